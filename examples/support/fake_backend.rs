//! A tiny OpenAI-compatible backend on std only: thread per connection, keep-alive,
//! deterministic answers. Used by `make run` (demo backend), the benchmark and tests.
//!
//! * `GET /v1/models` lists [`FakeBackend::model`].
//! * `POST /v1/...` answers a chat completion; with `"stream": true` it streams one SSE
//!   event per word of the answer (chunked encoding, no pauses) and `data: [DONE]`; with
//!   `"stream_options":{"include_usage":true}` also a usage-only event (`"choices":[]`)
//!   just before `[DONE]`, as llama-server and vLLM do.
//! * Tests pick other behaviour with a `"scenario"` field in the body; see [`Scenario`].
//! * [`FakeBackend::spawn_stoppable`] serves until [`Running::stop`], which closes the
//!   listener and every open connection (a backend that died); [`FakeBackend::resetting`]
//!   makes every connection end in a TCP reset instead of an answer.
//! * Backend-wide behaviour, whatever the body says: [`FakeBackend::always_status`] (a
//!   wedged backend answering every POST with one status) and [`FakeBackend::answer_delay`]
//!   (a pause before every POST answer, like generation time). Both are off by default.
//! * Flavours beyond plain OpenAI (see `fake_flavours.rs`): [`FakeBackend::ollama`],
//!   [`FakeBackend::llama_router`] and [`FakeBackend::vllm`], with the routes that say what
//!   is loaded (issue 10) and those that load, unload and flush (issue 12). Each holds a
//!   loaded set the test reads or changes through [`FakeBackend::loaded`]; a POST for a
//!   listed model loads it, as the real ones do. [`FakeBackend::failing`] makes one path
//!   answer an error.
//! * [`FakeBackend::with_prompt_cache`]: whole chat answers report the prompt tokens it
//!   could reuse from earlier requests (see `prompt_cache.rs`).
#![allow(dead_code)]

#[path = "prompt_cache.rs"]
mod prompt_cache;
pub use prompt_cache::PromptCache;

use std::io::{BufReader, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

#[path = "fake_active.rs"]
mod active;
#[path = "fake_chaos.rs"]
pub mod chaos;
#[path = "fake_flavours.rs"]
mod flavours;
#[path = "fake_wire.rs"]
mod wire;
#[allow(unused_imports)]
pub use flavours::{FAKE_BUILD, FAKE_KV_USAGE, FAKE_VERSION, ROUTER_N_CTX, ROUTER_SLOTS};
use wire::*;

/// What the backend observed, for tests.
#[derive(Debug)]
pub enum Observed {
    /// A request arrived: path and body.
    Request(String, String),
    /// A `hang`/`drip` stream saw its client close the connection, this long after the
    /// stream began.
    ClientClosed(Duration),
}

#[derive(Default, Debug)]
pub struct Stats {
    /// Requests being answered whose client is still there (see `fake_active.rs`).
    pub active: AtomicUsize,
    pub max_active: AtomicUsize,
    counted: active::Active,
    pub requests: AtomicUsize,
    /// Set by [`FakeBackend::release`]: `hold` requests answer from then on.
    pub released: AtomicBool,
}

/// The context length a fake Ollama's `POST /api/show` reports for each of its models.
pub const OLLAMA_CONTEXT_LENGTH: u64 = 8192;
/// The capabilities a fake Ollama's `POST /api/show` reports for each of its models.
pub const OLLAMA_CAPABILITIES: &[&str] = &["completion", "tools"];

/// Which backend a fake imitates beyond the OpenAI routes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Flavour {
    /// Only the OpenAI routes (the default).
    OpenAi,
    /// Ollama: `/api/version`, `/api/tags`, `/api/ps` (names as `name:latest`).
    Ollama,
    /// llama-server in router mode: `/props` of a router, `/models` with a status each.
    LlamaRouter,
    /// vLLM: `/v1/models` owned by `vllm`, `/version`, sleep and wake.
    Vllm,
}

