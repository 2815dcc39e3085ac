//! The device interface a model drives: memory addressed by `u64`, the kernels of
//! `cuda/*.cu`, and GEMM. Implemented by the CUDA `cuda::Gpu` (feature `cuda`)
//! and by the CPU emulator of those kernels (`thaw-cuda-emu`, tests), so the model code above it
//! — the sequence of launches, buffer sizes, GEMM shapes — runs and is checked without a GPU.
//!
//! All work is queued in order on one stream; [`DeviceOps::download`] waits for everything
//! queued before it.

/// How elements are stored in device memory (the kernels' `kind` codes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Elem {
    F32 = 0,
    Bf16 = 1,
    F16 = 2,
}

impl Elem {
    pub fn bytes(self) -> usize {
        match self {
            Elem::F32 => 4,
            _ => 2,
        }
    }
    pub fn code(self) -> i32 {
        self as i32
    }
}

/// Query heads per KV head and head dimension the attention kernel holds in registers.
pub const MAX_GROUP: usize = 8;
pub const MAX_HEAD_DIM: usize = 128;

/// Attention shape.
#[derive(Debug, Clone, Copy)]
pub struct AttnDims {
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
}

impl AttnDims {
    /// Whether the attention kernel takes this shape (it keeps a query group in registers).
    pub fn check(&self) -> Result<(), String> {
        let ok = self.n_kv_heads > 0
            && self.n_heads.is_multiple_of(self.n_kv_heads)
            && self.n_heads / self.n_kv_heads <= MAX_GROUP
            && self.head_dim <= MAX_HEAD_DIM
            && self.head_dim.is_multiple_of(2);
        if ok {
            Ok(())
        } else {
            Err(format!(
                "{} query heads over {} KV heads of dimension {}: the CUDA attention kernel takes \
                 up to {MAX_GROUP} query heads per KV head and head_dim up to {MAX_HEAD_DIM}",
                self.n_heads, self.n_kv_heads, self.head_dim
            ))
        }
    }
}

/// Where attention finds each row's keys and values: device addresses of the per-row position,
/// per-row offset into the flattened block tables, the tables; and the store's layout.
#[derive(Debug, Clone, Copy)]
pub struct Paging {
    /// Rows the per-row kernel serves, as indices (0: every row, in order).
    pub rows: u64,
    pub pos: u64,
    pub table_off: u64,
    pub tables: u64,
    pub block_size: usize,
    pub block_stride: usize,
    pub layer_off: usize,
}

/// Flash-decoding for [`DeviceOps::attention`]: each row's positions in splits of `chunk`
/// (at most `n` splits), each split a block of its own, combined by a second kernel through
/// `partials` ([`Split::partial_floats`] f32). A decode row is otherwise one block per KV head
/// — 8 blocks for a Llama-3-8B row on a GPU of 132 multiprocessors, each walking the whole
/// context.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Split {
    pub chunk: usize,
    pub n: usize,
    pub partials: u64,
}

impl Split {
    /// No split: one block per row and KV head.
    pub const NONE: Split = Split {
        chunk: 0,
        n: 1,
        partials: 0,
    };

    /// `(chunk, n)` for `rows` rows over `kv_heads` KV heads whose longest row has
    /// `max_pos + 1` positions: as many splits as bring the grid to about `target_blocks`, none
    /// of fewer than `min_chunk` positions, the chunk rounded up to a multiple of `quantum`
    /// (1: even splits; `min_chunk`: a plan that changes only every `min_chunk` positions or
    /// more, as recorded decode steps want — their recordings are keyed on it); `(0, 1)` where
    /// one split per row is all that fits.
    pub fn plan(
        rows: usize,
        kv_heads: usize,
        max_pos: usize,
        target_blocks: usize,
        min_chunk: usize,
        quantum: usize,
    ) -> (usize, usize) {
        let len = max_pos + 1;
        if min_chunk == 0 {
            return (0, 1);
        }
        let n = (target_blocks / (rows * kv_heads).max(1)).min(len / min_chunk);
        if n <= 1 {
            return (0, 1);
        }
        // (Rounded up to at most `min_chunk`'s multiple, the chunk stays below `len`: n ≥ 2
        // splits need len ≥ 2·min_chunk.)
        let chunk = len
            .div_ceil(n)
            .next_multiple_of(quantum.clamp(1, min_chunk));
        (chunk, len.div_ceil(chunk))
    }

