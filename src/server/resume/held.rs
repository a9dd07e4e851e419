//! One held stream, shared by the connection thread that relays the request (through
//! its [`Tap`]) and whichever connection resumes it ([`super::handler`]).
//!
//! Readers take turns: the original connection is reader 0, every resume gets the
//! next number and takes over (an older reader notices and leaves quietly; its
//! connection may be dead without anyone knowing yet). The relaying thread writes to
//! the original connection itself, as for any stream; a resumed reader copies events
//! out of the buffer, woken by [`Held`]'s condition variable.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};
use subtle::ConstantTimeEq;

use super::buffer::Events;
use super::{Inner, Owner, ROUTE_PREFIX};
use crate::server::errors::ApiError;
use crate::server::relay::boundary::Format;

/// Why a held stream is no longer going, as a resume learns it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum End {
    Running,
    /// The answer is complete (its events kept for the grace period).
    Finished {
        at: Instant,
    },
    /// Given up and cancelled; `code` says why (an outcome of the access log).
    GivenUp {
        at: Instant,
        code: &'static str,
    },
}

/// Outcome code: a cap was reached with events nobody had been handed.
pub const BUFFER_FULL: &str = "resume_buffer_full";
/// Outcome code: nobody resumed within the grace period.
pub const GRACE_OVER: &str = "client_disconnect";

#[derive(Debug)]
struct State {
    events: Events,
    /// The reader events go to: 0 the original connection, then each resume.
    reader: u64,
    /// That reader is connected.
    attached: bool,
    /// The last id handed to that reader.
    handed: u64,
    /// When the last reader left (while nobody is attached).
    left_at: Option<Instant>,
    end: End,
}

/// A stream held for resuming.
pub struct Held {
    wire: String,
    owner: Owner,
    /// The secret a resume must present besides its key ([`super::resume_token`]).
    token: String,
    format: Format,
    content_type: &'static str,
    state: Mutex<State>,
    changed: Condvar,
}

/// What a resumed reader should do next ([`Held::next`]).
#[derive(Debug, PartialEq, Eq)]
pub enum Step {
    /// Events were appended: write them.
    More,
    /// Nothing new within the wait.
    Idle,
    /// Another resume took over: leave without touching the stream.
    Replaced,
    /// Nothing more will come: `finished` when the answer is complete.
    Ended { finished: bool },
}

impl Held {
    pub(super) fn new(
        wire: &str,
        owner: Owner,
        token: String,
        format: Format,
        content_type: &'static str,
    ) -> Held {
        Held {
            wire: wire.to_string(),
            owner,
            token,
            format,
            content_type,
            state: Mutex::new(State {
                events: Events::new(format),
                reader: 0,
                attached: true,
                handed: 0,
                left_at: None,
                end: End::Running,
            }),
            changed: Condvar::new(),
        }
    }

