//! `bench-coldstart gpu` (feature `cuda`): the CUDA backend checked against the CPU backend and
//! timed against floors measured in the same run — what `scripts/gpu-check.sh` runs on a GPU
//! host.
//!
//! 1. **Floors**: pinned host → device copy bandwidth (the load's floor) and device-memory read
//!    bandwidth (decode's roofline), each the best of several passes.
//! 2. **Correctness** on each `--check` checkpoint: the same prompt through the CPU and CUDA
//!    models (prefill logits, then a batched step of three sequences over scattered,
//!    non-contiguous block tables), relative error `‖a − b‖ / ‖b‖` per logit row; greedy
//!    generations through each backend's engine, several concurrent requests; ids must match
//!    exactly for f32 weights.
//! 3. **Load**: `--big` (an 8B-shaped checkpoint, page cache warm) loaded to the device twice;
//!    GB/s of the second against the pinned floor, and its cold-start phases.
//! 4. **Decode**: batch 1 and batch 32 tokens/s on `--big` against the roofline
//!    (`read bandwidth / weight bytes per step`).
//!
//! Results go to one JSON file (`--out`) and a short table on stdout.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use serde_json::{json, Value};
use thaw_kernels::cuda::{DevBuf, Gpu};
use thaw_kernels::device::DeviceOps;
use thaw_loader::LoadOptions;
use thaw_runtime::compare::{engine_outputs, prompt, rel_err, steps};
use thaw_runtime::device_model::CudaLlama;
use thaw_runtime::{Llama, SeqChunk, StepModel};

#[derive(clap::Args)]
pub struct GpuArgs {
    /// Checkpoints to compare CPU vs CUDA on (small; f32 gets the exact-ids check), each `DIR`
    /// or `DIR=REF` with REF the same weights in f32 (`synth --dtype f32-from-bf16`).
    #[arg(long)]
    check: Vec<String>,
    /// A large checkpoint to time loading and decode on (e.g. `synth --shape llama-3-8b`).
    #[arg(long)]
    big: Option<PathBuf>,
    #[arg(long, default_value_t = 0)]
    device: usize,
    /// Decode steps timed per batch size.
    #[arg(long, default_value_t = 64)]
    steps: usize,
    #[arg(long)]
    out: PathBuf,
    /// Only decode `--big` at batch 1, matrix-vector kernel then cuBLAS, `--steps` steps after a
    /// 32-token prefill each (a short run to put under a profiler such as `ncu`).
    #[arg(long)]
    profile: bool,
}

fn pinned_h2d(gpu: &Gpu, bytes: usize, reps: usize) -> Result<f64> {
    // SAFETY: the pinned buffer is only copied from; its contents do not matter.
    let host = unsafe {
        gpu.ctx
            .alloc_pinned_with_flags::<u8>(bytes, cudarc::driver::sys::CU_MEMHOSTALLOC_PORTABLE)
    }?;
    let mut dev = gpu.stream.alloc_zeros::<u8>(bytes)?;
    let mut best = 0f64;
    for _ in 0..reps + 1 {
        gpu.sync()?;
        let t = Instant::now();
        gpu.stream.memcpy_htod(&host, &mut dev)?;
        gpu.sync()?;
        best = best.max(bytes as f64 / t.elapsed().as_secs_f64());
    }
    Ok(best)
}

