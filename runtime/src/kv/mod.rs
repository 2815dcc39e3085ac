//! The paged KV cache's bookkeeping (engine issue, in progress): fixed-size blocks, reference
//! counts, a free list, and a prefix cache of full blocks identified by a hash chained over the
//! previous block's hash and the block's token ids. Pure logic — no tensors — so it can be tested
//! exhaustively; the engine owns one and the KV tensors are indexed by its block ids.

pub mod blocks;

pub use blocks::{BlockId, BlockManager, PrefixMatch};
