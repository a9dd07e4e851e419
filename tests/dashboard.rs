//! The dashboard and setup wizard over real sockets: sign-in and its cookie, the Origin
//! check on every action, the security headers, no data without a session, the live
//! feed (and its end at sign-out), and worker downloads from `WORKER_DOWNLOAD_DIR`.
//! The pages themselves are exercised in a real browser by `tests/browser/`.
#![cfg(feature = "dashboard")]

mod common;

use std::io::BufReader;
use std::net::TcpStream;
use std::path::PathBuf;

use common::{
    read_chunk, read_head, request, send_request, wait_until, FakeWorker, Response, TestServer,
    ADMIN_TOKEN, SECRET,
};
use modelrelay::protocol::ServerMessage;
use serde_json::{json, Value};
use sha2::{Digest, Sha256};

/// `Host` of every request `common::request` sends, so our pages' Origin is this.
const ORIGIN: &str = "http://localhost";

fn form_sign_in(server: &TestServer, token: &str) -> Response {
    let body = format!("token={token}&next=%2Fsetup");
    request(
        server.addr,
        "POST",
        "/dashboard/signin",
        Some(&body),
        &[
            ("content-type", "application/x-www-form-urlencoded"),
            ("origin", ORIGIN),
        ],
    )
}

/// Signs in and returns the `Cookie` header value.
fn sign_in(server: &TestServer) -> String {
    let r = request(
        server.addr,
        "POST",
        "/dashboard/signin",
        Some(&json!({ "token": ADMIN_TOKEN }).to_string()),
        &[("content-type", "application/json")],
    );
    assert_eq!(r.status, 200, "{}", r.text());
    cookie_of(&r)
}

fn cookie_of(r: &Response) -> String {
    let set = r.header("set-cookie").expect("set-cookie");
    set.split(';').next().unwrap().to_string()
}

fn act(
    server: &TestServer,
    path: &str,
    body: &str,
    cookie: &str,
    extra: &[(&str, &str)],
) -> Response {
    let mut headers = vec![("cookie", cookie), ("content-type", "application/json")];
    headers.extend_from_slice(extra);
    request(server.addr, "POST", path, Some(body), &headers)
}

fn assert_security_headers(r: &Response) {
    let csp = r.header("content-security-policy").expect("CSP");
    for part in [
        "default-src 'self'",
        "script-src 'self'",
        "frame-ancestors 'none'",
    ] {
        assert!(csp.contains(part), "{csp}");
    }
    assert!(
        !csp.contains("unsafe-inline") && !csp.contains("unsafe-eval"),
        "{csp}"
    );
    assert_eq!(r.header("x-content-type-options"), Some("nosniff"));
    assert_eq!(r.header("referrer-policy"), Some("same-origin"));
    assert_eq!(r.header("x-frame-options"), Some("DENY"));
}

