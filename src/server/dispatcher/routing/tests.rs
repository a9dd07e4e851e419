//! Cache-affinity routing in the dispatcher, with the fake clock: the longest prefix
//! wins, load stays bounded, what is forgotten when, explicit keys, and the short wait
//! for a full cached worker (and its expiry), with the queue's order untouched.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::*;
use crate::protocol::lifecycle::{
    OperationKind, OperationState, OperationStatus, FEATURE_LIFECYCLE,
};
use crate::protocol::{
    BackendState, RegisterMessage, RequestMessage, ResponseComplete, ServerMessage, WorkerMessage,
};
use crate::server::dispatcher::lifecycle::OperationRequest;
use crate::server::dispatcher::tests::dispatched;
use crate::server::dispatcher::{wire_request_id, Action, Config, Event, Who};
use crate::server::fingerprint::Fingerprints;

const WAIT: Duration = Duration::from_millis(400);

struct Harness {
    d: Dispatcher,
    now: Instant,
}

impl Harness {
    fn new() -> Harness {
        Harness::with(Config {
            affinity_wait: WAIT,
            ..Config::default()
        })
    }

    fn with(cfg: Config) -> Harness {
        let now = Instant::now();
        Harness {
            d: Dispatcher::new(cfg, now),
            now,
        }
    }

    fn join_with(&mut self, id: WorkerId, slots: u32, loaded: Option<&[&str]>, ops: bool) {
        let register = RegisterMessage {
            worker_name: format!("box-{id}"),
            models: vec!["m".into(), "n".into()],
            max_concurrent: slots,
            protocol_version: Some("1".into()),
            current_load: Some(0),
            features: if ops {
                vec![FEATURE_LIFECYCLE.into()]
            } else {
                vec![]
            },
            loaded_models: loaded.map(|l| l.iter().map(|m| m.to_string()).collect()),
            backend_kind: None,
            model_info: None,
            wake: None,
        };
        let remote = "127.0.0.1:1".into();
        self.d.handle(
            Event::WorkerJoined {
                id,
                register,
                remote,
            },
            self.now,
        );
    }

    fn join(&mut self, id: WorkerId, slots: u32) {
        self.join_with(id, slots, None, false);
    }

    /// Submits request `id` for model `m` with these fingerprints; where it went now.
    fn send(&mut self, id: RequestId, prints: Fingerprints) -> Option<WorkerId> {
        self.send_for(id, "m", prints)
    }

    fn send_for(&mut self, id: RequestId, model: &str, prints: Fingerprints) -> Option<WorkerId> {
        let msg = Arc::new(RequestMessage {
            request_id: wire_request_id(id),
            model: model.into(),
            endpoint_path: "/v1/chat/completions".into(),
            is_streaming: false,
            body: Arc::from("{}"),
            headers: Default::default(),
            continuation: None,
        });
        let event = Event::Submit {
            id,
            msg,
            who: Who::default(),
            needs: Needs::default(),
            prints,
            progress: false,
            continuable: false,
        };
        let actions = self.d.handle(event, self.now);
        went(&actions, id)
    }

    /// Worker `w` finishes request `id`; the requests that started because of it.
    fn done(&mut self, w: WorkerId, id: RequestId) -> Vec<(RequestId, WorkerId)> {
        let rc = ResponseComplete {
            request_id: wire_request_id(id),
            status_code: 200,
            ..Default::default()
        };
        let msg = WorkerMessage::ResponseComplete(rc);
        dispatched(&self.d.handle(Event::WorkerSaid(w, msg), self.now))
    }

    fn said(&mut self, w: WorkerId, msg: WorkerMessage) {
        self.d.handle(Event::WorkerSaid(w, msg), self.now);
    }

    /// Moves the clock on; the requests that started when the timers fired.
    fn later(&mut self, by: Duration) -> Vec<(RequestId, WorkerId)> {
        self.now += by;
        dispatched(&self.d.tick(self.now))
    }

