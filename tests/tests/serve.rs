//! `thaw serve` over real HTTP on 127.0.0.1: the OpenAI API (log probabilities, n, JSON mode,
//! echo; also through the official Python client), /invoke, /tokenize, health and readiness,
//! Prometheus metrics checked by promtool, every error status, overload, client disconnects,
//! SIGTERM drain and a thousand malformed bodies.

use std::io::Read;
use std::process::Command;
use std::time::Duration;

use serde_json::{json, Value};
use thaw_tests::{client, golden, model_dir, thaw, Server};

fn post(s: &Server, path: &str, body: &Value) -> (u16, Value) {
    let r = client().post(s.url(path)).json(body).send().expect("POST");
    let status = r.status().as_u16();
    let text = r.text().unwrap_or_default();
    (
        status,
        serde_json::from_str(&text).unwrap_or(Value::String(text)),
    )
}

/// Reads an SSE response to the end: the `data:` payloads in order.
fn sse_events(resp: reqwest::blocking::Response) -> Vec<String> {
    let mut body = String::new();
    let mut r = resp;
    r.read_to_string(&mut body).expect("SSE body");
    body.lines()
        .filter_map(|l| l.strip_prefix("data: ").map(str::to_string))
        .collect()
}

fn stream_text(events: &[String]) -> (String, Option<String>, Option<Value>) {
    let mut text = String::new();
    let (mut finish, mut usage) = (None, None);
    for e in events.iter().filter(|e| *e != "[DONE]") {
        let v: Value = serde_json::from_str(e).expect("chunk JSON");
        if !v["usage"].is_null() {
            usage = Some(v["usage"].clone());
        }
        for c in v["choices"].as_array().unwrap() {
            if let Some(t) = c["delta"]["content"].as_str().or(c["text"].as_str()) {
                text.push_str(t);
            }
            if let Some(f) = c["finish_reason"].as_str() {
                finish = Some(f.to_string());
            }
        }
    }
    (text, finish, usage)
}

#[test]
fn chat_matches_reference_and_stream_equals_nonstream() {
    model_dir("default-f32");
    let s = Server::ready(&["--model", "default-f32"]);
    // Greedy chat through HTTP = llama.cpp's greedy output (f32 weights).
    let g = &golden()["greedy"][0];
    let (st, v) = post(
        &s,
        "/v1/chat/completions",
        &json!({"messages": g["messages"], "max_tokens": 32, "temperature": 0}),
    );
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["choices"][0]["message"]["content"], g["output_text"]);
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    assert_eq!(v["object"], "chat.completion");
    let n_prompt = g["prompt_ids"].as_array().unwrap().len() as u64;
    let n_out = g["output_ids"].as_array().unwrap().len() as u64 - 1; // EOS is not output
    assert_eq!(v["usage"]["prompt_tokens"], n_prompt);
    assert_eq!(v["usage"]["completion_tokens"], n_out);
    assert_eq!(v["usage"]["total_tokens"], n_prompt + n_out);

    // Sampled with a seed: streamed text = non-streamed text, for chat and completions.
    for (path, body) in [
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "Write a short poem about ice."}],
                   "max_tokens": 40, "temperature": 0.9, "top_p": 0.95, "seed": 1234}),
        ),
        (
            "/v1/completions",
            json!({"prompt": "Once upon a time", "max_tokens": 40, "temperature": 0.9,
                   "top_k": 40, "seed": 99}),
        ),
    ] {
        let (st, plain) = post(&s, path, &body);
        assert_eq!(st, 200, "{plain}");
        let mut sb = body.clone();
        sb["stream"] = json!(true);
        sb["stream_options"] = json!({"include_usage": true});
        let resp = client().post(s.url(path)).json(&sb).send().unwrap();
        assert_eq!(resp.status().as_u16(), 200);
        assert!(resp.headers()["content-type"]
            .to_str()
            .unwrap()
            .starts_with("text/event-stream"));
        let events = sse_events(resp);
        assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
        let (text, finish, usage) = stream_text(&events);
        let want = plain["choices"][0]["message"]["content"]
            .as_str()
            .or(plain["choices"][0]["text"].as_str())
            .unwrap();
        assert_eq!(text, want, "{path}");
        assert!(!text.is_empty());
        assert_eq!(
            finish.as_deref(),
            plain["choices"][0]["finish_reason"].as_str()
        );
        // Same counts (the prefix cache may serve more of the prompt the second time).
        let u = usage.unwrap();
        for k in ["prompt_tokens", "completion_tokens", "total_tokens"] {
            assert_eq!(u[k], plain["usage"][k], "{path} {k}");
        }
        // Same seed again: same text.
        let (_, again) = post(&s, path, &body);
        assert_eq!(again["choices"], plain["choices"]);
    }

    // ignore_eos fixes the output length; stop strings cut it.
    let (_, v) = post(
        &s,
        "/v1/completions",
        &json!({"prompt": "The capital of France is", "max_tokens": 17, "temperature": 0,
                "ignore_eos": true}),
    );
    assert_eq!(v["usage"]["completion_tokens"], 17);
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    let full = v["choices"][0]["text"].as_str().unwrap().to_string();
    let cut_at = full.find('.').expect("a period in the output");
    let (_, v) = post(
        &s,
        "/v1/completions",
        &json!({"prompt": "The capital of France is", "max_tokens": 17, "temperature": 0,
                "stop": ["."]}),
    );
    assert_eq!(v["choices"][0]["text"], &full[..cut_at]);
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
}

