//! Ollama requests → the OpenAI request a worker forwards.

use super::*;

/// The OpenAI request to forward.
#[derive(Debug, Clone, PartialEq)]
pub struct Translated {
    pub path: &'static str,
    pub body: String,
    pub model: String,
    pub stream: bool,
}

/// Translates an Ollama request body into the OpenAI request to forward.
///
/// Call [`preload`] first: a request with nothing to generate gets Ollama's load
/// answer, which backends cannot give.
pub fn request(endpoint: Endpoint, body: &[u8]) -> Result<Translated, OllamaError> {
    let req = parse_request(body)?;
    let model = required_model(&req)?;
    match endpoint {
        Endpoint::Chat => chat_request(&req, model),
        Endpoint::Generate => generate_request(&req, model),
        Endpoint::Embed => embed_request(&req, model),
        Endpoint::LegacyEmbeddings => legacy_embeddings_request(&req, model),
    }
}

/// Ollama's answer when the request only asks to load (or, with `keep_alive: 0`,
/// unload) the model: chat without messages, generate with an empty prompt and no
/// images, embed without input. `None` when there is something to generate (or the
/// body is invalid; [`request`] reports that). The answer is one JSON object without
/// a trailing newline, the same whether or not the client asked to stream.
pub fn preload(endpoint: Endpoint, body: &[u8], now_unix_ms: u64) -> Option<String> {
    let req = parse_request(body).ok()?;
    let model = required_model(&req).ok()?;
    let nothing_to_generate = match endpoint {
        Endpoint::Chat => is_empty(req.get("messages")),
        Endpoint::Generate => is_empty(req.get("prompt")) && is_empty(req.get("images")),
        Endpoint::Embed => is_empty(req.get("input")),
        Endpoint::LegacyEmbeddings => is_empty(req.get("prompt")),
    };
    if !nothing_to_generate {
        return None;
    }
    let reason = if keep_alive_is_zero(req.get("keep_alive")) {
        "unload"
    } else {
        "load"
    };
    let end = End {
        done_reason: reason.to_string(),
        metrics: None,
    };
    Some(match endpoint {
        Endpoint::Chat | Endpoint::Generate => {
            render(endpoint, &model, now_unix_ms, Piece::default(), Some(end))
        }
        Endpoint::Embed => json!({ "model": model, "embeddings": [] }).to_string(),
        Endpoint::LegacyEmbeddings => json!({ "embedding": [] }).to_string(),
    })
}

/// Absent, null, `""` and `[]` all mean "nothing to generate" to Ollama.
fn is_empty(value: Option<&Value>) -> bool {
    match value {
        None | Some(Value::Null) => true,
        Some(Value::String(s)) => s.is_empty(),
        Some(Value::Array(a)) => a.is_empty(),
        Some(_) => false,
    }
}

/// `keep_alive` of `0`, `"0"`, `"0s"`, `"0m"`...: the client asks to unload.
fn keep_alive_is_zero(value: Option<&Value>) -> bool {
    match value {
        Some(Value::Number(n)) => n.as_f64() == Some(0.0),
        Some(Value::String(s)) => {
            let number = s.trim().trim_end_matches(|c: char| c.is_ascii_alphabetic());
            number.parse::<f64>().ok() == Some(0.0)
        }
        _ => false,
    }
}

/// The request body as a JSON object; Ollama answers 400 to anything else.
fn parse_request(body: &[u8]) -> Result<Map<String, Value>, OllamaError> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Err(OllamaError::bad_request("missing request body"));
    }
    match serde_json::from_slice::<Value>(body) {
        Ok(Value::Object(map)) => Ok(map),
        Ok(_) => Err(OllamaError::bad_request(
            "request body must be a JSON object",
        )),
        Err(e) => Err(OllamaError::bad_request(format!("invalid JSON: {e}"))),
    }
}

