//! Failover figures (issue 17): `make bench-failover` (or build the release binaries and
//! `cargo run --release --example failover_bench`).
//!
//! Reruns the issue's table with the release `modelrelay-server` and `modelrelay-worker`
//! binaries on loopback: two workers with 4 slots each (`MAX_CONCURRENCY=4`), each with
//! its own std-only fake backend answering after ~0.2 s, one of which goes bad:
//!
//! * it stops (connections refused) after both workers registered — 1 client sending 100
//!   requests one after another, then 4 concurrent clients, half of them streaming, 200;
//! * it answers 500 to everything at once (a wedged GPU; it still lists its model) —
//!   4 concurrent clients, half streaming, 200 requests.
//!
//! Each scenario gets a fresh server, workers and backends. A request counts as failed
//! unless it is a 200 with the whole answer (a stream ending in `data: [DONE]`).
//!
//! Then the revival: the bad backend is stopped until the worker's probe backoff reaches
//! its cap (default `BACKEND_PROBE_MAX_SECS=10`), restarted on the same port just after a
//! probe failed (the slowest case), and timed until `/admin/workers` shows it `up` and
//! until it served a request again.

#[path = "support/fake_backend.rs"]
mod fake_backend;
#[path = "support/http.rs"]
mod http;
#[path = "support/load.rs"]
mod load;
#[path = "support/process.rs"]
mod process;

use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use fake_backend::{FakeBackend, Running};
use http::http;
use process::{free_addr, Process};
use serde_json::Value;

const SECRET: &str = "failover-bench-secret";
const ADMIN: &str = "failover-bench-admin";
const MODEL: &str = "bench";
const ANSWER: &str = "the quick brown fox jumps over the lazy dog";
/// Time the fake backends take per answer.
const ANSWER_DELAY: Duration = Duration::from_millis(200);
/// The worker's default `BACKEND_PROBE_MAX_SECS`.
const PROBE_MAX_SECS: u64 = 10;

fn main() {
    let mut rows = Vec::new();
    let mut notes = Vec::new();
    for scenario in [
        Scenario {
            name: "one backend refuses connections, 1 client, sequential",
            bad: Bad::Refusing,
            clients: 1,
            requests: 100,
            streaming: false,
        },
        Scenario {
            name: "same, 4 concurrent clients, half streaming",
            bad: Bad::Refusing,
            clients: 4,
            requests: 200,
            streaming: true,
        },
        Scenario {
            name: "one backend answers 500 to everything (wedged GPU), 4 clients",
            bad: Bad::Wedged,
            clients: 4,
            requests: 200,
            streaming: true,
        },
    ] {
        eprintln!("running: {} ...", scenario.name);
        let (row, note) = scenario.run();
        eprintln!("  {row}");
        rows.push(row);
        notes.push(note);
    }
    eprintln!("running: revival (takes up to ~30 s) ...");
    let revival = revival();

    println!("| scenario | requests | failed |");
    println!("|---|---|---|");
    for row in &rows {
        println!("{row}");
    }
    println!();
    for note in &notes {
        println!("- {note}");
    }
    println!();
    println!("{revival}");
}

enum Bad {
    /// Stopped after the workers registered: connects are refused.
    Refusing,
    /// Answers every request at once with 500.
    Wedged,
}

struct Scenario {
    name: &'static str,
    bad: Bad,
    clients: usize,
    requests: usize,
    streaming: bool,
}

impl Scenario {
    /// Runs it on a fresh pool; returns the table row and a line of server figures.
    fn run(&self) -> (String, String) {
        let bad = match self.bad {
            Bad::Refusing => healthy_backend(),
            Bad::Wedged => FakeBackend::new(MODEL, ANSWER).always_status(500),
        };
        let mut pool = Pool::start(bad, &[]);
        if let Bad::Refusing = self.bad {
            pool.bad_backend.take().expect("running").stop();
        }
        let started = Instant::now();
        let results = load(
            pool.server.addr,
            self.clients,
            self.requests,
            self.streaming,
        );
        let elapsed = started.elapsed();
        let mut failed: std::collections::BTreeMap<String, usize> = Default::default();
        for r in results.iter().filter(|r| !r.ok) {
            *failed.entry(r.label()).or_default() += 1;
        }
        let total: usize = failed.values().sum();
        let failed = if total == 0 {
            "0".to_string()
        } else {
            let kinds: Vec<String> = failed.iter().map(|(k, n)| format!("{n}× {k}")).collect();
            format!("{total} ({})", kinds.join(", "))
        };
        let metrics = pool.server.metrics();
        let note = format!(
            "{}: {:.1} s; failovers {}, ejections {}, backend states now {}",
            self.name,
            elapsed.as_secs_f64(),
            metric(&metrics, "modelrelay_failovers_total"),
            metric(&metrics, "modelrelay_ejections_total"),
            pool.server
                .workers()
                .iter()
                .map(|w| format!(
                    "{}={}",
                    w["name"].as_str().unwrap_or("?"),
                    w["backend_state"].as_str().unwrap_or("?")
                ))
                .collect::<Vec<_>>()
                .join(" ")
        );
        (
            format!("| {} | {} | {} |", self.name, self.requests, failed),
            note,
        )
    }
}

