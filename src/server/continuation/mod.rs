//! A streamed chat answer whose worker died, finished on another worker: the client
//! thread's part (the dispatcher's is `dispatcher/continuation.rs`, the worker's
//! `worker/continuation.rs`).
//!
//! A request opts in (`X-Continue-On-Failure: true`, or `CONTINUE_ON_FAILURE=on` and not
//! `false`) and must be one whose answer can be continued from its text alone
//! ([`eligible`]): a streamed `/v1/chat/completions` (also what `/api/chat` becomes)
//! with one choice, no log probabilities and no response format or grammar (a
//! constrained answer would restart its grammar at the prefix), or a streamed
//! `/v1/messages` without extended thinking (its events are read by [`messages`]; the
//! rest of this documentation speaks of chat chunks). Its stream is watched
//! as it passes ([`Tracker`]): the content of every complete event that went to the
//! client is kept (bounded by [`MAX_PREFIX_BYTES`]), with the answer's `id`, `created`
//! and `model`. Nothing else is copied; requests that did not opt in have no tracker.
//!
//! When the dispatcher says the stream broke ([`Tracker::interrupted`]), the tracker
//! builds the same request with the text delivered as `continuation.prefix`, unless the
//! answer cannot be continued: a tool call under way, reasoning text, a finished answer,
//! an event it could not read, or too much text. Then the client gets today's error.
//!
//! The continuation's events are rewritten into the original answer's
//! ([`Tracker::pass`]): the same `id`, `created` and `model`, no second role chunk,
//! usage counting both parts. One SSE comment (`: continued on another worker`) marks
//! the switch, written with the continuation's first event (not on the NDJSON routes,
//! which have no comments). The unfinished event the dead worker left is dropped by
//! the relay's event boundary, so the client sees whole events only.
//!
//! Usage: the continuation's backend counts the delivered text as prompt. The tracker
//! counts the content deltas delivered before the switch (one token each on
//! llama-server, vLLM and Ollama) and moves that many tokens from prompt to completion;
//! the total stays what the backend said.

use std::borrow::Cow;
use std::sync::Arc;

use serde_json::{Map, Value};

use crate::protocol::continuation::Continuation;
use crate::protocol::{RequestMessage, ResponseComplete};

mod messages;
#[cfg(test)]
mod tests;

/// The most answer text kept for a continuation; a longer answer fails as before.
pub const MAX_PREFIX_BYTES: usize = 256 * 1024;
/// The longest event read; a longer one makes the answer not continuable (and, in a
/// continuation, is passed on unread).
const MAX_EVENT: usize = crate::server::relay::boundary::MAX_HELD;
/// The comment that marks where the continuation begins.
pub const MARKER: &str = ": continued on another worker\n\n";
/// The request header that opts in or out.
pub const HEADER: &str = "x-continue-on-failure";

/// The routes whose answers may be continued: OpenAI chat, and Anthropic's Messages.
pub const CHAT_ROUTE: &str = "/v1/chat/completions";
pub const MESSAGES_ROUTE: &str = "/v1/messages";

/// The continuable route a request's path names (as `'static`, for `Needs`).
pub fn route_of(path: &str) -> &'static str {
    if path == MESSAGES_ROUTE {
        MESSAGES_ROUTE
    } else {
        CHAT_ROUTE
    }
}

/// Whether a request may be continued: opted in (header, else the server's setting)
/// and of a kind whose answer goes on from its text.
pub fn eligible(
    header: Option<&str>,
    default_on: bool,
    path: &str,
    stream: bool,
    body: &str,
) -> bool {
    let wanted = match header.map(|v| v.trim().to_ascii_lowercase()) {
        Some(v) if v == "true" || v == "on" || v == "1" => true,
        Some(v) if v == "false" || v == "off" || v == "0" => false,
        _ => default_on,
    };
    let messages = path == MESSAGES_ROUTE;
    if !wanted || !stream || !(path == CHAT_ROUTE || messages) {
        return false;
    }
    let Ok(Value::Object(body)) = serde_json::from_str::<Value>(body) else {
        return false;
    };
    let absent_or =
        |key: &str, ok: &dyn Fn(&Value) -> bool| body.get(key).is_none_or(|v| v.is_null() || ok(v));
    absent_or("n", &|v| v.as_u64() == Some(1))
        && absent_or("logprobs", &|v| v == &Value::Bool(false))
        && absent_or("top_logprobs", &|_| false)
        && absent_or("response_format", &|v| v["type"] == "text")
        && absent_or("grammar", &|_| false)
        && absent_or("json_schema", &|_| false)
        // Thinking cannot be prefilled (the continuation would think again in the
        // middle of the text), and structured output restarts like a grammar.
        && (!messages
            || absent_or("thinking", &|v| v["type"] == "disabled")
                && absent_or("output_format", &|_| false))
        && body.get("messages").is_some_and(Value::is_array)
}

