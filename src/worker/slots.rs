//! Backend slots: `MAX_CONCURRENCY` long-lived threads, each owning one backend agent.
//! The number of threads is what bounds the backend's parallel requests; no thread is
//! spawned per request.
//!
//! Each idle slot parks on its own mailbox and [`Slots::submit`] hands a request to
//! exactly one of them (the most recently idle, whose stack is still warm) and unparks
//! it. With every slot busy the request waits in `pending`, which a slot drains before
//! parking again. (A single queue shared by all slots made every idle thread spin and
//! yield for each request; on a 2-core box that cost more than the backend call.)

use std::collections::VecDeque;
use std::sync::Arc;

use std::thread::Thread;

use log::{error, info, warn};
use parking_lot::Mutex;

use super::backend::{fresh_agent, Outcome, UNAVAILABLE_BODY_CHARS};
use super::continuation;
use super::health;
use super::held;
use super::inflight::{Handle, Refused};
use super::relays;
use super::relays::session::{Link, Out};
use super::trim;
use super::Shared;
use crate::protocol::{HeaderMap, RequestMessage, WorkerMessage};

/// One request waiting for (or running in) a slot.
pub struct Job {
    pub req: Arc<RequestMessage>,
    pub handle: Arc<Handle>,
    /// The writer of the session the request came in on.
    pub out: Out,
    /// That session's relay (its index in `PROXY_URL`).
    pub relay: usize,
    /// That relay reads `error.retryable` and runs such requests elsewhere.
    pub failover: bool,
    /// That relay asked for `response_head` (the backend's head before the first chunk).
    pub response_head: bool,
    /// The answer is also kept here for a resume through another relay ([`held`]).
    pub held: Option<Arc<held::Stream>>,
}

#[derive(Default)]
pub struct Slots {
    state: Mutex<SlotState>,
}

#[derive(Default)]
struct SlotState {
    idle: Vec<Arc<Mailbox>>,
    pending: VecDeque<Job>,
}

/// Where a parked slot receives its next request.
struct Mailbox {
    job: Mutex<Option<Job>>,
    thread: Thread,
}

impl Slots {
    /// Starts `n` slot threads; they run for the life of the process.
    pub fn start(shared: &Arc<Shared>, n: u32) {
        for i in 0..n {
            let shared = shared.clone();
            let spawned = std::thread::Builder::new()
                .name(format!("slot-{i}"))
                .stack_size(256 * 1024)
                .spawn(move || run_slot(&shared));
            if let Err(e) = spawned {
                error!("cannot start backend slot thread {i}: {e}");
            }
        }
    }

    /// Hands a request to an idle slot, or queues it. False for a duplicate id, or a
    /// request refused as `busy`: with every slot taken, a relay that understands `busy`
    /// (only a worker serving several relays offers it) is refused at once and runs the
    /// request elsewhere or later; any other relay's request waits here for a slot, as
    /// it always did (an original server counts its own requests and never sends more
    /// than our slots, so only other relays' work can make it wait).
    pub fn submit(&self, shared: &Shared, req: Arc<RequestMessage>, link: &Link) -> bool {
        let limit = link.busy.then_some(shared.cfg.max_concurrency as usize);
        let handle = match shared.inflight.insert(link.relay, &req.request_id, limit) {
            Ok(handle) => handle,
            Err(Refused::Duplicate) => {
                warn!(
                    "request {} is already running; duplicate ignored",
                    req.request_id
                );
                return false;
            }
            Err(Refused::Full) => {
                relays::refuse_busy(shared, link, &req.request_id);
                return false;
            }
        };
        relays::report_load(shared);
        // Only a worker serving several relays holds streams (it listed the feature).
        let held = req
            .held
            .as_ref()
            .filter(|_| req.is_streaming && shared.cfg.connect_urls.len() > 1)
            .and_then(|h| shared.held.open(link.relay, &req.request_id, h, &handle));
        if link.answer_credit {
            handle.limit_answer(crate::protocol::pieces::ANSWER_WINDOW);
        }
        let job = Job {
            req,
            handle,
            out: link.out.clone(),
            relay: link.relay,
            failover: link.failover,
            response_head: link.response_head,
            held,
        };
        let idle = {
            let mut state = self.state.lock();
            match state.idle.pop() {
                Some(slot) => Some(slot),
                None => {
                    state.pending.push_back(job);
                    return true;
                }
            }
        };
        if let Some(slot) = idle {
            *slot.job.lock() = Some(job);
            slot.thread.unpark();
        }
        true
    }

