//! Workers whose backend is dead or failing are routed around.
//!
//! Two sources: a worker that reports its backend down (`backend_status`, our workers),
//! and outlier ejection for the rest (original workers, and backends that answer but fail
//! everything): after `OUTLIER_CONSECUTIVE_FAILURES` answers in a row that were 5xx or
//! transport failures, the worker is skipped for an ejection time that doubles with each
//! ejection in a row (10 s, 20 s, 40 s … at most 5 min) and starts over after a clean
//! stretch. Never more than half of the workers serving a model are ejected at once, nor
//! the last one that is up (the others' backends may be down), so one poisoned request
//! shape cannot empty the pool.

use std::time::{Duration, Instant};

use log::{info, warn};

use super::{Dispatcher, Timer, WorkerId};
use crate::protocol::BackendState;

const FIRST_EJECTION: Duration = Duration::from_secs(10);
const LONGEST_EJECTION: Duration = Duration::from_secs(300);

/// What a worker's backend looks like from here.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Health {
    Up,
    /// The worker said its backend is down.
    Down {
        since: Instant,
        reason: String,
    },
    /// Too many failures in a row: skipped until `until`.
    Ejected {
        since: Instant,
        until: Instant,
    },
}

impl Health {
    pub fn label(&self) -> &'static str {
        match self {
            Health::Up => "up",
            Health::Down { .. } => "down",
            Health::Ejected { .. } => "ejected",
        }
    }

    pub fn since(&self) -> Option<Instant> {
        match self {
            Health::Up => None,
            Health::Down { since, .. } | Health::Ejected { since, .. } => Some(*since),
        }
    }
}

/// A worker's recent record of answers.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Record {
    pub consecutive_failures: u32,
    clean_streak: u32,
    ejections_in_row: u32,
}

impl Record {
    /// How long the next ejection lasts.
    fn next_ejection(&self) -> Duration {
        let doubled = FIRST_EJECTION.saturating_mul(1 << self.ejections_in_row.min(10));
        doubled.min(LONGEST_EJECTION)
    }
}

impl Dispatcher {
    /// Notes how an answer from `worker` ended: `failed` for a 5xx from its backend or a
    /// transport failure. Ejects the worker when it crosses the threshold.
    pub(super) fn note_outcome(&mut self, worker: WorkerId, failed: bool, now: Instant) {
        let threshold = self.cfg.outlier_consecutive_failures;
        let Some(w) = self.registry.get_mut(worker) else {
            return;
        };
        let r = &mut w.record;
        if !failed {
            r.consecutive_failures = 0;
            r.clean_streak += 1;
            if r.clean_streak >= threshold.max(1) {
                r.ejections_in_row = 0;
            }
            return;
        }
        r.clean_streak = 0;
        r.consecutive_failures += 1;
        if threshold > 0 && r.consecutive_failures >= threshold && w.health == Health::Up {
            self.eject(worker, now);
        }
    }

    fn eject(&mut self, worker: WorkerId, now: Instant) {
        if !self.may_eject(worker) {
            // Said once, when the worker crosses the threshold, not on every failure after.
            let crossing = |w: &super::Worker| {
                w.record.consecutive_failures == self.cfg.outlier_consecutive_failures
            };
            if let Some(w) = self.registry.get(worker).filter(|w| crossing(w)) {
                warn!(
                    "worker {} ({}) keeps failing but is not ejected: half of its models' workers are out already, or no other is up",
                    w.wire_id, w.name
                );
            }
            return;
        }
        let Some(w) = self.registry.get_mut(worker) else {
            return;
        };
        let length = w.record.next_ejection();
        w.record.ejections_in_row += 1;
        w.record.consecutive_failures = 0;
        let until = now + length;
        w.health = Health::Ejected { since: now, until };
        warn!(
            "worker {} ({}) ejected for {}s after {} failures in a row",
            w.wire_id,
            w.name,
            length.as_secs(),
            self.cfg.outlier_consecutive_failures
        );
        self.counters.ejections += 1;
        self.models_version += 1;
        self.timers.insert((until, Timer::Readmit(worker)));
        // A request that waited for this worker rather than go back to one it failed
        // on may take that one now.
        self.fill_all(now);
    }

