//! Counters and histograms, and their Prometheus text rendering.
//!
//! Two owners: the dispatcher keeps request outcomes (its `Counters`, plain data like
//! the rest of its state), and the HTTP
//! threads keep what they see ([`HttpMetrics`]: requests by route/model/status class,
//! durations, time to first chunk, auth failures, per-key usage). `/metrics` and
//! `/admin/stats` combine a snapshot of both. [`recent`] keeps the last hour in buckets
//! and the last requests for the dashboard.

mod key;
pub mod recent;

use std::borrow::Cow;
use std::collections::{BTreeMap, VecDeque};
use std::fmt::Write as _;
use std::time::Duration;

use parking_lot::Mutex;

/// Upper bounds (seconds) of the histogram buckets.
pub const BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
];

/// A cumulative-bucket histogram of durations.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Histogram {
    /// Count per bucket in [`BUCKETS`] (not cumulative), plus one for `+Inf`.
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

impl Histogram {
    pub fn observe(&mut self, d: Duration) {
        if self.counts.is_empty() {
            self.counts = vec![0; BUCKETS.len() + 1];
        }
        let secs = d.as_secs_f64();
        let i = BUCKETS
            .iter()
            .position(|b| secs <= *b)
            .unwrap_or(BUCKETS.len());
        self.counts[i] += 1;
        self.sum += secs;
        self.count += 1;
    }

    pub fn count(&self) -> u64 {
        self.count
    }

    /// Appends `name_bucket`, `name_sum`, `name_count` lines with `labels`.
    fn render(&self, out: &mut String, name: &str, labels: &str) {
        let sep = if labels.is_empty() { "" } else { "," };
        let mut cumulative = 0;
        for (i, bound) in BUCKETS.iter().enumerate() {
            cumulative += self.counts.get(i).copied().unwrap_or(0);
            let _ = writeln!(
                out,
                "{name}_bucket{{{labels}{sep}le=\"{bound}\"}} {cumulative}"
            );
        }
        let _ = writeln!(
            out,
            "{name}_bucket{{{labels}{sep}le=\"+Inf\"}} {}",
            self.count
        );
        let braces = if labels.is_empty() {
            String::new()
        } else {
            format!("{{{labels}}}")
        };
        let _ = writeln!(out, "{name}_sum{braces} {}", self.sum);
        let _ = writeln!(out, "{name}_count{braces} {}", self.count);
    }
}

/// Usage of one client API key.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct KeyUsage {
    pub requests: u64,
    pub tokens_in: u64,
    pub tokens_out: u64,
}

/// What the HTTP threads record.
#[derive(Debug, Default)]
pub struct HttpMetrics {
    inner: Mutex<HttpInner>,
    /// The last hour and the last requests (its own lock: the dashboard reads it
    /// without copying everything else).
    recent: Mutex<recent::Recent>,
    /// Tenants named in the per-tenant figures; later ones count as [`OTHER_TENANT`].
    max_tenants: usize,
}

/// The label under which tenants beyond `METRICS_MAX_TENANTS` are counted.
pub const OTHER_TENANT: &str = OTHER;
/// The label of what has no label of its own: tenants past the cap, models no worker
/// advertises.
pub const OTHER: &str = "other";
/// Recent queue waits kept per tenant for percentiles.
const RECENT_TENANT_WAITS: usize = 256;

/// `2xx`, `4xx`...: a status's class label (no formatting per request).
fn status_class(status: u16) -> Cow<'static, str> {
    const CLASSES: [&str; 10] = [
        "0xx", "1xx", "2xx", "3xx", "4xx", "5xx", "6xx", "7xx", "8xx", "9xx",
    ];
    match CLASSES.get(usize::from(status / 100)) {
        Some(class) => (*class).into(),
        None => format!("{}xx", status / 100).into(),
    }
}

/// What one tenant did, as the HTTP side saw it.
#[derive(Debug, Default, Clone)]
pub struct TenantStats {
    /// (priority, status class) → finished requests.
    pub requests: BTreeMap<(&'static str, Cow<'static, str>), u64>,
    pub completed: u64,
    /// Every other outcome (failure or rejection code) → count.
    pub rejected: BTreeMap<String, u64>,
    /// Queue wait by priority.
    pub wait: BTreeMap<&'static str, Histogram>,
    pub recent_waits: VecDeque<Duration>,
    pub tokens_in: u64,
    pub tokens_out: u64,
}

