//! Shared-store benchmark: `make bench-store` (needs `redis-server` and a build with
//! `--features redis-store`).
//!
//! Prints:
//! * the admission round trip (one rate-limit check, the GCRA script in Redis) p50/p99,
//!   next to the same check in this process's own limiter;
//! * sequential request latency p50/p99 through a relay with a tenant limit, with the
//!   store on (`STATE_URL`) and off, and the difference: what the store adds per request;
//! * an outage run: two relays on one Redis and one worker serving both, 4 clients
//!   spread over both for `BENCH_OUTAGE_SECS` × 3 (default 10: 30 s), Redis stopped for
//!   the middle third and started again (empty: no persistence). Requests failed (in
//!   total and during the outage), how long until `/admin/usage` on both relays shows
//!   exactly the requests served, and a 60/min limit over 100 requests alternating
//!   between the relays afterwards (exact: 60).

#[path = "support/fake_backend.rs"]
mod fake_backend;
#[path = "support/http.rs"]
mod http;
#[path = "support/process.rs"]
mod process;

use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use fake_backend::FakeBackend;
use http::{http, http_with};
use modelrelay::server::shared::Shared;
use modelrelay::server::store::Store;
use modelrelay::server::tenancy::limits::Rate;
use process::{free_addr, Process};
use serde_json::Value;

const SECRET: &str = "store-bench-secret";
const ADMIN: &str = "store-bench-admin";
const MODEL: &str = "bench";
const ANSWER: &str = "one two three four five";

