//! The worker's power management: where this box is woken (`wake.rs`) and the magic
//! packets it sends for the relay. Hooks elsewhere are small: `register` carries
//! [`Power::wake`] and the `wake_peers` feature, and the session hands `wake_peer`
//! here.

pub mod wake;

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
        })
    }
}

/// The power features this worker lists in `register`.
pub fn features(cfg: &PowerConfig) -> Vec<String> {
    let mut features = Vec::new();
    if cfg.wake_peers {
        features.push(crate::protocol::power::FEATURE_WAKE_PEERS.to_string());
    }
    features
}

/// What the power code knows at run time.
#[derive(Debug, Default)]
pub struct Power {
    /// Where this box is woken, when wakeable.
    pub wake: Option<WakeAddress>,
}

impl Power {
    pub fn new(cfg: &PowerConfig, connect_url: &str) -> Power {
        let wake = wake::address(cfg, connect_url);
        if let Some(w) = &wake {
            log::info!("wakeable: MAC {} via {}", w.mac, w.broadcast);
        }
        Power { wake }
    }
}
