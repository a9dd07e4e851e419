//! What happened lately, for the dashboard: requests, errors by reason, tokens and time
//! to first token in 10-second buckets over the last hour (so rates over 5 and 60
//! minutes and a per-minute chart), and a bounded ring of the last finished requests.
//!
//! Memory is fixed: [`BUCKETS`] buckets (each with at most [`MAX_REASONS`] error
//! reasons), [`RECENT_REQUESTS`] ring entries and [`TTFT_SAMPLES`] samples. Nothing
//! from a request's body is kept, only what the access log already shows.
//! Time is passed in (Unix seconds), so the windows are tested without a clock.

use std::collections::VecDeque;
use std::time::Duration;

use serde::Serialize;
use serde_json::{json, Value};

use super::{percentile, Finished};

/// Seconds per bucket.
pub const BUCKET_SECS: u64 = 10;
/// Buckets kept: one hour.
pub const BUCKETS: usize = 360;
/// Finished requests kept for the recent-requests table.
pub const RECENT_REQUESTS: usize = 50;
/// Error reasons named per bucket; more fold into `other`.
pub const MAX_REASONS: usize = 12;
/// Recent time-to-first-token samples kept for percentiles.
pub const TTFT_SAMPLES: usize = 256;

#[derive(Debug, Default, Clone)]
struct Bucket {
    /// `unix_secs / BUCKET_SECS` of the period it counts; a stale one is reset on use.
    index: u64,
    requests: u64,
    errors: u64,
    reasons: Vec<(String, u64)>,
    tokens_in: u64,
    tokens_out: u64,
    ttft_ms_sum: u64,
    ttft_n: u64,
}

/// One finished request as the recent-requests table shows it.
#[derive(Debug, Clone, Default, Serialize)]
pub struct RecentRequest {
    pub id: String,
    pub route: String,
    pub model: String,
    pub worker: Option<String>,
    pub tenant: Option<String>,
    pub status: u16,
    pub outcome: String,
    pub wait_ms: Option<u64>,
    pub duration_ms: u64,
    pub ttft_ms: Option<u64>,
    pub tokens_out: u64,
    pub finished_unix: u64,
}

/// The buckets, the ring and the samples.
#[derive(Debug, Default)]
pub struct Recent {
    buckets: Vec<Bucket>,
    ring: VecDeque<RecentRequest>,
    ttft: VecDeque<Duration>,
}

/// Overwrites `to` with `from`, keeping its allocation.
fn set(to: &mut String, from: &str) {
    to.clear();
    to.push_str(from);
}

fn set_opt(to: &mut Option<String>, from: Option<&str>) {
    match (to.as_mut(), from) {
        (Some(s), Some(from)) => set(s, from),
        (_, from) => *to = from.map(str::to_string),
    }
}

fn ms(d: Duration) -> u64 {
    d.as_millis().min(u128::from(u64::MAX)) as u64
}

impl Recent {
    /// Counts `f`, finished at `now_unix`.
    pub fn record(&mut self, now_unix: u64, f: &Finished) {
        if self.buckets.is_empty() {
            self.buckets = vec![Bucket::default(); BUCKETS];
        }
        let index = now_unix / BUCKET_SECS;
        let b = &mut self.buckets[(index % BUCKETS as u64) as usize];
        if b.index != index {
            *b = Bucket {
                index,
                ..Bucket::default()
            };
        }
        b.requests += 1;
        if f.outcome != "completed" {
            b.errors += 1;
            let reason =
                if b.reasons.iter().any(|(r, _)| r == f.outcome) || b.reasons.len() < MAX_REASONS {
                    f.outcome
                } else {
                    "other"
                };
            match b.reasons.iter_mut().find(|(r, _)| r == reason) {
                Some((_, n)) => *n += 1,
                None => b.reasons.push((reason.to_string(), 1)),
            }
        }
        b.tokens_in = b.tokens_in.saturating_add(f.tokens.0);
        b.tokens_out = b.tokens_out.saturating_add(f.tokens.1);
        if let Some(t) = f.first_chunk {
            b.ttft_ms_sum = b.ttft_ms_sum.saturating_add(ms(t));
            b.ttft_n += 1;
            if self.ttft.len() == TTFT_SAMPLES {
                self.ttft.pop_front();
            }
            self.ttft.push_back(t);
        }
        // The oldest entry's strings are reused once the ring is full: no allocation
        // per request for the names (they are short and alike from one to the next).
        let mut entry = if self.ring.len() == RECENT_REQUESTS {
            self.ring.pop_back().unwrap_or_default()
        } else {
            RecentRequest::default()
        };
        set(&mut entry.id, f.id);
        set(&mut entry.route, f.route);
        set(&mut entry.model, f.model);
        set_opt(&mut entry.worker, f.worker);
        set_opt(&mut entry.tenant, f.tenant.map(|(t, _)| t));
        set(&mut entry.outcome, f.outcome);
        entry.status = f.status;
        entry.wait_ms = f.queue_wait.map(ms);
        entry.duration_ms = ms(f.duration);
        entry.ttft_ms = f.first_chunk.map(ms);
        entry.tokens_out = f.tokens.1;
        entry.finished_unix = now_unix;
        self.ring.push_front(entry);
    }