#[test]
fn invoke_health_ready_models() {
    model_dir("default");
    let s = Server::spawn(&[]);
    let r = client().get(s.url("/health")).send().unwrap();
    assert_eq!(r.status().as_u16(), 200);
    s.wait_ready();
    let ready: Value = client()
        .get(s.url("/ready"))
        .send()
        .unwrap()
        .json()
        .unwrap();
    assert_eq!(ready["state"], "ready");
    let m: Value = client()
        .get(s.url("/v1/models"))
        .send()
        .unwrap()
        .json()
        .unwrap();
    assert_eq!(m["data"][0]["id"], "smollm2-135m-instruct");

    let resp = client()
        .post(s.url("/invoke"))
        .json(
            &json!({"messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 8,
                      "temperature": 0, "ignore_eos": true}),
        )
        .send()
        .unwrap();
    assert_eq!(resp.status().as_u16(), 200);
    assert_eq!(resp.headers()["x-thaw-cold-start"], "false");
    let v: Value = resp.json().unwrap();
    assert!(!v["text"].as_str().unwrap().is_empty(), "{v}");
    assert_eq!(v["usage"]["completion_tokens"], 8);
    assert_eq!(v["cold_start"], false);
    assert!(v["timings"]["load_ms"].is_null());
    let t = &v["timings"];
    let (ttft, total) = (
        t["ttft_ms"].as_f64().unwrap(),
        t["total_ms"].as_f64().unwrap(),
    );
    assert!(ttft > 0.0 && ttft <= total, "{t}");
    assert!(t["queue_ms"].as_f64().unwrap() <= ttft, "{t}");
    // A prompt works too; both or neither is a 400.
    let (st, v) = post(&s, "/invoke", &json!({"prompt": "Hello", "max_tokens": 3}));
    assert_eq!(
        (st, v["usage"]["completion_tokens"].as_u64().unwrap() <= 3),
        (200, true)
    );
    let (st, _) = post(&s, "/invoke", &json!({"max_tokens": 3}));
    assert_eq!(st, 400);
}

