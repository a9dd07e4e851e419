//! The `make bench-affinity` workload on the dispatcher state machine with a fake clock,
//! for choosing `AFFINITY_WAIT_MS` without llama-server's noise: two boxes of two slots,
//! each with an unbounded prompt cache; 8 conversations of 5 turns with 1,128-token
//! system prompts, 35-token questions and 24-token answers; 4 clients, each taking a
//! random idle conversation. A box evaluates `P` prompt tokens/s and decodes `D`
//! tokens/s for one sequence, its one thread shared by the sequences it runs (two
//! batched run 1.6× as fast as one). Prints the mean of 20 seeds for affinity off and
//! on with waits from 0 to 30 s, in milliseconds of computer time.
//!
//! `make bench-affinity-sim` or `cargo run --release --example affinity_sim -- [P D]`
//! (default 150 15, about this 2-core machine's llama-server with Gemma 3 270M).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use modelrelay::protocol::{
    RegisterMessage, RequestMessage, ResponseComplete, ServerMessage, WorkerMessage,
};
use modelrelay::server::dispatcher::{
    parse_request_id, wire_request_id, Action, Config, Dispatcher, Event, Who, WorkerId,
};
use modelrelay::server::fingerprint::Fingerprints;

const CONVERSATIONS: usize = 8;
const TURNS: usize = 5;
const CLIENTS: usize = 4;
const SYSTEM: usize = 1_128;
const QUESTION: usize = 35;
const ANSWER: usize = 24;
const SEEDS: u64 = 20;
const WAITS_MS: [u64; 9] = [0, 500, 1_000, 2_000, 3_000, 5_000, 10_000, 20_000, 30_000];

/// One turn sent by a client.
#[derive(Clone)]
struct Turn {
    client: usize,
    conversation: usize,
    turn: usize,
    sent: Duration,
    latency: Duration,
    evaluated: usize,
    worker: WorkerId,
}

/// A sequence a box is running: seconds of its whole thread still needed.
struct Running {
    id: u64,
    work: f64,
}

#[derive(Default)]
struct Box_ {
    running: Vec<Running>,
    /// Conversation → how many of its tokens the box has cached.
    cache: HashMap<usize, usize>,
}

struct Sim {
    t0: Instant,
    now: Duration,
    dispatcher: Dispatcher,
    boxes: [Box_; 2],
    next_turn: [usize; CONVERSATIONS],
    busy: [bool; CONVERSATIONS],
    rngs: [u64; CLIENTS],
    asked: HashMap<u64, Turn>,
    done: Vec<Turn>,
    next_id: u64,
    speeds: (f64, f64),
}

fn main() {
    let args: Vec<f64> = std::env::args()
        .skip(1)
        .filter_map(|a| a.parse().ok())
        .collect();
    let speeds = (
        args.first().copied().unwrap_or(150.0),
        args.get(1).copied().unwrap_or(15.0),
    );
    println!(
        "prompt {} tok/s, decode {} tok/s; mean of {SEEDS} seeds",
        speeds.0, speeds.1
    );
    println!("| | later turns that moved box | tokens evaluated on later turns | later-turn latency p50 / p95 | wall time | smaller box share |");
    println!("|---|---|---|---|---|---|");
    let phases = std::iter::once(None).chain(WAITS_MS.into_iter().map(Some));
    for wait in phases {
        let runs: Vec<Vec<Turn>> = (1..=SEEDS).map(|s| Sim::run(wait, speeds, s)).collect();
        let mean =
            |f: &dyn Fn(&[Turn]) -> f64| runs.iter().map(|r| f(r)).sum::<f64>() / SEEDS as f64;
        let label = wait.map_or("off".to_string(), |w| format!("on, wait {w} ms"));
        println!(
            "| {label} | {:.1} of 32 | {:.0} | {:.1} s / {:.1} s | {:.1} s | {:.0} % |",
            mean(&|r| moved(r) as f64),
            mean(&|r| later(r).map(|t| t.evaluated as f64).sum()),
            mean(&|r| latency(r, 50)),
            mean(&|r| latency(r, 95)),
            mean(&|r| r
                .iter()
                .map(|t| (t.sent + t.latency).as_secs_f64())
                .fold(0.0, f64::max)),
            mean(&|r| {
                let on_first = r.iter().filter(|t| t.worker == 1).count();
                100.0 * on_first.min(r.len() - on_first) as f64 / r.len() as f64
            }),
        );
    }
}

