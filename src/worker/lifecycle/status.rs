//! `worker_status`: the backend's version and what it and the machine expose, sampled
//! every [`SAMPLE_EVERY`] by one thread and sent only when it changed, only to a server
//! whose `register_ack` listed the lifecycle feature (an original server never gets one).
//!
//! | kind | version | resources |
//! |---|---|---|
//! | `llama-server` | `GET /props` `build_info` | `GET /slots` (slots total, busy: `is_processing`), `GET /metrics` `llamacpp:kv_cache_usage_ratio` when exposed (`--metrics`); in router mode per loaded model (`?model=…&autoload=false`), slots summed, the highest KV usage |
//! | `ollama` | `GET /api/version` | — |
//! | `vllm` | `GET /version` | `GET /metrics` `vllm:kv_cache_usage_perc` (or `vllm:gpu_cache_usage_perc`, a fraction despite the name) |
//! | `openai` | — | — |
//!
//! plus GPU memory and utilisation from `nvidia-smi` ([`super::gpu`]) whenever it is on
//! `PATH`. What is not known is left out, never guessed. An endpoint that answers 404 or
//! 501 is not asked again until the backend's kind changes; a sleeping single-model
//! llama-server is not asked for its slots (that would wake it). With nothing to report
//! (an `openai` backend and no `nvidia-smi`), or no lifecycle session, or the backend
//! down, the thread sleeps until kicked: it costs nothing while idle.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use log::debug;
use serde_json::Value;

use super::gpu;
use super::http::{self, encode};
use super::llama;
use crate::protocol::lifecycle::{Resources, WorkerStatus};
use crate::protocol::WorkerMessage;
use crate::worker::backend::Backend;
use crate::worker::backend_kind::{llama_server_sleeping, Kind};
use crate::worker::relays::session::Link;
use crate::worker::Shared;

/// How often the backend is sampled while a lifecycle session is up.
pub const SAMPLE_EVERY: Duration = Duration::from_secs(5);
/// The version is re-read this often (it changes only when the backend is replaced).
const VERSION_EVERY: Duration = Duration::from_secs(60);
/// A router's loaded models asked for slots and metrics, at most.
const ROUTER_MODELS: usize = 8;

/// A string field of a JSON object body.
fn json_str(body: &str, key: &str) -> Option<String> {
    let v: Value = serde_json::from_str(body).ok()?;
    v.get(key)?.as_str().map(str::to_string)
}

/// The value of the first of `names` found in a Prometheus text body (the highest when
/// several label sets carry it), if it is a fraction 0..1.
pub fn metric(text: &str, names: &[&str]) -> Option<f64> {
    for name in names {
        let mut best: Option<f64> = None;
        for line in text.lines() {
            let Some(rest) = line.trim_start().strip_prefix(name) else {
                continue;
            };
            let rest = match rest.chars().next() {
                Some('{') => match rest.rfind('}') {
                    Some(end) => &rest[end + 1..],
                    None => continue,
                },
                Some(' ' | '\t') => rest,
                _ => continue,
            };
            let Some(value) = rest.split_whitespace().next() else {
                continue;
            };
            if let Ok(v) = value.parse::<f64>() {
                if v.is_finite() && (0.0..=1.0).contains(&v) {
                    best = Some(best.map_or(v, |b: f64| b.max(v)));
                }
            }
        }
        if best.is_some() {
            return best;
        }
    }
    None
}

/// The version, where each kind says it.
pub fn parse_version(kind: Kind, body: &str) -> Option<String> {
    match kind {
        Kind::LlamaServer => json_str(body, "build_info"),
        Kind::Ollama | Kind::Vllm => json_str(body, "version"),
        Kind::OpenAi => None,
    }
    .filter(|v| !v.is_empty())
}

fn version_path(kind: Kind) -> Option<&'static str> {
    match kind {
        Kind::LlamaServer => Some("/props"),
        Kind::Ollama => Some("/api/version"),
        Kind::Vllm => Some("/version"),
        Kind::OpenAi => None,
    }
}

/// What one worker samples, and what it learnt not to ask.
pub struct Sampler {
    nvidia_smi: Option<PathBuf>,
    kind: Option<Kind>,
    version: Option<(Instant, Option<String>)>,
    /// Endpoints that answered 404 or 501 (not asked again for this kind).
    absent: Vec<&'static str>,
}

impl Sampler {
    pub fn new(nvidia_smi: Option<PathBuf>) -> Sampler {
        Sampler {
            nvidia_smi,
            kind: None,
            version: None,
            absent: Vec::new(),
        }
    }

    /// Whether anything can be reported for a backend of `kind`.
    pub fn has_sources(&self, kind: Option<Kind>) -> bool {
        self.nvidia_smi.is_some() || matches!(kind, Some(k) if k != Kind::OpenAi)
    }