/// `model` is the one field every endpoint requires.
fn required_model(req: &Map<String, Value>) -> Result<String, OllamaError> {
    match req.get("model") {
        Some(Value::String(m)) if m.len() > crate::server::body::MAX_MODEL_NAME_BYTES => Err(
            OllamaError::bad_request(crate::server::body::model_too_long().message),
        ),
        Some(Value::String(m)) if !m.trim().is_empty() => Ok(m.clone()),
        _ => Err(OllamaError::bad_request("model is required")),
    }
}

/// Ollama streams unless told `"stream": false`, the opposite of OpenAI's default.
fn wants_stream(req: &Map<String, Value>) -> Result<bool, OllamaError> {
    match req.get("stream") {
        None | Some(Value::Null) => Ok(true),
        Some(Value::Bool(b)) => Ok(*b),
        Some(_) => Err(OllamaError::bad_request("stream must be a boolean")),
    }
}

/// A string field that may be absent or null but nothing else.
fn optional_str<'a>(
    req: &'a Map<String, Value>,
    key: &str,
) -> Result<Option<&'a str>, OllamaError> {
    match req.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s)),
        Some(_) => Err(OllamaError::bad_request(format!("{key} must be a string"))),
    }
}

fn translated(
    path: &'static str,
    out: Map<String, Value>,
    model: String,
    stream: bool,
) -> Translated {
    Translated {
        path,
        body: Value::Object(out).to_string(),
        model,
        stream,
    }
}

fn chat_request(req: &Map<String, Value>, model: String) -> Result<Translated, OllamaError> {
    let stream = wants_stream(req)?;
    let mut out = Map::new();
    out.insert("model".into(), model.clone().into());
    out.insert(
        "messages".into(),
        Value::Array(chat_messages(req.get("messages"))?),
    );
    match req.get("tools") {
        None | Some(Value::Null) => {}
        Some(Value::Array(tools)) if tools.is_empty() => {}
        Some(tools @ Value::Array(_)) => {
            out.insert("tools".into(), tools.clone());
        }
        Some(_) => return Err(OllamaError::bad_request("tools must be an array")),
    }
    apply_common(req, &mut out, stream)?;
    Ok(translated(CHAT_PATH, out, model, stream))
}

fn generate_request(req: &Map<String, Value>, model: String) -> Result<Translated, OllamaError> {
    let stream = wants_stream(req)?;
    let prompt = optional_str(req, "prompt")?.unwrap_or_default();
    let raw = matches!(req.get("raw"), Some(Value::Bool(true)));
    let mut out = Map::new();
    out.insert("model".into(), model.clone().into());
    let path = if raw {
        raw_prompt(req, prompt, &mut out)?;
        COMPLETIONS_PATH
    } else {
        out.insert("messages".into(), generate_messages(req, prompt)?);
        CHAT_PATH
    };
    apply_common(req, &mut out, stream)?;
    Ok(translated(path, out, model, stream))
}

/// Raw mode skips the chat template, which only `/v1/completions` can do. Its
/// `suffix` is the OpenAI parameter of the same name; images cannot go along.
fn raw_prompt(
    req: &Map<String, Value>,
    prompt: &str,
    out: &mut Map<String, Value>,
) -> Result<(), OllamaError> {
    out.insert("prompt".into(), prompt.into());
    if let Some(suffix) = optional_str(req, "suffix")?.filter(|s| !s.is_empty()) {
        out.insert("suffix".into(), suffix.into());
    }
    if !is_empty(req.get("images")) {
        debug!("ollama generate: images dropped in raw mode");
    }
    Ok(())
}

/// Templated generate is a one-turn chat: `system` then the prompt (with images).
/// `suffix` (fill-in-the-middle) has no chat equivalent and is dropped.
fn generate_messages(req: &Map<String, Value>, prompt: &str) -> Result<Value, OllamaError> {
    let mut messages = Vec::new();
    if let Some(system) = optional_str(req, "system")?.filter(|s| !s.is_empty()) {
        messages.push(json!({ "role": "system", "content": system }));
    }
    if optional_str(req, "suffix")?.is_some_and(|s| !s.is_empty()) {
        debug!("ollama generate: suffix dropped (no chat equivalent)");
    }
    let images = image_parts(req.get("images"))?;
    let content = with_images(Value::String(prompt.to_string()), images);
    messages.push(json!({ "role": "user", "content": content }));
    Ok(Value::Array(messages))
}

