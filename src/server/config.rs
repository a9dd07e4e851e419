//! `modelrelay-server` settings: the option table (flags, env vars, defaults) and the
//! typed configuration built from it.

use std::time::Duration;

use super::dispatcher;
use super::http::request::Limits;
use super::lifecycle::governance;
use super::tenancy::policy::Policy;
use crate::cli::{ConfigError, Opt, Settings};

pub const USAGE: &str = "modelrelay-server — the central relay: clients speak OpenAI/Anthropic HTTP, workers dial in over WebSocket.\n\nUsage: modelrelay-server [OPTIONS]";

pub const OPTIONS: &[Opt] = &[
    Opt {
        flag: "listen-addr",
        env: "LISTEN_ADDR",
        default: Some("127.0.0.1:8080"),
        help: "address to listen on for clients and workers",
    },
    Opt {
        flag: "worker-secret",
        env: "WORKER_SECRET",
        default: None,
        help: "shared secret workers must present (required)",
    },
    Opt {
        flag: "provider-name",
        env: "PROVIDER_NAME",
        default: Some("local"),
        help: "provider name workers connect to (?provider=)",
    },
    Opt {
        flag: "max-queue-len",
        env: "MAX_QUEUE_LEN",
        default: Some("100"),
        help: "requests that may wait for a worker before 429",
    },
    Opt {
        flag: "queue-timeout-secs",
        env: "QUEUE_TIMEOUT_SECS",
        default: Some("30"),
        help: "how long a request may wait for a worker before 504",
    },
    Opt {
        flag: "request-timeout-secs",
        env: "REQUEST_TIMEOUT_SECS",
        default: Some("300"),
        help: "longest wait for the answer to start, and between stream chunks",
    },
    Opt {
        flag: "heartbeat-interval-secs",
        env: "HEARTBEAT_INTERVAL_SECS",
        default: Some("15"),
        help: "how often workers are pinged",
    },
    Opt {
        flag: "heartbeat-timeout-secs",
        env: "HEARTBEAT_TIMEOUT_SECS",
        default: Some("45"),
        help: "silence after which a worker is dropped",
    },
    Opt {
        flag: "max-request-body-bytes",
        env: "MAX_REQUEST_BODY_BYTES",
        default: Some("33554432"),
        help: "largest client request body (413 beyond)",
    },
    Opt {
        flag: "max-ws-message-bytes",
        env: "MAX_WS_MESSAGE_BYTES",
        default: Some("67108864"),
        help: "largest WebSocket message accepted from a worker",
    },
    Opt {
        flag: "max-connections",
        env: "MAX_CONNECTIONS",
        default: Some("4096"),
        help: "open connections beyond which new ones get 503",
    },
    Opt {
        flag: "max-models-per-worker",
        env: "MAX_MODELS_PER_WORKER",
        default: Some("256"),
        help: "models kept from one worker's advertisement",
    },
    Opt {
        flag: "drain-timeout-secs",
        env: "DRAIN_TIMEOUT_SECS",
        default: Some("30"),
        help: "on SIGTERM, how long in-flight requests may finish",
    },
    Opt {
        flag: "admin-token",
        env: "MODELRELAY_ADMIN_TOKEN",
        default: None,
        help: "bearer token for /admin/* (unset: admin answers 403)",
    },
    Opt {
        flag: "require-api-keys",
        env: "MODELRELAY_REQUIRE_API_KEYS",
        default: Some("false"),
        help: "require a client API key on inference routes and /v1/models",
    },
    Opt {
        flag: "state-dir",
        env: "STATE_DIR",
        default: Some("/var/lib/modelrelay"),
        help: "directory for the API keys (keys.json), the usage journal (usage.journal) and used op-token nonces (op-nonces)",
    },
    Opt {
        flag: "state-url",
        env: "STATE_URL",
        default: None,
        help: "redis://[user:pass@]host:port/db: share API keys, rate limits and op-token nonces with the other relays through Redis or Valkey (needs the redis-store build)",
    },
    Opt {
        flag: "usage-retention-days",
        env: "USAGE_RETENTION_DAYS",
        default: Some("400"),
        help: "days of hourly token usage kept in the usage journal (0: forever)",
    },
    Opt {
        flag: "tls-cert-file",
        env: "TLS_CERT_FILE",
        default: None,
        help: "PEM certificate chain: serve HTTPS/WSS (needs --tls-key-file; reloaded on SIGHUP)",
    },
    Opt {
        flag: "tls-key-file",
        env: "TLS_KEY_FILE",
        default: None,
        help: "PEM private key for --tls-cert-file",
    },
    Opt {
        flag: "max-queue-per-tenant",
        env: "MAX_QUEUE_PER_TENANT",
        default: None,
        help: "requests one tenant may have waiting before 429 tenant_queue_full (default: half of MAX_QUEUE_LEN)",
    },
    Opt {
        flag: "priority-aging-secs",
        env: "PRIORITY_AGING_SECS",
        default: Some("10"),
        help: "wait after which a queued request moves up one priority class (0: never)",
    },
    Opt {
        flag: "default-rate-limit",
        env: "DEFAULT_RATE_LIMIT",
        default: None,
        help: "request rate for tenants without TENANT_RATE_LIMIT_<tenant>, e.g. 100req/min",
    },
    Opt {
        flag: "default-token-limit",
        env: "DEFAULT_TOKEN_LIMIT",
        default: None,
        help: "token budget for tenants without TENANT_TOKEN_LIMIT_<tenant>, e.g. 50000tok/min",
    },
    Opt {
        flag: "metrics-max-tenants",
        env: "METRICS_MAX_TENANTS",
        default: Some("100"),
        help: "tenants named in /metrics and /admin/stats; the rest count as `other`",
    },
    Opt {
        flag: "outlier-consecutive-failures",
        env: "OUTLIER_CONSECUTIVE_FAILURES",
        default: Some("5"),
        help: "5xx, transport failures or request timeouts in a row after which a worker is ejected for a while (0: never)",
    },
    Opt {
        flag: "routing-affinity",
        env: "ROUTING_AFFINITY",
        default: Some("on"),
        help: "on or off: send each conversation back to the worker whose backend already holds its prompt prefix in cache (off: load and round robin only)",
    },
    Opt {
        flag: "affinity-wait-ms",
        env: "AFFINITY_WAIT_MS",
        default: Some("20000"),
        help: "how long a request may wait for its full cached worker before going elsewhere (0: never)",
    },
    Opt {
        flag: "moe-enabled",
        env: "MOE_ENABLED",
        default: Some("false"),
        help: "answer `moe-<model>` on /v1/chat/completions with a multiple-opinions ensemble (3 drafts, 3 critiques, 1 final)",
    },
    Opt {
        flag: "verified-op-token-key-path",
        env: "VERIFIED_OP_TOKEN_KEY_PATH",
        default: None,
        help: "HMAC key for lifecycle op tokens: a file (one shared key) or a directory (one key file per signer); unset: lifecycle calls need the admin token",
    },
    Opt {
        flag: "require-op-token",
        env: "REQUIRE_OP_TOKEN",
        default: Some("false"),
        help: "lifecycle calls need a valid op token even with the admin token (needs VERIFIED_OP_TOKEN_KEY_PATH)",
    },
    Opt {
        flag: "governance-signers",
        env: "GOVERNANCE_SIGNERS",
        default: None,
        help: "comma list of signers whose op-token signatures count (unset: any signer with a key)",
    },
    Opt {
        flag: "governance-min-signers",
        env: "GOVERNANCE_MIN_SIGNERS",
        default: Some("1"),
        help: "distinct valid signers an op token needs",
    },
    Opt {
        flag: "public-url",
        env: "PUBLIC_URL",
        default: None,
        help: "URL browsers and workers use to reach this server (setup wizard commands, dashboard Origin check) [default: from the request's Host header]",
    },
    Opt {
        flag: "worker-download-dir",
        env: "WORKER_DOWNLOAD_DIR",
        default: None,
        help: "directory of worker binaries named by target triple, offered by /setup with their SHA-256",
    },
    Opt {
        flag: "log-level",
        env: "LOG_LEVEL",
        default: Some("info"),
        help: "error, warn, info, debug or trace (RUST_LOG also works)",
    },
    Opt {
        flag: "idle-timeout-secs",
        env: "IDLE_TIMEOUT_SECS",
        default: Some("75"),
        help: "how long an idle keep-alive client connection stays open",
    },
];

