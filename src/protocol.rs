//! Wire protocol v1 between `modelrelay-server` and `modelrelay-worker`.
//!
//! Every WebSocket text frame carries one JSON object tagged by `"type"`. The shapes match
//! the deployed ModelRelay protocol byte for byte, so either side interoperates with the
//! original implementation. Parsing is deliberately lenient: unknown fields are ignored,
//! unknown message types decode to [`WorkerMessage::Unknown`] / [`ServerMessage::Unknown`]
//! and a message missing a required field is an [`Malformed`] error the caller logs and
//! skips. Nothing here ever closes a connection by itself.
//!
//! Extensions (all optional, only used when the peer opted in):
//! * `features` on `register` and `register_ack`: the capabilities each side supports.
//! * `status_code` on `error`: the HTTP status the worker wants the client to see.
//! * `worker_draining` (worker → server): "finish my in-flight work, send me nothing new".
//!   Only sent when the server listed [`FEATURE_WORKER_DRAIN`] in its `register_ack`.
//! * `retryable` on `error`: the request failed before the backend sent anything back
//!   (connection refused or reset, connect timeout, 502/503/504), so the server may run
//!   it on another worker. A server that does not know the field sees today's error.
//! * `headers` and `body` on `error`: the backend's own answer to a request reported as
//!   retryable (status in `status_code`). When the server runs it nowhere else, the
//!   client gets that answer unchanged, not the server's own error.
//! * `loaded_models` and `backend_kind` on `register`, `loaded_models` on `models_update`:
//!   which advertised models the backend holds in memory (routing prefers those).
//! * `model_info` on `register` and `models_update`: model name → `{"context_length":
//!   <u64 or null>, "capabilities": [...]}` as the backend describes it (`/api/show`
//!   answers from it). Read leniently: a malformed entry is dropped, never the message.
//! * `backend_status` (worker → server, `{"state": "up"|"down", "reason": ...}`): the
//!   worker's backend went down or came back. Only sent when the server listed
//!   [`FEATURE_BACKEND_HEALTH`]; toward any other server the worker advertises an
//!   empty model list while its backend is down instead.
//! * `heartbeat_interval_secs` on `register_ack`: the server's ping period, sent to
//!   workers that listed [`FEATURE_HEARTBEAT_INTERVAL`] (a worker on a black-holed
//!   connection then notices the silence even before it saw two pings).
//! * `response_head` (worker → server): the backend's status and headers of a streamed
//!   answer before its first chunk, so headers the worker adds (`X-Context-Trimmed`)
//!   reach the client with the stream's head. Only between sides that both listed
//!   [`FEATURE_RESPONSE_HEAD`].
//! * `model_operation`, `operation_status` and `worker_status`: load, unload and flush
//!   models on request, and report the backend's version and resources; see
//!   [`lifecycle`] (feature [`lifecycle::FEATURE_LIFECYCLE`]).
//! * `body_encoding` on `request`: a base64 body, answered in base64 (bytes such as
//!   audio and multipart forms); only toward workers that listed
//!   [`binary::FEATURE_BINARY_BODIES`]. See [`binary`].
//! * `routes` on `register`: which relayed routes beyond chat the backend serves; the
//!   server sends a route only to workers that serve it (or did not say).
//! * `wake` on `register`, `wake_peer`, `sleep_request` and `sleep_answer`: boxes that
//!   sleep and are woken on demand; see [`power`].
//! * `prefixes` (both ways): cache affinity across relays; see [`affinity`] (feature
//!   [`affinity::FEATURE_AFFINITY_REPORTS`]).
//! * `continuation` on `request`: go on with an answer another worker began; see
//!   [`continuation`] (feature [`continuation::FEATURE_CONTINUATION`]).
//! * `held` on `request`, `attach` (server → worker): a resumable stream kept on the
//!   worker, resumed through another relay; see [`held`] (feature
//!   [`held::FEATURE_HELD_STREAMS`]).
//! * `body_piece` (server → worker) and `body_credit` (worker → server): a large
//!   request body in pieces with flow control; see [`pieces`] (feature
//!   [`pieces::FEATURE_BODY_PIECES`]). `answer_credit` (server → worker): how far a
//!   binary answer may run ahead of the client (feature
//!   [`pieces::FEATURE_ANSWER_CREDIT`]).
//! * A whole `response_complete` as one binary message, its body unescaped; see
//!   [`raw_bodies`] (feature [`raw_bodies::FEATURE_RAW_BODIES`]).

use std::collections::BTreeMap;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

pub mod affinity;
pub mod binary;
pub mod continuation;
pub mod held;
pub mod lifecycle;
mod parse;
pub mod pieces;
pub mod power;
pub mod raw_bodies;
pub mod size;
use crate::power::WakeAddress;
use lifecycle::{ModelOperation, OperationStatus, WorkerStatus};

