//! `out[t, r] = Σ_i x[t, i] · W[r, i]` for a block of tokens `x` (`[n, k]`, f32) and one or more
//! weight matrices `W` (`[rows, k]`, bf16/f16/f32) that share the input.
//!
//! Passing several matrices at once (q/k/v, gate/up) makes one parallel region instead of three,
//! which matters at batch 1 where a region lasts microseconds. Tasks are blocks of output rows;
//! inside a task, tokens are taken 4 at a time (3 with AVX2) against 4 weight rows, each weight
//! vector loaded once for all of them, and single tokens against 4 rows. Each output is the same lane-wise accumulation in every tile shape, so the
//! result does not depend on `n` (see the crate docs on batch invariance).

use crate::{Isa, ThreadPool};

#[derive(Clone, Copy, Debug)]
pub enum Weights<'a> {
    F32(&'a [f32]),
    Bf16(&'a [u16]),
    F16(&'a [u16]),
    /// Q8_0 ([`crate::q8`]): `i8` values and an f16 scale (bits) per 32 of a row.
    Q8 {
        qs: &'a [i8],
        scales: &'a [u16],
    },
}

/// A row-major `[rows, cols]` weight matrix.
#[derive(Clone, Copy, Debug)]
pub struct Matrix<'a> {
    pub w: Weights<'a>,
    pub rows: usize,
    pub cols: usize,
}

impl<'a> Matrix<'a> {
    pub fn new(w: Weights<'a>, rows: usize, cols: usize) -> Matrix<'a> {
        let len = match w {
            Weights::F32(s) => s.len(),
            Weights::Bf16(s) | Weights::F16(s) => s.len(),
            Weights::Q8 { qs, scales } => {
                assert!(
                    cols.is_multiple_of(crate::q8::BLOCK)
                        && scales.len() * crate::q8::BLOCK == qs.len(),
                    "Q8_0 rows must be whole 32-blocks, one scale each"
                );
                qs.len()
            }
        };
        assert_eq!(len, rows * cols, "matrix data does not match its shape");
        Matrix { w, rows, cols }
    }

    /// Row `r` widened to f32 (embedding lookup).
    pub fn row_f32(&self, r: usize, out: &mut [f32]) {
        let (a, b) = (r * self.cols, (r + 1) * self.cols);
        match self.w {
            Weights::F32(s) => out.copy_from_slice(&s[a..b]),
            Weights::Bf16(s) => out
                .iter_mut()
                .zip(&s[a..b])
                .for_each(|(o, &v)| *o = f32::from_bits((v as u32) << 16)),
            Weights::F16(s) => out
                .iter_mut()
                .zip(&s[a..b])
                .for_each(|(o, &v)| *o = half::f16::from_bits(v).to_f32()),
            Weights::Q8 { qs, scales } => crate::q8::dequantize_row(
                &qs[a..b],
                &scales[a / crate::q8::BLOCK..b / crate::q8::BLOCK],
                out,
            ),
        }
    }

    fn kind(&self) -> (u8, *const u8) {
        match self.w {
            Weights::F32(s) => (KIND_F32, s.as_ptr().cast()),
            Weights::Bf16(s) => (KIND_BF16, s.as_ptr().cast()),
            Weights::F16(s) => (KIND_F16, s.as_ptr().cast()),
            // Never dispatched by kind: `rows_kernel` sends Q8_0 to `q8::rows` first.
            Weights::Q8 { qs, .. } => (KIND_Q8, qs.as_ptr().cast()),
        }
    }
}

/// Tokens per task when a call carries many (prefill).
const TOKEN_BLOCK: usize = 64;

const KIND_F32: u8 = 0;
const KIND_BF16: u8 = 1;
const KIND_F16: u8 = 2;
/// bf16 weights × bf16 activations with `vdpbf16ps` (the activations are passed as a `*const
/// f32` that really points at u16 pairs; `ldx` then counts f32 slots, i.e. pairs).
const KIND_BF16_DOT: u8 = 3;
const KIND_Q8: u8 = 4;

/// The activations, plus a per-call rearrangement shared by every task: for the AVX-512 bf16
/// kernel, the values split even/odd per 32-chunk; for the BF16-dot kernel, the values rounded
/// to bf16.
pub(crate) struct Input<'a> {
    x: &'a [f32],
    split: Option<(&'a [f32], usize)>,
    /// bf16 bits, `ldx` per token (a multiple of 32, zero-padded).
    bf16: Option<(&'a [u16], usize)>,
    /// Quantized per 32-block for Q8_0 weights: `k` values and `k / 32` scales per token.
    q8: Option<crate::q8::QSlice<'a>>,
}

/// A zeroed buffer of `T` on cache-line boundaries. The kernels load a token's activations 64
/// bytes at a time, and a `Vec`'s buffer starts 16 bytes into a line (glibc), so every one of
/// those loads straddled two lines: aligned, a 512-token prefill took 448 ms instead of 479
/// (medians of 7 alternated runs; docs/PERFORMANCE.md, "Alignment of weights and KV rows").
struct LineBuf<T> {
    lines: Vec<Line>,
    len: usize,
    _t: std::marker::PhantomData<T>,
}

#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Line([u8; 64]);

/// Element types any bit pattern of which is a value (so zeroed bytes are zeros).
trait Plain: Copy {}
impl Plain for u16 {}
impl Plain for f32 {}

impl<T: Plain> LineBuf<T> {
    fn zeroed(len: usize) -> LineBuf<T> {
        let bytes = len * std::mem::size_of::<T>();
        LineBuf {
            lines: vec![Line([0; 64]); bytes.div_ceil(64)],
            len,
            _t: std::marker::PhantomData,
        }
    }
    fn as_slice(&self) -> &[T] {
        // SAFETY: the lines hold at least len × size_of::<T>() initialized bytes, aligned to 64
        // (more than T needs); any bit pattern is a T (`Plain`).
        unsafe { std::slice::from_raw_parts(self.lines.as_ptr().cast(), self.len) }
    }
    fn as_mut_slice(&mut self) -> &mut [T] {
        // SAFETY: as in `as_slice`, with &mut self for exclusive access.
        unsafe { std::slice::from_raw_parts_mut(self.lines.as_mut_ptr().cast(), self.len) }
    }
}

/// `x` (`[n, k]`) rounded to bf16 (round to nearest even), each row zero-padded to a multiple of
/// 32 so the kernel's 64-byte loads never need a mask (and, the buffer being line-aligned, never
/// straddle two lines).
fn to_bf16_padded(x: &[f32], n: usize, k: usize) -> (LineBuf<u16>, usize) {
    let kp = k.div_ceil(32) * 32;
    let mut buf = LineBuf::zeroed(n * kp);
    let out = buf.as_mut_slice();
    for t in 0..n {
        for (o, &v) in out[t * kp..t * kp + k]
            .iter_mut()
            .zip(&x[t * k..(t + 1) * k])
        {
            *o = half::bf16::from_f32(v).to_bits();
        }
    }
    (buf, kp)
}

/// Rearranges each 32-value chunk of each row of `x` (`[n, k]`) as its 16 even-indexed values
/// followed by its 16 odd-indexed ones, zero-padding rows to a multiple of 32.
fn split_even_odd(x: &[f32], n: usize, k: usize) -> (LineBuf<f32>, usize) {
    let kp = k.div_ceil(32) * 32;
    let mut buf = LineBuf::zeroed(n * kp);
    let out = buf.as_mut_slice();
    for t in 0..n {
        let (src, dst) = (&x[t * k..(t + 1) * k], &mut out[t * kp..(t + 1) * kp]);
        for (j, &v) in src.iter().enumerate() {
            let (c, o) = (j / 32, j % 32);
            dst[c * 32 + (o % 2) * 16 + o / 2] = v;
        }
    }
    (buf, kp)
}

/// Raw output pointer shared by tasks that write disjoint elements.
#[derive(Clone, Copy)]
struct OutPtr(*mut f32);
// SAFETY: tasks write pairwise-disjoint (token, row) elements; `run` joins before returning.
unsafe impl Send for OutPtr {}
// SAFETY: as above.
unsafe impl Sync for OutPtr {}

/// Multiplies `x` (`[n, k]`) by every matrix in `mats`, writing `[n, rows]` into each output.
pub fn matmul(pool: &ThreadPool, x: &[f32], n: usize, mats: &mut [(Matrix<'_>, &mut [f32])]) {
    matmul_with(Isa::detect(), pool, x, n, mats)
}

/// [`matmul`] on a chosen instruction set (tests compare them all).
pub fn matmul_with(
    isa: Isa,
    pool: &ThreadPool,
    x: &[f32],
    n: usize,
    mats: &mut [(Matrix<'_>, &mut [f32])],
) {
    if n == 0 || mats.is_empty() {
        return;
    }
    let k = mats[0].0.cols;
    assert_eq!(x.len(), n * k, "input is not [n, k]");
    for (m, out) in mats.iter() {
        assert_eq!(m.cols, k, "matrices in one call must share the input width");
        assert_eq!(out.len(), n * m.rows, "output is not [n, rows]");
    }
    let total_rows: usize = mats.iter().map(|(m, _)| m.rows).sum();
    // Decode (one token): one contiguous share of the rows per thread, so each thread streams a
    // single long run that the prefetchers stay locked on (measured 4–6% faster decode than
    // 64-row tasks). Prefill: smaller blocks, as many tasks as it takes to balance the threads.
    let block = if n > 1 {
        (total_rows / (pool.threads() * 6)).clamp(16, 64) / 8 * 8
    } else {
        total_rows.div_ceil(pool.threads()).div_ceil(8) * 8
    };
    // Long prompts are also split into token blocks: with only rows to share out, a 576-row
    // matrix makes 9 big tasks and two threads finish 5 against 4. Each output element is the
    // same dot product whatever block it is in, so this changes no result.
    let tblock = if n > TOKEN_BLOCK { TOKEN_BLOCK } else { n };
    let mut tasks: Vec<(usize, usize, usize, usize)> = Vec::new();
    for (mi, (m, _)) in mats.iter().enumerate() {
        let mut r = 0;
        while r < m.rows {
            let e = (r + block).min(m.rows);
            let mut t = 0;
            while t < n {
                tasks.push((mi, r, e, t));
                t += tblock;
            }
            r = e;
        }
    }
    let any_bf16 = mats.iter().any(|(m, _)| matches!(m.w, Weights::Bf16(_)));
    let split = (isa == Isa::Avx512 && any_bf16).then(|| split_even_odd(x, n, k));
    // With BF16 dot products every bf16 product of every batch size takes this path, so a
    // token's result never depends on how many tokens share the call.
    let bf16 = (isa == Isa::Avx512Bf16 && any_bf16).then(|| to_bf16_padded(x, n, k));
    let any_q8 = mats.iter().any(|(m, _)| matches!(m.w, Weights::Q8 { .. }));
    let q8 = any_q8.then(|| crate::q8::quantize_input(x, isa));
    let views: Vec<(Matrix<'_>, OutPtr)> = mats
        .iter_mut()
        .map(|(m, o)| (*m, OutPtr(o.as_mut_ptr())))
        .collect();
    let job = |ti: usize| {
        let (mi, r0, r1, t0) = tasks[ti];
        let t1 = (t0 + tblock).min(n);
        let (m, out) = views[mi];
        let input = Input {
            x: &x[t0 * k..t1 * k],
            split: split
                .as_ref()
                .map(|(v, kp)| (&v.as_slice()[t0 * kp..t1 * kp], *kp)),
            bf16: bf16
                .as_ref()
                .map(|(v, kp)| (&v.as_slice()[t0 * kp..t1 * kp], *kp)),
            q8: q8.as_ref().map(|q| {
                let nb = k / crate::q8::BLOCK;
                crate::q8::QSlice {
                    q: q.q.get(t0 * k..t1 * k).unwrap_or_default(),
                    u: q.u.get(t0 * k..t1 * k).unwrap_or_default(),
                    d: &q.d[t0 * nb..t1 * nb],
                }
            }),
        };
        // SAFETY: shapes were checked above; this task writes only rows r0..r1 of tokens
        // t0..t1 of `out`.
        unsafe {
            rows_kernel(
                isa,
                &input,
                t1 - t0,
                k,
                &m,
                r0,
                r1,
                out.0.add(t0 * m.rows),
                m.rows,
            )
        };
    };
    pool.run(tasks.len(), &job);
}

/// Computes output rows `r0..r1` for all `n` tokens.
///
/// # Safety
/// `out` must be valid for `n * ldo` f32 writes and `x` hold `n * k` values; `m` is `[rows, k]`.
#[allow(clippy::too_many_arguments)]
unsafe fn rows_kernel(
    isa: Isa,
    input: &Input<'_>,
    n: usize,
    k: usize,
    m: &Matrix<'_>,
    r0: usize,
    r1: usize,
    out: *mut f32,
    ldo: usize,
) {
    if let (Weights::Q8 { .. }, Some(q)) = (m.w, input.q8.as_ref()) {
        // SAFETY: forwards the caller's bounds; `q` holds these n tokens.
        return unsafe { crate::q8::rows(isa, q, n, k, m, r0, r1, out, ldo) };
    }
    #[cfg(target_arch = "x86_64")]
    match isa {
        // SAFETY: Isa::Avx512*/Avx2 are only produced after feature detection.
        Isa::Avx512 | Isa::Avx512Bf16 => {
            return unsafe { avx512::rows(input, n, k, m, r0, r1, out, ldo) }
        }
        Isa::Avx2 => return unsafe { avx2::rows(input, n, k, m, r0, r1, out, ldo) },
        Isa::Scalar => {}
    }
    let _ = isa;
    let x = input.x;
    for t in 0..n {
        let xr = &x[t * k..(t + 1) * k];
        for r in r0..r1 {
            let mut acc = 0f32;
            match m.w {
                Weights::F32(s) => xr
                    .iter()
                    .zip(&s[r * k..(r + 1) * k])
                    .for_each(|(a, b)| acc += a * b),
                Weights::Bf16(s) => xr
                    .iter()
                    .zip(&s[r * k..(r + 1) * k])
                    .for_each(|(a, &b)| acc += a * f32::from_bits((b as u32) << 16)),
                Weights::F16(s) => xr
                    .iter()
                    .zip(&s[r * k..(r + 1) * k])
                    .for_each(|(a, &b)| acc += a * half::f16::from_bits(b).to_f32()),
                Weights::Q8 { .. } => unreachable!("Q8_0 products go to q8::rows"),
            }
            // SAFETY: t < n and r < ldo by the caller's contract.
            unsafe { *out.add(t * ldo + r) = acc };
        }
    }
}

/// Generates the row-range driver for one SIMD width: token tiles of `TT` against row tiles of
/// `TR`, remainders against 1 row.
macro_rules! rows_driver {
    ($feat:literal) => {
        #[target_feature(enable = $feat)]
        #[allow(clippy::too_many_arguments)]
        pub(super) unsafe fn rows(
            x: &Input<'_>,
            n: usize,
            k: usize,
            m: &Matrix<'_>,
            r0: usize,
            r1: usize,
            out: *mut f32,
            ldo: usize,
        ) {
            let (kind, w) = m.kind();
            // SAFETY (whole body): every tile stays inside rows r0..r1 and tokens 0..n, which the
            // caller guarantees are in bounds of `x`, the matrix and `out`.
            unsafe {
                match kind {
                    KIND_F32 => rows_k::<KIND_F32>(x.x.as_ptr(), k, n, k, w, r0, r1, out, ldo),
                    KIND_BF16 => match (x.bf16, x.split) {
                        (Some((xb, ldx)), _) => rows_k::<KIND_BF16_DOT>(
                            xb.as_ptr().cast(),
                            ldx / 2,
                            n,
                            k,
                            w,
                            r0,
                            r1,
                            out,
                            ldo,
                        ),
                        (None, Some((xs, ldx))) => {
                            rows_k::<KIND_BF16>(xs.as_ptr(), ldx, n, k, w, r0, r1, out, ldo)
                        }
                        (None, None) => {
                            rows_k::<KIND_BF16>(x.x.as_ptr(), k, n, k, w, r0, r1, out, ldo)
                        }
                    },
                    _ => rows_k::<KIND_F16>(x.x.as_ptr(), k, n, k, w, r0, r1, out, ldo),
                }
            }
        }

        #[target_feature(enable = $feat)]
        #[allow(clippy::too_many_arguments)]
        unsafe fn rows_k<const K: u8>(
            x: *const f32,
            ldx: usize,
            n: usize,
            k: usize,
            w: *const u8,
            r0: usize,
            r1: usize,
            out: *mut f32,
            ldo: usize,
        ) {
            // SAFETY (whole body): see `rows`.
            unsafe {
                // Row tiles outside, token tiles inside: a tile's weights (TR rows) are read
                // from memory once and reused from L1 by every token tile while the next rows
                // stream in — token tiles outside made the first pass over a task's rows wait on
                // memory and the later ones leave it idle (LM head, 16 tokens, one thread:
                // 109 GFLOP/s against 170 for the same product from cache).
                let full = n / TT * TT;
                let mut r = r0;
                while full > 0 && r + TR <= r1 {
                    let mut t = 0;
                    while t < full {
                        tile::<K, TR, TT>(x.add(t * ldx), ldx, k, w, r, out.add(t * ldo), ldo);
                        t += TT;
                    }
                    r += TR;
                }
                while full > 0 && r < r1 {
                    let mut t = 0;
                    while t < full {
                        tile::<K, 1, TT>(x.add(t * ldx), ldx, k, w, r, out.add(t * ldo), ldo);
                        t += TT;
                    }
                    r += 1;
                }
                let t = full;
                let rest = n - t;
                if rest > 1 {
                    let mut r = r0;
                    while r + TR <= r1 {
                        small_tile::<K, TR>(
                            rest,
                            x.add(t * ldx),
                            ldx,
                            k,
                            w,
                            r,
                            out.add(t * ldo),
                            ldo,
                        );
                        r += TR;
                    }
                    while r < r1 {
                        small_tile::<K, 1>(
                            rest,
                            x.add(t * ldx),
                            ldx,
                            k,
                            w,
                            r,
                            out.add(t * ldo),
                            ldo,
                        );
                        r += 1;
                    }
                } else if rest == 1 {
                    let mut r = r0;
                    // Four rows at once: enough independent FMA chains to hide latency, few
                    // enough interleaved streams that prefetching keeps up (8 measured 25%
                    // slower on decode's matrix-vector products, 2 slower still).
                    while r + TR <= r1 {
                        tile::<K, TR, 1>(x.add(t * ldx), ldx, k, w, r, out.add(t * ldo), ldo);
                        r += TR;
                    }
                    while r < r1 {
                        tile::<K, 1, 1>(x.add(t * ldx), ldx, k, w, r, out.add(t * ldo), ldo);
                        r += 1;
                    }
                }
            }
        }

        /// Fewer than `TT` tokens: dispatch to a tile of exactly that many.
        #[target_feature(enable = $feat)]
        #[allow(clippy::too_many_arguments)]
        unsafe fn small_tile<const K: u8, const R: usize>(
            nt: usize,
            x: *const f32,
            ldx: usize,
            k: usize,
            w: *const u8,
            r: usize,
            out: *mut f32,
            ldo: usize,
        ) {
            // SAFETY: forwards the caller's bounds.
            unsafe {
                match nt {
                    2 => tile::<K, R, 2>(x, ldx, k, w, r, out, ldo),
                    3 => tile::<K, R, 3>(x, ldx, k, w, r, out, ldo),
                    4 => tile::<K, R, 4>(x, ldx, k, w, r, out, ldo),
                    5 => tile::<K, R, 5>(x, ldx, k, w, r, out, ldo),
                    _ => unreachable!("small_tile takes 2..TT tokens"),
                }
            }
        }
    };
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::avx512_bf16_tile::tile_bf16;
    use super::*;
    use std::arch::x86_64::*;

    const TT: usize = 4;
    const TR: usize = 4;
    const LANES: usize = 16;

    rows_driver!("avx512f,avx512bw,avx512vl");

    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    unsafe fn widen<const K: u8>(v: __m256i) -> __m512 {
        if K == KIND_BF16 {
            _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16))
        } else {
            _mm512_cvtph_ps(v)
        }
    }

    /// 16 weights at element index `i`, widened to f32.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    unsafe fn load_w<const K: u8>(w: *const u8, i: usize) -> __m512 {
        // SAFETY: the caller guarantees 16 elements at `i` are in bounds.
        unsafe {
            if K == KIND_F32 {
                _mm512_loadu_ps(w.cast::<f32>().add(i))
            } else {
                widen::<K>(_mm256_loadu_si256(w.cast::<u16>().add(i).cast()))
            }
        }
    }

    /// The first `popcount(mask)` weights at `i`, zeros beyond (masked loads never fault).
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    unsafe fn load_w_tail<const K: u8>(w: *const u8, i: usize, mask: __mmask16) -> __m512 {
        // SAFETY: masked-off lanes are not accessed.
        unsafe {
            if K == KIND_F32 {
                _mm512_maskz_loadu_ps(mask, w.cast::<f32>().add(i))
            } else {
                widen::<K>(_mm256_maskz_loadu_epi16(
                    mask,
                    w.cast::<u16>().add(i).cast(),
                ))
            }
        }
    }

    /// R weight rows starting at row `r` × T tokens.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    unsafe fn tile<const K: u8, const R: usize, const T: usize>(
        x: *const f32,
        ldx: usize,
        k: usize,
        w: *const u8,
        r: usize,
        out: *mut f32,
        ldo: usize,
    ) {
        if K == KIND_BF16 {
            // SAFETY: same contract.
            return unsafe { tile_bf16::<R, T>(x, ldx, k, w.cast(), r, out, ldo) };
        }
        if K == KIND_BF16_DOT {
            // SAFETY: same contract; KIND_BF16_DOT is only chosen when Isa::Avx512Bf16 was
            // detected, and `x` then points at bf16 values, `2 * ldx` per token.
            return unsafe {
                super::avx512_bf16_dot::tile_dot::<R, T>(
                    x.cast(),
                    2 * ldx,
                    k,
                    w.cast(),
                    r,
                    out,
                    ldo,
                )
            };
        }
        // SAFETY: rows r..r+R of `w` and tokens 0..T of `x`/`out` are in bounds (caller).
        unsafe {
            let mut acc = [[_mm512_setzero_ps(); T]; R];
            let full = k / LANES * LANES;
            let esz = if K == KIND_F32 { 4 } else { 2 };
            // The R rows of this tile are one contiguous block, but we walk them as R short
            // interleaved streams that the hardware prefetcher barely ramps up on. So prefetch
            // the next tile's block linearly: each step consumes R·16 elements, the same amount.
            let step_bytes = R * LANES * esz;
            let next = w.wrapping_add((r + R) * k * esz);
            let mut i = 0;
            while i < full {
                let pf = next.wrapping_add(i / LANES * step_bytes);
                let mut line = 0;
                while line < step_bytes {
                    _mm_prefetch::<_MM_HINT_T0>(pf.wrapping_add(line).cast());
                    line += 64;
                }
                let mut xv = [_mm512_setzero_ps(); T];
                for t in 0..T {
                    xv[t] = _mm512_loadu_ps(x.add(t * ldx + i));
                }
                for ri in 0..R {
                    let wv = load_w::<K>(w, (r + ri) * k + i);
                    for t in 0..T {
                        acc[ri][t] = _mm512_fmadd_ps(wv, xv[t], acc[ri][t]);
                    }
                }
                i += LANES;
            }
            if full < k {
                let mask: __mmask16 = ((1u32 << (k - full)) - 1) as u16;
                let mut xv = [_mm512_setzero_ps(); T];
                for t in 0..T {
                    xv[t] = _mm512_maskz_loadu_ps(mask, x.add(t * ldx + i));
                }
                for ri in 0..R {
                    let wv = load_w_tail::<K>(w, (r + ri) * k + i, mask);
                    for t in 0..T {
                        acc[ri][t] = _mm512_fmadd_ps(wv, xv[t], acc[ri][t]);
                    }
                }
            }
            store_sums(&acc, out, ldo, r);
        }
    }
}

/// Prefetches `bytes` (a multiple of 64) from `p` with `HINT` (`_MM_HINT_T0`: into L1, for the
/// next row tile streamed linearly while this one is consumed as R interleaved rows;
/// `_MM_HINT_T1`: into L2, leaving L1's few miss buffers to the loads).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(crate) fn prefetch_lines<const HINT: i32>(p: *const u8, bytes: usize) {
    use std::arch::x86_64::_mm_prefetch;
    let mut line = 0;
    while line < bytes {
        // SAFETY: prefetch is a hint; it never faults, whatever the address.
        unsafe { _mm_prefetch::<HINT>(p.wrapping_add(line).cast()) };
        line += 64;
    }
}

/// Writes the horizontal sum of each accumulator to `out[t, r + ri]`.
///
/// # Safety
/// `out` must be valid for writes at `t * ldo + r + ri` for every t < T, ri < R; AVX-512F.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn store_sums<const R: usize, const T: usize>(
    acc: &[[std::arch::x86_64::__m512; T]; R],
    out: *mut f32,
    ldo: usize,
    r: usize,
) {
    for (ri, row) in acc.iter().enumerate() {
        for (t, a) in row.iter().enumerate() {
            // SAFETY: in bounds by the caller's contract.
            unsafe { *out.add(t * ldo + r + ri) = std::arch::x86_64::_mm512_reduce_add_ps(*a) };
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512_bf16_tile {
    use super::{prefetch_lines, store_sums};
    use std::arch::x86_64::*;

    /// bf16 weights, 32 at a time: one 64-byte load holds 16 (even, odd) pairs; a shift left by
    /// 16 yields the even elements as f32, masking the low half yields the odd ones. That is two
    /// cheap in-lane ops per 32 weights instead of two widening shuffles and two shifts, which on
    /// cores that split 512-bit ops in two is what keeps decode at memory speed. The activations
    /// arrive pre-split (`split_even_odd`): each 32-chunk stored as its 16 even then 16 odd
    /// values, zero-padded to a multiple of 32, `ldx` floats per token.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    pub(super) unsafe fn tile_bf16<const R: usize, const T: usize>(
        x: *const f32,
        ldx: usize,
        k: usize,
        w: *const u16,
        r: usize,
        out: *mut f32,
        ldo: usize,
    ) {
        // SAFETY: rows r..r+R of `w` (k elements each) and tokens 0..T of `x`/`out` are in bounds
        // (caller); masked loads never touch lanes beyond k; prefetches cannot fault.
        unsafe {
            let hi = _mm512_set1_epi32(0xffff_0000u32 as i32);
            let mut acc = [[_mm512_setzero_ps(); T]; R];
            let full = k / 32 * 32;
            let step_bytes = R * 64;
            let next = w.wrapping_add((r + R) * k).cast::<u8>();
            let mut i = 0;
            while i < k {
                let rem = k - i;
                let m32: __mmask32 = if i < full {
                    !0
                } else {
                    ((1u64 << rem) - 1) as u32
                };
                prefetch_lines::<_MM_HINT_T0>(next.wrapping_add(i / 32 * step_bytes), step_bytes);
                let mut xe = [_mm512_setzero_ps(); T];
                let mut xo = [_mm512_setzero_ps(); T];
                for t in 0..T {
                    xe[t] = _mm512_loadu_ps(x.add(t * ldx + i));
                    xo[t] = _mm512_loadu_ps(x.add(t * ldx + i + 16));
                }
                for ri in 0..R {
                    let wp = w.add((r + ri) * k + i).cast();
                    let wv = if i < full {
                        _mm512_loadu_si512(wp)
                    } else {
                        _mm512_maskz_loadu_epi16(m32, wp.cast())
                    };
                    let we = _mm512_castsi512_ps(_mm512_slli_epi32(wv, 16));
                    let wo = _mm512_castsi512_ps(_mm512_and_si512(wv, hi));
                    for t in 0..T {
                        acc[ri][t] = _mm512_fmadd_ps(we, xe[t], acc[ri][t]);
                        acc[ri][t] = _mm512_fmadd_ps(wo, xo[t], acc[ri][t]);
                    }
                }
                i += 32;
            }
            store_sums(&acc, out, ldo, r);
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512_bf16_dot {
    use super::{prefetch_lines, store_sums};
    use std::arch::x86_64::*;

    /// bf16 weights × bf16 activations, 32 per instruction: `vdpbf16ps` multiplies the (even,
    /// odd) pairs of each 32-bit lane and adds both products to that lane's f32 sum, so one
    /// 64-byte load of a weight row and one of a token feed 32 multiply-adds — half the
    /// instructions of widening to f32 and two FMAs. Activations were rounded to bf16 once per
    /// call (as llama.cpp's bf16 path does) and zero-padded to a multiple of 32 (`ldx` u16 per
    /// token); weight tails are masked loads.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
    pub(super) unsafe fn tile_dot<const R: usize, const T: usize>(
        x: *const u16,
        ldx: usize,
        k: usize,
        w: *const u16,
        r: usize,
        out: *mut f32,
        ldo: usize,
    ) {
        // SAFETY: rows r..r+R of `w` (k elements each) and tokens 0..T of `x` (ldx ≥ k rounded
        // up to 32) and `out` are in bounds (caller); masked loads never touch lanes beyond k;
        // prefetches cannot fault. The transmutes reinterpret 512 bits as 32 bf16 values.
        unsafe {
            let mut acc = [[_mm512_setzero_ps(); T]; R];
            let full = k / 32 * 32;
            let step_bytes = R * 64;
            let next = w.wrapping_add((r + R) * k).cast::<u8>();
            let mut i = 0;
            while i < k {
                // One token streams the weights past once: fetch the next rows into L1. More
                // tokens reuse a tile from L1 for every token tile (`rows_k`), and fetching the
                // next into L2 leaves L1's few miss buffers to the loads (LM head at 16 tokens:
                // +15% over L1 prefetches, on top of the loop order's +14%).
                let pf = next.wrapping_add(i / 32 * step_bytes);
                if T == 1 {
                    prefetch_lines::<_MM_HINT_T0>(pf, step_bytes);
                } else {
                    prefetch_lines::<_MM_HINT_T1>(pf, step_bytes);
                }
                let mut xv = [_mm512_setzero_si512(); T];
                for t in 0..T {
                    xv[t] = _mm512_loadu_si512(x.add(t * ldx + i).cast());
                }
                for ri in 0..R {
                    let wp = w.add((r + ri) * k + i);
                    let wv = if i < full {
                        _mm512_loadu_si512(wp.cast())
                    } else {
                        let m32: __mmask32 = ((1u64 << (k - i)) - 1) as u32;
                        _mm512_maskz_loadu_epi16(m32, wp.cast())
                    };
                    let wb: __m512bh = std::mem::transmute(wv);
                    for t in 0..T {
                        let xb: __m512bh = std::mem::transmute(xv[t]);
                        acc[ri][t] = _mm512_dpbf16_ps(acc[ri][t], wb, xb);
                    }
                }
                i += 32;
            }
            store_sums(&acc, out, ldo, r);
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::*;
    use std::arch::x86_64::*;

    const TT: usize = 3;
    const TR: usize = 4;
    const LANES: usize = 8;

    rows_driver!("avx2,fma,f16c");

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load_w<const K: u8>(w: *const u8, i: usize) -> __m256 {
        // SAFETY: the caller guarantees 8 elements at `i` are in bounds.
        unsafe {
            if K == KIND_F32 {
                _mm256_loadu_ps(w.cast::<f32>().add(i))
            } else {
                let v = _mm_loadu_si128(w.cast::<u16>().add(i).cast());
                if K == KIND_BF16 {
                    _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16))
                } else {
                    _mm256_cvtph_ps(v)
                }
            }
        }
    }

    /// A fixed-order horizontal sum of 8 lanes.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn hsum(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
        _mm_cvtss_f32(s)
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn tile<const K: u8, const R: usize, const T: usize>(
        x: *const f32,
        ldx: usize,
        k: usize,
        w: *const u8,
        r: usize,
        out: *mut f32,
        ldo: usize,
    ) {
        // SAFETY: rows r..r+R of `w` and tokens 0..T of `x`/`out` are in bounds (caller).
        unsafe {
            let mut acc = [[_mm256_setzero_ps(); T]; R];
            let full = k / LANES * LANES;
            let mut i = 0;
            while i < full {
                let mut xv = [_mm256_setzero_ps(); T];
                for t in 0..T {
                    xv[t] = _mm256_loadu_ps(x.add(t * ldx + i));
                }
                for ri in 0..R {
                    let wv = load_w::<K>(w, (r + ri) * k + i);
                    for t in 0..T {
                        acc[ri][t] = _mm256_fmadd_ps(wv, xv[t], acc[ri][t]);
                    }
                }
                i += LANES;
            }
            if full < k {
                // Tail: copy the last few values into zero-padded stack vectors.
                let rem = k - full;
                let esz = if K == KIND_F32 { 4 } else { 2 };
                let mut xv = [_mm256_setzero_ps(); T];
                for t in 0..T {
                    let mut buf = [0f32; LANES];
                    std::ptr::copy_nonoverlapping(x.add(t * ldx + i), buf.as_mut_ptr(), rem);
                    xv[t] = _mm256_loadu_ps(buf.as_ptr());
                }
                for ri in 0..R {
                    let mut buf = [0u8; LANES * 4];
                    std::ptr::copy_nonoverlapping(
                        w.add(((r + ri) * k + i) * esz),
                        buf.as_mut_ptr(),
                        rem * esz,
                    );
                    let wv = load_w::<K>(buf.as_ptr(), 0);
                    for t in 0..T {
                        acc[ri][t] = _mm256_fmadd_ps(wv, xv[t], acc[ri][t]);
                    }
                }
            }
            for ri in 0..R {
                for t in 0..T {
                    *out.add(t * ldo + r + ri) = hsum(acc[ri][t]);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::{bf16, f16};

    #[test]
    fn activation_copies_are_line_aligned_and_padded() {
        for (n, k) in [(1, 576), (3, 50), (17, 1536)] {
            let x: Vec<f32> = (0..n * k).map(|i| i as f32 * 0.25 - 3.0).collect();
            let (b, kp) = to_bf16_padded(&x, n, k);
            let (s, kp2) = split_even_odd(&x, n, k);
            assert_eq!((kp % 32, kp2), (0, kp));
            let (b, s) = (b.as_slice(), s.as_slice());
            assert_eq!((b.len(), s.len()), (n * kp, n * kp));
            assert_eq!(b.as_ptr() as usize % 64, 0);
            assert_eq!(s.as_ptr() as usize % 64, 0);
            for t in 0..n {
                for j in 0..kp {
                    let want = if j < k { x[t * k + j] } else { 0.0 };
                    assert_eq!(b[t * kp + j], bf16::from_f32(want).to_bits());
                    let (c, o) = (j / 32, j % 32);
                    assert_eq!(s[t * kp + c * 32 + (o % 2) * 16 + o / 2], want);
                }
            }
        }
    }

    struct Rng(u64);
    impl Rng {
        fn f(&mut self) -> f32 {
            self.0 = self
                .0
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((self.0 >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        }
    }

    #[test]
    fn matches_f64_reference_on_awkward_sizes() {
        let pool = ThreadPool::new(3);
        let mut rng = Rng(7);
        for &(n, rows, k) in &[
            (1, 1, 1),
            (1, 13, 17),
            (5, 7, 33),
            (7, 29, 15),
            (13, 67, 577),
            (1, 130, 64),
            (6, 8, 16),
            (2, 9, 31),
        ] {
            let x: Vec<f32> = (0..n * k).map(|_| rng.f()).collect();
            let wf: Vec<f32> = (0..rows * k).map(|_| rng.f()).collect();
            let wb: Vec<u16> = wf.iter().map(|&v| bf16::from_f32(v).to_bits()).collect();
            let wh: Vec<u16> = wf.iter().map(|&v| f16::from_f32(v).to_bits()).collect();
            type Exact<'a> = Box<dyn Fn(usize) -> f64 + 'a>;
            let variants: [(Weights, Exact); 3] = [
                (Weights::F32(&wf), Box::new(|i| wf[i] as f64)),
                (
                    Weights::Bf16(&wb),
                    Box::new(|i| bf16::from_bits(wb[i]).to_f64()),
                ),
                (
                    Weights::F16(&wh),
                    Box::new(|i| f16::from_bits(wh[i]).to_f64()),
                ),
            ];
            for (vi, (w, wval)) in variants.iter().enumerate() {
                for isa in Isa::available() {
                    // The BF16-dot path multiplies bf16 weights by activations rounded to bf16:
                    // its exact result is the sum over those rounded values.
                    let round_x = isa == Isa::Avx512Bf16 && vi == 1;
                    let xval = |i: usize| {
                        if round_x {
                            bf16::from_f32(x[i]).to_f64()
                        } else {
                            x[i] as f64
                        }
                    };
                    let m = Matrix::new(*w, rows, k);
                    let mut out = vec![0f32; n * rows];
                    let mut out2 = vec![0f32; n * rows];
                    matmul_with(isa, &pool, &x, n, &mut [(m, &mut out), (m, &mut out2)]);
                    assert_eq!(out, out2);
                    for t in 0..n {
                        for r in 0..rows {
                            let (mut want, mut mag) = (0f64, 0f64);
                            for i in 0..k {
                                let p = xval(t * k + i) * wval(r * k + i);
                                want += p;
                                mag += p.abs();
                            }
                            let got = out[t * rows + r] as f64;
                            assert!(
                                (got - want).abs() <= 1e-5 * mag + 1e-12,
                                "{isa:?} n{n} r{rows} k{k}: {got} vs {want}"
                            );
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn batch_invariant() {
        let pool = ThreadPool::new(2);
        let mut rng = Rng(11);
        let (rows, k) = (37, 100);
        let w: Vec<u16> = (0..rows * k)
            .map(|_| bf16::from_f32(rng.f()).to_bits())
            .collect();
        let m = Matrix::new(Weights::Bf16(&w), rows, k);
        let n = 150; // more than TOKEN_BLOCK: token-blocked tasks too
        let x: Vec<f32> = (0..n * k).map(|_| rng.f()).collect();
        for isa in Isa::available() {
            let mut all = vec![0f32; n * rows];
            matmul_with(isa, &pool, &x, n, &mut [(m, &mut all)]);
            for t in 0..n {
                let mut one = vec![0f32; rows];
                matmul_with(isa, &pool, &x[t * k..(t + 1) * k], 1, &mut [(m, &mut one)]);
                assert_eq!(
                    &all[t * rows..(t + 1) * rows],
                    &one[..],
                    "{isa:?} token {t}"
                );
            }
            // Any split of the tokens gives the same bits.
            let mut parts = vec![0f32; n * rows];
            for (a, b) in [(0, 4), (4, 9), (9, 13), (13, 100), (100, 150)] {
                matmul_with(
                    isa,
                    &pool,
                    &x[a * k..b * k],
                    b - a,
                    &mut [(m, &mut parts[a * rows..b * rows])],
                );
            }
            assert_eq!(all, parts);
        }
    }
}