#[test]
fn official_openai_python_client() {
    model_dir("default");
    let s = Server::ready(&["--api-key", "sekret"]);
    let home = std::env::var("THAW_HOME")
        .unwrap_or_else(|_| format!("{}/.cache/thaw", std::env::var("HOME").unwrap_or_default()));
    let py = std::env::var("THAW_TEST_PYTHON").unwrap_or(format!("{home}/venv/bin/python"));
    assert!(
        std::path::Path::new(&py).exists(),
        "{py} is missing: scripts/test.sh creates it (python3 -m venv + pip install openai)"
    );
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/openai_client.py");
    let o = Command::new(&py)
        .args([script, &s.base, "smollm2-135m-instruct", "sekret"])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let v: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert!(v["chat"]["text"].as_str().unwrap().contains("Paris"), "{v}");
    assert_eq!(v["chat_stream"]["text"], v["chat"]["text"]);
    assert_eq!(
        v["chat_stream"]["finish_reason"],
        v["chat"]["finish_reason"]
    );
    for k in ["prompt_tokens", "completion_tokens", "total_tokens"] {
        assert_eq!(v["chat_stream"]["usage"][k], v["chat"]["usage"][k], "{k}");
    }
    assert!(v["chat_stream"]["chunks"].as_u64().unwrap() > 1);
    assert_eq!(v["completion"]["usage"]["completion_tokens"], 8);
    // Log probabilities and n through the client's own types.
    let lp = v["chat_logprobs"].as_array().unwrap();
    assert_eq!(lp.len(), 2, "{v}");
    assert_eq!(lp[0], lp[1], "greedy choices are alike");
    let toks: Vec<&str> = lp[0]["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_str().unwrap())
        .collect();
    assert_eq!(toks.concat(), lp[0]["text"].as_str().unwrap());
    assert!(lp[0]["top"]
        .as_array()
        .unwrap()
        .iter()
        .all(|t| t.as_array().unwrap().len() == 2));
    let c = &v["completion_logprobs"];
    assert_eq!(c["tokens"].as_array().unwrap().len(), 4, "{v}");
    // 7042 is " Paris", the greedy first token without the bias.
    assert_ne!(c["tokens"][0], " Paris", "{v}");
    assert!(!c["text"].as_str().unwrap().starts_with(" Paris"), "{v}");
    assert_eq!(v["models"], json!(["smollm2-135m-instruct"]));
    assert_eq!(v["unknown_model"], 404);
}

#[test]
fn metrics_pass_promtool_and_count_requests() {
    model_dir("default");
    let s = Server::ready(&[]);
    let count = |s: &Server| s.metric("thaw_time_to_first_token_seconds_count");
    let before = count(&s);
    for i in 0..3 {
        let (st, _) = post(
            &s,
            "/v1/completions",
            &json!({"prompt": "Hi", "max_tokens": 4, "temperature": 0, "ignore_eos": true}),
        );
        assert_eq!(st, 200);
        assert_eq!(count(&s), before + 1.0 + i as f64);
    }
    assert_eq!(
        s.metric("thaw_request_success_total{finished_reason=\"length\"}"),
        3.0
    );
    assert!(s.metric("thaw_generation_tokens_total") >= 12.0);
    assert_eq!(s.metric("thaw_request_params_max_tokens_sum"), 12.0);
    let (st, _) = post(
        &s,
        "/v1/completions",
        &json!({"prompt": "Hi", "max_tokens": 2, "n": 3}),
    );
    assert_eq!(st, 200);
    assert_eq!(s.metric("thaw_request_params_n_sum"), 6.0);
    assert_eq!(s.metric("thaw_request_params_n_count"), 4.0);
    assert_eq!(s.metric("thaw_state{state=\"ready\"}"), 1.0);
    assert!(s.metric("thaw_model_load_bytes") > 2e8);
    post(&s, "/v1/completions", &json!({"prompt": 5}));
    assert!(s.metric("thaw_request_failure_total{reason=\"invalid_request\"}") >= 1.0);
    let text = client()
        .get(s.url("/metrics"))
        .send()
        .unwrap()
        .text()
        .unwrap();
    for name in [
        "thaw_time_to_first_token_seconds",
        "thaw_inter_token_latency_seconds",
        "thaw_e2e_request_latency_seconds",
        "thaw_request_queue_time_seconds",
        "thaw_num_requests_running",
        "thaw_num_requests_waiting",
        "thaw_kv_cache_usage_perc",
        "thaw_prompt_tokens_total",
        "thaw_prefix_cache_hits_total",
        "thaw_prefix_cache_queries_total",
        "thaw_model_load_seconds",
        "thaw_request_params_n",
        "thaw_request_params_max_tokens",
    ] {
        assert!(text.contains(&format!("# TYPE {name} ")), "{name} missing");
    }
    let mut p = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("promtool (Debian package 'prometheus'; scripts/test.sh installs it)");
    use std::io::Write;
    p.stdin.take().unwrap().write_all(text.as_bytes()).unwrap();
    let o = p.wait_with_output().unwrap();
    assert!(
        o.status.success(),
        "promtool: {}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
}

#[test]
fn errors_have_their_status_and_openai_shape() {
    model_dir("default");
    let s = Server::ready(&["--api-key", "k1", "--max-body-bytes", "2KiB"]);
    let send = |path: &str, body: Vec<u8>, key: Option<&str>| -> (u16, Value) {
        let mut rq = client()
            .post(s.url(path))
            .header("content-type", "application/json")
            .body(body);
        if let Some(k) = key {
            rq = rq.bearer_auth(k);
        }
        let r = rq.send().unwrap();
        let st = r.status().as_u16();
        (st, r.json().unwrap_or(Value::Null))
    };
    let chat = |extra: Value| -> Vec<u8> {
        let mut b = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2});
        for (k, v) in extra.as_object().unwrap() {
            b[k] = v.clone();
        }
        serde_json::to_vec(&b).unwrap()
    };
    // (path, body, content type, expected status, expected error type)
    type Case<'a> = (&'a str, Vec<u8>, Option<&'a str>, u16, &'a str);
    let cases: Vec<Case> = vec![
        (
            "/v1/chat/completions",
            chat(json!({})),
            None,
            401,
            "invalid_api_key",
        ),
        (
            "/v1/chat/completions",
            chat(json!({})),
            Some("k2"),
            401,
            "invalid_api_key",
        ),
        (
            "/invoke",
            chat(json!({})),
            Some("k"),
            401,
            "invalid_api_key",
        ),
        (
            "/v1/chat/completions",
            b"{\"messages\": [".to_vec(),
            Some("k1"),
            400,
            "invalid_request",
        ),
        (
            "/v1/chat/completions",
            chat(json!({"temperature": "hot"})),
            Some("k1"),
            400,
            "invalid_request",
        ),
        (
            "/v1/chat/completions",
            chat(json!({"temperature": -1})),
            Some("k1"),
            400,
            "invalid_request",
        ),
        (
            "/v1/chat/completions",
            chat(json!({"n": 17})),
            Some("k1"),
            400,
            "invalid_request",
        ),
        (
            "/v1/chat/completions",
            chat(json!({"top_logprobs": 2})),
            Some("k1"),
            400,
            "invalid_request",
        ),
        (
            "/v1/chat/completions",
            chat(json!({"logprobs": true, "top_logprobs": 21})),
            Some("k1"),
            400,
            "invalid_request",
        ),
        (
            "/v1/chat/completions",
            chat(json!({"logit_bias": {"49152": 5}})),
            Some("k1"),
            400,
            "invalid_request",
        ),
        (
            "/v1/chat/completions",
            chat(json!({"min_p": 1.5})),
            Some("k1"),
            400,
            "invalid_request",
        ),
        (
            "/v1/chat/completions",
            chat(json!({"repetition_penalty": 0})),
            Some("k1"),
            400,
            "invalid_request",
        ),
        (
            "/v1/chat/completions",
            chat(json!({"stop_token_ids": [49152]})),
            Some("k1"),
            400,
            "invalid_request",
        ),
        (
            "/v1/chat/completions",
            chat(json!({"min_tokens": 3})),
            Some("k1"),
            400,
            "invalid_request",
        ),
        (
            "/v1/chat/completions",
            chat(json!({"echo": true})),
            Some("k1"),
            400,
            "invalid_request",
        ),
        (
            "/v1/chat/completions",
            chat(json!({"response_format": {"type": "json_schema", "json_schema": {}}})),
            Some("k1"),
            400,
            "invalid_request",
        ),
        (
            "/invoke",
            chat(json!({"logprobs": true})),
            Some("k1"),
            400,
            "invalid_request",
        ),
        (
            "/v1/chat/completions",
            chat(json!({"max_tokens": 0})),
            Some("k1"),
            400,
            "invalid_request",
        ),
        (
            "/v1/chat/completions",
            chat(json!({"model": "gpt-4"})),
            Some("k1"),
            404,
            "model_not_found",
        ),
        (
            "/v1/chat/completions",
            vec![b' '; 4096],
            Some("k1"),
            413,
            "body_too_large",
        ),
        (
            "/v1/chat/completions",
            chat(json!({"max_tokens": 100000})),
            Some("k1"),
            422,
            "context_length_exceeded",
        ),
        (
            "/v1/completions",
            serde_json::to_vec(&json!({"prompt": vec![1u32; 200], "max_tokens": 8190})).unwrap(),
            Some("k1"),
            422,
            "context_length_exceeded",
        ),
        ("/v1/nope", chat(json!({})), Some("k1"), 404, "not_found"),
    ];
    for (path, body, key, status, code) in cases {
        let (st, v) = send(path, body, key);
        assert_eq!(st, status, "{path} {v}");
        assert_eq!(v["error"]["code"], code, "{path} {v}");
        assert!(v["error"]["message"].as_str().unwrap().len() > 5, "{v}");
        assert!(v["error"]["type"].is_string(), "{v}");
    }
    // /health, /ready and /metrics stay open; the right key works.
    for p in ["/health", "/ready", "/metrics"] {
        assert_eq!(s.status(p), 200, "{p}");
    }
    assert_eq!(
        send("/v1/chat/completions", chat(json!({})), Some("k1")).0,
        200
    );
    let r = client().get(s.url("/v1/models")).send().unwrap();
    assert_eq!(r.status().as_u16(), 401);
}

