//! `modelrelay-worker`: runs on a GPU box beside a local backend and dials out to the
//! relay server.
//!
//! ```text
//!  main thread: supervisor ── waits for Control::Drain (SIGTERM or graceful_shutdown)
//!  one thread per relay in PROXY_URL: relays/connection.rs ── dial, register, reconnect
//!        └─ relays/session.rs: reader loop ─► slots.rs (MAX_CONCURRENCY threads, shared
//!                        by every relay) ─► backend.rs (ureq); slots write answers
//!                        straight to the session the request came on
//!  models thread: every MODELS_REFRESH_SECS re-reads the backend's /v1/models (when
//!                 MODELS is `*`) and its loaded models (backend_kind.rs); also woken by
//!                 a slot after a request for a model that was not loaded
//!  prober thread: health.rs ── probes a backend that stopped answering, with backoff
//!  (a slot's request whose prompt does not fit the model's context: trim.rs)
//!  status thread: lifecycle/status.rs ── `worker_status` every 5 s to a server that
//!                 listed `lifecycle` (idle otherwise)
//!  model-op threads: lifecycle/ ── one per `model_operation` (load, unload, flush)
//! ```

pub mod backend;
pub mod backend_kind;
pub mod config;
pub mod continuation;
pub mod health;
pub mod held;
pub mod inflight;
pub mod lifecycle;
pub mod power;
pub mod relays;
pub mod routes;
pub mod slots;
pub mod stream_usage;
pub mod trim;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender};
use log::{info, warn};
use parking_lot::Mutex;

use crate::ws::close_code;
pub use config::{ModelSource, WorkerConfig};

/// Requests to the supervisor.
#[derive(Debug)]
pub enum Control {
    /// Stop taking work, finish in-flight requests up to `timeout`, then exit.
    Drain { timeout: Duration, why: String },
}

/// State shared by the worker's threads.
pub struct Shared {
    pub cfg: WorkerConfig,
    pub backend: backend::Backend,
    /// Whether the backend answers (see `health.rs`).
    pub health: health::Health,
    /// What the backend is and which models it holds in memory (`backend_kind.rs`).
    pub residency: backend_kind::Residency,
    pub inflight: inflight::InFlight,
    /// The context sizes learned from the backend's refusals (`trim.rs`).
    pub contexts: trim::Contexts,
    /// The models the backend serves (what a session advertises may differ: see
    /// `health::sync`).
    pub models: Mutex<Vec<String>>,
    /// The registered session of each relay (`relays/`).
    pub relays: relays::Relays,
    pub control: Sender<Control>,
    /// TLS client configuration for a `wss://` server.
    #[cfg(feature = "tls")]
    pub tls: Option<Arc<rustls::ClientConfig>>,
    /// The backend slots requests run in.
    pub slots: slots::Slots,
    /// Model operations and `worker_status` (`lifecycle/`).
    pub lifecycle: lifecycle::Lifecycle,
    pub power: power::Power,
    /// Resumable streams kept for a resume through another relay (`held/`).
    pub held: held::HeldStreams,
    draining: AtomicBool,
    /// Closed (by dropping the sender) when a drain starts, to wake sleeping threads.
    drain_signal: Mutex<Option<Sender<()>>>,
    drain_wait: Receiver<()>,
}

impl Shared {
    pub fn is_draining(&self) -> bool {
        self.draining.load(Ordering::Acquire)
    }

    /// Sleeps up to `d`; returns true early if a drain started.
    pub fn wait_for_drain(&self, d: Duration) -> bool {
        let _ = self.drain_wait.recv_timeout(d);
        self.is_draining()
    }
}

/// A running worker: hand its control sender to the signal handler, then `wait`.
pub struct Worker {
    shared: Arc<Shared>,
    control_rx: Receiver<Control>,
}

/// The TLS client configuration, when a relay's URL is `wss://`.
#[cfg(feature = "tls")]
fn tls_config(cfg: &WorkerConfig) -> Result<Option<Arc<rustls::ClientConfig>>, String> {
    if !cfg.connect_urls.iter().any(|u| u.starts_with("wss://")) {
        return Ok(None);
    }
    crate::net::tls::client_config(cfg.ca_file.as_deref()).map(Some)
}

