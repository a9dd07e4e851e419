//! The dispatcher: one state machine that alone owns the registry, the queue and every
//! live request.
//!
//! It is pure: [`Dispatcher::handle`] takes an [`Event`] and the current time and returns
//! [`Action`]s; [`Dispatcher::tick`] fires whatever deadlines have passed. No sockets, no
//! threads, no clock of its own, so every routing, queueing, requeue, timeout and drain
//! rule is unit-tested by feeding events with a fake clock (see `tests.rs`). The thread
//! that runs it and turns actions into channel sends lives in `runtime.rs`.

mod queue;
mod registry;
pub mod runtime;
#[cfg(test)]
mod tests;

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use log::{debug, info, warn};

use crate::protocol::{
    self, CancelReason, RegisterAck, RegisterMessage, RequestMessage, ResponseComplete,
    ServerMessage, WorkerMessage,
};
use crate::server::metrics::Histogram;
pub use queue::Queue;
pub use registry::{sanitize_models, DrainState, Registry, Worker, WorkerId};

/// Internal request key; the wire id is [`wire_request_id`] of it.
pub type RequestId = u64;

/// Renders a request id as sent on the wire and in `X-Request-Id`.
pub fn wire_request_id(id: RequestId) -> String {
    format!("r-{id:016x}")
}

/// Parses a wire request id back; foreign ids are `None`.
pub fn parse_request_id(wire: &str) -> Option<RequestId> {
    let hex = wire.strip_prefix("r-")?;
    if hex.len() != 16 {
        return None;
    }
    u64::from_str_radix(hex, 16).ok()
}

/// Tunables, mostly from the environment.
#[derive(Debug, Clone)]
pub struct Config {
    pub max_queue_len: usize,
    pub queue_timeout: Duration,
    pub request_timeout: Duration,
    pub heartbeat_interval: Duration,
    pub heartbeat_timeout: Duration,
    pub max_requeues: u32,
    pub max_models_per_worker: usize,
}

impl Default for Config {
    fn default() -> Config {
        Config {
            max_queue_len: 100,
            queue_timeout: Duration::from_secs(30),
            request_timeout: Duration::from_secs(300),
            heartbeat_interval: Duration::from_secs(15),
            heartbeat_timeout: Duration::from_secs(45),
            max_requeues: 3,
            max_models_per_worker: 256,
        }
    }
}

/// Something that happened, delivered to the dispatcher by the socket threads.
#[derive(Debug)]
pub enum Event {
    /// A client request, already parsed; `msg.request_id` is `wire_request_id(id)`.
    Submit {
        id: RequestId,
        msg: Arc<RequestMessage>,
    },
    /// The client hung up before its answer was complete.
    ClientGone(RequestId),
    /// A worker socket authenticated and sent `register`.
    WorkerJoined {
        id: WorkerId,
        register: RegisterMessage,
        remote: String,
    },
    /// A registered worker sent a message.
    WorkerSaid(WorkerId, WorkerMessage),
    /// A worker socket closed or failed.
    WorkerLeft { id: WorkerId, reason: String },
    /// Operator asks one worker to drain (`graceful_shutdown`, close when idle).
    DrainWorker {
        id: WorkerId,
        timeout: Option<Duration>,
    },
    /// Operator asks every worker to re-advertise its models.
    RefreshModels,
    /// The server is stopping: refuse new work, let in-flight finish until `timeout`.
    Shutdown { timeout: Duration },
}

/// What the runtime must do.
#[derive(Debug, Clone, PartialEq)]
pub enum Action {
    /// Send a message on a worker's socket.
    ToWorker(WorkerId, ServerMessage),
    /// Close a worker's socket (already removed from the registry).
    CloseWorker(WorkerId, String),
    /// Deliver to the waiting client; `Complete` and `Failed` are final.
    ToClient(RequestId, ClientEvent),
    /// Shutdown finished: the process may exit.
    Exit,
}

/// What a waiting client connection receives.
#[derive(Debug, Clone, PartialEq)]
pub enum ClientEvent {
    /// The request reached a worker after waiting this long (sent again on requeue).
    Dispatched {
        queue_wait: Duration,
        worker: String,
    },
    /// A piece of the streamed body, to be written as-is.
    Chunk(String),
    /// The worker finished; final.
    Complete(ResponseComplete),
    /// The request failed; final.
    Failed(Failure),
}

