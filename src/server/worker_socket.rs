//! The worker side of the server: `GET /v1/worker/connect` upgrades to a WebSocket,
//! after which this connection's thread becomes the socket's reader and a second thread
//! its writer for whatever cannot be sent at once ([`WorkerLink`]).
//!
//! Authentication happens before the upgrade: provider, secret (`X-Worker-Secret`, or the
//! legacy `worker_secret` query parameter) compared in constant time, and a per-IP
//! lockout after repeated failures. The first message must be `register`; after that
//! every parsed message goes to the dispatcher. Malformed or unknown messages are logged
//! and skipped; only a broken WebSocket stream ends the session.

use std::io::Write;
use std::sync::Arc;
use std::time::Duration;

use log::{info, warn};
use tungstenite::protocol::{Role, WebSocketContext};
use tungstenite::Message;

use super::auth::authorize_worker;
use super::dispatcher::runtime::Input;
use super::dispatcher::{parse_request_id, Event, WorkerId};
use super::errors::{ApiError, Style};
use super::http::request::{Conn, Request};
use super::reply::write_error;
use super::worker_link::WorkerLink;
use super::Ctx;
use crate::net::Stream;
use crate::protocol::{raw_bodies, RegisterMessage, WorkerMessage};
use crate::ws::{self, close_code, ReadHalf, Writer};

/// How long a new socket may take to send `register`.
const REGISTER_TIMEOUT: Duration = Duration::from_secs(10);
/// A worker that does not drain its socket for this long is dropped.
const WRITE_TIMEOUT: Duration = Duration::from_secs(30);

/// Handles the upgrade request; on success the calling thread serves the socket.
pub fn accept(mut conn: Conn, req: Request, ctx: Arc<Ctx>) {
    let ip = conn.peer.ip();
    if let Err(e) = check(&req, &ctx, ip) {
        info!(
            "worker connection from {} refused: {}",
            conn.peer, e.message
        );
        write_error(&mut conn, Style::OpenAi, &e, false, None);
        return;
    }
    let key = req.header("sec-websocket-key").unwrap_or_default();
    let accept = tungstenite::handshake::derive_accept_key(key.as_bytes());
    let head = format!(
        "HTTP/1.1 101 Switching Protocols\r\nupgrade: websocket\r\nconnection: Upgrade\r\nsec-websocket-accept: {accept}\r\n\r\n"
    );
    if conn.stream.write_all(head.as_bytes()).is_err() {
        return;
    }
    let leftover = conn.take_buffered();
    serve(conn.stream, leftover, &ctx, conn.peer.to_string());
}

fn check(req: &Request, ctx: &Ctx, ip: std::net::IpAddr) -> Result<(), ApiError> {
    if ctx.shared.is_shutting_down() {
        return Err(ApiError::new(
            503,
            "server_shutting_down",
            "the relay is shutting down",
        ));
    }
    let upgrade = req.header("upgrade").unwrap_or("");
    if !upgrade.eq_ignore_ascii_case("websocket") || req.header("sec-websocket-key").is_none() {
        return Err(ApiError::new(
            400,
            "websocket_required",
            "this endpoint expects a WebSocket upgrade",
        ));
    }
    let provider = req
        .query_param("provider")
        .unwrap_or_else(|| ctx.cfg.provider.clone());
    if provider != ctx.cfg.provider {
        return Err(ApiError::new(
            404,
            "unknown_provider",
            format!("unknown provider `{provider}`"),
        ));
    }
    authorize_worker(ctx, req, ip)
}

