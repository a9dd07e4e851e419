//! Streams that survive their relay: two real relays, one real worker connected to both
//! (`PROXY_URL` lists them), and a backend that lets its events out one at a time. A
//! client reads part of a resumable stream through relay A, relay A is killed with
//! SIGKILL, and the client resumes through relay B with `Last-Event-ID`: the worker kept
//! the stream, and every event arrives exactly once, in order, to the normal end.
//!
//! The same through HAProxy in front of both relays: the resume reaches the relay that
//! lives. Also: a stream nobody resumes is cancelled at the backend after the grace period; a
//! wrong token through relay B is refused; a worker serving one relay (which does not
//! list `held_streams`, like an original worker) cancels at once as before.
//!
//! Nothing sleeps to synchronise: the backend lets events out as the test reads, and
//! the test waits for the worker's log line saying it holds the stream.

#[path = "resume/backend.rs"]
mod backend;
// Shared with `resume.rs`, which uses all of it.
#[allow(dead_code)]
#[path = "resume/client.rs"]
mod client;
mod common;
#[path = "../examples/support/haproxy.rs"]
mod haproxy;

use std::time::{Duration, Instant};

use client::{word, Client, Rng};
use common::procs::{start_worker, Proc, ServerProc};
use common::*;

const EVENTS: usize = 30;
const HELD: &str = "relay lost; stream held for a resume";

/// Relay A, relay B and a worker connected to both (A first).
struct Pair {
    a: ServerProc,
    b: ServerProc,
    worker: Proc,
}

fn pair(backend: &backend::Backend, env: &[(&str, &str)]) -> Pair {
    let a = ServerProc::start(env);
    let b = ServerProc::start(env);
    let urls = format!("http://{},http://{}", a.addr, b.addr);
    let worker = start_worker(a.addr, backend.addr, &[("PROXY_URL", &urls)]);
    a.wait_workers(1);
    b.wait_workers(1);
    Pair { a, b, worker }
}

/// Starts a resumable chat through relay A and reads `n` events; returns the client,
/// the resume URL and the id of the last event read.
fn read_some(pair: &Pair, backend: &backend::Backend, n: usize) -> (Client, String, u64) {
    backend.gate.allow(n);
    let mut client = Client::chat(pair.a.addr, &[]);
    assert_eq!(client.status, 200);
    let url = client
        .header("x-resume-url")
        .expect("resume url")
        .to_string();
    let mut last = 0;
    for i in 1..=n {
        let got = client.next_event().expect("an event");
        assert_eq!(got.id, i as u64);
        assert_eq!(word(&got.data), Some(format!("w{i} ")));
        last = got.id;
    }
    (client, url, last)
}

/// Kills relay A (SIGKILL) and waits until the worker holds the stream.
fn kill_a(pair: &mut Pair) {
    kill(&mut pair.a, &pair.worker);
}

/// Kills `relay` (SIGKILL) and waits until `worker` holds the stream.
fn kill(relay: &mut ServerProc, worker: &Proc) {
    let _ = relay.proc.child.kill();
    let _ = relay.proc.child.wait();
    worker.wait_line(HELD);
}

/// Reads `resumed` on from the event after `last` to `[DONE]`: every id in order, each
/// event the backend's word of that number, and the answer's full length.
fn read_rest(resumed: &mut Client, last: u64) {
    let mut id = last;
    loop {
        let got = resumed.next_event().expect("the body goes on to [DONE]");
        assert_eq!(got.id, id + 1, "none lost or repeated");
        id = got.id;
        if got.data == "[DONE]" {
            break;
        }
        assert_eq!(word(&got.data), Some(format!("w{id} ")));
    }
    assert_eq!(id as usize, EVENTS + 1);
}

