//! Pieces the fake-device tests share (`destination.rs`, `mapped.rs`): a sharded checkpoint of
//! awkward sizes with a manifest, the "device" a fake engine copies into, and its copy events.

use std::sync::{Arc, Condvar, Mutex};

// Each test file uses a part of these helpers.
#[allow(dead_code)]
pub mod fake_gpu;

use thaw_loader::plan::LoadPlan;
use thaw_loader::{Checkpoint, Manifest};

/// A fake copy's completion: set when the copy is done.
pub type Done = Arc<(Mutex<bool>, Condvar)>;

pub fn done() -> Done {
    Arc::new((Mutex::new(false), Condvar::new()))
}

/// Marks `d` complete and wakes its waiters.
pub fn signal(d: &Done) {
    let (m, cv) = &**d;
    *m.lock().unwrap() = true;
    cv.notify_all();
}

/// Blocks until `d` is complete.
pub fn wait(d: &Done) {
    let (m, cv) = &**d;
    let mut g = m.lock().unwrap();
    while !*g {
        g = cv.wait(g).unwrap();
    }
}

/// The fake device's memory for `plan`: one zeroed region per shard, `device_len()` bytes each.
pub fn device_for(plan: &LoadPlan) -> Vec<Vec<u8>> {
    plan.shards
        .iter()
        .map(|s| vec![0u8; s.device_len() as usize])
        .collect()
}

/// Every shard's data section arrived whole in `device` (the fake device's memory), starting on
/// a `DEVICE_ALIGN` boundary of its region — also where the file has it off such a boundary
/// (this fixture's headers end at odd offsets, so the arenas must shift them).
pub fn assert_on_device(plan: &LoadPlan, device: &[Vec<u8>], what: &str) {
    use thaw_loader::plan::DEVICE_ALIGN;
    assert!(
        plan.shards.iter().any(|s| s.device_lead() != 0),
        "the fixture should need a shift"
    );
    for (si, s) in plan.shards.iter().enumerate() {
        let file = std::fs::read(&s.path).unwrap();
        let data = &file[s.data_start as usize..(s.data_start + s.data_len) as usize];
        let off = s.device_data_offset() as usize;
        assert_eq!(
            off as u64 % DEVICE_ALIGN,
            0,
            "{what} shard {si}: data at {off}"
        );
        assert_eq!(
            &device[si][off..off + data.len()],
            data,
            "{what} shard {si}"
        );
    }
}

/// Two shards of awkward sizes (partial last chunks), tensors in layer order, with a manifest
/// of 64 KiB chunks, written into `d`.
pub fn two_shards(d: &std::path::Path) -> Checkpoint {
    let mk = |name: &str, tensors: &[(&str, usize)]| {
        let mut header = serde_json::Map::new();
        let mut off = 0usize;
        for (n, len) in tensors {
            header.insert(n.to_string(), serde_json::json!({"dtype": "U8", "shape": [len], "data_offsets": [off, off + len]}));
            off += len;
        }
        let h = serde_json::to_string(&header).unwrap();
        let mut bytes = (h.len() as u64).to_le_bytes().to_vec();
        bytes.extend(h.as_bytes());
        bytes.extend((0..off).map(|i| (i * 7 + name.len()) as u8));
        std::fs::write(d.join(name), bytes).unwrap();
    };
    mk(
        "model-00001-of-00002.safetensors",
        &[
            ("model.embed_tokens.weight", 300_001),
            ("model.layers.0.w", 123_457),
        ],
    );
    mk(
        "model-00002-of-00002.safetensors",
        &[("model.layers.1.w", 200_003), ("model.norm.weight", 99)],
    );
    std::fs::write(
        d.join("model.safetensors.index.json"),
        r#"{"weight_map":{"model.embed_tokens.weight":"model-00001-of-00002.safetensors","model.layers.0.w":"model-00001-of-00002.safetensors","model.layers.1.w":"model-00002-of-00002.safetensors","model.norm.weight":"model-00002-of-00002.safetensors"}}"#,
    )
    .unwrap();
    let ck = Checkpoint::open(d).unwrap();
    Manifest::build(&ck, 64 << 10).unwrap().write(d).unwrap();
    ck
}
