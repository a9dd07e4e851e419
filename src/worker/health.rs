//! What the worker knows about its backend, and what it tells the server about it.
//!
//! The backend is [`State::Up`] or [`State::Down`] (since when, and why). Only a failure
//! without any HTTP answer (refused, reset, connect timeout) marks it down: a 500 or a 4xx
//! is an answer, so the backend is up. While it is down the worker takes no work —
//! requests that still arrive get a retryable error at once, without touching the backend
//! — and the prober thread calls `GET /v1/models` after 1 s, 2 s, 4 s, ... at most
//! `BACKEND_PROBE_MAX_SECS` apart, until the backend answers. The worker also probes once
//! at start-up, so it never registers a dead backend's (empty) model list and forgets it.
//!
//! The server learns of it through [`sync`], which compares what the current session was
//! last told ([`Told`]) with the worker's view and sends only the difference, in order:
//! `backend_status` to a server that listed `backend_health`, and to any other server an
//! empty `models_update` while the backend is down and the real list once it is back.
//! The loaded models (`backend_kind.rs`) ride along in `models_update`, sent when they
//! change; so does `model_info` (what each model is), only in the `models_update` that
//! follows a change (or one the server asked for): absent means "unchanged".

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender};
use log::{debug, info, warn};
use parking_lot::Mutex;

use super::backend::ModelsError;
use super::{ModelSource, Shared};
use crate::protocol::{BackendState, ModelInfoMap, WorkerMessage};

/// Delay before the first probe after the backend went down; it doubles from there.
const FIRST_PROBE: Duration = Duration::from_secs(1);

/// Whether the backend answers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum State {
    Up,
    Down { since: Instant, reason: String },
}

/// The backend's state, shared by the slots (which report failures), the prober (which
/// reports the revival) and the session (which registers accordingly).
pub struct Health {
    state: Mutex<State>,
    /// Mirrors `state` so the per-request check takes no lock.
    down: AtomicBool,
    /// Wakes the prober when the backend goes down (capacity 1: one pending kick is enough).
    kick_tx: Sender<()>,
    kick_rx: Receiver<()>,
    max_backoff: Duration,
}

impl Health {
    pub fn new(max_backoff: Duration) -> Health {
        let (kick_tx, kick_rx) = crossbeam_channel::bounded(1);
        Health {
            state: Mutex::new(State::Up),
            down: AtomicBool::new(false),
            kick_tx,
            kick_rx,
            max_backoff,
        }
    }

    pub fn is_down(&self) -> bool {
        self.down.load(Ordering::Acquire)
    }

    /// Why the backend is down; `None` while it is up.
    pub fn down_reason(&self) -> Option<String> {
        if !self.is_down() {
            return None;
        }
        match &*self.state.lock() {
            State::Up => None,
            State::Down { reason, .. } => Some(reason.clone()),
        }
    }

    /// Up → down. True on the transition; false when it was already down.
    pub fn mark_down(&self, reason: &str, now: Instant) -> bool {
        let mut state = self.state.lock();
        if matches!(*state, State::Down { .. }) {
            return false;
        }
        *state = State::Down {
            since: now,
            reason: reason.to_string(),
        };
        self.down.store(true, Ordering::Release);
        let _ = self.kick_tx.try_send(());
        true
    }

    /// Down → up. How long it was down, on the transition; `None` when it was up.
    pub fn mark_up(&self, now: Instant) -> Option<Duration> {
        let mut state = self.state.lock();
        let State::Down { since, .. } = *state else {
            return None;
        };
        *state = State::Up;
        self.down.store(false, Ordering::Release);
        Some(now.saturating_duration_since(since))
    }
}

/// Probe delays: 1 s, doubling, capped at `max`.
#[derive(Debug)]
pub struct Backoff {
    next: Duration,
    max: Duration,
}

impl Backoff {
    pub fn new(max: Duration) -> Backoff {
        Backoff {
            next: FIRST_PROBE.min(max),
            max,
        }
    }

