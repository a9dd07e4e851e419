//! Unit tests of the dispatcher state machine: events in, actions out, fake clock.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::*;
use crate::protocol::{
    CancelReason, RegisterMessage, RequestMessage, ResponseComplete, ServerMessage, WorkerMessage,
};

mod actions;
mod continuation;
mod pieces;
mod relays;
mod routes;

const S: Duration = Duration::from_secs(1);

struct Harness {
    d: Dispatcher,
    t0: Instant,
    now: Instant,
}

fn cfg() -> Config {
    Config {
        max_queue_len: 3,
        ..Config::default()
    }
}

impl Harness {
    fn new() -> Harness {
        Harness::with(cfg())
    }

    fn with(cfg: Config) -> Harness {
        let t0 = Instant::now();
        Harness {
            d: Dispatcher::new(cfg, t0),
            t0,
            now: t0,
        }
    }

    fn at(&mut self, secs: f64) {
        self.now = self.t0 + Duration::from_secs_f64(secs);
    }

    /// Through `handle_into` and `tick_into`, as the runtime calls them (`handle` and
    /// `tick` are the same state change with a vector of their own).
    fn ev(&mut self, event: Event) -> Vec<Action> {
        let mut out = Vec::new();
        self.d.handle_into(event, self.now, &mut out);
        out
    }

    fn tick(&mut self) -> Vec<Action> {
        let mut out = Vec::new();
        self.d.tick_into(self.now, &mut out);
        out
    }

    fn join(&mut self, id: WorkerId, models: &[&str], max: u32) -> Vec<Action> {
        let register = register(id, models, max, &[]);
        self.ev(Event::WorkerJoined {
            id,
            register,
            remote: "127.0.0.1:1".into(),
        })
    }

    fn submit(&mut self, id: RequestId, model: &str) -> Vec<Action> {
        let msg = Arc::new(RequestMessage {
            request_id: wire_request_id(id),
            model: model.into(),
            endpoint_path: "/v1/chat/completions".into(),
            is_streaming: false,
            body: Arc::from(format!("{{\"model\":\"{model}\"}}")),
            headers: Default::default(),
            body_encoding: None,
            continuation: None,
            held: None,
        });
        self.ev(Event::Submit {
            id,
            msg,
            who: Who::default(),
            needs: Needs::default(),
            prints: Default::default(),
            progress: false,
            continuable: false,
        })
    }

    /// Submits a streaming request that asked for queue progress notes.
    fn submit_with_progress(&mut self, id: RequestId) -> Vec<Action> {
        let msg = Arc::new(RequestMessage {
            request_id: wire_request_id(id),
            model: "m".into(),
            endpoint_path: "/v1/chat/completions".into(),
            is_streaming: true,
            body: Arc::from("{}"),
            headers: Default::default(),
            body_encoding: None,
            continuation: None,
            held: None,
        });
        self.ev(Event::Submit {
            id,
            msg,
            who: Who::default(),
            needs: Needs::default(),
            prints: Default::default(),
            progress: true,
            continuable: false,
        })
    }

    /// Submits for a tenant at a priority.
    fn submit_as(
        &mut self,
        id: RequestId,
        tenant: &str,
        priority: Priority,
        weight: u32,
    ) -> Vec<Action> {
        let msg = Arc::new(RequestMessage {
            request_id: wire_request_id(id),
            model: "m".into(),
            endpoint_path: "/v1/chat/completions".into(),
            is_streaming: true,
            body: Arc::from("{\"model\":\"m\"}"),
            headers: Default::default(),
            body_encoding: None,
            continuation: None,
            held: None,
        });
        let who = Who {
            tenant: Arc::from(tenant),
            priority,
            weight,
        };
        self.ev(Event::Submit {
            id,
            msg,
            who,
            needs: Needs::default(),
            prints: Default::default(),
            progress: false,
            continuable: false,
        })
    }

    fn said(&mut self, worker: WorkerId, msg: WorkerMessage) -> Vec<Action> {
        self.ev(Event::WorkerSaid(worker, msg))
    }

    fn complete(&mut self, worker: WorkerId, id: RequestId) -> Vec<Action> {
        self.said(worker, WorkerMessage::ResponseComplete(ok(id)))
    }

    fn chunk(&mut self, worker: WorkerId, id: RequestId, text: &str) -> Vec<Action> {
        self.said(
            worker,
            WorkerMessage::ResponseChunk {
                request_id: wire_request_id(id),
                chunk: text.into(),
            },
        )
    }
}

/// The `register` of worker `id` (named `box-{id}`) serving `models` with `max` slots.
pub(super) fn register(
    id: WorkerId,
    models: &[&str],
    max: u32,
    features: &[&str],
) -> RegisterMessage {
    RegisterMessage {
        worker_name: format!("box-{id}"),
        models: models.iter().map(|m| m.to_string()).collect(),
        max_concurrent: max,
        protocol_version: Some("1".into()),
        current_load: Some(0),
        features: features.iter().map(|f| f.to_string()).collect(),
        loaded_models: None,
        backend_kind: None,
        model_info: None,
        wake: None,
        routes: None,
    }
}

fn ok(id: RequestId) -> ResponseComplete {
    ResponseComplete {
        request_id: wire_request_id(id),
        status_code: 200,
        body: Some("{}".into()),
        ..Default::default()
    }
}

/// A plain chat request `id` for `model` with these fingerprints, as a client submits it.
pub(super) fn chat_submit(id: RequestId, model: &str, prints: Fingerprints) -> Event {
    let msg = Arc::new(RequestMessage {
        request_id: wire_request_id(id),
        model: model.into(),
        endpoint_path: "/v1/chat/completions".into(),
        is_streaming: false,
        body: Arc::from("{}"),
        headers: Default::default(),
        body_encoding: None,
        continuation: None,
        held: None,
    });
    Event::Submit {
        id,
        msg,
        who: Who::default(),
        needs: Needs::default(),
        prints,
        progress: false,
        continuable: false,
    }
}

