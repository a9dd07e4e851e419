//! One client request from submission to the last byte written.
//!
//! The connection thread submits the request to the dispatcher with a private reply
//! channel, then waits on that channel. While waiting it checks every
//! [`HANGUP_CHECK`] whether the client hung up (a non-blocking `peek` that sees EOF),
//! so a client that leaves while queued or while a non-streaming answer is generated
//! is cancelled within that time. Events themselves wake it at once ([`wait`]).
//! A plain whole answer on a keep-alive connection is written instead by the thread that
//! holds it, while the connection thread sleeps on its socket ([`direct`]).
//!
//! Nothing is written until the first chunk or the final event, so a worker that
//! answers a streaming request with an error status gets that status through, not a
//! `200` stream. A stream the relay ends with an error ends on an event boundary, the
//! error event whole ([`boundary`]). Every request ends with one access-log line and one
//! metrics record ([`record`]).

use std::borrow::Cow;
use std::io::Write;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, RecvTimeoutError};
use log::debug;

use super::body::{inspect_body, BodyInfo, FORWARDED_HEADERS};
use super::continuation::{self, Tracker};
use super::dispatcher::reply::Reply;
use super::dispatcher::runtime::Input;
use super::dispatcher::{wire_request_id, ClientEvent, Event, Failure, Needs, RequestId};
use super::endpoints::Spec;
use super::errors::{ApiError, Style};
use super::fingerprint;
use super::http::pieces::BodyStream;
use super::http::request::{Conn, Request};
use super::http::response::{self, Framing};
use super::reply::reject_caller;
use super::resume;
use super::tenancy::gate::RateHeaders;
use super::tenancy::identity::Caller;
use super::Ctx;
use crate::protocol::{HeaderMap, RequestMessage};
use boundary::{EventBoundary, Format};
use bounds::{fits_one_message, is_timeout, MAX_ANSWER_BUFFER, SLOW_WRITE};
pub use direct::Outlet;
pub use record::{record, Record};

pub(crate) mod boundary;
mod bounds;
mod bytes;
mod continued;
mod direct;
mod held;
mod record;
mod resumable;
mod upload;
mod wait;
mod whole;
mod write;

/// How often a waiting connection checks whether its client is still there.
pub const HANGUP_CHECK: Duration = Duration::from_millis(200);

/// Rewrites a relayed answer into another API's shape (the Ollama routes). Without one
/// the backend's bytes reach the client as they are.
pub trait Reshape {
    /// Content type of a streamed answer.
    fn stream_type(&self) -> &'static str;
    /// A piece of the backend's stream → what the client gets (may be empty).
    fn chunk(&mut self, chunk: &str) -> String;
    /// The end of the stream, with whatever bytes the final message still carried.
    fn end(&mut self, rest: &str) -> String;
    /// A whole (non-streamed) answer: the backend's status and body → the client's.
    fn whole(&mut self, status: u16, body: &str, elapsed: Duration) -> (u16, String);
    /// Token counts it saw (prompt, completion), for when the worker reported none.
    fn tokens(&self) -> (u64, u64);
}

/// One request for a worker, as a route prepared it.
pub struct Job<'a> {
    /// The client's route (metrics, logs).
    pub route: String,
    /// The backend path the worker calls.
    pub endpoint_path: String,
    pub model: String,
    pub stream: bool,
    /// The JSON body the worker forwards.
    pub body: String,
    /// The error shape the client expects.
    pub style: Style,
    pub reshape: Option<Box<dyn Reshape + 'a>>,
}

/// Relays one OpenAI- or Anthropic-style request (body forwarded untouched); returns
/// whether the connection may be reused.
pub fn relay(conn: &mut Conn, ctx: &Ctx, req: Request, caller: Caller) -> bool {
    match inspect_body(&req.body) {
        Ok(info) => relay_inspected(conn, ctx, req, caller, info),
        Err(e) => reject_caller(conn, ctx, &req.path, &e, req.keep_alive, Some(&caller)),
    }
}

