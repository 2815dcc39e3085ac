//! The model a worker serves, on whichever backend `--device` chose: one enum so the worker's
//! load path (phases, engine start) is written once for the CPU and the CUDA model.

use std::sync::Arc;

use thaw_loader::LoadStats;

use super::telemetry::ColdStart;
use super::{LoadDone, ServeOptions};
use crate::device::Device;
use crate::engine::{Engine, EngineConfig};
use crate::{Llama, RuntimeError};

/// A loaded model on its backend.
pub(super) enum Loaded {
    Cpu(Arc<Llama>),
    #[cfg(feature = "cuda")]
    Cuda(Arc<crate::device_model::CudaLlama>),
}

impl Loaded {
    pub(super) fn load(o: &ServeOptions) -> Result<(Loaded, Option<LoadDone>), RuntimeError> {
        match o.device {
            Device::Cpu if o.serve_while_loading => Llama::load_streaming(&o.model_dir, &o.load)
                .map(|(m, d)| (Loaded::Cpu(Arc::new(m)), Some(d))),
            Device::Cpu => {
                Llama::load_with(&o.model_dir, &o.load).map(|m| (Loaded::Cpu(Arc::new(m)), None))
            }
            #[cfg(feature = "cuda")]
            Device::Cuda(ordinal) => {
                crate::device_model::CudaLlama::load(&o.model_dir, &o.load, ordinal)
                    .map(|m| (Loaded::Cuda(Arc::new(m)), None))
            }
            #[cfg(not(feature = "cuda"))]
            Device::Cuda(_) => Err(RuntimeError::Config(
                "this thaw was built without the `cuda` feature".into(),
            )),
        }
    }

    pub(super) fn cfg(&self) -> &crate::ModelConfig {
        match self {
            Loaded::Cpu(m) => &m.cfg,
            #[cfg(feature = "cuda")]
            Loaded::Cuda(m) => &m.cfg,
        }
    }

    pub(super) fn stats(&self) -> &LoadStats {
        match self {
            Loaded::Cpu(m) => m.load_stats(),
            #[cfg(feature = "cuda")]
            Loaded::Cuda(m) => m.load_stats(),
        }
    }

    /// The backend's phases: device bring-up, then the loader's (host → device copy included).
    pub(super) fn push_phases(&self, cs: &mut ColdStart, device_init_s: f64) {
        match self {
            Loaded::Cpu(m) => {
                cs.push("device_init", device_init_s);
                cs.push_load(m.load_stats(), 0.0);
            }
            #[cfg(feature = "cuda")]
            Loaded::Cuda(m) => {
                let p = &m.phases;
                cs.push("device_init", p.context_s);
                cs.push("compile", p.compile_s);
                cs.push("module_load", p.module_s);
                cs.push("alloc", p.alloc_s);
                cs.push_load(m.load_stats(), p.copy_s);
            }
        }
    }

    /// Starts the engine with `o`'s KV budget and batch limits.
    pub(super) fn engine(&self, o: &ServeOptions) -> Result<Engine, RuntimeError> {
        fn start<M: crate::StepModel>(
            m: &Arc<M>,
            o: &ServeOptions,
        ) -> Result<Engine, RuntimeError> {
            let mut cfg = EngineConfig::with_kv_bytes(&**m, o.kv_cache_bytes);
            cfg.max_batch_tokens = o.max_batch_tokens.max(1);
            cfg.max_running = o.max_running.max(1);
            Engine::start(m.clone(), cfg)
        }
        match self {
            Loaded::Cpu(m) => start(m, o),
            #[cfg(feature = "cuda")]
            Loaded::Cuda(m) => start(m, o),
        }
    }
}