    pub fn next_delay(&mut self) -> Duration {
        let delay = self.next;
        self.next = (self.next * 2).min(self.max);
        delay
    }
}

/// What one session's server was last told.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Told {
    pub models: Vec<String>,
    pub backend: BackendState,
    /// The loaded models it was last told (`None`: never told).
    pub loaded: Option<Vec<String>>,
    /// The model descriptions it was last told (`None`: never told).
    pub info: Option<ModelInfoMap>,
}

impl Told {
    /// Right after `register` with `models`, `loaded` and `info`: a server assumes a new
    /// worker's backend is up.
    pub fn registered(
        models: Vec<String>,
        loaded: Option<Vec<String>>,
        info: Option<ModelInfoMap>,
    ) -> Told {
        Told {
            models,
            backend: BackendState::Up,
            loaded,
            info,
        }
    }
}

/// The worker's current view, as the server should see it.
#[derive(Debug)]
pub struct View<'a> {
    pub models: &'a [String],
    pub down_reason: Option<&'a str>,
    pub draining: bool,
    pub current_load: u32,
    /// Which of `models` the backend holds in memory (`None`: unknown).
    pub loaded: Option<&'a [String]>,
    /// What the backend says about `models` (`None`: nothing).
    pub info: Option<&'a ModelInfoMap>,
}

/// The model list to advertise: a server without `backend_health` only learns that the
/// backend is down from an empty list (which every ModelRelay server honours).
pub fn advertised(view: &View, health_feature: bool) -> Vec<String> {
    if view.down_reason.is_some() && !health_feature {
        Vec::new()
    } else {
        view.models.to_vec()
    }
}

/// The messages that bring a server from `told` to `view`, updating `told`.
/// `force_models`: the server asked for the list (`models_refresh`).
pub fn plan(
    told: &mut Told,
    view: &View,
    health_feature: bool,
    force_models: bool,
) -> Vec<WorkerMessage> {
    let mut out = Vec::new();
    let state = match view.down_reason {
        Some(_) => BackendState::Down,
        None => BackendState::Up,
    };
    if health_feature && told.backend != state {
        out.push(WorkerMessage::BackendStatus {
            state,
            reason: view.down_reason.map(str::to_string),
        });
        told.backend = state;
    }
    // A draining worker already announced itself; a model list now would undo that.
    let models = advertised(view, health_feature);
    // Loaded among what is advertised. Once told, "unknown" is sent as "none loaded"
    // (a server keeps the last set it heard; routing treats both alike).
    let loaded = match view.loaded {
        Some(l) => Some(l.iter().filter(|m| models.contains(m)).cloned().collect()),
        None => told.loaded.as_ref().map(|_| Vec::new()),
    };
    let loaded_changed = loaded.is_some() && loaded != told.loaded;
    // The same for the descriptions, which travel only when they changed (or asked for).
    let info: Option<ModelInfoMap> = match view.info {
        Some(i) => Some(
            i.iter()
                .filter(|(m, _)| models.contains(m))
                .map(|(m, v)| (m.clone(), v.clone()))
                .collect(),
        ),
        None => told.info.as_ref().map(|_| ModelInfoMap::new()),
    };
    let info_changed = info.is_some() && info != told.info;
    if !view.draining && (force_models || models != told.models || loaded_changed || info_changed) {
        told.models = models.clone();
        if loaded.is_some() {
            told.loaded = loaded.clone();
        }
        let model_info = if info_changed || force_models {
            info.clone()
        } else {
            None
        };
        if info.is_some() {
            told.info = info;
        }
        out.push(WorkerMessage::ModelsUpdate {
            models,
            current_load: view.current_load,
            loaded_models: loaded,
            model_info,
        });
    }
    out
}

/// Tells every relay's session whatever changed since it was last told. Each session's
/// `told` lock is held while sending, so two threads reporting opposite transitions
/// cannot deliver them out of order.
pub fn sync(shared: &Shared, force_models: bool) {
    for link in shared.relays.links() {
        sync_link(shared, &link, force_models);
    }
}

