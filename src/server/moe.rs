//! Multiple opinions (`moe-<model>`, opt-in with `MOE_ENABLED`): the ensemble of the
//! NOMYO Router seed, built on the relay like any client.
//!
//! A request for `moe-m` on `POST /v1/chat/completions` becomes up to seven ordinary
//! requests for `m`. Each one is submitted to the dispatcher with the caller's tenant and
//! priority and its own request id, so queueing, fair share, rate limits, token budgets,
//! the access log and the metrics see (and bill) every part:
//!
//! 1. **three drafts**: the client's body with `model: m`, not streamed, all three
//!    submitted before any is awaited. The dispatcher's least-load, round-robin choice then
//!    puts them on different workers whenever several have a free slot (no routing hint is
//!    needed, and the dispatcher is untouched);
//! 2. **one critique per draft that came back**, again submitted together: a short prompt
//!    with the question and every draft, asking for a critique of one of them and a
//!    `BEST: <n>` vote ([`critique_prompt`]);
//! 3. **the final answer**: the client's body (its `stream` and sampling parameters
//!    included) with one prompt holding the drafts, the winner of the vote and the
//!    critiques ([`final_prompt`]), run through [`relay::run`] like any request, so the
//!    client gets one ordinary chat completion, streamed or whole, with headers,
//!    cancellation, metrics and its access line as usual. Only `model` is rewritten to
//!    `moe-m` on the way out ([`Rename`]).
//!
//! If no draft succeeds the client gets the first draft's failure; failed critiques are
//! left out. The connection thread only orchestrates: it submits, waits on the reply
//! channels and watches the client, whose hang-up cancels the parts in flight
//! ([`Event::ClientGone`], as the relay does). Every routing and queueing decision stays
//! with the dispatcher, which also times each part out; [`BACKSTOP`] is only a last
//! resort.

use std::io::Write;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Select};
use log::info;
use serde_json::{json, Map, Value};

use super::body::BodyInfo;
use super::dispatcher::runtime::Input;
use super::dispatcher::{wire_request_id, ClientEvent, Event, Failure, RequestId};
use super::errors::{ApiError, Style};
use super::http::request::{Conn, Request};
use super::relay::{self, Job, Record, Reshape, HANGUP_CHECK};
use super::reply;
use super::tenancy::identity::Caller;
use super::Ctx;
use crate::protocol::{HeaderMap, RequestMessage, ResponseComplete};

/// Model prefix that asks for the ensemble.
pub const PREFIX: &str = "moe-";
/// The only route that offers it.
pub const ROUTE: &str = "/v1/chat/completions";
/// Drafts per request.
const DRAFTS: usize = 3;
/// Slack beyond the dispatcher's queue and request timeouts after which a part still
/// unanswered is given up here (the dispatcher normally fails it first).
const BACKSTOP: Duration = Duration::from_secs(5);

/// Whether `model` asks for the ensemble (the route table calls this when it is on).
pub fn requested(model: &str) -> bool {
    model.starts_with(PREFIX)
}

/// Runs the ensemble for a `moe-` request; returns whether the connection may be reused.
pub fn serve(conn: &mut Conn, ctx: &Ctx, req: Request, caller: Caller, info: BodyInfo) -> bool {
    let keep = req.keep_alive;
    let plan = match Plan::new(&req.body, &info.model) {
        Ok(plan) => plan,
        Err(e) => return reply::reject_caller(conn, ctx, &req.path, &e, keep, Some(&caller)),
    };
    let final_body = {
        let _active = ctx.shared.relay_started();
        let parts = Parts {
            ctx,
            caller: &caller,
            headers: relay::forwarded_headers(&req.headers, &caller),
            model: &plan.model,
        };
        let draft: Arc<str> = Arc::from(plan.draft_body());
        let Some(drafts) = parts.gather(conn, vec![draft; DRAFTS]) else {
            return false;
        };
        let texts: Vec<String> = drafts.iter().filter_map(|p| p.text().cloned()).collect();
        if texts.is_empty() {
            return answer_failure(conn, &drafts, keep);
        }
        let bodies = (0..texts.len())
            .map(|i| Arc::from(plan.critique_body(&texts, i)))
            .collect();
        let Some(critiques) = parts.gather(conn, bodies) else {
            return false;
        };
        let reviews: Vec<Option<String>> = critiques.iter().map(|p| p.text().cloned()).collect();
        let best = best_draft(&reviews, texts.len());
        info!(
            "moe {}: drafts {}/{DRAFTS} [{}], critiques {}/{} [{}], best draft {}; the final answer follows",
            info.model,
            texts.len(),
            wires(&drafts),
            reviews.iter().flatten().count(),
            texts.len(),
            wires(&critiques),
            best + 1
        );
        plan.final_body(&texts, best, &reviews, info.stream)
    };
    let job = Job {
        route: ROUTE.into(),
        endpoint_path: ROUTE.into(),
        model: plan.model.clone(),
        stream: info.stream,
        body: final_body,
        style: Style::OpenAi,
        reshape: Some(Box::new(Rename::new(&info.model))),
    };
    relay::run(conn, ctx, &req, job, caller)
}