fn temp_dir(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("mr-dash-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// An open event stream: its reader, after the head.
struct Feed {
    reader: BufReader<TcpStream>,
}

impl Feed {
    fn open(server: &TestServer, cookie: &str) -> (u16, Vec<(String, String)>, Feed) {
        let stream = send_request(
            server.addr,
            "GET",
            "/dashboard/events",
            None,
            &[("cookie", cookie)],
        );
        let mut reader = BufReader::new(stream);
        let (status, headers) = read_head(&mut reader);
        (status, headers, Feed { reader })
    }

    /// The next snapshot (skipping keep-alives); `None` when the stream ended.
    fn next(&mut self) -> Option<Value> {
        loop {
            let chunk = read_chunk(&mut self.reader)?;
            let text = String::from_utf8(chunk).unwrap();
            if let Some(data) = text.strip_prefix("event: snapshot\ndata: ") {
                return Some(serde_json::from_str(data.trim_end()).expect("snapshot JSON"));
            }
        }
    }

    fn until(&mut self, what: &str, pred: impl Fn(&Value) -> bool) -> Value {
        loop {
            match self.next() {
                Some(v) if pred(&v) => return v,
                Some(_) => continue,
                None => panic!("the feed ended before {what}"),
            }
        }
    }
}

#[test]
fn signed_out_pages_carry_no_data_and_data_routes_answer_401() {
    let server = TestServer::start_admin(|_| {});
    let _w = FakeWorker::connect(server.addr, &["secret-model"], 1);
    let r = request(server.addr, "GET", "/dashboard", None, &[]);
    assert_eq!(r.status, 200);
    assert_security_headers(&r);
    assert!(r.text().contains("name=\"token\""), "no sign-in form");
    assert!(!r.text().contains("secret-model"));
    for (method, path) in [
        ("GET", "/dashboard/events"),
        ("POST", "/dashboard/api/models/refresh"),
        ("POST", "/dashboard/api/keys"),
        ("POST", "/dashboard/api/workers/w-1/drain"),
    ] {
        let r = request(server.addr, method, path, Some("{}"), &[("origin", ORIGIN)]);
        assert_eq!(r.status, 401, "{method} {path}: {}", r.text());
        assert_eq!(r.json()["error"]["code"], "signed_out");
        assert_security_headers(&r);
    }
    let junk = request(
        server.addr,
        "GET",
        "/dashboard/events",
        None,
        &[("cookie", "modelrelay_session=00ff")],
    );
    assert_eq!(junk.status, 401);
    let setup = request(server.addr, "GET", "/setup", None, &[]);
    assert_eq!(setup.status, 200);
    assert_security_headers(&setup);
    let info = request(server.addr, "GET", "/setup/info", None, &[]).json();
    assert_eq!(info["signed_in"], false);
    assert_eq!(info["worker_secret"], Value::Null);
    assert_eq!(info["public_url"], "http://localhost");
    let css = request(server.addr, "GET", "/dashboard/assets/style.css", None, &[]);
    assert_eq!(css.status, 200);
    assert!(css.header("content-type").unwrap().starts_with("text/css"));
    assert_eq!(
        request(server.addr, "GET", "/dashboard/assets/../../etc", None, &[]).status,
        404
    );
}

#[test]
fn sign_in_gives_a_strict_http_only_cookie_and_failures_are_limited_per_ip() {
    let server = TestServer::start_admin(|_| {});
    let wrong = form_sign_in(&server, "nope");
    assert_eq!(wrong.status, 401);
    assert!(wrong.header("set-cookie").is_none());
    assert!(
        wrong.text().contains("wrong admin token"),
        "{}",
        wrong.text()
    );
    let ok = form_sign_in(&server, ADMIN_TOKEN);
    assert_eq!(ok.status, 303, "{}", ok.text());
    assert_eq!(ok.header("location"), Some("/setup"));
    let set = ok.header("set-cookie").unwrap();
    let value = set
        .split(';')
        .next()
        .unwrap()
        .strip_prefix("modelrelay_session=")
        .unwrap();
    assert_eq!(value.len(), 64, "{set}");
    for flag in ["Path=/", "Max-Age=43200", "HttpOnly", "SameSite=Strict"] {
        assert!(set.contains(flag), "{set} lacks {flag}");
    }
    assert!(
        !set.contains("Secure"),
        "plain HTTP: no Secure flag ({set})"
    );
    let cookie = cookie_of(&ok);
    let page = request(
        server.addr,
        "GET",
        "/dashboard",
        None,
        &[("cookie", &cookie)],
    );
    assert!(
        page.text().contains("id=\"workers\""),
        "signed in, yet no dashboard"
    );
    let info = request(
        server.addr,
        "GET",
        "/setup/info",
        None,
        &[("cookie", &cookie)],
    )
    .json();
    assert_eq!(
        (info["signed_in"].clone(), info["worker_secret"].clone()),
        (json!(true), json!(SECRET))
    );
    // A login form on another site must not sign the operator in.
    let forged = request(
        server.addr,
        "POST",
        "/dashboard/signin",
        Some(&format!("token={ADMIN_TOKEN}")),
        &[("origin", "http://evil.example")],
    );
    assert_eq!(forged.status, 403);
    // The same per-IP admin limit as the admin API: 10 failures, then 429 for guesses;
    // the right token always passes.
    for _ in 0..10 {
        form_sign_in(&server, "guess");
    }
    assert_eq!(form_sign_in(&server, "guess").status, 429);
    let admin = |token: &str| {
        let auth = format!("Bearer {token}");
        request(
            server.addr,
            "GET",
            "/admin/workers",
            None,
            &[("authorization", &auth)],
        )
        .status
    };
    assert_eq!(admin("guess"), 429, "the admin API shares the limit");
    assert_eq!(admin(ADMIN_TOKEN), 200, "a valid token passes");
    assert_ne!(form_sign_in(&server, ADMIN_TOKEN).status, 429);
}

#[test]
fn behind_https_the_cookie_is_secure_and_the_public_origin_is_accepted() {
    let server =
        TestServer::start_admin(|c| c.public_url = Some("https://relay.example.com".into()));
    let r = request(
        server.addr,
        "POST",
        "/dashboard/signin",
        Some(&format!("token={ADMIN_TOKEN}")),
        &[("origin", "https://relay.example.com")],
    );
    assert_eq!(r.status, 303, "{}", r.text());
    assert!(r.header("set-cookie").unwrap().contains("; Secure"));
    let cookie = cookie_of(&r);
    let refresh = act(
        &server,
        "/dashboard/api/models/refresh",
        "{}",
        &cookie,
        &[("origin", "https://relay.example.com")],
    );
    assert_eq!(refresh.status, 202, "{}", refresh.text());
    let info = request(server.addr, "GET", "/setup/info", None, &[]).json();
    assert_eq!(info["public_url"], "https://relay.example.com");
}

#[test]
fn actions_need_a_session_and_our_origin_and_reach_the_same_code_as_the_admin_api() {
    let server = TestServer::start_admin(|_| {});
    let cookie = sign_in(&server);
    let w = FakeWorker::connect(server.addr, &["m"], 1);
    let drain = format!("/dashboard/api/workers/{}/drain", w.worker_id);
    for refused in [
        vec![],
        vec![("origin", "http://evil.example")],
        vec![("origin", "null")],
        vec![("origin", ORIGIN), ("sec-fetch-site", "cross-site")],
    ] {
        let r = act(&server, &drain, "{}", &cookie, &refused);
        assert_eq!(r.status, 403, "{refused:?}: {}", r.text());
        assert_eq!(r.json()["error"]["code"], "cross_origin");
    }
    assert!(
        w.recv_within(std::time::Duration::from_millis(200))
            .is_none(),
        "a refused drain reached the worker"
    );
    let ours = [("origin", ORIGIN), ("sec-fetch-site", "same-origin")];
    let r = act(
        &server,
        "/dashboard/api/models/refresh",
        "{}",
        &cookie,
        &ours,
    );
    assert_eq!(
        (r.status, r.json()["refresh_sent"].clone()),
        (202, json!(true))
    );
    assert!(matches!(w.recv(), ServerMessage::ModelsRefresh { .. }));
    let r = act(&server, &drain, "{}", &cookie, &ours);
    assert_eq!(r.status, 202, "{}", r.text());
    assert!(matches!(w.recv(), ServerMessage::GracefulShutdown { .. }));
    let missing = act(
        &server,
        "/dashboard/api/workers/w-999/drain",
        "{}",
        &cookie,
        &ours,
    );
    assert_eq!(missing.json()["error"]["code"], "worker_not_found");
    // Keys: the secret comes back once, the list never shows it, revoke takes effect.
    let r = act(
        &server,
        "/dashboard/api/keys",
        r#"{"name":"laptop","tenant":"team-a"}"#,
        &cookie,
        &ours,
    );
    assert_eq!(r.status, 201, "{}", r.text());
    let (id, secret) = (
        r.json()["id"].as_str().unwrap().to_string(),
        r.json()["key"].as_str().unwrap().to_string(),
    );
    assert!(secret.starts_with("mr-"));
    let bad = act(
        &server,
        "/dashboard/api/keys",
        r#"{"name":""}"#,
        &cookie,
        &ours,
    );
    assert_eq!(
        bad.json()["error"]["code"],
        "invalid_name",
        "the admin API's own checks"
    );
    let r = act(
        &server,
        &format!("/dashboard/api/keys/{id}/revoke"),
        "{}",
        &cookie,
        &ours,
    );
    assert_eq!(r.status, 200, "{}", r.text());
    let auth = format!("Bearer {ADMIN_TOKEN}");
    let keys = request(
        server.addr,
        "GET",
        "/admin/keys",
        None,
        &[("authorization", &auth)],
    );
    assert!(!keys.text().contains(&secret));
    assert_eq!(keys.json()["keys"][0]["revoked"], true);
}

#[test]
fn the_feed_streams_snapshots_with_recent_requests_and_ends_at_sign_out() {
    let server = TestServer::start_admin(|_| {});
    let cookie = sign_in(&server);
    let (status, headers, mut feed) = Feed::open(&server, &cookie);
    assert_eq!(status, 200);
    let header = |n: &str| {
        headers
            .iter()
            .find(|(k, _)| k == n)
            .map(|(_, v)| v.as_str())
    };
    assert_eq!(header("content-type"), Some("text/event-stream"));
    assert!(header("content-security-policy").is_some());
    let first = feed.next().expect("a first snapshot at once");
    assert_eq!(first["workers"], json!([]));
    let w = FakeWorker::connect(server.addr, &["m"], 2);
    feed.until("the worker", |v| v["workers"][0]["max_concurrent"] == 2);
    // A request relayed through the worker shows up in the recent-requests ring, its
    // prompt nowhere.
    let client = std::thread::spawn({
        let addr = server.addr;
        move || {
            common::post(
                addr,
                "/v1/chat/completions",
                r#"{"model":"m","messages":[{"role":"user","content":"a very private prompt"}]}"#,
            )
        }
    });
    let req = w.request();
    feed.until("the busy slot", |v| v["workers"][0]["in_flight"] == 1);
    w.complete(&req.request_id, 200, &common::openai_answer("hi"));
    assert_eq!(client.join().unwrap().status, 200);
    let v = feed.until("the finished request", |v| {
        v["activity"]["recent"]
            .as_array()
            .is_some_and(|r| !r.is_empty())
    });
    let recent = &v["activity"]["recent"][0];
    assert_eq!(recent["id"], req.request_id.as_str());
    assert_eq!(
        (
            recent["model"].clone(),
            recent["worker"].clone(),
            recent["status"].clone()
        ),
        (json!("m"), json!("fake"), json!(200))
    );
    assert_eq!(v["activity"]["last_5m"]["requests"], 1);
    assert!(!v.to_string().contains("private prompt"));
    // Signing out ends the stream (within a second or so) and the cookie stops working.
    let out = request(
        server.addr,
        "POST",
        "/dashboard/signout",
        None,
        &[("cookie", &cookie), ("origin", ORIGIN)],
    );
    assert_eq!(out.status, 303);
    assert!(out.header("set-cookie").unwrap().contains("Max-Age=0"));
    while feed.next().is_some() {}
    let again = request(
        server.addr,
        "GET",
        "/dashboard/events",
        None,
        &[("cookie", &cookie)],
    );
    assert_eq!(again.status, 401);
}

#[test]
fn one_session_may_hold_only_a_few_streams() {
    let server = TestServer::start_admin(|_| {});
    let cookie = sign_in(&server);
    let feeds: Vec<Feed> = (0..8)
        .map(|_| {
            let (status, _, feed) = Feed::open(&server, &cookie);
            assert_eq!(status, 200);
            feed
        })
        .collect();
    let (status, _, _) = Feed::open(&server, &cookie);
    assert_eq!(status, 429);
    drop(feeds);
    wait_until("a stream slot freed", || {
        let (status, _, _) = Feed::open(&server, &cookie);
        (status == 200, format!("status {status}"))
    });
}

#[test]
fn downloads_come_from_the_directory_with_their_checksum_and_nothing_else() {
    let dir = temp_dir("downloads");
    let bytes: Vec<u8> = (0..200_000u32).map(|n| (n % 251) as u8).collect();
    std::fs::write(
        dir.join("modelrelay-worker-x86_64-unknown-linux-musl"),
        &bytes,
    )
    .unwrap();
    std::fs::write(dir.join("x86_64-pc-windows-msvc.exe"), b"MZ").unwrap();
    std::fs::write(dir.join("README.txt"), b"not a target").unwrap();
    std::fs::write(dir.parent().unwrap().join("mr-dash-outside"), b"secret").unwrap();
    let server = TestServer::start_admin({
        let dir = dir.clone();
        move |c| c.worker_download_dir = Some(dir)
    });
    let sha: String = Sha256::digest(&bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    let r = request(
        server.addr,
        "GET",
        "/setup/download/x86_64-unknown-linux-musl",
        None,
        &[],
    );
    assert_eq!(r.status, 200);
    assert_eq!(r.body, bytes);
    assert_eq!(r.header("x-checksum-sha256"), Some(sha.as_str()));
    assert_eq!(r.header("content-type"), Some("application/octet-stream"));
    assert!(r
        .header("content-disposition")
        .unwrap()
        .contains("modelrelay-worker-x86_64-unknown-linux-musl"));
    let sum = request(
        server.addr,
        "GET",
        "/setup/download/x86_64-unknown-linux-musl.sha256",
        None,
        &[],
    );
    assert_eq!(
        sum.text(),
        format!("{sha}  modelrelay-worker-x86_64-unknown-linux-musl\n")
    );
    let exe = request(
        server.addr,
        "GET",
        "/setup/download/x86_64-pc-windows-msvc",
        None,
        &[],
    );
    assert_eq!(exe.body, b"MZ");
    for path in [
        "/setup/download/../mr-dash-outside",
        "/setup/download/..%2fmr-dash-outside",
        "/setup/download/%2e%2e%2fmr-dash-outside",
        "/setup/download/..",
        "/setup/download/README.txt",
        "/setup/download/",
    ] {
        let r = request(server.addr, "GET", path, None, &[]);
        assert_eq!(r.status, 400, "{path}: {}", r.text());
        assert!(!r.text().contains("secret"));
    }
    assert_eq!(
        request(
            server.addr,
            "GET",
            "/setup/download/aarch64-apple-darwin",
            None,
            &[]
        )
        .status,
        404
    );
    let info = request(server.addr, "GET", "/setup/info", None, &[]).json();
    let listed: Vec<&String> = info["downloads"].as_object().unwrap().keys().collect();
    assert_eq!(
        listed,
        ["x86_64-pc-windows-msvc", "x86_64-unknown-linux-musl"]
    );
    assert_eq!(
        info["downloads"]["x86_64-unknown-linux-musl"]["sha256"],
        sha
    );
    let _ = std::fs::remove_dir_all(&dir);
    let _ = std::fs::remove_file(dir.parent().unwrap().join("mr-dash-outside"));
    let plain = TestServer::start_admin(|_| {});
    let r = request(
        plain.addr,
        "GET",
        "/setup/download/x86_64-unknown-linux-musl",
        None,
        &[],
    );
    assert_eq!(r.status, 404);
    assert!(r.text().contains("WORKER_DOWNLOAD_DIR"));
}

#[test]
fn without_an_admin_token_the_pages_say_how_to_set_one() {
    let server = TestServer::start();
    let r = request(server.addr, "GET", "/dashboard", None, &[]);
    assert_eq!(r.status, 403);
    assert!(r.text().contains("MODELRELAY_ADMIN_TOKEN"));
    assert_security_headers(&r);
    let r = request(
        server.addr,
        "POST",
        "/dashboard/signin",
        Some(r#"{"token":"anything"}"#),
        &[("content-type", "application/json")],
    );
    assert_eq!(r.status, 403);
    assert_eq!(r.json()["error"]["code"], "admin_disabled");
    let info = request(server.addr, "GET", "/setup/info", None, &[]).json();
    assert_eq!(info["admin_enabled"], false);
    assert_eq!(request(server.addr, "GET", "/setup", None, &[]).status, 200);
}
