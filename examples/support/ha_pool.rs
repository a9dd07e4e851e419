//! A pool of several relays for `make bench-ha`: release `modelrelay-server`s on loopback
//! ports, `modelrelay-worker`s whose `PROXY_URL` lists all of them (4 slots each), a fake
//! backend per worker, and a plain HTTP/1.1 client.
#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use super::fake_backend::FakeBackend;
use super::process::{free_addr, Process};
use serde_json::Value;

pub const SECRET: &str = "ha-bench-secret";
pub const MODEL: &str = "m";
pub const SLOTS: usize = 4;

/// One relay process and its address (kept when it is killed, for a restart).
pub struct Relay {
    pub process: Option<Process>,
    pub addr: SocketAddr,
}

impl Relay {
    pub fn start(addr: SocketAddr) -> Relay {
        let process = Process::spawn(
            "modelrelay-server",
            &[
                ("WORKER_SECRET", SECRET.into()),
                ("LISTEN_ADDR", addr.to_string()),
                ("LOG_LEVEL", "warn".into()),
            ],
        );
        wait_for("a relay answering /health", || health(addr).is_some());
        Relay {
            process: Some(process),
            addr,
        }
    }

    /// SIGKILL, and waits until it is gone (its sockets closed).
    pub fn kill(&mut self) {
        self.process.take();
    }

    pub fn health(&self) -> Value {
        health(self.addr).unwrap_or(Value::Null)
    }

    /// A `/metrics` sample (0 when absent).
    pub fn metric(&self, name: &str) -> f64 {
        let text = http(self.addr, "GET", "/metrics", None).map_or(String::new(), |r| r.body);
        text.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
            .unwrap_or(0.0)
    }
}

pub struct Pool {
    pub relays: Vec<Relay>,
    pub backends: Vec<FakeBackend>,
    workers: Vec<Process>,
}

impl Pool {
    /// `relays` relays and one worker per backend, everyone registered everywhere.
    pub fn start(relays: usize, backends: Vec<FakeBackend>) -> Pool {
        let relays: Vec<Relay> = (0..relays).map(|_| Relay::start(free_addr())).collect();
        let urls: Vec<String> = relays
            .iter()
            .map(|r| format!("http://{}", r.addr))
            .collect();
        let workers = backends
            .iter()
            .enumerate()
            .map(|(i, b)| {
                let addr = b.clone().spawn("127.0.0.1:0").expect("backend");
                Process::spawn(
                    "modelrelay-worker",
                    &[
                        ("WORKER_SECRET", SECRET.into()),
                        ("PROXY_URL", urls.join(",")),
                        ("BACKEND_URL", format!("http://{addr}")),
                        ("WORKER_NAME", format!("w{i}")),
                        ("MODELS", MODEL.into()),
                        ("MAX_CONCURRENCY", SLOTS.to_string()),
                        ("LOG_LEVEL", "warn".into()),
                    ],
                )
            })
            .collect();
        let pool = Pool {
            relays,
            backends,
            workers,
        };
        for r in &pool.relays {
            pool.wait_registered(r);
        }
        pool
    }

    /// Waits until every worker is registered with `relay` and reports all relays.
    pub fn wait_registered(&self, relay: &Relay) {
        let (workers, relays) = (self.backends.len(), self.relays.len());
        wait_for("every worker registered with every relay", || {
            let h = relay.health();
            h["workers_connected"] == workers as u64 && h["relays"] == relays as u64
        });
    }

    pub fn slots(&self) -> usize {
        self.backends.len() * SLOTS
    }

    pub fn backend_requests(&self) -> usize {
        self.backends
            .iter()
            .map(|b| b.stats.requests.load(std::sync::atomic::Ordering::SeqCst))
            .sum()
    }

    pub fn busy_refusals(&self) -> f64 {
        self.relays
            .iter()
            .filter(|r| r.process.is_some())
            .map(|r| r.metric("modelrelay_busy_refusals_total"))
            .sum()
    }
}

/// What a client got.
pub struct Reply {
    pub status: u16,
    pub head: String,
    pub body: String,
}

impl Reply {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.head.lines().find_map(|l| {
            let (n, v) = l.split_once(':')?;
            n.trim().eq_ignore_ascii_case(name).then(|| v.trim())
        })
    }

    /// A 200 with the whole answer (a stream ending in `data: [DONE]`).
    pub fn whole(&self) -> bool {
        self.status == 200
            && (self.body.contains("data: [DONE]")
                || self.body.contains("\"finish_reason\":\"stop\""))
    }
}

/// One request on a fresh connection (`connection: close`), read to the end; the body
/// left chunked (callers only look for markers in it).
pub fn http(addr: SocketAddr, method: &str, path: &str, body: Option<&str>) -> Option<Reply> {
    let mut s = TcpStream::connect(addr).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(60))).ok()?;
    let body = body.unwrap_or("");
    let head = format!(
        "{method} {path} HTTP/1.1\r\nhost: localhost\r\nconnection: close\r\n\
         content-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    s.write_all(head.as_bytes()).ok()?;
    let mut raw = Vec::new();
    let _ = s.read_to_end(&mut raw);
    let text = String::from_utf8_lossy(&raw);
    let (head, body) = text.split_once("\r\n\r\n")?;
    let status = head.split_whitespace().nth(1)?.parse().ok()?;
    Some(Reply {
        status,
        head: head.to_string(),
        body: body.to_string(),
    })
}

pub fn health(addr: SocketAddr) -> Option<Value> {
    let r = http(addr, "GET", "/health", None)?;
    serde_json::from_str(&r.body).ok()
}

/// Polls `done` every 5 ms; panics after a minute.
pub fn wait_for(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while !done() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(5));
    }
}
