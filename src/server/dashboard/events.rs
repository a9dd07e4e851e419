//! `GET /dashboard/events`: the dashboard's live feed, Server-Sent Events with one
//! snapshot of everything the page shows, whenever it changes and at most every
//! [`INTERVAL`] (4 a second).
//!
//! One publisher thread builds each snapshot once from the same functions as
//! `/admin/workers` and `/admin/stats`, plus the recent-activity view and the key list,
//! and fans it out through a [`crate::server::fanout::Hub`]: a tab that stops reading
//! loses old snapshots, never slows the relay. Nobody subscribed, the publisher sleeps.
//! A stream ends when its session ends (sign-out, expiry).

use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use super::session::Key;
use super::{error, SECURITY_HEADERS};
use crate::server::errors::ApiError;
use crate::server::fanout;
use crate::server::http::request::{Conn, Request};
use crate::server::ops;
use crate::server::Ctx;

/// The shortest time between two snapshots.
pub const INTERVAL: Duration = Duration::from_millis(250);
/// How soon a stream notices that its session ended (an idle relay publishes nothing).
const RECHECK: Duration = Duration::from_secs(1);

/// The publisher: while anyone subscribes, builds a snapshot every [`INTERVAL`] and
/// publishes it when it differs from the last one.
pub fn run_publisher(ctx: Arc<Ctx>) {
    let hub = &ctx.dashboard.hub;
    let mut last: Option<Value> = None;
    loop {
        if hub.subscribers() == 0 {
            last = None;
            hub.wait_for_subscriber();
        }
        if ctx.shared.is_shutting_down() {
            hub.close();
            return;
        }
        if let Some(snapshot) = snapshot(&ctx) {
            if last.as_ref() != Some(&snapshot) {
                let mut stamped = snapshot.clone();
                stamped["now_unix_ms"] = json!(unix_ms());
                stamped["uptime_secs"] = json!(ctx.shared.started.elapsed().as_secs());
                hub.publish(Arc::from(stamped.to_string()));
                last = Some(snapshot);
            }
        }
        std::thread::sleep(INTERVAL);
    }
}

/// Everything the dashboard shows, without the ticking clocks (so equal states compare
/// equal and an idle relay publishes nothing). `None` when the dispatcher has stopped.
pub fn snapshot(ctx: &Ctx) -> Option<Value> {
    let (_, mut workers) = ops::workers(ctx).ok()?;
    let (_, mut stats) = ops::admin_stats(ctx).ok()?;
    // The page gets the uptime outside the compared part (see `run_publisher`).
    stats["uptime_secs"] = Value::Null;
    let keys = ctx.keys.as_ref().map(|k| k.list()).unwrap_or_default();
    Some(json!({
        "workers": workers["workers"].take(),
        // Without the ticking figures: the page computes them from `asleep_since_unix`.
        "sleeping": workers["sleeping"].as_array_mut().map(|list| {
            for s in list.iter_mut() {
                if let Some(s) = s.as_object_mut() {
                    s.remove("hours_asleep");
                    s.remove("energy_saved_wh");
                }
            }
            list.clone()
        }),
        "idle_watts": ctx.cfg.idle_watts,
        "stats": stats,
        "activity": ctx.http_metrics.recent_view(),
        "keys": keys,
        "provider": ctx.cfg.provider,
        "subscribers": ctx.dashboard.hub.subscribers(),
    }))
}

fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// Holds the connection until the client leaves, the session ends, its socket stays
/// full too long, or the server shuts down.
pub fn serve(conn: &mut Conn, ctx: &Ctx, req: &Request, key: Key) -> bool {
    if ctx.shared.is_shutting_down() {
        let e = ApiError::new(503, "shutting_down", "the relay is shutting down");
        return error(conn, req, &e);
    }
    let sessions = &ctx.dashboard.sessions;
    let Some(_counted) = sessions.open_stream(key) else {
        let e = ApiError::new(
            429,
            "too_many_streams",
            "this session already has the most event streams open; close a tab",
        );
        return error(conn, req, &e);
    };
    let subscription = ctx.dashboard.hub.subscribe();
    fanout::stream_events(
        conn,
        req,
        &subscription,
        "snapshot",
        SECURITY_HEADERS,
        fanout::Recheck {
            every: RECHECK,
            allowed: || sessions.is_live(&key, Instant::now()),
        },
    );
    false
}
