//! A throwaway private CA and a server certificate it signed for `localhost` and
//! 127.0.0.1, made with the `openssl` command, for the TLS suites.

use std::path::{Path, PathBuf};
use std::process::Command;

/// `ca.pem` (`ca.key`) and `server.pem` (`server.key`) in `dir`.
pub struct Pki {
    pub dir: PathBuf,
}

impl Pki {
    /// A CA and a `localhost`/127.0.0.1 server certificate signed by it, under `tag`.
    pub fn new(dir: &Path, tag: &str) -> Pki {
        let dir = dir.join(tag);
        std::fs::create_dir_all(&dir).unwrap();
        let sh = |cmd: &str| {
            let out = Command::new("sh")
                .arg("-c")
                .arg(cmd)
                .current_dir(&dir)
                .output()
                .expect("openssl");
            assert!(
                out.status.success(),
                "{cmd}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        };
        sh("openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -keyout ca.key -out ca.pem -days 2 \
            -subj /CN=modelrelay-test-ca -addext basicConstraints=critical,CA:TRUE -addext keyUsage=critical,keyCertSign 2>/dev/null");
        sh("openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -keyout server.key -out server.csr -subj /CN=localhost 2>/dev/null");
        sh("printf 'subjectAltName=DNS:localhost,IP:127.0.0.1\\nbasicConstraints=CA:FALSE\\nkeyUsage=critical,digitalSignature\\nextendedKeyUsage=serverAuth\\n' > ext.cnf");
        sh("openssl x509 -req -in server.csr -CA ca.pem -CAkey ca.key -CAcreateserial -out server.pem -days 2 -extfile ext.cnf 2>/dev/null");
        Pki { dir }
    }

    pub fn path(&self, name: &str) -> String {
        self.dir.join(name).to_string_lossy().into_owned()
    }
}
