//! Run-time compilation of `kernels.cu` with NVRTC, for the device's own architecture, cached on
//! disk.
//!
//! NVRTC turns the source into PTX for `compute_XY` (the device's compute capability); the driver
//! finishes it for the exact GPU when the module loads. The PTX is cached under a key made of
//! the source, the architecture and the NVRTC version, so a cold start after the first pays only
//! the module load — and need not even open libnvrtc (~100 MB).

use std::path::{Path, PathBuf};

use super::CudaError;

/// The kernels' CUDA C source.
pub const SOURCE: &str = include_str!("kernels.cu");

/// Every kernel `SOURCE` defines (checked after each compile).
pub const KERNELS: &[&str] = &[
    "widen",
    "embed",
    "rmsnorm",
    "add_bias",
    "silu_mul",
    "rope_store",
    "attention",
    "attention_prefill",
    "argmax_rows",
    "read_probe",
];

/// The PTX for one architecture, and where it came from.
#[derive(Debug, Clone)]
pub struct CompiledPtx {
    pub ptx: String,
    /// Taken from the on-disk cache (no NVRTC call).
    pub cache_hit: bool,
    pub seconds: f64,
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

/// Compiles [`SOURCE`] for compute capability `arch` (e.g. `(9, 0)`), NVRTC only.
pub fn compile(arch: (i32, i32)) -> Result<String, CudaError> {
    if !nvrtc_present() {
        return Err(CudaError::Compile(
            "libnvrtc could not be loaded (install the CUDA runtime libraries or set LD_LIBRARY_PATH)"
                .into(),
        ));
    }
    let opts = cudarc::nvrtc::CompileOptions {
        options: vec![
            format!("--gpu-architecture=compute_{}{}", arch.0, arch.1),
            "--std=c++17".into(),
        ],
        name: Some("thaw_kernels.cu".into()),
        ..Default::default()
    };
    let ptx = cudarc::nvrtc::compile_ptx_with_opts(SOURCE, opts)
        .map_err(|e| CudaError::Compile(e.to_string()))?
        .to_src();
    for k in KERNELS {
        if !ptx.contains(&format!(".entry {k}(")) {
            return Err(CudaError::Compile(format!(
                "kernel '{k}' missing from the PTX"
            )));
        }
    }
    Ok(ptx)
}

/// [`compile`] through a cache directory (`None`: no cache). The key is the source and the
/// architecture; a hit needs no NVRTC at all. A cache that cannot be read or written is only a
/// slower start, never an error; an entry the driver refuses is dropped by the caller
/// ([`forget`]) and compiled afresh.
pub fn compile_cached(arch: (i32, i32), cache: Option<&Path>) -> Result<CompiledPtx, CudaError> {
    let t = std::time::Instant::now();
    let path = cache.map(|dir| cache_file(dir, arch));
    if let Some(p) = &path {
        if let Ok(ptx) = std::fs::read_to_string(p) {
            if KERNELS
                .iter()
                .all(|k| ptx.contains(&format!(".entry {k}(")))
            {
                return Ok(CompiledPtx {
                    ptx,
                    cache_hit: true,
                    seconds: t.elapsed().as_secs_f64(),
                });
            }
        }
    }
    let ptx = compile(arch)?;
    if let Some(p) = &path {
        // Write then rename: a concurrent starter never reads half a file.
        let tmp = p.with_extension(format!("tmp{}", std::process::id()));
        if std::fs::create_dir_all(p.parent().unwrap_or(Path::new("."))).is_ok()
            && std::fs::write(&tmp, &ptx).is_ok()
        {
            let _ = std::fs::rename(&tmp, p);
        }
    }
    Ok(CompiledPtx {
        ptx,
        cache_hit: false,
        seconds: t.elapsed().as_secs_f64(),
    })
}

/// Removes the cache entry for `arch` (after the driver refused it).
pub fn forget(arch: (i32, i32), cache: &Path) {
    let _ = std::fs::remove_file(cache_file(cache, arch));
}

fn cache_file(dir: &Path, arch: (i32, i32)) -> PathBuf {
    let key = fnv1a(&[SOURCE.as_bytes()]);
    dir.join(format!(
        "thaw-kernels-sm{}{}-{key:016x}.ptx",
        arch.0, arch.1
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
            let ptx = super::compile(arch).unwrap_or_else(|e| panic!("sm_{arch:?}: {e}"));
            assert!(ptx.contains(&format!(".target sm_{}{}", arch.0, arch.1)));
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
        let a = super::compile_cached((9, 0), Some(&dir)).unwrap();
        let b = super::compile_cached((9, 0), Some(&dir)).unwrap();
        assert!(!a.cache_hit && b.cache_hit);
        assert_eq!(a.ptx, b.ptx);
        // A damaged cache file is recompiled, not trusted.
        for e in std::fs::read_dir(&dir).unwrap() {
            std::fs::write(e.unwrap().path(), "garbage").unwrap();
        }
        let c = super::compile_cached((9, 0), Some(&dir)).unwrap();
        assert!(!c.cache_hit && c.ptx == a.ptx);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
