//! Whom to wake, when, and when to give up: events in, actions out, fake clock.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::super::tests::failures;
use super::super::*;
use crate::power::WakeAddress;
use crate::protocol::power::{FEATURE_SLEEP, FEATURE_WAKE_PEERS};
use crate::protocol::{RegisterMessage, RequestMessage, ServerMessage, WorkerMessage};

struct H {
    d: Dispatcher,
    t0: Instant,
    now: Instant,
}

fn wake_addr() -> WakeAddress {
    WakeAddress::parse("aa:bb:cc:dd:ee:01", "127.0.0.1:9").unwrap()
}

impl H {
    fn new(wake: WakeConfig) -> H {
        let t0 = Instant::now();
        let cfg = Config {
            queue_timeout: Duration::from_secs(30),
            // Workers here never pong: keep them registered through the test.
            heartbeat_interval: Duration::from_secs(10_000),
            heartbeat_timeout: Duration::from_secs(10_000),
            wake,
            ..Config::default()
        };
        H {
            d: Dispatcher::new(cfg, t0),
            t0,
            now: t0,
        }
    }

    fn at(&mut self, secs: u64) {
        self.now = self.t0 + Duration::from_secs(secs);
    }

    fn join(&mut self, id: WorkerId, name: &str, models: &[&str], wake: bool) -> Vec<Action> {
        let register = RegisterMessage {
            worker_name: name.into(),
            models: models.iter().map(|m| m.to_string()).collect(),
            max_concurrent: 1,
            protocol_version: Some("1".into()),
            current_load: Some(0),
            features: vec![FEATURE_WAKE_PEERS.into(), FEATURE_SLEEP.into()],
            loaded_models: None,
            backend_kind: None,
            model_info: None,
            wake: wake.then(wake_addr),
            routes: None,
        };
        self.d.handle(
            Event::WorkerJoined {
                id,
                register,
                remote: "127.0.0.1:1".into(),
            },
            self.now,
        )
    }

    fn leave(&mut self, id: WorkerId) -> Vec<Action> {
        let reason = "gone".into();
        self.d.handle(Event::WorkerLeft { id, reason }, self.now)
    }

    fn submit(&mut self, id: RequestId, model: &str, progress: bool) -> Vec<Action> {
        let msg = Arc::new(RequestMessage {
            request_id: wire_request_id(id),
            model: model.into(),
            endpoint_path: "/v1/chat/completions".into(),
            is_streaming: progress,
            body: Arc::from("{}"),
            headers: Default::default(),
            body_encoding: None,
            continuation: None,
            held: None,
        });
        self.d.handle(
            Event::Submit {
                id,
                msg,
                who: Who::default(),
                needs: Needs::default(),
                prints: Default::default(),
                progress,
                continuable: false,
            },
            self.now,
        )
    }

    fn tick(&mut self) -> Vec<Action> {
        self.d.tick(self.now)
    }

    /// Worker `id` asks to sleep: `Ok` when granted, else the reason it is refused.
    fn ask_sleep(&mut self, id: WorkerId) -> Result<(), String> {
        let event = Event::WorkerSaid(id, WorkerMessage::SleepRequest {});
        match &self.d.handle(event, self.now)[..] {
            [Action::ToWorker(w, ServerMessage::SleepAnswer { granted, reason })] if *w == id => {
                match granted {
                    true => Ok(()),
                    false => Err(reason.clone().unwrap_or_default()),
                }
            }
            other => panic!("no sleep answer: {other:?}"),
        }
    }
}

fn wake_peers(actions: &[Action]) -> Vec<(WorkerId, String)> {
    actions
        .iter()
        .filter_map(|a| match a {
            Action::ToWorker(w, ServerMessage::WakePeer { worker_name, .. }) => {
                Some((*w, worker_name.clone()))
            }
            _ => None,
        })
        .collect()
}

fn dispatched(actions: &[Action]) -> Vec<(WorkerId, String)> {
    actions
        .iter()
        .filter_map(|a| match a {
            Action::ToWorker(w, ServerMessage::Request(r)) => Some((*w, r.request_id.clone())),
            _ => None,
        })
        .collect()
}

/// A NAS worker (no models, sends packets) and a GPU box with `m` that went to sleep.
fn nas_and_sleeping_box(wake: WakeConfig) -> H {
    let mut h = H::new(wake);
    h.join(1, "nas", &[], false);
    h.join(2, "gpu", &["m"], true);
    h.leave(2);
    h
}

