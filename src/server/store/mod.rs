//! Where state that several relays must agree on lives: op-token nonces and rate-limit
//! buckets (one trait per concern). Without `STATE_URL` every relay keeps its own
//! ([`local`]: today's files and memory); with it (`redis-store` build) they share one
//! Redis or Valkey ([`redis`]). Callers hold a `Box<dyn …>` and never know which.
//!
//! A shared store that is unreachable degrades per concern, never silently: nonces are
//! refused (a token must never be accepted twice), rate limits fall back to this relay's
//! own limiter (logged once per transition).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

#[cfg(feature = "governance")]
use crate::server::lifecycle::governance::replay::Remembered;
use crate::server::shared::Shared;
use crate::server::tenancy::limits::{Decision, Rate, RateLimiter};
use crate::server::usage::journal::{Key, Usage};

mod local;
#[cfg(feature = "redis-store")]
pub mod redis;
#[cfg(feature = "redis-store")]
mod redis_sessions;
#[cfg(feature = "redis-store")]
mod redis_usage;

/// The op-token replay store: remembers a nonce once, durably.
#[cfg(feature = "governance")]
pub trait Nonces: Send + Sync {
    /// Records `nonce` (of a token issued at `issued_at`) unless already seen.
    fn remember(&self, nonce: &str, issued_at: u64, now: u64) -> Remembered;
}

/// API keys: a created or revoked key is published here for every relay; each relay
/// keeps authenticating from its own copy ([`crate::server::keys::KeyStore`]).
pub trait KeyMirror: Send + Sync {
    /// Makes `record` (hashed secret only) the fleet's version of that key.
    fn publish(&self, record: &crate::server::keys::KeyRecord) -> Result<(), String>;
}

/// Usage across relays: each relay publishes its own journal's buckets (absolute values,
/// so publishing again never counts twice) and reads the other relays'.
pub trait UsageMirror: Send + Sync {
    /// Makes `buckets` (this relay's, absolute) and this relay's `totals` the store's.
    /// `Ok(true)` when the store did not know this relay (new, or the store lost its
    /// data): everything must be published again.
    fn publish(&self, buckets: &[(Key, Usage)], totals: Usage) -> Result<bool, String>;
    /// The other relays' buckets of hours `from_hour..to_hour`.
    fn others(&self, from_hour: u64, to_hour: u64) -> Result<Others, String>;
    /// The sum of the other relays' totals.
    fn others_totals(&self) -> Result<Usage, String>;
}

/// What the other relays published.
#[derive(Debug, Default)]
pub struct Others {
    /// Relays that ever published, this one included.
    pub relays: usize,
    pub buckets: Vec<(Key, Usage)>,
}

/// Dashboard sessions: the SHA-256 of each session id with its remaining life.
pub trait SessionMirror: Send + Sync {
    fn put(&self, key: &[u8; 32], ttl: std::time::Duration) -> Result<(), String>;
    /// The session's remaining life; `Ok(None)` when the store does not have it.
    fn remaining(&self, key: &[u8; 32]) -> Result<Option<std::time::Duration>, String>;
    fn remove(&self, key: &[u8; 32]) -> Result<(), String>;
}

/// Lifecycle tasks: each task's JSON as its relay last published it.
pub trait TaskMirror: Send + Sync {
    fn put(&self, task_id: &str, json: &str, keep: std::time::Duration) -> Result<(), String>;
    fn get(&self, task_id: &str) -> Result<Option<String>, String>;
}

/// Rate-limit buckets (GCRA), keyed by tenant.
pub trait Limits: Send + Sync {
    /// Admits one request for `key` and counts it, or refuses it without counting.
    fn check_request(&self, key: &str, rate: Rate, now: Instant) -> Decision;
    /// Whether `key` has at least one token left; consumes nothing.
    fn check_tokens(&self, key: &str, rate: Rate, now: Instant) -> Decision;
    /// Counts `tokens` used by an answer.
    fn charge_tokens(&self, key: &str, rate: Rate, tokens: u64, now: Instant);
    /// Keys held in this relay's memory.
    fn tracked(&self) -> usize;
}

