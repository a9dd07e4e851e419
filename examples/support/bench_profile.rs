//! The bench's profiling modes: one scenario under load for the window, the pids printed
//! first for `perf record -p` (`BENCH_PROFILE`, `BENCH_PROFILE_E2E`; contrib/profile.sh).

use std::time::Duration;

use super::fake_backend::FakeBackend;
use super::http_load::{throughput, Load};
use super::rows::cpu_rows;
use super::{chat, spawn_fake_worker, wait_ready, ServerProcess, WorkerProcess, ANSWER, MODEL};

/// `BENCH_PROFILE=clients`: the relay core alone under that many clients for the window,
/// its server's pid printed first (for `perf record -p`), then its CPU rows.
pub fn profile_core(clients: usize, window: Duration) {
    let backend = FakeBackend::new(MODEL, ANSWER);
    let server = ServerProcess::start();
    for _ in 0..4 {
        spawn_fake_worker(server.addr, MODEL, 64, backend.clone());
    }
    wait_ready(server.addr, 4);
    println!("server pid {} at {}", server.pid(), server.addr);
    let load = throughput(server.addr, clients, window, &chat(false), &[server.pid()]);
    println!("requests/s, {clients} clients: {:.0}", load.rps);
    print_latency(clients, &load);
    cpu_rows(&format!("{clients} clients"), &load, &["server"]);
}

/// `BENCH_PROFILE_E2E=clients`: server, worker binary and fake backend under that many
/// clients for the window, both pids printed first (for `perf record -p`), then the CPU rows.
pub fn profile_e2e(clients: usize, window: Duration) {
    let backend_addr = FakeBackend::new(MODEL, ANSWER)
        .spawn("127.0.0.1:0")
        .expect("backend");
    let server = ServerProcess::start();
    let worker = WorkerProcess::start(server.addr, backend_addr, "64");
    wait_ready(server.addr, 1);
    println!(
        "server pid {} worker pid {} at {}",
        server.pid(),
        worker.pid(),
        server.addr
    );
    let pids = [server.pid(), worker.pid()];
    let load = throughput(server.addr, clients, window, &chat(false), &pids);
    println!("requests/s, {clients} clients: {:.0}", load.rps);
    print_latency(clients, &load);
    cpu_rows(&format!("{clients} clients"), &load, &["server", "worker"]);
}

fn print_latency(clients: usize, load: &Load) {
    println!(
        "latency p50 / p99, {clients} clients (ms): {:.3} / {:.3}",
        load.latency.p(50).as_secs_f64() * 1e3,
        load.latency.p(99).as_secs_f64() * 1e3
    );
}
