//! Unit tests of `trim`: the refusal parsers on recorded bodies, the trimming rules, and
//! the retries of one request.

use std::sync::Arc;

use serde_json::{json, Value};

use super::attempts::wanted;
use super::*;
use crate::protocol::{HeaderMap, RequestMessage};

/// What llama-server (b6xxx, `-np 4 -c 4096`) answered for a 16,159-byte chat body.
const LLAMA_REFUSAL: &str = r#"{"error":{"code":400,"message":"request (3155 tokens) exceeds the available context size (1024 tokens), try increasing it","type":"exceed_context_size_error","n_prompt_tokens":3155,"n_ctx":1024}}"#;
/// Older llama-server builds: the same refusal without numbers.
const LLAMA_OLD_REFUSAL: &str = r#"{"error":{"code":400,"message":"the request exceeds the available context size, try increasing it","type":"invalid_request_error"}}"#;
const VLLM_REQUESTED: &str = r#"{"object":"error","message":"This model's maximum context length is 16384 tokens. However, you requested 122946 tokens (112946 in the messages, 10000 in the completion). Please reduce the length of the messages or completion.","type":"BadRequestError","param":null,"code":400}"#;
const VLLM_INPUT: &str = r#"{"error":{"message":"This model's maximum context length is 1536 tokens. However, your request has 4176 input tokens. Please reduce the length of the input messages.","type":"BadRequestError","param":null,"code":400}}"#;
const VLLM_MAX_TOKENS: &str = r#"{"error":{"message":"'max_tokens' or 'max_completion_tokens' is too large: 8000. This model's maximum context length is 4096 tokens and your request has 2778 input tokens (8000 > 4096 - 2778). None","type":"BadRequestError","param":null,"code":400}}"#;

fn refusal(n_ctx: Option<u64>, n_prompt_tokens: Option<u64>) -> Option<Refusal> {
    Some(Refusal {
        n_ctx,
        n_prompt_tokens,
    })
}

#[test]
fn llama_server_refusals_are_recognised_with_their_numbers() {
    assert_eq!(
        parse_refusal(400, LLAMA_REFUSAL),
        refusal(Some(1024), Some(3155))
    );
    assert_eq!(parse_refusal(400, LLAMA_OLD_REFUSAL), refusal(None, None));
    // The numbers are read from the message when the fields are missing.
    let message_only = r#"{"error":{"message":"request (600 tokens) exceeds the available context size (512 tokens), try increasing it"}}"#;
    assert_eq!(
        parse_refusal(400, message_only),
        refusal(Some(512), Some(600))
    );
    // Plain text, not JSON.
    assert_eq!(
        parse_refusal(
            400,
            "request (9 tokens) exceeds the available context size (8 tokens)"
        ),
        refusal(Some(8), Some(9))
    );
}

#[test]
fn vllm_refusals_are_recognised_in_each_wording() {
    assert_eq!(
        parse_refusal(400, VLLM_REQUESTED),
        refusal(Some(16384), Some(112946))
    );
    assert_eq!(
        parse_refusal(400, VLLM_INPUT),
        refusal(Some(1536), Some(4176))
    );
    assert_eq!(
        parse_refusal(400, VLLM_MAX_TOKENS),
        refusal(Some(4096), Some(2778))
    );
    let bare = r#"{"message":"This model's maximum context length is 2048 tokens. However, you requested 3000 tokens."}"#;
    assert_eq!(parse_refusal(400, bare), refusal(Some(2048), Some(3000)));
}

#[test]
fn other_errors_are_not_refusals() {
    assert_eq!(parse_refusal(500, LLAMA_REFUSAL), None);
    assert_eq!(parse_refusal(413, VLLM_INPUT), None);
    let other =
        r#"{"error":{"code":400,"message":"Invalid tool call","type":"invalid_request_error"}}"#;
    assert_eq!(parse_refusal(400, other), None);
    assert_eq!(parse_refusal(400, ""), None);
    assert_eq!(parse_refusal(400, "not json at all"), None);
}

#[test]
fn chat_paths_only() {
    assert!(is_chat_path("/v1/chat/completions"));
    assert!(is_chat_path("/v1/chat/completions?x=1"));
    assert!(is_chat_path("/v1/messages"));
    assert!(!is_chat_path("/v1/completions"));
    assert!(!is_chat_path("/v1/embeddings"));
    assert!(!is_chat_path("/v1/responses"));
}

