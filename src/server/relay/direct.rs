//! Whole answers written by the thread that has them.
//!
//! A request that wants one plain JSON answer (not streamed, no reshaping, resuming,
//! continuation, upload or token budget, on a plain keep-alive connection) need not wake
//! its connection thread for it. That thread submits with a [`Direct`] as the request's
//! reply. When the dispatcher sends the request to a worker, it lends the `Direct` to
//! that worker's socket (`dispatcher/reply.rs`). The socket's reader thread, the first
//! to hold the worker's `response_complete`, writes the answer to the client without
//! waiting (`MSG_DONTWAIT`) and records it; the dispatcher still gets the message for
//! its bookkeeping. There is one reader per worker, so these writes are not serialised
//! on the dispatcher. Whatever the reader does not answer (the request was taken back
//! first: requeued, cancelled, timed out) the dispatcher thread answers the same way.
//! The connection thread meanwhile sleeps in `poll` on its socket, and wakes when the
//! client sends its next request or leaves: one wake per request where the channel
//! path takes two.
//!
//! Anything else goes back to the connection thread, called by the [`Outlet`]'s doorbell:
//! what the socket would not take at once (written there, where a write may block), and
//! any event other than dispatch, answer or the client's departure (the usual relay then
//! takes over, as if it had waited from the start). A client that leaves while its
//! request runs is seen at once (the socket polls readable) and its request cancelled.
//!
//! On other systems than Linux, and on TLS connections, every answer takes the channel.

use std::io::Write;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender};
use log::debug;
use parking_lot::Mutex;

use super::super::dispatcher::reply::Answerer;
use super::super::dispatcher::runtime::Input;
use super::super::dispatcher::{ClientEvent, Event};
use super::super::shared::RelayGuard;
use super::super::tenancy::gate::RateHeaders;
use super::super::tenancy::identity::Caller;
use super::super::Ctx;
use super::whole::{whole_answer, Stamp};
use super::{record, Record, Session};
use crate::net::{Peeked, Stream};
use crate::protocol::{RequestMessage, ResponseComplete};

#[cfg_attr(not(target_os = "linux"), path = "direct/no_wake.rs")]
mod wake;
use wake::{Wake, Woke};

/// One connection's way for another thread to answer on it: a clone of the
/// socket, a doorbell for its thread, and where its current request stands.
pub struct Outlet {
    stream: Stream,
    wake: Wake,
    phase: Mutex<Phase>,
}

/// Where a direct request stands; the lock orders the two threads' moves.
enum Phase {
    /// Submitted, not answered.
    Pending,
    /// Not answered, and the connection thread waits for the end (it holds the next
    /// request already): the end rings.
    Awaited,
    /// Written whole and recorded; `keep`: the connection may carry another request.
    Done { keep: bool, at: Instant },
    /// Written in part: the connection thread writes the rest and records.
    Rest(Box<Rest>),
    /// The connection thread took over: the events go to its channel, and it counts
    /// the request as in progress from here (the guard).
    Back(Option<RelayGuard>),
    /// The client left first; its request is being cancelled.
    Gone,
}

/// An answer the socket did not take whole, and what its record needs.
struct Rest {
    bytes: Vec<u8>,
    /// The request stays in progress until the rest is written.
    active: Option<RelayGuard>,
    status: u16,
    tokens: (u64, u64),
    queue_wait: Option<Duration>,
    worker: Option<String>,
}

impl Outlet {
    fn new(stream: &Stream) -> Option<Outlet> {
        if !stream.is_plain() {
            return None;
        }
        Some(Outlet {
            stream: stream.try_clone().ok()?,
            wake: Wake::new().ok()?,
            phase: Mutex::new(Phase::Pending),
        })
    }

    /// Starts a request: no answer yet. A ring left over from the last one costs one
    /// spurious wake at most (a ring is cleared when a wait sees it).
    fn begin(&self) {
        *self.phase.lock() = Phase::Pending;
    }

    fn ring(&self) {
        self.wake.signal();
    }
}

/// The answering side of one direct request: on the dispatcher thread, or lent to the
/// reader thread of the worker socket its request runs on.
pub(super) struct Direct {
    outlet: Arc<Outlet>,
    ctx: Arc<Ctx>,
    /// The connection thread's channel, used once it takes over.
    events: Sender<ClientEvent>,
    wire: String,
    route: String,
    model: String,
    caller: Caller,
    rate: Option<RateHeaders>,
    started: Instant,
    queue_wait: Option<Duration>,
    worker: Option<String>,
    state: Handling,
    /// Counts the request as in progress (shutdown waits for it) until its answer is
    /// out, or moves to the connection thread with the request.
    active: Option<RelayGuard>,
}

/// Who acts on this request's events.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Handling {
    /// This answerer, wherever it is (dispatcher, or a worker socket's reader).
    Here,
    /// The connection thread, through its channel.
    Handed,
    /// Nobody: the final event came.
    Finished,
}

