//! Streaming loads: the weights are usable layer by layer while the rest is still being read.
//!
//! [`load_streaming`] plans the load, allocates the arenas and returns at once with the
//! [`HostWeights`] (views into those arenas), a [`LayerGate`] and the reader thread's handle. The
//! reader fills chunks in plan order (embeddings, layer 0, 1, …) and publishes, after each chunk
//! has landed and passed its integrity check, how many leading layer groups are complete. A
//! consumer calls [`LayerGate::wait`] before touching group `g`: the mutex that publishes the
//! count orders the reader's writes before the consumer's reads. A failed load (bad bytes, I/O
//! error) wakes every waiter with the error. A checkpoint already in the page cache is mapped in
//! place instead, and the gate is open from the start.

use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;

use crate::dest::{Destination, HostArena};
use crate::host::HostWeights;
use crate::read::{self, Backing, LoadOptions, LoadStats, Strategy};
use crate::{Checkpoint, LoadError};

/// How many leading layer groups (embeddings = 0, block i = 1 + i, the rest last) are loaded.
pub struct LayerGate {
    state: Mutex<(usize, Option<String>)>,
    cv: Condvar,
    groups: usize,
}

impl LayerGate {
    fn new(groups: usize, ready: usize) -> LayerGate {
        LayerGate {
            state: Mutex::new((ready, None)),
            cv: Condvar::new(),
            groups,
        }
    }

    pub fn groups(&self) -> usize {
        self.groups
    }

    pub fn ready(&self) -> usize {
        self.state.lock().unwrap_or_else(|e| e.into_inner()).0
    }

    /// Blocks until group `g` (clamped to the last) is loaded; the load's error if it failed.
    pub fn wait(&self, g: usize) -> Result<(), String> {
        let g = g.min(self.groups.saturating_sub(1));
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            if st.0 > g {
                return Ok(());
            }
            if let Some(e) = &st.1 {
                return Err(e.clone());
            }
            st = self.cv.wait(st).unwrap_or_else(|e| e.into_inner());
        }
    }

    fn publish(&self, ready: usize) {
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if ready > st.0 {
            st.0 = ready;
            self.cv.notify_all();
        }
    }

    fn fail(&self, e: String) {
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        st.1 = Some(e);
        self.cv.notify_all();
    }
}

/// A load in progress.
pub struct Streaming {
    pub weights: HostWeights,
    pub gate: Arc<LayerGate>,
    /// The reader: its final stats (io and verify times), or the load's error.
    pub done: JoinHandle<Result<LoadStats, LoadError>>,
}

/// Starts loading `checkpoint`; see the module docs.
pub fn load_streaming(checkpoint: Checkpoint, opts: &LoadOptions) -> Result<Streaming, LoadError> {
    let mut job = read::begin(&checkpoint, opts)?;
    let groups = job.plan.layers;
    let strategy = match opts.strategy {
        _ if checkpoint.remote.is_some() => Strategy::S3,
        Strategy::Auto if job.stats.resident >= 0.9 => Strategy::Mmap,
        Strategy::Auto => Strategy::UringDirect,
        s => s,
    };
    if strategy == Strategy::Mmap {
        // In place: nothing to stream.
        let weights = HostWeights::load_with(checkpoint, opts, &mut |_| {})?;
        let stats = weights.stats.clone();
        return Ok(Streaming {
            weights,
            gate: Arc::new(LayerGate::new(groups, groups)),
            done: std::thread::spawn(move || Ok(stats)),
        });
    }
    let mut arena = HostArena::new();
    arena.prepare(&job.plan)?;
    let mut filler = arena.share();
    let data_offset = job.plan.shards.iter().map(|s| s.data_offset()).collect();
    let weights = HostWeights::from_parts(
        checkpoint.clone(),
        arena
            .into_arenas()
            .into_iter()
            .map(Backing::Arena)
            .collect(),
        data_offset,
        job.stats.clone(),
    );
    let gate = Arc::new(LayerGate::new(groups, 0));
    let g = gate.clone();
    let dir = checkpoint.dir.clone();
    let done = std::thread::Builder::new()
        .name("thaw-load".into())
        .spawn(move || {
            let r = read::read_into(&checkpoint, &mut job, strategy, &mut filler, &mut |p| {
                g.publish(p.layers_ready)
            });
            match r {
                Ok(used) => {
                    read::finish(&mut job, used);
                    g.publish(g.groups);
                    Ok(job.stats)
                }
                Err(e) => {
                    g.fail(e.to_string());
                    Err(e)
                }
            }
        })
        .map_err(|e| LoadError::io(&dir, e))?;
    Ok(Streaming {
        weights,
        gate,
        done,
    })
}