#[test]
fn overload_gets_429_and_server_stays_healthy() {
    model_dir("default");
    let s = Server::ready(&["--max-waiting", "8", "--max-running", "4"]);
    let url = s.url("/v1/completions");
    let handles: Vec<_> = (0..200)
        .map(|i| {
            let url = url.clone();
            std::thread::spawn(move || {
                let r = client()
                    .post(url)
                    .json(&json!({"prompt": format!("Count to {i}:"), "max_tokens": 8,
                                  "temperature": 0, "ignore_eos": true}))
                    .send()
                    .expect("a response, not a dropped connection");
                let st = r.status().as_u16();
                if st == 429 {
                    assert!(r.headers().contains_key("retry-after"));
                }
                st
            })
        })
        .collect();
    let statuses: Vec<u16> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    let ok = statuses.iter().filter(|&&s| s == 200).count();
    let busy = statuses.iter().filter(|&&s| s == 429).count();
    assert_eq!(ok + busy, 200, "{statuses:?}");
    assert!(ok >= 12 && busy > 0, "ok {ok}, 429 {busy}");
    let (st, _) = post(
        &s,
        "/v1/completions",
        &json!({"prompt": "Hi", "max_tokens": 2}),
    );
    assert_eq!(st, 200);
    assert_eq!(s.status("/health"), 200);
}

/// `/tokenize` counts what a request will be charged (chat template included), `/detokenize`
/// inverts it, bad ids and unknown models are refused.
#[test]
fn tokenize_and_detokenize() {
    model_dir("default");
    let s = Server::ready(&[]);
    let msgs = json!([{"role": "user", "content": "What is the capital of France?"}]);
    let (st, t) = post(&s, "/tokenize", &json!({"messages": msgs}));
    assert_eq!(st, 200, "{t}");
    let (_, v) = post(
        &s,
        "/v1/chat/completions",
        &json!({"messages": msgs, "max_tokens": 1}),
    );
    assert_eq!(t["count"], v["usage"]["prompt_tokens"], "{t} {v}");
    assert_eq!(
        t["tokens"].as_array().unwrap().len() as u64,
        t["count"].as_u64().unwrap()
    );
    assert!(t["max_model_len"].as_u64().unwrap() > 1000);
    let text = "Ünïcode, <|im_start|> and  spaces";
    let (_, t) = post(&s, "/tokenize", &json!({"prompt": text}));
    let (st, d) = post(&s, "/detokenize", &json!({"tokens": t["tokens"]}));
    assert_eq!(st, 200, "{d}");
    assert_eq!(d["prompt"], text);
    for (path, body, status) in [
        ("/tokenize", json!({}), 400),
        ("/tokenize", json!({"prompt": "x", "messages": msgs}), 400),
        ("/tokenize", json!({"prompt": "x", "model": "nope"}), 404),
        ("/detokenize", json!({"tokens": [49152]}), 400),
        ("/detokenize", json!({"tokens": "abc"}), 400),
    ] {
        let (st, v) = post(&s, path, &body);
        assert_eq!(st, status, "{path} {body} {v}");
        assert!(v["error"]["message"].is_string(), "{v}");
    }
}

