//! The wait queue: strict priority classes with aging, weighted fair share between
//! tenants inside a class, FIFO inside a tenant.
//!
//! Fairness is start-time fair queueing: each class keeps a virtual clock, and a request
//! is stamped on arrival with a start tag `max(class clock, tenant's last finish tag)`;
//! the tenant's finish tag then advances by `SCALE / weight`. The queue serves the lowest
//! tag, and the class clock follows the tags it serves. So a tenant that queued 1,000
//! requests holds tags far in the future while a newcomer's single request is stamped
//! with the present: it goes next (at most one free slot later). A tenant of weight 3
//! gets three turns for every one of a tenant of weight 1. An idle tenant banks nothing:
//! its next tag is never below the class clock.
//!
//! Aging: a request that waited `aging` in its class moves up one class (low → normal →
//! high), so `low` cannot starve behind a steady stream of `normal`. In its new class it
//! still goes before the requests of its own tenant that arrived after it.
//!
//! Workers serve only some models, so each class indexes its requests per model; taking
//! work for a worker looks at the head of each model it serves. Every operation is
//! O(log n) in the queue length (times the number of distinct queued models when
//! taking), which keeps dispatch flat at 10,000 queued requests (see `make bench-queue`).
//!
//! A request's [`Place`] (class, tag, arrival order) is handed back when it leaves the
//! queue for a worker; a requeue restores it, so the request goes back where it stood.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::ids::IdMap;
use super::RequestId;
use crate::protocol::RequestMessage;

/// Virtual time one request of a weight-1 tenant costs.
const SCALE: u64 = 1 << 20;

/// Queue priority class (`X-Priority`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub enum Priority {
    Low,
    #[default]
    Normal,
    High,
}

impl Priority {
    pub const ALL: [Priority; 3] = [Priority::Low, Priority::Normal, Priority::High];

    /// Parses `high`, `normal` or `low` (any case).
    pub fn parse(text: &str) -> Option<Priority> {
        let t = text.trim();
        Priority::ALL
            .into_iter()
            .find(|p| p.as_str().eq_ignore_ascii_case(t))
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Priority::Low => "low",
            Priority::Normal => "normal",
            Priority::High => "high",
        }
    }

    fn index(self) -> usize {
        self as usize
    }

    fn up(self) -> Priority {
        match self {
            Priority::Low => Priority::Normal,
            _ => Priority::High,
        }
    }
}

/// Who a request belongs to, as far as queueing cares.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Who {
    pub tenant: Arc<str>,
    pub priority: Priority,
    /// Share of the pool relative to other tenants (at least 1).
    pub weight: u32,
}

impl Default for Who {
    fn default() -> Who {
        Who {
            tenant: Arc::from(DEFAULT_TENANT),
            priority: Priority::Normal,
            weight: 1,
        }
    }
}

/// The tenant of requests that name none.
pub const DEFAULT_TENANT: &str = "default";

impl Who {
    /// Whether the request named no tenant (it is in [`DEFAULT_TENANT`]).
    pub fn is_anonymous(&self) -> bool {
        &*self.tenant == DEFAULT_TENANT
    }
}

/// Where a request stands: restored as it was when a requeued request comes back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Place {
    class: Priority,
    tag: u64,
    seq: u64,
    /// When the request entered its current class (aging counts from here).
    class_since: Instant,
}

impl Place {
    pub fn class(&self) -> Priority {
        self.class
    }
}

/// Order inside a class: start tag, then arrival.
type Key = (u64, u64);

#[derive(Debug)]
struct Entry {
    msg: Arc<RequestMessage>,
    tenant: Arc<str>,
    weight: u32,
    place: Place,
}

#[derive(Debug, Default)]
struct TenantState {
    /// The tenant's waiting requests in this class: arrival order → start tag.
    queued: BTreeMap<u64, u64>,
    finish: u64,
}

