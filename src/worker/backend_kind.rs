//! What the backend is, and which of its models it holds in memory (issue 10).
//!
//! `BACKEND_KIND=auto` (the default) asks the backend once it answers — at start-up and
//! each time it comes back after being down — with a few bounded `GET`s, first match wins:
//!
//! | kind | evidence |
//! |---|---|
//! | `ollama` | `GET /api/version` answers `{"version": "..."}` |
//! | `llama-server` | `GET /props` answers with `default_generation_settings`, `model_path`, `build_info` or `"role": "router"` |
//! | `vllm` | a `GET /v1/models` entry is `"owned_by": "vllm"` |
//! | `openai` | anything else (never an error) |
//!
//! What is loaded, per kind: Ollama lists it at `GET /api/ps` (`name:tag`, matched to the
//! advertised names with `:latest` implied); a llama-server in router mode lists every
//! model at `GET /models` with a `status` (`loaded`, `loading`, `unloaded`, ...), one in
//! single-model mode holds its one model unless `/props` says it is asleep; vLLM holds
//! everything it serves unless `GET /is_sleeping` says it sleeps; for `openai` it is
//! unknown and the field is left out.
//!
//! What each model is (`model_info`: context length and capabilities, for the relay's
//! `/api/show`) is read at the same moments, on the same thread, only for advertised
//! models not described yet (at most [`DESCRIBE_PER_PASS`] per pass; all again when re-detection
//! finds another kind): Ollama answers `POST /api/show` per model (`capabilities`
//! as it reports them, the context length from the `model_info` key ending in
//! `.context_length`); a single-model llama-server's `/props` gives
//! `default_generation_settings.n_ctx` and `completion` (+ `vision` when
//! `modalities.vision`); a llama-server router answers the same per loaded model
//! (`/props?model=NAME&autoload=false`; a model not loaded is asked again next pass);
//! vLLM's `/v1/models` gives `max_model_len` and `completion`. An `openai` backend
//! describes nothing. What is not said is `null`, never guessed.
//!
//! The parsers are pure functions over the recorded bodies ([`parse`]); the HTTP calls are thin.
//! The worker re-reads the set every `MODELS_REFRESH_SECS`, when the server asks, and —
//! signalled by [`Residency::after_request`], without any call on the request's path —
//! after a request for a model that was not loaded (the backend most likely loaded it).

use std::collections::BTreeMap;

use crossbeam_channel::{Receiver, Sender};
use log::{debug, info, warn};
use parking_lot::Mutex;

use super::backend::{Backend, ModelsError};
use crate::protocol::{ModelInfo, ModelInfoMap};

mod parse;
pub use parse::{
    is_llama_router_props, is_llama_server_props, is_ollama_version, is_vllm_model_list,
    llama_server_sleeping, parse_llama_models, parse_llama_props_info, parse_ollama_ps,
    parse_ollama_show, parse_vllm_max_len, same_model,
};

/// At most this many models are described in one pass (each one a `POST /api/show` on
/// Ollama); the rest follow in later passes.
pub const DESCRIBE_PER_PASS: usize = 32;

/// What the backend is (`backend_kind` in `register`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// Any OpenAI-compatible server: nothing known about what it holds in memory.
    OpenAi,
    Ollama,
    LlamaServer,
    Vllm,
}

impl Kind {
    /// The spelling on the wire and in `BACKEND_KIND`.
    pub fn as_str(self) -> &'static str {
        match self {
            Kind::OpenAi => "openai",
            Kind::Ollama => "ollama",
            Kind::LlamaServer => "llama-server",
            Kind::Vllm => "vllm",
        }
    }

    pub fn parse(text: &str) -> Option<Kind> {
        [Kind::OpenAi, Kind::Ollama, Kind::LlamaServer, Kind::Vllm]
            .into_iter()
            .find(|k| k.as_str() == text)
    }
}

/// `BACKEND_KIND`: detect, or trust the operator.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KindSetting {
    Auto,
    Fixed(Kind),
}

impl KindSetting {
    pub fn parse(text: &str) -> Result<KindSetting, String> {
        let text = text.trim().to_ascii_lowercase();
        if text == "auto" {
            return Ok(KindSetting::Auto);
        }
        Kind::parse(&text).map(KindSetting::Fixed).ok_or_else(|| {
            format!(
                "BACKEND_KIND must be auto, openai, ollama, llama-server or vllm (got `{text}`)"
            )
        })
    }
}

