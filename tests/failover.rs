//! Issue 17, end to end: the real `modelrelay-server` and `modelrelay-worker` binaries,
//! two workers with 4 slots each, one healthy fake backend and one bad one (refusing,
//! resetting, answering 500, or dead and revived), and real HTTP clients. While a
//! healthy worker exists no request may be lost to the bad one.
//!
//! Nothing here sleeps to synchronise: each step waits for an observable state
//! (`/admin/workers`, `/metrics`, a log line, what a backend saw), with a deadline.

mod common;
#[path = "../examples/support/fake_backend.rs"]
mod fake_backend;
#[path = "../examples/support/load.rs"]
mod load;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::procs::{start_worker, Proc, ServerProc};
use common::*;
use fake_backend::{FakeBackend, Running};
use modelrelay::protocol::ServerMessage;
use serde_json::{json, Value};

const ANSWER: &str = "one two three four five";
const ADMIN: &str = "failover-admin-token";
/// `BACKEND_PROBE_MAX_SECS` of the workers: a revived backend must take work again
/// within this plus one second.
const PROBE_MAX_SECS: u64 = 2;
/// The server's default `OUTLIER_CONSECUTIVE_FAILURES`.
const EJECT_AFTER: usize = 5;

/// One client request's result.
#[derive(Debug)]
struct Answer {
    stream: bool,
    status: u16,
    text: String,
    retry_after: Option<String>,
}

impl Answer {
    /// A whole, correct answer: the completion, or a stream that ends with `[DONE]`.
    fn is_complete(&self, completion: &str) -> bool {
        self.status == 200
            && if self.stream {
                self.text.contains("\"content\":\"five\"")
                    && self.text.trim_end().ends_with("data: [DONE]")
            } else {
                self.text == completion
            }
    }
}

fn ask(addr: SocketAddr, stream: bool) -> Answer {
    let resp = post(addr, "/v1/chat/completions", &chat("m", stream));
    Answer {
        stream,
        status: resp.status,
        retry_after: resp.header("retry-after").map(str::to_string),
        text: resp.text(),
    }
}

/// `clients` concurrent clients send `total` requests between them, each on a fresh
/// connection; with `half_streaming` every other request streams.
fn load(addr: SocketAddr, clients: usize, total: usize, half_streaming: bool) -> Vec<Answer> {
    load::spread(clients, total, move |i| {
        ask(addr, half_streaming && i % 2 == 1)
    })
}

/// Panics with the failed answers unless every answer is complete.
fn assert_none_lost(answers: &[Answer], completion: &str) {
    let lost: Vec<&Answer> = answers
        .iter()
        .filter(|a| !a.is_complete(completion))
        .collect();
    assert!(
        lost.is_empty(),
        "{} of {} requests lost: {lost:#?}",
        lost.len(),
        answers.len()
    );
}

fn start_server(extra: &[(&str, &str)]) -> ServerProc {
    // Never created: the key store finds no file and starts empty.
    let state = std::env::temp_dir().join(format!("modelrelay-failover-{}", std::process::id()));
    let state = state.to_string_lossy().into_owned();
    let mut env = vec![
        ("MODELRELAY_ADMIN_TOKEN", ADMIN),
        ("STATE_DIR", state.as_str()),
    ];
    env.extend_from_slice(extra);
    ServerProc::start(&env)
}

fn admin_get(server: &ServerProc, path: &str) -> Response {
    let auth = format!("Bearer {ADMIN}");
    let r = request(server.addr, "GET", path, None, &[("authorization", &auth)]);
    assert_eq!(r.status, 200, "{path}: {}", r.text());
    r
}

fn workers(server: &ServerProc) -> Vec<Value> {
    admin_get(server, "/admin/workers").json()["workers"]
        .as_array()
        .cloned()
        .unwrap_or_default()
}

/// The `/admin/workers` entry whose `name` (or `id`) is `who`.
fn worker_info(server: &ServerProc, who: &str) -> Value {
    let list = workers(server);
    list.iter()
        .find(|w| w["name"] == who || w["id"] == who)
        .cloned()
        .unwrap_or_else(|| panic!("no worker {who} in {list:#?}"))
}

