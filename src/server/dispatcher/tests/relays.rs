//! Workers serving several relays: `load` reports and `busy` answers (fake clock).

use super::*;

/// Joins a worker that reports its load and understands `busy`.
fn join_multi(h: &mut Harness, id: WorkerId, max: u32) -> Vec<Action> {
    let register = RegisterMessage {
        worker_name: format!("box-{id}"),
        models: vec!["m".into()],
        max_concurrent: max,
        protocol_version: Some("1".into()),
        current_load: Some(0),
        features: vec![
            crate::protocol::FEATURE_LOAD_REPORTS.into(),
            crate::protocol::FEATURE_BUSY.into(),
        ],
        loaded_models: None,
        backend_kind: None,
        model_info: None,
        wake: None,
        routes: None,
    };
    h.ev(Event::WorkerJoined {
        id,
        register,
        remote: "127.0.0.1:1".into(),
    })
}

fn busy(h: &mut Harness, worker: WorkerId, id: RequestId, in_flight: u32) -> Vec<Action> {
    let request_id = wire_request_id(id);
    h.said(
        worker,
        WorkerMessage::Busy {
            request_id,
            in_flight,
        },
    )
}

fn load(h: &mut Harness, worker: WorkerId, in_flight: u32) -> Vec<Action> {
    h.said(worker, WorkerMessage::Load { in_flight })
}

#[test]
fn the_features_are_acked_only_to_workers_that_list_them() {
    let mut h = Harness::new();
    let acked = |actions: &[Action]| -> Vec<String> {
        actions
            .iter()
            .find_map(|a| match a {
                Action::ToWorker(_, ServerMessage::RegisterAck(ack)) => Some(ack.features.clone()),
                _ => None,
            })
            .expect("register_ack")
    };
    let plain = acked(&h.join(1, &["m"], 1));
    assert!(!plain.iter().any(|f| f == "load_reports" || f == "busy"));
    let multi = acked(&join_multi(&mut h, 2, 1));
    assert!(multi.iter().any(|f| f == "load_reports"));
    assert!(multi.iter().any(|f| f == "busy"));
}

#[test]
fn reported_load_from_other_relays_takes_capacity_here() {
    let mut h = Harness::new();
    join_multi(&mut h, 1, 2);
    // Another relay holds both slots: nothing is sent.
    load(&mut h, 1, 2);
    assert!(dispatched(&h.submit(1, "m")).is_empty());
    // One slot freed there: the request goes.
    assert_eq!(dispatched(&load(&mut h, 1, 1)), vec![(1, 1)]);
    // Its report now counts our request too: still one slot taken elsewhere, none free.
    load(&mut h, 1, 2);
    assert!(dispatched(&h.submit(2, "m")).is_empty());
}

#[test]
fn busy_requeues_in_place_and_is_no_failure_nor_a_requeue() {
    let mut h = Harness::new();
    join_multi(&mut h, 1, 1);
    assert_eq!(dispatched(&h.submit(1, "m")), vec![(1, 1)]);
    h.submit(2, "m");
    // More refusals than the requeue budget allows: none of them fails the request.
    for round in 0..5 {
        let a = busy(&mut h, 1, 1, 1);
        assert!(failures(&a).is_empty(), "round {round}: {a:?}");
        // The worker is full until it reports a freed slot: nothing is sent meanwhile.
        assert!(dispatched(&a).is_empty(), "round {round}: {a:?}");
        // Then request 1 goes first again: it kept its place ahead of request 2.
        assert_eq!(dispatched(&load(&mut h, 1, 0)), vec![(1, 1)]);
    }
    let c = h.d.counters();
    assert_eq!((c.busy, c.failovers, c.requeued, c.failed), (5, 0, 0, 0));
    // Not an ejection signal either: the worker is up and takes the next request.
    assert!(h.d.registry.get(1).is_some_and(|w| w.health == Health::Up));
    assert_eq!(dispatched(&h.complete(1, 1)), vec![(2, 1)]);
}

#[test]
fn a_busy_request_goes_at_once_to_a_worker_with_room() {
    let mut h = Harness::new();
    join_multi(&mut h, 1, 1);
    join_multi(&mut h, 2, 1);
    let first = dispatched(&h.submit(1, "m"));
    let (_, w) = first[0];
    let other = if w == 1 { 2 } else { 1 };
    assert_eq!(dispatched(&busy(&mut h, w, 1, 1)), vec![(1, other)]);
}

