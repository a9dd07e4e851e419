//! What a process costs, read from `/proc` (Linux): CPU time (all threads, living and
//! ended), RSS, and context switches of its threads. CPU time per request is the bench's
//! steadiest figure on a shared machine: throughput moves with whatever else runs, the
//! work one request takes much less.
#![allow(dead_code)]

use std::collections::HashMap;
use std::time::{Duration, Instant};

/// Clock ticks per second of `/proc/PID/stat` (`USER_HZ`, 100 on every Linux build).
const TICKS_PER_SEC: u64 = 100;

/// utime + stime of `pid` in clock ticks (0 when unreadable).
pub fn cpu_ticks(pid: u32) -> u64 {
    let (user, system) = cpu_split(pid);
    user + system
}

/// (user, system) CPU time of `pid` in clock ticks.
pub fn cpu_split(pid: u32) -> (u64, u64) {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let fields: Vec<u64> = stat
        .rsplit(')')
        .next()
        .unwrap_or("")
        .split_whitespace()
        .map(|v| v.parse().unwrap_or(0))
        .collect();
    // utime and stime are fields 14 and 15; after the ')' split they are 11 and 12.
    (
        fields.get(11).copied().unwrap_or(0),
        fields.get(12).copied().unwrap_or(0),
    )
}

/// CPU time `pid` used during `window`, and how long the window really was.
pub fn cpu_over(pid: u32, window: Duration) -> (Duration, Duration) {
    let before = cpu_ticks(pid);
    let t = Instant::now();
    std::thread::sleep(window);
    let ticks = cpu_ticks(pid) - before;
    (ticks_to_duration(ticks), t.elapsed())
}

pub fn ticks_to_duration(ticks: u64) -> Duration {
    Duration::from_millis(ticks * 1000 / TICKS_PER_SEC)
}

pub fn rss_kb(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or(0)
}

/// Context switches (voluntary + involuntary) of each living thread of `pid`. A thread
/// that ends between two snapshots loses its count, so compare snapshots of a steady
/// state (keep-alive clients), where threads live throughout.
pub fn switches(pid: u32) -> HashMap<u32, u64> {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return HashMap::new();
    };
    tasks
        .flatten()
        .filter_map(|t| {
            let tid: u32 = t.file_name().to_str()?.parse().ok()?;
            let status = std::fs::read_to_string(t.path().join("status")).ok()?;
            let n = status
                .lines()
                .filter(|l| l.contains("ctxt_switches:"))
                .filter_map(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
                .sum();
            Some((tid, n))
        })
        .collect()
}

/// A process's counters at one moment, to subtract from a later one.
pub struct Snapshot {
    pid: u32,
    user: u64,
    system: u64,
    switches: HashMap<u32, u64>,
}

/// What a process spent between two snapshots.
#[derive(Clone, Copy, Default)]
pub struct Spent {
    pub user: Duration,
    pub system: Duration,
    pub switches: u64,
}

impl Spent {
    pub fn cpu(&self) -> Duration {
        self.user + self.system
    }
}

impl Snapshot {
    pub fn take(pid: u32) -> Snapshot {
        let (user, system) = cpu_split(pid);
        Snapshot {
            pid,
            user,
            system,
            switches: switches(pid),
        }
    }

    pub fn since(&self) -> Spent {
        let (user, system) = cpu_split(self.pid);
        let now = switches(self.pid);
        let switches = now
            .iter()
            .map(|(tid, n)| n.saturating_sub(self.switches.get(tid).copied().unwrap_or(0)))
            .sum();
        Spent {
            user: ticks_to_duration(user.saturating_sub(self.user)),
            system: ticks_to_duration(system.saturating_sub(self.system)),
            switches,
        }
    }
}
