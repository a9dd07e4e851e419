//! Sleeping boxes: which workers are asleep with which models, which one is being
//! woken, and when a wake is given up. Policy only: the magic packet itself is sent by
//! an awake worker (`wake_peer`) or by the runtime ([`Action::SendWake`]), and the
//! list is saved by the runtime (`server/power.rs`) whenever [`Sleepers::version`]
//! moves.
//!
//! A worker that registered with a `wake` address is remembered as asleep when it
//! leaves (unless the operator drained it away). A request for a model that only
//! sleeping boxes serve wakes one of them (or, with `WAKE_WHEN_BUSY`, when every awake
//! worker of the model is full and more than `WAKE_QUEUE_DEPTH` wait for it); it waits
//! up to `WAKE_TIMEOUT_SECS` and is dispatched the moment the box registers again. One
//! wake per box at a time; a box that does not come back fails the requests waiting
//! for it with an error naming it.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use log::{info, warn};
use serde::{Deserialize, Serialize};

use super::{Action, ClientEvent, Dispatcher, Failure, RequestId, Stage, Timer, WorkerId};
use crate::power::WakeAddress;
use crate::protocol::power::FEATURE_WAKE_PEERS;
use crate::protocol::ServerMessage;

/// Most boxes remembered asleep (the oldest is forgotten beyond it).
const MAX_SLEEPERS: usize = 256;

/// A sleeping box as saved in `STATE_DIR/sleepers.json`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SleeperRecord {
    pub name: String,
    pub models: Vec<String>,
    pub wake: WakeAddress,
    /// When it went to sleep (Unix seconds).
    pub since_unix: u64,
    /// Seconds it spent asleep before this sleep: the energy saved adds up over sleeps.
    #[serde(default)]
    pub slept_secs: u64,
}

/// What `STATE_DIR/sleepers.json` keeps, so a relay restart forgets nothing the
/// operator sees: the sleeping boxes, the earlier sleep time of boxes awake now (their
/// energy saved so far) and the workers pinned awake (by name).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SavedPower {
    pub boxes: Vec<SleeperRecord>,
    pub slept_secs: BTreeMap<String, u64>,
    pub pinned: Vec<String>,
}

/// A wake under way.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Waking {
    /// Numbers the wake's timer.
    pub seq: u64,
    pub started: Instant,
    pub deadline: Instant,
    /// When the wake started (Unix seconds), for `/admin/workers`.
    pub since_unix: u64,
}

/// One sleeping box.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sleeper {
    pub record: SleeperRecord,
    pub waking: Option<Waking>,
}

/// The sleeping boxes by worker name.
#[derive(Debug, Default)]
pub struct Sleepers {
    boxes: BTreeMap<String, Sleeper>,
    /// Boxes awake now: the seconds they spent asleep so far.
    slept: BTreeMap<String, u64>,
    /// Worker names the operator pinned awake: the pin outlives a reconnect (the
    /// connection's worker id does not).
    pinned: BTreeSet<String>,
    /// Bumped whenever the saved state changes.
    version: u64,
}

impl Sleepers {
    pub fn version(&self) -> u64 {
        self.version
    }

    pub fn iter(&self) -> impl Iterator<Item = &Sleeper> {
        self.boxes.values()
    }

    /// Every sleeping box, waking or not.
    pub fn records(&self) -> Vec<SleeperRecord> {
        self.boxes.values().map(|s| s.record.clone()).collect()
    }

    /// What is saved: the sleeping boxes, earlier sleeps and pins.
    pub fn saved(&self) -> SavedPower {
        SavedPower {
            boxes: self.records(),
            slept_secs: self.slept.clone(),
            pinned: self.pinned.iter().cloned().collect(),
        }
    }

    /// Seconds the box `name`, awake now, spent asleep before.
    pub fn slept_secs(&self, name: &str) -> u64 {
        self.slept.get(name).copied().unwrap_or(0)
    }

    pub fn is_pinned(&self, name: &str) -> bool {
        self.pinned.contains(name)
    }

