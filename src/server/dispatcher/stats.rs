//! Outcome counters kept by the dispatcher, and the gauges it publishes.

use std::collections::{BTreeMap, VecDeque};
use std::time::Duration;

use super::Failure;
use crate::protocol::CancelReason;
use crate::server::metrics::Histogram;

/// Request outcomes, for `/metrics`, `/admin/stats` and tests.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct Counters {
    pub completed: u64,
    pub failed: u64,
    pub cancelled: u64,
    pub requeued: u64,
    pub dispatched: u64,
    pub heartbeat_timeouts: u64,
    /// Requests run again elsewhere after a failure before the first byte.
    pub failovers: u64,
    /// Workers ejected for failing.
    pub ejections: u64,
    /// Dispatches a worker refused with `busy` (its other relays held every slot).
    pub busy: u64,
    /// Dispatches of requests with prompt fingerprints: to the worker holding the
    /// longest prefix, to others because none held any, or elsewhere because the one
    /// holding it was full or too loaded.
    pub affinity_hits: u64,
    pub affinity_misses: u64,
    pub affinity_overridden: u64,
    /// Requests that waited for their full cached worker (`AFFINITY_WAIT_MS`).
    pub affinity_waits: u64,
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
    pub(super) fn failed(&mut self, f: &Failure) {
        self.failed += 1;
        *self.failed_by.entry(f.code()).or_default() += 1;
    }

    pub(super) fn cancelled(&mut self, reason: CancelReason) {
        self.cancelled += 1;
        *self.cancelled_by.entry(reason.as_str()).or_default() += 1;
    }

    pub(super) fn waited(&mut self, wait: Duration) {
        self.queue_wait.observe(wait);
        if self.recent_waits.len() == RECENT_WAITS {
            self.recent_waits.pop_front();
        }
        self.recent_waits.push_back(wait);
    }

    /// Mean of the recent queue waits.
    pub fn mean_wait(&self) -> Duration {
        let n = self.recent_waits.len() as u32;
        if n == 0 {
            return Duration::ZERO;
        }
        self.recent_waits.iter().sum::<Duration>() / n
    }

    /// Percentile (0–100) of the recent queue waits.
    pub fn wait_percentile(&self, pct: usize) -> Duration {
        crate::server::metrics::percentile(&self.recent_waits, pct)
    }
}

/// Gauges the HTTP threads read for `/health`.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Gauges {
    pub workers: usize,
    pub queue_depth: usize,
    pub in_flight: usize,
    /// Relays the workers report they serve (at least this one).
    pub relays: usize,
}

/// Where requests are right now, for the live usage stream.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct LiveLoad {
    /// Worker name → model → requests in flight there. Every registered worker is
    /// listed, an idle one with an empty map (workers sharing a name are summed).
    pub workers: BTreeMap<String, BTreeMap<String, usize>>,
    /// Model → requests waiting in the queue.
    pub queued: BTreeMap<String, usize>,
    /// Model → (prompt tokens, completion tokens) since the server started.
    pub tokens: BTreeMap<String, (u64, u64)>,
}