/// Log probabilities in both APIs' forms, streamed and not; `n` choices; `logit_bias`.
#[test]
fn logprobs_choices_and_logit_bias() {
    model_dir("default");
    let s = Server::ready(&[]);
    let msgs = json!([{"role": "user", "content": "Write a haiku about ice."}]);
    // Chat, greedy, 3 alternatives: one entry per token, the chosen one first among them, and
    // the tokens' bytes are the text.
    let body = json!({"messages": msgs, "max_tokens": 12, "temperature": 0, "ignore_eos": true,
                      "logprobs": true, "top_logprobs": 3});
    let (st, v) = post(&s, "/v1/chat/completions", &body);
    assert_eq!(st, 200, "{v}");
    let content = v["choices"][0]["logprobs"]["content"]
        .as_array()
        .unwrap()
        .clone();
    assert_eq!(content.len(), 12, "{v}");
    let mut bytes = vec![];
    for e in &content {
        let lp = e["logprob"].as_f64().unwrap();
        assert!((-30.0..=0.0).contains(&lp), "{e}");
        let top = e["top_logprobs"].as_array().unwrap();
        assert_eq!(top.len(), 3, "{e}");
        assert_eq!(
            top[0]["token"], e["token"],
            "greedy picks the likeliest: {e}"
        );
        assert!(top
            .windows(2)
            .all(|w| w[0]["logprob"].as_f64() >= w[1]["logprob"].as_f64()));
        bytes.extend(
            e["bytes"]
                .as_array()
                .unwrap()
                .iter()
                .map(|b| b.as_u64().unwrap() as u8),
        );
    }
    assert_eq!(
        String::from_utf8(bytes).unwrap(),
        v["choices"][0]["message"]["content"].as_str().unwrap()
    );
    // Streamed: the same entries, spread over the chunks.
    let mut sb = body.clone();
    sb["stream"] = json!(true);
    let r = client()
        .post(s.url("/v1/chat/completions"))
        .json(&sb)
        .send()
        .unwrap();
    let mut streamed = vec![];
    for e in sse_events(r).iter().filter(|e| *e != "[DONE]") {
        let c: Value = serde_json::from_str(e).unwrap();
        if let Some(l) = c["choices"][0]["logprobs"]["content"].as_array() {
            streamed.extend(l.iter().cloned());
        }
    }
    assert_eq!(streamed, content);
    // Without asking: null.
    let (_, v) = post(
        &s,
        "/v1/chat/completions",
        &json!({"messages": msgs, "max_tokens": 2}),
    );
    assert!(v["choices"][0]["logprobs"].is_null(), "{v}");

    // Completions: logprobs N, parallel lists, offsets into the text.
    let body = json!({"prompt": "The capital of France is", "max_tokens": 6, "temperature": 0,
                      "ignore_eos": true, "logprobs": 2});
    let (st, v) = post(&s, "/v1/completions", &body);
    assert_eq!(st, 200, "{v}");
    let lp = &v["choices"][0]["logprobs"];
    let tokens: Vec<&str> = lp["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_str().unwrap())
        .collect();
    assert_eq!(tokens.concat(), v["choices"][0]["text"].as_str().unwrap());
    assert_eq!(lp["token_logprobs"].as_array().unwrap().len(), 6);
    let mut off = 0;
    for (i, t) in tokens.iter().enumerate() {
        assert_eq!(lp["text_offset"][i], off, "{lp}");
        off += t.chars().count();
        let top = lp["top_logprobs"][i].as_object().unwrap();
        assert!(!top.is_empty() && top.len() <= 2, "{lp}");
        assert_eq!(
            top[*t], lp["token_logprobs"][i],
            "greedy picks the likeliest: {lp}"
        );
    }
    let first = tokens[0].to_string();
    let first_lp = lp["token_logprobs"][0].as_f64().unwrap();

    // echo + logprobs, max_tokens 0 (how evaluation harnesses score a text): the prompt comes
    // back scored, its first token unscored, and a token's score as a prompt token is its
    // score as a generated one.
    let scored = format!("The capital of France is{first}");
    let (st, v) = post(
        &s,
        "/v1/completions",
        &json!({"prompt": scored, "max_tokens": 0,
        "echo": true, "logprobs": 1}),
    );
    assert_eq!(st, 200, "{v}");
    let c = &v["choices"][0];
    assert_eq!(c["text"], scored.as_str(), "{v}");
    let ptoks: Vec<&str> = c["logprobs"]["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_str().unwrap())
        .collect();
    assert_eq!(ptoks.concat(), scored);
    assert!(
        c["logprobs"]["token_logprobs"][0].is_null() && c["logprobs"]["top_logprobs"][0].is_null()
    );
    let last = c["logprobs"]["token_logprobs"][ptoks.len() - 1]
        .as_f64()
        .unwrap();
    assert!((last - first_lp).abs() < 1e-3, "{last} vs {first_lp}");
    assert_eq!(v["usage"]["completion_tokens"], 0);
    // Streamed, echo without logprobs: the prompt is the first chunk's text.
    let r = client()
        .post(s.url("/v1/completions"))
        .json(&json!({"prompt": "The capital of France is",
        "max_tokens": 2, "temperature": 0, "echo": true, "stream": true}))
        .send()
        .unwrap();
    let ev = sse_events(r);
    let c0: Value = serde_json::from_str(&ev[0]).unwrap();
    assert_eq!(c0["choices"][0]["text"], "The capital of France is");
    assert!(stream_text(&ev)
        .0
        .starts_with(&format!("The capital of France is{first}")));

    // logit_bias -100 on the greedy first token: another one comes first.
    let id = {
        let (_, t) = post(
            &s,
            "/v1/completions",
            &json!({"prompt": "The capital of France is",
            "max_tokens": 1, "temperature": 0, "logprobs": 0}),
        );
        assert_eq!(t["choices"][0]["logprobs"]["tokens"][0], first.as_str());
        let out = thaw(&["tokenize", "--model", "default", "--text", &first]);
        let v: Value = serde_json::from_slice(&out.stdout).unwrap();
        v["ids"][0].as_u64().unwrap()
    };
    let mut biased = body.clone();
    biased["logit_bias"] = json!({ id.to_string(): -100 });
    let (st, v) = post(&s, "/v1/completions", &biased);
    assert_eq!(st, 200, "{v}");
    assert_ne!(
        v["choices"][0]["logprobs"]["tokens"][0],
        first.as_str(),
        "{v}"
    );

    // n = 3 sampled choices, seeded: indices 0..3, usage adds the completions up, the same
    // request again gives the same three texts, and the streamed form gives them too.
    let body = json!({"messages": msgs, "max_tokens": 8, "temperature": 1.0, "seed": 11,
                      "ignore_eos": true, "n": 3});
    let (st, v) = post(&s, "/v1/chat/completions", &body);
    assert_eq!(st, 200, "{v}");
    let texts = |v: &Value| -> Vec<String> {
        v["choices"]
            .as_array()
            .unwrap()
            .iter()
            .enumerate()
            .map(|(i, c)| {
                assert_eq!(c["index"], i);
                c["message"]["content"].as_str().unwrap().to_string()
            })
            .collect()
    };
    let t1 = texts(&v);
    assert_eq!(t1.len(), 3);
    assert!(
        t1[0] != t1[1] || t1[1] != t1[2],
        "seeded choices all alike: {t1:?}"
    );
    assert_eq!(v["usage"]["completion_tokens"], 24, "{v}");
    let (_, again) = post(&s, "/v1/chat/completions", &body);
    assert_eq!(texts(&again), t1);
    let mut sb = body.clone();
    sb["stream"] = json!(true);
    sb["stream_options"] = json!({"include_usage": true});
    let r = client()
        .post(s.url("/v1/chat/completions"))
        .json(&sb)
        .send()
        .unwrap();
    let mut parts = vec![String::new(); 3];
    let mut finished = 0;
    let mut usage = Value::Null;
    for e in sse_events(r).iter().filter(|e| *e != "[DONE]") {
        let c: Value = serde_json::from_str(e).unwrap();
        if !c["usage"].is_null() {
            usage = c["usage"].clone();
        }
        for ch in c["choices"].as_array().unwrap() {
            let i = ch["index"].as_u64().unwrap() as usize;
            parts[i].push_str(ch["delta"]["content"].as_str().unwrap_or(""));
            finished += ch["finish_reason"].is_string() as usize;
        }
    }
    assert_eq!(parts, t1);
    assert_eq!(finished, 3);
    assert_eq!(usage["completion_tokens"], 24);

    // vLLM's stop_token_ids end the output even with ignore_eos (the id is not shown), and
    // repetition_penalty / min_p are taken.
    let (st, v) = post(
        &s,
        "/v1/completions",
        &json!({"prompt": "The capital of France is",
        "max_tokens": 8, "temperature": 0, "ignore_eos": true, "stop_token_ids": [id]}),
    );
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["choices"][0]["finish_reason"], "stop", "{v}");
    assert_eq!(v["choices"][0]["text"], "", "{v}");
    let (st, v) = post(
        &s,
        "/v1/completions",
        &json!({"prompt": "The capital of France is",
        "max_tokens": 8, "temperature": 0.8, "seed": 1, "repetition_penalty": 1.3, "min_p": 0.1}),
    );
    assert_eq!(st, 200, "{v}");

    // JSON mode: the answer is a JSON object that parses (without it this model fences its
    // JSON in markdown), streamed too, and the request ends when the object closes.
    let body = json!({"messages": [{"role": "user",
        "content": "Give me a JSON object describing a cat with name and age."}],
        "max_tokens": 300, "temperature": 0, "response_format": {"type": "json_object"}});
    let (st, v) = post(&s, "/v1/chat/completions", &body);
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["choices"][0]["finish_reason"], "stop", "{v}");
    let content = v["choices"][0]["message"]["content"].as_str().unwrap();
    let obj: Value = serde_json::from_str(content).unwrap_or_else(|e| panic!("{e}: {content:?}"));
    assert!(obj.is_object(), "{content}");
    let mut sb = body.clone();
    sb["stream"] = json!(true);
    let r = client()
        .post(s.url("/v1/chat/completions"))
        .json(&sb)
        .send()
        .unwrap();
    assert_eq!(stream_text(&sse_events(r)).0, content);

    // Several prompts in one completions request, n = 2 each: choices prompt by prompt, each
    // the text that prompt gets alone; each prompt's tokens counted once in the usage.
    let ps = ["The capital of France is", "2 + 2 ="];
    let alone: Vec<Value> = ps
        .iter()
        .map(|p| {
            post(
                &s,
                "/v1/completions",
                &json!({"prompt": p, "max_tokens": 3, "temperature": 0,
                "ignore_eos": true}),
            )
            .1
        })
        .collect();
    let (st, v) = post(
        &s,
        "/v1/completions",
        &json!({"prompt": ps, "max_tokens": 3,
        "temperature": 0, "ignore_eos": true, "n": 2}),
    );
    assert_eq!(st, 200, "{v}");
    let choices = v["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 4, "{v}");
    for (i, c) in choices.iter().enumerate() {
        assert_eq!(c["index"], i);
        assert_eq!(c["text"], alone[i / 2]["choices"][0]["text"], "{v}");
    }
    let prompt_tokens: u64 = alone
        .iter()
        .map(|a| a["usage"]["prompt_tokens"].as_u64().unwrap())
        .sum();
    assert_eq!(v["usage"]["prompt_tokens"], prompt_tokens, "{v}");
    assert_eq!(v["usage"]["completion_tokens"], 12, "{v}");
    let (st, _) = post(
        &s,
        "/v1/completions",
        &json!({"prompt": vec!["x"; 40], "n": 2}),
    );
    assert_eq!(st, 400, "80 generations in one request");

    // best_of 4, n 2: the two likeliest (summed log probability) of the four candidates that
    // n = 4 with the same seed gives, likeliest first; all four candidates in the usage.
    let body = json!({"prompt": "Once upon a time", "max_tokens": 6, "temperature": 1.0,
        "seed": 5, "ignore_eos": true, "n": 4, "logprobs": 0});
    let (_, all) = post(&s, "/v1/completions", &body);
    let mut scored: Vec<(f64, String)> = all["choices"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            let lp = c["logprobs"]["token_logprobs"].as_array().unwrap();
            (
                lp.iter().map(|l| l.as_f64().unwrap()).sum(),
                c["text"].as_str().unwrap().into(),
            )
        })
        .collect();
    scored.sort_by(|a, b| b.0.total_cmp(&a.0));
    let mut best = body.clone();
    best["n"] = json!(2);
    best["best_of"] = json!(4);
    best.as_object_mut().unwrap().remove("logprobs");
    let (st, v) = post(&s, "/v1/completions", &best);
    assert_eq!(st, 200, "{v}");
    let got: Vec<&str> = v["choices"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["text"].as_str().unwrap())
        .collect();
    assert_eq!(
        got,
        vec![scored[0].1.as_str(), scored[1].1.as_str()],
        "{scored:?}"
    );
    assert!(v["choices"][0]["logprobs"].is_null(), "not asked for: {v}");
    assert_eq!(v["usage"]["completion_tokens"], 24, "{v}");
    best["stream"] = json!(true);
    assert_eq!(
        post(&s, "/v1/completions", &best).0,
        400,
        "best_of > n cannot stream"
    );

    // A client that leaves an n = 3 stream frees all three sequences' blocks.
    let mut resp = client()
        .post(s.url("/v1/chat/completions"))
        .json(
            &json!({"messages": msgs, "max_tokens": 4000, "ignore_eos": true,
                      "stream": true, "n": 3}),
        )
        .send()
        .unwrap();
    let mut buf = [0u8; 4096];
    let mut got = 0;
    while got < 3000 {
        got += resp.read(&mut buf).unwrap();
    }
    assert_eq!(s.metric("thaw_num_requests_running"), 3.0);
    drop(resp);
    s.wait_until("the KV blocks to be freed", 20, || {
        s.metric("thaw_kv_cache_usage_perc") <= 0.0
    });
    assert_eq!(s.metric("thaw_num_requests_running"), 0.0);
}

