//! Elementwise, normalization and attention kernels on f32 rows.
//!
//! Reductions use 16 independent lane accumulators combined in a fixed order: LLVM vectorizes that
//! shape without needing to reassociate, and the result is the same for a row whatever batch it
//! came in.

use crate::{Isa, ThreadPool};

/// Compiles a generic (`#[inline(always)]`) body three times — AVX-512, AVX2+FMA and baseline —
/// and picks one at run time. The lane-array code is written so every version performs the same
/// operations in the same order (Rust never fuses a multiply and an add on its own), so results
/// are bit-identical across versions; only the vector width changes.
macro_rules! multiversion {
    ($vis:vis fn $name:ident($($arg:ident: $ty:ty),*) $(-> $ret:ty)? => $generic:ident) => {
        $vis fn $name($($arg: $ty),*) $(-> $ret)? {
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
                unsafe fn avx512($($arg: $ty),*) $(-> $ret)? { $generic($($arg),*) }
                #[target_feature(enable = "avx2,fma")]
                unsafe fn avx2($($arg: $ty),*) $(-> $ret)? { $generic($($arg),*) }
                match Isa::detect() {
                    // SAFETY: Isa::detect reports only features this CPU has.
                    Isa::Avx512 | Isa::Avx512Bf16 => return unsafe { avx512($($arg),*) },
                    // SAFETY: as above.
                    Isa::Avx2 => return unsafe { avx2($($arg),*) },
                    Isa::Scalar => {}
                }
            }
            $generic($($arg),*)
        }
    };
}

const L: usize = 16;

#[inline(always)]
fn combine(acc: [f32; L]) -> f32 {
    // Fixed pairwise tree.
    let mut a = acc;
    let mut w = L / 2;
    while w > 0 {
        for i in 0..w {
            a[i] += a[i + w];
        }
        w /= 2;
    }
    a[0]
}

/// Dot product with lane accumulators (deterministic order).
#[inline(always)]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    let mut acc = [0f32; L];
    let (ca, cb) = (a.chunks_exact(L), b.chunks_exact(L));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for l in 0..L {
            acc[l] += x[l] * y[l];
        }
    }
    for (l, (x, y)) in ra.iter().zip(rb).enumerate() {
        acc[l] += x * y;
    }
    combine(acc)
}

multiversion!(pub fn rmsnorm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) => rmsnorm_generic);

/// `out = x / sqrt(mean(x²) + eps) * weight`, row by row (`x` is `[n, d]`).
#[inline(always)]
fn rmsnorm_generic(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let d = weight.len();
    assert_eq!(x.len(), out.len());
    assert_eq!(x.len() % d, 0);
    for (xr, or) in x.chunks_exact(d).zip(out.chunks_exact_mut(d)) {
        let ss = dot(xr, xr);
        let scale = 1.0 / (ss / d as f32 + eps).sqrt();
        for ((o, &v), &w) in or.iter_mut().zip(xr).zip(weight) {
            *o = v * scale * w;
        }
    }
}

/// `a += b`.
pub fn add_inplace(a: &mut [f32], b: &[f32]) {
    assert_eq!(a.len(), b.len());
    a.iter_mut().zip(b).for_each(|(x, y)| *x += y);
}

multiversion!(pub fn silu_mul(gate: &mut [f32], up: &[f32]) => silu_mul_generic);

/// `gate = silu(gate) * up` in place, with `silu(g) = g / (1 + e^-g)`.
#[inline(always)]
fn silu_mul_generic(gate: &mut [f32], up: &[f32]) {
    assert_eq!(gate.len(), up.len());
    for (g, &u) in gate.iter_mut().zip(up) {
        *g = *g / (1.0 + exp_approx(-*g)) * u;
    }
}

/// In-place softmax of one row.
pub fn softmax(x: &mut [f32]) {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0f32;
    x.iter_mut().for_each(|v| *v -= max);
    exp_inplace(x);
    for v in x.iter() {
        sum += *v;
    }
    let inv = 1.0 / sum;
    x.iter_mut().for_each(|v| *v *= inv);
}

/// Rotary-embedding angles for one position: `cos`/`sin` of `pos · inv_freq[i]`, computed in f64.
pub fn rope_angles(pos: usize, inv_freq: &[f64], cos: &mut [f32], sin: &mut [f32]) {
    for ((c, s), &f) in cos.iter_mut().zip(sin.iter_mut()).zip(inv_freq) {
        let a = pos as f64 * f;
        *c = a.cos() as f32;
        *s = a.sin() as f32;
    }
}

/// Hugging Face "rotate half" RoPE on `x` (`[heads, head_dim]`) with one position's angles
/// (`head_dim / 2` each): the pair `(x[i], x[i + half])` is rotated by angle `i`.
pub fn rope(x: &mut [f32], head_dim: usize, cos: &[f32], sin: &[f32]) {
    let half = head_dim / 2;
    assert_eq!(cos.len(), half);
    for h in x.chunks_exact_mut(head_dim) {
        let (a, b) = h.split_at_mut(half);
        for i in 0..half {
            let (x1, x2) = (a[i], b[i]);
            a[i] = x1 * cos[i] - x2 * sin[i];
            b[i] = x2 * cos[i] + x1 * sin[i];
        }
    }
}

/// Shapes for [`paged_attention`].
#[derive(Clone, Copy, Debug)]
pub struct AttnShape {
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
}

/// One query row of [`paged_attention`]: its position and its sequence's block table.
#[derive(Clone, Copy, Debug)]
pub struct PagedRow<'a> {
    pub pos: usize,
    pub table: &'a [u32],
}

/// Where one layer's keys and values sit in a paged store: block `b`, slot `s`, KV head `h`
/// starts at `b · block_stride + layer_off + s · kv_dim + h · head_dim`.
#[derive(Clone, Copy, Debug)]
pub struct PagedStore {
    pub block_size: usize,
    pub block_stride: usize,
    pub layer_off: usize,
}

