//! The Llama-family forward pass (Llama, Mistral, Qwen2): RMSNorm → GQA attention with RoPE →
//! residual → RMSNorm → SwiGLU MLP → residual, tied or separate LM head.
//!
//! Weights stay where the loader put them, in their checkpoint dtype; each use takes a typed view
//! (no copy). Only the small vectors (norm weights, biases) are widened to f32 once at load. The
//! pass works on a block of `n` tokens at once — prefill and decode are the same code — so every
//! weight matrix is read once per block.

use std::path::Path;
use std::time::{Duration, Instant};

use thaw_kernels::ops::{self, AttnShape};
use thaw_kernels::{matmul, Matrix, ThreadPool, Weights};
use thaw_loader::{
    Checkpoint, Dtype, HostWeights, LoadOptions, LoadStats, Progress, TensorEntry, TensorView,
};

use crate::{ModelConfig, RuntimeError};

const MATRIX_DTYPES: &[Dtype] = &[Dtype::BF16, Dtype::F16, Dtype::F32];

struct Layer {
    attn_norm: Vec<f32>,
    q: TensorEntry,
    k: TensorEntry,
    v: TensorEntry,
    q_bias: Option<Vec<f32>>,
    k_bias: Option<Vec<f32>>,
    v_bias: Option<Vec<f32>>,
    o: TensorEntry,
    mlp_norm: Vec<f32>,
    gate: TensorEntry,
    up: TensorEntry,
    down: TensorEntry,
}

pub struct Llama {
    pub cfg: ModelConfig,
    weights: HostWeights,
    embed: TensorEntry,
    layers: Vec<Layer>,
    norm: Vec<f32>,
    lm_head: TensorEntry,
    inv_freq: Vec<f64>,
    pub load_time: Duration,
    pub weight_dtype: Dtype,
}

/// Per-sequence attention history: keys and values of every position so far, per layer.
pub struct KvCache {
    k: Vec<Vec<f32>>,
    v: Vec<Vec<f32>>,
    len: usize,
}

impl KvCache {
    pub fn new(cfg: &ModelConfig) -> KvCache {
        KvCache {
            k: vec![Vec::new(); cfg.num_hidden_layers],
            v: vec![Vec::new(); cfg.num_hidden_layers],
            len: 0,
        }
    }
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

fn widen(view: TensorView<'_>) -> Vec<f32> {
    match view.dtype {
        Dtype::F32 => view
            .bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
            .collect(),
        Dtype::BF16 => view
            .bytes
            .chunks_exact(2)
            .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        _ => view
            .bytes
            .chunks_exact(2)
            .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
    }
}

fn matrix<'a>(w: &'a HostWeights, e: &'a TensorEntry) -> Matrix<'a> {
    let v = w.view(e);
    let data = match v.dtype {
        Dtype::F32 => Weights::F32(v.as_f32().expect("alignment checked at load")),
        Dtype::BF16 => Weights::Bf16(v.as_u16().expect("alignment checked at load")),
        _ => Weights::F16(v.as_u16().expect("alignment checked at load")),
    };
    Matrix::new(data, v.shape[0], v.shape[1])
}

impl Llama {
    /// Opens, validates and loads the checkpoint in `dir` with the default load options.
    pub fn load(dir: &Path) -> Result<Llama, RuntimeError> {
        Self::load_with(dir, &LoadOptions::default())
    }

    /// Opens, validates and loads the checkpoint in `dir`: every header and required tensor is
    /// checked before any data is read.
    pub fn load_with(dir: &Path, opts: &LoadOptions) -> Result<Llama, RuntimeError> {
        Self::load_with_progress(dir, opts, &mut |_| {})
    }

