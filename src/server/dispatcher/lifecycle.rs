//! Model operations (load, unload, flush) as dispatcher tasks: which workers run one, the
//! `model_operation` messages sent to them, their `operation_status` reports, and the
//! timeout that fails a worker that never answers. A finished load or unload changes the
//! worker's loaded set at once, so routing sees it before the worker's own
//! `models_update`.
//!
//! Choosing workers is policy and lives here, tested with the fake clock:
//! - load: the named runner, else the workers that advertise the model and run
//!   operations, preferring one that does not hold it yet, then the most free capacity;
//! - unload: the named runner, else every operating worker holding the model (or
//!   advertising it, when it does not say what it holds);
//! - flush: the named runner, else every operating worker advertising the model, or all
//!   of them for a flush without a model.

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

use log::{info, warn};

use super::ids::IdMap;
use super::registry::{Worker, WorkerId};
use super::{Action, Dispatcher, Timer};
use crate::protocol::lifecycle::{ModelOperation, OperationKind, OperationState, OperationStatus};
use crate::protocol::ServerMessage;

/// Finished tasks kept for polling; the oldest goes first.
const FINISHED_KEPT: usize = 256;
/// Tasks running at once; more are refused (a client looping on load).
const MAX_RUNNING: usize = 64;

/// What an operator asked for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OperationRequest {
    pub kind: OperationKind,
    pub model: Option<String>,
    /// A worker name (`runnerId`): only that worker.
    pub runner: Option<String>,
}

/// Why an operation could not start.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OpRefusal {
    RunnerNotFound(String),
    ModelNotFound(String),
    /// The workers that could run it do not support operations (named, with backend).
    NotSupported(String),
    TooManyTasks,
    /// Every runner that could do it is draining.
    Unavailable(String),
    ShuttingDown,
}

impl OpRefusal {
    pub fn status(&self) -> u16 {
        match self {
            OpRefusal::RunnerNotFound(_) | OpRefusal::ModelNotFound(_) => 404,
            OpRefusal::NotSupported(_) => 501,
            OpRefusal::TooManyTasks => 429,
            OpRefusal::Unavailable(_) | OpRefusal::ShuttingDown => 503,
        }
    }

    pub fn code(&self) -> &'static str {
        match self {
            OpRefusal::RunnerNotFound(_) => "runner_not_found",
            OpRefusal::ModelNotFound(_) => "model_not_found",
            OpRefusal::NotSupported(_) => "not_supported",
            OpRefusal::TooManyTasks => "too_many_operations",
            OpRefusal::Unavailable(_) => "no_runner_available",
            OpRefusal::ShuttingDown => "shutting_down",
        }
    }

    pub fn message(&self) -> String {
        match self {
            OpRefusal::RunnerNotFound(r) => format!("no connected runner is named {r:?}"),
            OpRefusal::ModelNotFound(m) => {
                format!("no runner advertises {m:?} (name a runner to have it fetch the model)")
            }
            OpRefusal::NotSupported(why) => why.clone(),
            OpRefusal::TooManyTasks => format!("{MAX_RUNNING} model operations are running"),
            OpRefusal::Unavailable(m) => format!("every runner that advertises {m:?} is draining"),
            OpRefusal::ShuttingDown => "the relay is shutting down".into(),
        }
    }
}

/// One worker's share of a task.
#[derive(Debug, Clone, PartialEq)]
pub struct PartView {
    pub runner: String,
    /// `pending` (sent, no report yet), or an [`OperationState`] name.
    pub status: &'static str,
    pub progress: f64,
    pub message: Option<String>,
    pub backend: Option<String>,
}

/// A task as `GET /v1/models/load/{taskId}` shows it.
#[derive(Debug, Clone, PartialEq)]
pub struct TaskView {
    pub task_id: String,
    pub operation: OperationKind,
    pub model: Option<String>,
    /// `running`, `completed`, `failed` or `not_supported` (see [`Task::status`]).
    pub status: &'static str,
    pub progress: f64,
    /// Seconds left, estimated from progress so far; `None` before any progress.
    pub eta_secs: Option<u64>,
    pub elapsed_ms: u64,
    pub parts: Vec<PartView>,
}

#[derive(Debug)]
struct Part {
    worker: WorkerId,
    runner: String,
    /// `None` until the worker's first report.
    state: Option<OperationState>,
    permille: u16,
    message: Option<String>,
    backend: Option<String>,
}

#[derive(Debug)]
struct Task {
    kind: OperationKind,
    model: Option<String>,
    started: Instant,
    finished: Option<Instant>,
    parts: Vec<Part>,
}

