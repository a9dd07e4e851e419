//! The actions' hand-over to the runtime: appended to its buffer, in order, and the room
//! a burst took given back.

use super::*;

#[test]
fn actions_are_appended_after_those_already_in_the_buffer() {
    let mut h = Harness::new();
    h.join(1, &["m"], 4);
    let mut out = h.submit(1, "m");
    let first = out.len();
    assert!(first > 0, "a dispatch has actions");
    h.d.handle_into(Event::ClientGone(1), h.now, &mut out);
    assert!(out.len() > first, "the cancel came after the dispatch");
    assert!(matches!(
        out[0],
        Action::ToWorker(1, ServerMessage::Request(_))
    ));
    assert!(out[first..]
        .iter()
        .any(|a| matches!(a, Action::ToWorker(1, ServerMessage::Cancel { .. }))));
}

#[test]
fn a_burst_of_actions_leaves_no_large_buffer_behind() {
    let mut actions: Vec<Action> = Vec::with_capacity(10_000);
    shrink_after_burst(&mut actions);
    assert!(actions.capacity() <= KEPT_ACTIONS);
    let mut ordinary: Vec<Action> = Vec::with_capacity(16);
    shrink_after_burst(&mut ordinary);
    assert_eq!(ordinary.capacity(), 16, "an ordinary buffer keeps its room");
}
