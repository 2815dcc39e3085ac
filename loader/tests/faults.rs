//! The loader under bad input and faults, for every strategy: each case is a clear error (or a
//! logged fallback) and never a panic, a hang or a partially-loaded result reported as loaded.

use std::path::{Path, PathBuf};

use thaw_loader::{Checkpoint, HostWeights, LoadOptions, Manifest, Strategy, Verify};

const STRATEGIES: [Strategy; 4] = [
    Strategy::UringDirect,
    Strategy::Pread,
    Strategy::Mmap,
    Strategy::Auto,
];

/// Writes a safetensors file holding `tensors` (name, f32 values) in the given order.
fn write_st(path: &Path, tensors: &[(&str, Vec<f32>)]) {
    let mut header = serde_json::Map::new();
    let mut off = 0usize;
    for (name, v) in tensors {
        header.insert(name.to_string(), serde_json::json!({"dtype": "F32", "shape": [v.len()], "data_offsets": [off, off + 4 * v.len()]}));
        off += 4 * v.len();
    }
    let mut h = serde_json::to_string(&header).unwrap();
    while !(8 + h.len()).is_multiple_of(8) {
        h.push(' ');
    }
    let mut bytes = (h.len() as u64).to_le_bytes().to_vec();
    bytes.extend(h.as_bytes());
    for (_, v) in tensors {
        bytes.extend(v.iter().flat_map(|x| x.to_le_bytes()));
    }
    std::fs::write(path, bytes).unwrap();
}

/// A checkpoint of `layers` blocks with ~`per_tensor` floats per tensor, written in *reverse*
/// layer order so the plan has to reorder it.
fn checkpoint(dir: &Path, layers: usize, per_tensor: usize) -> Vec<(String, Vec<f32>)> {
    let mut t: Vec<(String, Vec<f32>)> = vec![(
        "model.embed_tokens.weight".into(),
        (0..per_tensor).map(|i| i as f32).collect(),
    )];
    for l in 0..layers {
        t.push((
            format!("model.layers.{l}.mlp.up_proj.weight"),
            (0..per_tensor).map(|i| (l * 1000 + i) as f32).collect(),
        ));
    }
    t.push(("model.norm.weight".into(), vec![1.0; 7]));
    let mut rev: Vec<(&str, Vec<f32>)> = t.iter().map(|(n, v)| (n.as_str(), v.clone())).collect();
    rev.reverse();
    write_st(&dir.join("model.safetensors"), &rev);
    t
}

/// Writes the integrity manifest, then flips one byte well inside the data; returns its offset.
fn write_manifest_then_flip_a_byte(dir: &Path) -> usize {
    Manifest::build(&Checkpoint::open(dir).unwrap(), 64 << 10)
        .unwrap()
        .write(dir)
        .unwrap();
    let p = dir.join("model.safetensors");
    let mut bytes = std::fs::read(&p).unwrap();
    let at = bytes.len() / 2;
    bytes[at] ^= 0x40;
    std::fs::write(&p, bytes).unwrap();
    at
}

fn opts(strategy: Strategy, verify: Verify) -> LoadOptions {
    LoadOptions {
        strategy,
        chunk_size: 64 << 10,
        queue_depth: 4,
        threads: 2,
        verify,
        ..LoadOptions::default()
    }
}

#[test]
fn every_strategy_loads_identical_tensors_in_layer_order() {
    let d = tempfile::tempdir().unwrap();
    let tensors = checkpoint(d.path(), 6, 40_000);
    Manifest::build(&Checkpoint::open(d.path()).unwrap(), 64 << 10)
        .unwrap()
        .write(d.path())
        .unwrap();
    for s in STRATEGIES {
        let mut events = vec![];
        let w = HostWeights::load_with(
            Checkpoint::open(d.path()).unwrap(),
            &opts(s, Verify::Required),
            &mut |p| events.push(p),
        )
        .unwrap();
        assert!(w.stats.verified, "{s:?}");
        for (name, want) in &tensors {
            assert_eq!(
                w.tensor(name).unwrap().as_f32().unwrap(),
                &want[..],
                "{s:?} {name}"
            );
        }
        // Layers become ready front to back and all of them do.
        let last = events.last().unwrap();
        assert_eq!(last.layers_ready, last.layers_total, "{s:?}");
        assert!(events
            .windows(2)
            .all(|p| p[0].layers_ready <= p[1].layers_ready));
    }
    // The plan issues reads front to back by layer although the file is written back to front:
    // the embeddings (last in the file) are read first. (When each read *lands* depends on the
    // threads and the disk, so the landing order itself is not asserted.)
    let plan = thaw_loader::LoadPlan::new(&Checkpoint::open(d.path()).unwrap(), 64 << 10);
    assert_eq!(plan.chunks[0].layer, 0);
    assert!(
        plan.chunks[0].file_off > plan.chunks.last().unwrap().file_off,
        "embeddings sit at the end of the file"
    );
    assert!(plan.chunks.windows(2).all(|w| w[0].layer <= w[1].layer));
}

#[test]
fn manifest_mismatch_names_shard_and_range() {
    let d = tempfile::tempdir().unwrap();
    checkpoint(d.path(), 4, 50_000);
    let at = write_manifest_then_flip_a_byte(d.path());
    for s in STRATEGIES {
        let err = HostWeights::load_with(
            Checkpoint::open(d.path()).unwrap(),
            &opts(s, Verify::Auto),
            &mut |_| {},
        )
        .err()
        .unwrap()
        .to_string();
        assert!(
            err.contains("model.safetensors") && err.contains("integrity check failed for bytes"),
            "{s:?}: {err}"
        );
        let range: Vec<u64> = err
            .split("bytes ")
            .nth(1)
            .unwrap()
            .split(':')
            .next()
            .unwrap()
            .split("..")
            .map(|x| x.parse().unwrap())
            .collect();
        assert!(
            range[0] <= at as u64 && (at as u64) < range[1],
            "{s:?}: {at} not in {range:?}"
        );
    }
    // Without verification the same load succeeds (nothing else notices a flipped bit).
    assert!(HostWeights::load_with(
        Checkpoint::open(d.path()).unwrap(),
        &opts(Strategy::Pread, Verify::Off),
        &mut |_| {}
    )
    .is_ok());
}