    /// The next queued request, or registers the slot as idle (it then parks).
    fn next_or_idle(&self, me: &Arc<Mailbox>) -> Option<Job> {
        let mut state = self.state.lock();
        let job = state.pending.pop_front();
        if job.is_none() {
            state.idle.push(me.clone());
        }
        job
    }
}

fn run_slot(shared: &Shared) {
    let me = Arc::new(Mailbox {
        job: Mutex::new(None),
        thread: std::thread::current(),
    });
    let mut agent = fresh_agent();
    let mut next = shared.slots.next_or_idle(&me);
    loop {
        match next.take().or_else(|| me.job.lock().take()) {
            Some(job) => {
                run_job(shared, &mut agent, job);
                next = shared.slots.next_or_idle(&me);
            }
            // An unpark that came before this park makes it return at once.
            None => std::thread::park(),
        }
    }
}

fn run_job(shared: &Shared, agent: &mut ureq::Agent, job: Job) {
    // A continuation gets the body its backend's kind needs ([`continuation`]).
    let kind = shared.residency.kind();
    let (job, refused) = match continuation::prepare(&job.req, kind) {
        Ok(req) => (Job { req, ..job }, None),
        Err(why) => (job, Some(why)),
    };
    let id = job.req.request_id.as_str();
    let (report, answered) = match (shared.health.down_reason(), refused) {
        (_, Some(why)) => (
            Some(Report::retryable("continuation_unsupported", why, 502)),
            false,
        ),
        // The server has not heard yet (or, an original server, still had the request
        // queued): refuse at once, without touching the backend, so it can run elsewhere.
        (Some(reason), None) => (
            Some(Report::retryable(
                "backend_unreachable",
                format!("backend is down: {reason}"),
                502,
            )),
            false,
        ),
        (None, None) => {
            let (outcome, echo_refused) = forward(shared, agent, &job);
            if echo_refused {
                let why = "the backend did not continue the answer (llama-server continues \
                           an assistant prefill only with a jinja chat template)";
                warn!("request {id} refused: {why}");
                let report = Report::retryable("continuation_unsupported", why.into(), 502);
                shared.inflight.remove(job.relay, id);
                relays::report_load(shared);
                send_report(&job, report.into_message(id));
                return;
            }
            let answered = !matches!(outcome, Outcome::Unreachable(_));
            if let Outcome::Unreachable(e) = &outcome {
                // Before the error, so the server stops routing here before it retries.
                health::backend_failed(shared, e);
            }
            (report(shared, &job.req, outcome), answered)
        }
    };
    // Off the books before the error goes out: a server that fails the request over
    // may send the same id straight back here, and must not find it still running.
    shared.inflight.remove(job.relay, id);
    relays::report_load(shared);
    if let Some(r) = report {
        send_report(&job, r.into_message(id));
    }
    if answered {
        // After the answer went out: a model that was not loaded probably is now, and
        // the models thread re-checks (a loaded model costs a lookup, nothing more).
        shared.residency.after_request(&job.req.model);
    }
}

/// Runs the request against the backend; a cancelled agent is replaced. True with the
/// outcome: a continuation the backend did not continue (see [`continuation::Echo`]).
fn forward(shared: &Shared, agent: &mut ureq::Agent, job: &Job) -> (Outcome, bool) {
    let head = job.response_head;
    let mut echo = continuation::Echo::for_request(&job.req, shared.residency.kind());
    let mut emit = |msg: WorkerMessage| {
        let msg = match &mut echo {
            Some(echo) => match echo.filter(msg) {
                Some(msg) => msg,
                None => {
                    if echo.refused() {
                        job.handle.cancel();
                    }
                    return;
                }
            },
            None => msg,
        };
        // A server that did not ask for `response_head` is not sent one.
        if head || !matches!(msg, WorkerMessage::ResponseHead { .. }) {
            match &job.held {
                Some(held) => held.pass(msg, |m| job.out.send(m)),
                None => {
                    job.out.send(&msg);
                }
            }
        }
    };
    let outcome = if job.handle.attach(agent) {
        info!(
            "forwarding request {}: {} {} (stream: {})",
            job.req.request_id, job.req.model, job.req.endpoint_path, job.req.is_streaming
        );
        let failover = job.failover;
        let trim =
            trim::attempts::wanted(shared.cfg.context_trim, &job.req).then(|| trim::Policy {
                contexts: &shared.contexts,
                described_ctx: shared.residency.context_length(&job.req.model),
            });
        shared
            .backend
            .forward(agent, &job.req, &job.handle, failover, trim, &mut emit)
    } else {
        Outcome::Cancelled
    };
    job.handle.detach();
    if job.handle.is_cancelled() {
        // A cancelled agent is shut down for good.
        *agent = fresh_agent();
    }
    (outcome, echo.is_some_and(|e| e.refused()))
}

