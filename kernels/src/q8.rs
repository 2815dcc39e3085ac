//! 8-bit weights (Q8_0, as GGUF defines it): each run of 32 weights of a row stored as 32 `i8`
//! and one f16 scale, so a matrix is 1.0625 bytes per weight instead of bf16's 2. Decode reads
//! every weight once per token, so this is nearly half the bytes per step on the memory-bound
//! path — and half the bytes a cold start moves.
//!
//! The product follows llama.cpp's Q8_0 × Q8_0: the activations are quantized per token to the
//! same 32-blocks (scale `max|x| / 127`), each block's dot product is exact in integers, and the
//! f32 result accumulates `isum · d_w · d_x` block by block. On AVX-512 each block's 32 `i8`
//! weights are widened to `i16` and multiplied with `vpmaddwd` against the activations (kept as
//! `i16`), giving 16 exact `i32` lane sums that are converted and scaled into 16 f32 lanes; the
//! scales of 16 blocks are widened and multiplied once per row and token. Every output is the
//! same lane-wise sequence in every tile shape (1 or 4 rows × 1–4 tokens), so results do not
//! depend on the batch (the crate's batch invariance).

use crate::{Isa, Matrix, Weights};

/// Weights per scale.
pub const BLOCK: usize = 32;

/// Quantizes a row-major `[rows, cols]` matrix (`cols` a multiple of [`BLOCK`]): the `i8` values
/// and each block's scale as f16 bits.
pub fn quantize(w: &[f32], rows: usize, cols: usize) -> (Vec<i8>, Vec<u16>) {
    assert!(
        cols.is_multiple_of(BLOCK),
        "Q8_0 needs rows of whole 32-blocks"
    );
    assert_eq!(w.len(), rows * cols);
    let mut qs = vec![0i8; w.len()];
    let mut scales = Vec::with_capacity(w.len() / BLOCK);
    for (blk, q) in w.chunks_exact(BLOCK).zip(qs.chunks_exact_mut(BLOCK)) {
        let amax = blk.iter().fold(0f32, |a, &v| a.max(v.abs()));
        let d = amax / 127.0;
        let id = if d > 0.0 { 1.0 / d } else { 0.0 };
        for (o, &v) in q.iter_mut().zip(blk) {
            *o = (v * id).round().clamp(-127.0, 127.0) as i8;
        }
        scales.push(half::f16::from_f32(d).to_bits());
    }
    (qs, scales)
}

/// The value of weight `j` of a Q8_0 row (`qs`, `scales` of that row).
pub fn dequantize_row(qs: &[i8], scales: &[u16], out: &mut [f32]) {
    for (j, o) in out.iter_mut().enumerate() {
        *o = qs[j] as f32 * half::f16::from_bits(scales[j / BLOCK]).to_f32();
    }
}

/// Activations quantized like the weights, one row per token, an f32 scale per 32-block, the
/// values in the form the kernel multiplies: `i16` (for `vpmaddwd`), or `u8` offset by 128 (for
/// `vpdpbusd`, which takes one unsigned operand: Σ (x + 128)·w − 128·Σ w = Σ x·w).
pub(crate) struct QInput {
    pub(crate) q: Vec<i16>,
    pub(crate) u: Vec<u8>,
    pub(crate) d: Vec<f32>,
}

/// Whether products on `isa` use `vpdpbusd` (AVX512-VNNI, present on every AVX512-BF16 CPU
/// there is; checked anyway).
pub(crate) fn uses_vnni(isa: Isa) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        static VNNI: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        isa == Isa::Avx512Bf16 && *VNNI.get_or_init(|| is_x86_feature_detected!("avx512vnni"))
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = isa;
        false
    }
}

