//! Token usage accounting: every finished request's tokens by API key, tenant, model and
//! worker.
//!
//! - [`journal`]: the crash-safe store of hourly buckets (`STATE_DIR/usage.journal`).
//! - [`Ledger`] (here): what the relay calls when a request ends; it feeds the journal
//!   and keeps it flushed by a background thread (at most half a second behind).
//! - [`query`]: `GET /admin/usage` (JSON or CSV) over the journal.
//! - [`stream`]: `GET /api/usage-stream`, live snapshots fanned out to subscribers.
//!
//! With a shared store (`STATE_URL`) the flusher also publishes each flushed bucket's
//! absolute value there ([`crate::server::store::UsageMirror`]), and the report and the
//! stream add the other relays' figures: the fleet's totals on every relay.

pub mod journal;
pub mod query;
pub mod stream;

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crossbeam_channel::{Receiver, RecvTimeoutError, Sender, TrySendError};
use log::{info, warn};

use crate::server::store::UsageMirror;
use journal::{Journal, Key, Usage};

/// How long a recorded request may wait in memory before the flusher writes it. Well
/// under the promised second, so the fsync's own time fits inside it too.
const FLUSH_DELAY: Duration = Duration::from_millis(500);
/// How often a publication the shared store missed is tried again.
const PUBLISH_RETRY: Duration = Duration::from_secs(1);
/// How often an idle relay checks that the shared store still has its figures.
const HEARTBEAT: Duration = Duration::from_secs(5);

/// Placeholder for "no API key" / "no worker" in the journal and its reports.
pub const NONE: &str = "-";

/// Where finished requests are counted.
pub struct Ledger {
    /// `None` when usage is not persisted (no admin token and no API keys configured,
    /// so nobody could read it).
    journal: Option<Arc<Journal>>,
    /// Wakes the flusher after a record; capacity one, so a burst costs one wake-up.
    dirty: Sender<()>,
    /// Subscribers of `/api/usage-stream`.
    pub hub: Arc<stream::Hub>,
    /// Where the other relays' usage is (with a shared store).
    mirror: Option<Arc<dyn UsageMirror>>,
}

/// One finished request, as the ledger records it.
pub struct Entry<'a> {
    pub key: Option<&'a str>,
    pub tenant: &'a str,
    pub model: &'a str,
    pub worker: &'a str,
    pub tokens: (u64, u64),
}

impl Ledger {
    /// Opens the journal in `dir` (when `persist`) and starts its flusher thread, which
    /// also publishes to `mirror` when there is one.
    pub fn open(
        dir: &Path,
        persist: bool,
        retention_days: u32,
        mirror: Option<Arc<dyn UsageMirror>>,
    ) -> Result<Ledger, String> {
        let (dirty, wake) = crossbeam_channel::bounded(1);
        let mirror = mirror.filter(|_| persist);
        let journal = if persist {
            let journal = Arc::new(Journal::open(dir, retention_days, unix_now())?);
            let stats = journal.stats();
            info!(
                "usage journal {}: {} bucket(s), {} record(s), {} bytes",
                journal.path().display(),
                stats.live_buckets,
                stats.file_records,
                stats.file_bytes
            );
            if mirror.is_some() {
                journal.track_unpublished();
            }
            let (flushed, publish) = (journal.clone(), mirror.clone());
            std::thread::Builder::new()
                .name("usage-flush".into())
                .stack_size(super::THREAD_STACK)
                .spawn(move || flush_loop(&flushed, &wake, publish.as_deref()))
                .map_err(|e| format!("cannot start the usage flusher: {e}"))?;
            Some(journal)
        } else {
            None
        };
        Ok(Ledger {
            journal,
            dirty,
            hub: Arc::new(stream::Hub::default()),
            mirror,
        })
    }

    /// Counts one request that reached a worker.
    pub fn record(&self, e: &Entry<'_>) {
        let Some(journal) = &self.journal else {
            return;
        };
        let key = Key {
            hour: unix_now() / 3600,
            key: e.key.unwrap_or(NONE).to_string(),
            tenant: e.tenant.to_string(),
            model: e.model.to_string(),
            worker: e.worker.to_string(),
        };
        let usage = Usage {
            requests: 1,
            tokens_in: e.tokens.0,
            tokens_out: e.tokens.1,
        };
        journal.add(key, usage);
        match self.dirty.try_send(()) {
            Ok(()) | Err(TrySendError::Full(())) => {}
            Err(TrySendError::Disconnected(())) => warn!("usage flusher is gone"),
        }
    }

    pub fn journal(&self) -> Option<&Journal> {
        self.journal.as_deref()
    }

    /// The journal for a thread of its own (the usage-stream publisher).
    pub fn shared_journal(&self) -> Option<Arc<Journal>> {
        self.journal.clone()
    }

