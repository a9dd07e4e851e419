//! Lifecycle tasks across relays (with a shared store): a task started here is
//! published as it progresses, so `GET /v1/models/load/{taskId}` on any relay answers
//! it. Task ids are unique across the fleet (each relay numbers its tasks from a random
//! point when the store is shared, see `server::start`).
//!
//! One thread per running task (tasks are few: the dispatcher bounds them) asks the
//! dispatcher for the task every [`INTERVAL`] and writes its JSON when it changed,
//! until it ends. Each write keeps it for [`KEEP`].

use std::sync::Arc;
use std::time::Duration;

use crossbeam_channel::Sender;
use serde_json::Value;

use super::routes::task_json;
use crate::server::dispatcher::runtime::{ask, Answer, Input, Query};
use crate::server::shared::Shared;
use crate::server::store::TaskMirror;

/// How often a running task is published.
pub const INTERVAL: Duration = Duration::from_millis(250);
/// How long the store keeps a task after its last change.
pub const KEEP: Duration = Duration::from_secs(3600);
/// Longest task id looked up in the store (ids are `load-<number>`).
const MAX_ID: usize = 64;

/// Publishes task `task_id` until it ends (on a thread of its own).
pub fn follow(
    task_id: String,
    mirror: Box<dyn TaskMirror>,
    inputs: Sender<Input>,
    shared: Arc<Shared>,
) {
    let spawned = std::thread::Builder::new()
        .name("task-sync".into())
        .stack_size(crate::server::THREAD_STACK)
        .spawn(move || {
            let mut last: Option<Value> = None;
            while !shared.is_shutting_down() {
                let Some(Answer::Task(Some(task))) = ask(&inputs, Query::Task(task_id.clone()))
                else {
                    return;
                };
                let running = task.status == "running";
                let json = task_json(&task);
                if last.as_ref() != Some(&json) {
                    // A failed write is tried again at the next change or turn.
                    if mirror.put(&task_id, &json.to_string(), KEEP).is_ok() {
                        last = Some(json);
                    }
                }
                if !running && last.is_some() {
                    return;
                }
                std::thread::sleep(INTERVAL);
            }
        });
    if let Err(e) = spawned {
        log::warn!("task not shared with the other relays: {e}");
    }
}

/// A task another relay published, as it last stood.
pub fn lookup(mirror: &dyn TaskMirror, task_id: &str) -> Option<Value> {
    if task_id.len() > MAX_ID {
        return None;
    }
    let text = mirror.get(task_id).ok()??;
    serde_json::from_str(&text).ok()
}
