//! Issue 12 through the real server: `/v1/capabilities` from what workers report, model
//! load / unload / flush carried to fake workers that speak the lifecycle extension,
//! and who may start them (admin token, op tokens, replay).

mod common;

use std::net::SocketAddr;

use common::*;
use modelrelay::protocol::lifecycle::OperationKind;
use modelrelay::protocol::ServerMessage;
#[cfg(feature = "governance")]
use modelrelay::server::lifecycle::governance::{self, mint, KeySet, OpToken};
use serde_json::{json, Value};

fn lifecycle_worker(addr: SocketAddr, name: &str, models: &[&str], loaded: &[&str]) -> FakeWorker {
    let register = json!({
        "type": "register", "worker_name": name, "models": models, "max_concurrent": 2,
        "protocol_version": "1", "features": ["lifecycle"], "loaded_models": loaded,
        "backend_kind": "ollama",
        "model_info": {"m": {"context_length": 8192, "capabilities": ["completion", "tools"]}}
    });
    match FakeWorker::try_connect(addr, "/v1/worker/connect", Some(SECRET), register) {
        Upgrade::Ok(w) => w,
        Upgrade::Refused(s) => panic!("refused {s}"),
    }
}

fn admin(addr: SocketAddr, method: &str, path: &str, body: Option<Value>) -> Response {
    common::admin_call(addr, ADMIN_TOKEN, method, path, body)
}

/// The next `model_operation` the worker receives: (operation id, kind, model).
fn next_operation(w: &FakeWorker) -> (String, OperationKind, Option<String>) {
    loop {
        if let ServerMessage::ModelOperation(op) = w.recv() {
            return (op.operation_id, op.operation, op.model);
        }
    }
}

fn status(w: &FakeWorker, id: &str, status: &str, progress: Option<f64>, message: Option<&str>) {
    w.send(
        json!({"type": "operation_status", "operation_id": id, "status": status,
                  "progress": progress, "message": message, "backend": "ollama"}),
    );
}

#[test]
fn capabilities_describe_every_runner_and_the_pool() {
    let server = TestServer::start_admin(|_| {});
    let _a = lifecycle_worker(server.addr, "gpu-a", &["m", "n"], &["m"]);
    let _b = FakeWorker::connect(server.addr, &["legacy"], 1);
    server.wait_health("two workers", |h| h["workers_connected"] == 2);
    let r = request(server.addr, "GET", "/v1/capabilities", None, &[]);
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    let runners = v["runners"].as_array().expect("runners");
    assert_eq!(runners.len(), 2);
    let a = runners
        .iter()
        .find(|r| r["runnerId"] == "gpu-a")
        .expect("gpu-a");
    assert_eq!(a["runnerType"], "ollama");
    assert_eq!(a["models"]["loaded"][0]["id"], "m");
    assert_eq!(a["models"]["loaded"][0]["contextLength"], 8192);
    assert_eq!(a["models"]["available"], json!(["n"]));
    assert_eq!(a["capabilities"]["functionCalling"], true);
    assert_eq!(a["capabilities"]["visionInput"], false);
    assert_eq!(a["lifecycle"], true);
    assert_eq!(
        a["resources"]["gpuMemoryTotalMB"],
        Value::Null,
        "unknown stays null"
    );
    let legacy = runners
        .iter()
        .find(|r| r["runnerId"] == "fake")
        .expect("legacy");
    assert_eq!(legacy["runnerType"], Value::Null);
    assert_eq!(legacy["capabilities"]["visionInput"], Value::Null);
    assert_eq!(legacy["lifecycle"], false);
    assert_eq!(v["models"]["loaded"], json!(["m"]));
    assert_eq!(v["models"]["available"], json!(["legacy", "n"]));
    assert_eq!(v["queue"]["depth"], 0);
    assert_eq!(v["queue"]["maxDepth"], 100);
    assert_eq!(v["health"], "healthy");
    let one = request(
        server.addr,
        "GET",
        "/v1/capabilities?runner=gpu-a",
        None,
        &[],
    );
    assert_eq!(one.json()["runnerId"], "gpu-a");
    let none = request(
        server.addr,
        "GET",
        "/v1/capabilities?runner=nope",
        None,
        &[],
    );
    assert_eq!(none.status, 404);
    assert_eq!(none.json()["error"]["code"], "runner_not_found");
}

