//! `bench-coldstart serve --in-process`: the serving workload of vLLM's `bench serve` (fixed
//! input/output lengths via ignore_eos, N concurrent requests) against the engine in this
//! process — the stand-in until the HTTP worker lands, after which `--url` drives any
//! OpenAI-compatible server. Reports TTFT, TPOT, ITL and end-to-end latency (p50/p90/p99) and
//! total output tokens/s.

use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Result};
use serde_json::json;
use thaw_runtime::engine::{Engine, EngineConfig, Event, Request};
use thaw_runtime::fetch::resolve_model;
use thaw_runtime::{Llama, SamplingParams};

#[derive(clap::Args)]
pub struct ServeArgs {
    #[arg(long, default_value = "default")]
    model: String,
    /// Measure the engine in this process (the HTTP client arrives with the HTTP worker).
    #[arg(long)]
    in_process: bool,
    #[arg(long, value_delimiter = ',', default_value = "1,4,16")]
    concurrency: Vec<usize>,
    #[arg(long, default_value_t = 128)]
    input_len: usize,
    #[arg(long, default_value_t = 128)]
    output_len: usize,
    #[arg(long, default_value_t = 512 << 20)]
    kv_cache_bytes: usize,
    /// Also measure prefix caching: TTFT of a request whose first N tokens were just served for
    /// another request, against the TTFT of the first (uncached) one.
    #[arg(long, default_value_t = 0)]
    shared_prefix: usize,
    #[arg(long)]
    json: bool,
}

/// `n` ordinary-vocabulary token ids from a xorshift stream (prompts that share nothing).
fn random_ids(state: &mut u64, n: usize) -> Vec<u32> {
    (0..n)
        .map(|_| {
            *state ^= *state << 13;
            *state ^= *state >> 7;
            *state ^= *state << 17;
            100 + (*state % 40_000) as u32
        })
        .collect()
}

fn pct(v: &mut [f64], p: f64) -> f64 {
    v.sort_by(f64::total_cmp);
    v[((v.len() - 1) as f64 * p).round() as usize]
}

