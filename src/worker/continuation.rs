//! The worker's side of a continuation (`request.continuation`, see
//! `protocol::continuation`): the backend's body built from the original request and
//! the text already delivered, the way this backend's kind wants it.
//!
//! | kind | body | answer |
//! |---|---|---|
//! | llama-server | the text as a trailing assistant message (a prefill; needs `--jinja`) | begins with the prefill again: [`Echo`] takes it off |
//! | vLLM | the same, plus `continue_final_message: true`, `add_generation_prompt: false` | the new text only |
//! | Ollama | the text as a trailing assistant message (a prefill) | the new text only |
//! | openai (or not known yet) | refused: what such a backend does with it is not known | |
//!
//! On `/v1/messages` (Anthropic's format, which the backend serves itself) the same
//! trailing assistant message is Anthropic's own prefill; llama-server and Ollama go on
//! from it. vLLM's Anthropic endpoint has no `continue_final_message` and would start
//! a new turn: refused there (`protocol::continuation::continues_on`).
//!
//! A client's own prefill (its last message already the assistant's) gets the text
//! appended instead of a second assistant message (to its last text part when its
//! content is a list). A refusal is reported retryable: nothing reached the backend,
//! another worker may take it.
//!
//! llama-server answers a prefill with the prefill text first, then the new text (in
//! chat chunks and in Anthropic `text_delta`s alike). A
//! llama-server whose template is not jinja ignores the prefill and starts a new turn,
//! which would splice two answers; [`Echo`] therefore holds the answer back until the
//! echo matched the text, and refuses the request if it did not.

use std::sync::Arc;

use serde_json::{json, Value};

use super::backend_kind::Kind;
use crate::protocol::continuation::{continues_on, Continuation};
use crate::protocol::{RequestMessage, WorkerMessage};

/// The request to run: `req` itself, or for a continuation the same with the body
/// this backend needs. `Err` says why it cannot be continued here.
pub fn prepare(
    req: &Arc<RequestMessage>,
    kind: Option<Kind>,
) -> Result<Arc<RequestMessage>, String> {
    let Some(continuation) = &req.continuation else {
        return Ok(req.clone());
    };
    let kind = kind
        .filter(|k| continues_on(k.as_str(), &req.endpoint_path))
        .ok_or_else(|| {
            format!(
                "this worker's backend ({}) cannot continue an answer on this route",
                kind.map_or("kind not known yet", Kind::as_str)
            )
        })?;
    let body = backend_body(kind, &req.body, continuation)?;
    let mut msg = (**req).clone();
    msg.body = Arc::from(body);
    Ok(Arc::new(msg))
}

/// The backend body that goes on from the text delivered (see the module table). The
/// token limit is what the first part left of it (at least one token).
pub fn backend_body(kind: Kind, body: &str, delivered: &Continuation) -> Result<String, String> {
    let prefix = delivered.prefix.as_str();
    let mut body: Value =
        serde_json::from_str(body).map_err(|_| "the request body is not JSON".to_string())?;
    let Some(object) = body.as_object_mut() else {
        return Err("the request body is not a JSON object".into());
    };
    let Some(messages) = object.get_mut("messages").and_then(Value::as_array_mut) else {
        return Err("the request has no messages".into());
    };
    let own = messages
        .last_mut()
        .filter(|last| last["role"] == "assistant")
        .and_then(|last| last.get_mut("content"));
    match own {
        Some(Value::String(text)) => text.push_str(prefix),
        Some(Value::Array(parts)) => match parts.last_mut() {
            Some(part) if part["type"] == "text" && part["text"].is_string() => {
                let text = format!("{}{prefix}", part["text"].as_str().unwrap_or(""));
                part["text"] = Value::String(text);
            }
            _ => parts.push(json!({"type": "text", "text": prefix})),
        },
        _ => messages.push(json!({"role": "assistant", "content": prefix})),
    }
    for limit in ["max_tokens", "max_completion_tokens"] {
        if let Some(n) = object.get(limit).and_then(Value::as_u64) {
            let left = n.saturating_sub(delivered.tokens).max(1);
            object.insert(limit.into(), left.into());
        }
    }
    if kind == Kind::Vllm {
        object.insert("continue_final_message".into(), Value::Bool(true));
        object.insert("add_generation_prompt".into(), Value::Bool(false));
    }
    Ok(body.to_string())
}

