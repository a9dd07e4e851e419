//! The usage journal: hourly token counts per (API key, tenant, model, worker), kept in
//! memory and persisted in `STATE_DIR/usage.journal`.
//!
//! # Format
//! An append-only text file, one self-delimiting JSON record per line:
//! `{"h":482113,"k":"key-id","t":"tenant","m":"model","w":"worker","n":3,"i":120,"o":45}`
//! where `h` is the hour (unix seconds / 3600), `n` the requests, `i` the input tokens
//! and `o` the output tokens. A record is a *delta*: loading sums all records of a
//! bucket (same hour, key, tenant, model and worker).
//!
//! # Crash safety
//! [`Journal::add`] only touches memory; [`Journal::flush`] (called by the server at
//! least once a second) appends one record per bucket changed since the last flush and
//! fsyncs, so `kill -9` or a power cut loses at most the deltas of the last second. A
//! crash mid-write leaves a torn last line: on load it is skipped with a warning, never
//! fatal. A corrupt line elsewhere is skipped the same way and counted
//! ([`Stats::corrupt_skipped`]); a file with skipped lines is rewritten clean on open. A
//! failed append is truncated back and its deltas kept in memory for the next flush.
//!
//! # Retention
//! Buckets more than `retention_days` × 24 hours older than the newest hour seen (the
//! clock at open, or the newest bucket added) are dropped on load, once a day from
//! memory, and at compaction; late adds for such hours are ignored. `retention_days = 0`
//! keeps everything.
//!
//! # Compaction
//! Every bucket changed in a flush adds a record, so the file grows faster than the set
//! of live buckets. When it holds more than twice as many records as there are live
//! buckets (and at least [`COMPACT_MIN_RECORDS`]), the next flush (or open) rewrites it
//! with one record per live bucket, atomically: temp file, fsync, rename over the
//! journal, fsync the directory. The file thus stays under about twice its compacted
//! size, and memory holds only the live buckets (names interned once).

use std::collections::{HashMap, HashSet};
use std::fs::{self, File};
use std::io::{self, BufRead, BufReader, Write};
use std::path::{Path, PathBuf};

use parking_lot::Mutex;
use serde::{Deserialize, Serialize};

/// The journal's file name inside the state directory.
pub const FILE_NAME: &str = "usage.journal";
/// Below this many records the file is never compacted (not worth the rewrite).
pub const COMPACT_MIN_RECORDS: u64 = 4096;
/// Corrupt lines reported one by one on load; the rest only in the summary.
const WARN_LINES: u64 = 10;

/// Counts of one bucket or of a sum of buckets; additions saturate.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Usage {
    pub requests: u64,
    pub tokens_in: u64,
    pub tokens_out: u64,
}

impl Usage {
    /// Adds `other` into `self`, saturating at `u64::MAX`.
    pub fn add(&mut self, other: &Usage) {
        self.requests = self.requests.saturating_add(other.requests);
        self.tokens_in = self.tokens_in.saturating_add(other.tokens_in);
        self.tokens_out = self.tokens_out.saturating_add(other.tokens_out);
    }
}

/// A bucket: one hour of one (API key, tenant, model, worker).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Key {
    /// Unix seconds / 3600.
    pub hour: u64,
    pub key: String,
    pub tenant: String,
    pub model: String,
    pub worker: String,
}

/// The dimension [`Journal::query`] groups by.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GroupBy {
    Key,
    Tenant,
    Model,
    Worker,
}

/// The time bucket [`Journal::query`] sums into (UTC days for `Day`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Bucket {
    Hour,
    Day,
}

/// One query result: a time bucket, a group value, and its usage.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Row {
    /// Start of the hour or day, unix seconds.
    pub start: u64,
    pub group: String,
    pub usage: Usage,
}

/// Figures about the journal, for logs, metrics and the bench.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Stats {
    pub live_buckets: u64,
    pub file_records: u64,
    pub file_bytes: u64,
    /// Lines skipped as torn or corrupt when the journal was opened.
    pub corrupt_skipped: u64,
    pub compactions: u64,
}

/// A bucket with its names interned (indexes into [`Names`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct Slot {
    hour: u64,
    key: u32,
    tenant: u32,
    model: u32,
    worker: u32,
}

/// Every key, tenant, model and worker name seen, stored once.
#[derive(Debug, Default)]
struct Names {
    list: Vec<String>,
    index: HashMap<String, u32>,
}

impl Names {
    fn id(&mut self, name: &str) -> u32 {
        if let Some(&id) = self.index.get(name) {
            return id;
        }
        let id = u32::try_from(self.list.len()).unwrap_or(u32::MAX);
        self.list.push(name.to_string());
        self.index.insert(name.to_string(), id);
        id
    }