    /// The kernels' `(chunk, nsplit)` arguments: `(0, 1)` for no split.
    pub fn kernel_args(&self) -> (i32, i32) {
        if self.chunk > 0 && self.n > 1 {
            (self.chunk as i32, self.n as i32)
        } else {
            (0, 1)
        }
    }

    /// f32 elements of the partials buffer for `rows` rows of `n_heads` heads in `n` splits.
    pub fn partial_floats(rows: usize, n_heads: usize, n: usize, head_dim: usize) -> usize {
        rows * n_heads * n * (head_dim + 2)
    }
}

/// Query tiles for [`DeviceOps::attention_prefill`]: tile `t` is `count[t]` (at most
/// [`PREFILL_TILE`]) consecutive rows of one sequence starting at row `row0[t]`.
#[derive(Debug, Clone, Copy)]
pub struct Tiles {
    pub row0: u64,
    pub count: u64,
    pub n: usize,
}

/// Query rows per prefill tile (one warp each).
pub const PREFILL_TILE: usize = 4;

/// Most rows the matrix-vector kernel (`gemv` in gemv.cu) takes in one launch.
pub const GEMV_MAX_ROWS: usize = 8;

/// Most matrices one [`DeviceOps::gemv`] launch multiplies by the same activations.
pub const GEMV_MAX_OUTS: usize = 3;

/// Shared memory for the activations of the warp-per-rows kernel `gemv1r` (gemv.cu's
/// GEMV_XS_BYTES): 20480 bf16 or 10240 f32 elements — an 8B Llama's widest input (the down
/// product's 14336) and Qwen2-7B's (18944) fit.
pub const GEMV_XS_BYTES: usize = 40960;

/// Outputs per block of `gemv1r` with 8 warps (GEMV_WR = 2 rows a warp).
pub const GEMV_WARP_ROWS_PER_BLOCK: usize = 16;

/// The activations of a [`DeviceOps::gemv`] launch: `rows` rows of `in_dim` elements of `kind`
/// at `x` (W's kind, or f32 with `norm`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GemvIn {
    pub x: u64,
    pub kind: Elem,
    pub rows: usize,
    pub in_dim: usize,
    /// The product is of x's RMSNorm, folded into the kernel: x is the f32 residual and no
    /// normalized copy is written (decode's attention and MLP norms).
    pub norm: Option<GemvNorm>,
}

/// An RMSNorm folded into a [`DeviceOps::gemv`]: `w` its f32 weights (`in_dim` of them).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GemvNorm {
    pub w: u64,
    pub eps: f32,
}

impl GemvIn {
    /// Whether the matrix-vector kernel takes these activations times `outs` (of `w_kind`):
    /// f32 or bf16 weights, 1 to [`GEMV_MAX_OUTS`] matrices, each fitting [`gemv_fits`] for at
    /// most `max_rows` rows, x in W's kind (or f32 under a norm, whose weights are 8-byte aligned).
    pub fn fits(&self, w_kind: Elem, outs: &[GemvOut], max_rows: usize) -> bool {
        // f32 or bf16 weights (f16 products go to cuBLAS: one kind fewer for NVRTC to compile).
        let kind_ok = w_kind != Elem::F16
            && match self.norm {
                None => self.kind == w_kind,
                Some(n) => self.kind == Elem::F32 && n.w.is_multiple_of(8),
            };
        kind_ok
            && !outs.is_empty()
            && outs.len() <= GEMV_MAX_OUTS
            && outs
                .iter()
                .all(|o| gemv_fits(o.w, self.x, self.in_dim, self.rows, max_rows))
    }