    /// Buckets of the last `secs` seconds up to `now_unix` (a clock that went back
    /// leaves the future ones out).
    fn window(&self, now_unix: u64, secs: u64) -> impl Iterator<Item = &Bucket> {
        let now = now_unix / BUCKET_SECS;
        let first = now.saturating_sub(secs / BUCKET_SECS - 1);
        self.buckets
            .iter()
            .filter(move |b| b.requests > 0 && b.index >= first && b.index <= now)
    }

    fn summary(&self, now_unix: u64, secs: u64) -> Value {
        let (mut requests, mut errors, mut tin, mut tout, mut ttft_sum, mut ttft_n) =
            (0u64, 0u64, 0u64, 0u64, 0u64, 0u64);
        let mut reasons = std::collections::BTreeMap::<&str, u64>::new();
        for b in self.window(now_unix, secs) {
            requests += b.requests;
            errors += b.errors;
            tin += b.tokens_in;
            tout += b.tokens_out;
            ttft_sum += b.ttft_ms_sum;
            ttft_n += b.ttft_n;
            for (r, n) in &b.reasons {
                *reasons.entry(r).or_default() += n;
            }
        }
        let per_s = |n: u64| n as f64 / secs as f64;
        json!({
            "requests": requests,
            "requests_per_s": per_s(requests),
            "errors": errors,
            "errors_by_reason": reasons,
            "tokens_in": tin,
            "tokens_out": tout,
            "tokens_out_per_s": per_s(tout),
            "ttft_ms_mean": if ttft_n == 0 { 0.0 } else { ttft_sum as f64 / ttft_n as f64 },
        })
    }

    /// Per minute over the last hour, oldest first: requests, errors, output tokens.
    fn per_minute(&self, now_unix: u64) -> Vec<[u64; 3]> {
        let now_min = now_unix / 60;
        let mut out = vec![[0u64; 3]; 60];
        for b in self.window(now_unix, 3600) {
            let age = now_min.saturating_sub(b.index * BUCKET_SECS / 60);
            if let Some(slot) = 59usize.checked_sub(age as usize) {
                out[slot][0] += b.requests;
                out[slot][1] += b.errors;
                out[slot][2] += b.tokens_out;
            }
        }
        out
    }

