//! The replay store: every nonce of an accepted op token, so a token works once.
//!
//! # Why bounding it is safe
//! A token is only accepted while its `issuedAt` is within [`super::WINDOW_SECS`] of the
//! clock. Once `issuedAt + WINDOW_SECS` has passed, the time check refuses the token
//! before its nonce is even looked up, so remembering that nonce protects nothing: it
//! may be forgotten. Entries are kept a further [`FORGET_MARGIN_SECS`] so a clock
//! stepped back a little does not reopen them. The store therefore only needs the
//! nonces of the last ten minutes or so (a token may be dated up to five minutes ahead);
//! [`MAX_ENTRIES`] caps it even under a flood of valid tokens, and when it is full of
//! live nonces new tokens are refused (`503`) rather than an old nonce forgotten early.
//!
//! # Persistence
//! `STATE_DIR/op-nonces`, append-only text, one `<issuedAt> <nonce>` line per accepted
//! token. The line is written and fsynced **before** the token is accepted, so a crash
//! or restart can never forget a nonce that was used. A crash mid-write leaves a torn
//! last line (no `\n`): that token was never accepted, so the line is skipped on load,
//! as is any other line that does not parse — never fatal. Opening the store rewrites
//! the file with the live entries only (temp file, fsync, rename, fsync the directory),
//! which also drops the torn tail; so does a running store once the file holds more than
//! twice its live entries (and at least [`COMPACT_MIN_LINES`]).

use std::collections::HashMap;
use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::path::{Path, PathBuf};

use parking_lot::Mutex;

use super::WINDOW_SECS;
use crate::server::private_fs;

/// The store's file name inside the state directory.
pub const FILE_NAME: &str = "op-nonces";
/// Most nonces remembered at once.
pub const MAX_ENTRIES: usize = 100_000;
/// Extra time a nonce is kept past the end of its token's validity.
pub const FORGET_MARGIN_SECS: u64 = 60;
/// Below this many lines the file is never rewritten while running.
pub const COMPACT_MIN_LINES: usize = 4096;

/// What [`NonceStore::remember`] decided.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Remembered {
    /// First use: recorded durably, the token may be accepted.
    Fresh,
    /// Seen before: refuse.
    Replayed,
    /// Full of live nonces: refuse for now.
    Full,
    /// Could not be made durable: refuse (accepting could reopen a replay on restart).
    Unavailable(String),
}

/// Nonces of accepted tokens, in memory and on disk. One lock around lookup, append
/// and insert, so two requests carrying the same token cannot both pass.
pub struct NonceStore {
    path: PathBuf,
    /// Most nonces held ([`MAX_ENTRIES`]; smaller in tests).
    capacity: usize,
    inner: Mutex<Inner>,
}

struct Inner {
    /// nonce → the `issuedAt` of its token (which decides when it may be forgotten).
    seen: HashMap<String, u64>,
    file: File,
    /// Lines in the file (for compaction).
    lines: usize,
}

/// Whether a nonce of a token issued at `issued_at` can be forgotten at `now`.
fn expired(issued_at: u64, now: u64) -> bool {
    issued_at.saturating_add(WINDOW_SECS + FORGET_MARGIN_SECS) < now
}

impl NonceStore {
    /// Opens (creating the directory and file when needed) `dir/op-nonces`, keeps the
    /// entries still live at `now`, and rewrites the file with only those. Unreadable
    /// lines are skipped with a warning; only I/O errors are returned.
    pub fn open(dir: &Path, now: u64) -> Result<NonceStore, String> {
        NonceStore::with_capacity(dir, now, MAX_ENTRIES)
    }

