//! Two relays sharing one real `redis-server` over TLS (`STATE_URL=rediss://…`), its
//! certificate signed by a throwaway CA made with the `openssl` command and trusted
//! through `STATE_CA_FILE`; a relay that does not trust it says so and keeps serving.
//! Skipped with a message when `redis-server` or `openssl` is not installed, except
//! under CI.
#![cfg(feature = "redis-store")]

mod common;

use std::net::SocketAddr;
use std::path::Path;

use common::pki::Pki;
use common::procs::{tool, Proc, ServerProc};
use common::redis::{scratch_dir, Redis};
use common::{request, wait_until};
use serde_json::{json, Value};

const ADMIN: &str = "store-tls-admin-token";

fn admin(addr: SocketAddr, method: &str, path: &str, body: Option<Value>) -> common::Response {
    common::admin_call(addr, ADMIN, method, path, body)
}

fn store_health(s: &ServerProc) -> Value {
    s.health()["state_store"].clone()
}

/// A relay on `redis` with the admin token and client keys required, trusting `ca`.
fn relay(redis: &Redis, state: &Path, ca: Option<&Path>) -> ServerProc {
    let ca = ca.map(|p| p.to_string_lossy().into_owned());
    let mut env = vec![
        ("MODELRELAY_ADMIN_TOKEN", ADMIN),
        ("MODELRELAY_REQUIRE_API_KEYS", "true"),
    ];
    if let Some(ca) = &ca {
        env.push(("STATE_CA_FILE", ca));
    }
    redis.relay(state, &env)
}

#[test]
fn two_relays_share_keys_over_tls_and_an_untrusted_store_is_reported_not_fatal() {
    if !tool("redis-server") || !tool("openssl") {
        return;
    }
    let dir = scratch_dir("store-tls-two");
    let trusted = Pki::new(&dir, "trusted").dir;
    let redis = Redis::start_tls(&trusted);
    assert!(redis.url().starts_with("rediss://"));
    let ca = trusted.join("ca.pem");
    let (a, b) = (
        relay(&redis, &dir.join("a"), Some(&ca)),
        relay(&redis, &dir.join("b"), Some(&ca)),
    );
    a.proc.wait_line("over TLS (CA from STATE_CA_FILE)");

    // A key created on A answers on B: both reached the store through TLS.
    let created = admin(a.addr, "POST", "/admin/keys", Some(json!({"name": "tls"})));
    assert_eq!(created.status, 201, "{}", created.text());
    let created = created.json();
    let (id, secret) = (
        created["id"].as_str().expect("id"),
        created["key"].as_str().expect("key"),
    );
    wait_until("B to follow the shared keys", || {
        let listed = admin(b.addr, "GET", "/admin/keys", None).json();
        let found = listed["keys"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|k| k["id"] == id);
        (found, listed.to_string())
    });
    let auth = format!("Bearer {secret}");
    let models = request(
        b.addr,
        "GET",
        "/v1/models",
        None,
        &[("authorization", &auth)],
    );
    assert_eq!(models.status, 200, "{}", models.text());
    for s in [&a, &b] {
        assert_eq!(store_health(s)["reachable"], true);
    }

    // Another CA, and no CA file at all (the bundled web roots): the store's
    // certificate does not verify; each relay logs why, reports the store unreachable
    // and keeps answering.
    let other = Pki::new(&dir, "other").dir.join("ca.pem");
    for (name, ca) in [("wrong", Some(other.as_path())), ("roots", None)] {
        let c = relay(&redis, &dir.join(name), ca);
        let refused = admin(c.addr, "POST", "/admin/keys", Some(json!({"name": "x"})));
        assert_eq!(refused.status, 500, "{}", refused.text());
        let line = c.proc.wait_line("state store unreachable");
        assert!(line.contains("certificate"), "{line}");
        assert_eq!(store_health(&c)["reachable"], false);
        assert_eq!(c.health()["status"], "ok", "{}", c.health());
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// The relay refuses to start, with a log line containing `needle`.
fn refused_at_start(env: &[(&str, String)], needle: &str) {
    let mut env = env.to_vec();
    env.push(("WORKER_SECRET", "secret".into()));
    env.push(("LISTEN_ADDR", "127.0.0.1:0".into()));
    let mut p = Proc::spawn(env!("CARGO_BIN_EXE_modelrelay-server"), &env);
    assert!(!p.wait_exit().success());
    assert!(p.log().contains(needle), "{}", p.log());
}

#[test]
fn a_ca_file_that_cannot_be_used_is_a_start_up_error() {
    let dir = scratch_dir("store-tls-bad");
    let state = ("STATE_DIR", dir.to_string_lossy().into_owned());
    let url = ("STATE_URL", "rediss://127.0.0.1:1/0".to_string());
    let missing = dir.join("missing.pem").to_string_lossy().into_owned();
    refused_at_start(
        &[state.clone(), url.clone(), ("STATE_CA_FILE", missing)],
        "STATE_CA_FILE",
    );
    let empty = dir.join("empty.pem");
    std::fs::write(&empty, "not a certificate\n").expect("file");
    let empty = empty.to_string_lossy().into_owned();
    refused_at_start(
        &[state.clone(), url, ("STATE_CA_FILE", empty.clone())],
        "no PEM certificate",
    );
    let insecure = ("STATE_URL", "rediss://127.0.0.1:1/0#insecure".to_string());
    refused_at_start(&[state.clone(), insecure], "#insecure is not supported");
    let plain = ("STATE_URL", "redis://127.0.0.1:1/0".to_string());
    refused_at_start(
        &[state, plain, ("STATE_CA_FILE", empty)],
        "STATE_URL is not rediss://",
    );
    let _ = std::fs::remove_dir_all(&dir);
}
