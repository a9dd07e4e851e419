//! [`Stream`]: one TCP connection, plain or TLS, that can be cloned into handles for
//! different threads (a reader and a writer), like `TcpStream::try_clone`.
//!
//! For TLS the rustls session sits behind a mutex shared by the clones. A read blocks on
//! the socket **without** the lock, then takes it only to decrypt what arrived; a write
//! takes it to encrypt and send. So a thread blocked reading never holds up a writer,
//! which is what the socket threads of both binaries rely on.

use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::time::Duration;

#[cfg(feature = "tls")]
use std::sync::Arc;

#[cfg(feature = "tls")]
use parking_lot::Mutex;

/// A connection handle; clones share the connection.
pub struct Stream {
    sock: TcpStream,
    /// The TLS session, behind a trait object so that a binary which never creates one
    /// (the server built without `server-tls`) links none of rustls.
    #[cfg(feature = "tls")]
    tls: Option<Arc<dyn Tls>>,
}

/// What [`Stream`] needs from a TLS session.
#[cfg(feature = "tls")]
trait Tls: Send + Sync {
    fn read(&self, sock: &TcpStream, buf: &mut [u8]) -> io::Result<usize>;
    fn write(&self, sock: &TcpStream, buf: &[u8]) -> io::Result<usize>;
    fn flush(&self, sock: &TcpStream) -> io::Result<()>;
    /// Non-blocking: has the peer closed (EOF or close_notify)?
    fn peek_closed(&self, sock: &TcpStream) -> bool;
    fn close_notify(&self, sock: &TcpStream);
}

#[cfg(feature = "tls")]
struct Rustls(Mutex<TlsState>);

#[cfg(feature = "tls")]
struct TlsState {
    conn: rustls::Connection,
    /// Bytes read from the socket that rustls has not taken yet.
    raw: Vec<u8>,
    peer_closed: bool,
}

#[cfg(feature = "tls")]
const RAW_READ: usize = 16 * 1024;

impl Stream {
    pub fn plain(sock: TcpStream) -> Stream {
        Stream {
            sock,
            #[cfg(feature = "tls")]
            tls: None,
        }
    }

    /// A server-side TLS connection; the handshake happens on the first read.
    #[cfg(feature = "server-tls")]
    pub fn tls_server(sock: TcpStream, config: Arc<rustls::ServerConfig>) -> io::Result<Stream> {
        let conn = rustls::ServerConnection::new(config).map_err(io::Error::other)?;
        Ok(Stream::with_tls(sock, conn.into()))
    }