    /// Whether the one-row kernel that stages x in shared memory (`gemv1r`) can hold this x:
    /// `in_dim` elements of W's kind within [`GEMV_XS_BYTES`] (it also needs [`GemvIn::vec16`]).
    pub fn stages(&self, w_kind: Elem) -> bool {
        self.in_dim * w_kind.bytes() <= GEMV_XS_BYTES
    }

    /// Whether the product can also take 16-byte loads (the one-row kernels `gemv1v`,
    /// `gemv1r`): rows of a multiple of 8 elements, every W, x and the norm's weights 16-byte
    /// aligned.
    pub fn vec16(&self, outs: &[GemvOut]) -> bool {
        self.in_dim.is_multiple_of(8)
            && self.x.is_multiple_of(16)
            && self.norm.is_none_or(|n| n.w.is_multiple_of(16))
            && outs.iter().all(|o| o.w.is_multiple_of(16))
    }
}

/// One matrix of a [`DeviceOps::gemv`] launch: `W [out_dim, in_dim]` at `w`, `y [n, out_dim]`
/// (f32) at `y`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GemvOut {
    pub w: u64,
    pub out_dim: usize,
    pub y: u64,
}

/// Whether [`DeviceOps::gemv`] takes this product: 1..=`max_rows` rows (at most
/// [`GEMV_MAX_ROWS`]), rows of a multiple of 4 elements, W and x 8-byte aligned (its loads are 4
/// elements of 16 bits, or two pairs of f32). Others go to [`DeviceOps::gemm`].
pub fn gemv_fits(w: u64, x: u64, in_dim: usize, n: usize, max_rows: usize) -> bool {
    n >= 1
        && n <= max_rows.min(GEMV_MAX_ROWS)
        && in_dim.is_multiple_of(4)
        && w.is_multiple_of(8)
        && x.is_multiple_of(8)
}

/// A column-major GEMM call (cuBLAS's convention): `C[m×n] = op(A)·op(B) + beta·C` with
/// `op(A)[i][l] = A[l + i·lda]` when `transa` (else `A[i + l·lda]`), likewise for B, and
/// `C[i][j]` at `i + j·ldc`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GemmCall {
    pub transa: bool,
    pub transb: bool,
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub lda: usize,
    pub ldb: usize,
    pub ldc: usize,
}

impl GemmCall {
    /// The call computing row-major `Y[rows, out] = X[rows, in] · Wᵀ` for row-major
    /// `W[out, in]`: seen column-major, Yᵀ[out, rows] = (W as [in, out])ᵀ · (X as [in, rows]).
    /// The CUDA backend hands exactly this to cuBLAS; the emulator executes it.
    pub fn linear(out_dim: usize, in_dim: usize, rows: usize) -> GemmCall {
        GemmCall {
            transa: true,
            transb: false,
            m: out_dim,
            n: rows,
            k: in_dim,
            lda: in_dim,
            ldb: in_dim,
            ldc: out_dim,
        }
    }
}

/// A device allocation.
pub trait DeviceBuf: Send + Sync {
    /// Its device address.
    fn ptr(&self) -> u64;
    fn len(&self) -> usize;
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// One device with one in-order stream. Kernel arguments are device addresses; callers keep
/// buffers alive until a download has waited for the work that uses them.
pub trait DeviceOps: Send + Sync + 'static {
    type Buf: DeviceBuf + 'static;
    type Error: std::error::Error + Send + Sync + 'static;