    pub fn restore(&mut self, saved: SavedPower) {
        let SavedPower {
            boxes,
            slept_secs,
            pinned,
        } = saved;
        self.slept = slept_secs.into_iter().take(MAX_SLEEPERS).collect();
        self.pinned = pinned.into_iter().take(MAX_SLEEPERS).collect();
        for record in boxes.into_iter().take(MAX_SLEEPERS) {
            self.boxes.insert(
                record.name.clone(),
                Sleeper {
                    record,
                    waking: None,
                },
            );
        }
    }

    pub fn serves(&self, model: &str) -> bool {
        self.boxes
            .values()
            .any(|s| s.record.models.iter().any(|m| m == model))
    }

    fn insert(&mut self, record: SleeperRecord) {
        if self.boxes.len() >= MAX_SLEEPERS && !self.boxes.contains_key(&record.name) {
            let oldest = self.boxes.values().min_by_key(|s| s.record.since_unix);
            if let Some(name) = oldest.map(|s| s.record.name.clone()) {
                self.boxes.remove(&name);
            }
        }
        self.boxes.insert(
            record.name.clone(),
            Sleeper {
                record,
                waking: None,
            },
        );
        self.version += 1;
    }

    /// Pins `name` awake or unpins it; at most [`MAX_SLEEPERS`] names are kept.
    fn pin(&mut self, name: &str, on: bool) {
        let changed = if on {
            self.pinned.len() < MAX_SLEEPERS && self.pinned.insert(name.to_string())
        } else {
            self.pinned.remove(name)
        };
        if changed {
            self.version += 1;
        }
    }

    /// A box woke after sleeping since `since_unix`: its sleep time so far is kept.
    fn add_sleep(&mut self, name: &str, secs: u64) {
        if self.slept.len() < MAX_SLEEPERS || self.slept.contains_key(name) {
            self.slept.insert(name.to_string(), secs);
        }
    }

    fn remove(&mut self, name: &str) -> Option<Sleeper> {
        let gone = self.boxes.remove(name);
        if gone.is_some() {
            self.version += 1;
        }
        gone
    }

    /// The box being woken for `model`, if any.
    fn waking_for(&self, model: &str) -> Option<&Sleeper> {
        self.boxes
            .values()
            .find(|s| s.waking.is_some() && s.record.models.iter().any(|m| m == model))
    }

    /// A sleeping box for `model` not being woken yet: the one asleep longest.
    fn candidate(&self, model: &str) -> Option<&Sleeper> {
        self.boxes
            .values()
            .filter(|s| s.waking.is_none() && s.record.models.iter().any(|m| m == model))
            .min_by_key(|s| s.record.since_unix)
    }
}

/// Wake settings (`WAKE_*`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WakeConfig {
    /// How long a request waits for a box being woken (`WAKE_TIMEOUT_SECS`).
    pub timeout: Duration,
    /// Wake a box also when every awake worker of the model is full (`WAKE_WHEN_BUSY`).
    pub when_busy: bool,
    /// With `when_busy`: more than this many must wait for the model (`WAKE_QUEUE_DEPTH`).
    pub queue_depth: usize,
    /// The relay sends the magic packet itself (`WAKE_FROM_RELAY`).
    pub from_relay: bool,
}

impl Default for WakeConfig {
    fn default() -> WakeConfig {
        WakeConfig {
            timeout: Duration::from_secs(120),
            when_busy: false,
            queue_depth: 4,
            from_relay: false,
        }
    }
}

impl Dispatcher {
    pub fn sleepers(&self) -> &Sleepers {
        &self.sleepers
    }

    /// Boxes a previous run remembered asleep, earlier sleeps and pins
    /// (`STATE_DIR/sleepers.json`).
    pub fn restore_sleepers(&mut self, saved: SavedPower, now: Instant) {
        let models: Vec<String> = saved.boxes.iter().flat_map(|r| r.models.clone()).collect();
        self.sleepers.restore(saved);
        self.note_models_seen(&models, now);
    }

    /// The models clients may ask for (`/v1/models`): what awake workers serve, then
    /// what only sleeping boxes serve (asking for one wakes its box).
    pub fn listed_models(&self) -> Vec<String> {
        let mut models = self.registry.routable_models();
        let mut seen: BTreeSet<String> = models.iter().cloned().collect();
        for s in self.sleepers.iter() {
            for m in &s.record.models {
                if seen.insert(m.clone()) {
                    models.push(m.clone());
                }
            }
        }
        models
    }

