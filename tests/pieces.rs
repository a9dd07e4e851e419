//! Uploads in pieces, end to end: the real server and worker binaries in front of a
//! fake box on real sockets. A large body goes through without either process holding
//! it (their memory is sampled during a 100 MiB upload), a box that reads slowly holds
//! the client back, a client that breaks off cancels at the box, a body past the limit
//! is cut with the stable error, and a worker without the feature gets the body whole
//! or the client a clear error.

#[path = "pieces/backend.rs"]
mod backend;
mod common;
#[path = "endpoints/backend.rs"]
mod endpoints_box;

use std::io::{ErrorKind, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use common::procs::{start_worker, Proc, ServerProc};
use common::*;
use modelrelay::protocol::{binary, ServerMessage};
use serde_json::json;
use sha2::{Digest, Sha256};

const MIB: usize = 1 << 20;

fn relay(extra: &[(&str, &str)]) -> (ServerProc, Proc, backend::Box) {
    let mut env = vec![
        ("EXTRA_ROUTES", "/upload,/slow,/download"),
        ("MAX_REQUEST_BODY_BYTES", "120000000"),
    ];
    env.extend_from_slice(extra);
    let server = ServerProc::start(&env);
    let b = backend::start();
    let worker = start_worker(server.addr, b.addr, &[]);
    server.wait_workers(1);
    (server, worker, b)
}

/// A request body of deterministic noise, written as the test says.
struct Uploader {
    stream: TcpStream,
    hasher: Sha256,
    x: u32,
    /// Generated (and hashed) but not yet accepted by the socket.
    pending: Vec<u8>,
    left: usize,
    chunked: bool,
    written: usize,
}

impl Uploader {
    fn start(addr: SocketAddr, path: &str, len: usize, chunked: bool) -> Uploader {
        let mut stream = TcpStream::connect(addr).expect("connect");
        stream.set_read_timeout(Some(WAIT * 6)).ok();
        let framing = if chunked {
            "transfer-encoding: chunked".to_string()
        } else {
            format!("content-length: {len}")
        };
        let head = format!(
            "POST {path} HTTP/1.1\r\nhost: localhost\r\nx-model: whisper\r\ncontent-type: application/octet-stream\r\n{framing}\r\n\r\n"
        );
        stream.write_all(head.as_bytes()).expect("head");
        Uploader {
            stream,
            hasher: Sha256::new(),
            x: 0x9e37_79b9,
            pending: Vec::new(),
            left: len,
            chunked,
            written: 0,
        }
    }

    /// The next part of the body (framed as a chunk when chunked), hashed.
    fn generate(&mut self) {
        let n = self.left.min(256 * 1024);
        let mut bytes = Vec::with_capacity(n);
        for _ in 0..n {
            self.x ^= self.x << 13;
            self.x ^= self.x >> 17;
            self.x ^= self.x << 5;
            bytes.push(self.x as u8);
        }
        self.hasher.update(&bytes);
        self.left -= n;
        if self.chunked {
            self.pending
                .extend_from_slice(format!("{n:x}\r\n").as_bytes());
            self.pending.extend_from_slice(&bytes);
            self.pending.extend_from_slice(b"\r\n");
            if self.left == 0 {
                self.pending.extend_from_slice(b"0\r\n\r\n");
            }
        } else {
            self.pending = bytes;
        }
    }

    /// Writes until `upto` body bytes went out or the socket would not take more
    /// within the write timeout; false on the latter.
    fn send(&mut self, upto: usize) -> bool {
        while self.written < upto {
            if self.pending.is_empty() {
                if self.left == 0 {
                    return true;
                }
                self.generate();
            }
            match self.stream.write(&self.pending) {
                Ok(n) => {
                    self.written += n;
                    self.pending.drain(..n);
                }
                Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                    return false
                }
                Err(_) => return false,
            }
        }
        true
    }

    fn sha256(&self) -> String {
        backend::hex(&self.hasher.clone().finalize())
    }
}

