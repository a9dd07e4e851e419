//! The worker's client for its local backend (llama-server, Ollama, vLLM, ...).
//!
//! Blocking `ureq` requests. Each backend slot (see `slots.rs`) owns one agent, so a
//! cancel can shut down exactly that request's socket (`Agent::shutdown`): the backend
//! sees the connection close and stops generating at once, and the slot continues with
//! a fresh agent.
//!
//! Streaming bodies are forwarded piece by piece as they are read; a multi-byte UTF-8
//! character split across reads is carried over to the next piece ([`Utf8Carry`]).
//! What a failed call means (backend down, retry, fail over) is decided in [`failure`].

use std::io::Read;
use std::time::Duration;

use log::debug;

use super::inflight::Handle;
pub use super::stream_usage::{
    is_usage_event, usage_from_json, with_usage_requested, UsageEventFilter, UsageScanner,
};
use super::trim::{self, TRIM_REQUEST_HEADER};
use crate::protocol::{HeaderMap, RequestMessage, ResponseComplete, WorkerMessage};

mod binary;
mod failure;
mod pieces;
mod resolve;
mod socket;
pub use failure::is_connection_failure;
use failure::{is_stale_connection, unavailable};

/// Response headers not worth sending to the server (framing is redone there).
const SKIPPED_HEADERS: &[&str] = &[
    "connection",
    "keep-alive",
    "transfer-encoding",
    "content-length",
    "date",
];
/// Read size for streamed bodies: a read returns as soon as any bytes arrived.
const READ_BYTES: usize = 16 * 1024;

/// How a forwarded request ended (the caller turns it into protocol messages).
#[derive(Debug, PartialEq, Eq)]
pub enum Outcome {
    /// `response_complete` was sent.
    Completed,
    /// Cancelled by the server; the backend socket was shut down.
    Cancelled,
    /// The backend could not be reached or dropped the connection before answering
    /// (refused, reset, connect timeout). Nothing was sent: another worker may run it,
    /// and this backend is probably down.
    Unreachable(String),
    /// The backend answered 502, 503 or 504 (its own upstream or its model is not
    /// ready). Nothing was sent: another worker may run it. `body`: the whole answer
    /// (absent when larger than a message may carry), for the client if none other does.
    Unavailable {
        status: u16,
        headers: HeaderMap,
        body: Option<String>,
    },
    /// Any other failure before the answer went out (not safe to run elsewhere).
    Failed(String),
    /// The backend failed after part of a stream was sent.
    StreamBroken(String),
    /// The answer exceeded what fits in one WebSocket message.
    TooLarge(usize),
    /// The server named a path that would leave the backend's host (`url.rs`): nothing
    /// was sent anywhere.
    BadPath(&'static str),
}

/// Why the backend's model list could not be read.
#[derive(Debug, PartialEq, Eq)]
pub enum ModelsError {
    /// No HTTP answer at all (refused, reset, timeout): the backend is down.
    Unreachable(String),
    /// The backend answered, but not with a usable list.
    Unusable(String),
}

impl std::fmt::Display for ModelsError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ModelsError::Unreachable(e) | ModelsError::Unusable(e) => f.write_str(e),
        }
    }
}

/// Statuses that mean "not this backend, not now": retryable on another worker.
pub const UNAVAILABLE_STATUSES: [u16; 3] = [502, 503, 504];
/// How much of a 502/503/504 body goes into the error message.
pub const UNAVAILABLE_BODY_CHARS: usize = 512;
/// `GET /v1/models` gives up after this long (it is also the health probe, which must
/// not hang on a backend that accepts connections and never answers).
const MODELS_TIMEOUT: Duration = Duration::from_secs(10);
const MODELS_CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

pub struct Backend {
    base: String,
    /// `base` parsed once (`None`: it does not parse, and no request path passes).
    base_uri: Option<ureq::http::Uri>,
    /// `base` with its userinfo redacted: the form shown in errors and logs.
    shown: String,
    api_key: Option<String>,
    /// The largest body read from a non-streamed answer.
    max_body: usize,
    /// The largest WebSocket message the worker sends: an answer is checked by its size
    /// once escaped (control bytes grow sixfold), not by its raw length.
    max_message: usize,
}

