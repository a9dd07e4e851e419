//! A streamed answer whose worker died, finished on another worker (fake clock).

use super::*;
use crate::protocol::continuation::{Continuation, FEATURE_CONTINUATION};

/// Joins a worker; `continues`: it lists the feature over a llama-server.
fn join_as(h: &mut Harness, id: WorkerId, continues: bool) -> Vec<Action> {
    join_over(h, id, continues, "llama-server")
}

fn join_over(h: &mut Harness, id: WorkerId, continues: bool, kind: &str) -> Vec<Action> {
    let register = RegisterMessage {
        worker_name: format!("box-{id}"),
        models: vec!["m".into()],
        max_concurrent: 1,
        protocol_version: Some("1".into()),
        current_load: Some(0),
        features: if continues {
            vec![FEATURE_CONTINUATION.into()]
        } else {
            vec![]
        },
        loaded_models: None,
        backend_kind: Some(kind.into()),
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

fn original(id: RequestId) -> Arc<RequestMessage> {
    on_route(id, "/v1/chat/completions")
}

fn on_route(id: RequestId, route: &str) -> Arc<RequestMessage> {
    Arc::new(RequestMessage {
        request_id: wire_request_id(id),
        model: "m".into(),
        endpoint_path: route.into(),
        is_streaming: true,
        body: Arc::from("{\"model\":\"m\",\"messages\":[]}"),
        headers: Default::default(),
        body_encoding: None,
        continuation: None,
        held: None,
    })
}

fn submit(h: &mut Harness, id: RequestId, continuable: bool) -> Vec<Action> {
    h.ev(Event::Submit {
        id,
        msg: original(id),
        who: Who::default(),
        needs: Needs::default(),
        prints: Default::default(),
        progress: false,
        continuable,
    })
}

fn continuing(id: RequestId, prefix: &str) -> Option<Arc<RequestMessage>> {
    let mut msg = (*original(id)).clone();
    msg.continuation = Some(Continuation {
        prefix: prefix.into(),
        tokens: 1,
    });
    Some(Arc::new(msg))
}

fn interrupted(actions: &[Action]) -> Vec<RequestId> {
    actions
        .iter()
        .filter_map(|a| match a {
            Action::ToClient(id, ClientEvent::Interrupted) => Some(*id),
            _ => None,
        })
        .collect()
}

fn left(h: &mut Harness, worker: WorkerId) -> Vec<Action> {
    h.ev(Event::WorkerLeft {
        id: worker,
        reason: "eof".into(),
    })
}

/// The continuation (its prefix) each worker was sent.
fn continued(actions: &[Action]) -> Vec<(WorkerId, String)> {
    actions
        .iter()
        .filter_map(|a| match a {
            Action::ToWorker(w, ServerMessage::Request(m)) => {
                Some((*w, m.continuation.as_ref()?.prefix.clone()))
            }
            _ => None,
        })
        .collect()
}

#[test]
fn a_stream_whose_worker_died_goes_on_only_on_a_worker_that_can_continue() {
    let mut h = Harness::new();
    join_as(&mut h, 1, true);
    join_as(&mut h, 2, false);
    join_as(&mut h, 3, true);
    submit(&mut h, 1, true);
    h.chunk(1, 1, "data: {}\n\n");
    h.at(100.0); // long past its arrival's queue deadline
    let a = left(&mut h, 1);
    assert_eq!(interrupted(&a), vec![1]);
    assert!(failures(&a).is_empty() && dispatched(&a).is_empty());
    // The client's answer: the same request, going on from what it delivered.
    let a = h.ev(Event::Continue {
        id: 1,
        msg: continuing(1, "Hel"),
    });
    assert_eq!(continued(&a), vec![(3, "Hel".to_string())]);
    // It streams and completes there like any request.
    h.chunk(3, 1, "data: {}\n\n");
    let a = h.complete(3, 1);
    assert!(a
        .iter()
        .any(|a| matches!(a, Action::ToClient(1, ClientEvent::Complete(_)))));
}

#[test]
fn what_cannot_continue_fails_as_before() {
    // Not continuable: the old error.
    let mut h = Harness::new();
    join_as(&mut h, 1, true);
    join_as(&mut h, 2, true);
    submit(&mut h, 1, false);
    h.chunk(1, 1, "data: {}\n\n");
    assert_eq!(failures(&left(&mut h, 1)), vec![(1, Failure::WorkerLost)]);
    // Nothing streamed yet: an ordinary requeue, no interruption.
    submit(&mut h, 2, true);
    let a = h.ev(Event::WorkerLeft {
        id: 2,
        reason: "eof".into(),
    });
    assert!(interrupted(&a).is_empty());
    // No other worker can continue it: the old error at once.
    let mut h = Harness::new();
    join_as(&mut h, 1, true);
    join_as(&mut h, 2, false);
    submit(&mut h, 1, true);
    h.chunk(1, 1, "data: {}\n\n");
    assert_eq!(failures(&left(&mut h, 1)), vec![(1, Failure::WorkerLost)]);
    // The client cannot continue it (a tool call under way): the old error then.
    let mut h = Harness::new();
    join_as(&mut h, 1, true);
    join_as(&mut h, 2, true);
    submit(&mut h, 1, true);
    h.chunk(1, 1, "data: {}\n\n");
    assert_eq!(interrupted(&left(&mut h, 1)), vec![1]);
    let a = h.ev(Event::Continue { id: 1, msg: None });
    assert_eq!(failures(&a), vec![(1, Failure::WorkerLost)]);
    assert_eq!(h.d.gauges().in_flight + h.d.gauges().queue_depth, 0);
    // A request that is not interrupted is not continued, whatever the client sends.
    submit(&mut h, 2, true);
    assert!(h
        .ev(Event::Continue {
            id: 2,
            msg: continuing(2, "x"),
        })
        .is_empty());
}

#[test]
fn a_broken_backend_stream_continues_too_and_the_budget_holds() {
    let mut h = Harness::with(Config {
        max_requeues: 2,
        ..cfg()
    });
    for w in 1..=3 {
        join_as(&mut h, w, true);
    }
    submit(&mut h, 1, true);
    h.chunk(1, 1, "data: {}\n\n");
    // The worker stays; its backend broke midway.
    let error = WorkerMessage::Error {
        request_id: Some(wire_request_id(1)),
        code: "backend_stream_failed".into(),
        message: "reset".into(),
        status_code: Some(502),
        retryable: None,
        headers: Default::default(),
        body: None,
    };
    assert_eq!(interrupted(&h.said(1, error.clone())), vec![1]);
    let a = h.ev(Event::Continue {
        id: 1,
        msg: continuing(1, "a"),
    });
    assert_eq!(continued(&a), vec![(2, "a".to_string())]);
    h.chunk(2, 1, "data: {}\n\n");
    assert_eq!(interrupted(&left(&mut h, 2)), vec![1]);
    let a = h.ev(Event::Continue {
        id: 1,
        msg: continuing(1, "ab"),
    });
    // Back to the only worker left that can continue it, although it failed there.
    assert_eq!(continued(&a), vec![(3, "ab".to_string())]);
    h.chunk(3, 1, "data: {}\n\n");
    // Two interruptions spent the budget of two: the third break fails as before.
    assert_eq!(failures(&left(&mut h, 3)), vec![(1, Failure::WorkerLost)]);
}

#[test]
fn an_interrupted_request_waits_at_most_the_queue_timeout_and_not_during_shutdown() {
    let mut h = Harness::new();
    join_as(&mut h, 1, true);
    join_as(&mut h, 2, true);
    submit(&mut h, 1, true); // on 1
    submit(&mut h, 2, false); // on 2
    h.chunk(1, 1, "data: {}\n\n");
    h.at(40.0);
    let pong = WorkerMessage::Pong {
        current_load: 1,
        timestamp_unix_ms: None,
    };
    h.said(2, pong.clone());
    h.at(50.0);
    assert_eq!(interrupted(&left(&mut h, 1)), vec![1]);
    let a = h.ev(Event::Continue {
        id: 1,
        msg: continuing(1, "x"),
    });
    assert!(continued(&a).is_empty(), "worker 2 is busy: it waits");
    h.at(79.0);
    h.said(2, pong);
    assert!(failures(&h.tick()).is_empty());
    h.at(80.5);
    assert_eq!(failures(&h.tick()), vec![(1, Failure::QueueTimeout)]);
    // While the server shuts down, a broken stream ends as before.
    let mut h = Harness::new();
    join_as(&mut h, 1, true);
    join_as(&mut h, 2, true);
    submit(&mut h, 1, true);
    h.chunk(1, 1, "data: {}\n\n");
    h.ev(Event::Shutdown { timeout: 60 * S });
    assert_eq!(failures(&left(&mut h, 1)), vec![(1, Failure::WorkerLost)]);
}

#[test]
fn a_messages_answer_goes_on_only_where_its_backend_continues_that_route() {
    let mut h = Harness::new();
    join_over(&mut h, 1, true, "ollama");
    join_over(&mut h, 2, true, "vllm");
    join_over(&mut h, 3, true, "ollama");
    let msg = on_route(1, "/v1/messages");
    h.ev(Event::Submit {
        id: 1,
        msg: msg.clone(),
        who: Who::default(),
        needs: Needs::default(),
        prints: Default::default(),
        progress: false,
        continuable: true,
    });
    h.chunk(1, 1, "event: message_start\ndata: {}\n\n");
    assert_eq!(interrupted(&left(&mut h, 1)), vec![1]);
    let mut cont = (*msg).clone();
    cont.continuation = Some(Continuation {
        prefix: "Hel".into(),
        tokens: 1,
    });
    let a = h.ev(Event::Continue {
        id: 1,
        msg: Some(Arc::new(cont)),
    });
    // vLLM continues chat answers, not Anthropic ones: worker 3, not the idle 2.
    assert_eq!(continued(&a), vec![(3, "Hel".to_string())]);
    // With only vLLM left, the next break is not continued: the old error.
    h.chunk(3, 1, "event: content_block_delta\ndata: {}\n\n");
    assert_eq!(failures(&left(&mut h, 3)), vec![(1, Failure::WorkerLost)]);
}
