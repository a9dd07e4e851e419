//! The dispatcher's tunables ([`Config`]), mostly from the environment, and the
//! deadlines they give (a zero limit means none).

use std::time::Duration;

use super::WakeConfig;

/// Tunables, mostly from the environment.
#[derive(Debug, Clone)]
pub struct Config {
    /// Requests that may wait (0: no cap; `MAX_CONNECTIONS` still bounds them).
    pub max_queue_len: usize,
    /// Longest wait in the queue (zero: no limit).
    pub queue_timeout: Duration,
    /// Longest wait for the answer to start and between chunks (zero: no limit).
    pub request_timeout: Duration,
    pub heartbeat_interval: Duration,
    pub heartbeat_timeout: Duration,
    pub max_requeues: u32,
    pub max_models_per_worker: usize,
    /// Requests one named tenant may have waiting (`MAX_QUEUE_PER_TENANT`; 0: no cap).
    /// The anonymous tenant of a relay nobody divided is held to `max_queue_len` only.
    pub max_queue_per_tenant: usize,
    /// Wait after which a queued request moves up one priority class.
    pub priority_aging: Duration,
    /// Failed answers in a row after which a worker is ejected (0: never).
    pub outlier_consecutive_failures: u32,
    /// Send a conversation back to the worker holding its prompt prefix
    /// (`ROUTING_AFFINITY`).
    pub affinity: bool,
    /// How long a request may wait for its full cached worker (`AFFINITY_WAIT_MS`; zero:
    /// never).
    pub affinity_wait: Duration,
    /// Waking sleeping boxes (`WAKE_*`).
    pub wake: WakeConfig,
    /// On shutdown, while the workers report other relays: keep serving this long
    /// before draining (`DRAIN_GRACE_SECS`), so a load balancer notices first.
    pub drain_grace: Duration,
}

/// What a zero timeout stands for: far enough to never come, near enough that adding it
/// to an `Instant` cannot overflow.
const NEVER: Duration = Duration::from_secs(100 * 365 * 24 * 3600);

impl Config {
    /// How long a request may wait in the queue (`QUEUE_TIMEOUT_SECS=0`: for ever).
    pub fn queue_limit(&self) -> Duration {
        or_never(self.queue_timeout)
    }

    /// How long an answer may take to start, or pause (`REQUEST_TIMEOUT_SECS=0`: for ever).
    pub fn request_limit(&self) -> Duration {
        or_never(self.request_timeout)
    }
}

fn or_never(limit: Duration) -> Duration {
    if limit.is_zero() {
        NEVER
    } else {
        limit
    }
}

/// `AFFINITY_WAIT_MS` unless set: measured with `make bench-affinity` (see docs/proving.md).
pub const DEFAULT_AFFINITY_WAIT_MS: u64 = 20_000;

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
            max_queue_per_tenant: 50,
            priority_aging: Duration::from_secs(10),
            outlier_consecutive_failures: 5,
            affinity: true,
            affinity_wait: Duration::from_millis(DEFAULT_AFFINITY_WAIT_MS),
            wake: WakeConfig::default(),
            drain_grace: Duration::from_secs(5),
        }
    }
}
