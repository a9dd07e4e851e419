//! Worker-facing behaviour of the server: auth, registration, hostile input, heartbeat,
//! cancellation, requeue, drain and load, over real WebSockets.

mod common;

use std::collections::HashSet;
use std::io::{BufReader, Read};
use std::time::{Duration, Instant};

use common::*;
use modelrelay::protocol::ServerMessage;
use serde_json::json;

fn register(version: Option<&str>) -> serde_json::Value {
    let mut v =
        json!({"type": "register", "worker_name": "w", "models": ["m"], "max_concurrent": 1});
    if let Some(version) = version {
        v["protocol_version"] = json!(version);
    }
    v
}

#[test]
fn wrong_or_missing_secret_and_unknown_provider_are_refused_before_registration() {
    let server = TestServer::start();
    let path = "/v1/worker/connect?provider=local";
    assert!(matches!(
        FakeWorker::try_connect(server.addr, path, Some("wrong"), register(None)),
        Upgrade::Refused(401)
    ));
    assert!(matches!(
        FakeWorker::try_connect(server.addr, path, None, register(None)),
        Upgrade::Refused(401)
    ));
    let other = "/v1/worker/connect?provider=elsewhere";
    assert!(matches!(
        FakeWorker::try_connect(server.addr, other, Some(SECRET), register(None)),
        Upgrade::Refused(404)
    ));
    // The legacy query-string secret still works.
    let legacy = format!("{path}&worker_secret={SECRET}");
    assert!(matches!(
        FakeWorker::try_connect(server.addr, &legacy, None, register(None)),
        Upgrade::Ok(_)
    ));
    // The ack is sent before `/health` is republished: wait for it, do not race it.
    server.wait_health("the legacy worker counted", |h| h["workers_connected"] == 1);
}

#[test]
fn repeated_auth_failures_are_rate_limited() {
    let server = TestServer::start();
    let path = "/v1/worker/connect?provider=local";
    let mut statuses = Vec::new();
    for _ in 0..12 {
        match FakeWorker::try_connect(server.addr, path, Some("bad"), register(None)) {
            Upgrade::Refused(s) => statuses.push(s),
            Upgrade::Ok(_) => panic!("bad secret accepted"),
        }
    }
    assert_eq!(&statuses[..10], &[401; 10]);
    assert_eq!(&statuses[10..], &[429, 429], "locked out after 10 failures");
}

#[test]
fn protocol_versions_one_bridge_and_legacy_are_accepted_others_closed() {
    let server = TestServer::start();
    let path = "/v1/worker/connect?provider=local";
    for v in [Some("1"), Some("2026-04-bridge-v1"), None] {
        let Upgrade::Ok(w) = FakeWorker::try_connect(server.addr, path, Some(SECRET), register(v))
        else {
            panic!()
        };
        assert!(
            matches!(w.ack, ServerMessage::RegisterAck(_)),
            "{v:?}: {:?}",
            w.ack
        );
    }
    let Upgrade::Ok(w) =
        FakeWorker::try_connect(server.addr, path, Some(SECRET), register(Some("3")))
    else {
        panic!()
    };
    let ServerMessage::Unknown(closed) = &w.ack else {
        panic!("version 3 was acked")
    };
    assert!(
        closed.contains("1002") || closed.contains("Protocol"),
        "{closed}"
    );
    server.wait_health("three workers counted", |h| h["workers_connected"] == 3);
}

#[test]
fn ack_carries_sanitized_models_and_warnings() {
    let server = TestServer::start();
    let reg = json!({"type": "register", "worker_name": "w", "models": [" a ", "", "a", "b"], "max_concurrent": 2, "protocol_version": "1"});
    let Upgrade::Ok(w) = FakeWorker::try_connect(
        server.addr,
        "/v1/worker/connect?provider=local",
        Some(SECRET),
        reg,
    ) else {
        panic!()
    };
    let ServerMessage::RegisterAck(ack) = &w.ack else {
        panic!("{:?}", w.ack)
    };
    assert_eq!(ack.models, vec!["a", "b"]);
    assert_eq!(ack.warnings.len(), 2);
    assert!(ack.worker_id.starts_with("w-"));
}

