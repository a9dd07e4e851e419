//! Operator endpoints: `/metrics` (Prometheus text, in [`prometheus`]) and the `/admin/*` API (workers,
//! stats, drain, model refresh, client API keys). Admin routes need
//! `Authorization: Bearer <MODELRELAY_ADMIN_TOKEN>`; without a configured token they
//! answer 403, with a wrong one 401.

use std::time::Duration;

use log::info;
use serde_json::{json, Value};

use super::auth::authorize_admin;
use super::dispatcher::runtime::{Answer, Query, StatsSnapshot};
use super::dispatcher::Priority;
use super::errors::{ApiError, Style};
use super::http::request::{Conn, Request};
use super::keys::KeyGrant;
use super::metrics::HttpInner;
use super::reply::write_error;
use super::tenancy::identity::valid_tenant;
use super::tenancy::limits::Rate;
use super::Ctx;

mod prometheus;
pub use prometheus::{metrics, render};

fn ask(ctx: &Ctx, query: Query) -> Option<Answer> {
    super::dispatcher::runtime::ask(&ctx.inputs, query)
}

fn stats(ctx: &Ctx) -> Option<StatsSnapshot> {
    match ask(ctx, Query::Stats)? {
        Answer::Stats(s) => Some(*s),
        _ => None,
    }
}

fn unavailable() -> ApiError {
    ApiError::new(503, "dispatcher_unavailable", "the relay is shutting down")
}

/// Everything under `/admin/`.
pub fn admin(conn: &mut Conn, ctx: &Ctx, req: &Request) -> bool {
    let keep = req.keep_alive;
    if let Err(e) = authorize_admin(ctx, req, conn.peer.ip()) {
        return write_error(conn, Style::OpenAi, &e, keep, None);
    }
    let segments: Vec<&str> = req.path.trim_start_matches("/admin/").split('/').collect();
    let result = match (req.method.as_str(), segments.as_slice()) {
        ("GET", ["workers"]) => workers(ctx),
        ("GET", ["stats"]) => admin_stats(ctx),
        ("POST", ["workers", id, "drain"]) => drain(ctx, id, &req.body),
        ("POST", ["workers", id, "stay-awake"]) => super::power::stay_awake(ctx, id, &req.body),
        ("POST", ["models", "refresh"]) => refresh(ctx),
        ("GET", ["keys"]) => list_keys(ctx),
        ("POST", ["keys"]) => create_key(ctx, &req.body),
        ("DELETE", ["keys", id]) => revoke_key(ctx, id),
        _ => Err(ApiError::new(
            404,
            "not_found",
            format!("no admin route for {} {}", req.method, req.path),
        )),
    };
    match result {
        Ok((status, body)) => conn.write_json(status, &body, keep),
        Err(e) => write_error(conn, Style::OpenAi, &e, keep, None),
    }
}

/// Status and JSON body of an admin operation; the dashboard's actions call the same
/// functions, so both front ends behave alike.
pub type AdminResult = Result<(u16, Value), ApiError>;

// These run for the admin API and the dashboard alike: kept out of line so the binary
// holds one copy of each, not one per caller.
#[inline(never)]
pub fn workers(ctx: &Ctx) -> AdminResult {
    match ask(ctx, Query::Workers) {
        Some(Answer::Workers(list)) => {
            let list: Vec<Value> = list
                .into_iter()
                .map(|w| {
                    let slept = w.slept_secs;
                    let mut v = serde_json::to_value(w).unwrap_or(Value::Null);
                    v["provider"] = json!(ctx.cfg.provider);
                    v["energy_saved_wh"] = super::power::energy_saved(ctx, slept);
                    v
                })
                .collect();
            let sleeping = super::power::sleeping(ctx);
            Ok((200, json!({ "workers": list, "sleeping": sleeping })))
        }
        _ => Err(unavailable()),
    }
}

