//! The deployment files in `infra/` against the real binary and tools, so they cannot drift:
//! every container's arguments (Knative, the Deployment, each Dockerfile's entrypoint) parse as
//! `thaw serve` arguments; the Prometheus configuration and rules pass `promtool`; and every
//! `thaw_*` metric that the rules and the Grafana dashboard query is one a running worker exports.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

use thaw_tests::{bin, client, model_dir, Server};

fn infra() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../infra")
}

fn files(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap().flatten() {
        let p = e.path();
        if p.is_dir() {
            files(&p, out);
        } else {
            out.push(p);
        }
    }
}

/// The test venv's Python (it has PyYAML: scripts/setup-test-deps.sh installs moto, which
/// needs it).
fn python() -> PathBuf {
    let home = std::env::var_os("THAW_HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(std::env::var_os("HOME").unwrap()).join(".cache/thaw"));
    home.join("venv/bin/python")
}

/// Every container's `args` in the YAML files, as JSON arrays.
fn container_args(yaml_files: &[PathBuf]) -> Vec<Vec<String>> {
    let script = r#"
import json, sys, yaml
out = []
def walk(v):
    if isinstance(v, dict):
        if "containers" in v:
            for c in v["containers"]:
                out.append([str(a) for a in c.get("args", [])])
        for x in v.values():
            walk(x)
    elif isinstance(v, list):
        for x in v:
            walk(x)
for f in sys.argv[1:]:
    for doc in yaml.safe_load_all(open(f)):
        walk(doc)
print(json.dumps(out))
"#;
    let o = Command::new(python())
        .arg("-c")
        .arg(script)
        .args(yaml_files)
        .output()
        .expect("running the test venv's python (scripts/setup-test-deps.sh)");
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    serde_json::from_slice(&o.stdout).unwrap()
}

#[test]
fn every_deployment_argument_list_parses_as_thaw_serve() {
    let mut all = Vec::new();
    files(&infra(), &mut all);
    let yaml: Vec<PathBuf> = all
        .iter()
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .cloned()
        .collect();
    let lists = container_args(&yaml);
    assert!(lists.len() >= 2, "Knative and the Deployment: {lists:?}");
    // What each Dockerfile's ENTRYPOINT runs (after `thaw`).
    let mut entry = Vec::new();
    for d in all.iter().filter(|p| {
        p.file_name()
            .is_some_and(|n| n.to_string_lossy().starts_with("Dockerfile"))
    }) {
        let text = std::fs::read_to_string(d).unwrap();
        let line = text
            .lines()
            .find(|l| l.starts_with("ENTRYPOINT"))
            .expect("an ENTRYPOINT");
        let v: Vec<String> =
            serde_json::from_str(line.trim_start_matches("ENTRYPOINT").trim()).unwrap();
        assert_eq!(v[0], "thaw", "{}", d.display());
        entry.push(v[1..].to_vec());
    }
    assert_eq!(entry.len(), 2, "the CPU and CUDA images");
    for e in &entry {
        for args in &lists {
            let o = Command::new(bin("thaw"))
                .args(e)
                .args(args)
                .arg("--help")
                .output()
                .unwrap();
            assert!(
                o.status.success(),
                "thaw {e:?} {args:?}: {}",
                String::from_utf8_lossy(&o.stderr)
            );
        }
    }
    // The check itself refuses what thaw refuses.
    let o = Command::new(bin("thaw"))
        .args(["serve", "--max-running", "many", "--help"])
        .output()
        .unwrap();
    assert!(!o.status.success());
}

#[test]
fn prometheus_files_pass_promtool_and_query_only_exported_metrics() {
    let dir = infra().join("prometheus");
    for (what, file) in [("config", "prometheus.yml"), ("rules", "thaw-rules.yml")] {
        let o = Command::new("promtool")
            .args(["check", what])
            .arg(dir.join(file))
            .output()
            .expect("promtool (scripts/setup-test-deps.sh installs it)");
        assert!(
            o.status.success(),
            "promtool check {what} {file}: {}",
            String::from_utf8_lossy(&o.stdout)
        );
    }
    let dash: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(infra().join("grafana/thaw-dashboard.json")).unwrap(),
    )
    .expect("the dashboard is JSON");
    let panels = dash["panels"].as_array().unwrap();
    assert!(panels
        .iter()
        .all(|p| p["targets"].as_array().is_some_and(|t| !t.is_empty())));

    // Names the rules and the dashboard use.
    let mut used = BTreeSet::new();
    for f in [
        dir.join("thaw-rules.yml"),
        infra().join("grafana/thaw-dashboard.json"),
    ] {
        let text = std::fs::read_to_string(&f).unwrap();
        let mut rest = text.as_str();
        while let Some(i) = rest.find("thaw_") {
            let name: String = rest[i..]
                .chars()
                .take_while(|c| c.is_ascii_lowercase() || *c == '_' || c.is_ascii_digit())
                .collect();
            rest = &rest[i + name.len()..];
            if name == "thaw_" {
                continue; // prose ("the `thaw_` prefix")
            }
            let base = ["_bucket", "_sum", "_count"]
                .iter()
                .find_map(|s| name.strip_suffix(s))
                .unwrap_or(&name);
            used.insert(base.to_string());
        }
    }
    assert!(used.len() >= 10, "{used:?}");

    // A worker that has loaded, served a request and refused one exports all of them.
    let s = Server::ready(&["--model", model_dir("default").to_str().unwrap()]);
    let c = client();
    let ok = c
        .post(s.url("/v1/completions"))
        .json(&serde_json::json!({"prompt": "Hello", "max_tokens": 3}))
        .send()
        .unwrap();
    assert!(ok.status().is_success());
    let bad = c
        .post(s.url("/v1/completions"))
        .header("content-type", "application/json")
        .body("{not json")
        .send()
        .unwrap();
    assert_eq!(bad.status().as_u16(), 400);
    let text = c.get(s.url("/metrics")).send().unwrap().text().unwrap();
    let exported: BTreeSet<String> = text
        .lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| l.split(['{', ' ']).next())
        .map(|n| {
            ["_bucket", "_sum", "_count"]
                .iter()
                .find_map(|s| n.strip_suffix(s))
                .unwrap_or(n)
                .to_string()
        })
        .collect();
    let missing: Vec<&String> = used.iter().filter(|n| !exported.contains(*n)).collect();
    assert!(missing.is_empty(), "queried but not exported: {missing:?}");
}