    /// [`NonceStore::open`] holding at most `capacity` nonces.
    pub fn with_capacity(dir: &Path, now: u64, capacity: usize) -> Result<NonceStore, String> {
        let path = dir.join(FILE_NAME);
        private_fs::create_dir(dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
        let text = match fs::read(&path) {
            Ok(bytes) => String::from_utf8_lossy(&bytes).into_owned(),
            Err(e) if e.kind() == io::ErrorKind::NotFound => String::new(),
            Err(e) => return Err(format!("cannot read {}: {e}", path.display())),
        };
        let (mut seen, skipped) = parse(&text);
        if skipped > 0 {
            log::warn!(
                "{}: skipped {skipped} unreadable line(s) (a torn last line after a crash is expected)",
                path.display()
            );
        }
        seen.retain(|_, issued_at| !expired(*issued_at, now));
        let file =
            rewrite(&path, &seen).map_err(|e| format!("cannot write {}: {e}", path.display()))?;
        let lines = seen.len();
        Ok(NonceStore {
            path,
            capacity,
            inner: Mutex::new(Inner { seen, file, lines }),
        })
    }

    /// Records `nonce` (of a token issued at `issued_at`) unless it was seen before.
    /// `Fresh` is returned only once the line is on disk.
    pub fn remember(&self, nonce: &str, issued_at: u64, now: u64) -> Remembered {
        let mut inner = self.inner.lock();
        if inner.seen.contains_key(nonce) {
            return Remembered::Replayed;
        }
        if inner.seen.len() >= self.capacity {
            inner.seen.retain(|_, at| !expired(*at, now));
            if inner.seen.len() >= self.capacity {
                return Remembered::Full;
            }
        }
        if let Err(e) = append(&mut inner.file, issued_at, nonce) {
            return Remembered::Unavailable(format!("cannot write {}: {e}", self.path.display()));
        }
        inner.seen.insert(nonce.to_string(), issued_at);
        inner.lines += 1;
        if inner.lines >= COMPACT_MIN_LINES && inner.lines > 2 * inner.seen.len() {
            self.compact(&mut inner, now);
        }
        Remembered::Fresh
    }

    /// Nonces remembered now.
    pub fn len(&self) -> usize {
        self.inner.lock().seen.len()
    }

    /// Whether no nonce is remembered.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Drops expired nonces and rewrites the file with the rest. On failure the old
    /// file (a superset) stays in use: nothing is lost, it is only larger.
    fn compact(&self, inner: &mut Inner, now: u64) {
        inner.seen.retain(|_, at| !expired(*at, now));
        match rewrite(&self.path, &inner.seen) {
            Ok(file) => {
                inner.file = file;
                inner.lines = inner.seen.len();
            }
            Err(e) => log::warn!("cannot compact {}: {e}", self.path.display()),
        }
    }
}

/// Parses the file; returns the entries and how many lines were skipped. A final
/// segment without `\n` is a torn write and counts as skipped.
fn parse(text: &str) -> (HashMap<String, u64>, usize) {
    let mut seen = HashMap::new();
    let mut skipped = 0;
    let (complete, tail) = match text.rfind('\n') {
        Some(end) => (&text[..end], &text[end + 1..]),
        None => ("", text),
    };
    if !tail.is_empty() {
        skipped += 1;
    }
    for line in complete.split('\n').filter(|l| !l.is_empty()) {
        match parse_line(line) {
            Some((nonce, at)) => {
                let slot = seen.entry(nonce.to_string()).or_insert(at);
                *slot = (*slot).max(at);
            }
            None => skipped += 1,
        }
    }
    (seen, skipped)
}

fn parse_line(line: &str) -> Option<(&str, u64)> {
    let (at, nonce) = line.split_once(' ')?;
    let at = at.parse().ok()?;
    let valid = !nonce.is_empty() && nonce.bytes().all(|b| b.is_ascii_graphic());
    valid.then_some((nonce, at))
}

/// Appends one line and fsyncs it; a failed write is cut back off so the next append
/// does not land after a partial line.
fn append(file: &mut File, issued_at: u64, nonce: &str) -> io::Result<()> {
    let before = file.metadata()?.len();
    let line = format!("{issued_at} {nonce}\n");
    let written = file
        .write_all(line.as_bytes())
        .and_then(|()| file.sync_data());
    if written.is_err() {
        let _ = file.set_len(before);
    }
    written
}

/// Replaces the file with `seen` atomically and returns it opened for appending.
fn rewrite(path: &Path, seen: &HashMap<String, u64>) -> io::Result<File> {
    let tmp = path.with_extension("tmp");
    let mut body = String::with_capacity(seen.len() * 48);
    for (nonce, at) in seen {
        body.push_str(&format!("{at} {nonce}\n"));
    }
    {
        let mut file = private_fs::options()
            .write(true)
            .truncate(true)
            .open(&tmp)?;
        file.write_all(body.as_bytes())?;
        file.sync_all()?;
    }
    fs::rename(&tmp, path)?;
    if let Some(dir) = path.parent() {
        // Makes the rename itself durable; not every filesystem allows it.
        if let Ok(dir) = File::open(dir) {
            let _ = dir.sync_all();
        }
    }
    OpenOptions::new().append(true).open(path)
}
