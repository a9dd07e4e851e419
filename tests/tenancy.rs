//! Many users, one queue: tenants, priority, fair share, rate limits and backpressure,
//! tested over real sockets (a real server, fake workers on a real WebSocket, raw HTTP
//! clients). Ordering is decided by what the server reports, never by sleeping.

mod common;

use std::io::{BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use common::*;
use modelrelay::server::tenancy::gate::TRACKED_TENANTS;
use modelrelay::server::tenancy::limits::Rate;
use serde_json::{json, Value};

const ADMIN: &str = "tenancy-admin";

fn chat_as(addr: SocketAddr, tenant: &str, priority: Option<&str>, stream: bool) -> TcpStream {
    let mut headers = vec![
        ("content-type", "application/json"),
        ("x-tenant-id", tenant),
    ];
    if let Some(p) = priority {
        headers.push(("x-priority", p));
    }
    send_request(
        addr,
        "POST",
        "/v1/chat/completions",
        Some(&chat("m", stream)),
        &headers,
    )
}

fn admin(server: &TestServer, method: &str, path: &str, body: Option<&str>) -> Response {
    let auth = format!("Bearer {ADMIN}");
    request(server.addr, method, path, body, &[("authorization", &auth)])
}

/// Serves `n` requests on a fake worker as they come, returning their tenants in
/// dispatch order.
fn serve(worker: &FakeWorker, n: usize) -> Vec<String> {
    (0..n)
        .map(|_| {
            let req = worker.request();
            worker.complete(&req.request_id, 200, "{}");
            req.headers.get("x-tenant-id").cloned().unwrap_or_default()
        })
        .collect()
}

#[test]
fn a_flooding_tenant_does_not_hold_up_another() {
    let server = TestServer::start_with(|c| {
        c.dispatch.max_queue_len = 1000;
        c.dispatch.max_queue_per_tenant = 600;
    });
    let worker = FakeWorker::connect(server.addr, &["m"], 2);
    let flood: Vec<TcpStream> = (0..500)
        .map(|_| chat_as(server.addr, "flood", None, false))
        .collect();
    server.wait_health("the flood queued", |h| h["queue_depth"] == 498);
    let calm: Vec<TcpStream> = (0..5)
        .map(|_| chat_as(server.addr, "calm", None, false))
        .collect();
    server.wait_health("calm queued too", |h| h["queue_depth"] == 503);
    // The two running flood requests were dispatched before calm arrived.
    let order = serve(&worker, 505);
    let turns: Vec<usize> = order
        .iter()
        .enumerate()
        .filter(|(_, t)| *t == "calm")
        .map(|(i, _)| i.saturating_sub(2))
        .collect();
    eprintln!("calm dispatched after {turns:?} turns of 503 queued");
    assert_eq!(turns.len(), 5);
    // Fair share: calm's k-th request goes within its k-th pair of turns, so its p95
    // wait is about one slot turn per request it has, not 500.
    for (k, turn) in turns.iter().enumerate() {
        assert!(
            *turn <= 2 * k + 2,
            "calm #{k} waited {turn} turns: {turns:?}"
        );
    }
    for mut s in flood.into_iter().chain(calm) {
        assert_eq!(read_response(&mut s).status, 200);
    }
}

#[test]
fn high_priority_overtakes_a_full_normal_queue() {
    let server = TestServer::start_with(|c| c.dispatch.max_queue_len = 20);
    let worker = FakeWorker::connect(server.addr, &["m"], 1);
    let mut normal: Vec<TcpStream> = (0..21)
        .map(|i| chat_as(server.addr, &format!("t{}", i % 3), None, false))
        .collect();
    server.wait_health("queue full", |h| h["queue_depth"] == 20);
    let full = request(
        server.addr,
        "POST",
        "/v1/chat/completions",
        Some(&chat("m", false)),
        &[("x-priority", "low")],
    );
    assert_eq!(full.status, 429, "the queue is full for everyone");
    assert_eq!(full.json()["error"]["code"], "queue_full");
    // Free a place (the next normal request starts), then a high request joins the
    // back of the 19 normal ones still waiting.
    let first = worker.request();
    worker.complete(&first.request_id, 200, "{}");
    let second = worker.request();
    server.wait_health("one place free", |h| h["queue_depth"] == 19);
    let mut high = chat_as(server.addr, "vip", Some("high"), false);
    server.wait_health("high queued", |h| h["queue_depth"] == 20);
    worker.complete(&second.request_id, 200, "{}");
    let next = worker.request();
    assert_eq!(
        next.headers.get("x-priority").map(String::as_str),
        Some("high")
    );
    assert_eq!(
        next.headers.get("x-tenant-id").map(String::as_str),
        Some("vip")
    );
    worker.complete(&next.request_id, 200, "{}");
    assert_eq!(read_response(&mut high).status, 200);
    serve(&worker, 19);
    for s in normal.iter_mut() {
        assert_eq!(read_response(s).status, 200);
    }
}

#[test]
fn bad_tenant_and_priority_headers_are_400() {
    let server = TestServer::start();
    let bad = |name: &str, value: &str| {
        let r = request(
            server.addr,
            "POST",
            "/v1/chat/completions",
            Some(&chat("m", false)),
            &[(name, value)],
        );
        (r.status, r.json()["error"]["code"].clone())
    };
    assert_eq!(
        bad("x-tenant-id", "has space"),
        (400, json!("invalid_tenant"))
    );
    assert_eq!(
        bad("x-tenant-id", &"x".repeat(65)),
        (400, json!("invalid_tenant"))
    );
    assert_eq!(
        bad("x-priority", "urgent"),
        (400, json!("invalid_priority"))
    );
}

#[test]
fn a_rate_limit_refuses_at_the_boundary_with_retry_after() {
    let server = TestServer::start_with(|c| {
        c.tenancy.rates.insert(
            "team-a".into(),
            Rate::parse_requests("3req/min").expect("rate"),
        );
    });
    let worker = FakeWorker::connect(server.addr, &["m"], 4);
    for remaining in ["2", "1", "0"] {
        let mut s = chat_as(server.addr, "team-a", None, false);
        let req = worker.request();
        worker.complete(&req.request_id, 200, "{}");
        let r = read_response(&mut s);
        assert_eq!(r.status, 200);
        assert_eq!(r.header("x-ratelimit-limit-requests"), Some("3"));
        assert_eq!(r.header("x-ratelimit-remaining-requests"), Some(remaining));
        assert!(r.header("x-ratelimit-reset-requests").is_some());
    }
    let r = read_response(&mut chat_as(server.addr, "team-a", None, false));
    assert_eq!(r.status, 429);
    // 3 per minute: the next one fits 20 s after the first.
    let retry: u64 = r
        .header("retry-after")
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    assert!((19..=20).contains(&retry), "retry-after {retry}");
    let e = &r.json()["error"];
    assert_eq!(e["code"], "rate_limit_exceeded");
    assert_eq!(
        (e["limit"].clone(), e["remaining"].clone()),
        (json!(3), json!(0))
    );
    assert!(e["resetAt"].as_u64().unwrap_or(0) > 1_700_000_000, "{e}");
    // The Anthropic route keeps its own shape.
    let r = request(
        server.addr,
        "POST",
        "/v1/messages",
        Some(&chat("m", false)),
        &[("x-tenant-id", "team-a")],
    );
    assert_eq!(r.status, 429);
    let body = r.json();
    assert_eq!(body["type"], "error");
    assert_eq!(body["error"]["type"], "rate_limit_error");
    assert_eq!(body["error"]["limit"], 3);
    // Another tenant is not limited and gets no rate headers.
    let mut s = chat_as(server.addr, "team-b", None, false);
    let req = worker.request();
    worker.complete(&req.request_id, 200, "{}");
    let r = read_response(&mut s);
    assert_eq!(r.status, 200);
    assert_eq!(r.header("x-ratelimit-limit-requests"), None);
}

#[test]
fn a_token_budget_is_charged_from_reported_usage() {
    let server = TestServer::start_with(|c| {
        c.tenancy.tokens.insert(
            "small".into(),
            Rate::parse_tokens("10tok/min").expect("rate"),
        );
    });
    let worker = FakeWorker::connect(server.addr, &["m"], 1);
    let mut s = chat_as(server.addr, "small", None, false);
    let req = worker.request();
    worker.send(json!({
        "type": "response_complete", "request_id": req.request_id, "status_code": 200,
        "body": "{}", "token_counts": {"prompt_tokens": 8, "completion_tokens": 5}
    }));
    assert_eq!(read_response(&mut s).status, 200);
    let r = read_response(&mut chat_as(server.addr, "small", None, false));
    assert_eq!(r.status, 429, "13 of 10 tokens spent");
    assert_eq!(r.json()["error"]["code"], "rate_limit_exceeded");
}

#[test]
fn a_flood_of_made_up_tenants_keeps_memory_flat() {
    let server = TestServer::start_with(|c| {
        c.admin_token = Some(ADMIN.into());
        c.dispatch.queue_timeout = Duration::from_millis(300);
        c.tenancy.default_rate = Some(Rate::parse_requests("5req/s").expect("rate"));
        c.metrics_max_tenants = 50;
    });
    // Once the relay outlived its queue timeout, an unknown model is a quick 404 —
    // after the rate gate has seen the tenant.
    server.wait_health("uptime past the queue timeout", |h| {
        h["uptime_secs"].as_f64().unwrap_or(0.0) > 0.4
    });
    let flood = |from: usize, to: usize| {
        let threads: Vec<_> = (0..4)
            .map(|t| {
                let addr = server.addr;
                std::thread::spawn(move || keep_alive_flood(addr, (from + t..to).step_by(4)))
            })
            .collect();
        for t in threads {
            assert!(t.join().is_ok());
        }
    };
    flood(0, 5_000);
    let before = rss_kb();
    flood(5_000, 25_000);
    let after = rss_kb();
    // RSS is the whole test process (other tests run beside this one), so it is printed
    // as a figure; what is asserted is that every table a tenant id lands in is bounded.
    eprintln!("RSS after 5,000 tenants: {before} kB, after 25,000: {after} kB");
    let stats = admin(&server, "GET", "/admin/stats", None).json();
    let tracked = stats["rate_limit_tenants_tracked"]
        .as_u64()
        .unwrap_or(u64::MAX);
    assert!(
        tracked as usize <= TRACKED_TENANTS,
        "{tracked} tenants tracked after 25,000 made-up ids"
    );
    let named = stats["tenants"].as_object().map_or(0, |t| t.len());
    assert!(named <= 51, "{named} tenant names in stats");
    assert!(stats["tenants"]["other"]["rejected_by_reason"]["model_not_found"].is_u64());
}

/// Sends one request per tenant id on a single keep-alive connection.
fn keep_alive_flood(addr: SocketAddr, ids: impl Iterator<Item = usize>) {
    let stream = TcpStream::connect(addr).expect("connect");
    stream.set_read_timeout(Some(WAIT)).ok();
    stream.set_nodelay(true).ok();
    let mut writer = stream.try_clone().expect("clone");
    let mut reader = BufReader::new(stream);
    let body = chat("nobody-serves-this", false);
    for id in ids {
        let request = format!(
            "POST /v1/chat/completions HTTP/1.1\r\nhost: localhost\r\nx-tenant-id: made-up-{id}\r\ncontent-length: {}\r\n\r\n{body}",
            body.len()
        );
        writer.write_all(request.as_bytes()).expect("write");
        let (status, headers) = read_head(&mut reader);
        assert_eq!(status, 404);
        let len: usize = headers
            .iter()
            .find(|(n, _)| n == "content-length")
            .and_then(|(_, v)| v.parse().ok())
            .expect("length");
        let mut buf = vec![0; len];
        reader.read_exact(&mut buf).expect("body");
    }
}

fn rss_kb() -> i64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|v| v.parse().ok())
        })
        .unwrap_or(0)
}