/// Protocol version string of this implementation.
pub const PROTOCOL_VERSION: &str = "1";
/// Version string sent by deployed ModelRelay 0.2.x workers and required by its servers.
pub const BRIDGE_PROTOCOL_VERSION: &str = "2026-04-bridge-v1";
/// Server feature: the worker may send `worker_draining`.
pub const FEATURE_WORKER_DRAIN: &str = "worker_drain";
/// Worker feature: the worker answers every `cancel` with a final message for that id.
pub const FEATURE_CANCEL_ACK: &str = "cancel_ack";
/// Server feature: the worker may send `backend_status`.
pub const FEATURE_BACKEND_HEALTH: &str = "backend_health";
/// Worker feature: send `heartbeat_interval_secs` in `register_ack`.
pub const FEATURE_HEARTBEAT_INTERVAL: &str = "heartbeat_interval";
/// Feature of both sides: the worker sends `response_head` before a streamed body.
pub const FEATURE_RESPONSE_HEAD: &str = "response_head";
/// Server feature: `error.retryable` is read, and such requests fail over to another
/// worker. Workers list it too, so the server knows their errors carry the field.
pub const FEATURE_FAILOVER: &str = "failover";
/// A worker serving several relays lists it; a server that lists it back reads `load`
/// (the worker's live load across all its relays, sent whenever it changes).
pub const FEATURE_LOAD_REPORTS: &str = "load_reports";
/// A worker serving several relays lists it; a server that lists it back understands
/// `busy` (a request refused because other relays took every slot: dispatch it again,
/// not a failure) and the worker then refuses rather than queues.
pub const FEATURE_BUSY: &str = "busy";

/// Whether a worker's backend answers (`backend_status.state`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BackendState {
    Up,
    Down,
}

impl BackendState {
    pub fn as_str(self) -> &'static str {
        match self {
            BackendState::Up => "up",
            BackendState::Down => "down",
        }
    }
}

/// Whether a worker announcing `version` can be served (absent = legacy worker, accepted).
pub fn is_supported_version(version: Option<&str>) -> bool {
    matches!(
        version,
        None | Some(PROTOCOL_VERSION) | Some(BRIDGE_PROTOCOL_VERSION)
    )
}

/// Header names and values, lower-case names by convention.
pub type HeaderMap = BTreeMap<String, String>;

/// Token usage reported by a backend.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TokenCounts {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prompt_tokens: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub completion_tokens: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub total_tokens: Option<u64>,
}

/// What a backend says about one of its models (`model_info` entries).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct ModelInfo {
    /// The context window in tokens; `null` when the backend did not say.
    pub context_length: Option<u64>,
    /// Ollama's capability names: `completion`, `tools`, `vision`, `embedding`, ...
    pub capabilities: Vec<String>,
}

/// Model name → what its backend says about it.
pub type ModelInfoMap = BTreeMap<String, ModelInfo>;

/// Reads `model_info` leniently: anything but an object is absent; an entry that is not
/// an object is dropped; a context length that is not a `u64` is `null`; capabilities
/// that are not strings are dropped.
fn model_info_from(value: Option<serde_json::Value>) -> Option<ModelInfoMap> {
    let serde_json::Value::Object(map) = value? else {
        return None;
    };
    Some(
        map.into_iter()
            .filter_map(|(name, entry)| {
                let entry = entry.as_object()?;
                let capabilities = entry
                    .get("capabilities")
                    .and_then(serde_json::Value::as_array)
                    .map(|list| {
                        list.iter()
                            .filter_map(|c| c.as_str().map(String::from))
                            .collect()
                    })
                    .unwrap_or_default();
                let info = ModelInfo {
                    context_length: entry
                        .get("context_length")
                        .and_then(serde_json::Value::as_u64),
                    capabilities,
                };
                Some((name, info))
            })
            .collect(),
    )
}

/// `register`: first message a worker sends.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct RegisterMessage {
    pub worker_name: String,
    pub models: Vec<String>,
    pub max_concurrent: u32,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub protocol_version: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub current_load: Option<u32>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub features: Vec<String>,
    /// Extension: which of `models` the backend holds in memory now (the rest load on
    /// first use). Absent: unknown, every model counts as available only.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub loaded_models: Option<Vec<String>>,
    /// Extension: what the backend is (`ollama`, `llama-server`, `vllm`, `openai`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub backend_kind: Option<String>,
    /// Extension: what the backend says about `models` (context length, capabilities).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub model_info: Option<ModelInfoMap>,
    /// Extension: where a magic packet wakes this box (see [`power`]).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub wake: Option<WakeAddress>,
    /// Extension: the relayed routes beyond chat (`/tokenize`, `/v1/audio/speech`, ...)
    /// the backend serves, when the worker can tell. Absent: unknown (may serve any).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub routes: Option<Vec<String>>,
}

