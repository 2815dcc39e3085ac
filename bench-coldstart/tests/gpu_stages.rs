//! `bench-coldstart gpu` runs each stage in a process of its own and merges their JSON. On a
//! machine without a GPU (CI) the first stage, the floors, fails in its child process: the
//! parent must report that stage's own error, write the JSON with it, and exit non-zero — the
//! path a GPU host's first failing stage takes too. A stage run directly writes its error.
#![cfg(feature = "cuda")]

use std::process::Command;

fn bench() -> Command {
    Command::new(env!("CARGO_BIN_EXE_bench-coldstart"))
}

fn gpu_present() -> bool {
    std::path::Path::new("/dev/nvidiactl").exists()
}

#[test]
fn a_failing_stage_is_reported_with_its_own_error() {
    if gpu_present() {
        eprintln!("skipped: a GPU is present (this test is of the no-GPU path)");
        return;
    }
    let dir = std::env::temp_dir().join(format!("thaw-gpu-stages-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let out = dir.join("gpu.json");
    let run = bench()
        .args(["gpu", "--check", "/nonexistent", "--out"])
        .arg(&out)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&run.stdout);
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert_eq!(run.status.code(), Some(1), "{stdout}\n{stderr}");
    assert!(stderr.contains("no usable GPU"), "{stderr}");
    // The child's error, carried through its JSON part, not just "exited with 1".
    assert!(stdout.contains("floors: ERROR opening the GPU"), "{stdout}");
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();
    assert_eq!(v["errors"][0]["stage"], "floors");
    assert!(
        v["errors"][0]["error"]
            .as_str()
            .unwrap()
            .contains("opening the GPU"),
        "{v}"
    );
    // No stage's part file is left behind.
    assert!(!out.with_extension("stage.json").exists());

    // A stage run directly: its error goes to --out as {"error": …}, exit 1.
    let part = dir.join("part.json");
    let run = bench()
        .args(["gpu", "--stage", "decode", "--out"])
        .arg(&part)
        .output()
        .unwrap();
    assert_eq!(run.status.code(), Some(1));
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&part).unwrap()).unwrap();
    assert!(v["error"].as_str().unwrap().contains("needs --big"), "{v}");
    std::fs::remove_dir_all(&dir).unwrap();
}
