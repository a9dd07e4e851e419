//! Bodies without JSON escaping (extension, [`FEATURE_RAW_BODIES`]).
//!
//! A request's body and an answer's body are JSON themselves, and in the text messages
//! they travel as JSON strings: every quote escaped by the sender and unescaped by the
//! receiver, the body cut into a fragment at each one. For a chat request that was about
//! one in seven of the instructions the server and the worker spent on it (callgrind,
//! `make bench-instructions`). Between sides that both listed the feature, a `request`
//! and a whole `response_complete` go as one binary WebSocket message instead:
//!
//! ```text
//! head length (4 bytes, big-endian) | head | body
//! ```
//!
//! The head is the same message's JSON without its `body`; the body follows as its own
//! bytes (UTF-8, as the text message's body always was). The receiver reads it back into
//! the same message, so routing, accounting, cancellation and failover never see the
//! difference. The worker lists the feature in `register`, and a server that reads and
//! writes such messages lists it back; with an original server (or worker) nothing is
//! listed and everything stays text. A binary message that does not read back is dropped
//! like an unusable text message.

use std::sync::Arc;

use serde::Serialize;

use super::continuation::Continuation;
use super::held::Hold;
use super::{
    HeaderMap, Malformed, RequestMessage, ResponseComplete, ServerMessage, TokenCounts,
    WorkerMessage,
};

/// Worker feature, listed back by a server that sends and reads bodies unescaped.
pub const FEATURE_RAW_BODIES: &str = "raw_bodies";

/// The bytes of the head's length.
const LENGTH_BYTES: usize = 4;

/// A `response_complete` without its body, borrowed from the message.
#[derive(Serialize)]
#[serde(tag = "type", rename = "response_complete")]
struct AnswerHead<'a> {
    request_id: &'a str,
    status_code: u16,
    #[serde(skip_serializing_if = "Option::is_none")]
    headers: Option<&'a HeaderMap>,
    #[serde(skip_serializing_if = "Option::is_none")]
    token_counts: Option<&'a TokenCounts>,
}

/// A `request` without its body, borrowed from the message.
#[derive(Serialize)]
#[serde(tag = "type", rename = "request")]
struct RequestHead<'a> {
    request_id: &'a str,
    model: &'a str,
    endpoint_path: &'a str,
    is_streaming: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    headers: Option<&'a HeaderMap>,
    #[serde(skip_serializing_if = "Option::is_none")]
    body_encoding: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    continuation: Option<&'a Continuation>,
    #[serde(skip_serializing_if = "Option::is_none")]
    held: Option<&'a Hold>,
}

/// The binary message of a `response_complete` that has a body; `None` without one (it
/// goes as text, as ever).
pub fn encode_answer(done: &ResponseComplete) -> Option<Vec<u8>> {
    let body = done.body.as_deref()?;
    let head = AnswerHead {
        request_id: &done.request_id,
        status_code: done.status_code,
        headers: (!done.headers.is_empty()).then_some(&done.headers),
        token_counts: done.token_counts.as_ref(),
    };
    frame(&head, body)
}

/// The binary message of a `request`.
pub fn encode_request(req: &RequestMessage) -> Option<Vec<u8>> {
    let head = RequestHead {
        request_id: &req.request_id,
        model: &req.model,
        endpoint_path: &req.endpoint_path,
        is_streaming: req.is_streaming,
        headers: (!req.headers.is_empty()).then_some(&req.headers),
        body_encoding: req.body_encoding.as_deref(),
        continuation: req.continuation.as_ref(),
        held: req.held.as_ref(),
    };
    frame(&head, &req.body)
}

fn frame(head: &impl Serialize, body: &str) -> Option<Vec<u8>> {
    let head = serde_json::to_vec(head).ok()?;
    let length = u32::try_from(head.len()).ok()?;
    let mut out = Vec::with_capacity(LENGTH_BYTES + head.len() + body.len());
    out.extend_from_slice(&length.to_be_bytes());
    out.extend_from_slice(&head);
    out.extend_from_slice(body.as_bytes());
    Some(out)
}

