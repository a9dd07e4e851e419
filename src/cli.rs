//! Command-line and environment configuration shared by both binaries.
//!
//! Each binary declares a table of [`Opt`]s; every option can be given as `--flag VALUE`,
//! `--flag=VALUE` or through its environment variable, and the flag wins. The same table
//! renders `--help`, so help text, parsing and the man-page test never drift apart.

use std::collections::HashMap;
use std::time::Duration;

/// One configurable setting.
#[derive(Debug, Clone, Copy)]
pub struct Opt {
    /// Long flag without the leading dashes, e.g. `listen-addr`.
    pub flag: &'static str,
    /// Environment variable, e.g. `LISTEN_ADDR`.
    pub env: &'static str,
    /// Default shown in help; `None` means unset (or required, see the help text).
    pub default: Option<&'static str>,
    /// One-line description.
    pub help: &'static str,
}

/// What the command line asked for.
#[derive(Debug)]
pub enum Parsed {
    Run(Settings),
    Help,
    Version,
}

/// Resolved option values, by flag name.
#[derive(Debug, Default, Clone)]
pub struct Settings {
    values: HashMap<&'static str, String>,
}

/// A configuration problem; binaries print it and exit with status 2.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError(pub String);

impl std::fmt::Display for ConfigError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// Resolves `args` (without the program name) and `env` against `opts`.
pub fn parse(
    opts: &[Opt],
    args: &[String],
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<Parsed, ConfigError> {
    let mut values: HashMap<&'static str, String> = HashMap::new();
    for opt in opts {
        if let Some(v) = env(opt.env).filter(|v| !v.is_empty()) {
            values.insert(opt.flag, v);
        } else if let Some(d) = opt.default {
            values.insert(opt.flag, d.to_string());
        }
    }
    let mut i = 0;
    while i < args.len() {
        let arg = &args[i];
        match arg.as_str() {
            "-h" | "--help" => return Ok(Parsed::Help),
            "-V" | "--version" => return Ok(Parsed::Version),
            _ => {}
        }
        let Some(body) = arg.strip_prefix("--") else {
            return Err(ConfigError(format!(
                "unexpected argument `{arg}` (see --help)"
            )));
        };
        let (name, inline) = match body.split_once('=') {
            Some((n, v)) => (n, Some(v.to_string())),
            None => (body, None),
        };
        let opt = opts
            .iter()
            .find(|o| o.flag == name)
            .ok_or_else(|| ConfigError(format!("unknown option `--{name}` (see --help)")))?;
        let value = match inline {
            Some(v) => v,
            None => {
                i += 1;
                args.get(i)
                    .cloned()
                    .ok_or_else(|| ConfigError(format!("option `--{name}` needs a value")))?
            }
        };
        values.insert(opt.flag, value);
        i += 1;
    }
    Ok(Parsed::Run(Settings { values }))
}

/// Renders the option table for `--help`.
pub fn help(usage: &str, opts: &[Opt]) -> String {
    let mut out = format!("{usage}\n\nOptions (each flag can also be set by its environment variable; the flag wins):\n");
    for o in opts {
        let default = o
            .default
            .map(|d| format!(" [default: {d}]"))
            .unwrap_or_default();
        out.push_str(&format!(
            "  --{:<24} {:<26} {}{}\n",
            o.flag, o.env, o.help, default
        ));
    }
    out.push_str("  -h, --help                  print this help\n  -V, --version               print the version\n");
    out
}

impl Settings {
    /// Builds settings directly (tests).
    pub fn from_pairs(pairs: &[(&'static str, &str)]) -> Settings {
        Settings {
            values: pairs.iter().map(|(k, v)| (*k, v.to_string())).collect(),
        }
    }

    pub fn get(&self, flag: &str) -> Option<&str> {
        self.values
            .get(flag)
            .map(String::as_str)
            .filter(|v| !v.is_empty())
    }

    pub fn required(&self, flag: &str, env: &str) -> Result<String, ConfigError> {
        self.get(flag)
            .map(str::to_string)
            .ok_or_else(|| ConfigError(format!("{env} (or --{flag}) is required")))
    }

    pub fn string(&self, flag: &str, fallback: &str) -> String {
        self.get(flag).unwrap_or(fallback).to_string()
    }

    pub fn number<T: std::str::FromStr>(&self, flag: &str, fallback: T) -> Result<T, ConfigError> {
        match self.get(flag) {
            None => Ok(fallback),
            Some(v) => v
                .trim()
                .parse()
                .map_err(|_| ConfigError(format!("--{flag}: `{v}` is not a valid number"))),
        }
    }

    pub fn secs(&self, flag: &str, fallback: u64) -> Result<Duration, ConfigError> {
        self.number(flag, fallback).map(Duration::from_secs)
    }

    pub fn flag_bool(&self, flag: &str) -> Result<bool, ConfigError> {
        match self.get(flag).map(|v| v.trim().to_ascii_lowercase()) {
            None => Ok(false),
            Some(v) if ["1", "true", "yes", "on"].contains(&v.as_str()) => Ok(true),
            Some(v) if ["0", "false", "no", "off"].contains(&v.as_str()) => Ok(false),
            Some(v) => Err(ConfigError(format!("--{flag}: `{v}` is not true/false"))),
        }
    }
}

/// The common start of both binaries: parses the command line and environment,
/// answers `--help` / `--version`, sets up logging. `Err` carries the exit code to
/// return (0 after help/version, 2 with a message on stderr for bad options).
pub fn start(
    name: &str,
    usage: &str,
    opts: &[Opt],
    help_extra: &str,
) -> Result<Settings, std::process::ExitCode> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match parse(opts, &args, &|k| std::env::var(k).ok()) {
        Ok(Parsed::Run(s)) => {
            init_logging(s.get("log-level").unwrap_or("info"));
            Ok(s)
        }
        Ok(Parsed::Help) => {
            print!("{}", help(usage, opts));
            println!("\n{help_extra}");
            Err(std::process::ExitCode::SUCCESS)
        }
        Ok(Parsed::Version) => {
            println!("{name} {}", env!("CARGO_PKG_VERSION"));
            Err(std::process::ExitCode::SUCCESS)
        }
        Err(e) => Err(bad_config(name, &e.to_string())),
    }
}

/// Prints a configuration error and returns exit status 2.
pub fn bad_config(name: &str, message: &str) -> std::process::ExitCode {
    eprintln!("{name}: {message}");
    std::process::ExitCode::from(2)
}

/// Sets up logging to stderr at `level` (the `--log-level`/`LOG_LEVEL` setting); `RUST_LOG`,
/// when set, wins and allows per-module filters (see [`crate::logger`]).
pub fn init_logging(level: &str) {
    let level = std::env::var("RUST_LOG").unwrap_or_else(|_| level.to_string());
    crate::logger::init(&level);
}

#[cfg(test)]
mod tests {
    use super::*;

    const OPTS: &[Opt] = &[
        Opt {
            flag: "listen-addr",
            env: "LISTEN_ADDR",
            default: Some("127.0.0.1:8080"),
            help: "x",
        },
        Opt {
            flag: "worker-secret",
            env: "WORKER_SECRET",
            default: None,
            help: "y",
        },
    ];

    fn run(args: &[&str], env: &[(&str, &str)]) -> Result<Parsed, ConfigError> {
        let args: Vec<String> = args.iter().map(|s| s.to_string()).collect();
        let env: HashMap<String, String> = env
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        parse(OPTS, &args, &|k| env.get(k).cloned())
    }

    #[test]
    fn flag_wins_over_env_and_env_over_default() {
        let Parsed::Run(s) = run(&[], &[]).unwrap() else {
            panic!()
        };
        assert_eq!(s.get("listen-addr"), Some("127.0.0.1:8080"));
        let Parsed::Run(s) = run(&[], &[("LISTEN_ADDR", "0.0.0.0:1")]).unwrap() else {
            panic!()
        };
        assert_eq!(s.get("listen-addr"), Some("0.0.0.0:1"));
        let Parsed::Run(s) = run(
            &["--listen-addr=1.2.3.4:5"],
            &[("LISTEN_ADDR", "0.0.0.0:1")],
        )
        .unwrap() else {
            panic!()
        };
        assert_eq!(s.get("listen-addr"), Some("1.2.3.4:5"));
        let Parsed::Run(s) = run(&["--worker-secret", "abc"], &[]).unwrap() else {
            panic!()
        };
        assert_eq!(s.required("worker-secret", "WORKER_SECRET").unwrap(), "abc");
    }

    #[test]
    fn errors_are_clear() {
        assert!(run(&["--nope", "1"], &[]).unwrap_err().0.contains("--nope"));
        assert!(run(&["--worker-secret"], &[])
            .unwrap_err()
            .0
            .contains("needs a value"));
        let Parsed::Run(s) = run(&[], &[]).unwrap() else {
            panic!()
        };
        assert!(s
            .required("worker-secret", "WORKER_SECRET")
            .unwrap_err()
            .0
            .contains("WORKER_SECRET"));
        assert!(matches!(run(&["--help"], &[]), Ok(Parsed::Help)));
    }
}
