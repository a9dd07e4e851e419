//! The dispatcher thread: receives [`Input`]s from the socket threads, feeds them to the
//! [`Dispatcher`] state machine with the real clock, and carries out its actions by
//! sending on the right channel. It sleeps until the next event or the nearest deadline;
//! there is no polling interval.

use std::sync::Arc;
use std::time::Instant;

use crossbeam_channel::{Receiver, RecvTimeoutError, Sender};
use log::debug;

use super::ids::IdMap;
use super::lifecycle::{OpRefusal, OperationRequest, TaskView};
use super::reply::{self, Reply};
use super::{
    Action, ClientEvent, Counters, Dispatcher, Event, Gauges, Health, LiveLoad, RequestId, Who,
    WorkerId,
};
use crate::protocol::{RegisterMessage, RequestMessage, ServerMessage};
use crate::server::shared::Shared;
use crate::server::worker_link::{self, WorkerLink};
use crate::ws::close_code;

/// Inputs from the socket threads: an [`Event`] plus the channels that go with it.
#[derive(Debug)]
pub enum Input {
    Submit {
        id: RequestId,
        msg: Arc<RequestMessage>,
        who: Who,
        needs: super::Needs,
        /// Prompt-prefix fingerprints for cache affinity (`server/fingerprint.rs`).
        prints: crate::server::fingerprint::Fingerprints,
        progress: bool,
        /// See [`Event::Submit`].
        continuable: bool,
        /// The request's events go here: a channel, or an answerer on this thread.
        reply: Reply,
    },
    WorkerJoined {
        id: WorkerId,
        register: RegisterMessage,
        remote: String,
        link: Arc<WorkerLink>,
    },
    /// A resume of a stream held on a worker (see [`Event::Attach`]).
    Attach {
        id: RequestId,
        msg: crate::protocol::held::Attach,
        reply: Sender<ClientEvent>,
    },
    Event(Event),
    /// An operator question, answered by the dispatcher thread from its own state.
    Query(Query, Sender<Answer>),
}

/// Admin questions.
#[derive(Debug)]
pub enum Query {
    Workers,
    Stats,
    Drain {
        worker: WorkerId,
        timeout: Option<std::time::Duration>,
    },
    RefreshModels,
    /// In flight per worker and model (the usage stream).
    LiveLoad,
    /// Start a model operation; it fails on its own after the timeout.
    StartOperation(OperationRequest, std::time::Duration),
    /// A model operation by task id.
    Task(String),
    /// The sleeping boxes (`/admin/workers`).
    Sleepers,
    /// Pin a worker awake (it is never granted sleep), or unpin it.
    StayAwake {
        worker: WorkerId,
        on: bool,
    },
}

/// Answers to [`Query`].
#[derive(Debug)]
pub enum Answer {
    Workers(Vec<WorkerInfo>),
    Stats(Box<StatsSnapshot>),
    /// Whether the operation found its target.
    Done(bool),
    LiveLoad(Box<LiveLoad>),
    Operation(Result<TaskView, OpRefusal>),
    Task(Option<TaskView>),
    Sleepers(Vec<SleeperInfo>),
}

/// A sleeping box as `/admin/workers` shows it.
#[derive(Debug, Clone, serde::Serialize)]
pub struct SleeperInfo {
    pub name: String,
    pub models: Vec<String>,
    /// `asleep` or `waking`.
    pub power: &'static str,
    /// Since when it sleeps (Unix seconds).
    pub asleep_since_unix: u64,
    /// Since when it is being woken.
    pub waking_since_unix: Option<u64>,
    /// Seconds asleep in its earlier sleeps (the energy saved adds them up).
    pub slept_secs: u64,
    pub wake_mac: String,
    pub wake_broadcast: String,
}

/// Asks the dispatcher thread `query` and waits for its answer (at most 5 s); `None`
/// when it has stopped.
pub fn ask(inputs: &Sender<Input>, query: Query) -> Option<Answer> {
    let (tx, rx) = crossbeam_channel::bounded(1);
    inputs.send(Input::Query(query, tx)).ok()?;
    rx.recv_timeout(std::time::Duration::from_secs(5)).ok()
}

