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

mod chunks;
pub mod client;
pub mod credentials;
mod materialize;
pub mod sign;
mod upload;
pub mod xml;

use std::path::Path;

pub(crate) use chunks::load_chunks;
pub use client::{Client, Object, S3Config};
pub use materialize::{materialize, push, MaterializeStats, MAX_PUT};

use crate::LoadError;

/// What [`materialize`] records in the local directory.
pub const REMOTE_FILE: &str = "thaw-remote.json";

/// Files bigger than this are not copied into the local directory (other weight formats, say).
pub const MAX_SIDE_FILE: u64 = 64 << 20;

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