#[derive(Debug, Default)]
struct Class {
    by_model: HashMap<String, BTreeMap<Key, RequestId>>,
    by_age: BTreeMap<(Instant, u64), RequestId>,
    tenants: HashMap<Arc<str>, TenantState>,
    clock: u64,
    len: usize,
}

impl Class {
    /// Stamps a new arrival of `tenant` and returns its start tag.
    fn stamp(&mut self, tenant: &Arc<str>, weight: u32) -> u64 {
        let clock = self.clock;
        let state = self.tenants.entry(tenant.clone()).or_default();
        let start = state.finish.max(clock);
        state.finish = start + SCALE / u64::from(weight.max(1));
        start
    }

    fn insert(&mut self, id: RequestId, e: &Entry) {
        let p = e.place;
        self.by_model
            .entry(e.msg.model.clone())
            .or_default()
            .insert((p.tag, p.seq), id);
        self.by_age.insert((p.class_since, p.seq), id);
        let state = self.tenants.entry(e.tenant.clone()).or_default();
        state.queued.insert(p.seq, p.tag);
        state.finish = state.finish.max(p.tag + SCALE / u64::from(e.weight.max(1)));
        self.len += 1;
    }

    fn remove(&mut self, e: &Entry) {
        let p = e.place;
        if let Some(set) = self.by_model.get_mut(e.msg.model.as_str()) {
            set.remove(&(p.tag, p.seq));
            if set.is_empty() {
                self.by_model.remove(e.msg.model.as_str());
            }
        }
        self.by_age.remove(&(p.class_since, p.seq));
        if let Some(state) = self.tenants.get_mut(&e.tenant) {
            state.queued.remove(&p.seq);
            if state.queued.is_empty() {
                // Nothing banked: the next arrival starts at the class clock anyway
                // unless its finish tag is still ahead, which matters only while queued.
                self.tenants.remove(&e.tenant);
            }
        }
        self.len -= 1;
    }

    /// The best request for a worker that serves `serves` and `accept`s it (a worker
    /// skips the rare request that already failed on it, so the scan rarely goes past
    /// the head of each model's line).
    fn head_for(
        &self,
        serves: &impl Fn(&str) -> bool,
        accept: &impl Fn(RequestId) -> bool,
    ) -> Option<(Key, RequestId)> {
        self.by_model
            .iter()
            .filter(|(model, _)| serves(model))
            .filter_map(|(_, set)| {
                set.iter()
                    .find(|(_, id)| accept(**id))
                    .map(|(k, id)| (*k, *id))
            })
            .min()
    }
}

/// See the module docs.
#[derive(Debug)]
pub struct FairQueue {
    classes: [Class; 3],
    entries: IdMap<Entry>,
    per_tenant: HashMap<Arc<str>, usize>,
    aging: Option<Duration>,
    next_seq: u64,
}

