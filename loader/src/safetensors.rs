//! Strict parsing of one safetensors file's header.
//!
//! Layout: 8 bytes little-endian header length `N`, `N` bytes of JSON, then the data section.
//! The JSON maps tensor names to `{dtype, shape, data_offsets: [begin, end]}` (offsets relative to
//! the data section) plus an optional `__metadata__` string map. We check everything a kernel
//! would otherwise trust blindly: known dtype, `product(shape) × size == end − begin`, ranges in
//! bounds of the actual file and pairwise disjoint.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::Read;
use std::path::{Path, PathBuf};

use crate::{Dtype, LoadError};

/// Headers larger than this are refused (the format's own reference limit is 100 MB).
pub const MAX_HEADER_LEN: u64 = 100 * 1024 * 1024;

/// Where files written by thaw (`thaw convert`, `bench-coldstart synth`) start their data
/// section: on a page boundary, so that tensors used in place (a mapping, or an arena the file
/// was read into whole) start on cache-line boundaries wherever their sizes keep them there.
/// The common 8-byte alignment made every 64-byte weight load of the CPU products straddle two
/// lines (docs/PERFORMANCE.md, "Alignment of weights and KV rows").
pub const DATA_ALIGN: usize = 4096;

/// The first bytes of a safetensors file with header `json`: its length, then the JSON padded
/// with spaces (which the format allows) so that the data section starts at a multiple of
/// [`DATA_ALIGN`].
pub fn header_bytes(json: &str) -> Vec<u8> {
    let len = (8 + json.len()).div_ceil(DATA_ALIGN) * DATA_ALIGN - 8;
    let mut out = Vec::with_capacity(8 + len);
    out.extend_from_slice(&(len as u64).to_le_bytes());
    out.extend_from_slice(json.as_bytes());
    out.resize(8 + len, b' ');
    out
}

#[derive(Debug, Clone, PartialEq)]
pub struct TensorInfo {
    pub name: String,
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    /// Byte range relative to the start of the data section.
    pub begin: u64,
    pub end: u64,
}

impl TensorInfo {
    pub fn len(&self) -> u64 {
        self.end - self.begin
    }
    pub fn is_empty(&self) -> bool {
        self.begin == self.end
    }
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

/// The parsed header of one shard.
#[derive(Debug, Clone)]
pub struct ShardHeader {
    pub path: PathBuf,
    /// Absolute file offset of the data section (8 + header length).
    pub data_start: u64,
    /// Length of the data section the tensors cover (max end offset).
    pub data_len: u64,
    pub file_len: u64,
    /// Tensors sorted by their begin offset.
    pub tensors: Vec<TensorInfo>,
    pub metadata: BTreeMap<String, String>,
}

#[derive(serde::Deserialize)]
struct RawEntry {
    dtype: String,
    shape: Vec<u64>,
    data_offsets: (u64, u64),
}

impl ShardHeader {
    /// Reads and validates the header of the safetensors file at `path`.
    pub fn read(path: &Path) -> Result<ShardHeader, LoadError> {
        let mut f = File::open(path).map_err(|e| LoadError::io(path, e))?;
        let file_len = f.metadata().map_err(|e| LoadError::io(path, e))?.len();
        let mut len_bytes = [0u8; 8];
        if file_len >= 8 {
            f.read_exact(&mut len_bytes)
                .map_err(|e| LoadError::io(path, e))?;
        }
        let header_len = Self::header_len(path, &len_bytes[..file_len.min(8) as usize], file_len)?;
        let mut json = vec![0u8; header_len as usize];
        f.read_exact(&mut json)
            .map_err(|e| LoadError::io(path, e))?;
        Self::parse(path, &json, file_len)
    }

    /// Validates the 8-byte length prefix at the start of `head` (the file's first bytes, at
    /// least 8 of them unless the file is shorter) for a file of `file_len` bytes; returns the
    /// header's JSON length.
    pub fn header_len(path: &Path, head: &[u8], file_len: u64) -> Result<u64, LoadError> {
        if file_len < 8 || head.len() < 8 {
            return Err(LoadError::invalid(
                path,
                format!("truncated safetensors file: {file_len} bytes, shorter than the 8-byte header length"),
            ));
        }
        let header_len = u64::from_le_bytes(head[..8].try_into().expect("8 bytes"));
        if header_len > MAX_HEADER_LEN {
            return Err(LoadError::invalid(
                path,
                format!("header length {header_len} exceeds the {MAX_HEADER_LEN}-byte limit (not a safetensors file?)"),
            ));
        }
        if 8 + header_len > file_len {
            return Err(LoadError::invalid(
                path,
                format!("truncated safetensors file: header claims {header_len} bytes but the file has {file_len}"),
            ));
        }
        Ok(header_len)
    }

