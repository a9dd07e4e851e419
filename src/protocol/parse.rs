//! The lenient decoder of incoming frames: one serde pass into [`Raw`] (every field any
//! message may carry, all optional), then a per-type check of the fields that type
//! requires. Kept apart from the message types in the parent module because it is the
//! one place that decides what a malformed or unknown frame becomes (a [`Malformed`]
//! error or an `Unknown` variant, never a closed connection); the types themselves only
//! describe the wire shapes.

use std::borrow::Cow;
use std::sync::Arc;

use serde::Deserialize;

use super::affinity::{self, PrefixNote};
use super::lifecycle::{
    self, ModelOperation, OperationKind, OperationState, OperationStatus, WorkerStatus,
};
use super::{
    model_info_from, power, BackendState, CancelReason, HeaderMap, Malformed, RegisterAck,
    RegisterMessage, RequestMessage, ResponseComplete, ServerMessage, TokenCounts, WorkerMessage,
};

/// `request.continuation`, read leniently (a missing prefix is an empty one).
#[derive(Deserialize, Default)]
struct RawContinuation {
    prefix: Option<String>,
    tokens: Option<u64>,
}

/// Every field any message may carry, all optional: one lenient pass over the JSON
/// (no intermediate tree), then [`Raw::need`] checks what the type requires.
#[derive(Deserialize, Default)]
struct Raw<'a> {
    /// Borrowed from the frame when it needs no unescaping (always, in practice): the
    /// type only picks the branch, so it is never copied.
    #[serde(rename = "type", borrow)]
    kind: Option<Cow<'a, str>>,
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
    routes: Option<Vec<String>>,
    loaded_models: Option<Vec<String>>,
    backend_kind: Option<String>,
    model_info: Option<serde_json::Value>,
    request_id: Option<String>,
    model: Option<String>,
    endpoint_path: Option<String>,
    is_streaming: Option<bool>,
    body: Option<String>,
    body_encoding: Option<String>,
    headers: Option<HeaderMap>,
    continuation: Option<RawContinuation>,
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
    prefixes: Option<affinity::Bounded>,
    held: Option<RawHold>,
    stream_id: Option<String>,
    after: Option<u64>,
    proof: Option<String>,
    seq: Option<u64>,
    last: Option<bool>,
    until: Option<u64>,
}

/// `request.held`, read leniently (no proof: nobody may attach).
#[derive(Deserialize, Default)]
struct RawHold {
    grace_secs: Option<u64>,
    proof: Option<String>,
}

fn need<T>(value: Option<T>, kind: &str, field: &str) -> Result<T, Malformed> {
    value.ok_or_else(|| Malformed(format!("`{kind}` message without `{field}`")))
}

fn parse_raw(text: &str) -> Result<(Cow<'_, str>, Raw<'_>), Malformed> {
    let mut raw: Raw =
        serde_json::from_str(text).map_err(|e| Malformed(format!("invalid JSON: {e}")))?;
    let kind = raw
        .kind
        .take()
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
        let k: &str = &kind;
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
                routes: r.routes,
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
            "prefixes" => WorkerMessage::Prefixes(prefix_note(r, k)?),
            "body_credit" => WorkerMessage::BodyCredit {
                request_id: need(r.request_id, k, "request_id")?,
                until: need(r.until, k, "until")?,
            },
            _ => WorkerMessage::Unknown(kind.into_owned()),
        })
    }
}

impl ServerMessage {
    /// Parses one text frame sent by a server.
    pub fn parse(text: &str) -> Result<ServerMessage, Malformed> {
        let (kind, r) = parse_raw(text)?;
        let k: &str = &kind;
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
                body_encoding: r.body_encoding,
                continuation: r.continuation.map(|c| super::continuation::Continuation {
                    prefix: c.prefix.unwrap_or_default(),
                    tokens: c.tokens.unwrap_or(0),
                }),
                held: r.held.map(|h| super::held::Hold {
                    grace_secs: h.grace_secs.unwrap_or(0),
                    proof: h.proof.unwrap_or_default(),
                }),
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
            "prefixes" => ServerMessage::Prefixes(prefix_note(r, k)?),
            "attach" => ServerMessage::Attach(super::held::Attach {
                request_id: need(r.request_id, k, "request_id")?,
                stream_id: need(r.stream_id, k, "stream_id")?,
                after: r.after.unwrap_or(0),
                proof: need(r.proof, k, "proof")?,
            }),
            "answer_credit" => ServerMessage::AnswerCredit {
                request_id: need(r.request_id, k, "request_id")?,
                until: need(r.until, k, "until")?,
            },
            "body_piece" => ServerMessage::BodyPiece {
                request_id: need(r.request_id, k, "request_id")?,
                seq: need(r.seq, k, "seq")?,
                chunk: need(r.chunk, k, "chunk")?,
                last: r.last.unwrap_or(false),
            },
            _ => ServerMessage::Unknown(kind.into_owned()),
        })
    }
}

fn prefix_note(r: Raw<'_>, k: &str) -> Result<PrefixNote, Malformed> {
    Ok(PrefixNote {
        model: need(r.model, k, "model")?,
        prefixes: need(r.prefixes, k, "prefixes")?.0,
    })
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
