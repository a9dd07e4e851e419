//! Fuzz targets for every parser that takes bytes from the network (issue 14). Not part
//! of the relay's API: each target feeds arbitrary bytes to one parser and panics when a
//! property fails. Beyond "no panic", each checks what the parser promises:
//!
//! | target | parser (who sends the bytes) | checked |
//! |---|---|---|
//! | `http_head` | `http::request::parse_head` (client) | consumed ≤ given |
//! | `http_request` | `Conn::read_request`, heads, lengths, chunked bodies, pipelining (client) | body ≤ limit |
//! | `worker_message` | `WorkerMessage::parse` (worker) | what we send back parses the same |
//! | `server_message` | `ServerMessage::parse` (server, read by the worker) | same |
//! | `ws_frames` | WebSocket frames with our `ws::config` limits (either peer) | messages ≤ limit |
//! | `sse_usage` | `UsageEventFilter`, `UsageScanner`, `with_usage_requested` (backend) | split-invariant, lossless without usage events, usage option set |
//! | `event_boundary` | `relay::boundary::EventBoundary` (backend via worker) | lossless; after `abandon`, the error event parses whole |
//! | `ollama_stream` | `ollama::translate::StreamConverter` (backend) | split-invariant, every line JSON, nothing after the last |
//! | `api_body` | `body::inspect_body`, `needs`, Ollama `request`/`preload` (client) | translated bodies are JSON naming the model |
//! | `backend_json` | model lists, `/api/ps`, `/models`, `/props`, `/api/show`, usage, Ollama `response` (backend) | no panic |
//! | `utf8_carry` | `backend::Utf8Carry` (backend) | same text as decoding the whole |
//! | `op_token` | `SignedToken::parse`, `rfc3339::parse`, `Operation::parse` (client) | no panic |
//!
//! `tests/fuzz.rs` drives them with seeded mutations (a short slice in `make test`, long
//! runs in `make fuzz`); `fuzz/` (nightly) drives them with libFuzzer.
#![doc(hidden)]

pub mod reference;
pub mod seeds;

use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use serde_json::Value;
use tungstenite::protocol::{Role, WebSocketContext};
use tungstenite::Message;

use crate::protocol::{to_json, ServerMessage, WorkerMessage};
use crate::server::http::request::{parse_head, Conn, Limits};
use crate::server::ollama::translate::{self, Endpoint, StreamConverter};
use crate::server::relay::boundary::{EventBoundary, Format, MAX_HELD};
use crate::worker::backend::{self, Utf8Carry};
use crate::worker::stream_usage::{self, UsageEventFilter, UsageScanner, MAX_HELD_EVENT};

/// A fuzz target: panics when a property fails.
pub type Target = fn(&[u8]);

/// Every target by name.
pub const TARGETS: &[(&str, Target)] = &[
    ("http_head", http_head),
    ("http_request", http_request),
    ("worker_message", worker_message),
    ("server_message", server_message),
    ("ws_frames", ws_frames),
    ("sse_usage", sse_usage),
    ("event_boundary", event_boundary),
    ("ollama_stream", ollama_stream),
    ("api_body", api_body),
    ("backend_json", backend_json),
    ("utf8_carry", utf8_carry),
    ("op_token", op_token),
];

/// The limits `http_request` reads with (small, so inputs reach them).
pub const HTTP_LIMITS: (usize, usize) = (4 * 1024, 64 * 1024);
/// The largest WebSocket message `ws_frames` accepts.
pub const WS_LIMIT: usize = 64 * 1024;

/// A property of what we produce: it is JSON (a fuzz target's assertion, not input
/// handling; the relay's own paths never panic on what they read).
fn must_be_json(text: &str, what: &str) -> Value {
    match serde_json::from_str(text) {
        Ok(v) => v,
        Err(e) => panic!("{what} is not JSON ({e}): {text:?}"),
    }
}

pub fn http_head(data: &[u8]) {
    if let Ok(Some((req, _, used))) = parse_head(data) {
        assert!(
            used <= data.len(),
            "consumed {used} of {} bytes",
            data.len()
        );
        let _ = req.query_param("provider");
        let _ = req.header("content-type");
    }
}