/// Which worker each request in `actions` was dispatched to.
pub(super) fn dispatched(actions: &[Action]) -> Vec<(RequestId, WorkerId)> {
    actions
        .iter()
        .filter_map(|a| match a {
            Action::ToWorker(w, ServerMessage::Request(m)) => {
                Some((parse_request_id(&m.request_id)?, *w))
            }
            _ => None,
        })
        .collect()
}

pub(super) fn failures(actions: &[Action]) -> Vec<(RequestId, Failure)> {
    actions
        .iter()
        .filter_map(|a| match a {
            Action::ToClient(id, ClientEvent::Failed(f)) => Some((*id, f.clone())),
            _ => None,
        })
        .collect()
}

pub(super) fn cancels(actions: &[Action]) -> Vec<(WorkerId, RequestId, CancelReason)> {
    actions
        .iter()
        .filter_map(|a| match a {
            Action::ToWorker(w, ServerMessage::Cancel { request_id, reason }) => {
                Some((*w, parse_request_id(request_id)?, *reason))
            }
            _ => None,
        })
        .collect()
}

fn closed(actions: &[Action]) -> Vec<(WorkerId, String)> {
    actions
        .iter()
        .filter_map(|a| match a {
            Action::CloseWorker(w, r) => Some((*w, r.clone())),
            _ => None,
        })
        .collect()
}

#[test]
fn register_is_acked_with_sanitized_models_and_warnings() {
    let mut h = Harness::with(Config {
        max_models_per_worker: 2,
        ..cfg()
    });
    let register = RegisterMessage {
        worker_name: "gpu".into(),
        models: vec![" a ".into(), "".into(), "a".into(), "b".into(), "c".into()],
        max_concurrent: 1,
        protocol_version: Some("2026-04-bridge-v1".into()),
        current_load: None,
        features: vec![],
        loaded_models: None,
        backend_kind: None,
        model_info: None,
        wake: None,
        routes: None,
    };
    let actions = h.ev(Event::WorkerJoined {
        id: 7,
        register,
        remote: "x".into(),
    });
    let Some(Action::ToWorker(7, ServerMessage::RegisterAck(ack))) = actions.first() else {
        panic!("no ack: {actions:?}")
    };
    assert_eq!(ack.worker_id, "w-7");
    assert_eq!(ack.models, vec!["a", "b"]);
    assert_eq!(ack.warnings.len(), 3, "{:?}", ack.warnings);
    assert_eq!(ack.protocol_version.as_deref(), Some("2026-04-bridge-v1"));
    assert_eq!(h.d.registry().routable_models(), vec!["a", "b"]);
}

#[test]
fn unsupported_protocol_version_is_closed_without_registering() {
    let mut h = Harness::new();
    let register = RegisterMessage {
        worker_name: "gpu".into(),
        models: vec!["a".into()],
        max_concurrent: 1,
        protocol_version: Some("99".into()),
        current_load: None,
        features: vec![],
        loaded_models: None,
        backend_kind: None,
        model_info: None,
        wake: None,
        routes: None,
    };
    let actions = h.ev(Event::WorkerJoined {
        id: 1,
        register,
        remote: "x".into(),
    });
    assert_eq!(closed(&actions).len(), 1);
    assert!(closed(&actions)[0].1.contains("protocol"));
    assert_eq!(h.d.gauges().workers, 0);
}

#[test]
fn routes_only_to_workers_serving_the_exact_model() {
    let mut h = Harness::new();
    h.join(1, &["llama"], 4);
    h.join(2, &["qwen"], 4);
    assert_eq!(dispatched(&h.submit(10, "qwen")), vec![(10, 2)]);
    assert_eq!(dispatched(&h.submit(11, "llama")), vec![(11, 1)]);
    assert!(
        dispatched(&h.submit(12, "Llama")).is_empty(),
        "model match is exact"
    );
    assert_eq!(h.d.gauges().queue_depth, 1);
}

#[test]
fn lowest_load_wins_and_ties_go_round_robin() {
    let mut h = Harness::new();
    h.join(1, &["m"], 4);
    h.join(2, &["m"], 4);
    h.join(3, &["m"], 4);
    let picks: Vec<WorkerId> = (0..3)
        .flat_map(|i| dispatched(&h.submit(i, "m")))
        .map(|(_, w)| w)
        .collect();
    assert_eq!(picks, vec![1, 2, 3], "ties rotate");
    h.complete(2, 1);
    assert_eq!(
        dispatched(&h.submit(3, "m")),
        vec![(3, 2)],
        "the least loaded worker wins"
    );
    // Reported load from elsewhere counts too.
    h.said(
        1,
        WorkerMessage::Pong {
            current_load: 4,
            timestamp_unix_ms: None,
        },
    );
    let next: Vec<WorkerId> = (4..6)
        .flat_map(|i| dispatched(&h.submit(i, "m")))
        .map(|(_, w)| w)
        .collect();
    assert!(!next.contains(&1), "worker 1 reports itself full: {next:?}");
}

#[test]
fn draining_workers_and_full_workers_get_nothing() {
    let mut h = Harness::new();
    h.join(1, &["m"], 1);
    h.join(2, &["m"], 1);
    h.said(2, WorkerMessage::WorkerDraining {});
    assert_eq!(dispatched(&h.submit(1, "m")), vec![(1, 1)]);
    assert!(
        dispatched(&h.submit(2, "m")).is_empty(),
        "1 is full, 2 is draining"
    );
    assert_eq!(h.d.gauges().queue_depth, 1);
    assert!(
        !h.d.registry().routable_models().is_empty(),
        "worker 1 still routable"
    );
}

#[test]
fn queue_is_bounded_and_fifo_among_compatible_requests() {
    let mut h = Harness::new();
    h.join(1, &["a", "b"], 1);
    h.submit(1, "a");
    h.submit(2, "b");
    h.submit(3, "a");
    h.submit(4, "b");
    assert!(matches!(
        failures(&h.submit(5, "a"))[..],
        [(5, Failure::QueueFull(_))]
    ));
    assert_eq!(dispatched(&h.complete(1, 1)), vec![(2, 1)], "oldest first");
    h.join(2, &["b"], 1);
    // Worker 2 only serves b: it skips request 3 (a) and takes 4.
    assert_eq!(h.d.gauges().queue_depth, 1);
    assert_eq!(dispatched(&h.complete(1, 2)), vec![(3, 1)]);
}

