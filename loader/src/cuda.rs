//! The CUDA destination (feature `cuda`): a [`StagingRing`] of pinned host buffers in front of a
//! copy stream, filling one device allocation per shard. The ring's logic (event waits before a
//! refill, copies queued as chunks land) is tested on the CPU with a fake engine
//! (`tests/destination.rs`); this file is the thin CUDA side of it.

use std::sync::{Arc, Mutex};

use cudarc::driver::{CudaContext, CudaEvent, CudaSlice, CudaStream, PinnedHostSlice};

use crate::mapped::{copy_mapped, map_shards, MappedStats, PinInPlace};
use crate::plan::LoadPlan;
use crate::read::{begin, load_job_into, Job, LoadOptions, LoadStats, Strategy};
use crate::staging::{CopyEngine, StagingBuf, StagingRing};
use crate::{Checkpoint, LoadError};

fn cuda_err(e: impl std::fmt::Display) -> LoadError {
    LoadError::invalid(std::path::Path::new("cuda"), e.to_string())
}

/// A pinned host buffer (plain page-locked memory, not write-combined: io_uring and the CPU
/// hashing write and read it).
pub struct PinnedBuf {
    _mem: PinnedHostSlice<u8>,
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the buffer is owned memory; the ring hands out disjoint use of it.
unsafe impl Send for PinnedBuf {}
// SAFETY: as above.
unsafe impl Sync for PinnedBuf {}

impl PinnedBuf {
    /// `write_combined`: the CPU's writes skip its caches (no read-for-ownership of the
    /// buffer), but its reads are uncached and slow — only where nothing on the host reads the
    /// staged bytes (no integrity check).
    pub fn new(
        ctx: &Arc<CudaContext>,
        len: usize,
        write_combined: bool,
    ) -> Result<PinnedBuf, LoadError> {
        use cudarc::driver::sys::{CU_MEMHOSTALLOC_PORTABLE, CU_MEMHOSTALLOC_WRITECOMBINED};
        let flags = CU_MEMHOSTALLOC_PORTABLE
            | if write_combined {
                CU_MEMHOSTALLOC_WRITECOMBINED
            } else {
                0
            };
        // SAFETY: the memory is uninitialized until a read fills it; nothing reads it before.
        let mut mem = unsafe { ctx.alloc_pinned_with_flags::<u8>(len, flags) }.map_err(cuda_err)?;
        let ptr = mem.as_mut_ptr().map_err(cuda_err)?;
        Ok(PinnedBuf {
            _mem: mem,
            ptr,
            len,
        })
    }
}

impl PinnedBuf {
    /// `n` buffers of `len` bytes, allocated by `n` threads at once: page-locking and zeroing
    /// 128 MiB one buffer after another is tens of milliseconds of a load's critical path
    /// (`bench-coldstart gpu` times both ways).
    pub fn many(
        ctx: &Arc<CudaContext>,
        n: usize,
        len: usize,
        write_combined: bool,
    ) -> Result<Vec<PinnedBuf>, LoadError> {
        std::thread::scope(|s| {
            let handles: Vec<_> = (0..n)
                .map(|_| s.spawn(|| PinnedBuf::new(ctx, len, write_combined)))
                .collect();
            handles
                .into_iter()
                .map(|h| {
                    h.join()
                        .unwrap_or_else(|_| Err(cuda_err("a pinned allocation thread panicked")))
                })
                .collect()
        })
    }
}

impl StagingBuf for PinnedBuf {
    fn ptr(&self) -> *mut u8 {
        self.ptr
    }
    fn len(&self) -> usize {
        self.len
    }
}

/// Host → device copies on one stream, each followed by an event.
pub struct CudaCopy {
    stream: Arc<CudaStream>,
    shards: Mutex<Vec<CudaSlice<u8>>>,
    /// The driver refused to pin pages in place (then the staging ring loads instead).
    pin_refused: std::sync::atomic::AtomicBool,
    /// Seconds `prepare` spent allocating device memory.
    alloc_s: f64,
}

impl CudaCopy {
    pub fn new(ctx: &Arc<CudaContext>) -> Result<CudaCopy, LoadError> {
        Ok(CudaCopy {
            stream: ctx.new_stream().map_err(cuda_err)?,
            shards: Mutex::new(vec![]),
            pin_refused: false.into(),
            alloc_s: 0.0,
        })
    }

    /// The device allocations, one per shard, `device_len()` bytes each.
    pub fn into_shards(self) -> Vec<CudaSlice<u8>> {
        self.shards.into_inner().unwrap_or_else(|e| e.into_inner())
    }
}

impl CopyEngine for CudaCopy {
    type Event = CudaEvent;

    fn prepare(&mut self, plan: &LoadPlan) -> Result<(), LoadError> {
        let t = std::time::Instant::now();
        let mut v = Vec::with_capacity(plan.shards.len());
        for s in &plan.shards {
            // SAFETY: every byte of the data range is written by the load before it is used.
            v.push(unsafe { self.stream.alloc::<u8>(s.device_len() as usize) }.map_err(cuda_err)?);
        }
        *self.shards.lock().unwrap_or_else(|e| e.into_inner()) = v;
        self.alloc_s = t.elapsed().as_secs_f64();
        Ok(())
    }

