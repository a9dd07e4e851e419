//! Release binaries started by the benches: found beside the running example, killed
//! when dropped, their stderr lines kept for the bench to read.
#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;

use parking_lot::Mutex;

/// A child process killed when dropped; its stderr lines are kept.
pub struct Process {
    child: Child,
    pub lines: Arc<Mutex<Vec<String>>>,
}

impl Process {
    /// Starts `target/<profile>/<name>` with exactly `env`.
    pub fn spawn(name: &str, env: &[(&str, String)]) -> Process {
        let mut cmd = Command::new(binary(name));
        cmd.env_clear();
        for (k, v) in env {
            cmd.env(k, v);
        }
        Process::start(
            cmd,
            &format!("{name}; build it first: cargo build --release --bins"),
        )
    }

    /// Starts another program (a real backend) with `args`, in this environment.
    pub fn spawn_program(program: &std::path::Path, args: &[String]) -> Process {
        let mut cmd = Command::new(program);
        cmd.args(args);
        Process::start(cmd, &program.display().to_string())
    }

    fn start(mut cmd: Command, what: &str) -> Process {
        let mut child = cmd
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("start {what}: {e}"));
        let lines = Arc::new(Mutex::new(Vec::new()));
        let (sink, stderr) = (lines.clone(), child.stderr.take().expect("stderr"));
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                sink.lock().push(line);
            }
        });
        Process { child, lines }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `target/<profile>/examples/<bench>` → `target/<profile>/<name>`, or `$BENCH_BIN_DIR/<name>`
/// when set (another build's binaries, for side-by-side runs), or `$BENCH_ORIG/<name>`
/// (the original ModelRelay's binaries, see [`original`]).
pub fn binary(name: &str) -> std::path::PathBuf {
    if let Some(dir) = std::env::var_os("BENCH_ORIG").or_else(|| std::env::var_os("BENCH_BIN_DIR"))
    {
        return std::path::PathBuf::from(dir).join(name);
    }
    let exe = std::env::current_exe().expect("exe");
    exe.parent()
        .and_then(|p| p.parent())
        .map(|p| p.join(name))
        .expect("target dir")
}

/// Whether the binaries under test are the original ModelRelay's (`BENCH_ORIG=dir`): a
/// bench then speaks only what both relays understand and skips what the original lacks.
pub fn original() -> bool {
    std::env::var_os("BENCH_ORIG").is_some()
}

/// A loopback address with a port nobody listens on right now.
pub fn free_addr() -> SocketAddr {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("port")
        .port();
    SocketAddr::from(([127, 0, 0, 1], port))
}
