//! Streams held on the worker ([`crate::protocol::held`]): a resumable answer survives
//! the death of the relay it streamed through.
//!
//! A request that came with `held` numbers its events as the relay does (the relay's
//! own buffer code, [`Events`]) and keeps them. When the relay's socket drops, the
//! request is not cancelled: it goes on into the buffer for its grace period; a relay
//! that sends `attach` with the right proof gets the events after the client's last
//! one and then the rest live ([`stream`]). Nobody within the grace period: the reaper
//! thread cancels it at the backend, as a lost relay's requests always were.
//!
//! Bounded per stream (`HELD_STREAM_BYTES`) and for all streams (`HELD_TOTAL_BYTES`): while a
//! relay reads, the oldest events (already sent) make room; past a cap with nobody
//! reading, the stream is given up and cancelled as before.

pub mod stream;

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use log::info;
use parking_lot::{Condvar, Mutex};

use super::inflight::Handle;
use super::relays::session::Link;
use crate::protocol::held::{Attach, Hold, MAX_PROOF};
pub use stream::Stream;

/// Default of `HELD_STREAM_BYTES` (the relay's `RESUME_BUFFER_BYTES` default).
pub const STREAM_BYTES: usize = 1 << 20;
/// Default of `HELD_TOTAL_BYTES`.
pub const TOTAL_BYTES: usize = 64 << 20;
/// Charged per stream besides its events.
pub const STREAM_OVERHEAD: usize = 512;
/// The longest grace period a relay may ask for.
const MAX_GRACE: Duration = Duration::from_secs(600);
/// How often the reaper looks while streams are held.
const REAP_EVERY: Duration = Duration::from_millis(250);
/// How long it sleeps with none (an insert wakes it).
const IDLE_WAIT: Duration = Duration::from_secs(3600);

/// The held streams of this worker, by request id.
pub struct HeldStreams {
    /// Most bytes one stream keeps (`HELD_STREAM_BYTES`).
    stream_cap: usize,
    /// Most bytes all streams keep (`HELD_TOTAL_BYTES`).
    total_cap: usize,
    streams: Mutex<HashMap<String, Arc<Stream>>>,
    /// The streams resumed through a relay, by the id that relay gave the resume (so a
    /// `cancel` finds its stream without a scan).
    resumes: Mutex<HashMap<(usize, String), Arc<Stream>>>,
    /// Bytes charged by all streams.
    bytes: Arc<AtomicUsize>,
    /// Wakes the reaper when a stream loses its reader.
    wake: Condvar,
}

impl Default for HeldStreams {
    fn default() -> HeldStreams {
        HeldStreams::new(STREAM_BYTES, TOTAL_BYTES)
    }
}

impl HeldStreams {
    pub fn new(stream_cap: usize, total_cap: usize) -> HeldStreams {
        HeldStreams {
            stream_cap,
            total_cap,
            streams: Mutex::default(),
            resumes: Mutex::default(),
            bytes: Arc::default(),
            wake: Condvar::new(),
        }
    }

    /// Starts holding request `id` of relay `relay`; `None` when it does not qualify
    /// or the total cap leaves no room (it then runs as any other request).
    pub fn open(
        &self,
        relay: usize,
        id: &str,
        hold: &Hold,
        handle: &Arc<Handle>,
    ) -> Option<Arc<Stream>> {
        if hold.proof.is_empty() || hold.proof.len() > MAX_PROOF || hold.grace_secs == 0 {
            return None;
        }
        let mut streams = self.streams.lock();
        if self.bytes.load(Ordering::Relaxed) + STREAM_OVERHEAD > self.total_cap {
            return None;
        }
        self.bytes.fetch_add(STREAM_OVERHEAD, Ordering::Relaxed);
        let grace = Duration::from_secs(hold.grace_secs).min(MAX_GRACE);
        let stream = Arc::new(Stream::new(
            id,
            relay,
            hold.proof.clone(),
            grace,
            handle.clone(),
            self.bytes.clone(),
            (self.stream_cap, self.total_cap),
        ));
        if let Some(old) = streams.insert(id.to_string(), stream.clone()) {
            self.release(&old);
        }
        self.wake.notify_all();
        Some(stream)
    }

    /// Relay `relay`'s session ended: its held streams that still run go on for their
    /// grace period. Returns their ids (not to be cancelled).
    pub fn relay_lost(&self, relay: usize) -> Vec<String> {
        let streams: Vec<Arc<Stream>> = self.streams.lock().values().cloned().collect();
        let mut kept = Vec::new();
        for s in streams {
            if s.relay_lost(relay, Instant::now()) {
                info!("request {}: relay lost; stream held for a resume", s.id());
                kept.push(s.id().to_string());
            }
        }
        self.wake.notify_all();
        kept
    }

    /// A `cancel` from relay `relay`: true when it concerned a held stream and is taken
    /// care of here (a resume's reader left; or the stream moved to another relay).
    pub fn cancel(&self, relay: usize, id: &str) -> bool {
        let key = (relay, id.to_string());
        let resumed = self.resumes.lock().remove(&key);
        let stream = resumed.or_else(|| self.streams.lock().get(id).cloned());
        let taken = stream.is_some_and(|s| s.cancel_from(relay, id, Instant::now()));
        self.wake.notify_all();
        taken
    }

    /// An `attach` from `link`'s relay: the holder answers it; any other stream id is
    /// answered `stream_not_held`.
    pub fn attach(&self, link: &Link, msg: &Attach) {
        let stream = self.streams.lock().get(&msg.stream_id).cloned();
        let Some(s) = stream else {
            return stream::refuse(&link.out, &msg.request_id, stream::Refusal::NotHeld);
        };
        s.attach(link, msg, Instant::now());
        if s.read_by(link.relay, &msg.request_id) {
            let mut resumes = self.resumes.lock();
            // Resumes of streams that are over, or taken over since, go first.
            resumes.retain(|(relay, id), s| s.read_by(*relay, id));
            resumes.insert((link.relay, msg.request_id.clone()), s);
        }
    }

    /// Bytes charged now.
    pub fn bytes(&self) -> usize {
        self.bytes.load(Ordering::Relaxed)
    }

    /// Streams remembered now.
    pub fn len(&self) -> usize {
        self.streams.lock().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// One round of the reaper: cancels streams nobody read for their grace period,
    /// forgets ended ones past it. Returns how long it may sleep.
    pub fn reap(&self, now: Instant) -> Duration {
        let streams: Vec<Arc<Stream>> = self.streams.lock().values().cloned().collect();
        let mut gone = Vec::new();
        for s in &streams {
            if s.reap(now) {
                gone.push(s.clone());
            }
        }
        if !gone.is_empty() {
            let mut map = self.streams.lock();
            for s in gone {
                if map.get(s.id()).is_some_and(|x| Arc::ptr_eq(x, &s)) {
                    map.remove(s.id());
                    self.release(&s);
                }
            }
        }
        REAP_EVERY
    }

    fn release(&self, s: &Stream) {
        let freed = s.forget() + STREAM_OVERHEAD;
        self.bytes.fetch_sub(freed, Ordering::Relaxed);
    }

    /// Runs the reaper for the life of the process. With no stream held it sleeps
    /// until one is (emptiness is judged under the lock [`HeldStreams::open`] inserts
    /// under, so that wake-up cannot be missed).
    pub fn run_reaper(&self) {
        loop {
            let wait = self.reap(Instant::now());
            let mut guard = self.streams.lock();
            let wait = if guard.is_empty() { IDLE_WAIT } else { wait };
            self.wake.wait_for(&mut guard, wait);
        }
    }
}

#[cfg(test)]
mod tests;
