//! Browsers on the LAN: which browser requests the relay answers.
//!
//! With API keys off (the default) any web page a LAN user opens could POST to the
//! inference routes, and with DNS rebinding read the answers (the class of Ollama's
//! CVE-2024-28224). Every request passes here before the route table:
//!
//! * **Host check** while the relay listens on loopback only: the `Host` must be
//!   `localhost` (or `*.localhost`), a loopback address, or `PUBLIC_URL`'s host, any
//!   port. A rebound name (`evil.example` resolving to 127.0.0.1) is refused.
//! * **Cross-site browser requests** are refused: an `Origin` that is neither this
//!   server (the `Host` it was sent to, by http or https, or `PUBLIC_URL`) nor listed in
//!   `ALLOWED_ORIGINS`, or, without `Origin`, `Sec-Fetch-Site: cross-site`.
//! * **CORS** for the origins in `ALLOWED_ORIGINS` (`*`: any): a preflight `OPTIONS` is
//!   answered here, and every answer to such a request carries `Access-Control-*`.
//!
//! curl, SDKs and server-side callers (Open WebUI's backend) send no `Origin` and no
//! `Sec-Fetch-Site`, so they pass as before; so do LAN clients reaching a relay that
//! listens on the LAN by any name or address.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use super::dispatcher::wire_request_id;
use super::errors::{ApiError, Style};
use super::http::request::{Conn, Request};
use super::http::response;
use super::reply::write_error;
use super::Ctx;

/// Checks `req` and hands it to the route table, answers its preflight, or refuses it;
/// gives the connection back when it may carry another request.
pub fn route(mut conn: Conn, ctx: &Arc<Ctx>, req: Request) -> Option<Conn> {
    let guard = Guard {
        listen_addr: &ctx.cfg.listen_addr,
        public_url: ctx.cfg.public_url.as_deref(),
        allowed: &ctx.cfg.allowed_origins,
    };
    match guard.check(&req) {
        Verdict::Pass(cors) => {
            response::set_extra_headers(cors.as_deref().map_or_else(Vec::new, response_headers));
            let next = super::api::route(conn, ctx, req);
            response::set_extra_headers(Vec::new());
            next
        }
        Verdict::Preflight(origin) => {
            let id = wire_request_id(ctx.next_request_id());
            let mut headers = preflight_headers(&req, &origin);
            headers.push(("x-request-id".into(), id));
            let headers: Vec<(&str, &str)> = headers
                .iter()
                .map(|(n, v)| (n.as_str(), v.as_str()))
                .collect();
            let sent = response::write_full(&mut conn.stream, 204, &headers, b"", req.keep_alive);
            (sent.is_ok() && req.keep_alive).then_some(conn)
        }
        Verdict::Refuse(e) => {
            conn.request_id = Some(wire_request_id(ctx.next_request_id()));
            let style = Style::for_path(&req.path);
            write_error(&mut conn, style, &e, req.keep_alive, None).then_some(conn)
        }
    }
}

/// `ALLOWED_ORIGINS`: origins whose pages may call the relay (with CORS).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AllowedOrigins {
    any: bool,
    /// `scheme://host[:port]`, lower case, no trailing slash.
    list: Vec<String>,
}

impl AllowedOrigins {
    /// A comma list of origins (`https://app.example.com, http://10.0.0.5:3000`) or `*`.
    pub fn parse(text: &str) -> Result<AllowedOrigins, String> {
        let mut allowed = AllowedOrigins::default();
        for item in text.split(',').map(str::trim).filter(|i| !i.is_empty()) {
            if item == "*" {
                allowed.any = true;
                continue;
            }
            let origin = item.trim_end_matches('/').to_ascii_lowercase();
            let host = origin
                .strip_prefix("http://")
                .or_else(|| origin.strip_prefix("https://"));
            match host {
                Some(h) if !h.is_empty() && !h.contains(['/', ' ', '@', '?', '#']) => {
                    allowed.list.push(origin)
                }
                _ => {
                    return Err(format!(
                        "ALLOWED_ORIGINS: `{item}` is not an origin such as https://app.example.com (or *)"
                    ))
                }
            }
        }
        Ok(allowed)
    }

    fn allows(&self, origin: &str) -> bool {
        self.any || self.list.iter().any(|o| o.eq_ignore_ascii_case(origin))
    }
}

/// What to do with a request.
#[derive(Debug)]
pub enum Verdict {
    /// Route it; `Some(origin)`: an allowed cross-origin request, whose answer carries
    /// the CORS headers for `origin`.
    Pass(Option<String>),
    /// A CORS preflight from an allowed origin: answer it here.
    Preflight(String),
    /// Refuse it with this error.
    Refuse(ApiError),
}

/// The settings this guard reads.
pub struct Guard<'a> {
    pub listen_addr: &'a str,
    pub public_url: Option<&'a str>,
    pub allowed: &'a AllowedOrigins,
}

