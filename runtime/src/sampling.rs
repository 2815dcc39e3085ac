//! Choosing the next token from logits: greedy, or temperature → top-k → min-p → top-p with a
//! seeded RNG, after logit bias, repetition / presence / frequency penalties and bans (a
//! request's stop ids before its `min_tokens`).
//!
//! Presence and frequency penalties follow OpenAI's definition: each logit is lowered by
//! `frequency_penalty × count + presence_penalty × (count > 0)`, counting the tokens this
//! request has generated so far (not the prompt).
//!
//! `logit_bias` (OpenAI's: a value in [-100, 100] added to a token's logit) applies before the
//! penalties. Log probabilities ([`logprobs`]) are always those of the model's own distribution
//! (the raw logits' log-softmax, before bias, penalties and temperature), as vLLM reports them
//! by default: they say what the model thought, whatever the sampler then did.
//!
//! The RNG is SplitMix64: tiny, fast, and fully determined by the seed, so a seeded request gives
//! the same tokens on every run and every machine.

#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// 0 means greedy.
    pub temperature: f32,
    /// 0 means no top-k cut.
    pub top_k: usize,
    /// 1 means no nucleus cut.
    pub top_p: f32,
    pub seed: Option<u64>,
    /// In [-2, 2]; 0 means none.
    pub presence_penalty: f32,
    /// In [-2, 2]; 0 means none.
    pub frequency_penalty: f32,
    /// (token id, value in [-100, 100]) added to the logits before sampling.
    pub logit_bias: Vec<(u32, f32)>,
    /// In [0, 1]: tokens less likely than `min_p` × the likeliest one's probability are cut
    /// (after temperature); 0 means none.
    pub min_p: f32,
    /// In (0, 10]: logits of tokens in the prompt or the output so far are divided by it when
    /// positive, multiplied when negative (vLLM's / Hugging Face's); 1 means none.
    pub repetition_penalty: f32,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            seed: None,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            logit_bias: Vec::new(),
            min_p: 0.0,
            repetition_penalty: 1.0,
        }
    }
}

impl SamplingParams {
    pub fn validate(&self) -> Result<(), String> {
        if !(self.temperature >= 0.0 && self.temperature.is_finite()) {
            return Err(format!(
                "temperature must be a finite number >= 0, got {}",
                self.temperature
            ));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(format!("top_p must be in (0, 1], got {}", self.top_p));
        }
        for (name, v) in [
            ("presence_penalty", self.presence_penalty),
            ("frequency_penalty", self.frequency_penalty),
        ] {
            if !(-2.0..=2.0).contains(&v) {
                return Err(format!("{name} must be in [-2, 2], got {v}"));
            }
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return Err(format!("min_p must be in [0, 1], got {}", self.min_p));
        }
        if !(self.repetition_penalty > 0.0 && self.repetition_penalty <= 10.0) {
            return Err(format!(
                "repetition_penalty must be in (0, 10], got {}",
                self.repetition_penalty
            ));
        }
        if let Some((id, v)) = self
            .logit_bias
            .iter()
            .find(|(_, v)| !(-100.0..=100.0).contains(v))
        {
            return Err(format!(
                "logit_bias values must be in [-100, 100], got {v} for token {id}"
            ));
        }
        Ok(())
    }
}

pub struct Sampler {
    params: SamplingParams,
    state: u64,
    /// How often each generated token occurred (only kept when a penalty is set).
    counts: std::collections::HashMap<u32, u32>,
    /// Tokens of the prompt and the output (only kept for the repetition penalty).
    seen: std::collections::HashSet<u32>,
    /// Ids that may not come next (the stop ids while `min_tokens` is not reached).
    banned: Vec<u32>,
    scratch: Vec<f32>,
}

