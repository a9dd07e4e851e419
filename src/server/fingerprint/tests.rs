//! Fingerprints on recorded body shapes: each API's boundaries, the next turn repeating
//! the previous one, explicit keys, and what is left out.

use serde_json::{json, Value};

use super::*;

const CHAT: &str = "/v1/chat/completions";

/// A system prompt long enough to be worth steering for.
fn system(topic: &str) -> String {
    format!("You are a careful assistant for {topic}. ").repeat(30)
}

fn prints(path: &str, body: &Value, session: Option<&str>) -> Vec<u64> {
    for_request(true, path, &body.to_string(), session)
        .as_slice()
        .to_vec()
}

fn chat(turns: &[(&str, &str)]) -> Value {
    let messages: Vec<Value> = turns
        .iter()
        .map(|(role, content)| json!({"role": role, "content": content}))
        .collect();
    json!({"model": "m", "stream": true, "messages": messages})
}

#[test]
fn the_next_turn_repeats_the_previous_turns_longest_fingerprint() {
    let sys = system("gardening");
    let first = prints(CHAT, &chat(&[("system", &sys), ("user", "roses?")]), None);
    let second = prints(
        CHAT,
        &chat(&[
            ("system", &sys),
            ("user", "roses?"),
            ("assistant", "Prune in spring."),
            ("user", "and tulips?"),
        ]),
        None,
    );
    assert_eq!(first.len(), 2, "one per message boundary");
    assert_eq!(second.len(), 4);
    assert_eq!(&second[..2], &first[..], "the shared prefix hashes alike");
    assert!(!first.contains(&second[3]));

    let other = prints(
        CHAT,
        &chat(&[("system", &system("taxes")), ("user", "roses?")]),
        None,
    );
    assert!(
        other.iter().all(|p| !first.contains(p)),
        "another conversation"
    );
}

#[test]
fn encoding_details_do_not_change_a_fingerprint() {
    let sys = system("cooking");
    let compact = chat(&[("system", &sys), ("user", "soup?")]).to_string();
    // The same messages with keys in another order and spaces, as another SDK writes them.
    let spaced = format!(
        "{{ \"messages\": [ {{\"content\": {}, \"role\": \"system\"}}, {{\"content\": \"soup?\", \"role\": \"user\"}} ], \"model\": \"m\" }}",
        serde_json::to_string(&sys).unwrap()
    );
    assert_eq!(
        for_request(true, CHAT, &compact, None),
        for_request(true, CHAT, &spaced, None)
    );
}

#[test]
fn anthropic_system_and_moved_cache_markers() {
    let sys = system("law");
    let turn1 = json!({"model": "c", "system": sys, "max_tokens": 64, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "hi", "cache_control": {"type": "ephemeral"}}]}
    ]});
    let turn2 = json!({"model": "c", "system": sys, "max_tokens": 64, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "hi"}]},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": [{"type": "text", "text": "more", "cache_control": {"type": "ephemeral"}}]}
    ]});
    let (a, b) = (
        prints("/v1/messages", &turn1, None),
        prints("/v1/messages", &turn2, None),
    );
    assert_eq!(a.len(), 2, "system, then each message");
    assert_eq!(&b[..2], &a[..], "the marker moved, the prefix is the same");
}

#[test]
fn responses_instructions_and_input() {
    let sys = system("maths");
    let turn1 = json!({"model": "m", "instructions": sys, "input": [
        {"role": "user", "content": "2+2?"}
    ]});
    let turn2 = json!({"model": "m", "instructions": sys, "input": [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "3+3?"}
    ]});
    let (a, b) = (
        prints("/v1/responses", &turn1, None),
        prints("/v1/responses", &turn2, None),
    );
    assert_eq!(a.len(), 2);
    assert_eq!(&b[..2], &a[..]);
    let text = json!({"model": "m", "input": "x".repeat(600)});
    assert_eq!(
        prints("/v1/responses", &text, None).len(),
        1,
        "a string input"
    );
}

#[test]
fn raw_prompts_are_cut_into_blocks() {
    let story = "Once upon a time there was a relay. ".repeat(100); // 3,600 bytes
    let first = prints(
        "/v1/completions",
        &json!({"model": "m", "prompt": story}),
        None,
    );
    assert_eq!(
        first.len(),
        3,
        "three whole blocks; the tail is not a boundary"
    );
    let longer = format!("{story} It routed well. And then some more text came along.");
    let second = prints(
        "/v1/completions",
        &json!({"model": "m", "prompt": longer}),
        None,
    );
    assert_eq!(&second[..3], &first[..]);
}

#[test]
fn explicit_keys_win_body_first() {
    let body = chat(&[("system", &system("x")), ("user", "y")]);
    let mut keyed = body.clone();
    keyed["prompt_cache_key"] = json!("conv-42");
    let by_body = prints(CHAT, &keyed, Some("other"));
    assert_eq!(by_body.len(), 1);
    assert_eq!(
        by_body,
        prints(
            CHAT,
            &json!({"model": "m", "prompt_cache_key": "conv-42"}),
            None
        )
    );
    let by_header = prints(CHAT, &body, Some("conv-42"));
    assert_eq!(by_header.len(), 1);
    assert_eq!(by_header, by_body, "the same key, whichever way it came");
    assert_ne!(prints(CHAT, &body, Some("conv-43")), by_header);
    assert!(
        !prints(CHAT, &body, None).contains(&by_header[0]),
        "a key never equals a prompt prefix"
    );
    // A short body has no prefix worth steering for, but a key still counts.
    assert_eq!(prints(CHAT, &json!({"model": "m"}), Some("s")).len(), 1);
    assert!(prints(CHAT, &json!({"model": "m"}), Some("  ")).is_empty());
}

#[test]
fn nothing_for_short_prompts_embeddings_odd_bodies_or_when_off() {
    let short = chat(&[("user", "hello")]);
    assert!(prints(CHAT, &short, None).is_empty());
    let long = chat(&[("system", &system("z")), ("user", "hello")]);
    assert!(!prints(CHAT, &long, None).is_empty());
    assert!(for_request(false, CHAT, &long.to_string(), Some("s")).is_none());
    let embed = json!({"model": "e", "input": system("z")});
    assert!(prints("/v1/embeddings", &embed, None).is_empty());
    assert!(for_request(true, CHAT, &"[1,2,3]".repeat(300), None).is_none());
    let odd = json!({"model": "m", "messages": "not a list", "pad": system("z")});
    assert!(prints(CHAT, &odd, None).is_empty());
}

#[test]
fn long_conversations_keep_the_first_and_the_longest_prefixes() {
    let sys = system("history");
    let mut turns = vec![("system", sys.as_str())];
    let words: Vec<String> = (0..99).map(|i| format!("message {i}")).collect();
    turns.extend(words.iter().map(|w| ("user", w.as_str())));
    let all = prints(CHAT, &chat(&turns), None);
    assert_eq!(all.len(), MAX_PRINTS);
    let fewer = prints(CHAT, &chat(&turns[..5]), None);
    assert_eq!(&all[..FIRST_KEPT], &fewer[..FIRST_KEPT], "the opening kept");
    turns.push(("assistant", "done"));
    let next = prints(CHAT, &chat(&turns), None);
    assert_eq!(
        next[MAX_PRINTS - 2],
        all[MAX_PRINTS - 1],
        "the longest kept"
    );
}
