//! Built-in TLS: curl over HTTPS, a worker over WSS trusting a private CA (`--ca-file`),
//! a clear log line when the worker does not trust the certificate, and SIGHUP reload.
#![cfg(feature = "server-tls")]

mod common;
#[path = "../examples/support/fake_backend.rs"]
mod fake_backend;

use std::process::Command;

use common::pki::Pki;
use common::procs::{start_worker, ServerProc};

fn curl(args: &[&str]) -> (bool, String) {
    let out = Command::new("curl")
        .args(["-s", "--max-time", "10"])
        .args(args)
        .output()
        .expect("curl");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
    )
}

#[test]
fn https_clients_and_a_wss_worker_with_a_private_ca_then_sighup_reload() {
    if !common::procs::tool("openssl") || !common::procs::tool("curl") {
        return;
    }
    let base = std::env::temp_dir().join(format!("mr-tls-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&base);
    let first = Pki::new(&base, "first");
    let live_cert = base.join("live.pem");
    let live_key = base.join("live.key");
    std::fs::copy(first.path("server.pem"), &live_cert).unwrap();
    std::fs::copy(first.path("server.key"), &live_key).unwrap();
    let server = ServerProc::start(&[
        ("TLS_CERT_FILE", live_cert.to_str().unwrap()),
        ("TLS_KEY_FILE", live_key.to_str().unwrap()),
    ]);
    let port = server.addr.port();
    let health = format!("https://localhost:{port}/health");

    let (ok, body) = curl(&["--cacert", &first.path("ca.pem"), &health]);
    assert!(ok && body.contains("\"status\":\"ok\""), "{body}");
    let (ok, _) = curl(&[&health]);
    assert!(!ok, "an untrusted certificate is refused by curl");

    // A worker that does not trust the CA says why, and keeps retrying.
    let backend = fake_backend::FakeBackend::new("m", "secure words")
        .spawn("127.0.0.1:0")
        .unwrap();
    let proxy = format!("https://localhost:{port}");
    let untrusting = start_worker(server.addr, backend, &[("PROXY_URL", &proxy)]);
    let line = untrusting.wait_line("cannot connect");
    assert!(
        line.contains("certificate") || line.contains("UnknownIssuer"),
        "{line}"
    );
    drop(untrusting);

    // With --ca-file it registers over wss:// and serves, streaming included.
    let worker = start_worker(
        server.addr,
        backend,
        &[("PROXY_URL", &proxy), ("CA_FILE", &first.path("ca.pem"))],
    );
    worker.wait_line("registered with server");
    let chat = r#"{"model":"m","stream":true,"messages":[]}"#;
    let url = format!("https://localhost:{port}/v1/chat/completions");
    let (ok, body) = curl(&[
        "-N",
        "--cacert",
        &first.path("ca.pem"),
        "-H",
        "content-type: application/json",
        "-d",
        chat,
        &url,
    ]);
    assert!(
        ok && body.contains("secure ") && body.contains("[DONE]"),
        "{body}"
    );

    // SIGHUP: a certificate from another CA replaces the first for new connections.
    let second = Pki::new(&base, "second");
    std::fs::copy(second.path("server.pem"), &live_cert).unwrap();
    std::fs::copy(second.path("server.key"), &live_key).unwrap();
    server.proc.signal("HUP");
    server.proc.wait_line("TLS certificate reloaded");
    let (ok, _) = curl(&["--cacert", &second.path("ca.pem"), &health]);
    assert!(ok, "new certificate served after SIGHUP");
    let (ok, _) = curl(&["--cacert", &first.path("ca.pem"), &health]);
    assert!(!ok, "old certificate no longer served");
    let _ = std::fs::remove_dir_all(&base);
}
