//! Judging what a chaos client received: the HTTP status and error shape, then the SSE
//! or NDJSON events or the whole answer, against the fake backend's checksum.

use serde_json::Value;

use super::client::{Kind, Plan, Route};
use crate::fake_backend::chaos::{Fault, Received};

/// Judges a complete HTTP response.
pub fn judge(plan: &Plan, status: u16, ctype: &str, body: &[u8]) -> (Kind, String) {
    let Ok(text) = std::str::from_utf8(body) else {
        return (Kind::Violation("malformed"), "body is not UTF-8".into());
    };
    if status >= 400 {
        return error_body(status, text);
    }
    if status != 200 {
        return (
            Kind::Violation("malformed"),
            format!("unexpected status {status}"),
        );
    }
    if ctype.starts_with("text/event-stream") {
        sse(plan, text)
    } else if ctype.contains("ndjson") {
        ndjson(plan, text)
    } else {
        whole(plan, text)
    }
}

fn error_code(v: &Value) -> Option<String> {
    match v.get("error")? {
        Value::String(s) => Some(format!("ollama:{}", short(s))),
        e => e
            .get("code")
            .and_then(Value::as_str)
            .or_else(|| e.get("type").and_then(Value::as_str))
            .map(str::to_string),
    }
}

/// The first words of an Ollama error message, without ids or numbers.
fn short(message: &str) -> String {
    message
        .split_whitespace()
        .take(4)
        .collect::<Vec<_>>()
        .join(" ")
        .chars()
        .filter(|c| !c.is_ascii_digit())
        .collect()
}

fn error_body(status: u16, text: &str) -> (Kind, String) {
    match serde_json::from_str::<Value>(text)
        .ok()
        .as_ref()
        .and_then(error_code)
    {
        Some(code) => (Kind::Error(status, code), String::new()),
        None => (
            Kind::Violation("malformed"),
            format!(
                "{status} without an error body: {:?}",
                &text[..text.len().min(200)]
            ),
        ),
    }
}

/// The verdict on received content: how it ended (`done`, error codes) and whether
/// the content is whole, a clean start, or corrupt.
fn verdict(plan: &Plan, content: &str, done: bool, errors: &[String]) -> (Kind, String) {
    let check = plan.spec.check(content);
    if let Received::Corrupt(d) = &check {
        return (Kind::Violation("spliced"), d.clone());
    }
    match (errors, done, check) {
        ([], true, Received::Whole) if plan.spec.fault == Fault::None => {
            (Kind::Complete, String::new())
        }
        ([], true, Received::Whole) => (
            Kind::Violation("unexpected"),
            format!("a whole answer for {:?}", plan.spec.fault),
        ),
        ([], true, _) => (
            Kind::Violation("truncated"),
            format!("ended normally after {} bytes of content", content.len()),
        ),
        ([], false, _) => (
            Kind::Violation("truncated"),
            format!(
                "no end and no error event after {} bytes of content",
                content.len()
            ),
        ),
        ([code], false, _) => (Kind::StreamError(code.clone()), String::new()),
        _ => (
            Kind::Violation("duplicated"),
            format!("end seen: {done}, error events: {errors:?}"),
        ),
    }
}

/// A relayed SSE stream, parsed as an SDK would.
fn sse(plan: &Plan, text: &str) -> (Kind, String) {
    if !text.is_empty() && !text.ends_with("\n\n") {
        let tail = &text[text.len().saturating_sub(80)..];
        return (
            Kind::Violation("malformed"),
            format!("stream does not end on an event boundary: ...{tail:?}"),
        );
    }
    let (mut content, mut done, mut errors) = (String::new(), false, Vec::new());
    for event in text.split("\n\n").filter(|e| !e.trim().is_empty()) {
        let data: Vec<&str> = event
            .lines()
            .filter_map(|l| l.strip_prefix("data:"))
            .map(|d| d.strip_prefix(' ').unwrap_or(d))
            .collect();
        if data.is_empty() {
            continue; // a comment (queue progress) or an `event:` line alone
        }
        if done || !errors.is_empty() {
            return (
                Kind::Violation("duplicated"),
                format!("an event after the end: {event:?}"),
            );
        }
        let data = data.join("\n");
        if data == "[DONE]" {
            done = true;
            continue;
        }
        let Ok(v) = serde_json::from_str::<Value>(&data) else {
            return (
                Kind::Violation("malformed"),
                format!("corrupt event {data:?}"),
            );
        };
        if let Some(code) = error_code(&v) {
            errors.push(code);
            continue;
        }
        if let Some(piece) = v["choices"][0]["delta"]["content"].as_str() {
            content.push_str(piece);
        }
    }
    verdict(plan, &content, done, &errors)
}

/// A relayed Ollama NDJSON stream.
fn ndjson(plan: &Plan, text: &str) -> (Kind, String) {
    if !text.is_empty() && !text.ends_with('\n') {
        return (
            Kind::Violation("malformed"),
            "stream does not end on a line boundary".into(),
        );
    }
    let (mut content, mut done, mut errors) = (String::new(), false, Vec::new());
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        if done || !errors.is_empty() {
            return (
                Kind::Violation("duplicated"),
                format!("a line after the end: {line:?}"),
            );
        }
        let Ok(v) = serde_json::from_str::<Value>(line) else {
            return (
                Kind::Violation("malformed"),
                format!("corrupt line {line:?}"),
            );
        };
        if let Some(code) = error_code(&v) {
            errors.push(code);
            continue;
        }
        let piece = match plan.route {
            Route::OllamaGenerate => v["response"].as_str(),
            _ => v["message"]["content"].as_str(),
        };
        content.push_str(piece.unwrap_or(""));
        if v["done"] == true {
            done = true;
        }
    }
    verdict(plan, &content, done, &errors)
}

/// A whole (non-streamed) answer.
fn whole(plan: &Plan, text: &str) -> (Kind, String) {
    let Ok(v) = serde_json::from_str::<Value>(text) else {
        return (
            Kind::Violation("malformed"),
            format!("200 answer is not JSON: {:?}", &text[..text.len().min(200)]),
        );
    };
    let content = match plan.route {
        Route::Chat | Route::Messages => v["choices"][0]["message"]["content"].as_str(),
        Route::OllamaChat => v["message"]["content"].as_str(),
        Route::OllamaGenerate => v["response"].as_str(),
    };
    match content {
        Some(c) => verdict(plan, c, true, &[]),
        None => (
            Kind::Violation("malformed"),
            format!(
                "200 answer without content: {:?}",
                &text[..text.len().min(200)]
            ),
        ),
    }
}
