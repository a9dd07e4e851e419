//! The dispatcher: one state machine that alone owns the registry, the queue and every
//! live request.
//!
//! It is pure: [`Dispatcher::handle`] takes an [`Event`] and the current time and returns
//! [`Action`]s; [`Dispatcher::tick`] fires whatever deadlines have passed. No sockets, no
//! threads, no clock of its own, so every routing, queueing, requeue, timeout and drain
//! rule is unit-tested by feeding events with a fake clock (see `tests.rs`). The thread
//! that runs it and turns actions into channel sends lives in `runtime.rs`.
//!
//! | file | part of the machine |
//! |---|---|
//! | `mod.rs` | events, actions, the state, `handle`/`tick` |
//! | `requests.rs` | submit, queue, dispatch, complete, cancel, request timeouts |
//! | `workers.rs` | register, messages, heartbeats, loss and requeue, drain |
//! | `shutdown.rs` | server drain and exit |
//! | `fair_queue.rs` | the wait queue: priority classes, aging, fair share by tenant |
//! | `outliers.rs` | backends reported down, outlier ejection, failover targets |
//! | `relays.rs` | workers serving several relays: `load` reports, `busy` answers |
//! | `routing.rs` | which worker takes a request: one ranked choice (capability, health, loaded model, cache affinity, least load, round robin) |
//! | `affinity.rs` | which prompt prefixes each worker was sent lately (bounded LRU) |
//! | `sleepers.rs` | sleeping boxes: whom to wake for a request, when to give up |
//! | `continuation.rs` | a streamed answer whose worker died, finished on another one |
//! | `pieces.rs` | a request body sent in pieces after dispatch, on the worker's credit |
//! | `registry.rs`, `stats.rs` | the other data it owns |

pub mod affinity;
mod attach;
mod config;
mod continuation;
pub mod fair_queue;
pub mod ids;
pub mod lifecycle;
mod outliers;
mod pieces;
mod registry;
mod relay_affinity;
mod relays;
pub mod reply;
mod requests;
pub mod routing;
pub mod runtime;
mod shutdown;
pub mod sleepers;
mod stats;
#[cfg(test)]
mod tests;
mod workers;

use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::protocol::{
    HeaderMap, RegisterAck, RegisterMessage, RequestMessage, ResponseComplete, ServerMessage,
    WorkerMessage,
};
use crate::server::fingerprint::Fingerprints;
pub use config::{Config, DEFAULT_AFFINITY_WAIT_MS};
pub use fair_queue::{FairQueue, Place, Priority, Who, DEFAULT_TENANT};
use ids::IdMap;
pub use ids::{parse_request_id, wire_request_id};
pub use outliers::Health;
pub use registry::Needs;
pub use registry::{sanitize_models, DrainState, Registry, Worker, WorkerId};
pub use sleepers::{SavedPower, SleeperRecord, WakeConfig};
pub use stats::{Counters, Gauges, LiveLoad};

/// Internal request key; the wire id is [`wire_request_id`] of it.
pub type RequestId = u64;

/// Something that happened, delivered to the dispatcher by the socket threads.
#[derive(Debug)]
pub enum Event {
    /// A client request, already parsed; `msg.request_id` is `wire_request_id(id)`.
    Submit {
        id: RequestId,
        msg: Arc<RequestMessage>,
        who: Who,
        /// What the model must be able to do (images in, embeddings).
        needs: Needs,
        /// Its prompt's prefix fingerprints (cache affinity), never its text.
        prints: Fingerprints,
        /// Send [`ClientEvent::Queued`] about once a second while it waits.
        progress: bool,
        /// A streamed answer that may be finished on another worker when its own dies
        /// ([`ClientEvent::Interrupted`]).
        continuable: bool,
    },
    /// The client's answer to [`ClientEvent::Interrupted`]: the request that goes on
    /// from the text delivered (`continuation` set), or `None` when it cannot.
    Continue {
        id: RequestId,
        msg: Option<Arc<RequestMessage>>,
    },
    /// A client resumes a stream this relay does not hold: ask the workers that hold
    /// streams ([`attach`]).
    Attach {
        id: RequestId,
        msg: crate::protocol::held::Attach,
    },
    /// The client hung up before its answer was complete.
    ClientGone(RequestId),
    /// One piece of a request body that follows its request (`protocol::pieces`), sent
    /// by the client's thread on the worker's [`ClientEvent::Credit`].
    BodyPiece {
        id: RequestId,
        seq: u64,
        chunk: String,
        last: bool,
    },
    /// The client's thread wrote a binary answer's chunks: the worker may send those
    /// numbered below `until` (`protocol::pieces::FEATURE_ANSWER_CREDIT`).
    AnswerCredit { id: RequestId, until: u64 },
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
    /// Send a Wake-on-LAN magic packet from the relay (`WAKE_FROM_RELAY`) to wake the
    /// named box.
    SendWake(String, crate::power::WakeAddress),
    /// Shutdown finished: the process may exit.
    Exit,
}

