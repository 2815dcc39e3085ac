//! Turning `s3://bucket/prefix` into a local model directory ([`materialize`]), and the reverse
//! ([`push`]).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use super::client::{self, Client, Object, S3Config};
use super::{runtime, Remote, RemoteShard, S3Url, MAX_SIDE_FILE, REMOTE_FILE};
use crate::LoadError;

/// Bytes read first from each weight object: its header in all but the largest checkpoints.
const HEADER_PROBE: u64 = 64 << 10;

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
    let strip = if url.prefix.is_empty() {
        String::new()
    } else {
        format!("{}/", url.prefix)
    };
    let mut objects: Vec<(String, Object)> = listed
        .into_iter()
        .filter_map(|o| Some((file_name(&o.key, &strip)?.to_string(), o)))
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

/// The local file name of `key` under `prefix` (with its trailing `/`): direct children only —
/// `original/` and other subfolders belong to other tools — and never a name that would leave
/// the directory (`.`, `..`, a backslash or NUL).
fn file_name<'a>(key: &'a str, prefix: &str) -> Option<&'a str> {
    let name = key.strip_prefix(prefix)?;
    let bad = name.is_empty() || name == "." || name == ".." || name.contains(['/', '\\', '\0']);
    (!bad).then_some(name)
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
                set.spawn(async move { client.put_file(&bucket, &key, &path).await });
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

#[cfg(test)]
mod tests {
    #[test]
    fn only_plain_direct_children_become_files() {
        let f = |k| super::file_name(k, "m/");
        assert_eq!(f("m/config.json"), Some("config.json"));
        assert_eq!(f("m/original/consolidated.pth"), None);
        for bad in ["m/", "m/.", "m/..", "m/a\\b", "m/a\0b", "other/config.json"] {
            assert_eq!(f(bad), None, "{bad:?}");
        }
    }
}
