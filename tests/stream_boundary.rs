//! A stream the relay ends with an error ends on an event boundary, the error event
//! whole (issue 14, "Known defect"): a backend that dies inside an SSE event, a chunked
//! body cut inside a chunk, a worker killed inside an event, over the OpenAI, Anthropic
//! and Ollama (NDJSON) routes. Real server, real worker binary, and a scripted backend
//! over TCP that writes exactly the bytes each case needs.
//!
//! Nothing sleeps to synchronise: the backend writes its bytes and closes, and the one
//! case that kills the worker waits until the client has read the events before it.

mod common;

use std::io::{BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;

use common::procs::{start_worker, Proc, ServerProc};
use common::sse::{clean_events, events};
use common::*;
use modelrelay::protocol::RequestMessage;
use serde_json::{json, Value};

/// What the scripted backend does with every POST.
#[derive(Clone)]
struct Script {
    /// Written after a `200` chunked head, one write each.
    writes: Vec<Vec<u8>>,
    /// Afterwards wait for the worker to close its end (else close at once, without
    /// the final chunk: the backend died).
    hold: bool,
}

/// One chunk of a chunked body.
fn chunk(data: &str) -> Vec<u8> {
    format!("{:x}\r\n{data}\r\n", data.len()).into_bytes()
}

fn openai_event(n: u32) -> String {
    let chunk = json!({"object": "chat.completion.chunk", "model": "m",
        "choices": [{"index": 0, "delta": {"content": format!("w{n} ")}}]});
    format!("data: {chunk}\n\n")
}

/// A backend serving model `m` that answers every POST with `script`.
fn scripted_backend(script: Script) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("addr");
    std::thread::spawn(move || {
        for conn in listener.incoming().flatten() {
            let script = script.clone();
            std::thread::spawn(move || serve(conn, &script));
        }
    });
    addr
}

fn serve(conn: TcpStream, script: &Script) {
    let mut out = conn.try_clone().expect("clone");
    let mut reader = BufReader::new(conn);
    while let Some((method, path, _)) = read_request(&mut reader) {
        if method == "GET" {
            if answer_get(&mut out, &path).is_err() {
                return;
            }
            continue;
        }
        let head =
            "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n";
        if out.write_all(head.as_bytes()).is_err() {
            return;
        }
        for write in &script.writes {
            if out.write_all(write).is_err() {
                return;
            }
        }
        if script.hold {
            let mut rest = Vec::new();
            let _ = reader.read_to_end(&mut rest);
        }
        return;
    }
}

/// A real server and a real worker in front of `script`.
fn relay(script: Script) -> (ServerProc, Proc) {
    let server = ServerProc::start(&[]);
    let backend = scripted_backend(script);
    let worker = start_worker(server.addr, backend, &[]);
    server.wait_workers(1);
    (server, worker)
}

/// A streamed chat request that asks for usage itself, so the worker forwards the
/// stream as it reads it (it holds whole events back only for a usage chunk it asked
/// for on its own).
fn chat_body() -> String {
    json!({"model": "m", "stream": true, "stream_options": {"include_usage": true},
           "messages": [{"role": "user", "content": "hi"}]})
    .to_string()
}

fn content(event: &Value) -> &str {
    event["choices"][0]["delta"]["content"]
        .as_str()
        .unwrap_or_default()
}

/// The client got `words` whole, then one error event with `code`, nothing corrupt.
fn assert_words_then_error(text: &str, words: &[&str], code: &str) {
    let events = clean_events(text);
    let (last, before) = events.split_last().expect("at least the error event");
    let got: Vec<&str> = before.iter().map(|(_, e)| content(e)).collect();
    assert_eq!(got, words, "{text:?}");
    assert_eq!(last.1["error"]["code"], code, "{text:?}");
}

#[test]
fn a_backend_dying_inside_an_event_ends_the_stream_with_a_whole_error_event() {
    let (server, _worker) = relay(Script {
        writes: vec![
            chunk(&openai_event(1)),
            chunk(&openai_event(2)),
            chunk("data: {\"choi"),
        ],
        hold: false,
    });
    let r = post(server.addr, "/v1/chat/completions", &chat_body());
    assert_eq!(r.status, 200, "{}", r.text());
    assert_words_then_error(&r.text(), &["w1 ", "w2 "], "backend_stream_failed");
}

