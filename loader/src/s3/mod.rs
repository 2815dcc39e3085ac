//! Checkpoints in S3 (or any S3-compatible store): `s3://bucket/prefix`.
//!
//! A serverless replica's weights usually live in object storage, and the fastest cold start
//! does not stop at the local disk on the way: the weights go from ranged GETs straight into the
//! final arena (or a GPU staging ring), chunk by chunk in the plan's layer order, verified as
//! they land — the same [`crate::Destination`] contract as the file strategies.
//!
//! The split that makes this fit the rest of the loader without a second code path:
//! * [`materialize`] lists the prefix once and, in parallel, downloads every small file (config,
//!   tokenizer, chat template, index, manifest) into a local directory, and reads the header of
//!   every `.safetensors` object with one ranged GET each (a second only for headers past 64 KiB).
//!   It writes what it learnt — each weight object's size, ETag and header — to
//!   [`REMOTE_FILE`] in that directory. The directory is an ordinary model directory to everything
//!   above the loader (config and tokenizer are read from it as from any other).
//! * [`crate::Checkpoint::open`] on such a directory builds the tensor table from the recorded
//!   headers (no network) and marks the checkpoint remote; every load path then reads its
//!   chunks with [`load_chunks`]: up to `queue_depth` ranged GETs in flight on a small tokio
//!   runtime, each body written into the chunk's region as it arrives, every GET pinned to the
//!   listed ETag (`If-Match`) so an object replaced mid-load fails the load instead of mixing
//!   two versions.
//!
//! Requests are signed with SigV4 ([`sign`]) and retried on transient failures, resuming a cut
//! body at its last byte ([`client`]).

pub mod client;
pub mod sign;
pub mod xml;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

pub use client::{Client, Object, S3Config};

use crate::dest::Destination;
use crate::plan::LoadPlan;
use crate::LoadError;

/// What [`materialize`] records in the local directory.
pub const REMOTE_FILE: &str = "thaw-remote.json";

/// Files bigger than this are not copied into the local directory (other weight formats, say).
pub const MAX_SIDE_FILE: u64 = 64 << 20;

/// Bytes read first from each weight object: its header in all but the largest checkpoints.
const HEADER_PROBE: u64 = 64 << 10;

/// `s3://bucket/prefix` (prefix without a trailing slash; may be empty).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct S3Url {
    pub bucket: String,
    pub prefix: String,
}

impl S3Url {
    pub fn parse(s: &str) -> Result<S3Url, String> {
        let rest = s
            .strip_prefix("s3://")
            .ok_or_else(|| format!("{s}: not an s3:// URL"))?;
        let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
        if bucket.is_empty()
            || !bucket
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'.' || b == b'_')
        {
            return Err(format!("{s}: '{bucket}' is not a valid bucket name"));
        }
        Ok(S3Url {
            bucket: bucket.to_string(),
            prefix: prefix.trim_matches('/').to_string(),
        })
    }

    /// The key of `name` under the prefix.
    pub fn key(&self, name: &str) -> String {
        if self.prefix.is_empty() {
            name.to_string()
        } else {
            format!("{}/{name}", self.prefix)
        }
    }

    /// `s3://bucket/prefix/name`, for messages and as the shard's "path".
    pub fn display(&self, name: &str) -> String {
        client::s3_url(&self.bucket, &self.key(name))
    }
}

impl std::fmt::Display for S3Url {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "s3://{}/{}", self.bucket, self.prefix)
    }
}

/// One weight object, as listed and as its header reads.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct RemoteShard {
    pub name: String,
    pub size: u64,
    pub etag: String,
    /// The header's JSON text, exactly as stored (its length fixes where the data starts).
    pub header: String,
}

/// A checkpoint whose weights stay in S3 ([`REMOTE_FILE`]).
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct Remote {
    pub url: S3Url,
    pub shards: Vec<RemoteShard>,
}

impl Remote {
    pub fn read(dir: &Path) -> Result<Option<Remote>, LoadError> {
        let p = dir.join(REMOTE_FILE);
        let text = match std::fs::read_to_string(&p) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(LoadError::io(&p, e)),
        };
        serde_json::from_str(&text)
            .map(Some)
            .map_err(|e| LoadError::invalid(&p, format!("malformed: {e}")))
    }

    pub fn shard(&self, name: &str) -> Option<&RemoteShard> {
        self.shards.iter().find(|s| s.name == name)
    }
}

/// A runtime for the client's requests: a few threads are plenty (the work is waiting on the
/// network and one memcpy per body chunk).
pub fn runtime(threads: usize) -> Result<tokio::runtime::Runtime, LoadError> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(threads.clamp(1, 8))
        .thread_name("thaw-s3")
        .enable_all()
        .build()
        .map_err(|e| LoadError::io("s3", e))
}

