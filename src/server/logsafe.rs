//! Untrusted text in log lines and messages: escaped and bounded.
//!
//! A client chooses its `model` (and a worker its name); written raw, a newline in one
//! forges a log line and a megabyte of it fills the log. [`bounded`] escapes control
//! characters, quotes and backslashes as Rust does (`\n`, `\u{1}`) and keeps at most
//! [`MAX_SHOWN`] characters, so one field stays one short token of one line.

use std::borrow::Cow;

/// Characters of an untrusted string shown in a log line or an error message.
pub const MAX_SHOWN: usize = 256;

/// `s` escaped and cut to [`MAX_SHOWN`] characters (`…` marks a cut).
pub fn bounded(s: &str) -> Cow<'_, str> {
    let plain = |c: char| !c.is_control() && c != '\\' && c != '"';
    if s.chars().count() <= MAX_SHOWN && s.chars().all(plain) {
        return Cow::Borrowed(s);
    }
    let mut out = String::new();
    for c in s.chars().take(MAX_SHOWN) {
        if plain(c) {
            out.push(c);
        } else {
            out.extend(c.escape_debug());
        }
    }
    if s.chars().nth(MAX_SHOWN).is_some() {
        out.push('…');
    }
    Cow::Owned(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn newlines_cannot_forge_a_line_and_long_text_is_cut() {
        assert_eq!(bounded("llama3:8b"), "llama3:8b");
        let forged = bounded("m\nrequest req-1 /v1/chat status=200\u{1}\"");
        assert!(!forged.contains('\n') && !forged.contains('\u{1}'));
        assert_eq!(forged, "m\\nrequest req-1 /v1/chat status=200\\u{1}\\\"");
        let text = "é".repeat(10_000);
        let long = bounded(&text);
        assert_eq!(long.chars().count(), MAX_SHOWN + 1);
        assert!(long.ends_with('…'));
    }
}
