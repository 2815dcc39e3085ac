//! One batched forward step, independent of the backend: the [`StepModel`] interface the engine
//! drives, the checks every step passes before any kernel runs, and the host-side [`StepPlan`]
//! (per-row positions, cache slots, block tables, RoPE angles) a device backend uploads.
//!
//! The plan is plain arithmetic over the same paged layout the CPU store uses, so it is tested
//! here against [`crate::PagedKv`]'s own slot computation — the CUDA backend's addressing is
//! checked on every machine, with or without a GPU.

use crate::model::SeqChunk;
use crate::{ModelConfig, RuntimeError};

/// What the engine needs from a model: its configuration, a KV store of its own kind, and a
/// batched step. The CPU [`crate::Llama`] and the CUDA model implement it.
pub trait StepModel: Send + Sync + 'static {
    /// The paged key/value store this backend computes with (host or device memory).
    type Kv: Send + 'static;
    fn config(&self) -> &ModelConfig;
    /// Bytes one KV block of `block_size` positions takes (all layers, keys and values).
    fn kv_bytes_per_block(&self, block_size: usize) -> usize;
    /// A store of `blocks` blocks of `block_size` positions.
    fn new_kv(&self, block_size: usize, blocks: usize) -> Result<Self::Kv, RuntimeError>;
    /// Runs each sequence's tokens, writing their keys and values through its block table;
    /// returns the logits of each sequence's last token, `[seqs.len(), vocab]`.
    fn forward_batch(
        &self,
        seqs: &[SeqChunk<'_>],
        kv: &mut Self::Kv,
    ) -> Result<Vec<f32>, RuntimeError> {
        self.forward_batch_rows(seqs, kv, &[])
    }
    /// [`StepModel::forward_batch`] with the logits of every token of the chunks `all_rows`
    /// marks (a prompt's log probabilities), in row order: each chunk gives all its rows or
    /// its last one.
    fn forward_batch_rows(
        &self,
        seqs: &[SeqChunk<'_>],
        kv: &mut Self::Kv,
        all_rows: &[bool],
    ) -> Result<Vec<f32>, RuntimeError>;
    /// [`StepModel::forward_batch`] for a step whose every sequence samples greedily: each
    /// sequence's argmax id (the first index of its largest logit, as
    /// [`crate::sampling::argmax`]). A device backend computes it where the logits are and
    /// copies back one id per sequence instead of a vocabulary of floats.
    fn forward_batch_greedy(
        &self,
        seqs: &[SeqChunk<'_>],
        kv: &mut Self::Kv,
    ) -> Result<Vec<u32>, RuntimeError> {
        let vocab = self.config().vocab_size;
        Ok(self
            .forward_batch(seqs, kv)?
            .chunks_exact(vocab)
            .map(crate::sampling::argmax)
            .collect())
    }
}

/// Where a paged store keeps things: `block_size` positions per block, `layers` layers per
/// block, `kv_dim` elements per position and layer (layout `[block][layer][slot][kv_dim]`).
#[derive(Debug, Clone, Copy)]
pub struct KvLayout {
    pub block_size: usize,
    pub layers: usize,
    pub kv_dim: usize,
    pub blocks: usize,
}

impl KvLayout {
    pub fn block_stride(&self) -> usize {
        self.layers * self.block_size * self.kv_dim
    }
    /// Element offset of layer `layer`'s part of a position, relative to layer 0's.
    pub fn layer_off(&self, layer: usize) -> usize {
        layer * self.block_size * self.kv_dim
    }
    /// Element offset of position `pos` (layer 0) for a sequence with block table `table`.
    pub fn slot(&self, table: &[u32], pos: usize) -> usize {
        table[pos / self.block_size] as usize * self.block_stride()
            + (pos % self.block_size) * self.kv_dim
    }
}

/// Rejects a step no backend could run: empty chunks, token ids outside the vocabulary,
/// positions beyond the context, block tables too short or naming blocks the store lacks.
pub fn validate(
    cfg: &ModelConfig,
    seqs: &[SeqChunk<'_>],
    block_size: usize,
    blocks: usize,
) -> Result<(), RuntimeError> {
    let bad = |m: String| Err(RuntimeError::Request(m));
    if seqs.is_empty() || seqs.iter().any(|s| s.tokens.is_empty()) {
        return bad("no tokens to process".into());
    }
    for sq in seqs {
        if let Some(&t) = sq.tokens.iter().find(|&&t| t as usize >= cfg.vocab_size) {
            return bad(format!(
                "token id {t} is outside the vocabulary of {}",
                cfg.vocab_size
            ));
        }
        let end = sq.start + sq.tokens.len();
        if end > cfg.max_position_embeddings {
            return bad(format!(
                "{end} positions exceed the model's context of {}",
                cfg.max_position_embeddings
            ));
        }
        if sq.table.len() * block_size < end || sq.table.iter().any(|&b| b as usize >= blocks) {
            return bad(format!(
                "block table of {} blocks cannot hold positions up to {end}",
                sq.table.len()
            ));
        }
    }
    Ok(())
}

/// The host-side description of one step, row by row (a row is one token of one sequence), in
/// the flat arrays a device backend uploads.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StepPlan {
    pub tokens: Vec<u32>,
    /// Position of each row in its sequence.
    pub pos: Vec<u32>,
    /// Element offset of each row's keys/values in layer 0 (add [`KvLayout::layer_off`]).
    pub slot: Vec<i64>,
    /// Where each row's block table starts in `tables`.
    pub table_off: Vec<u32>,
    /// Every sequence's block table, concatenated.
    pub tables: Vec<u32>,
    /// Rows whose logits are wanted: each sequence's last, or every row.
    pub picked: Vec<u32>,
    /// RoPE angles per row, `[rows, head_dim / 2]` each (f64 angles rounded once, as the CPU).
    pub cos: Vec<f32>,
    pub sin: Vec<f32>,
    /// Rows of one-token chunks (decodes), for the per-row attention kernel.
    pub decode_rows: Vec<u32>,
    /// Prefill tiles: up to [`PREFILL_TILE`] consecutive rows of one multi-token chunk, from
    /// row `tile_row0[t]`, `tile_rows[t]` of them (the flash-style prefill kernel).
    pub tile_row0: Vec<u32>,
    pub tile_rows: Vec<u32>,
}

pub use thaw_kernels::device::PREFILL_TILE;

impl StepPlan {
    /// Builds the plan of a validated step (see [`validate`]); the chunks `all_rows` marks
    /// (index by index; missing entries are `false`) pick every row for logits, the others
    /// their last.
    pub fn build(
        seqs: &[SeqChunk<'_>],
        layout: KvLayout,
        inv_freq: &[f64],
        all_rows: &[bool],
    ) -> StepPlan {
        let mut p = StepPlan::default();
        let half = inv_freq.len();
        for (i, sq) in seqs.iter().enumerate() {
            let off = p.tables.len() as u32;
            p.tables.extend_from_slice(sq.table);
            let first = p.tokens.len() as u32;
            if sq.tokens.len() == 1 {
                p.decode_rows.push(first);
            } else {
                for t0 in (0..sq.tokens.len()).step_by(PREFILL_TILE) {
                    p.tile_row0.push(first + t0 as u32);
                    p.tile_rows
                        .push((sq.tokens.len() - t0).min(PREFILL_TILE) as u32);
                }
            }
            for (j, &t) in sq.tokens.iter().enumerate() {
                let pos = sq.start + j;
                p.tokens.push(t);
                p.pos.push(pos as u32);
                p.slot.push(layout.slot(sq.table, pos) as i64);
                p.table_off.push(off);
                let at = p.cos.len();
                p.cos.resize(at + half, 0.0);
                p.sin.resize(at + half, 0.0);
                thaw_kernels::ops::rope_angles(
                    pos,
                    inv_freq,
                    &mut p.cos[at..at + half],
                    &mut p.sin[at..at + half],
                );
            }
            if all_rows.get(i).copied().unwrap_or(false) {
                p.picked.extend(first..p.tokens.len() as u32);
            } else {
                p.picked.push(p.tokens.len() as u32 - 1);
            }
        }
        p
    }

    pub fn rows(&self) -> usize {
        self.tokens.len()
    }
}

/// Byte offsets of the plan's arrays inside the uploaded metadata buffer.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct MetaOffsets {
    pub tokens: u64,
    pub pos: u64,
    pub slot: u64,
    pub table_off: u64,
    pub tables: u64,
    pub picked: u64,
    pub cos: u64,
    pub sin: u64,
    pub decode_rows: u64,
    pub tile_row0: u64,
    pub tile_rows: u64,
}

impl StepPlan {
    /// The plan packed into one buffer (each array 16-byte aligned), so a device step makes
    /// one upload. The block tables, whose length grows with the contexts, come last: the
    /// other arrays' offsets then depend only on the step's rows, so consecutive decode steps
    /// of one batch have the same offsets — and can replay one recorded CUDA graph.
    pub fn pack(&self) -> (Vec<u8>, MetaOffsets) {
        let p = self;
        let mut out: Vec<u8> = Vec::new();
        fn put<T: Copy>(out: &mut Vec<u8>, v: &[T]) -> u64 {
            out.resize(out.len().next_multiple_of(16), 0);
            let at = out.len() as u64;
            // SAFETY: plain integers and floats viewed as their bytes.
            let b = unsafe {
                std::slice::from_raw_parts(v.as_ptr() as *const u8, std::mem::size_of_val(v))
            };
            out.extend_from_slice(b);
            at
        }
        let mut at = MetaOffsets {
            tokens: put(&mut out, &p.tokens),
            pos: put(&mut out, &p.pos),
            slot: put(&mut out, &p.slot),
            table_off: put(&mut out, &p.table_off),
            picked: put(&mut out, &p.picked),
            cos: put(&mut out, &p.cos),
            sin: put(&mut out, &p.sin),
            decode_rows: put(&mut out, &p.decode_rows),
            tile_row0: put(&mut out, &p.tile_row0),
            tile_rows: put(&mut out, &p.tile_rows),
            tables: 0,
        };
        at.tables = put(&mut out, &p.tables);
        (out, at)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> ModelConfig {
        serde_json::from_str(
            r#"{"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
                "num_key_value_heads": 2, "num_hidden_layers": 3, "vocab_size": 100,
                "max_position_embeddings": 256, "rms_norm_eps": 1e-5}"#,
        )
        .unwrap()
    }

    /// The plan's slots are exactly where the CPU store writes each row, in every layer; its
    /// table offsets find each row's own table; its angles are the CPU's.
    #[test]
    fn plan_addresses_match_the_cpu_store() {
        let c = cfg();
        let kv = crate::PagedKv::new(&c, 4, 40);
        let layout = KvLayout {
            block_size: 4,
            layers: c.num_hidden_layers,
            kv_dim: c.kv_dim(),
            blocks: 40,
        };
        let t1: Vec<u32> = vec![7, 3, 30];
        let t2: Vec<u32> = vec![12, 0, 5, 39, 2];
        let (a, b): (Vec<u32>, Vec<u32>) = ((0..5).collect(), (10..13).collect());
        let seqs = [
            SeqChunk {
                tokens: &a,
                start: 6,
                table: &t1,
            },
            SeqChunk {
                tokens: &b,
                start: 17,
                table: &t2,
            },
        ];
        validate(&c, &seqs, 4, 40).unwrap();
        let hd = c.head_dim();
        let inv: Vec<f64> = (0..hd / 2)
            .map(|i| 1.0 / 10000f64.powf(2.0 * i as f64 / hd as f64))
            .collect();
        let p = StepPlan::build(&seqs, layout, &inv, &[]);
        assert_eq!(p.rows(), 8);
        assert_eq!(p.picked, vec![4, 7]);
        assert_eq!(p.tokens, [a.clone(), b.clone()].concat());
        for (r, (sq, j)) in seqs
            .iter()
            .flat_map(|sq| (0..sq.tokens.len()).map(move |j| (sq, j)))
            .enumerate()
        {
            let pos = sq.start + j;
            assert_eq!(p.pos[r] as usize, pos);
            let off = p.table_off[r] as usize;
            assert_eq!(&p.tables[off..off + sq.table.len()], sq.table);
            for layer in 0..c.num_hidden_layers {
                assert_eq!(
                    p.slot[r] as usize + layout.layer_off(layer),
                    kv.slot(layer, sq.table, pos),
                    "row {r} layer {layer}"
                );
            }
            let (mut cs, mut sn) = (vec![0f32; hd / 2], vec![0f32; hd / 2]);
            thaw_kernels::ops::rope_angles(pos, &inv, &mut cs, &mut sn);
            assert_eq!(&p.cos[r * hd / 2..(r + 1) * hd / 2], &cs[..]);
            assert_eq!(&p.sin[r * hd / 2..(r + 1) * hd / 2], &sn[..]);
        }
        // Every row is a decode row or in exactly one tile; tiles are runs of at most
        // PREFILL_TILE consecutive rows of one chunk.
        let mut seen = vec![0u32; p.rows()];
        for &r in &p.decode_rows {
            seen[r as usize] += 1;
        }
        for (&r0, &n) in p.tile_row0.iter().zip(&p.tile_rows) {
            assert!((1..=PREFILL_TILE as u32).contains(&n));
            for r in r0..r0 + n {
                seen[r as usize] += 1;
                assert_eq!(p.table_off[r as usize], p.table_off[r0 as usize]);
                assert_eq!(p.pos[r as usize], p.pos[r0 as usize] + (r - r0));
            }
        }
        assert!(seen.iter().all(|&c| c == 1), "{seen:?}");
        assert_eq!(p.tile_rows, vec![4, 1, 3]);
        let one: Vec<u32> = vec![7];
        let solo = StepPlan::build(
            &[
                SeqChunk {
                    tokens: &one,
                    start: 3,
                    table: &t1,
                },
                seqs[1],
            ],
            layout,
            &inv,
            &[],
        );
        assert_eq!(solo.decode_rows, vec![0]);
        assert_eq!(
            (solo.tile_row0.clone(), solo.tile_rows.clone()),
            (vec![1], vec![3])
        );
        let all = StepPlan::build(&seqs, layout, &inv, &[true, true]);
        assert_eq!(all.picked, (0..8).collect::<Vec<u32>>());
        // Only the second chunk's rows (rows 5..8), after the first's last row.
        let second = StepPlan::build(&seqs, layout, &inv, &[false, true]);
        assert_eq!(second.picked, vec![4, 5, 6, 7]);
        // Every slot of every row lies inside the store.
        let max = p.slot.iter().max().copied().unwrap() as usize
            + layout.layer_off(c.num_hidden_layers - 1)
            + c.kv_dim();
        assert!(max <= layout.blocks * layout.block_stride());
    }

    /// Steps no backend may run are refused with a reason.
    #[test]
    fn invalid_steps_are_refused() {
        let c = cfg();
        let t: Vec<u32> = vec![0, 1];
        let chunk = |tokens: &'static [u32], start, table| SeqChunk {
            tokens,
            start,
            table,
        };
        for (seqs, want) in [
            (vec![], "no tokens"),
            (vec![chunk(&[], 0, &t)], "no tokens"),
            (vec![chunk(&[100], 0, &t)], "outside the vocabulary"),
            (vec![chunk(&[1], 256, &t)], "context"),
            (vec![chunk(&[1, 2], 7, &t)], "cannot hold"),
        ] {
            let e = validate(&c, &seqs, 4, 2).unwrap_err().to_string();
            assert!(e.contains(want), "{e}");
        }
        let bad_block: Vec<u32> = vec![5];
        let e = validate(&c, &[chunk(&[1], 0, &bad_block)], 4, 2).unwrap_err();
        assert!(e.to_string().contains("cannot hold"), "{e}");
    }

    /// The packed metadata holds each array at its offset, 16-byte aligned, bit for bit.
    #[test]
    fn packed_plan_round_trips() {
        let p = StepPlan {
            tokens: vec![1, 2, 3],
            pos: vec![4, 5, 6],
            slot: vec![7, 8, 1 << 40],
            table_off: vec![0, 0, 2],
            tables: vec![9, 10, 11, 12, 13],
            picked: vec![2],
            cos: vec![0.5; 6],
            sin: vec![-0.25; 6],
            decode_rows: vec![1],
            tile_row0: vec![0, 2],
            tile_rows: vec![1, 1],
        };
        let (b, at) = p.pack();
        // Longer tables (contexts that grew by a block) move no offset: tables come last.
        let grown = StepPlan {
            tables: vec![9, 10, 11, 12, 13, 14, 15],
            table_off: vec![0, 0, 3],
            ..p.clone()
        };
        assert_eq!(grown.pack().1, at);
        let u32s = |off: u64, n: usize| -> Vec<u32> {
            (0..n)
                .map(|i| u32::from_le_bytes(b[off as usize + 4 * i..][..4].try_into().unwrap()))
                .collect()
        };
        for off in [
            at.tokens,
            at.pos,
            at.slot,
            at.table_off,
            at.tables,
            at.picked,
            at.cos,
            at.sin,
        ] {
            assert_eq!(off % 16, 0);
        }
        assert_eq!(u32s(at.tokens, 3), p.tokens);
        assert_eq!(u32s(at.pos, 3), p.pos);
        assert_eq!(u32s(at.table_off, 3), p.table_off);
        assert_eq!(u32s(at.tables, 5), p.tables);
        assert_eq!(u32s(at.picked, 1), p.picked);
        let slot2 = i64::from_le_bytes(b[at.slot as usize + 16..][..8].try_into().unwrap());
        assert_eq!(slot2, 1 << 40);
        let sin0 = f32::from_le_bytes(b[at.sin as usize..][..4].try_into().unwrap());
        assert_eq!(sin0, -0.25);
        assert_eq!(u32s(at.decode_rows, 1), p.decode_rows);
        assert_eq!(u32s(at.tile_row0, 2), p.tile_row0);
        assert_eq!(u32s(at.tile_rows, 2), p.tile_rows);
        assert_eq!(b.len() as u64, at.tables + 4 * p.tables.len() as u64);
    }
}