#[test]
fn load_runs_on_the_runner_without_the_model_and_routing_sees_it() {
    let server = TestServer::start_admin(|_| {});
    let a = lifecycle_worker(server.addr, "gpu-a", &["m"], &["m"]);
    let b = lifecycle_worker(server.addr, "gpu-b", &["m"], &[]);
    server.wait_health("two workers", |h| h["workers_connected"] == 2);
    let r = admin(
        server.addr,
        "POST",
        "/v1/models/load",
        Some(json!({"modelId": "m"})),
    );
    assert_eq!(r.status, 202, "{}", r.text());
    let task = r.json()["taskId"].as_str().expect("taskId").to_string();
    assert_eq!(r.json()["status"], "loading");
    let (op, kind, model) = next_operation(&b);
    assert_eq!((kind, model.as_deref()), (OperationKind::Load, Some("m")));
    status(&b, &op, "running", Some(0.5), Some("pulling"));
    let path = format!("/v1/models/load/{task}");
    wait_until("progress 0.5", || {
        let v = request(server.addr, "GET", &path, None, &[]).json();
        (v["progress"] == 0.5, v.to_string())
    });
    let caps = request(
        server.addr,
        "GET",
        "/v1/capabilities?runner=gpu-b",
        None,
        &[],
    )
    .json();
    assert_eq!(caps["models"]["loading"][0]["id"], "m");
    status(&b, &op, "completed", None, None);
    wait_until("completed", || {
        let v = request(server.addr, "GET", &path, None, &[]).json();
        (v["status"] == "completed", v.to_string())
    });
    let workers = server.workers();
    let gpu_b = workers
        .iter()
        .find(|w| w["name"] == "gpu-b")
        .expect("gpu-b");
    assert_eq!(gpu_b["loaded_models"], json!(["m"]));
    drop(a);
}