/// `register_ack`: the server's answer to `register`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct RegisterAck {
    pub worker_id: String,
    pub models: Vec<String>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub warnings: Vec<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub protocol_version: Option<String>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub features: Vec<String>,
    /// Extension: how often the server pings, for workers that listed
    /// [`FEATURE_HEARTBEAT_INTERVAL`]: they treat three intervals of silence as a dead
    /// connection from the start, not only once two pings showed the interval.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub heartbeat_interval_secs: Option<u64>,
}

/// `request`: one inference request for a worker. The body is the client's raw JSON.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct RequestMessage {
    pub request_id: String,
    pub model: String,
    pub endpoint_path: String,
    pub is_streaming: bool,
    pub body: Arc<str>,
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub headers: HeaderMap,
    /// Extension ([`binary`]): `"base64"` when `body` and the answer are base64.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub body_encoding: Option<String>,
    /// Extension: the answer began on another worker; go on from this text (sent only
    /// to workers that listed [`continuation::FEATURE_CONTINUATION`]).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub continuation: Option<continuation::Continuation>,
    /// Extension: keep this resumable stream's events on the worker (sent only to
    /// workers that listed [`held::FEATURE_HELD_STREAMS`]).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub held: Option<held::Hold>,
}

/// Why the server cancels a request (`cancel.reason`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum CancelReason {
    ClientDisconnect,
    Timeout,
    GracefulShutdown,
    WorkerDisconnect,
    RequeueExhausted,
    ServerShutdown,
}

impl CancelReason {
    /// The wire spelling, also used in log lines and metrics.
    pub fn as_str(self) -> &'static str {
        match self {
            CancelReason::ClientDisconnect => "client_disconnect",
            CancelReason::Timeout => "timeout",
            CancelReason::GracefulShutdown => "graceful_shutdown",
            CancelReason::WorkerDisconnect => "worker_disconnect",
            CancelReason::RequeueExhausted => "requeue_exhausted",
            CancelReason::ServerShutdown => "server_shutdown",
        }
    }
}

/// Messages the server sends to a worker.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ServerMessage {
    RegisterAck(RegisterAck),
    Request(Arc<RequestMessage>),
    Cancel {
        request_id: String,
        reason: CancelReason,
    },
    Ping {
        #[serde(skip_serializing_if = "Option::is_none")]
        timestamp_unix_ms: Option<u64>,
    },
    GracefulShutdown {
        #[serde(skip_serializing_if = "Option::is_none")]
        reason: Option<String>,
        #[serde(skip_serializing_if = "Option::is_none")]
        drain_timeout_secs: Option<u64>,
    },
    ModelsRefresh {
        #[serde(skip_serializing_if = "Option::is_none")]
        reason: Option<String>,
    },
    /// Extension: load, unload or flush a model (see [`lifecycle`]).
    ModelOperation(ModelOperation),
    /// Extension: send a magic packet to wake another box (see [`power`]).
    WakePeer {
        worker_name: String,
        mac: String,
        broadcast: String,
    },
    /// Extension: whether the worker may go to sleep (see [`power`]).
    SleepAnswer {
        granted: bool,
        #[serde(skip_serializing_if = "Option::is_none")]
        reason: Option<String>,
    },
    /// Extension: the prefixes of the request that follows (see [`affinity`]).
    Prefixes(affinity::PrefixNote),
    /// Extension: a client resumes a stream a worker holds (see [`held`]).
    Attach(held::Attach),
    /// Extension: the worker may send the chunks of the request's binary answer numbered
    /// below `until` (see [`pieces::FEATURE_ANSWER_CREDIT`]).
    AnswerCredit {
        request_id: String,
        until: u64,
    },
    /// Extension: one piece of a request body that follows its request (see [`pieces`]).
    BodyPiece {
        request_id: String,
        seq: u64,
        chunk: String,
        #[serde(skip_serializing_if = "std::ops::Not::not")]
        last: bool,
    },
    /// A type this side does not know; never serialized.
    #[serde(skip)]
    Unknown(String),
}

/// `response_complete`: the end of a request, with the backend's status.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct ResponseComplete {
    pub request_id: String,
    pub status_code: u16,
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub headers: HeaderMap,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub body: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub token_counts: Option<TokenCounts>,
}

