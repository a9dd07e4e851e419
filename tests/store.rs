//! Two relays (the real server binary twice) sharing one real `redis-server`
//! (`STATE_URL`): rate limits exact across relays, an op token spent on one refused on
//! the other, and what each relay does while Redis is gone and after it is back.
//! Skipped with a message when `redis-server` is not installed, except under CI.
#![cfg(all(feature = "redis-store", feature = "governance"))]

mod common;

use std::net::SocketAddr;
use std::path::Path;

use common::procs::{tool, ServerProc};
use common::redis::{scratch_dir, Redis};
use common::{chat_as, request, wait_until, FakeWorker, Seen};
use modelrelay::protocol::ServerMessage;
use modelrelay::server::lifecycle::governance::keys::KeySet;
use modelrelay::server::lifecycle::governance::mint;
use modelrelay::server::lifecycle::governance::token::OpToken;
use serde_json::{json, Value};

const KEY: &str = "a-shared-governance-key-of-at-least-32-bytes";

/// Two relays on `redis`, governed by op tokens, with `teama` and `teamb` limited to
/// 60 an hour (not a minute: a slow machine must not see a unit come back mid-test).
fn relays(redis: &Redis, dir: &std::path::Path) -> (ServerProc, ServerProc) {
    let key = dir.join("op.key");
    std::fs::write(&key, KEY).expect("key");
    let key = key.to_string_lossy().into_owned();
    let start = |name: &str| {
        redis.relay(
            &dir.join(name),
            &[
                ("VERIFIED_OP_TOKEN_KEY_PATH", &key),
                ("TENANT_RATE_LIMIT_teama", "60req/h"),
                ("TENANT_RATE_LIMIT_teamb", "60req/h"),
                // Limited, so that its requests reach the store (and reconnect to it).
                ("TENANT_RATE_LIMIT_probe", "1000000req/min"),
            ],
        )
    };
    let (a, b) = (start("a"), start("b"));
    answer_all(a.addr);
    answer_all(b.addr);
    a.wait_workers(1);
    b.wait_workers(1);
    (a, b)
}

/// A worker on `relay` that answers every request at once, until the relay is gone.
fn answer_all(relay: SocketAddr) {
    let worker = FakeWorker::connect(relay, &["m"], 8);
    std::thread::spawn(move || loop {
        match worker.next_seen(std::time::Duration::from_secs(120)) {
            Some(Seen::Msg(ServerMessage::Request(r))) => worker.complete(&r.request_id, 200, "{}"),
            Some(Seen::Msg(_)) => {}
            Some(Seen::Closed(_)) | None => return,
        }
    });
}

/// Of 100 requests alternating between `a` and `b`, how many were admitted.
fn admitted_of_100(a: &ServerProc, b: &ServerProc, tenant: &str) -> usize {
    (0..100)
        .filter(|i| {
            let addr = if i % 2 == 0 { a.addr } else { b.addr };
            chat_as(addr, tenant) != 429
        })
        .count()
}

fn load(addr: SocketAddr, token: &str) -> (u16, Value) {
    let body = json!({"modelId": "m", "verifiedOpToken": token});
    let r = request(
        addr,
        "POST",
        "/v1/models/load",
        Some(&body.to_string()),
        &[],
    );
    let code = r.json()["error"]["code"].clone();
    (r.status, code)
}

fn token(nonce: &str, dir: &std::path::Path) -> String {
    let keys = KeySet::load(&dir.join("op.key")).expect("keys");
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock")
        .as_secs();
    let claims = OpToken {
        operation: "model-load".into(),
        model_id: "m".into(),
        issued_at: now,
        signers: vec!["ops".into()],
        nonce: nonce.into(),
    };
    mint::sign(&keys, &claims).expect("token")
}

/// A fresh token is accepted by `first` and then refused as replayed by `second`.
fn spent_then_replayed(first: &ServerProc, second: &ServerProc, nonce: &str, dir: &Path) {
    let t = token(nonce, dir);
    let (status, code) = load(first.addr, &t);
    assert!(
        !code.as_str().unwrap_or("").starts_with("op_token"),
        "the first relay accepts the token: {status} {code}"
    );
    assert_eq!(load(second.addr, &t), (401, json!("op_token_replayed")));
}

fn store_health(s: &ServerProc) -> Value {
    s.health()["state_store"].clone()
}

