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
mod tests {
    use super::*;
    use std::sync::Arc;

    const SEC: Duration = Duration::from_secs(1);
    const MIN: Duration = Duration::from_secs(60);

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    fn per_min(n: u64) -> Rate {
        Rate::requests(n, MIN)
    }

    fn tok_per_min(n: u64) -> Rate {
        Rate::tokens(n, MIN)
    }

    /// Sends `n` requests at `at`, returns how many passed.
    fn burst(lim: &RateLimiter, key: &str, rate: Rate, at: Instant, n: usize) -> usize {
        (0..n)
            .filter(|_| lim.check_request(key, rate, at).allowed)
            .count()
    }

    #[test]
    fn parse_and_display_round_trip() {
        for s in ["100req/min", "10req/s", "500req/h", "1req/s"] {
            assert_eq!(Rate::parse_requests(s).unwrap().to_string(), s);
        }
        for s in ["50000tok/min", "1000tok/s", "2000000tok/h"] {
            assert_eq!(Rate::parse_tokens(s).unwrap().to_string(), s);
        }
        assert_eq!(Rate::parse_requests("100req/min").unwrap(), per_min(100));
        assert_eq!(
            Rate::parse_tokens("50000tok/min").unwrap(),
            tok_per_min(50_000)
        );
    }

    #[test]
    fn parse_accepts_period_aliases() {
        let cases = [
            ("sec", "s"),
            ("second", "s"),
            ("m", "min"),
            ("minute", "min"),
            ("hour", "h"),
        ];
        for (alias, canonical) in cases {
            let r = Rate::parse_requests(&format!("7req/{alias}")).unwrap();
            assert_eq!(r.to_string(), format!("7req/{canonical}"));
            let t = Rate::parse_tokens(&format!(" 9tok/{alias} ")).unwrap();
            assert_eq!(t.to_string(), format!("9tok/{canonical}"));
        }
        assert_eq!(Rate::parse_requests("10req/s").unwrap().per, SEC);
        assert_eq!(Rate::parse_requests("500req/h").unwrap().per, 60 * MIN);
    }

    #[test]
    fn parse_errors_name_the_bad_text() {
        let bad_requests = [
            ("", "missing `/`"),
            ("100req", "missing `/`"),
            ("req/min", "missing amount"),
            ("-1req/min", "missing amount"),
            ("0req/min", "at least 1"),
            ("10/min", "unit must be `req`"),
            ("10tok/min", "unit must be `req`, not `tok`"),
            ("10 req/min", "not ` req`"),
            ("10req/day", "unknown period `day`"),
            ("10req/min/x", "unknown period `min/x`"),
            ("10req/MIN", "unknown period `MIN`"),
            ("99999999999999999999999req/s", "too large"),
        ];
        for (input, why) in bad_requests {
            let err = Rate::parse_requests(input).unwrap_err();
            assert!(err.contains(&format!("`{input}`")), "{err}");
            assert!(err.contains(why), "{input}: {err}");
            assert!(err.contains("100req/min"), "{err}");
        }
        let err = Rate::parse_tokens("100req/min").unwrap_err();
        assert!(err.contains("invalid token rate `100req/min`"), "{err}");
        assert!(err.contains("unit must be `tok`, not `req`"), "{err}");
    }

    #[test]
    fn display_of_a_hand_built_period() {
        assert_eq!(Rate::requests(5, 30 * SEC).to_string(), "5req/30s");
    }

    #[test]
    fn burst_of_exactly_amount_then_refused_with_retry_after() {
        let lim = RateLimiter::new(16);
        let t0 = Instant::now();
        assert_eq!(burst(&lim, "a", per_min(10), t0, 10), 10);
        let d = lim.check_request("a", per_min(10), t0);
        assert!(!d.allowed);
        assert_eq!(d.limit, 10);
        assert_eq!(d.remaining, 0);
        assert_eq!(d.retry_after, 6 * SEC);
        assert_eq!(d.retry_after_secs(), 6);
        assert_eq!(d.reset_after, MIN);
    }

    #[test]
    fn one_more_passes_after_retry_after() {
        let lim = RateLimiter::new(16);
        let t0 = Instant::now();
        let rate = per_min(10);
        burst(&lim, "a", rate, t0, 10);
        let wait = lim.check_request("a", rate, t0).retry_after;
        let early = lim.check_request("a", rate, t0 + wait - Duration::from_nanos(1));
        assert!(!early.allowed);
        assert_eq!(early.retry_after, Duration::from_nanos(1));
        let d = lim.check_request("a", rate, t0 + wait);
        assert!(d.allowed);
        assert_eq!(d.retry_after, Duration::ZERO);
        assert_eq!(d.remaining, 0);
        let next = lim.check_request("a", rate, t0 + wait);
        assert!(!next.allowed);
        assert_eq!(next.retry_after, 6 * SEC);
    }

