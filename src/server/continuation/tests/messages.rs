//! The watch and splice of Anthropic Messages streams (`/v1/messages`), on streams
//! shaped like llama-server's.

use super::*;

fn original() -> Arc<RequestMessage> {
    Arc::new(RequestMessage {
        request_id: "r-1".into(),
        model: "m".into(),
        endpoint_path: MESSAGES_ROUTE.into(),
        is_streaming: true,
        body: Arc::from(
            r#"{"model":"m","stream":true,"max_tokens":64,"messages":[{"role":"user","content":"hi"}]}"#,
        ),
        headers: Default::default(),
        body_encoding: None,
        continuation: None,
        held: None,
    })
}

fn ev(data: Value) -> String {
    format!(
        "event: {}\ndata: {data}\n\n",
        data["type"].as_str().unwrap()
    )
}

fn start(id: &str, input: u64) -> String {
    ev(
        json!({"type": "message_start", "message": {"id": id, "type": "message",
        "role": "assistant", "content": [], "model": "m", "stop_reason": null,
        "usage": {"input_tokens": input, "output_tokens": 0}}}),
    )
}

fn block(index: u64, block: Value) -> String {
    ev(json!({"type": "content_block_start", "index": index, "content_block": block}))
}

fn text_block(index: u64) -> String {
    block(index, json!({"type": "text", "text": ""}))
}

fn texts(index: u64, words: &[&str]) -> String {
    words
        .iter()
        .map(|w| {
            ev(json!({"type": "content_block_delta", "index": index,
                "delta": {"type": "text_delta", "text": w}}))
        })
        .collect()
}

fn stop(index: u64) -> String {
    ev(json!({"type": "content_block_stop", "index": index}))
}

fn end(output: u64) -> String {
    let delta = ev(json!({"type": "message_delta",
        "delta": {"stop_reason": "end_turn", "stop_sequence": null},
        "usage": {"output_tokens": output}}));
    format!("{delta}{}", ev(json!({"type": "message_stop"})))
}

/// The stream's events as JSON (the `event:` name checked against the data's type).
fn parsed(stream: &str) -> Vec<Value> {
    stream
        .split("\n\n")
        .filter(|e| !e.is_empty() && !e.starts_with(':'))
        .map(|e| {
            let (name, data) = e.split_once('\n').unwrap();
            let v: Value = serde_json::from_str(data.strip_prefix("data: ").unwrap()).unwrap();
            assert_eq!(name.strip_prefix("event: "), v["type"].as_str(), "{e}");
            v
        })
        .collect()
}

/// The text of block `index`, and the indexes the stream's blocks started with.
fn text_of(events: &[Value], index: u64) -> (String, Vec<u64>) {
    let text = events
        .iter()
        .filter(|v| v["type"] == "content_block_delta" && v["index"] == index)
        .filter_map(|v| v["delta"]["text"].as_str())
        .collect();
    let starts = events
        .iter()
        .filter(|v| v["type"] == "content_block_start")
        .filter_map(|v| v["index"].as_u64())
        .collect();
    (text, starts)
}

/// The first part of an answer: its start and a text block with `words`.
fn first(words: &[&str]) -> String {
    format!("{}{}{}", start("a", 9), text_block(0), texts(0, words))
}

/// A tracker whose answer broke after [`first`]`(words)`, its continuation asked for.
fn broken_after(words: &[&str], marker: bool) -> Tracker {
    let mut t = Tracker::new(original(), marker);
    t.pass(&first(words));
    t.interrupted().expect("continuable");
    t
}

