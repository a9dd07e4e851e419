//! Shows the final answer as `moe-<model>`: renames `model` in a whole answer or in each SSE line.

use super::*;

/// Shows the final answer as `moe-<model>`'s: rewrites `model` in the whole body or in
/// every SSE `data:` line (split lines are held until complete); everything else, errors
/// included, passes through.
pub(super) struct Rename {
    model: String,
    /// An SSE line not complete yet.
    partial: String,
    tokens: (u64, u64),
}

impl Rename {
    pub(super) fn new(model: &str) -> Rename {
        Rename {
            model: model.to_string(),
            partial: String::new(),
            tokens: (0, 0),
        }
    }

    /// One SSE line (with its line end, if any) with `model` rewritten.
    fn line(&mut self, line: &str) -> String {
        let Some(data) = line.strip_prefix("data:") else {
            return line.to_string();
        };
        let Ok(mut v) = serde_json::from_str::<Value>(data.trim()) else {
            return line.to_string();
        };
        if let Some(t) = usage_of(&v) {
            self.tokens = t;
        }
        if let Some(m) = v.get_mut("model") {
            *m = self.model.clone().into();
        }
        let end = &line[line.trim_end_matches(['\r', '\n']).len()..];
        format!("data: {v}{end}")
    }
}

/// Longest unfinished SSE line held back to rename its `model`.
pub(super) const MAX_PARTIAL_LINE: usize = 1 << 20;

impl Reshape for Rename {
    fn stream_type(&self) -> &'static str {
        "text/event-stream"
    }

    fn chunk(&mut self, chunk: &str) -> String {
        self.partial.push_str(chunk);
        let Some(cut) = self.partial.rfind('\n') else {
            // A backend that never ends its line: pass it on rather than grow without end.
            if self.partial.len() > MAX_PARTIAL_LINE {
                return std::mem::take(&mut self.partial);
            }
            return String::new();
        };
        let complete: String = self.partial.drain(..=cut).collect();
        complete
            .split_inclusive('\n')
            .map(|l| self.line(l))
            .collect()
    }

    fn end(&mut self, rest: &str) -> String {
        let mut out = self.chunk(rest);
        let tail = std::mem::take(&mut self.partial);
        out.push_str(&self.line(&tail));
        out
    }

    fn whole(&mut self, status: u16, body: &str, _elapsed: Duration) -> (u16, String) {
        if !(200..300).contains(&status) {
            return (status, body.to_string());
        }
        match serde_json::from_str::<Value>(body) {
            Ok(mut v) if v.get("model").is_some() => {
                if let Some(t) = usage_of(&v) {
                    self.tokens = t;
                }
                v["model"] = self.model.clone().into();
                (status, v.to_string())
            }
            _ => (status, body.to_string()),
        }
    }

    fn tokens(&self) -> (u64, u64) {
        self.tokens
    }
}
