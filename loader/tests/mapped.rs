//! Loading from the page cache by pinning mapped pages in place (`thaw_loader::copy_mapped`, what
//! the CUDA loader does for a resident checkpoint), exercised with a fake device whose copies are
//! asynchronous. The fake checks what the real driver would not forgive: a copy only from pinned
//! pages, an unpin only after every copy from those pages completed, pins on page boundaries —
//! and that nothing stays pinned, whether the load succeeds or fails half-way.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Mutex};

mod common;
use common::Done;

use thaw_loader::plan::LoadPlan;
use thaw_loader::PinInPlace;
use thaw_loader::{copy_mapped, map_shards, Checkpoint, CopyEngine, LoadError, Manifest};

/// A queued copy: source, length, shard, destination offset, the pin it reads, its event.
type CopyJob = (usize, usize, usize, u64, usize, Done);

#[derive(Default)]
struct Pins {
    /// Pinned start → (length, copies from it not yet completed).
    live: HashMap<usize, (usize, usize)>,
    most: usize,
    violations: Vec<String>,
}

struct FakeDevice {
    device: Arc<Mutex<Vec<Vec<u8>>>>,
    pins: Arc<Mutex<Pins>>,
    jobs: Mutex<mpsc::Sender<CopyJob>>,
    /// Refuse the pin after this many (to test failure half-way).
    refuse_after: Option<usize>,
    pinned_total: AtomicUsize,
}

impl FakeDevice {
    fn new(refuse_after: Option<usize>) -> FakeDevice {
        let (tx, rx) = mpsc::channel::<CopyJob>();
        let device: Arc<Mutex<Vec<Vec<u8>>>> = Default::default();
        let pins: Arc<Mutex<Pins>> = Default::default();
        let (d, p) = (device.clone(), pins.clone());
        std::thread::spawn(move || {
            for (src, len, shard, dst, pin, done) in rx {
                std::thread::sleep(std::time::Duration::from_micros(200));
                // SAFETY: `copy` checked the range lies in a live pin of a live mapping, and
                // an unpin before this completes is recorded as a violation.
                let bytes = unsafe { std::slice::from_raw_parts(src as *const u8, len) };
                d.lock().unwrap()[shard][dst as usize..dst as usize + len].copy_from_slice(bytes);
                if let Some(e) = p.lock().unwrap().live.get_mut(&pin) {
                    e.1 -= 1;
                }
                common::signal(&done);
            }
        });
        FakeDevice {
            device,
            pins,
            jobs: Mutex::new(tx),
            refuse_after,
            pinned_total: AtomicUsize::new(0),
        }
    }
}

impl CopyEngine for FakeDevice {
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
        let mut pins = self.pins.lock().unwrap();
        let s = src as usize;
        let pin = pins
            .live
            .iter()
            .find(|(&p, &(l, _))| s >= p && s + len <= p + l)
            .map(|(&p, _)| p);
        let Some(pin) = pin else {
            pins.violations.push(format!(
                "copy of {len} bytes at {s:#x} from unpinned memory"
            ));
            return Err(LoadError::invalid(
                std::path::Path::new("fake"),
                "unpinned copy",
            ));
        };
        pins.live.get_mut(&pin).unwrap().1 += 1;
        let done = common::done();
        self.jobs
            .lock()
            .unwrap()
            .send((s, len, shard, dst, pin, done.clone()))
            .unwrap();
        Ok(done)
    }
    fn wait(&self, ev: Done) -> Result<(), LoadError> {
        common::wait(&ev);
        Ok(())
    }
}

