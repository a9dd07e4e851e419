//! Issue 17, worker side: the real `modelrelay-worker` binary against a fake server (a
//! real WebSocket, so every message the worker sends is seen exactly as on the wire) and
//! a fake backend that dies, comes back, resets connections or answers 5xx.
//!
//! Nothing here sleeps to synchronise: each step waits for an observable message or log
//! line, with a deadline.

mod common;
#[path = "../examples/support/fake_backend.rs"]
mod fake_backend;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::procs::start_worker;
use common::WAIT;
use crossbeam_channel::Receiver;
use fake_backend::{FakeBackend, Running};
use modelrelay::ws::{self, ReadHalf, Writer};
use parking_lot::Mutex;
use serde_json::{json, Value};
use tungstenite::protocol::{Role, WebSocketContext};
use tungstenite::Message;

const ANSWER: &str = "one two three";
/// `BACKEND_PROBE_MAX_SECS` for these tests: a revived backend must be noticed within
/// this plus one second.
const PROBE_MAX_SECS: u64 = 2;
const HEALTH_FEATURES: &[&str] = &["worker_drain", "backend_health", "failover"];

/// A stand-in for `modelrelay-server`: accepts worker sessions and acks them with the
/// given features (none: an original ModelRelay server).
struct FakeServer {
    addr: SocketAddr,
    sessions: Receiver<Session>,
}

impl FakeServer {
    fn start(features: &'static [&'static str]) -> FakeServer {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = listener.local_addr().expect("addr");
        let (tx, sessions) = crossbeam_channel::unbounded();
        std::thread::spawn(move || {
            for stream in listener.incoming().flatten() {
                let tx = tx.clone();
                std::thread::spawn(move || {
                    if let Some(session) = Session::accept(stream, features) {
                        let _ = tx.send(session);
                    }
                });
            }
        });
        FakeServer { addr, sessions }
    }

    /// The next registered worker session.
    fn session(&self) -> Session {
        self.sessions
            .recv_timeout(WAIT)
            .expect("the worker never registered")
    }
}

/// One registered worker connection: everything it sent, in order.
struct Session {
    register: Value,
    incoming: Receiver<Value>,
    /// Every message received so far, for order checks and failure messages.
    history: Mutex<Vec<Value>>,
    writer: Arc<Mutex<Writer<TcpStream>>>,
}

impl Session {
    fn accept(mut stream: TcpStream, features: &[&str]) -> Option<Session> {
        upgrade(&mut stream).ok()?;
        let writer = Arc::new(Mutex::new(Writer::new(
            stream.try_clone().ok()?,
            Role::Server,
            64 << 20,
        )));
        let (tx, incoming) = crossbeam_channel::unbounded();
        let reader = ReadHalf::new(stream.try_clone().ok()?);
        let replies = writer.clone();
        std::thread::spawn(move || read_loop(reader, replies, tx));
        let register = incoming.recv_timeout(WAIT).ok()?;
        assert_eq!(register["type"], "register", "{register}");
        let mut ack =
            json!({"type": "register_ack", "worker_id": "w-1", "models": register["models"]});
        if !features.is_empty() {
            ack["features"] = json!(features);
        }
        let session = Session {
            register,
            incoming,
            history: Mutex::new(Vec::new()),
            writer,
        };
        session.send(ack);
        Some(session)
    }

    fn send(&self, msg: Value) {
        let mut w = self.writer.lock();
        let _ = w.text(msg.to_string());
        let _ = w.flush();
    }

    fn request(&self, id: &str, scenario: &str, stream: bool) {
        let body = json!({"model": "m", "stream": stream, "scenario": scenario,
            "messages": [{"role": "user", "content": "hi"}]});
        self.send(json!({
            "type": "request", "request_id": id, "model": "m",
            "endpoint_path": "/v1/chat/completions", "is_streaming": stream,
            "body": body.to_string()
        }));
    }

    /// Waits up to `limit` for a message matching `pred`; returns it and its position in
    /// the session's history.
    fn wait_for(
        &self,
        what: &str,
        limit: Duration,
        pred: impl Fn(&Value) -> bool,
    ) -> (usize, Value) {
        let deadline = Instant::now() + limit;
        if let Some(found) = self.find(&pred) {
            return found;
        }
        loop {
            let Ok(msg) = self.incoming.recv_deadline(deadline) else {
                panic!(
                    "no {what} within {limit:?}; the worker sent: {:#?}",
                    self.history.lock()
                );
            };
            let mut history = self.history.lock();
            history.push(msg.clone());
            if pred(&msg) {
                return (history.len() - 1, msg);
            }
        }
    }

