//! One request must not hurt everyone: the auth-failure limiter behind a reverse proxy
//! (`TRUSTED_PROXIES`), and cross-site browser requests (`origin.rs`). The real server
//! on a real socket; the proxy is a small forwarding proxy in this file that adds
//! `X-Forwarded-For` as nginx's `$proxy_add_x_forwarded_for` does, so every client
//! arrives from the proxy's one address.

mod common;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};

use common::{
    chat, openai_answer, read_response, request, FakeWorker, Response, TestServer, Upgrade,
    ADMIN_TOKEN, SECRET,
};
use modelrelay::server::client_ip::TrustedProxies;
use modelrelay::server::origin::AllowedOrigins;
use serde_json::json;

/// A forwarding proxy on 127.0.0.1 that presents every connection to `server` as coming
/// from `client`: it adds `X-Forwarded-For: client` to the request head, then copies
/// bytes both ways (a WebSocket upgrade included).
fn proxy(server: SocketAddr, client: &'static str) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("addr");
    std::thread::spawn(move || {
        for down in listener.incoming().flatten() {
            std::thread::spawn(move || forward(down, server, client));
        }
    });
    addr
}

fn forward(mut down: TcpStream, server: SocketAddr, client: &str) {
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        match down.read(&mut byte) {
            Ok(1) => head.push(byte[0]),
            _ => return,
        }
    }
    head.truncate(head.len() - 2);
    head.extend_from_slice(format!("x-forwarded-for: {client}\r\n\r\n").as_bytes());
    let Ok(mut up) = TcpStream::connect(server) else {
        return;
    };
    if up.write_all(&head).is_err() {
        return;
    }
    let (Ok(mut up_read), Ok(mut down_write)) = (up.try_clone(), down.try_clone()) else {
        return;
    };
    std::thread::spawn(move || {
        let _ = std::io::copy(&mut up_read, &mut down_write);
        let _ = down_write.shutdown(std::net::Shutdown::Both);
    });
    let _ = std::io::copy(&mut down, &mut up);
    let _ = up.shutdown(std::net::Shutdown::Write);
}

fn admin_stats(via: SocketAddr, token: Option<&str>) -> u16 {
    let auth = token.map(|t| format!("Bearer {t}"));
    let headers: Vec<(&str, &str)> = auth.iter().map(|a| ("authorization", a.as_str())).collect();
    request(via, "GET", "/admin/stats", None, &headers).status
}

fn worker_connects(via: SocketAddr, secret: &str) -> Result<FakeWorker, u16> {
    let register = json!({"type": "register", "worker_name": "w", "models": ["m"],
        "max_concurrent": 1, "protocol_version": "1"});
    match FakeWorker::try_connect(
        via,
        "/v1/worker/connect?provider=local",
        Some(secret),
        register,
    ) {
        Upgrade::Ok(w) => Ok(w),
        Upgrade::Refused(status) => Err(status),
    }
}

#[test]
fn bad_admin_calls_from_one_forwarded_client_lock_out_no_one_else() {
    let server = TestServer::start_admin(|c| {
        c.trusted_proxies = TrustedProxies::parse("127.0.0.1").unwrap();
    });
    let attacker = proxy(server.addr, "203.0.113.66");
    let curious = proxy(server.addr, "203.0.113.77");
    let operator = proxy(server.addr, "198.51.100.8");
    let worker_host = proxy(server.addr, "198.51.100.7");

    // Header-less calls are plain 401s, however many: nothing to count.
    for _ in 0..15 {
        assert_eq!(admin_stats(curious, None), 401);
    }
    assert_eq!(admin_stats(curious, Some(ADMIN_TOKEN)), 200);

    // Wrong tokens: counted for that client only, 429 past the limit.
    let statuses: Vec<u16> = (0..12)
        .map(|_| admin_stats(attacker, Some("guess")))
        .collect();
    assert_eq!(&statuses[..10], &[401; 10]);
    assert_eq!(&statuses[10..], &[429, 429]);

    // Everyone else, all arriving from the same proxy address, still gets in.
    assert_eq!(admin_stats(operator, Some(ADMIN_TOKEN)), 200);
    let w = worker_connects(worker_host, SECRET).expect("a worker behind the proxy connects");
    // A worker on the attacker's own address is another kind of credential; and a
    // valid admin token always passes.
    let w2 = worker_connects(attacker, SECRET).expect("worker secret is counted apart");
    assert_eq!(admin_stats(attacker, Some(ADMIN_TOKEN)), 200);
    server.wait_health("both workers counted", |h| h["workers_connected"] == 2);
    drop((w, w2));
}