fn sync_link(shared: &Shared, link: &super::relays::session::Link, force_models: bool) {
    let mut told = link.told.lock();
    let models = shared.models.lock().clone();
    let loaded = shared.residency.loaded_among(&models);
    let info = shared.residency.info_among(&models);
    let reason = shared.health.down_reason();
    let view = View {
        models: &models,
        down_reason: reason.as_deref(),
        draining: shared.is_draining(),
        current_load: shared.inflight.len() as u32,
        loaded: loaded.as_deref(),
        info: info.as_ref(),
    };
    for msg in plan(&mut told, &view, link.backend_health, force_models) {
        link.out.send(&msg);
    }
}

/// The backend gave no answer at all: mark it down, wake the prober, tell the server.
pub fn backend_failed(shared: &Shared, reason: &str) {
    if !shared.health.mark_down(reason, Instant::now()) {
        return;
    }
    warn!(
        "backend down: {reason}; probing every {}s, backing off to {}s",
        FIRST_PROBE.min(shared.health.max_backoff).as_secs(),
        shared.health.max_backoff.as_secs()
    );
    sync(shared, false);
}

/// A probe answered: take the models it read, mark the backend up, tell the server.
fn backend_answered(shared: &Shared, models: Option<Vec<String>>) {
    if let Some(list) = models {
        super::set_models(shared, list);
    }
    if let Some(after) = shared.health.mark_up(Instant::now()) {
        info!("backend up again after {:.1}s", after.as_secs_f64());
        // It may be another backend now: its version and resources are read afresh.
        shared.lifecycle.kick();
    }
    sync(shared, false);
}

/// One `GET /v1/models`. Up means an answer: with `MODELS=*` a usable list (the worker
/// has nothing to advertise without one), with a fixed list any HTTP status. Then, with
/// the backend answering, what it is (again: it may have been replaced while down) and
/// which models it holds.
fn probe(shared: &Shared) -> Result<Option<Vec<String>>, String> {
    let models = match (&shared.cfg.models, shared.backend.models()) {
        (ModelSource::Backend, Ok(list)) => Some(list),
        (ModelSource::Backend, Err(e)) => return Err(e.to_string()),
        (ModelSource::Fixed(_), Err(ModelsError::Unreachable(e))) => return Err(e),
        (ModelSource::Fixed(_), _) => None,
    };
    shared.residency.refresh(&shared.backend, true)?;
    let advertised = models
        .clone()
        .unwrap_or_else(|| shared.models.lock().clone());
    shared.residency.describe(&shared.backend, &advertised)?;
    Ok(models)
}

/// The start-up probe, before the first connection to the server.
pub fn probe_at_start(shared: &Shared) {
    match probe(shared) {
        Ok(models) => backend_answered(shared, models),
        Err(e) => backend_failed(shared, &e),
    }
}

/// The prober thread: idle while the backend is up, probing with backoff while it is
/// down. Returns when the worker drains.
pub fn run_prober(shared: &Shared) {
    while wait_until_down(shared) {
        if !probe_until_up(shared) {
            return;
        }
    }
}

/// Blocks until the backend is down (true) or the worker drains (false).
fn wait_until_down(shared: &Shared) -> bool {
    loop {
        if shared.is_draining() {
            return false;
        }
        if shared.health.is_down() {
            return true;
        }
        crossbeam_channel::select! {
            recv(shared.health.kick_rx) -> _ => {}
            recv(shared.drain_wait) -> _ => {}
        }
    }
}

