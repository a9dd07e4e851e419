//! Cache affinity across relays, with real binaries: two relays, two workers serving
//! both (each with its own fake backend, answering with its box's name). A
//! conversation's first turn goes to one relay, its next turn to the other, which has
//! never seen it: the worker that ran the first turn passed its prefixes on, so the
//! second relay sends the next turn to the same box.

mod common;
#[path = "../examples/support/fake_backend.rs"]
mod fake_backend;

use common::procs::{start_worker, Proc, ServerProc};
use common::*;
use fake_backend::FakeBackend;
use serde_json::{json, Value};

const ADMIN: &str = "relays-affinity-admin";

fn admin_relay(tag: &str) -> ServerProc {
    let state = std::env::temp_dir().join(format!(
        "modelrelay-relays-affinity-{}-{tag}",
        std::process::id()
    ));
    let state = state.to_string_lossy().into_owned();
    ServerProc::start(&[
        ("MODELRELAY_ADMIN_TOKEN", ADMIN),
        ("STATE_DIR", state.as_str()),
    ])
}

/// The fingerprints `relay` holds for the worker named `name`.
fn held(relay: &ServerProc, name: &str) -> u64 {
    let r = admin_call(relay.addr, ADMIN, "GET", "/admin/workers", None);
    assert_eq!(r.status, 200, "{}", r.text());
    r.json()["workers"]
        .as_array()
        .and_then(|ws| ws.iter().find(|w| w["name"] == name).cloned())
        .and_then(|w| w["affinity_fingerprints"].as_u64())
        .unwrap_or(0)
}

/// Sends the conversation so far to `relay`; the box that answered (`box-a`/`box-b`).
fn turn(relay: &ServerProc, messages: &[Value]) -> String {
    let body = json!({"model": "m", "messages": messages}).to_string();
    let r = post(relay.addr, "/v1/chat/completions", &body);
    assert_eq!(r.status, 200, "{}", r.text());
    r.json()["choices"][0]["message"]["content"]
        .as_str()
        .unwrap_or_default()
        .to_string()
}

#[test]
fn a_later_turn_through_another_relay_goes_back_to_the_box_that_ran_the_first() {
    let (a, b) = (admin_relay("a"), admin_relay("b"));
    let urls = format!("http://{},http://{}", a.addr, b.addr);
    let _workers: Vec<Proc> = ["box-a", "box-b"]
        .iter()
        .map(|name| {
            let backend = FakeBackend::new("m", name)
                .spawn("127.0.0.1:0")
                .expect("backend");
            start_worker(
                a.addr,
                backend,
                &[("PROXY_URL", &urls), ("MODELS", "m"), ("WORKER_NAME", name)],
            )
        })
        .collect();
    for relay in [&a, &b] {
        wait_until(
            "both workers on both relays, each reporting two relays",
            || {
                let h = relay.health();
                (
                    h["workers_connected"] == 2 && h["relays"] == 2,
                    h.to_string(),
                )
            },
        );
    }
    for c in 0..4 {
        // Long enough to be fingerprinted (512 bytes), its own per conversation.
        let opening = format!("conversation {c}: {}", "tell me more about it. ".repeat(30));
        let mut messages = vec![json!({"role": "user", "content": opening})];
        let before = [held(&b, "box-a"), held(&b, "box-b")];
        let first = turn(&a, &messages);
        let before = before[usize::from(first == "box-b")];
        // The relay that never saw the conversation hears of it from the worker.
        wait_until("the other relay hears the first turn's prefixes", || {
            let now = held(&b, &first);
            (now > before, format!("{first}: {now} held"))
        });
        messages.push(json!({"role": "assistant", "content": first}));
        messages.push(json!({"role": "user", "content": "and then?"}));
        assert_eq!(turn(&b, &messages), first, "conversation {c} moved box");
    }
}
