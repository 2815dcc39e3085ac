//! The engine on the default model: continuous batching, cancellation, chunked prefill,
//! preemption and prefix caching all give exactly the tokens a request gets alone.

use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use thaw_runtime::convert::OutDtype;
use thaw_runtime::engine::{Engine, EngineConfig, Event, Request};
use thaw_runtime::fetch::default_model;
use thaw_runtime::{generate, FinishReason, GenerateParams, Llama, SamplingParams, TextTokenizer};

fn setup() -> &'static (Arc<Llama>, TextTokenizer) {
    static S: OnceLock<(Arc<Llama>, TextTokenizer)> = OnceLock::new();
    S.get_or_init(|| {
        let dir = default_model(OutDtype::Bf16).unwrap();
        (
            Arc::new(Llama::load(&dir).unwrap()),
            TextTokenizer::load(&dir).unwrap(),
        )
    })
}

fn eos(m: &Llama, tok: &TextTokenizer) -> Vec<u32> {
    let mut e = m.cfg.eos_ids();
    e.extend(tok.eos_id);
    e
}

fn request(prompt: Vec<u32>, max_tokens: usize, stop_ids: Vec<u32>) -> Request {
    Request {
        prompt,
        max_tokens,
        sampling: SamplingParams::default(),
        stop_ids,
        ignore_eos: false,
        logprobs: None,
        min_tokens: 0,
        prompt_logprobs: None,
        constraint: None,
    }
}

/// A user message through the chat template, ready for the assistant's answer.
fn chat_prompt(content: &str) -> Vec<u32> {
    let (_, tok) = setup();
    let msg = thaw_runtime::ChatMessage {
        role: "user".into(),
        content: content.into(),
    };
    let text = thaw_runtime::render_chat(tok, &[msg], true).unwrap();
    tok.encode(&text, true).unwrap()
}

/// The reference: the single-sequence generation loop, no engine.
fn alone(prompt: &[u32], max_tokens: usize) -> Vec<u32> {
    let (m, tok) = setup();
    let p = GenerateParams {
        max_tokens,
        sampling: SamplingParams::default(),
        stop: vec![],
        ignore_eos: false,
    };
    generate(&**m, tok, prompt, &p, |_| {}).unwrap().output_ids
}

fn prompts(n: usize) -> Vec<Vec<u32>> {
    let (_, tok) = setup();
    let subjects = [
        "the sea",
        "a lighthouse",
        "mountains",
        "a small village",
        "the moon",
        "rivers",
        "autumn",
        "a library",
    ];
    (0..n)
        .map(|i| {
            tok.encode(
                &format!(
                    "Write {} sentences about {}:",
                    1 + i % 3,
                    subjects[i % subjects.len()]
                ),
                false,
            )
            .unwrap()
        })
        .collect()
}

fn cfg(m: &Llama, blocks: usize, batch_tokens: usize) -> EngineConfig {
    EngineConfig {
        num_blocks: blocks,
        max_batch_tokens: batch_tokens,
        ..EngineConfig::with_kv_bytes(m, 1 << 26)
    }
}