    fn find(&self, pred: impl Fn(&Value) -> bool) -> Option<(usize, Value)> {
        let history = self.history.lock();
        let at = history.iter().position(pred)?;
        Some((at, history[at].clone()))
    }

    /// The final message for request `id` (`error` or `response_complete`).
    fn outcome(&self, id: &str) -> (usize, Value) {
        self.wait_for(&format!("outcome of {id}"), WAIT, |m| {
            m["request_id"] == id && (m["type"] == "error" || m["type"] == "response_complete")
        })
    }

    fn backend_status(&self, state: &str, limit: Duration) -> (usize, Value) {
        self.wait_for(&format!("backend_status {state}"), limit, |m| {
            m["type"] == "backend_status" && m["state"] == state
        })
    }

    fn models_update(&self, models: Value, limit: Duration) -> (usize, Value) {
        self.wait_for(&format!("models_update {models}"), limit, |m| {
            m["type"] == "models_update" && m["models"] == models
        })
    }

    /// Drops the connection without a close frame, as a crashed server would.
    fn kill(&self) {
        let _ = self.writer.lock().stream.shutdown(std::net::Shutdown::Both);
    }

    fn sent_any(&self, kind: &str) -> bool {
        self.find(|m| m["type"] == kind).is_some()
    }
}

/// Answers the worker's WebSocket upgrade (it may send no frame before the 101).
fn upgrade(stream: &mut TcpStream) -> std::io::Result<()> {
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        stream.read_exact(&mut byte)?;
        head.push(byte[0]);
    }
    let head = String::from_utf8_lossy(&head);
    let key = head
        .lines()
        .find_map(|l| {
            let (name, value) = l.split_once(':')?;
            name.eq_ignore_ascii_case("sec-websocket-key")
                .then(|| value.trim().to_string())
        })
        .ok_or_else(|| std::io::Error::other("no sec-websocket-key"))?;
    let accept = tungstenite::handshake::derive_accept_key(key.as_bytes());
    write!(
        stream,
        "HTTP/1.1 101 Switching Protocols\r\nupgrade: websocket\r\nconnection: Upgrade\r\nsec-websocket-accept: {accept}\r\n\r\n"
    )
}

fn read_loop(
    mut reader: ReadHalf<TcpStream>,
    replies: Arc<Mutex<Writer<TcpStream>>>,
    tx: crossbeam_channel::Sender<Value>,
) {
    let mut ctx = WebSocketContext::new(Role::Server, Some(ws::config(64 << 20)));
    loop {
        let result = ctx.read(&mut reader);
        if let Some(bytes) = reader.take_pending() {
            let _ = replies.lock().raw(&bytes);
        }
        match result {
            Ok(Message::Text(text)) => {
                let msg: Value = serde_json::from_str(&text).expect("worker sent JSON");
                if tx.send(msg).is_err() {
                    return;
                }
            }
            Ok(Message::Close(_)) | Err(_) => return,
            Ok(_) => {}
        }
    }
}

/// A healthy backend on an ephemeral port that can be stopped and revived on that port.
fn backend() -> Running {
    FakeBackend::new("m", ANSWER)
        .spawn_stoppable("127.0.0.1:0")
        .expect("backend")
}

fn revive(addr: SocketAddr) -> (Running, Instant) {
    let running = FakeBackend::new("m", ANSWER)
        .spawn_stoppable(&addr.to_string())
        .expect("rebind the backend's port");
    (running, Instant::now())
}

/// A worker with `MODELS=models`; debug logs show each failed probe.
fn worker(server: &FakeServer, backend: SocketAddr, models: &str) -> common::procs::Proc {
    let max = PROBE_MAX_SECS.to_string();
    start_worker(
        server.addr,
        backend,
        &[
            ("MODELS", models),
            ("BACKEND_PROBE_MAX_SECS", &max),
            ("LOG_LEVEL", "debug"),
        ],
    )
}

