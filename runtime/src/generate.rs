//! The single-sequence generation loop used by `thaw generate` and the decode benchmark:
//! prefill the prompt, then sample one token per step until EOS, a stop string or the limit.

use std::time::Instant;

use crate::sampling::{Sampler, SamplingParams};
use crate::tokenizer::StreamDecoder;
use crate::{KvCache, Llama, RuntimeError, TextTokenizer};

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

/// Length of the longest suffix of `text` that is a proper prefix of some stop string: that much
/// text must be held back from the stream until we know it is not the start of a stop.
fn held_back(text: &str, stops: &[String]) -> usize {
    let mut keep = 0;
    for s in stops {
        for l in (1..s.len()).rev() {
            if l <= text.len()
                && text.is_char_boundary(text.len() - l)
                && s.is_char_boundary(l)
                && text.ends_with(&s[..l])
            {
                keep = keep.max(l);
                break;
            }
        }
    }
    keep
}

pub fn generate(
    model: &Llama,
    tok: &TextTokenizer,
    prompt: &[u32],
    params: &GenerateParams,
    mut on_text: impl FnMut(&str),
) -> Result<Generation, RuntimeError> {
    params.sampling.validate().map_err(RuntimeError::Request)?;
    if prompt.is_empty() {
        return Err(RuntimeError::Request("the prompt is empty".into()));
    }
    let ctx = model.cfg.max_position_embeddings;
    if prompt.len() >= ctx {
        return Err(RuntimeError::Request(format!(
            "the prompt has {} tokens; the context holds {ctx}",
            prompt.len()
        )));
    }
    let mut eos: Vec<u32> = model.cfg.eos_ids();
    eos.extend(tok.eos_id);
    let mut sampler = Sampler::new(params.sampling.clone());
    let mut cache = KvCache::new(&model.cfg);
    let mut decoder = StreamDecoder::default();
    let t0 = Instant::now();
    let mut logits = model.forward(prompt, &mut cache, false)?;
    let mut out = Vec::new();
    let mut text = String::new();
    let mut emitted = 0;
    let mut t_first = None;
    let mut finish = FinishReason::Length;
    let max_tokens = params.max_tokens.min(ctx - prompt.len());
    while out.len() < max_tokens {
        let id = sampler.sample(&logits);
        t_first.get_or_insert_with(Instant::now);
        if !params.ignore_eos && eos.contains(&id) {
            finish = FinishReason::Stop;
            break;
        }
        out.push(id);
        text.push_str(&decoder.push(tok, id)?);
        if let Some(pos) = params
            .stop
            .iter()
            .filter_map(|s| text.find(s.as_str()))
            .min()
        {
            text.truncate(pos);
            finish = FinishReason::Stop;
            break;
        }
        let safe = text.len() - held_back(&text, &params.stop);
        if safe > emitted {
            on_text(&text[emitted..safe]);
            emitted = safe;
        }
        if out.len() == max_tokens {
            break;
        }
        logits = model.forward(&[id], &mut cache, false)?;
    }
    if text.len() > emitted {
        on_text(&text[emitted..]);
    }
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

#[cfg(test)]
mod tests {
    use super::held_back;

    #[test]
    fn holds_back_possible_stop_prefixes() {
        let stops = vec!["</end>".to_string(), "\n\n".to_string()];
        assert_eq!(held_back("hello </e", &stops), 3);
        assert_eq!(held_back("hello\n", &stops), 1);
        assert_eq!(held_back("hello", &stops), 0);
        assert_eq!(held_back("é", &["éa".to_string()]), 2);
    }
}
