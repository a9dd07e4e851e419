//! The start of a streamed answer, held back while it may still be a whole answer.
//!
//! A worker speaking the original protocol reports a backend's error to a streaming
//! request as the error body in `response_chunk`s, then `response_complete` with the
//! backend's status and headers. Written as it came, that would be a `200` event stream
//! carrying a JSON error. So a stream whose first bytes are not SSE (a JSON object or
//! array) is held until the end, and the client gets status, headers and body as the
//! backend sent them. A worker that sent `response_head` has said its stream is one:
//! nothing is held. SSE streams, which start with a field or a comment, pass at once.

use std::borrow::Cow;

use crate::protocol::HeaderMap;

/// Held bytes beyond this go out as a stream after all (a whole answer the worker sends
/// in chunks is rarely bigger; this bounds what one request holds).
const HOLD_MAX: usize = 1 << 20;
/// Headers of the worker's `response_head` a stream's head carries (the worker's own).
const STREAM_HEAD_HEADERS: &[&str] = &["x-context-trimmed"];

#[derive(Debug)]
pub(super) enum Held {
    /// Nothing but whitespace seen yet (kept).
    Undecided(String),
    /// Not SSE: kept until the end.
    Holding(String),
    /// A stream: everything passes.
    Passing,
}

impl Default for Held {
    fn default() -> Held {
        Held::Undecided(String::new())
    }
}

impl Held {
    /// A piece of the stream: what to write now (`None`: held).
    pub fn push<'a>(&mut self, chunk: &'a str) -> Option<Cow<'a, str>> {
        match self {
            Held::Passing => Some(Cow::Borrowed(chunk)),
            Held::Holding(held) => {
                held.push_str(chunk);
                (held.len() > HOLD_MAX).then(|| Cow::Owned(self.release()))
            }
            Held::Undecided(seen) => {
                seen.push_str(chunk);
                match seen.trim_start().chars().next() {
                    None => None,
                    Some('{' | '[') => {
                        *self = Held::Holding(std::mem::take(seen));
                        None
                    }
                    Some(_) => Some(Cow::Owned(self.release())),
                }
            }
        }
    }

    /// The worker's `response_head`: its answer is a stream. Returns the headers the
    /// stream's head carries.
    pub fn head(&mut self, headers: &HeaderMap) -> Vec<(&'static str, String)> {
        if matches!(self, Held::Undecided(seen) if seen.is_empty()) {
            *self = Held::Passing;
        }
        STREAM_HEAD_HEADERS
            .iter()
            .filter_map(|n| Some((*n, headers.get(*n)?.clone())))
            .collect()
    }

    /// Everything held; from now on everything passes.
    pub fn release(&mut self) -> String {
        match std::mem::replace(self, Held::Passing) {
            Held::Undecided(held) | Held::Holding(held) => held,
            Held::Passing => String::new(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pushed(held: &mut Held, chunk: &str) -> Option<String> {
        held.push(chunk).map(Cow::into_owned)
    }

    #[test]
    fn sse_passes_at_once_and_json_is_held_to_the_end() {
        let mut sse = Held::default();
        assert_eq!(pushed(&mut sse, "\n"), None);
        assert_eq!(
            pushed(&mut sse, "data: 1\n\n").as_deref(),
            Some("\ndata: 1\n\n")
        );
        assert_eq!(
            pushed(&mut sse, "data: 2\n\n").as_deref(),
            Some("data: 2\n\n")
        );
        let mut json = Held::default();
        assert_eq!(pushed(&mut json, "{\"error\":"), None);
        assert_eq!(pushed(&mut json, "\"overloaded\"}"), None);
        assert_eq!(json.release(), "{\"error\":\"overloaded\"}");
    }

    #[test]
    fn a_big_held_start_goes_out_after_all_and_a_head_means_a_stream() {
        let mut big = Held::default();
        assert_eq!(pushed(&mut big, "["), None);
        let out = pushed(&mut big, &"x".repeat(HOLD_MAX)).expect("released");
        assert_eq!(out.len(), HOLD_MAX + 1);
        assert_eq!(pushed(&mut big, "y").as_deref(), Some("y"));
        let mut headed = Held::default();
        let head: HeaderMap = [("x-context-trimmed".to_string(), "3".to_string())].into();
        assert_eq!(
            headed.head(&head),
            vec![("x-context-trimmed", "3".to_string())]
        );
        assert_eq!(pushed(&mut headed, "{}").as_deref(), Some("{}"));
    }
}
