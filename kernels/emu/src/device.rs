//! The emulator as a `DeviceOps` device: host memory, the emulated kernels, and cuBLAS's
//! column-major GEMM semantics executed literally (f64 accumulation) from the same
//! `GemmCall` the CUDA backend passes to cuBLAS. A model driven through it runs the CUDA
//! backend's step code on the CPU.

use crate::fence::Fenced;
use thaw_kernels::device::{
    AttnDims, DeviceBuf, DeviceOps, Elem, GemmCall, GemvIn, GemvOut, Paging, Split, Tiles,
};

/// Host memory standing in for a device allocation: zeroed, 256-byte aligned as `cuMemAlloc`'s
/// allocations are (so alignment checks of 16-byte loads pass or fail here as on a GPU), and
/// fenced by guard pages (an out-of-bounds kernel access faults; see [`crate::fence`]).
pub struct EmuBuf {
    mem: Fenced,
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
#[derive(Default)]
pub struct Emu {
    /// Launches of each matrix-vector kernel ([`GemvKernel`] order) that ran the kernel itself.
    gemv_runs: [std::sync::atomic::AtomicU64; 4],
    /// While capturing: the operations queued so far, each with its arguments fixed.
    capture: std::sync::Mutex<Option<Vec<Op>>>,
    /// Refuse to start captures (as a driver without stream capture would): tests of the
    /// fallback.
    refuse_captures: std::sync::atomic::AtomicBool,
}

/// One queued operation, as a capture records it: its arguments are moved in, so a replay
/// runs it with exactly what it was given — as a CUDA graph's kernel nodes do.
type Op = Box<dyn Fn(&Emu) -> Result<(), EmuError> + Send>;

/// What [`DeviceOps::end_capture`] returns on the emulator.
pub struct EmuGraph(Vec<Op>);

impl EmuGraph {
    /// Operations recorded.
    pub fn len(&self) -> usize {
        self.0.len()
    }
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

/// Largest weight matrix (elements) the emulator runs through the `gemv` kernel itself.
pub const EMU_GEMV_MAX_ELEMS: usize = 1 << 16;

/// The matrix-vector kernels of gemv.cu (the GPU picks by rows and alignment, as
/// [`Emu`]'s `gemv` does). The discriminants are emu.cpp's `which` numbers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(i32)]
pub enum GemvKernel {
    /// `gemv`: 1..=8 rows, 4 outputs per block.
    Rows = 0,
    /// `gemv1`: one row, 4 outputs per block.
    One = 1,
    /// `gemv1v`: one row, 4 outputs per block, 16-byte loads ([`GemvIn::vec16`] products).
    OneVec16 = 2,
    /// `gemv1r`: one row, x staged in shared memory, a warp per 2 outputs, 16-byte loads
    /// ([`GemvIn::vec16`] products whose x [`GemvIn::stages`]).
    OneWarpRows = 3,
}

impl Emu {
    pub fn new() -> Emu {
        Emu::default()
    }

    /// From now on, captures are refused (or again allowed).
    pub fn set_refuse_captures(&self, on: bool) {
        self.refuse_captures
            .store(on, std::sync::atomic::Ordering::Relaxed);
    }

    /// Runs `op` now, or records it while a capture is open.
    fn queue(
        &self,
        op: impl Fn(&Emu) -> Result<(), EmuError> + Send + 'static,
    ) -> Result<(), EmuError> {
        let mut capture = self.capture.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(ops) = capture.as_mut() {
            ops.push(Box::new(op));
            return Ok(());
        }
        drop(capture);
        op(self)
    }

    fn capturing(&self) -> bool {
        self.capture
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_some()
    }

