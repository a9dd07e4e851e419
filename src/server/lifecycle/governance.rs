//! Who may load, unload or flush: the admin token, or a signed `verifiedOpToken`.
//!
//! # Decision ([`Governance::authorize`])
//! | `VERIFIED_OP_TOKEN_KEY_PATH` | `REQUIRE_OP_TOKEN` | allowed with |
//! |---|---|---|
//! | unset | (must be false) | the admin token |
//! | set | `false` (default) | the admin token, or a valid op token |
//! | set | `true` | a valid op token only |
//!
//! When the admin token suffices, an op token sent along is ignored (its nonce is not
//! used up). Every decision logs one line — operation, model, signers, outcome — and
//! never the token or a signature.
//!
//! # The token
//! As in the seed: `{"opToken": {"operation", "modelId", "issuedAt", "signers", "nonce"},
//! "signature": "<HMAC-SHA256>"}`, or, beyond the seed, `"signatures": [{"signer",
//! "signature"}]` with one HMAC per signer under that signer's own key. Signatures are
//! 64 hex digits (what `sign-op-token` writes) or base64/base64url of the 32 bytes. The
//! signed bytes are [`OpToken::canonical_bytes`] (a fixed six-line text, not the JSON,
//! so no JSON canonicalisation is needed to verify). `operation` is `model-load`,
//! `model-unload` or `cache-flush` (`load`, `unload`, `flush` also accepted).
//!
//! The key path decides the form: a **file** is one shared key and tokens carry one
//! `signature` (the listed signers are taken on trust: a shared key cannot tell them
//! apart); a **directory** holds one key file per signer, named by the signer, and
//! tokens carry `signatures`: only signers whose own signature verifies count — real
//! M-of-N.
//!
//! Checks, in order, each refused with its own [`Refusal`]: the token parses (401),
//! some signature verifies (401), operation and model match the call (403), `issuedAt`
//! within [`WINDOW_SECS`] of now either way (401), every listed signer is known (in
//! `GOVERNANCE_SIGNERS`, or else holding a key) and at least `GOVERNANCE_MIN_SIGNERS`
//! verified (403), and the nonce was never used (401; recorded durably only once
//! everything else passed, see [`replay`]). Before the nonce is recorded: with several
//! relays and no shared store, op tokens are refused (503) unless `OP_TOKENS_PER_RELAY`
//! accepts per-relay replay stores (see [`relays`]).
//!
//! # Use from a route
//! ```ignore
//! let token = req.header(OP_TOKEN_HEADER).map(Cow::Borrowed).or_else(|| token_from_body(&body));
//! let target = model_id;                       // for cache-flush: flush_target(scope, value)
//! match ctx.governance.authorize(token.as_deref(), Operation::Load, target, admin_ok, now_unix()) {
//!     Ok(_) => { /* start the task */ }
//!     Err(r) => return Err(ApiError::new(r.status(), r.code(), r.message())),
//! }
//! ```
//! The token travels in the `X-Op-Token` header (JSON text or base64url of it) or, as in
//! the seed, in the `verifiedOpToken` field of the JSON body (a string in either form,
//! or the token object itself). For `cache-flush` the token's `modelId` names the flush
//! target ([`flush_target`]) so a token for one tenant cannot flush everything.

// Without the `governance` feature (the router build) only the admin token governs:
// the token parser, the signature check and the replay store are not compiled, and
// `VERIFIED_OP_TOKEN_KEY_PATH` refuses to start ([`NOT_BUILT`]).
#[cfg(feature = "governance")]
mod encoding;
#[cfg(feature = "governance")]
pub mod keys;
#[cfg(feature = "governance")]
pub mod mint;
mod refusal;
#[cfg(feature = "governance")]
pub mod relays;
#[cfg(feature = "governance")]
pub mod replay;
#[cfg(feature = "governance")]
pub mod token;

#[cfg(all(test, feature = "governance"))]
mod tests;

use std::borrow::Cow;
use std::path::{Path, PathBuf};

#[cfg(feature = "governance")]
pub use keys::{Key, KeySet};
pub use refusal::Refusal;
#[cfg(feature = "governance")]
pub use replay::NonceStore;
#[cfg(feature = "governance")]
pub use token::{OpToken, Signatures, SignedToken, SignerSignature};

/// Why a build without the `governance` feature refuses `VERIFIED_OP_TOKEN_KEY_PATH`
/// and `sign-op-token`.
pub const NOT_BUILT: &str = "this build has no op-token governance (built without the `governance` feature, which the default build has); lifecycle calls take the admin token";