    #[test]
    fn remaining_counts_down() {
        let lim = RateLimiter::new(16);
        let t0 = Instant::now();
        for expected in (0..10).rev() {
            let d = lim.check_request("a", per_min(10), t0);
            assert!(d.allowed);
            assert_eq!(d.remaining, expected);
            assert_eq!(d.limit, 10);
        }
    }

    #[test]
    fn reset_after_is_time_to_full_replenishment() {
        let lim = RateLimiter::new(16);
        let t0 = Instant::now();
        let rate = per_min(10);
        assert_eq!(lim.check_request("a", rate, t0).reset_after, 6 * SEC);
        burst(&lim, "a", rate, t0, 3);
        // 4 requests at t0 drain in 24 s; 10 s later 14 s are left, then one more adds 6 s.
        let d = lim.check_request("a", rate, t0 + 10 * SEC);
        assert_eq!(d.reset_after, 20 * SEC);
        assert_eq!(d.remaining, 6);
        assert_eq!(d.reset_at_unix_ms(1_000_000), 1_020_000);
        let later = lim.check_request("a", rate, t0 + 10 * MIN);
        assert_eq!(later.remaining, 9);
        assert_eq!(later.reset_after, 6 * SEC);
    }

    #[test]
    fn refused_request_does_not_consume() {
        let lim = RateLimiter::new(16);
        let t0 = Instant::now();
        let rate = per_min(10);
        burst(&lim, "a", rate, t0, 10);
        for i in 0..100 {
            assert!(!lim.check_request("a", rate, t0 + ms(i * 50)).allowed);
        }
        assert!(lim.check_request("a", rate, t0 + 6 * SEC).allowed);
    }

    #[test]
    fn sliding_no_double_burst_at_window_edge() {
        let lim = RateLimiter::new(16);
        let t0 = Instant::now();
        let rate = per_min(10);
        // A full burst just before a minute boundary...
        assert_eq!(burst(&lim, "a", rate, t0 + 59 * SEC, 10), 10);
        // ...and just after it a fixed window would allow 10 more; GCRA allows none,
        assert_eq!(burst(&lim, "a", rate, t0 + 61 * SEC, 10), 0);
        // then one per emission interval (6 s).
        assert_eq!(burst(&lim, "a", rate, t0 + 65 * SEC, 10), 1);
        assert_eq!(burst(&lim, "a", rate, t0 + 71 * SEC, 10), 1);
        // A full burst again only once the whole window has drained.
        assert_eq!(burst(&lim, "a", rate, t0 + 137 * SEC, 20), 10);
    }

    #[test]
    fn steady_rate_is_one_per_emission_interval() {
        let lim = RateLimiter::new(16);
        let t0 = Instant::now();
        let rate = per_min(10);
        burst(&lim, "a", rate, t0, 10);
        let passed = (1..=600)
            .filter(|&s| lim.check_request("a", rate, t0 + s * 100 * ms(1)).allowed)
            .count();
        assert_eq!(passed, 10, "one per 6 s over the next minute");
    }

    #[test]
    fn odd_rates_are_exact() {
        let lim = RateLimiter::new(16);
        let t0 = Instant::now();
        let seven = Rate::requests(7, SEC);
        assert_eq!(burst(&lim, "a", seven, t0, 8), 7);
        assert_eq!(burst(&lim, "a", seven, t0 + SEC, 8), 7);
        // T = 999.997 ns: rounding T to whole nanoseconds would admit ~3000 too many.
        let fine = Rate::requests(1_000_003, SEC);
        assert_eq!(burst(&lim, "b", fine, t0, 1_000_010), 1_000_003);
        let finer = Rate::requests(3_000_000_000, SEC);
        assert_eq!(burst(&lim, "c", finer, t0, 10), 10);
    }

    #[test]
    fn token_check_does_not_consume() {
        let lim = RateLimiter::new(16);
        let t0 = Instant::now();
        for _ in 0..100 {
            let d = lim.check_tokens("a", tok_per_min(50_000), t0);
            assert!(d.allowed);
            assert_eq!(d.remaining, 50_000);
            assert_eq!(d.reset_after, Duration::ZERO);
        }
        assert_eq!(lim.tracked(), 0, "a check alone does not track a key");
    }