pub(crate) fn quantize_input(x: &[f32], isa: Isa) -> QInput {
    let vnni = uses_vnni(isa);
    let (mut q, mut u) = if vnni {
        (Vec::new(), vec![0u8; x.len()])
    } else {
        (vec![0i16; x.len()], Vec::new())
    };
    let mut d = Vec::with_capacity(x.len() / BLOCK);
    for (b, blk) in x.chunks_exact(BLOCK).enumerate() {
        let amax = blk.iter().fold(0f32, |a, &v| a.max(v.abs()));
        let s = amax / 127.0;
        let id = if s > 0.0 { 1.0 / s } else { 0.0 };
        for (j, &v) in blk.iter().enumerate() {
            let qv = (v * id).round().clamp(-127.0, 127.0) as i16;
            if vnni {
                u[b * BLOCK + j] = (qv + 128) as u8;
            } else {
                q[b * BLOCK + j] = qv;
            }
        }
        d.push(s);
    }
    QInput { q, u, d }
}

/// One task's tokens of a [`QInput`].
pub(crate) struct QSlice<'a> {
    pub(crate) q: &'a [i16],
    pub(crate) u: &'a [u8],
    pub(crate) d: &'a [f32],
}

/// Output rows `r0..r1` for `n` tokens of quantized activations (`q`: `n · k` values, `d`:
/// `n · k / 32` scales).
///
/// # Safety
/// `out` must be valid for `n * ldo` f32 writes; `m` is a Q8_0 `[rows, k]` matrix, r1 ≤ rows.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn rows(
    isa: Isa,
    input: &QSlice<'_>,
    n: usize,
    k: usize,
    m: &Matrix<'_>,
    r0: usize,
    r1: usize,
    out: *mut f32,
    ldo: usize,
) {
    let Weights::Q8 { qs, scales } = m.w else {
        unreachable!("q8::rows takes Q8_0 matrices")
    };
    let (q, d) = (input.q, input.d);
    debug_assert!(d.len() >= n * k / BLOCK);
    #[cfg(target_arch = "x86_64")]
    if uses_vnni(isa) {
        // SAFETY: VNNI was detected; `input.u` holds these n tokens (quantized for this isa).
        return unsafe { vnni::rows(input.u, d, n, k, qs, scales, r0, r1, out, ldo) };
    }
    #[cfg(target_arch = "x86_64")]
    if matches!(isa, Isa::Avx512 | Isa::Avx512Bf16) {
        // SAFETY: Avx512* is only produced after feature detection; bounds as documented.
        return unsafe { avx512::rows(q, d, n, k, qs, scales, r0, r1, out, ldo) };
    }
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Avx2 {
        // SAFETY: Avx2 (with FMA and F16C) is only produced after feature detection.
        return unsafe { avx2::rows(q, d, n, k, qs, scales, r0, r1, out, ldo) };
    }
    let _ = isa;
    let nb = k / BLOCK;
    for t in 0..n {
        for r in r0..r1 {
            let mut acc = 0f32;
            for b in 0..nb {
                let (w, x) = (&qs[r * k + b * BLOCK..], &q[t * k + b * BLOCK..]);
                let isum: i32 = (0..BLOCK).map(|j| w[j] as i32 * x[j] as i32).sum();
                let s = half::f16::from_bits(scales[r * nb + b]).to_f32() * d[t * nb + b];
                acc += isum as f32 * s;
            }
            // SAFETY: t < n and r < ldo by the caller's contract.
            unsafe { *out.add(t * ldo + r) = acc };
        }
    }
}

