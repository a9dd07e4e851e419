//! The relay's hook for answers finished on another worker (see `server::continuation`):
//! what a session does when the dispatcher says its stream was interrupted.

use log::debug;

use super::bounds::fits_one_message;
use super::{response, Session};
use crate::server::continuation::Tracker;
use crate::server::dispatcher::runtime::Input;
use crate::server::dispatcher::Event;

impl Session<'_, '_> {
    /// The worker streaming this answer was lost midway and the dispatcher waits for
    /// the request that goes on from the text delivered ([`continuation`]); `None`
    /// ends it with the error, as before. What the lost worker left of an unfinished
    /// event never went out (the tracker holds back partial events).
    pub(super) fn interrupted(&mut self, buf: &mut Vec<u8>) {
        let msg = match self.continuation.as_mut().map(Tracker::interrupted) {
            Some(Ok(msg)) if fits_one_message(&msg, self.ctx.cfg.max_ws_message_bytes).is_ok() => {
                if let Some(framing) = self.framing {
                    let cut = self.boundary.abandon();
                    response::push_chunk(buf, cut.close.as_bytes(), framing);
                }
                Some(msg)
            }
            Some(Ok(_)) => None,
            Some(Err(why)) => {
                debug!("request {}: not continued: {why}", self.wire);
                None
            }
            None => None,
        };
        let event = Event::Continue { id: self.id, msg };
        let _ = self.ctx.inputs.send(Input::Event(event));
    }
}