fn revival_limit() -> Duration {
    Duration::from_secs(PROBE_MAX_SECS + 1)
}

fn assert_retryable(error: &Value, code: &str, status: u16) {
    assert_eq!(error["type"], "error", "{error}");
    assert_eq!(error["retryable"], true, "{error}");
    assert_eq!(error["code"], code, "{error}");
    assert_eq!(error["status_code"], status, "{error}");
}

#[test]
fn refused_backend_is_reported_down_and_up_again_to_a_health_aware_server() {
    let server = FakeServer::start(HEALTH_FEATURES);
    let running = backend();
    let addr = running.addr;
    let w = worker(&server, addr, "m");
    let s = server.session();
    assert_eq!(s.register["models"], json!(["m"]));
    for feature in ["failover", "backend_health", "cancel_ack", "worker_drain"] {
        let features = s.register["features"].as_array().expect("features");
        assert!(features.iter().any(|f| f == feature), "{}", s.register);
    }

    running.stop();
    s.request("r1", "", false);
    let (error_at, error) = s.outcome("r1");
    assert_retryable(&error, "backend_unreachable", 502);
    assert!(error["message"]
        .as_str()
        .unwrap_or("")
        .contains(&addr.to_string()));
    let (down_at, down) = s.backend_status("down", WAIT);
    assert!(
        down_at < error_at,
        "backend_status down comes before the error"
    );
    assert!(!down["reason"].as_str().unwrap_or("").is_empty(), "{down}");
    w.wait_line("backend down: ");

    // A request that still arrives is refused at once, and the load stays honest.
    s.request("r2", "", true);
    let (_, error) = s.outcome("r2");
    assert_retryable(&error, "backend_unreachable", 502);
    assert!(error["message"]
        .as_str()
        .unwrap_or("")
        .contains("backend is down"));
    s.send(json!({"type": "ping", "timestamp_unix_ms": 7}));
    let (_, pong) = s.wait_for("pong", WAIT, |m| m["type"] == "pong");
    assert_eq!(pong["current_load"], 0);

    // Two failed probes (after 1 s, then 2 s): the backoff is at its cap, the slowest
    // case for noticing the revival.
    for _ in 0..2 {
        w.wait_line_after(w.line_count(), "backend probe failed");
    }
    let (_revived, revived_at) = revive(addr);
    s.backend_status("up", revival_limit());
    eprintln!(
        "backend revived -> backend_status up: {:?} (BACKEND_PROBE_MAX_SECS={PROBE_MAX_SECS})",
        revived_at.elapsed()
    );
    w.wait_line("backend up again after");
    assert!(!s.sent_any("models_update"), "the models never changed");
    s.request("r3", "", false);
    let (_, done) = s.outcome("r3");
    assert_eq!(done["type"], "response_complete", "{done}");
    assert_eq!(done["status_code"], 200);
}

#[test]
fn an_original_server_sees_an_empty_model_list_then_the_real_one() {
    let server = FakeServer::start(&[]);
    let running = backend();
    let addr = running.addr;
    let w = worker(&server, addr, "*");
    let s = server.session();
    assert_eq!(s.register["models"], json!(["m"]));

    running.stop();
    s.request("r1", "", true);
    let (error_at, error) = s.outcome("r1");
    assert_retryable(&error, "backend_unreachable", 502);
    let (empty_at, _) = s.models_update(json!([]), WAIT);
    assert!(empty_at < error_at, "the empty list comes before the error");
    w.wait_line("backend down: ");

    let (_revived, revived_at) = revive(addr);
    s.models_update(json!(["m"]), revival_limit());
    eprintln!(
        "backend revived -> models_update [m]: {:?}",
        revived_at.elapsed()
    );
    assert!(
        !s.sent_any("backend_status"),
        "not understood by this server"
    );
    s.request("r2", "", false);
    assert_eq!(s.outcome("r2").1["status_code"], 200);
}

