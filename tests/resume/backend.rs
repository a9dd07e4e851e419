//! A backend whose streamed answer is a fixed sequence of events the test lets out one
//! at a time, and that reports when its client (the worker) closed the connection: a
//! cancel reached it.
//!
//! Every POST streams `data: {"choices":[{"delta":{"content":"w<n> "}}]}` for n = 1..=N,
//! each only once the test allowed it ([`Gate::allow`]), then `data: [DONE]` once N+1
//! is allowed. While it waits it watches the connection, so a cancel is seen at once.

use std::io::{BufReader, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender};
use parking_lot::{Condvar, Mutex};
use serde_json::json;

// The fake backend's HTTP helpers (reading a request, writing chunks).
#[allow(dead_code)]
#[path = "../../examples/support/fake_wire.rs"]
mod wire;

/// How far each stream may go; shared by the test and the backend.
#[derive(Default)]
pub struct Gate {
    allowed: Mutex<usize>,
    changed: Condvar,
}

impl Gate {
    /// A new stream starts: nothing allowed yet.
    pub fn reset(&self) {
        *self.allowed.lock() = 0;
    }

    /// Lets the streams send events up to `n` (`N + 1`: the end too).
    pub fn allow(&self, n: usize) {
        let mut allowed = self.allowed.lock();
        if n > *allowed {
            *allowed = n;
            self.changed.notify_all();
        }
    }
}

pub struct Backend {
    pub addr: SocketAddr,
    pub gate: Arc<Gate>,
    /// One message per stream the worker closed before its end.
    pub cancels: Receiver<Instant>,
}

/// The `n`th event of every answer.
pub fn event(n: usize) -> String {
    let chunk = json!({"object": "chat.completion.chunk", "model": "m",
        "choices": [{"index": 0, "delta": {"content": format!("w{n} ")}}]});
    format!("data: {chunk}\n\n")
}

/// Starts a backend serving model `m` with `events` events per answer.
pub fn start(events: usize) -> Backend {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("addr");
    let gate = Arc::new(Gate::default());
    let (tx, cancels) = crossbeam_channel::unbounded();
    let shared = gate.clone();
    std::thread::spawn(move || {
        for conn in listener.incoming().flatten() {
            let (gate, tx) = (shared.clone(), tx.clone());
            std::thread::spawn(move || serve(conn, &gate, events, &tx));
        }
    });
    Backend {
        addr,
        gate,
        cancels,
    }
}

fn serve(conn: TcpStream, gate: &Gate, events: usize, cancels: &Sender<Instant>) {
    let mut out = conn.try_clone().expect("clone");
    let mut reader = BufReader::new(conn);
    while let Some((method, _, _)) = wire::read_request(&mut reader) {
        if method == "GET" {
            let models = br#"{"object":"list","data":[{"id":"m"}]}"#;
            if !wire::respond(&mut out, 200, "application/json", models) {
                return;
            }
            continue;
        }
        if !wire::start_stream(&mut out) {
            return;
        }
        for n in 1..=events + 1 {
            let data = if n <= events {
                event(n)
            } else {
                "data: [DONE]\n\n".to_string()
            };
            if !wait_allowed(gate, n, &out) || wire::write_chunk(&mut out, data.as_bytes()).is_err()
            {
                let _ = cancels.send(Instant::now());
                return;
            }
        }
        if out.write_all(b"0\r\n\r\n").is_err() {
            return;
        }
    }
}

/// Waits until event `n` may go; `false` when the worker closed the connection first.
fn wait_allowed(gate: &Gate, n: usize, conn: &TcpStream) -> bool {
    let mut allowed = gate.allowed.lock();
    while *allowed < n {
        // Watching the connection needs a look now and then: a closed socket wakes
        // no condition variable.
        gate.changed
            .wait_for(&mut allowed, Duration::from_millis(20));
        if closed(conn) {
            return false;
        }
    }
    true
}

/// Whether the peer closed its end (nothing else is sent on it while streaming).
fn closed(conn: &TcpStream) -> bool {
    let mut byte = [0u8; 1];
    if conn.set_nonblocking(true).is_err() {
        return true;
    }
    let closed = match conn.peek(&mut byte) {
        Ok(0) => true,
        Ok(_) => false,
        Err(e) => e.kind() != std::io::ErrorKind::WouldBlock,
    };
    let _ = conn.set_nonblocking(false);
    closed
}
