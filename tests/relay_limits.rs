//! Rate limits with several relays and no shared store (or one that is unreachable):
//! each relay admits its share, the limit divided by the relays its workers report, so
//! the fleet stays within the limit. Real relay binaries, one real worker serving both
//! (`PROXY_URL` a list), a fake backend.

mod common;
#[path = "../examples/support/fake_backend.rs"]
mod fake_backend;

use common::procs::{start_worker, Proc, ServerProc};
use common::{chat_as, wait_until};
use fake_backend::FakeBackend;

/// Per hour, so that no unit comes back while the test runs.
const LIMIT: (&str, &str) = ("TENANT_RATE_LIMIT_teama", "10req/h");

/// Of 20 requests alternating between `a` and `b`, how many were admitted.
fn admitted_of_20(a: &ServerProc, b: &ServerProc, tenant: &str) -> usize {
    (0..20)
        .filter(|i| {
            let addr = if i % 2 == 0 { a.addr } else { b.addr };
            let status = chat_as(addr, tenant);
            assert!(status == 200 || status == 429, "{status}");
            status == 200
        })
        .count()
}

/// One worker serving both relays, once both know the pool spans two relays.
fn serve_both(a: &ServerProc, b: &ServerProc) -> Proc {
    let backend = FakeBackend::new("m", "one two")
        .spawn("127.0.0.1:0")
        .expect("backend");
    let urls = format!("http://{},http://{}", a.addr, b.addr);
    let worker = start_worker(a.addr, backend, &[("PROXY_URL", &urls)]);
    for s in [a, b] {
        s.wait_workers(1);
        wait_until("the relay to learn the pool spans two relays", || {
            let h = s.health();
            (h["relays"] == 2, h.to_string())
        });
    }
    worker
}

#[test]
fn without_a_shared_store_each_of_two_relays_admits_half_of_a_limit() {
    let (a, b) = (ServerProc::start(&[LIMIT]), ServerProc::start(&[LIMIT]));
    let _worker = serve_both(&a, &b);
    assert_eq!(admitted_of_20(&a, &b, "teama"), 10);
    for s in [&a, &b] {
        s.proc.wait_line("this relay admits 1/2 of each limit");
    }
}

#[cfg(feature = "redis-store")]
#[test]
fn with_the_shared_store_unreachable_each_relay_falls_back_to_its_share() {
    use common::redis::Redis;
    if !common::procs::tool("redis-server") {
        return;
    }
    let mut redis = Redis::start();
    let url = redis.url();
    let store = ("STATE_URL", url.as_str());
    let (a, b) = (
        ServerProc::start(&[LIMIT, store]),
        ServerProc::start(&[LIMIT, store]),
    );
    let _worker = serve_both(&a, &b);
    redis.stop();
    assert_eq!(admitted_of_20(&a, &b, "teama"), 10);
    for s in [&a, &b] {
        s.proc.wait_line("state store unreachable");
    }
}
