//! One request must not hurt everyone: limits that hold with the real server and worker
//! binaries. A body that grows when escaped, an answer that does, a drain timeout that
//! would overflow.
//!
//! `cargo test --test bounds -- --nocapture` prints the figures (worker sessions dropped).

mod common;
#[path = "../examples/support/fake_backend.rs"]
mod fake_backend;

use std::io::{BufRead, BufReader, Write};
use std::net::TcpStream;
use std::time::Instant;

use common::procs::{start_worker, Proc, ServerProc};
use common::{
    post, read_head, read_response, request, send_request, wait_until, FakeWorker, ADMIN_TOKEN,
    WAIT,
};
use fake_backend::FakeBackend;
use serde_json::json;

/// Server log lines that mark a worker session ending.
fn sessions_dropped(server: &ServerProc) -> usize {
    server
        .proc
        .log()
        .lines()
        .filter(|l| l.contains(") disconnected:") || l.contains("heartbeat timed out"))
        .count()
}

/// The relay still answers an ordinary request.
fn assert_answers(server: &ServerProc) {
    let r = post(
        server.addr,
        "/v1/chat/completions",
        &common::chat("m", false),
    );
    assert_eq!(r.status, 200, "{}", r.text());
}

fn pool(
    server: &ServerProc,
    backend: std::net::SocketAddr,
    n: usize,
    extra: &[(&str, &str)],
) -> Vec<Proc> {
    let workers = (0..n)
        .map(|_| start_worker(server.addr, backend, extra))
        .collect();
    server.wait_workers(n as u64);
    workers
}

#[test]
fn a_body_of_newlines_over_the_message_limit_once_escaped_is_413_and_no_worker_drops() {
    let server = ServerProc::start(&[]);
    let backend = FakeBackend::new("m", "ok")
        .spawn("127.0.0.1:0")
        .expect("backend");
    let _workers = pool(&server, backend, 3, &[]);
    // 32 MiB (the default MAX_REQUEST_BODY_BYTES) of valid JSON: mostly whitespace, which
    // doubles once escaped into the worker's `request` message (64 MiB, its limit).
    let head = r#"{"model":"m","messages":[{"role":"user","content":"hi"}]"#;
    let mut body = String::with_capacity(32 << 20);
    body.push_str(head);
    body.extend(std::iter::repeat_n('\n', (32 << 20) - head.len() - 1));
    body.push('}');
    // Reading, sizing and refusing 32 MiB in a debug build on a loaded CI box can take
    // longer than the usual read timeout: this one is a safety net, not a figure.
    let mut conn = send_request(
        server.addr,
        "POST",
        "/v1/chat/completions",
        Some(&body),
        &[("content-type", "application/json")],
    );
    conn.set_read_timeout(Some(WAIT * 12)).ok();
    let r = read_response(&mut conn);
    let dropped = sessions_dropped(&server);
    println!(
        "32 MiB newline body, 3 workers: status {}, worker sessions dropped: {dropped}",
        r.status
    );
    assert_eq!(r.status, 413, "{}", r.text());
    assert_eq!(
        r.json()["error"]["code"],
        "request_too_large",
        "{}",
        r.text()
    );
    assert!(r.text().contains("MAX_WS_MESSAGE_BYTES"), "{}", r.text());
    assert_eq!(dropped, 0, "server log:\n{}", server.proc.log());
    assert_eq!(server.health()["workers_connected"], 3);
    // The pool still answers.
    assert_answers(&server);
}

#[test]
fn an_answer_over_the_message_limit_once_escaped_is_502_and_the_worker_stays() {
    let limit = (4 << 20).to_string();
    let server = ServerProc::start(&[
        ("MAX_WS_MESSAGE_BYTES", &limit),
        ("MAX_REQUEST_BODY_BYTES", "1048576"),
    ]);
    let backend = FakeBackend::new("m", "ok")
        .spawn("127.0.0.1:0")
        .expect("backend");
    let _workers = pool(&server, backend, 1, &[("MAX_WS_MESSAGE_BYTES", &limit)]);
    // 1 MiB of control bytes: within what the worker reads, six times that escaped.
    let body = json!({"model": "m", "scenario": "control:1048576",
        "messages": [{"role": "user", "content": "hi"}]});
    let r = post(server.addr, "/v1/chat/completions", &body.to_string());
    assert_eq!(r.status, 502, "{}", r.text());
    assert!(r.text().contains("response_too_large"), "{}", r.text());
    assert_eq!(
        sessions_dropped(&server),
        0,
        "server log:\n{}",
        server.proc.log()
    );
    assert_eq!(server.health()["workers_connected"], 1);
}

