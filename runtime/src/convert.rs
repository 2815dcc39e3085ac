//! `thaw convert`: a llama-architecture GGUF file → a Hugging-Face-style checkpoint directory.
//!
//! Output is exactly what Hugging Face would ship: `config.json`, `model.safetensors` (or shards
//! plus `model.safetensors.index.json`) with HF tensor names and layouts, `tokenizer.json`,
//! `tokenizer_config.json` (chat template, special tokens) and `generation_config.json`.
//! Everything is read from the GGUF's metadata; nothing about the model is hard-coded.
//!
//! Layout notes: GGUF dims list the fastest-varying first, so the row-major shape is their reverse
//! and the bytes need no transposition. llama.cpp's converter permutes the rows of `q_proj` and
//! `k_proj` so that each head's RoPE pairs are adjacent (GPT-J style); we undo that permutation to
//! get Hugging Face's rotate-half layout back.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};

use serde_json::{json, Value as Json};
use thaw_loader::gguf::{GgufFile, GgufTensor, Value};
use thaw_loader::Dtype;

use crate::RuntimeError;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OutDtype {
    Bf16,
    F16,
    F32,
}

impl std::str::FromStr for OutDtype {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "bf16" => Ok(OutDtype::Bf16),
            "f16" => Ok(OutDtype::F16),
            "f32" => Ok(OutDtype::F32),
            _ => Err(format!("unknown dtype '{s}' (bf16, f16 or f32)")),
        }
    }
}

impl OutDtype {
    /// The checkpoint dtype written (its safetensors name and element size).
    fn stored(self) -> Dtype {
        match self {
            OutDtype::Bf16 => Dtype::BF16,
            OutDtype::F16 => Dtype::F16,
            OutDtype::F32 => Dtype::F32,
        }
    }
    fn torch_name(self) -> &'static str {
        match self {
            OutDtype::Bf16 => "bfloat16",
            OutDtype::F16 => "float16",
            OutDtype::F32 => "float32",
        }
    }
    fn encode(self, v: &[f32]) -> Vec<u8> {
        match self {
            OutDtype::F32 => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            OutDtype::Bf16 => v
                .iter()
                .flat_map(|&x| half::bf16::from_f32(x).to_le_bytes())
                .collect(),
            OutDtype::F16 => v
                .iter()
                .flat_map(|&x| half::f16::from_f32(x).to_le_bytes())
                .collect(),
        }
    }
}

pub struct ConvertOptions {
    pub dtype: OutDtype,
    /// Start a new shard once a shard holds this many bytes (`None`: one file).
    pub shard_size: Option<u64>,
}

/// What the conversion wrote.
pub struct ConvertReport {
    pub out: PathBuf,
    pub tensors: usize,
    pub bytes: u64,
    pub shards: usize,
}

fn meta_err(path: &Path, key: &str) -> RuntimeError {
    RuntimeError::Convert(format!(
        "{}: missing or invalid metadata '{key}'",
        path.display()
    ))
}

fn get_u64(g: &GgufFile, key: &str) -> Result<u64, RuntimeError> {
    g.get(key)
        .and_then(Value::as_u64)
        .ok_or_else(|| meta_err(&g.path, key))
}

/// Maps a llama.cpp tensor name to its Hugging Face name.
fn hf_name(gguf: &str) -> Option<String> {
    let simple = match gguf {
        "token_embd.weight" => Some("model.embed_tokens.weight"),
        "output_norm.weight" => Some("model.norm.weight"),
        "output.weight" => Some("lm_head.weight"),
        _ => None,
    };
    if let Some(s) = simple {
        return Some(s.to_string());
    }
    let rest = gguf.strip_prefix("blk.")?;
    let (layer, tail) = rest.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    let (part, kind) = tail.rsplit_once('.')?;
    let hf = match part {
        "attn_norm" => "input_layernorm",
        "ffn_norm" => "post_attention_layernorm",
        "attn_q" => "self_attn.q_proj",
        "attn_k" => "self_attn.k_proj",
        "attn_v" => "self_attn.v_proj",
        "attn_output" => "self_attn.o_proj",
        "ffn_gate" => "mlp.gate_proj",
        "ffn_up" => "mlp.up_proj",
        "ffn_down" => "mlp.down_proj",
        _ => return None,
    };
    Some(format!("model.layers.{layer}.{hf}.{kind}"))
}

