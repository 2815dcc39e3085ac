//! A ring of staging buffers between the reads and an asynchronous copy engine — the loader
//! destination for device memory (the CUDA backend supplies pinned buffers and a copy stream;
//! tests supply a fake engine that copies on another thread).
//!
//! Chunk `i` is read into a free staging buffer; when it has landed (and passed its integrity
//! check) the engine is asked to copy it to its place in device memory and returns an event.
//! The buffer goes back to the ring at once, tagged with that event; before it is handed out
//! again, the event is waited on — so a read never overwrites bytes still being copied, and
//! reads of later chunks overlap the copies of earlier ones. Buffers are reused oldest-copy
//! first, which is also the order the copies finish. [`Destination::max_regions`] is the ring
//! size, so the reader never asks for more buffers than exist.
//!
//! A ring made with [`StagingRing::background`] starts empty: its buffers are allocated on
//! threads of their own from the moment it is made, each joining the free list when ready, and
//! a read waits only while none is. Pinning and zeroing 16 × 8 MiB of host memory up front was
//! all on the load's critical path before the first read; now the first read waits for one
//! buffer, and the others' allocations overlap reads and copies already under way.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::Instant;

use crate::dest::Destination;
use crate::plan::{Chunk, LoadPlan};
use crate::LoadError;

