//! Many relays, one pool: `make bench-ha` (or build the release binaries and
//! `cargo run --release --example ha_bench`).
//!
//! Release `modelrelay-server`s and `modelrelay-worker`s on loopback: two workers with
//! 4 slots each (`MAX_CONCURRENCY=4`), each with its own std-only fake backend, and their
//! `PROXY_URL` listing every relay. Each figure gets a fresh pool. Printed:
//!
//! * **Kill under load**: 3 relays behind HAProxy (skipped when it is not installed), 12
//!   clients one request after another (~50 ms answers, half streamed); one relay is
//!   killed with SIGKILL. Requests lost, against those in flight on the dead relay.
//! * **Restart**: the killed relay started again on its port, after being down a moment
//!   and after 15 s; seconds until both workers are registered with it again.
//! * **Slot utilization** under saturating load (32 clients, 100 ms answers) with 1 and
//!   with 3 relays (clients spread over the relays): backend busy time over slots × time.
//!   And `busy` refusals per 1,000 requests with 3 relays.
//! * **Affinity**: 24 conversations of 4 turns (each opening with its own ~1 KB message),
//!   4 clients; turn t of conversation c goes to relay (c + t) mod n. Later turns answered
//!   by another box than the turn before, with 1 relay and with 3.
//!
//! `BENCH_SECS` (default 5) sets the utilization window.

#[path = "support/balanced_load.rs"]
mod balanced_load;
#[path = "support/fake_backend.rs"]
mod fake_backend;
#[path = "support/ha_pool.rs"]
mod ha_pool;
#[path = "support/haproxy.rs"]
mod haproxy;
#[path = "support/process.rs"]
mod process;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use balanced_load::{Load, Tally};
use fake_backend::FakeBackend;
use ha_pool::{http, wait_for, Pool, Relay, MODEL};
use serde_json::json;

