//! `make bench-dashboard`: what open dashboards cost the relay. The release server (with
//! an admin token), one real `modelrelay-worker` (64 slots) and a std-only fake backend;
//! the server's CPU time is read from `/proc` over each window:
//!
//! * idle, with 0 and with `BENCH_DASHBOARDS` (default 10) dashboards open (each signed
//!   in with a session of its own and reading `/dashboard/events`, as a browser tab does);
//! * under load (8 keep-alive clients sending chat requests as fast as answers come), with
//!   0 and with the dashboards open: server CPU, requests/s, and snapshots each
//!   dashboard received per second (the feed sends at most 4).
//!
//! `BENCH_SECS` sets each window (default 10).

#[path = "support/fake_backend.rs"]
mod fake_backend;
#[path = "support/process.rs"]
mod process;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use fake_backend::FakeBackend;
use process::{free_addr, Process};

const SECRET: &str = "bench-secret";
const ADMIN: &str = "bench-admin";
const MODEL: &str = "bench";
const CLIENTS: usize = 8;

fn main() {
    let window = Duration::from_secs(env_num("BENCH_SECS", 10));
    let dashboards = env_num("BENCH_DASHBOARDS", 10) as usize;
    let backend = FakeBackend::new(MODEL, "a short answer from the fake backend")
        .spawn("127.0.0.1:0")
        .expect("backend");
    let addr = free_addr();
    let state = std::env::temp_dir().join(format!("mr-dash-bench-{}", std::process::id()));
    let server = Process::spawn(
        "modelrelay-server",
        &[
            ("WORKER_SECRET", SECRET.into()),
            ("LISTEN_ADDR", addr.to_string()),
            ("MODELRELAY_ADMIN_TOKEN", ADMIN.into()),
            ("STATE_DIR", state.to_string_lossy().into_owned()),
            ("LOG_LEVEL", "warn".into()),
        ],
    );
    let _worker = Process::spawn(
        "modelrelay-worker",
        &[
            ("WORKER_SECRET", SECRET.into()),
            ("PROXY_URL", format!("http://{addr}")),
            ("BACKEND_URL", format!("http://{backend}")),
            ("MODELS", MODEL.into()),
            ("MAX_CONCURRENCY", "64".into()),
            ("LOG_LEVEL", "warn".into()),
        ],
    );
    wait_for(|| get(addr, "/health").contains("\"workers_connected\":1"));
    println!(
        "{:<34} {:>12} {:>14} {:>22}",
        "window", "server CPU", "requests/s", "snapshots/s per tab"
    );
    for load in [false, true] {
        for n in [0, dashboards] {
            let tabs: Vec<Tab> = (0..n).map(|_| Tab::open(addr)).collect();
            wait_for(|| tabs.iter().all(|t| t.snapshots.load(Ordering::Relaxed) > 0));
            let seen: Vec<u64> = tabs
                .iter()
                .map(|t| t.snapshots.load(Ordering::Relaxed))
                .collect();
            let before = cpu_ticks(server.pid());
            let started = Instant::now();
            let requests = if load {
                drive(addr, window)
            } else {
                std::thread::sleep(window);
                0
            };
            let elapsed = started.elapsed().as_secs_f64();
            let cpu = (cpu_ticks(server.pid()) - before) as f64 / 100.0;
            let per_tab = tabs
                .iter()
                .zip(&seen)
                .map(|(t, s)| (t.snapshots.load(Ordering::Relaxed) - s) as f64 / elapsed)
                .fold(0.0, f64::max);
            let label = format!(
                "{}, {n} dashboards",
                if load { "load (8 clients)" } else { "idle" }
            );
            println!(
                "{label:<34} {:>11.2}% {:>14.0} {:>22}",
                100.0 * cpu / elapsed,
                requests as f64 / elapsed,
                if n == 0 {
                    "-".to_string()
                } else {
                    format!("{per_tab:.2} (max)")
                }
            );
        }
    }
    let _ = std::fs::remove_dir_all(&state);
}

/// A dashboard tab: its own session and one event stream, read as it arrives.
struct Tab {
    snapshots: Arc<AtomicU64>,
    stream: TcpStream,
    stop: Arc<AtomicBool>,
}

