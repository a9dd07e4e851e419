//! The documentation and packaging agree with the binaries: every option is in its man
//! page and in docs/configuration.md, whose option tables are exactly what the code's
//! tables render (`make docs`), every relative link and anchor in README.md and docs/*.md
//! resolves, no internal issue number reaches user-facing text, the man pages render
//! without warnings, the systemd units verify, and `--help` / `--version` / exit codes
//! behave as documented.
//!
//! Tools that may be missing on a developer machine (`man`, `systemd-analyze`) make their
//! test skip with a message, except under CI (`CI` set), where they are required.

use std::path::Path;
use std::process::Command;

use modelrelay::cli::Opt;

mod common;

fn check_documented(opts: &[Opt], page: &str) {
    let man = std::fs::read_to_string(page).expect("man page");
    let reference = std::fs::read_to_string(modelrelay::options_doc::PAGE).expect("reference");
    for o in opts {
        let flag = format!("\\-\\-{}", o.flag.replace('-', "\\-"));
        assert!(man.contains(&flag), "{page} does not document --{}", o.flag);
        assert!(man.contains(o.env), "{page} does not document {}", o.env);
        assert!(
            reference.contains(&format!("`--{}`", o.flag)),
            "docs/configuration.md does not document --{}",
            o.flag
        );
        assert!(
            reference.contains(&format!("`{}`", o.env)),
            "docs/configuration.md does not document {}",
            o.env
        );
    }
}

#[test]
fn every_server_option_is_in_its_man_page_and_the_reference() {
    check_documented(
        modelrelay::server::config::OPTIONS,
        "man/modelrelay-server.8",
    );
}

#[test]
fn every_worker_option_is_in_its_man_page_and_the_reference() {
    check_documented(
        modelrelay::worker::config::OPTIONS,
        "man/modelrelay-worker.8",
    );
}

#[test]
fn the_configuration_reference_is_generated_from_the_option_tables() {
    let page = std::fs::read_to_string(modelrelay::options_doc::PAGE).expect("reference");
    for (name, opts) in modelrelay::options_doc::sections() {
        let part = modelrelay::options_doc::generated_part(&page, name)
            .unwrap_or_else(|| panic!("docs/configuration.md lacks the {name} option markers"));
        assert_eq!(
            part,
            modelrelay::options_doc::markdown(opts),
            "docs/configuration.md's {name} options disagree with the code: run `make docs`"
        );
    }
}

/// README.md and every page directly in docs/ (docs/pending/ holds unplaced notes).
fn user_pages() -> Vec<std::path::PathBuf> {
    let mut pages = vec![std::path::PathBuf::from("README.md")];
    for entry in std::fs::read_dir("docs").expect("docs/") {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "md") {
            pages.push(path);
        }
    }
    pages.sort();
    pages
}

#[test]
fn every_relative_link_and_anchor_resolves() {
    let mut broken = Vec::new();
    let mut checked = 0;
    for page in user_pages() {
        let text = std::fs::read_to_string(&page).unwrap();
        let dir = page.parent().unwrap_or(Path::new("."));
        for target in links::targets(&text) {
            if target.contains("://") || target.starts_with("mailto:") {
                continue;
            }
            checked += 1;
            let (file, anchor) = match target.split_once('#') {
                Some((f, a)) => (f, Some(a)),
                None => (target.as_str(), None),
            };
            let linked = if file.is_empty() {
                page.clone()
            } else {
                dir.join(file)
            };
            if !linked.exists() {
                broken.push(format!("{}: {target}: no such file", page.display()));
                continue;
            }
            let Some(anchor) = anchor else { continue };
            let anchors = if linked.extension().is_some_and(|e| e == "md") {
                links::anchors(&std::fs::read_to_string(&linked).unwrap())
            } else {
                Vec::new()
            };
            if !anchors.iter().any(|a| a == anchor) {
                broken.push(format!("{}: {target}: no such heading", page.display()));
            }
        }
    }
    assert!(broken.is_empty(), "broken links:\n{}", broken.join("\n"));
    assert!(
        checked > 30,
        "only {checked} links found: is the scanner broken?"
    );
}

#[test]
fn the_link_checker_follows_github_slugs() {
    let page = "# Title\n## Multiple opinions (`moe-<model>`)\n```sh\n# not a heading\n```\n## Title\n### A, b: c/d\n";
    assert_eq!(
        links::anchors(page),
        ["title", "multiple-opinions-moe-model", "title-1", "a-b-cd"]
    );
    let text = "see [a](x.md#y) and `[b](code.md)` and\n```\n[c](fenced.md)\n```\n[d](#z \"t\")";
    assert_eq!(links::targets(text), ["x.md#y", "#z"]);
}

