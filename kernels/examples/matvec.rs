//! Quick matvec bandwidth probe: `cargo run --release -p thaw-kernels --example matvec`.
use std::time::Instant;
use thaw_kernels::{matmul, Matrix, ThreadPool, Weights};

fn main() {
    let pool = ThreadPool::global();
    for &(rows, k) in &[(49152usize, 576usize), (1536, 576), (576, 1536), (576, 576)] {
        let w: Vec<u16> = (0..rows * k).map(|i| (i % 7 + 0x3f00) as u16).collect();
        let x = vec![0.5f32; k];
        let mut out = vec![0f32; rows];
        let m = Matrix::new(Weights::Bf16(&w), rows, k);
        let reps = (2_000_000_000 / (rows * k * 2)).max(3);
        // The same matrix repeatedly is cache-resident when small: use many copies for small ones.
        let copies = (256 << 20) / (rows * k * 2);
        let ws: Vec<Vec<u16>> = (0..copies.max(1)).map(|_| w.clone()).collect();
        let t = Instant::now();
        for r in 0..reps {
            let m = Matrix::new(Weights::Bf16(&ws[r % ws.len()]), rows, k);
            matmul(pool, &x, 1, &mut [(m, &mut out)]);
        }
        let dt = t.elapsed().as_secs_f64();
        let _ = m;
        println!("{rows}x{k}: {:.1} GB/s, {:.1} us/call", (reps * rows * k * 2) as f64 / dt / 1e9, dt / reps as f64 * 1e6);
    }
}
