//! Concurrent load for benches and tests: `clients` threads share `total` jobs, each
//! taking the next index until none is left. Returns every job's result.
#![allow(dead_code)]

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

pub fn spread<T, F>(clients: usize, total: usize, job: F) -> Vec<T>
where
    T: Send + 'static,
    F: Fn(usize) -> T + Send + Sync + 'static,
{
    let next = Arc::new(AtomicUsize::new(0));
    let job = Arc::new(job);
    let threads: Vec<_> = (0..clients)
        .map(|_| {
            let (next, job) = (next.clone(), job.clone());
            std::thread::spawn(move || {
                let mut out = Vec::new();
                loop {
                    let i = next.fetch_add(1, Ordering::SeqCst);
                    if i >= total {
                        return out;
                    }
                    out.push(job(i));
                }
            })
        })
        .collect();
    threads
        .into_iter()
        .flat_map(|t| t.join().unwrap_or_default())
        .collect()
}
