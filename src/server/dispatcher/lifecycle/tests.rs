//! Model operations in the dispatcher, with the fake clock: who runs them, how their
//! reports end the task, timeouts, disconnects, and routing seeing a load at once.

use std::time::{Duration, Instant};

use super::*;
use crate::protocol::lifecycle::FEATURE_LIFECYCLE;
use crate::protocol::{RegisterMessage, WorkerMessage};
use crate::server::dispatcher::{Config, Event};

const MIN: Duration = Duration::from_secs(60);

fn dispatcher() -> (Dispatcher, Instant) {
    let t0 = Instant::now();
    (Dispatcher::new(Config::default(), t0), t0)
}

fn join(
    d: &mut Dispatcher,
    id: WorkerId,
    models: &[&str],
    loaded: &[&str],
    ops: bool,
    now: Instant,
) {
    let register = RegisterMessage {
        worker_name: format!("box-{id}"),
        models: models.iter().map(|m| m.to_string()).collect(),
        max_concurrent: 4,
        protocol_version: Some("1".into()),
        current_load: Some(0),
        features: if ops {
            vec![FEATURE_LIFECYCLE.into()]
        } else {
            vec![]
        },
        loaded_models: Some(loaded.iter().map(|m| m.to_string()).collect()),
        backend_kind: Some("ollama".into()),
        model_info: None,
        wake: None,
        routes: None,
    };
    d.handle(
        Event::WorkerJoined {
            id,
            register,
            remote: "127.0.0.1:1".into(),
        },
        now,
    );
}

fn op(kind: OperationKind, model: Option<&str>, runner: Option<&str>) -> OperationRequest {
    OperationRequest {
        kind,
        model: model.map(String::from),
        runner: runner.map(String::from),
    }
}

/// The `model_operation`s sent: (worker, operation id, kind, model).
fn sent(actions: &[Action]) -> Vec<(WorkerId, String, OperationKind, Option<String>)> {
    actions
        .iter()
        .filter_map(|a| match a {
            Action::ToWorker(w, ServerMessage::ModelOperation(o)) => {
                Some((*w, o.operation_id.clone(), o.operation, o.model.clone()))
            }
            _ => None,
        })
        .collect()
}

fn report(d: &mut Dispatcher, w: WorkerId, id: &str, status: OperationState, now: Instant) {
    let msg = WorkerMessage::OperationStatus(OperationStatus {
        operation_id: id.into(),
        status,
        progress: Some(400),
        message: Some(format!("{status:?}")),
        backend: Some("ollama".into()),
    });
    d.handle(Event::WorkerSaid(w, msg), now);
}

#[test]
fn a_load_goes_to_the_runner_without_the_model_and_routing_prefers_it_once_done() {
    let (mut d, t0) = dispatcher();
    join(&mut d, 1, &["m"], &["m"], true, t0);
    join(&mut d, 2, &["m"], &[], true, t0);
    let task = d
        .start_operation(op(OperationKind::Load, Some("m"), None), MIN, t0)
        .expect("started");
    assert_eq!(task.status, "running");
    let ops = sent(&d.tick(t0));
    assert_eq!(ops.len(), 1);
    assert_eq!((ops[0].0, ops[0].2), (2, OperationKind::Load));
    report(&mut d, 2, &ops[0].1, OperationState::Running, t0 + MIN / 4);
    let view = d.task(&task.task_id, t0 + MIN / 4).expect("task");
    assert_eq!(view.status, "running");
    assert!((view.progress - 0.4).abs() < 1e-9);
    assert_eq!(view.eta_secs, Some(23), "15 s for 40 % leaves ~22.5 s");
    assert_eq!(d.loading(t0).len(), 1);
    assert!(!d.registry().get(2).expect("w2").has_loaded("m"));
    report(
        &mut d,
        2,
        &ops[0].1,
        OperationState::Completed,
        t0 + MIN / 2,
    );
    let view = d.task(&task.task_id, t0 + MIN).expect("task");
    assert_eq!(view.status, "completed");
    assert_eq!(view.elapsed_ms, 30_000, "elapsed stops at the end");
    assert!(
        d.registry().get(2).expect("w2").has_loaded("m"),
        "routing sees the load at once"
    );
    assert!(d.loading(t0).is_empty());
}