    fn held(&self, w: WorkerId) -> usize {
        self.d.affinity.held(w)
    }

    /// (hits, misses, overridden, waits)
    fn counts(&self) -> (u64, u64, u64, u64) {
        let c = self.d.counters();
        (
            c.affinity_hits,
            c.affinity_misses,
            c.affinity_overridden,
            c.affinity_waits,
        )
    }
}

fn went(actions: &[Action], id: RequestId) -> Option<WorkerId> {
    dispatched(actions)
        .into_iter()
        .find(|(r, _)| *r == id)
        .map(|(_, w)| w)
}

fn prefixes(p: &[u64]) -> Fingerprints {
    Fingerprints::Prefixes(p.into())
}

#[test]
fn each_conversation_comes_back_to_its_worker_and_two_spread_over_two() {
    let mut h = Harness::new();
    h.join(1, 4);
    h.join(2, 4);
    // Turn 1 of A and of B: nobody holds them, so load and round robin spread them.
    let a = h.send(1, prefixes(&[10, 11])).expect("a");
    let b = h.send(2, prefixes(&[20, 21])).expect("b");
    assert_ne!(a, b, "two conversations on two workers");
    h.done(a, 1);
    h.done(b, 2);
    // Later turns repeat the earlier prompt and add to it.
    for turn in 0..4u64 {
        let ta = 100 + 2 * turn;
        let pa: Vec<u64> = [10, 11].into_iter().chain(12..13 + turn).collect();
        let pb: Vec<u64> = [20, 21].into_iter().chain(22..23 + turn).collect();
        assert_eq!(h.send(ta, prefixes(&pa)), Some(a), "A turn {turn}");
        assert_eq!(h.send(ta + 1, prefixes(&pb)), Some(b), "B turn {turn}");
        h.done(a, ta);
        h.done(b, ta + 1);
    }
    assert_eq!(h.counts(), (8, 2, 0, 0));
}

#[test]
fn the_longest_held_prefix_wins() {
    let mut h = Harness::new();
    h.join(1, 4);
    h.join(2, 4);
    h.join(3, 4);
    let m = model_key("m");
    h.d.affinity.remember(1, m, &[1, 2]);
    h.d.affinity.remember(2, m, &[1, 2, 3, 4]);
    h.d.affinity.remember(3, m, &[1]);
    assert_eq!(h.send(1, prefixes(&[1, 2, 3, 4, 5])), Some(2));
    assert_eq!(
        h.send(2, prefixes(&[1, 2, 9])),
        Some(1),
        "w2 is busier: a tie on [1, 2] goes to the idle w1"
    );
    assert_eq!(
        h.send(3, prefixes(&[1, 7])),
        Some(3),
        "all hold [1]: the least loaded"
    );
    assert_eq!(
        h.send_for(4, "n", prefixes(&[1, 2, 3, 4])),
        Some(1),
        "per model: n is held nowhere, least load and round robin"
    );
    assert_eq!(h.counts(), (3, 1, 0, 0));
}

#[test]
fn load_stays_within_a_quarter_above_the_mean() {
    let mut h = Harness::new();
    h.join(1, 8);
    h.join(2, 8);
    h.d.affinity.remember(1, model_key("m"), &[7]);
    let conv = || prefixes(&[7]);
    // 1 → 0 others: fine; 2 vs 0: 4·2·1 < 5·2; 3 vs 0: 4·2·2 ≥ 5·3, so elsewhere.
    assert_eq!(h.send(1, conv()), Some(1));
    assert_eq!(h.send(2, conv()), Some(1));
    assert_eq!(h.send(3, conv()), Some(2), "overridden by load");
    assert_eq!(
        h.send(4, conv()),
        Some(2),
        "both hold it now: the less loaded"
    );
    assert_eq!(h.counts(), (3, 0, 1, 0));
    assert_eq!(h.held(2), 1, "the new home is remembered too");
}

