//! `bench-coldstart load`: every load strategy on a checkpoint, page cache warm and cold, against
//! the floor for the same bytes measured in the same run — warm: an in-process memory copy;
//! cold: the best large-block O_DIRECT read of the files at several queue depths.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result};
use serde_json::json;
use thaw_loader::{Checkpoint, HostWeights, LoadOptions, LoadPlan, Strategy, Verify};

use crate::stats;

#[derive(clap::Args)]
pub struct LoadArgs {
    #[arg(long, default_value = "default")]
    model: String,
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "uring-direct,pread,mmap,auto"
    )]
    strategies: Vec<Strategy>,
    /// Page-cache states to measure: warm, cold.
    #[arg(long, value_delimiter = ',', default_value = "warm,cold")]
    cache: Vec<String>,
    #[arg(long, default_value_t = 5)]
    runs: usize,
    #[arg(long, default_value_t = 8 << 20)]
    chunk_size: u64,
    #[arg(long, default_value_t = 16)]
    queue_depth: usize,
    /// Verify the manifest: auto (when present) or off.
    #[arg(long, default_value = "auto")]
    verify: String,
    #[arg(long)]
    json: bool,
    /// Also time Python `safetensors.numpy.load_file` on the same files (needs `pip install
    /// safetensors numpy`; numpy has no bfloat16, so use an f16/f32 checkpoint).
    #[arg(long)]
    peer_python: bool,
    /// Also time llama.cpp's model load (llama-cpp-python's `llama_model_load_from_file`, which
    /// includes its vocabulary) of this GGUF — e.g. the F16 file of the same weights — against
    /// thaw's full model load (weights with `auto` + tokenizer) in the same run.
    #[arg(long)]
    peer_llama_cpp: Option<PathBuf>,
    /// For an s3:// model: also time boto3's `download_fileobj` of the same objects with this
    /// Python (one that has boto3, e.g. $THAW_HOME/venv/bin/python).
    #[arg(long)]
    peer_boto3: Option<String>,
}

const LLAMA_CPP_PEER: &str = r#"
import sys, time, llama_cpp
llama_cpp.llama_backend_init()
p = llama_cpp.llama_model_default_params()
p.use_mmap = True
t = time.perf_counter()
m = llama_cpp.llama_model_load_from_file(sys.argv[1].encode(), p)
dt = time.perf_counter() - t
if not m:
    sys.exit("llama.cpp could not load " + sys.argv[1])
print(dt)
llama_cpp.llama_model_free(m)
"#;

fn llama_cpp_load(gguf: &std::path::Path) -> Result<f64> {
    let out = std::process::Command::new("python3")
        .arg("-c")
        .arg(LLAMA_CPP_PEER)
        .arg(gguf)
        .output()?;
    anyhow::ensure!(
        out.status.success(),
        "llama-cpp-python failed: {}",
        String::from_utf8_lossy(&out.stderr)
            .lines()
            .last()
            .unwrap_or("")
    );
    Ok(String::from_utf8_lossy(&out.stdout).trim().parse()?)
}

const PY_PEER: &str = r#"
import sys, time
from safetensors.numpy import load_file
t = time.perf_counter()
n = 0
for f in sys.argv[1:]:
    d = load_file(f)
    n += sum(v.nbytes for v in d.values())
print(time.perf_counter() - t, n)
"#;

/// Seconds Python's safetensors takes to load `files` (timed inside the interpreter).
fn python_load(files: &[PathBuf]) -> Result<f64> {
    python_timed("python3", "python safetensors", PY_PEER, files)
}

/// Runs `script` with `python` and `args`; the first number it prints is the seconds it timed.
pub fn python_timed(
    python: &str,
    what: &str,
    script: &str,
    args: impl IntoIterator<Item = impl AsRef<std::ffi::OsStr>>,
) -> Result<f64> {
    let out = std::process::Command::new(python)
        .arg("-c")
        .arg(script)
        .args(args)
        .output()
        .with_context(|| format!("running {python}"))?;
    anyhow::ensure!(
        out.status.success(),
        "{what} failed: {}",
        String::from_utf8_lossy(&out.stderr)
            .lines()
            .last()
            .unwrap_or("")
    );
    let text = String::from_utf8_lossy(&out.stdout);
    Ok(text
        .split_whitespace()
        .next()
        .with_context(|| format!("no timing from {what}"))?
        .parse()?)
}

