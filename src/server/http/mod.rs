//! The HTTP front: one thread per client connection, reading requests with
//! [`request::Conn`] and handing each to the route table ([`super::api`]) through the
//! browser guard ([`super::origin`]).

pub mod budget;
mod framing;
pub mod pieces;
pub mod request;
pub mod response;

use std::net::SocketAddr;
use std::sync::Arc;

use log::debug;

use super::dispatcher::wire_request_id;
use super::errors::{ApiError, Style};
use super::reply::write_error;
use super::Ctx;
use crate::net::Stream;
use request::{Conn, ReadError};

/// Serves one client connection until it closes or is upgraded.
pub fn serve(stream: Stream, peer: SocketAddr, ctx: Arc<Ctx>) {
    let _ = stream.set_nodelay(true);
    // Every answer on this connection: a client that stops reading frees its thread.
    let write_timeout = Some(ctx.cfg.limits.write_timeout).filter(|t| !t.is_zero());
    let _ = stream.set_write_timeout(write_timeout);
    let mut conn = Conn::new(stream, peer);
    loop {
        let streams = |req: &request::Request| super::endpoints::streams_body(&ctx, req);
        let req = match conn.read_request_or_defer(&ctx.cfg.limits, &streams) {
            Ok(req) => req,
            Err(ReadError::Closed) => return,
            Err(ReadError::Io(e)) => {
                debug!("connection from {peer}: {e}");
                return;
            }
            Err(ReadError::Reject(status, message)) => {
                let mut e = ApiError::new(status, reject_code(status), message);
                if status == 503 {
                    e.retry_after = Some(1);
                }
                conn.request_id = Some(wire_request_id(ctx.next_request_id()));
                write_error(&mut conn, Style::OpenAi, &e, false, None);
                return;
            }
        };
        let next = super::origin::route(conn, &ctx, req);
        match next {
            Some(c) => conn = c,
            None => return,
        }
    }
}

pub(crate) fn reject_code(status: u16) -> &'static str {
    match status {
        413 => "request_too_large",
        431 => "headers_too_large",
        408 => "request_timeout",
        501 => "not_implemented",
        503 => "bodies_over_budget",
        _ => "bad_request",
    }
}
