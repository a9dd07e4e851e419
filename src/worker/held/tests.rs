//! The held-stream table without sockets: numbering, caps, grace and attach answers are
//! covered end to end in `tests/survive.rs`; here, what needs no relay.

use super::*;
use crate::protocol::WorkerMessage;

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

fn chunk(text: &str) -> WorkerMessage {
    WorkerMessage::ResponseChunk {
        request_id: "r-1".into(),
        chunk: text.into(),
    }
}

#[test]
fn the_relay_gets_the_answer_unchanged_until_it_is_lost_and_the_rest_is_kept() {
    let t = HeldStreams::default();
    let handle = Arc::new(Handle::default());
    let s = t.open(0, "r-1", &hold(30, "p"), &handle).expect("held");
    let sent = parking_lot::Mutex::new(Vec::new());
    let origin = |m: &WorkerMessage| {
        sent.lock().push(m.clone());
        true
    };
    s.pass(chunk("data: a\n\nda"), origin);
    s.pass(chunk("ta: b\n\n"), origin);
    assert_eq!(
        *sent.lock(),
        vec![chunk("data: a\n\nda"), chunk("ta: b\n\n")]
    );
    let two = t.bytes();
    assert!(two > STREAM_OVERHEAD, "the events are charged");
    assert_eq!(t.relay_lost(0), vec!["r-1".to_string()]);
    s.pass(chunk("data: c\n\n"), origin);
    assert_eq!(sent.lock().len(), 2, "a lost relay is sent nothing");
    assert!(t.bytes() > two, "what follows is kept");
    assert!(!handle.is_cancelled());
}

#[test]
fn past_the_stream_cap_with_nobody_reading_the_stream_is_given_up_and_cancelled() {
    let t = HeldStreams::default();
    let handle = Arc::new(Handle::default());
    let s = t.open(0, "r-1", &hold(30, "p"), &handle).expect("held");
    t.relay_lost(0);
    let event = format!("data: {}\n\n", "x".repeat(64 << 10));
    for _ in 0..(STREAM_BYTES / event.len()) {
        s.pass(chunk(&event), |_| true);
    }
    assert!(!handle.is_cancelled());
    s.pass(chunk(&event), |_| true);
    s.pass(chunk(&event), |_| true);
    assert!(handle.is_cancelled());
    assert_eq!(t.bytes(), STREAM_OVERHEAD, "its events are freed");
}

#[test]
fn while_its_relay_reads_the_oldest_events_make_room() {
    let t = HeldStreams::default();
    let handle = Arc::new(Handle::default());
    let s = t.open(0, "r-1", &hold(30, "p"), &handle).expect("held");
    let event = format!("data: {}\n\n", "x".repeat(64 << 10));
    for _ in 0..(3 * STREAM_BYTES / event.len()) {
        s.pass(chunk(&event), |_| true);
    }
    assert!(!handle.is_cancelled());
    assert!(t.bytes() <= STREAM_BYTES + STREAM_OVERHEAD);
}
