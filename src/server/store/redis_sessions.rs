//! Dashboard sessions and lifecycle tasks in Redis.
//!
//! - `modelrelay:session:<sha256 hex>`: set with the session's life as its expiry,
//!   deleted at sign-out. Only the hash of a session id is stored, as in each relay's
//!   memory.
//! - `modelrelay:task:<task id>`: the task's JSON as its relay last published it.

use std::sync::Arc;
use std::time::Duration;

use super::redis::Redis;
use super::{SessionMirror, TaskMirror};

pub struct SharedSessions {
    redis: Arc<Redis>,
}

impl SharedSessions {
    pub fn new(redis: Arc<Redis>) -> SharedSessions {
        SharedSessions { redis }
    }
}

fn name(key: &[u8; 32]) -> String {
    let hex: String = key.iter().map(|b| format!("{b:02x}")).collect();
    format!("modelrelay:session:{hex}")
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX).max(1)
}

impl SessionMirror for SharedSessions {
    fn put(&self, key: &[u8; 32], ttl: Duration) -> Result<(), String> {
        self.redis.call(|c| {
            redis::cmd("SET")
                .arg(name(key))
                .arg(1)
                .arg("PX")
                .arg(millis(ttl))
                .query::<()>(c)
        })
    }

    fn remaining(&self, key: &[u8; 32]) -> Result<Option<Duration>, String> {
        let ms: i64 = self
            .redis
            .call(|c| redis::cmd("PTTL").arg(name(key)).query(c))?;
        // -2: no such key; -1: no expiry (never written so by a relay: treated as gone).
        Ok(u64::try_from(ms)
            .ok()
            .filter(|&ms| ms > 0)
            .map(Duration::from_millis))
    }

    fn remove(&self, key: &[u8; 32]) -> Result<(), String> {
        self.redis
            .call(|c| redis::cmd("DEL").arg(name(key)).query::<()>(c))
    }
}

pub struct SharedTasks {
    redis: Arc<Redis>,
}

impl SharedTasks {
    pub fn new(redis: Arc<Redis>) -> SharedTasks {
        SharedTasks { redis }
    }
}

impl TaskMirror for SharedTasks {
    fn put(&self, task_id: &str, json: &str, keep: Duration) -> Result<(), String> {
        self.redis.call(|c| {
            redis::cmd("SET")
                .arg(format!("modelrelay:task:{task_id}"))
                .arg(json)
                .arg("PX")
                .arg(millis(keep))
                .query::<()>(c)
        })
    }

    fn get(&self, task_id: &str) -> Result<Option<String>, String> {
        self.redis.call(|c| {
            redis::cmd("GET")
                .arg(format!("modelrelay:task:{task_id}"))
                .query(c)
        })
    }
}