/// Sort key that puts tensors in the order a forward pass needs them.
fn layer_order(name: &str) -> (usize, String) {
    if name.starts_with("model.embed_tokens") {
        return (0, name.to_string());
    }
    if let Some(rest) = name.strip_prefix("model.layers.") {
        let l: usize = rest
            .split('.')
            .next()
            .and_then(|s| s.parse().ok())
            .unwrap_or(0);
        return (1 + l, name.to_string());
    }
    (usize::MAX, name.to_string())
}

/// Undoes llama.cpp's `permute` of Q/K rows: GGUF row `h·d + 2i + j` is HF row `h·d + j·d/2 + i`.
fn unpermute_rows(w: &[f32], rows: usize, cols: usize, n_head: usize) -> Vec<f32> {
    let hd = rows / n_head;
    let half = hd / 2;
    let mut out = vec![0f32; w.len()];
    for h in 0..n_head {
        for i in 0..half {
            for j in 0..2 {
                let src = h * hd + 2 * i + j;
                let dst = h * hd + j * half + i;
                out[dst * cols..(dst + 1) * cols].copy_from_slice(&w[src * cols..(src + 1) * cols]);
            }
        }
    }
    out
}

pub fn convert(
    gguf_path: &Path,
    out: &Path,
    opts: &ConvertOptions,
) -> Result<ConvertReport, RuntimeError> {
    let g = GgufFile::open(gguf_path)?;
    let arch = g
        .get("general.architecture")
        .and_then(Value::as_str)
        .unwrap_or("");
    if arch != "llama" {
        return Err(RuntimeError::Convert(format!(
            "{}: architecture '{arch}' is not supported (only llama)",
            gguf_path.display()
        )));
    }
    let key = |k: &str| format!("{arch}.{k}");
    let n_layers = get_u64(&g, &key("block_count"))? as usize;
    let hidden = get_u64(&g, &key("embedding_length"))? as usize;
    let ffn = get_u64(&g, &key("feed_forward_length"))? as usize;
    let n_head = get_u64(&g, &key("attention.head_count"))? as usize;
    let n_kv = g
        .get(&key("attention.head_count_kv"))
        .and_then(Value::as_u64)
        .unwrap_or(n_head as u64) as usize;
    let ctx = get_u64(&g, &key("context_length"))? as usize;
    let theta = g
        .get(&key("rope.freq_base"))
        .and_then(Value::as_f64)
        .unwrap_or(10000.0);
    let eps = match g.get(&key("attention.layer_norm_rms_epsilon")) {
        // Print the f32 in its shortest form (1e-5, not 9.99999974737875e-6), as HF configs do.
        Some(Value::F32(v)) => format!("{v}").parse::<f64>().unwrap_or(*v as f64),
        _ => return Err(meta_err(&g.path, &key("attention.layer_norm_rms_epsilon"))),
    };
    let tokens: Vec<&str> = g
        .get("tokenizer.ggml.tokens")
        .and_then(Value::as_array)
        .ok_or_else(|| meta_err(&g.path, "tokenizer.ggml.tokens"))?
        .iter()
        .map(|v| v.as_str().unwrap_or(""))
        .collect();
    let vocab = g
        .get(&key("vocab_size"))
        .and_then(Value::as_u64)
        .map(|v| v as usize)
        .unwrap_or(tokens.len());
    if n_head == 0 || n_kv == 0 || !hidden.is_multiple_of(n_head) {
        return Err(RuntimeError::Convert(format!(
            "{}: inconsistent head counts",
            gguf_path.display()
        )));
    }
    let head_dim = hidden / n_head;
    let tied = g.tensor("output.weight").is_none();

    std::fs::create_dir_all(out).map_err(|e| RuntimeError::io(out, e))?;

    // Tensors, in forward order, converted.
    let mut named: Vec<(String, &GgufTensor)> = Vec::new();
    for t in &g.tensors {
        let name = hf_name(&t.name).ok_or_else(|| {
            RuntimeError::Convert(format!(
                "{}: unexpected tensor '{}'",
                gguf_path.display(),
                t.name
            ))
        })?;
        named.push((name, t));
    }
    named.sort_by_key(|(n, _)| layer_order(n));
    let mut written: Vec<StTensor> = Vec::with_capacity(named.len());
    for (name, t) in &named {
        let shape = t.shape();
        let mut vals = g.dequantize(t);
        let heads = if name.ends_with("self_attn.q_proj.weight")
            || name.ends_with("self_attn.q_proj.bias")
        {
            Some(n_head)
        } else if name.ends_with("self_attn.k_proj.weight")
            || name.ends_with("self_attn.k_proj.bias")
        {
            Some(n_kv)
        } else {
            None
        };
        if let Some(h) = heads {
            let cols = if shape.len() == 2 { shape[1] } else { 1 };
            vals = unpermute_rows(&vals, shape[0], cols, h);
        }
        // Norm weights stay f32 in HF checkpoints only when the whole model is f32; follow dtype.
        written.push((
            name.clone(),
            shape,
            opts.dtype.stored(),
            opts.dtype.encode(&vals),
        ));
    }

    let report = write_safetensors(out, &written, opts.shard_size)?;
    write_json(
        &out.join("config.json"),
        &json!({
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": hidden,
            "intermediate_size": ffn,
            "num_hidden_layers": n_layers,
            "num_attention_heads": n_head,
            "num_key_value_heads": n_kv,
            "head_dim": head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": ctx,
            "rms_norm_eps": eps,
            "rope_theta": theta,
            "rope_scaling": null,
            "vocab_size": vocab,
            "tie_word_embeddings": tied,
            "attention_bias": false,
            "mlp_bias": false,
            "bos_token_id": g.get("tokenizer.ggml.bos_token_id").and_then(Value::as_u64),
            "eos_token_id": g.get("tokenizer.ggml.eos_token_id").and_then(Value::as_u64),
            "torch_dtype": opts.dtype.torch_name(),
        }),
    )?;
    write_tokenizer(&g, &tokens, out)?;
    // The integrity manifest the loader verifies against.
    let ck = thaw_loader::Checkpoint::open(out)?;
    thaw_loader::Manifest::build(&ck, thaw_loader::manifest::DEFAULT_CHUNK)?.write(out)?;
    Ok(ConvertReport {
        out: out.to_path_buf(),
        ..report
    })
}

