//! `GET /metrics`: every metric family in the Prometheus text format, from one
//! dispatcher stats snapshot plus the HTTP-side counters. Apart from the admin routes in
//! the parent module because it writes text for a scraper and needs no admin token; the
//! two share only the dispatcher query.

use std::time::Duration;

use super::super::dispatcher::runtime::StatsSnapshot;
use super::super::errors::Style;
use super::super::http::request::{Conn, Request};
use super::super::metrics::{Exposition, HttpInner};
use super::super::reply::write_error;
use super::super::Ctx;
use super::{stats, unavailable};

/// `GET /metrics`.
pub fn metrics(conn: &mut Conn, ctx: &Ctx, req: &Request) -> bool {
    let Some(snapshot) = stats(ctx) else {
        return write_error(conn, Style::OpenAi, &unavailable(), req.keep_alive, None);
    };
    let mut text = render(
        &snapshot,
        &ctx.http_metrics.snapshot(),
        ctx.shared.started.elapsed(),
    );
    let mut usage = Exposition::new();
    ctx.usage.render_metrics(&mut usage);
    if ctx.store.is_shared() {
        ctx.store.status().render_metrics(&mut usage);
    }
    text.push_str(&usage.out);
    conn.write_full(
        200,
        "text/plain; version=0.0.4; charset=utf-8",
        text.as_bytes(),
        req.keep_alive,
    )
}

/// Renders every metric family in the Prometheus text format.
pub fn render(s: &StatsSnapshot, http: &HttpInner, uptime: Duration) -> String {
    let mut e = Exposition::new();
    e.family(
        "modelrelay_requests_total",
        "counter",
        "Finished client requests by route, model and status class.",
    );
    for ((route, model, class), n) in &http.requests {
        e.sample(
            "modelrelay_requests_total",
            &[("route", route), ("model", model), ("status_class", class)],
            n,
        );
    }
    e.family(
        "modelrelay_request_duration_seconds",
        "histogram",
        "Client request duration, from request to last byte.",
    );
    for (route, h) in &http.duration {
        e.histogram(
            "modelrelay_request_duration_seconds",
            &[("route", route)],
            h,
        );
    }
    e.family(
        "modelrelay_queue_wait_seconds",
        "histogram",
        "Time from arrival to dispatch to a worker.",
    );
    e.histogram("modelrelay_queue_wait_seconds", &[], &s.counters.queue_wait);
    e.family(
        "modelrelay_time_to_first_chunk_seconds",
        "histogram",
        "Time from request to the first streamed byte.",
    );
    e.histogram(
        "modelrelay_time_to_first_chunk_seconds",
        &[],
        &http.first_chunk,
    );
    e.family(
        "modelrelay_in_flight",
        "gauge",
        "Requests dispatched to a worker and not finished.",
    );
    e.sample("modelrelay_in_flight", &[], s.gauges.in_flight);
    e.family(
        "modelrelay_queue_depth",
        "gauge",
        "Requests waiting for a worker.",
    );
    e.sample("modelrelay_queue_depth", &[], s.gauges.queue_depth);
    e.family(
        "modelrelay_workers_connected",
        "gauge",
        "Registered workers.",
    );
    e.sample("modelrelay_workers_connected", &[], s.gauges.workers);
    e.family(
        "modelrelay_relays",
        "gauge",
        "Relays the workers report serving (the most any worker reports; at least 1).",
    );
    e.sample("modelrelay_relays", &[], s.gauges.relays);
    e.family(
        "modelrelay_worker_slots",
        "gauge",
        "Worker concurrency slots, total and used.",
    );
    e.sample(
        "modelrelay_worker_slots",
        &[("state", "total")],
        s.slots_total,
    );
    e.sample(
        "modelrelay_worker_slots",
        &[("state", "used")],
        s.slots_used,
    );
    e.family(
        "modelrelay_dispatched_total",
        "counter",
        "Dispatches to workers (requeues count again).",
    );
    e.sample("modelrelay_dispatched_total", &[], s.counters.dispatched);
    e.family(
        "modelrelay_requeues_total",
        "counter",
        "Requests put back in the queue after their worker was lost.",
    );
    e.sample("modelrelay_requeues_total", &[], s.counters.requeued);
    e.family(
        "modelrelay_cancels_total",
        "counter",
        "Cancelled requests by reason.",
    );
    for (reason, n) in &s.counters.cancelled_by {
        e.sample("modelrelay_cancels_total", &[("reason", reason)], n);
    }
    e.family(
        "modelrelay_failures_total",
        "counter",
        "Failed requests by reason.",
    );
    for (reason, n) in &s.counters.failed_by {
        e.sample("modelrelay_failures_total", &[("reason", reason)], n);
    }
    e.family(
        "modelrelay_heartbeat_timeouts_total",
        "counter",
        "Workers dropped for missing heartbeats.",
    );
    e.sample(
        "modelrelay_heartbeat_timeouts_total",
        &[],
        s.counters.heartbeat_timeouts,
    );
    e.family(
        "modelrelay_auth_failures_total",
        "counter",
        "Failed authentications by kind.",
    );
    for (kind, n) in &http.auth_failures {
        e.sample("modelrelay_auth_failures_total", &[("kind", kind)], n);
    }
    e.family(
        "modelrelay_tokens_total",
        "counter",
        "Tokens reported by backends, by model and direction.",
    );
    for (model, (input, output)) in &s.counters.tokens {
        e.sample(
            "modelrelay_tokens_total",
            &[("model", model), ("direction", "in")],
            input,
        );
        e.sample(
            "modelrelay_tokens_total",
            &[("model", model), ("direction", "out")],
            output,
        );
    }
    e.family(
        "modelrelay_workers_by_backend_state",
        "gauge",
        "Registered workers by backend state: up, down (reported by the worker), ejected (failing).",
    );
    for (state, n) in &s.workers_by_state {
        e.sample(
            "modelrelay_workers_by_backend_state",
            &[("state", state)],
            n,
        );
    }
    e.family(
        "modelrelay_failovers_total",
        "counter",
        "Requests run again on another worker after a failure before the first byte.",
    );
    e.sample("modelrelay_failovers_total", &[], s.counters.failovers);
    e.family(
        "modelrelay_busy_refusals_total",
        "counter",
        "Dispatches a worker refused as busy (its other relays held every slot), dispatched again.",
    );
    e.sample("modelrelay_busy_refusals_total", &[], s.counters.busy);
    e.family(
        "modelrelay_ejections_total",
        "counter",
        "Workers ejected for consecutive failures.",
    );
    e.sample("modelrelay_ejections_total", &[], s.counters.ejections);
    let c = &s.counters;
    e.family(
        "modelrelay_affinity_routing_total",
        "counter",
        "Dispatches of requests with prompt fingerprints: hit (to the worker holding the longest prefix), miss (no worker held any), overridden_by_load (it was full or too loaded).",
    );
    for (outcome, n) in [
        ("hit", c.affinity_hits),
        ("miss", c.affinity_misses),
        ("overridden_by_load", c.affinity_overridden),
    ] {
        e.sample(
            "modelrelay_affinity_routing_total",
            &[("outcome", outcome)],
            n,
        );
    }
    e.family(
        "modelrelay_affinity_waits_total",
        "counter",
        "Requests that waited for their full cached worker (AFFINITY_WAIT_MS).",
    );
    e.sample("modelrelay_affinity_waits_total", &[], c.affinity_waits);
    render_tenants(&mut e, http);
    e.family(
        "modelrelay_uptime_seconds",
        "gauge",
        "Seconds since the server started.",
    );
    e.sample(
        "modelrelay_uptime_seconds",
        &[],
        format!("{:.3}", uptime.as_secs_f64()),
    );
    e.out
}

