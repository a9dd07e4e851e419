//! The stream watch and splice, on recorded-style streams.

use super::*;
use crate::protocol::TokenCounts;
use serde_json::json;

mod messages;

fn original() -> Arc<RequestMessage> {
    Arc::new(RequestMessage {
        request_id: "r-1".into(),
        model: "m".into(),
        endpoint_path: "/v1/chat/completions".into(),
        is_streaming: true,
        body: Arc::from(
            r#"{"model":"m","stream":true,"messages":[{"role":"user","content":"hi"}]}"#,
        ),
        headers: Default::default(),
        body_encoding: None,
        continuation: None,
        held: None,
    })
}

fn event(id: &str, delta: Value, finish: Value) -> String {
    let chunk = json!({"id": id, "created": 7, "model": "m-q4", "object": "chat.completion.chunk",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]});
    format!("data: {chunk}\n\n")
}

fn words(id: &str, words: &[&str]) -> String {
    words
        .iter()
        .map(|w| event(id, json!({"content": w}), Value::Null))
        .collect()
}

fn contents(stream: &str) -> String {
    stream
        .split("\n\n")
        .filter_map(|e| serde_json::from_str::<Value>(e.strip_prefix("data: ")?).ok())
        .filter_map(|v| {
            v["choices"][0]["delta"]["content"]
                .as_str()
                .map(String::from)
        })
        .collect()
}

