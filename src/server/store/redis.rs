//! The shared backends: one Redis or Valkey (`STATE_URL`), through the blocking `redis`
//! crate over one connection (no async runtime).
//!
//! Every call is bounded: connecting and each reply time out after [`TIMEOUT`]. After a
//! failure the connection is dropped and no new one is tried for [`RETRY_AFTER`], so an
//! unreachable store costs a request nothing but a failed mutex-guarded check. Each
//! transition between reachable and unreachable is logged once.

use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

#[cfg(feature = "governance")]
use super::Nonces;
use super::{Limits, Status};
use crate::server::keys::KeyRecord;
#[cfg(feature = "governance")]
use crate::server::lifecycle::governance::replay::{Remembered, FORGET_MARGIN_SECS};
#[cfg(feature = "governance")]
use crate::server::lifecycle::governance::WINDOW_SECS;
use crate::server::tenancy::limits::{Decision, Rate};

/// Longest wait for a connection or a reply.
pub const TIMEOUT: Duration = Duration::from_millis(500);
/// After a failure, calls fail fast for this long before a reconnect is tried.
pub const RETRY_AFTER: Duration = Duration::from_millis(500);
/// Prefix of every key this relay writes.
const PREFIX: &str = "modelrelay:";

/// The PEM certificates of `path`, checked to hold at least one: an unreadable or
/// empty file is a start-up error, not a store that silently never verifies.
fn read_ca(path: &Path) -> Result<Vec<u8>, String> {
    use rustls::pki_types::{pem::PemObject, CertificateDer};
    let pem = std::fs::read(path).map_err(|e| format!("STATE_CA_FILE {}: {e}", path.display()))?;
    let certs = CertificateDer::pem_slice_iter(&pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("STATE_CA_FILE {}: {e}", path.display()))?;
    if certs.is_empty() {
        return Err(format!(
            "STATE_CA_FILE {}: no PEM certificate in it",
            path.display()
        ));
    }
    Ok(pem)
}

/// One connection to the store, shared by all threads.
pub struct Redis {
    client: redis::Client,
    conn: Mutex<Link>,
    reachable: AtomicBool,
    round_trips: AtomicU64,
    errors: AtomicU64,
    rtt_us_total: AtomicU64,
}

struct Link {
    conn: Option<redis::Connection>,
    /// No reconnect before this, after a failure.
    quiet_until: Option<Instant>,
}

impl Redis {
    /// Parses `url`: `redis://`, or `rediss://` for TLS (rustls; the server's certificate
    /// is checked against the bundled web roots, or against `ca_file` alone when given,
    /// for a private CA). Connecting is lazy: a store down at start-up is the same as a
    /// store that went down later; a certificate that does not verify is the same as a
    /// store that cannot be reached (logged, shown in `/health`), never a crash.
    pub fn open(url: &str, ca_file: Option<&Path>) -> Result<Redis, String> {
        let tls = url.starts_with("rediss://");
        if !tls && !url.starts_with("redis://") {
            return Err(
                "STATE_URL must be redis://[user:pass@]host:port/db or rediss://… (TLS)".into(),
            );
        }
        let client = match ca_file {
            None => redis::Client::open(url),
            Some(path) if tls => redis::Client::build_with_tls(
                url,
                redis::TlsCertificates {
                    client_tls: None,
                    root_cert: Some(read_ca(path)?),
                },
            ),
            Some(_) => {
                return Err("STATE_CA_FILE is set but STATE_URL is not rediss:// (TLS)".into())
            }
        }
        .map_err(|e| format!("invalid STATE_URL: {e}"))?;
        let info = client.get_connection_info();
        if let redis::ConnectionAddr::TcpTls { insecure: true, .. } = info.addr() {
            // Certificate checks cannot be switched off in this build (no
            // tls-rustls-insecure): a private CA goes in STATE_CA_FILE instead.
            return Err(
                "STATE_URL: #insecure is not supported; trust a private CA with STATE_CA_FILE"
                    .into(),
            );
        }
        log::info!(
            "state store: redis at {}{} (API keys, rate limits and op-token nonces shared)",
            info.addr(),
            match (tls, ca_file) {
                (false, _) => "",
                (true, None) => " over TLS",
                (true, Some(_)) => " over TLS (CA from STATE_CA_FILE)",
            }
        );
        Ok(Redis {
            client,
            conn: Mutex::new(Link {
                conn: None,
                quiet_until: None,
            }),
            reachable: AtomicBool::new(true),
            round_trips: AtomicU64::new(0),
            errors: AtomicU64::new(0),
            rtt_us_total: AtomicU64::new(0),
        })
    }

