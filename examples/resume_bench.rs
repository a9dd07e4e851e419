//! What a held (resumable) stream costs: heap per held stream and per event, measured
//! with a counting allocator, and the time to number and keep one event. `make
//! bench-resume`. Streams that did not opt in do none of this work.
//!
//! The answer is a typical chat stream: `EVENTS` OpenAI chunks of one word each (about
//! 150 bytes an event) and `data: [DONE]`.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicIsize, Ordering};
use std::time::{Duration, Instant};

use modelrelay::server::resume::{Config, Owner, Registry, Tap};

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
}