#[test]
fn queue_drains_whenever_capacity_appears() {
    let mut h = Harness::new();
    // A new worker registering.
    h.submit(1, "m");
    assert_eq!(dispatched(&h.join(1, &["m"], 1)), vec![(1, 1)]);
    // A request finishing.
    h.submit(2, "m");
    assert_eq!(dispatched(&h.complete(1, 1)), vec![(2, 1)]);
    // A request cancelled by its client.
    h.submit(3, "m");
    assert_eq!(dispatched(&h.ev(Event::ClientGone(2))), vec![(3, 1)]);
    // A pong lowering reported external load.
    h.complete(1, 3);
    h.said(
        1,
        WorkerMessage::Pong {
            current_load: 1,
            timestamp_unix_ms: None,
        },
    );
    h.submit(4, "m");
    assert_eq!(
        h.d.gauges().queue_depth,
        1,
        "worker reports a slot used elsewhere"
    );
    let a = h.said(
        1,
        WorkerMessage::Pong {
            current_load: 0,
            timestamp_unix_ms: None,
        },
    );
    assert_eq!(dispatched(&a), vec![(4, 1)]);
    // models_update adding the model.
    h.submit(5, "new");
    let a = h.said(
        1,
        WorkerMessage::ModelsUpdate {
            models: vec!["m".into(), "new".into()],
            current_load: 0,
            loaded_models: None,
            model_info: None,
        },
    );
    assert!(dispatched(&a).is_empty(), "still full with request 4");
    assert_eq!(dispatched(&h.complete(1, 4)), vec![(5, 1)]);
}

#[test]
fn queued_request_times_out_with_no_cancel() {
    let mut h = Harness::new();
    h.submit(1, "m");
    h.at(29.0);
    assert!(h.tick().is_empty());
    assert_eq!(h.d.next_deadline(), Some(h.t0 + 30 * S));
    h.at(30.0);
    let a = h.tick();
    assert_eq!(failures(&a), vec![(1, Failure::QueueTimeout)]);
    assert!(cancels(&a).is_empty());
    assert_eq!(h.d.gauges().queue_depth, 0);
}

#[test]
fn client_gone_while_queued_is_never_dispatched() {
    let mut h = Harness::new();
    h.submit(1, "m");
    h.ev(Event::ClientGone(1));
    let a = h.join(1, &["m"], 1);
    assert!(dispatched(&a).is_empty());
    assert_eq!(h.d.counters().cancelled, 1);
}

#[test]
fn client_gone_in_flight_cancels_and_frees_the_slot_without_an_ack() {
    let mut h = Harness::new();
    h.join(1, &["m"], 1);
    for id in 0..1000 {
        assert_eq!(
            dispatched(&h.submit(id, "m")),
            vec![(id, 1)],
            "capacity intact at {id}"
        );
        let a = h.ev(Event::ClientGone(id));
        assert_eq!(cancels(&a), vec![(1, id, CancelReason::ClientDisconnect)]);
    }
    // Late messages for cancelled requests are dropped.
    assert!(h.chunk(1, 5, "late").is_empty());
    assert!(h.complete(1, 5).is_empty());
    assert_eq!(h.d.gauges().in_flight, 0);
}

#[test]
fn request_timeout_bounds_first_byte_and_every_silence() {
    let long_heartbeat = Duration::from_secs(10_000);
    let mut h = Harness::with(Config {
        heartbeat_timeout: long_heartbeat,
        heartbeat_interval: long_heartbeat,
        ..cfg()
    });
    h.join(1, &["m"], 1);
    h.submit(1, "m");
    h.at(200.0);
    let a = h.chunk(1, 1, "a");
    assert_eq!(a.len(), 2, "dispatch notice and chunk: {a:?}");
    h.at(450.0);
    h.tick();
    assert_eq!(
        h.d.gauges().in_flight,
        1,
        "silence since the chunk is 250 s < 300 s"
    );
    h.at(500.0);
    let a = h.tick();
    assert_eq!(failures(&a), vec![(1, Failure::RequestTimeout)]);
    assert_eq!(cancels(&a), vec![(1, 1, CancelReason::Timeout)]);
    assert_eq!(h.d.gauges().in_flight, 0);
}

#[test]
fn dispatch_is_told_with_the_next_event_not_alone() {
    let mut h = Harness::new();
    h.join(1, &["m"], 1);
    h.join(2, &["m"], 1);
    h.at(0.5);
    let a = h.submit(1, "m");
    assert_eq!(dispatched(&a), vec![(1, 1)]);
    assert!(
        !a.iter().any(|a| matches!(a, Action::ToClient(..))),
        "a dispatch alone must not wake the client: {a:?}"
    );
    // The worker dies before answering: the request moves to worker 2, and the client
    // hears only of the dispatch that counts, together with the first chunk.
    let a = h.ev(Event::WorkerLeft {
        id: 1,
        reason: "gone".into(),
    });
    assert_eq!(dispatched(&a), vec![(1, 2)]);
    assert!(!a.iter().any(|a| matches!(a, Action::ToClient(..))));
    let a = h.chunk(2, 1, "hi");
    assert_eq!(
        a,
        vec![
            Action::ToClient(
                1,
                ClientEvent::Dispatched {
                    queue_wait: Duration::ZERO,
                    worker: "box-2".into()
                }
            ),
            Action::ToClient(1, ClientEvent::Chunk("hi".into())),
        ]
    );
    // Told once: later events come alone.
    assert_eq!(h.chunk(2, 1, "more").len(), 1);
}

#[test]
fn worker_error_fails_only_that_request() {
    let mut h = Harness::new();
    h.join(1, &["m"], 2);
    h.submit(1, "m");
    h.submit(2, "m");
    let a = h.said(
        1,
        WorkerMessage::Error {
            request_id: Some(wire_request_id(1)),
            code: "backend".into(),
            message: "down".into(),
            status_code: None,
            retryable: None,
            headers: Default::default(),
            body: None,
        },
    );
    assert_eq!(
        failures(&a),
        vec![(
            1,
            Failure::WorkerError {
                status: None,
                code: "backend".into(),
                message: "down".into()
            }
        )]
    );
    assert!(closed(&a).is_empty());
    assert!(matches!(
        h.complete(1, 2)[..],
        [
            Action::ToClient(2, ClientEvent::Dispatched { .. }),
            Action::ToClient(2, ClientEvent::Complete(_))
        ]
    ));
}

