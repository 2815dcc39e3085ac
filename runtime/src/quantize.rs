//! `thaw quantize`: a checkpoint whose block projections (q, k, v, o, gate, up, down) become
//! Q8_0 — `I8` values and a `<name>_scale` F16 tensor of one scale per 32 — and everything else
//! (embeddings and the tied LM head, norms, biases) stays as it was.
//!
//! The result is an ordinary safetensors directory (same shards/index rules, tensors in forward
//! order, a fresh integrity manifest, the source's config, tokenizer and chat template copied),
//! so every load path — local strategies, streaming, S3 — takes it unchanged; only the CPU
//! kernels see the difference ([`thaw_kernels::q8`]). The embedding table stays 16-bit: it is
//! read one row per token, and as the tied LM head it is the most sensitive product.

use std::path::{Path, PathBuf};

use serde_json::Value as Json;
use thaw_kernels::q8;
use thaw_loader::plan::layer_of;
use thaw_loader::{Checkpoint, Dtype, HostWeights, LoadOptions};

use crate::convert::{write_json, write_safetensors, StTensor};
use crate::model::{scale_name, widen};
use crate::RuntimeError;

const PROJECTIONS: [&str; 7] = [
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
];

/// Files of the source directory that describe its weights (rewritten, not copied).
fn is_weight_file(name: &str) -> bool {
    name.ends_with(".safetensors")
        || name == thaw_loader::checkpoint::INDEX_FILE
        || name == thaw_loader::manifest::MANIFEST_FILE
        || name == thaw_loader::s3::REMOTE_FILE
}

fn is_projection(name: &str) -> bool {
    name.starts_with("model.layers.") && PROJECTIONS.iter().any(|p| name.ends_with(p))
}

#[derive(Debug, Clone, Default)]
pub struct QuantizeOptions {
    pub shard_size: Option<u64>,
    /// Also the embedding table (and so a tied LM head; an untied `lm_head.weight` too).
    pub embeddings: bool,
}

#[derive(Debug)]
pub struct QuantizeReport {
    pub out: PathBuf,
    pub quantized: usize,
    pub bytes_in: u64,
    pub bytes_out: u64,
    pub shards: usize,
}

/// Writes the Q8_0 version of the checkpoint in `src` to `out` (see the module docs).
pub fn quantize(
    src: &Path,
    out: &Path,
    opts: &QuantizeOptions,
) -> Result<QuantizeReport, RuntimeError> {
    let same = |a: &Path, b: &Path| match (a.canonicalize(), b.canonicalize()) {
        (Ok(a), Ok(b)) => a == b,
        _ => false,
    };
    if same(src, out) {
        return Err(RuntimeError::Config(format!(
            "{}: --out must be another directory than the source",
            out.display()
        )));
    }
    let ck = Checkpoint::open(src)?;
    let w = HostWeights::load_with(ck, &LoadOptions::default(), &mut |_| {})?;
    let ck = &w.checkpoint;
    // Forward order (embeddings, block 0, 1, …), file order within a block.
    let blocks = ck
        .tensor_names()
        .map(|n| layer_of(n, usize::MAX - 1))
        .filter(|&l| l != usize::MAX)
        .max()
        .unwrap_or(0);
    let mut names: Vec<&str> = ck.tensor_names().collect();
    names.sort_by_key(|n| {
        let e = ck.get(n).expect("listed");
        (layer_of(n, blocks), e.shard, e.info.begin)
    });
    let mut tensors: Vec<StTensor> = Vec::with_capacity(names.len() * 2);
    let mut quantized = 0;
    for name in names {
        let e = ck.get(name).expect("listed");
        let v = w.view(e);
        let shape = e.info.shape.clone();
        let widenable = matches!(v.dtype, Dtype::BF16 | Dtype::F16 | Dtype::F32);
        let embedding = name == "model.embed_tokens.weight" || name == "lm_head.weight";
        if (is_projection(name) || (opts.embeddings && embedding))
            && widenable
            && shape.len() == 2
            && shape[1].is_multiple_of(q8::BLOCK)
        {
            let vals = widen(v);
            let (qs, scales) = q8::quantize(&vals, shape[0], shape[1]);
            tensors.push((
                name.to_string(),
                shape.clone(),
                Dtype::I8,
                qs.iter().map(|&q| q as u8).collect(),
            ));
            tensors.push((
                scale_name(name),
                vec![shape[0], shape[1] / q8::BLOCK],
                Dtype::F16,
                scales.iter().flat_map(|s| s.to_le_bytes()).collect(),
            ));
            quantized += 1;
        } else {
            tensors.push((name.to_string(), shape, v.dtype, v.bytes.to_vec()));
        }
    }
    if quantized == 0 {
        return Err(RuntimeError::Config(format!(
            "{}: no block projections to quantize (already Q8_0, or not a Llama-family checkpoint)",
            src.display()
        )));
    }
    std::fs::create_dir_all(out).map_err(|e| RuntimeError::io(out, e))?;
    let report = write_safetensors(out, &tensors, opts.shard_size)?;
    for entry in std::fs::read_dir(src).map_err(|e| RuntimeError::io(src, e))? {
        let entry = entry.map_err(|e| RuntimeError::io(src, e))?;
        let name = entry.file_name().to_string_lossy().to_string();
        if !entry.path().is_file() || is_weight_file(&name) {
            continue;
        }
        let to = out.join(&name);
        if name == "config.json" {
            let text = std::fs::read_to_string(entry.path())
                .map_err(|e| RuntimeError::io(entry.path(), e))?;
            let mut cfg: Json = serde_json::from_str(&text)
                .map_err(|e| RuntimeError::Config(format!("{}: {e}", entry.path().display())))?;
            if let Some(o) = cfg.as_object_mut() {
                o.insert(
                    "quantization_config".into(),
                    serde_json::json!({"quant_method": "thaw_q8_0", "group_size": q8::BLOCK,
                        "modules": PROJECTIONS, "embeddings": opts.embeddings}),
                );
            }
            write_json(&to, &cfg)?;
        } else {
            std::fs::copy(entry.path(), &to).map_err(|e| RuntimeError::io(&to, e))?;
        }
    }
    let written = Checkpoint::open(out)?;
    thaw_loader::Manifest::build(&written, thaw_loader::manifest::DEFAULT_CHUNK)?.write(out)?;
    Ok(QuantizeReport {
        out: out.to_path_buf(),
        quantized,
        bytes_in: w.checkpoint.data_bytes(),
        bytes_out: report.bytes,
        shards: report.shards,
    })
}
