//! The CUDA kernels (`src/cuda/*.cu`, run by the CPU emulator in `thaw-cuda-emu`) against
//! the CPU backend's functions on the same inputs — the GPU code's logic tested on every
//! machine. Tolerances only cover summation order (and `exp` implementations); conversions and
//! data movement are compared bit for bit.

use half::{bf16, f16};
use thaw_cuda_emu as emu;
use thaw_kernels::ops::{self, AttnShape, KvData, PagedRow, PagedStore};
use thaw_kernels::ThreadPool;

struct Rng(u64);
impl Rng {
    fn f(&mut self) -> f32 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        ((self.0 >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
    fn vec(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.f()).collect()
    }
}

fn as_bytes<T: Copy>(v: &[T]) -> &[u8] {
    // SAFETY: plain numbers viewed as bytes.
    unsafe { std::slice::from_raw_parts(v.as_ptr() as *const u8, std::mem::size_of_val(v)) }
}

fn u16s(b: &[u8]) -> Vec<u16> {
    b.chunks_exact(2)
        .map(|c| u16::from_le_bytes([c[0], c[1]]))
        .collect()
}

fn f32s(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

fn assert_close(got: &[f32], want: &[f32], tol: f32, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    let scale = want.iter().fold(0f32, |m, x| m.max(x.abs())).max(1e-6);
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= tol * scale,
            "{what}[{i}]: {g} vs {w} (scale {scale})"
        );
    }
}

/// f32 → bf16 and f32 → f16 stores round to nearest even with NaN kept a NaN, exactly as the
/// `half` crate the CPU uses (the value path through `rope_store`'s V copy is a plain store).
#[test]
fn sixteen_bit_stores_match_the_cpu_rounding() {
    let mut vals = vec![
        0.0f32,
        -0.0,
        1.0,
        -1.0,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
        f32::MIN_POSITIVE,
        1e-40,
        3.0e38,
        65504.0,
        70000.0,
        f32::from_bits(0x3f80_8000), // 1 + 2^-8: a bf16 tie, rounds to even (down)
        f32::from_bits(0x3f81_8000), // 1 + 3·2^-8: a tie rounding up to even
    ];
    let mut r = Rng(7);
    vals.extend(r.vec(100).iter().map(|x| x * 1000.0));
    let n = vals.len();
    let h = emu::Heads {
        n_heads: 1,
        n_kv: 1,
        head_dim: n.next_multiple_of(2),
    };
    let hd = h.head_dim;
    vals.resize(hd, 0.5);
    for kind in [emu::Kind::Bf16, emu::Kind::F16] {
        let mut q = vec![0f32; hd];
        let k = vec![0f32; hd];
        let (cos, sin) = (vec![1f32; hd / 2], vec![0f32; hd / 2]);
        let (mut kc, mut vc) = (vec![0u8; hd * 2], vec![0u8; hd * 2]);
        emu::rope_store(
            &mut q,
            &k,
            &vals,
            &cos,
            &sin,
            h,
            &mut kc,
            &mut vc,
            kind,
            &[0],
            0,
        );
        for (i, (&got, &x)) in u16s(&vc).iter().zip(&vals).enumerate() {
            let want = match kind {
                emu::Kind::Bf16 => bf16::from_f32(x).to_bits(),
                _ => f16::from_f32(x).to_bits(),
            };
            if x.is_nan() {
                let back = match kind {
                    emu::Kind::Bf16 => bf16::from_bits(got).is_nan(),
                    _ => f16::from_bits(got).is_nan(),
                };
                assert!(back, "{kind:?}: NaN stored as {got:#x}");
            } else {
                assert_eq!(got, want, "{kind:?} store of {x} (element {i})");
            }
        }
    }
}