/// Host memory a read can land in (pinned, for a real device).
pub trait StagingBuf: Send + Sync {
    fn ptr(&self) -> *mut u8;
    fn len(&self) -> usize;
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl StagingBuf for crate::AlignedBuf {
    fn ptr(&self) -> *mut u8 {
        self.as_ptr()
    }
    fn len(&self) -> usize {
        crate::AlignedBuf::len(self)
    }
}

/// Asynchronous host → device copies.
pub trait CopyEngine: Sync {
    /// Completes when a copy is done.
    type Event: Send;
    /// Allocates device memory for the plan (one region per shard, `device_len()` bytes).
    fn prepare(&mut self, plan: &LoadPlan) -> Result<(), LoadError>;
    /// Queues a copy of `len` bytes at `src` to offset `dst` of shard `shard`'s device region.
    ///
    /// # Safety
    /// `src` must be valid for `len` bytes and stay untouched until the returned event completes.
    unsafe fn copy(
        &self,
        src: *const u8,
        len: usize,
        shard: usize,
        dst: u64,
    ) -> Result<Self::Event, LoadError>;
    /// Blocks until `ev` has completed.
    fn wait(&self, ev: Self::Event) -> Result<(), LoadError>;
}

struct Ring<Ev> {
    /// Free buffers, oldest copy first, each with the event of its last copy.
    free: VecDeque<(usize, Option<Ev>)>,
    /// Chunk index → buffer holding it.
    held: HashMap<usize, usize>,
    /// Buffers still being allocated (a background ring).
    pending: usize,
    /// Why an allocation failed. The load fails: with fewer buffers than the readers were
    /// promised (`max_regions`), a reader holding every buffer could wait on its own reads.
    failed: Option<String>,
}

/// Makes one staging buffer (a background ring's allocator).
pub type MakeBuf<B> = Arc<dyn Fn() -> Result<B, LoadError> + Send + Sync>;

/// What the ring shares with its allocation threads.
struct Shared<B, Ev> {
    bufs: Vec<OnceLock<B>>,
    ring: Mutex<Ring<Ev>>,
    /// Signalled when a buffer joins the free list or an allocation fails.
    ready: Condvar,
    /// Allocation time summed over the allocating threads.
    alloc_ns: AtomicU64,
    /// From the ring's making to its first buffer ready: the allocation left on the critical
    /// path.
    first_ns: OnceLock<u64>,
}

impl<B, Ev> Shared<B, Ev> {
    /// Slots `bufs`, none free yet, `pending` of them still to be allocated.
    fn new(bufs: Vec<OnceLock<B>>, pending: usize) -> Arc<Self> {
        Arc::new(Shared {
            bufs,
            ring: Mutex::new(Ring {
                free: VecDeque::new(),
                held: HashMap::new(),
                pending,
                failed: None,
            }),
            ready: Condvar::new(),
            alloc_ns: AtomicU64::new(0),
            first_ns: OnceLock::new(),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Ring<Ev>> {
        self.ring.lock().unwrap_or_else(|e| e.into_inner())
    }
}

pub struct StagingRing<B: StagingBuf, E: CopyEngine> {
    shared: Arc<Shared<B, E::Event>>,
    /// A background ring's buffer size (a ring of buffers made beforehand has them to ask).
    buf_len: Option<usize>,
    engine: E,
    /// The plan's shards (where a chunk lands in device memory).
    shards: Vec<crate::plan::ShardPlan>,
    /// Time readers and `finish` spent waiting for copies (the copy work reads did not hide).
    waited_ns: AtomicU64,
}

impl<B: StagingBuf, E: CopyEngine> StagingRing<B, E> {
    /// The oldest free buffer, now held for chunk `i` (after its previous copy is done); with `block`,
    /// waiting for one still being allocated, else `None` while none is free.
    fn take(&self, i: usize, block: bool) -> Result<Option<*mut u8>, LoadError> {
        let (b, ev) = {
            let mut r = self.lock();
            let x = loop {
                if let Some(f) = &r.failed {
                    return Err(err(format!("allocating a staging buffer: {f}")));
                }
                if let Some(x) = r.free.pop_front() {
                    break x;
                }
                if r.pending == 0 {
                    return Err(err(
                        "a region was requested with every staging buffer in use".into(),
                    ));
                }
                if !block {
                    return Ok(None);
                }
                // None free yet, some still being allocated: wait for one.
                r = self.shared.ready.wait(r).unwrap_or_else(|e| e.into_inner());
            };
            r.held.insert(i, x.0);
            x
        };
        // The buffer's previous copy must be done before the read overwrites it.
        if let Some(ev) = ev {
            self.wait(ev)?;
        }
        Ok(Some(self.buf(b)?.ptr()))
    }

    /// A ring over buffers allocated beforehand.
    pub fn new(bufs: Vec<B>, engine: E) -> StagingRing<B, E> {
        let n = bufs.len();
        let shared = Shared::new(bufs.into_iter().map(OnceLock::from).collect(), 0);
        // (Every buffer is free, and "ready" from the start.)
        shared.lock().free.extend((0..n).map(|i| (i, None)));
        let _ = shared.first_ns.set(0);
        StagingRing::over(shared, None, engine)
    }

    fn over(shared: Arc<Shared<B, E::Event>>, buf_len: Option<usize>, engine: E) -> Self {
        StagingRing {
            shared,
            buf_len,
            engine,
            shards: vec![],
            waited_ns: AtomicU64::new(0),
        }
    }

    /// Buffers allocated so far.
    pub fn buffers_created(&self) -> usize {
        (self.shared.bufs.iter())
            .filter(|b| b.get().is_some())
            .count()
    }

    /// Waits until no allocation is in flight (tests; a load never needs to).
    pub fn allocations_done(&self) {
        let mut r = self.lock();
        while r.pending > 0 {
            r = self.shared.ready.wait(r).unwrap_or_else(|e| e.into_inner());
        }
    }

    /// Seconds the allocation threads spent allocating (summed; overlapped with the load).
    pub fn alloc_s(&self) -> f64 {
        self.shared.alloc_ns.load(Ordering::Relaxed) as f64 / 1e9
    }

    /// Seconds from the ring's making to its first buffer (0 for buffers made beforehand).
    pub fn first_buffer_s(&self) -> f64 {
        self.shared.first_ns.get().copied().unwrap_or(0) as f64 / 1e9
    }

    fn buf(&self, b: usize) -> Result<&B, LoadError> {
        self.shared.bufs[b]
            .get()
            .ok_or_else(|| err(format!("staging buffer {b} was never allocated")))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Ring<E::Event>> {
        self.shared.lock()
    }

    fn wait(&self, ev: E::Event) -> Result<(), LoadError> {
        let t = Instant::now();
        let r = self.engine.wait(ev);
        self.waited_ns
            .fetch_add(t.elapsed().as_nanos() as u64, Ordering::Relaxed);
        r
    }

    /// Seconds spent waiting on copies so far: the copy phase's share of the load that the
    /// reads did not overlap.
    pub fn copy_wait_s(&self) -> f64 {
        self.waited_ns.load(Ordering::Relaxed) as f64 / 1e9
    }

    /// Waits for every copy still in flight; then the device holds every landed chunk.
    pub fn finish(&self) -> Result<(), LoadError> {
        let pending: Vec<E::Event> = {
            let mut r = self.lock();
            r.free.iter_mut().filter_map(|(_, ev)| ev.take()).collect()
        };
        for ev in pending {
            self.wait(ev)?;
        }
        Ok(())
    }

    pub fn engine(&self) -> &E {
        &self.engine
    }

    pub fn into_engine(self) -> E {
        self.engine
    }
}

impl<B: StagingBuf + 'static, E: CopyEngine> StagingRing<B, E>
where
    E::Event: 'static,
{
    /// A ring of `size` buffers of `buf_len` bytes, each made by `make` on a thread of its own,
    /// starting now (see the module doc).
    pub fn background(size: usize, buf_len: usize, make: MakeBuf<B>, engine: E) -> Self {
        let t0 = Instant::now();
        let shared = Shared::new((0..size).map(|_| OnceLock::new()).collect(), size);
        for i in 0..size {
            let (sh, make) = (shared.clone(), make.clone());
            // Detached: a load that fails early does not wait for allocations it no longer
            // needs; such a buffer is freed with the last reference to `shared`.
            std::thread::spawn(move || {
                let t = Instant::now();
                let r = make().and_then(|b| {
                    if b.len() < buf_len {
                        return Err(err(format!(
                            "a staging buffer of {} bytes was made for {buf_len}",
                            b.len()
                        )));
                    }
                    Ok(b)
                });
                sh.alloc_ns
                    .fetch_add(t.elapsed().as_nanos() as u64, Ordering::Relaxed);
                let mut ring = sh.lock();
                ring.pending -= 1;
                match r {
                    Ok(b) => {
                        let _ = sh.bufs[i].set(b);
                        let _ = sh.first_ns.set(t0.elapsed().as_nanos() as u64);
                        ring.free.push_back((i, None));
                    }
                    Err(e) => {
                        ring.failed.get_or_insert(e.to_string());
                    }
                }
                drop(ring);
                sh.ready.notify_all();
            });
        }
        StagingRing::over(shared, Some(buf_len), engine)
    }
}

fn err(msg: String) -> LoadError {
    LoadError::invalid(std::path::Path::new("staging ring"), msg)
}

impl<B: StagingBuf, E: CopyEngine> Destination for StagingRing<B, E> {
    fn prepare(&mut self, plan: &LoadPlan) -> Result<(), LoadError> {
        let biggest = plan.chunks.iter().map(|c| c.len).max().unwrap_or(0) as usize;
        let made = (self.shared.bufs.iter()).filter_map(|b| b.get().map(|b| b.len()));
        if let Some(small) = made.chain(self.buf_len).find(|&l| l < biggest) {
            return Err(err(format!(
                "staging buffers of {small} bytes cannot hold chunks of {biggest}"
            )));
        }
        self.shards = plan.shards.clone();
        self.engine.prepare(plan)
    }

    fn max_regions(&self) -> usize {
        self.shared.bufs.len()
    }

    fn region(&self, i: usize, _c: &Chunk) -> Result<*mut u8, LoadError> {
        self.take(i, true)?
            .ok_or_else(|| err("no staging buffer while waiting for one".into()))
    }

    fn try_region(&self, i: usize, _c: &Chunk) -> Result<Option<*mut u8>, LoadError> {
        self.take(i, false)
    }

    fn landed(&self, i: usize, c: &Chunk, len: u64) -> Result<(), LoadError> {
        let b = (self.lock().held.remove(&i))
            .ok_or_else(|| err(format!("chunk {i} landed without a region")))?;
        let dst = self.shards[c.shard].device_off(c.file_off);
        // SAFETY: buffer `b` holds `len` landed bytes (len ≤ its size, checked in prepare) and
        // is not handed out again before this copy's event has been waited on.
        let ev = unsafe {
            self.engine
                .copy(self.buf(b)?.ptr(), len as usize, c.shard, dst)?
        };
        self.lock().free.push_back((b, Some(ev)));
        Ok(())
    }
}
