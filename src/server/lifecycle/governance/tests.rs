//! Unit tests of `governance`: the decision table, every refusal, replay (also across a
//! restart), clock skew, shared and per-signer keys, malformed tokens, the minting CLI.

use super::*;
use std::fs;
use std::sync::atomic::{AtomicU64, Ordering};

const NOW: u64 = 1_750_000_000;
const MODEL: &str = "meta-llama/Llama-3.1-8B-Instruct";

/// A scratch directory, removed when dropped.
struct Scratch(PathBuf);

impl std::ops::Deref for Scratch {
    type Target = Path;
    fn deref(&self) -> &Path {
        &self.0
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

fn temp_dir(tag: &str) -> Scratch {
    static SEQ: AtomicU64 = AtomicU64::new(0);
    let n = SEQ.fetch_add(1, Ordering::Relaxed);
    let dir = std::env::temp_dir().join(format!("mr-gov-{tag}-{}-{n}", std::process::id()));
    let _ = fs::remove_dir_all(&dir);
    fs::create_dir_all(&dir).unwrap();
    Scratch(dir)
}

fn key_text(name: &str) -> String {
    format!("{name}-{}\n", "k".repeat(40))
}

/// A shared key file in a fresh directory; returns (dir, key file).
fn shared_key(tag: &str) -> (Scratch, PathBuf) {
    let dir = temp_dir(tag);
    let file = dir.join("model-api.key");
    fs::write(&file, key_text("shared")).unwrap();
    (dir, file)
}

/// A key directory with one key per signer; returns (dir, key directory).
fn signer_keys(tag: &str, signers: &[&str]) -> (Scratch, PathBuf) {
    let dir = temp_dir(tag);
    let keys = dir.join("keys");
    fs::create_dir_all(&keys).unwrap();
    for s in signers {
        fs::write(keys.join(s), key_text(s)).unwrap();
    }
    (dir, keys)
}

fn config(key_path: &Path, require: bool, signers: &str, min: usize) -> Config {
    Config::new(
        Some(key_path.to_str().unwrap()),
        require,
        Some(signers),
        min,
    )
    .unwrap()
}

fn open(cfg: &Config, dir: &Path) -> Governance {
    Governance::open(cfg, &dir.join("state"), NOW).unwrap()
}

fn claims(op: &str, model: &str, at: u64, signers: &[&str], nonce: &str) -> OpToken {
    OpToken {
        operation: op.into(),
        model_id: model.into(),
        issued_at: at,
        signers: signers.iter().map(|s| s.to_string()).collect(),
        nonce: nonce.into(),
    }
}

/// A token for `model-load` of MODEL issued at NOW, signed with `key_path`.
fn token(key_path: &Path, signers: &[&str], nonce: &str) -> String {
    let keys = KeySet::load(key_path).unwrap();
    mint::sign(&keys, &claims("model-load", MODEL, NOW, signers, nonce)).unwrap()
}

fn load(gov: &Governance, token: &str) -> Result<Authorized, Refusal> {
    gov.authorize(Some(token), Operation::Load, MODEL, false, NOW)
}

fn names(list: &[&str]) -> Vec<String> {
    list.iter().map(|s| s.to_string()).collect()
}

#[test]
fn without_a_key_path_only_the_admin_token_works() {
    let gov = Governance::open(&Config::default(), Path::new("/nonexistent"), NOW).unwrap();
    assert_eq!(
        gov.authorize(None, Operation::Load, MODEL, true, NOW),
        Ok(Authorized::AdminToken)
    );
    let refused = gov.authorize(None, Operation::Unload, MODEL, false, NOW);
    assert_eq!(refused, Err(Refusal::AdminTokenRequired));
    let (_scratch, file) = shared_key("noconf");
    let tok = token(&file, &["alice"], "nonce-noconf");
    let refused = gov
        .authorize(Some(&tok), Operation::Load, MODEL, false, NOW)
        .unwrap_err();
    assert_eq!(
        (refused.code(), refused.status()),
        ("admin_token_required", 401)
    );
}

#[test]
fn with_a_key_path_the_admin_token_or_an_op_token_works() {
    let (dir, file) = shared_key("either");
    let gov = open(&config(&file, false, "", 1), &dir);
    let tok = token(&file, &["alice"], "nonce-either");
    // The admin token suffices and leaves the op token unused...
    assert_eq!(
        gov.authorize(Some(&tok), Operation::Load, MODEL, true, NOW),
        Ok(Authorized::AdminToken)
    );
    // ...so it still works once on its own.
    assert_eq!(
        load(&gov, &tok),
        Ok(Authorized::OpToken {
            signers: names(&["alice"])
        })
    );
    let missing = gov
        .authorize(None, Operation::Load, MODEL, false, NOW)
        .unwrap_err();
    assert_eq!(
        missing,
        Refusal::OpTokenMissing {
            admin_accepted: true
        }
    );
    assert_eq!(
        (missing.code(), missing.status()),
        ("op_token_missing", 401)
    );
    let blank = gov.authorize(Some("  "), Operation::Load, MODEL, false, NOW);
    assert_eq!(blank, Err(missing));
}

#[test]
fn require_op_token_refuses_the_admin_token_alone() {
    let (dir, file) = shared_key("require");
    let gov = open(&config(&file, true, "", 1), &dir);
    let refused = gov
        .authorize(None, Operation::Load, MODEL, true, NOW)
        .unwrap_err();
    assert_eq!(
        refused,
        Refusal::OpTokenMissing {
            admin_accepted: false
        }
    );
    assert!(refused.message().contains("REQUIRE_OP_TOKEN"));
    let tok = token(&file, &["alice"], "nonce-require");
    assert!(matches!(
        gov.authorize(Some(&tok), Operation::Load, MODEL, true, NOW),
        Ok(Authorized::OpToken { .. })
    ));
}

#[test]
fn a_bad_signature_is_refused() {
    let (dir, file) = shared_key("badsig");
    let gov = open(&config(&file, false, "", 1), &dir);
    // Signed with another key.
    let (_scratch, other) = shared_key("badsig-other");
    fs::write(&other, key_text("other")).unwrap();
    let refused = load(&gov, &token(&other, &["alice"], "nonce-badsig-1")).unwrap_err();
    assert_eq!(
        (refused.code(), refused.status()),
        ("op_token_bad_signature", 401)
    );
    // A signed claim changed afterwards: the signature no longer covers it.
    let tok = token(&file, &["alice"], "nonce-badsig-2").replace("\"alice\"", "\"bob\"");
    assert_eq!(load(&gov, &tok), Err(Refusal::BadSignature));
    // A signature that does not even decode.
    let mut value: serde_json::Value =
        serde_json::from_str(&token(&file, &["a"], "nonce-x1")).unwrap();
    value["signature"] = "zz".repeat(32).into();
    assert_eq!(load(&gov, &value.to_string()), Err(Refusal::BadSignature));
    // A refused token did not use up its nonce: signed properly it is accepted.
    assert!(load(&gov, &token(&file, &["alice"], "nonce-badsig-2")).is_ok());
}

#[test]
fn operation_and_model_must_match_the_call() {
    let (dir, file) = shared_key("mismatch");
    let gov = open(&config(&file, false, "", 1), &dir);
    let tok = token(&file, &["alice"], "nonce-mismatch");
    let refused = gov
        .authorize(Some(&tok), Operation::Unload, MODEL, false, NOW)
        .unwrap_err();
    assert_eq!(
        (refused.code(), refused.status()),
        ("op_token_operation_mismatch", 403)
    );
    let refused = gov
        .authorize(Some(&tok), Operation::Load, "other-model", false, NOW)
        .unwrap_err();
    assert_eq!(
        (refused.code(), refused.status()),
        ("op_token_model_mismatch", 403)
    );
    // Short operation names are accepted in tokens.
    let keys = KeySet::load(&file).unwrap();
    let short = mint::sign(&keys, &claims("unload", MODEL, NOW, &["a"], "nonce-short")).unwrap();
    assert!(gov
        .authorize(Some(&short), Operation::Unload, MODEL, false, NOW)
        .is_ok());
}

#[test]
fn issued_at_must_be_within_five_minutes_either_way() {
    let (dir, file) = shared_key("skew");
    let gov = open(&config(&file, false, "", 1), &dir);
    let keys = KeySet::load(&file).unwrap();
    let at = |issued: u64, nonce: &str| {
        mint::sign(&keys, &claims("model-load", MODEL, issued, &["a"], nonce)).unwrap()
    };
    assert!(load(&gov, &at(NOW - WINDOW_SECS, "nonce-edge-past")).is_ok());
    assert!(load(&gov, &at(NOW + WINDOW_SECS, "nonce-edge-future")).is_ok());
    let old = load(&gov, &at(NOW - WINDOW_SECS - 1, "nonce-old")).unwrap_err();
    assert_eq!(old, Refusal::Expired { age_secs: 301 });
    assert_eq!((old.code(), old.status()), ("op_token_expired", 401));
    let ahead = load(&gov, &at(NOW + WINDOW_SECS + 1, "nonce-ahead")).unwrap_err();
    assert_eq!(ahead, Refusal::FromFuture { ahead_secs: 301 });
    assert_eq!(
        (ahead.code(), ahead.status()),
        ("op_token_from_future", 401)
    );
    assert_eq!(
        load(&gov, &at(0, "nonce-zero")),
        Err(Refusal::Expired { age_secs: NOW })
    );
    assert!(matches!(
        load(&gov, &at(u64::MAX, "nonce-max")),
        Err(Refusal::FromFuture { .. })
    ));
}

#[test]
fn a_nonce_is_accepted_once_also_across_a_restart() {
    let (dir, file) = shared_key("replay");
    let cfg = config(&file, false, "", 1);
    let tok = token(&file, &["alice"], "nonce-replay");
    {
        let gov = open(&cfg, &dir);
        assert!(load(&gov, &tok).is_ok());
        let again = load(&gov, &tok).unwrap_err();
        assert_eq!((again.code(), again.status()), ("op_token_replayed", 401));
        // A new token with the same nonce (other claims) is a replay too.
        let keys = KeySet::load(&file).unwrap();
        let same_nonce = mint::sign(
            &keys,
            &claims("cache-flush", "*", NOW, &["a"], "nonce-replay"),
        )
        .unwrap();
        assert_eq!(
            gov.authorize(Some(&same_nonce), Operation::Flush, "*", false, NOW),
            Err(Refusal::Replayed)
        );
    }
    let reopened = open(&cfg, &dir);
    assert_eq!(load(&reopened, &tok), Err(Refusal::Replayed));
    assert!(load(&reopened, &token(&file, &["alice"], "nonce-fresh")).is_ok());
}

#[test]
fn a_torn_last_line_is_skipped_and_the_file_rewritten() {
    let dir = temp_dir("torn");
    let store = NonceStore::open(&dir, NOW).unwrap();
    assert_eq!(
        store.remember("nonce-one", NOW, NOW),
        replay::Remembered::Fresh
    );
    drop(store);
    let path = dir.join(replay::FILE_NAME);
    let mut text = fs::read_to_string(&path).unwrap();
    text.push_str("not a line\n1750000000 nonce-t"); // garbage, then a torn write
    fs::write(&path, text).unwrap();
    let store = NonceStore::open(&dir, NOW).unwrap();
    assert_eq!(store.len(), 1);
    assert_eq!(
        store.remember("nonce-one", NOW, NOW),
        replay::Remembered::Replayed
    );
    // The torn nonce was never accepted, so it is fresh.
    assert_eq!(
        store.remember("nonce-t", NOW, NOW),
        replay::Remembered::Fresh
    );
    let text = fs::read_to_string(&path).unwrap();
    assert!(
        text.ends_with('\n') && !text.contains("not a line"),
        "{text:?}"
    );
    assert_eq!(text.lines().count(), 2);
}

#[test]
fn nonces_past_the_window_are_forgotten_on_open() {
    let dir = temp_dir("evict");
    let store = NonceStore::open(&dir, NOW).unwrap();
    assert_eq!(
        store.remember("nonce-old", NOW, NOW),
        replay::Remembered::Fresh
    );
    assert_eq!(
        store.remember("nonce-ahead", NOW + 300, NOW),
        replay::Remembered::Fresh
    );
    drop(store);
    let horizon = WINDOW_SECS + replay::FORGET_MARGIN_SECS;
    assert_eq!(NonceStore::open(&dir, NOW + horizon).unwrap().len(), 2);
    let later = NonceStore::open(&dir, NOW + horizon + 1).unwrap();
    assert_eq!(later.len(), 1, "only the token dated ahead is still live");
    assert!(!later.is_empty());
}

#[test]
fn a_full_store_refuses_until_nonces_expire() {
    let dir = temp_dir("full");
    let store = NonceStore::with_capacity(&dir, NOW, 2).unwrap();
    assert_eq!(
        store.remember("nonce-a1", NOW, NOW),
        replay::Remembered::Fresh
    );
    assert_eq!(
        store.remember("nonce-a2", NOW, NOW),
        replay::Remembered::Fresh
    );
    assert_eq!(
        store.remember("nonce-a3", NOW, NOW),
        replay::Remembered::Full
    );
    let later = NOW + WINDOW_SECS + replay::FORGET_MARGIN_SECS + 1;
    assert_eq!(
        store.remember("nonce-a3", later, later),
        replay::Remembered::Fresh
    );
    assert_eq!(store.len(), 1);
    let full = Refusal::ReplayStoreFull;
    assert_eq!(
        (full.code(), full.status()),
        ("op_token_replay_store_full", 503)
    );
}

#[test]
fn two_of_three_per_signer_keys_count_only_real_signatures() {
    let (dir, keys_dir) = signer_keys("m-of-n", &["alice", "bob", "carol"]);
    let gov = open(&config(&keys_dir, false, "alice,bob,carol", 2), &dir);
    let keys = KeySet::load(&keys_dir).unwrap();
    let c = claims("model-load", MODEL, NOW, &["alice", "bob"], "nonce-forged");
    let mut value: serde_json::Value =
        serde_json::from_str(&mint::sign(&keys, &c).unwrap()).unwrap();
    // Bob's signature forged: made with alice's key.
    let alice_sig = value["signatures"][0]["signature"].clone();
    value["signatures"][1]["signature"] = alice_sig;
    let refused = load(&gov, &value.to_string()).unwrap_err();
    assert_eq!(
        refused,
        Refusal::NotEnoughSigners {
            valid: 1,
            required: 2
        }
    );
    assert_eq!(
        (refused.code(), refused.status()),
        ("op_token_not_enough_signers", 403)
    );
    // Only one signer at all.
    let one = mint::sign(
        &keys,
        &claims("model-load", MODEL, NOW, &["carol"], "nonce-one1"),
    )
    .unwrap();
    assert_eq!(
        load(&gov, &one),
        Err(Refusal::NotEnoughSigners {
            valid: 1,
            required: 2
        })
    );
    // Two genuine signatures.
    let two = mint::sign(
        &keys,
        &claims("model-load", MODEL, NOW, &["alice", "carol"], "nonce-two2"),
    )
    .unwrap();
    assert_eq!(
        load(&gov, &two),
        Ok(Authorized::OpToken {
            signers: names(&["alice", "carol"])
        })
    );
    // Every signature forged.
    value["signatures"][0]["signature"] = "00".repeat(32).into();
    value["signatures"][1]["signature"] = "00".repeat(32).into();
    assert_eq!(load(&gov, &value.to_string()), Err(Refusal::BadSignature));
}

#[test]
fn listing_a_signature_without_signing_does_not_count() {
    let (dir, keys_dir) = signer_keys("listed", &["alice", "bob", "carol"]);
    let gov = open(&config(&keys_dir, false, "", 2), &dir);
    let keys = KeySet::load(&keys_dir).unwrap();
    let c = claims(
        "model-load",
        MODEL,
        NOW,
        &["alice", "bob", "carol"],
        "nonce-listed",
    );
    let mut value: serde_json::Value =
        serde_json::from_str(&mint::sign(&keys, &c).unwrap()).unwrap();
    value["signatures"].as_array_mut().unwrap().truncate(1);
    assert_eq!(
        load(&gov, &value.to_string()),
        Err(Refusal::NotEnoughSigners {
            valid: 1,
            required: 2
        })
    );
}

#[test]
fn unknown_signers_are_refused() {
    // Per-signer keys: `dave` has a key file but is not a governance signer.
    let (dir, keys_dir) = signer_keys("unknown", &["alice", "bob", "dave"]);
    let gov = open(&config(&keys_dir, false, "alice,bob", 1), &dir);
    let tok = token(&keys_dir, &["alice", "dave"], "nonce-unknown");
    let refused = load(&gov, &tok).unwrap_err();
    assert_eq!(refused, Refusal::UnknownSigner("dave".into()));
    assert_eq!(
        (refused.code(), refused.status()),
        ("op_token_unknown_signer", 403)
    );
    // Shared key: the listed names must be governance signers too.
    let (dir, file) = shared_key("unknown-shared");
    let gov = open(&config(&file, false, "alice,bob", 1), &dir);
    let tok = token(&file, &["alice", "mallory"], "nonce-mallory");
    assert_eq!(
        load(&gov, &tok),
        Err(Refusal::UnknownSigner("mallory".into()))
    );
}

#[test]
fn a_signer_without_a_key_file_is_unknown() {
    let (dir, keys_dir) = signer_keys("nokey", &["alice", "bob"]);
    let gov = open(&config(&keys_dir, false, "", 1), &dir);
    let keys = KeySet::load(&keys_dir).unwrap();
    let c = claims("model-load", MODEL, NOW, &["alice", "zed"], "nonce-nokey");
    let mut value: serde_json::Value = serde_json::from_str(
        &mint::sign(
            &keys,
            &claims("model-load", MODEL, NOW, &["alice"], "nonce-nokey"),
        )
        .unwrap(),
    )
    .unwrap();
    value["opToken"] = serde_json::to_value(&c).unwrap();
    // Re-sign alice's entry over the claims that list zed.
    let sig = encoding::hex(&keys.key_of("alice").unwrap().sign(&c.canonical_bytes()));
    value["signatures"][0]["signature"] = sig.into();
    assert_eq!(
        load(&gov, &value.to_string()),
        Err(Refusal::UnknownSigner("zed".into()))
    );
    assert!(mint::sign(&keys, &c).unwrap_err().contains("zed"));
}

#[test]
fn the_shared_key_form_counts_listed_signers() {
    let (dir, file) = shared_key("shared-m");
    let gov = open(&config(&file, false, "alice,bob,carol", 2), &dir);
    assert_eq!(
        load(&gov, &token(&file, &["alice", "bob"], "nonce-shared2")),
        Ok(Authorized::OpToken {
            signers: names(&["alice", "bob"])
        })
    );
    assert_eq!(
        load(&gov, &token(&file, &["carol"], "nonce-shared1")),
        Err(Refusal::NotEnoughSigners {
            valid: 1,
            required: 2
        })
    );
}

#[test]
fn the_signature_form_must_fit_the_key_path() {
    let (dir, file) = shared_key("form");
    let (_scratch, keys_dir) = signer_keys("form-dir", &["alice"]);
    let shared_gov = open(&config(&file, false, "", 1), &dir);
    let per_signer_token = token(&keys_dir, &["alice"], "nonce-form-1");
    let refused = load(&shared_gov, &per_signer_token).unwrap_err();
    assert_eq!(refused.code(), "op_token_malformed");
    assert!(refused.message().contains("one `signature`"));
    let state = temp_dir("form-state");
    let dir_gov = open(&config(&keys_dir, false, "", 1), &state);
    let refused = load(&dir_gov, &token(&file, &["alice"], "nonce-form-2")).unwrap_err();
    assert!(refused.message().contains("signatures"), "{refused}");
}

#[test]
fn every_transport_form_is_accepted() {
    let (dir, file) = shared_key("transport");
    let gov = open(&config(&file, false, "", 1), &dir);
    let json = token(&file, &["alice"], "nonce-json");
    assert!(load(&gov, &format!("  {json}\n")).is_ok());
    let b64url = encoding::base64url(token(&file, &["alice"], "nonce-b64url").as_bytes());
    assert!(b64url.starts_with("eyJ"));
    assert!(load(&gov, &b64url).is_ok());
    // Standard alphabet with padding, as other tools write it.
    let std = std_base64(token(&file, &["alice"], "nonce-b64std").as_bytes());
    assert!(load(&gov, &std).is_ok());
    // The body field: a string, or the token object itself.
    let body = serde_json::json!({"modelId": MODEL, "verifiedOpToken": token(&file, &["a"], "nonce-body-s")});
    assert!(load(&gov, &token_from_body(&body).unwrap()).is_ok());
    let object: serde_json::Value =
        serde_json::from_str(&token(&file, &["a"], "nonce-body-o")).unwrap();
    let body = serde_json::json!({"modelId": MODEL, "verifiedOpToken": object});
    assert!(load(&gov, &token_from_body(&body).unwrap()).is_ok());
    assert!(token_from_body(&serde_json::json!({"verifiedOpToken": 1})).is_none());
    assert!(token_from_body(&serde_json::json!({})).is_none());
    // A base64 signature instead of hex.
    let mut value: serde_json::Value =
        serde_json::from_str(&token(&file, &["a"], "nonce-sig64")).unwrap();
    let raw = encoding::from_hex(value["signature"].as_str().unwrap()).unwrap();
    value["signature"] = std_base64(&raw).into();
    assert!(load(&gov, &value.to_string()).is_ok());
}

fn std_base64(bytes: &[u8]) -> String {
    let mut text = encoding::base64url(bytes)
        .replace('-', "+")
        .replace('_', "/");
    while text.len() % 4 != 0 {
        text.push('=');
    }
    text
}

#[test]
fn malformed_tokens_of_every_kind_are_refused_without_panicking() {
    let (dir, file) = shared_key("malformed");
    let gov = open(&config(&file, false, "", 1), &dir);
    let good: serde_json::Value =
        serde_json::from_str(&token(&file, &["alice"], "nonce-good")).unwrap();
    let with = |path: &[&str], v: serde_json::Value| {
        let mut t = good.clone();
        let mut at = &mut t;
        for p in &path[..path.len() - 1] {
            at = &mut at[*p];
        }
        match v {
            serde_json::Value::Null => {
                at.as_object_mut().unwrap().remove(path[path.len() - 1]);
            }
            v => at[path[path.len() - 1]] = v,
        }
        t.to_string()
    };
    use serde_json::json;
    let cases: Vec<String> = vec![
        "{".into(),
        "{}".into(),
        "null".into(),
        "[]".into(),
        "\"text\"".into(),
        "!!!!".into(),
        "e".into(),
        encoding::base64url(&[0xff, 0xfe, 0xfd]),
        encoding::base64url(b"not json"),
        format!("{}{}", "[".repeat(10_000), "]".repeat(10_000)),
        format!("{{\"opToken\": {}}}", "{\"a\":".repeat(5000)),
        "x".repeat(token::MAX_TOKEN_BYTES + 1),
        r#"{"opToken":{},"signature":"00"}"#.into(),
        with(&["opToken", "nonce"], serde_json::Value::Null),
        with(&["opToken", "operation"], serde_json::Value::Null),
        with(&["opToken", "issuedAt"], json!(-5)),
        with(&["opToken", "issuedAt"], json!(1.5e9)),
        with(&["opToken", "issuedAt"], json!("1750000000")),
        with(&["opToken", "issuedAt"], json!(1e30)),
        with(&["opToken", "signers"], json!([])),
        with(&["opToken", "signers"], json!("alice")),
        with(&["opToken", "signers"], json!(["alice", "alice"])),
        with(&["opToken", "signers"], json!(["../etc/passwd"])),
        with(&["opToken", "signers"], json!([".hidden"])),
        with(&["opToken", "signers"], json!(["a b"])),
        with(
            &["opToken", "signers"],
            json!((0..40).map(|i| format!("s{i}")).collect::<Vec<_>>()),
        ),
        with(&["opToken", "nonce"], json!("short")),
        with(&["opToken", "nonce"], json!("has space 123")),
        with(&["opToken", "nonce"], json!("n".repeat(129))),
        with(&["opToken", "modelId"], json!("")),
        with(&["opToken", "modelId"], json!("a\nissuedAt=1")),
        with(&["opToken", "operation"], json!("m".repeat(65))),
        with(&["opToken", "scope"], json!("all")),
        with(&["signature"], serde_json::Value::Null),
        with(
            &["signatures"],
            json!([{"signer": "alice", "signature": "00"}]),
        ),
        with(&["signature"], json!(5)),
        with(&["opToken"], json!("eyJ")),
    ];
    for case in &cases {
        let refused = load(&gov, case).unwrap_err();
        assert_eq!(
            refused.code(),
            "op_token_malformed",
            "{case:.200}: {refused}"
        );
        assert_eq!(refused.status(), 401);
    }
    // Per-signer list shapes.
    let (dir, keys_dir) = signer_keys("malformed-dir", &["alice", "bob"]);
    let gov = open(&config(&keys_dir, false, "", 1), &dir);
    let good: serde_json::Value =
        serde_json::from_str(&token(&keys_dir, &["alice"], "nonce-good")).unwrap();
    let entry = good["signatures"][0].clone();
    for signatures in [
        json!([]),
        json!([entry.clone(), entry.clone()]),
        json!([{"signer": "bob", "signature": entry["signature"]}]),
        json!([{"signer": "alice"}]),
        json!([{"signer": "alice", "signature": entry["signature"], "extra": 1}]),
        json!({"alice": "00"}),
    ] {
        let mut t = good.clone();
        t["signatures"] = signatures.clone();
        let refused = load(&gov, &t.to_string()).unwrap_err();
        assert_eq!(
            refused.code(),
            "op_token_malformed",
            "{signatures}: {refused}"
        );
    }
    // A signature that does not decode is simply not valid.
    let mut t = good.clone();
    t["signatures"][0]["signature"] = json!("not hex");
    assert_eq!(load(&gov, &t.to_string()), Err(Refusal::BadSignature));
}

#[test]
fn the_signed_bytes_are_the_documented_text() {
    let c = claims(
        "model-load",
        "org/model",
        1_745_880_000,
        &["admin1", "admin2"],
        "abc123xyz",
    );
    assert_eq!(
        String::from_utf8(c.canonical_bytes()).unwrap(),
        "modelrelay-op-token-v1\noperation=model-load\nmodelId=org/model\nissuedAt=1745880000\nsigners=admin1,admin2\nnonce=abc123xyz\n"
    );
    // Known answer, computed independently with
    // `printf '<the text above>' | openssl dgst -sha256 -hmac "shared-kkk…k"`.
    let key = Key::new(key_text("shared").trim_end().as_bytes()).unwrap();
    let expected = "a777a3cbe61a05688536345410f364cc6cd91a60965aa992ef828328aef8c86c";
    assert_eq!(encoding::hex(&key.sign(&c.canonical_bytes())), expected);
    let sig = encoding::from_hex(expected).unwrap();
    assert!(key.verify(&c.canonical_bytes(), &sig));
    assert!(!key.verify(b"other", &sig));
    assert!(!key.verify(&c.canonical_bytes(), &sig[..31]));
}

#[test]
fn hex_and_base64_round_trip() {
    assert_eq!(encoding::base64url(b"foobar"), "Zm9vYmFy");
    assert_eq!(encoding::base64url(b"fo"), "Zm8");
    assert_eq!(encoding::base64url(b"f"), "Zg");
    assert_eq!(encoding::from_base64("Zm9vYg==").unwrap(), b"foob");
    assert_eq!(encoding::from_base64("Zm9vYg").unwrap(), b"foob");
    assert!(encoding::from_base64("Z").is_none());
    assert!(encoding::from_base64("Zm9v===").is_none());
    assert!(encoding::from_base64("Zm9v!").is_none());
    let bytes: Vec<u8> = (0..=255).collect();
    assert_eq!(
        encoding::from_base64(&encoding::base64url(&bytes)).unwrap(),
        bytes
    );
    assert_eq!(encoding::from_hex(&encoding::hex(&bytes)).unwrap(), bytes);
    assert_eq!(encoding::from_hex("ABcd").unwrap(), [0xab, 0xcd]);
    assert!(encoding::from_hex("abc").is_none());
    assert!(encoding::from_hex("zz").is_none());
}

#[test]
fn settings_are_checked() {
    assert_eq!(
        Config::new(None, false, None, 1).unwrap(),
        Config::default()
    );
    let err = |r: Result<Config, String>| r.unwrap_err();
    assert!(err(Config::new(None, true, None, 1)).contains("VERIFIED_OP_TOKEN_KEY_PATH"));
    assert!(err(Config::new(Some("/k"), false, None, 0)).contains("at least 1"));
    assert!(err(Config::new(Some("/k"), false, Some("a,b"), 3)).contains("exceeds"));
    assert!(err(Config::new(Some("/k"), false, Some("a,../b"), 1)).contains("../b"));
    let cfg = Config::new(Some("/k"), true, Some(" a, b ,,c "), 2).unwrap();
    assert_eq!(cfg.signers, names(&["a", "b", "c"]));
}

#[test]
fn bad_keys_stop_the_start() {
    let dir = temp_dir("badkeys");
    let short = dir.join("short.key");
    fs::write(&short, "too short\n").unwrap();
    let cfg = config(&short, false, "", 1);
    assert!(Governance::open(&cfg, &dir, NOW)
        .err()
        .unwrap()
        .contains("too short"));
    let missing = config(&dir.join("absent"), false, "", 1);
    assert!(Governance::open(&missing, &dir, NOW).is_err());
    let empty = dir.join("empty");
    fs::create_dir_all(empty.join(".hidden-dir")).unwrap();
    fs::write(empty.join(".hidden"), key_text("h")).unwrap();
    assert!(Governance::open(&config(&empty, false, "", 1), &dir, NOW)
        .err()
        .unwrap()
        .contains("no signer key files"));
    let (_scratch, keys_dir) = signer_keys("badkeys-dir", &["alice", "bob"]);
    let no_file = config(&keys_dir, false, "alice,carol", 1);
    assert!(Governance::open(&no_file, &dir, NOW)
        .err()
        .unwrap()
        .contains("carol"));
    let too_many = config(&keys_dir, false, "", 3);
    assert!(Governance::open(&too_many, &dir, NOW)
        .err()
        .unwrap()
        .contains("exceeds"));
    // A shared key with trailing whitespace is the same key without it.
    let (_scratch, file) = shared_key("badkeys-ws");
    let tok = token(&file, &["a"], "nonce-ws-1");
    fs::write(&file, format!("{} \r\n\n", key_text("shared").trim_end())).unwrap();
    let gov = open(&config(&file, false, "", 1), &dir);
    assert!(load(&gov, &tok).is_ok());
}

#[test]
fn the_mint_command_line() {
    let args = |list: &[&str]| list.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    let parsed = mint::parse_args(
        &args(&[
            "--operation",
            "flush",
            "--model=tenant:x",
            "--signer",
            "a,b",
            "--signer=c",
            "--issued-at",
            "5",
            "--nonce",
            "n-12345678",
            "--base64url",
        ]),
        Some("/keys".into()),
    )
    .unwrap();
    assert_eq!(
        parsed,
        mint::MintCommand::Mint(mint::MintRequest {
            operation: Operation::Flush,
            model: "tenant:x".into(),
            key_path: "/keys".into(),
            signers: names(&["a", "b", "c"]),
            issued_at: Some(5),
            nonce: Some("n-12345678".into()),
            base64url: true,
        })
    );
    assert_eq!(
        mint::parse_args(&args(&["-h"]), None),
        Ok(mint::MintCommand::Help)
    );
    let fails = |list: &[&str], needle: &str| {
        let e = mint::parse_args(&args(list), None).unwrap_err();
        assert!(e.contains(needle), "{list:?}: {e}");
    };
    fails(
        &["--model", "m", "--key-path", "k", "--signer", "a"],
        "--operation",
    );
    fails(&["--operation", "delete"], "delete");
    fails(
        &["--operation", "load", "--key-path", "k", "--signer", "a"],
        "--model",
    );
    fails(
        &["--operation", "load", "--model", "m", "--signer", "a"],
        "--key-path",
    );
    fails(
        &["--operation", "load", "--model", "m", "--key-path", "k"],
        "--signer",
    );
    fails(&["--operation"], "needs a value");
    fails(&["--issued-at", "soon"], "soon");
    fails(&["--bogus"], "--bogus");
    // End to end in-process: minted now, accepted now.
    let (dir, file) = shared_key("mint");
    let out = mint::run(
        &args(&[
            "--operation",
            "load",
            "--model",
            MODEL,
            "--signer",
            "alice",
            "--key-path",
            file.to_str().unwrap(),
        ]),
        None,
        NOW,
    )
    .unwrap();
    let gov = open(&config(&file, false, "", 1), &dir);
    assert!(load(&gov, out.trim()).is_ok());
    let bad_nonce = mint::run(
        &args(&[
            "--operation",
            "load",
            "--model",
            "m",
            "--signer",
            "a",
            "--nonce",
            "x",
        ]),
        Some(file.to_str().unwrap().into()),
        NOW,
    );
    assert!(bad_nonce.unwrap_err().contains("nonce"));
}

#[test]
fn refusal_codes_are_distinct_and_never_echo_secrets() {
    let all = [
        Refusal::AdminTokenRequired,
        Refusal::OpTokenMissing {
            admin_accepted: true,
        },
        Refusal::Malformed("x".into()),
        Refusal::BadSignature,
        Refusal::OperationMismatch {
            token: "a".into(),
            call: Operation::Load,
        },
        Refusal::ModelMismatch {
            token: "a".into(),
            call: "b".into(),
        },
        Refusal::Expired { age_secs: 1 },
        Refusal::FromFuture { ahead_secs: 1 },
        Refusal::UnknownSigner("x".into()),
        Refusal::NotEnoughSigners {
            valid: 0,
            required: 1,
        },
        Refusal::Replayed,
        Refusal::ReplayStoreFull,
        Refusal::ReplayStoreUnavailable("/var/lib/x: disk full".into()),
    ];
    let codes: std::collections::HashSet<_> = all.iter().map(Refusal::code).collect();
    assert_eq!(codes.len(), all.len());
    for r in &all {
        assert!(matches!(r.status(), 401 | 403 | 503));
        assert!(r.to_string().starts_with(r.code()));
    }
    assert!(!Refusal::ReplayStoreUnavailable("/var/lib/x".into())
        .message()
        .contains("/var"));
}

#[test]
fn flush_targets_name_the_scope() {
    assert_eq!(flush_target("all", None), "*");
    assert_eq!(flush_target("all", Some("ignored")), "*");
    assert_eq!(flush_target("model", Some("m")), "m");
    assert_eq!(
        flush_target("tenant", Some("community-x")),
        "tenant:community-x"
    );
    assert_eq!(flush_target("tag", Some("t1")), "tag:t1");
    assert_eq!(Operation::parse("cache-flush"), Some(Operation::Flush));
    assert_eq!(
        Operation::parse(Operation::Load.name()),
        Some(Operation::Load)
    );
    assert_eq!(Operation::parse("delete"), None);
}

#[test]
fn the_same_token_sent_at_once_from_many_threads_passes_once() {
    let (dir, file) = shared_key("race");
    let gov = open(&config(&file, false, "", 1), &dir);
    let tok = token(&file, &["alice"], "nonce-race");
    let accepted = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..8)
            .map(|_| scope.spawn(|| load(&gov, &tok).is_ok()))
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap())
            .filter(|ok| *ok)
            .count()
    });
    assert_eq!(accepted, 1);
}

#[test]
fn server_settings_carry_the_governance_options() {
    use crate::cli::Settings;
    use crate::server::ServerConfig;
    let base = [("worker-secret", "s")];
    let cfg = ServerConfig::from_settings(&Settings::from_pairs(&base)).unwrap();
    assert_eq!(cfg.governance, Config::default());
    let cfg = ServerConfig::from_settings(&Settings::from_pairs(&[
        ("worker-secret", "s"),
        ("verified-op-token-key-path", "/etc/modelrelay/op-keys"),
        ("require-op-token", "true"),
        ("governance-signers", "admin1,admin2,admin3"),
        ("governance-min-signers", "2"),
    ]))
    .unwrap();
    assert_eq!(
        cfg.governance,
        Config {
            key_path: Some("/etc/modelrelay/op-keys".into()),
            require_op_token: true,
            signers: names(&["admin1", "admin2", "admin3"]),
            min_signers: 2,
            op_tokens_per_relay: false,
        }
    );
    let err = ServerConfig::from_settings(&Settings::from_pairs(&[
        ("worker-secret", "s"),
        ("require-op-token", "true"),
    ]))
    .unwrap_err();
    assert!(err.0.contains("VERIFIED_OP_TOKEN_KEY_PATH"), "{err}");
}
