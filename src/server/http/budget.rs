//! One budget for every request body held in memory at once.
//!
//! Each connection may send a body of up to `MAX_REQUEST_BODY_BYTES`, and bodies are
//! read before anything else is known about the request (credentials included): 4,096
//! connections could otherwise make the server hold 128 GiB. A body takes its size from
//! the budget before it is read (a chunked one, chunk by chunk) and gives it back when
//! its request is done; past the budget the request gets a `503` at once.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

/// Bytes of request bodies in memory, and how many may be.
#[derive(Debug)]
pub struct BodyBudget {
    used: AtomicUsize,
    max: usize,
}

impl BodyBudget {
    pub fn new(max: usize) -> Arc<BodyBudget> {
        Arc::new(BodyBudget {
            used: AtomicUsize::new(0),
            max,
        })
    }

    pub fn max(&self) -> usize {
        self.max
    }

    /// Bytes taken now.
    pub fn in_use(&self) -> usize {
        self.used.load(Ordering::Acquire)
    }

    /// Takes `bytes`, or `None` when that would pass the budget.
    pub fn take(self: &Arc<Self>, bytes: usize) -> Option<BodyHold> {
        self.reserve(bytes).then(|| BodyHold {
            budget: self.clone(),
            bytes,
        })
    }

    fn reserve(&self, bytes: usize) -> bool {
        self.used
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |used| {
                used.checked_add(bytes).filter(|total| *total <= self.max)
            })
            .is_ok()
    }
}

/// Bytes one request holds; given back when dropped.
#[derive(Debug)]
pub struct BodyHold {
    budget: Arc<BodyBudget>,
    bytes: usize,
}

impl BodyHold {
    /// Takes `more` bytes for the same body; `false` when past the budget.
    pub fn grow(&mut self, more: usize) -> bool {
        let ok = self.budget.reserve(more);
        if ok {
            self.bytes += more;
        }
        ok
    }
}

impl Drop for BodyHold {
    fn drop(&mut self) {
        self.budget.used.fetch_sub(self.bytes, Ordering::AcqRel);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn holds_add_up_to_the_budget_and_give_back_on_drop() {
        let budget = BodyBudget::new(100);
        let mut a = budget.take(60).expect("fits");
        assert!(budget.take(41).is_none());
        assert!(!a.grow(41));
        assert!(a.grow(40));
        assert!(budget.take(1).is_none());
        drop(a);
        assert_eq!(budget.in_use(), 0);
        assert!(budget.take(usize::MAX).is_none());
        assert!(budget.take(100).is_some());
    }
}
