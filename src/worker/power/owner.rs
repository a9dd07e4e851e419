//! Yield to the owner: the box is someone's workstation or gaming PC. Every
//! `OWNER_CHECK_SECS` the worker asks `OWNER_BUSY_CMD` (exit 0: the owner is using the
//! box) and, with `OWNER_GPU_CHECK`, `nvidia-smi` for compute processes other than an
//! inference backend. While the owner is busy the relay sends nothing new
//! (`owner_status`), what is running finishes, and with `OWNER_UNLOAD` the loaded models
//! are unloaded through the lifecycle adapters to hand the VRAM back. When the owner is
//! done, the worker takes work again.

use std::process::{Command, Stdio};
use std::sync::atomic::Ordering;
use std::sync::Arc;

use log::{info, warn};

use crate::protocol::lifecycle::{ModelOperation, OperationKind};
use crate::protocol::WorkerMessage;
use crate::worker::Shared;

/// Process names of inference backends: their GPU use is ours, not the owner's.
const BACKENDS: &[&str] = &[
    "ollama",
    "llama",
    "vllm",
    "python",
    "text-generation",
    "tgi",
];

/// Watches the owner until drain; does nothing without a check configured.
pub fn run(shared: &Arc<Shared>) {
    let cfg = &shared.cfg.power;
    if cfg.owner_busy_cmd.is_none() && !cfg.owner_gpu_check {
        return;
    }
    loop {
        let busy = owner_busy(cfg.owner_busy_cmd.as_deref(), cfg.owner_gpu_check);
        let was = shared.power.owner_busy.swap(busy, Ordering::AcqRel);
        if busy != was {
            if busy {
                info!("the owner is using this box: taking nothing new");
            } else {
                info!("the owner is done: taking work again");
            }
            announce(shared);
            if busy && cfg.owner_unload {
                unload_all(shared);
            }
        }
        if shared.wait_for_drain(cfg.owner_check) {
            return;
        }
    }
}

/// After a registration: a relay new to this box hears only of a busy owner.
pub fn announce_busy(shared: &Shared) {
    if shared.power.owner_busy.load(Ordering::Acquire) {
        announce(shared);
    }
}

/// Tells every relay that reads it the owner's state.
pub fn announce(shared: &Shared) {
    let busy = shared.power.owner_busy.load(Ordering::Acquire);
    for link in shared.relays.links().iter().filter(|l| l.owner_yield) {
        link.out.send(&WorkerMessage::OwnerStatus { busy });
    }
}

fn owner_busy(cmd: Option<&str>, gpu: bool) -> bool {
    let by_cmd = cmd.is_some_and(|cmd| {
        Command::new("sh")
            .arg("-c")
            .arg(cmd)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    });
    by_cmd || (gpu && gpu_used_by_others())
}

/// Whether `nvidia-smi` lists a compute process that is no inference backend. Without
/// `nvidia-smi` (no NVIDIA GPU), never.
fn gpu_used_by_others() -> bool {
    let out = Command::new("nvidia-smi")
        .args([
            "--query-compute-apps=pid,process_name",
            "--format=csv,noheader",
        ])
        .stdin(Stdio::null())
        .stderr(Stdio::null())
        .output();
    match out {
        Ok(o) if o.status.success() => others_in(&String::from_utf8_lossy(&o.stdout)),
        _ => false,
    }
}

/// `pid, name` lines: any whose name is no backend's.
pub fn others_in(csv: &str) -> bool {
    csv.lines()
        .filter_map(|l| l.split_once(','))
        .any(|(_, name)| {
            let base = name
                .trim()
                .rsplit('/')
                .next()
                .unwrap_or("")
                .to_ascii_lowercase();
            !base.is_empty() && !BACKENDS.iter().any(|b| base.contains(b))
        })
}

/// Unloads every loaded model (`OWNER_UNLOAD`), as a `model_operation` would.
fn unload_all(shared: &Shared) {
    let models = shared.models.lock().clone();
    let loaded = shared.residency.loaded_among(&models).unwrap_or(models);
    for model in loaded {
        let op = ModelOperation {
            operation_id: "owner-unload".into(),
            operation: OperationKind::Unload,
            model: Some(model.clone()),
        };
        match crate::worker::lifecycle::run_here(shared, &op) {
            Ok(message) => info!("unloaded `{model}` for the owner: {message}"),
            Err(message) => warn!("cannot unload `{model}` for the owner: {message}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_owner_is_busy_when_the_command_says_so_or_another_program_holds_the_gpu() {
        let dir = std::env::temp_dir().join(format!("mr-owner-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let flag = dir.join("busy");
        let cmd = format!("test -e '{}'", flag.display());
        assert!(!owner_busy(Some(&cmd), false));
        std::fs::write(&flag, "").unwrap();
        assert!(owner_busy(Some(&cmd), false));
        assert!(!owner_busy(None, false));
        let _ = std::fs::remove_dir_all(&dir);

        assert!(!others_in(""));
        assert!(!others_in(
            "101, /usr/local/bin/ollama\n102, /opt/llama.cpp/llama-server\n"
        ));
        assert!(others_in(
            "101, /usr/bin/ollama\n2200, C:\\Games\\game.exe\n"
        ));
        assert!(others_in("3300, blender\n"));
    }
}
