//! The chaos harness (issue 14): a real `modelrelay-server`, several real
//! `modelrelay-worker`s dialing it through a fault-injecting proxy, one fake backend each,
//! and many clients, all on loopback. Clients send a seeded mix of plain, streaming,
//! `/v1/messages` and Ollama requests whose answers carry a checksum; the backends fail
//! on request (statuses, deaths mid-stream, hangs, resets); clients hang up and read
//! slowly; meanwhile workers are killed, paused past the heartbeat timeout, and their
//! connections cut or black-holed. Then the server is restarted twice (SIGTERM, then
//! kill -9) with requests running and queued. At the end the invariants are checked and
//! printed as a table ([`report`]).
//!
//! Used by `examples/chaos.rs` (`make chaos`: 10,000 requests) and `tests/chaos.rs` (the
//! short slice in `make test`). Everything waits for states (`/health`,
//! `/admin/workers`, the backends' counters); the sleeps are fault durations.
#![allow(dead_code)]

pub mod client;
pub mod faults;
pub mod judge;
pub mod procs;
pub mod proxy;
pub mod report;
pub mod restart;
pub mod rng;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use client::{Kind, Mix, Outcome, Plan};
use faults::{Backend, FaultCtx, Fleet};
use procs::{Proc, Sample};
use report::{Check, Report};

/// One chaos run.
#[derive(Debug, Clone)]
pub struct Config {
    pub server_bin: PathBuf,
    pub worker_bin: PathBuf,
    pub seed: u64,
    /// Requests in the main phase.
    pub requests: usize,
    /// Concurrent clients.
    pub clients: usize,
    pub workers: usize,
    /// `MAX_CONCURRENCY` of each worker.
    pub slots: u32,
    /// Worker and network faults in the main phase (cycling through every kind).
    pub faults: usize,
    /// How long a client waits for its whole answer before it counts as overdue.
    pub client_timeout: Duration,
    /// Where logs go.
    pub dir: PathBuf,
}

/// Relay settings of every run: short timeouts so faults resolve quickly.
pub const HEARTBEAT_INTERVAL_SECS: u64 = 1;
pub const HEARTBEAT_TIMEOUT_SECS: u64 = 3;
pub const REQUEST_TIMEOUT_SECS: u64 = 3;
pub const QUEUE_TIMEOUT_SECS: u64 = 10;
pub const DRAIN_TIMEOUT_SECS: u64 = 2;

/// Everything a run holds.
pub struct Harness {
    pub cfg: Config,
    pub addr: SocketAddr,
    pub server: Mutex<Option<Proc>>,
    servers_started: AtomicUsize,
    pub proxy: proxy::Proxy,
    pub backends: Vec<Backend>,
    pub fleet: Arc<Fleet>,
    /// Unique answer ids across phases.
    next_id: AtomicUsize,
}

impl Harness {
    pub fn start(cfg: Config) -> Harness {
        let _ = std::fs::remove_dir_all(&cfg.dir);
        std::fs::create_dir_all(&cfg.dir).expect("chaos log directory");
        let addr = free_addr();
        let proxy = proxy::Proxy::start(addr).expect("proxy");
        let backends: Vec<Backend> = (0..cfg.workers).map(|_| Backend::start()).collect();
        let fleet = Fleet::start(&cfg.worker_bin, &cfg.dir, proxy.addr, &backends, cfg.slots);
        let h = Harness {
            cfg,
            addr,
            server: Mutex::new(None),
            servers_started: AtomicUsize::new(0),
            proxy,
            backends,
            fleet,
            next_id: AtomicUsize::new(1),
        };
        h.start_server();
        h
    }

    /// Starts a server on the run's address (again after a restart).
    pub fn start_server(&self) {
        let n = self.servers_started.fetch_add(1, Ordering::SeqCst);
        let env: Vec<(&str, String)> = vec![
            ("WORKER_SECRET", procs::SECRET.into()),
            ("LISTEN_ADDR", self.addr.to_string()),
            ("MODELRELAY_ADMIN_TOKEN", procs::ADMIN_TOKEN.into()),
            (
                "STATE_DIR",
                self.cfg.dir.join("state").display().to_string(),
            ),
            ("LOG_LEVEL", "info".into()),
            (
                "HEARTBEAT_INTERVAL_SECS",
                HEARTBEAT_INTERVAL_SECS.to_string(),
            ),
            ("HEARTBEAT_TIMEOUT_SECS", HEARTBEAT_TIMEOUT_SECS.to_string()),
            ("REQUEST_TIMEOUT_SECS", REQUEST_TIMEOUT_SECS.to_string()),
            ("QUEUE_TIMEOUT_SECS", QUEUE_TIMEOUT_SECS.to_string()),
            ("DRAIN_TIMEOUT_SECS", DRAIN_TIMEOUT_SECS.to_string()),
            ("MAX_QUEUE_LEN", "5000".into()),
            ("MAX_QUEUE_PER_TENANT", "5000".into()),
            ("MAX_CONNECTIONS", "20000".into()),
        ];
        let log = self.cfg.dir.join(format!("server-{n}.log"));
        let proc = Proc::spawn(&self.cfg.server_bin, &env, log);
        *self.server.lock() = Some(proc);
        let up = procs::wait_for(Duration::from_secs(30), || {
            procs::get_json(self.addr, "/health")
        });
        assert!(up.is_some(), "server did not come up on {}", self.addr);
    }