/// Drops the files' pages from the page cache: the whole cache where permitted, else each file's
/// pages with posix_fadvise(DONTNEED). Returns the method used.
pub fn evict(files: &[PathBuf]) -> &'static str {
    // SAFETY: sync has no preconditions.
    unsafe { libc::sync() };
    if std::fs::write("/proc/sys/vm/drop_caches", "1\n").is_ok() {
        return "drop_caches";
    }
    for f in files {
        if let Ok(file) = File::open(f) {
            // SAFETY: fadvise on an open descriptor; advisory only.
            unsafe { libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
        }
    }
    "fadvise"
}

/// Memory-copy floor: GB/s of one plain copy between two pre-faulted buffers (up to 1 GiB,
/// repeated to cover `bytes`).
fn memcpy_floor(bytes: u64) -> f64 {
    let n = bytes.min(1 << 30) as usize;
    let src = vec![1u8; n];
    let mut dst = vec![0u8; n];
    dst.copy_from_slice(&src);
    let mut best = 0f64;
    for _ in 0..3 {
        let t = Instant::now();
        let mut done = 0u64;
        while done < bytes {
            let k = ((bytes - done) as usize).min(n);
            dst[..k].copy_from_slice(&src[..k]);
            done += k as u64;
        }
        std::hint::black_box(&dst);
        best = best.max(bytes as f64 / t.elapsed().as_secs_f64() / 1e9);
    }
    best
}

/// Direct-read floor: the best GB/s of O_DIRECT reads of the shards (up to 2 GiB in all) in
/// `block`-sized requests at each queue depth, into pre-faulted buffers.
fn direct_floor(files: &[PathBuf], block: usize) -> Result<Vec<(usize, f64)>> {
    use io_uring::{opcode, types, IoUring};
    let mut out = Vec::new();
    for depth in [1usize, 4, 16, 32] {
        let mut bufs: Vec<thaw_loader::AlignedBuf> = (0..depth)
            .map(|_| thaw_loader::AlignedBuf::zeroed(block))
            .collect();
        for b in &mut bufs {
            b.as_mut_slice().fill(1);
        }
        let mut ring = IoUring::new(depth as u32)?;
        let t = Instant::now();
        let mut total = 0u64;
        let budget = 2u64 << 30;
        'files: for f in files {
            let file = std::fs::OpenOptions::new()
                .read(true)
                .custom_flags(libc::O_DIRECT)
                .open(f)
                .with_context(|| format!("O_DIRECT open {}", f.display()))?;
            let len = file.metadata()?.len();
            let mut off = 0u64;
            let mut free: Vec<usize> = (0..depth).collect();
            let mut inflight = 0;
            loop {
                while off < len && total < budget {
                    let Some(b) = free.pop() else { break };
                    let ptr = bufs[b].as_mut_slice().as_mut_ptr();
                    let e = opcode::Read::new(types::Fd(file.as_raw_fd()), ptr, block as u32)
                        .offset(off)
                        .build()
                        .user_data(b as u64);
                    // SAFETY: buffer b is ours until its completion is reaped below.
                    unsafe { ring.submission().push(&e).expect("queue sized to depth") };
                    off += block as u64;
                    total += block.min((len.saturating_sub(off - block as u64)) as usize) as u64;
                    inflight += 1;
                }
                if inflight == 0 {
                    break;
                }
                ring.submit_and_wait(1)?;
                let done: Vec<(u64, i32)> = ring
                    .completion()
                    .map(|c| (c.user_data(), c.result()))
                    .collect();
                for (b, res) in done {
                    anyhow::ensure!(
                        res >= 0,
                        "O_DIRECT read of {} failed: {}",
                        f.display(),
                        std::io::Error::from_raw_os_error(-res)
                    );
                    free.push(b as usize);
                    inflight -= 1;
                }
            }
            if total >= budget {
                break 'files;
            }
        }
        out.push((depth, total as f64 / t.elapsed().as_secs_f64() / 1e9));
    }
    Ok(out)
}

