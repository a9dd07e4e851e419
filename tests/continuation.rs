//! A streamed chat answer whose worker is killed midway is finished on another worker:
//! real server, two real worker binaries (`kill -9` one of them at a random event), and
//! a fake llama-server whose answer is a fixed function of the prompt and of the
//! assistant prefill it is given, so a continuation can be checked exactly: the client
//! must end with the very text of the uninterrupted answer, in one well-formed stream.
//!
//! The backend paces its words (a few ms apart) so that a kill lands mid-answer; the
//! test waits for the events it needs, never for time.

mod common;

use std::io::{BufReader, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::procs::{start_worker, Proc, ServerProc};
use common::sse::events;
use common::*;
use parking_lot::Mutex;
use serde_json::{json, Value};

/// Words in every answer.
const WORDS: usize = 24;
/// Pause between two words.
const PACE: Duration = Duration::from_millis(15);

/// The answer to `prompt`, one token per word: a fixed sequence seeded by the prompt.
fn answer(prompt: &str) -> Vec<String> {
    let mut seed = prompt.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
    });
    (0..WORDS)
        .map(|i| {
            seed = seed.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
            let word = format!("w{}", (seed >> 33) % 1000);
            if i == 0 {
                word
            } else {
                format!(" {word}")
            }
        })
        .collect()
}

/// A fake llama-server: what it was asked (the prefill of each chat request).
#[derive(Clone, Default)]
struct Backend {
    prefills: Arc<Mutex<Vec<Option<String>>>>,
}

fn start_backend() -> (SocketAddr, Backend) {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("addr");
    let backend = Backend::default();
    let b = backend.clone();
    std::thread::spawn(move || {
        for conn in listener.incoming().flatten() {
            let b = b.clone();
            std::thread::spawn(move || serve(conn, &b));
        }
    });
    (addr, backend)
}

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

fn serve(conn: TcpStream, backend: &Backend) {
    let mut out = conn.try_clone().expect("clone");
    let mut reader = BufReader::new(conn);
    while let Some((method, path, body)) = read_request(&mut reader) {
        if method == "GET" {
            let (status, body) = match path.as_str() {
                "/v1/models" => (200, r#"{"object":"list","data":[{"id":"m"}]}"#),
                _ => (404, r#"{"error":"not found"}"#),
            };
            let head = format!(
                "HTTP/1.1 {status} X\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
                body.len()
            );
            if out.write_all(format!("{head}{body}").as_bytes()).is_err() {
                return;
            }
            continue;
        }
        if stream_answer(&mut out, backend, &body).is_err() {
            return;
        }
    }
}

/// Streams the answer as llama-server does: a role chunk, one chunk per word (the
/// prefill, when given, echoed in front of the first new word), a finish chunk, usage
/// when asked, `[DONE]`.
fn stream_answer(out: &mut TcpStream, backend: &Backend, body: &[u8]) -> std::io::Result<()> {
    let body: Value = serde_json::from_slice(body).unwrap_or_default();
    let messages = body["messages"].as_array().cloned().unwrap_or_default();
    let prefill = messages
        .last()
        .filter(|m| m["role"] == "assistant")
        .and_then(|m| m["content"].as_str().map(String::from));
    backend.prefills.lock().push(prefill.clone());
    let prompt: String = messages
        .iter()
        .filter(|m| m["role"] != "assistant")
        .filter_map(|m| m["content"].as_str())
        .collect();
    let words = answer(&prompt);
    let prefill = prefill.unwrap_or_default();
    // Where the prefill ends in the answer (by characters; it is always a word boundary
    // here, since the relay sends the text of whole chunks).
    let mut done = 0;
    let mut skip = 0;
    while skip < words.len() && done + words[skip].len() <= prefill.len() {
        done += words[skip].len();
        skip += 1;
    }
    let n = NEXT_ID.fetch_add(1, Ordering::Relaxed);
    let id = format!("chatcmpl-{n}");
    let event = |delta: Value, finish: Value| {
        let chunk = json!({"id": id, "created": 1_000 + n, "model": "m", "object": "chat.completion.chunk",
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]});
        format!("data: {chunk}\n\n")
    };
    let head =
        "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n";
    out.write_all(head.as_bytes())?;
    let send = |out: &mut TcpStream, data: &str| {
        out.write_all(format!("{:x}\r\n{data}\r\n", data.len()).as_bytes())
    };
    send(
        out,
        &event(json!({"role": "assistant", "content": null}), Value::Null),
    )?;
    for (i, word) in words.iter().enumerate().skip(skip) {
        std::thread::sleep(PACE);
        let text = if i == skip {
            format!("{prefill}{word}")
        } else {
            word.clone()
        };
        // With tools, the answer turns into a tool call after two words.
        let delta = if body.get("tools").is_some() && i >= 2 {
            json!({"tool_calls": [{"index": 0, "function": {"arguments": word}}]})
        } else {
            json!({"content": text})
        };
        send(out, &event(delta, Value::Null))?;
    }
    send(out, &event(json!({}), json!("stop")))?;
    if body["stream_options"]["include_usage"] == true {
        let prompt_tokens = 5 + skip;
        let usage = json!({"id": id, "created": 1_000 + n, "model": "m", "choices": [],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": WORDS - skip,
                      "total_tokens": prompt_tokens + WORDS - skip}});
        send(out, &format!("data: {usage}\n\n"))?;
    }
    send(out, "data: [DONE]\n\n")?;
    out.write_all(b"0\r\n\r\n")
}

