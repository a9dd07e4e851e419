//! Dialing the server and staying connected: WebSocket handshake with the secret in
//! `X-Worker-Secret`, and reconnection with exponential backoff (1 s doubling to 30 s,
//! plus up to 500 ms of jitter). A refused secret is retried at the slow end.

use std::net::{TcpStream, ToSocketAddrs};

use crate::net::Stream;
use std::sync::Arc;
use std::time::Duration;

use log::{error, info, warn};
use tungstenite::client::IntoClientRequest;

use super::backend::url::redacted;
use super::{session, Shared};

const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
const MIN_BACKOFF: Duration = Duration::from_secs(1);
const MAX_BACKOFF: Duration = Duration::from_secs(30);

#[derive(Debug)]
pub enum DialError {
    /// The server refused the upgrade with this HTTP status (401: wrong secret).
    Refused(u16),
    Other(String),
}

/// Connects and serves until the worker drains.
pub fn run_forever(shared: Arc<Shared>) {
    let mut backoff = MIN_BACKOFF;
    while !shared.is_draining() {
        let delay = match dial(&shared) {
            Ok(stream) => {
                info!("connected to {}", redacted(&shared.cfg.connect_url));
                match session::run(stream, &shared) {
                    session::End::Lost(reason) => {
                        backoff = MIN_BACKOFF;
                        if shared.is_draining() {
                            return;
                        }
                        // Asleep: no reconnection until the box resumes, then at once.
                        if shared.power.sleep.hold() {
                            info!("awake again: reconnecting");
                            continue;
                        }
                        warn!("disconnected from server: {reason}; reconnecting");
                        MIN_BACKOFF
                    }
                    session::End::NotRegistered(reason) => {
                        error!("registration failed: {reason}");
                        next(&mut backoff)
                    }
                }
            }
            Err(DialError::Refused(401)) => {
                error!(
                    "server rejected the worker secret (401); check WORKER_SECRET. Retrying in {}s",
                    MAX_BACKOFF.as_secs()
                );
                backoff = MAX_BACKOFF;
                MAX_BACKOFF
            }
            Err(DialError::Refused(status)) => {
                error!(
                    "server refused the connection with HTTP {status} (provider `{}`)",
                    shared.cfg.provider
                );
                next(&mut backoff)
            }
            Err(DialError::Other(e)) => {
                warn!(
                    "cannot connect to {}: {e}",
                    redacted(&shared.cfg.connect_url)
                );
                next(&mut backoff)
            }
        };
        let delay = delay + jitter();
        info!("next connection attempt in {:.1}s", delay.as_secs_f64());
        if shared.wait_for_drain(delay) {
            return;
        }
    }
}

fn next(backoff: &mut Duration) -> Duration {
    let current = *backoff;
    *backoff = (*backoff * 2).min(MAX_BACKOFF);
    current
}

fn jitter() -> Duration {
    let mut b = [0u8; 2];
    let _ = getrandom::fill(&mut b);
    Duration::from_millis(u64::from(u16::from_le_bytes(b)) % 501)
}

/// Opens the TCP connection and performs the WebSocket upgrade.
pub fn dial(shared: &Shared) -> Result<Stream, DialError> {
    let cfg = &shared.cfg;
    let secure = cfg.connect_url.starts_with("wss://");
    let url = format!("{}?provider={}", cfg.connect_url, encode(&cfg.provider));
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
                let stream = wrap(shared, sock, &host)?;
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

/// TLS when the worker has a client configuration (a `wss://` URL), plain otherwise.
fn wrap(shared: &Shared, sock: TcpStream, host: &str) -> Result<Stream, DialError> {
    #[cfg(feature = "tls")]
    if let Some(config) = &shared.tls {
        return Stream::tls_client(sock, host, config.clone())
            .map_err(|e| DialError::Other(e.to_string()));
    }
    let _ = (shared, host);
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