#[test]
fn the_answer_gets_max_tokens_at_most_half_the_context_else_a_quarter() {
    assert_eq!(answer_room(&json!({"max_tokens": 100}), 1024), 100);
    assert_eq!(answer_room(&json!({"max_completion_tokens": 50}), 1024), 50);
    assert_eq!(answer_room(&json!({"max_tokens": 5000}), 1024), 512);
    assert_eq!(answer_room(&json!({}), 1024), 256);
    let b = Budget::for_context(&json!({"max_tokens": 24}), 1024, 0.25);
    assert_eq!(b.target_tokens, 1000.0);
    assert_eq!(
        calibrate(3155, 16159).map(|r| (r * 1000.0).round()),
        Some(195.0)
    );
    assert_eq!(calibrate(0, 100), None);
    assert_eq!(calibrate(10, 0), None);
}

/// A conversation like a chat client's: a system prompt, `turns` user/assistant pairs of
/// `words` words each, and a final user question.
fn conversation(turns: usize, words: usize) -> Value {
    let text = |i: usize| format!("turn {i}: {}", "lorem ipsum ".repeat(words / 2));
    let mut messages = vec![json!({"role": "system", "content": "You are terse."})];
    for i in 0..turns {
        messages.push(json!({"role": "user", "content": text(i)}));
        messages.push(json!({"role": "assistant", "content": text(i)}));
    }
    messages.push(json!({"role": "user", "content": "And the last question?"}));
    json!({"model": "m", "max_tokens": 16, "messages": messages})
}

