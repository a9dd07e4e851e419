//! A body that follows its request in pieces: pieces and credit pass only between the
//! client and the worker running the request; once a piece went out the request is not
//! run elsewhere; a request no worker takes in pieces fails at once.

use super::routes::{join_with, submit_route, submit_with};
use super::*;
use crate::protocol::binary::FEATURE_BINARY_BODIES;
use crate::protocol::pieces::{FEATURE_ANSWER_CREDIT, FEATURE_BODY_PIECES, PIECES};

const PIECED: &[&str] = &[FEATURE_BINARY_BODIES, FEATURE_BODY_PIECES];

fn submit_pieces(h: &mut Harness, id: RequestId) -> Vec<Action> {
    let needs = Needs {
        binary: true,
        pieces: true,
        ..Needs::default()
    };
    submit_with(h, id, "/upload", Some(PIECES), needs)
}

fn piece(h: &mut Harness, id: RequestId, seq: u64) -> Vec<Action> {
    h.ev(Event::BodyPiece {
        id,
        seq,
        chunk: "AAAA".into(),
        last: false,
    })
}

fn credit(h: &mut Harness, worker: WorkerId, id: RequestId, until: u64) -> Vec<Action> {
    let request_id = wire_request_id(id);
    h.said(worker, WorkerMessage::BodyCredit { request_id, until })
}

fn credits(actions: &[Action]) -> Vec<(RequestId, u64)> {
    actions
        .iter()
        .filter_map(|a| match a {
            Action::ToClient(id, ClientEvent::Credit(until)) => Some((*id, *until)),
            _ => None,
        })
        .collect()
}

fn pieces_to(actions: &[Action]) -> Vec<(WorkerId, u64)> {
    actions
        .iter()
        .filter_map(|a| match a {
            Action::ToWorker(w, ServerMessage::BodyPiece { seq, .. }) => Some((*w, *seq)),
            _ => None,
        })
        .collect()
}

#[test]
fn pieces_and_credit_pass_only_between_the_client_and_its_worker() {
    let mut h = Harness::new();
    join_with(&mut h, 1, &[FEATURE_BINARY_BODIES], None);
    join_with(&mut h, 2, PIECED, None);
    let a = submit_pieces(&mut h, 7);
    assert_eq!(dispatched(&a), [(7, 2)], "only the worker taking pieces");
    // Credit from a worker that does not run it is ignored.
    assert!(credits(&credit(&mut h, 1, 7, 8)).is_empty());
    let c = credit(&mut h, 2, 7, 8);
    assert_eq!(credits(&c), [(7, 8)]);
    assert_eq!(pieces_to(&piece(&mut h, 7, 0)), [(2, 0)]);
    // A piece of a request that is over goes nowhere.
    h.ev(Event::ClientGone(7));
    assert!(pieces_to(&piece(&mut h, 7, 1)).is_empty());
}

#[test]
fn a_worker_lost_after_a_piece_fails_the_request_instead_of_requeueing_it() {
    let mut h = Harness::new();
    join_with(&mut h, 1, PIECED, None);
    join_with(&mut h, 2, PIECED, None);
    let first = dispatched(&submit_pieces(&mut h, 1))[0].1;
    // Lost before any piece: the body is still with the client, so it runs elsewhere.
    let a = h.ev(Event::WorkerLeft {
        id: first,
        reason: "gone".into(),
    });
    let second = dispatched(&a)[0].1;
    assert_ne!(first, second);
    credit(&mut h, second, 1, 8);
    piece(&mut h, 1, 0);
    join_with(&mut h, first, PIECED, None);
    let b = h.ev(Event::WorkerLeft {
        id: second,
        reason: "gone".into(),
    });
    assert!(dispatched(&b).is_empty(), "{b:?}");
    assert_eq!(failures(&b), [(1, Failure::WorkerLost)]);
}

#[test]
fn a_body_in_pieces_no_worker_takes_fails_at_once() {
    let mut h = Harness::new();
    join_with(&mut h, 1, &[FEATURE_BINARY_BODIES], None);
    let a = submit_pieces(&mut h, 1);
    assert!(dispatched(&a).is_empty());
    assert_eq!(
        failures(&a),
        [(
            1,
            Failure::UnsupportedCapability {
                model: "m".into(),
                capability: FEATURE_BODY_PIECES
            }
        )]
    );
}

#[test]
fn answer_credit_goes_to_the_worker_streaming_the_answer_when_it_reads_it() {
    let mut h = Harness::new();
    join_with(
        &mut h,
        1,
        &[FEATURE_BINARY_BODIES, FEATURE_ANSWER_CREDIT],
        None,
    );
    join_with(&mut h, 2, &[FEATURE_BINARY_BODIES], None);
    let a = submit_route(&mut h, 1, "/v1/audio/speech", true);
    let b = submit_route(&mut h, 2, "/v1/audio/speech", true);
    let on_one = if dispatched(&a) == [(1, 1)] { 1 } else { 2 };
    assert!(dispatched(&a).len() + dispatched(&b).len() == 2);
    let credit_to = |a: &[Action]| -> Vec<(WorkerId, u64)> {
        a.iter()
            .filter_map(|a| match a {
                Action::ToWorker(w, ServerMessage::AnswerCredit { until, .. }) => {
                    Some((*w, *until))
                }
                _ => None,
            })
            .collect()
    };
    let a = h.ev(Event::AnswerCredit {
        id: on_one,
        until: 64,
    });
    assert_eq!(credit_to(&a), [(1, 64)]);
    // A worker that never listed the feature is not sent it.
    let other = 3 - on_one;
    let b = h.ev(Event::AnswerCredit {
        id: other,
        until: 64,
    });
    assert!(credit_to(&b).is_empty(), "{b:?}");
}