#[test]
fn messages_about_another_workers_request_are_ignored() {
    let mut h = Harness::new();
    h.join(1, &["m"], 1);
    h.join(2, &["m"], 1);
    h.submit(1, "m");
    assert!(h.chunk(2, 1, "spoof").is_empty());
    assert!(h.complete(2, 1).is_empty());
    assert_eq!(h.d.gauges().in_flight, 1);
}

#[test]
fn worker_lost_before_any_byte_requeues_keeping_arrival_order() {
    let mut h = Harness::new();
    h.join(1, &["m"], 1);
    h.submit(1, "m");
    h.submit(2, "m");
    h.at(5.0);
    let a = h.ev(Event::WorkerLeft {
        id: 1,
        reason: "eof".into(),
    });
    assert!(failures(&a).is_empty());
    assert_eq!(h.d.counters().requeued, 1);
    // The requeued request (arrived first) goes before request 2.
    assert_eq!(dispatched(&h.join(2, &["m"], 1)), vec![(1, 2)]);
}

#[test]
fn requeue_stops_after_three_attempts() {
    let mut h = Harness::new();
    h.submit(1, "m");
    let mut last = Vec::new();
    for w in 1..=4 {
        h.join(w, &["m"], 1);
        last = h.ev(Event::WorkerLeft {
            id: w,
            reason: "crash".into(),
        });
    }
    assert_eq!(failures(&last), vec![(1, Failure::RequeueExhausted)]);
    assert_eq!(h.d.counters().requeued, 3);
}

#[test]
fn worker_lost_mid_stream_ends_the_stream_and_never_requeues() {
    let mut h = Harness::new();
    h.join(1, &["m"], 1);
    h.join(2, &["m"], 1);
    h.submit(1, "m");
    h.chunk(1, 1, "data: x\n\n");
    let a = h.ev(Event::WorkerLeft {
        id: 1,
        reason: "eof".into(),
    });
    assert_eq!(failures(&a), vec![(1, Failure::WorkerLost)]);
    assert!(dispatched(&a).is_empty());
}

#[test]
fn heartbeat_pings_and_silence_closes_the_worker() {
    let mut h = Harness::new();
    h.join(1, &["m"], 1);
    h.submit(1, "m");
    h.at(15.0);
    let a = h.tick();
    assert!(a
        .iter()
        .any(|a| matches!(a, Action::ToWorker(1, ServerMessage::Ping { .. }))));
    h.at(40.0);
    h.said(
        1,
        WorkerMessage::Pong {
            current_load: 1,
            timestamp_unix_ms: None,
        },
    );
    h.at(84.0);
    assert!(closed(&h.tick()).is_empty(), "44 s since the pong");
    h.at(85.0);
    let a = h.tick();
    assert_eq!(
        closed(&a),
        vec![(1, "worker heartbeat timed out".to_string())]
    );
    assert_eq!(h.d.counters().heartbeat_timeouts, 1);
    assert_eq!(h.d.counters().requeued, 1, "its request was requeued");
    // ... but a requeue never extends the queue deadline (30 s from arrival), long
    // gone by now: with no other worker free it fails at once.
    assert_eq!(failures(&a), vec![(1, Failure::QueueTimeout)]);
}

#[test]
fn unknown_model_is_queued_at_first_then_fails_fast() {
    let mut h = Harness::new();
    h.join(1, &["llama"], 1);
    assert!(
        failures(&h.submit(1, "lama")).is_empty(),
        "young server: queue it"
    );
    h.at(31.0);
    h.tick();
    let a = h.submit(2, "lama");
    match &failures(&a)[..] {
        [(2, Failure::ModelNotFound { model, available })] => {
            assert_eq!(model, "lama");
            assert_eq!(available, &vec!["llama".to_string()]);
        }
        other => panic!("expected model_not_found, got {other:?}"),
    }
    // A model whose worker left recently is still queued (it may be restarting).
    h.ev(Event::WorkerLeft {
        id: 1,
        reason: "restart".into(),
    });
    h.at(50.0);
    assert!(failures(&h.submit(3, "llama")).is_empty());
    h.at(200.0);
    assert!(matches!(
        failures(&h.submit(4, "llama"))[..],
        [(4, Failure::ModelNotFound { .. })]
    ));
}

#[test]
fn drain_worker_stops_routing_and_closes_when_idle() {
    let mut h = Harness::new();
    h.join(1, &["m"], 2);
    h.submit(1, "m");
    let a = h.ev(Event::DrainWorker {
        id: 1,
        timeout: Some(60 * S),
    });
    assert!(a.iter().any(|a| matches!(
        a,
        Action::ToWorker(1, ServerMessage::GracefulShutdown { .. })
    )));
    assert!(closed(&a).is_empty(), "still busy");
    assert!(h.d.registry().routable_models().is_empty());
    assert!(dispatched(&h.submit(2, "m")).is_empty());
    let a = h.complete(1, 1);
    assert_eq!(closed(&a), vec![(1, "drained".to_string())]);
}

#[test]
fn drain_timeout_closes_a_busy_worker_and_requeues() {
    let mut h = Harness::new();
    h.join(1, &["m"], 1);
    h.submit(1, "m");
    h.ev(Event::DrainWorker {
        id: 1,
        timeout: Some(10 * S),
    });
    h.at(10.0);
    let a = h.tick();
    assert_eq!(closed(&a), vec![(1, "drain timeout reached".to_string())]);
    assert_eq!(h.d.gauges().queue_depth, 1);
}