/// Waits until worker `who` shows `backend_state == state`; returns how long it took.
fn wait_state(server: &ServerProc, who: &str, state: &str, limit: Duration) -> Duration {
    let start = Instant::now();
    loop {
        let info = worker_info(server, who);
        if info["backend_state"] == state {
            return start.elapsed();
        }
        assert!(
            start.elapsed() < limit,
            "worker {who} not {state} within {limit:?}: {info:#}"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// A sample from `/metrics`, e.g. `modelrelay_failovers_total` or
/// `modelrelay_workers_by_backend_state{state="down"}`.
fn metric(server: &ServerProc, sample: &str) -> f64 {
    let text = request(server.addr, "GET", "/metrics", None, &[]).text();
    text.lines()
        .find_map(|l| l.strip_prefix(sample)?.strip_prefix(' '))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no {sample} in /metrics:\n{text}"))
}

fn stoppable(backend: &FakeBackend, addr: &str) -> Running {
    backend
        .clone()
        .spawn_stoppable(addr)
        .unwrap_or_else(|e| panic!("backend on {addr}: {e}"))
}

fn worker(server: &ServerProc, backend: SocketAddr, name: &str) -> Proc {
    let max = PROBE_MAX_SECS.to_string();
    start_worker(
        server.addr,
        backend,
        &[
            ("WORKER_NAME", name),
            ("MODELS", "m"),
            ("MAX_CONCURRENCY", "4"),
            ("BACKEND_PROBE_MAX_SECS", &max),
            ("LOG_LEVEL", "debug"),
        ],
    )
}

/// A server and two workers, `good` and `bad`, each with its own backend; both backends
/// answer when the workers register (`bad` is a healthy backend unless the test passes
/// another), so the bad worker starts up and only learns of trouble from a request.
struct Pool {
    server: ServerProc,
    good: FakeBackend,
    good_backend: Option<Running>,
    bad_addr: SocketAddr,
    bad_backend: Option<Running>,
    good_worker: Proc,
    bad_worker: Proc,
}

impl Pool {
    fn start(bad: FakeBackend, server_extra: &[(&str, &str)]) -> Pool {
        let server = start_server(server_extra);
        let good = FakeBackend::new("m", ANSWER);
        let good_backend = stoppable(&good, "127.0.0.1:0");
        let bad_backend = stoppable(&bad, "127.0.0.1:0");
        let bad_addr = bad_backend.addr;
        let good_worker = worker(&server, good_backend.addr, "good");
        let bad_worker = worker(&server, bad_addr, "bad");
        server.wait_workers(2);
        wait_state(&server, "good", "up", WAIT);
        wait_state(&server, "bad", "up", WAIT);
        Pool {
            server,
            good,
            good_backend: Some(good_backend),
            bad_addr,
            bad_backend: Some(bad_backend),
            good_worker,
            bad_worker,
        }
    }

    /// Both backends healthy at first.
    fn healthy(server_extra: &[(&str, &str)]) -> Pool {
        Pool::start(FakeBackend::new("m", ANSWER), server_extra)
    }

    /// The bad backend dies: connects to its port are refused from now on.
    fn kill_bad_backend(&mut self) {
        self.bad_backend.take().expect("bad backend running").stop();
    }

    fn addr(&self) -> SocketAddr {
        self.server.addr
    }

    fn completion(&self) -> String {
        self.good.completion()
    }

    fn good_requests(&self) -> usize {
        self.good.stats.requests.load(Ordering::SeqCst)
    }

    /// The bad worker went through the failover path and was then routed around: at
    /// most one failover per client (the requests it held when its backend died).
    fn assert_bad_failed_over_and_down(&self, clients: usize) {
        let failovers = metric(&self.server, "modelrelay_failovers_total");
        assert!(
            failovers >= 1.0,
            "the bad worker was never tried: the scenario did not happen"
        );
        assert!(
            failovers <= clients as f64,
            "{failovers} failovers with {clients} client(s): the down worker was still routed to"
        );
        let info = worker_info(&self.server, "bad");
        assert_eq!(info["backend_state"], "down", "{info:#}");
        assert!(
            info["backend_reason"]
                .as_str()
                .is_some_and(|r| !r.is_empty()),
            "{info:#}"
        );
        assert!(info["backend_since_unix"].as_u64().is_some(), "{info:#}");
        assert_eq!(
            metric(
                &self.server,
                "modelrelay_workers_by_backend_state{state=\"down\"}"
            ),
            1.0
        );
        self.server.proc.wait_line("backend down: ");
        self.bad_worker.wait_line("backend down: ");
        assert!(
            !self.good_worker.log().contains("backend down: "),
            "{}",
            self.good_worker.log()
        );
    }
}

#[test]
fn refused_backend_one_client_sequential_loses_nothing() {
    let mut pool = Pool::healthy(&[]);
    pool.kill_bad_backend();
    let answers = load(pool.addr(), 1, 40, false);
    assert_eq!(answers.len(), 40);
    assert_none_lost(&answers, &pool.completion());
    pool.assert_bad_failed_over_and_down(1);
    assert_eq!(pool.good_requests(), 40, "each request ran once, on good");
    pool.server.proc.wait_line("failed over from worker");
}

#[test]
fn refused_backend_four_clients_half_streaming_loses_nothing() {
    let mut pool = Pool::healthy(&[]);
    pool.kill_bad_backend();
    let answers = load(pool.addr(), 4, 80, true);
    assert_eq!(answers.len(), 80);
    assert_eq!(answers.iter().filter(|a| a.stream).count(), 40);
    assert_none_lost(&answers, &pool.completion());
    pool.assert_bad_failed_over_and_down(4);
    assert_eq!(pool.good_requests(), 80);
}

#[test]
fn resetting_backend_loses_nothing() {
    let mut pool = Pool::healthy(&[]);
    pool.kill_bad_backend();
    // Something listens again on the bad port, but resets every connection.
    let _resetting = stoppable(
        &FakeBackend::new("m", ANSWER).resetting(),
        &pool.bad_addr.to_string(),
    );
    let answers = load(pool.addr(), 4, 40, true);
    assert_none_lost(&answers, &pool.completion());
    pool.assert_bad_failed_over_and_down(4);
    assert_eq!(pool.good_requests(), 40);
}

#[test]
fn wedged_backend_answering_500_is_ejected_after_a_handful() {
    let pool = Pool::start(FakeBackend::new("m", ANSWER).always_status(500), &[]);
    // Watches /admin/workers during the run: the ejection must be visible there.
    let stop = Arc::new(AtomicBool::new(false));
    let monitor = {
        let (stop, addr) = (stop.clone(), pool.addr());
        std::thread::spawn(move || {
            let auth = format!("Bearer {ADMIN}");
            let mut seen = Vec::new();
            while !stop.load(Ordering::SeqCst) {
                let r = request(
                    addr,
                    "GET",
                    "/admin/workers",
                    None,
                    &[("authorization", &auth)],
                );
                for w in r.json()["workers"].as_array().into_iter().flatten() {
                    if w["name"] == "bad" && w["backend_state"] == "ejected" {
                        seen.push(w.clone());
                    }
                }
                std::thread::sleep(Duration::from_millis(5));
            }
            seen
        })
    };
    let answers = load(pool.addr(), 4, 80, true);
    // One more look after the run, then stop watching.
    let bad_now = worker_info(&pool.server, "bad");
    stop.store(true, Ordering::SeqCst);
    let ejected_seen = monitor.join().expect("monitor");

    let failed: Vec<&Answer> = answers.iter().filter(|a| a.status != 200).collect();
    assert!(
        failed
            .iter()
            .all(|a| a.status == 500 && a.text.contains("scenario status 500")),
        "only the backend's own 500s may fail: {failed:#?}"
    );
    assert!(
        failed.len() <= 10,
        "{} of 80 failed with 500: the wedged worker was not ejected in time",
        failed.len()
    );
    assert!(
        failed.len() >= EJECT_AFTER,
        "the wedged backend got only {} requests: the scenario did not happen",
        failed.len()
    );
    let completion = pool.completion();
    let ok: Vec<&Answer> = answers.iter().filter(|a| a.status == 200).collect();
    assert!(ok.iter().all(|a| a.is_complete(&completion)), "{ok:#?}");
    assert!(metric(&pool.server, "modelrelay_ejections_total") >= 1.0);
    assert!(
        !ejected_seen.is_empty() || bad_now["backend_state"] == "ejected",
        "/admin/workers never showed the wedged worker ejected; now: {bad_now:#}"
    );
    let info = ejected_seen.first().unwrap_or(&bad_now);
    assert!(info["backend_since_unix"].as_u64().is_some(), "{info:#}");
    assert!(
        info["backend_reason"]
            .as_str()
            .is_some_and(|r| r.contains("ejected")),
        "{info:#}"
    );
    pool.server
        .proc
        .wait_line("ejected for 10s after 5 failures");
    // A 500 is an answer: the worker itself never calls its backend down.
    assert!(
        !pool.bad_worker.log().contains("backend down: "),
        "{}",
        pool.bad_worker.log()
    );
    assert_eq!(metric(&pool.server, "modelrelay_failovers_total"), 0.0);
}

#[test]
fn revived_backend_takes_work_again_within_the_probe_cap() {
    let mut pool = Pool::healthy(&[]);
    pool.kill_bad_backend();
    // Requests until the bad worker has tried its dead backend and reported it.
    let mut sent = 0;
    while worker_info(&pool.server, "bad")["backend_state"] != "down" {
        assert!(sent < 10, "the bad worker never reported its backend down");
        assert!(ask(pool.addr(), false).is_complete(&pool.completion()));
        sent += 1;
    }
    // Two failed probes (after 1 s, then 2 s): the backoff is at its cap, the slowest
    // case for noticing the revival.
    for _ in 0..2 {
        pool.bad_worker
            .wait_line_after(pool.bad_worker.line_count(), "backend probe failed");
    }
    let revived = FakeBackend::new("m", ANSWER);
    let _revived_backend = stoppable(&revived, &pool.bad_addr.to_string());
    let took = wait_state(
        &pool.server,
        "bad",
        "up",
        Duration::from_secs(PROBE_MAX_SECS + 1),
    );
    eprintln!(
        "revived backend -> /admin/workers up: {took:?} (BACKEND_PROBE_MAX_SECS={PROBE_MAX_SECS})"
    );
    pool.bad_worker.wait_line("backend up again after");
    pool.server.proc.wait_line("backend up");
    // The revived worker takes requests again (routing alternates between idle workers).
    for _ in 0..10 {
        if revived.stats.requests.load(Ordering::SeqCst) > 0 {
            break;
        }
        assert!(ask(pool.addr(), false).is_complete(&pool.completion()));
    }
    assert!(
        revived.stats.requests.load(Ordering::SeqCst) > 0,
        "the revived backend never got a request"
    );
    assert_eq!(
        metric(
            &pool.server,
            "modelrelay_workers_by_backend_state{state=\"up\"}"
        ),
        2.0
    );
}

#[test]
fn every_backend_dead_is_a_503_no_healthy_worker_within_the_queue_timeout() {
    let queue_timeout = 2;
    let mut pool = Pool::healthy(&[("QUEUE_TIMEOUT_SECS", &queue_timeout.to_string())]);
    pool.kill_bad_backend();
    pool.good_backend.take().expect("good backend").stop();
    // The queue deadline, plus slack for a loaded 2-core CI machine.
    let limit = Duration::from_secs(queue_timeout + 3);

    // The first request fails on both workers (each then reports its backend down);
    // with no worker up to run it, the last worker's error comes through at once. (If a
    // periodic model refresh noticed both outages first, it is already the 503.)
    let start = Instant::now();
    let first = ask(pool.addr(), false);
    let took = start.elapsed();
    if first.status == 503 {
        assert_no_healthy_worker(&first);
    } else {
        assert_eq!(first.status, 502, "{first:#?}");
        assert!(first.text.contains("backend_unreachable"), "{first:#?}");
    }
    assert!(took < limit, "the first request took {took:?}");
    wait_state(&pool.server, "good", "down", WAIT);
    wait_state(&pool.server, "bad", "down", WAIT);
    assert_eq!(
        metric(
            &pool.server,
            "modelrelay_workers_by_backend_state{state=\"down\"}"
        ),
        2.0
    );

    // Known to be down: refused at once, streaming or not.
    for stream in [false, true] {
        let start = Instant::now();
        let answer = ask(pool.addr(), stream);
        let took = start.elapsed();
        assert_no_healthy_worker(&answer);
        assert!(
            took < Duration::from_secs(queue_timeout),
            "took {took:?}: it waited in the queue"
        );
    }
    pool.server.proc.wait_line("no healthy worker serves `m`");
}

fn assert_no_healthy_worker(answer: &Answer) {
    assert_eq!(answer.status, 503, "{answer:#?}");
    let body: Value = serde_json::from_str(&answer.text).expect("JSON error");
    assert_eq!(body["error"]["code"], "no_healthy_worker", "{answer:#?}");
    let retry: u32 = answer
        .retry_after
        .as_deref()
        .and_then(|r| r.parse().ok())
        .unwrap_or_else(|| panic!("no numeric Retry-After: {answer:#?}"));
    assert!((1..=60).contains(&retry), "{answer:#?}");
}

/// Answers every request from `worker` with `reply` until `stop`; returns how many it got.
fn serve_fake(
    worker: FakeWorker,
    stop: Arc<AtomicBool>,
    reply: impl Fn(&FakeWorker, &str) + Send + 'static,
) -> std::thread::JoinHandle<usize> {
    std::thread::spawn(move || {
        let mut served = 0;
        while !stop.load(Ordering::SeqCst) {
            if let Some(ServerMessage::Request(r)) = worker.recv_within(Duration::from_millis(20)) {
                reply(&worker, &r.request_id);
                served += 1;
            }
        }
        served
    })
}

#[test]
fn an_original_workers_502s_pass_through_until_it_is_ejected() {
    let server = start_server(&[]);
    // Like an original ModelRelay worker: no `features`, errors without `retryable`.
    let original = FakeWorker::connect(server.addr, &["m"], 4);
    let original_id = original.worker_id.clone();
    let healthy = FakeWorker::connect(server.addr, &["m"], 4);
    server.wait_workers(2);
    assert_eq!(worker_info(&server, &original_id)["features"], json!([]));
    let stop = Arc::new(AtomicBool::new(false));
    let failing = serve_fake(original, stop.clone(), |w, id| {
        w.send(json!({
            "type": "error", "request_id": id, "code": "backend_unreachable",
            "message": "connection refused", "status_code": 502
        }));
    });
    let answering = serve_fake(healthy, stop.clone(), |w, id| {
        w.complete(id, 200, r#"{"ok":true}"#)
    });

    let answers: Vec<Answer> = (0..20).map(|_| ask(server.addr, false)).collect();
    let info = worker_info(&server, &original_id);
    stop.store(true, Ordering::SeqCst);
    let (failed_served, ok_served) = (failing.join().unwrap(), answering.join().unwrap());

    let statuses: Vec<u16> = answers.iter().map(|a| a.status).collect();
    // Routing alternates between the two idle workers: without the ejection after the
    // fifth failure in a row, half of the 20 would fail.
    let failures: Vec<&Answer> = answers.iter().filter(|a| a.status != 200).collect();
    assert_eq!(failures.len(), EJECT_AFTER, "{statuses:?}");
    for a in &failures {
        assert_eq!(a.status, 502, "{a:#?}");
        let body: Value = serde_json::from_str(&a.text).expect("JSON error");
        assert_eq!(body["error"]["code"], "backend_unreachable", "{a:#?}");
    }
    assert!(answers
        .iter()
        .filter(|a| a.status == 200)
        .all(|a| a.text == r#"{"ok":true}"#));
    // No failover: each 502 reached the client from the original worker alone.
    assert_eq!(failed_served, EJECT_AFTER, "{statuses:?}");
    assert_eq!(ok_served, 20 - EJECT_AFTER, "{statuses:?}");
    assert_eq!(metric(&server, "modelrelay_failovers_total"), 0.0);
    assert_eq!(info["backend_state"], "ejected", "{info:#}");
    assert_eq!(metric(&server, "modelrelay_ejections_total"), 1.0);
}

/// One worker's backend is down; the other answers 500 to everything. Ejecting the
/// second would leave nobody: clients would get `no_healthy_worker` instead of the
/// backend's answers, and one poisoned request shape could empty the pool.
#[test]
fn the_last_worker_up_is_not_ejected_beside_a_down_one() {
    let server = start_server(&[]);
    let register = json!({
        "type": "register", "worker_name": "down", "models": ["m"], "max_concurrent": 4,
        "protocol_version": "1", "features": ["backend_health", "failover"]
    });
    let Upgrade::Ok(down) = FakeWorker::try_connect(
        server.addr,
        "/v1/worker/connect?provider=local",
        Some(SECRET),
        register,
    ) else {
        panic!("refused")
    };
    down.send(json!({"type": "backend_status", "state": "down", "reason": "refused"}));
    let failing = FakeWorker::connect(server.addr, &["m"], 4);
    let failing_id = failing.worker_id.clone();
    wait_state(&server, "down", "down", WAIT);
    let stop = Arc::new(AtomicBool::new(false));
    let served = serve_fake(failing, stop.clone(), |w, id| {
        w.complete(id, 500, r#"{"error":{"message":"poisoned"}}"#)
    });
    let statuses: Vec<u16> = (0..2 * EJECT_AFTER)
        .map(|_| ask(server.addr, false).status)
        .collect();
    let info = worker_info(&server, &failing_id);
    stop.store(true, Ordering::SeqCst);
    assert_eq!(served.join().unwrap(), 2 * EJECT_AFTER);
    assert_eq!(statuses, vec![500; 2 * EJECT_AFTER]);
    assert_eq!(info["backend_state"], "up", "{info:#}");
    assert!(
        info["consecutive_failures"].as_u64() >= Some(2 * EJECT_AFTER as u64),
        "{info:#}"
    );
    assert_eq!(metric(&server, "modelrelay_ejections_total"), 0.0);
    server.proc.wait_line("keeps failing but is not ejected");
}