/// CPU vs CUDA on `spec` = `DIR` or `DIR=REF`, REF the same weights widened to f32 (`synth
/// --dtype f32-from-bf16`). With 16-bit weights both backends round activations, in different
/// places and orders, and a random-weight network amplifies such differences far more than a
/// trained one (the real SmolLM2 in bf16: 3.1e-3 CPU vs the kernels' emulator): so next to the
/// direct comparison, each backend's distance from the f32 reference says whether the GPU is as
/// close to the exact function as the CPU is.
fn check(spec: &str, device: usize) -> Result<Value> {
    let (dir, reference) = match spec.split_once('=') {
        Some((d, r)) => (PathBuf::from(d), Some(PathBuf::from(r))),
        None => (PathBuf::from(spec), None),
    };
    let cpu = Arc::new(Llama::load(&dir)?);
    let f32_weights = cpu.weight_dtype() == thaw_loader::Dtype::F32;
    let gpu = Arc::new(CudaLlama::load(&dir, &LoadOptions::default(), device)?);
    let vocab = cpu.cfg.vocab_size;
    let (cp, cb) = steps(&*cpu)?;
    let ci = engine_outputs(cpu.clone())?;
    let exact = match &reference {
        Some(r) => Some(steps(&Llama::load(r)?)?),
        None => None,
    };
    let limit = if f32_weights { 1e-4 } else { 1e-2 };
    let mut modes = vec![];
    let mut all_ok = true;
    // Decode products through cuBLAS, then through the matrix-vector kernels (RMSNorm folded
    // in), each queued launch by launch and replayed from recorded decode steps (CUDA graphs):
    // each must pass on its own.
    let gemv = thaw_kernels::device::GEMV_MAX_ROWS;
    let gemv_default = gpu.gemv_max_rows();
    for (mode, gemv_rows, graphs) in [
        ("cuBLAS", 0, false),
        ("gemv", gemv, false),
        ("cuBLAS+graphs", 0, true),
        ("gemv+graphs", gemv, true),
    ] {
        gpu.set_gemv_max_rows(gemv_rows);
        gpu.set_graphs(graphs);
        // A mode that errors fails the check, and the other modes still run.
        let ran = steps(&*gpu).and_then(|s| Ok((s, engine_outputs(gpu.clone())?)));
        let ((gp, gb), gi) = match ran {
            Ok(r) => r,
            Err(e) => {
                println!("check {} ({mode}): ERROR {e:#} — FAIL", dir.display());
                modes.push(
                    json!({"model": dir, "mode": mode, "error": format!("{e:#}"), "pass": false}),
                );
                all_ok = false;
                continue;
            }
        };
        let prefill_err = rel_err(&gp, &cp, vocab);
        let batch_err = rel_err(&gb, &cb, vocab);
        let same = ci.iter().zip(&gi).filter(|(a, b)| a == b).count();
        let direct_ok =
            prefill_err < limit && batch_err < limit && (!f32_weights || same == ci.len());
        let mut v = json!({
            "model": dir, "mode": mode, "dtype": cpu.weight_dtype().to_string(),
            "prefill_rel_err": prefill_err, "batch_rel_err": batch_err, "limit": limit,
            "greedy_equal": same, "requests": ci.len(), "direct_pass": direct_ok,
        });
        let mut ok = direct_ok;
        let mut vs_ref = String::new();
        if let (Some(r), Some((rp, rb))) = (&reference, &exact) {
            let e = |a: &[f32], b: &[f32]| rel_err(a, b, vocab);
            let (gpu_p, gpu_b, cpu_p, cpu_b) = (e(&gp, rp), e(&gb, rb), e(&cp, rp), e(&cb, rb));
            // As close to the exact function as the CPU backend, within a quarter (rounding
            // in different places is not better or worse, only different).
            let ref_ok = gpu_p <= 1.25 * cpu_p && gpu_b <= 1.25 * cpu_b;
            ok = direct_ok || ref_ok;
            vs_ref = format!(
                "; vs the f32 reference: CUDA {gpu_p:.2e}/{gpu_b:.2e}, CPU {cpu_p:.2e}/{cpu_b:.2e} — {}",
                if ref_ok { "as close" } else { "FURTHER" }
            );
            v["reference"] = json!({"model": r, "cuda_prefill": gpu_p, "cuda_batch": gpu_b,
                                    "cpu_prefill": cpu_p, "cpu_batch": cpu_b, "pass": ref_ok});
        }
        let replays = if graphs {
            let g = gpu.graph_stats();
            format!(
                "; {} decode steps recorded, {} replayed",
                g.captures, g.replays
            )
        } else {
            String::new()
        };
        println!(
            "check {} ({mode}): {} weights, prefill rel err {prefill_err:.2e}, later steps {batch_err:.2e} (limit {limit:.0e}); greedy ids equal in {same}/{} requests{vs_ref}{replays} — {}",
            dir.display(),
            cpu.weight_dtype(),
            ci.len(),
            if ok { "PASS" } else { "FAIL" }
        );
        v["pass"] = json!(ok);
        all_ok &= ok;
        modes.push(v);
    }
    // A small model's decode is launch-bound (8 small kernels a layer): the regime where
    // replaying recorded steps should gain most. Default products, queued vs replayed.
    gpu.set_gemv_max_rows(gemv_default);
    let mut decode = vec![];
    for batch in [1usize, 16] {
        for graphs in [false, true] {
            gpu.set_graphs(graphs);
            let how = if graphs { "graphs" } else { "queued" };
            let r = match decode_rate(&gpu, batch, 64, 32) {
                Ok(r) => r,
                Err(e) => {
                    // Reported, and it fails the check, without losing the lines above.
                    println!(
                        "decode {} batch {batch:>2} ({how}): ERROR {e:#}",
                        dir.display()
                    );
                    decode
                        .push(json!({"batch": batch, "graphs": graphs, "error": format!("{e:#}")}));
                    all_ok = false;
                    continue;
                }
            };
            println!(
                "decode {} batch {batch:>2} ({how}): {r:.1} tokens/s",
                dir.display()
            );
            decode.push(json!({"batch": batch, "graphs": graphs, "tokens_per_s": r}));
        }
    }
    gpu.set_graphs(false);
    Ok(json!({"model": dir, "modes": modes, "decode": decode, "pass": all_ok}))
}