impl Task {
    /// Running while any part runs; then failed if any failed, not_supported if every
    /// part was, else completed (a task with no parts had nothing to do).
    fn status(&self) -> &'static str {
        let states: Vec<Option<OperationState>> = self.parts.iter().map(|p| p.state).collect();
        if states.iter().any(|s| s.is_none_or(|s| !s.is_final())) {
            "running"
        } else if states.contains(&Some(OperationState::Failed)) {
            "failed"
        } else if !states.is_empty()
            && states
                .iter()
                .all(|s| *s == Some(OperationState::NotSupported))
        {
            "not_supported"
        } else if states.contains(&Some(OperationState::NotSupported)) {
            "failed"
        } else {
            "completed"
        }
    }

    fn permille(&self) -> u16 {
        if self.parts.is_empty() {
            return 1000;
        }
        let sum: u32 = self
            .parts
            .iter()
            .map(|p| {
                if p.state.is_some_and(|s| s.is_final()) {
                    1000
                } else {
                    u32::from(p.permille)
                }
            })
            .sum();
        (sum / self.parts.len() as u32) as u16
    }
}

/// Every task, by number; wire ids are `<operation>-<number>`.
#[derive(Debug, Default)]
pub struct Tasks {
    next: u64,
    tasks: IdMap<Task>,
    finished: VecDeque<u64>,
    /// Wire operation id → (task, part index).
    operations: HashMap<String, (u64, usize)>,
}

fn task_number(task_id: &str) -> Option<u64> {
    task_id.rsplit_once('-')?.1.parse().ok()
}

impl Dispatcher {
    /// Numbers this relay's tasks from `first` on: relays sharing a store start apart,
    /// so that a task id names one task across the fleet.
    pub fn number_tasks_from(&mut self, first: u64) {
        self.tasks.next = first;
    }

    /// Starts an operation: picks the workers, sends them `model_operation`, and arms
    /// the timeout. Answers the task as it stands.
    pub fn start_operation(
        &mut self,
        req: OperationRequest,
        timeout: Duration,
        now: Instant,
    ) -> Result<TaskView, OpRefusal> {
        if self.phase != super::Phase::Running {
            return Err(OpRefusal::ShuttingDown);
        }
        if self.tasks.tasks.len() - self.tasks.finished.len() >= MAX_RUNNING {
            return Err(OpRefusal::TooManyTasks);
        }
        let targets = self.targets(&req)?;
        self.tasks.next += 1;
        let number = self.tasks.next;
        let task_id = format!("{}-{number}", req.kind.as_str());
        let mut parts = Vec::new();
        for (i, id) in targets.into_iter().enumerate() {
            let Some(w) = self.registry.get(id) else {
                continue;
            };
            let operation_id = format!("{task_id}.{i}");
            self.tasks
                .operations
                .insert(operation_id.clone(), (number, i));
            parts.push(Part {
                worker: id,
                runner: w.name.clone(),
                state: None,
                permille: 0,
                message: None,
                backend: w.backend_kind.clone(),
            });
            self.actions.push(Action::ToWorker(
                id,
                ServerMessage::ModelOperation(ModelOperation {
                    operation_id,
                    operation: req.kind,
                    model: req.model.clone(),
                }),
            ));
        }
        let runners: Vec<&str> = parts.iter().map(|p| p.runner.as_str()).collect();
        info!(
            "model operation {task_id}: {} {} on {}",
            req.kind.as_str(),
            req.model.as_deref().unwrap_or("(all models)"),
            if runners.is_empty() {
                "no runner (nothing to do)".to_string()
            } else {
                runners.join(", ")
            }
        );
        let done = parts.is_empty();
        self.tasks.tasks.insert(
            number,
            Task {
                kind: req.kind,
                model: req.model,
                started: now,
                finished: None,
                parts,
            },
        );
        if done {
            self.task_finished(number, now);
        } else {
            self.timers.insert((now + timeout, Timer::Task(number)));
        }
        self.task(&task_id, now).ok_or(OpRefusal::ShuttingDown)
    }

