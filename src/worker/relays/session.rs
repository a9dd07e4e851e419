//! One registered connection to one relay. Its connection thread reads; the backend slots and
//! the reader write whole frames through [`SessionWriter`], whose lock covers only the
//! write half, so frames never interleave, no lock is held while a read blocks, and a
//! chunk leaves the moment its slot read it from the backend (no writer thread to wake).
//! A server silent for three of its ping intervals ends the session ([`Silence`]): a
//! black-holed connection delivers no close.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use log::{debug, info, warn};
use std::sync::Mutex;
use tungstenite::protocol::{Role, WebSocketContext};
use tungstenite::Message;

use crate::net::Stream;
use crate::protocol::lifecycle::{WorkerStatus, FEATURE_LIFECYCLE};
use crate::protocol::{self, raw_bodies, RegisterMessage, ServerMessage, WorkerMessage};
use crate::worker::health::{self, Told};
use crate::worker::{Control, Shared};
use crate::ws::{self, close_code, ReadHalf, Writer};

/// The write half of the session's socket, shared by every thread that sends.
pub type Out = Arc<SessionWriter>;

pub struct SessionWriter {
    /// `None` once the socket failed or was closed.
    writer: Mutex<Option<Writer<Stream>>>,
    /// The server listed [`raw_bodies::FEATURE_RAW_BODIES`]: whole answers go as binary
    /// messages.
    raw_bodies: AtomicBool,
}

impl SessionWriter {
    fn new(stream: Stream, max: usize) -> SessionWriter {
        let _ = stream.set_write_timeout(Some(WRITE_TIMEOUT));
        SessionWriter {
            writer: Mutex::new(Some(Writer::new(stream, Role::Client, max))),
            raw_bodies: AtomicBool::new(false),
        }
    }

    /// Sends one message; false if the session is gone.
    pub fn send(&self, msg: &WorkerMessage) -> bool {
        if let WorkerMessage::ResponseComplete(done) = msg {
            if self.raw_bodies.load(Ordering::Relaxed) {
                if let Some(bytes) = raw_bodies::encode_answer(done) {
                    return self.with(|w| w.binary(bytes).and_then(|_| w.flush()));
                }
            }
        }
        let text = protocol::to_json_sized(msg, msg.text_hint());
        self.with(|w| w.text(text).and_then(|_| w.flush()))
    }

    /// Writes control-frame bytes captured by the reader.
    pub fn raw(&self, bytes: &[u8]) -> bool {
        self.with(|w| w.raw(bytes).and_then(|_| w.flush()))
    }

    /// Sends a close frame and shuts the socket down (which also ends the reader).
    pub fn close(&self, code: u16, reason: &str) {
        if let Some(mut w) = self.lock().take() {
            let _ = w.close(code, reason);
            w.stream.shutdown();
        }
    }

    /// A plain futex mutex: it does not spin-yield, which matters with many writers
    /// on a small box. A poisoned lock is still a usable writer.
    fn lock(&self) -> std::sync::MutexGuard<'_, Option<Writer<Stream>>> {
        self.writer.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn with(&self, op: impl FnOnce(&mut Writer<Stream>) -> tungstenite::Result<()>) -> bool {
        let mut guard = self.lock();
        let Some(w) = guard.as_mut() else {
            return false;
        };
        if op(w).is_ok() {
            return true;
        }
        // A failed write leaves the socket unusable: shut it so the reader ends too.
        w.stream.shutdown();
        *guard = None;
        false
    }
}

/// The `graceful_shutdown` reason of a relay that is itself stopping.
const SERVER_SHUTDOWN: &str = "server_shutdown";
const ACK_TIMEOUT: Duration = Duration::from_secs(10);
const WRITE_TIMEOUT: Duration = Duration::from_secs(30);