#[test]
fn a_model_loaded_everywhere_completes_at_once_and_unknown_models_are_refused() {
    let (mut d, t0) = dispatcher();
    join(&mut d, 1, &["m"], &["m"], true, t0);
    let task = d
        .start_operation(op(OperationKind::Load, Some("m"), None), MIN, t0)
        .expect("ok");
    assert_eq!(task.status, "completed");
    assert!(sent(&d.tick(t0)).is_empty());
    let e = d.start_operation(op(OperationKind::Load, Some("nope"), None), MIN, t0);
    assert_eq!(e.err().map(|r| r.code()), Some("model_not_found"));
    let e = d.start_operation(op(OperationKind::Load, Some("m"), Some("ghost")), MIN, t0);
    assert_eq!(e.err().map(|r| r.code()), Some("runner_not_found"));
}

#[test]
fn workers_without_the_extension_get_not_supported_naming_them() {
    let (mut d, t0) = dispatcher();
    join(&mut d, 1, &["m"], &[], false, t0);
    let e = d
        .start_operation(op(OperationKind::Unload, Some("m"), None), MIN, t0)
        .expect_err("refused");
    assert_eq!(e.status(), 501);
    assert!(e.message().contains("box-1 (ollama)"), "{}", e.message());
}

#[test]
fn unload_goes_to_every_holder_and_one_failure_fails_the_task() {
    let (mut d, t0) = dispatcher();
    join(&mut d, 1, &["m"], &["m"], true, t0);
    join(&mut d, 2, &["m"], &["m"], true, t0);
    join(&mut d, 3, &["m"], &[], true, t0);
    let task = d
        .start_operation(op(OperationKind::Unload, Some("m"), None), MIN, t0)
        .expect("ok");
    let ops = sent(&d.tick(t0));
    assert_eq!(ops.iter().map(|o| o.0).collect::<Vec<_>>(), [1, 2]);
    report(&mut d, 1, &ops[0].1, OperationState::Completed, t0);
    assert_eq!(d.task(&task.task_id, t0).map(|t| t.status), Some("running"));
    report(&mut d, 2, &ops[1].1, OperationState::Failed, t0);
    let view = d.task(&task.task_id, t0).expect("task");
    assert_eq!(view.status, "failed");
    assert_eq!(view.parts[1].status, "failed");
    assert!(!d.registry().get(1).expect("w1").has_loaded("m"));
    assert!(d.registry().get(2).expect("w2").has_loaded("m"));
}

#[test]
fn a_silent_runner_times_out_and_a_lost_one_fails_its_part() {
    let (mut d, t0) = dispatcher();
    join(&mut d, 1, &["m"], &[], true, t0);
    join(&mut d, 2, &["m"], &[], true, t0);
    let flush = d
        .start_operation(op(OperationKind::Flush, None, None), MIN, t0)
        .expect("ok");
    let ops = sent(&d.tick(t0));
    assert_eq!(ops.len(), 2);
    assert_eq!(ops[0].3, None, "a flush of everything names no model");
    report(&mut d, 1, &ops[0].1, OperationState::Completed, t0);
    d.handle(
        Event::WorkerLeft {
            id: 2,
            reason: "gone".into(),
        },
        t0 + MIN / 2,
    );
    let view = d.task(&flush.task_id, t0 + MIN / 2).expect("task");
    assert_eq!(view.status, "failed");
    assert_eq!(
        view.parts[1].message.as_deref(),
        Some("the runner disconnected")
    );

    join(&mut d, 3, &["x"], &[], true, t0);
    let limit = Duration::from_secs(20);
    let load = d
        .start_operation(op(OperationKind::Load, Some("x"), None), limit, t0)
        .expect("ok");
    d.tick(t0 + limit / 2);
    assert_eq!(
        d.task(&load.task_id, t0 + limit / 2).map(|t| t.status),
        Some("running")
    );
    d.tick(t0 + limit);
    let view = d.task(&load.task_id, t0 + limit).expect("task");
    assert_eq!(view.status, "failed");
    let message = view.parts[0].message.clone().unwrap_or_default();
    assert!(message.contains("within 20s"), "{message}");
}

#[test]
fn reports_for_other_workers_or_unknown_operations_change_nothing() {
    let (mut d, t0) = dispatcher();
    join(&mut d, 1, &["m"], &[], true, t0);
    join(&mut d, 2, &["z"], &[], true, t0);
    let task = d
        .start_operation(op(OperationKind::Load, Some("m"), None), MIN, t0)
        .expect("ok");
    let ops = sent(&d.tick(t0));
    report(&mut d, 2, &ops[0].1, OperationState::Completed, t0);
    report(&mut d, 1, "load-999.0", OperationState::Completed, t0);
    assert_eq!(d.task(&task.task_id, t0).map(|t| t.status), Some("running"));
    assert_eq!(d.task("unload-1", t0), None, "the kind is part of the id");
}
