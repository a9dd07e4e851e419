//! The backend side of a body that follows its request in pieces (`protocol::pieces`):
//! the backend request's body is a reader that takes the pieces as they arrive, so the
//! upload never sits whole here. Credit goes back to the server as the backend takes
//! each piece ([`WINDOW`] ahead): a backend that reads slowly holds the upload back all
//! the way to the client. The body goes with the client's `Content-Length` when it gave
//! one (the server puts it in the request's headers), chunked otherwise.

use std::io::{self, Read};
use std::time::Duration;

use crossbeam_channel::{Receiver, RecvTimeoutError};

use super::{is_connection_failure, Backend, Outcome};
use crate::protocol::binary;
use crate::protocol::pieces::WINDOW;
use crate::protocol::{RequestMessage, WorkerMessage};
use crate::worker::inflight::{Handle, Piece};

/// How long the next piece may take before the upload counts as abandoned (the server
/// cancels a request whose client stopped sending long before).
const PIECE_WAIT: Duration = Duration::from_secs(300);

/// Sends the request with its body read from the pieces; the answer's head, or the
/// request's outcome.
pub(super) fn send(
    backend: &Backend,
    uri: &ureq::http::Uri,
    agent: &mut ureq::Agent,
    req: &RequestMessage,
    handle: &Handle,
    emit: &mut dyn FnMut(WorkerMessage),
) -> Result<ureq::http::Response<ureq::Body>, Outcome> {
    // One spare place: a piece may arrive before the reader took the one before.
    let pieces = handle.open_pieces(WINDOW as usize + 1);
    if !handle.attach(agent) {
        return Err(Outcome::Cancelled);
    }
    let mut reader = PieceReader {
        pieces,
        current: Vec::new(),
        at: 0,
        next: 0,
        done: false,
        broken: None,
        request_id: &req.request_id,
        emit,
    };
    reader.grant();
    let sent = backend.send(uri, agent, req, ureq::SendBody::from_reader(&mut reader));
    match sent {
        Ok(response) => Ok(response),
        Err(_) if handle.is_cancelled() => Err(Outcome::Cancelled),
        Err(_) if reader.broken.is_some() => {
            Err(Outcome::Failed(reader.broken.take().unwrap_or_default()))
        }
        // Nothing of the body was taken: the server may still run it elsewhere.
        Err(e) if reader.next == 0 && is_connection_failure(&e) => {
            Err(Outcome::Unreachable(e.to_string()))
        }
        Err(e) => Err(Outcome::Failed(e.to_string())),
    }
}

/// The backend request's body: the pieces in order, decoded.
struct PieceReader<'a> {
    pieces: Receiver<Piece>,
    current: Vec<u8>,
    at: usize,
    /// The number of the piece expected next.
    next: u64,
    done: bool,
    /// Why the body could not be read whole (the request fails with it).
    broken: Option<String>,
    request_id: &'a str,
    emit: &'a mut dyn FnMut(WorkerMessage),
}

impl PieceReader<'_> {
    /// Lets the server send up to [`WINDOW`] pieces past those taken.
    fn grant(&mut self) {
        (self.emit)(WorkerMessage::BodyCredit {
            request_id: self.request_id.to_string(),
            until: self.next + WINDOW,
        });
    }

    fn fail(&mut self, why: String) -> io::Error {
        let e = io::Error::other(why.clone());
        self.broken = Some(why);
        e
    }

    /// Takes the next piece into `current`.
    fn take(&mut self) -> io::Result<()> {
        let (seq, chunk, last) = match self.pieces.recv_timeout(PIECE_WAIT) {
            Ok(piece) => piece,
            Err(RecvTimeoutError::Timeout) => {
                return Err(self.fail("the request body stopped arriving".into()))
            }
            // Cancelled: the request's handle dropped the way in.
            Err(RecvTimeoutError::Disconnected) => {
                return Err(io::Error::new(io::ErrorKind::Interrupted, "cancelled"))
            }
        };
        if seq != self.next {
            return Err(self.fail(format!(
                "body piece {seq} arrived where piece {} was due",
                self.next
            )));
        }
        let Ok(bytes) = binary::decode(&chunk) else {
            return Err(self.fail(format!("body piece {seq} is not valid base64")));
        };
        self.current = bytes;
        self.at = 0;
        self.next += 1;
        self.done = last;
        if !last {
            self.grant();
        }
        Ok(())
    }
}

impl Read for PieceReader<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        while self.at == self.current.len() {
            if self.done {
                return Ok(0);
            }
            self.take()?;
        }
        let n = buf.len().min(self.current.len() - self.at);
        buf[..n].copy_from_slice(&self.current[self.at..self.at + n]);
        self.at += n;
        Ok(n)
    }
}
