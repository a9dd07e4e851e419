//! Sign-in, sign-out and the operator's actions (drain a worker, refresh models, create
//! and revoke client keys).
//!
//! Every action is a POST from our own page: it needs a live session and an `Origin`
//! naming this server ([`session::same_origin`]), and then runs the very function the
//! admin API runs ([`ops`]), so both answer alike. Sign-in attempts count against the
//! same per-IP failure limit as the admin token on `/admin/*`.

use std::time::Instant;

use log::info;
use serde_json::{json, Value};

use super::session::{self, Key};
use super::{error, json as write_json, next_page, secure, signin_page, write};
use crate::server::auth::check_admin_token;
use crate::server::errors::ApiError;
use crate::server::http::request::{percent_decode, Conn, Request};
use crate::server::ops;
use crate::server::Ctx;

fn cross_origin() -> ApiError {
    ApiError::new(
        403,
        "cross_origin",
        "refused: the request did not come from this server's own page (Origin)",
    )
}

/// A field of an `application/x-www-form-urlencoded` body.
fn form_field(body: &[u8], name: &str) -> Option<String> {
    std::str::from_utf8(body).ok()?.split('&').find_map(|pair| {
        let (k, v) = pair.split_once('=')?;
        (k == name).then(|| percent_decode(v))
    })
}

fn is_json(req: &Request) -> bool {
    req.header("content-type")
        .is_some_and(|t| t.trim_start().starts_with("application/json"))
}

/// `POST /dashboard/signin`: the admin token (form field or JSON `token`) for a session
/// cookie. A form gets a redirect to the page it came from (or the sign-in page again
/// with the reason); JSON gets JSON.
pub fn sign_in(conn: &mut Conn, ctx: &Ctx, req: &Request) -> bool {
    let as_json = is_json(req);
    let (token, next) = if as_json {
        let v: Value = serde_json::from_slice(&req.body).unwrap_or(Value::Null);
        let token = v.get("token").and_then(Value::as_str).map(str::to_string);
        (token, "/dashboard")
    } else {
        let next = form_field(&req.body, "next");
        (form_field(&req.body, "token"), next_page(next.as_deref()))
    };
    // A login from someone else's page would sign the operator into a session the
    // other page chose; browsers send Origin on every POST, so demand ours when present.
    if req.header("origin").is_some() && !session::same_origin(req, ctx.cfg.public_url.as_deref()) {
        return error(conn, req, &cross_origin());
    }
    let token = token
        .map(|t| t.trim().to_string())
        .filter(|t| !t.is_empty());
    if let Err(e) = check_admin_token(ctx, token.as_deref(), req, conn.peer.ip()) {
        return if as_json {
            error(conn, req, &e)
        } else {
            signin_page(conn, ctx, req, e.status, next, &e.message)
        };
    }
    let Some(id) = ctx.dashboard.sessions.create(Instant::now()) else {
        let e = ApiError::new(500, "no_randomness", "cannot create a session id");
        return error(conn, req, &e);
    };
    info!("dashboard: signed in from {}", conn.peer.ip());
    let cookie = session::set_cookie(&id, secure(ctx));
    if as_json {
        let body = json!({"signed_in": true, "expires_in_secs": session::TTL.as_secs()});
        let body = body.to_string();
        let extra = [
            ("set-cookie", cookie.as_str()),
            ("cache-control", "no-store"),
        ];
        write(conn, req, 200, "application/json", body.as_bytes(), &extra)
    } else {
        let extra = [
            ("set-cookie", cookie.as_str()),
            ("location", next),
            ("cache-control", "no-store"),
        ];
        write(
            conn,
            req,
            303,
            "text/plain; charset=utf-8",
            b"signed in",
            &extra,
        )
    }
}

/// `POST /dashboard/signout`: ends the session and clears the cookie.
pub fn sign_out(conn: &mut Conn, ctx: &Ctx, req: &Request, key: Option<Key>) -> bool {
    if !session::same_origin(req, ctx.cfg.public_url.as_deref()) {
        return error(conn, req, &cross_origin());
    }
    if let Some(key) = key {
        ctx.dashboard.sessions.remove(&key);
        info!("dashboard: signed out from {}", conn.peer.ip());
    }
    let cookie = session::clear_cookie(secure(ctx));
    let extra = [
        ("set-cookie", cookie.as_str()),
        ("location", "/dashboard"),
        ("cache-control", "no-store"),
    ];
    write(
        conn,
        req,
        303,
        "text/plain; charset=utf-8",
        b"signed out",
        &extra,
    )
}

/// `POST /dashboard/api/...` for a request that has a session.
pub fn act(conn: &mut Conn, ctx: &Ctx, req: &Request) -> bool {
    if !session::same_origin(req, ctx.cfg.public_url.as_deref()) {
        return error(conn, req, &cross_origin());
    }
    let rest = req.path.trim_start_matches("/dashboard/api/");
    let segments: Vec<&str> = rest.split('/').collect();
    let result = match segments.as_slice() {
        ["workers", id, "drain"] => ops::drain(ctx, id, &req.body),
        ["models", "refresh"] => ops::refresh(ctx),
        ["keys"] => ops::create_key(ctx, &req.body),
        ["keys", id, "revoke"] => ops::revoke_key(ctx, id),
        _ => Err(ApiError::new(
            404,
            "not_found",
            format!("no dashboard action {}", req.path),
        )),
    };
    match result {
        Ok((status, body)) => write_json(conn, req, status, &body),
        Err(e) => error(conn, req, &e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn form_fields_are_decoded() {
        let body = b"next=%2Fsetup&token=a%2Bb+c%26d";
        assert_eq!(form_field(body, "token").as_deref(), Some("a+b c&d"));
        assert_eq!(form_field(body, "next").as_deref(), Some("/setup"));
        assert_eq!(form_field(body, "nope"), None);
        assert_eq!(form_field(&[0xff, b'='], "x"), None);
    }
}
