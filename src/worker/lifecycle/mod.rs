//! The lifecycle extension, worker side (issue 12): model operations the server asks
//! for, and the backend's version and resources (`worker_status`). The wire shapes are in
//! [`crate::protocol::lifecycle`]; the worker lists the feature in every `register` and
//! the server decides whether to use it.
//!
//! A `model_operation` runs on a thread of its own (never on the socket reader): it
//! reports `running` as it goes (at most two a second, progress 0..1 when the backend
//! tells it), then exactly one final `completed`, `failed` (with the backend's reason)
//! or `not_supported` (naming the backend). After a completed load or unload the worker
//! re-reads what the backend holds and sends `models_update` when it changed, so the
//! server's view converges on the backend's own.
//!
//! | kind | load | unload | flush |
//! |---|---|---|---|
//! | `llama-server` router ([`llama`]) | `POST /models/load`, then `GET /models` until `loaded` | `POST /models/unload`, then until `unloaded` | every slot of every loaded model: `POST /slots/{id}?action=erase` |
//! | `llama-server`, one model | not supported | not supported | its slots, erased |
//! | `ollama` ([`ollama`]) | `POST /api/generate` with `keep_alive` (`LOAD_KEEP_ALIVE`), pulling a missing model first (`POST /api/pull`, progress from its stream) | `POST /api/generate` with `keep_alive: 0` | not supported (no cache API) |
//! | `vllm` ([`vllm`], `VLLM_SERVER_DEV_MODE=1`) | `POST /wake_up` | `POST /sleep?level=1` | `POST /reset_prefix_cache` |
//! | `openai` | not supported | not supported | not supported |
//!
//! `worker_status` is sampled by one thread ([`status`]), only while the session's server
//! listed the feature.

pub mod gpu;
pub mod http;
pub mod llama;
pub mod ollama;
pub mod status;
pub mod vllm;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender};
use log::{info, warn};

use super::backend_kind::Kind;
use super::relays::session::Out;
use super::Shared;
use crate::protocol::lifecycle::{
    permille, ModelOperation, OperationKind, OperationState, OperationStatus,
};
use crate::protocol::WorkerMessage;

/// Operations running at once on one worker; more are refused (a client looping on load).
const MAX_RUNNING: usize = 8;
/// Least time between two `running` reports of one operation.
pub const REPORT_GAP: Duration = Duration::from_millis(500);

/// How an operation ended, with what the operator should read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    Completed(String),
    Failed(String),
    /// The backend cannot do this at all (the message names it).
    NotSupported(String),
}

impl Outcome {
    pub fn state(&self) -> OperationState {
        match self {
            Outcome::Completed(_) => OperationState::Completed,
            Outcome::Failed(_) => OperationState::Failed,
            Outcome::NotSupported(_) => OperationState::NotSupported,
        }
    }

    pub fn message(&self) -> &str {
        match self {
            Outcome::Completed(m) | Outcome::Failed(m) | Outcome::NotSupported(m) => m,
        }
    }
}

/// The lifecycle state shared by the worker's threads.
pub struct Lifecycle {
    running: AtomicUsize,
    /// Wakes the status thread (a session registered, the backend came back).
    kick_tx: Sender<()>,
    kick_rx: Receiver<()>,
}

impl Default for Lifecycle {
    fn default() -> Lifecycle {
        let (kick_tx, kick_rx) = crossbeam_channel::bounded(1);
        Lifecycle {
            running: AtomicUsize::new(0),
            kick_tx,
            kick_rx,
        }
    }
}

impl Lifecycle {
    /// Wakes the status thread to look again (one pending kick is enough).
    pub fn kick(&self) {
        let _ = self.kick_tx.try_send(());
    }
}

/// Decrements the running count however the operation's thread ends.
struct Running<'a>(&'a AtomicUsize);

impl Drop for Running<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// `running` reports of one operation: the first one and the first with a figure go out
/// at once, the others at most one per [`REPORT_GAP`]; progress never goes back.
pub struct Progress<'a> {
    emit: &'a mut dyn FnMut(OperationStatus),
    operation_id: &'a str,
    backend: &'static str,
    /// When the last report went, and whether it had a figure.
    last: Option<(Instant, bool)>,
    permille: Option<u16>,
}

impl<'a> Progress<'a> {
    pub fn new(
        emit: &'a mut dyn FnMut(OperationStatus),
        operation_id: &'a str,
        backend: &'static str,
    ) -> Progress<'a> {
        Progress {
            emit,
            operation_id,
            backend,
            last: None,
            permille: None,
        }
    }

    /// Reports `running`, `fraction` 0..1 when known.
    pub fn update(&mut self, fraction: Option<f64>, message: Option<String>) {
        self.update_at(Instant::now(), fraction, message);
    }

    pub fn update_at(&mut self, now: Instant, fraction: Option<f64>, message: Option<String>) {
        let figure = permille(fraction.map(|f| f.clamp(0.0, 1.0)));
        let figure = match (figure, self.permille) {
            (Some(new), Some(old)) => Some(new.max(old)),
            (new, old) => new.or(old),
        };
        let due = match self.last {
            None => true,
            Some((at, had)) => {
                now.saturating_duration_since(at) >= REPORT_GAP || (figure.is_some() && !had)
            }
        };
        if !due {
            return;
        }
        self.last = Some((now, figure.is_some()));
        self.permille = figure;
        (self.emit)(OperationStatus {
            operation_id: self.operation_id.to_string(),
            status: OperationState::Running,
            progress: figure,
            message,
            backend: Some(self.backend.to_string()),
        });
    }

    /// The one final report.
    pub fn finish(self, outcome: &Outcome) {
        (self.emit)(OperationStatus {
            operation_id: self.operation_id.to_string(),
            status: outcome.state(),
            progress: None,
            message: Some(outcome.message().to_string()),
            backend: Some(self.backend.to_string()),
        });
    }
}