/// The row-range driver of an AVX-512 Q8_0 module: row tiles of `TR` (then single rows) outside,
/// token tiles of up to `TT` inside, as the bf16 kernels (a tile's weights are read once and
/// reused from L1 by every token tile). `$x` is the activations' element type.
macro_rules! q8_rows_driver {
    ($feat:literal, $x:ty) => {
        const TT: usize = 4;
        const TR: usize = 4;

        #[target_feature(enable = $feat)]
        #[allow(clippy::too_many_arguments)]
        pub(super) unsafe fn rows(
            q: &[$x],
            d: &[f32],
            n: usize,
            k: usize,
            qs: &[i8],
            scales: &[u16],
            r0: usize,
            r1: usize,
            out: *mut f32,
            ldo: usize,
        ) {
            let (x, xd, w, ws) = (q.as_ptr(), d.as_ptr(), qs.as_ptr(), scales.as_ptr());
            // SAFETY (whole body): tiles stay inside rows r0..r1 and tokens 0..n (caller's
            // bounds).
            unsafe {
                let mut r = r0;
                while r < r1 {
                    let rows = if r + TR <= r1 { TR } else { 1 };
                    let mut t = 0;
                    while t < n {
                        let nt = (n - t).min(TT);
                        let (xt, dt, ot) =
                            (x.add(t * k), xd.add(t * (k / BLOCK)), out.add(t * ldo));
                        match (rows, nt) {
                            (TR, 1) => tile::<TR, 1>(xt, dt, k, w, ws, r, ot, ldo),
                            (TR, 2) => tile::<TR, 2>(xt, dt, k, w, ws, r, ot, ldo),
                            (TR, 3) => tile::<TR, 3>(xt, dt, k, w, ws, r, ot, ldo),
                            (TR, _) => tile::<TR, TT>(xt, dt, k, w, ws, r, ot, ldo),
                            (_, 1) => tile::<1, 1>(xt, dt, k, w, ws, r, ot, ldo),
                            (_, 2) => tile::<1, 2>(xt, dt, k, w, ws, r, ot, ldo),
                            (_, 3) => tile::<1, 3>(xt, dt, k, w, ws, r, ot, ldo),
                            (_, _) => tile::<1, TT>(xt, dt, k, w, ws, r, ot, ldo),
                        }
                        t += nt;
                    }
                    r += rows;
                }
            }
        }
    };
}

/// What the AVX-512 tiles share: the combined scales of a group of 16 blocks, and the final
/// reduction (inlined into the VNNI tiles too, whose features are a superset).
#[cfg(target_arch = "x86_64")]
mod avx512_common {
    use std::arch::x86_64::*;