pub fn run(a: LoadArgs) -> Result<()> {
    if a.model.starts_with("s3://") {
        return crate::load_s3::run(crate::load_s3::S3Args {
            model: &a.model,
            runs: a.runs,
            queue_depth: a.queue_depth,
            verify: if a.verify == "off" {
                Verify::Off
            } else {
                Verify::Auto
            },
            peer_boto3: a.peer_boto3.as_deref(),
            json: a.json,
        });
    }
    let dir = thaw_runtime::fetch::resolve_model(&a.model)?;
    let ck = Checkpoint::open(&dir)?;
    let files: Vec<PathBuf> = ck.shards.iter().map(|s| s.path.clone()).collect();
    let plan = LoadPlan::new(&ck, a.chunk_size);
    let bytes = plan.total_bytes();
    let verify = if a.verify == "off" {
        Verify::Off
    } else {
        Verify::Auto
    };
    let mut rows = Vec::new();
    let warm_floor = memcpy_floor(bytes);
    let cold_floors = if a.cache.iter().any(|c| c == "cold") {
        direct_floor(&files, 8 << 20)?
    } else {
        vec![]
    };
    let cold_floor = cold_floors.iter().map(|x| x.1).fold(0.0, f64::max);
    let mut evict_method = "";
    for cache in &a.cache {
        for &strategy in &a.strategies {
            let mut gbs = Vec::new();
            let mut last = None;
            for _ in 0..a.runs {
                if cache == "cold" {
                    evict_method = evict(&files);
                } else {
                    warm(&files)?;
                }
                let opts = LoadOptions {
                    strategy,
                    chunk_size: a.chunk_size,
                    queue_depth: a.queue_depth,
                    verify,
                    ..LoadOptions::default()
                };
                let t = Instant::now();
                let w = HostWeights::load_with(Checkpoint::open(&dir)?, &opts, &mut |_| {})?;
                let secs = t.elapsed().as_secs_f64();
                gbs.push(bytes as f64 / secs / 1e9);
                last = Some(w.stats.clone());
                drop(w);
            }
            let (med, min, max) = stats(&gbs);
            let floor = if cache == "cold" {
                cold_floor
            } else {
                warm_floor
            };
            let st = last.expect("at least one run");
            rows.push(json!({
                "cache": cache, "strategy": strategy.name(), "used": st.strategy, "fallback": st.fallback,
                "gb_s": med, "min": min, "max": max, "floor_gb_s": floor, "ratio": med / floor,
                "verified": st.verified, "verify_s": st.verify_s, "io_s": st.io_s, "plan_s": st.plan_s, "total_s": st.total_s,
            }));
        }
    }
    let mut peers = Vec::new();
    if a.peer_python {
        for cache in &a.cache {
            let mut gbs = Vec::new();
            for _ in 0..a.runs {
                if cache == "cold" {
                    evict(&files);
                } else {
                    warm(&files)?;
                }
                gbs.push(bytes as f64 / python_load(&files)? / 1e9);
            }
            let (med, min, max) = stats(&gbs);
            let ours = rows
                .iter()
                .find(|r| r["cache"] == cache.as_str() && r["strategy"] == "auto")
                .and_then(|r| r["gb_s"].as_f64());
            peers.push(json!({"peer": "python safetensors.numpy.load_file", "cache": cache, "gb_s": med, "min": min, "max": max,
                "ours_auto_vs_peer": ours.map(|o| o / med)}));
        }
    }
    if let Some(gguf) = &a.peer_llama_cpp {
        let mut all = files.clone();
        all.push(gguf.clone());
        for cache in &a.cache {
            let (mut peer, mut ours) = (Vec::new(), Vec::new());
            for _ in 0..a.runs {
                if cache == "cold" {
                    evict(&all);
                } else {
                    warm(&all)?;
                }
                peer.push(llama_cpp_load(gguf)? * 1e3);
                if cache == "cold" {
                    evict(&all);
                }
                let t = Instant::now();
                let m = thaw_runtime::Llama::load(&dir)?;
                let tok = thaw_runtime::TextTokenizer::load(&dir)?;
                ours.push(t.elapsed().as_secs_f64() * 1e3);
                drop((m, tok));
            }
            let (pm, pmin, pmax) = stats(&peer);
            let (om, omin, omax) = stats(&ours);
            peers.push(json!({"peer": format!("llama.cpp model load ({})", gguf.display()), "cache": cache,
                "peer_ms": pm, "peer_min": pmin, "peer_max": pmax,
                "thaw_model_and_tokenizer_ms": om, "thaw_min": omin, "thaw_max": omax, "thaw_time_vs_peer": om / pm}));
        }
    }
    let out = json!({
        "peers": peers,
        "model": dir.display().to_string(), "bytes": bytes, "shards": files.len(), "runs": a.runs,
        "chunk_size": a.chunk_size, "queue_depth": a.queue_depth, "evict": evict_method,
        "floor_warm_memcpy_gb_s": warm_floor,
        "floor_cold_direct_gb_s": cold_floors.iter().map(|(d, g)| json!({"depth": d, "gb_s": g})).collect::<Vec<_>>(),
        "results": rows,
    });
    if a.json {
        println!("{out}");
        return Ok(());
    }
    println!(
        "checkpoint {} ({:.2} GB in {} shard(s)), {} runs each, median (min–max)",
        dir.display(),
        bytes as f64 / 1e9,
        files.len(),
        a.runs
    );
    println!("floor warm: memcpy {warm_floor:.2} GB/s");
    if !cold_floors.is_empty() {
        let d: Vec<String> = cold_floors
            .iter()
            .map(|(d, g)| format!("qd{d} {g:.2}"))
            .collect();
        println!(
            "floor cold: O_DIRECT 8 MiB reads {} GB/s (cache evicted with {evict_method})",
            d.join(", ")
        );
    }
    println!(
        "{:<6} {:<13} {:<13} {:>22} {:>9} {:>8}",
        "cache", "strategy", "used", "GB/s", "vs floor", "verify"
    );
    for r in out["results"].as_array().unwrap() {
        println!(
            "{:<6} {:<13} {:<13} {:>8.2} ({:.2}–{:.2}) {:>8.2}x {:>7.1}%",
            r["cache"].as_str().unwrap(),
            r["strategy"].as_str().unwrap(),
            r["used"].as_str().unwrap(),
            r["gb_s"].as_f64().unwrap(),
            r["min"].as_f64().unwrap(),
            r["max"].as_f64().unwrap(),
            r["ratio"].as_f64().unwrap(),
            if r["verified"].as_bool().unwrap() {
                100.0 * r["verify_s"].as_f64().unwrap() / r["total_s"].as_f64().unwrap()
            } else {
                0.0
            },
        );
    }
    for p in out["peers"].as_array().unwrap() {
        if let Some(pm) = p["peer_ms"].as_f64() {
            println!(
                "peer {} ({}): {pm:.1} ms ({:.1}–{:.1}); thaw model + tokenizer {:.1} ms ({:.1}–{:.1}) = {:.2}x the time",
                p["peer"].as_str().unwrap(), p["cache"].as_str().unwrap(), p["peer_min"].as_f64().unwrap(), p["peer_max"].as_f64().unwrap(),
                p["thaw_model_and_tokenizer_ms"].as_f64().unwrap(), p["thaw_min"].as_f64().unwrap(), p["thaw_max"].as_f64().unwrap(),
                p["thaw_time_vs_peer"].as_f64().unwrap()
            );
            continue;
        }
        println!(
            "peer {} ({}): {:.2} GB/s ({:.2}–{:.2}); thaw auto = {}",
            p["peer"].as_str().unwrap(),
            p["cache"].as_str().unwrap(),
            p["gb_s"].as_f64().unwrap(),
            p["min"].as_f64().unwrap(),
            p["max"].as_f64().unwrap(),
            p["ours_auto_vs_peer"]
                .as_f64()
                .map(|r| format!("{r:.2}x"))
                .unwrap_or("(auto not measured)".into())
        );
    }
    Ok(())
}

/// Reads the files once through the page cache so they are resident.
fn warm(files: &[PathBuf]) -> Result<()> {
    for f in files {
        let mut file = File::open(f)?;
        std::io::copy(&mut file, &mut std::io::sink())?;
    }
    Ok(())
}