fn main() {
    let Some(redis_bin) = which("redis-server") else {
        println!("skipped: redis-server is not installed");
        return;
    };
    let mut redis = RedisProc::start(&redis_bin);
    let state = std::env::temp_dir().join(format!("modelrelay-store-bench-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&state);

    println!("== admission round trip (one rate-limit check), 5000 checks");
    let shared = match Store::open(&state.join("probe"), Some(&redis.url()), None) {
        Ok(s) => s,
        Err(e) => {
            println!("skipped: {e}");
            return;
        }
    };
    let local = Store::local(&state.join("probe"));
    let rate = Rate::requests(1_000_000_000, Duration::from_secs(60));
    for (name, store) in [("redis (GCRA script)", &shared), ("local limiter", &local)] {
        let limits = store.limits("bench", 1000, &Shared::new());
        let mut times: Vec<Duration> = (0..5000)
            .map(|_| {
                let t = Instant::now();
                let d = limits.check_request("bench", rate, Instant::now());
                assert!(d.allowed);
                t.elapsed()
            })
            .collect();
        println!("  {name:<22} {}", percentiles(&mut times));
    }

    let backend = FakeBackend::new(MODEL, ANSWER)
        .spawn("127.0.0.1:0")
        .expect("backend");

    println!("== sequential latency, 2000 requests, tenant limited (admission on every request)");
    let mut p50s = Vec::new();
    for (name, url) in [("store on", Some(redis.url())), ("store off", None)] {
        let relay = Relay::start(&state.join(name.replace(' ', "-")), url.as_deref());
        let _worker = worker(&[relay.addr], backend);
        relay.wait_workers();
        let mut times: Vec<Duration> = (0..2000)
            .map(|_| {
                let t = Instant::now();
                assert_eq!(chat(relay.addr, "bench"), 200);
                t.elapsed()
            })
            .collect();
        times.sort();
        p50s.push((times[times.len() / 2], times[times.len() * 99 / 100]));
        println!("  {name:<10} {}", percentiles(&mut times));
    }
    let us = |d: Duration| d.as_secs_f64() * 1e6;
    println!(
        "  added by the store: p50 {:+.0} µs, p99 {:+.0} µs",
        us(p50s[0].0) - us(p50s[1].0),
        us(p50s[0].1) - us(p50s[1].1)
    );

    outage(&mut redis, &state, backend);
    let _ = std::fs::remove_dir_all(&state);
}

/// The outage run (see the module docs).
fn outage(redis: &mut RedisProc, state: &std::path::Path, backend: SocketAddr) {
    let third: u64 = std::env::var("BENCH_OUTAGE_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(10);
    println!("== outage: 2 relays, 1 worker serving both, 4 clients; Redis down from {third} s to {} s of {} s", 2 * third, 3 * third);
    let url = redis.url();
    let a = Relay::start(&state.join("outage-a"), Some(&url));
    let b = Relay::start(&state.join("outage-b"), Some(&url));
    let _worker = worker(&[a.addr, b.addr], backend);
    a.wait_workers();
    b.wait_workers();
    let stop = Arc::new(AtomicBool::new(false));
    let down = Arc::new(AtomicBool::new(false));
    let counts = Arc::new([(); 4].map(|()| AtomicU64::new(0)));
    let clients: Vec<_> = (0..4)
        .map(|i| {
            let (stop, down, counts) = (stop.clone(), down.clone(), counts.clone());
            let addrs = [a.addr, b.addr];
            std::thread::spawn(move || {
                let mut n = i;
                while !stop.load(Ordering::Relaxed) {
                    let during = down.load(Ordering::Relaxed);
                    let ok = chat(addrs[n % 2], "bench") == 200;
                    n += 1;
                    // [served, failed, served during the outage, failed during it]
                    let slot = usize::from(!ok) + 2 * usize::from(during);
                    counts[slot].fetch_add(1, Ordering::Relaxed);
                }
            })
        })
        .collect();
    std::thread::sleep(Duration::from_secs(third));
    down.store(true, Ordering::Relaxed);
    redis.stop();
    std::thread::sleep(Duration::from_secs(third));
    redis.restart();
    down.store(false, Ordering::Relaxed);
    std::thread::sleep(Duration::from_secs(third));
    stop.store(true, Ordering::Relaxed);
    for c in clients {
        let _ = c.join();
    }
    let get = |i: usize| counts[i].load(Ordering::Relaxed);
    let (served, failed) = (get(0) + get(2), get(1) + get(3));
    println!("  requests served: {served} ({} during the outage)", get(2));
    println!("  requests failed: {failed} ({} during the outage)", get(3));
    let t = Instant::now();
    let exact = wait_for(Duration::from_secs(30), || {
        [&a, &b].iter().all(|r| r.usage_requests() == Some(served))
    });
    let shown: Vec<String> = [&a, &b]
        .iter()
        .map(|r| format!("{:?}", r.usage_requests()))
        .collect();
    println!(
        "  /admin/usage on both relays {} {served} requests after the run ({} ms after the last request; shown: {})",
        if exact { "exactly" } else { "NOT" },
        t.elapsed().as_millis(),
        shown.join(", ")
    );
    let admitted = (0..100)
        .filter(|i| chat([a.addr, b.addr][i % 2], "exact") == 200)
        .count();
    println!("  limit 60/min after the outage, 100 requests alternating: {admitted} admitted");
}

/// One chat request as `tenant`; its status (0 when the connection failed).
fn chat(addr: SocketAddr, tenant: &str) -> u16 {
    let body = format!(r#"{{"model":"{MODEL}","messages":[{{"role":"user","content":"hi"}}]}}"#);
    let tenant = [("x-tenant-id", tenant)];
    http_with(
        addr,
        "POST",
        "/v1/chat/completions",
        Some(&body),
        None,
        &tenant,
    )
    .map(|(s, _)| s)
    .unwrap_or(0)
}

fn percentiles(times: &mut [Duration]) -> String {
    times.sort();
    let at = |p: usize| times[(times.len() * p / 100).min(times.len() - 1)].as_secs_f64() * 1e6;
    format!("p50 {:>8.1} µs   p99 {:>8.1} µs", at(50), at(99))
}

fn wait_for(limit: Duration, cond: impl Fn() -> bool) -> bool {
    let deadline = Instant::now() + limit;
    while !cond() {
        if Instant::now() > deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    true
}

fn which(name: &str) -> Option<std::path::PathBuf> {
    std::env::var_os("PATH")?
        .to_str()?
        .split(':')
        .map(|d| std::path::Path::new(d).join(name))
        .find(|p| p.is_file())
}

/// `redis-server` on a loopback port, no persistence; stopped and started on the same port.
struct RedisProc {
    bin: std::path::PathBuf,
    port: u16,
    process: Option<Process>,
}

impl RedisProc {
    fn start(bin: &std::path::Path) -> RedisProc {
        let mut r = RedisProc {
            bin: bin.to_path_buf(),
            port: free_addr().port(),
            process: None,
        };
        r.restart();
        r
    }

    fn restart(&mut self) {
        let args: Vec<String> = ["--port", &self.port.to_string(), "--bind", "127.0.0.1"]
            .into_iter()
            .chain(["--save", "", "--appendonly", "no"])
            .map(String::from)
            .collect();
        self.process = Some(Process::spawn_program(&self.bin, &args));
        let addr = SocketAddr::from(([127, 0, 0, 1], self.port));
        assert!(wait_for(Duration::from_secs(10), || TcpStream::connect(
            addr
        )
        .is_ok()));
    }

    fn stop(&mut self) {
        self.process = None;
    }

    fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/0", self.port)
    }
}

struct Relay {
    _process: Process,
    addr: SocketAddr,
}

impl Relay {
    /// A relay with usage recorded and tenants `bench` (no practical limit) and `exact`
    /// (60/min) limited; on the store at `url` when given.
    fn start(state: &std::path::Path, url: Option<&str>) -> Relay {
        let addr = free_addr();
        let mut env = vec![
            ("WORKER_SECRET", SECRET.to_string()),
            ("LISTEN_ADDR", addr.to_string()),
            ("MODELRELAY_ADMIN_TOKEN", ADMIN.to_string()),
            ("STATE_DIR", state.to_string_lossy().into_owned()),
            ("TENANT_RATE_LIMIT_bench", "1000000000req/min".to_string()),
            ("TENANT_RATE_LIMIT_exact", "60req/min".to_string()),
            ("LOG_LEVEL", "warn".to_string()),
        ];
        if let Some(url) = url {
            env.push(("STATE_URL", url.to_string()));
        }
        let process = Process::spawn("modelrelay-server", &env);
        assert!(wait_for(Duration::from_secs(20), || TcpStream::connect(
            addr
        )
        .is_ok()));
        Relay {
            _process: process,
            addr,
        }
    }

    fn wait_workers(&self) {
        assert!(wait_for(Duration::from_secs(20), || {
            http(self.addr, "GET", "/health", None, None)
                .ok()
                .and_then(|(_, b)| serde_json::from_str::<Value>(&b).ok())
                .is_some_and(|h| h["workers_connected"].as_u64() >= Some(1))
        }));
    }

    /// Requests in `/admin/usage` (the fleet's, with a store).
    fn usage_requests(&self) -> Option<u64> {
        let (_, body) = http(self.addr, "GET", "/admin/usage", None, Some(ADMIN)).ok()?;
        serde_json::from_str::<Value>(&body).ok()?["totals"]["requests"].as_u64()
    }
}

fn worker(relays: &[SocketAddr], backend: SocketAddr) -> Process {
    let urls: Vec<String> = relays.iter().map(|a| format!("http://{a}")).collect();
    Process::spawn(
        "modelrelay-worker",
        &[
            ("WORKER_SECRET", SECRET.to_string()),
            ("PROXY_URL", urls.join(",")),
            ("BACKEND_URL", format!("http://{backend}")),
            ("MODELS", MODEL.to_string()),
            ("MAX_CONCURRENCY", "8".to_string()),
            ("LOG_LEVEL", "warn".to_string()),
        ],
    )
}