/// The models a flavoured fake holds in memory: change it to "load" or "unload" one.
pub type LoadedSet = Arc<parking_lot::Mutex<Vec<String>>>;

#[derive(Clone)]
pub struct FakeBackend {
    pub model: String,
    /// Every model `/v1/models` lists (just [`Self::model`] unless flavoured).
    pub models: Vec<String>,
    flavour: Flavour,
    loaded: LoadedSet,
    /// Words of the answer; one SSE event each when streaming.
    pub words: Vec<String>,
    pub stats: Arc<Stats>,
    observer: Option<crossbeam_channel::Sender<Observed>>,
    /// Reset every connection once the client sent something (see [`Self::resetting`]).
    reset: bool,
    /// Answer every POST with this status (see [`Self::always_status`]).
    status: Option<u16>,
    /// Pause before answering every POST (see [`Self::answer_delay`]).
    delay: Option<Duration>,
    /// Router models asked to load, not yet seen `loaded`.
    loading: LoadedSet,
    /// Models an Ollama can pull ([`Self::pullable`]), and those it pulled.
    pullable: Vec<String>,
    pulled: LoadedSet,
    /// Paths that answer an error status ([`Self::failing`]).
    failing: Vec<(String, u16)>,
    /// vLLM: dev-mode routes exist (see [`Self::without_dev_mode`]); asleep.
    dev_mode: bool,
    sleeping: Arc<AtomicBool>,
    /// Reports cache reuse (see [`Self::with_prompt_cache`]).
    pub cache: Option<Arc<PromptCache>>,
}

/// A backend started by [`FakeBackend::spawn_stoppable`].
pub struct Running {
    pub addr: SocketAddr,
    stopping: Arc<AtomicBool>,
    open: Arc<parking_lot::Mutex<Vec<(usize, TcpStream)>>>,
    acceptor: Option<std::thread::JoinHandle<()>>,
}

impl Running {
    /// Stops like a crashed process: once this returns, connects to `addr` are refused
    /// and every connection that was open is closed.
    pub fn stop(mut self) {
        self.stopping.store(true, Ordering::SeqCst);
        // Wakes the blocking accept; the acceptor then drops the listener.
        let _ = TcpStream::connect(self.addr);
        if let Some(acceptor) = self.acceptor.take() {
            let _ = acceptor.join();
        }
        for (_, conn) in self.open.lock().drain(..) {
            let _ = conn.shutdown(Shutdown::Both);
        }
    }
}

/// Test behaviours, selected by `"scenario":"..."` in the request body.
#[derive(Debug, PartialEq)]
enum Scenario {
    Normal,
    /// Answer with this status and a JSON error body (streaming or not).
    Status(u16),
    /// Stream text whose multi-byte characters are split across TCP writes.
    SplitUtf8,
    /// A non-streaming body of this many bytes.
    Big(usize),
    /// A non-streaming `text/plain` body of this many control bytes (0x01): six times
    /// its size once escaped into a JSON string.
    Control(usize),
    /// Stream one event, then wait for the client to close.
    Hang,
    /// Stream an event every 20 ms until the client closes.
    Drip,
    /// Wait this long before answering (normal answer).
    Delay(u64),
    /// Wait until [`FakeBackend::release`] is called (at most 10 s), then answer
    /// normally: a request stays in flight until the test has seen what it needs.
    Hold,
    /// Stream normally, then close the connection although keep-alive was implied
    /// (what llama-server does).
    CloseAfter,
    /// Stream normally, but in pieces of [`SPLIT_PIECE`] bytes with pauses: events (and
    /// their blank-line ends) are cut across reads.
    SplitEvents,
    /// One line that never ends: 64 KiB pieces of `x` (after `data: ` when streaming)
    /// until the client closes.
    Endless,
    /// Whole 16 KiB events as fast as the reader takes them, until the client closes.
    Flood,
}

/// The piece size of the `split-events` scenario.
const SPLIT_PIECE: usize = 13;

