//! One stream held on the worker: fed by the backend slot that runs the request
//! ([`Stream::pass`]), read by the relay it came from and, after an `attach`, by the
//! relay a client resumed through. Messages to both go out under the stream's lock, so
//! a resume's backlog and the live events that follow it never cross.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use log::info;
use parking_lot::Mutex;
use subtle::ConstantTimeEq;

use crate::protocol::held::{Attach, NOT_HELD};
use crate::protocol::{ResponseComplete, WorkerMessage};
use crate::server::relay::boundary::Format;
use crate::server::resume::buffer::Events;
use crate::worker::inflight::Handle;
use crate::worker::relays::session::{Link, Out};

/// Why an attach is refused; each is an `error` with the relay's own resume codes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    NotHeld,
    /// Nobody resumed within the grace period; the request was cancelled.
    Expired,
    /// The stream outgrew the buffer while nobody read it.
    BufferFull,
    /// The request ended early (a backend failure, a drain).
    Cancelled,
    /// `after` is past the last event (which is given).
    BadLast(u64),
    /// The events after `after` were dropped; the oldest kept is given.
    Gone(u64),
    /// A newer resume took the stream over.
    TakenOver,
}

/// Sends the `error` for a refused attach (or a reader replaced).
pub fn refuse(out: &Out, request_id: &str, why: Refusal) {
    let (code, status, message) = match why {
        Refusal::NotHeld => (NOT_HELD, 404, "this worker holds no such stream".into()),
        Refusal::Expired => (
            "stream_expired",
            404,
            "nobody resumed the stream within the grace period; it was cancelled".into(),
        ),
        Refusal::BufferFull => (
            "resume_buffer_full",
            409,
            "the stream outgrew the resume buffer while nobody read it and was cancelled".into(),
        ),
        Refusal::Cancelled => ("stream_cancelled", 410, "the stream was cancelled".into()),
        Refusal::BadLast(last) => (
            "invalid_last_event_id",
            400,
            format!("Last-Event-ID is past the stream's last event ({last})"),
        ),
        Refusal::Gone(first) => (
            "resume_events_gone",
            410,
            format!("those events are no longer held (the oldest kept is {first})"),
        ),
        Refusal::TakenOver => ("stream_taken_over", 410, "a newer resume took over".into()),
    };
    out.send(&WorkerMessage::Error {
        request_id: Some(request_id.to_string()),
        code: code.into(),
        message,
        status_code: Some(status),
        retryable: None,
        headers: Default::default(),
        body: None,
    });
}

#[derive(Clone)]
struct Reader {
    out: Out,
    relay: usize,
    request_id: String,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum End {
    Running,
    /// Complete; the answer's `response_complete` for a late resume.
    Done {
        at: Instant,
        rc: ResponseComplete,
    },
    GivenUp {
        at: Instant,
        why: Refusal,
    },
}

struct State {
    events: Events,
    /// The relay the request came from still gets the answer.
    origin_reads: bool,
    /// A relay a client resumed through.
    reader: Option<Reader>,
    /// Since when nobody reads (the grace period runs from here).
    left_at: Option<Instant>,
    end: End,
}

pub struct Stream {
    id: String,
    origin: usize,
    proof: String,
    grace: Duration,
    handle: Arc<Handle>,
    /// The table's total of bytes charged.
    total: Arc<AtomicUsize>,
    /// Most bytes this stream, and all streams, may keep.
    caps: (usize, usize),
    state: Mutex<State>,
}

impl Stream {
    pub(super) fn new(
        id: &str,
        origin: usize,
        proof: String,
        grace: Duration,
        handle: Arc<Handle>,
        total: Arc<AtomicUsize>,
        caps: (usize, usize),
    ) -> Stream {
        Stream {
            id: id.to_string(),
            origin,
            proof,
            grace,
            handle,
            total,
            caps,
            state: Mutex::new(State {
                events: Events::new(Format::Sse),
                origin_reads: true,
                reader: None,
                left_at: None,
                end: End::Running,
            }),
        }
    }

    pub fn id(&self) -> &str {
        &self.id
    }

