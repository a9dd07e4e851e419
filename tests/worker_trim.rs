//! Context that fits (issue 12): the real server, the real worker and a fake backend
//! over TCP that refuses, like llama-server, any body making more tokens than its
//! context (one token per four bytes here) with HTTP 400 `exceed_context_size_error`,
//! `n_prompt_tokens` and `n_ctx`. The worker retries trimmed before anything reached the
//! client; trimming off (per request or per worker) lets the 400 through unchanged.
//!
//! Nothing sleeps to synchronise: the backend reports every request on a channel.

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};

use common::procs::{start_worker, Proc, ServerProc};
use common::*;
use crossbeam_channel::{Receiver, Sender};
use serde_json::{json, Value};

/// The fake backend's context: bodies over this many bytes are refused.
const LIMIT_BYTES: usize = 4000;
const N_CTX: usize = LIMIT_BYTES / 4;
const ANSWER: &str = "short answer";

/// One request the fake backend received.
#[derive(Debug)]
struct Seen {
    headers: Vec<(String, String)>,
    body: String,
}

impl Seen {
    fn json(&self) -> Value {
        serde_json::from_str(&self.body).expect("JSON body")
    }
}

/// The llama-server refusal for a body of `len` bytes.
fn refusal(len: usize) -> String {
    let n = len.div_ceil(4);
    json!({"error": {"code": 400,
        "message": format!("request ({n} tokens) exceeds the available context size ({N_CTX} tokens), try increasing it"),
        "type": "exceed_context_size_error", "n_prompt_tokens": n, "n_ctx": N_CTX}})
    .to_string()
}

/// Starts the fake backend (model `m`); every POST is reported on the receiver.
fn fake_backend() -> (SocketAddr, Receiver<Seen>) {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("addr");
    let (tx, rx) = crossbeam_channel::unbounded();
    std::thread::spawn(move || {
        for stream in listener.incoming().flatten() {
            let tx = tx.clone();
            std::thread::spawn(move || serve(stream, &tx));
        }
    });
    (addr, rx)
}

/// Answers one request per connection, then closes it.
fn serve(stream: TcpStream, seen: &Sender<Seen>) {
    let Ok(mut out) = stream.try_clone() else {
        return;
    };
    let mut reader = BufReader::new(stream);
    let mut line = String::new();
    if reader.read_line(&mut line).unwrap_or(0) == 0 {
        return;
    }
    let mut parts = line.split_whitespace();
    let (method, path) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
    let (method, path) = (method.to_string(), path.to_string());
    let mut headers = Vec::new();
    loop {
        line.clear();
        if reader.read_line(&mut line).unwrap_or(0) == 0 {
            return;
        }
        let l = line.trim_end();
        if l.is_empty() {
            break;
        }
        if let Some((n, v)) = l.split_once(':') {
            headers.push((n.trim().to_ascii_lowercase(), v.trim().to_string()));
        }
    }
    let len = headers
        .iter()
        .find(|(n, _)| n == "content-length")
        .and_then(|(_, v)| v.parse().ok())
        .unwrap_or(0);
    let mut body = vec![0; len];
    if reader.read_exact(&mut body).is_err() {
        return;
    }
    let body = String::from_utf8_lossy(&body).into_owned();
    let (status, content_type, answer) = match (method.as_str(), path.as_str()) {
        ("GET", "/v1/models") => (
            200,
            "application/json",
            json!({"object": "list", "data": [{"id": "m", "object": "model"}]}).to_string(),
        ),
        ("POST", "/v1/chat/completions") => {
            let answer = if body.len() > LIMIT_BYTES {
                (400, "application/json", refusal(body.len()))
            } else if body.contains("\"stream\":true") {
                let event = json!({"choices": [{"index": 0, "delta": {"content": ANSWER}}]});
                (
                    200,
                    "text/event-stream",
                    format!("data: {event}\n\ndata: [DONE]\n\n"),
                )
            } else {
                (200, "application/json", openai_answer(ANSWER))
            };
            let _ = seen.send(Seen { headers, body });
            answer
        }
        _ => (404, "application/json", "{}".to_string()),
    };
    let reason = if status == 200 { "OK" } else { "Error" };
    let head = format!(
        "HTTP/1.1 {status} {reason}\r\ncontent-type: {content_type}\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
        answer.len()
    );
    let _ = out.write_all(head.as_bytes());
    let _ = out.write_all(answer.as_bytes());
}

