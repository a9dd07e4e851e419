//! What a flavoured [`FakeBackend`] answers beyond the OpenAI routes: Ollama, a
//! llama-server router and vLLM, with what is loaded (issue 10) and the lifecycle routes
//! (issue 12). Every POST answered here is reported to the observer first.
//!
//! * Ollama: `/api/version`, `/api/tags`, `/api/ps`, `POST /api/show`; `POST /api/generate`
//!   without a prompt loads the model (`keep_alive: 0` unloads it), 404 for a model it does
//!   not have; `POST /api/pull` streams NDJSON progress for a model in
//!   [`FakeBackend::pullable`] (then lists it), an `{"error"}` line for any other.
//! * llama-server router: `/props`, `/models` with a status per model; `POST /models/load`
//!   marks a model `loading` (it shows `loaded` from the `/models` read after the one
//!   that showed `loading`), `POST /models/unload`; per loaded model (`?model=` or the
//!   body's `model`) two slots at `GET /slots`, `POST /slots/{id}?action=erase`, and
//!   `GET /metrics`.
//! * vLLM: `/v1/models` (`owned_by: vllm`), `/version`, `/metrics`; with dev mode (the
//!   default) `POST /sleep`, `POST /wake_up`, `GET /is_sleeping`, `POST
//!   /reset_prefix_cache`, which answer 404 without it.
//! * Any flavour: [`FakeBackend::failing`] paths answer their status and an error body.

use std::io::Write;
use std::net::TcpStream;
use std::sync::atomic::Ordering;

use serde_json::{json, Value};

use super::{
    json_string, ollama_name, respond, start_stream, write_chunk, FakeBackend, Flavour, Observed,
    OLLAMA_CAPABILITIES, OLLAMA_CONTEXT_LENGTH,
};

/// The version every flavour reports.
pub const FAKE_VERSION: &str = "0.0.0-fake";
/// The `build_info` of a fake llama-server.
pub const FAKE_BUILD: &str = "b0-fake";
/// Slots per loaded model of a fake llama-server router.
pub const ROUTER_SLOTS: u64 = 2;
/// The context a router's loaded model has (`/props?model=`, `/slots`).
pub const ROUTER_N_CTX: u64 = 4096;
/// The KV-cache usage a fake llama-server or vLLM reports in `/metrics`.
pub const FAKE_KV_USAGE: f64 = 0.25;

/// An answer of a flavoured route.
enum Reply {
    Json(u16, String),
    Text(u16, String),
    /// One NDJSON line per element, streamed.
    Lines(Vec<String>),
}

fn ok(v: Value) -> Option<Reply> {
    Some(Reply::Json(200, v.to_string()))
}

fn err(status: u16, message: &str) -> Option<Reply> {
    Some(Reply::Json(
        status,
        json!({"error": {"code": status, "message": message, "type": "fake_error"}}).to_string(),
    ))
}

/// `a=1&b=x%2Fy` → the value of `key`, percent-decoded.
fn query_param(query: &str, key: &str) -> Option<String> {
    let raw = query
        .split('&')
        .find_map(|kv| kv.strip_prefix(key)?.strip_prefix('='))?;
    let bytes = raw.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < bytes.len() {
        let hex = raw.get(i + 1..i + 3).filter(|_| bytes[i] == b'%');
        match hex.and_then(|h| u8::from_str_radix(h, 16).ok()) {
            Some(b) => {
                out.push(b);
                i += 3;
            }
            None => {
                out.push(bytes[i]);
                i += 1;
            }
        }
    }
    String::from_utf8(out).ok()
}

fn body_json(body: &str) -> Value {
    serde_json::from_str(body).unwrap_or(Value::Null)
}

fn model_of(v: &Value) -> String {
    v["model"].as_str().unwrap_or_default().to_string()
}

impl FakeBackend {
    /// Answers a flavoured route; `None` when `target` is not one (the caller goes on).
    pub(super) fn flavoured(
        &self,
        out: &mut TcpStream,
        method: &str,
        target: &str,
        body: &str,
    ) -> Option<bool> {
        let (path, query) = target.split_once('?').unwrap_or((target, ""));
        let failing = self
            .failing
            .iter()
            .find(|(p, _)| p == path)
            .map(|(_, s)| *s);
        let reply = match failing {
            Some(status) => err(status, &format!("fake failure of {path}")),
            None => match self.flavour {
                Flavour::OpenAi => None,
                Flavour::Ollama => self.ollama_route(method, path, body),
                Flavour::LlamaRouter => self.router_route(method, path, query, body),
                Flavour::Vllm => self.vllm_route(method, path),
            },
        }?;
        if method == "POST" {
            self.observe(Observed::Request(target.to_string(), body.to_string()));
        }
        Some(match reply {
            Reply::Json(status, text) => respond(out, status, "application/json", text.as_bytes()),
            Reply::Text(status, text) => respond(out, status, "text/plain", text.as_bytes()),
            Reply::Lines(lines) => {
                if !start_stream(out) {
                    return Some(false);
                }
                for line in lines {
                    if write_chunk(out, format!("{line}\n").as_bytes()).is_err() {
                        return Some(false);
                    }
                }
                out.write_all(b"0\r\n\r\n").is_ok()
            }
        })
    }