/// How the store is doing, for `/health` and `/metrics`.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct Status {
    /// `local` or `redis`.
    pub kind: &'static str,
    /// Whether the shared store answered the last call (always true for `local`).
    pub reachable: bool,
    pub round_trips: u64,
    pub errors: u64,
    /// Mean round-trip time in microseconds.
    pub mean_rtt_us: u64,
    /// Sum of the round-trip times, in microseconds.
    #[serde(skip)]
    pub rtt_us_total: u64,
}

impl Status {
    /// The store's families for `/metrics` (only written when a shared store is set).
    pub fn render_metrics(&self, e: &mut crate::server::metrics::Exposition) {
        e.family(
            "modelrelay_state_store_up",
            "gauge",
            "Whether the shared state store answered the last call (0: this relay is in fallback).",
        );
        e.sample("modelrelay_state_store_up", &[], u8::from(self.reachable));
        e.family(
            "modelrelay_state_store_errors_total",
            "counter",
            "Calls to the shared state store that failed or timed out.",
        );
        e.sample("modelrelay_state_store_errors_total", &[], self.errors);
        e.family(
            "modelrelay_state_store_round_trip_seconds",
            "summary",
            "Round trips to the shared state store that succeeded, and their total time.",
        );
        e.sample(
            "modelrelay_state_store_round_trip_seconds_sum",
            &[],
            self.rtt_us_total as f64 / 1e6,
        );
        e.sample(
            "modelrelay_state_store_round_trip_seconds_count",
            &[],
            self.round_trips,
        );
    }
}

/// The configured store: where to open each concern's backend.
#[derive(Clone)]
pub struct Store {
    /// Where the local replay store lives (only op-token governance keeps nonces).
    #[cfg_attr(not(feature = "governance"), allow(dead_code))]
    state_dir: PathBuf,
    #[cfg(feature = "redis-store")]
    shared: Option<std::sync::Arc<redis::Redis>>,
}

impl Store {
    /// Every concern local, in `state_dir`.
    pub fn local(state_dir: &Path) -> Store {
        Store {
            state_dir: state_dir.to_path_buf(),
            #[cfg(feature = "redis-store")]
            shared: None,
        }
    }

    /// Local without `url`; shared through Redis with it (`ca_file`: the CA that signed
    /// a `rediss://` store's certificate). A URL this build cannot use is a start-up
    /// error, not a silent fall back to per-relay state.
    pub fn open(
        state_dir: &Path,
        url: Option<&str>,
        ca_file: Option<&Path>,
    ) -> Result<Store, String> {
        let Some(url) = url.filter(|u| !u.trim().is_empty()) else {
            return Ok(Store::local(state_dir));
        };
        #[cfg(feature = "redis-store")]
        {
            let shared = redis::Redis::open(url, ca_file)?;
            Ok(Store {
                state_dir: state_dir.to_path_buf(),
                shared: Some(std::sync::Arc::new(shared)),
            })
        }
        #[cfg(not(feature = "redis-store"))]
        {
            let _ = (url, ca_file);
            Err("STATE_URL is set but this build has no shared store (build with --features redis-store)".into())
        }
    }

    /// The op-token replay store; `now` drops expired local entries.
    #[cfg(feature = "governance")]
    pub fn nonces(&self, now: u64) -> Result<Box<dyn Nonces>, String> {
        #[cfg(feature = "redis-store")]
        if let Some(shared) = &self.shared {
            return Ok(Box::new(redis::SharedNonces::new(shared.clone())));
        }
        Ok(Box::new(
            crate::server::lifecycle::governance::NonceStore::open(&self.state_dir, now)?,
        ))
    }

    /// A family of rate-limit buckets (`name`: `requests`, `tokens`) tracking at most
    /// `capacity` tenants locally. Kept locally (no shared store, or the store
    /// unreachable), a limit is this relay's share: divided by the relays its workers
    /// report (`relays`).
    pub fn limits(&self, name: &str, capacity: usize, relays: &Arc<Shared>) -> Box<dyn Limits> {
        let local = local::Share::new(RateLimiter::new(capacity), relays.clone());
        #[cfg(feature = "redis-store")]
        if let Some(shared) = &self.shared {
            return Box::new(redis::SharedLimits::new(shared.clone(), name, local));
        }
        let _ = name;
        Box::new(local)
    }