fn roles(body: &Value) -> Vec<&str> {
    body["messages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["role"].as_str().unwrap())
        .collect()
}

fn estimate(body: &Value, per_byte: f64) -> f64 {
    serde_json::to_vec(body).unwrap().len() as f64 * per_byte
}

#[test]
fn oldest_messages_go_first_system_and_last_stay() {
    let mut body = conversation(10, 100);
    let per_byte = 0.25;
    let before = estimate(&body, per_byte);
    let budget = Budget {
        target_tokens: before / 3.0,
        tokens_per_byte: per_byte,
    };
    let done = trim(&mut body, &budget, false);
    assert!(done.dropped > 0 && !done.tools_dropped, "{done:?}");
    assert_eq!(done.dropped % 2, 0, "whole turns go: {done:?}");
    assert!(estimate(&body, per_byte) <= budget.target_tokens);
    let messages = body["messages"].as_array().unwrap();
    assert_eq!(messages.len(), 22 - done.dropped);
    assert_eq!(messages[0]["role"], "system");
    assert_eq!(messages[1]["role"], "user");
    assert_eq!(
        messages.last().unwrap()["content"],
        "And the last question?"
    );
    // The newest turns are the ones left.
    let kept = 10 - done.dropped / 2;
    assert!(messages[1]["content"]
        .as_str()
        .unwrap()
        .starts_with(&format!("turn {}:", 10 - kept)));
    // The rest of the body is untouched.
    assert_eq!(body["max_tokens"], 16);
    assert_eq!(body["model"], "m");
}

#[test]
fn a_body_that_fits_is_left_alone() {
    let mut body = conversation(3, 10);
    let original = body.clone();
    let budget = Budget {
        target_tokens: 1e9,
        tokens_per_byte: 0.25,
    };
    assert_eq!(trim(&mut body, &budget, false), Trimmed::default());
    assert_eq!(body, original);
}

#[test]
fn the_last_message_is_never_dropped_even_when_it_alone_is_too_long() {
    let mut body = conversation(2, 10);
    let budget = Budget {
        target_tokens: 1.0,
        tokens_per_byte: 0.25,
    };
    let done = trim(&mut body, &budget, false);
    assert_eq!(done.dropped, 4);
    assert_eq!(roles(&body), ["system", "user"]);
    // Nothing more can go: a second trim changes nothing.
    assert!(!trim(&mut body, &budget, false).changed());
}

#[test]
fn a_leading_assistant_message_is_dropped_too() {
    // Dropping just the first user message would leave an assistant message first.
    let mut body = json!({"messages": [
        {"role": "system", "content": "s"},
        {"role": "system", "content": "s2"},
        {"role": "user", "content": "x".repeat(400)},
        {"role": "assistant", "content": "short"},
        {"role": "user", "content": "short"},
        {"role": "assistant", "content": "short"},
        {"role": "user", "content": "last"},
    ]});
    let per_byte = 1.0;
    let budget = Budget {
        target_tokens: estimate(&body, per_byte) - 300.0,
        tokens_per_byte: per_byte,
    };
    let done = trim(&mut body, &budget, false);
    assert_eq!(done.dropped, 2);
    assert_eq!(
        roles(&body),
        ["system", "system", "user", "assistant", "user"]
    );
}

fn tool_conversation() -> Value {
    let call = |id: &str| json!({"id": id, "type": "function", "function": {"name": "f", "arguments": "{}"}});
    json!({
        "model": "m",
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
        "tool_choice": "auto",
        "messages": [
            {"role": "system", "content": "s"},
            {"role": "user", "content": "u".repeat(200)},
            {"role": "assistant", "content": null, "tool_calls": [call("a"), call("b")]},
            {"role": "tool", "tool_call_id": "a", "content": "r".repeat(200)},
            {"role": "tool", "tool_call_id": "b", "content": "r".repeat(200)},
            {"role": "assistant", "content": "done"},
            {"role": "user", "content": "again"},
            {"role": "assistant", "content": null, "tool_calls": [call("c")]},
            {"role": "tool", "tool_call_id": "c", "content": "the last answer"},
        ]
    })
}

#[test]
fn a_tool_call_goes_with_its_answers() {
    let mut body = tool_conversation();
    let per_byte = 1.0;
    // Just over: the first user message alone would do, but then the assistant's tool
    // call leads, and its two answers must go with it, then the plain answer after them.
    let budget = Budget {
        target_tokens: estimate(&body, per_byte) - 10.0,
        tokens_per_byte: per_byte,
    };
    let done = trim(&mut body, &budget, false);
    assert_eq!(done.dropped, 5, "{body}");
    assert_eq!(roles(&body), ["system", "user", "assistant", "tool"]);
    assert_eq!(body["messages"][1]["content"], "again");
    assert!(body["tools"].is_array(), "tools stay on the first pass");
}

#[test]
fn a_call_answered_by_the_last_message_stays() {
    let mut body = tool_conversation();
    let budget = Budget {
        target_tokens: 1.0,
        tokens_per_byte: 1.0,
    };
    trim(&mut body, &budget, false);
    // The last message answers call `c`, so the assistant message making it stays.
    assert_eq!(roles(&body), ["system", "assistant", "tool"]);
    assert_eq!(body["messages"][2]["tool_call_id"], "c");
}

#[test]
fn the_second_pass_drops_the_tools() {
    let mut body = tool_conversation();
    let budget = Budget {
        target_tokens: 1e9,
        tokens_per_byte: 1.0,
    };
    let done = trim(&mut body, &budget, true);
    assert_eq!(
        done,
        Trimmed {
            dropped: 0,
            tools_dropped: true
        }
    );
    assert!(body.get("tools").is_none() && body.get("tool_choice").is_none());
    assert_eq!(body["messages"].as_array().unwrap().len(), 9);
}

#[test]
fn anthropic_tool_use_and_results_stay_paired() {
    let mut body = json!({
        "model": "m", "max_tokens": 64, "system": "be brief",
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "t".repeat(300)}]},
            {"role": "assistant", "content": [
                {"type": "text", "text": "let me look"},
                {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "r".repeat(100)}]},
            {"role": "assistant", "content": "found it"},
            {"role": "user", "content": "thanks, and now?"},
        ]
    });
    let budget = Budget {
        target_tokens: estimate(&body, 1.0) - 100.0,
        tokens_per_byte: 1.0,
    };
    let done = trim(&mut body, &budget, false);
    // The user text goes; the tool call would lead, so it goes with its result; then
    // the assistant's answer would lead and goes too.
    assert_eq!(done.dropped, 4, "{body}");
    assert_eq!(roles(&body), ["user"]);
    assert_eq!(body["system"], "be brief");
}

