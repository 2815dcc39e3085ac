//! Bringing a device model up: the CUDA load (pinned staging ring straight into device memory),
//! the simple whole-file load (the emulator's, and a reference), and assembling the tensor
//! addresses, widened norms and KV policy both share.

use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicUsize};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use thaw_kernels::device::{AttnDims, DeviceBuf, DeviceOps, Elem};
use thaw_loader::{Checkpoint, Dtype, LoadStats, TensorEntry};

#[cfg(feature = "cuda")]
use super::ptx_cache_dir;

/// Decode products through cuBLAS by default: on an H200 the first matrix-vector kernel
/// measured slower at every batch size, and its rewrite is not measured yet
/// (docs/PERFORMANCE.md), so it is opt-in (`THAW_CUDA_GEMV_ROWS`) until it beats cuBLAS.
const DEFAULT_GEMV_ROWS: usize = 0;
use super::{dev_err, elem, DevLayer, DeviceLlama, DeviceLoadPhases, Mat};
use crate::model::{inv_freq, Tensors};
use crate::{KvDtype, ModelConfig, RuntimeError};

#[cfg(feature = "cuda")]
impl DeviceLlama<thaw_kernels::cuda::Gpu> {
    /// Opens GPU `ordinal`, checks `dir`'s config and tensors, streams the weights to the device
    /// (a pinned staging ring where reads overlap host → device copies; or, opted in, a
    /// page-cache-resident checkpoint pinned in place and copied from there).
    pub fn load(
        dir: &Path,
        opts: &thaw_loader::LoadOptions,
        ordinal: usize,
    ) -> Result<Self, RuntimeError> {
        use thaw_kernels::cuda::{DevBuf, Gpu};
        use thaw_loader::cuda::Staging;
        let (cfg, ck, t) = open(dir)?;
        // THAW_CUDA_PIN_IN_PLACE=1|0 overrides the default (A/B runs).
        let def = Staging::default();
        let staging = Staging {
            pin_in_place: env_switch("THAW_CUDA_PIN_IN_PLACE", def.pin_in_place),
            ..def
        };
        let cache = ptx_cache_dir();
        let c = Gpu::open_context(ordinal).map_err(dev_err)?;
        let ctx = c.ctx.clone();
        let load = || {
            thaw_loader::cuda::load_to_device(&ck, opts, &ctx, staging).map_err(RuntimeError::from)
        };
        // THAW_CUDA_OVERLAP_INIT=1: the kernels (module load, or a cold cache's compile) and
        // cuBLAS come up on a thread of their own while the weights stream in — they need only
        // the context, as the load does. Opt-in until a GPU run's cold starts measure it
        // (`scripts/gpu-check.sh` runs both).
        let (gpu, loaded) = if env_switch(OVERLAP_INIT, false) {
            std::thread::scope(|s| {
                let kernels = s.spawn(|| Gpu::finish(c, cache.as_deref()));
                let loaded = load();
                let gpu = kernels.join().unwrap_or_else(|_| {
                    Err(thaw_kernels::cuda::CudaError::Driver(
                        "the kernel-loading thread panicked".into(),
                    ))
                });
                (gpu, loaded)
            })
        } else {
            let gpu = Gpu::finish(c, cache.as_deref()).map_err(dev_err)?;
            (Ok(gpu), load())
        };
        let gpu = Arc::new(gpu.map_err(dev_err)?);
        let loaded = loaded?;
        let offsets: Vec<u64> = (loaded.plan.shards.iter())
            .map(|s| s.device_data_offset())
            .collect();
        let shards: Vec<DevBuf> = loaded
            .shards
            .into_iter()
            .map(|m| DevBuf::new(m, &gpu.stream))
            .collect();
        let init = gpu.init.clone();
        let phases = DeviceLoadPhases {
            context_s: init.context_s,
            compile_s: init.compile_s,
            compile_cache_hit: init.compile_cache_hit,
            module_s: init.module_s,
            alloc_s: loaded.alloc_s,
            copy_s: loaded.copy_s,
            widen_s: 0.0,
        };
        Self::assemble(gpu, cfg, t, shards, &offsets, loaded.stats, phases)
    }

    pub fn gpu(&self) -> &thaw_kernels::cuda::Gpu {
        &self.dev
    }
}

/// The environment switch that brings the kernels and cuBLAS up beside the weight load.
pub const OVERLAP_INIT: &str = "THAW_CUDA_OVERLAP_INIT";

/// An on/off switch from the environment (A/B runs): unset, `default`; `0` or empty, off;
/// anything else, on.
pub fn env_switch(name: &str, default: bool) -> bool {
    std::env::var(name).map_or(default, |v| v != "0" && !v.is_empty())
}

/// Config, checkpoint and tensor map of `dir`, checked, plus the attention shape check.
fn open(dir: &Path) -> Result<(ModelConfig, Checkpoint, Tensors), RuntimeError> {
    let cfg = ModelConfig::load(dir)?;
    let ck = Checkpoint::open(dir)?;
    let t = Tensors::find(&cfg, &ck)?;
    if !t.scales.is_empty() {
        return Err(RuntimeError::Config(format!(
            "{}: Q8_0 (8-bit) weights run on the CPU backend only for now (--device cpu)",
            dir.display()
        )));
    }
    AttnDims {
        n_heads: cfg.num_attention_heads,
        n_kv_heads: cfg.n_kv_heads(),
        head_dim: cfg.head_dim(),
    }
    .check()
    .map_err(dev_err)?;
    Ok((cfg, ck, t))
}

