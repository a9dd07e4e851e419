//! `modelrelay-server` settings: the option table (flags, env vars, defaults) and the
//! typed configuration built from it.

use std::time::Duration;

use super::client_ip::TrustedProxies;
use super::dispatcher;
use super::http::budget::BodyBudget;
use super::http::request::{Limits, DEFAULT_BODY_BUDGET};
use super::lifecycle::governance;
use super::origin::AllowedOrigins;
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
        help: "requests that may wait for a worker before 429 (0: no cap)",
    },
    Opt {
        flag: "queue-timeout-secs",
        env: "QUEUE_TIMEOUT_SECS",
        default: Some("30"),
        help: "how long a request may wait for a worker before 504 (0: no limit)",
    },
    Opt {
        flag: "request-timeout-secs",
        env: "REQUEST_TIMEOUT_SECS",
        default: Some("300"),
        help: "longest wait for the answer to start, and between stream chunks (0: no limit)",
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
        flag: "max-buffered-body-bytes",
        env: "MAX_BUFFERED_BODY_BYTES",
        default: Some("536870912"),
        help: "request bodies held in memory at once, all connections together (503 beyond)",
    },
    Opt {
        flag: "write-timeout-secs",
        env: "WRITE_TIMEOUT_SECS",
        default: Some("30"),
        help: "how long a client may stop reading an answer before it is cancelled (0: never)",
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
        flag: "drain-grace-secs",
        env: "DRAIN_GRACE_SECS",
        default: Some("5"),
        help: "on SIGTERM, while workers report other relays: keep serving this long (health answers 503) before draining",
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
        help: "directory for the API keys (keys.json), the usage journal (usage.journal), used op-token nonces (op-nonces) and sleeping boxes (sleepers.json)",
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
        flag: "wake-timeout-secs",
        env: "WAKE_TIMEOUT_SECS",
        default: Some("120"),
        help: "how long a request waits for a sleeping box it woke (Wake-on-LAN) before failing",
    },
    Opt {
        flag: "wake-when-busy",
        env: "WAKE_WHEN_BUSY",
        default: Some("off"),
        help: "on: also wake a sleeping box when every awake worker of the model is full and more than WAKE_QUEUE_DEPTH wait",
    },
    Opt {
        flag: "wake-queue-depth",
        env: "WAKE_QUEUE_DEPTH",
        default: Some("4"),
        help: "with WAKE_WHEN_BUSY: requests that must wait for a model before a sleeping box is woken",
    },
    Opt {
        flag: "wake-from-relay",
        env: "WAKE_FROM_RELAY",
        default: Some("off"),
        help: "on: the relay sends the magic packet itself (it sits on the boxes' LAN) instead of asking an awake worker",
    },
    Opt {
        flag: "idle-watts",
        env: "IDLE_WATTS",
        default: None,
        help: "what an idle GPU box draws, in watts: /admin/workers then shows the energy each sleeping box saved",
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
        help: "requests one named tenant may have waiting before 429 tenant_queue_full (default: half of MAX_QUEUE_LEN; 0: no cap)",
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
        help: "how long an idle keep-alive client connection stays open (must be above 0)",
    },
    Opt {
        flag: "trusted-proxies",
        env: "TRUSTED_PROXIES",
        default: None,
        help: "reverse proxies (IPs, CIDRs, comma list) whose X-Forwarded-For names the client",
    },
    Opt {
        flag: "allowed-origins",
        env: "ALLOWED_ORIGINS",
        default: None,
        help: "web origins (comma list, or *) whose pages may call the relay, with CORS",
    },
];

/// Typed server configuration. `Debug` is written by hand: it never shows a secret.
#[derive(Clone)]
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
    /// Proxies whose forwarding headers name the client (`TRUSTED_PROXIES`).
    pub trusted_proxies: TrustedProxies,
    /// Web origins allowed to call us from a browser (`ALLOWED_ORIGINS`).
    pub allowed_origins: AllowedOrigins,
    /// What an idle box draws, for the energy sleeping saved (`IDLE_WATTS`).
    pub idle_watts: Option<f64>,
}

