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
//! | `affinity.rs` | the prompt prefixes one relay sent, passed on to the others |

pub mod affinity;
pub mod backoff;
pub mod connection;
pub mod session;

use std::sync::Arc;

use log::{debug, error};
use parking_lot::Mutex;

use super::Shared;
use crate::protocol::WorkerMessage;
use session::Link;

/// The registered session of each relay, in `PROXY_URL` order.
pub struct Relays {
    links: Mutex<Vec<Option<Link>>>,
    /// Held while the relay list is read and sent, so two sessions starting at once
    /// cannot deliver their lists in the wrong order.
    reporting: Mutex<()>,
}

impl Relays {
    pub fn new(count: usize) -> Relays {
        Relays {
            links: Mutex::new(vec![None; count]),
            reporting: Mutex::new(()),
        }
    }

    /// Records (or, with `None`, forgets) the registered session of relay `relay`.
    pub fn set(&self, relay: usize, link: Option<Link>) {
        if let Some(slot) = self.links.lock().get_mut(relay) {
            *slot = link;
        }
    }

    /// The URLs of the relays with a registered session, without any userinfo (they
    /// are shown to every relay).
    pub fn registered(&self, urls: &[String]) -> Vec<String> {
        let links = self.links.lock();
        links
            .iter()
            .zip(urls)
            .filter(|(l, _)| l.is_some())
            .map(|(_, u)| super::backend::url::redacted(u))
            .collect()
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

/// Tells every relay that reads `load` the worker's live load (requests running or
/// waiting, from all relays), when it changed since that relay was last told. Called
/// after every change; the count is read under the relay's lock, so the last report a
/// relay gets is never older than the last change.
pub fn report_load(shared: &Shared) {
    // One relay counts its own requests exactly, and is never told.
    if shared.cfg.connect_urls.len() < 2 {
        return;
    }
    for link in shared.relays.links() {
        if !link.load_reports {
            continue;
        }
        let mut told = link.load_told.lock();
        let in_flight = shared.inflight.len() as u32;
        if *told != Some(in_flight) && link.out.send(&WorkerMessage::Load { in_flight }) {
            *told = Some(in_flight);
        }
    }
}

/// Refuses a request of `link`'s relay: every slot is taken by the other relays. The
/// answer carries the load, so the relay counts the worker full until told otherwise.
pub fn refuse_busy(shared: &Shared, link: &Link, request_id: &str) {
    let mut told = link.load_told.lock();
    let in_flight = shared.inflight.len() as u32;
    debug!("request {request_id}: every slot taken; answered busy");
    let busy = WorkerMessage::Busy {
        request_id: request_id.to_string(),
        in_flight,
    };
    if link.out.send(&busy) {
        *told = Some(in_flight);
    }
}

/// Tells every relay that reads it which relays the worker is registered with (a
/// session began or ended): each relay shows it and counts the relays of its pool.
pub fn report_relays(shared: &Shared) {
    if shared.cfg.connect_urls.len() < 2 {
        return;
    }
    let _order = shared.relays.reporting.lock();
    let relays = shared.relays.registered(&shared.cfg.connect_urls);
    let msg = WorkerMessage::Relays { relays };
    for link in shared.relays.links() {
        if link.load_reports {
            link.out.send(&msg);
        }
    }
}
