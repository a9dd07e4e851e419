//! Answers of binary routes (`endpoints.rs`): the worker sends the backend's bytes
//! base64-encoded (`protocol::binary`), each chunk on its own, and they reach the client
//! decoded, with the backend's own `Content-Type`, `Content-Disposition` and length.
//! None of the SSE machinery applies (no held start, no event boundaries, no reshaping):
//! a stream that breaks is cut, the connection closed, so the client sees a short body
//! (fewer bytes than `Content-Length`, or no last chunk) and never a corrupted one.

use log::debug;

use super::super::errors::ApiError;
use super::super::http::response::{self, Framing};
use super::Session;
use crate::protocol::pieces::ANSWER_WINDOW;
use crate::protocol::{binary, HeaderMap, ResponseComplete};
use crate::server::dispatcher::runtime::Input;
use crate::server::dispatcher::{ClientEvent, Event};
use crate::server::reply::error_response;

/// Backend headers a binary answer carries to the client, beyond the relay's own.
const PASSED: &[&str] = &[
    "content-type",
    "content-disposition",
    "content-language",
    "cache-control",
    "etag",
    "last-modified",
];

/// A binary answer in progress.
#[derive(Debug)]
pub(super) struct Binary {
    /// The backend's headers from `response_head`.
    head: HeaderMap,
    /// A chunk did not decode: the answer is cut, never ended as if whole.
    broken: bool,
    /// Chunks taken from the worker, and how far the worker may go
    /// (`protocol::pieces::FEATURE_ANSWER_CREDIT`).
    chunks: u64,
    granted: u64,
}

impl Default for Binary {
    fn default() -> Binary {
        Binary {
            head: HeaderMap::new(),
            broken: false,
            chunks: 0,
            granted: ANSWER_WINDOW,
        }
    }
}

impl Session<'_, '_> {
    /// The backend's head of a streamed binary answer.
    pub(super) fn binary_head(&mut self, headers: HeaderMap) {
        if let Some(b) = &mut self.binary {
            b.head = headers;
        }
    }

    /// One base64 chunk of a binary stream: written decoded. A chunk that does not
    /// decode ends the answer (cut, never passed on as text).
    pub(super) fn push_binary_chunk(&mut self, buf: &mut Vec<u8>, chunk: &str) -> bool {
        if self.binary.as_ref().is_some_and(|b| b.broken) {
            return false;
        }
        let Ok(bytes) = binary::decode(chunk) else {
            debug!("request {}: a binary chunk is not base64", self.wire);
            if let Some(b) = &mut self.binary {
                b.broken = true;
            }
            self.keep_alive = false;
            return false;
        };
        let framing = self.open_binary(buf);
        if self.first_chunk.is_none() {
            self.first_chunk = Some(self.started.elapsed());
        }
        response::push_chunk(buf, &bytes, framing);
        if let Some(b) = &mut self.binary {
            b.chunks += 1;
        }
        true
    }

    /// After a write reached the client: the worker may send more of a binary answer,
    /// granted half a window at a time (one message per 16 chunks, not per chunk).
    pub(super) fn grant_answer(&mut self) {
        let Some(b) = &mut self.binary else {
            return;
        };
        if b.granted >= b.chunks + ANSWER_WINDOW / 2 {
            return;
        }
        b.granted = b.chunks + ANSWER_WINDOW;
        let credit = Event::AnswerCredit {
            id: self.id,
            until: b.granted,
        };
        let _ = self.ctx.inputs.send(Input::Event(credit));
    }