impl PinInPlace for FakeDevice {
    unsafe fn pin(&self, ptr: *const u8, len: usize) -> Result<(), LoadError> {
        let n = self.pinned_total.fetch_add(1, Ordering::SeqCst);
        if self.refuse_after.is_some_and(|k| n >= k) {
            return Err(LoadError::invalid(
                std::path::Path::new("fake"),
                "pin refused",
            ));
        }
        let mut pins = self.pins.lock().unwrap();
        if !(ptr as usize).is_multiple_of(4096) || !len.is_multiple_of(4096) {
            pins.violations
                .push(format!("pin of {len} bytes at {ptr:?} not on pages"));
        }
        pins.live.insert(ptr as usize, (len, 0));
        pins.most = pins.most.max(pins.live.len());
        Ok(())
    }
    unsafe fn unpin(&self, ptr: *const u8) -> Result<(), LoadError> {
        let mut pins = self.pins.lock().unwrap();
        match pins.live.remove(&(ptr as usize)) {
            Some((_, 0)) => {}
            Some((_, n)) => pins
                .violations
                .push(format!("unpin at {ptr:?} with {n} copies in flight")),
            None => pins
                .violations
                .push(format!("unpin at {ptr:?} of nothing pinned")),
        }
        Ok(())
    }
}

fn expected(ck: &Checkpoint, plan: &LoadPlan) -> Vec<String> {
    Manifest::read(&ck.dir)
        .unwrap()
        .unwrap()
        .expected(plan, &ck.dir)
        .unwrap()
}

impl FakeDevice {
    /// Nothing the driver would refuse happened, and nothing is left pinned.
    fn assert_clean(&self) {
        let pins = self.pins.lock().unwrap();
        assert!(pins.violations.is_empty(), "{:?}", pins.violations);
        assert!(pins.live.is_empty(), "left pinned: {:?}", pins.live);
    }
}

#[test]
fn pinned_in_place_every_byte_arrives_and_nothing_stays_pinned() {
    let d = tempfile::tempdir().unwrap();
    let ck = common::two_shards(d.path());
    let plan = LoadPlan::new(&ck, 64 << 10);
    let want = expected(&ck, &plan);
    let maps = map_shards(&plan).unwrap();
    for (threads, depth) in [(1, 1), (3, 2), (4, 4)] {
        let mut dev = FakeDevice::new(None);
        dev.prepare(&plan).unwrap();
        let stats = copy_mapped(&plan, &maps, Some(&want), &dev, threads, depth).unwrap();
        assert_eq!(stats.threads, threads);
        dev.assert_clean();
        let pins = dev.pins.lock().unwrap();
        assert!(
            pins.most <= threads * depth,
            "{} pinned at once > {threads}×{depth}",
            pins.most
        );
        assert_eq!(dev.pinned_total.load(Ordering::SeqCst), plan.chunks.len());
        let what = format!("{threads}×{depth}");
        common::assert_on_device(&plan, &dev.device.lock().unwrap(), &what);
    }
}

#[test]
fn a_corrupt_chunk_or_a_refused_pin_fails_the_load_and_unpins_everything() {
    let d = tempfile::tempdir().unwrap();
    let ck = common::two_shards(d.path());
    let plan = LoadPlan::new(&ck, 64 << 10);
    let mut want = expected(&ck, &plan);
    let maps = map_shards(&plan).unwrap();

    // The driver refuses the fourth pin: the error comes back, earlier pins are undone after
    // their copies.
    let mut dev = FakeDevice::new(Some(3));
    dev.prepare(&plan).unwrap();
    let e = copy_mapped(&plan, &maps, Some(&want), &dev, 2, 2).unwrap_err();
    assert!(e.to_string().contains("pin refused"), "{e}");
    dev.assert_clean();

    // A chunk that does not match the manifest is never copied; the load names it.
    let bad = plan.chunks.len() / 2;
    want[bad] = "0000000000000000".into();
    let mut dev = FakeDevice::new(None);
    dev.prepare(&plan).unwrap();
    let e = copy_mapped(&plan, &maps, Some(&want), &dev, 3, 2).unwrap_err();
    assert!(e.to_string().contains("integrity check failed"), "{e}");
    dev.assert_clean();
}

#[test]
fn a_file_shorter_than_its_header_is_refused_before_mapping() {
    let d = tempfile::tempdir().unwrap();
    let ck = common::two_shards(d.path());
    let plan = LoadPlan::new(&ck, 64 << 10);
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(&plan.shards[1].path)
        .unwrap();
    f.set_len(plan.shards[1].data_start + 1000).unwrap();
    let e = map_shards(&plan).unwrap_err();
    assert!(e.to_string().contains("shrank"), "{e}");
}
