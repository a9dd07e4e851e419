//! State the dispatcher publishes for the HTTP threads to read without a round trip:
//! gauges for `/health`, the routable model list for `/v1/models`, and what workers say
//! about their models for `/api/show`.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

use parking_lot::RwLock;

use super::dispatcher::Gauges;
use crate::protocol::ModelInfoMap;

#[derive(Debug)]
pub struct Shared {
    pub started: Instant,
    workers: AtomicUsize,
    queue_depth: AtomicUsize,
    in_flight: AtomicUsize,
    /// Relays the workers report (see `Gauges::relays`).
    relays_reported: AtomicUsize,
    shutting_down: AtomicBool,
    /// Client requests between submission and their last byte written.
    relays: AtomicUsize,
    models: RwLock<Arc<Vec<String>>>,
    /// Models some worker reports loaded in its backend's memory.
    loaded: RwLock<Arc<Vec<String>>>,
    /// What workers say about their models, merged (see `Registry::model_info`).
    model_info: RwLock<Arc<ModelInfoMap>>,
}

impl Shared {
    pub fn new() -> Arc<Shared> {
        Arc::new(Shared {
            started: Instant::now(),
            workers: AtomicUsize::new(0),
            queue_depth: AtomicUsize::new(0),
            in_flight: AtomicUsize::new(0),
            relays_reported: AtomicUsize::new(1),
            shutting_down: AtomicBool::new(false),
            relays: AtomicUsize::new(0),
            models: RwLock::new(Arc::new(Vec::new())),
            loaded: RwLock::new(Arc::new(Vec::new())),
            model_info: RwLock::new(Arc::new(ModelInfoMap::new())),
        })
    }

    pub fn publish(&self, g: &Gauges) {
        self.workers.store(g.workers, Ordering::Relaxed);
        self.queue_depth.store(g.queue_depth, Ordering::Relaxed);
        self.in_flight.store(g.in_flight, Ordering::Relaxed);
        self.relays_reported.store(g.relays, Ordering::Relaxed);
    }

    pub fn gauges(&self) -> Gauges {
        Gauges {
            workers: self.workers.load(Ordering::Relaxed),
            queue_depth: self.queue_depth.load(Ordering::Relaxed),
            in_flight: self.in_flight.load(Ordering::Relaxed),
            relays: self.relays_reported.load(Ordering::Relaxed),
        }
    }

    /// How many relays the workers report serving (at least 1).
    pub fn relays_reported(&self) -> usize {
        self.relays_reported.load(Ordering::Relaxed).max(1)
    }

    pub fn set_models(&self, models: Vec<String>) {
        *self.models.write() = Arc::new(models);
    }

    pub fn models(&self) -> Arc<Vec<String>> {
        self.models.read().clone()
    }

    pub fn set_loaded(&self, models: Vec<String>) {
        *self.loaded.write() = Arc::new(models);
    }

    pub fn loaded(&self) -> Arc<Vec<String>> {
        self.loaded.read().clone()
    }

    pub fn set_model_info(&self, info: ModelInfoMap) {
        *self.model_info.write() = Arc::new(info);
    }

    pub fn model_info(&self) -> Arc<ModelInfoMap> {
        self.model_info.read().clone()
    }

    pub fn set_shutting_down(&self) {
        self.shutting_down.store(true, Ordering::Relaxed);
    }

    pub fn is_shutting_down(&self) -> bool {
        self.shutting_down.load(Ordering::Relaxed)
    }

    /// Counts a relay in progress until the returned guard drops (on whichever thread
    /// finishes the answer: see `relay/direct.rs`).
    pub fn relay_started(self: &Arc<Self>) -> RelayGuard {
        self.relays.fetch_add(1, Ordering::AcqRel);
        RelayGuard(self.clone())
    }

    pub fn relays(&self) -> usize {
        self.relays.load(Ordering::Acquire)
    }
}

pub struct RelayGuard(Arc<Shared>);

impl Drop for RelayGuard {
    fn drop(&mut self) {
        self.0.relays.fetch_sub(1, Ordering::AcqRel);
    }
}
