//! The access-log line and the metrics record of a request that reached the dispatcher.

use std::time::{Duration, Instant};

use log::info;

use crate::server::logsafe::bounded;
use crate::server::metrics::{Finished, OTHER};
use crate::server::tenancy::identity::Caller;
use crate::server::Ctx;

/// What the access log and the metrics learn about one request that reached the
/// dispatcher (a relayed request, or a part of a `moe-` ensemble).
pub struct Record<'a> {
    pub wire: &'a str,
    pub route: &'a str,
    pub model: &'a str,
    pub caller: &'a Caller,
    pub worker: Option<&'a str>,
    pub status: u16,
    pub started: Instant,
    pub queue_wait: Option<Duration>,
    pub first_chunk: Option<Duration>,
    pub tokens: (u64, u64),
    pub outcome: &'a str,
}

/// Writes the access-log line and the metrics record of a finished request.
pub fn record(ctx: &Ctx, r: &Record<'_>) {
    let duration = r.started.elapsed();
    let wait = r
        .queue_wait
        .map(|w| w.as_millis().to_string())
        .unwrap_or_else(|| "-".into());
    let who = &r.caller.who;
    let capped = if r.caller.asked != who.priority {
        format!("(asked {})", r.caller.asked.as_str())
    } else {
        String::new()
    };
    info!(
        "request {} {} model={} tenant={} priority={}{capped} worker={} status={} queue_wait_ms={} duration_ms={} tokens_in={} tokens_out={} outcome={}",
        r.wire,
        r.route,
        bounded(r.model),
        who.tenant,
        who.priority.as_str(),
        bounded(r.worker.unwrap_or("-")),
        r.status,
        wait,
        duration.as_millis(),
        r.tokens.0,
        r.tokens.1,
        r.outcome
    );
    if let Some(worker) = r.worker {
        ctx.usage.record(&crate::server::usage::Entry {
            key: r.caller.key_id(),
            tenant: &who.tenant,
            model: r.model,
            worker,
            tokens: r.tokens,
        });
    }
    // Metrics keep a label per model for ever: only models a worker advertises get
    // their own, what clients invent counts as `other` (as surplus tenants do).
    let served = ctx.shared.models().iter().any(|m| m == r.model);
    ctx.http_metrics.finished(&Finished {
        id: r.wire,
        route: r.route,
        model: if served { r.model } else { OTHER },
        status: r.status,
        duration,
        first_chunk: r.first_chunk,
        key: r.caller.key_id(),
        tokens: r.tokens,
        worker: r.worker,
        tenant: Some((&who.tenant, who.priority.as_str())),
        outcome: r.outcome,
        queue_wait: r.queue_wait,
    });
}
