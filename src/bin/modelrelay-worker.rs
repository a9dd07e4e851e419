//! `modelrelay-worker` entry point: configuration, signals, exit codes.
//! Exit status: 0 after a graceful drain, 2 on bad configuration.

use std::process::ExitCode;

use modelrelay::cli::{self, Parsed};
use modelrelay::worker::{config, Control, Worker, WorkerConfig};

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let settings = match cli::parse(config::OPTIONS, &args, &|k| std::env::var(k).ok()) {
        Ok(Parsed::Run(s)) => s,
        Ok(Parsed::Help) => {
            print!("{}", cli::help(config::USAGE, config::OPTIONS));
            println!("\nSignals: SIGTERM/SIGINT stop taking work, finish in-flight requests (DRAIN_TIMEOUT_SECS), exit 0.");
            return ExitCode::SUCCESS;
        }
        Ok(Parsed::Version) => {
            println!("modelrelay-worker {}", env!("CARGO_PKG_VERSION"));
            return ExitCode::SUCCESS;
        }
        Err(e) => return bad_config(&e.to_string()),
    };
    cli::init_logging(settings.get("log-level").unwrap_or("info"));
    let cfg = match WorkerConfig::from_settings(&settings) {
        Ok(cfg) => cfg,
        Err(e) => return bad_config(&e.to_string()),
    };
    let drain_timeout = cfg.drain_timeout;
    let worker = match Worker::start(cfg) {
        Ok(w) => w,
        Err(e) => return bad_config(&e),
    };
    let control = worker.control();
    match signal_hook::iterator::Signals::new([
        signal_hook::consts::SIGTERM,
        signal_hook::consts::SIGINT,
    ]) {
        Ok(mut signals) => {
            std::thread::spawn(move || {
                let mut seen = 0;
                for _ in signals.forever() {
                    seen += 1;
                    if seen > 1 {
                        std::process::exit(130);
                    }
                    let _ = control.send(Control::Drain {
                        timeout: drain_timeout,
                        why: "signal".into(),
                    });
                }
            });
        }
        Err(e) => log::warn!("cannot install signal handlers: {e}"),
    }
    worker.wait();
    ExitCode::SUCCESS
}

fn bad_config(message: &str) -> ExitCode {
    eprintln!("modelrelay-worker: {message}");
    ExitCode::from(2)
}
