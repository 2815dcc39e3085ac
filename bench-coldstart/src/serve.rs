//! `bench-coldstart serve`: the serving workload of vLLM's `bench serve`.
//!
//! `--url URL` drives any OpenAI-compatible server (thaw, llama.cpp's `llama-server`, vLLM) over
//! HTTP with streamed `/v1/completions`; `--in-process` drives thaw's engine directly (no HTTP),
//! which isolates the engine from the server. Both use the same workload and definitions:
//!
//! * prompts of exactly `--input-len` token ids (sent as ids, so every server sees the same
//!   tokens), `--dataset random` (distinct prompts) or `fixed` (one prompt for all requests:
//!   prefix caching may apply); outputs of exactly `--output-len` tokens via `ignore_eos`;
//!   greedy sampling;
//! * `--num-prompts` requests per level, at most `--concurrency` in flight (vLLM's
//!   `--max-concurrency` with an infinite request rate);
//! * TTFT = request sent → first streamed token; ITL = gaps between streamed chunks; TPOT =
//!   (E2E − TTFT) / (output tokens − 1); E2E = sent → last token; output tokens/s = all output
//!   tokens / wall time of the level. p50/p90/p99 of each.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use futures_util::StreamExt;
use serde_json::{json, Value};
use thaw_runtime::engine::{Engine, EngineConfig, Event, Request};
use thaw_runtime::fetch::resolve_model;
use thaw_runtime::{Llama, SamplingParams};

