//! Stages on the large (8B-shaped) checkpoint: load, decode in one product mode, long-context
//! decode attention, prefill attention, and the short run put under `ncu`.

use std::path::Path;
use std::sync::atomic::Ordering::Relaxed;

use anyhow::{bail, Result};
use serde_json::{json, Value};
use thaw_loader::LoadOptions;
use thaw_runtime::compare::{prompt, rel_err};
use thaw_runtime::device_model::{CudaLlama, OVERLAP_INIT};
use thaw_runtime::StepModel;

use super::measure::{decode_rate, prefill_rate, run_step};

/// Decode A/B, one process per line: the model's defaults as shipped ("default": no
/// overrides — the figure the aim is about), then the matrix-vector kernels (rows ≤ GEMV_MAX_ROWS) vs cuBLAS
/// alone. "gemv": as the model would run them (one row: x staged in shared memory, a warp per
/// 2 outputs, 16-byte loads — the checkpoint's tensors are 16-byte aligned on the device);
/// "gemv-block": one row by a block per 4 outputs (K split over the block), 16-byte loads;
/// "gemv-8B": that with 8-byte loads; "gemv-unfused" runs the RMSNorms as kernels of their own
/// instead of folding them into the products; "gemv-persistent" launches only the blocks the
/// device holds at once; "+graphs": each decode step replayed from a recording of its shape
/// (CUDA graphs) instead of queued launch by launch.
pub const DECODE_MODES: [(usize, &str); 21] = [
    (1, "default"),
    (8, "default"),
    (32, "default"),
    (1, "gemv"),
    (1, "gemv-block"),
    (1, "gemv-8B"),
    (1, "gemv-unfused"),
    (1, "gemv-persistent"),
    (1, "cuBLAS"),
    (1, "gemv+graphs"),
    (1, "cuBLAS+graphs"),
    (2, "gemv"),
    (2, "cuBLAS"),
    (4, "gemv"),
    (4, "cuBLAS"),
    (8, "gemv"),
    (8, "cuBLAS"),
    (8, "gemv+graphs"),
    (8, "cuBLAS+graphs"),
    (32, "cuBLAS"),
    (32, "cuBLAS+graphs"),
];

fn load(dir: &Path, device: usize) -> Result<CudaLlama> {
    Ok(CudaLlama::load(dir, &LoadOptions::default(), device)?)
}

/// The model's load, timed: the first load compiles (or reads from the cache) the kernels and
/// warms the page cache; the second is the one measured.
pub fn big_load(dir: &Path, device: usize, h2d: f64) -> Result<Value> {
    drop(load(dir, device)?);
    let t = std::time::Instant::now();
    let m = load(dir, device)?;
    // The whole `CudaLlama::load` (context, kernels, cuBLAS, weights, assembly): what
    // THAW_CUDA_OVERLAP_INIT changes, where the loader's own span does not see it.
    let wall = t.elapsed().as_secs_f64();
    let st = m.load_stats().clone();
    let load_gbs = st.bytes as f64 / st.total_s / 1e9;
    let p = m.phases.clone();
    let overlap = thaw_runtime::device_model::env_switch(OVERLAP_INIT, false);
    println!(
        "load {}: {:.2} GB in {:.0} ms = {load_gbs:.1} GB/s = {:.0}% of pinned H2D ({}, copy wait {:.0} ms); the model up in {:.0} ms (kernels {})",
        dir.display(),
        st.bytes as f64 / 1e9,
        st.total_s * 1e3,
        100.0 * load_gbs * 1e9 / h2d,
        st.strategy,
        p.copy_s * 1e3,
        wall * 1e3,
        if overlap { "beside the weights" } else { "before the weights" }
    );
    Ok(json!({
        "model": dir, "bytes": st.bytes, "load_s": st.total_s, "load_gb_per_s": load_gbs,
        "model_up_s": wall, "overlap_init": overlap,
        "fraction_of_pinned_h2d": load_gbs * 1e9 / h2d, "strategy": st.strategy,
        "phases_s": {"device_init": p.context_s, "compile": p.compile_s,
                     "compile_cache_hit": p.compile_cache_hit, "module_load": p.module_s,
                     "alloc": p.alloc_s, "plan": st.plan_s, "read": st.io_s,
                     "copy_wait": p.copy_s, "verify": st.verify_s, "widen": p.widen_s},
        "weight_bytes_per_step": m.weight_bytes() as f64,
    }))
}