#[test]
fn keys_carry_tenant_priority_cap_and_weight() {
    let dir = std::env::temp_dir().join(format!("mr-tenancy-keys-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let server = TestServer::start_with(move |c| {
        c.admin_token = Some(ADMIN.into());
        c.require_api_keys = true;
        c.state_dir = dir;
    });
    let body = json!({"name": "ci", "tenant": "team-a", "max_priority": "normal",
                      "rate_limit": "100req/min", "weight": 2});
    let created = admin(&server, "POST", "/admin/keys", Some(&body.to_string()));
    assert_eq!(created.status, 201, "{}", created.text());
    let key = created.json()["key"].as_str().unwrap_or("").to_string();
    let listed = admin(&server, "GET", "/admin/keys", None).json();
    let k = &listed["keys"][0];
    assert_eq!(
        (
            k["tenant"].clone(),
            k["max_priority"].clone(),
            k["weight"].clone()
        ),
        (json!("team-a"), json!("normal"), json!(2))
    );
    for (field, value) in [
        ("tenant", json!("no spaces allowed")),
        ("max_priority", json!("urgent")),
        ("rate_limit", json!("lots")),
        ("weight", json!(0)),
    ] {
        let mut b = json!({"name": "x"});
        b[field] = value;
        let r = admin(&server, "POST", "/admin/keys", Some(&b.to_string()));
        assert_eq!(r.status, 400, "{field}: {}", r.text());
    }
    let auth = format!("Bearer {key}");
    let worker = FakeWorker::connect(server.addr, &["m"], 1);
    let mut s = send_request(
        server.addr,
        "POST",
        "/v1/chat/completions",
        Some(&chat("m", false)),
        &[("authorization", &auth), ("x-priority", "high")],
    );
    let req = worker.request();
    assert_eq!(
        req.headers.get("x-tenant-id").map(String::as_str),
        Some("team-a")
    );
    assert_eq!(
        req.headers.get("x-priority").map(String::as_str),
        Some("normal"),
        "capped at the key's max_priority"
    );
    worker.complete(&req.request_id, 200, "{}");
    let r = read_response(&mut s);
    assert_eq!(r.status, 200);
    assert_eq!(r.header("x-ratelimit-limit-requests"), Some("100"));
    let other = request(
        server.addr,
        "POST",
        "/v1/chat/completions",
        Some(&chat("m", false)),
        &[("authorization", &auth), ("x-tenant-id", "team-b")],
    );
    assert_eq!(other.status, 403);
    assert_eq!(other.json()["error"]["code"], "tenant_mismatch");
    let stats = admin(&server, "GET", "/admin/stats", None).json();
    let t = &stats["tenants"]["team-a"];
    assert_eq!(t["completed"], 1, "{stats}");
    assert_eq!(t["rejected_by_reason"]["tenant_mismatch"], 1, "{stats}");
}

