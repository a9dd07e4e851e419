//! The bounded FIFO of requests waiting for a worker.
//!
//! Ordered by original arrival, so a requeued request goes back ahead of newer ones.
//! Length is small (`MAX_QUEUE_LEN`, default 100), so plain scans are the fast path.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Instant;

use super::RequestId;
use crate::protocol::RequestMessage;

#[derive(Debug)]
struct Entry {
    arrived: Instant,
    id: RequestId,
    msg: Arc<RequestMessage>,
}

#[derive(Debug, Default)]
pub struct Queue {
    entries: VecDeque<Entry>,
}

impl Queue {
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Inserts keeping arrival order (new requests land at the back in O(1)).
    pub fn insert(&mut self, id: RequestId, arrived: Instant, msg: Arc<RequestMessage>) {
        let key = (arrived, id);
        let pos = self
            .entries
            .iter()
            .rposition(|e| (e.arrived, e.id) <= key)
            .map_or(0, |p| p + 1);
        self.entries.insert(pos, Entry { arrived, id, msg });
    }

    pub fn remove(&mut self, id: RequestId) -> bool {
        match self.entries.iter().position(|e| e.id == id) {
            Some(pos) => {
                self.entries.remove(pos);
                true
            }
            None => false,
        }
    }

    /// Removes and returns the oldest request whose model `accepts` says yes to.
    pub fn take_first(&mut self, accepts: impl Fn(&str) -> bool) -> Option<RequestId> {
        let pos = self.entries.iter().position(|e| accepts(&e.msg.model))?;
        self.entries.remove(pos).map(|e| e.id)
    }

    pub fn drain_all(&mut self) -> Vec<RequestId> {
        self.entries.drain(..).map(|e| e.id).collect()
    }
}