    #[test]
    fn token_charges_count_down_and_replenish() {
        let lim = RateLimiter::new(16);
        let t0 = Instant::now();
        let rate = tok_per_min(50_000);
        lim.charge_tokens("a", rate, 20_000, t0);
        let d = lim.check_tokens("a", rate, t0);
        assert!(d.allowed);
        assert_eq!(d.remaining, 30_000);
        assert_eq!(d.reset_after, 24 * SEC);
        assert_eq!(lim.check_tokens("a", rate, t0 + 12 * SEC).remaining, 40_000);
        assert_eq!(lim.check_tokens("a", rate, t0 + 24 * SEC).remaining, 50_000);
    }

    #[test]
    fn token_overcharge_refuses_until_replenished() {
        let lim = RateLimiter::new(16);
        let t0 = Instant::now();
        let rate = tok_per_min(50_000);
        assert!(lim.check_tokens("a", rate, t0).allowed);
        lim.charge_tokens("a", rate, 60_000, t0);
        let d = lim.check_tokens("a", rate, t0);
        assert!(!d.allowed);
        assert_eq!(d.remaining, 0);
        // 72 s of backlog; one token fits once it is down to 60 s − 1.2 ms.
        assert_eq!(d.retry_after, 12 * SEC + Duration::from_micros(1_200));
        assert_eq!(d.retry_after_secs(), 13);
        assert_eq!(d.reset_after, 72 * SEC);
        assert!(
            !lim.check_tokens("a", rate, t0 + d.retry_after - ms(1))
                .allowed
        );
        let after = lim.check_tokens("a", rate, t0 + d.retry_after);
        assert!(after.allowed);
        assert_eq!(after.remaining, 1);
    }

    #[test]
    fn token_debt_is_clamped_to_one_window() {
        let lim = RateLimiter::new(16);
        let t0 = Instant::now();
        let rate = tok_per_min(50_000);
        lim.charge_tokens("a", rate, 10_000_000, t0);
        lim.charge_tokens("a", rate, u64::MAX, t0);
        let d = lim.check_tokens("a", rate, t0);
        assert!(!d.allowed);
        assert_eq!(d.retry_after, MIN);
        assert_eq!(d.reset_after, 2 * MIN - Duration::from_micros(1_200));
        assert!(!lim.check_tokens("a", rate, t0 + MIN - ms(1)).allowed);
        let back = lim.check_tokens("a", rate, t0 + MIN);
        assert!(back.allowed);
        assert_eq!(back.remaining, 1);
    }

    #[test]
    fn tenants_and_kinds_are_independent() {
        let lim = RateLimiter::new(16);
        let t0 = Instant::now();
        assert_eq!(burst(&lim, "a", per_min(10), t0, 20), 10);
        assert_eq!(burst(&lim, "b", per_min(10), t0, 20), 10);
        lim.charge_tokens("c", tok_per_min(100), 1_000, t0);
        assert!(!lim.check_tokens("c", tok_per_min(100), t0).allowed);
        assert!(lim.check_tokens("a", tok_per_min(100), t0).allowed);
        assert!(lim.check_request("c", per_min(10), t0).allowed);
        assert_eq!(lim.tracked(), 3);
    }

    #[test]
    fn flood_of_keys_stays_within_capacity() {
        let lim = RateLimiter::new(1_000);
        let t0 = Instant::now();
        let rate = per_min(10);
        assert_eq!(burst(&lim, "busy", rate, t0, 10), 10);
        for i in 0..100_000u64 {
            let d = lim.check_request(&format!("made-up-{i}"), rate, t0 + ms(i / 10));
            assert!(d.allowed);
            assert!(lim.tracked() <= 1_000);
        }
        // The flood's entries were closer to replenishment than the busy tenant's.
        // (10 s after its burst, one request has come back, not ten.)
        assert_eq!(burst(&lim, "busy", rate, t0 + ms(10_000), 10), 1);
    }

    #[test]
    fn replenished_entries_are_purged_before_live_ones() {
        let lim = RateLimiter::new(4);
        let t0 = Instant::now();
        let rate = per_min(10);
        for key in ["a", "b", "c"] {
            assert!(lim.check_request(key, rate, t0).allowed);
        }
        assert_eq!(burst(&lim, "busy", rate, t0, 10), 10);
        assert_eq!(lim.tracked(), 4);
        // At t0 + 10 s a, b and c are replenished, "busy" is not.
        assert!(lim.check_request("new", rate, t0 + 10 * SEC).allowed);
        assert_eq!(lim.tracked(), 2);
        assert_eq!(burst(&lim, "busy", rate, t0 + 10 * SEC, 10), 1);
    }

