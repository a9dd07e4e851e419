//! The routes beyond chat the boxes serve: speech, transcription, images, rerank,
//! infill, tokenize, and the operator's own (`EXTRA_ROUTES`). They are relayed like chat
//! (queue, tenants, limits, routing by model, cancel, failover before the first byte),
//! through [`relay::run_with`].
//!
//! Two kinds. JSON routes (rerank, tokenize, ...) send JSON and get JSON or SSE back:
//! they travel as text, like chat, and any worker may serve them. Binary routes
//! (multipart uploads, generated audio, and every operator route, whose bodies the relay
//! cannot know) travel base64-encoded (`protocol::binary`) and go only to workers that
//! listed `binary_bodies`; an original worker is never sent one (it would forward the
//! base64 text itself), the client gets `501` instead.
//!
//! The model is read from the JSON body's `model`, else a multipart form's `model`
//! field ([`form`]), else an `X-Model` header; a request naming none goes to the one
//! model served when there is exactly one (llama-server's `/tokenize` names none).

use super::body::{inspect_body, MAX_MODEL_NAME_BYTES};
use super::errors::{ApiError, Style};
use super::http::pieces::refusal;
use super::http::request::{Conn, Request};
use super::relay::{self, Job};
use super::reply::reject_caller;
use super::tenancy::identity::Caller;
use super::Ctx;
use crate::cli::ConfigError;
use crate::protocol::binary;

mod form;

/// How a route's bodies travel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// JSON in, JSON or SSE out: text, any worker.
    Json,
    /// Bytes in or out (multipart, audio): base64, workers with `binary_bodies` only.
    Binary,
}

/// The built-in routes beyond chat.
const ROUTES: &[(&str, Kind)] = &[
    ("/v1/audio/transcriptions", Kind::Binary),
    ("/v1/audio/translations", Kind::Binary),
    ("/v1/audio/speech", Kind::Binary),
    ("/v1/images/generations", Kind::Json),
    ("/v1/images/edits", Kind::Binary),
    ("/v1/rerank", Kind::Json),
    ("/rerank", Kind::Json),
    ("/v1/reranking", Kind::Json),
    ("/v1/score", Kind::Json),
    ("/infill", Kind::Json),
    ("/tokenize", Kind::Json),
    ("/detokenize", Kind::Json),
    ("/apply-template", Kind::Json),
];

/// Every built-in route's path (a worker reports the ones its backend serves).
pub fn builtin() -> impl Iterator<Item = &'static str> {
    ROUTES.iter().map(|(path, _)| *path)
}

/// What a route needs from the worker that runs it (see `Needs`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Spec {
    /// The route's path.
    pub route: &'static str,
    /// Only workers serving it (or not saying) take it; an operator's route is not one
    /// a worker can know, so any worker may.
    pub checked: bool,
    /// Base64 bodies: only workers listing `binary_bodies` take it.
    pub binary: bool,
}

/// The route `path` is, when it is one of ours or the operator's.
pub fn spec(path: &str, extra: &[&'static str]) -> Option<Spec> {
    if let Some((route, kind)) = ROUTES.iter().find(|(p, _)| *p == path) {
        return Some(Spec {
            route,
            checked: true,
            binary: *kind == Kind::Binary,
        });
    }
    extra.iter().find(|p| **p == path).map(|route| Spec {
        route,
        checked: false,
        binary: true,
    })
}

/// Longest path `EXTRA_ROUTES` may name, and how many it may name.
const MAX_EXTRA_ROUTE: usize = 200;
const MAX_EXTRA_ROUTES: usize = 64;

/// Reads `EXTRA_ROUTES` (comma-separated paths). The paths live as long as the process
/// (they are named in routing needs), so they are leaked once, at start-up.
pub fn parse_extra_routes(text: Option<&str>) -> Result<Vec<&'static str>, ConfigError> {
    let mut out: Vec<&'static str> = Vec::new();
    for path in text.unwrap_or("").split(',').map(str::trim) {
        if path.is_empty() {
            continue;
        }
        let bad = |why: &str| ConfigError(format!("EXTRA_ROUTES: `{path}` {why}"));
        if !path.starts_with('/') || path.len() > MAX_EXTRA_ROUTE {
            return Err(bad(&format!(
                "must be a path starting with `/`, at most {MAX_EXTRA_ROUTE} bytes"
            )));
        }
        if !path
            .bytes()
            .all(|b| b.is_ascii_graphic() && b != b'?' && b != b'#')
        {
            return Err(bad("may hold no spaces, query or fragment"));
        }
        if spec(path, &[]).is_some()
            || super::api::RELAYED_ROUTES.contains(&path)
            || path.starts_with("/admin/")
            || path.starts_with("/api/")
            || path.starts_with("/v1/worker")
            || path.starts_with("/v1/models")
        {
            return Err(bad("is already a route of the relay"));
        }
        if !out.contains(&path) {
            out.push(Box::leak(path.to_string().into_boxed_str()));
        }
    }
    if out.len() > MAX_EXTRA_ROUTES {
        return Err(ConfigError(format!(
            "EXTRA_ROUTES: at most {MAX_EXTRA_ROUTES} routes"
        )));
    }
    Ok(out)
}