/// Read and write buffers of a slot's backend connection. ureq's default is 128 KiB
/// each, allocated (and touched) per connection: 256 KiB resident per busy slot, which
/// made a 1,000-slot worker peak at 254 MB. Answers are read 16 KiB at a time anyway
/// ([`READ_BYTES`]); 32 KiB still holds any response head a backend sends.
const AGENT_INPUT_BUFFER: usize = 32 * 1024;
const AGENT_OUTPUT_BUFFER: usize = 16 * 1024;

/// A new agent with its own connection pool (one idle keep-alive connection), over the
/// slot's own transport ([`socket`]: one `send` per request, a one-call liveness check)
/// and its own resolver ([`resolve`]: the backend's address kept for a few seconds);
/// a CONNECT proxy from the environment still comes first, as in ureq's default chain.
pub fn fresh_agent() -> ureq::Agent {
    use ureq::unversioned::transport::{ConnectProxyConnector, Connector};
    let config = ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_connect(Some(Duration::from_secs(10)))
        .input_buffer_size(AGENT_INPUT_BUFFER)
        .output_buffer_size(AGENT_OUTPUT_BUFFER)
        .max_response_header_size(AGENT_INPUT_BUFFER)
        .max_idle_connections_per_host(1)
        .user_agent(concat!("modelrelay-worker/", env!("CARGO_PKG_VERSION")))
        .build();
    let connector = ().chain(ConnectProxyConnector::default()).chain(socket::BackendConnector);
    ureq::Agent::with_parts(config, connector, resolve::CachedResolver::default())
}

impl Backend {
    /// `max_message` caps a non-streamed answer (it travels in one WebSocket message);
    /// half of it, less a MiB for the envelope, is read at most.
    pub fn new(base: &str, api_key: Option<String>, max_message: usize) -> Backend {
        let base = base.trim_end_matches('/');
        Backend {
            base: base.to_string(),
            base_uri: base.parse().ok(),
            shown: url::redacted(base),
            api_key,
            max_body: max_message.saturating_sub(1 << 20) / 2,
            max_message,
        }
    }

