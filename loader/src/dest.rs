//! Where loaded chunks go, behind one trait.
//!
//! A strategy asks the destination for memory to read chunk `i` into and tells it when the chunk
//! has landed and passed verification. What happens then is the destination's business:
//! * [`HostArena`] (now): the memory *is* the final weight arena, so landing is a no-op and the
//!   only work is faulting fresh huge pages in ahead of the reads ([`Destination::prefault`]).
//! * [`crate::StagingRing`] (for device memory): `region` hands out one of a ring of staging
//!   buffers (waiting for its previous copy's event), `landed` queues the host-to-device copy on
//!   a [`crate::CopyEngine`] — the next reads overlap the copy. The CUDA backend supplies pinned
//!   buffers and a copy stream; the tests a fake asynchronous engine.
//!   [`Destination::max_regions`] caps reads in flight at the ring's size so a read never waits
//!   for a buffer that only its own completion could free.

use std::sync::Arc;

use crate::plan::{Chunk, LoadPlan};
use crate::{AlignedBuf, LoadError};

pub trait Destination: Sync {
    /// Called once with the plan before any read (allocate arenas, device memory, staging).
    fn prepare(&mut self, plan: &LoadPlan) -> Result<(), LoadError>;
    /// How many regions may be held at once; reads in flight are capped to this.
    fn max_regions(&self) -> usize {
        usize::MAX
    }
    /// Called in plan order ahead of the reads, possibly on another thread, before `region(i)`.
    fn prefault(&self, _i: usize, _chunk: &Chunk) {}
    /// Memory for chunk `i`: `chunk.len` bytes, 4 KiB-aligned, the caller's alone until
    /// `landed(i)` returns.
    fn region(&self, i: usize, chunk: &Chunk) -> Result<*mut u8, LoadError>;
    /// [`Destination::region`] if memory is ready for it, else `None` without waiting (a
    /// destination still allocating): a reader with reads in flight then reaps those instead
    /// of blocking behind the allocation.
    fn try_region(&self, i: usize, chunk: &Chunk) -> Result<Option<*mut u8>, LoadError> {
        self.region(i, chunk).map(Some)
    }
    /// The first `len` bytes of chunk `i`'s region hold verified data.
    fn landed(&self, i: usize, chunk: &Chunk, len: u64) -> Result<(), LoadError>;
}

/// Host memory: one huge-page arena per shard mirroring its block-aligned data range. The arenas
/// are shared (`Arc`): a streaming load hands them to the model while its reader thread keeps a
/// [`HostArena::share`] of them to fill — disjoint chunks, each published only once landed.
#[derive(Default)]
pub struct HostArena {
    arenas: Vec<Arc<AlignedBuf>>,
    bases: Vec<usize>,
    aligned_start: Vec<u64>,
}

/// Faulting one byte per huge page faults the whole page.
const PREFAULT_STEP: usize = 2 << 20;

impl HostArena {
    pub fn new() -> HostArena {
        HostArena::default()
    }

    pub fn into_arenas(self) -> Vec<Arc<AlignedBuf>> {
        self.arenas
    }

    /// Another handle on the same (prepared) arenas.
    pub fn share(&self) -> HostArena {
        HostArena {
            arenas: self.arenas.clone(),
            bases: self.bases.clone(),
            aligned_start: self.aligned_start.clone(),
        }
    }

    /// Address of chunk `c`'s region.
    fn addr(&self, c: &Chunk) -> usize {
        self.bases[c.shard] + (c.file_off - self.aligned_start[c.shard]) as usize
    }
}

impl Destination for HostArena {
    fn prepare(&mut self, plan: &LoadPlan) -> Result<(), LoadError> {
        if !self.arenas.is_empty() {
            return Ok(()); // a share of arenas prepared (for this plan) by the original
        }
        self.arenas = plan
            .shards
            .iter()
            .map(|s| Arc::new(AlignedBuf::zeroed(s.aligned_len as usize)))
            .collect();
        self.bases = self.arenas.iter().map(|a| a.as_ptr() as usize).collect();
        self.aligned_start = plan.shards.iter().map(|s| s.aligned_start).collect();
        Ok(())
    }

    fn prefault(&self, _i: usize, c: &Chunk) {
        let (start, end) = (self.addr(c), self.addr(c) + c.len as usize);
        let mut at = start;
        while at < end {
            // SAFETY: `at` lies inside this chunk's part of its arena; the strategy calls
            // `prefault(i)` before handing the region to a read, so nothing else writes it now,
            // and writing 0 to a fresh (zero) page changes no data.
            unsafe { std::ptr::write_volatile(at as *mut u8, 0u8) };
            at = (at / PREFAULT_STEP + 1) * PREFAULT_STEP;
        }
    }

    fn region(&self, _i: usize, c: &Chunk) -> Result<*mut u8, LoadError> {
        Ok(self.addr(c) as *mut u8)
    }

    fn landed(&self, _i: usize, _c: &Chunk, _len: u64) -> Result<(), LoadError> {
        Ok(())
    }
}
