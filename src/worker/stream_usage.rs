//! Token usage in streams: the worker asks the backend for the final usage chunk when
//! the client did not ([`with_usage_requested`]), keeps it from the client then
//! ([`UsageEventFilter`]), and reads the counts from whatever it saw ([`UsageScanner`],
//! [`usage_from_json`]) for `response_complete.token_counts`.

use log::warn;
use serde::Deserialize;

use crate::protocol::TokenCounts;

/// The OpenAI-style endpoints whose streams can carry a usage-only chunk on request.
const USAGE_OPTION_PATHS: &[&str] = &["/v1/chat/completions", "/v1/completions"];
/// A pending event longer than this is not a usage event (those are a few hundred
/// bytes): it is forwarded without waiting for its end.
pub(crate) const MAX_HELD_EVENT: usize = 64 * 1024;

/// For a streaming request to `/v1/chat/completions` or `/v1/completions` whose body
/// does not already ask for `stream_options.include_usage`, the body with that option
/// added (merged into an existing `stream_options` object). `None` means "send the body
/// as it is": other endpoints, bodies that already ask, bodies that do not stream, and
/// bodies that are not a JSON object.
pub fn with_usage_requested(endpoint_path: &str, body: &str) -> Option<String> {
    let path = endpoint_path.split('?').next().unwrap_or_default();
    if !USAGE_OPTION_PATHS.contains(&path) {
        return None;
    }
    // Fast path: the client asked for usage itself (the common compact spellings).
    if body.contains("\"include_usage\":true") || body.contains("\"include_usage\": true") {
        return None;
    }
    let mut v: serde_json::Value = serde_json::from_str(body).ok()?;
    let obj = v.as_object_mut()?;
    if obj.get("stream").and_then(|s| s.as_bool()) != Some(true) {
        return None;
    }
    match obj.get_mut("stream_options") {
        Some(serde_json::Value::Object(options)) => {
            if options.get("include_usage").and_then(|u| u.as_bool()) == Some(true) {
                return None;
            }
            options.insert("include_usage".into(), serde_json::Value::Bool(true));
        }
        None | Some(serde_json::Value::Null) => {
            obj.insert(
                "stream_options".into(),
                serde_json::json!({ "include_usage": true }),
            );
        }
        // Something the backend would reject anyway: leave it as the client sent it.
        Some(_) => return None,
    }
    serde_json::to_string(&v).ok()
}

/// Removes the usage-only event (`"choices":[]` with a `usage` object) from an SSE
/// stream, passing everything else through unchanged and in order. Whole events are
/// held until their blank-line end, since any of them could be the usage event; an
/// event that grows past [`MAX_HELD_EVENT`] is forwarded as it comes.
#[derive(Default)]
pub struct UsageEventFilter {
    /// The start of an event whose end has not arrived yet.
    held: String,
    /// Forwarding a long event as it comes, until its end.
    passing: bool,
    /// The last few bytes forwarded while `passing` (an event end split across reads).
    passed_tail: String,
}

impl UsageEventFilter {
    /// Takes the next piece of the stream; returns what can be forwarded now.
    pub fn push(&mut self, text: &str) -> String {
        let mut out = String::new();
        let mut rest = text;
        if self.passing {
            // Look for the event's end, also across the previous piece.
            let joined = format!("{}{}", self.passed_tail, rest);
            match event_end(&joined) {
                Some(end) => {
                    let cut = end - self.passed_tail.len();
                    out.push_str(&rest[..cut]);
                    rest = &rest[cut..];
                    self.passing = false;
                    self.passed_tail.clear();
                }
                None => {
                    out.push_str(rest);
                    self.passed_tail = last_chars(&joined, 3);
                    return out;
                }
            }
        }
        // What was held has no event end in it: only the new bytes can complete one
        // (searching the whole held text again for every piece cost quadratic time on
        // a stream arriving in small pieces).
        let fresh = self.held.len();
        self.held.push_str(rest);
        let mut start = 0;
        while let Some(end) = event_end_after(&self.held[start..], fresh.saturating_sub(start)) {
            let event = &self.held[start..start + end];
            if !is_usage_event(event) {
                out.push_str(event);
            }
            start += end;
        }
        self.held.drain(..start);
        if self.held.len() > MAX_HELD_EVENT {
            out.push_str(&self.held);
            self.passed_tail = last_chars(&self.held, 3);
            self.held.clear();
            self.passing = true;
        }
        out
    }