    /// `bytes` of zeroed device memory.
    fn alloc(&self, bytes: usize) -> Result<Self::Buf, Self::Error>;
    /// Copies `src` into `dst` at byte offset `at`.
    fn upload(&self, dst: &mut Self::Buf, at: usize, src: &[u8]) -> Result<(), Self::Error>;
    /// Copies bytes out of `src` at byte offset `at`, after all queued work.
    fn download(&self, src: &Self::Buf, at: usize, dst: &mut [u8]) -> Result<(), Self::Error>;
    /// Makes the device usable from the calling thread.
    fn bind(&self) -> Result<(), Self::Error>;
    /// Waits for all queued work.
    fn sync(&self) -> Result<(), Self::Error>;

    /// Recorded device work (a CUDA graph), queued again by [`DeviceOps::replay`].
    type Graph: Send + 'static;
    /// Until [`DeviceOps::end_capture`], the work this thread queues is recorded instead of run,
    /// with the arguments it is given — pointers, sizes, scalars all fixed in the recording.
    /// Allocations, uploads and downloads are refused meanwhile (they stay outside: a step
    /// uploads its plan, replays, then downloads).
    fn begin_capture(&self) -> Result<(), Self::Error>;
    /// Ends the capture begun last (call it also when queueing failed midway) and returns
    /// what it recorded.
    fn end_capture(&self) -> Result<Self::Graph, Self::Error>;
    /// Queues a recording's work again, in order, after the work already queued.
    fn replay(&self, g: &Self::Graph) -> Result<(), Self::Error>;

    /// `dst[i] = src[i]` widened to f32, `n` elements.
    fn widen(&self, src: u64, kind: Elem, dst: u64, n: usize) -> Result<(), Self::Error>;
    /// `out[r] = table[ids[r]]` widened to f32, rows of `d`.
    fn embed(
        &self,
        table: u64,
        kind: Elem,
        ids: u64,
        n: usize,
        d: usize,
        out: u64,
    ) -> Result<(), Self::Error>;
    /// RMSNorm of `n` rows of `d` (row `rows_map[r]` of `x` when `rows_map` is nonzero),
    /// stored as `out_kind`.
    #[allow(clippy::too_many_arguments)]
    fn rmsnorm(
        &self,
        x: u64,
        rows_map: u64,
        w: u64,
        n: usize,
        d: usize,
        eps: f32,
        out: u64,
        out_kind: Elem,
    ) -> Result<(), Self::Error>;
    /// `x[i] += bias[i % d]` for `n` elements.
    fn add_bias(&self, x: u64, bias: u64, d: usize, n: usize) -> Result<(), Self::Error>;
    /// `out = silu(g) · u` over `n` elements, stored as `out_kind`.
    fn silu_mul(
        &self,
        g: u64,
        u: u64,
        out: u64,
        out_kind: Elem,
        n: usize,
    ) -> Result<(), Self::Error>;
    /// RoPE on `n` rows of queries (in place) and keys, then keys and values into the cache at
    /// `slots[r] + layer_off`.
    #[allow(clippy::too_many_arguments)]
    fn rope_store(
        &self,
        q: u64,
        k: u64,
        v: u64,
        cos: u64,
        sin: u64,
        n: usize,
        shape: AttnDims,
        kc: u64,
        vc: u64,
        kv_kind: Elem,
        slots: u64,
        layer_off: usize,
    ) -> Result<(), Self::Error>;
    /// Causal paged GQA attention for `n` query rows, each row's positions cut into `split`
    /// (flash-decoding; [`Split::NONE`]: one block per row and KV head).
    #[allow(clippy::too_many_arguments)]
    fn attention(
        &self,
        q: u64,
        kc: u64,
        vc: u64,
        kv_kind: Elem,
        paging: Paging,
        n: usize,
        shape: AttnDims,
        out: u64,
        out_kind: Elem,
        split: Split,
    ) -> Result<(), Self::Error>;
    /// How [`DeviceOps::attention`] should split long rows here: (blocks that keep the device
    /// busy, fewest positions worth a split of their own). `(0, 0)`: never.
    fn attention_split_target(&self) -> (usize, usize) {
        (0, 0)
    }
    /// Causal attention for tiles of consecutive prefill rows, keys and values staged on chip
    /// and shared by a tile's rows (flash-style).
    #[allow(clippy::too_many_arguments)]
    fn attention_prefill(
        &self,
        q: u64,
        kc: u64,
        vc: u64,
        kv_kind: Elem,
        tiles: Tiles,
        paging: Paging,
        shape: AttnDims,
        out: u64,
        out_kind: Elem,
    ) -> Result<(), Self::Error>;
    /// `ids[r]` = the first index of the maximum of row `r` of `x` (`rows` rows of `n` f32).
    fn argmax_rows(&self, x: u64, rows: usize, n: usize, ids: u64) -> Result<(), Self::Error>;
    /// `y[n, out] = x[n, in] · Wᵀ + beta · y`: W `[out, in]` row-major in `w_kind`, x in the same
    /// kind, y f32, f32 accumulation.
    #[allow(clippy::too_many_arguments)]
    fn gemm(
        &self,
        w: u64,
        w_kind: Elem,
        out_dim: usize,
        in_dim: usize,
        x: u64,
        n: usize,
        y: u64,
        beta: f32,
    ) -> Result<(), Self::Error>;
    /// The same product for decode-sized `n` by the matrix-vector kernel, which reads W once at
    /// memory speed whatever `n` is — for up to [`GEMV_MAX_OUTS`] matrices of the same kind and
    /// `in_dim` that multiply the same activations (q, k, v; gate, up), in one launch,
    /// optionally of their RMSNorm ([`GemvIn::norm`]). Only where [`GemvIn::fits`] says so.
    fn gemv(
        &self,
        w_kind: Elem,
        outs: &[GemvOut],
        x: &GemvIn,
        beta: f32,
    ) -> Result<(), Self::Error>;
}

