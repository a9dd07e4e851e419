//! Ollama's API on the relay, so Open WebUI or the `ollama` client can point at it and
//! change nothing else.
//!
//! Inference routes (`/api/chat`, `/api/generate`, `/api/embed`, `/api/embeddings`) are
//! translated to the OpenAI request every worker already forwards ([`translate`]) and go
//! through [`relay::run`] like any other request: queueing, tenants, cancel, requeue,
//! failover and metrics are the same. The answer is translated back on the way out
//! ([`OllamaShape`]). The listing routes answer from what the dispatcher publishes.

use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde_json::{json, Value};

use super::translate::{self, Endpoint, StreamConverter, Timing};
use crate::protocol::ModelInfo;
use crate::server::errors::{ApiError, Style};
use crate::server::http::request::{Conn, Request};
use crate::server::relay::{self, Job, Reshape};
use crate::server::reply;
use crate::server::tenancy::identity::Caller;
use crate::server::Ctx;

/// The Ollama API version the relay speaks (clients check that one answers).
pub const OLLAMA_API_VERSION: &str = "0.9.0";

/// The endpoint behind an inference route, if `path` is one.
pub fn endpoint(path: &str) -> Option<Endpoint> {
    match path {
        "/api/chat" => Some(Endpoint::Chat),
        "/api/generate" => Some(Endpoint::Generate),
        "/api/embed" => Some(Endpoint::Embed),
        "/api/embeddings" => Some(Endpoint::LegacyEmbeddings),
        _ => None,
    }
}

/// `POST /api/chat` and friends: translate, relay, translate back.
pub fn infer(conn: &mut Conn, ctx: &Ctx, req: Request, caller: Caller, ep: Endpoint) -> bool {
    // A chat with no messages or a generate with no prompt is how clients load a model
    // (`ollama run` sends one first): answered here, as Ollama does, without a backend.
    // Only for a model some worker serves: an unknown one takes the usual path (404).
    if let Some(answer) = translate::preload(ep, &req.body, unix_ms()) {
        if is_served(ctx, &req.body) {
            return conn.write_full(200, "application/json", answer.as_bytes(), req.keep_alive);
        }
    }
    let t = match translate::request(ep, &req.body) {
        Ok(t) => t,
        Err(e) => {
            let e = ApiError::new(e.status, "invalid_request", e.message);
            return reply::reject_caller(conn, ctx, &req.path, &e, req.keep_alive, Some(&caller));
        }
    };
    let shape = OllamaShape {
        endpoint: ep,
        model: t.model.clone(),
        converter: StreamConverter::new(ep, &t.model, Instant::now()),
    };
    let job = Job {
        route: req.path.clone(),
        endpoint_path: t.path.to_string(),
        model: t.model,
        stream: t.stream,
        body: t.body,
        style: Style::Ollama,
        reshape: Some(Box::new(shape)),
    };
    relay::run(conn, ctx, &req, job, caller)
}

/// Rewrites OpenAI answers into Ollama's: NDJSON lines for streams, one object else.
struct OllamaShape {
    endpoint: Endpoint,
    model: String,
    converter: StreamConverter,
}

impl Reshape for OllamaShape {
    fn stream_type(&self) -> &'static str {
        "application/x-ndjson"
    }

    fn chunk(&mut self, chunk: &str) -> String {
        self.converter.feed(chunk, Instant::now(), unix_ms())
    }

    fn end(&mut self, rest: &str) -> String {
        let mut out = self.converter.feed(rest, Instant::now(), unix_ms());
        out.push_str(&self.converter.finish(Instant::now(), unix_ms()));
        out
    }

    fn whole(&mut self, status: u16, body: &str, elapsed: Duration) -> (u16, String) {
        if status != 200 {
            let e = translate::error_from_openai(status, body);
            return (e.status, e.body());
        }
        let timing = Timing {
            total: elapsed,
            first_token: None,
            now_unix_ms: unix_ms(),
        };
        match translate::response(self.endpoint, &self.model, body, &timing) {
            Ok(text) => (200, text),
            Err(e) => (e.status, translate::error_body(&e.message)),
        }
    }

    fn tokens(&self) -> (u64, u64) {
        self.converter.usage()
    }
}

/// Whether the `model` of a request body is one a worker advertises.
fn is_served(ctx: &Ctx, body: &[u8]) -> bool {
    let v: Value = serde_json::from_slice(body).unwrap_or(Value::Null);
    v["model"]
        .as_str()
        .is_some_and(|m| ctx.shared.models().iter().any(|s| s == m))
}

fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// `GET /` and `HEAD /`: what Ollama answers, so clients that probe for it find one.
pub fn banner(conn: &mut Conn, head_only: bool, keep_alive: bool) -> bool {
    let body: &[u8] = if head_only { b"" } else { b"Ollama is running" };
    conn.write_full(200, "text/plain; charset=utf-8", body, keep_alive)
}

/// `GET /api/version`.
pub fn version(conn: &mut Conn, keep_alive: bool) -> bool {
    conn.write_json(200, &json!({ "version": OLLAMA_API_VERSION }), keep_alive)
}

/// One model as `/api/tags` and `/api/ps` list it; sizes and digests are unknown here.
fn model_entry(name: &str, modified: &str) -> Value {
    json!({
        "name": name,
        "model": name,
        "modified_at": modified,
        "size": 0,
        "digest": "",
        "details": {
            "parent_model": "",
            "format": "",
            "family": "",
            "families": [],
            "parameter_size": "",
            "quantization_level": "",
        },
    })
}

/// `GET /api/tags`: every model a worker advertises.
pub fn tags(conn: &mut Conn, ctx: &Ctx, keep_alive: bool) -> bool {
    let since = translate::rfc3339(ctx.started_unix * 1000);
    let models: Vec<Value> = ctx
        .shared
        .models()
        .iter()
        .map(|m| model_entry(m, &since))
        .collect();
    conn.write_json(200, &json!({ "models": models }), keep_alive)
}

/// `GET /api/ps`: models some worker reports loaded in memory.
pub fn ps(conn: &mut Conn, ctx: &Ctx, keep_alive: bool) -> bool {
    let since = translate::rfc3339(ctx.started_unix * 1000);
    let models: Vec<Value> = ctx
        .shared
        .loaded()
        .iter()
        .map(|m| {
            let mut e = model_entry(m, &since);
            e["expires_at"] = json!(translate::rfc3339(unix_ms() + 300_000));
            e["size_vram"] = json!(0);
            e
        })
        .collect();
    conn.write_json(200, &json!({ "models": models }), keep_alive)
}

/// `POST /api/show`: what the relay knows of a model, from what its workers' backends
/// say (merged over the workers). `capabilities` as they report them, `["completion"]`
/// when none reported any; the context length, when known, under `model_info` as
/// `general.context_length`: Ollama names it `<architecture>.context_length`, and
/// clients look for the key ending in `.context_length`; the relay knows no
/// architecture, so it invents none.
pub fn show(conn: &mut Conn, ctx: &Ctx, req: &Request) -> bool {
    let keep = req.keep_alive;
    let v: Value = serde_json::from_slice(&req.body).unwrap_or(Value::Null);
    let Some(name) = v["model"].as_str().or_else(|| v["name"].as_str()) else {
        let e = ApiError::new(400, "invalid_request", "model is required");
        return reply::write_error(conn, Style::Ollama, &e, keep, None);
    };
    if !ctx.shared.models().iter().any(|m| m == name) {
        let shown = crate::server::logsafe::bounded(name);
        let e = ApiError::new(404, "model_not_found", format!("model '{shown}' not found"));
        return reply::write_error(conn, Style::Ollama, &e, keep, None);
    }
    let (capabilities, model_info) = show_info(ctx.shared.model_info().get(name));
    let body = json!({
        "modelfile": "",
        "parameters": "",
        "template": "",
        "details": model_entry(name, "")["details"],
        "model_info": model_info,
        "capabilities": capabilities,
        "modified_at": translate::rfc3339(ctx.started_unix * 1000),
    });
    conn.write_json(200, &body, keep)
}

/// `capabilities` and `model_info` of `/api/show` for what workers said of a model.
fn show_info(info: Option<&ModelInfo>) -> (Value, Value) {
    let capabilities = match info {
        Some(i) if !i.capabilities.is_empty() => json!(i.capabilities),
        // Nothing reported: what the relay can vouch for is that it completes with it.
        _ => json!(["completion"]),
    };
    let model_info = match info.and_then(|i| i.context_length) {
        Some(n) => json!({ "general.context_length": n }),
        None => json!({}),
    };
    (capabilities, model_info)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn show_answers_from_what_workers_reported() {
        let (caps, info) = show_info(None);
        assert_eq!(caps, json!(["completion"]));
        assert_eq!(info, json!({}));
        let reported = ModelInfo {
            context_length: Some(8192),
            capabilities: vec!["completion".into(), "tools".into()],
        };
        let (caps, info) = show_info(Some(&reported));
        assert_eq!(caps, json!(["completion", "tools"]));
        assert_eq!(info, json!({"general.context_length": 8192}));
        let (caps, info) = show_info(Some(&ModelInfo::default()));
        assert_eq!(
            caps,
            json!(["completion"]),
            "an empty list is no capability list"
        );
        assert_eq!(info, json!({}));
    }
}
