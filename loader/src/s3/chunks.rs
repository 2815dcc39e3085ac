//! A remote checkpoint's chunks, by ranged GETs into the destination's regions.

use std::sync::Arc;

use super::client::{Client, S3Config};
use super::{runtime, Remote};
use crate::dest::Destination;
use crate::plan::LoadPlan;
use crate::LoadError;

type Done = (usize, usize, Result<(), LoadError>);

/// A GET task's result, sent when the task ends however it ends: a task that panicked still
/// reports (an error), so the loop waiting for it never hangs.
struct Report {
    tx: std::sync::mpsc::Sender<Done>,
    i: usize,
    ptr: usize,
    result: Option<Result<(), LoadError>>,
}

impl Drop for Report {
    fn drop(&mut self) {
        let r = self.result.take().unwrap_or_else(|| {
            Err(LoadError::Remote {
                url: format!("chunk {}", self.i),
                msg: "its request ended without a result".into(),
            })
        });
        let _ = self.tx.send((self.i, self.ptr, r));
    }
}

/// What [`load_chunks`] calls with (chunk index, bytes, the bytes) as each chunk arrives.
pub(crate) type OnLanded<'a> = dyn FnMut(usize, u64, &[u8]) -> Result<(), LoadError> + 'a;

/// Reads every chunk of `plan` from `remote` into `dest` (see the module docs): GETs issued in
/// plan order, at most `opts.queue_depth` in flight; `on_landed(i, len, buf)` runs on this
/// thread for each chunk as it arrives (length check, hash, `dest.landed`, progress).
pub(crate) fn load_chunks(
    plan: &LoadPlan,
    remote: &Remote,
    opts: &crate::LoadOptions,
    dest: &dyn Destination,
    on_landed: &mut OnLanded,
) -> Result<(), LoadError> {
    let rt = runtime(opts.threads)?;
    let cfg = opts.s3.clone().unwrap_or_else(S3Config::from_env);
    let client = Arc::new(Client::new(cfg)?);
    let depth = opts.queue_depth.clamp(1, dest.max_regions());
    let (tx, rx) = std::sync::mpsc::channel::<Done>();
    let mut next = 0usize;
    let mut in_flight = 0usize;
    let mut failure: Option<LoadError> = None;
    while failure.is_none() && (next < plan.chunks.len() || in_flight > 0) {
        while next < plan.chunks.len() && in_flight < depth {
            let i = next;
            let c = &plan.chunks[i];
            let s = &plan.shards[c.shard];
            let name = s
                .path
                .file_name()
                .map(|n| n.to_string_lossy().to_string())
                .unwrap_or_default();
            let shard = match remote.shard(&name) {
                Some(sh) => sh,
                None => {
                    failure = Some(LoadError::invalid(&s.path, "not in the remote listing"));
                    break;
                }
            };
            let len = c.len.min(s.file_len.saturating_sub(c.file_off)) as usize;
            dest.prefault(i, c);
            let ptr = match dest.region(i, c) {
                Ok(p) => p as usize,
                Err(e) => {
                    failure = Some(e);
                    break;
                }
            };
            let (client, tx) = (client.clone(), tx.clone());
            let (bucket, key) = (remote.url.bucket.clone(), remote.url.key(&name));
            let etag = (!shard.etag.is_empty()).then(|| shard.etag.clone());
            let off = c.file_off;
            rt.spawn(async move {
                let mut report = Report {
                    tx,
                    i,
                    ptr,
                    result: None,
                };
                // SAFETY: the destination gives chunk i's region (c.len ≥ len bytes) to this
                // load alone until `landed(i)`, which runs only after this task has sent its
                // result; a failed load drops the runtime (cancelling this task at an await,
                // never mid-copy) before the region's memory can go away.
                let buf = unsafe { std::slice::from_raw_parts_mut(ptr as *mut u8, len) };
                let r = client
                    .get_into(&bucket, &key, off, buf, etag.as_deref())
                    .await;
                report.result = Some(r);
            });
            next += 1;
            in_flight += 1;
        }
        if in_flight == 0 {
            break;
        }
        let Ok((i, ptr, r)) = rx.recv() else { break };
        in_flight -= 1;
        let c = &plan.chunks[i];
        let s = &plan.shards[c.shard];
        let len = c.len.min(s.file_len.saturating_sub(c.file_off));
        let r = r.and_then(|()| {
            // SAFETY: the task that filled this region has finished with it (it sent its result).
            let buf = unsafe { std::slice::from_raw_parts(ptr as *const u8, len as usize) };
            on_landed(i, len, buf)
        });
        if let Err(e) = r {
            failure = Some(e);
        }
    }
    // Cancels whatever is still in flight and waits for the workers, so no task writes a region
    // after this returns.
    drop(rt);
    match failure {
        Some(e) => Err(e),
        None => Ok(()),
    }
}
