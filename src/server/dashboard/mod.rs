//! The operator's web pages: the live dashboard (`/dashboard`) and the
//! connect-a-worker wizard (`/setup`).
//!
//! - here: the routes under `/dashboard` and `/setup`, the embedded pages and their
//!   security headers (a strict Content-Security-Policy: scripts and styles only from
//!   our own embedded files, nothing inline, no framing);
//! - [`session`]: admin token → session cookie, the Origin check on actions;
//! - [`actions`]: sign-in, sign-out, and the operator's actions, which call the same
//!   functions as the admin API ([`crate::server::ops`]);
//! - [`events`]: the live feed (Server-Sent Events from one publisher thread);
//! - [`setup`]: what the wizard needs (public URL, worker secret, downloads).
//!
//! Pages are static HTML + CSS + plain JavaScript compiled into the binary; no data is
//! in them. The data comes from the feed and `/setup/info`, and only to a session.

pub mod actions;
pub mod events;
pub mod session;
pub mod setup;

use std::time::Instant;

use super::errors::{ApiError, Style};
use super::fanout::Hub;
use super::http::request::{Conn, Request};
use super::http::response;
use super::Ctx;

/// The dashboard's shared state.
#[derive(Default)]
pub struct Dashboard {
    pub sessions: session::Sessions,
    /// Subscribers of the live feed.
    pub hub: Hub,
    /// SHA-256 of downloadable worker binaries, by file.
    pub downloads: setup::Checksums,
}

impl Dashboard {
    /// Sessions shared through `store` when it is shared (valid on every relay).
    pub fn with_store(store: &super::store::Store) -> Dashboard {
        Dashboard {
            sessions: session::Sessions::with_mirror(store.session_mirror()),
            ..Dashboard::default()
        }
    }
}

/// Scripts, styles and images only from here; no inline code, no framing, forms post
/// only to us.
pub const CSP: &str = "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self'; object-src 'none'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'";

/// Headers every dashboard answer carries. The referrer policy is `same-origin`, not
/// `no-referrer`: under the latter browsers send `Origin: null` on our own form posts,
/// which the Origin check must refuse.
pub const SECURITY_HEADERS: &[(&str, &str)] = &[
    ("content-security-policy", CSP),
    ("x-content-type-options", "nosniff"),
    ("referrer-policy", "same-origin"),
    ("x-frame-options", "DENY"),
];

const DASHBOARD_HTML: &str = include_str!("assets/dashboard.html");
const SETUP_HTML: &str = include_str!("assets/setup.html");
const SIGNIN_HTML: &str = include_str!("assets/signin.html");
const DISABLED_HTML: &str = include_str!("assets/disabled.html");

/// Embedded files under `/dashboard/assets/`: name, content type, bytes.
const ASSETS: &[(&str, &str, &str)] = &[
    (
        "style.css",
        "text/css; charset=utf-8",
        include_str!("assets/style.css"),
    ),
    (
        "common.js",
        "text/javascript; charset=utf-8",
        include_str!("assets/common.js"),
    ),
    (
        "dashboard.js",
        "text/javascript; charset=utf-8",
        include_str!("assets/dashboard.js"),
    ),
    (
        "setup.js",
        "text/javascript; charset=utf-8",
        include_str!("assets/setup.js"),
    ),
    ("icon.svg", "image/svg+xml", include_str!("assets/icon.svg")),
];

/// Whether `path` is one of ours.
pub fn owns(path: &str) -> bool {
    ["/dashboard", "/setup"]
        .iter()
        .any(|p| path == *p || path.strip_prefix(p).is_some_and(|r| r.starts_with('/')))
}

/// Serves a request for one of our paths; returns whether the connection may be reused.
pub fn serve(conn: &mut Conn, ctx: &Ctx, req: &Request) -> bool {
    let session = ctx.dashboard.sessions.check(req, Instant::now());
    let path = req.path.as_str();
    match (req.method.as_str(), path) {
        ("GET", "/dashboard") => match session {
            Some(_) => html(conn, req, 200, DASHBOARD_HTML),
            None => signin_page(conn, ctx, req, 200, "/dashboard", ""),
        },
        ("GET", "/dashboard/signin") => {
            let next = next_page(req.query_param("next").as_deref());
            signin_page(conn, ctx, req, 200, next, "")
        }
        ("GET", "/setup") => html(conn, req, 200, SETUP_HTML),
        ("GET", _) if path.starts_with("/dashboard/assets/") => asset(conn, req),
        ("POST", "/dashboard/signin") => actions::sign_in(conn, ctx, req),
        ("POST", "/dashboard/signout") => actions::sign_out(conn, ctx, req, session),
        ("GET", "/dashboard/events") => match session {
            Some(key) => events::serve(conn, ctx, req, key),
            None => error(conn, req, &signed_out()),
        },
        ("POST", _) if path.starts_with("/dashboard/api/") => match session {
            Some(_) => actions::act(conn, ctx, req),
            None => error(conn, req, &signed_out()),
        },
        ("GET", "/setup/info") => setup::info(conn, ctx, req, session.is_some()),
        ("GET", _) if path.starts_with("/setup/download/") => setup::download(conn, ctx, req),
        _ => {
            let e = ApiError::new(
                404,
                "not_found",
                format!("no route for {} {path}", req.method),
            );
            error(conn, req, &e)
        }
    }
}

