//! The fake backend's prompt cache (cache affinity, issue 18): it remembers the chat
//! message prefixes it evaluated and reports, as llama-server and vLLM do, how many
//! prompt tokens it could take from its cache (`usage.prompt_tokens_details
//! .cached_tokens`). A token is counted per 4 bytes of message JSON.
#![allow(dead_code)]

use std::collections::hash_map::DefaultHasher;
use std::collections::HashSet;
use std::hash::Hasher;
use std::sync::atomic::{AtomicUsize, Ordering};

impl super::FakeBackend {
    /// Remembers the prompts it answered and reports cache reuse in whole answers.
    pub fn with_prompt_cache(mut self) -> super::FakeBackend {
        self.cache = Some(std::sync::Arc::default());
        self
    }
}

#[derive(Default, Debug)]
pub struct PromptCache {
    seen: parking_lot::Mutex<HashSet<u64>>,
    /// Prompt tokens taken from the cache, over every request.
    pub reused: AtomicUsize,
    /// Prompt tokens evaluated afresh, over every request.
    pub evaluated: AtomicUsize,
}

impl PromptCache {
    /// (prompt tokens, cached tokens) of a chat body, whose prefixes are then cached.
    pub fn evaluate(&self, body: &str) -> (usize, usize) {
        let value: serde_json::Value = serde_json::from_str(body).unwrap_or_default();
        let messages = value["messages"].as_array().cloned().unwrap_or_default();
        let mut h = DefaultHasher::new();
        let mut bytes = 0;
        let prefixes: Vec<(u64, usize)> = messages
            .iter()
            .map(|m| {
                let text = m.to_string();
                h.write(text.as_bytes());
                bytes += text.len();
                (h.finish(), bytes)
            })
            .collect();
        let mut seen = self.seen.lock();
        let cached = prefixes
            .iter()
            .rev()
            .find(|(key, _)| seen.contains(key))
            .map_or(0, |(_, b)| *b);
        seen.extend(prefixes.iter().map(|(key, _)| *key));
        let (prompt, cached) = (bytes / 4, cached / 4);
        self.reused.fetch_add(cached, Ordering::SeqCst);
        self.evaluated.fetch_add(prompt - cached, Ordering::SeqCst);
        (prompt, cached)
    }

    /// A whole chat answer with `text`, reporting what the cache reused as llama-server
    /// does (`usage.prompt_tokens_details.cached_tokens`).
    pub fn answer(&self, model: &str, text: &str, body: &str) -> String {
        let (prompt, cached) = self.evaluate(body);
        let words = text.split_inclusive(' ').count();
        serde_json::json!({
            "id": "chatcmpl-demo", "object": "chat.completion", "model": model,
            "choices": [{"index": 0, "finish_reason": "stop",
                "message": {"role": "assistant", "content": text}}],
            "usage": {"prompt_tokens": prompt, "completion_tokens": words,
                "total_tokens": prompt + words,
                "prompt_tokens_details": {"cached_tokens": cached}},
        })
        .to_string()
    }
}