#[test]
fn the_recorded_llama_refusal_calibrates_a_trim_that_fits() {
    // The body llama-server refused above: 30 turns of "word " x 100 (16,159 bytes).
    let mut messages = vec![json!({"role": "system", "content": "Be brief."})];
    for i in 0..30 {
        let role = if i % 2 == 0 { "user" } else { "assistant" };
        messages.push(json!({"role": role, "content": "word ".repeat(100)}));
    }
    let mut body = json!({"model": "gemma3", "messages": messages, "max_tokens": 4});
    let r = parse_refusal(400, LLAMA_REFUSAL).unwrap();
    let per_byte = calibrate(r.n_prompt_tokens.unwrap(), 16159).unwrap();
    let budget = Budget::for_context(&body, r.n_ctx.unwrap(), per_byte);
    assert_eq!(budget.target_tokens, 1020.0);
    let done = trim(&mut body, &budget, false);
    assert!(estimate(&body, per_byte) <= 1020.0);
    // About a third of the tokens may stay: 9 or so of the 30 messages.
    let left = body["messages"].as_array().unwrap().len();
    assert_eq!(left + done.dropped, 31);
    assert!((6..=11).contains(&left), "{left} messages left");
    assert_eq!(roles(&body)[..2], ["system", "user"]);
}

fn request(body: &Value, headers: &[(&str, &str)]) -> RequestMessage {
    RequestMessage {
        request_id: "r1".into(),
        model: "m".into(),
        endpoint_path: "/v1/chat/completions".into(),
        is_streaming: false,
        body: Arc::from(body.to_string()),
        headers: headers
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
        body_encoding: None,
        continuation: None,
        held: None,
    }
}

fn llama_refusal(n_prompt: u64, n_ctx: u64) -> Vec<u8> {
    json!({"error": {"code": 400, "message": "too long", "type": "exceed_context_size_error",
        "n_prompt_tokens": n_prompt, "n_ctx": n_ctx}})
    .to_string()
    .into_bytes()
}

#[test]
fn wanted_only_for_chat_bodies_without_the_off_header() {
    let body = conversation(1, 2);
    assert!(wanted(true, &request(&body, &[])));
    assert!(!wanted(false, &request(&body, &[])));
    assert!(!wanted(true, &request(&body, &[("x-context-trim", "off")])));
    assert!(!wanted(
        true,
        &request(&body, &[("x-context-trim", " OFF")])
    ));
    assert!(wanted(true, &request(&body, &[("x-context-trim", "on")])));
    let mut other = request(&body, &[]);
    other.endpoint_path = "/v1/embeddings".into();
    assert!(!wanted(true, &other));
    let prompt = request(&json!({"model": "m", "prompt": "hi"}), &[]);
    assert!(!wanted(true, &prompt));
}

#[test]
fn refusals_retry_trimmed_then_without_tools_then_the_first_refusal_goes_out() {
    let mut body = tool_conversation();
    body["messages"][6]["content"] = json!("again ".repeat(50));
    let req = request(&body, &[]);
    let contexts = Contexts::default();
    let policy = Policy {
        contexts: &contexts,
        described_ctx: None,
    };
    let mut a = Attempts::new(Some(policy), &req, &req.body);
    assert_eq!(a.body(), &*req.body, "nothing known: sent as it is");
    assert!(a.watches(400) && !a.watches(200) && !a.watches(500));
    let size = req.body.len() as u64;
    let mut first_headers = HeaderMap::new();
    first_headers.insert("content-type".into(), "application/json".into());
    // Refused at one token per byte with a context of half the body.
    let first = llama_refusal(size, size / 2);
    assert_eq!(
        a.refused(400, first_headers.clone(), first.clone()),
        Next::Retry
    );
    let sent: Value = serde_json::from_str(a.body()).unwrap();
    assert!(sent["tools"].is_array(), "first retry keeps the tools");
    let dropped = 9 - sent["messages"].as_array().unwrap().len();
    assert!(dropped > 0);
    assert_eq!(contexts.get("m").map(|l| l.n_ctx), Some(size / 2));
    // Refused again: the second retry also drops the tools.
    let again = a.body().len() as u64;
    assert_eq!(
        a.refused(400, HeaderMap::new(), llama_refusal(again, 10)),
        Next::Retry
    );
    let sent: Value = serde_json::from_str(a.body()).unwrap();
    assert!(sent.get("tools").is_none());
    let mut headers = HeaderMap::new();
    a.mark(&mut headers);
    let total: usize = headers[TRIMMED_HEADER].parse().unwrap();
    assert!(total >= dropped);
    assert_eq!(total, 9 - sent["messages"].as_array().unwrap().len());
    // A third refusal: the first one goes out, unchanged.
    assert_eq!(
        a.refused(400, HeaderMap::new(), llama_refusal(5, 4)),
        Next::Answer {
            status: 400,
            headers: first_headers,
            body: first
        }
    );
}