/// [`relay`] for a body whose `model` and `stream` were already read.
pub fn relay_inspected(
    conn: &mut Conn,
    ctx: &Ctx,
    mut req: Request,
    caller: Caller,
    info: BodyInfo,
) -> bool {
    // inspect_body parsed it as JSON, so it is UTF-8; stay defensive anyway.
    let body = match text_body(&mut req) {
        Ok(b) => b,
        Err(e) => return reject_caller(conn, ctx, &req.path, &e, req.keep_alive, Some(&caller)),
    };
    let job = Job {
        route: req.path.clone(),
        endpoint_path: req.path.clone(),
        model: info.model,
        stream: info.stream,
        body,
        style: Style::for_path(&req.path),
        reshape: None,
    };
    run(conn, ctx, &req, job, caller)
}

/// Takes a JSON route's body as text; `400` when it is not UTF-8.
pub fn text_body(req: &mut Request) -> Result<String, ApiError> {
    String::from_utf8(std::mem::take(&mut req.body))
        .map_err(|_| ApiError::new(400, "invalid_json", "request body is not UTF-8"))
}

/// Admits, submits and answers a prepared request; returns whether the connection may
/// be reused.
pub fn run(conn: &mut Conn, ctx: &Ctx, req: &Request, job: Job<'_>, caller: Caller) -> bool {
    run_with(conn, ctx, req, job, caller, None, None)
}