/// A socket whose peer is gone: reads see the end at once, writes fail.
fn dead_socket() -> Option<TcpStream> {
    static DEAD: OnceLock<Option<(TcpStream, SocketAddr)>> = OnceLock::new();
    let (sock, _) = DEAD
        .get_or_init(|| {
            let listener = TcpListener::bind("127.0.0.1:0").ok()?;
            let sock = TcpStream::connect(listener.local_addr().ok()?).ok()?;
            drop(listener.accept().ok()?);
            Some((sock, listener.local_addr().ok()?))
        })
        .as_ref()?;
    sock.try_clone().ok()
}

pub fn http_request(data: &[u8]) {
    let Some(sock) = dead_socket() else {
        return;
    };
    let limits = Limits {
        max_header_bytes: HTTP_LIMITS.0,
        max_body_bytes: HTTP_LIMITS.1,
        idle_timeout: Duration::from_millis(50),
        io_timeout: Duration::from_millis(50),
        ..Limits::default()
    };
    let peer = SocketAddr::from(([127, 0, 0, 1], 9));
    let mut conn = Conn::with_buffered(crate::net::Stream::plain(sock), peer, data.to_vec());
    // Pipelined requests, until the input runs out or is refused.
    for _ in 0..16 {
        match conn.read_request(&limits) {
            Ok(req) => assert!(
                req.body.len() <= limits.max_body_bytes,
                "body of {} bytes read past the {} limit",
                req.body.len(),
                limits.max_body_bytes
            ),
            Err(_) => return,
        }
    }
}

pub fn worker_message(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    if let Ok(msg) = WorkerMessage::parse(text) {
        if matches!(msg, WorkerMessage::Unknown(_)) {
            return; // skipped by the reader, never sent
        }
        let sent = to_json(&msg);
        let again = WorkerMessage::parse(&sent)
            .unwrap_or_else(|e| panic!("our own {sent} does not parse: {e}"));
        assert_eq!(to_json(&again), sent, "a message changes on a round trip");
    }
}

pub fn server_message(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    if let Ok(msg) = ServerMessage::parse(text) {
        if matches!(msg, ServerMessage::Unknown(_)) {
            return; // skipped by the reader, never sent
        }
        let sent = to_json(&msg);
        let again = ServerMessage::parse(&sent)
            .unwrap_or_else(|e| panic!("our own {sent} does not parse: {e}"));
        assert_eq!(to_json(&again), sent, "a message changes on a round trip");
    }
}

/// A binary message as the server (an answer) or the worker (a request) reads it: what
/// reads back goes out again as the same bytes.
fn raw_body(data: &[u8], role: Role) {
    use crate::protocol::raw_bodies;
    match role {
        Role::Server => {
            if let Ok(WorkerMessage::ResponseComplete(done)) = raw_bodies::decode_answer(data) {
                let again = raw_bodies::encode_answer(&done).expect("an answer with a body");
                assert_eq!(
                    raw_bodies::decode_answer(&again).ok(),
                    Some(WorkerMessage::ResponseComplete(done))
                );
            }
        }
        Role::Client => {
            if let Ok(ServerMessage::Request(req)) = raw_bodies::decode_request(data) {
                let again = raw_bodies::encode_request(&req).expect("a request");
                assert_eq!(
                    raw_bodies::decode_request(&again).ok(),
                    Some(ServerMessage::Request(req))
                );
            }
        }
    }
}

/// Frames as a server (masked, from a worker) or as a worker (unmasked) reads them.
pub fn ws_frames(data: &[u8]) {
    let Some((first, rest)) = data.split_first() else {
        return;
    };
    let role = if first & 1 == 0 {
        Role::Server
    } else {
        Role::Client
    };
    let mut ctx = WebSocketContext::new(role, Some(crate::ws::config(WS_LIMIT)));
    let mut reader = crate::ws::ReadHalf::new(std::io::Cursor::new(rest));
    for _ in 0..256 {
        match ctx.read(&mut reader) {
            Ok(Message::Text(text)) => {
                assert!(text.len() <= WS_LIMIT, "a {} byte message", text.len());
                match role {
                    Role::Server => worker_message(text.as_bytes()),
                    Role::Client => server_message(text.as_bytes()),
                }
            }
            Ok(Message::Binary(b)) => {
                assert!(b.len() <= WS_LIMIT, "a {} byte message", b.len());
                raw_body(&b, role);
            }
            Ok(_) => {}
            Err(_) => return,
        }
        let _ = reader.take_pending();
    }
}