#[inline(never)]
pub fn admin_stats(ctx: &Ctx) -> AdminResult {
    let s = stats(ctx).ok_or_else(unavailable)?;
    let http = ctx.http_metrics.snapshot();
    let ms = |d: Duration| d.as_secs_f64() * 1000.0;
    let tokens: serde_json::Map<String, Value> = s
        .counters
        .tokens
        .iter()
        .map(|(m, (i, o))| (m.clone(), json!({"in": i, "out": o})))
        .collect();
    let by_status: serde_json::Map<String, Value> = http
        .requests
        .iter()
        .fold(
            std::collections::BTreeMap::<String, u64>::new(),
            |mut acc, ((_, _, class), n)| {
                *acc.entry(class.clone()).or_default() += n;
                acc
            },
        )
        .into_iter()
        .map(|(k, v)| (k, json!(v)))
        .collect();
    Ok((
        200,
        json!({
            "requests": {
                "completed": s.counters.completed,
                "failed": s.counters.failed,
                "failed_by_reason": s.counters.failed_by,
                "cancelled": s.counters.cancelled,
                "cancelled_by_reason": s.counters.cancelled_by,
                "requeued": s.counters.requeued,
                "failovers": s.counters.failovers,
                "busy_refusals": s.counters.busy,
                "dispatched": s.counters.dispatched,
                "by_status_class": by_status,
            },
            "affinity": {
                "hits": s.counters.affinity_hits,
                "misses": s.counters.affinity_misses,
                "overridden_by_load": s.counters.affinity_overridden,
                "waits": s.counters.affinity_waits,
            },
            "queue": {
                "depth": s.gauges.queue_depth,
                "wait_ms": {
                    "p50": ms(s.counters.wait_percentile(50)),
                    "p90": ms(s.counters.wait_percentile(90)),
                    "p95": ms(s.counters.wait_percentile(95)),
                    "p99": ms(s.counters.wait_percentile(99)),
                },
            },
            "in_flight": s.gauges.in_flight,
            "workers_connected": s.gauges.workers,
            "worker_slots": {"total": s.slots_total, "used": s.slots_used},
            "heartbeat_timeouts": s.counters.heartbeat_timeouts,
            "tokens_by_model": tokens,
            "keys": http.keys,
            "tenants": tenant_stats(&s, &http),
            "rate_limit_tenants_tracked": ctx.gate.tracked(),
            "auth_failures": http.auth_failures,
            "uptime_secs": ctx.shared.started.elapsed().as_secs_f64(),
        }),
    ))
}

/// Per tenant: waiting and running now (from the dispatcher), and what finished (from
/// the HTTP side, capped at `METRICS_MAX_TENANTS` names).
fn tenant_stats(s: &StatsSnapshot, http: &HttpInner) -> Value {
    let ms = |d: Duration| d.as_secs_f64() * 1000.0;
    let mut out = serde_json::Map::new();
    for (tenant, t) in &http.tenants {
        let (queued, in_flight) = s.tenants.get(tenant).copied().unwrap_or((0, 0));
        out.insert(
            tenant.clone(),
            json!({
                "queued": queued,
                "in_flight": in_flight,
                "completed": t.completed,
                "rejected_by_reason": t.rejected,
                "wait_ms": {"p50": ms(t.wait_percentile(50)), "p95": ms(t.wait_percentile(95))},
                "tokens": {"in": t.tokens_in, "out": t.tokens_out},
            }),
        );
    }
    for (tenant, (queued, in_flight)) in &s.tenants {
        if !out.contains_key(tenant) {
            out.insert(
                tenant.clone(),
                json!({"queued": queued, "in_flight": in_flight, "completed": 0,
                       "rejected_by_reason": {}, "wait_ms": {"p50": 0.0, "p95": 0.0},
                       "tokens": {"in": 0, "out": 0}}),
            );
        }
    }
    Value::Object(out)
}

#[inline(never)]
pub fn drain(ctx: &Ctx, id: &str, body: &[u8]) -> AdminResult {
    let worker = id
        .strip_prefix("w-")
        .and_then(|n| n.parse().ok())
        .ok_or_else(|| ApiError::new(404, "worker_not_found", format!("no worker `{id}`")))?;
    let timeout = if body.is_empty() {
        None
    } else {
        let v: Value = serde_json::from_slice(body).map_err(|e| {
            ApiError::new(400, "invalid_json", format!("body is not valid JSON: {e}"))
        })?;
        v.get("drain_timeout_secs")
            .and_then(Value::as_u64)
            .map(Duration::from_secs)
    };
    match ask(ctx, Query::Drain { worker, timeout }) {
        Some(Answer::Done(true)) => {
            info!("admin: draining worker {id}");
            Ok((202, json!({"worker": id, "draining": true})))
        }
        Some(_) => Err(ApiError::new(
            404,
            "worker_not_found",
            format!("no worker `{id}`"),
        )),
        None => Err(unavailable()),
    }
}