/// [`run`] for a route beyond chat (`endpoints.rs`): only workers serving the route
/// take it, and a binary one travels base64-encoded both ways. With `pieces` (the body
/// still on the connection, and its first part read) the body follows the request in
/// pieces ([`upload`]).
pub fn run_with(
    conn: &mut Conn,
    ctx: &Ctx,
    req: &Request,
    job: Job<'_>,
    caller: Caller,
    spec: Option<Spec>,
    pieces: Option<(BodyStream, Vec<u8>)>,
) -> bool {
    let binary = spec.is_some_and(|s| s.binary);
    let started = Instant::now();
    let keep = req.keep_alive;
    let mut headers = forwarded_headers(&req.headers, &caller);
    let encoding = match &pieces {
        Some((stream, _)) => {
            if let Some(len) = stream.length() {
                headers.insert("content-length".into(), len.to_string());
            }
            Some(crate::protocol::pieces::PIECES)
        }
        None => binary.then_some(crate::protocol::binary::BASE64),
    };
    let id = ctx.next_request_id();
    let wire = wire_request_id(id);
    let msg = Arc::new(RequestMessage {
        request_id: wire.clone(),
        model: job.model.clone(),
        endpoint_path: job.endpoint_path,
        is_streaming: job.stream,
        body: Arc::from(job.body),
        headers,
        body_encoding: encoding.map(str::to_string),
        continuation: None,
        held: None,
    });
    if let Err(e) = fits_one_message(&msg, ctx.cfg.max_ws_message_bytes) {
        return reject_caller(conn, ctx, &job.route, &e, keep, Some(&caller));
    }
    let rate = match ctx.gate.admit(&caller, started) {
        Ok(rate) => rate,
        Err(e) => return reject_caller(conn, ctx, &job.route, &e, keep, Some(&caller)),
    };
    // Progress notes are SSE comments: not for reshaped (Ollama NDJSON) answers.
    let progress = job.stream
        && job.reshape.is_none()
        && req
            .header("x-queue-updates")
            .is_some_and(|v| v.trim().eq_ignore_ascii_case("true"));
    let needs = match spec {
        Some(spec) => Needs {
            route: spec.checked.then_some(spec.route),
            binary: spec.binary,
            pieces: pieces.is_some(),
            ..Needs::default()
        },
        None => crate::server::body::needs(&msg.endpoint_path, &msg.body),
    };
    let session = req.header("x-session-id");
    // A binary body holds no prompt to find a cached prefix of (and may be 100 MB).
    let prints = fingerprint::for_request(
        ctx.cfg.dispatch.affinity && !binary,
        &msg.endpoint_path,
        &msg.body,
        session,
    );
    let continuable = continuation::eligible(
        req.header(continuation::HEADER),
        ctx.cfg.continue_on_failure,
        &msg.endpoint_path,
        msg.is_streaming,
        &msg.body,
    );
    // The marker comment is SSE; the NDJSON routes get none.
    let tracker = continuable.then(|| Tracker::new(msg.clone(), job.reshape.is_none()));
    let (reply, events) = crossbeam_channel::unbounded();
    // In progress until the answer is out; a direct answerer takes it over.
    let mut active = Some(ctx.shared.relay_started());
    let who = caller.who.clone();
    let content_type = job
        .reshape
        .as_ref()
        .map_or("text/event-stream", |r| r.stream_type());
    let format = Format::for_content_type(content_type);
    // Resuming numbers text events; a binary answer's bytes have none to number.
    let resume = (job.stream && !binary && resume::opted_in(req, ctx.resume.config()))
        .then(|| {
            ctx.resume
                .open(&wire, resume::Owner::of(&caller), content_type)
        })
        .flatten();
    // The worker keeps a copy too when it can number the events alike: the relay's
    // own SSE as the worker sends it (no reshaped NDJSON, no continuation splice).
    let mut msg = msg;
    if let (Some(tap), true, None) = (&resume, job.reshape.is_none(), &tracker) {
        Arc::make_mut(&mut msg).held = Some(tap.worker_hold());
    }
    let mut session = Session {
        conn,
        ctx,
        id,
        wire,
        style: job.style,
        reshape: job.reshape,
        keep_alive: keep,
        http10: req.http10,
        framing: None,
        head: Vec::new(),
        held: Default::default(),
        boundary: EventBoundary::new(format),
        route: job.route,
        model: job.model,
        caller,
        rate,
        started,
        queue_wait: None,
        worker: None,
        first_chunk: None,
        status: 0,
        tokens: (0, 0),
        client_lags: false,
        binary: binary.then(Default::default),
        resume,
        continuation: tracker,
        upload: pieces.map(|(stream, first)| {
            let mut upload = upload::Upload::new(stream, first);
            upload.submitted(msg.clone(), who.clone(), needs);
            upload
        }),
    };
    // A plain whole answer is written by the thread that holds it ([`direct`]).
    let outlet = session.direct_outlet(&msg, progress);
    let direct = outlet
        .clone()
        .and_then(|outlet| session.direct(outlet, reply.clone(), &mut active));
    let submit = Input::Submit {
        id,
        msg,
        who,
        needs,
        prints,
        progress,
        reply: match direct {
            Some(direct) => Reply::Direct(Box::new(direct)),
            None => reply.into(),
        },
        continuable,
    };
    if ctx.inputs.send(submit).is_err() {
        return session.finish_with(ClientEvent::Failed(Failure::ShuttingDown), Vec::new());
    }
    match outlet {
        Some(outlet) => session.await_direct(&outlet, events),
        None => session.wait(events),
    }
}

/// The client headers that travel to the backend, minus the relay's own key; the
/// resolved tenant and priority go along when the caller named them or holds a key.
pub fn forwarded_headers(all: &[(String, String)], caller: &Caller) -> HeaderMap {
    let mut headers: HeaderMap = all
        .iter()
        .filter(|(name, _)| {
            FORWARDED_HEADERS.contains(&name.as_str())
                && Some(name.as_str()) != caller.consumed_header
        })
        .map(|(n, v)| (n.clone(), v.clone()))
        .collect();
    if caller.explicit || caller.key.is_some() {
        headers.insert("x-tenant-id".into(), caller.who.tenant.to_string());
        headers.insert("x-priority".into(), caller.who.priority.as_str().into());
    }
    headers
}