/// Sends a request's `error` to its relay; a held stream's resumed reader gets it too.
fn send_report(job: &Job, msg: WorkerMessage) {
    if let Some(held) = &job.held {
        held.failed(&msg);
    }
    job.out.send(&msg);
}

/// An `error` for one request.
struct Report {
    code: &'static str,
    message: String,
    status_code: Option<u16>,
    /// Nothing reached the server yet and the backend never answered this request:
    /// another worker may run it.
    retryable: bool,
    /// The backend's own answer (headers, body), for the client if no other comes.
    answer: Option<(HeaderMap, String)>,
}

impl Report {
    fn new(code: &'static str, message: String, status_code: Option<u16>) -> Report {
        Report {
            code,
            message,
            status_code,
            retryable: false,
            answer: None,
        }
    }

    fn retryable(code: &'static str, message: String, status_code: u16) -> Report {
        Report {
            retryable: true,
            ..Report::new(code, message, Some(status_code))
        }
    }

    fn into_message(self, id: &str) -> WorkerMessage {
        let (headers, body) = match self.answer {
            Some((headers, body)) => (headers, Some(body)),
            None => (HeaderMap::new(), None),
        };
        WorkerMessage::Error {
            request_id: Some(id.to_string()),
            code: self.code.into(),
            message: self.message,
            status_code: self.status_code,
            // Absent rather than false when not retryable: today's exact shape.
            retryable: self.retryable.then_some(true),
            headers,
            body,
        }
    }
}

/// The `error` to report for an outcome, if any.
fn report(shared: &Shared, req: &RequestMessage, outcome: Outcome) -> Option<Report> {
    let id = req.request_id.as_str();
    let unreachable = |e: &str| {
        let url = shared.backend.shown_url(&req.endpoint_path);
        format!("backend request to {url} failed: {e}")
    };
    match outcome {
        Outcome::Completed => None,
        Outcome::Cancelled => {
            info!("request {id} cancelled; backend connection closed");
            Some(Report::new("cancelled", "request cancelled".into(), None))
        }
        Outcome::Unreachable(e) => {
            warn!("backend error for request {id}: {e}");
            Some(Report::retryable(
                "backend_unreachable",
                unreachable(&e),
                502,
            ))
        }
        Outcome::Unavailable {
            status,
            headers,
            body,
        } => {
            warn!("backend answered {status} for request {id}; reported as retryable");
            let text = body.as_deref().unwrap_or("(too large to keep)");
            let short: String = text.chars().take(UNAVAILABLE_BODY_CHARS).collect();
            let message = format!("backend answered {status}: {short}");
            let mut report = Report::retryable("backend_unavailable", message, status);
            report.answer = body.map(|body| (headers, body));
            Some(report)
        }
        Outcome::Failed(e) => {
            warn!("backend error for request {id}: {e}");
            Some(Report::new(
                "backend_unreachable",
                unreachable(&e),
                Some(502),
            ))
        }
        Outcome::StreamBroken(e) => {
            warn!("backend stream for request {id} broke: {e}");
            let message = format!("backend stream failed: {e}");
            Some(Report::new("backend_stream_failed", message, Some(502)))
        }
        Outcome::TooLarge(limit) => {
            warn!("backend answer for request {id} exceeds {limit} bytes");
            let message = format!("backend answer exceeds {limit} bytes");
            Some(Report::new("response_too_large", message, Some(502)))
        }
        Outcome::BadPath(why) => {
            let path = &req.endpoint_path;
            warn!("request {id} refused: endpoint path {path:?} not sent to the backend: {why}");
            let message = format!("the worker refused endpoint path {path:?}: {why}");
            Some(Report::new("invalid_endpoint_path", message, Some(502)))
        }
    }
}
