//! Who the client is behind a reverse proxy (`TRUSTED_PROXIES`).
//!
//! Behind nginx or Caddy every request arrives from the proxy's address, so anything
//! keyed by address (the auth-failure limiter) would treat all clients as one. When the
//! socket peer is a trusted proxy, the client is read from `X-Forwarded-For` (or, when a
//! proxy sets only that, `Forwarded: for=`): the right-most address that is not itself a
//! trusted proxy. Entries to its left were written by the client and prove nothing. A
//! peer that is not trusted is the client, whatever headers it sends.

use std::net::IpAddr;

use super::http::request::Request;

/// One `TRUSTED_PROXIES` entry: an address or a CIDR block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Block {
    net: IpAddr,
    prefix: u8,
}

impl Block {
    fn parse(text: &str) -> Option<Block> {
        let (addr, prefix) = match text.split_once('/') {
            Some((a, p)) => (a.parse::<IpAddr>().ok()?, Some(p.parse::<u8>().ok()?)),
            None => (text.parse::<IpAddr>().ok()?, None),
        };
        let addr = addr.to_canonical();
        let max = if addr.is_ipv4() { 32 } else { 128 };
        let prefix = prefix.unwrap_or(max);
        (prefix <= max).then_some(Block { net: addr, prefix })
    }

    fn contains(&self, ip: IpAddr) -> bool {
        let bits = |ip: IpAddr| -> u128 {
            match ip {
                IpAddr::V4(v4) => u32::from(v4).into(),
                IpAddr::V6(v6) => u128::from(v6),
            }
        };
        if self.net.is_ipv4() != ip.is_ipv4() {
            return false;
        }
        let width = if ip.is_ipv4() { 32 } else { 128 };
        let shift = width - u32::from(self.prefix);
        let mask = |v: u128| v.checked_shr(shift).unwrap_or(0);
        mask(bits(ip)) == mask(bits(self.net))
    }
}

/// The proxies whose forwarding headers are believed (empty: none, the default).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TrustedProxies {
    blocks: Vec<Block>,
}

impl TrustedProxies {
    /// A comma-separated list of addresses and CIDR blocks (`10.0.0.0/8, ::1`).
    pub fn parse(text: &str) -> Result<TrustedProxies, String> {
        let mut blocks = Vec::new();
        for item in text.split(',').map(str::trim).filter(|i| !i.is_empty()) {
            let block = Block::parse(item).ok_or_else(|| {
                format!("TRUSTED_PROXIES: `{item}` is not an IP address or CIDR block")
            })?;
            blocks.push(block);
        }
        Ok(TrustedProxies { blocks })
    }

    pub fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }

    fn trusts(&self, ip: IpAddr) -> bool {
        let ip = ip.to_canonical();
        self.blocks.iter().any(|b| b.contains(ip))
    }

    /// The client's address: the socket peer, or, when the peer is a trusted proxy,
    /// the right-most untrusted address it forwarded (the left-most when all are trusted).
    pub fn client_ip(&self, peer: IpAddr, req: &Request) -> IpAddr {
        let peer = peer.to_canonical();
        if !self.trusts(peer) {
            return peer;
        }
        let chain = forwarded_chain(req);
        chain
            .iter()
            .rev()
            .find(|ip| !self.trusts(**ip))
            .or(chain.first())
            .copied()
            .unwrap_or(peer)
    }
}

/// The forwarded addresses in order (client first): `X-Forwarded-For` when present,
/// else the `for=` parameters of `Forwarded`. An entry that is not an address (a
/// hostname, `unknown`, an obfuscated identifier) ends the chain there: nothing to its
/// left can be attributed.
fn forwarded_chain(req: &Request) -> Vec<IpAddr> {
    let xff: Vec<&str> = headers(req, "x-forwarded-for")
        .flat_map(|v| v.split(','))
        .map(str::trim)
        .collect();
    let items: Vec<String> = if !xff.is_empty() {
        xff.iter().map(|s| s.to_string()).collect()
    } else {
        headers(req, "forwarded")
            .flat_map(|v| v.split(','))
            .flat_map(|element| element.split(';'))
            .filter_map(|pair| {
                let (k, v) = pair.trim().split_once('=')?;
                k.trim()
                    .eq_ignore_ascii_case("for")
                    .then(|| v.trim().trim_matches('"').to_string())
            })
            .collect()
    };
    let mut chain = Vec::new();
    for item in items.iter().rev() {
        match parse_node(item) {
            Some(ip) => chain.push(ip),
            None => break,
        }
    }
    chain.reverse();
    chain
}

fn headers<'a>(req: &'a Request, name: &'a str) -> impl Iterator<Item = &'a str> {
    req.headers
        .iter()
        .filter(move |(n, _)| n.eq_ignore_ascii_case(name))
        .map(|(_, v)| v.as_str())
}