/// The link other threads use to reach one relay's current session.
#[derive(Clone)]
pub struct Link {
    pub out: Out,
    /// The relay's index in `PROXY_URL`.
    pub relay: usize,
    /// The server understands `worker_draining`.
    pub server_drain: bool,
    /// The server understands `backend_status`.
    pub backend_health: bool,
    /// The server reads `error.retryable` and runs such requests elsewhere.
    pub failover: bool,
    /// The server reads `response_head`.
    pub response_head: bool,
    /// The server grants `answer_credit` for binary answers.
    pub answer_credit: bool,
    /// What the server was last told about models and backend (see `health::sync`).
    pub told: Arc<parking_lot::Mutex<Told>>,
    /// The server runs model operations and reads `worker_status`.
    pub lifecycle: bool,
    /// The last `worker_status` this server got (see `lifecycle::status`).
    pub status_told: Arc<parking_lot::Mutex<WorkerStatus>>,
    /// The server answers `sleep_request` (`worker/power/suspend.rs`).
    pub sleep: bool,
    /// The server reads `owner_status` (`worker/power/owner.rs`).
    pub owner_yield: bool,
    /// The relay reads `load` (listed `load_reports` back).
    pub load_reports: bool,
    /// The relay understands `busy`: refuse its requests when every slot is taken.
    pub busy: bool,
    /// The relay reads `prefixes` (see `relays/affinity.rs`).
    pub affinity_reports: bool,
    /// The load this relay was last told (`register` or `load`), under the lock that
    /// orders load reports (see `relays::report_load`).
    pub load_told: Arc<parking_lot::Mutex<Option<u32>>>,
}

/// How a session ended.
#[derive(Debug)]
pub enum End {
    /// Registered and served, then the connection went away.
    Lost(String),
    /// Never got as far as a `register_ack`.
    NotRegistered(String),
}

/// Registers on a connected socket to relay `relay` and serves it until it ends.
pub fn run(stream: Stream, shared: &Arc<Shared>, relay: usize) -> End {
    let max = shared.cfg.max_ws_message_bytes;
    let (Ok(read_stream), Ok(write_stream)) = (stream.try_clone(), stream.try_clone()) else {
        return End::NotRegistered("cannot clone socket".into());
    };
    let out: Out = Arc::new(SessionWriter::new(write_stream, max));
    let mut reader = ReadHalf::new(read_stream);
    let mut ctx = WebSocketContext::new(Role::Client, Some(ws::config(max)));

    let register = register_message(shared);
    let registered_load = register.current_load;
    let told = Told::registered(
        register.models.clone(),
        register.loaded_models.clone(),
        register.model_info.clone(),
    );
    let _ = out.send(&WorkerMessage::Register(register));
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
        "registered with server {} as {} (models: {:?})",
        crate::worker::backend::url::redacted(&shared.cfg.connect_urls[relay]),
        ack.worker_id,
        ack.models
    );
    let has = |feature: &str| ack.features.iter().any(|f| f == feature);
    out.raw_bodies
        .store(has(raw_bodies::FEATURE_RAW_BODIES), Ordering::Relaxed);
    let link = Link {
        out: out.clone(),
        relay,
        server_drain: has(protocol::FEATURE_WORKER_DRAIN),
        backend_health: has(protocol::FEATURE_BACKEND_HEALTH),
        failover: has(protocol::FEATURE_FAILOVER),
        response_head: has(protocol::FEATURE_RESPONSE_HEAD),
        answer_credit: has(protocol::pieces::FEATURE_ANSWER_CREDIT),
        told: Arc::new(parking_lot::Mutex::new(told)),
        lifecycle: has(FEATURE_LIFECYCLE),
        status_told: Arc::default(),
        sleep: has(protocol::power::FEATURE_SLEEP),
        owner_yield: has(protocol::power::FEATURE_OWNER_YIELD),
        load_reports: has(protocol::FEATURE_LOAD_REPORTS),
        busy: has(protocol::FEATURE_BUSY),
        affinity_reports: has(protocol::affinity::FEATURE_AFFINITY_REPORTS),
        load_told: Arc::new(parking_lot::Mutex::new(registered_load)),
    };
    shared.relays.set(relay, Some(link.clone()));
    crate::worker::power::owner::announce_busy(shared);
    if shared.is_draining() {
        announce_drain(shared, &link);
    }
    // A backend that is down now (or went down since `register`): say so at once.
    health::sync(shared, false);
    // Likewise the load, if it changed since `register`; and every relay hears of this one.
    super::report_load(shared);
    super::report_relays(shared);
    // A new server has heard nothing of the backend's version and resources.
    shared.lifecycle.kick();
    let reason = serve(
        &mut ctx,
        &mut reader,
        shared,
        &link,
        ack.heartbeat_interval_secs,
    );
    shared.relays.set(relay, None);
    super::report_relays(shared);
    // This relay's answers can no longer be delivered: stop them at the backend (the
    // relay requeues them); the other relays' requests run on.
    let held = shared.held.relay_lost(relay);
    shared.inflight.cancel_relay(relay, &held);
    out.close(close_code::GOING_AWAY, "worker reconnecting");
    End::Lost(reason)
}

