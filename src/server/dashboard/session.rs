//! Dashboard sessions: the admin token is exchanged once for a random session id held
//! in an HttpOnly, `SameSite=Strict` cookie (`Secure` when the server or its public URL
//! speaks HTTPS).
//!
//! Only the SHA-256 of each id is kept, so a memory dump does not hand out live
//! sessions; looking the hash up in a map leaks nothing useful through timing (an
//! attacker cannot steer the hash of a guess). The table is bounded: when full, expired
//! sessions go first, then the oldest. Sessions live in memory only; a restart signs
//! everyone out. At most [`CAPACITY`] entries, so a list searched in order does (a map
//! would cost more binary than it saves).
//!
//! With a shared store (`STATE_URL`) each session's hash and expiry are also kept there,
//! so a sign-in on one relay is valid on every relay until it expires or signs out: a
//! relay asks the store about a session it does not know, or has not checked for
//! [`VERIFY`]. While the store is unreachable, sessions this relay knows keep working.

use std::time::{Duration, Instant};

use parking_lot::Mutex;
use sha2::{Digest, Sha256};

use crate::server::http::request::Request;
use crate::server::store::SessionMirror;

/// The cookie's name.
pub const COOKIE: &str = "modelrelay_session";
/// How long a session lasts after sign-in.
pub const TTL: Duration = Duration::from_secs(12 * 3600);
/// Sessions kept at once.
pub const CAPACITY: usize = 64;
/// Event streams one session may hold open (one per tab; this only stops a runaway).
pub const MAX_STREAMS: u32 = 8;

/// How long a session the shared store confirmed is trusted without asking again (a
/// sign-out on another relay takes effect here within this).
pub const VERIFY: Duration = Duration::from_secs(1);

/// The server-side key of a session: SHA-256 of its id.
pub type Key = [u8; 32];

#[derive(Debug)]
struct Entry {
    key: Key,
    expires: Instant,
    streams: u32,
    /// When the shared store last confirmed it.
    verified: Instant,
}

/// The session table.
#[derive(Default)]
pub struct Sessions {
    table: Mutex<Vec<Entry>>,
    /// Where every relay finds the sessions (with a shared store).
    mirror: Option<Box<dyn SessionMirror>>,
}

fn key_of(id: &str) -> Key {
    Sha256::digest(id.as_bytes()).into()
}

impl Sessions {
    /// Sessions shared with the other relays through `mirror`.
    pub fn with_mirror(mirror: Option<Box<dyn SessionMirror>>) -> Sessions {
        Sessions {
            table: Mutex::default(),
            mirror,
        }
    }

    /// Starts a session; returns its id (the cookie value), or `None` when the system
    /// has no randomness to give.
    pub fn create(&self, now: Instant) -> Option<String> {
        let mut bytes = [0u8; 32];
        getrandom::fill(&mut bytes).ok()?;
        let id: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
        let key = key_of(&id);
        self.insert(key, now + TTL, now);
        if let Some(mirror) = &self.mirror {
            if let Err(e) = mirror.put(&key, TTL) {
                log::warn!("dashboard session valid on this relay only: {e}");
            }
        }
        Some(id)
    }

    /// Adds (or renews) a session; when full, expired ones go first, then the oldest.
    fn insert(&self, key: Key, expires: Instant, now: Instant) {
        let mut table = self.table.lock();
        if let Some(e) = table.iter_mut().find(|e| e.key == key) {
            e.expires = expires;
            e.verified = now;
            return;
        }
        if table.len() >= CAPACITY {
            table.retain(|e| e.expires > now);
        }
        if table.len() >= CAPACITY {
            // Entries are pushed in creation order: the first is the oldest.
            table.remove(0);
        }
        table.push(Entry {
            key,
            expires,
            streams: 0,
            verified: now,
        });
    }

    /// The session `req` carries, if it is live.
    pub fn check(&self, req: &Request, now: Instant) -> Option<Key> {
        let key = key_of(cookie(req, COOKIE)?);
        self.is_live(&key, now).then_some(key)
    }

    /// Whether `key` is still live (streams check it at every wake-up). With a shared
    /// store, one this relay has not confirmed for [`VERIFY`] is looked up there.
    pub fn is_live(&self, key: &Key, now: Instant) -> bool {
        let local = {
            let mut table = self.table.lock();
            match table.iter().position(|e| e.key == *key) {
                Some(i) if table[i].expires <= now => {
                    table.remove(i);
                    return false;
                }
                Some(i) if now.saturating_duration_since(table[i].verified) < VERIFY => {
                    return true;
                }
                found => found.is_some(),
            }
        };
        let Some(mirror) = &self.mirror else {
            return local;
        };
        match mirror.remaining(key) {
            Ok(Some(left)) => {
                self.insert(*key, now + left.min(TTL), now);
                true
            }
            Ok(None) => {
                self.table.lock().retain(|e| e.key != *key);
                false
            }
            // The store is away: what this relay knows stands.
            Err(_) => local,
        }
    }