fn wait_idle(e: &Engine) {
    let t = Instant::now();
    while e.stats().blocks_used != 0 || e.stats().running != 0 {
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "engine did not go idle: {:?}",
            e.stats()
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn sixteen_concurrent_requests_match_alone() {
    let (m, tok) = setup();
    let ps = prompts(16);
    let want: Vec<Vec<u32>> = ps.iter().map(|p| alone(p, 12)).collect();
    let e = Engine::start(m.clone(), cfg(m, 256, 512)).unwrap();
    let streams: Vec<_> = ps
        .iter()
        .map(|p| e.submit(request(p.clone(), 12, eos(m, tok))))
        .collect();
    for (i, s) in streams.into_iter().enumerate() {
        let (ids, fin) = s.collect();
        assert_eq!(ids, want[i], "request {i}");
        assert!(
            matches!(fin, Event::Finished { completion_tokens, .. } if completion_tokens == ids.len()),
            "{fin:?}"
        );
    }
    wait_idle(&e);
    assert!(
        e.stats().steps < 16 * 13,
        "requests were not batched: {} steps",
        e.stats().steps
    );
}

#[test]
fn cancelled_request_frees_its_blocks() {
    let (m, _) = setup();
    let e = Engine::start(m.clone(), cfg(m, 64, 512)).unwrap();
    let mut r = request(prompts(1).remove(0), 400, vec![]);
    r.ignore_eos = true;
    let mut s = e.submit(r);
    for _ in 0..3 {
        assert!(matches!(s.recv(), Some(Event::Token { .. })));
    }
    assert!(e.stats().blocks_used > 0);
    drop(s);
    wait_idle(&e);
    assert_eq!(e.stats().blocks_used, 0);
}

#[test]
fn long_prompt_is_prefilled_in_chunks() {
    let (m, tok) = setup();
    let text = "The lighthouse keeper climbed the spiral stairs each evening, counting the steps. "
        .repeat(6);
    let p = tok.encode(&text, false).unwrap();
    assert!(p.len() > 64);
    let want = alone(&p, 8);
    let e = Engine::start(m.clone(), cfg(m, 64, 24)).unwrap();
    let (ids, _) = e.submit(request(p.clone(), 8, eos(m, tok))).collect();
    assert_eq!(ids, want);
    assert!(
        e.stats().steps as usize >= p.len() / 24,
        "prefill was not chunked"
    );
}

#[test]
fn too_small_kv_cache_preempts_and_still_matches() {
    let (m, tok) = setup();
    let ps = prompts(6);
    let want: Vec<Vec<u32>> = ps.iter().map(|p| alone(p, 24)).collect();
    // 10 blocks × 16 tokens: not enough for six ~40-token sequences at once.
    let e = Engine::start(m.clone(), cfg(m, 10, 512)).unwrap();
    let streams: Vec<_> = ps
        .iter()
        .map(|p| e.submit(request(p.clone(), 24, eos(m, tok))))
        .collect();
    for (i, s) in streams.into_iter().enumerate() {
        assert_eq!(s.collect().0, want[i], "request {i}");
    }
    wait_idle(&e);
    assert!(e.stats().preemptions > 0, "{:?}", e.stats());
}

#[test]
fn repeated_prefix_is_served_from_cache() {
    let (m, tok) = setup();
    let prefix = "You are a careful assistant. Answer briefly and precisely. ".repeat(8);
    let a = tok
        .encode(
            &format!("{prefix}Question: what is the capital of France?"),
            false,
        )
        .unwrap();
    let b = tok
        .encode(&format!("{prefix}Question: what colour is the sky?"), false)
        .unwrap();
    let want_b = alone(&b, 10);
    let e = Engine::start(m.clone(), cfg(m, 128, 512)).unwrap();
    e.submit(request(a, 4, eos(m, tok))).collect();
    let (ids, fin) = e.submit(request(b.clone(), 10, eos(m, tok))).collect();
    assert_eq!(ids, want_b);
    let Event::Finished {
        cached_tokens,
        reason,
        ..
    } = fin
    else {
        panic!("{fin:?}")
    };
    assert!(
        cached_tokens >= 64,
        "only {cached_tokens} tokens came from the cache"
    );
    assert!(matches!(reason, FinishReason::Length | FinishReason::Stop));
    assert!(e.stats().prefix_hits >= 1);
}

#[test]
fn bad_requests_get_errors_not_panics() {
    let (m, _) = setup();
    let e = Engine::start(m.clone(), cfg(m, 8, 512)).unwrap();
    for r in [
        request(vec![], 4, vec![]),
        request(vec![999_999], 4, vec![]),
        request(vec![1; 10], 1_000, vec![]),
        request(vec![1; 10], usize::MAX, vec![]),
    ] {
        let (ids, fin) = e.submit(r).collect();
        assert!(ids.is_empty() && matches!(fin, Event::Error(_)), "{fin:?}");
    }
    assert!(e.is_alive());
    let (ids, _) = e.submit(request(vec![1; 4], 2, vec![])).collect();
    assert_eq!(ids.len(), 2);
}

/// Log probabilities through the engine are the log-softmax of the model's own logits at each
/// position (computed here with the plain single-sequence forward pass), top lists sorted, and
/// asking for them changes no token.
#[test]
fn logprobs_are_the_models_log_softmax() {
    use thaw_runtime::KvCache;
    let (m, tok) = setup();
    let prompt = prompts(3).remove(2);
    let want = alone(&prompt, 8);
    let e = Engine::start(m.clone(), cfg(m, 64, 512)).unwrap();
    let mut r = request(prompt.clone(), 8, eos(m, tok));
    r.logprobs = Some(4);
    // A second request in the same batches, without log probabilities, sampled.
    let mut other = request(prompts(2).remove(1), 8, vec![]);
    other.sampling.temperature = 0.8;
    other.sampling.seed = Some(1);
    let (mut s, mut s2) = (e.submit(r), e.submit(other));
    let mut got = vec![];
    let mut lps = vec![];
    while let Some(ev) = s.recv() {
        match ev {
            Event::Token { id, logprobs } => {
                got.push(id);
                lps.push(*logprobs.expect("asked for"));
            }
            Event::Finished { .. } => break,
            e => panic!("{e:?}"),
        }
    }
    assert_eq!(got, want);
    while let Some(ev) = s2.recv() {
        match ev {
            Event::Token { logprobs, .. } => assert!(logprobs.is_none()),
            _ => break,
        }
    }
    // The reference: logits of each position from the single-sequence pass.
    let mut cache = KvCache::new(m);
    let mut logits = m.forward(&prompt, &mut cache, false).unwrap();
    for (i, (&id, lp)) in got.iter().zip(&lps).enumerate() {
        let max = logits.iter().cloned().fold(f32::NEG_INFINITY, f32::max) as f64;
        let lse = max
            + logits
                .iter()
                .map(|&v| (v as f64 - max).exp())
                .sum::<f64>()
                .ln();
        let want_lp = (logits[id as usize] as f64 - lse) as f32;
        assert!(
            (lp.logprob - want_lp).abs() < 1e-4,
            "token {i}: {lp:?} vs {want_lp}"
        );
        assert_eq!(lp.top.len(), 4);
        // Greedy: the chosen token is the likeliest.
        assert_eq!(lp.top[0], (id, lp.logprob), "token {i}");
        assert!(lp.top.windows(2).all(|w| w[0].1 >= w[1].1), "{lp:?}");
        for &(t, l) in &lp.top {
            assert!((l - (logits[t as usize] as f64 - lse) as f32).abs() < 1e-4);
        }
        logits = m.forward(&[id], &mut cache, false).unwrap();
    }
    wait_idle(&e);
}

/// `logit_bias` -100 on the greedy continuation's first token makes the engine pick another,
/// and the request still finishes and frees its blocks.
#[test]
fn logit_bias_bans_a_token() {
    let (m, tok) = setup();
    let prompt = prompts(1).remove(0);
    let want = alone(&prompt, 4);
    let e = Engine::start(m.clone(), cfg(m, 64, 512)).unwrap();
    let mut r = request(prompt, 4, eos(m, tok));
    r.sampling.logit_bias = vec![(want[0], -100.0)];
    let (ids, fin) = e.submit(r).collect();
    assert!(matches!(fin, Event::Finished { .. }), "{fin:?}");
    assert!(
        !ids.is_empty() && !ids.contains(&want[0]),
        "{ids:?} vs {want:?}"
    );
    wait_idle(&e);
}

/// `min_tokens` bans the stop ids until that many tokens are out: a chat answer that ends
/// after a few tokens goes on (the same tokens first), then may stop again.
#[test]
fn min_tokens_holds_off_the_stop_ids() {
    let (m, tok) = setup();
    let prompt = chat_prompt("What is the capital of France?");
    let e = Engine::start(m.clone(), cfg(m, 64, 512)).unwrap();
    let (short, fin) = e.submit(request(prompt.clone(), 64, eos(m, tok))).collect();
    assert!(
        matches!(
            fin,
            Event::Finished {
                reason: FinishReason::Stop,
                ..
            }
        ),
        "{fin:?}"
    );
    assert!(short.len() < 20, "{short:?}");
    let mut r = request(prompt, 64, eos(m, tok));
    r.min_tokens = short.len() + 6;
    let (long, _) = e.submit(r).collect();
    assert!(long.len() >= short.len() + 6, "{long:?} vs {short:?}");
    assert_eq!(&long[..short.len()], &short[..]);
    let stops = eos(m, tok);
    assert!(long.iter().all(|t| !stops.contains(t)));
    wait_idle(&e);
}

/// Prompt log probabilities: one per prompt token after the first, each the log-softmax of the
/// single-sequence pass's logits at the position before — through chunked prefill (4-token
/// steps), for a prompt the prefix cache holds (it is bypassed: cached positions have no
/// logits), and with `max_tokens` 0 (the prompt scored, nothing generated).
#[test]
fn prompt_logprobs_score_every_prompt_token() {
    use thaw_runtime::KvCache;
    let (m, tok) = setup();
    let prompt: Vec<u32> = prompts(8).concat(); // several full blocks
    assert!(prompt.len() > 40);
    let mut cache = KvCache::new(m);
    let all = m.forward(&prompt, &mut cache, true).unwrap();
    let vocab = m.cfg.vocab_size;
    let e = Engine::start(m.clone(), cfg(m, 64, 4)).unwrap();
    // Twice: the second time the prompt's full blocks are in the prefix cache.
    for (round, max_tokens) in [(0, 3), (1, 0)] {
        let mut r = request(prompt.clone(), max_tokens, eos(m, tok));
        r.prompt_logprobs = Some(2);
        r.ignore_eos = true;
        let mut s = e.submit(r);
        let (mut scored, mut generated) = (vec![], 0);
        let fin = loop {
            match s.recv().unwrap() {
                Event::PromptLogprobs(v) => scored.extend(v),
                Event::Token { .. } => generated += 1,
                end => break end,
            }
        };
        assert!(
            matches!(fin, Event::Finished { completion_tokens, .. } if completion_tokens == max_tokens),
            "{fin:?}"
        );
        assert_eq!(generated, max_tokens);
        assert_eq!(scored.len(), prompt.len() - 1, "round {round}");
        for (q, (id, lp)) in scored.iter().enumerate() {
            let q = q + 1;
            assert_eq!(*id, prompt[q]);
            let row = &all[(q - 1) * vocab..q * vocab];
            let max = row.iter().cloned().fold(f32::NEG_INFINITY, f32::max) as f64;
            let lse = max
                + row
                    .iter()
                    .map(|&v| (v as f64 - max).exp())
                    .sum::<f64>()
                    .ln();
            let want = (row[*id as usize] as f64 - lse) as f32;
            assert!(
                (lp.logprob - want).abs() < 1e-3,
                "position {q}: {} vs {want}",
                lp.logprob
            );
            assert_eq!(lp.top.len(), 2);
        }
        wait_idle(&e);
        // The first round left the prompt's full blocks in the cache; the second did not use them.
        assert_eq!(e.stats().cached_tokens, 0, "round {round}");
    }
    // Without prompt log probabilities the same prompt is served from the cache.
    let (_, fin) = e.submit(request(prompt.clone(), 1, vec![])).collect();
    assert!(
        matches!(fin, Event::Finished { cached_tokens, .. } if cached_tokens >= 32),
        "{fin:?}"
    );
}

/// JSON mode through the engine: greedy and sampled outputs are JSON objects that parse, and
/// each request ends (reason stop) the moment its object closes.
#[test]
fn json_mode_outputs_parse_as_objects() {
    use thaw_runtime::json_mode::{JsonObject, JsonState, Vocab};
    let (m, tok) = setup();
    let vocab = Arc::new(Vocab::new(
        (0..m.cfg.vocab_size as u32)
            .map(|id| (!tok.is_added(id)).then(|| tok.token_bytes(id)))
            .collect(),
    ));
    let prompt = chat_prompt("Describe a city as JSON with its name and population.");
    let e = Engine::start(m.clone(), cfg(m, 128, 512)).unwrap();
    let streams: Vec<_> = (0..4)
        .map(|i| {
            let mut r = request(prompt.clone(), 200, eos(m, tok));
            r.constraint = Some(Box::new(JsonObject::new(vocab.clone())));
            if i > 0 {
                r.sampling.temperature = 0.7;
                r.sampling.seed = Some(i);
            }
            e.submit(r)
        })
        .collect();
    let mut closed = 0;
    for (i, s) in streams.into_iter().enumerate() {
        let (ids, fin) = s.collect();
        let out = tok.decode(&ids, false).unwrap();
        match fin {
            Event::Finished {
                reason: FinishReason::Stop,
                ..
            } => {
                let v: serde_json::Value = serde_json::from_str(&out)
                    .unwrap_or_else(|err| panic!("request {i}: {err}: {out:?}"));
                assert!(v.is_object(), "{out}");
                closed += 1;
            }
            // A sampled ramble may run out of tokens first: still a JSON object so far.
            Event::Finished {
                reason: FinishReason::Length,
                ..
            } if i > 0 => {
                let mut st = JsonState::default();
                assert!(st.feed_all(out.as_bytes()) && !st.done(), "{out:?}");
            }
            other => panic!("request {i}: {other:?} after {out:?}"),
        }
    }
    assert!(closed >= 2, "only {closed} of 4 objects closed");
    wait_idle(&e);
}

/// Requests that arrive together behind one prompt (n choices, a shared system prompt): the
/// first computes the shared full blocks, the others wait for them to reach the prefix cache
/// instead of computing them too — and every request still gets the tokens it gets alone.
#[test]
fn siblings_wait_for_a_shared_prefix_instead_of_recomputing_it() {
    let (m, tok) = setup();
    let shared: Vec<u32> = prompts(8).concat(); // several full blocks
    let bs = EngineConfig::with_kv_bytes(&**m, 1 << 26).block_size;
    let full = (shared.len() / bs) * bs;
    let ps: Vec<Vec<u32>> = (0..4)
        .map(|i| {
            let mut p = shared[..full].to_vec();
            p.extend(&prompts(4)[i]); // each its own question after the shared part
            p
        })
        .collect();
    let want: Vec<Vec<u32>> = ps.iter().map(|p| alone(p, 6)).collect();
    let e = Engine::start(m.clone(), cfg(m, 256, 512)).unwrap();
    let streams: Vec<_> = ps
        .iter()
        .map(|p| e.submit(request(p.clone(), 6, eos(m, tok))))
        .collect();
    let mut cached = vec![];
    for (i, s) in streams.into_iter().enumerate() {
        let (ids, fin) = s.collect();
        assert_eq!(ids, want[i], "request {i}");
        match fin {
            Event::Finished { cached_tokens, .. } => cached.push(cached_tokens),
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(cached[0], 0);
    assert!(
        cached[1..].iter().all(|&c| c == full),
        "{cached:?} (shared {full})"
    );
    wait_idle(&e);
}
