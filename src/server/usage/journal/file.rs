//! The journal file: encoding records, appending, and reading them back (torn or corrupt lines skipped).

use super::*;

/// One JSON line per bucket, names looked up in `names`.
pub(super) fn encode(names: &[String], slots: &[(Slot, Usage)]) -> Vec<u8> {
    let name = |id: u32| names.get(id as usize).map_or("", String::as_str);
    let mut body = Vec::with_capacity(slots.len() * 96);
    for (slot, usage) in slots {
        let record = RecordOut {
            h: slot.hour,
            k: name(slot.key),
            t: name(slot.tenant),
            m: name(slot.model),
            w: name(slot.worker),
            n: usage.requests,
            i: usage.tokens_in,
            o: usage.tokens_out,
        };
        // Serializing plain strings and integers into a Vec cannot fail.
        if serde_json::to_writer(&mut body, &record).is_ok() {
            body.push(b'\n');
        }
    }
    body
}

pub fn bucket_start(hour: u64, bucket: Bucket) -> u64 {
    match bucket {
        Bucket::Hour => hour.saturating_mul(3600),
        Bucket::Day => (hour / 24).saturating_mul(86_400),
    }
}

pub(super) fn open_append(path: &Path) -> io::Result<File> {
    crate::server::private_fs::options().append(true).open(path)
}

/// What loading the file found.
pub(super) struct Read {
    pub(super) records: u64,
    pub(super) bytes: u64,
    pub(super) corrupt: u64,
    /// Whether the file ended with a newline (or was empty).
    pub(super) ends_clean: bool,
}

/// Reads every line, summing good records into `state`, skipping bad ones with a warning.
pub(super) fn read_records(file: File, state: &mut State) -> io::Result<Read> {
    let mut reader = BufReader::with_capacity(1 << 16, file);
    let mut line = Vec::with_capacity(256);
    let mut read = Read {
        records: 0,
        bytes: 0,
        corrupt: 0,
        ends_clean: true,
    };
    let mut number = 0u64;
    loop {
        line.clear();
        let n = reader.read_until(b'\n', &mut line)?;
        if n == 0 {
            return Ok(read);
        }
        number += 1;
        read.bytes += n as u64;
        read.ends_clean = line.last() == Some(&b'\n');
        let text = line.strip_suffix(b"\n").unwrap_or(&line);
        if text.iter().all(u8::is_ascii_whitespace) {
            continue;
        }
        match serde_json::from_slice::<RecordIn>(text) {
            Ok(record) => {
                read.records += 1;
                apply(state, &record);
            }
            Err(e) => {
                read.corrupt += 1;
                if read.corrupt <= WARN_LINES {
                    let torn = if read.ends_clean {
                        "corrupt"
                    } else {
                        "torn last"
                    };
                    log::warn!("usage journal: skipping {torn} line {number}: {e}");
                }
            }
        }
    }
}

pub(super) fn apply(state: &mut State, record: &RecordIn) {
    let slot = Slot {
        hour: record.h,
        key: state.names.id(&record.k),
        tenant: state.names.id(&record.t),
        model: state.names.id(&record.m),
        worker: state.names.id(&record.w),
    };
    let usage = Usage {
        requests: record.n,
        tokens_in: record.i,
        tokens_out: record.o,
    };
    state.merge(slot, &usage, false);
}
