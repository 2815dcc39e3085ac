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
//!    exactly for f32 weights. Once per product mode (cuBLAS, matrix-vector kernels, each
//!    queued or replayed as CUDA graphs).
//! 3. **Load**: `--big` (an 8B-shaped checkpoint, page cache warm) loaded to the device twice;
//!    GB/s of the second against the pinned floor, and its cold-start phases; the staging
//!    ring's shapes and pinning in place swept.
//! 4. **Decode**: batch 1 to 32 tokens/s on `--big` in each product mode against the roofline
//!    (`read bandwidth / weight bytes per step`), long-context attention, prefill attention.
//!
//! **Each stage runs in a process of its own** (this binary, re-executed with a hidden
//! `--stage`), under a time limit. A kernel that faults on a GPU raises a sticky error
//! (`CUDA_ERROR_ILLEGAL_ADDRESS`) that poisons its context: in one process, an experimental
//! mode's fault would fail every later measurement. Here it costs that stage's line; a hung
//! kernel costs its time limit. The parent never touches the GPU: it runs the stages, merges
//! their JSON into one file (`--out`, rewritten after each stage) and prints the "best" lines.

mod big;
mod check;
mod measure;

use std::io::Read;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use serde_json::{json, Value};

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
    /// Only the defaults as shipped: each checkpoint checked in the default mode, the 8B load,
    /// its decode at batch 1/8/32 and prefill — no A/B lines, no load sweep (a confirmation run
    /// after changing defaults: about a third of the full run).
    #[arg(long)]
    quick: bool,
    /// (Internal) run one stage in this process and write its JSON to `--out`.
    #[arg(long, hide = true)]
    stage: Option<String>,
    /// (Internal) the stage's product mode.
    #[arg(long, hide = true)]
    mode: Option<String>,
    /// (Internal) the stage's batch size.
    #[arg(long, hide = true)]
    batch: Option<usize>,
    /// (Internal) the floors, bytes/s, for the stages that report fractions of them.
    #[arg(long, hide = true)]
    h2d: Option<f64>,
    #[arg(long, hide = true)]
    read_bw: Option<f64>,
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

/// One stage, in this process (the child's side). Its result, or its error, goes to `--out`.
fn run_stage(a: &GpuArgs, stage: &str) -> Result<()> {
    let big = || a.big.as_deref().context("this stage needs --big");
    let spec = || a.check.first().context("this stage needs --check");
    let mode = || a.mode.as_deref().context("this stage needs --mode");
    let h2d = || a.h2d.context("this stage needs --h2d");
    let r = guard(|| match stage {
        "floors" => {
            let (dev, h2d, read_bw) = measure::floors(a.device)?;
            Ok(json!({"device": dev, "pinned_h2d_bytes_per_s": h2d,
                      "device_read_bytes_per_s": read_bw}))
        }
        "check" => check::check_mode(spec()?, mode()?, a.device),
        "small-decode" => check::small_decode(spec()?, a.device),
        "big-load" => big::big_load(big()?, a.device, h2d()?),
        "decode" => big::decode_mode(
            big()?,
            a.device,
            a.batch.context("this stage needs --batch")?,
            mode()?,
            a.steps,
            a.read_bw.context("this stage needs --read-bw")?,
        ),
        "long-context" => big::long_context(big()?, a.device, a.steps),
        "prefill" => big::prefill_ab(big()?, a.device),
        "load-sweep" => measure::load_sweep(big()?, a.device, h2d()?),
        s => bail!("unknown stage {s:?}"),
    });
    let v = match &r {
        Ok(v) => json!({"ok": v}),
        Err(e) => json!({"error": format!("{e:#}")}),
    };
    std::fs::write(&a.out, serde_json::to_string(&v)?)
        .with_context(|| format!("writing {}", a.out.display()))?;
    r.map(|_| ())
}

/// Runs this binary as `gpu --stage <args…>` under `limit`, its output passed through; its
/// JSON result, or why there is none (its error, the signal that killed it, the time limit).
fn child(a: &GpuArgs, args: &[&str], limit: Duration) -> Result<Value> {
    child_env(a, args, &[], limit)
}

