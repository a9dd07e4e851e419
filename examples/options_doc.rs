//! `make docs`: rewrites the generated option tables in docs/configuration.md from the
//! option tables in the code (the same ones `--help` prints).

fn main() -> std::process::ExitCode {
    let page = modelrelay::options_doc::PAGE;
    let result = std::fs::read_to_string(page)
        .map_err(|e| format!("{page}: {e}"))
        .and_then(|old| modelrelay::options_doc::regenerate(&old).map(|new| (old, new)))
        .and_then(|(old, new)| {
            if old == new {
                return Ok("up to date");
            }
            std::fs::write(page, new)
                .map(|_| "regenerated")
                .map_err(|e| format!("{page}: {e}"))
        });
    match result {
        Ok(what) => {
            println!("{page}: option tables {what}");
            std::process::ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("{e}");
            std::process::ExitCode::FAILURE
        }
    }
}