/// The relay, and two workers each over its own fake backend.
struct Rig {
    server: ServerProc,
    backends: [(SocketAddr, Backend); 2],
    workers: [Option<Proc>; 2],
}

impl Rig {
    fn start(server_env: &[(&str, &str)]) -> Rig {
        let server = ServerProc::start(server_env);
        let backends = [start_backend(), start_backend()];
        let mut rig = Rig {
            server,
            backends,
            workers: [None, None],
        };
        rig.restart(0);
        rig.restart(1);
        rig.server.wait_workers(2);
        rig
    }

    fn restart(&mut self, i: usize) {
        let name = format!("box-{i}");
        let env = [
            ("BACKEND_KIND", "llama-server"),
            ("WORKER_NAME", name.as_str()),
            ("MAX_CONCURRENCY", "2"),
        ];
        self.workers[i] = Some(start_worker(self.server.addr, self.backends[i].0, &env));
    }

    /// Kills (`-9`) the worker whose backend got the latest request.
    fn kill_serving(&mut self, asked_before: [usize; 2]) -> usize {
        let i = (0..2)
            .find(|i| self.backends[*i].1.prefills.lock().len() > asked_before[*i])
            .expect("a backend got the request");
        let mut worker = self.workers[i].take().expect("running");
        worker.signal("KILL");
        worker.wait_exit();
        i
    }

    fn asked(&self) -> [usize; 2] {
        [0, 1].map(|i| self.backends[i].1.prefills.lock().len())
    }
}

fn body(prompt: &str, extra: Value) -> String {
    let mut body = json!({"model": "m", "stream": true,
        "messages": [{"role": "user", "content": prompt}]});
    if let (Value::Object(b), Value::Object(e)) = (&mut body, extra) {
        b.extend(e);
    }
    body.to_string()
}

/// Reads the stream until `n` content events arrived.
fn read_until(reader: &mut BufReader<TcpStream>, text: &mut String, n: usize) {
    while content_events(text) < n {
        let piece = read_chunk(reader)
            .unwrap_or_else(|| panic!("the stream ended before {n} words: {text:?}"));
        text.push_str(&String::from_utf8_lossy(&piece));
    }
}

fn content_events(text: &str) -> usize {
    events(text)
        .iter()
        .filter_map(|e| serde_json::from_str::<Value>(&e.data).ok())
        .filter(|v| v["choices"][0]["delta"]["content"].is_string())
        .count()
}

fn read_rest(reader: &mut BufReader<TcpStream>, text: &mut String) {
    while let Some(piece) = read_chunk(reader) {
        text.push_str(&String::from_utf8_lossy(&piece));
    }
}

/// The answer's text, and its chunks' JSON (checked to be one answer).
fn content_of(text: &str) -> (String, Vec<Value>) {
    let chunks: Vec<Value> = events(text)
        .iter()
        .filter(|e| e.data != "[DONE]")
        .map(|e| serde_json::from_str(&e.data).unwrap_or_else(|_| panic!("bad event {e:?}")))
        .collect();
    let content = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect();
    (content, chunks)
}

/// Small deterministic generator for the kill points (seed printed, to rerun a case).
fn points(n: usize) -> Vec<usize> {
    let seed = std::env::var("CONTINUE_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| u64::from(std::process::id()));
    eprintln!("kill points from CONTINUE_SEED={seed}");
    let mut x = seed | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            1 + (x % (WORDS as u64 - 4)) as usize
        })
        .collect()
}