/// `1.2.3.4`, `1.2.3.4:5678`, `::1`, `[::1]`, `[::1]:5678`.
fn parse_node(text: &str) -> Option<IpAddr> {
    if let Ok(ip) = text.parse::<IpAddr>() {
        return Some(ip.to_canonical());
    }
    if let Some(rest) = text.strip_prefix('[') {
        return rest.split_once(']')?.0.parse::<IpAddr>().ok();
    }
    let (host, port) = text.rsplit_once(':')?;
    port.parse::<u16>().ok()?;
    host.parse::<std::net::Ipv4Addr>().ok().map(IpAddr::V4)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    fn req(headers: &[(&str, &str)]) -> Request {
        request("GET", headers)
    }

    /// A parsed request with these headers (for this module's and `origin.rs`'s tests).
    pub(crate) fn request(method: &str, headers: &[(&str, &str)]) -> Request {
        Request {
            method: method.into(),
            path: "/v1/chat/completions".into(),
            query: String::new(),
            headers: headers
                .iter()
                .map(|(n, v)| (n.to_string(), v.to_string()))
                .collect(),
            body: Vec::new(),
            keep_alive: true,
            http10: false,
            pending: None,
            hold: None,
        }
    }

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn entries_parse_and_bad_ones_are_refused() {
        let t = TrustedProxies::parse(" 10.0.0.0/8, 192.168.1.5 ,::1, fd00::/8 ,").unwrap();
        assert!(t.trusts(ip("10.200.3.4")) && t.trusts(ip("192.168.1.5")));
        assert!(!t.trusts(ip("192.168.1.6")) && !t.trusts(ip("11.0.0.1")));
        assert!(t.trusts(ip("::1")) && t.trusts(ip("fd12::1")) && !t.trusts(ip("fe80::1")));
        assert!(
            t.trusts(ip("::ffff:10.1.1.1")),
            "v4-mapped peers count as v4"
        );
        assert!(TrustedProxies::parse("0.0.0.0/0")
            .unwrap()
            .trusts(ip("8.8.8.8")));
        for bad in [
            "10.0.0.0/33",
            "example.com",
            "1.2.3",
            "::1/129",
            "1.2.3.4/x",
        ] {
            assert!(TrustedProxies::parse(bad).is_err(), "{bad}");
        }
        assert!(TrustedProxies::parse("").unwrap().is_empty());
    }

    #[test]
    fn an_untrusted_peer_is_the_client_whatever_it_forwards() {
        let t = TrustedProxies::parse("10.0.0.1").unwrap();
        let r = req(&[("x-forwarded-for", "1.1.1.1")]);
        assert_eq!(t.client_ip(ip("10.0.0.2"), &r), ip("10.0.0.2"));
        assert_eq!(
            TrustedProxies::default().client_ip(ip("10.0.0.1"), &r),
            ip("10.0.0.1")
        );
    }

    #[test]
    fn the_right_most_untrusted_forwarded_address_is_the_client() {
        let t = TrustedProxies::parse("10.0.0.0/8").unwrap();
        let proxy = ip("10.0.0.1");
        // The client forged the first entry; nginx appended the real one.
        let r = req(&[("x-forwarded-for", "6.6.6.6, 203.0.113.7")]);
        assert_eq!(t.client_ip(proxy, &r), ip("203.0.113.7"));
        // Two proxies: the inner one is trusted and skipped.
        let r = req(&[
            ("X-Forwarded-For", "6.6.6.6"),
            ("x-forwarded-for", "203.0.113.7, 10.9.9.9"),
        ]);
        assert_eq!(t.client_ip(proxy, &r), ip("203.0.113.7"));
        // All trusted: the left-most.
        let r = req(&[("x-forwarded-for", "10.1.1.1, 10.2.2.2")]);
        assert_eq!(t.client_ip(proxy, &r), ip("10.1.1.1"));
        // Nothing forwarded: the proxy itself.
        assert_eq!(t.client_ip(proxy, &req(&[])), proxy);
        // Garbage in the chain ends it.
        let r = req(&[("x-forwarded-for", "203.0.113.7, junk")]);
        assert_eq!(t.client_ip(proxy, &r), proxy);
    }

    #[test]
    fn forwarded_is_read_when_x_forwarded_for_is_absent() {
        let t = TrustedProxies::parse("10.0.0.1").unwrap();
        let r = req(&[(
            "forwarded",
            "for=6.6.6.6;proto=http, For=\"[2001:db8::7]:4711\";by=10.0.0.1",
        )]);
        assert_eq!(t.client_ip(ip("10.0.0.1"), &r), ip("2001:db8::7"));
        let r = req(&[("forwarded", "for=198.51.100.9:1234")]);
        assert_eq!(t.client_ip(ip("10.0.0.1"), &r), ip("198.51.100.9"));
    }
}
