//! modelrelay: a self-hosted relay for LLM inference.
//!
//! GPU boxes run a local OpenAI-compatible backend and a `modelrelay-worker` that dials
//! **out** to one `modelrelay-server` over WebSocket. Clients talk ordinary OpenAI or
//! Anthropic HTTP to the server, which queues, routes, streams, cancels and requeues.
//!
//! Map of the crate (read this first):
//!
//! | module | what it does |
//! |---|---|
//! | [`protocol`] | the JSON messages on the worker WebSocket (protocol v1) |
//! | [`net`] | one connection, plain or TLS, cloneable into reader and writer handles |
//! | [`ws`] | WebSocket reader/writer split shared by both binaries |
//! | [`clock`] | deadlines that saturate instead of overflowing |
//! | [`cli`] | option tables: flags, environment variables, `--help` |
//! | [`logger`] | the stderr log lines and their `RUST_LOG`/`LOG_LEVEL` filter |
//! | [`signals`] | stop and reload requests: Unix signals, the Windows console's Ctrl-C |
//! | [`rfc3339`] | UTC timestamps as text and back (no calendar crate) |
//! | [`server`] | the relay: [`server::http`] front, [`server::relay`] client sessions, [`server::worker_socket`], the [`server::dispatcher`] state machine that owns all routing state, and operator endpoints ([`server::ops`]) |
//! | [`worker`] | the daemon: dial out, register, backend slots, drain |
//!
//! No async runtime: OS threads and crossbeam channels, with one dispatcher thread that
//! alone owns the queue and the registry.

mod allocator;
pub mod cli;
pub mod clock;
#[doc(hidden)]
pub mod fuzz;
pub mod logger;
pub mod net;
pub mod options_doc;
pub mod power;
pub mod protocol;
pub mod rfc3339;
pub mod server;
pub mod signals;
pub mod worker;
pub mod ws;
