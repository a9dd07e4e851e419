//! Per-tenant rate limits: requests (`100req/min`) and token budgets (`50000tok/min`).
//!
//! **Algorithm.** GCRA (generic cell rate algorithm): per tenant and kind, one
//! "theoretical arrival time" (TAT). With emission interval `T = per / amount` and
//! tolerance `τ = per − T`, a unit at `now` passes iff `max(TAT, now) − now ≤ τ`, and
//! then TAT grows by `T`. The backlog `TAT − now` is a bucket of size `per` that drains in
//! real time: a burst of `amount` passes at once, then one per `T`; unlike a fixed window
//! there is never a second burst right after a window edge. (It is a bucket, not a
//! sliding log: a burst then the steady rate puts up to `2 × amount − 1` into one span of
//! `per`, never more.) Time is counted in nanoseconds × `amount`, so `T` is exact
//! (`7req/s` admits exactly 7, with no drift).
//! Tokens use the same bucket: [`RateLimiter::check_tokens`] asks whether one token still
//! fits, [`RateLimiter::charge_tokens`] adds `tokens × T` after the answer, capped at one
//! window of debt, so the longest lock-out is one `per`.
//!
//! **Memory.** One entry per tenant (request and token state together), at most
//! `capacity`. An entry whose TATs have passed is fully replenished and worthless. When a
//! new tenant finds the table full, replenished entries are purged; if that leaves less
//! than 1/8 of the table free, the live entries closest to replenishment (least to lose)
//! are evicted until 1/8 is free. Sweeping in batches keeps inserts O(1) amortized. An
//! evicted live tenant gets part of its budget back early: a loss of accuracy under a
//! flood of tenant ids, never an error.

use std::collections::HashMap;
use std::fmt;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

/// Longest window the limiter honours; longer ones are treated as this (keeps the
/// arithmetic far from overflow). The parser only produces `s`, `min` and `h`.
pub const MAX_PER: Duration = Duration::from_secs(24 * 3600);

/// When the table is full, a sweep leaves at least `capacity / EVICT_FRACTION` free.
const EVICT_FRACTION: usize = 8;

/// What a [`Rate`] counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Unit {
    Requests,
    Tokens,
}

impl Unit {
    fn word(self) -> &'static str {
        match self {
            Unit::Requests => "req",
            Unit::Tokens => "tok",
        }
    }

    fn example(self) -> &'static str {
        match self {
            Unit::Requests => "100req/min",
            Unit::Tokens => "50000tok/min",
        }
    }

    fn noun(self) -> &'static str {
        match self {
            Unit::Requests => "request",
            Unit::Tokens => "token",
        }
    }
}

/// `amount` units per `per`. The limiter uses only `amount` and `per`; `unit` is there so
/// that [`fmt::Display`] renders what was parsed (`100req/min`, `50000tok/min`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Rate {
    pub amount: u64,
    pub per: Duration,
    pub unit: Unit,
}

impl Rate {
    pub const fn requests(amount: u64, per: Duration) -> Rate {
        Rate {
            amount,
            per,
            unit: Unit::Requests,
        }
    }

    pub const fn tokens(amount: u64, per: Duration) -> Rate {
        Rate {
            amount,
            per,
            unit: Unit::Tokens,
        }
    }

    /// `100req/min`, `10req/s`, `500req/h` (also `/sec`, `/second`, `/m`, `/minute`, `/hour`).
    pub fn parse_requests(s: &str) -> Result<Rate, String> {
        parse(s, Unit::Requests)
    }

    /// `50000tok/min`, `1000tok/s`, `1000000tok/h` (same periods as requests).
    pub fn parse_tokens(s: &str) -> Result<Rate, String> {
        parse(s, Unit::Tokens)
    }
}

fn parse(s: &str, unit: Unit) -> Result<Rate, String> {
    let bad = |why: String| {
        format!(
            "invalid {} rate `{s}`: {why} (expected e.g. `{}`)",
            unit.noun(),
            unit.example()
        )
    };
    let (count, period) = s
        .trim()
        .split_once('/')
        .ok_or_else(|| bad("missing `/` and period".into()))?;
    let digits_end = count
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(count.len());
    let (digits, word) = count.split_at(digits_end);
    if digits.is_empty() {
        return Err(bad("missing amount".into()));
    }
    if word != unit.word() {
        return Err(bad(format!("unit must be `{}`, not `{word}`", unit.word())));
    }
    let amount: u64 = digits
        .parse()
        .map_err(|_| bad(format!("amount `{digits}` is too large")))?;
    if amount == 0 {
        return Err(bad("amount must be at least 1".into()));
    }
    let per = parse_period(period)
        .ok_or_else(|| bad(format!("unknown period `{period}` (use s, min or h)")))?;
    Ok(Rate { amount, per, unit })
}

fn parse_period(p: &str) -> Option<Duration> {
    let secs = match p {
        "s" | "sec" | "second" => 1,
        "m" | "min" | "minute" => 60,
        "h" | "hour" => 3600,
        _ => return None,
    };
    Some(Duration::from_secs(secs))
}