    /// The workers an operation goes to, by the rules in the module docs.
    fn targets(&self, req: &OperationRequest) -> Result<Vec<WorkerId>, OpRefusal> {
        let model = req.model.as_deref();
        let named: Vec<&Worker> = match &req.runner {
            Some(r) => {
                let found: Vec<&Worker> = self.registry.iter().filter(|w| &w.name == r).collect();
                if found.is_empty() {
                    return Err(OpRefusal::RunnerNotFound(r.clone()));
                }
                found
            }
            None => self
                .registry
                .iter()
                .filter(|w| model.is_none_or(|m| w.serves(m)))
                .collect(),
        };
        if named.is_empty() {
            return match (req.kind, model) {
                (OperationKind::Load, Some(m)) => Err(OpRefusal::ModelNotFound(m.to_string())),
                _ => Ok(Vec::new()),
            };
        }
        let able: Vec<&Worker> = named
            .iter()
            .copied()
            .filter(|w| w.runs_operations())
            .collect();
        if able.is_empty() {
            return Err(OpRefusal::NotSupported(not_supported(&named, req.kind)));
        }
        Ok(match (req.kind, model) {
            (OperationKind::Load, Some(m)) => {
                let chosen = choose_loader(&able, m, req.runner.is_some());
                if chosen.is_empty() && !able.iter().any(|w| w.has_loaded(m)) {
                    return Err(OpRefusal::Unavailable(m.to_string()));
                }
                chosen
            }
            (OperationKind::Unload, Some(m)) => able
                .iter()
                .filter(|w| w.has_loaded(m) || w.loaded_models().is_none())
                .map(|w| w.id)
                .collect(),
            _ => able.iter().map(|w| w.id).collect(),
        })
    }

    /// A worker's `operation_status`.
    pub(super) fn operation_status(&mut self, worker: WorkerId, s: OperationStatus, now: Instant) {
        let Some(&(number, index)) = self.tasks.operations.get(&s.operation_id) else {
            return;
        };
        let Some(task) = self.tasks.tasks.get_mut(&number) else {
            return;
        };
        let (kind, model) = (task.kind, task.model.clone());
        let Some(part) = task.parts.get_mut(index).filter(|p| p.worker == worker) else {
            return;
        };
        if part.state.is_some_and(|st| st.is_final()) {
            return;
        }
        part.state = Some(s.status);
        part.permille = s.progress.unwrap_or(part.permille).min(1000);
        part.message = s.message.map(|mut m| {
            m.truncate(512);
            m
        });
        if s.backend.is_some() {
            part.backend = s.backend;
        }
        if !s.status.is_final() {
            return;
        }
        info!(
            "model operation {}: {} on {}{}",
            s.operation_id,
            s.status.as_str(),
            part.runner,
            part.message
                .as_deref()
                .map(|m| format!(": {m}"))
                .unwrap_or_default()
        );
        let running = task
            .parts
            .iter()
            .any(|p| p.state.is_none_or(|st| !st.is_final()));
        if s.status == OperationState::Completed {
            self.apply_loaded(worker, kind, model.as_deref());
        }
        if !running {
            self.task_finished(number, now);
        }
    }

    /// A completed load or unload changes what routing prefers, at once; an unload or a
    /// flush empties the caches affinity counted on.
    fn apply_loaded(&mut self, worker: WorkerId, kind: OperationKind, model: Option<&str>) {
        match (kind, model) {
            (OperationKind::Load, _) => {}
            (_, Some(m)) => self
                .affinity
                .forget_model(worker, super::affinity::model_key(m)),
            (_, None) => self.affinity.forget_worker(worker),
        }
        let (Some(model), Some(w)) = (model, self.registry.get_mut(worker)) else {
            return;
        };
        match kind {
            OperationKind::Load => w.set_model_loaded(model, true),
            OperationKind::Unload => w.set_model_loaded(model, false),
            OperationKind::Flush => return,
        }
        self.models_version += 1;
    }

    /// A task's timer fired: whatever still runs has failed.
    pub(super) fn task_timed_out(&mut self, number: u64, now: Instant) {
        let Some(task) = self.tasks.tasks.get_mut(&number) else {
            return;
        };
        if task.finished.is_some() {
            return;
        }
        let waited = now.saturating_duration_since(task.started).as_secs();
        for part in &mut task.parts {
            if part.state.is_none_or(|s| !s.is_final()) {
                warn!(
                    "model operation on {} timed out after {waited}s",
                    part.runner
                );
                part.state = Some(OperationState::Failed);
                part.message = Some(format!("no answer from the runner within {waited}s"));
            }
        }
        self.task_finished(number, now);
    }

