//! Unit tests of `backend_kind`.

use super::*;

fn names(list: &[&str]) -> Vec<String> {
    list.iter().map(|s| s.to_string()).collect()
}

/// `GET /api/ps` of Ollama (docs/api.md, "List Running Models").
const OLLAMA_PS: &str = r#"{
  "models": [
    {
      "name": "mistral:latest",
      "model": "mistral:latest",
      "size": 5137025024,
      "digest": "2ae6f6dd7a3dd734790bbbf58b8909a606e0e7e97e94b7604e0aa7ae4490e6d8",
      "details": {
        "parent_model": "",
        "format": "gguf",
        "family": "llama",
        "families": ["llama"],
        "parameter_size": "7.2B",
        "quantization_level": "Q4_0"
      },
      "expires_at": "2024-06-04T14:38:31.83753-07:00",
      "size_vram": 5137025024
    },
    {"name": "qwen2.5:7b", "model": "qwen2.5:7b", "size": 1}
  ]
}"#;

/// `GET /models` of a llama-server router (tools/server/README.md).
const LLAMA_ROUTER_MODELS: &str = r#"{
  "data": [
    {"id": "ggml-org/gemma-3-4b-it-GGUF:Q4_K_M", "path": "/c/gemma.gguf",
     "status": {"value": "loaded", "args": ["llama-server", "-ctx", "4096"]}},
    {"id": "qwen3-8b", "status": {"value": "unloaded"}},
    {"id": "llama-3.2-1b", "status": {"value": "loading", "args": ["llama-server"]}},
    {"id": "kimi", "status": {"value": "unloaded", "failed": true, "exit_code": 1}},
    {"id": "phi", "status": {"value": "sleeping"}},
    {"id": "smol", "status": "loaded"}
  ]
}"#;

/// `GET /v1/models` of a single-model llama-server.
const LLAMA_SINGLE_MODELS: &str = r#"{"object": "list", "data": [{"id":
  "../models/Meta-Llama-3.1-8B-Instruct-Q4_K_M.gguf", "object": "model", "created": 1,
  "owned_by": "llamacpp", "meta": {"n_ctx_train": 131072}}]}"#;

/// `GET /props` of a single-model llama-server (abridged).
const LLAMA_PROPS: &str = r#"{"default_generation_settings": {"id": 0, "n_ctx": 1024,
  "params": {"n_predict": -1}}, "total_slots": 1,
  "model_path": "../models/Meta-Llama-3.1-8B-Instruct-Q4_K_M.gguf",
  "chat_template": "...", "modalities": {"vision": false},
  "build_info": "b4000-abcdef", "is_sleeping": false}"#;

/// `GET /v1/models` of vLLM.
const VLLM_MODELS: &str = r#"{"object": "list", "data": [{"id": "meta-llama/Llama-3.1-8B",
  "object": "model", "created": 1, "owned_by": "vllm", "root": "meta-llama/Llama-3.1-8B",
  "parent": null, "max_model_len": 8192, "permission": []}]}"#;

/// `POST /api/show` of Ollama (docs/api.md, "Show Model Information", abridged).
const OLLAMA_SHOW: &str = r#"{
  "modelfile": "FROM llama3",
  "parameters": "num_keep 24\nstop \"<|start_header_id|>\"",
  "template": "{{ .Prompt }}",
  "details": {"parent_model": "", "format": "gguf", "family": "llama",
    "families": ["llama"], "parameter_size": "8.0B", "quantization_level": "Q4_0"},
  "model_info": {
    "general.architecture": "llama",
    "general.file_type": 2,
    "general.parameter_count": 8030261248,
    "llama.attention.head_count": 32,
    "llama.context_length": 8192,
    "llama.embedding_length": 4096,
    "tokenizer.ggml.model": "gpt2"
  },
  "capabilities": ["completion", "tools", "vision"],
  "modified_at": "2024-06-04T14:38:31.83753-07:00"
}"#;

