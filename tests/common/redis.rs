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
    /// TLS only (`rediss://`), with the certificates of [`tls_files`] in this directory.
    tls: Option<PathBuf>,
}

impl Redis {
    pub fn start() -> Redis {
        Redis::start_with(None)
    }

    /// TLS only, its certificate signed by `certs/ca.pem` (see [`tls_files`]).
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

/// A throwaway CA (`ca.pem`) and a certificate it signed for 127.0.0.1 and localhost
/// (`server.pem`, `server.key`) in `dir`, made with the `openssl` command.
pub fn tls_files(dir: &Path) {
    let openssl = |args: &[&str]| {
        let out = Command::new("openssl")
            .args(args)
            .current_dir(dir)
            .output()
            .expect("run openssl");
        assert!(
            out.status.success(),
            "openssl {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    let key = ["-newkey", "rsa:2048", "-nodes"];
    openssl(
        &[
            &["req", "-x509"],
            &key[..],
            &[
                "-keyout",
                "ca.key",
                "-out",
                "ca.pem",
                "-days",
                "2",
                "-subj",
                "/CN=modelrelay test CA",
            ],
        ]
        .concat(),
    );
    std::fs::write(
        dir.join("server.ext"),
        "subjectAltName=IP:127.0.0.1,DNS:localhost\n",
    )
    .expect("extensions file");
    openssl(
        &[
            &["req"],
            &key[..],
            &[
                "-keyout",
                "server.key",
                "-out",
                "server.csr",
                "-subj",
                "/CN=localhost",
            ],
        ]
        .concat(),
    );
    openssl(&[
        "x509",
        "-req",
        "-in",
        "server.csr",
        "-CA",
        "ca.pem",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-days",
        "2",
        "-extfile",
        "server.ext",
        "-out",
        "server.pem",
    ]);
}
