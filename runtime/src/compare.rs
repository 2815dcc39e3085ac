//! Comparing two backends on the same weights — the CUDA backend's correctness checks, run
//! against the CPU model by the emulator test (`tests/device_emu.rs`) and by `bench-coldstart gpu`
//! on a GPU: the same prompts, steps and requests, and the error measure their bars (relative
//! error 1e-4 for f32, 1e-2 for bf16) are stated in.

use std::sync::Arc;

use crate::engine::{Engine, EngineConfig, Request};
use crate::step::StepModel;
use crate::{RuntimeError, SamplingParams, SeqChunk};

/// Worst relative error `‖a − b‖ / ‖b‖` over rows of `vocab` (rows beyond the shorter input are
/// not compared: callers compare equal-length outputs).
pub fn rel_err(a: &[f32], b: &[f32], vocab: usize) -> f64 {
    a.chunks(vocab)
        .zip(b.chunks(vocab))
        .map(|(x, y)| {
            let d: f64 = x.iter().zip(y).map(|(p, q)| ((p - q) as f64).powi(2)).sum();
            let n: f64 = y.iter().map(|q| (*q as f64).powi(2)).sum();
            (d / n.max(1e-30)).sqrt()
        })
        .fold(0.0, f64::max)
}

/// `n` deterministic token ids spread over the vocabulary.
pub fn prompt(vocab: usize, n: usize, salt: u64) -> Vec<u32> {
    (0..n as u64)
        .map(|i| ((i * 2_654_435_761 + salt * 97 + 11) % vocab as u64) as u32)
        .collect()
}

/// A prefill, then one batched step: a decode of that sequence plus two new prompts, each over
/// its own scattered block table, the first of them with logits for every row (a prompt's log
/// probabilities); then a decode step of two of them. Returns the prefill's logits and the two
/// later steps' (concatenated).
pub fn steps<M: StepModel>(m: &M) -> Result<(Vec<f32>, Vec<f32>), RuntimeError> {
    let vocab = m.config().vocab_size;
    let mut kv = m.new_kv(16, 64)?;
    let p = prompt(vocab, 37, 1);
    let t0: Vec<u32> = vec![9, 3, 40];
    let prefill = m.forward_batch(
        &[SeqChunk {
            tokens: &p,
            start: 0,
            table: &t0,
        }],
        &mut kv,
    )?;
    let (q1, q2) = (prompt(vocab, 20, 2), prompt(vocab, 5, 3));
    let (t1, t2): (Vec<u32>, Vec<u32>) = (vec![63, 0], vec![17]);
    let next = [p[36]];
    let batch = m.forward_batch_rows(
        &[
            SeqChunk {
                tokens: &next,
                start: 37,
                table: &t0,
            },
            SeqChunk {
                tokens: &q1,
                start: 0,
                table: &t1,
            },
            SeqChunk {
                tokens: &q2,
                start: 0,
                table: &t2,
            },
        ],
        &mut kv,
        &[false, true, false],
    )?;
    if batch.len() != (1 + q1.len() + 1) * vocab {
        return Err(RuntimeError::Config(format!(
            "the batched step gave {} logits rows, not {}",
            batch.len() / vocab,
            1 + q1.len() + 1
        )));
    }
    // Then a decode step of two of them (rows few enough for a device's matrix-vector path),
    // its logits after the batch's.
    let (n0, n1) = ([q1[3]], [q2[1]]);
    let decode = m.forward_batch(
        &[
            SeqChunk {
                tokens: &n0,
                start: 38,
                table: &t0,
            },
            SeqChunk {
                tokens: &n1,
                start: 20,
                table: &t1,
            },
        ],
        &mut kv,
    )?;
    let mut batch = batch;
    batch.extend(decode);
    Ok((prefill, batch))
}

/// Outputs of concurrent requests through the engine (chunked prefill: 16-token steps): greedy
/// ones (steps of only greedy sequences take the model's argmax path) and one seeded sampled
/// request, whose steps need the logits.
pub fn engine_outputs<M: StepModel>(m: Arc<M>) -> Result<Vec<Vec<u32>>, RuntimeError> {
    let vocab = m.config().vocab_size;
    let mut cfg = EngineConfig::with_kv_bytes(&*m, 64 << 20);
    cfg.max_batch_tokens = 16;
    let e = Engine::start(m, cfg)?;
    let streams: Vec<_> = (0..4)
        .map(|i| {
            e.submit(Request {
                prompt: prompt(vocab, 3 + 11 * i, i as u64 + 5),
                max_tokens: 6,
                sampling: if i == 3 {
                    SamplingParams {
                        temperature: 0.7,
                        seed: Some(3),
                        ..SamplingParams::default()
                    }
                } else {
                    SamplingParams::default()
                },
                stop_ids: vec![],
                ignore_eos: true,
                logprobs: None,
                min_tokens: 0,
                prompt_logprobs: None,
                constraint: None,
            })
        })
        .collect();
    Ok(streams.into_iter().map(|s| s.collect().0).collect())
}
