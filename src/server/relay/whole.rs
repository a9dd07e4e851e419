//! Answers that reach the client whole, not as a stream: the worker's complete answer
//! with its own status and headers, or a reshaping route's answer rewritten in one
//! piece. Apart from the parent's event loop and stream writing because nothing here
//! frames chunks or holds event boundaries: it sizes one body and writes one head.
//! Token accounting lives here too, as both a whole answer and a stream's end charge
//! the tenant through it.

use std::borrow::Cow;
use std::time::{Duration, Instant};

use super::super::body::cache_reuse;
use super::super::http::response::{self, Framing};
use super::super::tenancy::gate::RateHeaders;
use super::Session;
use crate::protocol::ResponseComplete;

impl Session<'_, '_> {
    /// A whole answer for a reshaping route: a stream that arrived in one piece goes
    /// through the stream path; anything else is rewritten whole.
    pub(super) fn push_reshaped(&mut self, buf: &mut Vec<u8>, rc: ResponseComplete) {
        let body = rc.body.as_deref().unwrap_or("");
        let streamed = rc.status_code == 200
            && rc
                .headers
                .iter()
                .any(|(n, v)| n.eq_ignore_ascii_case("content-type") && v.contains("event-stream"));
        if streamed {
            self.push_chunk(buf, body);
            let framing = self.open_stream(buf);
            self.note_tokens(&rc);
            let tail = self.reshape.as_mut().map(|r| r.end("")).unwrap_or_default();
            self.push_stream_end(buf, framing, &tail);
            return;
        }
        let elapsed = self.started.elapsed();
        let Some(r) = &mut self.reshape else {
            return;
        };
        let (status, text) = r.whole(rc.status_code, body, elapsed);
        self.note_tokens(&rc);
        self.status = status;
        let relay = self.relay_headers();
        let mut headers = vec![("content-type", "application/json")];
        headers.extend(relay.iter().map(|(n, v)| (*n, v.as_ref())));
        response::head_into(
            buf,
            status,
            &headers,
            Framing::Length(text.len()),
            self.keep_alive,
        );
        buf.extend_from_slice(text.as_bytes());
    }

    /// Takes the token counts of a finished answer and charges the tenant's budget.
    pub(super) fn note_tokens(&mut self, rc: &ResponseComplete) {
        let reported = rc.token_counts.as_ref().map(|t| {
            (
                t.prompt_tokens.unwrap_or(0),
                t.completion_tokens.unwrap_or(0),
            )
        });
        let seen = self.reshape.as_ref().map(|r| r.tokens());
        if let Some(tokens) = reported.or(seen).filter(|t| *t != (0, 0)) {
            self.tokens = tokens;
            let used = self.tokens.0.saturating_add(self.tokens.1);
            self.ctx
                .gate
                .charge(&self.caller.who.tenant, used, Instant::now());
        }
    }

    /// A complete answer that was not streamed: the worker's status, headers and body.
    pub(super) fn push_whole(&mut self, buf: &mut Vec<u8>, rc: ResponseComplete) {
        self.note_tokens(&rc);
        self.status = whole_answer(buf, &rc, &self.stamp(), self.keep_alive);
    }
}

/// What the relay's own headers say of a request.
pub(super) struct Stamp<'a> {
    pub wire: &'a str,
    pub started: Instant,
    pub queue_wait: Option<Duration>,
    /// The tenant's request-rate state.
    pub rate: Option<&'a RateHeaders>,
}

impl<'a> Stamp<'a> {
    /// Headers every relayed answer carries: request id, queue wait, time on the worker
    /// so far (dispatch to now: the last byte for whole answers, the first for streams)
    /// and the tenant's rate-limit state.
    pub(super) fn headers(&self) -> Vec<(&'static str, Cow<'a, str>)> {
        // Room for all of them at once: this runs for every answer.
        let mut h = Vec::with_capacity(6);
        h.push(("x-request-id", Cow::Borrowed(self.wire)));
        let waited = self.queue_wait.unwrap_or_else(|| self.started.elapsed());
        h.push((
            "x-queue-wait-ms",
            Cow::Owned(waited.as_millis().to_string()),
        ));
        if let Some(wait) = self.queue_wait {
            let on_worker = self.started.elapsed().saturating_sub(wait);
            h.push(("x-gpu-time-ms", on_worker.as_millis().to_string().into()));
        }
        if let Some(rate) = self.rate {
            h.extend(rate.render().into_iter().map(|(n, v)| (n, Cow::Owned(v))));
        }
        h
    }
}

/// Writes a complete answer, head and body, into `buf`: the worker's status (`502` for
/// one no HTTP client could read), its headers, and the relay's own. Returns the status.
pub(super) fn whole_answer(
    buf: &mut Vec<u8>,
    rc: &ResponseComplete,
    stamp: &Stamp<'_>,
    keep_alive: bool,
) -> u16 {
    let status = if (100..=599).contains(&rc.status_code) {
        rc.status_code
    } else {
        502
    };
    let relay = stamp.headers();
    // Room for the backend's headers and ours: one allocation per answer.
    let mut headers: Vec<(&str, &str)> = Vec::with_capacity(rc.headers.len() + relay.len() + 3);
    headers.extend(rc.headers.iter().map(|(n, v)| (n.as_str(), v.as_str())));
    if !rc
        .headers
        .keys()
        .any(|k| k.eq_ignore_ascii_case("content-type"))
    {
        headers.push(("content-type", "application/json"));
    }
    let body_text = rc.body.as_deref().unwrap_or("");
    let reused = cache_reuse(body_text);
    let hit = if reused > 0 { "true" } else { "false" };
    let reused = reused.to_string();
    headers.push(("x-cache-hit", hit));
    headers.push(("x-cache-tokens-reused", reused.as_str()));
    headers.extend(relay.iter().map(|(n, v)| (*n, v.as_ref())));
    let body = body_text.as_bytes();
    // Head and body in one buffer, sized once (a head is a few hundred bytes).
    buf.reserve(body.len() + 512);
    response::head_into(
        buf,
        status,
        &headers,
        Framing::Length(body.len()),
        keep_alive,
    );
    buf.extend_from_slice(body);
    status
}
