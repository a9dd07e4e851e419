//! The worker's table of running requests: cancel handles, the live load, and a way to
//! wait until everything finished (for drain).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use parking_lot::{Condvar, Mutex};

/// Cancellation handle of one request. Cancelling shuts down the backend agent the
/// request uses, so a thread blocked reading the backend's answer wakes up at once.
#[derive(Default)]
pub struct Handle {
    state: Mutex<HandleState>,
}

#[derive(Default)]
struct HandleState {
    cancelled: bool,
    agent: Option<ureq::Agent>,
}

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

    pub fn cancel(&self) {
        let mut state = self.state.lock();
        state.cancelled = true;
        if let Some(agent) = state.agent.take() {
            agent.shutdown();
        }
    }

    pub fn is_cancelled(&self) -> bool {
        self.state.lock().cancelled
    }
}

#[derive(Default)]
pub struct InFlight {
    table: Mutex<HashMap<String, Arc<Handle>>>,
    changed: Condvar,
}

impl InFlight {
    /// Registers a request; `None` if the id is already running.
    pub fn insert(&self, id: &str) -> Option<Arc<Handle>> {
        let mut table = self.table.lock();
        if table.contains_key(id) {
            return None;
        }
        let handle = Arc::new(Handle::default());
        table.insert(id.to_string(), handle.clone());
        Some(handle)
    }

    pub fn remove(&self, id: &str) {
        self.table.lock().remove(id);
        self.changed.notify_all();
    }

    /// Cancels one request; false if it is not running.
    pub fn cancel(&self, id: &str) -> bool {
        let handle = self.table.lock().get(id).cloned();
        handle.map(|h| h.cancel()).is_some()
    }

    pub fn cancel_all(&self) {
        let handles: Vec<Arc<Handle>> = self.table.lock().values().cloned().collect();
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