    /// Everything the dashboard shows from here, as of `now_unix`.
    pub fn view(&self, now_unix: u64) -> Value {
        let p = |pct| ms(percentile(&self.ttft, pct));
        json!({
            "last_5m": self.summary(now_unix, 300),
            "last_60m": self.summary(now_unix, 3600),
            "per_minute": self.per_minute(now_unix),
            "ttft_ms": {"p50": p(50), "p95": p(95)},
            "recent": self.ring,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn finished<'a>(outcome: &'a str, first: Option<u64>, tokens: u64) -> Finished<'a> {
        Finished {
            id: "req-1",
            route: "/v1/chat/completions",
            model: "m",
            worker: Some("w1"),
            status: if outcome == "completed" { 200 } else { 503 },
            duration: Duration::from_millis(40),
            first_chunk: first.map(Duration::from_millis),
            key: None,
            tokens: (1, tokens),
            tenant: Some(("t", "normal")),
            outcome,
            queue_wait: Some(Duration::from_millis(3)),
        }
    }

    #[test]
    fn windows_count_what_is_inside_them_and_forget_older_buckets() {
        let mut r = Recent::default();
        let t0 = 1_000_000;
        r.record(t0 - 3000, &finished("completed", Some(10), 5)); // 50 min ago
        r.record(t0 - 10, &finished("completed", Some(30), 7));
        r.record(t0, &finished("no_worker", None, 0));
        r.record(t0 - 4000, &finished("completed", None, 100)); // outside the hour
        let v = r.view(t0);
        assert_eq!(v["last_5m"]["requests"], 2);
        assert_eq!(v["last_5m"]["errors"], 1);
        assert_eq!(v["last_5m"]["errors_by_reason"]["no_worker"], 1);
        assert_eq!(v["last_5m"]["tokens_out"], 7);
        assert_eq!(v["last_5m"]["ttft_ms_mean"], 30.0);
        assert_eq!(v["last_60m"]["requests"], 3);
        assert_eq!(v["last_60m"]["tokens_out"], 12);
        assert_eq!(v["last_60m"]["requests_per_s"], 3.0 / 3600.0);
        let minutes = v["per_minute"].as_array().unwrap();
        assert_eq!(minutes.len(), 60);
        assert_eq!(minutes[59][0], 1 + u64::from(t0 % 60 >= 10));
        let total: u64 = minutes.iter().map(|m| m[0].as_u64().unwrap()).sum();
        assert_eq!(total, 3);
    }

    #[test]
    fn the_ring_keeps_the_newest_requests_first_and_is_bounded() {
        let mut r = Recent::default();
        for n in 0..(RECENT_REQUESTS as u64 + 20) {
            r.record(100 + n, &finished("completed", None, n));
        }
        let v = r.view(200);
        let recent = v["recent"].as_array().unwrap();
        assert_eq!(recent.len(), RECENT_REQUESTS);
        assert_eq!(recent[0]["tokens_out"], RECENT_REQUESTS as u64 + 19);
        assert_eq!(recent[0]["worker"], "w1");
        assert_eq!(recent[0]["wait_ms"], 3);
    }

    #[test]
    fn a_reused_entry_keeps_nothing_of_the_request_it_held() {
        let mut r = Recent::default();
        for n in 0..RECENT_REQUESTS as u64 {
            r.record(100, &finished("completed", Some(5), n));
        }
        // The ring is full: the next record reuses the oldest entry's strings.
        let mut last = finished("no_worker", None, 0);
        (last.id, last.route, last.model) = ("r-x", "/v1/embeddings", "m");
        (last.worker, last.tenant, last.queue_wait) = (None, None, None);
        r.record(101, &last);
        let v = r.view(101);
        let newest = &v["recent"][0];
        assert_eq!(newest["id"], "r-x");
        assert_eq!(newest["route"], "/v1/embeddings");
        assert_eq!(newest["model"], "m");
        assert_eq!(newest["outcome"], "no_worker");
        assert!(newest["worker"].is_null() && newest["tenant"].is_null());
        assert!(newest["wait_ms"].is_null() && newest["ttft_ms"].is_null());
        assert_eq!(v["recent"].as_array().unwrap().len(), RECENT_REQUESTS);
    }

    #[test]
    fn error_reasons_per_bucket_are_bounded() {
        let mut r = Recent::default();
        let names: Vec<String> = (0..100).map(|n| format!("reason_{n}")).collect();
        for name in &names {
            r.record(50, &finished(name, None, 0));
        }
        let v = r.view(50);
        let reasons = v["last_5m"]["errors_by_reason"].as_object().unwrap();
        assert_eq!(reasons.len(), MAX_REASONS + 1);
        assert_eq!(reasons["other"], 100 - MAX_REASONS as u64);
        assert!(r.buckets.iter().all(|b| b.reasons.len() <= MAX_REASONS + 1));
    }
}
