//! Authentication: constant-time secret comparison, the admin token and client API key
//! checks, and a limiter for failed attempts.
//!
//! The limiter must not lock out the innocent: a valid credential always passes, a
//! request that presents no credential at all is a plain 401 (not a guess, not counted),
//! failures are counted per client address *and* kind (worker secret, admin token, API
//! key), so a stranger's bad admin tokens do not keep workers from reconnecting, and
//! behind a reverse proxy the address is the forwarded client's (`client_ip.rs`), not
//! the proxy's. Its table is bounded so a flood of addresses cannot grow memory.

use std::collections::HashMap;
use std::net::IpAddr;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use subtle::ConstantTimeEq;

use super::errors::ApiError;
use super::http::request::Request;
use super::tenancy::identity::Caller;
use super::Ctx;

/// Compares secrets without leaking where they differ through timing.
pub fn secrets_match(given: &str, expected: &str) -> bool {
    given.as_bytes().ct_eq(expected.as_bytes()).into()
}

/// The token of an `Authorization: Bearer` header.
fn bearer(req: &Request) -> Option<&str> {
    req.header("authorization")
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim)
}

/// Which credential failed: each kind has its own count per address.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Kind {
    Worker,
    Admin,
    Client,
}

impl Kind {
    /// The metrics label (unchanged from when there was one table).
    fn label(self) -> &'static str {
        match self {
            Kind::Worker => "worker",
            Kind::Admin => "admin",
            Kind::Client => "api_key",
        }
    }
}

/// Runs `check` on a presented credential (`presented`: one was sent at all). A valid
/// one passes and clears this kind's failures for the address; none at all is a 401
/// that is not held against anyone; a wrong one is counted, and past the limit is
/// answered 429 instead of 401.
fn limited<T>(
    ctx: &Ctx,
    req: &Request,
    peer: IpAddr,
    kind: Kind,
    presented: bool,
    check: impl FnOnce() -> Result<T, ApiError>,
) -> Result<T, ApiError> {
    let ip = ctx.cfg.trusted_proxies.client_ip(peer, req);
    match check() {
        Ok(v) => {
            ctx.limiter.record_success(ip, kind);
            Ok(v)
        }
        Err(e) => {
            ctx.http_metrics.auth_failure(kind.label());
            if !presented {
                return Err(e);
            }
            let label = kind.label();
            match ctx.limiter.record_failure(ip, kind, Instant::now()) {
                Verdict::Counted => {
                    log::warn!("{label} authentication failed from {ip}");
                    Err(e)
                }
                Verdict::Reached => {
                    log::warn!("{label} authentication failed from {ip}; further failures answered 429 for a while");
                    Err(e)
                }
                Verdict::Over => Err(ApiError::new(
                    429,
                    "auth_rate_limited",
                    "too many failed authentications; retry later",
                )),
            }
        }
    }
}

/// Checks a worker's secret (`X-Worker-Secret`, or the legacy `worker_secret` query
/// parameter) before its WebSocket upgrade.
pub fn authorize_worker(ctx: &Ctx, req: &Request, peer: IpAddr) -> Result<(), ApiError> {
    let given = req
        .header("x-worker-secret")
        .map(str::to_string)
        .or_else(|| req.query_param("worker_secret"))
        .filter(|s| !s.is_empty());
    limited(
        ctx,
        req,
        peer,
        Kind::Worker,
        given.is_some(),
        || match given {
            Some(secret) if secrets_match(&secret, &ctx.cfg.worker_secret) => Ok(()),
            _ => Err(ApiError::new(
                401,
                "invalid_worker_secret",
                "missing or wrong worker secret",
            )),
        },
    )
}

/// Checks `Authorization: Bearer <MODELRELAY_ADMIN_TOKEN>` for `/admin/*`: 403 when no
/// token is configured, 401 when it is missing or wrong.
pub fn authorize_admin(ctx: &Ctx, req: &Request, peer: IpAddr) -> Result<(), ApiError> {
    check_admin_token(ctx, bearer(req), req, peer)
}

/// Checks a presented admin token (a bearer header, or the dashboard's sign-in form
/// field, `given`, of request `req`) under the failure limit: 403 when no token is
/// configured, 401 when it is missing or wrong.
pub fn check_admin_token(
    ctx: &Ctx,
    given: Option<&str>,
    req: &Request,
    peer: IpAddr,
) -> Result<(), ApiError> {
    let Some(token) = &ctx.cfg.admin_token else {
        return Err(ApiError::new(
            403,
            "admin_disabled",
            "admin API disabled: set MODELRELAY_ADMIN_TOKEN",
        ));
    };
    let given = given.filter(|g| !g.is_empty());
    limited(
        ctx,
        req,
        peer,
        Kind::Admin,
        given.is_some(),
        || match given {
            Some(given) if secrets_match(given, token) => Ok(()),
            _ => Err(ApiError::new(
                401,
                "invalid_admin_token",
                "missing or wrong admin token",
            )),
        },
    )
}

/// Checks the client API key when `MODELRELAY_REQUIRE_API_KEYS` is on. The key comes
/// from `Authorization: Bearer` (or `x-api-key` on `/v1/messages`); the header that
/// carried it is consumed by the relay and not forwarded to the backend.
pub fn authorize_client(ctx: &Ctx, req: &Request, peer: IpAddr) -> Result<Caller, ApiError> {
    if !ctx.cfg.require_api_keys {
        return Ok(optional_key(ctx, req));
    }
    let (secret, header) = match bearer(req) {
        Some(b) => (Some(b), "authorization"),
        None if req.path.starts_with("/v1/messages") => (req.header("x-api-key"), "x-api-key"),
        None => (None, "authorization"),
    };
    let secret = secret.filter(|s| !s.is_empty());
    limited(ctx, req, peer, Kind::Client, secret.is_some(), || {
        let Some(secret) = secret else {
            return Err(ApiError::new(
                401,
                "missing_api_key",
                "an API key is required: Authorization: Bearer <key>",
            ));
        };
        match ctx.keys.as_ref().and_then(|k| k.verify(secret)) {
            Some(key) => Ok(Caller {
                key: Some(key),
                consumed_header: Some(header),
                ..Caller::default()
            }),
            None => Err(ApiError::new(
                401,
                "invalid_api_key",
                "the API key is unknown or revoked",
            )),
        }
    })
}

