//! `bench-coldstart decode`: batch-1 decode and prefill on the CPU backend.

use std::time::Instant;

use anyhow::Result;
use serde_json::json;
use thaw_kernels::{Isa, ThreadPool};
use thaw_runtime::fetch::resolve_model;
use thaw_runtime::sampling::argmax;
use thaw_runtime::{KvCache, Llama, TextTokenizer};

use crate::{membw, stats};

#[derive(clap::Args)]
pub struct DecodeArgs {
    #[arg(long, default_value = "default")]
    model: String,
    /// Tokens decoded per run.
    #[arg(long, default_value_t = 128)]
    tokens: usize,
    /// Prompt lengths measured for prefill.
    #[arg(long, value_delimiter = ',', default_value = "104,512")]
    prefill: Vec<usize>,
    #[arg(long, default_value_t = 5)]
    runs: usize,
    #[arg(long)]
    json: bool,
    /// A llama.cpp `llama-bench` binary to measure side by side, on `--peer-gguf`.
    #[arg(long, requires = "peer_gguf")]
    peer_llama_bench: Option<std::path::PathBuf>,
    /// The GGUF the peer runs (e.g. the same weights as F16).
    #[arg(long)]
    peer_gguf: Vec<std::path::PathBuf>,
}

/// Runs llama-bench (batch-1 decode of `gen` tokens, prefill of each `prompts`) with the same
/// thread count; returns (label, decode tokens/s, [(prompt, prefill tokens/s)]).
/// llama-bench's model description, its decode tokens/s, and prefill tokens/s per prompt length.
type PeerRates = (String, f64, Vec<(usize, f64)>);