impl TenantStats {
    /// Percentile (0–100) of the recent queue waits.
    pub fn wait_percentile(&self, pct: usize) -> Duration {
        percentile(&self.recent_waits, pct)
    }

    fn record(&mut self, f: &Finished, priority: &'static str) {
        let class = status_class(f.status);
        *self.requests.entry((priority, class)).or_default() += 1;
        if f.outcome == "completed" {
            self.completed += 1;
        } else if let Some(n) = self.rejected.get_mut(f.outcome) {
            *n += 1;
        } else {
            self.rejected.insert(f.outcome.to_string(), 1);
        }
        if let Some(w) = f.queue_wait {
            self.wait.entry(priority).or_default().observe(w);
            if self.recent_waits.len() == RECENT_TENANT_WAITS {
                self.recent_waits.pop_front();
            }
            self.recent_waits.push_back(w);
        }
        self.tokens_in = self.tokens_in.saturating_add(f.tokens.0);
        self.tokens_out = self.tokens_out.saturating_add(f.tokens.1);
    }
}

#[derive(Debug, Default, Clone)]
pub struct HttpInner {
    /// (route, model, status class) → count
    pub requests: BTreeMap<key::Triple, u64>,
    /// route → request duration
    pub duration: BTreeMap<String, Histogram>,
    pub first_chunk: Histogram,
    /// kind (`worker`, `api_key`, `admin`) → count
    pub auth_failures: BTreeMap<String, u64>,
    /// key id → usage
    pub keys: BTreeMap<String, KeyUsage>,
    /// tenant (capped, see [`OTHER_TENANT`]) → what it did
    pub tenants: BTreeMap<String, TenantStats>,
}

/// One finished client request, as the HTTP side saw it.
pub struct Finished<'a> {
    /// The request id (`X-Request-Id`).
    pub id: &'a str,
    pub route: &'a str,
    pub model: &'a str,
    pub status: u16,
    pub duration: Duration,
    pub first_chunk: Option<Duration>,
    pub key: Option<&'a str>,
    pub tokens: (u64, u64),
    /// The worker that answered, if one did.
    pub worker: Option<&'a str>,
    /// Tenant and priority, once the caller was identified.
    pub tenant: Option<(&'a str, &'static str)>,
    /// `completed`, or the failure / rejection code.
    pub outcome: &'a str,
    pub queue_wait: Option<Duration>,
}

impl HttpMetrics {
    /// `max_tenants`: how many tenants get their own label (`METRICS_MAX_TENANTS`).
    pub fn new(max_tenants: usize) -> HttpMetrics {
        HttpMetrics {
            inner: Mutex::default(),
            recent: Mutex::default(),
            max_tenants,
        }
    }

    pub fn finished(&self, f: &Finished) {
        self.recent.lock().record(unix_now(), f);
        let mut m = self.inner.lock();
        if let Some((tenant, priority)) = f.tenant {
            let label = if m.tenants.contains_key(tenant) || m.tenants.len() < self.max_tenants {
                tenant
            } else {
                OTHER_TENANT
            };
            // Looked up by reference first: a name is copied only when it is new.
            match m.tenants.get_mut(label) {
                Some(t) => t.record(f, priority),
                None => m
                    .tenants
                    .entry(label.to_string())
                    .or_default()
                    .record(f, priority),
            }
        }
        let class = status_class(f.status);
        key::bump(&mut m.requests, f.route, f.model, &class);
        match m.duration.get_mut(f.route) {
            Some(h) => h.observe(f.duration),
            None => m
                .duration
                .entry(f.route.to_string())
                .or_default()
                .observe(f.duration),
        }
        if let Some(t) = f.first_chunk {
            m.first_chunk.observe(t);
        }
        if let Some(key) = f.key {
            if !m.keys.contains_key(key) {
                m.keys.insert(key.to_string(), KeyUsage::default());
            }
            let Some(usage) = m.keys.get_mut(key) else {
                return;
            };
            usage.requests += 1;
            usage.tokens_in = usage.tokens_in.saturating_add(f.tokens.0);
            usage.tokens_out = usage.tokens_out.saturating_add(f.tokens.1);
        }
    }

    pub fn auth_failure(&self, kind: &str) {
        *self
            .inner
            .lock()
            .auth_failures
            .entry(kind.to_string())
            .or_default() += 1;
    }

    pub fn snapshot(&self) -> HttpInner {
        self.inner.lock().clone()
    }

