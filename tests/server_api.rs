//! Client-facing HTTP behaviour of the server, with fake workers over real sockets.

mod common;

use std::io::{BufReader, Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use common::*;
use modelrelay::protocol::ServerMessage;
use serde_json::json;

#[test]
fn non_streaming_answer_is_relayed_with_status_headers_and_body() {
    let server = TestServer::start();
    let worker = FakeWorker::connect(server.addr, &["llama"], 2);
    let body =
        r#"{"model":"llama","messages":[{"role":"user","content":"hi"}],"extra":{"kept":true}}"#;
    let mut client = send_request(
        server.addr,
        "POST",
        "/v1/chat/completions",
        Some(body),
        &[
            ("content-type", "application/json"),
            ("authorization", "Bearer k"),
            ("user-agent", "ua"),
            ("x-custom", "no"),
        ],
    );
    let req = worker.request();
    assert_eq!(&*req.body, body, "body forwarded untouched");
    assert_eq!(req.endpoint_path, "/v1/chat/completions");
    assert_eq!(req.model, "llama");
    assert!(!req.is_streaming);
    assert_eq!(
        req.headers.get("authorization").map(String::as_str),
        Some("Bearer k")
    );
    assert_eq!(
        req.headers.get("content-type").map(String::as_str),
        Some("application/json")
    );
    assert!(
        !req.headers.contains_key("user-agent")
            && !req.headers.contains_key("x-custom")
            && !req.headers.contains_key("host")
    );
    worker.send(json!({
        "type": "response_complete", "request_id": req.request_id, "status_code": 200,
        "headers": {"content-type": "application/json; charset=utf-8", "x-backend": "llama-server"},
        "body": "{\"choices\":[{\"message\":{\"content\":\"héllo\"}}]}"
    }));
    let resp = read_response(&mut client);
    assert_eq!(resp.status, 200);
    assert_eq!(
        resp.header("content-type"),
        Some("application/json; charset=utf-8")
    );
    assert_eq!(resp.header("x-backend"), Some("llama-server"));
    assert_eq!(resp.header("x-request-id"), Some(req.request_id.as_str()));
    assert_eq!(
        resp.text(),
        "{\"choices\":[{\"message\":{\"content\":\"héllo\"}}]}"
    );
}

#[test]
fn backend_error_statuses_pass_through_unchanged() {
    let server = TestServer::start();
    let worker = FakeWorker::connect(server.addr, &["m"], 4);
    for (status, body) in [
        (400, r#"{"error":"bad prompt"}"#),
        (500, r#"{"error":"oom"}"#),
        (503, "busy"),
    ] {
        let mut client = open_chat(server.addr, "m", false);
        let req = worker.request();
        worker.complete(&req.request_id, status, body);
        let resp = read_response(&mut client);
        assert_eq!((resp.status, resp.text().as_str()), (status, body));
    }
}

#[test]
fn streaming_chunks_arrive_in_order_byte_for_byte_and_as_they_are_sent() {
    let server = TestServer::start();
    let worker = FakeWorker::connect(server.addr, &["m"], 1);
    let mut client = open_chat(server.addr, "m", true);
    let req = worker.request();
    assert!(req.is_streaming);
    let mut reader = BufReader::new(&mut client);
    let chunks = [
        "data: {\"a\":\"é\"}\n\n",
        "data: {\"b\":2}\n\n",
        "data: [DONE]\n\n",
    ];
    worker.chunk(&req.request_id, chunks[0]);
    // The head and first chunk arrive before the worker sends anything else.
    let (status, headers) = read_head(&mut reader);
    assert_eq!(status, 200);
    assert!(headers
        .iter()
        .any(|(n, v)| n == "content-type" && v == "text/event-stream"));
    assert_eq!(read_chunk(&mut reader).unwrap(), chunks[0].as_bytes());
    for c in &chunks[1..] {
        worker.chunk(&req.request_id, c);
        assert_eq!(read_chunk(&mut reader).unwrap(), c.as_bytes());
    }
    worker.finish_stream(&req.request_id);
    assert_eq!(read_chunk(&mut reader), None, "stream terminated");
}

#[test]
fn streaming_request_answered_with_an_error_status_gets_that_status() {
    let server = TestServer::start();
    let worker = FakeWorker::connect(server.addr, &["m"], 1);
    let mut client = open_chat(server.addr, "m", true);
    let req = worker.request();
    worker.complete(&req.request_id, 429, r#"{"error":"slots busy"}"#);
    let resp = read_response(&mut client);
    assert_eq!(resp.status, 429);
    assert_eq!(resp.text(), r#"{"error":"slots busy"}"#);
}

#[test]
fn messages_and_responses_routes_are_relayed_and_errors_follow_their_shape() {
    let server = TestServer::start();
    let worker = FakeWorker::connect(server.addr, &["claude-local"], 2);
    for path in ["/v1/messages", "/v1/responses"] {
        let body = json!({"model": "claude-local", "max_tokens": 5, "messages": []}).to_string();
        let mut client = send_request(
            server.addr,
            "POST",
            path,
            Some(&body),
            &[("x-api-key", "k"), ("anthropic-version", "2023-06-01")],
        );
        let req = worker.request();
        assert_eq!(req.endpoint_path, path);
        if path == "/v1/messages" {
            assert_eq!(req.headers.get("x-api-key").map(String::as_str), Some("k"));
            assert_eq!(
                req.headers.get("anthropic-version").map(String::as_str),
                Some("2023-06-01")
            );
        }
        worker.complete(&req.request_id, 200, r#"{"ok":true}"#);
        assert_eq!(read_response(&mut client).status, 200);
    }
    let anthropic = post(server.addr, "/v1/messages", "{broken");
    assert_eq!(anthropic.status, 400);
    let v = anthropic.json();
    assert_eq!(v["type"], "error");
    assert_eq!(v["error"]["type"], "invalid_request_error");
    let openai = post(server.addr, "/v1/responses", "{broken");
    assert_eq!(openai.json()["error"]["code"], "invalid_json");
}

#[test]
fn client_errors_have_stable_statuses_and_codes() {
    let server = TestServer::start_with(|c| c.limits.max_body_bytes = 1000);
    let cases: Vec<(Response, u16, &str)> = vec![
        (
            post(server.addr, "/v1/chat/completions", "not json"),
            400,
            "invalid_json",
        ),
        (
            post(server.addr, "/v1/chat/completions", r#"{"messages":[]}"#),
            400,
            "missing_model",
        ),
        (
            post(server.addr, "/v1/chat/completions", r#"{"model":7}"#),
            400,
            "invalid_model",
        ),
        (post(server.addr, "/v1/nope", "{}"), 404, "not_found"),
        (
            request(server.addr, "GET", "/v1/chat/completions", None, &[]),
            405,
            "method_not_allowed",
        ),
        (
            post(
                server.addr,
                "/v1/chat/completions",
                &format!(r#"{{"model":"m","x":"{}"}}"#, "a".repeat(2000)),
            ),
            413,
            "request_too_large",
        ),
    ];
    for (resp, status, code) in cases {
        assert_eq!(resp.status, status, "{}", resp.text());
        assert_eq!(resp.json()["error"]["code"], code);
    }
}

#[test]
fn models_lists_the_union_of_connected_non_draining_workers() {
    let server = TestServer::start();
    let _a = FakeWorker::connect(server.addr, &["llama", "qwen"], 1);
    let b = FakeWorker::connect(server.addr, &["qwen", "phi"], 1);
    let ids = |server: &TestServer| -> Vec<String> {
        let v = request(server.addr, "GET", "/v1/models", None, &[]).json();
        assert_eq!(v["object"], "list");
        let mut ids: Vec<String> = v["data"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| m["id"].as_str().unwrap().to_string())
            .collect();
        ids.sort();
        ids
    };
    // `/v1/models` is republished after the acks go out: wait for it, do not race it.
    wait_until("both workers' models listed", || {
        let got = ids(&server);
        (got == ["llama", "phi", "qwen"], format!("listed {got:?}"))
    });
    b.send(json!({"type": "worker_draining"}));
    wait_until("drain applied", || {
        let got = ids(&server);
        (got == ["llama", "qwen"], format!("listed {got:?}"))
    });
    let h = server.health();
    assert_eq!(h["status"], "ok");
    assert_eq!(h["workers_connected"], 2);
    assert_eq!(h["queue_depth"], 0);
    assert_eq!(h["in_flight"], 0);
    assert!(h["uptime_secs"].as_f64().is_some() && h["version"].is_string());
}

#[test]
fn queue_full_is_429_with_retry_after() {
    let server = TestServer::start_with(|c| c.dispatch.max_queue_len = 1);
    let _queued = open_chat(server.addr, "m", false);
    server.wait_health("one queued", |h| h["queue_depth"] == 1);
    let resp = post(server.addr, "/v1/chat/completions", &chat("m", false));
    assert_eq!(resp.status, 429);
    // Nothing finished yet, so the drain rate is unknown: the longest advice.
    assert_eq!(resp.header("retry-after"), Some("60"));
    let body = resp.json();
    assert_eq!(body["error"]["code"], "queue_full");
    assert_eq!(body["error"]["queueDepth"], 1);
    assert!(body["error"]["avgWaitMs"].is_u64(), "{body}");
}

#[test]
fn queue_timeout_is_504_and_request_timeout_is_504_with_a_cancel() {
    let server = TestServer::start_with(|c| {
        c.dispatch.queue_timeout = Duration::from_secs(1);
        c.dispatch.request_timeout = Duration::from_secs(1);
    });
    let resp = post(server.addr, "/v1/chat/completions", &chat("m", false));
    assert_eq!(
        (resp.status, resp.json()["error"]["code"].as_str()),
        (504, Some("queue_timeout"))
    );
    let worker = FakeWorker::connect(server.addr, &["m"], 1);
    let mut client = open_chat(server.addr, "m", false);
    let req = worker.request();
    let resp = read_response(&mut client);
    assert_eq!(
        (resp.status, resp.json()["error"]["code"].as_str()),
        (504, Some("request_timeout"))
    );
    match worker.recv() {
        ServerMessage::Cancel { request_id, reason } => {
            assert_eq!(request_id, req.request_id);
            assert_eq!(reason.as_str(), "timeout");
        }
        other => panic!("expected cancel, got {other:?}"),
    }
}

#[test]
fn request_timeout_mid_stream_ends_with_an_sse_error() {
    let server = TestServer::start_with(|c| c.dispatch.request_timeout = Duration::from_secs(1));
    let worker = FakeWorker::connect(server.addr, &["m"], 1);
    let mut client = open_chat(server.addr, "m", true);
    let req = worker.request();
    worker.chunk(&req.request_id, "data: {\"x\":1}\n\n");
    let resp = read_response(&mut client);
    assert_eq!(resp.status, 200);
    let text = resp.text();
    assert!(text.starts_with("data: {\"x\":1}\n\n"), "{text}");
    assert!(text.contains("request_timeout"), "{text}");
}

#[test]
fn unknown_model_fails_fast_once_the_server_is_older_than_the_queue_timeout() {
    let server = TestServer::start_with(|c| c.dispatch.queue_timeout = Duration::from_secs(1));
    // Young server: the typo waits in the queue and times out. Sent first thing, so the
    // server is as young as it can be (nothing else has to happen within the window).
    let resp = post(server.addr, "/v1/chat/completions", &chat("lama3", false));
    assert_eq!(resp.status, 504);
    let _w = FakeWorker::connect(server.addr, &["llama3"], 1);
    // Older than the window now (the 504 took a whole window): 404 at once, listing
    // what exists.
    let resp = post(server.addr, "/v1/chat/completions", &chat("lama3", false));
    assert_eq!(resp.status, 404);
    let v = resp.json();
    assert_eq!(v["error"]["code"], "model_not_found");
    assert!(v["error"]["message"].as_str().unwrap().contains("llama3"));
}

#[test]
fn worker_error_message_fails_the_request_with_502_and_keeps_the_worker() {
    let server = TestServer::start();
    let worker = FakeWorker::connect(server.addr, &["m"], 1);
    let mut client = open_chat(server.addr, "m", false);
    let req = worker.request();
    worker.send(json!({"type": "error", "request_id": req.request_id, "code": "backend_unreachable", "message": "connection refused"}));
    let resp = read_response(&mut client);
    assert_eq!(resp.status, 502);
    assert_eq!(resp.json()["error"]["code"], "backend_unreachable");
    // Same worker serves the next request.
    let mut client = open_chat(server.addr, "m", false);
    let req = worker.request();
    worker.complete(&req.request_id, 200, "{}");
    assert_eq!(read_response(&mut client).status, 200);
}

#[test]
fn keep_alive_expect_continue_and_chunked_request_bodies() {
    let server = TestServer::start();
    let worker = FakeWorker::connect(server.addr, &["m"], 1);
    let answer = std::thread::spawn(move || {
        for _ in 0..3 {
            let req = worker.request();
            let body = req.body.to_string();
            worker.complete(&req.request_id, 200, &body);
        }
        worker
    });
    let mut stream = TcpStream::connect(server.addr).unwrap();
    stream.set_read_timeout(Some(WAIT)).unwrap();
    let mut reader = BufReader::new(stream.try_clone().unwrap());
    // 1: plain keep-alive request.
    let body = chat("m", false);
    write!(
        stream,
        "POST /v1/chat/completions HTTP/1.1\r\nhost: localhost\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let (status, headers) = read_head(&mut reader);
    assert_eq!(status, 200);
    let len: usize = headers
        .iter()
        .find(|(n, _)| n == "content-length")
        .unwrap()
        .1
        .parse()
        .unwrap();
    let mut got = vec![0; len];
    reader.read_exact(&mut got).unwrap();
    assert_eq!(got, body.as_bytes());
    // 2: Expect: 100-continue on the same connection.
    write!(stream, "POST /v1/chat/completions HTTP/1.1\r\nhost: localhost\r\nexpect: 100-continue\r\ncontent-length: {}\r\n\r\n", body.len()).unwrap();
    let (status, _) = read_head(&mut reader);
    assert_eq!(status, 100);
    stream.write_all(body.as_bytes()).unwrap();
    let (status, _) = read_head(&mut reader);
    assert_eq!(status, 200);
    let mut got = vec![0; len];
    reader.read_exact(&mut got).unwrap();
    // 3: chunked request body.
    let (a, b) = body.split_at(10);
    write!(stream, "POST /v1/chat/completions HTTP/1.1\r\nhost: localhost\r\ntransfer-encoding: chunked\r\n\r\n{:x}\r\n{a}\r\n{:x}\r\n{b}\r\n0\r\n\r\n", a.len(), b.len()).unwrap();
    let (status, _) = read_head(&mut reader);
    assert_eq!(status, 200);
    let mut got = vec![0; len];
    reader.read_exact(&mut got).unwrap();
    assert_eq!(got, body.as_bytes());
    answer.join().unwrap();
}

#[test]
fn oversized_headers_and_garbage_requests_get_clean_errors() {
    let server = TestServer::start();
    let huge = "x".repeat(70 * 1024);
    let resp = request(server.addr, "GET", "/health", None, &[("x-big", &huge)]);
    assert_eq!(resp.status, 431);
    let mut s = TcpStream::connect(server.addr).unwrap();
    s.set_read_timeout(Some(WAIT)).unwrap();
    s.write_all(b"\x16\x03\x01 garbage not http\r\n\r\n")
        .unwrap();
    let resp = read_response(&mut s);
    assert_eq!(resp.status, 400);
    // The server is still fine.
    assert_eq!(server.health()["status"], "ok");
}

#[test]
fn an_idle_connection_does_not_block_anyone() {
    let server = TestServer::start();
    let _idle = TcpStream::connect(server.addr).unwrap();
    let _half = {
        let mut s = TcpStream::connect(server.addr).unwrap();
        s.write_all(b"POST /v1/chat/completions HTTP/1.1\r\ncontent-length: 100\r\n\r\n{")
            .unwrap();
        s
    };
    assert_eq!(server.health()["status"], "ok");
}

/// A build without the dashboard (`make static FEATURES=minimal`) says so on its paths
/// rather than answering a bare 404 (runs in builds without the `dashboard` feature).
#[cfg(not(feature = "dashboard"))]
#[test]
fn dashboard_left_out_of_the_build_says_so() {
    let server = TestServer::start();
    for path in ["/dashboard", "/setup", "/dashboard/events"] {
        let r = request(server.addr, "GET", path, None, &[]);
        assert_eq!(r.status, 404, "{path}");
        assert_eq!(r.json()["error"]["code"], "dashboard_not_built", "{path}");
    }
}