    /// A worker registers: it keeps the operator's pin on its name, and if it is a box
    /// we knew asleep, it is awake now.
    pub(super) fn box_awake(&mut self, worker: &mut super::Worker, now: Instant) {
        let name = worker.name.as_str();
        worker.stay_awake = self.sleepers.is_pinned(name);
        let Some(gone) = self.sleepers.remove(name) else {
            return;
        };
        let now_unix = super::unix_ms().unwrap_or(0) / 1000;
        let asleep = now_unix.saturating_sub(gone.record.since_unix);
        self.sleepers
            .add_sleep(name, gone.record.slept_secs.saturating_add(asleep));
        // `/v1/models` lists the sleeper's models until then.
        self.models_version += 1;
        match gone.waking {
            Some(w) => {
                self.timers.remove(&(w.deadline, Timer::Wake(w.seq)));
                info!(
                    "box `{name}` woke after {} ms",
                    now.saturating_duration_since(w.started).as_millis()
                );
            }
            None => info!("box `{name}` is awake again"),
        }
    }

    /// A worker left: with a wake address (and not drained away by the operator), its
    /// box is remembered asleep with its models.
    pub(super) fn box_asleep(&mut self, w: &super::Worker, operator_drained: bool) {
        let Some(wake) = w.wake.clone() else {
            return;
        };
        if operator_drained || self.phase != super::Phase::Running {
            return;
        }
        info!(
            "box `{}` is asleep; wake address {} via {}",
            w.name, wake.mac, wake.broadcast
        );
        let slept_secs = self.sleepers.slept.remove(&w.name).unwrap_or(0);
        self.sleepers.insert(SleeperRecord {
            name: w.name.clone(),
            models: w.models.clone(),
            wake,
            since_unix: super::unix_ms().unwrap_or(0) / 1000,
            slept_secs,
        });
        self.models_version += 1;
    }

    /// Pins a worker awake (never granted sleep) or unpins it; false when unknown. The
    /// pin belongs to the worker's name: it holds when the worker reconnects.
    pub fn stay_awake(&mut self, worker: WorkerId, on: bool) -> bool {
        let Some(w) = self.registry.get_mut(worker) else {
            return false;
        };
        w.stay_awake = on;
        self.sleepers.pin(&w.name, on);
        info!("worker {} ({}) pinned awake: {on}", w.wire_id, w.name);
        true
    }

    /// The box's owner uses it (capacity 0: requests go elsewhere or wait) or is done
    /// (it takes the queued work it can).
    pub(super) fn owner_status(&mut self, worker: WorkerId, busy: bool, now: Instant) {
        let Some(w) = self.registry.get_mut(worker) else {
            return;
        };
        if busy == w.yielded.is_some() {
            return;
        }
        w.yielded = busy.then_some(now);
        info!(
            "worker {} ({}) {}",
            w.wire_id,
            w.name,
            if busy {
                "yields to its owner: takes nothing new"
            } else {
                "takes work again: its owner is done"
            }
        );
        self.models_version += 1;
        if !busy {
            self.fill_worker(worker, now);
        }
    }

    /// Whether a model is served by a sleeping box (so it is no typo).
    pub(super) fn sleeping_model(&self, model: &str) -> bool {
        self.sleepers.serves(model)
    }

    /// A request just joined the queue: wake a box for it if the policy says so, and
    /// let it wait for the box being woken (also when awake workers serve its model
    /// but are full: with `WAKE_WHEN_BUSY` it waits for the box as much as for them).
    pub(super) fn wake_for(&mut self, id: RequestId, now: Instant) {
        let Some(req) = self.requests.get(&id) else {
            return;
        };
        let model = req.msg.model.clone();
        if !self.sleepers.serves(&model) {
            return;
        }
        let awake = self.registry.iter().any(|w| w.serves(&model));
        if awake && !self.cfg.wake.when_busy {
            return;
        }
        // One wake per model at a time, busy or not.
        if self.sleepers.waking_for(&model).is_none() && (!awake || self.busy(&model)) {
            self.start_wake(&model, now);
        }
        let waking = self.sleepers.waking_for(&model).map(|s| {
            let w = s.waking.as_ref().map(|w| w.deadline);
            (s.record.name.clone(), w)
        });
        if let (Some((name, Some(deadline))), Some(req)) = (waking, self.requests.get_mut(&id)) {
            wait_for_box(req, name, deadline);
        }
    }

