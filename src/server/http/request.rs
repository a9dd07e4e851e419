//! Reading one HTTP/1.1 request from a client connection.
//!
//! We own the accepted connection (tiny_http would hide it, and we need it to notice a
//! client that hangs up while its answer is pending). Supported: keep-alive and
//! pipelining, `Content-Length` and chunked request bodies, `Expect: 100-continue`, limits
//! on header and body size, an idle timeout between requests and a deadline for a slow
//! client to finish sending its head.

use std::io::{self, Write};
use std::net::SocketAddr;

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::budget::{BodyBudget, BodyHold};
use crate::net::Stream;

/// Bytes of request bodies held at once by default (`MAX_BUFFERED_BODY_BYTES`): sixteen
/// bodies of the largest size.
pub const DEFAULT_BODY_BUDGET: usize = 512 << 20;

/// Size and time limits for reading requests.
#[derive(Debug, Clone)]
pub struct Limits {
    pub max_header_bytes: usize,
    pub max_body_bytes: usize,
    /// Shared by every connection: bytes of bodies in memory at once.
    pub body_budget: Arc<BodyBudget>,
    /// How long a keep-alive connection may sit idle before the next request.
    pub idle_timeout: Duration,
    /// How long one read may block, and the whole head may take, once a request began.
    pub io_timeout: Duration,
    /// How long a client may stop reading an answer (zero: no limit).
    pub write_timeout: Duration,
    /// Bodies of routes that take them in pieces, when larger than this, are not read
    /// here but by the route as they are relayed ([`super::pieces`]); zero: never.
    pub pieces_over: usize,
}

impl Default for Limits {
    fn default() -> Limits {
        Limits {
            max_header_bytes: 64 * 1024,
            max_body_bytes: 32 * 1024 * 1024,
            body_budget: BodyBudget::new(DEFAULT_BODY_BUDGET),
            idle_timeout: Duration::from_secs(75),
            io_timeout: Duration::from_secs(30),
            write_timeout: Duration::from_secs(30),
            pieces_over: super::pieces::DEFAULT_PIECES_OVER,
        }
    }
}

/// A parsed request. Header names are lower-case.
#[derive(Debug, Clone)]
pub struct Request {
    pub method: String,
    pub path: String,
    pub query: String,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
    /// The body's share of [`Limits::body_budget`], given back when the request (and
    /// every clone) is dropped.
    pub hold: Option<Arc<BodyHold>>,
    pub keep_alive: bool,
    pub http10: bool,
    /// A body left on the connection for the route to read in pieces
    /// ([`Conn::read_request_or_defer`]); `body` then is empty.
    pub pending: Option<super::pieces::BodyStream>,
}

impl Request {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }

    /// A query parameter, percent-decoded.
    pub fn query_param(&self, name: &str) -> Option<String> {
        self.query.split('&').find_map(|pair| {
            let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
            (k == name).then(|| percent_decode(v))
        })
    }
}

/// Why no request could be read.
#[derive(Debug)]
pub enum ReadError {
    /// The connection closed or idled out between requests: nothing to answer.
    Closed,
    /// The connection failed mid-request: nothing sensible to answer.
    Io(io::Error),
    /// The request is unacceptable: answer with this status and message, then close.
    Reject(u16, String),
}

/// One client connection with its read buffer (bytes past the current request stay
/// here for the next one, or for the WebSocket after an upgrade).
pub struct Conn {
    pub stream: Stream,
    pub peer: SocketAddr,
    /// `X-Request-Id` of the response being written (set by the route table for
    /// routes that are not relayed; relayed requests carry their own).
    pub request_id: Option<String>,
    pub(super) buf: Vec<u8>,
    /// A body left for the route to read ([`Request::pending`]) is not all read: an
    /// answer written meanwhile is followed by a linger ([`super::pieces::linger`]).
    pub(super) unread_body: bool,
    /// The read timeout the socket has now; changed only when a read needs another
    /// (a request that arrives in one piece costs no `setsockopt` at all).
    read_timeout: Option<Duration>,
    /// Where the dispatcher thread writes this connection's whole answers, made on the
    /// first one (`relay/direct.rs`).
    pub(crate) outlet: Option<Arc<crate::server::relay::Outlet>>,
}