/// What [`materialize`] did.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct MaterializeStats {
    pub files: usize,
    pub file_bytes: u64,
    pub shards: usize,
    pub weight_bytes: u64,
    pub total_s: f64,
}

/// Lists `url` and fills `dir` with its small files and [`REMOTE_FILE`] (see the module docs).
/// `dir` is replaced as a whole, so a reader never sees half of two versions.
pub fn materialize(cfg: S3Config, url: &S3Url, dir: &Path) -> Result<MaterializeStats, LoadError> {
    let t0 = Instant::now();
    let rt = runtime(4)?;
    let client = Arc::new(Client::new(cfg)?);
    let listed = rt.block_on(client.list(&url.bucket, &url.key("")))?;
    // Direct children only: `original/` and other subfolders belong to other tools.
    let strip = if url.prefix.is_empty() {
        String::new()
    } else {
        format!("{}/", url.prefix)
    };
    let mut objects: Vec<(String, Object)> = listed
        .into_iter()
        .filter_map(|o| {
            let name = o.key.strip_prefix(&strip)?.to_string();
            (!name.is_empty() && !name.contains('/')).then_some((name, o))
        })
        .collect();
    objects.sort_by(|a, b| a.0.cmp(&b.0));
    if objects.is_empty() {
        return Err(LoadError::Remote {
            url: url.to_string(),
            msg: "no objects under this prefix".into(),
        });
    }
    let tmp = dir.with_extension(format!("tmp-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    std::fs::create_dir_all(&tmp).map_err(|e| LoadError::io(&tmp, e))?;
    let r = rt.block_on(fetch_all(&client, url, &objects, &tmp));
    let (files, shards) = match r {
        Ok(v) => v,
        Err(e) => {
            let _ = std::fs::remove_dir_all(&tmp);
            return Err(e);
        }
    };
    let mut stats = MaterializeStats {
        files: files.len(),
        file_bytes: files.values().sum(),
        shards: shards.len(),
        weight_bytes: shards.iter().map(|s| s.size).sum(),
        ..Default::default()
    };
    let remote = Remote {
        url: url.clone(),
        shards,
    };
    let p = tmp.join(REMOTE_FILE);
    let text =
        serde_json::to_string_pretty(&remote).map_err(|e| LoadError::invalid(&p, e.to_string()))?;
    std::fs::write(&p, text).map_err(|e| LoadError::io(&p, e))?;
    // Swap in: move the old directory aside first (rename cannot replace a non-empty one).
    let old = dir.with_extension(format!("old-{}", std::process::id()));
    let moved = std::fs::rename(dir, &old).is_ok();
    let placed = std::fs::rename(&tmp, dir);
    if moved {
        let _ = std::fs::remove_dir_all(&old);
    }
    placed.map_err(|e| LoadError::io(dir, e))?;
    stats.total_s = t0.elapsed().as_secs_f64();
    Ok(stats)
}

fn is_weights(name: &str) -> bool {
    name.ends_with(".safetensors")
}

/// Downloads the small files into `tmp` and reads every weight object's header, all at once.
async fn fetch_all(
    client: &Arc<Client>,
    url: &S3Url,
    objects: &[(String, Object)],
    tmp: &Path,
) -> Result<(BTreeMap<String, u64>, Vec<RemoteShard>), LoadError> {
    let mut files = tokio::task::JoinSet::new();
    let mut heads = tokio::task::JoinSet::new();
    for (name, o) in objects {
        let (client, bucket, name, o) =
            (client.clone(), url.bucket.clone(), name.clone(), o.clone());
        if is_weights(&name) {
            heads.spawn(async move { read_header(&client, &bucket, &name, &o).await });
        } else if o.size <= MAX_SIDE_FILE {
            let path = tmp.join(&name);
            files.spawn(async move {
                let bytes =
                    client
                        .get(&bucket, &o.key)
                        .await?
                        .ok_or_else(|| LoadError::Remote {
                            url: client::s3_url(&bucket, &o.key),
                            msg: "listed but gone (HTTP 404)".into(),
                        })?;
                tokio::fs::write(&path, &bytes)
                    .await
                    .map_err(|e| LoadError::io(&path, e))?;
                Ok::<_, LoadError>((name, bytes.len() as u64))
            });
        }
    }
    let mut got_files = BTreeMap::new();
    while let Some(r) = files.join_next().await {
        let (name, len) = r.map_err(|e| LoadError::io(tmp, std::io::Error::other(e)))??;
        got_files.insert(name, len);
    }
    let mut shards = Vec::new();
    while let Some(r) = heads.join_next().await {
        shards.push(r.map_err(|e| LoadError::io(tmp, std::io::Error::other(e)))??);
    }
    shards.sort_by(|a, b| a.name.cmp(&b.name));
    Ok((got_files, shards))
}

/// One weight object's header: a probe GET of its first 64 KiB, then the rest if the header is
/// longer. Validated here (the first place a corrupt object is seen).
async fn read_header(
    client: &Client,
    bucket: &str,
    name: &str,
    o: &Object,
) -> Result<RemoteShard, LoadError> {
    let path = PathBuf::from(client::s3_url(bucket, &o.key));
    let etag = (!o.etag.is_empty()).then_some(o.etag.as_str());
    let (mut head, size) = client
        .get_head_bytes(bucket, &o.key, HEADER_PROBE, etag)
        .await?;
    let len = crate::ShardHeader::header_len(&path, &head, size)?;
    if head.len() < 8 + len as usize {
        let mut rest = vec![0u8; 8 + len as usize - head.len()];
        client
            .get_into(bucket, &o.key, head.len() as u64, &mut rest, etag)
            .await?;
        head.extend_from_slice(&rest);
    }
    let json = &head[8..8 + len as usize];
    crate::ShardHeader::parse(&path, json, size)?;
    let header = String::from_utf8(json.to_vec())
        .map_err(|_| LoadError::invalid(&path, "header is not valid UTF-8"))?;
    Ok(RemoteShard {
        name: name.to_string(),
        size,
        etag: o.etag.clone(),
        header,
    })
}

/// What [`load_chunks`] calls with (chunk index, bytes, the bytes) as each chunk arrives.
pub(crate) type OnLanded<'a> = dyn FnMut(usize, u64, &[u8]) -> Result<(), LoadError> + 'a;

/// Reads every chunk of `plan` from `remote` into `dest` (see the module docs): GETs issued in
/// plan order, at most `opts.queue_depth` in flight; `on_landed(i, len, buf)` runs on this thread for each
/// chunk as it arrives (length check, hash, `dest.landed`, progress).
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
    let (tx, rx) = std::sync::mpsc::channel::<(usize, usize, Result<(), LoadError>)>();
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
                // SAFETY: the destination gives chunk i's region (c.len ≥ len bytes) to this
                // load alone until `landed(i)`, which runs only after this task has sent its
                // result; a failed load drops the runtime (cancelling this task at an await,
                // never mid-copy) before the region's memory can go away.
                let buf = unsafe { std::slice::from_raw_parts_mut(ptr as *mut u8, len) };
                let r = client
                    .get_into(&bucket, &key, off, buf, etag.as_deref())
                    .await;
                let _ = tx.send((i, ptr, r));
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

/// S3's limit for one PUT; larger files need a multipart upload (not implemented yet).
pub const MAX_PUT: u64 = 5 << 30;

/// Uploads every file of checkpoint directory `dir` (not its subdirectories) under `url`, up to
/// four at a time. Returns (files, bytes).
pub fn push(cfg: S3Config, dir: &Path, url: &S3Url) -> Result<(usize, u64), LoadError> {
    let mut files = Vec::new();
    for e in std::fs::read_dir(dir).map_err(|e| LoadError::io(dir, e))? {
        let e = e.map_err(|e| LoadError::io(dir, e))?;
        let name = e.file_name().to_string_lossy().to_string();
        let meta = e.metadata().map_err(|err| LoadError::io(e.path(), err))?;
        // The marker of a materialized directory describes another copy, not this one.
        if !meta.is_file() || name == REMOTE_FILE || name.starts_with('.') {
            continue;
        }
        if meta.len() > MAX_PUT {
            return Err(LoadError::invalid(
                e.path(),
                format!(
                    "{} bytes: over S3's 5 GiB single-PUT limit (shard it smaller)",
                    meta.len()
                ),
            ));
        }
        files.push((name, e.path(), meta.len()));
    }
    if files.is_empty() {
        return Err(LoadError::invalid(dir, "no files to upload"));
    }
    let rt = runtime(4)?;
    let client = Arc::new(Client::new(cfg)?);
    let bytes: u64 = files.iter().map(|f| f.2).sum();
    let n = files.len();
    rt.block_on(async {
        let mut set = tokio::task::JoinSet::new();
        let mut pending = files.into_iter();
        let mut first_err = None;
        loop {
            while set.len() < 4 {
                let Some((name, path, _)) = pending.next() else {
                    break;
                };
                let (client, bucket, key) = (client.clone(), url.bucket.clone(), url.key(&name));
                set.spawn(async move {
                    let body = tokio::fs::read(&path)
                        .await
                        .map_err(|e| LoadError::io(&path, e))?;
                    client.put(&bucket, &key, body).await
                });
            }
            match set.join_next().await {
                None => break,
                Some(Ok(Ok(()))) => {}
                Some(Ok(Err(e))) => {
                    first_err.get_or_insert(e);
                }
                Some(Err(e)) => {
                    first_err.get_or_insert(LoadError::io(dir, std::io::Error::other(e)));
                }
            }
            if first_err.is_some() {
                break;
            }
        }
        match first_err {
            Some(e) => Err(e),
            None => Ok((n, bytes)),
        }
    })
}
