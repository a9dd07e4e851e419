//! Resumes of worker-held streams in the dispatcher (fake clock): who is asked, whose
//! answer reaches the client, and what a leaving client or worker ends.

use std::sync::Arc;
use std::time::Instant;

use super::*;
use crate::protocol::ResponseComplete;
use crate::server::dispatcher::tests::{cancels, chat_submit, dispatched, register};
use crate::server::dispatcher::{wire_request_id, Config, Event};

struct Harness {
    d: Dispatcher,
    now: Instant,
}

impl Harness {
    fn new() -> Harness {
        let now = Instant::now();
        Harness {
            d: Dispatcher::new(Config::default(), now),
            now,
        }
    }

    /// A worker serving `m`; `holds`: it lists `held_streams`.
    fn join(&mut self, id: WorkerId, holds: bool) {
        let features: &[&str] = if holds { &[FEATURE_HELD_STREAMS] } else { &[] };
        let register = register(id, &["m"], 1, features);
        let remote = "127.0.0.1:1".into();
        self.ev(Event::WorkerJoined {
            id,
            register,
            remote,
        });
    }

    fn ev(&mut self, event: Event) -> Vec<Action> {
        self.d.handle(event, self.now)
    }

    fn attach(&mut self, id: RequestId) -> Vec<Action> {
        let msg = Attach {
            request_id: wire_request_id(id),
            stream_id: "r-0123456789abcdef".into(),
            after: 3,
            proof: "p".into(),
        };
        self.ev(Event::Attach { id, msg })
    }

    fn said(&mut self, worker: WorkerId, msg: WorkerMessage) -> Vec<Action> {
        self.ev(Event::WorkerSaid(worker, msg))
    }
}

fn error(id: RequestId, code: &str) -> WorkerMessage {
    WorkerMessage::Error {
        request_id: Some(wire_request_id(id)),
        code: code.into(),
        message: "m".into(),
        status_code: Some(404),
        retryable: None,
        headers: Default::default(),
        body: None,
    }
}

fn chunk(id: RequestId, text: &str) -> WorkerMessage {
    WorkerMessage::ResponseChunk {
        request_id: wire_request_id(id),
        chunk: text.into(),
    }
}

fn asked(actions: &[Action]) -> Vec<WorkerId> {
    actions
        .iter()
        .filter_map(|a| match a {
            Action::ToWorker(w, ServerMessage::Attach(_)) => Some(*w),
            _ => None,
        })
        .collect()
}

fn to_client(actions: &[Action]) -> Vec<(RequestId, ClientEvent)> {
    actions
        .iter()
        .filter_map(|a| match a {
            Action::ToClient(id, e) => Some((*id, e.clone())),
            _ => None,
        })
        .collect()
}

fn cancelled(actions: &[Action]) -> Vec<WorkerId> {
    cancels(actions).into_iter().map(|(w, _, _)| w).collect()
}

#[test]
fn only_workers_that_hold_streams_are_asked_and_none_means_not_held() {
    let mut h = Harness::new();
    assert_eq!(to_client(&h.attach(1)), vec![(1, not_held())]);
    h.join(1, false);
    h.join(2, true);
    h.join(3, true);
    assert_eq!(asked(&h.attach(2)), vec![2, 3]);
    // Both say no: the client hears it once, after the last.
    assert!(to_client(&h.said(3, error(2, NOT_HELD))).is_empty());
    assert_eq!(
        to_client(&h.said(2, error(2, NOT_HELD))),
        vec![(2, not_held())]
    );
    assert!(h.d.attaches.is_empty());
}

#[test]
fn the_holder_streams_to_the_client_and_others_are_not_heard() {
    let mut h = Harness::new();
    h.join(1, true);
    h.join(2, true);
    h.attach(5);
    let got = to_client(&h.said(2, chunk(5, "id: 4\ndata: x\n\n")));
    assert_eq!(
        got,
        vec![(5, ClientEvent::Chunk("id: 4\ndata: x\n\n".into()))]
    );
    // A late no from the other worker changes nothing.
    assert!(to_client(&h.said(1, error(5, NOT_HELD))).is_empty());
    let done = ResponseComplete {
        request_id: wire_request_id(5),
        status_code: 200,
        ..Default::default()
    };
    let got = to_client(&h.said(2, WorkerMessage::ResponseComplete(done.clone())));
    assert_eq!(got, vec![(5, ClientEvent::Complete(done))]);
    assert!(h.d.attaches.is_empty());
}

#[test]
fn a_leaving_client_detaches_at_the_holder_and_a_leaving_holder_fails_the_resume() {
    let mut h = Harness::new();
    h.join(1, true);
    h.join(2, true);
    h.attach(7);
    h.said(1, chunk(7, "id: 4\n\n"));
    // The client leaves: only the holder is told, and no request was touched.
    let out = h.ev(Event::ClientGone(7));
    assert_eq!(cancelled(&out), vec![1]);
    assert!(h.d.attaches.is_empty());
    h.attach(8);
    h.said(2, chunk(8, "id: 4\n\n"));
    let out = h.ev(Event::WorkerLeft {
        id: 2,
        reason: "gone".into(),
    });
    assert_eq!(
        to_client(&out),
        vec![(8, ClientEvent::Failed(Failure::WorkerLost))]
    );
    // Asked, not answered, the only worker left: not held.
    h.attach(9);
    let out = h.ev(Event::WorkerLeft {
        id: 1,
        reason: "gone".into(),
    });
    assert_eq!(to_client(&out), vec![(9, not_held())]);
}

#[test]
fn the_held_field_reaches_only_workers_that_listed_the_feature() {
    let mut h = Harness::new();
    h.join(1, false);
    // A streamed chat as a relay marks it when the client asked for a resumable one.
    let submit = |id: RequestId| {
        let mut event = chat_submit(id, "m", Default::default());
        if let Event::Submit { msg, .. } = &mut event {
            Arc::make_mut(msg).held = Some(crate::protocol::held::Hold {
                grace_secs: 30,
                proof: "p".into(),
            });
        }
        event
    };
    let sent = |actions: &[Action]| {
        actions.iter().find_map(|a| match a {
            Action::ToWorker(_, ServerMessage::Request(m)) => Some(m.held.is_some()),
            _ => None,
        })
    };
    let out = h.ev(submit(1));
    assert_eq!(dispatched(&out), vec![(1, 1)]);
    assert_eq!(sent(&out), Some(false));
    h.join(2, true);
    let out = h.ev(submit(2));
    assert_eq!(dispatched(&out), vec![(2, 2)]);
    assert_eq!(sent(&out), Some(true));
}