#[test]
fn a_waiting_stream_hears_its_place_and_a_queue_timeout_ends_it_cleanly() {
    let server = TestServer::start_with(|c| c.dispatch.queue_timeout = Duration::from_secs(2));
    let mut s = send_request(
        server.addr,
        "POST",
        "/v1/chat/completions",
        Some(&chat("m", true)),
        &[("x-queue-updates", "true")],
    );
    let started = Instant::now();
    let mut reader = BufReader::new(&mut s);
    let (status, headers) = read_head(&mut reader);
    assert_eq!(status, 200, "the head goes out while it waits");
    assert!(headers
        .iter()
        .any(|(n, v)| n == "content-type" && v == "text/event-stream"));
    let mut body = String::new();
    while let Some(chunk) = read_chunk(&mut reader) {
        body.push_str(&String::from_utf8_lossy(&chunk));
    }
    eprintln!("stream ended after {:?}: {body:?}", started.elapsed());
    assert!(body.starts_with(": queued position=1 eta_ms="), "{body}");
    assert!(
        body.matches(": queued").count() >= 2,
        "about once a second: {body}"
    );
    let last = body.trim_end().lines().last().unwrap_or("");
    let event: Value = serde_json::from_str(last.trim_start_matches("data: ")).expect("json");
    assert_eq!(event["error"]["code"], "queue_timeout");
}