#[test]
fn a_busy_request_keeps_its_queue_deadline() {
    let mut h = Harness::new();
    join_multi(&mut h, 1, 1);
    h.submit(1, "m");
    h.at(20.0);
    busy(&mut h, 1, 1, 1);
    h.at(29.0);
    assert!(failures(&h.tick()).is_empty());
    // 30 s after it arrived, not 30 s after the refusal.
    h.at(30.5);
    assert_eq!(failures(&h.tick()), vec![(1, Failure::QueueTimeout)]);
}

#[test]
fn busy_for_a_request_not_running_there_is_ignored() {
    let mut h = Harness::new();
    join_multi(&mut h, 1, 1);
    join_multi(&mut h, 2, 1);
    let (_, w) = dispatched(&h.submit(1, "m"))[0];
    let other = if w == 1 { 2 } else { 1 };
    let a = busy(&mut h, other, 1, 1);
    assert!(a.is_empty(), "{a:?}");
    assert_eq!(h.d.counters().busy, 0);
}

#[test]
fn the_relay_list_is_bounded_and_counted() {
    let mut h = Harness::new();
    assert_eq!(h.d.gauges().relays, 1);
    join_multi(&mut h, 1, 1);
    join_multi(&mut h, 2, 1);
    let long = format!("ws://{}\u{1b}[31m", "x".repeat(500));
    let relays = vec![long; 40];
    h.said(1, WorkerMessage::Relays { relays });
    let w = h.d.registry.get(1).expect("worker");
    assert_eq!(w.relays.len(), 16);
    assert!(w
        .relays
        .iter()
        .all(|r| r.len() <= 200 && !r.contains('\u{1b}')));
    h.said(
        2,
        WorkerMessage::Relays {
            relays: vec!["a".into(), "b".into()],
        },
    );
    assert_eq!(h.d.gauges().relays, 16);
    h.ev(Event::WorkerLeft {
        id: 1,
        reason: "gone".into(),
    });
    assert_eq!(h.d.gauges().relays, 2);
}

/// Worker 1 (`max` slots) reports that it serves this relay and one other.
fn pool_of_two_relays(max: u32) -> Harness {
    let mut h = Harness::new();
    join_multi(&mut h, 1, max);
    let relays = vec!["a".into(), "b".into()];
    h.said(1, WorkerMessage::Relays { relays });
    h
}

fn graceful_shutdowns(actions: &[Action]) -> usize {
    actions
        .iter()
        .filter(|a| {
            matches!(
                a,
                Action::ToWorker(_, ServerMessage::GracefulShutdown { .. })
            )
        })
        .count()
}

#[test]
fn a_relay_alone_drains_at_once() {
    let mut h = Harness::new();
    join_multi(&mut h, 1, 1);
    let a = h.ev(Event::Shutdown { timeout: 30 * S });
    assert_eq!(graceful_shutdowns(&a), 1);
}

#[test]
fn a_relay_with_others_serves_through_the_grace_then_drains() {
    let mut h = pool_of_two_relays(2);
    let a = h.ev(Event::Shutdown { timeout: 30 * S });
    assert_eq!(graceful_shutdowns(&a), 0);
    // Still accepting and dispatching during the grace (5 s by default).
    h.at(4.0);
    assert_eq!(dispatched(&h.submit(1, "m")), vec![(1, 1)]);
    assert!(h.tick().is_empty());
    h.at(5.0);
    let a = h.tick();
    assert_eq!(graceful_shutdowns(&a), 1);
    // Now new work is refused; what is in flight finishes.
    let a = h.submit(2, "m");
    assert_eq!(failures(&a), vec![(2, Failure::ShuttingDown)]);
    let a = h.complete(1, 1);
    assert!(a.iter().any(|x| matches!(x, Action::Exit)), "{a:?}");
}

#[test]
fn asked_again_during_the_grace_it_drains_at_once() {
    let mut h = pool_of_two_relays(1);
    assert_eq!(
        graceful_shutdowns(&h.ev(Event::Shutdown { timeout: 30 * S })),
        0
    );
    assert_eq!(
        graceful_shutdowns(&h.ev(Event::Shutdown { timeout: 30 * S })),
        1
    );
    // The grace timer that is left does nothing.
    h.at(6.0);
    assert_eq!(graceful_shutdowns(&h.tick()), 0);
}
