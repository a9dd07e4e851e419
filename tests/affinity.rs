//! Issue 18, cache affinity, end to end: the real server and worker binaries with fake
//! backends that keep a prompt cache and report its reuse as llama-server does
//! (`usage.prompt_tokens_details.cached_tokens`, read back from the relay's
//! `x-cache-hit` / `x-cache-tokens-reused` headers). Where a request ran is read from
//! each fake backend's own counters.
//!
//! Nothing sleeps to synchronise: each step waits for `/health`, `/admin/workers` or a
//! backend counter to show what it needs.

mod common;
#[path = "../examples/support/fake_backend.rs"]
mod fake_backend;

use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::thread::JoinHandle;

use common::procs::{start_worker, Proc, ServerProc};
use common::{request, wait_until, Response};
use fake_backend::FakeBackend;
use serde_json::{json, Value};

const ADMIN: &str = "affinity-admin-token";
const WAIT_MS: u64 = 300;

fn start_server(extra: &[(&str, &str)]) -> ServerProc {
    let mut env = vec![("MODELRELAY_ADMIN_TOKEN", ADMIN)];
    let state = std::env::temp_dir().join(format!(
        "modelrelay-affinity-{}-{}",
        std::process::id(),
        std::thread::current()
            .name()
            .unwrap_or("t")
            .replace("::", "-")
    ));
    let state = state.to_string_lossy().into_owned();
    env.push(("STATE_DIR", state.as_str()));
    env.extend_from_slice(extra);
    ServerProc::start(&env)
}

struct Pool {
    server: ServerProc,
    backends: Vec<FakeBackend>,
    _workers: Vec<Proc>,
}

impl Pool {
    /// A server and one worker per entry of `slots`, registered in that order (so the
    /// first is the first in round-robin order), each with a caching fake backend.
    fn start(server_env: &[(&str, &str)], slots: &[u32]) -> Pool {
        let server = start_server(server_env);
        let (mut backends, mut workers) = (Vec::new(), Vec::new());
        for (i, n) in slots.iter().enumerate() {
            let backend = FakeBackend::new("m", "sure thing").with_prompt_cache();
            let addr: SocketAddr = backend.clone().spawn("127.0.0.1:0").expect("backend");
            let (name, n) = (format!("w{}", i + 1), n.to_string());
            let env = [("WORKER_NAME", name.as_str()), ("MAX_CONCURRENCY", &n)];
            workers.push(start_worker(server.addr, addr, &env));
            server.wait_workers(i as u64 + 1);
            backends.push(backend);
        }
        Pool {
            server,
            backends,
            _workers: workers,
        }
    }

    /// Requests each backend has received.
    fn served(&self) -> Vec<usize> {
        self.backends
            .iter()
            .map(|b| b.stats.requests.load(Ordering::SeqCst))
            .collect()
    }

    fn chat(&self, body: &Value, headers: &[(&str, &str)]) -> Response {
        let mut all = vec![("content-type", "application/json")];
        all.extend_from_slice(headers);
        let text = body.to_string();
        let r = request(
            self.server.addr,
            "POST",
            "/v1/chat/completions",
            Some(&text),
            &all,
        );
        assert_eq!(r.status, 200, "{}", r.text());
        r
    }

    fn admin(&self, path: &str) -> Response {
        let auth = format!("Bearer {ADMIN}");
        request(
            self.server.addr,
            "GET",
            path,
            None,
            &[("authorization", &auth)],
        )
    }

    fn metric(&self, name: &str) -> f64 {
        let text = self.admin("/metrics").text();
        text.lines()
            .find_map(|l| l.strip_prefix(name)?.trim().parse().ok())
            .unwrap_or(0.0)
    }