/// Widening and the embedding lookup read every kind exactly.
#[test]
fn widen_and_embed_read_every_kind_exactly() {
    let mut r = Rng(3);
    let (rows, d) = (11, 70);
    let vals = r.vec(rows * d);
    let ids = [3u32, 0, 10, 3, 7];
    for kind in [emu::Kind::F32, emu::Kind::Bf16, emu::Kind::F16] {
        let (bytes, exact): (Vec<u8>, Vec<f32>) = match kind {
            emu::Kind::F32 => (as_bytes(&vals).to_vec(), vals.clone()),
            emu::Kind::Bf16 => {
                let b: Vec<u16> = vals.iter().map(|&x| bf16::from_f32(x).to_bits()).collect();
                let e = b.iter().map(|&x| bf16::from_bits(x).to_f32()).collect();
                (as_bytes(&b).to_vec(), e)
            }
            emu::Kind::F16 => {
                let b: Vec<u16> = vals.iter().map(|&x| f16::from_f32(x).to_bits()).collect();
                let e = b.iter().map(|&x| f16::from_bits(x).to_f32()).collect();
                (as_bytes(&b).to_vec(), e)
            }
        };
        let mut wide = vec![0f32; rows * d];
        emu::widen(&bytes, kind, &mut wide);
        assert_eq!(wide, exact, "{kind:?} widen");
        let mut out = vec![0f32; ids.len() * d];
        emu::embed(&bytes, kind, &ids, d, &mut out);
        for (j, &id) in ids.iter().enumerate() {
            assert_eq!(
                &out[j * d..(j + 1) * d],
                &exact[id as usize * d..(id as usize + 1) * d],
                "{kind:?} embed row {id}"
            );
        }
    }
}

/// RMSNorm (every row, or picked rows), bias add and SiLU·mul against the CPU's.
#[test]
fn elementwise_kernels_match_the_cpu() {
    let mut r = Rng(11);
    for (rows, d, block) in [(3usize, 576usize, 256u32), (2, 4096, 1024), (4, 100, 256)] {
        let x: Vec<f32> = r.vec(rows * d).iter().map(|v| v * 3.0).collect();
        let w = r.vec(d);
        let mut want = vec![0f32; rows * d];
        ops::rmsnorm(&x, &w, 1e-5, &mut want);
        let mut got = vec![0u8; rows * d * 4];
        emu::rmsnorm(&x, None, &w, 1e-5, &mut got, emu::Kind::F32, block);
        assert_close(&f32s(&got), &want, 1e-5, "rmsnorm");
        // Picked rows, stored as bf16: the CPU value rounded once (or a neighbour, at a tie
        // the two summation orders straddle).
        let map = [rows as u32 - 1, 0];
        let mut got = vec![0u8; 2 * d * 2];
        emu::rmsnorm(&x, Some(&map), &w, 1e-5, &mut got, emu::Kind::Bf16, block);
        let got: Vec<f32> = u16s(&got)
            .iter()
            .map(|&b| bf16::from_bits(b).to_f32())
            .collect();
        let mut picked = want[(rows - 1) * d..].to_vec();
        picked.extend_from_slice(&want[..d]);
        assert_close(&got, &picked, 1e-2, "rmsnorm picked rows (bf16)");
    }
    let n = 3 * 1536 + 5;
    let (g, u) = (r.vec(n), r.vec(n));
    let g: Vec<f32> = g.iter().map(|v| v * 8.0).collect();
    let mut want = g.clone();
    ops::silu_mul(&mut want, &u);
    let mut got = vec![0u8; n * 4];
    emu::silu_mul(&g, &u, &mut got, emu::Kind::F32);
    assert_close(&f32s(&got), &want, 1e-5, "silu_mul");
    let b = r.vec(96);
    let mut x = r.vec(96 * 5);
    let mut want = x.clone();
    want.chunks_exact_mut(96)
        .for_each(|row| ops::add_inplace(row, &b));
    emu::add_bias(&mut x, &b);
    assert_eq!(x, want, "add_bias");
}

/// A paged store and rows spread over sequences with scattered block tables.
struct Case {
    h: emu::Heads,
    block_size: usize,
    layers: usize,
    layer: usize,
    blocks: usize,
    /// (block table, positions of this step's rows)
    seqs: Vec<(Vec<u32>, Vec<usize>)>,
}

impl Case {
    fn kvd(&self) -> usize {
        self.h.n_kv * self.h.head_dim
    }
    fn stride(&self) -> usize {
        self.layers * self.block_size * self.kvd()
    }
    fn layer_off(&self) -> usize {
        self.layer * self.block_size * self.kvd()
    }
    fn slot(&self, table: &[u32], pos: usize) -> usize {
        table[pos / self.block_size] as usize * self.stride()
            + self.layer_off()
            + (pos % self.block_size) * self.kvd()
    }
}

