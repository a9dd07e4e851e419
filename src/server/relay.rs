//! One client request from submission to the last byte written.
//!
//! The connection thread submits the request to the dispatcher with a private reply
//! channel, then waits on that channel. While waiting it checks every
//! [`HANGUP_CHECK`] whether the client hung up (a non-blocking `peek` that sees EOF),
//! so a client that leaves while queued or while a non-streaming answer is generated
//! is cancelled within that time. Events themselves wake it at once.
//!
//! Nothing is written until the first event, so a worker that answers a streaming
//! request with an error status gets that status through, not a `200` stream.

use std::io::{ErrorKind, Write};
use std::net::TcpStream;
use std::sync::Arc;
use std::time::Duration;

use crossbeam_channel::{Receiver, RecvTimeoutError};
use log::debug;

use super::api::{inspect_body, ApiError, Style, FORWARDED_HEADERS};
use super::dispatcher::runtime::Input;
use super::dispatcher::{wire_request_id, ClientEvent, Event, RequestId};
use super::http::request::{Conn, Request};
use super::http::response::{self, Framing};
use super::Ctx;
use crate::protocol::{HeaderMap, RequestMessage, ResponseComplete};

/// How often a waiting connection checks whether its client is still there.
pub const HANGUP_CHECK: Duration = Duration::from_millis(200);

/// Relays one inference request; returns whether the connection may be reused.
pub fn relay(conn: &mut Conn, ctx: &Ctx, req: Request) -> bool {
    let style = Style::for_path(&req.path);
    let info = match inspect_body(&req.body) {
        Ok(info) => info,
        Err(e) => return write_error(conn, style, &e, req.keep_alive, None),
    };
    // inspect_body parsed it as JSON, so it is UTF-8; stay defensive anyway.
    let body = match String::from_utf8(req.body) {
        Ok(b) => b,
        Err(_) => {
            let e = ApiError::new(400, "invalid_json", "request body is not UTF-8");
            return write_error(conn, style, &e, req.keep_alive, None);
        }
    };
    let headers: HeaderMap = req
        .headers
        .iter()
        .filter(|(name, _)| FORWARDED_HEADERS.contains(&name.as_str()))
        .map(|(n, v)| (n.clone(), v.clone()))
        .collect();
    let id = ctx.next_request_id();
    let wire = wire_request_id(id);
    let msg = Arc::new(RequestMessage {
        request_id: wire.clone(),
        model: info.model,
        endpoint_path: req.path.clone(),
        is_streaming: info.stream,
        body: Arc::from(body),
        headers,
    });
    let (reply, events) = crossbeam_channel::unbounded();
    let _active = ctx.shared.relay_started();
    if ctx.inputs.send(Input::Submit { id, msg, reply }).is_err() {
        let e = ApiError::new(503, "server_shutting_down", "the relay is shutting down");
        return write_error(conn, style, &e, false, Some(&wire));
    }
    let mut session = Session {
        conn,
        ctx,
        id,
        wire,
        style,
        keep_alive: req.keep_alive,
        http10: req.http10,
        framing: None,
    };
    session.wait(events)
}

struct Session<'a> {
    conn: &'a mut Conn,
    ctx: &'a Ctx,
    id: RequestId,
    wire: String,
    style: Style,
    keep_alive: bool,
    http10: bool,
    /// Set once the streaming response head went out.
    framing: Option<Framing>,
}

