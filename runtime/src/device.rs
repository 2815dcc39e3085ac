//! `--device cpu|cuda|auto`: which backend runs the model.
//!
//! The CPU backend is the default everywhere. The CUDA backend (feature `cuda`, issue 7) can so
//! far only find and open a device: `auto` therefore picks the CPU (saying so when a GPU is
//! present), and `cuda` is refused with the reason — never a silent fallback.

use crate::RuntimeError;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceChoice {
    Cpu,
    Cuda,
    Auto,
}

impl std::str::FromStr for DeviceChoice {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "cpu" => Ok(DeviceChoice::Cpu),
            "cuda" => Ok(DeviceChoice::Cuda),
            "auto" => Ok(DeviceChoice::Auto),
            _ => Err(format!("unknown device '{s}' (cpu, cuda, auto)")),
        }
    }
}

/// The backend a model will run on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Device {
    Cpu,
}

/// Resolves a choice to a backend; `note` receives one line to log when `auto` passes over a
/// GPU.
pub fn resolve(choice: DeviceChoice, note: &mut dyn FnMut(String)) -> Result<Device, RuntimeError> {
    match choice {
        DeviceChoice::Cpu => Ok(Device::Cpu),
        DeviceChoice::Auto => {
            if let Some(gpu) = gpu_name() {
                note(format!(
                    "found CUDA device {gpu}; the CUDA backend cannot run models yet, using the CPU"
                ));
            }
            Ok(Device::Cpu)
        }
        DeviceChoice::Cuda => Err(RuntimeError::Config(cuda_refusal())),
    }
}

#[cfg(feature = "cuda")]
fn gpu_name() -> Option<String> {
    thaw_kernels::cuda::open(0).ok().map(|(_, i)| i.name)
}

#[cfg(not(feature = "cuda"))]
fn gpu_name() -> Option<String> {
    None
}

#[cfg(feature = "cuda")]
fn cuda_refusal() -> String {
    match thaw_kernels::cuda::open(0) {
        Err(e) => format!("--device cuda: {e}"),
        Ok((_, i)) => format!(
            "--device cuda: found {} ({} GB), but running models on CUDA is not implemented yet",
            i.name,
            i.total_mem >> 30
        ),
    }
}

#[cfg(not(feature = "cuda"))]
fn cuda_refusal() -> String {
    "--device cuda: this thaw was built without the `cuda` feature (cargo build --release --features cuda)".into()
}
