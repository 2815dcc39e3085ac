//! # thaw-tests: black-box tests against the built binaries
//!
//! Nothing here links the project's crates: tests start `target/<profile>/thaw` and
//! `bench-coldstart` as real processes, exactly as a user or a platform would, and judge them by
//! exit codes, stdout and stderr. Build the binaries first (`scripts/test.sh` does).

use std::path::PathBuf;
use std::process::{Command, Output};

/// Path of a workspace binary next to the running test executable's profile directory.
pub fn bin(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("test executable path");
    // target/<profile>/deps/<test> → target/<profile>/<name>
    let dir = exe
        .parent()
        .and_then(|d| d.parent())
        .expect("target profile directory");
    let p = dir.join(name);
    assert!(
        p.is_file(),
        "{} is missing: run `cargo build --release --bins` first (scripts/test.sh does)",
        p.display()
    );
    p
}

/// Runs `thaw` with `args`.
pub fn thaw(args: &[&str]) -> Output {
    Command::new(bin("thaw"))
        .args(args)
        .output()
        .expect("starting thaw")
}

pub fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// The reference data copied from llama.cpp runs (tests/fixtures).
pub fn golden() -> serde_json::Value {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("fixtures/smollm2-public.json");
    serde_json::from_str(&std::fs::read_to_string(p).expect("fixture")).expect("fixture JSON")
}

/// The default model's directory (fetched on first use) in `variant` (`default`, `default-f32`).
pub fn model_dir(variant: &str) -> PathBuf {
    let dtype = variant.strip_prefix("default-").unwrap_or("bf16");
    let o = thaw(&["model", "fetch", "--dtype", dtype]);
    assert!(
        o.status.success(),
        "thaw model fetch failed: {}",
        stderr(&o)
    );
    PathBuf::from(stdout(&o).trim())
}
