//! The worker registry: who is connected, what they serve, how loaded they are.
//!
//! Owned by the dispatcher thread; nothing else touches it.

use std::collections::{BTreeMap, HashSet};
use std::time::Instant;

use super::ids::IdSet;
use super::outliers::{Health, Record};
use crate::protocol::lifecycle::{WorkerStatus, FEATURE_LIFECYCLE};
use crate::protocol::{ModelInfo, ModelInfoMap};

/// Capabilities kept per model description (a worker's word, bounded).
const MAX_CAPABILITIES: usize = 16;

/// Routes kept per worker (`register.routes`), and the longest path kept.
const MAX_ROUTES: usize = 128;
const MAX_ROUTE_LEN: usize = 256;

/// What a request needs its model to do, read from its body on the client's thread.
/// A worker is passed over only when it describes the model and the ability is missing
/// (a worker that says nothing about its models may still get the request).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Needs {
    /// Image parts in the messages.
    pub vision: bool,
    /// `/v1/embeddings`.
    pub embedding: bool,
    /// A base64 body (`binary.rs`): only workers listing `binary_bodies` take it.
    pub binary: bool,
    /// A body that follows in pieces (`protocol::pieces`): only workers listing
    /// `body_pieces` take it.
    pub pieces: bool,
    /// A relayed route beyond chat: only workers serving it (or not saying) take it.
    pub route: Option<&'static str>,
    /// It continues an answer begun elsewhere on this route: only a worker that listed
    /// the `continuation` feature, over a backend kind that can go on from a prefix on
    /// it, takes it (see `server::continuation`).
    pub continuation: Option<&'static str>,
}

impl Needs {
    /// The capability names (Ollama's) this asks for.
    fn names(self) -> impl Iterator<Item = &'static str> {
        [("vision", self.vision), ("embedding", self.embedding)]
            .into_iter()
            .filter_map(|(name, on)| on.then_some(name))
    }
}

/// Dispatcher-assigned worker key (the connection number).
pub type WorkerId = u64;

/// One registered worker session.
#[derive(Debug)]
pub struct Worker {
    pub id: WorkerId,
    pub wire_id: String,
    pub name: String,
    pub remote: String,
    pub models: Vec<String>,
    model_set: HashSet<String>,
    pub max_concurrent: u32,
    /// Requests this server has dispatched to the worker and not yet seen finish.
    pub in_flight: IdSet,
    /// Load the worker reports beyond what we dispatched (e.g. another server's work).
    pub external_load: u32,
    pub reported_load: u32,
    pub drain: DrainState,
    pub last_seen: Instant,
    pub connected_at: Instant,
    pub protocol_version: Option<String>,
    pub features: Vec<String>,
    /// Whether its backend answers: up, reported down, or ejected for failing.
    pub health: Health,
    /// Its recent answers, for outlier ejection.
    pub record: Record,
    /// Models its backend holds in memory, when the worker reports it.
    loaded: Option<HashSet<String>>,
    /// What its backend is, when the worker reports it.
    pub backend_kind: Option<String>,
    /// What its backend says about its models, when the worker reports it.
    model_info: Option<ModelInfoMap>,
    /// Its backend's version and resources (`worker_status`), when reported.
    pub status: WorkerStatus,
    /// Where a magic packet wakes its box, when it said (`register.wake`).
    pub wake: Option<crate::power::WakeAddress>,
    /// The operator pinned it awake: it is never granted sleep.
    pub stay_awake: bool,
    /// Since when its box's owner uses it (`owner_status`): it takes nothing new.
    pub yielded: Option<Instant>,
    /// The relays it is registered with, as it reports them (`relays`; empty: not
    /// reported, an original or single-relay worker).
    pub relays: Vec<String>,
    /// The routes beyond chat its backend serves (`register.routes`); `None`: unknown.
    pub routes: Option<HashSet<String>>,
}

/// Whether a worker takes new work.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DrainState {
    Active,
    /// Asked by us (admin or shutdown): close the socket once idle.
    DrainingCloseWhenIdle,
    /// Announced by the worker: it closes its own socket when done.
    DrainingByWorker,
}