/// Which models the backend holds in memory, by its own names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Resident {
    /// Not known: an `openai` backend, or not read yet.
    Unknown,
    /// Everything it serves (vLLM, a llama-server with one model that is awake).
    All,
    /// These and no others.
    Names(Vec<String>),
}

impl Resident {
    /// The advertised models that are loaded, in advertised order; `None` when unknown.
    pub fn loaded_among(&self, advertised: &[String]) -> Option<Vec<String>> {
        match self {
            Resident::Unknown => None,
            Resident::All => Some(advertised.to_vec()),
            Resident::Names(names) => Some(
                advertised
                    .iter()
                    .filter(|m| names.iter().any(|n| same_model(n, m)))
                    .cloned()
                    .collect(),
            ),
        }
    }

    /// Whether `model` is loaded; `None` when unknown.
    pub fn holds(&self, model: &str) -> Option<bool> {
        match self {
            Resident::Unknown => None,
            Resident::All => Some(true),
            Resident::Names(names) => Some(names.iter().any(|n| same_model(n, model))),
        }
    }
}

/// Describes `missing` (advertised, not described yet) for a backend of `kind`. A model
/// the backend would not describe maps to `None` (not asked again until re-detection);
/// one left out of the answer is asked again next pass. `Err`: no answer at all.
fn describe_models(
    backend: &Backend,
    kind: Kind,
    missing: &[String],
) -> Result<Vec<(String, Option<ModelInfo>)>, String> {
    let every =
        |info: Option<ModelInfo>| missing.iter().map(|m| (m.clone(), info.clone())).collect();
    match kind {
        Kind::OpenAi => Ok(every(None)),
        Kind::LlamaServer => {
            let props = fetch(backend, "/props")?;
            if !props.as_deref().is_some_and(is_llama_router_props) {
                return Ok(every(props.and_then(|b| parse_llama_props_info(&b))));
            }
            // A router's `/props` describes no one model; `?model=` asks one that is
            // loaded (`autoload=false`: asking must not load it). One not loaded is left
            // out, so it is asked again next pass.
            let mut out = Vec::new();
            for m in missing {
                let path = format!(
                    "/props?model={}&autoload=false",
                    super::lifecycle::http::encode(m)
                );
                if let Some(info) = fetch(backend, &path)?.and_then(|b| parse_llama_props_info(&b))
                {
                    out.push((m.clone(), Some(info)));
                }
            }
            Ok(out)
        }
        Kind::Vllm => {
            let Some(body) = fetch(backend, "/v1/models")? else {
                return Ok(every(None));
            };
            let listed = parse_vllm_max_len(&body).unwrap_or_default();
            Ok(missing
                .iter()
                .map(|m| {
                    let info = listed
                        .iter()
                        .find(|(id, _)| id == m)
                        .map(|(_, len)| ModelInfo {
                            context_length: *len,
                            capabilities: vec!["completion".to_string()],
                        });
                    (m.clone(), info)
                })
                .collect())
        }
        Kind::Ollama => {
            let mut out = Vec::new();
            for m in missing {
                let body = serde_json::json!({ "model": m }).to_string();
                match backend.post_json("/api/show", &body) {
                    Ok((200, body)) => match parse_ollama_show(&body) {
                        Ok(info) => out.push((m.clone(), Some(info))),
                        Err(e) => {
                            warn!("cannot read what `{m}` is: {e}");
                            out.push((m.clone(), None));
                        }
                    },
                    Ok((status, _)) => {
                        debug!("POST /api/show for `{m}` answered {status}");
                        out.push((m.clone(), None));
                    }
                    Err(ModelsError::Unusable(e)) => debug!("{e}"),
                    Err(ModelsError::Unreachable(e)) => return Err(e),
                }
            }
            Ok(out)
        }
    }
}

/// The body of a `200` answer; `Ok(None)` for any other answer (or an unreadable one),
/// `Err` when the backend gave no answer at all.
fn fetch(backend: &Backend, path: &str) -> Result<Option<String>, String> {
    match backend.get(path) {
        Ok((200, body)) => Ok(Some(body)),
        Ok(_) | Err(ModelsError::Unusable(_)) => Ok(None),
        Err(ModelsError::Unreachable(e)) => Err(e),
    }
}