/// Causal GQA attention for query rows of any number of sequences, each reading its keys and
/// values through its block table (positions `0..=pos`). Each (row, head) is one [`attend_one`],
/// so batching and paging change no bits.
#[allow(clippy::too_many_arguments)]
pub fn paged_attention(
    pool: &ThreadPool,
    q: &[f32],
    k: KvData<'_>,
    v: KvData<'_>,
    rows: &[PagedRow<'_>],
    store: PagedStore,
    s: AttnShape,
    out: &mut [f32],
) {
    let (hd, nh, nkv) = (s.head_dim, s.n_heads, s.n_kv_heads);
    let n = rows.len();
    assert!(nh % nkv == 0);
    assert_eq!(q.len(), n * nh * hd);
    assert_eq!(out.len(), n * nh * hd);
    for r in rows {
        assert!(
            r.table.len() * store.block_size > r.pos,
            "block table too short for position {}",
            r.pos
        );
    }
    let group = nh / nkv;
    let scale = 1.0 / (hd as f32).sqrt();
    let out_ptr = SyncPtr(out.as_mut_ptr());
    let job = |task: usize| {
        let (t, kvh) = (task / nkv, task % nkv);
        let h = kvh * group;
        let qr = &q[(t * nh + h) * hd..(t * nh + h + group) * hd];
        let layout = KvLayout::Paged {
            table: rows[t].table,
            block_size: store.block_size,
            block_stride: store.block_stride,
            stride: nkv * hd,
            off: store.layer_off + kvh * hd,
        };
        // SAFETY: each task writes the disjoint rows (t, h..h + group) of `out`, whose bounds
        // were asserted.
        let o = unsafe {
            std::slice::from_raw_parts_mut(out_ptr.get().add((t * nh + h) * hd), group * hd)
        };
        match (k, v) {
            (KvData::F32(k), KvData::F32(v)) => {
                attend_group(qr, hd, k, v, rows[t].pos + 1, layout, scale, o)
            }
            (KvData::Bf16(k), KvData::Bf16(v)) => {
                attend_group(qr, hd, k, v, rows[t].pos + 1, layout, scale, o)
            }
            _ => panic!("keys and values must share one storage type"),
        }
    };
    pool.run(n * nkv, &job);
}

/// Keys per attention block. Blocks start at absolute positions 0, B, 2B, … so a query's result
/// depends only on its own position, never on how many queries share the call.
pub const ATTN_BLOCK: usize = 64;

/// Where key/value row `j` of one KV head starts in the K and V storage.
#[derive(Clone, Copy, Debug)]
pub enum KvLayout<'a> {
    /// Row `j` at `j · stride + off`.
    Contiguous { stride: usize, off: usize },
    /// Paged: row `j` is slot `j % block_size` of block `table[j / block_size]`, at
    /// `table[..] · block_stride + slot · stride + off`.
    Paged {
        table: &'a [u32],
        block_size: usize,
        block_stride: usize,
        stride: usize,
        off: usize,
    },
}

impl KvLayout<'_> {
    #[inline(always)]
    pub fn row(&self, j: usize) -> usize {
        match *self {
            KvLayout::Contiguous { stride, off } => j * stride + off,
            KvLayout::Paged {
                table,
                block_size,
                block_stride,
                stride,
                off,
            } => table[j / block_size] as usize * block_stride + (j % block_size) * stride + off,
        }
    }
}

/// The key/value store's element: f32, or bf16 bits (half the bytes to stream per step).
#[derive(Clone, Copy, Debug)]
pub enum KvData<'a> {
    F32(&'a [f32]),
    Bf16(&'a [u16]),
}

/// An element type the attention kernels read keys and values as.
pub trait KvElem: Copy + Send + Sync + 'static {
    fn to_f32(self) -> f32;
    /// 16 values at `p`, widened to f32.
    ///
    /// # Safety
    /// 16 elements at `p` must be readable; AVX-512F must be available.
    #[cfg(target_arch = "x86_64")]
    unsafe fn load16(p: *const Self) -> std::arch::x86_64::__m512;
}

impl KvElem for f32 {
    fn to_f32(self) -> f32 {
        self
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load16(p: *const f32) -> std::arch::x86_64::__m512 {
        // SAFETY: the caller's contract.
        unsafe { std::arch::x86_64::_mm512_loadu_ps(p) }
    }
}

impl KvElem for u16 {
    fn to_f32(self) -> f32 {
        f32::from_bits((self as u32) << 16)
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load16(p: *const u16) -> std::arch::x86_64::__m512 {
        use std::arch::x86_64::*;
        // SAFETY: the caller's contract; bf16 → f32 is the bits shifted into the high half.
        unsafe {
            _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(
                _mm256_loadu_si256(p.cast()),
            )))
        }
    }
}

