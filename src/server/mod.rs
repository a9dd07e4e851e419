//! `modelrelay-server`: the central relay.
//!
//! ```text
//!  clients ──HTTP──► http (thread per connection) ──┐
//!                     └─ relay: waits on its reply  │  crossbeam channels
//!                                                   ▼
//!                               dispatcher thread (runtime.rs) ─ owns ─► Dispatcher
//!                                                   ▲                    (registry, queue,
//!  workers ──WebSocket──► worker_socket (reader) ───┘                     timers, requests)
//!           ◄── sent at once by the dispatcher ── worker_link ◄───────────┘
//!           ◄── or, when the socket is full, by its writer thread
//! ```
//!
//! Every decision is made by the [`dispatcher::Dispatcher`] state machine; the threads
//! around it only move bytes and events.

mod api;
pub mod auth;
pub mod body;
pub mod client_ip;
pub mod config;
pub mod continuation;
#[cfg(feature = "dashboard")]
pub mod dashboard;
#[cfg(not(feature = "dashboard"))]
#[path = "dashboard_off.rs"]
pub mod dashboard;
pub mod dispatcher;
pub mod endpoints;
pub mod errors;
pub mod fanout;
pub mod fingerprint;
pub mod http;
pub mod keys;
pub mod lifecycle;
pub mod logsafe;
pub mod metrics;
#[cfg(feature = "moe")]
pub mod moe;
pub mod ollama;
pub mod ops;
pub mod origin;
pub mod power;
pub mod private_fs;
pub mod relay;
pub mod reply;
pub mod resume;
pub mod shared;
pub mod status;
pub mod store;
pub mod tenancy;
pub mod usage;
pub mod worker_link;
pub mod worker_socket;

use std::io::Write;
use std::net::{SocketAddr, TcpListener};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::Sender;
use log::{error, info, warn};

pub use config::ServerConfig;
use dispatcher::runtime::{self, Input};
use dispatcher::{Dispatcher, Event, RequestId, WorkerId};
use shared::Shared;

/// Stack for connection and socket threads: they parse JSON and little else.
pub const THREAD_STACK: usize = 256 * 1024;

/// What every connection thread shares.
pub struct Ctx {
    /// This context itself, for what outlives a connection thread's borrow of it (a
    /// whole answer the dispatcher thread writes and records: `relay/direct.rs`).
    pub this: std::sync::Weak<Ctx>,
    pub cfg: ServerConfig,
    pub inputs: Sender<Input>,
    pub shared: Arc<Shared>,
    pub limiter: auth::FailureLimiter,
    pub http_metrics: metrics::HttpMetrics,
    /// Per-tenant rate limits and token budgets.
    pub gate: tenancy::gate::Gate,
    /// Client API keys (loaded when admin or key auth is configured).
    pub keys: Option<keys::KeyStore>,
    /// Token usage: the journal and the live usage stream.
    pub usage: usage::Ledger,
    /// Where shared state lives (this relay alone, or Redis with `STATE_URL`).
    pub store: store::Store,
    /// Who may load, unload and flush models.
    pub governance: lifecycle::governance::Governance,
    /// The web dashboard's sessions, live feed and download checksums.
    pub dashboard: dashboard::Dashboard,
    /// Streams held for a client to resume.
    pub resume: resume::Registry,
    /// The TLS configuration new connections use; replaced on reload.
    #[cfg(feature = "server-tls")]
    pub tls: Option<parking_lot::RwLock<Arc<rustls::ServerConfig>>>,
    pub started_unix: u64,
    next_request: AtomicU64,
    next_worker: AtomicU64,
    connections: AtomicUsize,
}

impl Ctx {
    pub fn next_request_id(&self) -> RequestId {
        self.next_request.fetch_add(1, Ordering::Relaxed)
    }

    pub fn next_worker_id(&self) -> WorkerId {
        self.next_worker.fetch_add(1, Ordering::Relaxed)
    }
}

/// A running server.
pub struct Server {
    addr: SocketAddr,
    ctx: Arc<Ctx>,
    dispatcher: JoinHandle<()>,
}

/// A cloneable handle that can start the graceful shutdown.
#[derive(Clone)]
pub struct ShutdownHandle {
    ctx: Arc<Ctx>,
}

