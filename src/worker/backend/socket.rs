//! A slot's connection to its backend, as the transport under its `ureq` agent.
//!
//! ureq's own TCP transport costs a forwarded request nine system calls where four do:
//! - it sends the request head and the body in two `send`s. Each is a loopback segment
//!   the worker pays to deliver, and often a second wake-up of the backend's thread.
//!   Here the bytes of a request are held until the answer is awaited, then go in one
//!   `send` (a body larger than [`HOLD_BYTES`] still goes out as it is written);
//! - before and after each use of a pooled connection it checks that the backend has not
//!   closed it by switching the socket to non-blocking, reading and switching back:
//!   three calls, here one non-blocking peek ([`net::idle_and_open`]).
//!
//! Everything else is as ureq does it: the same buffers, `TCP_NODELAY`, timeouts, and the
//! socket registered with the agent so that a cancel (`Agent::shutdown`) closes it under a
//! blocked read. Proxies set in the environment keep working: the agent chains ureq's
//! CONNECT-proxy connector in front of this one ([`super::fresh_agent`]).

use std::fmt;
use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::sync::{Arc, Weak};
use std::time::Duration;

use ureq::unversioned::transport::{
    Buffers, ConnectionDetails, Connector, Either, LazyBuffers, NextTimeout, ShutdownHandle,
    Transport,
};
use ureq::Error;

use crate::net;

/// Request bytes held back before the first read: a usual request (head and JSON body)
/// leaves in one `send`; a larger upload goes out in pieces of about this size.
const HOLD_BYTES: usize = 64 * 1024;
/// The holding buffer's room kept between requests (a usual request fits).
const KEPT_BYTES: usize = 16 * 1024;

/// Opens plain TCP connections to the backend; a transport made earlier in the chain (a
/// CONNECT proxy's tunnel) is passed through unchanged.
#[derive(Debug, Default)]
pub struct BackendConnector;

impl<In: Transport> Connector<In> for BackendConnector {
    type Out = Either<In, BackendSocket>;

    fn connect(
        &self,
        details: &ConnectionDetails,
        chained: Option<In>,
    ) -> Result<Option<Self::Out>, Error> {
        if let Some(tunnel) = chained {
            return Ok(Some(Either::A(tunnel)));
        }
        let stream = connect(details)?;
        if details.config.no_delay() {
            stream.set_nodelay(true)?;
        }
        let socket = BackendSocket {
            stream: Arc::new(stream),
            buffers: LazyBuffers::new(
                details.config.input_buffer_size(),
                details.config.output_buffer_size(),
            ),
            held: Vec::new(),
            read_timeout: None,
            write_timeout: None,
        };
        let handle: Weak<dyn ShutdownHandle> = Arc::downgrade(&socket.stream) as _;
        (details.register_shutdown)(handle)?;
        Ok(Some(Either::B(socket)))
    }
}

/// The first address that accepts within the connect timeout; the last failure if none.
fn connect(details: &ConnectionDetails) -> Result<TcpStream, Error> {
    let timeout = details.timeout.not_zero().map(|t| *t);
    let mut last = None;
    for addr in &details.addrs {
        let attempt = match timeout {
            Some(t) => TcpStream::connect_timeout(addr, t),
            None => TcpStream::connect(addr),
        };
        match attempt {
            Ok(stream) => return Ok(stream),
            Err(e) if is_timeout(&e) => last = Some(Error::Timeout(ureq::Timeout::Connect)),
            Err(e) => last = Some(Error::Io(e)),
        }
    }
    Err(last.unwrap_or(Error::ConnectionFailed))
}

pub struct BackendSocket {
    stream: Arc<TcpStream>,
    buffers: LazyBuffers,
    /// Request bytes not sent yet (see [`HOLD_BYTES`]).
    held: Vec<u8>,
    /// The socket's timeouts as last set: set again only when they change.
    read_timeout: Option<Duration>,
    write_timeout: Option<Duration>,
}

impl fmt::Debug for BackendSocket {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BackendSocket")
            .field("peer", &self.stream.peer_addr().ok())
            .field("held", &self.held.len())
            .finish()
    }
}

impl BackendSocket {
    /// Sends what is held, within `timeout`.
    fn flush(&mut self, timeout: NextTimeout) -> Result<(), Error> {
        if self.held.is_empty() {
            return Ok(());
        }
        let timeout = unexpired(timeout.for_write())?;
        let stream = &self.stream;
        set_if_changed(&mut self.write_timeout, timeout, |t| {
            stream.set_write_timeout(t)
        })?;
        let sent = (&*self.stream).write_all(&self.held);
        self.held.clear();
        if self.held.capacity() > KEPT_BYTES {
            // A slot that once sent a long prompt need not keep its size for good.
            self.held = Vec::new();
        }
        sent.map_err(|e| io_error(e, timeout))
    }
}

