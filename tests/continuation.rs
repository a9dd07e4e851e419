//! A streamed chat answer whose worker is killed midway is finished on another worker:
//! real server, two real worker binaries (`kill -9` one of them at a random event), and
//! a fake llama-server whose answer is a fixed function of the prompt and of the
//! assistant prefill it is given (`continuing/`), so a continuation can be checked
//! exactly: the client must end with the very text of the uninterrupted answer, in one
//! well-formed stream.

mod common;
mod continuing;

use std::io::BufReader;
use std::net::{SocketAddr, TcpStream};

use common::sse::events;
use common::*;
use continuing::{answer, points, read_rest, Rig, WORDS};
use serde_json::{json, Value};

fn body(prompt: &str, extra: Value) -> String {
    let mut body = json!({"model": "m", "stream": true,
        "messages": [{"role": "user", "content": prompt}]});
    if let (Value::Object(b), Value::Object(e)) = (&mut body, extra) {
        b.extend(e);
    }
    body.to_string()
}

/// Reads the stream until `n` content events arrived.
fn read_until(reader: &mut BufReader<TcpStream>, text: &mut String, n: usize) {
    while content_events(text) < n {
        let piece = read_chunk(reader)
            .unwrap_or_else(|| panic!("the stream ended before {n} words: {text:?}"));
        text.push_str(&String::from_utf8_lossy(&piece));
    }
}

fn content_events(text: &str) -> usize {
    events(text)
        .iter()
        .filter_map(|e| serde_json::from_str::<Value>(&e.data).ok())
        .filter(|v| v["choices"][0]["delta"]["content"].is_string())
        .count()
}

/// The answer's text, and its chunks' JSON (checked to be one answer).
fn content_of(text: &str) -> (String, Vec<Value>) {
    let chunks: Vec<Value> = events(text)
        .iter()
        .filter(|e| e.data != "[DONE]")
        .map(|e| serde_json::from_str(&e.data).unwrap_or_else(|_| panic!("bad event {e:?}")))
        .collect();
    let content = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect();
    (content, chunks)
}

#[test]
fn a_killed_worker_s_answer_is_finished_on_another_with_the_same_text() {
    let mut rig = Rig::start(&[]);
    let prompt = "Tell me a story about the sea.";
    let expected: String = answer(prompt).concat();
    // The uninterrupted answer through the relay is that text.
    let r = post_stream(rig.server.addr, &body(prompt, json!({})), &[]);
    assert_eq!(content_of(&r).0, expected);
    for k in points(5) {
        let before = rig.asked();
        let client = send_request(
            rig.server.addr,
            "POST",
            "/v1/chat/completions",
            Some(&body(
                prompt,
                json!({"stream_options": {"include_usage": true}}),
            )),
            &[("x-continue-on-failure", "true")],
        );
        let mut reader = BufReader::new(client);
        let (status, _) = read_head(&mut reader);
        assert_eq!(status, 200);
        let mut text = String::new();
        read_until(&mut reader, &mut text, k);
        let killed = rig.kill_serving(before);
        read_rest(&mut reader, &mut text);
        let (content, chunks) = content_of(&text);
        assert_eq!(content, expected, "killed after {k} words; stream:\n{text}");
        // One answer: one id, one `created`, one role chunk, one marker, `[DONE]` last.
        let ids: std::collections::BTreeSet<String> =
            chunks.iter().map(|c| c["id"].to_string()).collect();
        assert_eq!(ids.len(), 1, "{text}");
        let created: std::collections::BTreeSet<String> =
            chunks.iter().map(|c| c["created"].to_string()).collect();
        assert_eq!(created.len(), 1, "{text}");
        assert_eq!(text.matches("\"role\"").count(), 1, "{text}");
        assert_eq!(text.matches(": continued on another worker\n\n").count(), 1);
        assert!(text.ends_with("data: [DONE]\n\n"), "{text}");
        // Usage counts both parts: the whole answer's words as completion.
        let usage = chunks.iter().find_map(|c| c.get("usage")).expect("usage");
        assert_eq!(usage["completion_tokens"], WORDS, "{usage}");
        // The other backend was asked to go on from exactly what the client had.
        rig.check_prefill_and_revive(killed, &expected);
    }
}

#[test]
fn what_cannot_be_continued_ends_with_today_s_clean_error() {
    let mut rig = Rig::start(&[("CONTINUE_ON_FAILURE", "on")]);
    let tools = json!({"tools": [{"type": "function", "function": {"name": "f"}}]});
    for (extra, header) in [
        (tools, None),
        (json!({"n": 2}), None),
        (json!({"logprobs": true}), None),
        (json!({}), Some("false")),
    ] {
        let before = rig.asked();
        let headers: Vec<(&str, &str)> = header
            .map(|h| vec![("x-continue-on-failure", h)])
            .unwrap_or_default();
        let client = send_request(
            rig.server.addr,
            "POST",
            "/v1/chat/completions",
            Some(&body("Another prompt.", extra.clone())),
            &headers,
        );
        let mut reader = BufReader::new(client);
        assert_eq!(read_head(&mut reader).0, 200);
        let mut text = String::new();
        read_until(&mut reader, &mut text, 2);
        // With tools: until the tool call has begun.
        while extra.get("tools").is_some() && !text.contains("tool_calls") {
            let piece = read_chunk(&mut reader).expect("more events");
            text.push_str(&String::from_utf8_lossy(&piece));
        }
        let killed = rig.kill_serving(before);
        read_rest(&mut reader, &mut text);
        assert!(!text.contains(": continued"), "{extra}: {text}");
        let last = events(&text).pop().expect("events");
        assert!(last.data.contains("worker_disconnected"), "{extra}: {text}");
        rig.revive(killed);
    }
}

/// A whole streamed answer's body.
fn post_stream(addr: SocketAddr, body: &str, headers: &[(&str, &str)]) -> String {
    let client = send_request(addr, "POST", "/v1/chat/completions", Some(body), headers);
    let mut reader = BufReader::new(client);
    assert_eq!(read_head(&mut reader).0, 200);
    let mut text = String::new();
    read_rest(&mut reader, &mut text);
    text
}
