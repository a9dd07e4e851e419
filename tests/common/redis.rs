//! A real `redis-server` on a loopback port for the shared-store suites.

use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use super::procs::ServerProc;
use super::wait_until;

/// A `redis-server` on a loopback port, with no persistence; killed on drop.
pub struct Redis {
    pub port: u16,
    child: Option<Child>,
    /// TLS only (`rediss://`), with the certificates of a [`super::pki::Pki`] in this directory.
    tls: Option<PathBuf>,
}

impl Redis {
    pub fn start() -> Redis {
        Redis::start_with(None)
    }

    /// TLS only, its certificate signed by `certs/ca.pem` (a [`super::pki::Pki`]).
    pub fn start_tls(certs: &Path) -> Redis {
        Redis::start_with(Some(certs.to_path_buf()))
    }

    fn start_with(tls: Option<PathBuf>) -> Redis {
        let port = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("free port")
            .port();
        let mut r = Redis {
            port,
            child: None,
            tls,
        };
        r.restart();
        r
    }

    /// Starts it (again) on the same port and waits until it answers.
    pub fn restart(&mut self) {
        let mut cmd = Command::new("redis-server");
        match &self.tls {
            None => cmd.args(["--port", &self.port.to_string()]),
            Some(dir) => cmd
                .args(["--port", "0", "--tls-port", &self.port.to_string()])
                .arg("--tls-cert-file")
                .arg(dir.join("server.pem"))
                .arg("--tls-key-file")
                .arg(dir.join("server.key"))
                .arg("--tls-ca-cert-file")
                .arg(dir.join("ca.pem"))
                .args(["--tls-auth-clients", "no"]),
        };
        let child = cmd
            .args(["--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn redis-server");
        self.child = Some(child);
        let addr = SocketAddr::from(([127, 0, 0, 1], self.port));
        wait_until("redis-server to listen", || {
            (TcpStream::connect(addr).is_ok(), String::new())
        });
    }

    pub fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    pub fn url(&self) -> String {
        let scheme = if self.tls.is_some() {
            "rediss"
        } else {
            "redis"
        };
        format!("{scheme}://127.0.0.1:{}/0", self.port)
    }

    /// A relay (the server binary) on this store, with its state in `dir`.
    pub fn relay(&self, dir: &Path, extra: &[(&str, &str)]) -> ServerProc {
        let (url, state) = (self.url(), dir.to_string_lossy().into_owned());
        let mut env = vec![("STATE_URL", url.as_str()), ("STATE_DIR", state.as_str())];
        env.extend_from_slice(extra);
        ServerProc::start(&env)
    }
}

impl Drop for Redis {
    fn drop(&mut self) {
        self.stop();
    }
}

/// A fresh, empty directory for one test's relays (`mr-{tag}-{pid}` under the system
/// temporary directory).
pub fn scratch_dir(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("mr-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("dir");
    dir
}
