//! Admission by rate: before a request is queued, its tenant's request rate and token
//! budget are checked ([`Gate::admit`]); after it finished, the tokens it used are
//! charged ([`Gate::charge`]). With no limit configured the gate is a no-op and the
//! limiter tables are never touched.

use std::time::{Instant, SystemTime, UNIX_EPOCH};

use super::identity::Caller;
use super::limits::Decision;
use super::policy::Policy;
use crate::server::errors::ApiError;
use crate::server::store::{Limits, Store};

/// Tenants whose limiter state is kept; idle ones are dropped first (see `limits.rs`).
pub const TRACKED_TENANTS: usize = 10_000;

/// The request-rate state a relayed answer reports in `x-ratelimit-*` headers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RateHeaders {
    pub limit: u64,
    pub remaining: u64,
    pub reset_ms: u64,
}

impl RateHeaders {
    /// OpenAI's header names, with the reset as a duration (`750ms`, `6s`).
    pub fn render(&self) -> [(&'static str, String); 3] {
        let reset = if self.reset_ms < 1000 {
            format!("{}ms", self.reset_ms)
        } else {
            format!("{}s", self.reset_ms.div_ceil(1000))
        };
        [
            ("x-ratelimit-limit-requests", self.limit.to_string()),
            ("x-ratelimit-remaining-requests", self.remaining.to_string()),
            ("x-ratelimit-reset-requests", reset),
        ]
    }
}

/// Per-tenant request and token limiters under one policy.
pub struct Gate {
    policy: Policy,
    requests: Box<dyn Limits>,
    tokens: Box<dyn Limits>,
}

impl Gate {
    /// A gate whose limiters live in this relay, alone.
    pub fn new(policy: Policy) -> Gate {
        let store = Store::local(std::path::Path::new(""));
        Gate::with_store(policy, &store, &crate::server::shared::Shared::new())
    }

    /// A gate whose buckets live where `store` keeps limits; kept per relay, they are
    /// divided by the relays the workers report (`relays`).
    pub fn with_store(
        policy: Policy,
        store: &Store,
        relays: &std::sync::Arc<crate::server::shared::Shared>,
    ) -> Gate {
        Gate {
            policy,
            requests: store.limits("requests", TRACKED_TENANTS, relays),
            tokens: store.limits("tokens", TRACKED_TENANTS, relays),
        }
    }

    pub fn policy(&self) -> &Policy {
        &self.policy
    }

    /// Checks the caller's token budget, then takes one request from its rate. Returns
    /// the headers to report, or the 429 to answer.
    pub fn admit(&self, caller: &Caller, now: Instant) -> Result<Option<RateHeaders>, ApiError> {
        let tenant = &*caller.who.tenant;
        if let Some(rate) = self.policy.token_rate(tenant) {
            let d = self.tokens.check_tokens(tenant, rate, now);
            if !d.allowed {
                return Err(refusal(tenant, "tokens", &rate.to_string(), &d));
            }
        }
        let Some(rate) = self.policy.request_rate(tenant, caller.key_rate()) else {
            return Ok(None);
        };
        let d = self.requests.check_request(tenant, rate, now);
        if !d.allowed {
            return Err(refusal(tenant, "requests", &rate.to_string(), &d));
        }
        Ok(Some(RateHeaders {
            limit: d.limit,
            remaining: d.remaining,
            reset_ms: d.reset_after.as_millis() as u64,
        }))
    }

    /// Whether a finished request of `tenant` is charged tokens: a charge may be a
    /// round trip to the shared store, which only a thread that may wait can make.
    pub fn charges_tokens(&self, tenant: &str) -> bool {
        self.policy.token_rate(tenant).is_some()
    }

    /// Charges the tokens a finished request used against its tenant's budget.
    pub fn charge(&self, tenant: &str, tokens: u64, now: Instant) {
        if tokens == 0 {
            return;
        }
        if let Some(rate) = self.policy.token_rate(tenant) {
            self.tokens.charge_tokens(tenant, rate, tokens, now);
        }
    }

    /// Tenants with limiter state (bounded; for tests and stats).
    pub fn tracked(&self) -> usize {
        self.requests.tracked() + self.tokens.tracked()
    }
}

/// The 429 for a tenant over its limit, in the seed's shape: `limit`, `remaining` and
/// `resetAt` (Unix seconds) inside the usual error object, and `Retry-After`.
fn refusal(tenant: &str, what: &str, rate: &str, d: &Decision) -> ApiError {
    let now_ms = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|t| t.as_millis() as u64)
        .unwrap_or(0);
    let retry = u32::try_from(d.retry_after_secs()).unwrap_or(u32::MAX);
    ApiError::new(
        429,
        "rate_limit_exceeded",
        format!("tenant {tenant} exceeded its {what} limit of {rate}"),
    )
    .retry_after(retry)
    .field("limit", d.limit)
    .field("remaining", d.remaining)
    .field("resetAt", d.reset_at_unix_ms(now_ms).div_ceil(1000))
}
