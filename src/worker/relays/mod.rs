//! The worker's relays: one session per `PROXY_URL` entry, each dialing, registering,
//! heartbeating and reconnecting on its own thread, so a relay that is down or
//! restarting never disturbs the others. All of them draw from the one slot table
//! (`slots.rs`); with a single relay everything on the wire is exactly as before.
//!
//! | file | part |
//! |---|---|
//! | `connection.rs` | dial, the WebSocket upgrade, the reconnect loop |
//! | `backoff.rs` | how long to wait before the next dial (short toward a relay just lost) |
//! | `session.rs` | one registered session: register, read loop, the write half |

pub mod backoff;
pub mod connection;
pub mod session;

use std::sync::Arc;

use log::error;
use parking_lot::Mutex;

use super::Shared;
use session::Link;

/// The registered session of each relay, in `PROXY_URL` order.
pub struct Relays {
    links: Mutex<Vec<Option<Link>>>,
}

impl Relays {
    pub fn new(count: usize) -> Relays {
        Relays {
            links: Mutex::new(vec![None; count]),
        }
    }

    /// Records (or, with `None`, forgets) the registered session of relay `relay`.
    pub fn set(&self, relay: usize, link: Option<Link>) {
        if let Some(slot) = self.links.lock().get_mut(relay) {
            *slot = link;
        }
    }

    /// Every registered session, in `PROXY_URL` order.
    pub fn links(&self) -> Vec<Link> {
        self.links.lock().iter().flatten().cloned().collect()
    }
}

/// Starts one connection thread per relay; each runs until the worker drains.
pub fn start(shared: &Arc<Shared>) {
    for relay in 0..shared.cfg.connect_urls.len() {
        let s = shared.clone();
        let spawned = std::thread::Builder::new()
            .name(format!("relay-{relay}"))
            .spawn(move || connection::run_forever(s, relay));
        if let Err(e) = spawned {
            error!("cannot start the connection thread of relay {relay}: {e}");
        }
    }
}