/// What a waiting client connection receives.
#[derive(Debug, Clone, PartialEq)]
pub enum ClientEvent {
    /// The request reached a worker after waiting this long. Sent just before the
    /// next event for the request, and again after a requeue.
    Dispatched {
        queue_wait: Duration,
        worker: String,
    },
    /// Still waiting (only for requests that asked for progress): how many go
    /// before it and a guess of the wait left.
    Queued { position: usize, eta_ms: u64 },
    /// The backend's headers of a streamed answer, before its first chunk.
    Head(HeaderMap),
    /// Still waiting (only for requests that asked for progress): for this sleeping
    /// box to wake up.
    Waking { worker: String },
    /// A piece of the streamed body, to be written as-is.
    Chunk(String),
    /// The worker takes the request body's pieces numbered below this
    /// (`protocol::pieces`). Not final.
    Credit(u64),
    /// The worker streaming a continuable answer died (or its backend failed) midway;
    /// the request waits for the client's [`Event::Continue`]. Not final.
    Interrupted,
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
    /// The whole queue is at `MAX_QUEUE_LEN`.
    QueueFull(Backpressure),
    /// The caller's tenant has `MAX_QUEUE_PER_TENANT` waiting.
    TenantQueueFull(Backpressure),
    QueueTimeout,
    /// Every worker serving the model has its backend down or is ejected.
    NoHealthyWorker {
        retry_after_secs: u32,
    },
    RequestTimeout,
    RequeueExhausted,
    ModelNotFound {
        model: String,
        available: Vec<String>,
    },
    /// Every worker serving the model says it lacks what the request needs.
    UnsupportedCapability {
        model: String,
        capability: &'static str,
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
    /// Only a sleeping box serves the model, and it did not come back (or nothing could
    /// wake it): `detail` says which.
    Asleep {
        worker: String,
        detail: String,
    },
}

impl Failure {
    /// Stable machine code, also the `code` field of the client's error body.
    pub fn code(&self) -> &'static str {
        match self {
            Failure::QueueFull(_) => "queue_full",
            Failure::TenantQueueFull(_) => "tenant_queue_full",
            Failure::QueueTimeout => "queue_timeout",
            Failure::NoHealthyWorker { .. } => "no_healthy_worker",
            Failure::RequestTimeout => "request_timeout",
            Failure::RequeueExhausted => "requeue_exhausted",
            Failure::ModelNotFound { .. } => "model_not_found",
            Failure::UnsupportedCapability { .. } => "unsupported_capability",
            Failure::ShuttingDown => "server_shutting_down",
            Failure::WorkerError { .. } => "worker_error",
            Failure::WorkerLost => "worker_disconnected",
            Failure::ClientGone => "client_closed_request",
            Failure::Asleep { .. } => "worker_asleep",
        }
    }
}

/// What a client refused for a full queue is told, so it can back off sensibly.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Backpressure {
    /// Seconds until the queue has likely drained (depth ÷ recent completion rate).
    pub retry_after_secs: u32,
    pub queue_depth: usize,
    pub avg_wait_ms: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Timer {
    Request(RequestId),
    /// Time to tell a waiting client where it stands.
    Progress(RequestId),
    /// A request's wait for its full cached worker is over.
    AffinityWait(RequestId),
    /// An ejected worker's time is up.
    Readmit(WorkerId),
    WorkerSilent(WorkerId),
    WorkerDrain(WorkerId),
    /// A model operation's time is up.
    Task(u64),
    /// A box being woken did not come back in time.
    Wake(u64),
    Ping,
    /// The drain grace is over: drain now.
    Grace,
    Shutdown,
}

#[derive(Debug)]
enum Stage {
    Queued,
    InFlight { worker: WorkerId, streamed: bool },
}

/// Whether a request waits for the full worker that holds its prompt prefix.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Hold {
    /// It has not waited; it may, once.
    Never,
    /// It waits for `worker` until `until` (`AFFINITY_WAIT_MS` after it began); other
    /// workers pass over it meanwhile, without it losing its place in the queue.
    For { worker: WorkerId, until: Instant },
    /// It waited already: it goes wherever routing sends it.
    Done,
}

