//! The Llama-family model on a device ([`DeviceOps`]: the CUDA GPU with feature `cuda`, or the
//! CPU emulator of the same kernels in tests), behind the same [`StepModel`] interface as the
//! CPU model — the engine, scheduler, block manager and prefix cache are the same code whichever
//! backend computes. Because the device is a trait, this module's step (launch order, buffer
//! sizes, GEMM shapes) runs in CI against the emulator and is compared with the CPU model.
//!
//! * **Weights** go from disk straight to device memory through the loader's pinned staging ring
//!   (`thaw_loader::cuda::load_to_device`: reads overlap host → device copies, same plan and
//!   integrity check as the CPU load). Tensors are addresses inside the per-shard allocations,
//!   in their checkpoint dtype; only norm weights and biases are widened to f32 (on the device).
//! * **A step** is the CPU pass's structure with device kernels: the host builds the
//!   [`StepPlan`] (positions, cache slots, block tables, RoPE angles — tested against the CPU
//!   store), uploads it in one copy, and queues embedding → per layer (RMSNorm, Q/K/V GEMMs,
//!   RoPE + cache store, paged attention (per-row kernel for decodes, flash-style tiles for
//!   prefill chunks), O GEMM accumulated into the residual, RMSNorm,
//!   gate/up GEMMs, SiLU·mul, down GEMM accumulated into the residual) → final norm of the
//!   picked rows → LM head (→ argmax on the device for all-greedy steps). One synchronization
//!   per step: the download of the logits, or of one id per sequence.
//! * **Decode products** can go to matrix-vector kernels instead of cuBLAS (opt-in,
//!   `THAW_CUDA_GEMV_ROWS`): products sharing their input (q/k/v, gate/up) in one launch, the
//!   RMSNorm before them folded in, one-row products with 16-byte loads (the loader puts every
//!   tensor of a checkpoint on 16-byte device boundaries). The first such kernel lost to cuBLAS
//!   on an H200; this one (rewritten, see gemv.cu) is not measured on a GPU yet, so cuBLAS stays
//!   the default until a run shows it winning (docs/PERFORMANCE.md).
//! * **Long rows' decode attention** is split over blocks (flash-decoding, [`Split`]) where one
//!   block per row and KV head would leave the device mostly idle.
//! * **Decode steps can be replayed as CUDA graphs** (opt-in, `THAW_CUDA_GRAPHS`; `graphs.rs`):
//!   the step's launches recorded once per shape, then one launch per step.
//! * **Precision** follows the weights: bf16/f16 weights take bf16/f16 activations into cuBLAS
//!   (f32 accumulation, tensor cores) and a bf16 KV cache, like the CPU's AVX512-BF16 path;
//!   f32 weights stay f32 end to end (no TF32), for a tight comparison with the CPU.

mod forward;
mod graphs;
mod load;
pub use load::{env_switch, OVERLAP_INIT};

use forward::Step;
pub use graphs::GraphStats;
use graphs::Graphs;

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use thaw_kernels::device::{AttnDims, DeviceBuf, DeviceOps, Elem, Split};
use thaw_loader::{Dtype, LoadStats};

use crate::model::SeqChunk;
use crate::step::{KvLayout, StepModel};
use crate::{ModelConfig, RuntimeError};

fn dev_err(e: impl std::fmt::Display) -> RuntimeError {
    RuntimeError::Config(format!("device: {e}"))
}

fn elem(d: Dtype) -> Elem {
    match d {
        Dtype::F32 => Elem::F32,
        Dtype::BF16 => Elem::Bf16,
        _ => Elem::F16,
    }
}

/// A weight matrix `[rows, cols]` in device memory.
#[derive(Clone, Copy)]
struct Mat {
    ptr: u64,
    rows: usize,
    cols: usize,
    kind: Elem,
}

