//! `bench-coldstart synth`: a random-weight checkpoint with a real model's shapes and Hugging
//! Face's shard layout (index.json), so loading can be measured at realistic sizes without
//! downloading anything. Tensors are streamed to disk in forward order; nothing is held whole.

use std::io::{BufWriter, Write};
use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use serde_json::json;

#[derive(clap::Args)]
pub struct SynthArgs {
    /// llama-3-8b, llama-3-1b or smollm2-135m.
    #[arg(long)]
    shape: String,
    /// bf16, f16, f32, or f32-from-bf16 (the bf16 checkpoint of the same seed, widened
    /// exactly: a reference for its precision; shard sizes must give the same shards).
    #[arg(long, default_value = "bf16")]
    dtype: String,
    #[arg(long)]
    out: PathBuf,
    /// Maximum shard size in bytes (HF ships ~5 GB shards).
    #[arg(long, default_value_t = 5_000_000_000)]
    shard_size: u64,
    /// Also write thaw-manifest.json (reads everything back once).
    #[arg(long)]
    manifest: bool,
    #[arg(long, default_value_t = 1)]
    seed: u64,
}

struct Shape {
    hidden: usize,
    inter: usize,
    layers: usize,
    heads: usize,
    kv: usize,
    vocab: usize,
    tied: bool,
    theta: f64,
    ctx: usize,
}

fn shape(name: &str) -> Result<Shape> {
    Ok(match name {
        "llama-3-8b" => Shape {
            hidden: 4096,
            inter: 14336,
            layers: 32,
            heads: 32,
            kv: 8,
            vocab: 128256,
            tied: false,
            theta: 500000.0,
            ctx: 8192,
        },
        "llama-3-1b" => Shape {
            hidden: 2048,
            inter: 8192,
            layers: 16,
            heads: 32,
            kv: 8,
            vocab: 128256,
            tied: true,
            theta: 500000.0,
            ctx: 8192,
        },
        "smollm2-135m" => Shape {
            hidden: 576,
            inter: 1536,
            layers: 30,
            heads: 9,
            kv: 3,
            vocab: 49152,
            tied: true,
            theta: 100000.0,
            ctx: 8192,
        },
        s => bail!("unknown shape '{s}' (llama-3-8b, llama-3-1b, smollm2-135m)"),
    })
}

/// Tensors in forward order: (name, shape, is_norm).
fn tensors(s: &Shape) -> Vec<(String, Vec<usize>, bool)> {
    let hd = s.hidden / s.heads;
    let mut v = vec![(
        "model.embed_tokens.weight".to_string(),
        vec![s.vocab, s.hidden],
        false,
    )];
    for i in 0..s.layers {
        let p = |n: &str| format!("model.layers.{i}.{n}");
        v.push((p("input_layernorm.weight"), vec![s.hidden], true));
        v.push((
            p("self_attn.q_proj.weight"),
            vec![s.heads * hd, s.hidden],
            false,
        ));
        v.push((
            p("self_attn.k_proj.weight"),
            vec![s.kv * hd, s.hidden],
            false,
        ));
        v.push((
            p("self_attn.v_proj.weight"),
            vec![s.kv * hd, s.hidden],
            false,
        ));
        v.push((
            p("self_attn.o_proj.weight"),
            vec![s.hidden, s.heads * hd],
            false,
        ));
        v.push((p("post_attention_layernorm.weight"), vec![s.hidden], true));
        v.push((p("mlp.gate_proj.weight"), vec![s.inter, s.hidden], false));
        v.push((p("mlp.up_proj.weight"), vec![s.inter, s.hidden], false));
        v.push((p("mlp.down_proj.weight"), vec![s.hidden, s.inter], false));
    }
    v.push(("model.norm.weight".to_string(), vec![s.hidden], true));
    if !s.tied {
        v.push(("lm_head.weight".to_string(), vec![s.vocab, s.hidden], false));
    }
    v
}

/// A bf16 weight's bits from 16 random bits: norm weights near 1, others small with either sign.
fn bf16_bits(m: u16, norm: bool) -> u16 {
    if norm {
        0x3f80 | (m & 0x000f)
    } else {
        (m & 0x8000) | 0x3c00 | (m & 0x01ff)
    }
}