struct Relay {
    server: ServerProc,
    worker: Proc,
    seen: Receiver<Seen>,
}

impl Relay {
    fn start(worker_env: &[(&str, &str)]) -> Relay {
        let server = ServerProc::start(&[]);
        let (backend, seen) = fake_backend();
        let worker = start_worker(server.addr, backend, worker_env);
        server.wait_workers(1);
        Relay {
            server,
            worker,
            seen,
        }
    }

    fn chat(&self, body: &Value, headers: &[(&str, &str)]) -> Response {
        let mut all = vec![("content-type", "application/json")];
        all.extend_from_slice(headers);
        request(
            self.server.addr,
            "POST",
            "/v1/chat/completions",
            Some(&body.to_string()),
            &all,
        )
    }

    /// The next request the backend received.
    fn next_seen(&self) -> Seen {
        self.seen.recv_timeout(WAIT).expect("a backend request")
    }

    /// No request beyond those taken: the one after them is a marker request.
    fn assert_no_more_than(&self, taken: &[Seen]) {
        let marker = json!({"model": "m", "messages": [{"role": "user", "content": "marker"}]});
        assert_eq!(self.chat(&marker, &[]).status, 200);
        let next = self.next_seen();
        assert!(
            next.body.contains("marker"),
            "an extra backend request after {} seen: {}",
            taken.len(),
            next.body
        );
    }
}

/// A system prompt, `turns` user/assistant pairs of about 240 bytes each, and a question.
fn conversation(turns: usize) -> Value {
    let mut messages = vec![json!({"role": "system", "content": "You answer in one line."})];
    for i in 0..turns {
        let text = format!("turn {i} {}", "filler words ".repeat(16));
        messages.push(json!({"role": "user", "content": text}));
        messages.push(json!({"role": "assistant", "content": text}));
    }
    messages.push(json!({"role": "user", "content": "THE LAST QUESTION"}));
    json!({"model": "m", "max_tokens": 32, "messages": messages})
}

fn messages(v: &Value) -> &Vec<Value> {
    v["messages"].as_array().expect("messages")
}

/// The trimmed body keeps the system prompt and the last question, starts with a user
/// message, and fits.
fn assert_trimmed(original: &Value, sent: &Seen, dropped: usize) {
    let v = sent.json();
    let kept = messages(&v);
    assert!(sent.body.len() <= LIMIT_BYTES, "{} bytes", sent.body.len());
    assert_eq!(kept.len() + dropped, messages(original).len());
    assert_eq!(kept[0], messages(original)[0], "system prompt kept");
    assert_eq!(kept[1]["role"], "user");
    assert_eq!(kept.last(), messages(original).last(), "last message kept");
    // What is kept is the newest part, in order.
    assert_eq!(kept[1..], messages(original)[1 + dropped..]);
}

#[test]
fn a_refused_conversation_is_retried_trimmed_and_says_how_much_went() {
    let relay = Relay::start(&[]);
    let body = conversation(20);
    let resp = relay.chat(&body, &[]);
    assert_eq!(resp.status, 200, "{}", resp.text());
    assert_eq!(resp.json()["choices"][0]["message"]["content"], ANSWER);
    let dropped: usize = resp
        .header("x-context-trimmed")
        .expect("x-context-trimmed")
        .parse()
        .expect("a count");
    assert!(dropped > 0);
    let first = relay.next_seen();
    assert_eq!(first.json(), body, "the first try is the client's body");
    let second = relay.next_seen();
    assert_trimmed(&body, &second, dropped);
    // One log line for the trim, with the numbers and without the prompt.
    let line = relay.worker.wait_line("refused the prompt");
    assert!(
        line.contains(&format!("dropped {dropped} message(s)")),
        "{line}"
    );
    assert!(line.contains(&format!("context {N_CTX}")), "{line}");
    assert!(
        !relay.worker.log().contains("filler"),
        "prompt text in the log"
    );

    // The worker now knows the model's context: the same conversation is pre-trimmed,
    // and the backend sees only the trimmed body.
    let resp = relay.chat(&body, &[]);
    assert_eq!(resp.status, 200, "{}", resp.text());
    let dropped: usize = resp.header("x-context-trimmed").unwrap().parse().unwrap();
    let only = relay.next_seen();
    assert_trimmed(&body, &only, dropped);
    relay.worker.wait_line("pre-trimmed for model `m`");
    relay.assert_no_more_than(&[only]);
}