/// [`child`] with environment variables set for the stage's process.
fn child_env(a: &GpuArgs, args: &[&str], env: &[(&str, &str)], limit: Duration) -> Result<Value> {
    let part = a.out.with_extension("stage.json");
    let _ = std::fs::remove_file(&part);
    let mut cmd = Command::new(std::env::current_exe().context("finding this binary")?);
    cmd.arg("gpu")
        .args(args)
        .arg("--device")
        .arg(a.device.to_string())
        .arg("--steps")
        .arg(a.steps.to_string())
        .arg("--out")
        .arg(&part)
        .envs(env.iter().copied())
        .stdin(Stdio::null());
    let mut proc = cmd.spawn().context("starting a stage")?;
    let t = Instant::now();
    let status = loop {
        if let Some(s) = proc.try_wait()? {
            break s;
        }
        if t.elapsed() > limit {
            let _ = proc.kill();
            let _ = proc.wait();
            bail!("over its time limit of {} s (killed)", limit.as_secs());
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let mut text = String::new();
    if let Ok(mut f) = std::fs::File::open(&part) {
        f.read_to_string(&mut text)?;
    }
    let _ = std::fs::remove_file(&part);
    let v: Option<Value> = serde_json::from_str(&text).ok();
    match v {
        Some(v) if v.get("ok").is_some() && status.success() => Ok(v["ok"].clone()),
        Some(v) if v.get("error").is_some() => bail!("{}", v["error"].as_str().unwrap_or("?")),
        _ => {
            use std::os::unix::process::ExitStatusExt;
            match status.signal() {
                Some(sig) => bail!("the stage's process died of signal {sig}"),
                None => bail!("the stage's process exited with {status} and no result"),
            }
        }
    }
}

/// Prints a failed stage and records it.
fn fail(errors: &mut Vec<Value>, what: &str, e: anyhow::Error) {
    println!("{what}: ERROR {e:#}");
    errors.push(json!({"stage": what, "error": format!("{e:#}")}));
}

/// Per batch size, the fastest decode mode against cuBLAS queued launch by launch (the
/// default): what the next defaults should be.
fn best_lines(dec: &[Value]) {
    let rate = |d: &Value| d["tokens_per_s"].as_f64().unwrap_or(0.0);
    for batch in [1usize, 2, 4, 8, 32] {
        let rows: Vec<&Value> = dec.iter().filter(|d| d["batch"] == batch).collect();
        let best = rows
            .iter()
            .copied()
            .max_by(|a, b| rate(a).total_cmp(&rate(b)));
        let base = rows.iter().find(|d| d["mode"] == "cuBLAS");
        let default = rows
            .iter()
            .find(|d| d["mode"] == "default")
            .map_or(String::new(), |d| {
                format!(
                    "; the defaults: {:.1} tokens/s ({:.0}%)",
                    rate(d),
                    100.0 * d["fraction_of_roofline"].as_f64().unwrap_or(0.0)
                )
            });
        if let (Some(best), Some(base)) = (best, base) {
            println!(
                "decode batch {batch:>2} best: {} {:.1} tokens/s ({:.0}% of roofline) = {:.2}× cuBLAS{default}",
                best["mode"].as_str().unwrap_or("?"),
                rate(best),
                100.0 * best["fraction_of_roofline"].as_f64().unwrap_or(0.0),
                rate(best) / rate(base).max(1e-9)
            );
        }
    }
}

/// Every stage runs even if an earlier one failed (its error is recorded), and the JSON is
/// rewritten after each, so one GPU session yields everything it can.
pub fn run(a: GpuArgs) -> Result<()> {
    if let Some(stage) = a.stage.clone() {
        return run_stage(&a, &stage);
    }
    if a.profile {
        let dir = a.big.as_deref().context("--profile needs --big")?;
        return guard(|| big::profile_decode(dir, a.device, a.steps));
    }
    let t_all = Instant::now();
    let mut out = json!({"checks": [], "big": null, "errors": []});
    let save = |out: &mut Value| -> Result<()> {
        out["seconds"] = json!(t_all.elapsed().as_secs_f64());
        std::fs::write(&a.out, serde_json::to_string_pretty(out)?)
            .with_context(|| format!("writing {}", a.out.display()))
    };
    let mut errors: Vec<Value> = vec![];
    let secs = Duration::from_secs;

    let (h2d, read_bw) = match child(&a, &["--stage", "floors"], secs(90)) {
        Ok(v) => {
            let f = |k: &str| v[k].as_f64().unwrap_or(0.0);
            let floors = (f("pinned_h2d_bytes_per_s"), f("device_read_bytes_per_s"));
            for (k, x) in v.as_object().into_iter().flatten() {
                out[k] = x.clone();
            }
            floors
        }
        Err(e) => {
            fail(&mut errors, "floors", e);
            out["errors"] = json!(errors);
            save(&mut out)?;
            bail!("no usable GPU (see {})", a.out.display());
        }
    };
    save(&mut out)?;
    let (h2d_s, bw_s) = (h2d.to_string(), read_bw.to_string());

    for spec in &a.check {
        let mut modes = vec![];
        let mut pass = true;
        for mode in check::CHECK_MODES
            .into_iter()
            .filter(|m| !a.quick || *m == "default")
        {
            let args = ["--stage", "check", "--check", spec, "--mode", mode];
            match child(&a, &args, secs(120)) {
                Ok(v) => {
                    pass &= v["pass"] == true;
                    modes.push(v);
                }
                Err(e) => {
                    let (dir, _) = check::split_spec(spec);
                    println!("check {} ({mode}): ERROR {e:#} — FAIL", dir.display());
                    modes.push(
                        json!({"model": dir, "mode": mode, "error": format!("{e:#}"),
                                      "pass": false}),
                    );
                    pass = false;
                }
            }
        }
        let decode = match child(&a, &["--stage", "small-decode", "--check", spec], secs(90)) {
            Ok(v) => {
                pass &= v["pass"] == true;
                v["decode"].clone()
            }
            Err(e) => {
                fail(&mut errors, &format!("decode {spec}"), e);
                pass = false;
                json!([])
            }
        };
        out["checks"]
            .as_array_mut()
            .expect("an array")
            .push(json!({"model": check::split_spec(spec).0, "modes": modes,
                         "decode": decode, "pass": pass}));
        out["errors"] = json!(errors);
        save(&mut out)?;
    }

    if let Some(dir) = &a.big {
        let dir = dir.to_str().context("a --big path that is not UTF-8")?;
        let big_args = |stage: &'static str| vec!["--stage", stage, "--big", dir];
        let mut args = big_args("big-load");
        args.extend(["--h2d", &h2d_s]);
        let mut big = match child(&a, &args, secs(150)) {
            Ok(v) => v,
            Err(e) => {
                fail(&mut errors, "big model load", e);
                json!({"model": dir})
            }
        };
        out["big"] = big.clone();
        save(&mut out)?;
        // The same load with the kernels and cuBLAS brought up beside the weights.
        if !a.quick {
            match child_env(
                &a,
                &args,
                &[(thaw_runtime::device_model::OVERLAP_INIT, "1")],
                secs(150),
            ) {
                Ok(v) => big["overlap_init"] = v,
                Err(e) => fail(&mut errors, "big model load (overlap init)", e),
            }
        }
        let mut dec = vec![];
        for (batch, mode) in big::DECODE_MODES
            .into_iter()
            .filter(|(_, m)| !a.quick || *m == "default")
        {
            let b = batch.to_string();
            let mut args = big_args("decode");
            args.extend(["--batch", &b, "--mode", mode, "--read-bw", &bw_s]);
            match child(&a, &args, secs(90)) {
                Ok(v) => dec.push(v),
                Err(e) => {
                    // An experimental mode that fails costs its line, not the rest of the run.
                    fail(&mut errors, &format!("decode batch {batch:>2} ({mode})"), e);
                }
            }
        }
        best_lines(&dec);
        big["decode"] = json!(dec);
        let stages: &[(&str, &str, u64)] = if a.quick {
            &[("prefill", "prefill", 90)]
        } else {
            &[
                ("long-context", "decode_long_context", 120),
                ("prefill", "prefill", 90),
            ]
        };
        for &(stage, key, limit) in stages {
            match child(&a, &big_args(stage), secs(limit)) {
                Ok(v) => {
                    // A failing line inside fails the run too, after the rest was measured.
                    if let Some(e) = v
                        .as_array()
                        .and_then(|l| l.iter().find(|r| r.get("error").is_some()))
                    {
                        errors.push(json!({"stage": stage, "error": e["error"].clone()}));
                    }
                    big[key] = v;
                }
                Err(e) => fail(&mut errors, stage, e),
            }
        }
        out["big"] = big;
        out["errors"] = json!(errors);
        save(&mut out)?;
        let mut args = big_args("load-sweep");
        args.extend(["--h2d", &h2d_s]);
        match (!a.quick).then(|| child(&a, &args, secs(180))).transpose() {
            Ok(None) => {}
            Ok(Some(v)) => {
                if let Some(e) = v
                    .as_array()
                    .and_then(|l| l.iter().find(|r| r.get("error").is_some()))
                {
                    errors.push(json!({"stage": "load sweep", "error": e["error"].clone()}));
                }
                out["load_sweep"] = v;
            }
            Err(e) => fail(&mut errors, "load sweep", e),
        }
    }
    out["errors"] = json!(errors);
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