#[test]
fn shutdown_refuses_new_work_lets_in_flight_finish_then_exits() {
    let mut h = Harness::new();
    h.join(1, &["m"], 1);
    h.submit(1, "m");
    h.submit(2, "m");
    let a = h.ev(Event::Shutdown { timeout: 30 * S });
    assert_eq!(
        failures(&a),
        vec![(2, Failure::ShuttingDown)],
        "queued requests fail"
    );
    assert!(a.iter().any(|a| matches!(
        a,
        Action::ToWorker(1, ServerMessage::GracefulShutdown { .. })
    )));
    assert!(!a.contains(&Action::Exit));
    assert_eq!(
        failures(&h.submit(3, "m")),
        vec![(3, Failure::ShuttingDown)]
    );
    let a = h.complete(1, 1);
    assert!(matches!(
        a[1],
        Action::ToClient(1, ClientEvent::Complete(_))
    ));
    assert!(a.contains(&Action::Exit));
}

#[test]
fn shutdown_deadline_cancels_what_is_left() {
    let mut h = Harness::new();
    h.join(1, &["m"], 1);
    h.submit(1, "m");
    h.ev(Event::Shutdown { timeout: 5 * S });
    h.at(5.0);
    let a = h.tick();
    assert_eq!(cancels(&a), vec![(1, 1, CancelReason::ServerShutdown)]);
    assert_eq!(failures(&a), vec![(1, Failure::ShuttingDown)]);
    assert!(a.contains(&Action::Exit));
}

#[test]
fn streamed_chunks_reach_the_client_in_order() {
    let mut h = Harness::new();
    h.join(1, &["m"], 1);
    h.submit(1, "m");
    let mut seen = Vec::new();
    for i in 0..5 {
        for a in h.chunk(1, 1, &format!("c{i}")) {
            if let Action::ToClient(1, ClientEvent::Chunk(c)) = a {
                seen.push(c);
            }
        }
    }
    assert_eq!(seen, vec!["c0", "c1", "c2", "c3", "c4"]);
}

#[test]
fn wire_ids_round_trip_and_foreign_ids_are_rejected() {
    assert_eq!(parse_request_id(&wire_request_id(42)), Some(42));
    assert_eq!(parse_request_id("r-001"), None);
    assert_eq!(parse_request_id("nonsense"), None);
}

// ----- tenants, priority and fair share (issue 9) -----

/// Order in which queued requests reach a 1-slot worker as each one completes.
fn serve_in_order(h: &mut Harness, first: RequestId, n: usize) -> Vec<RequestId> {
    let mut order = Vec::new();
    let mut current = first;
    for _ in 0..n {
        match dispatched(&h.complete(1, current))[..] {
            [(next, 1)] => {
                order.push(next);
                current = next;
            }
            _ => break,
        }
    }
    order
}

#[test]
fn high_priority_overtakes_a_long_normal_queue_and_low_goes_last() {
    let mut h = Harness::with(Config {
        max_queue_len: 100,
        ..Config::default()
    });
    h.join(1, &["m"], 1);
    h.submit_as(1, "a", Priority::Normal, 1);
    for id in 10..30 {
        h.submit_as(id, "a", Priority::Normal, 1);
    }
    h.submit_as(50, "b", Priority::Low, 1);
    h.submit_as(60, "c", Priority::High, 1);
    let order = serve_in_order(&mut h, 1, 22);
    assert_eq!(order[0], 60, "high first");
    assert_eq!(*order.last().unwrap_or(&0), 50, "low last");
    assert_eq!(&order[1..21], &(10..30).collect::<Vec<_>>()[..], "FIFO");
}

#[test]
fn a_low_request_ages_into_normal_and_then_high() {
    let mut h = Harness::with(Config {
        max_queue_len: 100,
        priority_aging: Duration::from_secs(10),
        ..Config::default()
    });
    h.join(1, &["m"], 1);
    h.submit_as(1, "a", Priority::Normal, 1);
    h.submit_as(2, "slow", Priority::Low, 1);
    // A steady stream of normal requests from another tenant.
    for id in 10..40 {
        h.submit_as(id, "busy", Priority::Normal, 1);
    }
    h.at(5.0);
    assert_eq!(dispatched(&h.complete(1, 1)), vec![(10, 1)], "not aged yet");
    h.at(21.0);
    h.submit_as(99, "late", Priority::High, 1);
    // At 20 s the low request has climbed two classes and, the oldest of all, goes
    // first. The busy tenant's requests climbed too (they waited 10 s), so the fresh
    // high request shares the class with them fairly: it goes within two turns.
    assert_eq!(dispatched(&h.complete(1, 10)), vec![(2, 1)]);
    let next = serve_in_order(&mut h, 2, 2);
    assert!(next.contains(&99), "{next:?}");
}

#[test]
fn a_flooding_tenant_delays_another_by_at_most_one_slot() {
    let mut h = Harness::with(Config {
        max_queue_len: 2000,
        max_queue_per_tenant: 1000,
        ..Config::default()
    });
    h.join(1, &["m"], 1);
    h.submit_as(1, "flood", Priority::Normal, 1);
    for id in 100..1100 {
        h.submit_as(id, "flood", Priority::Normal, 1);
    }
    let first = serve_in_order(&mut h, 1, 10);
    h.submit_as(5000, "calm", Priority::Normal, 1);
    let next = serve_in_order(&mut h, *first.last().unwrap_or(&1), 2);
    assert!(next.contains(&5000), "served within one slot: {next:?}");
}

#[test]
fn weights_share_the_pool() {
    let mut h = Harness::with(Config {
        max_queue_len: 1000,
        ..Config::default()
    });
    h.join(1, &["m"], 1);
    h.submit_as(1, "x", Priority::Normal, 1);
    for id in 0..40 {
        h.submit_as(100 + id, "one", Priority::Normal, 1);
        h.submit_as(200 + id, "three", Priority::Normal, 3);
    }
    let order = serve_in_order(&mut h, 1, 40);
    let three = order.iter().filter(|id| **id >= 200).count();
    assert!((29..=31).contains(&three), "3:1, got {three} of 40");
}

#[test]
fn a_tenant_at_its_cap_is_refused_while_others_still_queue() {
    let mut h = Harness::with(Config {
        max_queue_len: 10,
        max_queue_per_tenant: 2,
        ..Config::default()
    });
    h.join(1, &["m"], 1);
    h.submit_as(1, "a", Priority::Normal, 1);
    h.submit_as(2, "a", Priority::Normal, 1);
    h.submit_as(3, "a", Priority::Normal, 1);
    let refused = failures(&h.submit_as(4, "a", Priority::Normal, 1));
    assert!(matches!(refused[..], [(4, Failure::TenantQueueFull(_))]));
    assert!(failures(&h.submit_as(5, "b", Priority::Normal, 1)).is_empty());
    assert_eq!(h.d.gauges().queue_depth, 3);
}