#[test]
fn a_chunked_body_cut_inside_a_chunk_ends_with_a_whole_error_event() {
    // The last chunk announces 0x80 bytes and brings fewer: one whole event and the
    // start of the next.
    let cut = format!("80\r\n{}data: {{\"choi", openai_event(2));
    let (server, _worker) = relay(Script {
        writes: vec![chunk(&openai_event(1)), cut.into_bytes()],
        hold: false,
    });
    let r = post(server.addr, "/v1/chat/completions", &chat_body());
    assert_eq!(r.status, 200, "{}", r.text());
    let text = r.text();
    let events = clean_events(&text);
    let (last, before) = events.split_last().expect("the error event");
    assert_eq!(last.1["error"]["code"], "backend_stream_failed", "{text:?}");
    // The whole event inside the cut chunk may or may not have been read before the
    // cut was noticed; either way nothing after it.
    let got: Vec<&str> = before.iter().map(|(_, e)| content(e)).collect();
    assert!(got == ["w1 "] || got == ["w1 ", "w2 "], "{text:?}");
}

#[test]
fn an_anthropic_stream_cut_inside_an_event_ends_with_a_whole_error_event() {
    let start = "event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"id\":\"msg_1\"}}\n\n";
    let delta = "event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"text_delta\",\"text\":\"Hi\"}}\n\n";
    let (server, _worker) = relay(Script {
        writes: vec![
            chunk(start),
            chunk(delta),
            chunk("event: content_block_delta\ndata: {\"type\":\"cont"),
        ],
        hold: false,
    });
    let body = json!({"model": "m", "stream": true, "max_tokens": 16,
                      "messages": [{"role": "user", "content": "hi"}]});
    let r = post(server.addr, "/v1/messages", &body.to_string());
    assert_eq!(r.status, 200, "{}", r.text());
    let text = r.text();
    let events = clean_events(&text);
    let kinds: Vec<Option<&str>> = events.iter().map(|(k, _)| k.as_deref()).collect();
    assert_eq!(
        kinds,
        [
            Some("message_start"),
            Some("content_block_delta"),
            Some("error")
        ],
        "{text:?}"
    );
    let error = &events[2].1;
    assert_eq!(error["type"], "error", "{text:?}");
    assert!(
        error["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("backend stream failed")),
        "{text:?}"
    );
}

#[test]
fn an_ollama_stream_cut_inside_an_event_ends_with_an_error_line() {
    let (server, _worker) = relay(Script {
        writes: vec![
            chunk(&openai_event(1)),
            chunk(&openai_event(2)),
            chunk("data: {\"choi"),
        ],
        hold: false,
    });
    let body =
        json!({"model": "m", "stream": true, "messages": [{"role": "user", "content": "hi"}]});
    let r = post(server.addr, "/api/chat", &body.to_string());
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.header("content-type"), Some("application/x-ndjson"));
    let text = r.text();
    assert!(text.ends_with('\n'), "{text:?}");
    let lines: Vec<Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("corrupt line {l:?}: {e}")))
        .collect();
    let (last, before) = lines.split_last().expect("the error line");
    let words: Vec<&str> = before
        .iter()
        .map(|l| l["message"]["content"].as_str().unwrap_or_default())
        .collect();
    assert_eq!(words, ["w1 ", "w2 "], "{text:?}");
    assert!(
        last["error"]
            .as_str()
            .is_some_and(|m| m.contains("backend stream failed")),
        "{text:?}"
    );
}

/// Reads a chunked response until its body holds `n` SSE events; returns the reader
/// and what it read so far.
fn read_events(client: TcpStream, n: usize) -> (BufReader<TcpStream>, String) {
    let mut reader = BufReader::new(client);
    let (status, _) = read_head(&mut reader);
    assert_eq!(status, 200);
    let mut text = String::new();
    while events(&text).len() < n {
        let piece = read_chunk(&mut reader)
            .unwrap_or_else(|| panic!("the stream ended before {n} events: {text:?}"));
        text.push_str(&String::from_utf8_lossy(&piece));
    }
    (reader, text)
}