#[test]
fn a_killed_worker_s_answer_is_finished_on_another_with_the_same_text() {
    let mut rig = Rig::start(&[]);
    let prompt = "Tell me a story about the sea.";
    let expected: String = answer(prompt).concat();
    // The uninterrupted answer through the relay is that text.
    let r = post_stream(rig.server.addr, &body(prompt, json!({})), &[]);
    assert_eq!(content_of(&r).0, expected);
    for k in points(5) {
        let before = rig.asked();
        let client = send_request(
            rig.server.addr,
            "POST",
            "/v1/chat/completions",
            Some(&body(
                prompt,
                json!({"stream_options": {"include_usage": true}}),
            )),
            &[("x-continue-on-failure", "true")],
        );
        let mut reader = BufReader::new(client);
        let (status, _) = read_head(&mut reader);
        assert_eq!(status, 200);
        let mut text = String::new();
        read_until(&mut reader, &mut text, k);
        let killed = rig.kill_serving(before);
        read_rest(&mut reader, &mut text);
        let (content, chunks) = content_of(&text);
        assert_eq!(content, expected, "killed after {k} words; stream:\n{text}");
        // One answer: one id, one `created`, one role chunk, one marker, `[DONE]` last.
        let ids: std::collections::BTreeSet<String> =
            chunks.iter().map(|c| c["id"].to_string()).collect();
        assert_eq!(ids.len(), 1, "{text}");
        let created: std::collections::BTreeSet<String> =
            chunks.iter().map(|c| c["created"].to_string()).collect();
        assert_eq!(created.len(), 1, "{text}");
        assert_eq!(text.matches("\"role\"").count(), 1, "{text}");
        assert_eq!(text.matches(": continued on another worker\n\n").count(), 1);
        assert!(text.ends_with("data: [DONE]\n\n"), "{text}");
        // Usage counts both parts: the whole answer's words as completion.
        let usage = chunks.iter().find_map(|c| c.get("usage")).expect("usage");
        assert_eq!(usage["completion_tokens"], WORDS, "{usage}");
        // The other backend was asked to go on from exactly what the client had.
        let other = &rig.backends[1 - killed].1;
        let prefill = other.prefills.lock().last().cloned().flatten();
        assert!(
            prefill
                .as_deref()
                .is_some_and(|p| expected.starts_with(p) && !p.is_empty()),
            "{prefill:?}"
        );
        rig.restart(killed);
        rig.server.wait_workers(2);
    }
}

#[test]
fn what_cannot_be_continued_ends_with_today_s_clean_error() {
    let mut rig = Rig::start(&[("CONTINUE_ON_FAILURE", "on")]);
    let tools = json!({"tools": [{"type": "function", "function": {"name": "f"}}]});
    for (extra, header) in [
        (tools, None),
        (json!({"n": 2}), None),
        (json!({"logprobs": true}), None),
        (json!({}), Some("false")),
    ] {
        let before = rig.asked();
        let headers: Vec<(&str, &str)> = header
            .map(|h| vec![("x-continue-on-failure", h)])
            .unwrap_or_default();
        let client = send_request(
            rig.server.addr,
            "POST",
            "/v1/chat/completions",
            Some(&body("Another prompt.", extra.clone())),
            &headers,
        );
        let mut reader = BufReader::new(client);
        assert_eq!(read_head(&mut reader).0, 200);
        let mut text = String::new();
        read_until(&mut reader, &mut text, 2);
        // With tools: until the tool call has begun.
        while extra.get("tools").is_some() && !text.contains("tool_calls") {
            let piece = read_chunk(&mut reader).expect("more events");
            text.push_str(&String::from_utf8_lossy(&piece));
        }
        let killed = rig.kill_serving(before);
        read_rest(&mut reader, &mut text);
        assert!(!text.contains(": continued"), "{extra}: {text}");
        let last = events(&text).pop().expect("events");
        assert!(last.data.contains("worker_disconnected"), "{extra}: {text}");
        rig.restart(killed);
        rig.server.wait_workers(2);
    }
}

/// A whole streamed answer's body.
fn post_stream(addr: SocketAddr, body: &str, headers: &[(&str, &str)]) -> String {
    let client = send_request(addr, "POST", "/v1/chat/completions", Some(body), headers);
    let mut reader = BufReader::new(client);
    assert_eq!(read_head(&mut reader).0, 200);
    let mut text = String::new();
    read_rest(&mut reader, &mut text);
    text
}