#[test]
fn answers_carry_gpu_time_and_cache_headers_and_every_route_a_request_id() {
    let server = TestServer::start_with(|c| c.admin_token = Some(ADMIN.into()));
    let worker = FakeWorker::connect(server.addr, &["m"], 1);
    let mut s = open_chat(server.addr, "m", false);
    let req = worker.request();
    let body =
        json!({"usage": {"prompt_tokens": 9, "prompt_tokens_details": {"cached_tokens": 7}}});
    worker.complete(&req.request_id, 200, &body.to_string());
    let r = read_response(&mut s);
    assert_eq!(r.header("x-cache-hit"), Some("true"));
    assert_eq!(r.header("x-cache-tokens-reused"), Some("7"));
    assert!(r
        .header("x-gpu-time-ms")
        .and_then(|v| v.parse::<u64>().ok())
        .is_some());
    let mut s = open_chat(server.addr, "m", false);
    let req = worker.request();
    worker.complete(&req.request_id, 200, "{}");
    let r = read_response(&mut s);
    assert_eq!(r.header("x-cache-hit"), Some("false"));
    assert_eq!(r.header("x-cache-tokens-reused"), Some("0"));
    for (method, path) in [
        ("GET", "/health"),
        ("GET", "/metrics"),
        ("GET", "/v1/models"),
        ("GET", "/admin/stats"),
        ("GET", "/nope"),
    ] {
        let auth = format!("Bearer {ADMIN}");
        let r = request(server.addr, method, path, None, &[("authorization", &auth)]);
        let id = r.header("x-request-id").unwrap_or("");
        assert!(id.starts_with("r-") && id.len() == 18, "{path}: {id:?}");
    }
}

