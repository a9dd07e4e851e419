//! Bodies without JSON escaping (`raw_bodies`, `src/protocol/raw_bodies.rs`): a worker
//! that lists the feature gets requests as binary messages and may answer a whole
//! request the same way, on the closing and on the keep-alive path; a binary message
//! that does not read back is dropped without harm; a worker that does not list it (an
//! original one) sees only text.

mod common;

use std::io::{BufReader, Write};
use std::net::{SocketAddr, TcpStream};

use common::*;
use modelrelay::protocol::raw_bodies::{self, FEATURE_RAW_BODIES};
use modelrelay::protocol::{HeaderMap, ResponseComplete, ServerMessage};
use serde_json::{json, Value};

/// A client body with everything JSON escapes: quotes, a newline, a backslash, non-ASCII.
const BODY: &str =
    r#"{"model":"m","messages":[{"role":"user","content":"a \"quoted\" line\nand é, \\ too"}]}"#;
/// The backend's answer, likewise.
const ANSWER: &str =
    r#"{"choices":[{"message":{"role":"assistant","content":"said \"hi\"\n\\o/ ✓"}}]}"#;

fn register(features: &[&str]) -> Value {
    json!({
        "type": "register", "worker_name": "fake", "models": ["m"], "max_concurrent": 4,
        "protocol_version": "1", "current_load": 0, "features": features
    })
}

fn acked(worker: &FakeWorker) -> Vec<String> {
    match &worker.ack {
        ServerMessage::RegisterAck(ack) => ack.features.clone(),
        other => panic!("expected register_ack, got {other:?}"),
    }
}

fn binary_answer(request_id: &str) -> Vec<u8> {
    let mut headers = HeaderMap::new();
    headers.insert("content-type".into(), "application/json".into());
    let done = ResponseComplete {
        request_id: request_id.into(),
        status_code: 200,
        headers,
        body: Some(ANSWER.into()),
        token_counts: None,
    };
    raw_bodies::encode_answer(&done).expect("an answer with a body")
}

/// One chat request on a keep-alive connection (the answer is written by the worker
/// socket's reader, `relay/direct.rs`); the connection stays open for the next one.
fn keep_alive_chat(addr: SocketAddr) -> (TcpStream, std::thread::JoinHandle<Response>) {
    let mut stream = TcpStream::connect(addr).expect("connect");
    stream.set_read_timeout(Some(WAIT)).unwrap();
    let head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: localhost\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
        BODY.len()
    );
    stream.write_all(head.as_bytes()).unwrap();
    stream.write_all(BODY.as_bytes()).unwrap();
    let reading = stream.try_clone().unwrap();
    let reader = std::thread::spawn(move || read_length_framed(&mut BufReader::new(reading)));
    (stream, reader)
}

#[test]
fn a_worker_that_lists_the_feature_gets_and_gives_bodies_unescaped() {
    let server = TestServer::start();
    let worker = FakeWorker::connect_as(server.addr, register(&[FEATURE_RAW_BODIES]));
    assert!(acked(&worker).iter().any(|f| f == FEATURE_RAW_BODIES));
    let addr = server.addr;

    // The closing path: the relaying thread writes the answer.
    let client = std::thread::spawn(move || post(addr, "/v1/chat/completions", BODY));
    let req = worker.request();
    assert_eq!(worker.binary_requests(), 1, "the request came as text");
    assert_eq!(&*req.body, BODY, "the body changed on the way");
    worker.send_binary(binary_answer(&req.request_id));
    let resp = client.join().unwrap();
    assert_eq!(resp.status, 200);
    assert_eq!(resp.text(), ANSWER);

    // The keep-alive path: the worker socket's reader writes the answer.
    let (_stream, reader) = keep_alive_chat(addr);
    let req = worker.request();
    assert_eq!(worker.binary_requests(), 2);
    assert_eq!(&*req.body, BODY);
    worker.send_binary(binary_answer(&req.request_id));
    let resp = reader.join().unwrap();
    assert_eq!(resp.status, 200);
    assert_eq!(resp.text(), ANSWER);
    assert_eq!(resp.header("x-request-id"), Some(req.request_id.as_str()));
}

#[test]
fn a_binary_message_that_does_not_read_back_is_dropped_and_the_socket_stays() {
    let server = TestServer::start();
    let worker = FakeWorker::connect_as(server.addr, register(&[FEATURE_RAW_BODIES]));
    let addr = server.addr;
    let client = std::thread::spawn(move || post(addr, "/v1/chat/completions", BODY));
    let req = worker.request();
    // A length past the end, a head that is no answer, a body that is not UTF-8.
    worker.send_binary(vec![0xff, 0xff, 0xff, 0xff, b'{']);
    worker.send_binary([&[0, 0, 0, 15][..], br#"{"type":"pong"}"#].concat());
    let mut not_utf8 = binary_answer(&req.request_id);
    not_utf8.push(0xff);
    worker.send_binary(not_utf8);
    // Still registered, and the request still open: a good answer finishes it.
    worker.send_binary(binary_answer(&req.request_id));
    let resp = client.join().unwrap();
    assert_eq!(resp.status, 200);
    assert_eq!(resp.text(), ANSWER);
    assert_eq!(server.health()["workers_connected"], 1);
}

#[test]
fn a_worker_without_the_feature_sees_only_text() {
    let server = TestServer::start();
    let worker = FakeWorker::connect_as(server.addr, register(&[]));
    assert!(!acked(&worker).iter().any(|f| f == FEATURE_RAW_BODIES));
    let addr = server.addr;
    let client = std::thread::spawn(move || post(addr, "/v1/chat/completions", BODY));
    let req = worker.request();
    assert_eq!(
        worker.binary_requests(),
        0,
        "an original worker got a binary request"
    );
    assert_eq!(&*req.body, BODY);
    worker.complete(&req.request_id, 200, ANSWER);
    let resp = client.join().unwrap();
    assert_eq!(resp.status, 200);
    assert_eq!(resp.text(), ANSWER);
}
