//! The request lifecycle: submission, queueing, dispatch, completion, cancellation and
//! timeouts.

use std::sync::Arc;
use std::time::{Duration, Instant};

use log::{debug, info, warn};

use super::routing::{Route, Verdict};
use super::{
    parse_request_id, Action, Backpressure, ClientEvent, Dispatcher, DrainState, Failure,
    Fingerprints, Hold, Needs, Phase, Request, RequestId, Stage, Timer, Who, WorkerId,
};

/// Finished requests remembered for the drain rate.
const RECENT_DONE: usize = 256;
/// How far back the drain rate looks.
const DRAIN_WINDOW: Duration = Duration::from_secs(60);
/// How often a waiting client that asked for progress hears from the queue.
const PROGRESS_EVERY: Duration = Duration::from_secs(1);
use crate::protocol::held::FEATURE_HELD_STREAMS;
use crate::protocol::{CancelReason, RequestMessage, ServerMessage};
use crate::server::logsafe::bounded;

impl Dispatcher {
    #[allow(clippy::too_many_arguments)]
    pub(super) fn submit(
        &mut self,
        id: RequestId,
        msg: Arc<RequestMessage>,
        who: Who,
        needs: Needs,
        prints: Fingerprints,
        progress: bool,
        now: Instant,
    ) {
        if self.phase != Phase::Running {
            return self.fail(id, Failure::ShuttingDown);
        }
        if let Some(capability) = self.registry.unmet(&msg.model, needs) {
            info!(
                "request {} rejected: no worker's `{}` has {capability}",
                msg.request_id,
                bounded(&msg.model)
            );
            let model = msg.model.clone();
            return self.fail(id, Failure::UnsupportedCapability { model, capability });
        }
        if self.model_is_unknown(&msg.model, now) && !self.sleeping_model(&msg.model) {
            let available = self.registry.routable_models();
            info!(
                "request {} rejected: model `{}` not found",
                msg.request_id,
                bounded(&msg.model)
            );
            let model = msg.model.clone();
            return self.fail(id, Failure::ModelNotFound { model, available });
        }
        let queue_deadline = now + self.cfg.queue_limit();
        let request = Request {
            msg,
            who,
            needs,
            prints,
            hold: Hold::Never,
            arrived: now,
            queue_deadline,
            place: None,
            progress,
            progress_at: None,
            requeues: 0,
            failed_on: Vec::new(),
            last_answer: None,
            stage: Stage::Queued,
            deadline: queue_deadline,
            timer_at: queue_deadline,
            untold_dispatch: None,
            waking_for: None,
            continuable: false,
            interrupted: false,
        };
        let (worker, verdict) = match self.route(&request) {
            Route::Go(worker, verdict) => (Some(worker), verdict),
            // It may wait for its cached worker only where it may queue; else it starts
            // now elsewhere rather than be refused.
            Route::Wait { home, otherwise } => match self.admission(&request, now) {
                Some(_) => (Some(otherwise), Verdict::Overridden),
                None => {
                    self.requests.insert(id, request);
                    self.enqueue(id, now);
                    return self.start_hold(id, home, now);
                }
            },
            Route::Busy => (None, Verdict::Unkeyed),
        };
        if let Some(worker) = worker {
            let mut request = request;
            request.place = Some(self.queue.place_now(&request.who, now));
            self.requests.insert(id, request);
            return self.assign(id, worker, verdict, now);
        }
        if let Some(retry_after_secs) = self.no_healthy_worker(&request.msg.model, now) {
            info!(
                "request {} rejected: no healthy worker serves `{}`",
                request.msg.request_id,
                bounded(&request.msg.model)
            );
            return self.fail(id, Failure::NoHealthyWorker { retry_after_secs });
        }
        if let Some(failure) = self.admission(&request, now) {
            return self.fail(id, failure);
        }
        debug!(
            "request {} queued for model `{}` (tenant {}, {})",
            request.msg.request_id,
            bounded(&request.msg.model),
            request.who.tenant,
            request.who.priority.as_str()
        );
        self.requests.insert(id, request);
        self.enqueue(id, now);
        self.wake_for(id, now);
    }

    /// Whether a request that must wait may join the queue: a named tenant's share
    /// first, then the whole queue. The anonymous tenant has no share of its own: on a
    /// relay nobody divided it is everyone, and gets the whole queue. Zero: no cap.
    fn admission(&self, req: &Request, now: Instant) -> Option<Failure> {
        let tenant = &req.who.tenant;
        let capped = |len: usize, cap: usize| cap != 0 && len >= cap;
        if !req.who.is_anonymous()
            && capped(self.queue.tenant_len(tenant), self.cfg.max_queue_per_tenant)
        {
            warn!(
                "tenant {tenant} has {} waiting: request {} rejected",
                self.queue.tenant_len(tenant),
                req.msg.request_id
            );
            return Some(Failure::TenantQueueFull(self.backpressure(now)));
        }
        if capped(self.queue.len(), self.cfg.max_queue_len) {
            warn!(
                "queue full ({} waiting): request {} rejected",
                self.queue.len(),
                req.msg.request_id
            );
            return Some(Failure::QueueFull(self.backpressure(now)));
        }
        None
    }