/// Fills `out` with values of magnitude ~0.02 (norm weights ~1), as little-endian `dtype`.
fn fill(out: &mut [u8], dtype: &str, norm: bool, state: &mut u64) {
    let mut next = || {
        *state ^= *state << 13;
        *state ^= *state >> 7;
        *state ^= *state << 17;
        *state
    };
    match dtype {
        "f32" => {
            for c in out.chunks_exact_mut(4) {
                let r = next();
                let v = if norm {
                    1.0 + ((r >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.1
                } else {
                    ((r >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.04
                };
                c.copy_from_slice(&v.to_le_bytes());
            }
        }
        "f32-from-bf16" => {
            // The bf16 checkpoint's values (same stream, same bit patterns) widened to f32
            // exactly: an f32 reference for a bf16 model's precision.
            for c in out.chunks_exact_mut(16) {
                let r = next();
                for j in 0..4 {
                    let m = ((r >> (16 * j)) & 0xffff) as u16;
                    let v = f32::from_bits((bf16_bits(m, norm) as u32) << 16);
                    c[4 * j..4 * j + 4].copy_from_slice(&v.to_le_bytes());
                }
            }
        }
        _ => {
            // bf16/f16 bit patterns built directly: sign, a small exponent, random mantissa.
            for c in out.chunks_exact_mut(8) {
                let r = next();
                for j in 0..4 {
                    let m = ((r >> (16 * j)) & 0xffff) as u16;
                    let bits: u16 = if dtype == "f16" {
                        if norm {
                            0x3c00 | (m & 0x00ff)
                        } else {
                            (m & 0x8000) | 0x2000 | (m & 0x07ff)
                        }
                    } else {
                        bf16_bits(m, norm)
                    };
                    c[2 * j..2 * j + 2].copy_from_slice(&bits.to_le_bytes());
                }
            }
        }
    }
}

pub fn run(a: SynthArgs) -> Result<()> {
    let s = shape(&a.shape)?;
    let (esz, st_dtype, torch) = match a.dtype.as_str() {
        "bf16" => (2, "BF16", "bfloat16"),
        "f16" => (2, "F16", "float16"),
        "f32" | "f32-from-bf16" => (4, "F32", "float32"),
        d => bail!("unknown dtype '{d}' (bf16, f16, f32, f32-from-bf16)"),
    };
    std::fs::create_dir_all(&a.out).with_context(|| format!("creating {}", a.out.display()))?;
    for e in std::fs::read_dir(&a.out)?.flatten() {
        let n = e.file_name().to_string_lossy().to_string();
        if n.ends_with(".safetensors") || n.ends_with(".index.json") || n == "thaw-manifest.json" {
            std::fs::remove_file(e.path())?;
        }
    }
    let all = tensors(&s);
    // Split into shards by size.
    let mut shards: Vec<Vec<usize>> = vec![vec![]];
    let mut cur = 0u64;
    for (i, (_, sh, _)) in all.iter().enumerate() {
        let b = sh.iter().product::<usize>() as u64 * esz;
        if cur > 0 && cur + b > a.shard_size {
            shards.push(vec![]);
            cur = 0;
        }
        shards.last_mut().unwrap().push(i);
        cur += b;
    }
    let n = shards.len();
    let mut weight_map = serde_json::Map::new();
    let mut total = 0u64;
    let mut jobs = vec![];
    for (si, idx) in shards.iter().enumerate() {
        let file = if n == 1 {
            "model.safetensors".to_string()
        } else {
            format!("model-{:05}-of-{:05}.safetensors", si + 1, n)
        };
        let mut header = serde_json::Map::new();
        header.insert("__metadata__".into(), json!({"format": "pt"}));
        let mut off = 0u64;
        for &i in idx {
            let (name, sh, _) = &all[i];
            let b = sh.iter().product::<usize>() as u64 * esz;
            header.insert(
                name.clone(),
                json!({"dtype": st_dtype, "shape": sh, "data_offsets": [off, off + b]}),
            );
            weight_map.insert(name.clone(), json!(file));
            off += b;
        }
        total += off;
        // Data on a page boundary, as `thaw convert` writes it.
        let h = thaw_loader::safetensors::header_bytes(&serde_json::to_string(&header)?);
        // Each shard its own random stream, so shards are written in parallel (an 8B
        // checkpoint is 16 GB: on a GPU host this is lease time).
        let state = (a.seed.max(1) + si as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        jobs.push((a.out.join(&file), h, idx.clone(), state));
    }
    std::thread::scope(|scope| -> Result<()> {
        let handles: Vec<_> = jobs
            .iter()
            .map(|(path, h, idx, state)| {
                let all = &all;
                let dtype = a.dtype.as_str();
                let mut state = *state;
                scope.spawn(move || -> Result<()> {
                    let file = std::fs::File::create(path)
                        .with_context(|| format!("creating {}", path.display()))?;
                    let mut w = BufWriter::with_capacity(8 << 20, file);
                    w.write_all(h)?;
                    let mut buf = vec![0u8; 8 << 20];
                    for &i in idx {
                        let (_, sh, norm) = &all[i];
                        let mut left = sh.iter().product::<usize>() * esz as usize;
                        while left > 0 {
                            let k = left.min(buf.len());
                            fill(&mut buf[..k], dtype, *norm, &mut state);
                            w.write_all(&buf[..k])?;
                            left -= k;
                        }
                    }
                    w.flush()?;
                    Ok(())
                })
            })
            .collect();
        for h in handles {
            h.join()
                .map_err(|_| anyhow::anyhow!("a shard writer panicked"))??;
        }
        Ok(())
    })?;
    if n > 1 {
        std::fs::write(
            a.out.join("model.safetensors.index.json"),
            serde_json::to_string_pretty(
                &json!({"metadata": {"total_size": total}, "weight_map": weight_map}),
            )?,
        )?;
    }
    let hd = s.hidden / s.heads;
    std::fs::write(
        a.out.join("config.json"),
        serde_json::to_string_pretty(&json!({
            "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": s.hidden,
            "intermediate_size": s.inter, "num_hidden_layers": s.layers, "num_attention_heads": s.heads,
            "num_key_value_heads": s.kv, "head_dim": hd, "vocab_size": s.vocab, "rms_norm_eps": 1e-5,
            "rope_theta": s.theta, "max_position_embeddings": s.ctx, "tie_word_embeddings": s.tied,
            "torch_dtype": torch, "bos_token_id": 1, "eos_token_id": 2,
        }))?,
    )?;
    if a.manifest {
        let ck = thaw_loader::Checkpoint::open(&a.out)?;
        thaw_loader::Manifest::build(&ck, thaw_loader::manifest::DEFAULT_CHUNK)?.write(&a.out)?;
    }
    println!(
        "{} ({} tensors, {:.2} GB in {n} shard(s))",
        a.out.display(),
        all.len(),
        total as f64 / 1e9
    );
    Ok(())
}
