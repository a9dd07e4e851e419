//! The hooks of a resumable stream ([`crate::server::resume`]) in a relayed request:
//! its events numbered and kept, and a lost connection that holds the stream instead of
//! cancelling it. A stream that did not opt in passes straight through [`Session::emit`].

use log::info;

use super::response::{self, Framing};
use super::Session;

impl Session<'_, '_> {
    /// Whether the client's connection still gets the answer (a resumable stream's
    /// may have been left or taken over by a resume).
    pub(super) fn client_reads(&self) -> bool {
        self.resume.as_ref().is_none_or(|t| t.original_reads())
    }

    /// The client's connection is gone: a resumable stream that started goes on into
    /// its buffer (`true`); any other is cancelled by the caller.
    pub(super) fn hold(&mut self) -> bool {
        let held = self.framing.is_some() && self.resume.as_mut().is_some_and(|t| t.lost());
        if held {
            info!(
                "request {}: client hung up; stream held for a resume",
                self.wire
            );
        }
        held
    }

    /// Appends event text to the answer; a resumable stream numbers and keeps it
    /// (`last`: the stream's end), and gives nothing once its client left.
    pub(super) fn emit(&mut self, buf: &mut Vec<u8>, text: &str, framing: Framing, last: bool) {
        match &mut self.resume {
            None => response::push_chunk(buf, text.as_bytes(), framing),
            Some(tap) => {
                if let Some(out) = tap.emit(text, last) {
                    response::push_chunk(buf, &out, framing);
                }
            }
        }
    }

    /// Appends a note of the relay's own (an SSE comment); a resumable stream does not
    /// number it (see [`crate::server::resume::Tap::note`]).
    pub(super) fn emit_note(&mut self, buf: &mut Vec<u8>, text: &str, framing: Framing) {
        match &mut self.resume {
            None => response::push_chunk(buf, text.as_bytes(), framing),
            Some(tap) => {
                if let Some(out) = tap.note(text) {
                    response::push_chunk(buf, &out, framing);
                }
            }
        }
    }
}