    /// Starts two requests the backends hold (until released): round robin puts the
    /// first on w2, the least load the second on w1, which is then full with one slot.
    fn hold_two(&self) -> Vec<JoinHandle<Response>> {
        let hold = json!({"model": "m", "scenario": "hold", "messages": [{"role": "user", "content": "wait"}]});
        let mut holders = Vec::new();
        for expect in [[0, 1], [1, 1]] {
            let (addr, body) = (self.server.addr, hold.to_string());
            holders.push(std::thread::spawn(move || {
                let headers = [("content-type", "application/json")];
                request(addr, "POST", "/v1/chat/completions", Some(&body), &headers)
            }));
            wait_until("the held request in flight", || {
                let seen = self.in_flight();
                (seen == expect, format!("in flight per worker: {seen:?}"))
            });
        }
        holders
    }

    fn in_flight(&self) -> Vec<u64> {
        let list = self.admin("/admin/workers").json()["workers"].clone();
        let mut out: Vec<(String, u64)> = list
            .as_array()
            .into_iter()
            .flatten()
            .map(|w| {
                let name = w["name"].as_str().unwrap_or_default().to_string();
                (name, w["in_flight"].as_u64().unwrap_or(0))
            })
            .collect();
        out.sort();
        out.into_iter().map(|(_, n)| n).collect()
    }
}

/// Turn `turns` of conversation `topic`: a ~1,300-byte system prompt, then the user's
/// questions with the (fake) answers between them.
fn conversation(topic: &str, turns: usize) -> Value {
    let system = format!("You help with {topic}; answer briefly and precisely. ").repeat(25);
    let mut messages = vec![json!({"role": "system", "content": system})];
    for t in 0..turns {
        if t > 0 {
            messages.push(json!({"role": "assistant", "content": "sure thing"}));
        }
        messages.push(json!({"role": "user", "content": format!("{topic} question {t}")}));
    }
    json!({"model": "m", "max_tokens": 16, "messages": messages})
}

fn cache_hit(r: &Response) -> bool {
    r.header("x-cache-hit") == Some("true")
        && r.header("x-cache-tokens-reused")
            .and_then(|n| n.parse::<u64>().ok())
            .is_some_and(|n| n > 0)
}

#[test]
fn a_conversation_stays_on_its_worker_and_two_spread_over_two() {
    let pool = Pool::start(&[], &[2, 2]);
    // Turn 1 of each, one after the other: nobody holds them, so load and round robin
    // put them on different workers.
    pool.chat(&conversation("gardening", 1), &[]);
    pool.chat(&conversation("taxes", 1), &[]);
    assert_eq!(pool.served(), [1, 1], "two conversations on two workers");
    for turn in 2..=5 {
        for topic in ["gardening", "taxes"] {
            let r = pool.chat(&conversation(topic, turn), &[]);
            assert!(
                cache_hit(&r),
                "{topic} turn {turn} reused its cache: {:?}",
                r.headers
            );
        }
    }
    assert_eq!(
        pool.served(),
        [5, 5],
        "each conversation kept to its worker"
    );
    let reused: usize = (pool.backends.iter())
        .filter_map(|b| b.cache.as_ref())
        .map(|c| c.reused.load(Ordering::SeqCst))
        .sum();
    assert!(reused > 0);
    let outcome = |o: &str| {
        pool.metric(&format!(
            "modelrelay_affinity_routing_total{{outcome=\"{o}\"}}"
        ))
    };
    assert_eq!((outcome("hit"), outcome("miss")), (8.0, 2.0));
    assert_eq!(outcome("overridden_by_load"), 0.0);
    let workers = pool.admin("/admin/workers").json();
    for w in workers["workers"].as_array().expect("workers") {
        let held = w["affinity_fingerprints"].as_u64().unwrap_or(0);
        assert!(held >= 2, "{}: {held} fingerprints", w["name"]);
    }

    // An explicit session key keeps even short requests together.
    let before = pool.served();
    let short = json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]});
    for _ in 0..3 {
        pool.chat(&short, &[("x-session-id", "session-7")]);
    }
    let after = pool.served();
    let moved: Vec<usize> = after.iter().zip(&before).map(|(a, b)| a - b).collect();
    assert!(
        moved == [3, 0] || moved == [0, 3],
        "one worker took the session: {moved:?}"
    );
}