#[test]
fn tenant_metrics_are_exposed() {
    let server = TestServer::start();
    let worker = FakeWorker::connect(server.addr, &["m"], 1);
    let mut s = chat_as(server.addr, "team-x", Some("low"), false);
    let req = worker.request();
    worker.complete(&req.request_id, 200, "{}");
    assert_eq!(read_response(&mut s).status, 200);
    // A request is counted after its last byte is written: the client can read its
    // answer first, so wait for the count rather than race it.
    let counted =
        "modelrelay_tenant_requests_total{tenant=\"team-x\",priority=\"low\",status_class=\"2xx\"} 1";
    let mut text = String::new();
    wait_until("the request counted", || {
        text = request(server.addr, "GET", "/metrics", None, &[]).text();
        (text.contains(counted), text.clone())
    });
    assert!(text.contains(
        "modelrelay_tenant_queue_wait_seconds_count{tenant=\"team-x\",priority=\"low\"} 1"
    ));
    assert!(text.contains("# TYPE modelrelay_rate_limited_total counter"));
}

#[test]
fn a_backend_error_after_progress_notes_ends_the_stream_with_one_error_event() {
    let server = TestServer::start();
    let worker = FakeWorker::connect(server.addr, &["m"], 1);
    let mut first = open_chat(server.addr, "m", false);
    let running = worker.request();
    let mut s = send_request(
        server.addr,
        "POST",
        "/v1/chat/completions",
        Some(&chat("m", true)),
        &[("x-queue-updates", "true")],
    );
    let mut reader = BufReader::new(&mut s);
    assert_eq!(
        read_head(&mut reader).0,
        200,
        "the head goes out while it waits"
    );
    worker.complete(&running.request_id, 200, "{}");
    assert_eq!(read_response(&mut first).status, 200);
    let req = worker.request();
    let err = json!({"error": {"message": "prompt too long", "type": "invalid_request_error"}});
    worker.complete(&req.request_id, 400, &err.to_string());
    let mut body = String::new();
    while let Some(chunk) = read_chunk(&mut reader) {
        body.push_str(&String::from_utf8_lossy(&chunk));
    }
    let events: Vec<&str> = body.lines().filter(|l| l.starts_with("data: ")).collect();
    assert_eq!(events.len(), 1, "{body}");
    let e: Value = serde_json::from_str(&events[0][6..]).expect("json");
    assert_eq!(e["error"]["message"], "prompt too long", "{body}");
}

#[test]
fn absurd_token_counts_from_a_worker_do_not_break_accounting() {
    let server = TestServer::start_with(|c| {
        c.tenancy
            .tokens
            .insert("t".into(), Rate::parse_tokens("1000tok/min").expect("rate"));
    });
    let worker = FakeWorker::connect(server.addr, &["m"], 1);
    for tenant in ["free", "t"] {
        let mut s = chat_as(server.addr, tenant, None, false);
        let req = worker.request();
        worker.send(json!({
            "type": "response_complete", "request_id": req.request_id, "status_code": 200,
            "body": "{}", "token_counts": {"prompt_tokens": u64::MAX, "completion_tokens": 1}
        }));
        assert_eq!(read_response(&mut s).status, 200);
    }
    // The budget is spent (clamped to one window), not wrapped around.
    let r = read_response(&mut chat_as(server.addr, "t", None, false));
    assert_eq!(r.status, 429);
    let text = request(server.addr, "GET", "/metrics", None, &[]).text();
    assert!(text.contains("modelrelay_tokens_total"), "{text}");
    assert_eq!(server.health()["status"], "ok");
}