pub fn run(a: ServeArgs) -> Result<()> {
    if !a.in_process {
        bail!("only --in-process is implemented until the HTTP worker lands");
    }
    let dir = resolve_model(&a.model)?;
    let model = Arc::new(Llama::load(&dir)?);
    let engine = Engine::start(
        model.clone(),
        EngineConfig::with_kv_bytes(&model, a.kv_cache_bytes),
    );
    // Warm up (first touches of the KV store and the weights) as a running server would be.
    engine
        .submit(Request {
            prompt: vec![504, 3575, 282],
            max_tokens: 8,
            sampling: SamplingParams::default(),
            stop_ids: vec![],
            ignore_eos: true,
        })
        .collect();
    let mut results = Vec::new();
    for &c in &a.concurrency {
        // Distinct random prompts (no prefix sharing) of exactly input_len ids.
        let mut state = 0x2545_F491_4F6C_DD1Du64 ^ c as u64;
        let prompts: Vec<Vec<u32>> = (0..c)
            .map(|_| random_ids(&mut state, a.input_len))
            .collect();
        let t0 = Instant::now();
        let handles: Vec<_> = prompts
            .into_iter()
            .map(|p| {
                let mut s = engine.submit(Request {
                    prompt: p,
                    max_tokens: a.output_len,
                    sampling: SamplingParams::default(),
                    stop_ids: vec![],
                    ignore_eos: true,
                });
                std::thread::spawn(move || {
                    let start = Instant::now();
                    let mut times = Vec::new();
                    while let Some(e) = s.recv() {
                        match e {
                            Event::Token(_) => times.push(start.elapsed().as_secs_f64()),
                            _ => break,
                        }
                    }
                    times
                })
            })
            .collect();
        let per: Vec<Vec<f64>> = handles
            .into_iter()
            .map(|h| h.join().unwrap_or_default())
            .collect();
        let wall = t0.elapsed().as_secs_f64();
        let mut ttft: Vec<f64> = per.iter().filter_map(|t| t.first().copied()).collect();
        let mut e2e: Vec<f64> = per.iter().filter_map(|t| t.last().copied()).collect();
        let mut tpot: Vec<f64> = per
            .iter()
            .filter(|t| t.len() > 1)
            .map(|t| (t[t.len() - 1] - t[0]) / (t.len() - 1) as f64)
            .collect();
        let mut itl: Vec<f64> = per
            .iter()
            .flat_map(|t| t.windows(2).map(|w| w[1] - w[0]).collect::<Vec<_>>())
            .collect();
        let tokens: usize = per.iter().map(|t| t.len()).sum();
        let r = json!({
            "concurrency": c, "input_len": a.input_len, "output_len": a.output_len,
            "output_tokens_per_s": tokens as f64 / wall,
            "ttft_ms": {"p50": pct(&mut ttft, 0.5) * 1e3, "p90": pct(&mut ttft, 0.9) * 1e3, "p99": pct(&mut ttft, 0.99) * 1e3},
            "tpot_ms": {"p50": pct(&mut tpot, 0.5) * 1e3, "p90": pct(&mut tpot, 0.9) * 1e3, "p99": pct(&mut tpot, 0.99) * 1e3},
            "itl_ms": {"p50": pct(&mut itl, 0.5) * 1e3, "p99": pct(&mut itl, 0.99) * 1e3},
            "e2e_s": {"p50": pct(&mut e2e, 0.5), "p99": pct(&mut e2e, 0.99)},
        });
        if !a.json {
            println!(
                "concurrency {c:>3}: {:7.1} output tok/s | TTFT p50 {:7.1} p99 {:7.1} ms | TPOT p50 {:6.1} ms | ITL p99 {:6.1} ms | E2E p50 {:.2} s",
                r["output_tokens_per_s"].as_f64().unwrap_or(0.0),
                r["ttft_ms"]["p50"].as_f64().unwrap_or(0.0),
                r["ttft_ms"]["p99"].as_f64().unwrap_or(0.0),
                r["tpot_ms"]["p50"].as_f64().unwrap_or(0.0),
                r["itl_ms"]["p99"].as_f64().unwrap_or(0.0),
                r["e2e_s"]["p50"].as_f64().unwrap_or(0.0),
            );
        }
        results.push(r);
    }
    let mut prefix = serde_json::Value::Null;
    if a.shared_prefix > 0 {
        let mut state = 0x9E37_79B9_7F4A_7C15u64;
        let shared = random_ids(&mut state, a.shared_prefix);
        let ttft = |suffix: Vec<u32>| -> f64 {
            let mut p = shared.clone();
            p.extend(suffix);
            let t = Instant::now();
            let mut s = engine.submit(Request {
                prompt: p,
                max_tokens: 1,
                sampling: SamplingParams::default(),
                stop_ids: vec![],
                ignore_eos: true,
            });
            let _ = s.recv();
            let dt = t.elapsed().as_secs_f64();
            s.collect();
            dt
        };
        let (s1, s2) = (random_ids(&mut state, 16), random_ids(&mut state, 16));
        let cold = ttft(s1);
        let warm = ttft(s2);
        prefix = json!({"prefix_tokens": a.shared_prefix, "uncached_ttft_ms": cold * 1e3, "cached_ttft_ms": warm * 1e3, "ratio": warm / cold});
        if !a.json {
            println!(
                "shared prefix {}: TTFT uncached {:.1} ms, cached {:.1} ms = {:.3} of uncached",
                a.shared_prefix,
                cold * 1e3,
                warm * 1e3,
                warm / cold
            );
        }
    }
    if a.json {
        println!(
            "{}",
            json!({"model": dir.display().to_string(), "results": results, "prefix_cache": prefix})
        );
    }
    Ok(())
}
