//! Run-time compilation of the kernels with NVRTC, for the device's own architecture, cached
//! on disk: one program per kernel family ([`PARTS`]: `common.cuh` then that family's `.cu`
//! file), compiled concurrently, so a cold cache waits for the slowest family, not the sum.
//!
//! Two forms: a **cubin** (machine code for exactly `sm_XY`) and **PTX** (for `compute_XY`,
//! which the driver must still compile for the GPU when the module loads). The cubin is what a
//! cold start wants: on an H200 the driver's PTX compile of these kernels took 1.4 s in a fresh
//! process (187 ms with the driver's own cache warm), where loading a cubin is a copy. PTX stays
//! as the fallback for a GPU nobody compiled a cubin for, on a host without NVRTC. Both are
//! cached under a key made of the source and the architecture, so a cold start after the first
//! need not even open libnvrtc (~100 MB); `thaw kernels --arch 9.0` fills the cache ahead (e.g.
//! while building an image).

use std::path::{Path, PathBuf};

use super::CudaError;

/// One NVRTC program: `common.cuh` then one family's kernels, and the kernels it defines.
/// The families compile as separate programs, on threads of their own: a cold cache's compile
/// then takes as long as the slowest family instead of the sum (each is a separate module on
/// the GPU; none calls another's functions).
#[derive(Debug)]
pub struct Part {
    pub name: &'static str,
    pub source: &'static str,
    /// `-D` options selecting the kernels of a file this part compiles (a file split over
    /// parts guards its kernels with them).
    pub defines: &'static [&'static str],
    pub kernels: &'static [&'static str],
}

macro_rules! part_source {
    ($file:literal) => {
        concat!(include_str!("common.cuh"), "\n", include_str!($file))
    };
}

/// The kernels, by program (a file split over two programs guards each family with a
/// `THAW_SKIP_*` macro: an uninstantiated template costs NVRTC nothing).
pub const PARTS: &[Part] = &[
    Part {
        name: "elementwise",
        source: part_source!("elementwise.cu"),
        defines: &[],
        kernels: &[
            "widen",
            "embed",
            "rmsnorm",
            "add_bias",
            "silu_mul",
            "rope_store",
            "argmax_rows",
            "read_probe",
        ],
    },
    Part {
        name: "attention",
        source: part_source!("attention.cu"),
        defines: &["THAW_SKIP_PREFILL"],
        kernels: &["attention", "attention_merge"],
    },
    Part {
        name: "prefill",
        source: part_source!("attention.cu"),
        defines: &["THAW_SKIP_DECODE"],
        kernels: &["attention_prefill"],
    },
    Part {
        name: "gemv",
        source: part_source!("gemv.cu"),
        defines: &["THAW_SKIP_GEMV_ONE", "THAW_SKIP_GEMV_WARP"],
        kernels: &["gemv"],
    },
    Part {
        name: "gemv1",
        source: part_source!("gemv.cu"),
        defines: &["THAW_SKIP_GEMV_ROWS", "THAW_SKIP_GEMV_WARP"],
        kernels: &["gemv1", "gemv1v"],
    },
    Part {
        name: "gemv_warp",
        source: part_source!("gemv.cu"),
        defines: &["THAW_SKIP_GEMV_ROWS", "THAW_SKIP_GEMV_ONE"],
        kernels: &["gemv1r"],
    },
];

/// Every kernel of every part.
pub fn kernels() -> impl Iterator<Item = &'static str> {
    PARTS.iter().flat_map(|p| p.kernels.iter().copied())
}

/// The part (index into [`PARTS`]) that defines `kernel`.
pub fn part_of(kernel: &str) -> Option<usize> {
    PARTS.iter().position(|p| p.kernels.contains(&kernel))
}

/// What NVRTC is asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Form {
    /// Machine code for `sm_XY` (loads without a driver-side compile).
    Cubin,
    /// PTX for `compute_XY` (the driver compiles it at load).
    Ptx,
}

impl Form {
    fn ext(self) -> &'static str {
        match self {
            Form::Cubin => "cubin",
            Form::Ptx => "ptx",
        }
    }
}

/// The compiled modules for one architecture (one image per [`PARTS`] entry, in order), and
/// where they came from.
#[derive(Debug, Clone)]
pub struct Compiled {
    pub form: Form,
    /// Each part's cubin bytes, or its PTX text's.
    pub images: Vec<Vec<u8>>,
    /// Every part taken from the on-disk cache (no NVRTC call).
    pub cache_hit: bool,
    /// Wall time of the whole (the parts compile concurrently).
    pub seconds: f64,
    /// Each part's own compile (or cache read) time.
    pub part_seconds: Vec<f64>,
}

