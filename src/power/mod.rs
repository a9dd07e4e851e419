//! Power management shared by both binaries: the wake address a worker advertises and
//! the Wake-on-LAN magic packet (`wol.rs`). The relay's decisions about whom to wake
//! live in `server/dispatcher/sleepers.rs`; the worker's idle and owner checks in
//! `worker/power/`.

pub mod wol;

pub use wol::{parse_mac, send_magic_packet, WakeAddress};
