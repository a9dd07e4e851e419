//! Many relays, one pool: the real worker binary connected to several real relay
//! binaries at once (`PROXY_URL` a comma-separated list), with a fake backend.

mod common;
#[path = "../examples/support/fake_backend.rs"]
mod fake_backend;

use std::net::SocketAddr;
use std::sync::atomic::Ordering;

use common::fake_server::{FakeServer, Session};
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

/// What our server acks to a worker serving several relays.
const MULTI: &[&str] = &["failover", "load_reports", "busy"];

/// A worker with `MAX_CONCURRENCY=1` serving two stand-in relays.
fn worker_on_fakes(a: &FakeServer, b: &FakeServer, backend: SocketAddr) -> Proc {
    let urls = format!("http://{},http://{}", a.addr, b.addr);
    start_worker(
        a.addr,
        backend,
        &[
            ("PROXY_URL", urls.as_str()),
            ("MODELS", "m"),
            ("MAX_CONCURRENCY", "1"),
        ],
    )
}

fn request(session: &Session, id: &str, scenario: &str) {
    session.send(json!({
        "type": "request", "request_id": id, "model": "m",
        "endpoint_path": "/v1/chat/completions", "is_streaming": false,
        "body": body(scenario), "headers": {}
    }));
}

fn load_is(n: u64) -> impl Fn(&serde_json::Value) -> bool {
    move |m| m["type"] == "load" && m["in_flight"] == n
}

fn completed(id: &'static str) -> impl Fn(&serde_json::Value) -> bool {
    move |m| m["type"] == "response_complete" && m["request_id"] == id
}

#[test]
fn one_relay_registers_exactly_as_before() {
    let relay = FakeServer::start(MULTI);
    let backend = FakeBackend::new("m", ANSWER)
        .spawn("127.0.0.1:0")
        .expect("backend");
    let _worker = start_worker(relay.addr, backend, &[("MODELS", "m")]);
    let session = relay.session();
    let features = session.register["features"].to_string();
    assert!(
        !features.contains("load_reports") && !features.contains("busy"),
        "{features}"
    );
    request(&session, "r-1", "");
    session.wait_for("the answer", WAIT, completed("r-1"));
    assert!(
        !session.sent_any("load") && !session.sent_any("relays"),
        "{:?}",
        session.history()
    );
}

#[test]
fn the_last_slot_taken_by_one_relay_is_refused_busy_to_the_other() {
    let (a, b) = (FakeServer::start(MULTI), FakeServer::start(MULTI));
    let backend = FakeBackend::new("m", ANSWER);
    let baddr = backend.clone().spawn("127.0.0.1:0").expect("backend");
    let _worker = worker_on_fakes(&a, &b, baddr);
    let (sa, sb) = (a.session(), b.session());
    for s in [&sa, &sb] {
        let features = s.register["features"].to_string();
        assert!(features.contains("load_reports") && features.contains("busy"));
    }
    request(&sa, "r-1", "hold");
    // Relay B hears of relay A's request, then sends one anyway (as a relay whose
    // report had not arrived yet would): refused at once, never queued.
    sb.wait_for("load 1", WAIT, load_is(1));
    request(&sb, "r-1", "");
    let (_, busy) = sb.wait_for("busy", WAIT, |m| m["type"] == "busy");
    assert_eq!(
        busy,
        json!({"type": "busy", "request_id": "r-1", "in_flight": 1})
    );
    backend.release();
    sa.wait_for("the held answer", WAIT, completed("r-1"));
    sb.wait_for("load 0", WAIT, load_is(0));
    // Dispatched again, it runs.
    request(&sb, "r-1", "");
    sb.wait_for("the answer", WAIT, completed("r-1"));
    assert_eq!(backend.stats.max_active.load(Ordering::SeqCst), 1);
}

