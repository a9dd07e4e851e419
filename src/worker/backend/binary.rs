//! Requests of binary routes (`body_encoding: "base64"`, `protocol::binary`): audio
//! uploads, multipart forms, generated speech. The body is decoded and sent to the
//! backend as bytes; the answer goes back base64-encoded, a piece per read, so a long
//! audio answer streams through in bounded memory whatever its size. An error status
//! goes back whole (bounded like any whole answer) for the client to see as sent.
//!
//! Nothing of the text path applies: no UTF-8 carry, no usage injection, no context
//! trim. The backend's `Content-Length` travels in the head so the client gets the
//! answer framed as the backend framed it.

use std::io::Read;

use super::failure::unavailable;
use super::{response_headers, Backend, Outcome, UNAVAILABLE_STATUSES};
use crate::protocol::binary::{self, BASE64};
use crate::protocol::pieces::PIECES;
use crate::protocol::{HeaderMap, RequestMessage, ResponseComplete, WorkerMessage};
use crate::worker::inflight::Handle;
use crate::worker::stream_usage::usage_from_json;

/// Raw bytes read per chunk: 64 KiB once encoded.
const READ_BYTES: usize = 48 * 1024;
/// A JSON answer (a transcription) up to this size is also scanned for token usage.
const USAGE_SCAN_BYTES: usize = 1 << 20;

/// Runs one binary request (the caller checked the path).
pub(super) fn forward(
    backend: &Backend,
    uri: &ureq::http::Uri,
    agent: &mut ureq::Agent,
    req: &RequestMessage,
    handle: &Handle,
    failover: bool,
    emit: &mut dyn FnMut(WorkerMessage),
) -> Outcome {
    let sent = match req.body_encoding.as_deref() {
        Some(PIECES) => super::pieces::send(backend, uri, agent, req, handle, emit),
        Some(BASE64) => {
            let Ok(body) = binary::decode(&req.body) else {
                return Outcome::Failed("the request body is not valid base64".into());
            };
            backend.send_once(uri, agent, req, &body, handle)
        }
        _ => {
            return Outcome::Failed(
                "unknown body_encoding (this worker knows base64 and base64-pieces)".into(),
            )
        }
    };
    let response = match sent {
        Ok(response) => response,
        Err(outcome) => return outcome,
    };
    let status = response.status().as_u16();
    let mut headers = response_headers(&response);
    if let Some(len) = response.headers().get("content-length") {
        if let Ok(len) = len.to_str() {
            headers.insert("content-length".into(), len.to_string());
        }
    }
    let reader = response.into_body().into_reader();
    if failover && UNAVAILABLE_STATUSES.contains(&status) {
        headers.remove("content-length");
        // The server may hand this answer to the client: encoded like any other.
        return match unavailable(status, headers, reader, backend.max_body, handle) {
            Outcome::Unavailable {
                status,
                headers,
                body,
            } => Outcome::Unavailable {
                status,
                headers,
                body: body.map(|b| binary::encode(b.as_bytes())),
            },
            other => other,
        };
    }
    if status >= 400 {
        return whole(backend, req, status, headers, reader, handle, emit);
    }
    stream(req, status, headers, reader, handle, emit)
}

/// An error answer, whole and encoded, within what one message may carry.
fn whole(
    backend: &Backend,
    req: &RequestMessage,
    status: u16,
    mut headers: HeaderMap,
    reader: impl Read,
    handle: &Handle,
    emit: &mut dyn FnMut(WorkerMessage),
) -> Outcome {
    let bytes = match backend.read_whole(reader, None, handle) {
        Ok(bytes) => bytes,
        Err(outcome) => return outcome,
    };
    let encoded = binary::encoded_len(bytes.len());
    if bytes.len() > backend.max_body || encoded > backend.max_message.saturating_sub(1 << 20) {
        return Outcome::TooLarge(backend.max_body);
    }
    headers.remove("content-length");
    let token_counts = std::str::from_utf8(&bytes).ok().and_then(usage_from_json);
    emit(WorkerMessage::ResponseComplete(ResponseComplete {
        request_id: req.request_id.clone(),
        status_code: status,
        headers,
        body: Some(binary::encode(&bytes)),
        token_counts,
    }));
    Outcome::Completed
}

/// A successful answer, a base64 chunk per read.
fn stream(
    req: &RequestMessage,
    status: u16,
    headers: HeaderMap,
    mut reader: impl Read,
    handle: &Handle,
    emit: &mut dyn FnMut(WorkerMessage),
) -> Outcome {
    emit(WorkerMessage::ResponseHead {
        request_id: req.request_id.clone(),
        status_code: status,
        headers: headers.clone(),
    });
    let json = headers
        .get("content-type")
        .is_some_and(|t| t.contains("json"));
    let mut scanned: Vec<u8> = Vec::new();
    let mut buf = vec![0u8; READ_BYTES];
    let mut sent = 0u64;
    loop {
        // A client that reads slowly holds the backend back (`answer_credit`).
        if !handle.wait_answer(sent) {
            return Outcome::Cancelled;
        }
        match reader.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => {
                sent += 1;
                if json && scanned.len() + n <= USAGE_SCAN_BYTES {
                    scanned.extend_from_slice(&buf[..n]);
                }
                emit(WorkerMessage::ResponseChunk {
                    request_id: req.request_id.clone(),
                    chunk: binary::encode(&buf[..n]),
                });
            }
            Err(_) if handle.is_cancelled() => return Outcome::Cancelled,
            Err(e) => return Outcome::StreamBroken(e.to_string()),
        }
    }
    let token_counts = std::str::from_utf8(&scanned).ok().and_then(usage_from_json);
    let mut headers = headers;
    headers.remove("content-length");
    emit(WorkerMessage::ResponseComplete(ResponseComplete {
        request_id: req.request_id.clone(),
        status_code: status,
        headers,
        body: None,
        token_counts,
    }));
    Outcome::Completed
}
