//! The held-stream table without sockets: numbering, caps, grace and attach answers are
//! covered end to end in `tests/survive.rs`; here, what needs no relay.

use super::*;

fn hold(grace: u64, proof: &str) -> Hold {
    Hold {
        grace_secs: grace,
        proof: proof.into(),
    }
}

#[test]
fn a_stream_without_proof_or_grace_is_not_held_and_the_total_is_charged() {
    let t = HeldStreams::default();
    let handle = Arc::new(Handle::default());
    assert!(t.open(0, "r-1", &hold(30, ""), &handle).is_none());
    assert!(t.open(0, "r-1", &hold(0, "p"), &handle).is_none());
    assert!(t
        .open(0, "r-1", &hold(30, &"p".repeat(MAX_PROOF + 1)), &handle)
        .is_none());
    assert!(t.open(0, "r-1", &hold(30, "p"), &handle).is_some());
    assert_eq!((t.len(), t.bytes()), (1, STREAM_OVERHEAD));
}

#[test]
fn a_lost_relay_holds_its_streams_and_the_grace_period_cancels_them() {
    let t = HeldStreams::default();
    let handle = Arc::new(Handle::default());
    let s = t.open(1, "r-1", &hold(2, "p"), &handle).expect("held");
    // Another relay's loss changes nothing.
    assert!(t.relay_lost(0).is_empty());
    let t0 = Instant::now();
    assert!(s.relay_lost(1, t0));
    assert!(!s.reap(t0 + Duration::from_secs(1)));
    assert!(!handle.is_cancelled());
    assert!(!s.reap(t0 + Duration::from_secs(2)));
    assert!(handle.is_cancelled());
    // Ended: forgotten a grace period later.
    assert!(s.reap(t0 + Duration::from_secs(5)));
}
