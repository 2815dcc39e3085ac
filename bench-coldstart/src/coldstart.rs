//! `bench-coldstart coldstart`: a cold start is always a fresh process. Each run spawns `thaw
//! serve` (or, with `--peer`, another OpenAI-compatible server command) on a free port and, at
//! exec time, starts knocking: the first request is sent as soon as the port accepts (a server
//! still loading either holds it, as thaw does, or answers 503, and the client retries every
//! 5 ms, as a platform's queue-proxy would). Per run: exec → listening, → ready (`/ready` or
//! `/health` 200, polled on a second connection), → first token and → end of the first request,
//! plus thaw's own phase breakdown (`thaw_cold_start_phase_seconds`). Medians with min–max, a
//! markdown table, and an SVG waterfall of the phases.
//!
//! Floors from the same run: the load floor (reading the checkpoint's bytes from the page cache
//! into a reused buffer — what any loader must at least do), and thaw's warm TTFT for the same
//! request (the second request of each run).

use std::io::Read;
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use serde_json::{json, Value};
use thaw_runtime::fetch::resolve_model;

use crate::stats;

#[derive(clap::Args)]
pub struct ColdstartArgs {
    #[arg(long, default_value = "default")]
    model: String,
    #[arg(long, default_value_t = 5)]
    runs: usize,
    /// Drop the page cache before each run (needs root; else fadvise on the model's files).
    #[arg(long)]
    cold: bool,
    /// Extra arguments for `thaw serve` (e.g. "--lazy").
    #[arg(long, default_value = "")]
    thaw_args: String,
    /// Another server command, `{port}` replaced by the port (e.g. "llama-server -m F.gguf
    /// --port {port}"), measured with the same protocol in the same run.
    #[arg(long)]
    peer: Option<String>,
    /// Files the peer reads (evicted too with --cold).
    #[arg(long)]
    peer_files: Vec<PathBuf>,
    #[arg(long, default_value = "llama.cpp")]
    peer_label: String,
    #[arg(long, default_value_t = 8)]
    max_tokens: usize,
    /// SVG waterfall of the phases.
    #[arg(long, default_value = "target/coldstart.svg")]
    svg: PathBuf,
    #[arg(long)]
    json: bool,
}

/// A fixed prompt of about a hundred tokens (the same text for every server).
const PROMPT: &str =
    "The history of the lighthouse begins in the ancient world, where fires were lit on \
hilltops to guide ships safely into harbour. Over the centuries these beacons became towers of \
stone, and the fires gave way to oil lamps, then to mirrors and lenses that could throw a beam \
of light far out to sea. Today most lighthouses are automated, but their purpose has not \
changed: to warn sailors of danger and to show them the way home. Describe in one sentence why \
lighthouses still matter.";

fn free_port() -> Result<u16> {
    let l = std::net::TcpListener::bind("127.0.0.1:0")?;
    Ok(l.local_addr()?.port())
}

#[derive(Debug, Default, Clone)]
struct Run {
    listen_s: f64,
    ready_s: f64,
    ttft_s: f64,
    e2e_s: f64,
    warm_ttft_s: f64,
    phases: Vec<(String, f64)>,
}

/// Streams one completion; returns (seconds from `t0` to the first token, to the end).
fn first_request(base: &str, t0: Instant, max_tokens: usize, prompt: &str) -> Result<(f64, f64)> {
    let client = reqwest::blocking::Client::builder()
        .timeout(Duration::from_secs(300))
        .build()?;
    let body = json!({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                      "ignore_eos": true, "stream": true});
    loop {
        if t0.elapsed() > Duration::from_secs(300) {
            bail!("no answer within 300 s");
        }
        let r = client
            .post(format!("{base}/v1/completions"))
            .json(&body)
            .send();
        let mut r = match r {
            Ok(r) if r.status().as_u16() == 503 => {
                std::thread::sleep(Duration::from_millis(5));
                continue;
            }
            Ok(r) if r.status().is_success() => r,
            Ok(r) => bail!("{}: {}", r.status(), r.text().unwrap_or_default()),
            Err(_) => {
                std::thread::sleep(Duration::from_millis(5));
                continue;
            }
        };
        let mut first = None;
        let mut buf = [0u8; 8192];
        let mut acc = Vec::new();
        loop {
            let n = r.read(&mut buf)?;
            if n == 0 {
                break;
            }
            acc.extend_from_slice(&buf[..n]);
            // The first SSE chunk that carries text.
            if first.is_none()
                && String::from_utf8_lossy(&acc).lines().any(|l| {
                    l.strip_prefix("data: ")
                        .and_then(|d| serde_json::from_str::<Value>(d).ok())
                        .is_some_and(|v| {
                            v["choices"][0]["text"]
                                .as_str()
                                .is_some_and(|t| !t.is_empty())
                        })
                })
            {
                first = Some(t0.elapsed().as_secs_f64());
            }
        }
        let end = t0.elapsed().as_secs_f64();
        return Ok((first.unwrap_or(end), end));
    }
}