/// Seconds of each of `passes` prefills of one `len`-token prompt (a fresh cache, the same
/// positions each pass).
fn prefill_times(m: &CudaLlama, len: usize, passes: usize) -> Result<Vec<f64>> {
    let blocks = len.div_ceil(16);
    let mut kv = m.new_kv(16, blocks)?;
    let table: Vec<u32> = (0..blocks as u32).collect();
    let p = prompt(m.cfg.vocab_size, len, 9);
    let chunk = [SeqChunk {
        tokens: &p,
        start: 0,
        table: &table,
    }];
    (0..passes)
        .map(|_| {
            let t = Instant::now();
            m.forward_batch(&chunk, &mut kv)?;
            Ok(t.elapsed().as_secs_f64())
        })
        .collect()
}

/// Prefill tokens/s of one `len`-token prompt (best of 3, after one untimed pass).
fn prefill_rate(m: &CudaLlama, len: usize) -> Result<f64> {
    let times = prefill_times(m, len, 4)?;
    Ok(times[1..]
        .iter()
        .map(|s| len as f64 / s)
        .fold(0.0, f64::max))
}

/// Decode tokens/s of `batch` sequences after a 32-token prefill each, the timed steps at
/// positions `ctx`, `ctx + 1`, … (`ctx` > 32: a long context whose keys and values past the
/// prompt are the cache's zeros — attention's cost is the same).
fn decode_rate(m: &CudaLlama, batch: usize, steps: usize, ctx: usize) -> Result<f64> {
    let vocab = m.cfg.vocab_size;
    let ctx = ctx.max(32);
    let per_seq = (ctx + steps + 2).div_ceil(16);
    let mut kv = m.new_kv(16, per_seq * batch)?;
    let tables: Vec<Vec<u32>> = (0..batch)
        .map(|b| ((b * per_seq) as u32..((b + 1) * per_seq) as u32).collect())
        .collect();
    let prompts: Vec<Vec<u32>> = (0..batch).map(|b| prompt(vocab, 32, b as u64)).collect();
    let chunks: Vec<SeqChunk> = (0..batch)
        .map(|b| SeqChunk {
            tokens: &prompts[b],
            start: 0,
            table: &tables[b],
        })
        .collect();
    m.forward_batch(&chunks, &mut kv)?;
    let next: Vec<[u32; 1]> = (0..batch).map(|b| [b as u32 + 1]).collect();
    let mut t = Instant::now();
    for s in 0..steps + 2 {
        if s == 2 {
            t = Instant::now(); // two untimed steps: cuBLAS picks its kernels
        }
        let chunks: Vec<SeqChunk> = (0..batch)
            .map(|b| SeqChunk {
                tokens: &next[b],
                start: ctx + s,
                table: &tables[b],
            })
            .collect();
        m.forward_batch(&chunks, &mut kv)?;
    }
    Ok((batch * steps) as f64 / t.elapsed().as_secs_f64())
}