const READ_CHUNK: usize = 16 * 1024;

impl Conn {
    pub fn new(stream: Stream, peer: SocketAddr) -> Conn {
        Conn {
            stream,
            peer,
            request_id: None,
            buf: Vec::new(),
            unread_body: false,
            read_timeout: None,
            outlet: None,
        }
    }

    /// A connection whose first bytes were already read (the fuzz targets feed a whole
    /// input this way).
    pub(crate) fn with_buffered(stream: Stream, peer: SocketAddr, buf: Vec<u8>) -> Conn {
        Conn {
            buf,
            ..Conn::new(stream, peer)
        }
    }

    /// Writes a JSON response with this request's id; returns whether the connection
    /// may be reused.
    pub fn write_json(&mut self, status: u16, body: &serde_json::Value, keep_alive: bool) -> bool {
        let body = body.to_string();
        self.write_full(status, "application/json", body.as_bytes(), keep_alive)
    }

    /// Writes a complete response with this request's id.
    pub fn write_full(
        &mut self,
        status: u16,
        content_type: &str,
        body: &[u8],
        keep_alive: bool,
    ) -> bool {
        let mut headers = vec![("content-type", content_type)];
        if let Some(id) = self.request_id.as_deref() {
            headers.push(("x-request-id", id));
        }
        super::response::write_full(&mut self.stream, status, &headers, body, keep_alive).is_ok()
            && keep_alive
    }

    /// Bytes read past the last request (used after a WebSocket upgrade).
    /// Whether bytes past the current request were read already (a pipelined request).
    pub fn has_buffered(&self) -> bool {
        !self.buf.is_empty()
    }

    pub fn take_buffered(&mut self) -> Vec<u8> {
        std::mem::take(&mut self.buf)
    }

    /// Reads more bytes, waiting at most `timeout`; `Ok(0)` is end of stream.
    pub(super) fn fill(&mut self, timeout: Duration) -> io::Result<usize> {
        // A zero timeout is refused by the OS; as before, the read then just blocks.
        if self.read_timeout != Some(timeout) && self.stream.set_read_timeout(Some(timeout)).is_ok()
        {
            self.read_timeout = Some(timeout);
        }
        self.stream.read_append(&mut self.buf, READ_CHUNK)
    }

    pub fn read_request(&mut self, limits: &Limits) -> Result<Request, ReadError> {
        self.read_request_or_defer(limits, &|_| false)
    }

    /// [`Conn::read_request`], except that the body of a request `streams` accepts is
    /// left on the connection when it may be larger than [`Limits::pieces_over`]: the
    /// route reads it through [`Request::pending`]. Such a connection is not reused
    /// (a route that refuses the request leaves its body unread).
    pub fn read_request_or_defer(
        &mut self,
        limits: &Limits,
        streams: &dyn Fn(&Request) -> bool,
    ) -> Result<Request, ReadError> {
        let (mut req, body_kind) = self.read_head(limits)?;
        if let BodyKind::Length(n) = body_kind {
            if n > limits.max_body_bytes {
                return Err(too_large(limits));
            }
        }
        let defer = limits.pieces_over > 0
            && match body_kind {
                BodyKind::Length(n) => n > limits.pieces_over,
                BodyKind::Chunked => true,
            }
            && streams(&req);
        let reserve = match body_kind {
            // What a deferred body holds at once: its first part, then a piece.
            _ if defer => limits.pieces_over + crate::protocol::pieces::PIECE_BYTES,
            BodyKind::Length(n) => n,
            BodyKind::Chunked => 0,
        };
        let mut hold = limits
            .body_budget
            .take(reserve)
            .ok_or_else(|| over_budget(limits))?;
        if body_kind != BodyKind::Length(0)
            && req
                .header("expect")
                .is_some_and(|v| v.eq_ignore_ascii_case("100-continue"))
        {
            self.stream
                .write_all(b"HTTP/1.1 100 Continue\r\n\r\n")
                .map_err(ReadError::Io)?;
        }
        if defer {
            self.unread_body = true;
            req.pending = Some(super::pieces::BodyStream::new(body_kind, limits));
            req.keep_alive = false;
            req.hold = Some(Arc::new(hold));
            return Ok(req);
        }
        req.body = match body_kind {
            BodyKind::Length(n) => {
                let deadline = body_deadline(Instant::now(), n, limits.io_timeout);
                self.read_exact_body(n, limits.io_timeout, deadline)?
            }
            BodyKind::Chunked => self.read_chunked_body(limits, &mut hold)?,
        };
        req.hold = Some(Arc::new(hold));
        Ok(req)
    }