/// Typed server configuration.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    pub listen_addr: String,
    pub provider: String,
    pub worker_secret: String,
    pub dispatch: dispatcher::Config,
    pub limits: Limits,
    pub max_ws_message_bytes: usize,
    pub max_connections: usize,
    pub drain_timeout: Duration,
    pub admin_token: Option<String>,
    pub require_api_keys: bool,
    pub state_dir: std::path::PathBuf,
    /// Shared state store (`STATE_URL`); none: everything stays in this relay.
    pub state_url: Option<String>,
    /// Days of usage buckets kept (`USAGE_RETENTION_DAYS`, 0 = forever).
    pub usage_retention_days: u32,
    /// Certificate chain and key files, when the server terminates TLS itself.
    pub tls: Option<(String, String)>,
    /// Per-tenant rate limits, token budgets and weights.
    pub tenancy: Policy,
    pub metrics_max_tenants: usize,
    /// `moe-<model>` on `/v1/chat/completions` runs the ensemble (`MOE_ENABLED`).
    pub moe_enabled: bool,
    /// Who may load, unload and flush (admin token, op tokens).
    pub governance: governance::Config,
    /// How browsers and workers reach us (`PUBLIC_URL`, no trailing slash).
    pub public_url: Option<String>,
    /// Worker binaries the setup wizard hands out (`WORKER_DOWNLOAD_DIR`).
    pub worker_download_dir: Option<std::path::PathBuf>,
}