fn wait_listening(port: u16, t0: Instant, child: &mut Child) -> Result<f64> {
    loop {
        if TcpStream::connect(("127.0.0.1", port)).is_ok() {
            return Ok(t0.elapsed().as_secs_f64());
        }
        if let Some(s) = child.try_wait()? {
            bail!("the server exited before listening ({s})");
        }
        if t0.elapsed() > Duration::from_secs(120) {
            bail!("not listening after 120 s");
        }
        std::thread::sleep(Duration::from_micros(500));
    }
}

/// One cold start of `cmd` (argv) on `port`.
fn one(argv: &[String], port: u16, thaw: bool, max_tokens: usize) -> Result<Run> {
    let base = format!("http://127.0.0.1:{port}");
    let t0 = Instant::now();
    let mut child = Command::new(&argv[0])
        .args(&argv[1..])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .with_context(|| format!("starting {}", argv[0]))?;
    let r = (|| -> Result<Run> {
        let listen_s = wait_listening(port, t0, &mut child)?;
        // Readiness is polled on its own connection while the first request waits.
        let ready_path = if thaw { "/ready" } else { "/health" };
        let rb = base.clone();
        let ready = std::thread::spawn(move || -> f64 {
            let c = reqwest::blocking::Client::new();
            loop {
                if let Ok(r) = c.get(format!("{rb}{ready_path}")).send() {
                    if r.status().is_success() {
                        return t0.elapsed().as_secs_f64();
                    }
                }
                if t0.elapsed() > Duration::from_secs(300) {
                    return f64::NAN;
                }
                std::thread::sleep(Duration::from_millis(2));
            }
        });
        let (ttft_s, e2e_s) = first_request(&base, t0, max_tokens, PROMPT)?;
        let ready_s = ready.join().unwrap_or(f64::NAN);
        let t1 = Instant::now();
        // Warm TTFT: a prompt of the same length that shares no prefix with the first one (no
        // prefix-cache hit on either server).
        let other = format!("Summary: {PROMPT}");
        let (warm, _) = first_request(&base, t1, max_tokens, &other)?;
        let mut phases = Vec::new();
        if thaw {
            let text = reqwest::blocking::get(format!("{base}/metrics"))?.text()?;
            for l in text
                .lines()
                .filter(|l| l.starts_with("thaw_cold_start_phase_seconds{"))
            {
                let name = l.split('"').nth(1).unwrap_or("").to_string();
                let v: f64 = l
                    .rsplit(' ')
                    .next()
                    .and_then(|v| v.parse().ok())
                    .unwrap_or(0.0);
                phases.push((name, v));
            }
        }
        Ok(Run {
            listen_s,
            ready_s,
            ttft_s,
            e2e_s,
            warm_ttft_s: warm,
            phases,
        })
    })();
    // SAFETY: kill(2) on our own child.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let t = Instant::now();
    while child.try_wait()?.is_none() {
        if t.elapsed() > Duration::from_secs(10) {
            let _ = child.kill();
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let _ = child.wait();
    r
}

/// Load floor: seconds to read `files` into one reused buffer — from the page cache, or with
/// `cold`, from the disk after evicting them (best of 3 warm; one pass cold, where a pass is long
/// and an 8B checkpoint's three would be 48 GB of disk reads).
fn load_floor(files: &[PathBuf], cold: bool) -> Result<f64> {
    let mut buf = vec![0u8; 16 << 20];
    let mut best = f64::INFINITY;
    for _ in 0..if cold { 1 } else { 3 } {
        if cold {
            crate::load::evict(files);
        }
        let t = Instant::now();
        for f in files {
            let mut file = std::fs::File::open(f)?;
            while file.read(&mut buf)? > 0 {}
        }
        best = best.min(t.elapsed().as_secs_f64());
    }
    Ok(best)
}

fn model_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "safetensors"))
        .collect();
    v.sort();
    Ok(v)
}

fn med(runs: &[Run], f: impl Fn(&Run) -> f64) -> (f64, f64, f64) {
    stats(&runs.iter().map(f).collect::<Vec<_>>())
}