/// One worker as `/admin/workers` shows it.
#[derive(Debug, Clone, serde::Serialize)]
pub struct WorkerInfo {
    pub id: String,
    pub name: String,
    pub models: Vec<String>,
    pub max_concurrent: u32,
    pub in_flight: usize,
    pub reported_load: u32,
    pub draining: bool,
    pub connected_since_unix: u64,
    pub last_heartbeat_unix: u64,
    pub remote_addr: String,
    pub protocol_version: Option<String>,
    /// Protocol extensions the worker announced.
    pub features: Vec<String>,
    /// `up`, `down` (its backend, as the worker reports) or `ejected` (failing).
    pub backend_state: &'static str,
    /// Since when it is down or ejected.
    pub backend_since_unix: Option<u64>,
    pub backend_reason: Option<String>,
    /// Failed answers in a row (5xx or transport), for outlier ejection.
    pub consecutive_failures: u32,
    /// Which of `models` its backend holds in memory, as the worker reports it (`null`:
    /// not reported).
    pub loaded_models: Option<Vec<String>>,
    /// What its backend is (`ollama`, `llama-server`, `vllm`, `openai`), when reported.
    pub backend_kind: Option<String>,
    /// What its backend says about its models (context length, capabilities), when
    /// reported.
    pub model_info: Option<crate::protocol::ModelInfoMap>,
    /// Its backend's version, when reported (`worker_status`).
    pub backend_version: Option<String>,
    /// Its backend's and machine's resources, when reported (`worker_status`).
    pub resources: Option<crate::protocol::lifecycle::Resources>,
    /// Models it is loading now: (model, progress 0–1, seconds left).
    pub loading: Vec<(String, f64, Option<u64>)>,
    /// Prompt-prefix fingerprints remembered for it (cache affinity; at most
    /// 2,048).
    pub affinity_fingerprints: usize,
    /// `awake`, or `yielded` while its box's owner uses it (sleeping boxes are listed
    /// apart, see [`SleeperInfo`]).
    pub power: &'static str,
    /// Since when it is yielded.
    pub power_since_unix: Option<u64>,
    /// Whether it said where it is woken (`register.wake`).
    pub wakeable: bool,
    /// Pinned awake by the operator: never granted sleep.
    pub stay_awake: bool,
    /// Seconds its box spent asleep in earlier sleeps.
    pub slept_secs: u64,
    /// The relays it reports being registered with (empty: not reported).
    pub relays: Vec<String>,
}

