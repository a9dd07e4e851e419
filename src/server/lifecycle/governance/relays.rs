//! Op tokens with several relays: a token must work once across the whole pool, not once
//! per relay. With `STATE_URL` the relays share one nonce store, so that holds. Without it
//! each relay remembers only the nonces it accepted itself, and a token spent on one relay
//! could be spent again on another. So while the workers report more than one relay and
//! no shared store is set, op tokens are refused unless the operator accepts that risk
//! with `OP_TOKENS_PER_RELAY=on`. A single relay is never affected.
//!
//! The relay count comes from the workers ([`Shared::relays_reported`]), so the check is
//! live: a second relay joining turns it on, the pool shrinking back to one turns it off.

use std::sync::Arc;

use crate::server::shared::Shared;

/// The environment variable that opts in to per-relay replay stores (for messages).
pub const OPT_IN: &str = "OP_TOKENS_PER_RELAY";

/// What governance needs to know about the pool to decide whether op tokens are safe.
#[derive(Debug, Clone)]
pub struct RelayGuard {
    /// The relays share one nonce store (`STATE_URL`).
    pub shared_store: bool,
    /// `OP_TOKENS_PER_RELAY=on`: each relay's own store is accepted.
    pub per_relay_ok: bool,
    /// Where the dispatcher publishes the relay count; `None`: one relay (unit tests,
    /// and any governance not wired to a running relay).
    pub relays: Option<Arc<Shared>>,
}

impl RelayGuard {
    /// How many relays the workers report (1 when not wired).
    pub fn relays(&self) -> usize {
        self.relays.as_ref().map_or(1, |s| s.relays_reported())
    }

    /// `Some(relays)` when op tokens must be refused now.
    pub fn refuses(&self) -> Option<usize> {
        let relays = self.relays();
        refuse_op_tokens(self.shared_store, self.per_relay_ok, relays).then_some(relays)
    }
}

/// The decision: refuse when the nonce store is this relay's own, other relays serve the
/// same workers, and the operator has not accepted per-relay replay stores.
pub fn refuse_op_tokens(shared_store: bool, per_relay_ok: bool, relays: usize) -> bool {
    !shared_store && !per_relay_ok && relays > 1
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::server::dispatcher::Gauges;

    #[test]
    fn refused_only_with_several_relays_no_shared_store_and_no_opt_in() {
        assert!(refuse_op_tokens(false, false, 2));
        assert!(refuse_op_tokens(false, false, 3));
        assert!(
            !refuse_op_tokens(false, false, 1),
            "a single relay is unchanged"
        );
        assert!(!refuse_op_tokens(false, false, 0));
        assert!(
            !refuse_op_tokens(true, false, 3),
            "a shared store makes it safe"
        );
        assert!(!refuse_op_tokens(false, true, 3), "the operator opted in");
        assert!(!refuse_op_tokens(true, true, 3));
    }

    #[test]
    fn the_guard_follows_the_relay_count_the_workers_report() {
        let shared = Shared::new();
        let guard = RelayGuard {
            shared_store: false,
            per_relay_ok: false,
            relays: Some(shared.clone()),
        };
        assert_eq!(guard.refuses(), None);
        let gauges = |relays| Gauges {
            workers: 1,
            queue_depth: 0,
            in_flight: 0,
            relays,
        };
        shared.publish(&gauges(2));
        assert_eq!(guard.refuses(), Some(2));
        shared.publish(&gauges(1));
        assert_eq!(guard.refuses(), None, "back to one relay");
        let unwired = RelayGuard {
            relays: None,
            ..guard
        };
        assert_eq!(unwired.refuses(), None);
    }
}
