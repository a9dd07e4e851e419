//! `modelrelay-server sign-op-token`: tokens minted by the built binary verify with the
//! library's governance gate (shared key and per-signer keys), and bad arguments exit 2.
#![cfg(feature = "governance")]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{SystemTime, UNIX_EPOCH};

use modelrelay::server::lifecycle::governance::{
    Authorized, Config, Governance, Operation, Refusal,
};
use serde_json::Value;

const BIN: &str = env!("CARGO_BIN_EXE_modelrelay-server");

fn temp_dir(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("mr-gov-cli-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs()
}

fn sign(args: &[&str]) -> Output {
    Command::new(BIN)
        .arg("sign-op-token")
        .args(args)
        .env_remove("VERIFIED_OP_TOKEN_KEY_PATH")
        .output()
        .unwrap()
}

fn minted(args: &[&str]) -> String {
    let out = sign(args);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap().trim().to_string()
}

fn gate(key_path: &Path, state: &Path, signers: &str, min: usize) -> Governance {
    let cfg = Config::new(key_path.to_str(), false, Some(signers), min).unwrap();
    Governance::open(&cfg, state, now()).unwrap()
}

#[test]
fn a_shared_key_token_from_the_binary_verifies() {
    let dir = temp_dir("shared");
    let key = dir.join("model-api.key");
    std::fs::write(&key, "0123456789abcdef0123456789abcdef0123456789abcdef\n").unwrap();
    let key_arg = key.to_str().unwrap();
    let model = "meta-llama/Llama-3.1-70B-Instruct";
    let text = minted(&[
        "--operation",
        "load",
        "--model",
        model,
        "--key-path",
        key_arg,
        "--signer",
        "admin1",
        "--signer",
        "admin2",
    ]);
    let token: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(token["opToken"]["operation"], "model-load");
    assert_eq!(token["opToken"]["modelId"], model);
    assert_eq!(
        token["opToken"]["signers"],
        serde_json::json!(["admin1", "admin2"])
    );
    assert_eq!(token["signature"].as_str().unwrap().len(), 64);
    let gov = gate(&key, &dir.join("state"), "admin1,admin2,admin3", 2);
    assert_eq!(
        gov.authorize(Some(&text), Operation::Load, model, false, now()),
        Ok(Authorized::OpToken {
            signers: vec!["admin1".into(), "admin2".into()]
        })
    );
    assert_eq!(
        gov.authorize(Some(&text), Operation::Load, model, false, now()),
        Err(Refusal::Replayed)
    );
    // The seed's transport: base64url of the JSON, `eyJ...`.
    let b64 = minted(&[
        "--operation=flush",
        "--model=tenant:community-x",
        "--key-path",
        key_arg,
        "--signer",
        "admin1,admin3",
        "--base64url",
    ]);
    assert!(b64.starts_with("eyJ"), "{b64}");
    assert!(gov
        .authorize(
            Some(&b64),
            Operation::Flush,
            "tenant:community-x",
            false,
            now()
        )
        .is_ok());
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn per_signer_tokens_from_the_binary_verify_signer_by_signer() {
    let dir = temp_dir("per-signer");
    let keys = dir.join("keys");
    std::fs::create_dir_all(&keys).unwrap();
    for signer in ["alice", "bob", "carol"] {
        std::fs::write(keys.join(signer), format!("{signer}-{}", "s".repeat(40))).unwrap();
    }
    let keys_arg = keys.to_str().unwrap();
    let text = minted(&[
        "--operation",
        "unload",
        "--model",
        "m",
        "--key-path",
        keys_arg,
        "--signer",
        "alice",
        "--signer",
        "carol",
    ]);
    let token: Value = serde_json::from_str(&text).unwrap();
    let signatures = token["signatures"].as_array().unwrap();
    assert_eq!(signatures.len(), 2);
    assert_eq!(signatures[1]["signer"], "carol");
    assert!(token.get("signature").is_none());
    let gov = gate(&keys, &dir.join("state"), "", 2);
    assert!(gov
        .authorize(Some(&text), Operation::Unload, "m", false, now())
        .is_ok());
    // A signer without a key file cannot be signed for.
    let out = sign(&[
        "--operation",
        "unload",
        "--model",
        "m",
        "--key-path",
        keys_arg,
        "--signer",
        "mallory",
    ]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("mallory"));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn help_and_bad_arguments() {
    let help = sign(&["--help"]);
    assert!(help.status.success());
    assert!(String::from_utf8_lossy(&help.stdout).contains("--signer"));
    let bad = sign(&["--operation", "delete"]);
    assert_eq!(bad.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&bad.stderr).contains("delete"));
    let no_key = sign(&["--operation", "load", "--model", "m", "--signer", "a"]);
    assert_eq!(no_key.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&no_key.stderr).contains("VERIFIED_OP_TOKEN_KEY_PATH"));
}