impl Transport for BackendSocket {
    fn buffers(&mut self) -> &mut dyn Buffers {
        &mut self.buffers
    }

    fn transmit_output(&mut self, amount: usize, timeout: NextTimeout) -> Result<(), Error> {
        if self.held.len() + amount > HOLD_BYTES {
            self.flush(timeout)?;
        }
        let output = &self.buffers.output()[..amount];
        self.held.extend_from_slice(output);
        if self.held.len() >= HOLD_BYTES {
            self.flush(timeout)?;
        }
        Ok(())
    }

    fn await_input(&mut self, timeout: NextTimeout) -> Result<bool, Error> {
        self.flush(timeout)?;
        let timeout = unexpired(timeout.for_read())?;
        let stream = &self.stream;
        set_if_changed(&mut self.read_timeout, timeout, |t| {
            stream.set_read_timeout(t)
        })?;
        let input = self.buffers.input_append_buf();
        let read = loop {
            match (&*self.stream).read(input) {
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                other => break other,
            }
        };
        let amount = read.map_err(|e| io_error(e, timeout))?;
        self.buffers.input_appended(amount);
        Ok(amount > 0)
    }

    fn is_open(&mut self) -> bool {
        self.held.is_empty() && net::idle_and_open(&self.stream)
    }
}

/// `timeout`, or the timeout error when it has already run out.
fn unexpired(timeout: NextTimeout) -> Result<NextTimeout, Error> {
    if timeout.after.is_zero() {
        return Err(Error::Timeout(timeout.reason));
    }
    Ok(timeout)
}

/// Sets a socket timeout only when it differs from the one last set (`cached`): one
/// system call fewer per request in the usual case of no change.
fn set_if_changed(
    cached: &mut Option<Duration>,
    timeout: NextTimeout,
    set: impl FnOnce(Option<Duration>) -> io::Result<()>,
) -> io::Result<()> {
    let wanted = timeout.not_zero().map(|t| *t);
    if wanted != *cached {
        set(wanted)?;
        *cached = wanted;
    }
    Ok(())
}

fn is_timeout(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::TimedOut | io::ErrorKind::WouldBlock
    )
}

/// A socket timeout is ureq's timeout error (as its own transport reports it).
fn io_error(e: io::Error, timeout: NextTimeout) -> Error {
    if is_timeout(&e) {
        Error::Timeout(timeout.reason)
    } else {
        Error::Io(e)
    }
}

#[cfg(test)]
mod tests {
    use std::net::TcpListener;
    use std::thread::JoinHandle;

    use super::super::fresh_agent;
    use super::*;

    const ANSWER: &[u8] = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok";

    /// Reads one request (head and `content-length` body) from `conn`; returns it and
    /// how many reads it took.
    fn read_request(conn: &mut TcpStream) -> (Vec<u8>, usize) {
        let (mut got, mut reads, mut buf) = (Vec::new(), 0, vec![0u8; 1 << 20]);
        loop {
            let n = conn.read(&mut buf).expect("read");
            assert!(n > 0, "the client closed mid-request");
            got.extend_from_slice(&buf[..n]);
            reads += 1;
            let text = String::from_utf8_lossy(&got).to_string();
            let Some(end) = text.find("\r\n\r\n") else {
                continue;
            };
            let length = text[..end]
                .lines()
                .find_map(|l| l.strip_prefix("content-length: "))
                .map_or(0, |v| v.trim().parse::<usize>().expect("length"));
            if got.len() >= end + 4 + length {
                return (got, reads);
            }
        }
    }

    /// A backend on loopback that runs `serve` on each accepted connection, `accepts` times.
    fn backend(
        accepts: usize,
        serve: impl Fn(TcpStream) + Send + 'static,
    ) -> (String, JoinHandle<()>) {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let url = format!("http://{}", listener.local_addr().expect("addr"));
        let handle = std::thread::spawn(move || {
            for _ in 0..accepts {
                let (conn, _) = listener.accept().expect("accept");
                // A request that never comes fails the test instead of hanging it.
                let timeout = Some(std::time::Duration::from_secs(10));
                conn.set_read_timeout(timeout).expect("timeout");
                serve(conn);
            }
        });
        (url, handle)
    }