impl ServerConfig {
    pub fn from_settings(s: &Settings) -> Result<ServerConfig, ConfigError> {
        let max_queue_len: usize = s.number("max-queue-len", 100)?;
        let dispatch = dispatcher::Config {
            max_queue_len,
            max_queue_per_tenant: s.number("max-queue-per-tenant", (max_queue_len / 2).max(1))?,
            priority_aging: s.secs("priority-aging-secs", 10)?,
            outlier_consecutive_failures: s.number("outlier-consecutive-failures", 5)?,
            queue_timeout: s.secs("queue-timeout-secs", 30)?,
            request_timeout: s.secs("request-timeout-secs", 300)?,
            heartbeat_interval: s.secs("heartbeat-interval-secs", 15)?,
            heartbeat_timeout: s.secs("heartbeat-timeout-secs", 45)?,
            max_requeues: 3,
            max_models_per_worker: s.number("max-models-per-worker", 256)?,
            affinity: s.get("routing-affinity").is_none() || s.flag_bool("routing-affinity")?,
            affinity_wait: std::time::Duration::from_millis(
                s.number("affinity-wait-ms", dispatcher::DEFAULT_AFFINITY_WAIT_MS)?,
            ),
        };
        if dispatch.heartbeat_interval.is_zero()
            || dispatch.heartbeat_timeout < dispatch.heartbeat_interval
        {
            return Err(ConfigError(
                "HEARTBEAT_TIMEOUT_SECS must be at least HEARTBEAT_INTERVAL_SECS (> 0)".into(),
            ));
        }
        let limits = Limits {
            max_body_bytes: s.number("max-request-body-bytes", 32 << 20)?,
            idle_timeout: s.secs("idle-timeout-secs", 75)?,
            ..Limits::default()
        };
        let secret = s.required("worker-secret", "WORKER_SECRET")?;
        Ok(ServerConfig {
            listen_addr: s.string("listen-addr", "127.0.0.1:8080"),
            provider: s.string("provider-name", "local"),
            worker_secret: secret,
            dispatch,
            limits,
            max_ws_message_bytes: s.number("max-ws-message-bytes", 64 << 20)?,
            max_connections: s.number("max-connections", 4096)?,
            drain_timeout: s.secs("drain-timeout-secs", 30)?,
            admin_token: s.get("admin-token").map(str::to_string),
            require_api_keys: s.flag_bool("require-api-keys")?,
            state_dir: s.string("state-dir", "/var/lib/modelrelay").into(),
            state_url: s.get("state-url").map(str::to_string),
            usage_retention_days: s.number("usage-retention-days", 400)?,
            tls: tls_files(s)?,
            tenancy: Policy::from_env(
                // Entries that are not UTF-8 cannot name a tenant: skipped, not fatal.
                std::env::vars_os()
                    .filter_map(|(k, v)| Some((k.into_string().ok()?, v.into_string().ok()?))),
                s.get("default-rate-limit"),
                s.get("default-token-limit"),
            )
            .map_err(ConfigError)?,
            metrics_max_tenants: s.number("metrics-max-tenants", 100)?,
            moe_enabled: s.flag_bool("moe-enabled")?,
            governance: governance_config(s)?,
            public_url: public_url(s)?,
            worker_download_dir: s.get("worker-download-dir").map(Into::into),
        })
    }
}