#[test]
fn a_requeued_request_keeps_its_place_and_its_queue_deadline() {
    let mut h = Harness::with(Config {
        max_queue_len: 10,
        queue_timeout: Duration::from_secs(30),
        ..Config::default()
    });
    h.join(1, &["m"], 1);
    h.join(2, &["m"], 1);
    h.submit(1, "m"); // on worker 1
    h.submit(2, "m"); // on worker 2
    h.at(1.0);
    h.submit(3, "m"); // queued
    h.at(10.0);
    h.ev(Event::WorkerLeft {
        id: 1,
        reason: "eof".into(),
    });
    // Request 1 arrived before 3: it goes first when worker 2 frees up.
    assert_eq!(dispatched(&h.complete(2, 2)), vec![(1, 2)]);
    // Lose it again at 20 s: it waits with its deadline from arrival (30 s), not 50 s.
    h.at(20.0);
    h.ev(Event::WorkerLeft {
        id: 2,
        reason: "eof".into(),
    });
    assert_eq!(h.d.gauges().queue_depth, 2);
    h.at(30.5);
    let a = h.tick();
    assert!(failures(&a).contains(&(1, Failure::QueueTimeout)), "{a:?}");
    assert!(
        !failures(&a).iter().any(|(id, _)| *id == 3),
        "3 has 1 s left"
    );
}

#[test]
fn retry_after_follows_the_measured_drain_rate() {
    let mut h = Harness::with(Config {
        max_queue_len: 4,
        ..Config::default()
    });
    h.join(1, &["m"], 1);
    // One completion every 2 s for a while: 0.5 per second.
    h.submit(1, "m");
    let mut current = 1;
    for i in 0..10 {
        h.at(2.0 * (i + 1) as f64);
        h.submit(100 + i, "m");
        current = dispatched(&h.complete(1, current))[0].0;
    }
    for id in 200..204 {
        h.submit(id, "m");
    }
    let refused = failures(&h.submit(300, "m"));
    let [(300, Failure::QueueFull(bp))] = refused[..] else {
        panic!("expected queue_full, got {refused:?}");
    };
    assert_eq!(bp.queue_depth, 4);
    // 4 waiting at about 0.5 per second: about 8 s.
    assert!((7..=9).contains(&bp.retry_after_secs), "{bp:?}");
}

#[test]
fn progress_is_told_once_a_second_to_requests_that_ask() {
    let mut h = Harness::new();
    h.join(1, &["m"], 1);
    h.submit(1, "m");
    h.submit_with_progress(2);
    let progress = |a: &[Action]| {
        a.iter()
            .filter(|a| matches!(a, Action::ToClient(2, ClientEvent::Queued { .. })))
            .count()
    };
    assert_eq!(progress(&h.tick()), 1, "told at once");
    h.at(0.5);
    assert_eq!(progress(&h.tick()), 0);
    h.at(1.0);
    assert_eq!(progress(&h.tick()), 1);
    h.complete(1, 1);
    h.at(3.0);
    assert_eq!(progress(&h.tick()), 0, "not once it runs");
}

// ----- failover and outliers (issue 17) -----

fn retryable_error(id: RequestId) -> WorkerMessage {
    WorkerMessage::Error {
        request_id: Some(wire_request_id(id)),
        code: "backend_unreachable".into(),
        message: "connection refused".into(),
        status_code: Some(502),
        retryable: Some(true),
        headers: Default::default(),
        body: None,
    }
}

fn status(worker_said: &mut Harness, worker: WorkerId, state: crate::protocol::BackendState) {
    worker_said.said(
        worker,
        WorkerMessage::BackendStatus {
            state,
            reason: Some("test".into()),
        },
    );
}

fn answer(h: &mut Harness, worker: WorkerId, id: RequestId, code: u16) -> Vec<Action> {
    let mut rc = ok(id);
    rc.status_code = code;
    h.said(worker, WorkerMessage::ResponseComplete(rc))
}

#[test]
fn the_last_worker_up_is_not_ejected_while_the_others_are_down() {
    use crate::protocol::BackendState;
    let mut h = Harness::new();
    h.join(1, &["m"], 4);
    h.join(2, &["m"], 4);
    status(&mut h, 1, BackendState::Down);
    // Worker 2 fails everything, but it is all that is left: ejecting it would turn
    // its answers into no_healthy_worker for everyone.
    for id in 1..=8 {
        assert_eq!(dispatched(&h.submit(id, "m")), vec![(id, 2)]);
        answer(&mut h, 2, id, 500);
    }
    assert_eq!(h.d.registry().get(2).map(|w| w.health.label()), Some("up"));
    assert_eq!(h.d.counters().ejections, 0);
    // Worker 1 is back: the next failure ejects worker 2.
    status(&mut h, 1, BackendState::Up);
    let on = |h: &Harness, id| {
        h.d.registry()
            .get(2)
            .is_some_and(|w| w.in_flight.contains(&id))
    };
    let mut id = 100;
    while h.d.counters().ejections == 0 {
        id += 1;
        assert!(id < 110, "worker 2 never ejected");
        h.submit(id, "m");
        let (worker, code) = if on(&h, id) { (2, 500) } else { (1, 200) };
        answer(&mut h, worker, id, code);
    }
    assert_eq!(
        h.d.registry().get(2).map(|w| w.health.label()),
        Some("ejected")
    );
}

#[test]
fn a_retryable_failure_runs_again_on_another_worker_not_the_same() {
    let mut h = Harness::new();
    h.join(1, &["m"], 2);
    h.join(2, &["m"], 1);
    h.submit(1, "m"); // worker 1 (lowest id on a tie)
    h.submit(2, "m"); // worker 2
    assert_eq!(dispatched(&h.submit(3, "m")), vec![(3, 1)]);
    // Request 3 fails on worker 1 before any byte: worker 1 has a free slot now, but
    // it goes to worker 2 once that one frees up.
    let a = h.said(1, retryable_error(3));
    assert!(
        failures(&a).is_empty() && dispatched(&a).is_empty(),
        "{a:?}"
    );
    assert_eq!(h.d.counters().failovers, 1);
    assert_eq!(h.d.gauges().queue_depth, 1);
    assert_eq!(dispatched(&h.complete(2, 2)), vec![(3, 2)]);
}