#[test]
fn a_worker_killed_inside_an_event_ends_the_stream_with_a_whole_error_event() {
    // Two whole events and the start of a third in one write, then the backend waits:
    // once the client has the two events, the worker has forwarded the half one too.
    let piece = format!("{}{}data: {{\"choi", openai_event(1), openai_event(2));
    let (server, mut worker) = relay(Script {
        writes: vec![chunk(&piece)],
        hold: true,
    });
    let client = send_request(
        server.addr,
        "POST",
        "/v1/chat/completions",
        Some(&chat_body()),
        &[],
    );
    let (mut reader, mut text) = read_events(client, 2);
    worker.signal("KILL");
    worker.wait_exit();
    while let Some(piece) = read_chunk(&mut reader) {
        text.push_str(&String::from_utf8_lossy(&piece));
    }
    assert_words_then_error(&text, &["w1 ", "w2 "], "worker_disconnected");
}

/// A chat stream in flight on a fake worker (byte-exact control of what it sends):
/// the server, the worker, the client's connection and the request it got.
fn streaming_to_fake_worker() -> (TestServer, FakeWorker, TcpStream, Arc<RequestMessage>) {
    let server = TestServer::start();
    let worker = FakeWorker::connect(server.addr, &["m"], 1);
    let client = send_request(
        server.addr,
        "POST",
        "/v1/chat/completions",
        Some(&chat_body()),
        &[],
    );
    let req = worker.request();
    (server, worker, client, req)
}

/// The worker streams `sent` and its connection is then lost: the body the client got.
fn streamed_then_worker_lost(sent: &str) -> String {
    let (_server, worker, mut client, req) = streaming_to_fake_worker();
    worker.chunk(&req.request_id, sent);
    worker.kill();
    let r = read_response(&mut client);
    assert_eq!(r.status, 200);
    r.text()
}

#[test]
fn a_worker_connection_lost_after_a_data_line_ends_with_a_whole_error_event() {
    // A fake worker, byte-exact: a whole event, then a data line whose blank line never
    // comes (forwarded, the error's data would join it in one event).
    let half = format!("{}data: {{\"choices\":[]}}\n", openai_event(1));
    let text = streamed_then_worker_lost(&half);
    assert_words_then_error(&text, &["w1 "], "worker_disconnected");
}

#[test]
fn an_event_split_across_chunks_goes_out_whole_as_soon_as_its_end_arrives() {
    let (_server, worker, client, req) = streaming_to_fake_worker();
    let (one, two) = (openai_event(1), openai_event(2));
    // A whole event and the start of the next in one piece: the whole one goes out now.
    worker.chunk(&req.request_id, &format!("{one}{}", &two[..20]));
    let mut reader = BufReader::new(client);
    let (status, _) = read_head(&mut reader);
    assert_eq!(status, 200);
    assert_eq!(read_chunk(&mut reader).expect("a chunk"), one.as_bytes());
    // Its end arrives (before the stream's): the event goes out in one piece, at once.
    worker.chunk(&req.request_id, &two[20..]);
    assert_eq!(read_chunk(&mut reader).expect("a chunk"), two.as_bytes());
    worker.finish_stream(&req.request_id);
    assert_eq!(read_chunk(&mut reader), None, "stream terminated");
}

#[test]
fn a_worker_lost_after_the_last_event_ends_the_stream_normally() {
    // Found by `make soak`: a stream's `data: [DONE]` reached the client, the worker's
    // connection was then cut before its `response_complete`, and the relay appended a
    // `worker_disconnected` event after the end.
    let whole = format!("{}data: [DONE]\n\n", openai_event(1));
    assert_eq!(
        streamed_then_worker_lost(&whole),
        whole,
        "the stream as the backend sent it, nothing after"
    );
}