fn governance_config(s: &Settings) -> Result<governance::Config, ConfigError> {
    governance::Config::new(
        s.get("verified-op-token-key-path"),
        s.flag_bool("require-op-token")?,
        s.get("governance-signers"),
        s.number("governance-min-signers", 1)?,
    )
    .map_err(ConfigError)
}

fn public_url(s: &Settings) -> Result<Option<String>, ConfigError> {
    let Some(url) = s.get("public-url") else {
        return Ok(None);
    };
    let rest = url
        .strip_prefix("https://")
        .or_else(|| url.strip_prefix("http://"));
    match rest {
        Some(host)
            if !host.trim_end_matches('/').is_empty() && !host.contains(char::is_whitespace) =>
        {
            Ok(Some(url.trim_end_matches('/').to_string()))
        }
        _ => Err(ConfigError(format!(
            "PUBLIC_URL must be an http:// or https:// URL, got `{url}`"
        ))),
    }
}

fn tls_files(s: &Settings) -> Result<Option<(String, String)>, ConfigError> {
    match (s.get("tls-cert-file"), s.get("tls-key-file")) {
        (None, None) => Ok(None),
        (Some(_), None) | (None, Some(_)) => Err(ConfigError(
            "TLS_CERT_FILE and TLS_KEY_FILE go together".into(),
        )),
        (Some(c), Some(k)) if cfg!(feature = "server-tls") => {
            Ok(Some((c.to_string(), k.to_string())))
        }
        _ => Err(ConfigError(
            "this build has no built-in server TLS (rebuild with `--features server-tls`)".into(),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn affinity_settings_default_on_with_the_measured_wait() {
        let opt = OPTIONS.iter().find(|o| o.env == "AFFINITY_WAIT_MS");
        let shown = opt.and_then(|o| o.default).unwrap_or_default();
        assert_eq!(shown, dispatcher::DEFAULT_AFFINITY_WAIT_MS.to_string());
        let cfg = |pairs: &[(&'static str, &str)]| {
            let mut all = vec![("worker-secret", "s")];
            all.extend_from_slice(pairs);
            ServerConfig::from_settings(&Settings::from_pairs(&all)).map(|c| c.dispatch)
        };
        let d = cfg(&[]).expect("defaults");
        assert!(d.affinity);
        assert_eq!(
            d.affinity_wait.as_millis() as u64,
            dispatcher::DEFAULT_AFFINITY_WAIT_MS
        );
        let off = cfg(&[("routing-affinity", "off"), ("affinity-wait-ms", "0")]).expect("off");
        assert!(!off.affinity && off.affinity_wait.is_zero());
        assert!(cfg(&[("routing-affinity", "sometimes")]).is_err());
    }
}
