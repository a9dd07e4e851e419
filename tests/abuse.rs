//! Abuse scenarios (issue 14): clients, workers and backends that misbehave on purpose.
//! Each must get a clear error or be cut off, and another client must be unaffected:
//! its latency during the abuse is printed (`cargo test --test abuse -- --nocapture`),
//! never asserted (timing depends on the machine); its errors are asserted.
//!
//! Scale: `ABUSE_IDLE` idle connections (default 2,000; `make chaos` runs 10,000) and
//! `ABUSE_WORKERS` workers connecting and leaving (default 1,000).

mod common;
#[path = "../examples/support/fake_backend.rs"]
mod fake_backend;
#[path = "abuse/support.rs"]
mod support;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use common::procs::{start_worker, ServerProc};
use common::{chat, send_request, FakeWorker, TestServer, Upgrade, SECRET, WAIT};
use fake_backend::{FakeBackend, Observed};
use serde_json::json;
use support::{eventually, open_files_limit, sample, scale, Answering, Bystander, Client};

/// Trickles `bytes` one every 100 ms, watching for the server's answer between bytes;
/// returns the status it got and when.
fn trickle(addr: std::net::SocketAddr, head: &[u8], bytes: &[u8]) -> (u16, Duration) {
    let began = Instant::now();
    let mut s = TcpStream::connect(addr).expect("connect");
    s.write_all(head).expect("head");
    s.set_read_timeout(Some(Duration::from_millis(1))).ok();
    let mut got = Vec::new();
    let mut buf = [0u8; 1024];
    for b in bytes.iter().chain(std::iter::repeat_n(&b' ', 600)) {
        match s.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => got.extend_from_slice(&buf[..n]),
            Err(_) => {}
        }
        if got.windows(4).any(|w| w == b"\r\n\r\n") || s.write_all(&[*b]).is_err() {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    s.set_read_timeout(Some(WAIT)).ok();
    let _ = s.read_to_end(&mut got);
    let text = String::from_utf8_lossy(&got);
    let status = text
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    (status, began.elapsed())
}

#[test]
fn slow_loris_heads_and_bodies_get_408() {
    let server = TestServer::start_with(|c| c.limits.io_timeout = Duration::from_secs(1));
    let addr = server.addr;
    let _worker = Answering::start(addr, "ok");
    let bystander = Bystander::start(addr, "ok");
    let lorises: Vec<_> = (0..40)
        .map(|i| {
            std::thread::spawn(move || {
                if i % 2 == 0 {
                    trickle(
                        addr,
                        b"",
                        b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\n",
                    )
                } else {
                    let head =
                        b"POST /v1/chat/completions HTTP/1.1\r\nContent-Length: 1000\r\n\r\n";
                    trickle(addr, head, &[b'x'; 1000])
                }
            })
        })
        .collect();
    let results: Vec<(u16, Duration)> = lorises.into_iter().map(|h| h.join().unwrap()).collect();
    let errors = bystander.finish("40 slow-loris heads and bodies");
    let slowest = results.iter().map(|r| r.1).max().unwrap_or_default();
    println!("abuse slow loris: every one cut off with 408, the last after {slowest:?}");
    for (status, _) in &results {
        assert_eq!(*status, 408, "{results:?}");
    }
    assert!(errors.is_empty(), "{errors:?}");
}

#[test]
fn idle_connections_do_not_slow_other_clients() {
    // Scaled to the open-file limit (each side holds one descriptor per connection).
    let wanted = scale("IDLE", 2_000);
    let n = wanted.min(open_files_limit().saturating_sub(256));
    if n < wanted {
        println!("abuse idle connections: {wanted} asked, {n} fit the open-file limit");
    }
    let server = ServerProc::start(&[("MAX_CONNECTIONS", &(n + 100).to_string())]);
    let pid = server.proc.child.id();
    let _worker = Answering::start(server.addr, "ok");
    let base = sample(pid);
    let idle: Vec<TcpStream> = (0..n)
        .map(|_| TcpStream::connect(server.addr).expect("connect"))
        .collect();
    assert!(
        eventually(Duration::from_secs(60), || sample(pid).threads
            >= base.threads + n as u64),
        "the server did not take {n} connections: {}",
        sample(pid)
    );
    let peak = sample(pid);
    let bystander = Bystander::start(server.addr, "ok");
    std::thread::sleep(Duration::from_secs(2));
    let errors = bystander.finish(&format!("{n} idle connections"));
    println!("abuse idle connections: server {base} -> {peak} with {n} idle");
    drop(idle);
    assert!(
        eventually(Duration::from_secs(60), || sample(pid).threads
            <= base.threads + 2),
        "threads not back: {} (baseline {base})",
        sample(pid)
    );
    assert!(errors.is_empty(), "{errors:?}");
}

#[test]
fn a_connection_flood_past_max_connections_is_refused_with_503() {
    let server = ServerProc::start(&[("MAX_CONNECTIONS", "16")]);
    let _worker = Answering::start(server.addr, "ok");
    let mut client = Client::new(server.addr);
    assert_eq!(
        client.chat("ok"),
        Ok(200),
        "a pooled connection before the flood"
    );
    let bystander = Bystander::start(server.addr, "ok");
    // The flood: connections held until the server refuses one, then 500 more, each
    // of which must be refused at once.
    let mut held = Vec::new();
    let mut refused = 0;
    while refused < 500 && held.len() < 100 {
        let mut s = TcpStream::connect(server.addr).expect("connect");
        let wait = if refused == 0 {
            Duration::from_millis(300)
        } else {
            WAIT
        };
        s.set_read_timeout(Some(wait)).ok();
        let mut buf = [0u8; 512];
        match s.read(&mut buf) {
            Ok(n) if n > 0 => {
                let text = String::from_utf8_lossy(&buf[..n]);
                assert!(
                    text.starts_with("HTTP/1.1 503") && text.contains("too_many_connections"),
                    "{text}"
                );
                refused += 1;
            }
            _ if refused == 0 => held.push(s),
            other => panic!("a connection past the limit was not refused: {other:?}"),
        }
    }
    let errors = bystander.finish("connection flood past MAX_CONNECTIONS (16)");
    println!(
        "abuse flood: {} connections held, {refused} refused at once with 503 too_many_connections",
        held.len()
    );
    assert_eq!(refused, 500);
    assert!(errors.is_empty(), "pooled client affected: {errors:?}");
    drop(held);
    assert!(eventually(WAIT, || Client::new(server.addr).chat("ok") == Ok(200)));
}

#[test]
fn a_thousand_workers_connecting_and_leaving() {
    let n = scale("WORKERS", 1_000);
    let server = ServerProc::start(&[]);
    let pid = server.proc.child.id();
    let _worker = Answering::start(server.addr, "ok");
    server.wait_workers(1);
    let base = sample(pid);
    let bystander = Bystander::start(server.addr, "ok");
    let began = Instant::now();
    let threads: Vec<_> = (0..10)
        .map(|t| {
            let addr = server.addr;
            std::thread::spawn(move || {
                for i in 0..n / 10 {
                    let name = format!("transient-{t}-{i}");
                    let register = json!({"type": "register", "worker_name": name,
                        "models": ["ok", format!("m-{t}-{i}")], "max_concurrent": 2,
                        "protocol_version": "1"});
                    let path = "/v1/worker/connect?provider=local";
                    match FakeWorker::try_connect(addr, path, Some(SECRET), register) {
                        Upgrade::Ok(w) => w.kill(),
                        Upgrade::Refused(status) => panic!("refused with {status}"),
                    }
                }
            })
        })
        .collect();
    for t in threads {
        t.join().expect("worker thread");
    }
    let took = began.elapsed();
    server.wait_workers(1);
    let errors = bystander.finish(&format!("{n} workers connecting and leaving"));
    assert!(
        eventually(Duration::from_secs(30), || sample(pid).threads
            <= base.threads + 2),
        "threads not back: {} (baseline {base})",
        sample(pid)
    );
    println!(
        "abuse workers: {n} connected and left in {:.1}s; server {base} -> {}",
        took.as_secs_f64(),
        sample(pid)
    );
    // The bystander may have been routed to a transient worker that left at once: its
    // request is then requeued, never failed.
    assert!(errors.is_empty(), "{errors:?}");
}

#[test]
fn a_worker_advertising_100000_models_keeps_256() {
    let server = ServerProc::start(&[]);
    let pid = server.proc.child.id();
    let _worker = Answering::start(server.addr, "ok");
    let bystander = Bystander::start(server.addr, "ok");
    let models: Vec<String> = (0..100_000).map(|i| format!("model-{i}")).collect();
    let register = json!({"type": "register", "worker_name": "hoarder", "models": models,
        "max_concurrent": 1, "protocol_version": "1"});
    let w = match FakeWorker::try_connect(
        server.addr,
        "/v1/worker/connect?provider=local",
        Some(SECRET),
        register,
    ) {
        Upgrade::Ok(w) => w,
        Upgrade::Refused(s) => panic!("refused {s}"),
    };
    let modelrelay::protocol::ServerMessage::RegisterAck(ack) = &w.ack else {
        panic!("no ack: {:?}", w.ack);
    };
    assert_eq!(ack.models.len(), 256);
    assert!(!ack.warnings.is_empty(), "the worker is told");
    w.send(json!({"type": "models_update", "models": models, "current_load": 0}));
    let listed = |n: usize| {
        let r = common::request(server.addr, "GET", "/v1/models", None, &[]);
        r.json()["data"].as_array().map_or(0, |d| d.len()) == n
    };
    assert!(eventually(WAIT, || listed(257)), "256 + the bystander's");
    let errors = bystander.finish("a worker advertising 100,000 models");
    println!("abuse 100,000 models: 256 kept; server {}", sample(pid));
    assert!(errors.is_empty(), "{errors:?}");
}

#[test]
fn chunks_for_cancelled_and_unknown_requests_are_dropped() {
    let server = ServerProc::start(&[]);
    let pid = server.proc.child.id();
    let _worker = Answering::start(server.addr, "ok");
    let spam = FakeWorker::connect(server.addr, &["spam"], 4);
    let bystander = Bystander::start(server.addr, "ok");
    // A stream the client leaves after its first chunk.
    let mut client = send_request(
        server.addr,
        "POST",
        "/v1/chat/completions",
        Some(&chat("spam", true)),
        &[],
    );
    let req = spam.request();
    spam.chunk(&req.request_id, "data: {\"n\":0}\n\n");
    let mut first = [0u8; 64];
    let _ = client.read(&mut first);
    drop(client);
    match spam.recv() {
        modelrelay::protocol::ServerMessage::Cancel { request_id, .. } => {
            assert_eq!(request_id, req.request_id)
        }
        other => panic!("expected a cancel, got {other:?}"),
    }
    let before = sample(pid);
    for i in 0..20_000 {
        spam.chunk(&req.request_id, "data: {\"late\":true}\n\n");
        let unknown = format!("r-{:016x}", 0xdead_0000u64 + i);
        spam.chunk(&unknown, "data: {\"unknown\":true}\n\n");
        if i % 100 == 0 {
            spam.complete(&unknown, 200, "{}");
            spam.send(json!({"type": "error", "request_id": unknown, "code": "x",
                "message": "y"}));
        }
    }
    // The server read all of it (the worker is still heard: a ping round trip).
    assert!(eventually(WAIT, || server.health()["in_flight"] == 0));
    let errors =
        bystander.finish("a worker sending 40,000 chunks for cancelled and unknown requests");
    println!("abuse spam chunks: server {before} -> {}", sample(pid));
    assert!(errors.is_empty(), "{errors:?}");
    // The worker is still usable: its next request is answered normally.
    let next = std::thread::spawn({
        let addr = server.addr;
        move || common::post(addr, "/v1/chat/completions", &chat("spam", false))
    });
    let req = spam.request();
    spam.complete(&req.request_id, 200, &common::openai_answer("fine"));
    assert_eq!(next.join().unwrap().status, 200);
}

#[test]
fn a_worker_that_never_answers_or_reports_absurd_load_is_cut_off() {
    let server = ServerProc::start(&[
        ("REQUEST_TIMEOUT_SECS", "1"),
        ("HEARTBEAT_INTERVAL_SECS", "1"),
        ("HEARTBEAT_TIMEOUT_SECS", "3"),
        ("MODELRELAY_ADMIN_TOKEN", "abuse-admin"),
        (
            "STATE_DIR",
            &std::env::temp_dir()
                .join(format!("mr-abuse-{}", std::process::id()))
                .display()
                .to_string(),
        ),
    ]);
    let _honest = Answering::start(server.addr, "ok");
    // Claims a huge capacity and never answers a request (it pongs, so only its
    // silence on requests gives it away).
    let liar = FakeWorker::connect(server.addr, &["ok"], u32::MAX);
    let liar_id = liar.worker_id.clone();
    let _liar = Answering::run(liar, false, 0);
    // Reports an absurd load: never chosen, harmless.
    let busy = json!({"type": "register", "worker_name": "busy", "models": ["ok"],
        "max_concurrent": 4, "protocol_version": "1", "current_load": u32::MAX});
    let Upgrade::Ok(busy) = FakeWorker::try_connect(
        server.addr,
        "/v1/worker/connect?provider=local",
        Some(SECRET),
        busy,
    ) else {
        panic!("busy worker refused");
    };
    let _busy = Answering::run(busy, false, u32::MAX);
    // Never says anything again after registering: dropped by the heartbeat.
    let mute = FakeWorker::connect(server.addr, &["ok"], 4);
    server.wait_workers(4);
    let bystander = Bystander::start(server.addr, "ok");
    let auth = [("authorization", "Bearer abuse-admin")];
    let state = |id: &str| {
        let r = common::request(server.addr, "GET", "/admin/workers", None, &auth);
        r.json()["workers"]
            .as_array()
            .and_then(|l| l.iter().find(|w| w["id"] == id).cloned())
            .map(|w| w["backend_state"].as_str().unwrap_or("").to_string())
    };
    assert!(
        eventually(Duration::from_secs(30), || state(&liar_id).as_deref()
            == Some("ejected")),
        "the silent worker was not ejected: {:?}",
        state(&liar_id)
    );
    assert!(eventually(Duration::from_secs(15), || state(
        &mute.worker_id
    )
    .is_none()));
    let during = bystander
        .finish("a worker that never answers (until ejected), one with absurd load, one mute");
    // Once it is out, the other client is served without errors.
    let after = Bystander::start(server.addr, "ok");
    std::thread::sleep(Duration::from_secs(2));
    let errors = after.finish("after the silent worker was ejected");
    println!(
        "abuse silent worker: {} requests timed out (504) before it was ejected",
        during.len()
    );
    assert!(
        during.iter().all(|e| e.contains("504")),
        "only timeouts: {during:?}"
    );
    assert!(errors.is_empty(), "{errors:?}");
}

#[test]
fn a_backend_sending_an_endless_line_is_cut_off() {
    let server = ServerProc::start(&[]);
    let (backend, seen) = FakeBackend::new("m", "hello there").observed();
    let addr = backend.spawn("127.0.0.1:0").expect("backend");
    let worker = start_worker(
        server.addr,
        addr,
        &[
            ("MAX_WS_MESSAGE_BYTES", "4194304"),
            ("MAX_CONCURRENCY", "4"),
        ],
    );
    server.wait_workers(1);
    let (spid, wpid) = (server.proc.child.id(), worker.child.id());
    let bystander = Bystander::start(server.addr, "m");
    let endless = |stream: bool| {
        json!({"model": "m", "stream": stream, "scenario": "endless",
            "messages": [{"role": "user", "content": "hi"}]})
        .to_string()
    };
    let hung_up = || loop {
        match seen.recv_timeout(WAIT) {
            Ok(Observed::ClientClosed(_)) => return true,
            Ok(_) => continue,
            Err(_) => return false,
        }
    };
    // Whole answers: the worker stops reading at its limit.
    let r = common::post(server.addr, "/v1/chat/completions", &endless(false));
    assert_eq!(r.status, 502, "{}", r.text());
    assert_eq!(r.json()["error"]["code"], "response_too_large");
    // A stream: passed on as it comes, with bounded memory; the client's hang-up
    // reaches the backend.
    let mut s = send_request(
        server.addr,
        "POST",
        "/v1/chat/completions",
        Some(&endless(true)),
        &[],
    );
    let mut buf = vec![0u8; 64 * 1024];
    let mut got = 0usize;
    while got < 64 << 20 {
        got += s.read(&mut buf).expect("stream");
    }
    let (srv, wrk) = (sample(spid), sample(wpid));
    drop(s);
    assert!(hung_up(), "the backend never saw the hang-up");
    // Ollama: the line is never a whole line; the relay holds at most 16 MiB of it.
    let ollama = json!({"model": "m", "scenario": "endless",
        "messages": [{"role": "user", "content": "hi"}]})
    .to_string();
    let s = send_request(server.addr, "POST", "/api/chat", Some(&ollama), &[]);
    std::thread::sleep(Duration::from_secs(3));
    let srv_ollama = sample(spid);
    drop(s);
    assert!(
        hung_up(),
        "the backend never saw the Ollama client's hang-up"
    );
    assert!(eventually(WAIT, || server.health()["in_flight"] == 0));
    let errors = bystander.finish("a backend sending an endless line");
    println!(
        "abuse endless line: after 64 MB streamed: server {srv}, worker {wrk}; Ollama route after 3 s: server {srv_ollama}"
    );
    assert!(
        srv.rss_kb < 64 * 1024 && wrk.rss_kb < 64 * 1024,
        "{srv} / {wrk}"
    );
    assert!(errors.is_empty(), "{errors:?}");
}
