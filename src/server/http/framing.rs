//! How a request body is framed (RFC 9112 §6): `Content-Length` or chunked, and
//! nothing ambiguous in between.

use super::request::{BodyKind, ReadError};

/// How the body is framed, as RFC 9112 §6 asks: `Transfer-Encoding` must end in exactly one
/// `chunked` (the only coding we decode; others get 501, `chunked` not last gets 400),
/// and must not come with `Content-Length` or in HTTP/1.0; `Content-Length` must be one
/// field of digits only (no sign, no list, no repeat). Ambiguous framing is how requests
/// are smuggled past a proxy in front of us, so it is refused, never guessed.
pub(crate) fn body_kind(headers: &[(String, String)], http10: bool) -> Result<BodyKind, ReadError> {
    let bad = |m: &str| ReadError::Reject(400, m.to_string());
    let codings: Vec<String> = headers
        .iter()
        .filter(|(n, _)| n == "transfer-encoding")
        .flat_map(|(_, v)| v.split(','))
        .map(|c| c.trim().to_ascii_lowercase())
        .collect();
    let lengths: Vec<&str> = headers
        .iter()
        .filter(|(n, _)| n == "content-length")
        .map(|(_, v)| v.as_str())
        .collect();
    if let Some((last, before)) = codings.split_last() {
        if http10 {
            return Err(bad("Transfer-Encoding is not allowed in HTTP/1.0"));
        }
        if !lengths.is_empty() {
            return Err(bad("both Transfer-Encoding and Content-Length"));
        }
        if last != "chunked" || before.iter().any(|c| c == "chunked") {
            return Err(bad("Transfer-Encoding must end in one chunked"));
        }
        if !before.is_empty() {
            return Err(ReadError::Reject(
                501,
                "only the chunked transfer coding is supported".into(),
            ));
        }
        return Ok(BodyKind::Chunked);
    }
    match lengths.as_slice() {
        [] => Ok(BodyKind::Length(0)),
        [v] if !v.is_empty() && v.bytes().all(|b| b.is_ascii_digit()) => v
            .parse()
            .map(BodyKind::Length)
            .map_err(|_| bad("invalid Content-Length")),
        [_] => Err(bad("invalid Content-Length")),
        _ => Err(bad("duplicate Content-Length")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::server::http::request::parse_head;

    fn status_of(raw: &[u8]) -> Result<BodyKind, u16> {
        match parse_head(raw) {
            Ok(Some((_, kind, _))) => Ok(kind),
            Err(ReadError::Reject(status, _)) => Err(status),
            other => panic!("unexpected {other:?}"),
        }
    }

    #[test]
    fn signed_listed_or_repeated_content_length_is_400() {
        for raw in [
            &b"POST / HTTP/1.1\r\nContent-Length: +5\r\n\r\n"[..],
            b"POST / HTTP/1.1\r\nContent-Length: -5\r\n\r\n",
            b"POST / HTTP/1.1\r\nContent-Length: 5, 5\r\n\r\n",
            b"POST / HTTP/1.1\r\nContent-Length: 5\r\nContent-Length: 5\r\n\r\n",
            b"POST / HTTP/1.1\r\nContent-Length: 5\r\nContent-Length: 7\r\n\r\n",
            b"POST / HTTP/1.1\r\nContent-Length: \r\n\r\n",
        ] {
            assert_eq!(status_of(raw), Err(400), "{}", String::from_utf8_lossy(raw));
        }
        assert_eq!(
            status_of(b"POST / HTTP/1.1\r\nContent-Length: 05\r\n\r\n"),
            Ok(BodyKind::Length(5))
        );
    }

    #[test]
    fn transfer_encoding_must_be_exactly_chunked_last() {
        for (raw, want) in [
            (
                &b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n"[..],
                Ok(BodyKind::Chunked),
            ),
            (
                b"POST / HTTP/1.1\r\nTransfer-Encoding: Chunked \r\n\r\n",
                Ok(BodyKind::Chunked),
            ),
            (
                b"POST / HTTP/1.1\r\nTransfer-Encoding: xchunked\r\n\r\n",
                Err(400),
            ),
            (
                b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked, gzip\r\n\r\n",
                Err(400),
            ),
            (
                b"POST / HTTP/1.1\r\nTransfer-Encoding: gzip\r\n\r\n",
                Err(400),
            ),
            (
                b"POST / HTTP/1.1\r\nTransfer-Encoding: gzip, chunked\r\n\r\n",
                Err(501),
            ),
            (
                b"POST / HTTP/1.1\r\nTransfer-Encoding: gzip\r\nTransfer-Encoding: chunked\r\n\r\n",
                Err(501),
            ),
            (
                b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked, chunked\r\n\r\n",
                Err(400),
            ),
            (
                b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\nContent-Length: 3\r\n\r\n",
                Err(400),
            ),
            (
                b"POST / HTTP/1.0\r\nTransfer-Encoding: chunked\r\n\r\n",
                Err(400),
            ),
        ] {
            assert_eq!(status_of(raw), want, "{}", String::from_utf8_lossy(raw));
        }
    }
}