fn embed_request(req: &Map<String, Value>, model: String) -> Result<Translated, OllamaError> {
    let input = match req.get("input") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::String(s)) => vec![Value::String(s.clone())],
        Some(Value::Array(list)) if list.iter().all(Value::is_string) => list.clone(),
        Some(_) => {
            return Err(OllamaError::bad_request(
                "input must be a string or an array of strings",
            ))
        }
    };
    let mut out = Map::new();
    out.insert("model".into(), model.clone().into());
    out.insert("input".into(), Value::Array(input));
    if let Some(dimensions) = req.get("dimensions").filter(|d| d.is_number()) {
        out.insert("dimensions".into(), dimensions.clone());
    }
    Ok(translated(EMBEDDINGS_PATH, out, model, false))
}

fn legacy_embeddings_request(
    req: &Map<String, Value>,
    model: String,
) -> Result<Translated, OllamaError> {
    let prompt = optional_str(req, "prompt")?.unwrap_or_default();
    let mut out = Map::new();
    out.insert("model".into(), model.clone().into());
    out.insert("input".into(), json!([prompt]));
    Ok(translated(EMBEDDINGS_PATH, out, model, false))
}

/// The parts chat and generate share: sampling options, format, think, stream.
fn apply_common(
    req: &Map<String, Value>,
    out: &mut Map<String, Value>,
    stream: bool,
) -> Result<(), OllamaError> {
    apply_options(req.get("options"), out)?;
    apply_format(req.get("format"), out)?;
    if let Some(think) = req.get("think").filter(|t| !t.is_null()) {
        out.insert("think".into(), think.clone());
    }
    out.insert("stream".into(), stream.into());
    if stream {
        // Without this, OpenAI-style backends send no counts in a stream.
        out.insert("stream_options".into(), json!({ "include_usage": true }));
    }
    Ok(())
}

/// Ollama options whose OpenAI (or llama-server/vLLM extension) field has the same name.
const SAME_NAME_OPTIONS: &[&str] = &[
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "min_p",
    "typical_p",
    "presence_penalty",
    "frequency_penalty",
    "repeat_last_n",
    "mirostat",
    "mirostat_tau",
    "mirostat_eta",
];

/// Sampling options become top-level fields; load-time ones (`num_ctx`, `num_gpu`...)
/// belong to whoever started the backend and are dropped.
fn apply_options(options: Option<&Value>, out: &mut Map<String, Value>) -> Result<(), OllamaError> {
    let options = match options {
        None | Some(Value::Null) => return Ok(()),
        Some(Value::Object(o)) => o,
        Some(_) => return Err(OllamaError::bad_request("options must be an object")),
    };
    for (key, value) in options.iter().filter(|(_, v)| !v.is_null()) {
        match key.as_str() {
            "num_predict" => {
                if let Some(n) = positive_int(value) {
                    out.insert("max_tokens".into(), n.into());
                }
            }
            "num_keep" => {
                out.insert("n_keep".into(), value.clone());
            }
            "repeat_penalty" => {
                out.insert("repeat_penalty".into(), value.clone());
                out.insert("repetition_penalty".into(), value.clone());
            }
            name if SAME_NAME_OPTIONS.contains(&name) => {
                out.insert(name.to_string(), value.clone());
            }
            other => debug!("ollama option {other} dropped"),
        }
    }
    Ok(())
}

/// `num_predict` as a token limit: −1 (unlimited), −2 (fill the context) and 0 have
/// no `max_tokens` equivalent, so they leave the backend's default.
fn positive_int(value: &Value) -> Option<u64> {
    let n = value
        .as_i64()
        .or_else(|| value.as_f64().map(|f| f as i64))?;
    u64::try_from(n).ok().filter(|n| *n > 0)
}

