//! Writing HTTP/1.1 responses: whole bodies with `Content-Length`, and chunked bodies for
//! SSE where every piece goes out in one write the moment it is available.

use std::cell::RefCell;
use std::io::{self, Write};

/// Hop-by-hop and framing headers we never copy from a worker's response.
const SKIPPED: &[&str] = &[
    "connection",
    "keep-alive",
    "transfer-encoding",
    "content-length",
    "te",
    "trailer",
    "upgrade",
    "proxy-authenticate",
    "proxy-connection",
];

thread_local! {
    /// Headers every response written on this thread carries: the CORS headers of an
    /// allowed cross-origin request (`origin.rs`). The HTTP front sets them around one
    /// request on its connection's thread, because that answer is written from many
    /// modules (relay, errors, status, ops, ...) that need not know about CORS.
    static EXTRA: RefCell<Vec<(String, String)>> = const { RefCell::new(Vec::new()) };
}

/// Sets the headers added to every response written on this thread (empty: none).
pub fn set_extra_headers(headers: Vec<(String, String)>) {
    EXTRA.with(|extra| *extra.borrow_mut() = headers);
}

pub fn reason(status: u16) -> &'static str {
    match status {
        100 => "Continue",
        101 => "Switching Protocols",
        200 => "OK",
        201 => "Created",
        202 => "Accepted",
        204 => "No Content",
        303 => "See Other",
        400 => "Bad Request",
        401 => "Unauthorized",
        403 => "Forbidden",
        404 => "Not Found",
        405 => "Method Not Allowed",
        408 => "Request Timeout",
        409 => "Conflict",
        413 => "Payload Too Large",
        422 => "Unprocessable Entity",
        426 => "Upgrade Required",
        429 => "Too Many Requests",
        431 => "Request Header Fields Too Large",
        500 => "Internal Server Error",
        501 => "Not Implemented",
        502 => "Bad Gateway",
        503 => "Service Unavailable",
        504 => "Gateway Timeout",
        _ => "Status",
    }
}

/// How the body is framed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Framing {
    Length(usize),
    Chunked,
    /// HTTP/1.0 streaming: raw bytes until the connection closes.
    UntilClose,
}

/// Renders a status line and headers. `headers` may contain anything; framing headers
/// in it are dropped and replaced by ours.
pub fn head(status: u16, headers: &[(&str, &str)], framing: Framing, keep_alive: bool) -> Vec<u8> {
    let mut out = Vec::with_capacity(256);
    head_into(&mut out, status, headers, framing, keep_alive);
    out
}

/// [`head`] appended to `out`: an answer's head and body leave in one buffer, and the
/// request path allocates nothing for it (writing into a `Vec` cannot fail).
pub fn head_into(
    out: &mut Vec<u8>,
    status: u16,
    headers: &[(&str, &str)],
    framing: Framing,
    keep_alive: bool,
) {
    out.reserve(256);
    let _ = write!(out, "HTTP/1.1 {status} {}\r\n", reason(status));
    EXTRA.with(|extra| {
        let extra = extra.borrow();
        let ours = extra.iter().map(|(n, v)| (n.as_str(), v.as_str()));
        // A backend's own CORS headers give way to ours.
        let theirs = headers
            .iter()
            .filter(|(n, _)| !extra.iter().any(|(e, _)| e.eq_ignore_ascii_case(n)))
            .copied();
        for (name, value) in theirs.chain(ours) {
            if SKIPPED.iter().any(|s| name.eq_ignore_ascii_case(s)) || !header_is_safe(name, value)
            {
                continue;
            }
            out.extend_from_slice(name.as_bytes());
            out.extend_from_slice(b": ");
            out.extend_from_slice(value.as_bytes());
            out.extend_from_slice(b"\r\n");
        }
    });
    match framing {
        Framing::Length(n) => {
            let _ = write!(out, "content-length: {n}\r\n");
        }
        Framing::Chunked => out.extend_from_slice(b"transfer-encoding: chunked\r\n"),
        Framing::UntilClose => {}
    }
    let keep_alive = keep_alive && framing != Framing::UntilClose;
    out.extend_from_slice(if keep_alive {
        b"connection: keep-alive\r\n\r\n"
    } else {
        b"connection: close\r\n\r\n"
    });
}

/// A worker could send header text that would split our response; refuse it.
fn header_is_safe(name: &str, value: &str) -> bool {
    !name.is_empty()
        && name.bytes().all(|b| b.is_ascii_graphic() && b != b':')
        && !value.bytes().any(|b| b == b'\r' || b == b'\n')
}

/// Writes a complete response in one write.
pub fn write_full(
    out: &mut impl Write,
    status: u16,
    headers: &[(&str, &str)],
    body: &[u8],
    keep_alive: bool,
) -> io::Result<()> {
    let mut buf = head(status, headers, Framing::Length(body.len()), keep_alive);
    buf.extend_from_slice(body);
    out.write_all(&buf)?;
    out.flush()
}

/// Appends `data` to `buf` framed as one chunk (no-op for empty data, which would
/// otherwise end the body).
pub fn push_chunk(buf: &mut Vec<u8>, data: &[u8], framing: Framing) {
    if data.is_empty() {
        return;
    }
    if framing == Framing::Chunked {
        buf.extend_from_slice(format!("{:x}\r\n", data.len()).as_bytes());
        buf.extend_from_slice(data);
        buf.extend_from_slice(b"\r\n");
    } else {
        buf.extend_from_slice(data);
    }
}

/// Appends the end-of-body marker.
pub fn push_end(buf: &mut Vec<u8>, framing: Framing) {
    if framing == Framing::Chunked {
        buf.extend_from_slice(b"0\r\n\r\n");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn head_drops_framing_and_unsafe_headers() {
        let h = head(
            200,
            &[
                ("content-type", "application/json"),
                ("Content-Length", "99"),
                ("x-bad", "a\r\nb"),
                ("Transfer-Encoding", "chunked"),
            ],
            Framing::Length(2),
            true,
        );
        let h = String::from_utf8(h).unwrap();
        assert!(h.starts_with("HTTP/1.1 200 OK\r\n"));
        assert!(h.contains("content-type: application/json\r\n"));
        assert!(h.contains("content-length: 2\r\n"));
        assert!(!h.contains("99") && !h.contains("x-bad") && !h.contains("Transfer-Encoding"));
        assert!(h.ends_with("connection: keep-alive\r\n\r\n"));
    }

    #[test]
    fn chunks_are_framed() {
        let mut buf = Vec::new();
        push_chunk(&mut buf, b"data: x\n\n", Framing::Chunked);
        push_chunk(&mut buf, b"", Framing::Chunked);
        push_end(&mut buf, Framing::Chunked);
        assert_eq!(buf, b"9\r\ndata: x\n\n\r\n0\r\n\r\n");
    }
}