pub(crate) fn write_json(path: &Path, v: &Json) -> Result<(), RuntimeError> {
    let text = serde_json::to_string_pretty(v).expect("JSON values always serialize");
    std::fs::write(path, text + "\n").map_err(|e| RuntimeError::io(path, e))
}

/// One tensor to write: name, shape, stored dtype, little-endian bytes.
pub(crate) type StTensor = (String, Vec<usize>, Dtype, Vec<u8>);

/// Writes `tensors` in order as `model.safetensors`, or shards of at most `shard_size` bytes
/// with an index, replacing any earlier conversion's weight files in `out`.
pub(crate) fn write_safetensors(
    out: &Path,
    tensors: &[StTensor],
    shard_size: Option<u64>,
) -> Result<ConvertReport, RuntimeError> {
    // Group into shards by size, keeping forward order.
    let mut shards: Vec<Vec<usize>> = vec![vec![]];
    let mut cur = 0u64;
    for (i, t) in tensors.iter().enumerate() {
        let sz = t.3.len() as u64;
        if let Some(limit) = shard_size {
            if cur > 0 && cur + sz > limit {
                shards.push(vec![]);
                cur = 0;
            }
        }
        shards.last_mut().expect("at least one shard").push(i);
        cur += sz;
    }
    // Remove stale outputs of an earlier conversion with a different layout.
    if let Ok(rd) = std::fs::read_dir(out) {
        for e in rd.flatten() {
            let n = e.file_name().to_string_lossy().to_string();
            if (n.starts_with("model")
                && (n.ends_with(".safetensors") || n.ends_with(".index.json")))
                || n == thaw_loader::manifest::MANIFEST_FILE
            {
                let _ = std::fs::remove_file(e.path());
            }
        }
    }
    let n = shards.len();
    let mut weight_map = BTreeMap::new();
    let mut total = 0u64;
    for (si, idx) in shards.iter().enumerate() {
        let file = if n == 1 {
            "model.safetensors".to_string()
        } else {
            format!("model-{:05}-of-{:05}.safetensors", si + 1, n)
        };
        // Written by hand rather than by the safetensors crate: its header is padded to 8
        // bytes only (ours to a page: see `thaw_loader::safetensors::DATA_ALIGN`), and it
        // reorders tensors by dtype and name, where forward order lets a streaming load hand
        // out layers as they land.
        let mut header = serde_json::Map::new();
        header.insert("__metadata__".into(), json!({"format": "pt"}));
        let mut off = 0usize;
        for &i in idx {
            let (name, shape, dtype, bytes) = &tensors[i];
            let want = shape.iter().product::<usize>() * dtype.size();
            if bytes.len() != want {
                return Err(RuntimeError::Convert(format!(
                    "tensor '{name}': shape {shape:?} of {} needs {want} bytes, got {}",
                    dtype.name(),
                    bytes.len()
                )));
            }
            header.insert(
                name.clone(),
                json!({"dtype": dtype.name(), "shape": shape, "data_offsets": [off, off + want]}),
            );
            weight_map.insert(name.clone(), file.clone());
            off += want;
        }
        total += off as u64;
        let path = out.join(&file);
        let head = thaw_loader::safetensors::header_bytes(&Json::Object(header).to_string());
        let write = || -> std::io::Result<()> {
            let mut w = std::io::BufWriter::with_capacity(8 << 20, std::fs::File::create(&path)?);
            w.write_all(&head)?;
            for &i in idx {
                w.write_all(&tensors[i].3)?;
            }
            w.flush()
        };
        write().map_err(|e| RuntimeError::io(&path, e))?;
    }
    if n > 1 {
        write_json(
            &out.join("model.safetensors.index.json"),
            &json!({"metadata": {"total_size": total}, "weight_map": weight_map}),
        )?;
    }
    Ok(ConvertReport {
        out: out.to_path_buf(),
        tensors: tensors.len(),
        bytes: total,
        shards: n,
    })
}