    /// Where the other relays' usage is, with a shared store.
    pub fn mirror(&self) -> Option<&Arc<dyn UsageMirror>> {
        self.mirror.as_ref()
    }

    /// Writes what is still in memory (at shutdown), and publishes it.
    pub fn flush(&self) {
        if let Some(journal) = &self.journal {
            if let Err(e) = journal.flush() {
                warn!("usage journal: final flush failed: {e}");
            } else if let Some(mirror) = &self.mirror {
                let _ = publish(journal, mirror.as_ref());
            }
        }
    }
}

impl Ledger {
    /// The journal's and the usage stream's families for `/metrics`.
    pub fn render_metrics(&self, e: &mut crate::server::metrics::Exposition) {
        if let Some(journal) = &self.journal {
            let totals = journal.totals();
            let stats = journal.stats();
            e.family(
                "modelrelay_usage_retained_tokens",
                "gauge",
                "Tokens in the usage journal (kept USAGE_RETENTION_DAYS; survives restarts).",
            );
            e.sample(
                "modelrelay_usage_retained_tokens",
                &[("direction", "in")],
                totals.tokens_in,
            );
            e.sample(
                "modelrelay_usage_retained_tokens",
                &[("direction", "out")],
                totals.tokens_out,
            );
            e.family(
                "modelrelay_usage_retained_requests",
                "gauge",
                "Requests in the usage journal.",
            );
            e.sample("modelrelay_usage_retained_requests", &[], totals.requests);
            e.family(
                "modelrelay_usage_journal_bytes",
                "gauge",
                "Size of the usage journal file.",
            );
            e.sample("modelrelay_usage_journal_bytes", &[], stats.file_bytes);
        }
        e.family(
            "modelrelay_usage_stream_subscribers",
            "gauge",
            "Clients subscribed to /api/usage-stream.",
        );
        e.sample(
            "modelrelay_usage_stream_subscribers",
            &[],
            self.hub.subscribers(),
        );
        e.family(
            "modelrelay_usage_stream_dropped_total",
            "counter",
            "Usage snapshots dropped from full subscriber queues.",
        );
        e.sample(
            "modelrelay_usage_stream_dropped_total",
            &[],
            self.hub.dropped(),
        );
    }
}

/// Sleeps until something was recorded, waits [`FLUSH_DELAY`] to batch the burst, then
/// appends it (and publishes it to `mirror`). Idle servers never wake up, except with a
/// shared store: to retry a publication every [`PUBLISH_RETRY`] while the store is
/// unreachable, and every [`HEARTBEAT`] to notice a store that lost its data.
fn flush_loop(journal: &Journal, wake: &Receiver<()>, mirror: Option<&dyn UsageMirror>) {
    let mut failing = false;
    loop {
        let woke = match mirror {
            None => wake.recv().map_err(|_| RecvTimeoutError::Disconnected),
            Some(_) if journal.has_unpublished() => wake.recv_timeout(PUBLISH_RETRY),
            Some(_) => wake.recv_timeout(HEARTBEAT),
        };
        match woke {
            Ok(()) => std::thread::sleep(FLUSH_DELAY),
            Err(RecvTimeoutError::Disconnected) => return,
            Err(RecvTimeoutError::Timeout) => {}
        }
        match journal.flush() {
            Ok(()) if failing => {
                info!("usage journal: writing again");
                failing = false;
            }
            Ok(()) => {}
            Err(e) if !failing => {
                warn!("usage journal: flush failed, keeping the counts in memory: {e}");
                failing = true;
            }
            Err(_) => {}
        }
        if failing {
            // Retry without waiting for the next request.
            std::thread::sleep(Duration::from_secs(1));
            if journal.flush().is_ok() {
                info!("usage journal: writing again");
                failing = false;
            }
        }
        // Only what is on disk is published: a relay killed before its flush never has
        // more in the store than in its journal.
        if let (Some(mirror), false) = (mirror, failing) {
            let _ = publish(journal, mirror);
        }
    }
}

/// Publishes the buckets changed since the last publication (at least this relay's
/// totals); on failure they wait for the next (the store logs its own unreachability).
/// A store that did not know this relay gets everything again at the next call.
fn publish(journal: &Journal, mirror: &dyn UsageMirror) -> Result<(), String> {
    let buckets = journal.take_unpublished();
    match mirror.publish(&buckets, journal.totals()) {
        Ok(unknown) => {
            if unknown {
                journal.track_unpublished();
            }
            Ok(())
        }
        Err(e) => {
            journal.mark_unpublished(buckets.into_iter().map(|(key, _)| key));
            Err(e)
        }
    }
}

pub fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}
