//! Resumable streams end to end: a real server and worker in front of a backend that
//! lets its events out one at a time ([`backend`]). A client drops its connection at
//! random events and resumes with `Last-Event-ID`; no event may be lost or repeated.
//! A stream nobody resumes is cancelled at the backend after the grace period; the
//! caps refuse; another key cannot resume.
//!
//! Nothing sleeps to synchronise: the backend's events are released as the test reads,
//! and where the test needs the relay to have noticed a drop it waits for that log line.

#[path = "resume/backend.rs"]
mod backend;
#[path = "resume/client.rs"]
mod client;
mod common;

use std::time::{Duration, Instant};

use client::{word, Client, Rng};
use common::procs::{start_worker, Proc, ServerProc};
use common::*;
use serde_json::{json, Value};

const EVENTS: usize = 40;
const HELD: &str = "stream held for a resume";

fn relay(backend: &backend::Backend, env: &[(&str, &str)]) -> (ServerProc, Proc) {
    let server = ServerProc::start(env);
    let worker = start_worker(server.addr, backend.addr, &[]);
    server.wait_workers(1);
    (server, worker)
}

/// Starts a resumable chat with `n` events let out, reads them and drops the connection;
/// returns the resume URL.
fn read_then_drop(
    server: &ServerProc,
    backend: &backend::Backend,
    n: usize,
    headers: &[(&str, &str)],
) -> String {
    backend.gate.allow(n);
    let mut client = Client::chat(server.addr, headers);
    assert_eq!(client.status, 200);
    for _ in 0..n {
        client.next_event().expect("an event");
    }
    let url = client
        .header("x-resume-url")
        .expect("resume url")
        .to_string();
    client.drop_connection();
    url
}

#[test]
fn a_stream_dropped_ten_times_reaches_the_client_whole_and_once() {
    let backend = backend::start(EVENTS);
    let (server, _worker) = relay(&backend, &[]);
    let mut rng = Rng::seeded();
    for stream in 0..3 {
        backend.gate.reset();
        // Ten drops at distinct random events.
        let mut drops: Vec<usize> = Vec::new();
        while drops.len() < 10 {
            let at = 1 + rng.below(EVENTS);
            if !drops.contains(&at) {
                drops.push(at);
            }
        }
        // The head goes out with the first event.
        backend.gate.allow(3);
        let mut client = Client::chat(server.addr, &[]);
        assert_eq!(client.status, 200);
        assert_eq!(client.header("x-resumable"), Some("event-id"));
        let url = client
            .header("x-resume-url")
            .expect("resume url")
            .to_string();
        let id = client
            .header("x-request-id")
            .expect("request id")
            .to_string();
        assert!(
            url.starts_with(&format!("/v1/streams/{id}?resume_token=")),
            "{url}"
        );
        let (mut words, mut last, mut seen) = (Vec::new(), 0, 0);
        loop {
            // The backend runs a little ahead of the client: events are in flight
            // when the connection drops.
            backend.gate.allow(seen + 3);
            let got = client
                .next_event()
                .unwrap_or_else(|| panic!("stream {stream}: body ended before [DONE]"));
            assert_eq!(
                got.id,
                last + 1,
                "stream {stream}: ids in order, none skipped"
            );
            last = got.id;
            seen += 1;
            if got.data == "[DONE]" {
                break;
            }
            if let Some(w) = word(&got.data) {
                words.push(w);
            }
            if drops.contains(&seen) {
                client.drop_connection();
                backend.gate.allow(seen + 1 + rng.below(6));
                client = Client::resume(server.addr, &url, last, &[]);
                assert_eq!(client.status, 200, "stream {stream}: resumed after {last}");
                assert_eq!(client.header("x-request-id"), Some(id.as_str()));
            }
        }
        assert!(client.next_event().is_none(), "the body ends after [DONE]");
        let expected: Vec<String> = (1..=EVENTS).map(|n| format!("w{n} ")).collect();
        assert_eq!(
            words, expected,
            "stream {stream}: every word once, in order"
        );
        // An EventSource reconnects after the end: told to stop (204).
        let again = Client::resume(server.addr, &url, last, &[]);
        assert_eq!(again.status, 204);
    }
}

#[test]
fn an_ndjson_stream_resumes_by_line_number() {
    let backend = backend::start(EVENTS);
    let (server, _worker) = relay(&backend, &[]);
    let body = json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).to_string();
    let headers = [
        ("x-resumable", "true"),
        ("content-type", "application/json"),
    ];
    backend.gate.allow(5);
    let mut client = Client::open(server.addr, "POST", "/api/chat", Some(&body), &headers);
    assert_eq!(client.status, 200);
    assert_eq!(client.header("x-resumable"), Some("line-number"));
    let url = client
        .header("x-resume-url")
        .expect("resume url")
        .to_string();
    let mut lines = Vec::new();
    for _ in 0..3 {
        lines.push(client.next_line().expect("a line"));
    }
    client.drop_connection();
    backend.gate.allow(EVENTS + 1);
    let mut client = Client::open(
        server.addr,
        "GET",
        &format!("{url}&last_event_id=3"),
        None,
        &[],
    );
    assert_eq!(client.status, 200);
    while let Some(line) = client.next_line() {
        lines.push(line);
    }
    let words: String = lines
        .iter()
        .map(|l| {
            let v: Value = serde_json::from_str(l).expect("each line is JSON");
            v["message"]["content"]
                .as_str()
                .unwrap_or_default()
                .to_string()
        })
        .collect();
    let expected: String = (1..=EVENTS).map(|n| format!("w{n} ")).collect();
    assert_eq!(words, expected);
    assert!(lines.last().is_some_and(|l| l.contains("\"done\":true")));
}