/// Sets the model's product path to `mode` (see [`DECODE_MODES`]).
fn apply_mode(m: &CudaLlama, mode: &str) -> Result<()> {
    if mode == "default" {
        return Ok(());
    }
    let graphs = mode.ends_with("+graphs");
    let kernels = mode.trim_end_matches("+graphs");
    if !matches!(
        kernels,
        "gemv" | "gemv-block" | "gemv-8B" | "gemv-unfused" | "gemv-persistent" | "cuBLAS"
    ) {
        bail!("unknown decode mode {mode:?}");
    }
    m.set_gemv_max_rows(if kernels == "cuBLAS" {
        0
    } else {
        thaw_kernels::device::GEMV_MAX_ROWS
    });
    let d = m.device();
    d.gemv_vec16.store(kernels != "gemv-8B", Relaxed);
    d.gemv_warp_rows
        .store(!matches!(kernels, "gemv-block" | "gemv-8B"), Relaxed);
    d.gemv_persistent
        .store(kernels == "gemv-persistent", Relaxed);
    m.set_fused_norm(kernels != "gemv-unfused");
    // (Also drops recordings made under the device flags just changed.)
    m.set_graphs(graphs);
    Ok(())
}

/// Decode tokens/s at `batch` in `mode`, against the roofline (`read_bw` / weight bytes per
/// step, times the batch).
pub fn decode_mode(
    dir: &Path,
    device: usize,
    batch: usize,
    mode: &str,
    steps: usize,
    read_bw: f64,
) -> Result<Value> {
    let m = load(dir, device)?;
    apply_mode(&m, mode)?;
    let (launches, g0) = (m.gemv_launches(), m.graph_stats());
    let r = decode_rate(&m, batch, steps, 32)?;
    // Matrix-vector launches per step (0: every product went to cuBLAS, so a silent fallback
    // shows), and steps replayed from a recording (all but the first with "+graphs", else none).
    let per_step = (m.gemv_launches() - launches) as f64 / (steps + 2) as f64;
    let g1 = m.graph_stats();
    let (recorded, replayed) = (g1.captures - g0.captures, g1.replays - g0.replays);
    let roof = read_bw / m.weight_bytes() as f64 * batch as f64;
    // The same decode step's logits in this mode and through cuBLAS queued (the reference):
    // the small checkpoints' checks do not reach this shape's products (K = 4096 and 14336,
    // hundreds of blocks), where a fast but wrong kernel must not win a line.
    let mine = decode_logits(&m, batch)?;
    apply_mode(&m, "cuBLAS")?;
    let reference = decode_logits(&m, batch)?;
    let err = rel_err(&mine, &reference, m.cfg.vocab_size);
    let ok = err.is_finite() && err < LOGITS_LIMIT;
    println!(
        "decode batch {batch:>2} ({mode}): {r:.1} tokens/s; roofline {roof:.1} ({:.0}%); {per_step:.0} gemv launches per step; graphs: {recorded} recorded, {replayed} replayed; logits vs cuBLAS {err:.1e}{}",
        100.0 * r / roof,
        if ok { "" } else { " — MISMATCH" }
    );
    let v = json!({"batch": batch, "mode": mode, "tokens_per_s": r, "gemv_launches_per_step": per_step,
                   "graphs_recorded": recorded, "graphs_replayed": replayed,
                   "roofline_tokens_per_s": roof, "fraction_of_roofline": r / roof,
                   "logits_rel_err_vs_cublas": err, "logits_ok": ok});
    if !ok {
        bail!("logits differ from cuBLAS's by {err:.2e} (limit {LOGITS_LIMIT:.0e}): {v}");
    }
    Ok(v)
}