/// `register` lists no models while the backend is down: the server's features are not
/// known yet, and an empty list keeps any server from routing here meanwhile. It carries
/// the backend's kind, loaded models and model descriptions when known (an original
/// server ignores them).
fn register_message(shared: &Shared) -> RegisterMessage {
    let models = if shared.health.is_down() {
        Vec::new()
    } else {
        shared.models.lock().clone()
    };
    let loaded_models = shared.residency.loaded_among(&models);
    let model_info = shared.residency.info_among(&models);
    let mut features: Vec<String> = vec![
        protocol::FEATURE_CANCEL_ACK.into(),
        protocol::FEATURE_WORKER_DRAIN.into(),
        protocol::FEATURE_FAILOVER.into(),
        protocol::FEATURE_BACKEND_HEALTH.into(),
        FEATURE_LIFECYCLE.into(),
        protocol::FEATURE_HEARTBEAT_INTERVAL.into(),
        protocol::FEATURE_RESPONSE_HEAD.into(),
        protocol::binary::FEATURE_BINARY_BODIES.into(),
        protocol::pieces::FEATURE_BODY_PIECES.into(),
        protocol::pieces::FEATURE_ANSWER_CREDIT.into(),
        raw_bodies::FEATURE_RAW_BODIES.into(),
        // Understood whatever the backend; the server sends continuations only to
        // workers whose backend kind can go on from a prefix.
        protocol::continuation::FEATURE_CONTINUATION.into(),
    ];
    features.extend(crate::worker::power::features(&shared.cfg.power));
    // Only a worker serving several relays shares its slots: with one, `register` is
    // exactly what it always was.
    if shared.cfg.connect_urls.len() > 1 {
        features.push(protocol::FEATURE_LOAD_REPORTS.into());
        features.push(protocol::FEATURE_BUSY.into());
        features.push(protocol::affinity::FEATURE_AFFINITY_REPORTS.into());
        features.push(protocol::held::FEATURE_HELD_STREAMS.into());
    }
    RegisterMessage {
        worker_name: shared.cfg.name.clone(),
        models,
        max_concurrent: shared.cfg.max_concurrency,
        protocol_version: Some(shared.cfg.protocol_version.clone()),
        current_load: Some(shared.inflight.len() as u32),
        features,
        loaded_models,
        backend_kind: shared.residency.kind().map(|k| k.as_str().to_string()),
        model_info,
        wake: shared.power.wake.clone(),
        routes: shared
            .cfg
            .routes
            .reported(shared.residency.kind(), shared.residency.listed_routes()),
    }
}

