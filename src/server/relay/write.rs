//! How a relayed answer is written: the stream's head once, its chunks, its end or its one
//! error event, queue notes, and the final event of an answer that was not streamed.

use std::borrow::Cow;

use log::debug;

use super::Session;
use crate::server::dispatcher::ClientEvent;
use crate::server::errors::ApiError;
use crate::server::http::response::{self, Framing};
use crate::server::reply::error_response;

impl Session<'_, '_> {
    /// Writes the `200` event-stream head once; returns the framing in use.
    pub(super) fn open_stream(&mut self, buf: &mut Vec<u8>) -> Framing {
        if let Some(f) = self.framing {
            return f;
        }
        let f = if self.http10 {
            Framing::UntilClose
        } else {
            Framing::Chunked
        };
        let mut extra = self.relay_headers();
        extra.extend(
            self.resume
                .iter()
                .flat_map(|t| t.head())
                .map(|(n, v)| (n, Cow::Owned(v))),
        );
        let content_type = self
            .reshape
            .as_ref()
            .map_or("text/event-stream", |r| r.stream_type());
        let mut headers = vec![
            ("content-type", content_type),
            ("cache-control", "no-cache"),
        ];
        headers.extend(extra.iter().map(|(n, v)| (*n, v.as_ref())));
        headers.extend(self.head.iter().map(|(n, v)| (*n, v.as_str())));
        response::head_into(buf, 200, &headers, f, self.keep_alive);
        self.framing = Some(f);
        self.status = 200;
        f
    }

    pub(super) fn push_chunk(&mut self, buf: &mut Vec<u8>, chunk: &str) {
        if self.binary.is_some() {
            self.push_binary_chunk(buf, chunk);
            return;
        }
        let tracked;
        let chunk = match &mut self.continuation {
            Some(tracker) => {
                tracked = tracker.pass(chunk);
                if tracked.is_empty() {
                    return;
                }
                tracked.as_ref()
            }
            None => chunk,
        };
        let Some(chunk) = self.held.push(chunk) else {
            return;
        };
        let chunk = chunk.as_ref();
        let reshaped;
        let chunk = match &mut self.reshape {
            Some(r) => {
                reshaped = r.chunk(chunk);
                if reshaped.is_empty() {
                    return;
                }
                reshaped.as_str()
            }
            None => chunk,
        };
        let framing = self.open_stream(buf);
        if self.first_chunk.is_none() {
            self.first_chunk = Some(self.started.elapsed());
        }
        let ready = self.boundary.push(chunk);
        self.emit(buf, &ready, framing, false);
    }

    /// The normal end of a stream: the start of an unfinished last event as the backend
    /// sent it, then `tail`, then the end of the body.
    pub(super) fn push_stream_end(&mut self, buf: &mut Vec<u8>, framing: Framing, tail: &str) {
        let held = self.boundary.finish();
        self.emit(buf, &held, framing, false);
        self.emit(buf, tail, framing, true);
        response::push_end(buf, framing);
    }

    /// A stream the relay ends with an error: on an event boundary (an unfinished event
    /// is dropped), then the error event whole.
    pub(super) fn push_stream_error(&mut self, buf: &mut Vec<u8>, framing: Framing, e: &ApiError) {
        let cut = self.boundary.abandon();
        if cut.withheld > 0 {
            debug!(
                "request {}: {} bytes of an unfinished event withheld before the error event",
                self.wire, cut.withheld
            );
        }
        self.emit(buf, cut.close, framing, false);
        self.emit(buf, &e.sse_event(self.style), framing, true);
        response::push_end(buf, framing);
    }

    /// An SSE comment for a waiting stream that asked for progress (`X-Queue-Updates`).
    pub(super) fn push_progress(&mut self, buf: &mut Vec<u8>, position: usize, eta_ms: u64) {
        let framing = self.open_stream(buf);
        let note = format!(": queued position={} eta_ms={eta_ms}\n\n", position + 1);
        self.emit_note(buf, &note, framing);
    }

    pub(super) fn push_final(&mut self, buf: &mut Vec<u8>, event: ClientEvent) {
        if self.binary.is_some() {
            return self.push_binary_final(buf, event);
        }
        let queue_timeout = self.ctx.cfg.dispatch.queue_timeout.as_secs();
        match (self.framing, event) {
            (None, ClientEvent::Complete(rc)) if self.reshape.is_some() => {
                self.push_reshaped(buf, rc)
            }
            (None, ClientEvent::Complete(rc)) => self.push_whole(buf, rc),
            (None, ClientEvent::Failed(f)) => {
                let e = ApiError::from_failure_for(&f, queue_timeout, self.style);
                self.status = e.status;
                let extra = self.relay_headers();
                let extra: Vec<(&str, &str)> =
                    extra.iter().map(|(n, v)| (*n, v.as_ref())).collect();
                buf.extend_from_slice(&error_response(self.style, &e, self.keep_alive, &extra));
            }
            (Some(framing), ClientEvent::Complete(rc)) if rc.status_code >= 400 => {
                // The head went out early (queue progress notes) and the backend then
                // refused: its error becomes the stream's one error event.
                let body = rc.body.as_deref().unwrap_or("");
                let e = ApiError::from_backend(rc.status_code, body);
                self.push_stream_error(buf, framing, &e);
            }
            (Some(framing), ClientEvent::Complete(rc)) => {
                let rest = rc.body.as_deref().unwrap_or("");
                let tail = match &mut self.reshape {
                    Some(r) => r.end(rest),
                    None => rest.to_string(),
                };
                self.note_tokens(&rc);
                self.push_stream_end(buf, framing, &tail);
            }
            (Some(framing), ClientEvent::Failed(f)) if self.boundary.ended() => {
                debug!(
                    "request {}: {} after the stream's last event; ended normally",
                    self.wire,
                    f.code()
                );
                self.push_stream_end(buf, framing, "");
            }
            (Some(framing), ClientEvent::Failed(f)) => {
                let e = ApiError::from_failure_for(&f, queue_timeout, self.style);
                self.push_stream_error(buf, framing, &e);
            }
            (_, ClientEvent::Chunk(chunk)) => self.push_chunk(buf, &chunk),
            (
                _,
                ClientEvent::Interrupted
                | ClientEvent::Queued { .. }
                | ClientEvent::Waking { .. }
                | ClientEvent::Dispatched { .. }
                | ClientEvent::Credit(_)
                | ClientEvent::Head(_),
            ) => {}
        }
    }
}
