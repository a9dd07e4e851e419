//! Client API keys: created, listed and revoked through the admin API, stored **hashed**
//! (SHA-256) in `STATE_DIR/keys.json`.
//!
//! The file is replaced atomically (write a temporary file, fsync it, rename it over the
//! old one, fsync the directory), so a crash or power cut leaves either the old or the
//! new list, never a torn one. A file that does not parse is reported at start-up and
//! never silently replaced. `last_used` is kept in memory and saved with the next write.

use std::collections::HashMap;
use std::fs;
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use parking_lot::RwLock;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use super::private_fs;

/// Every client key secret starts with this, so a bearer token meant for someone else
/// is told apart without hashing it.
pub const SECRET_PREFIX: &str = "mr-";

const FILE_NAME: &str = "keys.json";

/// One key as stored (the secret itself is never stored).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KeyRecord {
    pub id: String,
    pub name: String,
    /// Hex SHA-256 of the secret.
    pub sha256: String,
    pub created_unix: u64,
    #[serde(default)]
    pub last_used_unix: Option<u64>,
    #[serde(default)]
    pub revoked: bool,
    /// What the key's holder may do (absent in key files written before tenants).
    #[serde(flatten)]
    pub grant: KeyGrant,
}

/// A key's tenant and limits, all optional; validated by the admin route that sets
/// them, kept here as written.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct KeyGrant {
    /// Tenant the key belongs to; none: a tenant of its own, named by the key id.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenant: Option<String>,
    /// Highest `X-Priority` the key may use (`high`, `normal`, `low`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_priority: Option<String>,
    /// Request rate, e.g. `100req/min`, overriding the tenant's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rate_limit: Option<String>,
    /// Fair-share weight of the key's requests (default 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub weight: Option<u32>,
}

/// A live key that matched: its id and grant.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VerifiedKey {
    pub id: String,
    pub grant: KeyGrant,
}

/// What `GET /admin/keys` shows: metadata only.
#[derive(Debug, Clone, Serialize)]
pub struct KeyInfo {
    pub id: String,
    pub name: String,
    pub created_unix: u64,
    pub last_used_unix: Option<u64>,
    pub revoked: bool,
    #[serde(flatten)]
    pub grant: KeyGrant,
}

#[derive(Serialize, Deserialize)]
struct KeyFile {
    version: u32,
    keys: Vec<KeyRecord>,
}

pub struct KeyStore {
    dir: PathBuf,
    keys: RwLock<Vec<KeyRecord>>,
    /// sha256 → index into `keys`.
    by_hash: RwLock<HashMap<String, usize>>,
    /// Where changes are published for the other relays (`STATE_URL`); a change that
    /// cannot be published is refused, so no relay keeps a key the others do not know.
    mirror: Option<Box<dyn crate::server::store::KeyMirror>>,
}

fn now_unix() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

pub fn hash(secret: &str) -> String {
    hex(&Sha256::digest(secret.as_bytes()))
}

fn random_hex(n: usize) -> Result<String, String> {
    let mut bytes = vec![0u8; n];
    getrandom::fill(&mut bytes).map_err(|e| format!("no randomness available: {e}"))?;
    Ok(hex(&bytes))
}