/// Relays one request on a route of [`spec`]; returns whether the connection may be
/// reused.
pub fn relay(conn: &mut Conn, ctx: &Ctx, mut req: Request, caller: Caller, spec: Spec) -> bool {
    let keep = req.keep_alive;
    // A large upload left on the connection: its first part names the model (a form's
    // `model` field before the file, or the X-Model header), the rest goes in pieces.
    let mut pieces = None;
    if let Some(mut body) = req.pending.take() {
        let first = ctx.cfg.limits.pieces_over;
        if let Err(e) = body.read_into(conn, &mut req.body, first) {
            return match refusal(&e) {
                Some(e) => reject_caller(conn, ctx, &req.path, &e, false, Some(&caller)),
                None => false,
            };
        }
        if !body.is_done() {
            pieces = Some(body);
        }
    }
    let (model, stream) = match model_of(ctx, &req) {
        Ok(found) => found,
        Err(e) => return reject_caller(conn, ctx, &req.path, &e, keep, Some(&caller)),
    };
    if let Some(body) = pieces {
        let job = Job {
            route: req.path.clone(),
            endpoint_path: req.path.clone(),
            model,
            stream,
            body: String::new(),
            style: Style::OpenAi,
            reshape: None,
        };
        let first = std::mem::take(&mut req.body);
        return relay::run_with(
            conn,
            ctx,
            &req,
            job,
            caller,
            Some(spec),
            Some((body, first)),
        );
    }
    let body = if spec.binary {
        // The raw bytes go as soon as they are encoded: a large upload is held once.
        let encoded = binary::encode(&req.body);
        req.body = Vec::new();
        encoded
    } else {
        match relay::text_body(&mut req) {
            Ok(text) => text,
            Err(e) => return reject_caller(conn, ctx, &req.path, &e, keep, Some(&caller)),
        }
    };
    let job = Job {
        route: req.path.clone(),
        endpoint_path: req.path.clone(),
        model,
        stream,
        body,
        style: Style::OpenAi,
        reshape: None,
    };
    relay::run_with(conn, ctx, &req, job, caller, Some(spec), None)
}

/// Whether the route of `req` takes a large body in pieces (binary routes: their body
/// is relayed as it is, so nothing needs it whole).
pub fn streams_body(ctx: &Ctx, req: &Request) -> bool {
    req.method == "POST" && spec(&req.path, &ctx.cfg.extra_routes).is_some_and(|s| s.binary)
}

/// The model a request names and whether it asks for a stream.
fn model_of(ctx: &Ctx, req: &Request) -> Result<(String, bool), ApiError> {
    let content_type = req.header("content-type").unwrap_or("");
    let mut stream = false;
    let mut named = None;
    if let Some(boundary) = form::boundary(content_type) {
        named = form::field(&req.body, &boundary, "model");
        stream = form::field(&req.body, &boundary, "stream").is_some_and(|v| v == "true");
    } else if req.body.first().is_some_and(|b| *b == b'{') {
        match inspect_body(&req.body) {
            Ok(info) => return Ok((info.model, info.stream)),
            // A JSON body without a model (llama-server's own routes): keep looking.
            Err(e) if e.code == "missing_model" => {}
            Err(e) => return Err(e),
        }
    }
    if named.is_none() {
        named = req.header("x-model").map(str::to_string);
    }
    let model = match named {
        Some(m) if m.len() > MAX_MODEL_NAME_BYTES => return Err(super::body::model_too_long()),
        Some(m) if !m.trim().is_empty() => m,
        _ => match ctx.shared.models().as_slice() {
            [only] => only.clone(),
            _ => {
                return Err(ApiError::new(
                    400,
                    "missing_model",
                    "name the model: the JSON body's `model`, the form's `model` field, or \
                     an X-Model header (more than one model is served)",
                ))
            }
        },
    };
    Ok((model, stream))
}
