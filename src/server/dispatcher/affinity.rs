//! Cache affinity memory: which prompt prefixes each worker was recently sent, per model.
//!
//! A backend keeps the KV cache of the prompts it evaluated lately, so the next turn of
//! a conversation costs only its new tokens if it lands on the same backend. The
//! dispatcher remembers, per worker, the fingerprints (see `server/fingerprint.rs`) of
//! the requests it dispatched there, keyed by model: a bounded least-recently-used set
//! of [`PER_WORKER`] entries. It forgets a worker's entries when the worker leaves or
//! its backend goes down, and a model's when it is unloaded, flushed or no longer
//! advertised or loaded there: the cache went with it.
//!
//! Memory: an entry is a 24-byte slot plus a 16-byte hash-table bucket with its control
//! byte (two buckets per entry at worst), so a worker whose set is full costs about
//! [`PER_WORKER`] × 58 bytes ≈ 116 KiB; an idle worker costs nothing. Only 64-bit keyed
//! hashes are kept, never prompt text.
//!
//! The routing policy that reads this lives in `routing.rs`.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

use super::ids::IdMap;
use super::WorkerId;

/// Fingerprints remembered per worker (across its models).
pub const PER_WORKER: usize = 2048;

/// An entry of the set: a fingerprint mixed with its model.
type Key = u64;

const NIL: u32 = u32::MAX;

/// The model a fingerprint was seen with, as a fixed (unkeyed) hash of its name: only
/// compared, never shown.
pub fn model_key(model: &str) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    h.write(model.as_bytes());
    h.finish()
}

/// What the dispatcher remembers for affinity, and who waits for which worker.
#[derive(Debug, Default)]
pub struct Affinity {
    workers: IdMap<Lru>,
    /// Requests waiting for a full worker that holds their prefix, per worker.
    waiting: IdMap<u32>,
}

impl Affinity {
    /// How many of `prints` (shortest first) `worker` holds as a prefix for `model`:
    /// the position of the longest one it holds, plus one (0: none).
    pub fn matched(&self, worker: WorkerId, model: u64, prints: &[u64]) -> usize {
        let Some(lru) = self.workers.get(&worker) else {
            return 0;
        };
        (0..prints.len())
            .rev()
            .find(|i| lru.contains(mix(prints[*i], model), model))
            .map_or(0, |i| i + 1)
    }

    /// Notes that `worker` was sent a prompt with `prints` for `model`.
    pub fn remember(&mut self, worker: WorkerId, model: u64, prints: &[u64]) {
        if prints.is_empty() {
            return;
        }
        let lru = self.workers.entry(worker).or_insert_with(Lru::new);
        for p in prints {
            lru.touch(mix(*p, model), model);
        }
    }

    /// Forgets everything about `worker` (it left, or its backend restarted).
    pub fn forget_worker(&mut self, worker: WorkerId) {
        self.workers.remove(&worker);
    }

    /// Forgets `model`'s prefixes on `worker` (unloaded, flushed, no longer served).
    pub fn forget_model(&mut self, worker: WorkerId, model: u64) {
        if let Some(lru) = self.workers.get_mut(&worker) {
            lru.retain(|m| m != model);
            if lru.len() == 0 {
                self.workers.remove(&worker);
            }
        }
    }

    /// Fingerprints held for `worker` (`/admin/workers`).
    pub fn held(&self, worker: WorkerId) -> usize {
        self.workers.get(&worker).map_or(0, Lru::len)
    }

    /// Requests waiting for `worker` right now.
    pub fn waiting_for(&self, worker: WorkerId) -> u32 {
        self.waiting.get(&worker).copied().unwrap_or(0)
    }

    pub fn start_wait(&mut self, worker: WorkerId) {
        *self.waiting.entry(worker).or_default() += 1;
    }

    pub fn end_wait(&mut self, worker: WorkerId) {
        if let Some(n) = self.waiting.get_mut(&worker) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                self.waiting.remove(&worker);
            }
        }
    }
}

/// Keys are already keyed hashes, uniformly spread and unknown to clients: the table
/// uses them as they are instead of hashing them again.
#[derive(Default)]
struct Identity(u64);

impl Hasher for Identity {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(*b);
        }
    }
    fn write_u64(&mut self, n: u64) {
        self.0 = n;
    }
}

fn mix(print: u64, model: u64) -> Key {
    print ^ model.rotate_left(29)
}

#[derive(Debug, Clone, Copy)]
struct Slot {
    key: Key,
    model: u64,
    /// Towards the most recently used.
    newer: u32,
    /// Towards the least recently used.
    older: u32,
}

/// A fixed-capacity LRU set: slots in a vector linked newest ↔ oldest, found through a
/// hash table. Every operation is O(1) except [`Lru::retain`] (a model forgotten).
#[derive(Debug)]
struct Lru {
    index: HashMap<Key, u32, BuildHasherDefault<Identity>>,
    slots: Vec<Slot>,
    /// Slots emptied by `retain`, reused first.
    free: Vec<u32>,
    newest: u32,
    oldest: u32,
}

impl Lru {
    fn new() -> Lru {
        Lru {
            index: HashMap::default(),
            slots: Vec::new(),
            free: Vec::new(),
            newest: NIL,
            oldest: NIL,
        }
    }

    fn len(&self) -> usize {
        self.index.len()
    }

    fn contains(&self, key: Key, model: u64) -> bool {
        self.index
            .get(&key)
            .is_some_and(|&i| self.slots[i as usize].model == model)
    }

    /// Marks `key` most recently used, inserting it (and evicting the oldest when full).
    fn touch(&mut self, key: Key, model: u64) {
        if let Some(&i) = self.index.get(&key) {
            self.unlink(i);
            self.slots[i as usize].model = model;
            self.push_newest(i);
            return;
        }
        let i = if self.index.len() >= PER_WORKER {
            let old = self.oldest;
            self.unlink(old);
            self.index.remove(&self.slots[old as usize].key);
            old
        } else if let Some(i) = self.free.pop() {
            i
        } else {
            self.slots.push(Slot {
                key,
                model,
                newer: NIL,
                older: NIL,
            });
            (self.slots.len() - 1) as u32
        };
        self.slots[i as usize].key = key;
        self.slots[i as usize].model = model;
        self.index.insert(key, i);
        self.push_newest(i);
    }

    /// Keeps only the entries whose model passes `keep`.
    fn retain(&mut self, keep: impl Fn(u64) -> bool) {
        let mut i = self.newest;
        while i != NIL {
            let slot = self.slots[i as usize];
            if !keep(slot.model) {
                self.unlink(i);
                self.index.remove(&slot.key);
                self.free.push(i);
            }
            i = slot.older;
        }
    }

    fn unlink(&mut self, i: u32) {
        let Slot { newer, older, .. } = self.slots[i as usize];
        match newer {
            NIL => self.newest = older,
            n => self.slots[n as usize].older = older,
        }
        match older {
            NIL => self.oldest = newer,
            o => self.slots[o as usize].newer = newer,
        }
    }

    fn push_newest(&mut self, i: u32) {
        let old_newest = self.newest;
        let slot = &mut self.slots[i as usize];
        slot.newer = NIL;
        slot.older = old_newest;
        match old_newest {
            NIL => self.oldest = i,
            n => self.slots[n as usize].newer = i,
        }
        self.newest = i;
    }
}

#[cfg(test)]
mod tests;