fn llama_bench(
    bin: &std::path::Path,
    gguf: &std::path::Path,
    threads: usize,
    gen: usize,
    prompts: &[usize],
    runs: usize,
) -> Result<PeerRates> {
    let p: Vec<String> = prompts.iter().map(|p| p.to_string()).collect();
    let mut cmd = std::process::Command::new(bin);
    // scripts/build-llama-cpp.sh installs the shared libraries beside bin/ in lib/.
    if let Some(lib) = bin
        .parent()
        .and_then(|b| b.parent())
        .map(|p| p.join("lib"))
        .filter(|l| l.is_dir())
    {
        cmd.env("LD_LIBRARY_PATH", lib);
    }
    let out = cmd
        .args([
            "-m",
            &gguf.display().to_string(),
            "-t",
            &threads.to_string(),
            "-n",
            &gen.to_string(),
            "-p",
            &p.join(","),
            "-r",
            &runs.to_string(),
            "-o",
            "json",
        ])
        .output()?;
    anyhow::ensure!(
        out.status.success(),
        "llama-bench failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let rows: Vec<serde_json::Value> = serde_json::from_slice(&out.stdout)?;
    let mut decode = 0.0;
    let mut prefill = vec![];
    for r in &rows {
        let ts = r["avg_ts"].as_f64().unwrap_or(0.0);
        match (
            r["n_prompt"].as_u64().unwrap_or(0),
            r["n_gen"].as_u64().unwrap_or(0),
        ) {
            (0, _) => decode = ts,
            (np, 0) => prefill.push((np as usize, ts)),
            _ => {}
        }
    }
    let label = gguf
        .file_name()
        .map(|f| f.to_string_lossy().to_string())
        .unwrap_or_default();
    Ok((label, decode, prefill))
}

/// A deterministic prompt of exactly `n` tokens from ordinary text.
fn prompt(tok: &TextTokenizer, n: usize) -> Result<Vec<u32>> {
    let text = "The lighthouse keeper climbed the spiral stairs each evening, counting the steps as his father had taught him, and watched the ships pass beyond the rocks. ";
    let mut ids = Vec::new();
    while ids.len() < n {
        ids.extend(tok.encode(text, false)?);
    }
    ids.truncate(n);
    Ok(ids)
}

pub fn run(a: DecodeArgs) -> Result<()> {
    let dir = resolve_model(&a.model)?;
    let model = Llama::load(&dir)?;
    let tok = TextTokenizer::load(&dir)?;
    let pool = ThreadPool::global();
    let bw = membw::read_bandwidth(pool, 1 << 30, 5);
    let per_token = model.weight_bytes() as f64;
    let roofline = bw * 1e9 / per_token;

    // Warm up once (page faults, caches).
    let p16 = prompt(&tok, 16)?;
    let mut cache = KvCache::new(&model);
    model.forward(&p16, &mut cache, false)?;

    let mut decode = Vec::new();
    for _ in 0..a.runs {
        let mut cache = KvCache::new(&model);
        let mut logits = model.forward(&p16, &mut cache, false)?;
        let t = Instant::now();
        for _ in 0..a.tokens {
            let id = argmax(&logits);
            logits = model.forward(&[id], &mut cache, false)?;
        }
        decode.push(a.tokens as f64 / t.elapsed().as_secs_f64());
    }
    let (d_med, d_min, d_max) = stats(&decode);
    let mut prefill = Vec::new();
    for &n in &a.prefill {
        let p = prompt(&tok, n)?;
        let mut v = Vec::new();
        for _ in 0..a.runs.min(3) {
            let mut cache = KvCache::new(&model);
            let t = Instant::now();
            model.forward(&p, &mut cache, false)?;
            v.push(n as f64 / t.elapsed().as_secs_f64());
        }
        let (med, min, max) = stats(&v);
        prefill.push(json!({"tokens": n, "tokens_per_s": med, "min": min, "max": max}));
    }
    let mut peers = Vec::new();
    if let Some(bin) = &a.peer_llama_bench {
        for g in &a.peer_gguf {
            let (label, dec, pre) =
                llama_bench(bin, g, pool.threads(), a.tokens, &a.prefill, a.runs)?;
            peers.push(json!({"peer": format!("llama.cpp {label}"), "decode_tokens_per_s": dec,
                "ours_vs_peer_decode": d_med / dec,
                "prefill": pre.iter().map(|(n, t)| json!({"tokens": n, "tokens_per_s": t})).collect::<Vec<_>>()}));
        }
    }
    let out = json!({
        "peers": peers,
        "model": dir.display().to_string(),
        "weight_dtype": model.weight_dtype().name(),
        "weight_format": model.weight_format(),
        "isa": Isa::detect().name(),
        "threads": pool.threads(),
        "weight_bytes_per_token": per_token,
        "read_bandwidth_gb_s": bw,
        "roofline_tokens_per_s": roofline,
        "decode_tokens_per_s": d_med,
        "decode_min": d_min,
        "decode_max": d_max,
        "decode_vs_roofline": d_med / roofline,
        "prefill": prefill,
    });
    if a.json {
        println!("{out}");
    } else {
        println!(
            "model            {} ({}, {} threads, {})",
            out["model"].as_str().unwrap_or(""),
            model.weight_format(),
            pool.threads(),
            Isa::detect().name()
        );
        println!("read bandwidth   {bw:.1} GB/s (best of 5, 1 GiB)");
        println!("bytes per token  {:.1} MB", per_token / 1e6);
        println!("roofline         {roofline:.1} tokens/s");
        println!("decode (batch 1) {d_med:.1} tokens/s (min {d_min:.1}, max {d_max:.1}) = {:.2} of roofline", d_med / roofline);
        for p in out["prefill"].as_array().unwrap() {
            println!(
                "prefill {:>4}     {:.1} tokens/s (min {:.1}, max {:.1})",
                p["tokens"],
                p["tokens_per_s"].as_f64().unwrap(),
                p["min"].as_f64().unwrap(),
                p["max"].as_f64().unwrap()
            );
        }
        for p in out["peers"].as_array().unwrap() {
            println!(
                "{}: decode {:.1} tokens/s (ours = {:.2}x)",
                p["peer"].as_str().unwrap(),
                p["decode_tokens_per_s"].as_f64().unwrap(),
                p["ours_vs_peer_decode"].as_f64().unwrap()
            );
            for (pp, ours) in p["prefill"]
                .as_array()
                .unwrap()
                .iter()
                .zip(out["prefill"].as_array().unwrap())
            {
                let (t, o) = (
                    pp["tokens_per_s"].as_f64().unwrap(),
                    ours["tokens_per_s"].as_f64().unwrap(),
                );
                println!(
                    "  prefill {:>4}  {t:.1} tokens/s (ours = {:.2}x)",
                    pp["tokens"],
                    o / t
                );
            }
        }
    }
    Ok(())
}