impl ClientEvent {
    pub fn is_final(&self) -> bool {
        matches!(self, ClientEvent::Complete(_) | ClientEvent::Failed(_))
    }
}

/// Why a request failed, mapped to an HTTP status and error body by the HTTP layer.
#[derive(Debug, Clone, PartialEq)]
pub enum Failure {
    QueueFull,
    QueueTimeout,
    RequestTimeout,
    RequeueExhausted,
    ModelNotFound {
        model: String,
        available: Vec<String>,
    },
    ShuttingDown,
    /// The worker reported an error for this request.
    WorkerError {
        status: Option<u16>,
        code: String,
        message: String,
    },
    /// The worker vanished after part of the stream reached the client.
    WorkerLost,
    /// The client went away (never written anywhere; closes the bookkeeping).
    ClientGone,
}

impl Failure {
    /// Stable machine code, also the `code` field of the client's error body.
    pub fn code(&self) -> &'static str {
        match self {
            Failure::QueueFull => "queue_full",
            Failure::QueueTimeout => "queue_timeout",
            Failure::RequestTimeout => "request_timeout",
            Failure::RequeueExhausted => "requeue_exhausted",
            Failure::ModelNotFound { .. } => "model_not_found",
            Failure::ShuttingDown => "server_shutting_down",
            Failure::WorkerError { .. } => "worker_error",
            Failure::WorkerLost => "worker_disconnected",
            Failure::ClientGone => "client_closed_request",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Timer {
    Request(RequestId),
    WorkerSilent(WorkerId),
    WorkerDrain(WorkerId),
    Ping,
    Shutdown,
}

#[derive(Debug)]
enum Stage {
    Queued,
    InFlight { worker: WorkerId, streamed: bool },
}

#[derive(Debug)]
struct Request {
    msg: Arc<RequestMessage>,
    arrived: Instant,
    requeues: u32,
    stage: Stage,
    /// When the request times out (queue wait, or silence while in flight).
    deadline: Instant,
    /// Where its timer entry sits; chunks move `deadline` without touching the timer
    /// set, and the timer re-arms itself when it fires early.
    timer_at: Instant,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Running,
    ShuttingDown,
    Done,
}

/// Request outcomes, for `/metrics`, `/admin/stats` and tests.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct Counters {
    pub completed: u64,
    pub failed: u64,
    pub cancelled: u64,
    pub requeued: u64,
    pub dispatched: u64,
    pub heartbeat_timeouts: u64,
    /// Failure code (see [`Failure::code`]) → count.
    pub failed_by: BTreeMap<&'static str, u64>,
    /// Cancel reason sent to workers (or `client_disconnect` while queued) → count.
    pub cancelled_by: BTreeMap<&'static str, u64>,
    /// Model → (prompt tokens, completion tokens) reported by workers.
    pub tokens: BTreeMap<String, (u64, u64)>,
    pub queue_wait: Histogram,
    /// The most recent queue waits, for percentiles.
    pub recent_waits: VecDeque<Duration>,
}

const RECENT_WAITS: usize = 1024;

impl Counters {
    fn failed(&mut self, f: &Failure) {
        self.failed += 1;
        *self.failed_by.entry(f.code()).or_default() += 1;
    }

    fn cancelled(&mut self, reason: CancelReason) {
        self.cancelled += 1;
        *self.cancelled_by.entry(reason.as_str()).or_default() += 1;
    }

    fn waited(&mut self, wait: Duration) {
        self.queue_wait.observe(wait);
        if self.recent_waits.len() == RECENT_WAITS {
            self.recent_waits.pop_front();
        }
        self.recent_waits.push_back(wait);
    }

    /// Percentile (0–100) of the recent queue waits.
    pub fn wait_percentile(&self, pct: usize) -> Duration {
        let mut v: Vec<Duration> = self.recent_waits.iter().copied().collect();
        v.sort_unstable();
        v.get((v.len() * pct / 100).min(v.len().saturating_sub(1)))
            .copied()
            .unwrap_or_default()
    }
}

/// Gauges the HTTP threads read for `/health`.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Gauges {
    pub workers: usize,
    pub queue_depth: usize,
    pub in_flight: usize,
}