impl Sampler {
    pub fn new(params: SamplingParams) -> Sampler {
        let seed = params.seed.unwrap_or_else(|| {
            let t = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos() as u64)
                .unwrap_or(0);
            t ^ (std::process::id() as u64) << 32
        });
        Sampler {
            params,
            state: seed,
            counts: Default::default(),
            seen: Default::default(),
            banned: Vec::new(),
            scratch: Vec::new(),
        }
    }

    /// Whether [`Sampler::sample`] is a plain argmax (temperature 0, nothing that changes the
    /// logits): then the model may pick the id itself
    /// ([`crate::StepModel::forward_batch_greedy`]).
    pub fn is_greedy(&self) -> bool {
        self.params.temperature <= 0.0
            && !self.penalized()
            && self.params.repetition_penalty == 1.0
            && self.params.logit_bias.is_empty()
            && self.banned.is_empty()
    }

    fn penalized(&self) -> bool {
        self.params.presence_penalty != 0.0 || self.params.frequency_penalty != 0.0
    }

    /// Records the prompt (the repetition penalty counts its tokens as seen).
    pub fn observe_prompt(&mut self, prompt: &[u32]) {
        if self.params.repetition_penalty != 1.0 {
            self.seen.extend(prompt);
        }
    }

    /// Records a generated token (for the penalties).
    pub fn observe(&mut self, id: u32) {
        if self.penalized() {
            *self.counts.entry(id).or_insert(0) += 1;
        }
        if self.params.repetition_penalty != 1.0 {
            self.seen.insert(id);
        }
    }

    /// Ids that may not be sampled until the next call (empty: none).
    pub fn set_banned(&mut self, ids: &[u32]) {
        self.banned.clear();
        self.banned.extend_from_slice(ids);
    }

    /// Picks the next token from `logits`, after the bias, the penalties and the bans.
    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        let adjusted = !self.params.logit_bias.is_empty()
            || (self.penalized() && !self.counts.is_empty())
            || !self.seen.is_empty()
            || !self.banned.is_empty();
        if !adjusted {
            return self.pick(logits);
        }
        let mut l = std::mem::take(&mut self.scratch);
        l.clear();
        l.extend_from_slice(logits);
        for &(id, b) in &self.params.logit_bias {
            if let Some(v) = l.get_mut(id as usize) {
                *v += b;
            }
        }
        // The CTRL / Hugging Face repetition penalty: seen tokens' logits shrink toward zero
        // from above and grow away from it below, so either sign becomes less likely.
        let rp = self.params.repetition_penalty;
        for &id in &self.seen {
            if let Some(v) = l.get_mut(id as usize) {
                *v = if *v > 0.0 { *v / rp } else { *v * rp };
            }
        }
        for (&id, &n) in &self.counts {
            if let Some(v) = l.get_mut(id as usize) {
                *v -= self.params.frequency_penalty * n as f32 + self.params.presence_penalty;
            }
        }
        for &id in &self.banned {
            if let Some(v) = l.get_mut(id as usize) {
                *v = f32::NEG_INFINITY;
            }
        }
        let id = self.pick(&l);
        self.scratch = l;
        id
    }

    fn next_f64(&mut self) -> f64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        (z >> 11) as f64 / (1u64 << 53) as f64
    }

    fn pick(&mut self, logits: &[f32]) -> u32 {
        if self.params.temperature <= 0.0 {
            return argmax(logits);
        }
        let inv_t = 1.0 / self.params.temperature as f64;
        let mut cand: Vec<(u32, f32)> = logits
            .iter()
            .enumerate()
            .filter(|(_, v)| !v.is_nan())
            .map(|(i, &v)| (i as u32, v))
            .collect();
        if cand.is_empty() {
            return 0;
        }
        let by_logit = |a: &(u32, f32), b: &(u32, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
        if self.params.top_k > 0 && self.params.top_k < cand.len() {
            cand.select_nth_unstable_by(self.params.top_k - 1, by_logit);
            cand.truncate(self.params.top_k);
        }
        cand.sort_unstable_by(by_logit);
        let max = cand[0].1 as f64;
        let mut probs: Vec<f64> = cand
            .iter()
            .map(|c| ((c.1 as f64 - max) * inv_t).exp())
            .collect();
        let z: f64 = probs.iter().sum();
        probs.iter_mut().for_each(|p| *p /= z);
        let mut keep = probs.len();
        if self.params.min_p > 0.0 {
            // min-p: only tokens at least min_p times as likely as the likeliest.
            let floor = self.params.min_p as f64 * probs[0];
            keep = probs.iter().take_while(|&&p| p >= floor).count().max(1);
        }
        if self.params.top_p < 1.0 {
            let mut acc = 0.0;
            for (i, p) in probs[..keep].iter().enumerate() {
                acc += p;
                if acc >= self.params.top_p as f64 {
                    keep = i + 1;
                    break;
                }
            }
        }
        let total: f64 = probs[..keep].iter().sum();
        let mut r = self.next_f64() * total;
        for i in 0..keep {
            r -= probs[i];
            if r < 0.0 {
                return cand[i].0;
            }
        }
        cand[keep - 1].0
    }
}

