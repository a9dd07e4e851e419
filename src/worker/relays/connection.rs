//! Dialing one relay and staying connected: WebSocket handshake with the secret in
//! `X-Worker-Secret`, and reconnection with backoff (`backoff.rs`, plus up to 500 ms of
//! jitter). A refused secret is retried at the slow end.

use std::net::{TcpStream, ToSocketAddrs};

use crate::net::Stream;
use std::sync::Arc;
use std::time::{Duration, Instant};

use log::{error, info, warn};
use tungstenite::client::IntoClientRequest;

use super::backoff::{Backoff, MAX_BACKOFF};
use super::session;
use crate::worker::backend::url::redacted;
use crate::worker::Shared;

const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

#[derive(Debug)]
pub enum DialError {
    /// The server refused the upgrade with this HTTP status (401: wrong secret).
    Refused(u16),
    Other(String),
}

/// Connects to relay `relay` (its index in `PROXY_URL`) and serves it until the worker
/// drains.
pub fn run_forever(shared: Arc<Shared>, relay: usize) {
    let url = shared.cfg.connect_urls[relay].clone();
    // For logs: without any userinfo the URL carries.
    let shown = redacted(&url);
    let mut backoff = Backoff::default();
    while !shared.is_draining() {
        let delay = match dial(&shared, &url) {
            Ok(stream) => {
                info!("connected to {shown}");
                match session::run(stream, &shared, relay) {
                    session::End::Lost(reason) => {
                        if shared.is_draining() {
                            return;
                        }
                        // Asleep: no reconnection until the box resumes, then at once.
                        if shared.power.sleep.hold() {
                            info!("awake again: reconnecting to {shown}");
                            continue;
                        }
                        warn!("disconnected from server {shown}: {reason}; reconnecting");
                        backoff.lost(Instant::now())
                    }
                    session::End::NotRegistered(reason) => {
                        error!("registration with {shown} failed: {reason}");
                        backoff.failed(Instant::now())
                    }
                }
            }
            Err(DialError::Refused(401)) => {
                error!(
                    "{shown} rejected the worker secret (401); check WORKER_SECRET. Retrying in {}s",
                    MAX_BACKOFF.as_secs()
                );
                backoff.refused()
            }
            Err(DialError::Refused(status)) => {
                error!(
                    "{shown} refused the connection with HTTP {status} (provider `{}`)",
                    shared.cfg.provider
                );
                backoff.failed(Instant::now())
            }
            Err(DialError::Other(e)) => {
                warn!("cannot connect to {shown}: {e}");
                backoff.failed(Instant::now())
            }
        };
        let delay = delay + jitter();
        info!(
            "next connection attempt to {shown} in {:.1}s",
            delay.as_secs_f64()
        );
        if shared.wait_for_drain(delay) {
            return;
        }
    }
}

fn jitter() -> Duration {
    let mut b = [0u8; 2];
    let _ = getrandom::fill(&mut b);
    Duration::from_millis(u64::from(u16::from_le_bytes(b)) % 501)
}

/// Opens the TCP connection and performs the WebSocket upgrade.
pub fn dial(shared: &Shared, connect_url: &str) -> Result<Stream, DialError> {
    let cfg = &shared.cfg;
    let secure = connect_url.starts_with("wss://");
    let url = format!("{connect_url}?provider={}", encode(&cfg.provider));
    let mut request = url
        .as_str()
        .into_client_request()
        .map_err(|e| DialError::Other(format!("bad PROXY_URL: {e}")))?;
    let secret = cfg
        .secret
        .parse()
        .map_err(|_| DialError::Other("WORKER_SECRET is not a valid header value".into()))?;
    request.headers_mut().insert("x-worker-secret", secret);
    let host = request.uri().host().unwrap_or("127.0.0.1").to_string();
    let port = request
        .uri()
        .port_u16()
        .unwrap_or(if secure { 443 } else { 80 });
    let addrs = (host.as_str(), port)
        .to_socket_addrs()
        .map_err(|e| DialError::Other(format!("resolving {host}: {e}")))?;
    let mut last = String::from("no address");
    for addr in addrs {
        match TcpStream::connect_timeout(&addr, CONNECT_TIMEOUT) {
            Ok(sock) => {
                let _ = sock.set_nodelay(true);
                let _ = sock.set_read_timeout(Some(CONNECT_TIMEOUT));
                let stream = wrap(shared, sock, &host, secure)?;
                return match tungstenite::client::client(request, stream) {
                    Ok((ws, _)) => {
                        let stream = ws.into_inner();
                        let _ = stream.set_read_timeout(None);
                        Ok(stream)
                    }
                    Err(tungstenite::HandshakeError::Failure(tungstenite::Error::Http(resp))) => {
                        Err(DialError::Refused(resp.status().as_u16()))
                    }
                    Err(e) => Err(DialError::Other(format!("handshake failed: {e}"))),
                };
            }
            Err(e) => last = format!("{addr}: {e}"),
        }
    }
    Err(DialError::Other(last))
}

/// TLS toward a `wss://` relay (the worker then has a client configuration), plain
/// otherwise: one `PROXY_URL` list may mix both.
fn wrap(shared: &Shared, sock: TcpStream, host: &str, secure: bool) -> Result<Stream, DialError> {
    #[cfg(feature = "tls")]
    if let (true, Some(config)) = (secure, &shared.tls) {
        return Stream::tls_client(sock, host, config.clone())
            .map_err(|e| DialError::Other(e.to_string()));
    }
    let _ = (shared, host, secure);
    Ok(Stream::plain(sock))
}

/// Percent-encodes a query value.
fn encode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}
