//! The routes beyond chat, end to end: the real server and worker binaries in front of a
//! fake box on real sockets (multipart transcription, streamed speech, images, an
//! operator's route, a 100 MB upload), and fake workers for what an original worker or
//! a worker without the route gets.

#[path = "endpoints/backend.rs"]
mod backend;
mod common;

use std::io::{BufReader, Write};
use std::net::{SocketAddr, TcpStream};

use common::procs::{start_worker, Proc, ServerProc};
use common::*;
use modelrelay::protocol::ServerMessage;
use serde_json::{json, Value};

/// A server (with `extra` settings), the fake box and one real worker for it.
fn relay(
    extra: &[(&str, &str)],
    worker_extra: &[(&str, &str)],
) -> (ServerProc, Proc, backend::Box) {
    let server = ServerProc::start(extra);
    let b = backend::start();
    let worker = start_worker(server.addr, b.addr, worker_extra);
    server.wait_workers(1);
    (server, worker, b)
}

/// Sends a request with a byte body on a fresh connection (left open to read).
fn send(addr: SocketAddr, path: &str, headers: &[(&str, &str)], body: &[u8]) -> TcpStream {
    let mut stream = TcpStream::connect(addr).expect("connect");
    stream.set_read_timeout(Some(WAIT * 6)).ok();
    let mut head = format!(
        "POST {path} HTTP/1.1\r\nhost: localhost\r\nconnection: close\r\ncontent-length: {}\r\n",
        body.len()
    );
    for (n, v) in headers {
        head.push_str(&format!("{n}: {v}\r\n"));
    }
    head.push_str("\r\n");
    stream.write_all(head.as_bytes()).expect("head");
    stream.write_all(body).expect("body");
    stream
}

fn call(addr: SocketAddr, path: &str, headers: &[(&str, &str)], body: &[u8]) -> Response {
    read_response(&mut send(addr, path, headers, body))
}

fn json_call(addr: SocketAddr, path: &str, body: &Value) -> Response {
    let text = body.to_string();
    call(
        addr,
        path,
        &[("content-type", "application/json")],
        text.as_bytes(),
    )
}

/// A multipart form: text fields, then one file part.
fn form(boundary: &str, fields: &[(&str, &str)], file: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    for (name, value) in fields {
        out.extend_from_slice(
            format!("--{boundary}\r\nContent-Disposition: form-data; name=\"{name}\"\r\n\r\n{value}\r\n")
                .as_bytes(),
        );
    }
    out.extend_from_slice(
        format!("--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a.wav\"\r\nContent-Type: audio/wav\r\n\r\n")
            .as_bytes(),
    );
    out.extend_from_slice(file);
    out.extend_from_slice(format!("\r\n--{boundary}--\r\n").as_bytes());
    out
}

#[test]
fn multipart_transcription_reaches_the_box_byte_for_byte() {
    let (server, _w, b) = relay(&[], &[]);
    let audio = backend::noise(300_000, 1);
    let boundary = "----relay-test-7f3a";
    // The file first: the model is found past a binary part.
    let mut body = form(boundary, &[], &audio);
    let tail = format!("--{boundary}\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\nwhisper\r\n--{boundary}\r\nContent-Disposition: form-data; name=\"language\"\r\n\r\nde\r\n--{boundary}--\r\n");
    body.truncate(body.len() - format!("--{boundary}--\r\n").len());
    body.extend_from_slice(tail.as_bytes());
    let content_type = format!("multipart/form-data; boundary={boundary}");
    let resp = call(
        server.addr,
        "/v1/audio/transcriptions",
        &[("content-type", &content_type)],
        &body,
    );
    assert_eq!(resp.status, 200, "{}", resp.text());
    assert_eq!(resp.json()["text"], "hello from the box");
    assert_eq!(resp.header("content-type"), Some("application/json"));
    let seen = b.seen.recv_timeout(WAIT).expect("the box saw the upload");
    assert_eq!(seen.path, "/v1/audio/transcriptions");
    assert_eq!(seen.header("content-type"), Some(content_type.as_str()));
    assert_eq!(seen.len, body.len());
    assert_eq!(seen.body, body, "the form reached the box byte for byte");
    assert!(resp.header("x-request-id").is_some());
}