/// Reads the socket until it ends; the writer thread runs beside it.
fn serve(stream: Stream, leftover: Vec<u8>, ctx: &Ctx, remote: String) {
    let max = ctx.cfg.max_ws_message_bytes;
    let Ok(read_stream) = stream.try_clone() else {
        return;
    };
    let mut reader = ReadHalf::new(read_stream);
    let mut rctx =
        WebSocketContext::from_partially_read(leftover, Role::Server, Some(ws::config(max)));

    let _ = stream.set_read_timeout(Some(REGISTER_TIMEOUT));
    let register = match read_register(&mut rctx, &mut reader) {
        Ok(r) => r,
        Err(reason) => {
            warn!("worker socket from {remote} closed before registering: {reason}");
            let mut w = Writer::new(stream, Role::Server, max);
            let _ = w.close(close_code::PROTOCOL, &reason);
            w.stream.shutdown();
            return;
        }
    };
    let _ = stream.set_read_timeout(None);

    let id = ctx.next_worker_id();
    let Ok(send_stream) = stream.try_clone() else {
        return;
    };
    let raw_bodies = register
        .features
        .iter()
        .any(|f| f == raw_bodies::FEATURE_RAW_BODIES);
    let link = Arc::new(WorkerLink::new(send_stream, raw_bodies));
    let writer = link.clone();
    let spawned = std::thread::Builder::new()
        .name(format!("worker-w{id}-tx"))
        .stack_size(super::THREAD_STACK)
        .spawn(move || writer.write_loop(stream, max, WRITE_TIMEOUT));
    if spawned.is_err() {
        warn!("could not start a writer thread for worker socket from {remote}");
        return;
    }
    let joined = Input::WorkerJoined {
        id,
        register,
        remote,
        link: link.clone(),
    };
    if ctx.inputs.send(joined).is_err() {
        link.close(close_code::GOING_AWAY, "server stopping".into());
        return;
    }
    let reason = read_loop(id, &mut rctx, &mut reader, ctx, &link);
    let _ = ctx
        .inputs
        .send(Input::Event(Event::WorkerLeft { id, reason }));
    // Ends the writer thread once anything still queued is out.
    link.going_away();
}

fn read_register(
    rctx: &mut WebSocketContext,
    reader: &mut ReadHalf<Stream>,
) -> Result<RegisterMessage, String> {
    loop {
        match rctx.read(reader) {
            Ok(Message::Text(text)) => {
                return match WorkerMessage::parse(&text) {
                    Ok(WorkerMessage::Register(reg)) => Ok(reg),
                    Ok(_) => Err("first message must be `register`".into()),
                    Err(e) => Err(format!("invalid register message: {e}")),
                }
            }
            Ok(Message::Close(_)) => return Err("closed by worker".into()),
            Ok(_) => continue,
            Err(e) => return Err(e.to_string()),
        }
    }
}

/// Forwards every message to the dispatcher; returns why the socket ended.
fn read_loop(
    id: WorkerId,
    rctx: &mut WebSocketContext,
    reader: &mut ReadHalf<Stream>,
    ctx: &Ctx,
    link: &WorkerLink,
) -> String {
    loop {
        let result = rctx.read(reader);
        if let Some(bytes) = reader.take_pending() {
            link.send_frames(bytes);
        }
        let parsed = match result {
            Ok(Message::Text(text)) => WorkerMessage::parse(&text),
            // The only binary message: a whole answer, unescaped (`protocol/raw_bodies.rs`).
            Ok(Message::Binary(bytes)) => raw_bodies::decode_answer(&bytes),
            Ok(Message::Close(frame)) => {
                return match frame {
                    Some(f) if !f.reason.is_empty() => format!("closed by worker: {}", f.reason),
                    _ => "closed by worker".into(),
                }
            }
            Ok(_) => continue,
            Err(e) => return format!("socket error: {e}"),
        };
        match parsed {
            Ok(msg) => {
                answer_lent(link, &msg);
                if ctx
                    .inputs
                    .send(Input::Event(Event::WorkerSaid(id, msg)))
                    .is_err()
                {
                    return "server stopping".into();
                }
            }
            Err(e) => warn!("worker w-{id} sent an unusable message ({e}); ignored"),
        }
    }
}

/// Writes a complete answer at once when its answerer was lent to this socket
/// (`dispatcher/reply.rs`) and nothing else came for the request before it; the
/// dispatcher still gets every message, for its bookkeeping.
fn answer_lent(link: &WorkerLink, msg: &WorkerMessage) {
    let other = match msg {
        WorkerMessage::ResponseComplete(rc) => {
            let lent =
                parse_request_id(&rc.request_id).and_then(|id| link.answers.take_for_answer(id));
            if let Some(mut answerer) = lent {
                answerer.answer(rc);
            }
            return;
        }
        WorkerMessage::ResponseChunk { request_id, .. }
        | WorkerMessage::ResponseHead { request_id, .. }
        | WorkerMessage::Busy { request_id, .. }
        | WorkerMessage::BodyCredit { request_id, .. }
        | WorkerMessage::Error {
            request_id: Some(request_id),
            ..
        } => request_id,
        _ => return,
    };
    if let Some(id) = parse_request_id(other) {
        link.answers.spoil(id);
    }
}