impl Answerer for Direct {
    fn deliver(&mut self, event: ClientEvent) -> bool {
        match (self.state, event) {
            (Handling::Handed, event) => self.events.send(event).is_ok(),
            (Handling::Finished, _) => false,
            (Handling::Here, ClientEvent::Dispatched { queue_wait, worker }) => {
                self.queue_wait = Some(queue_wait);
                self.worker = Some(worker);
                true
            }
            (Handling::Here, ClientEvent::Complete(rc)) => self.complete(&rc),
            (Handling::Here, event) => self.hand_back(event),
        }
    }

    fn dispatched(&mut self, worker: &str, at: Instant) {
        self.queue_wait = Some(at.saturating_duration_since(self.started));
        self.worker = Some(worker.to_string());
    }

    fn answer(&mut self, rc: &ResponseComplete) {
        if self.state == Handling::Here {
            self.complete(rc);
        }
    }
}

impl Direct {
    /// Writes a complete answer, or as much as the socket takes now.
    fn complete(&mut self, rc: &ResponseComplete) -> bool {
        let mut phase = self.outlet.phase.lock();
        if matches!(*phase, Phase::Gone) {
            drop(phase);
            self.record_gone();
            return false;
        }
        self.state = Handling::Finished;
        let tokens = rc.token_counts.as_ref().map_or((0, 0), |t| {
            (
                t.prompt_tokens.unwrap_or(0),
                t.completion_tokens.unwrap_or(0),
            )
        });
        let stamp = Stamp {
            wire: &self.wire,
            started: self.started,
            queue_wait: self.queue_wait,
            rate: self.rate.as_ref(),
        };
        let mut buf = Vec::new();
        let status = whole_answer(&mut buf, rc, &stamp, true);
        let sent = self.outlet.stream.send_now(&buf);
        let awaited = matches!(*phase, Phase::Awaited);
        match sent {
            Ok(n) if n < buf.len() => {
                buf.drain(..n);
                *phase = Phase::Rest(Box::new(Rest {
                    bytes: buf,
                    active: self.active.take(),
                    status,
                    tokens,
                    queue_wait: self.queue_wait,
                    worker: self.worker.take(),
                }));
                drop(phase);
                self.outlet.ring();
                return true;
            }
            written => {
                let keep = written.is_ok();
                *phase = Phase::Done {
                    keep,
                    at: Instant::now(),
                };
            }
        }
        drop(phase);
        // Only a waiting thread needs the news; one asleep on its socket learns it with
        // the client's next request.
        if awaited {
            self.outlet.ring();
        }
        self.record(status, tokens, "completed");
        true
    }

    /// Gives the request to the connection thread: what is known of its dispatch, then
    /// `event` and every later one, on its channel.
    fn hand_back(&mut self, event: ClientEvent) -> bool {
        let mut phase = self.outlet.phase.lock();
        if matches!(*phase, Phase::Gone) {
            drop(phase);
            if event.is_final() {
                self.record_gone();
            }
            return false;
        }
        if let (Some(queue_wait), Some(worker)) = (self.queue_wait, self.worker.take()) {
            let _ = self
                .events
                .send(ClientEvent::Dispatched { queue_wait, worker });
        }
        let sent = self.events.send(event).is_ok();
        *phase = Phase::Back(self.active.take());
        self.state = Handling::Handed;
        drop(phase);
        self.outlet.ring();
        sent
    }

    /// The client left before its answer (`Session::cancel`'s record).
    fn record_gone(&mut self) {
        self.state = Handling::Finished;
        self.record(499, (0, 0), "client_disconnect");
    }

    /// No tokens are charged: a direct request's tenant has no token budget.
    fn record(&self, status: u16, tokens: (u64, u64), outcome: &str) {
        let r = Record {
            wire: &self.wire,
            route: &self.route,
            model: &self.model,
            caller: &self.caller,
            worker: self.worker.as_deref(),
            status,
            started: self.started,
            queue_wait: self.queue_wait,
            first_chunk: None,
            tokens,
            outcome,
        };
        record(&self.ctx, &r);
    }
}

impl Drop for Direct {
    /// Dropped before its final event (the dispatcher stopping): the connection thread
    /// takes over and finds its channel closed, which it answers like any relay.
    fn drop(&mut self) {
        if self.state != Handling::Here {
            return;
        }
        let mut phase = self.outlet.phase.lock();
        match *phase {
            Phase::Pending | Phase::Awaited => {
                *phase = Phase::Back(self.active.take());
                drop(phase);
                self.outlet.ring();
            }
            Phase::Gone => {
                drop(phase);
                self.record_gone();
            }
            _ => {}
        }
    }
}

/// What the connection thread does next.
enum Step {
    /// Sleep on the socket and the doorbell.
    Watch,
    /// Sleep on the doorbell alone (the next request is read already).
    AwaitEnd,
    Done {
        keep: bool,
        at: Instant,
    },
    Rest(Box<Rest>),
    Back(Option<RelayGuard>),
}