fn cases() -> Vec<Case> {
    let smol = emu::Heads {
        n_heads: 9,
        n_kv: 3,
        head_dim: 64,
    };
    let llama = emu::Heads {
        n_heads: 32,
        n_kv: 8,
        head_dim: 128,
    };
    let odd = emu::Heads {
        n_heads: 16,
        n_kv: 2,
        head_dim: 80,
    };
    vec![
        Case {
            h: smol,
            block_size: 16,
            layers: 3,
            layer: 1,
            blocks: 24,
            seqs: vec![
                (
                    vec![5, 17, 2, 9, 11, 0, 23, 4, 8, 1],
                    (0..3).chain([150]).collect(),
                ),
                (vec![22, 3], vec![0]),
                (vec![7, 13, 19, 6], vec![40, 41, 63]),
            ],
        },
        Case {
            h: llama,
            block_size: 16,
            layers: 2,
            layer: 0,
            blocks: 12,
            seqs: vec![(vec![11, 0, 6, 3, 9], vec![70]), (vec![1, 2], vec![5, 17])],
        },
        Case {
            h: odd,
            block_size: 8,
            layers: 1,
            layer: 0,
            blocks: 10,
            seqs: vec![(vec![9, 8, 7, 6, 5], vec![33]), (vec![0], vec![0, 3])],
        },
        // Prefill chunks: long runs of consecutive rows crossing key tiles of 32, a chunk in
        // the middle of a sequence, and a lone decode row.
        Case {
            h: smol,
            block_size: 16,
            layers: 2,
            layer: 1,
            blocks: 16,
            seqs: vec![
                (vec![3, 9, 0, 14, 5], (0..37).collect()),
                (vec![7, 1, 12], (30..35).collect()),
                (vec![15], vec![9]),
            ],
        },
    ]
}

