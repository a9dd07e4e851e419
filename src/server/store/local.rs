//! The per-relay backends: today's replay file and in-memory limiter, the latter as
//! this relay's share of a limit the whole fleet must keep.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

use super::Limits;
#[cfg(feature = "governance")]
use super::Nonces;
#[cfg(feature = "governance")]
use crate::server::lifecycle::governance::{replay::Remembered, NonceStore};
use crate::server::shared::Shared;
use crate::server::tenancy::limits::{Decision, Rate, RateLimiter};

#[cfg(feature = "governance")]
impl Nonces for NonceStore {
    fn remember(&self, nonce: &str, issued_at: u64, now: u64) -> Remembered {
        NonceStore::remember(self, nonce, issued_at, now)
    }
}

impl Limits for RateLimiter {
    fn check_request(&self, key: &str, rate: Rate, now: Instant) -> Decision {
        RateLimiter::check_request(self, key, rate, now)
    }
    fn check_tokens(&self, key: &str, rate: Rate, now: Instant) -> Decision {
        RateLimiter::check_tokens(self, key, rate, now)
    }
    fn charge_tokens(&self, key: &str, rate: Rate, tokens: u64, now: Instant) {
        RateLimiter::charge_tokens(self, key, rate, tokens, now)
    }
    fn tracked(&self) -> usize {
        RateLimiter::tracked(self)
    }
}

/// A limit kept by this relay alone while several relays serve the pool (no shared
/// store, or the store unreachable): each relay admits its share, the rate divided by
/// the live relay count its workers report (rounded down, at least 1), so the fleet
/// stays within the limit. One relay alone keeps the whole rate.
pub struct Share {
    limiter: RateLimiter,
    relays: Arc<Shared>,
    /// The count last applied (logged when it changes).
    applied: AtomicUsize,
}

impl Share {
    pub fn new(limiter: RateLimiter, relays: Arc<Shared>) -> Share {
        Share {
            limiter,
            relays,
            applied: AtomicUsize::new(1),
        }
    }

    /// This relay's part of `rate`.
    fn part(&self, rate: Rate) -> Rate {
        let n = self.relays.relays_reported();
        // Written only on a change: admission threads do not contend on it.
        if self.applied.load(Ordering::Relaxed) != n && self.applied.swap(n, Ordering::Relaxed) != n
        {
            log::info!(
                "rate limits kept per relay with {n} relay(s) serving the pool: this relay admits 1/{n} of each limit"
            );
        }
        share_of(rate, n)
    }
}

/// `rate` divided among `relays`, rounded down but at least one unit.
pub fn share_of(rate: Rate, relays: usize) -> Rate {
    let n = u64::try_from(relays.max(1)).unwrap_or(u64::MAX);
    Rate {
        amount: (rate.amount / n).max(1),
        ..rate
    }
}

impl Limits for Share {
    fn check_request(&self, key: &str, rate: Rate, now: Instant) -> Decision {
        self.limiter.check_request(key, self.part(rate), now)
    }
    fn check_tokens(&self, key: &str, rate: Rate, now: Instant) -> Decision {
        self.limiter.check_tokens(key, self.part(rate), now)
    }
    fn charge_tokens(&self, key: &str, rate: Rate, tokens: u64, now: Instant) {
        self.limiter
            .charge_tokens(key, self.part(rate), tokens, now)
    }
    fn tracked(&self) -> usize {
        self.limiter.tracked()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn a_share_is_the_rate_divided_rounded_down_but_never_zero() {
        let rate = Rate::requests(60, Duration::from_secs(60));
        assert_eq!(share_of(rate, 1), rate);
        assert_eq!(share_of(rate, 0), rate);
        assert_eq!(share_of(rate, 2).amount, 30);
        assert_eq!(share_of(rate, 7).amount, 8);
        assert_eq!(share_of(rate, 100).amount, 1);
        assert_eq!(share_of(rate, 2).per, rate.per);
    }

    #[test]
    fn a_relay_alone_admits_the_whole_rate_and_one_of_three_a_third() {
        let shared = Shared::new();
        let share = Share::new(RateLimiter::new(16), shared.clone());
        let rate = Rate::requests(6, Duration::from_secs(60));
        let now = Instant::now();
        let admitted = |key: &str| {
            (0..10)
                .filter(|_| share.check_request(key, rate, now).allowed)
                .count()
        };
        assert_eq!(admitted("alone"), 6);
        shared.publish(&crate::server::dispatcher::Gauges {
            relays: 3,
            ..Default::default()
        });
        assert_eq!(admitted("three"), 2);
        let d = share.check_request("fresh", rate, now);
        assert_eq!(d.limit, 2, "the headers tell this relay's share");
    }
}
