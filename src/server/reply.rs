//! Answers the relay writes itself, without a worker: an inference request refused
//! before it reached the dispatcher (bad body, missing key, rate limit...) gets a request
//! id, a metrics record and an access line like any other; JSON errors in the called
//! API's shape for every route.

use std::io::Write;
use std::time::Duration;

use log::info;

use super::dispatcher::wire_request_id;
use super::errors::{ApiError, Style};
use super::http::request::Conn;
use super::http::response::{self, Framing};
use super::metrics::Finished;
use super::tenancy::identity::Caller;
use super::Ctx;

/// Answers an inference request refused before it reached the dispatcher (bad body,
/// missing key, ...) like any other: with a request id, metrics and an access line.
pub fn reject(conn: &mut Conn, ctx: &Ctx, route: &str, e: &ApiError, keep_alive: bool) -> bool {
    reject_caller(conn, ctx, route, e, keep_alive, None)
}

/// [`reject`] for a caller already identified (its tenant is logged and counted).
pub fn reject_caller(
    conn: &mut Conn,
    ctx: &Ctx,
    route: &str,
    e: &ApiError,
    keep_alive: bool,
    caller: Option<&Caller>,
) -> bool {
    let wire = wire_request_id(ctx.next_request_id());
    let tenant = caller.map(|c| (&*c.who.tenant, c.who.priority.as_str()));
    info!(
        "request {wire} {route} model=- tenant={} worker=- status={} queue_wait_ms=- duration_ms=0 tokens_in=0 tokens_out=0 outcome=rejected:{}",
        tenant.map_or("-", |t| t.0),
        e.status,
        e.code
    );
    ctx.http_metrics.finished(&Finished {
        id: &wire,
        route,
        model: "-",
        status: e.status,
        duration: Duration::ZERO,
        first_chunk: None,
        key: caller.and_then(Caller::key_id),
        tokens: (0, 0),
        worker: None,
        tenant,
        outcome: &e.code,
        queue_wait: None,
    });
    let headers = [("x-request-id", wire.as_str()), ("x-queue-wait-ms", "0")];
    let response = error_response(Style::for_path(route), e, keep_alive, &headers);
    conn.stream.write_all(&response).is_ok() && keep_alive
}

/// A complete JSON error response with extra headers.
pub fn error_response(
    style: Style,
    e: &ApiError,
    keep_alive: bool,
    extra: &[(&str, &str)],
) -> Vec<u8> {
    let body = e.body(style);
    let retry = e.retry_after.map(|s| s.to_string());
    let mut headers = vec![("content-type", "application/json")];
    if let Some(r) = retry.as_deref() {
        headers.push(("retry-after", r));
    }
    headers.extend_from_slice(extra);
    let mut out = response::head(e.status, &headers, Framing::Length(body.len()), keep_alive);
    out.extend_from_slice(body.as_bytes());
    out
}

/// Writes a JSON error; returns whether the connection may be reused.
pub fn write_error(
    conn: &mut Conn,
    style: Style,
    e: &ApiError,
    keep_alive: bool,
    id: Option<&str>,
) -> bool {
    let id = id.or(conn.request_id.as_deref());
    let extra: Vec<(&str, &str)> = id.map(|id| ("x-request-id", id)).into_iter().collect();
    let written = conn
        .stream
        .write_all(&error_response(style, e, keep_alive, &extra))
        .is_ok();
    // A large upload refused before it was read: the client must get to see why.
    super::http::pieces::linger(conn);
    written && keep_alive
}
