//! Usage journal figures for a simulated year: 100 models x 100 API keys, hourly buckets.
//!
//! Each simulated hour, 200 (key, model) pairs out of the 10,000 are active (a busy
//! small team: a few dozen keys, each on a handful of models; a different pseudo-random
//! set every hour so all pairs appear over the year). Each active pair gets one request
//! in each of 4 flush batches per hour (4 "seconds" with traffic per pair and hour), and
//! the journal is flushed (append + fsync) after every batch, compacting when due as it
//! would in the server. The file never holds more than about twice its compacted size,
//! whatever the number of batches; more batches only mean more compactions.
//!
//! Prints the journal size after the year, the time to open (load) it, the cost per
//! `add` and per `flush`, and, by arithmetic, what the full 10,000-pairs-per-hour case
//! would reach. Run: `make bench-usage` (or
//! `cargo run --release --example usage_journal_bench`); `USAGE_BENCH_DIR` picks the
//! directory (default: the system temp dir).

use std::path::PathBuf;
use std::time::{Duration, Instant};

use modelrelay::server::usage::journal::{Bucket, GroupBy, Journal, Key, Usage};

const MODELS: u64 = 100;
const KEYS: u64 = 100;
const ACTIVE_PAIRS: u64 = 200;
const BATCHES_PER_HOUR: u64 = 4;
const HOURS: u64 = 365 * 24;
const RETENTION_DAYS: u32 = 400;
const START_HOUR: u64 = 1_735_689_600 / 3600; // 2025-01-01T00:00Z

/// A small deterministic generator (xorshift64*), so runs are comparable.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
}

struct Timings {
    adds: u64,
    add_time: Duration,
    flushes: u64,
    flush_time: Duration,
    slowest_flush: Duration,
}

fn key(hour: u64, pair: u64) -> Key {
    let (k, m) = (pair / MODELS, pair % MODELS);
    Key {
        hour,
        key: format!("key-{k:03}"),
        tenant: format!("tenant-{:02}", k % 10),
        model: format!("model-{m:03}"),
        worker: format!("worker-{}", m % 8),
    }
}

fn simulate(journal: &Journal, rng: &mut Rng) -> (Timings, Usage) {
    let mut t = Timings {
        adds: 0,
        add_time: Duration::ZERO,
        flushes: 0,
        flush_time: Duration::ZERO,
        slowest_flush: Duration::ZERO,
    };
    let mut expected = Usage::default();
    let mut pairs = Vec::with_capacity(ACTIVE_PAIRS as usize);
    for hour in START_HOUR..START_HOUR + HOURS {
        pairs.clear();
        while pairs.len() < ACTIVE_PAIRS as usize {
            let pair = rng.next() % (MODELS * KEYS);
            if !pairs.contains(&pair) {
                pairs.push(pair);
            }
        }
        for _ in 0..BATCHES_PER_HOUR {
            for &pair in &pairs {
                let u = Usage {
                    requests: 1,
                    tokens_in: 50 + rng.next() % 4_000,
                    tokens_out: 10 + rng.next() % 1_000,
                };
                expected.add(&u);
                let k = key(hour, pair);
                let start = Instant::now();
                journal.add(k, u);
                t.add_time += start.elapsed();
                t.adds += 1;
            }
            let start = Instant::now();
            if let Err(e) = journal.flush() {
                eprintln!("flush failed: {e}");
                std::process::exit(1);
            }
            let took = start.elapsed();
            t.flush_time += took;
            t.slowest_flush = t.slowest_flush.max(took);
            t.flushes += 1;
        }
    }
    (t, expected)
}

/// A line of `/proc/self/status` in KiB (`VmRSS`, `VmHWM`), 0 where unavailable.
fn proc_kib(field: &str) -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

fn mib(bytes: u64) -> f64 {
    bytes as f64 / (1024.0 * 1024.0)
}