impl Session<'_> {
    fn wait(&mut self, events: Receiver<ClientEvent>) -> bool {
        loop {
            let event = match events.recv_timeout(HANGUP_CHECK) {
                Ok(event) => event,
                Err(RecvTimeoutError::Timeout) => {
                    if peer_closed(&self.conn.stream) {
                        return self.client_gone();
                    }
                    continue;
                }
                Err(RecvTimeoutError::Disconnected) => {
                    let e =
                        ApiError::new(503, "server_shutting_down", "the relay is shutting down");
                    let mut buf = Vec::new();
                    self.push_final(
                        &mut buf,
                        ClientEvent::Failed(super::dispatcher::Failure::ShuttingDown),
                    );
                    let _ = self.conn.stream.write_all(&buf);
                    debug!("request {}: dispatcher gone ({})", self.wire, e.code);
                    return false;
                }
            };
            let mut buf = Vec::new();
            let mut last = None;
            match event {
                ClientEvent::Chunk(chunk) => {
                    self.push_chunk(&mut buf, &chunk);
                    // Whatever else is already waiting goes out in the same write.
                    while let Ok(more) = events.try_recv() {
                        match more {
                            ClientEvent::Chunk(chunk) => self.push_chunk(&mut buf, &chunk),
                            other => {
                                last = Some(other);
                                break;
                            }
                        }
                    }
                }
                other => last = Some(other),
            }
            let finished = last.is_some();
            if let Some(event) = last {
                self.push_final(&mut buf, event);
            }
            if self.conn.stream.write_all(&buf).is_err() {
                return if finished { false } else { self.client_gone() };
            }
            if finished {
                return self.keep_alive && self.framing != Some(Framing::UntilClose);
            }
        }
    }

    fn client_gone(&mut self) -> bool {
        debug!("request {}: client hung up", self.wire);
        let _ = self
            .ctx
            .inputs
            .send(Input::Event(Event::ClientGone(self.id)));
        false
    }

    fn push_chunk(&mut self, buf: &mut Vec<u8>, chunk: &str) {
        let framing = match self.framing {
            Some(f) => f,
            None => {
                let f = if self.http10 {
                    Framing::UntilClose
                } else {
                    Framing::Chunked
                };
                let headers = [
                    ("content-type", "text/event-stream"),
                    ("cache-control", "no-cache"),
                    ("x-request-id", self.wire.as_str()),
                ];
                buf.extend_from_slice(&response::head(200, &headers, f, self.keep_alive));
                self.framing = Some(f);
                f
            }
        };
        response::push_chunk(buf, chunk.as_bytes(), framing);
    }

    fn push_final(&mut self, buf: &mut Vec<u8>, event: ClientEvent) {
        match (self.framing, event) {
            (None, ClientEvent::Complete(rc)) => self.push_whole(buf, rc),
            (None, ClientEvent::Failed(f)) => {
                let e = ApiError::from_failure(&f, self.ctx.cfg.dispatch.queue_timeout.as_secs());
                buf.extend_from_slice(&error_response(
                    self.style,
                    &e,
                    self.keep_alive,
                    Some(&self.wire),
                ));
            }
            (Some(framing), ClientEvent::Complete(rc)) => {
                response::push_chunk(buf, rc.body.as_deref().unwrap_or("").as_bytes(), framing);
                response::push_end(buf, framing);
            }
            (Some(framing), ClientEvent::Failed(f)) => {
                let e = ApiError::from_failure(&f, self.ctx.cfg.dispatch.queue_timeout.as_secs());
                response::push_chunk(buf, e.sse_event(self.style).as_bytes(), framing);
                response::push_end(buf, framing);
            }
            (_, ClientEvent::Chunk(chunk)) => self.push_chunk(buf, &chunk),
        }
    }

    /// A complete answer that was not streamed: the worker's status, headers and body.
    fn push_whole(&mut self, buf: &mut Vec<u8>, rc: ResponseComplete) {
        let status = if (100..=599).contains(&rc.status_code) {
            rc.status_code
        } else {
            502
        };
        let mut headers: Vec<(&str, &str)> = rc
            .headers
            .iter()
            .map(|(n, v)| (n.as_str(), v.as_str()))
            .collect();
        if !rc
            .headers
            .keys()
            .any(|k| k.eq_ignore_ascii_case("content-type"))
        {
            headers.push(("content-type", "application/json"));
        }
        headers.push(("x-request-id", self.wire.as_str()));
        let body = rc.body.as_deref().unwrap_or("").as_bytes();
        buf.extend_from_slice(&response::head(
            status,
            &headers,
            Framing::Length(body.len()),
            self.keep_alive,
        ));
        buf.extend_from_slice(body);
    }
}

/// A complete JSON error response.
pub fn error_response(
    style: Style,
    e: &ApiError,
    keep_alive: bool,
    request_id: Option<&str>,
) -> Vec<u8> {
    let body = e.body(style);
    let retry = e.retry_after.map(|s| s.to_string());
    let mut headers = vec![("content-type", "application/json")];
    if let Some(r) = retry.as_deref() {
        headers.push(("retry-after", r));
    }
    if let Some(id) = request_id {
        headers.push(("x-request-id", id));
    }
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
    conn.stream
        .write_all(&error_response(style, e, keep_alive, id))
        .is_ok()
        && keep_alive
}

/// True when the client has closed its end (EOF or error on a non-blocking peek).
fn peer_closed(stream: &TcpStream) -> bool {
    if stream.set_nonblocking(true).is_err() {
        return true;
    }
    let mut probe = [0u8; 1];
    let result = stream.peek(&mut probe);
    let _ = stream.set_nonblocking(false);
    match result {
        Ok(0) => true,
        Ok(_) => false,
        Err(e) => e.kind() != ErrorKind::WouldBlock && e.kind() != ErrorKind::Interrupted,
    }
}
