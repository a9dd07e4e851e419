//! The configuration reference in `docs/configuration.md`, rendered from the same option
//! tables as `--help` and checked against the man pages, so the three cannot drift.
//!
//! The generated part of the page sits between marker comments
//! (`<!-- options:server:begin -->` … `<!-- options:server:end -->`); `make docs`
//! rewrites it and `tests/docs.rs` fails when it disagrees with the tables.

use crate::cli::Opt;

/// The page that holds the generated tables, relative to the crate root.
pub const PAGE: &str = "docs/configuration.md";

/// Every generated section: its marker name and its option table.
pub fn sections() -> [(&'static str, &'static [Opt]); 2] {
    [
        ("server", crate::server::config::OPTIONS),
        ("worker", crate::worker::config::OPTIONS),
    ]
}

/// One option table as a Markdown table (variable, flag, default, meaning).
pub fn markdown(opts: &[Opt]) -> String {
    let mut out = String::from("| variable | flag | default | meaning |\n|---|---|---|---|\n");
    for o in opts {
        let default = o
            .default
            .map(|d| format!("`{d}`"))
            .unwrap_or_else(|| "(none)".to_string());
        out.push_str(&format!(
            "| `{}` | `--{}` | {} | {} |\n",
            o.env,
            o.flag,
            default,
            o.help.replace('|', "\\|")
        ));
    }
    out
}

fn markers(name: &str) -> (String, String) {
    (
        format!("<!-- options:{name}:begin -->\n"),
        format!("<!-- options:{name}:end -->"),
    )
}

/// The text between `name`'s markers in `page`, or `None` when they are missing.
pub fn generated_part<'a>(page: &'a str, name: &str) -> Option<&'a str> {
    let (begin, end) = markers(name);
    let start = page.find(&begin)? + begin.len();
    let len = page[start..].find(&end)?;
    Some(&page[start..start + len])
}

/// `page` with every section's markers holding the freshly rendered table.
pub fn regenerate(page: &str) -> Result<String, String> {
    let mut page = page.to_string();
    for (name, opts) in sections() {
        let (begin, end) = markers(name);
        let start = page
            .find(&begin)
            .ok_or_else(|| format!("{PAGE}: marker {} missing", begin.trim()))?
            + begin.len();
        let len = page[start..]
            .find(&end)
            .ok_or_else(|| format!("{PAGE}: marker {end} missing"))?;
        page.replace_range(start..start + len, &markdown(opts));
    }
    Ok(page)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn regenerate_replaces_only_between_markers_and_escapes_pipes() {
        let page = "intro\n<!-- options:server:begin -->\nSTALE-TABLE\n<!-- options:server:end -->\nmid\n<!-- options:worker:begin -->\n<!-- options:worker:end -->\nend\n";
        let new = regenerate(page).unwrap();
        assert!(new.starts_with("intro\n") && new.ends_with("end\n") && new.contains("\nmid\n"));
        assert!(!new.contains("STALE-TABLE"));
        assert_eq!(
            generated_part(&new, "server").unwrap(),
            markdown(crate::server::config::OPTIONS)
        );
        assert_eq!(regenerate(&new).unwrap(), new, "idempotent");
        let opts = [Opt {
            flag: "a",
            env: "A",
            default: None,
            help: "x | y",
        }];
        assert!(markdown(&opts).contains("| `A` | `--a` | (none) | x \\| y |"));
        assert!(regenerate("no markers").is_err());
    }
}