impl<D: DeviceOps> DeviceLlama<D> {
    /// Loads `dir` onto `dev` the simple way: each shard file read whole, then uploaded (no
    /// pipelining — the emulator's loader, and a reference for the streaming one).
    pub fn load_simple(dev: Arc<D>, dir: &Path) -> Result<Self, RuntimeError> {
        let t0 = Instant::now();
        let (cfg, ck, t) = open(dir)?;
        let mut shards = Vec::with_capacity(ck.shards.len());
        let mut offsets = Vec::with_capacity(ck.shards.len());
        let mut bytes = 0u64;
        for sh in &ck.shards {
            let data = std::fs::read(&sh.path).map_err(|e| RuntimeError::io(&sh.path, e))?;
            if (data.len() as u64) < sh.data_start + sh.data_len {
                return Err(RuntimeError::Config(format!(
                    "{}: truncated ({} bytes, the header needs {})",
                    sh.path.display(),
                    data.len(),
                    sh.data_start + sh.data_len
                )));
            }
            // The data section alone, at the allocation's start: on the device's allocation
            // boundary, as the streaming load puts it (`ShardPlan::device_data_offset`).
            let section = &data[sh.data_start as usize..(sh.data_start + sh.data_len) as usize];
            let mut b = dev.alloc(section.len()).map_err(dev_err)?;
            dev.upload(&mut b, 0, section).map_err(dev_err)?;
            bytes += sh.data_len;
            shards.push(b);
            offsets.push(0);
        }
        let stats = LoadStats {
            strategy: "simple".into(),
            bytes,
            total_s: t0.elapsed().as_secs_f64(),
            ..LoadStats::default()
        };
        Self::assemble(
            dev,
            cfg,
            t,
            shards,
            &offsets,
            stats,
            DeviceLoadPhases::default(),
        )
    }

    /// Builds the model over shards already in device memory: shard `s`'s data section starts
    /// at byte `offsets[s]` of `shards[s]`.
    fn assemble(
        dev: Arc<D>,
        cfg: ModelConfig,
        t: Tensors,
        shards: Vec<D::Buf>,
        offsets: &[u64],
        stats: LoadStats,
        mut phases: DeviceLoadPhases,
    ) -> Result<Self, RuntimeError> {
        let addr = |e: &TensorEntry| -> Result<u64, RuntimeError> {
            let a = shards[e.shard].ptr() + offsets[e.shard] + e.info.begin;
            let align = if e.info.dtype == Dtype::F32 { 4 } else { 2 };
            if !a.is_multiple_of(align) {
                return Err(RuntimeError::Config(format!(
                    "tensor '{}' is not aligned to its {} element size",
                    e.info.name, e.info.dtype
                )));
            }
            Ok(a)
        };
        let mat = |e: &TensorEntry| -> Result<Mat, RuntimeError> {
            Ok(Mat {
                ptr: addr(e)?,
                rows: e.info.shape[0],
                cols: e.info.shape[1],
                kind: elem(e.info.dtype),
            })
        };
        let tw = Instant::now();
        let widen = |e: &TensorEntry| -> Result<D::Buf, RuntimeError> {
            let n = e.info.shape.iter().product::<usize>();
            let out = dev.alloc(n * 4).map_err(dev_err)?;
            dev.widen(addr(e)?, elem(e.info.dtype), out.ptr(), n)
                .map_err(dev_err)?;
            Ok(out)
        };
        let mut layers = Vec::with_capacity(t.layers.len());
        for l in &t.layers {
            layers.push(DevLayer {
                attn_norm: widen(&l.attn_norm)?,
                mlp_norm: widen(&l.mlp_norm)?,
                q: mat(&l.q)?,
                k: mat(&l.k)?,
                v: mat(&l.v)?,
                o: mat(&l.o)?,
                gate: mat(&l.gate)?,
                up: mat(&l.up)?,
                down: mat(&l.down)?,
                q_bias: l.q_bias.as_ref().map(widen).transpose()?,
                k_bias: l.k_bias.as_ref().map(widen).transpose()?,
                v_bias: l.v_bias.as_ref().map(widen).transpose()?,
            });
        }
        let norm = widen(&t.norm)?;
        dev.sync().map_err(dev_err)?;
        phases.widen_s = tw.elapsed().as_secs_f64();
        let embed = mat(&t.embed)?;
        let lm_head = mat(&t.lm_head)?;
        // The CPU's policy (bf16 KV with bf16 weights; THAW_KV_DTYPE overrides), one place.
        let kv_kind = match crate::model::kv_dtype_for(t.embed.info.dtype) {
            KvDtype::F32 => Elem::F32,
            KvDtype::Bf16 => Elem::Bf16,
        };
        Ok(DeviceLlama {
            inv_freq: inv_freq(&cfg),
            cfg,
            _shards: shards,
            act: embed.kind,
            embed,
            lm_head,
            norm,
            layers,
            kv_kind,
            scratch: Mutex::new(None),
            stats,
            phases,
            dev,
            tiled_prefill: AtomicBool::new(
                std::env::var("THAW_CUDA_PREFILL").as_deref() != Ok("paged"),
            ),
            gemv_max_rows: AtomicUsize::new(
                std::env::var("THAW_CUDA_GEMV_ROWS")
                    .ok()
                    .and_then(|v| v.parse().ok())
                    .unwrap_or(DEFAULT_GEMV_ROWS),
            ),
            fused_norm: AtomicBool::new(true),
            split_attention: AtomicBool::new(true),
            gemv_launches: Default::default(),
            // Off until a GPU run measures them against queued launches (docs/PERFORMANCE.md);
            // THAW_CUDA_GRAPHS=1 turns them on.
            use_graphs: AtomicBool::new(env_switch("THAW_CUDA_GRAPHS", false)),
            graphs: Default::default(),
        })
    }
}