impl Worker {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        id: WorkerId,
        name: String,
        remote: String,
        models: Vec<String>,
        max_concurrent: u32,
        protocol_version: Option<String>,
        features: Vec<String>,
        now: Instant,
    ) -> Worker {
        let model_set = models.iter().cloned().collect();
        Worker {
            id,
            wire_id: format!("w-{id}"),
            name,
            remote,
            models,
            model_set,
            max_concurrent,
            in_flight: IdSet::default(),
            external_load: 0,
            reported_load: 0,
            drain: DrainState::Active,
            last_seen: now,
            connected_at: now,
            protocol_version,
            features,
            health: Health::Up,
            record: Record::default(),
            loaded: None,
            backend_kind: None,
            model_info: None,
            status: WorkerStatus::default(),
            wake: None,
            stay_awake: false,
            yielded: None,
            relays: Vec::new(),
            routes: None,
        }
    }

    /// Records a `worker_status` report (a field it leaves out keeps its value).
    pub fn set_status(&mut self, status: WorkerStatus) {
        if status.backend_version.is_some() {
            self.status.backend_version = status.backend_version.map(|mut v| {
                v.truncate(64);
                v
            });
        }
        if status.resources.is_some() {
            self.status.resources = status.resources;
        }
    }

    /// Whether the worker runs model operations (the lifecycle extension).
    pub fn runs_operations(&self) -> bool {
        self.features.iter().any(|f| f == FEATURE_LIFECYCLE)
    }

    /// A finished load or unload, seen before the worker's own `models_update`.
    pub fn set_model_loaded(&mut self, model: &str, loaded: bool) {
        let set = self.loaded.get_or_insert_with(HashSet::new);
        if loaded {
            set.insert(model.to_string());
        } else {
            set.remove(model);
        }
    }

    /// Records what the backend says about its models (`None`: not reported), keeping
    /// only advertised models and a bounded list of capabilities each.
    pub fn set_model_info(&mut self, info: Option<ModelInfoMap>) {
        self.model_info = info.map(|map| {
            map.into_iter()
                .filter(|(m, _)| self.model_set.contains(m))
                .map(|(m, mut i)| {
                    i.capabilities.truncate(MAX_CAPABILITIES);
                    (m, i)
                })
                .collect()
        });
    }

    /// What the backend says about its advertised models (`None`: not reported).
    pub fn model_info(&self) -> Option<ModelInfoMap> {
        let info = self.model_info.as_ref()?;
        Some(
            info.iter()
                .filter(|(m, _)| self.model_set.contains(*m))
                .map(|(m, i)| (m.clone(), i.clone()))
                .collect(),
        )
    }

    /// Records which models the backend holds in memory (`None`: not reported).
    pub fn set_loaded(&mut self, loaded: Option<Vec<String>>) {
        self.loaded = loaded.map(|l| l.into_iter().collect());
    }

    /// Whether the backend holds `model` in memory (false when not reported).
    pub fn has_loaded(&self, model: &str) -> bool {
        self.loaded.as_ref().is_some_and(|l| l.contains(model))
    }

    /// The models reported loaded, in advertised order (`None`: not reported).
    pub fn loaded_models(&self) -> Option<Vec<String>> {
        let loaded = self.loaded.as_ref()?;
        Some(
            self.models
                .iter()
                .filter(|m| loaded.contains(*m))
                .cloned()
                .collect(),
        )
    }

    pub fn is_draining(&self) -> bool {
        self.drain != DrainState::Active
    }

    /// Effective load: our own in-flight requests plus whatever else the worker reports.
    pub fn load(&self) -> u32 {
        self.in_flight.len() as u32 + self.external_load
    }

    /// Takes new work: not draining, backend up and not ejected, a slot free.
    pub fn has_free_slot(&self) -> bool {
        !self.is_draining()
            && self.yielded.is_none()
            && self.health == Health::Up
            && self.load() < self.max_concurrent
    }

    pub fn serves(&self, model: &str) -> bool {
        self.model_set.contains(model)
    }

    /// The first capability in `needs` this worker says its `model` lacks. Only what
    /// the backend can say counts: every kind reports vision, but only Ollama lists
    /// `embedding` (llama-server and vLLM cannot tell whether a model embeds).
    pub fn lacks(&self, model: &str, needs: Needs) -> Option<&'static str> {
        if let Some(missing) = self.lacks_route(needs) {
            return Some(missing);
        }
        let described = self.model_info.as_ref()?.get(model)?;
        if described.capabilities.is_empty() {
            return None;
        }
        let complete = self.backend_kind.as_deref() == Some("ollama");
        needs
            .names()
            .filter(|need| *need != "embedding" || complete)
            .find(|need| !described.capabilities.iter().any(|c| c == need))
    }

    /// What the worker itself (not its model) lacks for `needs`: the binary-body
    /// extension (an original worker would corrupt the bytes) or the route, named by
    /// its path (a path is how [`super::requests`] tells a route from a capability).
    fn lacks_route(&self, needs: Needs) -> Option<&'static str> {
        if needs.binary
            && !self
                .features
                .iter()
                .any(|f| f == crate::protocol::binary::FEATURE_BINARY_BODIES)
        {
            return Some(crate::protocol::binary::FEATURE_BINARY_BODIES);
        }
        let pieces = crate::protocol::pieces::FEATURE_BODY_PIECES;
        if needs.pieces && !self.features.iter().any(|f| f == pieces) {
            return Some(pieces);
        }
        let route = needs.route?;
        let routes = self.routes.as_ref()?;
        (!routes.contains(route)).then_some(route)
    }

    /// Whether `model` here may take a request with `needs`.
    pub fn can(&self, model: &str, needs: Needs) -> bool {
        if needs
            .continuation
            .is_some_and(|route| !self.continues(route))
        {
            return false;
        }
        let needs = Needs {
            continuation: None,
            ..needs
        };
        needs == Needs::default() || self.lacks(model, needs).is_none()
    }

    /// Keeps the routes a worker reports, bounded: a worker's word, not trusted with
    /// memory (more than [`MAX_ROUTES`] or overlong paths are dropped).
    pub fn set_routes(&mut self, routes: Option<Vec<String>>) {
        self.routes = routes.map(|list| {
            list.into_iter()
                .filter(|r| r.len() <= MAX_ROUTE_LEN)
                .take(MAX_ROUTES)
                .collect()
        });
    }

    /// Whether this worker may take a continuation on `route`: it listed the feature,
    /// and its backend is of a kind that goes on from an assistant prefix there (an
    /// unknown kind may be one that does not).
    pub fn continues(&self, route: &str) -> bool {
        use crate::protocol::continuation::{continues_on, FEATURE_CONTINUATION};
        self.features.iter().any(|f| f == FEATURE_CONTINUATION)
            && self
                .backend_kind
                .as_deref()
                .is_some_and(|kind| continues_on(kind, route))
    }

    pub fn set_models(&mut self, models: Vec<String>) {
        self.model_set = models.iter().cloned().collect();
        self.models = models;
    }

    /// A reported load is a snapshot that includes our own in-flight requests; only the
    /// excess is load we cannot see, so a stale report never blocks a slot we freed.
    pub fn set_reported_load(&mut self, reported: u32) {
        self.reported_load = reported;
        self.external_load = reported.saturating_sub(self.in_flight.len() as u32);
    }
}