    pub fn remove(&self, key: &Key) {
        self.table.lock().retain(|e| e.key != *key);
        if let Some(mirror) = &self.mirror {
            if let Err(e) = mirror.remove(key) {
                log::warn!("dashboard sign-out not shared with the other relays: {e}");
            }
        }
    }

    pub fn len(&self) -> usize {
        self.table.lock().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Counts an event stream against the session; `None` when it has
    /// [`MAX_STREAMS`] open already.
    pub fn open_stream(&self, key: Key) -> Option<StreamGuard<'_>> {
        let mut table = self.table.lock();
        let e = table.iter_mut().find(|e| e.key == key)?;
        if e.streams >= MAX_STREAMS {
            return None;
        }
        e.streams += 1;
        Some(StreamGuard {
            sessions: self,
            key,
        })
    }
}

/// An open event stream, uncounted when dropped.
pub struct StreamGuard<'a> {
    sessions: &'a Sessions,
    key: Key,
}

impl Drop for StreamGuard<'_> {
    fn drop(&mut self) {
        if let Some(e) = self
            .sessions
            .table
            .lock()
            .iter_mut()
            .find(|e| e.key == self.key)
        {
            e.streams = e.streams.saturating_sub(1);
        }
    }
}

/// The value of cookie `name` in the request's `Cookie` header(s).
pub fn cookie<'a>(req: &'a Request, name: &str) -> Option<&'a str> {
    req.headers
        .iter()
        .filter(|(n, _)| n == "cookie")
        .flat_map(|(_, v)| v.split(';'))
        .find_map(|pair| {
            let (k, v) = pair.trim().split_once('=')?;
            (k == name).then_some(v.trim())
        })
}

/// `Set-Cookie` for a new session.
pub fn set_cookie(id: &str, secure: bool) -> String {
    format!(
        "{COOKIE}={id}; Path=/; Max-Age={}; HttpOnly; SameSite=Strict{}",
        TTL.as_secs(),
        if secure { "; Secure" } else { "" }
    )
}

/// `Set-Cookie` that removes the session cookie (sign-out).
pub fn clear_cookie(secure: bool) -> String {
    format!(
        "{COOKIE}=; Path=/; Max-Age=0; HttpOnly; SameSite=Strict{}",
        if secure { "; Secure" } else { "" }
    )
}

/// Whether a state-changing request comes from our own pages: its `Origin` names this
/// server (the configured public URL, or the host the request was sent to, by http or
/// https since a TLS-terminating proxy may sit in front), and the browser did not flag
/// it as cross-site. A request without `Origin` is refused: every browser sends one on
/// a POST, and scripts can use the admin API with the token instead.
pub fn same_origin(req: &Request, public_url: Option<&str>) -> bool {
    if req
        .header("sec-fetch-site")
        .is_some_and(|s| s != "same-origin" && s != "none")
    {
        return false;
    }
    let Some(origin) = req.header("origin") else {
        return false;
    };
    if public_url.is_some_and(|p| origin_of(p) == origin) {
        return true;
    }
    let host = origin
        .strip_prefix("http://")
        .or_else(|| origin.strip_prefix("https://"));
    matches!((host, req.header("host")), (Some(o), Some(h)) if o.eq_ignore_ascii_case(h))
}