#[derive(clap::Args)]
pub struct ServeArgs {
    /// Base URL of an OpenAI-compatible server (e.g. http://127.0.0.1:8000).
    #[arg(long, conflicts_with = "in_process")]
    url: Option<String>,
    /// Drive the engine in this process instead of a server.
    #[arg(long)]
    in_process: bool,
    /// Model for --in-process; with --url, sent as the `model` field only if --served-model.
    #[arg(long, default_value = "default")]
    model: String,
    /// `model` field to send with --url.
    #[arg(long)]
    served_model: Option<String>,
    #[arg(long, env = "OPENAI_API_KEY", hide_env_values = true)]
    api_key: Option<String>,
    #[arg(long, value_delimiter = ',', default_value = "1,4,16,64")]
    concurrency: Vec<usize>,
    /// Requests per concurrency level (default: max(2 × concurrency, 8)).
    #[arg(long)]
    num_prompts: Option<usize>,
    #[arg(long, default_value_t = 128)]
    input_len: usize,
    #[arg(long, default_value_t = 128)]
    output_len: usize,
    /// random: distinct prompts; fixed: the same prompt for every request.
    #[arg(long, default_value = "random")]
    dataset: String,
    /// KV cache memory for --in-process.
    #[arg(long, default_value_t = 512 << 20)]
    kv_cache_bytes: usize,
    /// Also measure prefix caching: TTFT of a request whose first N tokens were just served for
    /// another request, against the TTFT of the first (uncached) one.
    #[arg(long, default_value_t = 0)]
    shared_prefix: usize,
    /// Name for this side in the output (e.g. "thaw bf16", "llama-server F16 -np 16").
    #[arg(long, default_value = "")]
    label: String,
    /// With --url: `response_format` type to ask for (`json_object`: JSON mode, whose outputs
    /// end when their object closes).
    #[arg(long, requires = "url")]
    response_format: Option<String>,
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

/// What one request saw.
#[derive(Default, Debug)]
struct Outcome {
    /// Seconds after sending at which each non-empty chunk arrived.
    chunks: Vec<f64>,
    output_tokens: usize,
    error: Option<String>,
}

fn pct(v: &[f64], p: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    s[((s.len() - 1) as f64 * p).round() as usize]
}

fn dist_ms(v: &[f64]) -> Value {
    json!({"mean": v.iter().sum::<f64>() / v.len().max(1) as f64 * 1e3,
           "p50": pct(v, 0.5) * 1e3, "p90": pct(v, 0.9) * 1e3, "p99": pct(v, 0.99) * 1e3})
}

fn summarize(c: usize, a: &ServeArgs, outs: &[Outcome], wall: f64) -> Value {
    let ok: Vec<&Outcome> = outs
        .iter()
        .filter(|o| o.error.is_none() && !o.chunks.is_empty())
        .collect();
    let ttft: Vec<f64> = ok.iter().map(|o| o.chunks[0]).collect();
    let e2e: Vec<f64> = ok.iter().map(|o| *o.chunks.last().unwrap()).collect();
    let tpot: Vec<f64> = ok
        .iter()
        .filter(|o| o.output_tokens > 1)
        .map(|o| (o.chunks.last().unwrap() - o.chunks[0]) / (o.output_tokens - 1) as f64)
        .collect();
    let itl: Vec<f64> = ok
        .iter()
        .flat_map(|o| o.chunks.windows(2).map(|w| w[1] - w[0]).collect::<Vec<_>>())
        .collect();
    let tokens: usize = ok.iter().map(|o| o.output_tokens).sum();
    let errors: Vec<&String> = outs.iter().filter_map(|o| o.error.as_ref()).collect();
    json!({
        "concurrency": c, "requests": outs.len(), "completed": ok.len(), "failed": errors.len(),
        "first_error": errors.first(),
        "input_len": a.input_len, "output_len": a.output_len, "dataset": a.dataset,
        "wall_s": wall,
        "output_tokens": tokens,
        "output_tokens_per_s": tokens as f64 / wall,
        "requests_per_s": ok.len() as f64 / wall,
        "ttft_ms": dist_ms(&ttft), "tpot_ms": dist_ms(&tpot), "itl_ms": dist_ms(&itl),
        "e2e_ms": dist_ms(&e2e),
    })
}

fn print_row(label: &str, r: &Value) {
    let f = |p: &str, k: &str| r[p][k].as_f64().unwrap_or(f64::NAN);
    println!(
        "{label}c={:>3} n={:>3}: {:7.1} out tok/s | TTFT p50 {:7.1} p90 {:7.1} p99 {:7.1} ms | TPOT p50 {:6.1} p99 {:6.1} ms | ITL p50 {:6.1} p99 {:6.1} ms | E2E p50 {:7.0} p99 {:7.0} ms{}",
        r["concurrency"], r["requests"],
        r["output_tokens_per_s"].as_f64().unwrap_or(0.0),
        f("ttft_ms", "p50"), f("ttft_ms", "p90"), f("ttft_ms", "p99"),
        f("tpot_ms", "p50"), f("tpot_ms", "p99"),
        f("itl_ms", "p50"), f("itl_ms", "p99"),
        f("e2e_ms", "p50"), f("e2e_ms", "p99"),
        match r["failed"].as_u64() {
            Some(0) | None => String::new(),
            Some(n) => format!(" | {n} FAILED: {}", r["first_error"]),
        }
    );
}

/// The prompts of one level.
fn prompts(a: &ServeArgs, c: usize, n: usize) -> Vec<Vec<u32>> {
    let mut state = 0x2545_F491_4F6C_DD1Du64 ^ c as u64;
    match a.dataset.as_str() {
        "fixed" => {
            let p = random_ids(&mut state, a.input_len);
            vec![p; n]
        }
        _ => (0..n)
            .map(|_| random_ids(&mut state, a.input_len))
            .collect(),
    }
}

/// Sends requests to whoever is measured: at most `concurrency` in flight.
trait Target: Sync {
    fn run(&self, prompts: Vec<Vec<u32>>, max_tokens: usize, concurrency: usize) -> Vec<Outcome>;
}

struct InProcess {
    engine: Engine,
}

impl InProcess {
    fn one(&self, prompt: Vec<u32>, max_tokens: usize) -> Outcome {
        let start = Instant::now();
        let mut s = self.engine.submit(Request {
            prompt,
            max_tokens,
            sampling: SamplingParams::default(),
            stop_ids: vec![],
            ignore_eos: true,
            logprobs: None,
            min_tokens: 0,
            prompt_logprobs: None,
            constraint: None,
        });
        let mut o = Outcome::default();
        while let Some(e) = s.recv() {
            match e {
                Event::Token { .. } => o.chunks.push(start.elapsed().as_secs_f64()),
                Event::PromptLogprobs(_) => {}
                Event::Finished { .. } => break,
                Event::Error(e) => {
                    o.error = Some(e);
                    break;
                }
            }
        }
        o.output_tokens = o.chunks.len();
        o
    }
}

impl Target for InProcess {
    fn run(&self, prompts: Vec<Vec<u32>>, max_tokens: usize, concurrency: usize) -> Vec<Outcome> {
        let next = AtomicUsize::new(0);
        let prompts = &prompts;
        let mut outs: Vec<(usize, Outcome)> = std::thread::scope(|sc| {
            let hs: Vec<_> = (0..concurrency.min(prompts.len()))
                .map(|_| {
                    let next = &next;
                    sc.spawn(move || {
                        let mut mine = vec![];
                        loop {
                            let i = next.fetch_add(1, Ordering::Relaxed);
                            if i >= prompts.len() {
                                return mine;
                            }
                            mine.push((i, self.one(prompts[i].clone(), max_tokens)));
                        }
                    })
                })
                .collect();
            hs.into_iter()
                .flat_map(|h| h.join().unwrap_or_default())
                .collect()
        });
        outs.sort_by_key(|(i, _)| *i);
        outs.into_iter().map(|(_, o)| o).collect()
    }
}

struct Http {
    rt: tokio::runtime::Runtime,
    client: reqwest::Client,
    url: String,
    /// Fields every request carries besides the prompt and limits (`model`, `response_format`).
    fields: Value,
    api_key: Option<String>,
}

impl Http {
    async fn one(
        client: reqwest::Client,
        url: String,
        fields: Value,
        key: Option<String>,
        prompt: Vec<u32>,
        max_tokens: usize,
    ) -> Outcome {
        let mut body = json!({
            "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": true,
            "stream": true, "stream_options": {"include_usage": true},
        });
        for (k, v) in fields.as_object().into_iter().flatten() {
            body[k] = v.clone();
        }
        let mut o = Outcome::default();
        let start = Instant::now();
        let send = || {
            let mut rq = client.post(format!("{url}/v1/completions")).json(&body);
            if let Some(k) = &key {
                rq = rq.bearer_auth(k);
            }
            rq.send()
        };
        // A connection the server closed while idle in the pool fails before the request is
        // sent; one retry on a fresh connection is what any client does (llama-server closes
        // idle keep-alive connections, which otherwise shows up as failed requests).
        let resp = match send().await {
            Ok(r) => Ok(r),
            Err(e) if e.is_request() || e.is_connect() => send().await,
            Err(e) => Err(e),
        };
        let resp = match resp {
            Ok(r) => r,
            Err(e) => {
                o.error = Some(format!("{e:?}"));
                return o;
            }
        };
        if !resp.status().is_success() {
            let st = resp.status();
            o.error = Some(format!("{st}: {}", resp.text().await.unwrap_or_default()));
            return o;
        }
        let mut usage_tokens = None;
        let mut buf: Vec<u8> = Vec::new();
        let mut stream = resp.bytes_stream();
        'read: while let Some(chunk) = stream.next().await {
            let chunk = match chunk {
                Ok(c) => c,
                Err(e) => {
                    o.error = Some(e.to_string());
                    break;
                }
            };
            let t = start.elapsed().as_secs_f64();
            buf.extend_from_slice(&chunk);
            while let Some(pos) = buf.windows(2).position(|w| w == b"\n\n") {
                let event: Vec<u8> = buf.drain(..pos + 2).collect();
                for line in String::from_utf8_lossy(&event).lines() {
                    let Some(data) = line.strip_prefix("data:").map(str::trim) else {
                        continue;
                    };
                    if data == "[DONE]" {
                        break 'read;
                    }
                    let Ok(v) = serde_json::from_str::<Value>(data) else {
                        continue;
                    };
                    if let Some(e) = v.get("error") {
                        o.error = Some(e.to_string());
                        break 'read;
                    }
                    if let Some(n) = v["usage"]["completion_tokens"].as_u64() {
                        usage_tokens = Some(n as usize);
                    }
                    let text = v["choices"][0]["text"].as_str().unwrap_or("");
                    if !text.is_empty() {
                        o.chunks.push(t);
                    }
                }
            }
        }
        o.output_tokens = usage_tokens.unwrap_or(o.chunks.len());
        o
    }
}

