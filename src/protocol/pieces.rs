//! Request bodies in pieces (extension, [`FEATURE_BODY_PIECES`]).
//!
//! A 100 MB upload must not sit whole in the server's or the worker's memory. A
//! `request` whose `body_encoding` is [`PIECES`] carries an empty `body`; its bytes
//! follow in `body_piece` messages (`seq` from 0, `chunk` the base64 of up to
//! [`PIECE_BYTES`] raw bytes, `last: true` on the final one). The worker says how far
//! the server may go with `body_credit` (`until`: pieces numbered below it may be sent),
//! [`WINDOW`] pieces at first and one more each time its backend took one, so what is
//! on the way is bounded however slowly the backend reads. The answer is base64 as for
//! [`super::binary::BASE64`].
//!
//! Why base64 text frames rather than binary WebSocket frames: the pieces then share
//! the socket's one message type, its size checks and its writer queue with everything
//! else, and need no second framing for the request id; the cost (a third more bytes,
//! an encode and a decode pass) is what `make bench-binary` measures.
//!
//! The server sends such a request only to a worker listing the feature; a worker
//! without it gets the body whole (when it fits one message) or the client a clear
//! error. Once a piece went out the request cannot run elsewhere: a worker lost
//! mid-upload ends it with `502`.

/// Worker feature: it takes `body_encoding: "base64-pieces"` requests and grants
/// `body_credit`.
pub const FEATURE_BODY_PIECES: &str = "body_pieces";
/// The `body_encoding` of a request whose body follows in `body_piece` messages.
pub const PIECES: &str = "base64-pieces";
/// Raw bytes in one piece (about 341 KiB once encoded).
pub const PIECE_BYTES: usize = 256 * 1024;
/// Pieces the worker lets the server send ahead of what its backend took.
pub const WINDOW: u64 = 8;

/// Server feature (in `register_ack`, to workers that listed it): it sends
/// `answer_credit` for binary answers, and the worker sends a binary answer's chunks
/// only as far as that credit goes ([`ANSWER_WINDOW`] before any), so a client that
/// reads slowly holds the backend back instead of the relay holding the answer.
pub const FEATURE_ANSWER_CREDIT: &str = "answer_credit";
/// Chunks of a binary answer (48 KiB each) the worker may send ahead of those the
/// server wrote to the client.
pub const ANSWER_WINDOW: u64 = 32;

#[cfg(test)]
mod tests {
    use super::super::{to_json, ServerMessage, WorkerMessage};

    #[test]
    fn pieces_and_credit_round_trip_and_need_their_fields() {
        for last in [false, true] {
            let piece = ServerMessage::BodyPiece {
                request_id: "r1".into(),
                seq: 3,
                chunk: "AAEC".into(),
                last,
            };
            let text = to_json(&piece);
            assert_eq!(text.contains("last"), last, "{text}");
            assert_eq!(ServerMessage::parse(&text), Ok(piece));
        }
        let credit = WorkerMessage::BodyCredit {
            request_id: "r1".into(),
            until: 8,
        };
        assert_eq!(WorkerMessage::parse(&to_json(&credit)), Ok(credit));
        let answer = ServerMessage::AnswerCredit {
            request_id: "r1".into(),
            until: 64,
        };
        assert_eq!(ServerMessage::parse(&to_json(&answer)), Ok(answer));
        assert!(WorkerMessage::parse(r#"{"type":"body_credit","request_id":"r"}"#).is_err());
        assert!(ServerMessage::parse(r#"{"type":"body_piece","request_id":"r","seq":0}"#).is_err());
    }
}