fn filter(pieces: &[String]) -> String {
    let mut f = UsageEventFilter::default();
    let mut out: String = pieces.iter().map(|p| f.push(p)).collect();
    out.push_str(&f.finish());
    out
}

fn scan(pieces: &[String]) -> Option<crate::protocol::TokenCounts> {
    let mut s = UsageScanner::default();
    for p in pieces {
        s.scan(p);
    }
    s.counts
}

pub fn sse_usage(data: &[u8]) {
    let pieces = reference::pieces(data);
    let whole = pieces.concat();
    let single = filter(std::slice::from_ref(&whole));
    let split = filter(&pieces);
    assert!(split.len() <= whole.len(), "the filter added bytes");
    if whole.len() <= MAX_HELD_EVENT {
        // An over-long event is forwarded as it comes, so only short streams are the
        // same however they were cut.
        assert_eq!(split, single, "output depends on how the stream was cut");
    }
    if !whole.contains("usage") {
        assert_eq!(split, whole, "a stream without usage events changed");
    }
    assert_eq!(scan(&pieces), scan(std::slice::from_ref(&whole)));
    let _ = stream_usage::usage_from_json(&whole);
    if let Some(body) = stream_usage::with_usage_requested("/v1/chat/completions", &whole) {
        let v = must_be_json(&body, "the rewritten body");
        assert_eq!(v["stream_options"]["include_usage"], true);
        assert_eq!(v["stream"], true);
    }
}

const ERROR_EVENT: &str = "data: {\"error\":{\"message\":\"backend stream failed\"}}\n\n";

pub fn event_boundary(data: &[u8]) {
    let Some((first, rest)) = data.split_first() else {
        return;
    };
    let format = if first & 1 == 0 {
        Format::Sse
    } else {
        Format::Ndjson
    };
    let pieces = reference::pieces(rest);
    let whole = pieces.concat();
    // Lossless: everything goes out, in order, however it was cut.
    let mut b = EventBoundary::new(format);
    let mut out: String = pieces.iter().map(|p| b.push(p).into_owned()).collect();
    out.push_str(&b.finish());
    assert_eq!(out, whole, "bytes lost or reordered");
    // Abandoned after a piece, the error event that follows parses whole (checked after
    // at most 64 pieces spread over the input: the check parses everything sent so far).
    let mut b = EventBoundary::new(format);
    let (mut sent, mut seen) = (String::new(), 0);
    let stride = pieces.len().div_ceil(64).max(1);
    for (i, p) in pieces.iter().enumerate() {
        sent.push_str(&b.push(p));
        seen += p.len();
        let held = seen - sent.len();
        assert!(held <= MAX_HELD, "{held} bytes held back");
        if i % stride != 0 && i + 1 != pieces.len() {
            continue;
        }
        let cut = b.clone().abandon();
        let before = format!("{sent}{}", cut.close);
        match format {
            Format::Sse => {
                let events = reference::sse_events(&before);
                let after = reference::sse_events(&format!("{before}{ERROR_EVENT}"));
                assert_eq!(
                    after.len(),
                    events.len() + 1,
                    "error event merged: {before:?}"
                );
                assert_eq!(&after[..events.len()], &events[..]);
            }
            Format::Ndjson => assert!(
                before.is_empty() || before.ends_with('\n'),
                "error line glued to a partial line: {before:?}"
            ),
        }
    }
}

