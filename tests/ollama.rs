//! Ollama's API on the relay over real sockets: requests are translated to the OpenAI
//! request a worker forwards (seen by a fake worker), answers come back in Ollama's
//! shape (NDJSON streams, `{"error": ...}`), and the listing routes answer from the
//! registry.

mod common;

use std::io::BufReader;
use std::time::Duration;

use common::*;
use serde_json::{json, Value};

fn ollama_post(addr: std::net::SocketAddr, path: &str, body: &Value) -> std::net::TcpStream {
    send_request(
        addr,
        "POST",
        path,
        Some(&body.to_string()),
        &[("content-type", "application/json")],
    )
}

fn sse_delta(content: &str) -> String {
    let chunk = json!({"id": "c1", "object": "chat.completion.chunk", "model": "m",
        "choices": [{"index": 0, "delta": {"content": content}, "finish_reason": null}]});
    format!("data: {chunk}\n\n")
}

#[test]
fn chat_is_translated_both_ways_without_streaming() {
    let server = TestServer::start();
    let worker = FakeWorker::connect(server.addr, &["m"], 1);
    let body = json!({"model": "m", "stream": false, "options": {"num_predict": 5, "temperature": 0},
                      "messages": [{"role": "user", "content": "hi"}]});
    let mut client = ollama_post(server.addr, "/api/chat", &body);
    let req = worker.request();
    assert_eq!(req.endpoint_path, "/v1/chat/completions");
    let sent: Value = serde_json::from_str(&req.body).expect("json");
    assert_eq!(sent["max_tokens"], 5);
    assert_eq!(sent["messages"][0]["content"], "hi");
    worker.complete(&req.request_id, 200, &openai_answer("hello there"));
    let r = read_response(&mut client);
    assert_eq!(r.status, 200);
    let v = r.json();
    assert_eq!(v["message"]["content"], "hello there");
    assert_eq!(v["done"], true);
    assert_eq!(v["prompt_eval_count"], 7);
    assert_eq!(v["eval_count"], 3);
    assert!(v["total_duration"].as_u64().unwrap_or(0) > 0, "{v}");
}

#[test]
fn chat_streams_ndjson_by_default_and_ends_with_done() {
    let server = TestServer::start();
    let worker = FakeWorker::connect(server.addr, &["m"], 1);
    let body = json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]});
    let mut client = ollama_post(server.addr, "/api/chat", &body);
    let req = worker.request();
    assert!(req.is_streaming, "stream defaults to true");
    worker.chunk(&req.request_id, &sse_delta("Hel"));
    worker.chunk(&req.request_id, &sse_delta("lo"));
    worker.chunk(&req.request_id, "data: [DONE]\n\n");
    worker.finish_stream(&req.request_id);
    let r = read_response(&mut client);
    assert_eq!(r.status, 200);
    assert_eq!(r.header("content-type"), Some("application/x-ndjson"));
    let lines: Vec<Value> = r
        .text()
        .lines()
        .map(|l| serde_json::from_str(l).expect("one JSON object per line"))
        .collect();
    let text: String = lines
        .iter()
        .filter_map(|l| l["message"]["content"].as_str())
        .collect();
    assert_eq!(text, "Hello");
    let last = lines.last().cloned().unwrap_or(Value::Null);
    assert_eq!(last["done"], true, "{lines:?}");
    assert!(last["done_reason"].is_string(), "{last}");
    assert_eq!(lines.iter().filter(|l| l["done"] == true).count(), 1);
}

#[test]
fn generate_and_embed_reach_the_openai_routes() {
    let server = TestServer::start();
    let worker = FakeWorker::connect(server.addr, &["m"], 1);
    let mut client = ollama_post(
        server.addr,
        "/api/generate",
        &json!({"model": "m", "prompt": "why?", "stream": false}),
    );
    let req = worker.request();
    assert_eq!(req.endpoint_path, "/v1/chat/completions");
    worker.complete(&req.request_id, 200, &openai_answer("because"));
    let v = read_response(&mut client).json();
    assert_eq!(v["response"], "because");
    let mut client = ollama_post(
        server.addr,
        "/api/embed",
        &json!({"model": "m", "input": ["a", "b"]}),
    );
    let req = worker.request();
    assert_eq!(req.endpoint_path, "/v1/embeddings");
    let emb = json!({"object": "list", "model": "m", "usage": {"prompt_tokens": 2, "total_tokens": 2},
        "data": [{"object": "embedding", "index": 0, "embedding": [0.1, 0.2]},
                 {"object": "embedding", "index": 1, "embedding": [0.3, 0.4]}]});
    worker.complete(&req.request_id, 200, &emb.to_string());
    let v = read_response(&mut client).json();
    assert_eq!(v["embeddings"], json!([[0.1, 0.2], [0.3, 0.4]]));
}

