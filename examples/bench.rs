//! Relay benchmark: `make bench` (or `cargo run --release --example bench`).
//!
//! Starts the real `modelrelay-server` binary, a std-only fake backend and fake workers
//! over loopback, then prints each figure for the relay next to the same figure measured
//! directly against the backend:
//!
//! * added latency p50/p99 of sequential non-streaming requests (one keep-alive client),
//! * stream time-to-first-chunk and largest gap between chunks,
//! * requests/s with 8 and 64 concurrent keep-alive clients, and latency p50/p99 at 64
//!   (relay / direct), streams/s with 32 streaming clients, and at each the CPU time per request
//!   (user + system, all threads) and context switches per request of every relay process
//!   (server; server and worker end to end; the forwarders of the floor): CPU per request
//!   is the figure to judge a change by on a busy machine, throughput the noisy one,
//! * Ollama `/api/chat` streaming next to OpenAI streaming through the same relay: time
//!   to first chunk and sequential latency to the last event (`"done":true` / `[DONE]`),
//! * server CPU and RSS while idle with 100 workers connected.
//!
//! It runs twice: once with fake workers answering from memory (the relay core alone),
//! once through the real `modelrelay-worker` binary and the fake backend (end to end),
//! then measures the floor (two do-nothing byte forwarders with the same TCP hops), and
//! finally times the worker's cancel path (cancel message -> backend socket closed).
//! `BENCH_USAGE_SUBSCRIBERS=N` gives the server an admin token and a state directory
//! (so every request is recorded in the usage journal) and opens N `/api/usage-stream`
//! subscribers that never read, before the figures are taken (`make bench-usage-stream`
//! runs it with 0 and 1,000).
//! `BENCH_SECS` sets the throughput window (default 3); `BENCH_RATE=N` paces every
//! throughput row's clients to offer N requests/s together instead of as many as they
//! can (CPU per request of two relays compared at one load, not each at its saturation);
//! `BENCH_LOAD=host:port` only
//! measures sequential latency and drives `BENCH_CLIENTS` (default 8) clients against
//! that address (for profiling and A/B runs of two builds); `BENCH_PROFILE=clients` runs
//! only the relay core under that load, printing its server's pid first (`BENCH_PROFILE_E2E=clients`
//! the same end to end, printing the server's and the worker's). `BENCH_BIN_DIR=dir` runs the
//! `modelrelay-server` and `modelrelay-worker` found there instead of the ones built beside
//! the bench (`make bench-compare` runs two builds that way, alternating). `BENCH_ORIG=dir`
//! runs the original ModelRelay's binaries from there: its fake workers then register with
//! the original's protocol version, a relay counts as ready once its `/health` shows the
//! workers and a request through it succeeds (both relays answer both), and the rows the
//! original cannot produce (Ollama streaming; the worker's cancel path, timed against a
//! server speaking our protocol version) are left out (`make bench-orig ORIG=dir` runs
//! it alternating with this checkout's build).

#[path = "support/bench_cancel.rs"]
mod bench_cancel;
#[path = "support/bench_profile.rs"]
mod bench_profile;
#[path = "support/fake_backend.rs"]
mod fake_backend;
#[path = "support/forwarder.rs"]
mod forwarder;
#[path = "support/http_load.rs"]
mod http_load;
#[path = "support/process.rs"]
mod process;
#[path = "support/procstat.rs"]
mod procstat;
#[path = "support/rows.rs"]
mod rows;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use fake_backend::FakeBackend;
use forwarder::Chain;
use http_load::{sequential, streams, throughput, Client, OPENAI_PATH};
use modelrelay::protocol::{
    to_json, ResponseComplete, ServerMessage, WorkerMessage, BRIDGE_PROTOCOL_VERSION,
    PROTOCOL_VERSION,
};
use modelrelay::ws::{self, ReadHalf, Writer};
use process::{free_addr, original, Process};
use procstat::{cpu_over, rss_kb};
use rows::{cpu_rows, row_ms, row_ms_in, row_ratio, row_rps, OLLAMA_COLUMN};
use tungstenite::client::IntoClientRequest;
use tungstenite::protocol::{Role, WebSocketContext};
use tungstenite::Message;

const SECRET: &str = "bench-secret";
const ADMIN: &str = "bench-admin";
const MODEL: &str = "bench";
const ANSWER: &str =
    "the quick brown fox jumps over the lazy dog while the relay keeps every token in order";