impl Guard<'_> {
    pub fn check(&self, req: &Request) -> Verdict {
        if loopback_only(self.listen_addr) {
            if let Some(host) = req.header("host") {
                if !self.local_host(host) {
                    return Verdict::Refuse(ApiError::new(
                        403,
                        "host_not_allowed",
                        "this relay listens on loopback only and answers only requests for localhost; \
                         set PUBLIC_URL to reach it by another name",
                    ));
                }
            }
        }
        let Some(origin) = req.header("origin") else {
            return if req.header("sec-fetch-site") == Some("cross-site") && !self.allowed.any {
                Verdict::Refuse(cross_site())
            } else {
                Verdict::Pass(None)
            };
        };
        if self.allowed.allows(origin) {
            let preflight =
                req.method == "OPTIONS" && req.header("access-control-request-method").is_some();
            return if preflight {
                Verdict::Preflight(origin.to_string())
            } else {
                Verdict::Pass(Some(origin.to_string()))
            };
        }
        if self.own_origin(req, origin) {
            Verdict::Pass(None)
        } else {
            Verdict::Refuse(cross_site())
        }
    }

    /// Whether `origin` is this server: the host the request was sent to (by http or
    /// https: a TLS proxy may sit in front) or `PUBLIC_URL`.
    fn own_origin(&self, req: &Request, origin: &str) -> bool {
        if req
            .header("sec-fetch-site")
            .is_some_and(|s| s == "cross-site")
        {
            return false;
        }
        if self
            .public_url
            .is_some_and(|p| origin.eq_ignore_ascii_case(origin_of(p)))
        {
            return true;
        }
        let host = origin
            .strip_prefix("http://")
            .or_else(|| origin.strip_prefix("https://"));
        matches!((host, req.header("host")), (Some(o), Some(h)) if o.eq_ignore_ascii_case(h))
    }

    /// Whether a `Host` value names this machine (or `PUBLIC_URL`'s host), any port.
    fn local_host(&self, host: &str) -> bool {
        let name = host_name(host).to_ascii_lowercase();
        if name == "localhost" || name.ends_with(".localhost") {
            return true;
        }
        if name.parse::<IpAddr>().is_ok_and(|ip| ip.is_loopback()) {
            return true;
        }
        self.public_url.is_some_and(|p| {
            let public = origin_of(p);
            let public = public.find("://").map_or(public, |i| &public[i + 3..]);
            host_name(public).eq_ignore_ascii_case(&name)
        })
    }
}

fn cross_site() -> ApiError {
    ApiError::new(
        403,
        "cross_origin",
        "cross-site browser requests are refused; list the page's origin in ALLOWED_ORIGINS to allow it",
    )
}

/// Whether the relay listens on a loopback address only (`127.0.0.1:8080`, `[::1]:8080`,
/// `localhost:8080`).
fn loopback_only(listen_addr: &str) -> bool {
    match listen_addr.parse::<SocketAddr>() {
        Ok(addr) => addr.ip().is_loopback(),
        Err(_) => host_name(listen_addr).eq_ignore_ascii_case("localhost"),
    }
}

/// The host of `host[:port]` / `[v6]:port`, without brackets or port.
fn host_name(host: &str) -> &str {
    if let Some(rest) = host.strip_prefix('[') {
        return rest.split(']').next().unwrap_or(rest);
    }
    match host.rsplit_once(':') {
        Some((name, port)) if !name.contains(':') && port.bytes().all(|b| b.is_ascii_digit()) => {
            name
        }
        _ => host,
    }
}

/// `scheme://host[:port]` of a URL.
fn origin_of(url: &str) -> &str {
    let after_scheme = url.find("://").map_or(0, |i| i + 3);
    match url[after_scheme..].find('/') {
        Some(slash) => &url[..after_scheme + slash],
        None => url,
    }
}

/// Request headers a preflight may ask for that we echo back; anything longer or odd
/// gets the fixed list.
const MAX_ASKED_HEADERS: usize = 512;
const DEFAULT_ALLOW_HEADERS: &str = "authorization, content-type, x-api-key, anthropic-version, \
     x-request-id, x-tenant-id, x-priority, x-session-id, x-context-trim";

/// The headers of a preflight answer for `origin`.
pub fn preflight_headers(req: &Request, origin: &str) -> Vec<(String, String)> {
    let asked = req
        .header("access-control-request-headers")
        .filter(|h| {
            h.len() <= MAX_ASKED_HEADERS
                && h.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"-_, ".contains(&b))
        })
        .unwrap_or(DEFAULT_ALLOW_HEADERS);
    let mut headers = response_headers(origin);
    headers.extend([
        (
            "access-control-allow-methods".to_string(),
            "GET, POST, DELETE, OPTIONS".to_string(),
        ),
        (
            "access-control-allow-headers".to_string(),
            asked.to_string(),
        ),
        ("access-control-max-age".to_string(), "600".to_string()),
    ]);
    headers
}

/// The CORS headers every answer to an allowed origin carries.
pub fn response_headers(origin: &str) -> Vec<(String, String)> {
    vec![
        (
            "access-control-allow-origin".to_string(),
            origin.to_string(),
        ),
        ("vary".to_string(), "Origin".to_string()),
        (
            "access-control-expose-headers".to_string(),
            "x-request-id, x-context-trimmed, retry-after".to_string(),
        ),
    ]
}

#[cfg(test)]
mod tests;
