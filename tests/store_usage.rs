//! Usage across relays through one real `redis-server`: two relays (the real server
//! binary twice), one real worker serving both (`PROXY_URL` a list) and a fake backend
//! with known token counts. After a mix of plain, streamed and Ollama requests on both,
//! `/admin/usage` and `/api/usage-stream` on either show the fleet's exact totals; they
//! stay exact through a Redis outage (requests served meanwhile are published once it is
//! back) and through a relay restart (publishing again never adds twice).
//! Skipped with a message when `redis-server` is not installed, except under CI.
#![cfg(feature = "redis-store")]

mod common;
#[path = "../examples/support/fake_backend.rs"]
mod fake_backend;

use std::io::BufReader;
use std::net::SocketAddr;
use std::path::Path;

use common::procs::{start_worker, tool, ServerProc};
use common::redis::{scratch_dir, Redis};
use common::{read_chunk, read_head, request, send_request, wait_until, Response};
use fake_backend::FakeBackend;
use serde_json::{json, Value};

const ADMIN: &str = "fleet-usage-admin";
/// The fake backend reports 5 prompt and 5 completion tokens per answer.
const ANSWER: &str = "one two three four five";
const IN: u64 = 5;
const OUT: u64 = 5;

fn relay(redis: &Redis, dir: &Path) -> ServerProc {
    redis.relay(dir, &[("MODELRELAY_ADMIN_TOKEN", ADMIN)])
}

fn send(addr: SocketAddr, tenant: &str, path: &str, body: Value) -> Response {
    let r = request(
        addr,
        "POST",
        path,
        Some(&body.to_string()),
        &[
            ("content-type", "application/json"),
            ("x-tenant-id", tenant),
        ],
    );
    assert_eq!(r.status, 200, "{path}: {}", r.text());
    r
}

/// A plain, a streamed and two Ollama chats as `tenant`; returns how many requests
/// were made.
fn mixed(addr: SocketAddr, tenant: &str) -> u64 {
    let msgs = json!([{"role": "user", "content": "hi"}]);
    send(
        addr,
        tenant,
        "/v1/chat/completions",
        json!({"model": "m", "messages": msgs}),
    );
    send(
        addr,
        tenant,
        "/v1/chat/completions",
        json!({"model": "m", "stream": true, "messages": msgs}),
    );
    send(
        addr,
        tenant,
        "/api/chat",
        json!({"model": "m", "stream": false, "messages": msgs}),
    );
    send(
        addr,
        tenant,
        "/api/chat",
        json!({"model": "m", "messages": msgs}),
    );
    4
}

/// `(requests, input, output)` summed over `/admin/usage`'s rows, and its `fleet` part.
fn report(addr: SocketAddr) -> ((u64, u64, u64), Value) {
    let auth = format!("Bearer {ADMIN}");
    let r = request(
        addr,
        "GET",
        "/admin/usage?group_by=model",
        None,
        &[("authorization", &auth)],
    );
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    let t = &v["totals"];
    let n = |f: &str| t[f].as_u64().unwrap_or(0);
    (
        (n("requests"), n("input_tokens"), n("output_tokens")),
        v["fleet"].clone(),
    )
}

fn wait_for_totals(addr: SocketAddr, n: u64) {
    wait_until("the fleet's totals in /admin/usage", || {
        let (got, fleet) = report(addr);
        (got == (n, n * IN, n * OUT), format!("{got:?} {fleet}"))
    });
}

/// Reads `/api/usage-stream` until a snapshot's totals are `n` requests.
fn stream_reaches(addr: SocketAddr, n: u64) -> Value {
    let auth = format!("Bearer {ADMIN}");
    let stream = send_request(
        addr,
        "GET",
        "/api/usage-stream",
        None,
        &[("authorization", &auth)],
    );
    stream
        .set_read_timeout(Some(common::WAIT))
        .expect("timeout");
    let mut reader = BufReader::new(stream);
    assert_eq!(read_head(&mut reader).0, 200);
    let mut text = String::new();
    loop {
        let chunk = read_chunk(&mut reader).expect("the stream reaches the fleet's totals");
        text.push_str(&String::from_utf8_lossy(&chunk));
        while let Some(end) = text.find("\n\n") {
            let event: String = text.drain(..end + 2).collect();
            let Some(data) = event.lines().find_map(|l| l.strip_prefix("data: ")) else {
                continue;
            };
            let v: Value = serde_json::from_str(data).expect("snapshot");
            if v["totals"]["requests"] == n {
                return v["totals"].clone();
            }
        }
    }
}

#[test]
fn usage_is_the_fleets_on_both_relays_through_an_outage_and_a_restart() {
    if !tool("redis-server") {
        return;
    }
    let dir = scratch_dir("fleet-usage");
    let mut redis = Redis::start();
    let backend = FakeBackend::new("m", ANSWER)
        .spawn("127.0.0.1:0")
        .expect("backend");
    let a = relay(&redis, &dir.join("a"));
    let mut b = relay(&redis, &dir.join("b"));
    let urls = format!("http://{},http://{}", a.addr, b.addr);
    let _worker = start_worker(a.addr, backend, &[("PROXY_URL", &urls)]);
    a.wait_workers(1);
    b.wait_workers(1);

    let mut n = mixed(a.addr, "one") + mixed(b.addr, "one") + mixed(b.addr, "two");
    for s in [&a, &b] {
        wait_for_totals(s.addr, n);
        assert_eq!(report(s.addr).1, json!({"complete": true, "relays": 2}));
        let totals = stream_reaches(s.addr, n);
        assert_eq!(totals["input_tokens"], n * IN);
        assert_eq!(totals["output_tokens"], n * OUT);
    }

    // Redis gone: requests are served as before; each relay reports its own figures
    // and says the fleet's are incomplete.
    redis.stop();
    n += mixed(a.addr, "three") + mixed(b.addr, "three");
    wait_until("A to say its report is its own", || {
        let (_, fleet) = report(a.addr);
        (fleet["complete"] == false, fleet.to_string())
    });
    // Back, empty (no persistence): each relay publishes what it served meanwhile and,
    // finding the store did not know it, everything else again.
    redis.restart();
    for s in [&a, &b] {
        wait_for_totals(s.addr, n);
    }

    // B restarted on its journal publishes everything again: nothing adds twice.
    b.proc.signal("TERM");
    b.proc.wait_exit();
    b = relay(&redis, &dir.join("b"));
    b.proc
        .wait_line("usage: published to the shared store as relay");
    n += mixed(a.addr, "one");
    for s in [&a, &b] {
        wait_for_totals(s.addr, n);
        assert_eq!(report(s.addr).1["relays"], 2);
    }
    let _ = std::fs::remove_dir_all(&dir);
}
