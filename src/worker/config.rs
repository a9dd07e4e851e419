//! `modelrelay-worker` settings: the option table and the typed configuration.

use std::time::Duration;

use super::backend_kind::KindSetting;
use crate::cli::{ConfigError, Opt, Settings};
use crate::protocol::BRIDGE_PROTOCOL_VERSION;

pub const USAGE: &str = "modelrelay-worker — runs beside a local inference backend and dials out to a modelrelay server.\n\nUsage: modelrelay-worker [OPTIONS]";

pub const OPTIONS: &[Opt] = &[
    Opt {
        flag: "proxy-url",
        env: "PROXY_URL",
        default: Some("http://127.0.0.1:8080"),
        help: "relay server URL, or a comma-separated list of relays to serve all at once (https:// connects over wss://)",
    },
    Opt {
        flag: "worker-secret",
        env: "WORKER_SECRET",
        default: None,
        help: "shared secret, as configured on the server (required)",
    },
    Opt {
        flag: "worker-name",
        env: "WORKER_NAME",
        default: None,
        help: "name shown by the server [default: the hostname]",
    },
    Opt {
        flag: "provider-name",
        env: "PROVIDER_NAME",
        default: Some("local"),
        help: "provider to join on the server",
    },
    Opt {
        flag: "backend-url",
        env: "BACKEND_URL",
        default: Some("http://127.0.0.1:8000"),
        help: "local OpenAI-compatible backend",
    },
    Opt {
        flag: "models",
        env: "MODELS",
        default: Some("*"),
        help: "comma-separated models to advertise; * asks the backend's /v1/models",
    },
    Opt {
        flag: "backend-kind",
        env: "BACKEND_KIND",
        default: Some("auto"),
        help: "auto, openai, ollama, llama-server or vllm: how to tell which models are loaded",
    },
    Opt {
        flag: "routes",
        env: "ROUTES",
        default: Some("auto"),
        help: "which relayed routes beyond chat the backend serves, reported to the server: auto (by backend kind; a vLLM's /openapi.json), any (report nothing), or paths like /v1/audio/speech,/v1/audio/transcriptions",
    },
    Opt {
        flag: "load-keep-alive",
        env: "LOAD_KEEP_ALIVE",
        default: Some("-1"),
        help: "Ollama keep_alive of a model loaded on request: seconds (negative: until unloaded) or a duration like 30m",
    },
    Opt {
        flag: "max-concurrency",
        env: "MAX_CONCURRENCY",
        default: Some("1"),
        help: "parallel requests the backend can take (its slots)",
    },
    Opt {
        flag: "backend-api-key",
        env: "BACKEND_API_KEY",
        default: None,
        help: "bearer token sent to the backend instead of the client's",
    },
    Opt {
        flag: "drain-timeout-secs",
        env: "DRAIN_TIMEOUT_SECS",
        default: Some("60"),
        help: "on SIGTERM, how long in-flight requests may finish",
    },
    Opt {
        flag: "models-refresh-secs",
        env: "MODELS_REFRESH_SECS",
        default: Some("30"),
        help: "how often the backend's model list (when MODELS is *) and loaded models are re-read",
    },
    Opt {
        flag: "backend-probe-max-secs",
        env: "BACKEND_PROBE_MAX_SECS",
        default: Some("10"),
        help:
            "longest wait between probes of a backend that stopped answering (from 1 s, doubling)",
    },
    Opt {
        flag: "context-trim",
        env: "CONTEXT_TRIM",
        default: Some("on"),
        help: "on or off: a chat request the backend refuses for its context size is retried with the oldest messages dropped (X-Context-Trim: off per request)",
    },
    Opt {
        flag: "protocol-version",
        env: "PROTOCOL_VERSION",
        default: Some(BRIDGE_PROTOCOL_VERSION),
        help: "protocol_version sent in register",
    },
    Opt {
        flag: "max-ws-message-bytes",
        env: "MAX_WS_MESSAGE_BYTES",
        default: Some("67108864"),
        help: "largest WebSocket message accepted from the server",
    },
    Opt {
        flag: "held-stream-bytes",
        env: "HELD_STREAM_BYTES",
        default: Some("1048576"),
        help: "with several relays: most bytes of events kept for one resumable stream, so it survives its relay (past it while no relay reads: cancelled)",
    },
    Opt {
        flag: "held-total-bytes",
        env: "HELD_TOTAL_BYTES",
        default: Some("67108864"),
        help: "with several relays: most bytes kept for all such streams together (a new stream past it is not kept)",
    },
    Opt {
        flag: "ca-file",
        env: "CA_FILE",
        default: None,
        help: "extra PEM CA certificates to trust for a wss:// server (private CA)",
    },
    Opt {
        flag: "log-level",
        env: "LOG_LEVEL",
        default: Some("info"),
        help: "error, warn, info, debug or trace (RUST_LOG also works)",
    },
    Opt {
        flag: "wake-on-lan",
        env: "WAKE_ON_LAN",
        default: Some("off"),
        help: "on: tell the relay this box's Wake-on-LAN address, so it is remembered asleep when it goes away and woken when needed",
    },
    Opt {
        flag: "wake-mac",
        env: "WAKE_MAC",
        default: None,
        help: "MAC address to wake this box at [default: the interface that routes to the relay] (implies WAKE_ON_LAN)",
    },
    Opt {
        flag: "wake-broadcast",
        env: "WAKE_BROADCAST",
        default: None,
        help: "broadcast address (IP or IP:port) the magic packet for this box goes to [default: that interface's LAN, port 9]",
    },
    Opt {
        flag: "wake-peers",
        env: "WAKE_PEERS",
        default: Some("on"),
        help: "on: send Wake-on-LAN packets to other boxes when the relay asks",
    },
    Opt {
        flag: "idle-suspend-secs",
        env: "IDLE_SUSPEND_SECS",
        default: Some("0"),
        help: "after this long without a request, ask the relay to sleep, then disconnect and run SUSPEND_CMD (0: never)",
    },
    Opt {
        flag: "suspend-cmd",
        env: "SUSPEND_CMD",
        default: None,
        help: "command (sh -c) that suspends this box, e.g. `systemctl suspend`",
    },
    Opt {
        flag: "stay-awake",
        env: "STAY_AWAKE",
        default: Some("off"),
        help: "on: never ask to sleep (pins the box awake)",
    },
    Opt {
        flag: "owner-busy-cmd",
        env: "OWNER_BUSY_CMD",
        default: None,
        help: "command (sh -c) whose exit status 0 means the box's owner uses it: take nothing new meanwhile",
    },
    Opt {
        flag: "owner-gpu-check",
        env: "OWNER_GPU_CHECK",
        default: Some("off"),
        help: "on: a GPU compute process other than an inference backend (nvidia-smi) means the owner is busy",
    },
    Opt {
        flag: "owner-check-secs",
        env: "OWNER_CHECK_SECS",
        default: Some("10"),
        help: "how often the owner check runs",
    },
    Opt {
        flag: "owner-unload",
        env: "OWNER_UNLOAD",
        default: Some("off"),
        help: "on: unload the backend's models while the owner is busy, to hand the VRAM back",
    },
];