impl Worker {
    /// Starts the worker's threads; fails only on an unusable TLS setup (`--ca-file`).
    pub fn start(cfg: WorkerConfig) -> Result<Worker, String> {
        #[cfg(feature = "tls")]
        let tls = tls_config(&cfg)?;
        let (control, control_rx) = crossbeam_channel::unbounded();
        let (drain_tx, drain_wait) = crossbeam_channel::bounded(0);
        let models = match &cfg.models {
            ModelSource::Fixed(list) => list.clone(),
            ModelSource::Backend => Vec::new(),
        };
        let shared = Arc::new(Shared {
            backend: backend::Backend::new(
                &cfg.backend_url,
                cfg.backend_api_key.clone(),
                cfg.max_ws_message_bytes,
            ),
            health: health::Health::new(cfg.backend_probe_max),
            residency: backend_kind::Residency::new(cfg.backend_kind),
            inflight: inflight::InFlight::default(),
            contexts: trim::Contexts::default(),
            models: Mutex::new(models),
            relays: relays::Relays::new(cfg.connect_urls.len()),
            control,
            #[cfg(feature = "tls")]
            tls,
            slots: slots::Slots::default(),
            lifecycle: lifecycle::Lifecycle::default(),
            // The wake address is the LAN interface toward the first relay.
            power: power::Power::new(
                &cfg.power,
                cfg.connect_urls.first().map_or("", String::as_str),
            ),
            held: held::HeldStreams::new(cfg.held_stream_bytes, cfg.held_total_bytes),
            draining: AtomicBool::new(false),
            drain_signal: Mutex::new(Some(drain_tx)),
            drain_wait,
            cfg,
        });
        slots::Slots::start(&shared, shared.cfg.max_concurrency);
        // Before the first connection, so `register` carries what the backend serves.
        health::probe_at_start(&shared);
        let s = shared.clone();
        let _ = std::thread::Builder::new()
            .name("prober".into())
            .spawn(move || health::run_prober(&s));
        let s = shared.clone();
        let _ = std::thread::Builder::new()
            .name("models".into())
            .spawn(move || run_models(&s));
        let s = shared.clone();
        let _ = std::thread::Builder::new()
            .name("status".into())
            .spawn(move || lifecycle::status::run(&s));
        let s = shared.clone();
        let _ = std::thread::Builder::new()
            .name("power".into())
            .spawn(move || power::suspend::run(&s));
        let s = shared.clone();
        let _ = std::thread::Builder::new()
            .name("owner".into())
            .spawn(move || power::owner::run(&s));
        if shared.cfg.connect_urls.len() > 1 {
            // Only a worker serving several relays holds streams for a resume.
            let s = shared.clone();
            let _ = std::thread::Builder::new()
                .name("held".into())
                .spawn(move || s.held.run_reaper());
        }
        relays::start(&shared);
        Ok(Worker { shared, control_rx })
    }

    pub fn control(&self) -> Sender<Control> {
        self.shared.control.clone()
    }

    /// Blocks until a drain was requested and completed.
    pub fn wait(self) {
        let Ok(Control::Drain { timeout, why }) = self.control_rx.recv() else {
            return;
        };
        drain(&self.shared, timeout, &why);
    }
}

fn drain(shared: &Shared, timeout: Duration, why: &str) {
    info!(
        "graceful shutdown ({why}): finishing {} in-flight request(s), waiting up to {}s",
        shared.inflight.len(),
        timeout.as_secs()
    );
    shared.draining.store(true, Ordering::Release);
    shared.drain_signal.lock().take();
    let links = shared.relays.links();
    for link in &links {
        relays::session::announce_drain(shared, link);
    }
    if !shared
        .inflight
        .wait_idle(crate::clock::later(Instant::now(), timeout))
    {
        warn!(
            "drain timeout reached; cancelling {} request(s)",
            shared.inflight.len()
        );
        shared.inflight.cancel_all();
        shared
            .inflight
            .wait_idle(Instant::now() + Duration::from_secs(2));
    }
    for link in links {
        link.out.close(close_code::NORMAL, "worker drained");
    }
    info!("drained; exiting");
}

/// At most one re-check of the loaded models per this long, however many requests for
/// unloaded models ask for one.
const RECHECK_SPACING: Duration = Duration::from_secs(1);

/// The models thread: the periodic refresh, and the re-checks the slots ask for after a
/// request for a model that was not loaded. Returns when the worker drains.
fn run_models(shared: &Shared) {
    let mut next_refresh = Instant::now() + shared.cfg.models_refresh;
    loop {
        let wait = next_refresh.saturating_duration_since(Instant::now());
        crossbeam_channel::select! {
            recv(shared.residency.kick_rx) -> _ => {
                if shared.is_draining() {
                    return;
                }
                refresh_loaded(shared);
                health::sync(shared, false);
                if shared.wait_for_drain(RECHECK_SPACING) {
                    return;
                }
            }
            recv(shared.drain_wait) -> _ => return,
            default(wait) => {
                if shared.is_draining() {
                    return;
                }
                refresh_models(shared, false);
                next_refresh = Instant::now() + shared.cfg.models_refresh;
            }
        }
    }
}

/// Re-reads which models the backend holds, and describes the ones not described yet
/// (not while it is down: the prober reads both when it is back).
fn refresh_loaded(shared: &Shared) {
    if shared.health.is_down() {
        return;
    }
    let described = shared
        .residency
        .refresh(&shared.backend, false)
        .and_then(|()| {
            let models = shared.models.lock().clone();
            shared.residency.describe(&shared.backend, &models)
        });
    if let Err(e) = described {
        health::backend_failed(shared, &e);
    }
}

/// Re-reads the backend's models (with `MODELS=*`) and which of them are loaded, unless
/// the backend is down (then the prober reads them when it is back), and tells the server
/// what changed, or everything when it asked.
pub fn refresh_models(shared: &Shared, asked: bool) {
    if shared.cfg.models == ModelSource::Backend && !shared.health.is_down() {
        match shared.backend.models() {
            Ok(models) => set_models(shared, models),
            Err(backend::ModelsError::Unreachable(e)) => health::backend_failed(shared, &e),
            Err(e) => warn!("cannot read models from the backend: {e}"),
        }
    }
    refresh_loaded(shared);
    health::sync(shared, asked);
}

/// Records the backend's model list (the server hears of it through `health::sync`).
fn set_models(shared: &Shared, models: Vec<String>) {
    let mut current = shared.models.lock();
    if *current != models {
        info!("backend models: {models:?}");
        *current = models;
    }
}
