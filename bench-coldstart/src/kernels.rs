//! `bench-coldstart kernels`: matrix-vector streaming rate of the CPU kernels on huge-page
//! arenas, against the read bandwidth measured in the same run.

use std::time::Instant;

use anyhow::Result;
use thaw_kernels::{matmul, Isa, Matrix, ThreadPool, Weights};
use thaw_loader::AlignedBuf;

use crate::membw;

#[derive(clap::Args)]
pub struct KernelArgs {
    /// Tokens per call (1 = decode's matrix-vector product).
    #[arg(long, default_value_t = 1)]
    tokens: usize,
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
    Ok(())
}
