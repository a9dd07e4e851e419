//! The client side of a resumable stream, for the tests: reads SSE events and NDJSON
//! lines one at a time, resumes, and drops its connection like a lost network.

use std::io::BufReader;
use std::net::{Shutdown, SocketAddr, TcpStream};

use serde_json::{json, Value};

use crate::common::*;

/// One streamed answer as a client reads it: event by event.
pub struct Client {
    reader: BufReader<TcpStream>,
    pub status: u16,
    headers: Vec<(String, String)>,
    pending: String,
}

/// One event as read: its id and its data (SSE), or a line (NDJSON, id 0).
#[derive(Debug)]
pub struct Got {
    pub id: u64,
    pub data: String,
}

impl Client {
    pub fn open(
        addr: SocketAddr,
        method: &str,
        path: &str,
        body: Option<&str>,
        headers: &[(&str, &str)],
    ) -> Client {
        let stream = send_request(addr, method, path, body, headers);
        let mut reader = BufReader::new(stream);
        let (status, headers) = read_head(&mut reader);
        Client {
            reader,
            status,
            headers,
            pending: String::new(),
        }
    }

    pub fn chat(addr: SocketAddr, headers: &[(&str, &str)]) -> Client {
        let body = json!({"model": "m", "stream": true, "stream_options": {"include_usage": true},
                          "messages": [{"role": "user", "content": "hi"}]});
        let mut all = vec![
            ("x-resumable", "true"),
            ("content-type", "application/json"),
        ];
        all.extend_from_slice(headers);
        Client::open(
            addr,
            "POST",
            "/v1/chat/completions",
            Some(&body.to_string()),
            &all,
        )
    }

    pub fn resume(addr: SocketAddr, url: &str, last: u64, headers: &[(&str, &str)]) -> Client {
        let last = last.to_string();
        let mut all = vec![("last-event-id", last.as_str())];
        all.extend_from_slice(headers);
        Client::open(addr, "GET", url, None, &all)
    }

    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }

    /// The next SSE event; `None` at the end of the body.
    pub fn next_event(&mut self) -> Option<Got> {
        loop {
            if let Some(i) = self.pending.find("\n\n") {
                let event: String = self.pending.drain(..i + 2).collect();
                let mut got = Got {
                    id: 0,
                    data: String::new(),
                };
                for line in event.lines() {
                    if let Some(id) = line.strip_prefix("id: ") {
                        got.id = id.parse().expect("numeric id");
                    } else if let Some(data) = line.strip_prefix("data: ") {
                        got.data = data.to_string();
                    }
                }
                return Some(got);
            }
            let chunk = read_chunk(&mut self.reader)?;
            self.pending
                .push_str(std::str::from_utf8(&chunk).expect("utf-8"));
        }
    }

    /// The next NDJSON line; `None` at the end of the body.
    pub fn next_line(&mut self) -> Option<String> {
        loop {
            if let Some(i) = self.pending.find('\n') {
                return Some(self.pending.drain(..=i).collect());
            }
            let chunk = read_chunk(&mut self.reader)?;
            self.pending
                .push_str(std::str::from_utf8(&chunk).expect("utf-8"));
        }
    }

    /// The rest of a whole (error) answer.
    pub fn json(mut self) -> Value {
        let mut r = Response {
            status: self.status,
            headers: self.headers.clone(),
            body: Vec::new(),
        };
        let len: usize = self
            .header("content-length")
            .map_or(0, |l| l.parse().expect("length"));
        r.body = vec![0; len];
        std::io::Read::read_exact(&mut self.reader, &mut r.body).expect("body");
        r.json()
    }

    /// The connection drops (Wi-Fi gone): whatever was in flight is lost.
    pub fn drop_connection(self) {
        let _ = self.reader.get_ref().shutdown(Shutdown::Both);
    }
}

pub fn word(data: &str) -> Option<String> {
    let v: Value = serde_json::from_str(data).ok()?;
    v["choices"][0]["delta"]["content"]
        .as_str()
        .map(str::to_string)
}

/// A small deterministic generator; the seed is printed so a failure can be rerun.
pub struct Rng(u64);

impl Rng {
    pub fn seeded() -> Rng {
        let seed = std::env::var("RESUME_SEED")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| {
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(1, |d| d.as_nanos() as u64)
            });
        eprintln!("RESUME_SEED={seed}");
        Rng(seed | 1)
    }

    pub fn below(&mut self, n: usize) -> usize {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 % n as u64) as usize
    }
}
