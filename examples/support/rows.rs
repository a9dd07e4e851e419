//! The bench's table rows: a name column of 44, then direct, relay and a last column.
#![allow(dead_code)]

use std::time::Duration;

use crate::http_load::Load;

/// Requests/s direct and relayed, and the relayed share.
pub fn row_rps(name: &str, direct: &Load, relay: &Load) {
    println!(
        "{:<44} {:>12.0} {:>12.0} {:>11.1}%",
        name,
        direct.rps,
        relay.rps,
        100.0 * relay.rps / direct.rps
    );
}

/// CPU per request (user + system, all threads) and context switches per request of
/// each watched process, then their sum when there are several.
pub fn cpu_rows(what: &str, load: &Load, names: &[&str]) {
    let mut total = (0.0, 0.0);
    for (i, name) in names.iter().enumerate() {
        let spent = load.spent.get(i).copied().unwrap_or_default();
        let user = 100.0 * spent.user.as_secs_f64() / spent.cpu().as_secs_f64().max(1e-9);
        println!(
            "{:<44} {:>12} {:>12.1} {:>12}",
            format!("CPU/request {name}, {what} (us)"),
            "",
            load.cpu_us(i),
            format!("{user:.0}% user")
        );
        println!(
            "{:<44} {:>12} {:>12.1}",
            format!("switches/request {name}, {what}"),
            "",
            load.switches(i)
        );
        total = (total.0 + load.cpu_us(i), total.1 + load.switches(i));
    }
    if names.len() > 1 {
        println!(
            "{:<44} {:>12} {:>12.1} {:>12.1}",
            format!("CPU/request total, {what} (us, switches)"),
            "",
            total.0,
            total.1
        );
    }
}

/// Width of the name column of the Ollama rows (the others use 44).
pub const OLLAMA_COLUMN: usize = 53;

pub fn row_ms(name: &str, direct: Duration, relay: Duration) {
    row_ms_in(44, name, direct, relay);
}

/// A row whose last column is relay / direct (for latency under concurrency, where
/// both sides queue on the same cores and the ratio is the figure that travels).
pub fn row_ratio(name: &str, direct: Duration, relay: Duration) {
    let ms = |d: Duration| d.as_secs_f64() * 1000.0;
    println!(
        "{:<44} {:>12.3} {:>12.3} {:>11.1}x",
        name,
        ms(direct),
        ms(relay),
        ms(relay) / ms(direct).max(1e-6)
    );
}

pub fn row_ms_in(width: usize, name: &str, direct: Duration, relay: Duration) {
    let ms = |d: Duration| d.as_secs_f64() * 1000.0;
    println!(
        "{:<width$} {:>12.3} {:>12.3} {:>+12.3}",
        name,
        ms(direct),
        ms(relay),
        ms(relay) - ms(direct)
    );
}
