//! What the relay reads from a client request: `model` and `stream` from the JSON
//! body (which itself travels unchanged), and which headers go on to the backend.

use serde::Deserialize;

use super::dispatcher::Needs;

use super::errors::ApiError;

/// Request headers that travel to the backend; everything else stays at the relay.
pub const FORWARDED_HEADERS: &[&str] = &[
    "authorization",
    "content-type",
    "openai-organization",
    "x-api-key",
    "anthropic-version",
    "anthropic-beta",
    "x-cache-mode",
    "x-cache-tag",
    // The worker's trim switch (`X-Context-Trim: off`); the worker keeps it to itself.
    "x-context-trim",
    // The relay routes a session back to its cached worker by it (cache affinity); a
    // router or gateway behind the worker may keep sessions together by it too.
    "x-session-id",
];

/// The two fields the relay needs from a client body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BodyInfo {
    pub model: String,
    pub stream: bool,
}

/// The longest `model` a client may name. Real names (`org/repo-GGUF:Q4_K_M`) are far
/// shorter; the name travels into logs, error messages and the dashboard, so a
/// megabyte-long one is refused before anything keeps it.
pub const MAX_MODEL_NAME_BYTES: usize = 256;

/// Reads `model` and `stream` from a JSON body; the body itself is never rewritten.
pub fn inspect_body(body: &[u8]) -> Result<BodyInfo, ApiError> {
    #[derive(Deserialize)]
    struct Probe {
        model: Option<serde_json::Value>,
        stream: Option<serde_json::Value>,
    }
    let probe: Probe = serde_json::from_slice(body).map_err(|e| {
        ApiError::new(
            400,
            "invalid_json",
            format!("request body is not valid JSON: {e}"),
        )
    })?;
    let model = match probe.model {
        Some(serde_json::Value::String(m)) if m.len() > MAX_MODEL_NAME_BYTES => {
            return Err(model_too_long())
        }
        Some(serde_json::Value::String(m)) if !m.trim().is_empty() => m,
        Some(_) => {
            return Err(ApiError::new(
                400,
                "invalid_model",
                "`model` must be a non-empty string",
            ))
        }
        None => {
            return Err(ApiError::new(
                400,
                "missing_model",
                "request body has no `model` field",
            ))
        }
    };
    let stream = matches!(probe.stream, Some(serde_json::Value::Bool(true)));
    Ok(BodyInfo { model, stream })
}

/// The refusal of a `model` longer than [`MAX_MODEL_NAME_BYTES`].
pub fn model_too_long() -> ApiError {
    ApiError::new(
        400,
        "invalid_model",
        format!("`model` is longer than {MAX_MODEL_NAME_BYTES} bytes"),
    )
}

/// What a request needs its model to do: embeddings for `/v1/embeddings`, vision when
/// a message carries an image part (OpenAI `image_url`, Responses `input_image`,
/// Anthropic `image`; Ollama's `images` arrive here already as `image_url` parts).
pub fn needs(endpoint_path: &str, body: &str) -> Needs {
    Needs {
        vision: has_image_parts(body),
        embedding: endpoint_path == "/v1/embeddings",
        continuation: false,
    }
}

fn has_image_parts(body: &str) -> bool {
    // Most bodies never mention an image: no parse for them.
    if !body.contains("image") {
        return false;
    }
    let Ok(v) = serde_json::from_str::<serde_json::Value>(body) else {
        return false;
    };
    let turns = v
        .get("messages")
        .or_else(|| v.get("input"))
        .and_then(serde_json::Value::as_array);
    turns.into_iter().flatten().any(|turn| {
        turn.get("content")
            .and_then(serde_json::Value::as_array)
            .into_iter()
            .flatten()
            .any(|part| {
                matches!(
                    part.get("type").and_then(serde_json::Value::as_str),
                    Some("image_url" | "input_image" | "image")
                )
            })
    })
}

/// Prompt tokens the backend says it took from its cache, read from a whole answer:
/// OpenAI's `usage.prompt_tokens_details.cached_tokens`, Anthropic's
/// `usage.cache_read_input_tokens`, or llama-server's `timings.cache_n`. Zero when it
/// reports none. Bodies that mention none of them are not parsed at all.
pub fn cache_reuse(body: &str) -> u64 {
    if !["cached_tokens", "cache_n", "cache_read_input_tokens"]
        .iter()
        .any(|k| body.contains(k))
    {
        return 0;
    }
    let Ok(v) = serde_json::from_str::<serde_json::Value>(body) else {
        return 0;
    };
    [
        &v["usage"]["prompt_tokens_details"]["cached_tokens"],
        &v["usage"]["cache_read_input_tokens"],
        &v["timings"]["cache_n"],
    ]
    .iter()
    .find_map(|n| n.as_u64())
    .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn inspects_model_and_stream() {
        let info = inspect_body(br#"{"model":"m","stream":true,"messages":[]}"#).unwrap();
        assert_eq!(
            info,
            BodyInfo {
                model: "m".into(),
                stream: true
            }
        );
        assert!(!inspect_body(br#"{"model":"m"}"#).unwrap().stream);
        assert_eq!(inspect_body(b"{nope").unwrap_err().status, 400);
        assert_eq!(
            inspect_body(br#"{"stream":true}"#).unwrap_err().code,
            "missing_model"
        );
        assert_eq!(
            inspect_body(br#"{"model":""}"#).unwrap_err().code,
            "invalid_model"
        );
        assert_eq!(inspect_body(br#"[1,2]"#).unwrap_err().status, 400);
        let long = format!(r#"{{"model":"{}"}}"#, "m".repeat(MAX_MODEL_NAME_BYTES + 1));
        assert_eq!(
            inspect_body(long.as_bytes()).unwrap_err().code,
            "invalid_model"
        );
    }

    #[test]
    fn cache_reuse_reads_each_backend_shape() {
        let openai = r#"{"usage":{"prompt_tokens":9,"prompt_tokens_details":{"cached_tokens":7}}}"#;
        assert_eq!(cache_reuse(openai), 7);
        assert_eq!(cache_reuse(r#"{"timings":{"cache_n":1234}}"#), 1234);
        assert_eq!(cache_reuse(r#"{"usage":{"cache_read_input_tokens":5}}"#), 5);
        assert_eq!(cache_reuse(r#"{"usage":{"prompt_tokens":9}}"#), 0);
        assert_eq!(cache_reuse("not json cache_n"), 0);
    }
}

#[cfg(test)]
mod needs_tests {
    use super::*;

    #[test]
    fn image_parts_and_embeddings_are_needs() {
        let openai = r#"{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"what is this"},{"type":"image_url","image_url":{"url":"data:image/png;base64,AA"}}]}]}"#;
        let anthropic = r#"{"model":"m","messages":[{"role":"user","content":[{"type":"image","source":{"type":"base64","data":"AA"}}]}]}"#;
        let responses = r#"{"model":"m","input":[{"role":"user","content":[{"type":"input_image","image_url":"https://x/y.png"}]}]}"#;
        for body in [openai, anthropic, responses] {
            assert!(needs("/v1/chat/completions", body).vision, "{body}");
        }
        let text =
            r#"{"model":"m","messages":[{"role":"user","content":"describe image_url fields"}]}"#;
        assert_eq!(needs("/v1/chat/completions", text), Needs::default());
        assert!(needs("/v1/embeddings", r#"{"model":"e","input":"hi"}"#).embedding);
    }
}