impl Sim {
    /// One run; `wait`: `None` for affinity off, else `AFFINITY_WAIT_MS`.
    fn run(wait: Option<u64>, speeds: (f64, f64), seed: u64) -> Vec<Turn> {
        let t0 = Instant::now();
        let long = Duration::from_secs(1 << 20);
        let cfg = Config {
            affinity: wait.is_some(),
            affinity_wait: Duration::from_millis(wait.unwrap_or(0)),
            queue_timeout: long,
            request_timeout: long,
            heartbeat_interval: long,
            heartbeat_timeout: long,
            ..Config::default()
        };
        let mut sim = Sim {
            t0,
            now: Duration::ZERO,
            dispatcher: Dispatcher::new(cfg, t0),
            boxes: Default::default(),
            next_turn: [0; CONVERSATIONS],
            busy: [false; CONVERSATIONS],
            rngs: std::array::from_fn(|c| 0x9E37_79B9_7F4A_7C15 ^ (c as u64 + seed * 7919)),
            asked: HashMap::new(),
            done: Vec::new(),
            next_id: 1,
            speeds,
        };
        for id in 1..=2 {
            let register = RegisterMessage {
                worker_name: format!("box-{id}"),
                models: vec!["m".into()],
                max_concurrent: 2,
                protocol_version: Some("1".into()),
                current_load: Some(0),
                features: vec![],
                loaded_models: None,
                backend_kind: None,
                model_info: None,
                wake: None,
                routes: None,
            };
            let remote = "sim".into();
            let joined = Event::WorkerJoined {
                id,
                register,
                remote,
            };
            sim.dispatcher.handle(joined, t0);
        }
        let mut actions = Vec::new();
        for client in 0..CLIENTS {
            actions.extend(sim.submit(client));
        }
        while sim.done.len() < CONVERSATIONS * TURNS {
            sim.start(actions.drain(..));
            actions.extend(sim.step());
        }
        sim.done
    }

