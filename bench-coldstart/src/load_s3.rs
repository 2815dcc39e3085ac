//! `bench-coldstart load --model s3://bucket/prefix`: the S3 load against the floor for the same
//! bytes from the same server in the same run — the same ranged GETs at the same depth into a
//! few reused buffers, with nothing done to the bytes (no arena, no page faults, no hashing) —
//! and, with `--peer-boto3`, against boto3's managed download (`download_fileobj`, its default
//! 10 threads × 8 MiB parts) of the same objects.
//!
//! The server is whatever `AWS_ENDPOINT_URL` names (scripts/bench-s3.sh starts s3s-fs, a Rust
//! S3 server over a directory); on one machine client and server share the CPUs, so the figure
//! is the client's overhead on top of what the server can give, not a network speed.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Instant;

use anyhow::{Context, Result};
use serde_json::json;
use thaw_loader::plan::{Chunk, LoadPlan};
use thaw_loader::{
    AlignedBuf, Checkpoint, Destination, HostWeights, LoadError, LoadOptions, Verify,
};

use crate::stats;

/// A destination that keeps nothing: `depth` buffers handed out and taken back.
struct Discard {
    free: Mutex<Vec<AlignedBuf>>,
    held: Mutex<HashMap<usize, AlignedBuf>>,
    depth: usize,
    len: usize,
}

impl Destination for Discard {
    fn prepare(&mut self, plan: &LoadPlan) -> Result<(), LoadError> {
        self.len = plan.chunk_size as usize;
        let mut f = self.free.lock().unwrap();
        for _ in 0..self.depth {
            let mut b = AlignedBuf::zeroed(self.len);
            b.as_mut_slice().fill(1); // faulted once, up front
            f.push(b);
        }
        Ok(())
    }
    fn max_regions(&self) -> usize {
        self.depth
    }
    fn region(&self, i: usize, _c: &Chunk) -> Result<*mut u8, LoadError> {
        let mut b = self
            .free
            .lock()
            .unwrap()
            .pop()
            .expect("at most depth regions held");
        let p = b.as_mut_slice().as_mut_ptr();
        self.held.lock().unwrap().insert(i, b);
        Ok(p)
    }
    fn landed(&self, i: usize, _c: &Chunk, _len: u64) -> Result<(), LoadError> {
        let b = self.held.lock().unwrap().remove(&i).expect("a held region");
        self.free.lock().unwrap().push(b);
        Ok(())
    }
}

const BOTO3_PEER: &str = r#"
import io, os, sys, time, boto3
s3 = boto3.client("s3", endpoint_url=os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL"))
bucket, keys = sys.argv[1], sys.argv[2:]
t = time.perf_counter()
n = 0
for k in keys:
    b = io.BytesIO()
    s3.download_fileobj(bucket, k, b)
    n += b.getbuffer().nbytes
print(time.perf_counter() - t, n)
"#;

fn boto3_download(python: &str, bucket: &str, keys: &[String]) -> Result<f64> {
    let args = std::iter::once(bucket.to_string()).chain(keys.iter().cloned());
    crate::load::python_timed(python, "boto3", BOTO3_PEER, args)
}

impl Discard {
    fn new(depth: usize) -> Discard {
        Discard {
            free: Mutex::new(Vec::new()),
            held: Mutex::new(HashMap::new()),
            depth,
            len: 0,
        }
    }
}

/// Seconds of the fastest of `runs` passes of every ranged GET of the checkpoint in `dir` (a
/// materialized s3:// model) at `depth` in flight, bytes discarded: the floor of an S3 load.
pub fn raw_gets_seconds(dir: &std::path::Path, depth: usize, runs: usize) -> Result<f64> {
    let opts = LoadOptions {
        queue_depth: depth,
        verify: Verify::Off,
        ..LoadOptions::default()
    };
    let mut best = f64::INFINITY;
    for _ in 0..runs.max(1) {
        let mut d = Discard::new(depth);
        let t = Instant::now();
        thaw_loader::read::load_into(&Checkpoint::open(dir)?, &opts, &mut d, &mut |_| {})?;
        best = best.min(t.elapsed().as_secs_f64());
    }
    Ok(best)
}

pub struct S3Args<'a> {
    pub model: &'a str,
    pub runs: usize,
    pub queue_depth: usize,
    pub verify: Verify,
    pub peer_boto3: Option<&'a str>,
    pub json: bool,
}

