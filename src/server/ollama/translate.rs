//! PLACEHOLDER until the real translation lands.
#![allow(dead_code, unused_variables)]
use std::time::{Duration, Instant};
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    Chat,
    Generate,
    Embed,
    LegacyEmbeddings,
}
#[derive(Debug)]
pub struct OllamaError {
    pub status: u16,
    pub message: String,
}
pub fn error_body(message: &str) -> String {
    serde_json::json!({"error": message}).to_string()
}
pub struct Translated {
    pub path: &'static str,
    pub body: String,
    pub model: String,
    pub stream: bool,
}
pub fn request(endpoint: Endpoint, body: &[u8]) -> Result<Translated, OllamaError> {
    Err(OllamaError {
        status: 400,
        message: "x".into(),
    })
}
pub struct Timing {
    pub total: Duration,
    pub first_token: Option<Duration>,
    pub now_unix_ms: u64,
}
pub fn response(
    endpoint: Endpoint,
    model: &str,
    openai_body: &str,
    timing: &Timing,
) -> Result<String, OllamaError> {
    Ok(String::new())
}
pub struct StreamConverter;
impl StreamConverter {
    pub fn new(endpoint: Endpoint, model: &str, started: Instant) -> StreamConverter {
        StreamConverter
    }
    pub fn feed(&mut self, sse: &str, now: Instant, now_unix_ms: u64) -> String {
        String::new()
    }
    pub fn finish(&mut self, now: Instant, now_unix_ms: u64) -> String {
        String::new()
    }
    pub fn usage(&self) -> (u64, u64) {
        (0, 0)
    }
}
pub fn rfc3339(unix_ms: u64) -> String {
    String::new()
}