fn scenario(body: &str) -> Scenario {
    let Some(start) = body.find("\"scenario\":\"") else {
        return Scenario::Normal;
    };
    let rest = &body[start + 12..];
    let name = &rest[..rest.find('"').unwrap_or(0)];
    let (kind, arg) = name.split_once(':').unwrap_or((name, ""));
    match kind {
        "status" => Scenario::Status(arg.parse().unwrap_or(500)),
        "split-utf8" => Scenario::SplitUtf8,
        "big" => Scenario::Big(arg.parse().unwrap_or(1 << 20)),
        "control" => Scenario::Control(arg.parse().unwrap_or(1 << 20)),
        "hang" => Scenario::Hang,
        "drip" => Scenario::Drip,
        "delay" => Scenario::Delay(arg.parse().unwrap_or(100)),
        "hold" => Scenario::Hold,
        "close-after" => Scenario::CloseAfter,
        "split-events" => Scenario::SplitEvents,
        "endless" => Scenario::Endless,
        "flood" => Scenario::Flood,
        _ => Scenario::Normal,
    }
}

impl FakeBackend {
    pub fn new(model: &str, answer: &str) -> FakeBackend {
        FakeBackend {
            model: model.to_string(),
            models: vec![model.to_string()],
            flavour: Flavour::OpenAi,
            loaded: LoadedSet::default(),
            words: answer.split_inclusive(' ').map(String::from).collect(),
            stats: Arc::new(Stats::default()),
            observer: None,
            reset: false,
            status: None,
            delay: None,
            loading: LoadedSet::default(),
            pullable: Vec::new(),
            pulled: LoadedSet::default(),
            failing: Vec::new(),
            dev_mode: true,
            sleeping: Arc::default(),
            cache: None,
        }
    }

    /// An Ollama serving `models`, with `loaded` in memory.
    pub fn ollama(models: &[&str], loaded: &[&str], answer: &str) -> FakeBackend {
        FakeBackend::flavour(Flavour::Ollama, models, loaded, answer)
    }

    /// A llama-server router serving `models`, with `loaded` in memory.
    pub fn llama_router(models: &[&str], loaded: &[&str], answer: &str) -> FakeBackend {
        FakeBackend::flavour(Flavour::LlamaRouter, models, loaded, answer)
    }

    /// A vLLM serving `model` (awake), with its dev-mode routes.
    pub fn vllm(model: &str, answer: &str) -> FakeBackend {
        FakeBackend::flavour(Flavour::Vllm, &[model], &[model], answer)
    }

    /// An Ollama that can pull `models` (it lists them once pulled).
    pub fn pullable(mut self, models: &[&str]) -> FakeBackend {
        self.pullable = models.iter().map(|m| m.to_string()).collect();
        self
    }

    /// `path` (without query) answers `status` with a JSON error, whatever the flavour.
    pub fn failing(mut self, path: &str, status: u16) -> FakeBackend {
        self.failing.push((path.to_string(), status));
        self
    }

    /// A vLLM started without `VLLM_SERVER_DEV_MODE=1`: no sleep, wake or cache routes.
    pub fn without_dev_mode(mut self) -> FakeBackend {
        self.dev_mode = false;
        self
    }

    fn flavour(flavour: Flavour, models: &[&str], loaded: &[&str], answer: &str) -> FakeBackend {
        let mut b = FakeBackend::new(models.first().copied().unwrap_or("m"), answer);
        b.models = models.iter().map(|m| m.to_string()).collect();
        b.flavour = flavour;
        *b.loaded.lock() = loaded.iter().map(|m| m.to_string()).collect();
        b
    }

    /// The loaded set (shared with every clone and the running backend).
    pub fn loaded(&self) -> LoadedSet {
        self.loaded.clone()
    }

    /// Answers every POST with `status` and a JSON error body, whatever its scenario: a
    /// backend that is up but fails everything (a wedged GPU). `GET /v1/models` still works.
    pub fn always_status(mut self, status: u16) -> FakeBackend {
        self.status = Some(status);
        self
    }

