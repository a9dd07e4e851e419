//! Sleeping boxes woken on demand, all on loopback: the "LAN broadcast address" is a UDP
//! listener on 127.0.0.1, never a real broadcast or LAN address. A box "wakes" when the
//! test starts its worker after the magic packet arrived.

mod common;
#[path = "../examples/support/fake_backend.rs"]
mod fake_backend;

use std::io::{BufRead, BufReader};
use std::net::{SocketAddr, UdpSocket};
use std::time::{Duration, Instant};

use common::procs::start_worker;
use common::*;
use fake_backend::FakeBackend;
use serde_json::json;

const MAC: &str = "02:00:00:00:00:01";

/// The stand-in for the LAN: where magic packets arrive.
fn lan() -> (UdpSocket, SocketAddr) {
    let socket = UdpSocket::bind("127.0.0.1:0").expect("udp");
    socket.set_read_timeout(Some(WAIT)).expect("timeout");
    let addr = socket.local_addr().expect("addr");
    (socket, addr)
}

/// Waits for one magic packet and checks it is for [`MAC`].
fn expect_packet(lan: &UdpSocket) {
    let mut buf = [0u8; 256];
    let (n, _) = lan.recv_from(&mut buf).expect("a magic packet arrives");
    assert_eq!(n, 102);
    assert_eq!(&buf[..6], &[0xFF; 6]);
    assert_eq!(&buf[6..12], &[2, 0, 0, 0, 0, 1]);
    assert_eq!(&buf[96..102], &[2, 0, 0, 0, 0, 1]);
}

/// A fake worker for `gpu` serving `m` that says where it is woken.
fn gpu_box(server: SocketAddr, lan: SocketAddr) -> FakeWorker {
    let register = json!({
        "type": "register", "worker_name": "gpu", "models": ["m"], "max_concurrent": 1,
        "protocol_version": "1", "current_load": 0,
        "wake": {"mac": MAC, "broadcast": lan.to_string()}
    });
    match FakeWorker::try_connect(server, "/v1/worker/connect", Some(SECRET), register) {
        Upgrade::Ok(w) => w,
        Upgrade::Refused(s) => panic!("refused: {s}"),
    }
}

/// `GET` an admin path of a [`TestServer::start_admin`] relay.
fn admin_get(server: &TestServer, path: &str) -> serde_json::Value {
    let auth = format!("Bearer {ADMIN_TOKEN}");
    request(server.addr, "GET", path, None, &[("authorization", &auth)]).json()
}

fn wait_workers(server: &TestServer, n: u64) {
    server.wait_health(&format!("{n} workers"), |h| h["workers_connected"] == n);
}