/// All connected workers, ordered by id so round-robin is deterministic.
#[derive(Debug, Default)]
pub struct Registry {
    workers: BTreeMap<WorkerId, Worker>,
    last_pick: Option<WorkerId>,
}

impl Registry {
    pub fn insert(&mut self, worker: Worker) {
        self.workers.insert(worker.id, worker);
    }

    pub fn remove(&mut self, id: WorkerId) -> Option<Worker> {
        self.workers.remove(&id)
    }

    pub fn get(&self, id: WorkerId) -> Option<&Worker> {
        self.workers.get(&id)
    }

    pub fn get_mut(&mut self, id: WorkerId) -> Option<&mut Worker> {
        self.workers.get_mut(&id)
    }

    pub fn len(&self) -> usize {
        self.workers.len()
    }

    pub fn is_empty(&self) -> bool {
        self.workers.is_empty()
    }

    pub fn ids(&self) -> Vec<WorkerId> {
        self.workers.keys().copied().collect()
    }

    pub fn iter(&self) -> impl Iterator<Item = &Worker> {
        self.workers.values()
    }

    /// The worker routing picked last (round robin goes on after it).
    pub fn last_pick(&self) -> Option<WorkerId> {
        self.last_pick
    }

    /// Notes where routing sent a request (see `routing.rs`).
    pub fn note_pick(&mut self, id: WorkerId) {
        self.last_pick = Some(id);
    }

    /// The capability no worker serving `model` has, when every one of them says so
    /// (`None` when some worker can, may, or none serves the model at all).
    pub fn unmet(&self, model: &str, needs: Needs) -> Option<&'static str> {
        if needs == Needs::default() {
            return None;
        }
        let mut lacking = None;
        for w in self.workers.values().filter(|w| w.serves(model)) {
            match w.lacks(model, needs) {
                None => return None,
                Some(need) => lacking = Some(need),
            }
        }
        lacking
    }

    /// Whether any connected worker (draining or not) advertises `model`.
    pub fn advertises(&self, model: &str) -> bool {
        self.workers.values().any(|w| w.serves(model))
    }

    /// Union of the models workers report loaded in memory, in first-seen order.
    pub fn loaded_models(&self) -> Vec<String> {
        let mut seen = HashSet::new();
        self.workers
            .values()
            .filter(|w| !w.is_draining())
            .flat_map(|w| w.loaded_models().unwrap_or_default())
            .filter(|m| seen.insert(m.clone()))
            .collect()
    }

    /// What the non-draining workers say about their models, merged per model: the first
    /// known context length (in worker order) and the union of the capabilities.
    pub fn model_info(&self) -> ModelInfoMap {
        let mut merged = ModelInfoMap::new();
        for w in self.workers.values().filter(|w| !w.is_draining()) {
            for (m, info) in w.model_info().unwrap_or_default() {
                let entry: &mut ModelInfo = merged.entry(m).or_default();
                if entry.context_length.is_none() {
                    entry.context_length = info.context_length;
                }
                for c in info.capabilities {
                    if !entry.capabilities.contains(&c) {
                        entry.capabilities.push(c);
                    }
                }
            }
        }
        merged
    }

    /// Union of the models of connected, non-draining workers, in first-seen order.
    pub fn routable_models(&self) -> Vec<String> {
        let mut seen = HashSet::new();
        let mut out = Vec::new();
        for w in self.workers.values().filter(|w| !w.is_draining()) {
            for m in &w.models {
                if seen.insert(m.as_str()) {
                    out.push(m.clone());
                }
            }
        }
        out
    }
}

