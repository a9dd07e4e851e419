//! How many bytes a message takes on the WebSocket, known before it is built.
//!
//! Bodies travel as JSON strings, and escaping can multiply them: `\n` becomes two bytes,
//! a control byte six (`\u0001`). A 32 MiB body of newlines is a 64 MiB message, past
//! what a worker accepts; a peer that receives a message over its limit drops the whole
//! connection, and every request on it. So the sender sizes the *encoded* message and
//! refuses what the other side cannot receive, instead of the body's raw length.

use super::{HeaderMap, RequestMessage, ResponseComplete, ServerMessage, WorkerMessage};

/// Room for the field names, the `type` tag, numbers and punctuation of one message:
/// more than any of them needs, so the sizes below are upper bounds.
pub const ENVELOPE: usize = 512;

/// Bytes `s` takes as a JSON string, quotes included, as `serde_json` writes it (it
/// escapes only `"`, `\` and bytes below 0x20; non-ASCII stays as UTF-8). Bodies are
/// tens of MiB, so eight bytes are looked at at once and only a word holding a byte to
/// escape is counted byte by byte.
pub fn json_string_len(s: &str) -> usize {
    let bytes = s.as_bytes();
    let mut words = bytes.chunks_exact(8);
    let mut extra = 0;
    for chunk in &mut words {
        let mut word = [0u8; 8];
        word.copy_from_slice(chunk);
        if needs_escape(u64::from_le_bytes(word)) {
            extra += chunk.iter().map(|b| escape_extra(*b)).sum::<usize>();
        }
    }
    extra += words
        .remainder()
        .iter()
        .map(|b| escape_extra(*b))
        .sum::<usize>();
    2 + bytes.len() + extra
}

/// Bytes an escape adds: `\n` one, `\u0001` five. A table rather than a `match`: in a
/// JSON body (quotes every few bytes) most words hold a byte to escape, and a branch
/// per byte cost three times what a lookup does.
fn escape_extra(b: u8) -> usize {
    usize::from(ESCAPE_EXTRA[usize::from(b)])
}

const ESCAPE_EXTRA: [u8; 256] = escape_table();

const fn escape_table() -> [u8; 256] {
    let mut table = [0u8; 256];
    let mut b = 0;
    while b < 0x20 {
        table[b] = 5;
        b += 1;
    }
    let short = [b'"', b'\\', b'\n', b'\r', b'\t', 0x08, 0x0c];
    let mut i = 0;
    while i < short.len() {
        table[short[i] as usize] = 1;
        i += 1;
    }
    table
}

const ONES: u64 = 0x0101_0101_0101_0101;
const HIGHS: u64 = 0x8080_8080_8080_8080;

/// Whether some byte of `word` may need escaping (no false negatives).
fn needs_escape(word: u64) -> bool {
    let below = |n: u8| word.wrapping_sub(ONES * u64::from(n)) & !word & HIGHS != 0;
    let has = |b: u8| {
        let x = word ^ (ONES * u64::from(b));
        x.wrapping_sub(ONES) & !x & HIGHS != 0
    };
    below(0x20) || has(b'"') || has(b'\\')
}

/// A first guess at the JSON length of a message carrying `payload` bytes of text, for
/// the buffer it is written into: an eighth more for escapes, plus the envelope. Not a
/// bound (escapes may run higher, and the buffer then grows once); what it saves is the
/// doublings, copies and frees of a buffer that starts small, for the price of no scan.
fn text_hint(payload: usize) -> usize {
    payload.saturating_add(payload / 8).saturating_add(ENVELOPE)
}

/// Room guessed for the headers of a message (names and values are short).
fn headers_hint(headers: &HeaderMap) -> usize {
    headers.len().saturating_mul(64)
}