    /// The client's next turn: a random idle conversation with turns left.
    fn submit(&mut self, client: usize) -> Vec<Action> {
        let idle: Vec<usize> = (0..CONVERSATIONS)
            .filter(|c| !self.busy[*c] && self.next_turn[*c] < TURNS)
            .collect();
        if idle.is_empty() {
            return Vec::new();
        }
        let r = &mut self.rngs[client];
        *r ^= *r << 13;
        *r ^= *r >> 7;
        *r ^= *r << 17;
        let conversation = idle[(*r % idle.len() as u64) as usize];
        self.busy[conversation] = true;
        let (id, turn) = (self.next_id, self.next_turn[conversation]);
        self.next_id += 1;
        let turn_info = Turn {
            client,
            conversation,
            turn,
            sent: self.now,
            latency: Duration::ZERO,
            evaluated: 0,
            worker: 0,
        };
        self.asked.insert(id, turn_info);
        // One fingerprint per message boundary: system, then question / answer pairs.
        let prints: Vec<u64> = (0..=2 * turn as u64)
            .map(|k| ((conversation as u64) << 32 | k).wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
            .collect();
        let msg = Arc::new(RequestMessage {
            request_id: wire_request_id(id),
            model: "m".into(),
            endpoint_path: "/v1/chat/completions".into(),
            is_streaming: false,
            body: Arc::from("{}"),
            headers: Default::default(),
            body_encoding: None,
            continuation: None,
            held: None,
        });
        let event = Event::Submit {
            id,
            msg,
            who: Who::default(),
            needs: Default::default(),
            prints: Fingerprints::Prefixes(prints.into()),
            progress: false,
            continuable: false,
        };
        self.dispatcher.handle(event, self.t0 + self.now)
    }

    /// Starts the requests the dispatcher sent to boxes.
    fn start(&mut self, actions: impl Iterator<Item = Action>) {
        let (prompt_speed, decode_speed) = self.speeds;
        for action in actions {
            let Action::ToWorker(w, ServerMessage::Request(m)) = action else {
                continue;
            };
            let Some(id) = parse_request_id(&m.request_id) else {
                continue;
            };
            let Some(turn) = self.asked.get_mut(&id) else {
                continue;
            };
            let b = &mut self.boxes[(w - 1) as usize];
            let len = prompt_len(turn.turn);
            let cached = b.cache.get(&turn.conversation).copied().unwrap_or(0);
            turn.evaluated = len - cached.min(len - 1);
            turn.worker = w;
            let work = turn.evaluated as f64 / prompt_speed + ANSWER as f64 / decode_speed;
            b.running.push(Running { id, work });
        }
    }

    /// Runs the boxes to the next completion or dispatcher deadline; what follows.
    fn step(&mut self) -> Vec<Action> {
        let rate = |n: usize| if n >= 2 { 1.6 / n as f64 } else { 1.0 };
        let finish = (self.boxes.iter())
            .flat_map(|b| b.running.iter().map(|r| r.work / rate(b.running.len())))
            .min_by(f64::total_cmp);
        let deadline = (self.dispatcher.next_deadline()).map(|at| {
            at.saturating_duration_since(self.t0 + self.now)
                .as_secs_f64()
        });
        let step = match (finish, deadline) {
            (Some(f), Some(d)) => f.min(d),
            (Some(s), None) | (None, Some(s)) => s,
            (None, None) => panic!("nothing runs and nothing is due"),
        };
        let mut finished = Vec::new();
        for (i, b) in self.boxes.iter_mut().enumerate() {
            let r = rate(b.running.len());
            b.running.iter_mut().for_each(|run| run.work -= step * r);
            finished.extend(
                b.running
                    .iter()
                    .filter(|r| r.work <= 1e-9)
                    .map(|r| (i, r.id)),
            );
            b.running.retain(|r| r.work > 1e-9);
        }
        self.now += Duration::from_secs_f64(step.max(0.0));
        let mut actions = self.dispatcher.tick(self.t0 + self.now);
        for (i, id) in finished {
            let Some(mut turn) = self.asked.remove(&id) else {
                continue;
            };
            let c = turn.conversation;
            let cached = self.boxes[i].cache.entry(c).or_default();
            *cached = (*cached).max(prompt_len(turn.turn) + ANSWER);
            self.next_turn[c] += 1;
            self.busy[c] = false;
            let rc = ResponseComplete {
                request_id: wire_request_id(id),
                status_code: 200,
                ..Default::default()
            };
            let said = Event::WorkerSaid(i as u64 + 1, WorkerMessage::ResponseComplete(rc));
            actions.extend(self.dispatcher.handle(said, self.t0 + self.now));
            turn.latency = self.now - turn.sent;
            let client = turn.client;
            self.done.push(turn);
            actions.extend(self.submit(client));
        }
        // Clients that found every remaining conversation busy try again.
        for client in 0..CLIENTS {
            if !self.asked.values().any(|t| t.client == client) {
                actions.extend(self.submit(client));
            }
        }
        actions
    }
}

fn prompt_len(turn: usize) -> usize {
    SYSTEM + turn * (QUESTION + ANSWER) + QUESTION
}

fn later(turns: &[Turn]) -> impl Iterator<Item = &Turn> {
    turns.iter().filter(|t| t.turn > 0)
}

fn moved(turns: &[Turn]) -> usize {
    let at: HashMap<(usize, usize), WorkerId> = (turns.iter())
        .map(|t| ((t.conversation, t.turn), t.worker))
        .collect();
    later(turns)
        .filter(|t| at.get(&(t.conversation, t.turn - 1)) != Some(&t.worker))
        .count()
}

fn latency(turns: &[Turn], pct: usize) -> f64 {
    let mut l: Vec<f64> = later(turns).map(|t| t.latency.as_secs_f64()).collect();
    l.sort_by(f64::total_cmp);
    l[(l.len() * pct / 100).min(l.len() - 1)]
}
