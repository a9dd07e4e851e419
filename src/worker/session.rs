//! One registered connection to the server: this thread reads, a writer thread writes,
//! and every request runs on a thread of its own. Request threads and the reader all
//! send through the writer's channel, so frames never interleave and no lock is held
//! while a read blocks.

use std::net::TcpStream;
use std::sync::Arc;
use std::time::Duration;

use crossbeam_channel::Sender;
use log::{debug, error, info, warn};
use tungstenite::protocol::{Role, WebSocketContext};
use tungstenite::Message;

use super::backend::Outcome;
use super::{Control, Shared};
use crate::protocol::{self, RegisterMessage, RequestMessage, ServerMessage, WorkerMessage};
use crate::ws::{self, close_code, Outgoing, ReadHalf};

/// Messages for this session's writer thread.
pub type Out = Sender<Outgoing<WorkerMessage>>;

const ACK_TIMEOUT: Duration = Duration::from_secs(10);
const WRITE_TIMEOUT: Duration = Duration::from_secs(30);

/// The link other threads use to reach the current session.
#[derive(Clone)]
pub struct Link {
    pub out: Out,
    /// The server understands `worker_draining`.
    pub server_drain: bool,
}

/// How a session ended.
#[derive(Debug)]
pub enum End {
    /// Registered and served, then the connection went away.
    Lost(String),
    /// Never got as far as a `register_ack`.
    NotRegistered(String),
}

/// Registers on a connected socket and serves it until it ends.
pub fn run(stream: TcpStream, shared: &Arc<Shared>) -> End {
    let max = shared.cfg.max_ws_message_bytes;
    let (Ok(read_stream), Ok(write_stream)) = (stream.try_clone(), stream.try_clone()) else {
        return End::NotRegistered("cannot clone socket".into());
    };
    let (out, queue) = crossbeam_channel::unbounded();
    let writer = std::thread::Builder::new()
        .name("ws-writer".into())
        .spawn(move || ws::write_loop(write_stream, queue, Role::Client, max, WRITE_TIMEOUT));
    if writer.is_err() {
        return End::NotRegistered("cannot start writer thread".into());
    }
    let mut reader = ReadHalf::new(read_stream);
    let mut ctx = WebSocketContext::new(Role::Client, Some(ws::config(max)));

    let _ = out.send(Outgoing::Message(WorkerMessage::Register(
        register_message(shared),
    )));
    let _ = stream.set_read_timeout(Some(ACK_TIMEOUT));
    let ack = match next_message(&mut ctx, &mut reader, &out) {
        Ok(ServerMessage::RegisterAck(ack)) => ack,
        Ok(other) => return End::NotRegistered(format!("expected register_ack, got {other:?}")),
        Err(reason) => return End::NotRegistered(reason),
    };
    let _ = stream.set_read_timeout(None);
    for w in &ack.warnings {
        warn!("server warning: {w}");
    }
    info!(
        "registered with server as {} (models: {:?})",
        ack.worker_id, ack.models
    );
    let link = Link {
        out: out.clone(),
        server_drain: ack
            .features
            .iter()
            .any(|f| f == protocol::FEATURE_WORKER_DRAIN),
    };
    *shared.session.lock() = Some(link.clone());
    if shared.is_draining() {
        announce_drain(shared, &link);
    }
    let reason = serve(&mut ctx, &mut reader, shared, &out);
    *shared.session.lock() = None;
    // Answers can no longer be delivered: stop the backend; the server requeues.
    shared.inflight.cancel_all();
    let _ = out.send(Outgoing::Close(
        close_code::GOING_AWAY,
        "worker reconnecting".into(),
    ));
    End::Lost(reason)
}

fn register_message(shared: &Shared) -> RegisterMessage {
    RegisterMessage {
        worker_name: shared.cfg.name.clone(),
        models: shared.models.lock().clone(),
        max_concurrent: shared.cfg.max_concurrency,
        protocol_version: Some(shared.cfg.protocol_version.clone()),
        current_load: Some(shared.inflight.len() as u32),
        features: vec![
            protocol::FEATURE_CANCEL_ACK.into(),
            protocol::FEATURE_WORKER_DRAIN.into(),
        ],
    }
}

/// Reads the next protocol message, skipping what cannot be parsed.
fn next_message(
    ctx: &mut WebSocketContext,
    reader: &mut ReadHalf<TcpStream>,
    out: &Out,
) -> Result<ServerMessage, String> {
    loop {
        let result = ctx.read(reader);
        if let Some(bytes) = reader.take_pending() {
            let _ = out.send(Outgoing::Raw(bytes));
        }
        match result {
            Ok(Message::Text(text)) => match ServerMessage::parse(&text) {
                Ok(msg) => return Ok(msg),
                Err(e) => warn!("server sent an unusable message ({e}); ignored"),
            },
            Ok(Message::Close(frame)) => {
                return Err(match frame {
                    Some(f) if !f.reason.is_empty() => {
                        format!("server closed the connection: {}", f.reason)
                    }
                    _ => "server closed the connection".into(),
                })
            }
            Ok(_) => {}
            Err(e) => return Err(format!("connection error: {e}")),
        }
    }
}

