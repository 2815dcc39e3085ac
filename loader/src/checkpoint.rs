//! A checkpoint directory: one `model.safetensors`, or shards listed by
//! `model.safetensors.index.json`. Opening reads and validates every header but no tensor data.
//! A directory made by [`crate::s3::materialize`] holds the small files of a checkpoint in S3 and
//! the headers of its weight objects: the checkpoint opens the same way, marked remote.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::s3::Remote;
use crate::{Dtype, LoadError, ShardHeader, TensorInfo};

pub const SINGLE_FILE: &str = "model.safetensors";
pub const INDEX_FILE: &str = "model.safetensors.index.json";

/// Where one tensor lives: which shard, and its header entry.
#[derive(Debug, Clone)]
pub struct TensorEntry {
    pub shard: usize,
    pub info: TensorInfo,
}

#[derive(Debug, Clone)]
pub struct Checkpoint {
    pub dir: PathBuf,
    pub shards: Vec<ShardHeader>,
    by_name: HashMap<String, TensorEntry>,
    /// Set when the weights stay in S3: every load reads them with ranged GETs.
    pub remote: Option<Arc<Remote>>,
}

#[derive(serde::Deserialize)]
struct Index {
    weight_map: BTreeMap<String, String>,
}

impl Checkpoint {
    pub fn open(dir: &Path) -> Result<Checkpoint, LoadError> {
        if !dir.is_dir() {
            return Err(LoadError::invalid(dir, "not a checkpoint directory"));
        }
        let index_path = dir.join(INDEX_FILE);
        let remote = Remote::read(dir)?.map(Arc::new);
        let has = |f: &str| match &remote {
            Some(r) => r.shard(f).is_some(),
            None => dir.join(f).is_file(),
        };
        let (files, weight_map) = if index_path.exists() {
            let text =
                std::fs::read_to_string(&index_path).map_err(|e| LoadError::io(&index_path, e))?;
            let index: Index = serde_json::from_str(&text)
                .map_err(|e| LoadError::invalid(&index_path, format!("malformed index: {e}")))?;
            let mut files: Vec<String> = index.weight_map.values().cloned().collect();
            files.sort();
            files.dedup();
            for f in &files {
                if f.contains('/') || f.contains("..") {
                    return Err(LoadError::invalid(
                        &index_path,
                        format!("shard name '{f}' must be a plain file name"),
                    ));
                }
                if !has(f) {
                    return Err(LoadError::invalid(
                        &index_path,
                        format!("names shard '{f}', which does not exist"),
                    ));
                }
            }
            (files, Some(index.weight_map))
        } else if has(SINGLE_FILE) {
            (vec![SINGLE_FILE.to_string()], None)
        } else {
            return Err(LoadError::invalid(
                dir,
                format!("no {SINGLE_FILE} or {INDEX_FILE} in this directory"),
            ));
        };

        let mut shards = Vec::with_capacity(files.len());
        let mut by_name: HashMap<String, TensorEntry> = HashMap::new();
        for (i, f) in files.iter().enumerate() {
            let header = match remote.as_ref().and_then(|r| Some((r, r.shard(f)?))) {
                Some((r, sh)) => ShardHeader::parse(
                    &PathBuf::from(r.url.display(f)),
                    sh.header.as_bytes(),
                    sh.size,
                )?,
                None => ShardHeader::read(&dir.join(f))?,
            };
            for t in &header.tensors {
                if let Some(prev) = by_name.get(&t.name) {
                    return Err(LoadError::invalid(
                        &header.path,
                        format!("tensor '{}' also appears in {}", t.name, files[prev.shard]),
                    ));
                }
                by_name.insert(
                    t.name.clone(),
                    TensorEntry {
                        shard: i,
                        info: t.clone(),
                    },
                );
            }
            shards.push(header);
        }
        if let Some(map) = weight_map {
            for (name, file) in &map {
                match by_name.get(name) {
                    Some(e) if &files[e.shard] == file => {}
                    Some(e) => {
                        return Err(LoadError::invalid(
                            &index_path,
                            format!("maps '{name}' to {file} but it is in {}", files[e.shard]),
                        ))
                    }
                    None => {
                        return Err(LoadError::invalid(
                            &index_path,
                            format!("maps '{name}' to {file}, which has no such tensor"),
                        ))
                    }
                }
            }
        }
        Ok(Checkpoint {
            dir: dir.to_path_buf(),
            shards,
            by_name,
            remote,
        })
    }

    pub fn get(&self, name: &str) -> Option<&TensorEntry> {
        self.by_name.get(name)
    }

    pub fn tensor_names(&self) -> impl Iterator<Item = &str> {
        self.by_name.keys().map(|s| s.as_str())
    }

    pub fn len(&self) -> usize {
        self.by_name.len()
    }

    pub fn is_empty(&self) -> bool {
        self.by_name.is_empty()
    }

    /// Total bytes of tensor data across shards.
    pub fn data_bytes(&self) -> u64 {
        self.shards.iter().map(|s| s.data_len).sum()
    }

    /// Checks that `name` exists with `shape` and one of `dtypes`; the error names the shard.
    pub fn expect(
        &self,
        name: &str,
        shape: &[usize],
        dtypes: &[Dtype],
    ) -> Result<&TensorEntry, LoadError> {
        let e = self.get(name).ok_or_else(|| {
            LoadError::tensor(&self.dir, format!("checkpoint is missing tensor '{name}'"))
        })?;
        let path = &self.shards[e.shard].path;
        if e.info.shape != shape {
            return Err(LoadError::tensor(
                path,
                format!(
                    "tensor '{name}' has shape {:?}, expected {:?}",
                    e.info.shape, shape
                ),
            ));
        }
        if !dtypes.contains(&e.info.dtype) {
            return Err(LoadError::tensor(
                path,
                format!(
                    "tensor '{name}' has dtype {}, expected one of {:?}",
                    e.info.dtype,
                    dtypes.iter().map(|d| d.name()).collect::<Vec<_>>()
                ),
            ));
        }
        Ok(e)
    }
}