    /// Waits `delay` before answering every POST (streaming or not), like a model
    /// generating; added to a `delay:N` scenario.
    pub fn answer_delay(mut self, delay: Duration) -> FakeBackend {
        self.delay = Some(delay);
        self
    }

    /// Accepts connections, then resets each one (closing with the request unread makes
    /// the kernel send RST) without answering: a backend crashing on every request.
    pub fn resetting(mut self) -> FakeBackend {
        self.reset = true;
        self
    }

    /// Lets every held (`"scenario":"hold"`) request answer, now and from then on.
    pub fn release(&self) {
        self.stats.released.store(true, Ordering::SeqCst);
    }

    /// Reports requests and closed connections on the returned channel.
    pub fn observed(mut self) -> (FakeBackend, crossbeam_channel::Receiver<Observed>) {
        let (tx, rx) = crossbeam_channel::unbounded();
        self.observer = Some(tx);
        (self, rx)
    }

    /// Binds `addr` and serves forever on background threads.
    pub fn spawn(self, addr: &str) -> std::io::Result<SocketAddr> {
        let listener = TcpListener::bind(addr)?;
        let local = listener.local_addr()?;
        let backend = Arc::new(self);
        std::thread::spawn(move || {
            for stream in listener.incoming().flatten() {
                let backend = backend.clone();
                std::thread::spawn(move || backend.serve(stream));
            }
        });
        Ok(local)
    }

    /// Binds `addr` and serves on background threads until [`Running::stop`].
    pub fn spawn_stoppable(self, addr: &str) -> std::io::Result<Running> {
        let listener = TcpListener::bind(addr)?;
        let local = listener.local_addr()?;
        let backend = Arc::new(self);
        let stopping = Arc::new(AtomicBool::new(false));
        let open = Arc::new(parking_lot::Mutex::new(Vec::new()));
        let (stop, conns) = (stopping.clone(), open.clone());
        let acceptor = std::thread::spawn(move || {
            for (n, stream) in listener.incoming().flatten().enumerate() {
                if stop.load(Ordering::SeqCst) {
                    return;
                }
                // A resetting backend must hold no second handle: the reset needs the
                // last one closed.
                if !backend.reset {
                    if let Ok(clone) = stream.try_clone() {
                        conns.lock().push((n, clone));
                    }
                }
                let (backend, conns) = (backend.clone(), conns.clone());
                std::thread::spawn(move || {
                    backend.serve(stream);
                    // Closed: its handle goes too (a long run must not pile them up).
                    conns.lock().retain(|(m, _)| *m != n);
                });
            }
        });
        Ok(Running {
            addr: local,
            stopping,
            open,
            acceptor: Some(acceptor),
        })
    }

    fn observe(&self, what: Observed) {
        if let Some(tx) = &self.observer {
            let _ = tx.send(what);
        }
    }

    fn serve(&self, stream: TcpStream) {
        if self.reset {
            // Wait for the request, leave it unread and close: the peer gets a reset.
            let _ = stream.peek(&mut [0u8; 1]);
            return;
        }
        let _ = stream.set_nodelay(true);
        let Ok(write_half) = stream.try_clone() else {
            return;
        };
        let mut out = write_half;
        let mut reader = BufReader::new(stream);
        loop {
            let Some((method, path, body)) = read_request(&mut reader) else {
                return;
            };
            let body = String::from_utf8_lossy(&body).into_owned();
            if let Some(keep_going) = self.flavoured(&mut out, &method, &path, &body) {
                if !keep_going {
                    return;
                }
                continue;
            }
            let flavour = self.flavour;
            let keep_going = match (method.as_str(), path.as_str()) {
                ("GET", "/v1/models") if flavour == Flavour::OpenAi => {
                    let body = format!(
                        r#"{{"object":"list","data":[{{"id":"{}","object":"model","owned_by":"demo"}}]}}"#,
                        self.model
                    );
                    respond(&mut out, 200, "application/json", body.as_bytes())
                }
                ("GET", "/health") => {
                    respond(&mut out, 200, "application/json", b"{\"status\":\"ok\"}")
                }
                ("POST", _) => {
                    self.observe(Observed::Request(path.clone(), body.clone()));
                    self.load_for(&body);
                    let s = &self.stats;
                    let me = s.counted.begin(&s.active, &s.max_active, &out);
                    s.requests.fetch_add(1, Ordering::SeqCst);
                    let ok = self.answer(&mut out, &mut reader, &body);
                    s.counted.end(&s.active, &me);
                    ok
                }
                _ => respond(
                    &mut out,
                    404,
                    "application/json",
                    b"{\"error\":\"not found\"}",
                ),
            };
            if !keep_going {
                return;
            }
        }
    }