struct DevLayer<B> {
    attn_norm: B,
    mlp_norm: B,
    q: Mat,
    k: Mat,
    v: Mat,
    o: Mat,
    gate: Mat,
    up: Mat,
    down: Mat,
    q_bias: Option<B>,
    k_bias: Option<B>,
    v_bias: Option<B>,
}

/// Keys and values in device memory, in the CPU store's layout (`[block][layer][slot][kv_dim]`).
pub struct DeviceKv<B> {
    k: B,
    v: B,
    layout: KvLayout,
    kind: Elem,
}

impl<B> DeviceKv<B> {
    pub fn layout(&self) -> KvLayout {
        self.layout
    }
}

/// Activation buffers for up to `rows` rows and `picked` logit rows, grown on demand.
struct Scratch<B> {
    rows: usize,
    picked: usize,
    meta: B,
    x: B,
    xn: B,
    q: B,
    k: B,
    v: B,
    att: B,
    g: B,
    u: B,
    hid: B,
    logits: B,
    ids: B,
    /// Flash-decoding's partial results (sized for the device's split target).
    partials: B,
}

/// How a device model came up: the device-specific cold-start phases, in seconds.
#[derive(Debug, Clone, Default)]
pub struct DeviceLoadPhases {
    pub context_s: f64,
    pub compile_s: f64,
    pub compile_cache_hit: bool,
    pub module_s: f64,
    pub alloc_s: f64,
    pub copy_s: f64,
    pub widen_s: f64,
}

pub struct DeviceLlama<D: DeviceOps> {
    pub cfg: ModelConfig,
    dev: Arc<D>,
    _shards: Vec<D::Buf>,
    embed: Mat,
    lm_head: Mat,
    norm: D::Buf,
    layers: Vec<DevLayer<D::Buf>>,
    act: Elem,
    kv_kind: Elem,
    inv_freq: Vec<f64>,
    scratch: Mutex<Option<Scratch<D::Buf>>>,
    stats: LoadStats,
    pub phases: DeviceLoadPhases,
    /// Prefill chunks through the flash-style tiled kernel (default; `THAW_CUDA_PREFILL=paged`
    /// or [`DeviceLlama::set_tiled_prefill`] sends every row through the per-row kernel, for
    /// A/B measurements).
    tiled_prefill: AtomicBool,
    /// Products of up to this many rows (decode steps) go to the matrix-vector kernel instead of
    /// cuBLAS (default 0, cuBLAS only: measured faster; `THAW_CUDA_GEMV_ROWS` or
    /// [`DeviceLlama::set_gemv_max_rows`] for A/B measurements).
    gemv_max_rows: AtomicUsize,
    /// Decode products by the matrix-vector kernel take their RMSNorm folded in (default; off
    /// only for A/B measurements).
    fused_norm: AtomicBool,
    /// Flash-decoding for long rows (default; off only for A/B measurements).
    split_attention: AtomicBool,
    /// Matrix-vector kernel launches so far (A/B runs check which path the products took).
    gemv_launches: AtomicU64,
    /// Decode steps replay recordings of their batch shape (CUDA graphs; `THAW_CUDA_GRAPHS`
    /// or [`DeviceLlama::set_graphs`]).
    use_graphs: AtomicBool,
    graphs: Mutex<Graphs<D::Graph>>,
}

/// The model on a CUDA GPU.
#[cfg(feature = "cuda")]
pub type CudaLlama = DeviceLlama<thaw_kernels::cuda::Gpu>;

/// Where PTX is cached between cold starts: `$THAW_HOME/ptx` (default `~/.cache/thaw/ptx`).
pub fn ptx_cache_dir() -> Option<std::path::PathBuf> {
    Some(crate::fetch::thaw_home().join("ptx"))
}

impl<D: DeviceOps> DeviceLlama<D> {
    /// Whether prefill chunks use the flash-style tiled attention kernel.
    pub fn set_tiled_prefill(&self, on: bool) {
        self.tiled_prefill.store(on, Ordering::Relaxed);
        self.clear_graphs();
    }

