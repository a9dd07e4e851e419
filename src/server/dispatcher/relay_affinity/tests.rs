//! Cache affinity across relays in the dispatcher (fake clock): the prefixes a worker is
//! told before a request, and the reports of other relays steering later turns.

use std::time::Instant;

use super::*;
use crate::protocol::{RegisterMessage, ResponseComplete, WorkerMessage};
use crate::server::dispatcher::tests::{chat_submit, dispatched};
use crate::server::dispatcher::{wire_request_id, Config, Event};
use crate::server::fingerprint::Fingerprints;

struct Harness {
    d: Dispatcher,
    now: Instant,
}

impl Harness {
    fn new(affinity: bool) -> Harness {
        let now = Instant::now();
        let cfg = Config {
            affinity,
            ..Config::default()
        };
        Harness {
            d: Dispatcher::new(cfg, now),
            now,
        }
    }

    /// A worker with one slot; `multi`: it serves several relays and passes prefixes on.
    fn join(&mut self, id: WorkerId, multi: bool) {
        let features = if multi {
            vec![FEATURE_AFFINITY_REPORTS.into()]
        } else {
            vec![]
        };
        let register = RegisterMessage {
            worker_name: format!("box-{id}"),
            models: vec!["m".into(), "n".into()],
            max_concurrent: 1,
            protocol_version: Some("1".into()),
            current_load: Some(0),
            features,
            loaded_models: None,
            backend_kind: None,
            model_info: None,
            wake: None,
            routes: None,
        };
        let remote = "127.0.0.1:1".into();
        let joined = Event::WorkerJoined {
            id,
            register,
            remote,
        };
        self.d.handle(joined, self.now);
    }

    fn submit(&mut self, id: RequestId, model: &str, prints: &[u64]) -> Vec<Action> {
        let event = chat_submit(id, model, Fingerprints::Prefixes(prints.into()));
        self.d.handle(event, self.now)
    }

    /// Submits, answers, and says which worker ran it.
    fn run(&mut self, id: RequestId, model: &str, prints: &[u64]) -> WorkerId {
        let went = dispatched(&self.submit(id, model, prints));
        let [(_, w)] = went[..] else {
            panic!("request {id} went to {went:?}");
        };
        let rc = ResponseComplete {
            request_id: wire_request_id(id),
            status_code: 200,
            ..Default::default()
        };
        let done = Event::WorkerSaid(w, WorkerMessage::ResponseComplete(rc));
        self.d.handle(done, self.now);
        w
    }

    /// Worker `w` reports that another relay sent it these prefixes (longest first).
    fn reports(&mut self, w: WorkerId, model: &str, prefixes: &[u64]) {
        let note = PrefixNote {
            model: model.into(),
            prefixes: prefixes.to_vec(),
        };
        self.d.handle(
            Event::WorkerSaid(w, WorkerMessage::Prefixes(note)),
            self.now,
        );
    }
}

/// The notes and requests sent, in order: `(worker, Some(prefixes))` for a note,
/// `(worker, None)` for a request.
fn sent(actions: &[Action]) -> Vec<(WorkerId, Option<Vec<u64>>)> {
    actions
        .iter()
        .filter_map(|a| match a {
            Action::ToWorker(w, ServerMessage::Prefixes(n)) => Some((*w, Some(n.prefixes.clone()))),
            Action::ToWorker(w, ServerMessage::Request(_)) => Some((*w, None)),
            _ => None,
        })
        .collect()
}

#[test]
fn only_a_worker_serving_several_relays_is_told_the_prefixes_just_before_the_request() {
    let mut h = Harness::new(true);
    h.join(1, true);
    h.join(2, false);
    // Two conversations, one on each worker (the same one would wait for its worker).
    let mut seen = sent(&h.submit(1, "m", &[1, 2, 3, 4, 5]));
    seen.extend(sent(&h.submit(2, "m", &[11, 12, 13, 14, 15])));
    seen.sort_by_key(|(w, _)| *w);
    assert_eq!(
        seen,
        vec![(1, Some(vec![5, 4, 3, 1])), (1, None), (2, None)],
        "worker 1 gets the note (longest first, then the shortest) before its request"
    );
    // No prompt worth a fingerprint: no note.
    let mut h = Harness::new(true);
    h.join(1, true);
    assert_eq!(sent(&h.submit(1, "m", &[])), vec![(1, None)]);
}

#[test]
fn a_later_turn_goes_to_the_worker_another_relay_sent_the_conversation_to() {
    let mut h = Harness::new(true);
    h.join(1, true);
    h.join(2, true);
    // Conversation A ran on worker 2 and B on worker 1, both through other relays.
    h.reports(2, "m", &[102, 101]);
    h.reports(1, "m", &[202, 201]);
    // Their next turns repeat the prompts so far: each goes home, turn after turn
    // (round robin alone would alternate).
    assert_eq!(h.run(1, "m", &[101, 102, 103]), 2);
    assert_eq!(h.run(2, "m", &[101, 102, 103, 104]), 2);
    assert_eq!(h.run(3, "m", &[201, 202, 203]), 1);
    assert_eq!(h.run(4, "m", &[201, 202, 203, 204]), 1);
    assert_eq!(h.d.counters().affinity_hits, 4);
    // A report is per model: the same prefixes for another model steer nothing.
    h.reports(1, "n", &[302, 301]);
    let before = h.d.counters().affinity_misses;
    h.run(5, "m", &[301, 302, 303]);
    assert_eq!(h.d.counters().affinity_misses, before + 1);
}

#[test]
fn with_affinity_off_nothing_is_told_or_learned() {
    let mut h = Harness::new(false);
    h.join(1, true);
    h.reports(1, "m", &[2, 1]);
    assert_eq!(h.d.affinity.held(1), 0);
    assert_eq!(sent(&h.submit(1, "m", &[1, 2])), vec![(1, None)]);
}

#[test]
fn a_report_from_an_unknown_worker_or_an_oversized_one_is_bounded() {
    let mut h = Harness::new(true);
    h.reports(9, "m", &[1]);
    assert_eq!(h.d.affinity.held(9), 0);
    h.join(1, true);
    let many: Vec<u64> = (0..100).collect();
    h.reports(1, "m", &many);
    assert_eq!(h.d.affinity.held(1), MAX_PREFIXES);
}
