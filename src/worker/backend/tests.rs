//! Unit tests of `backend`.

use super::*;
use crate::worker::stream_usage::MAX_HELD_EVENT;

#[test]
fn split_multibyte_characters_are_carried_to_the_next_piece() {
    let text = "héllo 🌍!";
    let bytes = text.as_bytes();
    let mut carry = Utf8Carry::default();
    let mut out = String::new();
    for b in bytes {
        out.push_str(&carry.push(std::slice::from_ref(b)));
    }
    out.push_str(&carry.finish());
    assert_eq!(out, text);
    let mut carry = Utf8Carry::default();
    assert_eq!(carry.push(&[b'a', 0xF0, 0x9F]), "a");
    assert_eq!(carry.push(&[0x8C, 0x8D, b'b']), "🌍b");
    assert_eq!(carry.push(&[0xFF, b'c']), "\u{FFFD}c");
}

#[test]
fn usage_is_found_in_openai_and_anthropic_shapes() {
    let openai = r#"{"usage":{"prompt_tokens":3,"completion_tokens":4,"total_tokens":7}}"#;
    assert_eq!(usage_from_json(openai).unwrap().total_tokens, Some(7));
    let anthropic =
        r#"{"type":"message_start","message":{"usage":{"input_tokens":5,"output_tokens":1}}}"#;
    let c = usage_from_json(anthropic).unwrap();
    assert_eq!(
        (c.prompt_tokens, c.completion_tokens, c.total_tokens),
        (Some(5), Some(1), Some(6))
    );
    assert!(usage_from_json(r#"{"choices":[]}"#).is_none());
}

#[test]
fn usage_scanner_handles_lines_split_across_chunks() {
    let mut s = UsageScanner::default();
    s.scan("data: {\"choices\":[]}\n\ndata: {\"usage\":{\"prompt_");
    assert!(s.counts.is_none());
    s.scan("tokens\":2,\"completion_tokens\":3}}\n\ndata: [DONE]\n\n");
    assert_eq!(s.counts.unwrap().total_tokens, Some(5));
}

#[test]
fn usage_is_requested_only_for_openai_streams_that_did_not_ask() {
    let plain = r#"{"model":"m","stream":true,"messages":[]}"#;
    let v: serde_json::Value =
        serde_json::from_str(&with_usage_requested("/v1/chat/completions", plain).unwrap())
            .unwrap();
    assert_eq!(
        v["stream_options"],
        serde_json::json!({"include_usage": true})
    );
    assert_eq!(v["model"], "m");
    let merged = r#"{"stream":true,"stream_options":{"continuous_usage_stats":false,"include_usage":false}}"#;
    let v: serde_json::Value =
        serde_json::from_str(&with_usage_requested("/v1/completions", merged).unwrap()).unwrap();
    assert_eq!(
        v["stream_options"],
        serde_json::json!({"continuous_usage_stats": false, "include_usage": true})
    );
    // Left alone: already asked (any spelling), not streaming, other endpoints,
    // not a JSON object.
    for (path, body) in [
        (
            "/v1/chat/completions",
            r#"{"stream":true,"stream_options":{"include_usage":true}}"#,
        ),
        (
            "/v1/chat/completions",
            r#"{"stream":true,"stream_options":{ "include_usage" : true }}"#,
        ),
        ("/v1/chat/completions", r#"{"stream":false}"#),
        ("/v1/chat/completions", r#"{"messages":[]}"#),
        (
            "/v1/chat/completions",
            r#"{"stream":true,"stream_options":"x"}"#,
        ),
        ("/v1/chat/completions", "not json"),
        ("/v1/messages", r#"{"stream":true}"#),
        ("/v1/responses", r#"{"stream":true}"#),
        ("/v1/embeddings", r#"{"stream":true}"#),
    ] {
        assert_eq!(with_usage_requested(path, body), None, "{path} {body}");
    }
    assert!(with_usage_requested("/v1/chat/completions?x=1", r#"{"stream":true}"#).is_some());
}

const EVENT: &str = "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"hi\"}}]}\n\n";
const USAGE: &str = "data: {\"id\":\"x\",\"choices\":[],\"usage\":{\"prompt_tokens\":2,\"completion_tokens\":3,\"total_tokens\":5}}\n\n";
const DONE: &str = "data: [DONE]\n\n";

fn filtered(pieces: &[&str]) -> String {
    let mut f = UsageEventFilter::default();
    let mut out: String = pieces.iter().map(|p| f.push(p)).collect();
    out.push_str(&f.finish());
    out
}

#[test]
fn the_usage_event_is_stripped_and_everything_else_kept() {
    let stream = format!("{EVENT}{EVENT}{USAGE}{DONE}");
    let want = format!("{EVENT}{EVENT}{DONE}");
    assert_eq!(filtered(&[&stream]), want);
    // Cut at every byte position, and byte by byte.
    for cut in 1..stream.len() {
        assert_eq!(
            filtered(&[&stream[..cut], &stream[cut..]]),
            want,
            "cut {cut}"
        );
    }
    let bytes: Vec<String> = stream.chars().map(String::from).collect();
    let pieces: Vec<&str> = bytes.iter().map(String::as_str).collect();
    assert_eq!(filtered(&pieces), want);
    // CRLF event ends, and a usage chunk that still has choices is kept.
    let crlf = USAGE.replace("\n\n", "\r\n\r\n");
    assert_eq!(filtered(&[&crlf, DONE]), DONE);
    let final_with_choices =
        "data: {\"choices\":[{\"index\":0}],\"usage\":{\"prompt_tokens\":1}}\n\n";
    assert_eq!(filtered(&[final_with_choices]), final_with_choices);
    // A stream that ends without a blank line keeps its last bytes.
    assert_eq!(
        filtered(&[EVENT, "data: [DONE]"]),
        format!("{EVENT}data: [DONE]")
    );
}

#[test]
fn only_the_pending_event_is_held_back() {
    let mut f = UsageEventFilter::default();
    let half = EVENT.len() / 2;
    assert_eq!(f.push(&format!("{EVENT}{}", &EVENT[..half])), EVENT);
    assert_eq!(f.push(&EVENT[half..]), EVENT);
    // A long event is forwarded as it comes, up to its end across reads.
    let long = format!("data: {}", "x".repeat(MAX_HELD_EVENT + 10));
    assert_eq!(f.push(&long), long);
    assert_eq!(f.push("yy\n"), "yy\n");
    assert_eq!(f.push(&format!("\n{}", &USAGE[..10])), "\n");
    assert_eq!(f.push(&format!("{}{DONE}", &USAGE[10..])), DONE);
    assert_eq!(f.finish(), "");
}

#[test]
fn only_failures_without_an_answer_count_as_connection_failures() {
    use std::io::{Error, ErrorKind};
    for kind in [
        ErrorKind::ConnectionRefused,
        ErrorKind::ConnectionReset,
        ErrorKind::UnexpectedEof,
    ] {
        assert!(is_connection_failure(&ureq::Error::Io(Error::from(kind))));
    }
    assert!(is_connection_failure(&ureq::Error::Timeout(
        ureq::Timeout::Connect
    )));
    assert!(is_connection_failure(&ureq::Error::ConnectionFailed));
    assert!(!is_connection_failure(&ureq::Error::Io(Error::from(
        ErrorKind::InvalidData
    ))));
    assert!(!is_connection_failure(&ureq::Error::Timeout(
        ureq::Timeout::RecvBody
    )));
    assert!(!is_connection_failure(&ureq::Error::StatusCode(500)));
}

#[test]
fn a_503_answer_is_kept_whole_unless_too_large() {
    let answer = r#"{"error":{"message":"model overloaded"}}"#;
    let headers: HeaderMap = [("content-type".to_string(), "application/json".to_string())].into();
    let outcome = unavailable(
        503,
        headers.clone(),
        answer.as_bytes(),
        1024,
        &Handle::default(),
    );
    let expected = Outcome::Unavailable {
        status: 503,
        headers,
        body: Some(answer.to_string()),
    };
    assert_eq!(outcome, expected);
    let outcome = unavailable(
        503,
        HeaderMap::new(),
        answer.as_bytes(),
        8,
        &Handle::default(),
    );
    assert!(
        matches!(outcome, Outcome::Unavailable { body: None, .. }),
        "{outcome:?}"
    );
}

#[test]
fn model_lists_parse() {
    assert_eq!(
        parse_model_list(r#"{"data":[{"id":"a"},{"id":"b"}]}"#).unwrap(),
        vec!["a", "b"]
    );
    assert!(parse_model_list("[]").is_err());
}

#[test]
fn ollama_native_counts_are_read_from_whole_bodies_and_ndjson_streams() {
    let body = r#"{"model":"m","message":{"role":"assistant","content":"hi"},"done":true,"prompt_eval_count":26,"eval_count":298}"#;
    let c = usage_from_json(body).expect("counts");
    assert_eq!(
        (c.prompt_tokens, c.completion_tokens, c.total_tokens),
        (Some(26), Some(298), Some(324))
    );
    // A cached prompt leaves `prompt_eval_count` out.
    let c = usage_from_json(r#"{"done":true,"eval_count":5}"#).expect("counts");
    assert_eq!((c.prompt_tokens, c.completion_tokens), (Some(0), Some(5)));
    let mut scanner = UsageScanner::default();
    scanner.scan("{\"message\":{\"content\":\"a\"},\"done\":false}\n{\"done\":true,\"prompt_e");
    assert!(scanner.counts.is_none());
    scanner.scan("val_count\":7,\"eval_count\":3}\n");
    let c = scanner.counts.expect("counts from the final line");
    assert_eq!((c.prompt_tokens, c.completion_tokens), (Some(7), Some(3)));
    assert!(usage_from_json(r#"{"done":true}"#).is_none());
}

#[test]
fn odd_usage_fields_count_as_absent_without_losing_the_rest() {
    // A float count is no count; the other fields still are.
    let c = usage_from_json(r#"{"usage":{"prompt_tokens":1.5,"completion_tokens":2}}"#)
        .expect("counts");
    assert_eq!(
        (c.prompt_tokens, c.completion_tokens, c.total_tokens),
        (None, Some(2), None)
    );
    // A usage that is not an object is no usage, and no reason to look elsewhere.
    assert!(usage_from_json(r#"{"usage":"n/a","eval_count":3,"x_tokens":1}"#).is_none());
    // A `message` that is text (an error shape) does not hide Ollama's counts.
    let c = usage_from_json(r#"{"message":"hi","eval_count":3}"#).expect("counts");
    assert_eq!(c.completion_tokens, Some(3));
    // Anthropic's stream start nests its usage in `message`, beside long text.
    let c = usage_from_json(
        r#"{"type":"message_start","message":{"content":[{"text":"a\"b"}],"usage":{"input_tokens":4,"output_tokens":1}}}"#,
    )
    .expect("counts");
    assert_eq!(c.total_tokens, Some(5));
    assert!(usage_from_json(r#"[{"usage":{"total_tokens":1}}]"#).is_none());
}