fn serve(
    ctx: &mut WebSocketContext,
    reader: &mut ReadHalf<TcpStream>,
    shared: &Arc<Shared>,
    out: &Out,
) -> String {
    loop {
        let msg = match next_message(ctx, reader, out) {
            Ok(msg) => msg,
            Err(reason) => return reason,
        };
        match msg {
            ServerMessage::Request(req) => spawn_request(shared, req, out.clone()),
            ServerMessage::Cancel { request_id, reason } => {
                if shared.inflight.cancel(&request_id) {
                    info!(
                        "request {request_id} cancelled by server ({})",
                        reason.as_str()
                    );
                } else {
                    debug!("cancel for unknown request {request_id}");
                }
            }
            ServerMessage::Ping { timestamp_unix_ms } => {
                let current_load = shared.inflight.len() as u32;
                let _ = out.send(Outgoing::Message(WorkerMessage::Pong {
                    current_load,
                    timestamp_unix_ms,
                }));
            }
            ServerMessage::GracefulShutdown {
                reason,
                drain_timeout_secs,
            } => {
                let timeout = drain_timeout_secs
                    .map(Duration::from_secs)
                    .unwrap_or(shared.cfg.drain_timeout);
                let why = format!(
                    "server asked ({})",
                    reason.unwrap_or_else(|| "no reason given".into())
                );
                let _ = shared.control.send(Control::Drain { timeout, why });
            }
            ServerMessage::ModelsRefresh { .. } => {
                let shared = shared.clone();
                let _ = std::thread::Builder::new()
                    .name("models-refresh".into())
                    .spawn(move || super::refresh_models(&shared, true));
            }
            ServerMessage::RegisterAck(_) => debug!("unexpected second register_ack; ignored"),
            ServerMessage::Unknown(kind) => {
                debug!("server sent unknown message type `{kind}`; ignored")
            }
        }
    }
}

fn spawn_request(shared: &Arc<Shared>, req: Arc<RequestMessage>, out: Out) {
    let shared = shared.clone();
    let spawned = std::thread::Builder::new()
        .name("request".into())
        .stack_size(256 * 1024)
        .spawn(move || serve_request(&shared, &req, &out));
    if let Err(e) = spawned {
        error!("cannot start a request thread: {e}");
    }
}

fn serve_request(shared: &Shared, req: &RequestMessage, out: &Out) {
    let id = req.request_id.as_str();
    let Some(handle) = shared.inflight.insert(id) else {
        warn!("request {id} is already running; duplicate ignored");
        return;
    };
    info!(
        "forwarding request {id}: {} {} (stream: {})",
        req.model, req.endpoint_path, req.is_streaming
    );
    let mut emit = |msg: WorkerMessage| {
        let _ = out.send(Outgoing::Message(msg));
    };
    let outcome = shared.backend.forward(req, &handle, &mut emit);
    let failure = match outcome {
        Outcome::Completed => None,
        Outcome::Cancelled => {
            info!("request {id} cancelled; backend connection closed");
            Some(("cancelled", "request cancelled".to_string(), None))
        }
        Outcome::Unreachable(e) => {
            warn!("backend error for request {id}: {e}");
            let url = shared.backend.url(&req.endpoint_path);
            Some((
                "backend_unreachable",
                format!("backend request to {url} failed: {e}"),
                Some(502),
            ))
        }
        Outcome::StreamBroken(e) => {
            warn!("backend stream for request {id} broke: {e}");
            Some((
                "backend_stream_failed",
                format!("backend stream failed: {e}"),
                Some(502),
            ))
        }
        Outcome::TooLarge(limit) => {
            warn!("backend answer for request {id} exceeds {limit} bytes");
            Some((
                "response_too_large",
                format!("backend answer exceeds {limit} bytes"),
                Some(502),
            ))
        }
    };
    if let Some((code, message, status_code)) = failure {
        emit(WorkerMessage::Error {
            request_id: Some(id.to_string()),
            code: code.into(),
            message,
            status_code,
        });
    }
    shared.inflight.remove(id);
}

/// Tells the server to send nothing new: `worker_draining` where understood, otherwise an
/// empty model list (which any ModelRelay server honours).
pub fn announce_drain(shared: &Shared, link: &Link) {
    let msg = if link.server_drain {
        WorkerMessage::WorkerDraining {}
    } else {
        WorkerMessage::ModelsUpdate {
            models: Vec::new(),
            current_load: shared.inflight.len() as u32,
        }
    };
    let _ = link.out.send(Outgoing::Message(msg));
}
