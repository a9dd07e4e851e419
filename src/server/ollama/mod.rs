//! Ollama's own API on the relay: [`routes`] (the `/api/*` handlers, on top of
//! `relay`) and [`translate`] (pure: Ollama bodies and stream chunks to and from
//! OpenAI's, so any backend works behind it).

pub mod routes;
pub mod translate;