#[test]
fn errors_are_ollama_shaped() {
    let server = TestServer::start_with(|c| c.dispatch.queue_timeout = Duration::from_millis(200));
    let worker = FakeWorker::connect(server.addr, &["m"], 1);
    let r = request(server.addr, "POST", "/api/chat", Some("{nope"), &[]);
    assert_eq!(r.status, 400);
    assert!(r.json()["error"].is_string(), "{}", r.text());
    server.wait_health("past the queue timeout", |h| {
        h["uptime_secs"].as_f64().unwrap_or(0.0) > 0.3
    });
    let body = json!({"model": "nope", "messages": [{"role": "user", "content": "x"}]}).to_string();
    let r = request(server.addr, "POST", "/api/chat", Some(&body), &[]);
    assert_eq!(r.status, 404);
    let msg = r.json()["error"].as_str().unwrap_or("").to_string();
    assert!(msg.contains("model \"nope\" not found"), "{msg}");
    // A backend error status comes back as {"error": ...} with that status.
    // An empty chat is a load request: answered by the relay, no backend call.
    let r = request(
        server.addr,
        "POST",
        "/api/chat",
        Some(&json!({"model": "m", "messages": []}).to_string()),
        &[],
    );
    assert_eq!(r.status, 200);
    assert_eq!(r.json()["done"], true, "{}", r.text());
    let mut client = ollama_post(
        server.addr,
        "/api/chat",
        &json!({"model": "m", "stream": false, "messages": [{"role": "user", "content": "x"}]}),
    );
    let req = worker.request();
    let err = json!({"error": {"message": "context too long", "type": "invalid_request_error"}});
    worker.complete(&req.request_id, 400, &err.to_string());
    let r = read_response(&mut client);
    assert_eq!(r.status, 400);
    assert_eq!(r.json(), json!({"error": "context too long"}));
}

#[test]
fn closing_an_ndjson_stream_cancels_the_request() {
    let server = TestServer::start();
    let worker = FakeWorker::connect(server.addr, &["m"], 1);
    let body = json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]});
    let mut client = ollama_post(server.addr, "/api/chat", &body);
    let req = worker.request();
    worker.chunk(&req.request_id, &sse_delta("one"));
    let mut reader = BufReader::new(&mut client);
    let (status, _) = read_head(&mut reader);
    assert_eq!(status, 200);
    assert!(read_chunk(&mut reader).is_some());
    drop(reader);
    drop(client);
    match worker.recv() {
        modelrelay::protocol::ServerMessage::Cancel { request_id, .. } => {
            assert_eq!(request_id, req.request_id)
        }
        other => panic!("expected a cancel, got {other:?}"),
    }
}

#[test]
fn listing_routes_answer_from_the_registry() {
    let server = TestServer::start();
    let worker = FakeWorker::connect(server.addr, &["a", "b"], 1);
    worker.send(
        json!({"type": "models_update", "models": ["a", "b"], "current_load": 0,
                       "loaded_models": ["b"]}),
    );
    let r = request(server.addr, "GET", "/", None, &[]);
    assert_eq!((r.status, r.text()), (200, "Ollama is running".to_string()));
    assert_eq!(request(server.addr, "HEAD", "/", None, &[]).status, 200);
    let v = request(server.addr, "GET", "/api/version", None, &[]).json();
    assert!(v["version"].is_string());
    let names = |path: &str| -> Vec<String> {
        request(server.addr, "GET", path, None, &[]).json()["models"]
            .as_array()
            .map(|a| {
                a.iter()
                    .filter_map(|m| m["name"].as_str().map(String::from))
                    .collect()
            })
            .unwrap_or_default()
    };
    server.wait_health("models published", |_| names("/api/tags") == vec!["a", "b"]);
    server.wait_health("loaded set published", |_| names("/api/ps") == vec!["b"]);
    let r = request(
        server.addr,
        "POST",
        "/api/show",
        Some(&json!({"model": "a"}).to_string()),
        &[],
    );
    assert_eq!(r.status, 200);
    assert!(r.json()["capabilities"].is_array());
    let r = request(
        server.addr,
        "POST",
        "/api/show",
        Some(&json!({"model": "zzz"}).to_string()),
        &[],
    );
    assert_eq!(r.status, 404);
    assert!(r.json()["error"].is_string());
}
