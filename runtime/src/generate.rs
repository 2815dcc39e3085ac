//! The single-sequence generation loop used by `thaw generate` and the decode benchmark:
//! prefill the prompt, then sample one token per step until EOS, a stop string or the limit.

use std::time::Instant;

use crate::model::{SeqChunk, DEFAULT_BLOCK_SIZE};
use crate::sampling::{Sampler, SamplingParams};
use crate::step::StepModel;
use crate::textstream::{Delta, TextStream};
use crate::{RuntimeError, TextTokenizer};

#[derive(Debug, Clone)]
pub struct GenerateParams {
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    pub stop: Vec<String>,
    /// Keep going past EOS (benchmarks fix output lengths this way).
    pub ignore_eos: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    Stop,
    Length,
}

#[derive(Debug, Clone, serde::Serialize)]
pub struct Timings {
    /// From the start of generation to the first sampled token (prefill included).
    pub ttft_ms: f64,
    pub prompt_tokens: usize,
    pub prefill_tokens_per_s: f64,
    pub decode_tokens_per_s: f64,
    pub total_ms: f64,
}

#[derive(Debug, Clone)]
pub struct Generation {
    pub output_ids: Vec<u32>,
    pub text: String,
    pub finish_reason: FinishReason,
    pub timings: Timings,
}

/// Generates from `prompt` on any backend (a private KV store sized for prompt + max_tokens).
pub fn generate<M: StepModel>(
    model: &M,
    tok: &TextTokenizer,
    prompt: &[u32],
    params: &GenerateParams,
    mut on_text: impl FnMut(&str),
) -> Result<Generation, RuntimeError> {
    params.sampling.validate().map_err(RuntimeError::Request)?;
    if prompt.is_empty() {
        return Err(RuntimeError::Request("the prompt is empty".into()));
    }
    let cfg = model.config();
    let ctx = cfg.max_position_embeddings;
    if prompt.len() >= ctx {
        return Err(RuntimeError::Request(format!(
            "the prompt has {} tokens; the context holds {ctx}",
            prompt.len()
        )));
    }
    let mut eos: Vec<u32> = cfg.eos_ids();
    eos.extend(tok.eos_id);
    let mut sampler = Sampler::new(params.sampling.clone());
    let max_tokens = params.max_tokens.min(ctx - prompt.len());
    let blocks = (prompt.len() + max_tokens).div_ceil(DEFAULT_BLOCK_SIZE);
    let mut kv = model.new_kv(DEFAULT_BLOCK_SIZE, blocks)?;
    let table: Vec<u32> = (0..blocks as u32).collect();
    let mut step = |tokens: &[u32], start: usize| {
        model.forward_batch(
            &[SeqChunk {
                tokens,
                start,
                table: &table,
            }],
            &mut kv,
        )
    };
    let mut stream = TextStream::new(params.stop.clone());
    let t0 = Instant::now();
    let mut logits = step(prompt, 0)?;
    let mut out = Vec::new();
    let mut t_first = None;
    let mut finish = FinishReason::Length;
    while out.len() < max_tokens {
        let id = sampler.sample(&logits);
        t_first.get_or_insert_with(Instant::now);
        if !params.ignore_eos && eos.contains(&id) {
            finish = FinishReason::Stop;
            break;
        }
        out.push(id);
        sampler.observe(id);
        match stream.push(tok, id)? {
            Delta::Text(d) => {
                if !d.is_empty() {
                    on_text(&d);
                }
            }
            Delta::Stop(d) => {
                if !d.is_empty() {
                    on_text(&d);
                }
                finish = FinishReason::Stop;
                break;
            }
        }
        if out.len() == max_tokens {
            break;
        }
        logits = step(&[id], prompt.len() + out.len() - 1)?;
    }
    let tail = stream.finish();
    if !tail.is_empty() {
        on_text(&tail);
    }
    let text = stream.text().to_string();
    let end = Instant::now();
    let first = t_first.unwrap_or(end);
    let ttft = first - t0;
    let decode_s = (end - first).as_secs_f64();
    // Steps after the first token each produced one more token.
    let decoded =
        out.len().saturating_sub(1) + usize::from(finish == FinishReason::Stop && !out.is_empty());
    Ok(Generation {
        output_ids: out,
        text,
        finish_reason: finish,
        timings: Timings {
            ttft_ms: ttft.as_secs_f64() * 1e3,
            prompt_tokens: prompt.len(),
            prefill_tokens_per_s: prompt.len() as f64 / ttft.as_secs_f64(),
            decode_tokens_per_s: if decode_s > 0.0 {
                decoded as f64 / decode_s
            } else {
                0.0
            },
            total_ms: (end - t0).as_secs_f64() * 1e3,
        },
    })
}
