//! Cache affinity against real llama-servers (issue 18): `make bench-affinity`.
//!
//! Two llama-servers (Gemma 3 270M, 2 slots each, one thread each) behind two
//! `modelrelay-worker`s and one `modelrelay-server`; 8 conversations of 5 turns, each
//! opening with its own ~1,100-token system prompt; 4 clients, each taking a random idle
//! conversation for its next turn (same seed in every phase). Each phase starts every
//! process afresh, so no cache carries over. Reported per phase: later turns (2–5) that
//! moved to another box than their previous turn, the prompt tokens llama-server
//! evaluated for them (`timings.prompt_n`), their latency p50 / p95, the wall time and
//! each box's share of the 40 requests; for affinity phases also the relay's counters.
//!
//! Needs `llama-server` and `gemma3.gguf` in `~/.cache/modelrelay` (or
//! `MODELRELAY_CACHE`): `contrib/ci/setup-real-backend.sh` builds and fetches them.
//! `AFFINITY_BENCH_PHASES` (default `off,on`) lists the phases: `off`, `on` (the
//! server's default `AFFINITY_WAIT_MS`) or `on@<ms>`. `LLAMA_THREADS` (default 1) sets
//! each llama-server's threads.

#[path = "support/process.rs"]
mod process;

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};
use process::{free_addr, Process};
use serde_json::{json, Value};

const CONVERSATIONS: usize = 8;
const TURNS: usize = 5;
const CLIENTS: usize = 4;
const SLOTS: usize = 2;
const SYSTEM_WORDS: usize = 1_080;
const MAX_TOKENS: u64 = 24;
const SECRET: &str = "affinity-bench";
const WORDS: &[&str] = &[
    "river", "stone", "lamp", "garden", "winter", "copper", "signal", "harbor", "meadow", "engine",
    "pepper", "violet", "orbit", "canyon", "lantern", "ribbon", "falcon", "marble", "thunder",
    "pillow", "cedar", "glacier", "saddle", "quartz", "biscuit", "anchor", "velvet", "tundra",
    "mosaic", "walnut", "comet", "prairie",
];

#[derive(Clone, Debug)]
struct Phase {
    label: String,
    affinity: bool,
    wait_ms: Option<u64>,
}

/// One answered turn.
#[derive(Clone, Debug)]
struct Turn {
    conversation: usize,
    turn: usize,
    latency: Duration,
    evaluated: u64,
    reused: u64,
    answered: u64,
    /// llama-server's own time for the prompt and for the answer, in ms.
    prompt_ms: f64,
    predicted_ms: f64,
    /// How long the relay kept it before a worker took it.
    queued_ms: u64,
    request_id: String,
    worker: String,
}

struct Outcome {
    phase: Phase,
    turns: Vec<Turn>,
    wall: Duration,
    counters: String,
}

fn main() {
    let cache = std::env::var_os("MODELRELAY_CACHE")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/modelrelay")))
        .expect("HOME or MODELRELAY_CACHE");
    let (llama, model) = (cache.join("llama-server"), cache.join("gemma3.gguf"));
    if !llama.exists() || !model.exists() {
        eprintln!(
            "needs {} and {}: run contrib/ci/setup-real-backend.sh first",
            llama.display(),
            model.display()
        );
        std::process::exit(1);
    }
    let phases = std::env::var("AFFINITY_BENCH_PHASES").unwrap_or_else(|_| "off,on".into());
    let phases: Vec<Phase> = phases.split(',').map(parse_phase).collect();
    let mut outcomes = Vec::new();
    for phase in phases {
        eprintln!("== phase {}", phase.label);
        let outcome = run_phase(&llama, &model, phase);
        report_one(&outcome);
        outcomes.push(outcome);
    }
    println!();
    println!("| | later turns that moved box | tokens evaluated on later turns (new) | later-turn latency p50 / p95 | wall time | box shares |");
    println!("|---|---|---|---|---|---|");
    for o in &outcomes {
        println!("{}", row(o));
    }
    if let Some(off) = outcomes.iter().find(|o| !o.phase.affinity) {
        for on in outcomes.iter().filter(|o| o.phase.affinity) {
            let ratio = |a: f64, b: f64| if b > 0.0 { a / b } else { f64::NAN };
            println!(
                "{} vs off: evaluated tokens {:.2}x, wall time {:.2}x",
                on.phase.label,
                ratio(later_evaluated(on) as f64, later_evaluated(off) as f64),
                ratio(on.wall.as_secs_f64(), off.wall.as_secs_f64()),
            );
        }
    }
}