/// The state machine. See the module docs.
pub struct Dispatcher {
    cfg: Config,
    started: Instant,
    registry: Registry,
    queue: Queue,
    requests: HashMap<RequestId, Request>,
    timers: BTreeSet<(Instant, Timer)>,
    /// When each model was last advertised by some worker (for fast 404s on typos).
    model_seen: HashMap<String, Instant>,
    phase: Phase,
    counters: Counters,
    actions: Vec<Action>,
    models_version: u64,
}

impl Dispatcher {
    pub fn new(cfg: Config, now: Instant) -> Dispatcher {
        let mut d = Dispatcher {
            timers: BTreeSet::new(),
            started: now,
            registry: Registry::default(),
            queue: Queue::default(),
            requests: HashMap::new(),
            model_seen: HashMap::new(),
            phase: Phase::Running,
            counters: Counters::default(),
            actions: Vec::new(),
            models_version: 0,
            cfg,
        };
        d.timers
            .insert((now + d.cfg.heartbeat_interval, Timer::Ping));
        d
    }

    /// The earliest pending deadline: the runtime sleeps until then or the next event.
    pub fn next_deadline(&self) -> Option<Instant> {
        self.timers.first().map(|(t, _)| *t)
    }

    pub fn gauges(&self) -> Gauges {
        Gauges {
            workers: self.registry.len(),
            queue_depth: self.queue.len(),
            in_flight: self.requests.len() - self.queue.len(),
        }
    }

    pub fn counters(&self) -> &Counters {
        &self.counters
    }

    pub fn registry(&self) -> &Registry {
        &self.registry
    }

    /// Bumped whenever the routable model set may have changed.
    pub fn models_version(&self) -> u64 {
        self.models_version
    }

    /// Applies one event.
    pub fn handle(&mut self, event: Event, now: Instant) -> Vec<Action> {
        match event {
            Event::Submit { id, msg } => self.submit(id, msg, now),
            Event::ClientGone(id) => self.client_gone(id, now),
            Event::WorkerJoined {
                id,
                register,
                remote,
            } => self.worker_joined(id, register, remote, now),
            Event::WorkerSaid(id, msg) => self.worker_said(id, msg, now),
            Event::WorkerLeft { id, reason } => self.worker_left(id, &reason, now),
            Event::DrainWorker { id, timeout } => self.drain_worker(id, timeout, now),
            Event::RefreshModels => self.refresh_models(),
            Event::Shutdown { timeout } => self.shutdown(timeout, now),
        }
        std::mem::take(&mut self.actions)
    }

    /// Fires every deadline at or before `now`.
    pub fn tick(&mut self, now: Instant) -> Vec<Action> {
        while let Some(&(at, timer)) = self.timers.first() {
            if at > now {
                break;
            }
            self.timers.remove(&(at, timer));
            match timer {
                Timer::Request(id) => self.request_deadline(id, now),
                Timer::WorkerSilent(id) => self.heartbeat_expired(id),
                Timer::WorkerDrain(id) => self.close_worker(id, "drain timeout reached", now),
                Timer::Ping => self.ping_all(now),
                Timer::Shutdown => self.shutdown_deadline(),
            }
        }
        std::mem::take(&mut self.actions)
    }

    // ----- client side -----

    fn submit(&mut self, id: RequestId, msg: Arc<RequestMessage>, now: Instant) {
        if self.phase != Phase::Running {
            return self.fail(id, Failure::ShuttingDown);
        }
        if self.model_is_unknown(&msg.model, now) {
            let available = self.registry.routable_models();
            info!(
                "request {} rejected: model `{}` not found",
                msg.request_id, msg.model
            );
            let model = msg.model.clone();
            return self.fail(id, Failure::ModelNotFound { model, available });
        }
        if let Some(worker) = self.registry.pick(&msg.model) {
            let deadline = now + self.cfg.request_timeout;
            self.requests.insert(
                id,
                Request {
                    msg,
                    arrived: now,
                    requeues: 0,
                    stage: Stage::Queued,
                    deadline,
                    timer_at: deadline,
                },
            );
            return self.assign(id, worker, now);
        }
        if self.queue.len() >= self.cfg.max_queue_len {
            warn!(
                "queue full ({} waiting): request {} rejected",
                self.queue.len(),
                msg.request_id
            );
            return self.fail(id, Failure::QueueFull);
        }
        debug!(
            "request {} queued for model `{}`",
            msg.request_id, msg.model
        );
        self.enqueue(id, msg, now, 0, now);
    }