#[test]
fn unknown_types_unknown_fields_and_garbage_json_are_ignored() {
    let server = TestServer::start();
    let worker = FakeWorker::connect(server.addr, &["m"], 1);
    worker.send(json!({"type": "telemetry", "gpu_temp": 71}));
    worker.send_text("this is not json");
    worker.send_text(r#"{"type":"response_chunk"}"#);
    worker.send(json!({"type": "pong", "current_load": 0, "future_field": [1, 2]}));
    let mut client = open_chat(server.addr, "m", false);
    let req = worker.request();
    worker.send(json!({"type": "response_complete", "request_id": req.request_id, "status_code": 200, "body": "ok", "new_thing": true}));
    assert_eq!(read_response(&mut client).text(), "ok");
}

#[test]
fn garbage_frames_close_only_that_worker_and_its_request_is_requeued() {
    let server = TestServer::start();
    let bad = FakeWorker::connect(server.addr, &["m"], 1);
    let mut client = open_chat(server.addr, "m", false);
    let first = bad.request();
    let good = FakeWorker::connect(server.addr, &["m"], 1);
    // A frame with reserved opcode 0x3 and no mask: a protocol violation.
    bad.send_raw(&[0x83, 0x02, b'h', b'i']);
    let again = good.request();
    assert_eq!(
        again.request_id, first.request_id,
        "same request, second worker"
    );
    assert_eq!(again.body, first.body);
    good.complete(&again.request_id, 200, "from good");
    assert_eq!(read_response(&mut client).text(), "from good");
    server.wait_health("bad worker removed", |h| h["workers_connected"] == 1);
}

#[test]
fn pings_are_sent_and_silent_workers_are_closed_with_the_documented_reason() {
    let server = TestServer::start_with(|c| {
        c.dispatch.heartbeat_interval = Duration::from_millis(300);
        c.dispatch.heartbeat_timeout = Duration::from_secs(1);
    });
    let alive = FakeWorker::connect(server.addr, &["m"], 1);
    let silent = FakeWorker::connect(server.addr, &["m"], 1);
    // `alive` answers pings; `silent` never does (a half-open socket looks the same).
    // The responder keeps answering until the silent worker is gone, however long the
    // server takes to notice, so `alive` never goes quiet itself.
    let stop = std::sync::atomic::AtomicBool::new(false);
    let pongs = std::thread::scope(|scope| {
        let responder = scope.spawn(|| {
            let deadline = Instant::now() + WAIT;
            let mut pongs = 0;
            while !(stop.load(std::sync::atomic::Ordering::SeqCst) && pongs >= 2)
                && Instant::now() < deadline
            {
                if let Some(Seen::Msg(ServerMessage::Ping { timestamp_unix_ms })) =
                    alive.next_seen(Duration::from_millis(20))
                {
                    alive.send(
                        json!({"type": "pong", "current_load": 0, "timestamp_unix_ms": timestamp_unix_ms}),
                    );
                    pongs += 1;
                }
            }
            pongs
        });
        let frame = silent.closed().expect("close frame");
        assert_eq!(frame.1, "worker heartbeat timed out");
        // The close frame can reach us before `/health` is republished.
        server.wait_health("only the silent worker removed", |h| {
            h["workers_connected"] == 1
        });
        stop.store(true, std::sync::atomic::Ordering::SeqCst);
        responder.join().expect("responder")
    });
    // The silent worker lasted a whole timeout (1 s): pings every 300 ms meanwhile.
    assert!(pongs >= 2, "pings arrive every interval ({pongs})");
}

#[test]
fn pong_load_and_models_update_change_routing_at_once() {
    // The worker's messages and the client's request reach the dispatcher on different
    // sockets, in no set order: each step waits until the server shows the previous one
    // applied (`/admin/workers`, `/health`) before it takes the next.
    let server = TestServer::start_admin(|_| {});
    let worker = FakeWorker::connect(server.addr, &["m"], 1);
    let id = worker.worker_id.clone();
    worker.send(json!({"type": "pong", "current_load": 1}));
    server.wait_worker(&id, "the pong's load applied", |w| w["reported_load"] == 1);
    let mut client = open_chat(server.addr, "m", false);
    server.wait_health("request queued behind reported load", |h| {
        h["queue_depth"] == 1 && h["in_flight"] == 0
    });
    worker.send(json!({"type": "pong", "current_load": 0}));
    let req = worker.request();
    worker.complete(&req.request_id, 200, "{}");
    assert_eq!(read_response(&mut client).status, 200);
    server.wait_worker(&id, "the first request finished", |w| {
        w["in_flight"] == 0 && w["reported_load"] == 0
    });
    let mut client = open_chat(server.addr, "new-model", false);
    server.wait_health("queued for unknown model", |h| h["queue_depth"] == 1);
    worker.send(json!({"type": "models_update", "models": ["m", "new-model"], "current_load": 0}));
    let req = worker.request();
    assert_eq!(req.model, "new-model");
    server.wait_worker(&id, "the models update applied", |w| {
        w["models"] == json!(["m", "new-model"])
    });
    worker.complete(&req.request_id, 200, "{}");
    assert_eq!(read_response(&mut client).status, 200);
}

#[test]
fn client_hangup_while_queued_removes_the_request() {
    let server = TestServer::start();
    let client = open_chat(server.addr, "m", false);
    server.wait_health("queued", |h| h["queue_depth"] == 1);
    drop(client);
    server.wait_health("removed from queue", |h| h["queue_depth"] == 0);
    let worker = FakeWorker::connect(server.addr, &["m"], 1);
    let mut client = open_chat(server.addr, "m", false);
    let req = worker.request();
    worker.complete(&req.request_id, 200, "second");
    assert_eq!(
        read_response(&mut client).text(),
        "second",
        "the abandoned request was never dispatched"
    );
}

fn expect_cancel(worker: &FakeWorker, id: &str) -> Duration {
    let start = Instant::now();
    match worker.recv() {
        ServerMessage::Cancel { request_id, reason } => {
            assert_eq!(request_id, id);
            assert_eq!(reason.as_str(), "client_disconnect");
        }
        other => panic!("expected cancel, got {other:?}"),
    }
    start.elapsed()
}

#[test]
fn client_hangup_in_flight_and_mid_stream_sends_cancel_and_drops_late_chunks() {
    let server = TestServer::start();
    let worker = FakeWorker::connect(server.addr, &["m"], 1);
    // Non-streaming answer pending.
    let client = open_chat(server.addr, "m", false);
    let req = worker.request();
    drop(client);
    let waited = expect_cancel(&worker, &req.request_id);
    eprintln!("cancel after hangup (non-streaming): {waited:?}");
    // Mid-stream.
    let mut client = open_chat(server.addr, "m", true);
    let req = worker.request();
    worker.chunk(&req.request_id, "data: 1\n\n");
    let mut buf = [0u8; 64];
    let _ = client.read(&mut buf).unwrap();
    drop(client);
    expect_cancel(&worker, &req.request_id);
    // Late chunks for the cancelled request go nowhere; the slot is free again.
    worker.chunk(&req.request_id, "data: late\n\n");
    let mut client = open_chat(server.addr, "m", false);
    let next = worker.request();
    worker.complete(&next.request_id, 200, "fresh");
    assert_eq!(read_response(&mut client).text(), "fresh");
}

#[test]
fn capacity_is_intact_after_many_unacknowledged_cancels() {
    let server = TestServer::start();
    let worker = FakeWorker::connect(server.addr, &["m"], 1);
    for _ in 0..25 {
        let client = open_chat(server.addr, "m", false);
        let req = worker.request();
        drop(client);
        expect_cancel(&worker, &req.request_id);
    }
    server.wait_health("nothing in flight", |h| h["in_flight"] == 0);
    let mut client = open_chat(server.addr, "m", false);
    let req = worker.request();
    worker.complete(&req.request_id, 200, "still works");
    assert_eq!(read_response(&mut client).text(), "still works");
}

#[test]
fn worker_death_before_first_byte_requeues_to_another_worker() {
    let server = TestServer::start();
    let a = FakeWorker::connect(server.addr, &["m"], 1);
    let mut client = open_chat(server.addr, "m", false);
    let first = a.request();
    let b = FakeWorker::connect(server.addr, &["m"], 1);
    a.kill();
    let again = b.request();
    assert_eq!(again.request_id, first.request_id);
    b.complete(&again.request_id, 200, "from b");
    assert_eq!(read_response(&mut client).text(), "from b");
}

#[test]
fn requeue_exhausted_is_503() {
    let server = TestServer::start();
    let mut client = open_chat(server.addr, "m", false);
    for _ in 0..4 {
        let w = FakeWorker::connect(server.addr, &["m"], 1);
        w.request();
        w.kill();
        w.closed();
    }
    let resp = read_response(&mut client);
    assert_eq!(resp.status, 503);
    assert_eq!(resp.json()["error"]["code"], "requeue_exhausted");
}

#[test]
fn worker_death_mid_stream_ends_the_stream_with_an_error_and_never_splices() {
    let server = TestServer::start();
    let a = FakeWorker::connect(server.addr, &["m"], 1);
    let b = FakeWorker::connect(server.addr, &["m"], 1);
    let mut client = open_chat(server.addr, "m", true);
    // Whichever worker the request went to (no time limit on finding out).
    let (streaming, idle) = match FakeWorker::first_request(&[&a, &b]) {
        (0, r) => ((a, r), b),
        (_, r) => ((b, r), a),
    };
    streaming.0.chunk(&streaming.1.request_id, "data: part\n\n");
    let mut reader = BufReader::new(&mut client);
    let (status, _) = read_head(&mut reader);
    assert_eq!(status, 200);
    assert_eq!(read_chunk(&mut reader).unwrap(), b"data: part\n\n");
    streaming.0.kill();
    let err = String::from_utf8(read_chunk(&mut reader).expect("error event")).unwrap();
    assert!(err.contains("worker_disconnected"), "{err}");
    assert_eq!(read_chunk(&mut reader), None);
    assert!(
        idle.recv_within(Duration::from_millis(300)).is_none(),
        "not requeued"
    );
}

#[test]
fn shutdown_refuses_new_work_drains_in_flight_then_finishes() {
    let mut server = TestServer::start();
    let worker = FakeWorker::connect(server.addr, &["m"], 2);
    let mut client = open_chat(server.addr, "m", false);
    let req = worker.request();
    let done = server.shutdown();
    match worker.recv() {
        ServerMessage::GracefulShutdown { .. } => {}
        other => panic!("expected graceful_shutdown, got {other:?}"),
    }
    let refused = post(server.addr, "/v1/chat/completions", &chat("m", false));
    assert_eq!(refused.status, 503);
    assert!(done.try_recv().is_err(), "still draining");
    worker.complete(&req.request_id, 200, "finished during drain");
    assert_eq!(read_response(&mut client).text(), "finished during drain");
    done.recv_timeout(WAIT)
        .expect("shutdown completes once idle");
    worker.closed();
}

#[test]
fn two_hundred_concurrent_requests_across_four_workers_no_loss_no_duplicates() {
    // All 200 are the `default` tenant: its share of the queue must hold them too.
    let server = TestServer::start_with(|c| {
        c.dispatch.max_queue_len = 500;
        c.dispatch.max_queue_per_tenant = 500;
    });
    let workers: Vec<FakeWorker> = (0..4)
        .map(|_| FakeWorker::connect(server.addr, &["m"], 8))
        .collect();
    let (seen_tx, seen_rx) = crossbeam_channel::unbounded();
    // Workers answer until every client has its answer (not until a quiet spell, which
    // a slow machine could produce mid-run).
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut handles = Vec::new();
    for w in workers {
        let seen_tx = seen_tx.clone();
        let stop = stop.clone();
        handles.push(std::thread::spawn(move || {
            let mut n = 0;
            while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                if let Some(ServerMessage::Request(r)) = w.recv_within(Duration::from_millis(20)) {
                    seen_tx.send(r.request_id.clone()).unwrap();
                    // Echo the client's marker so each client can check it got its own answer.
                    w.complete(&r.request_id, 200, &r.body);
                    n += 1;
                }
            }
            n
        }));
    }
    drop(seen_tx);
    let clients: Vec<_> = (0..200)
        .map(|i| {
            let addr = server.addr;
            std::thread::spawn(move || {
                let body = json!({"model": "m", "marker": i}).to_string();
                let resp = post(addr, "/v1/chat/completions", &body);
                assert_eq!(resp.status, 200);
                assert_eq!(resp.text(), body, "client {i} got someone else's answer");
            })
        })
        .collect();
    for c in clients {
        c.join().expect("client ok");
    }
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    let per_worker: Vec<usize> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    let ids: Vec<String> = seen_rx.iter().collect();
    let unique: HashSet<&String> = ids.iter().collect();
    assert_eq!(ids.len(), 200, "every request dispatched once");
    assert_eq!(unique.len(), 200, "no duplicates");
    assert!(
        per_worker.iter().all(|n| *n > 0),
        "all workers used: {per_worker:?}"
    );
}