    fn read_head(&mut self, limits: &Limits) -> Result<(Request, BodyKind), ReadError> {
        let mut started: Option<Instant> = None;
        loop {
            if !self.buf.is_empty() && started.is_none() {
                started = Some(Instant::now());
            }
            if let Some(parsed) = parse_head(&self.buf)? {
                let (req, kind, used) = parsed;
                if used > limits.max_header_bytes {
                    return Err(ReadError::Reject(
                        431,
                        "request header fields too large".into(),
                    ));
                }
                self.buf.drain(..used);
                return Ok((req, kind));
            }
            if self.buf.len() > limits.max_header_bytes {
                return Err(ReadError::Reject(
                    431,
                    "request header fields too large".into(),
                ));
            }
            if started.is_some_and(|s| s.elapsed() > limits.io_timeout) {
                return Err(ReadError::Reject(
                    408,
                    "request head not received in time".into(),
                ));
            }
            // Between requests the idle timeout applies; once a request began, the
            // (shorter) I/O timeout.
            let timeout = match started {
                None => limits.idle_timeout,
                Some(_) => limits.io_timeout,
            };
            match self.fill(timeout) {
                Ok(0) if self.buf.is_empty() => return Err(ReadError::Closed),
                Ok(0) => return Err(ReadError::Io(io::ErrorKind::UnexpectedEof.into())),
                Ok(_) => {}
                Err(e) if self.buf.is_empty() && is_timeout(&e) => return Err(ReadError::Closed),
                Err(e) if is_timeout(&e) => {
                    return Err(ReadError::Reject(
                        408,
                        "request head not received in time".into(),
                    ))
                }
                Err(e) => return Err(ReadError::Io(e)),
            }
        }
    }

    fn read_exact_body(
        &mut self,
        n: usize,
        timeout: Duration,
        deadline: Instant,
    ) -> Result<Vec<u8>, ReadError> {
        while self.buf.len() < n {
            match self.fill(until(timeout, deadline)?) {
                Ok(0) => return Err(ReadError::Io(io::ErrorKind::UnexpectedEof.into())),
                Ok(_) => {}
                Err(e) if is_timeout(&e) => {
                    return Err(ReadError::Reject(
                        408,
                        "request body not received in time".into(),
                    ))
                }
                Err(e) => return Err(ReadError::Io(e)),
            }
        }
        Ok(self.buf.drain(..n).collect())
    }

    /// Reads a line ending in CRLF (without it), at most 4 KiB.
    pub(super) fn read_line(
        &mut self,
        timeout: Duration,
        deadline: Instant,
    ) -> Result<String, ReadError> {
        loop {
            if let Some(pos) = self.buf.windows(2).position(|w| w == b"\r\n") {
                let line = String::from_utf8_lossy(&self.buf[..pos]).into_owned();
                self.buf.drain(..pos + 2);
                return Ok(line);
            }
            if self.buf.len() > 4096 {
                return Err(ReadError::Reject(400, "malformed chunked body".into()));
            }
            match self.fill(until(timeout, deadline)?) {
                Ok(0) => return Err(ReadError::Io(io::ErrorKind::UnexpectedEof.into())),
                Ok(_) => {}
                Err(e) => return Err(ReadError::Io(e)),
            }
        }
    }