/// RoPE + cache store, then paged GQA attention, against the CPU's rope and paged attention
/// over the same store layout — f32 and bf16 caches, Llama/SmolLM2/odd head shapes, rows at
/// position 0, inside one block, across many blocks and CPU attention tiles.
#[test]
fn rope_store_and_paged_attention_match_the_cpu() {
    let mut r = Rng(29);
    let pool = ThreadPool::global();
    for c in cases() {
        let (nh, hd, kvd) = (c.h.n_heads, c.h.head_dim, c.kvd());
        for kind in [emu::Kind::F32, emu::Kind::Bf16] {
            let total = c.blocks * c.stride();
            // Fill every position each sequence may read with random keys/values, stored by the
            // emulated rope_store (angles of each position), rows in sequence order.
            let (mut kc, mut vc) = (
                vec![0u8; total * kind.bytes()],
                vec![0u8; total * kind.bytes()],
            );
            let inv: Vec<f64> = (0..hd / 2)
                .map(|i| 1.0 / 10000f64.powf(2.0 * i as f64 / hd as f64))
                .collect();
            let mut cpu_k = vec![0f32; total];
            let mut cpu_v = vec![0f32; total];
            for (table, rows) in &c.seqs {
                let last = *rows.iter().max().unwrap();
                let positions: Vec<usize> = (0..=last).collect();
                let n = positions.len();
                let mut q = r.vec(n * nh * hd);
                let k = r.vec(n * kvd);
                let v = r.vec(n * kvd);
                let (mut cos, mut sin) = (vec![0f32; n * hd / 2], vec![0f32; n * hd / 2]);
                for (i, &p) in positions.iter().enumerate() {
                    ops::rope_angles(
                        p,
                        &inv,
                        &mut cos[i * hd / 2..(i + 1) * hd / 2],
                        &mut sin[i * hd / 2..(i + 1) * hd / 2],
                    );
                }
                let slots: Vec<i64> = positions
                    .iter()
                    .map(|&p| (c.slot(table, p) - c.layer_off()) as i64)
                    .collect();
                let q0 = q.clone();
                emu::rope_store(
                    &mut q,
                    &k,
                    &v,
                    &cos,
                    &sin,
                    c.h,
                    &mut kc,
                    &mut vc,
                    kind,
                    &slots,
                    c.layer_off(),
                );
                // The CPU's rope on the same rows gives the same queries and keys.
                for (i, &p) in positions.iter().enumerate() {
                    let (cs, sn) = (
                        &cos[i * hd / 2..(i + 1) * hd / 2],
                        &sin[i * hd / 2..(i + 1) * hd / 2],
                    );
                    let mut qr = q0[i * nh * hd..(i + 1) * nh * hd].to_vec();
                    ops::rope(&mut qr, hd, cs, sn);
                    assert_close(&q[i * nh * hd..(i + 1) * nh * hd], &qr, 1e-6, "rope q");
                    let mut kr = k[i * kvd..(i + 1) * kvd].to_vec();
                    ops::rope(&mut kr, hd, cs, sn);
                    let at = c.slot(table, p);
                    cpu_k[at..at + kvd].copy_from_slice(&kr);
                    cpu_v[at..at + kvd].copy_from_slice(&v[i * kvd..(i + 1) * kvd]);
                }
            }
            // What the emulated store holds, widened: equal to the CPU's rows (rounded to the
            // cache's kind) wherever a row was written.
            let (gk, gv): (Vec<f32>, Vec<f32>) = match kind {
                emu::Kind::F32 => (f32s(&kc), f32s(&vc)),
                _ => (
                    u16s(&kc)
                        .iter()
                        .map(|&b| bf16::from_bits(b).to_f32())
                        .collect(),
                    u16s(&vc)
                        .iter()
                        .map(|&b| bf16::from_bits(b).to_f32())
                        .collect(),
                ),
            };
            for (table, rows) in &c.seqs {
                for p in 0..=*rows.iter().max().unwrap() {
                    let at = c.slot(table, p);
                    let round = |x: &[f32]| -> Vec<f32> {
                        match kind {
                            emu::Kind::F32 => x.to_vec(),
                            _ => x.iter().map(|&v| bf16::from_f32(v).to_f32()).collect(),
                        }
                    };
                    assert_close(
                        &gk[at..at + kvd],
                        &round(&cpu_k[at..at + kvd]),
                        2e-6,
                        "k cache",
                    );
                    assert_eq!(
                        &gv[at..at + kvd],
                        &round(&cpu_v[at..at + kvd])[..],
                        "v cache"
                    );
                }
            }
            // This step's query rows.
            let mut tables = vec![];
            let (mut pos, mut toff, mut prows) = (vec![], vec![], vec![]);
            for (table, rows) in &c.seqs {
                let off = tables.len() as u32;
                tables.extend_from_slice(table);
                for &p in rows {
                    pos.push(p as u32);
                    toff.push(off);
                    prows.push(PagedRow { pos: p, table });
                }
            }
            let n = pos.len();
            let q = r.vec(n * nh * hd);
            let mut want = vec![0f32; n * nh * hd];
            let store = PagedStore {
                block_size: c.block_size,
                block_stride: c.stride(),
                layer_off: c.layer_off(),
            };
            let shape = AttnShape {
                n_heads: nh,
                n_kv_heads: c.h.n_kv,
                head_dim: hd,
            };
            let (k16, v16) = (u16s(&kc), u16s(&vc));
            let (kd, vd) = match kind {
                emu::Kind::F32 => (KvData::F32(&gk), KvData::F32(&gv)),
                _ => (KvData::Bf16(&k16), KvData::Bf16(&v16)),
            };
            ops::paged_attention(pool, &q, kd, vd, &prows, store, shape, &mut want);
            let paging = emu::Paging {
                block_size: c.block_size,
                block_stride: c.stride(),
                layer_off: c.layer_off(),
            };
            // Whole rows per block, and flash-decoding in splits of 32 positions (rows past
            // 32 positions merged from 2–3 splits, shorter ones finished in their one).
            for chunk in [0, 32] {
                let mut got = vec![0u8; n * nh * hd * 4];
                emu::attention(
                    &q,
                    &kc,
                    &vc,
                    kind,
                    &pos,
                    &toff,
                    &tables,
                    paging,
                    c.h,
                    &mut got,
                    emu::Kind::F32,
                    chunk,
                );
                assert_close(
                    &f32s(&got),
                    &want,
                    2e-5,
                    &format!("attention {:?} {kind:?}, splits of {chunk}", c.h),
                );
            }
            // The flash-style prefill kernel over tiles of up to 4 consecutive rows of one
            // sequence (every row in some tile): the same outputs.
            let mut tiles: Vec<(u32, u32)> = vec![];
            for r in 0..n as u32 {
                match tiles.last_mut() {
                    Some((r0, cnt))
                        if *cnt < 4
                            && toff[r as usize] == toff[*r0 as usize]
                            && pos[r as usize] == pos[*r0 as usize] + *cnt =>
                    {
                        *cnt += 1
                    }
                    _ => tiles.push((r, 1)),
                }
            }
            let mut flash = vec![0u8; n * nh * hd * 4];
            emu::attention_prefill(
                &q,
                &kc,
                &vc,
                kind,
                &tiles,
                &pos,
                &toff,
                &tables,
                paging,
                c.h,
                &mut flash,
                emu::Kind::F32,
            );
            assert_close(
                &f32s(&flash),
                &want,
                2e-5,
                &format!("prefill attention {:?} {kind:?}", c.h),
            );
        }
    }
}

