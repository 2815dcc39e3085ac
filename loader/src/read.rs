//! Load strategies: how the plan's chunks get from storage into host memory.
//!
//! * `uring-direct` — io_uring with `O_DIRECT`: `queue_depth` reads of `chunk_size` in flight,
//!   straight into the final huge-page arena (no page cache, no second copy). Best when the file
//!   is not already cached: the disk sees a deep queue of large requests.
//! * `pread` — buffered positioned reads from `threads` threads into the same arena: best when the
//!   file is already in the page cache (a memcpy out of it).
//! * `mmap` — the file mapped and used *in place* (zero copy), as llama.cpp does: tensors are
//!   views into the page cache. Valid for the CPU backend because it computes on weights in their
//!   stored dtype.
//! * `auto` — looks at what is cheap to know: the fraction of the files resident in the page cache
//!   (mincore on a mapping). Resident → `mmap` in place (measured: ~5 ms for the default model vs
//!   ~35 ms to copy it, and decode runs at the same speed on either); otherwise → `uring-direct`.
//!   Where O_DIRECT or io_uring is refused (tmpfs, old kernels, seccomp) it falls back to `pread`
//!   and says why.
//!
//! Every chunk is verified against the manifest as it lands when one exists; a mismatch names the
//! shard and byte range. Nothing is reported loaded until every chunk has landed and checked out.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::manifest::{hash, hashed_part, Manifest};
use crate::plan::{Chunk, LoadPlan};
use crate::{AlignedBuf, Checkpoint, LoadError};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Strategy {
    Auto,
    UringDirect,
    Pread,
    Mmap,
}

impl std::str::FromStr for Strategy {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Ok(match s {
            "auto" => Strategy::Auto,
            "uring-direct" | "uring" => Strategy::UringDirect,
            "pread" => Strategy::Pread,
            "mmap" => Strategy::Mmap,
            _ => return Err(format!("unknown load strategy '{s}' (auto, uring-direct, pread, mmap)")),
        })
    }
}

impl Strategy {
    pub fn name(self) -> &'static str {
        match self {
            Strategy::Auto => "auto",
            Strategy::UringDirect => "uring-direct",
            Strategy::Pread => "pread",
            Strategy::Mmap => "mmap",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verify {
    /// Verify when a manifest exists.
    Auto,
    Off,
    /// Fail when there is no manifest.
    Required,
}

#[derive(Debug, Clone)]
pub struct LoadOptions {
    pub strategy: Strategy,
    pub chunk_size: u64,
    pub queue_depth: usize,
    pub threads: usize,
    pub verify: Verify,
}

impl Default for LoadOptions {
    fn default() -> Self {
        LoadOptions {
            strategy: Strategy::Auto,
            chunk_size: crate::manifest::DEFAULT_CHUNK,
            queue_depth: 16,
            threads: std::thread::available_parallelism().map(|n| n.get()).unwrap_or(2),
            verify: Verify::Auto,
        }
    }
}

/// What a load did and how long each part took.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct LoadStats {
    pub strategy: String,
    /// Why the requested strategy was not used, if it was not.
    pub fallback: Option<String>,
    pub bytes: u64,
    /// Fraction of the files' pages resident in the page cache before the load.
    pub resident: f64,
    pub plan_s: f64,
    pub io_s: f64,
    pub verify_s: f64,
    pub verified: bool,
    pub total_s: f64,
}

impl LoadStats {
    pub fn gb_per_s(&self) -> f64 {
        self.bytes as f64 / self.total_s.max(1e-9) / 1e9
    }
}

/// Progress as chunks land: the number of leading layer groups now complete.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Progress {
    pub bytes_done: u64,
    pub bytes_total: u64,
    pub layers_ready: usize,
    pub layers_total: usize,
}

/// Where a shard's bytes live once loaded.
pub enum Backing {
    Arena(AlignedBuf),
    Map(memmap2::Mmap),
}

impl Backing {
    pub fn bytes(&self) -> &[u8] {
        match self {
            Backing::Arena(a) => a.as_slice(),
            Backing::Map(m) => m,
        }
    }
}

/// Tracks completed chunks and reports how many leading layer groups are fully resident.
struct LayerTracker {
    pending: Vec<usize>,
    ready: usize,
    done: u64,
}

