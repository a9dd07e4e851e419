//! Unit tests of `moe`.

use super::*;

fn drafts() -> Vec<String> {
    vec!["Paris.".into(), "Lyon.".into(), "Paris, France.".into()]
}

#[test]
fn votes_are_read_from_the_last_best_line() {
    assert_eq!(vote("Good answer.\nBEST: 2", 3), Some(1));
    assert_eq!(vote("**Best:** Answer 3", 3), Some(2));
    assert_eq!(vote("the best one is 1.\nBEST: 3\n", 3), Some(2));
    assert_eq!(vote("BEST: 7", 3), None, "out of range");
    assert_eq!(vote("no vote here", 3), None);
    assert_eq!(vote("BEST:\n2", 3), None, "the number is on the line");
}

#[test]
fn the_most_voted_draft_wins_and_ties_go_to_the_earlier() {
    let c = |s: &str| Some(s.to_string());
    assert_eq!(
        best_draft(&[c("BEST: 3"), c("BEST: 3"), c("BEST: 1")], 3),
        2
    );
    assert_eq!(best_draft(&[c("BEST: 2"), c("BEST: 1"), None], 3), 0);
    assert_eq!(best_draft(&[None, c("meh"), None], 3), 0);
    assert_eq!(best_draft(&[], 1), 0);
}

#[test]
fn prompts_quote_the_question_and_every_draft() {
    let p = critique_prompt("Capital of France?", &drafts(), 1);
    assert!(p.contains("Critique answer 2"), "{p}");
    assert!(p.contains("Capital of France?") && p.contains("BEST: <number>"));
    for (i, d) in drafts().iter().enumerate() {
        assert!(p.contains(&format!("Answer {}:\n{d}", i + 1)), "{p}");
    }
    let critiques = [Some("Fine.\nBEST: 3".to_string()), None, Some("Ok".into())];
    let f = final_prompt("Capital of France?", &drafts(), 2, &critiques);
    assert!(f.contains("Answer 3 (voted best):\nParis, France."), "{f}");
    assert!(f.contains("Answer 1:\nParis.") && f.contains("Answer 2:\nLyon."));
    assert!(f.contains("Critique of answer 1:\nFine.") && f.contains("Critique of answer 3"));
    assert!(!f.contains("Critique of answer 2"), "{f}");
}

#[test]
fn bodies_keep_the_clients_parameters_where_they_belong() {
    let raw = br#"{"model":"moe-m","stream":true,"stream_options":{"include_usage":true},
        "temperature":0.2,"messages":[{"role":"system","content":"Be brief."},
        {"role":"user","content":[{"type":"text","text":"Why?"},{"type":"image_url"}]}]}"#;
    let plan = Plan::new(raw, "moe-m").expect("plan");
    assert_eq!(plan.model, "m");
    assert_eq!(plan.question, "Why?\n[image_url]");
    let draft: Value = serde_json::from_str(&plan.draft_body()).unwrap();
    assert_eq!(draft["model"], "m");
    assert_eq!(draft["stream"], false);
    assert_eq!(draft["temperature"], 0.2);
    assert!(draft.get("stream_options").is_none());
    assert_eq!(draft["messages"][1]["content"][0]["text"], "Why?");
    let critique: Value = serde_json::from_str(&plan.critique_body(&drafts(), 0)).unwrap();
    assert_eq!(critique["messages"].as_array().map(Vec::len), Some(1));
    assert!(critique.get("temperature").is_none());
    let fin: Value = serde_json::from_str(&plan.final_body(&drafts(), 0, &[], true)).unwrap();
    assert_eq!(fin["stream"], true);
    assert_eq!(fin["temperature"], 0.2);
    assert_eq!(fin["messages"][0]["content"], "Be brief.");
    assert_eq!(fin["messages"][1]["role"], "user");
    assert!(Plan::new(br#"{"model":"moe-"}"#, "moe-").is_err());
    let e = Plan::new(br#"{"model":"moe-m","messages":[]}"#, "moe-m").unwrap_err();
    assert_eq!(e.status, 400);
}

#[test]
fn a_conversation_is_quoted_turn_by_turn() {
    let msgs: Vec<Value> = serde_json::from_str(
        r#"[{"role":"user","content":"a"},{"role":"assistant","content":"b"},
            {"role":"user","content":"c"}]"#,
    )
    .unwrap();
    assert_eq!(question(&msgs), "user: a\n\nassistant: b\n\nuser: c");
}

#[test]
fn answers_are_read_whole_or_from_sse() {
    let whole = r#"{"choices":[{"message":{"role":"assistant","content":"hi"}}]}"#;
    assert_eq!(answer_text(whole).as_deref(), Some("hi"));
    let sse = "data: {\"choices\":[{\"delta\":{\"content\":\"h\"}}]}\n\n\
               data: {\"choices\":[{\"delta\":{\"content\":\"i\"}}]}\n\ndata: [DONE]\n\n";
    assert_eq!(answer_text(sse).as_deref(), Some("hi"));
    assert_eq!(
        answer_text(r#"{"choices":[{"message":{"content":" "}}]}"#),
        None
    );
    assert_eq!(answer_text("not json"), None);
    let e = answer_error(500, r#"{"error":{"message":"boom","code":"oops"}}"#);
    assert_eq!(
        (e.status, e.code.as_str(), e.message.as_str()),
        (500, "oops", "boom")
    );
    assert_eq!(answer_error(503, "").code, "worker_error");
}

#[test]
fn rename_rewrites_model_in_split_sse_lines_and_whole_bodies() {
    let mut r = Rename::new("moe-m");
    let mut out = r.chunk("data: {\"model\":\"m\",\"choices\":[]}\n\ndata: {\"mo");
    out.push_str(
        &r.chunk("del\":\"m\",\"usage\":{\"prompt_tokens\":4,\"completion_tokens\":2}}\n\n"),
    );
    out.push_str(&r.end("data: [DONE]\n\n"));
    let events: Vec<&str> = out.split("\n\n").collect();
    assert_eq!(events.len(), 4, "{out}");
    for event in &events[..2] {
        let v: Value = serde_json::from_str(event.strip_prefix("data: ").unwrap()).unwrap();
        assert_eq!(v["model"], "moe-m", "{out}");
    }
    assert_eq!(events[2..], ["data: [DONE]", ""]);
    assert_eq!(r.tokens(), (4, 2));
    let (status, body) = r.whole(200, r#"{"model":"m","x":1}"#, Duration::ZERO);
    assert_eq!((status, body.as_str()), (200, r#"{"model":"moe-m","x":1}"#));
    let err = r#"{"error":{"message":"no"}}"#;
    assert_eq!(r.whole(404, err, Duration::ZERO), (404, err.to_string()));
}