impl ShutdownHandle {
    /// Re-reads the TLS certificate and key (SIGHUP); existing connections keep theirs.
    pub fn reload_tls(&self) {
        #[cfg(feature = "server-tls")]
        if let (Some(slot), Some((cert, key))) = (&self.ctx.tls, &self.ctx.cfg.tls) {
            match crate::net::tls::server_config(cert, key) {
                Ok(config) => {
                    *slot.write() = config;
                    info!("TLS certificate reloaded from {cert}");
                }
                Err(e) => log::error!("TLS reload failed, keeping the current certificate: {e}"),
            }
        }
    }

    pub fn shutdown(&self) {
        self.ctx.shared.set_shutting_down();
        let timeout = self.ctx.cfg.drain_timeout;
        let _ = self
            .ctx
            .inputs
            .send(Input::Event(Event::Shutdown { timeout }));
    }
}

/// Binds the listener and starts the dispatcher and acceptor threads.
pub fn start(cfg: ServerConfig) -> std::io::Result<Server> {
    // Every relay of a pool fingerprints prompts alike (cache affinity across relays).
    fingerprint::share_key(&cfg.worker_secret);
    // Keys and usage are kept on disk once someone can manage or read them.
    let persist = cfg.require_api_keys || cfg.admin_token.is_some();
    let store = store::Store::open(
        &cfg.state_dir,
        cfg.state_url.as_deref(),
        cfg.state_ca_file.as_deref(),
    )
    .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
    let keys = if persist {
        let keys = keys::KeyStore::open(&cfg.state_dir)
            .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))?;
        Some(keys.with_mirror(store.key_mirror()))
    } else {
        None
    };
    let governance =
        lifecycle::governance::Governance::with_store(&cfg.governance, &store, usage::unix_now())
            .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))?;
    let mirror = store
        .usage_mirror(cfg.usage_retention_days)
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))?;
    let usage = usage::Ledger::open(&cfg.state_dir, persist, cfg.usage_retention_days, mirror)
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))?;
    #[cfg(feature = "server-tls")]
    let tls = match &cfg.tls {
        Some((cert, key)) => Some(parking_lot::RwLock::new(
            crate::net::tls::server_config(cert, key)
                .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))?,
        )),
        None => None,
    };
    let listener = TcpListener::bind(&cfg.listen_addr)?;
    let addr = listener.local_addr()?;
    let (inputs, inbox) = crossbeam_channel::unbounded();
    let shared = Shared::new();
    let mut core = Dispatcher::new(cfg.dispatch.clone(), Instant::now());
    let sleepers = power::SleeperStore::new(&cfg.state_dir);
    core.restore_sleepers(sleepers.load(), Instant::now());
    if store.is_shared() {
        core.number_tasks_from(random_start());
    }
    let dispatcher = {
        let shared = shared.clone();
        std::thread::Builder::new()
            .name("dispatcher".into())
            .spawn(move || runtime::run(core, inbox, shared, sleepers))?
    };
    let ctx = Arc::new_cyclic(|this| Ctx {
        this: this.clone(),
        limiter: auth::FailureLimiter::new(10, Duration::from_secs(60), 4096),
        http_metrics: metrics::HttpMetrics::new(cfg.metrics_max_tenants),
        gate: tenancy::gate::Gate::with_store(cfg.tenancy.clone(), &store, &shared),
        dashboard: dashboard::Dashboard::with_store(&store),
        store,
        keys,
        usage,
        // Op tokens depend on how many relays the workers report (see governance::relays).
        governance: governance.with_relays(&shared),
        resume: resume::Registry::new(cfg.resume.clone()),
        #[cfg(feature = "server-tls")]
        tls,
        started_unix: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0),
        next_request: AtomicU64::new(random_start()),
        next_worker: AtomicU64::new(1),
        connections: AtomicUsize::new(0),
        cfg,
        inputs,
        shared,
    });
    ctx.store.follow_keys(&ctx)?;
    {
        let (hub, inputs) = (ctx.usage.hub.clone(), ctx.inputs.clone());
        let (journal, shared) = (ctx.usage.shared_journal(), ctx.shared.clone());
        let mirror = ctx.usage.mirror().cloned();
        std::thread::Builder::new()
            .name("usage-stream".into())
            .stack_size(THREAD_STACK)
            .spawn(move || usage::stream::run_publisher(hub, inputs, journal, mirror, shared))?;
    }
    #[cfg(feature = "dashboard")]
    {
        let ctx = ctx.clone();
        std::thread::Builder::new()
            .name("dashboard-feed".into())
            .stack_size(THREAD_STACK)
            .spawn(move || dashboard::events::run_publisher(ctx))?;
    }
    let acceptor_ctx = ctx.clone();
    std::thread::Builder::new()
        .name("acceptor".into())
        .spawn(move || accept_loop(listener, acceptor_ctx))?;
    info!(
        "modelrelay-server {} listening on {addr}",
        env!("CARGO_PKG_VERSION")
    );
    if ctx.cfg.tls.is_some() {
        info!("TLS enabled: clients use https://, workers wss:// (SIGHUP reloads the certificate)");
    }
    Ok(Server {
        addr,
        ctx,
        dispatcher,
    })
}