/// The API whose stream is watched.
#[derive(Debug)]
enum Dialect {
    /// OpenAI chat chunks; the answer's `id`, `created`, `model`, which a
    /// continuation's chunks are given.
    Chat { ids: Map<String, Value> },
    /// Anthropic Messages events ([`messages`]).
    Messages(messages::Blocks),
}

/// Where the stream stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// The first worker's answer passes unchanged.
    Original,
    /// A continuation's events are rewritten; `marked` once the marker went out.
    Continuing { marked: bool },
}

/// The watch over one continuable stream; see the module documentation.
#[derive(Debug)]
pub struct Tracker {
    original: Arc<RequestMessage>,
    /// Write the marker comment (SSE clients; not the NDJSON routes).
    marker: bool,
    phase: Phase,
    /// The start of an event whose end has not arrived.
    partial: String,
    /// The answer's text the client received.
    text: String,
    /// Content deltas the client received (an estimate of the completion tokens).
    parts: u64,
    /// Deltas received before the current continuation began.
    parts_before: u64,
    dialect: Dialect,
    /// Why the answer can no longer be continued, once that is so.
    why_not: Option<&'static str>,
}

impl Tracker {
    pub fn new(original: Arc<RequestMessage>, marker: bool) -> Tracker {
        let dialect = if original.endpoint_path == MESSAGES_ROUTE {
            Dialect::Messages(messages::Blocks::default())
        } else {
            Dialect::Chat { ids: Map::new() }
        };
        Tracker {
            dialect,
            original,
            marker,
            phase: Phase::Original,
            partial: String::new(),
            text: String::new(),
            parts: 0,
            parts_before: 0,
            why_not: None,
        }
    }