    fn get(&self, id: u32) -> &str {
        self.list.get(id as usize).map_or("", String::as_str)
    }

    fn slot(&mut self, key: &Key) -> Slot {
        Slot {
            hour: key.hour,
            key: self.id(&key.key),
            tenant: self.id(&key.tenant),
            model: self.id(&key.model),
            worker: self.id(&key.worker),
        }
    }
}

/// A line of the file as written.
#[derive(Serialize)]
struct RecordOut<'a> {
    h: u64,
    k: &'a str,
    t: &'a str,
    m: &'a str,
    w: &'a str,
    n: u64,
    i: u64,
    o: u64,
}

/// A line of the file as read.
#[derive(Deserialize)]
struct RecordIn {
    h: u64,
    k: String,
    t: String,
    m: String,
    w: String,
    n: u64,
    i: u64,
    o: u64,
}

/// In-memory buckets; guarded by `Journal::state`.
#[derive(Debug, Default)]
struct State {
    names: Names,
    live: HashMap<Slot, Usage>,
    pending: HashMap<Slot, Usage>,
    /// Buckets changed since the shared store last took them (`None`: no shared store).
    unpublished: Option<HashSet<Slot>>,
    totals: Usage,
    newest_hour: u64,
    pruned_at_hour: u64,
}

/// The append handle and file figures; guarded by `Journal::writer`, which a flush
/// holds throughout so flushes and compactions never interleave.
#[derive(Debug, Default)]
struct Writer {
    file: Option<File>,
    records: u64,
    bytes: u64,
    corrupt_skipped: u64,
    compactions: u64,
}

/// What a flush writes, taken from the state under its lock.
struct Batch {
    /// The pending deltas taken (merged back if the write fails).
    taken: Vec<(Slot, Usage)>,
    work: Work,
}

enum Work {
    /// Encoded lines to append, and how many.
    Append(Vec<u8>, u64),
    /// A snapshot of the names and every live bucket, to replace the file with.
    Compact(Vec<String>, Vec<(Slot, Usage)>),
}

/// The usage store: thread-safe, cheap `add`, durable on `flush`.
#[derive(Debug)]
pub struct Journal {
    dir: PathBuf,
    retention_hours: u64,
    state: Mutex<State>,
    writer: Mutex<Writer>,
}

impl State {
    /// Oldest hour kept (0 = keep everything).
    fn cutoff(&self, retention_hours: u64) -> u64 {
        if retention_hours == 0 {
            return 0;
        }
        self.newest_hour.saturating_sub(retention_hours - 1)
    }

    fn merge(&mut self, slot: Slot, usage: &Usage, pending: bool) {
        self.live.entry(slot).or_default().add(usage);
        if pending {
            self.pending.entry(slot).or_default().add(usage);
            if let Some(unpublished) = &mut self.unpublished {
                unpublished.insert(slot);
            }
        }
        self.totals.add(usage);
        self.newest_hour = self.newest_hour.max(slot.hour);
    }

    /// Drops buckets older than the retention and recomputes the totals.
    fn prune(&mut self, retention_hours: u64) {
        let cutoff = self.cutoff(retention_hours);
        self.pruned_at_hour = self.newest_hour;
        self.live.retain(|slot, _| slot.hour >= cutoff);
        self.pending.retain(|slot, _| slot.hour >= cutoff);
        if let Some(unpublished) = &mut self.unpublished {
            unpublished.retain(|slot| slot.hour >= cutoff);
        }
        let mut totals = Usage::default();
        for usage in self.live.values() {
            totals.add(usage);
        }
        self.totals = totals;
    }

    fn prune_if_due(&mut self, retention_hours: u64) {
        if retention_hours > 0 && self.newest_hour >= self.pruned_at_hour.saturating_add(24) {
            self.prune(retention_hours);
        }
    }

    /// Takes the pending deltas, or a snapshot of everything live when compaction is
    /// due (encoded later, outside the lock).
    fn take_batch(&mut self, file_records: u64, force_compact: bool) -> Batch {
        let taken: Vec<(Slot, Usage)> = self.pending.drain().collect();
        let live = self.live.len() as u64;
        let after = file_records.saturating_add(taken.len() as u64);
        if force_compact || (after >= COMPACT_MIN_RECORDS && after > 2 * live) {
            let all: Vec<(Slot, Usage)> = self.live.iter().map(|(s, u)| (*s, *u)).collect();
            return Batch {
                taken,
                work: Work::Compact(self.names.list.clone(), all),
            };
        }
        let body = encode(&self.names.list, &taken);
        let records = taken.len() as u64;
        Batch {
            taken,
            work: Work::Append(body, records),
        }
    }