/// How far `issuedAt` may be from the clock, either way.
pub const WINDOW_SECS: u64 = 300;
/// Request header that may carry the token.
pub const OP_TOKEN_HEADER: &str = "x-op-token";
/// JSON body field that may carry the token (the seed's).
pub const BODY_FIELD: &str = "verifiedOpToken";

/// A governed operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Operation {
    Load,
    Unload,
    Flush,
}

impl Operation {
    /// The seed's name, written into tokens.
    pub fn name(self) -> &'static str {
        match self {
            Operation::Load => "model-load",
            Operation::Unload => "model-unload",
            Operation::Flush => "cache-flush",
        }
    }

    /// The seed's name or its short form.
    pub fn parse(text: &str) -> Option<Operation> {
        match text {
            "model-load" | "load" => Some(Operation::Load),
            "model-unload" | "unload" => Some(Operation::Unload),
            "cache-flush" | "flush" => Some(Operation::Flush),
            _ => None,
        }
    }
}

/// The target a `cache-flush` token names in `modelId`: `*` for `scope: all`, the model
/// id for `model`, `tenant:<id>` and `tag:<tag>` for the others.
pub fn flush_target(scope: &str, value: Option<&str>) -> String {
    match (scope, value) {
        ("all", _) => "*".to_string(),
        ("model", Some(model)) => model.to_string(),
        (scope, Some(value)) => format!("{scope}:{value}"),
        (scope, None) => format!("{scope}:"),
    }
}

/// The token in a JSON body's `verifiedOpToken`: a string as is, an object as its JSON.
pub fn token_from_body(body: &serde_json::Value) -> Option<Cow<'_, str>> {
    match body.get(BODY_FIELD)? {
        serde_json::Value::String(text) => Some(Cow::Borrowed(text)),
        value @ serde_json::Value::Object(_) => Some(Cow::Owned(value.to_string())),
        _ => None,
    }
}

/// Governance settings (`VERIFIED_OP_TOKEN_KEY_PATH`, `REQUIRE_OP_TOKEN`,
/// `GOVERNANCE_SIGNERS`, `GOVERNANCE_MIN_SIGNERS`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Config {
    /// Shared key file or per-signer key directory; `None`: admin token only.
    pub key_path: Option<PathBuf>,
    /// The admin token alone is not enough.
    pub require_op_token: bool,
    /// Signers whose signatures count; empty: anyone with a key (directory) or any
    /// listed name (shared key).
    pub signers: Vec<String>,
    /// Distinct valid signers a token needs.
    pub min_signers: usize,
    /// `OP_TOKENS_PER_RELAY`: accept op tokens with several relays and no shared store
    /// (each relay's own replay store; a token could be used once per relay).
    pub op_tokens_per_relay: bool,
}

impl Default for Config {
    fn default() -> Config {
        Config {
            key_path: None,
            require_op_token: false,
            signers: Vec::new(),
            min_signers: 1,
            op_tokens_per_relay: false,
        }
    }
}

impl Config {
    /// Validates the settings as given (no file access: see [`Governance::open`]).
    pub fn new(
        key_path: Option<&str>,
        require_op_token: bool,
        signers: Option<&str>,
        min_signers: usize,
    ) -> Result<Config, String> {
        if key_path.is_some() && !cfg!(feature = "governance") {
            return Err(format!("VERIFIED_OP_TOKEN_KEY_PATH: {NOT_BUILT}"));
        }
        if require_op_token && key_path.is_none() {
            return Err("REQUIRE_OP_TOKEN=true needs VERIFIED_OP_TOKEN_KEY_PATH".into());
        }
        let signers: Vec<String> = signers
            .unwrap_or("")
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(str::to_string)
            .collect();
        #[cfg(feature = "governance")]
        if let Some(bad) = signers.iter().find(|s| !token::valid_name(s)) {
            return Err(format!(
                "GOVERNANCE_SIGNERS: `{bad}` is not a valid signer name ([A-Za-z0-9._-], not starting with `.`)"
            ));
        }
        if min_signers == 0 {
            return Err("GOVERNANCE_MIN_SIGNERS must be at least 1".into());
        }
        if !signers.is_empty() && min_signers > signers.len() {
            return Err(format!(
                "GOVERNANCE_MIN_SIGNERS ({min_signers}) exceeds the {} GOVERNANCE_SIGNERS",
                signers.len()
            ));
        }
        Ok(Config {
            key_path: key_path.map(PathBuf::from),
            require_op_token,
            signers,
            min_signers,
            op_tokens_per_relay: false,
        })
    }
}

