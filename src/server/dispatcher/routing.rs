//! Which worker takes a request: one ranked choice, used both for a new request and for
//! the request the queue picked when a slot freed. The queue decides *which* request
//! goes next (priority, tenant fairness); this decides only *where* it goes.
//!
//! In order:
//! 1. **eligible**: serves the model, can do what the request needs (capability), backend
//!    up and not ejected, not draining, and not a worker the request already failed on
//!    while another one is up;
//! 2. **loaded model**: when a free eligible worker holds the model in memory, only
//!    workers that hold it;
//! 3. **cache affinity** (`ROUTING_AFFINITY=on`): the worker holding the longest prefix
//!    of the prompt (see `affinity.rs`), as long as one more request keeps its load
//!    within 5/4 of the mean load of the eligible workers (consistent hashing with
//!    bounded loads: `load + 1 <= ceil(1.25 × (total + 1) / n)`), and it has a free
//!    slot. When it is full, the request may wait for it up to `AFFINITY_WAIT_MS` (once,
//!    while fewer requests wait for it than it has slots) instead of re-evaluating its
//!    whole history elsewhere; the bound is then judged for the moment it would take the
//!    request, when one of its requests has finished;
//! 4. **least load**, ties round robin (the first tied worker after the last one picked).
//!
//! For a queued request taken by a worker that freed a slot (or just joined), only a
//! cache hit elsewhere moves it: otherwise that worker takes it (see `fill_worker`).
//!
//! A waiting request keeps its place in the queue; workers it does not wait for pass
//! over it meanwhile, the one it waits for takes it first when a slot frees there (it is
//! ahead of everything queued after it), and when its wait ends any worker may take it.
//! Wherever a request goes, its fingerprints are remembered there.

use std::time::Instant;

use log::debug;

use super::affinity::{model_key, Affinity};
use super::registry::{Needs, Registry, Worker, WorkerId};
use super::{Dispatcher, Health, Hold, Request, RequestId, Timer};

/// Affinity may raise a worker's load to at most NUM/DEN of the eligible workers' mean.
const BOUND_NUM: u64 = 5;
const BOUND_DEN: u64 = 4;

/// What routing needs to know about a request.
#[derive(Debug, Clone, Copy)]
pub struct Ask<'a> {
    pub model: &'a str,
    pub needs: Needs,
    /// Prompt-prefix fingerprints, shortest first (empty: load routing only).
    pub prints: &'a [u64],
    /// Workers it failed on before their backend answered (failover).
    pub failed_on: &'a [WorkerId],
    /// Whether it may still wait for a full worker that holds its prefix.
    pub may_wait: bool,
}

/// Where a request goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Route {
    /// Start it on this worker now.
    Go(WorkerId, Verdict),
    /// The worker holding its prefix (`home`) is full but within the load bound: wait
    /// for it. `otherwise` has a free slot and is where it would go now.
    Wait { home: WorkerId, otherwise: WorkerId },
    /// No eligible worker has a free slot: it queues.
    Busy,
}

/// What affinity made of a dispatch (`modelrelay_affinity_routing_total`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// No fingerprints (or affinity off): load routing only, not counted.
    Unkeyed,
    /// To the worker holding the longest prefix of its prompt.
    Hit,
    /// No eligible worker holds any prefix of it.
    Miss,
    /// A worker holds a prefix, but it was full or too loaded: elsewhere.
    Overridden,
}

/// The ranked choice (see the module docs). Pure: the caller notes the pick.
pub fn choose(reg: &Registry, affinity: &Affinity, ask: &Ask) -> Route {
    // A worker yielded to its box's owner (`owner_status`) takes nothing new.
    let up = |w: &Worker| {
        w.serves(ask.model) && w.health == Health::Up && !w.is_draining() && w.yielded.is_none()
    };
    // A request goes back to a worker it failed on only when no other is up.
    let avoid_failed =
        !ask.failed_on.is_empty() && reg.iter().any(|w| up(w) && !ask.failed_on.contains(&w.id));
    let eligible = |w: &Worker| {
        up(w) && w.can(ask.model, ask.needs) && !(avoid_failed && ask.failed_on.contains(&w.id))
    };
    let free = |w: &Worker| w.load() < w.max_concurrent;
    let any_loaded = reg
        .iter()
        .any(|w| eligible(w) && free(w) && w.has_loaded(ask.model));
    let tier = |w: &Worker| eligible(w) && (!any_loaded || w.has_loaded(ask.model));
    let least = least_loaded(reg, |w| tier(w) && free(w));
    let (verdict, home) = preferred(reg, affinity, ask, &eligible, &tier);
    match (home, least) {
        (Some(h), _) if free(h) => Route::Go(h.id, Verdict::Hit),
        (Some(h), Some(otherwise))
            if ask.may_wait && affinity.waiting_for(h.id) < h.max_concurrent =>
        {
            Route::Wait {
                home: h.id,
                otherwise,
            }
        }
        (Some(_), Some(otherwise)) => Route::Go(otherwise, Verdict::Overridden),
        (None, Some(otherwise)) => Route::Go(otherwise, verdict),
        (_, None) => Route::Busy,
    }
}

