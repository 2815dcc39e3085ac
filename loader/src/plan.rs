//! The load plan: what to read, in which order, and where each tensor will sit — decided from
//! headers alone, before any data moves.
//!
//! Per shard the data section is one contiguous byte range, widened to 4 KiB boundaries so that
//! O_DIRECT can read it (the arena holds the widened range; tensors are views at their offsets
//! inside it). The range is cut into chunks; chunks are ordered by the earliest layer they hold
//! (embeddings, layer 0, layer 1, …) so consumers can start on early layers while later ones are
//! still in flight, whatever order the writer put tensors in. Nothing here knows where bytes come
//! from (a file, S3) or where they go (host arena, GPU).

use std::path::PathBuf;

use crate::Checkpoint;

/// O_DIRECT alignment for file offsets, lengths and buffers.
pub const BLOCK: u64 = 4096;

/// Where a device arena puts each shard's data section: on a multiple of this. A safetensors
/// header ends wherever its JSON does (8-byte padded at best), so mirroring the file's alignment
/// would leave every tensor of half the checkpoints off 16-byte boundaries, and the GPU's
/// widest loads (16 bytes) would be unusable on them. A host arena mirrors the file exactly
/// (O_DIRECT reads land in it); device copies come from staging buffers and may land anywhere.
pub const DEVICE_ALIGN: u64 = 256;

#[derive(Debug, Clone)]
pub struct ShardPlan {
    pub path: PathBuf,
    pub file_len: u64,
    /// Where the data section starts in the file.
    pub data_start: u64,
    pub data_len: u64,
    /// The block-aligned file range the arena mirrors: `[aligned_start, aligned_start + aligned_len)`.
    pub aligned_start: u64,
    pub aligned_len: u64,
}

impl ShardPlan {
    /// Offset of the data section inside this shard's arena.
    pub fn data_offset(&self) -> u64 {
        self.data_start - self.aligned_start
    }

    /// Bytes a device arena leaves in front of the mirrored range, so that the data section
    /// starts on a [`DEVICE_ALIGN`] boundary.
    pub fn device_lead(&self) -> u64 {
        (DEVICE_ALIGN - self.data_offset() % DEVICE_ALIGN) % DEVICE_ALIGN
    }

    /// Size of this shard's device arena.
    pub fn device_len(&self) -> u64 {
        self.device_lead() + self.aligned_len
    }

    /// Offset of the data section inside this shard's device arena (a multiple of
    /// [`DEVICE_ALIGN`]).
    pub fn device_data_offset(&self) -> u64 {
        self.device_off(self.data_start)
    }

    /// Where file offset `file_off` (inside the mirrored range) lands in the device arena.
    pub fn device_off(&self, file_off: u64) -> u64 {
        self.device_lead() + file_off - self.aligned_start
    }
}

/// One read: `len` bytes at file offset `file_off` of shard `shard` (both block-aligned except
/// that the last chunk of a shard may run past the end of the file, where reads come up short).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Chunk {
    pub shard: usize,
    pub file_off: u64,
    pub len: u64,
    /// Earliest layer group with a tensor in this chunk (0 = embeddings).
    pub layer: usize,
    /// Last layer group with a tensor in this chunk.
    pub last_layer: usize,
}

impl Chunk {
    /// Offset of this chunk inside its shard's arena.
    pub fn arena_off(&self, plan: &LoadPlan) -> u64 {
        self.file_off - plan.shards[self.shard].aligned_start
    }

    /// Offset of this chunk inside its shard's device arena.
    pub fn device_off(&self, plan: &LoadPlan) -> u64 {
        plan.shards[self.shard].device_off(self.file_off)
    }
}

#[derive(Debug, Clone)]
pub struct LoadPlan {
    pub shards: Vec<ShardPlan>,
    /// Every read, in the order to issue them.
    pub chunks: Vec<Chunk>,
    pub chunk_size: u64,
    /// Number of layer groups (embeddings, each block, then everything else).
    pub layers: usize,
}

/// Layer group of a tensor name: 0 for embeddings, 1 + i for block i, a last group for the rest
/// (final norm, LM head).
pub fn layer_of(name: &str, n_blocks: usize) -> usize {
    if name.contains("embed_tokens") || name.contains("wte") {
        return 0;
    }
    for prefix in ["model.layers.", "layers.", "transformer.h."] {
        if let Some(rest) = name.strip_prefix(prefix) {
            if let Some(i) = rest.split('.').next().and_then(|s| s.parse::<usize>().ok()) {
                return 1 + i;
            }
        }
    }
    n_blocks + 1
}

impl LoadPlan {
    pub fn new(ck: &Checkpoint, chunk_size: u64) -> LoadPlan {
        let chunk_size = chunk_size.max(BLOCK).div_ceil(BLOCK) * BLOCK;
        let n_blocks = ck
            .tensor_names()
            .map(|n| layer_of(n, usize::MAX - 1))
            .filter(|&l| l != usize::MAX)
            .max()
            .unwrap_or(0);
        let mut shards = Vec::new();
        let mut chunks = Vec::new();
        for (si, s) in ck.shards.iter().enumerate() {
            let aligned_start = s.data_start / BLOCK * BLOCK;
            let end = s.data_start + s.data_len;
            let aligned_len = end.div_ceil(BLOCK) * BLOCK - aligned_start;
            // Earliest layer per chunk: walk the (offset-sorted) tensors once.
            let n_chunks = aligned_len.div_ceil(chunk_size) as usize;
            let mut first_layer = vec![usize::MAX; n_chunks];
            let mut last_layer = vec![0usize; n_chunks];
            for t in &s.tensors {
                if t.is_empty() {
                    continue;
                }
                let l = layer_of(&t.name, n_blocks);
                let a = (s.data_start + t.begin - aligned_start) / chunk_size;
                let b = (s.data_start + t.end - 1 - aligned_start) / chunk_size;
                for c in a..=b {
                    first_layer[c as usize] = first_layer[c as usize].min(l);
                    last_layer[c as usize] = last_layer[c as usize].max(l);
                }
            }
            for (c, &l) in first_layer.iter().enumerate() {
                let off = c as u64 * chunk_size;
                chunks.push(Chunk {
                    shard: si,
                    file_off: aligned_start + off,
                    len: chunk_size.min(aligned_len - off),
                    layer: if l == usize::MAX { n_blocks + 1 } else { l },
                    last_layer: if l == usize::MAX {
                        n_blocks + 1
                    } else {
                        last_layer[c]
                    },
                });
            }
            shards.push(ShardPlan {
                path: s.path.clone(),
                file_len: s.file_len,
                data_start: s.data_start,
                data_len: s.data_len,
                aligned_start,
                aligned_len,
            });
        }
        // Stable: within a layer, file order (sequential reads stay sequential).
        chunks.sort_by_key(|c| c.layer);
        LoadPlan {
            shards,
            chunks,
            chunk_size,
            layers: n_blocks + 2,
        }
    }

    pub fn total_bytes(&self) -> u64 {
        self.shards.iter().map(|s| s.data_len).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layer_groups() {
        assert_eq!(layer_of("model.embed_tokens.weight", 30), 0);
        assert_eq!(layer_of("model.layers.0.mlp.up_proj.weight", 30), 1);
        assert_eq!(layer_of("model.layers.29.mlp.up_proj.weight", 30), 30);
        assert_eq!(layer_of("model.norm.weight", 30), 31);
        assert_eq!(layer_of("lm_head.weight", 30), 31);
    }
}