    /// Every awake worker of `model` is full and more than `WAKE_QUEUE_DEPTH` wait.
    fn busy(&self, model: &str) -> bool {
        let full = self
            .registry
            .iter()
            .filter(|w| w.serves(model))
            .all(|w| !w.has_free_slot());
        let waiting = self
            .requests
            .values()
            .filter(|r| matches!(r.stage, Stage::Queued) && r.msg.model == model)
            .count();
        full && waiting > self.cfg.wake.queue_depth
    }

    /// Sends the magic packet for a sleeping box of `model` and lets the requests queued
    /// for it wait up to `WAKE_TIMEOUT_SECS`. Nothing when no box can be woken.
    fn start_wake(&mut self, model: &str, now: Instant) {
        let Some(sleeper) = self.sleepers.candidate(model) else {
            return;
        };
        let (name, wake) = (sleeper.record.name.clone(), sleeper.record.wake.clone());
        let sender = if self.cfg.wake.from_relay {
            Some("the relay".to_string())
        } else {
            self.registry
                .iter()
                .find(|w| w.features.iter().any(|f| f == FEATURE_WAKE_PEERS))
                .map(|w| {
                    let msg = ServerMessage::WakePeer {
                        worker_name: name.clone(),
                        mac: wake.mac.clone(),
                        broadcast: wake.broadcast.clone(),
                    };
                    self.actions.push(Action::ToWorker(w.id, msg));
                    format!("worker {} ({})", w.wire_id, w.name)
                })
        };
        let Some(sender) = sender else {
            warn!(
                "box `{name}` serves `{model}` but cannot be woken: no awake worker sends Wake-on-LAN and WAKE_FROM_RELAY is off"
            );
            return;
        };
        if self.cfg.wake.from_relay {
            self.actions.push(Action::SendWake(name.clone(), wake));
        }
        self.next_wake_seq += 1;
        let seq = self.next_wake_seq;
        let deadline = now + self.cfg.wake.timeout;
        info!("waking box `{name}` for `{model}` via {sender}");
        if let Some(s) = self.sleepers.boxes.get_mut(&name) {
            s.waking = Some(Waking {
                seq,
                started: now,
                deadline,
                since_unix: super::unix_ms().unwrap_or(0) / 1000,
            });
        }
        self.timers.insert((deadline, Timer::Wake(seq)));
        let models = self
            .sleepers
            .boxes
            .get(&name)
            .map(|s| s.record.models.clone())
            .unwrap_or_default();
        let registry = &self.registry;
        for req in self.requests.values_mut() {
            // The model woken for waits even when awake workers serve it (they are full:
            // `WAKE_WHEN_BUSY`); the box's other models only when nothing awake serves them.
            let waits =
                req.msg.model == model || !registry.iter().any(|w| w.serves(&req.msg.model));
            if matches!(req.stage, Stage::Queued) && models.contains(&req.msg.model) && waits {
                wait_for_box(req, name.clone(), deadline);
            }
        }
    }

    /// A wake's time is up: the box stays asleep and its waiting requests fail.
    pub(super) fn wake_expired(&mut self, seq: u64, now: Instant) {
        let Some(s) = self
            .sleepers
            .boxes
            .values_mut()
            .find(|s| s.waking.as_ref().is_some_and(|w| w.seq == seq))
        else {
            return;
        };
        s.waking = None;
        let name = s.record.name.clone();
        let secs = self.cfg.wake.timeout.as_secs();
        warn!("box `{name}` did not wake within {secs}s; it stays asleep");
        // Requests that awake (full) workers also serve stop waiting for the box: they
        // meet their own deadline (the same instant) with the usual queue timeout.
        let registry = &self.registry;
        let mut waiting = Vec::new();
        for (id, r) in self.requests.iter_mut() {
            if !matches!(r.stage, Stage::Queued) || r.waking_for.as_deref() != Some(&name) {
                continue;
            }
            if registry.advertises(&r.msg.model) {
                r.waking_for = None;
            } else {
                waiting.push(*id);
            }
        }
        waiting.sort_unstable();
        for id in waiting {
            let Some(req) = self.requests.remove(&id) else {
                continue;
            };
            self.end_hold(id);
            self.queue.remove(id);
            self.unschedule(id, req.timer_at);
            info!(
                "request {} failed: box `{name}` did not wake",
                req.msg.request_id
            );
            self.fail(id, asleep(&name, secs));
        }
        let _ = now;
    }