#[test]
fn a_workers_success_does_not_clear_admin_failures_and_untrusted_peers_forward_nothing() {
    let server = TestServer::start_admin(|c| {
        c.trusted_proxies = TrustedProxies::parse("10.0.0.0/8").unwrap();
    });
    // 127.0.0.1 is not trusted here: its X-Forwarded-For is ignored, so spreading
    // guesses over forged addresses does not spread the count.
    let forged_a = proxy(server.addr, "203.0.113.1");
    let forged_b = proxy(server.addr, "203.0.113.2");
    for n in 0..9 {
        let via = if n % 2 == 0 { forged_a } else { forged_b };
        assert_eq!(admin_stats(via, Some("guess")), 401);
    }
    // The same address's worker signs in; its admin failures stay.
    let _w = worker_connects(server.addr, SECRET).expect("worker connects");
    assert_eq!(admin_stats(server.addr, Some("guess")), 401, "the tenth");
    assert_eq!(admin_stats(forged_a, Some("guess")), 429);
    // And a wrong worker secret is refused by its own count, not the admin one.
    assert_eq!(worker_connects(server.addr, "wrong").err(), Some(401));
}

#[cfg(unix)]
#[test]
fn state_files_are_created_owner_only() {
    use std::os::unix::fs::PermissionsExt;
    let root = std::env::temp_dir().join(format!("mr-guard-state-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    let dir = root.join("state");
    let state = dir.clone();
    let server = TestServer::start_admin(move |c| c.state_dir = state);
    let auth = format!("Bearer {ADMIN_TOKEN}");
    let created = request(
        server.addr,
        "POST",
        "/admin/keys",
        Some(r#"{"name":"t"}"#),
        &[
            ("authorization", &auth),
            ("content-type", "application/json"),
        ],
    );
    assert_eq!(created.status, 201, "{}", created.text());
    let mode = |p: &std::path::Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode(&dir), 0o700, "the state directory");
    let mut files = Vec::new();
    for entry in std::fs::read_dir(&dir).unwrap().flatten() {
        let path = entry.path();
        if path.is_file() {
            assert_eq!(mode(&path), 0o600, "{}", path.display());
            files.push(entry.file_name().to_string_lossy().into_owned());
        }
    }
    assert!(files.iter().any(|f| f == "keys.json"), "{files:?}");
    drop(server);
    let _ = std::fs::remove_dir_all(&root);
}

/// A chat POST with exactly these `headers` (Host included, or not), answered by `w`
/// if it reaches it; `None` from `w` when it did not.
fn chat_with(addr: SocketAddr, w: &FakeWorker, headers: &[(&str, &str)]) -> (Response, bool) {
    let body = chat("m", false);
    let mut head = "POST /v1/chat/completions HTTP/1.1\r\nconnection: close\r\n".to_string();
    for (n, v) in headers {
        head.push_str(&format!("{n}: {v}\r\n"));
    }
    head.push_str(&format!("content-length: {}\r\n\r\n{body}", body.len()));
    let mut stream = TcpStream::connect(addr).expect("connect");
    stream.set_read_timeout(Some(common::WAIT)).ok();
    stream.write_all(head.as_bytes()).expect("write");
    let reached = match w.recv_within(std::time::Duration::from_millis(300)) {
        Some(modelrelay::protocol::ServerMessage::Request(r)) => {
            w.complete(&r.request_id, 200, &openai_answer("hello"));
            true
        }
        _ => false,
    };
    (read_response(&mut stream), reached)
}

#[test]
fn cross_site_pages_and_rebound_names_are_refused_tools_and_own_pages_pass() {
    let server = TestServer::start(); // listens on 127.0.0.1: loopback only
    let w = FakeWorker::connect(server.addr, &["m"], 4);
    let port = server.addr.port();
    let own = format!("localhost:{port}");
    let own_origin = format!("http://{own}");
    let ip_host = format!("127.0.0.1:{port}");
    let rebound = format!("evil.example:{port}");

    // curl / SDKs: no Origin.
    let (r, reached) = chat_with(server.addr, &w, &[("host", &ip_host)]);
    assert_eq!((r.status, reached), (200, true), "{}", r.text());
    // HTTP/1.0-style, no Host at all.
    let (r, _) = chat_with(server.addr, &w, &[]);
    assert_eq!(r.status, 200, "{}", r.text());
    // A page of this server.
    let (r, _) = chat_with(server.addr, &w, &[("host", &own), ("origin", &own_origin)]);
    assert_eq!(r.status, 200, "{}", r.text());
    assert!(r.header("access-control-allow-origin").is_none());

    // Another site's page, by Origin or by Sec-Fetch-Site.
    for headers in [
        vec![("host", own.as_str()), ("origin", "http://evil.example")],
        vec![("host", own.as_str()), ("origin", "null")],
        vec![("host", own.as_str()), ("sec-fetch-site", "cross-site")],
    ] {
        let (r, reached) = chat_with(server.addr, &w, &headers);
        assert_eq!(r.status, 403, "{headers:?}");
        assert_eq!(r.json()["error"]["code"], "cross_origin", "{headers:?}");
        assert!(r.header("x-request-id").is_some());
        assert!(!reached, "{headers:?} reached the worker");
    }
    // DNS rebinding: the page is same-origin with itself, but its Host is not ours.
    let (r, reached) = chat_with(
        server.addr,
        &w,
        &[("host", &rebound), ("origin", &format!("http://{rebound}"))],
    );
    assert_eq!((r.status, reached), (403, false));
    assert_eq!(r.json()["error"]["code"], "host_not_allowed");
    let mut s = TcpStream::connect(server.addr).unwrap();
    write!(
        s,
        "GET /v1/models HTTP/1.1\r\nhost: {rebound}\r\nconnection: close\r\n\r\n"
    )
    .unwrap();
    assert_eq!(read_response(&mut s).status, 403, "reading the model list");
}

#[test]
fn a_relay_on_the_lan_answers_any_name_and_allowed_origins_get_cors() {
    let server = TestServer::start_with(|c| {
        c.listen_addr = "0.0.0.0:0".into();
        c.allowed_origins = AllowedOrigins::parse("http://app.lan:3000").unwrap();
    });
    let addr = SocketAddr::from(([127, 0, 0, 1], server.addr.port()));
    let w = FakeWorker::connect(addr, &["m"], 4);
    for host in ["relay.lan:8080", "192.168.1.20:8080", "relay"] {
        let (r, reached) = chat_with(addr, &w, &[("host", host)]);
        assert_eq!((r.status, reached), (200, true), "{host}: {}", r.text());
    }
    let app = ("origin", "http://app.lan:3000");
    let host = ("host", "relay.lan:8080");
    // The preflight is answered without reaching any route.
    let pre = request(
        addr,
        "OPTIONS",
        "/v1/chat/completions",
        None,
        &[
            app,
            ("access-control-request-method", "POST"),
            (
                "access-control-request-headers",
                "authorization, content-type",
            ),
        ],
    );
    assert_eq!(pre.status, 204, "{}", pre.text());
    assert_eq!(
        pre.header("access-control-allow-origin"),
        Some("http://app.lan:3000")
    );
    assert!(pre
        .header("access-control-allow-methods")
        .is_some_and(|m| m.contains("POST")));
    assert_eq!(
        pre.header("access-control-allow-headers"),
        Some("authorization, content-type")
    );
    // Its answers, and errors, carry the CORS headers.
    let (r, reached) = chat_with(addr, &w, &[host, app]);
    assert_eq!((r.status, reached), (200, true), "{}", r.text());
    assert_eq!(
        r.header("access-control-allow-origin"),
        Some("http://app.lan:3000")
    );
    let missing = request(addr, "GET", "/nowhere", None, &[app]);
    assert_eq!(missing.status, 404);
    assert_eq!(
        missing.header("access-control-allow-origin"),
        Some("http://app.lan:3000")
    );
    // Not carried over to the next request on the same (keep-alive) connection.
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(common::WAIT)).ok();
    let get = |origin: &str| format!("GET /health HTTP/1.1\r\nhost: relay.lan\r\n{origin}\r\n");
    s.write_all(get("origin: http://app.lan:3000\r\n").as_bytes())
        .unwrap();
    let first = read_response(&mut s);
    assert_eq!(
        first.header("access-control-allow-origin"),
        Some("http://app.lan:3000")
    );
    s.write_all(get("").as_bytes()).unwrap();
    let second = read_response(&mut s);
    assert_eq!(second.status, 200);
    assert!(second.header("access-control-allow-origin").is_none());
    // Another origin is still refused, preflight included.
    let other = ("origin", "http://other.lan");
    let (r, reached) = chat_with(addr, &w, &[host, other]);
    assert_eq!((r.status, reached), (403, false));
    let pre = request(
        addr,
        "OPTIONS",
        "/v1/chat/completions",
        None,
        &[other, ("access-control-request-method", "POST")],
    );
    assert_eq!(pre.status, 403);
    assert!(pre.header("access-control-allow-origin").is_none());
}
