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

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
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
}

pub struct StagingRing<B: StagingBuf, E: CopyEngine> {
    bufs: Vec<B>,
    engine: E,
    ring: Mutex<Ring<E::Event>>,
    /// The plan's shards (where a chunk lands in device memory).
    shards: Vec<crate::plan::ShardPlan>,
    /// Time readers and `finish` spent waiting for copies (the copy work reads did not hide).
    waited_ns: AtomicU64,
}

impl<B: StagingBuf, E: CopyEngine> StagingRing<B, E> {
    pub fn new(bufs: Vec<B>, engine: E) -> StagingRing<B, E> {
        let free = (0..bufs.len()).map(|i| (i, None)).collect();
        StagingRing {
            bufs,
            engine,
            ring: Mutex::new(Ring {
                free,
                held: HashMap::new(),
            }),
            shards: vec![],
            waited_ns: AtomicU64::new(0),
        }
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
            let mut r = self.ring.lock().unwrap_or_else(|e| e.into_inner());
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

fn err(msg: String) -> LoadError {
    LoadError::invalid(std::path::Path::new("staging ring"), msg)
}

impl<B: StagingBuf, E: CopyEngine> Destination for StagingRing<B, E> {
    fn prepare(&mut self, plan: &LoadPlan) -> Result<(), LoadError> {
        let biggest = plan.chunks.iter().map(|c| c.len).max().unwrap_or(0) as usize;
        if let Some(small) = self.bufs.iter().find(|b| b.len() < biggest) {
            return Err(err(format!(
                "staging buffers of {} bytes cannot hold chunks of {biggest}",
                small.len()
            )));
        }
        self.shards = plan.shards.clone();
        self.engine.prepare(plan)
    }

    fn max_regions(&self) -> usize {
        self.bufs.len()
    }

    fn region(&self, i: usize, _c: &Chunk) -> Result<*mut u8, LoadError> {
        let (b, ev) = {
            let mut r = self.ring.lock().unwrap_or_else(|e| e.into_inner());
            let (b, ev) = r.free.pop_front().ok_or_else(|| {
                err("a region was requested with every staging buffer in use".into())
            })?;
            r.held.insert(i, b);
            (b, ev)
        };
        // The buffer's previous copy must be done before the read overwrites it.
        if let Some(ev) = ev {
            self.wait(ev)?;
        }
        Ok(self.bufs[b].ptr())
    }

    fn landed(&self, i: usize, c: &Chunk, len: u64) -> Result<(), LoadError> {
        let b = self
            .ring
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .held
            .remove(&i)
            .ok_or_else(|| err(format!("chunk {i} landed without a region")))?;
        let dst = self.shards[c.shard].device_off(c.file_off);
        // SAFETY: buffer `b` holds `len` landed bytes (len ≤ its size, checked in prepare) and
        // is not handed out again before this copy's event has been waited on.
        let ev = unsafe {
            self.engine
                .copy(self.bufs[b].ptr(), len as usize, c.shard, dst)?
        };
        self.ring
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .free
            .push_back((b, Some(ev)));
        Ok(())
    }
}