struct Session<'a, 'r> {
    conn: &'a mut Conn,
    ctx: &'a Ctx,
    id: RequestId,
    wire: String,
    style: Style,
    reshape: Option<Box<dyn Reshape + 'r>>,
    keep_alive: bool,
    http10: bool,
    /// Set once the streaming response head went out.
    framing: Option<Framing>,
    /// From the worker's `response_head`: headers the stream's head carries.
    head: Vec<(&'static str, String)>,
    /// A stream start that may be a whole answer ([`held`]).
    held: held::Held,
    /// Holds back the start of an event until its end arrived.
    boundary: EventBoundary,
    route: String,
    model: String,
    caller: Caller,
    /// The tenant's request-rate state, reported in `x-ratelimit-*` headers.
    rate: Option<RateHeaders>,
    started: Instant,
    queue_wait: Option<Duration>,
    worker: Option<String>,
    first_chunk: Option<Duration>,
    status: u16,
    tokens: (u64, u64),
    /// The last write waited on the client ([`SLOW_WRITE`]): what piles up meanwhile is
    /// the client's doing, and bounded by [`MAX_ANSWER_BUFFER`].
    client_lags: bool,
    /// A binary route's answer (`bytes.rs`): base64 chunks, written decoded.
    binary: Option<bytes::Binary>,
    /// A resumable stream's numbered, held events ([`resume`]); `None` for the rest.
    resume: Option<resume::Tap>,
    /// A stream that may be finished on another worker ([`continuation`]).
    continuation: Option<Tracker>,
    /// A request body still to send in pieces ([`upload`]).
    upload: Option<upload::Upload>,
}

impl Session<'_, '_> {
    fn wait(&mut self, mut events: Receiver<ClientEvent>) -> bool {
        loop {
            if let Some(outcome) = self.resume.as_mut().and_then(|t| t.due(Instant::now())) {
                return self.cancel(outcome);
            }
            let event = match wait::next_event(&events, HANGUP_CHECK) {
                Ok(event) => event,
                Err(RecvTimeoutError::Timeout) => {
                    if self.client_reads() && self.conn.stream.peer_closed() && !self.hold() {
                        return self.client_gone();
                    }
                    continue;
                }
                Err(RecvTimeoutError::Disconnected) => {
                    return self.finish_with(ClientEvent::Failed(Failure::ShuttingDown), Vec::new())
                }
            };
            let mut buf = Vec::new();
            let mut last = None;
            match event {
                ClientEvent::Dispatched { queue_wait, worker } => {
                    self.queue_wait = Some(queue_wait);
                    self.worker = Some(worker);
                    continue;
                }
                ClientEvent::Queued { position, eta_ms } => {
                    self.push_progress(&mut buf, position, eta_ms);
                }
                ClientEvent::Head(headers) if self.binary.is_some() => {
                    self.binary_head(headers);
                    continue;
                }
                ClientEvent::Head(headers) => {
                    self.head = self.held.head(&headers);
                    continue;
                }
                ClientEvent::Waking { worker } => {
                    let framing = self.open_stream(&mut buf);
                    // A worker names itself: no line break may end the comment early.
                    let name: String = worker
                        .chars()
                        .take(64)
                        .map(|c| if c.is_control() { '?' } else { c })
                        .collect();
                    let note = format!(": waking {name}\n\n");
                    self.emit_note(&mut buf, &note, framing);
                }
                ClientEvent::Interrupted => self.interrupted(&mut buf),
                ClientEvent::Credit(until) => {
                    if let Err(outcome) = self.send_pieces(until) {
                        self.record(outcome);
                        return false;
                    }
                    continue;
                }
                ClientEvent::Chunk(chunk) => {
                    self.push_chunk(&mut buf, &chunk);
                    // Whatever else is already waiting goes out in the same write.
                    while let Ok(more) = events.try_recv() {
                        match more {
                            ClientEvent::Chunk(chunk) => self.push_chunk(&mut buf, &chunk),
                            ClientEvent::Interrupted => self.interrupted(&mut buf),
                            ClientEvent::Credit(until) => {
                                if let Err(outcome) = self.send_pieces(until) {
                                    self.record(outcome);
                                    return false;
                                }
                            }
                            ClientEvent::Dispatched { .. }
                            | ClientEvent::Queued { .. }
                            | ClientEvent::Head(_)
                            | ClientEvent::Waking { .. } => {}
                            other => {
                                last = Some(other);
                                break;
                            }
                        }
                    }
                }
                other => last = Some(other),
            }
            if let Some(event) = last {
                match self.whole_instead(&event) {
                    Some(Ok(again)) => {
                        events = again;
                        continue;
                    }
                    Some(Err(outcome)) => {
                        self.record(outcome);
                        return false;
                    }
                    None => return self.finish_with(event, buf),
                }
            }
            if !self.client_reads() {
                continue;
            }
            if buf.len() > MAX_ANSWER_BUFFER && self.client_lags {
                debug!(
                    "request {}: {} bytes waiting for a client that does not read",
                    self.wire,
                    buf.len()
                );
                return self.cancel("client_too_slow");
            }
            let began = Instant::now();
            match self.conn.stream.write_all(&buf) {
                Ok(()) => {
                    self.client_lags = began.elapsed() >= SLOW_WRITE;
                    self.grant_answer();
                }
                Err(e) if is_timeout(&e) => return self.cancel("client_too_slow"),
                Err(_) if self.hold() => {}
                Err(_) => return self.client_gone(),
            }
        }
    }

