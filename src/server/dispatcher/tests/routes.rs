//! Routes beyond chat: a request goes only to workers that serve its route (or did not
//! say) and, when binary, only to workers that carry binary bodies; when none of the
//! model's workers can, it fails at once instead of waiting in the queue.

use super::*;
use crate::protocol::binary::FEATURE_BINARY_BODIES;

const BINARY: &[&str] = &[FEATURE_BINARY_BODIES];

pub(super) fn join_with(h: &mut Harness, id: WorkerId, features: &[&str], routes: Option<&[&str]>) {
    let register = RegisterMessage {
        routes: routes.map(|r| r.iter().map(|p| p.to_string()).collect()),
        ..register(id, &["m"], 1, features)
    };
    h.ev(Event::WorkerJoined {
        id,
        register,
        remote: "127.0.0.1:1".into(),
    });
}

pub(super) fn submit_route(
    h: &mut Harness,
    id: RequestId,
    route: &'static str,
    binary: bool,
) -> Vec<Action> {
    let needs = Needs {
        route: Some(route),
        binary,
        ..Needs::default()
    };
    submit_with(h, id, route, binary.then_some("base64"), needs)
}

/// Submits a request for `route` with its body so encoded and these needs.
pub(super) fn submit_with(
    h: &mut Harness,
    id: RequestId,
    route: &str,
    encoding: Option<&str>,
    needs: Needs,
) -> Vec<Action> {
    let msg = Arc::new(RequestMessage {
        request_id: wire_request_id(id),
        model: "m".into(),
        endpoint_path: route.into(),
        is_streaming: false,
        body: Arc::from("{}"),
        headers: Default::default(),
        body_encoding: encoding.map(str::to_string),
        continuation: None,
        held: None,
    });
    h.ev(Event::Submit {
        id,
        msg,
        who: Who::default(),
        needs,
        prints: Default::default(),
        progress: false,
        continuable: false,
    })
}

#[test]
fn a_route_goes_only_where_it_is_served_or_may_be() {
    let mut h = Harness::new();
    join_with(&mut h, 1, BINARY, Some(&["/tokenize"]));
    join_with(&mut h, 2, BINARY, None);
    join_with(&mut h, 3, BINARY, Some(&["/v1/rerank", "/tokenize"]));
    // Round robin would start at 1: the rerank skips it.
    let a = submit_route(&mut h, 1, "/v1/rerank", false);
    let b = submit_route(&mut h, 2, "/v1/rerank", false);
    let mut got: Vec<WorkerId> = dispatched(&a)
        .into_iter()
        .chain(dispatched(&b))
        .map(|(_, w)| w)
        .collect();
    got.sort_unstable();
    assert_eq!(got, [2, 3]);
    // Every worker that may serve it is busy: it waits, and never goes to 1.
    let c = submit_route(&mut h, 3, "/v1/rerank", false);
    assert!(
        dispatched(&c).is_empty() && failures(&c).is_empty(),
        "{c:?}"
    );
    h.at(0.5);
    let done = h.complete(3, 2);
    assert_eq!(dispatched(&done), [(3, 3)]);
}

#[test]
fn a_route_no_worker_serves_fails_at_once() {
    let mut h = Harness::new();
    join_with(&mut h, 1, BINARY, Some(&["/tokenize"]));
    join_with(&mut h, 2, BINARY, Some(&[]));
    let actions = submit_route(&mut h, 1, "/v1/rerank", false);
    assert!(dispatched(&actions).is_empty());
    assert_eq!(
        failures(&actions),
        [(
            1,
            Failure::UnsupportedCapability {
                model: "m".into(),
                capability: "/v1/rerank"
            }
        )]
    );
    // A route it does serve runs.
    assert_eq!(
        dispatched(&submit_route(&mut h, 2, "/tokenize", false)),
        [(2, 1)]
    );
}

#[test]
fn binary_bodies_never_reach_an_original_worker() {
    let mut h = Harness::new();
    join_with(&mut h, 1, &[], None);
    let actions = submit_route(&mut h, 1, "/v1/audio/speech", true);
    assert_eq!(
        failures(&actions),
        [(
            1,
            Failure::UnsupportedCapability {
                model: "m".into(),
                capability: FEATURE_BINARY_BODIES
            }
        )]
    );
    // With a worker that carries them beside it, it goes there, never to the original.
    join_with(&mut h, 2, BINARY, None);
    for id in 2..4 {
        let actions = submit_route(&mut h, id, "/v1/audio/speech", true);
        assert!(
            dispatched(&actions).iter().all(|(_, w)| *w == 2),
            "{actions:?}"
        );
    }
    // The original still takes text routes.
    assert_eq!(
        dispatched(&submit_route(&mut h, 4, "/tokenize", false)),
        [(4, 1)]
    );
}