impl Session<'_, '_> {
    /// This request's outlet, when its answer can be written by the thread that holds it.
    pub(super) fn direct_outlet(
        &mut self,
        msg: &RequestMessage,
        progress: bool,
    ) -> Option<Arc<Outlet>> {
        let plain_whole = !msg.is_streaming
            && !progress
            && self.keep_alive
            && !self.http10
            && self.reshape.is_none()
            && self.binary.is_none()
            && self.resume.is_none()
            && self.continuation.is_none()
            && self.upload.is_none()
            && !self.ctx.gate.charges_tokens(&self.caller.who.tenant);
        if !plain_whole {
            return None;
        }
        if self.conn.outlet.is_none() {
            self.conn.outlet = Outlet::new(&self.conn.stream).map(Arc::new);
        }
        let outlet = self.conn.outlet.clone()?;
        outlet.begin();
        Some(outlet)
    }

    /// The answerer for this request; it takes over counting the request as in progress.
    pub(super) fn direct(
        &self,
        outlet: Arc<Outlet>,
        events: Sender<ClientEvent>,
        active: &mut Option<RelayGuard>,
    ) -> Option<Direct> {
        let ctx = self.ctx.this.upgrade()?;
        Some(Direct {
            active: active.take(),
            outlet,
            ctx,
            events,
            wire: self.wire.clone(),
            route: self.route.clone(),
            model: self.model.clone(),
            caller: self.caller.clone(),
            rate: self.rate,
            started: self.started,
            queue_wait: None,
            worker: None,
            state: Handling::Here,
        })
    }

    /// Waits out a direct request; returns whether the connection may be reused.
    pub(super) fn await_direct(&mut self, outlet: &Outlet, events: Receiver<ClientEvent>) -> bool {
        // Zero is no idle limit, as for the connection's reads.
        let idle = Some(self.ctx.cfg.limits.idle_timeout).filter(|t| !t.is_zero());
        // A pipelined request already read must wait for this answer to be out.
        let mut next_read = self.conn.has_buffered();
        loop {
            match self.next_step(outlet, next_read) {
                Step::Done { keep, at } => {
                    return keep && (next_read || self.client_speaks(outlet, idle, at));
                }
                Step::Rest(rest) => return self.write_rest(*rest),
                Step::Back(active) => {
                    let _active = active;
                    return self.wait(events);
                }
                Step::AwaitEnd => {
                    outlet.wake.poll(None, None);
                    outlet.wake.clear();
                }
                Step::Watch => {
                    if let Some(gone) = self.watch(outlet, idle, &mut next_read) {
                        return gone;
                    }
                }
            }
        }
    }

    fn next_step(&self, outlet: &Outlet, next_read: bool) -> Step {
        let mut phase = outlet.phase.lock();
        match &mut *phase {
            Phase::Done { keep, at } => Step::Done {
                keep: *keep,
                at: *at,
            },
            Phase::Back(active) => Step::Back(active.take()),
            Phase::Gone => Step::Back(None),
            Phase::Rest(_) => match std::mem::replace(&mut *phase, Phase::Back(None)) {
                Phase::Rest(rest) => Step::Rest(rest),
                _ => Step::Back(None),
            },
            Phase::Pending | Phase::Awaited if next_read => {
                *phase = Phase::Awaited;
                Step::AwaitEnd
            }
            Phase::Pending | Phase::Awaited => Step::Watch,
        }
    }

    /// Sleeps until the socket or the doorbell wakes it. `Some(false)`: the client left
    /// first and its request is cancelled.
    fn watch(
        &mut self,
        outlet: &Outlet,
        idle: Option<Duration>,
        next_read: &mut bool,
    ) -> Option<bool> {
        match outlet.wake.poll(Some(&self.conn.stream), idle) {
            Woke::Socket => {}
            Woke::Rung => {
                outlet.wake.clear();
                return None;
            }
            Woke::Timeout => return None,
        }
        match self.conn.stream.peek_now() {
            Peeked::Data => *next_read = true,
            Peeked::Nothing => {}
            Peeked::Closed => {
                let mut phase = outlet.phase.lock();
                if matches!(*phase, Phase::Pending | Phase::Awaited) {
                    *phase = Phase::Gone;
                    drop(phase);
                    debug!("request {}: client hung up", self.wire);
                    let gone = Event::ClientGone(self.id);
                    let _ = self.ctx.inputs.send(Input::Event(gone));
                    return Some(false);
                }
            }
        }
        None
    }

    /// After an answer went out whole: whether the client sends again (or leaves)
    /// before the connection's idle time, counted from the answer, runs out.
    fn client_speaks(&self, outlet: &Outlet, idle: Option<Duration>, at: Instant) -> bool {
        let left = idle.map(|idle| idle.saturating_sub(at.elapsed()));
        if left.is_some_and(|left| left.is_zero()) {
            return false;
        }
        outlet.wake.poll(Some(&self.conn.stream), left) == Woke::Socket
    }

    /// Writes what the socket did not take at once, then records the request.
    fn write_rest(&mut self, rest: Rest) -> bool {
        let _active = rest.active;
        self.status = rest.status;
        self.tokens = rest.tokens;
        self.queue_wait = rest.queue_wait;
        self.worker = rest.worker;
        // Recorded as completed even when the client is gone, as a whole answer is.
        let written = self.conn.stream.write_all(&rest.bytes).is_ok();
        self.record("completed");
        written && self.keep_alive
    }
}