/// Reads a binary message back into its `response_complete`. Anything else (too short,
/// a length past the end, a head that is not such a message or already has a body, a
/// body that is not UTF-8) is [`Malformed`].
pub fn decode_answer(message: &[u8]) -> Result<WorkerMessage, Malformed> {
    let (head, body) = split(message)?;
    let mut done = match WorkerMessage::parse(head)? {
        WorkerMessage::ResponseComplete(done) if done.body.is_none() => done,
        WorkerMessage::ResponseComplete(_) => return Err(bad("head carries a body")),
        _ => return Err(bad("not a response_complete")),
    };
    done.body = Some(text(body)?.to_owned());
    Ok(WorkerMessage::ResponseComplete(done))
}

/// Reads a binary message back into its `request`, as [`decode_answer`] does.
pub fn decode_request(message: &[u8]) -> Result<ServerMessage, Malformed> {
    let (head, body) = split(message)?;
    let ServerMessage::Request(req) = ServerMessage::parse(head)? else {
        return Err(bad("not a request"));
    };
    // Just parsed, so not shared yet.
    let mut req = Arc::unwrap_or_clone(req);
    if !req.body.is_empty() {
        return Err(bad("head carries a body"));
    }
    // Straight from the frame's bytes into the shared string: one copy.
    req.body = Arc::from(text(body)?);
    Ok(ServerMessage::Request(Arc::new(req)))
}

fn bad(why: &str) -> Malformed {
    Malformed(format!("binary message: {why}"))
}

/// The head (checked to be UTF-8) and the body's bytes.
fn split(message: &[u8]) -> Result<(&str, &[u8]), Malformed> {
    let (length, rest) = message
        .split_first_chunk::<LENGTH_BYTES>()
        .ok_or_else(|| bad("shorter than its head's length"))?;
    let length = usize::try_from(u32::from_be_bytes(*length)).unwrap_or(usize::MAX);
    if length > rest.len() {
        return Err(bad("head longer than the message"));
    }
    let (head, body) = rest.split_at(length);
    let head = std::str::from_utf8(head).map_err(|_| bad("head is not UTF-8"))?;
    Ok((head, body))
}