impl Server {
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    pub fn shutdown_handle(&self) -> ShutdownHandle {
        ShutdownHandle {
            ctx: self.ctx.clone(),
        }
    }

    /// Blocks until shutdown completes, then gives responses in progress a moment to
    /// reach their clients. Returns `false` when the dispatcher thread died of a panic
    /// instead: nothing can be routed any more, and the process must exit non-zero so a
    /// supervisor (systemd `Restart=on-failure`) starts it again.
    pub fn wait(self) -> bool {
        let clean = self.dispatcher.join().is_ok();
        if !clean {
            error!("the dispatcher thread died; exiting so a supervisor can restart the server");
            return false;
        }
        let deadline = Instant::now() + Duration::from_secs(2);
        while self.ctx.shared.relays() > 0 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        self.ctx.usage.flush();
        true
    }
}

/// Request ids start at a random point so ids from different runs do not collide.
fn random_start() -> u64 {
    let mut bytes = [0u8; 4];
    let _ = getrandom::fill(&mut bytes);
    u64::from(u32::from_le_bytes(bytes)) << 24
}

fn accept_loop(listener: TcpListener, ctx: Arc<Ctx>) {
    for incoming in listener.incoming() {
        let mut stream = match incoming {
            Ok(s) => s,
            Err(e) => {
                // Out of descriptors or similar: back off briefly instead of spinning.
                error!("accept failed: {e}");
                std::thread::sleep(Duration::from_millis(50));
                continue;
            }
        };
        let Ok(peer) = stream.peer_addr() else {
            continue;
        };
        let _ = stream.set_nodelay(true);
        if ctx.connections.fetch_add(1, Ordering::AcqRel) >= ctx.cfg.max_connections {
            ctx.connections.fetch_sub(1, Ordering::AcqRel);
            warn!(
                "connection limit reached ({}); refusing {peer}",
                ctx.cfg.max_connections
            );
            let _ = stream.set_write_timeout(Some(Duration::from_secs(1)));
            let e = errors::ApiError::new(503, "too_many_connections", "connection limit reached");
            if ctx.cfg.tls.is_none() {
                let id = dispatcher::wire_request_id(ctx.next_request_id());
                let _ = stream.write_all(&reply::error_response(
                    errors::Style::OpenAi,
                    &e,
                    false,
                    &[("x-request-id", &id)],
                ));
            }
            continue;
        }
        let stream = match wrap(&ctx, stream) {
            Ok(s) => s,
            Err(e) => {
                ctx.connections.fetch_sub(1, Ordering::AcqRel);
                warn!("cannot set up TLS for {peer}: {e}");
                continue;
            }
        };
        let slot = ConnectionSlot(ctx.clone());
        let spawned = std::thread::Builder::new()
            .name("conn".into())
            .stack_size(THREAD_STACK)
            .spawn(move || {
                let ctx = slot.0.clone();
                http::serve(stream, peer, ctx);
                drop(slot);
            });
        if let Err(e) = spawned {
            // The closure, and the slot with it, was dropped: the count is back.
            error!("could not start a connection thread: {e}");
        }
    }
}

/// One counted connection: the count goes down when its thread ends, also when the
/// thread ends in a panic (a bug in one connection must not leak a place under
/// `MAX_CONNECTIONS`).
struct ConnectionSlot(Arc<Ctx>);

impl Drop for ConnectionSlot {
    fn drop(&mut self) {
        self.0.connections.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Plain or TLS, as configured.
fn wrap(ctx: &Ctx, sock: std::net::TcpStream) -> std::io::Result<crate::net::Stream> {
    #[cfg(feature = "server-tls")]
    if let Some(slot) = &ctx.tls {
        let config = slot.read().clone();
        return crate::net::Stream::tls_server(sock, config);
    }
    let _ = ctx;
    Ok(crate::net::Stream::plain(sock))
}