impl fmt::Display for Rate {
    /// `100req/min`; a `per` other than 1 s, 1 min or 1 h (only possible when built by
    /// hand) renders as a duration (`100req/30s`), which does not parse back.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}{}/", self.amount, self.unit.word())?;
        match self.per.as_nanos() {
            1_000_000_000 => f.write_str("s"),
            60_000_000_000 => f.write_str("min"),
            3_600_000_000_000 => f.write_str("h"),
            _ => write!(f, "{:?}", self.per),
        }
    }
}

/// The outcome of a check, with what the OpenAI-style `x-ratelimit-*` headers need.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Decision {
    pub allowed: bool,
    /// The rate's `amount`.
    pub limit: u64,
    /// Units left right now (after this request, for [`RateLimiter::check_request`]).
    pub remaining: u64,
    /// Until the bucket is fully replenished (`remaining == limit`).
    pub reset_after: Duration,
    /// Until the next unit would pass; zero when allowed.
    pub retry_after: Duration,
}

impl Decision {
    /// The decision for a bucket at `level` (backlog in nanoseconds × amount) under
    /// `rate`; for a limiter that keeps its buckets elsewhere (the shared store).
    pub fn from_level(rate: Rate, level: u128, allowed: bool) -> Decision {
        let s = Scale::of(rate);
        s.decision(level.min(s.ceiling()), allowed)
    }

    /// `Retry-After` in whole seconds, rounded up; at least 1 when refused.
    pub fn retry_after_secs(&self) -> u64 {
        let secs = self.retry_after.as_nanos().div_ceil(1_000_000_000);
        let secs = u64::try_from(secs).unwrap_or(u64::MAX);
        if self.allowed {
            secs
        } else {
            secs.max(1)
        }
    }

    /// When the bucket is full again, as Unix milliseconds (rounded up).
    pub fn reset_at_unix_ms(&self, now_unix_ms: u64) -> u64 {
        let ms = self.reset_after.as_nanos().div_ceil(1_000_000);
        now_unix_ms.saturating_add(u64::try_from(ms).unwrap_or(u64::MAX))
    }
}

/// A rate in the limiter's units: time in nanoseconds × `amount`, so that one unit costs
/// exactly `per_ns` and the bucket holds `per_ns × amount`.
#[derive(Debug, Clone, Copy)]
struct Scale {
    /// `amount`, at least 1.
    amount: u64,
    /// Cost of one unit (`T` scaled), = `per` in nanoseconds, at least 1.
    cost: u128,
    /// Bucket size (`per` scaled).
    cap: u128,
}

impl Scale {
    fn of(rate: Rate) -> Scale {
        let amount = rate.amount.max(1);
        let cost = rate.per.min(MAX_PER).as_nanos().max(1);
        Scale {
            amount,
            cost,
            cap: cost * u128::from(amount),
        }
    }

    /// Most a bucket may hold: one window of debt beyond `cap`, less one unit, so a unit
    /// fits again after at most one `per`.
    fn ceiling(self) -> u128 {
        2 * self.cap - self.cost
    }

    fn fits(self, level: u128) -> bool {
        level + self.cost <= self.cap
    }

    /// Real time for a scaled amount to drain, rounded up to the nanosecond.
    fn drain_time(self, scaled: u128) -> Duration {
        let ns = scaled.div_ceil(u128::from(self.amount));
        Duration::from_nanos(u64::try_from(ns).unwrap_or(u64::MAX))
    }

    fn decision(self, level: u128, allowed: bool) -> Decision {
        let remaining = self.cap.saturating_sub(level) / self.cost;
        let retry_after = if allowed {
            Duration::ZERO
        } else {
            self.drain_time((level + self.cost).saturating_sub(self.cap))
        };
        Decision {
            allowed,
            limit: self.amount,
            remaining: u64::try_from(remaining).unwrap_or(u64::MAX),
            reset_after: self.drain_time(level),
            retry_after,
        }
    }
}

/// A theoretical arrival time, exact to 1/`amount` of a nanosecond: `at + frac / amount`.
#[derive(Debug, Clone, Copy)]
struct Tat {
    at: Instant,
    frac: u64,
}

impl Tat {
    fn empty(now: Instant) -> Tat {
        Tat { at: now, frac: 0 }
    }

    /// The backlog at `now`, scaled; 0 when replenished. Clamped to the ceiling, which
    /// also bounds a backlog left by a since-changed rate (callers store the clamped
    /// level back, so that `retry_after` holds).
    fn level(self, now: Instant, s: Scale) -> u128 {
        let Some(ahead) = self.at.checked_duration_since(now) else {
            return 0;
        };
        let frac = u128::from(self.frac.min(s.amount - 1));
        let amount = u128::from(s.amount);
        (ahead.as_nanos().saturating_mul(amount) + frac).min(s.ceiling())
    }

