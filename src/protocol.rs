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
//! * `wake` on `register`, `wake_peer`, `sleep_request` and `sleep_answer`: boxes that
//!   sleep and are woken on demand; see [`power`].

use std::collections::BTreeMap;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

pub mod lifecycle;
pub mod power;
pub mod size;
use crate::power::WakeAddress;
use lifecycle::{ModelOperation, OperationKind, OperationState, OperationStatus, WorkerStatus};

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

/// Every field any message may carry, all optional: one lenient pass over the JSON
/// (no intermediate tree), then [`Raw::need`] checks what the type requires.
#[derive(Deserialize, Default)]
struct Raw {
    #[serde(rename = "type")]
    kind: Option<String>,
    worker_name: Option<String>,
    worker_id: Option<String>,
    models: Option<Vec<String>>,
    warnings: Option<Vec<String>>,
    features: Option<Vec<String>>,
    max_concurrent: Option<u32>,
    protocol_version: Option<String>,
    current_load: Option<u32>,
    in_flight: Option<u32>,
    relays: Option<Vec<String>>,
    loaded_models: Option<Vec<String>>,
    backend_kind: Option<String>,
    model_info: Option<serde_json::Value>,
    request_id: Option<String>,
    model: Option<String>,
    endpoint_path: Option<String>,
    is_streaming: Option<bool>,
    body: Option<String>,
    headers: Option<HeaderMap>,
    reason: Option<serde_json::Value>,
    timestamp_unix_ms: Option<u64>,
    drain_timeout_secs: Option<u64>,
    heartbeat_interval_secs: Option<u64>,
    chunk: Option<String>,
    status_code: Option<u16>,
    token_counts: Option<TokenCounts>,
    code: Option<String>,
    message: Option<String>,
    retryable: Option<bool>,
    state: Option<String>,
    operation_id: Option<String>,
    operation: Option<String>,
    status: Option<String>,
    progress: Option<f64>,
    backend: Option<String>,
    backend_version: Option<String>,
    resources: Option<serde_json::Value>,
    wake: Option<serde_json::Value>,
    mac: Option<String>,
    broadcast: Option<String>,
    granted: Option<bool>,
    busy: Option<bool>,
}

fn need<T>(value: Option<T>, kind: &str, field: &str) -> Result<T, Malformed> {
    value.ok_or_else(|| Malformed(format!("`{kind}` message without `{field}`")))
}

fn parse_raw(text: &str) -> Result<(String, Raw), Malformed> {
    let raw: Raw =
        serde_json::from_str(text).map_err(|e| Malformed(format!("invalid JSON: {e}")))?;
    let kind = raw
        .kind
        .clone()
        .ok_or_else(|| Malformed("message without `type`".into()))?;
    Ok((kind, raw))
}

/// Reads a reason that is a string (or the serde shape `{"other": "..."}`).
fn reason_text(value: Option<serde_json::Value>) -> Option<String> {
    match value? {
        serde_json::Value::String(s) => Some(s),
        serde_json::Value::Object(map) => map
            .values()
            .next()
            .and_then(|v| v.as_str())
            .map(String::from),
        _ => None,
    }
}

impl WorkerMessage {
    /// Parses one text frame sent by a worker.
    pub fn parse(text: &str) -> Result<WorkerMessage, Malformed> {
        let (kind, r) = parse_raw(text)?;
        let k = kind.as_str();
        Ok(match k {
            "register" => WorkerMessage::Register(RegisterMessage {
                worker_name: r.worker_name.unwrap_or_default(),
                models: r.models.unwrap_or_default(),
                max_concurrent: need(r.max_concurrent, k, "max_concurrent")?,
                protocol_version: r.protocol_version,
                current_load: r.current_load,
                features: r.features.unwrap_or_default(),
                loaded_models: r.loaded_models,
                backend_kind: r.backend_kind,
                model_info: model_info_from(r.model_info),
                wake: power::wake_from(r.wake),
            }),
            "models_update" => WorkerMessage::ModelsUpdate {
                models: need(r.models, k, "models")?,
                current_load: r.current_load.unwrap_or(0),
                loaded_models: r.loaded_models,
                model_info: model_info_from(r.model_info),
            },
            "response_chunk" => WorkerMessage::ResponseChunk {
                request_id: need(r.request_id, k, "request_id")?,
                chunk: need(r.chunk, k, "chunk")?,
            },
            "response_complete" => WorkerMessage::ResponseComplete(ResponseComplete {
                request_id: need(r.request_id, k, "request_id")?,
                status_code: need(r.status_code, k, "status_code")?,
                headers: r.headers.unwrap_or_default(),
                body: r.body,
                token_counts: r.token_counts,
            }),
            "response_head" => WorkerMessage::ResponseHead {
                request_id: need(r.request_id, k, "request_id")?,
                status_code: need(r.status_code, k, "status_code")?,
                headers: r.headers.unwrap_or_default(),
            },
            "pong" => WorkerMessage::Pong {
                current_load: r.current_load.unwrap_or(0),
                timestamp_unix_ms: r.timestamp_unix_ms,
            },
            "error" => WorkerMessage::Error {
                request_id: r.request_id,
                code: r.code.unwrap_or_else(|| "worker_error".into()),
                message: r.message.unwrap_or_default(),
                status_code: r.status_code,
                retryable: r.retryable,
                headers: r.headers.unwrap_or_default(),
                body: r.body,
            },
            "worker_draining" => WorkerMessage::WorkerDraining {},
            "backend_status" => WorkerMessage::BackendStatus {
                state: match need(r.state, k, "state")?.as_str() {
                    "up" => BackendState::Up,
                    "down" => BackendState::Down,
                    other => return Err(Malformed(format!("unknown backend state `{other}`"))),
                },
                reason: reason_text(r.reason),
            },
            "operation_status" => {
                let status = need(r.status, k, "status")?;
                WorkerMessage::OperationStatus(OperationStatus {
                    operation_id: need(r.operation_id, k, "operation_id")?,
                    status: OperationState::parse(&status)
                        .ok_or_else(|| Malformed(format!("unknown operation status `{status}`")))?,
                    progress: lifecycle::permille(r.progress),
                    message: r.message,
                    backend: r.backend,
                })
            }
            "worker_status" => WorkerMessage::WorkerStatus(WorkerStatus {
                backend_version: r.backend_version,
                resources: lifecycle::resources_from(r.resources),
            }),
            "sleep_request" => WorkerMessage::SleepRequest {},
            "owner_status" => WorkerMessage::OwnerStatus {
                busy: need(r.busy, k, "busy")?,
            },
            "load" => WorkerMessage::Load {
                in_flight: need(r.in_flight, k, "in_flight")?,
            },
            "busy" => WorkerMessage::Busy {
                request_id: need(r.request_id, k, "request_id")?,
                in_flight: need(r.in_flight, k, "in_flight")?,
            },
            "relays" => WorkerMessage::Relays {
                relays: need(r.relays, k, "relays")?,
            },
            _ => WorkerMessage::Unknown(kind),
        })
    }
}

