//! How many bytes a message takes on the WebSocket, known before it is built.
//!
//! Bodies travel as JSON strings, and escaping can multiply them: `\n` becomes two bytes,
//! a control byte six (`\u0001`). A 32 MiB body of newlines is a 64 MiB message, past
//! what a worker accepts; a peer that receives a message over its limit drops the whole
//! connection, and every request on it. So the sender sizes the *encoded* message and
//! refuses what the other side cannot receive, instead of the body's raw length.

use super::{HeaderMap, RequestMessage, ResponseComplete};

/// Room for the field names, the `type` tag, numbers and punctuation of one message:
/// more than any of them needs, so the sizes below are upper bounds.
pub const ENVELOPE: usize = 512;

/// Bytes `s` takes as a JSON string, quotes included, as `serde_json` writes it (it
/// escapes only `"`, `\` and bytes below 0x20; non-ASCII stays as UTF-8).
pub fn json_string_len(s: &str) -> usize {
    2 + s
        .bytes()
        .map(|b| match b {
            b'"' | b'\\' | b'\n' | b'\r' | b'\t' | 0x08 | 0x0c => 2,
            0..=0x1f => 6,
            _ => 1,
        })
        .sum::<usize>()
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
    }
}
