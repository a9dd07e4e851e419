//! The events of one resumable stream: cut at event ends, numbered, and the recent ones
//! kept so that a client reconnecting with the id of the last event it saw can be given
//! every later one exactly once.
//!
//! * SSE: every event gets an `id: N` line in front; its own bytes are unchanged. A
//!   browser's `EventSource` (or any SSE client) remembers the last id it saw and sends
//!   it back as `Last-Event-ID`.
//! * NDJSON: the lines stay as they are; line `N` (counted from 1) has id `N`, so the
//!   client's count of lines it received is its last id.
//!
//! Pure: no locks, no clock. What the caps mean (trim or refuse) is decided by the
//! caller ([`super::held`]); this only counts and drops.

use std::collections::VecDeque;

use crate::server::relay::boundary::Format;

/// Bookkeeping charged per kept event besides its bytes (its id, the box, the deque
/// slot), so many tiny events are bounded by the caps too.
pub const EVENT_OVERHEAD: usize = 32;

/// Numbered events of one stream, the recent ones kept.
#[derive(Debug)]
pub struct Events {
    format: Format,
    /// The id the next event will get (ids start at 1).
    next: u64,
    /// The start of an event whose end has not arrived.
    pending: String,
    /// Where the bytes scanned so far end, in SSE terms.
    at_line_start: bool,
    /// The last byte scanned was `\r` (a `\n` next only completes that line end).
    cr: bool,
    /// That `\r` ended an event, whose end is placed at the next byte.
    cr_end: bool,
    /// Kept events, oldest first: `(id, bytes as written to a client)`.
    kept: VecDeque<(u64, Box<[u8]>)>,
    /// Bytes charged for `kept` (event bytes plus [`EVENT_OVERHEAD`] each).
    charged: usize,
}

impl Events {
    pub fn new(format: Format) -> Events {
        Events {
            format,
            next: 1,
            pending: String::new(),
            at_line_start: true,
            cr: false,
            cr_end: false,
            kept: VecDeque::new(),
            charged: 0,
        }
    }

    /// The id of the last event numbered so far (0: none yet).
    pub fn last_id(&self) -> u64 {
        self.next - 1
    }

    /// The id of the oldest event still kept, or the next id when none is kept.
    pub fn first_kept(&self) -> u64 {
        self.kept.front().map_or(self.next, |(id, _)| *id)
    }

    /// Bytes charged for the kept events.
    pub fn charged(&self) -> usize {
        self.charged
    }

    /// Bytes of an unfinished event waiting for its end.
    pub fn pending(&self) -> usize {
        self.pending.len()
    }

    /// Takes the next piece of the stream; numbers and keeps every event it ends, and
    /// appends them (as a client gets them) to `out`. Returns the bytes charged.
    pub fn push(&mut self, text: &str, out: &mut Vec<u8>) -> usize {
        let mut charged = 0;
        let mut start = 0;
        for end in self.event_ends(text) {
            let piece = &text[start..end];
            start = end;
            if self.pending.is_empty() {
                charged += self.keep(piece, out);
            } else {
                let mut event = std::mem::take(&mut self.pending);
                event.push_str(piece);
                charged += self.keep(&event, out);
            }
        }
        self.pending.push_str(&text[start..]);
        charged
    }

    /// The end of the stream: an unfinished last event is numbered as it is.
    pub fn flush(&mut self, out: &mut Vec<u8>) -> usize {
        let event = std::mem::take(&mut self.pending);
        self.at_line_start = true;
        self.cr = false;
        self.cr_end = false;
        if event.is_empty() {
            0
        } else {
            self.keep(&event, out)
        }
    }

    /// Appends every kept event after `last` to `out`; returns the id of the last one
    /// appended (`last` when none). Events before [`Events::first_kept`] are gone: the
    /// caller checks that first.
    pub fn copy_after(&self, last: u64, out: &mut Vec<u8>) -> u64 {
        let mut sent = last;
        // Ids are consecutive: the first event after `last` sits at a known index.
        let skip = last.saturating_add(1).saturating_sub(self.first_kept());
        let skip = usize::try_from(skip).unwrap_or(usize::MAX);
        for (id, bytes) in self.kept.iter().skip(skip) {
            out.extend_from_slice(bytes);
            sent = *id;
        }
        sent
    }

    /// Drops the oldest kept events with ids up to `upto` until at most `max` bytes are
    /// charged; returns the bytes freed.
    pub fn trim(&mut self, max: usize, upto: u64) -> usize {
        let mut freed = 0;
        while self.charged > max {
            match self.kept.front() {
                Some((id, _)) if *id <= upto => {}
                _ => break,
            }
            if let Some((_, bytes)) = self.kept.pop_front() {
                let cost = bytes.len() + EVENT_OVERHEAD;
                self.charged -= cost;
                freed += cost;
            }
        }
        freed
    }

    /// Forgets every kept event (numbering goes on); returns the bytes freed.
    pub fn clear(&mut self) -> usize {
        let freed = self.charged;
        self.kept = VecDeque::new();
        self.pending = String::new();
        self.charged = 0;
        freed
    }

