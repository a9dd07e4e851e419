//! What a held (resumable) stream costs: heap per held stream and per event, measured
//! with a counting allocator, and the time to number and keep one event; on the relay,
//! and on a worker serving several relays (its copy, for a resume through another
//! relay). `make bench-resume`. Streams that did not opt in do none of this work.
//!
//! The answer is a typical chat stream: `EVENTS` OpenAI chunks of one word each (about
//! 150 bytes an event) and `data: [DONE]`.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicIsize, Ordering};
use std::time::{Duration, Instant};

use std::sync::Arc;

use modelrelay::protocol::held::Hold;
use modelrelay::protocol::{ResponseComplete, WorkerMessage};
use modelrelay::server::resume::{Config, Owner, Registry, Tap};
use modelrelay::worker::held::HeldStreams;
use modelrelay::worker::inflight::Handle;

struct Counting;

static LIVE: AtomicIsize = AtomicIsize::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LIVE.fetch_add(layout.size() as isize, Ordering::Relaxed);
        System.alloc(layout)
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size() as isize, Ordering::Relaxed);
        System.dealloc(ptr, layout)
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

const STREAMS: usize = 1000;
/// Streams held on the worker at once (their answers fit its 64 MiB total cap).
const WORKER_STREAMS: usize = 200;
const EVENTS: usize = 500;

fn event(n: usize) -> String {
    format!(
        "data: {{\"id\":\"chatcmpl-1\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"m\",\"choices\":[{{\"index\":0,\"delta\":{{\"content\":\"w{n} \"}},\"finish_reason\":null}}]}}\n\n"
    )
}

fn registry() -> Registry {
    Registry::new(Config {
        default_on: false,
        grace: Duration::from_secs(30),
        stream_bytes: 64 << 20,
        total_bytes: 1 << 40,
    })
}

fn open(reg: &Registry, i: usize) -> Tap {
    reg.open(
        &format!("r-{i:016x}"),
        Owner::new(Some("key"), "tenant"),
        "text/event-stream",
    )
    .expect("room")
}

fn main() {
    let events: Vec<String> = (1..=EVENTS).map(event).collect();
    let answer_bytes: usize = events.iter().map(String::len).sum::<usize>() + 14;

    // Empty held streams: what remembering one costs.
    let reg = registry();
    let before = LIVE.load(Ordering::Relaxed);
    let taps: Vec<Tap> = (0..STREAMS).map(|i| open(&reg, i)).collect();
    let empty = (LIVE.load(Ordering::Relaxed) - before) as f64 / STREAMS as f64;
    drop(taps);

    // Streams whose client left after the first event: the whole answer is held.
    let reg = registry();
    let before = LIVE.load(Ordering::Relaxed);
    let mut taps: Vec<Tap> = (0..STREAMS).map(|i| open(&reg, i)).collect();
    for tap in &mut taps {
        tap.emit(&events[0], false);
        tap.lost();
        for e in &events[1..] {
            tap.emit(e, false);
        }
        tap.emit("data: [DONE]\n\n", true);
    }
    let full = (LIVE.load(Ordering::Relaxed) - before) as f64 / STREAMS as f64;
    let charged = reg.bytes() as f64 / STREAMS as f64;
    drop(taps);

    // Numbering and keeping, per event (a reading client: handed events make room).
    let reg = Registry::new(Config {
        stream_bytes: 1 << 20,
        ..registry().config().clone()
    });
    let mut tap = open(&reg, 0);
    let rounds = 200_000;
    let started = Instant::now();
    for i in 0..rounds {
        std::hint::black_box(tap.emit(&events[i % EVENTS], false));
    }
    let per_event = started.elapsed().as_nanos() as f64 / rounds as f64;

    println!(
        "resumable streams ({STREAMS} streams, {EVENTS}-event answers of {answer_bytes} bytes):"
    );
    println!("  heap per held stream, nothing kept yet:   {empty:>9.0} bytes");
    println!(
        "  heap per held stream, whole answer kept:  {full:>9.0} bytes ({:.2}x the answer)",
        full / answer_bytes as f64
    );
    println!("  charged against the caps per stream:      {charged:>9.0} bytes");
    println!("  number and keep one event:                {per_event:>9.0} ns");
    worker_copy(&events, answer_bytes);
}

/// The worker's copy: streams whose relay died after the first event, the whole
/// answer kept until a resume or the grace period's end.
fn worker_copy(events: &[String], answer_bytes: usize) {
    let held = HeldStreams::default();
    let hold = Hold {
        grace_secs: 30,
        proof: "0".repeat(64),
    };
    let chunk = |text: &str| WorkerMessage::ResponseChunk {
        request_id: "r-0000000000000001".into(),
        chunk: text.to_string(),
    };
    let before = LIVE.load(Ordering::Relaxed);
    let streams: Vec<_> = (0..WORKER_STREAMS)
        .map(|i| {
            let handle = Arc::new(Handle::default());
            let s = held.open(0, &format!("r-{i:016x}"), &hold, &handle);
            s.expect("room")
        })
        .collect();
    let empty = (LIVE.load(Ordering::Relaxed) - before) as f64 / WORKER_STREAMS as f64;
    for s in &streams {
        s.pass(chunk(&events[0]), |_| true);
    }
    held.relay_lost(0);
    for s in &streams {
        for e in &events[1..] {
            s.pass(chunk(e), |_| true);
        }
        s.pass(chunk("data: [DONE]\n\n"), |_| true);
        let done = ResponseComplete {
            request_id: "r-0000000000000001".into(),
            status_code: 200,
            ..Default::default()
        };
        s.pass(WorkerMessage::ResponseComplete(done), |_| true);
    }
    let full = (LIVE.load(Ordering::Relaxed) - before) as f64 / WORKER_STREAMS as f64;
    let charged = held.bytes() as f64 / WORKER_STREAMS as f64;
    println!("held on the worker ({WORKER_STREAMS} streams, the same answers):");
    println!("  heap per held stream, nothing kept yet:   {empty:>9.0} bytes");
    println!(
        "  heap per held stream, whole answer kept:  {full:>9.0} bytes ({:.2}x the answer)",
        full / answer_bytes as f64
    );
    println!("  charged against the caps per stream:      {charged:>9.0} bytes");
}
