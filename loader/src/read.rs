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

use crate::dest::{Destination, HostArena};
use crate::manifest::{hash, hashed_part, Manifest};
use crate::plan::{Chunk, LoadPlan};
use crate::{AlignedBuf, Checkpoint, LoadError};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Strategy {
    Auto,
    UringDirect,
    Pread,
    Mmap,
    /// Ranged GETs from S3: what every remote checkpoint uses (never chosen by name).
    S3,
}

impl std::str::FromStr for Strategy {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Ok(match s {
            "auto" => Strategy::Auto,
            "uring-direct" | "uring" => Strategy::UringDirect,
            "pread" => Strategy::Pread,
            "mmap" => Strategy::Mmap,
            _ => {
                return Err(format!(
                    "unknown load strategy '{s}' (auto, uring-direct, pread, mmap)"
                ))
            }
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
            Strategy::S3 => "s3",
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
    /// How to reach a remote checkpoint's store (`None`: [`crate::s3::S3Config::from_env`] at
    /// load time). Never written anywhere: it may hold credentials.
    pub s3: Option<crate::s3::S3Config>,
}

impl Default for LoadOptions {
    fn default() -> Self {
        LoadOptions {
            strategy: Strategy::Auto,
            chunk_size: crate::manifest::DEFAULT_CHUNK,
            queue_depth: 16,
            threads: std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(2),
            verify: Verify::Auto,
            s3: None,
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
    Arena(std::sync::Arc<AlignedBuf>),
    Map(memmap2::Mmap),
}

impl Backing {
    /// Bytes `start..end`. Only this range is borrowed: during a streaming load other ranges of
    /// an arena may still be written by the reader thread.
    pub fn range(&self, start: usize, end: usize) -> &[u8] {
        match self {
            Backing::Arena(a) => {
                assert!(start <= end && end <= a.len(), "range outside the arena");
                // SAFETY: inside the arena (checked); the caller only asks for landed ranges.
                unsafe { std::slice::from_raw_parts(a.as_ptr().add(start), end - start) }
            }
            Backing::Map(m) => &m[start..end],
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
            let last = c.last_layer.min(plan.layers - 1);
            pending[c.layer..=last].iter_mut().for_each(|p| *p += 1);
        }
        LayerTracker {
            pending,
            ready: 0,
            done: 0,
        }
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
            bytes_done: self
                .done
                .min(plan.shards.iter().map(|s| s.aligned_len).sum()),
            bytes_total: plan.shards.iter().map(|s| s.aligned_len).sum(),
            layers_ready: self.ready,
            layers_total: plan.layers,
        }
    }
}

/// Fraction of the checkpoint's data pages currently in the page cache.
///
/// Large shards are sampled: [`RESIDENCY_SAMPLES`] evenly spaced windows of
/// [`RESIDENCY_WINDOW`] bytes each. mincore costs a page-cache lookup per page, and over an
/// 8B checkpoint's 4 M pages that was 168 ms of a 613 ms load on an H200 host; the decision it
/// feeds (a threshold of 0.9) does not need every page.
pub fn resident_fraction(plan: &LoadPlan) -> f64 {
    let (mut res, mut total) = (0u64, 0u64);
    for s in &plan.shards {
        if let Some((r, t)) = file_residency(&s.path) {
            res += r;
            total += t;
        }
    }
    if total == 0 {
        0.0
    } else {
        res as f64 / total as f64
    }
}

/// (resident pages, pages looked at) of one file, over [`residency_windows`].
fn file_residency(path: &std::path::Path) -> Option<(u64, u64)> {
    let f = File::open(path).ok()?;
    // SAFETY: a read-only shared mapping of a file we just opened; only mincore looks at it.
    let m = unsafe { memmap2::MmapOptions::new().map(&f) }.ok()?;
    let (mut res, mut total) = (0u64, 0u64);
    for (off, len) in residency_windows(m.len()) {
        let pages = len.div_ceil(PAGE);
        let mut vec = vec![0u8; pages];
        // SAFETY: [off, off + len) lies inside the mapping, `off` is page-aligned, and vec has
        // one byte per page.
        let rc = unsafe {
            libc::mincore(
                m.as_ptr().add(off) as *mut libc::c_void,
                len,
                vec.as_mut_ptr(),
            )
        };
        if rc == 0 {
            res += vec.iter().filter(|&&b| b & 1 == 1).count() as u64;
            total += pages as u64;
        }
    }
    Some((res, total))
}

const PAGE: usize = 4096;
/// Windows sampled per shard by [`resident_fraction`], and their size.
pub const RESIDENCY_SAMPLES: usize = 64;
pub const RESIDENCY_WINDOW: usize = 1 << 20;

/// The (page-aligned offset, length) ranges of a `len`-byte file that residency is read over:
/// all of it when small, else evenly spaced windows from its start to its end.
fn residency_windows(len: usize) -> Vec<(usize, usize)> {
    if len <= RESIDENCY_SAMPLES * RESIDENCY_WINDOW * 2 {
        return if len == 0 { vec![] } else { vec![(0, len)] };
    }
    let last = (len - RESIDENCY_WINDOW) / PAGE * PAGE;
    (0..RESIDENCY_SAMPLES)
        .map(|i| {
            let off = last / (RESIDENCY_SAMPLES - 1) * i / PAGE * PAGE;
            (off, RESIDENCY_WINDOW)
        })
        .collect()
}

fn check_len(plan: &LoadPlan, c: &Chunk, got: u64) -> Result<(), LoadError> {
    let s = &plan.shards[c.shard];
    let need = (s.data_start + s.data_len)
        .saturating_sub(c.file_off)
        .min(c.len);
    if got < need {
        return Err(LoadError::invalid(
            &s.path,
            format!(
                "file ended during the load: bytes {}..{} came back {} short (did it shrink?)",
                c.file_off,
                c.file_off + c.len,
                need - got
            ),
        ));
    }
    Ok(())
}

pub(crate) fn verify_chunk(
    plan: &LoadPlan,
    c: &Chunk,
    buf: &[u8],
    want: &str,
) -> Result<(), LoadError> {
    let got = hash(hashed_part(plan, c, buf));
    if got != want {
        let s = &plan.shards[c.shard];
        let end = (s.data_start + s.data_len).min(c.file_off + c.len);
        return Err(LoadError::invalid(
            &s.path,
            format!(
                "integrity check failed for bytes {}..{end}: xxh3 {got}, manifest says {want}",
                c.file_off
            ),
        ));
    }
    Ok(())
}

pub struct Loaded {
    pub backing: Vec<Backing>,
    /// Offset of each shard's data section inside its backing.
    pub data_offset: Vec<u64>,
    pub stats: LoadStats,
}

/// Everything a strategy needs besides the destination.
pub(crate) struct Job {
    pub(crate) plan: LoadPlan,
    pub(crate) expected: Option<Vec<String>>,
    pub(crate) opts: LoadOptions,
    pub(crate) stats: LoadStats,
    t0: Instant,
}

pub(crate) fn begin(ck: &Checkpoint, opts: &LoadOptions) -> Result<Job, LoadError> {
    let t0 = Instant::now();
    let manifest = match opts.verify {
        Verify::Off => None,
        _ => Manifest::read(&ck.dir)?,
    };
    if manifest.is_none() && opts.verify == Verify::Required {
        return Err(LoadError::invalid(
            &ck.dir,
            "integrity verification required but there is no thaw-manifest.json",
        ));
    }
    let chunk_size = manifest
        .as_ref()
        .map(|m| m.chunk_size)
        .unwrap_or(opts.chunk_size);
    let plan = LoadPlan::new(ck, chunk_size);
    let expected = match &manifest {
        Some(m) => Some(m.expected(&plan, &ck.dir)?),
        None => None,
    };
    let resident = if ck.remote.is_some() {
        0.0
    } else {
        resident_fraction(&plan)
    };
    let stats = LoadStats {
        bytes: plan.total_bytes(),
        resident,
        verified: expected.is_some(),
        plan_s: t0.elapsed().as_secs_f64(),
        ..Default::default()
    };
    Ok(Job {
        plan,
        expected,
        opts: opts.clone(),
        stats,
        t0,
    })
}

/// Runs `strategy` (uring-direct or pread) into `dest`, falling back from uring-direct to pread
/// when the system refuses it. Returns the strategy used.
pub(crate) fn read_into(
    ck: &Checkpoint,
    job: &mut Job,
    mut strategy: Strategy,
    dest: &mut dyn Destination,
    progress: &mut dyn FnMut(Progress),
) -> Result<Strategy, LoadError> {
    dest.prepare(&job.plan)?;
    let t_io = Instant::now();
    let mut verify_time = Duration::ZERO;
    if let Some(remote) = &ck.remote {
        let plan = &job.plan;
        let expected = job.expected.as_deref();
        let dest: &dyn Destination = &*dest;
        let mut tracker = LayerTracker::new(plan);
        crate::s3::load_chunks(plan, remote, &job.opts, dest, &mut |i, len, buf| {
            let c = &plan.chunks[i];
            check_len(plan, c, len)?;
            if let Some(h) = expected {
                let t = Instant::now();
                verify_chunk(plan, c, buf, &h[i])?;
                verify_time += t.elapsed();
            }
            dest.landed(i, c, len)?;
            progress(tracker.land(plan, c));
            Ok(())
        })?;
        job.stats.verify_s = verify_time.as_secs_f64();
        job.stats.io_s = t_io.elapsed().as_secs_f64() - job.stats.verify_s;
        return Ok(Strategy::S3);
    }
    loop {
        let mut tracker = LayerTracker::new(&job.plan);
        let expected = job.expected.as_deref();
        let r = match strategy {
            Strategy::Pread => load_pread(
                &job.plan,
                job.opts.threads,
                expected,
                &*dest,
                &mut tracker,
                progress,
                &mut verify_time,
            ),
            _ => load_uring(
                &job.plan,
                &job.opts,
                expected,
                &*dest,
                &mut tracker,
                progress,
                &mut verify_time,
            ),
        };
        match r {
            Ok(()) => break,
            Err(Refused(reason)) if strategy == Strategy::UringDirect => {
                job.stats.fallback = Some(reason);
                strategy = Strategy::Pread;
                verify_time = Duration::ZERO;
            }
            Err(Refused(reason)) => return Err(LoadError::invalid(&ck.dir, reason)),
            Err(Failed(e)) => return Err(e),
        }
    }
    job.stats.verify_s = verify_time.as_secs_f64();
    job.stats.io_s = t_io.elapsed().as_secs_f64() - job.stats.verify_s;
    Ok(strategy)
}

pub(crate) fn finish(job: &mut Job, strategy: Strategy) {
    job.stats.strategy = strategy.name().to_string();
    job.stats.total_s = job.t0.elapsed().as_secs_f64();
}

/// Loads every shard of `ck` into host memory with `opts`, calling `progress` as chunks land.
pub fn load(
    ck: &Checkpoint,
    opts: &LoadOptions,
    progress: &mut dyn FnMut(Progress),
) -> Result<Loaded, LoadError> {
    let mut job = begin(ck, opts)?;
    let strategy = match opts.strategy {
        _ if ck.remote.is_some() => Strategy::S3,
        // Resident: use the page cache in place — nothing to read, nothing to copy.
        Strategy::Auto if job.stats.resident >= 0.9 => Strategy::Mmap,
        Strategy::Auto => Strategy::UringDirect,
        s => s,
    };
    if strategy == Strategy::Mmap {
        let t_io = Instant::now();
        let mut verify_time = Duration::ZERO;
        let mut tracker = LayerTracker::new(&job.plan);
        let maps = match load_mmap(
            &job.plan,
            job.expected.as_deref(),
            &mut tracker,
            progress,
            &mut verify_time,
        ) {
            Ok(m) => m,
            Err(Failed(e)) => return Err(e),
            Err(Refused(r)) => return Err(LoadError::invalid(&ck.dir, r)),
        };
        job.stats.verify_s = verify_time.as_secs_f64();
        job.stats.io_s = t_io.elapsed().as_secs_f64() - job.stats.verify_s;
        finish(&mut job, strategy);
        let data_offset = job.plan.shards.iter().map(|s| s.data_start).collect();
        return Ok(Loaded {
            backing: maps,
            data_offset,
            stats: job.stats,
        });
    }
    let mut dest = HostArena::new();
    let used = read_into(ck, &mut job, strategy, &mut dest, progress)?;
    finish(&mut job, used);
    let data_offset = job.plan.shards.iter().map(|s| s.data_offset()).collect();
    Ok(Loaded {
        backing: dest.into_arenas().into_iter().map(Backing::Arena).collect(),
        data_offset,
        stats: job.stats,
    })
}

/// Loads every shard of `ck` into any [`Destination`] (`mmap` and `auto` read with
/// uring-direct here: there is no in-place use outside host memory). Returns the plan the
/// destination was prepared with, and the stats.
pub fn load_into(
    ck: &Checkpoint,
    opts: &LoadOptions,
    dest: &mut dyn Destination,
    progress: &mut dyn FnMut(Progress),
) -> Result<(LoadPlan, LoadStats), LoadError> {
    load_job_into(ck, begin(ck, opts)?, dest, progress)
}

/// [`load_into`] for a load already begun (plan made, manifest read, residency sampled).
pub(crate) fn load_job_into(
    ck: &Checkpoint,
    mut job: Job,
    dest: &mut dyn Destination,
    progress: &mut dyn FnMut(Progress),
) -> Result<(LoadPlan, LoadStats), LoadError> {
    // Bytes must be copied into the destination's buffers either way (no in-place mapping), so
    // `auto` reads a page-cache-resident checkpoint with buffered parallel preads (memory
    // speed; O_DIRECT would go back to the disk) and anything else with io_uring + O_DIRECT.
    let strategy = match job.opts.strategy {
        Strategy::Pread => Strategy::Pread,
        Strategy::Auto if job.stats.resident >= 0.9 => Strategy::Pread,
        _ => Strategy::UringDirect,
    };
    let used = read_into(ck, &mut job, strategy, dest, progress)?;
    finish(&mut job, used);
    Ok((job.plan, job.stats))
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

#[allow(clippy::too_many_arguments)]
fn load_pread(
    plan: &LoadPlan,
    threads: usize,
    expected: Option<&[String]>,
    dest: &dyn Destination,
    tracker: &mut LayerTracker,
    progress: &mut dyn FnMut(Progress),
    verify_time: &mut Duration,
) -> Result<(), LoadFailure> {
    let files = plan
        .shards
        .iter()
        .map(|s| File::open(&s.path).map_err(|e| LoadError::io(&s.path, e)))
        .collect::<Result<Vec<_>, _>>()?;
    let threads = threads.clamp(1, dest.max_regions());
    let next = AtomicUsize::new(0);
    let landed: Mutex<(Vec<usize>, Option<LoadError>, Duration)> =
        Mutex::new((Vec::new(), None, Duration::ZERO));
    std::thread::scope(|scope| {
        for _ in 0..threads {
            scope.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= plan.chunks.len() || landed.lock().map(|l| l.1.is_some()).unwrap_or(true) {
                    break;
                }
                let c = &plan.chunks[i];
                let s = &plan.shards[c.shard];
                let len = (c.len.min(s.file_len.saturating_sub(c.file_off))) as usize;
                dest.prefault(i, c);
                let mut result = dest.region(i, c);
                let mut got = 0usize;
                let mut verify = Duration::ZERO;
                if let Ok(ptr) = result {
                    // SAFETY: the destination gives chunk i's region (c.len ≥ len bytes) to this
                    // thread alone until `landed(i)`.
                    let buf = unsafe { std::slice::from_raw_parts_mut(ptr, len) };
                    let mut r = Ok(());
                    while got < len {
                        match files[c.shard].read_at(&mut buf[got..], c.file_off + got as u64) {
                            Ok(0) => break,
                            Ok(n) => got += n,
                            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                            Err(e) => {
                                r = Err(LoadError::io(&s.path, e));
                                break;
                            }
                        }
                    }
                    let t = Instant::now();
                    r = r.and_then(|_| check_len(plan, c, got as u64)).and_then(
                        |_| match expected {
                            Some(h) => verify_chunk(plan, c, buf, &h[i]),
                            None => Ok(()),
                        },
                    );
                    verify = t.elapsed();
                    result = r.and_then(|_| dest.landed(i, c, got as u64)).map(|_| ptr);
                }
                let mut l = landed.lock().unwrap_or_else(|e| e.into_inner());
                l.2 += verify;
                match result {
                    Ok(_) => l.0.push(i),
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
    *verify_time = vt / threads as u32;
    match err {
        Some(e) => Err(Failed(e)),
        None => Ok(()),
    }
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
            return Err(Failed(LoadError::invalid(
                &s.path,
                format!("file shrank to {len} bytes since its header was read"),
            )));
        }
        // SAFETY: a private read-only mapping. If another process truncates the file while it is
        // mapped, reads fault (SIGBUS) — the accepted contract of in-place loading, as with
        // llama.cpp's mmap; the size check above catches truncation before the load.
        let m = unsafe { memmap2::MmapOptions::new().populate().map(&f) }
            .map_err(|e| LoadError::io(&s.path, e))?;
        maps.push(m);
    }
    if let Some(h) = expected {
        // Hash on every core: in place, verification is the only work left.
        let t = Instant::now();
        let next = AtomicUsize::new(0);
        let threads = std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1);
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
                        errors
                            .lock()
                            .unwrap_or_else(|p| p.into_inner())
                            .get_or_insert(e);
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

/// A region pointer handed between the submitting thread and the helper.
#[derive(Clone, Copy)]
struct RegionPtr(*mut u8);
// SAFETY: a region belongs to exactly one chunk, and the chunk to one thread at a time (the
// submitter until its read completes, then the hashing helper until its verdict is sent).
unsafe impl Send for RegionPtr {}

/// Sends completed chunks (index, region, bytes) to the hashing helper; receives verdicts.
type Verifier = (
    std::sync::mpsc::Sender<(usize, RegionPtr, u64)>,
    std::sync::mpsc::Receiver<(usize, Result<(), LoadError>, Duration)>,
);

#[allow(clippy::too_many_arguments)]
fn load_uring(
    plan: &LoadPlan,
    opts: &LoadOptions,
    expected: Option<&[String]>,
    dest: &dyn Destination,
    tracker: &mut LayerTracker,
    progress: &mut dyn FnMut(Progress),
    verify_time: &mut Duration,
) -> Result<(), LoadFailure> {
    use io_uring::IoUring;

    // Operators can rule io_uring out (some hardened kernels and sandboxes refuse it in ways that
    // are slow to discover); it is then refused like a failing io_uring_setup.
    if std::env::var("THAW_IO_URING").is_ok_and(|v| v == "off" || v == "0") {
        return Err(Refused("io_uring disabled by THAW_IO_URING".into()));
    }
    let mut files = Vec::with_capacity(plan.shards.len());
    for s in &plan.shards {
        match std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_DIRECT)
            .open(&s.path)
        {
            Ok(f) => files.push(f),
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                return Err(Refused(format!(
                    "O_DIRECT refused on {} ({e})",
                    s.path.display()
                )))
            }
            Err(e) => return Err(Failed(LoadError::io(&s.path, e))),
        }
    }
    let depth = opts.queue_depth.clamp(1, 256).min(dest.max_regions());
    // Probe io_uring before anything else.
    drop(IoUring::new(depth as u32).map_err(|e| Refused(format!("io_uring unavailable ({e})")))?);
    // A helper thread runs ahead of the reads calling `prefault` in plan order (for the host
    // arena: fresh huge pages are faulted and zeroed there, overlapping the disk instead of
    // adding to each read — ~25% of a cold load otherwise); a chunk is submitted only once the
    // helper is past it. Then the helper verifies landed chunks: hashing on the thread that
    // reaps completions would delay resubmission and starve the queue.
    let prefaulted = AtomicUsize::new(0);
    let stop = std::sync::atomic::AtomicBool::new(false);
    let (job_tx, job_rx) = std::sync::mpsc::channel::<(usize, RegionPtr, u64)>();
    let (done_tx, done_rx) = std::sync::mpsc::channel::<(usize, Result<(), LoadError>, Duration)>();
    std::thread::scope(|scope| {
        let (prefaulted, stop) = (&prefaulted, &stop);
        scope.spawn(move || {
            for (i, c) in plan.chunks.iter().enumerate() {
                if stop.load(Ordering::Relaxed) {
                    break;
                }
                dest.prefault(i, c);
                prefaulted.store(i + 1, Ordering::Release);
            }
            let Some(h) = expected else { return };
            for (i, ptr, got) in job_rx {
                let c = &plan.chunks[i];
                let t = Instant::now();
                // SAFETY: chunk i's read completed before its job was sent; nothing writes the
                // region until its verdict is back and `landed` has run.
                let buf = unsafe { std::slice::from_raw_parts(ptr.0, got as usize) };
                let r = verify_chunk(plan, c, buf, &h[i]);
                if done_tx.send((i, r, t.elapsed())).is_err() {
                    break;
                }
            }
        });
        let verifier = expected.map(|_| (job_tx, done_rx));
        let r = uring_reads(
            plan,
            &files,
            depth,
            dest,
            prefaulted,
            verifier,
            tracker,
            progress,
            verify_time,
        );
        stop.store(true, Ordering::Relaxed);
        r
    })
}

/// Applies the hashing helper's verdict on chunk `i`: landed (and reported) or the load's failure.
#[allow(clippy::too_many_arguments)]
fn take_verdict(
    plan: &LoadPlan,
    (i, r, dt): (usize, Result<(), LoadError>, Duration),
    got: &[u64],
    dest: &dyn Destination,
    landed: &mut usize,
    verify_time: &mut Duration,
    failure: &mut Option<LoadFailure>,
    tracker: &mut LayerTracker,
    progress: &mut dyn FnMut(Progress),
) {
    *verify_time += dt;
    match r.and_then(|_| dest.landed(i, &plan.chunks[i], got[i])) {
        Ok(()) => {
            *landed += 1;
            progress(tracker.land(plan, &plan.chunks[i]));
        }
        Err(e) => {
            failure.get_or_insert(Failed(e));
        }
    }
}

#[allow(clippy::too_many_arguments)]
fn uring_reads(
    plan: &LoadPlan,
    files: &[File],
    depth: usize,
    dest: &dyn Destination,
    prefaulted: &AtomicUsize,
    verifier: Option<Verifier>,
    tracker: &mut LayerTracker,
    progress: &mut dyn FnMut(Progress),
    verify_time: &mut Duration,
) -> Result<(), LoadFailure> {
    use io_uring::{opcode, types, IoUring};
    let mut ring =
        IoUring::new(depth as u32).map_err(|e| Refused(format!("io_uring unavailable ({e})")))?;
    // Per chunk: its region and the bytes read so far (short reads are resubmitted).
    let mut region: Vec<*mut u8> = vec![std::ptr::null_mut(); plan.chunks.len()];
    let mut got = vec![0u64; plan.chunks.len()];
    let (mut next, mut in_flight, mut landed, mut hashing) = (0usize, 0usize, 0usize, 0usize);
    let submit =
        |ring: &mut IoUring, i: usize, ptr: *mut u8, got: u64| -> Result<(), LoadFailure> {
            let c = &plan.chunks[i];
            // SAFETY: `ptr` + `got` stays inside chunk i's region (c.len bytes), which the
            // destination gave to us alone; we drain the ring before returning.
            let sqe = opcode::Read::new(
                types::Fd(files[c.shard].as_raw_fd()),
                unsafe { ptr.add(got as usize) },
                (c.len - got) as u32,
            )
            .offset(c.file_off + got)
            .build()
            .user_data(i as u64);
            // SAFETY: the buffer stays valid and unaliased until the completion is reaped.
            unsafe { ring.submission().push(&sqe) }.map_err(|_| {
                Failed(LoadError::invalid(
                    &plan.shards[c.shard].path,
                    "io_uring submission queue full",
                ))
            })?;
            Ok(())
        };
    let mut failure: Option<LoadFailure> = None;
    while landed < plan.chunks.len() {
        // Regions are held from submission until landed (through hashing), so they count
        // against the destination's cap separately from reads in flight.
        while failure.is_none()
            && in_flight < depth
            && in_flight + hashing < dest.max_regions()
            && next < plan.chunks.len()
        {
            if prefaulted.load(Ordering::Acquire) <= next {
                if in_flight > 0 {
                    break; // reap completions meanwhile
                }
                std::thread::yield_now();
                continue;
            }
            // With reads in flight, only memory that is ready: blocking here would hold back
            // their submission and reaping (a destination still allocating buffers).
            let r = if in_flight > 0 {
                dest.try_region(next, &plan.chunks[next])
            } else {
                dest.region(next, &plan.chunks[next]).map(Some)
            };
            match r {
                Ok(Some(p)) => region[next] = p,
                Ok(None) => break,
                Err(e) => {
                    failure = Some(Failed(e));
                    break;
                }
            }
            submit(&mut ring, next, region[next], 0)?;
            next += 1;
            in_flight += 1;
        }
        if in_flight == 0 {
            // Only verdicts are outstanding: wait for the next one.
            if let (Some((_, rx)), true) = (&verifier, hashing > 0 && failure.is_none()) {
                let Ok(v) = rx.recv() else { break };
                hashing -= 1;
                take_verdict(
                    plan,
                    v,
                    &got,
                    dest,
                    &mut landed,
                    verify_time,
                    &mut failure,
                    tracker,
                    progress,
                );
                continue;
            }
            break;
        }
        if let Err(e) = ring.submit_and_wait(1) {
            if e.raw_os_error() != Some(libc::EINTR) {
                failure.get_or_insert(Failed(LoadError::invalid(
                    &plan.shards[0].path,
                    format!("io_uring wait failed: {e}"),
                )));
                break;
            }
            continue;
        }
        let cqes: Vec<(usize, i32)> = ring
            .completion()
            .map(|c| (c.user_data() as usize, c.result()))
            .collect();
        for (i, res) in cqes {
            in_flight -= 1;
            let c = &plan.chunks[i];
            let s = &plan.shards[c.shard];
            if res < 0 {
                let err = std::io::Error::from_raw_os_error(-res);
                if res == -libc::EINVAL && landed == 0 {
                    failure.get_or_insert(Refused(format!(
                        "O_DIRECT read refused on {} ({err})",
                        s.path.display()
                    )));
                } else {
                    failure.get_or_insert(Failed(LoadError::io(&s.path, err)));
                }
                continue;
            }
            got[i] += res as u64;
            let at_eof = res == 0 || c.file_off + got[i] >= s.file_len;
            if got[i] < c.len && !at_eof && failure.is_none() {
                // Short read mid-file: ask for the rest.
                submit(&mut ring, i, region[i], got[i])?;
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
                    let _ = tx.send((i, RegionPtr(region[i]), got[i]));
                    hashing += 1;
                }
                None => take_verdict(
                    plan,
                    (i, Ok(()), Duration::ZERO),
                    &got,
                    dest,
                    &mut landed,
                    verify_time,
                    &mut failure,
                    tracker,
                    progress,
                ),
            }
        }
        if let Some((_, rx)) = &verifier {
            // Collect the verdicts that are ready.
            while let Ok(v) = rx.try_recv() {
                hashing -= 1;
                take_verdict(
                    plan,
                    v,
                    &got,
                    dest,
                    &mut landed,
                    verify_time,
                    &mut failure,
                    tracker,
                    progress,
                );
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

#[cfg(test)]
mod residency_tests {
    use super::*;
    use std::io::Write;

    #[test]
    fn windows_cover_small_files_whole_and_sample_large_ones_end_to_end() {
        assert!(residency_windows(0).is_empty());
        assert_eq!(residency_windows(5000), vec![(0, 5000)]);
        let big = 16usize << 30;
        let w = residency_windows(big);
        assert_eq!(w.len(), RESIDENCY_SAMPLES);
        assert_eq!(w[0].0, 0);
        assert!(w.iter().all(|&(o, l)| o % PAGE == 0 && o + l <= big));
        assert!(
            w.windows(2).all(|p| p[0].0 + p[0].1 <= p[1].0),
            "disjoint, in order"
        );
        assert!(w.last().unwrap().0 + RESIDENCY_WINDOW > big - (big / RESIDENCY_SAMPLES));
    }

    /// A file bigger than the sampling threshold, evicted, then half read back: the sampled
    /// fraction sees the half (and all of it once the rest is read).
    #[test]
    fn sampled_residency_tracks_what_is_cached() {
        let dir = std::env::temp_dir().join(format!("thaw-residency-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("big.bin");
        let len = RESIDENCY_SAMPLES * RESIDENCY_WINDOW * 3;
        let mut f = File::create(&path).unwrap();
        let block = vec![7u8; 1 << 20];
        for _ in 0..len / block.len() {
            f.write_all(&block).unwrap();
        }
        f.sync_all().unwrap();
        // SAFETY: advice on an open descriptor; no memory is touched.
        unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
        let (r0, t) = file_residency(&path).unwrap();
        assert_eq!(
            t as usize,
            RESIDENCY_SAMPLES * RESIDENCY_WINDOW / PAGE,
            "sampled, not whole"
        );
        let mut buf = vec![0u8; 1 << 20];
        let f = File::open(&path).unwrap();
        for i in 0..len / 2 / buf.len() {
            f.read_exact_at(&mut buf, (i << 20) as u64).unwrap();
        }
        let (r1, _) = file_residency(&path).unwrap();
        let half = r1 as f64 / t as f64;
        for i in len / 2 / buf.len()..len / buf.len() {
            f.read_exact_at(&mut buf, (i << 20) as u64).unwrap();
        }
        let (r2, _) = file_residency(&path).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
        eprintln!("evicted {r0}/{t}, half read {half:.2}, all read {r2}/{t}");
        // Eviction is advice; where the kernel kept the pages the half-read check says nothing.
        if r0 == 0 {
            assert!((0.4..=0.6).contains(&half), "half read: {half}");
        }
        // (Memory pressure may take back a few pages meanwhile.)
        assert!(r2 as f64 >= 0.95 * t as f64, "all read: {r2}/{t}");
    }
}