    /// Rates over the last 5 and 60 minutes, per-minute counts and the last requests.
    pub fn recent_view(&self) -> serde_json::Value {
        self.recent.lock().view(unix_now())
    }
}

fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// Percentile (0–100) of a set of durations; zero when there are none.
pub fn percentile(samples: &VecDeque<Duration>, pct: usize) -> Duration {
    let mut v: Vec<Duration> = samples.iter().copied().collect();
    v.sort_unstable();
    v.get((v.len() * pct / 100).min(v.len().saturating_sub(1)))
        .copied()
        .unwrap_or_default()
}

/// Escapes a Prometheus label value.
pub fn label(value: &str) -> String {
    value
        .replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

/// A Prometheus text-format writer that emits `# HELP`/`# TYPE` once per family.
pub struct Exposition {
    pub out: String,
}

impl Exposition {
    pub fn new() -> Exposition {
        Exposition {
            out: String::with_capacity(8192),
        }
    }

    pub fn family(&mut self, name: &str, kind: &str, help: &str) {
        let _ = writeln!(self.out, "# HELP {name} {help}");
        let _ = writeln!(self.out, "# TYPE {name} {kind}");
    }

    pub fn sample(&mut self, name: &str, labels: &[(&str, &str)], value: impl std::fmt::Display) {
        if labels.is_empty() {
            let _ = writeln!(self.out, "{name} {value}");
            return;
        }
        let l: Vec<String> = labels
            .iter()
            .map(|(k, v)| format!("{k}=\"{}\"", label(v)))
            .collect();
        let _ = writeln!(self.out, "{name}{{{}}} {value}", l.join(","));
    }

    pub fn histogram(&mut self, name: &str, labels: &[(&str, &str)], h: &Histogram) {
        let l: Vec<String> = labels
            .iter()
            .map(|(k, v)| format!("{k}=\"{}\"", label(v)))
            .collect();
        h.render(&mut self.out, name, &l.join(","));
    }
}

impl Default for Exposition {
    fn default() -> Self {
        Exposition::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_buckets_are_cumulative() {
        let mut h = Histogram::default();
        h.observe(Duration::from_millis(3));
        h.observe(Duration::from_millis(30));
        h.observe(Duration::from_secs(1000));
        let mut out = String::new();
        h.render(&mut out, "x", "");
        assert!(out.contains("x_bucket{le=\"0.001\"} 0\n"));
        assert!(out.contains("x_bucket{le=\"0.005\"} 1\n"));
        assert!(out.contains("x_bucket{le=\"0.05\"} 2\n"));
        assert!(out.contains("x_bucket{le=\"300\"} 2\n"));
        assert!(out.contains("x_bucket{le=\"+Inf\"} 3\n"));
        assert!(out.contains("x_count 3\n"));
    }

    #[test]
    fn repeated_requests_add_up_under_the_same_labels() {
        let m = HttpMetrics::new(10);
        for (status, outcome) in [(200, "completed"), (200, "completed"), (503, "no_worker")]
            .into_iter()
            .chain([(999, "odd"), (1000, "odd")])
        {
            m.finished(&Finished {
                id: "r",
                route: "/v1/chat/completions",
                model: "m",
                status,
                duration: Duration::from_millis(2),
                first_chunk: None,
                key: Some("k1"),
                tokens: (1, 2),
                worker: None,
                tenant: Some(("t", "normal")),
                outcome,
                queue_wait: None,
            });
        }
        let inner = m.snapshot();
        let count = |class: &str| {
            let key = (
                "/v1/chat/completions".to_string(),
                "m".to_string(),
                class.to_string(),
            );
            inner.requests.get(&key).copied()
        };
        assert_eq!(count("2xx"), Some(2));
        assert_eq!(count("5xx"), Some(1));
        assert_eq!(count("9xx"), Some(1));
        assert_eq!(count("10xx"), Some(1));
        assert_eq!(inner.duration["/v1/chat/completions"].count(), 5);
        assert_eq!(inner.keys["k1"].requests, 5);
        assert_eq!(inner.keys["k1"].tokens_out, 10);
        let t = &inner.tenants["t"];
        assert_eq!(t.completed, 2);
        assert_eq!(t.rejected["no_worker"], 1);
        assert_eq!(t.rejected["odd"], 2);
        assert_eq!(t.requests[&("normal", Cow::Borrowed("2xx"))], 2);
    }

    #[test]
    fn labels_are_escaped() {
        assert_eq!(label("a\"b\\c\nd"), "a\\\"b\\\\c\\nd");
    }
}