impl LayerTracker {
    fn new(plan: &LoadPlan) -> LayerTracker {
        let mut pending = vec![0usize; plan.layers];
        for c in &plan.chunks {
            for l in c.layer..=c.last_layer.min(plan.layers - 1) {
                pending[l] += 1;
            }
        }
        LayerTracker { pending, ready: 0, done: 0 }
    }
    fn land(&mut self, plan: &LoadPlan, c: &Chunk) -> Progress {
        for l in c.layer..=c.last_layer.min(plan.layers - 1) {
            self.pending[l] -= 1;
        }
        self.done += c.len;
        while self.ready < self.pending.len() && self.pending[self.ready] == 0 {
            self.ready += 1;
        }
        Progress {
            bytes_done: self.done.min(plan.shards.iter().map(|s| s.aligned_len).sum()),
            bytes_total: plan.shards.iter().map(|s| s.aligned_len).sum(),
            layers_ready: self.ready,
            layers_total: plan.layers,
        }
    }
}

/// Fraction of the checkpoint's data pages currently in the page cache.
pub fn resident_fraction(plan: &LoadPlan) -> f64 {
    let (mut res, mut total) = (0u64, 0u64);
    for s in &plan.shards {
        let Ok(f) = File::open(&s.path) else { continue };
        // SAFETY: a read-only shared mapping of a file we just opened; only mincore looks at it.
        let Ok(m) = (unsafe { memmap2::MmapOptions::new().map(&f) }) else { continue };
        let page = 4096usize;
        let pages = m.len().div_ceil(page);
        let mut vec = vec![0u8; pages];
        // SAFETY: the mapping is valid for m.len() bytes and vec has one byte per page.
        let rc = unsafe { libc::mincore(m.as_ptr() as *mut libc::c_void, m.len(), vec.as_mut_ptr()) };
        if rc == 0 {
            res += vec.iter().filter(|&&b| b & 1 == 1).count() as u64;
            total += pages as u64;
        }
    }
    if total == 0 {
        0.0
    } else {
        res as f64 / total as f64
    }
}

/// A raw pointer into a shard arena, shared by I/O workers that write disjoint chunks.
#[derive(Clone, Copy)]
struct ArenaPtr(*mut u8);
// SAFETY: every chunk covers a disjoint range of its arena; the arenas outlive the workers.
unsafe impl Send for ArenaPtr {}
// SAFETY: as above.
unsafe impl Sync for ArenaPtr {}

fn check_len(plan: &LoadPlan, c: &Chunk, got: u64) -> Result<(), LoadError> {
    let s = &plan.shards[c.shard];
    let need = (s.data_start + s.data_len).saturating_sub(c.file_off).min(c.len);
    if got < need {
        return Err(LoadError::invalid(
            &s.path,
            format!("file ended during the load: bytes {}..{} came back {} short (did it shrink?)", c.file_off, c.file_off + c.len, need - got),
        ));
    }
    Ok(())
}

fn verify_chunk(plan: &LoadPlan, c: &Chunk, buf: &[u8], want: &str) -> Result<(), LoadError> {
    let got = hash(hashed_part(plan, c, buf));
    if got != want {
        let s = &plan.shards[c.shard];
        let end = (s.data_start + s.data_len).min(c.file_off + c.len);
        return Err(LoadError::invalid(&s.path, format!("integrity check failed for bytes {}..{end}: xxh3 {got}, manifest says {want}", c.file_off)));
    }
    Ok(())
}

pub struct Loaded {
    pub backing: Vec<Backing>,
    /// Offset of each shard's data section inside its backing.
    pub data_offset: Vec<u64>,
    pub stats: LoadStats,
}

