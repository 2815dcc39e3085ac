//! # thaw-cuda-emu: the CUDA kernels on the CPU, for tests
//!
//! `kernels/src/cuda/kernels.cu` compiled as C++ (see `cpp/shim.h`): each CUDA thread is an OS
//! thread, blocks run one after another, `__syncthreads` and warp shuffles are barriers. Slow,
//! but the same source the GPU runs — so the kernels' indexing, online softmax, warp merges and
//! 16-bit conversions are tested against the CPU backend on machines without a GPU
//! (`thaw-kernels/tests/cuda_emu.rs`). Device addresses are host pointers here.
//!
//! Every wrapper checks its slices' lengths against the launch before the call.

/// Element kinds, as the kernels' `kind` arguments.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    F32 = 0,
    Bf16 = 1,
    F16 = 2,
}

impl Kind {
    pub fn bytes(self) -> usize {
        if self == Kind::F32 {
            4
        } else {
            2
        }
    }
}

type I64 = i64;

extern "C" {
    fn thaw_emu_widen(grid: u32, block: u32, src: *const u8, kind: i32, dst: *mut f32, n: I64);
    fn thaw_emu_embed(
        rows: u32,
        block: u32,
        table: *const u8,
        kind: i32,
        ids: *const u32,
        d: i32,
        out: *mut f32,
    );
    fn thaw_emu_rmsnorm(
        rows: u32,
        block: u32,
        x: *const f32,
        map: *const u32,
        w: *const f32,
        d: i32,
        eps: f32,
        out: *mut u8,
        out_kind: i32,
    );
    fn thaw_emu_add_bias(grid: u32, block: u32, x: *mut f32, b: *const f32, d: i32, n: I64);
    fn thaw_emu_silu_mul(
        grid: u32,
        block: u32,
        g: *const f32,
        u: *const f32,
        out: *mut u8,
        out_kind: i32,
        n: I64,
    );
    fn thaw_emu_rope_store(
        rows: u32,
        block: u32,
        q: *mut f32,
        k: *const f32,
        v: *const f32,
        cos: *const f32,
        sin: *const f32,
        n_heads: i32,
        n_kv: i32,
        hd: i32,
        kc: *mut u8,
        vc: *mut u8,
        kv_kind: i32,
        slot: *const I64,
        layer_off: I64,
    );
    fn thaw_emu_argmax_rows(rows: u32, block: u32, x: *const f32, n: i32, ids: *mut u32);
    fn thaw_emu_attention(
        rows: u32,
        kv_heads: u32,
        q: *const f32,
        kc: *const u8,
        vc: *const u8,
        kv_kind: i32,
        pos: *const u32,
        table_off: *const u32,
        tables: *const u32,
        block_size: i32,
        block_stride: I64,
        layer_off: I64,
        n_heads: i32,
        n_kv: i32,
        hd: i32,
        scale: f32,
        out: *mut u8,
        out_kind: i32,
    );
}

/// Attention head layout.
#[derive(Debug, Clone, Copy)]
pub struct Heads {
    pub n_heads: usize,
    pub n_kv: usize,
    pub head_dim: usize,
}

pub fn widen(src: &[u8], kind: Kind, dst: &mut [f32]) {
    assert_eq!(src.len(), dst.len() * kind.bytes());
    // SAFETY: lengths checked; the kernel touches n elements of each.
    unsafe {
        thaw_emu_widen(
            2,
            64,
            src.as_ptr(),
            kind as i32,
            dst.as_mut_ptr(),
            dst.len() as I64,
        )
    }
}

pub fn embed(table: &[u8], kind: Kind, ids: &[u32], d: usize, out: &mut [f32]) {
    let rows = table.len() / kind.bytes() / d;
    assert!(ids.iter().all(|&i| (i as usize) < rows));
    assert_eq!(out.len(), ids.len() * d);
    // SAFETY: ids index rows of the table (checked); out holds ids.len() rows.
    unsafe {
        thaw_emu_embed(
            ids.len() as u32,
            64,
            table.as_ptr(),
            kind as i32,
            ids.as_ptr(),
            d as i32,
            out.as_mut_ptr(),
        )
    }
}

/// RMSNorm of rows `map` (or all rows) of `x`, stored as `kind` into `out`.
pub fn rmsnorm(
    x: &[f32],
    map: Option<&[u32]>,
    w: &[f32],
    eps: f32,
    out: &mut [u8],
    kind: Kind,
    block: u32,
) {
    let d = w.len();
    let rows = map.map_or(x.len() / d, |m| m.len());
    if let Some(m) = map {
        assert!(m.iter().all(|&r| (r as usize + 1) * d <= x.len()));
    }
    assert_eq!(out.len(), rows * d * kind.bytes());
    // SAFETY: bounds checked above.
    unsafe {
        thaw_emu_rmsnorm(
            rows as u32,
            block,
            x.as_ptr(),
            map.map_or(std::ptr::null(), |m| m.as_ptr()),
            w.as_ptr(),
            d as i32,
            eps,
            out.as_mut_ptr(),
            kind as i32,
        )
    }
}

