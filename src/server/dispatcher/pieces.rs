//! A request body that follows its request in pieces (`protocol::pieces`). The
//! dispatcher only passes pieces and credit between the client's thread and the worker
//! the request runs on: a piece for a request not in flight (cancelled, failed, or not
//! yet dispatched) is dropped, and credit from any other worker is ignored. The first
//! piece marks the request as streamed: its body is gone from the relay, so a worker
//! lost or failing after it ends the request instead of running it elsewhere. The
//! credit of a binary answer (`answer_credit`) goes the other way, client to worker.

use std::time::Instant;

use super::{Action, ClientEvent, Dispatcher, RequestId, Stage, WorkerId};
use crate::protocol::ServerMessage;

impl Dispatcher {
    pub(super) fn body_piece(
        &mut self,
        id: RequestId,
        seq: u64,
        chunk: String,
        last: bool,
        now: Instant,
    ) {
        let Some(req) = self.requests.get_mut(&id) else {
            return;
        };
        let Stage::InFlight { worker, streamed } = &mut req.stage else {
            return;
        };
        *streamed = true;
        let worker = *worker;
        // An upload under way is activity: the silence timer restarts.
        req.deadline = now + self.cfg.request_limit();
        let request_id = req.msg.request_id.clone();
        self.actions.push(Action::ToWorker(
            worker,
            ServerMessage::BodyPiece {
                request_id,
                seq,
                chunk,
                last,
            },
        ));
    }

    /// Passes the client's credit on to the worker streaming its answer, when that
    /// worker reads it.
    pub(super) fn answer_credit(&mut self, id: RequestId, until: u64) {
        let Some(req) = self.requests.get(&id) else {
            return;
        };
        let Stage::InFlight { worker, .. } = req.stage else {
            return;
        };
        let reads = self.registry.get(worker).is_some_and(|w| {
            w.features
                .iter()
                .any(|f| f == crate::protocol::pieces::FEATURE_ANSWER_CREDIT)
        });
        if reads {
            let request_id = req.msg.request_id.clone();
            self.actions.push(Action::ToWorker(
                worker,
                ServerMessage::AnswerCredit { request_id, until },
            ));
        }
    }

    pub(super) fn body_credit(&mut self, worker: WorkerId, wire: &str, until: u64, now: Instant) {
        let Some(id) = self.in_flight_on(worker, wire) else {
            return;
        };
        let Some(req) = self.requests.get_mut(&id) else {
            return;
        };
        req.deadline = now + self.cfg.request_limit();
        let untold = req.untold_dispatch.take();
        self.reply_after(id, untold, ClientEvent::Credit(until));
    }
}
