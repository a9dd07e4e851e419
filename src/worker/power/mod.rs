//! The worker's power management: where this box is woken and the magic packets it
//! sends for the relay (`wake.rs`), sleeping when idle and noticing the resume
//! (`suspend.rs`). Hooks elsewhere are small: `register` carries [`Power::wake`] and
//! the features, the session hands `wake_peer`, `sleep_answer` and each request here,
//! and the connection loop waits in [`suspend::Sleep::hold`] while the box sleeps.

pub mod owner;
pub mod suspend;
pub mod wake;

use std::sync::atomic::AtomicBool;
use std::time::Duration;

use crate::cli::{ConfigError, Settings};
use crate::power::WakeAddress;

/// Power settings (`WAKE_*`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PowerConfig {
    /// Advertise a wake address (`WAKE_ON_LAN`, or implied by `WAKE_MAC`).
    pub wakeable: bool,
    /// `WAKE_MAC`: instead of the detected one.
    pub mac: Option<String>,
    /// `WAKE_BROADCAST`: instead of the detected one.
    pub broadcast: Option<String>,
    /// Send magic packets when the relay asks (`WAKE_PEERS`, on by default).
    pub wake_peers: bool,
    /// Ask to sleep after this long without a request (`IDLE_SUSPEND_SECS`, 0: never).
    pub idle_suspend: Option<Duration>,
    /// What puts the machine to sleep (`SUSPEND_CMD`, run with `sh -c`).
    pub suspend_cmd: Option<String>,
    /// Never ask to sleep (`STAY_AWAKE`).
    pub stay_awake: bool,
    /// Exit 0 means the box's owner uses it (`OWNER_BUSY_CMD`, `sh -c`).
    pub owner_busy_cmd: Option<String>,
    /// Another program's compute process on the GPU means the owner is busy
    /// (`OWNER_GPU_CHECK`, via `nvidia-smi`).
    pub owner_gpu_check: bool,
    /// How often the owner is checked (`OWNER_CHECK_SECS`).
    pub owner_check: Duration,
    /// Unload the models while the owner is busy (`OWNER_UNLOAD`).
    pub owner_unload: bool,
}

impl PowerConfig {
    pub fn from_settings(s: &Settings) -> Result<PowerConfig, ConfigError> {
        let mac = s.get("wake-mac").map(str::to_string);
        if let Some(m) = &mac {
            if crate::power::parse_mac(m).is_none() {
                return Err(ConfigError(format!(
                    "WAKE_MAC must be six hex bytes like aa:bb:cc:dd:ee:ff (got `{m}`)"
                )));
            }
        }
        let broadcast = s.get("wake-broadcast").map(str::to_string);
        if let Some(b) = &broadcast {
            if WakeAddress::parse("02:00:00:00:00:01", b).is_none() {
                return Err(ConfigError(format!(
                    "WAKE_BROADCAST must be an IP address, optionally with a port (got `{b}`)"
                )));
            }
        }
        Ok(PowerConfig {
            wakeable: s.flag_bool("wake-on-lan")? || mac.is_some(),
            mac,
            broadcast,
            wake_peers: s.get("wake-peers").is_none() || s.flag_bool("wake-peers")?,
            idle_suspend: Some(s.secs("idle-suspend-secs", 0)?).filter(|d| !d.is_zero()),
            suspend_cmd: s
                .get("suspend-cmd")
                .map(str::trim)
                .filter(|c| !c.is_empty())
                .map(str::to_string),
            stay_awake: s.flag_bool("stay-awake")?,
            owner_busy_cmd: s
                .get("owner-busy-cmd")
                .map(str::trim)
                .filter(|c| !c.is_empty())
                .map(str::to_string),
            owner_gpu_check: s.flag_bool("owner-gpu-check")?,
            owner_check: s.secs("owner-check-secs", 10)?.max(Duration::from_secs(1)),
            owner_unload: s.flag_bool("owner-unload")?,
        })
    }
}

/// The power features this worker lists in `register`.
pub fn features(cfg: &PowerConfig) -> Vec<String> {
    let mut features = Vec::new();
    if cfg.wake_peers {
        features.push(crate::protocol::power::FEATURE_WAKE_PEERS.to_string());
    }
    if cfg.owner_busy_cmd.is_some() || cfg.owner_gpu_check {
        features.push(crate::protocol::power::FEATURE_OWNER_YIELD.to_string());
    }
    if cfg.idle_suspend.is_some() && !cfg.stay_awake {
        features.push(crate::protocol::power::FEATURE_SLEEP.to_string());
    }
    features
}

/// What the power code knows at run time.
#[derive(Default)]
pub struct Power {
    /// Where this box is woken, when wakeable.
    pub wake: Option<WakeAddress>,
    /// Idle sleep and resume.
    pub sleep: suspend::Sleep,
    /// The box's owner uses it now (`owner.rs`).
    pub owner_busy: AtomicBool,
}

impl Power {
    pub fn new(cfg: &PowerConfig, connect_url: &str) -> Power {
        let wake = wake::address(cfg, connect_url);
        if let Some(w) = &wake {
            log::info!("wakeable: MAC {} via {}", w.mac, w.broadcast);
        }
        Power {
            wake,
            sleep: suspend::Sleep::default(),
            owner_busy: AtomicBool::new(false),
        }
    }
}
