//! The worker against a hostile server: an `endpoint_path` that would leave the backend's
//! host (`@other-host/x`, `//other-host/x`, ...) is refused with a clear error, and the
//! other host never hears of it, nor of `BACKEND_API_KEY`. The real worker binary, a fake
//! server over a real WebSocket, a fake backend, and a bare listener as the other host.

mod common;
#[path = "../examples/support/fake_backend.rs"]
mod fake_backend;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener};

use common::fake_server::{FakeServer, Session};
use common::procs::start_worker;
use common::WAIT;
use crossbeam_channel::Receiver;
use fake_backend::FakeBackend;
use serde_json::{json, Value};

/// A host that records the first bytes of every connection and answers 200.
fn other_host() -> (SocketAddr, Receiver<String>) {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("addr");
    let (tx, rx) = crossbeam_channel::unbounded();
    std::thread::spawn(move || {
        for mut stream in listener.incoming().flatten() {
            let mut buf = [0u8; 4096];
            let n = stream.read(&mut buf).unwrap_or(0);
            let _ = tx.send(String::from_utf8_lossy(&buf[..n]).into_owned());
            let _ = stream.write_all(
                b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\nconnection: close\r\n\r\n{}",
            );
        }
    });
    (addr, rx)
}

fn request(s: &Session, id: &str, path: &str) {
    let body = json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]});
    s.send(json!({
        "type": "request", "request_id": id, "model": "m",
        "endpoint_path": path, "is_streaming": false, "body": body.to_string()
    }));
}

fn outcome(s: &Session, id: &str) -> Value {
    s.wait_for(&format!("outcome of {id}"), WAIT, |m| {
        m["request_id"] == id && (m["type"] == "error" || m["type"] == "response_complete")
    })
    .1
}

#[test]
fn hostile_endpoint_paths_are_refused_and_reach_no_other_host() {
    let (other, seen) = other_host();
    let backend: SocketAddr = FakeBackend::new("m", "fine")
        .spawn("127.0.0.1:0")
        .expect("backend");
    let server = FakeServer::start(&["failover"]);
    let _worker = start_worker(
        server.addr,
        backend,
        &[("MODELS", "m"), ("BACKEND_API_KEY", "backend-key-123")],
    );
    let s = server.session();
    let hostile = [
        format!("@{other}/v1/chat/completions"),
        format!("//{other}/v1/chat/completions"),
        format!("http://{other}/v1/chat/completions"),
        format!("/v1@{other}/x"),
        "/v1/chat\\completions".to_string(),
        "/v1/chat/completions\r\nX-Injected: 1".to_string(),
    ];
    for (n, path) in hostile.iter().enumerate() {
        let id = format!("bad-{n}");
        request(&s, &id, path);
        let answer = outcome(&s, &id);
        assert_eq!(answer["type"], "error", "{path:?}: {answer}");
        assert_eq!(
            answer["code"], "invalid_endpoint_path",
            "{path:?}: {answer}"
        );
        assert_eq!(answer["status_code"], 502, "{answer}");
        assert!(answer["retryable"].is_null(), "not run elsewhere: {answer}");
    }
    // A good path still reaches the backend, after every hostile one was answered.
    request(&s, "good", "/v1/chat/completions");
    let answer = outcome(&s, "good");
    assert_eq!(answer["type"], "response_complete", "{answer}");
    assert_eq!(answer["status_code"], 200, "{answer}");
    let leaked: Vec<String> = seen.try_iter().collect();
    assert!(leaked.is_empty(), "the other host was sent: {leaked:?}");
}