impl Compiled {
    /// Part `i`'s image as cudarc's module input.
    pub fn module_input(&self, i: usize) -> cudarc::nvrtc::Ptx {
        match self.form {
            Form::Cubin => cudarc::nvrtc::Ptx::from_binary(self.images[i].clone()),
            Form::Ptx => cudarc::nvrtc::Ptx::from_src(String::from_utf8_lossy(&self.images[i])),
        }
    }
}

/// Whether libnvrtc can be loaded here.
pub fn nvrtc_present() -> bool {
    // SAFETY: only probes whether the library can be opened.
    unsafe { cudarc::nvrtc::sys::is_culib_present() }
}

/// FNV-1a: a stable cache key (std's hasher is randomly seeded per process).
fn fnv1a(parts: &[&[u8]]) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for p in parts {
        for &b in p.iter() {
            h ^= b as u64;
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
        h ^= 0xff;
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

fn nvrtc_err(what: &str, e: impl std::fmt::Debug) -> CudaError {
    CudaError::Compile(format!("{what}: {e:?}"))
}

/// Compiles `part` for compute capability `arch` (e.g. `(9, 0)`) into `form`, NVRTC only.
pub fn compile(part: &Part, arch: (i32, i32), form: Form) -> Result<Vec<u8>, CudaError> {
    use cudarc::nvrtc::{result, sys};
    if !nvrtc_present() {
        return Err(CudaError::Compile(
            "libnvrtc could not be loaded (install the CUDA runtime libraries or set LD_LIBRARY_PATH)"
                .into(),
        ));
    }
    let target = match form {
        Form::Cubin => format!("--gpu-architecture=sm_{}{}", arch.0, arch.1),
        Form::Ptx => format!("--gpu-architecture=compute_{}{}", arch.0, arch.1),
    };
    let mut opts = vec![target, "--std=c++17".to_string()];
    opts.extend(part.defines.iter().map(|d| format!("-D{d}")));
    let opts: Vec<&str> = opts.iter().map(String::as_str).collect();
    let src = std::ffi::CString::new(part.source).map_err(|e| nvrtc_err("source", e))?;
    let name = std::ffi::CString::new(format!("thaw_{}.cu", part.name))
        .map_err(|e| nvrtc_err("name", e))?;
    let prog = result::create_program(&src, Some(&name)).map_err(|e| nvrtc_err("program", e))?;
    // SAFETY: `prog` is a live program until destroyed below; the output buffers are sized by
    // NVRTC's own size queries.
    let out = unsafe {
        let compiled = result::compile_program(prog, &opts);
        let r = match compiled {
            Err(e) => {
                let log = result::get_program_log(prog)
                    .map(|l| {
                        let b: Vec<u8> = l.iter().map(|&c| c as u8).collect();
                        String::from_utf8_lossy(&b)
                            .trim_end_matches('\0')
                            .to_string()
                    })
                    .unwrap_or_default();
                Err(CudaError::Compile(format!("{}: {e:?}: {log}", part.name)))
            }
            Ok(()) => match form {
                Form::Ptx => result::get_ptx(prog)
                    .map(|p| {
                        let mut b: Vec<u8> = p.iter().map(|&c| c as u8).collect();
                        while b.last() == Some(&0) {
                            b.pop();
                        }
                        b
                    })
                    .map_err(|e| nvrtc_err("PTX", e)),
                Form::Cubin => {
                    let mut n = 0usize;
                    sys::nvrtcGetCUBINSize(prog, &mut n)
                        .result()
                        .map_err(|e| nvrtc_err("cubin size", e))
                        .and_then(|_| {
                            let mut b = vec![0u8; n];
                            sys::nvrtcGetCUBIN(prog, b.as_mut_ptr() as *mut _)
                                .result()
                                .map(|_| b)
                                .map_err(|e| nvrtc_err("cubin", e))
                        })
                }
            },
        };
        let _ = result::destroy_program(prog);
        r
    }?;
    check(part, form, &out)?;
    Ok(out)
}

/// Whether `image` looks like `part`'s whole module in `form`: every kernel's entry in PTX, the
/// ELF magic and every kernel's name in a cubin.
fn check(part: &Part, form: Form, image: &[u8]) -> Result<(), CudaError> {
    let missing = part.kernels.iter().find(|k| {
        let needle = match form {
            Form::Ptx => format!(".entry {k}("),
            Form::Cubin => format!("{k}\0"),
        };
        !image.windows(needle.len()).any(|w| w == needle.as_bytes())
    });
    if form == Form::Cubin && !image.starts_with(b"\x7fELF") {
        return Err(CudaError::Compile(format!(
            "{}: not an ELF cubin",
            part.name
        )));
    }
    match missing {
        Some(k) => Err(CudaError::Compile(format!(
            "kernel '{k}' missing from the {} {}",
            part.name,
            form.ext()
        ))),
        None => Ok(()),
    }
}

/// One part through the cache: (image, cache hit, seconds).
fn part_cached(
    part: &Part,
    arch: (i32, i32),
    form: Form,
    cache: Option<&Path>,
) -> Result<(Vec<u8>, bool, f64), CudaError> {
    let t = std::time::Instant::now();
    let path = cache.map(|dir| cache_file(dir, part, arch, form));
    if let Some(p) = &path {
        if let Ok(image) = std::fs::read(p) {
            if check(part, form, &image).is_ok() {
                return Ok((image, true, t.elapsed().as_secs_f64()));
            }
        }
    }
    let image = compile(part, arch, form)?;
    if let Some(p) = &path {
        // Write then rename: a concurrent starter never reads half a file.
        let tmp = p.with_extension(format!("tmp{}", std::process::id()));
        if std::fs::create_dir_all(p.parent().unwrap_or(Path::new("."))).is_ok()
            && std::fs::write(&tmp, &image).is_ok()
        {
            let _ = std::fs::rename(&tmp, p);
        }
    }
    Ok((image, false, t.elapsed().as_secs_f64()))
}

/// Every part of [`PARTS`] compiled for `arch` through a cache directory (`None`: no cache),
/// the parts on threads of their own ([`default_jobs`] at once). The key is the part's source, options and the
/// architecture; a hit needs no NVRTC at all. A cache that cannot be read or written is only a
/// slower start, never an error; an entry the driver refuses is dropped by the caller
/// ([`forget`]) and compiled afresh.
pub fn compile_cached(
    arch: (i32, i32),
    form: Form,
    cache: Option<&Path>,
) -> Result<Compiled, CudaError> {
    compile_cached_jobs(arch, form, cache, default_jobs())
}

/// Parts compiled at once by default: one per core, at most one per part (more threads than
/// cores measured 15% slower than as many: NVRTC is CPU-bound).
pub fn default_jobs() -> usize {
    std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .min(PARTS.len())
}

/// [`compile_cached`] with at most `jobs` parts compiling at once (`thaw kernels --jobs`: 1
/// measures each part alone, or spares a small image builder).
pub fn compile_cached_jobs(
    arch: (i32, i32),
    form: Form,
    cache: Option<&Path>,
    jobs: usize,
) -> Result<Compiled, CudaError> {
    let t = std::time::Instant::now();
    type PartResult = Result<(Vec<u8>, bool, f64), CudaError>;
    let next = std::sync::atomic::AtomicUsize::new(0);
    let slots: Vec<std::sync::Mutex<Option<PartResult>>> =
        PARTS.iter().map(|_| std::sync::Mutex::new(None)).collect();
    std::thread::scope(|s| {
        for _ in 0..jobs.clamp(1, PARTS.len()) {
            s.spawn(|| loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let Some(part) = PARTS.get(i) else { break };
                let r = part_cached(part, arch, form, cache);
                *slots[i].lock().unwrap_or_else(|e| e.into_inner()) = Some(r);
            });
        }
    });
    let results = slots.into_iter().map(|m| {
        m.into_inner()
            .unwrap_or_else(|e| e.into_inner())
            .unwrap_or_else(|| Err(CudaError::Compile("a compile thread panicked".into())))
    });
    let mut c = Compiled {
        form,
        images: Vec::with_capacity(PARTS.len()),
        cache_hit: true,
        seconds: 0.0,
        part_seconds: Vec::with_capacity(PARTS.len()),
    };
    for r in results {
        let (image, hit, secs) = r?;
        c.images.push(image);
        c.cache_hit &= hit;
        c.part_seconds.push(secs);
    }
    c.seconds = t.elapsed().as_secs_f64();
    Ok(c)
}

/// The modules for `arch`: the cached or freshly compiled cubins, else (no NVRTC here, and no
/// cubins cached for this GPU) cached PTX for the driver to compile.
pub fn module_image(arch: (i32, i32), cache: Option<&Path>) -> Result<Compiled, CudaError> {
    compile_cached(arch, Form::Cubin, cache)
        .or_else(|cubin_err| compile_cached(arch, Form::Ptx, cache).map_err(|_| cubin_err))
}

/// Removes the cache entries for `arch` and `form` (after the driver refused one).
pub fn forget(arch: (i32, i32), form: Form, cache: &Path) {
    for part in PARTS {
        let _ = std::fs::remove_file(cache_file(cache, part, arch, form));
    }
}

fn cache_file(dir: &Path, part: &Part, arch: (i32, i32), form: Form) -> PathBuf {
    let defines = part.defines.join(" ");
    let key = fnv1a(&[part.source.as_bytes(), defines.as_bytes()]);
    dir.join(format!(
        "thaw-{}-sm{}{}-{key:016x}.{}",
        part.name,
        arch.0,
        arch.1,
        form.ext()
    ))
}

#[cfg(test)]
mod tests {
    /// Without libnvrtc these tests skip — unless `THAW_REQUIRE_NVRTC` is set (scripts/test.sh
    /// sets it after installing NVRTC, so CI cannot silently stop compiling the kernels).
    fn nvrtc_or_skip() -> bool {
        if super::nvrtc_present() {
            return true;
        }
        assert!(
            std::env::var_os("THAW_REQUIRE_NVRTC").is_none(),
            "THAW_REQUIRE_NVRTC is set but libnvrtc cannot be loaded (LD_LIBRARY_PATH?)"
        );
        eprintln!("skipped: libnvrtc not found (run scripts/setup-test-deps.sh)");
        false
    }

    /// The kernels compile with NVRTC for the GPUs thaw targets (Ampere, Hopper) — no GPU
    /// needed, only libnvrtc (scripts/setup-test-deps.sh installs NVIDIA's PyPI wheel and
    /// scripts/test.sh points LD_LIBRARY_PATH at it). Skips, saying so, where it is absent.
    #[test]
    fn kernels_compile_for_ampere_and_hopper() {
        if !nvrtc_or_skip() {
            return;
        }
        for arch in [(8, 0), (9, 0)] {
            for part in super::PARTS {
                let ptx = super::compile(part, arch, super::Form::Ptx)
                    .unwrap_or_else(|e| panic!("sm_{arch:?}: {e}"));
                let ptx = String::from_utf8(ptx).unwrap();
                assert!(ptx.contains(&format!(".target sm_{}{}", arch.0, arch.1)));
                // Only its own kernels: another part's would be compiled twice.
                for k in super::kernels().filter(|k| !part.kernels.contains(k)) {
                    assert!(
                        !ptx.contains(&format!(".entry {k}(")),
                        "{k} in {}",
                        part.name
                    );
                }
                let cubin = super::compile(part, arch, super::Form::Cubin)
                    .unwrap_or_else(|e| panic!("sm_{arch:?} cubin: {e}"));
                assert!(cubin.starts_with(b"\x7fELF"), "a cubin is an ELF file");
            }
        }
    }

    /// Every kernel belongs to exactly one part, and each part's source defines its kernels
    /// (the kernels' names are the modules' entry points; that a part compiles only its own is
    /// checked on the PTX below).
    #[test]
    fn every_kernel_is_in_one_part() {
        let all: Vec<&str> = super::kernels().collect();
        let mut unique = all.clone();
        unique.sort();
        unique.dedup();
        assert_eq!(all.len(), unique.len(), "a kernel listed in two parts");
        for (i, part) in super::PARTS.iter().enumerate() {
            for k in part.kernels {
                assert_eq!(super::part_of(k), Some(i));
                assert!(
                    part.source.contains(&format!("KERNEL void {k}("))
                        || part.source.contains(&format!("{k}(const"))
                        || part.source.contains(&format!("\n{k}(")),
                    "{k} not defined in part {}",
                    part.name
                );
            }
        }
    }

    /// The second compile of the same source is a cache hit with the same PTX.
    #[test]
    fn ptx_cache_hits_the_second_time() {
        if !nvrtc_or_skip() {
            return;
        }
        let dir = std::env::temp_dir().join(format!("thaw-ptx-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        for form in [super::Form::Ptx, super::Form::Cubin] {
            let a = super::compile_cached((9, 0), form, Some(&dir)).unwrap();
            let b = super::compile_cached((9, 0), form, Some(&dir)).unwrap();
            assert!(!a.cache_hit && b.cache_hit, "{form:?}");
            assert_eq!(a.images, b.images);
            assert_eq!(a.images.len(), super::PARTS.len());
            // A damaged cache file is recompiled, not trusted.
            for e in std::fs::read_dir(&dir).unwrap() {
                std::fs::write(e.unwrap().path(), "garbage").unwrap();
            }
            let c = super::compile_cached((9, 0), form, Some(&dir)).unwrap();
            assert!(!c.cache_hit && c.images == a.images, "{form:?}");
            // One part's entry lost: only that part compiles again.
            let lost = super::cache_file(&dir, &super::PARTS[0], (9, 0), form);
            std::fs::remove_file(&lost).unwrap();
            let d = super::compile_cached((9, 0), form, Some(&dir)).unwrap();
            assert!(!d.cache_hit && d.images == a.images, "{form:?}");
            assert!(lost.exists());
        }
        // Without a cubin for this GPU and without NVRTC, a cached PTX still serves; with NVRTC
        // the cubin comes first.
        let m = super::module_image((9, 0), Some(&dir)).unwrap();
        assert_eq!(m.form, super::Form::Cubin);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
