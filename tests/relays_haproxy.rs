//! Many relays behind a real load balancer: HAProxy (started by the test on loopback
//! ports) in front of three real relay binaries, two real workers with 4 slots each and
//! `PROXY_URL` listing all three relays, each worker with a fake backend of its own that
//! records its highest concurrency. Under load, one relay is killed with SIGKILL.
//!
//! What must hold: the only requests lost are ones that were in flight on the dead relay
//! when it died; every request sent after its death succeeds (at least 200 of them); no
//! backend ever runs more requests at once than its worker's slots.
//!
//! Skipped when HAProxy is not installed (under CI it must be: `.ci/run` installs it).
//! Nothing sleeps to synchronise: each step waits for HAProxy's, a relay's or a
//! process's observable state.

#[path = "../examples/support/balanced_load.rs"]
mod balanced_load;
mod common;
#[path = "../examples/support/fake_backend.rs"]
mod fake_backend;
#[path = "../examples/support/haproxy.rs"]
mod haproxy;

use std::sync::atomic::Ordering;
use std::time::Instant;

use balanced_load::{Load, Tally};

use common::procs::{start_worker, Proc, ServerProc};
use common::*;
use fake_backend::FakeBackend;

const ANSWER: &str = "one two three four";
const SLOTS: usize = 4;
const CLIENTS: usize = 12;
/// Requests that must follow the kill, all answered.
const AFTER_KILL: usize = 200;

fn haproxy_proc(layout: &haproxy::Layout, bin: &std::path::Path, dir: &std::path::Path) -> Proc {
    let proc = Proc::haproxy(bin, &layout.config(), dir);
    wait_until("HAProxy sees three relays up", || {
        haproxy::all_up(&layout.stats, 3)
    });
    proc
}

#[test]
fn haproxy_over_three_relays_loses_only_what_a_killed_relay_had_in_flight() {
    let Some(bin) = haproxy::binary_for_test() else {
        return;
    };
    let dir = std::env::temp_dir().join(format!("modelrelay-haproxy-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");

    let mut relays: Vec<ServerProc> = (0..3).map(|_| ServerProc::start(&[])).collect();
    let urls: Vec<String> = relays
        .iter()
        .map(|r| format!("http://{}", r.addr))
        .collect();
    let urls = urls.join(",");
    let slots = SLOTS.to_string();
    let backends: Vec<FakeBackend> = (0..2).map(|_| FakeBackend::new("m", ANSWER)).collect();
    let _workers: Vec<Proc> = backends
        .iter()
        .enumerate()
        .map(|(i, b)| {
            let addr = b.clone().spawn("127.0.0.1:0").expect("backend");
            let name = format!("w{i}");
            start_worker(
                relays[0].addr,
                addr,
                &[
                    ("PROXY_URL", &urls),
                    ("MAX_CONCURRENCY", &slots),
                    ("MODELS", "m"),
                    ("WORKER_NAME", &name),
                ],
            )
        })
        .collect();
    for relay in &relays {
        relay.wait_workers(2);
        wait_until("both workers report three relays", || {
            let h = relay.health();
            (h["relays"] == 3, h.to_string())
        });
    }

    let layout = haproxy::Layout {
        front: std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("free port"),
        relays: relays.iter().map(|r| r.addr).collect(),
        stats: dir.join("haproxy.sock"),
    };
    let _haproxy = haproxy_proc(&layout, &bin, &dir);

    // Load: CLIENTS clients one request after another, every other one streamed.
    let load = Load::start(layout.front, CLIENTS, "delay:30");

    // Under load: answers flowing, and the victim with requests of its own in flight.
    let victim = &relays[0];
    wait_until("load through HAProxy with the victim busy", || {
        let done = load.count(|_| true);
        let h = victim.health();
        let busy = h["in_flight"].as_u64().unwrap_or(0) > 0;
        let last = load.last();
        (
            done >= 60 && busy,
            format!("{done} answered; victim {h}; last {last:?}"),
        )
    });
    let killed = Instant::now();
    let mut victim = relays.remove(0);
    victim.proc.signal("KILL");
    victim.proc.wait_exit();
    // Its sockets are closed from here on: anything sent now must succeed elsewhere.
    let dead = Instant::now();
    wait_until("requests sent after the kill answered", || {
        let after = load.count(|s| s.started >= dead);
        (after >= AFTER_KILL, format!("{after} answered"))
    });
    let tally = Tally {
        sent: load.stop(),
        victim: "r1".into(),
        killed,
        dead,
    };
    let lost = tally.lost();
    eprintln!(
        "{} requests, {} lost {:?}, {} in flight on the killed relay; highest backend concurrency {:?}",
        tally.sent.len(),
        lost.len(),
        lost.iter().map(|s| s.head.as_str()).collect::<Vec<_>>(),
        tally.on_dead(),
        backends
            .iter()
            .map(|b| b.stats.max_active.load(Ordering::SeqCst))
            .collect::<Vec<_>>()
    );
    for s in &lost {
        assert!(
            tally.was_on_dead(s),
            "a request lost that was not in flight on the killed relay: {s:?}"
        );
    }
    assert!(lost.len() <= tally.on_dead());
    let after = tally.after();
    assert!(after.len() >= AFTER_KILL);
    assert!(
        after.iter().all(|s| s.ok),
        "{:?}",
        after.iter().filter(|s| !s.ok).collect::<Vec<_>>()
    );
    assert!(
        after.iter().any(|s| s.stream) && after.iter().any(|s| !s.stream),
        "both kinds ran"
    );
    for (i, b) in backends.iter().enumerate() {
        let max = b.stats.max_active.load(Ordering::SeqCst);
        assert!(max <= SLOTS, "backend of w{i} ran {max} requests at once");
        assert!(b.stats.requests.load(Ordering::SeqCst) > 0, "w{i} served");
    }
    let _ = std::fs::remove_dir_all(&dir);
}
