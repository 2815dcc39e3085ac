//! Recorded decode steps (CUDA graphs). A decode step is a few hundred small launches (8 per
//! layer); queued one by one, each costs the host a few microseconds and the GPU a gap between
//! kernels. Recorded once and replayed, the step is one launch.
//!
//! A recording fixes every argument it was made with, so it may only be replayed by a step
//! whose launches would be identical: [`GraphKey`] holds everything a decode step's arguments
//! depend on besides buffers that stay put (weights, scratch — a scratch that grows clears the
//! recordings). What changes from step to step — tokens, positions, cache slots, block tables,
//! RoPE angles — lives in the plan buffer, uploaded before the replay at offsets that depend
//! only on the batch's rows (`StepPlan::pack` puts the growing tables last). The split of long
//! rows' attention changes with the context — with graphs on, at most every `min_chunk`
//! positions (`Split::plan`'s quantum) — and is part of the key. Prefill steps are queued directly: their shapes
//! rarely repeat.

use std::collections::HashMap;

use thaw_kernels::device::{DeviceOps, Split};

use super::dev_err;
use crate::step::MetaOffsets;
use crate::RuntimeError;

/// What a decode step's launches depend on, besides buffers that stay put: its shape and the
/// KV cache it reads and writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(super) struct GraphKey {
    pub shape: StepShape,
    /// The cache's keys and values, block size and block stride.
    pub kv: (u64, u64, usize, usize),
}

/// A step's shape: what [`super::DeviceLlama::enqueue`] launches with, besides buffers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(super) struct StepShape {
    pub n: usize,
    /// Rows whose logits are computed.
    pub p: usize,
    pub at: MetaOffsets,
    pub tiled: bool,
    pub n_decode: usize,
    pub n_tiles: usize,
    pub split: Split,
    pub greedy: bool,
    pub gemv_rows: usize,
    pub fuse_norm: bool,
}

struct Recorded<G> {
    graph: G,
    /// Matrix-vector launches in the recording (the model counts them per replay).
    gemv_launches: u64,
}

/// Recordings kept at most (a decode batch of each size, a few splits each); past it, all are
/// dropped and recorded anew.
const MAX_GRAPHS: usize = 64;

/// The model's recordings, by key.
pub(super) struct Graphs<G> {
    map: HashMap<GraphKey, Recorded<G>>,
    captures: u64,
    replays: u64,
}

impl<G> Default for Graphs<G> {
    fn default() -> Self {
        Graphs {
            map: HashMap::new(),
            captures: 0,
            replays: 0,
        }
    }
}

/// What [`Graphs::run`] did.
pub(super) enum Replayed {
    /// The step ran from a recording; its matrix-vector launches.
    Ran(u64),
    /// The device refused to record (a driver without stream capture, a capture the driver
    /// invalidated): nothing of the step ran.
    Refused(String),
}

/// How often decode steps were recorded and replayed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct GraphStats {
    /// Steps recorded (each also replayed once to run it).
    pub captures: u64,
    /// Steps that replayed an earlier recording.
    pub replays: u64,
    /// Recordings held now.
    pub held: usize,
}

impl<G> Graphs<G> {
    pub fn clear(&mut self) {
        self.map.clear();
    }

    pub fn stats(&self) -> GraphStats {
        GraphStats {
            captures: self.captures,
            replays: self.replays,
            held: self.map.len(),
        }
    }

    /// Runs the step `key` describes: replays its recording, recording it first through
    /// `enqueue` (which queues the step's work and returns its matrix-vector launches) where
    /// there is none. Returns the step's matrix-vector launches — or, where the device refused
    /// to record (nothing of the step has run then), why: the caller queues the step itself.
    pub fn run<D: DeviceOps<Graph = G>>(
        &mut self,
        dev: &D,
        key: GraphKey,
        enqueue: impl FnOnce() -> Result<u64, RuntimeError>,
    ) -> Result<Replayed, RuntimeError> {
        if let Some(r) = self.map.get(&key) {
            dev.replay(&r.graph).map_err(dev_err)?;
            self.replays += 1;
            return Ok(Replayed::Ran(r.gemv_launches));
        }
        if self.map.len() >= MAX_GRAPHS {
            self.map.clear();
        }
        if let Err(e) = dev.begin_capture() {
            return Ok(Replayed::Refused(format!("starting a capture: {e}")));
        }
        let queued = enqueue();
        // Ended whether or not queueing succeeded: a capture left open would swallow the
        // next step's work.
        let ended = dev.end_capture();
        let gemv_launches = queued?;
        let graph = match ended {
            Ok(g) => g,
            Err(e) => return Ok(Replayed::Refused(format!("ending a capture: {e}"))),
        };
        dev.replay(&graph).map_err(dev_err)?;
        self.captures += 1;
        self.map.insert(
            key,
            Recorded {
                graph,
                gemv_launches,
            },
        );
        Ok(Replayed::Ran(gemv_launches))
    }
}
