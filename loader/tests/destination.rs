//! The `Destination` seam the CUDA loader plugs into, exercised with a fake copy engine: a ring
//! of two staging buffers, each "copied to the device" (a Vec) when its chunk lands, then reused.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

use thaw_loader::plan::{Chunk, LoadPlan};
use thaw_loader::read::load_into;
use thaw_loader::{
    AlignedBuf, Checkpoint, Destination, LoadError, LoadOptions, Manifest, Strategy, Verify,
};

struct StagingRing {
    bufs: Vec<Mutex<AlignedBuf>>,
    ptrs: Vec<usize>,
    free: Mutex<Vec<usize>>,
    owner: Mutex<std::collections::HashMap<usize, usize>>,
    device: Mutex<Vec<Vec<u8>>>,
    aligned_start: Vec<u64>,
    out: AtomicUsize,
    max_out: AtomicUsize,
    regions: AtomicUsize,
    order: Mutex<Vec<usize>>,
}

impl StagingRing {
    fn new(n: usize, size: usize) -> StagingRing {
        let mut bufs: Vec<AlignedBuf> = (0..n).map(|_| AlignedBuf::zeroed(size)).collect();
        let ptrs = bufs
            .iter_mut()
            .map(|b| b.as_mut_slice().as_mut_ptr() as usize)
            .collect();
        StagingRing {
            bufs: bufs.into_iter().map(Mutex::new).collect(),
            ptrs,
            free: Mutex::new((0..n).collect()),
            owner: Default::default(),
            device: Default::default(),
            aligned_start: vec![],
            out: AtomicUsize::new(0),
            max_out: AtomicUsize::new(0),
            regions: AtomicUsize::new(0),
            order: Default::default(),
        }
    }
}

impl Destination for StagingRing {
    fn prepare(&mut self, plan: &LoadPlan) -> Result<(), LoadError> {
        *self.device.lock().unwrap() = plan
            .shards
            .iter()
            .map(|s| vec![0u8; s.aligned_len as usize])
            .collect();
        self.aligned_start = plan.shards.iter().map(|s| s.aligned_start).collect();
        Ok(())
    }
    fn max_regions(&self) -> usize {
        self.bufs.len()
    }
    fn region(&self, i: usize, _c: &Chunk) -> Result<*mut u8, LoadError> {
        let b = self
            .free
            .lock()
            .unwrap()
            .pop()
            .expect("a region was requested with every staging buffer in use");
        self.owner.lock().unwrap().insert(i, b);
        let now = self.out.fetch_add(1, Ordering::SeqCst) + 1;
        self.max_out.fetch_max(now, Ordering::SeqCst);
        self.regions.fetch_add(1, Ordering::SeqCst);
        Ok(self.ptrs[b] as *mut u8)
    }
    fn landed(&self, i: usize, c: &Chunk, len: u64) -> Result<(), LoadError> {
        let b = self
            .owner
            .lock()
            .unwrap()
            .remove(&i)
            .expect("landed without a region");
        let off = (c.file_off - self.aligned_start[c.shard]) as usize;
        {
            let buf = self.bufs[b].lock().unwrap();
            self.device.lock().unwrap()[c.shard][off..off + len as usize]
                .copy_from_slice(&buf.as_slice()[..len as usize]);
        }
        self.order.lock().unwrap().push(i);
        self.out.fetch_sub(1, Ordering::SeqCst);
        self.free.lock().unwrap().push(b);
        Ok(())
    }
}

#[test]
fn staging_ring_reuses_buffers_and_reassembles_every_byte() {
    let d = tempfile::tempdir().unwrap();
    // Two shards of awkward sizes (partial tail chunks), tensors in layer order.
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
        std::fs::write(d.path().join(name), bytes).unwrap();
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
        d.path().join("model.safetensors.index.json"),
        r#"{"weight_map":{"model.embed_tokens.weight":"model-00001-of-00002.safetensors","model.layers.0.w":"model-00001-of-00002.safetensors","model.layers.1.w":"model-00002-of-00002.safetensors","model.norm.weight":"model-00002-of-00002.safetensors"}}"#,
    )
    .unwrap();
    let ck = Checkpoint::open(d.path()).unwrap();
    Manifest::build(&ck, 64 << 10)
        .unwrap()
        .write(d.path())
        .unwrap();
    for strategy in [Strategy::UringDirect, Strategy::Pread] {
        let mut ring = StagingRing::new(2, 64 << 10);
        let opts = LoadOptions {
            strategy,
            chunk_size: 64 << 10,
            queue_depth: 8,
            threads: 4,
            verify: Verify::Required,
        };
        let (plan, stats) = load_into(&ck, &opts, &mut ring, &mut |_| {}).unwrap();
        assert!(stats.verified);
        assert!(
            ring.max_out.load(Ordering::SeqCst) <= 2,
            "{strategy:?}: more regions out than buffers"
        );
        assert_eq!(ring.regions.load(Ordering::SeqCst), plan.chunks.len());
        assert!(plan.chunks.len() > 4, "buffers must be reused");
        // Every tensor's bytes arrived at its place on the "device".
        let device = ring.device.lock().unwrap();
        for (si, s) in plan.shards.iter().enumerate() {
            let file = std::fs::read(&s.path).unwrap();
            let data = &file[s.data_start as usize..(s.data_start + s.data_len) as usize];
            let off = s.data_offset() as usize;
            assert_eq!(
                &device[si][off..off + data.len()],
                data,
                "{strategy:?} shard {si}"
            );
        }
        // Layer 0's chunks were issued first (pread lands in any order; uring in issue order).
        let order = ring.order.lock().unwrap();
        assert_eq!(order.len(), plan.chunks.len());
        if strategy == Strategy::UringDirect {
            assert_eq!(plan.chunks[order[0]].layer, 0);
        }
    }
}