#[test]
fn only_opted_in_single_choice_chat_streams_are_eligible() {
    let chat = r#"{"model":"m","stream":true,"messages":[]}"#;
    let path = "/v1/chat/completions";
    assert!(eligible(Some("true"), false, path, true, chat));
    assert!(eligible(None, true, path, true, chat));
    assert!(!eligible(Some("false"), true, path, true, chat));
    assert!(!eligible(None, false, path, true, chat));
    assert!(!eligible(Some("true"), false, path, false, chat));
    assert!(eligible(Some("true"), false, "/v1/messages", true, chat));
    assert!(!eligible(Some("true"), false, "/v1/responses", true, chat));
    for extra in [
        r#""thinking":{"type":"enabled","budget_tokens":1024}"#,
        r#""output_format":{"type":"json_schema"}"#,
    ] {
        let body = format!(r#"{{"model":"m","stream":true,"messages":[],{extra}}}"#);
        assert!(
            !eligible(Some("true"), false, "/v1/messages", true, &body),
            "{extra}"
        );
        // Chat has no such fields: its own rules apply.
        assert!(eligible(Some("true"), false, path, true, &body), "{extra}");
    }
    let off = r#"{"model":"m","stream":true,"messages":[],"thinking":{"type":"disabled"}}"#;
    assert!(eligible(Some("true"), false, "/v1/messages", true, off));
    for extra in [
        r#""n":2"#,
        r#""logprobs":true"#,
        r#""top_logprobs":3"#,
        r#""response_format":{"type":"json_object"}"#,
        r#""grammar":"root ::= x""#,
    ] {
        let body = format!(r#"{{"model":"m","stream":true,"messages":[],{extra}}}"#);
        assert!(!eligible(Some("true"), false, path, true, &body), "{extra}");
    }
    let one =
        r#"{"model":"m","n":1,"logprobs":false,"response_format":{"type":"text"},"messages":[]}"#;
    assert!(eligible(Some("true"), false, path, true, one));
}

#[test]
fn a_continuation_is_spliced_into_the_original_answer() {
    let mut t = Tracker::new(original(), true);
    let role = event(
        "a",
        json!({"role": "assistant", "content": null}),
        Value::Null,
    );
    let first = format!("{role}{}", words("a", &["Hel", "lo"]));
    // Split anywhere: complete events pass, the start of one waits.
    let (x, y) = first.split_at(first.len() - 9);
    let out = format!("{}{}", t.pass(x), t.pass(y));
    assert_eq!(out, first);
    // The worker dies inside an event: that start never goes out.
    assert_eq!(t.pass("data: {\"id\":\"a\",\"cho"), "");
    let msg = t.interrupted().expect("continuable");
    assert_eq!(msg.continuation.as_ref().unwrap().prefix, "Hello");
    assert_eq!(msg.continuation.as_ref().unwrap().tokens, 2);
    assert_eq!(msg.request_id, "r-1");
    // The other worker's answer: its own id, a role chunk, then the rest.
    let role2 = event(
        "b",
        json!({"role": "assistant", "content": ""}),
        Value::Null,
    );
    let second = format!(
        "{role2}{}{}",
        words("b", &[" wor", "ld"]),
        event("b", json!({}), json!("stop"))
    );
    let usage = json!({"id": "b", "created": 9, "model": "m-q4", "choices": [],
        "usage": {"prompt_tokens": 12, "completion_tokens": 2, "total_tokens": 14}});
    let second = format!("{second}data: {usage}\n\ndata: [DONE]\n\n");
    let out = t.pass(&second).into_owned();
    assert!(out.starts_with(MARKER), "{out}");
    assert_eq!(out.matches(": continued").count(), 1);
    assert_eq!(contents(&out), " world");
    assert!(!out.contains("\"role\""), "no second role chunk: {out}");
    assert!(
        !out.contains("\"b\"") && !out.contains("\"created\":9"),
        "{out}"
    );
    assert!(out.ends_with("data: [DONE]\n\n"));
    let usage_out: Value = out
        .split("\n\n")
        .filter_map(|e| serde_json::from_str::<Value>(e.strip_prefix("data: ")?).ok())
        .find(|v| v.get("usage").is_some())
        .unwrap();
    assert_eq!(
        usage_out["usage"],
        json!({"prompt_tokens": 10, "completion_tokens": 4, "total_tokens": 14})
    );
    let mut rc = ResponseComplete {
        token_counts: Some(TokenCounts {
            prompt_tokens: Some(12),
            completion_tokens: Some(2),
            total_tokens: Some(14),
        }),
        ..Default::default()
    };
    t.fix_usage(&mut rc);
    let counts = rc.token_counts.unwrap();
    assert_eq!(
        (counts.prompt_tokens, counts.completion_tokens),
        (Some(10), Some(4))
    );
}

#[test]
fn a_second_break_goes_on_from_everything_delivered() {
    let mut t = Tracker::new(original(), false);
    t.pass(&words("a", &["one", " two"]));
    t.interrupted().expect("first");
    let out = t.pass(&words("b", &[" three"])).into_owned();
    assert!(!out.contains(MARKER), "no marker on NDJSON routes");
    let msg = t.interrupted().expect("second");
    assert_eq!(msg.continuation.as_ref().unwrap().prefix, "one two three");
}

#[test]
fn what_cannot_be_continued_says_why() {
    let cases = [
        (
            event(
                "a",
                json!({"tool_calls": [{"index": 0, "function": {"name": "f"}}]}),
                Value::Null,
            ),
            "a tool call under way",
        ),
        (
            format!(
                "data: {}\n\n",
                json!({"choices": [{"index": 0, "delta": {"content": "a"}}, {"index": 1, "delta": {"content": "b"}}]})
            ),
            "several choices",
        ),
        ("data: [DONE]\n\n".to_string(), "the answer is complete"),
        (
            "data: {nope\n\n".to_string(),
            "an event that is not a JSON object",
        ),
    ];
    for (stream, why) in cases {
        let mut t = Tracker::new(original(), true);
        t.pass(&words("a", &["x"]));
        assert_eq!(t.pass(&stream), stream, "passes unchanged");
        assert_eq!(t.interrupted().unwrap_err(), why);
    }
    let mut big = Tracker::new(original(), true);
    let long = "y".repeat(MAX_PREFIX_BYTES / 2 + 1);
    big.pass(&words("a", &[&long, &long]));
    assert_eq!(
        big.interrupted().unwrap_err(),
        "too much text to continue from"
    );
    // An event too long to read passes as it comes, and ends the chance.
    let mut huge = Tracker::new(original(), true);
    let piece = format!("data: {}", "z".repeat(MAX_EVENT + 1));
    assert_eq!(huge.pass(&piece), piece);
    assert_eq!(huge.pass("\n\n"), "\n\n");
    assert!(huge.interrupted().is_err());
}
