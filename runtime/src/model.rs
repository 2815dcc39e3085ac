//! The Llama-family forward pass (Llama, Mistral, Qwen2): RMSNorm → GQA attention with RoPE →
//! residual → RMSNorm → SwiGLU MLP → residual, tied or separate LM head.
//!
//! Weights stay where the loader put them, in their checkpoint dtype; each use takes a typed view
//! (no copy). Only the small vectors (norm weights, biases) are widened to f32 once at load. The
//! pass works on a block of `n` tokens at once — prefill and decode are the same code — so every
//! weight matrix is read once per block.

use std::path::Path;
use std::sync::Arc;

use thaw_kernels::ops::{self, AttnShape};
use thaw_kernels::{matmul, Matrix, ThreadPool, Weights};
use thaw_loader::{
    Checkpoint, Dtype, HostWeights, LoadOptions, LoadStats, Progress, TensorEntry, TensorView,
};

use crate::kv_store::KvBuf;
use crate::{ModelConfig, RuntimeError};

const MATRIX_DTYPES: &[Dtype] = &[Dtype::BF16, Dtype::F16, Dtype::F32];
/// The block projections may also be Q8_0: `I8` values beside a `<name>_scale` F16 tensor of
/// one scale per 32 (what `thaw quantize` writes).
const PROJ_DTYPES: &[Dtype] = &[Dtype::BF16, Dtype::F16, Dtype::F32, Dtype::I8];

/// The name of a Q8_0 weight's scale tensor.
pub fn scale_name(weight: &str) -> String {
    format!("{weight}_scale")
}

/// A norm weight or bias, widened to f32 on first use (at load, or — when the load streams —
/// once its layer has landed).
struct Vec32 {
    entry: TensorEntry,
    v: std::sync::OnceLock<Vec<f32>>,
}

impl Vec32 {
    fn new(entry: TensorEntry) -> Vec32 {
        Vec32 {
            entry,
            v: std::sync::OnceLock::new(),
        }
    }
    fn get(&self, w: &HostWeights) -> &[f32] {
        self.v.get_or_init(|| widen(w.view(&self.entry)))
    }
}

struct Layer {
    attn_norm: Vec32,
    q: Proj,
    k: Proj,
    v: Proj,
    q_bias: Option<Vec32>,
    k_bias: Option<Vec32>,
    v_bias: Option<Vec32>,
    o: Proj,
    mlp_norm: Vec32,
    gate: Proj,
    up: Proj,
    down: Proj,
}

/// A projection's weight tensor and, for Q8_0 (`I8` values), its per-32 f16 scales.
struct Proj {
    w: TensorEntry,
    scale: Option<TensorEntry>,
}

pub struct Llama {
    pub cfg: ModelConfig,
    weights: HostWeights,
    embed: Proj,
    layers: Vec<Layer>,
    norm: Vec32,
    lm_head: Proj,
    inv_freq: Vec<f64>,
    /// While a streaming load is in progress: which layer groups may be read yet.
    gate: Option<Arc<thaw_loader::LayerGate>>,
}

/// Keys and values of every layer in fixed-size blocks, laid out `[block][layer][slot][kv_dim]`:
/// a block holds `block_size` positions of all layers, so the store grows by appending blocks and
/// a block id means the same thing in every layer. Which block holds which positions of which
/// sequence is the caller's block table ([`crate::kv::BlockManager`] hands them out).
pub struct PagedKv {
    block_size: usize,
    layers: usize,
    kv_dim: usize,
    blocks: usize,
    k: KvBuf,
    v: KvBuf,
}

/// How keys and values are stored: f32, or bf16 (half the bytes attention streams per step;
/// used with bf16 weights, whose activations are already rounded to bf16 in the products).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvDtype {
    F32,
    Bf16,
}

impl KvDtype {
    pub(crate) fn bytes(self) -> usize {
        match self {
            KvDtype::F32 => 4,
            KvDtype::Bf16 => 2,
        }
    }
}