impl FairQueue {
    /// `aging`: how long a request waits in a class before it moves up (`None`: never).
    pub fn new(aging: Option<Duration>) -> FairQueue {
        FairQueue {
            classes: Default::default(),
            entries: IdMap::default(),
            per_tenant: HashMap::new(),
            aging: aging.filter(|a| !a.is_zero()),
            next_seq: 0,
        }
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Requests `tenant` has waiting.
    pub fn tenant_len(&self, tenant: &str) -> usize {
        self.per_tenant.get(tenant).copied().unwrap_or(0)
    }

    /// Waiting requests per tenant.
    pub fn tenants(&self) -> impl Iterator<Item = (&Arc<str>, usize)> {
        self.per_tenant.iter().map(|(t, n)| (t, *n))
    }

    /// Queues a new request at the back of its tenant's line in its class.
    pub fn push(&mut self, id: RequestId, msg: Arc<RequestMessage>, who: &Who, now: Instant) {
        let class = who.priority;
        let tag = self.classes[class.index()].stamp(&who.tenant, who.weight);
        let place = Place {
            class,
            tag,
            seq: self.next_seq,
            class_since: now,
        };
        self.next_seq += 1;
        self.insert(id, msg, who, place);
    }

    /// The place a request arriving now would get, without queueing it: given to a
    /// request dispatched at once, so that a requeue puts it back by its arrival.
    pub fn place_now(&mut self, who: &Who, now: Instant) -> Place {
        let class = &self.classes[who.priority.index()];
        let finish = class.tenants.get(&who.tenant).map_or(0, |t| t.finish);
        let seq = self.next_seq;
        self.next_seq += 1;
        Place {
            class: who.priority,
            tag: class.clock.max(finish),
            seq,
            class_since: now,
        }
    }

    /// Puts a request back where it stood before it was taken (a requeue).
    pub fn restore(&mut self, id: RequestId, msg: Arc<RequestMessage>, who: &Who, place: Place) {
        self.insert(id, msg, who, place);
    }

    fn insert(&mut self, id: RequestId, msg: Arc<RequestMessage>, who: &Who, place: Place) {
        let entry = Entry {
            msg,
            tenant: who.tenant.clone(),
            weight: who.weight,
            place,
        };
        self.classes[place.class.index()].insert(id, &entry);
        *self.per_tenant.entry(who.tenant.clone()).or_default() += 1;
        if let Some(old) = self.entries.insert(id, entry) {
            // Never expected (ids are unique); keep the indexes consistent anyway.
            self.classes[old.place.class.index()].remove(&old);
            self.untrack_tenant(&old.tenant);
        }
    }

    /// Removes a waiting request; returns its place.
    pub fn remove(&mut self, id: RequestId) -> Option<Place> {
        let entry = self.entries.remove(&id)?;
        self.classes[entry.place.class.index()].remove(&entry);
        self.untrack_tenant(&entry.tenant);
        Some(entry.place)
    }

    fn untrack_tenant(&mut self, tenant: &Arc<str>) {
        if let Some(n) = self.per_tenant.get_mut(tenant) {
            *n -= 1;
            if *n == 0 {
                self.per_tenant.remove(tenant);
            }
        }
    }

    /// Takes the next request for a worker serving the models `serves` accepts: highest
    /// class first (after aging), lowest start tag inside it. Returns it and its place.
    pub fn take_for(
        &mut self,
        serves: impl Fn(&str) -> bool,
        accept: impl Fn(RequestId) -> bool,
        now: Instant,
    ) -> Option<(RequestId, Place)> {
        self.promote_aged(now);
        for class in Priority::ALL.into_iter().rev() {
            let c = &mut self.classes[class.index()];
            if let Some(((tag, _), id)) = c.head_for(&serves, &accept) {
                c.clock = c.clock.max(tag);
                return self.remove(id).map(|place| (id, place));
            }
        }
        None
    }

    /// Moves every request that waited `aging` in its class up one class.
    fn promote_aged(&mut self, now: Instant) {
        let Some(aging) = self.aging else {
            return;
        };
        // Low first, so a request due twice over climbs both steps in one pass.
        for class in [Priority::Low, Priority::Normal] {
            loop {
                let c = &self.classes[class.index()];
                let Some((&(since, _), &id)) = c.by_age.first_key_value() else {
                    break;
                };
                if since + aging > now {
                    break;
                }
                self.promote(id, since + aging);
            }
        }
    }

    fn promote(&mut self, id: RequestId, at: Instant) {
        let Some(mut entry) = self.entries.remove(&id) else {
            return;
        };
        let from = entry.place.class;
        self.classes[from.index()].remove(&entry);
        let to = from.up();
        let class = &mut self.classes[to.index()];
        let stamped = class.stamp(&entry.tenant, entry.weight);
        // It arrived before the tenant's requests that came later straight into this
        // class: it goes before them (a tie in tag is broken by arrival), not behind.
        let later = class
            .tenants
            .get(&entry.tenant)
            .and_then(|t| t.queued.range(entry.place.seq + 1..).next())
            .map(|(_, tag)| *tag);
        let tag = later.map_or(stamped, |later| later.min(stamped));
        entry.place = Place {
            class: to,
            tag,
            seq: entry.place.seq,
            class_since: at,
        };
        self.classes[to.index()].insert(id, &entry);
        self.entries.insert(id, entry);
    }

    /// Roughly how many requests go before `id` (for queue progress notes): all of the
    /// higher classes plus those ahead in its own class. O(n) in its class: used only for
    /// requests that asked for progress, about once a second each.
    pub fn position(&self, id: RequestId) -> Option<usize> {
        let place = self.entries.get(&id)?.place;
        let higher: usize = Priority::ALL
            .into_iter()
            .filter(|p| *p > place.class)
            .map(|p| self.classes[p.index()].len)
            .sum();
        let key = (place.tag, place.seq);
        let ahead: usize = self.classes[place.class.index()]
            .by_model
            .values()
            .map(|set| set.range(..key).count())
            .sum();
        Some(higher + ahead)
    }

    /// Empties the queue (shutdown).
    pub fn drain_all(&mut self) -> Vec<RequestId> {
        let ids: Vec<RequestId> = self.entries.keys().copied().collect();
        for id in &ids {
            self.remove(*id);
        }
        ids
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn msg(model: &str) -> Arc<RequestMessage> {
        Arc::new(RequestMessage {
            request_id: String::new(),
            model: model.into(),
            endpoint_path: "/v1/chat/completions".into(),
            is_streaming: false,
            body: Arc::from("{}"),
            headers: Default::default(),
            body_encoding: None,
            continuation: None,
            held: None,
        })
    }

    fn who(tenant: &str, priority: Priority, weight: u32) -> Who {
        Who {
            tenant: Arc::from(tenant),
            priority,
            weight,
        }
    }

    fn take_all(q: &mut FairQueue, now: Instant) -> Vec<RequestId> {
        std::iter::from_fn(|| q.take_for(|_| true, |_| true, now).map(|(id, _)| id)).collect()
    }

    #[test]
    fn one_tenant_is_fifo() {
        let t = Instant::now();
        let mut q = FairQueue::new(None);
        for id in 0..5 {
            q.push(id, msg("m"), &who("a", Priority::Normal, 1), t);
        }
        assert_eq!(take_all(&mut q, t), vec![0, 1, 2, 3, 4]);
        assert!(q.is_empty());
    }

    #[test]
    fn a_newcomer_goes_before_a_flood() {
        let t = Instant::now();
        let mut q = FairQueue::new(None);
        for id in 0..1000 {
            q.push(id, msg("m"), &who("flood", Priority::Normal, 1), t);
        }
        // Two slots free up, then the other tenant arrives.
        assert_eq!(q.take_for(|_| true, |_| true, t).map(|x| x.0), Some(0));
        assert_eq!(q.take_for(|_| true, |_| true, t).map(|x| x.0), Some(1));
        q.push(5000, msg("m"), &who("calm", Priority::Normal, 1), t);
        let next: Vec<_> = (0..2)
            .filter_map(|_| q.take_for(|_| true, |_| true, t).map(|x| x.0))
            .collect();
        assert!(next.contains(&5000), "served within one slot: {next:?}");
    }

    #[test]
    fn weights_share_turns() {
        let t = Instant::now();
        let mut q = FairQueue::new(None);
        for id in 0..40 {
            q.push(id, msg("m"), &who("one", Priority::Normal, 1), t);
            q.push(100 + id, msg("m"), &who("three", Priority::Normal, 3), t);
        }
        let first: Vec<_> = take_all(&mut q, t).into_iter().take(40).collect();
        let three = first.iter().filter(|id| **id >= 100).count();
        assert!((29..=31).contains(&three), "3:1 share, got {three} of 40");
    }

    #[test]
    fn priority_is_strict_and_aging_lifts_low() {
        let t = Instant::now();
        let aging = Duration::from_secs(10);
        let mut q = FairQueue::new(Some(aging));
        q.push(1, msg("m"), &who("a", Priority::Low, 1), t);
        q.push(2, msg("m"), &who("a", Priority::Normal, 1), t);
        q.push(3, msg("m"), &who("b", Priority::High, 1), t);
        assert_eq!(q.take_for(|_| true, |_| true, t).map(|x| x.0), Some(3));
        // Before aging, normal beats low.
        q.push(
            4,
            msg("m"),
            &who("c", Priority::Normal, 1),
            t + Duration::from_secs(9),
        );
        assert_eq!(
            q.take_for(|_| true, |_| true, t + Duration::from_secs(9))
                .map(|x| x.0),
            Some(2)
        );
        // After 10 s the low request is normal and was stamped before 4... it is now
        // compared by tag with 4; after 20 s it is high and goes first for sure.
        q.push(
            5,
            msg("m"),
            &who("c", Priority::Normal, 1),
            t + Duration::from_secs(19),
        );
        let at20 = t + Duration::from_secs(20);
        assert_eq!(q.take_for(|_| true, |_| true, at20).map(|x| x.0), Some(1));
        assert_eq!(q.position(4), Some(0));
    }

    #[test]
    fn an_aged_request_goes_before_its_tenants_later_arrivals() {
        let t = Instant::now();
        let mut q = FairQueue::new(Some(Duration::from_secs(10)));
        q.push(1, msg("m"), &who("a", Priority::Low, 1), t);
        let later = t + Duration::from_secs(5);
        q.push(2, msg("m"), &who("a", Priority::Normal, 1), later);
        q.push(3, msg("m"), &who("a", Priority::Normal, 1), later);
        // At 11 s the low request is normal: it waited longest, so it leaves first.
        let at11 = t + Duration::from_secs(11);
        assert_eq!(take_all(&mut q, at11), vec![1, 2, 3]);
    }

    #[test]
    fn a_restored_request_keeps_its_place() {
        let t = Instant::now();
        let mut q = FairQueue::new(None);
        for id in 0..3 {
            q.push(id, msg("m"), &who("a", Priority::Normal, 1), t);
        }
        let (first, place) = q
            .take_for(|_| true, |_| true, t)
            .unwrap_or((99, dummy_place(t)));
        assert_eq!(first, 0);
        q.push(9, msg("m"), &who("b", Priority::Normal, 1), t);
        q.restore(0, msg("m"), &who("a", Priority::Normal, 1), place);
        assert_eq!(take_all(&mut q, t)[0], 0, "back at the front");
    }

    fn dummy_place(t: Instant) -> Place {
        Place {
            class: Priority::Normal,
            tag: 0,
            seq: 0,
            class_since: t,
        }
    }

    #[test]
    fn workers_take_only_models_they_serve_and_counts_follow() {
        let t = Instant::now();
        let mut q = FairQueue::new(None);
        q.push(1, msg("big"), &who("a", Priority::High, 1), t);
        q.push(2, msg("small"), &who("a", Priority::Low, 1), t);
        assert_eq!(q.tenant_len("a"), 2);
        assert_eq!(
            q.take_for(|m| m == "small", |_| true, t).map(|x| x.0),
            Some(2)
        );
        assert_eq!(q.take_for(|m| m == "small", |_| true, t), None);
        assert_eq!(q.tenant_len("a"), 1);
        assert_eq!(q.remove(1).map(|p| p.class()), Some(Priority::High));
        assert_eq!(q.tenant_len("a"), 0);
        assert_eq!(q.tenants().count(), 0);
        assert!(q
            .classes
            .iter()
            .all(|c| c.by_model.is_empty() && c.by_age.is_empty() && c.tenants.is_empty()));
    }
}
