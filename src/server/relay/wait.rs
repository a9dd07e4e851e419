//! How a relaying thread waits for its request's next event.
//!
//! An answer comes back after a round trip through a worker and its backend, far longer
//! than a crossbeam receiver spins (about a hundred `pause`s) before it yields and then
//! sleeps. On a busy box that spin is CPU the threads making the round trip needed, so
//! the relaying thread yields first, looking for the event after each yield, and falls
//! back to crossbeam's wait (spin, yield, sleep) only when it is still not there.
//! Sleeping at once instead (a park that the dispatcher ends) cost more: the dispatcher
//! then pays a futex wake for almost every answer (docs/proving.md, "Cheaper per
//! request", has both measurements).

use std::time::Duration;

use crossbeam_channel::{Receiver, RecvTimeoutError, TryRecvError};

use crate::server::dispatcher::ClientEvent;

/// Yields before crossbeam's wait. Eight measured no better than four; on an idle box
/// each yield is a system call that returns at once.
const YIELDS_BEFORE_WAIT: u32 = 4;

/// The request's next event, waiting at most about `timeout`.
pub(super) fn next_event(
    events: &Receiver<ClientEvent>,
    timeout: Duration,
) -> Result<ClientEvent, RecvTimeoutError> {
    for _ in 0..YIELDS_BEFORE_WAIT {
        match events.try_recv() {
            Ok(event) => return Ok(event),
            Err(TryRecvError::Disconnected) => return Err(RecvTimeoutError::Disconnected),
            Err(TryRecvError::Empty) => std::thread::yield_now(),
        }
    }
    events.recv_timeout(timeout)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_event_already_there_is_taken_without_waiting() {
        let (tx, rx) = crossbeam_channel::unbounded();
        tx.send(ClientEvent::Interrupted).unwrap();
        // A zero timeout: only the first look can find it.
        assert!(matches!(
            next_event(&rx, Duration::ZERO),
            Ok(ClientEvent::Interrupted)
        ));
    }

    #[test]
    fn an_event_sent_later_ends_the_wait() {
        let (tx, rx) = crossbeam_channel::unbounded();
        let (started_tx, started) = crossbeam_channel::bounded(0);
        let sender = std::thread::spawn(move || {
            started.recv().unwrap();
            tx.send(ClientEvent::Credit(7)).unwrap();
            tx
        });
        started_tx.send(()).unwrap();
        assert!(matches!(
            next_event(&rx, Duration::from_secs(60)),
            Ok(ClientEvent::Credit(7))
        ));
        drop(sender.join().unwrap());
        assert!(matches!(
            next_event(&rx, Duration::from_secs(60)),
            Err(RecvTimeoutError::Disconnected)
        ));
    }

    #[test]
    fn nothing_sent_times_out_and_a_dropped_sender_is_reported() {
        let (tx, rx) = crossbeam_channel::unbounded::<ClientEvent>();
        assert!(matches!(
            next_event(&rx, Duration::from_millis(10)),
            Err(RecvTimeoutError::Timeout)
        ));
        drop(tx);
        assert!(matches!(
            next_event(&rx, Duration::ZERO),
            Err(RecvTimeoutError::Disconnected)
        ));
    }
}
