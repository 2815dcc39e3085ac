//! Batch invariance on the default model: a request's logits are bit-identical whether it runs
//! alone or in a paged batch with 15 others, and whatever chunk size its prefill uses.

use thaw_runtime::convert::OutDtype;
use thaw_runtime::fetch::default_model;
use thaw_runtime::kv::BlockManager;
use thaw_runtime::sampling::argmax;
use thaw_runtime::{KvCache, Llama, PagedKv, SeqChunk, TextTokenizer};

const STEPS: usize = 6;

/// Greedy run alone: the logits of every step.
fn alone(m: &Llama, prompt: &[u32]) -> Vec<Vec<f32>> {
    let mut cache = KvCache::new(m);
    let mut logits = m.forward(prompt, &mut cache, false).unwrap();
    let mut out = vec![logits.clone()];
    for _ in 1..STEPS {
        let id = argmax(&logits);
        logits = m.forward(&[id], &mut cache, false).unwrap();
        out.push(logits.clone());
    }
    out
}

struct Live {
    tokens: Vec<u32>,
    done: usize,
    table: Vec<u32>,
    logits: Vec<Vec<f32>>,
}

#[test]
fn sixteen_requests_batched_and_chunked_match_each_alone() {
    let dir = default_model(OutDtype::Bf16).unwrap();
    let m = Llama::load(&dir).unwrap();
    let tok = TextTokenizer::load(&dir).unwrap();
    let texts = [
        "The history of the lighthouse is",
        "def quicksort(arr):\n",
        "Once upon a time, in a small village,",
        "1, 2, 3, 4, 5,",
        "The capital of France is",
        "Water boils at",
        "A haiku about the sea:",
        "In 1969, the first person to walk on the moon was",
        "The quick brown fox",
        "import numpy as np\n",
        "Dear Sir or Madam,",
        "The three primary colors are",
        "Photosynthesis is the process by which",
        "Hello",
        "The lighthouse keeper climbed the spiral stairs each evening, counting the steps as his father had taught him, and",
        "Rust is a programming language that",
    ];
    let prompts: Vec<Vec<u32>> = texts
        .iter()
        .map(|t| tok.encode(t, false).unwrap())
        .collect();
    let want: Vec<Vec<Vec<f32>>> = prompts.iter().map(|p| alone(&m, p)).collect();

    let bs = 16;
    let mut blocks = BlockManager::new(64, bs);
    let mut kv = PagedKv::with_dtype(&m.cfg, bs, 64, m.kv_dtype());
    let mut live: Vec<Live> = prompts
        .iter()
        .map(|p| Live {
            tokens: p.clone(),
            done: 0,
            table: vec![],
            logits: vec![],
        })
        .collect();
    // Each step: every sequence advances — prefill in chunks of a per-sequence size (1 to 7
    // tokens), decodes one token — all in one batched forward.
    let mut step = 0;
    while live.iter().any(|l| l.logits.len() < STEPS) {
        step += 1;
        let mut chunks = Vec::new();
        let mut idx = Vec::new();
        for (i, l) in live.iter_mut().enumerate() {
            if l.logits.len() >= STEPS {
                continue;
            }
            let chunk = if l.done < l.tokens.len() {
                (1 + (i + step) % 7).min(l.tokens.len() - l.done)
            } else {
                0
            };
            let n = if chunk > 0 { chunk } else { 1 };
            let end = l.done + n;
            let need = blocks.blocks_for(end).saturating_sub(l.table.len());
            l.table
                .extend(blocks.allocate(need).expect("enough blocks for the test"));
            idx.push((i, n));
        }
        for &(i, n) in &idx {
            let l = &live[i];
            chunks.push(SeqChunk {
                tokens: &l.tokens[l.done..l.done + n],
                start: l.done,
                table: &l.table,
            });
        }
        let logits = m.forward_batch(&chunks, &mut kv).unwrap();
        let v = m.cfg.vocab_size;
        for (j, &(i, n)) in idx.iter().enumerate() {
            let l = &mut live[i];
            l.done += n;
            if l.done == l.tokens.len() {
                // The prompt (or the last generated token) is fully in: this row's logits count.
                let row = logits[j * v..(j + 1) * v].to_vec();
                l.tokens.push(argmax(&row));
                l.logits.push(row);
            }
        }
    }
    for (i, l) in live.iter().enumerate() {
        assert_eq!(l.logits.len(), STEPS);
        for (s, (got, want)) in l.logits.iter().zip(&want[i]).enumerate() {
            assert!(
                got == want,
                "request {i} step {s}: batched logits differ from alone"
            );
        }
        blocks.release(&l.table);
    }
    assert_eq!(blocks.available(), blocks.total());
}