/// Takes llama-server's echo of the prefill off the start of its answer (see the
/// module docs).
#[derive(Debug)]
pub struct Echo {
    /// The echo still expected.
    rest: String,
    /// The start of an event whose end has not arrived.
    partial: String,
    state: State,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Expecting,
    Passing,
    Refused,
}

impl Echo {
    /// The filter a request needs: a continuation on llama-server with some text.
    pub fn for_request(req: &RequestMessage, kind: Option<Kind>) -> Option<Echo> {
        let prefix = &req.continuation.as_ref()?.prefix;
        (kind == Some(Kind::LlamaServer) && !prefix.is_empty()).then(|| Echo {
            rest: prefix.clone(),
            partial: String::new(),
            state: State::Expecting,
        })
    }

    /// Whether the backend did not echo the prefill (it did not continue): the request
    /// is to be refused, and nothing of its answer went out.
    pub fn refused(&self) -> bool {
        self.state == State::Refused
    }

    /// A message on its way to the server → what goes instead (`None`: nothing).
    pub fn filter(&mut self, msg: WorkerMessage) -> Option<WorkerMessage> {
        match (self.state, msg) {
            (State::Passing, msg) => Some(msg),
            (State::Refused, _) => None,
            (State::Expecting, WorkerMessage::ResponseChunk { request_id, chunk }) => {
                self.partial.push_str(&chunk);
                let mut out = String::new();
                while let Some(end) = self.partial.find("\n\n").map(|i| i + 2) {
                    let rest = self.partial.split_off(end);
                    let event = std::mem::replace(&mut self.partial, rest);
                    if self.state == State::Passing {
                        out.push_str(&event);
                    } else if let Some(event) = self.event(&event) {
                        out.push_str(&event);
                    }
                    if self.state == State::Refused {
                        return None;
                    }
                }
                if self.state == State::Passing {
                    out.push_str(&std::mem::take(&mut self.partial));
                }
                (!out.is_empty()).then_some(WorkerMessage::ResponseChunk {
                    request_id,
                    chunk: out,
                })
            }
            (State::Expecting, WorkerMessage::ResponseComplete(rc)) => {
                // The answer ended inside the echo: the backend did not go on.
                self.state = State::Refused;
                drop(rc);
                None
            }
            (State::Expecting, msg) => Some(msg),
        }
    }

    /// One event while the echo is expected.
    fn event(&mut self, event: &str) -> Option<String> {
        let Some(mut chunk) = data_json(event) else {
            return Some(event.to_string());
        };
        let Some(content) = text_slot(&mut chunk) else {
            return Some(event.to_string()); // the role chunk, `message_start`...
        };
        let Some(text) = content.as_str().filter(|t| !t.is_empty()) else {
            return Some(event.to_string());
        };
        if self.rest.starts_with(text) {
            self.rest.drain(..text.len());
            if self.rest.is_empty() {
                self.state = State::Passing;
            }
            return None;
        }
        match text.strip_prefix(self.rest.as_str()) {
            Some(new) => {
                *content = Value::String(new.to_string());
                self.rest.clear();
                self.state = State::Passing;
                Some(with_data(event, &chunk))
            }
            None => {
                self.state = State::Refused;
                None
            }
        }
    }
}

/// The JSON of an SSE event's `data:` lines, when it is JSON.
fn data_json(event: &str) -> Option<Value> {
    serde_json::from_str(&super::stream_usage::event_data(event)?).ok()
}

/// Where an event carries the answer's text: a chat chunk's `choices[0].delta.content`,
/// an Anthropic `content_block_delta`'s `text_delta`.
fn text_slot(chunk: &mut Value) -> Option<&mut Value> {
    if chunk.get("type").and_then(Value::as_str) == Some("content_block_delta") {
        let delta = chunk.get_mut("delta")?;
        if delta.get("type").and_then(Value::as_str) != Some("text_delta") {
            return None;
        }
        return delta.get_mut("text");
    }
    chunk
        .get_mut("choices")?
        .get_mut(0)?
        .get_mut("delta")?
        .get_mut("content")
}

