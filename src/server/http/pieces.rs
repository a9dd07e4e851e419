//! A request body read as it is relayed, a part at a time, instead of whole before the
//! route runs (large uploads on binary routes, `protocol::pieces`). The same limits as
//! a whole body apply while it streams: `MAX_REQUEST_BODY_BYTES` (a chunked body is
//! counted as it goes, so one without an end is cut at the limit), the minimum rate
//! against a client trickling its body, and the I/O timeout per read. A body shorter
//! than its `Content-Length` is a broken request, never a short one relayed as whole.

use std::time::{Duration, Instant};

use super::request::{body_deadline, is_timeout, until, BodyKind, Conn, Limits, ReadError};

/// `BODY_PIECES_OVER_BYTES` by default: bodies up to this size are read whole (and may
/// fail over to another worker); larger ones go in pieces.
pub const DEFAULT_PIECES_OVER: usize = 4 << 20;

/// Where a streamed body stands.
#[derive(Debug, Clone)]
pub struct BodyStream {
    kind: BodyKind,
    /// Bytes of the current chunk (chunked) or of the body (`Content-Length`) not read.
    left: usize,
    /// Bytes read so far.
    read: usize,
    done: bool,
    max: usize,
    io_timeout: Duration,
    started: Instant,
}

impl BodyStream {
    pub(super) fn new(kind: BodyKind, limits: &Limits) -> BodyStream {
        let left = match kind {
            BodyKind::Length(n) => n,
            BodyKind::Chunked => 0,
        };
        BodyStream {
            kind,
            left,
            read: 0,
            done: kind == BodyKind::Length(0),
            max: limits.max_body_bytes,
            io_timeout: limits.io_timeout,
            started: Instant::now(),
        }
    }

    /// The body's length when the client gave one.
    pub fn length(&self) -> Option<usize> {
        match self.kind {
            BodyKind::Length(n) => Some(n),
            BodyKind::Chunked => None,
        }
    }

    /// Whether the whole body was read.
    pub fn is_done(&self) -> bool {
        self.done
    }

    /// Bytes read so far.
    pub fn read_so_far(&self) -> usize {
        self.read
    }

    /// Appends up to `want` more bytes of the body to `out`; fewer only at its end.
    pub fn read_into(
        &mut self,
        conn: &mut Conn,
        out: &mut Vec<u8>,
        want: usize,
    ) -> Result<(), ReadError> {
        let goal = out.len() + want;
        while out.len() < goal && !self.done {
            if self.left == 0 {
                // Only a chunked body gets here: the next chunk's size line.
                self.next_chunk(conn)?;
                continue;
            }
            if conn.buf.is_empty() {
                self.fill(conn)?;
            }
            let n = self.left.min(goal - out.len()).min(conn.buf.len());
            out.extend_from_slice(&conn.buf[..n]);
            conn.buf.drain(..n);
            self.left -= n;
            self.read += n;
            if self.left == 0 {
                match self.kind {
                    BodyKind::Length(_) => self.done = true,
                    BodyKind::Chunked => self.chunk_end(conn)?,
                }
            }
        }
        conn.unread_body = !self.done;
        Ok(())
    }

    fn deadline(&self, len: usize) -> Instant {
        body_deadline(self.started, len, self.io_timeout)
    }

    fn fill(&self, conn: &mut Conn) -> Result<(), ReadError> {
        let wait = until(self.io_timeout, self.deadline(self.read + self.left))?;
        match conn.fill(wait) {
            Ok(0) => Err(ReadError::Io(std::io::ErrorKind::UnexpectedEof.into())),
            Ok(_) => Ok(()),
            Err(e) if is_timeout(&e) => Err(ReadError::Reject(
                408,
                "request body not received in time".into(),
            )),
            Err(e) => Err(ReadError::Io(e)),
        }
    }

    /// Reads a chunk-size line; the last (zero) chunk ends the body with its trailers.
    fn next_chunk(&mut self, conn: &mut Conn) -> Result<(), ReadError> {
        let deadline = self.deadline(self.read);
        let line = conn.read_line(self.io_timeout, deadline)?;
        let size_text = line.split(';').next().unwrap_or("").trim();
        let size = usize::from_str_radix(size_text, 16)
            .map_err(|_| ReadError::Reject(400, "malformed chunk size".into()))?;
        if size == 0 {
            while !conn.read_line(self.io_timeout, deadline)?.is_empty() {}
            self.done = true;
            return Ok(());
        }
        // Compared without adding: a size near usize::MAX must not wrap past the limit.
        if size > self.max.saturating_sub(self.read) {
            return Err(ReadError::Reject(
                413,
                format!("request body exceeds {} bytes", self.max),
            ));
        }
        self.left = size;
        Ok(())
    }

    /// The CRLF after a chunk's data.
    fn chunk_end(&mut self, conn: &mut Conn) -> Result<(), ReadError> {
        let line = conn.read_line(self.io_timeout, self.deadline(self.read))?;
        if !line.is_empty() {
            return Err(ReadError::Reject(400, "malformed chunked body".into()));
        }
        Ok(())
    }
}

/// What the client is told when its streamed body is refused (too large, too slow,
/// malformed); `None` when the connection broke and nobody is there to tell.
pub fn refusal(e: &ReadError) -> Option<crate::server::errors::ApiError> {
    match e {
        ReadError::Reject(status, message) => Some(crate::server::errors::ApiError::new(
            *status,
            super::reject_code(*status),
            message.clone(),
        )),
        ReadError::Closed | ReadError::Io(_) => None,
    }
}

/// How long the rest of a body nobody will read is read and dropped before the
/// connection closes: closed with unread bytes, the client's system would reset it and
/// could throw the answer away before the client read it.
const LINGER: Duration = Duration::from_secs(2);

/// After an answer to a request whose body was left unread (refused, or answered before
/// the upload ended): drops what the client still sends, for a while.
pub fn linger(conn: &mut Conn) {
    if !std::mem::take(&mut conn.unread_body) {
        return;
    }
    let until = Instant::now() + LINGER;
    let mut sink = [0u8; 16 * 1024];
    while Instant::now() < until {
        let _ = conn
            .stream
            .set_read_timeout(Some(Duration::from_millis(250)));
        match std::io::Read::read(&mut conn.stream, &mut sink) {
            Ok(0) | Err(_) => break,
            Ok(_) => {}
        }
    }
    conn.buf.clear();
}