/// Dispatcher-side figures for `/metrics` and `/admin/stats`.
#[derive(Debug, Clone)]
pub struct StatsSnapshot {
    pub counters: Counters,
    pub gauges: Gauges,
    pub slots_total: u64,
    pub slots_used: u64,
    /// Tenant → (queued, in flight), for tenants with either.
    pub tenants: std::collections::BTreeMap<String, (usize, usize)>,
    /// Workers by backend state (`up`, `down`, `ejected`).
    pub workers_by_state: [(&'static str, usize); 3],
}

/// Most inputs handled before their actions are carried out.
const BATCH: usize = 32;

/// Runs the dispatcher until it reports that shutdown is complete (or every input
/// sender is gone).
pub fn run(
    mut core: Dispatcher,
    inputs: Receiver<Input>,
    shared: Arc<Shared>,
    sleepers: crate::server::power::SleeperStore,
) {
    let mut sleepers_version = core.sleepers().version();
    let mut clients: IdMap<Reply> = IdMap::default();
    let mut workers = Links::default();
    let mut models_version = u64::MAX;
    // One buffer for every batch's actions (emptied as they are carried out).
    let mut actions = Vec::new();
    loop {
        let received = match core.next_deadline() {
            Some(at) => inputs.recv_deadline(at),
            None => inputs.recv().map_err(|_| RecvTimeoutError::Disconnected),
        };
        let now = Instant::now();
        let first = match received {
            Ok(input) => Some(input),
            Err(RecvTimeoutError::Timeout) => None,
            Err(RecvTimeoutError::Disconnected) => return,
        };
        // Inputs that arrived meanwhile are handled before any action goes out: a
        // burst's messages then reach each socket writer together (one write) and
        // the gauges are published once.
        let waiting = std::iter::from_fn(|| inputs.try_recv().ok()).take(BATCH - 1);
        for input in first.into_iter().chain(waiting) {
            take(
                &mut core,
                input,
                &mut clients,
                &mut workers,
                now,
                &mut actions,
            );
        }
        if core.next_deadline().is_some_and(|at| at <= now) {
            core.tick_into(now, &mut actions);
        }
        let exit = execute(&mut actions, &mut clients, &mut workers, &core, now);
        super::shrink_after_burst(&mut actions);
        shared.publish(&core.gauges());
        if core.models_version() != models_version {
            models_version = core.models_version();
            shared.set_models(core.listed_models());
            shared.set_loaded(core.registry().loaded_models());
            shared.set_model_info(core.registry().model_info());
        }
        if core.sleepers().version() != sleepers_version {
            sleepers_version = core.sleepers().version();
            if let Err(e) = sleepers.save(core.sleepers().saved()) {
                log::warn!("{e}");
            }
        }
        if exit {
            return;
        }
    }
}

/// Handles one input: a query is answered at once, anything else becomes an event.
fn take(
    core: &mut Dispatcher,
    input: Input,
    clients: &mut IdMap<Reply>,
    workers: &mut Links,
    now: Instant,
    actions: &mut Vec<Action>,
) {
    match input {
        Input::Query(query, reply) => {
            let (answer, mut more) = answer(core, query, now);
            let _ = reply.send(answer);
            actions.append(&mut more);
        }
        input => {
            let event = route_input(input, clients, workers);
            core.handle_into(event, now, actions);
        }
    }
}

fn route_input(input: Input, clients: &mut IdMap<Reply>, workers: &mut Links) -> Event {
    match input {
        Input::Submit {
            id,
            msg,
            who,
            needs,
            prints,
            progress,
            continuable,
            reply,
        } => {
            clients.insert(id, reply);
            Event::Submit {
                id,
                msg,
                who,
                needs,
                prints,
                progress,
                continuable,
            }
        }
        Input::Attach { id, msg, reply } => {
            clients.insert(id, reply.into());
            Event::Attach { id, msg }
        }
        Input::WorkerJoined {
            id,
            register,
            remote,
            link,
        } => {
            workers.insert(id, link);
            Event::WorkerJoined {
                id,
                register,
                remote,
            }
        }
        Input::Event(event) => {
            if let Event::WorkerLeft { id, .. } = &event {
                if let Some(link) = workers.remove(id) {
                    reply::take_back_all(clients, &link);
                    link.going_away();
                }
            }
            event
        }
        Input::Query(..) => unreachable!("queries are answered before routing"),
    }
}

fn answer(core: &mut Dispatcher, query: Query, now: Instant) -> (Answer, Vec<Action>) {
    match query {
        Query::Workers => (Answer::Workers(worker_infos(core, now)), Vec::new()),
        Query::Stats => {
            let (total, used) = core.registry().iter().fold((0u64, 0u64), |(t, u), w| {
                (
                    t + u64::from(w.max_concurrent),
                    u + w.in_flight.len() as u64,
                )
            });
            let snapshot = StatsSnapshot {
                counters: core.counters().clone(),
                gauges: core.gauges(),
                slots_total: total,
                slots_used: used,
                tenants: core.tenant_loads(),
                workers_by_state: ["up", "down", "ejected"].map(|state| {
                    let n = core.registry().iter().filter(|w| w.health.label() == state);
                    (state, n.count())
                }),
            };
            (Answer::Stats(Box::new(snapshot)), Vec::new())
        }
        Query::Drain { worker, timeout } => {
            if core.registry().get(worker).is_none() {
                return (Answer::Done(false), Vec::new());
            }
            let actions = core.handle(
                Event::DrainWorker {
                    id: worker,
                    timeout,
                },
                now,
            );
            (Answer::Done(true), actions)
        }
        Query::LiveLoad => (Answer::LiveLoad(Box::new(core.live_load())), Vec::new()),
        Query::StartOperation(req, timeout) => {
            let started = core.start_operation(req, timeout, now);
            (Answer::Operation(started), core.tick(now))
        }
        Query::Task(id) => (Answer::Task(core.task(&id, now)), Vec::new()),
        Query::Sleepers => (Answer::Sleepers(sleeper_infos(core)), Vec::new()),
        Query::StayAwake { worker, on } => (Answer::Done(core.stay_awake(worker, on)), Vec::new()),
        Query::RefreshModels => {
            let any = !core.registry().is_empty();
            (Answer::Done(any), core.handle(Event::RefreshModels, now))
        }
    }
}

fn worker_infos(core: &Dispatcher, now: Instant) -> Vec<WorkerInfo> {
    // Subtract before rounding to seconds: rounding both first made the same instant
    // come out a second apart from one call to the next (the dashboard saw every
    // worker "change" at every snapshot).
    let now_unix = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    let unix = |at: Instant| {
        now_unix
            .saturating_sub(now.saturating_duration_since(at))
            .as_secs()
    };
    let loading = core.loading(now);
    core.registry()
        .iter()
        .map(|w| WorkerInfo {
            id: w.wire_id.clone(),
            name: w.name.clone(),
            models: w.models.clone(),
            max_concurrent: w.max_concurrent,
            in_flight: w.in_flight.len(),
            reported_load: w.reported_load,
            draining: w.is_draining(),
            connected_since_unix: unix(w.connected_at),
            last_heartbeat_unix: unix(w.last_seen),
            remote_addr: w.remote.clone(),
            protocol_version: w.protocol_version.clone(),
            features: w.features.clone(),
            backend_state: w.health.label(),
            backend_since_unix: w.health.since().map(unix),
            backend_reason: match &w.health {
                Health::Down { reason, .. } => Some(reason.clone()),
                Health::Ejected { until, .. } => Some(format!(
                    "ejected for failing; back in {}s",
                    until.saturating_duration_since(now).as_secs()
                )),
                Health::Up => None,
            },
            consecutive_failures: w.record.consecutive_failures,
            loaded_models: w.loaded_models(),
            backend_kind: w.backend_kind.clone(),
            model_info: w.model_info(),
            relays: w.relays.clone(),
            backend_version: w.status.backend_version.clone(),
            resources: w.status.resources.clone(),
            loading: loading
                .iter()
                .filter(|(id, ..)| *id == w.id)
                .map(|(_, model, progress, eta)| (model.clone(), *progress, *eta))
                .collect(),
            affinity_fingerprints: core.fingerprints_held(w.id),
            power: if w.yielded.is_some() {
                "yielded"
            } else {
                "awake"
            },
            power_since_unix: w.yielded.map(unix),
            wakeable: w.wake.is_some(),
            stay_awake: w.stay_awake,
            slept_secs: core.sleepers().slept_secs(&w.name),
        })
        .collect()
}

fn sleeper_infos(core: &Dispatcher) -> Vec<SleeperInfo> {
    core.sleepers()
        .iter()
        .map(|s| SleeperInfo {
            name: s.record.name.clone(),
            models: s.record.models.clone(),
            power: if s.waking.is_some() {
                "waking"
            } else {
                "asleep"
            },
            asleep_since_unix: s.record.since_unix,
            waking_since_unix: s.waking.as_ref().map(|w| w.since_unix),
            slept_secs: s.record.slept_secs,
            wake_mac: s.record.wake.mac.clone(),
            wake_broadcast: s.record.wake.broadcast.clone(),
        })
        .collect()
}

/// The worker sockets' sending halves. Dropping it (the dispatcher stops) closes them.
#[derive(Default)]
struct Links(IdMap<Arc<WorkerLink>>);

impl std::ops::Deref for Links {
    type Target = IdMap<Arc<WorkerLink>>;
    fn deref(&self) -> &Self::Target {
        &self.0
    }
}

impl std::ops::DerefMut for Links {
    fn deref_mut(&mut self) -> &mut Self::Target {
        &mut self.0
    }
}

impl Drop for Links {
    fn drop(&mut self) {
        for link in self.0.values() {
            link.going_away();
        }
    }
}

/// Carries out actions; returns true when the process should exit. The messages for a
/// worker are framed into one buffer and sent together once the batch is done (or before
/// its socket is closed), so a burst costs one `send` per socket.
fn execute(
    actions: &mut Vec<Action>,
    clients: &mut IdMap<Reply>,
    workers: &mut Links,
    core: &Dispatcher,
    now: Instant,
) -> bool {
    let mut exit = false;
    let mut frames: Vec<(WorkerId, Vec<u8>)> = Vec::new();
    for action in actions.drain(..) {
        match action {
            Action::ToWorker(id, msg) => {
                let Some(raw_bodies) = workers.get(&id).map(|link| link.raw_bodies) else {
                    // The socket is going away; its WorkerLeft event is on its way to us.
                    continue;
                };
                if let ServerMessage::Request(req) = &msg {
                    let name = core.registry().get(id).map_or("", |w| w.name.as_str());
                    reply::lend(clients, workers, id, &req.request_id, (name, now));
                }
                let at = match frames.iter().position(|(w, _)| *w == id) {
                    Some(at) => at,
                    None => {
                        frames.push((id, Vec::new()));
                        frames.len() - 1
                    }
                };
                worker_link::push_message(&mut frames[at].1, &msg, raw_bodies);
            }
            Action::CloseWorker(id, reason) => {
                if let Some(at) = frames.iter().position(|(w, _)| *w == id) {
                    let (_, bytes) = frames.swap_remove(at);
                    if let Some(link) = workers.get(&id) {
                        link.send_frames(bytes);
                    }
                }
                if let Some(link) = workers.remove(&id) {
                    reply::take_back_all(clients, &link);
                    link.close(close_code_for(&reason), reason);
                }
            }
            Action::ToClient(id, event) => {
                let delivered = if !reply::take_back(clients, workers, id) {
                    // A worker socket's reader wrote the answer already.
                    if event.is_final() {
                        clients.remove(&id);
                    }
                    continue;
                } else if event.is_final() {
                    clients.remove(&id).map(|mut reply| reply.send(event))
                } else {
                    clients.get_mut(&id).map(|reply| reply.send(event))
                };
                if delivered != Some(true) {
                    debug!("client of request {id} is gone; event dropped");
                }
            }
            Action::SendWake(name, wake) => crate::server::power::send_wake(&name, &wake),
            Action::Exit => exit = true,
        }
    }
    for (id, bytes) in frames {
        if let Some(link) = workers.get(&id) {
            link.send_frames(bytes);
        }
    }
    exit
}

fn close_code_for(reason: &str) -> u16 {
    if reason.contains("protocol") {
        close_code::PROTOCOL
    } else if reason == "drained" {
        close_code::NORMAL
    } else {
        close_code::GOING_AWAY
    }
}