#[test]
fn two_relays_share_limits_and_nonces_and_survive_an_outage() {
    if !tool("redis-server") {
        return;
    }
    let dir = scratch_dir("store-two");
    let mut redis = Redis::start();
    let (a, b) = relays(&redis, &dir);

    // Limits: one bucket for both relays.
    assert_eq!(admitted_of_100(&a, &b, "teama"), 60);

    // Op tokens: spent on A, refused on B.
    spent_then_replayed(&a, &b, "nonce-store-0001", &dir);
    assert_eq!(store_health(&a)["reachable"], true);

    // Redis gone: governed calls refused, limits fall back to each relay's own.
    redis.stop();
    let (status, code) = load(b.addr, &token("nonce-store-0002", &dir));
    assert_eq!(status, 503, "no replay store, no governed call: {code}");
    assert_eq!(store_health(&b)["reachable"], false);
    assert_ne!(chat_as(a.addr, "teamb"), 429, "admitted by A's own limiter");
    assert_eq!(store_health(&a)["reachable"], false);
    a.proc.wait_line("state store unreachable");
    let metrics = request(a.addr, "GET", "/metrics", None, &[]).text();
    assert!(
        metrics.contains("\nmodelrelay_state_store_up 0\n"),
        "{metrics}"
    );
    assert!(metrics.contains("\nmodelrelay_state_store_round_trip_seconds_count "));

    // Back: exact again once each relay has reconnected.
    redis.restart();
    for s in [&a, &b] {
        wait_until("the relay to reach the store again", || {
            let _ = chat_as(s.addr, "probe");
            let h = store_health(s);
            (h["reachable"] == true, h.to_string())
        });
        s.proc.wait_line("state store reachable again");
    }
    assert_eq!(admitted_of_100(&a, &b, "teamb"), 60);
    spent_then_replayed(&b, &a, "nonce-store-0003", &dir);
    let _ = std::fs::remove_dir_all(&dir);
}

const ADMIN: &str = "store-admin-token";

/// Relays A and B on `redis` with the admin token (state in `dir/a`, `dir/b`).
fn admin_relays(redis: &Redis, dir: &Path, extra: &[(&str, &str)]) -> (ServerProc, ServerProc) {
    let mut env = vec![("MODELRELAY_ADMIN_TOKEN", ADMIN)];
    env.extend_from_slice(extra);
    (
        redis.relay(&dir.join("a"), &env),
        redis.relay(&dir.join("b"), &env),
    )
}

fn admin(addr: SocketAddr, method: &str, path: &str, body: Option<Value>) -> common::Response {
    common::admin_call(addr, ADMIN, method, path, body)
}

/// `GET /v1/models` with a client key: 200 when the relay knows it, 401 when not.
fn models_with(addr: SocketAddr, secret: &str) -> u16 {
    let auth = format!("Bearer {secret}");
    request(addr, "GET", "/v1/models", None, &[("authorization", &auth)]).status
}

/// Waits until `relay` lists key `id` with `revoked`.
fn wait_for_key(relay: &ServerProc, id: &str, revoked: bool) {
    wait_until("the relay to follow the shared keys", || {
        let listed = admin(relay.addr, "GET", "/admin/keys", None).json();
        let found = listed["keys"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|k| k["id"] == id && k["revoked"] == revoked);
        (found, listed.to_string())
    });
}

