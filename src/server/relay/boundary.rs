//! Keeps a relayed stream on event boundaries, so that a stream the relay ends with an
//! error event ends with that event whole.
//!
//! A backend or a worker can die in the middle of an event. Had the first half of that
//! event reached the client, the relay's error event would be glued onto it
//! (`data: {"choidata: {"error": ...}}`) and the client's parser would see one corrupt
//! event and never the error. So [`EventBoundary`] passes every complete event on at
//! once and holds back only the start of an event whose end has not arrived yet. When
//! the stream fails, that tail is dropped ([`EventBoundary::abandon`]) and the error
//! event starts on a boundary; when it ends normally the tail goes out as the backend
//! sent it ([`EventBoundary::finish`]).
//!
//! Holding back costs a client nothing it could use: no parser can act on an event
//! before its end, and the held bytes leave in the same write as that end. Events that
//! arrive whole (what backends write) pass without a copy.
//!
//! * SSE (`text/event-stream`): an event ends with a blank line; a line ends with
//!   `\r\n`, `\n` or `\r`. Anthropic's `event:` line is part of the event it names.
//! * NDJSON (the Ollama routes): every line is an event and ends with `\n`.
//!
//! An event longer than [`MAX_HELD`] is forwarded as it comes (a hostile backend cannot
//! make the relay buffer without end); if the stream fails inside such an event,
//! [`EventBoundary::abandon`] ends it with a blank line, so the error event is still an
//! event of its own and parses.

use std::borrow::Cow;

/// The longest unfinished event held back; a longer one is forwarded as it comes.
pub const MAX_HELD: usize = 64 * 1024;

/// How a stream's events are delimited.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// Server-sent events: an event ends with a blank line.
    Sse,
    /// Newline-delimited JSON: an event is one line.
    Ndjson,
}

impl Format {
    /// The format of a streamed answer with this content type.
    pub fn for_content_type(content_type: &str) -> Format {
        if content_type.contains("ndjson") {
            Format::Ndjson
        } else {
            Format::Sse
        }
    }
}

/// Where the bytes seen so far end, in SSE terms.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum At {
    /// On an event boundary (also the start of the stream).
    EventEnd,
    /// Just after the end of a line inside an event.
    LineEnd,
    /// Inside a line.
    Line,
}

/// Splits a stream on its event ends as it passes; see the module documentation.
#[derive(Debug, Clone)]
pub struct EventBoundary {
    format: Format,
    /// The start of an event whose end has not arrived.
    held: String,
    /// Forwarding an event longer than [`MAX_HELD`] as it comes, until its end.
    passing: bool,
    /// Where everything seen so far (forwarded and held) ends.
    at: At,
    /// The last byte seen was `\r`: a `\n` next belongs to the same line end.
    cr: bool,
    /// The stream's own last event has gone out (see [`EventBoundary::ended`]).
    ended: bool,
}

/// What [`EventBoundary::abandon`] did to end the stream on a boundary.
#[derive(Debug, PartialEq, Eq)]
pub struct Abandoned {
    /// Bytes of an unfinished event that were held back and are now dropped.
    pub withheld: usize,
    /// What to write before the error event: empty, or the blank line that ends an
    /// over-long event already partly forwarded.
    pub close: &'static str,
}

impl EventBoundary {
    pub fn new(format: Format) -> EventBoundary {
        EventBoundary {
            format,
            held: String::new(),
            passing: false,
            at: At::EventEnd,
            cr: false,
            ended: false,
        }
    }