#[test]
fn a_stream_survives_its_relay_and_resumes_through_another_whole_and_once() {
    let backend = backend::start(EVENTS);
    let mut rng = Rng::seeded();
    for round in 0..3 {
        backend.gate.reset();
        let mut pair = pair(&backend, &[]);
        let read = 1 + rng.below(EVENTS - 2);
        let (client, url, last) = read_some(&pair, &backend, read);
        // The backend runs ahead of the client: events in flight when A dies; never its
        // end (EVENTS + 1), or the stream would be over before A dies and nothing held.
        backend.gate.allow((read + rng.below(4)).min(EVENTS));
        kill_a(&mut pair);
        drop(client);
        // After the death, more is generated into the worker's buffer.
        backend.gate.allow(read + 4);
        let mut resumed = Client::resume(pair.b.addr, &url, last, &[]);
        assert_eq!(resumed.status, 200, "round {round}: resumed after {last}");
        backend.gate.allow(EVENTS + 1);
        let mut words: Vec<String> = (1..=read).map(|n| format!("w{n} ")).collect();
        let mut id = last;
        loop {
            let got = resumed
                .next_event()
                .unwrap_or_else(|| panic!("round {round}: body ended before [DONE]"));
            assert_eq!(got.id, id + 1, "round {round}: ids in order, none skipped");
            id = got.id;
            if got.data == "[DONE]" {
                break;
            }
            words.extend(word(&got.data));
        }
        assert!(resumed.next_event().is_none(), "the body ends after [DONE]");
        let expected: Vec<String> = (1..=EVENTS).map(|n| format!("w{n} ")).collect();
        assert_eq!(words, expected, "round {round}: every word once, in order");
        // Nothing was cancelled at the backend.
        assert!(backend.cancels.try_recv().is_err());
    }
}

#[test]
fn a_stream_nobody_resumes_after_its_relay_died_is_cancelled_after_the_grace_period() {
    let backend = backend::start(EVENTS);
    let grace = Duration::from_secs(2);
    let mut pair = pair(&backend, &[("RESUME_GRACE_SECS", "2")]);
    let (_client, url, last) = read_some(&pair, &backend, 3);
    let killed = Instant::now();
    kill_a(&mut pair);
    let cancelled = backend
        .cancels
        .recv_timeout(grace + WAIT)
        .expect("the backend sees the cancel");
    assert!(
        cancelled.duration_since(killed) >= grace,
        "cancelled {:?} after the relay died, before the grace period",
        cancelled.duration_since(killed)
    );
    pair.worker.wait_line("nobody resumed within 2s; cancelled");
    let late = Client::resume(pair.b.addr, &url, last, &[]);
    assert_eq!(late.status, 404);
    assert_eq!(late.json()["error"]["code"], "stream_expired");
}

#[test]
fn a_wrong_token_through_the_other_relay_is_refused() {
    let backend = backend::start(EVENTS);
    let mut pair = pair(&backend, &[]);
    let (_client, url, last) = read_some(&pair, &backend, 3);
    kill_a(&mut pair);
    let (path, _) = url.split_once("?resume_token=").expect("token");
    let wrong = format!("{path}?resume_token=00112233445566778899aabbccddeeff");
    let refused = Client::resume(pair.b.addr, &wrong, last, &[]);
    assert_eq!(refused.status, 404);
    assert_eq!(refused.json()["error"]["code"], "stream_not_found");
    // The right one still works.
    let mut right = Client::resume(pair.b.addr, &url, last, &[]);
    assert_eq!(right.status, 200);
    backend.gate.allow(4);
    let got = right.next_event().expect("the next event");
    assert_eq!((got.id, word(&got.data)), (4, Some("w4 ".into())));
}

#[test]
fn a_worker_without_the_feature_cancels_at_once_when_its_relay_dies() {
    let backend = backend::start(EVENTS);
    // One relay: the worker does not list `held_streams` (nor would an original one).
    let relay = ServerProc::start(&[("RESUME_GRACE_SECS", "600")]);
    let worker = start_worker(relay.addr, backend.addr, &[]);
    relay.wait_workers(1);
    backend.gate.allow(3);
    let mut client = Client::chat(relay.addr, &[]);
    assert_eq!(client.status, 200);
    for _ in 0..3 {
        client.next_event().expect("an event");
    }
    let mut relay = relay;
    let _ = relay.proc.child.kill();
    let _ = relay.proc.child.wait();
    // Far before the grace period: today's behaviour, cancelled with its relay.
    backend
        .cancels
        .recv_timeout(WAIT)
        .expect("the backend sees the cancel at once");
    assert!(!worker.log().contains(HELD));
}