/// Probes until the backend answers (true) or the worker drains (false).
fn probe_until_up(shared: &Shared) -> bool {
    let mut backoff = Backoff::new(shared.health.max_backoff);
    loop {
        if shared.wait_for_drain(backoff.next_delay()) {
            return false;
        }
        match probe(shared) {
            Ok(models) => {
                backend_answered(shared, models);
                return true;
            }
            Err(e) => debug!("backend probe failed: {e}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn secs(n: u64) -> Duration {
        Duration::from_secs(n)
    }

    fn view<'a>(models: &'a [String], down: Option<&'a str>) -> View<'a> {
        View {
            models,
            down_reason: down,
            draining: false,
            current_load: 0,
            loaded: None,
            info: None,
        }
    }

    #[test]
    fn transitions_happen_once_and_measure_the_downtime() {
        let h = Health::new(secs(10));
        let t0 = Instant::now();
        assert!(!h.is_down());
        assert_eq!(h.mark_up(t0), None, "already up");
        assert!(h.mark_down("refused", t0));
        assert!(!h.mark_down("reset", t0 + secs(1)), "already down");
        assert!(h.is_down());
        assert_eq!(h.down_reason().as_deref(), Some("refused"));
        assert!(h.kick_rx.try_recv().is_ok(), "the prober is woken");
        assert_eq!(h.mark_up(t0 + secs(7)), Some(secs(7)));
        assert!(!h.is_down());
        assert_eq!(h.down_reason(), None);
    }

    #[test]
    fn backoff_doubles_from_one_second_up_to_the_maximum() {
        let mut b = Backoff::new(secs(10));
        let delays: Vec<u64> = (0..6).map(|_| b.next_delay().as_secs()).collect();
        assert_eq!(delays, vec![1, 2, 4, 8, 10, 10]);
        let mut short = Backoff::new(Duration::from_millis(500));
        assert_eq!(short.next_delay(), Duration::from_millis(500));
        assert_eq!(short.next_delay(), Duration::from_millis(500));
    }

    #[test]
    fn a_server_with_backend_health_gets_backend_status_and_keeps_the_models() {
        let models = vec!["m".to_string()];
        let mut told = Told::registered(models.clone(), None, None);
        let down = plan(&mut told, &view(&models, Some("refused")), true, false);
        assert_eq!(
            down,
            vec![WorkerMessage::BackendStatus {
                state: BackendState::Down,
                reason: Some("refused".into())
            }]
        );
        assert!(plan(&mut told, &view(&models, Some("refused")), true, false).is_empty());
        let up = plan(&mut told, &view(&models, None), true, false);
        assert_eq!(
            up,
            vec![WorkerMessage::BackendStatus {
                state: BackendState::Up,
                reason: None
            }]
        );
    }

    #[test]
    fn an_original_server_sees_an_empty_list_then_the_real_one() {
        let models = vec!["m".to_string()];
        let mut told = Told::registered(models.clone(), None, None);
        let update = |models: &[&str]| WorkerMessage::ModelsUpdate {
            models: models.iter().map(|m| m.to_string()).collect(),
            current_load: 0,
            loaded_models: None,
            model_info: None,
        };
        let down = plan(&mut told, &view(&models, Some("refused")), false, false);
        assert_eq!(down, vec![update(&[])]);
        // A refresh the server asks for while down must not re-advertise the models.
        let asked = plan(&mut told, &view(&models, Some("refused")), false, true);
        assert_eq!(asked, vec![update(&[])]);
        let up = plan(&mut told, &view(&models, None), false, false);
        assert_eq!(up, vec![update(&["m"])]);
    }

    #[test]
    fn registered_while_down_the_models_follow_the_down_status() {
        // A worker registers an empty list while down (it does not know the server yet).
        let models = vec!["m".to_string()];
        let mut told = Told::registered(Vec::new(), None, None);
        let msgs = plan(&mut told, &view(&models, Some("refused")), true, false);
        assert!(matches!(
            msgs.as_slice(),
            [
                WorkerMessage::BackendStatus {
                    state: BackendState::Down,
                    ..
                },
                WorkerMessage::ModelsUpdate { .. }
            ]
        ));
        let mut told = Told::registered(Vec::new(), None, None);
        assert!(plan(&mut told, &view(&models, Some("refused")), false, false).is_empty());
    }

    #[test]
    fn loaded_models_are_sent_when_they_change_and_only_then() {
        let models = vec!["a".to_string(), "b".to_string()];
        let update = |loaded: Option<&[&str]>| WorkerMessage::ModelsUpdate {
            models: models.clone(),
            current_load: 0,
            loaded_models: loaded.map(|l| l.iter().map(|m| m.to_string()).collect()),
            model_info: None,
        };
        let mut told = Told::registered(models.clone(), Some(vec!["a".into()]), None);
        let mut v = view(&models, None);
        let a = vec!["a".to_string()];
        v.loaded = Some(&a);
        assert!(
            plan(&mut told, &v, true, false).is_empty(),
            "nothing changed"
        );
        let b = vec!["b".to_string()];
        v.loaded = Some(&b);
        assert_eq!(plan(&mut told, &v, true, false), vec![update(Some(&["b"]))]);
        assert!(plan(&mut told, &v, true, false).is_empty(), "told once");
        // Asked for: the current set travels with the list.
        assert_eq!(plan(&mut told, &v, true, true), vec![update(Some(&["b"]))]);
        // Only advertised models count.
        let c = vec!["b".to_string(), "c".to_string()];
        v.loaded = Some(&c);
        assert!(plan(&mut told, &v, true, false).is_empty());
        // Unknown after known: "none loaded", once.
        v.loaded = None;
        assert_eq!(plan(&mut told, &v, true, false), vec![update(Some(&[]))]);
        assert!(plan(&mut told, &v, true, false).is_empty());
        // Never known: the field stays out.
        let mut told = Told::registered(Vec::new(), None, None);
        assert_eq!(plan(&mut told, &v, true, false), vec![update(None)]);
    }

    #[test]
    fn model_info_is_sent_when_it_changes_and_only_then() {
        use crate::protocol::ModelInfo;
        let models = vec!["a".to_string(), "b".to_string()];
        let described = |ctx: u64| {
            ModelInfoMap::from([
                (
                    "a".to_string(),
                    ModelInfo {
                        context_length: Some(ctx),
                        capabilities: vec!["completion".into()],
                    },
                ),
                ("gone".to_string(), ModelInfo::default()),
            ])
        };
        let only_a = |ctx: u64| {
            let mut m = described(ctx);
            m.remove("gone");
            m
        };
        let info_of = |msgs: &[WorkerMessage]| match msgs {
            [WorkerMessage::ModelsUpdate { model_info, .. }] => model_info.clone(),
            other => panic!("expected one models_update, got {other:?}"),
        };
        let mut told = Told::registered(models.clone(), None, Some(only_a(4096)));
        let mut v = view(&models, None);
        let same = described(4096);
        v.info = Some(&same);
        assert!(
            plan(&mut told, &v, true, false).is_empty(),
            "unchanged (what is not advertised does not count)"
        );
        let bigger = described(8192);
        v.info = Some(&bigger);
        assert_eq!(
            info_of(&plan(&mut told, &v, true, false)),
            Some(only_a(8192))
        );
        assert!(plan(&mut told, &v, true, false).is_empty(), "told once");
        // A models_update for another reason leaves it out (unchanged).
        let fewer = vec!["a".to_string()];
        v.models = &fewer;
        assert_eq!(info_of(&plan(&mut told, &v, true, false)), None);
        // Asked for: it travels.
        assert_eq!(
            info_of(&plan(&mut told, &v, true, true)),
            Some(only_a(8192))
        );
        // Unknown after known: empty, once.
        v.info = None;
        assert_eq!(
            info_of(&plan(&mut told, &v, true, false)),
            Some(ModelInfoMap::new())
        );
        assert!(plan(&mut told, &v, true, false).is_empty());
    }

    #[test]
    fn a_draining_worker_sends_no_model_list() {
        let models = vec!["m".to_string()];
        let mut told = Told::registered(Vec::new(), None, None);
        let mut v = view(&models, None);
        v.draining = true;
        assert!(plan(&mut told, &v, false, true).is_empty());
        v.down_reason = Some("refused");
        assert_eq!(plan(&mut told, &v, true, false).len(), 1, "status only");
    }
}