#[test]
fn explicit_keys_keep_a_session_together_and_apart_from_others() {
    let mut h = Harness::new();
    h.join(1, 4);
    h.join(2, 4);
    let first = h.send(1, Fingerprints::Key(42)).expect("first");
    let other = h.send(2, Fingerprints::Key(43)).expect("other");
    assert_ne!(first, other);
    h.done(first, 1);
    h.done(other, 2);
    for id in 3..8 {
        assert_eq!(h.send(id, Fingerprints::Key(42)), Some(first));
        h.done(first, id);
    }
}

#[test]
fn a_worker_that_leaves_or_whose_backend_goes_down_is_forgotten() {
    let mut h = Harness::new();
    h.join(1, 4);
    h.join(2, 4);
    let home = h.send(1, prefixes(&[5, 6])).expect("home");
    h.done(home, 1);
    assert_eq!(h.held(home), 2);
    h.d.handle(
        Event::WorkerLeft {
            id: home,
            reason: "gone".into(),
        },
        h.now,
    );
    assert_eq!(h.held(home), 0);
    let next = h.send(2, prefixes(&[5, 6, 7])).expect("next");
    assert_ne!(next, home);
    h.done(next, 2);
    assert_eq!(h.counts(), (0, 2, 0, 0), "both were misses");
    let down = WorkerMessage::BackendStatus {
        state: BackendState::Down,
        reason: Some("restarting".into()),
    };
    h.said(next, down);
    assert_eq!(h.held(next), 0, "a restarted backend has lost its cache");
}

#[test]
fn an_unload_a_flush_or_a_model_no_longer_loaded_forgets_that_model() {
    let mut h = Harness::new();
    h.join_with(1, 4, Some(&["m", "n"]), true);
    let (m, n) = (model_key("m"), model_key("n"));
    h.d.affinity.remember(1, m, &[1, 2]);
    h.d.affinity.remember(1, n, &[3, 4]);
    let unload = OperationRequest {
        kind: OperationKind::Unload,
        model: Some("m".into()),
        runner: None,
    };
    h.d.start_operation(unload, Duration::from_secs(60), h.now)
        .expect("started");
    let op =
        h.d.tick(h.now)
            .into_iter()
            .find_map(|a| match a {
                Action::ToWorker(1, ServerMessage::ModelOperation(o)) => Some(o.operation_id),
                _ => None,
            })
            .expect("sent");
    h.said(
        1,
        WorkerMessage::OperationStatus(OperationStatus {
            operation_id: op,
            status: OperationState::Completed,
            progress: None,
            message: None,
            backend: None,
        }),
    );
    assert_eq!(h.d.affinity.matched(1, m, &[1, 2]), 0, "m unloaded");
    assert_eq!(h.d.affinity.matched(1, n, &[3, 4]), 2, "n stays");
    // The backend evicts n on its own (Ollama's keep_alive): its next report says so.
    h.said(
        1,
        WorkerMessage::ModelsUpdate {
            models: vec!["m".into(), "n".into()],
            current_load: 0,
            loaded_models: Some(vec![]),
            model_info: None,
        },
    );
    assert_eq!(h.held(1), 0);
}

#[test]
fn a_full_cached_worker_is_waited_for_briefly_and_the_queue_keeps_its_order() {
    let mut h = Harness::new();
    h.join(1, 2);
    h.join(2, 2);
    h.d.affinity.remember(1, model_key("m"), &[7]);
    // Fill w1 (load routing: 1, 2, 1) and leave one slot on w2.
    assert_eq!(h.send(1, Fingerprints::None), Some(1));
    assert_eq!(h.send(2, Fingerprints::None), Some(2));
    assert_eq!(h.send(3, Fingerprints::None), Some(1));
    // A's box is full, w2 has a slot: A waits for w1 rather than re-evaluate elsewhere.
    assert_eq!(h.send(10, prefixes(&[7, 8])), None, "waits");
    assert_eq!(h.d.gauges().queue_depth, 1);
    // Others still use w2 meanwhile (A does not want it).
    assert_eq!(h.send(11, Fingerprints::None), Some(2));
    assert_eq!(
        h.send(12, Fingerprints::None),
        None,
        "everything busy: queued behind A"
    );
    // w1 frees a slot: A goes first (it is ahead), and 12 waits for the next slot.
    assert_eq!(h.done(1, 1), vec![(10, 1)]);
    assert_eq!(h.done(2, 2), vec![(12, 2)]);
    assert_eq!(h.counts(), (1, 0, 0, 1));
    assert!(h.later(WAIT).is_empty(), "the timer went with the wait");
}

