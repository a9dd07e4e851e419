//! Model lifecycle across the pool, seen from the HTTP side: what each backend can do
//! ([`capabilities`], built from the registry), the load / unload / cache-flush routes
//! ([`routes`]) and who may start them ([`governance`]). Which workers run an
//! operation, and how its task progresses, is dispatcher policy
//! (`dispatcher/lifecycle.rs`); the workers' backend adapters are in `worker/lifecycle/`.

pub mod capabilities;
pub mod governance;
pub mod routes;
pub mod shared_tasks;
