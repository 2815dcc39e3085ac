//! # thaw-kernels: the compute, and nothing else
//!
//! Pure functions over host slices, and a device interface ([`device::DeviceOps`]) with its CUDA
//! implementation (`cuda`, feature `cuda`: NVRTC-compiled kernels, cuBLAS): no I/O, no model
//! knowledge. The CPU backend is the default everywhere and is written to be *fast* on the
//! memory-bound decode path and *deterministic* under batching:
//!
//! * **Matrix products** ([`matmul`]) take weights in their stored dtype (bf16, f16 or f32,
//!   row-major `[out, in]` as Hugging Face ships them) and activations in f32, and accumulate in
//!   f32. Weights are widened to f32 in registers as they stream past, so decode reads exactly the
//!   checkpoint's bytes once per step. The SIMD path is picked at run time (AVX-512, AVX2+FMA+F16C,
//!   scalar); work is split over output rows across a spin-then-park [`ThreadPool`].
//! * **Batch invariance.** Every output element is one dot product accumulated in the same lane
//!   order whatever the tile it was computed in (1–4 tokens × 1–4 rows, any token block) and whichever thread ran
//!   it, then reduced by a fixed tree. So a sequence's logits do not depend on what else was in the
//!   batch or how its prompt was chunked — the property the engine's determinism tests rely on.
//! * **8-bit weights** ([`q8`], Q8_0: `i8` per weight plus an f16 scale per 32) go through the
//!   same [`matmul`], with the activations quantized per 32-block once per call, as llama.cpp
//!   does: nearly half bf16's bytes per decode step.
//! * Elementwise and attention kernels ([`ops`]) use fixed-width lane accumulators that LLVM
//!   vectorizes without reassociation, for the same reason.
//!
//! Every kernel is tested against a plain f64 reference on random inputs of awkward sizes.

// SIMD tiles index several arrays by the same lane/row counter; iterators would obscure that.
#![allow(clippy::needless_range_loop)]

#[cfg(feature = "cuda")]
pub mod cuda;
pub mod device;
pub mod isa;
pub mod matmul;
pub mod ops;
pub mod pool;
pub mod q8;

pub use isa::Isa;
pub use matmul::{matmul, matmul_with, Matrix, Weights};
pub use pool::ThreadPool;
