//! The backend's address, looked up once every few seconds instead of for every request.
//!
//! ureq resolves a request's host before it looks in its pool for an idle connection, so
//! a pooled keep-alive connection still pays for a lookup: for a name (`localhost`, a
//! container's name) that is a `getaddrinfo` per request (reading `/etc/hosts`, perhaps
//! asking DNS), and even an IP address is formatted into a string and parsed again. Each
//! slot's agent keeps the last answer for [`KEEP`]; a backend that moves is found again
//! within that time, and a slot that replaces its agent (after a cancel) looks it up anew.

use std::fmt;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use ureq::config::Config;
use ureq::http::Uri;
use ureq::unversioned::resolver::{DefaultResolver, ResolvedSocketAddrs, Resolver};
use ureq::unversioned::transport::NextTimeout;
use ureq::Error;

/// How long one lookup's answer is used.
const KEEP: Duration = Duration::from_secs(5);

#[derive(Default)]
pub struct CachedResolver {
    lookup: DefaultResolver,
    last: Mutex<Option<Answer>>,
}

/// One lookup: which URL part it answered, when, and the addresses.
struct Answer {
    scheme: String,
    authority: String,
    at: Instant,
    addrs: ResolvedSocketAddrs,
}

impl Answer {
    fn serves(&self, uri: &Uri, now: Instant) -> bool {
        now.saturating_duration_since(self.at) < KEEP
            && uri.scheme_str() == Some(self.scheme.as_str())
            && uri.authority().map(|a| a.as_str()) == Some(self.authority.as_str())
    }
}

impl Resolver for CachedResolver {
    fn resolve(
        &self,
        uri: &Uri,
        config: &Config,
        timeout: NextTimeout,
    ) -> Result<ResolvedSocketAddrs, Error> {
        let now = Instant::now();
        let mut last = self.last.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(answer) = last.as_ref().filter(|a| a.serves(uri, now)) {
            return Ok(answer.addrs.clone());
        }
        // A failed lookup is not kept: the next request asks again.
        let addrs = self.lookup.resolve(uri, config, timeout)?;
        *last = Some(Answer {
            scheme: uri.scheme_str().unwrap_or_default().to_string(),
            authority: uri
                .authority()
                .map(|a| a.as_str())
                .unwrap_or_default()
                .to_string(),
            at: now,
            addrs: addrs.clone(),
        });
        Ok(addrs)
    }
}

impl fmt::Debug for CachedResolver {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CachedResolver").finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ureq::unversioned::transport::time::Duration as UreqDuration;

    fn no_timeout() -> NextTimeout {
        NextTimeout {
            after: UreqDuration::NotHappening,
            reason: ureq::Timeout::Global,
            ..NextTimeout::default()
        }
    }

    fn resolve(r: &CachedResolver, url: &str) -> Vec<std::net::SocketAddr> {
        let uri: Uri = url.parse().unwrap();
        let config = Config::default();
        r.resolve(&uri, &config, no_timeout()).unwrap().to_vec()
    }

    #[test]
    fn answers_each_host_and_port_with_its_own_addresses() {
        let r = CachedResolver::default();
        assert_eq!(
            resolve(&r, "http://127.0.0.1:8000/a"),
            ["127.0.0.1:8000".parse().unwrap()]
        );
        // Kept: the same answer for another path on the same host.
        assert_eq!(
            resolve(&r, "http://127.0.0.1:8000/b"),
            ["127.0.0.1:8000".parse().unwrap()]
        );
        // Another port or host is looked up, not served from the last answer.
        assert_eq!(
            resolve(&r, "http://127.0.0.1:9000/a"),
            ["127.0.0.1:9000".parse().unwrap()]
        );
        assert_eq!(
            resolve(&r, "http://127.0.0.2:9000/a"),
            ["127.0.0.2:9000".parse().unwrap()]
        );
    }

    #[test]
    fn an_old_answer_is_looked_up_again() {
        let r = CachedResolver::default();
        resolve(&r, "http://127.0.0.1:8000/");
        {
            let mut last = r.last.lock().unwrap();
            let answer = last.as_mut().unwrap();
            answer.at = answer.at.checked_sub(KEEP).unwrap();
            answer.addrs = r.empty();
        }
        // The emptied answer is past its time: a real lookup fills it again.
        assert_eq!(
            resolve(&r, "http://127.0.0.1:8000/"),
            ["127.0.0.1:8000".parse().unwrap()]
        );
    }
}