    /// Whether decode steps replay recordings of their batch shape (CUDA graphs).
    pub fn set_graphs(&self, on: bool) {
        self.use_graphs.store(on, Ordering::Relaxed);
        self.clear_graphs();
    }

    /// Drops the recorded decode steps: a setting that changes what a step launches (here, or
    /// a device's own, such as `Gpu::gemv_vec16`) must not meet a recording made before it.
    pub fn clear_graphs(&self) {
        self.graphs
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clear();
    }

    /// Whether decode steps replay recordings (on where asked for, until a device refuses).
    pub fn graphs_on(&self) -> bool {
        self.use_graphs.load(Ordering::Relaxed)
    }

    /// How often decode steps were recorded and replayed.
    pub fn graph_stats(&self) -> GraphStats {
        self.graphs
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .stats()
    }

    /// The device it runs on.
    pub fn device(&self) -> &Arc<D> {
        &self.dev
    }

    /// Products of at most `rows` rows use the matrix-vector kernel (0: cuBLAS for all).
    pub fn set_gemv_max_rows(&self, rows: usize) {
        self.gemv_max_rows.store(rows, Ordering::Relaxed);
        self.clear_graphs();
    }

    /// Matrix-vector kernel launches since the model was made.
    pub fn gemv_launches(&self) -> u64 {
        self.gemv_launches.load(Ordering::Relaxed)
    }

    /// Products of up to this many rows go to the matrix-vector kernel.
    pub fn gemv_max_rows(&self) -> usize {
        self.gemv_max_rows.load(Ordering::Relaxed)
    }

    /// Whether long rows' decode attention is split over blocks (flash-decoding).
    pub fn set_split_attention(&self, on: bool) {
        self.split_attention.store(on, Ordering::Relaxed);
        self.clear_graphs();
    }

    /// Whether decode products by the matrix-vector kernel fold in their RMSNorm.
    pub fn set_fused_norm(&self, on: bool) {
        self.fused_norm.store(on, Ordering::Relaxed);
        self.clear_graphs();
    }

    pub fn load_stats(&self) -> &LoadStats {
        &self.stats
    }

    /// Bytes of weights read per decoded token (as [`crate::Llama::weight_bytes`]).
    pub fn weight_bytes(&self) -> u64 {
        let m = |m: &Mat| (m.rows * m.cols * m.kind.bytes()) as u64;
        let mut b: u64 = self
            .layers
            .iter()
            .map(|l| {
                [l.q, l.k, l.v, l.o, l.gate, l.up, l.down]
                    .iter()
                    .map(m)
                    .sum::<u64>()
            })
            .sum();
        b += m(&self.lm_head);
        b
    }

    fn dims(&self) -> AttnDims {
        AttnDims {
            n_heads: self.cfg.num_attention_heads,
            n_kv_heads: self.cfg.n_kv_heads(),
            head_dim: self.cfg.head_dim(),
        }
    }

    /// Partials for the most splits a step can plan: splits × rows ≤ target / KV heads.
    fn partial_floats(&self) -> usize {
        let (target, _) = self.dev.attention_split_target();
        let d = self.dims();
        Split::partial_floats(target / d.n_kv_heads.max(1), d.n_heads, 1, d.head_dim)
    }

    /// Flash-decoding for the per-row attention kernel over `rows` (row indices), positions
    /// `pos`: splits where the rows are too few blocks for the device.
    fn split(&self, rows: impl Iterator<Item = usize>, pos: &[u32], partials: u64) -> Split {
        if !self.split_attention.load(Ordering::Relaxed) {
            return Split::NONE;
        }
        let (target, min_chunk) = self.dev.attention_split_target();
        let (mut n, mut max_pos) = (0, 0);
        for r in rows {
            n += 1;
            max_pos = max_pos.max(pos[r] as usize);
        }
        // Recorded steps are keyed on the split: coarse chunks keep a recording valid for
        // `min_chunk` positions or more; queued steps split evenly.
        let quantum = if self.use_graphs.load(Ordering::Relaxed) {
            min_chunk
        } else {
            1
        };
        match Split::plan(
            n,
            self.dims().n_kv_heads,
            max_pos,
            target,
            min_chunk,
            quantum,
        ) {
            (0, _) => Split::NONE,
            (chunk, splits) => Split {
                chunk,
                n: splits,
                partials,
            },
        }
    }