pub fn add_bias(x: &mut [f32], b: &[f32]) {
    assert_eq!(x.len() % b.len(), 0);
    // SAFETY: x holds n elements, b d.
    unsafe {
        thaw_emu_add_bias(
            3,
            64,
            x.as_mut_ptr(),
            b.as_ptr(),
            b.len() as i32,
            x.len() as I64,
        )
    }
}

pub fn silu_mul(g: &[f32], u: &[f32], out: &mut [u8], kind: Kind) {
    assert_eq!(g.len(), u.len());
    assert_eq!(out.len(), g.len() * kind.bytes());
    // SAFETY: lengths checked.
    unsafe {
        thaw_emu_silu_mul(
            3,
            64,
            g.as_ptr(),
            u.as_ptr(),
            out.as_mut_ptr(),
            kind as i32,
            g.len() as I64,
        )
    }
}

/// RoPE on `q` (in place) and `k`, then keys and values of row `r` into `kc`/`vc` at
/// `slot[r] + layer_off`.
#[allow(clippy::too_many_arguments)]
pub fn rope_store(
    q: &mut [f32],
    k: &[f32],
    v: &[f32],
    cos: &[f32],
    sin: &[f32],
    h: Heads,
    kc: &mut [u8],
    vc: &mut [u8],
    kind: Kind,
    slot: &[i64],
    layer_off: usize,
) {
    let rows = slot.len();
    let kvd = h.n_kv * h.head_dim;
    assert_eq!(q.len(), rows * h.n_heads * h.head_dim);
    assert_eq!(k.len(), rows * kvd);
    assert_eq!(v.len(), rows * kvd);
    assert_eq!(cos.len(), rows * h.head_dim / 2);
    assert_eq!(sin.len(), cos.len());
    assert_eq!(kc.len(), vc.len());
    assert!(slot
        .iter()
        .all(|&s| (s as usize + layer_off + kvd) * kind.bytes() <= kc.len()));
    // SAFETY: every slot's row lies inside the caches (checked); the rest by the asserts.
    unsafe {
        thaw_emu_rope_store(
            rows as u32,
            128,
            q.as_mut_ptr(),
            k.as_ptr(),
            v.as_ptr(),
            cos.as_ptr(),
            sin.as_ptr(),
            h.n_heads as i32,
            h.n_kv as i32,
            h.head_dim as i32,
            kc.as_mut_ptr(),
            vc.as_mut_ptr(),
            kind as i32,
            slot.as_ptr(),
            layer_off as I64,
        )
    }
}

/// The paged layout attention reads: `block_size` positions per block, blocks
/// `block_stride` elements apart, this layer at `layer_off`.
#[derive(Debug, Clone, Copy)]
pub struct Paging {
    pub block_size: usize,
    pub block_stride: usize,
    pub layer_off: usize,
}

/// `ids[r]` = first index of the maximum of row `r` (rows of `n`), with `block` threads per row.
pub fn argmax_rows(x: &[f32], n: usize, ids: &mut [u32], block: u32) {
    assert_eq!(x.len(), ids.len() * n);
    assert!(block.is_power_of_two() && (32..=1024).contains(&block));
    // SAFETY: lengths checked.
    unsafe {
        thaw_emu_argmax_rows(
            ids.len() as u32,
            block,
            x.as_ptr(),
            n as i32,
            ids.as_mut_ptr(),
        )
    }
}

/// Causal paged attention for rows at `pos`, each reading its table at `table_off` in `tables`.
#[allow(clippy::too_many_arguments)]
pub fn attention(
    q: &[f32],
    kc: &[u8],
    vc: &[u8],
    kind: Kind,
    pos: &[u32],
    table_off: &[u32],
    tables: &[u32],
    p: Paging,
    h: Heads,
    out: &mut [u8],
    out_kind: Kind,
) {
    let rows = pos.len();
    let kvd = h.n_kv * h.head_dim;
    assert_eq!(table_off.len(), rows);
    assert_eq!(q.len(), rows * h.n_heads * h.head_dim);
    assert_eq!(out.len(), q.len() * out_kind.bytes());
    let blocks = kc.len() / kind.bytes() / p.block_stride;
    for r in 0..rows {
        let need = pos[r] as usize / p.block_size + 1;
        let t = &tables[table_off[r] as usize..table_off[r] as usize + need];
        assert!(t.iter().all(|&b| (b as usize) < blocks));
        assert!(p.layer_off + (p.block_size - 1) * kvd + kvd <= p.block_stride);
    }
    // SAFETY: every position each row reads lies inside the caches (checked above).
    unsafe {
        thaw_emu_attention(
            rows as u32,
            h.n_kv as u32,
            q.as_ptr(),
            kc.as_ptr(),
            vc.as_ptr(),
            kind as i32,
            pos.as_ptr(),
            table_off.as_ptr(),
            tables.as_ptr(),
            p.block_size as i32,
            p.block_stride as I64,
            p.layer_off as I64,
            h.n_heads as i32,
            h.n_kv as i32,
            h.head_dim as i32,
            1.0 / (h.head_dim as f32).sqrt(),
            out.as_mut_ptr(),
            out_kind as i32,
        )
    }
}

