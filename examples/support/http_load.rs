//! Keep-alive HTTP/1.1 load for the benches: one client's request/response loop,
//! sequential latency, streams, and throughput with what the watched processes spent.
#![allow(dead_code)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::procstat::{Snapshot, Spent};

pub const OPENAI_PATH: &str = "/v1/chat/completions";

pub struct Samples(pub Vec<Duration>);

impl Samples {
    pub fn p(&self, pct: usize) -> Duration {
        let mut v = self.0.clone();
        v.sort();
        v.get((v.len() * pct / 100).min(v.len().saturating_sub(1)))
            .copied()
            .unwrap_or_default()
    }
    pub fn max(&self) -> Duration {
        self.0.iter().max().copied().unwrap_or_default()
    }
}

/// A keep-alive HTTP/1.1 client connection.
pub struct Client {
    out: TcpStream,
    reader: BufReader<TcpStream>,
}

impl Client {
    pub fn connect(addr: SocketAddr) -> Client {
        let out = TcpStream::connect(addr).expect("connect");
        out.set_nodelay(true).ok();
        let reader = BufReader::new(out.try_clone().expect("clone"));
        Client { out, reader }
    }

    pub fn send(&mut self, body: &str) {
        self.send_to(OPENAI_PATH, body);
    }

    pub fn send_to(&mut self, path: &str, body: &str) {
        let req = format!("POST {path} HTTP/1.1\r\nhost: localhost\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}", body.len());
        self.out.write_all(req.as_bytes()).expect("send");
    }

    /// Reads one response; calls `on_chunk` with the arrival time and bytes of each body
    /// piece.
    pub fn read(&mut self, mut on_chunk: impl FnMut(Instant, &[u8])) -> u16 {
        let mut line = String::new();
        self.reader.read_line(&mut line).expect("status");
        let status = line
            .split_whitespace()
            .nth(1)
            .and_then(|s| s.parse().ok())
            .unwrap_or(0);
        let (mut length, mut chunked) = (0usize, false);
        loop {
            line.clear();
            self.reader.read_line(&mut line).expect("header");
            let l = line.trim_end().to_ascii_lowercase();
            if l.is_empty() {
                break;
            }
            if let Some(v) = l.strip_prefix("content-length:") {
                length = v.trim().parse().unwrap_or(0);
            }
            if l.starts_with("transfer-encoding:") && l.contains("chunked") {
                chunked = true;
            }
        }
        if !chunked {
            let mut body = vec![0; length];
            self.reader.read_exact(&mut body).expect("body");
            on_chunk(Instant::now(), &body);
            return status;
        }
        loop {
            line.clear();
            self.reader.read_line(&mut line).expect("chunk size");
            let size = usize::from_str_radix(line.trim(), 16).unwrap_or(0);
            let mut data = vec![0; size + 2];
            self.reader.read_exact(&mut data).expect("chunk");
            if size == 0 {
                return status;
            }
            on_chunk(Instant::now(), &data[..size]);
        }
    }
}

pub fn sequential(addr: SocketAddr, body: &str, n: usize) -> Samples {
    let mut c = Client::connect(addr);
    for _ in 0..100 {
        c.send(body);
        c.read(|_, _| {});
    }
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        let t = Instant::now();
        c.send(body);
        assert_eq!(c.read(|_, _| {}), 200);
        out.push(t.elapsed());
    }
    Samples(out)
}

/// Per-stream figures of [`streams`].
pub struct Streams {
    /// Request sent to first body chunk.
    pub ttfc: Samples,
    /// Largest gap between two body chunks.
    pub gap: Samples,
    /// Request sent to the chunk that completes `marker` (the stream's last event), or
    /// to the end of the body for a stream without one.
    pub total: Samples,
}