    fn read_chunked_body(
        &mut self,
        limits: &Limits,
        hold: &mut BodyHold,
    ) -> Result<Vec<u8>, ReadError> {
        let started = Instant::now();
        let mut body = Vec::new();
        loop {
            let deadline = body_deadline(started, body.len(), limits.io_timeout);
            let line = self.read_line(limits.io_timeout, deadline)?;
            let size_text = line.split(';').next().unwrap_or("").trim();
            let size = usize::from_str_radix(size_text, 16)
                .map_err(|_| ReadError::Reject(400, "malformed chunk size".into()))?;
            if size == 0 {
                while !self.read_line(limits.io_timeout, deadline)?.is_empty() {}
                return Ok(body);
            }
            // Compared without adding: a size near usize::MAX must not wrap past the limit.
            if size > limits.max_body_bytes.saturating_sub(body.len()) {
                return Err(too_large(limits));
            }
            if !hold.grow(size) {
                return Err(over_budget(limits));
            }
            let deadline = body_deadline(started, body.len() + size, limits.io_timeout);
            let mut chunk = self.read_exact_body(size + 2, limits.io_timeout, deadline)?;
            if !chunk.ends_with(b"\r\n") {
                return Err(ReadError::Reject(400, "malformed chunked body".into()));
            }
            chunk.truncate(size);
            body.extend_from_slice(&chunk);
        }
    }
}

/// The slowest average rate a request body may arrive at (after a first `io_timeout`
/// of grace): a client trickling its body (slow loris) is cut off, while a 32 MiB body
/// still has more than half an hour.
const MIN_BODY_RATE: usize = 16 * 1024;

/// When a body of `len` bytes begun at `started` must have arrived.
pub(super) fn body_deadline(started: Instant, len: usize, io_timeout: Duration) -> Instant {
    started + io_timeout + Duration::from_secs((len / MIN_BODY_RATE) as u64)
}

/// How long the next read may wait: `timeout`, or less when the body's deadline is
/// nearer; a 408 once it passed.
pub(super) fn until(timeout: Duration, deadline: Instant) -> Result<Duration, ReadError> {
    let left = deadline.saturating_duration_since(Instant::now());
    if left.is_zero() {
        return Err(ReadError::Reject(
            408,
            "request body not received in time".into(),
        ));
    }
    Ok(timeout.min(left))
}

fn too_large(limits: &Limits) -> ReadError {
    ReadError::Reject(
        413,
        format!("request body exceeds {} bytes", limits.max_body_bytes),
    )
}

fn over_budget(limits: &Limits) -> ReadError {
    ReadError::Reject(
        503,
        format!(
            "the server is receiving {} bytes of request bodies already \
             (MAX_BUFFERED_BODY_BYTES); retry shortly",
            limits.body_budget.max()
        ),
    )
}

pub(super) fn is_timeout(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
    )
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum BodyKind {
    Length(usize),
    Chunked,
}

pub(crate) type Head = (Request, BodyKind, usize);