#[test]
fn a_continuation_goes_on_in_the_same_text_block() {
    let mut t = Tracker::new(original(), true);
    let first = first(&["The", " sea"]);
    let (x, y) = first.split_at(first.len() - 7);
    assert_eq!(format!("{}{}", t.pass(x), t.pass(y)), first);
    // The worker dies inside an event: that start never goes out.
    assert_eq!(t.pass("event: content_block_delta\ndata: {\"ty"), "");
    let msg = t.interrupted().expect("continuable");
    let c = msg.continuation.as_ref().unwrap();
    assert_eq!((c.prefix.as_str(), c.tokens), ("The sea", 2));
    // The other worker's stream: its own message and blocks from index 0.
    let second = format!(
        "{}{}{}{}{}",
        start("msg_b", 11),
        text_block(0),
        texts(0, &[" is", " blue"]),
        stop(0),
        end(2)
    );
    let out = t.pass(&second).into_owned();
    assert!(out.starts_with(MARKER), "{out}");
    assert_eq!(out.matches(": continued").count(), 1);
    let events = parsed(&out);
    assert!(
        !out.contains("message_start") && !out.contains("msg_b"),
        "{out}"
    );
    assert_eq!(text_of(&events, 0), (" is blue".to_string(), vec![]));
    let kinds: Vec<&str> = events.iter().filter_map(|v| v["type"].as_str()).collect();
    assert_eq!(
        kinds,
        [
            "content_block_delta",
            "content_block_delta",
            "content_block_stop",
            "message_delta",
            "message_stop"
        ]
    );
    // Usage counts both parts: two tokens before, two after.
    assert_eq!(events[3]["usage"], json!({"output_tokens": 4}));
    let mut rc = ResponseComplete {
        token_counts: Some(TokenCounts {
            prompt_tokens: None,
            completion_tokens: Some(2),
            total_tokens: None,
        }),
        ..Default::default()
    };
    t.fix_usage(&mut rc);
    assert_eq!(rc.token_counts.unwrap().completion_tokens, Some(4));
}

#[test]
fn a_second_break_goes_on_from_all_the_text_and_input_usage_moves_too() {
    let mut t = broken_after(&["one"], true);
    // This backend puts its text in the block start, and input usage in the delta.
    let second = format!(
        "{}{}{}",
        start("b", 10),
        block(0, json!({"type": "text", "text": " two"})),
        texts(0, &[" three"])
    );
    let out = t.pass(&second).into_owned();
    assert_eq!(text_of(&parsed(&out), 0).0, " two three");
    let msg = t.interrupted().expect("second");
    let c = msg.continuation.as_ref().unwrap();
    assert_eq!((c.prefix.as_str(), c.tokens), ("one two three", 3));
    let delta = ev(
        json!({"type": "message_delta", "delta": {"stop_reason": "end_turn"},
        "usage": {"input_tokens": 12, "output_tokens": 1}}),
    );
    let third = format!(
        "{}{}{}{}",
        start("c", 12),
        text_block(0),
        texts(0, &["!"]),
        delta
    );
    let out = t.pass(&third).into_owned();
    let events = parsed(&out);
    assert_eq!(out.matches(": continued").count(), 1, "{out}");
    // A synthetic stop closes the text block before the message ends.
    let kinds: Vec<&str> = events.iter().filter_map(|v| v["type"].as_str()).collect();
    assert_eq!(
        kinds,
        ["content_block_delta", "content_block_stop", "message_delta"]
    );
    assert_eq!(
        events[2]["usage"],
        json!({"input_tokens": 9, "output_tokens": 4})
    );
}

