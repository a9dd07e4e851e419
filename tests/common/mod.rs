//! Test harness: a real server on an ephemeral port, fake workers speaking protocol v1
//! over a real WebSocket, and a raw HTTP/1.1 client that can hang up at any moment.
#![allow(dead_code)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::sync::Arc;
use std::time::Duration;

use crossbeam_channel::{Receiver, RecvTimeoutError};
use modelrelay::cli::Settings;
use modelrelay::protocol::{RequestMessage, ServerMessage};
use modelrelay::server::{self, Server, ServerConfig, ShutdownHandle};
use modelrelay::ws::{self, ReadHalf, Writer};
use parking_lot::Mutex;
use serde_json::{json, Value};
use tungstenite::client::IntoClientRequest;
use tungstenite::protocol::{Role, WebSocketContext};
use tungstenite::Message;

pub mod fake_server;
pub mod pki;
pub mod procs;
pub mod redis;
pub mod sse;

pub const SECRET: &str = "s3cret";
/// The admin token of [`TestServer::start_admin`].
pub const ADMIN_TOKEN: &str = "test-admin-token";
/// Upper bound for waiting on something that should happen promptly. Tests fail, not
/// hang, when it does not.
pub const WAIT: Duration = Duration::from_secs(10);

pub struct TestServer {
    pub addr: SocketAddr,
    pub handle: ShutdownHandle,
    server: Option<Server>,
}

impl TestServer {
    pub fn start() -> TestServer {
        TestServer::start_with(|_| {})
    }

    pub fn start_with(tweak: impl FnOnce(&mut ServerConfig)) -> TestServer {
        let settings =
            Settings::from_pairs(&[("worker-secret", SECRET), ("listen-addr", "127.0.0.1:0")]);
        let mut cfg = ServerConfig::from_settings(&settings).expect("config");
        tweak(&mut cfg);
        let server = server::start(cfg).expect("server starts");
        TestServer {
            addr: server.local_addr(),
            handle: server.shutdown_handle(),
            server: Some(server),
        }
    }

    /// A server with the admin API on ([`ADMIN_TOKEN`], an empty state directory of its
    /// own), so a test can read `/admin/workers`: the dispatcher answers that query in
    /// turn with the events it received, so what it shows has been applied.
    pub fn start_admin(tweak: impl FnOnce(&mut ServerConfig)) -> TestServer {
        static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("mr-test-admin-{}-{n}", std::process::id()));
        TestServer::start_with(move |c| {
            c.admin_token = Some(ADMIN_TOKEN.into());
            c.state_dir = dir;
            tweak(c);
        })
    }

    /// `GET /admin/workers` (needs [`TestServer::start_admin`]).
    pub fn workers(&self) -> Vec<Value> {
        let auth = format!("Bearer {ADMIN_TOKEN}");
        let r = request(
            self.addr,
            "GET",
            "/admin/workers",
            None,
            &[("authorization", &auth)],
        );
        assert_eq!(r.status, 200, "/admin/workers: {}", r.text());
        r.json()["workers"]
            .as_array()
            .expect("workers list")
            .clone()
    }

    /// Waits until the worker `id` as `/admin/workers` shows it satisfies `pred`.
    pub fn wait_worker(&self, id: &str, what: &str, pred: impl Fn(&Value) -> bool) {
        wait_until(what, || {
            let list = self.workers();
            let found = list.iter().find(|w| w["id"] == id).cloned();
            (found.as_ref().is_some_and(&pred), format!("{list:?}"))
        });
    }

    /// Starts the graceful shutdown and returns a receiver that fires when it finished.
    pub fn shutdown(&mut self) -> Receiver<()> {
        self.handle.shutdown();
        let (tx, rx) = crossbeam_channel::bounded(1);
        if let Some(server) = self.server.take() {
            std::thread::spawn(move || {
                server.wait();
                let _ = tx.send(());
            });
        }
        rx
    }

    pub fn health(&self) -> Value {
        let r = request(self.addr, "GET", "/health", None, &[]);
        serde_json::from_slice(&r.body).expect("health json")
    }

    /// Waits until `/health` satisfies `pred` (the server's own published state).
    pub fn wait_health(&self, what: &str, pred: impl Fn(&Value) -> bool) {
        wait_until(what, || {
            let h = self.health();
            (pred(&h), format!("last health: {h}"))
        });
    }
}

