//! The staging ring the CUDA loader uses (`thaw_loader::StagingRing`), exercised with a fake copy
//! engine whose copies are asynchronous: two staging buffers, each copied to the "device" (a Vec)
//! after its chunk lands, and refilled only once that copy is done.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

mod common;
use common::fake_gpu::FakeGpu;

use thaw_loader::read::load_into;
use thaw_loader::{AlignedBuf, LoadError, LoadOptions, StagingRing, Strategy, Verify};

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
            ..LoadOptions::default()
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
    let e = load_error(&ck, &mut ring, Strategy::Auto);
    assert!(e.contains("cannot hold chunks"), "{e}");
}

/// The error of a load of `ck` in 64 KiB chunks into `ring`.
fn load_error(
    ck: &thaw_loader::Checkpoint,
    ring: &mut StagingRing<AlignedBuf, FakeGpu>,
    strategy: Strategy,
) -> String {
    let opts = LoadOptions {
        strategy,
        chunk_size: 64 << 10,
        threads: 2,
        ..LoadOptions::default()
    };
    match load_into(ck, &opts, ring, &mut |_| {}) {
        Ok(_) => panic!("the load must fail"),
        Err(e) => e.to_string(),
    }
}

/// A background ring allocates its buffers on threads of its own from the moment it is made,
/// and a read waits only while no buffer is ready: here buffer i takes i × 60 ms to make, and
/// the load (a few milliseconds of reads and fake copies) finishes on the first buffers while
/// the last is still being made — before, all of them preceded the first read. Every byte
/// still lands and no buffer is refilled under a pending copy; a failing allocation fails the
/// load with its error; buffers smaller than a chunk are refused before any read.
#[test]
fn a_background_ring_starts_reading_before_its_buffers_are_all_made() {
    let d = tempfile::tempdir().unwrap();
    let ck = common::two_shards(d.path());
    let caller = std::thread::current().id();
    for strategy in [Strategy::Pread, Strategy::UringDirect] {
        let makers: Arc<Mutex<Vec<std::thread::ThreadId>>> = Default::default();
        let (m, next) = (makers.clone(), Arc::new(AtomicUsize::new(0)));
        let make: thaw_loader::staging::MakeBuf<AlignedBuf> = Arc::new(move || {
            let i = next.fetch_add(1, Ordering::SeqCst);
            std::thread::sleep(std::time::Duration::from_millis(60 * i as u64));
            m.lock().unwrap().push(std::thread::current().id());
            Ok(AlignedBuf::zeroed(64 << 10))
        });
        let mut ring = StagingRing::background(4, 64 << 10, make, FakeGpu::new());
        let opts = LoadOptions {
            strategy,
            chunk_size: 64 << 10,
            queue_depth: 8,
            threads: 3,
            verify: Verify::Required,
            ..LoadOptions::default()
        };
        let (plan, stats) = load_into(&ck, &opts, &mut ring, &mut |_| {}).unwrap();
        ring.finish().unwrap();
        let what = format!("{strategy:?}");
        let made_during_load = ring.buffers_created();
        assert!(stats.verified);
        assert!(
            made_during_load < 4,
            "{what}: the load waited for every buffer"
        );
        assert!(
            plan.chunks.len() > made_during_load,
            "buffers must be reused"
        );
        ring.allocations_done();
        assert_eq!(ring.buffers_created(), 4, "{what}");
        let made = makers.lock().unwrap().clone();
        assert!(!made.contains(&caller), "{what}: {made:?}");
        assert!(
            ring.first_buffer_s() < 0.06,
            "{what}: {}",
            ring.first_buffer_s()
        );
        let gpu = ring.into_engine();
        assert_eq!(gpu.copies.load(Ordering::SeqCst), plan.chunks.len());
        assert_eq!(gpu.overwritten.load(Ordering::SeqCst), 0, "{what}");
        common::assert_on_device(&plan, &gpu.device.lock().unwrap(), &what);
    }
    // The second allocation fails at once, the first takes 100 ms: the load fails with the
    // allocator's error (instead of running on fewer buffers than its readers were promised).
    let next = Arc::new(AtomicUsize::new(0));
    let make: thaw_loader::staging::MakeBuf<AlignedBuf> = Arc::new(move || {
        if next.fetch_add(1, Ordering::SeqCst) == 1 {
            return Err(LoadError::invalid(
                std::path::Path::new("pinned"),
                "out of pinned memory".to_string(),
            ));
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
        Ok(AlignedBuf::zeroed(64 << 10))
    });
    let mut ring = StagingRing::background(2, 64 << 10, make, FakeGpu::new());
    let e = load_error(&ck, &mut ring, Strategy::Pread);
    assert!(e.contains("out of pinned memory"), "{e}");
    // Buffers smaller than chunks: refused before any read.
    let make: thaw_loader::staging::MakeBuf<AlignedBuf> = Arc::new(|| Ok(AlignedBuf::zeroed(4096)));
    let mut ring = StagingRing::background(4, 4096, make, FakeGpu::new());
    let e = load_error(&ck, &mut ring, Strategy::Auto);
    assert!(e.contains("cannot hold chunks"), "{e}");
}
