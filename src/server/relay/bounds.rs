//! What one relayed request may cost: the size of its message to a worker, and how much
//! of its answer waits for a client that does not read.

use crate::protocol::RequestMessage;
use crate::server::errors::ApiError;

/// Bytes of a streamed answer the relay holds for a client that reads slower than the
/// backend writes; past it the answer is cancelled end to end (worker and backend), as
/// it is when one write blocks for `WRITE_TIMEOUT_SECS`. What piles up meanwhile is at
/// most what the worker sends during that one write.
pub const MAX_ANSWER_BUFFER: usize = 8 << 20;

/// A write that took this long waited on the client, not on the relay: only then does
/// a full [`MAX_ANSWER_BUFFER`] count against the client. A client that reads as fast as
/// it can is never cut off because the backend is faster still.
pub const SLOW_WRITE: std::time::Duration = std::time::Duration::from_secs(1);

/// Refuses with `413` a request whose `request` message would exceed what a worker
/// accepts (`MAX_WS_MESSAGE_BYTES`). The body is forwarded as the client sent it (never
/// re-serialised: the backend must see the client's bytes), so it is the *escaped* size
/// that counts: a body of newlines doubles, of control bytes grows sixfold, and a message
/// over a worker's limit would cost that worker its connection and everything on it.
pub(super) fn fits_one_message(msg: &RequestMessage, max: usize) -> Result<(), ApiError> {
    let len = msg.wire_len();
    if len <= max {
        return Ok(());
    }
    Err(ApiError::new(
        413,
        "request_too_large",
        format!(
            "request body is {len} bytes once escaped for a worker, over the {max}-byte \
             message limit (MAX_WS_MESSAGE_BYTES); newlines and control characters in the \
             body count twice or six times"
        ),
    ))
}

pub(super) fn is_timeout(e: &std::io::Error) -> bool {
    matches!(
        e.kind(),
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
    )
}
