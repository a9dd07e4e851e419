//! Real `modelrelay-server` / `modelrelay-worker` processes for end-to-end tests, with
//! their log lines captured so tests can wait for events instead of sleeping.
#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::{request, SECRET, WAIT};

pub struct Proc {
    pub child: Child,
    lines: Arc<Mutex<Vec<String>>>,
    /// The thread copying stderr into `lines`; joined on exit so the log is complete.
    reader: Option<std::thread::JoinHandle<()>>,
    name: String,
}

impl Proc {
    pub fn spawn(bin: &str, env: &[(&str, String)]) -> Proc {
        Proc::spawn_args(bin, &[], env)
    }

    /// HAProxy from `bin` with `config` written into `dir`, in the foreground (`-db`;
    /// `-W` would fork a master, which `Proc` could not kill).
    pub fn haproxy(bin: &std::path::Path, config: &str, dir: &std::path::Path) -> Proc {
        let cfg = dir.join("haproxy.cfg");
        std::fs::write(&cfg, config).expect("write haproxy.cfg");
        let cfg = cfg.to_string_lossy().into_owned();
        Proc::spawn_args(&bin.to_string_lossy(), &["-db", "-f", &cfg], &[])
    }

    /// [`Proc::spawn`] with command-line arguments (another program, e.g. HAProxy).
    pub fn spawn_args(bin: &str, args: &[&str], env: &[(&str, String)]) -> Proc {
        let mut cmd = Command::new(bin);
        cmd.args(args)
            .env_clear()
            .env("PATH", std::env::var("PATH").unwrap_or_default());
        for (k, v) in env {
            cmd.env(k, v);
        }
        let mut child = cmd
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn binary");
        let lines = Arc::new(Mutex::new(Vec::new()));
        let stderr = child.stderr.take().expect("stderr");
        let sink = lines.clone();
        let reader = std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                sink.lock().push(line);
            }
        });
        let name = bin.rsplit('/').next().unwrap_or(bin).to_string();
        Proc {
            child,
            lines,
            reader: Some(reader),
            name,
        }
    }

    /// Waits for a log line containing `needle` (counting only lines after `skip`).
    pub fn wait_line_after(&self, skip: usize, needle: &str) -> String {
        let deadline = Instant::now() + WAIT;
        loop {
            if let Some(l) = self
                .lines
                .lock()
                .iter()
                .skip(skip)
                .find(|l| l.contains(needle))
            {
                return l.clone();
            }
            assert!(
                Instant::now() < deadline,
                "{} never logged {needle:?}; log:\n{}",
                self.name,
                self.log()
            );
            if let Ok(Some(status)) = self.child_status() {
                panic!(
                    "{} exited ({status}) before logging {needle:?}; log:\n{}",
                    self.name,
                    self.log()
                );
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    pub fn wait_line(&self, needle: &str) -> String {
        self.wait_line_after(0, needle)
    }

    pub fn line_count(&self) -> usize {
        self.lines.lock().len()
    }

    pub fn log(&self) -> String {
        self.lines.lock().join("\n")
    }

    fn child_status(&self) -> std::io::Result<Option<ExitStatus>> {
        // try_wait needs &mut; a status check through /proc keeps this &self.
        let alive = std::path::Path::new(&format!("/proc/{}", self.child.id())).exists();
        Ok(if alive {
            None
        } else {
            Some(ExitStatus::default())
        })
    }

    pub fn signal(&self, sig: &str) {
        let ok = Command::new("kill")
            .arg(format!("-{sig}"))
            .arg(self.child.id().to_string())
            .status();
        assert!(
            ok.map(|s| s.success()).unwrap_or(false),
            "kill -{sig} failed"
        );
    }

    /// Waits for the process to exit and returns its status.
    pub fn wait_exit(&mut self) -> ExitStatus {
        let deadline = Instant::now() + WAIT;
        loop {
            if let Some(status) = self.child.try_wait().expect("try_wait") {
                // The process is gone, so its stderr reaches EOF: wait for the last lines.
                if let Some(reader) = self.reader.take() {
                    let _ = reader.join();
                }
                return status;
            }
            assert!(
                Instant::now() < deadline,
                "{} did not exit; log:\n{}",
                self.name,
                self.log()
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    pub fn rss_kb(&self) -> u64 {
        std::fs::read_to_string(format!("/proc/{}/status", self.child.id()))
            .unwrap_or_default()
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.split_whitespace().next()?.parse().ok())
            .unwrap_or(0)
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub struct ServerProc {
    pub proc: Proc,
    pub addr: SocketAddr,
}

impl ServerProc {
    pub fn start(extra: &[(&str, &str)]) -> ServerProc {
        ServerProc::start_on("127.0.0.1:0", extra)
    }

    pub fn start_on(listen: &str, extra: &[(&str, &str)]) -> ServerProc {
        let mut env = vec![
            ("WORKER_SECRET", SECRET.to_string()),
            ("LISTEN_ADDR", listen.to_string()),
        ];
        env.extend(extra.iter().map(|(k, v)| (*k, v.to_string())));
        let proc = Proc::spawn(env!("CARGO_BIN_EXE_modelrelay-server"), &env);
        let line = proc.wait_line("listening on ");
        let addr = line
            .rsplit(' ')
            .next()
            .and_then(|a| a.parse().ok())
            .expect("listen address in log");
        ServerProc { proc, addr }
    }

    pub fn health(&self) -> serde_json::Value {
        request(self.addr, "GET", "/health", None, &[]).json()
    }

    /// Waits until `/health` reports `n` connected workers.
    pub fn wait_workers(&self, n: u64) {
        let deadline = Instant::now() + WAIT;
        while self.health()["workers_connected"] != n {
            assert!(
                Instant::now() < deadline,
                "expected {n} workers; health {}",
                self.health()
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

pub fn start_worker(server: SocketAddr, backend: SocketAddr, extra: &[(&str, &str)]) -> Proc {
    let mut env = vec![
        ("WORKER_SECRET", SECRET.to_string()),
        ("PROXY_URL", format!("http://{server}")),
        ("BACKEND_URL", format!("http://{backend}")),
        ("WORKER_NAME", "e2e".to_string()),
        ("LOG_LEVEL", "info".to_string()),
    ];
    env.extend(extra.iter().map(|(k, v)| (*k, v.to_string())));
    Proc::spawn(env!("CARGO_BIN_EXE_modelrelay-worker"), &env)
}

/// Whether a command-line tool is installed; under CI (`CI` set) it must be.
pub fn tool(name: &str) -> bool {
    let found = Command::new("sh")
        .arg("-c")
        .arg(format!("command -v {name}"))
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false);
    if !found {
        assert!(
            std::env::var_os("CI").is_none(),
            "{name} is required under CI (.ci/run installs it)"
        );
        eprintln!("skipped: {name} not installed");
    }
    found
}