/// Reads the next protocol message, skipping what cannot be parsed.
fn next_message(
    ctx: &mut WebSocketContext,
    reader: &mut ReadHalf<Stream>,
    out: &Out,
) -> Result<ServerMessage, String> {
    loop {
        let result = ctx.read(reader);
        if let Some(bytes) = reader.take_pending() {
            out.raw(&bytes);
        }
        match result {
            Ok(Message::Text(text)) => match ServerMessage::parse(&text) {
                Ok(msg) => return Ok(msg),
                Err(e) => warn!("server sent an unusable message ({e}); ignored"),
            },
            // The only binary message: a request, its body unescaped (`raw_bodies`).
            Ok(Message::Binary(bytes)) => match raw_bodies::decode_request(&bytes) {
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
            Err(tungstenite::Error::Io(e)) if is_timeout(&e) => return Err(TIMED_OUT.into()),
            Err(e) => return Err(format!("connection error: {e}")),
        }
    }
}

/// What [`next_message`] reports when the socket's read timeout passed.
const TIMED_OUT: &str = "no message from the server in time";

fn is_timeout(e: &std::io::Error) -> bool {
    matches!(
        e.kind(),
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
    )
}

/// How many ping intervals of silence end a session.
const SILENT_INTERVALS: u32 = 3;
/// The shortest silence that ends a session, whatever the interval.
const MIN_SILENCE: Duration = Duration::from_secs(2);

/// Notices a server that went silent. The server pings every heartbeat interval (and
/// drops a worker silent for three of them); the worker knows the interval from
/// `register_ack` (our server) or learns it from the gaps between pings (an original
/// server) and, once it knows it, treats three intervals without a single byte from the
/// server as a dead connection: a network that black-holes the socket
/// (a NAT or firewall dropping state, a partition) sends no close, so without this the
/// worker would wait forever on a connection the server has long dropped. The limit
/// only grows (the longest gap seen), and a server that never pings is never timed out.
#[derive(Debug, Default)]
pub struct Silence {
    last_ping: Option<Instant>,
    longest_gap: Duration,
}

impl Silence {
    /// The server said its ping interval (`register_ack.heartbeat_interval_secs`): the
    /// read timeout from the start.
    pub fn announced(&mut self, interval: Option<Duration>) -> Option<Duration> {
        let interval = interval.filter(|i| !i.is_zero())?;
        self.longest_gap = interval;
        Some((interval * SILENT_INTERVALS).max(MIN_SILENCE))
    }

    /// Records a ping; returns the new read timeout when it changed.
    pub fn ping(&mut self, now: Instant) -> Option<Duration> {
        let previous = self.last_ping.replace(now)?;
        let gap = now.saturating_duration_since(previous);
        if gap <= self.longest_gap {
            return None;
        }
        self.longest_gap = gap;
        Some((gap * SILENT_INTERVALS).max(MIN_SILENCE))
    }
}

fn serve(
    ctx: &mut WebSocketContext,
    reader: &mut ReadHalf<Stream>,
    shared: &Arc<Shared>,
    link: &Link,
    announced: Option<u64>,
) -> String {
    let out = &link.out;
    let mut silence = Silence::default();
    let mut limit = silence.announced(announced.map(Duration::from_secs));
    if let Some(limit) = limit {
        let _ = reader.stream.set_read_timeout(Some(limit));
    }
    loop {
        let msg = match next_message(ctx, reader, out) {
            Ok(msg) => msg,
            Err(reason) if reason == TIMED_OUT => {
                let secs = limit.map_or(0.0, |l: Duration| l.as_secs_f64());
                return format!(
                    "the server went silent for {secs:.1}s ({SILENT_INTERVALS} ping intervals): connection presumed dead"
                );
            }
            Err(reason) => return reason,
        };
        if matches!(msg, ServerMessage::Ping { .. }) {
            if let Some(new) = silence.ping(Instant::now()) {
                let _ = reader.stream.set_read_timeout(Some(new));
                limit = Some(new);
            }
        }
        match msg {
            ServerMessage::Request(req) => {
                shared.power.sleep.touch();
                shared.slots.submit(shared, req, link);
            }
            ServerMessage::Cancel { request_id, reason } => {
                if shared.held.cancel(link.relay, &request_id) {
                    info!(
                        "request {request_id}: held stream detached from relay {}",
                        link.relay
                    );
                } else if shared.inflight.cancel(link.relay, &request_id) {
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
                out.send(&WorkerMessage::Pong {
                    current_load,
                    timestamp_unix_ms,
                });
            }
            ServerMessage::GracefulShutdown {
                reason,
                drain_timeout_secs: _,
            } if shared.cfg.connect_urls.len() > 1
                && reason.as_deref() == Some(SERVER_SHUTDOWN) =>
            {
                // One relay of several is going away: it sends nothing new and closes
                // when its requests are done; the worker serves the others meanwhile
                // and dials it again (a restart). Other reasons (an operator's drain)
                // still drain the whole worker.
                info!(
                    "{} is shutting down; serving the other relays meanwhile",
                    crate::worker::backend::url::redacted(&shared.cfg.connect_urls[link.relay])
                );
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
                    .spawn(move || crate::worker::refresh_models(&shared, true));
            }
            ServerMessage::ModelOperation(op) => {
                crate::worker::lifecycle::start(shared, op, out.clone());
            }
            ServerMessage::WakePeer {
                worker_name,
                mac,
                broadcast,
            } => crate::worker::power::wake::wake_peer(&worker_name, &mac, &broadcast),
            ServerMessage::SleepAnswer { granted, reason } => {
                shared.power.sleep.answered(granted, reason)
            }
            ServerMessage::Prefixes(note) => super::affinity::pass_on(shared, link.relay, note),
            ServerMessage::Attach(msg) => shared.held.attach(link, &msg),
            ServerMessage::AnswerCredit { request_id, until } => {
                shared
                    .inflight
                    .answer_credit(link.relay, &request_id, until)
            }
            ServerMessage::BodyPiece {
                request_id,
                seq,
                chunk,
                last,
            } => {
                // Past its credit, or for a request that expects none: the upload cannot
                // be trusted to be whole, so it ends.
                if !shared
                    .inflight
                    .piece(link.relay, &request_id, (seq, chunk, last))
                    && shared.inflight.cancel(link.relay, &request_id)
                {
                    warn!("request {request_id}: body piece {seq} not expected; cancelled");
                }
            }
            ServerMessage::RegisterAck(_) => debug!("unexpected second register_ack; ignored"),
            ServerMessage::Unknown(kind) => {
                debug!("server sent unknown message type `{kind}`; ignored")
            }
        }
    }
}

/// Tells the server to send nothing new: `worker_draining` where understood, otherwise an
/// empty model list (which any ModelRelay server honours).
pub fn announce_drain(shared: &Shared, link: &Link) {
    let mut told = link.told.lock();
    let msg = if link.server_drain {
        WorkerMessage::WorkerDraining {}
    } else {
        told.models.clear();
        WorkerMessage::ModelsUpdate {
            models: Vec::new(),
            current_load: shared.inflight.len() as u32,
            loaded_models: None,
            model_info: None,
        }
    };
    link.out.send(&msg);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn silence_limit_is_learned_from_pings_and_only_grows() {
        let t0 = Instant::now();
        let mut s = Silence::default();
        // One ping says nothing about the interval: no limit yet.
        assert_eq!(s.ping(t0), None);
        assert_eq!(
            s.ping(t0 + Duration::from_secs(15)),
            Some(Duration::from_secs(45))
        );
        // A shorter gap (a ping that came early) does not shrink it.
        assert_eq!(s.ping(t0 + Duration::from_secs(20)), None);
        assert_eq!(
            s.ping(t0 + Duration::from_secs(40)),
            Some(Duration::from_secs(60))
        );
        // A fast-pinging server still gets at least MIN_SILENCE.
        let mut fast = Silence::default();
        fast.ping(t0);
        assert_eq!(
            fast.ping(t0 + Duration::from_millis(100)),
            Some(MIN_SILENCE)
        );
    }
}
