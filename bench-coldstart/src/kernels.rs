//! `bench-coldstart kernels`: matrix-vector streaming rate of the CPU kernels on huge-page
//! arenas, against the read bandwidth measured in the same run; with `--attention`, one decode
//! step's paged attention (SmolLM2's shape, a batch of sequences whose blocks are scattered over
//! a `thaw serve`-sized bf16 KV store) against the same bandwidth.

use std::time::Instant;

use anyhow::Result;
use thaw_kernels::ops::{paged_attention, AttnShape, KvData, PagedRow, PagedStore};
use thaw_kernels::{matmul, Isa, Matrix, ThreadPool, Weights};
use thaw_loader::AlignedBuf;

use crate::membw;

#[derive(clap::Args)]
pub struct KernelArgs {
    /// Tokens per call (1 = decode's matrix-vector product).
    #[arg(long, default_value_t = 1)]
    tokens: usize,
    /// Also time decode attention with this many cached positions per sequence (comma list).
    #[arg(long, value_delimiter = ',')]
    attention: Vec<usize>,
    /// Sequences in the decode step timed by --attention.
    #[arg(long, default_value_t = 16)]
    attention_rows: usize,
    /// KV store the --attention sequences' blocks are scattered over, MiB (1024 = `thaw
    /// serve`'s default; a few MiB keep it in cache, which times the kernel's own work).
    #[arg(long, default_value_t = 1024)]
    attention_store_mib: usize,
}

pub fn run(a: KernelArgs) -> Result<()> {
    let pool = ThreadPool::global();
    let bw = membw::read_bandwidth(pool, 1 << 30, 5);
    println!(
        "read bandwidth {bw:.1} GB/s; isa {}; {} threads; {} token(s) per call",
        Isa::detect().name(),
        pool.threads(),
        a.tokens
    );
    for &(rows, k) in &[(49152usize, 576usize), (1536, 576), (576, 1536), (576, 576)] {
        // Enough copies that the working set (~512 MiB) is far beyond the caches.
        let bytes = rows * k * 2;
        let copies = ((512usize << 20) / bytes).max(1);
        let mut arena = AlignedBuf::zeroed(bytes * copies);
        for (i, b) in arena.as_mut_slice().iter_mut().enumerate() {
            *b = if i % 2 == 1 { 0x3f } else { (i % 251) as u8 };
        }
        // SAFETY: the arena is 2 MiB-aligned, so u16 alignment holds; any bits are valid u16s.
        let words: &[u16] = unsafe { arena.as_slice().align_to::<u16>().1 };
        let x = vec![0.5f32; k * a.tokens];
        let mut out = vec![0f32; rows * a.tokens];
        let reps = copies * 4;
        let t = Instant::now();
        for r in 0..reps {
            let c = r % copies;
            let m = Matrix::new(
                Weights::Bf16(&words[c * rows * k..(c + 1) * rows * k]),
                rows,
                k,
            );
            matmul(pool, &x, a.tokens, &mut [(m, &mut out)]);
        }
        let dt = t.elapsed().as_secs_f64();
        let gbs = (reps * bytes) as f64 / dt / 1e9;
        println!(
            "bf16 {rows:>5} x {k:<5} {gbs:6.1} GB/s = {:.2} of read bandwidth, {:8.1} us/call",
            gbs / bw,
            dt / reps as f64 * 1e6
        );
    }
    for &pos in &a.attention {
        attention(pool, pos, a.attention_rows, a.attention_store_mib, bw);
    }
    Ok(())
}

/// One decode step's attention over all layers: `rows` sequences at about `pos` positions, each
/// block of their tables drawn at random from a bf16 store of `store_mib` MiB, laid out
/// [block][layer][slot][kv head][dim] as the runtime's.
fn attention(pool: &ThreadPool, pos: usize, rows: usize, store_mib: usize, bw: f64) {
    let (layers, bs, nkv, hd, nh) = (30usize, 16usize, 3usize, 64usize, 9usize);
    let kv_dim = nkv * hd;
    let block_stride = layers * bs * kv_dim;
    let blocks = ((store_mib << 20) / (2 * 2 * block_stride)).max(1);
    let n = blocks * block_stride;
    // Values that keep the softmax finite; written so the pages exist before timing.
    // In the runtime store's kind of memory (page aligned: a `Vec`'s 16-byte offset makes
    // every 128-byte row straddle three cache lines).
    let fill = |m: usize| -> AlignedBuf {
        let mut b = AlignedBuf::zeroed_small_pages(n * 2);
        // SAFETY: page aligned, so u16 alignment holds; any bits are valid u16s.
        let words = unsafe { b.as_mut_slice().align_to_mut::<u16>().1 };
        for (i, x) in words.iter_mut().enumerate() {
            // bf16 = an f32's high half.
            *x = ((((i * m) % 1009) as f32 / 1009.0 - 0.5).to_bits() >> 16) as u16;
        }
        b
    };
    let (kb, vb) = (fill(7), fill(13));
    // SAFETY: as above.
    let (k, v) = unsafe {
        (
            kb.as_slice().align_to::<u16>().1,
            vb.as_slice().align_to::<u16>().1,
        )
    };
    let mut seed = 0x9E37_79B9_7F4A_7C15u64;
    let tables: Vec<Vec<u32>> = (0..rows)
        .map(|_| {
            (0..(pos + rows).div_ceil(bs))
                .map(|_| {
                    seed ^= seed << 13;
                    seed ^= seed >> 7;
                    seed ^= seed << 17;
                    (seed % blocks as u64) as u32
                })
                .collect()
        })
        .collect();
    let prows: Vec<PagedRow<'_>> = tables
        .iter()
        .enumerate()
        .map(|(i, table)| PagedRow {
            pos: pos + i,
            table,
        })
        .collect();
    let q: Vec<f32> = (0..rows * nh * hd)
        .map(|i| (i % 17) as f32 * 0.05 - 0.4)
        .collect();
    let mut out = vec![0f32; rows * nh * hd];
    let shape = AttnShape {
        n_heads: nh,
        n_kv_heads: nkv,
        head_dim: hd,
    };
    let mut step = || {
        for l in 0..layers {
            let store = PagedStore {
                block_size: bs,
                block_stride,
                layer_off: l * bs * kv_dim,
            };
            let (kd, vd) = (KvData::Bf16(k), KvData::Bf16(v));
            paged_attention(pool, &q, kd, vd, &prows, store, shape, &mut out);
        }
    };
    step();
    let reps = 20;
    let t = Instant::now();
    for _ in 0..reps {
        step();
    }
    let dt = t.elapsed().as_secs_f64() / reps as f64;
    let read: usize = prows
        .iter()
        .map(|r| (r.pos + 1) * layers * kv_dim * 2 * 2)
        .sum();
    let gbs = read as f64 / dt / 1e9;
    println!(
        "attention, {rows} sequences at {pos}+ positions, bf16 KV in {store_mib} MiB: {:.2} ms per step (30 layers), \
         {gbs:.1} GB/s of KV = {:.2} of read bandwidth",
        dt * 1e3,
        gbs / bw
    );
}
