//! The affinity memory alone: longest held prefix, least-recently-used eviction at the
//! bound, forgetting a model or a worker, and the wait counts.

use super::*;

const M: u64 = 11;
const OTHER: u64 = 22;

#[test]
fn matched_is_the_longest_prefix_a_worker_holds() {
    let mut a = Affinity::default();
    a.remember(1, M, &[10, 20]);
    a.remember(2, M, &[10, 20, 30, 40]);
    let turn = [10, 20, 30, 40, 50, 60];
    assert_eq!(a.matched(1, M, &turn), 2);
    assert_eq!(a.matched(2, M, &turn), 4);
    assert_eq!(a.matched(3, M, &turn), 0, "an unknown worker holds nothing");
    assert_eq!(a.matched(1, M, &[99, 20]), 2, "the longest held one counts");
    assert_eq!(a.matched(1, OTHER, &turn), 0, "per model");
    assert_eq!(a.held(2), 4);
}

#[test]
fn the_least_recently_used_go_first_and_the_set_stays_bounded() {
    let mut a = Affinity::default();
    a.remember(1, M, &[1]);
    let filler: Vec<u64> = (1000..1000 + PER_WORKER as u64 - 1).collect();
    a.remember(1, M, &filler);
    assert_eq!(a.held(1), PER_WORKER);
    a.remember(1, M, &[1]); // used again: now the newest
    a.remember(1, M, &[5, 6]);
    assert_eq!(a.held(1), PER_WORKER, "never more than the bound");
    assert_eq!(a.matched(1, M, &[1]), 1, "recently used, kept");
    assert_eq!(a.matched(1, M, &[1000]), 0, "the oldest went");
    assert_eq!(a.matched(1, M, &[1001]), 0);
    assert_eq!(a.matched(1, M, &[1002]), 1);
    assert_eq!(a.matched(1, M, &[6]), 1);
    // Churn well past the bound keeps it there.
    for round in 0..4u64 {
        let batch: Vec<u64> = (0..1000).map(|i| 1_000_000 * (round + 1) + i).collect();
        a.remember(1, M, &batch);
    }
    assert_eq!(a.held(1), PER_WORKER);
}

#[test]
fn a_model_or_a_worker_is_forgotten_and_slots_are_reused() {
    let mut a = Affinity::default();
    a.remember(1, M, &[1, 2, 3]);
    a.remember(1, OTHER, &[4, 5]);
    a.remember(2, M, &[1, 2, 3]);
    a.forget_model(1, M);
    assert_eq!(a.matched(1, M, &[1, 2, 3]), 0);
    assert_eq!(a.matched(1, OTHER, &[4, 5]), 2, "the other model stays");
    assert_eq!(a.held(1), 2);
    a.remember(1, M, &[7, 8, 9]);
    assert_eq!(a.held(1), 5, "freed slots reused");
    assert_eq!(a.matched(1, M, &[7, 8, 9]), 3);
    a.forget_worker(1);
    assert_eq!(a.held(1), 0);
    assert_eq!(a.matched(2, M, &[1, 2, 3]), 3, "other workers keep theirs");
    a.forget_model(2, M);
    assert_eq!(a.held(2), 0);
}

#[test]
fn waits_are_counted_per_worker() {
    let mut a = Affinity::default();
    a.start_wait(1);
    a.start_wait(1);
    a.start_wait(2);
    assert_eq!((a.waiting_for(1), a.waiting_for(2)), (2, 1));
    a.end_wait(1);
    a.end_wait(2);
    a.end_wait(2);
    assert_eq!((a.waiting_for(1), a.waiting_for(2)), (1, 0));
}

#[test]
fn memory_per_worker_is_as_the_readme_says() {
    // docs/routing.md and the module docs state about 116 KiB for a full set.
    let slot = std::mem::size_of::<Slot>();
    let bucket = std::mem::size_of::<(Key, u32)>() + 1;
    let buckets = (PER_WORKER * 8 / 7).next_power_of_two();
    let bytes = PER_WORKER * slot + buckets * bucket;
    assert_eq!(slot, 24);
    assert!(bytes <= 120 * 1024, "{bytes} bytes");
}
