//! Cold-start telemetry: the phases of one cold start on one monotonic clock, as the log line,
//! the `thaw_cold_start_phase_seconds{phase}` gauges and the `/invoke` answer of the request
//! that waited for it show them.
//!
//! Phases, in order: `exec` (process exec → `thaw serve` entry, from /proc: 10 ms resolution),
//! `device_probe` (`--device cuda|auto` asking the GPU driver for devices: `cuInit`, measured
//! apart from `exec`, which ran before it), `runtime_init` (entry → port listening), `device_init` (compute threads, or the CUDA context; on a GPU then
//! `compile` (NVRTC, or the PTX cache), `module_load` and `alloc`),
//! `plan` (checkpoint open, header parse, read plan), `read` (bytes into memory), `copy`
//! (host → device; zero on the CPU, where weights are used in place), `verify` (integrity
//! hashes not hidden behind reads), `tokenizer`, `warmup` (engine start and one short request),
//! `first_token` (ready → first token of the first request). `exec`, `device_probe` and
//! `runtime_init` belong to the process's first load only; a return from `parked` starts at `device_init`.

use std::sync::Mutex;
use std::time::Instant;

use serde_json::{json, Value};

use super::metrics::METRICS;

/// Process-level phases, measured once and handed to the first cold start.
static PROCESS: Mutex<Option<Vec<(&'static str, f64)>>> = Mutex::new(None);
static ENTRY: Mutex<Option<(Instant, f64, Option<f64>)>> = Mutex::new(None);

/// Seconds since this process was exec'd, from /proc/self/stat (clock ticks since boot) and
/// CLOCK_BOOTTIME. None where /proc is unavailable.
fn since_exec() -> Option<f64> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // Field 22, counted after the parenthesized command name (which may contain spaces).
    let rest = &stat[stat.rfind(')')? + 2..];
    let start_ticks: f64 = rest.split_whitespace().nth(19)?.parse().ok()?;
    // SAFETY: sysconf and clock_gettime only write the timespec we pass.
    let (hz, now) = unsafe {
        let hz = libc::sysconf(libc::_SC_CLK_TCK) as f64;
        let mut ts = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        if libc::clock_gettime(libc::CLOCK_BOOTTIME, &mut ts) != 0 {
            return None;
        }
        (hz, ts.tv_sec as f64 + ts.tv_nsec as f64 / 1e9)
    };
    Some((now - start_ticks / hz).max(0.0))
}

/// Call first thing in `thaw serve`, with the seconds `--device` resolution spent probing the
/// GPU driver before it (`cuInit` and a device count: ~0.1 s on a GPU host, counted as its own
/// phase, `device_probe`, instead of inside `exec`; `None` where nothing was probed).
pub fn mark_entry(device_probe_s: Option<f64>) {
    let exec = since_exec().unwrap_or(0.0) - device_probe_s.unwrap_or(0.0);
    *ENTRY.lock().unwrap_or_else(|e| e.into_inner()) =
        Some((Instant::now(), exec.max(0.0), device_probe_s));
}

/// Call once the port is listening.
pub fn mark_listening() {
    if let Some((t, exec, probe)) = *ENTRY.lock().unwrap_or_else(|e| e.into_inner()) {
        let mut phases = vec![("exec", exec)];
        phases.extend(probe.map(|p| ("device_probe", p)));
        phases.push(("runtime_init", t.elapsed().as_secs_f64()));
        *PROCESS.lock().unwrap_or_else(|e| e.into_inner()) = Some(phases);
    }
}

#[derive(Debug, Clone)]
pub struct ColdStart {
    pub phases: Vec<(&'static str, f64)>,
    /// Trigger → ready.
    pub load_s: f64,
    ready_at: Instant,
}

impl ColdStart {
    /// A cold start; the first one of the process also gets `exec` and `runtime_init`.
    pub fn new() -> ColdStart {
        let phases = PROCESS
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
            .unwrap_or_default();
        ColdStart {
            phases,
            load_s: 0.0,
            ready_at: Instant::now(),
        }
    }

    pub fn push(&mut self, phase: &'static str, secs: f64) {
        self.phases.push((phase, secs));
    }

    /// The loader's phases from its stats.
    /// `copy_s`: host → device time the reads did not hide (zero on the CPU).
    pub fn push_load(&mut self, st: &thaw_loader::LoadStats, copy_s: f64) {
        self.push("plan", st.plan_s);
        self.push("read", st.io_s);
        self.push("copy", copy_s);
        self.push("verify", st.verify_s);
    }

    pub fn set_total(&mut self, load_s: f64) {
        self.load_s = load_s;
        self.ready_at = Instant::now();
    }

    pub fn first_token_now(&mut self) {
        let s = self.ready_at.elapsed().as_secs_f64();
        self.phases.retain(|(p, _)| *p != "first_token");
        self.phases.push(("first_token", s));
    }

    pub fn publish(&self) {
        for (p, s) in &self.phases {
            METRICS.cold_start_phase.with_label_values(&[p]).set(*s);
        }
    }

    pub fn summary(&self) -> String {
        let mut s: Vec<String> = self
            .phases
            .iter()
            .map(|(p, v)| format!("{p} {:.1} ms", v * 1e3))
            .collect();
        s.push(format!("(load {:.1} ms)", self.load_s * 1e3));
        s.join(", ")
    }

    pub fn json(&self) -> Value {
        let mut m = serde_json::Map::new();
        for (p, v) in &self.phases {
            m.insert(p.to_string(), json!((v * 1e4).round() / 10.0));
        }
        Value::Object(m)
    }
}

impl Default for ColdStart {
    fn default() -> Self {
        ColdStart::new()
    }
}