/// How a call was allowed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Authorized {
    AdminToken,
    /// A valid op token; the signers whose signatures counted.
    OpToken {
        signers: Vec<String>,
    },
}

/// The governance gate, shared by the lifecycle routes.
pub struct Governance {
    #[cfg_attr(not(feature = "governance"), allow(dead_code))]
    cfg: Config,
    /// Loaded when `VERIFIED_OP_TOKEN_KEY_PATH` is set, with the replay store.
    #[cfg(feature = "governance")]
    tokens: Option<(KeySet, Box<dyn crate::server::store::Nonces>)>,
    /// Whether op tokens are safe with the relays the workers report.
    #[cfg(feature = "governance")]
    guard: relays::RelayGuard,
}

impl Governance {
    /// Without the `governance` feature: the admin token only; a key path is refused.
    #[cfg(not(feature = "governance"))]
    pub fn open(cfg: &Config, _state_dir: &Path, _now_unix: u64) -> Result<Governance, String> {
        match cfg.key_path {
            Some(_) => Err(format!("VERIFIED_OP_TOKEN_KEY_PATH: {NOT_BUILT}")),
            None => Ok(Governance { cfg: cfg.clone() }),
        }
    }

    /// Loads the keys and opens the replay store in `state_dir` (only when a key path is
    /// configured). Errors are configuration problems, for start-up.
    #[cfg(feature = "governance")]
    pub fn open(cfg: &Config, state_dir: &Path, now_unix: u64) -> Result<Governance, String> {
        Governance::with_store(
            cfg,
            &crate::server::store::Store::local(state_dir),
            now_unix,
        )
    }

    /// Without the `governance` feature there are no nonces to keep: as `open`.
    #[cfg(not(feature = "governance"))]
    pub fn with_store(
        cfg: &Config,
        _store: &crate::server::store::Store,
        now_unix: u64,
    ) -> Result<Governance, String> {
        Governance::open(cfg, Path::new(""), now_unix)
    }

    /// As [`Governance::open`], with the replay store where `store` keeps nonces.
    #[cfg(feature = "governance")]
    pub fn with_store(
        cfg: &Config,
        store: &crate::server::store::Store,
        now_unix: u64,
    ) -> Result<Governance, String> {
        let Some(path) = &cfg.key_path else {
            return Ok(Governance {
                cfg: cfg.clone(),
                tokens: None,
                guard: guard(cfg, store),
            });
        };
        let keys = KeySet::load(path)?;
        check_keys(cfg, &keys)?;
        let nonces = store.nonces(now_unix)?;
        log::info!(
            "lifecycle governance: op tokens verified with {}; {} valid signer(s) needed; admin token {}",
            describe(&keys),
            cfg.min_signers,
            if cfg.require_op_token { "alone not enough" } else { "also accepted" }
        );
        if !store.is_shared() && cfg.op_tokens_per_relay {
            log::warn!(
                "lifecycle governance: OP_TOKENS_PER_RELAY is on: with several relays each keeps its own op-token replay store, so a token could be used once on every relay"
            );
        }
        Ok(Governance {
            cfg: cfg.clone(),
            tokens: Some((keys, nonces)),
            guard: guard(cfg, store),
        })
    }

    /// Watches the relay count the workers report (published in `shared`), for the
    /// several-relays check; without it this relay counts as alone.
    #[cfg(feature = "governance")]
    pub fn with_relays(mut self, shared: &std::sync::Arc<crate::server::shared::Shared>) -> Self {
        self.guard.relays = Some(shared.clone());
        self
    }

    /// Without the `governance` feature no op token is accepted: nothing to watch.
    #[cfg(not(feature = "governance"))]
    pub fn with_relays(self, _shared: &std::sync::Arc<crate::server::shared::Shared>) -> Self {
        self
    }

    /// Decides one lifecycle call and logs the decision (one line). `token` is the raw
    /// token text (header or body field), `model` the call's model (or flush target),
    /// `admin_token_ok` whether the caller presented the valid admin token.
    pub fn authorize(
        &self,
        token: Option<&str>,
        operation: Operation,
        model: &str,
        admin_token_ok: bool,
        now_unix: u64,
    ) -> Result<Authorized, Refusal> {
        let mut listed = Vec::new();
        let outcome = self.decide(
            token,
            operation,
            model,
            admin_token_ok,
            now_unix,
            &mut listed,
        );
        log_decision(operation, model, &listed, &outcome);
        outcome
    }

