//! Token usage accounting. [`journal`] is the crash-safe store of hourly usage buckets
//! (per API key, tenant, model and worker); recording from the relay and the usage
//! routes build on it.

pub mod journal;
