//! Which limits apply to whom, from the environment:
//!
//! | variable | meaning |
//! |---|---|
//! | `TENANT_RATE_LIMIT_<tenant>=100req/min` | that tenant's request rate (`/s`, `/min`, `/h`) |
//! | `TENANT_TOKEN_LIMIT_<tenant>=50000tok/min` | that tenant's token budget |
//! | `TENANT_WEIGHT_<tenant>=3` | that tenant's fair-share weight (default 1) |
//! | `DEFAULT_RATE_LIMIT`, `DEFAULT_TOKEN_LIMIT` | for tenants without their own |
//!
//! A key's own `rate_limit` overrides both rate sources. The tenant part of a variable
//! name may contain `-` (environment names allow it even if shells make it awkward).

use std::collections::HashMap;

use super::identity::valid_tenant;
use super::limits::Rate;

const RATE_PREFIX: &str = "TENANT_RATE_LIMIT_";
const TOKEN_PREFIX: &str = "TENANT_TOKEN_LIMIT_";
const WEIGHT_PREFIX: &str = "TENANT_WEIGHT_";

/// Per-tenant limits and weights. Empty by default: no limits, every weight 1.
#[derive(Debug, Clone, Default)]
pub struct Policy {
    pub default_rate: Option<Rate>,
    pub default_tokens: Option<Rate>,
    pub rates: HashMap<String, Rate>,
    pub tokens: HashMap<String, Rate>,
    pub weights: HashMap<String, u32>,
}

impl Policy {
    /// Reads the per-tenant variables from `vars` (the process environment) plus the two
    /// defaults; any malformed value is an error naming the variable.
    pub fn from_env(
        vars: impl Iterator<Item = (String, String)>,
        default_rate: Option<&str>,
        default_tokens: Option<&str>,
    ) -> Result<Policy, String> {
        let mut p = Policy {
            default_rate: default_rate
                .map(|v| Rate::parse_requests(v).map_err(|e| format!("DEFAULT_RATE_LIMIT: {e}")))
                .transpose()?,
            default_tokens: default_tokens
                .map(|v| Rate::parse_tokens(v).map_err(|e| format!("DEFAULT_TOKEN_LIMIT: {e}")))
                .transpose()?,
            ..Policy::default()
        };
        for (name, value) in vars {
            p.read_var(&name, &value)?;
        }
        Ok(p)
    }

    fn read_var(&mut self, name: &str, value: &str) -> Result<(), String> {
        let bad = |e: String| format!("{name}: {e}");
        if let Some(t) = tenant_part(name, RATE_PREFIX)? {
            self.rates
                .insert(t, Rate::parse_requests(value).map_err(bad)?);
        } else if let Some(t) = tenant_part(name, TOKEN_PREFIX)? {
            self.tokens
                .insert(t, Rate::parse_tokens(value).map_err(bad)?);
        } else if let Some(t) = tenant_part(name, WEIGHT_PREFIX)? {
            let w = value
                .trim()
                .parse::<u32>()
                .ok()
                .filter(|w| (1..=1000).contains(w))
                .ok_or_else(|| bad(format!("`{value}` is not a weight from 1 to 1000")))?;
            self.weights.insert(t, w);
        }
        Ok(())
    }

    /// The request rate for `tenant`: the key's, else the tenant's, else the default.
    pub fn request_rate(&self, tenant: &str, key_rate: Option<Rate>) -> Option<Rate> {
        key_rate
            .or_else(|| self.rates.get(tenant).copied())
            .or(self.default_rate)
    }

    /// The token budget for `tenant`, if any.
    pub fn token_rate(&self, tenant: &str) -> Option<Rate> {
        self.tokens.get(tenant).copied().or(self.default_tokens)
    }

    pub fn weight(&self, tenant: &str) -> u32 {
        self.weights.get(tenant).copied().unwrap_or(1)
    }

    /// Whether any limit is configured at all (the default path skips the limiter).
    pub fn limits_anything(&self) -> bool {
        self.default_rate.is_some()
            || self.default_tokens.is_some()
            || !self.rates.is_empty()
            || !self.tokens.is_empty()
    }
}

/// The tenant named by `name` after `prefix`, checked like an `X-Tenant-ID`.
fn tenant_part(name: &str, prefix: &str) -> Result<Option<String>, String> {
    let Some(t) = name.strip_prefix(prefix) else {
        return Ok(None);
    };
    if !valid_tenant(t) {
        return Err(format!("{name}: `{t}` is not a valid tenant id"));
    }
    Ok(Some(t.to_string()))
}
