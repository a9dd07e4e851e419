//! Multiple opinions (`moe-<model>`, `MOE_ENABLED=true`) over real sockets: three fake
//! workers serving `m` see three drafts, then three critiques, then one final request
//! built from the drafts, and the client gets one ordinary chat completion from
//! `moe-m`. Each phase's requests are all collected before any is answered, which shows
//! they were submitted together.
#![cfg(feature = "moe")]

mod common;

use std::collections::BTreeSet;
use std::sync::Arc;

use common::*;
use modelrelay::protocol::{RequestMessage, ServerMessage};
use serde_json::{json, Value};

const QUESTION: &str = "What is the capital of France?";

fn moe_server() -> TestServer {
    TestServer::start_with(|c| c.moe_enabled = true)
}

fn three_workers(server: &TestServer) -> [FakeWorker; 3] {
    [0, 1, 2].map(|_| FakeWorker::connect(server.addr, &["m"], 2))
}

fn moe_body(stream: bool) -> String {
    json!({"model": "moe-m", "stream": stream, "temperature": 0.5,
           "messages": [{"role": "user", "content": QUESTION}]})
    .to_string()
}

fn ask(server: &TestServer, stream: bool) -> std::net::TcpStream {
    send_request(
        server.addr,
        "POST",
        "/v1/chat/completions",
        Some(&moe_body(stream)),
        &[("x-tenant-id", "team-a")],
    )
}

fn error_body() -> String {
    json!({"error": {"message": "backend exploded", "type": "server_error", "code": "backend_error"}})
        .to_string()
}

fn sse_delta(content: &str) -> String {
    let chunk = json!({"id": "c1", "object": "chat.completion.chunk", "model": "m",
        "choices": [{"index": 0, "delta": {"content": content}, "finish_reason": null}]});
    format!("data: {chunk}\n\n")
}

#[derive(Debug, PartialEq)]
enum Kind {
    Draft,
    Critique,
    Final,
}

/// One request a worker received: which worker, the request, its body, and what kind of
/// part it is by its prompt.
struct Seen {
    worker: usize,
    req: Arc<RequestMessage>,
    prompt: String,
    kind: Kind,
}

fn classify(worker: usize, req: Arc<RequestMessage>) -> Seen {
    let body: Value = serde_json::from_str(&req.body).expect("JSON body");
    assert_eq!(body["model"], "m", "every part asks for the plain model");
    let prompt = body["messages"]
        .as_array()
        .and_then(|m| m.last())
        .and_then(|m| m["content"].as_str())
        .unwrap_or_default()
        .to_string();
    let kind = if prompt == QUESTION {
        Kind::Draft
    } else if prompt.contains("Critique answer") {
        Kind::Critique
    } else if prompt.contains("Write the final answer") {
        Kind::Final
    } else {
        panic!("unexpected prompt {prompt:?}");
    };
    Seen {
        worker,
        req,
        prompt,
        kind,
    }
}

/// Waits until the workers together received `n` requests, answering none.
fn collect(workers: &[FakeWorker; 3], n: usize) -> Vec<Seen> {
    let refs: Vec<&FakeWorker> = workers.iter().collect();
    (0..n)
        .map(|_| {
            let (i, req) = FakeWorker::first_request(&refs);
            classify(i, req)
        })
        .collect()
}

fn reply(workers: &[FakeWorker; 3], seen: &Seen, status: u16, body: &str) {
    workers[seen.worker].complete(&seen.req.request_id, status, body);
}

/// Runs the drafts and critiques of one ensemble; returns the draft texts.
fn drafts_and_critiques(workers: &[FakeWorker; 3]) -> Vec<String> {
    let drafts = collect(workers, 3);
    assert!(drafts.iter().all(|d| d.kind == Kind::Draft));
    let on: BTreeSet<usize> = drafts.iter().map(|d| d.worker).collect();
    assert_eq!(
        on.len(),
        3,
        "the three drafts ran on three different workers"
    );
    for d in &drafts {
        assert!(!d.req.is_streaming);
        let body: Value = serde_json::from_str(&d.req.body).unwrap();
        assert_eq!(body["temperature"], 0.5, "the client's parameters");
        assert_eq!(body["stream"], false);
        assert_eq!(
            d.req.headers.get("x-tenant-id").map(String::as_str),
            Some("team-a"),
            "each part runs as the caller's tenant"
        );
    }
    let texts: Vec<String> = (0..3).map(|i| format!("Paris, says draft {i}.")).collect();
    for (d, text) in drafts.iter().zip(&texts) {
        reply(workers, d, 200, &openai_answer(text));
    }
    let critiques = collect(workers, 3);
    assert!(critiques.iter().all(|c| c.kind == Kind::Critique));
    for n in 1..=3 {
        let asked = format!("Critique answer {n}");
        let count = critiques
            .iter()
            .filter(|c| c.prompt.contains(&asked))
            .count();
        assert_eq!(count, 1, "one critique of draft {n}");
    }
    for c in &critiques {
        assert!(c.prompt.contains(QUESTION));
        for t in &texts {
            assert!(c.prompt.contains(t.as_str()), "{}", c.prompt);
        }
        reply(
            workers,
            c,
            200,
            &openai_answer("Concise and right.\nBEST: 2"),
        );
    }
    texts
}

