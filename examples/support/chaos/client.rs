//! The chaos clients: what each request asks for (drawn from the seed), sending it over
//! a raw socket, reading the answer the way it was asked to (whole, slowly, or hanging up
//! part way), and judging what came back against the fake backend's checksum.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use serde_json::json;

use super::rng::Rng;
use crate::fake_backend::chaos::{Fault, Spec};

/// The API a request uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Route {
    Chat,
    Messages,
    OllamaChat,
    OllamaGenerate,
}

impl Route {
    pub const ALL: [Route; 4] = [
        Route::Chat,
        Route::Messages,
        Route::OllamaChat,
        Route::OllamaGenerate,
    ];

    pub fn path(self) -> &'static str {
        match self {
            Route::Chat => "/v1/chat/completions",
            Route::Messages => "/v1/messages",
            Route::OllamaChat => "/api/chat",
            Route::OllamaGenerate => "/api/generate",
        }
    }
}

/// What the client itself does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Act {
    /// Reads the whole answer.
    Normal,
    /// Hangs up this long after sending, unless the answer ended before.
    CancelAfter(Duration),
    /// Hangs up after this many bytes of body.
    CancelAfterBytes(usize),
    /// Reads in small pieces with pauses.
    Slow,
}

/// One request, fully determined by the seed and its index.
#[derive(Debug, Clone)]
pub struct Plan {
    pub route: Route,
    pub stream: bool,
    pub spec: Spec,
    pub act: Act,
    pub tenant: u64,
}

/// What happened to one request, from the client's side.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Kind {
    /// The whole answer, proven by its checksum.
    Complete,
    /// An error answer before any of the answer: status and code.
    Error(u16, String),
    /// A stream ended by one whole error event after a clean prefix: its code.
    StreamError(String),
    /// The client hung up on purpose.
    Cancelled,
    /// The server did not accept the connection (only while it restarts).
    Refused,
    /// The connection ended without a whole response (only when the server is killed).
    Lost,
    /// Broken: spliced, truncated, duplicated, malformed, overdue or unexpected.
    Violation(&'static str),
}

#[derive(Debug, Clone)]
pub struct Outcome {
    pub kind: Kind,
    pub detail: String,
    pub elapsed: Duration,
    pub request_id: Option<String>,
}

/// How faulty the mix is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mix {
    /// Backend faults, client hang-ups and slow readers.
    Chaos,
    /// Clean requests only (traffic that must get through).
    Clean,
}

/// Draws request `index` of the run `seed`; `id` is its unique answer id.
pub fn plan(seed: u64, index: u64, id: u64, mix: Mix) -> Plan {
    let mut r = Rng::fork(seed, index);
    let route = Route::ALL[r.weighted(&[50, 16, 20, 14])];
    let stream = match route {
        Route::Chat | Route::Messages => r.chance(600),
        Route::OllamaChat | Route::OllamaGenerate => r.chance(700),
    };
    let words = match r.weighted(&[70, 20, 8, 2]) {
        0 => r.range(1, 40),
        1 => r.range(40, 300),
        2 => r.range(300, 1500),
        _ => r.range(3000, 6000),
    } as usize;
    let delay_ms = if r.chance(100) {
        r.range(100, 400)
    } else {
        r.range(0, 50)
    };
    let gap_ms = match r.weighted(&[70, 25, 5]) {
        0 => 0,
        1 => r.range(1, 5),
        _ => r.range(10, 30),
    }
    // A stream lasts at most about two seconds of gaps.
    .min(2000 / words as u64);
    let pieces = words + 1;
    let fault = if mix == Mix::Clean {
        Fault::None
    } else {
        match r.weighted(&[729, 60, 80, 40, 1]) {
            0 => Fault::None,
            1 => Fault::Status(
                *[400u16, 429, 500, 503]
                    .get(r.below(4) as usize)
                    .unwrap_or(&500),
            ),
            2 => Fault::Die(r.below(pieces as u64) as usize),
            3 => Fault::Hang(r.below(pieces as u64 + 1) as usize),
            _ => Fault::Reset,
        }
    };
    let act = if mix == Mix::Clean {
        Act::Normal
    } else {
        match r.weighted(&[800, 70, 60, 70]) {
            0 => Act::Normal,
            1 => Act::CancelAfter(Duration::from_millis(r.range(0, 500))),
            2 => Act::CancelAfterBytes(r.range(1, 4000) as usize),
            _ => Act::Slow,
        }
    };
    Plan {
        route,
        stream,
        spec: Spec {
            id,
            words,
            delay_ms,
            gap_ms,
            fault,
        },
        act,
        tenant: r.below(4),
    }
}

