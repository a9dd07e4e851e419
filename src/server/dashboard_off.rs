//! The dashboard compiled out (a build without the `dashboard` feature, e.g. `make static
//! FEATURES=minimal` for routers): `/dashboard` and `/setup` answer 404 saying why, so an
//! operator who opens them learns it is the build, not a wrong address. The admin API
//! (`/admin/*`) and `/metrics` serve the same data.

use super::errors::{ApiError, Style};
use super::http::request::{Conn, Request};
use super::reply::write_error;
use super::Ctx;

/// Stands in for the dashboard's sessions and feed: nothing to keep.
#[derive(Default)]
pub struct Dashboard {}

impl Dashboard {
    pub fn with_store(_store: &super::store::Store) -> Dashboard {
        Dashboard {}
    }
}

/// Whether `path` belongs to the dashboard or the setup wizard.
pub fn owns(path: &str) -> bool {
    ["/dashboard", "/setup"]
        .iter()
        .any(|p| path == *p || path.strip_prefix(p).is_some_and(|r| r.starts_with('/')))
}

/// The message every dashboard path answers with.
pub const NOT_BUILT: &str = "the web dashboard is not in this build (built without the `dashboard` feature); the admin API under /admin/ and /metrics remain";

/// Answers 404 `dashboard_not_built`; returns whether the connection may be reused.
pub fn serve(conn: &mut Conn, _ctx: &Ctx, req: &Request) -> bool {
    let e = ApiError::new(404, "dashboard_not_built", NOT_BUILT);
    write_error(conn, Style::OpenAi, &e, req.keep_alive, None)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn owns_the_dashboard_and_setup_paths_only() {
        for p in ["/dashboard", "/dashboard/events", "/setup", "/setup/info"] {
            assert!(owns(p), "{p}");
        }
        for p in ["/dashboards", "/setupx", "/v1/models", "/"] {
            assert!(!owns(p), "{p}");
        }
    }
}