/// Loads every shard of `ck` with `opts`, calling `progress` as chunks land.
pub fn load(ck: &Checkpoint, opts: &LoadOptions, progress: &mut dyn FnMut(Progress)) -> Result<Loaded, LoadError> {
    let t0 = Instant::now();
    let manifest = match opts.verify {
        Verify::Off => None,
        _ => Manifest::read(&ck.dir)?,
    };
    if manifest.is_none() && opts.verify == Verify::Required {
        return Err(LoadError::invalid(&ck.dir, "integrity verification required but there is no thaw-manifest.json"));
    }
    let chunk_size = manifest.as_ref().map(|m| m.chunk_size).unwrap_or(opts.chunk_size);
    let plan = LoadPlan::new(ck, chunk_size);
    let expected = match &manifest {
        Some(m) => Some(m.expected(&plan, &ck.dir)?),
        None => None,
    };
    let resident = resident_fraction(&plan);
    let mut stats = LoadStats { bytes: plan.total_bytes(), resident, verified: expected.is_some(), ..Default::default() };
    let mut strategy = match opts.strategy {
        // Resident: use the page cache in place — nothing to read, nothing to copy.
        Strategy::Auto if resident >= 0.9 => Strategy::Mmap,
        Strategy::Auto => Strategy::UringDirect,
        s => s,
    };
    stats.plan_s = t0.elapsed().as_secs_f64();
    let mut tracker = LayerTracker::new(&plan);
    let t_io = Instant::now();
    let mut verify_time = Duration::ZERO;
    let backing = loop {
        let r = match strategy {
            Strategy::Mmap => load_mmap(&plan, expected.as_deref(), &mut tracker, progress, &mut verify_time),
            Strategy::Pread => load_pread(&plan, opts.threads, expected.as_deref(), &mut tracker, progress, &mut verify_time),
            _ => load_uring(&plan, opts, expected.as_deref(), &mut tracker, progress, &mut verify_time),
        };
        match r {
            Ok(b) => break b,
            Err(Refused(reason)) if strategy == Strategy::UringDirect => {
                stats.fallback = Some(reason);
                strategy = Strategy::Pread;
                tracker = LayerTracker::new(&plan);
                verify_time = Duration::ZERO;
            }
            Err(Refused(reason)) => return Err(LoadError::invalid(&ck.dir, reason)),
            Err(Failed(e)) => return Err(e),
        }
    };
    stats.strategy = strategy.name().to_string();
    stats.verify_s = verify_time.as_secs_f64();
    stats.io_s = t_io.elapsed().as_secs_f64() - stats.verify_s;
    stats.total_s = t0.elapsed().as_secs_f64();
    let data_offset = plan
        .shards
        .iter()
        .map(|s| if strategy == Strategy::Mmap { s.data_start } else { s.data_offset() })
        .collect();
    Ok(Loaded { backing, data_offset, stats })
}

/// Why a strategy did not produce a load.
enum LoadFailure {
    /// The system refused the mechanism (O_DIRECT, io_uring): fall back.
    Refused(String),
    /// The data is bad or unreadable: fail the load.
    Failed(LoadError),
}
use LoadFailure::{Failed, Refused};

impl From<LoadError> for LoadFailure {
    fn from(e: LoadError) -> Self {
        Failed(e)
    }
}

fn arenas(plan: &LoadPlan) -> Vec<AlignedBuf> {
    plan.shards.iter().map(|s| AlignedBuf::zeroed(s.aligned_len as usize)).collect()
}

fn load_pread(
    plan: &LoadPlan,
    threads: usize,
    expected: Option<&[String]>,
    tracker: &mut LayerTracker,
    progress: &mut dyn FnMut(Progress),
    verify_time: &mut Duration,
) -> Result<Vec<Backing>, LoadFailure> {
    let files = plan
        .shards
        .iter()
        .map(|s| File::open(&s.path).map_err(|e| LoadError::io(&s.path, e)))
        .collect::<Result<Vec<_>, _>>()?;
    let mut bufs = arenas(plan);
    let ptrs: Vec<ArenaPtr> = bufs.iter_mut().map(|b| ArenaPtr(b.as_mut_slice().as_mut_ptr())).collect();
    let next = AtomicUsize::new(0);
    let landed: Mutex<(Vec<usize>, Option<LoadError>, Duration)> = Mutex::new((Vec::new(), None, Duration::ZERO));
    std::thread::scope(|scope| {
        for _ in 0..threads.max(1) {
            scope.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= plan.chunks.len() || landed.lock().map(|l| l.1.is_some()).unwrap_or(true) {
                    break;
                }
                let c = &plan.chunks[i];
                let s = &plan.shards[c.shard];
                let len = (c.len.min(s.file_len.saturating_sub(c.file_off))) as usize;
                // SAFETY: chunk i covers [arena_off, arena_off + c.len) of its arena, disjoint
                // from every other chunk; the arena is c.len bytes long at least there.
                let buf = unsafe { std::slice::from_raw_parts_mut(ptrs[c.shard].0.add(c.arena_off(plan) as usize), len) };
                let mut got = 0usize;
                let mut result = Ok(());
                while got < len {
                    match files[c.shard].read_at(&mut buf[got..], c.file_off + got as u64) {
                        Ok(0) => break,
                        Ok(n) => got += n,
                        Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                        Err(e) => {
                            result = Err(LoadError::io(&s.path, e));
                            break;
                        }
                    }
                }
                let t = Instant::now();
                let result = result
                    .and_then(|_| check_len(plan, c, got as u64))
                    .and_then(|_| match expected {
                        Some(h) => verify_chunk(plan, c, buf, &h[i]),
                        None => Ok(()),
                    });
                let dt = t.elapsed();
                let mut l = landed.lock().unwrap_or_else(|e| e.into_inner());
                l.2 += dt;
                match result {
                    Ok(()) => l.0.push(i),
                    Err(e) => {
                        l.1.get_or_insert(e);
                    }
                }
            });
        }
        // Report progress from this thread as chunks land.
        let mut reported = 0;
        loop {
            let (done, failed) = {
                let l = landed.lock().unwrap_or_else(|e| e.into_inner());
                (l.0[reported..].to_vec(), l.1.is_some())
            };
            for i in done {
                progress(tracker.land(plan, &plan.chunks[i]));
                reported += 1;
            }
            if failed || reported == plan.chunks.len() {
                break;
            }
            std::thread::sleep(Duration::from_micros(200));
        }
    });
    let (_, err, vt) = landed.into_inner().unwrap_or_else(|e| e.into_inner());
    *verify_time = vt / threads.max(1) as u32;
    if let Some(e) = err {
        return Err(Failed(e));
    }
    Ok(bufs.into_iter().map(Backing::Arena).collect())
}