/// Stops the bad backend, waits until the worker's probe backoff is at its cap, revives
/// the backend on the same port right after a failed probe, and times its return.
fn revival() -> String {
    let mut pool = Pool::start(healthy_backend(), &[("LOG_LEVEL", "debug")]);
    let bad_addr = pool.bad_addr;
    pool.bad_backend.take().expect("running").stop();
    // Requests until the bad worker has tried its dead backend and reported it down.
    for _ in 0..20 {
        if pool.server.backend_state("bad") == "down" {
            break;
        }
        ask(pool.server.addr, false);
    }
    assert_eq!(pool.server.backend_state("bad"), "down", "never went down");
    // Probes fail after 1, 2, 4 and 8 s; from then on they are PROBE_MAX_SECS apart.
    let mut probes = 0;
    let mut seen = 0;
    let deadline = Instant::now() + Duration::from_secs(60);
    while probes < 4 {
        assert!(Instant::now() < deadline, "the worker stopped probing");
        let lines = pool.bad_worker.lines.lock();
        probes += lines[seen..]
            .iter()
            .filter(|l| l.contains("backend probe failed"))
            .count();
        seen = lines.len();
        drop(lines);
        std::thread::sleep(Duration::from_millis(2));
    }
    let revived = healthy_backend();
    let _running = revived
        .clone()
        .spawn_stoppable(&bad_addr.to_string())
        .expect("rebind the bad backend's port");
    let restarted = Instant::now();
    while pool.server.backend_state("bad") != "up" {
        assert!(
            restarted.elapsed() < Duration::from_secs(PROBE_MAX_SECS + 10),
            "the revived backend never came back"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    let up = restarted.elapsed();
    // Idle workers take turns: a few requests reach the revived one.
    while revived.stats.requests.load(Ordering::SeqCst) == 0 {
        assert!(
            restarted.elapsed() < Duration::from_secs(PROBE_MAX_SECS + 20),
            "the revived backend never got a request"
        );
        ask(pool.server.addr, false);
    }
    let served = restarted.elapsed();
    format!(
        "revived backend (restarted right after a failed probe, BACKEND_PROBE_MAX_SECS={PROBE_MAX_SECS}): \
         /admin/workers `up` after {:.2} s, first request served after {:.2} s",
        up.as_secs_f64(),
        served.as_secs_f64()
    )
}

fn healthy_backend() -> FakeBackend {
    FakeBackend::new(MODEL, ANSWER).answer_delay(ANSWER_DELAY)
}

/// A server and two workers, `good` and `bad`, each with its own backend.
struct Pool {
    server: ServerProcess,
    bad_addr: SocketAddr,
    bad_backend: Option<Running>,
    _good_backend: Running,
    _good_worker: Process,
    bad_worker: Process,
}

impl Pool {
    fn start(bad: FakeBackend, bad_worker_env: &[(&str, &str)]) -> Pool {
        let server = ServerProcess::start();
        let good_backend = healthy_backend()
            .spawn_stoppable("127.0.0.1:0")
            .expect("good backend");
        let bad_backend = bad.spawn_stoppable("127.0.0.1:0").expect("bad backend");
        let bad_addr = bad_backend.addr;
        let good_worker = start_worker(server.addr, good_backend.addr, "good", &[]);
        let bad_worker = start_worker(server.addr, bad_addr, "bad", bad_worker_env);
        wait_for("both workers registered and up", || {
            let w = server.workers();
            w.len() == 2 && w.iter().all(|w| w["backend_state"] == "up")
        });
        Pool {
            server,
            bad_addr,
            bad_backend: Some(bad_backend),
            _good_backend: good_backend,
            _good_worker: good_worker,
            bad_worker,
        }
    }
}

/// One client request's result.
struct Outcome {
    status: u16,
    /// A 200 with the whole answer.
    ok: bool,
    code: Option<String>,
}

impl Outcome {
    fn label(&self) -> String {
        match (&self.code, self.status) {
            (Some(code), s) => format!("{s} {code}"),
            (None, 200) => "200, incomplete".into(),
            (None, s) => s.to_string(),
        }
    }
}

/// `clients` concurrent clients send `total` requests between them, each on a fresh
/// connection; with `streaming` every other request streams.
fn load(addr: SocketAddr, clients: usize, total: usize, streaming: bool) -> Vec<Outcome> {
    load::spread(clients, total, move |i| ask(addr, streaming && i % 2 == 1))
}

fn ask(addr: SocketAddr, stream: bool) -> Outcome {
    let body = format!(
        r#"{{"model":"{MODEL}","stream":{stream},"messages":[{{"role":"user","content":"hello"}}]}}"#
    );
    let Ok((status, text)) = http(addr, "POST", "/v1/chat/completions", Some(&body), None) else {
        return Outcome {
            status: 0,
            ok: false,
            code: Some("connection failed".into()),
        };
    };
    let ok = status == 200
        && if stream {
            text.trim_end().ends_with("data: [DONE]")
        } else {
            text.contains("\"finish_reason\":\"stop\"")
        };
    let code = (status != 200)
        .then(|| serde_json::from_str::<Value>(&text).ok())
        .flatten()
        .and_then(|v| v["error"]["code"].as_str().map(str::to_string));
    Outcome { status, ok, code }
}

fn metric(metrics: &str, name: &str) -> String {
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' '))
        .unwrap_or("?")
        .trim()
        .to_string()
}

