//! Issue 10, "where a model is loaded" and "what a model is" (`/api/show`), end to end: the real server and worker binaries
//! with fake Ollama and llama-server router backends whose loaded sets the tests change.
//! What the worker detected and reports is read from the server's `/admin/workers`;
//! where a request ran, from each fake backend's own request counter.
//!
//! Nothing sleeps to synchronise: every step waits for `/admin/workers` (or a counter) to
//! show what it needs, with a deadline.

mod common;
#[path = "../examples/support/fake_backend.rs"]
mod fake_backend;

use std::net::SocketAddr;
use std::sync::atomic::Ordering;

use common::procs::{start_worker, Proc, ServerProc};
use common::{chat, post, request, wait_until, Response};
use fake_backend::{
    FakeBackend, LoadedSet, OLLAMA_CAPABILITIES, OLLAMA_CONTEXT_LENGTH, ROUTER_N_CTX,
};
use serde_json::{json, Value};

const ADMIN: &str = "residency-admin-token";
const ANSWER: &str = "one two three";
/// Long enough that only a re-check after a request (or an admin refresh) can update the
/// loaded set within a test.
const NEVER: &str = "3600";

fn start_server() -> ServerProc {
    // Never created: the key store finds no file and starts empty.
    let state = std::env::temp_dir().join(format!(
        "modelrelay-residency-{}-{}",
        std::process::id(),
        std::thread::current()
            .name()
            .unwrap_or("t")
            .replace("::", "-")
    ));
    let state = state.to_string_lossy().into_owned();
    ServerProc::start(&[
        ("MODELRELAY_ADMIN_TOKEN", ADMIN),
        ("STATE_DIR", state.as_str()),
    ])
}

fn admin(server: &ServerProc, method: &str, path: &str) -> Response {
    let auth = format!("Bearer {ADMIN}");
    request(server.addr, method, path, None, &[("authorization", &auth)])
}

fn workers(server: &ServerProc) -> Vec<Value> {
    let r = admin(server, "GET", "/admin/workers");
    assert_eq!(r.status, 200, "/admin/workers: {}", r.text());
    r.json()["workers"].as_array().cloned().unwrap_or_default()
}

/// A worker's name and what its `/admin/workers` entry must satisfy.
type Check<'a> = (&'a str, &'a dyn Fn(&Value) -> bool);

/// Waits until every check holds in one `/admin/workers` answer.
fn wait_workers(server: &ServerProc, what: &str, checks: &[Check]) {
    wait_until(what, || {
        let list = workers(server);
        let ok = checks
            .iter()
            .all(|(name, check)| list.iter().find(|w| w["name"] == *name).is_some_and(check));
        (ok, format!("/admin/workers: {list:#?}"))
    });
}

fn loaded_is(expected: Value) -> impl Fn(&Value) -> bool {
    move |w: &Value| w["loaded_models"] == expected
}

/// A fake backend on an ephemeral port: its address, the fake (for its counters) and
/// its loaded set.
fn spawn(backend: FakeBackend) -> (SocketAddr, FakeBackend, LoadedSet) {
    let addr = backend.clone().spawn("127.0.0.1:0").expect("backend");
    let loaded = backend.loaded();
    (addr, backend, loaded)
}

fn worker(server: &ServerProc, backend: SocketAddr, name: &str, extra: &[(&str, &str)]) -> Proc {
    let mut env = vec![("WORKER_NAME", name)];
    env.extend_from_slice(extra);
    start_worker(server.addr, backend, &env)
}

fn requests(b: &FakeBackend) -> usize {
    b.stats.requests.load(Ordering::SeqCst)
}

fn ask(server: &ServerProc, model: &str) {
    let r = post(server.addr, "/v1/chat/completions", &chat(model, false));
    assert_eq!(r.status, 200, "request for {model}: {}", r.text());
}

fn set(loaded: &LoadedSet, models: &[&str]) {
    *loaded.lock() = models.iter().map(|m| m.to_string()).collect();
}

