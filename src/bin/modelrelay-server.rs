//! `modelrelay-server` entry point: configuration, signals, exit codes.
//! Exit status: 0 after a clean shutdown, 1 when the listener cannot start, 2 on bad
//! configuration, 3 when the dispatcher thread died (a bug: a supervisor should restart). `modelrelay-server sign-op-token ...` mints a governance token instead
//! (see `server::lifecycle::governance::mint`).

use std::process::ExitCode;

#[cfg(feature = "governance")]
use modelrelay::server::lifecycle::governance::mint;
use modelrelay::server::{self, config, ServerConfig};
use modelrelay::{cli, signals};

const NAME: &str = "modelrelay-server";

fn main() -> ExitCode {
    if std::env::args().nth(1).as_deref() == Some("sign-op-token") {
        return sign_op_token();
    }
    let help = "Signals: SIGTERM/SIGINT drain in-flight requests (DRAIN_TIMEOUT_SECS), then exit 0; SIGHUP reloads the TLS certificate.\nLogging: LOG_LEVEL or RUST_LOG (error, warn, info, debug, trace).\nSubcommand: `modelrelay-server sign-op-token --help` mints a verifiedOpToken for lifecycle calls.";
    let settings = match cli::start(NAME, config::USAGE, config::OPTIONS, help) {
        Ok(s) => s,
        Err(code) => return code,
    };
    let cfg = match ServerConfig::from_settings(&settings) {
        Ok(cfg) => cfg,
        Err(e) => return bad_config(&e.to_string()),
    };
    let server = match server::start(cfg) {
        Ok(s) => s,
        Err(e) if e.kind() == std::io::ErrorKind::InvalidData => return bad_config(&e.to_string()),
        Err(e) => {
            eprintln!("modelrelay-server: cannot listen: {e}");
            return ExitCode::from(1);
        }
    };
    let handle = server.shutdown_handle();
    let reload = handle.clone();
    let stop = move || {
        log::info!("stop requested: draining (ask again to exit at once)");
        handle.shutdown();
    };
    if let Err(e) = signals::install(stop, Some(Box::new(move || reload.reload_tls()))) {
        log::warn!("cannot install signal handlers: {e}");
    }
    if server.wait() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(3)
    }
}

/// `modelrelay-server sign-op-token` in a build without op tokens: says so (exit 2).
#[cfg(not(feature = "governance"))]
fn sign_op_token() -> ExitCode {
    cli::bad_config(
        &format!("{NAME} sign-op-token"),
        modelrelay::server::lifecycle::governance::NOT_BUILT,
    )
}

/// `modelrelay-server sign-op-token ...`: prints a signed token (or its help).
#[cfg(feature = "governance")]
fn sign_op_token() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(2).collect();
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let key_path = std::env::var("VERIFIED_OP_TOKEN_KEY_PATH").ok();
    match mint::run(&args, key_path, now) {
        Ok(text) => {
            print!("{text}");
            ExitCode::SUCCESS
        }
        Err(e) => cli::bad_config(&format!("{NAME} sign-op-token"), &e),
    }
}

fn bad_config(message: &str) -> ExitCode {
    cli::bad_config(NAME, message)
}