/// Requests and queue wait by tenant and priority, and rate-limit refusals by tenant.
/// Tenant names beyond `METRICS_MAX_TENANTS` are already folded into `other`.
fn render_tenants(e: &mut Exposition, http: &HttpInner) {
    e.family(
        "modelrelay_tenant_requests_total",
        "counter",
        "Finished client requests by tenant, priority and status class.",
    );
    for (tenant, t) in &http.tenants {
        for ((priority, class), n) in &t.requests {
            let labels = [
                ("tenant", tenant.as_str()),
                ("priority", priority),
                ("status_class", class.as_ref()),
            ];
            e.sample("modelrelay_tenant_requests_total", &labels, n);
        }
    }
    e.family(
        "modelrelay_tenant_queue_wait_seconds",
        "histogram",
        "Time from arrival to dispatch, by tenant and priority.",
    );
    for (tenant, t) in &http.tenants {
        for (priority, h) in &t.wait {
            let labels = [("tenant", tenant.as_str()), ("priority", priority)];
            e.histogram("modelrelay_tenant_queue_wait_seconds", &labels, h);
        }
    }
    e.family(
        "modelrelay_rate_limited_total",
        "counter",
        "Requests refused for a tenant's rate limit or token budget.",
    );
    for (tenant, t) in &http.tenants {
        let n = t.rejected.get("rate_limit_exceeded").copied().unwrap_or(0);
        if n > 0 {
            e.sample("modelrelay_rate_limited_total", &[("tenant", tenant)], n);
        }
    }
}