    /// Runs `f` on the connection (connecting if needed); `Err` when the store cannot
    /// be reached or answered with an error. Errors are logged on transitions only.
    pub fn call<T>(
        &self,
        f: impl FnOnce(&mut redis::Connection) -> redis::RedisResult<T>,
    ) -> Result<T, String> {
        let mut link = self.conn.lock();
        let started = Instant::now();
        if link.conn.is_none() {
            if link.quiet_until.is_some_and(|t| started < t) {
                return Err("state store unreachable".into());
            }
            match self.connect() {
                Ok(c) => link.conn = Some(c),
                Err(e) => return Err(self.failed(&mut link, e)),
            }
        }
        let Some(conn) = link.conn.as_mut() else {
            return Err("state store unreachable".into());
        };
        match f(conn) {
            Ok(v) => {
                let us = u64::try_from(started.elapsed().as_micros()).unwrap_or(u64::MAX);
                self.round_trips.fetch_add(1, Ordering::Relaxed);
                self.rtt_us_total.fetch_add(us, Ordering::Relaxed);
                if !self.reachable.swap(true, Ordering::Relaxed) {
                    log::warn!(
                        "state store reachable again: shared keys, limits and nonces back in use"
                    );
                }
                Ok(v)
            }
            Err(e) => Err(self.failed(&mut link, e.to_string())),
        }
    }

    fn connect(&self) -> Result<redis::Connection, String> {
        let conn = self
            .client
            .get_connection_with_timeout(TIMEOUT)
            .map_err(|e| e.to_string())?;
        conn.set_read_timeout(Some(TIMEOUT))
            .and_then(|()| conn.set_write_timeout(Some(TIMEOUT)))
            .map_err(|e| e.to_string())?;
        Ok(conn)
    }

    fn failed(&self, link: &mut Link, why: String) -> String {
        link.conn = None;
        link.quiet_until = Some(Instant::now() + RETRY_AFTER);
        self.errors.fetch_add(1, Ordering::Relaxed);
        if self.reachable.swap(false, Ordering::Relaxed) {
            log::error!(
                "state store unreachable ({}): API keys from the local copy, op tokens refused, rate limits per relay until it is back",
                why.escape_debug()
            );
        }
        why
    }

    pub fn status(&self) -> Status {
        let round_trips = self.round_trips.load(Ordering::Relaxed);
        let rtt_us_total = self.rtt_us_total.load(Ordering::Relaxed);
        Status {
            kind: "redis",
            reachable: self.reachable.load(Ordering::Relaxed),
            round_trips,
            errors: self.errors.load(Ordering::Relaxed),
            mean_rtt_us: rtt_us_total / round_trips.max(1),
            rtt_us_total,
        }
    }
}

/// The fleet's keys: a hash of id → record JSON (hashed secret only) and a version
/// counter bumped with every change, in one transaction.
const KEYS_HASH: &str = "modelrelay:keys";
const KEYS_VERSION: &str = "modelrelay:keys:version";
const KEYS_EPOCH: &str = "modelrelay:keys:epoch";
/// How often each relay looks at the keys' version.
pub const KEY_POLL: Duration = Duration::from_millis(250);

pub struct SharedKeys {
    redis: Arc<Redis>,
}

impl SharedKeys {
    pub fn new(redis: Arc<Redis>) -> SharedKeys {
        SharedKeys { redis }
    }
}

impl super::KeyMirror for SharedKeys {
    fn publish(&self, record: &KeyRecord) -> Result<(), String> {
        let json = serde_json::to_string(record).map_err(|e| e.to_string())?;
        self.redis
            .call(|c| {
                redis::pipe()
                    .atomic()
                    .hset(KEYS_HASH, &record.id, &json)
                    .incr(KEYS_VERSION, 1)
                    .query::<()>(c)
            })
            .map_err(|e| format!("shared state store unreachable, key not changed: {e}"))
    }
}

