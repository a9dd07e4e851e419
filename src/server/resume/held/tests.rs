use std::sync::Arc;
use std::time::{Duration, Instant};

use super::*;
use crate::server::resume::{Config, Registry, STREAM_OVERHEAD};

fn owner(key: &str) -> Owner {
    Owner {
        key: Some(key.to_string()),
        tenant: Arc::from("t"),
    }
}

fn registry(stream_bytes: usize, total_bytes: usize) -> Registry {
    Registry::new(Config {
        default_on: false,
        grace: Duration::from_secs(30),
        stream_bytes,
        total_bytes,
    })
}

fn open(reg: &Registry, wire: &str) -> Tap {
    reg.open(wire, owner("k"), "text/event-stream")
        .expect("room for a stream")
}

fn event(n: u32) -> String {
    format!("data: {n}\n\n")
}

/// Everything reader `me` gets after `sent`, without waiting.
fn drain(held: &Held, me: u64, sent: &mut u64) -> (String, Step) {
    let mut out = Vec::new();
    loop {
        match held.next(me, sent, &mut out, Duration::ZERO) {
            Step::More => {}
            step => return (String::from_utf8(out).expect("utf-8"), step),
        }
    }
}

#[test]
fn a_dropped_stream_is_resumed_after_the_last_event_seen_then_live() {
    let reg = registry(1 << 20, 1 << 30);
    let mut tap = open(&reg, "r-1");
    let held = reg.get("r-1").expect("held");
    let first = tap
        .emit(&(event(1) + &event(2)), false)
        .expect("the client reads");
    assert_eq!(first, b"id: 1\ndata: 1\n\nid: 2\ndata: 2\n\n");
    assert!(tap.lost(), "held for a resume");
    assert_eq!(tap.emit(&event(3), false), None, "nobody to write to");
    // The client saw only event 1 (event 2 was lost in flight).
    let me = held.attach(&owner("k"), &held.token, 1).expect("resumes");
    let mut sent = 1;
    let (text, step) = drain(&held, me, &mut sent);
    assert_eq!(text, "id: 2\ndata: 2\n\nid: 3\ndata: 3\n\n");
    assert_eq!(step, Step::Idle);
    tap.emit(&event(4), true);
    tap.finish();
    let (text, step) = drain(&held, me, &mut sent);
    assert_eq!(text, "id: 4\ndata: 4\n\n");
    assert_eq!(step, Step::Ended { finished: true });

    // EventSource reconnects after the end with the last id: told to stop.
    assert_eq!(
        held.attach(&owner("k"), &held.token, 4)
            .map_err(|e| e.status),
        Err(204)
    );
    // A client that lost the last events although they were written gets them.
    let again = held.attach(&owner("k"), &held.token, 2).expect("kept");
    let mut sent = 2;
    let (text, step) = drain(&held, again, &mut sent);
    assert_eq!(text, "id: 3\ndata: 3\n\nid: 4\ndata: 4\n\n");
    assert_eq!(step, Step::Ended { finished: true });
    // Forgotten once the grace period is over (or when room is needed).
    drop(tap);
    assert!(reg.bytes() > STREAM_OVERHEAD);
    let mut streams = reg.inner.streams.lock();
    reg.sweep(&mut streams, Instant::now(), true);
    drop(streams);
    assert_eq!(reg.bytes(), 0);
}

#[test]
fn another_key_or_a_wrong_token_cannot_resume_and_sees_an_unknown_stream() {
    let reg = registry(1 << 20, 1 << 30);
    let mut tap = open(&reg, "r-1");
    tap.emit(&event(1), false);
    assert!(tap.lost());
    let held = reg.get("r-1").expect("held");
    let e = held
        .attach(&owner("other"), &held.token, 0)
        .expect_err("not the owner");
    assert_eq!((e.status, e.code.as_str()), (404, "stream_not_found"));
    let tenant = Owner {
        key: Some("k".into()),
        tenant: Arc::from("u"),
    };
    assert!(
        held.attach(&tenant, &held.token, 0).is_err(),
        "same key, other tenant"
    );
    let e = held
        .attach(&owner("k"), "guessed", 0)
        .expect_err("no token");
    assert_eq!((e.status, e.code.as_str()), (404, "stream_not_found"));
    assert!(held.attach(&owner("k"), &held.token, 0).is_ok());
}

#[test]
fn a_later_resume_takes_over_from_an_earlier_one() {
    let reg = registry(1 << 20, 1 << 30);
    let mut tap = open(&reg, "r-1");
    tap.emit(&event(1), false);
    let held = reg.get("r-1").expect("held");
    let first = held.attach(&owner("k"), &held.token, 0).expect("resumes");
    assert_eq!(tap.emit(&event(2), false), None);
    assert!(!tap.original_reads(), "the original connection is replaced");
    let second = held
        .attach(&owner("k"), &held.token, 1)
        .expect("resumes again");
    let mut sent = 0;
    assert_eq!(drain(&held, first, &mut sent).1, Step::Replaced);
    let mut sent = 1;
    let (text, step) = drain(&held, second, &mut sent);
    assert_eq!((text.as_str(), step), ("id: 2\ndata: 2\n\n", Step::Idle));
}