/// Which models to advertise.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ModelSource {
    /// A fixed list from `MODELS`.
    Fixed(Vec<String>),
    /// Whatever the backend's `GET /v1/models` says, re-read periodically.
    Backend,
}

#[derive(Clone)]
pub struct WorkerConfig {
    /// `ws://` or `wss://` URLs of the relays' connect endpoints, without the query: one
    /// per relay in `PROXY_URL` (a comma-separated list), never empty, no duplicates.
    pub connect_urls: Vec<String>,
    pub secret: String,
    pub name: String,
    pub provider: String,
    pub backend_url: String,
    pub models: ModelSource,
    /// `BACKEND_KIND`: what the backend is, or `auto` to ask it.
    pub backend_kind: KindSetting,
    /// `ROUTES`: which routes beyond chat to report (`routes.rs`).
    pub routes: super::routes::RoutesSetting,
    /// `LOAD_KEEP_ALIVE`: Ollama's `keep_alive` for a model loaded on the server's request.
    pub load_keep_alive: String,
    pub max_concurrency: u32,
    pub backend_api_key: Option<String>,
    pub drain_timeout: Duration,
    pub models_refresh: Duration,
    /// Upper bound of the probe backoff while the backend is down (at least 1 s).
    pub backend_probe_max: Duration,
    /// `CONTEXT_TRIM`: trim prompts that do not fit the backend's context (`trim.rs`).
    pub context_trim: bool,
    pub protocol_version: String,
    pub max_ws_message_bytes: usize,
    /// Caps of the streams kept for a resume through another relay (`held/`).
    pub held_stream_bytes: usize,
    pub held_total_bytes: usize,
    pub ca_file: Option<String>,
    /// Wake-on-LAN and sleep settings (`worker/power/`).
    pub power: super::power::PowerConfig,
}