#[test]
fn no_internal_issue_numbers_in_user_facing_text() {
    let mut files: Vec<std::path::PathBuf> = user_pages();
    files.extend(
        [
            "man/modelrelay-server.8",
            "man/modelrelay-worker.8",
            "Makefile",
            "src/cli.rs",
            "src/server/config.rs",
            "src/server/config/options.rs",
            "src/worker/config.rs",
        ]
        .map(std::path::PathBuf::from),
    );
    for entry in std::fs::read_dir("src/server/dashboard/assets").unwrap() {
        files.push(entry.unwrap().path());
    }
    let mut found = Vec::new();
    for file in files {
        let Ok(text) = std::fs::read_to_string(&file) else {
            continue;
        };
        for (n, line) in text.lines().enumerate() {
            if links::names_an_issue(line) {
                found.push(format!("{}:{}: {line}", file.display(), n + 1));
            }
        }
    }
    assert!(
        found.is_empty(),
        "say what it does, not when it was built:\n{}",
        found.join("\n")
    );
}

/// Markdown links and GitHub's heading anchors, enough for this repository's pages.
mod links {
    /// Lines outside fenced code blocks.
    fn prose(text: &str) -> impl Iterator<Item = &str> {
        let mut fenced = false;
        text.lines().filter(move |l| {
            if l.trim_start().starts_with("```") {
                fenced = !fenced;
                return false;
            }
            !fenced
        })
    }

    /// A line with its inline code spans removed.
    fn without_code(line: &str) -> String {
        line.split('`').step_by(2).collect::<Vec<_>>().join("")
    }

    /// Targets of `[text](target)` links outside code, without a link title.
    pub fn targets(text: &str) -> Vec<String> {
        let mut out = Vec::new();
        for line in prose(text) {
            let line = without_code(line);
            let mut rest = line.as_str();
            while let Some(i) = rest.find("](") {
                rest = &rest[i + 2..];
                let Some(end) = rest.find(')') else { break };
                let target = rest[..end].split_whitespace().next().unwrap_or("");
                if !target.is_empty() {
                    out.push(target.to_string());
                }
                rest = &rest[end..];
            }
        }
        out
    }

    /// GitHub's slug of a heading: lowercase, punctuation dropped (`-` and `_` kept),
    /// spaces to `-`; repeated slugs get `-1`, `-2`, ...
    pub fn anchors(text: &str) -> Vec<String> {
        let mut out: Vec<String> = Vec::new();
        for line in prose(text) {
            let hashes = line.chars().take_while(|c| *c == '#').count();
            if hashes == 0 || hashes > 6 || !line[hashes..].starts_with(' ') {
                continue;
            }
            let slug: String = line[hashes..]
                .trim()
                .to_lowercase()
                .chars()
                .filter(|c| c.is_alphanumeric() || matches!(c, ' ' | '-' | '_'))
                .map(|c| if c == ' ' { '-' } else { c })
                .collect();
            let mut unique = slug.clone();
            let mut n = 0;
            while out.contains(&unique) {
                n += 1;
                unique = format!("{slug}-{n}");
            }
            out.push(unique);
        }
        out
    }

    /// `issue 12`, `issue 14's`, `#12`: an internal issue number.
    pub fn names_an_issue(line: &str) -> bool {
        let lower = line.to_lowercase();
        let digit_after = |s: &str| s.chars().next().is_some_and(|c| c.is_ascii_digit());
        lower
            .match_indices("issue ")
            .any(|(i, m)| digit_after(&lower[i + m.len()..]))
            || lower.match_indices('#').any(|(i, _)| {
                let rest = &lower[i + 1..];
                let digits = rest.chars().take_while(|c| c.is_ascii_digit()).count();
                let before_ok = lower[..i]
                    .chars()
                    .last()
                    .is_none_or(|c| !c.is_alphanumeric() && c != '&');
                (1..=2).contains(&digits)
                    && before_ok
                    && !rest[digits..]
                        .chars()
                        .next()
                        .is_some_and(|c| c.is_alphanumeric())
            })
    }
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
            "modelrelay-server@.service",
            "modelrelay-server@relay-a.service",
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