#[test]
fn past_the_stream_cap_while_nobody_reads_the_stream_is_given_up() {
    let reg = registry(200, 1 << 30);
    let mut tap = open(&reg, "r-1");
    assert!(tap.lost());
    let mut n = 0;
    while tap.due(Instant::now()).is_none() {
        n += 1;
        assert!(n < 100, "the cap never bit");
        tap.emit(&event(n), false);
    }
    assert_eq!(tap.due(Instant::now()), Some(BUFFER_FULL));
    assert_eq!(reg.bytes(), STREAM_OVERHEAD, "the buffer is freed at once");
    let held = reg.get("r-1").expect("still known");
    let e = held
        .attach(&owner("k"), &held.token, 0)
        .expect_err("refused");
    assert_eq!((e.status, e.code.as_str()), (409, BUFFER_FULL));
}

#[test]
fn while_the_client_reads_the_oldest_events_make_room() {
    let reg = registry(200, 1 << 30);
    let mut tap = open(&reg, "r-1");
    for n in 1..=50 {
        assert!(tap.emit(&event(n), false).is_some());
    }
    assert_eq!(tap.due(Instant::now()), None, "still going");
    let held = reg.get("r-1").expect("held");
    assert!(held.state.lock().events.charged() <= 200);
    assert!(tap.lost());
    let e = held
        .attach(&owner("k"), &held.token, 1)
        .expect_err("event 2 was dropped");
    assert_eq!((e.status, e.code.as_str()), (410, "resume_events_gone"));
    let me = held
        .attach(&owner("k"), &held.token, 49)
        .expect("recent events kept");
    let mut sent = 49;
    assert_eq!(drain(&held, me, &mut sent).0, "id: 50\ndata: 50\n\n");
}

#[test]
fn the_total_cap_bounds_all_streams_together() {
    let reg = registry(1 << 20, 2 * STREAM_OVERHEAD + 100);
    let mut a = open(&reg, "r-a");
    let _b = open(&reg, "r-b");
    assert!(
        reg.open("r-c", owner("k"), "text/event-stream").is_none(),
        "no room for a third stream: it runs as one that did not opt in"
    );
    assert!(a.lost());
    for n in 1..=10 {
        a.emit(&event(n), false);
    }
    assert_eq!(a.due(Instant::now()), Some(BUFFER_FULL));
    drop(a);
    // An ended stream is forgotten when room is needed.
    assert!(reg.open("r-c", owner("k"), "text/event-stream").is_some());
    assert!(reg.get("r-a").is_none());
}

#[test]
fn nobody_resuming_within_the_grace_period_cancels() {
    let reg = registry(1 << 20, 1 << 30);
    let mut tap = open(&reg, "r-1");
    tap.emit(&event(1), false);
    let grace = reg.config().grace;
    assert_eq!(tap.due(Instant::now() + grace), None, "a reading client");
    assert!(tap.lost());
    assert_eq!(tap.due(Instant::now()), None);
    assert_eq!(tap.due(Instant::now() + grace), Some(GRACE_OVER));
    let held = reg.get("r-1").expect("held");
    let me = held
        .attach(&owner("k"), &held.token, 1)
        .expect("resumes in time");
    assert_eq!(tap.due(Instant::now() + grace), None, "read again");
    held.detach(me);
    assert_eq!(tap.due(Instant::now() + grace), Some(GRACE_OVER));
    drop(tap);
    let e = held
        .attach(&owner("k"), &held.token, 1)
        .expect_err("expired");
    assert_eq!((e.status, e.code.as_str()), (404, "stream_expired"));
    assert_eq!(reg.bytes(), STREAM_OVERHEAD);
}

#[test]
fn a_stream_that_ends_without_finishing_is_cancelled_for_its_readers() {
    let reg = registry(1 << 20, 1 << 30);
    let mut tap = open(&reg, "r-1");
    tap.emit(&event(1), false);
    let held = reg.get("r-1").expect("held");
    let me = held.attach(&owner("k"), &held.token, 0).expect("resumes");
    drop(tap);
    let mut sent = 0;
    let (text, step) = drain(&held, me, &mut sent);
    assert_eq!(text, "", "the buffer went with the stream");
    assert_eq!(step, Step::Ended { finished: false });
    let e = held
        .attach(&owner("k"), &held.token, 0)
        .expect_err("cancelled");
    assert_eq!((e.status, e.code.as_str()), (410, "stream_cancelled"));
}