fn main() {
    let base = std::env::var_os("USAGE_BENCH_DIR").map_or_else(std::env::temp_dir, PathBuf::from);
    let dir = base.join(format!("modelrelay-usage-bench-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let now = (START_HOUR + HOURS) * 3600;
    let journal = match Journal::open(&dir, RETENTION_DAYS, START_HOUR * 3600) {
        Ok(j) => j,
        Err(e) => {
            eprintln!("{e}");
            std::process::exit(1);
        }
    };
    println!(
        "simulated: {HOURS} hours x {ACTIVE_PAIRS} active (key, model) pairs of {} \
         ({MODELS} models x {KEYS} keys), {BATCHES_PER_HOUR} flush batches per hour, \
         retention {RETENTION_DAYS} days, in {}",
        MODELS * KEYS,
        dir.display()
    );
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    let wall = Instant::now();
    let (t, expected) = simulate(&journal, &mut rng);
    let wall = wall.elapsed();
    let stats = journal.stats();
    drop(journal);
    let size = std::fs::metadata(dir.join("usage.journal")).map_or(0, |m| m.len());
    println!(
        "year written in {:.1} s: {} adds, {} flushes, {} compactions",
        wall.as_secs_f64(),
        t.adds,
        t.flushes,
        stats.compactions
    );
    println!(
        "add: {:.0} ns each | flush (append {} records + fsync, or compaction): {:.2} ms mean, \
         {:.0} ms slowest",
        t.add_time.as_nanos() as f64 / t.adds as f64,
        ACTIVE_PAIRS,
        t.flush_time.as_secs_f64() * 1e3 / t.flushes as f64,
        t.slowest_flush.as_secs_f64() * 1e3
    );
    println!(
        "journal after the year: {:.1} MiB, {} records for {} live buckets ({:.0} bytes/record)",
        mib(size),
        stats.file_records,
        stats.live_buckets,
        size as f64 / stats.file_records.max(1) as f64
    );
    let peak_kib = proc_kib("VmHWM");
    let start = Instant::now();
    let reopened = match Journal::open(&dir, RETENTION_DAYS, now) {
        Ok(j) => j,
        Err(e) => {
            eprintln!("{e}");
            std::process::exit(1);
        }
    };
    let load = start.elapsed();
    let rss_kib = proc_kib("VmRSS");
    let exact = reopened.totals() == expected;
    let s2 = reopened.stats();
    println!(
        "open (load) at start-up: {:.2} s for {:.1} MiB ({} live buckets; compacted on open: {}); \
         totals exact after reopen: {exact}",
        load.as_secs_f64(),
        mib(size),
        s2.live_buckets,
        s2.compactions > 0
    );
    println!(
        "memory: {:.0} MiB resident after reopen (an upper bound: includes what the allocator \
         kept from the year's run), {:.0} MiB peak during the year",
        rss_kib as f64 / 1024.0,
        peak_kib as f64 / 1024.0
    );
    let start = Instant::now();
    let rows = reopened.query(START_HOUR, START_HOUR + HOURS, GroupBy::Model, Bucket::Day);
    println!(
        "query of the whole year by model per day: {} rows in {:.0} ms",
        rows.len(),
        start.elapsed().as_secs_f64() * 1e3
    );
    let compacted = s2.file_bytes.max(1) as f64 / s2.file_records.max(1) as f64;
    let full_buckets = MODELS * KEYS * HOURS;
    let scale = full_buckets as f64 / s2.live_buckets.max(1) as f64;
    println!(
        "full case by arithmetic (all {} pairs active every hour): {} buckets a year, \
         {:.1} GiB compacted (up to {:.1} GiB before compaction), ~{:.0} s to load, \
         up to ~{:.0} GiB of memory (scaling the resident figure)",
        MODELS * KEYS,
        full_buckets,
        full_buckets as f64 * compacted / (1u64 << 30) as f64,
        2.0 * full_buckets as f64 * compacted / (1u64 << 30) as f64,
        load.as_secs_f64() * scale,
        rss_kib as f64 * scale / (1024.0 * 1024.0)
    );
    drop(reopened);
    let _ = std::fs::remove_dir_all(&dir);
    if !exact {
        std::process::exit(1);
    }
}