    /// [`Llama::load_with`], reporting progress as chunks land (layers complete front to back).
    pub fn load_with_progress(
        dir: &Path,
        opts: &LoadOptions,
        progress: &mut dyn FnMut(Progress),
    ) -> Result<Llama, RuntimeError> {
        let t0 = Instant::now();
        let cfg = ModelConfig::load(dir)?;
        let ck = Checkpoint::open(dir)?;
        let (h, ffn, vocab) = (cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size);
        let (qd, kvd) = (cfg.q_dim(), cfg.kv_dim());
        let mat = |name: &str, shape: [usize; 2]| ck.expect(name, &shape, MATRIX_DTYPES).cloned();
        let vec_entry = |name: &str, len: usize| ck.expect(name, &[len], MATRIX_DTYPES).cloned();
        let embed = mat("model.embed_tokens.weight", [vocab, h])?;
        let lm_head = if cfg.tie_word_embeddings {
            embed.clone()
        } else {
            mat("lm_head.weight", [vocab, h])?
        };
        struct Pending {
            l: Layer,
            vecs: Vec<(usize, TensorEntry)>,
        }
        let mut pending = Vec::with_capacity(cfg.num_hidden_layers);
        for i in 0..cfg.num_hidden_layers {
            let p = |s: &str| format!("model.layers.{i}.{s}");
            let mut vecs = vec![
                (0, vec_entry(&p("input_layernorm.weight"), h)?),
                (1, vec_entry(&p("post_attention_layernorm.weight"), h)?),
            ];
            if cfg.has_qkv_bias() {
                vecs.push((2, vec_entry(&p("self_attn.q_proj.bias"), qd)?));
                vecs.push((3, vec_entry(&p("self_attn.k_proj.bias"), kvd)?));
                vecs.push((4, vec_entry(&p("self_attn.v_proj.bias"), kvd)?));
            }
            pending.push(Pending {
                l: Layer {
                    attn_norm: vec![],
                    q: mat(&p("self_attn.q_proj.weight"), [qd, h])?,
                    k: mat(&p("self_attn.k_proj.weight"), [kvd, h])?,
                    v: mat(&p("self_attn.v_proj.weight"), [kvd, h])?,
                    q_bias: None,
                    k_bias: None,
                    v_bias: None,
                    o: mat(&p("self_attn.o_proj.weight"), [h, qd])?,
                    mlp_norm: vec![],
                    gate: mat(&p("mlp.gate_proj.weight"), [ffn, h])?,
                    up: mat(&p("mlp.up_proj.weight"), [ffn, h])?,
                    down: mat(&p("mlp.down_proj.weight"), [h, ffn])?,
                },
                vecs,
            });
        }
        let norm_entry = vec_entry("model.norm.weight", h)?;
        let weight_dtype = embed.info.dtype;
        let weights = HostWeights::load_with(ck, opts, progress)?;
        // Kernels take typed slices: every matrix must sit at an address aligned for its dtype.
        let check = |e: &TensorEntry| -> Result<(), RuntimeError> {
            let v = weights.view(e);
            let ok = if v.dtype == Dtype::F32 {
                v.as_f32().is_some()
            } else {
                v.as_u16().is_some()
            };
            if ok {
                Ok(())
            } else {
                Err(RuntimeError::Config(format!(
                    "{}: tensor '{}' is not aligned to its {} element size",
                    weights.checkpoint.shards[e.shard].path.display(),
                    e.info.name,
                    e.info.dtype
                )))
            }
        };
        check(&embed)?;
        check(&lm_head)?;
        let mut layers = Vec::with_capacity(pending.len());
        for mut p in pending {
            for e in [
                &p.l.q, &p.l.k, &p.l.v, &p.l.o, &p.l.gate, &p.l.up, &p.l.down,
            ] {
                check(e)?;
            }
            for (slot, e) in &p.vecs {
                let v = widen(weights.view(e));
                match slot {
                    0 => p.l.attn_norm = v,
                    1 => p.l.mlp_norm = v,
                    2 => p.l.q_bias = Some(v),
                    3 => p.l.k_bias = Some(v),
                    _ => p.l.v_bias = Some(v),
                }
            }
            layers.push(p.l);
        }
        let norm = widen(weights.view(&norm_entry));
        let hd = cfg.head_dim();
        let inv_freq = (0..hd / 2)
            .map(|i| 1.0 / cfg.rope_theta.powf(2.0 * i as f64 / hd as f64))
            .collect();
        Ok(Llama {
            cfg,
            weights,
            embed,
            layers,
            norm,
            lm_head,
            inv_freq,
            load_time: t0.elapsed(),
            weight_dtype,
        })
    }

    /// Bytes of weights read per decoded token: every matrix once, except that the embedding
    /// table contributes one row unless it doubles as the (fully read) LM head.
    pub fn weight_bytes(&self) -> u64 {
        let mut b = self.weights.bytes;
        if !self.cfg.tie_word_embeddings {
            b -= self.embed.info.len() - self.embed.info.len() / self.cfg.vocab_size as u64;
        }
        b
    }

    pub fn checkpoint_bytes(&self) -> u64 {
        self.weights.bytes
    }

    /// How the weights were loaded (strategy, fallback, phase times).
    pub fn load_stats(&self) -> &LoadStats {
        &self.weights.stats
    }