fn svg(
    path: &Path,
    thaw: &[(String, f64)],
    thaw_ttft: f64,
    peer: Option<(&str, f64)>,
) -> Result<()> {
    let total = peer.map(|p| p.1).unwrap_or(0.0).max(thaw_ttft).max(1e-3);
    let (w, left, bar) = (900.0, 150.0, 26.0);
    let scale = (w - left - 20.0) / total;
    let colors = [
        "#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1", "#ff9da7",
        "#9c755f", "#bab0ac",
    ];
    let rows = thaw.len() + 2 + usize::from(peer.is_some());
    let h = 40.0 + rows as f64 * (bar + 6.0) + 30.0;
    let mut s = format!(
        "<svg xmlns='http://www.w3.org/2000/svg' width='{w}' height='{h}' font-family='sans-serif' font-size='12'>\n\
         <text x='10' y='20' font-size='14'>Cold start: exec → first token (medians, ms)</text>\n"
    );
    let mut y = 40.0;
    let mut x = 0.0;
    for (i, (name, v)) in thaw.iter().enumerate() {
        // Phases run in order except the tokenizer, which overlaps plan/read/verify.
        let start = if name == "tokenizer" {
            thaw.iter()
                .take_while(|(n, _)| n != "plan")
                .map(|(_, v)| v)
                .sum()
        } else {
            x
        };
        s += &format!(
            "<text x='10' y='{}'>{name}</text><rect x='{:.1}' y='{y}' width='{:.1}' height='{bar}' fill='{}'/><text x='{:.1}' y='{}'>{:.1}</text>\n",
            y + 17.0, left + start * scale, (v * scale).max(1.0), colors[i % colors.len()],
            left + (start + v) * scale + 4.0, y + 17.0, v * 1e3
        );
        if name != "tokenizer" {
            x += v;
        }
        y += bar + 6.0;
    }
    s += &format!(
        "<text x='10' y='{}'>thaw total</text><rect x='{left}' y='{y}' width='{:.1}' height='{bar}' fill='#333'/><text x='{:.1}' y='{}'>{:.1}</text>\n",
        y + 17.0, thaw_ttft * scale, left + thaw_ttft * scale + 4.0, y + 17.0, thaw_ttft * 1e3
    );
    y += bar + 6.0;
    if let Some((label, t)) = peer {
        s += &format!(
            "<text x='10' y='{}'>{label}</text><rect x='{left}' y='{y}' width='{:.1}' height='{bar}' fill='#999'/><text x='{:.1}' y='{}'>{:.1}</text>\n",
            y + 17.0, t * scale, left + t * scale + 4.0, y + 17.0, t * 1e3
        );
    }
    s += "</svg>\n";
    if let Some(d) = path.parent() {
        std::fs::create_dir_all(d)?;
    }
    std::fs::write(path, s)?;
    Ok(())
}