/// Asks the backend what it is. `Err` only when it stopped answering meanwhile.
pub fn detect(backend: &Backend) -> Result<Kind, String> {
    if fetch(backend, "/api/version")?.is_some_and(|b| is_ollama_version(&b)) {
        return Ok(Kind::Ollama);
    }
    if fetch(backend, "/props")?.is_some_and(|b| is_llama_server_props(&b)) {
        return Ok(Kind::LlamaServer);
    }
    if fetch(backend, "/v1/models")?.is_some_and(|b| is_vllm_model_list(&b)) {
        return Ok(Kind::Vllm);
    }
    Ok(Kind::OpenAi)
}

/// Reads which models a backend of `kind` holds now.
pub fn read_resident(backend: &Backend, kind: Kind) -> Result<Resident, ModelsError> {
    match kind {
        Kind::OpenAi => Ok(Resident::Unknown),
        // Everything it serves, unless it sleeps (`/is_sleeping` exists in dev mode only).
        Kind::Vllm => match backend.get("/is_sleeping")? {
            (200, body) if llama_server_sleeping(&body) => Ok(Resident::Names(Vec::new())),
            _ => Ok(Resident::All),
        },
        Kind::Ollama => {
            let (status, body) = backend.get("/api/ps")?;
            if status != 200 {
                return Err(ModelsError::Unusable(format!(
                    "GET /api/ps answered {status}"
                )));
            }
            parse_ollama_ps(&body)
                .map(Resident::Names)
                .map_err(ModelsError::Unusable)
        }
        Kind::LlamaServer => {
            let router = match backend.get("/models")? {
                (200, body) => parse_llama_models(&body).ok(),
                _ => None,
            };
            match router {
                Some(Resident::Names(names)) => Ok(Resident::Names(names)),
                // One model, loaded at start-up; unloaded only while it sleeps.
                _ => match backend.get("/props")? {
                    (200, body) if llama_server_sleeping(&body) => Ok(Resident::Names(Vec::new())),
                    _ => Ok(Resident::All),
                },
            }
        }
    }
}

/// The worker's view of its backend's kind and memory, shared by the threads.
pub struct Residency {
    setting: KindSetting,
    kind: Mutex<Option<Kind>>,
    resident: Mutex<Resident>,
    /// What each advertised model is, once asked (`None`: the backend would not say).
    described: Mutex<BTreeMap<String, Option<ModelInfo>>>,
    /// The relayed routes a vLLM backend's `/openapi.json` lists (`routes.rs`).
    listed_routes: Mutex<Option<Vec<String>>>,
    /// Wakes the models thread for a re-check (capacity 1: one pending is enough).
    kick_tx: Sender<()>,
    pub(super) kick_rx: Receiver<()>,
}

impl Residency {
    pub fn new(setting: KindSetting) -> Residency {
        let (kick_tx, kick_rx) = crossbeam_channel::bounded(1);
        let kind = match setting {
            KindSetting::Auto => None,
            KindSetting::Fixed(k) => Some(k),
        };
        Residency {
            setting,
            kind: Mutex::new(kind),
            resident: Mutex::new(Resident::Unknown),
            described: Mutex::new(BTreeMap::new()),
            listed_routes: Mutex::new(None),
            kick_tx,
            kick_rx,
        }
    }

    /// The backend's kind, once known.
    pub fn kind(&self) -> Option<Kind> {
        *self.kind.lock()
    }

    /// The relayed routes the backend's API document lists, when it has one.
    pub fn listed_routes(&self) -> Option<Vec<String>> {
        self.listed_routes.lock().clone()
    }

    /// Reads which routes a vLLM backend serves from its `/openapi.json` (it registers
    /// only those its model supports), on every re-detection; other kinds have none.
    fn list_routes(&self, backend: &Backend, kind: Kind) -> Result<(), String> {
        let listed = match kind {
            Kind::Vllm => fetch(backend, "/openapi.json")?
                .as_deref()
                .and_then(super::routes::from_openapi),
            _ => None,
        };
        let mut kept = self.listed_routes.lock();
        if *kept != listed {
            if let Some(routes) = &listed {
                info!("backend serves these relayed routes (its /openapi.json): {routes:?}");
            }
            *kept = listed;
        }
        Ok(())
    }