#[test]
fn shard_that_shrinks_after_open_fails_cleanly() {
    for s in STRATEGIES {
        let d = tempfile::tempdir().unwrap();
        checkpoint(d.path(), 4, 50_000);
        let ck = Checkpoint::open(d.path()).unwrap();
        let p = d.path().join("model.safetensors");
        let len = std::fs::metadata(&p).unwrap().len();
        std::fs::OpenOptions::new()
            .write(true)
            .open(&p)
            .unwrap()
            .set_len(len / 2)
            .unwrap();
        let err = HostWeights::load_with(ck, &opts(s, Verify::Off), &mut |_| {})
            .err()
            .unwrap()
            .to_string();
        assert!(
            err.contains("model.safetensors")
                && (err.contains("shrank") || err.contains("ended during the load")),
            "{s:?}: {err}"
        );
    }
}

#[test]
fn verification_required_without_manifest_is_an_error() {
    let d = tempfile::tempdir().unwrap();
    checkpoint(d.path(), 1, 100);
    let err = HostWeights::load_with(
        Checkpoint::open(d.path()).unwrap(),
        &opts(Strategy::Pread, Verify::Required),
        &mut |_| {},
    )
    .err()
    .unwrap()
    .to_string();
    assert!(err.contains("no thaw-manifest.json"), "{err}");
}

/// tmpfs refuses O_DIRECT: uring-direct must fall back to buffered reads and say why.
#[test]
fn o_direct_refused_falls_back_with_reason() {
    let shm = PathBuf::from("/dev/shm");
    if !shm.is_dir() {
        eprintln!("skipped: no /dev/shm on this machine");
        return;
    }
    let d = tempfile::tempdir_in(&shm).unwrap();
    let tensors = checkpoint(d.path(), 2, 10_000);
    let w = HostWeights::load_with(
        Checkpoint::open(d.path()).unwrap(),
        &opts(Strategy::UringDirect, Verify::Off),
        &mut |_| {},
    )
    .unwrap();
    let fb = w.stats.fallback.clone().unwrap_or_default();
    // Some kernels accept O_DIRECT on tmpfs; then there is nothing to fall back from.
    if w.stats.strategy == "pread" {
        assert!(fb.contains("O_DIRECT"), "{fb}");
    } else {
        assert_eq!(w.stats.strategy, "uring-direct");
    }
    assert_eq!(
        w.tensor(&tensors[1].0).unwrap().as_f32().unwrap(),
        &tensors[1].1[..]
    );
}

#[test]
fn missing_shard_and_bad_index_are_errors() {
    let d = tempfile::tempdir().unwrap();
    checkpoint(d.path(), 1, 10);
    std::fs::rename(
        d.path().join("model.safetensors"),
        d.path().join("model-00001-of-00002.safetensors"),
    )
    .unwrap();
    std::fs::write(
        d.path().join("model.safetensors.index.json"),
        r#"{"weight_map":{"model.norm.weight":"model-00001-of-00002.safetensors","x":"model-00002-of-00002.safetensors"}}"#,
    )
    .unwrap();
    let err = Checkpoint::open(d.path()).err().unwrap().to_string();
    assert!(
        err.contains("model.safetensors.index.json")
            && err.contains("model-00002-of-00002.safetensors")
            && err.contains("does not exist"),
        "{err}"
    );
    std::fs::write(d.path().join("model.safetensors.index.json"), "{not json").unwrap();
    let err = Checkpoint::open(d.path()).err().unwrap().to_string();
    assert!(err.contains("malformed index"), "{err}");
}

/// A streaming load hands out the weights at once; after waiting for each layer group in order,
/// every tensor equals what a blocking load gives, and the reader reports its stats. A corrupt
/// byte (with a manifest) fails the gate for every waiter past it and the reader's result.
#[test]
fn streaming_load_publishes_layers_in_order_and_fails_waiters_on_bad_bytes() {
    let d = tempfile::tempdir().unwrap();
    let tensors = checkpoint(d.path(), 6, 40_000);
    for s in [Strategy::UringDirect, Strategy::Pread, Strategy::Mmap] {
        let st = thaw_loader::load_streaming(
            Checkpoint::open(d.path()).unwrap(),
            &opts(s, Verify::Auto),
        )
        .unwrap();
        let groups = st.gate.groups();
        assert_eq!(groups, 6 + 2, "{s:?}");
        for g in 0..groups {
            st.gate.wait(g).unwrap();
        }
        for (name, want) in &tensors {
            let v = st.weights.tensor(name).unwrap();
            assert_eq!(v.as_f32().unwrap(), &want[..], "{s:?} {name}");
        }
        let stats = st.done.join().unwrap().unwrap();
        assert_eq!(stats.bytes, st.weights.stats.bytes);
    }
    write_manifest_then_flip_a_byte(d.path());
    for s in [Strategy::UringDirect, Strategy::Pread] {
        let st = thaw_loader::load_streaming(
            Checkpoint::open(d.path()).unwrap(),
            &opts(s, Verify::Auto),
        )
        .unwrap();
        let err = st.gate.wait(usize::MAX).unwrap_err();
        assert!(err.contains("integrity check failed"), "{s:?}: {err}");
        assert!(st.done.join().unwrap().is_err());
    }
}