/// Samples a process's resident memory until told to stop; the highest value (KiB).
fn sample_rss(p: &Proc, stop: &AtomicBool, peak: &AtomicU64) {
    while !stop.load(Ordering::SeqCst) {
        peak.fetch_max(p.rss_kb(), Ordering::SeqCst);
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn a_100_mib_upload_goes_through_in_bounded_memory() {
    const SIZE: usize = 100 * MIB;
    let (server, worker, b) = relay(&[]);
    let base = (server.proc.rss_kb(), worker.rss_kb());
    let stop = AtomicBool::new(false);
    let peaks = (AtomicU64::new(0), AtomicU64::new(0));
    let (sha, resp) = std::thread::scope(|s| {
        s.spawn(|| sample_rss(&server.proc, &stop, &peaks.0));
        s.spawn(|| sample_rss(&worker, &stop, &peaks.1));
        let mut up = Uploader::start(server.addr, "/upload", SIZE, false);
        assert!(up.send(SIZE));
        let resp = read_response(&mut up.stream);
        stop.store(true, Ordering::SeqCst);
        (up.sha256(), resp)
    });
    assert_eq!(resp.status, 200, "{}", resp.text());
    assert_eq!(resp.json()["bytes"], SIZE);
    assert_eq!(resp.json()["sha256"], sha.as_str());
    let seen = b.uploads.recv_timeout(WAIT).expect("the box saw it");
    assert!(seen.whole);
    assert_eq!(
        seen.content_length,
        Some(SIZE),
        "the client's length went along"
    );
    assert_eq!(seen.sha256, sha);
    let growth =
        |peak: &AtomicU64, base: u64| peak.load(Ordering::SeqCst).saturating_sub(base) / 1024;
    let (server_mib, worker_mib) = (growth(&peaks.0, base.0), growth(&peaks.1, base.1));
    eprintln!("100 MiB upload: server grew {server_mib} MiB, worker {worker_mib} MiB");
    // Held whole, the body alone is 100 MiB (and its base64 133 more).
    assert!(server_mib < 64, "server grew {server_mib} MiB");
    assert!(worker_mib < 64, "worker grew {worker_mib} MiB");
}

#[test]
fn a_chunked_upload_goes_through_in_pieces_and_chunked() {
    const SIZE: usize = 10 * MIB + 12_345;
    let (server, _worker, b) = relay(&[]);
    let mut up = Uploader::start(server.addr, "/upload", SIZE, true);
    assert!(up.send(usize::MAX));
    let resp = read_response(&mut up.stream);
    assert_eq!(resp.status, 200, "{}", resp.text());
    assert_eq!(resp.json()["sha256"], up.sha256().as_str());
    let seen = b.uploads.recv_timeout(WAIT).expect("seen");
    assert!(seen.chunked && seen.content_length.is_none());
    assert_eq!(seen.len, SIZE);
}

#[test]
fn a_slow_box_holds_the_client_back() {
    const SIZE: usize = 96 * MIB;
    let (server, _worker, b) = relay(&[]);
    let mut up = Uploader::start(server.addr, "/slow", SIZE, false);
    up.stream
        .set_write_timeout(Some(Duration::from_secs(2)))
        .ok();
    // The box reads 1 MiB, then nothing: the client must stall long before the end.
    b.slow_go.send(MIB).unwrap();
    assert!(
        !up.send(SIZE),
        "the whole body went out while the box read 1 MiB"
    );
    let read = b.slow_read.load(Ordering::SeqCst);
    let ahead = up.written - read;
    eprintln!("client stalled {} MiB ahead of the box", ahead / MIB);
    // The first part held by the server (4 MiB), the window (8 x 256 KiB) and the
    // socket buffers on the way; held whole, all 96 MiB would be gone.
    assert!(ahead < 40 * MIB, "{} MiB ahead", ahead / MIB);
    b.slow_go.send(usize::MAX / 2).unwrap();
    up.stream.set_write_timeout(None).ok();
    assert!(up.send(SIZE));
    let resp = read_response(&mut up.stream);
    assert_eq!(resp.status, 200, "{}", resp.text());
    assert_eq!(resp.json()["sha256"], up.sha256().as_str());
}

#[test]
fn a_client_that_breaks_off_cancels_at_the_box() {
    let (server, _worker, b) = relay(&[]);
    let mut up = Uploader::start(server.addr, "/upload", 40 * MIB, false);
    assert!(up.send(12 * MIB));
    // Wait until the box is being sent the body, then vanish.
    drop(up);
    let seen = b
        .uploads
        .recv_timeout(WAIT)
        .expect("the box's upload ended");
    assert!(!seen.whole, "the box saw a whole body: {seen:?}");
    assert!(seen.len < 40 * MIB);
}

#[test]
fn a_chunked_body_past_the_limit_is_cut_with_the_stable_error() {
    let (server, _worker, b) = relay(&[("MAX_REQUEST_BODY_BYTES", "9000000")]);
    let mut up = Uploader::start(server.addr, "/upload", 30 * MIB, true);
    up.stream
        .set_write_timeout(Some(Duration::from_secs(5)))
        .ok();
    // The server stops reading at the limit; the rest may not go out.
    let _ = up.send(usize::MAX);
    let resp = read_response(&mut up.stream);
    assert_eq!(resp.status, 413, "{}", resp.text());
    assert_eq!(resp.json()["error"]["code"], "request_too_large");
    let seen = b
        .uploads
        .recv_timeout(WAIT)
        .expect("the box's upload ended");
    assert!(!seen.whole, "the box got a body cut at the limit as whole");
}

#[test]
fn a_length_past_the_limit_is_refused_before_any_byte() {
    let (server, _worker, b) = relay(&[("MAX_REQUEST_BODY_BYTES", "9000000")]);
    let mut up = Uploader::start(server.addr, "/upload", 30 * MIB, false);
    let resp = read_response(&mut up.stream);
    assert_eq!(resp.status, 413, "{}", resp.text());
    assert_eq!(resp.json()["error"]["code"], "request_too_large");
    assert!(b.uploads.try_recv().is_err());
}

/// A worker of the protocol that takes binary bodies but not pieces.
fn binary_only_worker(addr: SocketAddr) -> FakeWorker {
    FakeWorker::connect_as(
        addr,
        json!({
            "type": "register", "worker_name": "older", "models": ["whisper"],
            "max_concurrent": 2, "protocol_version": "1", "features": ["binary_bodies"]
        }),
    )
}

#[test]
fn a_worker_without_pieces_gets_a_body_whole_when_it_fits() {
    let server = ServerProc::start(&[("EXTRA_ROUTES", "/upload")]);
    let w = binary_only_worker(server.addr);
    server.wait_workers(1);
    let mut up = Uploader::start(server.addr, "/upload", 6 * MIB, false);
    assert!(up.send(6 * MIB));
    let req = w.request();
    assert_eq!(req.body_encoding.as_deref(), Some(binary::BASE64));
    let body = binary::decode(&req.body).expect("base64");
    assert_eq!(backend::hex(&Sha256::digest(&body)), up.sha256());
    w.complete(&req.request_id, 200, &binary::encode(b"done"));
    let resp = read_response(&mut up.stream);
    assert_eq!(resp.status, 200, "{}", resp.text());
    assert_eq!(resp.body, b"done");
}

#[test]
fn a_worker_without_pieces_and_a_body_too_large_to_go_whole_is_a_clear_error() {
    let server = ServerProc::start(&[
        ("EXTRA_ROUTES", "/upload"),
        ("MAX_REQUEST_BODY_BYTES", "120000000"),
    ]);
    let w = binary_only_worker(server.addr);
    server.wait_workers(1);
    let mut up = Uploader::start(server.addr, "/upload", 60 * MIB, false);
    up.stream
        .set_write_timeout(Some(Duration::from_secs(5)))
        .ok();
    let _ = up.send(5 * MIB);
    let resp = read_response(&mut up.stream);
    assert_eq!(resp.status, 413, "{}", resp.text());
    assert_eq!(resp.json()["error"]["code"], "body_pieces_unsupported");
    assert!(w
        .recv_within(Duration::from_millis(300))
        .is_none_or(|m| !matches!(m, ServerMessage::Request(_))));
}

/// A worker that speaks the extension by hand: the server sends no piece past the
/// credit, and a worker lost mid-upload ends the request with a clear 502.
#[test]
fn pieces_follow_the_credit_and_a_worker_lost_midway_is_a_502() {
    let server = ServerProc::start(&[("EXTRA_ROUTES", "/upload")]);
    let w = FakeWorker::connect_as(
        server.addr,
        json!({
            "type": "register", "worker_name": "new", "models": ["whisper"],
            "max_concurrent": 2, "protocol_version": "1",
            "features": ["binary_bodies", "body_pieces"]
        }),
    );
    server.wait_workers(1);
    const SIZE: usize = 12 * MIB;
    let mut up = Uploader::start(server.addr, "/upload", SIZE, false);
    up.stream
        .set_write_timeout(Some(Duration::from_secs(1)))
        .ok();
    // Past the first part the server holds; the rest waits for credit.
    let _ = up.send(SIZE);
    let req = w.request();
    assert_eq!(req.body_encoding.as_deref(), Some("base64-pieces"));
    assert!(req.body.is_empty());
    assert_eq!(req.headers.get("content-length"), Some(&SIZE.to_string()));
    let piece = |w: &FakeWorker| match w.recv_within(WAIT) {
        Some(ServerMessage::BodyPiece {
            seq, chunk, last, ..
        }) => Some((seq, chunk, last)),
        _ => None,
    };
    w.send(json!({"type": "body_credit", "request_id": req.request_id, "until": 2}));
    let mut got = Vec::new();
    for want in 0..2 {
        let (seq, chunk, last) = piece(&w).expect("a piece");
        assert_eq!((seq, last), (want, false));
        got.extend(binary::decode(&chunk).expect("base64"));
    }
    assert!(
        w.recv_within(Duration::from_millis(300)).is_none(),
        "a piece past the credit"
    );
    w.send(json!({"type": "body_credit", "request_id": req.request_id, "until": 3}));
    assert_eq!(piece(&w).expect("piece 2").0, 2);
    w.kill();
    let resp = read_response(&mut up.stream);
    assert_eq!(resp.status, 502, "{}", resp.text());
    assert_eq!(resp.json()["error"]["code"], "worker_disconnected");
}

#[test]
fn a_client_that_reads_slowly_holds_the_box_back() {
    const SIZE: usize = 96 * MIB;
    let (server, _worker, b) = relay(&[]);
    let ask = json!({"bytes": SIZE}).to_string();
    let mut stream = TcpStream::connect(server.addr).expect("connect");
    stream.set_read_timeout(Some(WAIT * 6)).ok();
    let head = format!(
        "POST /download HTTP/1.1\r\nhost: localhost\r\nconnection: close\r\nx-model: whisper\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{ask}",
        ask.len()
    );
    stream.write_all(head.as_bytes()).expect("request");
    let mut reader = std::io::BufReader::with_capacity(64 * 1024, stream);
    let (status, _) = read_head(&mut reader);
    assert_eq!(status, 200);
    let mut got = vec![0u8; MIB];
    std::io::Read::read_exact(&mut reader, &mut got).expect("the first MiB");
    // The client stops reading: the box must stall long before the end, not the relay
    // take the whole answer in.
    match b
        .downloads
        .recv_timeout(WAIT * 3)
        .expect("the box's download")
    {
        backend::Download::Stalled(written) => {
            eprintln!("the box stalled {} MiB into the answer", written / MIB);
            assert!(written < 40 * MIB, "{} MiB went out", written / MIB);
        }
        done => panic!("the box sent it all while the client read 1 MiB: {done:?}"),
    }
    std::io::Read::read_to_end(&mut reader, &mut got).expect("the rest");
    assert_eq!(got.len(), SIZE);
    assert!(
        got == endpoints_box::noise(SIZE, 0),
        "the answer arrived intact"
    );
    assert_eq!(
        b.downloads.recv_timeout(WAIT),
        Ok(backend::Download::Done(SIZE))
    );
}