    /// A model nobody advertised for a whole queue-timeout window (after the server has
    /// been up that long) fails fast instead of waiting in the queue.
    fn model_is_unknown(&self, model: &str, now: Instant) -> bool {
        let window = self.cfg.queue_timeout;
        if now.saturating_duration_since(self.started) <= window || self.registry.advertises(model)
        {
            return false;
        }
        match self.model_seen.get(model) {
            Some(seen) => now.saturating_duration_since(*seen) > window,
            None => true,
        }
    }

    fn enqueue(
        &mut self,
        id: RequestId,
        msg: Arc<RequestMessage>,
        arrived: Instant,
        requeues: u32,
        now: Instant,
    ) {
        let deadline = now + self.cfg.queue_timeout;
        self.queue.insert(id, arrived, msg.clone());
        self.requests.insert(
            id,
            Request {
                msg,
                arrived,
                requeues,
                stage: Stage::Queued,
                deadline,
                timer_at: deadline,
            },
        );
        self.timers.insert((deadline, Timer::Request(id)));
    }

    fn client_gone(&mut self, id: RequestId, now: Instant) {
        let Some(req) = self.requests.remove(&id) else {
            return;
        };
        self.unschedule(id, req.timer_at);
        self.counters.cancelled(CancelReason::ClientDisconnect);
        match req.stage {
            Stage::Queued => {
                self.queue.remove(id);
                info!(
                    "request {} cancelled while queued (client_disconnect)",
                    req.msg.request_id
                );
            }
            Stage::InFlight { worker, .. } => {
                info!(
                    "request {} cancelled (client_disconnect), worker w-{worker}",
                    req.msg.request_id
                );
                self.cancel_on_worker(
                    worker,
                    id,
                    &req.msg.request_id,
                    CancelReason::ClientDisconnect,
                    now,
                );
            }
        }
        self.reply(id, ClientEvent::Failed(Failure::ClientGone));
    }

    // ----- dispatch -----

    fn assign(&mut self, id: RequestId, worker: WorkerId, now: Instant) {
        let Some(req) = self.requests.get_mut(&id) else {
            return;
        };
        let Some(w) = self.registry.get_mut(worker) else {
            return;
        };
        w.in_flight.insert(id);
        let old = req.timer_at;
        req.deadline = now + self.cfg.request_timeout;
        req.timer_at = req.deadline;
        req.stage = Stage::InFlight {
            worker,
            streamed: false,
        };
        let (deadline, msg) = (req.deadline, req.msg.clone());
        let queue_wait = now.saturating_duration_since(req.arrived);
        self.timers.remove(&(old, Timer::Request(id)));
        self.timers.insert((deadline, Timer::Request(id)));
        self.counters.dispatched += 1;
        self.counters.waited(queue_wait);
        debug!(
            "request {} dispatched to {} ({})",
            msg.request_id, w.wire_id, w.name
        );
        let name = w.name.clone();
        self.actions
            .push(Action::ToWorker(worker, ServerMessage::Request(msg)));
        self.reply(
            id,
            ClientEvent::Dispatched {
                queue_wait,
                worker: name,
            },
        );
    }

    /// Gives a worker with free slots the oldest queued requests it can serve.
    fn fill_worker(&mut self, worker: WorkerId, now: Instant) {
        while !self.queue.is_empty() {
            let Some(w) = self.registry.get(worker) else {
                return;
            };
            if !w.has_free_slot() {
                return;
            }
            let Some(id) = self.queue.take_first(|model| w.serves(model)) else {
                return;
            };
            self.assign(id, worker, now);
        }
    }

    fn fill_all(&mut self, now: Instant) {
        for id in self.registry.ids() {
            if self.queue.is_empty() {
                return;
            }
            self.fill_worker(id, now);
        }
    }

    fn cancel_on_worker(
        &mut self,
        worker: WorkerId,
        id: RequestId,
        wire: &str,
        reason: CancelReason,
        now: Instant,
    ) {
        // The slot is freed now, whether or not the worker ever acknowledges the cancel:
        // the original worker never does, and waiting for it would leak capacity.
        if let Some(w) = self.registry.get_mut(worker) {
            w.in_flight.remove(&id);
        }
        let msg = ServerMessage::Cancel {
            request_id: wire.to_string(),
            reason,
        };
        self.actions.push(Action::ToWorker(worker, msg));
        self.after_slot_freed(worker, now);
    }

