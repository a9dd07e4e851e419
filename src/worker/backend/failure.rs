//! What a failed backend call means. A connection failure (refused, reset, timed out
//! before any answer) marks the backend down and makes the request retryable elsewhere;
//! a stale pooled connection is worth one retry on a fresh one; a 502/503/504 answer is
//! read whole (bounded) so the server can fail over or pass it on unchanged. Apart from
//! request building and streaming in the parent module because these rules decide
//! failover and backend health, and are tested on their own.

use std::io::Read;

use super::super::inflight::Handle;
use super::Outcome;
use crate::protocol::HeaderMap;

/// Reads a 502/503/504 answer whole (at most `max` bytes), so the client can get it as
/// the backend sent it.
pub(super) fn unavailable(
    status: u16,
    headers: HeaderMap,
    reader: impl Read,
    max: usize,
    handle: &Handle,
) -> Outcome {
    let mut bytes = Vec::new();
    let read = reader.take(max as u64 + 1).read_to_end(&mut bytes);
    if read.is_err() && handle.is_cancelled() {
        return Outcome::Cancelled;
    }
    let body =
        (read.is_ok() && bytes.len() <= max).then(|| String::from_utf8_lossy(&bytes).into_owned());
    Outcome::Unavailable {
        status,
        headers,
        body,
    }
}

/// Errors that mean no answer came from the backend at all: it refused, reset or
/// never completed the connection, or closed it before a response head. Only these
/// mark the backend down; an HTTP answer of any status proves it is up.
pub fn is_connection_failure(e: &ureq::Error) -> bool {
    use std::io::ErrorKind::*;
    match e {
        ureq::Error::Io(io) => matches!(
            io.kind(),
            ConnectionRefused
                | ConnectionReset
                | ConnectionAborted
                | BrokenPipe
                | UnexpectedEof
                | NotConnected
                | TimedOut
                | HostUnreachable
                | NetworkUnreachable
                | AddrNotAvailable
        ),
        ureq::Error::Timeout(ureq::Timeout::Connect | ureq::Timeout::Resolve) => true,
        ureq::Error::ConnectionFailed | ureq::Error::HostNotFound => true,
        _ => false,
    }
}

pub(super) fn is_stale_connection(e: &ureq::Error) -> bool {
    use std::io::ErrorKind::*;
    match e {
        ureq::Error::Io(io) => matches!(
            io.kind(),
            ConnectionReset | ConnectionAborted | BrokenPipe | UnexpectedEof
        ),
        ureq::Error::Protocol(_) => true,
        _ => false,
    }
}