/// `event` with `chunk` as its data; its other lines (Anthropic's `event:`) kept.
fn with_data(event: &str, chunk: &Value) -> String {
    let mut out = String::new();
    for line in event.lines() {
        if !line.is_empty() && !line.starts_with("data:") {
            out.push_str(line);
            out.push('\n');
        }
    }
    out.push_str(&format!("data: {chunk}\n\n"));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn text(prefix: &str) -> Continuation {
        Continuation {
            prefix: prefix.into(),
            tokens: 3,
        }
    }

    fn body() -> &'static str {
        r#"{"model":"m","stream":true,"messages":[{"role":"user","content":"hi"}]}"#
    }

    #[test]
    fn each_kind_gets_its_body() {
        let llama: Value =
            serde_json::from_str(&backend_body(Kind::LlamaServer, body(), &text("Hel")).unwrap())
                .unwrap();
        assert_eq!(
            llama["messages"][1],
            json!({"role": "assistant", "content": "Hel"})
        );
        assert!(llama.get("continue_final_message").is_none());
        let vllm: Value =
            serde_json::from_str(&backend_body(Kind::Vllm, body(), &text("Hel")).unwrap()).unwrap();
        assert_eq!(vllm["continue_final_message"], true);
        assert_eq!(vllm["add_generation_prompt"], false);
        let own = r#"{"max_tokens":10,"max_completion_tokens":2,
            "messages":[{"role":"user","content":"hi"},{"role":"assistant","content":"A: "}]}"#;
        let own: Value =
            serde_json::from_str(&backend_body(Kind::Ollama, own, &text("yes")).unwrap()).unwrap();
        assert_eq!(own["messages"].as_array().unwrap().len(), 2);
        assert_eq!(own["messages"][1]["content"], "A: yes");
        // What the first part used is off the limit (at least one token is left).
        assert_eq!(
            (
                own["max_tokens"].as_u64(),
                own["max_completion_tokens"].as_u64()
            ),
            (Some(7), Some(1))
        );
        assert!(backend_body(Kind::Ollama, "[1]", &text("x")).is_err());
        let req = Arc::new(RequestMessage {
            request_id: "r".into(),
            model: "m".into(),
            endpoint_path: "/v1/chat/completions".into(),
            is_streaming: true,
            body: Arc::from(body()),
            headers: Default::default(),
            body_encoding: None,
            continuation: Some(text("x")),
            held: None,
        });
        assert!(prepare(&req, Some(Kind::OpenAi)).is_err());
        assert!(prepare(&req, None).is_err());
        assert!(prepare(&req, Some(Kind::LlamaServer)).is_ok());
        // On `/v1/messages` vLLM would start a new turn: refused there.
        let messages = Arc::new(RequestMessage {
            endpoint_path: "/v1/messages".into(),
            ..(*req).clone()
        });
        assert!(prepare(&messages, Some(Kind::Vllm)).is_err());
        for kind in [Kind::LlamaServer, Kind::Ollama] {
            let sent = prepare(&messages, Some(kind)).unwrap();
            let sent: Value = serde_json::from_str(&sent.body).unwrap();
            assert_eq!(
                sent["messages"][1],
                json!({"role": "assistant", "content": "x"})
            );
            assert!(sent.get("continue_final_message").is_none());
        }
    }

    #[test]
    fn a_prefill_in_content_blocks_gets_the_text_in_its_last_text_block() {
        let body = r#"{"max_tokens":10,"messages":[{"role":"user","content":"hi"},
            {"role":"assistant","content":[{"type":"text","text":"A: "}]}]}"#;
        let sent: Value =
            serde_json::from_str(&backend_body(Kind::LlamaServer, body, &text("yes")).unwrap())
                .unwrap();
        assert_eq!(
            sent["messages"][1]["content"],
            json!([{"type": "text", "text": "A: yes"}])
        );
        let body = r#"{"messages":[{"role":"assistant","content":[{"type":"image"}]}]}"#;
        let sent: Value =
            serde_json::from_str(&backend_body(Kind::Ollama, body, &text("yes")).unwrap()).unwrap();
        assert_eq!(
            sent["messages"][0]["content"][1],
            json!({"type": "text", "text": "yes"})
        );
    }

    fn chunk(text: &str) -> WorkerMessage {
        WorkerMessage::ResponseChunk {
            request_id: "r".into(),
            chunk: text.into(),
        }
    }

    fn content(text: &str) -> String {
        format!(
            "data: {}\n\n",
            json!({"choices": [{"index": 0, "delta": {"content": text}}]})
        )
    }

    fn echo(prefix: &str) -> Echo {
        Echo {
            rest: prefix.into(),
            partial: String::new(),
            state: State::Expecting,
        }
    }

    fn text_of(msg: Option<WorkerMessage>) -> String {
        match msg {
            Some(WorkerMessage::ResponseChunk { chunk, .. }) => chunk,
            None => String::new(),
            Some(other) => panic!("unexpected {other:?}"),
        }
    }

    #[test]
    fn the_echo_is_taken_off_across_events_and_splits() {
        let mut e = echo("The sea");
        let role =
            "data: {\"choices\":[{\"delta\":{\"role\":\"assistant\",\"content\":null}}]}\n\n";
        assert_eq!(text_of(e.filter(chunk(role))), role);
        let first = content("The ");
        let (a, b) = first.split_at(10);
        assert_eq!(text_of(e.filter(chunk(a))), "");
        assert_eq!(text_of(e.filter(chunk(b))), "");
        assert_eq!(text_of(e.filter(chunk(&content("sea is")))), content(" is"));
        assert_eq!(
            text_of(e.filter(chunk(&content(" blue")))),
            content(" blue")
        );
        assert!(!e.refused());
    }

    fn anthropic(text: &str) -> String {
        let data = json!({"type": "content_block_delta", "index": 0,
            "delta": {"type": "text_delta", "text": text}});
        format!("event: content_block_delta\ndata: {data}\n\n")
    }

    #[test]
    fn the_echo_is_taken_off_anthropic_text_deltas() {
        let mut e = echo("The salty");
        let start = "event: message_start\ndata: {\"type\":\"message_start\",\"message\":{}}\n\n\
            event: content_block_start\ndata: {\"type\":\"content_block_start\",\"index\":0,\
            \"content_block\":{\"type\":\"text\",\"text\":\"\"}}\n\n";
        assert_eq!(text_of(e.filter(chunk(start))), start);
        // llama-server: the prefill and the first new token in one delta.
        assert_eq!(
            text_of(e.filter(chunk(&anthropic("The salty sea")))),
            anthropic(" sea")
        );
        assert_eq!(
            text_of(e.filter(chunk(&anthropic(" is")))),
            anthropic(" is")
        );
        let mut other = echo("The salty");
        assert_eq!(text_of(other.filter(chunk(&anthropic("Once")))), "");
        assert!(other.refused());
    }

    #[test]
    fn events_without_text_pass_while_the_echo_is_expected() {
        // A usage-only chunk (no choice), an error object, a ping: no text, no panic.
        let mut e = echo("The sea");
        for event in [
            "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":1}}\n\n",
            "data: {\"error\":{\"message\":\"x\"}}\n\n",
            "data: [1,2]\n\n",
            "event: ping\ndata: {\"type\":\"ping\"}\n\n",
        ] {
            assert_eq!(text_of(e.filter(chunk(event))), event);
        }
        assert!(!e.refused());
    }

    #[test]
    fn an_answer_without_the_echo_is_refused_whole() {
        let mut e = echo("The sea");
        assert_eq!(text_of(e.filter(chunk(&content("Once")))), "");
        assert!(e.refused());
        assert_eq!(text_of(e.filter(chunk(&content(" upon")))), "");
        let mut short = echo("The sea");
        assert_eq!(text_of(short.filter(chunk(&content("The")))), "");
        let done = WorkerMessage::ResponseComplete(Default::default());
        assert!(short.filter(done).is_none());
        assert!(short.refused());
    }
}
