//! Deadlines that cannot overflow.
//!
//! `Instant + Duration` panics when the sum does not fit, and some durations come from
//! outside (`DRAIN_TIMEOUT_SECS`, the admin drain API's `drain_timeout_secs`, a server's
//! `graceful_shutdown`): a timeout of `u64::MAX` seconds means "practically never", so
//! it saturates to a deadline a century away instead of killing the thread that asked.

use std::time::{Duration, Instant};

/// A century: later than any process lives, early enough for every platform's `Instant`.
const NEVER: Duration = Duration::from_secs(100 * 365 * 24 * 3600);

/// `now + after`, saturated at a century from `now`.
pub fn later(now: Instant, after: Duration) -> Instant {
    now.checked_add(after.min(NEVER))
        .or_else(|| now.checked_add(Duration::from_secs(365 * 24 * 3600)))
        .unwrap_or(now)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_largest_timeout_saturates_instead_of_panicking() {
        let now = Instant::now();
        assert!(later(now, Duration::from_secs(u64::MAX)) > now + Duration::from_secs(3600));
        assert_eq!(
            later(now, Duration::from_secs(5)),
            now + Duration::from_secs(5)
        );
    }
}
