//! `thaw` as a user runs it: fetch, tokenize, generate, convert; bad input gives one clear line.

use std::path::Path;

use serde_json::Value;
use thaw_tests::{golden, model_dir, stderr, stdout, thaw};

fn ids(v: &Value) -> Vec<u64> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap())
        .collect()
}

#[test]
fn tokenize_matches_reference() {
    model_dir("default");
    for c in golden()["tokenize"].as_array().unwrap() {
        let text = c["text"].as_str().unwrap();
        let o = thaw(&["tokenize", "--model", "default", "--text", text]);
        assert!(o.status.success(), "{}", stderr(&o));
        let v: Value = serde_json::from_str(stdout(&o).trim()).unwrap();
        assert_eq!(ids(&v["ids"]), ids(&c["ids"]), "{text:?}");
    }
}

#[test]
fn generate_json_f32_matches_reference() {
    model_dir("default-f32");
    let g = &golden()["greedy"][0];
    let user = g["messages"][0]["content"].as_str().unwrap();
    let o = thaw(&[
        "generate",
        "--model",
        "default-f32",
        "--chat",
        user,
        "--max-tokens",
        "32",
        "--json",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: Value = serde_json::from_str(stdout(&o).trim()).unwrap();
    let want: Vec<u64> = ids(&g["output_ids"])
        .into_iter()
        .filter(|&t| t != 2)
        .collect();
    assert_eq!(ids(&v["prompt_ids"]), ids(&g["prompt_ids"]));
    assert_eq!(ids(&v["output_ids"]), want);
    assert_eq!(v["text"], g["output_text"]);
    assert_eq!(v["finish_reason"], "stop");
    for k in ["load_ms", "ttft_ms", "decode_tokens_per_s"] {
        assert!(
            v["timings"][k].as_f64().unwrap() > 0.0,
            "{k}: {}",
            v["timings"]
        );
    }
}

#[test]
fn generate_streams_text_and_honours_limits() {
    model_dir("default");
    // Raw prompt ids, fixed length with ignore_eos.
    let o = thaw(&[
        "generate",
        "--model",
        "default",
        "--prompt-ids",
        "504,3575,282,4649,314",
        "--max-tokens",
        "7",
        "--ignore-eos",
        "--json",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: Value = serde_json::from_str(stdout(&o).trim()).unwrap();
    assert_eq!(v["output_ids"].as_array().unwrap().len(), 7);
    assert_eq!(v["finish_reason"], "length");
    // Streaming mode prints the text; a stop string cuts it.
    let o = thaw(&[
        "generate",
        "--model",
        "default",
        "--chat",
        "What is the capital of France?",
        "--stop",
        " Paris",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(stdout(&o).trim_end(), "The capital of France is");
    // Seeded sampling is reproducible.
    let args = [
        "generate",
        "--model",
        "default",
        "--prompt",
        "Once upon a time",
        "--temperature",
        "0.9",
        "--top-p",
        "0.95",
        "--seed",
        "7",
        "--max-tokens",
        "16",
        "--json",
    ];
    let (a, b) = (thaw(&args), thaw(&args));
    let text = |o: &std::process::Output| {
        serde_json::from_str::<Value>(stdout(o).trim()).unwrap()["output_ids"].clone()
    };
    assert_eq!(text(&a), text(&b));
}

#[test]
fn sharded_conversion_loads_and_generates() {
    let gguf = dirs_gguf();
    let out = tempfile::tempdir().unwrap();
    let o = thaw(&[
        "convert",
        "--gguf",
        gguf.to_str().unwrap(),
        "--out",
        out.path().to_str().unwrap(),
        "--shard-size",
        "50MB",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let index: Value = serde_json::from_str(
        &std::fs::read_to_string(out.path().join("model.safetensors.index.json")).unwrap(),
    )
    .unwrap();
    let shards: std::collections::BTreeSet<&str> = index["weight_map"]
        .as_object()
        .unwrap()
        .values()
        .map(|v| v.as_str().unwrap())
        .collect();
    assert!(shards.len() >= 5, "{shards:?}");
    let o = thaw(&[
        "generate",
        "--model",
        out.path().to_str().unwrap(),
        "--chat",
        "What is the capital of France?",
        "--max-tokens",
        "8",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stdout(&o).contains("Paris"), "{}", stdout(&o));
}

#[test]
fn quantized_checkpoint_generates_and_broken_ones_are_refused() {
    let src = model_dir("default");
    let out = tempfile::tempdir().unwrap();
    let q = out.path().join("q8");
    let o = thaw(&[
        "quantize",
        "--model",
        src.to_str().unwrap(),
        "--out",
        q.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(
        stderr(&o).contains("quantized 210 matrices to Q8_0"),
        "{}",
        stderr(&o)
    );
    assert_eq!(Path::new(stdout(&o).trim()), q);
    let cfg: Value =
        serde_json::from_str(&std::fs::read_to_string(q.join("config.json")).unwrap()).unwrap();
    assert_eq!(cfg["quantization_config"]["quant_method"], "thaw_q8_0");
    for f in [
        "tokenizer.json",
        "tokenizer_config.json",
        "thaw-manifest.json",
    ] {
        assert!(q.join(f).is_file(), "{f}");
    }
    let o = thaw(&[
        "generate",
        "--model",
        q.to_str().unwrap(),
        "--chat",
        "What is the capital of France?",
        "--max-tokens",
        "8",
        "--verify",
        "required",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stdout(&o).contains("Paris"), "{}", stdout(&o));

    // Quantizing it again finds nothing to do; the source is never the output.
    let o = thaw(&[
        "quantize",
        "--model",
        q.to_str().unwrap(),
        "--out",
        out.path().join("again").to_str().unwrap(),
    ]);
    assert!(!o.status.success());
    assert!(
        stderr(&o).contains("no block projections to quantize"),
        "{}",
        stderr(&o)
    );
    let o = thaw(&[
        "quantize",
        "--model",
        q.to_str().unwrap(),
        "--out",
        q.to_str().unwrap(),
    ]);
    assert!(
        stderr(&o).contains("--out must be another directory"),
        "{}",
        stderr(&o)
    );

    // An I8 projection without its scales (renamed in the header, offsets unchanged).
    let st = q.join("model.safetensors");
    let mut bytes = std::fs::read(&st).unwrap();
    let hl = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header = String::from_utf8(bytes[8..8 + hl].to_vec()).unwrap();
    let renamed = header.replacen(
        "layers.0.self_attn.q_proj.weight_scale",
        "layers.0.self_attn.q_proj.weight_scalx",
        1,
    );
    assert_ne!(renamed, header);
    bytes[8..8 + hl].copy_from_slice(renamed.as_bytes());
    std::fs::write(&st, bytes).unwrap();
    assert_clean_error(
        &q,
        "q8",
        "missing tensor 'model.layers.0.self_attn.q_proj.weight_scale'",
    );
}

/// A default model cached by an older `thaw convert` (no format stamp, 8-byte-aligned data) is
/// converted again on the next fetch, and replaced whole; a current one is left alone.
#[test]
fn fetch_reconverts_a_cache_from_an_older_converter() {
    let gguf = dirs_gguf();
    let home = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(home.path().join("downloads")).unwrap();
    std::os::unix::fs::symlink(
        &gguf,
        home.path()
            .join("downloads")
            .join(gguf.file_name().unwrap()),
    )
    .unwrap();
    let stale = home.path().join("models/smollm2-135m-instruct");
    std::fs::create_dir_all(&stale).unwrap();
    let real = model_dir("default");
    std::fs::copy(real.join("config.json"), stale.join("config.json")).unwrap();
    std::fs::write(stale.join("model.safetensors"), b"old layout").unwrap();
    let fetch = || {
        std::process::Command::new(thaw_tests::bin("thaw"))
            .args(["model", "fetch"])
            .env("THAW_HOME", home.path())
            .output()
            .unwrap()
    };
    let o = fetch();
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(Path::new(stdout(&o).trim()), stale);
    let st = std::fs::read(stale.join("model.safetensors")).unwrap();
    let header = 8 + u64::from_le_bytes(st[..8].try_into().unwrap()) as usize;
    assert_eq!(header % 4096, 0);
    assert_eq!(
        std::fs::read_to_string(stale.join("thaw-convert-format"))
            .unwrap()
            .trim(),
        "2"
    );
    for f in ["tokenizer.json", "thaw-manifest.json"] {
        assert!(stale.join(f).is_file(), "{f}");
    }
    // Nothing left beside it, and a second fetch converts nothing.
    let names: Vec<_> = std::fs::read_dir(home.path().join("models"))
        .unwrap()
        .flatten()
        .map(|e| e.file_name())
        .collect();
    assert_eq!(names.len(), 1, "{names:?}");
    let mtime = || {
        std::fs::metadata(stale.join("model.safetensors"))
            .unwrap()
            .modified()
            .unwrap()
    };
    let before = mtime();
    let o = fetch();
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(mtime(), before);
}

fn dirs_gguf() -> std::path::PathBuf {
    model_dir("default");
    let home = std::env::var_os("THAW_HOME")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| Path::new(&std::env::var("HOME").unwrap()).join(".cache/thaw"));
    home.join("downloads/SmolLM2-135M-Instruct.Q4_1.gguf")
}

/// A model directory whose tokenizer and config are the real ones and whose weights are `st`.
fn broken_model(st: &[u8], config: Option<&str>) -> tempfile::TempDir {
    let real = model_dir("default");
    let d = tempfile::tempdir().unwrap();
    for f in ["tokenizer.json", "tokenizer_config.json", "config.json"] {
        std::fs::copy(real.join(f), d.path().join(f)).unwrap();
    }
    if let Some(c) = config {
        std::fs::write(d.path().join("config.json"), c).unwrap();
    }
    std::fs::write(d.path().join("model.safetensors"), st).unwrap();
    d
}

fn safetensors(header: &str, data_len: usize) -> Vec<u8> {
    let mut v = (header.len() as u64).to_le_bytes().to_vec();
    v.extend(header.as_bytes());
    v.resize(v.len() + data_len, 0);
    v
}

/// Runs `thaw generate` on `dir` and checks for a one-line error that names `file` and `what`.
fn assert_clean_error(dir: &Path, file: &str, what: &str) {
    let o = thaw(&[
        "generate",
        "--model",
        dir.to_str().unwrap(),
        "--prompt",
        "hi",
        "--max-tokens",
        "2",
    ]);
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(1), "stderr: {err}");
    assert!(!err.contains("panicked"), "{err}");
    assert_eq!(err.trim_end().lines().count(), 1, "one line: {err}");
    assert!(err.starts_with("error: "), "{err}");
    assert!(
        err.contains(file) && err.contains(what),
        "want '{file}' and '{what}' in: {err}"
    );
}

#[test]
fn bad_checkpoints_give_one_line_errors() {
    // Truncated: the real header, a fraction of the data.
    let real = std::fs::read(model_dir("default").join("model.safetensors")).unwrap();
    let d = broken_model(&real[..1 << 20], None);
    assert_clean_error(d.path(), "model.safetensors", "truncated");

    let d = broken_model(
        &safetensors(
            r#"{"a":{"dtype":"Q9","shape":[2],"data_offsets":[0,4]}}"#,
            4,
        ),
        None,
    );
    assert_clean_error(d.path(), "model.safetensors", "unknown dtype 'Q9'");

    let d = broken_model(
        &safetensors(
            r#"{"a":{"dtype":"BF16","shape":[3,3],"data_offsets":[0,16]}}"#,
            16,
        ),
        None,
    );
    assert_clean_error(d.path(), "model.safetensors", "needs 18 bytes");

    let d = broken_model(
        &safetensors(
            r#"{"model.norm.weight":{"dtype":"BF16","shape":[576],"data_offsets":[0,1152]}}"#,
            1152,
        ),
        None,
    );
    assert_clean_error(d.path(), "", "missing tensor 'model.embed_tokens.weight'");

    let cfg = r#"{"architectures":["GPT2LMHeadModel"],"hidden_size":8,"intermediate_size":8,"num_hidden_layers":1,"num_attention_heads":1,"vocab_size":8}"#;
    let d = broken_model(&safetensors("{}", 0), Some(cfg));
    assert_clean_error(
        d.path(),
        "config.json",
        "unsupported architecture 'GPT2LMHeadModel'",
    );

    // A model with the right names but a wrong shape.
    let cfg_small = r#"{"architectures":["LlamaForCausalLM"],"hidden_size":4,"intermediate_size":8,"num_hidden_layers":1,"num_attention_heads":1,"vocab_size":49152}"#;
    let d = broken_model(
        &safetensors(
            r#"{"model.embed_tokens.weight":{"dtype":"F32","shape":[49152,5],"data_offsets":[0,983040]}}"#,
            983040,
        ),
        Some(cfg_small),
    );
    assert_clean_error(
        d.path(),
        "model.safetensors",
        "has shape [49152, 5], expected [49152, 4]",
    );

    // An index that names a shard that is not there.
    let d = broken_model(&safetensors("{}", 0), None);
    std::fs::write(
        d.path().join("model.safetensors.index.json"),
        r#"{"weight_map":{"x":"model-00001-of-00002.safetensors"}}"#,
    )
    .unwrap();
    assert_clean_error(d.path(), "model.safetensors.index.json", "does not exist");
}

#[test]
fn bad_gguf_and_bad_arguments() {
    let d = tempfile::tempdir().unwrap();
    let g = d.path().join("bad.gguf");
    std::fs::write(&g, b"GGMLxxxxxxxxxxxxxxxxxxxxxxxx").unwrap();
    let o = thaw(&[
        "convert",
        "--gguf",
        g.to_str().unwrap(),
        "--out",
        d.path().join("out").to_str().unwrap(),
    ]);
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(
        err.contains("bad.gguf") && err.contains("bad magic") && !err.contains("panicked"),
        "{err}"
    );

    let o = thaw(&["generate", "--model", "/nonexistent/model", "--prompt", "x"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("/nonexistent/model"), "{}", stderr(&o));

    model_dir("default");
    let o = thaw(&[
        "generate",
        "--model",
        "default",
        "--prompt-ids",
        "1,999999",
        "--max-tokens",
        "1",
    ]);
    assert_eq!(o.status.code(), Some(1));
    assert!(
        stderr(&o).contains("outside the vocabulary"),
        "{}",
        stderr(&o)
    );
}

#[test]
fn unreadable_model_directory_is_a_clear_error() {
    let real = model_dir("default");
    let d = tempfile::tempdir().unwrap();
    for f in ["config.json", "tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(real.join(f), d.path().join(f)).unwrap();
    }
    std::os::unix::fs::symlink(
        real.join("model.safetensors"),
        d.path().join("model.safetensors"),
    )
    .unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(d.path(), std::fs::Permissions::from_mode(0o000)).unwrap();
    // Root ignores permission bits: run as an unprivileged user where we are root.
    let is_root = std::process::Command::new("id")
        .arg("-u")
        .output()
        .map(|o| stdout(&o).trim() == "0")
        .unwrap_or(false);
    // The unprivileged user must be able to reach the binary wherever the checkout lives
    // (CI may clone under a directory only root can enter): run a copy from a world-readable place.
    let bin_dir = tempfile::tempdir().unwrap();
    let bin = bin_dir.path().join("thaw");
    std::fs::copy(thaw_tests::bin("thaw"), &bin).unwrap();
    std::fs::set_permissions(bin_dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    std::fs::set_permissions(&bin, std::fs::Permissions::from_mode(0o755)).unwrap();
    if is_root
        && std::process::Command::new("setpriv")
            .arg("--version")
            .output()
            .is_err()
    {
        eprintln!("skipped: running as root without util-linux `setpriv` to drop privileges");
        std::fs::set_permissions(d.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
        return;
    }
    let mut cmd = if is_root {
        let mut c = std::process::Command::new("setpriv");
        c.args(["--reuid=65534", "--regid=65534", "--clear-groups"])
            .arg(&bin);
        c
    } else {
        std::process::Command::new(&bin)
    };
    let o = cmd
        .args([
            "generate",
            "--model",
            d.path().to_str().unwrap(),
            "--prompt",
            "hi",
        ])
        .output()
        .unwrap();
    std::fs::set_permissions(d.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(
        err.contains(d.path().to_str().unwrap())
            && err.contains("ermission denied")
            && !err.contains("panicked"),
        "{err}"
    );
}

/// On a terminal, loading shows a progress bar that ends at 100% with every layer ready.
#[test]
fn progress_bar_on_a_terminal() {
    model_dir("default");
    if std::process::Command::new("script")
        .arg("--version")
        .output()
        .is_err()
    {
        eprintln!("skipped: util-linux `script` (a pseudo-terminal) is not installed");
        return;
    }
    let cmd = format!(
        "{} generate --model default --prompt-ids 504,3575 --max-tokens 1 --load-strategy pread",
        thaw_tests::bin("thaw").display()
    );
    let o = std::process::Command::new("script")
        .args(["-qec", &cmd, "/dev/null"])
        .output()
        .unwrap();
    let out = stdout(&o);
    assert!(o.status.success(), "{out}");
    assert!(
        out.contains("loading weights 100%") && out.contains("32/32 layers ready"),
        "{out}"
    );
    // Not on a pipe.
    let o = thaw(&[
        "generate",
        "--model",
        "default",
        "--prompt-ids",
        "504,3575",
        "--max-tokens",
        "1",
    ]);
    assert!(!stderr(&o).contains("loading weights"), "{}", stderr(&o));
}

/// Where io_uring is refused, uring-direct falls back to buffered reads and says why.
#[test]
fn refused_io_uring_falls_back_and_says_so() {
    model_dir("default");
    let o = std::process::Command::new(thaw_tests::bin("thaw"))
        .env("THAW_IO_URING", "off")
        .args([
            "generate",
            "--model",
            "default",
            "--chat",
            "What is the capital of France?",
            "--max-tokens",
            "8",
            "--load-strategy",
            "uring-direct",
            "--json",
        ])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(
        stderr(&o).contains("note: loaded with pread instead: io_uring disabled"),
        "{}",
        stderr(&o)
    );
    let v: Value = serde_json::from_str(stdout(&o).trim()).unwrap();
    assert_eq!(v["timings"]["load"]["strategy"], "pread");
    assert_eq!(v["text"], "The capital of France is Paris.");
}

#[test]
fn device_flag_refuses_cuda_with_the_reason_and_auto_runs() {
    model_dir("default");
    let o = thaw(&[
        "generate",
        "--device",
        "cuda",
        "--prompt",
        "hi",
        "--max-tokens",
        "2",
    ]);
    assert_eq!(o.status.code(), Some(1));
    let e = stderr(&o);
    assert!(
        e.starts_with("error: --device cuda: ") && e.lines().count() == 1,
        "{e}"
    );
    let o = thaw(&[
        "generate",
        "--device",
        "auto",
        "--prompt",
        "hi",
        "--max-tokens",
        "2",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let o = thaw(&["generate", "--device", "tpu", "--prompt", "hi"]);
    assert!(!o.status.success() && stderr(&o).contains("unknown device 'tpu'"));
}