    fn at_level(now: Instant, level: u128, s: Scale) -> Tat {
        let amount = u128::from(s.amount);
        let whole = u64::try_from(level / amount).unwrap_or(u64::MAX);
        let frac = u64::try_from(level % amount).unwrap_or(0);
        let at = now.checked_add(Duration::from_nanos(whole)).unwrap_or(now);
        Tat { at, frac }
    }

    /// From when the backlog is zero.
    fn idle_at(self) -> Instant {
        if self.frac == 0 {
            self.at
        } else {
            self.at + Duration::from_nanos(1)
        }
    }
}

#[derive(Debug, Clone, Copy)]
struct Entry {
    requests: Tat,
    tokens: Tat,
}

impl Entry {
    fn new(now: Instant) -> Entry {
        Entry {
            requests: Tat::empty(now),
            tokens: Tat::empty(now),
        }
    }

    fn idle_at(&self) -> Instant {
        self.requests.idle_at().max(self.tokens.idle_at())
    }
}

struct Table {
    map: HashMap<String, Entry>,
    capacity: usize,
}

impl Table {
    fn with_entry<R>(&mut self, key: &str, now: Instant, f: impl FnOnce(&mut Entry) -> R) -> R {
        if let Some(entry) = self.map.get_mut(key) {
            return f(entry);
        }
        self.make_room(now);
        f(self
            .map
            .entry(key.to_owned())
            .or_insert_with(|| Entry::new(now)))
    }

    /// Called before inserting: if full, purge replenished entries, then evict the live
    /// ones closest to replenishment until `capacity / EVICT_FRACTION` (≥ 1) is free.
    fn make_room(&mut self, now: Instant) {
        if self.map.len() < self.capacity {
            return;
        }
        self.map.retain(|_, e| e.idle_at() > now);
        let target = self.capacity - (self.capacity / EVICT_FRACTION).max(1);
        let excess = self.map.len().saturating_sub(target);
        if excess > 0 {
            self.evict_closest(excess);
        }
    }

    /// Drops the `n` entries (`1 ≤ n ≤ len`) with the earliest `idle_at`.
    fn evict_closest(&mut self, n: usize) {
        let mut idle: Vec<Instant> = self.map.values().map(Entry::idle_at).collect();
        let threshold = *idle.select_nth_unstable(n - 1).1;
        let below = idle.iter().filter(|&&t| t < threshold).count();
        let mut ties = n - below;
        self.map.retain(|_, e| {
            let t = e.idle_at();
            if t < threshold {
                false
            } else if t == threshold && ties > 0 {
                ties -= 1;
                false
            } else {
                true
            }
        });
    }
}

/// Per-key GCRA limiter for requests and tokens; share it (`Arc`) between threads.
pub struct RateLimiter {
    table: Mutex<Table>,
}

impl RateLimiter {
    /// Tracks at most `capacity` keys (at least 1).
    pub fn new(capacity: usize) -> RateLimiter {
        RateLimiter {
            table: Mutex::new(Table {
                map: HashMap::new(),
                capacity: capacity.max(1),
            }),
        }
    }

    /// Admits one request for `key` and counts it, or refuses it without counting.
    pub fn check_request(&self, key: &str, rate: Rate, now: Instant) -> Decision {
        let s = Scale::of(rate);
        self.table.lock().with_entry(key, now, |e| {
            let level = e.requests.level(now, s);
            if !s.fits(level) {
                e.requests = Tat::at_level(now, level, s); // keeps a clamp, if any
                return s.decision(level, false);
            }
            let level = level + s.cost;
            e.requests = Tat::at_level(now, level, s);
            s.decision(level, true)
        })
    }

    /// Whether `key` has at least one token left; consumes nothing.
    pub fn check_tokens(&self, key: &str, rate: Rate, now: Instant) -> Decision {
        let s = Scale::of(rate);
        let level = self.table.lock().map.get_mut(key).map_or(0, |e| {
            let level = e.tokens.level(now, s);
            e.tokens = Tat::at_level(now, level, s); // keeps a clamp, if any
            level
        });
        s.decision(level, s.fits(level))
    }

    /// Counts `tokens` used by an answer. The bucket may go into debt, at most one
    /// window's worth: `key` is refused for no longer than one `per` afterwards.
    pub fn charge_tokens(&self, key: &str, rate: Rate, tokens: u64, now: Instant) {
        if tokens == 0 {
            return;
        }
        let s = Scale::of(rate);
        self.table.lock().with_entry(key, now, |e| {
            let charge = u128::from(tokens).saturating_mul(s.cost);
            let level = e.tokens.level(now, s).saturating_add(charge);
            e.tokens = Tat::at_level(now, level.min(s.ceiling()), s);
        });
    }

    /// Keys currently held (replenished ones included until the next purge).
    pub fn tracked(&self) -> usize {
        self.table.lock().map.len()
    }
}

#[cfg(test)]
mod tests;
