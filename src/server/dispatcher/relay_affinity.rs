//! Cache affinity across relays: what this relay tells a worker serving several relays
//! about the prompts it sends there, and what it learns from the worker about the
//! prompts the other relays sent (the protocol is in `protocol/affinity.rs`).
//!
//! Both ends stay cheap on this thread: the fingerprints were computed on the client's
//! thread with the request; sending them is a copy of at most four numbers, and a
//! report is remembered like a dispatch of our own (`affinity.rs`, bounded per worker).
//! Only workers that listed `affinity_reports` are sent anything; nothing changes for
//! a worker with one relay.

use log::debug;

use super::affinity::model_key;
use super::{Action, Dispatcher, RequestId, WorkerId};
use crate::protocol::affinity::{PrefixNote, FEATURE_AFFINITY_REPORTS, MAX_PREFIXES};
use crate::protocol::ServerMessage;

impl Dispatcher {
    /// Before request `id` goes to `worker`: its prefixes, when the worker passes them on
    /// to its other relays.
    pub(super) fn tell_prefixes(&mut self, worker: WorkerId, id: RequestId) {
        if !self.cfg.affinity {
            return;
        }
        let (Some(w), Some(req)) = (self.registry.get(worker), self.requests.get(&id)) else {
            return;
        };
        if req.prints.is_none() || !w.features.iter().any(|f| f == FEATURE_AFFINITY_REPORTS) {
            return;
        }
        if let Some(note) = PrefixNote::of(&req.msg.model, req.prints.as_slice()) {
            self.actions
                .push(Action::ToWorker(worker, ServerMessage::Prefixes(note)));
        }
    }

    /// `prefixes` from `worker`: another relay sent it a prompt with these prefixes, so
    /// its backend holds them now, as if we had sent it ourselves.
    pub(super) fn worker_prefixes(&mut self, worker: WorkerId, note: PrefixNote) {
        if !self.cfg.affinity || self.registry.get(worker).is_none() {
            return;
        }
        let prints = &note.prefixes[..note.prefixes.len().min(MAX_PREFIXES)];
        // Shortest last on the wire; remembered shortest first, so the conversation so
        // far is the most recent entry of the worker's set.
        let shortest_first: Vec<u64> = prints.iter().rev().copied().collect();
        self.affinity
            .remember(worker, model_key(&note.model), &shortest_first);
        debug!(
            "w-{worker} reports {} prefix(es) another relay sent it",
            prints.len()
        );
    }
}

#[cfg(test)]
mod tests;