/// `format: "json"` is JSON mode; an object is a JSON schema (structured outputs).
fn apply_format(format: Option<&Value>, out: &mut Map<String, Value>) -> Result<(), OllamaError> {
    let response_format = match format {
        None | Some(Value::Null) => return Ok(()),
        Some(Value::String(s)) if s.is_empty() => return Ok(()),
        Some(Value::String(s)) if s == "json" => json!({ "type": "json_object" }),
        Some(schema @ Value::Object(_)) => json!({
            "type": "json_schema",
            "json_schema": { "name": "schema", "schema": schema },
        }),
        Some(_) => {
            return Err(OllamaError::bad_request(
                "invalid format: expected \"json\" or a JSON schema object",
            ))
        }
    };
    out.insert("response_format".into(), response_format);
    Ok(())
}

/// Ids for the tool calls in a conversation. Ollama's calls carry none, OpenAI's
/// `tool` messages must name the call they answer, so calls get `call_N` and each
/// tool result is paired with an unanswered call of the latest assistant turn.
#[derive(Default)]
struct CallIds {
    next: usize,
    /// (id, function name) of the latest assistant turn's calls not yet answered.
    pending: Vec<(String, String)>,
}

impl CallIds {
    /// A new assistant turn: earlier unanswered calls can no longer be answered.
    fn new_turn(&mut self) {
        self.pending.clear();
    }

    fn assign(&mut self, given: Option<&str>, name: &str) -> String {
        let id = match given.filter(|id| !id.is_empty()) {
            Some(id) => id.to_string(),
            None => format!("call_{}", self.next),
        };
        self.next += 1;
        self.pending.push((id.clone(), name.to_string()));
        id
    }

    /// The id a tool result answers: its own `tool_call_id` if it has one, else the
    /// first pending call with its `tool_name`, else the first pending call.
    fn answer(&mut self, explicit: Option<&str>, tool_name: Option<&str>) -> Option<String> {
        let position = match (explicit, tool_name) {
            (Some(id), _) => {
                self.pending.retain(|(pending, _)| pending != id);
                return Some(id.to_string());
            }
            (None, Some(name)) => self.pending.iter().position(|(_, n)| n == name),
            (None, None) => None,
        };
        let position = position.or(if self.pending.is_empty() {
            None
        } else {
            Some(0)
        })?;
        Some(self.pending.remove(position).0)
    }
}

fn chat_messages(messages: Option<&Value>) -> Result<Vec<Value>, OllamaError> {
    let list = match messages {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::Array(list)) => list,
        Some(_) => return Err(OllamaError::bad_request("messages must be an array")),
    };
    let mut calls = CallIds::default();
    list.iter().map(|m| chat_message(m, &mut calls)).collect()
}

fn chat_message(message: &Value, calls: &mut CallIds) -> Result<Value, OllamaError> {
    let Value::Object(m) = message else {
        return Err(OllamaError::bad_request("each message must be an object"));
    };
    // Ollama lowercases roles; OpenAI backends only know the lowercase ones.
    let role = optional_str(m, "role")?
        .unwrap_or_default()
        .to_ascii_lowercase();
    let mut out = Map::new();
    out.insert("role".into(), role.clone().into());
    out.insert("content".into(), message_content(m)?);
    match role.as_str() {
        "assistant" => {
            calls.new_turn();
            if let Some(tool_calls) = openai_tool_calls(m.get("tool_calls"), calls)? {
                out.insert("tool_calls".into(), tool_calls);
            }
        }
        "tool" => {
            let explicit = optional_str(m, "tool_call_id")?;
            let name = optional_str(m, "tool_name")?.or(optional_str(m, "name")?);
            if let Some(id) = calls.answer(explicit, name) {
                out.insert("tool_call_id".into(), id.into());
            }
        }
        _ => {}
    }
    Ok(Value::Object(out))
}

