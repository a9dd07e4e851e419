//! Resuming a stream this relay does not hold ([`crate::protocol::held`]): the client's
//! `GET /v1/streams/{id}` reached this relay (another relay died, or a balancer sent it
//! here), so the workers that hold streams are asked; the one that holds it answers as
//! for a request with the resume's id, the others say [`NOT_HELD`].
//!
//! An attach is not a request: it takes no slot, never queues and is never requeued.
//! It is known by its id until its final answer, its client leaving, or every asked
//! worker having said no (or left).

use log::{debug, info};

use super::{Action, ClientEvent, Dispatcher, Failure, RequestId, WorkerId};
use crate::protocol::held::{Attach, FEATURE_HELD_STREAMS, NOT_HELD};
use crate::protocol::{CancelReason, ServerMessage, WorkerMessage};

/// An attach under way.
#[derive(Debug, Default)]
pub(super) struct Attaching {
    /// Workers asked that have not said no.
    asked: Vec<WorkerId>,
    /// The worker that answered with the stream.
    holder: Option<WorkerId>,
    wire: String,
}

/// The answer when no worker holds the stream.
fn not_held() -> ClientEvent {
    ClientEvent::Failed(Failure::WorkerError {
        status: Some(404),
        code: NOT_HELD.into(),
        message: "no worker holds this stream".into(),
    })
}

impl Dispatcher {
    /// Asks every worker that holds streams for this one.
    pub(super) fn attach(&mut self, id: RequestId, msg: Attach) {
        let asked: Vec<WorkerId> = self
            .registry
            .iter()
            .filter(|w| w.features.iter().any(|f| f == FEATURE_HELD_STREAMS))
            .map(|w| w.id)
            .collect();
        if asked.is_empty() {
            return self.reply(id, not_held());
        }
        for w in &asked {
            let m = ServerMessage::Attach(msg.clone());
            self.actions.push(Action::ToWorker(*w, m));
        }
        let wire = msg.request_id;
        debug!("resume {wire}: asked {} workers", asked.len());
        self.attaches.insert(
            id,
            Attaching {
                asked,
                holder: None,
                wire,
            },
        );
    }

    /// A worker's message about an attach: passed on, and `true`; `false` when the
    /// message is about no attach of this worker's.
    pub(super) fn attach_said(&mut self, worker: WorkerId, msg: &mut WorkerMessage) -> bool {
        let wire = match msg {
            WorkerMessage::ResponseChunk { request_id, .. }
            | WorkerMessage::ResponseHead { request_id, .. } => request_id.as_str(),
            WorkerMessage::ResponseComplete(rc) => rc.request_id.as_str(),
            WorkerMessage::Error {
                request_id: Some(request_id),
                ..
            } => request_id.as_str(),
            _ => return false,
        };
        let Some(id) = super::parse_request_id(wire) else {
            return false;
        };
        let Some(a) = self.attaches.get_mut(&id) else {
            return false;
        };
        if !a.asked.contains(&worker) || a.holder.is_some_and(|h| h != worker) {
            return true;
        }
        match std::mem::replace(msg, WorkerMessage::Unknown(String::new())) {
            WorkerMessage::ResponseHead { headers, .. } => {
                a.holder = Some(worker);
                self.reply(id, ClientEvent::Head(headers));
            }
            WorkerMessage::ResponseChunk { chunk, .. } => {
                a.holder = Some(worker);
                self.reply(id, ClientEvent::Chunk(chunk));
            }
            WorkerMessage::ResponseComplete(rc) => {
                self.attaches.remove(&id);
                self.reply(id, ClientEvent::Complete(rc));
            }
            WorkerMessage::Error { code, .. } if code == NOT_HELD && a.holder.is_none() => {
                a.asked.retain(|w| *w != worker);
                if a.asked.is_empty() {
                    self.attaches.remove(&id);
                    self.reply(id, not_held());
                }
            }
            WorkerMessage::Error {
                code,
                message,
                status_code,
                ..
            } => {
                info!("resume {wire}: {code}: {message}", wire = a.wire);
                self.attaches.remove(&id);
                let failure = Failure::WorkerError {
                    status: status_code,
                    code,
                    message,
                };
                self.reply(id, ClientEvent::Failed(failure));
            }
            _ => {}
        }
        true
    }

    /// A worker left: the attaches it held fail, those it was asked about go on without it.
    pub(super) fn attach_worker_left(&mut self, worker: WorkerId) {
        let mut ended = Vec::new();
        for (id, a) in &mut self.attaches {
            if a.holder == Some(worker) {
                ended.push((*id, ClientEvent::Failed(Failure::WorkerLost)));
            } else if a.holder.is_none() {
                a.asked.retain(|w| *w != worker);
                if a.asked.is_empty() {
                    ended.push((*id, not_held()));
                }
            }
        }
        ended.sort_unstable_by_key(|(id, _)| *id);
        for (id, event) in ended {
            self.attaches.remove(&id);
            self.reply(id, event);
        }
    }

    /// The resuming client left: the workers asked are told (the holder detaches the
    /// reader; the stream goes on for its grace period). `false`: no such attach.
    pub(super) fn attach_gone(&mut self, id: RequestId) -> bool {
        let Some(a) = self.attaches.remove(&id) else {
            return false;
        };
        let to: Vec<WorkerId> = a.holder.map_or(a.asked, |h| vec![h]);
        for w in to {
            let cancel = ServerMessage::Cancel {
                request_id: a.wire.clone(),
                reason: CancelReason::ClientDisconnect,
            };
            self.actions.push(Action::ToWorker(w, cancel));
        }
        self.reply(id, ClientEvent::Failed(Failure::ClientGone));
        true
    }
}

#[cfg(test)]
mod tests;