fn signed_out() -> ApiError {
    ApiError::new(
        401,
        "signed_out",
        "sign in at /dashboard with the admin token first",
    )
}

/// Where a sign-in may lead: one of our two pages.
pub fn next_page(asked: Option<&str>) -> &'static str {
    match asked {
        Some("/setup") => "/setup",
        _ => "/dashboard",
    }
}

/// The sign-in page (or, without an admin token, the page saying how to set one).
pub fn signin_page(
    conn: &mut Conn,
    ctx: &Ctx,
    req: &Request,
    status: u16,
    next: &str,
    message: &str,
) -> bool {
    if ctx.cfg.admin_token.is_none() {
        return html(conn, req, status.max(403), DISABLED_HTML);
    }
    let page = SIGNIN_HTML
        .replace("{{next}}", &escape_html(next))
        .replace("{{message}}", &escape_html(message));
    html(conn, req, status, &page)
}

fn asset(conn: &mut Conn, req: &Request) -> bool {
    let name = req.path.trim_start_matches("/dashboard/assets/");
    match ASSETS.iter().find(|(n, _, _)| *n == name) {
        Some((_, content_type, body)) => write(
            conn,
            req,
            200,
            content_type,
            body.as_bytes(),
            &[("cache-control", "no-cache")],
        ),
        None => error(
            conn,
            req,
            &ApiError::new(404, "not_found", format!("no asset `{name}`")),
        ),
    }
}

fn html(conn: &mut Conn, req: &Request, status: u16, page: &str) -> bool {
    write(
        conn,
        req,
        status,
        "text/html; charset=utf-8",
        page.as_bytes(),
        &[("cache-control", "no-store")],
    )
}

/// A JSON error with the security headers.
pub fn error(conn: &mut Conn, req: &Request, e: &ApiError) -> bool {
    let mut extra = vec![("cache-control", "no-store")];
    let retry = e.retry_after.map(|s| s.to_string());
    if let Some(r) = retry.as_deref() {
        extra.push(("retry-after", r));
    }
    let body = e.body(Style::OpenAi);
    write(
        conn,
        req,
        e.status,
        "application/json",
        body.as_bytes(),
        &extra,
    )
}

/// A JSON answer with the security headers.
pub fn json(conn: &mut Conn, req: &Request, status: u16, body: &serde_json::Value) -> bool {
    let body = body.to_string();
    write(
        conn,
        req,
        status,
        "application/json",
        body.as_bytes(),
        &[("cache-control", "no-store")],
    )
}

/// Writes a whole answer with the security headers, the request id and `extra`.
pub fn write(
    conn: &mut Conn,
    req: &Request,
    status: u16,
    content_type: &str,
    body: &[u8],
    extra: &[(&str, &str)],
) -> bool {
    let mut headers: Vec<(&str, &str)> = vec![("content-type", content_type)];
    headers.extend_from_slice(SECURITY_HEADERS);
    headers.extend_from_slice(extra);
    if let Some(id) = conn.request_id.as_deref() {
        headers.push(("x-request-id", id));
    }
    response::write_full(&mut conn.stream, status, &headers, body, req.keep_alive).is_ok()
        && req.keep_alive
}

/// Escapes text for HTML element content and attribute values.
pub fn escape_html(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

/// Whether answers should mark the cookie `Secure`: the server speaks TLS itself, or
/// its public URL (a TLS-terminating proxy in front) is https.
pub fn secure(ctx: &Ctx) -> bool {
    ctx.cfg.tls.is_some()
        || ctx
            .cfg
            .public_url
            .as_deref()
            .is_some_and(|u| u.starts_with("https://"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn owns_only_our_paths() {
        for p in ["/dashboard", "/dashboard/events", "/setup", "/setup/info"] {
            assert!(owns(p), "{p}");
        }
        for p in ["/dashboards", "/setupx", "/", "/admin/workers"] {
            assert!(!owns(p), "{p}");
        }
    }

    #[test]
    fn html_is_escaped_and_next_is_one_of_our_pages() {
        assert_eq!(
            escape_html("<a href=\"x\">'&'</a>"),
            "&lt;a href=&quot;x&quot;&gt;&#39;&amp;&#39;&lt;/a&gt;"
        );
        assert_eq!(next_page(Some("/setup")), "/setup");
        assert_eq!(next_page(Some("https://evil.example")), "/dashboard");
        assert_eq!(next_page(None), "/dashboard");
    }

    #[test]
    fn every_page_loads_only_our_own_files() {
        for page in [DASHBOARD_HTML, SETUP_HTML, SIGNIN_HTML, DISABLED_HTML] {
            assert!(!page.contains("<script>"), "inline script");
            assert!(!page.contains("<style"), "inline style");
            assert!(!page.contains(" style="), "style attribute");
            assert!(!page.contains("http://") && !page.contains("https://"));
            for src in page
                .split("src=\"")
                .skip(1)
                .chain(page.split("href=\"").skip(1))
            {
                let url = &src[..src.find('"').unwrap()];
                assert!(url.starts_with('/') || url.starts_with('#'), "{url}");
                if let Some(name) = url.strip_prefix("/dashboard/assets/") {
                    assert!(ASSETS.iter().any(|(n, _, _)| *n == name), "{name}");
                }
            }
        }
    }
}