pub fn run(a: ColdstartArgs) -> Result<()> {
    let dir = resolve_model(&a.model)?;
    // An s3:// model is served from the store (the server lists it again itself); its floor is
    // the same ranged GETs with the bytes discarded.
    let remote = a.model.starts_with("s3://");
    let model_arg = if remote {
        a.model.clone()
    } else {
        dir.display().to_string()
    };
    let files = model_files(&dir)?;
    let thaw_bin = std::env::current_exe()?
        .parent()
        .context("exe dir")?
        .join("thaw");
    let mut thaw_runs = Vec::new();
    let mut peer_runs = Vec::new();
    let mut evict_files = files.clone();
    evict_files.extend(a.peer_files.iter().cloned());
    let mut method = "none (page cache warm)";
    for i in 0..a.runs {
        // Alternate which side goes first so drift in machine speed hits both alike.
        let order: Vec<bool> = if i % 2 == 0 {
            vec![true, false]
        } else {
            vec![false, true]
        };
        for is_thaw in order {
            if !is_thaw && a.peer.is_none() {
                continue;
            }
            if a.cold {
                method = crate::load::evict(&evict_files);
            }
            let port = free_port()?;
            let argv: Vec<String> = if is_thaw {
                let mut v = vec![
                    thaw_bin.display().to_string(),
                    "serve".into(),
                    "--model".into(),
                    model_arg.clone(),
                    "--port".into(),
                    port.to_string(),
                ];
                v.extend(a.thaw_args.split_whitespace().map(str::to_string));
                v
            } else {
                a.peer
                    .as_deref()
                    .unwrap_or_default()
                    .replace("{port}", &port.to_string())
                    .split_whitespace()
                    .map(str::to_string)
                    .collect()
            };
            let r = one(&argv, port, is_thaw, a.max_tokens)?;
            if is_thaw {
                thaw_runs.push(r);
            } else {
                peer_runs.push(r);
            }
        }
    }
    let floor = if remote {
        crate::load_s3::raw_gets_seconds(&dir, 16, 3)?
    } else {
        load_floor(&files, a.cold)?
    };
    let fmt = |t: (f64, f64, f64)| format!("{:.1} ({:.1}–{:.1})", t.0 * 1e3, t.1 * 1e3, t.2 * 1e3);
    let mut table = String::from(
        "| server | exec → listening | exec → ready | exec → first token | exec → end of first request | warm TTFT |\n| --- | --- | --- | --- | --- | --- |\n",
    );
    let mut row = |label: &str, runs: &[Run]| {
        table += &format!(
            "| {label} | {} | {} | {} | {} | {} |\n",
            fmt(med(runs, |r| r.listen_s)),
            fmt(med(runs, |r| r.ready_s)),
            fmt(med(runs, |r| r.ttft_s)),
            fmt(med(runs, |r| r.e2e_s)),
            fmt(med(runs, |r| r.warm_ttft_s)),
        );
    };
    row("thaw", &thaw_runs);
    if !peer_runs.is_empty() {
        row(&a.peer_label, &peer_runs);
    }
    // Phase medians in the order they happen (the GPU's own after device_init), then any other
    // phase a server reported.
    let mut order: Vec<&str> = vec![
        "exec",
        "device_probe",
        "runtime_init",
        "remote_metadata",
        "device_init",
        "compile",
        "module_load",
        "alloc",
        "plan",
        "read",
        "copy",
        "verify",
        "tokenizer",
        "warmup",
        "first_token",
    ];
    for r in &thaw_runs {
        for (n, _) in &r.phases {
            if !order.contains(&n.as_str()) {
                order.push(n.as_str());
            }
        }
    }
    let phases: Vec<(String, f64)> = order
        .iter()
        .filter_map(|p| {
            let v: Vec<f64> = thaw_runs
                .iter()
                .filter_map(|r| r.phases.iter().find(|(n, _)| n == p).map(|x| x.1))
                .collect();
            (!v.is_empty()).then(|| (p.to_string(), stats(&v).0))
        })
        .collect();
    let thaw_ttft = med(&thaw_runs, |r| r.ttft_s).0;
    let warm = med(&thaw_runs, |r| r.warm_ttft_s).0;
    let peer_ttft = (!peer_runs.is_empty()).then(|| med(&peer_runs, |r| r.ttft_s).0);
    svg(
        &a.svg,
        &phases,
        thaw_ttft,
        peer_ttft.map(|t| (a.peer_label.as_str(), t)),
    )?;
    let ratio_floor = thaw_ttft / (floor + warm);
    if a.json {
        println!(
            "{}",
            json!({"model": dir.display().to_string(), "runs": a.runs, "cache": method,
                   "thaw_ttft_ms": thaw_ttft * 1e3, "peer_ttft_ms": peer_ttft.map(|t| t * 1e3),
                   "load_floor_ms": floor * 1e3, "warm_ttft_ms": warm * 1e3,
                   "vs_floor_plus_warm": ratio_floor,
                   "vs_peer": peer_ttft.map(|p| thaw_ttft / p),
                   "phases_ms": phases.iter().map(|(p, v)| (p.clone(), json!(v * 1e3))).collect::<serde_json::Map<_, _>>()})
        );
        return Ok(());
    }
    println!("model {} — {} runs, cache: {method}", dir.display(), a.runs);
    print!("{table}");
    println!(
        "thaw phases (median ms): {}",
        phases
            .iter()
            .map(|(p, v)| format!("{p} {:.1}", v * 1e3))
            .collect::<Vec<_>>()
            .join(", ")
    );
    println!(
        "load floor ({} → buffer) {:.1} ms + warm TTFT {:.1} ms = {:.1} ms; exec → first token = {:.2}× that",
        if remote {
            "S3 ranged GETs"
        } else if a.cold {
            "disk"
        } else {
            "page cache"
        },
        floor * 1e3,
        warm * 1e3,
        (floor + warm) * 1e3,
        ratio_floor
    );
    if let Some(p) = peer_ttft {
        println!(
            "exec → first token: thaw / {} = {:.2}×",
            a.peer_label,
            thaw_ttft / p
        );
    }
    println!("waterfall: {}", a.svg.display());
    Ok(())
}