    /// A piece of the stream from a worker → what goes on to the client: complete
    /// events only (the start of an unfinished one waits here, so nothing downstream,
    /// the Ollama reshaping included, ever holds part of an event a dead worker left);
    /// the original answer's as they came (they are only read), a continuation's
    /// rewritten. Once the answer cannot be continued, everything passes as it comes.
    pub fn pass<'a>(&mut self, chunk: &'a str) -> Cow<'a, str> {
        if self.phase == Phase::Original && self.why_not.is_some() && self.partial.is_empty() {
            return Cow::Borrowed(chunk);
        }
        let mut out = String::new();
        for event in self.split(chunk) {
            match self.phase {
                Phase::Original => {
                    if self.why_not.is_none() {
                        self.observe(&event);
                    }
                    out.push_str(&event);
                }
                Phase::Continuing { .. } => {
                    if let Some(event) = self.rewrite(&event) {
                        out.push_str(&event);
                    }
                }
            }
        }
        if self.partial.len() > MAX_EVENT
            || (self.phase == Phase::Original && self.why_not.is_some())
        {
            // Not an event this module can read: it passes as it comes.
            self.not_continuable("an event too long to read");
            out.push_str(&std::mem::take(&mut self.partial));
        }
        if let Phase::Continuing { marked: false } = self.phase {
            if !out.is_empty() {
                self.phase = Phase::Continuing { marked: true };
                if self.marker {
                    out.insert_str(0, MARKER);
                }
            }
        }
        Cow::Owned(out)
    }

    /// The normal end of the stream: the start of an unfinished last event, as it came.
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.partial)
    }

    /// The stream broke: the request that goes on from the text delivered, or why not.
    /// The unfinished event of the stream that broke is forgotten (the relay's event
    /// boundary drops it too).
    pub fn interrupted(&mut self) -> Result<Arc<RequestMessage>, &'static str> {
        self.partial.clear();
        if let Some(why) = self.why_not {
            return Err(why);
        }
        let mut msg = (*self.original).clone();
        msg.continuation = Some(Continuation {
            prefix: self.text.clone(),
            tokens: self.parts,
        });
        self.parts_before = self.parts;
        self.phase = Phase::Continuing { marked: false };
        if let Dialect::Messages(blocks) = &mut self.dialect {
            blocks.restart();
        }
        Ok(Arc::new(msg))
    }

    /// The usage a continuation's final message reports, counting both parts.
    pub fn fix_usage(&self, rc: &mut ResponseComplete) {
        if let (Phase::Continuing { .. }, Some(counts)) = (self.phase, &mut rc.token_counts) {
            let moved = self.parts_before;
            counts.prompt_tokens = counts.prompt_tokens.map(|p| p.saturating_sub(moved));
            counts.completion_tokens = counts.completion_tokens.map(|c| c.saturating_add(moved));
        }
    }

    /// Whether a continuation is under way (its events are rewritten).
    pub fn continuing(&self) -> bool {
        matches!(self.phase, Phase::Continuing { .. })
    }

    /// The complete events `chunk` ends, with what came before them; the start of an
    /// unfinished one is kept. An event ends with a blank line (`\n\n` or `\r\n\r\n`,
    /// what backends write).
    fn split(&mut self, chunk: &str) -> Vec<String> {
        self.partial.push_str(chunk);
        let mut events = Vec::new();
        while let Some(end) = event_end(&self.partial) {
            let rest = self.partial.split_off(end);
            events.push(std::mem::replace(&mut self.partial, rest));
        }
        events
    }

    fn not_continuable(&mut self, why: &'static str) {
        self.why_not.get_or_insert(why);
        self.text = String::new();
    }

    /// Reads one complete event of the answer the client receives. The Messages
    /// dialect reads every event (it follows the client's content blocks to rewrite a
    /// continuation's), also once the answer cannot be continued.
    fn observe(&mut self, event: &str) {
        let Some(data) = data_of(event) else {
            return;
        };
        let read = if data.trim() == "[DONE]" {
            Err("the answer is complete")
        } else if let Ok(Value::Object(chunk)) = serde_json::from_str::<Value>(&data) {
            let read = match &mut self.dialect {
                Dialect::Chat { ids } => read_chat(ids, &chunk),
                Dialect::Messages(blocks) => blocks.read(&chunk),
            };
            read.map(|text| text.map(String::from))
        } else {
            Err("an event that is not a JSON object")
        };
        if self.why_not.is_some() {
            return;
        }
        match read {
            Err(why) => self.not_continuable(why),
            Ok(Some(text)) if !text.is_empty() => {
                if self.text.len() + text.len() > MAX_PREFIX_BYTES {
                    return self.not_continuable("too much text to continue from");
                }
                self.text.push_str(&text);
                self.parts += 1;
            }
            Ok(_) => {}
        }
    }

    /// One event of a continuation, in the original answer's terms (`None`: dropped).
    /// Its text counts as delivered: a second interruption goes on from all of it.
    fn rewrite(&mut self, event: &str) -> Option<String> {
        let Some(data) = data_of(event) else {
            return Some(event.to_string());
        };
        let Ok(Value::Object(chunk)) = serde_json::from_str::<Value>(&data) else {
            return Some(event.to_string()); // `[DONE]`, or not ours to read
        };
        let lines = match &mut self.dialect {
            Dialect::Chat { ids } => rewrite_chat(ids, chunk, self.parts_before)
                .map(|chunk| format!("data: {chunk}\n\n"))
                .into_iter()
                .collect(),
            Dialect::Messages(blocks) => blocks.rewrite(chunk, self.parts_before),
        };
        let mut out = String::new();
        for line in lines {
            self.observe(&line);
            out.push_str(&line);
        }
        (!out.is_empty()).then_some(out)
    }
}

