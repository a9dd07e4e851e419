//! Server shutdown: refuse new work, let in-flight requests finish until the deadline,
//! then cancel what is left and report `Exit`. A relay whose workers report other
//! relays first keeps serving for the drain grace (`/health` already answers 503), so
//! a load balancer moves traffic away before anything is refused.

use std::time::{Duration, Instant};

use log::info;

use super::{Action, Dispatcher, DrainState, Failure, Phase, RequestId, Stage, Timer};
use crate::protocol::{CancelReason, ServerMessage};

impl Dispatcher {
    /// SIGTERM (or a test's shutdown): drain now, or after the grace when the pool has
    /// other relays. Asked again during the grace, it drains at once.
    pub(super) fn shutdown_requested(&mut self, timeout: Duration, now: Instant) {
        if self.phase != Phase::Running {
            return;
        }
        let others = self.relays_reported() - 1;
        if self.grace_pending.is_none() && others > 0 && !self.cfg.drain_grace.is_zero() {
            info!(
                "server draining: the workers serve {others} other relay(s); still serving for {}s so load balancers notice",
                self.cfg.drain_grace.as_secs_f64()
            );
            self.grace_pending = Some(timeout);
            self.timers
                .insert((now + self.cfg.drain_grace, Timer::Grace));
            return;
        }
        self.grace_pending = None;
        self.shutdown(timeout, now);
    }

    pub(super) fn grace_over(&mut self, now: Instant) {
        if let Some(timeout) = self.grace_pending.take() {
            self.shutdown(timeout, now);
        }
    }

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
