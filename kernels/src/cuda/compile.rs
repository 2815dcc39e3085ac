//! Run-time compilation of the kernels (`SOURCE`: `common.cuh` and the `.cu` files) with NVRTC, for the device's own architecture, cached on
//! disk.
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

/// The kernels' CUDA C source: `common.cuh`, then the kernels by family, as one program.
pub const SOURCE: &str = concat!(
    include_str!("common.cuh"),
    "\n",
    include_str!("elementwise.cu"),
    "\n",
    include_str!("attention.cu"),
    "\n",
    include_str!("gemv.cu"),
);

/// Every kernel `SOURCE` defines (checked after each PTX compile).
pub const KERNELS: &[&str] = &[
    "widen",
    "embed",
    "rmsnorm",
    "add_bias",
    "silu_mul",
    "rope_store",
    "attention",
    "attention_merge",
    "attention_prefill",
    "argmax_rows",
    "gemv",
    "gemv1",
    "gemv1v",
    "gemv1r",
    "read_probe",
];

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

/// A compiled module image for one architecture, and where it came from.
#[derive(Debug, Clone)]
pub struct Compiled {
    pub form: Form,
    /// The cubin's bytes, or the PTX text's.
    pub image: Vec<u8>,
    /// Taken from the on-disk cache (no NVRTC call).
    pub cache_hit: bool,
    pub seconds: f64,
}

impl Compiled {
    /// The image as cudarc's module input.
    pub fn module_input(&self) -> cudarc::nvrtc::Ptx {
        match self.form {
            Form::Cubin => cudarc::nvrtc::Ptx::from_binary(self.image.clone()),
            Form::Ptx => cudarc::nvrtc::Ptx::from_src(String::from_utf8_lossy(&self.image)),
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

/// Compiles [`SOURCE`] for compute capability `arch` (e.g. `(9, 0)`) into `form`, NVRTC only.
pub fn compile(arch: (i32, i32), form: Form) -> Result<Vec<u8>, CudaError> {
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
    let src = std::ffi::CString::new(SOURCE).map_err(|e| nvrtc_err("source", e))?;
    let name = c"thaw_kernels.cu";
    let prog = result::create_program(&src, Some(name)).map_err(|e| nvrtc_err("program", e))?;
    // SAFETY: `prog` is a live program until destroyed below; the output buffers are sized by
    // NVRTC's own size queries.
    let out = unsafe {
        let compiled = result::compile_program(prog, &[target.as_str(), "--std=c++17"]);
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
                Err(CudaError::Compile(format!("{e:?}: {log}")))
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
    check(form, &out)?;
    Ok(out)
}

/// Whether `image` looks like a whole module of `form`: every kernel's entry in PTX, the ELF
/// magic and every kernel's name in a cubin.
fn check(form: Form, image: &[u8]) -> Result<(), CudaError> {
    let missing = KERNELS.iter().find(|k| {
        let needle = match form {
            Form::Ptx => format!(".entry {k}("),
            Form::Cubin => format!("{k}\0"),
        };
        !image.windows(needle.len()).any(|w| w == needle.as_bytes())
    });
    if form == Form::Cubin && !image.starts_with(b"\x7fELF") {
        return Err(CudaError::Compile("not an ELF cubin".into()));
    }
    match missing {
        Some(k) => Err(CudaError::Compile(format!(
            "kernel '{k}' missing from the {}",
            form.ext()
        ))),
        None => Ok(()),
    }
}

/// [`compile`] through a cache directory (`None`: no cache). The key is the source and the
/// architecture; a hit needs no NVRTC at all. A cache that cannot be read or written is only a
/// slower start, never an error; an entry the driver refuses is dropped by the caller
/// ([`forget`]) and compiled afresh.
pub fn compile_cached(
    arch: (i32, i32),
    form: Form,
    cache: Option<&Path>,
) -> Result<Compiled, CudaError> {
    let t = std::time::Instant::now();
    let path = cache.map(|dir| cache_file(dir, arch, form));
    if let Some(p) = &path {
        if let Ok(image) = std::fs::read(p) {
            if check(form, &image).is_ok() {
                return Ok(Compiled {
                    form,
                    image,
                    cache_hit: true,
                    seconds: t.elapsed().as_secs_f64(),
                });
            }
        }
    }
    let image = compile(arch, form)?;
    if let Some(p) = &path {
        // Write then rename: a concurrent starter never reads half a file.
        let tmp = p.with_extension(format!("tmp{}", std::process::id()));
        if std::fs::create_dir_all(p.parent().unwrap_or(Path::new("."))).is_ok()
            && std::fs::write(&tmp, &image).is_ok()
        {
            let _ = std::fs::rename(&tmp, p);
        }
    }
    Ok(Compiled {
        form,
        image,
        cache_hit: false,
        seconds: t.elapsed().as_secs_f64(),
    })
}

/// The module for `arch`: the cached or freshly compiled cubin, else (no NVRTC here, and no
/// cubin cached for this GPU) a cached PTX for the driver to compile.
pub fn module_image(arch: (i32, i32), cache: Option<&Path>) -> Result<Compiled, CudaError> {
    compile_cached(arch, Form::Cubin, cache)
        .or_else(|cubin_err| compile_cached(arch, Form::Ptx, cache).map_err(|_| cubin_err))
}

/// Removes the cache entry for `arch` and `form` (after the driver refused it).
pub fn forget(arch: (i32, i32), form: Form, cache: &Path) {
    let _ = std::fs::remove_file(cache_file(cache, arch, form));
}

fn cache_file(dir: &Path, arch: (i32, i32), form: Form) -> PathBuf {
    let key = fnv1a(&[SOURCE.as_bytes()]);
    dir.join(format!(
        "thaw-kernels-sm{}{}-{key:016x}.{}",
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
            let ptx = super::compile(arch, super::Form::Ptx)
                .unwrap_or_else(|e| panic!("sm_{arch:?}: {e}"));
            let ptx = String::from_utf8(ptx).unwrap();
            assert!(ptx.contains(&format!(".target sm_{}{}", arch.0, arch.1)));
            let cubin = super::compile(arch, super::Form::Cubin)
                .unwrap_or_else(|e| panic!("sm_{arch:?} cubin: {e}"));
            assert!(cubin.starts_with(b"\x7fELF"), "a cubin is an ELF file");
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
            assert_eq!(a.image, b.image);
            // A damaged cache file is recompiled, not trusted.
            for e in std::fs::read_dir(&dir).unwrap() {
                std::fs::write(e.unwrap().path(), "garbage").unwrap();
            }
            let c = super::compile_cached((9, 0), form, Some(&dir)).unwrap();
            assert!(!c.cache_hit && c.image == a.image, "{form:?}");
        }
        // Without a cubin for this GPU and without NVRTC, a cached PTX still serves; with NVRTC
        // the cubin comes first.
        let m = super::module_image((9, 0), Some(&dir)).unwrap();
        assert_eq!(m.form, super::Form::Cubin);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
