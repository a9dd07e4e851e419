use super::*;

fn req(method: &str, headers: &[(&str, &str)]) -> Request {
    crate::server::client_ip::tests::request(method, headers)
}

/// Refusals compare by code.
impl PartialEq for Verdict {
    fn eq(&self, other: &Verdict) -> bool {
        match (self, other) {
            (Verdict::Pass(a), Verdict::Pass(b)) => a == b,
            (Verdict::Preflight(a), Verdict::Preflight(b)) => a == b,
            (Verdict::Refuse(a), Verdict::Refuse(b)) => a.code == b.code,
            _ => false,
        }
    }
}

fn guard<'a>(listen: &'a str, allowed: &'a AllowedOrigins) -> Guard<'a> {
    Guard {
        listen_addr: listen,
        public_url: Some("https://relay.example.com/base"),
        allowed,
    }
}

fn refused(v: &Verdict) -> Option<&'static str> {
    match v {
        Verdict::Refuse(e) => Some(match e.code.as_ref() {
            "host_not_allowed" => "host",
            "cross_origin" => "origin",
            _ => "other",
        }),
        _ => None,
    }
}

#[test]
fn allowed_origins_parse() {
    let a = AllowedOrigins::parse(" https://App.example.com/ , http://10.0.0.5:3000").unwrap();
    assert!(a.allows("https://app.example.com") && a.allows("http://10.0.0.5:3000"));
    assert!(!a.allows("http://app.example.com") && !a.allows("null"));
    assert!(AllowedOrigins::parse("*")
        .unwrap()
        .allows("http://anything"));
    for bad in ["app.example.com", "https://a/b", "ftp://a", "https://"] {
        assert!(AllowedOrigins::parse(bad).is_err(), "{bad}");
    }
}

#[test]
fn the_host_check_applies_on_loopback_only() {
    let none = AllowedOrigins::default();
    let g = guard("127.0.0.1:8080", &none);
    for host in [
        "localhost",
        "localhost:8080",
        "LOCALHOST:1",
        "app.localhost",
        "127.0.0.1:8080",
        "127.1.2.3",
        "[::1]:8080",
        "relay.example.com",
        "relay.example.com:443",
    ] {
        assert_eq!(
            g.check(&req("POST", &[("host", host)])),
            Verdict::Pass(None),
            "{host}"
        );
    }
    for host in [
        "evil.example",
        "evil.example:8080",
        "192.168.1.5:8080",
        "localhost.evil",
    ] {
        assert_eq!(
            refused(&g.check(&req("POST", &[("host", host)]))),
            Some("host"),
            "{host}"
        );
    }
    assert_eq!(
        g.check(&req("GET", &[])),
        Verdict::Pass(None),
        "no Host (HTTP/1.0)"
    );
    for listen in ["0.0.0.0:8080", "192.168.1.5:8080", "[::]:8080"] {
        let g = guard(listen, &none);
        assert_eq!(
            g.check(&req("POST", &[("host", "relay.lan")])),
            Verdict::Pass(None)
        );
    }
    assert!(loopback_only("localhost:8080") && loopback_only("[::1]:1"));
}

#[test]
fn cross_site_browser_requests_are_refused_same_origin_and_tools_pass() {
    let none = AllowedOrigins::default();
    let g = guard("0.0.0.0:8080", &none);
    let lan = |extra: &[(&str, &str)]| {
        let mut h = vec![("host", "relay.lan:8080")];
        h.extend_from_slice(extra);
        g.check(&req("POST", &h))
    };
    assert_eq!(lan(&[]), Verdict::Pass(None), "curl, SDKs");
    assert_eq!(
        lan(&[("origin", "http://relay.lan:8080")]),
        Verdict::Pass(None)
    );
    assert_eq!(
        lan(&[("origin", "https://relay.example.com")]),
        Verdict::Pass(None)
    );
    assert_eq!(
        refused(&lan(&[("origin", "http://evil.example")])),
        Some("origin")
    );
    assert_eq!(refused(&lan(&[("origin", "null")])), Some("origin"));
    assert_eq!(
        refused(&lan(&[("sec-fetch-site", "cross-site")])),
        Some("origin")
    );
    assert_eq!(
        lan(&[("sec-fetch-site", "same-origin")]),
        Verdict::Pass(None)
    );
    assert_eq!(
        refused(&lan(&[
            ("origin", "http://relay.lan:8080"),
            ("sec-fetch-site", "cross-site")
        ])),
        Some("origin")
    );
}

#[test]
fn allowed_origins_get_cors_and_preflights() {
    let allowed = AllowedOrigins::parse("http://app.lan:3000").unwrap();
    let g = guard("0.0.0.0:8080", &allowed);
    let o = ("origin", "http://app.lan:3000");
    assert_eq!(
        g.check(&req("POST", &[("host", "relay.lan"), o])),
        Verdict::Pass(Some("http://app.lan:3000".into()))
    );
    let pre = req(
        "OPTIONS",
        &[
            ("host", "relay.lan"),
            o,
            ("access-control-request-method", "POST"),
            (
                "access-control-request-headers",
                "authorization, content-type",
            ),
        ],
    );
    assert_eq!(
        g.check(&pre),
        Verdict::Preflight("http://app.lan:3000".into())
    );
    let h = preflight_headers(&pre, "http://app.lan:3000");
    let get = |n: &str| h.iter().find(|(k, _)| k == n).map(|(_, v)| v.as_str());
    assert_eq!(
        get("access-control-allow-origin"),
        Some("http://app.lan:3000")
    );
    assert_eq!(
        get("access-control-allow-headers"),
        Some("authorization, content-type")
    );
    let odd = req("OPTIONS", &[("access-control-request-headers", "x\u{7f}y")]);
    let h = preflight_headers(&odd, "http://app.lan:3000");
    assert!(h
        .iter()
        .any(|(k, v)| k == "access-control-allow-headers" && v == DEFAULT_ALLOW_HEADERS));
    // `*`: any origin, and a cross-site fetch without Origin too.
    let any = AllowedOrigins::parse("*").unwrap();
    let g = guard("0.0.0.0:8080", &any);
    assert!(matches!(
        g.check(&req("POST", &[("origin", "http://x.example")])),
        Verdict::Pass(Some(_))
    ));
    assert_eq!(
        g.check(&req("GET", &[("sec-fetch-site", "cross-site")])),
        Verdict::Pass(None)
    );
}
