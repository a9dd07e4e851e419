//! `modelrelay-worker`: runs on a GPU box beside a local backend and dials out to the
//! relay server.
//!
//! ```text
//!  main thread: supervisor ── waits for Control::Drain (SIGTERM or graceful_shutdown)
//!  connection thread: connection.rs ── dial, register, reconnect with backoff
//!        └─ session.rs: reader loop ─► slots.rs (MAX_CONCURRENCY threads) ─► backend.rs (ureq)
//!                        writer thread ◄── every outgoing message
//!  models thread: re-reads the backend's /v1/models when MODELS is `*`
//! ```

pub mod backend;
pub mod config;
pub mod connection;
pub mod inflight;
pub mod session;
pub mod slots;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender};
use log::{info, warn};
use parking_lot::Mutex;

use crate::protocol::WorkerMessage;
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
    pub inflight: inflight::InFlight,
    /// The models currently advertised.
    pub models: Mutex<Vec<String>>,
    /// The registered session, when there is one.
    pub session: Mutex<Option<session::Link>>,
    pub control: Sender<Control>,
    /// TLS client configuration for a `wss://` server.
    #[cfg(feature = "tls")]
    pub tls: Option<Arc<rustls::ClientConfig>>,
    /// The backend slots requests run in.
    pub slots: slots::Slots,
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

/// The TLS client configuration, when the server URL is `wss://`.
#[cfg(feature = "tls")]
fn tls_config(cfg: &WorkerConfig) -> Result<Option<Arc<rustls::ClientConfig>>, String> {
    if !cfg.connect_url.starts_with("wss://") {
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
        let max_body = cfg.max_ws_message_bytes.saturating_sub(1 << 20) / 2;
        let models = match &cfg.models {
            ModelSource::Fixed(list) => list.clone(),
            ModelSource::Backend => Vec::new(),
        };
        let shared = Arc::new(Shared {
            backend: backend::Backend::new(&cfg.backend_url, cfg.backend_api_key.clone(), max_body),
            inflight: inflight::InFlight::default(),
            models: Mutex::new(models),
            session: Mutex::new(None),
            control,
            #[cfg(feature = "tls")]
            tls,
            slots: slots::Slots::default(),
            draining: AtomicBool::new(false),
            drain_signal: Mutex::new(Some(drain_tx)),
            drain_wait,
            cfg,
        });
        slots::Slots::start(&shared, shared.cfg.max_concurrency);
        if shared.cfg.models == ModelSource::Backend {
            refresh_models(&shared, false);
            let s = shared.clone();
            let _ = std::thread::Builder::new()
                .name("models".into())
                .spawn(move || {
                    while !s.wait_for_drain(s.cfg.models_refresh) {
                        refresh_models(&s, false);
                    }
                });
        }
        let s = shared.clone();
        let _ = std::thread::Builder::new()
            .name("connection".into())
            .spawn(move || connection::run_forever(s));
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
    let link = shared.session.lock().clone();
    if let Some(link) = &link {
        session::announce_drain(shared, link);
    }
    if !shared.inflight.wait_idle(Instant::now() + timeout) {
        warn!(
            "drain timeout reached; cancelling {} request(s)",
            shared.inflight.len()
        );
        shared.inflight.cancel_all();
        shared
            .inflight
            .wait_idle(Instant::now() + Duration::from_secs(2));
    }
    if let Some(link) = link {
        link.out.close(close_code::NORMAL, "worker drained");
    }
    info!("drained; exiting");
}

/// Re-reads the backend's models; sends `models_update` when they changed (or always,
/// when the server asked).
pub fn refresh_models(shared: &Shared, asked: bool) {
    let models = match &shared.cfg.models {
        ModelSource::Fixed(list) => list.clone(),
        ModelSource::Backend => match shared.backend.models() {
            Ok(m) => m,
            Err(e) => {
                warn!("cannot read models from the backend: {e}");
                return;
            }
        },
    };
    let changed = {
        let mut current = shared.models.lock();
        let changed = *current != models;
        if changed {
            info!("backend models: {models:?}");
            *current = models.clone();
        }
        changed
    };
    if (changed || asked) && !shared.is_draining() {
        if let Some(link) = shared.session.lock().clone() {
            let current_load = shared.inflight.len() as u32;
            link.out.send(&WorkerMessage::ModelsUpdate {
                models,
                current_load,
            });
        }
    }
}