impl Target for Http {
    fn run(&self, prompts: Vec<Vec<u32>>, max_tokens: usize, concurrency: usize) -> Vec<Outcome> {
        self.rt.block_on(async {
            let prompts = Arc::new(prompts);
            let next = Arc::new(AtomicUsize::new(0));
            let mut tasks = Vec::new();
            for _ in 0..concurrency.min(prompts.len()) {
                let (prompts, next) = (prompts.clone(), next.clone());
                let (client, url, fields, key) = (
                    self.client.clone(),
                    self.url.clone(),
                    self.fields.clone(),
                    self.api_key.clone(),
                );
                tasks.push(tokio::spawn(async move {
                    let mut mine = vec![];
                    loop {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        if i >= prompts.len() {
                            return mine;
                        }
                        let o = Http::one(
                            client.clone(),
                            url.clone(),
                            fields.clone(),
                            key.clone(),
                            prompts[i].clone(),
                            max_tokens,
                        )
                        .await;
                        mine.push((i, o));
                    }
                }));
            }
            let mut outs = Vec::new();
            for t in tasks {
                outs.extend(t.await.unwrap_or_default());
            }
            outs.sort_by_key(|(i, _)| *i);
            outs.into_iter().map(|(_, o)| o).collect()
        })
    }
}