#[test]
fn toward_an_original_server_a_request_waits_for_the_slot_instead() {
    let ours = FakeServer::start(MULTI);
    let original = FakeServer::start(&[]);
    let backend = FakeBackend::new("m", ANSWER);
    let baddr = backend.clone().spawn("127.0.0.1:0").expect("backend");
    let _worker = worker_on_fakes(&ours, &original, baddr);
    let (so, sg) = (ours.session(), original.session());
    request(&so, "r-1", "hold");
    wait_until("the held request at the backend", || {
        let n = backend.stats.active.load(Ordering::SeqCst);
        (n == 1, format!("{n} active"))
    });
    request(&sg, "r-9", "");
    // The original server's request waits for the slot: the load counts it.
    so.wait_for("load 2", WAIT, load_is(2));
    backend.release();
    so.wait_for("the held answer", WAIT, completed("r-1"));
    sg.wait_for("the waiting answer", WAIT, completed("r-9"));
    assert_eq!(backend.stats.max_active.load(Ordering::SeqCst), 1);
    // An original server gets nothing it does not know.
    let kinds: Vec<_> = sg.history().iter().map(|m| m["type"].clone()).collect();
    assert!(
        !kinds.iter().any(|k| k == "load" || k == "busy"),
        "{kinds:?}"
    );
}

const ADMIN: &str = "relays-admin-token";

/// A relay with the admin API on (a state directory of its own).
fn admin_relay(tag: &str) -> ServerProc {
    let state =
        std::env::temp_dir().join(format!("modelrelay-relays-{}-{tag}", std::process::id()));
    let state = state.to_string_lossy().into_owned();
    ServerProc::start(&[
        ("MODELRELAY_ADMIN_TOKEN", ADMIN),
        ("STATE_DIR", state.as_str()),
    ])
}

fn admin_workers(relay: &ServerProc) -> Vec<serde_json::Value> {
    let auth = format!("Bearer {ADMIN}");
    let r = common::request(
        relay.addr,
        "GET",
        "/admin/workers",
        None,
        &[("authorization", &auth)],
    );
    assert_eq!(r.status, 200, "{}", r.text());
    r.json()["workers"].as_array().cloned().unwrap_or_default()
}

fn wait_relays_reported(relay: &ServerProc, n: u64) {
    wait_until("the relays the workers report", || {
        let h = relay.health();
        (h["relays"] == n, h.to_string())
    });
}

