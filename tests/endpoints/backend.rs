//! A fake box behind a worker for the routes beyond chat: real sockets, one thread per
//! connection, every request reported to the test (path, headers, body digest).
#![allow(dead_code)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};

use crossbeam_channel::{Receiver, Sender};
use serde_json::json;
use sha2::{Digest, Sha256};

/// Models the box serves.
pub const MODELS: &[&str] = &["whisper", "tts", "sd"];
/// Bytes of each streamed speech chunk, and how many.
pub const SPEECH_CHUNK: usize = 40_000;
pub const SPEECH_CHUNKS: usize = 4;
/// Bytes of the image an images answer carries.
pub const IMAGE_BYTES: usize = 3000;

/// One request as the box saw it.
#[derive(Debug, Clone)]
pub struct Seen {
    pub path: String,
    pub headers: Vec<(String, String)>,
    pub len: usize,
    pub sha256: String,
    /// The body, when at most 1 MiB.
    pub body: Vec<u8>,
}

impl Seen {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

pub struct Box {
    pub addr: SocketAddr,
    pub seen: Receiver<Seen>,
    /// Each send lets the speech answer write its next chunk.
    pub speech_go: Sender<()>,
}

/// Deterministic bytes covering every value (`seed` varies them).
pub fn noise(len: usize, seed: u8) -> Vec<u8> {
    let mut x = 0x9e37_79b9u32 ^ u32::from(seed);
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            x as u8
        })
        .collect()
}