#[test]
fn a_key_created_on_one_relay_works_on_the_other_and_revocation_follows() {
    if !tool("redis-server") {
        return;
    }
    let dir = scratch_dir("store-keys");
    let mut redis = Redis::start();
    let (a, b) = admin_relays(&redis, &dir, &[("MODELRELAY_REQUIRE_API_KEYS", "true")]);

    let created = admin(a.addr, "POST", "/admin/keys", Some(json!({"name": "ci"})));
    assert_eq!(created.status, 201, "{}", created.text());
    let created = created.json();
    let (id, secret) = (
        created["id"].as_str().unwrap(),
        created["key"].as_str().unwrap(),
    );
    // Waits on the admin list (probing with the secret would trip the relay's limit on
    // failed authentications).
    wait_for_key(&b, id, false);
    assert_eq!(models_with(b.addr, secret), 200);
    // Hashed at rest: the secret is nowhere in Redis's copy (checked through B's file).
    let file = std::fs::read_to_string(dir.join("b").join("keys.json")).expect("local copy");
    assert!(!file.contains(secret) && file.contains(id));

    // Revoked on B: A refuses it once it has followed.
    let revoked_at = std::time::Instant::now();
    assert_eq!(
        admin(b.addr, "DELETE", &format!("/admin/keys/{id}"), None).status,
        200
    );
    wait_for_key(&a, id, true);
    assert_eq!(models_with(a.addr, secret), 401);
    eprintln!(
        "revocation reached the other relay in {:?}",
        revoked_at.elapsed()
    );

    // Redis gone: keys keep authenticating from each relay's copy; changes are refused.
    let second = admin(a.addr, "POST", "/admin/keys", Some(json!({"name": "two"}))).json();
    let secret2 = second["key"].as_str().unwrap().to_string();
    wait_for_key(&b, second["id"].as_str().unwrap(), false);
    redis.stop();
    wait_until("B to notice the store is gone", || {
        let h = store_health(&b);
        (h["reachable"] == false, h.to_string())
    });
    assert_eq!(models_with(a.addr, &secret2), 200);
    assert_eq!(models_with(b.addr, &secret2), 200);
    assert_eq!(models_with(b.addr, secret), 401);
    let refused = admin(
        a.addr,
        "POST",
        "/admin/keys",
        Some(json!({"name": "three"})),
    );
    assert_eq!(refused.status, 500, "{}", refused.text());

    // Back, but empty (no persistence): the relays offer their keys again instead of
    // taking the empty list for the fleet's.
    redis.restart();
    let third = wait_for_created(&b, "three");
    wait_for_key(&a, &third, false);
    wait_for_key(&a, second["id"].as_str().unwrap(), false);
    assert_eq!(models_with(a.addr, &secret2), 200);
    assert_eq!(models_with(b.addr, &secret2), 200);
    assert_eq!(models_with(a.addr, secret), 401);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Creates key `name` on `relay` once it reaches the store again; its id.
fn wait_for_created(relay: &ServerProc, name: &str) -> String {
    let mut id = String::new();
    wait_until("a key created once the store is back", || {
        let r = admin(
            relay.addr,
            "POST",
            "/admin/keys",
            Some(json!({"name": name})),
        );
        id = r.json()["id"].as_str().unwrap_or("").to_string();
        (r.status == 201, r.text())
    });
    id
}

/// `POST /dashboard/api/models/refresh` with `cookie`: whether the session was accepted.
#[cfg(feature = "dashboard")]
fn signed_in(addr: SocketAddr, cookie: &str) -> bool {
    let r = request(
        addr,
        "POST",
        "/dashboard/api/models/refresh",
        Some("{}"),
        &[("cookie", cookie), ("origin", "http://localhost")],
    );
    r.status != 401
}

#[cfg(feature = "dashboard")]
#[test]
fn a_dashboard_sign_in_on_one_relay_holds_on_the_other_until_signed_out() {
    if !tool("redis-server") {
        return;
    }
    let dir = scratch_dir("store-sessions");
    let redis = Redis::start();
    let (a, b) = admin_relays(&redis, &dir, &[]);
    let r = request(
        a.addr,
        "POST",
        "/dashboard/signin",
        Some(&json!({ "token": ADMIN }).to_string()),
        &[("content-type", "application/json")],
    );
    assert_eq!(r.status, 200, "{}", r.text());
    let cookie = r
        .header("set-cookie")
        .and_then(|c| c.split(';').next())
        .expect("cookie")
        .to_string();
    assert!(signed_in(a.addr, &cookie));
    // B may still be connecting to the store when A signs in: wait for it to know.
    wait_until("B to know A's session", || {
        (signed_in(b.addr, &cookie), String::new())
    });
    assert!(!signed_in(b.addr, "modelrelay_session=00ff"));

    let out = request(
        b.addr,
        "POST",
        "/dashboard/signout",
        None,
        &[("cookie", &cookie), ("origin", "http://localhost")],
    );
    assert!(out.status < 400, "{}", out.text());
    assert!(!signed_in(b.addr, &cookie));
    wait_until("A to follow the sign-out on B", || {
        (!signed_in(a.addr, &cookie), String::new())
    });
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_load_started_on_one_relay_is_polled_on_the_other() {
    if !tool("redis-server") {
        return;
    }
    let dir = scratch_dir("store-tasks");
    let redis = Redis::start();
    let (a, b) = admin_relays(&redis, &dir, &[]);
    let register = json!({
        "type": "register", "worker_name": "gpu", "models": ["m"], "max_concurrent": 1,
        "protocol_version": "1", "features": ["lifecycle"], "loaded_models": [],
    });
    let worker =
        match FakeWorker::try_connect(a.addr, "/v1/worker/connect", Some(common::SECRET), register)
        {
            common::Upgrade::Ok(w) => w,
            common::Upgrade::Refused(s) => panic!("refused {s}"),
        };
    a.wait_workers(1);
    let r = admin(
        a.addr,
        "POST",
        "/v1/models/load",
        Some(json!({"modelId": "m"})),
    );
    assert_eq!(r.status, 202, "{}", r.text());
    let task = r.json()["taskId"].as_str().expect("taskId").to_string();
    let path = format!("/v1/models/load/{task}");
    let on_b = |what: &str, field: &str, want: Value| {
        wait_until(what, || {
            let r = request(b.addr, "GET", &path, None, &[]);
            (r.status == 200 && r.json()[field] == want, r.text())
        });
    };
    on_b("B to see the task", "status", json!("loading"));
    let op = loop {
        if let ServerMessage::ModelOperation(op) = worker.recv() {
            break op.operation_id;
        }
    };
    let status = |status: &str, progress: Option<f64>| {
        worker.send(
            json!({"type": "operation_status", "operation_id": op, "status": status,
                           "progress": progress, "backend": "ollama"}),
        );
    };
    status("running", Some(0.5));
    on_b("B to see its progress", "progress", json!(0.5));
    status("completed", None);
    on_b("B to see it completed", "status", json!("completed"));
    let unknown = request(b.addr, "GET", "/v1/models/load/load-1", None, &[]);
    assert_eq!(unknown.status, 404, "{}", unknown.text());
    let _ = std::fs::remove_dir_all(&dir);
}
