//! Who is asking: the caller's API key (when keys are on), tenant, priority and
//! fair-share weight, read from the key and the `X-Tenant-ID` / `X-Priority` headers.
//!
//! With keys, the tenant is the key's (a key without one is a tenant of its own, named
//! by its id) and a header naming another tenant is refused: a key holder cannot spend
//! another tenant's share. Without keys, `X-Tenant-ID` names the tenant, else `default`.
//! `X-Priority` is capped at the key's `max_priority`, silently (the access log shows it).

use std::sync::Arc;

use super::limits::Rate;
use super::policy::Policy;
use crate::server::dispatcher::{Priority, Who, DEFAULT_TENANT};
use crate::server::errors::ApiError;
use crate::server::http::request::Request;
use crate::server::keys::VerifiedKey;

/// Who is calling, as the relay treats them.
#[derive(Debug, Clone, Default)]
pub struct Caller {
    /// The matched API key, when keys are required.
    pub key: Option<VerifiedKey>,
    /// Header carrying the relay key, removed from the forwarded headers.
    pub consumed_header: Option<&'static str>,
    /// Tenant, priority (after capping) and weight.
    pub who: Who,
    /// The priority the client asked for, before the key's cap.
    pub asked: Priority,
    /// Whether the client named a tenant or priority itself (then both are forwarded).
    pub explicit: bool,
}

impl Caller {
    pub fn key_id(&self) -> Option<&str> {
        self.key.as_ref().map(|k| k.id.as_str())
    }

    /// The caller as far as its key tells, for counting a refused request against the
    /// key's tenant; `None` without a key.
    pub fn with_key_tenant(&self) -> Option<Caller> {
        let key = self.key.as_ref()?;
        let tenant = key.grant.tenant.as_deref().unwrap_or(&key.id);
        let mut caller = self.clone();
        caller.who.tenant = Arc::from(tenant);
        Some(caller)
    }

    /// The key's own request rate, which overrides the tenant's.
    pub fn key_rate(&self) -> Option<Rate> {
        let text = self.key.as_ref()?.grant.rate_limit.as_deref()?;
        Rate::parse_requests(text).ok()
    }
}

/// A valid tenant id: 1–64 characters of `[A-Za-z0-9._:-]`.
pub fn valid_tenant(id: &str) -> bool {
    (1..=64).contains(&id.len())
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._:-".contains(&b))
}

/// Completes `caller` (already authenticated) with tenant, priority and weight.
pub fn identify(req: &Request, mut caller: Caller, policy: &Policy) -> Result<Caller, ApiError> {
    let named = req.header("x-tenant-id").map(str::trim);
    if let Some(t) = named {
        if !valid_tenant(t) {
            return Err(ApiError::new(
                400,
                "invalid_tenant",
                "X-Tenant-ID must be 1-64 characters of A-Z a-z 0-9 . _ : -",
            ));
        }
    }
    let asked = match req.header("x-priority") {
        None => Priority::Normal,
        Some(p) => Priority::parse(p).ok_or_else(|| {
            ApiError::new(
                400,
                "invalid_priority",
                "X-Priority must be high, normal or low",
            )
        })?,
    };
    let (tenant, cap, key_weight) = match &caller.key {
        Some(key) => {
            let own = key.grant.tenant.as_deref().unwrap_or(&key.id);
            if named.is_some_and(|t| t != own) {
                return Err(ApiError::new(
                    403,
                    "tenant_mismatch",
                    "X-Tenant-ID differs from the tenant of this API key",
                ));
            }
            let cap = key.grant.max_priority.as_deref().and_then(Priority::parse);
            (own.to_string(), cap, key.grant.weight)
        }
        None => (named.unwrap_or(DEFAULT_TENANT).to_string(), None, None),
    };
    let weight = key_weight.unwrap_or_else(|| policy.weight(&tenant)).max(1);
    caller.explicit = named.is_some() || req.header("x-priority").is_some();
    caller.asked = asked;
    caller.who = Who {
        tenant: Arc::from(tenant),
        priority: cap.map_or(asked, |c| asked.min(c)),
        weight,
    };
    Ok(caller)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tenant_ids_are_checked() {
        assert!(valid_tenant("team-a.prod:1_x"));
        assert!(!valid_tenant(""));
        assert!(!valid_tenant("a b"));
        assert!(!valid_tenant(&"x".repeat(65)));
        assert!(valid_tenant(&"x".repeat(64)));
    }
}
