//! The relay's side of power management that touches the outside world: the list of
//! sleeping boxes saved in `STATE_DIR/sleepers.json` (so a restart still knows whom
//! to wake), and the magic packet sent by the relay itself (`WAKE_FROM_RELAY`). The
//! decisions are the dispatcher's (`dispatcher/sleepers.rs`).

use std::fs;
use std::path::PathBuf;

use log::{info, warn};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use super::dispatcher::runtime::{ask, Answer, Query};
use super::dispatcher::{SavedPower, SleeperRecord};
use super::errors::ApiError;
use super::ops::AdminResult;
use super::Ctx;
use crate::power::WakeAddress;

const FILE_NAME: &str = "sleepers.json";
/// A larger file is not ours (256 boxes of 256 models fit many times over).
const MAX_FILE_BYTES: u64 = 16 << 20;

#[derive(Serialize, Deserialize)]
struct SleeperFile {
    version: u32,
    boxes: Vec<SleeperRecord>,
    /// Boxes awake now: seconds asleep so far (absent in older files).
    #[serde(default)]
    slept_secs: std::collections::BTreeMap<String, u64>,
    /// Worker names pinned awake by the operator.
    #[serde(default)]
    pinned: Vec<String>,
}

/// Where the sleeping boxes are saved.
pub struct SleeperStore {
    dir: PathBuf,
}

impl SleeperStore {
    pub fn new(dir: impl Into<PathBuf>) -> SleeperStore {
        SleeperStore { dir: dir.into() }
    }

    /// The boxes a previous run saved (with earlier sleeps and pins); none when there
    /// is no file. A file that cannot be read is reported and ignored: losing the list
    /// only means those boxes are not woken until they come back by themselves.
    pub fn load(&self) -> SavedPower {
        let path = self.dir.join(FILE_NAME);
        let too_big = fs::metadata(&path).is_ok_and(|m| m.len() > MAX_FILE_BYTES);
        let text = match fs::read_to_string(&path) {
            Ok(_) if too_big => return SavedPower::default(),
            Ok(text) => text,
            Err(_) => return SavedPower::default(),
        };
        match serde_json::from_str::<SleeperFile>(&text) {
            Ok(file) => {
                // Only valid wake addresses are kept (the file may have been edited).
                let boxes: Vec<SleeperRecord> = file
                    .boxes
                    .into_iter()
                    .filter_map(|mut b| {
                        b.wake = WakeAddress::parse(&b.wake.mac, &b.wake.broadcast)?;
                        Some(b)
                    })
                    .collect();
                info!(
                    "{} sleeping box(es) remembered from {}",
                    boxes.len(),
                    path.display()
                );
                SavedPower {
                    boxes,
                    slept_secs: file.slept_secs,
                    pinned: file.pinned,
                }
            }
            Err(e) => {
                warn!("ignoring {}: {e}", path.display());
                SavedPower::default()
            }
        }
    }

    /// Replaces the file atomically, readable by the owner only (`private_fs::replace`): it
    /// holds the LAN's MAC addresses.
    pub fn save(&self, saved: SavedPower) -> Result<(), String> {
        let file = SleeperFile {
            version: 1,
            boxes: saved.boxes,
            slept_secs: saved.slept_secs,
            pinned: saved.pinned,
        };
        let body = serde_json::to_vec_pretty(&file)
            .map_err(|e| format!("cannot encode sleeping boxes: {e}"))?;
        super::private_fs::replace(&self.dir, FILE_NAME, &body)
            .map_err(|e| format!("cannot save sleeping boxes ({e})"))
    }
}

/// The sleeping boxes for `/admin/workers`: asleep or waking, since when, and (with
/// `IDLE_WATTS`) the energy saved by all their sleeps so far.
pub fn sleeping(ctx: &Ctx) -> Value {
    let Some(Answer::Sleepers(list)) = ask(&ctx.inputs, Query::Sleepers) else {
        return json!([]);
    };
    let now = super::usage::unix_now();
    list.into_iter()
        .map(|s| {
            let secs = now.saturating_sub(s.asleep_since_unix);
            let mut v = serde_json::to_value(&s).unwrap_or(Value::Null);
            v["hours_asleep"] = json!((secs as f64 / 36.0).round() / 100.0);
            v["energy_saved_wh"] = energy_saved(ctx, s.slept_secs.saturating_add(secs));
            v
        })
        .collect()
}

/// Watt-hours saved by `secs` asleep (`IDLE_WATTS` × hours); `null` without `IDLE_WATTS`.
pub fn energy_saved(ctx: &Ctx, secs: u64) -> Value {
    match ctx.cfg.idle_watts {
        Some(watts) => json!((secs as f64 / 3600.0 * watts).round()),
        None => Value::Null,
    }
}

/// `POST /admin/workers/{id}/stay-awake` with `{"on": true|false}` (no body: on).
pub fn stay_awake(ctx: &Ctx, id: &str, body: &[u8]) -> AdminResult {
    let missing = || ApiError::new(404, "worker_not_found", format!("no worker `{id}`"));
    let worker = id
        .strip_prefix("w-")
        .and_then(|n| n.parse().ok())
        .ok_or_else(missing)?;
    let on = if body.is_empty() {
        true
    } else {
        let v: Value = serde_json::from_slice(body).map_err(|e| {
            ApiError::new(400, "invalid_json", format!("body is not valid JSON: {e}"))
        })?;
        v.get("on").and_then(Value::as_bool).unwrap_or(true)
    };
    match ask(&ctx.inputs, Query::StayAwake { worker, on }) {
        Some(Answer::Done(true)) => Ok((200, json!({"worker": id, "stay_awake": on}))),
        Some(_) => Err(missing()),
        None => Err(ApiError::new(
            503,
            "dispatcher_unavailable",
            "the relay is shutting down",
        )),
    }
}

/// Sends the magic packet from the relay (`WAKE_FROM_RELAY=on`).
pub fn send_wake(name: &str, wake: &WakeAddress) {
    match crate::power::send_magic_packet(wake) {
        Ok(()) => info!("magic packet for `{name}` sent to {}", wake.broadcast),
        Err(e) => warn!("cannot wake `{name}`: {e}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn boxes_survive_a_save_and_load_and_bad_files_are_ignored() {
        let dir = std::env::temp_dir().join(format!("mr-sleepers-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        let store = SleeperStore::new(&dir);
        assert_eq!(store.load(), SavedPower::default());
        let record = SleeperRecord {
            name: "gpu-box-2".into(),
            models: vec!["m".into()],
            wake: WakeAddress::parse("aa:bb:cc:dd:ee:ff", "192.168.1.255").unwrap(),
            since_unix: 7,
            slept_secs: 60,
        };
        let saved = SavedPower {
            boxes: vec![record],
            slept_secs: [("cpu-box".to_string(), 3600)].into(),
            pinned: vec!["nas".into()],
        };
        store.save(saved.clone()).unwrap();
        assert_eq!(store.load(), saved);
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = fs::metadata(dir.join(FILE_NAME))
                .unwrap()
                .permissions()
                .mode();
            assert_eq!(mode & 0o777, 0o600);
        }
        fs::write(dir.join(FILE_NAME), "{not json").unwrap();
        assert_eq!(store.load(), SavedPower::default());
        let _ = fs::remove_dir_all(&dir);
    }
}
