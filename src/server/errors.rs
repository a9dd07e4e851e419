//! Error answers in the shape of the API the client called: OpenAI's
//! `{"error": {...}}`, Anthropic's `{"type": "error", ...}`, and how a dispatcher
//! [`Failure`] becomes one. Every route module shares these.

use serde_json::Value;

use super::dispatcher::{Backpressure, Failure};

/// Which error body shape a route uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Style {
    OpenAi,
    Anthropic,
    /// Ollama's `{"error": "..."}`.
    Ollama,
}

impl Style {
    pub fn for_path(path: &str) -> Style {
        if path.starts_with("/v1/messages") {
            Style::Anthropic
        } else if path.starts_with("/api/") {
            Style::Ollama
        } else {
            Style::OpenAi
        }
    }
}

/// An error answer: status, stable machine code, human message.
#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    pub status: u16,
    pub code: String,
    pub message: String,
    pub retry_after: Option<u32>,
    /// Extra fields inside the error object (`limit`, `queueDepth`, ...).
    pub fields: Vec<(&'static str, Value)>,
}

impl ApiError {
    pub fn new(status: u16, code: &str, message: impl Into<String>) -> ApiError {
        ApiError {
            status,
            code: code.to_string(),
            message: message.into(),
            retry_after: None,
            fields: Vec::new(),
        }
    }

    /// Adds `Retry-After` (seconds).
    pub fn retry_after(mut self, secs: u32) -> ApiError {
        self.retry_after = Some(secs);
        self
    }

    /// Adds a field to the error object.
    pub fn field(mut self, name: &'static str, value: impl Into<Value>) -> ApiError {
        self.fields.push((name, value.into()));
        self
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
            (_, Style::OpenAi | Style::Ollama) => "server_error",
        }
    }

    pub fn body(&self, style: Style) -> String {
        if style == Style::Ollama {
            return serde_json::json!({ "error": self.message }).to_string();
        }
        let mut error = serde_json::Map::new();
        match style {
            Style::OpenAi => {
                error.insert("message".into(), self.message.clone().into());
                error.insert("type".into(), self.kind(style).into());
                error.insert("code".into(), self.code.clone().into());
            }
            Style::Anthropic | Style::Ollama => {
                error.insert("type".into(), self.kind(style).into());
                error.insert("message".into(), self.message.clone().into());
                if !self.fields.is_empty() {
                    error.insert("code".into(), self.code.clone().into());
                }
            }
        }
        for (name, value) in &self.fields {
            error.insert((*name).into(), value.clone());
        }
        let value = match style {
            Style::OpenAi | Style::Ollama => serde_json::json!({ "error": error }),
            Style::Anthropic => serde_json::json!({ "type": "error", "error": error }),
        };
        value.to_string()
    }

    /// A backend's error answer (OpenAI or plain shape) as an error of ours, same status.
    pub fn from_backend(status: u16, body: &str) -> ApiError {
        let v: Value = serde_json::from_str(body).unwrap_or(Value::Null);
        let message = v["error"]["message"]
            .as_str()
            .or_else(|| v["error"].as_str())
            .map(str::to_string)
            .unwrap_or_else(|| body.chars().take(512).collect());
        ApiError::new(status, "backend_error", message)
    }

    /// 429 for a full queue, with the wait the client should expect.
    fn backpressure(code: &str, message: &str, bp: &Backpressure) -> ApiError {
        ApiError::new(429, code, message)
            .retry_after(bp.retry_after_secs)
            .field("queueDepth", bp.queue_depth)
            .field("avgWaitMs", bp.avg_wait_ms)
    }

    /// The same error as one SSE event, for a stream that already started.
    pub fn sse_event(&self, style: Style) -> String {
        match style {
            Style::OpenAi => format!("data: {}\n\n", self.body(style)),
            Style::Anthropic => format!("event: error\ndata: {}\n\n", self.body(style)),
            Style::Ollama => format!("{}\n", self.body(style)),
        }
    }

    /// [`ApiError::from_failure`] in the words of the API the client called (Ollama
    /// clients look for `model "x" not found`).
    pub fn from_failure_for(f: &Failure, queue_timeout_secs: u64, style: Style) -> ApiError {
        match (f, style) {
            (Failure::ModelNotFound { model, .. }, Style::Ollama) => ApiError::new(
                404,
                "model_not_found",
                format!("model \"{model}\" not found, try pulling it first"),
            ),
            _ => ApiError::from_failure(f, queue_timeout_secs),
        }
    }

    /// Maps a dispatcher failure to what the client sees.
    pub fn from_failure(f: &Failure, queue_timeout_secs: u64) -> ApiError {
        match f {
            Failure::QueueFull(bp) => ApiError::backpressure(
                "queue_full",
                "queue full: every worker is busy and the wait queue is at capacity",
                bp,
            ),
            Failure::TenantQueueFull(bp) => ApiError::backpressure(
                "tenant_queue_full",
                "your tenant already has as many requests waiting as it may (MAX_QUEUE_PER_TENANT)",
                bp,
            ),
            Failure::QueueTimeout => ApiError::new(
                504,
                "queue_timeout",
                format!("queue timeout: no worker became available within {queue_timeout_secs}s"),
            ),
            Failure::NoHealthyWorker { retry_after_secs } => ApiError::new(
                503,
                "no_healthy_worker",
                "no healthy worker: every worker serving this model has its backend down or is ejected for failing",
            )
            .retry_after(*retry_after_secs),
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
            // A route is named by its path (`Worker::lacks_route`).
            Failure::UnsupportedCapability { model, capability } if capability.starts_with('/') => {
                ApiError::new(
                    404,
                    "route_not_served",
                    format!("no worker serving `{model}` serves {capability} (its backend does not offer it)"),
                )
                .field("route", *capability)
            }
            Failure::UnsupportedCapability { model, capability }
                if *capability == crate::protocol::binary::FEATURE_BINARY_BODIES =>
            {
                ApiError::new(
                    501,
                    "binary_bodies_unsupported",
                    format!(
                        "no worker serving `{model}` can carry binary bodies: this route needs \
                         a worker that lists `binary_bodies` (a newer modelrelay-worker)"
                    ),
                )
            }
            Failure::UnsupportedCapability { model, capability }
                if *capability == crate::protocol::pieces::FEATURE_BODY_PIECES =>
            {
                ApiError::new(
                    413,
                    "body_pieces_unsupported",
                    format!(
                        "no worker serving `{model}` takes a request body in pieces, and this \
                         body is too large to travel whole: it needs a worker that lists \
                         `body_pieces` (a newer modelrelay-worker)"
                    ),
                )
            }
            Failure::UnsupportedCapability { model, capability } => ApiError::new(
                400,
                "unsupported_capability",
                format!("no worker's `{model}` has the `{capability}` capability this request needs"),
            )
            .field("capability", *capability),
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
            Failure::Asleep { worker, detail } => ApiError::new(
                503,
                "worker_asleep",
                format!("only the sleeping box `{worker}` serves this model, and {detail}"),
            )
            .field("worker", worker.clone()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