#[test]
fn disconnect_mid_stream_frees_kv_blocks() {
    model_dir("default");
    let s = Server::ready(&[]);
    assert_eq!(s.metric("thaw_kv_cache_usage_perc"), 0.0);
    let mut resp = client()
        .post(s.url("/v1/chat/completions"))
        .json(
            &json!({"messages": [{"role": "user", "content": "Tell me a long story."}],
                      "max_tokens": 4000, "ignore_eos": true, "stream": true}),
        )
        .send()
        .unwrap();
    let mut buf = [0u8; 4096];
    let mut got = 0;
    while got < 2000 {
        got += resp.read(&mut buf).unwrap();
    }
    assert!(s.metric("thaw_kv_cache_usage_perc") > 0.0);
    drop(resp);
    s.wait_until("the KV blocks to be freed", 20, || {
        s.metric("thaw_kv_cache_usage_perc") <= 0.0
    });
    assert_eq!(s.metric("thaw_num_requests_running"), 0.0);
    assert_eq!(
        s.metric("thaw_request_success_total{finished_reason=\"abort\"}"),
        1.0
    );
}

#[test]
fn sigterm_drains_in_flight_streams_then_exits_zero() {
    model_dir("default");
    let mut s = Server::ready(&["--drain-timeout", "60s"]);
    let url = s.url("/v1/completions");
    let streams: Vec<_> = (0..4)
        .map(|i| {
            let url = url.clone();
            std::thread::spawn(move || {
                let r = client()
                    .post(url)
                    .json(&json!({"prompt": format!("Story {i}:"), "max_tokens": 48,
                                  "ignore_eos": true, "stream": true, "temperature": 0,
                                  "stream_options": {"include_usage": true}}))
                    .send()
                    .unwrap();
                assert_eq!(r.status().as_u16(), 200);
                stream_text(&sse_events(r))
            })
        })
        .collect();
    // Wait until all four are running, then ask the worker to stop.
    s.wait_until("four running streams", 30, || {
        s.metric("thaw_num_requests_running") >= 4.0
    });
    s.signal(libc::SIGTERM);
    std::thread::sleep(Duration::from_millis(100));
    let (st, v) = post(
        &s,
        "/v1/completions",
        &json!({"prompt": "late", "max_tokens": 2}),
    );
    assert_eq!(st, 503, "{v}");
    let r = client().get(s.url("/ready")).send().unwrap();
    assert_eq!(r.status().as_u16(), 503);
    // A draining worker asks keep-alive clients to close: the exit would cut an idle one.
    assert_eq!(r.headers()["connection"], "close");
    for h in streams {
        let (_, finish, usage) = h.join().unwrap();
        assert_eq!(finish.as_deref(), Some("length"));
        assert_eq!(usage.unwrap()["completion_tokens"], 48);
    }
    let status = s.wait_exit(Duration::from_secs(30)).expect("exited");
    assert_eq!(status.code(), Some(0), "{}", s.log());
    assert!(s.log().contains("drained"), "{}", s.log());
}