fn main() {
    let secs: u64 = std::env::var("BENCH_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(5);
    let mut rows: Vec<(String, String)> = Vec::new();
    match haproxy::binary() {
        Some(bin) => {
            eprintln!("running: a relay killed under load behind HAProxy, then restarted ...");
            rows.extend(kill_and_restart(&bin));
        }
        None => rows.push((
            "requests lost when a relay is killed under load".into(),
            "skipped: haproxy not installed (apt-get install haproxy)".into(),
        )),
    }
    eprintln!("running: saturating load, 1 relay then 3 ({secs} s each) ...");
    let (one, _) = utilization(1, secs);
    let (three, busy) = utilization(3, secs);
    rows.push((
        "backend slot utilization, saturating load, 1 relay".into(),
        format!("{one:.3}"),
    ));
    rows.push((
        "backend slot utilization, saturating load, 3 relays".into(),
        format!("{three:.3} ({:.3} of 1 relay; goal >= 0.95)", three / one),
    ));
    rows.push((
        "busy refusals per 1,000 requests, 3 relays".into(),
        format!("{busy:.1}"),
    ));
    eprintln!("running: conversations, 1 relay then 3 round robin ...");
    for n in [1, 3] {
        let (moved, later) = affinity(n);
        let goal = if n == 3 { "; goal <= 10 %" } else { "" };
        rows.push((
            format!("later turns that moved box, turns round robin over {n} relay(s)"),
            format!(
                "{moved} of {later} ({:.1} %{goal})",
                100.0 * moved as f64 / later as f64
            ),
        ));
    }
    println!();
    println!("| figure | value |");
    println!("|---|---|");
    for (k, v) in rows {
        println!("| {k} | {v} |");
    }
}

const KILL_CLIENTS: usize = 12;

fn kill_and_restart(bin: &std::path::Path) -> Vec<(String, String)> {
    let backends = (0..2)
        .map(|_| FakeBackend::new(MODEL, "one two three"))
        .collect();
    let mut pool = Pool::start(3, backends);
    let dir = std::env::temp_dir().join(format!("modelrelay-ha-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let layout = haproxy::Layout {
        front: process::free_addr(),
        relays: pool.relays.iter().map(|r| r.addr).collect(),
        stats: dir.join("haproxy.sock"),
    };
    let cfg = dir.join("haproxy.cfg");
    std::fs::write(&cfg, layout.config()).expect("haproxy.cfg");
    let args = ["-db".to_string(), "-f".into(), cfg.to_string_lossy().into()];
    let _haproxy = process::Process::spawn_program(bin, &args);
    wait_for("HAProxy sees three relays up", || {
        haproxy::all_up(&layout.stats, 3).0
    });

    let load = Load::start(layout.front, KILL_CLIENTS, "delay:50");
    wait_for("load through HAProxy with the first relay busy", || {
        let busy = pool.relays[0].health()["in_flight"].as_u64().unwrap_or(0) > 0;
        load.count(|_| true) >= 200 && busy
    });
    let killed = Instant::now();
    pool.relays[0].kill();
    let dead = Instant::now();
    wait_for("400 requests sent after the kill", || {
        load.count(|s| s.started >= dead) >= 400
    });
    let tally = Tally {
        sent: load.stop(),
        victim: "r1".into(),
        killed,
        dead,
    };
    let lost_after = tally.after().iter().filter(|s| !s.ok).count();
    let mut rows = vec![(
        "requests lost when a relay is killed under load (3 relays, HAProxy)".to_string(),
        format!(
            "{} of {} ({} were in flight on the killed relay; {lost_after} lost of those sent after it died)",
            tally.lost().len(),
            tally.sent.len(),
            tally.on_dead(),
        ),
    )];

    for down in [Duration::ZERO, Duration::from_secs(15)] {
        // The workers noticed: the others count one relay fewer.
        wait_for("the workers noticed the dead relay", || {
            pool.relays[1].health()["relays"] == 2
        });
        // The scenario's downtime (an upgrade, a reboot), not a synchronisation.
        std::thread::sleep(down);
        let addr = pool.relays[0].addr;
        let restarted = Instant::now();
        pool.relays[0] = Relay::start(addr);
        wait_for("both workers back", || {
            pool.relays[0].health()["workers_connected"] == 2
        });
        rows.push((
            format!(
                "seconds until a restarted relay has its workers back (down {} s)",
                down.as_secs()
            ),
            format!("{:.2}", restarted.elapsed().as_secs_f64()),
        ));
        pool.wait_registered(&pool.relays[1]);
        pool.relays[0].kill();
    }
    let _ = std::fs::remove_dir_all(&dir);
    rows
}

const SATURATING_CLIENTS: usize = 32;
const SATURATING_ANSWER: Duration = Duration::from_millis(100);

/// Backend busy time over slots × time, and busy refusals per 1,000 requests.
fn utilization(relays: usize, secs: u64) -> (f64, f64) {
    let backends = (0..2)
        .map(|_| FakeBackend::new(MODEL, "one two three").answer_delay(SATURATING_ANSWER))
        .collect();
    let pool = Pool::start(relays, backends);
    let addrs: Vec<_> = pool.relays.iter().map(|r| r.addr).collect();
    let stop = Arc::new(AtomicBool::new(false));
    let answered = Arc::new(AtomicUsize::new(0));
    let clients: Vec<_> = (0..SATURATING_CLIENTS)
        .map(|c| {
            let (stop, answered, addr) = (stop.clone(), answered.clone(), addrs[c % addrs.len()]);
            std::thread::spawn(move || {
                let body = json!({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
                    .to_string();
                while !stop.load(Ordering::SeqCst) {
                    if http(addr, "POST", "/v1/chat/completions", Some(&body))
                        .is_some_and(|r| r.whole())
                    {
                        answered.fetch_add(1, Ordering::SeqCst);
                    }
                }
            })
        })
        .collect();
    // Warm-up: every slot taken once.
    wait_for("the backends saturated", || {
        pool.backend_requests() >= 2 * pool.slots()
    });
    let (start, before) = (Instant::now(), pool.backend_requests());
    std::thread::sleep(Duration::from_secs(secs));
    let (window, during) = (start.elapsed(), pool.backend_requests() - before);
    stop.store(true, Ordering::SeqCst);
    for c in clients {
        let _ = c.join();
    }
    let busy = during as f64 * SATURATING_ANSWER.as_secs_f64();
    let util = busy / (pool.slots() as f64 * window.as_secs_f64());
    let refusals = pool.busy_refusals() * 1000.0 / answered.load(Ordering::SeqCst).max(1) as f64;
    (util, refusals)
}

const CONVERSATIONS: usize = 24;
const TURNS: usize = 4;
const CONVERSATION_CLIENTS: usize = 4;

/// Later turns answered by another box than the turn before, and how many later turns.
fn affinity(relays: usize) -> (usize, usize) {
    let backends = ["box-a", "box-b"]
        .iter()
        .map(|name| FakeBackend::new(MODEL, name).answer_delay(Duration::from_millis(20)))
        .collect();
    let pool = Pool::start(relays, backends);
    let addrs: Vec<_> = pool.relays.iter().map(|r| r.addr).collect();
    let clients: Vec<_> = (0..CONVERSATION_CLIENTS)
        .map(|k| {
            let addrs = addrs.clone();
            std::thread::spawn(move || {
                let mine: Vec<usize> = (k..CONVERSATIONS).step_by(CONVERSATION_CLIENTS).collect();
                let mut history: Vec<Vec<serde_json::Value>> = mine
                    .iter()
                    .map(|c| vec![json!({"role": "user", "content": opening(*c)})])
                    .collect();
                let mut boxes: Vec<Vec<String>> = vec![Vec::new(); mine.len()];
                // Conversations interleaved, as many users would be.
                for t in 0..TURNS {
                    for (i, c) in mine.iter().enumerate() {
                        let addr = addrs[(c + t) % addrs.len()];
                        let body = json!({"model": MODEL, "messages": history[i]}).to_string();
                        let reply = http(addr, "POST", "/v1/chat/completions", Some(&body))
                            .filter(|r| r.whole())
                            .expect("a turn answered");
                        let served = if reply.body.contains("box-a") { "a" } else { "b" };
                        boxes[i].push(served.to_string());
                        history[i].push(json!({"role": "assistant", "content": format!("box-{served}")}));
                        history[i].push(json!({"role": "user", "content": format!("and turn {} of {c}?", t + 2)}));
                    }
                }
                boxes
            })
        })
        .collect();
    let mut moved = 0;
    let mut later = 0;
    for c in clients {
        for boxes in c.join().expect("client") {
            later += boxes.len() - 1;
            moved += boxes.windows(2).filter(|w| w[0] != w[1]).count();
        }
    }
    (moved, later)
}

/// A conversation's first message: ~1 KB of its own (fingerprints need 512 bytes).
fn opening(c: usize) -> String {
    let mut s = format!("Conversation {c}. ");
    while s.len() < 1024 {
        s.push_str(&format!(
            "This is conversation number {c}, about topic {}. ",
            c * 7 + s.len()
        ));
    }
    s
}
