//! Prompt-prefix fingerprints: where a request's conversation has been, without its text.
//!
//! Computed on the client's thread and handed to the dispatcher with the request, so the
//! dispatcher can send a conversation back to the backend whose KV cache already holds
//! its beginning (see `dispatcher/affinity.rs` and `dispatcher/routing.rs`). Pure: body
//! and header in, hashes out.
//!
//! A fingerprint is a keyed 64-bit hash (SipHash, see [`share_key`] for its key) of the
//! prompt up to a boundary: after each message of a chat
//! `messages` list (Ollama's `/api/chat` arrives here already as one), after Anthropic's
//! top-level `system` and each of its `messages`, after the Responses `instructions` and
//! each `input` item, and after every [`BLOCK_BYTES`] bytes of a raw `prompt`
//! (`/v1/completions`). `tools` count as part of the first boundary (they are part of
//! what the backend evaluates). The next turn of a conversation repeats the previous
//! turn's prompt, so its list contains the previous turn's longest fingerprint.
//!
//! Only the hashes leave this module: the parsed body is dropped when it returns, and
//! a hash cannot be turned back into the text nor, without the key, even be checked
//! against a guess. Values are hashed structurally with object keys in sorted
//! order and Anthropic's `cache_control` markers left out, so a client that re-encodes
//! an earlier message differently (key order, spacing, a moved cache marker) still
//! matches.
//!
//! An explicit key wins over the prompt: OpenAI's `prompt_cache_key` in the body, else
//! the `X-Session-Id` header. Then the conversation is that key alone.

use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, Hasher};
use std::sync::OnceLock;

use serde::Deserialize;
use serde_json::Value;

/// Raw prompts are cut into blocks of this many bytes (about 256 tokens).
pub const BLOCK_BYTES: usize = 1024;
/// Prefixes shorter than this (about 128 tokens) are not worth steering for: a backend
/// evaluates them in no time, and a short common opening ("hello") would pull unrelated
/// requests onto one box. Bodies shorter than this are not even parsed.
pub const MIN_PREFIX_BYTES: usize = 512;
/// At most this many fingerprints per request: the first [`FIRST_KEPT`] (a shared system
/// prompt) and the longest ones (the conversation so far, which the next turn repeats).
pub const MAX_PRINTS: usize = 32;
const FIRST_KEPT: usize = 4;

/// What the dispatcher learns about a request's prompt.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum Fingerprints {
    /// Nothing to go by: affinity off, no prompt (embeddings), or too short to matter.
    #[default]
    None,
    /// The client named its conversation (`prompt_cache_key`, `X-Session-Id`).
    Key(u64),
    /// Hashes of the prompt's prefixes at its boundaries, shortest first.
    Prefixes(Box<[u64]>),
}

impl Fingerprints {
    /// The hashes to look up and remember, shortest prefix first.
    pub fn as_slice(&self) -> &[u64] {
        match self {
            Fingerprints::None => &[],
            Fingerprints::Key(k) => std::slice::from_ref(k),
            Fingerprints::Prefixes(p) => p,
        }
    }

    pub fn is_none(&self) -> bool {
        self.as_slice().is_empty()
    }
}

/// The fingerprints of a request for `endpoint_path` with `body` (`session`: the
/// `X-Session-Id` header); [`Fingerprints::None`] when `enabled` is false.
pub fn for_request(
    enabled: bool,
    endpoint_path: &str,
    body: &str,
    session: Option<&str>,
) -> Fingerprints {
    if !enabled || endpoint_path.ends_with("/embeddings") {
        return Fingerprints::None;
    }
    // A body that never names the key field cannot hold it: no parse for it.
    let may_have_key = body.contains("prompt_cache_key");
    if !may_have_key && body.len() < MIN_PREFIX_BYTES {
        return session_key(session).unwrap_or_default();
    }
    let Ok(probe) = serde_json::from_str::<Probe>(body) else {
        return session_key(session).unwrap_or_default();
    };
    if let Some(key) = probe.prompt_cache_key.as_ref().and_then(Value::as_str) {
        if let Some(key) = explicit(key) {
            return key;
        }
    }
    if let Some(key) = session_key(session) {
        return key;
    }
    probe.prefixes()
}

fn session_key(session: Option<&str>) -> Option<Fingerprints> {
    session.and_then(explicit)
}

/// An explicit key, hashed in its own domain so it never equals a prompt prefix.
fn explicit(key: &str) -> Option<Fingerprints> {
    let key = key.trim();
    if key.is_empty() {
        return None;
    }
    let mut h = hasher();
    h.write_u8(b'k');
    h.write(key.as_bytes());
    Some(Fingerprints::Key(h.finish()))
}

/// std's only keyed SipHash constructor (deprecated for hash tables, which is not this
/// use): the key must be one the relays of a pool can share.
#[allow(deprecated)]
type Keyed = std::hash::SipHasher;

static KEY: OnceLock<(u64, u64)> = OnceLock::new();