    pub fn server_pid(&self) -> u32 {
        self.server.lock().as_ref().map(Proc::pid).unwrap_or(0)
    }

    pub fn server_log(&self) -> String {
        self.server
            .lock()
            .as_ref()
            .map(Proc::log_text)
            .unwrap_or_default()
    }

    /// A fresh answer id.
    pub fn id(&self) -> u64 {
        self.next_id.fetch_add(1, Ordering::Relaxed) as u64
    }

    /// Waits until `/health` shows every worker connected.
    pub fn wait_workers(&self, limit: Duration) -> Option<Duration> {
        let began = Instant::now();
        let n = self.fleet.len() as u64;
        procs::wait_for(limit, || {
            let h = procs::get_json(self.addr, "/health")?;
            (h["workers_connected"] == n).then_some(())
        })
        .map(|()| began.elapsed())
    }

    /// Runs `plans` on `clients` threads; `done` counts finished requests.
    pub fn drive(
        &self,
        plans: &[Plan],
        clients: usize,
        done: &AtomicUsize,
    ) -> Vec<(Plan, Outcome)> {
        let next = AtomicUsize::new(0);
        let results = Mutex::new(Vec::with_capacity(plans.len()));
        std::thread::scope(|s| {
            for _ in 0..clients {
                s.spawn(|| loop {
                    let i = next.fetch_add(1, Ordering::SeqCst);
                    let Some(plan) = plans.get(i) else {
                        return;
                    };
                    let outcome = client::execute(self.addr, plan, self.cfg.client_timeout);
                    // Told to come back later (no healthy worker, queue full): back off
                    // as SDKs do, instead of burning through the plan in a second.
                    let back_off = matches!(outcome.kind, Kind::Error(429 | 503, _));
                    results.lock().push((plan.clone(), outcome));
                    done.fetch_add(1, Ordering::SeqCst);
                    if back_off {
                        std::thread::sleep(Duration::from_millis(200));
                    }
                });
            }
        });
        results.into_inner()
    }

    /// `n` requests of `mix`, with ids of their own.
    pub fn plans(&self, salt: u64, n: usize, mix: Mix) -> Vec<Plan> {
        (0..n)
            .map(|i| client::plan(self.cfg.seed ^ salt, i as u64, self.id(), mix))
            .collect()
    }

    /// Waits until nothing is running anywhere, then reports what it saw: server idle,
    /// every slot free, backends idle, black holes noticed, every worker back.
    pub fn quiesce(&self, limit: Duration) -> Vec<Check> {
        let state = || {
            let health = procs::get_json(self.addr, "/health");
            let workers = procs::workers(self.addr);
            let backends: usize = self.backends.iter().map(Backend::active).sum();
            (health, workers, backends, self.proxy.holes_open())
        };
        let n = self.fleet.len();
        let settled = |(h, w, b, holes): &(
            Option<serde_json::Value>,
            Option<Vec<serde_json::Value>>,
            usize,
            usize,
        )| {
            let idle = h.as_ref().is_some_and(|h| {
                h["in_flight"] == 0 && h["queue_depth"] == 0 && h["workers_connected"] == n as u64
            });
            let slots = w
                .as_ref()
                .is_some_and(|w| w.len() == n && w.iter().all(|w| w["in_flight"] == 0));
            idle && slots && *b == 0 && *holes == 0
        };
        let began = Instant::now();
        let mut last = state();
        while !settled(&last) && began.elapsed() < limit {
            std::thread::sleep(Duration::from_millis(50));
            last = state();
        }
        let waited = format!("after {:.1}s", began.elapsed().as_secs_f64());
        let (h, w, b, holes) = last;
        let h = h.unwrap_or_default();
        let w = w.unwrap_or_default();
        let busy: Vec<String> = w
            .iter()
            .filter(|w| w["in_flight"] != 0)
            .map(|w| format!("{}={}", w["name"], w["in_flight"]))
            .collect();
        vec![
            Check::new(
                "server idle: /health in_flight 0, queue 0",
                h["in_flight"] == 0 && h["queue_depth"] == 0,
                format!(
                    "in_flight {}, queue_depth {} {waited}",
                    h["in_flight"], h["queue_depth"]
                ),
            ),
            Check::new(
                "every worker back and every slot free (/admin/workers)",
                w.len() == n && busy.is_empty(),
                format!("{} of {n} workers listed, busy: {busy:?}", w.len()),
            ),
            Check::new(
                "backends report no open request",
                b == 0,
                format!("{b} open"),
            ),
            Check::new(
                "black-holed workers noticed the silence and reconnected",
                holes == 0,
                format!("{holes} black-holed connection(s) still open on the worker side"),
            ),
        ]
    }
}