    /// The advertised models that are loaded (`None`: unknown).
    pub fn loaded_among(&self, advertised: &[String]) -> Option<Vec<String>> {
        self.resident.lock().loaded_among(advertised)
    }

    /// What the backend says about the advertised models it described; `None` when it
    /// described none (an `openai` backend, nothing loaded in a router, not read yet).
    pub fn info_among(&self, advertised: &[String]) -> Option<ModelInfoMap> {
        let described = self.described.lock();
        let map: ModelInfoMap = advertised
            .iter()
            .filter_map(|m| Some((m.clone(), described.get(m)?.clone()?)))
            .collect();
        (!map.is_empty()).then_some(map)
    }

    /// The context length the backend described for `model`, if it did.
    pub fn context_length(&self, model: &str) -> Option<u64> {
        self.described
            .lock()
            .get(model)
            .and_then(|info| info.as_ref()?.context_length)
    }

    /// Describes the advertised models not described yet (at most [`DESCRIBE_PER_PASS`]),
    /// and forgets the ones no longer advertised. `Err` when the backend gave no answer.
    pub fn describe(&self, backend: &Backend, advertised: &[String]) -> Result<(), String> {
        let Some(kind) = self.kind() else {
            return Ok(());
        };
        let missing: Vec<String> = {
            let mut described = self.described.lock();
            described.retain(|m, _| advertised.contains(m));
            advertised
                .iter()
                .filter(|m| !described.contains_key(*m))
                .take(DESCRIBE_PER_PASS)
                .cloned()
                .collect()
        };
        if missing.is_empty() {
            return Ok(());
        }
        let found = describe_models(backend, kind, &missing)?;
        let mut described = self.described.lock();
        for (m, info) in found {
            if let Some(i) = &info {
                info!(
                    "model `{m}`: context length {:?}, capabilities {:?}",
                    i.context_length, i.capabilities
                );
            }
            described.insert(m, info);
        }
        Ok(())
    }

    /// After a request for `model` reached the backend: if the model was not loaded
    /// (so the backend probably loaded it for this request), wake the models thread to
    /// re-read the set. A loaded or untracked model costs one lock and a comparison.
    pub fn after_request(&self, model: &str) {
        if model.is_empty() {
            return;
        }
        let unloaded = self.resident.lock().holds(model) == Some(false);
        if unloaded {
            let _ = self.kick_tx.try_send(());
        }
    }

    /// Detects the kind (with `BACKEND_KIND=auto`: when not known yet, or `redetect`)
    /// and reads what is loaded. `Err` when the backend gave no answer; a backend that
    /// answers unusably keeps the previous set.
    pub fn refresh(&self, backend: &Backend, redetect: bool) -> Result<(), String> {
        let known = self.kind();
        let kind = match (self.setting, known) {
            (KindSetting::Fixed(k), _) => k,
            (KindSetting::Auto, Some(k)) if !redetect => k,
            (KindSetting::Auto, _) => {
                let found = detect(backend)?;
                if known.is_some_and(|old| old != found) {
                    // Another backend now: describe its models afresh.
                    self.described.lock().clear();
                }
                match known {
                    None => info!("backend kind: {} (detected)", found.as_str()),
                    Some(old) if old != found => {
                        info!(
                            "backend kind changed: {} -> {}",
                            old.as_str(),
                            found.as_str()
                        )
                    }
                    Some(_) => {}
                }
                *self.kind.lock() = Some(found);
                found
            }
        };
        if redetect || known.is_none() {
            self.list_routes(backend, kind)?;
        }
        match read_resident(backend, kind) {
            Ok(now) => {
                let mut resident = self.resident.lock();
                if *resident != now {
                    if let Resident::Names(names) = &now {
                        info!("backend has loaded: {names:?}");
                    }
                    *resident = now;
                }
                Ok(())
            }
            Err(ModelsError::Unreachable(e)) => Err(e),
            Err(ModelsError::Unusable(e)) => {
                warn!("cannot read which models the backend has loaded: {e}");
                Ok(())
            }
        }
    }
}

#[cfg(test)]
mod tests;