#[cfg(test)]
mod tests {
    use super::Split;

    /// Splits cover each row's positions in at most `n` pieces of `chunk`, keep the grid near
    /// the target, are never shorter than the minimum, and vanish where one block per row and
    /// KV head already fills the device or the context is short.
    #[test]
    fn split_plans_cover_long_rows_and_stay_off_short_ones() {
        // An 8B decode row (8 KV heads) on 132 multiprocessors, target 528 blocks.
        assert_eq!(Split::plan(1, 8, 99, 528, 128, 1), (0, 1));
        assert_eq!(Split::plan(1, 8, 4095, 528, 128, 1), (128, 32));
        assert_eq!(Split::plan(32, 8, 4095, 528, 128, 1), (2048, 2));
        assert_eq!(Split::plan(64, 8, 4095, 528, 128, 1), (0, 1));
        assert_eq!(Split::plan(1, 8, 4095, 528, 0, 1), (0, 1));
        // 300 positions in two: even (150 each), or in 128s (256 + 44) for a stable plan.
        assert_eq!(Split::plan(1, 8, 299, 528, 128, 1), (150, 2));
        assert_eq!(Split::plan(1, 8, 299, 528, 128, 128), (256, 2));
        for (rows, quantum) in [1usize, 2, 3, 7, 16]
            .into_iter()
            .flat_map(|r| [(r, 1), (r, 16)])
        {
            for max_pos in [0usize, 15, 16, 31, 127, 128, 1000, 5000] {
                let (chunk, n) = Split::plan(rows, 2, max_pos, 64, 16, quantum);
                let len = max_pos + 1;
                if chunk == 0 {
                    assert_eq!(n, 1);
                    continue;
                }
                assert!(
                    n >= 2 && n * rows * 2 <= 64,
                    "{rows} rows, {len}: {n} splits"
                );
                assert!(
                    chunk >= 16
                        && chunk % quantum == 0
                        && chunk * n >= len
                        && chunk * (n - 1) < len,
                    "{chunk}×{n} for {len}"
                );
            }
        }
        assert_eq!(Split::partial_floats(2, 4, 3, 8), 2 * 4 * 3 * 10);
    }
}