    /// A flavoured backend loads the model a request names, as Ollama and a
    /// llama-server router do.
    fn load_for(&self, body: &str) {
        if self.flavour == Flavour::OpenAi {
            return;
        }
        let Some(model) = body_model(body) else {
            return;
        };
        let mut loaded = self.loaded.lock();
        if self.models.iter().any(|m| m == model) && !loaded.iter().any(|m| m == model) {
            loaded.push(model.to_string());
        }
    }

    /// Answers one POST; false when the connection should close.
    fn answer(&self, out: &mut TcpStream, reader: &mut BufReader<TcpStream>, body: &str) -> bool {
        let stream = is_stream(body.as_bytes());
        let usage = wants_usage(body);
        if let Some(delay) = self.delay {
            std::thread::sleep(delay);
        }
        if let (None, Some(spec)) = (self.status, chaos::Spec::find(body)) {
            return self.chaos(out, reader, &spec, stream, usage);
        }
        let chosen = match self.status {
            Some(code) => Scenario::Status(code),
            None => scenario(body),
        };
        match chosen {
            Scenario::Status(code) => {
                let err = format!(
                    r#"{{"error":{{"message":"scenario status {code}","type":"backend_error"}}}}"#
                );
                respond(out, code, "application/json", err.as_bytes())
            }
            Scenario::Big(n) => {
                let mut big = String::with_capacity(n + 16);
                big.push_str("{\"pad\":\"");
                big.extend(std::iter::repeat_n('x', n.saturating_sub(10)));
                big.push_str("\"}");
                respond(out, 200, "application/json", big.as_bytes())
            }
            Scenario::Control(n) => respond(out, 200, "text/plain", &vec![1u8; n]),
            Scenario::SplitUtf8 => {
                let text = "data: {\"content\":\"héllo wörld 🌍 ok\"}\n\n".as_bytes();
                if !start_stream(out) {
                    return false;
                }
                // Every piece ends inside a multi-byte character.
                for piece in [&text[..20], &text[20..27], &text[27..34], &text[34..]] {
                    if write_chunk(out, piece).is_err() {
                        return false;
                    }
                    std::thread::sleep(Duration::from_millis(15));
                }
                out.write_all(b"0\r\n\r\n").is_ok()
            }
            Scenario::Hang | Scenario::Drip => {
                let drip = chosen == Scenario::Drip;
                let began = Instant::now();
                if !start_stream(out) || write_chunk(out, b"data: {\"n\":0}\n\n").is_err() {
                    return false;
                }
                let closed = if drip {
                    drip_until_closed(out)
                } else {
                    wait_until_closed(reader)
                };
                if closed {
                    self.observe(Observed::ClientClosed(began.elapsed()));
                }
                false
            }
            Scenario::Delay(ms) => {
                std::thread::sleep(Duration::from_millis(ms));
                self.normal(out, stream, usage)
            }
            Scenario::Hold => {
                let deadline = Instant::now() + Duration::from_secs(10);
                while !self.stats.released.load(Ordering::SeqCst) && Instant::now() < deadline {
                    std::thread::sleep(Duration::from_millis(2));
                }
                self.normal(out, stream, usage)
            }
            Scenario::CloseAfter => {
                self.normal(out, true, usage);
                false
            }
            Scenario::Endless => {
                let began = Instant::now();
                if start_stream(out) {
                    let lead: &[u8] = if stream { b"data: " } else { b"{\"x\":\"" };
                    let piece = vec![b'x'; 64 * 1024];
                    let mut ok = write_chunk(out, lead).is_ok();
                    while ok {
                        ok = write_chunk(out, &piece).is_ok();
                    }
                    self.observe(Observed::ClientClosed(began.elapsed()));
                }
                false
            }
            Scenario::Flood => {
                let began = Instant::now();
                if start_stream(out) {
                    let event = format!("data: {{\"x\":\"{}\"}}\n\n", "x".repeat(16 * 1024));
                    while write_chunk(out, event.as_bytes()).is_ok() {}
                    self.observe(Observed::ClientClosed(began.elapsed()));
                }
                false
            }
            Scenario::SplitEvents if stream => self.stream_answer(out, usage, true),
            Scenario::Normal if !stream => match &self.cache {
                Some(cache) => {
                    let answer = cache.answer(&self.model, &self.words.concat(), body);
                    respond(out, 200, "application/json", answer.as_bytes())
                }
                None => self.normal(out, false, usage),
            },
            Scenario::SplitEvents | Scenario::Normal => self.normal(out, stream, usage),
        }
    }

