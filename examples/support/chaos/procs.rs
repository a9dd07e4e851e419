//! The real binaries under test: the server and the workers as child processes (logs
//! to files), their resource figures from `/proc`, and the state they publish
//! (`/health`, `/admin/workers`) read over plain HTTP.

use std::fs::File;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

/// The admin token the harness gives its server.
pub const ADMIN_TOKEN: &str = "chaos-admin-token";
pub const SECRET: &str = "chaos-secret";

/// A child process; killed when dropped.
pub struct Proc {
    child: Child,
    pub log: PathBuf,
}

impl Proc {
    pub fn spawn(bin: &Path, env: &[(&str, String)], log: PathBuf) -> Proc {
        let file = File::options()
            .create(true)
            .append(true)
            .open(&log)
            .unwrap_or_else(|e| panic!("open {}: {e}", log.display()));
        let mut cmd = Command::new(bin);
        cmd.env_clear()
            .env("PATH", std::env::var("PATH").unwrap_or_default());
        // glibc allocator settings pass through, to compare runs with them.
        for (k, v) in std::env::vars().filter(|(k, _)| k.starts_with("MALLOC_")) {
            cmd.env(k, v);
        }
        for (k, v) in env {
            cmd.env(k, v);
        }
        let child = cmd
            .stdout(Stdio::null())
            .stderr(Stdio::from(file))
            .spawn()
            .unwrap_or_else(|e| panic!("start {} ({e})", bin.display()));
        Proc { child, log }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Sends a signal by name (`STOP`, `CONT`, `TERM`, `KILL`).
    pub fn signal(&self, sig: &str) {
        let _ = Command::new("kill")
            .arg(format!("-{sig}"))
            .arg(self.pid().to_string())
            .stderr(Stdio::null())
            .status();
    }

    /// The exit status if it has exited.
    pub fn exited(&mut self) -> Option<ExitStatus> {
        self.child.try_wait().ok().flatten()
    }

    /// Waits up to `limit` for the process to exit.
    pub fn wait_exit(&mut self, limit: Duration) -> Option<ExitStatus> {
        let deadline = Instant::now() + limit;
        loop {
            if let Some(status) = self.exited() {
                return Some(status);
            }
            if Instant::now() > deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    pub fn kill9(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        // A stopped process must be continued to die promptly.
        self.signal("CONT");
        self.kill9();
    }
}

/// Threads, open descriptors and resident memory of a process.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Sample {
    pub threads: u64,
    pub fds: u64,
    pub rss_kb: u64,
}

pub fn sample(pid: u32) -> Sample {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.split_whitespace().next()?.parse().ok())
            .unwrap_or(0)
    };
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| d.count() as u64)
        .unwrap_or(0);
    Sample {
        threads: field("Threads:"),
        fds,
        rss_kb: field("VmRSS:"),
    }
}

/// One `GET` with the admin token; the JSON answer, or `None` when the server is not
/// answering (down, restarting).
pub fn get_json(addr: SocketAddr, path: &str) -> Option<Value> {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(2)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(10))).ok()?;
    let req = format!(
        "GET {path} HTTP/1.1\r\nhost: localhost\r\nauthorization: Bearer {ADMIN_TOKEN}\r\nconnection: close\r\n\r\n"
    );
    s.write_all(req.as_bytes()).ok()?;
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).ok()?;
    let text = String::from_utf8_lossy(&raw);
    let (head, body) = text.split_once("\r\n\r\n")?;
    if !head.starts_with("HTTP/1.1 200") {
        return None;
    }
    serde_json::from_str(body).ok()
}

/// Polls `probe` until it returns `Some`, for at most `limit`.
pub fn wait_for<T>(limit: Duration, mut probe: impl FnMut() -> Option<T>) -> Option<T> {
    let deadline = Instant::now() + limit;
    loop {
        if let Some(v) = probe() {
            return Some(v);
        }
        if Instant::now() > deadline {
            return None;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The server's `/admin/workers` list.
pub fn workers(addr: SocketAddr) -> Option<Vec<Value>> {
    get_json(addr, "/admin/workers")?["workers"]
        .as_array()
        .cloned()
}