/// `scheme://host[:port]` of a URL.
fn origin_of(url: &str) -> &str {
    let after_scheme = url.find("://").map_or(0, |i| i + 3);
    match url[after_scheme..].find('/') {
        Some(slash) => &url[..after_scheme + slash],
        None => url,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(headers: &[(&str, &str)]) -> Request {
        Request {
            method: "POST".into(),
            path: "/dashboard/api/refresh".into(),
            query: String::new(),
            headers: headers
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            body: Vec::new(),
            hold: None,
            keep_alive: true,
            http10: false,
            pending: None,
        }
    }

    #[test]
    fn a_session_is_found_by_its_cookie_until_it_expires_or_is_removed() {
        let s = Sessions::default();
        let t = Instant::now();
        let id = s.create(t).unwrap();
        assert_eq!(id.len(), 64);
        let cookie = format!("other=1; {COOKIE}={id}");
        let r = req(&[("cookie", &cookie)]);
        let key = s.check(&r, t).expect("live");
        assert!(s
            .check(&req(&[("cookie", "modelrelay_session=nope")]), t)
            .is_none());
        assert!(s.check(&r, t + TTL).is_none(), "expired");
        assert!(s.is_empty(), "an expired session is forgotten when seen");
        let id = s.create(t).unwrap();
        let r = req(&[("cookie", &format!("{COOKIE}={id}"))]);
        let key2 = s.check(&r, t).unwrap();
        assert_ne!(key, key2);
        s.remove(&key2);
        assert!(s.check(&r, t).is_none());
    }

    #[test]
    fn the_table_is_bounded_and_stores_no_ids() {
        let s = Sessions::default();
        let t = Instant::now();
        let ids: Vec<String> = (0..200)
            .map(|n| s.create(t + Duration::from_millis(n)).unwrap())
            .collect();
        assert_eq!(s.len(), CAPACITY);
        let last = req(&[("cookie", &format!("{COOKIE}={}", ids[199]))]);
        assert!(s.check(&last, t).is_some(), "the newest survive");
        let first = req(&[("cookie", &format!("{COOKIE}={}", ids[0]))]);
        assert!(s.check(&first, t).is_none(), "the oldest went");
        let dump = format!("{:?}", s.table.lock());
        assert!(!dump.contains(&ids[199][..8]));
    }

    #[test]
    fn streams_per_session_are_capped() {
        let s = Sessions::default();
        let t = Instant::now();
        let id = s.create(t).unwrap();
        let key = s
            .check(&req(&[("cookie", &format!("{COOKIE}={id}"))]), t)
            .unwrap();
        let guards: Vec<_> = (0..MAX_STREAMS)
            .map(|_| s.open_stream(key).unwrap())
            .collect();
        assert!(s.open_stream(key).is_none());
        drop(guards);
        assert!(s.open_stream(key).is_some());
    }

    #[test]
    fn cookies_carry_the_flags() {
        let c = set_cookie("abc", false);
        assert_eq!(
            c,
            "modelrelay_session=abc; Path=/; Max-Age=43200; HttpOnly; SameSite=Strict"
        );
        assert!(set_cookie("abc", true).ends_with("; Secure"));
        assert!(clear_cookie(true).contains("Max-Age=0"));
    }

    #[test]
    fn origin_must_name_this_server() {
        let host = ("host", "relay.lan:8080");
        assert!(same_origin(
            &req(&[host, ("origin", "http://relay.lan:8080")]),
            None
        ));
        assert!(same_origin(
            &req(&[host, ("origin", "https://relay.lan:8080")]),
            None
        ));
        assert!(!same_origin(&req(&[host]), None), "no Origin");
        assert!(!same_origin(
            &req(&[host, ("origin", "http://evil.example")]),
            None
        ));
        assert!(!same_origin(&req(&[host, ("origin", "null")]), None));
        let cross = [
            host,
            ("origin", "http://relay.lan:8080"),
            ("sec-fetch-site", "cross-site"),
        ];
        assert!(!same_origin(&req(&cross), None));
        let proxied = [
            ("host", "127.0.0.1:8080"),
            ("origin", "https://relay.example.com"),
        ];
        assert!(same_origin(
            &req(&proxied),
            Some("https://relay.example.com/")
        ));
        assert!(!same_origin(
            &req(&proxied),
            Some("https://other.example.com")
        ));
        assert_eq!(origin_of("https://a.b:9/x/y"), "https://a.b:9");
    }

    /// A store whose sessions the test sets, or that is unreachable.
    #[derive(Default)]
    struct FakeStore {
        sessions: Mutex<Vec<(Key, Duration)>>,
        down: std::sync::atomic::AtomicBool,
    }

    impl SessionMirror for std::sync::Arc<FakeStore> {
        fn put(&self, key: &Key, ttl: Duration) -> Result<(), String> {
            self.sessions.lock().push((*key, ttl));
            Ok(())
        }
        fn remaining(&self, key: &Key) -> Result<Option<Duration>, String> {
            if self.down.load(std::sync::atomic::Ordering::Relaxed) {
                return Err("down".into());
            }
            Ok(self
                .sessions
                .lock()
                .iter()
                .find(|e| e.0 == *key)
                .map(|e| e.1))
        }
        fn remove(&self, key: &Key) -> Result<(), String> {
            self.sessions.lock().retain(|e| e.0 != *key);
            Ok(())
        }
    }

    #[test]
    fn with_a_shared_store_a_session_from_another_relay_holds_until_signed_out_there() {
        let store = std::sync::Arc::new(FakeStore::default());
        let here = Sessions::with_mirror(Some(Box::new(store.clone())));
        let there = Sessions::with_mirror(Some(Box::new(store.clone())));
        let t = Instant::now();
        let id = there.create(t).unwrap();
        let cookie = format!("{COOKIE}={id}");
        let key = here
            .check(&req(&[("cookie", &cookie)]), t)
            .expect("known from the store");
        // Confirmed a moment ago: no need to ask; later, the store's word counts.
        there.remove(&key);
        assert!(here.is_live(&key, t + VERIFY / 2));
        assert!(!here.is_live(&key, t + VERIFY));
        // While the store is unreachable, what this relay knows stands.
        let id = there.create(t).unwrap();
        let key = here
            .check(&req(&[("cookie", &format!("{COOKIE}={id}"))]), t)
            .unwrap();
        store.down.store(true, std::sync::atomic::Ordering::Relaxed);
        assert!(here.is_live(&key, t + 2 * VERIFY));
        assert!(!here.is_live(&key, t + TTL), "expired all the same");
    }
}
