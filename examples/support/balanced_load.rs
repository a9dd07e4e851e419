//! Load through a load balancer in front of several relays, and the accounting of a
//! relay killed under it: for `tests/relays_haproxy.rs` and `make bench-ha`.
//!
//! Every request goes on a fresh connection and is read to the end; the balancer names
//! the relay that answered (or that it last tried) in an `x-relay` header (see
//! `haproxy.rs`).
#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

/// One request, as its client saw it.
#[derive(Debug, Clone)]
pub struct Sent {
    pub started: Instant,
    pub ended: Instant,
    pub stream: bool,
    /// A 200 with the whole answer (a stream ending in `data: [DONE]`).
    pub ok: bool,
    /// The relay the balancer sent it to last (`r1`...), empty when nothing answered.
    pub relay: String,
    /// The status line.
    pub head: String,
}

/// A chat request for model `m` with the fake backend's `scenario`, through `front`.
pub fn chat_via(front: SocketAddr, stream: bool, scenario: &str) -> Sent {
    let started = Instant::now();
    let body = serde_json::json!({"model": "m", "stream": stream, "scenario": scenario,
        "messages": [{"role": "user", "content": "hi"}]})
    .to_string();
    let mut raw = Vec::new();
    let sent = TcpStream::connect(front).and_then(|mut s| {
        s.set_read_timeout(Some(Duration::from_secs(10)))?;
        // `localhost`: relays listening on loopback check the Host (DNS rebinding).
        let head = format!(
            "POST /v1/chat/completions HTTP/1.1\r\nhost: localhost\r\nconnection: close\r\n\
             content-type: application/json\r\ncontent-length: {}\r\n\r\n",
            body.len()
        );
        s.write_all(head.as_bytes())?;
        s.write_all(body.as_bytes())?;
        s.read_to_end(&mut raw)
    });
    let text = String::from_utf8_lossy(&raw).into_owned();
    let (head, rest) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let relay = head
        .lines()
        .find_map(|l| {
            let (n, v) = l.split_once(':')?;
            n.eq_ignore_ascii_case("x-relay")
                .then(|| v.trim().to_string())
        })
        .unwrap_or_default();
    let whole = if stream {
        rest.contains("data: [DONE]")
    } else {
        rest.contains("\"finish_reason\":\"stop\"")
    };
    Sent {
        started,
        ended: Instant::now(),
        stream,
        ok: sent.is_ok() && head.starts_with("HTTP/1.1 200") && whole,
        relay,
        head: head.lines().next().unwrap_or("").to_string(),
    }
}

/// `clients` clients sending one request after another until [`Load::stop`], every
/// other one streamed.
pub struct Load {
    sent: Arc<Mutex<Vec<Sent>>>,
    stop: Arc<AtomicBool>,
    clients: Vec<std::thread::JoinHandle<()>>,
}

impl Load {
    pub fn start(front: SocketAddr, clients: usize, scenario: &str) -> Load {
        let sent = Arc::new(Mutex::new(Vec::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let clients = (0..clients)
            .map(|c| {
                let (sent, stop, scenario) = (sent.clone(), stop.clone(), scenario.to_string());
                std::thread::spawn(move || {
                    let mut n = c;
                    while !stop.load(Ordering::SeqCst) {
                        let s = chat_via(front, n % 2 == 0, &scenario);
                        sent.lock().push(s);
                        n += 1;
                    }
                })
            })
            .collect();
        Load {
            sent,
            stop,
            clients,
        }
    }

    /// Requests answered so far that satisfy `which`.
    pub fn count(&self, which: impl Fn(&Sent) -> bool) -> usize {
        self.sent.lock().iter().filter(|s| which(s)).count()
    }

    /// The last request answered.
    pub fn last(&self) -> Option<Sent> {
        self.sent.lock().last().cloned()
    }

    /// Stops the clients (each finishes its request) and returns every request.
    pub fn stop(self) -> Vec<Sent> {
        self.stop.store(true, Ordering::SeqCst);
        for c in self.clients {
            let _ = c.join();
        }
        let sent = self.sent.lock().clone();
        sent
    }
}

/// What a relay's death cost: `killed` when the kill was sent, `dead` once the process
/// was gone (its sockets closed).
pub struct Tally {
    pub sent: Vec<Sent>,
    pub victim: String,
    pub killed: Instant,
    pub dead: Instant,
}

impl Tally {
    /// Whether `s` was in flight on the dead relay: sent to it before it died, not
    /// answered before the kill.
    pub fn was_on_dead(&self, s: &Sent) -> bool {
        s.relay == self.victim && s.started < self.dead && s.ended >= self.killed
    }

    pub fn lost(&self) -> Vec<&Sent> {
        self.sent.iter().filter(|s| !s.ok).collect()
    }

    pub fn on_dead(&self) -> usize {
        self.sent.iter().filter(|s| self.was_on_dead(s)).count()
    }

    /// Requests sent after the relay died.
    pub fn after(&self) -> Vec<&Sent> {
        self.sent
            .iter()
            .filter(|s| s.started >= self.dead)
            .collect()
    }
}