/// Text content plus `images` as OpenAI content parts. A client that already sends
/// OpenAI-style part lists is passed through.
fn message_content(m: &Map<String, Value>) -> Result<Value, OllamaError> {
    let text = match m.get("content") {
        None | Some(Value::Null) => Value::String(String::new()),
        Some(content @ (Value::String(_) | Value::Array(_))) => content.clone(),
        Some(_) => return Err(OllamaError::bad_request("message content must be a string")),
    };
    Ok(with_images(text, image_parts(m.get("images"))?))
}

/// Content with images appended as parts; plain text when there are none, since
/// text-only backends may not accept part lists.
fn with_images(text: Value, images: Vec<Value>) -> Value {
    if images.is_empty() {
        return text;
    }
    let mut parts = match text {
        Value::Array(parts) => parts,
        Value::String(s) if !s.is_empty() => vec![json!({ "type": "text", "text": s })],
        _ => Vec::new(),
    };
    parts.extend(images);
    Value::Array(parts)
}

fn image_parts(images: Option<&Value>) -> Result<Vec<Value>, OllamaError> {
    let list = match images {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::Array(list)) => list,
        Some(_) => return Err(OllamaError::bad_request("images must be an array")),
    };
    list.iter()
        .map(|image| {
            let b64 = image
                .as_str()
                .ok_or_else(|| OllamaError::bad_request("images must be base64 strings"))?;
            Ok(json!({ "type": "image_url", "image_url": { "url": image_url(b64) } }))
        })
        .collect()
}

/// A `data:` URL for a bare base64 image (URLs pass unchanged). Ollama's images
/// carry no type, so it is sniffed from the encoded magic bytes; PNG if unknown.
pub fn image_url(b64: &str) -> String {
    let b64 = b64.trim();
    if b64.starts_with("data:") || b64.starts_with("http://") || b64.starts_with("https://") {
        return b64.to_string();
    }
    format!("data:{};base64,{b64}", image_mime(b64))
}

/// MIME type from the base64 of the file's first bytes.
fn image_mime(b64: &str) -> &'static str {
    const MAGIC: &[(&str, &str)] = &[
        ("/9j/", "image/jpeg"),
        ("iVBORw0KGgo", "image/png"),
        ("R0lGOD", "image/gif"),
        ("UklGR", "image/webp"),
    ];
    MAGIC
        .iter()
        .find(|(prefix, _)| b64.starts_with(prefix))
        .map_or("image/png", |(_, mime)| mime)
}

/// Ollama assistant tool calls (arguments as an object) as OpenAI ones (arguments
/// as JSON text, with an id and `type`).
fn openai_tool_calls(
    tool_calls: Option<&Value>,
    calls: &mut CallIds,
) -> Result<Option<Value>, OllamaError> {
    let list = match tool_calls {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::Array(list)) if list.is_empty() => return Ok(None),
        Some(Value::Array(list)) => list,
        Some(_) => return Err(OllamaError::bad_request("tool_calls must be an array")),
    };
    let converted = list
        .iter()
        .map(|call| openai_tool_call(call, calls))
        .collect::<Result<Vec<_>, _>>()?;
    Ok(Some(Value::Array(converted)))
}

fn openai_tool_call(call: &Value, calls: &mut CallIds) -> Result<Value, OllamaError> {
    let function = call
        .get("function")
        .filter(|f| f.is_object())
        .ok_or_else(|| OllamaError::bad_request("tool call without function"))?;
    let name = str_field(function, "name").unwrap_or_default();
    let arguments = match function.get("arguments") {
        None | Some(Value::Null) => "{}".to_string(),
        Some(Value::String(text)) => text.clone(),
        Some(object) => object.to_string(),
    };
    let id = calls.assign(str_field(call, "id"), name);
    Ok(json!({
        "id": id,
        "type": "function",
        "function": { "name": name, "arguments": arguments },
    }))
}