#[test]
fn with_routing_affinity_off_turns_wander_between_workers() {
    let pool = Pool::start(&[("ROUTING_AFFINITY", "off")], &[2, 2]);
    for turn in 1..=4 {
        pool.chat(&conversation("chess", turn), &[]);
    }
    assert_eq!(pool.served(), [2, 2], "round robin, as before affinity");
    let hits = pool.metric("modelrelay_affinity_routing_total{outcome=\"hit\"}");
    assert_eq!(hits, 0.0);
}

#[test]
fn a_full_cached_worker_does_not_hold_a_request_beyond_affinity_wait_ms() {
    let wait = WAIT_MS.to_string();
    let pool = Pool::start(&[("AFFINITY_WAIT_MS", &wait)], &[1, 2]);
    // Turn 1 goes to w1, the first in round-robin order.
    pool.chat(&conversation("sailing", 1), &[]);
    assert_eq!(pool.served(), [1, 0]);
    // Two held requests: w1 (one slot) is then full while w2 has one free.
    let holders = pool.hold_two();
    // Turn 2's worker is full: it waits up to AFFINITY_WAIT_MS, then goes to w2, while
    // w1's held request still runs (a held request lasts up to 10 s in the fake).
    let r = pool.chat(&conversation("sailing", 2), &[]);
    let waited: u64 = r
        .header("x-queue-wait-ms")
        .and_then(|v| v.parse().ok())
        .expect("x-queue-wait-ms");
    assert!(
        waited >= WAIT_MS,
        "it waited for its worker first: {waited} ms"
    );
    assert!(waited < 5_000, "but not for the held request: {waited} ms");
    assert_eq!(pool.served(), [2, 2], "turn 2 ran on w2");
    assert_eq!(pool.metric("modelrelay_affinity_waits_total"), 1.0);
    let overridden =
        pool.metric("modelrelay_affinity_routing_total{outcome=\"overridden_by_load\"}");
    assert_eq!(overridden, 1.0);
    for b in &pool.backends {
        b.release();
    }
    for h in holders {
        assert_eq!(h.join().expect("holder").status, 200);
    }
}

#[test]
fn a_request_waiting_for_its_full_worker_goes_there_as_soon_as_a_slot_frees() {
    let pool = Pool::start(&[("AFFINITY_WAIT_MS", "60000")], &[1, 2]);
    pool.chat(&conversation("rowing", 1), &[]);
    assert_eq!(pool.served(), [1, 0]);
    let holders = pool.hold_two();
    let addr = pool.server.addr;
    let turn = std::thread::spawn(move || {
        let body = conversation("rowing", 2).to_string();
        let headers = [("content-type", "application/json")];
        request(addr, "POST", "/v1/chat/completions", Some(&body), &headers)
    });
    wait_until("turn 2 waiting for w1", || {
        let waits = pool.metric("modelrelay_affinity_waits_total");
        (waits == 1.0, format!("waits: {waits}"))
    });
    // w1's held request ends: turn 2 takes that slot, long before its wait would end.
    for b in &pool.backends {
        b.release();
    }
    let r = turn.join().expect("turn 2");
    assert_eq!(r.status, 200, "{}", r.text());
    assert!(cache_hit(&r), "turn 2 reused w1's cache: {:?}", r.headers);
    assert_eq!(pool.served(), [3, 1], "turn 2 ran on w1");
    let hits = pool.metric("modelrelay_affinity_routing_total{outcome=\"hit\"}");
    assert_eq!(hits, 1.0);
    for h in holders {
        assert_eq!(h.join().expect("holder").status, 200);
    }
}