#[test]
fn a_box_that_leaves_with_a_wake_address_is_remembered_asleep() {
    let mut h = H::new(WakeConfig::default());
    h.join(1, "plain", &["a"], false);
    h.join(2, "gpu", &["m"], true);
    let v = h.d.sleepers().version();
    h.leave(1);
    assert_eq!(
        h.d.sleepers().version(),
        v,
        "no wake address: not remembered"
    );
    h.leave(2);
    let records = h.d.sleepers().records();
    assert_eq!(records.len(), 1);
    assert_eq!(records[0].name, "gpu");
    assert_eq!(records[0].models, vec!["m".to_string()]);
    // Back again: awake, forgotten.
    h.join(3, "gpu", &["m"], true);
    assert!(h.d.sleepers().records().is_empty());
}

#[test]
fn a_request_only_a_sleeper_serves_wakes_it_through_an_awake_worker_and_waits() {
    let mut h = nas_and_sleeping_box(WakeConfig::default());
    h.at(100); // long after the queue timeout window: the model is no typo
    let a = h.submit(10, "m", true);
    assert_eq!(wake_peers(&a), vec![(1, "gpu".to_string())]);
    assert!(failures(&a).is_empty());
    // One wake per box: a second request waits for the same wake.
    let a = h.submit(11, "m", false);
    assert!(wake_peers(&a).is_empty());
    // Progress notes name the box.
    h.at(101);
    let a = h.tick();
    assert!(a.contains(&Action::ToClient(
        10,
        ClientEvent::Waking {
            worker: "gpu".into()
        }
    )));
    // Past the usual queue timeout it still waits.
    h.at(100 + 60);
    assert!(failures(&h.tick()).is_empty());
    // The box registers: the requests go to it at once.
    let a = h.join(4, "gpu", &["m"], true);
    assert_eq!(dispatched(&a), vec![(4, wire_request_id(10))]);
    assert!(h.d.sleepers().records().is_empty());
}

#[test]
fn a_box_that_does_not_come_back_fails_its_requests_naming_it() {
    let mut h = nas_and_sleeping_box(WakeConfig {
        timeout: Duration::from_secs(50),
        ..WakeConfig::default()
    });
    h.at(100);
    h.submit(10, "m", false);
    h.at(149);
    assert!(failures(&h.tick()).is_empty());
    h.at(150);
    let f = failures(&h.tick());
    assert_eq!(f.len(), 1);
    match &f[0] {
        (10, Failure::Asleep { worker, detail }) => {
            assert_eq!(worker, "gpu");
            assert!(detail.contains("50s"), "{detail}");
        }
        other => panic!("unexpected {other:?}"),
    }
    // Still remembered asleep; the next request tries again.
    assert_eq!(h.d.sleepers().records().len(), 1);
    assert_eq!(wake_peers(&h.submit(11, "m", false)).len(), 1);
}

#[test]
fn the_relay_sends_the_packet_itself_when_configured_and_nobody_else_can() {
    let mut h = H::new(WakeConfig {
        from_relay: true,
        ..WakeConfig::default()
    });
    h.join(2, "gpu", &["m"], true);
    h.leave(2);
    h.at(100);
    let a = h.submit(10, "m", false);
    assert!(a.contains(&Action::SendWake("gpu".into(), wake_addr())));
    // Without either, the request waits its queue timeout and is told why.
    let mut h = H::new(WakeConfig::default());
    h.join(2, "gpu", &["m"], true);
    h.leave(2);
    h.at(100);
    assert!(h.submit(10, "m", false).is_empty());
    h.at(130);
    let f = failures(&h.tick());
    assert!(
        matches!(&f[..], [(10, Failure::Asleep { worker, detail })] if worker == "gpu" && detail.contains("nothing could wake it")),
        "{f:?}"
    );
}

#[test]
fn busy_workers_wake_a_sleeper_only_when_asked_and_the_queue_is_deep() {
    for when_busy in [false, true] {
        let mut h = H::new(WakeConfig {
            when_busy,
            queue_depth: 1,
            ..WakeConfig::default()
        });
        h.join(2, "gpu", &["m"], true);
        h.leave(2);
        h.join(1, "awake", &["m"], false);
        h.submit(10, "m", false); // runs on the awake worker
        let first = h.submit(11, "m", false); // one waits: not deeper than 1
        assert!(wake_peers(&first).is_empty());
        let second = h.submit(12, "m", false); // two wait
        assert_eq!(wake_peers(&second).len(), usize::from(when_busy));
    }
}

