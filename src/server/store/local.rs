//! The per-relay backends: today's replay file and in-memory limiter.

use std::time::Instant;

use super::Limits;
#[cfg(feature = "governance")]
use super::Nonces;
#[cfg(feature = "governance")]
use crate::server::lifecycle::governance::{replay::Remembered, NonceStore};
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