impl ServerConfig {
    pub fn from_settings(s: &Settings) -> Result<ServerConfig, ConfigError> {
        let max_queue_len: usize = s.number("max-queue-len", 100)?;
        // No cap on the queue: none on a tenant's share of it either, unless set.
        let per_tenant = match max_queue_len {
            0 => 0,
            len => (len / 2).max(1),
        };
        let dispatch = dispatcher::Config {
            max_queue_len,
            max_queue_per_tenant: s.number("max-queue-per-tenant", per_tenant)?,
            priority_aging: s.secs("priority-aging-secs", 10)?,
            outlier_consecutive_failures: s.number("outlier-consecutive-failures", 5)?,
            queue_timeout: s.secs("queue-timeout-secs", 30)?,
            request_timeout: s.secs("request-timeout-secs", 300)?,
            heartbeat_interval: s.secs("heartbeat-interval-secs", 15)?,
            heartbeat_timeout: s.secs("heartbeat-timeout-secs", 45)?,
            drain_grace: s.secs("drain-grace-secs", 5)?,
            max_requeues: 3,
            max_models_per_worker: s.number("max-models-per-worker", 256)?,
            affinity: s.get("routing-affinity").is_none() || s.flag_bool("routing-affinity")?,
            affinity_wait: std::time::Duration::from_millis(
                s.number("affinity-wait-ms", dispatcher::DEFAULT_AFFINITY_WAIT_MS)?,
            ),
            wake: dispatcher::WakeConfig {
                timeout: s.secs("wake-timeout-secs", 120)?,
                when_busy: s.flag_bool("wake-when-busy")?,
                queue_depth: s.number("wake-queue-depth", 4)?,
                from_relay: s.flag_bool("wake-from-relay")?,
            },
        };
        if dispatch.heartbeat_interval.is_zero()
            || dispatch.heartbeat_timeout < dispatch.heartbeat_interval
        {
            return Err(ConfigError(
                "HEARTBEAT_TIMEOUT_SECS must be at least HEARTBEAT_INTERVAL_SECS (> 0)".into(),
            ));
        }
        let idle_timeout = s.secs("idle-timeout-secs", 75)?;
        if idle_timeout.is_zero() {
            // Without an idle timeout every idle keep-alive connection would hold a
            // connection slot for ever: a few clients could use up MAX_CONNECTIONS.
            return Err(ConfigError(
                "IDLE_TIMEOUT_SECS must be above 0 (an idle connection without a timeout \
                 holds a connection slot for ever)"
                    .into(),
            ));
        }
        let limits = Limits {
            max_body_bytes: s.number("max-request-body-bytes", 32 << 20)?,
            body_budget: BodyBudget::new(s.number("max-buffered-body-bytes", DEFAULT_BODY_BUDGET)?),
            idle_timeout,
            write_timeout: s.secs("write-timeout-secs", 30)?,
            ..Limits::default()
        };
        if limits.body_budget.max() < limits.max_body_bytes {
            return Err(ConfigError(
                "MAX_BUFFERED_BODY_BYTES must be at least MAX_REQUEST_BODY_BYTES".into(),
            ));
        }
        let max_ws_message_bytes = s.number("max-ws-message-bytes", 64 << 20)?;
        fits_one_message(limits.max_body_bytes, max_ws_message_bytes)?;
        let secret = s.required("worker-secret", "WORKER_SECRET")?;
        Ok(ServerConfig {
            listen_addr: s.string("listen-addr", "127.0.0.1:8080"),
            provider: s.string("provider-name", "local"),
            worker_secret: secret,
            dispatch,
            limits,
            max_ws_message_bytes,
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
            moe_enabled: moe_enabled(s)?,
            governance: governance_config(s)?,
            public_url: public_url(s)?,
            worker_download_dir: s.get("worker-download-dir").map(Into::into),
            trusted_proxies: TrustedProxies::parse(s.get("trusted-proxies").unwrap_or(""))
                .map_err(ConfigError)?,
            allowed_origins: AllowedOrigins::parse(s.get("allowed-origins").unwrap_or(""))
                .map_err(ConfigError)?,
            idle_watts: match s.number("idle-watts", 0.0f64)? {
                w if w.is_finite() && w > 0.0 => Some(w),
                _ => None,
            },
        })
    }
}

impl std::fmt::Debug for ServerConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let hidden = |set: bool| if set { "<redacted>" } else { "<unset>" };
        f.debug_struct("ServerConfig")
            .field("listen_addr", &self.listen_addr)
            .field("provider", &self.provider)
            .field("worker_secret", &hidden(!self.worker_secret.is_empty()))
            .field("dispatch", &self.dispatch)
            .field("limits", &self.limits)
            .field("max_ws_message_bytes", &self.max_ws_message_bytes)
            .field("max_connections", &self.max_connections)
            .field("drain_timeout", &self.drain_timeout)
            .field("admin_token", &hidden(self.admin_token.is_some()))
            .field("require_api_keys", &self.require_api_keys)
            .field("state_dir", &self.state_dir)
            .field("usage_retention_days", &self.usage_retention_days)
            .field("tls", &self.tls)
            .field("tenancy", &self.tenancy)
            .field("metrics_max_tenants", &self.metrics_max_tenants)
            .field("moe_enabled", &self.moe_enabled)
            .field("governance", &self.governance)
            .field("public_url", &self.public_url)
            .field("worker_download_dir", &self.worker_download_dir)
            .field("trusted_proxies", &self.trusted_proxies)
            .field("allowed_origins", &self.allowed_origins)
            .finish()
    }
}