    /// Validates header JSON bytes for a file of `file_len` bytes.
    pub fn parse(path: &Path, json: &[u8], file_len: u64) -> Result<ShardHeader, LoadError> {
        let bad = |msg: String| LoadError::invalid(path, msg);
        let text =
            std::str::from_utf8(json).map_err(|_| bad("header is not valid UTF-8".into()))?;
        let map: serde_json::Map<String, serde_json::Value> =
            serde_json::from_str(text.trim_end_matches(' '))
                .map_err(|e| bad(format!("header is not a JSON object: {e}")))?;
        let data_start = 8 + json.len() as u64;
        let mut metadata = BTreeMap::new();
        let mut tensors = Vec::with_capacity(map.len());
        for (name, value) in map {
            if name == "__metadata__" {
                let m: BTreeMap<String, String> = serde_json::from_value(value)
                    .map_err(|e| bad(format!("__metadata__ must map strings to strings: {e}")))?;
                metadata = m;
                continue;
            }
            let raw: RawEntry = serde_json::from_value(value)
                .map_err(|e| bad(format!("tensor '{name}': malformed entry: {e}")))?;
            let dtype = Dtype::from_safetensors(&raw.dtype)
                .ok_or_else(|| bad(format!("tensor '{name}': unknown dtype '{}'", raw.dtype)))?;
            let (begin, end) = raw.data_offsets;
            if end < begin {
                return Err(bad(format!(
                    "tensor '{name}': data_offsets [{begin}, {end}] end before begin"
                )));
            }
            let numel = raw
                .shape
                .iter()
                .try_fold(1u64, |acc, &d| acc.checked_mul(d))
                .and_then(|n| n.checked_mul(dtype.size() as u64))
                .ok_or_else(|| bad(format!("tensor '{name}': shape {:?} overflows", raw.shape)))?;
            if numel != end - begin {
                return Err(bad(format!(
                    "tensor '{name}': shape {:?} of {dtype} needs {numel} bytes but data_offsets [{begin}, {end}] hold {}",
                    raw.shape,
                    end - begin
                )));
            }
            let shape = raw
                .shape
                .iter()
                .map(|&d| usize::try_from(d))
                .collect::<Result<Vec<_>, _>>()
                .map_err(|_| bad(format!("tensor '{name}': shape {:?} too large", raw.shape)))?;
            tensors.push(TensorInfo {
                name,
                dtype,
                shape,
                begin,
                end,
            });
        }
        tensors.sort_by_key(|t| (t.begin, t.end));
        for pair in tensors.windows(2) {
            if pair[1].begin < pair[0].end {
                return Err(bad(format!(
                    "tensors '{}' [{}, {}] and '{}' [{}, {}] overlap",
                    pair[0].name,
                    pair[0].begin,
                    pair[0].end,
                    pair[1].name,
                    pair[1].begin,
                    pair[1].end
                )));
            }
        }
        let data_len = tensors.iter().map(|t| t.end).max().unwrap_or(0);
        if data_start + data_len > file_len {
            let last = tensors
                .iter()
                .max_by_key(|t| t.end)
                .map(|t| t.name.as_str())
                .unwrap_or("");
            return Err(bad(format!(
                "truncated safetensors file: tensor '{last}' ends at byte {} but the file has {file_len}",
                data_start + data_len
            )));
        }
        Ok(ShardHeader {
            path: path.to_path_buf(),
            data_start,
            data_len,
            file_len,
            tensors,
            metadata,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(json: &str, file_len: u64) -> Result<ShardHeader, LoadError> {
        ShardHeader::parse(Path::new("x.safetensors"), json.as_bytes(), file_len)
    }

    #[test]
    fn accepts_valid_header() {
        let j = r#"{"__metadata__":{"format":"pt"},"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]},"a":{"dtype":"BF16","shape":[2],"data_offsets":[0,4]}}"#;
        let h = parse(j, 8 + j.len() as u64 + 12).unwrap();
        assert_eq!(h.tensors[0].name, "a");
        assert_eq!(h.data_len, 12);
        assert_eq!(h.metadata["format"], "pt");
    }

    #[test]
    fn written_headers_put_data_on_a_page_boundary() {
        let j = r#"{"a":{"dtype":"BF16","shape":[2],"data_offsets":[0,4]}}"#;
        for json in [j.to_string(), format!("{j}{}", " ".repeat(DATA_ALIGN))] {
            let b = header_bytes(&json);
            assert_eq!(b.len() % DATA_ALIGN, 0);
            let n = u64::from_le_bytes(b[..8].try_into().unwrap());
            assert_eq!(n as usize + 8, b.len());
            // The padded header still parses, with the data section right after it.
            let h = ShardHeader::parse(Path::new("x"), &b[8..], b.len() as u64 + 4).unwrap();
            assert_eq!(h.data_start as usize, b.len());
            assert_eq!(h.tensors[0].name, "a");
        }
    }

    #[test]
    fn rejects_bad_headers() {
        let cases = [
            (
                r#"{"a":{"dtype":"Q9","shape":[2],"data_offsets":[0,4]}}"#,
                "unknown dtype 'Q9'",
            ),
            (
                r#"{"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}}"#,
                "needs 12 bytes",
            ),
            (
                r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}}"#,
                "overlap",
            ),
            (
                r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[8,0]}}"#,
                "end before begin",
            ),
            (
                r#"{"a":{"dtype":"F32","shape":[4000],"data_offsets":[0,16000]}}"#,
                "truncated",
            ),
            (r#"[1,2]"#, "not a JSON object"),
            (
                r#"{"a":{"dtype":"F32","shape":[18446744073709551615,2],"data_offsets":[0,8]}}"#,
                "overflows",
            ),
            (
                r#"{"a":{"dtype":"F32","data_offsets":[0,8]}}"#,
                "malformed entry",
            ),
        ];
        for (j, want) in cases {
            let err = parse(j, 8 + j.len() as u64 + 64).unwrap_err().to_string();
            assert!(err.contains(want), "{j}: got '{err}', want '{want}'");
            assert!(err.starts_with("x.safetensors: "), "{err}");
        }
    }
}