    /// What the backend lists: its models and whatever was pulled since.
    pub fn listed(&self) -> Vec<String> {
        let mut all = self.models.clone();
        all.extend(self.pulled.lock().iter().cloned());
        all
    }

    fn ollama_route(&self, method: &str, path: &str, body: &str) -> Option<Reply> {
        let has = |m: &str| {
            self.listed()
                .iter()
                .any(|x| ollama_name(x) == ollama_name(m))
        };
        match (method, path) {
            ("GET", "/v1/models") => {
                let data: Vec<Value> = self
                    .listed()
                    .iter()
                    .map(|m| json!({"id": m, "object": "model", "created": 1, "owned_by": "library"}))
                    .collect();
                ok(json!({"object": "list", "data": data}))
            }
            ("GET", "/api/version") => ok(json!({ "version": FAKE_VERSION })),
            ("GET", "/api/tags" | "/api/ps") => {
                let list = if path == "/api/ps" {
                    self.loaded.lock().clone()
                } else {
                    self.listed()
                };
                let models: Vec<Value> = list
                    .iter()
                    .map(|m| {
                        let name = ollama_name(m);
                        json!({"name": name, "model": name, "size": 1, "digest": "0"})
                    })
                    .collect();
                ok(json!({ "models": models }))
            }
            ("POST", "/api/show") => {
                let asked = model_of(&body_json(body));
                if !has(&asked) {
                    return Some(Reply::Json(
                        404,
                        json!({"error": format!("model '{asked}' not found")}).to_string(),
                    ));
                }
                ok(json!({
                    "modelfile": "", "parameters": "", "template": "",
                    "details": {"format": "gguf", "family": "llama"},
                    "model_info": {"general.architecture": "llama",
                        "llama.context_length": OLLAMA_CONTEXT_LENGTH,
                        "llama.embedding_length": 4096},
                    "capabilities": OLLAMA_CAPABILITIES,
                }))
            }
            ("POST", "/api/generate") => {
                let v = body_json(body);
                if v["prompt"].as_str().is_some_and(|p| !p.is_empty()) {
                    return None;
                }
                let model = model_of(&v);
                if !has(&model) {
                    return Some(Reply::Json(
                        404,
                        json!({"error": format!("model '{model}' not found")}).to_string(),
                    ));
                }
                let unload = v["keep_alive"] == json!(0) || v["keep_alive"] == json!("0");
                let mut loaded = self.loaded.lock();
                loaded.retain(|m| ollama_name(m) != ollama_name(&model));
                if !unload {
                    loaded.push(model.clone());
                }
                let reason = if unload { "unload" } else { "load" };
                ok(json!({"model": model, "response": "", "done": true, "done_reason": reason}))
            }
            ("POST", "/api/pull") => {
                let model = model_of(&body_json(body));
                let mut lines = vec![json!({"status": "pulling manifest"}).to_string()];
                if !self
                    .pullable
                    .iter()
                    .any(|m| ollama_name(m) == ollama_name(&model))
                {
                    lines.push(
                        json!({"error": "pull model manifest: file does not exist"}).to_string(),
                    );
                    return Some(Reply::Lines(lines));
                }
                let total: u64 = 3_000_000_000;
                for done in [0, 1_000_000_000, 2_000_000_000, total] {
                    lines.push(
                        json!({"status": "downloading sha256:f00d", "digest": "sha256:f00d",
                            "total": total, "completed": done})
                        .to_string(),
                    );
                }
                for status in ["verifying sha256 digest", "writing manifest", "success"] {
                    lines.push(json!({ "status": status }).to_string());
                }
                self.pulled.lock().push(model);
                Some(Reply::Lines(lines))
            }
            _ => None,
        }
    }

