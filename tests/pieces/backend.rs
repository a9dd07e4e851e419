//! A fake box for uploads in pieces: real sockets, one thread per connection. It reads
//! a body (`Content-Length` or chunked) as it comes, hashing it, never holding it, and
//! tells the test how each upload ended. `/slow` reads only as the test lets it.
//! `/download` answers the bytes its JSON body asks for, and tells the test when its
//! writes stall (the client, through the relay, stopped taking them).
#![allow(dead_code)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use crossbeam_channel::{Receiver, Sender};
use serde_json::json;
use sha2::{Digest, Sha256};

/// One upload as the box saw it.
#[derive(Debug, Clone)]
pub struct Upload {
    pub path: String,
    pub content_length: Option<usize>,
    pub chunked: bool,
    /// Bytes read.
    pub len: usize,
    pub sha256: String,
    /// The body ended as framed; false: the connection broke off first.
    pub whole: bool,
}

pub struct Box {
    pub addr: SocketAddr,
    pub uploads: Receiver<Upload>,
    /// Each send lets `/slow` read 64 KiB more.
    pub slow_go: Sender<usize>,
    /// Bytes `/slow` has read so far.
    pub slow_read: Arc<AtomicUsize>,
    /// What `/download` did: `Stalled(written)` when a write waited 2 s, then
    /// `Done(written)`.
    pub downloads: Receiver<Download>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Download {
    Stalled(usize),
    Done(usize),
}

const READ: usize = 64 * 1024;

pub fn start() -> Box {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("addr");
    let (tx, uploads) = crossbeam_channel::unbounded();
    let (slow_go, go) = crossbeam_channel::unbounded::<usize>();
    let slow_read = Arc::new(AtomicUsize::new(0));
    let read = slow_read.clone();
    let (down_tx, downloads) = crossbeam_channel::unbounded();
    std::thread::spawn(move || {
        for conn in listener.incoming().map_while(Result::ok) {
            let (tx, go, read, down) = (tx.clone(), go.clone(), read.clone(), down_tx.clone());
            std::thread::spawn(move || serve(conn, &tx, &go, &read, &down));
        }
    });
    Box {
        addr,
        uploads,
        slow_go,
        slow_read,
        downloads,
    }
}

pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Reads a body through `take` (which gets at most `READ` bytes each call).
struct Body<'a> {
    reader: &'a mut BufReader<TcpStream>,
    hasher: Sha256,
    len: usize,
    gate: Option<(&'a Receiver<usize>, &'a AtomicUsize, usize)>,
}

impl Body<'_> {
    /// Reads exactly `n` bytes; false when the connection ended first.
    fn take(&mut self, mut n: usize) -> bool {
        let mut buf = vec![0u8; READ];
        while n > 0 {
            if let Some((go, _, allowed)) = &mut self.gate {
                while *allowed == 0 {
                    match go.recv() {
                        Ok(more) => *allowed += more,
                        Err(_) => return false,
                    }
                }
            }
            let want = n.min(READ).min(self.gate.as_ref().map_or(READ, |g| g.2));
            let got = match self.reader.read(&mut buf[..want]) {
                Ok(0) | Err(_) => return false,
                Ok(got) => got,
            };
            self.hasher.update(&buf[..got]);
            self.len += got;
            n -= got;
            if let Some((_, read, allowed)) = &mut self.gate {
                *allowed -= got;
                read.fetch_add(got, Ordering::SeqCst);
            }
        }
        true
    }

    fn line(&mut self) -> Option<String> {
        let mut line = String::new();
        match self.reader.read_line(&mut line) {
            Ok(0) | Err(_) => None,
            Ok(_) => Some(line.trim_end().to_string()),
        }
    }

    fn chunked(&mut self) -> bool {
        loop {
            let Some(size) = self.line() else {
                return false;
            };
            let Ok(size) = usize::from_str_radix(size.split(';').next().unwrap_or(""), 16) else {
                return false;
            };
            if size == 0 {
                return self.line().is_some();
            }
            if !self.take(size) || self.line().is_none() {
                return false;
            }
        }
    }
}

fn serve(
    conn: TcpStream,
    tx: &Sender<Upload>,
    go: &Receiver<usize>,
    read: &AtomicUsize,
    down: &Sender<Download>,
) {
    let mut reader = BufReader::new(conn.try_clone().expect("clone"));
    let mut out = conn;
    let Some((method, path, headers)) = crate::endpoints_box::read_head(&mut reader) else {
        return;
    };
    let header = |name: &str| {
        headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.clone())
    };
    if method == "GET" {
        let (status, body) = match path.as_str() {
            "/v1/models" => (200, json!({"data": [{"id": "whisper"}]}).to_string()),
            _ => (404, "{}".to_string()),
        };
        return answer(&mut out, status, &body);
    }
    let content_length = header("content-length").and_then(|v| v.parse().ok());
    if path == "/download" {
        let mut body = vec![0u8; content_length.unwrap_or(0)];
        if reader.read_exact(&mut body).is_err() {
            return;
        }
        let asked = serde_json::from_slice::<serde_json::Value>(&body)
            .ok()
            .and_then(|v| v.get("bytes")?.as_u64())
            .unwrap_or(0) as usize;
        return download(&mut out, asked, down);
    }
    let chunked = header("transfer-encoding").is_some_and(|v| v.contains("chunked"));
    let mut body = Body {
        reader: &mut reader,
        hasher: Sha256::new(),
        len: 0,
        gate: (path == "/slow").then_some((go, read, 0)),
    };
    let whole = if chunked {
        body.chunked()
    } else {
        body.take(content_length.unwrap_or(0))
    };
    let upload = Upload {
        path,
        content_length,
        chunked,
        len: body.len,
        sha256: hex(&body.hasher.finalize()),
        whole,
    };
    let _ = tx.send(upload.clone());
    if whole {
        let text = json!({"bytes": upload.len, "sha256": upload.sha256}).to_string();
        answer(&mut out, 200, &text);
    }
}

fn answer(out: &mut TcpStream, status: u16, body: &str) {
    let head = format!(
        "HTTP/1.1 {status} X\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
        body.len()
    );
    let _ = out.write_all(head.as_bytes());
    let _ = out.write_all(body.as_bytes());
}

/// Noise, `len` bytes (the endpoints box's `noise(len, 0)`), with its length; a write
/// that waits 2 s is reported once.
fn download(out: &mut TcpStream, len: usize, down: &Sender<Download>) {
    let head = format!(
        "HTTP/1.1 200 OK\r\ncontent-type: audio/wav\r\ncontent-length: {len}\r\nconnection: close\r\n\r\n"
    );
    if out.write_all(head.as_bytes()).is_err() {
        return;
    }
    let _ = out.set_write_timeout(Some(std::time::Duration::from_secs(2)));
    let mut x = 0x9e37_79b9u32;
    let mut written = 0;
    let mut stalled = false;
    let mut pending: Vec<u8> = Vec::new();
    while written < len {
        if pending.is_empty() {
            let n = (len - written).min(READ);
            pending = (0..n)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 17;
                    x ^= x << 5;
                    x as u8
                })
                .collect();
        }
        match out.write(&pending) {
            Ok(0) => return,
            Ok(n) => {
                written += n;
                pending.drain(..n);
            }
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                if !stalled {
                    stalled = true;
                    let _ = down.send(Download::Stalled(written));
                }
            }
            Err(_) => return,
        }
    }
    let _ = down.send(Download::Done(written));
}