/// The request body for a plan.
pub fn body(plan: &Plan) -> String {
    let prompt = plan.spec.encode();
    let messages = json!([{"role": "user", "content": prompt}]);
    match plan.route {
        Route::Chat | Route::OllamaChat => {
            json!({"model": "chaos", "stream": plan.stream, "messages": messages})
        }
        Route::Messages => {
            json!({"model": "chaos", "max_tokens": 64, "stream": plan.stream, "messages": messages})
        }
        Route::OllamaGenerate => json!({"model": "chaos", "stream": plan.stream, "prompt": prompt}),
    }
    .to_string()
}

/// Why reading stopped early.
enum Stop {
    Eof,
    Overdue,
    Cancelled,
    Io(String),
}

/// A socket reader with the client's deadline and hang-up plan.
struct Reader {
    stream: TcpStream,
    buf: Vec<u8>,
    pos: usize,
    end: Instant,
    cancel_at: Option<Instant>,
    cancel_bytes: Option<usize>,
    slow: bool,
    /// Body bytes consumed so far (for the hang-up after N bytes).
    body: usize,
    in_body: bool,
}

impl Reader {
    fn fill(&mut self) -> Result<(), Stop> {
        if self.pos > 0 {
            self.buf.drain(..self.pos);
            self.pos = 0;
        }
        let mut tmp = [0u8; 16 * 1024];
        let want = if self.slow { 256 } else { tmp.len() };
        loop {
            let now = Instant::now();
            if now >= self.end {
                return Err(Stop::Overdue);
            }
            let mut limit = self.end - now;
            if let Some(at) = self.cancel_at {
                if now >= at {
                    return Err(Stop::Cancelled);
                }
                limit = limit.min(at - now);
            }
            let _ = self
                .stream
                .set_read_timeout(Some(limit.max(Duration::from_millis(1))));
            match self.stream.read(&mut tmp[..want]) {
                Ok(0) => return Err(Stop::Eof),
                Ok(n) => {
                    self.buf.extend_from_slice(&tmp[..n]);
                    if self.slow {
                        std::thread::sleep(Duration::from_millis(1));
                    }
                    return Ok(());
                }
                Err(e)
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                    ) => {}
                Err(e) => return Err(Stop::Io(e.to_string())),
            }
        }
    }

    fn line(&mut self) -> Result<String, Stop> {
        loop {
            if let Some(at) = self.buf[self.pos..].windows(2).position(|w| w == b"\r\n") {
                let line = String::from_utf8_lossy(&self.buf[self.pos..self.pos + at]).into_owned();
                self.consume(at + 2)?;
                return Ok(line);
            }
            if self.buf.len() - self.pos > 64 * 1024 {
                return Err(Stop::Io("line longer than 64 KiB".into()));
            }
            self.fill()?;
        }
    }

    fn exact(&mut self, n: usize) -> Result<Vec<u8>, Stop> {
        while self.buf.len() - self.pos < n {
            self.fill()?;
        }
        let out = self.buf[self.pos..self.pos + n].to_vec();
        self.consume(n)?;
        Ok(out)
    }

    fn consume(&mut self, n: usize) -> Result<(), Stop> {
        self.pos += n;
        if self.in_body {
            self.body += n;
            if self.cancel_bytes.is_some_and(|k| self.body >= k) {
                return Err(Stop::Cancelled);
            }
        }
        Ok(())
    }

    /// Everything until the peer closes.
    fn rest(&mut self) -> Result<Vec<u8>, Stop> {
        loop {
            match self.fill() {
                Ok(()) => {}
                Err(Stop::Eof) => {
                    let out = self.buf[self.pos..].to_vec();
                    self.pos = self.buf.len();
                    return Ok(out);
                }
                Err(e) => return Err(e),
            }
        }
    }
}

/// Sends one request on a fresh connection and judges the answer.
pub fn execute(addr: SocketAddr, plan: &Plan, timeout: Duration) -> Outcome {
    let started = Instant::now();
    let mut out = Outcome {
        kind: Kind::Lost,
        detail: String::new(),
        elapsed: Duration::ZERO,
        request_id: None,
    };
    let (kind, detail) = run(addr, plan, started + timeout, &mut out.request_id);
    out.kind = kind;
    out.detail = detail;
    out.elapsed = started.elapsed();
    out
}