/// Keys not required: a client that still presents a key it was given is counted (usage,
/// tenant, limits) under that key; anything else passes as an anonymous caller, its
/// header untouched (it may be meant for the backend).
fn optional_key(ctx: &Ctx, req: &Request) -> Caller {
    let key = bearer(req)
        .filter(|s| s.starts_with(super::keys::SECRET_PREFIX))
        .and_then(|secret| ctx.keys.as_ref()?.verify(secret));
    match key {
        Some(key) => Caller {
            key: Some(key),
            consumed_header: Some("authorization"),
            ..Caller::default()
        },
        None => Caller::default(),
    }
}

#[derive(Debug, Clone, Copy)]
struct Entry {
    failures: u32,
    window_start: Instant,
}

/// What one more failure means for its address and kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Under the limit: an ordinary 401.
    Counted,
    /// This failure reached the limit (logged once).
    Reached,
    /// Past the limit until the window ends: 429.
    Over,
}

/// Counts failures per client address and credential kind within a window. Other
/// addresses, and other kinds from the same address, are unaffected.
#[derive(Debug)]
pub struct FailureLimiter {
    table: Mutex<HashMap<(IpAddr, Kind), Entry>>,
    max_failures: u32,
    window: Duration,
    capacity: usize,
}

impl FailureLimiter {
    pub fn new(max_failures: u32, window: Duration, capacity: usize) -> FailureLimiter {
        FailureLimiter {
            table: Mutex::new(HashMap::new()),
            max_failures,
            window,
            capacity,
        }
    }

    pub fn record_failure(&self, ip: IpAddr, kind: Kind, now: Instant) -> Verdict {
        let key = (ip, kind);
        let mut table = self.table.lock();
        if !table.contains_key(&key) && table.len() >= self.capacity {
            table.retain(|_, e| now.saturating_duration_since(e.window_start) < self.window);
            if table.len() >= self.capacity {
                // Still full of live entries: forget the oldest one.
                if let Some(oldest) = table
                    .iter()
                    .min_by_key(|(_, e)| e.window_start)
                    .map(|(key, _)| *key)
                {
                    table.remove(&oldest);
                }
            }
        }
        let entry = table.entry(key).or_insert(Entry {
            failures: 0,
            window_start: now,
        });
        if now.saturating_duration_since(entry.window_start) >= self.window {
            *entry = Entry {
                failures: 0,
                window_start: now,
            };
        }
        entry.failures = entry.failures.saturating_add(1);
        match entry.failures.cmp(&self.max_failures) {
            std::cmp::Ordering::Less => Verdict::Counted,
            std::cmp::Ordering::Equal => Verdict::Reached,
            std::cmp::Ordering::Greater => Verdict::Over,
        }
    }

    /// A valid credential of `kind` clears that kind's failures only.
    pub fn record_success(&self, ip: IpAddr, kind: Kind) {
        let mut table = self.table.lock();
        if !table.is_empty() {
            table.remove(&(ip, kind));
        }
    }

    pub fn tracked(&self) -> usize {
        self.table.lock().len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(n: u32) -> IpAddr {
        IpAddr::from(n.to_be_bytes())
    }

    #[test]
    fn compare() {
        assert!(secrets_match("abc", "abc"));
        assert!(!secrets_match("abd", "abc"));
        assert!(!secrets_match("ab", "abc"));
    }

    #[test]
    fn one_address_and_kind_goes_over_others_do_not_and_the_window_expires() {
        let l = FailureLimiter::new(3, Duration::from_secs(60), 100);
        let t = Instant::now();
        let verdicts: Vec<Verdict> = (0..4)
            .map(|_| l.record_failure(ip(1), Kind::Admin, t))
            .collect();
        use Verdict::*;
        assert_eq!(verdicts, [Counted, Counted, Reached, Over]);
        assert_eq!(l.record_failure(ip(2), Kind::Admin, t), Counted);
        assert_eq!(l.record_failure(ip(1), Kind::Worker, t), Counted);
        let later = t + Duration::from_secs(61);
        assert_eq!(l.record_failure(ip(1), Kind::Admin, later), Counted);
    }

    #[test]
    fn a_success_clears_its_own_kind_only() {
        let l = FailureLimiter::new(2, Duration::from_secs(60), 100);
        let t = Instant::now();
        l.record_failure(ip(1), Kind::Admin, t);
        l.record_failure(ip(1), Kind::Worker, t);
        l.record_success(ip(1), Kind::Worker);
        assert_eq!(l.record_failure(ip(1), Kind::Admin, t), Verdict::Reached);
        assert_eq!(l.record_failure(ip(1), Kind::Worker, t), Verdict::Counted);
    }

    #[test]
    fn table_is_bounded_under_a_flood_of_addresses() {
        let l = FailureLimiter::new(3, Duration::from_secs(60), 50);
        let t = Instant::now();
        for n in 0..10_000 {
            l.record_failure(ip(n), Kind::Client, t);
        }
        assert!(l.tracked() <= 50);
    }
}
