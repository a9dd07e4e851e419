//! The original ModelRelay's behaviour contract, as the dispatcher keeps it: the whole
//! queue for a relay nobody divided, zero settings meaning "no limit", and the backend's
//! own answer for the client when failover runs out.

use super::*;

#[test]
fn a_relay_nobody_divided_keeps_its_whole_queue() {
    let mut h = Harness::with(Config {
        max_queue_len: 2,
        max_queue_per_tenant: 1,
        ..Config::default()
    });
    h.join(1, &["m"], 1);
    h.submit(1, "m"); // the one slot
    assert!(failures(&h.submit(2, "m")).is_empty());
    assert!(failures(&h.submit(3, "m")).is_empty());
    let refused = failures(&h.submit(4, "m"));
    assert!(
        matches!(refused[..], [(4, Failure::QueueFull(_))]),
        "{refused:?}"
    );
    assert_eq!(h.d.gauges().queue_depth, 2);
    // A named tenant is still held to its share.
    let refused = failures(&h.submit_as(5, "a", Priority::Normal, 1));
    assert!(
        matches!(refused[..], [(5, Failure::QueueFull(_))]),
        "{refused:?}"
    );
}

#[test]
fn max_queue_len_zero_is_no_cap() {
    let mut h = Harness::with(Config {
        max_queue_len: 0,
        max_queue_per_tenant: 0,
        ..Config::default()
    });
    h.join(1, &["m"], 1);
    for id in 0..500 {
        assert!(failures(&h.submit(id, "m")).is_empty(), "refused at {id}");
    }
    assert_eq!(h.d.gauges().queue_depth, 499);
}

#[test]
fn queue_timeout_zero_waits_for_ever() {
    let long = Duration::from_secs(10_000_000);
    let mut h = Harness::with(Config {
        queue_timeout: Duration::ZERO,
        request_timeout: Duration::ZERO,
        heartbeat_interval: long,
        heartbeat_timeout: long,
        ..cfg()
    });
    h.join(1, &["m"], 1);
    h.submit(1, "m");
    let a = h.submit(2, "m");
    assert!(failures(&a).is_empty(), "{a:?}");
    h.at(30.0 * 24.0 * 3600.0);
    h.tick();
    assert_eq!(h.d.gauges().queue_depth, 1, "still waiting a month later");
    h.at(30.0 * 24.0 * 3600.0 + 1.0);
    assert_eq!(dispatched(&h.complete(1, 1)), vec![(2, 1)]);
}

#[test]
fn request_timeout_zero_never_cancels_an_answer() {
    let long = Duration::from_secs(10_000_000);
    let mut h = Harness::with(Config {
        request_timeout: Duration::ZERO,
        heartbeat_interval: long,
        heartbeat_timeout: long,
        ..cfg()
    });
    h.join(1, &["m"], 1);
    assert_eq!(dispatched(&h.submit(1, "m")), vec![(1, 1)]);
    let a = h.tick();
    assert!(failures(&a).is_empty() && cancels(&a).is_empty(), "{a:?}");
    h.at(1_000_000.0);
    let a = h.tick();
    assert!(failures(&a).is_empty() && cancels(&a).is_empty(), "{a:?}");
    assert_eq!(h.d.gauges().in_flight, 1);
    let a = h.complete(1, 1);
    assert!(
        a.iter()
            .any(|a| matches!(a, Action::ToClient(1, ClientEvent::Complete(_)))),
        "{a:?}"
    );
    assert_eq!(h.d.counters().failed, 0);
}

fn overloaded(id: RequestId) -> WorkerMessage {
    let headers = [
        ("content-type".to_string(), "application/json".to_string()),
        ("x-backend".to_string(), "one".to_string()),
    ];
    WorkerMessage::Error {
        request_id: Some(wire_request_id(id)),
        code: "backend_unavailable".into(),
        message: "backend answered 503".into(),
        status_code: Some(503),
        retryable: Some(true),
        headers: headers.into(),
        body: Some(r#"{"error":{"message":"model overloaded"}}"#.into()),
    }
}

fn completed(actions: &[Action]) -> Vec<(RequestId, ResponseComplete)> {
    actions
        .iter()
        .filter_map(|a| match a {
            Action::ToClient(id, ClientEvent::Complete(rc)) => Some((*id, rc.clone())),
            _ => None,
        })
        .collect()
}

#[test]
fn a_backend_error_reaches_the_client_as_the_backend_sent_it() {
    let mut h = Harness::new();
    h.join(1, &["m"], 1);
    h.submit(1, "m");
    // The one worker may try again; when the attempts are used up, the backend's own
    // answer goes to the client, not the relay's error.
    let mut a = h.said(1, overloaded(1));
    for _ in 0..5 {
        if !dispatched(&a).is_empty() {
            a = h.said(1, overloaded(1));
        }
    }
    assert!(failures(&a).is_empty(), "{a:?}");
    let done = completed(&a);
    assert_eq!(done.len(), 1, "{a:?}");
    let rc = &done[0].1;
    assert_eq!(rc.status_code, 503);
    assert_eq!(
        rc.body.as_deref(),
        Some(r#"{"error":{"message":"model overloaded"}}"#)
    );
    assert_eq!(
        rc.headers.get("content-type").map(String::as_str),
        Some("application/json")
    );
}

#[test]
fn after_failover_the_last_backend_answer_goes_through() {
    let mut h = Harness::new();
    h.join(1, &["m"], 1);
    h.join(2, &["m"], 1);
    assert_eq!(dispatched(&h.submit(1, "m")), vec![(1, 1)]);
    let a = h.said(1, overloaded(1));
    assert_eq!(dispatched(&a), vec![(1, 2)], "failed over: {a:?}");
    // The later attempts reach no backend at all: no answer of their own, so the
    // client gets the first backend's.
    let mut a = h.said(2, retryable_error(1));
    for _ in 0..5 {
        if let Some(&(_, worker)) = dispatched(&a).first() {
            a = h.said(worker, retryable_error(1));
        }
    }
    assert!(failures(&a).is_empty(), "{a:?}");
    let done = completed(&a);
    assert_eq!(done.len(), 1, "{a:?}");
    assert_eq!(done[0].1.status_code, 503);
    assert_eq!(
        done[0].1.headers.get("x-backend").map(String::as_str),
        Some("one")
    );
}

#[test]
fn a_backend_answer_outlives_a_later_attempt_that_times_out_in_the_queue() {
    let mut h = Harness::new();
    h.join(1, &["m"], 1);
    h.join(2, &["m"], 1);
    assert_eq!(dispatched(&h.submit(1, "m")), vec![(1, 1)]);
    assert_eq!(dispatched(&h.submit(2, "m")), vec![(2, 2)]);
    // Request 2's backend is overloaded; both workers are busy, so it waits again.
    let a = h.said(2, overloaded(2));
    assert!(failures(&a).is_empty() && completed(&a).is_empty(), "{a:?}");
    h.at(30.0);
    let a = h.tick();
    let done = completed(&a);
    assert_eq!(done.len(), 1, "{a:?}");
    assert_eq!((done[0].0, done[0].1.status_code), (2, 503));
}