fn parse_phase(text: &str) -> Phase {
    let text = text.trim();
    match text.split_once('@') {
        _ if text == "off" => Phase {
            label: "off".into(),
            affinity: false,
            wait_ms: None,
        },
        _ if text == "on" => Phase {
            label: "on".into(),
            affinity: true,
            wait_ms: None,
        },
        Some(("on", ms)) => Phase {
            label: format!("on, wait {ms} ms"),
            affinity: true,
            wait_ms: Some(ms.parse().expect("on@<milliseconds>")),
        },
        _ => panic!("phase `{text}`: off, on or on@<ms>"),
    }
}

fn run_phase(llama: &std::path::Path, model: &std::path::Path, phase: Phase) -> Outcome {
    let threads = std::env::var("LLAMA_THREADS").unwrap_or_else(|_| "1".into());
    let backends: Vec<(Process, String)> = (0..2)
        .map(|_| {
            let addr = free_addr();
            let args: Vec<String> = [
                "-m",
                &model.display().to_string(),
                "--alias",
                "gemma3",
                "--host",
                "127.0.0.1",
                "--port",
                &addr.port().to_string(),
                "-np",
                &SLOTS.to_string(),
                "-c",
                "8192",
                "-t",
                &threads,
                "--no-jinja",
                "--chat-template",
                "gemma",
            ]
            .iter()
            .map(|s| s.to_string())
            .collect();
            (
                Process::spawn_program(llama, &args),
                format!("http://{addr}"),
            )
        })
        .collect();
    for (_, url) in &backends {
        wait_for(&format!("{url}/health"), |s| s == 200);
    }
    let relay = free_addr();
    let mut env = vec![
        ("WORKER_SECRET", SECRET.to_string()),
        ("LISTEN_ADDR", relay.to_string()),
        ("QUEUE_TIMEOUT_SECS", "900".into()),
        ("REQUEST_TIMEOUT_SECS", "900".into()),
        ("MAX_QUEUE_PER_TENANT", "100".into()),
        (
            "ROUTING_AFFINITY",
            if phase.affinity { "on" } else { "off" }.into(),
        ),
        ("LOG_LEVEL", "info".into()),
    ];
    if let Some(ms) = phase.wait_ms {
        env.push(("AFFINITY_WAIT_MS", ms.to_string()));
    }
    let server = Process::spawn("modelrelay-server", &env);
    wait_for(&format!("http://{relay}/health"), |s| s == 200);
    let _workers: Vec<Process> = backends
        .iter()
        .enumerate()
        .map(|(i, (_, url))| {
            let env = [
                ("WORKER_SECRET", SECRET.to_string()),
                ("PROXY_URL", format!("http://{relay}")),
                ("BACKEND_URL", url.clone()),
                ("WORKER_NAME", format!("box-{}", (b'a' + i as u8) as char)),
                ("MAX_CONCURRENCY", SLOTS.to_string()),
            ];
            Process::spawn("modelrelay-worker", &env)
        })
        .collect();
    let base = format!("http://{relay}");
    wait_until_models(&base);
    let started = Instant::now();
    let mut turns = drive(&base);
    let wall = started.elapsed();
    // Where each request ran, from the relay's access log (`request <id> ... worker=`),
    // written just after the answer went out.
    let deadline = Instant::now() + Duration::from_secs(10);
    let workers = loop {
        let workers = access_log(&server.lines.lock());
        if turns.iter().all(|t| workers.contains_key(&t.request_id)) || Instant::now() > deadline {
            break workers;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    for t in &mut turns {
        t.worker = workers
            .get(&t.request_id)
            .cloned()
            .unwrap_or_else(|| "?".into());
    }
    let counters = if phase.affinity {
        let metrics = get(&format!("{base}/metrics")).1;
        metrics
            .lines()
            .filter(|l| l.starts_with("modelrelay_affinity_"))
            .map(|l| l.replace("modelrelay_affinity_", ""))
            .collect::<Vec<_>>()
            .join(", ")
    } else {
        String::new()
    };
    Outcome {
        phase,
        turns,
        wall,
        counters,
    }
}

/// Request id → worker name, from the relay's access-log lines.
fn access_log(lines: &[String]) -> HashMap<String, String> {
    lines
        .iter()
        .filter_map(|l| {
            let rest = &l[l.find("request r-")? + "request ".len()..];
            let id = rest.split(' ').next()?;
            let worker = rest.split(" worker=").nth(1)?.split(' ').next()?;
            Some((id.to_string(), worker.to_string()))
        })
        .collect()
}

/// The conversation state the clients share.
struct Talks {
    messages: Vec<Vec<Value>>,
    next_turn: Vec<usize>,
    busy: Vec<bool>,
}

fn drive(base: &str) -> Vec<Turn> {
    let talks = Arc::new((
        Mutex::new(Talks {
            messages: (0..CONVERSATIONS).map(|c| vec![system_prompt(c)]).collect(),
            next_turn: vec![0; CONVERSATIONS],
            busy: vec![false; CONVERSATIONS],
        }),
        Condvar::new(),
    ));
    let clients: Vec<_> = (0..CLIENTS)
        .map(|client| {
            let (talks, url) = (talks.clone(), format!("{base}/v1/chat/completions"));
            std::thread::spawn(move || {
                let mut rng = 0x9E37_79B9_7F4A_7C15u64 ^ (client as u64 + 1);
                let mut done = Vec::new();
                while let Some((c, turn, mut messages)) = take(&talks, &mut rng) {
                    let question = format!(
                        "Question {}: which three words of the list above fit a story about the sea? Answer in one short line.",
                        turn + 1
                    );
                    messages.push(json!({"role": "user", "content": question}));
                    let body = json!({"model": "gemma3", "max_tokens": MAX_TOKENS,
                        "temperature": 0, "messages": messages});
                    let began = Instant::now();
                    let (request_id, queued_ms, answer) = post(&url, &body.to_string());
                    let latency = began.elapsed();
                    let content = answer["choices"][0]["message"]["content"]
                        .as_str()
                        .unwrap_or_default()
                        .to_string();
                    done.push(Turn {
                        conversation: c,
                        turn,
                        latency,
                        evaluated: answer["timings"]["prompt_n"].as_u64().unwrap_or(0),
                        reused: answer["timings"]["cache_n"].as_u64().unwrap_or(0),
                        answered: answer["timings"]["predicted_n"].as_u64().unwrap_or(0),
                        prompt_ms: answer["timings"]["prompt_ms"].as_f64().unwrap_or(0.0),
                        predicted_ms: answer["timings"]["predicted_ms"].as_f64().unwrap_or(0.0),
                        queued_ms,
                        request_id,
                        worker: String::new(),
                    });
                    let (lock, wake) = &*talks;
                    let mut t = lock.lock();
                    t.messages[c].push(json!({"role": "user", "content": question}));
                    t.messages[c].push(json!({"role": "assistant", "content": content}));
                    t.next_turn[c] += 1;
                    t.busy[c] = false;
                    wake.notify_all();
                }
                done
            })
        })
        .collect();
    clients
        .into_iter()
        .flat_map(|c| c.join().expect("client"))
        .collect()
}

/// A random idle conversation with turns left (waits while all of those are busy);
/// `None` when every conversation is finished.
fn take(talks: &(Mutex<Talks>, Condvar), rng: &mut u64) -> Option<(usize, usize, Vec<Value>)> {
    let (lock, wake) = talks;
    let mut t = lock.lock();
    loop {
        let idle: Vec<usize> = (0..CONVERSATIONS)
            .filter(|c| !t.busy[*c] && t.next_turn[*c] < TURNS)
            .collect();
        if !idle.is_empty() {
            *rng ^= *rng << 13;
            *rng ^= *rng >> 7;
            *rng ^= *rng << 17;
            let c = idle[(*rng % idle.len() as u64) as usize];
            t.busy[c] = true;
            return Some((c, t.next_turn[c], t.messages[c].clone()));
        }
        if (0..CONVERSATIONS).all(|c| t.next_turn[c] >= TURNS) {
            return None;
        }
        wake.wait(&mut t);
    }
}

/// Conversation `c`'s own system prompt: about 1,100 tokens of words in its own order.
fn system_prompt(c: usize) -> Value {
    let mut rng = 0x2545_F491_4F6C_DD1Du64.wrapping_mul(c as u64 + 1);
    let words: Vec<&str> = (0..SYSTEM_WORDS)
        .map(|_| {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            WORDS[(rng % WORDS.len() as u64) as usize]
        })
        .collect();
    let text = format!(
        "You are assistant number {c}. Here is your word list: {}.",
        words.join(" ")
    );
    json!({"role": "system", "content": text})
}

fn agent() -> ureq::Agent {
    let config = ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(Duration::from_secs(900)))
        .build();
    ureq::Agent::new_with_config(config)
}

fn post(url: &str, body: &str) -> (String, u64, Value) {
    let mut response = agent()
        .post(url)
        .header("content-type", "application/json")
        .send(body)
        .expect("POST");
    let status = response.status().as_u16();
    let id = response
        .headers()
        .get("x-request-id")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_string();
    let queued = response
        .headers()
        .get("x-queue-wait-ms")
        .and_then(|v| v.to_str().ok()?.parse().ok())
        .unwrap_or(0);
    let text = response.body_mut().read_to_string().expect("answer");
    assert_eq!(status, 200, "{text}");
    (
        id,
        queued,
        serde_json::from_str(&text).expect("JSON answer"),
    )
}

fn get(url: &str) -> (u16, String) {
    match agent().get(url).call() {
        Ok(mut r) => {
            let status = r.status().as_u16();
            (status, r.body_mut().read_to_string().unwrap_or_default())
        }
        Err(_) => (0, String::new()),
    }
}

fn wait_for(url: &str, ok: impl Fn(u16) -> bool) {
    let deadline = Instant::now() + Duration::from_secs(300);
    while !ok(get(url).0) {
        assert!(Instant::now() < deadline, "{url} did not come up");
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn wait_until_models(base: &str) {
    let deadline = Instant::now() + Duration::from_secs(300);
    loop {
        let health: Value =
            serde_json::from_str(&get(&format!("{base}/health")).1).unwrap_or_default();
        let models = get(&format!("{base}/v1/models")).1;
        if health["workers_connected"] == 2 && models.contains("gemma3") {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "workers did not register: {health}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn later(o: &Outcome) -> impl Iterator<Item = &Turn> {
    o.turns.iter().filter(|t| t.turn > 0)
}

fn later_evaluated(o: &Outcome) -> u64 {
    later(o).map(|t| t.evaluated).sum()
}

/// Later turns whose box differs from their conversation's previous turn.
fn moved(o: &Outcome) -> usize {
    let at: HashMap<(usize, usize), &str> = o
        .turns
        .iter()
        .map(|t| ((t.conversation, t.turn), t.worker.as_str()))
        .collect();
    later(o)
        .filter(|t| at.get(&(t.conversation, t.turn - 1)) != Some(&t.worker.as_str()))
        .count()
}

fn percentile(mut v: Vec<Duration>, pct: usize) -> Duration {
    v.sort();
    v.get((v.len() * pct / 100).min(v.len().saturating_sub(1)))
        .copied()
        .unwrap_or_default()
}

fn shares(o: &Outcome) -> String {
    let mut by: std::collections::BTreeMap<&str, usize> = Default::default();
    for t in &o.turns {
        *by.entry(t.worker.as_str()).or_default() += 1;
    }
    by.iter()
        .map(|(w, n)| format!("{w} {:.0} %", 100.0 * *n as f64 / o.turns.len() as f64))
        .collect::<Vec<_>>()
        .join(", ")
}

fn row(o: &Outcome) -> String {
    let latencies: Vec<Duration> = later(o).map(|t| t.latency).collect();
    // New tokens of a later turn: its prompt minus the previous turn's prompt and answer.
    let seen: HashMap<(usize, usize), u64> = o
        .turns
        .iter()
        .map(|t| {
            (
                (t.conversation, t.turn),
                t.evaluated + t.reused + t.answered,
            )
        })
        .collect();
    let new: u64 = later(o)
        .map(|t| {
            let before = seen
                .get(&(t.conversation, t.turn - 1))
                .copied()
                .unwrap_or(0);
            (t.evaluated + t.reused).saturating_sub(before)
        })
        .sum();
    format!(
        "| {} | {} of {} | {} ({new}) | {:.2} s / {:.2} s | {:.0} s | {} |",
        o.phase.label,
        moved(o),
        latencies.len(),
        later_evaluated(o),
        percentile(latencies.clone(), 50).as_secs_f64(),
        percentile(latencies, 95).as_secs_f64(),
        o.wall.as_secs_f64(),
        shares(o)
    )
}

fn report_one(o: &Outcome) {
    let first: Vec<u64> = o
        .turns
        .iter()
        .filter(|t| t.turn == 0)
        .map(|t| t.evaluated)
        .collect();
    eprintln!("   first-turn prompts {:?} tokens; {}", first, row(o));
    let sum = |f: &dyn Fn(&Turn) -> f64| o.turns.iter().map(f).sum::<f64>();
    let (evaluated, prompt_s) = (sum(&|t| t.evaluated as f64), sum(&|t| t.prompt_ms) / 1e3);
    let (decoded, decode_s) = (sum(&|t| t.answered as f64), sum(&|t| t.predicted_ms) / 1e3);
    eprintln!(
        "   llama-servers: {evaluated:.0} prompt tokens in {prompt_s:.0} s ({:.0}/s), {decoded:.0} decoded in {decode_s:.0} s ({:.1}/s); later turns queued {:.1} s in all",
        evaluated / prompt_s.max(1e-9),
        decoded / decode_s.max(1e-9),
        later(o).map(|t| t.queued_ms).sum::<u64>() as f64 / 1e3
    );
    if !o.counters.is_empty() {
        eprintln!("   relay: {}", o.counters);
    }
}
