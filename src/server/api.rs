//! The client-facing API surface: which routes exist, how a request body is read for
//! `model` and `stream`, and how failures become JSON errors in the shape of the API the
//! client called (OpenAI or Anthropic).

use serde::Deserialize;

use super::dispatcher::Failure;

/// Routes whose body is relayed to a worker unchanged.
pub const RELAYED_ROUTES: &[&str] = &[
    "/v1/chat/completions",
    "/v1/responses",
    "/v1/messages",
    "/v1/completions",
    "/v1/embeddings",
];

/// Request headers that travel to the backend; everything else stays at the relay.
pub const FORWARDED_HEADERS: &[&str] = &[
    "authorization",
    "content-type",
    "openai-organization",
    "x-api-key",
    "anthropic-version",
    "anthropic-beta",
];

/// Which error body shape a route uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Style {
    OpenAi,
    Anthropic,
}

impl Style {
    pub fn for_path(path: &str) -> Style {
        if path.starts_with("/v1/messages") {
            Style::Anthropic
        } else {
            Style::OpenAi
        }
    }
}

/// An error answer: status, stable machine code, human message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiError {
    pub status: u16,
    pub code: String,
    pub message: String,
    pub retry_after: Option<u32>,
}

impl ApiError {
    pub fn new(status: u16, code: &str, message: impl Into<String>) -> ApiError {
        ApiError {
            status,
            code: code.to_string(),
            message: message.into(),
            retry_after: None,
        }
    }

    /// The error `type` field for this status in the given API's vocabulary.
    fn kind(&self, style: Style) -> &'static str {
        match (self.status, style) {
            (413, Style::Anthropic) => "request_too_large",
            (400 | 405 | 413 | 422, _) => "invalid_request_error",
            (401, _) => "authentication_error",
            (403, _) => "permission_error",
            (404, Style::Anthropic) => "not_found_error",
            (404, Style::OpenAi) => "invalid_request_error",
            (429, _) => "rate_limit_error",
            (503, Style::Anthropic) => "overloaded_error",
            (_, Style::Anthropic) => "api_error",
            (_, Style::OpenAi) => "server_error",
        }
    }

    pub fn body(&self, style: Style) -> String {
        let value = match style {
            Style::OpenAi => serde_json::json!({
                "error": {"message": self.message, "type": self.kind(style), "code": self.code}
            }),
            Style::Anthropic => serde_json::json!({
                "type": "error",
                "error": {"type": self.kind(style), "message": self.message}
            }),
        };
        value.to_string()
    }

    /// The same error as one SSE event, for a stream that already started.
    pub fn sse_event(&self, style: Style) -> String {
        match style {
            Style::OpenAi => format!("data: {}\n\n", self.body(style)),
            Style::Anthropic => format!("event: error\ndata: {}\n\n", self.body(style)),
        }
    }

    /// Maps a dispatcher failure to what the client sees.
    pub fn from_failure(f: &Failure, queue_timeout_secs: u64) -> ApiError {
        match f {
            Failure::QueueFull => ApiError {
                retry_after: Some(1),
                ..ApiError::new(
                    429,
                    "queue_full",
                    "queue full: every worker is busy and the wait queue is at capacity",
                )
            },
            Failure::QueueTimeout => ApiError::new(
                504,
                "queue_timeout",
                format!("queue timeout: no worker became available within {queue_timeout_secs}s"),
            ),
            Failure::RequestTimeout => ApiError::new(
                504,
                "request_timeout",
                "request timeout: the worker did not answer in time",
            ),
            Failure::RequeueExhausted => ApiError::new(
                503,
                "requeue_exhausted",
                "requeue attempts exhausted: the workers serving this request kept disconnecting",
            ),
            Failure::ModelNotFound { model, available } => ApiError::new(
                404,
                "model_not_found",
                format!(
                    "model `{model}` is not served by any connected worker; available models: [{}]",
                    available.join(", ")
                ),
            ),
            Failure::ShuttingDown => {
                ApiError::new(503, "server_shutting_down", "the relay is shutting down")
            }
            Failure::WorkerError {
                status,
                code,
                message,
            } => {
                let status = status.filter(|s| (400..=599).contains(s)).unwrap_or(502);
                ApiError::new(status, code, format!("worker error: {message}"))
            }
            Failure::WorkerLost => ApiError::new(
                502,
                "worker_disconnected",
                "the worker serving this stream disconnected",
            ),
            Failure::ClientGone => {
                ApiError::new(499, "client_closed_request", "client closed the request")
            }
        }
    }
}

/// The two fields the relay needs from a client body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BodyInfo {
    pub model: String,
    pub stream: bool,
}

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
    }

    #[test]
    fn error_shapes_follow_the_called_api() {
        let e = ApiError::new(429, "queue_full", "full");
        let openai: serde_json::Value = serde_json::from_str(&e.body(Style::OpenAi)).unwrap();
        assert_eq!(openai["error"]["code"], "queue_full");
        assert_eq!(openai["error"]["type"], "rate_limit_error");
        assert_eq!(openai["error"]["message"], "full");
        let anthropic: serde_json::Value = serde_json::from_str(&e.body(Style::Anthropic)).unwrap();
        assert_eq!(anthropic["type"], "error");
        assert_eq!(anthropic["error"]["type"], "rate_limit_error");
        assert_eq!(Style::for_path("/v1/messages"), Style::Anthropic);
    }

    #[test]
    fn worker_status_is_kept_only_when_it_is_an_error_status() {
        let f = |s| Failure::WorkerError {
            status: s,
            code: "c".into(),
            message: "m".into(),
        };
        assert_eq!(ApiError::from_failure(&f(Some(503)), 30).status, 503);
        assert_eq!(ApiError::from_failure(&f(Some(200)), 30).status, 502);
        assert_eq!(ApiError::from_failure(&f(None), 30).status, 502);
    }
}