    pub fn content_type(&self) -> &'static str {
        self.content_type
    }

    pub fn format(&self) -> Format {
        self.format
    }

    /// When it ended (`None`: still running).
    pub(super) fn ended_at(&self) -> Option<Instant> {
        match self.state.lock().end {
            End::Running => None,
            End::Finished { at, .. } | End::GivenUp { at, .. } => Some(at),
        }
    }

    /// Frees the kept events; returns the bytes they were charged.
    pub(super) fn forget(&self) -> usize {
        self.state.lock().events.clear()
    }

    /// A resume by `owner` with `token` after event `last`: becomes the reader, or
    /// says why not. Returns the reader's number.
    pub fn attach(&self, owner: &Owner, token: &str, last: u64) -> Result<u64, ApiError> {
        let token_ok: bool = token.as_bytes().ct_eq(self.token.as_bytes()).into();
        if *owner != self.owner || !token_ok {
            // The same answer as an unknown id: a stream's existence is not shown to
            // another key or tenant.
            return Err(not_found());
        }
        let mut st = self.state.lock();
        match st.end {
            End::GivenUp {
                code: BUFFER_FULL, ..
            } => {
                return Err(ApiError::new(
                    409,
                    BUFFER_FULL,
                    "the stream outgrew the resume buffer while nobody read it and was cancelled",
                ))
            }
            End::GivenUp {
                code: GRACE_OVER, ..
            } => {
                return Err(ApiError::new(
                    404,
                    "stream_expired",
                    "nobody resumed the stream within the grace period; it was cancelled",
                ))
            }
            End::GivenUp { .. } => {
                return Err(ApiError::new(
                    410,
                    "stream_cancelled",
                    "the stream was cancelled",
                ))
            }
            // The client has the whole answer (an `EventSource` reconnects after the
            // end by itself): told to stop.
            End::Finished { .. } if last >= st.events.last_id() => {
                return Err(ApiError::new(204, "stream_complete", ""));
            }
            _ => {}
        }
        if last > st.events.last_id() {
            return Err(ApiError::new(
                400,
                "invalid_last_event_id",
                format!(
                    "Last-Event-ID {last} is past the stream's last event ({})",
                    st.events.last_id()
                ),
            ));
        }
        if last.saturating_add(1) < st.events.first_kept() {
            return Err(ApiError::new(
                410,
                "resume_events_gone",
                format!(
                    "events after {last} are no longer held (the oldest kept is {})",
                    st.events.first_kept()
                ),
            ));
        }
        st.reader += 1;
        st.attached = true;
        st.handed = last;
        st.left_at = None;
        self.changed.notify_all();
        Ok(st.reader)
    }

    /// For reader `me`, who has events up to `sent`: appends what came after to `out`,
    /// waiting up to `wait` for something to happen.
    pub fn next(&self, me: u64, sent: &mut u64, out: &mut Vec<u8>, wait: Duration) -> Step {
        let mut st = self.state.lock();
        for round in 0..2 {
            if st.reader != me {
                return Step::Replaced;
            }
            if st.events.last_id() > *sent {
                if st.events.first_kept() > sent.saturating_add(1) {
                    // Cannot happen (only handed events are dropped); never skip silently.
                    return Step::Ended { finished: false };
                }
                *sent = st.events.copy_after(*sent, out);
                st.handed = *sent;
                return Step::More;
            }
            match st.end {
                End::Running => {}
                End::Finished { .. } => return Step::Ended { finished: true },
                End::GivenUp { .. } => return Step::Ended { finished: false },
            }
            if round == 0 {
                self.changed.wait_for(&mut st, wait);
            }
        }
        Step::Idle
    }

    /// Reader `me` lost its connection: the grace period starts (again).
    pub fn detach(&self, me: u64) {
        let mut st = self.state.lock();
        if st.reader == me && st.attached {
            st.attached = false;
            st.left_at = Some(Instant::now());
        }
    }

    /// Ends the stream (if still running) and wakes every reader.
    fn end(&self, end: End, inner: &Inner) {
        let mut st = self.state.lock();
        if st.end != End::Running {
            return;
        }
        if let End::GivenUp { .. } = end {
            let freed = st.events.clear();
            inner.bytes.fetch_sub(freed, Ordering::Relaxed);
        }
        st.end = end;
        self.changed.notify_all();
    }
}

fn not_found() -> ApiError {
    ApiError::new(
        404,
        "stream_not_found",
        "no resumable stream with this id (unknown, or long over)",
    )
}

/// The unknown-id answer, for the handler.
pub fn unknown() -> ApiError {
    not_found()
}

/// The relaying thread's side of a held stream.
pub struct Tap {
    held: Arc<Held>,
    inner: Arc<Inner>,
    /// The original connection still gets the events (cached per [`Tap::emit`]).
    reads: bool,
    /// What the last [`Tap::due`] said: why the request is being cancelled.
    verdict: Option<&'static str>,
}

impl Tap {
    pub(super) fn new(held: Arc<Held>, inner: Arc<Inner>) -> Tap {
        Tap {
            held,
            inner,
            reads: true,
            verdict: None,
        }
    }