    #[cfg(not(feature = "governance"))]
    fn decide(
        &self,
        _token: Option<&str>,
        _operation: Operation,
        _model: &str,
        admin_token_ok: bool,
        _now: u64,
        _listed: &mut Vec<String>,
    ) -> Result<Authorized, Refusal> {
        if admin_token_ok {
            return Ok(Authorized::AdminToken);
        }
        Err(Refusal::AdminTokenRequired)
    }

    #[cfg(feature = "governance")]
    fn decide(
        &self,
        token: Option<&str>,
        operation: Operation,
        model: &str,
        admin_token_ok: bool,
        now: u64,
        listed: &mut Vec<String>,
    ) -> Result<Authorized, Refusal> {
        let Some((keys, nonces)) = &self.tokens else {
            if admin_token_ok {
                return Ok(Authorized::AdminToken);
            }
            return Err(Refusal::AdminTokenRequired);
        };
        if admin_token_ok && !self.cfg.require_op_token {
            return Ok(Authorized::AdminToken);
        }
        let Some(text) = token.filter(|t| !t.trim().is_empty()) else {
            return Err(Refusal::OpTokenMissing {
                admin_accepted: !self.cfg.require_op_token,
            });
        };
        let token = SignedToken::parse(text).map_err(Refusal::Malformed)?;
        listed.clone_from(&token.claims.signers);
        let verified = verified_signers(keys, &token)?;
        check_call(&token.claims, operation, model)?;
        check_time(token.claims.issued_at, now)?;
        let signers = self.check_signers(keys, &token.claims.signers, verified)?;
        if let Some(relays) = self.guard.refuses() {
            return Err(Refusal::OpTokensNeedSharedStore { relays });
        }
        match nonces.remember(&token.claims.nonce, token.claims.issued_at, now) {
            replay::Remembered::Fresh => Ok(Authorized::OpToken { signers }),
            replay::Remembered::Replayed => Err(Refusal::Replayed),
            replay::Remembered::Full => Err(Refusal::ReplayStoreFull),
            replay::Remembered::Unavailable(e) => Err(Refusal::ReplayStoreUnavailable(e)),
        }
    }

    /// Every listed signer must be known; the verified ones must reach the minimum.
    #[cfg(feature = "governance")]
    fn check_signers(
        &self,
        keys: &KeySet,
        listed: &[String],
        verified: Vec<String>,
    ) -> Result<Vec<String>, Refusal> {
        let known = |name: &String| match (self.cfg.signers.is_empty(), keys) {
            (false, _) => self.cfg.signers.contains(name),
            (true, KeySet::Shared(_)) => true,
            (true, KeySet::PerSigner(map)) => map.contains_key(name),
        };
        if let Some(unknown) = listed.iter().find(|n| !known(n)) {
            return Err(Refusal::UnknownSigner(unknown.clone()));
        }
        if verified.len() < self.cfg.min_signers {
            return Err(Refusal::NotEnoughSigners {
                valid: verified.len(),
                required: self.cfg.min_signers,
            });
        }
        Ok(verified)
    }
}

/// The several-relays guard for a governance over `store`.
#[cfg(feature = "governance")]
fn guard(cfg: &Config, store: &crate::server::store::Store) -> relays::RelayGuard {
    relays::RelayGuard {
        shared_store: store.is_shared(),
        per_relay_ok: cfg.op_tokens_per_relay,
        relays: None,
    }
}

#[cfg(feature = "governance")]
/// The signers vouched for by valid signatures: with a shared key every listed signer
/// once its one signature verifies; with per-signer keys exactly those whose own
/// signature verifies. `BadSignature` when none does.
fn verified_signers(keys: &KeySet, token: &SignedToken) -> Result<Vec<String>, Refusal> {
    let message = token.claims.canonical_bytes();
    let valid = |key: &Key, signature: &str| {
        token::decode_signature(signature).is_some_and(|sig| key.verify(&message, &sig))
    };
    let verified: Vec<String> = match (keys, &token.signatures) {
        (KeySet::Shared(key), Signatures::Shared(sig)) if valid(key, sig) => {
            token.claims.signers.clone()
        }
        (KeySet::Shared(_), Signatures::Shared(_)) => Vec::new(),
        (KeySet::PerSigner(map), Signatures::PerSigner(list)) => list
            .iter()
            .filter(|e| {
                map.get(&e.signer)
                    .is_some_and(|key| valid(key, &e.signature))
            })
            .map(|e| e.signer.clone())
            .collect(),
        (KeySet::Shared(_), Signatures::PerSigner(_)) => {
            return Err(Refusal::Malformed(
                "this relay has one shared key: send one `signature`, not `signatures`".into(),
            ))
        }
        (KeySet::PerSigner(_), Signatures::Shared(_)) => return Err(Refusal::Malformed(
            "this relay verifies each signer's own key: send `signatures: [{signer, signature}]`"
                .into(),
        )),
    };
    if verified.is_empty() {
        return Err(Refusal::BadSignature);
    }
    Ok(verified)
}