#[test]
fn sleep_is_refused_to_the_last_worker_of_a_model_with_requests_waiting() {
    let mut h = H::new(WakeConfig::default());
    h.join(1, "gpu", &["m"], true);
    h.submit(10, "m", false); // in flight
    h.submit(11, "m", false); // queued
    assert!(h.ask_sleep(1).is_err_and(|r| r.contains("`m`")));
    // Without a wake address the relay could never wake it.
    h.join(2, "plain", &["x"], false);
    let a =
        h.d.handle(Event::WorkerSaid(2, WorkerMessage::SleepRequest {}), h.now);
    assert!(matches!(
        &a[..],
        [Action::ToWorker(
            2,
            ServerMessage::SleepAnswer { granted: false, .. }
        )]
    ));
    // An idle box with nothing waiting may: it takes nothing new, and sleeps on leaving.
    h.join(3, "idle", &["n"], true);
    let a =
        h.d.handle(Event::WorkerSaid(3, WorkerMessage::SleepRequest {}), h.now);
    assert_eq!(
        a,
        vec![Action::ToWorker(
            3,
            ServerMessage::SleepAnswer {
                granted: true,
                reason: None
            }
        )]
    );
    assert!(h.d.registry().get(3).unwrap().is_draining());
    h.leave(3);
    assert!(h.d.sleepers().records().iter().any(|r| r.name == "idle"));
}

#[test]
fn restored_sleepers_make_their_models_known_and_wakeable() {
    let mut h = H::new(WakeConfig {
        from_relay: true,
        ..WakeConfig::default()
    });
    let record = SleeperRecord {
        name: "gpu".into(),
        models: vec!["m".into()],
        wake: wake_addr(),
        since_unix: 1,
        slept_secs: 0,
    };
    let saved = SavedPower {
        boxes: vec![record],
        ..SavedPower::default()
    };
    h.d.restore_sleepers(saved, h.now);
    h.at(1000);
    let a = h.submit(10, "m", false);
    assert!(a.contains(&Action::SendWake("gpu".into(), wake_addr())));
    assert!(failures(&a).is_empty(), "not a model_not_found");
}

#[test]
fn a_worker_pinned_awake_is_never_granted_sleep() {
    let mut h = H::new(WakeConfig::default());
    h.join(1, "gpu", &["m"], true);
    assert!(h.d.stay_awake(1, true));
    assert!(!h.d.stay_awake(9, true), "unknown worker");
    let a =
        h.d.handle(Event::WorkerSaid(1, WorkerMessage::SleepRequest {}), h.now);
    assert!(matches!(
        &a[..],
        [Action::ToWorker(1, ServerMessage::SleepAnswer { granted: false, reason: Some(r) })] if r.contains("pinned")
    ));
    assert!(h.d.stay_awake(1, false));
    let a =
        h.d.handle(Event::WorkerSaid(1, WorkerMessage::SleepRequest {}), h.now);
    assert!(matches!(
        &a[..],
        [Action::ToWorker(
            1,
            ServerMessage::SleepAnswer { granted: true, .. }
        )]
    ));
}

#[test]
fn a_worker_yielded_to_its_owner_takes_nothing_new_until_the_owner_is_done() {
    let mut h = H::new(WakeConfig::default());
    h.join(1, "gpu", &["m"], false);
    let busy = |b| Event::WorkerSaid(1, WorkerMessage::OwnerStatus { busy: b });
    h.d.handle(busy(true), h.now);
    assert!(h.d.registry().get(1).unwrap().yielded.is_some());
    let a = h.submit(10, "m", false);
    assert!(dispatched(&a).is_empty(), "queued, not sent: {a:?}");
    assert!(failures(&a).is_empty());
    h.at(5);
    let a = h.d.handle(busy(false), h.now);
    assert_eq!(dispatched(&a), vec![(1, wire_request_id(10))]);
}

#[test]
fn the_models_of_sleeping_boxes_are_listed_for_clients() {
    let mut h = H::new(WakeConfig::default());
    h.join(1, "nas", &["small"], false);
    h.join(2, "gpu", &["m", "small"], true);
    let v = h.d.models_version();
    h.leave(2);
    assert_ne!(h.d.models_version(), v, "the list is published again");
    assert_eq!(
        h.d.listed_models(),
        vec!["small".to_string(), "m".to_string()]
    );
    assert_eq!(h.d.registry().routable_models(), vec!["small".to_string()]);
    let v = h.d.models_version();
    h.join(3, "gpu", &["m"], true);
    assert_ne!(h.d.models_version(), v);
    assert_eq!(
        h.d.listed_models(),
        vec!["small".to_string(), "m".to_string()]
    );
}

/// An awake worker `awake` (one slot) and the sleeping box `gpu`, both for `m`, with
/// `WAKE_WHEN_BUSY`: 10 runs, 11 and 12 wait and wake the box (more than one waits).
fn busy_with_a_sleeper() -> H {
    let mut h = H::new(WakeConfig {
        when_busy: true,
        queue_depth: 1,
        timeout: Duration::from_secs(120),
        ..WakeConfig::default()
    });
    h.join(2, "gpu", &["m"], true);
    h.leave(2);
    h.join(1, "awake", &["m"], false);
    assert_eq!(dispatched(&h.submit(10, "m", false)).len(), 1);
    assert!(wake_peers(&h.submit(11, "m", false)).is_empty());
    assert_eq!(
        wake_peers(&h.submit(12, "m", true)),
        vec![(1, "gpu".to_string())]
    );
    h
}