#[derive(Debug)]
struct Request {
    msg: Arc<RequestMessage>,
    who: Who,
    needs: Needs,
    prints: Fingerprints,
    hold: Hold,
    arrived: Instant,
    /// The queue timeout counts from arrival; a requeue never extends it.
    queue_deadline: Instant,
    /// Where it stood in the queue, kept so a requeue puts it back there.
    place: Option<Place>,
    progress: bool,
    /// When its pending progress note is due (one chain of them per request).
    progress_at: Option<Instant>,
    requeues: u32,
    /// Workers this request failed on before their backend answered (failover).
    failed_on: Vec<WorkerId>,
    /// The backend's own answer from the last attempt that failed over with one: the
    /// client gets it if no later attempt gets an answer of its own.
    last_answer: Option<ResponseComplete>,
    stage: Stage,
    /// When the request times out (queue wait, or silence while in flight).
    deadline: Instant,
    /// Where its timer entry sits; chunks move `deadline` without touching the timer
    /// set, and the timer re-arms itself when it fires early.
    timer_at: Instant,
    /// The latest dispatch, not yet told to the client. It rides along with the next
    /// event for that client, so a dispatch does not wake the connection thread on its
    /// own (one context switch less per request; the client needs it only for headers
    /// and the access log).
    untold_dispatch: Option<ClientEvent>,
    /// The sleeping box it waits for (its queue deadline then is the wake's).
    waking_for: Option<String>,
    /// May be finished on another worker if its stream breaks (see `continuation.rs`).
    continuable: bool,
    /// Interrupted: waiting for [`Event::Continue`] (queued, but not in the queue).
    interrupted: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Running,
    ShuttingDown,
    Done,
}

/// The state machine. See the module docs.
pub struct Dispatcher {
    cfg: Config,
    started: Instant,
    registry: Registry,
    queue: FairQueue,
    /// When recent requests finished, for the drain rate behind `Retry-After`.
    recent_done: std::collections::VecDeque<Instant>,
    requests: IdMap<Request>,
    timers: BTreeSet<(Instant, Timer)>,
    /// When each model was last advertised by some worker (for fast 404s on typos).
    model_seen: HashMap<String, Instant>,
    phase: Phase,
    /// The drain timeout of a shutdown waiting out its grace (see `shutdown.rs`).
    grace_pending: Option<Duration>,
    counters: Counters,
    actions: Vec<Action>,
    models_version: u64,
    /// Model operations (load, unload, flush) and their progress.
    tasks: lifecycle::Tasks,
    /// Which prompt prefixes each worker was sent lately, and who waits for whom.
    affinity: affinity::Affinity,
    /// Boxes asleep, and the wake under way for each.
    sleepers: sleepers::Sleepers,
    next_wake_seq: u64,
    /// Resumes of streams held on workers, under way ([`attach`]).
    attaches: IdMap<attach::Attaching>,
}

impl Dispatcher {
    pub fn new(cfg: Config, now: Instant) -> Dispatcher {
        let mut d = Dispatcher {
            timers: BTreeSet::new(),
            started: now,
            registry: Registry::default(),
            queue: FairQueue::new(Some(cfg.priority_aging)),
            recent_done: std::collections::VecDeque::new(),
            requests: IdMap::default(),
            model_seen: HashMap::new(),
            phase: Phase::Running,
            grace_pending: None,
            counters: Counters::default(),
            actions: Vec::new(),
            models_version: 0,
            tasks: lifecycle::Tasks::default(),
            affinity: affinity::Affinity::default(),
            sleepers: sleepers::Sleepers::default(),
            next_wake_seq: 0,
            attaches: IdMap::default(),
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
            relays: self.relays_reported(),
        }
    }

    /// Tenant → (queued, in flight), for tenants with either.
    pub fn tenant_loads(&self) -> std::collections::BTreeMap<String, (usize, usize)> {
        let mut loads: std::collections::BTreeMap<String, (usize, usize)> = self
            .queue
            .tenants()
            .map(|(t, n)| (t.to_string(), (n, 0)))
            .collect();
        for req in self.requests.values() {
            if matches!(req.stage, Stage::InFlight { .. }) {
                loads.entry(req.who.tenant.to_string()).or_default().1 += 1;
            }
        }
        loads
    }

    /// In flight per worker and model, queued per model, tokens per model.
    pub fn live_load(&self) -> LiveLoad {
        let mut load = LiveLoad {
            tokens: self.counters.tokens.clone(),
            ..LiveLoad::default()
        };
        for w in self.registry.iter() {
            load.workers.entry(w.name.clone()).or_default();
        }
        for req in self.requests.values() {
            let model = &req.msg.model;
            match req.stage {
                Stage::Queued => *load.queued.entry(model.clone()).or_default() += 1,
                Stage::InFlight { worker, .. } => {
                    if let Some(w) = self.registry.get(worker) {
                        let models = load.workers.entry(w.name.clone()).or_default();
                        *models.entry(model.clone()).or_default() += 1;
                    }
                }
            }
        }
        load
    }