/// Messages a worker sends to the server.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum WorkerMessage {
    Register(RegisterMessage),
    ModelsUpdate {
        models: Vec<String>,
        current_load: u32,
        /// Extension: see [`RegisterMessage::loaded_models`].
        #[serde(skip_serializing_if = "Option::is_none")]
        loaded_models: Option<Vec<String>>,
        /// Extension: see [`RegisterMessage::model_info`]. Absent: unchanged.
        #[serde(skip_serializing_if = "Option::is_none")]
        model_info: Option<ModelInfoMap>,
    },
    ResponseChunk {
        request_id: String,
        chunk: String,
    },
    ResponseComplete(ResponseComplete),
    /// Extension: the backend's status and headers of a streamed answer, before its
    /// first chunk (`response_complete` still ends it). Sent only to a server that listed
    /// [`FEATURE_RESPONSE_HEAD`].
    ResponseHead {
        request_id: String,
        status_code: u16,
        #[serde(skip_serializing_if = "BTreeMap::is_empty")]
        headers: HeaderMap,
    },
    Pong {
        current_load: u32,
        #[serde(skip_serializing_if = "Option::is_none")]
        timestamp_unix_ms: Option<u64>,
    },
    Error {
        #[serde(skip_serializing_if = "Option::is_none")]
        request_id: Option<String>,
        code: String,
        message: String,
        #[serde(skip_serializing_if = "Option::is_none")]
        status_code: Option<u16>,
        /// Extension: nothing reached the backend's answer yet; safe to run elsewhere.
        #[serde(skip_serializing_if = "Option::is_none")]
        retryable: Option<bool>,
        /// Extension, with `body`: the backend's own answer's headers.
        #[serde(skip_serializing_if = "BTreeMap::is_empty")]
        headers: HeaderMap,
        /// Extension: the backend's whole answer (status in `status_code`). A server that
        /// does not run the request elsewhere gives it to the client as it is.
        #[serde(skip_serializing_if = "Option::is_none")]
        body: Option<String>,
    },
    /// Extension: the worker is draining and wants no new requests.
    WorkerDraining {},
    /// Extension: the worker's backend went down or came back.
    BackendStatus {
        state: BackendState,
        #[serde(skip_serializing_if = "Option::is_none")]
        reason: Option<String>,
    },
    /// Extension: how a `model_operation` goes (see [`lifecycle`]).
    OperationStatus(OperationStatus),
    /// Extension: the backend's version and resources (see [`lifecycle`]).
    WorkerStatus(WorkerStatus),
    /// Extension: the worker has been idle and asks to sleep (see [`power`]).
    SleepRequest {},
    /// Extension: the box's owner uses it (take nothing new) or is done (see [`power`]).
    OwnerStatus {
        busy: bool,
    },
    /// Extension ([`FEATURE_LOAD_REPORTS`]): requests running or waiting on the worker,
    /// from every relay it serves.
    Load {
        in_flight: u32,
    },
    /// Extension ([`FEATURE_BUSY`]): every slot is taken (by other relays); the request
    /// never reached the backend. `in_flight` as in `load`.
    Busy {
        request_id: String,
        in_flight: u32,
    },
    /// Extension ([`FEATURE_LOAD_REPORTS`]): the relays the worker is registered with
    /// now (their connect URLs), sent whenever that changes.
    Relays {
        relays: Vec<String>,
    },
    /// Extension: prefixes another relay sent this worker (see [`affinity`]).
    Prefixes(affinity::PrefixNote),
    /// Extension: the server may send the request's body pieces numbered below `until`
    /// (see [`pieces`]).
    BodyCredit {
        request_id: String,
        until: u64,
    },
    /// A type this side does not know; never serialized.
    #[serde(skip)]
    Unknown(String),
}

/// A message that is valid JSON but lacks what its type requires.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Malformed(pub String);

impl std::fmt::Display for Malformed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// Serializes a message to its JSON text. Our types always serialize; a failure would be
/// a bug, reported as an empty object rather than a panic.
pub fn to_json<T: Serialize>(message: &T) -> String {
    serde_json::to_string(message).unwrap_or_else(|_| "{}".to_string())
}

/// [`to_json`] into a buffer of `capacity` bytes to begin with (see the messages'
/// `text_hint` in `size.rs`). serde_json writes only UTF-8, so the check that turns the
/// bytes into text never fails; were it to, the answer is the same empty object.
pub fn to_json_sized<T: Serialize>(message: &T, capacity: usize) -> String {
    let mut out = Vec::with_capacity(capacity);
    match serde_json::to_writer(&mut out, message) {
        Ok(()) => String::from_utf8(out).unwrap_or_else(|_| "{}".to_string()),
        Err(_) => "{}".to_string(),
    }
}

#[cfg(test)]
mod tests;