    /// Runs `tokens` (positions `cache.len()..`) through the model, appending to `cache`. Returns
    /// logits `[1, vocab]` for the last token, or `[n, vocab]` for every token with `all_logits`.
    pub fn forward(
        &self,
        tokens: &[u32],
        cache: &mut KvCache,
        all_logits: bool,
    ) -> Result<Vec<f32>, RuntimeError> {
        let cfg = &self.cfg;
        let n = tokens.len();
        if n == 0 {
            return Err(RuntimeError::Request("no tokens to process".into()));
        }
        if let Some(&bad) = tokens.iter().find(|&&t| t as usize >= cfg.vocab_size) {
            return Err(RuntimeError::Request(format!(
                "token id {bad} is outside the vocabulary of {}",
                cfg.vocab_size
            )));
        }
        if cache.len + n > cfg.max_position_embeddings {
            return Err(RuntimeError::Request(format!(
                "{} positions exceed the model's context of {}",
                cache.len + n,
                cfg.max_position_embeddings
            )));
        }
        let pool = ThreadPool::global();
        let (h, ffn, hd) = (cfg.hidden_size, cfg.intermediate_size, cfg.head_dim());
        let (qd, kvd) = (cfg.q_dim(), cfg.kv_dim());
        let shape = AttnShape {
            n_heads: cfg.num_attention_heads,
            n_kv_heads: cfg.n_kv_heads(),
            head_dim: hd,
        };
        let w = &self.weights;

        let mut x = vec![0f32; n * h];
        let embed = matrix(w, &self.embed);
        for (t, &id) in tokens.iter().enumerate() {
            embed.row_f32(id as usize, &mut x[t * h..(t + 1) * h]);
        }
        // RoPE angles for the block's positions, shared by all layers.
        let half = hd / 2;
        let mut cos = vec![0f32; n * half];
        let mut sin = vec![0f32; n * half];
        for t in 0..n {
            ops::rope_angles(
                cache.len + t,
                &self.inv_freq,
                &mut cos[t * half..(t + 1) * half],
                &mut sin[t * half..(t + 1) * half],
            );
        }
        let mut xn = vec![0f32; n * h];
        let (mut q, mut k, mut v) = (vec![0f32; n * qd], vec![0f32; n * kvd], vec![0f32; n * kvd]);
        let mut att = vec![0f32; n * qd];
        let mut o = vec![0f32; n * h];
        let (mut g, mut u) = (vec![0f32; n * ffn], vec![0f32; n * ffn]);
        let len = cache.len + n;
        for (li, l) in self.layers.iter().enumerate() {
            ops::rmsnorm(&x, &l.attn_norm, cfg.rms_norm_eps as f32, &mut xn);
            matmul(
                pool,
                &xn,
                n,
                &mut [
                    (matrix(w, &l.q), &mut q),
                    (matrix(w, &l.k), &mut k),
                    (matrix(w, &l.v), &mut v),
                ],
            );
            for (buf, bias, dim) in [
                (&mut q, &l.q_bias, qd),
                (&mut k, &l.k_bias, kvd),
                (&mut v, &l.v_bias, kvd),
            ] {
                if let Some(b) = bias {
                    buf.chunks_exact_mut(dim)
                        .for_each(|r| ops::add_inplace(r, b));
                }
            }
            for t in 0..n {
                let (c, s) = (
                    &cos[t * half..(t + 1) * half],
                    &sin[t * half..(t + 1) * half],
                );
                ops::rope(&mut q[t * qd..(t + 1) * qd], hd, c, s);
                ops::rope(&mut k[t * kvd..(t + 1) * kvd], hd, c, s);
            }
            cache.k[li].extend_from_slice(&k);
            cache.v[li].extend_from_slice(&v);
            ops::attention(
                pool,
                &q,
                &cache.k[li],
                &cache.v[li],
                n,
                len,
                shape,
                &mut att,
            );
            matmul(pool, &att, n, &mut [(matrix(w, &l.o), &mut o)]);
            ops::add_inplace(&mut x, &o);

            ops::rmsnorm(&x, &l.mlp_norm, cfg.rms_norm_eps as f32, &mut xn);
            matmul(
                pool,
                &xn,
                n,
                &mut [(matrix(w, &l.gate), &mut g), (matrix(w, &l.up), &mut u)],
            );
            ops::silu_mul(&mut g, &u);
            matmul(pool, &g, n, &mut [(matrix(w, &l.down), &mut o)]);
            ops::add_inplace(&mut x, &o);
        }
        cache.len = len;
        let rows = if all_logits { n } else { 1 };
        let last = &x[(n - rows) * h..];
        let mut normed = vec![0f32; rows * h];
        ops::rmsnorm(last, &self.norm, cfg.rms_norm_eps as f32, &mut normed);
        let mut logits = vec![0f32; rows * cfg.vocab_size];
        matmul(
            pool,
            &normed,
            rows,
            &mut [(matrix(w, &self.lm_head), &mut logits)],
        );
        Ok(logits)
    }
}