    /// One message of the answer, on its way to the relay it came from (`origin` sends
    /// it there): the events are numbered and kept, and a resumed reader gets them too.
    pub fn pass(&self, msg: WorkerMessage, origin: impl Fn(&WorkerMessage) -> bool) {
        let mut st = self.state.lock();
        if st.end != End::Running {
            // Given up (or, oddly, past its end): nothing more is kept.
            if st.origin_reads {
                origin(&msg);
            }
            return;
        }
        match msg {
            WorkerMessage::ResponseChunk { request_id, chunk } => {
                let mut numbered = Vec::new();
                let charged = st.events.push(&chunk, &mut numbered);
                if st.origin_reads {
                    origin(&WorkerMessage::ResponseChunk { request_id, chunk });
                }
                self.to_reader(&mut st, &numbered);
                self.charge(&mut st, charged);
            }
            WorkerMessage::ResponseComplete(rc) => {
                let mut numbered = Vec::new();
                let mut charged = 0;
                if let Some(body) = rc.body.as_deref().filter(|b| !b.is_empty()) {
                    charged += st.events.push(body, &mut numbered);
                }
                charged += st.events.flush(&mut numbered);
                self.total.fetch_add(charged, Ordering::Relaxed);
                self.to_reader(&mut st, &numbered);
                let last = ResponseComplete {
                    body: None,
                    ..rc.clone()
                };
                if let Some(r) = st.reader.take() {
                    r.out
                        .send(&WorkerMessage::ResponseComplete(ResponseComplete {
                            request_id: r.request_id.clone(),
                            ..last.clone()
                        }));
                }
                if st.origin_reads {
                    origin(&WorkerMessage::ResponseComplete(rc));
                }
                st.end = End::Done {
                    at: Instant::now(),
                    rc: last,
                };
            }
            other => {
                if st.origin_reads {
                    origin(&other);
                }
            }
        }
    }

    /// The request ended without a complete answer (`error`: the report its relay
    /// gets): a resumed reader gets it too; a later resume is told it was cancelled.
    pub fn failed(&self, error: &WorkerMessage) {
        let mut st = self.state.lock();
        if let (
            Some(r),
            WorkerMessage::Error {
                code,
                message,
                status_code,
                ..
            },
        ) = (st.reader.take(), error)
        {
            r.out.send(&WorkerMessage::Error {
                request_id: Some(r.request_id.clone()),
                code: code.clone(),
                message: message.clone(),
                status_code: *status_code,
                retryable: None,
                headers: Default::default(),
                body: None,
            });
        }
        if st.end == End::Running {
            st.end = End::GivenUp {
                at: Instant::now(),
                why: Refusal::Cancelled,
            };
        }
        let freed = st.events.clear();
        self.total.fetch_sub(freed, Ordering::Relaxed);
    }

    fn to_reader(&self, st: &mut State, numbered: &[u8]) {
        if numbered.is_empty() {
            return;
        }
        let Some(r) = &st.reader else {
            return;
        };
        let chunk = String::from_utf8_lossy(numbered).into_owned();
        let msg = WorkerMessage::ResponseChunk {
            request_id: r.request_id.clone(),
            chunk,
        };
        if !r.out.send(&msg) {
            // That relay is gone too: the grace period starts.
            st.reader = None;
            if !st.origin_reads {
                st.left_at = Some(Instant::now());
            }
        }
    }

    /// Counts `charged` more bytes; past a cap, drops what was sent already, and with
    /// nobody reading gives the stream up (cancelled at the backend).
    fn charge(&self, st: &mut State, charged: usize) {
        let (stream_cap, total_cap) = self.caps;
        let total = self.total.fetch_add(charged, Ordering::Relaxed) + charged;
        let own = st.events.charged() + st.events.pending();
        if own <= stream_cap && total <= total_cap {
            return;
        }
        let reading = st.origin_reads || st.reader.is_some();
        let upto = if reading { st.events.last_id() } else { 0 };
        let over_total = total.saturating_sub(total_cap);
        let target = stream_cap.min(st.events.charged().saturating_sub(over_total));
        let freed = st.events.trim(target, upto);
        self.total.fetch_sub(freed, Ordering::Relaxed);
        let own = st.events.charged() + st.events.pending();
        if (own > stream_cap || total - freed > total_cap) && st.end == End::Running {
            info!(
                "request {}: held stream outgrew its buffer; cancelled",
                self.id
            );
            st.end = End::GivenUp {
                at: Instant::now(),
                why: Refusal::BufferFull,
            };
            let freed = st.events.clear();
            self.total.fetch_sub(freed, Ordering::Relaxed);
            self.handle.cancel();
        }
    }

    /// Relay `relay`'s session ended. True when this stream came from it and goes on
    /// (for its grace period, unless a reader elsewhere has it).
    pub(super) fn relay_lost(&self, relay: usize, now: Instant) -> bool {
        let mut st = self.state.lock();
        if st.reader.as_ref().is_some_and(|r| r.relay == relay) {
            st.reader = None;
            if !st.origin_reads {
                st.left_at = Some(now);
            }
        }
        if self.origin != relay || st.end != End::Running {
            return false;
        }
        if st.origin_reads {
            st.origin_reads = false;
            if st.reader.is_none() {
                st.left_at = Some(now);
            }
        }
        true
    }

