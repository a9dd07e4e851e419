//! Unit tests of `limits`.

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