#[test]
fn unload_and_flush_answer_when_done_and_refusals_name_the_cause() {
    let server = TestServer::start_admin(|_| {});
    let a = lifecycle_worker(server.addr, "gpu-a", &["m"], &["m"]);
    let _legacy = FakeWorker::connect(server.addr, &["old"], 1);
    server.wait_health("two workers", |h| h["workers_connected"] == 2);
    let auth = format!("Bearer {ADMIN_TOKEN}");
    let mut pending = send_request(
        server.addr,
        "POST",
        "/v1/models/unload",
        Some(r#"{"modelId":"m"}"#),
        &[("authorization", &auth)],
    );
    let (op, kind, _) = next_operation(&a);
    assert_eq!(kind, OperationKind::Unload);
    status(&a, &op, "completed", None, None);
    let r = read_response(&mut pending);
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["status"], "completed");

    let mut pending = send_request(
        server.addr,
        "POST",
        "/v1/cache/flush",
        Some(r#"{"scope":"tenant","tenantId":"team-a","runner":"gpu-a"}"#),
        &[("authorization", &auth)],
    );
    let (op, kind, model) = next_operation(&a);
    assert_eq!((kind, model), (OperationKind::Flush, None));
    status(
        &a,
        &op,
        "not_supported",
        None,
        Some("ollama has no cache API"),
    );
    let r = read_response(&mut pending);
    assert_eq!(r.status, 501, "{}", r.text());
    let e = r.json();
    assert_eq!(e["error"]["code"], "not_supported");
    assert!(e["error"]["message"]
        .as_str()
        .is_some_and(|m| m.contains("gpu-a (ollama): ollama has no cache API")));

    let r = admin(
        server.addr,
        "POST",
        "/v1/models/load",
        Some(json!({"modelId": "old"})),
    );
    assert_eq!(r.status, 501);
    assert!(r.text().contains("fake (unknown backend)"), "{}", r.text());
    let r = admin(
        server.addr,
        "POST",
        "/v1/models/load",
        Some(json!({"modelId": "zzz"})),
    );
    assert_eq!(r.status, 404);
    let r = admin(server.addr, "POST", "/v1/models/load", Some(json!({})));
    assert_eq!(r.status, 400);
    let r = request(
        server.addr,
        "POST",
        "/v1/models/load",
        Some(r#"{"modelId":"m"}"#),
        &[],
    );
    assert_eq!(r.status, 401, "no admin token, no op token");
    let r = request(server.addr, "GET", "/v1/models/load/load-999", None, &[]);
    assert_eq!(r.status, 404);
}

#[test]
#[cfg(feature = "governance")]
fn op_tokens_govern_operations_and_are_used_once() {
    let dir = std::env::temp_dir().join(format!("mr-lifecycle-gov-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("dir");
    let key_file = dir.join("op.key");
    std::fs::write(&key_file, "a-shared-governance-key-of-at-least-32-bytes").expect("key");
    let key_path = key_file.to_string_lossy().into_owned();
    let state = dir.join("state");
    let server = TestServer::start_admin(|c| {
        c.state_dir = state;
        c.governance =
            governance::Config::new(Some(&key_path), true, None, 1).expect("governance config");
    });
    let a = lifecycle_worker(server.addr, "gpu-a", &["m"], &[]);
    server.wait_health("worker", |h| h["workers_connected"] == 1);

    let r = admin(
        server.addr,
        "POST",
        "/v1/models/load",
        Some(json!({"modelId": "m"})),
    );
    assert_eq!(
        r.status, 401,
        "REQUIRE_OP_TOKEN: the admin token alone is not enough"
    );
    assert_eq!(r.json()["error"]["code"], "op_token_missing");

    let keys = KeySet::load(&key_file).expect("keys");
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock")
        .as_secs();
    let claims = |model: &str, nonce: &str| OpToken {
        operation: "model-load".into(),
        model_id: model.into(),
        issued_at: now,
        signers: vec!["ops".into()],
        nonce: nonce.into(),
    };
    let token = mint::sign(&keys, &claims("m", "nonce-0001")).expect("token");
    let body = json!({"modelId": "m", "verifiedOpToken": token});
    let r = request(
        server.addr,
        "POST",
        "/v1/models/load",
        Some(&body.to_string()),
        &[],
    );
    assert_eq!(r.status, 202, "{}", r.text());
    let (op, ..) = next_operation(&a);
    status(&a, &op, "completed", None, None);
    let again = request(
        server.addr,
        "POST",
        "/v1/models/load",
        Some(&body.to_string()),
        &[],
    );
    assert_eq!(again.status, 401);
    assert_eq!(again.json()["error"]["code"], "op_token_replayed");
    let other = mint::sign(&keys, &claims("other", "nonce-0002")).expect("token");
    let r = request(
        server.addr,
        "POST",
        "/v1/models/load",
        Some(r#"{"modelId":"m"}"#),
        &[("x-op-token", &other)],
    );
    assert_eq!(r.status, 403);
    assert_eq!(r.json()["error"]["code"], "op_token_model_mismatch");
    let _ = std::fs::remove_dir_all(&dir);
}

fn described_worker(addr: SocketAddr, name: &str, caps: &[&str]) -> FakeWorker {
    let register = json!({
        "type": "register", "worker_name": name, "models": ["m"], "max_concurrent": 4,
        "protocol_version": "1", "backend_kind": "ollama",
        "model_info": {"m": {"context_length": null, "capabilities": caps}}
    });
    match FakeWorker::try_connect(addr, "/v1/worker/connect", Some(SECRET), register) {
        Upgrade::Ok(w) => w,
        Upgrade::Refused(s) => panic!("refused {s}"),
    }
}

const IMAGE_CHAT: &str = r#"{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"what is it"},{"type":"image_url","image_url":{"url":"data:image/png;base64,AA"}}]}]}"#;

#[test]
fn images_go_only_to_vision_models_and_are_refused_at_once_when_none_has_it() {
    let server = TestServer::start_admin(|_| {});
    let text_only = described_worker(server.addr, "text", &["completion"]);
    server.wait_health("one worker", |h| h["workers_connected"] == 1);
    let r = post(server.addr, "/v1/chat/completions", IMAGE_CHAT);
    assert_eq!(r.status, 400, "{}", r.text());
    assert_eq!(r.json()["error"]["code"], "unsupported_capability");
    let r = post(
        server.addr,
        "/v1/embeddings",
        r#"{"model":"m","input":"hi"}"#,
    );
    assert_eq!(r.status, 400, "{}", r.text());

    let vision = described_worker(server.addr, "eyes", &["completion", "vision"]);
    server.wait_health("two workers", |h| h["workers_connected"] == 2);
    for _ in 0..3 {
        let mut pending = open_chat_body(server.addr, IMAGE_CHAT);
        let req = vision.request();
        vision.complete(&req.request_id, 200, &openai_answer("a cat"));
        assert_eq!(read_response(&mut pending).status, 200);
    }
    drop(text_only);
}

fn open_chat_body(addr: SocketAddr, body: &str) -> std::net::TcpStream {
    send_request(
        addr,
        "POST",
        "/v1/chat/completions",
        Some(body),
        &[("content-type", "application/json")],
    )
}
