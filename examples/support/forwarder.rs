//! The forwarding floor: two do-nothing byte forwarders (a thread per direction per
//! connection) in a process of their own, so what they cost per request is measured the
//! same way as the server's and worker's. The bench runs itself again with
//! `BENCH_FORWARD=upstream` to be that process.
#![allow(dead_code)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::{Child, Command, Stdio};

/// Two chained forwarders to an upstream, in a child process killed when dropped.
pub struct Chain {
    child: Child,
    pub addr: SocketAddr,
}

impl Chain {
    pub fn start(upstream: SocketAddr) -> Chain {
        let exe = std::env::current_exe().expect("exe");
        let mut child = Command::new(exe)
            .env("BENCH_FORWARD", upstream.to_string())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("start the forwarder process");
        let mut line = String::new();
        let out = child.stdout.take().expect("stdout");
        BufReader::new(out)
            .read_line(&mut line)
            .expect("forwarder address");
        let addr = line.trim().parse().expect("forwarder address");
        Chain { child, addr }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for Chain {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// In the child (`BENCH_FORWARD` set): prints the chain's address, forwards until the
/// bench closes stdin, then exits. Returns when not asked to forward.
pub fn serve_if_asked() {
    let Ok(upstream) = std::env::var("BENCH_FORWARD") else {
        return;
    };
    let upstream: SocketAddr = upstream.parse().expect("BENCH_FORWARD=host:port");
    println!("{}", forwarder(forwarder(upstream)));
    let _ = std::io::stdout().flush();
    let _ = std::io::copy(&mut std::io::stdin(), &mut std::io::sink());
    std::process::exit(0);
}

/// Listens on a fresh port and copies bytes both ways between each client and a new
/// connection to `upstream`.
pub fn forwarder(upstream: SocketAddr) -> SocketAddr {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind forwarder");
    let addr = listener.local_addr().expect("forwarder address");
    std::thread::spawn(move || {
        for client in listener.incoming().flatten() {
            let Ok(up) = TcpStream::connect(upstream) else {
                continue;
            };
            let _ = (client.set_nodelay(true), up.set_nodelay(true));
            let (Ok(client2), Ok(up2)) = (client.try_clone(), up.try_clone()) else {
                continue;
            };
            std::thread::spawn(move || copy_bytes(client, up));
            std::thread::spawn(move || copy_bytes(up2, client2));
        }
    });
    addr
}

fn copy_bytes(mut from: TcpStream, mut to: TcpStream) {
    let mut buf = [0u8; 16 * 1024];
    while let Ok(n @ 1..) = from.read(&mut buf) {
        if to.write_all(&buf[..n]).is_err() {
            break;
        }
    }
    let _ = to.shutdown(std::net::Shutdown::Both);
}