/// The `g = qs.len() / hd` query heads that share one KV head (GQA), one query row, against
/// `visible` keys: each key and value row is loaded once for the whole group. Per head the
/// result is what [`attend_one`] gives (for f32 storage; bf16 storage is the same arithmetic on
/// the widened values).
#[allow(clippy::too_many_arguments)]
pub fn attend_group<E: KvElem>(
    qs: &[f32],
    hd: usize,
    k: &[E],
    v: &[E],
    visible: usize,
    layout: KvLayout<'_>,
    scale: f32,
    out: &mut [f32],
) {
    let g = qs.len() / hd;
    assert_eq!(qs.len(), g * hd);
    assert_eq!(out.len(), g * hd);
    #[cfg(target_arch = "x86_64")]
    if Isa::detect().avx512() && (hd == 64 || hd == 128) {
        // Heads per pass: the group's output accumulators (heads × hd/16 registers) must stay
        // in the 32 vector registers next to the value row being read.
        let per = if hd == 64 { 4 } else { 3 };
        let mut h = 0;
        while h < g {
            let c = (g - h).min(per);
            let (q, o) = (&qs[h * hd..(h + c) * hd], &mut out[h * hd..(h + c) * hd]);
            // SAFETY: AVX-512 was detected; shapes match the const parameters.
            unsafe {
                match (hd, c) {
                    (64, 1) => simd::group::<4, 1, E>(q, k, v, visible, &layout, scale, o),
                    (64, 2) => simd::group::<4, 2, E>(q, k, v, visible, &layout, scale, o),
                    (64, 3) => simd::group::<4, 3, E>(q, k, v, visible, &layout, scale, o),
                    (64, _) => simd::group::<4, 4, E>(q, k, v, visible, &layout, scale, o),
                    (_, 1) => simd::group::<8, 1, E>(q, k, v, visible, &layout, scale, o),
                    (_, 2) => simd::group::<8, 2, E>(q, k, v, visible, &layout, scale, o),
                    _ => simd::group::<8, 3, E>(q, k, v, visible, &layout, scale, o),
                }
            }
            h += c;
        }
        return;
    }
    // Other paths work on f32 rows: widen this sequence's visible rows (bf16 storage) into
    // contiguous buffers first.
    let (kf, vf, lay): (
        std::borrow::Cow<'_, [f32]>,
        std::borrow::Cow<'_, [f32]>,
        KvLayout<'_>,
    ) = match (as_f32(k), as_f32(v)) {
        (Some(k), Some(v)) => (k.into(), v.into(), layout),
        _ => {
            let widen = |src: &[E]| -> Vec<f32> {
                (0..visible)
                    .flat_map(|j| {
                        let r = layout.row(j);
                        src[r..r + hd].iter().map(|x| x.to_f32())
                    })
                    .collect()
            };
            (
                widen(k).into(),
                widen(v).into(),
                KvLayout::Contiguous { stride: hd, off: 0 },
            )
        }
    };
    for h in 0..g {
        attend_one(
            &qs[h * hd..(h + 1) * hd],
            &kf,
            &vf,
            visible,
            lay,
            scale,
            &mut out[h * hd..(h + 1) * hd],
        );
    }
}

/// `x` as f32 if `E` is f32.
fn as_f32<E: KvElem>(x: &[E]) -> Option<&[f32]> {
    if std::any::TypeId::of::<E>() == std::any::TypeId::of::<f32>() {
        // SAFETY: E is f32 (checked just above), so the slice is a &[f32].
        Some(unsafe { std::slice::from_raw_parts(x.as_ptr().cast::<f32>(), x.len()) })
    } else {
        None
    }
}

/// One query row against `visible` keys (see [`attend_one_with`]), on the best SIMD path.
pub fn attend_one(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    visible: usize,
    layout: KvLayout<'_>,
    scale: f32,
    out: &mut [f32],
) {
    #[cfg(target_arch = "x86_64")]
    {
        #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
        unsafe fn avx512(
            q: &[f32],
            k: &[f32],
            v: &[f32],
            visible: usize,
            layout: KvLayout<'_>,
            scale: f32,
            out: &mut [f32],
        ) {
            match q.len() {
                // SAFETY (both): this function only runs where AVX-512 was detected.
                64 => unsafe { simd::group::<4, 1, f32>(q, k, v, visible, &layout, scale, out) },
                128 => unsafe { simd::group::<8, 1, f32>(q, k, v, visible, &layout, scale, out) },
                _ => attend_one_generic(q, k, v, visible, layout, scale, out),
            }
        }
        #[target_feature(enable = "avx2,fma")]
        unsafe fn avx2(
            q: &[f32],
            k: &[f32],
            v: &[f32],
            visible: usize,
            layout: KvLayout<'_>,
            scale: f32,
            out: &mut [f32],
        ) {
            attend_one_generic(q, k, v, visible, layout, scale, out)
        }
        match Isa::detect() {
            // SAFETY: Isa::detect reports only features this CPU has.
            Isa::Avx512 | Isa::Avx512Bf16 => {
                return unsafe { avx512(q, k, v, visible, layout, scale, out) }
            }
            // SAFETY: as above.
            Isa::Avx2 => return unsafe { avx2(q, k, v, visible, layout, scale, out) },
            Isa::Scalar => {}
        }
    }
    attend_one_generic(q, k, v, visible, layout, scale, out)
}

#[inline(always)]
fn attend_one_generic(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    visible: usize,
    layout: KvLayout<'_>,
    scale: f32,
    out: &mut [f32],
) {
    attend_one_with(
        scores_generic,
        accum_values,
        q,
        k,
        v,
        visible,
        layout,
        scale,
        out,
    )
}

/// `s[j] = q · k[row(first + j)]` for every `j < s.len()`.
#[inline(always)]
fn scores_generic(q: &[f32], k: &[f32], first: usize, layout: &KvLayout<'_>, s: &mut [f32]) {
    let hd = q.len();
    for (j, sj) in s.iter_mut().enumerate() {
        let row = layout.row(first + j);
        *sj = dot(q, &k[row..row + hd]);
    }
}