/// The key-sync thread: first offers this relay's own keys to the store (those it does
/// not know yet: a relay that had keys before `STATE_URL` keeps them), then mirrors the
/// store's list whenever its version changes. While the store is unreachable the local
/// copy stays as it was and keeps authenticating.
pub fn follow_keys(redis: &Redis, ctx: &crate::server::Ctx) {
    let Some(keys) = &ctx.keys else { return };
    // The store's epoch this relay offered its keys to (see `offer`).
    let mut offered: Option<String> = None;
    let mut seen: Option<u64> = None;
    while !ctx.shared.is_shutting_down() {
        if offered.is_none() {
            offered = offer(redis, &keys.records()).ok();
        }
        if let Some(epoch) = &offered {
            match fetch(redis, seen, epoch) {
                Ok(Fetched::Changed(version, records)) => match keys.replace(records) {
                    Ok(()) => seen = Some(version),
                    Err(e) => log::error!("cannot keep the local copy of the shared keys: {e}"),
                },
                Ok(Fetched::Lost) => {
                    // A store restarted without its data: its empty list is not the
                    // fleet's. Offer ours again rather than forgetting every key.
                    log::warn!("the shared state store lost its key list; offering this relay's keys again");
                    offered = None;
                    seen = None;
                }
                Ok(Fetched::Same) | Err(_) => {}
            }
        }
        std::thread::sleep(KEY_POLL);
    }
}

/// Adds this relay's keys the store lacks; returns the store's epoch: a random mark
/// the first relay to offer sets, which a store restarted without its data no longer
/// has (so every relay offers again, whoever writes to the store first).
fn offer(redis: &Redis, records: &[KeyRecord]) -> Result<String, String> {
    let mut mark = [0u8; 8];
    getrandom::fill(&mut mark).map_err(|e| e.to_string())?;
    let mark: String = mark.iter().map(|b| format!("{b:02x}")).collect();
    let mut pipe = redis::pipe();
    pipe.atomic();
    pipe.set_nx(KEYS_EPOCH, mark).ignore();
    for r in records {
        let json = serde_json::to_string(r).map_err(|e| e.to_string())?;
        pipe.hset_nx(KEYS_HASH, &r.id, json).ignore();
    }
    pipe.incr(KEYS_VERSION, 1).ignore();
    pipe.get(KEYS_EPOCH);
    let (epoch,): (String,) = redis.call(|c| pipe.query(c))?;
    Ok(epoch)
}

enum Fetched {
    Same,
    Changed(u64, Vec<KeyRecord>),
    /// The store's epoch is not the one this relay offered its keys to: it lost them.
    Lost,
}

/// The store's keys when their version is not `seen`.
fn fetch(redis: &Redis, seen: Option<u64>, epoch: &str) -> Result<Fetched, String> {
    let (version, now): (Option<u64>, Option<String>) = redis.call(|c| {
        redis::cmd("MGET")
            .arg(KEYS_VERSION)
            .arg(KEYS_EPOCH)
            .query(c)
    })?;
    let (Some(version), true) = (version, now.as_deref() == Some(epoch)) else {
        return Ok(Fetched::Lost);
    };
    if seen == Some(version) {
        return Ok(Fetched::Same);
    }
    let all: std::collections::HashMap<String, String> =
        redis.call(|c| redis::cmd("HGETALL").arg(KEYS_HASH).query(c))?;
    let records = all
        .into_iter()
        .filter_map(
            |(id, json)| match serde_json::from_str::<KeyRecord>(&json) {
                Ok(r) => Some(r),
                Err(e) => {
                    log::warn!(
                        "shared key {} does not parse, skipped: {e}",
                        id.escape_debug()
                    );
                    None
                }
            },
        )
        .collect();
    Ok(Fetched::Changed(version, records))
}

/// Op-token nonces as `SET key 1 NX PX ttl`: the first relay to set it wins, every
/// other (and every later) attempt sees it taken. Redis's own durability settings
/// decide whether a nonce survives a Redis restart (see the docs).
#[cfg(feature = "governance")]
pub struct SharedNonces {
    redis: Arc<Redis>,
}

#[cfg(feature = "governance")]
impl SharedNonces {
    pub fn new(redis: Arc<Redis>) -> SharedNonces {
        SharedNonces { redis }
    }
}