    /// The URL a request's `endpoint_path` names, when it stays on the backend's host.
    fn target(&self, path: &str) -> Result<ureq::http::Uri, &'static str> {
        url::checked_uri(self.base_uri.as_ref(), &self.base, path)
    }

    /// The URL of one of the worker's own calls (fixed paths).
    pub fn url(&self, path: &str) -> String {
        format!("{}{}", self.base, path)
    }

    /// The URL of `path` as shown in errors and logs: credentials redacted.
    pub fn shown_url(&self, path: &str) -> String {
        format!("{}{}", self.shown, path)
    }

    /// The `authorization` header value sent with the worker's own calls, if any.
    pub fn authorization(&self) -> Option<String> {
        self.api_key.as_ref().map(|key| format!("Bearer {key}"))
    }

    /// Reads the backend's model list (`GET /v1/models`, OpenAI list shape). Also the
    /// health probe: a bounded call, so a hung backend cannot stall the prober.
    pub fn models(&self) -> Result<Vec<String>, ModelsError> {
        let (status, body) = self.get("/v1/models")?;
        if status != 200 {
            return Err(ModelsError::Unusable(format!(
                "GET /v1/models answered {status}"
            )));
        }
        parse_model_list(&body).map_err(ModelsError::Unusable)
    }

    /// One bounded `GET` (the models list, and the probes of `backend_kind.rs`): the
    /// status and at most 4 MiB of body. `Unreachable` when no HTTP answer came at all.
    pub fn get(&self, path: &str) -> Result<(u16, String), ModelsError> {
        self.bounded(path, None)
    }

    /// One bounded `POST` of a JSON body (`/api/show`), otherwise like [`Self::get`].
    pub fn post_json(&self, path: &str, body: &str) -> Result<(u16, String), ModelsError> {
        self.bounded(path, Some(body))
    }

    fn bounded(&self, path: &str, body: Option<&str>) -> Result<(u16, String), ModelsError> {
        let config = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .timeout_connect(Some(MODELS_CONNECT_TIMEOUT))
            .timeout_global(Some(MODELS_TIMEOUT))
            .user_agent(concat!("modelrelay-worker/", env!("CARGO_PKG_VERSION")))
            .build();
        let agent = ureq::Agent::new_with_config(config);
        let auth = self.authorization();
        let method = if body.is_some() { "POST" } else { "GET" };
        let result = match body {
            None => {
                let mut req = agent.get(&self.url(path));
                if let Some(auth) = &auth {
                    req = req.header("authorization", auth);
                }
                req.call()
            }
            Some(body) => {
                let mut req = agent
                    .post(&self.url(path))
                    .header("content-type", "application/json");
                if let Some(auth) = &auth {
                    req = req.header("authorization", auth);
                }
                req.send(body)
            }
        };
        let resp = result.map_err(|e| {
            let text = format!("{method} {path} failed: {e}");
            // A timeout here is a backend that never answered, like a refused one.
            if is_connection_failure(&e) || matches!(e, ureq::Error::Timeout(_)) {
                ModelsError::Unreachable(text)
            } else {
                ModelsError::Unusable(text)
            }
        })?;
        let status = resp.status().as_u16();
        let mut text = String::new();
        resp.into_body()
            .into_reader()
            .take(4 << 20)
            .read_to_string(&mut text)
            .map_err(|e| ModelsError::Unusable(format!("reading {path}: {e}")))?;
        Ok((status, text))
    }

    /// Runs one request to completion on `agent`, sending protocol messages through
    /// `emit`. After a stale-connection retry `agent` is replaced by a fresh one.
    /// `failover`: the server runs a retryable failure elsewhere, so a 502/503/504 is
    /// reported as one; any other server gets the backend's answer as it is. `trim`:
    /// a prompt the backend refuses for its context size is retried shorter (`trim.rs`).
    pub fn forward(
        &self,
        agent: &mut ureq::Agent,
        req: &RequestMessage,
        handle: &Handle,
        failover: bool,
        trim: Option<trim::Policy>,
        emit: &mut dyn FnMut(WorkerMessage),
    ) -> Outcome {
        let uri = match self.target(&req.endpoint_path) {
            Ok(uri) => uri,
            Err(why) => return Outcome::BadPath(why),
        };
        if req.body_encoding.is_some() {
            return binary::forward(self, &uri, agent, req, handle, failover, emit);
        }
        // Streams of OpenAI-style completions ask the backend for their token counts; the
        // extra usage chunk is then stripped from what the client gets.
        let injected = if req.is_streaming {
            with_usage_requested(&req.endpoint_path, &req.body)
        } else {
            None
        };
        let strip_usage = injected.is_some();
        let mut attempts = trim::Attempts::new(trim, req, injected.as_deref().unwrap_or(&req.body));
        loop {
            let response =
                match self.send_once(&uri, agent, req, attempts.body().as_bytes(), handle) {
                    Ok(response) => response,
                    Err(outcome) => return outcome,
                };
            let status = response.status().as_u16();
            let mut headers = response_headers(&response);
            let length = response
                .body()
                .content_length()
                .and_then(|n| usize::try_from(n).ok());
            let reader = response.into_body().into_reader();
            if failover && UNAVAILABLE_STATUSES.contains(&status) {
                // Nothing went to the server yet, so this can still run elsewhere.
                return unavailable(status, headers, reader, self.max_body, handle);
            }
            if attempts.watches(status) {
                // Nothing went out yet either: a context refusal is retried shorter.
                let bytes = match self.read_whole(reader, length, handle) {
                    Ok(bytes) => bytes,
                    Err(outcome) => return outcome,
                };
                match attempts.refused(status, headers, bytes) {
                    trim::Next::Retry => continue,
                    trim::Next::Answer {
                        status,
                        headers,
                        body,
                    } => return self.complete(req, status, headers, body, emit),
                }
            }
            attempts.mark(&mut headers);
            return if req.is_streaming && status < 400 {
                self.stream_body(req, status, headers, reader, strip_usage, handle, emit)
            } else {
                self.whole_body(req, status, headers, (reader, length), handle, emit)
            };
        }
    }

    /// Sends `body` and returns the response head; a stale pooled connection is retried
    /// once on a fresh agent. `Err`: the request's outcome (cancelled, unreachable, ...).
    fn send_once(
        &self,
        uri: &ureq::http::Uri,
        agent: &mut ureq::Agent,
        req: &RequestMessage,
        body: &[u8],
        handle: &Handle,
    ) -> Result<ureq::http::Response<ureq::Body>, Outcome> {
        let mut retried = false;
        loop {
            if !handle.attach(agent) {
                return Err(Outcome::Cancelled);
            }
            match self.send(uri, agent, req, body) {
                Ok(resp) => return Ok(resp),
                Err(_) if handle.is_cancelled() => return Err(Outcome::Cancelled),
                // A pooled keep-alive connection the backend already closed (llama-server
                // does this after a stream) fails before any response byte: the backend
                // never saw the request, so one retry on a fresh connection is safe.
                Err(e) if !retried && is_stale_connection(&e) => {
                    debug!(
                        "request {}: stale backend connection ({e}); retrying once",
                        req.request_id
                    );
                    retried = true;
                    *agent = fresh_agent();
                }
                Err(e) if is_connection_failure(&e) => {
                    return Err(Outcome::Unreachable(e.to_string()))
                }
                Err(e) => return Err(Outcome::Failed(e.to_string())),
            }
        }
    }

    /// A whole answer body, at most `max_body + 1` bytes (more is too large).
    fn read_whole(
        &self,
        reader: impl Read,
        length: Option<usize>,
        handle: &Handle,
    ) -> Result<Vec<u8>, Outcome> {
        // Sized once from the answer's Content-Length (capped: the header is the
        // backend's word), instead of grown by doubling from nothing.
        let mut bytes = Vec::with_capacity(length.unwrap_or(0).min(self.max_body + 1).min(1 << 20));
        match reader
            .take(self.max_body as u64 + 1)
            .read_to_end(&mut bytes)
        {
            Ok(_) => Ok(bytes),
            // The backend answered, then broke: not the "nothing happened" retry case.
            Err(_) if handle.is_cancelled() => Err(Outcome::Cancelled),
            Err(e) => Err(Outcome::Failed(e.to_string())),
        }
    }

    fn send(
        &self,
        uri: &ureq::http::Uri,
        agent: &ureq::Agent,
        req: &RequestMessage,
        body: impl ureq::AsSendBody,
    ) -> Result<ureq::http::Response<ureq::Body>, ureq::Error> {
        // `uri`: `endpoint_path` as `forward` checked it (a clone shares its bytes).
        let mut builder = agent.post(uri.clone());
        for (name, value) in &req.headers {
            // The worker's own switch (`X-Context-Trim`) is not the backend's business.
            if (name == "authorization" && self.api_key.is_some()) || name == TRIM_REQUEST_HEADER {
                continue;
            }
            builder = builder.header(name.as_str(), value.as_str());
        }
        if let Some(key) = &self.api_key {
            builder = builder.header("authorization", &format!("Bearer {key}"));
        }
        if !req.headers.contains_key("content-type") {
            builder = builder.header("content-type", "application/json");
        }
        builder.send(body)
    }

    /// `strip_usage`: the worker asked for usage itself, so the usage-only event is
    /// counted but not forwarded.
    #[allow(clippy::too_many_arguments)]
    fn stream_body(
        &self,
        req: &RequestMessage,
        status: u16,
        headers: HeaderMap,
        mut reader: impl Read,
        strip_usage: bool,
        handle: &Handle,
        emit: &mut dyn FnMut(WorkerMessage),
    ) -> Outcome {
        // The head first: headers the worker added (a trim) reach the client with the
        // stream's head, not only in `response_complete` after the body.
        emit(WorkerMessage::ResponseHead {
            request_id: req.request_id.clone(),
            status_code: status,
            headers: headers.clone(),
        });
        let mut buf = vec![0u8; READ_BYTES];
        let mut carry = Utf8Carry::default();
        let mut usage = UsageScanner::default();
        let mut filter = strip_usage.then(UsageEventFilter::default);
        loop {
            match reader.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => {
                    let mut text = carry.push(&buf[..n]);
                    if text.is_empty() {
                        continue;
                    }
                    usage.scan(&text);
                    if let Some(filter) = &mut filter {
                        text = filter.push(&text);
                        if text.is_empty() {
                            continue;
                        }
                    }
                    emit(WorkerMessage::ResponseChunk {
                        request_id: req.request_id.clone(),
                        chunk: text,
                    });
                }
                Err(_) if handle.is_cancelled() => return Outcome::Cancelled,
                Err(e) => return Outcome::StreamBroken(e.to_string()),
            }
        }
        let mut tail = carry.finish();
        usage.scan(&tail);
        if let Some(filter) = &mut filter {
            tail = filter.push(&tail);
            tail.push_str(&filter.finish());
        }
        if !tail.is_empty() {
            emit(WorkerMessage::ResponseChunk {
                request_id: req.request_id.clone(),
                chunk: tail,
            });
        }
        emit(WorkerMessage::ResponseComplete(ResponseComplete {
            request_id: req.request_id.clone(),
            status_code: status,
            headers,
            body: None,
            token_counts: usage.counts,
        }));
        Outcome::Completed
    }

    /// Reads a whole answer and sends it as `response_complete`.
    fn whole_body(
        &self,
        req: &RequestMessage,
        status: u16,
        headers: HeaderMap,
        (reader, length): (impl Read, Option<usize>),
        handle: &Handle,
        emit: &mut dyn FnMut(WorkerMessage),
    ) -> Outcome {
        match self.read_whole(reader, length, handle) {
            Ok(bytes) => self.complete(req, status, headers, bytes, emit),
            Err(outcome) => outcome,
        }
    }

    /// Sends a whole answer as `response_complete` (too large: nothing is sent).
    fn complete(
        &self,
        req: &RequestMessage,
        status: u16,
        headers: HeaderMap,
        bytes: Vec<u8>,
        emit: &mut dyn FnMut(WorkerMessage),
    ) -> Outcome {
        if bytes.len() > self.max_body {
            return Outcome::TooLarge(self.max_body);
        }
        let body = String::from_utf8(bytes)
            .unwrap_or_else(|e| String::from_utf8_lossy(e.as_bytes()).into_owned());
        let token_counts = usage_from_json(&body);
        let done = ResponseComplete {
            request_id: req.request_id.clone(),
            status_code: status,
            headers,
            body: Some(body),
            token_counts,
        };
        // Over the limit once escaped, the message would cost the whole session.
        if done.wire_len() > self.max_message {
            return Outcome::TooLarge(self.max_message);
        }
        emit(WorkerMessage::ResponseComplete(done));
        Outcome::Completed
    }
}