/// `out += Σ_j p[j] · v[row(first + j)][..out.len()]`, one multiply and one add per element per
/// key, keys in order.
#[inline(always)]
fn accum_values(out: &mut [f32], p: &[f32], v: &[f32], first: usize, layout: &KvLayout<'_>) {
    let hd = out.len();
    for (j, &pj) in p.iter().enumerate() {
        let row = layout.row(first + j);
        for (o, &x) in out.iter_mut().zip(&v[row..row + hd]) {
            *o += pj * x;
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod simd {
    use super::KvLayout;
    use std::arch::x86_64::*;

    /// [`super::attend_group`] for `G` heads of head_dim `16 N`: flash-style online softmax
    /// over blocks of [`super::ATTN_BLOCK`] keys starting at absolute positions, as
    /// [`super::attend_one_with`] does, with each key row and value row loaded once for all `G`
    /// heads and the `G` output rows kept in registers across the whole sequence.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn group<const N: usize, const G: usize, E: super::KvElem>(
        q: &[f32],
        k: &[E],
        v: &[E],
        visible: usize,
        layout: &KvLayout<'_>,
        scale: f32,
        out: &mut [f32],
    ) {
        use super::{combine, exp_approx, exp_inplace, ATTN_BLOCK, L};
        assert_eq!(q.len(), G * N * 16);
        assert_eq!(out.len(), G * N * 16);
        // SAFETY: every key/value row is bounds-checked before it is read; stores stay inside
        // `s` (masked) and `out` (G × N × 16 values).
        unsafe {
            let mut m = [f32::NEG_INFINITY; G];
            let mut l = [0f32; G];
            let mut s = [[0f32; ATTN_BLOCK]; G];
            let zero = _mm512_setzero_ps();
            let mut acc = [[zero; N]; G];
            // The group's queries, loaded once: in registers they spare the score loop G·N
            // loads a key (it was bound by loads, not multiplies).
            let mut qv = [[_mm512_setzero_ps(); N]; G];
            for g in 0..G {
                for i in 0..N {
                    qv[g][i] = _mm512_loadu_ps(q.as_ptr().add((g * N + i) * 16));
                }
            }
            let mut b = 0;
            while b < visible {
                let e = (b + ATTN_BLOCK).min(visible);
                let len = e - b;
                // Scores, 16 keys at a time. Each key's G dot-product vectors are folded into
                // the reduction tree as soon as its pair, then its quad, is complete: holding
                // all 16 keys' vectors (16 G of them) spilled them and the queries to the
                // stack. The tree's pairings do not depend on when each fold runs.
                let mut j0 = 0;
                while j0 < len {
                    let cnt = (len - j0).min(16);
                    let (mut quad0, mut keys8, mut sums) = ([zero; G], [zero; G], [zero; G]);
                    for quad in 0..4 {
                        let mut pairs = [[zero; G]; 2];
                        for (pi, pair) in pairs.iter_mut().enumerate() {
                            let j = quad * 4 + pi * 2;
                            let a = key_dots::<N, G, E>(
                                &qv,
                                k,
                                v,
                                layout,
                                visible,
                                b + j0 + j,
                                j < cnt,
                            );
                            let c = key_dots::<N, G, E>(
                                &qv,
                                k,
                                v,
                                layout,
                                visible,
                                b + j0 + j + 1,
                                j + 1 < cnt,
                            );
                            for g in 0..G {
                                pair[g] = fold_pairs(a[g], c[g]);
                            }
                        }
                        for g in 0..G {
                            let u = fold_quads(pairs[0][g], pairs[1][g]);
                            match quad {
                                0 | 2 => quad0[g] = u,
                                1 => keys8[g] = fold_lanes(quad0[g], u),
                                _ => sums[g] = fold_lanes(keys8[g], fold_lanes(quad0[g], u)),
                            }
                        }
                    }
                    let mask: __mmask16 = if cnt == 16 {
                        !0
                    } else {
                        ((1u32 << cnt) - 1) as u16
                    };
                    for g in 0..G {
                        _mm512_mask_storeu_ps(s[g].as_mut_ptr().add(j0), mask, sums[g]);
                    }
                    j0 += 16;
                }
                // Online softmax bookkeeping, per head (the same steps as attend_one_with).
                for g in 0..G {
                    let sb = &mut s[g][..len];
                    sb.iter_mut().for_each(|x| *x *= scale);
                    let bm = sb.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                    let m_new = m[g].max(bm);
                    let c = if m[g] == f32::NEG_INFINITY {
                        0.0
                    } else {
                        exp_approx(m[g] - m_new)
                    };
                    sb.iter_mut().for_each(|x| *x -= m_new);
                    exp_inplace(sb);
                    let mut lanes = [0f32; L];
                    for (i, &p) in sb.iter().enumerate() {
                        lanes[i % L] += p;
                    }
                    l[g] = l[g] * c + combine(lanes);
                    m[g] = m_new;
                    let cv = _mm512_set1_ps(c);
                    for i in 0..N {
                        acc[g][i] = _mm512_mul_ps(acc[g][i], cv);
                    }
                }
                // Values: each row loaded once, accumulated into every head's output.
                for j in 0..len {
                    let vc = load_row::<N, E>(v, layout.row(b + j));
                    for g in 0..G {
                        let p = _mm512_set1_ps(s[g][j]);
                        for i in 0..N {
                            acc[g][i] = _mm512_fmadd_ps(p, vc[i], acc[g][i]);
                        }
                    }
                }
                b = e;
            }
            for g in 0..G {
                let inv = _mm512_set1_ps(1.0 / l[g]);
                for i in 0..N {
                    _mm512_storeu_ps(
                        out.as_mut_ptr().add((g * N + i) * 16),
                        _mm512_mul_ps(acc[g][i], inv),
                    );
                }
            }
        }
    }

    /// The `16 N` floats of a key or value row starting at `at` (bounds-checked).
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    unsafe fn load_row<const N: usize, E: super::KvElem>(buf: &[E], at: usize) -> [__m512; N] {
        assert!(at + N * 16 <= buf.len(), "KV row out of bounds");
        let mut r = [_mm512_setzero_ps(); N];
        for (i, x) in r.iter_mut().enumerate() {
            // SAFETY: at + 16 i + 16 <= buf.len(), checked above; AVX-512 is enabled here.
            *x = unsafe { E::load16(buf.as_ptr().add(at + 16 * i)) };
        }
        r
    }

    /// Asks for the cache lines of the `16 N` elements at `at` to be brought into L2 (a hint:
    /// never faults).
    #[inline(always)]
    fn prefetch_row_l2<const N: usize, E>(buf: &[E], at: usize) {
        crate::matmul::prefetch_lines::<_MM_HINT_T1>(
            buf.as_ptr().wrapping_add(at).cast(),
            N * 16 * std::mem::size_of::<E>(),
        );
    }

    /// Key `j`'s dot product with each of the `G` queries, as 16 lane partial sums each (zeros
    /// when `valid` is false: a key past the block, read by nobody). Also asks for the key and
    /// value rows one attention block ahead: rows of one KV head are strided and their blocks
    /// scattered, which the hardware prefetcher does not follow, so they are fetched into L2
    /// (L1's few miss buffers stay free for the loads).
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    unsafe fn key_dots<const N: usize, const G: usize, E: super::KvElem>(
        qv: &[[__m512; N]; G],
        k: &[E],
        v: &[E],
        layout: &KvLayout<'_>,
        visible: usize,
        j: usize,
        valid: bool,
    ) -> [__m512; G] {
        let mut d = [_mm512_setzero_ps(); G];
        if !valid {
            return d;
        }
        let ahead = j + super::ATTN_BLOCK;
        if ahead < visible {
            prefetch_row_l2::<N, E>(k, layout.row(ahead));
            prefetch_row_l2::<N, E>(v, layout.row(ahead));
        }
        // SAFETY: load_row bounds-checks the row; AVX-512 is enabled in the caller.
        unsafe {
            let kc = load_row::<N, E>(k, layout.row(j));
            for g in 0..G {
                let mut a = _mm512_mul_ps(qv[g][0], kc[0]);
                for i in 1..N {
                    a = _mm512_fmadd_ps(qv[g][i], kc[i], a);
                }
                d[g] = a;
            }
        }
        d
    }

    // The reduction tree that turns 16 vectors v[0..16] into one whose lane j is the sum of
    // v[j]'s lanes, in three folds: `fold_pairs` of (v[2i], v[2i+1]), `fold_quads` of two
    // pairs, `fold_lanes` of two quads, then of the two eights. Its pairings are the ones
    // `attend_one`'s scores use, so a group's scores are each head's alone to the bit.

    /// Per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3].
    #[inline(always)]
    unsafe fn fold_pairs(a: __m512, b: __m512) -> __m512 {
        // SAFETY: AVX-512 is enabled in the caller.
        unsafe { _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b)) }
    }

    /// Per 128-bit lane L: the sums of elements 4L..4L+3 of the four vectors under `a`, `b`.
    #[inline(always)]
    unsafe fn fold_quads(a: __m512, b: __m512) -> __m512 {
        // SAFETY: AVX-512 is enabled in the caller.
        unsafe {
            let (a, b) = (_mm512_castps_pd(a), _mm512_castps_pd(b));
            _mm512_add_ps(
                _mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)),
            )
        }
    }

    /// Across the four 128-bit lanes of two folds.
    #[inline(always)]
    unsafe fn fold_lanes(a: __m512, b: __m512) -> __m512 {
        // SAFETY: AVX-512 is enabled in the caller.
        unsafe {
            _mm512_add_ps(
                _mm512_shuffle_f32x4::<0b10_00_10_00>(a, b),
                _mm512_shuffle_f32x4::<0b11_01_11_01>(a, b),
            )
        }
    }
}