#[test]
fn a_refusal_with_nothing_to_trim_goes_out_at_once() {
    let body = json!({"model": "m", "messages": [{"role": "user", "content": "x".repeat(500)}]});
    let req = request(&body, &[]);
    let contexts = Contexts::default();
    let policy = Policy {
        contexts: &contexts,
        described_ctx: None,
    };
    let mut a = Attempts::new(Some(policy), &req, &req.body);
    let refusal = llama_refusal(200, 100);
    assert_eq!(
        a.refused(400, HeaderMap::new(), refusal.clone()),
        Next::Answer {
            status: 400,
            headers: HeaderMap::new(),
            body: refusal
        }
    );
    let mut headers = HeaderMap::new();
    a.mark(&mut headers);
    assert!(headers.is_empty());
}

#[test]
fn another_400_goes_out_as_it_is() {
    let body = conversation(4, 20);
    let req = request(&body, &[]);
    let contexts = Contexts::default();
    let policy = Policy {
        contexts: &contexts,
        described_ctx: None,
    };
    let mut a = Attempts::new(Some(policy), &req, &req.body);
    let other = br#"{"error":{"message":"bad tool","type":"invalid_request_error"}}"#.to_vec();
    assert_eq!(
        a.refused(400, HeaderMap::new(), other.clone()),
        Next::Answer {
            status: 400,
            headers: HeaderMap::new(),
            body: other
        }
    );
    assert!(contexts.get("m").is_none());
}

#[test]
fn a_learned_small_context_pre_trims_the_next_request() {
    let body = conversation(20, 100);
    let req = request(&body, &[]);
    let contexts = Contexts::default();
    let size = req.body.len();
    // As if an earlier refusal said: one token per four bytes, a context of a third.
    let n_ctx = (size / 4 / 3) as u64;
    contexts.learn("m", Some(n_ctx), Some(0.25));
    let policy = Policy {
        contexts: &contexts,
        described_ctx: None,
    };
    let a = Attempts::new(Some(policy), &req, &req.body);
    let sent: Value = serde_json::from_str(a.body()).unwrap();
    assert!(estimate(&sent, 0.25) <= (n_ctx - 16) as f64);
    let mut headers = HeaderMap::new();
    a.mark(&mut headers);
    let dropped: usize = headers[TRIMMED_HEADER].parse().unwrap();
    assert_eq!(dropped + sent["messages"].as_array().unwrap().len(), 42);
    // Trimming off for the request: no policy, no pre-trim.
    let a = Attempts::new(None, &req, &req.body);
    assert_eq!(a.body(), &*req.body);
    assert!(!a.watches(400));
}

#[test]
fn a_described_context_pre_trims_only_when_small() {
    let body = conversation(20, 100);
    let req = request(&body, &[]);
    let contexts = Contexts::default();
    let n_ctx = (req.body.len() / 3 / 2) as u64;
    let small = Policy {
        contexts: &contexts,
        described_ctx: Some(n_ctx),
    };
    let a = Attempts::new(Some(small), &req, &req.body);
    assert!(a.body().len() < req.body.len());
    // A body that fits a small context is sent as it is.
    let short = request(&conversation(1, 4), &[]);
    let small = Policy {
        contexts: &contexts,
        described_ctx: Some(n_ctx),
    };
    let a = Attempts::new(Some(small), &short, &short.body);
    assert_eq!(a.body(), &*short.body);
    // Above 32,768 tokens nothing is pre-trimmed, whatever the estimate.
    let big = conversation(400, 100);
    let big_req = request(&big, &[]);
    let large = Policy {
        contexts: &contexts,
        described_ctx: Some(PROACTIVE_MAX_CTX + 1),
    };
    assert!(big_req.body.len() / 3 > (PROACTIVE_MAX_CTX + 1) as usize);
    let a = Attempts::new(Some(large), &big_req, &big_req.body);
    assert_eq!(a.body(), &*big_req.body);
}

#[test]
fn contexts_stay_bounded() {
    let contexts = Contexts::default();
    for i in 0..300 {
        contexts.learn(&format!("m{i}"), Some(512), None);
    }
    assert!(contexts.known_len() <= 256);
    contexts.learn("x", None, Some(0.2));
    assert!(
        contexts.get("x").is_none(),
        "no context size, nothing learned"
    );
    contexts.learn("x", Some(100), Some(0.2));
    contexts.learn("x", Some(200), None);
    assert_eq!(
        contexts.get("x"),
        Some(attempts::Learned {
            n_ctx: 200,
            tokens_per_byte: Some(0.2)
        })
    );
}