fn load_mmap(
    plan: &LoadPlan,
    expected: Option<&[String]>,
    tracker: &mut LayerTracker,
    progress: &mut dyn FnMut(Progress),
    verify_time: &mut Duration,
) -> Result<Vec<Backing>, LoadFailure> {
    let mut maps = Vec::with_capacity(plan.shards.len());
    for s in &plan.shards {
        let f = File::open(&s.path).map_err(|e| LoadError::io(&s.path, e))?;
        let len = f.metadata().map_err(|e| LoadError::io(&s.path, e))?.len();
        if len < s.data_start + s.data_len {
            return Err(Failed(LoadError::invalid(&s.path, format!("file shrank to {len} bytes since its header was read"))));
        }
        // SAFETY: a private read-only mapping. If another process truncates the file while it is
        // mapped, reads fault (SIGBUS) — the accepted contract of in-place loading, as with
        // llama.cpp's mmap; the size check above catches truncation before the load.
        let m = unsafe { memmap2::MmapOptions::new().populate().map(&f) }.map_err(|e| LoadError::io(&s.path, e))?;
        maps.push(m);
    }
    if let Some(h) = expected {
        // Hash on every core: in place, verification is the only work left.
        let t = Instant::now();
        let next = AtomicUsize::new(0);
        let threads = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
        let errors: Mutex<Option<LoadError>> = Mutex::new(None);
        std::thread::scope(|scope| {
            for _ in 0..threads {
                scope.spawn(|| loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= plan.chunks.len() {
                        break;
                    }
                    let c = &plan.chunks[i];
                    let m = &maps[c.shard];
                    let end = ((c.file_off + c.len) as usize).min(m.len());
                    if let Err(e) = verify_chunk(plan, c, &m[c.file_off as usize..end], &h[i]) {
                        errors.lock().unwrap_or_else(|p| p.into_inner()).get_or_insert(e);
                        break;
                    }
                });
            }
        });
        *verify_time += t.elapsed();
        if let Some(e) = errors.into_inner().unwrap_or_else(|p| p.into_inner()) {
            return Err(Failed(e));
        }
    }
    for c in &plan.chunks {
        progress(tracker.land(plan, c));
    }
    Ok(maps.into_iter().map(Backing::Map).collect())
}