/// One query row against `visible` keys: flash-style online softmax over blocks of keys — scores
/// of a block, one rescale of the running output per block, exponentials vectorized. Key blocks
/// start at absolute positions (multiples of [`ATTN_BLOCK`]) and every step is per query row, so
/// the result depends only on the row's own position and the keys' values — not on the batch,
/// the chunking of the prompt, or where the KV rows are stored.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn attend_one_with(
    scores: impl Fn(&[f32], &[f32], usize, &KvLayout<'_>, &mut [f32]),
    accum: impl Fn(&mut [f32], &[f32], &[f32], usize, &KvLayout<'_>),
    q: &[f32],
    k: &[f32],
    v: &[f32],
    visible: usize,
    layout: KvLayout<'_>,
    scale: f32,
    out: &mut [f32],
) {
    let mut m = f32::NEG_INFINITY;
    let mut l = 0f32;
    let mut s = [0f32; ATTN_BLOCK];
    out.iter_mut().for_each(|o| *o = 0.0);
    let mut b = 0;
    while b < visible {
        let e = (b + ATTN_BLOCK).min(visible);
        let sb = &mut s[..e - b];
        scores(q, k, b, &layout, sb);
        sb.iter_mut().for_each(|x| *x *= scale);
        let bm = sb.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let m_new = m.max(bm);
        let c = if m == f32::NEG_INFINITY {
            0.0
        } else {
            exp_approx(m - m_new)
        };
        sb.iter_mut().for_each(|x| *x -= m_new);
        exp_inplace(sb);
        let mut lanes = [0f32; L];
        for (i, &p) in sb.iter().enumerate() {
            lanes[i % L] += p;
        }
        l = l * c + combine(lanes);
        out.iter_mut().for_each(|o| *o *= c);
        accum(out, sb, v, b, &layout);
        m = m_new;
        b = e;
    }
    let inv = 1.0 / l;
    out.iter_mut().for_each(|o| *o *= inv);
}

/// `e^x` to within ~2 ulp for the range softmax needs, written so LLVM vectorizes it: split
/// `x = n·ln2 + r` with `|r| ≤ ln2/2`, a degree-6 polynomial for `e^r`, then scale by `2^n` through
/// the exponent bits. Inputs below −87 flush to 0.
#[inline(always)]
pub fn exp_approx(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    let x = x.clamp(-87.0, 88.0);
    let n = (x * LOG2E).round();
    let r = x - n * LN2_HI - n * LN2_LO;
    let p = 1.0
        + r * (1.0
            + r * (0.5
                + r * (0.166_666_67
                    + r * (0.041_666_668 + r * (0.008_333_452 + r * 0.001_388_975_7)))));
    // 2^n from n's bits: n is a whole number in [-126, 127] (x was clamped), so n + 1.5·2^23 is
    // exact and its low mantissa bits hold n. The same value as `(n as i32 + 127) << 23`, but
    // `as i32` is a saturating conversion LLVM does one lane at a time (`vcvttss2si` and
    // inserts: a tenth of decode attention's time), where this is three vector integer ops.
    let bits = (n + 12_582_912.0).to_bits().wrapping_sub(0x4B40_0000 - 127) << 23;
    let y = p * f32::from_bits(bits);
    if x <= -87.0 {
        0.0
    } else {
        y
    }
}

/// [`exp_approx`] over a slice.
#[inline(always)]
pub fn exp_inplace(x: &mut [f32]) {
    x.iter_mut().for_each(|v| *v = exp_approx(*v));
}

#[derive(Clone, Copy)]
struct SyncPtr(*mut f32);
impl SyncPtr {
    fn get(self) -> *mut f32 {
        self.0
    }
}
// SAFETY: used only for disjoint writes inside one `ThreadPool::run`, which joins before returning.
unsafe impl Send for SyncPtr {}
// SAFETY: as above.
unsafe impl Sync for SyncPtr {}

#[cfg(test)]
mod tests {
    use super::*;

    fn rng(seed: u64) -> impl FnMut() -> f32 {
        let mut s = seed;
        move || {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        }
    }

    fn close(a: f32, b: f64, tol: f64) -> bool {
        (a as f64 - b).abs() <= tol * (1.0 + b.abs())
    }

    #[test]
    fn dot_rmsnorm_silu_softmax() {
        let mut r = rng(3);
        for d in [1, 15, 16, 17, 100, 577] {
            let x: Vec<f32> = (0..3 * d).map(|_| r()).collect();
            let w: Vec<f32> = (0..d).map(|_| r()).collect();
            let want_dot: f64 = x[..d]
                .iter()
                .zip(&w)
                .map(|(&a, &b)| a as f64 * b as f64)
                .sum();
            assert!(close(dot(&x[..d], &w), want_dot, 1e-5));
            let mut out = vec![0f32; 3 * d];
            rmsnorm(&x, &w, 1e-5, &mut out);
            for row in 0..3 {
                let xr = &x[row * d..(row + 1) * d];
                let ms: f64 = xr.iter().map(|&a| (a as f64).powi(2)).sum::<f64>() / d as f64;
                for i in 0..d {
                    let want = xr[i] as f64 / (ms + 1e-5).sqrt() * w[i] as f64;
                    assert!(close(out[row * d + i], want, 1e-5));
                }
            }
            let mut s = x[..d].to_vec();
            silu_mul(&mut s, &w);
            for i in 0..d {
                let g = x[i] as f64;
                assert!(close(s[i], g / (1.0 + (-g).exp()) * w[i] as f64, 1e-6));
            }
            let mut sm: Vec<f32> = x[..d].iter().map(|v| v * 30.0).collect();
            softmax(&mut sm);
            let mx = x[..d]
                .iter()
                .map(|&v| v as f64 * 30.0)
                .fold(f64::MIN, f64::max);
            let z: f64 = x[..d].iter().map(|&v| (v as f64 * 30.0 - mx).exp()).sum();
            for i in 0..d {
                assert!(close(sm[i], (x[i] as f64 * 30.0 - mx).exp() / z, 1e-5));
            }
        }
    }

    #[test]
    fn simd_versions_match_baseline() {
        let mut r = rng(13);
        let (len, hd, stride) = (150, 64, 192);
        let q: Vec<f32> = (0..hd).map(|_| r() * 3.0).collect();
        let k: Vec<f32> = (0..len * stride).map(|_| r() * 3.0).collect();
        let v: Vec<f32> = (0..len * stride).map(|_| r()).collect();
        let (mut a, mut b) = (vec![0f32; hd], vec![0f32; hd]);
        attend_one(
            &q,
            &k,
            &v,
            len,
            KvLayout::Contiguous { stride, off: 64 },
            0.125,
            &mut a,
        );
        attend_one_generic(
            &q,
            &k,
            &v,
            len,
            KvLayout::Contiguous { stride, off: 64 },
            0.125,
            &mut b,
        );
        // Attention's SIMD path sums in a different order (FMA, a reduction tree across keys):
        // equal to rounding, not to the bit. Batch invariance holds within one path.
        let near = |a: &[f32], b: &[f32]| {
            a.iter()
                .zip(b)
                .all(|(x, y)| (x - y).abs() <= 1e-5 * (1.0 + y.abs()))
        };
        assert!(near(&a, &b), "{a:?} vs {b:?}");
        for hd in [128, 40] {
            let q: Vec<f32> = (0..hd).map(|_| r() * 3.0).collect();
            let (mut a, mut b) = (vec![0f32; hd], vec![0f32; hd]);
            attend_one(
                &q,
                &k,
                &v,
                len,
                KvLayout::Contiguous { stride, off: 32 },
                0.1,
                &mut a,
            );
            attend_one_generic(
                &q,
                &k,
                &v,
                len,
                KvLayout::Contiguous { stride, off: 32 },
                0.1,
                &mut b,
            );
            assert!(near(&a, &b), "hd {hd}");
        }
        let x: Vec<f32> = (0..3 * 577).map(|_| r()).collect();
        let w: Vec<f32> = (0..577).map(|_| r()).collect();
        let (mut a, mut b) = (vec![0f32; x.len()], vec![0f32; x.len()]);
        rmsnorm(&x, &w, 1e-5, &mut a);
        rmsnorm_generic(&x, &w, 1e-5, &mut b);
        assert_eq!(a, b);
        let (mut a, mut b) = (x.clone(), x.clone());
        silu_mul(&mut a, &x);
        silu_mul_generic(&mut b, &x);
        assert_eq!(a, b);
    }

    /// A GQA group computed together equals each head computed alone, to the bit.
    #[test]
    fn group_equals_heads_alone() {
        let mut r = rng(5);
        for (hd, g) in [(64usize, 3usize), (64, 6), (128, 4), (40, 2)] {
            let (len, stride) = (100usize, 2 * hd);
            let k: Vec<f32> = (0..len * stride).map(|_| r() * 3.0).collect();
            let v: Vec<f32> = (0..len * stride).map(|_| r()).collect();
            let qs: Vec<f32> = (0..g * hd).map(|_| r() * 3.0).collect();
            let layout = KvLayout::Contiguous { stride, off: hd };
            let mut together = vec![0f32; g * hd];
            attend_group(&qs, hd, &k, &v, 77, layout, 0.1, &mut together);
            for h in 0..g {
                let mut alone = vec![0f32; hd];
                attend_one(
                    &qs[h * hd..(h + 1) * hd],
                    &k,
                    &v,
                    77,
                    layout,
                    0.1,
                    &mut alone,
                );
                assert_eq!(
                    &together[h * hd..(h + 1) * hd],
                    &alone[..],
                    "hd {hd} g {g} head {h}"
                );
            }
        }
    }

    /// The same rows stored in scattered blocks give the same bits as stored contiguously.
    #[test]
    fn paged_layout_matches_contiguous_bits() {
        let mut r = rng(21);
        let (len, kv_dim, bs, hd) = (150usize, 192usize, 16usize, 64usize);
        let k: Vec<f32> = (0..len * kv_dim).map(|_| r() * 3.0).collect();
        let v: Vec<f32> = (0..len * kv_dim).map(|_| r()).collect();
        let n_blocks = len.div_ceil(bs);
        // Block i of the sequence lives in physical block table[i] (a permutation, plus spares).
        let table: Vec<u32> = (0..n_blocks as u32)
            .map(|i| (i * 7 + 3) % (n_blocks as u32 + 2))
            .collect();
        let block_stride = bs * kv_dim;
        let (mut kp, mut vp) = (
            vec![0f32; (n_blocks + 2) * block_stride],
            vec![0f32; (n_blocks + 2) * block_stride],
        );
        for j in 0..len {
            let dst = table[j / bs] as usize * block_stride + (j % bs) * kv_dim;
            kp[dst..dst + kv_dim].copy_from_slice(&k[j * kv_dim..(j + 1) * kv_dim]);
            vp[dst..dst + kv_dim].copy_from_slice(&v[j * kv_dim..(j + 1) * kv_dim]);
        }
        let q: Vec<f32> = (0..hd).map(|_| r() * 3.0).collect();
        for visible in [1, 16, 17, 64, 65, 150] {
            let (mut a, mut b) = (vec![0f32; hd], vec![0f32; hd]);
            attend_one(
                &q,
                &k,
                &v,
                visible,
                KvLayout::Contiguous {
                    stride: kv_dim,
                    off: 128,
                },
                0.125,
                &mut a,
            );
            let paged = KvLayout::Paged {
                table: &table,
                block_size: bs,
                block_stride,
                stride: kv_dim,
                off: 128,
            };
            attend_one(&q, &kp, &vp, visible, paged, 0.125, &mut b);
            assert_eq!(a, b, "visible {visible}");
        }
    }

    /// Rows of two sequences in one call (prefill rows of one, a decode row of the other) each
    /// get the bits they get alone, through their own block tables.
    #[test]
    fn paged_rows_match_single_rows() {
        let pool = ThreadPool::new(2);
        let mut r = rng(33);
        let (nh, nkv, hd, bs) = (6usize, 2usize, 64usize, 16usize);
        let kv_dim = nkv * hd;
        let blocks = 8usize;
        let store = PagedStore {
            block_size: bs,
            block_stride: bs * kv_dim,
            layer_off: 0,
        };
        let k: Vec<f32> = (0..blocks * bs * kv_dim).map(|_| r() * 2.0).collect();
        let v: Vec<f32> = (0..blocks * bs * kv_dim).map(|_| r()).collect();
        let (ta, tb) = (vec![3u32, 0, 5, 1, 7], vec![2u32, 6, 4]);
        let mut rows: Vec<PagedRow> = (50..69).map(|pos| PagedRow { pos, table: &ta }).collect();
        rows.push(PagedRow {
            pos: 40,
            table: &tb,
        });
        let q: Vec<f32> = (0..rows.len() * nh * hd).map(|_| r() * 2.0).collect();
        let mut out = vec![0f32; q.len()];
        let shape = AttnShape {
            n_heads: nh,
            n_kv_heads: nkv,
            head_dim: hd,
        };
        paged_attention(
            &pool,
            &q,
            KvData::F32(&k),
            KvData::F32(&v),
            &rows,
            store,
            shape,
            &mut out,
        );
        // bf16 storage: the same bits as f32 storage holding the same (bf16-exact) values.
        let kb: Vec<u16> = k
            .iter()
            .map(|&x| half::bf16::from_f32(x).to_bits())
            .collect();
        let vb: Vec<u16> = v
            .iter()
            .map(|&x| half::bf16::from_f32(x).to_bits())
            .collect();
        let widen = |b: &[u16]| -> Vec<f32> { b.iter().map(|&x| KvElem::to_f32(x)).collect() };
        let (kw, vw) = (widen(&kb), widen(&vb));
        let (mut ob, mut ow) = (vec![0f32; q.len()], vec![0f32; q.len()]);
        paged_attention(
            &pool,
            &q,
            KvData::Bf16(&kb),
            KvData::Bf16(&vb),
            &rows,
            store,
            shape,
            &mut ob,
        );
        paged_attention(
            &pool,
            &q,
            KvData::F32(&kw),
            KvData::F32(&vw),
            &rows,
            store,
            shape,
            &mut ow,
        );
        assert_eq!(ob, ow);
        for (t, row) in rows.iter().enumerate() {
            for h in 0..nh {
                let layout = KvLayout::Paged {
                    table: row.table,
                    block_size: bs,
                    block_stride: store.block_stride,
                    stride: kv_dim,
                    off: (h / (nh / nkv)) * hd,
                };
                let mut one = vec![0f32; hd];
                attend_one(
                    &q[(t * nh + h) * hd..(t * nh + h + 1) * hd],
                    &k,
                    &v,
                    row.pos + 1,
                    layout,
                    0.125,
                    &mut one,
                );
                assert_eq!(
                    &out[(t * nh + h) * hd..(t * nh + h + 1) * hd],
                    &one[..],
                    "row {t} head {h}"
                );
            }
        }
    }

    #[test]
    fn exp_approx_is_accurate() {
        let mut x = -90.0f32;
        while x < 88.0 {
            let want = (x as f64).exp();
            let got = exp_approx(x) as f64;
            if x > -87.0 {
                assert!(
                    (got - want).abs() <= 3e-7 * want,
                    "exp({x}) = {got}, want {want}"
                );
            } else {
                assert!(got < 1e-37);
            }
            x += 0.01;
        }
        assert_eq!(exp_approx(f32::NEG_INFINITY), 0.0);
    }

    #[test]
    fn rope_rotates_half() {
        let mut r = rng(5);
        let (heads, hd) = (3, 10);
        let inv: Vec<f64> = (0..hd / 2)
            .map(|i| 1.0 / 10000f64.powf(2.0 * i as f64 / hd as f64))
            .collect();
        let (mut c, mut s) = (vec![0f32; hd / 2], vec![0f32; hd / 2]);
        rope_angles(7, &inv, &mut c, &mut s);
        let x: Vec<f32> = (0..heads * hd).map(|_| r()).collect();
        let mut y = x.clone();
        rope(&mut y, hd, &c, &s);
        for h in 0..heads {
            for i in 0..hd {
                let a = 7.0 * inv[i % (hd / 2)];
                let rot = if i < hd / 2 {
                    -(x[h * hd + i + hd / 2] as f64)
                } else {
                    x[h * hd + i - hd / 2] as f64
                };
                let want = x[h * hd + i] as f64 * a.cos() + rot * a.sin();
                assert!(close(y[h * hd + i], want, 1e-6));
            }
        }
    }

    /// `n` query rows at the end of a contiguous `[len, kv_dim]` history: one block holding it all.
    #[allow(clippy::too_many_arguments)]
    fn attention(
        pool: &ThreadPool,
        q: &[f32],
        k: &[f32],
        v: &[f32],
        n: usize,
        len: usize,
        s: AttnShape,
        out: &mut [f32],
    ) {
        let kv_dim = s.n_kv_heads * s.head_dim;
        let table = [0u32];
        let rows: Vec<PagedRow> = (len - n..len)
            .map(|pos| PagedRow { pos, table: &table })
            .collect();
        let store = PagedStore {
            block_size: len,
            block_stride: len * kv_dim,
            layer_off: 0,
        };
        paged_attention(
            pool,
            q,
            KvData::F32(k),
            KvData::F32(v),
            &rows,
            store,
            s,
            out,
        );
    }

    #[test]
    fn gqa_attention_matches_reference() {
        let pool = ThreadPool::new(2);
        let mut r = rng(9);
        for &(n, len, nh, nkv, hd) in &[
            (1, 1, 1, 1, 4),
            (3, 7, 6, 2, 5),
            (5, 5, 9, 3, 17),
            (1, 33, 4, 4, 64),
            (3, 150, 6, 2, 64),
            (70, 200, 2, 1, 8),
        ] {
            let s = AttnShape {
                n_heads: nh,
                n_kv_heads: nkv,
                head_dim: hd,
            };
            let q: Vec<f32> = (0..n * nh * hd).map(|_| r() * 3.0).collect();
            let k: Vec<f32> = (0..len * nkv * hd).map(|_| r() * 3.0).collect();
            let v: Vec<f32> = (0..len * nkv * hd).map(|_| r()).collect();
            let mut out = vec![0f32; n * nh * hd];
            attention(&pool, &q, &k, &v, n, len, s, &mut out);
            for t in 0..n {
                for h in 0..nh {
                    let kvh = h / (nh / nkv);
                    let vis = len - n + t + 1;
                    let sc: Vec<f64> = (0..vis)
                        .map(|j| {
                            (0..hd)
                                .map(|d| {
                                    q[(t * nh + h) * hd + d] as f64
                                        * k[(j * nkv + kvh) * hd + d] as f64
                                })
                                .sum::<f64>()
                                / (hd as f64).sqrt()
                        })
                        .collect();
                    let mx = sc.iter().cloned().fold(f64::MIN, f64::max);
                    let z: f64 = sc.iter().map(|s| (s - mx).exp()).sum();
                    for d in 0..hd {
                        let want: f64 = (0..vis)
                            .map(|j| (sc[j] - mx).exp() / z * v[(j * nkv + kvh) * hd + d] as f64)
                            .sum();
                        assert!(
                            close(out[(t * nh + h) * hd + d], want, 1e-5),
                            "n{n} len{len} t{t} h{h}"
                        );
                    }
                }
            }
            // The last query row alone gives the same bits as within the block.
            let mut one = vec![0f32; nh * hd];
            attention(&pool, &q[(n - 1) * nh * hd..], &k, &v, 1, len, s, &mut one);
            assert_eq!(&one[..], &out[(n - 1) * nh * hd..]);
        }
    }
}