    /// Called whenever a worker may have gained a free slot: a drained worker that is now
    /// idle is closed, any other one takes queued work.
    fn after_slot_freed(&mut self, worker: WorkerId, now: Instant) {
        let Some(w) = self.registry.get(worker) else {
            return;
        };
        if w.drain == DrainState::DrainingCloseWhenIdle && w.in_flight.is_empty() {
            info!("worker {} ({}) drained", w.wire_id, w.name);
            self.close_worker(worker, "drained", now);
        } else {
            self.fill_worker(worker, now);
        }
        self.maybe_finish_shutdown();
    }

    fn reply(&mut self, id: RequestId, event: ClientEvent) {
        self.actions.push(Action::ToClient(id, event));
    }

    /// Fails a request that holds no worker slot (rejected, queued, or shutting down).
    fn fail(&mut self, id: RequestId, failure: Failure) {
        self.counters.failed(&failure);
        self.reply(id, ClientEvent::Failed(failure));
    }

    /// Ends a request that is in flight on `worker` (complete, error, timeout, loss).
    fn finish(&mut self, id: RequestId, event: ClientEvent, now: Instant) {
        let Some(req) = self.requests.remove(&id) else {
            return;
        };
        self.unschedule(id, req.timer_at);
        match &event {
            ClientEvent::Complete(rc) => {
                self.counters.completed += 1;
                if let Some(t) = &rc.token_counts {
                    let entry = self
                        .counters
                        .tokens
                        .entry(req.msg.model.clone())
                        .or_default();
                    entry.0 += t.prompt_tokens.unwrap_or(0);
                    entry.1 += t.completion_tokens.unwrap_or(0);
                }
            }
            ClientEvent::Failed(f) => self.counters.failed(f),
            _ => {}
        }
        self.reply(id, event);
        if let Stage::InFlight { worker, .. } = req.stage {
            if let Some(w) = self.registry.get_mut(worker) {
                w.in_flight.remove(&id);
            }
            self.after_slot_freed(worker, now);
        }
    }

    fn unschedule(&mut self, id: RequestId, deadline: Instant) {
        self.timers.remove(&(deadline, Timer::Request(id)));
    }

    /// Looks up a request that `worker` is currently serving. Messages about requests the
    /// worker does not hold (late, cancelled, or another worker's) are dropped.
    fn in_flight_on(&self, worker: WorkerId, wire: &str) -> Option<RequestId> {
        let id = parse_request_id(wire)?;
        match self.requests.get(&id)?.stage {
            Stage::InFlight { worker: w, .. } if w == worker => Some(id),
            _ => None,
        }
    }

    fn request_deadline(&mut self, id: RequestId, now: Instant) {
        let Some(req) = self.requests.get_mut(&id) else {
            return;
        };
        if req.deadline > now {
            // Pushed back by activity since this timer was set.
            req.timer_at = req.deadline;
            let deadline = req.deadline;
            self.timers.insert((deadline, Timer::Request(id)));
            return;
        }
        match req.stage {
            Stage::Queued => {
                info!("request {} failed: queue timeout", req.msg.request_id);
                self.queue.remove(id);
                self.requests.remove(&id);
                self.fail(id, Failure::QueueTimeout);
            }
            Stage::InFlight { worker, .. } => {
                let wire = req.msg.request_id.clone();
                info!("request {wire} timed out on worker w-{worker}; cancelling");
                self.counters.cancelled(CancelReason::Timeout);
                self.actions.push(Action::ToWorker(
                    worker,
                    ServerMessage::Cancel {
                        request_id: wire,
                        reason: CancelReason::Timeout,
                    },
                ));
                self.finish(id, ClientEvent::Failed(Failure::RequestTimeout), now);
            }
        }
    }

    // ----- worker side -----