/// Load GB/s on `dir` (page cache warm) by how the bytes reach the device: the staging ring's
/// shape (buffers = reader threads, chunk size, write-combined) against pinning the page cache
/// in place (threads, chunk, chunks pinned per thread). The default first and last, for the
/// spread.
fn load_sweep(dir: &std::path::Path, device: usize, h2d: f64) -> Result<Value> {
    use thaw_loader::cuda::{load_to_device, Staging};
    let ctx = cudarc::driver::CudaContext::new(device)?;
    let ck = thaw_loader::Checkpoint::open(dir)?;
    let def = Staging::default();
    let base = LoadOptions::default();
    // (threads = buffers for the ring, chunk, staging): the default first and last (drift).
    let staged = |buffers, write_combined| Staging {
        buffers,
        write_combined,
        pin_in_place: false,
        ..def
    };
    let in_place = |pin_depth| Staging {
        pin_in_place: true,
        pin_depth,
        ..def
    };
    let configs = [
        (def.buffers, base.chunk_size, def),
        (16, 8 << 20, staged(16, false)),
        (8, 8 << 20, staged(8, false)),
        (16, 4 << 20, staged(16, false)),
        (16, 8 << 20, staged(16, true)),
        (16, 8 << 20, in_place(2)),
        (16, 8 << 20, in_place(4)),
        (8, 32 << 20, in_place(2)),
        (4, 32 << 20, in_place(4)),
        (16, 2 << 20, in_place(4)),
        (def.buffers, base.chunk_size, def),
    ];
    let mut rows = vec![];
    for (threads, chunk, staging) in configs {
        let opts = LoadOptions {
            chunk_size: chunk,
            threads,
            ..LoadOptions::default()
        };
        let l = load_to_device(&ck, &opts, &ctx, staging)?;
        let gbs = l.stats.bytes as f64 / l.stats.total_s / 1e9;
        let how = match &l.mapped {
            Some(m) => format!(
                "pinned in place, {threads} threads × {} × {:>2} MiB: pin {:.0} ms, unpin {:.0} ms, copy wait {:.0} ms (sums over threads)",
                staging.pin_depth,
                chunk >> 20,
                m.pin_s * 1e3,
                m.unpin_s * 1e3,
                m.copy_wait_s * 1e3
            ),
            None => format!(
                "staged, {threads:>2} buffers × {:>2} MiB{}{}: copy wait {:.0} ms",
                chunk >> 20,
                if staging.write_combined { ", write-combined" } else { "" },
                l.stats.fallback.as_deref().map(|f| format!(" (fallback: {f})")).unwrap_or_default(),
                l.copy_s * 1e3
            ),
        };
        println!(
            "load sweep: {gbs:5.1} GB/s = {:3.0}% of pinned H2D, alloc {:.0} ms (device {:.0}), io {:.0} ms — {how}",
            100.0 * gbs * 1e9 / h2d,
            l.alloc_s * 1e3,
            l.device_alloc_s * 1e3,
            l.stats.io_s * 1e3,
        );
        rows.push(json!({"threads": threads, "chunk": chunk, "write_combined": staging.write_combined,
                         "pin_in_place": l.mapped.is_some(), "pin_depth": staging.pin_depth,
                         "mapped": l.mapped, "fallback": l.stats.fallback,
                         "gb_per_s": gbs, "plan_s": l.stats.plan_s, "read_s": l.stats.io_s,
                         "alloc_s": l.alloc_s, "device_alloc_s": l.device_alloc_s, "copy_wait_s": l.copy_s, "total_s": l.stats.total_s}));
    }
    if let Some(best) = rows.iter().max_by(|a, b| {
        let g = |v: &Value| v["gb_per_s"].as_f64().unwrap_or(0.0);
        g(a).total_cmp(&g(b))
    }) {
        println!(
            "load sweep best: {:.1} GB/s = {:.0}% of pinned H2D ({}, {} threads, {} MiB chunks{})",
            best["gb_per_s"].as_f64().unwrap_or(0.0),
            100.0 * best["gb_per_s"].as_f64().unwrap_or(0.0) * 1e9 / h2d,
            if best["pin_in_place"] == true {
                "pinned in place"
            } else {
                "staged"
            },
            best["threads"],
            best["chunk"].as_u64().unwrap_or(0) >> 20,
            if best["pin_in_place"] == true {
                format!(", depth {}", best["pin_depth"])
            } else {
                String::new()
            }
        );
    }
    Ok(json!(rows))
}