/// The pre-tokenizer for a llama.cpp `tokenizer.ggml.pre` name.
fn pre_tokenizer(pre: &str) -> Result<Json, RuntimeError> {
    let byte_level = |use_regex: bool| json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": use_regex});
    Ok(match pre {
        // SmolLM / StarCoder vocabularies: every digit on its own, then the GPT-2 split.
        "smollm" | "starcoder" | "refact" => json!({"type": "Sequence", "pretokenizers": [
            {"type": "Digits", "individual_digits": true}, byte_level(true)]}),
        "gpt-2" | "gpt2" | "default" => byte_level(true),
        "llama-bpe" | "llama3" => json!({"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"},
             "behavior": "Isolated", "invert": false},
            byte_level(false)]}),
        other => {
            return Err(RuntimeError::Convert(format!(
                "pre-tokenizer '{other}' is not supported"
            )))
        }
    })
}

fn write_tokenizer(g: &GgufFile, tokens: &[&str], out: &Path) -> Result<(), RuntimeError> {
    let model = g
        .get("tokenizer.ggml.model")
        .and_then(Value::as_str)
        .unwrap_or("");
    if model != "gpt2" {
        return Err(RuntimeError::Convert(format!(
            "{}: tokenizer model '{model}' is not supported (only byte-level BPE, 'gpt2')",
            g.path.display()
        )));
    }
    let pre = g
        .get("tokenizer.ggml.pre")
        .and_then(Value::as_str)
        .unwrap_or("default");
    let merges: Vec<&str> = g
        .get("tokenizer.ggml.merges")
        .and_then(Value::as_array)
        .ok_or_else(|| meta_err(&g.path, "tokenizer.ggml.merges"))?
        .iter()
        .map(|v| v.as_str().unwrap_or(""))
        .collect();
    let types: Vec<i64> = g
        .get("tokenizer.ggml.token_type")
        .and_then(Value::as_array)
        .map(|a| a.iter().map(|v| v.as_f64().unwrap_or(1.0) as i64).collect())
        .unwrap_or_else(|| vec![1; tokens.len()]);
    let mut vocab = serde_json::Map::new();
    for (i, t) in tokens.iter().enumerate() {
        vocab.insert(t.to_string(), json!(i));
    }
    // Control (3) and user-defined (4) tokens are matched before BPE, as llama.cpp does.
    let mut added = Vec::new();
    let mut added_decoder = serde_json::Map::new();
    for (i, t) in tokens.iter().enumerate() {
        let ty = types.get(i).copied().unwrap_or(1);
        if ty == 3 || ty == 4 {
            let entry = json!({"id": i, "content": t, "single_word": false, "lstrip": false, "rstrip": false,
                               "normalized": false, "special": ty == 3});
            added_decoder.insert(i.to_string(), entry.clone());
            added.push(entry);
        }
    }
    let tok_str = |key: &str| {
        g.get(key)
            .and_then(Value::as_u64)
            .and_then(|i| tokens.get(i as usize))
            .map(|s| s.to_string())
    };
    let tokenizer = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": pre_tokenizer(pre)?,
        "post_processor": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": false, "use_regex": true},
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {"type": "BPE", "dropout": null, "unk_token": tok_str("tokenizer.ggml.unknown_token_id"),
                  "continuing_subword_prefix": null, "end_of_word_suffix": null, "fuse_unk": false,
                  "byte_fallback": false, "ignore_merges": false, "vocab": vocab, "merges": merges},
    });
    write_json(&out.join("tokenizer.json"), &tokenizer)?;

    let add_bos = g
        .get("tokenizer.ggml.add_bos_token")
        .and_then(Value::as_bool)
        .unwrap_or(false);
    let add_eos = g
        .get("tokenizer.ggml.add_eos_token")
        .and_then(Value::as_bool)
        .unwrap_or(false);
    let template = g.get("tokenizer.chat_template").and_then(Value::as_str);
    let max_len = g.get("llama.context_length").and_then(Value::as_u64);
    write_json(
        &out.join("tokenizer_config.json"),
        &json!({
            "add_bos_token": add_bos,
            "add_eos_token": add_eos,
            "added_tokens_decoder": added_decoder,
            "bos_token": tok_str("tokenizer.ggml.bos_token_id"),
            "eos_token": tok_str("tokenizer.ggml.eos_token_id"),
            "unk_token": tok_str("tokenizer.ggml.unknown_token_id"),
            "pad_token": tok_str("tokenizer.ggml.padding_token_id"),
            "chat_template": template,
            "clean_up_tokenization_spaces": false,
            "model_max_length": max_len,
            "tokenizer_class": "GPT2Tokenizer",
        }),
    )?;
    write_json(
        &out.join("generation_config.json"),
        &json!({
            "bos_token_id": g.get("tokenizer.ggml.bos_token_id").and_then(Value::as_u64),
            "eos_token_id": g.get("tokenizer.ggml.eos_token_id").and_then(Value::as_u64),
            "pad_token_id": g.get("tokenizer.ggml.padding_token_id").and_then(Value::as_u64),
        }),
    )?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_map_to_hf() {
        assert_eq!(
            hf_name("blk.12.attn_q.weight").unwrap(),
            "model.layers.12.self_attn.q_proj.weight"
        );
        assert_eq!(
            hf_name("blk.0.ffn_norm.weight").unwrap(),
            "model.layers.0.post_attention_layernorm.weight"
        );
        assert_eq!(
            hf_name("token_embd.weight").unwrap(),
            "model.embed_tokens.weight"
        );
        assert!(hf_name("blk.x.attn_q.weight").is_none());
    }

    #[test]
    fn unpermute_inverts_llama_cpp_permute() {
        // llama.cpp: reshape(n_head, 2, hd/2, cols).swapaxes(1, 2): HF row h·d + j·d/2 + i → h·d + 2i + j.
        let (n_head, hd, cols) = (3, 8, 2);
        let rows = n_head * hd;
        let hf: Vec<f32> = (0..rows * cols).map(|v| v as f32).collect();
        let mut gg = vec![0f32; rows * cols];
        for h in 0..n_head {
            for j in 0..2 {
                for i in 0..hd / 2 {
                    let (src, dst) = (h * hd + j * hd / 2 + i, h * hd + 2 * i + j);
                    gg[dst * cols..(dst + 1) * cols]
                        .copy_from_slice(&hf[src * cols..(src + 1) * cols]);
                }
            }
        }
        assert_eq!(unpermute_rows(&gg, rows, cols, n_head), hf);
    }
}