impl Drop for Harness {
    fn drop(&mut self) {
        self.fleet.shutdown();
        self.server.lock().take();
    }
}

/// A loopback address with a port nobody listens on right now.
pub fn free_addr() -> SocketAddr {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("free port")
}

/// Resource figures of a process once they settle back to `base`, or the last ones seen.
fn settle(pid: u32, base: Sample, limit: Duration) -> Sample {
    let near = |s: &Sample| s.threads <= base.threads + 2 && s.fds <= base.fds + 4;
    let began = Instant::now();
    loop {
        let s = procs::sample(pid);
        if near(&s) || began.elapsed() > limit {
            return s;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The whole run: start, warm up, baseline, chaos, checks, restarts, checks.
pub fn run(cfg: Config) -> Report {
    let started = Instant::now();
    let h = Harness::start(cfg.clone());
    let mut report = Report::new(&cfg);
    let connected = h.wait_workers(Duration::from_secs(60));
    assert!(
        connected.is_some(),
        "workers never connected; logs:\n{}{}",
        h.server_log(),
        h.fleet.log_tails(20)
    );

    // Warm up (every route once or more), then take the baseline.
    let warm = h.plans(0x3a3a, 12, Mix::Clean);
    let warmed = h.drive(&warm, 4, &AtomicUsize::new(0));
    for (plan, o) in &warmed {
        assert_eq!(
            o.kind,
            Kind::Complete,
            "warm-up request failed: {plan:?} {o:?}; server log:\n{}",
            h.server_log()
        );
    }
    let _ = h.quiesce(Duration::from_secs(30));
    let pid = h.server_pid();
    let base = procs::sample(pid);

    // The chaos phase.
    let plans = h.plans(0, cfg.requests, Mix::Chaos);
    let done = AtomicUsize::new(0);
    let fault_ctx = FaultCtx {
        server: h.addr,
        fleet: &h.fleet,
        proxy: &h.proxy,
        backends: &h.backends,
        heartbeat_timeout: Duration::from_secs(HEARTBEAT_TIMEOUT_SECS),
    };
    let chaos_began = Instant::now();
    let (outcomes, fault_log) = std::thread::scope(|s| {
        let faults = s.spawn(|| faults::run(&fault_ctx, cfg.seed, cfg.faults, cfg.requests, &done));
        let outcomes = h.drive(&plans, cfg.clients, &done);
        (outcomes, faults.join().unwrap_or_default())
    });
    report.chaos_secs = chaos_began.elapsed().as_secs_f64();
    h.fleet.resume_all();
    report.add_phase("chaos", &outcomes, false);
    report.faults = fault_log;
    report.proxy_cut = h.proxy.stats.cut.load(Ordering::Relaxed);
    report.proxy_holed = h.proxy.stats.holed.load(Ordering::Relaxed);
    report.checks.extend(h.quiesce(Duration::from_secs(60)));
    let end = settle(pid, base, Duration::from_secs(30));
    report.resources(base, end);
    report.workers_end = h.fleet.pids().into_iter().map(procs::sample).collect();
    report.server_log(&h.server_log(), &outcomes);
    report.note_exits(&h.fleet.exits.lock(), "chaos");

    // Restarts: SIGTERM (queued and running get defined errors), then kill -9.
    restart::run(&h, &mut report, restart::How::Term);
    restart::run(&h, &mut report, restart::How::Kill);
    report.checks.extend(h.quiesce(Duration::from_secs(60)));
    report.backend_requests = h.backends.iter().map(Backend::requests).sum();
    report.worker_starts = h.fleet.spawned.load(Ordering::Relaxed);
    report.total_secs = started.elapsed().as_secs_f64();
    if !report.passed() {
        report.logs = format!(
            "server log tail:\n{}\n{}",
            tail(&h.server_log(), 40),
            h.fleet.log_tails(20)
        );
    }
    report
}

fn tail(text: &str, n: usize) -> String {
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}
