//! The relay's own status routes, answered from what the dispatcher publishes (no
//! round trip to it): `GET /health` and `GET /v1/models`.

use super::http::request::{Conn, Request};
use super::Ctx;

pub fn models(conn: &mut Conn, ctx: &Ctx, req: &Request) -> bool {
    let created = ctx.started_unix;
    let data: Vec<serde_json::Value> = ctx
        .shared
        .models()
        .iter()
        .map(|m| serde_json::json!({"id": m, "object": "model", "created": created, "owned_by": ctx.cfg.provider}))
        .collect();
    conn.write_json(
        200,
        &serde_json::json!({"object": "list", "data": data}),
        req.keep_alive,
    )
}

pub fn health(conn: &mut Conn, ctx: &Ctx, req: &Request) -> bool {
    let g = ctx.shared.gauges();
    // 503 from the moment a shutdown starts, before anything is refused: a load
    // balancer checking `/health` moves traffic away during the drain grace.
    let (code, status) = if ctx.shared.is_shutting_down() {
        (503, "shutting_down")
    } else {
        (200, "ok")
    };
    let body = serde_json::json!({
        "status": status,
        "version": env!("CARGO_PKG_VERSION"),
        "workers_connected": g.workers,
        "queue_depth": g.queue_depth,
        "in_flight": g.in_flight,
        "relays": g.relays,
        "uptime_secs": ctx.shared.started.elapsed().as_secs_f64(),
    });
    let mut body = body;
    if ctx.store.is_shared() {
        body["state_store"] = serde_json::json!(ctx.store.status());
    }
    conn.write_json(code, &body, req.keep_alive)
}