    /// A client-side TLS connection to `host`; the handshake happens on first use.
    #[cfg(feature = "tls")]
    pub fn tls_client(
        sock: TcpStream,
        host: &str,
        config: Arc<rustls::ClientConfig>,
    ) -> io::Result<Stream> {
        let name = rustls::pki_types::ServerName::try_from(host.to_string()).map_err(|e| {
            io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("bad TLS server name `{host}`: {e}"),
            )
        })?;
        let conn = rustls::ClientConnection::new(config, name).map_err(io::Error::other)?;
        Ok(Stream::with_tls(sock, conn.into()))
    }

    #[cfg(feature = "tls")]
    fn with_tls(sock: TcpStream, conn: rustls::Connection) -> Stream {
        let state = TlsState {
            conn,
            raw: Vec::new(),
            peer_closed: false,
        };
        Stream {
            sock,
            tls: Some(Arc::new(Rustls(Mutex::new(state)))),
        }
    }

    pub fn try_clone(&self) -> io::Result<Stream> {
        Ok(Stream {
            sock: self.sock.try_clone()?,
            #[cfg(feature = "tls")]
            tls: self.tls.clone(),
        })
    }

    pub fn peer_addr(&self) -> io::Result<SocketAddr> {
        self.sock.peer_addr()
    }

    pub fn set_nodelay(&self, on: bool) -> io::Result<()> {
        self.sock.set_nodelay(on)
    }

    pub fn set_read_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        self.sock.set_read_timeout(t)
    }

    pub fn set_write_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        self.sock.set_write_timeout(t)
    }

    /// Sends as much of `buf` as the socket takes without blocking and returns how much
    /// that was; 0 when it takes nothing now. Only plain TCP on Unix sends here (one
    /// `send` with `MSG_DONTWAIT`, which leaves the socket's blocking mode, shared with
    /// its clones, alone); a TLS session or another platform always answers 0, so the
    /// caller hands the bytes to a thread that may block.
    pub fn send_now(&self, buf: &[u8]) -> io::Result<usize> {
        #[cfg(feature = "tls")]
        if self.tls.is_some() {
            return Ok(0);
        }
        send_now(&self.sock, buf)
    }

    /// Whether this is a plain TCP connection (no TLS session), whose clones may write
    /// on it from another thread.
    pub fn is_plain(&self) -> bool {
        #[cfg(feature = "tls")]
        if self.tls.is_some() {
            return false;
        }
        true
    }

    /// What a plain connection holds for a reader right now, without blocking and
    /// without taking it. A TLS session answers [`Peeked::Nothing`]: its bytes mean
    /// something only to rustls.
    #[cfg(unix)]
    pub fn peek_now(&self) -> Peeked {
        if !self.is_plain() {
            return Peeked::Nothing;
        }
        use std::os::fd::AsRawFd;
        let mut probe = [0u8; 1];
        // SAFETY: `probe` is a live one-byte buffer and the descriptor belongs to
        // `self.sock`, which outlives the call.
        let got = unsafe {
            libc::recv(
                self.sock.as_raw_fd(),
                probe.as_mut_ptr().cast(),
                probe.len(),
                libc::MSG_PEEK | libc::MSG_DONTWAIT,
            )
        };
        match got {
            0 => Peeked::Closed,
            n if n > 0 => Peeked::Data,
            _ if is_would_block(&io::Error::last_os_error()) => Peeked::Nothing,
            _ => Peeked::Closed,
        }
    }

    /// Other systems: never asked (no direct answers there).
    #[cfg(not(unix))]
    pub fn peek_now(&self) -> Peeked {
        Peeked::Nothing
    }

    /// Reads once, appending at most `max` bytes to `buf`; `Ok(0)` is end of stream. A
    /// plain connection on Unix reads straight into `buf`'s spare room; a read through a
    /// zeroed scratch array cost the server a 16 KiB `memset` and a copy per request.
    pub fn read_append(&mut self, buf: &mut Vec<u8>, max: usize) -> io::Result<usize> {
        #[cfg(unix)]
        if self.is_plain() {
            return recv_append(&self.sock, buf, max);
        }
        let start = buf.len();
        buf.resize(start + max, 0);
        let read = self.read(&mut buf[start..]);
        buf.truncate(start + read.as_ref().map_or(0, |n| *n));
        read
    }

    /// Closes both directions (a TLS close_notify is attempted first); blocked reads and
    /// writes on any clone return at once.
    pub fn shutdown(&self) {
        #[cfg(feature = "tls")]
        if let Some(tls) = &self.tls {
            tls.close_notify(&self.sock);
        }
        let _ = self.sock.shutdown(Shutdown::Both);
    }

    /// True when the peer has closed its end, checked without blocking and without
    /// consuming anything a later read would need.
    pub fn peer_closed(&self) -> bool {
        if self.sock.set_nonblocking(true).is_err() {
            return true;
        }
        let closed = self.peek_closed();
        let _ = self.sock.set_nonblocking(false);
        closed
    }

    fn peek_closed(&self) -> bool {
        #[cfg(feature = "tls")]
        if let Some(tls) = &self.tls {
            return tls.peek_closed(&self.sock);
        }
        let mut probe = [0u8; 1];
        match self.sock.peek(&mut probe) {
            Ok(0) => true,
            Ok(_) => false,
            Err(e) => !is_would_block(&e),
        }
    }
}

/// What [`Stream::peek_now`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Peeked {
    /// The peer closed its end (or the connection failed).
    Closed,
    /// Bytes are waiting.
    Data,
    /// Nothing yet.
    Nothing,
}

#[cfg(unix)]
impl std::os::fd::AsRawFd for Stream {
    fn as_raw_fd(&self) -> std::os::fd::RawFd {
        self.sock.as_raw_fd()
    }
}

fn is_would_block(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted
    )
}

#[cfg(feature = "tls")]
impl TlsState {
    /// Feeds buffered socket bytes to rustls as far as it takes them.
    fn pump(&mut self) -> io::Result<()> {
        while !self.raw.is_empty() && self.conn.wants_read() {
            let mut slice = self.raw.as_slice();
            let n = self.conn.read_tls(&mut slice)?;
            self.raw.drain(..n);
            let state = self
                .conn
                .process_new_packets()
                .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
            if state.peer_has_closed() {
                self.peer_closed = true;
            }
            if n == 0 {
                break;
            }
        }
        Ok(())
    }

    /// Sends whatever TLS records rustls has ready.
    fn flush(&mut self, sock: &TcpStream) -> io::Result<()> {
        let mut out = sock;
        while self.conn.wants_write() {
            self.conn.write_tls(&mut out)?;
        }
        Ok(())
    }
}

