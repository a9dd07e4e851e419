//! Usage across relays in Redis. Each relay's journal stays the truth for its own
//! requests; what it publishes is the *absolute* value of each bucket it changed, so a
//! retried, repeated or post-restart publication overwrites with the same or a larger
//! figure and never adds twice. A publication that failed is kept for the next one, so a
//! relay catches up after an outage.
//!
//! Layout (all under `modelrelay:usage:`):
//! - `b:<relay>:<hour>`: a hash, field `["key","tenant","model","worker"]` (JSON) →
//!   `"requests tokens_in tokens_out"`; expires with the retention.
//! - `hours`: a sorted set of `<relay>:<hour>` scored by hour, to find the hashes of a
//!   time range in one call.
//! - `relays`: a hash, relay → `"requests tokens_in tokens_out unix_secs"`: its totals
//!   (for the usage stream) and when it last published.

use std::collections::HashSet;
use std::sync::Arc;

use super::redis::Redis;
use super::{Others, UsageMirror};
use crate::server::usage::journal::{Key, Usage};
use crate::server::usage::unix_now;

const BUCKETS: &str = "modelrelay:usage:b:";
const HOURS: &str = "modelrelay:usage:hours";
const RELAYS: &str = "modelrelay:usage:relays";
/// Buckets per pipeline (bounds one request's size).
const CHUNK: usize = 512;
/// Most hour hashes one report reads (90 days of 25 relays).
const MAX_HASHES: usize = 54_000;

pub struct SharedUsage {
    redis: Arc<Redis>,
    relay: String,
    /// 0: kept forever.
    retention_hours: u64,
}

impl SharedUsage {
    pub fn new(redis: Arc<Redis>, relay: String, retention_days: u32) -> SharedUsage {
        log::info!("usage: published to the shared store as relay {relay}");
        SharedUsage {
            redis,
            relay,
            retention_hours: u64::from(retention_days) * 24,
        }
    }

    /// Unix seconds after which the bucket of `hour` is past the retention.
    fn expires(&self, hour: u64) -> Option<u64> {
        (self.retention_hours > 0).then(|| (hour + self.retention_hours + 1) * 3600)
    }
}

fn counts(u: &Usage) -> String {
    format!("{} {} {}", u.requests, u.tokens_in, u.tokens_out)
}

fn parse_counts(text: &str) -> Option<Usage> {
    let mut it = text.split(' ').map(|n| n.parse::<u64>().ok());
    Some(Usage {
        requests: it.next()??,
        tokens_in: it.next()??,
        tokens_out: it.next()??,
    })
}

impl UsageMirror for SharedUsage {
    fn publish(&self, buckets: &[(Key, Usage)], totals: Usage) -> Result<bool, String> {
        for chunk in buckets.chunks(CHUNK) {
            let mut pipe = redis::pipe();
            let mut hours = HashSet::new();
            for (key, usage) in chunk {
                let field =
                    serde_json::to_string(&[&key.key, &key.tenant, &key.model, &key.worker])
                        .map_err(|e| e.to_string())?;
                let hash = format!("{BUCKETS}{}:{}", self.relay, key.hour);
                pipe.hset(&hash, field, counts(usage)).ignore();
                if hours.insert(key.hour) {
                    let member = format!("{}:{}", self.relay, key.hour);
                    pipe.zadd(HOURS, member, key.hour).ignore();
                    if let Some(at) = self.expires(key.hour) {
                        pipe.cmd("EXPIREAT").arg(&hash).arg(at).ignore();
                    }
                }
            }
            self.redis.call(|c| pipe.query::<()>(c))?;
        }
        let now = unix_now();
        let mut pipe = redis::pipe();
        let entry = format!("{} {now}", counts(&totals));
        pipe.hset(RELAYS, &self.relay, entry);
        if self.retention_hours > 0 {
            let cutoff = (now / 3600).saturating_sub(self.retention_hours);
            pipe.cmd("ZREMRANGEBYSCORE")
                .arg(HOURS)
                .arg("-inf")
                .arg(format!("({cutoff}"))
                .ignore();
        }
        let (added,): (u8,) = self.redis.call(|c| pipe.query(c))?;
        Ok(added == 1)
    }

    fn others(&self, from_hour: u64, to_hour: u64) -> Result<Others, String> {
        if to_hour <= from_hour {
            return Ok(Others::default());
        }
        let (relays, members): (Vec<String>, Vec<String>) = self.redis.call(|c| {
            redis::pipe()
                .cmd("HKEYS")
                .arg(RELAYS)
                .cmd("ZRANGEBYSCORE")
                .arg(HOURS)
                .arg(from_hour)
                .arg(to_hour - 1)
                .arg("LIMIT")
                .arg(0)
                .arg(MAX_HASHES)
                .query(c)
        })?;
        let mine = format!("{}:", self.relay);
        let hashes: Vec<String> = members
            .into_iter()
            .filter(|m| !m.starts_with(&mine))
            .map(|m| format!("{BUCKETS}{m}"))
            .collect();
        let mut buckets = Vec::new();
        for chunk in hashes.chunks(CHUNK) {
            let mut pipe = redis::pipe();
            for hash in chunk {
                pipe.hgetall(hash);
            }
            let replies: Vec<std::collections::HashMap<String, String>> =
                self.redis.call(|c| pipe.query(c))?;
            for (hash, fields) in chunk.iter().zip(replies) {
                let Some(hour) = hash.rsplit(':').next().and_then(|h| h.parse().ok()) else {
                    continue;
                };
                buckets.extend(fields.into_iter().filter_map(|(field, value)| {
                    let [key, tenant, model, worker]: [String; 4] =
                        serde_json::from_str(&field).ok()?;
                    let key = Key {
                        hour,
                        key,
                        tenant,
                        model,
                        worker,
                    };
                    Some((key, parse_counts(&value)?))
                }));
            }
        }
        Ok(Others {
            relays: relays.len().max(1),
            buckets,
        })
    }

    fn others_totals(&self) -> Result<Usage, String> {
        let all: std::collections::HashMap<String, String> = self
            .redis
            .call(|c| redis::cmd("HGETALL").arg(RELAYS).query(c))?;
        let oldest = match self.retention_hours {
            0 => 0,
            hours => unix_now().saturating_sub(hours * 3600),
        };
        let mut sum = Usage::default();
        for (relay, entry) in all {
            if relay == self.relay {
                continue;
            }
            let (figures, at) = entry.rsplit_once(' ').unwrap_or((&entry, "0"));
            let fresh = at.parse::<u64>().is_ok_and(|at| at >= oldest);
            if let (true, Some(u)) = (fresh, parse_counts(figures)) {
                sum.add(&u);
            }
        }
        Ok(sum)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_round_trip_and_bad_text_is_none() {
        let u = Usage {
            requests: 3,
            tokens_in: 120,
            tokens_out: 45,
        };
        assert_eq!(parse_counts(&counts(&u)), Some(u));
        assert_eq!(parse_counts("1 2"), None);
        assert_eq!(parse_counts("a b c"), None);
    }
}
