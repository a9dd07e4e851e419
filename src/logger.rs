//! The log sink of both binaries: a small `log::Log` that writes env_logger's default line
//! format (`[2024-05-01T12:00:00Z INFO ] message`, no target, no colour) to stderr, one
//! `write` per line so threads' lines do not interleave. Filtering is `env_filter`, the
//! parser env_logger itself uses, so `RUST_LOG`/`LOG_LEVEL` directives mean exactly what
//! they meant before. Why not env_logger: its formatter and the `jiff` calendar it pulls
//! in for the timestamp cost the router server 20 KB (x86_64 musl); [`crate::rfc3339`]
//! already formats the timestamp.

use std::io::Write;

struct Logger {
    filter: env_filter::Filter,
}

impl log::Log for Logger {
    fn enabled(&self, metadata: &log::Metadata<'_>) -> bool {
        self.filter.enabled(metadata)
    }

    fn log(&self, record: &log::Record<'_>) {
        if !self.filter.matches(record) {
            return;
        }
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        let line = format_line(now, record.level(), record.args());
        // Nothing sensible to do when stderr is gone; env_logger ignored it too.
        let _ = std::io::stderr().lock().write_all(line.as_bytes());
    }

    fn flush(&self) {
        let _ = std::io::stderr().flush();
    }
}

/// One log line, newline included: `[<RFC 3339 UTC seconds> <level padded to 5>] <args>`.
fn format_line(unix_secs: u64, level: log::Level, args: &std::fmt::Arguments<'_>) -> String {
    format!(
        "[{} {level:<5}] {args}\n",
        crate::rfc3339::format_secs(unix_secs)
    )
}

/// Installs the logger with `filters` (env_logger's `RUST_LOG` syntax: `info`,
/// `modelrelay::server=debug,warn`, …). A second call leaves the first logger in place.
pub fn init(filters: &str) {
    let filter = env_filter::Builder::new().parse(filters).build();
    let max = filter.filter();
    if log::set_boxed_logger(Box::new(Logger { filter })).is_ok() {
        log::set_max_level(max);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_have_env_loggers_default_format() {
        let line = |level, secs| format_line(secs, level, &format_args!("hello {}", 42));
        assert_eq!(
            line(log::Level::Info, 0),
            "[1970-01-01T00:00:00Z INFO ] hello 42\n"
        );
        assert_eq!(
            line(log::Level::Error, 1_714_564_800),
            "[2024-05-01T12:00:00Z ERROR] hello 42\n"
        );
        assert_eq!(
            line(log::Level::Warn, 1_714_564_801),
            "[2024-05-01T12:00:01Z WARN ] hello 42\n"
        );
    }

    #[test]
    fn filters_follow_rust_log_syntax() {
        let filter = env_filter::Builder::new()
            .parse("warn,modelrelay::server=debug")
            .build();
        let enabled = |target, level| {
            filter.enabled(&log::Metadata::builder().target(target).level(level).build())
        };
        assert!(enabled("modelrelay::server::relay", log::Level::Debug));
        assert!(!enabled("modelrelay::server::relay", log::Level::Trace));
        assert!(!enabled("modelrelay::worker", log::Level::Info));
        assert!(enabled("modelrelay::worker", log::Level::Warn));
        assert_eq!(filter.filter(), log::LevelFilter::Debug);
    }
}