fn run(
    addr: SocketAddr,
    plan: &Plan,
    end: Instant,
    request_id: &mut Option<String>,
) -> (Kind, String) {
    let mut stream = match TcpStream::connect_timeout(&addr, Duration::from_secs(5)) {
        Ok(s) => s,
        Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => {
            return (Kind::Refused, e.to_string())
        }
        Err(e) => return (Kind::Lost, format!("connect: {e}")),
    };
    let body = body(plan);
    let head = format!(
        "POST {} HTTP/1.1\r\nhost: localhost\r\ncontent-type: application/json\r\nx-tenant-id: t{}\r\nconnection: close\r\ncontent-length: {}\r\n\r\n",
        plan.route.path(),
        plan.tenant,
        body.len()
    );
    let mut request = head.into_bytes();
    request.extend_from_slice(body.as_bytes());
    if let Err(e) = stream.write_all(&request) {
        return (Kind::Lost, format!("write: {e}"));
    }
    let now = Instant::now();
    let mut r = Reader {
        stream,
        buf: Vec::new(),
        pos: 0,
        end,
        cancel_at: match plan.act {
            Act::CancelAfter(d) => Some(now + d),
            _ => None,
        },
        cancel_bytes: match plan.act {
            Act::CancelAfterBytes(k) => Some(k),
            _ => None,
        },
        slow: plan.act == Act::Slow,
        body: 0,
        in_body: false,
    };
    match read_response(&mut r, request_id) {
        Ok((_, _, _, Some(extra))) => (Kind::Violation("duplicated"), extra),
        Ok((status, ctype, body, None)) => super::judge::judge(plan, status, &ctype, &body),
        Err((Stop::Cancelled, _)) => (Kind::Cancelled, String::new()),
        Err((Stop::Overdue, what)) => (
            Kind::Violation("overdue"),
            format!("client timeout reached while reading {what}"),
        ),
        Err((Stop::Eof, what)) => (Kind::Lost, format!("connection closed in {what}")),
        Err((Stop::Io(e), what)) => (Kind::Lost, format!("{e} in {what}")),
    }
}

/// Status, content type, body, and what followed the response (it must be nothing).
type Read4 = (u16, String, Vec<u8>, Option<String>);

fn read_response(
    r: &mut Reader,
    request_id: &mut Option<String>,
) -> Result<Read4, (Stop, &'static str)> {
    let status_line = r.line().map_err(|e| (e, "the status line"))?;
    let status: u16 = status_line
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or((Stop::Io(format!("bad status line {status_line:?}")), "head"))?;
    let (mut chunked, mut length, mut ctype) = (false, None, String::new());
    loop {
        let line = r.line().map_err(|e| (e, "the head"))?;
        if line.is_empty() {
            break;
        }
        let Some((name, value)) = line.split_once(':') else {
            return Err((Stop::Io(format!("bad header {line:?}")), "the head"));
        };
        let (name, value) = (name.trim().to_ascii_lowercase(), value.trim());
        match name.as_str() {
            "transfer-encoding" => chunked = value.contains("chunked"),
            "content-length" => length = value.parse::<usize>().ok(),
            "content-type" => ctype = value.to_string(),
            "x-request-id" => *request_id = Some(value.to_string()),
            _ => {}
        }
    }
    r.in_body = true;
    let body = if chunked {
        let mut body = Vec::new();
        loop {
            let size = r.line().map_err(|e| (e, "a chunk size"))?;
            let size = usize::from_str_radix(size.trim(), 16)
                .map_err(|_| (Stop::Io(format!("bad chunk size {size:?}")), "the body"))?;
            if size == 0 {
                r.line().map_err(|e| (e, "the body's end"))?;
                break;
            }
            let data = r.exact(size + 2).map_err(|e| (e, "a chunk"))?;
            body.extend_from_slice(&data[..size]);
        }
        body
    } else if let Some(n) = length {
        r.exact(n).map_err(|e| (e, "the body"))?
    } else {
        r.rest().map_err(|e| (e, "the body"))?
    };
    // `connection: close`: after one response the server must close, with nothing more.
    r.cancel_bytes = None;
    let extra = r.rest().map_err(|e| (e, "the close after the response"))?;
    let extra = (!extra.is_empty()).then(|| {
        let text = String::from_utf8_lossy(&extra[..extra.len().min(120)]).into_owned();
        format!("{} bytes after the response: {text:?}", extra.len())
    });
    Ok((status, ctype, body, extra))
}