fn main() {
    forwarder::serve_if_asked();
    let secs: u64 = std::env::var("BENCH_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(3);
    let window = Duration::from_secs(secs);
    if let Ok(target) = std::env::var("BENCH_LOAD") {
        // Load-only mode for profiling: `BENCH_LOAD=127.0.0.1:8080 bench`.
        let addr: SocketAddr = target.parse().expect("BENCH_LOAD=host:port");
        let clients = std::env::var("BENCH_CLIENTS")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(8);
        let seq = sequential(addr, &chat(false), 2000);
        println!(
            "sequential latency p50: {:.3} ms",
            seq.p(50).as_secs_f64() * 1000.0
        );
        let load = throughput(addr, clients, window, &chat(false), &[]);
        println!("requests/s, {clients} clients: {:.0}", load.rps);
        return;
    }
    if let Some(clients) = std::env::var("BENCH_PROFILE")
        .ok()
        .and_then(|s| s.parse().ok())
    {
        bench_profile::profile_core(clients, window);
        return;
    }
    if let Some(clients) = std::env::var("BENCH_PROFILE_E2E")
        .ok()
        .and_then(|s| s.parse().ok())
    {
        bench_profile::profile_e2e(clients, window);
        return;
    }
    let (backend, observed) = FakeBackend::new(MODEL, ANSWER).observed();
    // Requests are reported on `observed`; only the cancel measurement reads it.
    let observed = bench_cancel::drain_requests(observed);
    let backend_addr = backend.clone().spawn("127.0.0.1:0").expect("backend");

    println!("== relay core: server binary + 4 fake workers answering from memory (loopback)");
    let server = ServerProcess::start();
    for _ in 0..4 {
        spawn_fake_worker(server.addr, MODEL, 64, backend.clone());
    }
    wait_ready(server.addr, 4);
    let stalled = stalled_subscribers(server.addr);
    compare(
        backend_addr,
        server.addr,
        window,
        &[("server", server.pid())],
    );
    paced_cpu(&server);
    drop(stalled);
    for _ in 0..100 {
        spawn_fake_worker(server.addr, "idle-model", 1, backend.clone());
    }
    wait_ready(server.addr, 104);
    std::thread::sleep(Duration::from_secs(1));
    let (cpu, idle) = cpu_over(server.pid(), Duration::from_secs(5));
    println!(
        "{:<44} {:>12} {:>11.2}% {:>12}",
        "server CPU idle, 104 workers connected",
        "",
        100.0 * cpu.as_secs_f64() / idle.as_secs_f64(),
        format!("{}ms/{}s", cpu.as_millis(), idle.as_secs())
    );
    println!(
        "{:<44} {:>12} {:>10} KB",
        "server RSS, 104 workers connected",
        "",
        rss_kb(server.pid())
    );
    drop(server);

    println!();
    println!("== end to end: server binary + modelrelay-worker binary (MAX_CONCURRENCY=64) + fake backend");
    let server = ServerProcess::start();
    let worker = WorkerProcess::start(server.addr, backend_addr, "64");
    wait_ready(server.addr, 1);
    std::thread::sleep(Duration::from_millis(300));
    println!(
        "{:<44} {:>12} {:>10} KB",
        "worker RSS idle, connected",
        "",
        rss_kb(worker.pid())
    );
    let stalled = stalled_subscribers(server.addr);
    let watch = [("server", server.pid()), ("worker", worker.pid())];
    compare(backend_addr, server.addr, window, &watch);
    drop(stalled);
    floor(backend_addr, window);
    std::thread::sleep(Duration::from_secs(1));
    let h = health(server.addr);
    let in_flight = h
        .split("\"in_flight\":")
        .nth(1)
        .and_then(|r| r.split(',').next())
        .unwrap_or("?")
        .to_string();
    println!(
        "{:<44} {:>12} {:>12}",
        "after load: server in_flight / backend active",
        "",
        format!(
            "{in_flight} / {}",
            backend.stats.active.load(Ordering::SeqCst)
        )
    );
    println!(
        "{:<44} {:>12} {:>10} KB",
        "worker RSS after load",
        "",
        rss_kb(worker.pid())
    );
    drop(worker);
    drop(server);

    if original() {
        return;
    }
    let cancel = bench_cancel::cancel_latency(backend_addr, &observed, 20);
    println!(
        "{:<44} {:>12} {:>12.3}",
        "worker: cancel -> backend socket closed p50 (ms)",
        "",
        cancel.p(50).as_secs_f64() * 1000.0
    );
    println!(
        "{:<44} {:>12} {:>12.3}",
        "worker: cancel -> backend socket closed max (ms)",
        "",
        cancel.max().as_secs_f64() * 1000.0
    );
}

/// Prints latency, stream and throughput figures for `relay` next to `direct`, and what
/// each `watch` process spent per request under load.
fn compare(direct: SocketAddr, relay: SocketAddr, window: Duration, watch: &[(&str, u32)]) {
    println!(
        "{:<44} {:>12} {:>12} {:>12}",
        "figure", "direct", "relay", "added/ratio"
    );
    let body = chat(false);
    let d = sequential(direct, &body, 2000);
    let r = sequential(relay, &body, 2000);
    row_ms("sequential latency p50 (ms)", d.p(50), r.p(50));
    row_ms("sequential latency p99 (ms)", d.p(99), r.p(99));
    let openai = chat(true);
    let d = streams(direct, OPENAI_PATH, &openai, b"[DONE]", 300);
    let r = streams(relay, OPENAI_PATH, &openai, b"[DONE]", 300);
    // Measured now, next to the OpenAI streams it is compared with; printed below (the
    // original has no Ollama API).
    let o =
        (!original()).then(|| streams(relay, OLLAMA_PATH, &ollama_chat(), br#""done":true"#, 300));
    row_ms(
        "stream time to first chunk p50 (ms)",
        d.ttfc.p(50),
        r.ttfc.p(50),
    );
    row_ms(
        "stream time to first chunk p99 (ms)",
        d.ttfc.p(99),
        r.ttfc.p(99),
    );
    row_ms(
        "largest gap between chunks, worst (ms)",
        d.gap.max(),
        r.gap.max(),
    );
    let pids: Vec<u32> = watch.iter().map(|(_, pid)| *pid).collect();
    let names: Vec<&str> = watch.iter().map(|(name, _)| *name).collect();
    for clients in [8, 64] {
        let d = throughput(direct, clients, window, &body, &[]);
        let r = throughput(relay, clients, window, &body, &pids);
        row_rps(&format!("requests/s, {clients} clients"), &d, &r);
        if clients == 64 {
            let (d, r) = (&d.latency, &r.latency);
            row_ratio("latency p50, 64 clients (ms)", d.p(50), r.p(50));
            row_ratio("latency p99, 64 clients (ms)", d.p(99), r.p(99));
        }
        cpu_rows(&format!("{clients} clients"), &r, &names);
    }
    // Streams under load: each client reads its whole SSE answer before the next.
    let direct_streams = throughput(direct, 32, window, &openai, &[]);
    let relay_streams = throughput(relay, 32, window, &openai, &pids);
    row_rps("streams/s, 32 clients", &direct_streams, &relay_streams);
    cpu_rows("32 streaming clients", &relay_streams, &names);
    // Ollama streaming next to OpenAI streaming, both through the relay; a wider name
    // column, so these rows have their own header.
    let Some(o) = o else { return };
    println!(
        "{:<W$} {:>12} {:>12} {:>12}",
        "same relay: ollama vs openai streaming",
        "openai",
        "ollama",
        "added",
        W = OLLAMA_COLUMN
    );
    row_ms_in(
        OLLAMA_COLUMN,
        "ollama /api/chat stream: time to first chunk p50 (ms)",
        r.ttfc.p(50),
        o.ttfc.p(50),
    );
    row_ms_in(
        OLLAMA_COLUMN,
        "ollama /api/chat stream: sequential latency p50 (ms)",
        r.total.p(50),
        o.total.p(50),
    );
}

const OLLAMA_PATH: &str = "/api/chat";

/// Ollama's chat body: streams by default; `num_predict` is the `max_tokens` of [`chat`].
fn ollama_chat() -> String {
    format!(
        r#"{{"model":"{MODEL}","options":{{"num_predict":16}},"messages":[{{"role":"user","content":"hello"}}]}}"#
    )
}

fn chat(stream: bool) -> String {
    format!(
        r#"{{"model":"{MODEL}","stream":{stream},"max_tokens":16,"messages":[{{"role":"user","content":"hello"}}]}}"#
    )
}

/// What the hops alone cost: two do-nothing byte forwarders (a thread per direction per
/// connection, in a process of their own) between client and backend, the same three TCP
/// hops as client -> server -> worker -> backend but with 6 thread wake-ups per request
/// instead of about 10. This is the ceiling for any relay with that shape on this
/// machine, and its CPU per request the floor of the relay's.
fn floor(backend: SocketAddr, window: Duration) {
    let chain = Chain::start(backend);
    let body = chat(false);
    for clients in [8, 64] {
        let d = throughput(backend, clients, window, &body, &[]);
        let f = throughput(chain.addr, clients, window, &body, &[chain.pid()]);
        let name = format!("floor: 2 byte-forwarding hops, {clients} clients");
        row_rps(&name, &d, &f);
        if clients == 64 {
            row_ratio(
                "floor: latency p99, 64 clients (ms)",
                d.latency.p(99),
                f.latency.p(99),
            );
        }
        cpu_rows(&format!("{clients} clients"), &f, &["floor"]);
    }
}

/// A fake worker answering from memory: the backend's canned completion, or its words as
/// SSE chunks.
fn spawn_fake_worker(relay: SocketAddr, model: &str, max: u32, backend: FakeBackend) {
    let mut req = format!("ws://{relay}/v1/worker/connect?provider=local")
        .into_client_request()
        .expect("req");
    req.headers_mut()
        .insert("x-worker-secret", SECRET.parse().expect("hdr"));
    let stream = TcpStream::connect(relay).expect("connect");
    stream.set_nodelay(true).ok();
    let (ws, _) = tungstenite::client::client(req, stream).expect("handshake");
    let stream = ws.into_inner();
    let model = model.to_string();
    std::thread::spawn(move || {
        let mut writer = Writer::new(stream.try_clone().expect("clone"), Role::Client, 64 << 20);
        let mut reader = ReadHalf::new(stream);
        let mut ctx = WebSocketContext::new(Role::Client, Some(ws::config(64 << 20)));
        // The original refuses any version but its own; ours takes both.
        let version = if original() {
            BRIDGE_PROTOCOL_VERSION
        } else {
            PROTOCOL_VERSION
        };
        let register = format!(
            r#"{{"type":"register","worker_name":"fake","models":["{model}"],"max_concurrent":{max},"protocol_version":"{version}"}}"#
        );
        writer
            .text(register)
            .and_then(|_| writer.flush())
            .expect("register");
        let completion = backend.completion();
        while let Ok(msg) = ctx.read(&mut reader) {
            let Message::Text(text) = msg else { continue };
            match ServerMessage::parse(&text) {
                Ok(ServerMessage::Request(r)) => {
                    if r.is_streaming {
                        for word in &backend.words {
                            let chunk = format!("data: {{\"choices\":[{{\"delta\":{{\"content\":\"{word}\"}}}}]}}\n\n");
                            let msg = WorkerMessage::ResponseChunk {
                                request_id: r.request_id.clone(),
                                chunk,
                            };
                            let _ = writer.text(to_json(&msg));
                            let _ = writer.flush();
                        }
                    }
                    let done = ResponseComplete {
                        request_id: r.request_id.clone(),
                        status_code: 200,
                        body: (!r.is_streaming).then(|| completion.clone()),
                        ..Default::default()
                    };
                    let _ = writer.text(to_json(&WorkerMessage::ResponseComplete(done)));
                    let _ = writer.flush();
                }
                Ok(ServerMessage::Ping { timestamp_unix_ms }) => {
                    let _ = writer.text(to_json(&WorkerMessage::Pong {
                        current_load: 0,
                        timestamp_unix_ms,
                    }));
                    let _ = writer.flush();
                }
                _ => {}
            }
        }
    });
}

/// `BENCH_USAGE_SUBSCRIBERS`, when set (even to 0): the usage journal is on.
fn usage_subscribers() -> Option<usize> {
    std::env::var("BENCH_USAGE_SUBSCRIBERS").ok()?.parse().ok()
}

/// Opens the `BENCH_USAGE_SUBSCRIBERS` usage-stream subscribers that never read.
fn stalled_subscribers(server: SocketAddr) -> Vec<TcpStream> {
    let n = usage_subscribers().unwrap_or(0);
    let subscribers: Vec<TcpStream> = (0..n)
        .filter_map(|_| {
            let mut s = TcpStream::connect(server).ok()?;
            let head = format!(
                "GET /api/usage-stream HTTP/1.1\r\nhost: localhost\r\nauthorization: Bearer {ADMIN}\r\n\r\n"
            );
            s.write_all(head.as_bytes()).ok()?;
            Some(s)
        })
        .collect();
    if n > 0 {
        let want = format!("modelrelay_usage_stream_subscribers {}", subscribers.len());
        wait_for(|| http_get(server, "/metrics").contains(&want));
        println!(
            "({} usage-stream subscribers that never read)",
            subscribers.len()
        );
    }
    subscribers
}

struct ServerProcess {
    process: Process,
    addr: SocketAddr,
    state: Option<std::path::PathBuf>,
}

impl Drop for ServerProcess {
    fn drop(&mut self) {
        if let Some(dir) = &self.state {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}

impl ServerProcess {
    fn start() -> ServerProcess {
        let addr = free_addr();
        let mut env = vec![
            ("WORKER_SECRET", SECRET.to_string()),
            ("LISTEN_ADDR", addr.to_string()),
            ("LOG_LEVEL", "warn".into()),
            ("MAX_QUEUE_LEN", "1000".into()),
            ("MAX_CONNECTIONS", "8192".into()),
        ];
        let state = usage_subscribers().map(|_| {
            let dir = std::env::temp_dir().join(format!(
                "mr-bench-{}-{}",
                std::process::id(),
                addr.port()
            ));
            env.push(("MODELRELAY_ADMIN_TOKEN", ADMIN.into()));
            env.push(("STATE_DIR", dir.to_string_lossy().into_owned()));
            dir
        });
        let process = Process::spawn("modelrelay-server", &env);
        wait_for(|| TcpStream::connect(addr).is_ok());
        ServerProcess {
            process,
            addr,
            state,
        }
    }

    fn pid(&self) -> u32 {
        self.process.pid()
    }
}

struct WorkerProcess(Process);

impl WorkerProcess {
    fn start(server: SocketAddr, backend: SocketAddr, slots: &str) -> WorkerProcess {
        WorkerProcess(Process::spawn(
            "modelrelay-worker",
            &[
                ("WORKER_SECRET", SECRET.into()),
                ("PROXY_URL", format!("http://{server}")),
                ("BACKEND_URL", format!("http://{backend}")),
                ("MODELS", MODEL.into()),
                ("MAX_CONCURRENCY", slots.into()),
                ("LOG_LEVEL", "warn".into()),
            ],
        ))
    }

    fn pid(&self) -> u32 {
        self.0.pid()
    }
}

/// With `BENCH_USAGE_SUBSCRIBERS` set: the server's CPU while one client sends a steady
/// 200 requests a second for 5 s (CPU time is a steadier figure than throughput on a
/// busy machine, and it is what idle subscribers would cost).
fn paced_cpu(server: &ServerProcess) {
    if usage_subscribers().is_none() {
        return;
    }
    let stop = Arc::new(AtomicBool::new(false));
    let (addr, flag) = (server.addr, stop.clone());
    let client = std::thread::spawn(move || {
        let mut c = Client::connect(addr);
        let body = chat(false);
        let mut next = Instant::now();
        while !flag.load(Ordering::Relaxed) {
            c.send(&body);
            c.read(|_, _| {});
            next += Duration::from_millis(5);
            std::thread::sleep(next.saturating_duration_since(Instant::now()));
        }
    });
    std::thread::sleep(Duration::from_millis(500));
    let (cpu, over) = cpu_over(server.pid(), Duration::from_secs(5));
    stop.store(true, Ordering::Relaxed);
    let _ = client.join();
    println!(
        "{:<44} {:>12} {:>11.2}% {:>12}",
        "server CPU at 200 req/s (usage journal on)",
        "",
        100.0 * cpu.as_secs_f64() / over.as_secs_f64(),
        format!("{}ms/{}s", cpu.as_millis(), over.as_secs())
    );
}

/// Waits until the relay's `/health` counts `workers` connected (a field both relays
/// report) and a chat request through it is answered.
fn wait_ready(addr: SocketAddr, workers: usize) {
    let want = format!("\"workers_connected\":{workers}");
    wait_for(|| health(addr).contains(&want));
    let body = chat(false);
    wait_for(|| {
        let mut c = Client::connect(addr);
        c.send(&body);
        c.read(|_, _| {}) == 200
    });
}

fn health(addr: SocketAddr) -> String {
    http_get(addr, "/health")
}

fn http_get(addr: SocketAddr, path: &str) -> String {
    let Ok(mut s) = TcpStream::connect(addr) else {
        return String::new();
    };
    let head = format!("GET {path} HTTP/1.1\r\nhost: localhost\r\nconnection: close\r\n\r\n");
    let _ = s.write_all(head.as_bytes());
    let mut out = String::new();
    let _ = s.read_to_string(&mut out);
    out
}

fn wait_for(cond: impl Fn() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !cond() {
        assert!(Instant::now() < deadline, "benchmark setup timed out");
        std::thread::sleep(Duration::from_millis(20));
    }
}