fn big_model(dir: &PathBuf, a: &GpuArgs, h2d: f64, read_bw: f64) -> Result<Value> {
    // The first load compiles (or caches) the kernels and warms the page cache; the second is
    // the one measured.
    drop(CudaLlama::load(dir, &LoadOptions::default(), a.device)?);
    let m = CudaLlama::load(dir, &LoadOptions::default(), a.device)?;
    let st = m.load_stats().clone();
    let load_gbs = st.bytes as f64 / st.total_s / 1e9;
    let p = m.phases.clone();
    println!(
        "load {}: {:.2} GB in {:.0} ms = {load_gbs:.1} GB/s = {:.0}% of pinned H2D ({}, copy wait {:.0} ms)",
        dir.display(),
        st.bytes as f64 / 1e9,
        st.total_s * 1e3,
        100.0 * load_gbs * 1e9 / h2d,
        st.strategy,
        p.copy_s * 1e3
    );
    let wb = m.weight_bytes() as f64;
    let roof1 = read_bw / wb;
    let gemv_default = m.gemv_max_rows();
    let mut dec = vec![];
    let mut errors: Vec<Value> = vec![];
    // Decode A/B in one run: the matrix-vector kernels (rows ≤ GEMV_MAX_ROWS) vs cuBLAS alone.
    // "gemv": as the model would run them (one row: x staged in shared memory, a warp per 2
    // outputs, 16-byte loads — the checkpoint's tensors are 16-byte aligned on the device);
    // "gemv-block": one row by a block per 4 outputs (K split over the block), 16-byte loads;
    // "gemv-8B": that with 8-byte loads; "gemv-unfused"
    // runs the RMSNorms as kernels of their own instead of folding them into the products;
    // "gemv-persistent" launches only the blocks the device holds at once; "+graphs": each
    // decode step replayed from a recording of its shape (CUDA graphs) instead of queued
    // launch by launch.
    let modes = [
        (1usize, "gemv"),
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
    for (batch, mode) in modes {
        let graphs = mode.ends_with("+graphs");
        let kernels = mode.trim_end_matches("+graphs");
        let gemv = kernels != "cuBLAS";
        m.set_gemv_max_rows(if gemv {
            thaw_kernels::device::GEMV_MAX_ROWS
        } else {
            0
        });
        m.device()
            .gemv_vec16
            .store(kernels != "gemv-8B", std::sync::atomic::Ordering::Relaxed);
        m.device().gemv_warp_rows.store(
            !matches!(kernels, "gemv-block" | "gemv-8B"),
            std::sync::atomic::Ordering::Relaxed,
        );
        m.set_fused_norm(kernels != "gemv-unfused");
        m.device().gemv_persistent.store(
            kernels == "gemv-persistent",
            std::sync::atomic::Ordering::Relaxed,
        );
        // (Also drops recordings made under the device flags just changed.)
        m.set_graphs(graphs);
        let (launches, g0) = (m.gemv_launches(), m.graph_stats());
        // An experimental mode that fails costs its line, not the rest of the run.
        let r = match decode_rate(&m, batch, a.steps, 32) {
            Ok(r) => r,
            Err(e) => {
                println!("decode batch {batch:>2} ({mode}): ERROR {e:#}");
                errors.push(json!({"stage": format!("decode batch {batch} ({mode})"),
                                   "error": format!("{e:#}")}));
                continue;
            }
        };
        // Matrix-vector launches per step (0: every product went to cuBLAS), and steps
        // replayed from a recording (all but the first with "+graphs", else none).
        let per_step = (m.gemv_launches() - launches) as f64 / (a.steps + 2) as f64;
        let g1 = m.graph_stats();
        let (recorded, replayed) = (g1.captures - g0.captures, g1.replays - g0.replays);
        let roof = roof1 * batch as f64;
        println!(
            "decode batch {batch:>2} ({mode}): {r:.1} tokens/s; roofline {roof:.1} ({:.0}%); {per_step:.0} gemv launches per step; graphs: {recorded} recorded, {replayed} replayed",
            100.0 * r / roof
        );
        dec.push(json!({"batch": batch, "mode": mode, "tokens_per_s": r, "gemv_launches_per_step": per_step,
                        "graphs_recorded": recorded, "graphs_replayed": replayed,
                        "roofline_tokens_per_s": roof, "fraction_of_roofline": r / roof}));
    }
    m.set_graphs(false);
    // Per batch size, the fastest mode against cuBLAS queued launch by launch (the default):
    // what the next defaults should be.
    for batch in [1usize, 2, 4, 8, 32] {
        let rows: Vec<&Value> = dec.iter().filter(|d| d["batch"] == batch).collect();
        let rate = |d: &Value| d["tokens_per_s"].as_f64().unwrap_or(0.0);
        let best = rows
            .iter()
            .copied()
            .max_by(|a, b| rate(a).total_cmp(&rate(b)));
        let base = rows.iter().find(|d| d["mode"] == "cuBLAS");
        if let (Some(best), Some(base)) = (best, base) {
            println!(
                "decode batch {batch:>2} best: {} {:.1} tokens/s ({:.0}% of roofline) = {:.2}× cuBLAS",
                best["mode"].as_str().unwrap_or("?"),
                rate(best),
                100.0 * best["fraction_of_roofline"].as_f64().unwrap_or(0.0),
                rate(best) / rate(base).max(1e-9)
            );
        }
    }
    m.device()
        .gemv_vec16
        .store(true, std::sync::atomic::Ordering::Relaxed);
    m.device()
        .gemv_warp_rows
        .store(true, std::sync::atomic::Ordering::Relaxed);
    m.set_fused_norm(true);
    m.device()
        .gemv_persistent
        .store(false, std::sync::atomic::Ordering::Relaxed);
    // Long contexts: decode attention split over blocks (flash-decoding) vs one block per row
    // and KV head, the products as by default.
    m.set_gemv_max_rows(gemv_default);
    let mut long = vec![];
    for (batch, ctx) in [(1usize, 4096usize), (8, 4096)] {
        for split in [true, false] {
            m.set_split_attention(split);
            let how = if split { "split" } else { "whole-row" };
            let r = match decode_rate(&m, batch, a.steps, ctx) {
                Ok(r) => r,
                Err(e) => {
                    println!("decode batch {batch} at {ctx} positions ({how}): ERROR {e:#}");
                    errors.push(
                        json!({"stage": format!("decode batch {batch} at {ctx} ({how})"),
                                       "error": format!("{e:#}")}),
                    );
                    continue;
                }
            };
            println!("decode batch {batch} at {ctx} positions ({how} attention): {r:.1} tokens/s");
            long.push(
                json!({"batch": batch, "context": ctx, "split_attention": split,
                             "tokens_per_s": r}),
            );
        }
    }
    m.set_split_attention(true);
    m.set_gemv_max_rows(thaw_kernels::device::GEMV_MAX_ROWS);
    // Prefill attention A/B in one run: the flash-style tiled kernel vs the per-row kernel.
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
    m.set_tiled_prefill(true);
    Ok(json!({
        "model": dir, "bytes": st.bytes, "load_s": st.total_s, "load_gb_per_s": load_gbs,
        "prefill": pre, "decode_long_context": long,
        "fraction_of_pinned_h2d": load_gbs * 1e9 / h2d, "strategy": st.strategy,
        "phases_s": {"device_init": p.context_s, "compile": p.compile_s,
                     "compile_cache_hit": p.compile_cache_hit, "module_load": p.module_s,
                     "alloc": p.alloc_s, "plan": st.plan_s, "read": st.io_s,
                     "copy_wait": p.copy_s, "verify": st.verify_s, "widen": p.widen_s},
        "weight_bytes_per_step": wb, "decode": dec, "errors": errors,
    }))
}

/// Runs `f`, turning a panic (a CUDA library cudarc could not load panics inside cudarc) into
/// an error.
fn guard<T>(f: impl FnOnce() -> Result<T>) -> Result<T> {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        Ok(r) => r,
        Err(p) => {
            let msg = p
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_else(|| "a panic".into());
            bail!("panicked: {msg}")
        }
    }
}