#[test]
fn a_wait_ends_after_affinity_wait_ms_and_the_request_goes_elsewhere() {
    let mut h = Harness::new();
    h.join(1, 2);
    h.join(2, 2);
    h.d.affinity.remember(1, model_key("m"), &[7]);
    for (id, to) in [(1, 1), (2, 2), (3, 1)] {
        assert_eq!(h.send(id, Fingerprints::None), Some(to));
    }
    assert_eq!(h.send(10, prefixes(&[7])), None);
    assert!(h.later(WAIT - Duration::from_millis(1)).is_empty());
    assert_eq!(
        h.later(Duration::from_millis(1)),
        vec![(10, 2)],
        "not held beyond the wait"
    );
    assert_eq!(h.counts(), (0, 0, 1, 1), "counted as overridden by load");
    assert_eq!(h.d.affinity.waiting_for(1), 0);
    assert_eq!(
        h.d.affinity.matched(2, model_key("m"), &[7]),
        1,
        "its new home is remembered"
    );
}

#[test]
fn no_wait_beyond_the_bound_when_disabled_or_when_enough_wait_already() {
    // w1 is full with three, w2 idle: even once w1 finishes one, taking this one would
    // put it above the bound (2 + 1 > ceil(1.25 × 3 / 2)), so it goes to w2 now.
    let mut h = Harness::new();
    h.join(1, 3);
    for id in 1..=3 {
        assert_eq!(h.send(id, Fingerprints::None), Some(1));
    }
    h.join(2, 3);
    h.d.affinity.remember(1, model_key("m"), &[7]);
    assert_eq!(h.send(4, prefixes(&[7])), Some(2), "w2 idles: no wait");
    assert_eq!(h.counts(), (0, 0, 1, 0));
    // Two slots: (2, 0) becomes (1 + 1, 0) when w1 frees one, within the bound: it waits.
    let mut h = Harness::new();
    h.join(1, 2);
    h.join(2, 2);
    h.d.affinity.remember(1, model_key("m"), &[7]);
    assert_eq!(h.send(1, prefixes(&[7])), Some(1));
    assert_eq!(h.send(2, prefixes(&[7])), Some(1));
    assert_eq!(h.send(3, prefixes(&[7])), None, "waits for w1");
    assert_eq!(h.done(1, 1), vec![(3, 1)]);

    // AFFINITY_WAIT_MS=0.
    let mut h = Harness::with(Config {
        affinity_wait: Duration::ZERO,
        ..Config::default()
    });
    h.join(1, 2);
    h.join(2, 2);
    h.d.affinity.remember(1, model_key("m"), &[7]);
    for (id, to) in [(1, 1), (2, 2), (3, 1)] {
        assert_eq!(h.send(id, Fingerprints::None), Some(to));
    }
    assert_eq!(h.send(10, prefixes(&[7])), Some(2));

    // At most as many wait for a worker as it has slots.
    let mut h = Harness::new();
    h.join(1, 1);
    h.join(2, 4);
    h.d.affinity.remember(1, model_key("m"), &[7]);
    assert_eq!(h.send(1, prefixes(&[7])), Some(1));
    assert_eq!(h.send(2, Fingerprints::None), Some(2));
    assert_eq!(h.send(3, prefixes(&[7])), None, "one waits for w1");
    assert_eq!(h.send(4, prefixes(&[7])), Some(2), "a second does not");
}