#[test]
fn requests_that_woke_a_box_for_busy_workers_wait_the_wake_timeout() {
    let mut h = busy_with_a_sleeper();
    h.at(5);
    // Later ones wait for the same wake: no second one.
    assert!(wake_peers(&h.submit(13, "m", false)).is_empty());
    // Past the 30 s queue timeout they all still wait, and hear about the box.
    h.at(31);
    let a = h.tick();
    assert!(failures(&a).is_empty(), "{a:?}");
    assert!(a.contains(&Action::ToClient(
        12,
        ClientEvent::Waking {
            worker: "gpu".into()
        }
    )));
    // The box comes: the first in line goes to it.
    h.at(60);
    let a = h.join(4, "gpu", &["m"], true);
    assert_eq!(dispatched(&a), vec![(4, wire_request_id(11))]);
    // The others time out at the wake timeout as any queued request would: awake
    // workers serve their model, no box is to blame.
    h.at(119);
    assert!(failures(&h.tick()).is_empty());
    h.at(120);
    let f = failures(&h.tick());
    assert_eq!(f.len(), 2, "{f:?}");
    assert!(f.iter().all(|(_, x)| *x == Failure::QueueTimeout), "{f:?}");
}

#[test]
fn a_box_woken_for_busy_workers_that_never_comes_fails_nobody_by_name() {
    let mut h = busy_with_a_sleeper();
    h.at(119);
    assert!(failures(&h.tick()).is_empty());
    h.at(120);
    let f = failures(&h.tick());
    let ids: Vec<RequestId> = f.iter().map(|(id, _)| *id).collect();
    assert_eq!(ids.len(), 2, "{f:?}");
    assert!(ids.contains(&11) && ids.contains(&12));
    assert!(f.iter().all(|(_, x)| *x == Failure::QueueTimeout), "{f:?}");
}

#[test]
fn an_operators_pin_outlives_a_reconnect_and_a_restart() {
    let mut h = H::new(WakeConfig::default());
    h.join(1, "gpu", &["m"], true);
    let v = h.d.sleepers().version();
    assert!(h.d.stay_awake(1, true));
    assert_ne!(h.d.sleepers().version(), v, "the pin is saved");
    h.leave(1);
    h.join(2, "gpu", &["m"], true);
    assert!(h.d.registry().get(2).unwrap().stay_awake);
    assert!(h.ask_sleep(2).is_err_and(|r| r.contains("pinned")));
    // Another name is not pinned.
    h.join(3, "other", &["m"], true);
    assert!(!h.d.registry().get(3).unwrap().stay_awake);
    // A restarted relay keeps it.
    let saved = h.d.sleepers().saved();
    assert_eq!(saved.pinned, vec!["gpu".to_string()]);
    let mut h2 = H::new(WakeConfig::default());
    h2.d.restore_sleepers(saved, h2.now);
    h2.join(1, "gpu", &["m"], true);
    assert!(h2.d.registry().get(1).unwrap().stay_awake);
    // Unpinned, it stays unpinned after a reconnect.
    assert!(h.d.stay_awake(2, false));
    h.leave(2);
    h.join(4, "gpu", &["m"], true);
    assert!(!h.d.registry().get(4).unwrap().stay_awake);
}

#[test]
fn the_time_asleep_adds_up_over_sleeps() {
    let mut h = H::new(WakeConfig::default());
    let now_unix = unix_ms().unwrap() / 1000;
    let record = SleeperRecord {
        name: "gpu".into(),
        models: vec!["m".into()],
        wake: wake_addr(),
        since_unix: now_unix - 3600,
        slept_secs: 7200,
    };
    let saved = SavedPower {
        boxes: vec![record],
        ..SavedPower::default()
    };
    h.d.restore_sleepers(saved, h.now);
    // It wakes: three hours asleep in all, kept while it is awake (and saved).
    h.join(1, "gpu", &["m"], true);
    let slept = h.d.sleepers().slept_secs("gpu");
    assert!((10_800..10_900).contains(&slept), "{slept}");
    assert_eq!(h.d.sleepers().saved().slept_secs.get("gpu"), Some(&slept));
    // Asleep again: the new sleep starts from there.
    h.leave(1);
    let records = h.d.sleepers().records();
    assert_eq!(records[0].slept_secs, slept);
    assert_eq!(h.d.sleepers().slept_secs("gpu"), 0, "moved into the record");
}