#[test]
fn a_request_fails_over_at_most_twice_and_goes_back_only_when_alone() {
    let mut h = Harness::new();
    h.join(1, &["m"], 1);
    h.join(2, &["m"], 1);
    assert_eq!(dispatched(&h.submit(1, "m")), vec![(1, 1)]);
    assert_eq!(dispatched(&h.said(1, retryable_error(1))), vec![(1, 2)]);
    // Failed on both: with nobody else, it may go back to worker 1.
    assert_eq!(dispatched(&h.said(2, retryable_error(1))), vec![(1, 1)]);
    // Third attempt failed too: the error reaches the client.
    let a = h.said(1, retryable_error(1));
    assert!(matches!(
        failures(&a)[..],
        [(
            1,
            Failure::WorkerError {
                status: Some(502),
                ..
            }
        )]
    ));
    assert_eq!(h.d.counters().failovers, 2);
}

#[test]
fn no_failover_after_a_byte_or_for_an_original_workers_error() {
    let mut h = Harness::new();
    h.join(1, &["m"], 2);
    h.join(2, &["m"], 2);
    h.submit(1, "m");
    h.chunk(1, 1, "data: {}\n\n");
    assert_eq!(
        failures(&h.said(1, retryable_error(1))).len(),
        1,
        "streamed"
    );
    h.submit(2, "m");
    let plain = WorkerMessage::Error {
        request_id: Some(wire_request_id(2)),
        code: "backend_unreachable".into(),
        message: "refused".into(),
        status_code: Some(502),
        retryable: None,
        headers: Default::default(),
        body: None,
    };
    let on = if h
        .d
        .registry()
        .get(1)
        .is_some_and(|w| w.in_flight.contains(&2))
    {
        1
    } else {
        2
    };
    assert_eq!(failures(&h.said(on, plain)).len(), 1, "passed through");
    assert_eq!(h.d.counters().failovers, 0);
}

#[test]
fn a_backend_reported_down_is_skipped_until_it_is_up() {
    use crate::protocol::BackendState;
    let mut h = Harness::new();
    h.join(1, &["m"], 1);
    h.join(2, &["m"], 1);
    status(&mut h, 1, BackendState::Down);
    assert_eq!(dispatched(&h.submit(1, "m")), vec![(1, 2)]);
    h.submit(2, "m");
    assert_eq!(h.d.gauges().queue_depth, 1, "worker 1 is free but down");
    h.said(
        1,
        WorkerMessage::Pong {
            current_load: 0,
            timestamp_unix_ms: None,
        },
    );
    assert_eq!(h.d.gauges().queue_depth, 1);
    status(&mut h, 1, BackendState::Up);
    assert_eq!(h.d.gauges().queue_depth, 0, "taken at once when up");
}

#[test]
fn with_every_backend_down_requests_fail_fast_and_queued_ones_say_why() {
    use crate::protocol::BackendState;
    let mut h = Harness::new();
    h.join(1, &["m"], 1);
    h.submit(1, "m"); // running
    h.submit(2, "m"); // queued
    status(&mut h, 1, BackendState::Down);
    let a = h.submit(3, "m");
    assert!(matches!(
        failures(&a)[..],
        [(
            3,
            Failure::NoHealthyWorker {
                retry_after_secs: 5
            }
        )]
    ));
    h.at(30.5);
    let a = h.tick();
    assert!(
        matches!(failures(&a)[..], [(2, Failure::NoHealthyWorker { .. })]),
        "{a:?}"
    );
}

#[test]
fn consecutive_failures_eject_a_worker_with_growing_backoff_and_never_half_the_pool() {
    let mut h = Harness::new();
    h.join(1, &["m"], 8);
    h.join(2, &["m"], 8);
    let mut next_id = 100;
    let mut fail_on = |h: &mut Harness, worker: WorkerId, n: usize| {
        for _ in 0..n {
            next_id += 1;
            let id = next_id;
            h.submit(id, "m");
            // Complete it with a 500 on whichever worker took it, counting for `worker`
            // only when it ran there.
            let on = if h
                .d
                .registry()
                .get(worker)
                .is_some_and(|w| w.in_flight.contains(&id))
            {
                worker
            } else {
                3 - worker
            };
            let code = if on == worker { 500 } else { 200 };
            answer(h, on, id, code);
        }
    };
    fail_on(&mut h, 1, 20);
    let w1 = h.d.registry().get(1).map(|w| w.health.label());
    assert_eq!(w1, Some("ejected"));
    assert_eq!(h.d.counters().ejections, 1);
    // Worker 2 failing now too: ejecting it would leave nobody, so it stays.
    fail_on(&mut h, 2, 10);
    assert_eq!(h.d.registry().get(2).map(|w| w.health.label()), Some("up"));
    // 10 s later worker 1 is back; failing again ejects it for 20 s.
    h.at(10.0);
    h.tick();
    assert_eq!(h.d.registry().get(1).map(|w| w.health.label()), Some("up"));
    // Fresh worker 2 answers well from now on.
    fail_on(&mut h, 1, 20);
    match h.d.registry().get(1).map(|w| w.health.clone()) {
        Some(Health::Ejected { until, .. }) => {
            assert_eq!(
                until,
                h.t0 + Duration::from_secs(30),
                "20 s the second time"
            )
        }
        other => panic!("expected ejected, got {other:?}"),
    }
}

#[test]
fn with_no_worker_up_to_take_it_a_retryable_error_goes_through_at_once() {
    use crate::protocol::BackendState;
    let mut h = Harness::new();
    h.join(1, &["m"], 1);
    h.submit(1, "m");
    status(&mut h, 1, BackendState::Down);
    let a = h.said(1, retryable_error(1));
    assert!(matches!(
        failures(&a)[..],
        [(
            1,
            Failure::WorkerError {
                status: Some(502),
                ..
            }
        )]
    ));
    assert_eq!(h.d.counters().failovers, 0);
}

