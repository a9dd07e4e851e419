//! `GET /v1/streams/{request_id}?resume_token=…`: a client resumes a held stream.
//!
//! The last event the client saw comes as `Last-Event-ID` (what `EventSource` sends by
//! itself) or `?last_event_id=` (for NDJSON: the number of lines received); none means
//! from the start. Same authentication as the relayed routes; the key (or, without
//! keys, the tenant) must be the one that started the stream, and the resume token of
//! its `x-resume-url` (or `X-Resume-Token`) must match, else the stream is unknown.
//!
//! Answers `200` with the stream's content type and every event after that id, then
//! the rest live; `204` when the client already has the whole answer (`EventSource`
//! stops reconnecting); `404 stream_not_found` / `stream_expired`, `409
//! resume_buffer_full`, `410 resume_events_gone` / `stream_cancelled`, `400
//! invalid_last_event_id` otherwise.

use std::io::Write;
use std::net::IpAddr;

use log::info;

use super::held::{unknown, Step};
use super::{Owner, ROUTE_PREFIX};
use crate::server::auth::authorize_client;
use crate::server::errors::{ApiError, Style};
use crate::server::http::request::{Conn, Request};
use crate::server::http::response::{self, Framing};
use crate::server::relay::HANGUP_CHECK;
use crate::server::reply::write_error;
use crate::server::tenancy::identity::identify;
use crate::server::Ctx;

/// Longest request id looked up (ours are 18 characters).
const MAX_ID: usize = 64;

/// Whether `path` is a resume route.
pub fn owns(path: &str) -> bool {
    path.len() > ROUTE_PREFIX.len() && path.starts_with(ROUTE_PREFIX)
}

/// Serves one resume; returns whether the connection may be reused.
pub fn serve(conn: &mut Conn, ctx: &Ctx, req: &Request, peer: IpAddr) -> bool {
    let keep = req.keep_alive;
    let caller =
        match authorize_client(ctx, req, peer).and_then(|c| identify(req, c, ctx.gate.policy())) {
            Ok(caller) => caller,
            Err(e) => return write_error(conn, Style::OpenAi, &e, keep, None),
        };
    let id = &req.path[ROUTE_PREFIX.len()..];
    let last = match last_event_id(req) {
        Ok(last) => last,
        Err(e) => return write_error(conn, Style::OpenAi, &e, keep, None),
    };
    if id.len() > MAX_ID {
        return write_error(conn, Style::OpenAi, &unknown(), keep, None);
    }
    let token = match req.header("x-resume-token") {
        Some(t) => t.trim().to_string(),
        None => req.query_param("resume_token").unwrap_or_default(),
    };
    let held = match ctx.resume.get(id) {
        Some(held) => held,
        // Not held here: perhaps on a worker, for a relay that died.
        None if !token.is_empty() && token.len() <= MAX_ID => {
            let owner = Owner::of(&caller);
            return super::remote::serve(conn, ctx, req, id, last, &owner, &token);
        }
        None => return write_error(conn, Style::OpenAi, &unknown(), keep, None),
    };
    let me = match held.attach(&Owner::of(&caller), &token, last) {
        Ok(me) => me,
        Err(e) if e.status == 204 => {
            let head = response::head(204, &[("x-request-id", id)], Framing::Length(0), keep);
            return conn.stream.write_all(&head).is_ok() && keep;
        }
        Err(e) => return write_error(conn, Style::OpenAi, &e, keep, Some(id)),
    };
    info!("request {id}: resumed after event {last}");
    let framing = if req.http10 {
        Framing::UntilClose
    } else {
        Framing::Chunked
    };
    let headers = [
        ("content-type", held.content_type()),
        ("cache-control", "no-cache"),
        ("x-request-id", id),
    ];
    let mut buf = response::head(200, &headers, framing, keep);
    let mut sent = last;
    let mut events = Vec::new();
    loop {
        events.clear();
        let step = held.next(me, &mut sent, &mut events, HANGUP_CHECK);
        response::push_chunk(&mut buf, &events, framing);
        match step {
            Step::More | Step::Idle => {}
            Step::Replaced => return false,
            Step::Ended { finished } => {
                response::push_end(&mut buf, framing);
                let ok = conn.stream.write_all(&buf).is_ok();
                if !ok {
                    held.detach(me);
                }
                return ok && finished && keep && framing != Framing::UntilClose;
            }
        }
        if buf.is_empty() {
            if conn.stream.peer_closed() {
                held.detach(me);
                return false;
            }
            continue;
        }
        if conn.stream.write_all(&buf).is_err() {
            held.detach(me);
            return false;
        }
        buf.clear();
    }
}

/// The id of the last event the client has: the header, else the query, else 0.
fn last_event_id(req: &Request) -> Result<u64, ApiError> {
    let text = match req.header("last-event-id") {
        Some(v) => v.trim().to_string(),
        None => req.query_param("last_event_id").unwrap_or_default(),
    };
    if text.is_empty() {
        return Ok(0);
    }
    text.parse().map_err(|_| {
        let shown: String = text.chars().take(24).collect();
        ApiError::new(
            400,
            "invalid_last_event_id",
            format!("Last-Event-ID must be a whole number (the id of the last event received), not {shown:?}"),
        )
    })
}
