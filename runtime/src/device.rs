//! `--device cpu|cuda|auto`: which backend runs the model.
//!
//! The CPU backend is the default everywhere. `cuda` (feature `cuda`) runs the model on GPU 0
//! and is refused, with the reason, where there is no driver or device — never a silent
//! fallback. `auto` takes the GPU when the driver reports one, else the CPU.

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
    /// CUDA device ordinal.
    Cuda(usize),
}

/// Resolves a choice to a backend; `note` receives one line to log about the choice `auto`
/// made.
pub fn resolve(choice: DeviceChoice, note: &mut dyn FnMut(String)) -> Result<Device, RuntimeError> {
    match choice {
        DeviceChoice::Cpu => Ok(Device::Cpu),
        DeviceChoice::Auto => match gpus() {
            Ok(n) if n > 0 => {
                note(format!("found {n} CUDA device(s); using device 0"));
                Ok(Device::Cuda(0))
            }
            _ => Ok(Device::Cpu),
        },
        DeviceChoice::Cuda => match gpus() {
            Ok(n) if n > 0 => Ok(Device::Cuda(0)),
            Ok(_) => Err(RuntimeError::Config(
                "--device cuda: the CUDA driver reports no device".into(),
            )),
            Err(e) => Err(RuntimeError::Config(format!("--device cuda: {e}"))),
        },
    }
}

/// Number of CUDA devices (no context is created: that is the load's `device_init`).
#[cfg(feature = "cuda")]
fn gpus() -> Result<usize, String> {
    thaw_kernels::cuda::device_count().map_err(|e| e.to_string())
}

#[cfg(not(feature = "cuda"))]
fn gpus() -> Result<usize, String> {
    Err(
        "this thaw was built without the `cuda` feature (cargo build --release --features cuda)"
            .into(),
    )
}
