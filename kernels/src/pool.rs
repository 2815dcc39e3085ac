//! A small fork-join thread pool tuned for the decode loop.
//!
//! A batch-1 decode step issues a few hundred parallel regions of a few microseconds each, so the
//! cost of waking threads matters more than anything a general pool (rayon) optimizes for. Here a
//! call publishes a job by bumping an epoch counter; workers that are spinning see it within
//! nanoseconds, workers that went to sleep after a while idle are unparked. Tasks are claimed with
//! one atomic `fetch_add` each, the caller works too, and returns when every task has finished.
//! Calls from different threads are serialized by a mutex; a job must not call back into the pool.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::thread::{self, JoinHandle, Thread};
use std::time::{Duration, Instant};

type Job = dyn Fn(usize) + Sync;

struct Shared {
    epoch: AtomicU64,
    /// Points at the caller's closure while `epoch` is odd-numbered-job live; see `run`.
    job: AtomicUsize,
    job_meta: AtomicUsize,
    n_tasks: AtomicUsize,
    next: AtomicUsize,
    /// Workers still inside the current job.
    busy: AtomicUsize,
    stop: AtomicBool,
}

pub struct ThreadPool {
    shared: Arc<Shared>,
    workers: Vec<(Thread, Option<JoinHandle<()>>)>,
    call: Mutex<()>,
}

/// How long an idle worker spins before it parks.
const SPIN: Duration = Duration::from_micros(200);

impl ThreadPool {
    /// A pool with `threads` threads in all (the caller counts as one).
    pub fn new(threads: usize) -> ThreadPool {
        let shared = Arc::new(Shared {
            epoch: AtomicU64::new(0),
            job: AtomicUsize::new(0),
            job_meta: AtomicUsize::new(0),
            n_tasks: AtomicUsize::new(0),
            next: AtomicUsize::new(0),
            busy: AtomicUsize::new(0),
            stop: AtomicBool::new(false),
        });
        let workers = (1..threads.max(1))
            .map(|i| {
                let s = shared.clone();
                let h = thread::Builder::new()
                    .name(format!("thaw-cpu-{i}"))
                    .spawn(move || worker(s))
                    .expect("spawning a kernel thread");
                (h.thread().clone(), Some(h))
            })
            .collect();
        ThreadPool {
            shared,
            workers,
            call: Mutex::new(()),
        }
    }

    /// The process-wide pool: `THAW_THREADS` threads, or one per available core.
    pub fn global() -> &'static ThreadPool {
        static POOL: OnceLock<ThreadPool> = OnceLock::new();
        POOL.get_or_init(|| {
            let n = std::env::var("THAW_THREADS")
                .ok()
                .and_then(|v| v.parse().ok())
                .unwrap_or_else(|| {
                    thread::available_parallelism()
                        .map(|n| n.get())
                        .unwrap_or(1)
                });
            ThreadPool::new(n)
        })
    }

    pub fn threads(&self) -> usize {
        self.workers.len() + 1
    }

    /// Runs `f(i)` for every `i in 0..n_tasks` across the pool; returns when all are done.
    pub fn run(&self, n_tasks: usize, f: &(dyn Fn(usize) + Sync)) {
        if n_tasks == 0 {
            return;
        }
        if n_tasks == 1 || self.workers.is_empty() {
            (0..n_tasks).for_each(f);
            return;
        }
        let _guard = self.call.lock().unwrap_or_else(|e| e.into_inner());
        let s = &*self.shared;
        // SAFETY: a fat pointer is two words; we store them in two atomics and rebuild it in the
        // workers. The closure outlives its use because we wait below until `busy` is zero, and
        // workers only touch the pointer between seeing the new epoch and decrementing `busy`.
        let ptr: *const (dyn Fn(usize) + Sync + '_) = f;
        let raw: [usize; 2] =
            unsafe { std::mem::transmute::<*const (dyn Fn(usize) + Sync + '_), [usize; 2]>(ptr) };
        s.job.store(raw[0], Ordering::Relaxed);
        s.job_meta.store(raw[1], Ordering::Relaxed);
        s.n_tasks.store(n_tasks, Ordering::Relaxed);
        s.next.store(0, Ordering::Relaxed);
        s.busy.store(self.workers.len(), Ordering::Relaxed);
        s.epoch.fetch_add(1, Ordering::Release);
        for (t, _) in &self.workers {
            t.unpark();
        }
        run_tasks(s, f);
        while s.busy.load(Ordering::Acquire) != 0 {
            std::hint::spin_loop();
        }
    }
}

fn run_tasks(s: &Shared, f: &(dyn Fn(usize) + Sync + '_)) {
    let n = s.n_tasks.load(Ordering::Relaxed);
    loop {
        let i = s.next.fetch_add(1, Ordering::Relaxed);
        if i >= n {
            break;
        }
        f(i);
    }
}

fn worker(s: Arc<Shared>) {
    // Epoch 0 is the pool's creation: a job published before this thread first runs must still
    // be seen, so start from 0 rather than from the current value.
    let mut seen = 0;
    loop {
        let start = Instant::now();
        let mut spins = 0u32;
        loop {
            let e = s.epoch.load(Ordering::Acquire);
            if e != seen {
                seen = e;
                break;
            }
            if s.stop.load(Ordering::Relaxed) {
                return;
            }
            spins += 1;
            if spins.is_multiple_of(1024) && start.elapsed() > SPIN {
                thread::park_timeout(Duration::from_millis(50));
            } else {
                std::hint::spin_loop();
            }
        }
        let raw = [
            s.job.load(Ordering::Relaxed),
            s.job_meta.load(Ordering::Relaxed),
        ];
        // SAFETY: rebuilt from the pointer `run` stored before bumping the epoch (Release/Acquire
        // orders those stores before this load); `run` keeps the closure alive until `busy` is 0.
        let f: &Job = unsafe { &*std::mem::transmute::<[usize; 2], *const Job>(raw) };
        run_tasks(&s, f);
        s.busy.fetch_sub(1, Ordering::Release);
    }
}

impl Drop for ThreadPool {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Relaxed);
        for (t, h) in &mut self.workers {
            t.unpark();
            if let Some(h) = h.take() {
                let _ = h.join();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_every_task_once() {
        let pool = ThreadPool::new(3);
        for n in [0, 1, 2, 7, 1000] {
            let hits: Vec<AtomicUsize> = (0..n).map(|_| AtomicUsize::new(0)).collect();
            pool.run(n, &|i| {
                hits[i].fetch_add(1, Ordering::Relaxed);
            });
            assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1));
        }
    }

    #[test]
    fn survives_idle_parking_and_concurrent_callers() {
        let pool = Arc::new(ThreadPool::new(2));
        std::thread::sleep(Duration::from_millis(5));
        let handles: Vec<_> = (0..4)
            .map(|_| {
                let p = pool.clone();
                std::thread::spawn(move || {
                    let sum = AtomicUsize::new(0);
                    for _ in 0..200 {
                        p.run(16, &|i| {
                            sum.fetch_add(i, Ordering::Relaxed);
                        });
                    }
                    sum.load(Ordering::Relaxed)
                })
            })
            .collect();
        for h in handles {
            assert_eq!(h.join().unwrap(), 200 * 120);
        }
    }
}