impl WorkerConfig {
    pub fn from_settings(s: &Settings) -> Result<WorkerConfig, ConfigError> {
        let secret = s.required("worker-secret", "WORKER_SECRET")?;
        let connect_urls = connect_urls(&s.string("proxy-url", "http://127.0.0.1:8080"))?;
        if connect_urls.iter().any(|u| u.starts_with("wss://")) && !cfg!(feature = "tls") {
            return Err(ConfigError(
                "https:// proxy URLs need a build with the `tls` feature".into(),
            ));
        }
        let models = parse_models(s.get("models").unwrap_or("*"));
        let backend_kind =
            KindSetting::parse(s.get("backend-kind").unwrap_or("auto")).map_err(ConfigError)?;
        let load_keep_alive = s.string("load-keep-alive", "-1").trim().to_string();
        if load_keep_alive.is_empty() {
            return Err(ConfigError(
                "LOAD_KEEP_ALIVE must be seconds or a duration such as 30m".into(),
            ));
        }
        let max_concurrency: u32 = s.number("max-concurrency", 1)?;
        if max_concurrency == 0 {
            return Err(ConfigError("MAX_CONCURRENCY must be at least 1".into()));
        }
        let backend_url = s
            .string("backend-url", "http://127.0.0.1:8000")
            .trim_end_matches('/')
            .to_string();
        if !backend_url.starts_with("http://") && !backend_url.starts_with("https://") {
            return Err(ConfigError(format!(
                "BACKEND_URL must start with http:// or https:// (got `{}`)",
                super::backend::url::redacted(&backend_url)
            )));
        }
        Ok(WorkerConfig {
            connect_urls,
            secret,
            name: s
                .get("worker-name")
                .map(str::to_string)
                .unwrap_or_else(hostname),
            provider: s.string("provider-name", "local"),
            backend_url,
            models,
            backend_kind,
            routes: super::routes::RoutesSetting::parse(s.get("routes"))?,
            load_keep_alive,
            max_concurrency,
            backend_api_key: s.get("backend-api-key").map(str::to_string),
            drain_timeout: s.secs("drain-timeout-secs", 60)?,
            models_refresh: s
                .secs("models-refresh-secs", 30)?
                .max(Duration::from_secs(1)),
            backend_probe_max: s
                .secs("backend-probe-max-secs", 10)?
                .max(Duration::from_secs(1)),
            context_trim: s.get("context-trim").is_none() || s.flag_bool("context-trim")?,
            protocol_version: s.string("protocol-version", BRIDGE_PROTOCOL_VERSION),
            max_ws_message_bytes: s.number("max-ws-message-bytes", 64 << 20)?,
            held_stream_bytes: s.number("held-stream-bytes", super::held::STREAM_BYTES)?,
            held_total_bytes: s.number("held-total-bytes", super::held::TOTAL_BYTES)?,
            ca_file: s.get("ca-file").map(str::to_string),
            power: super::power::PowerConfig::from_settings(s)?,
        })
    }
}