    fn scratch<'a>(
        &self,
        slot: &'a mut Option<Scratch<D::Buf>>,
        rows: usize,
        picked: usize,
        meta_bytes: usize,
    ) -> Result<&'a mut Scratch<D::Buf>, RuntimeError> {
        let fits = slot
            .as_ref()
            .is_some_and(|s| s.rows >= rows && s.picked >= picked && s.meta.len() >= meta_bytes);
        if !fits {
            // Recordings hold the old buffers' addresses.
            self.clear_graphs();
            *slot = None; // free the old buffers before the larger ones are made
            let c = &self.cfg;
            let rows = rows.next_power_of_two().max(16);
            let picked = picked.next_power_of_two().max(16);
            let (h, ffn) = (c.hidden_size, c.intermediate_size);
            let a = |n: usize| self.dev.alloc(n * 4).map_err(dev_err);
            *slot = Some(Scratch {
                rows,
                picked,
                meta: a(meta_bytes.next_power_of_two().max(4096) / 4)?,
                x: a(rows * h)?,
                xn: a(rows.max(picked) * h)?,
                q: a(rows * c.q_dim())?,
                k: a(rows * c.kv_dim())?,
                v: a(rows * c.kv_dim())?,
                att: a(rows * c.q_dim())?,
                g: a(rows * ffn)?,
                u: a(rows * ffn)?,
                hid: a(rows * ffn)?,
                logits: a(picked * c.vocab_size)?,
                ids: a(picked)?,
                partials: a(self.partial_floats().max(1))?,
            });
        }
        Ok(slot.as_mut().expect("just made"))
    }
}

impl<D: DeviceOps> StepModel for DeviceLlama<D> {
    type Kv = DeviceKv<D::Buf>;
    fn config(&self) -> &ModelConfig {
        &self.cfg
    }
    fn kv_bytes_per_block(&self, block_size: usize) -> usize {
        2 * self.cfg.num_hidden_layers * block_size * self.cfg.kv_dim() * self.kv_kind.bytes()
    }
    fn new_kv(&self, block_size: usize, blocks: usize) -> Result<Self::Kv, RuntimeError> {
        let layout = KvLayout {
            block_size,
            layers: self.cfg.num_hidden_layers,
            kv_dim: self.cfg.kv_dim(),
            blocks,
        };
        let bytes = blocks * layout.block_stride() * self.kv_kind.bytes();
        let alloc = |what: &str| {
            self.dev.alloc(bytes).map_err(|e| {
                RuntimeError::Config(format!(
                    "device: allocating the KV cache's {what} ({} MB): {e}",
                    bytes >> 20
                ))
            })
        };
        Ok(DeviceKv {
            k: alloc("keys")?,
            v: alloc("values")?,
            layout,
            kind: self.kv_kind,
        })
    }
    fn forward_batch_rows(
        &self,
        seqs: &[SeqChunk<'_>],
        kv: &mut Self::Kv,
        all_rows: &[bool],
    ) -> Result<Vec<f32>, RuntimeError> {
        match self.run(seqs, kv, false, all_rows)? {
            Step::Logits(l) => Ok(l),
            Step::Ids(_) => Err(RuntimeError::Config("a logits step returned ids".into())),
        }
    }
    fn forward_batch_greedy(
        &self,
        seqs: &[SeqChunk<'_>],
        kv: &mut Self::Kv,
    ) -> Result<Vec<u32>, RuntimeError> {
        match self.run(seqs, kv, true, &[])? {
            Step::Ids(ids) => Ok(ids),
            Step::Logits(_) => Err(RuntimeError::Config("a greedy step returned logits".into())),
        }
    }
}