#[test]
fn a_stream_nobody_resumes_is_cancelled_at_the_backend_after_the_grace_period() {
    let backend = backend::start(EVENTS);
    let grace = Duration::from_secs(2);
    let (server, _worker) = relay(&backend, &[("RESUME_GRACE_SECS", "2")]);
    let dropped = Instant::now();
    let url = read_then_drop(&server, &backend, 3, &[]);
    let cancelled = backend
        .cancels
        .recv_timeout(grace + WAIT)
        .expect("the backend sees the cancel");
    assert!(
        cancelled.duration_since(dropped) >= grace,
        "cancelled {:?} after the drop, before the grace period",
        cancelled.duration_since(dropped)
    );
    server.proc.wait_line("outcome=client_disconnect");
    let late = Client::resume(server.addr, &url, 3, &[]);
    assert_eq!(late.status, 404);
    assert_eq!(late.json()["error"]["code"], "stream_expired");
}

/// A stream that outgrows `cap` while nobody reads it is given up and cancelled.
fn assert_cap_refuses(cap: (&str, &str)) {
    let backend = backend::start(EVENTS);
    let (server, _worker) = relay(&backend, &[cap]);
    let url = read_then_drop(&server, &backend, 2, &[]);
    server.proc.wait_line(HELD);
    backend.gate.allow(EVENTS);
    backend
        .cancels
        .recv_timeout(WAIT)
        .unwrap_or_else(|_| panic!("{}: the stream is cancelled at the backend", cap.0));
    let refused = Client::resume(server.addr, &url, 2, &[]);
    assert_eq!(refused.status, 409, "{}", cap.0);
    assert_eq!(refused.json()["error"]["code"], "resume_buffer_full");
}

#[test]
fn past_the_stream_cap_resuming_is_refused_and_the_stream_cancelled() {
    assert_cap_refuses(("RESUME_BUFFER_BYTES", "3000"));
}

#[test]
fn past_the_total_cap_resuming_is_refused_and_the_stream_cancelled() {
    assert_cap_refuses(("RESUME_TOTAL_BYTES", "3000"));
}

#[test]
fn only_the_key_that_started_a_stream_may_resume_it() {
    let state = std::env::temp_dir().join(format!("resume-keys-{}", std::process::id()));
    let state_dir = state.display().to_string();
    let backend = backend::start(EVENTS);
    let env = [
        ("MODELRELAY_REQUIRE_API_KEYS", "true"),
        ("MODELRELAY_ADMIN_TOKEN", ADMIN_TOKEN),
        ("STATE_DIR", state_dir.as_str()),
    ];
    let (server, _worker) = relay(&backend, &env);
    let key = |name: &str| {
        let r = admin_call(
            server.addr,
            ADMIN_TOKEN,
            "POST",
            "/admin/keys",
            Some(json!({"name": name})),
        );
        assert_eq!(r.status, 201, "{}", r.text());
        format!("Bearer {}", r.json()["key"].as_str().expect("key"))
    };
    let (mine, theirs) = (key("mine"), key("theirs"));
    let url = read_then_drop(&server, &backend, 2, &[("authorization", &mine)]);
    server.proc.wait_line(HELD);
    let other = Client::resume(server.addr, &url, 2, &[("authorization", &theirs)]);
    assert_eq!(other.status, 404);
    assert_eq!(other.json()["error"]["code"], "stream_not_found");
    let anonymous = Client::resume(server.addr, &url, 2, &[]);
    assert_eq!(anonymous.status, 401);
    let (path, _) = url.split_once('?').expect("a token");
    let untokened = Client::resume(server.addr, path, 2, &[("authorization", &mine)]);
    assert_eq!(
        untokened.status, 404,
        "the right key without the resume token"
    );
    let mut client = Client::resume(server.addr, &url, 2, &[("authorization", &mine)]);
    assert_eq!(client.status, 200);
    backend.gate.allow(EVENTS + 1);
    let mut ids = Vec::new();
    while let Some(got) = client.next_event() {
        ids.push(got.id);
    }
    let expected: Vec<u64> = (3..=EVENTS as u64 + 1).collect();
    assert_eq!(ids, expected);
    let _ = std::fs::remove_dir_all(&state);
}