    /// The end of the stream: an unterminated last event is forwarded (unless it is the
    /// usage event).
    pub fn finish(&mut self) -> String {
        let held = std::mem::take(&mut self.held);
        if is_usage_event(&held) {
            String::new()
        } else {
            held
        }
    }
}

/// The byte just past the first event end (a blank line: `\n\n` or `\r\n\r\n`).
/// One pass that stops at the first end: searching the whole text for each pattern
/// made a piece holding many small events cost quadratic time.
fn event_end(text: &str) -> Option<usize> {
    event_end_after(text, 0)
}

/// [`event_end`] for a text whose first `from` bytes contain no complete event end: an
/// end's last `\n` is searched from `from` on (looking back past it for the rest).
fn event_end_after(text: &str, from: usize) -> Option<usize> {
    let bytes = text.as_bytes();
    let mut from = from.min(bytes.len());
    while let Some(offset) = bytes[from..].iter().position(|&b| b == b'\n') {
        let at = from + offset;
        let lf = at >= 1 && bytes[at - 1] == b'\n';
        let crlf = at >= 3 && &bytes[at - 3..at] == b"\r\n\r";
        if lf || crlf {
            return Some(at + 1);
        }
        from = at + 1;
    }
    None
}

/// At most the last `n` characters of `text`.
fn last_chars(text: &str, n: usize) -> String {
    let start = text
        .char_indices()
        .rev()
        .nth(n.saturating_sub(1))
        .map_or(0, |(i, _)| i);
    text[start..].to_string()
}

/// Whether one SSE event is the usage-only chunk: its data is a JSON object with an
/// empty `choices` list and a `usage` object.
pub fn is_usage_event(event: &str) -> bool {
    if !event.contains("usage") || !event.contains("choices") {
        return false;
    }
    let Some(data) = event_data(event) else {
        return false;
    };
    let Ok(v) = serde_json::from_str::<serde_json::Value>(&data) else {
        return false;
    };
    v.get("choices")
        .and_then(|c| c.as_array())
        .is_some_and(|c| c.is_empty())
        && v.get("usage").is_some_and(|u| u.is_object())
}

/// The data of one SSE event (its `data:` lines joined), or `None` for one without.
pub(crate) fn event_data(event: &str) -> Option<String> {
    let data: Vec<&str> = event
        .lines()
        .filter_map(|line| line.strip_prefix("data:"))
        .map(|d| d.strip_prefix(' ').unwrap_or(d))
        .collect();
    (!data.is_empty()).then(|| data.join("\n"))
}

/// Finds the last `usage` object in an SSE stream, line by line.
#[derive(Default)]
pub struct UsageScanner {
    line: String,
    pub counts: Option<TokenCounts>,
}

impl UsageScanner {
    pub fn scan(&mut self, text: &str) {
        for piece in text.split_inclusive('\n') {
            self.line.push_str(piece);
            if !piece.ends_with('\n') {
                // Keep a bounded partial line; usage lines are short.
                if self.line.len() > 64 * 1024 {
                    self.line.clear();
                }
                continue;
            }
            let line = std::mem::take(&mut self.line);
            let line = line.trim();
            // SSE `data:` lines, or NDJSON lines (Ollama's native streams end with an
            // object carrying `prompt_eval_count`/`eval_count`).
            let data = line.strip_prefix("data:").map(str::trim).unwrap_or(line);
            if data.starts_with('{')
                && (data.contains("\"usage\"")
                    || data.contains("_tokens\"")
                    || data.contains("eval_count\""))
            {
                if let Some(c) = usage_from_json(data) {
                    self.counts = Some(c);
                }
            }
        }
    }
}