#[inline(never)]
pub fn refresh(ctx: &Ctx) -> AdminResult {
    match ask(ctx, Query::RefreshModels) {
        Some(Answer::Done(any)) => Ok((202, json!({"refresh_sent": any}))),
        _ => Err(unavailable()),
    }
}

fn key_store(ctx: &Ctx) -> Result<&super::keys::KeyStore, ApiError> {
    ctx.keys
        .as_ref()
        .ok_or_else(|| ApiError::new(500, "keys_unavailable", "API key store not loaded"))
}

pub fn list_keys(ctx: &Ctx) -> AdminResult {
    Ok((200, json!({ "keys": key_store(ctx)?.list() })))
}

#[inline(never)]
pub fn create_key(ctx: &Ctx, body: &[u8]) -> AdminResult {
    let v: Value = serde_json::from_slice(body)
        .map_err(|e| ApiError::new(400, "invalid_json", format!("body is not valid JSON: {e}")))?;
    let name = v
        .get("name")
        .and_then(Value::as_str)
        .map(str::trim)
        .filter(|n| !n.is_empty() && n.len() <= 200)
        .ok_or_else(|| {
            ApiError::new(
                400,
                "invalid_name",
                "`name` must be a non-empty string (at most 200 bytes)",
            )
        })?;
    let grant = key_grant(&v)?;
    let (record, secret) = key_store(ctx)?
        .create(name, grant.clone())
        .map_err(|e| ApiError::new(500, "key_store_error", e))?;
    info!("admin: created API key {} ({})", record.id, record.name);
    Ok((
        201,
        json!({"id": record.id, "name": record.name, "key": secret, "created_unix": record.created_unix,
               "tenant": grant.tenant, "max_priority": grant.max_priority,
               "rate_limit": grant.rate_limit, "weight": grant.weight}),
    ))
}

/// Reads and checks the optional `tenant`, `max_priority`, `rate_limit` and `weight` of a
/// new key.
fn key_grant(v: &Value) -> Result<KeyGrant, ApiError> {
    let bad = |code: &str, message: &str| ApiError::new(400, code, message);
    let text = |name: &str| -> Result<Option<String>, ApiError> {
        match v.get(name) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::String(s)) => Ok(Some(s.trim().to_string())),
            Some(_) => Err(bad(
                "invalid_key_field",
                &format!("`{name}` must be a string"),
            )),
        }
    };
    let tenant = text("tenant")?;
    if tenant.as_deref().is_some_and(|t| !valid_tenant(t)) {
        return Err(bad(
            "invalid_tenant",
            "`tenant` must be 1-64 characters of A-Z a-z 0-9 . _ : -",
        ));
    }
    let max_priority = text("max_priority")?;
    if let Some(p) = &max_priority {
        if Priority::parse(p).is_none() {
            return Err(bad(
                "invalid_priority",
                "`max_priority` must be high, normal or low",
            ));
        }
    }
    let rate_limit = text("rate_limit")?;
    if let Some(r) = &rate_limit {
        Rate::parse_requests(r).map_err(|e| bad("invalid_rate_limit", &e))?;
    }
    let weight = match v.get("weight") {
        None | Some(Value::Null) => None,
        Some(w) => Some(
            w.as_u64()
                .filter(|w| (1..=1000).contains(w))
                .ok_or_else(|| {
                    bad(
                        "invalid_weight",
                        "`weight` must be a whole number from 1 to 1000",
                    )
                })? as u32,
        ),
    };
    Ok(KeyGrant {
        tenant,
        max_priority: max_priority.map(|p| p.to_ascii_lowercase()),
        rate_limit,
        weight,
    })
}

#[inline(never)]
pub fn revoke_key(ctx: &Ctx, id: &str) -> AdminResult {
    match key_store(ctx)?.revoke(id) {
        Ok(true) => {
            info!("admin: revoked API key {id}");
            Ok((200, json!({"id": id, "revoked": true})))
        }
        Ok(false) => Err(ApiError::new(
            404,
            "key_not_found",
            format!("no API key `{id}`"),
        )),
        Err(e) => Err(ApiError::new(500, "key_store_error", e)),
    }
}