    /// A bounded GET of `path` (asked as `ask`); `None` for no usable answer, and a 404
    /// or 501 marks `path` absent.
    fn fetch(&mut self, backend: &Backend, path: &'static str, ask: &str) -> Option<String> {
        if self.absent.contains(&path) {
            return None;
        }
        match http::get(backend, ask) {
            Ok(a) if a.ok() => Some(a.body),
            Ok(a) => {
                if a.status == 404 || a.status == 501 {
                    debug!("{path} answered {}: not asked again", a.status);
                    self.absent.push(path);
                }
                None
            }
            Err(_) => None,
        }
    }

    /// One sample of everything known for a backend of `kind`.
    pub fn sample(&mut self, backend: &Backend, kind: Option<Kind>) -> WorkerStatus {
        if kind != self.kind {
            self.kind = kind;
            self.version = None;
            self.absent.clear();
        }
        let mut resources = self
            .nvidia_smi
            .as_ref()
            .and_then(gpu::query)
            .unwrap_or_default();
        let mut version = None;
        if let Some(kind) = kind {
            let fresh = self
                .version
                .as_ref()
                .filter(|(at, _)| at.elapsed() < VERSION_EVERY)
                .map(|(_, v)| v.clone());
            // llama-server's `/props` also says whether it is a router, or asleep.
            let props = match version_path(kind) {
                Some(path) if fresh.is_none() || kind == Kind::LlamaServer => {
                    self.fetch(backend, path, path)
                }
                _ => None,
            };
            version = match fresh {
                Some(v) => v,
                None => {
                    let v = props.as_deref().and_then(|b| parse_version(kind, b));
                    self.version = Some((Instant::now(), v.clone()));
                    v
                }
            };
            match kind {
                Kind::LlamaServer => self.llama(backend, props.as_deref(), &mut resources),
                Kind::Vllm => {
                    resources.kv_cache_utilization =
                        self.fetch(backend, "/metrics", "/metrics").and_then(|m| {
                            metric(
                                &m,
                                &["vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"],
                            )
                        });
                }
                Kind::Ollama | Kind::OpenAi => {}
            }
        }
        WorkerStatus {
            backend_version: version,
            resources: (resources != Resources::default()).then_some(resources),
        }
    }

    /// llama-server's slots and KV usage (per loaded model in router mode).
    fn llama(&mut self, backend: &Backend, props: Option<&str>, out: &mut Resources) {
        let router = props.is_some_and(llama::is_router_props);
        let models: Vec<Option<String>> = if router {
            match llama::loaded_models(backend) {
                Ok(names) => names.into_iter().take(ROUTER_MODELS).map(Some).collect(),
                Err(_) => return,
            }
        } else {
            vec![None]
        };
        let asleep = !router && props.is_some_and(llama_server_sleeping);
        let (mut total, mut busy, mut kv, mut any_slots) = (0u32, 0u32, None::<f64>, false);
        for m in &models {
            let query = m
                .as_ref()
                .map(|m| format!("?model={}&autoload=false", encode(m)))
                .unwrap_or_default();
            if !asleep {
                let slots = self
                    .fetch(backend, "/slots", &format!("/slots{query}"))
                    .and_then(|b| llama::parse_slots(&b));
                if let Some(list) = slots {
                    any_slots = true;
                    total += list.len() as u32;
                    busy += list.iter().filter(|(_, processing)| *processing).count() as u32;
                }
            }
            let usage = self
                .fetch(backend, "/metrics", &format!("/metrics{query}"))
                .and_then(|t| metric(&t, &["llamacpp:kv_cache_usage_ratio"]));
            kv = match (kv, usage) {
                (Some(a), Some(b)) => Some(a.max(b)),
                (a, b) => a.or(b),
            };
        }
        if any_slots {
            out.slots_total = Some(total);
            out.slots_busy = Some(busy);
        }
        out.kv_cache_utilization = kv;
    }
}

/// Sends `status` to the session's server unless it was the last one it got.
fn report(link: &Link, status: WorkerStatus) {
    let mut told = link.status_told.lock();
    if *told == status {
        return;
    }
    debug!("worker_status: {status:?}");
    if link.out.send(&WorkerMessage::WorkerStatus(status.clone())) {
        *told = status;
    }
}

/// The status thread: samples while a lifecycle session is up and the backend answers,
/// sleeps until kicked otherwise. Returns when the worker drains.
pub fn run(shared: &Shared) {
    let mut sampler = Sampler::new(gpu::find());
    let kick = &shared.lifecycle.kick_rx;
    loop {
        if shared.is_draining() {
            return;
        }
        let mut links = shared.relays.links();
        links.retain(|l| l.lifecycle);
        let kind = shared.residency.kind();
        // One sample, told to every relay that reads it.
        let active = !links.is_empty() && !shared.health.is_down() && sampler.has_sources(kind);
        if active {
            let status = sampler.sample(&shared.backend, kind);
            for link in &links {
                report(link, status.clone());
            }
        }
        if active {
            crossbeam_channel::select! {
                recv(kick) -> _ => {}
                recv(shared.drain_wait) -> _ => return,
                default(SAMPLE_EVERY) => {}
            }
        } else {
            crossbeam_channel::select! {
                recv(kick) -> _ => {}
                recv(shared.drain_wait) -> _ => return,
            }
        }
    }
}