fn response_headers(resp: &ureq::http::Response<ureq::Body>) -> HeaderMap {
    resp.headers()
        .iter()
        .filter(|(name, _)| !SKIPPED_HEADERS.contains(&name.as_str()))
        .filter_map(|(name, value)| {
            Some((name.as_str().to_string(), value.to_str().ok()?.to_string()))
        })
        .collect()
}

/// Parses `{"data":[{"id":...},...]}`.
pub fn parse_model_list(body: &str) -> Result<Vec<String>, String> {
    let v: serde_json::Value =
        serde_json::from_str(body).map_err(|e| format!("/v1/models is not JSON: {e}"))?;
    let data = v
        .get("data")
        .and_then(|d| d.as_array())
        .ok_or("/v1/models has no `data` list")?;
    Ok(data
        .iter()
        .filter_map(|m| m.get("id")?.as_str().map(str::to_string))
        .collect())
}

/// Carries an incomplete UTF-8 sequence at the end of one read over to the next.
#[derive(Default)]
pub struct Utf8Carry {
    pending: Vec<u8>,
}

impl Utf8Carry {
    /// Returns all complete text so far; invalid bytes become U+FFFD.
    pub fn push(&mut self, bytes: &[u8]) -> String {
        self.pending.extend_from_slice(bytes);
        let mut out = String::new();
        loop {
            match std::str::from_utf8(&self.pending) {
                Ok(text) => {
                    out.push_str(text);
                    self.pending.clear();
                    return out;
                }
                Err(e) => {
                    let valid = e.valid_up_to();
                    out.push_str(&String::from_utf8_lossy(&self.pending[..valid]));
                    match e.error_len() {
                        // Incomplete sequence at the end: keep it for the next read.
                        None => {
                            self.pending.drain(..valid);
                            return out;
                        }
                        Some(bad) => {
                            out.push('\u{FFFD}');
                            self.pending.drain(..valid + bad);
                        }
                    }
                }
            }
        }
    }

    /// What is left at the end of the body (a truncated character becomes U+FFFD).
    pub fn finish(&mut self) -> String {
        let out = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        out
    }
}

pub mod url;

#[cfg(test)]
mod tests;
