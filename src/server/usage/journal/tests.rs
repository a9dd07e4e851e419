//! Unit tests of `journal`.

use super::*;
use std::sync::atomic::{AtomicU64, Ordering};

const NOW: u64 = 1_750_000_000; // a fixed "now", unix seconds
const HOUR: u64 = NOW / 3600;

fn temp_dir(tag: &str) -> PathBuf {
    static SEQ: AtomicU64 = AtomicU64::new(0);
    let n = SEQ.fetch_add(1, Ordering::Relaxed);
    let dir = std::env::temp_dir().join(format!("mr-usage-{tag}-{}-{n}", std::process::id()));
    let _ = fs::remove_dir_all(&dir);
    dir
}

fn key(hour: u64, k: &str, t: &str, m: &str, w: &str) -> Key {
    Key {
        hour,
        key: k.into(),
        tenant: t.into(),
        model: m.into(),
        worker: w.into(),
    }
}

fn usage(requests: u64, tokens_in: u64, tokens_out: u64) -> Usage {
    Usage {
        requests,
        tokens_in,
        tokens_out,
    }
}

fn line(hour: u64, k: &str, n: u64, i: u64, o: u64) -> String {
    format!(r#"{{"h":{hour},"k":"{k}","t":"t","m":"m","w":"w","n":{n},"i":{i},"o":{o}}}"#)
}

fn write_file(dir: &Path, body: &str) {
    fs::create_dir_all(dir).unwrap();
    fs::write(dir.join(FILE_NAME), body).unwrap();
}

#[test]
fn add_flush_reopen_gives_exact_totals() {
    let dir = temp_dir("reopen");
    let j = Journal::open(&dir, 400, NOW).unwrap();
    j.add(key(HOUR, "a", "t1", "m1", "w1"), usage(1, 10, 20));
    j.add(key(HOUR, "a", "t1", "m1", "w1"), usage(1, 5, 7));
    j.flush().unwrap();
    j.add(key(HOUR, "a", "t1", "m1", "w1"), usage(1, 1, 1));
    j.add(key(HOUR - 1, "b", "t2", "m2", "w2"), usage(2, 100, 200));
    j.flush().unwrap();
    j.flush().unwrap(); // nothing pending: no record
    assert_eq!(j.totals(), usage(5, 116, 228));
    assert_eq!(j.stats().file_records, 3);
    drop(j);
    let j = Journal::open(&dir, 400, NOW).unwrap();
    assert_eq!(j.totals(), usage(5, 116, 228));
    assert_eq!(j.stats().live_buckets, 2);
    assert_eq!(j.stats().corrupt_skipped, 0);
    let _ = fs::remove_dir_all(&dir);
}

#[test]
fn unflushed_adds_are_not_on_disk() {
    let dir = temp_dir("unflushed");
    let j = Journal::open(&dir, 400, NOW).unwrap();
    j.add(key(HOUR, "a", "t", "m", "w"), usage(1, 10, 20));
    j.flush().unwrap();
    j.add(key(HOUR, "a", "t", "m", "w"), usage(1, 10, 20));
    let j2 = Journal::open(&dir, 400, NOW).unwrap();
    assert_eq!(j2.totals(), usage(1, 10, 20));
    let _ = fs::remove_dir_all(&dir);
}

#[test]
fn saturating_adds() {
    let mut u = usage(u64::MAX - 1, 1, 2);
    u.add(&usage(5, 1, 1));
    assert_eq!(u, usage(u64::MAX, 2, 3));
}

#[test]
fn torn_last_line_is_skipped_and_file_repaired() {
    let dir = temp_dir("torn");
    let body = format!(
        "{}\n{}\n{{\"h\":{HOUR},\"k\":\"a\",\"t",
        line(HOUR, "a", 1, 10, 20),
        line(HOUR, "b", 2, 3, 4)
    );
    write_file(&dir, &body);
    let j = Journal::open(&dir, 400, NOW).unwrap();
    assert_eq!(j.totals(), usage(3, 13, 24));
    assert_eq!(j.stats().corrupt_skipped, 1);
    // Rewritten clean on open, so new appends start on a fresh line.
    j.add(key(HOUR, "c", "t", "m", "w"), usage(1, 1, 1));
    j.flush().unwrap();
    drop(j);
    let j = Journal::open(&dir, 400, NOW).unwrap();
    assert_eq!(j.totals(), usage(4, 14, 25));
    assert_eq!(j.stats().corrupt_skipped, 0);
    let _ = fs::remove_dir_all(&dir);
}

#[test]
fn complete_last_record_without_newline_counts_once() {
    let dir = temp_dir("nonl");
    write_file(&dir, &line(HOUR, "a", 1, 10, 20));
    let j = Journal::open(&dir, 400, NOW).unwrap();
    j.add(key(HOUR, "a", "t", "m", "w"), usage(1, 1, 1));
    j.flush().unwrap();
    drop(j);
    let j = Journal::open(&dir, 400, NOW).unwrap();
    assert_eq!(j.totals(), usage(2, 11, 21));
    assert_eq!(j.stats().corrupt_skipped, 0);
    let _ = fs::remove_dir_all(&dir);
}

#[test]
fn corrupt_middle_lines_are_skipped_and_counted() {
    let dir = temp_dir("corrupt");
    let body = format!(
        "{}\nnot json at all\n{{\"h\":1}}\n\n{}\n",
        line(HOUR, "a", 1, 10, 20),
        line(HOUR, "a", 1, 1, 1)
    );
    write_file(&dir, &body);
    let j = Journal::open(&dir, 400, NOW).unwrap();
    assert_eq!(j.totals(), usage(2, 11, 21));
    assert_eq!(j.stats().corrupt_skipped, 2);
    assert_eq!(j.stats().live_buckets, 1);
    let _ = fs::remove_dir_all(&dir);
}

#[test]
fn retention_drops_old_buckets_on_load_and_add() {
    let dir = temp_dir("retention");
    let body = format!(
        "{}\n{}\n{}\n",
        line(HOUR - 48, "old", 1, 1, 1),
        line(HOUR - 47, "edge", 2, 2, 2),
        line(HOUR, "new", 4, 4, 4)
    );
    write_file(&dir, &body);
    let j = Journal::open(&dir, 2, NOW).unwrap();
    assert_eq!(j.totals(), usage(6, 6, 6));
    j.add(key(HOUR - 100, "late", "t", "m", "w"), usage(9, 9, 9));
    assert_eq!(j.totals(), usage(6, 6, 6));
    // The newest hour moves on: the next flush a day later prunes memory.
    j.add(key(HOUR + 24, "later", "t", "m", "w"), usage(8, 8, 8));
    j.flush().unwrap();
    assert_eq!(j.totals(), usage(12, 12, 12));
    assert_eq!(j.stats().live_buckets, 2);
    j.compact().unwrap();
    drop(j);
    let j = Journal::open(&dir, 2, NOW).unwrap();
    assert_eq!(j.stats().file_records, 2);
    assert_eq!(j.totals(), usage(12, 12, 12));
    let kept = Journal::open(&dir, 0, NOW + 1_000 * 86_400).unwrap();
    assert_eq!(kept.totals(), usage(12, 12, 12));
    let _ = fs::remove_dir_all(&dir);
}

#[test]
fn compaction_keeps_totals_exact_and_shrinks_the_file() {
    let dir = temp_dir("compact");
    let j = Journal::open(&dir, 400, NOW).unwrap();
    let mut expected = Usage::default();
    for round in 0..100u64 {
        for k in 0..50u64 {
            let u = usage(1, round + k, 2 * k);
            expected.add(&u);
            j.add(key(HOUR + k % 3, &format!("k{k}"), "t", "m", "w"), u);
        }
        j.flush().unwrap();
        let stats = j.stats();
        assert!(
            stats.file_records < COMPACT_MIN_RECORDS.max(2 * stats.live_buckets) + 50,
            "{stats:?}"
        );
    }
    let stats = j.stats();
    assert!(stats.compactions >= 1, "{stats:?}");
    assert_eq!(j.totals(), expected);
    let before = fs::metadata(j.path()).unwrap().len();
    assert_eq!(before, stats.file_bytes);
    j.compact().unwrap();
    let after = fs::metadata(j.path()).unwrap().len();
    assert!(after < before, "{after} < {before}");
    assert_eq!(j.stats().file_records, 50);
    drop(j);
    let j = Journal::open(&dir, 400, NOW).unwrap();
    assert_eq!(j.totals(), expected);
    assert_eq!(j.stats().live_buckets, 50);
    let leftovers: Vec<_> = fs::read_dir(&dir).unwrap().collect();
    assert_eq!(leftovers.len(), 1, "no temp files left behind");
    let _ = fs::remove_dir_all(&dir);
}

fn sample() -> (Journal, PathBuf) {
    let dir = temp_dir("query");
    let j = Journal::open(&dir, 400, NOW).unwrap();
    let day0 = (HOUR / 24) * 24;
    j.add(key(day0, "ka", "ta", "m1", "w1"), usage(1, 10, 1));
    j.add(key(day0, "kb", "ta", "m2", "w1"), usage(1, 20, 2));
    j.add(key(day0 + 1, "ka", "ta", "m2", "w2"), usage(1, 30, 3));
    j.add(key(day0 + 24, "kc", "tb", "m1", "w2"), usage(1, 40, 4));
    (j, dir)
}

fn rows(j: &Journal, from: u64, to: u64, g: GroupBy, b: Bucket) -> Vec<(u64, String, u64)> {
    j.query(from, to, g, b)
        .into_iter()
        .map(|r| (r.start, r.group, r.usage.tokens_in))
        .collect()
}

#[test]
fn query_groups_by_each_dimension_per_hour() {
    let (j, dir) = sample();
    let d = (HOUR / 24) * 24;
    let (h0, h1, h24) = (d * 3600, (d + 1) * 3600, (d + 24) * 3600);
    let all = (0, u64::MAX);
    let s = |v: &str| v.to_string();
    assert_eq!(
        rows(&j, all.0, all.1, GroupBy::Key, Bucket::Hour),
        vec![
            (h0, s("ka"), 10),
            (h0, s("kb"), 20),
            (h1, s("ka"), 30),
            (h24, s("kc"), 40)
        ]
    );
    assert_eq!(
        rows(&j, all.0, all.1, GroupBy::Tenant, Bucket::Hour),
        vec![(h0, s("ta"), 30), (h1, s("ta"), 30), (h24, s("tb"), 40)]
    );
    assert_eq!(
        rows(&j, all.0, all.1, GroupBy::Model, Bucket::Hour),
        vec![
            (h0, s("m1"), 10),
            (h0, s("m2"), 20),
            (h1, s("m2"), 30),
            (h24, s("m1"), 40)
        ]
    );
    assert_eq!(
        rows(&j, all.0, all.1, GroupBy::Worker, Bucket::Hour),
        vec![(h0, s("w1"), 30), (h1, s("w2"), 30), (h24, s("w2"), 40)]
    );
    let _ = fs::remove_dir_all(&dir);
}

#[test]
fn query_sums_days_and_respects_bounds() {
    let (j, dir) = sample();
    let d = (HOUR / 24) * 24;
    let s = |v: &str| v.to_string();
    assert_eq!(
        rows(&j, 0, u64::MAX, GroupBy::Model, Bucket::Day),
        vec![
            (d * 3600, s("m1"), 10),
            (d * 3600, s("m2"), 50),
            ((d + 24) * 3600, s("m1"), 40)
        ]
    );
    // from is inclusive, to exclusive.
    assert_eq!(
        rows(&j, d + 1, d + 24, GroupBy::Key, Bucket::Hour),
        vec![((d + 1) * 3600, s("ka"), 30)]
    );
    assert_eq!(
        rows(&j, d, d + 1, GroupBy::Tenant, Bucket::Day),
        vec![(d * 3600, s("ta"), 30)]
    );
    assert!(j
        .query(d + 25, u64::MAX, GroupBy::Key, Bucket::Hour)
        .is_empty());
    let row = &j.query(d + 24, d + 25, GroupBy::Worker, Bucket::Hour)[0];
    assert_eq!(row.usage, usage(1, 40, 4));
    let _ = fs::remove_dir_all(&dir);
}

#[test]
fn concurrent_adds_and_flushes_stay_exact() {
    let dir = temp_dir("threads");
    let j = std::sync::Arc::new(Journal::open(&dir, 400, NOW).unwrap());
    let threads: Vec<_> = (0..4u64)
        .map(|t| {
            let j = j.clone();
            std::thread::spawn(move || {
                for i in 0..2_000u64 {
                    j.add(
                        key(HOUR, &format!("k{}", i % 7), "t", "m", &format!("w{t}")),
                        usage(1, 2, 3),
                    );
                    if i % 500 == 0 {
                        j.flush().unwrap();
                    }
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    j.flush().unwrap();
    assert_eq!(j.totals(), usage(8_000, 16_000, 24_000));
    let reopened = Journal::open(&dir, 400, NOW).unwrap();
    assert_eq!(reopened.totals(), usage(8_000, 16_000, 24_000));
    let _ = fs::remove_dir_all(&dir);
}

#[test]
fn unpublished_buckets_are_given_as_absolute_values_and_come_back_after_a_failure() {
    let dir = temp_dir("publish");
    let j = Journal::open(&dir, 400, NOW).unwrap();
    j.add(key(HOUR, "a", "t", "m", "w"), usage(1, 10, 20));
    assert!(
        j.take_unpublished().is_empty(),
        "not tracked without a store"
    );
    j.track_unpublished();
    let all = j.take_unpublished();
    assert_eq!(all, vec![(key(HOUR, "a", "t", "m", "w"), usage(1, 10, 20))]);
    assert!(!j.has_unpublished());
    j.add(key(HOUR, "a", "t", "m", "w"), usage(1, 1, 1));
    j.add(key(HOUR, "b", "t", "m", "w"), usage(1, 2, 2));
    let mut changed = j.take_unpublished();
    changed.sort_by(|x, y| x.0.cmp(&y.0));
    assert_eq!(
        changed,
        vec![
            (key(HOUR, "a", "t", "m", "w"), usage(2, 11, 21)),
            (key(HOUR, "b", "t", "m", "w"), usage(1, 2, 2)),
        ],
        "the bucket's whole value, not the delta"
    );
    j.mark_unpublished(changed.into_iter().map(|(k, _)| k));
    assert!(j.has_unpublished());
    assert_eq!(j.take_unpublished().len(), 2);
    let _ = fs::remove_dir_all(&dir);
}