/// One request on a fresh connection, as raw HTTP/1.1 with `Connection: close`: `Ok(None)` when
/// the connection was refused (the worker is gone), `Ok(Some(status))` for a complete response,
/// `Err` when the worker accepted the connection and then dropped it (reset, or a cut response).
fn one_connection(addr: &str, request: &[u8]) -> Result<Option<u16>, String> {
    use std::io::Write;
    let mut c = match std::net::TcpStream::connect(addr) {
        Ok(c) => c,
        Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => return Ok(None),
        Err(e) => return Err(format!("connect: {e}")),
    };
    c.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    c.write_all(request).map_err(|e| format!("write: {e}"))?;
    let mut got = Vec::new();
    c.read_to_end(&mut got).map_err(|e| format!("read: {e}"))?;
    let text = String::from_utf8_lossy(&got);
    let (head, body) = text
        .split_once("\r\n\r\n")
        .ok_or_else(|| format!("no complete head in {} bytes: {text:?}", got.len()))?;
    let status = head
        .strip_prefix("HTTP/1.1 ")
        .and_then(|r| r.get(..3))
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| format!("bad status line: {head:?}"))?;
    let length = head.lines().find_map(|l| {
        let (k, v) = l.split_once(':')?;
        k.eq_ignore_ascii_case("content-length")
            .then(|| v.trim().parse::<usize>().ok())?
    });
    if let Some(n) = length {
        if body.len() != n {
            return Err(format!("body cut at {} of {n} bytes", body.len()));
        }
    }
    Ok(Some(status))
}