/// Token counts from an OpenAI (`usage.prompt_tokens`...) or Anthropic
/// (`usage.input_tokens`/`output_tokens`, also inside `message`) JSON body, or from
/// Ollama's native `prompt_eval_count`/`eval_count`.
pub fn usage_from_json(body: &str) -> Option<TokenCounts> {
    if !body.contains("_tokens") && !body.contains("eval_count") {
        return None;
    }
    let counted: Counted = serde_json::from_str(body).ok()?;
    let nested = |n: Option<Lenient<Nested>>| match n {
        Some(Lenient::Is(Nested { usage })) => usage,
        _ => None,
    };
    let usage = counted
        .usage
        .or_else(|| nested(counted.message))
        .or_else(|| nested(counted.response));
    let usage = match usage {
        Some(Lenient::Is(usage)) => usage,
        // Present but not an object: not a usage to read, nor a reason to look elsewhere.
        Some(Lenient::Not(_)) => Usage::default(),
        None => return ollama_counts(counted.eval_count, counted.prompt_eval_count),
    };
    let prompt = count(usage.prompt_tokens).or(count(usage.input_tokens));
    let completion = count(usage.completion_tokens).or(count(usage.output_tokens));
    let total = count(usage.total_tokens).or(match (prompt, completion) {
        (Some(p), Some(c)) => Some(p.saturating_add(c)),
        _ => None,
    });
    if prompt.is_none() && completion.is_none() && total.is_none() {
        warn!("usage object without token counts");
        return None;
    }
    Some(TokenCounts {
        prompt_tokens: prompt,
        completion_tokens: completion,
        total_tokens: total,
    })
}

/// The fields of an answer that carry token counts. Everything else, the answer's text
/// included, is skipped while parsing, not copied (this runs on every answer).
#[derive(Deserialize)]
struct Counted {
    #[serde(default)]
    usage: Option<Lenient<Usage>>,
    #[serde(default)]
    message: Option<Lenient<Nested>>,
    #[serde(default)]
    response: Option<Lenient<Nested>>,
    #[serde(default)]
    eval_count: Option<Lenient<u64>>,
    #[serde(default)]
    prompt_eval_count: Option<Lenient<u64>>,
}

#[derive(Deserialize)]
struct Nested {
    #[serde(default)]
    usage: Option<Lenient<Usage>>,
}

#[derive(Deserialize, Default)]
struct Usage {
    #[serde(default)]
    prompt_tokens: Option<Lenient<u64>>,
    #[serde(default)]
    input_tokens: Option<Lenient<u64>>,
    #[serde(default)]
    completion_tokens: Option<Lenient<u64>>,
    #[serde(default)]
    output_tokens: Option<Lenient<u64>>,
    #[serde(default)]
    total_tokens: Option<Lenient<u64>>,
}

/// A field of the expected type, or of any other (a float count, a string usage...),
/// which then counts as absent instead of failing the whole body.
#[derive(Deserialize)]
#[serde(untagged)]
enum Lenient<T> {
    Is(T),
    Not(serde::de::IgnoredAny),
}

fn count(field: Option<Lenient<u64>>) -> Option<u64> {
    match field {
        Some(Lenient::Is(n)) => Some(n),
        _ => None,
    }
}

/// Ollama's `/api/chat` and `/api/generate` final object: `prompt_eval_count` (absent
/// when the whole prompt came from its cache, so 0) and `eval_count`.
fn ollama_counts(
    eval: Option<Lenient<u64>>,
    prompt_eval: Option<Lenient<u64>>,
) -> Option<TokenCounts> {
    let completion = count(eval)?;
    let prompt = count(prompt_eval).unwrap_or(0);
    Some(TokenCounts {
        prompt_tokens: Some(prompt),
        completion_tokens: Some(completion),
        total_tokens: Some(prompt.saturating_add(completion)),
    })
}