    /// Takes the next piece of the stream (split anywhere); returns what may go to the
    /// client now: everything up to the last event end, with any held start of the
    /// first of those events in front.
    pub fn push<'a>(&mut self, text: &'a str) -> Cow<'a, str> {
        let end = self.scan(text);
        let (ready, rest) = match end {
            Some(end) => (&text[..end], &text[end..]),
            None if self.passing => (text, ""),
            None => ("", text),
        };
        if end.is_some() {
            self.passing = false;
        }
        let mut out = if ready.is_empty() || self.held.is_empty() {
            Cow::Borrowed(ready)
        } else {
            let mut joined = std::mem::take(&mut self.held);
            joined.push_str(ready);
            Cow::Owned(joined)
        };
        self.held.push_str(rest);
        if self.held.len() > MAX_HELD {
            self.passing = true;
            let held = std::mem::take(&mut self.held);
            if out.is_empty() {
                out = Cow::Owned(held);
            } else {
                out.to_mut().push_str(&held);
            }
        }
        if !self.ended {
            self.ended = is_last_event_in(&out, self.format);
        }
        out
    }

    /// Whether the stream's own last event (`data: [DONE]`, Anthropic's
    /// `message_stop`, Ollama's `"done":true` line) has gone out whole. A worker lost
    /// after that has nothing left to send: the stream ends normally, since an error
    /// event after the last one would be an event after the end.
    pub fn ended(&self) -> bool {
        self.ended
    }

    /// The normal end of the stream: the held start of an unfinished last event, to be
    /// forwarded as the backend sent it.
    pub fn finish(&mut self) -> String {
        self.passing = false;
        std::mem::take(&mut self.held)
    }

    /// The relay ends the stream with an error: drops the held start of an unfinished
    /// event and says what to write so the error event begins on a boundary.
    pub fn abandon(&mut self) -> Abandoned {
        let withheld = self.held.len();
        self.held.clear();
        let close = match (self.passing, self.format) {
            (false, _) => "",
            // Extra line ends are harmless: a blank line with no data dispatches nothing.
            (true, Format::Sse) => "\n\n",
            (true, Format::Ndjson) => "\n",
        };
        self.passing = false;
        self.at = At::EventEnd;
        self.cr = false;
        Abandoned { withheld, close }
    }

    /// Whether everything forwarded so far ends on an event boundary (nothing held
    /// back, no over-long event half forwarded).
    #[cfg(test)]
    pub fn at_boundary(&self) -> bool {
        self.held.is_empty() && !self.passing
    }

    /// The index just past the last event end in `text`, if any; keeps the scanner's
    /// state across pieces.
    fn scan(&mut self, text: &str) -> Option<usize> {
        match self.format {
            Format::Ndjson => text.rfind('\n').map(|i| i + 1),
            Format::Sse => self.scan_sse(text),
        }
    }

    fn scan_sse(&mut self, text: &str) -> Option<usize> {
        // What backends write: whole events. Whatever came before, a piece that ends
        // with two `\n` ends on an event end (a `\n` after `\r` only completes a line
        // end, and the second `\n` then ends the event), so nothing needs reading.
        if text.ends_with("\n\n") {
            self.at = At::EventEnd;
            self.cr = false;
            return Some(text.len());
        }
        let bytes = text.as_bytes();
        let mut end = None;
        for (i, &b) in bytes.iter().enumerate() {
            match b {
                // The `\n` of a `\r\n`: no new line end; it belongs to an event end the
                // `\r` made.
                b'\n' if self.cr => {
                    self.cr = false;
                    if self.at == At::EventEnd {
                        end = Some(i + 1);
                    }
                }
                b'\n' | b'\r' => {
                    self.cr = b == b'\r';
                    self.at = match self.at {
                        At::Line => At::LineEnd,
                        At::LineEnd | At::EventEnd => {
                            end = Some(i + 1);
                            At::EventEnd
                        }
                    };
                }
                _ => {
                    self.cr = false;
                    self.at = At::Line;
                }
            }
        }
        end
    }
}

/// Whether forwarded events `out` hold a stream's last event. Markers count only at
/// the start of a line: inside a JSON string a line break is escaped, so a model that
/// writes `data: [DONE]` in its answer cannot end the stream early.
fn is_last_event_in(out: &str, format: Format) -> bool {
    let at_line_start = |marker: &str| {
        out.match_indices(marker)
            .any(|(i, _)| i == 0 || out.as_bytes()[i - 1] == b'\n')
    };
    match format {
        Format::Sse => {
            at_line_start("data: [DONE]")
                || at_line_start("data:[DONE]")
                || at_line_start("event: message_stop")
        }
        Format::Ndjson => out.contains("\"done\":true"),
    }
}

#[cfg(test)]
mod tests;