#[test]
fn one_worker_serves_two_relays() {
    let (a, b) = (admin_relay("serve-a"), admin_relay("serve-b"));
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
    // Each relay shows the relays the worker serves, and counts them.
    let expected = json!([
        format!("ws://{}/v1/worker/connect", a.addr),
        format!("ws://{}/v1/worker/connect", b.addr)
    ]);
    for relay in [&a, &b] {
        wait_relays_reported(relay, 2);
        assert_eq!(admin_workers(relay)[0]["relays"], expected);
        assert_eq!(metric(relay.addr, "modelrelay_relays"), 2.0);
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
    // Registered on the worker's side too (a kill while it still reads the ack is a
    // failed registration, not a lost session).
    worker.wait_line(&format!("registered with server ws://{b_addr}"));
    b.proc.signal("KILL");
    b.proc.wait_exit();
    // The worker notices, and keeps serving through the other relay meanwhile.
    worker.wait_line(&format!("disconnected from server ws://{b_addr}"));
    wait_relays_reported(&a, 1);
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
    wait_relays_reported(&a, 2);
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

/// A `/metrics` sample.
fn metric(addr: SocketAddr, sample: &str) -> f64 {
    let text = common::request(addr, "GET", "/metrics", None, &[]).text();
    text.lines()
        .find_map(|l| l.strip_prefix(sample)?.trim().parse().ok())
        .unwrap_or_else(|| panic!("no {sample} in /metrics:\n{text}"))
}

#[test]
fn a_relay_dispatches_a_busy_request_again_and_the_client_never_knows() {
    let server = ServerProc::start(&[]);
    let register = json!({
        "type": "register", "worker_name": "multi", "models": ["m"], "max_concurrent": 1,
        "protocol_version": "1", "current_load": 0, "features": ["load_reports", "busy"]
    });
    let worker = FakeWorker::connect_as(server.addr, register);
    let addr = server.addr;
    let client = std::thread::spawn(move || post(addr, "/v1/chat/completions", &body("")));
    let first = worker.request();
    // Another relay holds the slot: refused; the relay sends nothing until told.
    worker.send(json!({"type": "busy", "request_id": first.request_id, "in_flight": 1}));
    worker.send(json!({"type": "load", "in_flight": 0}));
    let again = worker.request();
    assert_eq!(again.request_id, first.request_id);
    worker.complete(&again.request_id, 200, &openai_answer("fine"));
    let resp = client.join().expect("client");
    assert_eq!(resp.status, 200, "{}", resp.text());
    assert_eq!(metric(addr, "modelrelay_busy_refusals_total"), 1.0);
    assert_eq!(metric(addr, "modelrelay_failovers_total"), 0.0);
}

#[test]
fn two_relays_saturating_one_worker_never_exceed_its_slots_and_lose_nothing() {
    let (a, b) = (ServerProc::start(&[]), ServerProc::start(&[]));
    let backend = FakeBackend::new("m", ANSWER);
    let baddr = backend.clone().spawn("127.0.0.1:0").expect("backend");
    let _worker = multi_homed(&[&a, &b], baddr, &[("MAX_CONCURRENCY", "2")]);
    a.wait_workers(1);
    b.wait_workers(1);
    let clients: Vec<_> = (0..16)
        .map(|i| {
            let addr = if i % 2 == 0 { a.addr } else { b.addr };
            std::thread::spawn(move || post(addr, "/v1/chat/completions", &body("delay:30")))
        })
        .collect();
    for c in clients {
        let resp = c.join().expect("client");
        assert_eq!(resp.status, 200, "{}", resp.text());
    }
    let max = backend.stats.max_active.load(Ordering::SeqCst);
    assert!(max <= 2, "the backend saw {max} requests at once");
    let busy = metric(a.addr, "modelrelay_busy_refusals_total")
        + metric(b.addr, "modelrelay_busy_refusals_total");
    eprintln!("highest backend concurrency {max}, busy refusals {busy}");
}

#[test]
fn a_relay_drained_with_other_relays_serves_through_its_grace_and_the_worker_stays() {
    let a = ServerProc::start(&[]);
    let mut b = ServerProc::start(&[("DRAIN_GRACE_SECS", "5")]);
    let backend = FakeBackend::new("m", ANSWER);
    let baddr = backend.clone().spawn("127.0.0.1:0").expect("backend");
    let worker = multi_homed(&[&a, &b], baddr, &[]);
    a.wait_workers(1);
    b.wait_workers(1);
    wait_relays_reported(&b, 2);
    b.proc.signal("TERM");
    // 503 at once, for the load balancer; requests are still served meanwhile.
    wait_until("/health 503 on the draining relay", || {
        let r = common::request(b.addr, "GET", "/health", None, &[]);
        (r.status == 503, r.text())
    });
    b.proc.wait_line("still serving for");
    let resp = post(b.addr, "/v1/chat/completions", &body(""));
    assert_eq!(resp.status, 200, "{}", resp.text());
    assert!(b.proc.wait_exit().success(), "{}", b.proc.log());
    // The worker lost one relay, not its life: it serves through the other. (The
    // relay's last words may be lost to a reset as it exits: either line will do.)
    let gone = format!("disconnected from server ws://{}", b.addr);
    wait_until("the worker hears the relay went away", || {
        let log = worker.log();
        let heard =
            log.contains("is shutting down; serving the other relays") || log.contains(&gone);
        (heard, log)
    });
    assert!(
        !worker.log().contains("graceful shutdown"),
        "{}",
        worker.log()
    );
    let resp = post(a.addr, "/v1/chat/completions", &body(""));
    assert_eq!(resp.status, 200, "{}", resp.text());
    assert_eq!(a.health()["workers_connected"], 1);
}

#[test]
fn a_relay_alone_drains_at_once() {
    let mut relay = ServerProc::start(&[("DRAIN_GRACE_SECS", "60")]);
    let backend = FakeBackend::new("m", ANSWER)
        .spawn("127.0.0.1:0")
        .expect("backend");
    let _worker = start_worker(relay.addr, backend, &[]);
    relay.wait_workers(1);
    relay.proc.signal("TERM");
    // Well before the 60 s grace (the wait gives up after 10 s).
    assert!(relay.proc.wait_exit().success(), "{}", relay.proc.log());
    assert!(!relay.proc.log().contains("still serving for"));
}
