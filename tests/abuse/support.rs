//! What the abuse scenarios share: a bystander client whose latency is measured while the
//! abuse runs, a fake worker that answers it, and a process's resource figures.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use modelrelay::protocol::ServerMessage;
use serde_json::json;

use crate::common::{chat, openai_answer, FakeWorker, Seen};

/// One client on a keep-alive connection (reconnecting when it breaks), as SDKs pool
/// them.
pub struct Client {
    addr: SocketAddr,
    conn: Option<BufReader<TcpStream>>,
}

impl Client {
    pub fn new(addr: SocketAddr) -> Client {
        Client { addr, conn: None }
    }

    /// One non-streamed chat completion for `model`: the status, or why none came.
    pub fn chat(&mut self, model: &str) -> Result<u16, String> {
        let body = chat(model, false);
        let req = format!(
            "POST /v1/chat/completions HTTP/1.1\r\nhost: localhost\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
            body.len()
        );
        if self.conn.is_none() {
            let s = TcpStream::connect(self.addr).map_err(|e| format!("connect: {e}"))?;
            s.set_read_timeout(Some(Duration::from_secs(30))).ok();
            self.conn = Some(BufReader::new(s));
        }
        let result = self.exchange(&req);
        if result.is_err() {
            self.conn = None;
        }
        result
    }

    fn exchange(&mut self, req: &str) -> Result<u16, String> {
        let conn = self.conn.as_mut().ok_or("no connection")?;
        conn.get_mut()
            .write_all(req.as_bytes())
            .map_err(|e| format!("write: {e}"))?;
        let mut line = String::new();
        conn.read_line(&mut line)
            .map_err(|e| format!("read: {e}"))?;
        let status: u16 = line
            .split_whitespace()
            .nth(1)
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| format!("bad status line {line:?}"))?;
        let mut length = 0;
        let mut close = false;
        loop {
            line.clear();
            conn.read_line(&mut line)
                .map_err(|e| format!("read: {e}"))?;
            let l = line.trim_end().to_ascii_lowercase();
            if l.is_empty() {
                break;
            }
            if let Some(v) = l.strip_prefix("content-length:") {
                length = v.trim().parse().unwrap_or(0);
            }
            close |= l == "connection: close";
        }
        let mut body = vec![0; length];
        conn.read_exact(&mut body)
            .map_err(|e| format!("body: {e}"))?;
        if close {
            self.conn = None;
        }
        Ok(status)
    }
}

/// A client sending chat requests one after another until stopped, timing each.
pub struct Bystander {
    stop: Arc<AtomicBool>,
    handle: JoinHandle<Vec<Result<Duration, String>>>,
}

impl Bystander {
    pub fn start(addr: SocketAddr, model: &str) -> Bystander {
        let stop = Arc::new(AtomicBool::new(false));
        let (s, model) = (stop.clone(), model.to_string());
        let handle = std::thread::spawn(move || {
            let mut client = Client::new(addr);
            let mut seen = Vec::new();
            while !s.load(Ordering::SeqCst) {
                let t0 = Instant::now();
                seen.push(match client.chat(&model) {
                    Ok(200) => Ok(t0.elapsed()),
                    Ok(status) => Err(format!("status {status}")),
                    Err(e) => Err(e),
                });
                std::thread::sleep(Duration::from_millis(5));
            }
            seen
        });
        Bystander { stop, handle }
    }

    /// Stops, prints the latency figures and returns the errors seen.
    pub fn finish(self, scenario: &str) -> Vec<String> {
        self.stop.store(true, Ordering::SeqCst);
        let seen = self.handle.join().unwrap_or_default();
        let mut ok: Vec<Duration> = seen.iter().filter_map(|r| r.clone().ok()).collect();
        let errors: Vec<String> = seen.iter().filter_map(|r| r.clone().err()).collect();
        ok.sort();
        let pct = |p: usize| {
            ok.get((ok.len() * p / 100).min(ok.len().saturating_sub(1)))
                .map_or(0.0, |d| d.as_secs_f64() * 1000.0)
        };
        println!(
            "abuse {scenario}: other client: {} requests, p50 {:.1} ms, p99 {:.1} ms, max {:.1} ms, {} errors {:?}",
            seen.len(),
            pct(50),
            pct(99),
            pct(100),
            errors.len(),
            errors.iter().take(3).collect::<Vec<_>>()
        );
        errors
    }
}

/// A fake worker serving `model` that answers every request at once and pongs, until
/// dropped.
pub struct Answering {
    stop: Arc<AtomicBool>,
    handle: Option<JoinHandle<()>>,
}

impl Answering {
    pub fn start(addr: SocketAddr, model: &str) -> Answering {
        Answering::run(FakeWorker::connect(addr, &[model], 8), true, 0)
    }

    /// Runs `worker`; `answer`: false for one that takes requests and never answers
    /// (it still pongs, with `load` as its current load, so only its silence on
    /// requests gives it away).
    pub fn run(worker: FakeWorker, answer: bool, load: u32) -> Answering {
        let stop = Arc::new(AtomicBool::new(false));
        let s = stop.clone();
        let handle = std::thread::spawn(move || {
            while !s.load(Ordering::SeqCst) {
                match worker.next_seen(Duration::from_millis(50)) {
                    Some(Seen::Msg(ServerMessage::Request(r))) if answer => {
                        worker.complete(&r.request_id, 200, &openai_answer("ok"))
                    }
                    Some(Seen::Msg(ServerMessage::Ping { timestamp_unix_ms })) => {
                        worker.send(json!({"type": "pong", "current_load": load,
                            "timestamp_unix_ms": timestamp_unix_ms}));
                    }
                    Some(Seen::Closed(_)) => return,
                    _ => {}
                }
            }
            worker.kill();
        });
        Answering {
            stop,
            handle: Some(handle),
        }
    }
}

impl Drop for Answering {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}

/// Threads, open descriptors and resident memory (KiB) of a process.
#[derive(Debug, Clone, Copy, Default)]
pub struct Sample {
    pub threads: u64,
    pub fds: u64,
    pub rss_kb: u64,
}

pub fn sample(pid: u32) -> Sample {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.split_whitespace().next()?.parse().ok())
            .unwrap_or(0)
    };
    Sample {
        threads: field("Threads:"),
        fds: std::fs::read_dir(format!("/proc/{pid}/fd")).map_or(0, |d| d.count() as u64),
        rss_kb: field("VmRSS:"),
    }
}

impl std::fmt::Display for Sample {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} threads, {} fds, RSS {:.1} MB",
            self.threads,
            self.fds,
            self.rss_kb as f64 / 1024.0
        )
    }
}

/// Polls `probe` until true, for at most `limit`; false on timeout.
pub fn eventually(limit: Duration, mut probe: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + limit;
    loop {
        if probe() {
            return true;
        }
        if Instant::now() > deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A scale setting: `ABUSE_<NAME>` from the environment, else `default`.
pub fn scale(name: &str, default: usize) -> usize {
    std::env::var(format!("ABUSE_{name}"))
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// The soft limit on open files of this process (the server inherits it).
pub fn open_files_limit() -> usize {
    std::fs::read_to_string("/proc/self/limits")
        .ok()
        .and_then(|text| {
            let line = text.lines().find(|l| l.starts_with("Max open files"))?;
            line.split_whitespace().nth(3)?.parse().ok()
        })
        .unwrap_or(1024)
}
