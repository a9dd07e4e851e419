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
//! an encode plus a decode pass, measured by `make bench-binary` (a few hundred MB/s on
//! one core, far above what the boxes behind the relay produce).

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

/// Standard base64 with padding.
pub fn encode(bytes: &[u8]) -> String {
    let mut out = Vec::with_capacity(encoded_len(bytes.len()));
    let mut triples = bytes.chunks_exact(3);
    for t in &mut triples {
        let n = u32::from(t[0]) << 16 | u32::from(t[1]) << 8 | u32::from(t[2]);
        out.extend_from_slice(&[
            ALPHABET[(n >> 18) as usize & 63],
            ALPHABET[(n >> 12) as usize & 63],
            ALPHABET[(n >> 6) as usize & 63],
            ALPHABET[n as usize & 63],
        ]);
    }
    match *triples.remainder() {
        [a] => {
            let n = u32::from(a) << 16;
            out.extend_from_slice(&[
                ALPHABET[(n >> 18) as usize & 63],
                ALPHABET[(n >> 12) as usize & 63],
                b'=',
                b'=',
            ]);
        }
        [a, b] => {
            let n = u32::from(a) << 16 | u32::from(b) << 8;
            out.extend_from_slice(&[
                ALPHABET[(n >> 18) as usize & 63],
                ALPHABET[(n >> 12) as usize & 63],
                ALPHABET[(n >> 6) as usize & 63],
                b'=',
            ]);
        }
        _ => {}
    }
    // Every byte pushed is from the ASCII alphabet or '='.
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
    let mut out = Vec::with_capacity(bytes.len() / 4 * 3);
    let last = bytes.len() / 4;
    for (i, quad) in bytes.chunks_exact(4).enumerate() {
        let pad = if i + 1 == last {
            quad.iter().rev().take_while(|b| **b == b'=').count()
        } else {
            0
        };
        if pad > 2 {
            return Err(BadBase64);
        }
        let mut n = 0u32;
        for (j, b) in quad.iter().enumerate() {
            let v = if j >= 4 - pad { 0 } else { VALUES[*b as usize] };
            if v == 64 {
                return Err(BadBase64);
            }
            n = n << 6 | u32::from(v);
        }
        let three = [(n >> 16) as u8, (n >> 8) as u8, n as u8];
        out.extend_from_slice(&three[..3 - pad]);
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