impl KeyStore {
    /// Loads `dir/keys.json` if it exists. A corrupt file is an error, not a fresh start.
    pub fn open(dir: &Path) -> Result<KeyStore, String> {
        let path = dir.join(FILE_NAME);
        let keys = match fs::read(&path) {
            Ok(bytes) => {
                let file: KeyFile = serde_json::from_slice(&bytes).map_err(|e| {
                    format!("{} is corrupt ({e}); it was left untouched — restore it from a backup or move it away", path.display())
                })?;
                file.keys
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
            Err(e) => return Err(format!("cannot read {}: {e}", path.display())),
        };
        let by_hash = keys
            .iter()
            .enumerate()
            .map(|(i, k)| (k.sha256.clone(), i))
            .collect();
        Ok(KeyStore {
            dir: dir.to_path_buf(),
            keys: RwLock::new(keys),
            by_hash: RwLock::new(by_hash),
            mirror: None,
        })
    }

    /// Publishes every later change through `mirror`.
    pub fn with_mirror(mut self, mirror: Option<Box<dyn crate::server::store::KeyMirror>>) -> Self {
        self.mirror = mirror;
        self
    }

    fn publish(&self, record: &KeyRecord) -> Result<(), String> {
        match &self.mirror {
            Some(m) => m.publish(record),
            None => Ok(()),
        }
    }

    /// Every record, as kept (hashed secrets only); for the shared store.
    pub fn records(&self) -> Vec<KeyRecord> {
        self.keys.read().clone()
    }

    /// Replaces the list with `records` (the shared store's), keeping this relay's
    /// `last_used`, and saves it as the local copy used while the store is unreachable.
    pub fn replace(&self, mut records: Vec<KeyRecord>) -> Result<(), String> {
        records.sort_by(|a, b| (a.created_unix, &a.id).cmp(&(b.created_unix, &b.id)));
        let mut keys = self.keys.write();
        for r in &mut records {
            if let Some(old) = keys.iter().find(|k| k.id == r.id) {
                r.last_used_unix = r.last_used_unix.max(old.last_used_unix);
            }
        }
        let same = keys.len() == records.len()
            && keys.iter().zip(&records).all(|(a, b)| {
                (a.id == b.id)
                    && a.revoked == b.revoked
                    && a.sha256 == b.sha256
                    && a.grant == b.grant
            });
        if same {
            return Ok(());
        }
        self.persist(&records)?;
        *self.by_hash.write() = records
            .iter()
            .enumerate()
            .map(|(i, k)| (k.sha256.clone(), i))
            .collect();
        *keys = records;
        Ok(())
    }

    /// Creates a key; returns its record and the secret (shown once).
    pub fn create(&self, name: &str, grant: KeyGrant) -> Result<(KeyRecord, String), String> {
        let secret = format!("{SECRET_PREFIX}{}", random_hex(32)?);
        let record = KeyRecord {
            id: format!("key-{}", random_hex(6)?),
            name: name.to_string(),
            sha256: hash(&secret),
            created_unix: now_unix(),
            last_used_unix: None,
            revoked: false,
            grant,
        };
        let mut keys = self.keys.write();
        let mut next = keys.clone();
        next.push(record.clone());
        self.publish(&record)?;
        self.persist(&next)?;
        self.by_hash
            .write()
            .insert(record.sha256.clone(), next.len() - 1);
        *keys = next;
        Ok((record, secret))
    }

    pub fn list(&self) -> Vec<KeyInfo> {
        self.keys
            .read()
            .iter()
            .map(|k| KeyInfo {
                id: k.id.clone(),
                name: k.name.clone(),
                created_unix: k.created_unix,
                last_used_unix: k.last_used_unix,
                revoked: k.revoked,
                grant: k.grant.clone(),
            })
            .collect()
    }

    /// Revokes a key; `Ok(false)` if there is no such key.
    pub fn revoke(&self, id: &str) -> Result<bool, String> {
        let mut keys = self.keys.write();
        let Some(pos) = keys.iter().position(|k| k.id == id) else {
            return Ok(false);
        };
        let mut next = keys.clone();
        next[pos].revoked = true;
        self.publish(&next[pos])?;
        self.persist(&next)?;
        *keys = next;
        Ok(true)
    }

    /// The live key with this secret.
    pub fn verify(&self, secret: &str) -> Option<VerifiedKey> {
        let index = *self.by_hash.read().get(&hash(secret))?;
        let mut keys = self.keys.write();
        let key = keys.get_mut(index).filter(|k| !k.revoked)?;
        key.last_used_unix = Some(now_unix());
        Some(VerifiedKey {
            id: key.id.clone(),
            grant: key.grant.clone(),
        })
    }

    /// Writes the list atomically, owner-only (`private_fs::replace`).
    fn persist(&self, keys: &[KeyRecord]) -> Result<(), String> {
        let body = serde_json::to_vec_pretty(&KeyFile {
            version: 1,
            keys: keys.to_vec(),
        })
        .map_err(|e| format!("cannot encode API keys: {e}"))?;
        private_fs::replace(&self.dir, FILE_NAME, &body)
            .map_err(|e| format!("cannot save API keys ({e})"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp_dir(tag: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("mr-keys-{tag}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        dir
    }

    #[test]
    fn create_verify_revoke_and_reload() {
        let dir = temp_dir("cycle");
        let store = KeyStore::open(&dir).unwrap();
        let grant = KeyGrant {
            tenant: Some("team-a".into()),
            weight: Some(2),
            ..KeyGrant::default()
        };
        let (rec, secret) = store.create("app", grant.clone()).unwrap();
        assert!(secret.starts_with("mr-") && secret.len() == 67);
        assert_eq!(
            store.verify(&secret),
            Some(VerifiedKey {
                id: rec.id.clone(),
                grant: grant.clone()
            })
        );
        assert_eq!(store.verify("mr-wrong"), None);
        let text = fs::read_to_string(dir.join(FILE_NAME)).unwrap();
        assert!(!text.contains(&secret), "the secret is never stored");
        assert!(text.contains(&hash(&secret)));
        assert!(store.revoke(&rec.id).unwrap());
        assert_eq!(store.verify(&secret), None, "revoked at once");
        assert!(!store.revoke("key-nope").unwrap());
        let reloaded = KeyStore::open(&dir).unwrap();
        assert!(reloaded.list()[0].revoked);
        assert_eq!(
            reloaded.list()[0].grant,
            grant,
            "the grant survives a reload"
        );
        assert_eq!(reloaded.verify(&secret), None);
        let _ = fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_key_file_from_before_tenants_still_loads() {
        let dir = temp_dir("old");
        fs::create_dir_all(&dir).unwrap();
        let old =
            r#"{"version":1,"keys":[{"id":"key-1","name":"n","sha256":"ab","created_unix":1}]}"#;
        fs::write(dir.join(FILE_NAME), old).unwrap();
        let store = KeyStore::open(&dir).unwrap();
        assert_eq!(store.list()[0].grant, KeyGrant::default());
        let _ = fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_corrupt_file_is_reported_and_left_alone() {
        let dir = temp_dir("corrupt");
        fs::create_dir_all(&dir).unwrap();
        fs::write(dir.join(FILE_NAME), b"{\"version\":1,\"keys\":[{\"id\":").unwrap();
        let err = KeyStore::open(&dir).err().unwrap();
        assert!(err.contains("corrupt"), "{err}");
        assert_eq!(
            fs::read(dir.join(FILE_NAME)).unwrap(),
            b"{\"version\":1,\"keys\":[{\"id\":"
        );
        let _ = fs::remove_dir_all(&dir);
    }
}
