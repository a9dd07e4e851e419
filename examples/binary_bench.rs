//! Binary bodies through the relay: `make bench-binary` (or build the release binaries
//! and `cargo run --release --example binary_bench`).
//!
//! The release `modelrelay-server` and `modelrelay-worker` on loopback in front of a fake
//! box (`tests/endpoints/backend.rs`), each scenario with fresh processes so that their
//! peak resident memory (`VmHWM`) is that scenario's:
//!
//! * a 100 MiB upload (an operator route, `EXTRA_ROUTES=/upload`): throughput and peak
//!   RSS of server and worker, against the same upload sent to the box directly; in
//!   pieces (the default) and held whole (`BODY_PIECES_OVER_BYTES=0`, as before pieces);
//! * a 100 MiB streamed answer (`/download`, the box sends it with its length);
//! * a small binary request (1 KiB up, a short JSON answer), 300 in a row: the latency
//!   the relay adds, median and p99, against the box directly;
//! * base64 itself: encode and decode rates on one core.

#[path = "../tests/endpoints/backend.rs"]
mod backend;
#[path = "support/process.rs"]
mod process;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use modelrelay::protocol::binary;
use process::Process;

const SECRET: &str = "binary-bench-secret";
const MIB100: usize = 100 << 20;

fn main() {
    let b = backend::start();
    // The box keeps a copy of each body up to 1 MiB for tests; drain what it reports.
    let seen = b.seen.clone();
    std::thread::spawn(move || while seen.recv().is_ok() {});
    let mut rows = Vec::new();

    let upload = backend::noise(MIB100, 5);
    let direct = timed(|| call(b.addr, "/upload", "whisper", &upload));
    let relay = Relay::start(b.addr, &[]);
    let through = timed(|| call(relay.addr, "/upload", "whisper", &upload));
    rows.push(row("100 MiB upload (in pieces)", direct, through, &relay));
    drop(relay);
    let relay = Relay::start(b.addr, &[("BODY_PIECES_OVER_BYTES", "0")]);
    let through = timed(|| call(relay.addr, "/upload", "whisper", &upload));
    rows.push(row("100 MiB upload (held whole)", direct, through, &relay));
    drop(relay);

    let ask = br#"{"model":"tts","bytes":104857600}"#;
    let direct = timed(|| call(b.addr, "/download", "tts", ask));
    let relay = Relay::start(b.addr, &[]);
    let through = timed(|| call(relay.addr, "/download", "tts", ask));
    rows.push(row("100 MiB streamed answer", direct, through, &relay));

    let small = backend::noise(1024, 9);
    let direct = latencies(b.addr, &small);
    let through = latencies(relay.addr, &small);
    drop(relay);

    let raw = backend::noise(MIB100, 1);
    let t = Instant::now();
    let text = binary::encode(&raw);
    let encode = t.elapsed();
    let t = Instant::now();
    let back = binary::decode(&text).expect("decode");
    let decode = t.elapsed();
    assert_eq!(back, raw);

    println!(
        "Binary bodies through the relay (release binaries, loopback, {MIB100} bytes = 100 MiB)"
    );
    println!();
    println!(
        "| transfer | direct to the box | through the relay | server peak RSS | worker peak RSS |"
    );
    println!("|---|---|---|---|---|");
    for r in rows {
        println!("{r}");
    }
    println!();
    println!(
        "Small binary request (1 KiB up, JSON answer), 300 sequential: direct median {:.2} ms, p99 {:.2} ms; \
         through the relay median {:.2} ms, p99 {:.2} ms; added median {:.2} ms",
        ms(direct.0),
        ms(direct.1),
        ms(through.0),
        ms(through.1),
        ms(through.0.saturating_sub(direct.0))
    );
    println!(
        "base64 on one core: encode {:.0} MB/s, decode {:.0} MB/s (of raw bytes)",
        mbps(MIB100, encode),
        mbps(MIB100, decode)
    );
}

/// A release server and worker in front of the box, with limits for 100 MiB bodies.
struct Relay {
    addr: SocketAddr,
    server: Process,
    worker: Process,
}