/// Keys the fingerprints from the worker secret, so every relay of a pool (they share
/// the secret) fingerprints a prompt alike and can use what the workers report of the
/// others (`protocol/affinity.rs`). Called once at start, before any request; without
/// a secret (or before the call) the key is random, this process's own.
pub fn share_key(worker_secret: &str) {
    use sha2::{Digest, Sha256};
    if worker_secret.is_empty() {
        return;
    }
    let mut d = Sha256::new();
    d.update(b"modelrelay prompt fingerprints\0");
    d.update(worker_secret.as_bytes());
    let d = d.finalize();
    let word = |i: usize| {
        let mut b = [0u8; 8];
        b.copy_from_slice(&d[i..i + 8]);
        u64::from_le_bytes(b)
    };
    let _ = KEY.set((word(0), word(8)));
}

/// A hasher with the fingerprint key (see [`share_key`]).
#[allow(deprecated)]
fn hasher() -> Keyed {
    let (k0, k1) = *KEY.get_or_init(|| {
        let r = RandomState::new();
        (r.hash_one(0u8), r.hash_one(1u8))
    });
    Keyed::new_with_keys(k0, k1)
}

/// The fields that make up a prompt; everything else in the body is skipped unparsed.
/// Every field is any JSON value, so an odd one only leaves that field out.
#[derive(Deserialize)]
struct Probe {
    prompt_cache_key: Option<Value>,
    tools: Option<Value>,
    /// Anthropic's top-level system prompt.
    system: Option<Value>,
    /// The Responses API's system prompt.
    instructions: Option<Value>,
    messages: Option<Value>,
    /// The Responses API's conversation (a string or a list of items).
    input: Option<Value>,
    /// `/v1/completions` (and Ollama's generate): raw text.
    prompt: Option<Value>,
}

impl Probe {
    fn prefixes(self) -> Fingerprints {
        let mut walk = Walk {
            h: hasher(),
            bytes: 0,
            prints: Vec::new(),
        };
        walk.h.write_u8(b'p');
        if let Some(tools) = &self.tools {
            walk.value(tools);
        }
        if let Some(prompt) = self.prompt {
            match prompt {
                Value::String(text) => walk.blocks(text.as_bytes()),
                // Token ids or a batch: blocks of its JSON text.
                other => walk.blocks(other.to_string().as_bytes()),
            }
            return walk.done();
        }
        for head in [&self.system, &self.instructions].into_iter().flatten() {
            walk.value(head);
            walk.boundary();
        }
        let turns = match (self.messages, self.input) {
            (Some(Value::Array(messages)), _) => messages,
            (None, Some(Value::Array(items))) => items,
            (None, Some(text @ Value::String(_))) => vec![text],
            _ => Vec::new(),
        };
        for turn in &turns {
            walk.value(turn);
            walk.boundary();
        }
        walk.done()
    }
}

/// A running hash over the prompt, with the fingerprints taken so far.
struct Walk {
    h: Keyed,
    /// Bytes of text hashed so far (to skip prefixes too short to matter).
    bytes: usize,
    prints: Vec<u64>,
}

impl Walk {
    /// Takes the fingerprint of everything hashed so far.
    fn boundary(&mut self) {
        if self.bytes >= MIN_PREFIX_BYTES {
            self.prints.push(self.h.finish());
        }
        // The separator keeps [a, bc] and [ab, c] apart.
        self.h.write_u8(0xfe);
    }

    fn blocks(&mut self, text: &[u8]) {
        for block in text.chunks_exact(BLOCK_BYTES) {
            self.h.write(block);
            self.bytes += block.len();
            self.boundary();
        }
    }

    /// Hashes a JSON value structurally: type tags, strings with a terminator (0xff is
    /// never in UTF-8), object keys in sorted order (serde_json's map is a BTreeMap).
    fn value(&mut self, v: &Value) {
        match v {
            Value::Null => self.h.write_u8(0),
            Value::Bool(b) => self.h.write_u8(if *b { 2 } else { 1 }),
            Value::Number(n) => {
                self.h.write_u8(3);
                self.text(&n.to_string());
            }
            Value::String(s) => {
                self.h.write_u8(4);
                self.text(s);
            }
            Value::Array(items) => {
                self.h.write_u8(5);
                for item in items {
                    self.value(item);
                }
                self.h.write_u8(6);
            }
            Value::Object(map) => {
                self.h.write_u8(7);
                // A cache marker says nothing about the tokens, and clients move it
                // to the newest message each turn.
                for (k, item) in map.iter().filter(|(k, _)| *k != "cache_control") {
                    self.text(k);
                    self.value(item);
                }
                self.h.write_u8(8);
            }
        }
    }

    fn text(&mut self, s: &str) {
        self.h.write(s.as_bytes());
        self.h.write_u8(0xff);
        self.bytes += s.len();
    }

    fn done(self) -> Fingerprints {
        let mut prints = self.prints;
        if prints.is_empty() {
            return Fingerprints::None;
        }
        if prints.len() > MAX_PRINTS {
            prints.drain(FIRST_KEPT..prints.len() - (MAX_PRINTS - FIRST_KEPT));
        }
        Fingerprints::Prefixes(prints.into_boxed_slice())
    }
}

#[cfg(test)]
mod tests;