    /// `d_w · d_x` of blocks `b .. b + 16` (fewer at a row's end: zeros beyond), per row of the
    /// tile and token.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    pub(super) unsafe fn group_scales<const R: usize, const T: usize>(
        ws: *const u16,
        xd: *const f32,
        nb: usize,
        r: usize,
        b: usize,
    ) -> [[__m512; T]; R] {
        let nbb = (nb - b).min(16);
        let mask: __mmask16 = if nbb == 16 {
            0xffff
        } else {
            ((1u32 << nbb) - 1) as u16
        };
        let mut scale = [[_mm512_setzero_ps(); T]; R];
        // SAFETY: the masked loads touch only blocks inside rows r..r+R's and the tokens'
        // scales (caller's bounds).
        unsafe {
            for ri in 0..R {
                let dw = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(
                    mask,
                    ws.add((r + ri) * nb + b).cast(),
                ));
                for t in 0..T {
                    let dx = _mm512_maskz_loadu_ps(mask, xd.add(t * nb + b));
                    scale[ri][t] = _mm512_mul_ps(dw, dx);
                }
            }
        }
        scale
    }

    /// Each accumulator's lane sum into `out[t * ldo + r + ri]`.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    pub(super) unsafe fn store<const R: usize, const T: usize>(
        acc: &[[__m512; T]; R],
        out: *mut f32,
        ldo: usize,
        r: usize,
    ) {
        for ri in 0..R {
            for t in 0..T {
                // SAFETY: in bounds by the caller's contract.
                unsafe { *out.add(t * ldo + r + ri) = _mm512_reduce_add_ps(acc[ri][t]) };
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::avx512_common::{group_scales, store};
    use super::BLOCK;
    use std::arch::x86_64::*;

    q8_rows_driver!("avx512f,avx512bw,avx512vl", i16);

    /// R weight rows starting at row `r` × T tokens.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    #[allow(clippy::too_many_arguments)]
    unsafe fn tile<const R: usize, const T: usize>(
        x: *const i16,
        xd: *const f32,
        k: usize,
        w: *const i8,
        ws: *const u16,
        r: usize,
        out: *mut f32,
        ldo: usize,
    ) {
        let nb = k / BLOCK;
        // SAFETY: rows r..r+R of the weights and tokens 0..T of `x`/`xd`/`out` are in bounds
        // (caller); masked loads touch only lanes inside the row's scales.
        unsafe {
            let mut acc = [[_mm512_setzero_ps(); T]; R];
            // The next row tile, prefetched linearly while this one is consumed as R rows.
            let next = w.wrapping_add((r + R) * k);
            let mut scale = [[[0f32; 16]; T]; R];
            let mut b0 = 0;
            while b0 < nb {
                let nbb = (nb - b0).min(16);
                // Combined scales of these (up to) 16 blocks, kept in memory for broadcasts.
                let sv = group_scales::<R, T>(ws, xd, nb, r, b0);
                for ri in 0..R {
                    for t in 0..T {
                        _mm512_storeu_ps(scale[ri][t].as_mut_ptr(), sv[ri][t]);
                    }
                }
                for j in 0..nbb {
                    let b = b0 + j;
                    let pf = next.wrapping_add(b * R * BLOCK);
                    let mut line = 0;
                    while line < R * BLOCK {
                        _mm_prefetch::<_MM_HINT_T0>(pf.wrapping_add(line).cast());
                        line += 64;
                    }
                    let mut xv = [_mm512_setzero_si512(); T];
                    for t in 0..T {
                        xv[t] = _mm512_loadu_si512(x.add(t * k + b * BLOCK).cast());
                    }
                    for ri in 0..R {
                        let wv = _mm512_cvtepi8_epi16(_mm256_loadu_si256(
                            w.add((r + ri) * k + b * BLOCK).cast(),
                        ));
                        for t in 0..T {
                            let p = _mm512_cvtepi32_ps(_mm512_madd_epi16(wv, xv[t]));
                            acc[ri][t] =
                                _mm512_fmadd_ps(p, _mm512_set1_ps(scale[ri][t][j]), acc[ri][t]);
                        }
                    }
                }
                b0 += nbb;
            }
            store(&acc, out, ldo, r);
        }
    }
}

/// AVX2: each block as two halves of 16 weights widened to `i16`, `vpmaddwd` against the
/// activations, the halves' 8 `i32` lanes added, converted and scaled — 4 rows per pass, one
/// token at a time (each output the same sequence whatever the batch).
#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::BLOCK;
    use std::arch::x86_64::*;

    #[target_feature(enable = "avx2,fma,f16c")]
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn rows(
        q: &[i16],
        d: &[f32],
        n: usize,
        k: usize,
        qs: &[i8],
        scales: &[u16],
        r0: usize,
        r1: usize,
        out: *mut f32,
        ldo: usize,
    ) {
        let nb = k / BLOCK;
        // SAFETY (whole body): rows r0..r1 and tokens 0..n are in bounds (caller).
        unsafe {
            let mut r = r0;
            while r < r1 {
                let rows = if r + 4 <= r1 { 4 } else { 1 };
                for t in 0..n {
                    let x = q.as_ptr().add(t * k);
                    let xd = d.as_ptr().add(t * nb);
                    if rows == 4 {
                        row_tile::<4>(x, xd, k, qs.as_ptr(), scales.as_ptr(), r, out.add(t * ldo));
                    } else {
                        row_tile::<1>(x, xd, k, qs.as_ptr(), scales.as_ptr(), r, out.add(t * ldo));
                    }
                }
                r += rows;
            }
        }
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn row_tile<const R: usize>(
        x: *const i16,
        xd: *const f32,
        k: usize,
        w: *const i8,
        ws: *const u16,
        r: usize,
        out: *mut f32,
    ) {
        let nb = k / BLOCK;
        // SAFETY: rows r..r+R and this token are in bounds (caller).
        unsafe {
            let mut acc = [_mm256_setzero_ps(); R];
            for b in 0..nb {
                let x0 = _mm256_loadu_si256(x.add(b * BLOCK).cast());
                let x1 = _mm256_loadu_si256(x.add(b * BLOCK + 16).cast());
                let dx = *xd.add(b);
                for ri in 0..R {
                    let p = w.add((r + ri) * k + b * BLOCK);
                    let w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128(p.cast()));
                    let w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128(p.add(16).cast()));
                    let isum =
                        _mm256_add_epi32(_mm256_madd_epi16(w0, x0), _mm256_madd_epi16(w1, x1));
                    let dw = _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(
                        *ws.add((r + ri) * nb + b) as i32,
                    )));
                    acc[ri] =
                        _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_set1_ps(dw * dx), acc[ri]);
                }
            }
            for ri in 0..R {
                let a = acc[ri];
                let s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
                let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
                let s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
                *out.add(r + ri) = _mm_cvtss_f32(s);
            }
        }
    }
}