/// Polls `probe` until it reports true; panics after [`WAIT`] with what it last saw.
/// For state another thread publishes (a gauge, a counter, a list): wait for it, never
/// for time.
pub fn wait_until(what: &str, mut probe: impl FnMut() -> (bool, String)) {
    let deadline = std::time::Instant::now() + WAIT;
    loop {
        let (done, seen) = probe();
        if done {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "timed out waiting for {what}; {seen}"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

impl Drop for TestServer {
    fn drop(&mut self) {
        if self.server.is_some() {
            self.handle.shutdown();
        }
    }
}

/// What a fake worker's reader saw.
#[derive(Debug)]
pub enum Seen {
    Msg(ServerMessage),
    Closed(Option<(u16, String)>),
}

pub struct FakeWorker {
    pub worker_id: String,
    pub ack: ServerMessage,
    seen: Receiver<Seen>,
    /// Requests that came as binary messages (`raw_bodies`), read back into `seen`.
    binary: Arc<std::sync::atomic::AtomicUsize>,
    writer: Arc<Mutex<Writer<TcpStream>>>,
    stream: TcpStream,
}

/// Result of a WebSocket upgrade attempt.
pub enum Upgrade {
    Ok(FakeWorker),
    Refused(u16),
}

impl FakeWorker {
    pub fn connect(addr: SocketAddr, models: &[&str], max: u32) -> FakeWorker {
        let register = json!({
            "type": "register", "worker_name": "fake", "models": models,
            "max_concurrent": max, "protocol_version": "1", "current_load": 0
        });
        FakeWorker::connect_as(addr, register)
    }

    /// Connects with a `register` of the test's own (features, load), acked.
    pub fn connect_as(addr: SocketAddr, register: Value) -> FakeWorker {
        match FakeWorker::try_connect(
            addr,
            "/v1/worker/connect?provider=local",
            Some(SECRET),
            register,
        ) {
            Upgrade::Ok(w) => w,
            Upgrade::Refused(status) => panic!("worker refused with {status}"),
        }
    }

    /// Upgrades, sends `register` and waits for the first answer (ack or close).
    pub fn try_connect(
        addr: SocketAddr,
        path: &str,
        secret: Option<&str>,
        register: Value,
    ) -> Upgrade {
        let mut req = format!("ws://{addr}{path}")
            .into_client_request()
            .expect("request");
        if let Some(s) = secret {
            req.headers_mut()
                .insert("x-worker-secret", s.parse().expect("header"));
        }
        let stream = TcpStream::connect(addr).expect("connect");
        stream.set_nodelay(true).ok();
        let ws = match tungstenite::client::client(req, stream) {
            Ok((ws, _)) => ws,
            Err(tungstenite::HandshakeError::Failure(tungstenite::Error::Http(resp))) => {
                return Upgrade::Refused(resp.status().as_u16())
            }
            Err(e) => panic!("handshake failed: {e}"),
        };
        let stream = ws.into_inner();
        let worker = FakeWorker::from_stream(stream);
        worker.send(register);
        Upgrade::Ok(worker.await_ack())
    }

    fn from_stream(stream: TcpStream) -> FakeWorker {
        let writer = Arc::new(Mutex::new(Writer::new(
            stream.try_clone().expect("clone"),
            Role::Client,
            64 << 20,
        )));
        let (tx, seen) = crossbeam_channel::unbounded();
        let mut reader = ReadHalf::new(stream.try_clone().expect("clone"));
        let reply_writer = writer.clone();
        let binary = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let binary_seen = binary.clone();
        std::thread::spawn(move || {
            let mut ctx = WebSocketContext::new(Role::Client, Some(ws::config(64 << 20)));
            loop {
                let result = ctx.read(&mut reader);
                if let Some(bytes) = reader.take_pending() {
                    let _ = reply_writer.lock().raw(&bytes);
                }
                match result {
                    Ok(Message::Text(t)) => {
                        let msg = ServerMessage::parse(&t).expect("server sent valid JSON");
                        if tx.send(Seen::Msg(msg)).is_err() {
                            return;
                        }
                    }
                    Ok(Message::Binary(b)) => {
                        let msg = modelrelay::protocol::raw_bodies::decode_request(&b)
                            .expect("server sent a readable binary request");
                        binary_seen.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                        if tx.send(Seen::Msg(msg)).is_err() {
                            return;
                        }
                    }
                    Ok(Message::Close(frame)) => {
                        let _ = tx.send(Seen::Closed(
                            frame.map(|f| (u16::from(f.code), f.reason.to_string())),
                        ));
                        return;
                    }
                    Ok(_) => {}
                    Err(_) => {
                        let _ = tx.send(Seen::Closed(None));
                        return;
                    }
                }
            }
        });
        FakeWorker {
            worker_id: String::new(),
            ack: ServerMessage::Unknown(String::new()),
            seen,
            binary,
            writer,
            stream,
        }
    }

    fn await_ack(mut self) -> FakeWorker {
        match self.seen.recv_timeout(WAIT) {
            Ok(Seen::Msg(ServerMessage::RegisterAck(ack))) => {
                self.worker_id = ack.worker_id.clone();
                self.ack = ServerMessage::RegisterAck(ack);
            }
            Ok(Seen::Closed(frame)) => {
                self.ack = ServerMessage::Unknown(format!("closed: {frame:?}"));
            }
            other => panic!("expected register_ack, got {other:?}"),
        }
        self
    }

    pub fn send(&self, msg: Value) {
        let mut w = self.writer.lock();
        let _ = w.text(msg.to_string());
        let _ = w.flush();
    }

    pub fn send_text(&self, text: &str) {
        let mut w = self.writer.lock();
        let _ = w.text(text.to_string());
        let _ = w.flush();
    }

    /// Sends a binary message (a `raw_bodies` answer, or junk).
    pub fn send_binary(&self, bytes: Vec<u8>) {
        let mut w = self.writer.lock();
        let _ = w.binary(bytes);
        let _ = w.flush();
    }

    /// How many requests came as binary messages so far.
    pub fn binary_requests(&self) -> usize {
        self.binary.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Writes raw bytes on the socket (for broken frames).
    pub fn send_raw(&self, bytes: &[u8]) {
        let _ = (&self.stream).write_all(bytes);
    }

    /// Next message other than `ping`, or panics after [`WAIT`].
    pub fn recv(&self) -> ServerMessage {
        match self.recv_within(WAIT) {
            Some(msg) => msg,
            None => panic!("worker {} received nothing within {WAIT:?}", self.worker_id),
        }
    }

    pub fn recv_within(&self, limit: Duration) -> Option<ServerMessage> {
        let deadline = std::time::Instant::now() + limit;
        loop {
            match self.seen.recv_deadline(deadline) {
                Ok(Seen::Msg(ServerMessage::Ping { .. })) => continue,
                Ok(Seen::Msg(msg)) => return Some(msg),
                Ok(Seen::Closed(frame)) => panic!("worker socket closed: {frame:?}"),
                Err(RecvTimeoutError::Timeout) => return None,
                Err(RecvTimeoutError::Disconnected) => panic!("worker reader gone"),
            }
        }
    }

    /// Next raw event including pings and the close frame.
    pub fn next_seen(&self, limit: Duration) -> Option<Seen> {
        self.seen.recv_timeout(limit).ok()
    }

    pub fn request(&self) -> Arc<RequestMessage> {
        match self.recv() {
            ServerMessage::Request(r) => r,
            other => panic!("expected a request, got {other:?}"),
        }
    }

    /// Whichever of `workers` is sent a request first: its index and the request.
    pub fn first_request(workers: &[&FakeWorker]) -> (usize, Arc<RequestMessage>) {
        let deadline = std::time::Instant::now() + WAIT;
        loop {
            for (i, w) in workers.iter().enumerate() {
                match w.recv_within(Duration::from_millis(5)) {
                    Some(ServerMessage::Request(r)) => return (i, r),
                    Some(other) => panic!("expected a request, got {other:?}"),
                    None => {}
                }
            }
            assert!(
                std::time::Instant::now() < deadline,
                "no worker received a request within {WAIT:?}"
            );
        }
    }

    pub fn complete(&self, request_id: &str, status: u16, body: &str) {
        self.send(json!({
            "type": "response_complete", "request_id": request_id, "status_code": status,
            "headers": {"content-type": "application/json"}, "body": body
        }));
    }

    pub fn chunk(&self, request_id: &str, chunk: &str) {
        self.send(json!({"type": "response_chunk", "request_id": request_id, "chunk": chunk}));
    }

    pub fn finish_stream(&self, request_id: &str) {
        self.send(
            json!({"type": "response_complete", "request_id": request_id, "status_code": 200}),
        );
    }

    /// Kills the TCP connection without a close frame.
    pub fn kill(&self) {
        let _ = self.stream.shutdown(Shutdown::Both);
    }

    /// Waits for the server to close the socket; returns the close frame.
    pub fn closed(&self) -> Option<(u16, String)> {
        let deadline = std::time::Instant::now() + WAIT;
        loop {
            match self.seen.recv_deadline(deadline) {
                Ok(Seen::Closed(frame)) => return frame,
                Ok(Seen::Msg(_)) => continue,
                Err(_) => panic!("socket was not closed within {WAIT:?}"),
            }
        }
    }
}

/// A parsed HTTP response.
#[derive(Debug)]
pub struct Response {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Response {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {}", self.text()))
    }
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
}

/// One request on a fresh connection, read to the end.
pub fn request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    body: Option<&str>,
    headers: &[(&str, &str)],
) -> Response {
    let mut stream = send_request(addr, method, path, body, headers);
    read_response(&mut stream)
}

/// An admin API call with `token` as the bearer (JSON body when given).
pub fn admin_call(
    addr: SocketAddr,
    token: &str,
    method: &str,
    path: &str,
    body: Option<Value>,
) -> Response {
    let auth = format!("Bearer {token}");
    let body = body.map(|b| b.to_string());
    request(
        addr,
        method,
        path,
        body.as_deref(),
        &[
            ("authorization", &auth),
            ("content-type", "application/json"),
        ],
    )
}

/// One chat request for model `m` as `tenant`; its status (429 when rate-limited).
pub fn chat_as(addr: SocketAddr, tenant: &str) -> u16 {
    let body = json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]});
    request(
        addr,
        "POST",
        "/v1/chat/completions",
        Some(&body.to_string()),
        &[("x-tenant-id", tenant)],
    )
    .status
}

