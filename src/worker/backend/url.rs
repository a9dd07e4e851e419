//! What the worker appends to its backend's base URL, and how that URL is shown.
//!
//! The server names the path of each request (`endpoint_path`). Appended as text to
//! `BACKEND_URL`, a path such as `@evil.example/x` turns the base's host into userinfo
//! and sends the request, with `BACKEND_API_KEY`, to another host. So a path is accepted
//! only when it is an absolute path on the backend's own host. And a base URL with
//! credentials (`http://user:pass@host`) is never shown whole: errors that reach a client
//! and log lines carry it with the userinfo replaced.

use ureq::http::Uri;

/// Why `path` may not be sent to the backend at `base_text`; `Ok` with the full URL when
/// it may. `base` is `base_text` parsed once by the caller (`None`: it does not parse, so
/// nothing passes); the URL comes back parsed, and ureq takes it as it is.
pub fn checked_uri(base: Option<&Uri>, base_text: &str, path: &str) -> Result<Uri, &'static str> {
    if !path.starts_with('/') || path.starts_with("//") {
        return Err("it must be an absolute path starting with a single /");
    }
    if path.contains('@') || path.contains('\\') || path.contains("://") {
        return Err("it may not contain @, \\ or a scheme");
    }
    if path.chars().any(|c| c.is_control() || c == ' ') {
        return Err("it may not contain spaces or control characters");
    }
    // Belt and braces: whatever the text checks missed, the parsed URL must name the
    // base's own host and port. (`try_from` a `String` keeps its buffer: no copy.)
    let full = Uri::try_from(format!("{base_text}{path}"));
    match (full, base) {
        (Ok(full), Some(base))
            if full.authority() == base.authority() && full.scheme() == base.scheme() =>
        {
            Ok(full)
        }
        _ => Err("it does not stay on the backend's host"),
    }
}

/// `url` with any userinfo (`user:pass@`) replaced by `***@`, for messages and logs.
pub fn redacted(url: &str) -> String {
    let Some(scheme_end) = url.find("://").map(|i| i + 3) else {
        return url.to_string();
    };
    let rest = &url[scheme_end..];
    let authority_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    match rest[..authority_end].rfind('@') {
        Some(at) => format!("{}***{}", &url[..scheme_end], &rest[at..]),
        None => url.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BASE: &str = "http://127.0.0.1:8000";

    /// The check as a `Backend` makes it, its URL as text.
    fn checked_url(base: &str, path: &str) -> Result<String, &'static str> {
        checked_uri(base.parse().ok().as_ref(), base, path).map(|uri| uri.to_string())
    }

    #[test]
    fn ordinary_paths_pass() {
        for path in [
            "/v1/chat/completions",
            "/api/chat",
            "/v1/models?x=1",
            "/v1/a%40b",
        ] {
            assert_eq!(
                checked_url(BASE, path),
                Ok(format!("{BASE}{path}")),
                "{path}"
            );
        }
    }

    #[test]
    fn paths_that_leave_the_host_are_refused() {
        for path in [
            "@evil.example/x",
            "/x@evil",
            "//evil.example/x",
            "http://evil.example/x",
            "/x://y",
            "\\\\evil/x",
            "/x\\y",
            "/x\r\nHost: evil",
            "/x y",
            "",
            "v1/chat",
            ".evil.example/x",
            ":9999/x",
        ] {
            assert!(checked_url(BASE, path).is_err(), "{path:?} was accepted");
        }
    }

    #[test]
    fn userinfo_is_redacted() {
        assert_eq!(
            redacted("http://user:pa@ss@host:1/v1?a=b@c"),
            "http://***@host:1/v1?a=b@c"
        );
        assert_eq!(redacted("https://host/x@y"), "https://host/x@y");
        assert_eq!(redacted("http://host"), "http://host");
        assert_eq!(redacted("no scheme"), "no scheme");
    }
}