fn assert_final_prompt(last: &Seen, texts: &[String]) {
    assert_eq!(last.kind, Kind::Final);
    for t in texts {
        assert!(last.prompt.contains(t.as_str()), "{}", last.prompt);
    }
    assert!(
        last.prompt.contains("Answer 2 (voted best):"),
        "{}",
        last.prompt
    );
    assert!(last.prompt.contains("Concise and right."));
    assert!(last.prompt.contains(QUESTION));
}

fn metric(server: &TestServer, series: &str) -> f64 {
    let text = request(server.addr, "GET", "/metrics", None, &[]).text();
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.trim().parse().ok())
        .unwrap_or(0.0)
}

#[test]
fn three_drafts_three_critiques_one_final_answer() {
    let server = moe_server();
    let workers = three_workers(&server);
    let mut client = ask(&server, false);
    let texts = drafts_and_critiques(&workers);
    let last = collect(&workers, 1).remove(0);
    assert_final_prompt(&last, &texts);
    assert!(!last.req.is_streaming);
    let body: Value = serde_json::from_str(&last.req.body).unwrap();
    assert_eq!(body["temperature"], 0.5);
    reply(&workers, &last, 200, &openai_answer("Paris."));
    let r = read_response(&mut client);
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    assert_eq!(v["model"], "moe-m");
    assert_eq!(v["choices"][0]["message"]["content"], "Paris.");
    assert!(r.header("x-request-id").is_some());
    // It counts as its seven parts.
    let ok =
        r#"modelrelay_requests_total{route="/v1/chat/completions",model="m",status_class="2xx"}"#;
    wait_until("seven parts counted", || {
        let n = metric(&server, ok);
        (n == 7.0, format!("{n} counted"))
    });
}

