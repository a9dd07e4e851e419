//! The rig of the continuation suites (`tests/continuation*.rs`): a real server, two
//! real worker binaries, each over a fake llama-server whose answer is a fixed function
//! of the prompt and of the assistant prefill it is given, so a continuation can be
//! checked exactly. It answers `/v1/chat/completions` and `/v1/messages` the way
//! llama-server does, echo of the prefill included.
//!
//! The backend paces its words (a few ms apart) so that a kill lands mid-answer; the
//! tests wait for the events they need, never for time.
#![allow(dead_code)]

use std::io::{BufReader, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::common::procs::{start_worker, Proc, ServerProc};
use crate::common::{answer_get, read_chunk, read_request};
use parking_lot::Mutex;
use serde_json::{json, Value};

/// Words in every answer.
pub const WORDS: usize = 24;
/// Pause between two words.
const PACE: Duration = Duration::from_millis(15);

/// The answer to `prompt`, one token per word: a fixed sequence seeded by the prompt.
pub fn answer(prompt: &str) -> Vec<String> {
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

/// A fake llama-server: what it was asked (the prefill of each answer request).
#[derive(Clone, Default)]
pub struct Backend {
    pub prefills: Arc<Mutex<Vec<Option<String>>>>,
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
            if answer_get(&mut out, &path).is_err() {
                return;
            }
            continue;
        }
        let asked = Asked::read(backend, &body);
        let sent = if path == "/v1/messages" {
            stream_messages(&mut out, &asked)
        } else {
            stream_chat(&mut out, &asked)
        };
        if sent.is_err() {
            return;
        }
    }
}

/// What one answer request asked for.
struct Asked {
    body: Value,
    words: Vec<String>,
    /// The prefill, echoed in front of the first new word.
    prefill: String,
    /// The answer's words the prefill already holds.
    skip: usize,
    n: u64,
}

impl Asked {
    fn read(backend: &Backend, body: &[u8]) -> Asked {
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
        // Where the prefill ends in the answer (by characters; it is always a word
        // boundary here, since the relay sends the text of whole chunks).
        let mut done = 0;
        let mut skip = 0;
        while skip < words.len() && done + words[skip].len() <= prefill.len() {
            done += words[skip].len();
            skip += 1;
        }
        let n = NEXT_ID.fetch_add(1, Ordering::Relaxed);
        Asked {
            body,
            words,
            prefill,
            skip,
            n,
        }
    }

    /// The new words, paced, the first with the prefill's echo; with tools, the answer
    /// turns into a tool call after two words (`Err`: the word is a tool call's).
    fn each_word(
        &self,
        mut send: impl FnMut(Result<String, &str>) -> std::io::Result<()>,
    ) -> std::io::Result<()> {
        for (i, word) in self.words.iter().enumerate().skip(self.skip) {
            std::thread::sleep(PACE);
            if self.body.get("tools").is_some() && i >= 2 {
                send(Err(word))?;
            } else if i == self.skip {
                send(Ok(format!("{}{word}", self.prefill)))?;
            } else {
                send(Ok(word.clone()))?;
            }
        }
        Ok(())
    }
}

const SSE_HEAD: &str =
    "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n";

fn send(out: &mut TcpStream, data: &str) -> std::io::Result<()> {
    out.write_all(format!("{:x}\r\n{data}\r\n", data.len()).as_bytes())
}

/// Streams a chat answer as llama-server does: a role chunk, one chunk per word, a
/// finish chunk, usage when asked, `[DONE]`.
fn stream_chat(out: &mut TcpStream, asked: &Asked) -> std::io::Result<()> {
    let (n, skip) = (asked.n, asked.skip);
    let id = format!("chatcmpl-{n}");
    let event = |delta: Value, finish: Value| {
        let chunk = json!({"id": id, "created": 1_000 + n, "model": "m", "object": "chat.completion.chunk",
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]});
        format!("data: {chunk}\n\n")
    };
    out.write_all(SSE_HEAD.as_bytes())?;
    let role = json!({"role": "assistant", "content": null});
    send(out, &event(role, Value::Null))?;
    asked.each_word(|word| {
        let delta = match word {
            Ok(text) => json!({"content": text}),
            Err(word) => json!({"tool_calls": [{"index": 0, "function": {"arguments": word}}]}),
        };
        send(out, &event(delta, Value::Null))
    })?;
    send(out, &event(json!({}), json!("stop")))?;
    if asked.body["stream_options"]["include_usage"] == true {
        let prompt_tokens = 5 + skip;
        let usage = json!({"id": id, "created": 1_000 + n, "model": "m", "choices": [],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": WORDS - skip,
                      "total_tokens": prompt_tokens + WORDS - skip}});
        send(out, &format!("data: {usage}\n\n"))?;
    }
    send(out, "data: [DONE]\n\n")?;
    out.write_all(b"0\r\n\r\n")
}