fn load_uring(
    plan: &LoadPlan,
    opts: &LoadOptions,
    expected: Option<&[String]>,
    tracker: &mut LayerTracker,
    progress: &mut dyn FnMut(Progress),
    verify_time: &mut Duration,
) -> Result<Vec<Backing>, LoadFailure> {
    use io_uring::IoUring;

    let mut files = Vec::with_capacity(plan.shards.len());
    for s in &plan.shards {
        match std::fs::OpenOptions::new().read(true).custom_flags(libc::O_DIRECT).open(&s.path) {
            Ok(f) => files.push(f),
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                return Err(Refused(format!("O_DIRECT refused on {} ({e})", s.path.display())))
            }
            Err(e) => return Err(Failed(LoadError::io(&s.path, e))),
        }
    }
    let depth = opts.queue_depth.clamp(1, 256);
    // Probe io_uring before spending anything on arenas.
    drop(IoUring::new(depth as u32).map_err(|e| Refused(format!("io_uring unavailable ({e})")))?);
    let mut bufs = arenas(plan);
    let ptrs: Vec<*mut u8> = bufs.iter_mut().map(|b| b.as_mut_slice().as_mut_ptr()).collect();
    // Fresh arena pages must be faulted in (and zeroed by the kernel) before data can land in
    // them; done inside the read that is ~25% of a cold load. A helper thread faults chunks in
    // plan order ahead of the reads, so that work overlaps the disk instead of adding to it. A
    // chunk is submitted only after the helper has finished with it (the helper writes zeros
    // into pages that are already zero, which must not race with the DMA).
    let prefaulted = AtomicUsize::new(0);
    let stop = std::sync::atomic::AtomicBool::new(false);
    let arena_ptrs: Vec<ArenaPtr> = ptrs.iter().map(|&p| ArenaPtr(p)).collect();
    // Verification also runs on the helper, once it has faulted everything: hashing on the
    // thread that reaps completions would delay resubmission and starve the queue.
    let (job_tx, job_rx) = std::sync::mpsc::channel::<(usize, u64)>();
    let (done_tx, done_rx) = std::sync::mpsc::channel::<(usize, Result<(), LoadError>, Duration)>();
    std::thread::scope(|scope| {
        let arena_ptrs = &arena_ptrs;
        let (prefaulted, stop) = (&prefaulted, &stop);
        scope.spawn(move || {
            for (i, c) in plan.chunks.iter().enumerate() {
                if stop.load(Ordering::Relaxed) {
                    break;
                }
                let base = arena_ptrs[c.shard].0;
                let (a, b) = (c.arena_off(plan) as usize, (c.arena_off(plan) + c.len) as usize);
                let mut at = a;
                while at < b {
                    // SAFETY: `at` is inside chunk i's range of its arena, which no read targets
                    // until `prefaulted` passes i (Release below, Acquire in the submitter).
                    unsafe { std::ptr::write_volatile(base.add(at), 0u8) };
                    at = (at / PREFAULT_STEP + 1) * PREFAULT_STEP;
                }
                prefaulted.store(i + 1, Ordering::Release);
            }
            let Some(h) = expected else { return };
            for (i, got) in job_rx {
                let c = &plan.chunks[i];
                let t = Instant::now();
                // SAFETY: chunk i's read completed before its job was sent; nothing writes it now.
                let buf = unsafe { std::slice::from_raw_parts(arena_ptrs[c.shard].0.add(c.arena_off(plan) as usize), got as usize) };
                let r = verify_chunk(plan, c, buf, &h[i]);
                if done_tx.send((i, r, t.elapsed())).is_err() {
                    break;
                }
            }
        });
        let verifier = expected.map(|_| (job_tx, done_rx));
        let r = uring_reads(plan, &files, depth, &ptrs, &prefaulted, verifier, tracker, progress, verify_time);
        stop.store(true, Ordering::Relaxed);
        r
    })?;
    Ok(bufs.into_iter().map(Backing::Arena).collect())
}

/// Sends completed chunks (index, bytes) to the hashing thread; receives verdicts.
type Verifier = (std::sync::mpsc::Sender<(usize, u64)>, std::sync::mpsc::Receiver<(usize, Result<(), LoadError>, Duration)>);

/// Faulting one byte per huge page faults the whole page.
const PREFAULT_STEP: usize = 2 << 20;