    /// Headers of the stream's response head: how to resume it.
    pub fn head(&self) -> [(&'static str, String); 2] {
        let by = match self.held.format {
            Format::Sse => "event-id",
            Format::Ndjson => "line-number",
        };
        [
            ("x-resumable", by.to_string()),
            (
                "x-resume-url",
                format!(
                    "{ROUTE_PREFIX}{}?resume_token={}",
                    self.held.wire, self.held.token
                ),
            ),
        ]
    }

    /// The `request.held` that asks the worker to keep this stream too, so it
    /// survives this relay ([`crate::protocol::held`]).
    pub fn worker_hold(&self) -> crate::protocol::held::Hold {
        crate::protocol::held::Hold {
            grace_secs: self.inner.cfg.grace.as_secs(),
            proof: self.held.owner.proof(&self.held.token),
        }
    }

    /// A note of the relay's own (queue progress, waking): passed to the original
    /// connection without an id and not kept, so that ids count the worker's events
    /// only and mean the same on a worker holding the stream.
    pub fn note(&mut self, text: &str) -> Option<Vec<u8>> {
        let st = self.held.state.lock();
        self.reads = st.reader == 0 && st.attached && st.end == End::Running;
        self.reads.then(|| text.as_bytes().to_vec())
    }

    /// Whether the original connection still gets the events.
    pub fn original_reads(&self) -> bool {
        self.reads
    }

    /// The next piece of the answer (`last`: the stream's end, an unfinished event
    /// included): numbered and kept. Returns what the original connection gets, or
    /// nothing once it no longer reads.
    pub fn emit(&mut self, text: &str, last: bool) -> Option<Vec<u8>> {
        let cfg = &self.inner.cfg;
        let mut st = self.held.state.lock();
        if st.end != End::Running {
            return None;
        }
        let mut out = Vec::new();
        let mut charged = st.events.push(text, &mut out);
        if last {
            charged += st.events.flush(&mut out);
        }
        let total = self.inner.bytes.fetch_add(charged, Ordering::Relaxed) + charged;
        self.reads = st.reader == 0 && st.attached;
        if self.reads {
            st.handed = st.events.last_id();
        }
        let own = st.events.charged() + st.events.pending();
        if own > cfg.stream_bytes || total > cfg.total_bytes {
            // Only events a connected reader was handed may go; the rest must stay.
            let upto = if st.attached { st.handed } else { 0 };
            let over_total = total.saturating_sub(cfg.total_bytes);
            let target = cfg
                .stream_bytes
                .min(st.events.charged().saturating_sub(over_total));
            let freed = st.events.trim(target, upto);
            self.inner.bytes.fetch_sub(freed, Ordering::Relaxed);
            let own = st.events.charged() + st.events.pending();
            if own > cfg.stream_bytes || total - freed > cfg.total_bytes {
                drop(st);
                self.held.end(
                    End::GivenUp {
                        at: Instant::now(),
                        code: BUFFER_FULL,
                    },
                    &self.inner,
                );
                return None;
            }
        }
        if !out.is_empty() {
            self.held.changed.notify_all();
        }
        self.reads.then_some(out)
    }

    /// The original connection is gone: `true` when the stream is held for a resume
    /// (else it is cancelled as any other).
    pub fn lost(&mut self) -> bool {
        self.reads = false;
        self.held.detach(0);
        self.due(Instant::now()).is_none()
    }

    /// Whether the request must be cancelled now, and the outcome to log: a cap was
    /// reached, or nobody has read the stream for the grace period.
    pub fn due(&mut self, now: Instant) -> Option<&'static str> {
        let st = self.held.state.lock();
        self.verdict = match st.end {
            End::GivenUp { code, .. } => Some(code),
            End::Finished { .. } => None,
            End::Running => {
                let left = st.left_at.filter(|_| !st.attached)?;
                (now.saturating_duration_since(left) >= self.inner.cfg.grace).then_some(GRACE_OVER)
            }
        };
        self.verdict
    }

    /// The answer is complete. Its events stay for the grace period even when the
    /// end was written: a successful write is no proof the client read it (a client
    /// that lost the last events resumes for them).
    pub fn finish(&mut self) {
        let end = End::Finished { at: Instant::now() };
        self.held.end(end, &self.inner);
    }
}

impl Drop for Tap {
    /// A request that ends without [`Tap::finish`] was cancelled or failed before its
    /// stream began: nothing more will come.
    fn drop(&mut self) {
        let code = self
            .verdict
            .or_else(|| self.due(Instant::now()))
            .unwrap_or("stream_cancelled");
        let end = End::GivenUp {
            at: Instant::now(),
            code,
        };
        self.held.end(end, &self.inner);
    }
}

#[cfg(test)]
mod tests;