/// Parses a complete request head from `buf`, or `None` if more bytes are needed.
pub(crate) fn parse_head(buf: &[u8]) -> Result<Option<Head>, ReadError> {
    let mut slots = [httparse::EMPTY_HEADER; 96];
    let mut parsed = httparse::Request::new(&mut slots);
    let used = match parsed.parse(buf) {
        Ok(httparse::Status::Complete(n)) => n,
        Ok(httparse::Status::Partial) => return Ok(None),
        Err(httparse::Error::TooManyHeaders) => {
            return Err(ReadError::Reject(431, "too many header fields".into()))
        }
        Err(e) => return Err(ReadError::Reject(400, format!("malformed request: {e}"))),
    };
    let method = parsed.method.unwrap_or("GET").to_string();
    let target = parsed.path.unwrap_or("/");
    let (path, query) = target.split_once('?').unwrap_or((target, ""));
    let http10 = parsed.version == Some(0);
    let headers: Vec<(String, String)> = parsed
        .headers
        .iter()
        .map(|h| {
            (
                h.name.to_ascii_lowercase(),
                String::from_utf8_lossy(h.value).trim().to_string(),
            )
        })
        .collect();
    let get = |name: &str| {
        headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    };
    let connection = get("connection").unwrap_or("").to_ascii_lowercase();
    let keep_alive = if http10 {
        connection.contains("keep-alive")
    } else {
        !connection.contains("close")
    };
    let kind = super::framing::body_kind(&headers, http10)?;
    let req = Request {
        method,
        path: path.to_string(),
        query: query.to_string(),
        headers,
        body: Vec::new(),
        hold: None,
        keep_alive,
        http10,
        pending: None,
    };
    Ok(Some((req, kind, used)))
}

/// Decodes `%XX` escapes and `+` (form encoding) in a query or form value.
pub fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let escaped = match bytes.get(i..i + 3) {
            Some([b'%', hi, lo]) => hex_val(*hi).zip(hex_val(*lo)).map(|(h, l)| h * 16 + l),
            _ => None,
        };
        match (escaped, bytes[i]) {
            (Some(b), _) => {
                out.push(b);
                i += 3;
            }
            (None, b'+') => {
                out.push(b' ');
                i += 1;
            }
            (None, b) => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn hex_val(c: u8) -> Option<u8> {
    (c as char).to_digit(16).map(|d| d as u8)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_head_with_body_length_and_query() {
        let raw = b"POST /v1/worker/connect?provider=local&worker_secret=a%2Bb HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\nabc";
        let (req, kind, used) = parse_head(raw).unwrap().unwrap();
        assert_eq!(req.method, "POST");
        assert_eq!(req.path, "/v1/worker/connect");
        assert_eq!(req.query_param("provider").as_deref(), Some("local"));
        assert_eq!(req.query_param("worker_secret").as_deref(), Some("a+b"));
        assert_eq!(kind, BodyKind::Length(3));
        assert_eq!(&raw[used..], b"abc");
        assert!(req.keep_alive);
    }

    #[test]
    fn partial_head_needs_more_and_garbage_is_rejected() {
        assert!(parse_head(b"GET / HTTP/1.1\r\nHost").unwrap().is_none());
        assert!(matches!(
            parse_head(b"\x00\x01 nonsense\r\n\r\n"),
            Err(ReadError::Reject(400, _))
        ));
        assert!(matches!(
            parse_head(b"POST / HTTP/1.1\r\nContent-Length: x\r\n\r\n"),
            Err(ReadError::Reject(400, _))
        ));
    }

    #[test]
    fn connection_header_decides_keep_alive() {
        let (req, ..) = parse_head(b"GET / HTTP/1.1\r\nConnection: close\r\n\r\n")
            .unwrap()
            .unwrap();
        assert!(!req.keep_alive);
        let (req, ..) = parse_head(b"GET / HTTP/1.0\r\n\r\n").unwrap().unwrap();
        assert!(!req.keep_alive && req.http10);
    }

    #[test]
    fn a_chunk_size_near_usize_max_is_too_large_not_an_overflow() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let sock = std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (peer, addr) = listener.accept().unwrap();
        drop(peer);
        // Found by the `http_request` fuzz target: `body.len() + size` overflowed.
        let raw = b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n1\r\na\r\nffffffffffffffff\r\nb\r\n";
        let mut conn = Conn::with_buffered(Stream::plain(sock), addr, raw.to_vec());
        match conn.read_request(&Limits::default()) {
            Err(ReadError::Reject(413, _)) => {}
            other => panic!("expected 413, got {other:?}"),
        }
    }

    #[test]
    fn percent_decoding_is_lenient() {
        assert_eq!(percent_decode("a%20b%zz%"), "a b%zz%");
    }
}