#[cfg(feature = "governance")]
fn check_call(claims: &OpToken, operation: Operation, model: &str) -> Result<(), Refusal> {
    if Operation::parse(&claims.operation) != Some(operation) {
        return Err(Refusal::OperationMismatch {
            token: claims.operation.clone(),
            call: operation,
        });
    }
    if claims.model_id != model {
        return Err(Refusal::ModelMismatch {
            token: claims.model_id.clone(),
            call: model.to_string(),
        });
    }
    Ok(())
}

#[cfg(feature = "governance")]
/// `issuedAt` within [`WINDOW_SECS`] of `now`, both ways (exactly the limit passes).
fn check_time(issued_at: u64, now: u64) -> Result<(), Refusal> {
    if issued_at > now.saturating_add(WINDOW_SECS) {
        return Err(Refusal::FromFuture {
            ahead_secs: issued_at - now,
        });
    }
    if now > issued_at.saturating_add(WINDOW_SECS) {
        return Err(Refusal::Expired {
            age_secs: now - issued_at,
        });
    }
    Ok(())
}

#[cfg(feature = "governance")]
/// Start-up checks of the keys against the signer settings.
fn check_keys(cfg: &Config, keys: &KeySet) -> Result<(), String> {
    match keys {
        KeySet::Shared(_) => {
            if cfg.min_signers > 1 {
                log::warn!(
                    "GOVERNANCE_MIN_SIGNERS={} with one shared key only counts the names a token lists, which anyone holding the key can write; a key directory (one key per signer) gives real M-of-N",
                    cfg.min_signers
                );
            }
            Ok(())
        }
        KeySet::PerSigner(map) => {
            if let Some(missing) = cfg.signers.iter().find(|s| !map.contains_key(*s)) {
                return Err(format!(
                    "GOVERNANCE_SIGNERS names `{missing}`, who has no key file in VERIFIED_OP_TOKEN_KEY_PATH"
                ));
            }
            // GOVERNANCE_SIGNERS, all with keys (checked above), or every key holder.
            let usable = if cfg.signers.is_empty() {
                map.len()
            } else {
                cfg.signers.len()
            };
            if usable < cfg.min_signers {
                return Err(format!(
                    "GOVERNANCE_MIN_SIGNERS ({}) exceeds the {usable} signer key(s) available",
                    cfg.min_signers
                ));
            }
            Ok(())
        }
    }
}

#[cfg(feature = "governance")]
fn describe(keys: &KeySet) -> String {
    match keys {
        KeySet::Shared(_) => "one shared key".into(),
        KeySet::PerSigner(map) => format!(
            "per-signer keys ({})",
            map.keys().cloned().collect::<Vec<_>>().join(", ")
        ),
    }
}

/// One line per decision. Signer names are checked (`[A-Za-z0-9._-]`), the model is
/// quoted with escapes; the token and signatures are never logged, nor the parser's
/// detail for a malformed token (which could echo parts of it).
fn log_decision(
    operation: Operation,
    model: &str,
    listed: &[String],
    outcome: &Result<Authorized, Refusal>,
) {
    let model: String = model.chars().take(200).collect();
    let op = operation.name();
    match outcome {
        Ok(Authorized::AdminToken) => log::info!(
            "lifecycle governance: operation={op} model={model:?} signers=- outcome=authorized by=admin_token"
        ),
        Ok(Authorized::OpToken { signers }) => log::info!(
            "lifecycle governance: operation={op} model={model:?} signers=[{}] outcome=authorized by=op_token",
            signers.join(",")
        ),
        Err(refusal) => {
            let reason = match refusal {
                Refusal::Malformed(_) => "malformed token".to_string(),
                Refusal::ReplayStoreUnavailable(e) => e.clone(),
                other => other.message(),
            };
            log::warn!(
                "lifecycle governance: operation={op} model={model:?} signers=[{}] outcome=refused code={} reason={reason:?}",
                listed.join(","),
                refusal.code()
            );
        }
    }
}
