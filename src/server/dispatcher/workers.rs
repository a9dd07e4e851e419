//! Worker events: registration, messages, heartbeats, loss (with requeue) and drain.

use std::time::{Duration, Instant};

use log::{debug, info, warn};

use super::{
    sanitize_models, unix_ms, Action, ClientEvent, Dispatcher, DrainState, Failure, Phase,
    RegisterAck, RequestId, Stage, Timer, Worker, WorkerId,
};
use crate::protocol::{
    self, ModelInfoMap, RegisterMessage, ResponseComplete, ServerMessage, WorkerMessage,
};

/// A request is dispatched at most this often (first try plus failovers and requeues).
const MAX_ATTEMPTS: usize = 3;

impl Dispatcher {
    pub(super) fn worker_joined(
        &mut self,
        id: WorkerId,
        reg: RegisterMessage,
        remote: String,
        now: Instant,
    ) {
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
        // Extensions are offered only to workers that announced them.
        let features: Vec<String> = [
            protocol::FEATURE_WORKER_DRAIN,
            protocol::FEATURE_BACKEND_HEALTH,
            protocol::FEATURE_FAILOVER,
            protocol::FEATURE_RESPONSE_HEAD,
            protocol::power::FEATURE_WAKE_PEERS,
            protocol::power::FEATURE_SLEEP,
            protocol::power::FEATURE_OWNER_YIELD,
            protocol::FEATURE_LOAD_REPORTS,
            protocol::FEATURE_BUSY,
            protocol::affinity::FEATURE_AFFINITY_REPORTS,
            protocol::held::FEATURE_HELD_STREAMS,
            protocol::pieces::FEATURE_ANSWER_CREDIT,
            protocol::raw_bodies::FEATURE_RAW_BODIES,
        ]
        .into_iter()
        .filter(|f| reg.features.iter().any(|g| g == f))
        .map(String::from)
        .collect();
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
        worker.set_loaded(reg.loaded_models);
        worker.backend_kind = reg.backend_kind;
        worker.set_model_info(reg.model_info);
        worker.wake = reg.wake;
        worker.set_routes(reg.routes);
        self.box_awake(&mut worker, now);
        let heartbeat_interval_secs = worker
            .features
            .iter()
            .any(|f| f == protocol::FEATURE_HEARTBEAT_INTERVAL)
            .then(|| self.cfg.heartbeat_interval.as_secs().max(1));
        let ack = RegisterAck {
            worker_id: worker.wire_id.clone(),
            models: worker.models.clone(),
            warnings,
            protocol_version: Some(version),
            features,
            heartbeat_interval_secs,
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

    pub(super) fn note_models_seen(&mut self, models: &[String], now: Instant) {
        for m in models {
            self.model_seen.insert(m.clone(), now);
        }
        self.models_version += 1;
    }

    /// A worker's wire id for a log line (looked up when a line is written: the
    /// message path itself copies nothing).
    fn wire_name(&self, worker: WorkerId) -> &str {
        self.registry
            .get(worker)
            .map_or("?", |w| w.wire_id.as_str())
    }

    pub(super) fn worker_said(&mut self, worker: WorkerId, mut msg: WorkerMessage, now: Instant) {
        let Some(w) = self.registry.get_mut(worker) else {
            return;
        };
        let old_seen = w.last_seen;
        w.last_seen = now;
        self.timers.remove(&(
            old_seen + self.cfg.heartbeat_timeout,
            Timer::WorkerSilent(worker),
        ));
        self.timers.insert((
            now + self.cfg.heartbeat_timeout,
            Timer::WorkerSilent(worker),
        ));
        if !self.attaches.is_empty() && self.attach_said(worker, &mut msg) {
            return;
        }
        match msg {
            WorkerMessage::ResponseChunk { request_id, chunk } => {
                self.on_chunk(worker, &request_id, chunk, now)
            }
            WorkerMessage::ResponseHead {
                request_id,
                headers,
                ..
            } => {
                if let Some(id) = self.in_flight_on(worker, &request_id) {
                    let untold = self
                        .requests
                        .get_mut(&id)
                        .and_then(|r| r.untold_dispatch.take());
                    self.reply_after(id, untold, ClientEvent::Head(headers));
                }
            }
            WorkerMessage::ResponseComplete(rc) => {
                if let Some(id) = self.in_flight_on(worker, &rc.request_id) {
                    debug!(
                        "request {} complete: status {}",
                        rc.request_id, rc.status_code
                    );
                    self.note_outcome(worker, rc.status_code >= 500, now);
                    self.finish(id, ClientEvent::Complete(rc), now);
                }
            }
            WorkerMessage::Error {
                request_id,
                code,
                message,
                status_code,
                retryable,
                headers,
                body,
            } => {
                let Some(wire) = request_id else {
                    warn!(
                        "worker {} reported: {code}: {message}",
                        self.wire_name(worker)
                    );
                    return;
                };
                if let Some(id) = self.in_flight_on(worker, &wire) {
                    self.note_outcome(worker, status_code.is_none_or(|s| s >= 500), now);
                    // A stream broken midway may go on elsewhere (it streamed: no answer
                    // of the backend's own to give the client instead).
                    if self.interrupt(id, now) {
                        return;
                    }
                    // The backend's own answer, when the worker sent it along.
                    let answer =
                        body.zip(status_code)
                            .map(|(body, status_code)| ResponseComplete {
                                request_id: wire.clone(),
                                status_code,
                                headers,
                                body: Some(body),
                                token_counts: None,
                            });
                    if retryable == Some(true) && self.fail_over(id, worker, &code, now) {
                        if let (Some(req), Some(answer)) = (self.requests.get_mut(&id), answer) {
                            req.last_answer = Some(answer);
                        }
                        return;
                    }
                    info!(
                        "request {wire} failed on worker {}: {code}: {message}",
                        self.wire_name(worker)
                    );
                    let failure = Failure::WorkerError {
                        status: status_code,
                        code,
                        message,
                    };
                    // A backend answered: the client gets that answer, not ours.
                    let event = match answer {
                        Some(answer) => ClientEvent::Complete(answer),
                        None => self.answer_or(id, failure),
                    };
                    self.finish(id, event, now);
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
                loaded_models,
                model_info,
            } => self.models_update(worker, models, current_load, loaded_models, model_info, now),
            WorkerMessage::WorkerDraining {} => {
                if let Some(w) = self.registry.get_mut(worker) {
                    info!("worker {} ({}) is draining", w.wire_id, w.name);
                    w.drain = DrainState::DrainingByWorker;
                    self.models_version += 1;
                }
            }
            WorkerMessage::BackendStatus { state, reason } => {
                self.backend_status(worker, state, reason, now)
            }
            WorkerMessage::OperationStatus(status) => self.operation_status(worker, status, now),
            WorkerMessage::WorkerStatus(status) => {
                if let Some(w) = self.registry.get_mut(worker) {
                    w.set_status(status);
                }
            }
            WorkerMessage::SleepRequest {} => self.sleep_request(worker, now),
            WorkerMessage::OwnerStatus { busy } => self.owner_status(worker, busy, now),
            WorkerMessage::Load { in_flight } => self.worker_load(worker, in_flight, now),
            WorkerMessage::Busy {
                request_id,
                in_flight,
            } => self.worker_busy(worker, &request_id, in_flight, now),
            WorkerMessage::Relays { relays } => self.worker_relays(worker, relays),
            WorkerMessage::Prefixes(note) => self.worker_prefixes(worker, note),
            WorkerMessage::BodyCredit { request_id, until } => {
                self.body_credit(worker, &request_id, until, now)
            }
            WorkerMessage::Register(_) => warn!(
                "worker {} sent a second register; ignored",
                self.wire_name(worker)
            ),
            WorkerMessage::Unknown(kind) => {
                debug!(
                    "worker {} sent unknown message type `{kind}`; ignored",
                    self.wire_name(worker)
                )
            }
        }
    }

    pub(super) fn on_chunk(&mut self, worker: WorkerId, wire: &str, chunk: String, now: Instant) {
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
        req.deadline = now + self.cfg.request_limit();
        let untold = req.untold_dispatch.take();
        self.reply_after(id, untold, ClientEvent::Chunk(chunk));
    }

    pub(super) fn models_update(
        &mut self,
        worker: WorkerId,
        models: Vec<String>,
        load: u32,
        loaded: Option<Vec<String>>,
        info: Option<ModelInfoMap>,
        now: Instant,
    ) {
        let Some(w) = self.registry.get_mut(worker) else {
            return;
        };
        // A model the backend no longer holds took its cache with it.
        let evicted: Vec<String> = match (w.loaded_models(), &loaded) {
            (Some(before), Some(now)) => before.into_iter().filter(|m| !now.contains(m)).collect(),
            _ => Vec::new(),
        };
        if loaded.is_some() {
            w.set_loaded(loaded);
        }
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
        // Absent: unchanged. Set after the models, so only advertised ones are kept.
        if info.is_some() {
            w.set_model_info(info);
        }
        w.set_reported_load(load);
        for model in dropped.iter().chain(&evicted) {
            self.affinity
                .forget_model(worker, super::affinity::model_key(model));
        }
        self.note_models_seen(&dropped, now);
        self.note_models_seen(&models, now);
        self.fill_worker(worker, now);
    }

    pub(super) fn heartbeat_expired(&mut self, worker: WorkerId) {
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

    pub(super) fn ping_all(&mut self, now: Instant) {
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

    pub(super) fn worker_left(&mut self, worker: WorkerId, reason: &str, now: Instant) {
        if let Some(w) = self.registry.get(worker) {
            info!("worker {} ({}) disconnected: {reason}", w.wire_id, w.name);
            self.remove_worker(worker, now);
        }
    }

    /// Closes the socket of a registered worker and handles its requests as lost.
    pub(super) fn close_worker(&mut self, worker: WorkerId, reason: &str, now: Instant) {
        if self.registry.get(worker).is_some() {
            self.actions
                .push(Action::CloseWorker(worker, reason.to_string()));
            self.remove_worker(worker, now);
        }
    }

    /// Drops a worker from the registry. Its requests are requeued when nothing reached
    /// the client yet (at most `max_requeues` times); a stream already under way is
    /// ended with an error instead, since another worker's answer cannot be spliced in.
    pub(super) fn remove_worker(&mut self, worker: WorkerId, now: Instant) {
        let Some(w) = self.registry.remove(worker) else {
            return;
        };
        self.affinity.forget_worker(worker);
        self.attach_worker_left(worker);
        self.box_asleep(&w, w.drain == DrainState::DrainingCloseWhenIdle);
        self.tasks_worker_left(worker, now);
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

    pub(super) fn request_lost(&mut self, id: RequestId, now: Instant) {
        // A stream under way may go on elsewhere (only one that streamed).
        if self.interrupt(id, now) {
            return;
        }
        let Some(req) = self.requests.get(&id) else {
            return;
        };
        let streamed = matches!(req.stage, Stage::InFlight { streamed: true, .. });
        let wire = req.msg.request_id.clone();
        if streamed {
            info!("request {wire} failed: worker lost mid-stream");
            self.finish(id, ClientEvent::Failed(Failure::WorkerLost), now);
        } else if req.requeues as usize + req.failed_on.len() >= self.cfg.max_requeues as usize
            || self.phase != Phase::Running
        {
            info!("request {wire} failed: requeue exhausted");
            let event = self.answer_or(id, Failure::RequeueExhausted);
            self.finish(id, event, now);
        } else if let Some(req) = self.requests.get_mut(&id) {
            req.requeues += 1;
            self.counters.requeued += 1;
            info!("request {wire} requeued (attempt {})", req.requeues);
            self.enqueue(id, now);
        }
    }

    /// Runs a request that failed on `worker` before its backend answered on another
    /// worker, under the requeue rules: nothing reached the client, at most three
    /// attempts in all, the queue deadline from arrival. Returns false when it may not.
    pub(super) fn fail_over(
        &mut self,
        id: RequestId,
        worker: WorkerId,
        code: &str,
        now: Instant,
    ) -> bool {
        let Some(req) = self.requests.get_mut(&id) else {
            return false;
        };
        let attempts = 1 + req.requeues as usize + req.failed_on.len();
        let streamed = matches!(req.stage, Stage::InFlight { streamed: true, .. });
        if streamed || attempts >= MAX_ATTEMPTS || self.phase != Phase::Running {
            return false;
        }
        // With no worker up to run it, waiting helps nobody: the error goes through.
        let model = req.msg.model.clone();
        let runnable = |w: &super::Worker| {
            w.serves(&model) && w.health == super::Health::Up && !w.is_draining()
        };
        if !self.registry.iter().any(runnable) {
            return false;
        }
        let Some(req) = self.requests.get_mut(&id) else {
            return false;
        };
        req.failed_on.push(worker);
        let wire = req.msg.request_id.clone();
        if let Some(w) = self.registry.get_mut(worker) {
            w.in_flight.remove(&id);
        }
        self.counters.failovers += 1;
        info!(
            "request {wire} failed over from worker w-{worker} ({code}), attempt {}",
            attempts + 1
        );
        self.enqueue(id, now);
        // Other workers first, so the one that failed takes it back only if no other can.
        for other in self.registry.ids() {
            if other != worker {
                self.fill_worker(other, now);
            }
        }
        self.after_slot_freed(worker, now);
        true
    }

    pub(super) fn drain_worker(
        &mut self,
        worker: WorkerId,
        timeout: Option<Duration>,
        now: Instant,
    ) {
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
            self.timers
                .insert((crate::clock::later(now, t), Timer::WorkerDrain(worker)));
        }
        self.models_version += 1;
        self.after_slot_freed(worker, now);
    }

    pub(super) fn refresh_models(&mut self) {
        for id in self.registry.ids() {
            let msg = ServerMessage::ModelsRefresh {
                reason: Some("admin".into()),
            };
            self.actions.push(Action::ToWorker(id, msg));
        }
    }
}
