//! How long a relay's connection thread waits before dialing again: 1 s doubling to
//! 30 s, except toward a relay this worker was registered with a moment ago (a restart,
//! an upgrade): then the wait stops growing at a few seconds, so the worker is back
//! within seconds of the relay, not half a minute later. Pure, so it is unit-tested
//! with a fake clock; the jitter is added by the caller.

use std::time::{Duration, Instant};

pub const MIN_BACKOFF: Duration = Duration::from_secs(1);
pub const MAX_BACKOFF: Duration = Duration::from_secs(30);
/// The longest wait toward a relay lost less than [`RECENT`] ago.
pub const RECENT_MAX: Duration = Duration::from_secs(4);
/// How long after losing a relay it counts as "up a moment ago".
pub const RECENT: Duration = Duration::from_secs(300);

#[derive(Debug)]
pub struct Backoff {
    next: Duration,
    /// When the last registered session with this relay ended.
    lost_at: Option<Instant>,
}

impl Default for Backoff {
    fn default() -> Backoff {
        Backoff {
            next: MIN_BACKOFF,
            lost_at: None,
        }
    }
}

impl Backoff {
    /// A registered session ended at `now`: dial again soon.
    pub fn lost(&mut self, now: Instant) -> Duration {
        self.lost_at = Some(now);
        self.next = MIN_BACKOFF;
        MIN_BACKOFF
    }

    /// A dial or registration failed at `now`: the current wait, and the next one grows.
    pub fn failed(&mut self, now: Instant) -> Duration {
        let cap = match self.lost_at {
            Some(at) if now.saturating_duration_since(at) < RECENT => RECENT_MAX,
            _ => MAX_BACKOFF,
        };
        let current = self.next.min(cap);
        self.next = (current * 2).min(cap);
        current
    }

    /// The relay refused the secret: retry at the slow end (an operator must act).
    pub fn refused(&mut self) -> Duration {
        self.next = MAX_BACKOFF;
        MAX_BACKOFF
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn secs(s: u64) -> Duration {
        Duration::from_secs(s)
    }

    #[test]
    fn a_relay_never_reached_backs_off_to_thirty_seconds() {
        let t0 = Instant::now();
        let mut b = Backoff::default();
        let waits: Vec<u64> = (0..7).map(|_| b.failed(t0).as_secs()).collect();
        assert_eq!(waits, [1, 2, 4, 8, 16, 30, 30]);
    }

    #[test]
    fn a_relay_lost_a_moment_ago_is_retried_every_few_seconds() {
        let t0 = Instant::now();
        let mut b = Backoff::default();
        assert_eq!(b.lost(t0), MIN_BACKOFF);
        let mut t = t0;
        let mut waits = Vec::new();
        for _ in 0..8 {
            let w = b.failed(t);
            waits.push(w.as_secs());
            t += w;
        }
        assert_eq!(waits, [1, 2, 4, 4, 4, 4, 4, 4]);
        // Long after the loss, it grows to the slow end again.
        let later = t0 + RECENT + secs(1);
        let waits: Vec<u64> = (0..4).map(|_| b.failed(later).as_secs()).collect();
        assert_eq!(waits, [4, 8, 16, 30]);
    }

    #[test]
    fn a_refused_secret_waits_long_and_a_new_session_resets() {
        let t0 = Instant::now();
        let mut b = Backoff::default();
        assert_eq!(b.refused(), MAX_BACKOFF);
        assert_eq!(b.failed(t0), MAX_BACKOFF);
        b.lost(t0);
        assert_eq!(b.failed(t0), MIN_BACKOFF);
    }
}
