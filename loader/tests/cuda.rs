//! The CUDA destination on a real GPU: a checkpoint with awkward sizes goes through the pinned
//! staging ring, and pinned in place from the page cache, into device memory and comes back byte
//! for byte. Skips (with a message)
//! where there is no CUDA driver; runs in `scripts/gpu-check.sh`.
#![cfg(feature = "cuda")]

use thaw_loader::{Checkpoint, LoadOptions, Strategy, Verify};

#[test]
fn checkpoint_reaches_device_memory_intact() {
    // SAFETY: only probes whether libcuda can be opened.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        eprintln!("skipped: no CUDA driver on this machine");
        return;
    }
    let ctx = match cudarc::driver::CudaContext::new(0) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("skipped: no usable CUDA device ({e})");
            return;
        }
    };
    let d = tempfile::tempdir().unwrap();
    let mut header = serde_json::Map::new();
    let (a, b) = (300_001usize, 123_457usize);
    header.insert(
        "model.embed_tokens.weight".into(),
        serde_json::json!({"dtype": "U8", "shape": [a], "data_offsets": [0, a]}),
    );
    header.insert(
        "model.layers.0.w".into(),
        serde_json::json!({"dtype": "U8", "shape": [b], "data_offsets": [a, a + b]}),
    );
    let h = serde_json::to_string(&header).unwrap();
    let mut bytes = (h.len() as u64).to_le_bytes().to_vec();
    bytes.extend(h.as_bytes());
    bytes.extend((0..a + b).map(|i| (i * 7 + 3) as u8));
    std::fs::write(d.path().join("model.safetensors"), &bytes).unwrap();
    let ck = Checkpoint::open(d.path()).unwrap();
    // Through the staging ring (io_uring reads; its pinned buffers allocated in the background,
    // then up front with preads), then pinned in place from the page cache (the file was just
    // written: resident).
    for (strategy, pin_in_place, pinned_up_front) in [
        (Strategy::UringDirect, false, false),
        (Strategy::Pread, false, true),
        (Strategy::Mmap, true, false),
    ] {
        let opts = LoadOptions {
            strategy,
            chunk_size: 64 << 10,
            verify: Verify::Off,
            ..LoadOptions::default()
        };
        let l = thaw_loader::cuda::load_to_device(
            &ck,
            &opts,
            &ctx,
            thaw_loader::cuda::Staging {
                buffers: 3,
                write_combined: false,
                pin_in_place,
                pin_depth: 2,
                pinned_up_front,
            },
        )
        .unwrap();
        eprintln!(
            "{strategy:?}, pin in place {pin_in_place}: loaded as {} (fallback: {:?})",
            l.stats.strategy, l.stats.fallback
        );
        assert_eq!(
            l.mapped.is_some(),
            pin_in_place && l.stats.fallback.is_none()
        );
        let stream = ctx.default_stream();
        let back = stream.clone_dtoh(&l.shards[0]).unwrap();
        let s = &l.plan.shards[0];
        let data = &bytes[s.data_start as usize..(s.data_start + s.data_len) as usize];
        let off = s.device_data_offset() as usize;
        assert_eq!(off as u64 % thaw_loader::plan::DEVICE_ALIGN, 0);
        assert_eq!(&back[off..off + data.len()], data, "{strategy:?}");
    }
}
