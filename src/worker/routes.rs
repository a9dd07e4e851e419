//! Which of the relay's routes beyond chat (`/tokenize`, `/v1/rerank`,
//! `/v1/audio/speech`, ...) the backend serves, reported in `register.routes` so the
//! server sends each route only where it can be answered (and answers `404` at once
//! when no worker serves it, rather than queueing it).
//!
//! `ROUTES=auto` (the default) goes by the backend's kind, as far as the kind tells:
//!
//! | kind | routes reported |
//! |---|---|
//! | `llama-server` | `/tokenize`, `/detokenize`, `/apply-template`, `/infill`, `/rerank`, `/v1/rerank`, `/v1/reranking` |
//! | `vllm` | the routes its `/openapi.json` lists (vLLM registers only the ones its model supports); without that document `/tokenize`, `/detokenize`, `/rerank`, `/v1/rerank`, `/v1/score`, `/v1/audio/transcriptions`, `/v1/audio/translations` |
//! | `ollama` | none of them |
//! | `openai` (anything else) | not reported: the server may send any route |
//!
//! The kind says what the server *software* offers; whether the loaded model can do it
//! (llama-server reranks only with `--reranking`, infills only with a FIM-capable
//! model) is the backend's answer to give, and it reaches the client as sent.
//! `ROUTES=any` reports nothing (an original worker's behaviour); a comma-separated
//! list reports exactly that list (a speaches or whisper.cpp box behind `openai`).

use super::backend_kind::Kind;
use crate::cli::ConfigError;

const LLAMA_SERVER: &[&str] = &[
    "/tokenize",
    "/detokenize",
    "/apply-template",
    "/infill",
    "/rerank",
    "/v1/rerank",
    "/v1/reranking",
];
const VLLM: &[&str] = &[
    "/tokenize",
    "/detokenize",
    "/rerank",
    "/v1/rerank",
    "/v1/score",
    "/v1/audio/transcriptions",
    "/v1/audio/translations",
];

/// `ROUTES`: how the worker decides what it reports.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum RoutesSetting {
    /// By the backend's kind.
    #[default]
    Auto,
    /// Report nothing: every route may come.
    Any,
    /// Exactly these paths.
    Fixed(Vec<String>),
}

impl RoutesSetting {
    pub fn parse(text: Option<&str>) -> Result<RoutesSetting, ConfigError> {
        match text.map(str::trim) {
            None | Some("" | "auto") => Ok(RoutesSetting::Auto),
            Some("any") => Ok(RoutesSetting::Any),
            Some(list) => {
                let paths: Vec<String> = list
                    .split(',')
                    .map(str::trim)
                    .filter(|p| !p.is_empty())
                    .map(str::to_string)
                    .collect();
                if let Some(bad) = paths.iter().find(|p| !p.starts_with('/')) {
                    return Err(ConfigError(format!(
                        "ROUTES: `{bad}` is not a path (auto, any, or paths like /tokenize,/infill)"
                    )));
                }
                Ok(RoutesSetting::Fixed(paths))
            }
        }
    }

    /// What `register.routes` says for a backend of `kind` (`None`: not reported);
    /// `listed`: the routes the backend's own API document lists, when it has one.
    pub fn reported(&self, kind: Option<Kind>, listed: Option<Vec<String>>) -> Option<Vec<String>> {
        let list: &[&str] = match (self, kind) {
            (RoutesSetting::Any, _) => return None,
            (RoutesSetting::Fixed(paths), _) => return Some(paths.clone()),
            (RoutesSetting::Auto, Some(Kind::LlamaServer)) => LLAMA_SERVER,
            (RoutesSetting::Auto, Some(Kind::Vllm)) if listed.is_some() => return listed,
            (RoutesSetting::Auto, Some(Kind::Vllm)) => VLLM,
            (RoutesSetting::Auto, Some(Kind::Ollama)) => &[],
            (RoutesSetting::Auto, Some(Kind::OpenAi) | None) => return None,
        };
        Some(list.iter().map(|p| p.to_string()).collect())
    }
}

/// The relay's routes beyond chat that an OpenAPI document (vLLM's `/openapi.json`)
/// lists with a `POST` operation; `None` when the text is not such a document.
pub fn from_openapi(doc: &str) -> Option<Vec<String>> {
    let doc: serde_json::Value = serde_json::from_str(doc).ok()?;
    let paths = doc.get("paths")?.as_object()?;
    Some(
        crate::server::endpoints::builtin()
            .filter(|route| {
                paths
                    .get(*route)
                    .is_some_and(|ops| ops.get("post").is_some())
            })
            .map(str::to_string)
            .collect(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auto_goes_by_kind() {
        let auto = RoutesSetting::Auto;
        let llama = auto.reported(Some(Kind::LlamaServer), None).unwrap();
        assert!(llama.iter().any(|r| r == "/tokenize"));
        assert!(!llama.iter().any(|r| r == "/v1/audio/speech"));
        assert_eq!(auto.reported(Some(Kind::Ollama), None), Some(vec![]));
        assert_eq!(auto.reported(Some(Kind::OpenAi), None), None);
        assert_eq!(auto.reported(None, None), None);
        // vLLM: what its document lists, else the routes it may serve.
        let listed = Some(vec!["/tokenize".to_string()]);
        assert_eq!(auto.reported(Some(Kind::Vllm), listed.clone()), listed);
        assert_eq!(
            auto.reported(Some(Kind::Vllm), None).unwrap().len(),
            VLLM.len()
        );
        assert_eq!(RoutesSetting::Any.reported(Some(Kind::Vllm), listed), None);
    }

    #[test]
    fn an_openapi_document_names_the_routes_served() {
        let doc = r#"{"openapi":"3.1.0","paths":{
            "/tokenize":{"post":{}}, "/v1/audio/transcriptions":{"post":{}},
            "/v1/chat/completions":{"post":{}}, "/detokenize":{"get":{}},
            "/pooling":{"post":{}}}}"#;
        assert_eq!(
            from_openapi(doc).unwrap(),
            ["/v1/audio/transcriptions", "/tokenize"]
        );
        assert_eq!(from_openapi(r#"{"paths":{}}"#), Some(vec![]));
        assert_eq!(from_openapi("<html>"), None);
        assert_eq!(from_openapi(r#"{"openapi":"3"}"#), None);
    }

    #[test]
    fn every_reported_route_is_one_the_relay_knows() {
        let known: Vec<&str> = crate::server::endpoints::builtin().collect();
        for r in LLAMA_SERVER.iter().chain(VLLM) {
            assert!(known.contains(r), "{r}");
        }
    }

    #[test]
    fn settings_parse() {
        assert_eq!(RoutesSetting::parse(None).unwrap(), RoutesSetting::Auto);
        assert_eq!(
            RoutesSetting::parse(Some("any")).unwrap(),
            RoutesSetting::Any
        );
        let fixed =
            RoutesSetting::parse(Some("/v1/audio/speech, /v1/audio/transcriptions")).unwrap();
        assert_eq!(
            fixed.reported(Some(Kind::Ollama), None).unwrap(),
            ["/v1/audio/speech", "/v1/audio/transcriptions"]
        );
        assert!(RoutesSetting::parse(Some("tokenize")).is_err());
    }
}