    /// What a queued request that timed out is told when a sleeping box serves its
    /// model: the box it waited for, or the sleeping box nothing could wake.
    pub(super) fn asleep_failure(&self, id: RequestId, model: &str) -> Option<Failure> {
        // Awake workers serve it (full, with `WAKE_WHEN_BUSY`): a plain queue timeout.
        if self.registry.advertises(model) {
            return None;
        }
        if let Some(name) = self.requests.get(&id)?.waking_for.as_ref() {
            return Some(asleep(name, self.cfg.wake.timeout.as_secs()));
        }
        let s = self.sleepers.candidate(model)?;
        Some(Failure::Asleep {
            worker: s.record.name.clone(),
            detail: "nothing could wake it: no awake worker sends Wake-on-LAN and WAKE_FROM_RELAY is off".into(),
        })
    }

    /// A worker idle long enough asks to suspend. It may when it can be woken, is not
    /// pinned awake, and no request waits for a model only it serves; granted, it
    /// takes nothing new, and its box is remembered asleep when it disconnects.
    pub(super) fn sleep_request(&mut self, worker: WorkerId, now: Instant) {
        let Some(w) = self.registry.get(worker) else {
            return;
        };
        let refusal = if w.wake.is_none() {
            Some("no wake address: the relay could not wake this box".to_string())
        } else if w.stay_awake {
            Some("pinned awake by the operator".to_string())
        } else {
            w.models
                .iter()
                .find(|m| {
                    let waiting = self
                        .requests
                        .values()
                        .any(|r| matches!(r.stage, Stage::Queued) && &r.msg.model == *m);
                    let others = self
                        .registry
                        .iter()
                        .any(|o| o.id != worker && o.serves(m) && !o.is_draining());
                    waiting && !others
                })
                .map(|m| format!("requests are queued for `{m}` and no other worker serves it"))
        };
        let (wire, name) = (w.wire_id.clone(), w.name.clone());
        let granted = refusal.is_none();
        match &refusal {
            Some(why) => info!("worker {wire} ({name}) may not sleep: {why}"),
            None => info!("worker {wire} ({name}) goes to sleep"),
        }
        let answer = ServerMessage::SleepAnswer {
            granted,
            reason: refusal,
        };
        self.actions.push(Action::ToWorker(worker, answer));
        if granted {
            if let Some(w) = self.registry.get_mut(worker) {
                w.drain = super::DrainState::DrainingByWorker;
            }
            self.models_version += 1;
        }
        let _ = now;
    }

    /// A progress note for a request waiting on a box: `Some` while that box wakes.
    pub(super) fn waking_note(&self, id: RequestId) -> Option<ClientEvent> {
        let name = self.requests.get(&id)?.waking_for.as_ref()?;
        let s = self.sleepers.boxes.get(name)?;
        s.waking.as_ref()?;
        Some(ClientEvent::Waking {
            worker: name.clone(),
        })
    }
}

/// The failure of a request whose box did not come back.
pub(super) fn asleep(name: &str, secs: u64) -> Failure {
    Failure::Asleep {
        worker: name.to_string(),
        detail: format!("it was woken but did not come back within {secs}s"),
    }
}

/// Lets a queued request wait for `name` until `deadline` instead of its queue timeout.
fn wait_for_box(req: &mut super::Request, name: String, deadline: Instant) {
    req.waking_for = Some(name);
    if deadline > req.queue_deadline {
        req.queue_deadline = deadline;
        // The request timer re-arms itself when it fires before `deadline`.
        req.deadline = deadline;
    }
}

#[cfg(test)]
mod tests;