#[test]
fn later_blocks_take_the_client_s_next_index_and_thinking_is_dropped() {
    let mut t = broken_after(&["Hi"], false);
    let thinking = format!(
        "{}{}{}",
        block(0, json!({"type": "thinking", "thinking": ""})),
        ev(json!({"type": "content_block_delta", "index": 0,
            "delta": {"type": "thinking_delta", "thinking": "hmm"}})),
        stop(0)
    );
    let tool = format!(
        "{}{}{}",
        block(
            2,
            json!({"type": "tool_use", "id": "t", "name": "f", "input": {}})
        ),
        ev(json!({"type": "content_block_delta", "index": 2,
            "delta": {"type": "input_json_delta", "partial_json": "{}"}})),
        stop(2)
    );
    let second = format!(
        "{}{thinking}{}{}{}{tool}{}",
        start("b", 10),
        text_block(1),
        texts(1, &[" there"]),
        stop(1),
        end(3)
    );
    let out = t.pass(&second).into_owned();
    assert!(!out.contains("thinking"), "{out}");
    let events = parsed(&out);
    let (text, starts) = text_of(&events, 0);
    assert_eq!((text.as_str(), starts), (" there", vec![1]));
    let indexes: Vec<u64> = events.iter().filter_map(|v| v["index"].as_u64()).collect();
    assert_eq!(indexes, [0, 0, 1, 1, 1]);
    // A continuation that begins with a tool use stops the open text block first.
    let mut t = broken_after(&["Hi"], false);
    let out = t
        .pass(&format!(
            "{}{}",
            start("b", 10),
            tool.replace("\"index\":2", "\"index\":0")
        ))
        .into_owned();
    let kinds: Vec<(String, u64)> = parsed(&out)
        .iter()
        .map(|v| {
            (
                v["type"].as_str().unwrap().into(),
                v["index"].as_u64().unwrap(),
            )
        })
        .collect();
    let expected = [
        ("content_block_stop", 0),
        ("content_block_start", 1),
        ("content_block_delta", 1),
        ("content_block_stop", 1),
    ];
    assert_eq!(kinds, expected.map(|(k, i)| (k.to_string(), i)));
}

#[test]
fn a_break_before_any_text_block_restarts_the_answer_whole() {
    let mut t = Tracker::new(original(), true);
    t.pass(&start("a", 9));
    let msg = t.interrupted().expect("continuable");
    assert_eq!(msg.continuation.as_ref().unwrap().prefix, "");
    let out = t
        .pass(&format!(
            "{}{}{}",
            start("b", 9),
            text_block(0),
            texts(0, &["Hi"])
        ))
        .into_owned();
    let (text, starts) = text_of(&parsed(&out), 0);
    assert_eq!((text.as_str(), starts), ("Hi", vec![0]));
    assert_eq!(out.matches("message_start").count(), 0);
}

#[test]
fn what_cannot_be_continued_says_why() {
    let tool = block(
        1,
        json!({"type": "tool_use", "id": "t", "name": "f", "input": {}}),
    );
    let cases = [
        (format!("{}{tool}", stop(0)), "the text block ended"),
        (
            tool.replace("\"index\":1", "\"index\":0"),
            "a tool call under way",
        ),
        (
            block(1, json!({"type": "redacted_thinking", "data": ""})),
            "thinking",
        ),
        (
            block(1, json!({"type": "web_search_tool_result", "content": []})),
            "a content block that is not text",
        ),
        (end(3), "the answer is complete"),
        (
            ev(json!({"type": "error", "error": {"type": "overloaded_error"}})),
            "the backend reported an error",
        ),
        (
            ev(json!({"type": "content_block_delta", "index": 0,
                "delta": {"type": "citations_delta", "citation": {}}})),
            "a delta that is not the open block's text",
        ),
    ];
    for (stream, why) in cases {
        let mut t = Tracker::new(original(), true);
        t.pass(&first(&["x"]));
        assert_eq!(t.pass(&stream), stream, "passes unchanged");
        assert_eq!(t.interrupted().unwrap_err(), why, "{stream}");
    }
    // Thinking first (a model that thinks unasked): never continuable.
    let mut t = Tracker::new(original(), true);
    let thinking = block(0, json!({"type": "thinking", "thinking": ""}));
    t.pass(&format!("{}{thinking}", start("a", 9)));
    assert_eq!(t.interrupted().unwrap_err(), "thinking");
    let mut t = Tracker::new(original(), true);
    t.pass(&format!("{}{}", start("a", 9), text_block(0)));
    t.pass("data: [DONE]\n\n");
    assert_eq!(t.interrupted().unwrap_err(), "the answer is complete");
}
