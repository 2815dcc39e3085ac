//! Integrity manifest: xxh3-64 of every load chunk of every shard, written by `thaw convert` /
//! `thaw manifest` as `thaw-manifest.json` and verified inline by the loader as chunks land.
//!
//! The chunk grid is the load plan's (from each shard's data section start rounded down to 4 KiB,
//! `chunk_size` apart) so a chunk can be hashed the moment its read completes, while later reads
//! are still in flight. Each hash covers the chunk's bytes up to the end of the data section.
//! xxh3 runs at tens of GB/s per core, so verification costs a few percent of a load.

use std::collections::BTreeMap;
use std::path::Path;

use xxhash_rust::xxh3::xxh3_64;

use crate::plan::{Chunk, LoadPlan};
use crate::{Checkpoint, LoadError};

pub const MANIFEST_FILE: &str = "thaw-manifest.json";
pub const DEFAULT_CHUNK: u64 = 8 << 20;

#[derive(Debug, Clone, serde::Serialize, serde::Deserialize, PartialEq)]
pub struct ShardHashes {
    pub size: u64,
    pub chunks: Vec<String>,
}

#[derive(Debug, Clone, serde::Serialize, serde::Deserialize, PartialEq)]
pub struct Manifest {
    pub version: u32,
    pub hash: String,
    pub chunk_size: u64,
    pub files: BTreeMap<String, ShardHashes>,
}

fn file_name(p: &Path) -> String {
    p.file_name()
        .map(|s| s.to_string_lossy().to_string())
        .unwrap_or_default()
}

/// The bytes of `chunk` that the hash covers, given the chunk's full buffer.
pub fn hashed_part<'a>(plan: &LoadPlan, chunk: &Chunk, buf: &'a [u8]) -> &'a [u8] {
    let s = &plan.shards[chunk.shard];
    let end = (s.data_start + s.data_len).min(chunk.file_off + chunk.len);
    &buf[..(end.saturating_sub(chunk.file_off)) as usize]
}

pub fn hash(bytes: &[u8]) -> String {
    format!("{:016x}", xxh3_64(bytes))
}

impl Manifest {
    /// Reads every shard of `ck` and hashes it on the plan's chunk grid.
    pub fn build(ck: &Checkpoint, chunk_size: u64) -> Result<Manifest, LoadError> {
        let plan = LoadPlan::new(ck, chunk_size);
        let mut files = BTreeMap::new();
        for (si, s) in plan.shards.iter().enumerate() {
            // Mapped, not read into the heap: shards are gigabytes.
            let file = std::fs::File::open(&s.path).map_err(|e| LoadError::io(&s.path, e))?;
            // SAFETY: a private read-only mapping, only read while `file` is open here.
            let data =
                unsafe { memmap2::Mmap::map(&file) }.map_err(|e| LoadError::io(&s.path, e))?;
            let mut chunks: Vec<&Chunk> = plan.chunks.iter().filter(|c| c.shard == si).collect();
            chunks.sort_by_key(|c| c.file_off);
            let hashes = chunks
                .iter()
                .map(|c| {
                    let end = ((c.file_off + c.len) as usize).min(data.len());
                    hash(hashed_part(&plan, c, &data[c.file_off as usize..end]))
                })
                .collect();
            files.insert(
                file_name(&s.path),
                ShardHashes {
                    size: s.file_len,
                    chunks: hashes,
                },
            );
        }
        Ok(Manifest {
            version: 1,
            hash: "xxh3-64".into(),
            chunk_size: plan.chunk_size,
            files,
        })
    }

    pub fn write(&self, dir: &Path) -> Result<(), LoadError> {
        let p = dir.join(MANIFEST_FILE);
        let text = serde_json::to_string_pretty(self).expect("manifest serializes");
        std::fs::write(&p, text).map_err(|e| LoadError::io(&p, e))
    }

    /// The manifest in `dir`, if there is one.
    pub fn read(dir: &Path) -> Result<Option<Manifest>, LoadError> {
        let p = dir.join(MANIFEST_FILE);
        let text = match std::fs::read_to_string(&p) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(LoadError::io(&p, e)),
        };
        let m: Manifest = serde_json::from_str(&text)
            .map_err(|e| LoadError::invalid(&p, format!("malformed manifest: {e}")))?;
        if m.version != 1
            || m.hash != "xxh3-64"
            || m.chunk_size == 0
            || !m.chunk_size.is_multiple_of(crate::plan::BLOCK)
        {
            return Err(LoadError::invalid(
                &p,
                format!(
                    "unsupported manifest (version {}, hash {}, chunk {})",
                    m.version, m.hash, m.chunk_size
                ),
            ));
        }
        Ok(Some(m))
    }

    /// Expected hashes per plan chunk (indexed like `plan.chunks`); errors if the manifest does
    /// not describe these files.
    pub fn expected(&self, plan: &LoadPlan, dir: &Path) -> Result<Vec<String>, LoadError> {
        let p = dir.join(MANIFEST_FILE);
        let mut out = Vec::with_capacity(plan.chunks.len());
        for c in &plan.chunks {
            let s = &plan.shards[c.shard];
            let name = file_name(&s.path);
            let f = self
                .files
                .get(&name)
                .ok_or_else(|| LoadError::invalid(&p, format!("has no entry for {name}")))?;
            if f.size != s.file_len {
                return Err(LoadError::invalid(
                    &s.path,
                    format!("size {} differs from the manifest's {}", s.file_len, f.size),
                ));
            }
            let idx = ((c.file_off - s.aligned_start) / plan.chunk_size) as usize;
            out.push(f.chunks.get(idx).cloned().ok_or_else(|| {
                LoadError::invalid(&p, format!("{name}: no hash for chunk {idx}"))
            })?);
        }
        Ok(out)
    }
}