    /// How many launches ran `kernel` itself (not the GEMM's definition, which the emulator
    /// takes for large products): tests check which kernel a model's products took.
    pub fn gemv_runs(&self, kernel: GemvKernel) -> u64 {
        self.gemv_runs[kernel as usize].load(std::sync::atomic::Ordering::Relaxed)
    }
    /// [`DeviceOps::gemv`] through a chosen kernel.
    #[allow(clippy::too_many_arguments)]
    pub fn gemv_kernel(
        &self,
        kernel: GemvKernel,
        w_kind: Elem,
        outs: &[GemvOut],
        x: &GemvIn,
        beta: f32,
    ) -> Result<(), EmuError> {
        use thaw_kernels::device::GEMV_MAX_ROWS;
        let rows_max = if kernel == GemvKernel::Rows {
            GEMV_MAX_ROWS
        } else {
            1
        };
        let vec16_ok = match kernel {
            GemvKernel::OneVec16 => x.vec16(outs),
            GemvKernel::OneWarpRows => x.vec16(outs) && x.stages(w_kind),
            _ => true,
        };
        if !x.fits(w_kind, outs, rows_max) || !vec16_ok {
            return Err(EmuError(format!(
                "gemv of {} rows of {} into {} matrices: unsupported",
                x.rows,
                x.in_dim,
                outs.len()
            )));
        }
        let (n, in_dim) = (x.rows, x.in_dim);
        // Each block ends in warp reductions, which the emulator does with OS-thread barriers
        // (~10 µs each): a SmolLM2-sized LM head would take minutes. Large products therefore
        // take the GEMM's definition (the same contract); the kernel itself runs for the small
        // ones — the tiny models' every decode product, and the kernel tests.
        if outs.iter().map(|o| o.out_dim * in_dim).sum::<usize>() > EMU_GEMV_MAX_ELEMS {
            let xs = match x.norm {
                // The norm first (into a scratch row in W's kind, as the step does unfused).
                Some(m) => {
                    let xn = self.alloc(n * in_dim * 4)?;
                    self.rmsnorm(x.x, 0, m.w, n, in_dim, m.eps, xn.ptr(), w_kind)?;
                    Some(xn)
                }
                None => None,
            };
            let xp = xs.as_ref().map_or(x.x, |b| b.ptr());
            for o in outs {
                self.gemm(o.w, w_kind, o.out_dim, in_dim, xp, n, o.y, beta)?;
            }
            return Ok(());
        }
        let at = |i: usize| {
            outs.get(i).copied().unwrap_or(GemvOut {
                w: 0,
                out_dim: 0,
                y: 0,
            })
        };
        let (a, b, c) = (at(0), at(1), at(2));
        self.gemv_runs[kernel as usize].fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        // A small grid of small blocks (the kernel strides its output groups over the grid):
        // every emulated thread is an OS thread.
        // SAFETY: each W holds out_dim·in elements, x n·in, each y n·out_dim f32 (the caller's
        // buffers); absent matrices have no outputs.
        unsafe {
            super::thaw_emu_gemv(
                kernel as i32,
                2,
                64,
                a.w as *const u8,
                b.w as *const u8,
                c.w as *const u8,
                a.y as *mut f32,
                b.y as *mut f32,
                c.y as *mut f32,
                a.out_dim as i32,
                b.out_dim as i32,
                c.out_dim as i32,
                w_kind.code(),
                x.x as *const u8,
                n as i32,
                in_dim as i32,
                x.norm.map_or(std::ptr::null(), |m| m.w as *const f32),
                x.norm.map_or(0.0, |m| m.eps),
                beta,
            )
        };
        Ok(())
    }
}

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
        // As `cuMemAlloc` on a capturing thread (thread-local capture mode).
        if self.capturing() {
            return Err(EmuError("an allocation during a capture".into()));
        }
        Ok(EmuBuf {
            mem: Fenced::zeroed(bytes),
            len: bytes,
        })
    }
    fn upload(&self, dst: &mut EmuBuf, at: usize, src: &[u8]) -> Result<(), EmuError> {
        if self.capturing() {
            return Err(EmuError("an upload during a capture".into()));
        }
        if at + src.len() > dst.len {
            return Err(EmuError(format!(
                "upload of {} at {at} overruns {}",
                src.len(),
                dst.len
            )));
        }
        // SAFETY: bounds checked; the buffer is owned host memory.
        unsafe {
            std::ptr::copy_nonoverlapping(src.as_ptr(), dst.mem.as_mut_ptr().add(at), src.len())
        };
        Ok(())
    }
    fn download(&self, src: &EmuBuf, at: usize, dst: &mut [u8]) -> Result<(), EmuError> {
        if self.capturing() {
            return Err(EmuError("a download during a capture".into()));
        }
        let n = dst.len();
        if at + n > src.len {
            return Err(EmuError("download overruns its buffer".into()));
        }
        // SAFETY: bounds checked.
        unsafe { std::ptr::copy_nonoverlapping(src.mem.as_ptr().add(at), dst.as_mut_ptr(), n) };
        Ok(())
    }
    fn bind(&self) -> Result<(), EmuError> {
        Ok(())
    }
    fn sync(&self) -> Result<(), EmuError> {
        Ok(())
    }
    type Graph = EmuGraph;
    fn begin_capture(&self) -> Result<(), EmuError> {
        if self
            .refuse_captures
            .load(std::sync::atomic::Ordering::Relaxed)
        {
            return Err(EmuError(
                "stream capture is not supported (refused on request)".into(),
            ));
        }
        let mut capture = self.capture.lock().unwrap_or_else(|e| e.into_inner());
        if capture.is_some() {
            return Err(EmuError("a capture is already open".into()));
        }
        *capture = Some(vec![]);
        Ok(())
    }
    fn end_capture(&self) -> Result<EmuGraph, EmuError> {
        let ops = (self.capture.lock().unwrap_or_else(|e| e.into_inner()))
            .take()
            .ok_or_else(|| EmuError("no capture is open".into()))?;
        Ok(EmuGraph(ops))
    }
    fn replay(&self, g: &EmuGraph) -> Result<(), EmuError> {
        if self.capturing() {
            return Err(EmuError("a replay during a capture".into()));
        }
        g.0.iter().try_for_each(|op| op(self))
    }
    fn widen(&self, src: u64, kind: Elem, dst: u64, n: usize) -> Result<(), EmuError> {
        self.queue(move |_| {
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
        })
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
        self.queue(move |_| {
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
        })
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
        self.queue(move |_| {
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
        })
    }
    fn add_bias(&self, x: u64, bias: u64, d: usize, n: usize) -> Result<(), EmuError> {
        self.queue(move |_| {
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
        })
    }
    fn silu_mul(&self, g: u64, u: u64, out: u64, out_kind: Elem, n: usize) -> Result<(), EmuError> {
        self.queue(move |_| {
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
        })
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
        self.queue(move |_| {
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
        })
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
        split: Split,
    ) -> Result<(), EmuError> {
        s.check().map_err(EmuError)?;
        if kv_kind == Elem::F16 {
            return Err(EmuError("an f16 KV cache: unsupported".into()));
        }
        self.queue(move |_| {
            let (chunk, nsplit) = split.kernel_args();
            // SAFETY: as above; the partials buffer is the caller's, of the planned size.
            unsafe {
                super::thaw_emu_attention(
                    n as u32,
                    s.n_kv_heads as u32,
                    q as *const f32,
                    kc as *const u8,
                    vc as *const u8,
                    kv_kind.code(),
                    p.rows as *const u32,
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
                    chunk,
                    nsplit,
                    split.partials as *mut f32,
                )
            };
            Ok(())
        })
    }
    /// Splits of 16 positions or more, to 16 blocks: the tiny models' short contexts are
    /// split, so the model tests run the merge.
    fn attention_split_target(&self) -> (usize, usize) {
        (16, 16)
    }
    fn attention_prefill(
        &self,
        q: u64,
        kc: u64,
        vc: u64,
        kv_kind: Elem,
        t: Tiles,
        p: Paging,
        s: AttnDims,
        out: u64,
        out_kind: Elem,
    ) -> Result<(), EmuError> {
        s.check().map_err(EmuError)?;
        self.queue(move |_| {
            // SAFETY: as above.
            unsafe {
                super::thaw_emu_attention_prefill(
                    t.n as u32,
                    s.n_kv_heads as u32,
                    q as *const f32,
                    kc as *const u8,
                    vc as *const u8,
                    kv_kind.code(),
                    t.row0 as *const u32,
                    t.count as *const u32,
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
        })
    }
    fn argmax_rows(&self, x: u64, rows: usize, n: usize, ids: u64) -> Result<(), EmuError> {
        self.queue(move |_| {
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
        })
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
        self.queue(move |_| {
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
        })
    }
    fn gemv(&self, w_kind: Elem, outs: &[GemvOut], x: &GemvIn, beta: f32) -> Result<(), EmuError> {
        // As the GPU picks (`Gpu::gemv_vec16` and `gemv_warp_rows` on, its defaults).
        let kernel = if x.rows == 1 && x.vec16(outs) && x.stages(w_kind) {
            GemvKernel::OneWarpRows
        } else if x.rows == 1 && x.vec16(outs) {
            GemvKernel::OneVec16
        } else if x.rows == 1 {
            GemvKernel::One
        } else {
            GemvKernel::Rows
        };
        // Refused now, not when replayed.
        if !x.fits(w_kind, outs, thaw_kernels::device::GEMV_MAX_ROWS) {
            return self.gemv_kernel(kernel, w_kind, outs, x, beta);
        }
        let (outs, x) = (outs.to_vec(), *x);
        self.queue(move |e| e.gemv_kernel(kernel, w_kind, &outs, &x, beta))
    }
}