/// By hand, so that a config printed for debugging shows no secret: the worker secret
/// and backend key are redacted, and URLs lose their userinfo.
impl std::fmt::Debug for WorkerConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        use super::backend::url::redacted;
        let hidden = |set: bool| if set { "<redacted>" } else { "<unset>" };
        f.debug_struct("WorkerConfig")
            .field(
                "connect_urls",
                &self
                    .connect_urls
                    .iter()
                    .map(|u| redacted(u))
                    .collect::<Vec<_>>(),
            )
            .field("secret", &hidden(!self.secret.is_empty()))
            .field("name", &self.name)
            .field("provider", &self.provider)
            .field("backend_url", &redacted(&self.backend_url))
            .field("models", &self.models)
            .field("backend_kind", &self.backend_kind)
            .field("load_keep_alive", &self.load_keep_alive)
            .field("max_concurrency", &self.max_concurrency)
            .field("backend_api_key", &hidden(self.backend_api_key.is_some()))
            .field("drain_timeout", &self.drain_timeout)
            .field("models_refresh", &self.models_refresh)
            .field("backend_probe_max", &self.backend_probe_max)
            .field("context_trim", &self.context_trim)
            .field("protocol_version", &self.protocol_version)
            .field("max_ws_message_bytes", &self.max_ws_message_bytes)
            .field("held_stream_bytes", &self.held_stream_bytes)
            .field("held_total_bytes", &self.held_total_bytes)
            .field("ca_file", &self.ca_file)
            .finish()
    }
}

/// Most relays one worker serves at once: each costs a thread and a connection.
pub const MAX_RELAYS: usize = 16;

/// `PROXY_URL`: one URL, or a comma-separated list of relays (duplicates dropped).
pub fn connect_urls(proxy_url: &str) -> Result<Vec<String>, ConfigError> {
    let mut urls: Vec<String> = Vec::new();
    for part in proxy_url.split(',').filter(|p| !p.trim().is_empty()) {
        let url = connect_url(part)?;
        if !urls.contains(&url) {
            urls.push(url);
        }
    }
    if urls.is_empty() {
        return Err(ConfigError("PROXY_URL is empty".into()));
    }
    if urls.len() > MAX_RELAYS {
        return Err(ConfigError(format!(
            "PROXY_URL lists {} relays; at most {MAX_RELAYS} are served",
            urls.len()
        )));
    }
    Ok(urls)
}

/// `http://host:port[/prefix]` → `ws://host:port[/prefix]/v1/worker/connect`.
pub fn connect_url(proxy_url: &str) -> Result<String, ConfigError> {
    let trimmed = proxy_url.trim().trim_end_matches('/');
    let ws = if let Some(rest) = trimmed.strip_prefix("http://") {
        format!("ws://{rest}")
    } else if let Some(rest) = trimmed.strip_prefix("https://") {
        format!("wss://{rest}")
    } else if trimmed.starts_with("ws://") || trimmed.starts_with("wss://") {
        trimmed.to_string()
    } else {
        return Err(ConfigError(format!(
            "PROXY_URL must start with http:// or https:// (got `{proxy_url}`)"
        )));
    };
    Ok(format!("{ws}/v1/worker/connect"))
}