fn text(body: &[u8]) -> Result<&str, Malformed> {
    std::str::from_utf8(body).map_err(|_| bad("body is not UTF-8"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn answer(body: Option<&str>) -> ResponseComplete {
        let mut headers = HeaderMap::new();
        headers.insert("content-type".into(), "application/json".into());
        ResponseComplete {
            request_id: "r-00000000000000ff".into(),
            status_code: 200,
            headers,
            body: body.map(str::to_string),
            token_counts: Some(TokenCounts {
                prompt_tokens: Some(3),
                completion_tokens: Some(5),
                total_tokens: Some(8),
            }),
        }
    }

    #[test]
    fn an_answer_comes_back_as_it_went() {
        for body in ["", "{\"text\":\"a \\\"quoted\\\" line\\n\"}", "é\u{1}\"\\"] {
            let done = answer(Some(body));
            let frame = encode_answer(&done).unwrap();
            // The body travels as its own bytes, unescaped.
            assert!(frame.ends_with(body.as_bytes()));
            assert_eq!(
                decode_answer(&frame).unwrap(),
                WorkerMessage::ResponseComplete(done)
            );
        }
        let mut bare = answer(Some("x"));
        bare.headers.clear();
        bare.token_counts = None;
        let frame = encode_answer(&bare).unwrap();
        assert_eq!(
            decode_answer(&frame).unwrap(),
            WorkerMessage::ResponseComplete(bare)
        );
    }

    #[test]
    fn an_answer_without_a_body_stays_text() {
        assert!(encode_answer(&answer(None)).is_none());
    }

    #[test]
    fn anything_else_is_malformed_not_a_panic() {
        let good = encode_answer(&answer(Some("{}"))).unwrap();
        let mut cases: Vec<Vec<u8>> = vec![
            vec![],
            vec![0, 0, 0],
            vec![0xff, 0xff, 0xff, 0xff, b'{'],
            [&[0, 0, 0, 2][..], b"{}"].concat(),
            [&[0, 0, 0, 4][..], b"\xff\xfe{}"].concat(),
        ];
        // A body that is not UTF-8.
        let mut bad_body = good.clone();
        bad_body.extend_from_slice(b"\xff");
        cases.push(bad_body);
        // Another message as the head, and a head that carries a body of its own.
        for head in [
            r#"{"type":"pong"}"#,
            r#"{"type":"response_complete","request_id":"r","status_code":200,"body":"x"}"#,
        ] {
            let len = u32::try_from(head.len()).unwrap().to_be_bytes();
            cases.push([&len[..], head.as_bytes(), b"{}"].concat());
        }
        // Every cut of a good message.
        for cut in 0..good.len() {
            cases.push(good[..cut].to_vec());
        }
        for case in &cases {
            if let Ok(msg) = decode_answer(case) {
                // A cut inside the body is still a (shorter) answer, never anything else.
                assert!(
                    matches!(msg, WorkerMessage::ResponseComplete(_)),
                    "{case:?}"
                );
            }
        }
        assert!(decode_answer(&[0xff, 0xff, 0xff, 0xff, b'{']).is_err());
        assert!(decode_answer(&[0, 0, 0, 2, b'{', b'}']).is_err());
    }

    fn request(body: &str) -> RequestMessage {
        let mut headers = HeaderMap::new();
        headers.insert("x-tenant-id".into(), "t\"1".into());
        RequestMessage {
            request_id: "r-0000000000000001".into(),
            model: "m".into(),
            endpoint_path: "/v1/chat/completions".into(),
            is_streaming: true,
            body: Arc::from(body),
            headers,
            body_encoding: None,
            continuation: Some(Continuation {
                prefix: "so \"far\"".into(),
                tokens: 4,
            }),
            held: Some(Hold {
                grace_secs: 30,
                proof: "p".into(),
            }),
        }
    }

    #[test]
    fn a_request_comes_back_as_it_went() {
        for body in [
            "",
            r#"{"messages":[{"role":"user","content":"say \"hi\"\n"}]}"#,
        ] {
            let req = request(body);
            let message = encode_request(&req).unwrap();
            assert!(message.ends_with(body.as_bytes()));
            assert_eq!(
                decode_request(&message).unwrap(),
                ServerMessage::Request(Arc::new(req))
            );
        }
        let mut bare = request("{}");
        bare.headers.clear();
        bare.continuation = None;
        bare.held = None;
        bare.body_encoding = Some("base64".into());
        let message = encode_request(&bare).unwrap();
        assert_eq!(
            decode_request(&message).unwrap(),
            ServerMessage::Request(Arc::new(bare))
        );
    }

    #[test]
    fn a_request_head_that_is_something_else_is_malformed() {
        for head in [
            r#"{"type":"ping"}"#,
            r#"{"type":"request","request_id":"r","endpoint_path":"/v1/x","body":"x"}"#,
            r#"{"type":"request","request_id":"r"}"#,
        ] {
            let len = u32::try_from(head.len()).unwrap().to_be_bytes();
            let message = [&len[..], head.as_bytes(), b"{}"].concat();
            assert!(decode_request(&message).is_err(), "{head}");
        }
        // An answer is not a request, nor a request an answer.
        let answer = encode_answer(&answer(Some("{}"))).unwrap();
        assert!(decode_request(&answer).is_err());
        assert!(decode_answer(&encode_request(&request("{}")).unwrap()).is_err());
    }
}
