//! The opt-in `continuation` extension: finish a streamed chat answer on another worker.
//!
//! When the worker streaming an answer dies (or its backend fails) after part of the
//! answer reached the client, a server may run the request again on another worker with
//! the text already delivered as the start of the assistant's turn, and splice the rest
//! into the client's stream (see `server::continuation`).
//!
//! The server sends the original request unchanged plus `continuation: {"prefix": ...}`
//! on `request`; the worker builds the backend's body. That split is deliberate: how a
//! backend is told "go on from here" differs by kind (a trailing assistant message is a
//! prefill on llama-server and Ollama; vLLM needs `continue_final_message` and no
//! generation prompt), and only the worker knows its backend's kind for sure (the kind
//! in `register` may be unknown at that time, and may change when the backend is
//! replaced). The server keeps one representation, the text delivered.
//!
//! A worker lists [`FEATURE_CONTINUATION`] in `register`; the server sends such a
//! request only to workers that listed it (an original worker would ignore the field
//! and start the answer again, which the client would see twice). A worker that cannot
//! build the body (unknown backend kind, a body that is no chat) reports a retryable
//! error: nothing was sent to the backend, another worker may take it.

use serde::Serialize;

/// Worker feature: `request.continuation` is understood.
pub const FEATURE_CONTINUATION: &str = "continuation";

/// Whether a backend of `kind` (as `register.backend_kind` spells it) goes on from the
/// text delivered on `route`. Chat: llama-server and Ollama take a trailing assistant
/// message as a prefill, vLLM with `continue_final_message`. `/v1/messages`: llama-server
/// and Ollama the same way; vLLM's Anthropic endpoint has no way to continue the final
/// message (it would start a new turn). An `openai` backend may be anything.
pub fn continues_on(kind: &str, route: &str) -> bool {
    match route {
        "/v1/messages" => matches!(kind, "llama-server" | "ollama"),
        _ => matches!(kind, "llama-server" | "vllm" | "ollama"),
    }
}

/// `request.continuation`: the request continues an answer that began elsewhere.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Continuation {
    /// The assistant's text the client already received; the backend goes on from it.
    pub prefix: String,
    /// The text chunks that carried it (one token each on the supported backends): the
    /// worker takes them off the request's token limit, so the whole answer keeps it.
    #[serde(default)]
    pub tokens: u64,
}
