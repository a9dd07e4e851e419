//! The original ModelRelay's behaviour contract, end to end over real sockets: a
//! backend's own error answer reaches the client unchanged (through our worker binary,
//! and from a worker speaking the original protocol), and every answer carries
//! `X-Request-Id`.
//!
//! Nothing here sleeps to synchronise: each step waits for an observable state.

mod common;
#[path = "../examples/support/fake_backend.rs"]
mod fake_backend;

use std::io::Read;
use std::net::TcpStream;

use common::procs::{start_worker, ServerProc};
use common::*;
use fake_backend::FakeBackend;
use serde_json::json;

/// What the fake backend answers with `always_status(503)`.
const OVERLOADED: &str = r#"{"error":{"message":"scenario status 503","type":"backend_error"}}"#;

#[test]
fn a_backend_503_reaches_the_client_as_the_backend_sent_it() {
    // Never ejected, so every attempt reaches the backend and fails over.
    let server = ServerProc::start(&[("OUTLIER_CONSECUTIVE_FAILURES", "0")]);
    let backend = FakeBackend::new("m", "unused")
        .always_status(503)
        .spawn("127.0.0.1:0")
        .expect("backend");
    let _worker = start_worker(server.addr, backend, &[("MODELS", "m")]);
    server.wait_workers(1);
    for stream in [false, true] {
        let r = post(server.addr, "/v1/chat/completions", &chat("m", stream));
        assert_eq!(r.status, 503, "stream={stream}: {}", r.text());
        assert_eq!(r.text(), OVERLOADED, "stream={stream}");
        assert_eq!(r.header("content-type"), Some("application/json"));
        assert!(r.header("x-request-id").is_some(), "{:?}", r.headers);
    }
}

/// A worker speaking the original protocol (no `features`) answers a request with a
/// backend's 503: whole in `response_complete`, or for a stream the body as chunks and
/// then the status, as the original worker does. The client gets the backend's answer.
fn original_worker_error_reaches_the_client(stream: bool) {
    let server = TestServer::start();
    let worker = FakeWorker::connect(server.addr, &["m"], 1);
    let body = r#"{"error":{"message":"model overloaded","type":"server_error"}}"#;
    let client = std::thread::spawn({
        let addr = server.addr;
        move || post(addr, "/v1/chat/completions", &chat("m", stream))
    });
    let req = worker.request();
    assert_eq!(req.is_streaming, stream);
    let mut complete = json!({
        "type": "response_complete", "request_id": req.request_id, "status_code": 503,
        "headers": {"content-type": "application/json", "x-backend-note": "busy"},
    });
    if stream {
        let (start, rest) = body.split_at(10);
        worker.chunk(&req.request_id, start);
        worker.chunk(&req.request_id, rest);
    } else {
        complete["body"] = json!(body);
    }
    worker.send(complete);
    let r = client.join().expect("client");
    assert_eq!(r.status, 503, "{}", r.text());
    assert_eq!(r.text(), body);
    assert_eq!(r.header("content-type"), Some("application/json"));
    assert_eq!(r.header("x-backend-note"), Some("busy"));
}

#[test]
fn an_original_workers_backend_error_passes_through() {
    original_worker_error_reaches_the_client(false);
}

#[test]
fn an_original_workers_streamed_backend_error_passes_through() {
    original_worker_error_reaches_the_client(true);
}

#[test]
fn zero_timeouts_and_queue_length_mean_no_limit() {
    let server = ServerProc::start(&[
        ("REQUEST_TIMEOUT_SECS", "0"),
        ("QUEUE_TIMEOUT_SECS", "0"),
        ("MAX_QUEUE_LEN", "0"),
    ]);
    let worker = FakeWorker::connect(server.addr, &["m"], 1);
    server.wait_workers(1);
    let clients: Vec<_> = (0..3)
        .map(|_| {
            let addr = server.addr;
            std::thread::spawn(move || post(addr, "/v1/chat/completions", &chat("m", false)))
        })
        .collect();
    // One at a time on the one slot, the others queued: every one is answered.
    for _ in 0..3 {
        let req = worker.request();
        worker.complete(&req.request_id, 200, r#"{"ok":true}"#);
    }
    for client in clients {
        let r = client.join().expect("client");
        assert_eq!(r.status, 200, "{}", r.text());
    }
}

#[test]
fn every_early_answer_carries_a_request_id() {
    let server = TestServer::start();
    let cases = [
        ("GET", "/v1/chat/completions", 405),
        ("GET", "/v1/messages", 405),
        ("GET", "/api/chat", 405),
        ("PUT", "/v1/models", 405),
        ("GET", "/no/such/path", 404),
        ("POST", "/v1/chat/completions", 400),
    ];
    for (method, path, status) in cases {
        let body = (method == "POST").then_some("not json");
        let r = request(server.addr, method, path, body, &[]);
        assert_eq!(r.status, status, "{method} {path}: {}", r.text());
        let id = r.header("x-request-id");
        assert!(
            id.is_some_and(|id| id.starts_with("r-")),
            "{method} {path}: {:?}",
            r.headers
        );
    }
    // A request the HTTP reader refuses before routing.
    let mut s = TcpStream::connect(server.addr).expect("connect");
    s.set_read_timeout(Some(WAIT)).ok();
    std::io::Write::write_all(&mut s, b"GET / HTTP/1.1\r\nbad header line\r\n\r\n").expect("write");
    let r = read_response(&mut s);
    assert_eq!(r.status, 400);
    assert!(r.header("x-request-id").is_some(), "{:?}", r.headers);
}

#[test]
fn a_connection_over_the_limit_is_refused_with_a_request_id() {
    let server = TestServer::start_with(|c| c.max_connections = 1);
    let first = request(server.addr, "GET", "/health", None, &[]);
    assert_eq!(first.status, 200);
    // An idle connection holds the one slot. It may be refused itself while the first
    // connection's thread has not yet given its slot back (that answer says
    // `connection: close`): then it is opened again, until one holds the slot.
    let mut held = TcpStream::connect(server.addr).expect("connect");
    wait_until("the second connection is refused", || {
        let mut s = send_request(server.addr, "GET", "/health", None, &[]);
        let mut text = String::new();
        let _ = s.read_to_string(&mut text);
        let ok = text.starts_with("HTTP/1.1 503")
            && text.to_ascii_lowercase().contains("x-request-id: r-");
        if !ok {
            held = TcpStream::connect(server.addr).expect("connect");
        }
        (ok, text)
    });
    drop(held);
}