pub fn run(a: S3Args) -> Result<()> {
    let t = Instant::now();
    let dir = thaw_runtime::fetch::resolve_model(a.model)?;
    let metadata_ms = t.elapsed().as_secs_f64() * 1e3;
    let ck = Checkpoint::open(&dir)?;
    let remote = ck.remote.clone().context("not a remote checkpoint")?;
    let bytes = ck.data_bytes();
    let opts = LoadOptions {
        queue_depth: a.queue_depth,
        verify: a.verify,
        ..LoadOptions::default()
    };
    let (mut ours, mut floor, mut peer) = (Vec::new(), Vec::new(), Vec::new());
    let mut last = None;
    let keys: Vec<String> = remote
        .shards
        .iter()
        .map(|s| remote.url.key(&s.name))
        .collect();
    for _ in 0..a.runs {
        // Alternated, so that drift in the machine's speed hits both alike.
        let mut d = Discard::new(a.queue_depth);
        let raw = LoadOptions {
            verify: Verify::Off,
            ..opts.clone()
        };
        let t = Instant::now();
        thaw_loader::read::load_into(&Checkpoint::open(&dir)?, &raw, &mut d, &mut |_| {})?;
        floor.push(bytes as f64 / t.elapsed().as_secs_f64() / 1e9);
        let t = Instant::now();
        let w = HostWeights::load_with(Checkpoint::open(&dir)?, &opts, &mut |_| {})?;
        ours.push(bytes as f64 / t.elapsed().as_secs_f64() / 1e9);
        last = Some(w.stats.clone());
        drop(w);
        if let Some(py) = a.peer_boto3 {
            peer.push(bytes as f64 / boto3_download(py, &remote.url.bucket, &keys)? / 1e9);
        }
    }
    let (om, omin, omax) = stats(&ours);
    let (fm, fmin, fmax) = stats(&floor);
    let st = last.context("no runs")?;
    let peer_row = (!peer.is_empty()).then(|| {
        let (pm, pmin, pmax) = stats(&peer);
        json!({"peer": "boto3 download_fileobj", "gb_s": pm, "min": pmin, "max": pmax, "ours_vs_peer": om / pm})
    });
    let out = json!({
        "model": a.model, "bytes": bytes, "shards": remote.shards.len(), "runs": a.runs,
        "queue_depth": a.queue_depth, "chunk_size": LoadPlan::new(&ck, opts.chunk_size).chunk_size,
        "metadata_ms": metadata_ms,
        "floor_raw_gets_gb_s": fm, "floor_min": fmin, "floor_max": fmax,
        "thaw_gb_s": om, "thaw_min": omin, "thaw_max": omax, "ratio": om / fm,
        "verified": st.verified, "verify_s": st.verify_s, "total_s": st.total_s,
        "peer": peer_row,
    });
    if a.json {
        println!("{out}");
        return Ok(());
    }
    println!(
        "{} ({:.2} GB in {} object(s)), {} runs, queue depth {}, median (min–max)",
        a.model,
        bytes as f64 / 1e9,
        remote.shards.len(),
        a.runs,
        a.queue_depth
    );
    println!("metadata (list, small files, headers): {metadata_ms:.1} ms");
    println!("floor: the same ranged GETs, bytes discarded: {fm:.3} GB/s ({fmin:.3}–{fmax:.3})");
    println!(
        "thaw s3 load{}: {om:.3} GB/s ({omin:.3}–{omax:.3}) = {:.2}x the floor",
        if st.verified { " (verified)" } else { "" },
        om / fm
    );
    if let Some(p) = &out["peer"].as_object() {
        println!(
            "peer {}: {:.3} GB/s ({:.3}–{:.3}); thaw = {:.2}x",
            p["peer"].as_str().unwrap_or(""),
            p["gb_s"].as_f64().unwrap_or(0.0),
            p["min"].as_f64().unwrap_or(0.0),
            p["max"].as_f64().unwrap_or(0.0),
            p["ours_vs_peer"].as_f64().unwrap_or(0.0)
        );
    }
    Ok(())
}