impl ServerMessage {
    /// Parses one text frame sent by a server.
    pub fn parse(text: &str) -> Result<ServerMessage, Malformed> {
        let (kind, r) = parse_raw(text)?;
        let k = kind.as_str();
        Ok(match k {
            "register_ack" => ServerMessage::RegisterAck(RegisterAck {
                worker_id: need(r.worker_id, k, "worker_id")?,
                models: r.models.unwrap_or_default(),
                warnings: r.warnings.unwrap_or_default(),
                protocol_version: r.protocol_version,
                features: r.features.unwrap_or_default(),
                heartbeat_interval_secs: r.heartbeat_interval_secs,
            }),
            "request" => ServerMessage::Request(Arc::new(RequestMessage {
                request_id: need(r.request_id, k, "request_id")?,
                model: r.model.unwrap_or_default(),
                endpoint_path: need(r.endpoint_path, k, "endpoint_path")?,
                is_streaming: r.is_streaming.unwrap_or(false),
                body: Arc::from(r.body.unwrap_or_default()),
                headers: r.headers.unwrap_or_default(),
            })),
            "cancel" => ServerMessage::Cancel {
                request_id: need(r.request_id, k, "request_id")?,
                reason: cancel_reason(reason_text(r.reason).as_deref()),
            },
            "ping" => ServerMessage::Ping {
                timestamp_unix_ms: r.timestamp_unix_ms,
            },
            "graceful_shutdown" => ServerMessage::GracefulShutdown {
                reason: reason_text(r.reason),
                drain_timeout_secs: r.drain_timeout_secs,
            },
            "models_refresh" => ServerMessage::ModelsRefresh {
                reason: reason_text(r.reason),
            },
            "model_operation" => {
                let op = need(r.operation, k, "operation")?;
                ServerMessage::ModelOperation(ModelOperation {
                    operation_id: need(r.operation_id, k, "operation_id")?,
                    operation: OperationKind::parse(&op)
                        .ok_or_else(|| Malformed(format!("unknown operation `{op}`")))?,
                    model: r.model.filter(|m| !m.is_empty()),
                })
            }
            "wake_peer" => ServerMessage::WakePeer {
                worker_name: r.worker_name.unwrap_or_default(),
                mac: need(r.mac, k, "mac")?,
                broadcast: need(r.broadcast, k, "broadcast")?,
            },
            "sleep_answer" => ServerMessage::SleepAnswer {
                granted: need(r.granted, k, "granted")?,
                reason: reason_text(r.reason),
            },
            _ => ServerMessage::Unknown(kind),
        })
    }
}

fn cancel_reason(text: Option<&str>) -> CancelReason {
    match text {
        Some("timeout") => CancelReason::Timeout,
        Some("graceful_shutdown") => CancelReason::GracefulShutdown,
        Some("worker_disconnect") => CancelReason::WorkerDisconnect,
        Some("requeue_exhausted") => CancelReason::RequeueExhausted,
        Some("server_shutdown") => CancelReason::ServerShutdown,
        _ => CancelReason::ClientDisconnect,
    }
}

/// Serializes a message to its JSON text. Our types always serialize; a failure would be
/// a bug, reported as an empty object rather than a panic.
pub fn to_json<T: Serialize>(message: &T) -> String {
    serde_json::to_string(message).unwrap_or_else(|_| "{}".to_string())
}

#[cfg(test)]
mod tests;