#[test]
fn a_backend_dead_at_start_up_is_probed_until_it_answers() {
    let addr = TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("free port");
    let server = FakeServer::start(HEALTH_FEATURES);
    let w = worker(&server, addr, "*");
    let first = server.session();
    assert_eq!(
        first.register["models"],
        json!([]),
        "nothing to advertise yet"
    );
    first.backend_status("down", WAIT);
    w.wait_line("backend down: ");

    // Reconnecting while still down: `down` is the first thing after the ack.
    first.kill();
    let s = server.session();
    assert_eq!(s.register["models"], json!([]));
    let (down_at, _) = s.backend_status("down", WAIT);
    assert_eq!(down_at, 0, "{:#?}", s.history.lock());

    let (_revived, revived_at) = revive(addr);
    let (up_at, _) = s.backend_status("up", revival_limit());
    let (models_at, _) = s.models_update(json!(["m"]), WAIT);
    eprintln!(
        "backend revived after a dead start -> models_update [m]: {:?}",
        revived_at.elapsed()
    );
    assert!(up_at < models_at, "{:#?}", s.history.lock());
    s.request("r1", "", true);
    assert_eq!(s.outcome("r1").1["status_code"], 200);
}

#[test]
fn a_backend_resetting_connections_gives_a_retryable_error() {
    let server = FakeServer::start(HEALTH_FEATURES);
    let running = backend();
    let addr = running.addr;
    let _w = worker(&server, addr, "m");
    let s = server.session();
    running.stop();
    let _resetting = FakeBackend::new("m", ANSWER)
        .resetting()
        .spawn_stoppable(&addr.to_string())
        .expect("rebind");
    s.request("r1", "", false);
    let (_, error) = s.outcome("r1");
    assert_retryable(&error, "backend_unreachable", 502);
    s.backend_status("down", WAIT);
}

#[test]
fn backend_502_503_504_are_retryable_with_their_status_and_no_outage() {
    let server = FakeServer::start(HEALTH_FEATURES);
    let running = backend();
    let _w = worker(&server, running.addr, "m");
    let s = server.session();
    for (i, (stream, status)) in [(false, 503), (true, 503), (false, 502), (true, 504)]
        .into_iter()
        .enumerate()
    {
        let id = format!("r{i}");
        s.request(&id, &format!("status:{status}"), stream);
        let (_, error) = s.outcome(&id);
        assert_retryable(&error, "backend_unavailable", status);
        let message = error["message"].as_str().unwrap_or("");
        assert!(
            message.contains(&format!("scenario status {status}")),
            "{error}"
        );
    }
    s.request("ok", "", false);
    assert_eq!(s.outcome("ok").1["status_code"], 200);
    assert!(!s.sent_any("backend_status"), "an answer is not an outage");
    assert!(!s.sent_any("response_chunk"), "nothing relayed for the 5xx");
}

#[test]
fn backend_500_and_4xx_pass_through_as_before() {
    let server = FakeServer::start(HEALTH_FEATURES);
    let running = backend();
    let _w = worker(&server, running.addr, "m");
    let s = server.session();
    for (i, (stream, status)) in [(false, 500), (true, 500), (false, 400), (true, 429)]
        .into_iter()
        .enumerate()
    {
        let id = format!("r{i}");
        s.request(&id, &format!("status:{status}"), stream);
        let (_, done) = s.outcome(&id);
        assert_eq!(done["type"], "response_complete", "{done}");
        assert_eq!(done["status_code"], status);
        let body = done["body"].as_str().unwrap_or("");
        assert!(
            body.contains(&format!("scenario status {status}")),
            "{done}"
        );
    }
    s.request("ok", "", false);
    assert_eq!(s.outcome("ok").1["status_code"], 200);
    assert!(!s.sent_any("error"), "{:#?}", s.history.lock());
    assert!(!s.sent_any("backend_status"));
}

#[test]
fn toward_a_server_without_failover_502_503_504_pass_through_as_before() {
    // An original ModelRelay server cannot run a request elsewhere: it gets the
    // backend's own answer (status, body), not a retryable error.
    let server = FakeServer::start(&[]);
    let running = backend();
    let _w = worker(&server, running.addr, "m");
    let s = server.session();
    for (i, (stream, status)) in [(false, 503), (true, 502)].into_iter().enumerate() {
        let id = format!("r{i}");
        s.request(&id, &format!("status:{status}"), stream);
        let (_, done) = s.outcome(&id);
        assert_eq!(done["type"], "response_complete", "{done}");
        assert_eq!(done["status_code"], status);
    }
    assert!(!s.sent_any("error"), "{:#?}", s.history.lock());
}