impl PagedKv {
    /// An f32 store.
    pub fn new(cfg: &ModelConfig, block_size: usize, blocks: usize) -> PagedKv {
        PagedKv::with_dtype(cfg, block_size, blocks, KvDtype::F32)
    }
    pub fn with_dtype(
        cfg: &ModelConfig,
        block_size: usize,
        blocks: usize,
        dtype: KvDtype,
    ) -> PagedKv {
        let n = blocks * cfg.num_hidden_layers * block_size * cfg.kv_dim();
        PagedKv {
            block_size,
            layers: cfg.num_hidden_layers,
            kv_dim: cfg.kv_dim(),
            blocks,
            k: KvBuf::zeros(dtype, n),
            v: KvBuf::zeros(dtype, n),
        }
    }
    /// Bytes one block takes (keys and values, all layers).
    pub fn bytes_per_block(cfg: &ModelConfig, block_size: usize, dtype: KvDtype) -> usize {
        2 * cfg.num_hidden_layers * block_size * cfg.kv_dim() * dtype.bytes()
    }
    pub fn dtype(&self) -> KvDtype {
        self.k.dtype()
    }
    pub fn blocks(&self) -> usize {
        self.blocks
    }
    pub fn block_size(&self) -> usize {
        self.block_size
    }
    fn block_stride(&self) -> usize {
        self.layers * self.block_size * self.kv_dim
    }
    /// Makes room for at least `blocks` blocks.
    pub fn grow(&mut self, blocks: usize) {
        if blocks > self.blocks {
            self.blocks = blocks;
            let n = blocks * self.block_stride();
            self.k.grow(n);
            self.v.grow(n);
        }
    }
    fn store(&self, layer: usize) -> ops::PagedStore {
        ops::PagedStore {
            block_size: self.block_size,
            block_stride: self.block_stride(),
            layer_off: layer * self.block_size * self.kv_dim,
        }
    }
    /// Element offset of position `pos` of layer `layer` for a sequence with block table `table`.
    pub(crate) fn slot(&self, layer: usize, table: &[u32], pos: usize) -> usize {
        table[pos / self.block_size] as usize * self.block_stride()
            + (layer * self.block_size + pos % self.block_size) * self.kv_dim
    }
}

/// One sequence's share of a batched forward step: `tokens` at positions `start..`, its keys and
/// values read and written through `table` (which must cover every position up to the last).
#[derive(Clone, Copy, Debug)]
pub struct SeqChunk<'a> {
    pub tokens: &'a [u32],
    pub start: usize,
    pub table: &'a [u32],
}

/// A single sequence's attention history (for `generate` and tests): a private paged store whose
/// blocks are used in order.
pub struct KvCache {
    kv: PagedKv,
    table: Vec<u32>,
    len: usize,
}

/// Block size of [`KvCache`] (and the engine's default).
pub const DEFAULT_BLOCK_SIZE: usize = 16;