#[test]
fn streamed_speech_arrives_while_it_is_generated() {
    let (server, _w, b) = relay(&[], &[]);
    let req = json!({"model": "tts", "input": "hello", "voice": "alloy"}).to_string();
    let stream = send(
        server.addr,
        "/v1/audio/speech",
        &[("content-type", "application/json")],
        req.as_bytes(),
    );
    // The relay answers when the first audio arrives: let the box make it.
    b.speech_go.send(()).expect("go");
    let mut reader = BufReader::new(stream);
    let (status, headers) = read_head(&mut reader);
    let get = |n: &str| {
        headers
            .iter()
            .find(|(k, _)| k == n)
            .map(|(_, v)| v.as_str())
    };
    assert_eq!(status, 200);
    assert_eq!(get("content-type"), Some("audio/mpeg"));
    assert_eq!(
        get("content-disposition"),
        Some("attachment; filename=\"speech.mp3\"")
    );
    assert_eq!(get("transfer-encoding"), Some("chunked"));
    let mut got = Vec::new();
    for i in 0..backend::SPEECH_CHUNKS {
        // Chunk i is all there before the box is allowed to make chunk i + 1.
        while got.len() < (i + 1) * backend::SPEECH_CHUNK {
            let chunk = read_chunk(&mut reader).expect("a chunk while the box generates");
            got.extend_from_slice(&chunk);
        }
        assert_eq!(
            got.len(),
            (i + 1) * backend::SPEECH_CHUNK,
            "no more than the box made"
        );
        if i + 1 < backend::SPEECH_CHUNKS {
            b.speech_go.send(()).expect("go");
        }
    }
    assert!(
        read_chunk(&mut reader).is_none(),
        "the stream ends after the last chunk"
    );
    let sent: Vec<u8> = (0..backend::SPEECH_CHUNKS)
        .flat_map(|i| backend::noise(backend::SPEECH_CHUNK, i as u8))
        .collect();
    assert_eq!(backend::sha256(&got), backend::sha256(&sent));
}

#[test]
fn images_in_json_base64_and_json_routes_pass_through() {
    let (server, _w, b) = relay(&[], &[]);
    let resp = json_call(
        server.addr,
        "/v1/images/generations",
        &json!({"model": "sd", "prompt": "a cat"}),
    );
    assert_eq!(resp.status, 200, "{}", resp.text());
    let b64 = resp.json()["data"][0]["b64_json"]
        .as_str()
        .expect("b64_json")
        .to_string();
    let png = modelrelay::protocol::binary::decode(&b64).expect("base64");
    assert_eq!(png, backend::noise(backend::IMAGE_BYTES, 7));
    for path in ["/v1/rerank", "/infill"] {
        let body = json!({"model": "whisper", "query": "q", "documents": ["a", "b"]});
        let resp = json_call(server.addr, path, &body);
        assert_eq!(resp.status, 200, "{path}: {}", resp.text());
        assert_eq!(resp.json()["path"], path);
    }
    let paths: Vec<String> = b.seen.try_iter().map(|s| s.path).collect();
    assert_eq!(paths, ["/v1/images/generations", "/v1/rerank", "/infill"]);
}

#[test]
fn an_operator_route_is_routed_by_x_model_and_carries_bytes() {
    let (server, _w, b) = relay(&[("EXTRA_ROUTES", "/upload, /download")], &[]);
    let bytes = backend::noise(70_000, 9);
    let resp = call(
        server.addr,
        "/upload",
        &[
            ("content-type", "application/octet-stream"),
            ("x-model", "whisper"),
        ],
        &bytes,
    );
    assert_eq!(resp.status, 200, "{}", resp.text());
    assert_eq!(resp.json()["sha256"], backend::sha256(&bytes));
    assert_eq!(b.seen.recv_timeout(WAIT).expect("seen").body, bytes);
    // An answer with a length arrives with that length.
    let resp = json_call(
        server.addr,
        "/download",
        &json!({"model": "tts", "bytes": 200_000}),
    );
    assert_eq!(resp.status, 200);
    assert_eq!(resp.header("content-length"), Some("200000"));
    assert_eq!(
        resp.header("content-type"),
        Some("application/octet-stream")
    );
    assert_eq!(resp.body.len(), 200_000);
    // A route nobody configured stays unknown.
    let resp = json_call(server.addr, "/v1/foo", &json!({"model": "tts"}));
    assert_eq!(resp.status, 404);
}

