//! The documentation and packaging agree with the binaries: every option is in its man
//! page and the README, the man pages render without warnings, the systemd units verify,
//! and `--help` / `--version` / exit codes behave as documented.
//!
//! Tools that may be missing on a developer machine (`man`, `systemd-analyze`) make their
//! test skip with a message, except under CI (`CI` set), where they are required.

use std::path::Path;
use std::process::Command;

use modelrelay::cli::Opt;

mod common;

fn check_documented(opts: &[Opt], page: &str) {
    let man = std::fs::read_to_string(page).expect("man page");
    let readme = std::fs::read_to_string("README.md").expect("README");
    for o in opts {
        let flag = format!("\\-\\-{}", o.flag.replace('-', "\\-"));
        assert!(man.contains(&flag), "{page} does not document --{}", o.flag);
        assert!(man.contains(o.env), "{page} does not document {}", o.env);
        assert!(
            readme.contains(&format!("`--{}`", o.flag)),
            "README does not document --{}",
            o.flag
        );
        assert!(
            readme.contains(&format!("`{}`", o.env)),
            "README does not document {}",
            o.env
        );
    }
}

#[test]
fn every_server_option_is_in_its_man_page_and_the_readme() {
    check_documented(
        modelrelay::server::config::OPTIONS,
        "man/modelrelay-server.8",
    );
}

#[test]
fn every_worker_option_is_in_its_man_page_and_the_readme() {
    check_documented(
        modelrelay::worker::config::OPTIONS,
        "man/modelrelay-worker.8",
    );
}

#[test]
fn man_pages_render_without_warnings() {
    if !common::procs::tool("man") {
        return;
    }
    for page in ["man/modelrelay-server.8", "man/modelrelay-worker.8"] {
        let out = Command::new("man")
            .args(["--warnings", "-l", page])
            .env("MANWIDTH", "80")
            .output()
            .expect("man");
        assert!(out.status.success(), "man -l {page} failed");
        let warnings = String::from_utf8_lossy(&out.stderr);
        assert!(warnings.trim().is_empty(), "{page}: {warnings}");
        let text = String::from_utf8_lossy(&out.stdout);
        for section in [
            "SYNOPSIS",
            "OPTIONS",
            "ENVIRONMENT",
            "SIGNALS",
            "FILES",
            "EXIT STATUS",
            "EXAMPLES",
        ] {
            assert!(text.contains(section), "{page} lacks {section}");
        }
    }
}

#[test]
fn systemd_units_verify() {
    if !common::procs::tool("systemd-analyze") {
        return;
    }
    let dir = std::env::temp_dir().join(format!("modelrelay-units-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let bins = [
        (
            "modelrelay-server.service",
            "modelrelay-server.service",
            env!("CARGO_BIN_EXE_modelrelay-server"),
        ),
        (
            "modelrelay-worker@.service",
            "modelrelay-worker@gpu0.service",
            env!("CARGO_BIN_EXE_modelrelay-worker"),
        ),
    ];
    for (src, name, bin) in bins {
        let unit = std::fs::read_to_string(Path::new("contrib/systemd").join(src)).unwrap();
        assert!(unit.contains("DynamicUser=yes") && unit.contains("ProtectSystem=strict"));
        assert!(unit.contains("NoNewPrivileges=yes") && unit.contains("RestrictAddressFamilies="));
        // Point ExecStart at the binary just built; the rest is verified as shipped.
        let unit = unit.replace(
            &format!(
                "/usr/local/bin/{}",
                Path::new(bin).file_name().unwrap().to_string_lossy()
            ),
            bin,
        );
        std::fs::write(dir.join(name), unit).unwrap();
        let out = Command::new("systemd-analyze")
            .args(["verify", "--man=no"])
            .arg(dir.join(name))
            .output()
            .expect("systemd-analyze");
        let msg = String::from_utf8_lossy(&out.stderr);
        assert!(
            out.status.success() && msg.trim().is_empty(),
            "{src}: {msg}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn stop_timeouts_outlast_the_drain_timeouts() {
    let secs = |unit: &str, key: &str| -> u64 {
        let text = std::fs::read_to_string(format!("contrib/systemd/{unit}")).unwrap();
        text.lines()
            .find_map(|l| l.strip_prefix(key))
            .and_then(|v| v.trim().parse().ok())
            .unwrap()
    };
    let default = |opts: &[Opt]| -> u64 {
        opts.iter()
            .find(|o| o.env == "DRAIN_TIMEOUT_SECS")
            .and_then(|o| o.default?.parse().ok())
            .unwrap()
    };
    assert!(
        secs("modelrelay-server.service", "TimeoutStopSec=")
            > default(modelrelay::server::config::OPTIONS)
    );
    assert!(
        secs("modelrelay-worker@.service", "TimeoutStopSec=")
            > default(modelrelay::worker::config::OPTIONS)
    );
}

#[test]
fn help_version_and_exit_codes() {
    for (bin, name) in [
        (env!("CARGO_BIN_EXE_modelrelay-server"), "modelrelay-server"),
        (env!("CARGO_BIN_EXE_modelrelay-worker"), "modelrelay-worker"),
    ] {
        let help = Command::new(bin).arg("--help").output().unwrap();
        assert!(help.status.success());
        assert!(String::from_utf8_lossy(&help.stdout).contains("WORKER_SECRET"));
        let version = Command::new(bin).arg("--version").output().unwrap();
        assert_eq!(
            String::from_utf8_lossy(&version.stdout).trim(),
            format!("{name} {}", env!("CARGO_PKG_VERSION"))
        );
        let no_secret = Command::new(bin).env_clear().output().unwrap();
        assert_eq!(
            no_secret.status.code(),
            Some(2),
            "{name} without WORKER_SECRET"
        );
        let bad_flag = Command::new(bin).arg("--nope").output().unwrap();
        assert_eq!(bad_flag.status.code(), Some(2));
        assert!(String::from_utf8_lossy(&bad_flag.stderr).contains("--nope"));
    }
    let busy = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_modelrelay-server"))
        .env("WORKER_SECRET", "x")
        .env("LISTEN_ADDR", busy.local_addr().unwrap().to_string())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1), "port in use");
}
