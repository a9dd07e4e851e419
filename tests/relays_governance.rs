//! Op tokens with several relays and no shared store: a token spent on one relay could
//! be spent again on another, so governance refuses op tokens there unless
//! `OP_TOKENS_PER_RELAY=on`. Real relay and worker binaries, tokens minted by
//! `modelrelay-server sign-op-token`.
#![cfg(feature = "governance")]

mod common;
#[path = "../examples/support/fake_backend.rs"]
mod fake_backend;

use std::path::PathBuf;
use std::process::Command;

use common::procs::{start_worker, Proc, ServerProc};
use common::*;
use fake_backend::FakeBackend;
use serde_json::json;

const KEY: &str = "a-shared-governance-key-of-at-least-32-bytes";

fn temp_dir(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("mr-relays-gov-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("dir");
    dir
}

/// A relay verifying op tokens with the key in `dir`, its state in `dir/<tag>`.
fn governed_relay(dir: &std::path::Path, tag: &str, extra: &[(&str, &str)]) -> ServerProc {
    let key = dir.join("op.key").to_string_lossy().into_owned();
    let state = dir.join(tag).to_string_lossy().into_owned();
    let mut env = vec![
        ("VERIFIED_OP_TOKEN_KEY_PATH", key.as_str()),
        ("STATE_DIR", state.as_str()),
    ];
    env.extend_from_slice(extra);
    ServerProc::start(&env)
}

/// A worker serving every relay in `relays`, with an Ollama-like backend that can load.
fn worker(relays: &[&ServerProc]) -> Proc {
    let backend = FakeBackend::ollama(&["m"], &[], "ok")
        .spawn("127.0.0.1:0")
        .expect("backend");
    let urls: Vec<String> = relays
        .iter()
        .map(|r| format!("http://{}", r.addr))
        .collect();
    start_worker(relays[0].addr, backend, &[("PROXY_URL", &urls.join(","))])
}

fn wait_relays_reported(relay: &ServerProc, n: u64) {
    wait_until("the relays the workers report", || {
        let h = relay.health();
        (h["relays"] == n, h.to_string())
    });
}

/// A fresh load token for model `m`, from the built binary.
fn token(dir: &std::path::Path) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_modelrelay-server"))
        .args(["sign-op-token", "--operation", "load", "--model", "m"])
        .args(["--signer", "ops", "--key-path"])
        .arg(dir.join("op.key"))
        .env_remove("VERIFIED_OP_TOKEN_KEY_PATH")
        .output()
        .expect("sign-op-token");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout)
        .expect("utf-8")
        .trim()
        .to_string()
}

/// A model load carrying a fresh op token (no admin token).
fn load(relay: &ServerProc, dir: &std::path::Path) -> Response {
    load_with(relay, &token(dir))
}

fn load_with(relay: &ServerProc, token: &str) -> Response {
    let body = json!({"modelId": "m", "verifiedOpToken": token}).to_string();
    request(relay.addr, "POST", "/v1/models/load", Some(&body), &[])
}

fn assert_accepted(relay: &ServerProc, r: &Response) {
    assert!(
        r.status != 401 && r.status != 403 && r.status != 503,
        "{} {}",
        r.status,
        r.text()
    );
    relay
        .proc
        .wait_line("operation=model-load model=\"m\" signers=[ops] outcome=authorized by=op_token");
}

#[test]
fn several_relays_without_a_shared_store_refuse_op_tokens_unless_opted_in() {
    let dir = temp_dir("two");
    std::fs::write(dir.join("op.key"), KEY).expect("key");
    let strict = governed_relay(&dir, "strict", &[]);
    let opted = governed_relay(&dir, "opted", &[("OP_TOKENS_PER_RELAY", "on")]);
    let _worker = worker(&[&strict, &opted]);
    wait_relays_reported(&strict, 2);
    wait_relays_reported(&opted, 2);

    let r = load(&strict, &dir);
    assert_eq!(r.status, 503, "{}", r.text());
    let error = &r.json()["error"];
    assert_eq!(error["code"], "op_tokens_need_shared_store");
    let message = error["message"].as_str().unwrap_or_default();
    assert!(
        message.contains("STATE_URL") && message.contains("OP_TOKENS_PER_RELAY=on"),
        "{message}"
    );

    let r = load(&opted, &dir);
    assert_accepted(&opted, &r);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_single_relay_accepts_op_tokens_as_before() {
    let dir = temp_dir("one");
    std::fs::write(dir.join("op.key"), KEY).expect("key");
    let relay = governed_relay(&dir, "alone", &[]);
    let _worker = worker(&[&relay]);
    relay.wait_workers(1);
    wait_relays_reported(&relay, 1);
    let r = load(&relay, &dir);
    assert_accepted(&relay, &r);
    let _ = std::fs::remove_dir_all(&dir);
}

/// With `STATE_URL` the nonces are shared: several relays accept op tokens, once.
#[cfg(feature = "redis-store")]
#[test]
fn several_relays_sharing_a_store_accept_op_tokens_once() {
    if !common::procs::tool("redis-server") {
        return;
    }
    let dir = temp_dir("shared");
    std::fs::write(dir.join("op.key"), KEY).expect("key");
    let redis = common::redis::Redis::start();
    let url = redis.url();
    let a = governed_relay(&dir, "a", &[("STATE_URL", &url)]);
    let b = governed_relay(&dir, "b", &[("STATE_URL", &url)]);
    let _worker = worker(&[&a, &b]);
    wait_relays_reported(&a, 2);
    wait_relays_reported(&b, 2);
    let t = token(&dir);
    let r = load_with(&a, &t);
    assert_accepted(&a, &r);
    let again = load_with(&b, &t);
    assert_eq!(again.status, 401, "{}", again.text());
    assert_eq!(again.json()["error"]["code"], "op_token_replayed");
    let _ = std::fs::remove_dir_all(&dir);
}