/// The log probabilities of one generated token: its own and the `k` likeliest alternatives.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprobs {
    pub logprob: f32,
    /// (id, log probability), likeliest first (ties: lower id first).
    pub top: Vec<(u32, f32)>,
}

/// Log-softmax of `logits` at `id`, and its `k` largest entries: one pass for the maximum and
/// the top `k` (an insertion into a short sorted list; `k` is at most 20), one for the sum.
pub fn logprobs(logits: &[f32], id: u32, k: usize) -> TokenLogprobs {
    let mut max = f32::NEG_INFINITY;
    let mut top: Vec<(u32, f32)> = Vec::with_capacity(k + 1);
    for (i, &v) in logits.iter().enumerate() {
        if v.is_nan() {
            continue;
        }
        max = max.max(v);
        if k > 0 && (top.len() < k || v > top[top.len() - 1].1) {
            // After the last entry that is >= v: equal logits keep the lower id first.
            let at = top.partition_point(|&(_, t)| t >= v);
            top.insert(at, (i as u32, v));
            top.truncate(k);
        }
    }
    let sum: f64 = logits
        .iter()
        .filter(|v| !v.is_nan())
        .map(|&v| ((v - max) as f64).exp())
        .sum();
    let lse = max as f64 + sum.ln();
    let lp = |v: f32| (v as f64 - lse) as f32;
    TokenLogprobs {
        logprob: logits
            .get(id as usize)
            .map_or(f32::NEG_INFINITY, |&v| lp(v)),
        top: top.into_iter().map(|(i, v)| (i, lp(v))).collect(),
    }
}