    /// The head of a streamed binary answer, once: the backend's length when it sent
    /// one (and this is no HTTP/1.0 client), else chunked.
    fn open_binary(&mut self, buf: &mut Vec<u8>) -> Framing {
        if let Some(f) = self.framing {
            return f;
        }
        let head = self
            .binary
            .as_ref()
            .map(|b| b.head.clone())
            .unwrap_or_default();
        let length = head
            .get("content-length")
            .and_then(|v| v.trim().parse::<usize>().ok());
        let framing = match (self.http10, length) {
            (_, Some(n)) => Framing::Length(n),
            (true, None) => Framing::UntilClose,
            (false, None) => Framing::Chunked,
        };
        self.write_binary_head(buf, 200, &head, framing);
        self.framing = Some(framing);
        framing
    }

    fn write_binary_head(
        &mut self,
        buf: &mut Vec<u8>,
        status: u16,
        backend: &HeaderMap,
        framing: Framing,
    ) {
        self.status = status;
        let relay = self.relay_headers();
        let mut headers: Vec<(&str, &str)> = backend
            .iter()
            .filter(|(n, _)| PASSED.iter().any(|p| n.eq_ignore_ascii_case(p)))
            .map(|(n, v)| (n.as_str(), v.as_str()))
            .collect();
        if !headers
            .iter()
            .any(|(n, _)| n.eq_ignore_ascii_case("content-type"))
        {
            headers.push(("content-type", "application/octet-stream"));
        }
        headers.extend(relay.iter().map(|(n, v)| (*n, v.as_ref())));
        response::head_into(buf, status, &headers, framing, self.keep_alive);
    }

    /// The final event of a binary answer.
    pub(super) fn push_binary_final(&mut self, buf: &mut Vec<u8>, event: ClientEvent) {
        match (self.framing, event) {
            (None, ClientEvent::Complete(rc)) => self.push_binary_whole(buf, rc),
            (Some(framing), ClientEvent::Complete(rc)) => {
                if let Some(rest) = rc.body.as_deref().filter(|b| !b.is_empty()) {
                    if !self.push_binary_chunk(buf, rest) {
                        self.keep_alive = false;
                        return;
                    }
                }
                if self.binary.as_ref().is_some_and(|b| b.broken) {
                    self.keep_alive = false;
                    return;
                }
                self.note_tokens(&rc);
                response::push_end(buf, framing);
            }
            (None, ClientEvent::Failed(f)) => {
                let queue_timeout = self.ctx.cfg.dispatch.queue_timeout.as_secs();
                let e = ApiError::from_failure_for(&f, queue_timeout, self.style);
                self.push_binary_error(buf, &e);
            }
            (Some(_), ClientEvent::Failed(f)) => {
                // Bytes cannot carry an error event: the answer is cut short.
                debug!("request {}: binary answer cut by {}", self.wire, f.code());
                self.keep_alive = false;
            }
            (_, ClientEvent::Chunk(chunk)) => {
                // A chunk that does not decode marks the answer broken itself.
                self.push_binary_chunk(buf, &chunk);
            }
            _ => {}
        }
    }

    /// A whole answer (an error status, or a stream that ended before its first
    /// chunk): the backend's status, headers and decoded body.
    fn push_binary_whole(&mut self, buf: &mut Vec<u8>, rc: ResponseComplete) {
        let text = rc.body.as_deref().unwrap_or("");
        let Ok(body) = binary::decode(text) else {
            let e = ApiError::new(
                502,
                "bad_worker_answer",
                "the worker's answer to a binary request is not base64",
            );
            return self.push_binary_error(buf, &e);
        };
        self.note_tokens(&rc);
        let status = if (100..=599).contains(&rc.status_code) {
            rc.status_code
        } else {
            502
        };
        self.write_binary_head(buf, status, &rc.headers, Framing::Length(body.len()));
        buf.extend_from_slice(&body);
    }

    fn push_binary_error(&mut self, buf: &mut Vec<u8>, e: &ApiError) {
        self.status = e.status;
        let extra = self.relay_headers();
        let extra: Vec<(&str, &str)> = extra.iter().map(|(n, v)| (*n, v.as_ref())).collect();
        buf.extend_from_slice(&error_response(self.style, e, self.keep_alive, &extra));
    }
}
