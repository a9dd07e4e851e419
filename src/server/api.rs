//! The route table: method + path → handler. Nothing else lives here and nothing
//! imports it but the HTTP front, which calls [`route`] for every parsed request.

use std::sync::Arc;

use super::auth::authorize_client;
#[cfg(feature = "moe")]
use super::body::inspect_body;
use super::dispatcher::wire_request_id;
use super::errors::{ApiError, Style};
use super::http::request::{Conn, Request};
use super::lifecycle::routes as lifecycle;
#[cfg(feature = "moe")]
use super::moe;
#[cfg(feature = "ollama")]
use super::ollama::routes as ollama;
#[cfg(feature = "ollama")]
use super::ollama::translate::Endpoint;
use super::relay;
use super::reply::{self, write_error};
use super::resume;
use super::tenancy::identity::identify;
use super::{dashboard, endpoints, ops, status, usage, worker_socket, Ctx};

/// `GET /v1/models/load/{taskId}`.
const TASK_PREFIX: &str = "/v1/models/load/";

/// Routes whose body is relayed to a worker unchanged.
pub const RELAYED_ROUTES: &[&str] = &[
    "/v1/chat/completions",
    "/v1/responses",
    "/v1/messages",
    "/v1/completions",
    "/v1/embeddings",
];