/// `n` sequential streams of `body` to `path` on one keep-alive connection, after 20
/// unmeasured ones.
pub fn streams(addr: SocketAddr, path: &str, body: &str, marker: &[u8], n: usize) -> Streams {
    let mut c = Client::connect(addr);
    let (mut ttfc, mut gaps, mut totals) = (Vec::new(), Vec::new(), Vec::new());
    for i in 0..n + 20 {
        let t = Instant::now();
        c.send_to(path, body);
        let mut arrivals = Vec::new();
        let (mut seen, mut last) = (Vec::new(), None);
        let status = c.read(|at, data| {
            arrivals.push(at);
            if last.is_none() {
                // Only the new bytes (and a marker split across chunks) need looking at.
                let from = seen.len().saturating_sub(marker.len());
                seen.extend_from_slice(data);
                if seen[from..].windows(marker.len()).any(|w| w == marker) {
                    last = Some(at);
                }
            }
        });
        let end = Instant::now();
        assert_eq!(status, 200, "{path}");
        if i < 20 {
            continue;
        }
        ttfc.push(arrivals[0] - t);
        gaps.push(
            arrivals
                .windows(2)
                .map(|w| w[1] - w[0])
                .max()
                .unwrap_or_default(),
        );
        totals.push(last.unwrap_or(end) - t);
    }
    Streams {
        ttfc: Samples(ttfc),
        gap: Samples(gaps),
        total: Samples(totals),
    }
}

/// What a throughput window measured.
pub struct Load {
    /// Requests/s answered with 200.
    pub rps: f64,
    /// Requests answered with 200 inside the window.
    pub count: u64,
    /// The latency of every request that began inside the window.
    pub latency: Samples,
    /// What each watched process spent inside the window, in `watch` order.
    pub spent: Vec<Spent>,
}

impl Load {
    /// CPU time per request of the `i`th watched process, in microseconds.
    pub fn cpu_us(&self, i: usize) -> f64 {
        let cpu = self.spent.get(i).map(Spent::cpu).unwrap_or_default();
        cpu.as_secs_f64() * 1e6 / self.count.max(1) as f64
    }

    /// Context switches per request of the `i`th watched process.
    pub fn switches(&self, i: usize) -> f64 {
        let n = self.spent.get(i).map_or(0, |s| s.switches);
        n as f64 / self.count.max(1) as f64
    }
}

/// With `BENCH_RATE=N`, each of `clients` sends at most one request per this interval,
/// so that together they offer N requests/s: CPU per request then compares two relays
/// at the same load instead of each at its own saturation.
fn paced(clients: usize) -> Option<Duration> {
    let rate: f64 = std::env::var("BENCH_RATE").ok()?.parse().ok()?;
    (rate > 0.0).then(|| Duration::from_secs_f64(clients as f64 / rate))
}

/// Requests/s of `clients` keep-alive clients sending `body` over `window`, the latency
/// of every request that began inside it, and what the `watch` processes spent meanwhile.
pub fn throughput(
    addr: SocketAddr,
    clients: usize,
    window: Duration,
    body: &str,
    watch: &[u32],
) -> Load {
    let done = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let measuring = Arc::new(AtomicBool::new(false));
    let pace = paced(clients);
    let handles: Vec<_> = (0..clients)
        .map(|i| {
            let (done, stop, measuring) = (done.clone(), stop.clone(), measuring.clone());
            let body = body.to_string();
            std::thread::spawn(move || {
                let mut c = Client::connect(addr);
                let mut latencies = Vec::new();
                // Paced clients start spread over one interval, not all at once.
                let mut next = pace.map(|every| Instant::now() + every * i as u32 / clients as u32);
                while !stop.load(Ordering::Relaxed) {
                    if let (Some(at), Some(every)) = (next.as_mut(), pace) {
                        std::thread::sleep(at.saturating_duration_since(Instant::now()));
                        *at += every;
                    }
                    let (sent, counted) = (Instant::now(), measuring.load(Ordering::Relaxed));
                    c.send(&body);
                    if c.read(|_, _| {}) == 200 {
                        done.fetch_add(1, Ordering::Relaxed);
                        if counted {
                            latencies.push(sent.elapsed());
                        }
                    }
                }
                latencies
            })
        })
        .collect();
    std::thread::sleep(Duration::from_millis(300));
    measuring.store(true, Ordering::Relaxed);
    let snapshots: Vec<Snapshot> = watch.iter().map(|&pid| Snapshot::take(pid)).collect();
    let (start_count, start) = (done.load(Ordering::Relaxed), Instant::now());
    std::thread::sleep(window);
    let count = done.load(Ordering::Relaxed) - start_count;
    let elapsed = start.elapsed();
    let spent = snapshots.iter().map(Snapshot::since).collect();
    stop.store(true, Ordering::Relaxed);
    let mut latencies = Vec::new();
    for h in handles {
        latencies.extend(h.join().unwrap_or_default());
    }
    Load {
        rps: count as f64 / elapsed.as_secs_f64(),
        count,
        latency: Samples(latencies),
        spent,
    }
}