#[test]
fn the_largest_drain_timeout_saturates_instead_of_killing_the_dispatcher() {
    let state = std::env::temp_dir().join(format!("mr-bounds-{}", std::process::id()));
    let mut server = ServerProc::start(&[
        ("MODELRELAY_ADMIN_TOKEN", ADMIN_TOKEN),
        ("STATE_DIR", &state.display().to_string()),
        ("DRAIN_TIMEOUT_SECS", &u64::MAX.to_string()),
    ]);
    let worker = FakeWorker::connect(server.addr, &["m"], 1);
    let auth = format!("Bearer {ADMIN_TOKEN}");
    let r = request(
        server.addr,
        "POST",
        &format!("/admin/workers/{}/drain", worker.worker_id),
        Some(&format!(r#"{{"drain_timeout_secs":{}}}"#, u64::MAX)),
        &[
            ("authorization", &auth),
            ("content-type", "application/json"),
        ],
    );
    assert_eq!(r.status, 202, "{}\nlog:\n{}", r.text(), server.proc.log());
    worker.closed();
    // The dispatcher still answers (a dead one could not count workers).
    assert_eq!(server.health()["workers_connected"], 0);
    // SIGTERM with DRAIN_TIMEOUT_SECS = u64::MAX: a clean drain, no panic.
    server.proc.signal("TERM");
    let status = server.proc.wait_exit();
    let log = server.proc.log();
    assert!(status.success(), "exit {status}; log:\n{log}");
    assert!(!log.contains("panicked"), "log:\n{log}");
}

#[test]
fn client_chosen_model_names_are_bounded_in_memory_metrics_and_logs() {
    // A model nobody advertises fails fast once the server is up a queue timeout.
    let server = ServerProc::start(&[("QUEUE_TIMEOUT_SECS", "1")]);
    let backend = FakeBackend::new("m", "ok")
        .spawn("127.0.0.1:0")
        .expect("backend");
    let _workers = pool(&server, backend, 1, &[]);
    let ask = |model: &str| {
        let body = json!({"model": model, "messages": [{"role": "user", "content": "hi"}]});
        post(server.addr, "/v1/chat/completions", &body.to_string())
    };
    // 40 distinct 2 MB model names: refused, and nothing of them is kept.
    let before = server.proc.rss_kb();
    for i in 0..40 {
        let r = ask(&format!("{i}-{}", "x".repeat(2 << 20)));
        assert_eq!(r.status, 400, "{}", r.text());
        assert_eq!(r.json()["error"]["code"], "invalid_model");
    }
    let after = server.proc.rss_kb();
    println!("server RSS before/after 40 model names of 2 MB: {before} kB / {after} kB");
    // Short names no worker advertises count as `other`; a newline cannot forge a line.
    for i in 0..50 {
        let r = ask(&format!("typo-{i}\nforged-line {i}"));
        assert!(matches!(r.status, 404 | 503), "{} {}", r.status, r.text());
    }
    assert_eq!(ask("m").status, 200);
    let metrics = request(server.addr, "GET", "/metrics", None, &[]).text();
    println!("/metrics: {} bytes", metrics.len());
    assert!(
        !metrics.contains("typo-") && !metrics.contains("xxxx"),
        "{metrics}"
    );
    assert!(metrics.contains("model=\"other\"") && metrics.contains("model=\"m\""));
    assert!(
        metrics.len() < 256 << 10,
        "/metrics is {} bytes",
        metrics.len()
    );
    let log = server.proc.log();
    assert!(!log.lines().any(|l| l.starts_with("forged-line")), "{log}");
    assert!(log.contains("model=typo-7\\nforged-line 7"), "{log}");
}

/// Opens a request whose body the server reserved (it said `100 Continue`) but that
/// never arrives.
fn held_body(server: &ServerProc, len: usize) -> TcpStream {
    let mut s = TcpStream::connect(server.addr).expect("connect");
    s.set_read_timeout(Some(WAIT)).ok();
    let head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: localhost\r\ncontent-length: {len}\r\n\
         expect: 100-continue\r\n\r\n"
    );
    s.write_all(head.as_bytes()).expect("head");
    let mut line = String::new();
    BufReader::new(&s)
        .read_line(&mut line)
        .expect("interim answer");
    assert!(line.starts_with("HTTP/1.1 100"), "{line}");
    s
}

#[test]
fn bodies_past_the_global_budget_get_503_at_once_and_the_budget_comes_back() {
    let server = ServerProc::start(&[
        ("MAX_REQUEST_BODY_BYTES", "1048576"),
        ("MAX_BUFFERED_BODY_BYTES", "2097152"),
        ("QUEUE_TIMEOUT_SECS", "1"),
    ]);
    let first = held_body(&server, 1 << 20);
    let _second = held_body(&server, 1 << 20);
    let r = post(
        server.addr,
        "/v1/chat/completions",
        &common::chat("m", false),
    );
    assert_eq!(r.status, 503, "{}", r.text());
    assert_eq!(
        r.json()["error"]["code"],
        "bodies_over_budget",
        "{}",
        r.text()
    );
    assert!(r.text().contains("MAX_BUFFERED_BODY_BYTES"));
    assert_eq!(r.header("retry-after"), Some("1"));
    // A client that gives up gives its share back.
    drop(first);
    wait_until("the budget to come back", || {
        let r = post(
            server.addr,
            "/v1/chat/completions",
            &common::chat("m", false),
        );
        let refused = r.text().contains("bodies_over_budget");
        (!refused, format!("{} {}", r.status, r.text()))
    });
}

#[test]
fn a_client_that_stops_reading_is_cancelled_end_to_end() {
    let server = ServerProc::start(&[("WRITE_TIMEOUT_SECS", "1")]);
    let addr = FakeBackend::new("m", "ok")
        .spawn("127.0.0.1:0")
        .expect("backend");
    let workers = pool(&server, addr, 1, &[]);
    let body = json!({"model": "m", "stream": true, "scenario": "flood",
        "messages": [{"role": "user", "content": "hi"}]});
    let stalled = send_request(
        server.addr,
        "POST",
        "/v1/chat/completions",
        Some(&body.to_string()),
        &[],
    );
    let (status, _) = read_head(&mut BufReader::new(&stalled));
    assert_eq!(status, 200);
    // The client reads nothing more; the backend keeps writing until it is cut off,
    // and the worker closes its backend connection.
    let began = Instant::now();
    workers[0].wait_line("cancelled; backend connection closed");
    let line = server.proc.wait_line("outcome=client_too_slow");
    println!(
        "stalled reader: cancelled on the worker after {:?}, server RSS {} kB",
        began.elapsed(),
        server.proc.rss_kb()
    );
    assert!(line.contains("status=200"), "{line}");
    assert_answers(&server);
    drop(stalled);
}

#[test]
fn ambiguous_framing_is_refused_over_the_socket() {
    let server = ServerProc::start(&[]);
    let send = |framing: &str| {
        let mut s = TcpStream::connect(server.addr).expect("connect");
        s.set_read_timeout(Some(WAIT)).ok();
        let raw = format!(
            "POST /v1/chat/completions HTTP/1.1\r\nhost: localhost\r\n{framing}\r\n\r\nhello"
        );
        s.write_all(raw.as_bytes()).expect("request");
        read_head(&mut BufReader::new(&s)).0
    };
    assert_eq!(send("content-length: +5"), 400);
    assert_eq!(send("content-length: 5\r\ncontent-length: 5"), 400);
    assert_eq!(send("transfer-encoding: xchunked"), 400);
    assert_eq!(send("transfer-encoding: chunked\r\ncontent-length: 5"), 400);
    assert_eq!(send("transfer-encoding: gzip, chunked"), 501);
}