    unsafe fn copy(
        &self,
        src: *const u8,
        len: usize,
        shard: usize,
        dst: u64,
    ) -> Result<CudaEvent, LoadError> {
        // SAFETY: the caller's contract: `src` holds `len` bytes, untouched until the event.
        let host = unsafe { std::slice::from_raw_parts(src, len) };
        let mut shards = self.shards.lock().unwrap_or_else(|e| e.into_inner());
        let dst = dst as usize;
        let mut view = shards[shard].slice_mut(dst..dst + len);
        self.stream.memcpy_htod(host, &mut view).map_err(cuda_err)?;
        self.stream
            .record_event(Some(
                cudarc::driver::sys::CUevent_flags::CU_EVENT_BLOCKING_SYNC,
            ))
            .map_err(cuda_err)
    }

    fn wait(&self, ev: CudaEvent) -> Result<(), LoadError> {
        ev.synchronize().map_err(cuda_err)
    }
}

impl PinInPlace for CudaCopy {
    unsafe fn pin(&self, ptr: *const u8, len: usize) -> Result<(), LoadError> {
        use cudarc::driver::sys::{
            cuMemHostRegister_v2, CU_MEMHOSTREGISTER_PORTABLE, CU_MEMHOSTREGISTER_READ_ONLY,
        };
        self.stream.context().bind_to_thread().map_err(cuda_err)?;
        // SAFETY: the caller's contract: `ptr..ptr + len` is mapped (read-only, hence the flag)
        // until `unpin`.
        let r = unsafe {
            cuMemHostRegister_v2(
                ptr as *mut _,
                len,
                CU_MEMHOSTREGISTER_READ_ONLY | CU_MEMHOSTREGISTER_PORTABLE,
            )
        };
        r.result().map_err(|e| {
            self.pin_refused
                .store(true, std::sync::atomic::Ordering::Relaxed);
            cuda_err(format!("pinning {len} mapped bytes in place: {e}"))
        })
    }

