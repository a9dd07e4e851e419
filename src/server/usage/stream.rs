//! `GET /api/usage-stream`: Server-Sent Events with a usage snapshot (in flight per
//! worker and model, queued per model, token totals) whenever it changes, at most every
//! [`INTERVAL`].
//!
//! The fan-out (bounded per-subscriber queues that drop their oldest snapshot, the
//! publisher asleep while nobody listens, the SSE writer) is [`crate::server::fanout`].

use std::sync::Arc;
use std::time::Duration;

use crossbeam_channel::Sender;
use serde_json::{json, Value};

use super::journal::{Journal, Usage};
use crate::server::auth::authorize_admin;
use crate::server::dispatcher::runtime::{ask, Answer, Input, Query};
use crate::server::dispatcher::LiveLoad;
use crate::server::errors::{ApiError, Style};
use crate::server::fanout;
pub use crate::server::fanout::Hub;
use crate::server::http::request::{Conn, Request};
use crate::server::reply::write_error;
use crate::server::shared::Shared;
use crate::server::store::UsageMirror;
use crate::server::Ctx;

/// The shortest time between two snapshots.
pub const INTERVAL: Duration = Duration::from_millis(250);

/// The publisher: while anyone subscribes, asks the dispatcher where requests are every
/// [`INTERVAL`] and publishes the snapshot when it differs from the last one. With a
/// shared store (`mirror`) the totals are the fleet's: this relay's journal plus what
/// the other relays published (their last known figures while the store is away).
pub fn run_publisher(
    hub: Arc<Hub>,
    inputs: Sender<Input>,
    journal: Option<Arc<Journal>>,
    mirror: Option<Arc<dyn UsageMirror>>,
    shared: Arc<Shared>,
) {
    let mut last: Option<Value> = None;
    let mut others = Usage::default();
    loop {
        if hub.subscribers() == 0 {
            last = None;
            hub.wait_for_subscriber();
        }
        if shared.is_shutting_down() {
            hub.close();
            return;
        }
        if let Some(Answer::LiveLoad(load)) = ask(&inputs, Query::LiveLoad) {
            if let Some(Ok(now)) = mirror.as_ref().map(|m| m.others_totals()) {
                others = now;
            }
            let mut totals = journal.as_ref().map(|j| j.totals()).unwrap_or_default();
            totals.add(&others);
            let snapshot = snapshot(&load, totals);
            if last.as_ref() != Some(&snapshot) {
                let mut stamped = snapshot.clone();
                stamped["time"] = json!(crate::rfc3339::format_ms(unix_ms()));
                hub.publish(Arc::from(stamped.to_string()));
                last = Some(snapshot);
            }
        }
        std::thread::sleep(INTERVAL);
    }
}

/// The snapshot without its timestamp (so equal states compare equal).
pub fn snapshot(load: &LiveLoad, totals: Usage) -> Value {
    let workers: Vec<Value> = load
        .workers
        .iter()
        .map(|(name, models)| {
            json!({
                "name": name,
                "in_flight": models.values().sum::<usize>(),
                "models": models,
            })
        })
        .collect();
    let mut models: std::collections::BTreeMap<&str, (usize, usize, u64, u64)> = Default::default();
    for m in load.workers.values() {
        for (model, n) in m {
            models.entry(model).or_default().0 += n;
        }
    }
    for (model, n) in &load.queued {
        models.entry(model).or_default().1 += n;
    }
    for (model, (input, output)) in &load.tokens {
        let entry = models.entry(model).or_default();
        entry.2 = *input;
        entry.3 = *output;
    }
    let models: Vec<Value> = models
        .into_iter()
        .map(|(model, (in_flight, queued, input, output))| {
            json!({
                "model": model,
                "in_flight": in_flight,
                "queued": queued,
                "input_tokens": input,
                "output_tokens": output,
            })
        })
        .collect();
    json!({
        "in_flight": load.workers.values().flat_map(|m| m.values()).sum::<usize>(),
        "queued": load.queued.values().sum::<usize>(),
        "workers": workers,
        "models": models,
        "totals": {
            "requests": totals.requests,
            "input_tokens": totals.tokens_in,
            "output_tokens": totals.tokens_out,
        },
    })
}

fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// `GET /api/usage-stream`: holds the connection until the client leaves, its socket
/// stays full too long, or the server shuts down.
pub fn serve(conn: &mut Conn, ctx: &Ctx, req: &Request) -> bool {
    if let Err(e) = authorize_admin(ctx, req, conn.peer.ip()) {
        return write_error(conn, Style::OpenAi, &e, req.keep_alive, None);
    }
    if ctx.shared.is_shutting_down() {
        let e = ApiError::new(503, "shutting_down", "the relay is shutting down");
        return write_error(conn, Style::OpenAi, &e, false, None);
    }
    let subscription = ctx.usage.hub.subscribe();
    fanout::stream_events(conn, req, &subscription, "usage", &[], fanout::always());
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn snapshot_sums_workers_and_models() {
        let mut load = LiveLoad::default();
        load.workers.insert("idle".into(), Default::default());
        load.workers
            .insert("w1".into(), [("m".to_string(), 2)].into_iter().collect());
        load.queued.insert("m".into(), 3);
        load.tokens.insert("m".into(), (10, 4));
        let v = snapshot(&load, Usage::default());
        assert_eq!(v["in_flight"], 2);
        assert_eq!(v["queued"], 3);
        assert_eq!(v["workers"][0]["name"], "idle");
        assert_eq!(v["workers"][0]["in_flight"], 0);
        assert_eq!(v["workers"][1]["models"]["m"], 2);
        assert_eq!(v["models"][0]["queued"], 3);
        assert_eq!(v["models"][0]["input_tokens"], 10);
        assert_eq!(v["totals"]["requests"], 0);
    }
}