    /// `Retry-After` from the measured drain rate: queue depth ÷ completions per second
    /// over the last minute, clamped to 1–60 s (60 when nothing finished lately).
    pub(super) fn backpressure(&self, now: Instant) -> Backpressure {
        let depth = self.queue.len();
        let retry = match self.drain_rate(now) {
            Some(per_sec) if per_sec > 0.0 => (depth.max(1) as f64 / per_sec).ceil(),
            _ => 60.0,
        };
        Backpressure {
            retry_after_secs: retry.clamp(1.0, 60.0) as u32,
            queue_depth: depth,
            avg_wait_ms: self.counters.mean_wait().as_millis() as u64,
        }
    }

    /// Completions per second over the recent window, if any finished in it.
    fn drain_rate(&self, now: Instant) -> Option<f64> {
        let recent: Vec<&Instant> = self
            .recent_done
            .iter()
            .filter(|t| now.saturating_duration_since(**t) <= DRAIN_WINDOW)
            .collect();
        let oldest = recent.first()?;
        let span = now
            .saturating_duration_since(**oldest)
            .max(Duration::from_secs(1));
        Some(recent.len() as f64 / span.as_secs_f64())
    }

    /// Notes a finished request for the drain rate.
    fn note_done(&mut self, now: Instant) {
        if self.recent_done.len() == RECENT_DONE {
            self.recent_done.pop_front();
        }
        self.recent_done.push_back(now);
    }

    /// Tells a waiting client that asked for progress where it stands, once a second.
    pub(super) fn tell_progress(&mut self, id: RequestId, now: Instant) {
        let Some(req) = self.requests.get_mut(&id) else {
            return;
        };
        req.progress_at = None;
        if !matches!(req.stage, Stage::Queued) {
            return;
        }
        let Some(position) = self.queue.position(id) else {
            return;
        };
        let note = self.waking_note(id);
        let per_request = match self.drain_rate(now) {
            Some(r) if r > 0.0 => 1000.0 / r,
            _ => self.counters.mean_wait().as_millis() as f64,
        };
        let eta_ms = ((position + 1) as f64 * per_request) as u64;
        self.reply(id, note.unwrap_or(ClientEvent::Queued { position, eta_ms }));
        let next = now + PROGRESS_EVERY;
        if let Some(req) = self.requests.get_mut(&id) {
            req.progress_at = Some(next);
        }
        self.timers.insert((next, Timer::Progress(id)));
    }

    /// A model nobody advertised for a whole queue-timeout window (after the server has
    /// been up that long) fails fast instead of waiting in the queue.
    pub(super) fn model_is_unknown(&self, model: &str, now: Instant) -> bool {
        // With no queue timeout a model nobody ever served still fails fast, not never.
        let window = match self.cfg.queue_timeout {
            limit if limit.is_zero() => super::Config::default().queue_timeout,
            limit => limit,
        };
        if now.saturating_duration_since(self.started) <= window || self.registry.advertises(model)
        {
            return false;
        }
        match self.model_seen.get(model) {
            Some(seen) => now.saturating_duration_since(*seen) > window,
            None => true,
        }
    }

    /// Puts a known request in the queue: back at its old place after a requeue, else at
    /// the back of its tenant's line. Its deadline is the queue deadline from arrival.
    pub(super) fn enqueue(&mut self, id: RequestId, now: Instant) {
        let Some(req) = self.requests.get_mut(&id) else {
            return;
        };
        req.stage = Stage::Queued;
        let old = req.timer_at;
        req.deadline = req.queue_deadline;
        req.timer_at = req.queue_deadline;
        let (deadline, progress, msg) = (req.deadline, req.progress, req.msg.clone());
        match req.place.take() {
            Some(place) => self.queue.restore(id, msg, &req.who, place),
            None => self.queue.push(id, msg, &req.who, now),
        }
        self.timers.remove(&(old, Timer::Request(id)));
        self.timers.insert((deadline, Timer::Request(id)));
        if progress {
            // A requeue restarts the notes at once; the chain already pending stops.
            if let Some(old) = req.progress_at.replace(now) {
                self.timers.remove(&(old, Timer::Progress(id)));
            }
            self.timers.insert((now, Timer::Progress(id)));
        }
    }

