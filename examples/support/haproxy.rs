//! HAProxy in front of several relays, for the many-relays test (`tests/relays_haproxy.rs`)
//! and `make bench-ha`: the configuration (the one docs/relays.md recommends, with test
//! timings), and the server states HAProxy reports on its stats socket, so callers wait
//! for HAProxy's view instead of sleeping.
#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::SocketAddr;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// The HAProxy binary: on `PATH`, or Debian's `/usr/sbin/haproxy` (not on a user's PATH).
pub fn binary() -> Option<PathBuf> {
    let on_path = std::env::var_os("PATH")
        .into_iter()
        .flat_map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
        .map(|d| d.join("haproxy"))
        .find(|p| p.is_file());
    on_path.or_else(|| Some(PathBuf::from("/usr/sbin/haproxy")).filter(|p| p.is_file()))
}

/// The binary for a test that needs HAProxy: `None` (the test skips) only outside CI,
/// where it may be missing; under CI (`.ci/run` installs it) its absence fails the test.
pub fn binary_for_test() -> Option<PathBuf> {
    let bin = binary();
    if bin.is_none() {
        assert!(
            std::env::var_os("CI").is_none(),
            "haproxy is required under CI (.ci/run installs it)"
        );
        eprintln!("skipped: haproxy not installed");
    }
    bin
}

/// Where HAProxy listens and what it spreads over.
pub struct Layout {
    /// The address clients use.
    pub front: SocketAddr,
    /// The relays, named `r1`, `r2`, ... in that order.
    pub relays: Vec<SocketAddr>,
    /// HAProxy's admin socket (`show stat`).
    pub stats: PathBuf,
}

impl Layout {
    /// The configuration. The health check and timeouts are those of the recipe in the
    /// docs, with a faster check interval so a test does not wait long; the `x-relay`
    /// response header (the relay that answered, or that HAProxy last tried when it
    /// answers an error itself) is for the test's accounting only.
    pub fn config(&self) -> String {
        let mut servers = String::new();
        for (i, addr) in self.relays.iter().enumerate() {
            servers.push_str(&format!("    server r{} {addr} check\n", i + 1));
        }
        format!(
            "global
    maxconn 4096
    stats socket {stats} mode 600 level admin

defaults
    mode http
    option redispatch
    retries 3
    timeout connect 2s
    timeout http-request 30s
    timeout queue 60s
    # A streamed (SSE) answer may pause for long between tokens: long client and server
    # timeouts, and HAProxy streams responses as they come (no buffering in http mode).
    timeout client 1h
    timeout server 1h

frontend llm
    bind {front}
    default_backend relays
    http-after-response set-header x-relay %[srv_name]

backend relays
    balance roundrobin
    option httpchk GET /health
    http-check expect status 200
    default-server inter 200ms fall 2 rise 1
{servers}",
            stats = self.stats.display(),
            front = self.front,
        )
    }
}

/// `(server, status)` for each server of backend `relays`, from HAProxy's `show stat`
/// (status `UP`, `DOWN`, `MAINT`, ...); empty while the socket does not answer.
pub fn states(stats: &Path) -> Vec<(String, String)> {
    let Ok(mut sock) = UnixStream::connect(stats) else {
        return Vec::new();
    };
    let _ = sock.set_read_timeout(Some(Duration::from_secs(5)));
    if sock.write_all(b"show stat\n").is_err() {
        return Vec::new();
    }
    let mut text = String::new();
    let _ = sock.read_to_string(&mut text);
    let mut lines = text.lines();
    let Some(head) = lines.next().and_then(|h| h.strip_prefix("# ")) else {
        return Vec::new();
    };
    let cols: Vec<&str> = head.split(',').collect();
    let col = |name: &str| cols.iter().position(|c| *c == name);
    let (Some(px), Some(sv), Some(st)) = (col("pxname"), col("svname"), col("status")) else {
        return Vec::new();
    };
    lines
        .map(|l| l.split(',').collect::<Vec<_>>())
        .filter(|f| f.get(px) == Some(&"relays"))
        .filter(|f| !matches!(f.get(sv), Some(&"BACKEND") | Some(&"FRONTEND")))
        .map(|f| {
            let get = |i: usize| f.get(i).map(|s| s.to_string()).unwrap_or_default();
            (get(sv), get(st))
        })
        .collect()
}

/// Whether every server HAProxy knows is `UP` (and it knows `n`).
pub fn all_up(stats: &Path, n: usize) -> (bool, String) {
    let s = states(stats);
    (
        s.len() == n && s.iter().all(|(_, st)| st == "UP"),
        format!("haproxy sees {s:?}"),
    )
}
