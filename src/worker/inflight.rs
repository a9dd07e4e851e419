//! The worker's table of running requests: cancel handles, the live load, and a way to
//! wait until everything finished (for drain). A request is known by its relay (the
//! index in `PROXY_URL`) and its id: two relays number their requests alike.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use parking_lot::{Condvar, Mutex};

/// Cancellation handle of one request. Cancelling shuts down the backend agent the
/// request uses, so a thread blocked reading the backend's answer wakes up at once.
#[derive(Default)]
pub struct Handle {
    state: Mutex<HandleState>,
    /// Wakes a binary answer waiting for the server's credit (or for the cancel).
    credit: Condvar,
}

#[derive(Default)]
struct HandleState {
    cancelled: bool,
    agent: Option<ureq::Agent>,
    /// Where the pieces of a body that follows the request go (`backend::pieces`).
    pieces: Option<crossbeam_channel::Sender<Piece>>,
    /// How many chunks of a binary answer the server lets come (`None`: no limit, the
    /// server does not grant `answer_credit`).
    answer_until: Option<u64>,
}

/// One `body_piece`: its number, its base64 text, whether it is the last.
pub type Piece = (u64, String, bool);

impl Handle {
    /// Records the agent the request is about to use; false if already cancelled.
    pub fn attach(&self, agent: &ureq::Agent) -> bool {
        let mut state = self.state.lock();
        if state.cancelled {
            return false;
        }
        state.agent = Some(agent.clone());
        true
    }

    pub fn detach(&self) {
        self.state.lock().agent = None;
    }

    /// Opens the way for the request's body pieces, `room` of them at most waiting.
    pub fn open_pieces(&self, room: usize) -> crossbeam_channel::Receiver<Piece> {
        let (tx, rx) = crossbeam_channel::bounded(room);
        let mut state = self.state.lock();
        if !state.cancelled {
            state.pieces = Some(tx);
        }
        rx
    }

    /// Passes a piece on without waiting; false when none is expected or there is no
    /// room (the server sent past its credit).
    pub fn push_piece(&self, piece: Piece) -> bool {
        let state = self.state.lock();
        state
            .pieces
            .as_ref()
            .is_some_and(|tx| tx.try_send(piece).is_ok())
    }

    /// The server grants answer credit: chunks past `window` wait for it.
    pub fn limit_answer(&self, window: u64) {
        self.state.lock().answer_until = Some(window);
    }

    /// The server's `answer_credit`: chunks below `until` may go.
    pub fn answer_credit(&self, until: u64) {
        let mut state = self.state.lock();
        if let Some(now) = &mut state.answer_until {
            *now = (*now).max(until);
            self.credit.notify_all();
        }
    }

    /// Waits until chunk number `n` of a binary answer may go; false when cancelled
    /// meanwhile.
    pub fn wait_answer(&self, n: u64) -> bool {
        let mut state = self.state.lock();
        while !state.cancelled && state.answer_until.is_some_and(|until| n >= until) {
            self.credit.wait(&mut state);
        }
        !state.cancelled
    }

    pub fn cancel(&self) {
        let mut state = self.state.lock();
        state.cancelled = true;
        self.credit.notify_all();
        // The backend's body reader, waiting for a piece, wakes up to an end.
        state.pieces = None;
        if let Some(agent) = state.agent.take() {
            agent.shutdown();
        }
    }

    pub fn is_cancelled(&self) -> bool {
        self.state.lock().cancelled
    }
}

/// A request's key: its relay and its id.
type Key = (usize, String);

#[derive(Default)]
pub struct InFlight {
    table: Mutex<HashMap<Key, Arc<Handle>>>,
    changed: Condvar,
}

/// Why [`InFlight::insert`] did not take a request.
#[derive(Debug, PartialEq, Eq)]
pub enum Refused {
    /// The id is already running for that relay.
    Duplicate,
    /// `limit` requests are running or waiting already.
    Full,
}

impl InFlight {
    /// Registers a request, unless its id runs already or `limit` requests (when given)
    /// are in the table: the check and the insert are one step, so two relays racing
    /// for the last slot cannot both get it.
    pub fn insert(
        &self,
        relay: usize,
        id: &str,
        limit: Option<usize>,
    ) -> Result<Arc<Handle>, Refused> {
        let mut table = self.table.lock();
        let key = (relay, id.to_string());
        if table.contains_key(&key) {
            return Err(Refused::Duplicate);
        }
        if limit.is_some_and(|l| table.len() >= l) {
            return Err(Refused::Full);
        }
        let handle = Arc::new(Handle::default());
        table.insert(key, handle.clone());
        Ok(handle)
    }

    pub fn remove(&self, relay: usize, id: &str) {
        self.table.lock().remove(&(relay, id.to_string()));
        self.changed.notify_all();
    }

    /// Cancels one request; false if it is not running.
    pub fn cancel(&self, relay: usize, id: &str) -> bool {
        let handle = self.table.lock().get(&(relay, id.to_string())).cloned();
        handle.map(|h| h.cancel()).is_some()
    }

    /// Hands a body piece to its request; false when it is not running or did not
    /// take it.
    pub fn piece(&self, relay: usize, id: &str, piece: Piece) -> bool {
        let handle = self.table.lock().get(&(relay, id.to_string())).cloned();
        handle.is_some_and(|h| h.push_piece(piece))
    }

    /// Passes the server's answer credit to its request.
    pub fn answer_credit(&self, relay: usize, id: &str, until: u64) {
        let handle = self.table.lock().get(&(relay, id.to_string())).cloned();
        if let Some(h) = handle {
            h.answer_credit(until);
        }
    }

    pub fn cancel_all(&self) {
        self.cancel_where(|_, _| true);
    }

    /// Cancels the requests of one relay (its session ended: answers cannot reach it),
    /// but those in `kept` (streams held for a resume through another relay).
    pub fn cancel_relay(&self, relay: usize, kept: &[String]) {
        self.cancel_where(|r, id| r == relay && !kept.iter().any(|k| k == id));
    }

    fn cancel_where(&self, which: impl Fn(usize, &str) -> bool) {
        let handles: Vec<Arc<Handle>> = self
            .table
            .lock()
            .iter()
            .filter(|((r, id), _)| which(*r, id))
            .map(|(_, h)| h.clone())
            .collect();
        for h in handles {
            h.cancel();
        }
    }

    pub fn len(&self) -> usize {
        self.table.lock().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Blocks until no request is running or `deadline` passes; true when idle.
    pub fn wait_idle(&self, deadline: Instant) -> bool {
        let mut table = self.table.lock();
        while !table.is_empty() {
            if self.changed.wait_until(&mut table, deadline).timed_out() {
                return table.is_empty();
            }
        }
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_are_known_by_relay_and_id_and_the_limit_is_kept() {
        let t = InFlight::default();
        assert!(t.insert(0, "r-1", Some(2)).is_ok());
        // Another relay numbers its requests alike.
        assert!(t.insert(1, "r-1", Some(2)).is_ok());
        assert_eq!(t.insert(1, "r-1", None).err(), Some(Refused::Duplicate));
        assert_eq!(t.insert(1, "r-2", Some(2)).err(), Some(Refused::Full));
        assert!(t.insert(1, "r-2", None).is_ok());
        t.cancel_relay(1, &[]);
        assert!(!t.table.lock()[&(0, "r-1".to_string())].is_cancelled());
        assert!(t.table.lock()[&(1, "r-2".to_string())].is_cancelled());
        t.remove(1, "r-1");
        assert_eq!(t.len(), 2);
    }
}