    /// Puts deltas back after a failed write so the next flush retries them.
    fn restore(&mut self, taken: Vec<(Slot, Usage)>) {
        for (slot, usage) in taken {
            self.pending.entry(slot).or_default().add(&usage);
        }
    }
}

impl Journal {
    /// Opens (or creates) `dir/usage.journal`, loading and summing its records, dropping
    /// buckets older than `retention_days` (0 = keep all) before `now_unix_secs`, and
    /// compacting the file if it is due or had torn/corrupt lines.
    pub fn open(dir: &Path, retention_days: u32, now_unix_secs: u64) -> Result<Journal, String> {
        crate::server::private_fs::create_dir(dir)
            .map_err(|e| format!("cannot create usage dir {}: {e}", dir.display()))?;
        let journal = Journal {
            dir: dir.to_path_buf(),
            retention_hours: u64::from(retention_days) * 24,
            state: Mutex::new(State {
                newest_hour: now_unix_secs / 3600,
                ..State::default()
            }),
            writer: Mutex::new(Writer::default()),
        };
        journal.load()?;
        Ok(journal)
    }

    /// The journal file's path.
    pub fn path(&self) -> PathBuf {
        self.dir.join(FILE_NAME)
    }

    fn load(&self) -> Result<(), String> {
        let path = self.path();
        let mut writer = self.writer.lock();
        let mut state = self.state.lock();
        let file = match File::open(&path) {
            Ok(file) => file,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
            Err(e) => return Err(format!("cannot open {}: {e}", path.display())),
        };
        let read = read_records(file, &mut state)
            .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
        writer.records = read.records;
        writer.bytes = read.bytes;
        writer.corrupt_skipped = read.corrupt;
        if read.corrupt > 0 {
            log::warn!(
                "usage journal {}: skipped {} torn or corrupt line(s) of {}; rewriting it",
                path.display(),
                read.corrupt,
                read.records + read.corrupt
            );
        }
        state.prune(self.retention_hours);
        let dirty = read.corrupt > 0 || !read.ends_clean;
        let batch = state.take_batch(writer.records, dirty);
        drop(state);
        if matches!(batch.work, Work::Compact(..)) {
            self.write_batch(&mut writer, batch)
                .map_err(|e| format!("cannot compact {}: {e}", path.display()))?;
        }
        Ok(())
    }

    /// Records usage for one bucket (memory only; made durable by [`Journal::flush`]).
    /// Adds for hours older than the retention are ignored.
    pub fn add(&self, key: Key, usage: Usage) {
        let mut state = self.state.lock();
        if key.hour < state.cutoff(self.retention_hours) {
            return;
        }
        let slot = state.names.slot(&key);
        state.merge(slot, &usage, true);
    }

    /// Appends one record per bucket changed since the last flush and fsyncs; or, when
    /// due, compacts the file instead. `add` is only blocked while the deltas are taken,
    /// not during the write.
    pub fn flush(&self) -> io::Result<()> {
        self.flush_with(false)
    }

    /// Rewrites the file now with one record per live bucket (also writes pending deltas).
    pub fn compact(&self) -> io::Result<()> {
        self.flush_with(true)
    }

    fn flush_with(&self, force_compact: bool) -> io::Result<()> {
        let mut writer = self.writer.lock();
        let batch = {
            let mut state = self.state.lock();
            state.prune_if_due(self.retention_hours);
            if state.pending.is_empty() && !force_compact {
                return Ok(());
            }
            state.take_batch(writer.records, force_compact)
        };
        self.write_batch(&mut writer, batch)
    }

    fn write_batch(&self, writer: &mut Writer, batch: Batch) -> io::Result<()> {
        let result = match &batch.work {
            Work::Append(body, records) => self.append(writer, body, *records),
            Work::Compact(names, all) => self.rewrite(writer, names, all),
        };
        if result.is_err() {
            self.state.lock().restore(batch.taken);
        }
        result
    }

    fn append(&self, writer: &mut Writer, body: &[u8], records: u64) -> io::Result<()> {
        if writer.file.is_none() {
            writer.file = Some(open_append(&self.path())?);
        }
        let Some(file) = writer.file.as_mut() else {
            return Ok(());
        };
        let written = file.write_all(body).and_then(|()| file.sync_data());
        if let Err(e) = written {
            // Cut a partial write back so a retry cannot duplicate or tear records.
            let _ = file.set_len(writer.bytes);
            return Err(e);
        }
        writer.records += records;
        writer.bytes += body.len() as u64;
        Ok(())
    }