#[test]
fn a_request_goes_where_its_model_is_loaded_and_follows_it_when_it_moves() {
    let server = start_server();
    let (addr1, b1, loaded1) = spawn(FakeBackend::ollama(&["a", "b"], &["a"], ANSWER));
    let (addr2, b2, loaded2) = spawn(FakeBackend::ollama(&["a", "b"], &[], ANSWER));
    let _w1 = worker(&server, addr1, "w1", &[("MODELS_REFRESH_SECS", NEVER)]);
    let _w2 = worker(&server, addr2, "w2", &[("MODELS_REFRESH_SECS", NEVER)]);
    let ollama = |w: &Value| w["backend_kind"] == "ollama" && w["models"] == json!(["a", "b"]);
    wait_workers(
        &server,
        "both workers registered as Ollama, `a` loaded on w1",
        &[
            ("w1", &|w: &Value| {
                ollama(w) && w["loaded_models"] == json!(["a"])
            }),
            ("w2", &|w: &Value| {
                ollama(w) && w["loaded_models"] == json!([])
            }),
        ],
    );

    // Both idle: without residency these would alternate between the two.
    for _ in 0..4 {
        ask(&server, "a");
    }
    assert_eq!((requests(&b1), requests(&b2)), (4, 0), "all on backend 1");

    // `a` moves from backend 1 to backend 2.
    set(&loaded1, &[]);
    set(&loaded2, &["a"]);
    let r = admin(&server, "POST", "/admin/models/refresh");
    assert_eq!(r.status, 202, "{}", r.text());
    wait_workers(
        &server,
        "`a` loaded on w2 only",
        &[
            ("w1", &loaded_is(json!([]))),
            ("w2", &loaded_is(json!(["a"]))),
        ],
    );
    for _ in 0..4 {
        ask(&server, "a");
    }
    assert_eq!(
        (requests(&b1), requests(&b2)),
        (4, 4),
        "the next ones on backend 2"
    );

    // `b` is loaded nowhere: it runs somewhere, that backend loads it, and its worker
    // re-checks right after the answer (the periodic refresh is an hour away).
    ask(&server, "b");
    let (on, b_now) = if requests(&b1) == 5 {
        ("w1", json!(["b"]))
    } else {
        assert_eq!(requests(&b2), 5, "`b` ran on neither backend");
        ("w2", json!(["a", "b"]))
    };
    wait_workers(
        &server,
        "`b` reported loaded where it ran",
        &[(on, &loaded_is(b_now))],
    );
    let before = (requests(&b1), requests(&b2));
    ask(&server, "b");
    let after = (requests(&b1), requests(&b2));
    let expected = if on == "w1" {
        (before.0 + 1, before.1)
    } else {
        (before.0, before.1 + 1)
    };
    assert_eq!(after, expected, "the next `b` goes where it is loaded");
}

#[test]
fn with_a_fixed_model_list_the_loaded_set_is_reread_periodically() {
    let server = start_server();
    let (addr, _b, loaded) = spawn(FakeBackend::ollama(&["a", "b"], &[], ANSWER));
    let _w = worker(
        &server,
        addr,
        "fixed",
        &[("MODELS", "a,b,c"), ("MODELS_REFRESH_SECS", "1")],
    );
    wait_workers(
        &server,
        "registered with nothing loaded",
        &[("fixed", &|w: &Value| {
            w["backend_kind"] == "ollama"
                && w["models"] == json!(["a", "b", "c"])
                && w["loaded_models"] == json!([])
        })],
    );
    // Loaded behind the relay's back (another client, `ollama run`): seen by the
    // periodic refresh alone.
    set(&loaded, &["b"]);
    wait_workers(
        &server,
        "`b` loaded",
        &[("fixed", &loaded_is(json!(["b"])))],
    );
    set(&loaded, &[]);
    wait_workers(&server, "`b` unloaded", &[("fixed", &loaded_is(json!([])))]);
}

