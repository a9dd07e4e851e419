//! A streamed Anthropic Messages answer (`/v1/messages`) whose worker is killed midway
//! is finished on another worker: real server, two real worker binaries (`kill -9` one
//! of them at a random event), and the fake llama-server of `continuing/`, whose answer
//! is a fixed function of the prompt and of the assistant prefill. The client, reading
//! a real socket and parsing SSE, must see one well-formed Anthropic stream whose text
//! is the uninterrupted answer's.

mod common;
mod continuing;

use std::collections::BTreeSet;
use std::io::BufReader;
use std::net::TcpStream;

use common::sse::{events, Event};
use common::*;
use continuing::{answer, points, read_rest, Rig, WORDS};
use serde_json::{json, Value};

fn body(prompt: &str, extra: Value) -> String {
    let mut body = json!({"model": "m", "stream": true, "max_tokens": 256,
        "messages": [{"role": "user", "content": prompt}]});
    if let (Value::Object(b), Value::Object(e)) = (&mut body, extra) {
        b.extend(e);
    }
    body.to_string()
}

/// Posts a streamed `/v1/messages` request; the reader after its `200` head.
fn open(rig: &Rig, body: &str, headers: &[(&str, &str)]) -> BufReader<TcpStream> {
    let client = send_request(rig.server.addr, "POST", "/v1/messages", Some(body), headers);
    let mut reader = BufReader::new(client);
    assert_eq!(read_head(&mut reader).0, 200);
    reader
}

/// The events' JSON, each checked to be named after its type (as Anthropic writes them).
fn parsed(text: &str) -> Vec<Value> {
    events(text)
        .iter()
        .map(|e: &Event| {
            let v: Value =
                serde_json::from_str(&e.data).unwrap_or_else(|_| panic!("bad event {e:?}"));
            assert_eq!(e.event.as_deref(), v["type"].as_str(), "{e:?}");
            v
        })
        .collect()
}

/// Reads the stream until `n` text deltas arrived, or until `also` is in it.
fn read_until(reader: &mut BufReader<TcpStream>, text: &mut String, n: usize, also: &str) {
    let deltas = |text: &str| text.matches("\"text_delta\"").count();
    while deltas(text) < n || !text.contains(also) {
        let piece = read_chunk(reader)
            .unwrap_or_else(|| panic!("the stream ended before {n} words: {text:?}"));
        text.push_str(&String::from_utf8_lossy(&piece));
    }
}

fn count(events: &[Value], kind: &str) -> usize {
    events.iter().filter(|v| v["type"] == kind).count()
}

/// The answer's text: every text delta, all in block 0.
fn text_of(events: &[Value]) -> String {
    let deltas: Vec<&Value> = events
        .iter()
        .filter(|v| v["type"] == "content_block_delta")
        .collect();
    assert!(deltas.iter().all(|v| v["index"] == 0), "{deltas:?}");
    deltas
        .iter()
        .filter_map(|v| v["delta"]["text"].as_str())
        .collect()
}

#[test]
fn a_killed_worker_s_messages_answer_is_finished_on_another_with_the_same_text() {
    let mut rig = Rig::start(&[]);
    let prompt = "Tell me a story about the sea.";
    let expected: String = answer(prompt).concat();
    // The uninterrupted answer through the relay is that text.
    let mut whole = String::new();
    read_rest(&mut open(&rig, &body(prompt, json!({})), &[]), &mut whole);
    assert_eq!(text_of(&parsed(&whole)), expected);
    for k in points(5) {
        let before = rig.asked();
        let opt_in = [("x-continue-on-failure", "true")];
        let mut reader = open(&rig, &body(prompt, json!({})), &opt_in);
        let mut text = String::new();
        read_until(&mut reader, &mut text, k, "");
        let killed = rig.kill_serving(before);
        read_rest(&mut reader, &mut text);
        let events = parsed(&text);
        assert_eq!(
            text_of(&events),
            expected,
            "killed after {k} words:\n{text}"
        );
        // One message: one start (the first worker's id), one text block, one end.
        for (kind, n) in [
            ("message_start", 1),
            ("content_block_start", 1),
            ("content_block_stop", 1),
            ("message_delta", 1),
            ("message_stop", 1),
        ] {
            assert_eq!(count(&events, kind), n, "{kind}:\n{text}");
        }
        assert_eq!(events.first().unwrap()["type"], "message_start");
        assert_eq!(events.last().unwrap()["type"], "message_stop", "{text}");
        let indexes: BTreeSet<String> = events
            .iter()
            .filter_map(|v| v.get("index"))
            .map(Value::to_string)
            .collect();
        assert_eq!(indexes.len(), 1, "{text}");
        assert_eq!(text.matches(": continued on another worker\n\n").count(), 1);
        // Usage counts both parts: every word of the answer as output.
        let end = events
            .iter()
            .find(|v| v["type"] == "message_delta")
            .unwrap();
        assert_eq!(end["usage"]["output_tokens"], WORDS, "{end}");
        // The other backend was asked to go on from exactly what the client had.
        rig.check_prefill_and_revive(killed, &expected);
    }
}

#[test]
fn what_cannot_be_continued_ends_with_today_s_clean_error() {
    let mut rig = Rig::start(&[("CONTINUE_ON_FAILURE", "on")]);
    let tools = json!({"tools": [{"name": "f", "input_schema": {"type": "object"}}]});
    let thinking = json!({"thinking": {"type": "enabled", "budget_tokens": 1024}});
    for (extra, header, until) in [
        // A tool use under construction.
        (tools, None, "input_json_delta"),
        (thinking, None, ""),
        (json!({}), Some("false"), ""),
    ] {
        let before = rig.asked();
        let headers: Vec<(&str, &str)> = header
            .map(|h| vec![("x-continue-on-failure", h)])
            .unwrap_or_default();
        let mut reader = open(&rig, &body("Another prompt.", extra.clone()), &headers);
        let mut text = String::new();
        read_until(&mut reader, &mut text, 2, until);
        let killed = rig.kill_serving(before);
        read_rest(&mut reader, &mut text);
        assert!(!text.contains(": continued"), "{extra}: {text}");
        let events = parsed(&text);
        assert_eq!(count(&events, "message_start"), 1, "{text}");
        let last = events.last().expect("events");
        assert_eq!(last["type"], "error", "{extra}: {text}");
        assert!(last.to_string().contains("disconnected"), "{last}");
        rig.revive(killed);
    }
}