/// SIGTERM while clients open connections as fast as they can: every connection the worker
/// accepted gets a whole response (200, or 503 once draining); after that, connections are
/// refused. None is reset — a reset leaves a client unable to tell whether its request ran.
#[test]
fn sigterm_in_a_connection_storm_resets_no_connection() {
    model_dir("default");
    let mut s = Server::ready(&[]);
    let addr = s.url("").trim_start_matches("http://").to_string();
    let health = b"GET /health HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n".to_vec();
    let body = r#"{"prompt": "Hi", "max_tokens": 1}"#;
    let completion = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .into_bytes();
    let storm: Vec<_> = (0..6)
        .map(|i| {
            let (addr, request) = (
                addr.clone(),
                if i < 2 {
                    completion.clone()
                } else {
                    health.clone()
                },
            );
            std::thread::spawn(move || {
                let mut seen = std::collections::BTreeMap::<String, u32>::new();
                let t = std::time::Instant::now();
                while t.elapsed() < Duration::from_secs(60) {
                    let outcome = match one_connection(&addr, &request) {
                        Ok(None) => break,
                        Ok(Some(st)) => st.to_string(),
                        Err(e) => format!("lost: {e}"),
                    };
                    *seen.entry(outcome).or_insert(0) += 1;
                }
                seen
            })
        })
        .collect();
    std::thread::sleep(Duration::from_millis(500));
    s.signal(libc::SIGTERM);
    let mut all = std::collections::BTreeMap::<String, u32>::new();
    for h in storm {
        for (k, n) in h.join().unwrap() {
            *all.entry(k).or_insert(0) += n;
        }
    }
    eprintln!("outcomes: {all:?}");
    let lost: Vec<_> = all.keys().filter(|k| k.starts_with("lost")).collect();
    assert!(lost.is_empty(), "connections lost: {all:?}\n{}", s.log());
    assert!(all.get("200").copied().unwrap_or(0) > 10, "{all:?}");
    let status = s.wait_exit(Duration::from_secs(30)).expect("exited");
    assert_eq!(status.code(), Some(0), "{}", s.log());
}

/// xorshift64*: reproducible pseudo-random bytes for the fuzz cases.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

#[test]
fn a_thousand_malformed_bodies_never_crash_or_500() {
    model_dir("default");
    let s = Server::ready(&["--default-max-tokens", "4"]);
    let bases = [
        json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0.5, "stop": ["x"]}),
        json!({"prompt": "Hello there", "max_tokens": 2, "top_p": 0.9, "seed": 3}),
        json!({"prompt": [1, 2, 3], "max_tokens": 2, "stream": true}),
    ];
    let wild = [
        json!(null),
        json!(-1),
        json!(1e308),
        json!(18446744073709551615u64),
        json!("x"),
        json!([]),
        json!({}),
        json!(true),
        json!([[1]]),
        json!(-9.5e18),
        json!(4294967296u64),
    ];
    let paths = ["/v1/chat/completions", "/v1/completions", "/invoke"];
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    let http = client();
    let mut statuses = std::collections::BTreeMap::new();
    for i in 0..1000 {
        let base = &bases[rng.below(bases.len())];
        let mut body: Vec<u8> = match i % 5 {
            // a field replaced by a value of the wrong type or size
            0 | 1 => {
                let mut v = base.clone();
                let keys: Vec<String> = v.as_object().unwrap().keys().cloned().collect();
                let extra = [
                    "n",
                    "top_k",
                    "max_completion_tokens",
                    "presence_penalty",
                    "logprobs",
                    "top_logprobs",
                    "logit_bias",
                    "echo",
                    "min_tokens",
                    "min_p",
                    "repetition_penalty",
                    "stop_token_ids",
                    "response_format",
                    "stream_options",
                    "model",
                ];
                let k = if rng.below(3) == 0 {
                    extra[rng.below(extra.len())].to_string()
                } else {
                    keys[rng.below(keys.len())].clone()
                };
                v[&k] = wild[rng.below(wild.len())].clone();
                serde_json::to_vec(&v).unwrap()
            }
            // truncated JSON
            2 => {
                let b = serde_json::to_vec(base).unwrap();
                b[..rng.below(b.len())].to_vec()
            }
            // random bytes flipped, including invalid UTF-8
            3 => {
                let mut b = serde_json::to_vec(base).unwrap();
                for _ in 0..1 + rng.below(4) {
                    let j = rng.below(b.len());
                    b[j] = rng.next() as u8;
                }
                b
            }
            // garbage
            _ => (0..rng.below(64)).map(|_| rng.next() as u8).collect(),
        };
        if rng.below(50) == 0 {
            body = vec![0xff, 0xfe, b'{'];
        }
        let path = paths[rng.below(paths.len())];
        if std::env::var("FUZZ_DEBUG").is_ok() {
            eprintln!("case {i} {path} {:?}", String::from_utf8_lossy(&body));
        }
        let r = http
            .post(s.url(path))
            .header("content-type", "application/json")
            .body(body.clone())
            .send()
            .unwrap_or_else(|e| panic!("case {i}: no response ({e}); {}", s.log()));
        let st = r.status().as_u16();
        let text = r.text().unwrap_or_default();
        assert!(
            st == 200 || (400..500).contains(&st),
            "case {i} {path} {:?} → {st} {text}",
            String::from_utf8_lossy(&body)
        );
        *statuses.entry(st).or_insert(0) += 1;
    }
    assert!(statuses.len() >= 2, "{statuses:?}");
    eprintln!("statuses: {statuses:?}");
    assert_eq!(s.status("/health"), 200);
    assert_eq!(s.metric("thaw_kv_cache_usage_perc"), 0.0);
}