/// No draft came back: the client gets the first draft's failure, OpenAI-shaped, with
/// that draft's request id (its access line tells the rest).
fn answer_failure(conn: &mut Conn, drafts: &[Part], keep: bool) -> bool {
    let Some((wire, e)) = drafts
        .iter()
        .find_map(|p| Some((p.wire.as_str(), p.error()?)))
    else {
        return false;
    };
    let head = [("x-request-id", wire)];
    let response = reply::error_response(Style::OpenAi, e, keep, &head);
    conn.stream.write_all(&response).is_ok() && keep
}

fn wires(parts: &[Part]) -> String {
    let ids: Vec<&str> = parts.iter().map(|p| p.wire.as_str()).collect();
    ids.join(" ")
}

/// What every request of the ensemble is built from.
#[derive(Debug)]
struct Plan {
    /// The model every part asks for (`m` of `moe-m`).
    model: String,
    /// The client's body.
    body: Map<String, Value>,
    /// The client's system (and developer) messages, kept for the final answer.
    system: Vec<Value>,
    /// The conversation as text, quoted in the critique and final prompts.
    question: String,
}

impl Plan {
    fn new(raw: &[u8], requested: &str) -> Result<Plan, ApiError> {
        let model = requested.strip_prefix(PREFIX).unwrap_or(requested).trim();
        if model.is_empty() {
            let e = format!("`{PREFIX}` must be followed by a model name");
            return Err(ApiError::new(400, "invalid_model", e));
        }
        let body: Map<String, Value> = serde_json::from_slice(raw).map_err(|e| {
            let e = format!("request body is not a JSON object: {e}");
            ApiError::new(400, "invalid_json", e)
        })?;
        let messages = match body.get("messages") {
            Some(Value::Array(m)) if !m.is_empty() => m,
            _ => {
                let e = format!("a `{PREFIX}` request needs a non-empty `messages` array");
                return Err(ApiError::new(400, "invalid_request", e));
            }
        };
        let system = messages.iter().filter(|m| is_system(m)).cloned().collect();
        Ok(Plan {
            model: model.to_string(),
            question: question(messages),
            system,
            body,
        })
    }

    /// The client's request for the plain model, answered whole.
    fn draft_body(&self) -> String {
        let mut body = self.body.clone();
        body.insert("model".into(), self.model.clone().into());
        body.insert("stream".into(), false.into());
        body.remove("stream_options");
        Value::Object(body).to_string()
    }

    /// A request for the critique of draft `i`: nothing of the client's but the question.
    fn critique_body(&self, drafts: &[String], i: usize) -> String {
        let prompt = critique_prompt(&self.question, drafts, i);
        json!({
            "model": self.model,
            "stream": false,
            "messages": [{"role": "user", "content": prompt}],
        })
        .to_string()
    }

