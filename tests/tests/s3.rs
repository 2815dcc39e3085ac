//! `--model s3://bucket/prefix` end to end: the default model pushed with `thaw model push` to a
//! real S3-compatible server (moto's, its own process), then generated from and served from
//! there with the weights read by ranged GETs — the same tokens as from the local directory.

use std::process::{Command, Output};

use thaw_tests::s3::Moto;
use thaw_tests::{bin, client, model_dir, stderr, stdout, Server};

/// The AWS variables that point thaw at `moto` (moto accepts any credentials; they are still
/// used to sign).
fn env(port: u16) -> Vec<(&'static str, String)> {
    vec![
        ("AWS_ENDPOINT_URL", format!("http://127.0.0.1:{port}")),
        ("AWS_ACCESS_KEY_ID", "test".into()),
        ("AWS_SECRET_ACCESS_KEY", "test".into()),
        ("AWS_REGION", "us-east-1".into()),
        ("THAW_S3_ATTEMPTS", "3".into()),
    ]
}

fn thaw_env(port: u16, home: &std::path::Path, args: &[&str]) -> Output {
    Command::new(bin("thaw"))
        .args(args)
        .envs(env(port))
        .env("THAW_HOME", home)
        .output()
        .expect("starting thaw")
}

fn greedy_ids(o: &Output) -> Vec<u64> {
    assert!(o.status.success(), "thaw generate failed: {}", stderr(o));
    let v: serde_json::Value = serde_json::from_str(stdout(o).trim()).expect("JSON output");
    v["output_ids"]
        .as_array()
        .expect("output_ids")
        .iter()
        .map(|x| x.as_u64().unwrap())
        .collect()
}

#[test]
fn the_default_model_generates_and_serves_from_s3_as_from_disk() {
    let local = model_dir("default");
    let moto = Moto::start();
    moto.create_bucket("models");
    // A THAW_HOME of its own: the materialized directory must not come from an earlier run.
    let home = tempfile::tempdir().unwrap();
    let local_s = local.to_str().unwrap();
    let o = thaw_env(
        moto.port,
        home.path(),
        &["model", "push", local_s, "s3://models/smollm2"],
    );
    assert!(o.status.success(), "push failed: {}", stderr(&o));
    assert!(stderr(&o).contains("uploaded 7 files"), "{}", stderr(&o));

    let args = [
        "generate",
        "--prompt",
        "The capital of France is",
        "--max-tokens",
        "8",
        "--json",
    ];
    let here = greedy_ids(&thaw_env(
        moto.port,
        home.path(),
        &[&args[..], &["--model", local_s]].concat(),
    ));
    let o = thaw_env(
        moto.port,
        home.path(),
        &[&args[..], &["--model", "s3://models/smollm2"]].concat(),
    );
    assert_eq!(greedy_ids(&o), here, "s3 and local weights differ");
    let v: serde_json::Value = serde_json::from_str(stdout(&o).trim()).unwrap();
    assert_eq!(v["timings"]["load"]["strategy"], "s3");
    assert_eq!(
        v["timings"]["load"]["verified"], true,
        "the manifest came along"
    );
    // Only the small files were stored locally.
    let stub = home.path().join("s3/models/smollm2");
    assert!(stub.join("tokenizer.json").is_file());
    assert!(stub.join("thaw-remote.json").is_file());
    assert!(!stub.join("model.safetensors").exists());

    // Served: the port opens before the store is asked; the listing is a cold-start phase.
    let env: Vec<(&str, String)> = env(moto.port);
    let mut env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let home_s = home.path().to_str().unwrap().to_string();
    env.push(("THAW_HOME", &home_s));
    let s = Server::spawn_env(&["--model", "s3://models/smollm2"], &env);
    s.wait_ready();
    let r: serde_json::Value = client()
        .post(s.url("/v1/completions"))
        .json(&serde_json::json!({"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}))
        .send()
        .unwrap()
        .json()
        .unwrap();
    let text = r["choices"][0]["text"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    assert!(text.contains("Paris"), "{r}");
    let log = s.log();
    assert!(log.contains("s3://models/smollm2: "), "{log}");
    assert!(log.contains("weight headers"), "{log}");
    assert!(log.contains(", s3)"), "loaded with the s3 strategy: {log}");
}

#[test]
fn unreachable_or_missing_s3_models_are_clear_errors() {
    let moto = Moto::start();
    moto.create_bucket("empty");
    let home = tempfile::tempdir().unwrap();
    let gen = |port: u16, url: &str| {
        let o = thaw_env(
            port,
            home.path(),
            &[
                "generate",
                "--model",
                url,
                "--prompt",
                "hi",
                "--max-tokens",
                "1",
            ],
        );
        assert!(!o.status.success(), "{url} must fail");
        let e = stderr(&o);
        assert!(!e.contains("panicked"), "{e}");
        e
    };
    let e = gen(moto.port, "s3://empty/nothing");
    assert!(
        e.contains("s3://empty/nothing: no objects under this prefix"),
        "{e}"
    );
    let e = gen(moto.port, "s3://no-such-bucket/m");
    assert!(e.contains("s3://no-such-bucket/"), "{e}");
    let e = gen(moto.port, "s3://");
    assert!(e.contains("not a valid bucket name"), "{e}");
    // A web identity (EKS's IRSA variables, no keys): its token file is read for STS.
    let o = Command::new(bin("thaw"))
        .args(["generate", "--model", "s3://empty/x", "--prompt", "hi"])
        .env(
            "AWS_ENDPOINT_URL",
            format!("http://127.0.0.1:{}", moto.port),
        )
        .env("AWS_WEB_IDENTITY_TOKEN_FILE", "/nonexistent/irsa-token")
        .env("AWS_ROLE_ARN", "arn:aws:iam::123456789012:role/thaw")
        .env("THAW_S3_ATTEMPTS", "1")
        .env_remove("AWS_ACCESS_KEY_ID")
        .env_remove("AWS_SECRET_ACCESS_KEY")
        .env("THAW_HOME", home.path())
        .output()
        .unwrap();
    assert!(!o.status.success());
    assert!(
        stderr(&o).contains("web identity token /nonexistent/irsa-token"),
        "{}",
        stderr(&o)
    );
    // Nothing listening: the listing's retries give up with the reason.
    let e = gen(thaw_tests::s3::free_port(), "s3://m/x");
    assert!(
        e.contains("s3://m/x") && e.contains("gave up after 3 tries"),
        "{e}"
    );
}
