//! A real `redis-server` on a loopback port for the shared-store suites.

use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::Path;
use std::process::{Child, Command, Stdio};

use super::procs::ServerProc;
use super::wait_until;

/// A `redis-server` on a loopback port, with no persistence; killed on drop.
pub struct Redis {
    pub port: u16,
    child: Option<Child>,
}

impl Redis {
    pub fn start() -> Redis {
        let port = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("free port")
            .port();
        let mut r = Redis { port, child: None };
        r.restart();
        r
    }

    /// Starts it (again) on the same port and waits until it answers.
    pub fn restart(&mut self) {
        let child = Command::new("redis-server")
            .args(["--port", &self.port.to_string(), "--bind", "127.0.0.1"])
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
        format!("redis://127.0.0.1:{}/0", self.port)
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