/// Reads one chat chunk the client receives: the text it adds, or why the answer can
/// no longer be continued. The first chunk's `id`, `created` and `model` are kept.
fn read_chat<'a>(
    ids: &mut Map<String, Value>,
    chunk: &'a Map<String, Value>,
) -> Result<Option<&'a str>, &'static str> {
    if chunk.contains_key("error") {
        return Err("the backend reported an error");
    }
    if ids.is_empty() {
        for key in ["id", "created", "model"] {
            if let Some(v) = chunk.get(key) {
                ids.insert(key.into(), v.clone());
            }
        }
    }
    let Some(choices) = chunk.get("choices").and_then(Value::as_array) else {
        return Ok(None); // a usage-only chunk
    };
    if choices.len() > 1
        || choices
            .iter()
            .any(|c| c["index"].as_u64().unwrap_or(0) != 0)
    {
        return Err("several choices");
    }
    let Some(choice) = choices.first() else {
        return Ok(None);
    };
    if !choice["finish_reason"].is_null() {
        return Err("the answer is complete");
    }
    let delta = &choice["delta"];
    if delta.get("tool_calls").is_some_and(|t| !t.is_null()) {
        return Err("a tool call under way");
    }
    if delta.get("reasoning_content").is_some_and(|t| !t.is_null()) {
        return Err("reasoning text");
    }
    Ok(delta["content"].as_str())
}

/// One chunk of a continuation in the original answer's terms (`None`: dropped): its
/// ids, usage counting both parts, no second role.
fn rewrite_chat(
    ids: &Map<String, Value>,
    mut chunk: Map<String, Value>,
    moved: u64,
) -> Option<Value> {
    for (key, value) in ids {
        if chunk.contains_key(key) {
            chunk.insert(key.clone(), value.clone());
        }
    }
    if let Some(Value::Object(usage)) = chunk.get_mut("usage") {
        move_tokens(usage, ["prompt_tokens", "completion_tokens"], moved);
    }
    (!drop_role(&mut chunk)).then_some(Value::Object(chunk))
}

/// Usage counting both parts: the continuation's backend counted the `moved` tokens
/// delivered before as prompt (`keys[0]`); they were completion (`keys[1]`).
fn move_tokens(usage: &mut Map<String, Value>, keys: [&str; 2], moved: u64) {
    let [prompt, completion] = keys;
    if let Some(p) = usage.get(prompt).and_then(Value::as_u64) {
        usage.insert(prompt.into(), p.saturating_sub(moved).into());
    }
    if let Some(c) = usage.get(completion).and_then(Value::as_u64) {
        usage.insert(completion.into(), c.saturating_add(moved).into());
    }
}

/// Removes the `role` of a continuation's deltas (the client had its role chunk);
/// true when the chunk then says nothing at all (the usual role-only first chunk).
fn drop_role(chunk: &mut Map<String, Value>) -> bool {
    let Some(Value::Array(choices)) = chunk.get_mut("choices") else {
        return false;
    };
    let mut had_role = false;
    let mut empty = true;
    for choice in choices.iter_mut() {
        if let Some(Value::Object(delta)) = choice.get_mut("delta") {
            had_role |= delta.remove("role").is_some();
            let says_something = delta.values().any(|v| match v {
                Value::Null => false,
                Value::String(s) => !s.is_empty(),
                _ => true,
            });
            empty &= !says_something;
        }
        empty &= choice.get("finish_reason").is_none_or(Value::is_null);
    }
    let usage = chunk.get("usage").is_some_and(|u| !u.is_null());
    had_role && empty && !usage
}

/// Where the first complete event in `text` ends.
fn event_end(text: &str) -> Option<usize> {
    let lf = text.find("\n\n").map(|i| i + 2);
    let crlf = text.find("\r\n\r\n").map(|i| i + 4);
    match (lf, crlf) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

/// The data of an SSE event (its `data:` lines joined), or `None` for one without.
fn data_of(event: &str) -> Option<String> {
    let mut data: Option<String> = None;
    for line in event.lines() {
        if let Some(value) = line.strip_prefix("data:") {
            let value = value.strip_prefix(' ').unwrap_or(value);
            match &mut data {
                Some(d) => {
                    d.push('\n');
                    d.push_str(value);
                }
                None => data = Some(value.to_string()),
            }
        }
    }
    data
}
