//! Token counts of streams (issue 11): the real server, the real worker and a fake
//! backend that, like llama-server and vLLM, sends a usage-only chunk only when the
//! request asks for `stream_options.include_usage`. The worker asks for it on
//! OpenAI-style streams, counts it, and strips it when the client did not ask.

mod common;
#[path = "../examples/support/fake_backend.rs"]
mod fake_backend;

use common::procs::{start_worker, ServerProc};
use common::*;
use crossbeam_channel::Receiver;
use fake_backend::{FakeBackend, Observed};
use serde_json::{json, Value};

const ANSWER: &str = "one two three four five";
const ADMIN: &str = "usage-admin";

/// A server with the admin API, one fake backend and one worker.
fn relay() -> (
    ServerProc,
    common::procs::Proc,
    FakeBackend,
    Receiver<Observed>,
) {
    let server = ServerProc::start(&[("MODELRELAY_ADMIN_TOKEN", ADMIN)]);
    let (b, seen) = FakeBackend::new("m", ANSWER).observed();
    let addr = b.clone().spawn("127.0.0.1:0").expect("backend");
    let worker = start_worker(server.addr, addr, &[]);
    server.wait_workers(1);
    (server, worker, b, seen)
}

/// The body the backend received for the next request.
fn backend_body(seen: &Receiver<Observed>, path: &str) -> String {
    loop {
        match seen.recv_timeout(WAIT) {
            Ok(Observed::Request(p, body)) => {
                assert_eq!(p, path);
                return body;
            }
            Ok(_) => continue,
            Err(_) => panic!("the backend saw no request"),
        }
    }
}

/// Waits until `/admin/stats` counts `tokens` (in, out) for model `m`.
fn wait_tokens(server: &ServerProc, tokens: Value) {
    let auth = format!("Bearer {ADMIN}");
    wait_until("token counts in /admin/stats", || {
        let stats = request(
            server.addr,
            "GET",
            "/admin/stats",
            None,
            &[("authorization", &auth)],
        )
        .json();
        let got = stats["tokens_by_model"]["m"].clone();
        (
            got == tokens,
            format!("tokens_by_model {}", stats["tokens_by_model"]),
        )
    });
}

fn usage_chunks(text: &str) -> usize {
    text.matches("\"choices\":[]").count()
}

#[test]
fn a_stream_that_did_not_ask_for_usage_is_unchanged_and_still_counted() {
    let (server, _w, backend, seen) = relay();
    let body =
        json!({"model": "m", "stream": true, "messages": [{"role": "user", "content": "hi"}]})
            .to_string();
    let resp = post(server.addr, "/v1/chat/completions", &body);
    assert_eq!(resp.status, 200);
    // Exactly what the backend streams to a client that did not ask for usage.
    assert_eq!(resp.text(), backend.stream_events(false).concat());
    let sent: Value = serde_json::from_str(&backend_body(&seen, "/v1/chat/completions")).unwrap();
    assert_eq!(sent["stream_options"], json!({"include_usage": true}));
    assert_eq!(sent["messages"][0]["content"], "hi");
    wait_tokens(&server, json!({"in": 5, "out": 5}));
}

#[test]
fn a_stream_that_asked_for_usage_gets_it_once_and_its_body_untouched() {
    let (server, _w, backend, seen) = relay();
    let body = json!({"model": "m", "stream": true, "stream_options": {"include_usage": true},
        "messages": [{"role": "user", "content": "hi"}]})
    .to_string();
    let resp = post(server.addr, "/v1/chat/completions", &body);
    assert_eq!(resp.status, 200);
    let text = resp.text();
    assert_eq!(text, backend.stream_events(true).concat());
    assert_eq!(usage_chunks(&text), 1, "{text}");
    assert_eq!(backend_body(&seen, "/v1/chat/completions"), body);
    wait_tokens(&server, json!({"in": 5, "out": 5}));
}

#[test]
fn messages_streams_are_relayed_byte_for_byte() {
    let (server, _w, backend, seen) = relay();
    let body = json!({"model": "m", "stream": true, "max_tokens": 8,
        "messages": [{"role": "user", "content": "hi"}]})
    .to_string();
    let resp = request(
        server.addr,
        "POST",
        "/v1/messages",
        Some(&body),
        &[("x-api-key", "k"), ("anthropic-version", "2023-06-01")],
    );
    assert_eq!(resp.status, 200);
    assert_eq!(resp.text(), backend.stream_events(false).concat());
    assert_eq!(backend_body(&seen, "/v1/messages"), body);
}

#[test]
fn events_split_across_reads_are_filtered_exactly() {
    let (server, _w, backend, seen) = relay();
    let body = json!({"model": "m", "stream": true, "scenario": "split-events",
        "messages": [{"role": "user", "content": "hi"}]})
    .to_string();
    let resp = post(server.addr, "/v1/completions", &body);
    assert_eq!(resp.status, 200);
    let text = resp.text();
    assert_eq!(text, backend.stream_events(false).concat());
    assert_eq!(usage_chunks(&text), 0, "{text}");
    let sent: Value = serde_json::from_str(&backend_body(&seen, "/v1/completions")).unwrap();
    assert_eq!(sent["stream_options"]["include_usage"], true);
    wait_tokens(&server, json!({"in": 5, "out": 5}));
}