    fn worker_joined(&mut self, id: WorkerId, reg: RegisterMessage, remote: String, now: Instant) {
        if !protocol::is_supported_version(reg.protocol_version.as_deref()) {
            let v = reg.protocol_version.unwrap_or_default();
            warn!(
                "worker `{}` from {remote} rejected: unsupported protocol version `{v}`",
                reg.worker_name
            );
            self.actions.push(Action::CloseWorker(
                id,
                format!("unsupported protocol version {v}"),
            ));
            return;
        }
        if self.phase != Phase::Running {
            self.actions
                .push(Action::CloseWorker(id, "server shutting down".into()));
            return;
        }
        let (models, warnings) = sanitize_models(reg.models, self.cfg.max_models_per_worker);
        for w in &warnings {
            warn!("worker `{}`: {w}", reg.worker_name);
        }
        let features = if reg
            .features
            .iter()
            .any(|f| f == protocol::FEATURE_WORKER_DRAIN)
        {
            vec![protocol::FEATURE_WORKER_DRAIN.to_string()]
        } else {
            Vec::new()
        };
        let version = reg
            .protocol_version
            .clone()
            .unwrap_or_else(|| protocol::PROTOCOL_VERSION.into());
        let name = if reg.worker_name.trim().is_empty() {
            "worker".to_string()
        } else {
            reg.worker_name
        };
        let mut worker = Worker::new(
            id,
            name,
            remote,
            models,
            reg.max_concurrent,
            reg.protocol_version,
            reg.features,
            now,
        );
        worker.set_reported_load(reg.current_load.unwrap_or(0));
        let ack = RegisterAck {
            worker_id: worker.wire_id.clone(),
            models: worker.models.clone(),
            warnings,
            protocol_version: Some(version),
            features,
        };
        info!(
            "worker registered: {} `{}` from {} models={:?} max_concurrent={}",
            worker.wire_id, worker.name, worker.remote, worker.models, worker.max_concurrent
        );
        self.note_models_seen(&worker.models, now);
        self.registry.insert(worker);
        self.timers
            .insert((now + self.cfg.heartbeat_timeout, Timer::WorkerSilent(id)));
        self.actions
            .push(Action::ToWorker(id, ServerMessage::RegisterAck(ack)));
        self.fill_worker(id, now);
    }

    fn note_models_seen(&mut self, models: &[String], now: Instant) {
        for m in models {
            self.model_seen.insert(m.clone(), now);
        }
        self.models_version += 1;
    }

    fn worker_said(&mut self, worker: WorkerId, msg: WorkerMessage, now: Instant) {
        let Some(w) = self.registry.get_mut(worker) else {
            return;
        };
        let (old_seen, name) = (w.last_seen, w.wire_id.clone());
        w.last_seen = now;
        self.timers.remove(&(
            old_seen + self.cfg.heartbeat_timeout,
            Timer::WorkerSilent(worker),
        ));
        self.timers.insert((
            now + self.cfg.heartbeat_timeout,
            Timer::WorkerSilent(worker),
        ));
        match msg {
            WorkerMessage::ResponseChunk { request_id, chunk } => {
                self.on_chunk(worker, &request_id, chunk, now)
            }
            WorkerMessage::ResponseComplete(rc) => {
                if let Some(id) = self.in_flight_on(worker, &rc.request_id) {
                    debug!(
                        "request {} complete: status {}",
                        rc.request_id, rc.status_code
                    );
                    self.finish(id, ClientEvent::Complete(rc), now);
                }
            }
            WorkerMessage::Error {
                request_id,
                code,
                message,
                status_code,
            } => {
                let Some(wire) = request_id else {
                    warn!("worker {name} reported: {code}: {message}");
                    return;
                };
                if let Some(id) = self.in_flight_on(worker, &wire) {
                    info!("request {wire} failed on worker {name}: {code}: {message}");
                    let failure = Failure::WorkerError {
                        status: status_code,
                        code,
                        message,
                    };
                    self.finish(id, ClientEvent::Failed(failure), now);
                }
            }
            WorkerMessage::Pong { current_load, .. } => {
                if let Some(w) = self.registry.get_mut(worker) {
                    w.set_reported_load(current_load);
                }
                self.fill_worker(worker, now);
            }
            WorkerMessage::ModelsUpdate {
                models,
                current_load,
            } => self.models_update(worker, models, current_load, now),
            WorkerMessage::WorkerDraining {} => {
                if let Some(w) = self.registry.get_mut(worker) {
                    info!("worker {} ({}) is draining", w.wire_id, w.name);
                    w.drain = DrainState::DrainingByWorker;
                    self.models_version += 1;
                }
            }
            WorkerMessage::Register(_) => warn!("worker {name} sent a second register; ignored"),
            WorkerMessage::Unknown(kind) => {
                debug!("worker {name} sent unknown message type `{kind}`; ignored")
            }
        }
    }

