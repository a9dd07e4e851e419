//! Who is asking and how much they may ask: the caller's tenant and priority
//! ([`identity`]), per-tenant rate limits and token budgets ([`limits`]) and the policy
//! that says which limit applies to whom ([`policy`]). Queue order itself is the
//! dispatcher's (`dispatcher/fair_queue.rs`); this room only decides admission.

pub mod gate;
pub mod identity;
pub mod limits;
pub mod policy;