    /// Replaces the file atomically: temp file, fsync, rename, fsync the directory. The
    /// records are encoded in chunks straight into the temp file.
    fn rewrite(
        &self,
        writer: &mut Writer,
        names: &[String],
        all: &[(Slot, Usage)],
    ) -> io::Result<()> {
        let tmp = self
            .dir
            .join(format!(".{FILE_NAME}.{}.tmp", std::process::id()));
        let mut file = crate::server::private_fs::options()
            .write(true)
            .truncate(true)
            .open(&tmp)?;
        let mut bytes = 0u64;
        for chunk in all.chunks(4096) {
            let body = encode(names, chunk);
            file.write_all(&body)?;
            bytes += body.len() as u64;
        }
        file.sync_all()?;
        drop(file);
        writer.file = None;
        fs::rename(&tmp, self.path())?;
        if let Ok(dir) = File::open(&self.dir) {
            let _ = dir.sync_all();
        }
        writer.records = all.len() as u64;
        writer.bytes = bytes;
        writer.compactions += 1;
        writer.file = Some(open_append(&self.path())?);
        Ok(())
    }

    /// Sums the buckets with `from_hour <= hour < to_hour`, grouped by `group_by` and
    /// summed per hour or UTC day; sorted by bucket start, then group value.
    pub fn query(
        &self,
        from_hour: u64,
        to_hour: u64,
        group_by: GroupBy,
        bucket: Bucket,
    ) -> Vec<Row> {
        let (sums, names) = {
            let state = self.state.lock();
            let mut sums: HashMap<(u64, u32), Usage> = HashMap::new();
            for (slot, usage) in &state.live {
                if slot.hour < from_hour || slot.hour >= to_hour {
                    continue;
                }
                let group = match group_by {
                    GroupBy::Key => slot.key,
                    GroupBy::Tenant => slot.tenant,
                    GroupBy::Model => slot.model,
                    GroupBy::Worker => slot.worker,
                };
                sums.entry((bucket_start(slot.hour, bucket), group))
                    .or_default()
                    .add(usage);
            }
            let ids: Vec<u32> = sums.keys().map(|(_, id)| *id).collect();
            let names: HashMap<u32, String> = ids
                .into_iter()
                .map(|id| (id, state.names.get(id).to_string()))
                .collect();
            (sums, names)
        };
        let mut rows: Vec<Row> = sums
            .into_iter()
            .map(|((start, id), usage)| Row {
                start,
                group: names.get(&id).cloned().unwrap_or_default(),
                usage,
            })
            .collect();
        rows.sort_by(|a, b| (a.start, &a.group).cmp(&(b.start, &b.group)));
        rows
    }

    /// Starts tracking what the shared store lacks: every live bucket to begin with (a
    /// restarted relay publishes all it has again; absolute values, so nothing adds twice).
    pub fn track_unpublished(&self) {
        let mut state = self.state.lock();
        let all = state.live.keys().copied().collect();
        state.unpublished = Some(all);
    }

    /// The buckets changed since the last call, with their absolute values now; they
    /// count as published until [`Journal::mark_unpublished`] puts them back.
    pub fn take_unpublished(&self) -> Vec<(Key, Usage)> {
        let mut state = self.state.lock();
        let Some(slots) = state.unpublished.as_mut().map(std::mem::take) else {
            return Vec::new();
        };
        let name = |id: u32| state.names.get(id).to_string();
        slots
            .into_iter()
            .filter_map(|slot| {
                let usage = *state.live.get(&slot)?;
                let key = Key {
                    hour: slot.hour,
                    key: name(slot.key),
                    tenant: name(slot.tenant),
                    model: name(slot.model),
                    worker: name(slot.worker),
                };
                Some((key, usage))
            })
            .collect()
    }

    /// Puts buckets back after a failed publication, for the next one.
    pub fn mark_unpublished(&self, keys: impl IntoIterator<Item = Key>) {
        let mut state = self.state.lock();
        for key in keys {
            let slot = state.names.slot(&key);
            if let Some(unpublished) = &mut state.unpublished {
                unpublished.insert(slot);
            }
        }
    }

    /// Whether some bucket still waits for the shared store.
    pub fn has_unpublished(&self) -> bool {
        self.state
            .lock()
            .unpublished
            .as_ref()
            .is_some_and(|u| !u.is_empty())
    }

    /// The sum of every live bucket (flushed or not).
    pub fn totals(&self) -> Usage {
        self.state.lock().totals
    }

    /// File and memory figures.
    pub fn stats(&self) -> Stats {
        let writer = self.writer.lock();
        let live_buckets = self.state.lock().live.len() as u64;
        Stats {
            live_buckets,
            file_records: writer.records,
            file_bytes: writer.bytes,
            corrupt_skipped: writer.corrupt_skipped,
            compactions: writer.compactions,
        }
    }
}

mod file;
pub use file::bucket_start;
use file::*;

#[cfg(test)]
mod tests;