/// Device argmax = the CPU sampler's rule (first index of the maximum) on rows with ties at
/// different distances, a maximum at either end, a row of -inf, for the GPU's and the
/// emulator's block sizes and vocabularies of awkward length.
#[test]
fn argmax_rows_picks_the_first_maximum() {
    let cpu = |row: &[f32]| -> u32 {
        let mut best = 0;
        for (i, &v) in row.iter().enumerate() {
            if v > row[best] {
                best = i;
            }
        }
        best as u32
    };
    let mut r = Rng(41);
    for n in [1usize, 31, 1000, 49_152 + 7] {
        let mut rows: Vec<Vec<f32>> = (0..5).map(|_| r.vec(n)).collect();
        if n > 31 {
            let m = 5.0;
            rows[1][n / 3] = m; // a tie: the earlier one wins
            rows[1][n - 2] = m;
            rows[2][n - 1] = m; // maximum at the end
            rows[3][0] = m; // and at the start, tied later
            rows[3][n / 2] = m;
            rows[3][n / 2 + 1] = m;
        }
        rows[4] = vec![f32::NEG_INFINITY; n];
        let x: Vec<f32> = rows.concat();
        for block in [64u32, 256, 1024] {
            let mut ids = vec![u32::MAX; rows.len()];
            emu::argmax_rows(&x, n, &mut ids, block);
            let want: Vec<u32> = rows.iter().map(|row| cpu(row)).collect();
            assert_eq!(ids, want, "n {n}, block {block}");
        }
    }
}