#[allow(clippy::too_many_arguments)]
fn uring_reads(
    plan: &LoadPlan,
    files: &[File],
    depth: usize,
    ptrs: &[*mut u8],
    prefaulted: &AtomicUsize,
    verifier: Option<Verifier>,
    tracker: &mut LayerTracker,
    progress: &mut dyn FnMut(Progress),
    verify_time: &mut Duration,
) -> Result<(), LoadFailure> {
    use io_uring::{opcode, types, IoUring};
    let mut ring = IoUring::new(depth as u32).map_err(|e| Refused(format!("io_uring unavailable ({e})")))?;
    // Per chunk: bytes read so far (reads can come back short and are resubmitted).
    let mut got = vec![0u64; plan.chunks.len()];
    let mut next = 0usize;
    let mut in_flight = 0usize;
    let mut landed = 0usize;
    let mut hashing = 0usize;
    let submit = |ring: &mut IoUring, i: usize, got: u64| -> Result<(), LoadFailure> {
        let c = &plan.chunks[i];
        // SAFETY: the target range lies inside chunk i's part of its arena (disjoint from every
        // other chunk's) and the arena outlives the ring's use of it (we drain before returning).
        let ptr = unsafe { ptrs[c.shard].add((c.arena_off(plan) + got) as usize) };
        let sqe = opcode::Read::new(types::Fd(files[c.shard].as_raw_fd()), ptr, (c.len - got) as u32)
            .offset(c.file_off + got)
            .build()
            .user_data(i as u64);
        // SAFETY: the buffer stays valid and unaliased until the completion is reaped.
        unsafe { ring.submission().push(&sqe) }.map_err(|_| Failed(LoadError::invalid(&plan.shards[c.shard].path, "io_uring submission queue full")))?;
        Ok(())
    };
    let mut failure: Option<LoadFailure> = None;
    while landed < plan.chunks.len() {
        while failure.is_none() && in_flight < depth && next < plan.chunks.len() {
            if prefaulted.load(Ordering::Acquire) <= next {
                if in_flight > 0 {
                    break; // reap completions meanwhile
                }
                std::thread::yield_now();
                continue;
            }
            submit(&mut ring, next, 0)?;
            next += 1;
            in_flight += 1;
        }
        if in_flight == 0 {
            // Only verdicts are outstanding: wait for the next one.
            if let (Some((_, rx)), true) = (&verifier, hashing > 0 && failure.is_none()) {
                let Ok((i, r, dt)) = rx.recv() else { break };
                hashing -= 1;
                *verify_time += dt;
                match r {
                    Ok(()) => {
                        landed += 1;
                        progress(tracker.land(plan, &plan.chunks[i]));
                    }
                    Err(e) => {
                        failure.get_or_insert(Failed(e));
                    }
                }
                continue;
            }
            break;
        }
        if let Err(e) = ring.submit_and_wait(1) {
            if e.raw_os_error() != Some(libc::EINTR) {
                failure.get_or_insert(Failed(LoadError::invalid(&plan.shards[0].path, format!("io_uring wait failed: {e}"))));
                break;
            }
            continue;
        }
        let cqes: Vec<(usize, i32)> = ring.completion().map(|c| (c.user_data() as usize, c.result())).collect();
        for (i, res) in cqes {
            in_flight -= 1;
            let c = &plan.chunks[i];
            let s = &plan.shards[c.shard];
            if res < 0 {
                let err = std::io::Error::from_raw_os_error(-res);
                if res == -libc::EINVAL && landed == 0 {
                    failure.get_or_insert(Refused(format!("O_DIRECT read refused on {} ({err})", s.path.display())));
                } else {
                    failure.get_or_insert(Failed(LoadError::io(&s.path, err)));
                }
                continue;
            }
            got[i] += res as u64;
            let at_eof = res == 0 || c.file_off + got[i] >= s.file_len;
            if got[i] < c.len && !at_eof && failure.is_none() {
                // Short read mid-file: ask for the rest.
                submit(&mut ring, i, got[i])?;
                in_flight += 1;
                continue;
            }
            if failure.is_some() {
                continue;
            }
            if let Err(e) = check_len(plan, c, got[i]) {
                failure.get_or_insert(Failed(e));
                continue;
            }
            match &verifier {
                Some((tx, _)) => {
                    let _ = tx.send((i, got[i]));
                    hashing += 1;
                }
                None => {
                    landed += 1;
                    progress(tracker.land(plan, c));
                }
            }
        }
        if let Some((_, rx)) = &verifier {
            // Collect the verdicts that are ready.
            while let Ok((i, r, dt)) = rx.try_recv() {
                hashing -= 1;
                *verify_time += dt;
                match r {
                    Ok(()) => {
                        landed += 1;
                        progress(tracker.land(plan, &plan.chunks[i]));
                    }
                    Err(e) => {
                        failure.get_or_insert(Failed(e));
                    }
                }
            }
        }
        if failure.is_some() && in_flight == 0 {
            break;
        }
    }
    match failure {
        Some(f) => Err(f),
        None => Ok(()),
    }
}
