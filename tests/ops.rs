//! Operating the relay: admin API, client API keys (including a crash during a key-file
//! write), metrics with exact counters, request headers, and secrets kept out of logs.

mod common;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use common::procs::ServerProc;
use common::*;
use modelrelay::protocol::ServerMessage;
use serde_json::{json, Value};

const ADMIN: &str = "admin-token-123";

fn state_dir(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("mr-ops-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

fn admin_server(tag: &str, require_keys: bool) -> TestServer {
    let dir = state_dir(tag);
    TestServer::start_with(move |c| {
        c.admin_token = Some(ADMIN.into());
        c.require_api_keys = require_keys;
        c.state_dir = dir;
    })
}

fn admin(server: &TestServer, method: &str, path: &str, body: Option<&str>) -> Response {
    let auth = format!("Bearer {ADMIN}");
    request(server.addr, method, path, body, &[("authorization", &auth)])
}

fn create_key(server: &TestServer, name: &str) -> (String, String) {
    let r = admin(
        server,
        "POST",
        "/admin/keys",
        Some(&json!({"name": name}).to_string()),
    );
    assert_eq!(r.status, 201, "{}", r.text());
    let v = r.json();
    (
        v["id"].as_str().unwrap().to_string(),
        v["key"].as_str().unwrap().to_string(),
    )
}

#[test]
fn admin_needs_a_configured_and_correct_token() {
    let plain = TestServer::start();
    let r = request(
        plain.addr,
        "GET",
        "/admin/workers",
        None,
        &[("authorization", "Bearer x")],
    );
    assert_eq!(r.status, 403);
    assert_eq!(r.json()["error"]["code"], "admin_disabled");
    let server = admin_server("token", false);
    assert_eq!(
        request(server.addr, "GET", "/admin/workers", None, &[]).status,
        401
    );
    let wrong = request(
        server.addr,
        "GET",
        "/admin/workers",
        None,
        &[("authorization", "Bearer nope")],
    );
    assert_eq!(wrong.status, 401);
    assert_eq!(wrong.json()["error"]["code"], "invalid_admin_token");
    assert_eq!(admin(&server, "GET", "/admin/workers", None).status, 200);
    assert_eq!(admin(&server, "GET", "/admin/nothing", None).status, 404);
}

#[test]
fn admin_workers_lists_every_documented_field() {
    let server = admin_server("workers", false);
    let w = FakeWorker::connect(server.addr, &["m1", "m2"], 3);
    let v = admin(&server, "GET", "/admin/workers", None).json();
    let list = v["workers"].as_array().unwrap();
    assert_eq!(list.len(), 1);
    let info = &list[0];
    assert_eq!(info["id"], w.worker_id.as_str());
    assert_eq!(info["name"], "fake");
    assert_eq!(info["provider"], "local");
    assert_eq!(info["models"], json!(["m1", "m2"]));
    assert_eq!(info["max_concurrent"], 3);
    assert_eq!(info["in_flight"], 0);
    assert_eq!(info["reported_load"], 0);
    assert_eq!(info["draining"], false);
    assert_eq!(info["protocol_version"], "1");
    assert!(info["connected_since_unix"].as_u64().unwrap() > 1_700_000_000);
    assert!(info["last_heartbeat_unix"].as_u64().is_some());
    assert!(info["remote_addr"]
        .as_str()
        .unwrap()
        .starts_with("127.0.0.1:"));
}

#[test]
fn admin_drain_stops_routing_and_closes_the_idle_worker() {
    let server = admin_server("drain", false);
    let w = FakeWorker::connect(server.addr, &["m"], 1);
    assert_eq!(
        admin(&server, "POST", "/admin/workers/w-999/drain", None).status,
        404
    );
    let r = admin(
        &server,
        "POST",
        &format!("/admin/workers/{}/drain", w.worker_id),
        Some(r#"{"drain_timeout_secs":30}"#),
    );
    assert_eq!(r.status, 202, "{}", r.text());
    match w.recv() {
        ServerMessage::GracefulShutdown {
            drain_timeout_secs, ..
        } => assert_eq!(drain_timeout_secs, Some(30)),
        other => panic!("expected graceful_shutdown, got {other:?}"),
    }
    let (code, reason) = w.closed().expect("close frame");
    assert_eq!((code, reason.as_str()), (1000, "drained"));
}

#[test]
fn admin_models_refresh_reaches_every_worker() {
    let server = admin_server("refresh", false);
    let a = FakeWorker::connect(server.addr, &["m"], 1);
    let b = FakeWorker::connect(server.addr, &["m"], 1);
    assert_eq!(
        admin(&server, "POST", "/admin/models/refresh", None).status,
        202
    );
    for w in [&a, &b] {
        assert!(matches!(w.recv(), ServerMessage::ModelsRefresh { .. }));
    }
}

#[test]
fn api_keys_are_required_consumed_counted_and_revoked_at_once() {
    let server = admin_server("keys", true);
    let worker = FakeWorker::connect(server.addr, &["m"], 1);
    // Missing or unknown keys: 401 in the called API's shape.
    let r = post(server.addr, "/v1/chat/completions", &chat("m", false));
    assert_eq!(
        (r.status, r.json()["error"]["code"].as_str()),
        (401, Some("missing_api_key"))
    );
    let r = request(
        server.addr,
        "POST",
        "/v1/messages",
        Some(&chat("m", false)),
        &[("x-api-key", "mr-bogus")],
    );
    assert_eq!(r.status, 401);
    assert_eq!(r.json()["type"], "error");
    assert_eq!(
        request(server.addr, "GET", "/v1/models", None, &[]).status,
        401
    );

    let (id, key) = create_key(&server, "app");
    assert!(key.starts_with("mr-") && key.len() == 67);
    let listed = admin(&server, "GET", "/admin/keys", None);
    assert!(!listed.text().contains(&key), "secrets are never listed");
    assert_eq!(listed.json()["keys"][0]["id"], id.as_str());

    let bearer = format!("Bearer {key}");
    let mut client = send_request(
        server.addr,
        "POST",
        "/v1/chat/completions",
        Some(&chat("m", false)),
        &[("authorization", &bearer)],
    );
    let req = worker.request();
    assert!(
        !req.headers.contains_key("authorization"),
        "the relay key is not forwarded"
    );
    worker.send(json!({"type": "response_complete", "request_id": req.request_id, "status_code": 200, "body": "{}",
        "token_counts": {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}}));
    assert_eq!(read_response(&mut client).status, 200);
    let mut client = send_request(
        server.addr,
        "POST",
        "/v1/messages",
        Some(&chat("m", false)),
        &[("x-api-key", &key)],
    );
    let req = worker.request();
    assert!(!req.headers.contains_key("x-api-key"));
    worker.complete(&req.request_id, 200, "{}");
    assert_eq!(read_response(&mut client).status, 200);
    assert_eq!(
        request(
            server.addr,
            "GET",
            "/v1/models",
            None,
            &[("authorization", &bearer)]
        )
        .status,
        200
    );

    // A request is counted after its last byte is written, so the client can have its
    // answer first: wait until both are counted, then check the figures exactly.
    let mut stats = Value::Null;
    wait_until("both keyed requests counted", || {
        stats = admin(&server, "GET", "/admin/stats", None).json();
        let n = stats["keys"][&id]["requests"].as_u64().unwrap_or(0);
        (n >= 2, format!("keys: {}", stats["keys"]))
    });
    assert_eq!(
        stats["keys"][&id],
        json!({"requests": 2, "tokens_in": 7, "tokens_out": 3})
    );

    assert_eq!(
        admin(&server, "DELETE", &format!("/admin/keys/{id}"), None).status,
        200
    );
    assert_eq!(
        admin(&server, "DELETE", "/admin/keys/key-missing", None).status,
        404
    );
    let r = request(
        server.addr,
        "POST",
        "/v1/chat/completions",
        Some(&chat("m", false)),
        &[("authorization", &bearer)],
    );
    assert_eq!(
        (r.status, r.json()["error"]["code"].as_str()),
        (401, Some("invalid_api_key")),
        "revoked at once"
    );
}

#[test]
fn failed_key_attempts_are_rate_limited_per_ip() {
    let server = admin_server("keylimit", true);
    let statuses: Vec<u16> = (0..11)
        .map(|_| {
            request(
                server.addr,
                "POST",
                "/v1/chat/completions",
                Some(&chat("m", false)),
                &[("authorization", "Bearer mr-x")],
            )
            .status
        })
        .collect();
    assert_eq!(&statuses[..10], &[401; 10]);
    assert_eq!(statuses[10], 429);
}

#[test]
fn responses_carry_request_id_and_queue_wait() {
    let server = TestServer::start();
    let worker = FakeWorker::connect(server.addr, &["m"], 1);
    let mut client = open_chat(server.addr, "m", false);
    let req = worker.request();
    worker.complete(&req.request_id, 200, "{}");
    let r = read_response(&mut client);
    assert_eq!(r.header("x-request-id"), Some(req.request_id.as_str()));
    assert!(r.header("x-queue-wait-ms").unwrap().parse::<u64>().is_ok());
    let r = post(server.addr, "/v1/chat/completions", "{bad");
    assert_eq!(r.status, 400);
}

/// Parses Prometheus text strictly: HELP and TYPE precede samples of each family, every
/// sample line is `name{labels} value`, histogram buckets never decrease.
fn parse_metrics(text: &str) -> BTreeMap<String, f64> {
    let mut samples = BTreeMap::new();
    let mut typed: BTreeMap<String, String> = BTreeMap::new();
    let mut last_bucket: Option<(String, f64)> = None;
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, kind) = rest.split_once(' ').expect("TYPE line");
            assert!(["counter", "gauge", "histogram"].contains(&kind), "{line}");
            assert!(
                typed.insert(name.to_string(), kind.to_string()).is_none(),
                "family declared twice: {name}"
            );
            continue;
        }
        if line.starts_with("# HELP ") {
            continue;
        }
        assert!(
            !line.starts_with('#') && !line.is_empty(),
            "unexpected line {line:?}"
        );
        let (series, value) = line.rsplit_once(' ').expect("sample line");
        let value: f64 = value
            .parse()
            .unwrap_or_else(|_| panic!("bad value in {line:?}"));
        let name = series.split('{').next().unwrap();
        let family = ["_bucket", "_sum", "_count"].iter().fold(name, |n, s| {
            if typed.contains_key(n) {
                n
            } else {
                n.strip_suffix(s).unwrap_or(n)
            }
        });
        assert!(typed.contains_key(family), "sample before its TYPE: {line}");
        if name.ends_with("_bucket") {
            let base = series.split("le=").next().unwrap().to_string();
            if let Some((prev_base, prev)) = &last_bucket {
                if *prev_base == base {
                    assert!(value >= *prev, "bucket decreased: {line}");
                }
            }
            last_bucket = Some((base, value));
        }
        assert!(
            samples.insert(series.to_string(), value).is_none(),
            "duplicate series {series}"
        );
    }
    samples
}