/// The matrix-vector kernels (`gemv`, `gemv1`, `gemv1v`, `gemv1r`) against the GEMM's definition
/// (computed in f64) for f32 and bf16 weights; one matrix and three sharing x in one launch (the
/// last group of outputs of each partial); widths below, past and not multiples of a block's
/// stride (4 elements a thread, 8 with 16-byte loads: 1028 is refused by those); 1..=8 rows; beta 0 (y never read: it starts NaN) and beta 1
/// (accumulate into the residual); with the RMSNorm folded in (x the f32 residual) against
/// the norm then the product (the norm rounded to W's kind as the `rmsnorm` kernel stores it);
/// and what they refuse.
#[test]
fn gemv_matches_the_gemm_for_decode_rows() {
    use emu::device::{Emu, GemvKernel};
    use thaw_kernels::device::{
        gemv_fits, DeviceBuf, DeviceOps, Elem, GemvIn, GemvNorm, GemvOut, GEMV_MAX_ROWS,
    };
    let dev = Emu::new();
    let mut r = Rng(77);
    let eps = 1e-5f32;
    for kind in [Elem::F32, Elem::Bf16] {
        let enc = |v: &[f32]| -> Vec<u8> {
            match kind {
                Elem::F32 => as_bytes(v).to_vec(),
                Elem::Bf16 => v
                    .iter()
                    .flat_map(|x| bf16::from_f32(*x).to_bits().to_le_bytes())
                    .collect(),
                Elem::F16 => v
                    .iter()
                    .flat_map(|x| f16::from_f32(*x).to_bits().to_le_bytes())
                    .collect(),
            }
        };
        // The values the kernel sees after encoding.
        let dec = |b: &[u8]| -> Vec<f64> {
            match kind {
                Elem::F32 => f32s(b).iter().map(|&v| v as f64).collect(),
                _ => b
                    .chunks(2)
                    .map(|c| {
                        let bits = u16::from_le_bytes([c[0], c[1]]);
                        if kind == Elem::Bf16 {
                            bf16::from_bits(bits).to_f64()
                        } else {
                            f16::from_bits(bits).to_f64()
                        }
                    })
                    .collect(),
            }
        };
        for in_dim in [64usize, 1028, 1032] {
            let dims = [29usize, 5, 22];
            // (Small enough that the emulator runs the kernel, not the GEMM's definition.)
            assert!(dims.iter().sum::<usize>() * in_dim <= emu::device::EMU_GEMV_MAX_ELEMS);
            let ws: Vec<_> = dims
                .iter()
                .map(|&o| {
                    let w = enc(&r.vec(o * in_dim));
                    let mut wd = dev.alloc(w.len()).unwrap();
                    dev.upload(&mut wd, 0, &w).unwrap();
                    (wd, dec(&w))
                })
                .collect();
            let nw: Vec<f32> = r.vec(in_dim).iter().map(|v| 1.0 + v).collect();
            let mut nwd = dev.alloc(in_dim * 4).unwrap();
            dev.upload(&mut nwd, 0, as_bytes(&nw)).unwrap();
            for (kernel, rows) in [
                (GemvKernel::Rows, 1usize),
                (GemvKernel::Rows, 3),
                (GemvKernel::Rows, GEMV_MAX_ROWS),
                (GemvKernel::One, 1),
                (GemvKernel::OneVec16, 1),
                (GemvKernel::OneWarpRows, 1),
            ] {
                let vec16 = matches!(kernel, GemvKernel::OneVec16 | GemvKernel::OneWarpRows);
                if vec16 && in_dim % 8 != 0 {
                    continue; // refused: below
                }
                let xf = r.vec(rows * in_dim);
                for (group, beta, norm) in [
                    (1usize, 0.0f32, false),
                    (3, 1.0, false),
                    (3, 0.0, true),
                    (1, 1.0, true),
                ] {
                    // Under a norm x is the f32 residual; otherwise in W's kind.
                    let x = if norm {
                        as_bytes(&xf).to_vec()
                    } else {
                        enc(&xf)
                    };
                    let xs = if norm {
                        xf.iter().map(|&v| v as f64).collect()
                    } else {
                        dec(&x)
                    };
                    let mut xd = dev.alloc(x.len()).unwrap();
                    dev.upload(&mut xd, 0, &x).unwrap();
                    // The reference's activations: x, or its RMSNorm — in f64 for f32 weights;
                    // for 16-bit weights as the `rmsnorm` kernel stores it in W's kind (what
                    // the unfused step feeds the product, and what the fused one must match).
                    let xr: Vec<f64> = if !norm {
                        xs
                    } else if kind == Elem::F32 {
                        xs.chunks(in_dim)
                            .flat_map(|row| {
                                let ms = row.iter().map(|v| v * v).sum::<f64>() / in_dim as f64;
                                let sc = 1.0 / (ms + eps as f64).sqrt();
                                row.iter().zip(&nw).map(move |(v, w)| v * sc * *w as f64)
                            })
                            .collect()
                    } else {
                        let xn = dev.alloc(rows * in_dim * 4).unwrap();
                        dev.rmsnorm(xd.ptr(), 0, nwd.ptr(), rows, in_dim, eps, xn.ptr(), kind)
                            .unwrap();
                        let mut b = vec![0u8; rows * in_dim * 2];
                        dev.download(&xn, 0, &mut b).unwrap();
                        dec(&b)
                    };
                    let mut outs = vec![];
                    let mut bufs = vec![];
                    for m in 0..group {
                        let y0 = r.vec(rows * dims[m]);
                        let start: Vec<f32> = if beta == 0.0 {
                            vec![f32::NAN; y0.len()]
                        } else {
                            y0
                        };
                        let mut got_d = dev.alloc(start.len() * 4).unwrap();
                        dev.upload(&mut got_d, 0, as_bytes(&start)).unwrap();
                        assert!(gemv_fits(
                            ws[m].0.ptr(),
                            xd.ptr(),
                            in_dim,
                            rows,
                            GEMV_MAX_ROWS
                        ));
                        outs.push(GemvOut {
                            w: ws[m].0.ptr(),
                            out_dim: dims[m],
                            y: got_d.ptr(),
                        });
                        let want: Vec<f32> = (0..rows * dims[m])
                            .map(|i| {
                                let (row, o) = (i / dims[m], i % dims[m]);
                                let w = &ws[m].1[o * in_dim..(o + 1) * in_dim];
                                let x = &xr[row * in_dim..(row + 1) * in_dim];
                                let acc: f64 = w.iter().zip(x).map(|(a, b)| a * b).sum();
                                let old = if beta == 0.0 {
                                    0.0
                                } else {
                                    beta as f64 * start[i] as f64
                                };
                                (acc + old) as f32
                            })
                            .collect();
                        bufs.push((got_d, want));
                    }
                    let xin = GemvIn {
                        x: xd.ptr(),
                        kind: if norm { Elem::F32 } else { kind },
                        rows,
                        in_dim,
                        norm: norm.then_some(GemvNorm { w: nwd.ptr(), eps }),
                    };
                    dev.gemv_kernel(kernel, kind, &outs, &xin, beta).unwrap();
                    for (m, (got_d, want)) in bufs.iter().enumerate() {
                        let mut got = vec![0u8; want.len() * 4];
                        dev.download(got_d, 0, &mut got).unwrap();
                        let what = format!(
                            "{kernel:?} {kind:?} matrix {m} of {group}: {}x{in_dim}, {rows} rows, beta {beta}, norm {norm}",
                            dims[m]
                        );
                        assert_close(&f32s(&got), want, 1e-5, &what);
                    }
                }
            }
        }
    }
    // Refused: too many rows, a width not a multiple of 4, misaligned operands, more than one
    // row for the one-row kernels, no matrices or more than three, x not in W's kind (or not
    // f32 under a norm).
    let a = dev.alloc(4096).unwrap().ptr();
    assert!(!gemv_fits(a, a, 64, GEMV_MAX_ROWS + 1, GEMV_MAX_ROWS));
    assert!(!gemv_fits(a, a, 64, 4, 3));
    assert!(!gemv_fits(a, a, 62, 1, GEMV_MAX_ROWS));
    assert!(!gemv_fits(a + 4, a, 64, 1, GEMV_MAX_ROWS));
    assert!(!gemv_fits(a, a + 2, 64, 1, GEMV_MAX_ROWS));
    let o = |w: u64| GemvOut {
        w,
        out_dim: 4,
        y: a,
    };
    let x = |rows: usize, kind: Elem, norm: bool| GemvIn {
        x: a,
        kind,
        rows,
        in_dim: 64,
        norm: norm.then_some(GemvNorm { w: a, eps }),
    };
    assert!(dev
        .gemv(Elem::F32, &[o(a + 4)], &x(1, Elem::F32, false), 0.0)
        .is_err());
    assert!(dev
        .gemv(Elem::F32, &[], &x(1, Elem::F32, false), 0.0)
        .is_err());
    assert!(dev
        .gemv(Elem::F32, &[o(a); 4], &x(1, Elem::F32, false), 0.0)
        .is_err());
    assert!(dev
        .gemv(Elem::Bf16, &[o(a)], &x(1, Elem::F32, false), 0.0)
        .is_err());
    assert!(dev
        .gemv(Elem::Bf16, &[o(a)], &x(1, Elem::Bf16, true), 0.0)
        .is_err());
    // f16 weights go to cuBLAS (the kernels are compiled for f32 and bf16).
    assert!(dev
        .gemv(Elem::F16, &[o(a)], &x(1, Elem::F16, false), 0.0)
        .is_err());
    assert!(dev
        .gemv_kernel(
            GemvKernel::One,
            Elem::F32,
            &[o(a)],
            &x(2, Elem::F32, false),
            0.0
        )
        .is_err());
    // 16-byte loads: W, x and the norm's weights 16-byte aligned, rows a multiple of 8 elements
    // (the emulator aborts on a misaligned vector load, as a GPU faults: these must be refused
    // before any launch). 8-byte aligned operands still take the 8-byte kernel.
    let x16 = x(1, Elem::F32, true);
    assert!(x16.vec16(&[o(a)]));
    assert!(!x16.vec16(&[o(a + 8)]));
    assert!(!GemvIn { x: a + 8, ..x16 }.vec16(&[o(a)]));
    assert!(!GemvIn {
        norm: Some(GemvNorm { w: a + 8, eps }),
        ..x16
    }
    .vec16(&[o(a)]));
    assert!(!GemvIn { in_dim: 68, ..x16 }.vec16(&[o(a)]));
    // The warp-per-rows kernel holds x in 40 KiB of shared memory: 10240 f32 or 20480 bf16.
    let stages = |in_dim: usize, kind: Elem| GemvIn { in_dim, ..x16 }.stages(kind);
    assert!(stages(10240, Elem::F32) && !stages(10248, Elem::F32));
    assert!(stages(20480, Elem::Bf16) && !stages(20488, Elem::Bf16));
    let plain = x(1, Elem::F32, false);
    assert!(dev
        .gemv_kernel(GemvKernel::OneVec16, Elem::F32, &[o(a + 8)], &plain, 0.0)
        .is_err());
    // (Live buffers for a launch: W 8 bytes into its allocation, x and y their own.)
    let (wb, xb, yb) = (
        dev.alloc(8 + 4 * 64 * 4).unwrap(),
        dev.alloc(64 * 4).unwrap(),
        dev.alloc(4 * 4).unwrap(),
    );
    let off8 = GemvOut {
        w: wb.ptr() + 8,
        out_dim: 4,
        y: yb.ptr(),
    };
    let xin = GemvIn {
        x: xb.ptr(),
        ..plain
    };
    assert!(!xin.vec16(&[off8]));
    dev.gemv(Elem::F32, &[off8], &xin, 0.0).unwrap();
}