    fn on_chunk(&mut self, worker: WorkerId, wire: &str, chunk: String, now: Instant) {
        let Some(id) = self.in_flight_on(worker, wire) else {
            debug!("dropping late chunk for {wire}");
            return;
        };
        let Some(req) = self.requests.get_mut(&id) else {
            return;
        };
        if let Stage::InFlight { streamed, .. } = &mut req.stage {
            *streamed = true;
        }
        // Every chunk restarts the silence timer; the timer entry is moved lazily.
        req.deadline = now + self.cfg.request_timeout;
        self.reply(id, ClientEvent::Chunk(chunk));
    }

    fn models_update(&mut self, worker: WorkerId, models: Vec<String>, load: u32, now: Instant) {
        let Some(w) = self.registry.get_mut(worker) else {
            return;
        };
        let (models, warnings) = sanitize_models(models, self.cfg.max_models_per_worker);
        for warning in &warnings {
            warn!("worker {}: {warning}", w.wire_id);
        }
        info!("worker {} models updated: {:?}", w.wire_id, models);
        let dropped: Vec<String> = w
            .models
            .iter()
            .filter(|m| !models.contains(m))
            .cloned()
            .collect();
        w.set_models(models.clone());
        w.set_reported_load(load);
        self.note_models_seen(&dropped, now);
        self.note_models_seen(&models, now);
        self.fill_worker(worker, now);
    }

    fn heartbeat_expired(&mut self, worker: WorkerId) {
        let Some(w) = self.registry.get(worker) else {
            return;
        };
        let last_seen = w.last_seen;
        self.counters.heartbeat_timeouts += 1;
        warn!("worker {} ({}) heartbeat timed out", w.wire_id, w.name);
        self.close_worker(
            worker,
            "worker heartbeat timed out",
            last_seen + self.cfg.heartbeat_timeout,
        );
    }

    fn ping_all(&mut self, now: Instant) {
        let ts = unix_ms();
        for id in self.registry.ids() {
            self.actions.push(Action::ToWorker(
                id,
                ServerMessage::Ping {
                    timestamp_unix_ms: ts,
                },
            ));
        }
        self.timers
            .insert((now + self.cfg.heartbeat_interval, Timer::Ping));
    }

    fn worker_left(&mut self, worker: WorkerId, reason: &str, now: Instant) {
        if let Some(w) = self.registry.get(worker) {
            info!("worker {} ({}) disconnected: {reason}", w.wire_id, w.name);
            self.remove_worker(worker, now);
        }
    }

    /// Closes the socket of a registered worker and handles its requests as lost.
    fn close_worker(&mut self, worker: WorkerId, reason: &str, now: Instant) {
        if self.registry.get(worker).is_some() {
            self.actions
                .push(Action::CloseWorker(worker, reason.to_string()));
            self.remove_worker(worker, now);
        }
    }

    /// Drops a worker from the registry. Its requests are requeued when nothing reached
    /// the client yet (at most `max_requeues` times); a stream already under way is
    /// ended with an error instead, since another worker's answer cannot be spliced in.
    fn remove_worker(&mut self, worker: WorkerId, now: Instant) {
        let Some(w) = self.registry.remove(worker) else {
            return;
        };
        self.timers.remove(&(
            w.last_seen + self.cfg.heartbeat_timeout,
            Timer::WorkerSilent(worker),
        ));
        self.timers
            .retain(|(_, t)| *t != Timer::WorkerDrain(worker));
        self.note_models_seen(&w.models, now);
        let mut lost: Vec<RequestId> = w.in_flight.into_iter().collect();
        lost.sort_unstable();
        for id in lost {
            self.request_lost(id, now);
        }
        self.fill_all(now);
        self.maybe_finish_shutdown();
    }