    #[cfg(target_os = "linux")]
    /// Waits until the client's kernel has acknowledged all `conn` sent, its close
    /// included: from then on the client's socket shows them.
    fn wait_acked(conn: &TcpStream) {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while !crate::net::all_sent_acked(conn) {
            assert!(std::time::Instant::now() < deadline, "never acknowledged");
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
    }

    fn post(agent: &ureq::Agent, url: &str, body: &[u8]) -> String {
        let mut response = agent.post(url).send(body).expect("answer");
        response.body_mut().read_to_string().expect("body")
    }

    /// Writes `bytes` the way ureq does: into the output buffer, then `transmit_output`.
    fn transmit(socket: &mut BackendSocket, bytes: &[u8]) {
        socket.buffers().output()[..bytes.len()].copy_from_slice(bytes);
        socket
            .transmit_output(bytes.len(), NextTimeout::default())
            .expect("transmit");
    }

    fn nothing_readable(conn: &TcpStream) -> bool {
        conn.set_nonblocking(true).expect("non-blocking");
        let peeked = conn.peek(&mut [0u8; 1]);
        conn.set_nonblocking(false).expect("blocking");
        matches!(peeked, Err(e) if e.kind() == std::io::ErrorKind::WouldBlock)
    }

    #[test]
    fn a_request_leaves_in_one_send() {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let client = TcpStream::connect(listener.local_addr().expect("addr")).expect("dial");
        let (mut backend, _) = listener.accept().expect("accept");
        let mut socket = BackendSocket {
            stream: Arc::new(client),
            buffers: LazyBuffers::new(8192, 8192),
            held: Vec::new(),
            read_timeout: None,
            write_timeout: None,
        };
        let head = b"POST /v1/chat/completions HTTP/1.1\r\ncontent-length: 4000\r\n\r\n";
        transmit(&mut socket, head);
        assert!(nothing_readable(&backend), "the head left on its own");
        transmit(&mut socket, &[b'x'; 4000]);
        assert!(
            nothing_readable(&backend),
            "the body left before the answer was awaited"
        );
        let answering = std::thread::spawn(move || {
            let (request, reads) = read_request(&mut backend);
            backend.write_all(ANSWER).expect("answer");
            (request.len(), reads)
        });
        assert!(socket.await_input(NextTimeout::default()).expect("answer"));
        let (length, reads) = answering.join().expect("backend");
        assert_eq!((length, reads), (head.len() + 4000, 1));
    }

    #[test]
    fn a_body_larger_than_what_is_held_arrives_whole() {
        let size = 3 * super::HOLD_BYTES + 17;
        let (url, server) = backend(1, move |mut conn| {
            let (request, _) = read_request(&mut conn);
            assert!(request.ends_with(&vec![b'y'; size]), "body cut short");
            conn.write_all(ANSWER).expect("answer");
        });
        assert_eq!(post(&fresh_agent(), &url, &vec![b'y'; size]), "ok");
        server.join().expect("backend");
    }

    #[test]
    #[cfg(target_os = "linux")]
    fn a_connection_the_backend_closed_is_not_reused() {
        // The first connection answers once and closes without saying so: the second
        // request must see the close and dial again instead of failing.
        let (closed, wait_closed) = std::sync::mpsc::channel::<()>();
        let closed = std::sync::Mutex::new(Some(closed));
        let (url, server) = backend(2, move |mut conn| {
            read_request(&mut conn);
            conn.write_all(ANSWER).expect("answer");
            if let Some(tell) = closed.lock().expect("lock").take() {
                let _ = conn.shutdown(std::net::Shutdown::Both);
                wait_acked(&conn);
                tell.send(()).expect("tell");
            }
        });
        let agent = fresh_agent();
        assert_eq!(post(&agent, &url, b"{}"), "ok");
        wait_closed.recv().expect("closed");
        assert_eq!(post(&agent, &url, b"{}"), "ok");
        server.join().expect("backend");
    }

    #[test]
    #[cfg(target_os = "linux")]
    fn a_connection_with_unasked_bytes_is_not_reused() {
        let (go, garbage) = std::sync::mpsc::channel::<()>();
        let (written, wait_written) = std::sync::mpsc::channel::<()>();
        let garbage = std::sync::Mutex::new(garbage);
        let (url, server) = backend(2, move |mut conn| {
            read_request(&mut conn);
            conn.write_all(ANSWER).expect("answer");
            // Stray bytes after the answer was read and the connection pooled: only
            // the check before reuse can tell the client not to send on it.
            if garbage.lock().expect("lock").recv().is_ok() {
                conn.write_all(b"garbage").expect("garbage");
                wait_acked(&conn);
                written.send(()).expect("tell");
                let _ = conn.read(&mut [0u8; 64]);
            }
        });
        let agent = fresh_agent();
        assert_eq!(post(&agent, &url, b"{}"), "ok");
        go.send(()).expect("go");
        wait_written.recv().expect("written");
        assert_eq!(post(&agent, &url, b"{}"), "ok");
        drop(go);
        server.join().expect("backend");
    }

    #[test]
    fn a_kept_alive_connection_is_reused() {
        let (url, server) = backend(1, |mut conn| {
            for _ in 0..3 {
                read_request(&mut conn);
                conn.write_all(ANSWER).expect("answer");
            }
        });
        let agent = fresh_agent();
        for _ in 0..3 {
            assert_eq!(post(&agent, &url, b"{}"), "ok");
        }
        server
            .join()
            .expect("backend: one connection served all three");
    }
}
