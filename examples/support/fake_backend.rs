//! A tiny OpenAI-compatible backend on std only: thread per connection, keep-alive,
//! deterministic answers. Used by `make run` (demo backend), the benchmark and tests.
//!
//! * `GET /v1/models` lists [`FakeBackend::model`].
//! * `POST /v1/...` answers a chat completion; with `"stream": true` it streams one SSE
//!   event per word of the answer (chunked encoding, no pauses) and `data: [DONE]`.
#![allow(dead_code)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;

#[derive(Clone)]
pub struct FakeBackend {
    pub model: String,
    /// Words of the answer; one SSE event each when streaming.
    pub words: Vec<String>,
}

impl FakeBackend {
    pub fn new(model: &str, answer: &str) -> FakeBackend {
        FakeBackend {
            model: model.to_string(),
            words: answer.split_inclusive(' ').map(String::from).collect(),
        }
    }

    /// Binds `addr` and serves forever on background threads.
    pub fn spawn(self, addr: &str) -> std::io::Result<SocketAddr> {
        let listener = TcpListener::bind(addr)?;
        let local = listener.local_addr()?;
        let backend = Arc::new(self);
        std::thread::spawn(move || {
            for stream in listener.incoming().flatten() {
                let backend = backend.clone();
                std::thread::spawn(move || backend.serve(stream));
            }
        });
        Ok(local)
    }

    fn serve(&self, stream: TcpStream) {
        let _ = stream.set_nodelay(true);
        let Ok(write_half) = stream.try_clone() else {
            return;
        };
        let mut out = write_half;
        let mut reader = BufReader::new(stream);
        loop {
            let Some((method, path, body)) = read_request(&mut reader) else {
                return;
            };
            let ok = match (method.as_str(), path.as_str()) {
                ("GET", "/v1/models") => {
                    let body = format!(
                        r#"{{"object":"list","data":[{{"id":"{}","object":"model","owned_by":"demo"}}]}}"#,
                        self.model
                    );
                    respond(&mut out, 200, "application/json", body.as_bytes())
                }
                ("GET", "/health") => {
                    respond(&mut out, 200, "application/json", b"{\"status\":\"ok\"}")
                }
                ("POST", _) if is_stream(&body) => self.stream_answer(&mut out),
                ("POST", _) => respond(
                    &mut out,
                    200,
                    "application/json",
                    self.completion().as_bytes(),
                ),
                _ => respond(
                    &mut out,
                    404,
                    "application/json",
                    b"{\"error\":\"not found\"}",
                ),
            };
            if !ok {
                return;
            }
        }
    }

    pub fn completion(&self) -> String {
        let text: String = self.words.concat();
        format!(
            r#"{{"id":"chatcmpl-demo","object":"chat.completion","model":"{}","choices":[{{"index":0,"message":{{"role":"assistant","content":{}}},"finish_reason":"stop"}}],"usage":{{"prompt_tokens":5,"completion_tokens":{},"total_tokens":{}}}}}"#,
            self.model,
            json_string(&text),
            self.words.len(),
            self.words.len() + 5
        )
    }

    fn stream_answer(&self, out: &mut TcpStream) -> bool {
        let head = "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n";
        if out.write_all(head.as_bytes()).is_err() {
            return false;
        }
        for word in &self.words {
            let event = format!(
                "data: {{\"object\":\"chat.completion.chunk\",\"model\":\"{}\",\"choices\":[{{\"index\":0,\"delta\":{{\"content\":{}}}}}]}}\n\n",
                self.model,
                json_string(word)
            );
            if write_chunk(out, event.as_bytes()).is_err() {
                return false;
            }
        }
        write_chunk(out, b"data: [DONE]\n\n").is_ok() && out.write_all(b"0\r\n\r\n").is_ok()
    }
}

fn is_stream(body: &[u8]) -> bool {
    let text = String::from_utf8_lossy(body);
    text.contains("\"stream\":true") || text.contains("\"stream\": true")
}

fn json_string(s: &str) -> String {
    let mut out = String::from("\"");
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

fn write_chunk(out: &mut TcpStream, data: &[u8]) -> std::io::Result<()> {
    let mut buf = format!("{:x}\r\n", data.len()).into_bytes();
    buf.extend_from_slice(data);
    buf.extend_from_slice(b"\r\n");
    out.write_all(&buf)
}

fn respond(out: &mut TcpStream, status: u16, content_type: &str, body: &[u8]) -> bool {
    let mut buf = format!(
        "HTTP/1.1 {status} X\r\ncontent-type: {content_type}\r\ncontent-length: {}\r\n\r\n",
        body.len()
    )
    .into_bytes();
    buf.extend_from_slice(body);
    out.write_all(&buf).is_ok()
}

/// Reads one request (Content-Length bodies only); `None` at EOF or on garbage.
fn read_request(reader: &mut BufReader<TcpStream>) -> Option<(String, String, Vec<u8>)> {
    let mut line = String::new();
    if reader.read_line(&mut line).ok()? == 0 {
        return None;
    }
    let mut parts = line.split_whitespace();
    let method = parts.next()?.to_string();
    let path = parts.next()?.to_string();
    let mut length = 0usize;
    loop {
        line.clear();
        if reader.read_line(&mut line).ok()? == 0 {
            return None;
        }
        let l = line.trim_end();
        if l.is_empty() {
            break;
        }
        if let Some((n, v)) = l.split_once(':') {
            if n.trim().eq_ignore_ascii_case("content-length") {
                length = v.trim().parse().ok()?;
            }
        }
    }
    let mut body = vec![0; length];
    reader.read_exact(&mut body).ok()?;
    Some((method, path, body))
}