    fn client_gone(&mut self) -> bool {
        debug!("request {}: client hung up", self.wire);
        self.cancel("client_disconnect")
    }

    /// Ends a request whose client is gone or does not read: the dispatcher cancels it
    /// on the worker, which cancels it on the backend.
    fn cancel(&mut self, outcome: &str) -> bool {
        let _ = self
            .ctx
            .inputs
            .send(Input::Event(Event::ClientGone(self.id)));
        if self.status == 0 {
            self.status = 499;
        }
        self.record(outcome);
        false
    }

    /// Writes the final part of the answer, records the request, and returns whether
    /// the connection may be reused.
    fn finish_with(&mut self, mut event: ClientEvent, mut buf: Vec<u8>) -> bool {
        if let ClientEvent::Complete(rc) = &mut event {
            let mut held = self.held.release();
            if let Some(tracker) = &mut self.continuation {
                held.push_str(&tracker.finish());
                tracker.fix_usage(rc);
            }
            rc.body = Some(held + rc.body.as_deref().unwrap_or("")).filter(|b| !b.is_empty());
        }
        let outcome = match &event {
            // The client already has the whole stream (see `EventBoundary::ended`).
            ClientEvent::Failed(_) if self.framing.is_some() && self.boundary.ended() => {
                "completed"
            }
            ClientEvent::Failed(f) => f.code(),
            _ => "completed",
        };
        self.push_final(&mut buf, event);
        let written = self.client_reads() && self.conn.stream.write_all(&buf).is_ok();
        // Answered before the client's body was all read (refused, worker lost).
        super::http::pieces::linger(self.conn);
        if let Some(tap) = &mut self.resume {
            tap.finish();
        }
        self.record(outcome);
        written && self.keep_alive && self.framing != Some(Framing::UntilClose)
    }

    /// One access-log line and one metrics record per request.
    fn record(&self, outcome: &str) {
        record(
            self.ctx,
            &Record {
                wire: &self.wire,
                route: &self.route,
                model: &self.model,
                caller: &self.caller,
                worker: self.worker.as_deref(),
                status: self.status,
                started: self.started,
                queue_wait: self.queue_wait,
                first_chunk: self.first_chunk,
                tokens: self.tokens,
                outcome,
            },
        );
    }

    /// What the relay's own headers say of this request.
    fn stamp(&self) -> whole::Stamp<'_> {
        whole::Stamp {
            wire: &self.wire,
            started: self.started,
            queue_wait: self.queue_wait,
            rate: self.rate.as_ref(),
        }
    }

    /// See [`whole::Stamp::headers`].
    fn relay_headers(&self) -> Vec<(&'static str, Cow<'_, str>)> {
        self.stamp().headers()
    }
}