pub fn post(addr: SocketAddr, path: &str, body: &str) -> Response {
    request(
        addr,
        "POST",
        path,
        Some(body),
        &[("content-type", "application/json")],
    )
}

/// Sends a request and returns the open connection (to read or to hang up).
pub fn send_request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    body: Option<&str>,
    headers: &[(&str, &str)],
) -> TcpStream {
    let mut stream = TcpStream::connect(addr).expect("connect");
    stream.set_read_timeout(Some(WAIT)).ok();
    let mut head = format!("{method} {path} HTTP/1.1\r\nhost: localhost\r\nconnection: close\r\n");
    for (n, v) in headers {
        head.push_str(&format!("{n}: {v}\r\n"));
    }
    if let Some(b) = body {
        head.push_str(&format!("content-length: {}\r\n", b.len()));
    }
    head.push_str("\r\n");
    stream.write_all(head.as_bytes()).expect("write head");
    if let Some(b) = body {
        stream.write_all(b.as_bytes()).expect("write body");
    }
    stream
}

/// Reads one length-framed response, leaving what follows in `reader` (a keep-alive
/// connection's next answer).
pub fn read_length_framed(reader: &mut impl BufRead) -> Response {
    let (status, headers) = read_head(reader);
    let len: usize = headers
        .iter()
        .find(|(n, _)| n == "content-length")
        .map(|(_, v)| v.parse().expect("length"))
        .expect("a length-framed answer");
    let mut body = vec![0; len];
    reader.read_exact(&mut body).expect("body");
    Response {
        status,
        headers,
        body,
    }
}