#[test]
fn a_request_for_a_sleeping_box_wakes_it_through_an_awake_worker_and_is_answered() {
    let (lan, lan_addr) = lan();
    let backend = FakeBackend::new("m", "awake now")
        .spawn("127.0.0.1:0")
        .expect("backend");
    // A queue timeout far below the wake: the request must wait for the box instead.
    let server = TestServer::start_admin(|c| c.dispatch.queue_timeout = Duration::from_secs(1));
    // The always-on NAS: a real worker that sends magic packets when asked.
    let _nas = start_worker(
        server.addr,
        backend,
        &[("WORKER_NAME", "nas"), ("MODELS", "small")],
    );
    wait_workers(&server, 1);
    let broadcast = lan_addr.to_string();
    let gpu_env = [
        ("WORKER_NAME", "gpu"),
        ("MODELS", "m"),
        ("WAKE_MAC", MAC),
        ("WAKE_BROADCAST", broadcast.as_str()),
    ];
    let mut gpu = start_worker(server.addr, backend, &gpu_env);
    wait_workers(&server, 2);
    // The box vanishes (powered down): the relay remembers it asleep.
    gpu.signal("KILL");
    gpu.wait_exit();
    wait_workers(&server, 1);

    let asked = Instant::now();
    let client = send_request(
        server.addr,
        "POST",
        "/v1/chat/completions",
        Some(&chat("m", true)),
        &[
            ("content-type", "application/json"),
            ("x-queue-updates", "true"),
        ],
    );
    expect_packet(&lan);
    let to_packet = asked.elapsed();
    let mut reader = BufReader::new(client.try_clone().expect("clone"));
    // The waiting stream hears which box is being woken.
    let mut seen = String::new();
    while !seen.contains(": waking gpu") {
        let mut line = String::new();
        assert!(reader.read_line(&mut line).expect("read") > 0, "{seen}");
        seen.push_str(&line);
    }
    let woken = Instant::now();
    let _gpu = start_worker(server.addr, backend, &gpu_env);
    let mut rest = String::new();
    while !rest.contains("[DONE]") {
        let mut line = String::new();
        if reader.read_line(&mut line).expect("read") == 0 {
            break;
        }
        rest.push_str(&line);
    }
    assert!(rest.contains("awake"), "{rest}");
    let _ = client.shutdown(std::net::Shutdown::Both);
    println!(
        "wake figures: request to magic packet {:.1} ms; worker start to answer {:.1} ms (includes process start and registration)",
        to_packet.as_secs_f64() * 1000.0,
        woken.elapsed().as_secs_f64() * 1000.0
    );
}

