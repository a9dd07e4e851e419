//! The HTTP front: one thread per client connection, reading requests with
//! [`request::Conn`] and routing them. Inference routes go to [`super::relay`], the
//! worker endpoint to [`super::worker_socket`]; `/v1/models` and `/health` are answered
//! here from the state the dispatcher publishes.

pub mod request;
pub mod response;

use std::net::SocketAddr;
use std::sync::Arc;

use log::debug;

use super::api::{ApiError, Style, RELAYED_ROUTES};
use super::auth::authorize_client;
use super::relay::{self, write_error};
use super::{ops, worker_socket, Ctx};
use crate::net::Stream;
use request::{Conn, ReadError, Request};

/// Serves one client connection until it closes or is upgraded.
pub fn serve(stream: Stream, peer: SocketAddr, ctx: Arc<Ctx>) {
    let _ = stream.set_nodelay(true);
    let mut conn = Conn::new(stream, peer);
    loop {
        let req = match conn.read_request(&ctx.cfg.limits) {
            Ok(req) => req,
            Err(ReadError::Closed) => return,
            Err(ReadError::Io(e)) => {
                debug!("connection from {peer}: {e}");
                return;
            }
            Err(ReadError::Reject(status, message)) => {
                let e = ApiError::new(status, reject_code(status), message);
                write_error(&mut conn, Style::OpenAi, &e, false, None);
                return;
            }
        };
        let keep_alive = match (req.method.as_str(), req.path.as_str()) {
            ("GET", "/v1/worker/connect") => return worker_socket::accept(conn, req, ctx),
            ("POST", path) if RELAYED_ROUTES.contains(&path) => {
                match authorize_client(&ctx, &req, peer.ip()) {
                    Ok(caller) => relay::relay(&mut conn, &ctx, req, caller),
                    Err(e) => relay::reject(&mut conn, &ctx, path, &e, req.keep_alive),
                }
            }
            ("GET", "/v1/models") => match authorize_client(&ctx, &req, peer.ip()) {
                Ok(_) => models(&mut conn, &ctx, &req),
                Err(e) => write_error(&mut conn, Style::OpenAi, &e, req.keep_alive, None),
            },
            ("GET", "/health") => health(&mut conn, &ctx, &req),
            ("GET", "/metrics") => ops::metrics(&mut conn, &ctx, &req),
            (_, path) if path.starts_with("/admin/") => ops::admin(&mut conn, &ctx, &req),
            (_, path) => {
                let e = if is_known(path) {
                    ApiError::new(
                        405,
                        "method_not_allowed",
                        format!("{} is not allowed on {path}", req.method),
                    )
                } else {
                    ApiError::new(
                        404,
                        "not_found",
                        format!("no route for {} {path}", req.method),
                    )
                };
                write_error(&mut conn, Style::for_path(path), &e, req.keep_alive, None)
            }
        };
        if !keep_alive {
            return;
        }
    }
}

fn is_known(path: &str) -> bool {
    RELAYED_ROUTES.contains(&path)
        || ["/v1/models", "/health", "/v1/worker/connect"].contains(&path)
}

fn reject_code(status: u16) -> &'static str {
    match status {
        413 => "request_too_large",
        431 => "headers_too_large",
        408 => "request_timeout",
        _ => "bad_request",
    }
}

fn models(conn: &mut Conn, ctx: &Ctx, req: &Request) -> bool {
    let created = ctx.started_unix;
    let data: Vec<serde_json::Value> = ctx
        .shared
        .models()
        .iter()
        .map(|m| serde_json::json!({"id": m, "object": "model", "created": created, "owned_by": ctx.cfg.provider}))
        .collect();
    response::write_json(
        &mut conn.stream,
        200,
        &serde_json::json!({"object": "list", "data": data}),
        req.keep_alive,
    )
}

fn health(conn: &mut Conn, ctx: &Ctx, req: &Request) -> bool {
    let g = ctx.shared.gauges();
    let status = if ctx.shared.is_shutting_down() {
        "shutting_down"
    } else {
        "ok"
    };
    let body = serde_json::json!({
        "status": status,
        "version": env!("CARGO_PKG_VERSION"),
        "workers_connected": g.workers,
        "queue_depth": g.queue_depth,
        "in_flight": g.in_flight,
        "uptime_secs": ctx.shared.started.elapsed().as_secs_f64(),
    });
    response::write_json(&mut conn.stream, 200, &body, req.keep_alive)
}
