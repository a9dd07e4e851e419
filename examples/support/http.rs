//! A minimal HTTP/1.1 client for the benches: one request per connection.
#![allow(dead_code)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

/// One HTTP/1.1 request on a fresh connection; the whole body (content-length or chunked).
pub fn http(
    addr: SocketAddr,
    method: &str,
    path: &str,
    body: Option<&str>,
    bearer: Option<&str>,
) -> std::io::Result<(u16, String)> {
    http_with(addr, method, path, body, bearer, &[])
}

/// [`http`] with extra request headers.
pub fn http_with(
    addr: SocketAddr,
    method: &str,
    path: &str,
    body: Option<&str>,
    bearer: Option<&str>,
    headers: &[(&str, &str)],
) -> std::io::Result<(u16, String)> {
    let mut s = TcpStream::connect(addr)?;
    s.set_read_timeout(Some(Duration::from_secs(60)))?;
    let mut head = format!("{method} {path} HTTP/1.1\r\nhost: localhost\r\nconnection: close\r\n");
    if let Some(token) = bearer {
        head.push_str(&format!("authorization: Bearer {token}\r\n"));
    }
    for (name, value) in headers {
        head.push_str(&format!("{name}: {value}\r\n"));
    }
    if let Some(b) = body {
        head.push_str(&format!(
            "content-type: application/json\r\ncontent-length: {}\r\n",
            b.len()
        ));
    }
    head.push_str("\r\n");
    head.push_str(body.unwrap_or(""));
    s.write_all(head.as_bytes())?;
    let mut r = BufReader::new(s);
    let mut line = String::new();
    r.read_line(&mut line)?;
    let status = line
        .split_whitespace()
        .nth(1)
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    let (mut length, mut chunked) = (None, false);
    loop {
        line.clear();
        r.read_line(&mut line)?;
        let l = line.trim_end().to_ascii_lowercase();
        if l.is_empty() {
            break;
        }
        if let Some(v) = l.strip_prefix("content-length:") {
            length = v.trim().parse::<usize>().ok();
        }
        if l.starts_with("transfer-encoding:") && l.contains("chunked") {
            chunked = true;
        }
    }
    let mut out = Vec::new();
    if chunked {
        loop {
            line.clear();
            r.read_line(&mut line)?;
            let size = usize::from_str_radix(line.trim(), 16).unwrap_or(0);
            let mut data = vec![0; size + 2];
            r.read_exact(&mut data)?;
            if size == 0 {
                break;
            }
            out.extend_from_slice(&data[..size]);
        }
    } else if let Some(n) = length {
        out.resize(n, 0);
        r.read_exact(&mut out)?;
    } else {
        r.read_to_end(&mut out)?;
    }
    Ok((status, String::from_utf8_lossy(&out).into_owned()))
}