#[test]
fn a_llama_server_router_reports_the_models_whose_status_is_loaded() {
    let server = start_server();
    let (addr, b, _loaded) = spawn(FakeBackend::llama_router(&["x", "y"], &["y"], ANSWER));
    let _w = worker(&server, addr, "llama", &[("MODELS_REFRESH_SECS", NEVER)]);
    wait_workers(
        &server,
        "a llama-server router with `y` loaded",
        &[("llama", &|w: &Value| {
            w["backend_kind"] == "llama-server"
                && w["models"] == json!(["x", "y"])
                && w["loaded_models"] == json!(["y"])
                // The loaded model is described (asked by name), the other not yet.
                && w["model_info"]["y"]["context_length"] == ROUTER_N_CTX
                && w["model_info"]["x"].is_null()
        })],
    );
    // `/v1/capabilities` lists it loaded, with its context.
    let caps = request(server.addr, "GET", "/v1/capabilities", None, &[]).json();
    let runner = &caps["runners"][0];
    assert_eq!(runner["models"]["loaded"][0]["id"], "y", "{caps:#}");
    assert_eq!(
        runner["models"]["loaded"][0]["contextLength"], ROUTER_N_CTX,
        "{caps:#}"
    );
    ask(&server, "x");
    assert_eq!(requests(&b), 1);
    wait_workers(
        &server,
        "`x` loaded by the request, re-checked and described after it",
        &[("llama", &|w: &Value| {
            loaded_is(json!(["x", "y"]))(w)
                && w["model_info"]["x"]["context_length"] == ROUTER_N_CTX
        })],
    );
}

#[test]
fn a_plain_openai_backend_reports_no_loaded_models() {
    let server = start_server();
    let (addr, _b, _) = spawn(FakeBackend::new("m", ANSWER));
    let _w = worker(&server, addr, "plain", &[]);
    wait_workers(
        &server,
        "an openai backend, loaded models unknown",
        &[("plain", &|w: &Value| {
            w["backend_kind"] == "openai"
                && w["models"] == json!(["m"])
                && w["loaded_models"].is_null()
                && w["model_info"].is_null()
        })],
    );
    ask(&server, "m");
}

#[test]
fn backend_kind_set_by_the_operator_skips_detection() {
    let server = start_server();
    // An Ollama the operator calls plain `openai`: nothing is probed or reported.
    let (addr, _b, _) = spawn(FakeBackend::ollama(&["a"], &["a"], ANSWER));
    let _w = worker(&server, addr, "told", &[("BACKEND_KIND", "openai")]);
    wait_workers(
        &server,
        "the operator's kind, loaded models unknown",
        &[("told", &|w: &Value| {
            w["backend_kind"] == "openai" && w["loaded_models"].is_null()
        })],
    );
}

fn show(server: &ServerProc, model: &str) -> Response {
    let body = json!({ "model": model }).to_string();
    request(server.addr, "POST", "/api/show", Some(&body), &[])
}

#[test]
fn api_show_answers_with_what_the_backend_says_of_the_model() {
    let server = start_server();
    let (addr, b, _) = spawn(FakeBackend::ollama(&["a", "b"], &["a"], ANSWER));
    let _w = worker(
        &server,
        addr,
        "described",
        &[("MODELS_REFRESH_SECS", NEVER)],
    );
    let described = json!({
        "context_length": OLLAMA_CONTEXT_LENGTH,
        "capabilities": OLLAMA_CAPABILITIES,
    });
    wait_workers(
        &server,
        "both models described by the backend's /api/show",
        &[("described", &|w: &Value| {
            w["model_info"] == json!({ "a": described, "b": described })
        })],
    );
    for model in ["a", "b"] {
        let r = show(&server, model);
        assert_eq!(r.status, 200, "/api/show {model}: {}", r.text());
        let v = r.json();
        assert_eq!(v["capabilities"], json!(OLLAMA_CAPABILITIES), "{v:#}");
        assert_eq!(
            v["model_info"]["general.context_length"],
            json!(OLLAMA_CONTEXT_LENGTH),
            "{v:#}"
        );
    }
    assert_eq!(show(&server, "zzz").status, 404);
    assert_eq!(requests(&b), 0, "describing models is no inference request");
}