    #[test]
    fn eviction_drops_the_entry_closest_to_replenishment() {
        let lim = RateLimiter::new(3);
        let t0 = Instant::now();
        let rate = per_min(10);
        burst(&lim, "two", rate, t0, 2);
        burst(&lim, "one", rate, t0, 1);
        burst(&lim, "three", rate, t0, 3);
        assert!(lim.check_request("new", rate, t0).allowed);
        assert_eq!(lim.tracked(), 3);
        // "one" was dropped: it gets a fresh burst; the others kept their counts.
        assert_eq!(lim.check_request("one", rate, t0).remaining, 9);
        assert_eq!(lim.check_request("three", rate, t0).remaining, 6);
    }

    #[test]
    fn tiny_capacity_and_degenerate_rates_do_not_panic() {
        let lim = RateLimiter::new(0);
        let t0 = Instant::now();
        for i in 0..10 {
            lim.check_request(&format!("k{i}"), per_min(1), t0);
            assert_eq!(lim.tracked(), 1);
        }
        let zero = Rate::requests(0, Duration::ZERO);
        assert!(lim.check_request("z", zero, t0).allowed);
        assert!(!lim.check_request("z", zero, t0).allowed);
        let huge = Rate::tokens(u64::MAX, Duration::MAX);
        lim.charge_tokens("h", huge, u64::MAX, t0);
        let d = lim.check_tokens("h", huge, t0);
        assert!(!d.allowed);
        assert!(d.retry_after <= MAX_PER, "{d:?}");
    }

    #[test]
    fn rate_change_keeps_lockout_within_new_window() {
        let lim = RateLimiter::new(16);
        let t0 = Instant::now();
        burst(&lim, "a", Rate::requests(100, 60 * MIN), t0, 100);
        let d = lim.check_request("a", Rate::requests(10, SEC), t0);
        assert!(!d.allowed);
        assert!(d.retry_after <= SEC, "{d:?}");
        assert!(d.reset_after < 2 * SEC, "{d:?}");
        assert!(
            lim.check_request("a", Rate::requests(10, SEC), t0 + SEC)
                .allowed
        );
        lim.charge_tokens("a", tok_per_min(1_000), 5_000, t0);
        let tok = lim.check_tokens("a", Rate::tokens(1_000, SEC), t0);
        assert_eq!(tok.retry_after, SEC);
        assert!(
            lim.check_tokens("a", Rate::tokens(1_000, SEC), t0 + SEC)
                .allowed
        );
    }

    #[test]
    fn retry_after_secs_rounds_up() {
        let d = |allowed, retry_after| Decision {
            allowed,
            limit: 1,
            remaining: 0,
            reset_after: Duration::ZERO,
            retry_after,
        };
        assert_eq!(d(false, ms(200)).retry_after_secs(), 1);
        assert_eq!(d(false, Duration::ZERO).retry_after_secs(), 1);
        assert_eq!(d(false, 6 * SEC).retry_after_secs(), 6);
        assert_eq!(d(false, 6 * SEC + ms(1)).retry_after_secs(), 7);
        assert_eq!(d(true, Duration::ZERO).retry_after_secs(), 0);
        let reset = Decision {
            reset_after: Duration::from_micros(1_500),
            ..d(true, Duration::ZERO)
        };
        assert_eq!(reset.reset_at_unix_ms(1_000), 1_002);
    }

    #[test]
    fn concurrent_requests_admit_exactly_the_burst() {
        let lim = Arc::new(RateLimiter::new(16));
        let t0 = Instant::now();
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let lim = Arc::clone(&lim);
                std::thread::spawn(move || burst(&lim, "a", per_min(10), t0, 100))
            })
            .collect();
        let passed: usize = threads.into_iter().map(|t| t.join().unwrap()).sum();
        assert_eq!(passed, 10);
    }

    /// `cargo test --release --lib tenancy -- --ignored --nocapture`
    #[test]
    #[ignore]
    fn timing_check_request() {
        let t0 = Instant::now();
        let keys: Vec<String> = (0..1_000).map(|i| format!("tenant-{i}")).collect();
        let lim = RateLimiter::new(10_000);
        let rate = Rate::requests(100, SEC);
        let n = 2_000_000u32;
        let start = Instant::now();
        for i in 0..n {
            let key = &keys[i as usize % keys.len()];
            lim.check_request(key, rate, t0 + Duration::from_micros(u64::from(i)));
        }
        let per_call = start.elapsed() / n;
        println!("check_request, 1000 live keys: {per_call:?}/call");

        let flood: Vec<String> = (0..500_000).map(|i| format!("made-up-{i}")).collect();
        let lim = RateLimiter::new(10_000);
        let start = Instant::now();
        for (i, key) in flood.iter().enumerate() {
            lim.check_request(key, rate, t0 + Duration::from_micros(i as u64));
        }
        let per_call = start.elapsed() / flood.len() as u32;
        println!("check_request, flood of new keys, capacity 10000: {per_call:?}/call");
        assert!(lim.tracked() <= 10_000);
    }
}
