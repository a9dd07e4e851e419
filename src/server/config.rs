//! `modelrelay-server` settings: the typed configuration built from the option table
//! (flags, env vars, defaults, in [`options`]), and the checks that reject a bad one.

use std::time::Duration;

use super::client_ip::TrustedProxies;
use super::dispatcher;
use super::http::budget::BodyBudget;
use super::http::pieces::DEFAULT_PIECES_OVER;
use super::http::request::{Limits, DEFAULT_BODY_BUDGET};
use super::lifecycle::governance;
use super::origin::AllowedOrigins;
use super::tenancy::policy::Policy;
use crate::cli::{ConfigError, Settings};

mod options;
pub use options::{OPTIONS, USAGE};

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
    /// CA certificates (PEM) a `rediss://` store is checked against (`STATE_CA_FILE`).
    pub state_ca_file: Option<std::path::PathBuf>,
    /// Days of usage buckets kept (`USAGE_RETENTION_DAYS`, 0 = forever).
    pub usage_retention_days: u32,
    /// Certificate chain and key files, when the server terminates TLS itself.
    pub tls: Option<(String, String)>,
    /// Per-tenant rate limits, token budgets and weights.
    pub tenancy: Policy,
    pub metrics_max_tenants: usize,
    /// `moe-<model>` on `/v1/chat/completions` runs the ensemble (`MOE_ENABLED`).
    pub moe_enabled: bool,
    /// Streamed chat answers whose worker dies are finished on another worker unless
    /// the request says otherwise (`CONTINUE_ON_FAILURE`; see `server::continuation`).
    pub continue_on_failure: bool,
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
    /// More routes relayed as they are, binary-safe (`EXTRA_ROUTES`).
    pub extra_routes: Vec<&'static str>,
    /// Streams that outlive a dropped connection (`RESUMABLE_STREAMS`, `RESUME_*`).
    pub resume: super::resume::Config,
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
            pieces_over: s.number("body-pieces-over-bytes", DEFAULT_PIECES_OVER)?,
            ..Limits::default()
        };
        if limits.body_budget.max() < limits.max_body_bytes {
            return Err(ConfigError(
                "MAX_BUFFERED_BODY_BYTES must be at least MAX_REQUEST_BODY_BYTES".into(),
            ));
        }
        let max_ws_message_bytes = s.number("max-ws-message-bytes", 64 << 20)?;
        // With bodies in pieces, only JSON bodies must fit one message; one that does
        // not gets its `413` as an escaped body too large does.
        if limits.pieces_over == 0 {
            fits_one_message(limits.max_body_bytes, max_ws_message_bytes)?;
        }
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
            state_ca_file: s.get("state-ca-file").map(Into::into),
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
            continue_on_failure: s.flag_bool("continue-on-failure")?,
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
            extra_routes: super::endpoints::parse_extra_routes(s.get("extra-routes"))?,
            resume: super::resume::Config {
                default_on: s.flag_bool("resumable-streams")?,
                grace: s.secs("resume-grace-secs", 30)?,
                stream_bytes: s.number("resume-buffer-bytes", 1 << 20)?,
                total_bytes: s.number("resume-total-bytes", 64 << 20)?,
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
            .field("state_ca_file", &self.state_ca_file)
            .field("usage_retention_days", &self.usage_retention_days)
            .field("tls", &self.tls)
            .field("tenancy", &self.tenancy)
            .field("metrics_max_tenants", &self.metrics_max_tenants)
            .field("moe_enabled", &self.moe_enabled)
            .field("continue_on_failure", &self.continue_on_failure)
            .field("governance", &self.governance)
            .field("public_url", &self.public_url)
            .field("worker_download_dir", &self.worker_download_dir)
            .field("trusted_proxies", &self.trusted_proxies)
            .field("allowed_origins", &self.allowed_origins)
            .field("resume", &self.resume)
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
    let op_tokens_per_relay = s.flag_bool("op-tokens-per-relay")?;
    governance::Config::new(
        s.get("verified-op-token-key-path"),
        s.flag_bool("require-op-token")?,
        s.get("governance-signers"),
        s.number("governance-min-signers", 1)?,
    )
    .map(|cfg| governance::Config {
        op_tokens_per_relay,
        ..cfg
    })
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
        let cfg = |body: &str, ws: &str, pieces: &str| {
            let pairs = [
                ("worker-secret", "s"),
                ("max-request-body-bytes", body),
                ("max-ws-message-bytes", ws),
                ("body-pieces-over-bytes", pieces),
            ];
            ServerConfig::from_settings(&Settings::from_pairs(&pairs))
        };
        assert!(cfg("33554432", "67108864", "0").is_ok());
        let e = cfg("67108864", "67108864", "0").expect_err("refused");
        assert!(e.to_string().contains("MAX_WS_MESSAGE_BYTES"), "{e}");
        // Large bodies go in pieces: only JSON bodies must fit one message.
        assert!(cfg("120000000", "67108864", "4194304").is_ok());
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