#[test]
fn a_queued_request_picked_for_another_worker_waits_while_the_next_one_takes_the_slot() {
    let mut h = Harness::new();
    h.join(1, 1);
    h.join(2, 1);
    let m = model_key("m");
    h.d.affinity.remember(1, m, &[1]);
    h.d.affinity.remember(2, m, &[2]);
    assert_eq!(h.send(1, Fingerprints::None), Some(1));
    assert_eq!(h.send(2, Fingerprints::None), Some(2));
    assert_eq!(h.send(3, prefixes(&[1])), None, "A (w1's) queued first");
    assert_eq!(h.send(4, prefixes(&[2])), None, "B (w2's) queued second");
    // w2 frees: the queue offers A; A waits for w1, so B, next in line, takes w2.
    assert_eq!(h.done(2, 2), vec![(4, 2)]);
    assert_eq!(h.done(1, 1), vec![(3, 1)]);
    assert_eq!(h.counts(), (2, 0, 0, 1));
}

#[test]
fn capability_and_loaded_model_rules_come_before_affinity() {
    let mut h = Harness::new();
    h.join_with(1, 4, Some(&[]), false);
    h.join_with(2, 4, Some(&["m"]), false);
    h.d.affinity.remember(1, model_key("m"), &[7]);
    assert_eq!(
        h.send(1, prefixes(&[7])),
        Some(2),
        "w2 holds the model in memory"
    );
    assert_eq!(h.counts(), (0, 1, 0, 0), "w1 was not a candidate");
}

#[test]
fn with_affinity_off_fingerprints_are_ignored() {
    let mut h = Harness::with(Config {
        affinity: false,
        ..Config::default()
    });
    h.join(1, 4);
    h.join(2, 4);
    let mut seen = Vec::new();
    for id in 1..5 {
        let w = h.send(id, prefixes(&[7])).expect("dispatched");
        h.done(w, id);
        seen.push(w);
    }
    assert_eq!(seen, [1, 2, 1, 2], "round robin as before");
    assert_eq!(h.counts(), (0, 0, 0, 0));
    assert_eq!(h.held(1) + h.held(2), 0, "nothing remembered");
}

#[test]
fn a_waiting_request_that_leaves_releases_its_place_for_the_worker() {
    let mut h = Harness::new();
    h.join(1, 1);
    h.join(2, 2);
    h.d.affinity.remember(1, model_key("m"), &[7]);
    assert_eq!(h.send(1, Fingerprints::None), Some(1));
    assert_eq!(h.send(2, prefixes(&[7])), None);
    assert_eq!(h.d.affinity.waiting_for(1), 1);
    h.d.handle(Event::ClientGone(2), h.now);
    assert_eq!(h.d.affinity.waiting_for(1), 0);
    assert_eq!(
        h.send(3, prefixes(&[7])),
        None,
        "the next one may wait again"
    );
    assert!(h.later(WAIT).iter().any(|(id, w)| (*id, *w) == (3, 2)));
}

#[test]
fn a_requeued_request_goes_to_the_worker_asking_for_work_not_the_next_newcomer() {
    // A steady worker and short-lived newcomers: round robin over the free workers
    // would hand a requeued request to the next newcomer each time, until its requeues
    // ran out; the worker that asks for work takes it instead.
    let mut h = Harness::new();
    h.join(1, 4);
    for newcomer in 2..=4 {
        h.join(newcomer, 1);
    }
    assert_eq!(h.send(1, Fingerprints::None), Some(1));
    h.done(1, 1);
    assert_eq!(h.send(2, Fingerprints::None), Some(2), "round robin");
    let left = Event::WorkerLeft {
        id: 2,
        reason: "gone".into(),
    };
    let requeued = dispatched(&h.d.handle(left, h.now));
    assert_eq!(requeued, vec![(2, 1)], "to the steady worker, not to w-3");
}