#[test]
fn x_context_trim_off_lets_the_refusal_through_unchanged() {
    let relay = Relay::start(&[]);
    let body = conversation(20);
    let resp = relay.chat(&body, &[("x-context-trim", "off")]);
    assert_eq!(resp.status, 400);
    let seen = relay.next_seen();
    assert_eq!(resp.text(), refusal(seen.body.len()));
    assert!(resp.header("x-context-trimmed").is_none());
    assert_eq!(seen.json(), body);
    assert!(
        seen.headers.iter().all(|(n, _)| n != "x-context-trim"),
        "the worker's switch reached the backend: {:?}",
        seen.headers
    );
    relay.assert_no_more_than(&[seen]);
}

#[test]
fn context_trim_off_on_the_worker_lets_the_refusal_through_unchanged() {
    let relay = Relay::start(&[("CONTEXT_TRIM", "off")]);
    let body = conversation(20);
    let resp = relay.chat(&body, &[]);
    assert_eq!(resp.status, 400);
    let seen = relay.next_seen();
    assert_eq!(resp.text(), refusal(seen.body.len()));
    assert!(resp.header("x-context-trimmed").is_none());
    relay.assert_no_more_than(&[seen]);
}

#[test]
fn a_streaming_request_is_trimmed_before_its_first_chunk() {
    let relay = Relay::start(&[]);
    let mut body = conversation(20);
    body["stream"] = json!(true);
    let resp = relay.chat(&body, &[]);
    assert_eq!(resp.status, 200, "{}", resp.text());
    let text = resp.text();
    assert!(
        text.contains(ANSWER) && text.contains("[DONE]"),
        "the stream: {text}"
    );
    assert!(!text.contains("exceed_context_size_error"), "{text}");
    let first = relay.next_seen();
    assert!(first.body.len() > LIMIT_BYTES);
    let second = relay.next_seen();
    let sent = second.json();
    assert_eq!(sent["stream"], true);
    let dropped = messages(&body).len() - messages(&sent).len();
    assert!(dropped > 0);
    assert_trimmed(&body, &second, dropped);
    // The stream's head says so: a client reads it before the body.
    let told = dropped.to_string();
    assert_eq!(resp.header("x-context-trimmed"), Some(told.as_str()));
}

#[test]
fn when_even_the_last_message_does_not_fit_the_first_refusal_goes_out() {
    let relay = Relay::start(&[]);
    let mut body = conversation(3);
    let huge = "x".repeat(LIMIT_BYTES);
    body["messages"]
        .as_array_mut()
        .unwrap()
        .push(json!({"role": "user", "content": huge}));
    let resp = relay.chat(&body, &[]);
    assert_eq!(resp.status, 400);
    let first = relay.next_seen();
    assert_eq!(first.json(), body);
    // The backend's own words about the client's body, not about a trimmed one.
    assert_eq!(resp.text(), refusal(first.body.len()));
    assert!(resp.header("x-context-trimmed").is_none());
    let second = relay.next_seen();
    assert_eq!(
        messages(&second.json()).len(),
        2,
        "system and the last message"
    );
    relay.worker.wait_line("the backend's refusal goes out");
    relay.assert_no_more_than(&[first, second]);
}
