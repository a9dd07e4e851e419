//! Many relays, one pool: the real worker binary connected to several real relay
//! binaries at once (`PROXY_URL` a comma-separated list), with a fake backend.

mod common;
#[path = "../examples/support/fake_backend.rs"]
mod fake_backend;

use std::net::SocketAddr;

use common::procs::{start_worker, Proc, ServerProc};
use common::*;
use fake_backend::FakeBackend;
use serde_json::json;

const ANSWER: &str = "one two three";

fn body(scenario: &str) -> String {
    json!({"model": "m", "scenario": scenario, "messages": [{"role": "user", "content": "hi"}]})
        .to_string()
}

fn proxy_urls(relays: &[&ServerProc]) -> String {
    relays
        .iter()
        .map(|r| format!("http://{}", r.addr))
        .collect::<Vec<_>>()
        .join(",")
}

/// A worker with `MODELS=*` serving every relay in `relays`.
fn multi_homed(relays: &[&ServerProc], backend: SocketAddr, extra: &[(&str, &str)]) -> Proc {
    let urls = proxy_urls(relays);
    let mut env = vec![("PROXY_URL", urls.as_str())];
    env.extend_from_slice(extra);
    start_worker(relays[0].addr, backend, &env)
}

#[test]
fn one_worker_serves_two_relays() {
    let (a, b) = (ServerProc::start(&[]), ServerProc::start(&[]));
    let backend = FakeBackend::new("m", ANSWER);
    let baddr = backend.clone().spawn("127.0.0.1:0").expect("backend");
    let _worker = multi_homed(&[&a, &b], baddr, &[]);
    a.wait_workers(1);
    b.wait_workers(1);
    for relay in [&a, &b, &a, &b] {
        let resp = post(relay.addr, "/v1/chat/completions", &body(""));
        assert_eq!(resp.status, 200, "{}", resp.text());
        assert_eq!(resp.text(), backend.completion());
    }
}

#[test]
fn a_relay_killed_and_restarted_gets_its_worker_back_while_the_other_serves() {
    let a = ServerProc::start(&[]);
    let mut b = ServerProc::start(&[]);
    let backend = FakeBackend::new("m", ANSWER);
    let baddr = backend.clone().spawn("127.0.0.1:0").expect("backend");
    let worker = multi_homed(&[&a, &b], baddr, &[]);
    a.wait_workers(1);
    b.wait_workers(1);
    let b_addr = b.addr;
    b.proc.signal("KILL");
    b.proc.wait_exit();
    // The worker notices, and keeps serving through the other relay meanwhile.
    worker.wait_line(&format!("disconnected from ws://{b_addr}"));
    for _ in 0..3 {
        let resp = post(a.addr, "/v1/chat/completions", &body(""));
        assert_eq!(resp.status, 200, "{}", resp.text());
    }
    // Five failed dials toward the lost relay (about 11 s down): a plain doubling
    // backoff would now wait 16 s, past the 10 s the restarted relay is given below.
    let refused = format!("cannot connect to ws://{b_addr}");
    for at_least in [2, 4, 5] {
        wait_until("failed dials toward the lost relay", || {
            let n = worker.log().matches(&refused).count();
            (n >= at_least, format!("{n} failed dials"))
        });
    }
    let restarted = ServerProc::start_on(&b_addr.to_string(), &[]);
    // Back within WAIT (10 s), however many dials failed before.
    restarted.wait_workers(1);
    let resp = post(restarted.addr, "/v1/chat/completions", &body(""));
    assert_eq!(resp.status, 200, "{}", resp.text());
    assert_eq!(a.health()["workers_connected"], 1);
}

#[test]
fn sigterm_on_a_worker_drains_every_relay_session() {
    let (a, b) = (ServerProc::start(&[]), ServerProc::start(&[]));
    let backend = FakeBackend::new("m", ANSWER);
    let baddr = backend.clone().spawn("127.0.0.1:0").expect("backend");
    let mut worker = multi_homed(&[&a, &b], baddr, &[("MAX_CONCURRENCY", "2")]);
    a.wait_workers(1);
    b.wait_workers(1);
    // One held request through each relay.
    let held: Vec<_> = [a.addr, b.addr]
        .into_iter()
        .map(|addr| std::thread::spawn(move || post(addr, "/v1/chat/completions", &body("hold"))))
        .collect();
    wait_until("both requests at the backend", || {
        let n = backend
            .stats
            .active
            .load(std::sync::atomic::Ordering::SeqCst);
        (n == 2, format!("{n} active"))
    });
    worker.signal("TERM");
    worker.wait_line("graceful shutdown");
    backend.release();
    for h in held {
        let resp = h.join().expect("client");
        assert_eq!(resp.status, 200, "{}", resp.text());
    }
    assert!(worker.wait_exit().success(), "{}", worker.log());
    a.wait_workers(0);
    b.wait_workers(0);
}