struct ServerProcess {
    _process: Process,
    addr: SocketAddr,
}

impl ServerProcess {
    fn start() -> ServerProcess {
        let addr = free_addr();
        // Never created: the key store finds no file and starts empty.
        let state = std::env::temp_dir().join(format!("modelrelay-failover-bench-{}", addr.port()));
        let process = Process::spawn(
            "modelrelay-server",
            &[
                ("WORKER_SECRET", SECRET.into()),
                ("LISTEN_ADDR", addr.to_string()),
                ("MODELRELAY_ADMIN_TOKEN", ADMIN.into()),
                ("STATE_DIR", state.to_string_lossy().into_owned()),
                ("LOG_LEVEL", "warn".into()),
            ],
        );
        wait_for("the server to listen", || TcpStream::connect(addr).is_ok());
        ServerProcess {
            _process: process,
            addr,
        }
    }

    fn workers(&self) -> Vec<Value> {
        http(self.addr, "GET", "/admin/workers", None, Some(ADMIN))
            .ok()
            .and_then(|(_, body)| serde_json::from_str::<Value>(&body).ok())
            .and_then(|v| v["workers"].as_array().cloned())
            .unwrap_or_default()
    }

    fn backend_state(&self, name: &str) -> String {
        self.workers()
            .iter()
            .find(|w| w["name"] == name)
            .and_then(|w| w["backend_state"].as_str().map(str::to_string))
            .unwrap_or_default()
    }

    fn metrics(&self) -> String {
        http(self.addr, "GET", "/metrics", None, None)
            .map(|(_, body)| body)
            .unwrap_or_default()
    }
}

fn start_worker(
    server: SocketAddr,
    backend: SocketAddr,
    name: &str,
    extra: &[(&str, &str)],
) -> Process {
    let mut env = vec![
        ("WORKER_SECRET", SECRET.to_string()),
        ("PROXY_URL", format!("http://{server}")),
        ("BACKEND_URL", format!("http://{backend}")),
        ("WORKER_NAME", name.to_string()),
        ("MODELS", MODEL.to_string()),
        ("MAX_CONCURRENCY", "4".to_string()),
        ("LOG_LEVEL", "warn".to_string()),
    ];
    for (k, v) in extra {
        env.retain(|(key, _)| key != k);
        env.push((k, v.to_string()));
    }
    Process::spawn("modelrelay-worker", &env)
}

fn wait_for(what: &str, cond: impl Fn() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}