#[test]
fn a_request_naming_no_model_needs_one_or_goes_to_the_only_one() {
    let server = ServerProc::start(&[]);
    let w = FakeWorker::connect(server.addr, &["only"], 2);
    server.wait_workers(1);
    let stream = send(
        server.addr,
        "/tokenize",
        &[("content-type", "application/json")],
        br#"{"content":"hi"}"#,
    );
    let req = w.request();
    assert_eq!(req.model, "only");
    assert_eq!(
        &*req.body, r#"{"content":"hi"}"#,
        "a JSON route travels as text, unchanged"
    );
    assert_eq!(req.body_encoding, None);
    w.complete(&req.request_id, 200, r#"{"tokens":[1,2]}"#);
    let resp = read_response(&mut { stream });
    assert_eq!(resp.text(), r#"{"tokens":[1,2]}"#);
    let _two = FakeWorker::connect(server.addr, &["other"], 2);
    server.wait_workers(2);
    let resp = call(server.addr, "/tokenize", &[], br#"{"content":"hi"}"#);
    assert_eq!(resp.status, 400);
    assert_eq!(resp.json()["error"]["code"], "missing_model");
}

#[test]
fn an_original_worker_never_gets_a_binary_route() {
    let server = ServerProc::start(&[]);
    // A worker of the original protocol: no `binary_bodies` feature.
    let w = FakeWorker::connect(server.addr, &["old"], 2);
    server.wait_workers(1);
    let body = json!({"model": "old", "input": "hi"});
    let resp = json_call(server.addr, "/v1/audio/speech", &body);
    assert_eq!(resp.status, 501, "{}", resp.text());
    assert_eq!(resp.json()["error"]["code"], "binary_bodies_unsupported");
    assert!(w
        .recv_within(std::time::Duration::from_millis(300))
        .is_none_or(|m| !matches!(m, ServerMessage::Request(_))));
}

#[test]
fn a_route_no_worker_serves_is_404_at_once() {
    let server = ServerProc::start(&[]);
    let register = json!({
        "type": "register", "worker_name": "w", "models": ["m"], "max_concurrent": 2,
        "protocol_version": "1", "features": ["binary_bodies"], "routes": ["/tokenize"]
    });
    let w = FakeWorker::connect_as(server.addr, register);
    server.wait_workers(1);
    let resp = json_call(
        server.addr,
        "/v1/rerank",
        &json!({"model": "m", "query": "q"}),
    );
    assert_eq!(resp.status, 404, "{}", resp.text());
    assert_eq!(resp.json()["error"]["code"], "route_not_served");
    // The route it serves, and a binary one, reach it: base64 both ways.
    let stream = send(
        server.addr,
        "/tokenize",
        &[("content-type", "application/json")],
        br#"{"model":"m","content":"x"}"#,
    );
    let req = w.request();
    assert_eq!(req.endpoint_path, "/tokenize");
    w.complete(&req.request_id, 200, "{}");
    assert_eq!(read_response(&mut { stream }).status, 200);
    let _ = w;
}

/// Peak resident memory of a process (Linux), in MiB.
fn peak_rss_mib(p: &Proc) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{}/status", p.child.id())).ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib / 1024)
}

/// A large upload held whole (`BODY_PIECES_OVER_BYTES=0`; by default it goes in pieces,
/// `tests/pieces.rs`) through debug binaries (the release bench, `make bench-binary`,
/// sends 100 MB and reports throughput and peak memory).
#[test]
fn a_large_upload_goes_through_whole_and_one_too_large_is_refused() {
    const SIZE: usize = 32 << 20;
    let limits = [
        ("MAX_REQUEST_BODY_BYTES", "40000000"),
        ("MAX_WS_MESSAGE_BYTES", "48000000"),
        ("EXTRA_ROUTES", "/upload"),
        ("BODY_PIECES_OVER_BYTES", "0"),
    ];
    let (server, worker, b) = relay(&limits, &[("MAX_WS_MESSAGE_BYTES", "48000000")]);
    let bytes = backend::noise(SIZE, 5);
    let resp = call(server.addr, "/upload", &[("x-model", "whisper")], &bytes);
    assert_eq!(resp.status, 200, "{}", resp.text());
    assert_eq!(resp.json()["bytes"], SIZE);
    assert_eq!(resp.json()["sha256"], backend::sha256(&bytes));
    assert_eq!(b.seen.recv_timeout(WAIT).expect("seen").len, SIZE);
    eprintln!(
        "{} MiB upload: server peak RSS {:?} MiB, worker peak RSS {:?} MiB",
        SIZE >> 20,
        peak_rss_mib(&server.proc),
        peak_rss_mib(&worker)
    );
    // Within the body limit, past the message limit once encoded: refused with the
    // reason, never cut or sent.
    let big = vec![b'x'; 37_000_000];
    let resp = call(server.addr, "/upload", &[("x-model", "whisper")], &big);
    assert_eq!(resp.status, 413, "{}", resp.text());
    assert_eq!(resp.json()["error"]["code"], "request_too_large");
    assert!(b.seen.try_recv().is_err(), "nothing reached the box");
}

#[test]
fn a_worker_reports_the_routes_its_box_serves() {
    let (server, _w, b) = relay(&[], &[("ROUTES", "/v1/audio/transcriptions")]);
    let resp = json_call(
        server.addr,
        "/tokenize",
        &json!({"model": "tts", "content": "x"}),
    );
    assert_eq!(resp.status, 404, "{}", resp.text());
    assert_eq!(resp.json()["error"]["code"], "route_not_served");
    assert!(b.seen.try_recv().is_err(), "nothing reached the box");
}

/// A vLLM box: its model list says `owned_by: vllm`, and its `/openapi.json` lists the
/// routes its model supports (here tokenize and transcription, not score).
fn fake_vllm() -> SocketAddr {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("addr");
    std::thread::spawn(move || {
        for conn in listener.incoming().map_while(Result::ok) {
            std::thread::spawn(move || {
                let mut reader = BufReader::new(conn.try_clone().expect("clone"));
                let Some((method, path, _)) = read_request(&mut reader) else {
                    return;
                };
                let body = match (method.as_str(), path.as_str()) {
                    ("GET", "/v1/models") => json!({"object": "list", "data": [
                        {"id": "whisper", "object": "model", "owned_by": "vllm", "max_model_len": 448}
                    ]}),
                    ("GET", "/openapi.json") => json!({"openapi": "3.1.0", "paths": {
                        "/tokenize": {"post": {}},
                        "/v1/audio/transcriptions": {"post": {}},
                        "/v1/chat/completions": {"post": {}}
                    }}),
                    ("POST", "/tokenize") => json!({"tokens": [1, 2], "count": 2}),
                    _ => json!({"detail": "Not Found"}),
                };
                let status = if body.get("detail").is_some() {
                    404
                } else {
                    200
                };
                let text = body.to_string();
                let mut out = conn;
                let _ = write!(
                    out,
                    "HTTP/1.1 {status} X\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{text}",
                    text.len()
                );
            });
        }
    });
    addr
}

#[test]
fn a_vllm_worker_reports_the_routes_its_openapi_document_lists() {
    let server = ServerProc::start(&[]);
    let _worker = start_worker(server.addr, fake_vllm(), &[]);
    server.wait_workers(1);
    let tokens = json_call(
        server.addr,
        "/tokenize",
        &json!({"model": "whisper", "prompt": "hi"}),
    );
    assert_eq!(tokens.status, 200, "{}", tokens.text());
    assert_eq!(tokens.json()["count"], 2);
    // vLLM may serve /v1/score, but this one does not list it: refused at once.
    let score = json_call(
        server.addr,
        "/v1/score",
        &json!({"model": "whisper", "text_1": "a", "text_2": "b"}),
    );
    assert_eq!(score.status, 404, "{}", score.text());
    assert_eq!(score.json()["error"]["code"], "route_not_served");
}