    /// A `cancel` of `id` from relay `relay`: true when taken care of here (the
    /// resumed reader left: the grace period starts; or the relay it came from gave
    /// up on a stream that moved to another relay: it just stops getting it).
    pub(super) fn cancel_from(&self, relay: usize, id: &str, now: Instant) -> bool {
        let mut st = self.state.lock();
        if st
            .reader
            .as_ref()
            .is_some_and(|r| r.relay == relay && r.request_id == id)
        {
            st.reader = None;
            st.left_at = Some(now);
            return true;
        }
        if relay == self.origin && id == self.id && st.reader.is_some() {
            st.origin_reads = false;
            return true;
        }
        false
    }

    /// Whether relay `relay`'s resume `id` reads this stream now.
    pub(super) fn read_by(&self, relay: usize, id: &str) -> bool {
        let st = self.state.lock();
        st.reader
            .as_ref()
            .is_some_and(|r| r.relay == relay && r.request_id == id)
    }

    /// Answers an `attach` from `link`'s relay.
    pub(super) fn attach(&self, link: &Link, msg: &Attach, now: Instant) {
        let proof_ok: bool = msg.proof.as_bytes().ct_eq(self.proof.as_bytes()).into();
        if !proof_ok {
            return refuse(&link.out, &msg.request_id, Refusal::NotHeld);
        }
        let mut st = self.state.lock();
        let (last, first) = (st.events.last_id(), st.events.first_kept());
        let done = match &st.end {
            End::GivenUp { why, .. } => return refuse(&link.out, &msg.request_id, *why),
            End::Done { rc, .. } => Some(rc.clone()),
            End::Running => None,
        };
        if msg.after > last {
            return refuse(&link.out, &msg.request_id, Refusal::BadLast(last));
        }
        if msg.after.saturating_add(1) < first && msg.after < last {
            return refuse(&link.out, &msg.request_id, Refusal::Gone(first));
        }
        if let Some(rc) = done.as_ref().filter(|_| msg.after >= last) {
            // The client has the whole answer: just the end.
            link.out
                .send(&WorkerMessage::ResponseComplete(ResponseComplete {
                    request_id: msg.request_id.clone(),
                    ..rc.clone()
                }));
            return;
        }
        if let Some(old) = st.reader.take() {
            refuse(&old.out, &old.request_id, Refusal::TakenOver);
        }
        // The reader takes over: the relay the request came from (alive or not) gets
        // nothing more; it gives its own copy up after its grace period.
        st.origin_reads = false;
        st.left_at = None;
        // The head first: the resuming relay answers its client at once, even when
        // nothing new has been generated yet.
        link.out.send(&WorkerMessage::ResponseHead {
            request_id: msg.request_id.clone(),
            status_code: 200,
            headers: Default::default(),
        });
        let mut backlog = Vec::new();
        st.events.copy_after(msg.after, &mut backlog);
        st.reader = Some(Reader {
            out: link.out.clone(),
            relay: link.relay,
            request_id: msg.request_id.clone(),
        });
        info!(
            "request {}: resumed after event {} through relay {}",
            self.id, msg.after, link.relay
        );
        self.to_reader(&mut st, &backlog);
        if let Some(rc) = done {
            if let Some(r) = st.reader.take() {
                r.out
                    .send(&WorkerMessage::ResponseComplete(ResponseComplete {
                        request_id: r.request_id.clone(),
                        ..rc
                    }));
            }
            st.left_at = Some(now);
        }
    }

    /// The reaper's look: cancels a running stream nobody read for the grace period;
    /// true when an ended stream is past it (to be forgotten).
    pub(super) fn reap(&self, now: Instant) -> bool {
        let mut st = self.state.lock();
        match st.end {
            End::Running => {
                let idle = !st.origin_reads && st.reader.is_none();
                let left = st.left_at.filter(|_| idle);
                if left.is_some_and(|at| now.saturating_duration_since(at) >= self.grace) {
                    info!(
                        "request {}: nobody resumed within {}s; cancelled",
                        self.id,
                        self.grace.as_secs()
                    );
                    st.end = End::GivenUp {
                        at: now,
                        why: Refusal::Expired,
                    };
                    let freed = st.events.clear();
                    self.total.fetch_sub(freed, Ordering::Relaxed);
                    self.handle.cancel();
                }
                false
            }
            End::Done { at, .. } | End::GivenUp { at, .. } => {
                now.saturating_duration_since(at) >= self.grace
            }
        }
    }

    /// Frees the kept events; returns the bytes they were charged.
    pub(super) fn forget(&self) -> usize {
        self.state.lock().events.clear()
    }
}