    unsafe fn unpin(&self, ptr: *const u8) -> Result<(), LoadError> {
        self.stream.context().bind_to_thread().map_err(cuda_err)?;
        // SAFETY: the caller's contract: `ptr` starts a pinned range no copy reads any more.
        unsafe { cudarc::driver::sys::cuMemHostUnregister(ptr as *mut _) }
            .result()
            .map_err(cuda_err)
    }
}

/// A checkpoint in device memory: one allocation per shard (tensor `e` of shard `s` starts at
/// `plan.shards[s].device_data_offset() + e.info.begin`, on a [`crate::plan::DEVICE_ALIGN`]
/// boundary plus the tensor's offset), and how the load went.
pub struct DeviceLoad {
    pub plan: LoadPlan,
    pub stats: LoadStats,
    pub shards: Vec<CudaSlice<u8>>,
    /// Allocation on the load's critical path (seconds): device memory, and pinned staging
    /// buffers when they are allocated up front.
    pub alloc_s: f64,
    /// Pinned staging buffers allocated in the background: the wait for the first (on the
    /// critical path), and all allocations summed over their threads (overlapped with the
    /// load). Zero when allocated up front.
    pub pinned_first_s: f64,
    pub pinned_background_s: f64,
    /// Of which device memory (inside the load's timed span: before the first copy).
    pub device_alloc_s: f64,
    /// Time the reads waited for host → device copies, plus the final copies' tail: the copy
    /// phase not hidden behind reads.
    pub copy_s: f64,
    /// Pinned in place (resident checkpoints): where the workers' time went.
    pub mapped: Option<MappedStats>,
}

/// The pinned staging ring's shape.
#[derive(Debug, Clone, Copy)]
pub struct Staging {
    /// Pinned buffers of the plan's chunk size (reads in flight ≤ this).
    pub buffers: usize,
    /// Write-combined buffers, where no integrity check reads them on the host.
    pub write_combined: bool,
    /// A checkpoint resident in the page cache is copied from there, its pages pinned in place
    /// (no staging copy); the ring is the fallback where the driver refuses.
    pub pin_in_place: bool,
    /// Pinned in place: chunks each worker keeps pinned (copies in flight per worker).
    pub pin_depth: usize,
    /// All staging buffers allocated before the first read (by as many threads), instead of in
    /// the background while the first reads run ([`StagingRing::background`]) — the A/B's
    /// other side.
    pub pinned_up_front: bool,
}

impl Default for Staging {
    fn default() -> Self {
        // 16 × 8 MiB: on an H200 host (16 cores) 38–42 GB/s from the page cache against
        // 33–36 with 8 buffers, and better than 32 buffers or 32 MiB chunks; write-combined
        // buffers were not consistently faster (docs/PERFORMANCE.md). Pinning in place is
        // off until a GPU run measures it against the ring (`bench-coldstart gpu`'s load sweep
        // has both; `THAW_CUDA_PIN_IN_PLACE=1` turns it on in `thaw`).
        Staging {
            buffers: 16,
            write_combined: false,
            pin_in_place: false,
            pin_depth: 2,
            pinned_up_front: false,
        }
    }
}

/// Loads `ck` into device memory through a ring of pinned buffers of the plan's chunk size — or,
/// with `staging.pin_in_place` and the checkpoint resident in the page cache, straight from its
/// mapped pages pinned in place (the ring is the fallback; `stats.fallback` says why).
pub fn load_to_device(
    ck: &Checkpoint,
    opts: &LoadOptions,
    ctx: &Arc<CudaContext>,
    staging: Staging,
) -> Result<DeviceLoad, LoadError> {
    let t = std::time::Instant::now();
    // One plan, manifest read and residency sample, whichever way the bytes go.
    let mut job = begin(ck, opts)?;
    let mut fallback = None;
    if staging.pin_in_place
        && ck.remote.is_none()
        && matches!(opts.strategy, Strategy::Auto | Strategy::Mmap)
    {
        if job.stats.resident < 0.9 && opts.strategy != Strategy::Mmap {
            fallback = Some(format!(
                "{:.0}% resident in the page cache: read from the disk instead",
                job.stats.resident * 100.0
            ));
        } else {
            match load_in_place(job, ctx, staging, t)? {
                Ok(l) => return Ok(l),
                Err((j, reason)) => {
                    job = j;
                    fallback = Some(reason);
                }
            }
        }
    }
    // Chunks are the plan's: the manifest's size when there is one (its hashes are per chunk).
    // Write-combined staging only where no hash is computed over the staged bytes.
    let t_alloc = std::time::Instant::now();
    let wc = staging.write_combined && job.expected.is_none();
    // (No more buffers than chunks: a small checkpoint needs no 128 MiB of pinned memory.)
    let n_bufs = staging.buffers.min(job.plan.chunks.len()).max(2);
    let chunk = job.plan.chunk_size as usize;
    let mut dest = if staging.pinned_up_front {
        StagingRing::new(
            PinnedBuf::many(ctx, n_bufs, chunk, wc)?,
            CudaCopy::new(ctx)?,
        )
    } else {
        let ctx2 = ctx.clone();
        let make: crate::staging::MakeBuf<PinnedBuf> =
            Arc::new(move || PinnedBuf::new(&ctx2, chunk, wc));
        StagingRing::background(n_bufs, chunk, make, CudaCopy::new(ctx)?)
    };
    let pinned_s = t_alloc.elapsed().as_secs_f64();
    let (plan, mut stats) = load_job_into(ck, job, &mut dest, &mut |_| {})?;
    dest.finish()?;
    let copy_s = dest.copy_wait_s();
    let (pinned_first_s, pinned_background_s) = (dest.first_buffer_s(), dest.alloc_s());
    stats.total_s = t.elapsed().as_secs_f64();
    if stats.fallback.is_none() {
        stats.fallback = fallback;
    }
    let engine = dest.into_engine();
    Ok(DeviceLoad {
        plan,
        stats,
        alloc_s: pinned_s + engine.alloc_s,
        pinned_first_s,
        pinned_background_s,
        device_alloc_s: engine.alloc_s,
        shards: engine.into_shards(),
        copy_s,
        mapped: None,
    })
}

/// Loads a page-cache-resident checkpoint by pinning its mapped pages in place. `Ok(Err((job,
/// why)))`: the driver refused to pin, so the caller stages the same job instead.
fn load_in_place(
    job: Job,
    ctx: &Arc<CudaContext>,
    staging: Staging,
    t: std::time::Instant,
) -> Result<Result<DeviceLoad, (Job, String)>, LoadError> {
    let t_alloc = std::time::Instant::now();
    let mut engine = CudaCopy::new(ctx)?;
    crate::staging::CopyEngine::prepare(&mut engine, &job.plan)?;
    let maps = map_shards(&job.plan)?;
    let alloc_s = t_alloc.elapsed().as_secs_f64();
    let t_io = std::time::Instant::now();
    let r = copy_mapped(
        &job.plan,
        &maps,
        job.expected.as_deref(),
        &engine,
        job.opts.threads,
        staging.pin_depth,
    );
    let m = match r {
        Ok(m) => m,
        Err(e)
            if engine
                .pin_refused
                .load(std::sync::atomic::Ordering::Relaxed) =>
        {
            return Ok(Err((job, e.to_string())))
        }
        Err(e) => return Err(e),
    };
    let mut stats = job.stats;
    stats.strategy = "pin-in-place".into();
    stats.verify_s = m.verify_s / m.threads as f64;
    stats.io_s = t_io.elapsed().as_secs_f64() - stats.verify_s;
    stats.total_s = t.elapsed().as_secs_f64();
    Ok(Ok(DeviceLoad {
        plan: job.plan,
        stats,
        device_alloc_s: engine.alloc_s,
        shards: engine.into_shards(),
        alloc_s,
        pinned_first_s: 0.0,
        pinned_background_s: 0.0,
        copy_s: m.copy_wait_s,
        mapped: Some(m),
    }))
}