/// A request body travels to a worker inside one WebSocket message, escaped. Refuses a
/// configuration where even a body with nothing to escape would not fit (with a MiB for
/// headers and envelope); bodies that fit raw but not escaped get a `413` each.
fn fits_one_message(max_body: usize, max_message: usize) -> Result<(), ConfigError> {
    if max_body.saturating_add(1 << 20) <= max_message {
        return Ok(());
    }
    Err(ConfigError(format!(
        "MAX_REQUEST_BODY_BYTES ({max_body}) plus 1 MiB for headers must fit in \
         MAX_WS_MESSAGE_BYTES ({max_message}): a body is sent to a worker in one message"
    )))
}

/// `MOE_ENABLED=true` in a build without the `moe` feature is refused, not ignored.
fn moe_enabled(s: &Settings) -> Result<bool, ConfigError> {
    let on = s.flag_bool("moe-enabled")?;
    if on && !cfg!(feature = "moe") {
        return Err(ConfigError(
            "MOE_ENABLED: this build has no multiple-opinions ensemble (rebuild with the `moe` feature, which the default build has)".into(),
        ));
    }
    Ok(on)
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

    #[test]
    fn debug_shows_no_secret() {
        let cfg = ServerConfig::from_settings(&Settings::from_pairs(&[
            ("worker-secret", "sekrit-worker"),
            ("admin-token", "sekrit-admin"),
        ]))
        .unwrap();
        let shown = format!("{cfg:?} {cfg:#?}");
        assert!(!shown.contains("sekrit"), "{shown}");
        assert!(shown.contains("<redacted>"), "{shown}");
    }

    #[test]
    fn a_body_limit_that_cannot_fit_one_worker_message_is_refused() {
        let cfg = |body: &str, ws: &str| {
            let pairs = [
                ("worker-secret", "s"),
                ("max-request-body-bytes", body),
                ("max-ws-message-bytes", ws),
            ];
            ServerConfig::from_settings(&Settings::from_pairs(&pairs))
        };
        assert!(cfg("33554432", "67108864").is_ok());
        let e = cfg("67108864", "67108864").expect_err("refused");
        assert!(e.to_string().contains("MAX_WS_MESSAGE_BYTES"), "{e}");
    }

    #[test]
    fn zero_means_no_limit_or_is_refused_with_a_reason() {
        let cfg = |pairs: &[(&'static str, &str)]| {
            let mut all = vec![("worker-secret", "s")];
            all.extend_from_slice(pairs);
            ServerConfig::from_settings(&Settings::from_pairs(&all))
        };
        let zero = cfg(&[
            ("max-queue-len", "0"),
            ("queue-timeout-secs", "0"),
            ("request-timeout-secs", "0"),
        ])
        .expect("zeros are accepted");
        let d = &zero.dispatch;
        assert_eq!((d.max_queue_len, d.max_queue_per_tenant), (0, 0));
        assert!(d.queue_limit() > Duration::from_secs(50 * 365 * 24 * 3600));
        assert!(d.request_limit() > Duration::from_secs(50 * 365 * 24 * 3600));
        let set = cfg(&[("max-queue-len", "0"), ("max-queue-per-tenant", "5")]).expect("set");
        assert_eq!(set.dispatch.max_queue_per_tenant, 5);
        let Err(e) = cfg(&[("idle-timeout-secs", "0")]) else {
            panic!("IDLE_TIMEOUT_SECS=0 accepted");
        };
        assert!(e.0.contains("IDLE_TIMEOUT_SECS"), "{}", e.0);
    }

    /// A setting of a part the build left out refuses to start and names the feature;
    /// in a build with the part it is accepted.
    #[test]
    fn settings_of_parts_left_out_of_the_build_are_refused() {
        let cfg = |pair: (&'static str, &str)| {
            ServerConfig::from_settings(&Settings::from_pairs(&[("worker-secret", "s"), pair]))
        };
        let moe = cfg(("moe-enabled", "true"));
        match moe {
            Ok(c) => assert!(cfg!(feature = "moe") && c.moe_enabled),
            Err(e) => assert!(
                !cfg!(feature = "moe") && e.0.contains("`moe` feature"),
                "{e}"
            ),
        }
        let key = std::env::temp_dir().join("mr-config-no-such-key");
        let gov = cfg(("verified-op-token-key-path", key.to_str().unwrap_or("k")));
        match gov {
            Ok(c) => assert!(cfg!(feature = "governance") && c.governance.key_path.is_some()),
            Err(e) => assert!(
                !cfg!(feature = "governance") && e.0.contains("`governance` feature"),
                "{e}"
            ),
        }
    }
}