    fn router_route(&self, method: &str, path: &str, query: &str, body: &str) -> Option<Reply> {
        let is_loaded = |m: &str| self.loaded.lock().iter().any(|x| x == m);
        let named = query_param(query, "model");
        match (method, path) {
            ("GET", "/v1/models" | "/models") => {
                let loading: Vec<String> = self.loading.lock().drain(..).collect();
                let loaded = self.loaded.lock().clone();
                let data: Vec<Value> = self
                    .models
                    .iter()
                    .map(|m| {
                        let state = if loaded.contains(m) {
                            "loaded"
                        } else if loading.contains(m) {
                            "loading"
                        } else {
                            "unloaded"
                        };
                        json!({"id": m, "object": "model", "owned_by": "llamacpp",
                            "status": {"value": state}})
                    })
                    .collect();
                // What showed `loading` shows `loaded` from the next read on.
                self.loaded.lock().extend(loading);
                ok(json!({"object": "list", "data": data}))
            }
            ("GET", "/props") => match named {
                None => ok(json!({
                    "role": "router", "build_info": FAKE_BUILD, "is_sleeping": false,
                })),
                // One model's props: only a loaded one without `autoload`.
                Some(m) if !is_loaded(&m) => err(400, "model is not loaded"),
                Some(m) => ok(json!({
                    "default_generation_settings": {"id": 0, "n_ctx": ROUTER_N_CTX},
                    "model_path": format!("/models/{m}.gguf"), "build_info": FAKE_BUILD,
                    "modalities": {"vision": false, "audio": false},
                })),
            },
            ("POST", "/models/load") => {
                let m = model_of(&body_json(body));
                if !self.models.contains(&m) {
                    return err(404, "model is not found");
                }
                if is_loaded(&m) || self.loading.lock().contains(&m) {
                    return err(400, "model is already running");
                }
                self.loading.lock().push(m);
                ok(json!({ "success": true }))
            }
            ("POST", "/models/unload") => {
                let m = model_of(&body_json(body));
                if !is_loaded(&m) {
                    return err(400, "model is not running");
                }
                self.loaded.lock().retain(|x| *x != m);
                ok(json!({ "success": true }))
            }
            ("GET", "/slots" | "/metrics") => {
                let Some(m) = named else {
                    return err(400, "model name is missing from the request");
                };
                if !is_loaded(&m) {
                    return err(400, "model is not loaded");
                }
                if path == "/metrics" {
                    return Some(Reply::Text(
                        200,
                        format!("llamacpp:kv_cache_usage_ratio {FAKE_KV_USAGE}\n"),
                    ));
                }
                let slots: Vec<Value> = (0..ROUTER_SLOTS)
                    .map(|id| json!({"id": id, "n_ctx": ROUTER_N_CTX, "is_processing": false}))
                    .collect();
                ok(Value::Array(slots))
            }
            ("POST", p) if p.starts_with("/slots/") => {
                let id: u64 = p["/slots/".len()..].parse().ok()?;
                let m = model_of(&body_json(body));
                if query_param(query, "action").as_deref() != Some("erase") || !is_loaded(&m) {
                    return err(400, "model is not loaded, or not an erase");
                }
                ok(json!({"id_slot": id, "n_erased": 7}))
            }
            _ => None,
        }
    }

    fn vllm_route(&self, method: &str, path: &str) -> Option<Reply> {
        let dev = self.dev_mode;
        match (method, path) {
            ("GET", "/v1/models") => ok(json!({"object": "list", "data": [
                {"id": self.model, "object": "model", "owned_by": "vllm", "max_model_len": 4096}
            ]})),
            ("GET", "/version") => ok(json!({ "version": FAKE_VERSION })),
            ("GET", "/metrics") => Some(Reply::Text(
                200,
                format!(
                    "vllm:kv_cache_usage_perc{{model_name={}}} {FAKE_KV_USAGE}\n",
                    json_string(&self.model)
                ),
            )),
            ("GET", "/is_sleeping") | ("POST", "/sleep" | "/wake_up" | "/reset_prefix_cache")
                if !dev =>
            {
                Some(Reply::Json(404, json!({"detail": "Not Found"}).to_string()))
            }
            ("GET", "/is_sleeping") => {
                ok(json!({ "is_sleeping": self.sleeping.load(Ordering::SeqCst) }))
            }
            ("POST", "/sleep" | "/wake_up") => {
                let asleep = path == "/sleep";
                self.sleeping.store(asleep, Ordering::SeqCst);
                *self.loaded.lock() = if asleep {
                    vec![]
                } else {
                    vec![self.model.clone()]
                };
                Some(Reply::Text(200, String::new()))
            }
            ("POST", "/reset_prefix_cache") => Some(Reply::Text(200, String::new())),
            _ => None,
        }
    }
}
