//! The staging ring the CUDA loader uses (`thaw_loader::StagingRing`), exercised with a fake copy
//! engine whose copies are asynchronous: two staging buffers, each copied to the "device" (a Vec)
//! after its chunk lands, and refilled only once that copy is done.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Mutex};

mod common;
use common::Done;

use thaw_loader::plan::LoadPlan;
use thaw_loader::read::load_into;
use thaw_loader::{AlignedBuf, CopyEngine, LoadError, LoadOptions, StagingRing, Strategy, Verify};

/// A fake device: copies run on a worker thread after a short delay (like a copy stream), into
/// plain vectors. Each copy checks that its source bytes did not change between the request and
/// the copy — i.e. that the ring never refilled a buffer whose copy was still pending.
struct FakeGpu {
    device: Arc<Mutex<Vec<Vec<u8>>>>,
    jobs: Mutex<mpsc::Sender<Job>>,
    copies: Arc<AtomicUsize>,
    overwritten: Arc<AtomicUsize>,
    order: Arc<Mutex<Vec<(usize, u64)>>>,
}

struct Job {
    src: usize,
    len: usize,
    shard: usize,
    dst: u64,
    sum: u64,
    done: Done,
}

fn sum(p: usize, len: usize) -> u64 {
    // SAFETY: the test hands valid staging buffers of at least `len` bytes.
    let b = unsafe { std::slice::from_raw_parts(p as *const u8, len) };
    b.iter().enumerate().fold(0u64, |a, (i, &x)| {
        a.wrapping_mul(31).wrapping_add(x as u64 ^ i as u64)
    })
}

impl FakeGpu {
    fn new() -> FakeGpu {
        let (tx, rx) = mpsc::channel::<Job>();
        let device: Arc<Mutex<Vec<Vec<u8>>>> = Default::default();
        let (copies, overwritten) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
        let order: Arc<Mutex<Vec<(usize, u64)>>> = Default::default();
        let (d, c, o, ord) = (
            device.clone(),
            copies.clone(),
            overwritten.clone(),
            order.clone(),
        );
        std::thread::spawn(move || {
            for j in rx {
                std::thread::sleep(std::time::Duration::from_micros(300));
                if sum(j.src, j.len) != j.sum {
                    o.fetch_add(1, Ordering::SeqCst);
                }
                // SAFETY: as in `sum`.
                let src = unsafe { std::slice::from_raw_parts(j.src as *const u8, j.len) };
                d.lock().unwrap()[j.shard][j.dst as usize..j.dst as usize + j.len]
                    .copy_from_slice(src);
                c.fetch_add(1, Ordering::SeqCst);
                ord.lock().unwrap().push((j.shard, j.dst));
                common::signal(&j.done);
            }
        });
        FakeGpu {
            device,
            jobs: Mutex::new(tx),
            copies,
            overwritten,
            order,
        }
    }
}

impl CopyEngine for FakeGpu {
    type Event = Done;
    fn prepare(&mut self, plan: &LoadPlan) -> Result<(), LoadError> {
        *self.device.lock().unwrap() = common::device_for(plan);
        Ok(())
    }
    unsafe fn copy(
        &self,
        src: *const u8,
        len: usize,
        shard: usize,
        dst: u64,
    ) -> Result<Done, LoadError> {
        let done = common::done();
        let job = Job {
            src: src as usize,
            len,
            shard,
            dst,
            sum: sum(src as usize, len),
            done: done.clone(),
        };
        self.jobs.lock().unwrap().send(job).unwrap();
        Ok(done)
    }
    fn wait(&self, ev: Done) -> Result<(), LoadError> {
        common::wait(&ev);
        Ok(())
    }
}

#[test]
fn staging_ring_reuses_buffers_and_reassembles_every_byte() {
    let d = tempfile::tempdir().unwrap();
    // Two shards of awkward sizes (partial tail chunks), tensors in layer order.
    let ck = common::two_shards(d.path());
    for strategy in [Strategy::UringDirect, Strategy::Pread] {
        let bufs = vec![AlignedBuf::zeroed(64 << 10), AlignedBuf::zeroed(64 << 10)];
        let mut ring = StagingRing::new(bufs, FakeGpu::new());
        let opts = LoadOptions {
            strategy,
            chunk_size: 64 << 10,
            queue_depth: 8,
            threads: 4,
            verify: Verify::Required,
        };
        let (plan, stats) = load_into(&ck, &opts, &mut ring, &mut |_| {}).unwrap();
        ring.finish().unwrap();
        assert!(stats.verified);
        let gpu = ring.into_engine();
        assert_eq!(gpu.copies.load(Ordering::SeqCst), plan.chunks.len());
        assert!(plan.chunks.len() > 4, "buffers must be reused");
        assert_eq!(
            gpu.overwritten.load(Ordering::SeqCst),
            0,
            "{strategy:?}: a buffer was refilled while its copy was pending"
        );
        // Every tensor's bytes arrived at its place on the "device" (partial tails included).
        common::assert_on_device(&plan, &gpu.device.lock().unwrap(), &format!("{strategy:?}"));
        // Copies were issued in the order chunks landed; with io_uring the first is layer 0's.
        let order = gpu.order.lock().unwrap();
        assert_eq!(order.len(), plan.chunks.len());
        if strategy == Strategy::UringDirect {
            let first = plan
                .chunks
                .iter()
                .find(|c| (c.shard, c.device_off(&plan)) == order[0])
                .unwrap();
            assert_eq!(first.layer, 0);
        }
    }
    // `auto` on a checkpoint just written (resident in the page cache) reads it with buffered
    // preads: O_DIRECT would fetch from the disk what memory already holds.
    let resident = thaw_loader::read::resident_fraction(&thaw_loader::LoadPlan::new(&ck, 64 << 10));
    let bufs = vec![AlignedBuf::zeroed(64 << 10), AlignedBuf::zeroed(64 << 10)];
    let mut ring = StagingRing::new(bufs, FakeGpu::new());
    let opts = LoadOptions {
        chunk_size: 64 << 10,
        ..LoadOptions::default()
    };
    let (_, stats) = load_into(&ck, &opts, &mut ring, &mut |_| {}).unwrap();
    ring.finish().unwrap();
    eprintln!("resident fraction after writing: {resident}");
    if resident >= 0.9 {
        assert_eq!(stats.strategy, "pread", "resident {resident}");
    } else {
        assert_eq!(stats.strategy, "uring-direct", "resident {resident}");
    }
    // Buffers smaller than a chunk: a clear error before any read.
    let mut ring = StagingRing::new(vec![AlignedBuf::zeroed(4096)], FakeGpu::new());
    let opts = LoadOptions {
        chunk_size: 64 << 10,
        ..LoadOptions::default()
    };
    let e = load_into(&ck, &opts, &mut ring, &mut |_| {})
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("cannot hold chunks"), "{e}");
}