/// Cleans an advertised model list: trims, drops empties, de-duplicates keeping the
/// first occurrence, and caps the count. Returns the list and warnings for the ack.
pub fn sanitize_models(models: Vec<String>, cap: usize) -> (Vec<String>, Vec<String>) {
    let mut warnings = Vec::new();
    let mut seen = HashSet::new();
    let mut out = Vec::new();
    let (mut empty, mut dup, mut over) = (0, 0, 0);
    let total = models.len();
    for m in models {
        if out.len() == cap {
            // Past the cap nothing is kept: no need to hash the rest (a worker may send
            // 100,000 names; this runs on the dispatcher thread).
            over = total - empty - dup - cap;
            break;
        }
        let m = m.trim();
        if m.is_empty() {
            empty += 1;
        } else if !seen.insert(m.to_string()) {
            dup += 1;
        } else {
            out.push(m.to_string());
        }
    }
    if empty > 0 {
        warnings.push(format!("dropped {empty} empty model name(s)"));
    }
    if dup > 0 {
        warnings.push(format!("dropped {dup} duplicate model name(s)"));
    }
    if over > 0 {
        warnings.push(format!(
            "model list truncated to {cap} entries ({over} more dropped)"
        ));
    }
    (out, warnings)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn worker(id: WorkerId, models: &[&str], info: &[(&str, Option<u64>, &[&str])]) -> Worker {
        let mut w = Worker::new(
            id,
            format!("w{id}"),
            "test".into(),
            models.iter().map(|m| m.to_string()).collect(),
            1,
            None,
            vec![],
            Instant::now(),
        );
        w.set_model_info(Some(
            info.iter()
                .map(|(m, ctx, caps)| {
                    let i = ModelInfo {
                        context_length: *ctx,
                        capabilities: caps.iter().map(|c| c.to_string()).collect(),
                    };
                    (m.to_string(), i)
                })
                .collect(),
        ));
        w
    }

    #[test]
    fn only_what_a_backend_can_say_is_held_against_it() {
        let needs = |vision, embedding| Needs {
            vision,
            embedding,
            ..Default::default()
        };
        let mut llama = worker(1, &["m"], &[("m", None, &["completion"])]);
        llama.backend_kind = Some("llama-server".into());
        assert_eq!(llama.lacks("m", needs(true, false)), Some("vision"));
        assert_eq!(
            llama.lacks("m", needs(false, true)),
            None,
            "llama-server cannot say"
        );
        let mut ollama = worker(2, &["m"], &[("m", None, &["completion"])]);
        ollama.backend_kind = Some("ollama".into());
        assert_eq!(ollama.lacks("m", needs(false, true)), Some("embedding"));
        let silent = worker(3, &["m"], &[]);
        assert!(
            silent.can("m", needs(true, true)),
            "undescribed models may take anything"
        );
    }

    #[test]
    fn model_info_merges_the_first_context_length_and_every_capability() {
        let mut r = Registry::default();
        r.insert(worker(
            1,
            &["a", "b"],
            &[
                ("a", None, &["completion"]),
                ("b", Some(2048), &["embedding"]),
                ("not-advertised", Some(1), &["x"]),
            ],
        ));
        r.insert(worker(
            2,
            &["a"],
            &[("a", Some(8192), &["completion", "tools"])],
        ));
        r.insert(worker(3, &["a"], &[("a", Some(4096), &["vision"])]));
        let merged = r.model_info();
        assert_eq!(merged.len(), 2, "{merged:?}");
        assert_eq!(merged["a"].context_length, Some(8192));
        assert_eq!(merged["a"].capabilities, ["completion", "tools", "vision"]);
        assert_eq!(merged["b"].context_length, Some(2048));
        assert_eq!(merged["b"].capabilities, ["embedding"]);
        // A draining worker no longer counts.
        r.get_mut(2).unwrap().drain = DrainState::DrainingByWorker;
        assert_eq!(r.model_info()["a"].context_length, Some(4096));
        assert_eq!(r.model_info()["a"].capabilities, ["completion", "vision"]);
    }
}