    fn normal(&self, out: &mut TcpStream, stream: bool, usage: bool) -> bool {
        if stream {
            self.stream_answer(out, usage, false)
        } else {
            respond(out, 200, "application/json", self.completion().as_bytes())
        }
    }

    pub fn completion(&self) -> String {
        let text: String = self.words.concat();
        format!(
            r#"{{"id":"chatcmpl-demo","object":"chat.completion","model":"{}","choices":[{{"index":0,"message":{{"role":"assistant","content":{}}},"finish_reason":"stop"}}],"usage":{{"prompt_tokens":5,"completion_tokens":{},"total_tokens":{}}}}}"#,
            self.model,
            json_string(&text),
            self.words.len(),
            self.words.len() + 5
        )
    }

    /// The SSE body of a streamed answer, one event per element; the usage-only event
    /// (when `usage`) just before `data: [DONE]`.
    pub fn stream_events(&self, usage: bool) -> Vec<String> {
        let mut events: Vec<String> = self
            .words
            .iter()
            .map(|word| {
                format!(
                    "data: {{\"object\":\"chat.completion.chunk\",\"model\":\"{}\",\"choices\":[{{\"index\":0,\"delta\":{{\"content\":{}}}}}]}}\n\n",
                    self.model,
                    json_string(word)
                )
            })
            .collect();
        if usage {
            events.push(self.usage_event());
        }
        events.push("data: [DONE]\n\n".to_string());
        events
    }

    /// The usage-only event a stream ends with when the request asked for usage.
    pub fn usage_event(&self) -> String {
        format!(
            "data: {{\"choices\":[],\"usage\":{{\"prompt_tokens\":5,\"completion_tokens\":{},\"total_tokens\":{}}}}}\n\n",
            self.words.len(),
            self.words.len() + 5
        )
    }

    /// Streams [`Self::stream_events`]: one write per event, or (`split`) the whole body
    /// in small pieces with pauses, so events and their ends are cut across reads.
    fn stream_answer(&self, out: &mut TcpStream, usage: bool, split: bool) -> bool {
        if !start_stream(out) {
            return false;
        }
        let events = self.stream_events(usage);
        if split {
            let body = events.concat();
            for piece in body.as_bytes().chunks(SPLIT_PIECE) {
                if write_chunk(out, piece).is_err() {
                    return false;
                }
                std::thread::sleep(Duration::from_millis(3));
            }
        } else {
            for event in &events {
                if write_chunk(out, event.as_bytes()).is_err() {
                    return false;
                }
            }
        }
        out.write_all(b"0\r\n\r\n").is_ok()
    }
}