    pub fn counters(&self) -> &Counters {
        &self.counters
    }

    pub fn registry(&self) -> &Registry {
        &self.registry
    }

    /// Prompt-prefix fingerprints held for a worker (`/admin/workers`).
    pub fn fingerprints_held(&self, worker: WorkerId) -> usize {
        self.affinity.held(worker)
    }

    /// Bumped whenever the routable model set may have changed.
    pub fn models_version(&self) -> u64 {
        self.models_version
    }

    /// Applies one event.
    pub fn handle(&mut self, event: Event, now: Instant) -> Vec<Action> {
        self.apply(event, now);
        std::mem::take(&mut self.actions)
    }

    /// [`handle`](Self::handle), its actions appended to `out`: the runtime keeps one
    /// buffer across events instead of a new vector for each.
    pub fn handle_into(&mut self, event: Event, now: Instant, out: &mut Vec<Action>) {
        self.apply(event, now);
        self.hand_over(out);
    }

    /// Moves the pending actions to `out`, keeping the vector's room for the next event
    /// unless a burst (a shutdown failing thousands of requests) left it large.
    fn hand_over(&mut self, out: &mut Vec<Action>) {
        out.append(&mut self.actions);
        shrink_after_burst(&mut self.actions);
    }

    fn apply(&mut self, event: Event, now: Instant) {
        match event {
            Event::Submit {
                id,
                msg,
                who,
                needs,
                prints,
                progress,
                continuable,
            } => {
                self.submit(id, msg, who, needs, prints, progress, now);
                self.mark_continuable(id, continuable);
            }
            Event::Continue { id, msg } => self.continue_with(id, msg, now),
            Event::Attach { id, msg } => self.attach(id, msg),
            Event::ClientGone(id) => {
                if !self.attach_gone(id) {
                    self.client_gone(id, now)
                }
            }
            Event::BodyPiece {
                id,
                seq,
                chunk,
                last,
            } => self.body_piece(id, seq, chunk, last, now),
            Event::AnswerCredit { id, until } => self.answer_credit(id, until),
            Event::WorkerJoined {
                id,
                register,
                remote,
            } => self.worker_joined(id, register, remote, now),
            Event::WorkerSaid(id, msg) => self.worker_said(id, msg, now),
            Event::WorkerLeft { id, reason } => self.worker_left(id, &reason, now),
            Event::DrainWorker { id, timeout } => self.drain_worker(id, timeout, now),
            Event::RefreshModels => self.refresh_models(),
            Event::Shutdown { timeout } => self.shutdown_requested(timeout, now),
        }
    }

    /// Fires every deadline at or before `now`.
    pub fn tick(&mut self, now: Instant) -> Vec<Action> {
        self.fire_due(now);
        std::mem::take(&mut self.actions)
    }

    /// [`tick`](Self::tick), its actions appended to `out`.
    pub fn tick_into(&mut self, now: Instant, out: &mut Vec<Action>) {
        self.fire_due(now);
        self.hand_over(out);
    }

    fn fire_due(&mut self, now: Instant) {
        while let Some(&(at, timer)) = self.timers.first() {
            if at > now {
                break;
            }
            self.timers.remove(&(at, timer));
            match timer {
                Timer::Request(id) => self.request_deadline(id, now),
                Timer::Progress(id) => self.tell_progress(id, now),
                Timer::AffinityWait(id) => self.hold_expired(id, now),
                Timer::Readmit(id) => self.readmit(id, now),
                Timer::WorkerSilent(id) => self.heartbeat_expired(id),
                Timer::WorkerDrain(id) => self.close_worker(id, "drain timeout reached", now),
                Timer::Task(number) => self.task_timed_out(number, now),
                Timer::Wake(seq) => self.wake_expired(seq, now),
                Timer::Ping => self.ping_all(now),
                Timer::Grace => self.grace_over(now),
                Timer::Shutdown => self.shutdown_deadline(),
            }
        }
    }
}

/// Room an emptied action buffer keeps: what an ordinary batch needs, so memory taken
/// by a burst goes back once it is over.
const KEPT_ACTIONS: usize = 256;

/// Gives back the room of an empty vector that a burst made large.
pub(super) fn shrink_after_burst(actions: &mut Vec<Action>) {
    if actions.capacity() > KEPT_ACTIONS {
        actions.shrink_to(KEPT_ACTIONS / 4);
    }
}

pub(super) fn unix_ms() -> Option<u64> {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .ok()
        .map(|d| d.as_millis() as u64)
}