/// Index of the largest logit (the first one on ties).
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in logits.iter().enumerate() {
        if v > logits[best] {
            best = i;
        }
    }
    best as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_and_seeded() {
        let logits = [0.1, 2.0, 2.0, -1.0];
        assert_eq!(Sampler::new(SamplingParams::default()).sample(&logits), 1);
        let p = SamplingParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            seed: Some(42),
            ..Default::default()
        };
        let a: Vec<u32> = {
            let mut s = Sampler::new(p.clone());
            (0..50).map(|_| s.sample(&logits)).collect()
        };
        let b: Vec<u32> = {
            let mut s = Sampler::new(p.clone());
            (0..50).map(|_| s.sample(&logits)).collect()
        };
        assert_eq!(a, b);
        assert!(a.contains(&1) && a.contains(&2));
    }

    #[test]
    fn penalties_lower_repeated_tokens() {
        let logits = [3.0, 2.5, 0.0];
        let mut s = Sampler::new(SamplingParams {
            frequency_penalty: 0.4,
            ..Default::default()
        });
        // 3.0 → 2.6 → 2.2: token 1 (2.5) wins once token 0 has been generated twice.
        let mut out = vec![];
        for _ in 0..3 {
            let t = s.sample(&logits);
            s.observe(t);
            out.push(t);
        }
        assert_eq!(out, vec![0, 0, 1]);
        let mut s = Sampler::new(SamplingParams {
            presence_penalty: 0.6,
            ..Default::default()
        });
        let t = s.sample(&logits);
        s.observe(t);
        assert_eq!((t, s.sample(&logits)), (0, 1));
        assert!(SamplingParams {
            presence_penalty: 2.5,
            ..Default::default()
        }
        .validate()
        .is_err());
    }

    #[test]
    fn logit_bias_moves_and_bans_tokens() {
        let logits = [3.0, 2.5, 0.0];
        let biased = |bias: Vec<(u32, f32)>| {
            let mut s = Sampler::new(SamplingParams {
                logit_bias: bias,
                ..Default::default()
            });
            assert!(!s.is_greedy(), "a biased argmax is not the model's argmax");
            s.sample(&logits)
        };
        assert_eq!(biased(vec![(2, 3.5)]), 2);
        assert_eq!(biased(vec![(0, -100.0)]), 1);
        // An id past the vocabulary changes nothing (the server refuses it before).
        assert_eq!(biased(vec![(7, 100.0)]), 0);
        // Sampled: a banned token never comes up.
        let mut s = Sampler::new(SamplingParams {
            temperature: 1.0,
            seed: Some(9),
            logit_bias: vec![(0, -100.0), (1, -100.0)],
            ..Default::default()
        });
        assert!((0..100).all(|_| s.sample(&logits) == 2));
        assert!(SamplingParams {
            logit_bias: vec![(1, 101.0)],
            ..Default::default()
        }
        .validate()
        .is_err());
    }

    #[test]
    fn min_p_repetition_penalty_and_bans() {
        let logits = [5.0, 4.9, 0.0, -3.0, 4.8];
        // min_p 0.5: 0.0 and -3.0 are far below half of the likeliest's probability.
        let mut s = Sampler::new(SamplingParams {
            temperature: 1.0,
            min_p: 0.5,
            seed: Some(2),
            ..Default::default()
        });
        let got: std::collections::BTreeSet<u32> = (0..300).map(|_| s.sample(&logits)).collect();
        assert_eq!(got, [0, 1, 4].into_iter().collect());
        // min_p 1: only the likeliest.
        let mut s = Sampler::new(SamplingParams {
            temperature: 1.0,
            min_p: 1.0,
            seed: Some(2),
            ..Default::default()
        });
        assert!((0..50).all(|_| s.sample(&logits) == 0));
        // Repetition penalty 2 on a prompt token: 5.0 → 2.5, so 4.9 wins; a negative logit
        // grows more negative.
        let mut s = Sampler::new(SamplingParams {
            repetition_penalty: 2.0,
            ..Default::default()
        });
        assert!(!s.is_greedy());
        s.observe_prompt(&[0, 3]);
        assert_eq!(s.sample(&logits), 1);
        s.observe(1);
        assert_eq!(s.sample(&logits), 4);
        // Bans: the banned ids never come, until lifted.
        let mut s = Sampler::new(SamplingParams::default());
        s.set_banned(&[0, 1]);
        assert!(!s.is_greedy());
        assert_eq!(s.sample(&logits), 4);
        s.set_banned(&[]);
        assert!(s.is_greedy());
        assert_eq!(s.sample(&logits), 0);
        for bad in [
            SamplingParams {
                min_p: 1.5,
                ..Default::default()
            },
            SamplingParams {
                repetition_penalty: 0.0,
                ..Default::default()
            },
        ] {
            assert!(bad.validate().is_err(), "{bad:?}");
        }
    }

    #[test]
    fn logprobs_are_the_log_softmax_and_its_top_k() {
        let logits = [1.0f32, 3.0, 3.0, -2.0, f32::NAN, 0.5];
        let z: f64 = [1.0f64, 3.0, 3.0, -2.0, 0.5].iter().map(|v| v.exp()).sum();
        let want = |v: f64| (v - z.ln()) as f32;
        let l = logprobs(&logits, 5, 3);
        assert!((l.logprob - want(0.5)).abs() < 1e-6, "{l:?}");
        let ids: Vec<u32> = l.top.iter().map(|t| t.0).collect();
        assert_eq!(ids, vec![1, 2, 0], "likeliest first, ties by id");
        for (id, lp) in &l.top {
            assert!((lp - want(logits[*id as usize] as f64)).abs() < 1e-6);
        }
        let total: f64 = [0usize, 1, 2, 3, 5]
            .iter()
            .map(|&i| (logprobs(&logits, i as u32, 0).logprob as f64).exp())
            .sum();
        assert!((total - 1.0).abs() < 1e-6, "{total}");
        assert!(logprobs(&logits, 0, 0).top.is_empty());
        // k larger than the vocabulary: every (non-NaN) token, sorted.
        assert_eq!(logprobs(&logits, 0, 20).top.len(), 5);
    }

    #[test]
    fn top_k_and_top_p_cut() {
        let logits = [5.0, 4.9, 0.0, -3.0, 4.8];
        let mut s = Sampler::new(SamplingParams {
            temperature: 1.0,
            top_k: 2,
            top_p: 1.0,
            seed: Some(1),
            ..Default::default()
        });
        assert!((0..200).all(|_| {
            let t = s.sample(&logits);
            t == 0 || t == 1
        }));
        let mut s = Sampler::new(SamplingParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 0.3,
            seed: Some(1),
            ..Default::default()
        });
        assert!((0..200).all(|_| s.sample(&logits) == 0));
        assert!(SamplingParams {
            top_p: 0.0,
            ..Default::default()
        }
        .validate()
        .is_err());
        assert!(SamplingParams {
            temperature: -1.0,
            ..Default::default()
        }
        .validate()
        .is_err());
    }
}