    pub(super) fn client_gone(&mut self, id: RequestId, now: Instant) {
        self.end_hold(id);
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

    pub(super) fn assign(
        &mut self,
        id: RequestId,
        worker: WorkerId,
        verdict: Verdict,
        now: Instant,
    ) {
        if self.registry.get(worker).is_none() {
            return;
        }
        self.note_route(id, worker, verdict);
        let Some(req) = self.requests.get_mut(&id) else {
            return;
        };
        let Some(w) = self.registry.get_mut(worker) else {
            return;
        };
        w.in_flight.insert(id);
        let old = req.timer_at;
        req.deadline = now + self.cfg.request_limit();
        req.timer_at = req.deadline;
        req.stage = Stage::InFlight {
            worker,
            streamed: false,
        };
        let (deadline, mut msg) = (req.deadline, req.msg.clone());
        // Only a worker that listed the feature is told to hold a stream.
        if msg.held.is_some() && !w.features.iter().any(|f| f == FEATURE_HELD_STREAMS) {
            Arc::make_mut(&mut msg).held = None;
        }
        let queue_wait = now.saturating_duration_since(req.arrived);
        self.timers.remove(&(old, Timer::Request(id)));
        self.timers.insert((deadline, Timer::Request(id)));
        self.counters.dispatched += 1;
        self.counters.waited(queue_wait);
        debug!(
            "request {} dispatched to {} ({})",
            msg.request_id, w.wire_id, w.name
        );
        req.untold_dispatch = Some(ClientEvent::Dispatched {
            queue_wait,
            worker: w.name.clone(),
        });
        self.tell_prefixes(worker, id);
        self.actions
            .push(Action::ToWorker(worker, ServerMessage::Request(msg)));
    }

    /// Gives a worker with free slots the queued requests it can serve, in queue order.
    /// Routing may send the request the queue picked to a better worker that is also
    /// free (its cached one), or have it wait for its full cached worker: then it stays
    /// where it is in the queue and this worker takes the next one.
    pub(super) fn fill_worker(&mut self, worker: WorkerId, now: Instant) {
        while !self.queue.is_empty() {
            let Some(w) = self.registry.get(worker) else {
                return;
            };
            if !w.has_free_slot() {
                return;
            }
            let (requests, registry) = (&self.requests, &self.registry);
            // A request goes back to a worker it failed on only when no other is up.
            let accept = |id: RequestId| {
                requests.get(&id).is_none_or(|r| {
                    if !w.can(&r.msg.model, r.needs) || waits_elsewhere(r, worker, registry, now) {
                        return false;
                    }
                    !r.failed_on.contains(&worker)
                        || !registry.iter().any(|o| {
                            o.serves(&r.msg.model)
                                && o.health == super::Health::Up
                                && !o.is_draining()
                                && !r.failed_on.contains(&o.id)
                        })
                })
            };
            let Some((id, place)) = self.queue.take_for(|model| w.serves(model), accept, now)
            else {
                return;
            };
            if let Some(req) = self.requests.get_mut(&id) {
                req.place = Some(place);
            }
            let Some(route) = self.requests.get(&id).map(|r| self.route(r)) else {
                continue;
            };
            match route {
                // Only a cached prefix moves the request off the worker that asked for
                // work: otherwise least-load round robin would send a requeued request
                // past the steady worker to whichever newcomer is next (churning
                // workers then used up its requeues).
                Route::Go(to, Verdict::Hit) => self.assign(id, to, Verdict::Hit, now),
                Route::Go(_, verdict) => self.assign(id, worker, verdict, now),
                Route::Wait { home, .. } => {
                    self.start_hold(id, home, now);
                    self.put_back(id);
                }
                // Not expected (this worker is free and took it); it waits as it was.
                Route::Busy => return self.put_back(id),
            }
        }
    }

    /// Returns a request taken from the queue to the place it had.
    fn put_back(&mut self, id: RequestId) {
        if let Some(req) = self.requests.get_mut(&id) {
            if let Some(place) = req.place.take() {
                self.queue.restore(id, req.msg.clone(), &req.who, place);
            }
        }
    }

    pub(super) fn fill_all(&mut self, now: Instant) {
        for id in self.registry.ids() {
            if self.queue.is_empty() {
                return;
            }
            self.fill_worker(id, now);
        }
    }

    pub(super) fn cancel_on_worker(
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
    pub(super) fn after_slot_freed(&mut self, worker: WorkerId, now: Instant) {
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

    pub(super) fn reply(&mut self, id: RequestId, event: ClientEvent) {
        self.actions.push(Action::ToClient(id, event));
    }

    /// Sends `event`, preceded by a dispatch the client has not been told of yet.
    pub(super) fn reply_after(
        &mut self,
        id: RequestId,
        untold: Option<ClientEvent>,
        event: ClientEvent,
    ) {
        if let Some(dispatched) = untold {
            self.actions.push(Action::ToClient(id, dispatched));
        }
        self.actions.push(Action::ToClient(id, event));
    }

    /// How a request that failed ends: with the backend answer an earlier attempt got,
    /// when there was one (the relay's own errors are for failures no backend answered).
    pub(super) fn answer_or(&mut self, id: RequestId, failure: Failure) -> ClientEvent {
        match self
            .requests
            .get_mut(&id)
            .and_then(|r| r.last_answer.take())
        {
            Some(answer) => ClientEvent::Complete(answer),
            None => ClientEvent::Failed(failure),
        }
    }

    /// Fails a request that holds no worker slot (rejected, queued, or shutting down).
    pub(super) fn fail(&mut self, id: RequestId, failure: Failure) {
        self.counters.failed(&failure);
        self.reply(id, ClientEvent::Failed(failure));
    }

    /// Ends a request that is in flight on `worker` (complete, error, timeout, loss).
    pub(super) fn finish(&mut self, id: RequestId, event: ClientEvent, now: Instant) {
        let Some(mut req) = self.requests.remove(&id) else {
            return;
        };
        self.unschedule(id, req.timer_at);
        self.note_done(now);
        match &event {
            ClientEvent::Complete(rc) => {
                self.counters.completed += 1;
                if let Some(t) = &rc.token_counts {
                    let entry = self
                        .counters
                        .tokens
                        .entry(req.msg.model.clone())
                        .or_default();
                    entry.0 = entry.0.saturating_add(t.prompt_tokens.unwrap_or(0));
                    entry.1 = entry.1.saturating_add(t.completion_tokens.unwrap_or(0));
                }
            }
            ClientEvent::Failed(f) => self.counters.failed(f),
            _ => {}
        }
        self.reply_after(id, req.untold_dispatch.take(), event);
        if let Stage::InFlight { worker, .. } = req.stage {
            if let Some(w) = self.registry.get_mut(worker) {
                w.in_flight.remove(&id);
            }
            self.after_slot_freed(worker, now);
        }
    }

    pub(super) fn unschedule(&mut self, id: RequestId, deadline: Instant) {
        self.timers.remove(&(deadline, Timer::Request(id)));
    }

    /// Looks up a request that `worker` is currently serving. Messages about requests the
    /// worker does not hold (late, cancelled, or another worker's) are dropped.
    pub(super) fn in_flight_on(&self, worker: WorkerId, wire: &str) -> Option<RequestId> {
        let id = parse_request_id(wire)?;
        match self.requests.get(&id)?.stage {
            Stage::InFlight { worker: w, .. } if w == worker => Some(id),
            _ => None,
        }
    }

    pub(super) fn request_deadline(&mut self, id: RequestId, now: Instant) {
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
                let (model, wire) = (req.msg.model.clone(), req.msg.request_id.clone());
                self.end_hold(id);
                let failure = match self.no_healthy_worker(&model, now) {
                    Some(retry_after_secs) => Failure::NoHealthyWorker { retry_after_secs },
                    None => self
                        .asleep_failure(id, &model)
                        .unwrap_or(Failure::QueueTimeout),
                };
                info!("request {wire} failed: {}", failure.code());
                self.queue.remove(id);
                match self.answer_or(id, failure) {
                    ClientEvent::Failed(failure) => self.fail(id, failure),
                    answer => self.reply(id, answer),
                }
                self.requests.remove(&id);
            }
            Stage::InFlight { worker, .. } => {
                let wire = req.msg.request_id.clone();
                info!("request {wire} timed out on worker w-{worker}; cancelling");
                // A worker whose answers never come fails like one whose answers are
                // 5xx: without this, a worker that takes requests and never answers
                // (wedged, or lying about its capacity) kept absorbing them.
                self.note_outcome(worker, true, now);
                self.counters.cancelled(CancelReason::Timeout);
                self.actions.push(Action::ToWorker(
                    worker,
                    ServerMessage::Cancel {
                        request_id: wire,
                        reason: CancelReason::Timeout,
                    },
                ));
                let event = self.answer_or(id, Failure::RequestTimeout);
                self.finish(id, event, now);
            }
        }
    }
}

/// Whether `req` waits for another worker than `worker` (one that is still up), so
/// `worker` passes over it for now.
fn waits_elsewhere(
    req: &Request,
    worker: WorkerId,
    registry: &super::Registry,
    now: Instant,
) -> bool {
    match req.hold {
        Hold::For {
            worker: home,
            until,
        } if home != worker && until > now => registry
            .get(home)
            .is_some_and(|h| h.health == super::Health::Up && !h.is_draining()),
        _ => false,
    }
}
