//! Device loads straight out of the page cache: when a checkpoint is resident, copying it into
//! pinned staging buffers first costs the host a read and a write of every byte (plus the
//! read-for-ownership of the buffer) while the DMA engine reads the same memory bus — the
//! suspected cap of the staging ring at ~72% of the pinned host → device floor on an H200 host
//! (not yet measured: `bench-coldstart gpu`'s load sweep runs both). Here the files
//! are mapped instead, and each chunk of a mapping is page-locked *in place* (CUDA's
//! `cuMemHostRegister`, read-only) and copied to the device by DMA: the CPU only pins pages.
//!
//! Each worker thread takes the next chunk in plan order (embeddings, layer 0, …), verifies it
//! against the manifest when there is one (reading the mapping), pins it, queues its copy, and
//! keeps at most `depth` chunks pinned: before pinning more it waits for its oldest copy and
//! unpins that chunk. Whatever happens — an error in this thread or another — every chunk it
//! pinned is waited for and unpinned before it returns, so no page stays locked and no copy
//! still reads a mapping that is about to be unmapped.
//!
//! The engine is a trait so this logic is tested on the CPU with a fake device
//! (`tests/mapped.rs`); the CUDA engine is `cuda::CudaCopy`.

use std::collections::VecDeque;
use std::fs::File;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::Instant;

use crate::plan::LoadPlan;
use crate::staging::CopyEngine;
use crate::LoadError;

/// A copy engine that can also lock host pages where they are, so it can copy from them.
pub trait PinInPlace: CopyEngine {
    /// Page-locks `len` bytes at `ptr` (page-aligned, inside a read-only mapping).
    ///
    /// # Safety
    /// `ptr..ptr + len` must stay mapped until [`PinInPlace::unpin`].
    unsafe fn pin(&self, ptr: *const u8, len: usize) -> Result<(), LoadError>;
    /// Undoes [`PinInPlace::pin`] of the range starting at `ptr`; no copy may still read it.
    ///
    /// # Safety
    /// `ptr` must start a range pinned by `pin` whose copies have all completed.
    unsafe fn unpin(&self, ptr: *const u8) -> Result<(), LoadError>;
}

/// Where the time went, summed over the worker threads.
#[derive(Debug, Clone, Copy, Default, serde::Serialize)]
pub struct MappedStats {
    pub threads: usize,
    pub pin_s: f64,
    pub unpin_s: f64,
    pub copy_wait_s: f64,
    pub verify_s: f64,
}

/// Host page size (pins cover whole pages).
const PAGE: usize = 4096;

/// Maps every shard read-only, checking each is still as long as its header said.
pub fn map_shards(plan: &LoadPlan) -> Result<Vec<memmap2::Mmap>, LoadError> {
    plan.shards
        .iter()
        .map(|s| {
            let f = File::open(&s.path).map_err(|e| LoadError::io(&s.path, e))?;
            let len = f.metadata().map_err(|e| LoadError::io(&s.path, e))?.len();
            if len < s.data_start + s.data_len {
                return Err(LoadError::invalid(
                    &s.path,
                    format!("file shrank to {len} bytes since its header was read"),
                ));
            }
            // SAFETY: a read-only shared mapping. A file truncated by another process while
            // mapped faults on access (SIGBUS) — the contract of every in-place load (the mmap
            // strategy, llama.cpp); the size check above catches truncation before the load.
            unsafe { memmap2::Mmap::map(&f) }.map_err(|e| LoadError::io(&s.path, e))
        })
        .collect()
}

/// A chunk pinned and queued: its pinned start and the event of its copy.
struct Pinned<Ev> {
    ptr: usize,
    ev: Ev,
}