impl Relay {
    fn start(backend: SocketAddr, extra: &[(&str, &str)]) -> Relay {
        let addr = process::free_addr();
        let mut env = vec![
            ("WORKER_SECRET", SECRET.to_string()),
            ("LISTEN_ADDR", addr.to_string()),
            ("MAX_REQUEST_BODY_BYTES", "110000000".into()),
            ("MAX_WS_MESSAGE_BYTES", "160000000".into()),
            ("EXTRA_ROUTES", "/upload,/download".into()),
        ];
        env.extend(extra.iter().map(|(k, v)| (*k, v.to_string())));
        let server = Process::spawn("modelrelay-server", &env);
        assert!(
            wait(|| TcpStream::connect(addr).is_ok()),
            "the server did not start"
        );
        let worker = Process::spawn(
            "modelrelay-worker",
            &[
                ("WORKER_SECRET", SECRET.into()),
                ("PROXY_URL", format!("http://{addr}")),
                ("BACKEND_URL", format!("http://{backend}")),
                ("MAX_WS_MESSAGE_BYTES", "160000000".into()),
            ],
        );
        let up = wait(|| health(addr).contains("\"workers_connected\":1"));
        if !up {
            let lines = worker.lines.lock().join("\n");
            panic!("the worker did not register:\n{lines}");
        }
        Relay {
            addr,
            server,
            worker,
        }
    }
}

/// Polls `ready` for up to 30 s; whether it became true.
fn wait(mut ready: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !ready() {
        if Instant::now() > deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    true
}

fn health(addr: SocketAddr) -> String {
    let Ok(mut s) = TcpStream::connect(addr) else {
        return String::new();
    };
    let _ = s.write_all(b"GET /health HTTP/1.1\r\nhost: localhost\r\nconnection: close\r\n\r\n");
    let mut out = String::new();
    let _ = s.read_to_string(&mut out);
    out
}

/// One POST; returns the status and how many body bytes came back (read and dropped).
fn call(addr: SocketAddr, path: &str, model: &str, body: &[u8]) -> (u16, usize) {
    let mut s = TcpStream::connect(addr).expect("connect");
    let head = format!(
        "POST {path} HTTP/1.1\r\nhost: localhost\r\nconnection: close\r\nx-model: {model}\r\ncontent-type: application/octet-stream\r\ncontent-length: {}\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes()).expect("head");
    s.write_all(body).expect("body");
    let mut r = BufReader::with_capacity(256 << 10, s);
    let mut line = String::new();
    r.read_line(&mut line).expect("status");
    let status = line
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    loop {
        line.clear();
        r.read_line(&mut line).expect("header");
        if line.trim().is_empty() {
            break;
        }
    }
    // Whatever the framing, the connection closes after the answer.
    let mut n = 0;
    let mut buf = vec![0u8; 256 << 10];
    while let Ok(k) = r.read(&mut buf) {
        if k == 0 {
            break;
        }
        n += k;
    }
    (status, n)
}

fn timed(f: impl FnOnce() -> (u16, usize)) -> (Duration, (u16, usize)) {
    let t = Instant::now();
    let out = f();
    (t.elapsed(), out)
}

fn row(
    what: &str,
    direct: (Duration, (u16, usize)),
    through: (Duration, (u16, usize)),
    relay: &Relay,
) -> String {
    assert_eq!(through.1 .0, 200, "{what}: status");
    format!(
        "| {what} | {:.2} s, {:.0} MB/s | {:.2} s, {:.0} MB/s | {} MiB | {} MiB |",
        direct.0.as_secs_f64(),
        mbps(MIB100, direct.0),
        through.0.as_secs_f64(),
        mbps(MIB100, through.0),
        peak_rss_mib(relay.server.pid()),
        peak_rss_mib(relay.worker.pid()),
    )
}

/// Median and p99 of 300 small uploads, one after another.
fn latencies(addr: SocketAddr, body: &[u8]) -> (Duration, Duration) {
    let mut all: Vec<Duration> = (0..300)
        .map(|_| {
            let (d, (status, _)) = timed(|| call(addr, "/upload", "whisper", body));
            assert_eq!(status, 200);
            d
        })
        .collect();
    all.sort_unstable();
    (all[all.len() / 2], all[all.len() * 99 / 100])
}

fn peak_rss_mib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            let line = s.lines().find(|l| l.starts_with("VmHWM:"))?.to_string();
            line.split_whitespace().nth(1)?.parse::<u64>().ok()
        })
        .map_or(0, |kib| kib / 1024)
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

fn mbps(bytes: usize, d: Duration) -> f64 {
    bytes as f64 / 1e6 / d.as_secs_f64().max(1e-9)
}