#[cfg(feature = "governance")]
impl Nonces for SharedNonces {
    fn remember(&self, nonce: &str, issued_at: u64, now: u64) -> Remembered {
        // Kept as long as the local store keeps it: until the token can no longer pass
        // the time check, plus the margin.
        let until = issued_at.saturating_add(WINDOW_SECS + FORGET_MARGIN_SECS);
        let ttl_ms = until.saturating_sub(now).max(1).saturating_mul(1000);
        let key = format!("{PREFIX}nonce:{nonce}");
        let set = self.redis.call(|c| {
            redis::cmd("SET")
                .arg(&key)
                .arg(issued_at)
                .arg("NX")
                .arg("PX")
                .arg(ttl_ms)
                .query::<Option<String>>(c)
        });
        match set {
            Ok(Some(_)) => Remembered::Fresh,
            Ok(None) => Remembered::Replayed,
            Err(e) => Remembered::Unavailable(format!("shared state store: {e}")),
        }
    }
}

/// The GCRA of `limits.rs`, run inside Redis so that every relay draws from one bucket,
/// one round trip per admission. The bucket is kept as its level (backlog in
/// microseconds × amount) and the Redis time it was measured at; the clock is Redis's
/// own (`TIME`), so relays with skewed clocks still agree.
/// ARGV: amount, per (µs), mode (`req`, `check`, `charge`), tokens to charge.
/// Returns {allowed (0/1), level after}.
const GCRA: &str = r"
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local amount = tonumber(ARGV[1])
local cost = tonumber(ARGV[2])
local mode = ARGV[3]
local cap = cost * amount
local ceiling = 2 * cap - cost
local s = redis.call('HMGET', KEYS[1], 'l', 't')
local level = 0
if s[1] and s[2] then
  level = tonumber(s[1]) - (now - tonumber(s[2])) * amount
  if level < 0 then level = 0 end
  if level > ceiling then level = ceiling end
end
local allowed = 0
if level + cost <= cap then allowed = 1 end
if mode == 'req' and allowed == 1 then
  level = level + cost
elseif mode == 'charge' then
  level = math.min(level + tonumber(ARGV[4]) * cost, ceiling)
elseif mode == 'check' then
  return {allowed, level}
end
redis.call('HSET', KEYS[1], 'l', level, 't', now)
redis.call('PEXPIRE', KEYS[1], math.floor(level / amount / 1000) + 1000)
return {allowed, level}
";

/// Rate-limit buckets in Redis, with this relay's share (the limit divided by the live
/// relay count) as the fall-back while the store is unreachable.
pub struct SharedLimits {
    redis: Arc<Redis>,
    script: redis::Script,
    /// `modelrelay:rl:<name>:`
    prefix: String,
    local: super::local::Share,
}

impl SharedLimits {
    pub fn new(redis: Arc<Redis>, name: &str, local: super::local::Share) -> SharedLimits {
        SharedLimits {
            redis,
            script: redis::Script::new(GCRA),
            prefix: format!("{PREFIX}rl:{name}:"),
            local,
        }
    }

    /// Runs the script; `None` when the store is unreachable (the caller falls back).
    fn run(&self, key: &str, rate: Rate, mode: &str, tokens: u64) -> Option<Decision> {
        let per_us = rate
            .per
            .min(crate::server::tenancy::limits::MAX_PER)
            .as_micros()
            .max(1);
        let amount = rate.amount.max(1);
        let reply: Result<(u8, i64), String> = self.redis.call(|c| {
            self.script
                .key(format!("{}{key}", self.prefix))
                .arg(amount)
                .arg(u64::try_from(per_us).unwrap_or(u64::MAX))
                .arg(mode)
                .arg(tokens)
                .invoke(c)
        });
        let (allowed, level_us) = reply.ok()?;
        // The script counts microseconds, the limiter nanoseconds.
        let level_ns = u128::from(level_us.max(0).unsigned_abs()).saturating_mul(1000);
        Some(Decision::from_level(rate, level_ns, allowed == 1))
    }
}

impl Limits for SharedLimits {
    fn check_request(&self, key: &str, rate: Rate, now: Instant) -> Decision {
        self.run(key, rate, "req", 0)
            .unwrap_or_else(|| self.local.check_request(key, rate, now))
    }

    fn check_tokens(&self, key: &str, rate: Rate, now: Instant) -> Decision {
        self.run(key, rate, "check", 0)
            .unwrap_or_else(|| self.local.check_tokens(key, rate, now))
    }

    fn charge_tokens(&self, key: &str, rate: Rate, tokens: u64, now: Instant) {
        if tokens == 0 {
            return;
        }
        if self.run(key, rate, "charge", tokens).is_none() {
            self.local.charge_tokens(key, rate, tokens, now);
        }
    }

    fn tracked(&self) -> usize {
        self.local.tracked()
    }
}