#[cfg(feature = "tls")]
impl Tls for Rustls {
    fn read(&self, sock: &TcpStream, buf: &mut [u8]) -> io::Result<usize> {
        let mut tmp = vec![0u8; RAW_READ];
        loop {
            {
                let mut st = self.0.lock();
                st.pump()?;
                match st.conn.reader().read(buf) {
                    Ok(n) => return Ok(n),
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                    Err(e) => return Err(e),
                }
                // Handshake messages or alerts rustls wants to send.
                st.flush(sock)?;
            }
            // Block on the socket without holding the session lock.
            let n = (&*sock).read(&mut tmp)?;
            if n == 0 {
                return Ok(0);
            }
            self.0.lock().raw.extend_from_slice(&tmp[..n]);
        }
    }

    fn write(&self, sock: &TcpStream, buf: &[u8]) -> io::Result<usize> {
        let mut st = self.0.lock();
        let n = st.conn.writer().write(buf)?;
        st.flush(sock)?;
        Ok(n)
    }

    fn flush(&self, sock: &TcpStream) -> io::Result<()> {
        self.0.lock().flush(sock)
    }

    fn peek_closed(&self, sock: &TcpStream) -> bool {
        // TLS data (maybe a close_notify) must go through rustls to be understood; what
        // it decrypts stays buffered inside it for the next read.
        let mut tmp = [0u8; RAW_READ];
        match (&*sock).read(&mut tmp) {
            Ok(0) => true,
            Ok(n) => {
                let mut st = self.0.lock();
                st.raw.extend_from_slice(&tmp[..n]);
                st.pump().is_err() || st.peer_closed
            }
            Err(e) => !is_would_block(&e),
        }
    }

    fn close_notify(&self, sock: &TcpStream) {
        if let Some(mut st) = self.0.try_lock() {
            st.conn.send_close_notify();
            let _ = st.flush(sock);
        }
    }
}

impl Read for Stream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        #[cfg(feature = "tls")]
        if let Some(tls) = &self.tls {
            return tls.read(&self.sock, buf);
        }
        (&self.sock).read(buf)
    }
}

impl Write for Stream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        #[cfg(feature = "tls")]
        if let Some(tls) = &self.tls {
            return tls.write(&self.sock, buf);
        }
        (&self.sock).write(buf)
    }

    fn flush(&mut self) -> io::Result<()> {
        #[cfg(feature = "tls")]
        if let Some(tls) = &self.tls {
            return tls.flush(&self.sock);
        }
        Ok(())
    }
}

/// TLS configuration loading, for both binaries.
#[cfg(feature = "tls")]
pub mod tls {
    use std::sync::Arc;

    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::CertificateDer;

    fn provider() -> Arc<rustls::crypto::CryptoProvider> {
        Arc::new(rustls::crypto::ring::default_provider())
    }

    /// A server configuration from PEM certificate chain and key files.
    #[cfg(feature = "server-tls")]
    pub fn server_config(
        cert_file: &str,
        key_file: &str,
    ) -> Result<Arc<rustls::ServerConfig>, String> {
        let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(cert_file)
            .map_err(|e| format!("cannot read TLS_CERT_FILE {cert_file}: {e}"))?
            .collect::<Result<_, _>>()
            .map_err(|e| format!("bad certificate in {cert_file}: {e}"))?;
        if certs.is_empty() {
            return Err(format!("no certificate found in {cert_file}"));
        }
        let key = rustls::pki_types::PrivateKeyDer::from_pem_file(key_file)
            .map_err(|e| format!("cannot read TLS_KEY_FILE {key_file}: {e}"))?;
        let config = rustls::ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(|e| e.to_string())?
            .with_no_client_auth()
            .with_single_cert(certs, key)
            .map_err(|e| format!("certificate and key do not fit together: {e}"))?;
        Ok(Arc::new(config))
    }

    /// A client configuration trusting the built-in Mozilla roots, plus the PEM
    /// certificates in `ca_file` (for a private CA) when given.
    pub fn client_config(ca_file: Option<&str>) -> Result<Arc<rustls::ClientConfig>, String> {
        let mut roots = rustls::RootCertStore {
            roots: webpki_roots::TLS_SERVER_ROOTS.to_vec(),
        };
        if let Some(path) = ca_file {
            let certs = CertificateDer::pem_file_iter(path)
                .map_err(|e| format!("cannot read --ca-file {path}: {e}"))?;
            let mut added = 0;
            for cert in certs {
                let cert = cert.map_err(|e| format!("bad certificate in {path}: {e}"))?;
                roots
                    .add(cert)
                    .map_err(|e| format!("unusable CA certificate in {path}: {e}"))?;
                added += 1;
            }
            if added == 0 {
                return Err(format!("no certificate found in {path}"));
            }
        }
        let config = rustls::ClientConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(|e| e.to_string())?
            .with_root_certificates(roots)
            .with_no_client_auth();
        Ok(Arc::new(config))
    }
}

