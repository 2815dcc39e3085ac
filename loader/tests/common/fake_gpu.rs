//! A fake device for the staging ring: asynchronous copies into plain vectors.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Mutex};

use thaw_loader::plan::LoadPlan;
use thaw_loader::{CopyEngine, LoadError};

use super::Done;

/// A fake device: copies run on a worker thread after a short delay (like a copy stream), into
/// plain vectors. Each copy checks that its source bytes did not change between the request and
/// the copy — i.e. that the ring never refilled a buffer whose copy was still pending.
pub struct FakeGpu {
    pub device: Arc<Mutex<Vec<Vec<u8>>>>,
    pub jobs: Mutex<mpsc::Sender<Job>>,
    pub copies: Arc<AtomicUsize>,
    pub overwritten: Arc<AtomicUsize>,
    pub order: Arc<Mutex<Vec<(usize, u64)>>>,
}

pub struct Job {
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
    pub fn new() -> FakeGpu {
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
                super::signal(&j.done);
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
        *self.device.lock().unwrap() = super::device_for(plan);
        Ok(())
    }
    unsafe fn copy(
        &self,
        src: *const u8,
        len: usize,
        shard: usize,
        dst: u64,
    ) -> Result<Done, LoadError> {
        let done = super::done();
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
        super::wait(&ev);
        Ok(())
    }
}