#[test]
fn the_final_answer_streams_when_the_client_asked() {
    let server = moe_server();
    let workers = three_workers(&server);
    let mut client = ask(&server, true);
    let texts = drafts_and_critiques(&workers);
    let last = collect(&workers, 1).remove(0);
    assert_final_prompt(&last, &texts);
    assert!(last.req.is_streaming);
    let w = &workers[last.worker];
    let id = &last.req.request_id;
    w.chunk(id, &sse_delta("Pa"));
    w.chunk(id, &sse_delta("ris."));
    w.chunk(id, "data: [DONE]\n\n");
    w.finish_stream(id);
    let r = read_response(&mut client);
    assert_eq!(r.status, 200);
    assert_eq!(r.header("content-type"), Some("text/event-stream"));
    let text = r.text();
    assert!(text.ends_with("data: [DONE]\n\n"), "{text}");
    let events: Vec<Value> = text
        .split("\n\n")
        .filter_map(|e| e.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .map(|d| serde_json::from_str(d).expect("JSON event"))
        .collect();
    assert_eq!(events.len(), 2, "{text}");
    assert!(events.iter().all(|e| e["model"] == "moe-m"), "{text}");
    let content: String = events
        .iter()
        .filter_map(|e| e["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(content, "Paris.");
}

#[test]
fn a_final_stream_broken_inside_an_event_ends_with_a_whole_error_event() {
    let server = moe_server();
    let workers = three_workers(&server);
    let mut client = ask(&server, true);
    drafts_and_critiques(&workers);
    let last = collect(&workers, 1).remove(0);
    let w = &workers[last.worker];
    let id = &last.req.request_id;
    w.chunk(id, &sse_delta("Pa"));
    // A whole line of the next event, whose blank line never comes.
    w.chunk(id, &format!("{}\n", sse_delta("ris.").trim_end()));
    w.send(
        json!({"type": "error", "request_id": id, "code": "backend_stream_failed",
                  "message": "backend stream failed: reset", "status_code": 502}),
    );
    let r = read_response(&mut client);
    assert_eq!(r.status, 200);
    let text = r.text();
    let events = common::sse::clean_events(&text);
    assert_eq!(events.len(), 2, "{text:?}");
    assert_eq!(events[0].1["model"], "moe-m", "{text:?}");
    assert_eq!(events[0].1["choices"][0]["delta"]["content"], "Pa");
    assert_eq!(events[1].1["error"]["code"], "backend_stream_failed");
}

#[test]
fn failed_drafts_and_critiques_are_left_out() {
    let server = moe_server();
    let workers = three_workers(&server);
    let mut client = ask(&server, false);
    let drafts = collect(&workers, 3);
    reply(&workers, &drafts[0], 500, &error_body());
    reply(&workers, &drafts[1], 200, &openai_answer("Paris, first."));
    reply(&workers, &drafts[2], 200, &openai_answer("Paris, second."));
    let critiques = collect(&workers, 2);
    assert!(critiques.iter().all(|c| c.kind == Kind::Critique));
    assert!(critiques
        .iter()
        .all(|c| c.prompt.contains("Below are 2 candidate answers")));
    reply(&workers, &critiques[0], 500, &error_body());
    reply(
        &workers,
        &critiques[1],
        200,
        &openai_answer("Fine.\nBEST: 1"),
    );
    let last = collect(&workers, 1).remove(0);
    assert_eq!(last.kind, Kind::Final);
    assert!(last.prompt.contains("Paris, first.") && last.prompt.contains("Paris, second."));
    assert!(last.prompt.contains("Fine."));
    assert!(!last.prompt.contains("backend exploded"));
    reply(&workers, &last, 200, &openai_answer("Paris."));
    let r = read_response(&mut client);
    assert_eq!(r.status, 200);
    assert_eq!(r.json()["choices"][0]["message"]["content"], "Paris.");
}

#[test]
fn no_draft_means_the_first_failure_reaches_the_client() {
    let server = moe_server();
    let workers = three_workers(&server);
    let mut client = ask(&server, true);
    for d in collect(&workers, 3) {
        reply(&workers, &d, 500, &error_body());
    }
    let r = read_response(&mut client);
    assert_eq!(r.status, 500, "{}", r.text());
    let v = r.json();
    assert_eq!(v["error"]["code"], "backend_error");
    assert_eq!(v["error"]["message"], "backend exploded");
    assert_eq!(v["error"]["type"], "server_error");
    assert!(r.header("x-request-id").is_some());
    let refs: Vec<&FakeWorker> = workers.iter().collect();
    for w in refs {
        assert!(
            w.recv_within(std::time::Duration::from_millis(100))
                .is_none(),
            "no critique after every draft failed"
        );
    }
}

#[test]
fn a_client_hanging_up_cancels_the_drafts() {
    let server = moe_server();
    let workers = three_workers(&server);
    let client = ask(&server, false);
    let drafts = collect(&workers, 3);
    drop(client);
    let mut cancelled = BTreeSet::new();
    for d in &drafts {
        match workers[d.worker].recv() {
            ServerMessage::Cancel { request_id, .. } => cancelled.insert(request_id),
            other => panic!("expected a cancel, got {other:?}"),
        };
    }
    let ids: BTreeSet<String> = drafts.iter().map(|d| d.req.request_id.clone()).collect();
    assert_eq!(cancelled, ids);
}

#[test]
fn when_disabled_moe_is_an_ordinary_model_name() {
    let server = TestServer::start();
    let plain = FakeWorker::connect(server.addr, &["m"], 2);
    let named = FakeWorker::connect(server.addr, &["moe-m"], 1);
    let mut client = ask(&server, false);
    let req = named.request();
    assert_eq!(req.model, "moe-m");
    assert_eq!(&*req.body, moe_body(false), "the body travels untouched");
    named.complete(&req.request_id, 200, &openai_answer("as is"));
    let r = read_response(&mut client);
    assert_eq!(r.status, 200);
    assert_eq!(r.json()["model"], "m", "the backend's answer, untouched");
    assert!(plain.recv_within(std::time::Duration::ZERO).is_none());
}

#[test]
fn when_disabled_an_unserved_moe_model_is_unknown() {
    let server = TestServer::start_with(|c| {
        c.dispatch.queue_timeout = std::time::Duration::from_millis(300);
    });
    let plain = FakeWorker::connect(server.addr, &["m"], 2);
    let mut client = ask(&server, false);
    let r = read_response(&mut client);
    let code = r.json()["error"]["code"].as_str().unwrap_or("").to_string();
    assert!(
        (r.status, code.as_str()) == (404, "model_not_found")
            || (r.status, code.as_str()) == (504, "queue_timeout"),
        "{} {}",
        r.status,
        r.text()
    );
    assert!(plain.recv_within(std::time::Duration::ZERO).is_none());
}
