//! # bench-coldstart: measurements as ratios against a floor measured in the same run
//!
//! `decode`: batch-1 decode tokens/s and prefill tokens/s of the CPU backend on a model, beside
//! the memory roofline (weight bytes read per token over the read bandwidth this run measures).
//! `load`, `synth`, `serve` and `coldstart` measure loading, serving and whole cold starts;
//! `gpu` (feature `cuda`) checks and times the CUDA backend.

use clap::{Parser, Subcommand};

mod coldstart;
mod decode;
#[cfg(feature = "cuda")]
mod gpu;
mod kernels;
mod load;
mod load_s3;
mod membw;
mod serve;
mod synth;

#[derive(Parser)]
#[command(
    name = "bench-coldstart",
    about = "Cold-start, load and decode benchmarks for thaw"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Batch-1 decode and prefill speed against the memory roofline.
    Decode(decode::DecodeArgs),
    /// Matrix-product streaming rate against the read bandwidth.
    Kernels(kernels::KernelArgs),
    /// Fresh `thaw serve` processes (and a peer server): exec → listening, ready, first token.
    Coldstart(coldstart::ColdstartArgs),
    /// Every load strategy, page cache warm and cold, against the floor for the same bytes.
    Load(load::LoadArgs),
    /// Serving throughput and latency at several concurrencies (any OpenAI server, or in-process).
    Serve(serve::ServeArgs),
    /// Write a random-weight checkpoint with a real model's shapes and shard layout.
    Synth(synth::SynthArgs),
    /// CUDA backend vs CPU backend on the same weights; load and decode against floors
    /// measured in the same run (scripts/gpu-check.sh; needs `--features cuda` and a GPU).
    #[cfg(feature = "cuda")]
    Gpu(gpu::GpuArgs),
}

fn main() {
    let r = match Cli::parse().cmd {
        Cmd::Decode(a) => decode::run(a),
        Cmd::Kernels(a) => kernels::run(a),
        Cmd::Synth(a) => synth::run(a),
        Cmd::Serve(a) => serve::run(a),
        Cmd::Load(a) => load::run(a),
        Cmd::Coldstart(a) => coldstart::run(a),
        #[cfg(feature = "cuda")]
        Cmd::Gpu(a) => gpu::run(a),
    };
    if let Err(e) = r {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

/// Median, min and max of a sample.
pub fn stats(v: &[f64]) -> (f64, f64, f64) {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    let med = if s.len() % 2 == 1 {
        s[s.len() / 2]
    } else {
        (s[s.len() / 2 - 1] + s[s.len() / 2]) / 2.0
    };
    (med, s[0], s[s.len() - 1])
}