/// Reads a whole response (content-length, chunked, or until close).
pub fn read_response(stream: &mut TcpStream) -> Response {
    let mut reader = BufReader::new(stream);
    let (status, headers) = read_head(&mut reader);
    let get = |n: &str| {
        headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(n))
            .map(|(_, v)| v.clone())
    };
    let body = if get("transfer-encoding").is_some_and(|v| v.contains("chunked")) {
        let mut body = Vec::new();
        while let Some(chunk) = read_chunk(&mut reader) {
            body.extend_from_slice(&chunk);
        }
        body
    } else if let Some(len) = get("content-length") {
        let mut body = vec![0; len.parse().expect("length")];
        reader.read_exact(&mut body).expect("body");
        body
    } else {
        let mut body = Vec::new();
        reader.read_to_end(&mut body).expect("body");
        body
    };
    Response {
        status,
        headers,
        body,
    }
}

pub fn read_head(reader: &mut impl BufRead) -> (u16, Vec<(String, String)>) {
    let mut line = String::new();
    reader.read_line(&mut line).expect("status line");
    let status = line
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("bad status line {line:?}"));
    let mut headers = Vec::new();
    loop {
        line.clear();
        reader.read_line(&mut line).expect("header");
        let l = line.trim_end();
        if l.is_empty() {
            break;
        }
        let (n, v) = l.split_once(':').expect("header line");
        headers.push((n.trim().to_ascii_lowercase(), v.trim().to_string()));
    }
    (status, headers)
}