/// The emulator as a [`DeviceOps`] device: host memory, the emulated kernels, and cuBLAS's
/// column-major GEMM semantics executed literally (f64 accumulation) from the same
/// [`GemmCall`] the CUDA backend passes to cuBLAS. A model driven through it runs the CUDA
/// backend's step code on the CPU.
pub mod device {
    use thaw_kernels::device::{AttnDims, DeviceBuf, DeviceOps, Elem, GemmCall, Paging};

    /// Host memory standing in for a device allocation (8-byte aligned, zeroed).
    pub struct EmuBuf {
        mem: Vec<u64>,
        len: usize,
    }

    impl DeviceBuf for EmuBuf {
        fn ptr(&self) -> u64 {
            self.mem.as_ptr() as u64
        }
        fn len(&self) -> usize {
            self.len
        }
    }

    #[derive(Debug)]
    pub struct EmuError(String);

    impl std::fmt::Display for EmuError {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str(&self.0)
        }
    }
    impl std::error::Error for EmuError {}

    /// The emulated device.
    pub struct Emu;

    // Every emulated thread is an OS thread: blocks here are small (the kernels take any
    // multiple of 32 but attention's 128; `tests/cuda_emu.rs` covers the GPU's sizes) and
    // grid-stride kernels get few blocks.
    fn grid(n: usize) -> u32 {
        n.div_ceil(64).clamp(1, 3) as u32
    }

    fn load(p: u64, i: usize, kind: Elem) -> f64 {
        // SAFETY: callers pass addresses of emulator buffers holding element i.
        unsafe {
            match kind {
                Elem::F32 => *(p as *const f32).add(i) as f64,
                Elem::Bf16 => half::bf16::from_bits(*(p as *const u16).add(i)).to_f64(),
                Elem::F16 => half::f16::from_bits(*(p as *const u16).add(i)).to_f64(),
            }
        }
    }

    impl DeviceOps for Emu {
        type Buf = EmuBuf;
        type Error = EmuError;

        fn alloc(&self, bytes: usize) -> Result<EmuBuf, EmuError> {
            Ok(EmuBuf {
                mem: vec![0u64; bytes.div_ceil(8).max(1)],
                len: bytes,
            })
        }
        fn upload(&self, dst: &mut EmuBuf, at: usize, src: &[u8]) -> Result<(), EmuError> {
            if at + src.len() > dst.len {
                return Err(EmuError(format!(
                    "upload of {} at {at} overruns {}",
                    src.len(),
                    dst.len
                )));
            }
            // SAFETY: bounds checked; the buffer is owned host memory.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    src.as_ptr(),
                    (dst.mem.as_mut_ptr() as *mut u8).add(at),
                    src.len(),
                )
            };
            Ok(())
        }
        fn download(&self, src: &EmuBuf, at: usize, dst: &mut [u8]) -> Result<(), EmuError> {
            let n = dst.len();
            if at + n > src.len {
                return Err(EmuError("download overruns its buffer".into()));
            }
            // SAFETY: bounds checked.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    (src.mem.as_ptr() as *const u8).add(at),
                    dst.as_mut_ptr(),
                    n,
                )
            };
            Ok(())
        }
        fn bind(&self) -> Result<(), EmuError> {
            Ok(())
        }
        fn sync(&self) -> Result<(), EmuError> {
            Ok(())
        }
        fn widen(&self, src: u64, kind: Elem, dst: u64, n: usize) -> Result<(), EmuError> {
            // SAFETY: addresses of emulator buffers sized by the caller.
            unsafe {
                super::thaw_emu_widen(
                    grid(n),
                    64,
                    src as *const u8,
                    kind.code(),
                    dst as *mut f32,
                    n as i64,
                )
            };
            Ok(())
        }
        fn embed(
            &self,
            table: u64,
            kind: Elem,
            ids: u64,
            n: usize,
            d: usize,
            out: u64,
        ) -> Result<(), EmuError> {
            // SAFETY: as above.
            unsafe {
                super::thaw_emu_embed(
                    n as u32,
                    32,
                    table as *const u8,
                    kind.code(),
                    ids as *const u32,
                    d as i32,
                    out as *mut f32,
                )
            };
            Ok(())
        }
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
        ) -> Result<(), EmuError> {
            // SAFETY: as above.
            unsafe {
                super::thaw_emu_rmsnorm(
                    n as u32,
                    64,
                    x as *const f32,
                    rows_map as *const u32,
                    w as *const f32,
                    d as i32,
                    eps,
                    out as *mut u8,
                    out_kind.code(),
                )
            };
            Ok(())
        }
        fn add_bias(&self, x: u64, bias: u64, d: usize, n: usize) -> Result<(), EmuError> {
            // SAFETY: as above.
            unsafe {
                super::thaw_emu_add_bias(
                    grid(n),
                    64,
                    x as *mut f32,
                    bias as *const f32,
                    d as i32,
                    n as i64,
                )
            };
            Ok(())
        }
        fn silu_mul(
            &self,
            g: u64,
            u: u64,
            out: u64,
            out_kind: Elem,
            n: usize,
        ) -> Result<(), EmuError> {
            // SAFETY: as above.
            unsafe {
                super::thaw_emu_silu_mul(
                    grid(n),
                    64,
                    g as *const f32,
                    u as *const f32,
                    out as *mut u8,
                    out_kind.code(),
                    n as i64,
                )
            };
            Ok(())
        }
        fn rope_store(
            &self,
            q: u64,
            k: u64,
            v: u64,
            cos: u64,
            sin: u64,
            n: usize,
            s: AttnDims,
            kc: u64,
            vc: u64,
            kv_kind: Elem,
            slots: u64,
            layer_off: usize,
        ) -> Result<(), EmuError> {
            // SAFETY: as above.
            unsafe {
                super::thaw_emu_rope_store(
                    n as u32,
                    32,
                    q as *mut f32,
                    k as *const f32,
                    v as *const f32,
                    cos as *const f32,
                    sin as *const f32,
                    s.n_heads as i32,
                    s.n_kv_heads as i32,
                    s.head_dim as i32,
                    kc as *mut u8,
                    vc as *mut u8,
                    kv_kind.code(),
                    slots as *const i64,
                    layer_off as i64,
                )
            };
            Ok(())
        }
        fn attention(
            &self,
            q: u64,
            kc: u64,
            vc: u64,
            kv_kind: Elem,
            p: Paging,
            n: usize,
            s: AttnDims,
            out: u64,
            out_kind: Elem,
        ) -> Result<(), EmuError> {
            s.check().map_err(EmuError)?;
            // SAFETY: as above.
            unsafe {
                super::thaw_emu_attention(
                    n as u32,
                    s.n_kv_heads as u32,
                    q as *const f32,
                    kc as *const u8,
                    vc as *const u8,
                    kv_kind.code(),
                    p.pos as *const u32,
                    p.table_off as *const u32,
                    p.tables as *const u32,
                    p.block_size as i32,
                    p.block_stride as i64,
                    p.layer_off as i64,
                    s.n_heads as i32,
                    s.n_kv_heads as i32,
                    s.head_dim as i32,
                    1.0 / (s.head_dim as f32).sqrt(),
                    out as *mut u8,
                    out_kind.code(),
                )
            };
            Ok(())
        }
        fn argmax_rows(&self, x: u64, rows: usize, n: usize, ids: u64) -> Result<(), EmuError> {
            // SAFETY: x holds rows·n f32, ids rows u32 (the caller's buffers).
            unsafe {
                super::thaw_emu_argmax_rows(
                    rows as u32,
                    64,
                    x as *const f32,
                    n as i32,
                    ids as *mut u32,
                )
            };
            Ok(())
        }
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
        ) -> Result<(), EmuError> {
            let c = GemmCall::linear(out_dim, in_dim, n);
            // cuBLAS's definition, literally: A and B in `w_kind`, C f32.
            let a = |i: usize, l: usize| {
                load(
                    w,
                    if c.transa {
                        l + i * c.lda
                    } else {
                        i + l * c.lda
                    },
                    w_kind,
                )
            };
            let b = |l: usize, j: usize| {
                load(
                    x,
                    if c.transb {
                        j + l * c.ldb
                    } else {
                        l + j * c.ldb
                    },
                    w_kind,
                )
            };
            for j in 0..c.n {
                for i in 0..c.m {
                    let mut acc = 0f64;
                    for l in 0..c.k {
                        acc += a(i, l) * b(l, j);
                    }
                    // SAFETY: C holds ldc·n f32 (the caller's output buffer).
                    unsafe {
                        let p = (y as *mut f32).add(i + j * c.ldc);
                        // As cuBLAS: with beta = 0, C is written, never read.
                        let old = if beta == 0.0 {
                            0.0
                        } else {
                            beta as f64 * *p as f64
                        };
                        *p = (acc + old) as f32;
                    }
                }
            }
            Ok(())
        }
    }
}