#[test]
fn with_its_relay_alive_a_stream_moves_to_the_relay_the_client_resumed_through() {
    let backend = backend::start(EVENTS);
    // Relay A gives its own copy up a second after its client left; the stream must
    // go on through B regardless.
    let pair = pair(&backend, &[("RESUME_GRACE_SECS", "1")]);
    let (client, url, last) = read_some(&pair, &backend, 5);
    client.drop_connection();
    pair.a.proc.wait_line("stream held for a resume");
    let mut resumed = Client::resume(pair.b.addr, &url, last, &[]);
    assert_eq!(resumed.status, 200);
    backend.gate.allow(8);
    for id in 6..=8 {
        let got = resumed.next_event().expect("an event");
        assert_eq!((got.id, word(&got.data)), (id, Some(format!("w{id} "))));
    }
    // A's grace period ends: it cancels its request, which the worker lets go of.
    pair.a.proc.wait_line("outcome=client_disconnect");
    pair.worker.wait_line("held stream detached");
    backend.gate.allow(EVENTS + 1);
    read_rest(&mut resumed, 8);
    assert!(backend.cancels.try_recv().is_err(), "never cancelled");
}

#[test]
fn through_haproxy_a_stream_survives_the_relay_it_went_through() {
    let Some(bin) = haproxy::binary_for_test() else {
        return;
    };
    let backend = backend::start(EVENTS);
    let mut pair = pair(&backend, &[]);
    let dir = std::env::temp_dir().join(format!("modelrelay-survive-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let layout = haproxy::Layout {
        front: std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("free port"),
        relays: vec![pair.a.addr, pair.b.addr],
        stats: dir.join("haproxy.sock"),
    };
    let _haproxy = Proc::haproxy(&bin, &layout.config(), &dir);
    wait_until("HAProxy sees both relays up", || {
        haproxy::all_up(&layout.stats, 2)
    });
    backend.gate.allow(4);
    let mut client = Client::chat(layout.front, &[]);
    assert_eq!(client.status, 200);
    let url = client.header("x-resume-url").expect("url").to_string();
    let went = client.header("x-relay").expect("x-relay").to_string();
    for id in 1..=4 {
        assert_eq!(client.next_event().expect("an event").id, id);
    }
    let victim = if went == "r1" {
        &mut pair.a
    } else {
        &mut pair.b
    };
    kill(victim, &pair.worker);
    wait_until("HAProxy sees the dead relay down", || {
        let s = haproxy::states(&layout.stats);
        (
            s.iter().any(|(n, st)| *n == went && st != "UP"),
            format!("{s:?}"),
        )
    });
    drop(client);
    let mut resumed = Client::resume(layout.front, &url, 4, &[]);
    assert_eq!(resumed.status, 200);
    assert_ne!(resumed.header("x-relay"), Some(went.as_str()));
    backend.gate.allow(EVENTS + 1);
    read_rest(&mut resumed, 4);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_client_that_drops_again_resumes_again_through_the_other_relay() {
    let backend = backend::start(EVENTS);
    let mut pair = pair(&backend, &[]);
    let (_client, url, last) = read_some(&pair, &backend, 3);
    kill_a(&mut pair);
    backend.gate.allow(6);
    let mut resumed = Client::resume(pair.b.addr, &url, last, &[]);
    assert_eq!(resumed.status, 200);
    for id in 4..=5 {
        assert_eq!(resumed.next_event().expect("an event").id, id);
    }
    resumed.drop_connection();
    // Relay B tells the worker; the stream waits for the next resume.
    pair.worker.wait_line("held stream detached from relay 1");
    let mut again = Client::resume(pair.b.addr, &url, 5, &[]);
    assert_eq!(again.status, 200);
    backend.gate.allow(EVENTS + 1);
    read_rest(&mut again, 5);
    assert!(backend.cancels.try_recv().is_err(), "never cancelled");
}