fn profile_decode(a: &GpuArgs) -> Result<()> {
    let dir = a.big.as_ref().context("--profile needs --big")?;
    let m = CudaLlama::load(dir, &LoadOptions::default(), a.device)?;
    for (rows, mode) in [(thaw_kernels::device::GEMV_MAX_ROWS, "gemv"), (0, "cuBLAS")] {
        m.set_gemv_max_rows(rows);
        let r = decode_rate(&m, 1, a.steps, 32)?;
        println!("profile: decode batch 1 ({mode}): {r:.1} tokens/s");
    }
    // Then one 512-token prefill (the last forward pass profiled).
    let secs = prefill_times(&m, 512, 1)?[0];
    println!(
        "profile: prefill 512 tokens in {:.1} ms (under the profiler)",
        secs * 1e3
    );
    Ok(())
}

/// Every stage runs even if an earlier one failed (its error is recorded), and the JSON is
/// rewritten after each, so one GPU session yields everything it can.
pub fn run(a: GpuArgs) -> Result<()> {
    if a.profile {
        return profile_decode(&a);
    }
    let t_all = Instant::now();
    let mut out = json!({"checks": [], "big": null, "errors": []});
    let save = |out: &mut Value| -> Result<()> {
        out["seconds"] = json!(t_all.elapsed().as_secs_f64());
        std::fs::write(&a.out, serde_json::to_string_pretty(out)?)
            .with_context(|| format!("writing {}", a.out.display()))
    };
    let fail = |out: &mut Value, what: &str, e: anyhow::Error| {
        println!("{what}: ERROR {e:#}");
        out["errors"]
            .as_array_mut()
            .expect("an array")
            .push(json!({"stage": what, "error": format!("{e:#}")}));
    };
    let floors = guard(|| -> Result<(Value, f64, f64)> {
        let cache = thaw_runtime::device_model::ptx_cache_dir();
        let gpu = Gpu::open(a.device, cache.as_deref()).context("opening the GPU")?;
        let info = gpu.info.clone();
        println!(
            "device: {} (sm_{}{}, {} GiB)",
            info.name,
            info.compute_capability.0,
            info.compute_capability.1,
            info.total_mem >> 30
        );
        let h2d = pinned_h2d(&gpu, 1 << 30, 5)?;
        // The staging ring's pinned buffers (16 × 8 MiB) allocated one after another vs by 16
        // threads at once (the loader's way), alternated, best of 3 each.
        let alloc_ab = || -> Result<(f64, f64)> {
            use thaw_loader::cuda::PinnedBuf;
            let (mut one_by_one, mut at_once) = (f64::MAX, f64::MAX);
            for _ in 0..3 {
                let t = Instant::now();
                let b = (0..16)
                    .map(|_| PinnedBuf::new(&gpu.ctx, 8 << 20, false))
                    .collect::<Result<Vec<_>, _>>()?;
                one_by_one = one_by_one.min(t.elapsed().as_secs_f64());
                drop(b);
                let t = Instant::now();
                let b = PinnedBuf::many(&gpu.ctx, 16, 8 << 20, false)?;
                at_once = at_once.min(t.elapsed().as_secs_f64());
                drop(b);
            }
            Ok((one_by_one, at_once))
        };
        // (A measurement beside the floors: its failure is printed, not fatal.)
        let (one_by_one, at_once) = match alloc_ab() {
            Ok(v) => v,
            Err(e) => {
                println!("pinned staging allocation: ERROR {e:#}");
                (f64::NAN, f64::NAN)
            }
        };
        println!(
            "pinned staging allocation (16 × 8 MiB): {:.1} ms one by one, {:.1} ms by 16 threads",
            one_by_one * 1e3,
            at_once * 1e3
        );
        let probe: DevBuf = gpu.alloc(4 << 30)?;
        let read_bw = gpu.read_bandwidth(&probe, 5)?;
        println!(
            "floors: pinned H2D {:.1} GB/s, device read {:.0} GB/s",
            h2d / 1e9,
            read_bw / 1e9
        );
        let dev = json!({"name": info.name, "compute_capability": [info.compute_capability.0,
                         info.compute_capability.1], "total_mem": info.total_mem,
                         "pinned_alloc_s": {"one_by_one": one_by_one, "threads": at_once},
                         "init_s": {"context": gpu.init.context_s, "compile": gpu.init.compile_s,
                                    "compile_cache_hit": gpu.init.compile_cache_hit,
                                    "module_load": gpu.init.module_s}});
        Ok((dev, h2d, read_bw))
    });
    let (h2d, read_bw) = match floors {
        Ok((dev, h2d, bw)) => {
            out["device"] = dev;
            out["pinned_h2d_bytes_per_s"] = json!(h2d);
            out["device_read_bytes_per_s"] = json!(bw);
            (h2d, bw)
        }
        Err(e) => {
            fail(&mut out, "floors", e);
            save(&mut out)?;
            bail!("no usable GPU (see {})", a.out.display());
        }
    };
    save(&mut out)?;
    for d in &a.check {
        match guard(|| check(d, a.device)) {
            Ok(v) => out["checks"].as_array_mut().expect("an array").push(v),
            Err(e) => fail(&mut out, &format!("check {d}"), e),
        }
        save(&mut out)?;
    }
    if let Some(dir) = &a.big {
        match guard(|| big_model(dir, &a, h2d, read_bw)) {
            Ok(v) => {
                // Modes that failed inside it fail the run too (after the rest was measured).
                if let Some(errs) = v["errors"].as_array() {
                    let all = out["errors"].as_array_mut().expect("an array");
                    all.extend(errs.iter().cloned());
                }
                out["big"] = v;
            }
            Err(e) => fail(&mut out, "big model", e),
        }
        save(&mut out)?;
        match guard(|| load_sweep(dir, a.device, h2d)) {
            Ok(v) => out["load_sweep"] = v,
            Err(e) => fail(&mut out, "load sweep", e),
        }
    }
    let checks = out["checks"].as_array().expect("an array");
    let pass = checks.len() == a.check.len()
        && checks.iter().all(|c| c["pass"] == true)
        && out["errors"].as_array().is_some_and(|e| e.is_empty());
    out["pass"] = json!(pass);
    save(&mut out)?;
    println!("wrote {}", a.out.display());
    if !pass {
        bail!("the GPU check failed (see above and {})", a.out.display());
    }
    Ok(())
}