/// Copies every chunk of `plan` from `maps` (from [`map_shards`]) to the engine's device
/// regions, pinning in place, `threads` workers each with at most `depth` chunks pinned.
/// `expected` holds the manifest's hash per chunk, checked before a chunk is copied.
pub fn copy_mapped<E: PinInPlace>(
    plan: &LoadPlan,
    maps: &[memmap2::Mmap],
    expected: Option<&[String]>,
    engine: &E,
    threads: usize,
    depth: usize,
) -> Result<MappedStats, LoadError> {
    let threads = threads.clamp(1, plan.chunks.len().max(1));
    let depth = depth.max(1);
    let next = AtomicUsize::new(0);
    let failed = AtomicBool::new(false);
    let first_err: Mutex<Option<LoadError>> = Mutex::new(None);
    // Nanoseconds summed over the workers: pinning, unpinning, waiting on copies, verifying.
    let (pin_ns, unpin_ns, wait_ns, verify_ns) = Default::default();
    let add = |ns: &AtomicU64, t: Instant| {
        ns.fetch_add(t.elapsed().as_nanos() as u64, Ordering::Relaxed);
    };
    let worker = || {
        let mut pinned: VecDeque<Pinned<E::Event>> = VecDeque::new();
        // Waits for the oldest copy and unpins its chunk.
        let retire = |p: Pinned<E::Event>| -> Result<(), LoadError> {
            let t = Instant::now();
            let waited = engine.wait(p.ev);
            add(&wait_ns, t);
            let t = Instant::now();
            // SAFETY: `p.ptr` was pinned by this thread and its copy has completed (or the wait
            // failed, in which case the context is broken and no copy runs any more).
            let unpinned = unsafe { engine.unpin(p.ptr as *const u8) };
            add(&unpin_ns, t);
            waited.and(unpinned)
        };
        let mut result = Ok(());
        while !failed.load(Ordering::Relaxed) {
            let i = next.fetch_add(1, Ordering::Relaxed);
            if i >= plan.chunks.len() {
                break;
            }
            let c = &plan.chunks[i];
            let map = &maps[c.shard];
            let start = c.file_off as usize;
            // The chunk's bytes (its last may end at the end of the file), and the whole pages
            // under them (the mapping runs to the end of the file's last page).
            let len = (c.len as usize).min(map.len().saturating_sub(start));
            if len == 0 {
                continue; // nothing of the file under this chunk (a zero-length pin is an error)
            }
            let pin_len = len.div_ceil(PAGE) * PAGE;
            let step = (|| {
                if let Some(h) = expected {
                    let t = Instant::now();
                    let r = crate::read::verify_chunk(plan, c, &map[start..start + len], &h[i]);
                    add(&verify_ns, t);
                    r?;
                }
                while pinned.len() >= depth {
                    retire(pinned.pop_front().expect("non-empty"))?;
                }
                let ptr = map[start..].as_ptr();
                let t = Instant::now();
                // SAFETY: page-aligned (file offsets of chunks are, and mappings start on a
                // page) and inside the mapping, which outlives this function.
                unsafe { engine.pin(ptr, pin_len)? };
                add(&pin_ns, t);
                // SAFETY: the pinned range holds `len` bytes that stay put (a read-only mapping)
                // until the copy's event has been waited for in `retire`.
                match unsafe { engine.copy(ptr, len, c.shard, c.device_off(plan)) } {
                    Ok(ev) => {
                        pinned.push_back(Pinned {
                            ptr: ptr as usize,
                            ev,
                        });
                        Ok(())
                    }
                    Err(e) => {
                        // SAFETY: pinned just above; no copy was queued from it.
                        let _ = unsafe { engine.unpin(ptr) };
                        Err(e)
                    }
                }
            })();
            if let Err(e) = step {
                result = Err(e);
                break;
            }
        }
        // Every pinned chunk is waited for and unpinned, whatever went wrong.
        while let Some(p) = pinned.pop_front() {
            let r = retire(p);
            if result.is_ok() {
                result = r;
            }
        }
        if let Err(e) = result {
            failed.store(true, Ordering::Relaxed);
            first_err
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .get_or_insert(e);
        }
    };
    std::thread::scope(|scope| {
        for _ in 0..threads {
            scope.spawn(worker);
        }
    });
    if let Some(e) = first_err.into_inner().unwrap_or_else(|p| p.into_inner()) {
        return Err(e);
    }
    let s = |ns: AtomicU64| ns.into_inner() as f64 / 1e9;
    Ok(MappedStats {
        threads,
        pin_s: s(pin_ns),
        unpin_s: s(unpin_ns),
        copy_wait_s: s(wait_ns),
        verify_s: s(verify_ns),
    })
}