/// The emulator's allocations are fenced (guard pages, `emu::fence`): a kernel reading past an
/// allocation kills the process with SIGSEGV and a message naming the kernel, as the GPU would
/// raise an illegal address (or silently read a neighbour). Here a one-row product is told its
/// matrix has 4 rows when its allocation holds 3: the child process running it must die so.
#[test]
fn a_kernel_reading_past_its_allocation_faults() {
    use emu::device::{Emu, GemvKernel};
    use thaw_kernels::device::{DeviceBuf, DeviceOps, Elem, GemvIn, GemvOut};
    const CHILD: &str = "THAW_EMU_OVERRUN_CHILD";
    let Ok(which) = std::env::var(CHILD) else {
        for (which, kernel) in [("short", Some("gemv1r")), ("fits", None)] {
            let out = std::process::Command::new(std::env::current_exe().unwrap())
                .args(["--exact", "a_kernel_reading_past_its_allocation_faults"])
                .args(["--nocapture", "--test-threads=1"])
                .env(CHILD, which)
                .output()
                .unwrap();
            let stderr = String::from_utf8_lossy(&out.stderr);
            match kernel {
                Some(k) => {
                    use std::os::unix::process::ExitStatusExt;
                    assert_eq!(
                        out.status.signal(),
                        Some(libc::SIGSEGV),
                        "{which}: {stderr}"
                    );
                    assert!(
                        stderr.contains("thaw emulator: memory fault") && stderr.contains(k),
                        "{which}: {stderr}"
                    );
                }
                None => assert!(out.status.success(), "{which}: {stderr}"),
            }
        }
        return;
    };
    let dev = Emu::new();
    let (k, n) = (64usize, 4usize);
    // 3 rows' bytes (768, a multiple of 256: no rounding slack before the guard page), or 4.
    let rows_held = if which == "short" { n - 1 } else { n };
    let mut w = dev.alloc(rows_held * k * 4).unwrap();
    dev.upload(&mut w, 0, &vec![0u8; rows_held * k * 4])
        .unwrap();
    let x = dev.alloc(k * 4).unwrap();
    let y = dev.alloc(n * 4).unwrap();
    let outs = [GemvOut {
        w: w.ptr(),
        out_dim: n,
        y: y.ptr(),
    }];
    let xin = GemvIn {
        x: x.ptr(),
        kind: Elem::F32,
        rows: 1,
        in_dim: k,
        norm: None,
    };
    dev.gemv_kernel(GemvKernel::OneWarpRows, Elem::F32, &outs, &xin, 0.0)
        .unwrap();
}

/// A full-warp shuffle after some of the warp's lanes returned is undefined on a GPU (it reads
/// lanes that are gone, or hangs); the emulator aborts on it, so a kernel doing it fails its
/// test here instead of giving garbage on a GPU. Checked in a child process.
#[test]
fn a_shuffle_after_lanes_returned_aborts() {
    const CHILD: &str = "THAW_EMU_SHUFFLE_CHILD";
    if let Ok(n) = std::env::var(CHILD) {
        let sum = emu::selftest_shuffle_after_exit(n.parse().unwrap());
        assert_eq!(sum, 32.0);
        return;
    }
    for (exit_lanes, aborts) in [(0u32, false), (1, true), (16, true)] {
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "a_shuffle_after_lanes_returned_aborts"])
            .args(["--nocapture", "--test-threads=1"])
            .env(CHILD, exit_lanes.to_string())
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        if aborts {
            use std::os::unix::process::ExitStatusExt;
            assert_eq!(
                out.status.signal(),
                Some(libc::SIGABRT),
                "{exit_lanes}: {stderr}"
            );
            assert!(stderr.contains("full-warp shuffle"), "{stderr}");
        } else {
            assert!(out.status.success(), "{exit_lanes}: {stderr}");
        }
    }
}