#[test]
fn metrics_count_a_known_mix_of_requests_exactly() {
    let server = admin_server("metrics", false);
    let worker = FakeWorker::connect(server.addr, &["m"], 1);
    // 3 completed (one with token counts), 1 backend 500, 1 client cancel, 1 requeue.
    for i in 0..3 {
        let mut c = open_chat(server.addr, "m", false);
        let req = worker.request();
        let counts = if i == 0 {
            json!({"prompt_tokens": 5, "completion_tokens": 2})
        } else {
            Value::Null
        };
        worker.send(json!({"type": "response_complete", "request_id": req.request_id, "status_code": 200, "body": "{}", "token_counts": counts}));
        assert_eq!(read_response(&mut c).status, 200);
    }
    let mut c = open_chat(server.addr, "m", false);
    let req = worker.request();
    worker.complete(&req.request_id, 500, "{}");
    assert_eq!(read_response(&mut c).status, 500);
    let c = open_chat(server.addr, "m", false);
    worker.request();
    drop(c);
    assert!(matches!(worker.recv(), ServerMessage::Cancel { .. }));
    let mut c = send_request(
        server.addr,
        "POST",
        "/v1/messages",
        Some(&chat("m", false)),
        &[],
    );
    let first = worker.request();
    let second = FakeWorker::connect(server.addr, &["m"], 1);
    worker.kill();
    let again = second.request();
    assert_eq!(again.request_id, first.request_id);
    second.complete(&again.request_id, 200, "{}");
    assert_eq!(read_response(&mut c).status, 200);
    server.wait_health("cancel recorded", |h| h["in_flight"] == 0);
    // The HTTP side counts a request after writing its last byte (or seeing the hangup),
    // so a client can have its answer before the count moves: wait until all six are
    // counted, then check every figure exactly.
    let mut text = String::new();
    wait_until("all six client requests counted", || {
        text = request(server.addr, "GET", "/metrics", None, &[]).text();
        let counted: f64 = parse_metrics(&text)
            .iter()
            .filter(|(k, _)| k.starts_with("modelrelay_requests_total{"))
            .map(|(_, v)| v)
            .sum();
        (counted >= 6.0, format!("{counted} counted in\n{text}"))
    });
    let m = parse_metrics(&text);
    let get = |k: &str| *m.get(k).unwrap_or_else(|| panic!("missing {k} in\n{text}"));
    assert_eq!(
        get(
            r#"modelrelay_requests_total{route="/v1/chat/completions",model="m",status_class="2xx"}"#
        ),
        3.0
    );
    assert_eq!(
        get(
            r#"modelrelay_requests_total{route="/v1/chat/completions",model="m",status_class="5xx"}"#
        ),
        1.0
    );
    assert_eq!(
        get(
            r#"modelrelay_requests_total{route="/v1/chat/completions",model="m",status_class="4xx"}"#
        ),
        1.0,
        "the cancel (499)"
    );
    assert_eq!(
        get(r#"modelrelay_requests_total{route="/v1/messages",model="m",status_class="2xx"}"#),
        1.0
    );
    assert_eq!(
        get(r#"modelrelay_cancels_total{reason="client_disconnect"}"#),
        1.0
    );
    assert_eq!(get("modelrelay_requeues_total"), 1.0);
    assert_eq!(get("modelrelay_dispatched_total"), 7.0);
    assert_eq!(
        get(r#"modelrelay_tokens_total{model="m",direction="in"}"#),
        5.0
    );
    assert_eq!(
        get(r#"modelrelay_tokens_total{model="m",direction="out"}"#),
        2.0
    );
    assert_eq!(get("modelrelay_queue_wait_seconds_count"), 7.0);
    assert_eq!(
        get(r#"modelrelay_request_duration_seconds_count{route="/v1/chat/completions"}"#),
        5.0
    );
    assert_eq!(get("modelrelay_workers_connected"), 1.0);
    assert_eq!(get(r#"modelrelay_worker_slots{state="total"}"#), 1.0);
    assert_eq!(get(r#"modelrelay_worker_slots{state="used"}"#), 0.0);
    assert_eq!(get("modelrelay_in_flight"), 0.0);
    assert_eq!(get("modelrelay_queue_depth"), 0.0);
    assert_eq!(get("modelrelay_heartbeat_timeouts_total"), 0.0);

    let stats = admin(&server, "GET", "/admin/stats", None).json();
    assert_eq!(stats["requests"]["completed"], 5);
    assert_eq!(
        stats["requests"]["cancelled_by_reason"]["client_disconnect"],
        1
    );
    assert_eq!(stats["requests"]["requeued"], 1);
    assert_eq!(stats["tokens_by_model"]["m"], json!({"in": 5, "out": 2}));
    assert!(stats["queue"]["wait_ms"]["p99"].as_f64().is_some());

    if common::procs::tool("promtool") {
        let path = std::env::temp_dir().join(format!("mr-metrics-{}.txt", std::process::id()));
        std::fs::write(&path, &text).unwrap();
        let out = Command::new("sh")
            .arg("-c")
            .arg(format!("promtool check metrics < {}", path.display()))
            .output()
            .unwrap();
        let _ = std::fs::remove_file(&path);
        assert!(
            out.status.success(),
            "promtool: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

#[test]
fn the_key_file_survives_kill_9_during_writes() {
    let dir = state_dir("crash");
    let dir_s = dir.to_string_lossy().to_string();
    let env = [
        ("MODELRELAY_ADMIN_TOKEN", ADMIN),
        ("STATE_DIR", dir_s.as_str()),
    ];
    let mut acknowledged: Vec<(String, String)> = Vec::new();
    for round in 0..5 {
        let mut server = ServerProc::start(&env);
        let addr = server.addr;
        let (tx, rx) = crossbeam_channel::unbounded();
        let writer = std::thread::spawn(move || {
            // Create keys as fast as possible until the server dies under us.
            for n in 0.. {
                let body = json!({"name": format!("k{n}")}).to_string();
                let Ok(mut s) = std::net::TcpStream::connect(addr) else {
                    return;
                };
                use std::io::Write;
                let auth = format!("Bearer {ADMIN}");
                let head = format!("POST /admin/keys HTTP/1.1\r\nhost: localhost\r\nconnection: close\r\nauthorization: {auth}\r\ncontent-length: {}\r\n\r\n{body}", body.len());
                if s.write_all(head.as_bytes()).is_err() {
                    return;
                }
                let mut text = String::new();
                use std::io::Read;
                let _ = s.read_to_string(&mut text);
                if let Some(json_start) = text.find("\r\n\r\n") {
                    if text.starts_with("HTTP/1.1 201") {
                        let v: Value = serde_json::from_str(&text[json_start + 4..]).unwrap();
                        let _ = tx.send((
                            v["id"].as_str().unwrap().to_string(),
                            v["key"].as_str().unwrap().to_string(),
                        ));
                    }
                } else {
                    return;
                }
            }
        });
        // Let some writes land, then kill without warning.
        let target = 20 + round * 7;
        let deadline = std::time::Instant::now() + WAIT;
        while rx.len() < target {
            assert!(
                std::time::Instant::now() < deadline,
                "round {round}: keys were not being created"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
        server.proc.signal("KILL");
        server.proc.wait_exit();
        let _ = writer.join();
        acknowledged.extend(rx.try_iter());
        // Restart: the file must load and hold every key we were told was created.
        let restarted = ServerProc::start(&env);
        let auth = format!("Bearer {ADMIN}");
        let listed = request(
            restarted.addr,
            "GET",
            "/admin/keys",
            None,
            &[("authorization", &auth)],
        )
        .json();
        let ids: Vec<&str> = listed["keys"]
            .as_array()
            .unwrap()
            .iter()
            .map(|k| k["id"].as_str().unwrap())
            .collect();
        for (id, _) in &acknowledged {
            assert!(
                ids.contains(&id.as_str()),
                "round {round}: acknowledged key {id} lost"
            );
        }
        drop(restarted);
    }
    // And the keys work for clients after all that.
    let mut env2 = env.to_vec();
    env2.push(("MODELRELAY_REQUIRE_API_KEYS", "true"));
    let server = ServerProc::start(&env2);
    let (_, key) = acknowledged.last().unwrap();
    let bearer = format!("Bearer {key}");
    let r = request(
        server.addr,
        "GET",
        "/v1/models",
        None,
        &[("authorization", &bearer)],
    );
    assert_eq!(r.status, 200);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_corrupt_key_file_stops_the_server_with_a_clear_message() {
    let dir = state_dir("corrupt");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("keys.json"), b"{\"version\":1,\"keys\":[").unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_modelrelay-server"))
        .env("WORKER_SECRET", "x")
        .env("LISTEN_ADDR", "127.0.0.1:0")
        .env("MODELRELAY_ADMIN_TOKEN", ADMIN)
        .env("STATE_DIR", &dir)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("corrupt"));
    assert_eq!(
        std::fs::read(dir.join("keys.json")).unwrap(),
        b"{\"version\":1,\"keys\":[",
        "left untouched"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn access_log_has_one_line_per_request_and_no_secrets() {
    let dir = state_dir("log");
    let dir_s = dir.to_string_lossy().to_string();
    let server = ServerProc::start(&[
        ("MODELRELAY_ADMIN_TOKEN", ADMIN),
        ("STATE_DIR", &dir_s),
        ("MODELRELAY_REQUIRE_API_KEYS", "true"),
    ]);
    let auth = format!("Bearer {ADMIN}");
    let created = request(
        server.addr,
        "POST",
        "/admin/keys",
        Some(r#"{"name":"x"}"#),
        &[("authorization", &auth)],
    )
    .json();
    let key = created["key"].as_str().unwrap().to_string();
    let worker = FakeWorker::connect(server.addr, &["m"], 1);
    let bearer = format!("Bearer {key}");
    let mut c = send_request(
        server.addr,
        "POST",
        "/v1/chat/completions",
        Some(&chat("m", false)),
        &[("authorization", &bearer)],
    );
    let req = worker.request();
    worker.complete(&req.request_id, 200, "{}");
    assert_eq!(read_response(&mut c).status, 200);
    let line = server
        .proc
        .wait_line(&format!("request {} /v1/chat/completions", req.request_id));
    for field in [
        "model=m",
        "worker=fake",
        "status=200",
        "queue_wait_ms=",
        "duration_ms=",
        "tokens_in=",
        "outcome=completed",
    ] {
        assert!(line.contains(field), "{field} missing from {line}");
    }
    let log = server.proc.log();
    assert_eq!(
        log.matches(&format!("request {} /v1", req.request_id))
            .count(),
        1,
        "one access line"
    );
    for secret in [SECRET, ADMIN, key.as_str()] {
        assert!(!log.contains(secret), "a secret leaked into the log");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn connections_beyond_max_connections_get_503() {
    let server = TestServer::start_with(|c| c.max_connections = 2);
    let _a = std::net::TcpStream::connect(server.addr).unwrap();
    let _b = std::net::TcpStream::connect(server.addr).unwrap();
    let mut third = send_request(server.addr, "GET", "/health", None, &[]);
    let r = read_response(&mut third);
    assert_eq!(r.status, 503);
    assert_eq!(r.json()["error"]["code"], "too_many_connections");
}

#[test]
fn idle_connections_are_closed_after_the_idle_timeout() {
    use std::io::Read;
    let server = TestServer::start_with(|c| c.limits.idle_timeout = Duration::from_millis(300));
    let mut idle = std::net::TcpStream::connect(server.addr).unwrap();
    idle.set_read_timeout(Some(WAIT)).unwrap();
    let mut buf = [0u8; 16];
    assert_eq!(
        idle.read(&mut buf).unwrap(),
        0,
        "closed by the server, not by our read timeout"
    );
}

#[test]
fn an_oversized_worker_message_closes_only_that_worker() {
    let server = TestServer::start_with(|c| c.max_ws_message_bytes = 4096);
    let big = FakeWorker::connect(server.addr, &["m"], 1);
    big.send(json!({"type": "telemetry", "blob": "x".repeat(10_000)}));
    big.closed();
    server.wait_health("oversized worker dropped", |h| h["workers_connected"] == 0);
    let ok = FakeWorker::connect(server.addr, &["m"], 1);
    let mut c = open_chat(server.addr, "m", false);
    let req = ok.request();
    ok.complete(&req.request_id, 200, "{}");
    assert_eq!(read_response(&mut c).status, 200);
}

#[test]
fn rejected_inference_requests_carry_a_request_id_too() {
    let r = {
        let server = admin_server("rejectid", true);
        post(server.addr, "/v1/chat/completions", &chat("m", false))
    };
    assert_eq!(r.status, 401);
    assert!(r
        .header("x-request-id")
        .is_some_and(|id| id.starts_with("r-")));
    assert_eq!(r.header("x-queue-wait-ms"), Some("0"));
}
