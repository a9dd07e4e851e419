//! Workers that serve several relays: their load reports and `busy` answers.
//!
//! Such a worker offers every slot to every relay, so this relay's count of what it
//! dispatched there is not the worker's load. The worker reports its live load
//! (`load`, whenever it changes): capacity here is `max_concurrent` minus that (less
//! our own requests, which it includes, see [`super::Worker::set_reported_load`]). When
//! two relays hand it the last slot at once, it refuses one of them with `busy`: the
//! request goes back to its place in the queue with its deadline, and it is neither a
//! failure of the worker, nor an attempt counted against the requeue budget.

use std::time::Instant;

use log::{debug, info};

use super::{Dispatcher, Failure, Stage, WorkerId};
use crate::server::dispatcher::ClientEvent;

/// Most relays kept per worker, and the longest URL kept (the list is the worker's
/// word: bounded before it is kept or shown).
const MAX_RELAYS: usize = 16;
const MAX_URL: usize = 200;

impl Dispatcher {
    /// `relays`: the relays the worker is registered with now.
    pub(super) fn worker_relays(&mut self, worker: WorkerId, relays: Vec<String>) {
        let Some(w) = self.registry.get_mut(worker) else {
            return;
        };
        w.relays = relays
            .into_iter()
            .take(MAX_RELAYS)
            .map(|r| {
                r.chars()
                    .filter(|c| !c.is_control())
                    .take(MAX_URL)
                    .collect()
            })
            .collect();
        debug!("worker {} serves {} relay(s)", w.wire_id, w.relays.len());
    }

    /// How many relays the pool spans, as its workers tell: the most any worker reports
    /// (this relay alone when none does).
    pub fn relays_reported(&self) -> usize {
        self.registry
            .iter()
            .map(|w| w.relays.len())
            .max()
            .unwrap_or(0)
            .max(1)
    }

    /// `load`: the worker's requests from every relay; room may have opened here.
    pub(super) fn worker_load(&mut self, worker: WorkerId, in_flight: u32, now: Instant) {
        if let Some(w) = self.registry.get_mut(worker) {
            w.set_reported_load(in_flight);
        }
        self.fill_worker(worker, now);
    }

    /// `busy`: the worker had no slot for request `wire`; it never reached the backend.
    pub(super) fn worker_busy(
        &mut self,
        worker: WorkerId,
        wire: &str,
        in_flight: u32,
        now: Instant,
    ) {
        let Some(id) = self.in_flight_on(worker, wire) else {
            debug!("busy for {wire}, which is not running on w-{worker}; ignored");
            return;
        };
        let Some(req) = self.requests.get(&id) else {
            return;
        };
        if matches!(req.stage, Stage::InFlight { streamed: true, .. }) {
            // A worker that streamed an answer was not busy: a broken worker.
            info!("request {wire} failed: worker w-{worker} said busy mid-stream");
            self.finish(id, ClientEvent::Failed(Failure::WorkerLost), now);
            return;
        }
        if let Some(w) = self.registry.get_mut(worker) {
            w.in_flight.remove(&id);
            // Full until it reports a freed slot (its report includes none of ours
            // beyond what is still in flight here).
            w.set_reported_load(in_flight.max(w.max_concurrent));
        }
        self.counters.busy += 1;
        debug!("request {wire} refused by busy worker w-{worker}; queued again");
        self.enqueue(id, now);
        self.fill_all(now);
        self.after_slot_freed(worker, now);
    }
}