/// Reads one chunk of a chunked body; `None` at the end (or when the stream breaks).
pub fn read_chunk(reader: &mut impl BufRead) -> Option<Vec<u8>> {
    let mut line = String::new();
    reader.read_line(&mut line).ok()?;
    let size = usize::from_str_radix(line.trim(), 16).ok()?;
    let mut data = vec![0; size + 2];
    reader.read_exact(&mut data).ok()?;
    data.truncate(size);
    (size > 0).then_some(data)
}

/// Opens a `/v1/chat/completions` request for `model` and returns the connection.
pub fn open_chat(addr: SocketAddr, model: &str, stream: bool) -> TcpStream {
    send_request(
        addr,
        "POST",
        "/v1/chat/completions",
        Some(&chat(model, stream)),
        &[],
    )
}

pub fn chat(model: &str, stream: bool) -> String {
    json!({"model": model, "stream": stream, "messages": [{"role": "user", "content": "hi"}]})
        .to_string()
}

/// A whole OpenAI chat completion with `content` and fixed usage (7 in, 3 out).
pub fn openai_answer(content: &str) -> String {
    json!({
        "id": "c1", "object": "chat.completion", "created": 1, "model": "m",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": content},
                     "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}
    })
    .to_string()
}

/// A scripted backend's side: reads one request head and its `content-length` body; `None` at EOF.
pub fn read_request(reader: &mut BufReader<TcpStream>) -> Option<(String, String, Vec<u8>)> {
    let mut line = String::new();
    if reader.read_line(&mut line).ok()? == 0 {
        return None;
    }
    let mut words = line.split_whitespace();
    let method = words.next()?.to_string();
    let path = words.next()?.to_string();
    let mut length = 0;
    loop {
        line.clear();
        if reader.read_line(&mut line).ok()? == 0 {
            return None;
        }
        let l = line.trim_end();
        if l.is_empty() {
            break;
        }
        if let Some((n, v)) = l.split_once(':') {
            if n.trim().eq_ignore_ascii_case("content-length") {
                length = v.trim().parse().ok()?;
            }
        }
    }
    let mut body = vec![0; length];
    reader.read_exact(&mut body).ok()?;
    Some((method, path, body))
}

/// A scripted backend's answer to a `GET` (what a worker asks before serving): model
/// `m` at `/v1/models`, 404 elsewhere.
pub fn answer_get(out: &mut TcpStream, path: &str) -> std::io::Result<()> {
    let (status, body) = match path {
        "/v1/models" => (200, r#"{"object":"list","data":[{"id":"m"}]}"#),
        _ => (404, r#"{"error":"not found"}"#),
    };
    let head = format!(
        "HTTP/1.1 {status} X\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
        body.len()
    );
    out.write_all(format!("{head}{body}").as_bytes())
}