pub fn sha256(bytes: &[u8]) -> String {
    hex(&Sha256::digest(bytes))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

pub fn start() -> Box {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("addr");
    let (tx, seen) = crossbeam_channel::unbounded();
    let (speech_go, go) = crossbeam_channel::unbounded::<()>();
    std::thread::spawn(move || {
        for conn in listener.incoming().map_while(Result::ok) {
            let tx = tx.clone();
            let go = go.clone();
            std::thread::spawn(move || serve(conn, &tx, &go));
        }
    });
    Box {
        addr,
        seen,
        speech_go,
    }
}

/// A request's method, path and headers (names lower-case).
pub type Head = (String, String, Vec<(String, String)>);

/// Reads a request's [`Head`]; `None` when the connection ends first.
pub fn read_head(reader: &mut impl BufRead) -> Option<Head> {
    let mut line = String::new();
    if reader.read_line(&mut line).unwrap_or(0) == 0 {
        return None;
    }
    let mut parts = line.split_whitespace();
    let method = parts.next().unwrap_or("").to_string();
    let path = parts.next().unwrap_or("").to_string();
    let mut headers = Vec::new();
    loop {
        line.clear();
        if reader.read_line(&mut line).unwrap_or(0) == 0 {
            return None;
        }
        let l = line.trim_end();
        if l.is_empty() {
            return Some((method, path, headers));
        }
        if let Some((n, v)) = l.split_once(':') {
            headers.push((n.trim().to_ascii_lowercase(), v.trim().to_string()));
        }
    }
}

fn serve(conn: TcpStream, tx: &Sender<Seen>, go: &Receiver<()>) {
    let mut reader = BufReader::new(conn.try_clone().expect("clone"));
    let mut out = conn;
    let Some((method, path, headers)) = read_head(&mut reader) else {
        return;
    };
    let len: usize = headers
        .iter()
        .find(|(n, _)| n == "content-length")
        .and_then(|(_, v)| v.parse().ok())
        .unwrap_or(0);
    // Read in pieces: a 100 MB upload is hashed, never held.
    let mut hasher = Sha256::new();
    let mut body = Vec::new();
    let mut left = len;
    let mut buf = vec![0u8; 64 * 1024];
    while left > 0 {
        let n = match reader.read(&mut buf[..left.min(64 * 1024)]) {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        hasher.update(&buf[..n]);
        if body.len() + n <= 1 << 20 {
            body.extend_from_slice(&buf[..n]);
        }
        left -= n;
    }
    let sha = hex(&hasher.finalize());
    let asked: usize = serde_json::from_slice::<serde_json::Value>(&body)
        .ok()
        .and_then(|v| v.get("bytes")?.as_u64())
        .unwrap_or(1000) as usize;
    if method == "POST" {
        let _ = tx.send(Seen {
            path: path.clone(),
            headers: headers.clone(),
            len,
            sha256: sha.clone(),
            body,
        });
    }
    match (method.as_str(), path.as_str()) {
        ("GET", "/v1/models") => {
            let data: Vec<_> = MODELS.iter().map(|m| json!({"id": m})).collect();
            whole(
                &mut out,
                200,
                "application/json",
                &json!({"data": data}).to_string().into_bytes(),
            );
        }
        ("POST", "/v1/audio/transcriptions") => {
            let answer = json!({"text": "hello from the box", "usage": {"prompt_tokens": 5, "completion_tokens": 4, "total_tokens": 9}});
            whole(
                &mut out,
                200,
                "application/json",
                answer.to_string().as_bytes(),
            );
        }
        ("POST", "/v1/audio/speech") => speech(&mut out, go),
        ("POST", "/v1/images/generations") => {
            let png = noise(IMAGE_BYTES, 7);
            let b64 = modelrelay::protocol::binary::encode(&png);
            let answer = json!({"created": 1, "data": [{"b64_json": b64}]});
            whole(
                &mut out,
                200,
                "application/json",
                answer.to_string().as_bytes(),
            );
        }
        ("POST", "/upload") => {
            let answer = json!({"bytes": len, "sha256": sha});
            whole(
                &mut out,
                200,
                "application/json",
                answer.to_string().as_bytes(),
            );
        }
        ("POST", "/download") => download(&mut out, asked),
        ("POST", "/v1/rerank" | "/infill") => {
            let answer = json!({"path": path, "usage": {"prompt_tokens": 3, "total_tokens": 3}});
            whole(
                &mut out,
                200,
                "application/json",
                answer.to_string().as_bytes(),
            );
        }
        _ => whole(&mut out, 404, "text/plain", b"no such route"),
    }
}

fn whole(out: &mut TcpStream, status: u16, content_type: &str, body: &[u8]) {
    let head = format!(
        "HTTP/1.1 {status} X\r\ncontent-type: {content_type}\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
        body.len()
    );
    let _ = out.write_all(head.as_bytes());
    let _ = out.write_all(body);
}

/// Speech: chunked audio, a chunk each time the test says so.
fn speech(out: &mut TcpStream, go: &Receiver<()>) {
    let head = "HTTP/1.1 200 OK\r\ncontent-type: audio/mpeg\r\ncontent-disposition: attachment; filename=\"speech.mp3\"\r\ntransfer-encoding: chunked\r\nconnection: close\r\n\r\n";
    if out.write_all(head.as_bytes()).is_err() {
        return;
    }
    for i in 0..SPEECH_CHUNKS {
        if go.recv().is_err() {
            return;
        }
        let chunk = noise(SPEECH_CHUNK, i as u8);
        let framed = [
            format!("{:x}\r\n", chunk.len()).into_bytes(),
            chunk,
            b"\r\n".to_vec(),
        ]
        .concat();
        if out.write_all(&framed).is_err() {
            return;
        }
    }
    let _ = out.write_all(b"0\r\n\r\n");
}

/// `total` bytes of noise with their length, written 64 KiB at a time.
pub fn download(out: &mut TcpStream, total: usize) {
    let head = format!(
        "HTTP/1.1 200 OK\r\ncontent-type: application/octet-stream\r\ncontent-length: {total}\r\nconnection: close\r\n\r\n"
    );
    if out.write_all(head.as_bytes()).is_err() {
        return;
    }
    let piece = noise(64 * 1024, 3);
    let mut left = total;
    while left > 0 {
        let n = left.min(piece.len());
        if out.write_all(&piece[..n]).is_err() {
            return;
        }
        left -= n;
    }
}