impl Tab {
    fn open(addr: SocketAddr) -> Tab {
        let body = format!(r#"{{"token":"{ADMIN}"}}"#);
        let answer = request(
            addr,
            &format!(
                "POST /dashboard/signin HTTP/1.1\r\nhost: localhost\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                body.len()
            ),
        );
        let cookie = answer
            .lines()
            .find_map(|l| l.strip_prefix("set-cookie: "))
            .and_then(|c| c.split(';').next())
            .expect("session cookie")
            .to_string();
        let mut stream = TcpStream::connect(addr).expect("connect");
        let head = format!(
            "GET /dashboard/events HTTP/1.1\r\nhost: localhost\r\ncookie: {cookie}\r\n\r\n"
        );
        stream.write_all(head.as_bytes()).expect("write");
        let snapshots = Arc::new(AtomicU64::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let (count, reader, quit) = (
            snapshots.clone(),
            stream.try_clone().expect("clone"),
            stop.clone(),
        );
        std::thread::spawn(move || {
            let mut reader = BufReader::new(reader);
            let mut line = String::new();
            while !quit.load(Ordering::Relaxed) {
                line.clear();
                match reader.read_line(&mut line) {
                    Ok(0) | Err(_) => return,
                    Ok(_) if line.starts_with("event: snapshot") => {
                        count.fetch_add(1, Ordering::Relaxed);
                    }
                    Ok(_) => {}
                }
            }
        });
        Tab {
            snapshots,
            stream,
            stop,
        }
    }
}

impl Drop for Tab {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        let _ = self.stream.shutdown(Shutdown::Both);
    }
}

/// `CLIENTS` keep-alive clients sending non-streaming chat requests for `window`;
/// returns how many were answered.
fn drive(addr: SocketAddr, window: Duration) -> u64 {
    let done = Arc::new(AtomicU64::new(0));
    let until = Instant::now() + window;
    let body = format!(
        r#"{{"model":"{MODEL}","max_tokens":16,"messages":[{{"role":"user","content":"hello"}}]}}"#
    );
    let threads: Vec<_> = (0..CLIENTS)
        .map(|_| {
            let (done, body) = (done.clone(), body.clone());
            std::thread::spawn(move || {
                let mut s = TcpStream::connect(addr).expect("connect");
                s.set_nodelay(true).ok();
                let mut reader = BufReader::new(s.try_clone().expect("clone"));
                let head = format!(
                    "POST /v1/chat/completions HTTP/1.1\r\nhost: localhost\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
                    body.len()
                );
                while Instant::now() < until {
                    if s.write_all(head.as_bytes()).is_err() || !read_answer(&mut reader) {
                        return;
                    }
                    done.fetch_add(1, Ordering::Relaxed);
                }
            })
        })
        .collect();
    for t in threads {
        let _ = t.join();
    }
    done.load(Ordering::Relaxed)
}

/// Reads one response with a `content-length` body; false when the connection failed.
fn read_answer(reader: &mut BufReader<TcpStream>) -> bool {
    let mut len = 0;
    let mut line = String::new();
    loop {
        line.clear();
        if reader.read_line(&mut line).unwrap_or(0) == 0 {
            return false;
        }
        if let Some(v) = line.to_ascii_lowercase().strip_prefix("content-length:") {
            len = v.trim().parse().unwrap_or(0);
        }
        if line == "\r\n" {
            break;
        }
    }
    let mut body = vec![0; len];
    reader.read_exact(&mut body).is_ok()
}

fn request(addr: SocketAddr, raw: &str) -> String {
    let mut s = TcpStream::connect(addr).expect("connect");
    s.write_all(raw.as_bytes()).expect("write");
    let mut out = String::new();
    let _ = s.read_to_string(&mut out);
    out
}

fn get(addr: SocketAddr, path: &str) -> String {
    match TcpStream::connect(addr) {
        Ok(_) => request(
            addr,
            &format!("GET {path} HTTP/1.1\r\nhost: localhost\r\nconnection: close\r\n\r\n"),
        ),
        Err(_) => String::new(),
    }
}

/// utime + stime of `pid`, in clock ticks (10 ms).
fn cpu_ticks(pid: u32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let fields: Vec<&str> = stat
        .rsplit(')')
        .next()
        .unwrap_or("")
        .split_whitespace()
        .collect();
    let field = |i: usize| {
        fields
            .get(i)
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(0)
    };
    field(11) + field(12)
}

fn env_num(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn wait_for(cond: impl Fn() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !cond() {
        assert!(Instant::now() < deadline, "benchmark setup timed out");
        std::thread::sleep(Duration::from_millis(20));
    }
}