impl WorkerMessage {
    /// See [`text_hint`]; the messages that carry an answer are the ones worth sizing.
    pub fn text_hint(&self) -> usize {
        match self {
            WorkerMessage::ResponseComplete(rc) => {
                text_hint(rc.body.as_ref().map_or(0, String::len) + headers_hint(&rc.headers))
            }
            WorkerMessage::ResponseChunk { chunk, .. } => text_hint(chunk.len()),
            _ => ENVELOPE,
        }
    }
}

impl ServerMessage {
    /// See [`text_hint`].
    pub fn text_hint(&self) -> usize {
        match self {
            ServerMessage::Request(r) => text_hint(
                r.body.len()
                    + headers_hint(&r.headers)
                    + r.continuation.as_ref().map_or(0, |c| c.prefix.len()),
            ),
            ServerMessage::BodyPiece { chunk, .. } => text_hint(chunk.len()),
            _ => ENVELOPE,
        }
    }
}

fn headers_len(headers: &HeaderMap) -> usize {
    headers
        .iter()
        .map(|(k, v)| json_string_len(k) + json_string_len(v) + 2)
        .sum()
}

impl RequestMessage {
    /// An upper bound of this `request`'s size on the wire.
    pub fn wire_len(&self) -> usize {
        ENVELOPE
            + json_string_len(&self.request_id)
            + json_string_len(&self.model)
            + json_string_len(&self.endpoint_path)
            + json_string_len(&self.body)
            + headers_len(&self.headers)
            + self
                .continuation
                .as_ref()
                .map_or(0, |c| json_string_len(&c.prefix))
            // `"held":{"grace_secs":…,"proof":…}`
            + self
                .held
                .as_ref()
                .map_or(0, |h| 64 + json_string_len(&h.proof))
    }
}

impl ResponseComplete {
    /// An upper bound of this `response_complete`'s size on the wire.
    pub fn wire_len(&self) -> usize {
        ENVELOPE
            + json_string_len(&self.request_id)
            + self.body.as_deref().map_or(0, json_string_len)
            + headers_len(&self.headers)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::protocol::{ServerMessage, TokenCounts, WorkerMessage};

    fn nasty() -> String {
        let mut s: String = (0u8..0x80).map(char::from).collect();
        s.push_str("é\"\\\n{}");
        s.repeat(50)
    }

    #[test]
    fn the_bound_holds_and_is_tight_for_escaped_bodies() {
        let mut headers = HeaderMap::new();
        headers.insert("x-tenant-id".into(), "a\u{1}b".into());
        let msg = RequestMessage {
            request_id: "req-1".into(),
            model: "m\n".into(),
            endpoint_path: "/v1/chat/completions".into(),
            is_streaming: true,
            body: Arc::from(nasty()),
            headers: headers.clone(),
            body_encoding: None,
            continuation: Some(crate::protocol::continuation::Continuation {
                prefix: nasty(),
                tokens: 7,
            }),
            held: Some(crate::protocol::held::Hold {
                grace_secs: u64::MAX,
                proof: "\u{1}".repeat(64),
            }),
        };
        let real = serde_json::to_string(&ServerMessage::Request(Arc::new(msg.clone())))
            .unwrap()
            .len();
        assert!(msg.wire_len() >= real && msg.wire_len() - real <= ENVELOPE);
        let done = ResponseComplete {
            request_id: "req-1".into(),
            status_code: 200,
            headers,
            body: Some(nasty()),
            token_counts: Some(TokenCounts::default()),
        };
        let real = serde_json::to_string(&WorkerMessage::ResponseComplete(done.clone()))
            .unwrap()
            .len();
        assert!(done.wire_len() >= real && done.wire_len() - real <= ENVELOPE);
        assert_eq!(json_string_len("\n\u{1}é"), 2 + 2 + 6 + 2);
        // Every byte value at every offset of a word agrees with serde_json.
        for b in 0u8..0x80 {
            for at in 0..9 {
                let mut text = "abcdefghijklmnop".to_string();
                text.insert(at, char::from(b));
                let real = serde_json::to_string(&text).unwrap().len();
                assert_eq!(json_string_len(&text), real, "byte {b:#x} at {at}");
            }
        }
    }
}