/// Starts `op` on a thread of its own; its reports go to `out`, the session it came on.
pub fn start(shared: &Arc<Shared>, op: ModelOperation, out: Out) {
    let counter = &shared.lifecycle.running;
    let refuse = |why: String| {
        out.send(&WorkerMessage::OperationStatus(OperationStatus {
            operation_id: op.operation_id.clone(),
            status: OperationState::Failed,
            progress: None,
            message: Some(why),
            backend: backend_name(shared.residency.kind()).map(str::to_string),
        }));
    };
    if counter.fetch_add(1, Ordering::AcqRel) >= MAX_RUNNING {
        counter.fetch_sub(1, Ordering::AcqRel);
        warn!(
            "model operation {}: refused, {MAX_RUNNING} already running",
            op.operation_id
        );
        refuse(format!(
            "{MAX_RUNNING} model operations are already running on this worker"
        ));
        return;
    }
    let s = shared.clone();
    let (op2, out2) = (op.clone(), out.clone());
    let spawned = std::thread::Builder::new()
        .name("model-op".into())
        .spawn(move || {
            let _running = Running(&s.lifecycle.running);
            run(&s, &op2, &out2);
        });
    if let Err(e) = spawned {
        counter.fetch_sub(1, Ordering::AcqRel);
        refuse(format!("the worker cannot start a thread: {e}"));
    }
}

/// The backend's name in reports (`backend` of `operation_status`).
fn backend_name(kind: Option<Kind>) -> Option<&'static str> {
    kind.map(Kind::as_str)
}

fn run(shared: &Shared, op: &ModelOperation, out: &Out) {
    let kind = shared.residency.kind();
    let name = backend_name(kind).unwrap_or("unknown");
    let what = format!(
        "{} {}",
        op.operation.as_str(),
        op.model.as_deref().unwrap_or("(every model)")
    );
    info!("model operation {}: {what} on {name}", op.operation_id);
    let began = Instant::now();
    let mut emit = |s: OperationStatus| {
        out.send(&WorkerMessage::OperationStatus(s));
    };
    let mut progress = Progress::new(&mut emit, &op.operation_id, name);
    let outcome = execute(shared, kind, op, &mut progress);
    info!(
        "model operation {}: {what} {} after {:.1}s: {}",
        op.operation_id,
        outcome.state().as_str(),
        began.elapsed().as_secs_f64(),
        outcome.message()
    );
    progress.finish(&outcome);
    if matches!(outcome, Outcome::Completed(_)) {
        if matches!(op.operation, OperationKind::Load | OperationKind::Unload) {
            super::refresh_models(shared, false);
        }
        // Slots, cache and memory changed: the server hears of it now, not in 5 s.
        shared.lifecycle.kick();
    }
}

/// Runs an operation the worker decided on itself (the owner check's unloads), with no
/// server to report to: the adapter's final message, or why it failed.
pub fn run_here(shared: &Shared, op: &ModelOperation) -> Result<String, String> {
    let kind = shared.residency.kind();
    let mut emit = |_: OperationStatus| {};
    let mut progress = Progress::new(&mut emit, &op.operation_id, "local");
    let outcome = execute(shared, kind, op, &mut progress);
    let message = outcome.message().to_string();
    if matches!(outcome, Outcome::Completed(_)) {
        super::refresh_models(shared, false);
        Ok(message)
    } else {
        Err(message)
    }
}

/// Runs one operation against the backend of `kind`.
fn execute(
    shared: &Shared,
    kind: Option<Kind>,
    op: &ModelOperation,
    progress: &mut Progress,
) -> Outcome {
    if let Some(reason) = shared.health.down_reason() {
        return Outcome::Failed(format!("the backend is down: {reason}"));
    }
    let Some(kind) = kind else {
        return Outcome::Failed(
            "the backend's kind is not known yet (it has not answered since the worker started)"
                .into(),
        );
    };
    let model = op.model.as_deref();
    if op.operation != OperationKind::Flush && model.is_none() {
        return Outcome::Failed(format!("{} needs a model", op.operation.as_str()));
    }
    let backend = &shared.backend;
    match kind {
        Kind::OpenAi => Outcome::NotSupported(format!(
            "the backend is a plain OpenAI-compatible server (BACKEND_KIND openai): it has no API to {} models (llama-server in router mode, Ollama and vLLM do)",
            op.operation.as_str()
        )),
        Kind::LlamaServer => llama::run(backend, op.operation, model, progress),
        Kind::Ollama => {
            ollama::run(backend, op.operation, model, &shared.cfg.load_keep_alive, progress)
        }
        Kind::Vllm => vllm::run(backend, op.operation, model, progress),
    }
}

#[cfg(test)]
mod tests;
