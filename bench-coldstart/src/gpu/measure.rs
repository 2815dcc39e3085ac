//! Measurements the stages share: the floors (pinned host → device copy bandwidth, device
//! read bandwidth), decode and prefill rates, and the load sweep.

use std::path::Path;
use std::time::Instant;

use anyhow::{Context, Result};
use serde_json::{json, Value};
use thaw_kernels::cuda::{DevBuf, Gpu};
use thaw_kernels::device::DeviceOps;
use thaw_loader::LoadOptions;
use thaw_runtime::compare::prompt;
use thaw_runtime::device_model::CudaLlama;
use thaw_runtime::{SeqChunk, StepModel};

pub fn pinned_h2d(gpu: &Gpu, bytes: usize, reps: usize) -> Result<f64> {
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

/// Seconds of each of `passes` prefills of one `len`-token prompt (a fresh cache, the same
/// positions each pass).
pub fn prefill_times(m: &CudaLlama, len: usize, passes: usize) -> Result<Vec<f64>> {
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
pub fn prefill_rate(m: &CudaLlama, len: usize) -> Result<f64> {
    let times = prefill_times(m, len, 4)?;
    Ok(times[1..]
        .iter()
        .map(|s| len as f64 / s)
        .fold(0.0, f64::max))
}

/// One forward pass of sequence `b`'s `tokens[b]` from position `start` through `tables[b]`
/// for every `b`; their last tokens' logits.
pub fn run_step(
    m: &CudaLlama,
    kv: &mut <CudaLlama as StepModel>::Kv,
    tokens: &[Vec<u32>],
    start: usize,
    tables: &[Vec<u32>],
) -> Result<Vec<f32>> {
    let chunks: Vec<SeqChunk> = (tokens.iter().zip(tables))
        .map(|(t, table)| SeqChunk {
            tokens: t,
            start,
            table,
        })
        .collect();
    Ok(m.forward_batch(&chunks, kv)?)
}

/// Decode tokens/s of `batch` sequences after a 32-token prefill each, the timed steps at
/// positions `ctx`, `ctx + 1`, … (`ctx` > 32: a long context whose keys and values past the
/// prompt are the cache's zeros — attention's cost is the same).
pub fn decode_rate(m: &CudaLlama, batch: usize, steps: usize, ctx: usize) -> Result<f64> {
    let vocab = m.cfg.vocab_size;
    let ctx = ctx.max(32);
    let per_seq = (ctx + steps + 2).div_ceil(16);
    let mut kv = m.new_kv(16, per_seq * batch)?;
    let tables: Vec<Vec<u32>> = (0..batch)
        .map(|b| ((b * per_seq) as u32..((b + 1) * per_seq) as u32).collect())
        .collect();
    let prompts: Vec<Vec<u32>> = (0..batch).map(|b| prompt(vocab, 32, b as u64)).collect();
    run_step(m, &mut kv, &prompts, 0, &tables)?;
    let next: Vec<Vec<u32>> = (0..batch).map(|b| vec![b as u32 + 1]).collect();
    let mut t = Instant::now();
    for s in 0..steps + 2 {
        if s == 2 {
            t = Instant::now(); // two untimed steps: cuBLAS picks its kernels
        }
        run_step(m, &mut kv, &next, ctx + s, &tables)?;
    }
    Ok((batch * steps) as f64 / t.elapsed().as_secs_f64())
}

/// Load GB/s on `dir` (page cache warm) by how the bytes reach the device: the staging ring's
/// shape (buffers = reader threads, chunk size, write-combined) against pinning the page cache
/// in place (threads, chunk, chunks pinned per thread). The default first and last, for the
/// spread.
pub fn load_sweep(dir: &Path, device: usize, h2d: f64) -> Result<Value> {
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
    let up_front = Staging {
        pinned_up_front: true,
        ..staged(16, false)
    };
    let configs = [
        (def.buffers, base.chunk_size, def),
        (16, 8 << 20, staged(16, false)),
        (16, 8 << 20, up_front),
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
        // A configuration that fails costs its line (recorded), not the sweep.
        let l = match load_to_device(&ck, &opts, &ctx, staging) {
            Ok(l) => l,
            Err(e) => {
                println!(
                    "load sweep: ERROR {e:#} — {threads} threads × {} MiB, pin in place {}, depth {}",
                    chunk >> 20,
                    staging.pin_in_place,
                    staging.pin_depth
                );
                rows.push(
                    json!({"threads": threads, "chunk": chunk, "pin_in_place": staging.pin_in_place,
                                 "pin_depth": staging.pin_depth, "error": format!("{e:#}")}),
                );
                continue;
            }
        };
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
                "staged, {threads:>2} buffers × {:>2} MiB{}{}{}: copy wait {:.0} ms",
                chunk >> 20,
                if staging.write_combined { ", write-combined" } else { "" },
                if staging.pinned_up_front {
                    ", pinned up front".to_string()
                } else {
                    format!(
                        ", pinned in the background (first {:.1} ms, {:.0} ms summed)",
                        l.pinned_first_s * 1e3,
                        l.pinned_background_s * 1e3
                    )
                },
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
                         "alloc_s": l.alloc_s, "device_alloc_s": l.device_alloc_s,
                         "pinned_up_front": staging.pinned_up_front, "pinned_first_s": l.pinned_first_s,
                         "pinned_background_s": l.pinned_background_s, "copy_wait_s": l.copy_s, "total_s": l.stats.total_s}));
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

/// The floors: the best of 5 pinned 1 GiB host → device copies (the load's floor) and the
/// device's read bandwidth over 4 GiB (decode's roofline); beside them, the staging ring's
/// pinned allocation one by one vs by 16 threads. Returns the device's JSON, then the two
/// bandwidths in bytes/s.
pub fn floors(device: usize) -> Result<(Value, f64, f64)> {
    let cache = thaw_runtime::device_model::ptx_cache_dir();
    let gpu = Gpu::open(device, cache.as_deref()).context("opening the GPU")?;
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
}