    /// The client's request (sampling parameters, `stream`) with its conversation
    /// replaced by the client's system messages and the final prompt.
    fn final_body(
        &self,
        drafts: &[String],
        best: usize,
        critiques: &[Option<String>],
        stream: bool,
    ) -> String {
        let mut messages = self.system.clone();
        let prompt = final_prompt(&self.question, drafts, best, critiques);
        messages.push(json!({"role": "user", "content": prompt}));
        let mut body = self.body.clone();
        body.insert("model".into(), self.model.clone().into());
        body.insert("stream".into(), stream.into());
        body.insert("messages".into(), Value::Array(messages));
        Value::Object(body).to_string()
    }
}

/// Submits and collects the parts of one phase for one client.
struct Parts<'a> {
    ctx: &'a Ctx,
    caller: &'a Caller,
    headers: HeaderMap,
    model: &'a str,
}

/// One sub-request, from submission to its end.
struct Part {
    id: RequestId,
    wire: String,
    events: Receiver<ClientEvent>,
    started: Instant,
    queue_wait: Option<Duration>,
    worker: Option<String>,
    first_chunk: Option<Duration>,
    body: String,
    /// Set when it ended: the answer's text, or why there is none.
    answer: Option<Result<String, ApiError>>,
}

impl Part {
    fn text(&self) -> Option<&String> {
        self.answer.as_ref()?.as_ref().ok()
    }

    fn error(&self) -> Option<&ApiError> {
        self.answer.as_ref()?.as_ref().err()
    }
}

