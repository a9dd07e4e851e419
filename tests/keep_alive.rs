//! Relayed whole answers on keep-alive connections, which a worker socket's reader thread
//! writes itself (`src/server/relay/direct.rs`): ids and counts, pipelining, a client
//! that leaves, an answer larger than the socket takes at once, the idle timeout, and the
//! answers that go back to the connection thread (chunks, backend errors, a requeue that
//! runs out). The other suites' clients send `connection: close`, which keeps them on the
//! channel path.

mod common;

use std::io::{BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use common::*;
use modelrelay::protocol::ServerMessage;

fn connect(addr: SocketAddr) -> TcpStream {
    let stream = TcpStream::connect(addr).expect("connect");
    stream.set_read_timeout(Some(WAIT)).unwrap();
    stream
}

/// A keep-alive chat request as bytes.
fn chat_request(model: &str, extra: &str) -> Vec<u8> {
    let body = chat(model, false);
    format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: localhost\r\ncontent-type: application/json\r\n{extra}content-length: {}\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

/// The value of one series in `/metrics`, 0 when it is absent.
fn counted(addr: SocketAddr, series: &str) -> f64 {
    let text = request(addr, "GET", "/metrics", None, &[]).text();
    text.lines()
        .find_map(|l| l.strip_prefix(series))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0.0)
}

const OK_2XX: &str =
    r#"modelrelay_requests_total{route="/v1/chat/completions",model="m",status_class="2xx"}"#;
const CANCELLED_4XX: &str =
    r#"modelrelay_requests_total{route="/v1/chat/completions",model="m",status_class="4xx"}"#;

#[test]
fn answers_on_one_connection_carry_their_own_ids_and_are_counted() {
    let server = TestServer::start();
    let worker = FakeWorker::connect(server.addr, &["m"], 1);
    let mut client = connect(server.addr);
    let mut reader = BufReader::new(client.try_clone().unwrap());
    for i in 0..3 {
        client.write_all(&chat_request("m", "")).unwrap();
        let req = worker.request();
        worker.complete(&req.request_id, 200, &format!("answer {i}"));
        let r = read_length_framed(&mut reader);
        assert_eq!(r.status, 200);
        assert_eq!(r.text(), format!("answer {i}"));
        assert_eq!(r.header("x-request-id"), Some(req.request_id.as_str()));
        assert!(r.header("x-queue-wait-ms").is_some(), "{:?}", r.headers);
        assert!(r.header("x-gpu-time-ms").is_some(), "{:?}", r.headers);
        assert_eq!(r.header("content-type"), Some("application/json"));
        assert!(r.header("connection").is_none_or(|v| v != "close"));
    }
    wait_until("three answers counted", || {
        let n = counted(server.addr, OK_2XX);
        (n == 3.0, format!("{n} counted"))
    });
}

#[test]
fn pipelined_requests_are_answered_in_order() {
    let server = TestServer::start();
    let worker = FakeWorker::connect(server.addr, &["m"], 2);
    let mut client = connect(server.addr);
    let mut both = chat_request("m", "");
    both.extend(chat_request("m", ""));
    client.write_all(&both).unwrap();
    let first = worker.request();
    worker.complete(&first.request_id, 200, "one");
    let second = worker.request();
    worker.complete(&second.request_id, 200, "two");
    let mut reader = BufReader::new(client);
    let a = read_length_framed(&mut reader);
    let b = read_length_framed(&mut reader);
    assert_eq!((a.text(), b.text()), ("one".into(), "two".into()));
    assert_eq!(a.header("x-request-id"), Some(first.request_id.as_str()));
    assert_eq!(b.header("x-request-id"), Some(second.request_id.as_str()));
}

#[test]
fn a_client_leaving_before_its_answer_cancels_it_and_is_counted() {
    let server = TestServer::start();
    let worker = FakeWorker::connect(server.addr, &["m"], 1);
    let mut client = connect(server.addr);
    client.write_all(&chat_request("m", "")).unwrap();
    let req = worker.request();
    drop(client);
    match worker.recv() {
        ServerMessage::Cancel { request_id, reason } => {
            assert_eq!(request_id, req.request_id);
            assert_eq!(reason.as_str(), "client_disconnect");
        }
        other => panic!("expected a cancel, got {other:?}"),
    }
    wait_until("the hang-up counted as a 499", || {
        let n = counted(server.addr, CANCELLED_4XX);
        (n == 1.0, format!("{n} counted"))
    });
    // The slot is free again, and an answer for the cancelled request goes nowhere.
    worker.complete(&req.request_id, 200, "late");
    let mut client = connect(server.addr);
    client.write_all(&chat_request("m", "")).unwrap();
    let next = worker.request();
    worker.complete(&next.request_id, 200, "fresh");
    assert_eq!(
        read_length_framed(&mut BufReader::new(client)).text(),
        "fresh"
    );
}

#[test]
fn an_answer_larger_than_the_socket_takes_arrives_whole_and_the_connection_stays() {
    let server = TestServer::start();
    let worker = FakeWorker::connect(server.addr, &["m"], 1);
    let mut client = connect(server.addr);
    let mut reader = BufReader::new(client.try_clone().unwrap());
    // Far more than a fresh loopback socket's send buffer.
    let big: String = (0..8 << 20)
        .map(|i| (b'a' + (i % 26) as u8) as char)
        .collect();
    client.write_all(&chat_request("m", "")).unwrap();
    let req = worker.request();
    worker.complete(&req.request_id, 200, &big);
    let r = read_length_framed(&mut reader);
    assert_eq!(r.status, 200);
    assert!(r.body == big.as_bytes(), "the answer arrived changed");
    client.write_all(&chat_request("m", "")).unwrap();
    let req = worker.request();
    worker.complete(&req.request_id, 200, "small");
    assert_eq!(read_length_framed(&mut reader).text(), "small");
    wait_until("both answers counted", || {
        let n = counted(server.addr, OK_2XX);
        (n == 2.0, format!("{n} counted"))
    });
}

#[test]
fn the_idle_timeout_counts_from_the_answer_not_from_the_request() {
    // Long enough that the client's next request, sent at once, never races it.
    let idle = Duration::from_secs(1);
    let server = TestServer::start_with(|c| c.limits.idle_timeout = idle);
    let worker = FakeWorker::connect(server.addr, &["m"], 1);
    let mut client = connect(server.addr);
    let mut reader = BufReader::new(client.try_clone().unwrap());
    client.write_all(&chat_request("m", "")).unwrap();
    let req = worker.request();
    // The scenario, not a synchronisation: a generation that outlasts the idle time.
    std::thread::sleep(idle * 2);
    worker.complete(&req.request_id, 200, "slow");
    assert_eq!(read_length_framed(&mut reader).text(), "slow");
    client.write_all(&chat_request("m", "")).unwrap();
    let req = worker.request();
    worker.complete(&req.request_id, 200, "again");
    assert_eq!(read_length_framed(&mut reader).text(), "again");
    // Then left idle, the connection is closed by the server (not by our read timeout).
    let mut rest = Vec::new();
    assert_eq!(reader.read_to_end(&mut rest).unwrap(), 0);
}

/// The same exchange on a keep-alive connection and on a `connection: close` one gives
/// the same status and body.
fn same_as_on_a_closing_connection(exchange: impl Fn(&FakeWorker, &str)) {
    let mut seen = Vec::new();
    for extra in ["", "connection: close\r\n"] {
        let server = TestServer::start();
        let worker = FakeWorker::connect(server.addr, &["m"], 1);
        let mut client = connect(server.addr);
        client.write_all(&chat_request("m", extra)).unwrap();
        let req = worker.request();
        exchange(&worker, &req.request_id);
        let r = read_response(&mut client);
        seen.push((r.status, r.text()));
    }
    assert_eq!(seen[0], seen[1], "keep-alive, then connection: close");
}

#[test]
fn chunks_for_a_whole_answer_are_relayed_as_on_a_closing_connection() {
    same_as_on_a_closing_connection(|worker, id| {
        worker.chunk(id, "data: {\"a\":1}\n\n");
        worker.finish_stream(id);
    });
}

#[test]
fn a_backend_error_status_passes_through_as_on_a_closing_connection() {
    same_as_on_a_closing_connection(|worker, id| {
        worker.complete(id, 503, r#"{"error":"loading"}"#);
    });
}

#[test]
fn a_requeue_that_runs_out_is_answered_on_the_same_connection() {
    let server = TestServer::start();
    let mut client = connect(server.addr);
    client.write_all(&chat_request("m", "")).unwrap();
    for _ in 0..4 {
        let w = FakeWorker::connect(server.addr, &["m"], 1);
        w.request();
        w.kill();
        w.closed();
    }
    let r = read_length_framed(&mut BufReader::new(client));
    assert_eq!(r.status, 503);
    assert_eq!(r.json()["error"]["code"], "requeue_exhausted");
}

#[test]
fn a_worker_lost_before_its_answer_hands_the_request_to_the_next_one() {
    let server = TestServer::start();
    let a = FakeWorker::connect(server.addr, &["m"], 1);
    let mut client = connect(server.addr);
    client.write_all(&chat_request("m", "")).unwrap();
    let first = a.request();
    let b = FakeWorker::connect(server.addr, &["m"], 1);
    a.kill();
    let again = b.request();
    assert_eq!(again.request_id, first.request_id);
    b.complete(&again.request_id, 200, "from b");
    let mut reader = BufReader::new(client.try_clone().unwrap());
    let r = read_length_framed(&mut reader);
    assert_eq!((r.status, r.text()), (200, "from b".to_string()));
    client.write_all(&chat_request("m", "")).unwrap();
    let next = b.request();
    b.complete(&next.request_id, 200, "next");
    assert_eq!(read_length_framed(&mut reader).text(), "next");
}

#[test]
fn a_request_timeout_on_a_worker_is_answered_once_and_a_late_answer_dropped() {
    let server = TestServer::start_with(|c| c.dispatch.request_timeout = Duration::from_secs(1));
    let worker = FakeWorker::connect(server.addr, &["m"], 1);
    let mut client = connect(server.addr);
    let mut reader = BufReader::new(client.try_clone().unwrap());
    client.write_all(&chat_request("m", "")).unwrap();
    let req = worker.request();
    match worker.recv() {
        ServerMessage::Cancel { request_id, .. } => assert_eq!(request_id, req.request_id),
        other => panic!("expected the timeout's cancel, got {other:?}"),
    }
    let r = read_length_framed(&mut reader);
    assert_eq!(r.status, 504, "{}", r.text());
    // The worker answers anyway: nothing more reaches the client, whose next request
    // gets its own answer.
    worker.complete(&req.request_id, 200, "late");
    client.write_all(&chat_request("m", "")).unwrap();
    let next = worker.request();
    worker.complete(&next.request_id, 200, "next");
    let r = read_length_framed(&mut reader);
    assert_eq!(r.text(), "next");
    assert_eq!(r.header("x-request-id"), Some(next.request_id.as_str()));
}