/// `POST /api/show` of an Ollama embedding model.
const OLLAMA_SHOW_EMBED: &str = r#"{"details": {"family": "nomic-bert"},
  "model_info": {"general.architecture": "nomic-bert", "nomic-bert.context_length": 2048},
  "capabilities": ["embedding"]}"#;

#[test]
fn ollama_show_gives_the_capabilities_and_the_context_length() {
    let info = parse_ollama_show(OLLAMA_SHOW).unwrap();
    assert_eq!(info.context_length, Some(8192));
    assert_eq!(info.capabilities, names(&["completion", "tools", "vision"]));
    let embed = parse_ollama_show(OLLAMA_SHOW_EMBED).unwrap();
    assert_eq!(embed.context_length, Some(2048));
    assert_eq!(embed.capabilities, names(&["embedding"]));
    // An older Ollama without `capabilities`, a model_info without a context length.
    let old = parse_ollama_show(r#"{"model_info": {"general.architecture": "x"}}"#).unwrap();
    assert_eq!(old, ModelInfo::default());
    assert!(parse_ollama_show(r#"{"error":"model 'x' not found"}"#).is_err());
    assert!(parse_ollama_show("garbage").is_err());
}

#[test]
fn llama_server_props_give_n_ctx_and_vision() {
    let info = parse_llama_props_info(LLAMA_PROPS).unwrap();
    assert_eq!(info.context_length, Some(1024));
    assert_eq!(info.capabilities, names(&["completion"]));
    let vision = parse_llama_props_info(
        r#"{"n_ctx": 32768, "modalities": {"vision": true, "audio": false}}"#,
    )
    .unwrap();
    assert_eq!(vision.context_length, Some(32768));
    assert_eq!(vision.capabilities, names(&["completion", "vision"]));
    let unknown = parse_llama_props_info(r#"{"model_path": "m.gguf"}"#).unwrap();
    assert_eq!(unknown.context_length, None);
    assert_eq!(
        parse_llama_props_info(r#"{"role":"router","build_info":"b7000"}"#),
        None,
        "a router describes no one model"
    );
    assert_eq!(parse_llama_props_info("garbage"), None);
}

#[test]
fn vllm_models_give_max_model_len() {
    assert_eq!(
        parse_vllm_max_len(VLLM_MODELS).unwrap(),
        vec![("meta-llama/Llama-3.1-8B".to_string(), Some(8192))]
    );
    assert_eq!(
        parse_vllm_max_len(r#"{"data":[{"id":"m"},{"no_id":1}]}"#).unwrap(),
        vec![("m".to_string(), None)]
    );
    assert!(parse_vllm_max_len("[]").is_err());
}

#[test]
fn only_described_advertised_models_are_reported() {
    let r = Residency::new(KindSetting::Fixed(Kind::Ollama));
    assert_eq!(r.info_among(&names(&["a"])), None, "nothing described yet");
    let a = ModelInfo {
        context_length: Some(4096),
        capabilities: names(&["completion"]),
    };
    r.described.lock().insert("a".into(), Some(a.clone()));
    r.described.lock().insert("b".into(), None);
    assert_eq!(
        r.info_among(&names(&["a", "b", "c"])),
        Some(ModelInfoMap::from([("a".to_string(), a)]))
    );
    assert_eq!(r.info_among(&names(&["b", "c"])), None);
}

#[test]
fn kinds_round_trip_and_the_setting_parses() {
    for k in [Kind::OpenAi, Kind::Ollama, Kind::LlamaServer, Kind::Vllm] {
        assert_eq!(Kind::parse(k.as_str()), Some(k));
    }
    assert_eq!(KindSetting::parse("auto"), Ok(KindSetting::Auto));
    assert_eq!(
        KindSetting::parse(" Llama-Server "),
        Ok(KindSetting::Fixed(Kind::LlamaServer))
    );
    assert!(KindSetting::parse("tgi")
        .unwrap_err()
        .contains("BACKEND_KIND"));
}

#[test]
fn detection_bodies_are_told_apart() {
    assert!(is_ollama_version(r#"{"version":"0.5.1"}"#));
    assert!(!is_ollama_version(r#"{"error":"not found"}"#));
    assert!(!is_ollama_version("404 page not found"));
    assert!(is_llama_server_props(LLAMA_PROPS));
    assert!(is_llama_server_props(
        r#"{"role":"router","build_info":"b7000","is_sleeping":false}"#
    ));
    assert!(!is_llama_server_props(r#"{"detail":"Not Found"}"#));
    assert!(!is_llama_server_props(r#"{"version":"0.5.1"}"#));
    assert!(is_vllm_model_list(VLLM_MODELS));
    assert!(!is_vllm_model_list(LLAMA_SINGLE_MODELS));
    assert!(!is_vllm_model_list("[]"));
}

#[test]
fn ollama_ps_names_match_the_advertised_names_with_latest_implied() {
    let running = parse_ollama_ps(OLLAMA_PS).unwrap();
    assert_eq!(running, names(&["mistral:latest", "qwen2.5:7b"]));
    let resident = Resident::Names(running);
    let advertised = names(&["mistral", "qwen2.5:7b", "qwen2.5:14b", "llama3:latest"]);
    assert_eq!(
        resident.loaded_among(&advertised),
        Some(names(&["mistral", "qwen2.5:7b"]))
    );
    assert_eq!(resident.holds("mistral:latest"), Some(true));
    assert_eq!(resident.holds("qwen2.5:14b"), Some(false));
    assert_eq!(parse_ollama_ps(r#"{"models":[]}"#).unwrap(), names(&[]));
    assert_eq!(parse_ollama_ps(r#"{"models":null}"#).unwrap(), names(&[]));
    assert!(parse_ollama_ps(r#"{"error":"x"}"#).is_err());
    assert!(parse_ollama_ps("garbage").is_err());
}

#[test]
fn llama_router_counts_only_loaded_models() {
    let resident = parse_llama_models(LLAMA_ROUTER_MODELS).unwrap();
    assert_eq!(
        resident,
        Resident::Names(names(&["ggml-org/gemma-3-4b-it-GGUF:Q4_K_M", "smol"]))
    );
    let single = parse_llama_models(LLAMA_SINGLE_MODELS).unwrap();
    assert_eq!(single, Resident::All);
    assert!(parse_llama_models(r#"{"models":[]}"#).is_err());
    assert!(!llama_server_sleeping(LLAMA_PROPS));
    assert!(llama_server_sleeping(
        r#"{"model_path":"m","is_sleeping":true}"#
    ));
}

#[test]
fn unknown_and_all_answer_as_such() {
    let advertised = names(&["a", "b"]);
    assert_eq!(Resident::Unknown.loaded_among(&advertised), None);
    assert_eq!(Resident::Unknown.holds("a"), None);
    assert_eq!(Resident::All.loaded_among(&advertised), Some(advertised));
    assert_eq!(Resident::All.holds("anything"), Some(true));
}

#[test]
fn only_a_request_for_an_unloaded_model_asks_for_a_recheck() {
    let r = Residency::new(KindSetting::Fixed(Kind::Ollama));
    r.after_request("a");
    assert!(
        r.kick_rx.try_recv().is_err(),
        "unknown set: nothing to re-check"
    );
    *r.resident.lock() = Resident::Names(names(&["a:latest"]));
    r.after_request("a");
    assert!(r.kick_rx.try_recv().is_err(), "loaded: no extra work");
    r.after_request("b");
    r.after_request("c");
    assert!(r.kick_rx.try_recv().is_ok(), "not loaded: re-check");
    assert!(
        r.kick_rx.try_recv().is_err(),
        "one pending re-check at most"
    );
}

#[test]
fn a_router_is_told_apart() {
    assert!(is_llama_router_props(
        r#"{"role":"router","build_info":"b7000"}"#
    ));
    assert!(!is_llama_router_props(LLAMA_PROPS));
}