// ----- where a model is loaded (issue 10) -----

fn loaded(h: &mut Harness, worker: WorkerId, models: &[&str], loaded: &[&str]) {
    h.said(
        worker,
        WorkerMessage::ModelsUpdate {
            models: models.iter().map(|m| m.to_string()).collect(),
            current_load: 0,
            loaded_models: Some(loaded.iter().map(|m| m.to_string()).collect()),
            model_info: None,
        },
    );
}

#[test]
fn a_worker_with_the_model_loaded_goes_first_then_any_then_the_queue() {
    let mut h = Harness::new();
    h.join(1, &["a", "b"], 2);
    h.join(2, &["a", "b"], 2);
    loaded(&mut h, 2, &["a", "b"], &["a"]);
    // Loaded beats less loaded: both requests for `a` go to worker 2.
    assert_eq!(dispatched(&h.submit(1, "a")), vec![(1, 2)]);
    assert_eq!(dispatched(&h.submit(2, "a")), vec![(2, 2)]);
    // Worker 2 is full: any worker that advertises it.
    assert_eq!(dispatched(&h.submit(3, "a")), vec![(3, 1)]);
    // Nobody has `b` loaded: least loaded, as before.
    assert_eq!(dispatched(&h.submit(4, "b")), vec![(4, 1)]);
    assert_eq!(h.d.gauges().queue_depth, 0);
    h.submit(5, "a");
    assert_eq!(h.d.gauges().queue_depth, 1, "all full: it waits");
    // Unloaded on worker 2, loaded on worker 1: the next `a` goes to 1.
    h.complete(1, 3);
    h.complete(1, 4);
    h.complete(2, 1);
    h.complete(2, 2);
    h.complete(2, 5);
    loaded(&mut h, 2, &["a", "b"], &[]);
    loaded(&mut h, 1, &["a", "b"], &["a"]);
    assert_eq!(dispatched(&h.submit(6, "a")), vec![(6, 1)]);
}

#[test]
fn failovers_and_requeues_share_one_budget() {
    let mut h = Harness::new();
    for w in 1..=3 {
        h.join(w, &["m"], 1);
    }
    h.submit(1, "m");
    let mut dispatches = 1;
    let mut on = 1;
    // Two failovers (1 → 2 → 3), then its worker keeps dying.
    for _ in 0..2 {
        let a = h.said(on, retryable_error(1));
        let d = dispatched(&a);
        assert_eq!(d.len(), 1, "{a:?}");
        on = d[0].1;
        dispatches += 1;
    }
    loop {
        let a = h.ev(Event::WorkerLeft {
            id: on,
            reason: "eof".into(),
        });
        if let [(1, f)] = &failures(&a)[..] {
            assert_eq!(*f, Failure::RequeueExhausted);
            break;
        }
        let d = dispatched(&a);
        assert_eq!(d.len(), 1, "{a:?}");
        on = d[0].1;
        dispatches += 1;
        h.join(10 + dispatches, &["m"], 1);
    }
    // Failovers count against the requeue budget (3): one dispatch, two failovers, one
    // requeue; the next loss ends it. Before, it could be dispatched six times.
    assert_eq!(dispatches, 4);
}

#[test]
fn a_failed_over_request_does_not_wait_for_a_draining_worker() {
    let mut h = Harness::new();
    h.join(1, &["m"], 1);
    h.join(2, &["m"], 1);
    h.said(2, WorkerMessage::WorkerDraining {});
    assert_eq!(dispatched(&h.submit(1, "m")), vec![(1, 1)]);
    // Worker 2 is draining: the only worker left to run it is the one it failed on.
    assert_eq!(dispatched(&h.said(1, retryable_error(1))), vec![(1, 1)]);
}

#[test]
fn a_requeue_does_not_start_a_second_chain_of_progress_notes() {
    let mut h = Harness::new();
    h.join(1, &["m"], 1);
    h.join(2, &["m"], 1);
    h.submit(1, "m");
    h.submit(2, "m");
    h.submit_with_progress(3);
    let notes = |a: &[Action]| {
        a.iter()
            .filter(|a| matches!(a, Action::ToClient(3, ClientEvent::Queued { .. })))
            .count()
    };
    let mut told = notes(&h.tick());
    // Dispatched, then its worker dies half a second later: queued again.
    h.at(0.2);
    h.complete(1, 1);
    h.at(0.7);
    h.ev(Event::WorkerLeft {
        id: 1,
        reason: "eof".into(),
    });
    for step in 1..=40 {
        h.at(0.7 + step as f64 * 0.1);
        told += notes(&h.tick());
    }
    // About one a second over 4.7 s (plus the one at once on each queueing).
    assert!((5..=7).contains(&told), "{told} notes");
}

/// A worker that takes requests and never answers them (wedged, or claiming a capacity
/// it does not have) is ejected like one failing with 5xx: its timeouts count (issue 14,
/// abuse).
#[test]
fn a_worker_whose_requests_time_out_is_ejected() {
    let long_heartbeat = Duration::from_secs(10_000);
    let mut h = Harness::with(Config {
        heartbeat_timeout: long_heartbeat,
        heartbeat_interval: long_heartbeat,
        ..cfg()
    });
    h.join(1, &["m"], 1_000_000);
    h.join(2, &["m"], 1);
    for id in 1..=10 {
        h.submit(id, "m");
    }
    let on_1 = h.d.registry().get(1).map_or(0, |w| w.in_flight.len());
    assert!(on_1 >= 5, "the liar took {on_1}");
    h.at(1000.0);
    let a = h.tick();
    assert_eq!(failures(&a).len(), 10);
    assert_eq!(
        h.d.registry().get(1).map(|w| w.health.label()),
        Some("ejected")
    );
    assert_eq!(h.d.registry().get(2).map(|w| w.health.label()), Some("up"));
    // The next request goes to the honest worker.
    h.submit(11, "m");
    assert!(h
        .d
        .registry()
        .get(2)
        .is_some_and(|w| w.in_flight.contains(&11)));
}

mod contract;