    fn keep(&mut self, event: &str, out: &mut Vec<u8>) -> usize {
        let id = self.next;
        self.next += 1;
        let bytes: Box<[u8]> = match self.format {
            Format::Sse => format!("id: {id}\n{event}").into_bytes().into(),
            Format::Ndjson => event.as_bytes().into(),
        };
        out.extend_from_slice(&bytes);
        let cost = bytes.len() + EVENT_OVERHEAD;
        self.kept.push_back((id, bytes));
        self.charged += cost;
        cost
    }

    /// Indexes just past every event end in `text`, keeping the scanner's state across
    /// pieces. SSE: a blank line (`\n`, `\r\n` or `\r` line ends); NDJSON: a `\n`.
    fn event_ends(&mut self, text: &str) -> Vec<usize> {
        let mut ends = Vec::new();
        if self.format == Format::Ndjson {
            ends.extend(text.match_indices('\n').map(|(i, _)| i + 1));
            return ends;
        }
        for (i, &b) in text.as_bytes().iter().enumerate() {
            if b == b'\n' && self.cr {
                // The `\n` of a `\r\n`: completes the line end (or event end) begun.
                self.cr = false;
                if std::mem::take(&mut self.cr_end) {
                    ends.push(i + 1);
                }
                continue;
            }
            if std::mem::take(&mut self.cr_end) {
                // A lone `\r` ended the event: it ends before this byte.
                ends.push(i);
            }
            self.cr = b == b'\r';
            match b {
                b'\n' | b'\r' => {
                    if self.at_line_start {
                        // After a `\r` the event may still end with a `\n` (in the
                        // next piece, even): its end is known at the next byte.
                        if self.cr {
                            self.cr_end = true;
                        } else {
                            ends.push(i + 1);
                        }
                    }
                    self.at_line_start = true;
                }
                _ => self.at_line_start = false,
            }
        }
        ends
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn numbered(format: Format, pieces: &[&str]) -> (Events, String) {
        let mut events = Events::new(format);
        let mut out = Vec::new();
        for p in pieces {
            events.push(p, &mut out);
        }
        events.flush(&mut out);
        (events, String::from_utf8(out).expect("utf-8"))
    }

    #[test]
    fn sse_events_get_an_id_line_and_stay_byte_identical() {
        let (events, out) = numbered(Format::Sse, &["data: a\n\ndata: b\n\n", "data: c\n\n"]);
        assert_eq!(
            out,
            "id: 1\ndata: a\n\nid: 2\ndata: b\n\nid: 3\ndata: c\n\n"
        );
        assert_eq!(events.last_id(), 3);
    }

    #[test]
    fn an_event_split_anywhere_is_numbered_once_whole() {
        let stream = "event: x\r\ndata: {\"a\":1}\r\n\r\n: note\n\ndata: [DONE]\r\r";
        for cut in 0..stream.len() {
            let (a, b) = stream.split_at(cut);
            let (_, out) = numbered(Format::Sse, &[a, b]);
            assert_eq!(
                out,
                "id: 1\nevent: x\r\ndata: {\"a\":1}\r\n\r\nid: 2\n: note\n\nid: 3\ndata: [DONE]\r\r",
                "cut at {cut}"
            );
        }
    }

    #[test]
    fn an_unfinished_last_event_is_numbered_at_the_end() {
        let (events, out) = numbered(Format::Sse, &["data: a\n\ndata: b"]);
        assert_eq!(out, "id: 1\ndata: a\n\nid: 2\ndata: b");
        assert_eq!(events.last_id(), 2);
    }

    #[test]
    fn ndjson_lines_are_numbered_without_changing_a_byte() {
        let (events, out) = numbered(Format::Ndjson, &["{\"a\":1}\n{\"b\"", ":2}\n"]);
        assert_eq!(out, "{\"a\":1}\n{\"b\":2}\n");
        let mut after = Vec::new();
        assert_eq!(events.copy_after(1, &mut after), 2);
        assert_eq!(after, b"{\"b\":2}\n");
    }

    #[test]
    fn copy_after_gives_every_later_event_exactly_once() {
        let pieces: Vec<String> = (1..=20).map(|i| format!("data: {i}\n\n")).collect();
        let refs: Vec<&str> = pieces.iter().map(String::as_str).collect();
        let (events, _) = numbered(Format::Sse, &refs);
        for last in 0..=20 {
            let mut out = Vec::new();
            assert_eq!(events.copy_after(last, &mut out), last.max(20));
            let text = String::from_utf8(out).expect("utf-8");
            let expected: String = (last + 1..=20)
                .map(|i| format!("id: {i}\ndata: {i}\n\n"))
                .collect();
            assert_eq!(text, expected, "after {last}");
        }
    }

    #[test]
    fn trim_drops_only_the_oldest_events_already_handed_out() {
        let (mut events, _) = numbered(Format::Ndjson, &["1\n2\n3\n4\n"]);
        let each = 2 + EVENT_OVERHEAD;
        assert_eq!(events.charged(), 4 * each);
        // Nothing handed out past id 1: only that one may go.
        assert_eq!(events.trim(0, 1), each);
        assert_eq!(events.first_kept(), 2);
        assert_eq!(events.trim(2 * each, 4), each);
        assert_eq!(events.first_kept(), 3);
        let mut out = Vec::new();
        assert_eq!(events.copy_after(2, &mut out), 4);
        assert_eq!(out, b"3\n4\n");
        assert_eq!(events.clear(), 2 * each);
        assert_eq!((events.charged(), events.first_kept()), (0, 5));
    }
}