/// How far a mode's logits may be from cuBLAS's on the bf16 8B shape (the bf16 limit;
/// the two differ only in accumulation order and where activations round).
const LOGITS_LIMIT: f64 = 1e-2;

/// Logits of one decode step of `batch` sequences after a 32-token prefill each (fresh cache,
/// block tables out of order).
fn decode_logits(m: &CudaLlama, batch: usize) -> Result<Vec<f32>> {
    let vocab = m.cfg.vocab_size;
    let mut kv = m.new_kv(16, 3 * batch)?;
    let tables: Vec<Vec<u32>> = (0..batch as u32)
        .map(|b| vec![3 * b + 2, 3 * b, 3 * b + 1])
        .collect();
    let prompts: Vec<Vec<u32>> = (0..batch)
        .map(|b| prompt(vocab, 32, 100 + b as u64))
        .collect();
    run_step(m, &mut kv, &prompts, 0, &tables)?;
    let next: Vec<Vec<u32>> = prompts.iter().map(|p| vec![p[31]]).collect();
    run_step(m, &mut kv, &next, 32, &tables)
}

/// Long contexts: decode attention split over blocks (flash-decoding) vs one block per row and
/// KV head, the products as by default. A failing line is reported and recorded.
pub fn long_context(dir: &Path, device: usize, steps: usize) -> Result<Value> {
    let m = load(dir, device)?;
    let mut long = vec![];
    for (batch, ctx) in [(1usize, 4096usize), (8, 4096)] {
        for split in [true, false] {
            m.set_split_attention(split);
            let how = if split { "split" } else { "whole-row" };
            match decode_rate(&m, batch, steps, ctx) {
                Ok(r) => {
                    println!(
                        "decode batch {batch} at {ctx} positions ({how} attention): {r:.1} tokens/s"
                    );
                    long.push(
                        json!({"batch": batch, "context": ctx, "split_attention": split,
                                     "tokens_per_s": r}),
                    );
                }
                Err(e) => {
                    println!("decode batch {batch} at {ctx} positions ({how}): ERROR {e:#}");
                    long.push(
                        json!({"batch": batch, "context": ctx, "split_attention": split,
                                     "error": format!("{e:#}")}),
                    );
                }
            }
        }
    }
    Ok(json!(long))
}

/// Prefill attention A/B: the flash-style tiled kernel vs the per-row kernel, 512 tokens.
pub fn prefill_ab(dir: &Path, device: usize) -> Result<Value> {
    let m = load(dir, device)?;
    let mut pre = vec![];
    for tiled in [true, false] {
        m.set_tiled_prefill(tiled);
        let r = prefill_rate(&m, 512)?;
        println!(
            "prefill 512 tokens: {r:.0} tokens/s ({} attention)",
            if tiled { "tiled" } else { "per-row" }
        );
        pre.push(json!({"tiled_attention": tiled, "tokens": 512, "tokens_per_s": r}));
    }
    Ok(json!(pre))
}

/// Only decode at batch 1, matrix-vector kernels then cuBLAS, then one 512-token prefill: a
/// short run to put under a profiler (`ncu`).
pub fn profile_decode(dir: &Path, device: usize, steps: usize) -> Result<()> {
    let m = load(dir, device)?;
    for (rows, mode) in [(thaw_kernels::device::GEMV_MAX_ROWS, "gemv"), (0, "cuBLAS")] {
        m.set_gemv_max_rows(rows);
        let r = decode_rate(&m, 1, steps, 32)?;
        println!("profile: decode batch 1 ({mode}): {r:.1} tokens/s");
    }
    let secs = super::measure::prefill_times(&m, 512, 1)?[0];
    println!(
        "profile: prefill 512 tokens in {:.1} ms (under the profiler)",
        secs * 1e3
    );
    Ok(())
}