/// An Anthropic event: its type as the SSE event name.
fn anthropic(data: Value) -> String {
    let name = data["type"].as_str().unwrap_or("").to_string();
    format!("event: {name}\ndata: {data}\n\n")
}

/// Streams an Anthropic Messages answer as llama-server does: `message_start` (input
/// usage), one text block with a `text_delta` per word, its stop, `message_delta`
/// (output usage), `message_stop`. With tools, the text block stops after two words
/// and a `tool_use` block takes the rest as `input_json_delta`s.
fn stream_messages(out: &mut TcpStream, asked: &Asked) -> std::io::Result<()> {
    out.write_all(SSE_HEAD.as_bytes())?;
    let message = json!({"id": format!("msg_{}", asked.n), "type": "message",
        "role": "assistant", "content": [], "model": "m", "stop_reason": null,
        "stop_sequence": null, "usage": {"input_tokens": 5 + asked.skip, "output_tokens": 0}});
    send(
        out,
        &anthropic(json!({"type": "message_start", "message": message})),
    )?;
    let text = json!({"type": "text", "text": ""});
    let start = json!({"type": "content_block_start", "index": 0, "content_block": text});
    send(out, &anthropic(start))?;
    let mut block = 0;
    asked.each_word(|word| match word {
        Ok(text) => {
            let delta = json!({"type": "text_delta", "text": text});
            let event = json!({"type": "content_block_delta", "index": 0, "delta": delta});
            send(out, &anthropic(event))
        }
        Err(word) => {
            if block == 0 {
                block = 1;
                send(
                    out,
                    &anthropic(json!({"type": "content_block_stop", "index": 0})),
                )?;
                let tool = json!({"type": "tool_use", "id": "toolu_1", "name": "f", "input": {}});
                let start =
                    json!({"type": "content_block_start", "index": 1, "content_block": tool});
                send(out, &anthropic(start))?;
            }
            let delta = json!({"type": "input_json_delta", "partial_json": word});
            let event = json!({"type": "content_block_delta", "index": 1, "delta": delta});
            send(out, &anthropic(event))
        }
    })?;
    let stop = json!({"type": "content_block_stop", "index": block});
    send(out, &anthropic(stop))?;
    let end = json!({"type": "message_delta",
        "delta": {"stop_reason": "end_turn", "stop_sequence": null},
        "usage": {"output_tokens": WORDS - asked.skip}});
    send(out, &anthropic(end))?;
    send(out, &anthropic(json!({"type": "message_stop"})))?;
    out.write_all(b"0\r\n\r\n")
}

/// The relay, and two workers each over its own fake backend.
pub struct Rig {
    pub server: ServerProc,
    pub backends: [(SocketAddr, Backend); 2],
    workers: [Option<Proc>; 2],
}

impl Rig {
    pub fn start(server_env: &[(&str, &str)]) -> Rig {
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

    pub fn restart(&mut self, i: usize) {
        let name = format!("box-{i}");
        let env = [
            ("BACKEND_KIND", "llama-server"),
            ("WORKER_NAME", name.as_str()),
            ("MAX_CONCURRENCY", "2"),
        ];
        self.workers[i] = Some(start_worker(self.server.addr, self.backends[i].0, &env));
    }

    /// Kills (`-9`) the worker whose backend got the latest request.
    pub fn kill_serving(&mut self, asked_before: [usize; 2]) -> usize {
        let i = (0..2)
            .find(|i| self.backends[*i].1.prefills.lock().len() > asked_before[*i])
            .expect("a backend got the request");
        let mut worker = self.workers[i].take().expect("running");
        worker.signal("KILL");
        worker.wait_exit();
        i
    }

    pub fn asked(&self) -> [usize; 2] {
        [0, 1].map(|i| self.backends[i].1.prefills.lock().len())
    }

    /// Asserts that the backend other than `killed` was asked to go on from a part of
    /// `expected` (what the client had); then brings the killed worker back.
    pub fn check_prefill_and_revive(&mut self, killed: usize, expected: &str) {
        let other = &self.backends[1 - killed].1;
        let prefill = other.prefills.lock().last().cloned().flatten();
        assert!(
            prefill
                .as_deref()
                .is_some_and(|p| expected.starts_with(p) && !p.is_empty()),
            "{prefill:?}"
        );
        self.revive(killed);
    }

    /// Starts worker `i` again and waits until both are connected.
    pub fn revive(&mut self, i: usize) {
        self.restart(i);
        self.server.wait_workers(2);
    }
}

/// Reads the rest of a chunked answer.
pub fn read_rest(reader: &mut BufReader<TcpStream>, text: &mut String) {
    while let Some(piece) = read_chunk(reader) {
        text.push_str(&String::from_utf8_lossy(&piece));
    }
}

/// Small deterministic generator for the kill points (seed printed, to rerun a case).
pub fn points(n: usize) -> Vec<usize> {
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
