//! Dispatch cost with a deep queue: the dispatcher state machine alone (no sockets), one
//! busy worker, N requests queued across T tenants with mixed priorities; then every
//! completion dispatches the next request. Prints the cost per enqueue and per
//! complete-and-dispatch cycle, for a shallow and a deep queue, so a reader can see it
//! stays flat. Run: `make bench-queue` (or `cargo run --release --example queue_bench`).

use std::sync::Arc;
use std::time::{Duration, Instant};

use modelrelay::protocol::ServerMessage;
use modelrelay::protocol::{RegisterMessage, RequestMessage, ResponseComplete, WorkerMessage};
use modelrelay::server::dispatcher::{
    wire_request_id, Action, Config, Dispatcher, Event, Priority, Who,
};

fn main() {
    println!("| queued | tenants | enqueue | complete + dispatch next |");
    println!("|---|---|---|---|");
    for (queued, tenants) in [(100, 10), (1_000, 100), (10_000, 1_000)] {
        let (enqueue, cycle) = run(queued, tenants);
        println!(
            "| {queued} | {tenants} | {:.2} µs | {:.2} µs |",
            enqueue.as_secs_f64() * 1e6,
            cycle.as_secs_f64() * 1e6
        );
    }
}

/// Returns (mean enqueue cost, mean complete-and-dispatch cost).
fn run(queued: usize, tenants: usize) -> (Duration, Duration) {
    let t0 = Instant::now();
    let cfg = Config {
        max_queue_len: queued + 1,
        max_queue_per_tenant: queued + 1,
        queue_timeout: Duration::from_secs(3600),
        ..Config::default()
    };
    let mut d = Dispatcher::new(cfg, t0);
    let register = RegisterMessage {
        worker_name: "bench".into(),
        models: vec!["m".into()],
        max_concurrent: 1,
        protocol_version: Some("1".into()),
        current_load: Some(0),
        features: vec![],
        loaded_models: None,
        backend_kind: None,
        model_info: None,
        wake: None,
        routes: None,
    };
    d.handle(
        Event::WorkerJoined {
            id: 1,
            register,
            remote: "bench".into(),
        },
        t0,
    );
    let tenant_names: Vec<Arc<str>> = (0..tenants).map(|t| Arc::from(format!("t{t}"))).collect();
    let priorities = [
        Priority::Normal,
        Priority::Normal,
        Priority::High,
        Priority::Low,
    ];
    let submit = |d: &mut Dispatcher, id: u64| {
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
        let who = Who {
            tenant: tenant_names[id as usize % tenants].clone(),
            priority: priorities[id as usize % priorities.len()],
            weight: 1 + (id % 3) as u32,
        };
        d.handle(
            Event::Submit {
                id,
                msg,
                who,
                needs: Default::default(),
                prints: Default::default(),
                progress: false,
                continuable: false,
            },
            t0,
        )
    };
    // Request 0 takes the only slot; the rest wait.
    submit(&mut d, 0);
    let started = Instant::now();
    for id in 1..=queued as u64 {
        submit(&mut d, id);
    }
    let enqueue = started.elapsed() / queued as u32;
    assert_eq!(d.gauges().queue_depth, queued);
    let mut running = 0u64;
    let started = Instant::now();
    for _ in 0..queued {
        let rc = ResponseComplete {
            request_id: wire_request_id(running),
            status_code: 200,
            ..Default::default()
        };
        let actions = d.handle(
            Event::WorkerSaid(1, WorkerMessage::ResponseComplete(rc)),
            t0,
        );
        running = next_dispatched(&actions).expect("a queued request is dispatched");
    }
    let cycle = started.elapsed() / queued as u32;
    assert_eq!(d.gauges().queue_depth, 0);
    (enqueue, cycle)
}

fn next_dispatched(actions: &[Action]) -> Option<u64> {
    actions.iter().find_map(|a| match a {
        Action::ToWorker(_, ServerMessage::Request(m)) => {
            modelrelay::server::dispatcher::parse_request_id(&m.request_id)
        }
        _ => None,
    })
}
