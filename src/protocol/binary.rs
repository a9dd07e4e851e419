//! Binary bodies over the text protocol (extension, [`FEATURE_BINARY_BODIES`]).
//!
//! Audio uploads, multipart forms and generated speech are bytes, not UTF-8, and every
//! protocol message is a JSON text frame. A `request` whose `body_encoding` is
//! [`BASE64`] carries its body base64-encoded (standard alphabet, padded), and the
//! worker answers it the same way: every `response_chunk.chunk` and
//! `response_complete.body` of that request is the base64 of the backend's bytes. Each
//! chunk is encoded on its own, so the server decodes it as it arrives.
//!
//! Why base64 in the existing messages rather than binary WebSocket frames: the messages,
//! their size checks (`size.rs`), cancellation and failover stay exactly those of chat;
//! an original peer never sees the field because the server sends such a request only
//! to a worker that listed the feature. The cost is a third more bytes on the wire and
//! an encode plus a decode pass, measured by `make bench-binary` (about 100 MB/s each
//! way on one busy core of the size-optimised release build; speech and transcription
//! boxes produce far less).

/// Worker feature: it decodes `body_encoding: "base64"` request bodies and answers
/// such requests in base64. The server sends binary routes only to workers listing it.
pub const FEATURE_BINARY_BODIES: &str = "binary_bodies";
/// The one `body_encoding` defined.
pub const BASE64: &str = "base64";

const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

/// Bytes `len` raw bytes take once encoded.
pub fn encoded_len(len: usize) -> usize {
    len.div_ceil(3) * 4
}

/// Standard base64 with padding. Writes into a buffer of the final size, three bytes
/// to four at a time (bodies are up to hundreds of MB).
pub fn encode(bytes: &[u8]) -> String {
    let mut out = vec![0u8; encoded_len(bytes.len())];
    let sym = |n: u32, shift: u32| ALPHABET[(n >> shift) as usize & 63];
    let whole = bytes.len() / 3;
    for (src, dst) in bytes.chunks_exact(3).zip(out.chunks_exact_mut(4)) {
        let n = u32::from(src[0]) << 16 | u32::from(src[1]) << 8 | u32::from(src[2]);
        dst.copy_from_slice(&[sym(n, 18), sym(n, 12), sym(n, 6), sym(n, 0)]);
    }
    let rest = &bytes[whole * 3..];
    if !rest.is_empty() {
        let b = rest.get(1).copied().unwrap_or(0);
        let n = u32::from(rest[0]) << 16 | u32::from(b) << 8;
        let third = if rest.len() == 2 { sym(n, 6) } else { b'=' };
        out[whole * 4..].copy_from_slice(&[sym(n, 18), sym(n, 12), third, b'=']);
    }
    // Every byte written is from the ASCII alphabet or '='.
    String::from_utf8(out).unwrap_or_default()
}

/// The value of one alphabet byte; 64 for anything else.
const fn value_table() -> [u8; 256] {
    let mut t = [64u8; 256];
    let mut i = 0;
    while i < 64 {
        t[ALPHABET[i] as usize] = i as u8;
        i += 1;
    }
    t
}
const VALUES: [u8; 256] = value_table();

/// Text that is not padded standard base64.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BadBase64;

impl std::fmt::Display for BadBase64 {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("body is not valid base64")
    }
}

/// Decodes padded standard base64; anything else (whitespace included) is refused.
pub fn decode(text: &str) -> Result<Vec<u8>, BadBase64> {
    let bytes = text.as_bytes();
    if bytes.len() % 4 != 0 {
        return Err(BadBase64);
    }
    let pad = bytes.iter().rev().take_while(|b| **b == b'=').count();
    if pad > 2 {
        return Err(BadBase64);
    }
    // Every quad but a padded last one decodes without looking for padding.
    let full = if pad > 0 {
        bytes.len() - 4
    } else {
        bytes.len()
    };
    let mut out = vec![0u8; full / 4 * 3 + if pad > 0 { 3 - pad } else { 0 }];
    let value = |b: u8| u32::from(VALUES[b as usize]);
    for (src, dst) in bytes[..full].chunks_exact(4).zip(out.chunks_exact_mut(3)) {
        let (a, b, c, d) = (value(src[0]), value(src[1]), value(src[2]), value(src[3]));
        if (a | b | c | d) & 64 != 0 {
            return Err(BadBase64);
        }
        let n = a << 18 | b << 12 | c << 6 | d;
        dst.copy_from_slice(&[(n >> 16) as u8, (n >> 8) as u8, n as u8]);
    }
    if pad > 0 {
        let last = &bytes[full..];
        let c = if pad == 1 { value(last[2]) } else { 0 };
        let (a, b) = (value(last[0]), value(last[1]));
        if (a | b | c) & 64 != 0 {
            return Err(BadBase64);
        }
        let n = a << 18 | b << 12 | c << 6;
        let three = [(n >> 16) as u8, (n >> 8) as u8];
        let at = full / 4 * 3;
        out[at..].copy_from_slice(&three[..3 - pad]);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_vectors() {
        for (raw, enc) in [
            ("", ""),
            ("f", "Zg=="),
            ("fo", "Zm8="),
            ("foo", "Zm9v"),
            ("foob", "Zm9vYg=="),
            ("fooba", "Zm9vYmE="),
            ("foobar", "Zm9vYmFy"),
        ] {
            assert_eq!(encode(raw.as_bytes()), enc);
            assert_eq!(decode(enc).unwrap(), raw.as_bytes());
            assert_eq!(encoded_len(raw.len()), enc.len());
        }
    }

    #[test]
    fn every_byte_round_trips() {
        let all: Vec<u8> = (0..=255u8).cycle().take(1000).collect();
        for len in 0..40 {
            assert_eq!(decode(&encode(&all[..len])).unwrap(), &all[..len]);
        }
        assert_eq!(decode(&encode(&all)).unwrap(), all);
    }

    #[test]
    fn refuses_what_is_not_base64() {
        for bad in ["Zg=", "Z===", "Zm 9v", "Zm9v\n", "Zg==Zg==", "Zm9*", "===="] {
            assert_eq!(decode(bad), Err(BadBase64), "{bad:?}");
        }
    }
}