    /// A worker left: its running parts have failed.
    pub(super) fn tasks_worker_left(&mut self, worker: WorkerId, now: Instant) {
        let mut ended = Vec::new();
        for (number, task) in &mut self.tasks.tasks {
            if task.finished.is_some() {
                continue;
            }
            for part in task.parts.iter_mut().filter(|p| p.worker == worker) {
                if part.state.is_none_or(|s| !s.is_final()) {
                    part.state = Some(OperationState::Failed);
                    part.message = Some("the runner disconnected".into());
                }
            }
            if task
                .parts
                .iter()
                .all(|p| p.state.is_some_and(|s| s.is_final()))
            {
                ended.push(*number);
            }
        }
        for number in ended {
            self.task_finished(number, now);
        }
    }

    fn task_finished(&mut self, number: u64, now: Instant) {
        let Some(task) = self.tasks.tasks.get_mut(&number) else {
            return;
        };
        task.finished = Some(now);
        self.tasks.finished.push_back(number);
        while self.tasks.finished.len() > FINISHED_KEPT {
            if let Some(old) = self.tasks.finished.pop_front() {
                self.tasks.tasks.remove(&old);
                self.tasks.operations.retain(|_, (n, _)| *n != old);
            }
        }
    }

    /// A task by its wire id.
    pub fn task(&self, task_id: &str, now: Instant) -> Option<TaskView> {
        let number = task_number(task_id)?;
        let task = self.tasks.tasks.get(&number)?;
        if !task_id.starts_with(task.kind.as_str()) {
            return None;
        }
        let end = task.finished.unwrap_or(now);
        let elapsed = end.saturating_duration_since(task.started);
        let permille = task.permille();
        let eta_secs = (task.finished.is_none() && permille > 0).then(|| {
            let total = elapsed.as_secs_f64() * 1000.0 / f64::from(permille);
            (total - elapsed.as_secs_f64()).max(0.0).round() as u64
        });
        Some(TaskView {
            task_id: task_id.to_string(),
            operation: task.kind,
            model: task.model.clone(),
            status: task.status(),
            progress: f64::from(permille) / 1000.0,
            eta_secs,
            elapsed_ms: elapsed.as_millis() as u64,
            parts: task
                .parts
                .iter()
                .map(|p| PartView {
                    runner: p.runner.clone(),
                    status: p.state.map_or("pending", OperationState::as_str),
                    progress: if p.state.is_some_and(|s| s.is_final()) {
                        1.0
                    } else {
                        f64::from(p.permille) / 1000.0
                    },
                    message: p.message.clone(),
                    backend: p.backend.clone(),
                })
                .collect(),
        })
    }

    /// Loads in progress: (worker, model, progress 0–1, eta seconds).
    pub fn loading(&self, now: Instant) -> Vec<(WorkerId, String, f64, Option<u64>)> {
        let mut out = Vec::new();
        for (number, task) in &self.tasks.tasks {
            let (OperationKind::Load, Some(model), None) = (task.kind, &task.model, task.finished)
            else {
                continue;
            };
            let eta = self
                .task(&format!("load-{number}"), now)
                .and_then(|v| v.eta_secs);
            for p in task
                .parts
                .iter()
                .filter(|p| p.state.is_none_or(|s| !s.is_final()))
            {
                out.push((p.worker, model.clone(), f64::from(p.permille) / 1000.0, eta));
            }
        }
        out
    }
}

/// The load target: not yet holding it first, then most free capacity, then lowest id.
/// With an explicit runner every named worker loads (it may have to fetch the model).
fn choose_loader(able: &[&Worker], model: &str, named: bool) -> Vec<WorkerId> {
    if named {
        return able.iter().map(|w| w.id).collect();
    }
    let serving: Vec<&&Worker> = able.iter().filter(|w| w.serves(model)).collect();
    if serving.iter().any(|w| w.has_loaded(model)) && serving.iter().all(|w| w.has_loaded(model)) {
        return Vec::new();
    }
    serving
        .iter()
        .filter(|w| !w.has_loaded(model) && !w.is_draining())
        .max_by_key(|w| {
            (
                w.max_concurrent.saturating_sub(w.load()),
                std::cmp::Reverse(w.id),
            )
        })
        .map(|w| vec![w.id])
        .unwrap_or_default()
}

/// "worker gpu-1 (llama-server) does not run model operations", for every worker named.
fn not_supported(workers: &[&Worker], kind: OperationKind) -> String {
    let names: Vec<String> = workers
        .iter()
        .map(|w| {
            format!(
                "{} ({})",
                w.name,
                w.backend_kind.as_deref().unwrap_or("unknown backend")
            )
        })
        .collect();
    format!(
        "cannot {} here: {} do(es) not support model operations (a modelrelay worker with the lifecycle extension is needed)",
        kind.as_str(),
        names.join(", ")
    )
}

#[cfg(test)]
mod tests;
