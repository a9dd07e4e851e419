//! Cache affinity across relays, the worker's part (`protocol/affinity.rs`): the prompt
//! prefixes one relay sent with a request are passed on to every other relay that reads
//! them, so a conversation's next turn comes back to this box through any relay.
//!
//! Passed on as they arrive, before the request runs: the next turn of a conversation
//! comes after this one's answer, and a request refused `busy` is sent again (here or
//! elsewhere) with its prefixes again. Nothing is kept here.

use log::debug;

use crate::protocol::affinity::PrefixNote;
use crate::protocol::WorkerMessage;
use crate::worker::Shared;

/// Sends `note`, which relay `from` sent, to every other relay that reads it.
pub fn pass_on(shared: &Shared, from: usize, note: PrefixNote) {
    let msg = WorkerMessage::Prefixes(note);
    let mut told = 0;
    for link in shared.relays.links() {
        if link.relay != from && link.affinity_reports && link.out.send(&msg) {
            told += 1;
        }
    }
    debug!("prompt prefixes from relay {from} passed on to {told} relay(s)");
}