pub fn parse_models(text: &str) -> ModelSource {
    let list: Vec<String> = text
        .split(',')
        .map(|m| m.trim().to_string())
        .filter(|m| !m.is_empty())
        .collect();
    if list.is_empty() || list.iter().any(|m| m == "*") {
        ModelSource::Backend
    } else {
        ModelSource::Fixed(list)
    }
}

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .or_else(|| std::env::var("HOSTNAME").ok())
        .or_else(|| std::env::var("COMPUTERNAME").ok()) // Windows
        .map(|h| h.trim().to_string())
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "worker".to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proxy_urls_map_to_websocket_urls() {
        assert_eq!(
            connect_url("http://relay:8080").unwrap(),
            "ws://relay:8080/v1/worker/connect"
        );
        assert_eq!(
            connect_url("https://relay.example/").unwrap(),
            "wss://relay.example/v1/worker/connect"
        );
        assert_eq!(
            connect_url("https://h/prefix").unwrap(),
            "wss://h/prefix/v1/worker/connect"
        );
        assert!(connect_url("relay:8080").is_err());
    }

    #[test]
    fn debug_shows_no_secret() {
        let cfg = WorkerConfig::from_settings(&Settings::from_pairs(&[
            ("worker-secret", "sekrit-worker"),
            ("backend-api-key", "sekrit-key"),
            ("backend-url", "http://user:sekrit-pass@gpu:8000"),
            ("proxy-url", "https://u:sekrit-proxy@relay"),
        ]))
        .unwrap();
        let shown = format!("{cfg:?} {cfg:#?}");
        assert!(!shown.contains("sekrit"), "{shown}");
        assert!(
            shown.contains("gpu:8000") && shown.contains("<redacted>"),
            "{shown}"
        );
    }

    #[test]
    fn proxy_url_may_list_several_relays() {
        assert_eq!(
            connect_urls("http://a:1").unwrap(),
            vec!["ws://a:1/v1/worker/connect"]
        );
        assert_eq!(
            connect_urls(" http://a:1 , https://b/ ,http://a:1/,").unwrap(),
            vec!["ws://a:1/v1/worker/connect", "wss://b/v1/worker/connect"]
        );
        assert!(connect_urls(" , ").is_err());
        assert!(connect_urls("http://a:1,b:2").is_err());
        let many = vec!["http://h:1"; MAX_RELAYS + 1]
            .iter()
            .enumerate()
            .map(|(i, u)| format!("{u}{i}"))
            .collect::<Vec<_>>()
            .join(",");
        assert!(connect_urls(&many).is_err());
    }

    #[test]
    fn models_star_or_empty_means_ask_the_backend() {
        assert_eq!(parse_models("*"), ModelSource::Backend);
        assert_eq!(parse_models(" "), ModelSource::Backend);
        assert_eq!(
            parse_models("a, b,,"),
            ModelSource::Fixed(vec!["a".into(), "b".into()])
        );
    }

    #[test]
    fn secret_is_required_and_defaults_apply() {
        let err = WorkerConfig::from_settings(&Settings::from_pairs(&[])).unwrap_err();
        assert!(err.0.contains("WORKER_SECRET"));
        let cfg =
            WorkerConfig::from_settings(&Settings::from_pairs(&[("worker-secret", "s")])).unwrap();
        assert_eq!(cfg.connect_urls, ["ws://127.0.0.1:8080/v1/worker/connect"]);
        assert_eq!(cfg.protocol_version, "2026-04-bridge-v1");
        assert_eq!(cfg.max_concurrency, 1);
        assert_eq!(cfg.backend_url, "http://127.0.0.1:8000");
        assert_eq!(cfg.backend_probe_max, Duration::from_secs(10));
        assert_eq!(cfg.backend_kind, KindSetting::Auto);
        assert!(cfg.context_trim);
        let trim = |v: &str| {
            WorkerConfig::from_settings(&Settings::from_pairs(&[
                ("worker-secret", "s"),
                ("context-trim", v),
            ]))
            .map(|c| c.context_trim)
        };
        assert!(!trim("off").unwrap());
        assert!(trim("on").unwrap());
        assert!(trim("maybe").is_err());
        assert_eq!(cfg.load_keep_alive, "-1");
        let kind = |v: &str| {
            WorkerConfig::from_settings(&Settings::from_pairs(&[
                ("worker-secret", "s"),
                ("backend-kind", v),
            ]))
            .map(|c| c.backend_kind)
        };
        assert_eq!(
            kind("ollama").unwrap(),
            KindSetting::Fixed(super::super::backend_kind::Kind::Ollama)
        );
        assert!(kind("tgi").unwrap_err().0.contains("BACKEND_KIND"));
        let zero = WorkerConfig::from_settings(&Settings::from_pairs(&[
            ("worker-secret", "s"),
            ("backend-probe-max-secs", "0"),
        ]))
        .unwrap();
        assert_eq!(zero.backend_probe_max, Duration::from_secs(1));
    }
}
