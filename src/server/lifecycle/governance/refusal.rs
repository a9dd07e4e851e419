//! Why a lifecycle call was refused: one variant per failed check, each with a stable
//! code and the HTTP status to answer with.

use super::{Operation, BODY_FIELD, WINDOW_SECS};

/// Why a lifecycle call was refused. [`Refusal::code`] is stable (API error code and
/// log field); [`Refusal::status`] is the HTTP status to answer with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refusal {
    /// Op tokens are not configured and the admin token was missing or wrong.
    AdminTokenRequired,
    /// No op token. `admin_accepted`: the admin token would have done but was missing
    /// or wrong; otherwise `REQUIRE_OP_TOKEN` makes the admin token not enough.
    OpTokenMissing {
        admin_accepted: bool,
    },
    /// The token does not parse or a field has the wrong shape.
    Malformed(String),
    /// No signature verifies with the configured key(s).
    BadSignature,
    OperationMismatch {
        token: String,
        call: Operation,
    },
    ModelMismatch {
        token: String,
        call: String,
    },
    Expired {
        age_secs: u64,
    },
    FromFuture {
        ahead_secs: u64,
    },
    /// A listed signer is not in `GOVERNANCE_SIGNERS` (or has no key file).
    UnknownSigner(String),
    NotEnoughSigners {
        valid: usize,
        required: usize,
    },
    /// The nonce was used before.
    Replayed,
    /// The replay store is full of live nonces.
    ReplayStoreFull,
    /// The nonce could not be recorded durably (the I/O error, for the log only).
    ReplayStoreUnavailable(String),
    /// The workers report `relays` relays, no shared store is set (`STATE_URL`) and
    /// `OP_TOKENS_PER_RELAY` is off: a token used on another relay could not be known.
    OpTokensNeedSharedStore {
        relays: usize,
    },
}

impl Refusal {
    pub fn code(&self) -> &'static str {
        match self {
            Refusal::AdminTokenRequired => "admin_token_required",
            Refusal::OpTokenMissing { .. } => "op_token_missing",
            Refusal::Malformed(_) => "op_token_malformed",
            Refusal::BadSignature => "op_token_bad_signature",
            Refusal::OperationMismatch { .. } => "op_token_operation_mismatch",
            Refusal::ModelMismatch { .. } => "op_token_model_mismatch",
            Refusal::Expired { .. } => "op_token_expired",
            Refusal::FromFuture { .. } => "op_token_from_future",
            Refusal::UnknownSigner(_) => "op_token_unknown_signer",
            Refusal::NotEnoughSigners { .. } => "op_token_not_enough_signers",
            Refusal::Replayed => "op_token_replayed",
            Refusal::ReplayStoreFull => "op_token_replay_store_full",
            Refusal::ReplayStoreUnavailable(_) => "op_token_replay_store_unavailable",
            Refusal::OpTokensNeedSharedStore { .. } => "op_tokens_need_shared_store",
        }
    }

    /// 401: no credential, or one that is not (or no longer) valid. 403: a valid
    /// credential that policy does not allow for this call. 503: the replay store
    /// cannot take the nonce now; a new token later may work.
    pub fn status(&self) -> u16 {
        match self {
            Refusal::AdminTokenRequired
            | Refusal::OpTokenMissing { .. }
            | Refusal::Malformed(_)
            | Refusal::BadSignature
            | Refusal::Expired { .. }
            | Refusal::FromFuture { .. }
            | Refusal::Replayed => 401,
            Refusal::OperationMismatch { .. }
            | Refusal::ModelMismatch { .. }
            | Refusal::UnknownSigner(_)
            | Refusal::NotEnoughSigners { .. } => 403,
            Refusal::ReplayStoreFull
            | Refusal::ReplayStoreUnavailable(_)
            | Refusal::OpTokensNeedSharedStore { .. } => 503,
        }
    }

    /// Text for the client. Never contains the token, a signature or a file path.
    pub fn message(&self) -> String {
        let send = format!("`X-Op-Token` header or `{BODY_FIELD}` body field");
        match self {
            Refusal::AdminTokenRequired => {
                "this call needs the admin token (VERIFIED_OP_TOKEN_KEY_PATH is unset, so op tokens are not accepted)".into()
            }
            Refusal::OpTokenMissing {
                admin_accepted: true,
            } => format!("this call needs the admin token or a verifiedOpToken ({send})"),
            Refusal::OpTokenMissing {
                admin_accepted: false,
            } => format!(
                "this call needs a verifiedOpToken; with REQUIRE_OP_TOKEN the admin token alone is not enough ({send})"
            ),
            Refusal::Malformed(why) => format!("malformed verifiedOpToken: {why}"),
            Refusal::BadSignature => "op token signature does not verify".into(),
            Refusal::OperationMismatch { token, call } => {
                format!("op token is for operation {token:?}, not {:?}", call.name())
            }
            Refusal::ModelMismatch { token, call } => {
                format!("op token is for model {token:?}, not {call:?}")
            }
            Refusal::Expired { age_secs } => {
                format!("op token issued {age_secs} s ago (limit {WINDOW_SECS} s)")
            }
            Refusal::FromFuture { ahead_secs } => format!(
                "op token issued {ahead_secs} s in the future (limit {WINDOW_SECS} s; check the clocks)"
            ),
            Refusal::UnknownSigner(name) => format!("{name:?} is not a governance signer here"),
            Refusal::NotEnoughSigners { valid, required } => {
                format!("op token has {valid} valid signer(s), {required} needed")
            }
            Refusal::Replayed => "op token nonce already used".into(),
            Refusal::ReplayStoreFull => "too many recent op tokens; retry in a few minutes".into(),
            Refusal::ReplayStoreUnavailable(_) => {
                "op token replay store unavailable (see the server log)".into()
            }
            Refusal::OpTokensNeedSharedStore { relays } => format!(
                "op tokens are refused: the workers report {relays} relays and this relay's replay store is its own, so it cannot know a token was not already used on another relay; set STATE_URL (a shared store) on every relay, or OP_TOKENS_PER_RELAY=on to accept a token once per relay"
            ),
        }
    }
}

impl std::fmt::Display for Refusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.code(), self.message())
    }
}