/// One `recv` into the spare room of `buf` (as `TcpStream::read` does it, flags 0).
#[cfg(unix)]
fn recv_append(sock: &TcpStream, buf: &mut Vec<u8>, max: usize) -> io::Result<usize> {
    use std::os::fd::AsRawFd;
    buf.reserve(max);
    let room = buf.spare_capacity_mut();
    let len = room.len().min(max);
    // SAFETY: `room` is at least `len` bytes of `buf`'s allocation past its length, and
    // the descriptor belongs to `sock`, which outlives the call.
    let got = unsafe { libc::recv(sock.as_raw_fd(), room.as_mut_ptr().cast(), len, 0) };
    if got < 0 {
        return Err(io::Error::last_os_error());
    }
    let n = got.unsigned_abs().min(len);
    // SAFETY: `recv` wrote (initialised) exactly `n` bytes at the start of the spare room.
    unsafe { buf.set_len(buf.len() + n) };
    Ok(n)
}

#[cfg(unix)]
fn send_now(sock: &TcpStream, buf: &[u8]) -> io::Result<usize> {
    use std::os::fd::AsRawFd;
    // SAFETY: `buf` is a live slice of `buf.len()` bytes and the descriptor belongs to
    // `sock`, which outlives the call.
    let sent = unsafe {
        libc::send(
            sock.as_raw_fd(),
            buf.as_ptr().cast(),
            buf.len(),
            libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL,
        )
    };
    if sent >= 0 {
        return Ok(sent.unsigned_abs());
    }
    let e = io::Error::last_os_error();
    match e.kind() {
        io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted => Ok(0),
        _ => Err(e),
    }
}

#[cfg(not(unix))]
fn send_now(_sock: &TcpStream, _buf: &[u8]) -> io::Result<usize> {
    Ok(0)
}

/// Whether an idle keep-alive connection is still usable: the peer has neither closed
/// it nor sent anything unasked. One `recv(MSG_PEEK | MSG_DONTWAIT)`, where switching
/// the socket to non-blocking and back would take three calls.
#[cfg(unix)]
pub fn idle_and_open(sock: &TcpStream) -> bool {
    use std::os::fd::AsRawFd;
    let mut probe = [0u8; 1];
    // SAFETY: `probe` is a live one-byte buffer and the descriptor belongs to `sock`,
    // which outlives the call.
    let got = unsafe {
        libc::recv(
            sock.as_raw_fd(),
            probe.as_mut_ptr().cast(),
            probe.len(),
            libc::MSG_PEEK | libc::MSG_DONTWAIT,
        )
    };
    // Nothing to read is the only good answer: 0 is the peer's close, more is garbage.
    got < 0 && is_would_block(&io::Error::last_os_error())
}

#[cfg(not(unix))]
pub fn idle_and_open(sock: &TcpStream) -> bool {
    if sock.set_nonblocking(true).is_err() {
        return false;
    }
    let mut probe = [0u8; 1];
    let open = matches!(sock.peek(&mut probe), Err(e) if is_would_block(&e));
    sock.set_nonblocking(false).is_ok() && open
}

/// Tests only: whether the peer's kernel has acknowledged everything sent on `sock`,
/// its close included (`TCP_INFO`'s `tcpi_unacked` is 0). A test waits for this before
/// it relies on the peer having seen the bytes or the close: a loopback segment may
/// still sit in a softirq backlog when `send` or `shutdown` returns.
#[cfg(all(test, target_os = "linux"))]
pub(crate) fn all_sent_acked(sock: &TcpStream) -> bool {
    use std::os::fd::AsRawFd;
    // SAFETY: `tcp_info` is plain integers, so all-zero is a valid value.
    let mut info: libc::tcp_info = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::tcp_info>() as libc::socklen_t;
    // SAFETY: `info` and `len` are live and `len` is `info`'s size; the descriptor
    // belongs to `sock`, which outlives the call.
    let rc = unsafe {
        libc::getsockopt(
            sock.as_raw_fd(),
            libc::IPPROTO_TCP,
            libc::TCP_INFO,
            (&mut info as *mut libc::tcp_info).cast(),
            &mut len,
        )
    };
    rc == 0 && info.tcpi_unacked == 0
}
