//! The parsers behind detection and residency: pure functions from one recorded
//! backend answer (`/api/version`, `/props`, `/v1/models`, `/api/ps`, `/models`,
//! `/api/show`) to what it says. Apart from the parent module, which makes the bounded
//! HTTP calls and keeps the state, so that each backend's quirks are tested on recorded
//! bodies alone and a new backend version means editing one function here.

use serde_json::Value;

use super::Resident;
use crate::protocol::ModelInfo;

/// Whether two names mean the same model: equal, or equal once Ollama's implied
/// `:latest` tag is added (`llama3` is `llama3:latest`).
pub fn same_model(a: &str, b: &str) -> bool {
    a == b || without_latest(a) == without_latest(b)
}

fn without_latest(name: &str) -> &str {
    name.strip_suffix(":latest").unwrap_or(name)
}

fn json_object(body: &str) -> Option<serde_json::Map<String, Value>> {
    match serde_json::from_str(body) {
        Ok(Value::Object(map)) => Some(map),
        _ => None,
    }
}

/// Ollama's `GET /api/version`: `{"version": "0.5.1"}`.
pub fn is_ollama_version(body: &str) -> bool {
    json_object(body).is_some_and(|o| o.get("version").is_some_and(Value::is_string))
}

/// llama-server's `GET /props`: `default_generation_settings`, `model_path` and
/// `build_info` with a model; a router answers with at least `"role": "router"`.
pub fn is_llama_server_props(body: &str) -> bool {
    json_object(body).is_some_and(|o| {
        o.contains_key("default_generation_settings")
            || o.contains_key("model_path")
            || o.get("build_info").is_some_and(Value::is_string)
            || o.get("role").and_then(Value::as_str) == Some("router")
    })
}

/// Whether llama-server's `/props` (or vLLM's `/is_sleeping`) says the model is unloaded
/// while idle (`"is_sleeping": true`).
pub fn llama_server_sleeping(body: &str) -> bool {
    json_object(body).is_some_and(|o| o.get("is_sleeping") == Some(&Value::Bool(true)))
}

/// vLLM's `GET /v1/models`: its entries are `"owned_by": "vllm"`.
pub fn is_vllm_model_list(body: &str) -> bool {
    json_object(body)
        .and_then(|o| o.get("data").and_then(Value::as_array).cloned())
        .is_some_and(|data| {
            data.iter()
                .any(|m| m.get("owned_by").and_then(Value::as_str) == Some("vllm"))
        })
}

/// Ollama's `GET /api/ps`: the `name` (and `model`) of each running model.
pub fn parse_ollama_ps(body: &str) -> Result<Vec<String>, String> {
    let o = json_object(body).ok_or("/api/ps is not a JSON object")?;
    let models = match o.get("models") {
        Some(Value::Array(list)) => list.as_slice(),
        // An idle Ollama may answer `"models": null`.
        Some(Value::Null) => &[],
        _ => return Err("/api/ps has no `models` list".into()),
    };
    let mut names: Vec<String> = Vec::new();
    for m in models {
        for key in ["name", "model"] {
            if let Some(name) = m.get(key).and_then(Value::as_str) {
                if !names.iter().any(|n| n == name) {
                    names.push(name.to_string());
                }
            }
        }
    }
    Ok(names)
}

/// A model's state in llama-server's router list: `"status": {"value": "loaded"}`
/// (a bare string is accepted too). `None`: the entry has no status.
fn llama_status(entry: &Value) -> Option<&str> {
    match entry.get("status")? {
        Value::String(s) => Some(s),
        status => status.get("value").and_then(Value::as_str),
    }
}

/// llama-server's `GET /models` (or `/v1/models`): in router mode each entry has a
/// `status`, and only `loaded` ones count (`loading`, `unloaded`, `sleeping`,
/// `downloading` do not); a single-model server's entries have none: [`Resident::All`].
pub fn parse_llama_models(body: &str) -> Result<Resident, String> {
    let o = json_object(body).ok_or("/models is not a JSON object")?;
    let data = o
        .get("data")
        .and_then(Value::as_array)
        .ok_or("/models has no `data` list")?;
    if !data.iter().any(|m| llama_status(m).is_some()) {
        return Ok(Resident::All);
    }
    Ok(Resident::Names(
        data.iter()
            .filter(|m| llama_status(m) == Some("loaded"))
            .filter_map(|m| m.get("id").and_then(Value::as_str).map(String::from))
            .collect(),
    ))
}

fn string_list(value: Option<&Value>) -> Vec<String> {
    value
        .and_then(Value::as_array)
        .map(|list| {
            list.iter()
                .filter_map(|c| c.as_str().map(String::from))
                .collect()
        })
        .unwrap_or_default()
}

/// Ollama's `POST /api/show`: `capabilities` as listed, and the context length from the
/// `model_info` key ending in `.context_length` (`llama.context_length`, ...).
pub fn parse_ollama_show(body: &str) -> Result<ModelInfo, String> {
    let o = json_object(body).ok_or("/api/show is not a JSON object")?;
    if !o.contains_key("model_info") && !o.contains_key("capabilities") {
        return Err("/api/show has neither `model_info` nor `capabilities`".into());
    }
    let context_length = o
        .get("model_info")
        .and_then(Value::as_object)
        .and_then(|info| {
            info.iter()
                .find(|(k, _)| k.ends_with(".context_length"))
                .and_then(|(_, v)| v.as_u64())
        });
    Ok(ModelInfo {
        context_length,
        capabilities: string_list(o.get("capabilities")),
    })
}

/// Whether llama-server's `GET /props` is a router's (`"role": "router"`).
pub fn is_llama_router_props(body: &str) -> bool {
    json_object(body).is_some_and(|o| o.get("role").and_then(Value::as_str) == Some("router"))
}

/// A single-model llama-server's `GET /props`: `default_generation_settings.n_ctx` (or a
/// top-level `n_ctx`), `completion`, and `vision` when `modalities.vision` is true.
/// Also a router's `/props?model=NAME` for a loaded model. `None` for a router's own
/// `/props` (it describes no one model) or an unreadable body.
pub fn parse_llama_props_info(body: &str) -> Option<ModelInfo> {
    let o = json_object(body)?;
    if o.get("role").and_then(Value::as_str) == Some("router") {
        return None;
    }
    let context_length = o
        .get("default_generation_settings")
        .and_then(|d| d.get("n_ctx"))
        .and_then(Value::as_u64)
        .or_else(|| o.get("n_ctx").and_then(Value::as_u64));
    let mut capabilities = vec!["completion".to_string()];
    if o.get("modalities").and_then(|m| m.get("vision")) == Some(&Value::Bool(true)) {
        capabilities.push("vision".to_string());
    }
    Some(ModelInfo {
        context_length,
        capabilities,
    })
}

/// vLLM's `GET /v1/models`: each listed model with its `max_model_len` (`None` when the
/// entry has none).
pub fn parse_vllm_max_len(body: &str) -> Result<Vec<(String, Option<u64>)>, String> {
    let o = json_object(body).ok_or("/v1/models is not a JSON object")?;
    let data = o
        .get("data")
        .and_then(Value::as_array)
        .ok_or("/v1/models has no `data` list")?;
    Ok(data
        .iter()
        .filter_map(|m| {
            let id = m.get("id").and_then(Value::as_str)?;
            Some((
                id.to_string(),
                m.get("max_model_len").and_then(Value::as_u64),
            ))
        })
        .collect())
}