/// The worker affinity prefers (`None`: none, or over the load bound) and the verdict
/// if the request goes elsewhere.
fn preferred<'r>(
    reg: &'r Registry,
    affinity: &Affinity,
    ask: &Ask,
    eligible: &impl Fn(&Worker) -> bool,
    tier: &impl Fn(&Worker) -> bool,
) -> (Verdict, Option<&'r Worker>) {
    if ask.prints.is_empty() {
        return (Verdict::Unkeyed, None);
    }
    let model = model_key(ask.model);
    let (mut n, mut total) = (0u64, 0u64);
    // (matched prefixes, free, -load) ranks a candidate; the lowest id wins ties.
    let mut best: Option<(&Worker, (usize, bool, i64))> = None;
    for w in reg.iter().filter(|w| eligible(w)) {
        n += 1;
        total += u64::from(w.load());
        if !tier(w) {
            continue;
        }
        let matched = affinity.matched(w.id, model, ask.prints);
        if matched == 0 {
            continue;
        }
        let rank = (matched, w.load() < w.max_concurrent, -i64::from(w.load()));
        if best.is_none_or(|(_, r)| rank > r) {
            best = Some((w, rank));
        }
    }
    match best {
        None => (Verdict::Miss, None),
        Some((w, _)) if within_bound(w, total, n) => (Verdict::Hit, Some(w)),
        Some(_) => (Verdict::Overridden, None),
    }
}

/// Whether `w` may take one more request under the load bound. A full worker would take
/// it when one of its own requests finishes, so it is judged for that moment (and again
/// when it comes).
fn within_bound(w: &Worker, total: u64, n: u64) -> bool {
    if w.load() >= w.max_concurrent && w.load() > 0 {
        bounded(w.load() - 1, total.saturating_sub(1), n)
    } else {
        bounded(w.load(), total, n)
    }
}

/// Whether one more request on a worker with `load` keeps it within the bound, with
/// `total` load over `n` eligible workers: `load + 1 <= ceil(5/4 × (total + 1) / n)`,
/// which for integers is `4 × n × load < 5 × (total + 1)`.
fn bounded(load: u32, total: u64, n: u64) -> bool {
    BOUND_DEN * n * u64::from(load) < BOUND_NUM * (total + 1)
}

/// The least loaded worker passing `ok`; ties go to the first after the last pick.
fn least_loaded(reg: &Registry, ok: impl Fn(&Worker) -> bool) -> Option<WorkerId> {
    let min = reg.iter().filter(|w| ok(w)).map(Worker::load).min()?;
    let tied = || {
        reg.iter()
            .filter(|w| ok(w) && w.load() == min)
            .map(|w| w.id)
    };
    let after_last = reg
        .last_pick()
        .and_then(|last| tied().find(|id| *id > last));
    after_last.or_else(|| tied().next())
}

impl Dispatcher {
    /// Where `req` goes now (see [`choose`]).
    pub(super) fn route(&self, req: &Request) -> Route {
        let ask = Ask {
            model: &req.msg.model,
            needs: req.needs,
            prints: if self.cfg.affinity {
                req.prints.as_slice()
            } else {
                &[]
            },
            failed_on: &req.failed_on,
            may_wait: !self.cfg.affinity_wait.is_zero() && req.hold == Hold::Never,
        };
        choose(&self.registry, &self.affinity, &ask)
    }

    /// Bookkeeping of a dispatch: the round-robin position, the request's fingerprints
    /// remembered at its new home, the affinity counters, and the end of any wait.
    pub(super) fn note_route(&mut self, id: RequestId, worker: WorkerId, verdict: Verdict) {
        self.end_hold(id);
        self.registry.note_pick(worker);
        let Some(req) = self.requests.get(&id) else {
            return;
        };
        if verdict == Verdict::Unkeyed {
            return;
        }
        let model = model_key(&req.msg.model);
        self.affinity.remember(worker, model, req.prints.as_slice());
        let c = &mut self.counters;
        match verdict {
            Verdict::Hit => c.affinity_hits += 1,
            Verdict::Miss => c.affinity_misses += 1,
            Verdict::Overridden => c.affinity_overridden += 1,
            Verdict::Unkeyed => {}
        }
    }

    /// `id` waits for `home`, a full worker holding its prefix, until `AFFINITY_WAIT_MS`
    /// from now (it waits at most once).
    pub(super) fn start_hold(&mut self, id: RequestId, home: WorkerId, now: Instant) {
        let until = now + self.cfg.affinity_wait;
        let Some(req) = self.requests.get_mut(&id) else {
            return;
        };
        if req.hold != Hold::Never {
            return;
        }
        req.hold = Hold::For {
            worker: home,
            until,
        };
        debug!(
            "request {} waits up to {} ms for w-{home}, which holds its prompt",
            req.msg.request_id,
            self.cfg.affinity_wait.as_millis()
        );
        self.affinity.start_wait(home);
        self.counters.affinity_waits += 1;
        self.timers.insert((until, Timer::AffinityWait(id)));
    }

    /// Ends `id`'s wait, if it waits (dispatched, gone, or its time is up).
    pub(super) fn end_hold(&mut self, id: RequestId) {
        let Some(req) = self.requests.get_mut(&id) else {
            return;
        };
        if let Hold::For { worker, until } = req.hold {
            req.hold = Hold::Done;
            self.affinity.end_wait(worker);
            self.timers.remove(&(until, Timer::AffinityWait(id)));
        }
    }

    /// A request's wait for its cached worker is over: any worker may take it now.
    pub(super) fn hold_expired(&mut self, id: RequestId, now: Instant) {
        let waiting = self
            .requests
            .get(&id)
            .is_some_and(|r| matches!(r.hold, Hold::For { until, .. } if until <= now));
        if waiting {
            self.end_hold(id);
            self.fill_all(now);
        }
    }
}

#[cfg(test)]
mod tests;