impl Parts<'_> {
    /// Submits one request per body, all before waiting, and collects every answer.
    /// `None` when the client hung up (the parts still running are cancelled).
    fn gather(&self, conn: &mut Conn, bodies: Vec<Arc<str>>) -> Option<Vec<Part>> {
        let cfg = &self.ctx.cfg.dispatch;
        let started = Instant::now();
        let deadline = started + cfg.queue_limit() + cfg.request_limit() + BACKSTOP;
        let mut parts: Vec<Part> = bodies.into_iter().map(|b| self.submit(b)).collect();
        let mut checked = started;
        loop {
            let pending: Vec<usize> = (0..parts.len())
                .filter(|&i| parts[i].answer.is_none())
                .collect();
            if pending.is_empty() {
                return Some(parts);
            }
            let now = Instant::now();
            if now.duration_since(checked) >= HANGUP_CHECK {
                checked = now;
                if conn.stream.peer_closed() {
                    for &i in &pending {
                        self.cancel(&mut parts[i], 499, Failure::ClientGone);
                    }
                    return None;
                }
            }
            if now >= deadline {
                for &i in &pending {
                    self.cancel(&mut parts[i], 504, Failure::RequestTimeout);
                }
                continue;
            }
            let receivers: Vec<Receiver<ClientEvent>> =
                pending.iter().map(|&i| parts[i].events.clone()).collect();
            let mut select = Select::new();
            for rx in &receivers {
                select.recv(rx);
            }
            let Ok(op) = select.select_timeout(HANGUP_CHECK.min(deadline - now)) else {
                continue;
            };
            let k = op.index();
            match op.recv(&receivers[k]) {
                Ok(event) => self.take(&mut parts[pending[k]], event),
                Err(_) => self.fail(&mut parts[pending[k]], &Failure::ShuttingDown),
            }
        }
    }

    /// Admits one part (rate limit, token budget) and hands it to the dispatcher.
    fn submit(&self, body: Arc<str>) -> Part {
        let id = self.ctx.next_request_id();
        let wire = wire_request_id(id);
        let (reply, events) = crossbeam_channel::unbounded();
        let mut part = Part {
            id,
            wire: wire.clone(),
            events,
            started: Instant::now(),
            queue_wait: None,
            worker: None,
            first_chunk: None,
            body: String::new(),
            answer: None,
        };
        if let Err(e) = self.ctx.gate.admit(self.caller, part.started) {
            let outcome = format!("rejected:{}", e.code);
            self.record(&part, e.status, (0, 0), &outcome);
            part.answer = Some(Err(e));
            return part;
        }
        let msg = Arc::new(RequestMessage {
            request_id: wire,
            model: self.model.to_string(),
            endpoint_path: ROUTE.into(),
            is_streaming: false,
            body,
            headers: self.headers.clone(),
            body_encoding: None,
            continuation: None,
            held: None,
        });
        let submit = Input::Submit {
            id,
            needs: crate::server::body::needs(ROUTE, &msg.body),
            // The drafts are meant for different workers, and critiques and the final
            // prompt are one-offs: no cache affinity for the ensemble's parts.
            prints: Default::default(),
            msg,
            who: self.caller.who.clone(),
            progress: false,
            reply: reply.into(),
            continuable: false,
        };
        if self.ctx.inputs.send(submit).is_err() {
            self.fail(&mut part, &Failure::ShuttingDown);
        }
        part
    }

    fn take(&self, part: &mut Part, event: ClientEvent) {
        match event {
            ClientEvent::Dispatched { queue_wait, worker } => {
                part.queue_wait = Some(queue_wait);
                part.worker = Some(worker);
            }
            // Never continuable (it is not submitted as such): no `Interrupted` comes.
            ClientEvent::Queued { .. }
            | ClientEvent::Head(_)
            | ClientEvent::Waking { .. }
            | ClientEvent::Interrupted
            | ClientEvent::Credit(_) => {}
            ClientEvent::Chunk(chunk) => {
                part.first_chunk
                    .get_or_insert_with(|| part.started.elapsed());
                part.body.push_str(&chunk);
            }
            ClientEvent::Complete(rc) => self.complete(part, rc),
            ClientEvent::Failed(f) => self.fail(part, &f),
        }
    }

    fn complete(&self, part: &mut Part, rc: ResponseComplete) {
        if let Some(rest) = rc.body.as_deref() {
            part.body.push_str(rest);
        }
        let reported = rc.token_counts.as_ref().map(|t| {
            (
                t.prompt_tokens.unwrap_or(0),
                t.completion_tokens.unwrap_or(0),
            )
        });
        let tokens = reported
            .filter(|t| *t != (0, 0))
            .or_else(|| usage_of(&serde_json::from_str(&part.body).ok()?))
            .unwrap_or((0, 0));
        if tokens != (0, 0) {
            let tenant = &self.caller.who.tenant;
            self.ctx
                .gate
                .charge(tenant, tokens.0.saturating_add(tokens.1), Instant::now());
        }
        let status = if (100..=599).contains(&rc.status_code) {
            rc.status_code
        } else {
            502
        };
        self.record(part, status, tokens, "completed");
        part.answer = Some(if (200..300).contains(&status) {
            answer_text(&part.body).ok_or_else(|| {
                ApiError::new(502, "empty_answer", "the backend's answer had no text")
            })
        } else {
            Err(answer_error(status, &part.body))
        });
    }

    fn fail(&self, part: &mut Part, f: &Failure) {
        let queue_timeout = self.ctx.cfg.dispatch.queue_timeout.as_secs();
        let e = ApiError::from_failure(f, queue_timeout);
        self.record(part, e.status, (0, 0), f.code());
        part.answer = Some(Err(e));
    }

    /// Gives up on a part still in flight: the dispatcher drops it (a `cancel` reaches
    /// its worker) and it is recorded with `status`.
    fn cancel(&self, part: &mut Part, status: u16, why: Failure) {
        let gone = Input::Event(Event::ClientGone(part.id));
        let _ = self.ctx.inputs.send(gone);
        let outcome = match why {
            Failure::ClientGone => "client_disconnect",
            _ => why.code(),
        };
        self.record(part, status, (0, 0), outcome);
        let queue_timeout = self.ctx.cfg.dispatch.queue_timeout.as_secs();
        part.answer = Some(Err(ApiError::from_failure(&why, queue_timeout)));
    }

    fn record(&self, part: &Part, status: u16, tokens: (u64, u64), outcome: &str) {
        relay::record(
            self.ctx,
            &Record {
                wire: &part.wire,
                route: ROUTE,
                model: self.model,
                caller: self.caller,
                worker: part.worker.as_deref(),
                status,
                started: part.started,
                queue_wait: part.queue_wait,
                first_chunk: part.first_chunk,
                tokens,
                outcome,
            },
        );
    }
}

mod prompts;
mod rename;
use prompts::*;
use rename::Rename;

#[cfg(test)]
mod tests;