    /// Whether ejecting `worker` keeps at least half of the workers of each of its models,
    /// and another one that is up and takes work (not down, ejected or draining).
    fn may_eject(&self, worker: WorkerId) -> bool {
        let Some(w) = self.registry.get(worker) else {
            return false;
        };
        w.models.iter().all(|model| {
            let serving: Vec<_> = self.registry.iter().filter(|o| o.serves(model)).collect();
            let out = serving
                .iter()
                .filter(|o| matches!(o.health, Health::Ejected { .. }))
                .count();
            let another_up = serving
                .iter()
                .any(|o| o.id != worker && o.health == Health::Up && !o.is_draining());
            (out + 1) * 2 <= serving.len() && another_up
        })
    }

    /// An ejection ran out: the worker takes work again.
    pub(super) fn readmit(&mut self, worker: WorkerId, now: Instant) {
        let Some(w) = self.registry.get_mut(worker) else {
            return;
        };
        if !matches!(w.health, Health::Ejected { until, .. } if until <= now) {
            return;
        }
        w.health = Health::Up;
        info!("worker {} ({}) back from ejection", w.wire_id, w.name);
        self.models_version += 1;
        self.fill_worker(worker, now);
    }

    /// The worker told us its backend went down or came back.
    pub(super) fn backend_status(
        &mut self,
        worker: WorkerId,
        state: BackendState,
        reason: Option<String>,
        now: Instant,
    ) {
        let Some(w) = self.registry.get_mut(worker) else {
            return;
        };
        match state {
            BackendState::Down => {
                if matches!(w.health, Health::Down { .. }) {
                    return;
                }
                let reason = reason.unwrap_or_else(|| "unreachable".into());
                warn!("worker {} ({}) backend down: {reason}", w.wire_id, w.name);
                w.health = Health::Down { since: now, reason };
                // When it comes back it will have restarted with an empty cache.
                self.affinity.forget_worker(worker);
            }
            BackendState::Up => {
                if !matches!(w.health, Health::Down { .. }) {
                    return;
                }
                info!("worker {} ({}) backend up", w.wire_id, w.name);
                w.health = Health::Up;
                w.record = Record::default();
            }
        }
        self.models_version += 1;
        // Up: it takes work. Down: requests that avoided other workers for it may go
        // back to them now.
        self.fill_all(now);
    }

    /// Every worker that advertises `model` is down or ejected (and there is one): the
    /// request cannot be served until one recovers. Returns the advice for `Retry-After`.
    pub(super) fn no_healthy_worker(&self, model: &str, now: Instant) -> Option<u32> {
        let mut serving = self.registry.iter().filter(|w| w.serves(model)).peekable();
        serving.peek()?;
        let mut soonest: Option<Duration> = None;
        for w in serving {
            let wait = match &w.health {
                Health::Up if !w.is_draining() => return None,
                Health::Up => continue,
                Health::Down { .. } => Duration::from_secs(5),
                Health::Ejected { until, .. } => until.saturating_duration_since(now),
            };
            soonest = Some(soonest.map_or(wait, |s| s.min(wait)));
        }
        let secs = soonest?.as_secs_f64().ceil().clamp(1.0, 60.0);
        Some(secs as u32)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ejections_double_up_to_five_minutes() {
        let mut r = Record::default();
        let mut seen = Vec::new();
        for _ in 0..7 {
            seen.push(r.next_ejection().as_secs());
            r.ejections_in_row += 1;
        }
        assert_eq!(seen, vec![10, 20, 40, 80, 160, 300, 300]);
    }
}