    fn request_lost(&mut self, id: RequestId, now: Instant) {
        let Some(req) = self.requests.get(&id) else {
            return;
        };
        let streamed = matches!(req.stage, Stage::InFlight { streamed: true, .. });
        let wire = req.msg.request_id.clone();
        if streamed {
            info!("request {wire} failed: worker lost mid-stream");
            self.finish(id, ClientEvent::Failed(Failure::WorkerLost), now);
        } else if req.requeues >= self.cfg.max_requeues || self.phase != Phase::Running {
            info!("request {wire} failed: requeue exhausted");
            self.finish(id, ClientEvent::Failed(Failure::RequeueExhausted), now);
        } else if let Some(req) = self.requests.remove(&id) {
            self.unschedule(id, req.timer_at);
            self.counters.requeued += 1;
            info!("request {wire} requeued (attempt {})", req.requeues + 1);
            self.enqueue(id, req.msg, req.arrived, req.requeues + 1, now);
        }
    }

    fn drain_worker(&mut self, worker: WorkerId, timeout: Option<Duration>, now: Instant) {
        let Some(w) = self.registry.get_mut(worker) else {
            return;
        };
        w.drain = DrainState::DrainingCloseWhenIdle;
        info!("worker {} ({}) draining on request", w.wire_id, w.name);
        let msg = ServerMessage::GracefulShutdown {
            reason: Some("drain requested".into()),
            drain_timeout_secs: timeout.map(|t| t.as_secs()),
        };
        self.actions.push(Action::ToWorker(worker, msg));
        if let Some(t) = timeout {
            self.timers.insert((now + t, Timer::WorkerDrain(worker)));
        }
        self.models_version += 1;
        self.after_slot_freed(worker, now);
    }

    fn refresh_models(&mut self) {
        for id in self.registry.ids() {
            let msg = ServerMessage::ModelsRefresh {
                reason: Some("admin".into()),
            };
            self.actions.push(Action::ToWorker(id, msg));
        }
    }

    // ----- server shutdown -----

    fn shutdown(&mut self, timeout: Duration, now: Instant) {
        if self.phase != Phase::Running {
            return;
        }
        info!(
            "server shutting down: draining {} in-flight request(s)",
            self.gauges().in_flight
        );
        self.phase = Phase::ShuttingDown;
        for id in self.queue.drain_all() {
            if let Some(req) = self.requests.remove(&id) {
                self.unschedule(id, req.timer_at);
            }
            self.fail(id, Failure::ShuttingDown);
        }
        for id in self.registry.ids() {
            let msg = ServerMessage::GracefulShutdown {
                reason: Some("server_shutdown".into()),
                drain_timeout_secs: Some(timeout.as_secs()),
            };
            self.actions.push(Action::ToWorker(id, msg));
            if let Some(w) = self.registry.get_mut(id) {
                w.drain = DrainState::DrainingCloseWhenIdle;
            }
            self.after_slot_freed(id, now);
        }
        self.timers.insert((now + timeout, Timer::Shutdown));
        self.maybe_finish_shutdown();
    }

    fn shutdown_deadline(&mut self) {
        if self.phase != Phase::ShuttingDown {
            return;
        }
        let ids: Vec<RequestId> = self.requests.keys().copied().collect();
        for id in ids {
            let Some(req) = self.requests.remove(&id) else {
                continue;
            };
            if let Stage::InFlight { worker, .. } = req.stage {
                let msg = ServerMessage::Cancel {
                    request_id: req.msg.request_id.clone(),
                    reason: CancelReason::ServerShutdown,
                };
                self.counters.cancelled(CancelReason::ServerShutdown);
                self.actions.push(Action::ToWorker(worker, msg));
            }
            self.fail(id, Failure::ShuttingDown);
        }
        for id in self.registry.ids() {
            self.registry.remove(id);
            self.actions
                .push(Action::CloseWorker(id, "server shutting down".into()));
        }
        self.finish_shutdown();
    }

    fn maybe_finish_shutdown(&mut self) {
        if self.phase == Phase::ShuttingDown && self.requests.is_empty() {
            for id in self.registry.ids() {
                self.registry.remove(id);
                self.actions
                    .push(Action::CloseWorker(id, "server shutting down".into()));
            }
            self.finish_shutdown();
        }
    }

    fn finish_shutdown(&mut self) {
        self.phase = Phase::Done;
        self.timers.clear();
        info!("shutdown complete");
        self.actions.push(Action::Exit);
    }
}

fn unix_ms() -> Option<u64> {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .ok()
        .map(|d| d.as_millis() as u64)
}