/// Runs the handler for `req`; gives the connection back when it may carry another
/// request (keep-alive), `None` when it was closed or handed to the worker socket.
pub fn route(mut conn: Conn, ctx: &Arc<Ctx>, req: Request) -> Option<Conn> {
    let peer = conn.peer;
    // A relayed request takes its id when it is admitted; every other answer (a wrong
    // method on a relayed path too) gets one here.
    let extra = &ctx.cfg.extra_routes;
    let relayed = req.method == "POST"
        && (RELAYED_ROUTES.contains(&req.path.as_str())
            || cfg!(feature = "ollama") && ollama_endpoint(&req.path)
            || endpoints::spec(&req.path, extra).is_some());
    conn.request_id = if relayed {
        None
    } else {
        Some(wire_request_id(ctx.next_request_id()))
    };
    let keep = match (req.method.as_str(), req.path.as_str()) {
        ("GET", "/v1/worker/connect") => {
            worker_socket::accept(conn, req, ctx.clone());
            return None;
        }
        ("POST", path) if RELAYED_ROUTES.contains(&path) => {
            match authorize_client(ctx, &req, peer.ip()) {
                Ok(caller) => match identify(&req, caller.clone(), ctx.gate.policy()) {
                    #[cfg(feature = "moe")]
                    Ok(caller) if ctx.cfg.moe_enabled && path == moe::ROUTE => {
                        match inspect_body(&req.body) {
                            Ok(info) if moe::requested(&info.model) => {
                                moe::serve(&mut conn, ctx, req, caller, info)
                            }
                            Ok(info) => relay::relay_inspected(&mut conn, ctx, req, caller, info),
                            Err(e) => {
                                let keep = req.keep_alive;
                                reply::reject_caller(&mut conn, ctx, path, &e, keep, Some(&caller))
                            }
                        }
                    }
                    Ok(caller) => relay::relay(&mut conn, ctx, req, caller),
                    Err(e) => {
                        let known = caller.with_key_tenant();
                        reply::reject_caller(
                            &mut conn,
                            ctx,
                            path,
                            &e,
                            req.keep_alive,
                            known.as_ref(),
                        )
                    }
                },
                Err(e) => reply::reject(&mut conn, ctx, path, &e, req.keep_alive),
            }
        }
        ("POST", path) if endpoints::spec(path, extra).is_some() => {
            let spec = endpoints::spec(path, extra);
            match authorize_client(ctx, &req, peer.ip())
                .and_then(|c| identify(&req, c, ctx.gate.policy()))
            {
                Ok(caller) => match spec {
                    Some(spec) => endpoints::relay(&mut conn, ctx, req, caller, spec),
                    None => false,
                },
                Err(e) => reply::reject(&mut conn, ctx, path, &e, req.keep_alive),
            }
        }
        ("GET", "/v1/models") => match authorize_client(ctx, &req, peer.ip()) {
            Ok(_) => status::models(&mut conn, ctx, &req),
            Err(e) => write_error(&mut conn, Style::OpenAi, &e, req.keep_alive, None),
        },
        #[cfg(feature = "ollama")]
        ("POST", path) if ollama::endpoint(path).is_some() => {
            let ep = ollama::endpoint(path).unwrap_or(Endpoint::Chat);
            match authorize_client(ctx, &req, peer.ip())
                .and_then(|c| identify(&req, c, ctx.gate.policy()))
            {
                Ok(caller) => ollama::infer(&mut conn, ctx, req, caller, ep),
                Err(e) => reply::reject(&mut conn, ctx, path, &e, req.keep_alive),
            }
        }
        #[cfg(feature = "ollama")]
        ("GET" | "HEAD", "/") => ollama::banner(&mut conn, req.method == "HEAD", req.keep_alive),
        #[cfg(feature = "ollama")]
        ("GET", "/api/version") => ollama::version(&mut conn, req.keep_alive),
        #[cfg(feature = "ollama")]
        ("GET", "/api/tags" | "/api/ps") | ("POST", "/api/show") => {
            match authorize_client(ctx, &req, peer.ip()) {
                Ok(_) if req.path == "/api/tags" => ollama::tags(&mut conn, ctx, req.keep_alive),
                Ok(_) if req.path == "/api/ps" => ollama::ps(&mut conn, ctx, req.keep_alive),
                Ok(_) => ollama::show(&mut conn, ctx, &req),
                Err(e) => write_error(&mut conn, Style::Ollama, &e, req.keep_alive, None),
            }
        }
        #[cfg(not(feature = "ollama"))]
        (_, path) if OLLAMA_ROUTES.contains(&path) || ollama_endpoint(path) => {
            let e = ApiError::new(
                404,
                "ollama_not_built",
                "this relay was built without Ollama's API (cargo feature `ollama`)",
            );
            write_error(&mut conn, Style::Ollama, &e, req.keep_alive, None)
        }
        ("GET", "/health") => status::health(&mut conn, ctx, &req),
        ("GET", "/metrics") => ops::metrics(&mut conn, ctx, &req),
        ("GET", "/v1/capabilities") => lifecycle::capabilities(&mut conn, ctx, &req),
        ("POST", "/v1/models/load") => lifecycle::load(&mut conn, ctx, &req),
        ("POST", "/v1/models/unload") => lifecycle::unload(&mut conn, ctx, &req),
        ("POST", "/v1/cache/flush") => lifecycle::flush(&mut conn, ctx, &req),
        ("GET", path) if path.starts_with(TASK_PREFIX) && path.len() > TASK_PREFIX.len() => {
            lifecycle::task(&mut conn, ctx, &req, &path[TASK_PREFIX.len()..])
        }
        ("GET", path) if resume::handler::owns(path) => {
            resume::handler::serve(&mut conn, ctx, &req, peer.ip())
        }
        ("GET", "/admin/usage") => usage::query::serve(&mut conn, ctx, &req),
        ("GET", "/api/usage-stream") => usage::stream::serve(&mut conn, ctx, &req),
        (_, path) if path.starts_with("/admin/") => ops::admin(&mut conn, ctx, &req),
        (_, path) if dashboard::owns(path) => dashboard::serve(&mut conn, ctx, &req),
        (_, path) => {
            let e = if is_known(path) || endpoints::spec(path, extra).is_some() {
                ApiError::new(
                    405,
                    "method_not_allowed",
                    format!("{} is not allowed on {path}", req.method),
                )
            } else {
                ApiError::new(
                    404,
                    "not_found",
                    format!("no route for {} {path}", req.method),
                )
            };
            write_error(&mut conn, Style::for_path(path), &e, req.keep_alive, None)
        }
    };
    keep.then_some(conn)
}

/// Ollama's API paths other than the inference ones.
const OLLAMA_ROUTES: &[&str] = &["/", "/api/version", "/api/tags", "/api/ps", "/api/show"];

/// Whether `path` is one of Ollama's inference routes (`/api/chat`, ...). Without the
/// `ollama` feature (the router build) every Ollama route answers 404 `ollama_not_built`.
fn ollama_endpoint(path: &str) -> bool {
    #[cfg(feature = "ollama")]
    return ollama::endpoint(path).is_some();
    #[cfg(not(feature = "ollama"))]
    return matches!(
        path,
        "/api/chat" | "/api/generate" | "/api/embed" | "/api/embeddings"
    );
}

fn is_known(path: &str) -> bool {
    RELAYED_ROUTES.contains(&path)
        || resume::handler::owns(path)
        || ollama_endpoint(path)
        || OLLAMA_ROUTES.contains(&path)
        || [
            "/v1/models",
            "/health",
            "/v1/worker/connect",
            "/admin/usage",
            "/api/usage-stream",
            "/v1/capabilities",
            "/v1/models/load",
            "/v1/models/unload",
            "/v1/cache/flush",
        ]
        .contains(&path)
}
