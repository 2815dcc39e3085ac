//! The CUDA backend (feature `cuda`).
//!
//! * Finding a device without ever crashing: cudarc loads libcuda at run time
//!   (`dynamic-loading`), so this compiles and links on machines with no CUDA toolkit; but a
//!   cudarc call made where libcuda is missing panics inside cudarc. Every entry point therefore
//!   checks `is_culib_present()` first and turns absence into a typed error.
//! * [`compile`]: the kernels' CUDA C source (`common.cuh`, `elementwise.cu`, `attention.cu`, `gemv.cu`), compiled at run time by NVRTC for
//!   the device's architecture and cached on disk (tested here wherever libnvrtc loads — no GPU
//!   needed).
//! * [`Gpu`]: context, one stream, cuBLAS, typed kernel launches. The model code that drives it
//!   lives in the runtime (`thaw_runtime::cuda`), so its host-side logic (step plans, slot
//!   arithmetic) is shared with and tested against the CPU backend.

pub mod compile;
mod gpu;

pub use gpu::{DevBuf, Gpu, GpuContext, GpuInit};

use std::sync::Arc;

use cudarc::driver::CudaContext;

#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    #[error("no CUDA driver found (libcuda could not be loaded)")]
    NoDriver,
    #[error("no CUDA device: {0}")]
    NoDevice(String),
    #[error("CUDA driver error: {0}")]
    Driver(String),
    #[error("compiling the CUDA kernels: {0}")]
    Compile(String),
    #[error("not supported by the CUDA backend: {0}")]
    Unsupported(String),
}

/// What a device is, for logs and `--device auto`.
#[derive(Debug, Clone)]
pub struct DeviceInfo {
    pub ordinal: usize,
    pub name: String,
    pub compute_capability: (i32, i32),
    pub total_mem: usize,
    /// Streaming multiprocessors (how many blocks the GPU runs at once, to a factor).
    pub sm_count: usize,
}

/// Whether the CUDA driver library can be loaded on this machine.
pub fn driver_present() -> bool {
    // SAFETY: only probes whether the library can be opened; touches no device.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

/// Number of CUDA devices the driver reports (no context is created).
pub fn device_count() -> Result<usize, CudaError> {
    if !driver_present() {
        return Err(CudaError::NoDriver);
    }
    let n = CudaContext::device_count().map_err(|e| CudaError::Driver(e.to_string()))?;
    Ok(n.max(0) as usize)
}

/// Opens device `ordinal` (creating its primary context): the `device_init` phase of a cold
/// start on a GPU.
pub fn open(ordinal: usize) -> Result<(Arc<CudaContext>, DeviceInfo), CudaError> {
    if !driver_present() {
        return Err(CudaError::NoDriver);
    }
    let n = CudaContext::device_count().map_err(|e| CudaError::Driver(e.to_string()))?;
    if ordinal >= n.max(0) as usize {
        return Err(CudaError::NoDevice(format!(
            "device {ordinal} requested, {n} present"
        )));
    }
    let ctx = CudaContext::new(ordinal).map_err(|e| CudaError::Driver(e.to_string()))?;
    let info = DeviceInfo {
        ordinal,
        name: ctx.name().map_err(|e| CudaError::Driver(e.to_string()))?,
        compute_capability: ctx
            .compute_capability()
            .map_err(|e| CudaError::Driver(e.to_string()))?,
        total_mem: ctx
            .total_mem()
            .map_err(|e| CudaError::Driver(e.to_string()))?,
        sm_count: ctx
            .attribute(
                cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
            )
            .map_err(|e| CudaError::Driver(e.to_string()))?
            .max(1) as usize,
    };
    Ok((ctx, info))
}

#[cfg(test)]
mod tests {
    /// Without a driver, opening a device is a typed error, not a panic; with one, device 0
    /// opens and reports itself.
    #[test]
    fn open_is_an_error_or_a_device_never_a_panic() {
        match super::open(0) {
            Ok((_, info)) => {
                assert!(!info.name.is_empty() && info.total_mem > 0, "{info:?}");
            }
            Err(e) => {
                eprintln!("skipped the GPU part: {e}");
                assert!(!super::driver_present() || !e.to_string().is_empty());
            }
        }
        assert!(matches!(
            super::open(1 << 20),
            Err(super::CudaError::NoDriver
                | super::CudaError::NoDevice(_)
                | super::CudaError::Driver(_))
        ));
    }
}