impl KvCache {
    /// An empty cache for `model` (storing keys and values as [`Llama::kv_dtype`] says).
    pub fn new(model: &Llama) -> KvCache {
        KvCache {
            kv: PagedKv::with_dtype(&model.cfg, DEFAULT_BLOCK_SIZE, 0, model.kv_dtype()),
            table: vec![],
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

/// A 16- or 32-bit float tensor's values as f32.
pub(crate) fn widen(view: TensorView<'_>) -> Vec<f32> {
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

fn proj<'a>(w: &'a HostWeights, p: &'a Proj) -> Matrix<'a> {
    match &p.scale {
        Some(s) => {
            let v = w.view(&p.w);
            let scales = w.view(s).as_u16().expect("alignment checked at load");
            let qs = v.as_i8().expect("checked at load");
            Matrix::new(Weights::Q8 { qs, scales }, v.shape[0], v.shape[1])
        }
        None => matrix(w, &p.w),
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

/// The KV element for weights of `weights` dtype (both backends' policy): bf16 with bf16
/// weights, else f32; `THAW_KV_DTYPE=f32|bf16` overrides (read once).
pub(crate) fn kv_dtype_for(weights: Dtype) -> KvDtype {
    static FORCED: std::sync::OnceLock<Option<KvDtype>> = std::sync::OnceLock::new();
    let forced = FORCED.get_or_init(|| match std::env::var("THAW_KV_DTYPE").as_deref() {
        Ok("f32") => Some(KvDtype::F32),
        Ok("bf16") => Some(KvDtype::Bf16),
        _ => None,
    });
    forced.unwrap_or(if weights == Dtype::BF16 {
        KvDtype::Bf16
    } else {
        KvDtype::F32
    })
}

/// RoPE inverse frequencies `1 / theta^(2i / head_dim)`, in f64 (angles are rounded once).
pub(crate) fn inv_freq(cfg: &ModelConfig) -> Vec<f64> {
    let hd = cfg.head_dim();
    (0..hd / 2)
        .map(|i| 1.0 / cfg.rope_theta.powf(2.0 * i as f64 / hd as f64))
        .collect()
}

/// One block's tensors, found and shape-checked in the checkpoint.
pub(crate) struct LayerTensors {
    pub attn_norm: TensorEntry,
    pub q: TensorEntry,
    pub k: TensorEntry,
    pub v: TensorEntry,
    pub q_bias: Option<TensorEntry>,
    pub k_bias: Option<TensorEntry>,
    pub v_bias: Option<TensorEntry>,
    pub o: TensorEntry,
    pub mlp_norm: TensorEntry,
    pub gate: TensorEntry,
    pub up: TensorEntry,
    pub down: TensorEntry,
}

/// Every tensor a Llama-family model needs, checked for presence, shape and dtype before any
/// data is read (shared by the CPU and CUDA models).
pub(crate) struct Tensors {
    pub embed: TensorEntry,
    pub lm_head: TensorEntry,
    pub norm: TensorEntry,
    pub layers: Vec<LayerTensors>,
    /// Scales of the Q8_0 projections, by the weight's name (empty unless quantized).
    pub scales: std::collections::HashMap<String, TensorEntry>,
}

impl Tensors {
    pub(crate) fn find(cfg: &ModelConfig, ck: &Checkpoint) -> Result<Tensors, RuntimeError> {
        let (h, ffn, vocab) = (cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size);
        let (qd, kvd) = (cfg.q_dim(), cfg.kv_dim());
        let vec_entry = |name: &str, len: usize| ck.expect(name, &[len], MATRIX_DTYPES).cloned();
        let scales = std::cell::RefCell::new(std::collections::HashMap::new());
        let mat_q = |name: &str, shape: [usize; 2]| -> Result<TensorEntry, RuntimeError> {
            let e = ck.expect(name, &shape, PROJ_DTYPES)?.clone();
            if e.info.dtype == Dtype::I8 {
                if !shape[1].is_multiple_of(thaw_kernels::q8::BLOCK) {
                    return Err(RuntimeError::Config(format!(
                        "tensor '{name}': Q8_0 needs rows of whole 32-blocks, not {}",
                        shape[1]
                    )));
                }
                let sn = scale_name(name);
                let s = ck.expect(
                    &sn,
                    &[shape[0], shape[1] / thaw_kernels::q8::BLOCK],
                    &[Dtype::F16],
                )?;
                scales.borrow_mut().insert(name.to_string(), s.clone());
            }
            Ok(e)
        };
        let embed = mat_q("model.embed_tokens.weight", [vocab, h])?;
        let lm_head = if cfg.tie_word_embeddings {
            embed.clone()
        } else {
            mat_q("lm_head.weight", [vocab, h])?
        };
        let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
        for i in 0..cfg.num_hidden_layers {
            let p = |s: &str| format!("model.layers.{i}.{s}");
            let bias = |s: &str, len| -> Result<Option<TensorEntry>, RuntimeError> {
                Ok(if cfg.has_qkv_bias() {
                    Some(vec_entry(&p(s), len)?)
                } else {
                    None
                })
            };
            layers.push(LayerTensors {
                attn_norm: vec_entry(&p("input_layernorm.weight"), h)?,
                mlp_norm: vec_entry(&p("post_attention_layernorm.weight"), h)?,
                q_bias: bias("self_attn.q_proj.bias", qd)?,
                k_bias: bias("self_attn.k_proj.bias", kvd)?,
                v_bias: bias("self_attn.v_proj.bias", kvd)?,
                q: mat_q(&p("self_attn.q_proj.weight"), [qd, h])?,
                k: mat_q(&p("self_attn.k_proj.weight"), [kvd, h])?,
                v: mat_q(&p("self_attn.v_proj.weight"), [kvd, h])?,
                o: mat_q(&p("self_attn.o_proj.weight"), [h, qd])?,
                gate: mat_q(&p("mlp.gate_proj.weight"), [ffn, h])?,
                up: mat_q(&p("mlp.up_proj.weight"), [ffn, h])?,
                down: mat_q(&p("mlp.down_proj.weight"), [h, ffn])?,
            });
        }
        let norm = vec_entry("model.norm.weight", h)?;
        Ok(Tensors {
            embed,
            lm_head,
            norm,
            layers,
            scales: scales.into_inner(),
        })
    }
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
        Self::build(dir, |ck| {
            Ok((HostWeights::load_with(ck, opts, progress)?, None))
        })
    }

    /// Starts loading and returns the model at once: a forward pass waits, layer by layer, for
    /// the weights it needs (so a first request's prefill overlaps the rest of the load). The
    /// handle gives the load's final stats, or its error (which also fails any forward pass
    /// still waiting).
    pub fn load_streaming(
        dir: &Path,
        opts: &LoadOptions,
    ) -> Result<
        (
            Llama,
            std::thread::JoinHandle<Result<LoadStats, thaw_loader::LoadError>>,
        ),
        RuntimeError,
    > {
        let mut done = None;
        let model = Self::build(dir, |ck| {
            let s = thaw_loader::load_streaming(ck, opts)?;
            done = Some(s.done);
            Ok((s.weights, Some(s.gate)))
        })?;
        let done = done.ok_or_else(|| RuntimeError::Config("the load did not start".into()))?;
        Ok((model, done))
    }

    /// Validates `dir`'s config and tensors, then gets the weights from `load`.
    fn build(
        dir: &Path,
        load: impl FnOnce(
            Checkpoint,
        )
            -> Result<(HostWeights, Option<Arc<thaw_loader::LayerGate>>), RuntimeError>,
    ) -> Result<Llama, RuntimeError> {
        let cfg = ModelConfig::load(dir)?;
        let ck = Checkpoint::open(dir)?;
        let t = Tensors::find(&cfg, &ck)?;
        let (weights, gate) = load(ck)?;
        // Kernels take typed slices: every matrix must sit at an address aligned for its dtype.
        // (Checked on the address: a streaming load may still be writing the bytes.)
        let check = |e: &TensorEntry| -> Result<(), RuntimeError> {
            let align = match e.info.dtype {
                Dtype::F32 => 4,
                Dtype::I8 => 1,
                _ => 2,
            };
            if weights.addr(e) % align == 0 {
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
        check(&t.embed)?;
        check(&t.lm_head)?;
        let mut layers = Vec::with_capacity(t.layers.len());
        let scales = t.scales;
        for s in scales.values() {
            check(s)?;
        }
        // (Tied embeddings: the embedding and the LM head share one tensor and its scales.)
        let p = |w: TensorEntry| Proj {
            scale: scales.get(&w.info.name).cloned(),
            w,
        };
        for l in t.layers {
            for e in [&l.q, &l.k, &l.v, &l.o, &l.gate, &l.up, &l.down] {
                check(e)?;
            }
            layers.push(Layer {
                attn_norm: Vec32::new(l.attn_norm),
                q: p(l.q),
                k: p(l.k),
                v: p(l.v),
                q_bias: l.q_bias.map(Vec32::new),
                k_bias: l.k_bias.map(Vec32::new),
                v_bias: l.v_bias.map(Vec32::new),
                o: p(l.o),
                mlp_norm: Vec32::new(l.mlp_norm),
                gate: p(l.gate),
                up: p(l.up),
                down: p(l.down),
            });
        }
        let norm = Vec32::new(t.norm);
        if gate.is_none() {
            // Everything is in memory: widen now, as part of the load.
            for l in &layers {
                for x in [
                    Some(&l.attn_norm),
                    Some(&l.mlp_norm),
                    l.q_bias.as_ref(),
                    l.k_bias.as_ref(),
                    l.v_bias.as_ref(),
                ]
                .into_iter()
                .flatten()
                {
                    x.get(&weights);
                }
            }
            norm.get(&weights);
        }
        let inv_freq = inv_freq(&cfg);
        Ok(Llama {
            cfg,
            weights,
            embed: p(t.embed),
            layers,
            norm,
            lm_head: p(t.lm_head),
            inv_freq,
            gate,
        })
    }

    /// Bytes of weights read per decoded token: every matrix once, except that the embedding
    /// table contributes one row unless it doubles as the (fully read) LM head.
    pub fn weight_bytes(&self) -> u64 {
        let mut b = self.weights.stats.bytes;
        if !self.cfg.tie_word_embeddings {
            let e = &self.embed.w.info;
            b -= e.len() - e.len() / self.cfg.vocab_size as u64;
        }
        b
    }

    pub fn checkpoint_bytes(&self) -> u64 {
        self.weights.stats.bytes
    }

    /// Whether the block projections are Q8_0 (8-bit values, f16 scales per 32).
    pub fn quantized(&self) -> bool {
        self.embed.scale.is_some() || self.layers.iter().any(|l| l.q.scale.is_some())
    }

    /// How the weights are stored, for reports: `bf16`, or `q8_0+bf16` for Q8_0 projections
    /// beside bf16 embeddings.
    pub fn weight_format(&self) -> String {
        let d = self.weight_dtype().name().to_ascii_lowercase();
        if self.quantized() {
            format!("q8_0+{d}")
        } else {
            d
        }
    }

    /// The dtype the embeddings (and any unquantized matrices) are stored (and streamed) in.
    pub fn weight_dtype(&self) -> Dtype {
        match self.embed.w.info.dtype {
            // A Q8_0 embedding: the norms say what the model's 16-bit type is.
            Dtype::I8 => self.norm.entry.info.dtype,
            d => d,
        }
    }

    /// Waits until layer group `g` (0 = embeddings, 1 + i = block i, the rest last) is loaded.
    fn wait_for(&self, g: usize) -> Result<(), RuntimeError> {
        match &self.gate {
            Some(gate) => gate
                .wait(g)
                .map_err(|e| RuntimeError::Config(format!("loading the weights failed: {e}"))),
            None => Ok(()),
        }
    }

    /// Whether every weight is in memory (always, except during a streaming load).
    pub fn fully_loaded(&self) -> bool {
        self.gate.as_ref().is_none_or(|g| g.ready() >= g.groups())
    }

    /// How this model's keys and values are best stored: bf16 with bf16 weights (half the
    /// attention traffic), else f32. `THAW_KV_DTYPE=f32|bf16` overrides (for measurements).
    pub fn kv_dtype(&self) -> KvDtype {
        kv_dtype_for(self.weight_dtype())
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
        let end = cache.len + tokens.len();
        let need = end.div_ceil(cache.kv.block_size());
        if end <= self.cfg.max_position_embeddings && need > cache.table.len() {
            cache.kv.grow(need);
            cache.table = (0..need as u32).collect();
        }
        let seq = SeqChunk {
            tokens,
            start: cache.len,
            table: &cache.table,
        };
        let logits = self.run(&[seq], &mut cache.kv, &[all_logits])?;
        cache.len = end;
        Ok(logits)
    }

    /// One step for a batch of sequences (continuous batching): every sequence's tokens go
    /// through each weight matrix together, attention reads each sequence's own blocks. Returns
    /// the logits of each sequence's last token, `[seqs.len(), vocab]`. Each sequence's result is
    /// bit-identical to running it alone (see the kernels' batch invariance).
    pub fn forward_batch(
        &self,
        seqs: &[SeqChunk<'_>],
        kv: &mut PagedKv,
    ) -> Result<Vec<f32>, RuntimeError> {
        self.run(seqs, kv, &[])
    }

    /// A step; the chunks `all_rows` marks get logits for every row (see
    /// [`crate::StepModel::forward_batch_rows`]).
    fn run(
        &self,
        seqs: &[SeqChunk<'_>],
        kv: &mut PagedKv,
        all_rows: &[bool],
    ) -> Result<Vec<f32>, RuntimeError> {
        let cfg = &self.cfg;
        crate::step::validate(cfg, seqs, kv.block_size(), kv.blocks())?;
        let pool = ThreadPool::global();
        let (h, ffn, hd) = (cfg.hidden_size, cfg.intermediate_size, cfg.head_dim());
        let (qd, kvd) = (cfg.q_dim(), cfg.kv_dim());
        let shape = AttnShape {
            n_heads: cfg.num_attention_heads,
            n_kv_heads: cfg.n_kv_heads(),
            head_dim: hd,
        };
        let w = &self.weights;
        // Row r of the step: (sequence, position).
        let rows: Vec<(usize, usize)> = seqs
            .iter()
            .enumerate()
            .flat_map(|(i, sq)| (0..sq.tokens.len()).map(move |j| (i, sq.start + j)))
            .collect();
        let n = rows.len();
        let prows: Vec<ops::PagedRow<'_>> = rows
            .iter()
            .map(|&(i, pos)| ops::PagedRow {
                pos,
                table: seqs[i].table,
            })
            .collect();

        let mut x = vec![0f32; n * h];
        self.wait_for(0)?;
        let embed = proj(w, &self.embed);
        for (t, &id) in seqs.iter().flat_map(|sq| sq.tokens.iter()).enumerate() {
            embed.row_f32(id as usize, &mut x[t * h..(t + 1) * h]);
        }
        // RoPE angles for each row's position, shared by all layers.
        let half = hd / 2;
        let mut cos = vec![0f32; n * half];
        let mut sin = vec![0f32; n * half];
        for (t, &(_, pos)) in rows.iter().enumerate() {
            ops::rope_angles(
                pos,
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
        for (li, l) in self.layers.iter().enumerate() {
            self.wait_for(1 + li)?;
            ops::rmsnorm(&x, l.attn_norm.get(w), cfg.rms_norm_eps as f32, &mut xn);
            matmul(
                pool,
                &xn,
                n,
                &mut [
                    (proj(w, &l.q), &mut q),
                    (proj(w, &l.k), &mut k),
                    (proj(w, &l.v), &mut v),
                ],
            );
            for (buf, bias, dim) in [
                (&mut q, &l.q_bias, qd),
                (&mut k, &l.k_bias, kvd),
                (&mut v, &l.v_bias, kvd),
            ] {
                if let Some(b) = bias.as_ref().map(|b| b.get(w)) {
                    buf.chunks_exact_mut(dim)
                        .for_each(|r| ops::add_inplace(r, b));
                }
            }
            for (t, &(i, pos)) in rows.iter().enumerate() {
                let (c, s) = (
                    &cos[t * half..(t + 1) * half],
                    &sin[t * half..(t + 1) * half],
                );
                ops::rope(&mut q[t * qd..(t + 1) * qd], hd, c, s);
                ops::rope(&mut k[t * kvd..(t + 1) * kvd], hd, c, s);
                let at = kv.slot(li, seqs[i].table, pos);
                kv.k.write(at, &k[t * kvd..(t + 1) * kvd]);
                kv.v.write(at, &v[t * kvd..(t + 1) * kvd]);
            }
            ops::paged_attention(
                pool,
                &q,
                kv.k.data(),
                kv.v.data(),
                &prows,
                kv.store(li),
                shape,
                &mut att,
            );
            matmul(pool, &att, n, &mut [(proj(w, &l.o), &mut o)]);
            ops::add_inplace(&mut x, &o);

            ops::rmsnorm(&x, l.mlp_norm.get(w), cfg.rms_norm_eps as f32, &mut xn);
            matmul(
                pool,
                &xn,
                n,
                &mut [(proj(w, &l.gate), &mut g), (proj(w, &l.up), &mut u)],
            );
            ops::silu_mul(&mut g, &u);
            matmul(pool, &g, n, &mut [(proj(w, &l.down), &mut o)]);
            ops::add_inplace(&mut x, &o);
        }
        // Logits for every row of the chunks that asked, the last row of the others.
        let mut picked: Vec<usize> = Vec::with_capacity(seqs.len());
        let mut end = 0;
        for (i, sq) in seqs.iter().enumerate() {
            let first = end;
            end += sq.tokens.len();
            if all_rows.get(i).copied().unwrap_or(false) {
                picked.extend(first..end);
            } else {
                picked.push(end - 1);
            }
        }
        let mut last = vec![0f32; picked.len() * h];
        for (j, &r) in picked.iter().enumerate() {
            last[j * h..(j + 1) * h].copy_from_slice(&x[r * h..(r + 1) * h]);
        }
        let mut normed = vec![0f32; picked.len() * h];
        self.wait_for(usize::MAX)?;
        ops::rmsnorm(
            &last,
            self.norm.get(w),
            cfg.rms_norm_eps as f32,
            &mut normed,
        );
        let mut logits = vec![0f32; picked.len() * cfg.vocab_size];
        matmul(
            pool,
            &normed,
            picked.len(),
            &mut [(proj(w, &self.lm_head), &mut logits)],
        );
        Ok(logits)
    }
}

impl crate::step::StepModel for Llama {
    type Kv = PagedKv;
    fn config(&self) -> &ModelConfig {
        &self.cfg
    }
    fn kv_bytes_per_block(&self, block_size: usize) -> usize {
        PagedKv::bytes_per_block(&self.cfg, block_size, self.kv_dtype())
    }
    fn new_kv(&self, block_size: usize, blocks: usize) -> Result<PagedKv, RuntimeError> {
        Ok(PagedKv::with_dtype(
            &self.cfg,
            block_size,
            blocks,
            self.kv_dtype(),
        ))
    }
    fn forward_batch_rows(
        &self,
        seqs: &[SeqChunk<'_>],
        kv: &mut PagedKv,
        all_rows: &[bool],
    ) -> Result<Vec<f32>, RuntimeError> {
        self.run(seqs, kv, all_rows)
    }
}
