//! Resumable streams: a streamed answer that outlives its client's connection.
//!
//! A client opts in per request (`X-Resumable: true`) or the server does for every
//! stream (`RESUMABLE_STREAMS=on`; `X-Resumable: false` then opts out). Such a
//! stream's events are numbered ([`buffer`]: SSE `id:` lines, NDJSON line numbers) and
//! the recent ones kept in a bounded buffer ([`held`]). When the client's connection
//! drops, the request is not cancelled: the connection thread that relays it goes on
//! reading the worker's events into the buffer for `RESUME_GRACE_SECS`. A client that
//! reconnects with `GET /v1/streams/{request_id}` and `Last-Event-ID` gets every event
//! after that id, then the rest live ([`handler`]); nobody within the grace period,
//! and the request is cancelled end to end as before.
//!
//! Bounds: `RESUME_BUFFER_BYTES` per stream and `RESUME_TOTAL_BYTES` for all streams
//! together. While a client reads, events it has been handed are dropped oldest first
//! to stay under them; events nobody has been handed are never dropped: past a cap
//! the stream is given up (resuming is refused with `resume_buffer_full`) and
//! cancelled as before. Streams that did not opt in do nothing of this.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::http::request::Request;
use super::relay::boundary::Format;
use super::tenancy::identity::Caller;

pub mod buffer;
pub mod handler;
pub mod held;
pub mod remote;

pub use held::{Held, Tap};

/// `GET /v1/streams/{request_id}`.
pub const ROUTE_PREFIX: &str = "/v1/streams/";
/// Bookkeeping charged per held stream besides its events, so the total cap also
/// bounds how many (finished, empty) streams are remembered.
pub const STREAM_OVERHEAD: usize = 512;

/// The options (see `RESUMABLE_STREAMS`, `RESUME_*` in the option table).
#[derive(Debug, Clone)]
pub struct Config {
    /// Every stream is resumable unless the client says `X-Resumable: false`.
    pub default_on: bool,
    /// How long a stream nobody reads is kept going.
    pub grace: Duration,
    /// Most bytes kept for one stream.
    pub stream_bytes: usize,
    /// Most bytes kept for all streams together.
    pub total_bytes: usize,
}

impl Default for Config {
    fn default() -> Config {
        Config {
            default_on: false,
            grace: Duration::from_secs(30),
            stream_bytes: 1 << 20,
            total_bytes: 64 << 20,
        }
    }
}

/// Whether this request asked for (or the server gives it) a resumable stream.
pub fn opted_in(req: &Request, cfg: &Config) -> bool {
    match req.header("x-resumable").map(str::trim) {
        Some(v) if v.eq_ignore_ascii_case("true") || v == "1" => true,
        Some(v) if v.eq_ignore_ascii_case("false") || v == "0" => false,
        _ => cfg.default_on,
    }
}

/// Who may resume a stream: the key that started it, or without keys its tenant.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Owner {
    key: Option<String>,
    tenant: Arc<str>,
}

impl Owner {
    pub fn new(key: Option<&str>, tenant: &str) -> Owner {
        Owner {
            key: key.map(str::to_string),
            tenant: Arc::from(tenant),
        }
    }

    /// What a worker holding the stream checks a resume against
    /// ([`crate::protocol::held::proof`]): the token bound to this owner.
    pub fn proof(&self, token: &str) -> String {
        crate::protocol::held::proof(token, self.key.as_deref(), &self.tenant)
    }

    pub fn of(caller: &Caller) -> Owner {
        Owner {
            key: caller.key_id().map(str::to_string),
            tenant: caller.who.tenant.clone(),
        }
    }
}

/// A fresh resume token: request ids are guessable, and without API keys every
/// anonymous client is the same owner, so a resume also needs this secret (it is part of
/// the `x-resume-url` the stream's head gives). `None` without randomness.
fn resume_token() -> Option<String> {
    let mut bytes = [0u8; 16];
    getrandom::fill(&mut bytes).ok()?;
    Some(bytes.iter().map(|b| format!("{b:02x}")).collect())
}

/// The held streams of this relay, by wire request id.
#[derive(Clone)]
pub struct Registry {
    inner: Arc<Inner>,
}

pub(crate) struct Inner {
    pub(crate) cfg: Config,
    streams: Mutex<HashMap<String, Arc<Held>>>,
    /// Bytes charged by all held streams (events and [`STREAM_OVERHEAD`]).
    pub(crate) bytes: AtomicUsize,
}

impl Registry {
    pub fn new(cfg: Config) -> Registry {
        Registry {
            inner: Arc::new(Inner {
                cfg,
                streams: Mutex::new(HashMap::new()),
                bytes: AtomicUsize::new(0),
            }),
        }
    }

    pub fn config(&self) -> &Config {
        &self.inner.cfg
    }

    /// Starts holding a stream with this content type; `None` when the total cap leaves
    /// no room even after forgetting finished streams (the stream then runs as one that
    /// did not opt in).
    pub fn open(&self, wire: &str, owner: Owner, content_type: &'static str) -> Option<Tap> {
        let format = Format::for_content_type(content_type);
        let now = Instant::now();
        let mut streams = self.inner.streams.lock();
        self.sweep(&mut streams, now, false);
        if self.inner.bytes.load(Ordering::Relaxed) + STREAM_OVERHEAD > self.inner.cfg.total_bytes {
            self.sweep(&mut streams, now, true);
            if self.inner.bytes.load(Ordering::Relaxed) + STREAM_OVERHEAD
                > self.inner.cfg.total_bytes
            {
                return None;
            }
        }
        self.inner
            .bytes
            .fetch_add(STREAM_OVERHEAD, Ordering::Relaxed);
        let token = resume_token()?;
        let held = Arc::new(Held::new(wire, owner, token, format, content_type));
        streams.insert(wire.to_string(), held.clone());
        Some(Tap::new(held, self.inner.clone()))
    }

    /// The held stream with this id, if it is still remembered.
    pub fn get(&self, wire: &str) -> Option<Arc<Held>> {
        let mut streams = self.inner.streams.lock();
        self.sweep(&mut streams, Instant::now(), false);
        streams.get(wire).cloned()
    }

    /// Streams remembered now (running or ended within the grace period).
    pub fn len(&self) -> usize {
        self.inner.streams.lock().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes charged now.
    pub fn bytes(&self) -> usize {
        self.inner.bytes.load(Ordering::Relaxed)
    }

    /// Forgets streams that ended more than the grace period ago (`all`: every ended
    /// stream), giving back what they were charged.
    fn sweep(&self, streams: &mut HashMap<String, Arc<Held>>, now: Instant, all: bool) {
        let grace = self.inner.cfg.grace;
        streams.retain(|_, held| {
            let keep = match held.ended_at() {
                None => true,
                Some(_) if all => false,
                Some(at) => now.saturating_duration_since(at) < grace,
            };
            if !keep {
                let freed = held.forget() + STREAM_OVERHEAD;
                self.inner.bytes.fetch_sub(freed, Ordering::Relaxed);
            }
            keep
        });
    }
}