pub fn run(a: ServeArgs) -> Result<()> {
    let target: Box<dyn Target> = if let Some(url) = &a.url {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()?;
        Box::new(Http {
            rt,
            client: reqwest::Client::builder()
                .pool_max_idle_per_host(256)
                .build()?,
            url: url.trim_end_matches('/').to_string(),
            fields: {
                let mut f = json!({});
                if let Some(m) = &a.served_model {
                    f["model"] = json!(m);
                }
                if let Some(t) = &a.response_format {
                    f["response_format"] = json!({ "type": t });
                }
                f
            },
            api_key: a.api_key.clone(),
        })
    } else if a.in_process {
        let dir = resolve_model(&a.model)?;
        let model = Arc::new(Llama::load(&dir)?);
        let engine = Engine::start(
            model.clone(),
            EngineConfig::with_kv_bytes(&*model, a.kv_cache_bytes),
        )?;
        Box::new(InProcess { engine })
    } else {
        bail!("give --url URL (an OpenAI-compatible server) or --in-process");
    };
    // Warm up (first touches of the KV store and the weights; the server's connection pool).
    let w = target.run(vec![vec![504, 3575, 282]], 8, 1);
    if let Some(e) = &w[0].error {
        bail!("the warmup request failed: {e}");
    }
    let label = if a.label.is_empty() {
        String::new()
    } else {
        format!("{}: ", a.label)
    };
    let mut results = Vec::new();
    for &c in &a.concurrency {
        let n = a.num_prompts.unwrap_or((2 * c).max(8));
        let ps = prompts(&a, c, n);
        let t0 = Instant::now();
        let outs = target.run(ps, a.output_len, c);
        let r = summarize(c, &a, &outs, t0.elapsed().as_secs_f64());
        if !a.json {
            print_row(&label, &r);
        }
        results.push(r);
    }
    let mut prefix = Value::Null;
    if a.shared_prefix > 0 {
        let mut state = 0x9E37_79B9_7F4A_7C15u64;
        let shared = random_ids(&mut state, a.shared_prefix);
        let ttft = |suffix: Vec<u32>| -> Result<f64> {
            let mut p = shared.clone();
            p.extend(suffix);
            let o = target.run(vec![p], 1, 1).pop().context("no outcome")?;
            if let Some(e) = o.error {
                bail!("prefix request failed: {e}");
            }
            o.chunks.first().copied().context("no token")
        };
        let (s1, s2) = (random_ids(&mut state, 16), random_ids(&mut state, 16));
        let cold = ttft(s1)?;
        let warm = ttft(s2)?;
        prefix = json!({"prefix_tokens": a.shared_prefix, "uncached_ttft_ms": cold * 1e3,
                        "cached_ttft_ms": warm * 1e3, "ratio": warm / cold});
        if !a.json {
            println!(
                "{label}shared prefix {}: TTFT uncached {:.1} ms, cached {:.1} ms = {:.3} of uncached",
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
            json!({"label": a.label, "target": a.url.clone().unwrap_or_else(|| format!("in-process {}", a.model)),
                   "results": results, "prefix_cache": prefix})
        );
    }
    Ok(())
}
