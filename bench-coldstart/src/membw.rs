//! The memory-read floor: how fast this machine's threads can stream a buffer far larger than
//! the caches, using the same thread pool the kernels use.

use std::time::Instant;

use thaw_kernels::ThreadPool;

/// Best-of-`reps` read bandwidth in GB/s over a `bytes`-sized buffer.
pub fn read_bandwidth(pool: &ThreadPool, bytes: usize, reps: usize) -> f64 {
    let words = bytes / 8;
    let buf: Vec<u64> = (0..words as u64).collect();
    let tasks = pool.threads() * 16;
    let chunk = words.div_ceil(tasks);
    let sums: Vec<std::sync::atomic::AtomicU64> = (0..tasks).map(|_| Default::default()).collect();
    let mut best = 0f64;
    for _ in 0..reps {
        let t = Instant::now();
        pool.run(tasks, &|i| {
            let s = &buf[(i * chunk).min(words)..((i + 1) * chunk).min(words)];
            // Eight independent lanes so the loop vectorizes into wide loads.
            let mut acc = [0u64; 8];
            for c in s.chunks_exact(8) {
                for l in 0..8 {
                    acc[l] = acc[l].wrapping_add(c[l]);
                }
            }
            sums[i].store(
                acc.iter().fold(0, |a, &b| a.wrapping_add(b)),
                std::sync::atomic::Ordering::Relaxed,
            );
        });
        best = best.max(bytes as f64 / t.elapsed().as_secs_f64() / 1e9);
    }
    std::hint::black_box(&sums);
    best
}
