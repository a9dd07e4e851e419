//! Server shutdown: refuse new work, let in-flight requests finish until the deadline,
//! then cancel what is left and report `Exit`.

use std::time::{Duration, Instant};

use log::info;

use super::{Action, Dispatcher, DrainState, Failure, Phase, RequestId, Stage, Timer};
use crate::protocol::{CancelReason, ServerMessage};

impl Dispatcher {
    pub(super) fn shutdown(&mut self, timeout: Duration, now: Instant) {
        if self.phase != Phase::Running {
            return;
        }
        info!(
            "server shutting down: draining {} in-flight request(s)",
            self.gauges().in_flight
        );
        self.phase = Phase::ShuttingDown;
        for id in self.queue.drain_all() {
            self.end_hold(id);
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
        self.timers
            .insert((crate::clock::later(now, timeout), Timer::Shutdown));
        self.maybe_finish_shutdown();
    }

    pub(super) fn shutdown_deadline(&mut self) {
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

    pub(super) fn maybe_finish_shutdown(&mut self) {
        if self.phase == Phase::ShuttingDown && self.requests.is_empty() {
            for id in self.registry.ids() {
                self.registry.remove(id);
                self.actions
                    .push(Action::CloseWorker(id, "server shutting down".into()));
            }
            self.finish_shutdown();
        }
    }

    pub(super) fn finish_shutdown(&mut self) {
        self.phase = Phase::Done;
        self.timers.clear();
        info!("shutdown complete");
        self.actions.push(Action::Exit);
    }
}
