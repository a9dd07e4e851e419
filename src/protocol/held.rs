//! Streams held on the worker (extension, feature [`FEATURE_HELD_STREAMS`]): a resumable
//! stream survives the death of the relay it streamed through.
//!
//! A relay that holds a resumable stream (`server/resume/`) loses it when it dies. With
//! workers connected to several relays, the worker keeps a copy instead:
//!
//! * server → worker, on `request`: `held: {"grace_secs": 30, "proof": "<hex>"}`. The
//!   worker numbers the answer's events the way the relay does (SSE `id:` lines counted
//!   from the first event of the worker's answer) and keeps them, bounded. When the
//!   relay's socket drops mid-answer, the request is not cancelled: it goes on into the
//!   buffer for `grace_secs`, then is cancelled at the backend if nobody attached.
//! * server → worker, `attach`: `{"request_id": "<new id>", "stream_id": "<original
//!   id>", "after": 41, "proof": "<hex>"}`: a client resumes through another relay,
//!   which does not hold the stream and asks its workers. The worker holding it answers
//!   over that relay's socket, as for a request with the new id: `response_chunk`s with
//!   the events after `after` (numbered), then the rest live, then `response_complete`
//!   (or `error`). A worker that does not hold it answers `error` with code
//!   [`NOT_HELD`]. A `cancel` of the new id detaches the reader (the grace period starts
//!   again); it does not stop the answer.
//!
//! The proof ([`proof`]) binds the resume token (a secret only the original client
//! learnt) to the caller who may resume (API key id, else tenant): the original relay
//! sends it with the request, the resuming relay computes it from what the client
//! presents, and the worker compares the two. The token itself never reaches a worker.
//!
//! Opt-in: a worker lists the feature; a server that lists it back sends `held` and
//! `attach` only to workers that listed it.

use serde::Serialize;
use sha2::{Digest, Sha256};

/// Worker feature: `request.held` and `attach` are understood.
pub const FEATURE_HELD_STREAMS: &str = "held_streams";
/// `error.code` of a worker asked to attach to a stream it does not hold.
pub const NOT_HELD: &str = "stream_not_held";
/// Longest proof kept (a SHA-256 in hex is 64 characters).
pub const MAX_PROOF: usize = 128;

/// `request.held`: keep this stream's events on the worker.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Hold {
    /// How long an answer nobody reads goes on.
    pub grace_secs: u64,
    /// Who may attach ([`proof`]).
    pub proof: String,
}

/// `attach`: a client resumes a held stream through this relay.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Attach {
    /// The relay's id for this resume; the answer's messages carry it.
    pub request_id: String,
    /// The original request's id (the `x-request-id` the client got).
    pub stream_id: String,
    /// The id of the last event the client has.
    pub after: u64,
    pub proof: String,
}

/// The proof that a resume may attach: SHA-256 over the resume token and the caller
/// allowed to resume (the key id, or without keys the tenant), in hex.
pub fn proof(token: &str, key: Option<&str>, tenant: &str) -> String {
    let mut h = Sha256::new();
    for part in [token, key.unwrap_or(""), tenant] {
        h.update((part.len() as u64).to_le_bytes());
        h.update(part.as_bytes());
    }
    h.update([u8::from(key.is_some())]);
    h.finalize().iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_proof_depends_on_token_key_and_tenant() {
        let p = proof("t", Some("k"), "default");
        assert_eq!(p.len(), 64);
        assert_eq!(p, proof("t", Some("k"), "default"));
        assert_ne!(p, proof("u", Some("k"), "default"));
        assert_ne!(p, proof("t", Some("j"), "default"));
        assert_ne!(p, proof("t", None, "default"));
        assert_ne!(proof("t", None, "a"), proof("t", None, "b"));
        // Lengths are part of the input: moving a character between parts changes it.
        assert_ne!(proof("ab", Some("c"), "x"), proof("a", Some("bc"), "x"));
    }
}

#[cfg(test)]
mod wire_tests {
    use std::sync::Arc;

    use super::*;
    use crate::protocol::{to_json, ServerMessage};

    #[test]
    fn held_and_attach_round_trip_and_an_old_request_has_neither() {
        let text = r#"{"type":"request","request_id":"r-3","model":"m","endpoint_path":"/v1/chat/completions","is_streaming":true,"body":"{}","held":{"grace_secs":30,"proof":"ab"}}"#;
        let Ok(ServerMessage::Request(msg)) = ServerMessage::parse(text) else {
            panic!("a request");
        };
        let hold = Hold {
            grace_secs: 30,
            proof: "ab".into(),
        };
        assert_eq!(msg.held.as_ref(), Some(&hold));
        assert_eq!(to_json(&ServerMessage::Request(msg.clone())), text);
        let mut old = (*msg).clone();
        old.held = None;
        assert!(!to_json(&ServerMessage::Request(Arc::new(old))).contains("held"));
        let attach = ServerMessage::Attach(Attach {
            request_id: "r-4".into(),
            stream_id: "r-3".into(),
            after: 41,
            proof: "ab".into(),
        });
        let text = to_json(&attach);
        assert_eq!(
            text,
            r#"{"type":"attach","request_id":"r-4","stream_id":"r-3","after":41,"proof":"ab"}"#
        );
        assert_eq!(ServerMessage::parse(&text), Ok(attach));
        // Without a proof nobody may attach: malformed.
        assert!(
            ServerMessage::parse(r#"{"type":"attach","request_id":"r","stream_id":"s"}"#).is_err()
        );
    }
}