#[test]
fn a_box_that_never_wakes_fails_its_request_naming_it_at_the_wake_timeout() {
    let (lan, lan_addr) = lan();
    let server = TestServer::start_admin(|c| {
        c.dispatch.queue_timeout = Duration::from_millis(200);
        c.dispatch.wake.timeout = Duration::from_secs(1);
        c.dispatch.wake.from_relay = true;
    });
    let gpu = gpu_box(server.addr, lan_addr);
    wait_workers(&server, 1);
    gpu.kill();
    wait_workers(&server, 0);
    // Clients still see the model, so they can ask for it and wake the box.
    wait_until("/v1/models lists the sleeping box's model", || {
        let models = request(server.addr, "GET", "/v1/models", None, &[]).json();
        (models["data"][0]["id"] == "m", models.to_string())
    });
    let asked = Instant::now();
    let r = post(server.addr, "/v1/chat/completions", &chat("m", false));
    expect_packet(&lan);
    assert_eq!(r.status, 503, "{}", r.text());
    let body = r.json();
    assert_eq!(body["error"]["code"], "worker_asleep", "{body}");
    assert!(
        body["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("`gpu`") && m.contains("1s")),
        "{body}"
    );
    assert!(asked.elapsed() >= Duration::from_secs(1));
}

#[test]
fn a_restarted_relay_remembers_sleeping_boxes_and_wakes_them() {
    let (lan, lan_addr) = lan();
    let dir = std::env::temp_dir().join(format!("mr-power-restart-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let state = dir.clone();
    let mut first = TestServer::start_with(move |c| c.state_dir = state);
    let gpu = gpu_box(first.addr, lan_addr);
    wait_workers(&first, 1);
    gpu.kill();
    let file = dir.join("sleepers.json");
    wait_until("sleepers.json names gpu", || {
        let text = std::fs::read_to_string(&file).unwrap_or_default();
        (text.contains("\"gpu\""), text)
    });
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(&file).expect("file").permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
    }
    first
        .shutdown()
        .recv_timeout(WAIT)
        .expect("first relay stops");

    let state = dir.clone();
    let second = TestServer::start_with(move |c| {
        c.state_dir = state;
        c.dispatch.wake.from_relay = true;
    });
    let addr = second.addr;
    let client = std::thread::spawn(move || post(addr, "/v1/chat/completions", &chat("m", false)));
    expect_packet(&lan);
    let registering = Instant::now();
    let gpu = gpu_box(second.addr, lan_addr);
    let req = gpu.request();
    println!(
        "wake figures: register sent to the waiting request received {:.2} ms (WebSocket upgrade, register, ack, dispatch)",
        registering.elapsed().as_secs_f64() * 1000.0
    );
    gpu.complete(&req.request_id, 200, &openai_answer("good morning"));
    let r = client.join().expect("client");
    assert_eq!(r.status, 200, "{}", r.text());
    assert!(r.text().contains("good morning"));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn an_idle_worker_asks_to_sleep_runs_its_suspend_command_and_the_relay_marks_it_asleep() {
    let (lan, lan_addr) = lan();
    let dir = std::env::temp_dir().join(format!("mr-power-suspend-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("dir");
    let marker = dir.join("suspended");
    let backend = FakeBackend::new("m", "hi")
        .spawn("127.0.0.1:0")
        .expect("backend");
    let server = TestServer::start_admin(|c| {
        c.dispatch.wake.from_relay = true;
        c.idle_watts = Some(100.0);
    });
    let broadcast = lan_addr.to_string();
    let cmd = format!("touch '{}'", marker.display());
    let gpu = start_worker(
        server.addr,
        backend,
        &[
            ("WORKER_NAME", "gpu"),
            ("MODELS", "m"),
            ("WAKE_MAC", MAC),
            ("WAKE_BROADCAST", broadcast.as_str()),
            ("IDLE_SUSPEND_SECS", "1"),
            ("SUSPEND_CMD", cmd.as_str()),
        ],
    );
    gpu.wait_line("idle for 1s: asking the relay to sleep");
    gpu.wait_line("going to sleep: running SUSPEND_CMD");
    wait_until("the suspend command ran", || {
        (marker.exists(), String::new())
    });
    let sleeping = || admin_get(&server, "/admin/workers")["sleeping"].clone();
    wait_until("the relay lists gpu asleep", || {
        let s = sleeping();
        (
            s[0]["name"] == "gpu" && s[0]["power"] == "asleep",
            s.to_string(),
        )
    });
    let s = sleeping();
    assert_eq!(s[0]["models"], json!(["m"]));
    assert_eq!(s[0]["wake_mac"], MAC);
    assert!(s[0]["energy_saved_wh"].is_number(), "{s}");
    assert_eq!(server.health()["workers_connected"], 0);
    // Asleep, it is woken for the next request (the relay sends the packet here).
    let addr = server.addr;
    let client = std::thread::spawn(move || post(addr, "/v1/chat/completions", &chat("m", false)));
    expect_packet(&lan);
    wait_until("the relay lists gpu waking", || {
        let s = sleeping();
        (s[0]["power"] == "waking", s.to_string())
    });
    drop(gpu);
    let _back = start_worker(
        server.addr,
        backend,
        &[("WORKER_NAME", "gpu"), ("MODELS", "m")],
    );
    let r = client.join().expect("client");
    assert_eq!(r.status, 200, "{}", r.text());
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn an_operator_pins_a_worker_awake_and_the_pin_outlives_a_reconnect() {
    let server = TestServer::start_admin(|_| {});
    let lan: SocketAddr = "127.0.0.1:9".parse().expect("addr");
    let gpu = gpu_box(server.addr, lan);
    wait_workers(&server, 1);
    let id = server.workers()[0]["id"].as_str().expect("id").to_string();
    assert_eq!(server.workers()[0]["wakeable"], true);
    assert_eq!(server.workers()[0]["stay_awake"], false);
    let auth = format!("Bearer {ADMIN_TOKEN}");
    let r = request(
        server.addr,
        "POST",
        &format!("/admin/workers/{id}/stay-awake"),
        Some(r#"{"on": true}"#),
        &[
            ("authorization", &auth),
            ("content-type", "application/json"),
        ],
    );
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(server.workers()[0]["stay_awake"], true);
    // The box drops off and comes back (a new connection, a new worker id): still pinned.
    gpu.kill();
    wait_workers(&server, 0);
    let _gpu = gpu_box(server.addr, lan);
    wait_workers(&server, 1);
    let back = &server.workers()[0];
    assert_ne!(back["id"], id.as_str());
    assert_eq!(back["stay_awake"], true, "{back}");
    let r = request(
        server.addr,
        "POST",
        "/admin/workers/w-999/stay-awake",
        None,
        &[("authorization", &auth)],
    );
    assert_eq!(r.status, 404);
}

#[test]
fn a_worker_yields_while_its_owner_is_busy_and_then_takes_work_again() {
    let dir = std::env::temp_dir().join(format!("mr-power-owner-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("dir");
    let flag = dir.join("gaming");
    let backend = FakeBackend::new("m", "yours again")
        .spawn("127.0.0.1:0")
        .expect("backend");
    let server = TestServer::start_admin(|c| c.dispatch.queue_timeout = Duration::from_secs(60));
    let cmd = format!("test -e '{}'", flag.display());
    let _gpu = start_worker(
        server.addr,
        backend,
        &[
            ("WORKER_NAME", "gpu"),
            ("MODELS", "m"),
            ("OWNER_BUSY_CMD", cmd.as_str()),
            ("OWNER_CHECK_SECS", "1"),
        ],
    );
    wait_workers(&server, 1);
    std::fs::write(&flag, "").expect("flag");
    wait_until("the worker yields", || {
        let w = server.workers();
        (
            w[0]["power"] == "yielded" && w[0]["power_since_unix"].is_number(),
            format!("{w:?}"),
        )
    });
    let addr = server.addr;
    let client = std::thread::spawn(move || post(addr, "/v1/chat/completions", &chat("m", false)));
    // It waits in the queue rather than going to the yielded worker.
    wait_until("the request is queued", || {
        let s = admin_get(&server, "/admin/stats");
        (s["queue"]["depth"] == 1, s["queue"].to_string())
    });
    assert_eq!(server.workers()[0]["in_flight"], 0);
    std::fs::remove_file(&flag).expect("owner done");
    let r = client.join().expect("client");
    assert_eq!(r.status, 200, "{}", r.text());
    assert!(r.text().contains("yours again"));
    assert_eq!(server.workers()[0]["power"], "awake");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn the_energy_saved_adds_up_over_sleeps_and_restarts() {
    let dir = std::env::temp_dir().join(format!("mr-power-energy-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("dir");
    // A previous run saw the box sleep an hour before, and asleep again for an hour now.
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock")
        .as_secs();
    let file = json!({"version": 1, "boxes": [{
        "name": "gpu", "models": ["m"], "since_unix": now - 3600, "slept_secs": 3600,
        "wake": {"mac": MAC, "broadcast": "127.0.0.1:9"}
    }]});
    std::fs::write(dir.join("sleepers.json"), file.to_string()).expect("write");
    let state = dir.clone();
    let server = TestServer::start_admin(move |c| {
        c.state_dir = state;
        c.idle_watts = Some(100.0);
    });
    let sleeping = || admin_get(&server, "/admin/workers")["sleeping"].clone();
    assert_eq!(
        sleeping()[0]["energy_saved_wh"],
        json!(200.0),
        "{}",
        sleeping()
    );
    // Awake, it keeps what it saved.
    let gpu = gpu_box(server.addr, "127.0.0.1:9".parse().expect("addr"));
    wait_workers(&server, 1);
    assert_eq!(server.workers()[0]["energy_saved_wh"], json!(200.0));
    // Asleep again, the next sleep adds to it.
    gpu.kill();
    wait_workers(&server, 0);
    wait_until("gpu is asleep again", || {
        let s = sleeping();
        (s[0]["energy_saved_wh"] == json!(200.0), s.to_string())
    });
    let _ = std::fs::remove_dir_all(&dir);
}