    /// Where key changes are published; none when every relay keeps its own keys.
    pub fn key_mirror(&self) -> Option<Box<dyn KeyMirror>> {
        #[cfg(feature = "redis-store")]
        if let Some(shared) = &self.shared {
            return Some(Box::new(redis::SharedKeys::new(shared.clone())));
        }
        None
    }

    /// Where this relay's usage is published for the others; none without a shared
    /// store. The relay is known by an id kept in `STATE_DIR/relay.id` (made on first
    /// use), so a restart publishes over its own figures instead of adding a relay.
    pub fn usage_mirror(
        &self,
        retention_days: u32,
    ) -> Result<Option<std::sync::Arc<dyn UsageMirror>>, String> {
        #[cfg(feature = "redis-store")]
        if let Some(shared) = &self.shared {
            let id = relay_id(&self.state_dir)?;
            let mirror = redis_usage::SharedUsage::new(shared.clone(), id, retention_days);
            return Ok(Some(std::sync::Arc::new(mirror)));
        }
        let _ = retention_days;
        Ok(None)
    }

    /// Where dashboard sessions are shared; none without a shared store.
    pub fn session_mirror(&self) -> Option<Box<dyn SessionMirror>> {
        #[cfg(feature = "redis-store")]
        if let Some(shared) = &self.shared {
            return Some(Box::new(redis_sessions::SharedSessions::new(
                shared.clone(),
            )));
        }
        None
    }

    /// Where lifecycle tasks are shared; none without a shared store.
    pub fn task_mirror(&self) -> Option<Box<dyn TaskMirror>> {
        #[cfg(feature = "redis-store")]
        if let Some(shared) = &self.shared {
            return Some(Box::new(redis_sessions::SharedTasks::new(shared.clone())));
        }
        None
    }

    /// Keeps the relay's keys equal to the shared store's list, on a thread of its own
    /// that polls the list's version (a change shows on every relay within a second);
    /// nothing to do without a shared store or without keys.
    pub fn follow_keys(&self, ctx: &std::sync::Arc<crate::server::Ctx>) -> std::io::Result<()> {
        #[cfg(feature = "redis-store")]
        if let (Some(shared), Some(_)) = (&self.shared, &ctx.keys) {
            let (shared, ctx) = (shared.clone(), ctx.clone());
            std::thread::Builder::new()
                .name("key-sync".into())
                .stack_size(crate::server::THREAD_STACK)
                .spawn(move || redis::follow_keys(&shared, &ctx))?;
        }
        let _ = ctx;
        Ok(())
    }

    /// The store's health and counters.
    pub fn status(&self) -> Status {
        #[cfg(feature = "redis-store")]
        if let Some(shared) = &self.shared {
            return shared.status();
        }
        Status {
            kind: "local",
            reachable: true,
            ..Status::default()
        }
    }

    /// Whether a shared store is configured.
    pub fn is_shared(&self) -> bool {
        #[cfg(feature = "redis-store")]
        if self.shared.is_some() {
            return true;
        }
        false
    }
}

/// This relay's id in the shared store: read from `dir/relay.id`, or made (random) and
/// kept there.
#[cfg(feature = "redis-store")]
fn relay_id(dir: &Path) -> Result<String, String> {
    let path = dir.join("relay.id");
    if let Ok(text) = std::fs::read_to_string(&path) {
        let id = text.trim();
        if !id.is_empty() && id.len() <= 64 && id.bytes().all(|b| b.is_ascii_alphanumeric()) {
            return Ok(id.to_string());
        }
    }
    let mut bytes = [0u8; 8];
    getrandom::fill(&mut bytes).map_err(|e| format!("cannot make a relay id: {e}"))?;
    let id: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
    crate::server::private_fs::create_dir(dir)
        .and_then(|()| std::fs::write(&path, format!("{id}\n")))
        .map_err(|e| format!("cannot write {}: {e}", path.display()))?;
    Ok(id)
}
