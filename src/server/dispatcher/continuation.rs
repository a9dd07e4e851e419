//! A streamed answer whose worker died midway, finished on another worker: the
//! dispatcher's part (the text and the splice are the client thread's, in
//! `server::continuation`).
//!
//! A request submitted as continuable whose stream breaks after it began (its worker's
//! socket gone, or the worker reporting an error for it) is not failed at once. When
//! the budget allows it and some other worker can take a continuation, the request is
//! *interrupted*: its slot is freed, it waits (queued, not yet in the queue) and the
//! client is sent [`ClientEvent::Interrupted`]. The client answers with
//! [`Event::Continue`]: the same request with the text it delivered as
//! `continuation.prefix`, which goes back to its old place in the queue and is
//! dispatched like any request, only to workers that can continue (`Needs`), and
//! preferably not to the one that failed. An answer of `None` (the stream cannot be
//! continued: a tool call under way, a prefix too big) fails it as before.
//!
//! The rules of a requeue hold: each interruption is one attempt of the request's
//! budget (`max_requeues`), none while the server shuts down, and the wait for another
//! worker is bounded by the queue timeout. That wait counts from the interruption, not
//! from arrival: a stream that ran for minutes is long past its arrival's queue
//! deadline, and the point is to finish it.

use std::sync::Arc;
use std::time::Instant;

use log::info;

use super::{
    ClientEvent, Dispatcher, Failure, Health, Needs, Phase, RequestId, Stage, Timer, Worker,
};
use crate::protocol::RequestMessage;

impl Dispatcher {
    /// Marks a submitted request as one that may be continued (see the module docs).
    pub(super) fn mark_continuable(&mut self, id: RequestId, continuable: bool) {
        if let Some(req) = self.requests.get_mut(&id) {
            req.continuable = continuable;
        }
    }

    /// The stream of request `id` broke midway. Returns true when it is interrupted to
    /// go on elsewhere; false when it fails as before (not continuable, nothing streamed
    /// yet, budget spent, shutting down, or no other worker can continue it).
    pub(super) fn interrupt(&mut self, id: RequestId, now: Instant) -> bool {
        let Some(req) = self.requests.get(&id) else {
            return false;
        };
        let Stage::InFlight {
            worker,
            streamed: true,
        } = req.stage
        else {
            return false;
        };
        if !req.continuable || self.phase != Phase::Running {
            return false;
        }
        let wire = req.msg.request_id.clone();
        if req.requeues as usize + req.failed_on.len() >= self.cfg.max_requeues as usize {
            info!("request {wire} not continued: requeue budget spent");
            return false;
        }
        let model = req.msg.model.clone();
        let needs = Needs {
            continuation: Some(crate::server::continuation::route_of(
                &req.msg.endpoint_path,
            )),
            ..req.needs
        };
        let able = |w: &Worker| {
            w.id != worker
                && w.serves(&model)
                && w.health == Health::Up
                && !w.is_draining()
                && w.can(&model, needs)
        };
        if !self.registry.iter().any(able) {
            info!("request {wire} not continued: no other worker can continue it");
            return false;
        }
        let limit = self.cfg.queue_limit();
        let Some(req) = self.requests.get_mut(&id) else {
            return false;
        };
        req.failed_on.push(worker);
        req.needs = needs;
        req.stage = Stage::Queued;
        req.interrupted = true;
        let old = req.timer_at;
        req.queue_deadline = crate::clock::later(now, limit);
        req.deadline = req.queue_deadline;
        req.timer_at = req.queue_deadline;
        let (deadline, untold) = (req.deadline, req.untold_dispatch.take());
        self.timers.remove(&(old, Timer::Request(id)));
        self.timers.insert((deadline, Timer::Request(id)));
        self.counters.requeued += 1;
        info!("request {wire} interrupted on worker w-{worker}; to be continued elsewhere");
        if let Some(w) = self.registry.get_mut(worker) {
            w.in_flight.remove(&id);
        }
        self.reply_after(id, untold, ClientEvent::Interrupted);
        self.after_slot_freed(worker, now);
        true
    }

    /// The client's answer to an interruption: queue the continuation, or fail.
    pub(super) fn continue_with(
        &mut self,
        id: RequestId,
        msg: Option<Arc<RequestMessage>>,
        now: Instant,
    ) {
        let Some(req) = self.requests.get_mut(&id) else {
            return;
        };
        if !std::mem::take(&mut req.interrupted) {
            return;
        }
        // Only the same request, continuing: never another one under this id.
        let msg = msg.filter(|m| m.request_id == req.msg.request_id && m.continuation.is_some());
        let Some(msg) = msg else {
            info!(
                "request {} failed: worker lost mid-stream (not continuable)",
                req.msg.request_id
            );
            let timer = req.timer_at;
            self.requests.remove(&id);
            self.unschedule(id, timer);
            self.fail(id, Failure::WorkerLost);
            return self.maybe_finish_shutdown();
        };
        req.msg = msg;
        // Its stream is under way: no queue notes in the middle of the answer.
        req.progress = false;
        self.enqueue(id, now);
        self.fill_all(now);
    }
}