pub fn ollama_stream(data: &[u8]) {
    let Some((first, rest)) = data.split_first() else {
        return;
    };
    let endpoint = if first & 1 == 0 {
        Endpoint::Chat
    } else {
        Endpoint::Generate
    };
    let pieces = reference::pieces(rest);
    let whole = pieces.concat();
    let now = Instant::now();
    let ms = 1_700_000_000_000;
    let run = |pieces: &[String]| {
        let mut c = StreamConverter::new(endpoint, "m", now);
        let mut out: String = pieces.iter().map(|p| c.feed(p, now, ms)).collect();
        out.push_str(&c.finish(now, ms));
        out.push_str(&c.finish(now, ms));
        out
    };
    let out = run(&pieces);
    assert_eq!(out, run(std::slice::from_ref(&whole)), "depends on the cut");
    assert!(out.is_empty() || out.ends_with('\n'));
    let lines: Vec<&str> = out.lines().collect();
    for (i, line) in lines.iter().enumerate() {
        let v: Value = serde_json::from_str(line).unwrap_or_else(|e| panic!("{line:?}: {e}"));
        assert!(v.is_object(), "{line:?}");
        let last = v.get("error").is_some() || v["done"] == true;
        assert!(
            !last || i + 1 == lines.len(),
            "a line after the last: {out:?}"
        );
    }
}

pub fn api_body(data: &[u8]) {
    if let Ok(info) = crate::server::body::inspect_body(data) {
        assert!(!info.model.trim().is_empty());
    }
    if let Ok(text) = std::str::from_utf8(data) {
        let _ = crate::server::body::needs("/v1/chat/completions", text);
        let _ = crate::server::body::needs("/v1/embeddings", text);
        let _ = crate::server::body::cache_reuse(text);
    }
    for endpoint in [
        Endpoint::Chat,
        Endpoint::Generate,
        Endpoint::Embed,
        Endpoint::LegacyEmbeddings,
    ] {
        if let Some(answer) = translate::preload(endpoint, data, 0) {
            must_be_json(&answer, "a preload answer");
        }
        if let Ok(t) = translate::request(endpoint, data) {
            let v = must_be_json(&t.body, "a translated body");
            assert_eq!(v["model"], t.model.as_str());
        }
    }
}

pub fn backend_json(data: &[u8]) {
    let text = String::from_utf8_lossy(data);
    let _ = backend::parse_model_list(&text);
    let _ = stream_usage::usage_from_json(&text);
    use crate::worker::backend_kind as k;
    let _ = k::is_ollama_version(&text);
    let _ = k::is_llama_server_props(&text);
    let _ = k::llama_server_sleeping(&text);
    let _ = k::is_vllm_model_list(&text);
    let _ = k::parse_ollama_ps(&text);
    let _ = k::parse_llama_models(&text);
    let _ = k::parse_ollama_show(&text);
    let _ = k::parse_llama_props_info(&text);
    let _ = k::parse_vllm_max_len(&text);
    let timing = translate::Timing::default();
    for endpoint in [Endpoint::Chat, Endpoint::Generate, Endpoint::Embed] {
        if let Ok(answer) = translate::response(endpoint, "m", &text, &timing) {
            must_be_json(&answer, "an Ollama answer");
        }
    }
    let _ = translate::error_from_openai(500, &text);
    let _ = crate::server::errors::ApiError::from_backend(502, &text);
}

pub fn utf8_carry(data: &[u8]) {
    let (pieces, rest) = reference::byte_pieces(data);
    let mut carry = Utf8Carry::default();
    let mut out: String = pieces.iter().map(|p| carry.push(p)).collect();
    out.push_str(&carry.finish());
    assert_eq!(
        out,
        String::from_utf8_lossy(rest),
        "decoded differently in pieces"
    );
}

pub fn op_token(data: &[u8]) {
    let text = String::from_utf8_lossy(data);
    use crate::server::lifecycle::governance::Operation;
    #[cfg(feature = "governance")]
    {
        use crate::server::lifecycle::governance::token;
        let _ = token::SignedToken::parse(&text);
        let _ = token::decode_signature(&text);
        let _ = token::valid_name(&text);
    }
    let _ = Operation::parse(&text);
    let _ = crate::rfc3339::parse(&text);
}
