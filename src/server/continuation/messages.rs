//! The Anthropic Messages stream (`/v1/messages`) of a continuable answer: what its
//! events say ([`Blocks::read`]) and a continuation's events in the original answer's
//! terms ([`Blocks::rewrite`]).
//!
//! The answer is continuable while its one text block is open: every `text_delta` of
//! it is the answer's text. A tool use, thinking, any other block or delta, the text
//! block's end, `message_delta`, `message_stop` or an `error` end the chance (the client
//! then gets today's error).
//!
//! A continuation's stream starts again with `message_start` and its own content
//! blocks from index 0. The client had the answer's start (its `id`, `model`, input
//! usage): the continuation's `message_start` is dropped. Its first text block goes
//! into the client's open one (its `content_block_start` dropped, its deltas and stop
//! given that index), so the text deltas go on in the same block; any later block gets
//! the client's next index. A thinking block while the client's text block is open is
//! dropped whole (thinking cannot go in the middle of the text). Should the
//! continuation start another kind of block or end the message while the client's
//! text block is open, that block is stopped first, so the stream stays well formed.
//! The final `message_delta`'s usage counts both parts.

use serde_json::{json, Map, Value};

use super::move_tokens;

/// Why the answer cannot be continued after a tool use began.
const TOOL_USE: &str = "a tool call under way";
/// ... after thinking.
const THINKING: &str = "thinking";

/// The client's content blocks, followed through every event it receives; and the
/// current continuation's blocks mapped onto them.
#[derive(Debug, Default)]
pub(super) struct Blocks {
    /// The client's block still open: its index, and whether it is text.
    open: Option<(u64, bool)>,
    /// The index the client's next block gets.
    next: u64,
    /// The current continuation's block indexes → the client's (`None`: dropped).
    map: Vec<(u64, Option<u64>)>,
    /// The continuation's first text block went into the client's open one.
    joined: bool,
}

impl Blocks {
    /// A continuation begins: its blocks are numbered from 0 again.
    pub(super) fn restart(&mut self) {
        self.map.clear();
        self.joined = false;
    }

    /// One event the client receives: the answer's text it adds, or why the answer
    /// can no longer be continued.
    pub(super) fn read<'a>(
        &mut self,
        event: &'a Map<String, Value>,
    ) -> Result<Option<&'a str>, &'static str> {
        let index = event.get("index").and_then(Value::as_u64);
        let kind_of = |v: Option<&'a Value>| v.and_then(|b| b.get("type")?.as_str());
        match event.get("type").and_then(Value::as_str) {
            Some("content_block_start") => {
                let Some(i) = index else {
                    return Err("a content block without an index");
                };
                let block = event.get("content_block");
                let kind = kind_of(block).unwrap_or("");
                self.open = Some((i, kind == "text"));
                self.next = self.next.max(i.saturating_add(1));
                match kind {
                    "text" => Ok(block.and_then(|b| b.get("text")?.as_str())),
                    "tool_use" | "server_tool_use" => Err(TOOL_USE),
                    "thinking" | "redacted_thinking" => Err(THINKING),
                    _ => Err("a content block that is not text"),
                }
            }
            Some("content_block_delta") => {
                let delta = event.get("delta");
                match kind_of(delta) {
                    Some("text_delta") if index.is_some() && self.open == index.zip(Some(true)) => {
                        Ok(delta.and_then(|d| d.get("text")?.as_str()))
                    }
                    Some("input_json_delta") => Err(TOOL_USE),
                    Some("thinking_delta" | "signature_delta") => Err(THINKING),
                    _ => Err("a delta that is not the open block's text"),
                }
            }
            Some("content_block_stop") => {
                if index.is_some() && self.open.map(|(i, _)| i) == index {
                    self.open = None;
                }
                Err("the text block ended")
            }
            Some("message_delta" | "message_stop") => Err("the answer is complete"),
            Some("error") => Err("the backend reported an error"),
            // `message_start`, `ping`, and whatever a later version adds.
            _ => Ok(None),
        }
    }

    /// One event of a continuation → the events the client gets instead (see the
    /// module documentation); `moved`: the tokens delivered before it.
    pub(super) fn rewrite(&mut self, mut event: Map<String, Value>, moved: u64) -> Vec<String> {
        let index = event.get("index").and_then(Value::as_u64);
        let kind = event
            .get("type")
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_string();
        let mut out = Vec::new();
        match kind.as_str() {
            "message_start" => {}
            "content_block_start" => {
                let Some(j) = index else {
                    out.push(line(event));
                    return out;
                };
                let block = event.get("content_block");
                let block_kind = block.and_then(|b| b.get("type")?.as_str()).unwrap_or("");
                let thinking = matches!(block_kind, "thinking" | "redacted_thinking");
                match self.open {
                    Some((t, true)) if block_kind == "text" && !self.joined => {
                        self.joined = true;
                        self.map.push((j, Some(t)));
                        let text = block.and_then(|b| b.get("text")?.as_str()).unwrap_or("");
                        if !text.is_empty() {
                            out.push(text_delta(t, text));
                        }
                    }
                    Some((_, true)) if thinking => self.map.push((j, None)),
                    _ => {
                        self.close_open(&mut out);
                        self.map.push((j, Some(self.next)));
                        event.insert("index".into(), self.next.into());
                        out.push(line(event));
                    }
                }
            }
            "content_block_delta" | "content_block_stop" => {
                match self.map.iter().find(|(j, _)| Some(*j) == index) {
                    Some((_, None)) => {}
                    Some((_, Some(k))) => {
                        event.insert("index".into(), (*k).into());
                        out.push(line(event));
                    }
                    None => out.push(line(event)),
                }
            }
            "message_delta" | "message_stop" => {
                self.close_open(&mut out);
                if let Some(Value::Object(usage)) = event.get_mut("usage") {
                    move_tokens(usage, ["input_tokens", "output_tokens"], moved);
                }
                out.push(line(event));
            }
            _ => out.push(line(event)),
        }
        out
    }

    /// Stops the client's open block before another begins or the message ends. It
    /// can only be the text block the continuation was to go on in.
    fn close_open(&mut self, out: &mut Vec<String>) {
        if let Some((i, _)) = self.open {
            let mut stop = Map::new();
            stop.insert("type".into(), "content_block_stop".into());
            stop.insert("index".into(), i.into());
            out.push(line(stop));
            // What the client then has (`read` says the same when it sees the stop).
            self.open = None;
        }
    }
}

/// An event as Anthropic writes it: its type as the SSE event name.
fn line(event: Map<String, Value>) -> String {
    let name = event
        .get("type")
        .and_then(Value::as_str)
        .unwrap_or("message")
        .to_string();
    let name: String = name.chars().filter(|c| !c.is_control()).collect();
    format!("event: {name}\ndata: {}\n\n", Value::Object(event))
}

/// A `text_delta` of block `index`.
fn text_delta(index: u64, text: &str) -> String {
    let mut event = Map::new();
    event.insert("type".into(), "content_block_delta".into());
    event.insert("index".into(), index.into());
    event.insert("delta".into(), json!({"type": "text_delta", "text": text}));
    line(event)
}