/// `vpdpbusd`: 64 weights (two blocks) per instruction. The activations come offset by 128
/// (unsigned), so each pair of blocks starts its i32 lanes at −128·Σ w (one more `vpdpbusd`
/// per row, shared by the tile's tokens) and ends at the exact Σ x·w; lanes 0–7 hold the first
/// block, 8–15 the second, scaled by a permuted vector of the two blocks' scales.
#[cfg(target_arch = "x86_64")]
mod vnni {
    use super::avx512_common::{group_scales, store};
    use super::BLOCK;
    use std::arch::x86_64::*;

    q8_rows_driver!("avx512f,avx512bw,avx512vl,avx512vnni", u8);

    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
    #[allow(clippy::too_many_arguments)]
    unsafe fn tile<const R: usize, const T: usize>(
        x: *const u8,
        xd: *const f32,
        k: usize,
        w: *const i8,
        ws: *const u16,
        r: usize,
        out: *mut f32,
        ldo: usize,
    ) {
        let nb = k / BLOCK;
        // SAFETY: rows r..r+R and tokens 0..T are in bounds (caller); the masked loads of an odd
        // last block read only its 32 bytes.
        unsafe {
            let mut acc = [[_mm512_setzero_ps(); T]; R];
            let next = w.wrapping_add((r + R) * k);
            let c128 = _mm512_set1_epi8(-128i8);
            let zero = _mm512_setzero_si512();
            let mut scale = [[_mm512_setzero_ps(); T]; R];
            let mut b = 0;
            while b < nb {
                // Every 16 blocks: the combined scales d_w · d_x of the next 16, per row and token.
                if b % 16 == 0 {
                    scale = group_scales::<R, T>(ws, xd, nb, r, b);
                }
                let pair = (nb - b).min(2);
                let bmask: __mmask64 = if pair == 2 { u64::MAX } else { u32::MAX as u64 };
                // Lanes 0–7 take block b's scale, 8–15 block b + 1's (positions in the group).
                let j = (b % 16) as i32;
                let idx = _mm512_set_epi32(
                    j + 1,
                    j + 1,
                    j + 1,
                    j + 1,
                    j + 1,
                    j + 1,
                    j + 1,
                    j + 1,
                    j,
                    j,
                    j,
                    j,
                    j,
                    j,
                    j,
                    j,
                );
                let pf = next.wrapping_add(b * R * BLOCK);
                let mut line = 0;
                while line < 2 * R * BLOCK {
                    _mm_prefetch::<_MM_HINT_T0>(pf.wrapping_add(line).cast());
                    line += 64;
                }
                let mut xv = [zero; T];
                for t in 0..T {
                    xv[t] = _mm512_maskz_loadu_epi8(bmask, x.add(t * k + b * BLOCK).cast());
                }
                for ri in 0..R {
                    let wv = _mm512_maskz_loadu_epi8(bmask, w.add((r + ri) * k + b * BLOCK).cast());
                    // −128 · Σ w per 4 weights, the start of every token's lanes.
                    let base = _mm512_sub_epi32(zero, _mm512_dpbusd_epi32(zero, c128, wv));
                    for t in 0..T {
                        let isum = _mm512_dpbusd_epi32(base, xv[t], wv);
                        let sv = _mm512_permutexvar_ps(idx, scale[ri][t]);
                        acc[ri][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), sv, acc[ri][t]);
                    }
                }
                b += pair;
            }
            store(&acc, out, ldo, r);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{matmul_with, ThreadPool};

    fn rng(seed: &mut u64) -> f32 {
        *seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((*seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }

    /// What the product must be: each block's integer dot, scaled, in f64.
    fn reference(qs: &[i8], sc: &[u16], x: &[f32], n: usize, rows: usize, k: usize) -> Vec<f64> {
        let xq = quantize_input(x, Isa::Scalar);
        let nb = k / BLOCK;
        let mut out = vec![0f64; n * rows];
        for t in 0..n {
            for r in 0..rows {
                let mut acc = 0f64;
                for b in 0..nb {
                    let isum: i64 = (0..BLOCK)
                        .map(|j| {
                            qs[r * k + b * BLOCK + j] as i64 * xq.q[t * k + b * BLOCK + j] as i64
                        })
                        .sum();
                    acc += isum as f64
                        * half::f16::from_bits(sc[r * nb + b]).to_f32() as f64
                        * xq.d[t * nb + b] as f64;
                }
                out[t * rows + r] = acc;
            }
        }
        out
    }

    #[test]
    fn quantization_error_is_within_half_a_step() {
        let mut s = 3;
        let (rows, cols) = (5, 96);
        let w: Vec<f32> = (0..rows * cols).map(|_| rng(&mut s) * 3.0).collect();
        let (qs, sc) = quantize(&w, rows, cols);
        let mut back = vec![0f32; cols];
        for r in 0..rows {
            dequantize_row(&qs[r * cols..], &sc[r * cols / BLOCK..], &mut back);
            for j in 0..cols {
                // Rounded to the exact step, then scaled by its f16 rounding (as llama.cpp).
                let b = r * cols + j / BLOCK * BLOCK;
                let exact = w[b..b + BLOCK].iter().fold(0f32, |a, v| a.max(v.abs())) / 127.0;
                let d = half::f16::from_bits(sc[r * cols / BLOCK + j / BLOCK]).to_f32();
                let bound = 0.5 * exact + 127.0 * (d - exact).abs() + 1e-6;
                assert!((back[j] - w[r * cols + j]).abs() <= bound, "{r},{j}");
            }
        }
        // An all-zero block has scale 0 and values 0.
        let (q0, s0) = quantize(&[0.0; 32], 1, 32);
        assert!(q0.iter().all(|&v| v == 0) && s0 == vec![0]);
    }

    #[test]
    fn products_match_the_block_reference_and_do_not_depend_on_the_batch() {
        let pool = ThreadPool::new(3);
        let mut s = 11;
        // Odd row counts (1-row tiles), block counts not a multiple of 16 (masked scales).
        for (rows, k) in [(7, 32), (13, 576), (9, 1536 + 64)] {
            let w: Vec<f32> = (0..rows * k).map(|_| rng(&mut s)).collect();
            let (qs, sc) = quantize(&w, rows, k);
            let m = Matrix::new(
                Weights::Q8 {
                    qs: &qs,
                    scales: &sc,
                },
                rows,
                k,
            );
            let n = 9;
            let x: Vec<f32> = (0..n * k).map(|_| rng(&mut s) * 2.0).collect();
            let want = reference(&qs, &sc, &x, n, rows, k);
            for isa in Isa::available() {
                let mut out = vec![0f32; n * rows];
                matmul_with(isa, &pool, &x, n, &mut [(m, &mut out)]);
                for (i, (&g, &e)) in out.iter().zip(&want).enumerate() {
                    assert!(
                        ((g as f64) - e).abs() <= 1e-4 * (1.0 + e.abs()),
                        "{isa:?} {rows}x{k} [{i}]: {g} vs {e}"
                    );
                }
                // Each token alone gives bit-identical outputs (batch invariance).
                for t in [0, 4, 8] {
                    let mut one = vec![0f32; rows];
                    matmul_with(isa, &pool, &x[t * k..(t + 1) * k], 1, &mut [(m, &mut one)]);
                    assert_eq!(one, out[t * rows..(t + 1) * rows], "{isa:?} token {t}");
                }
            }
        }
    }
}
