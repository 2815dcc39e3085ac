//! A GGUF reader: metadata, tensor infos and dequantization to f32.
//!
//! GGUF (llama.cpp's format): magic `GGUF`, version (2 or 3), tensor and key/value counts, the
//! key/values, tensor infos (name, dims with the fastest-varying first, ggml type, offset), then
//! data aligned to `general.alignment` (default 32). Every read is bounds-checked against the file,
//! so a truncated or corrupt file is an error, never a panic.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use half::{bf16, f16};

use crate::LoadError;

#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    String(String),
    Array(Vec<Value>),
    U64(u64),
    I64(i64),
    F64(f64),
}

impl Value {
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Value::U8(v) => Some(v as u64),
            Value::U16(v) => Some(v as u64),
            Value::U32(v) => Some(v as u64),
            Value::U64(v) => Some(v),
            Value::I8(v) if v >= 0 => Some(v as u64),
            Value::I16(v) if v >= 0 => Some(v as u64),
            Value::I32(v) if v >= 0 => Some(v as u64),
            Value::I64(v) if v >= 0 => Some(v as u64),
            _ => None,
        }
    }
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Value::F32(v) => Some(v as f64),
            Value::F64(v) => Some(v),
            _ => self.as_u64().map(|v| v as f64),
        }
    }
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::String(s) => Some(s),
            _ => None,
        }
    }
    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            Value::Bool(b) => Some(b),
            _ => None,
        }
    }
    pub fn as_array(&self) -> Option<&[Value]> {
        match self {
            Value::Array(a) => Some(a),
            _ => None,
        }
    }
}

/// ggml tensor types this reader can dequantize.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GgmlType {
    F32,
    F16,
    Q4_0,
    Q4_1,
    Q8_0,
    BF16,
}

impl GgmlType {
    fn from_id(id: u32) -> Option<GgmlType> {
        Some(match id {
            0 => GgmlType::F32,
            1 => GgmlType::F16,
            2 => GgmlType::Q4_0,
            3 => GgmlType::Q4_1,
            8 => GgmlType::Q8_0,
            30 => GgmlType::BF16,
            _ => return None,
        })
    }
    /// (elements per block, bytes per block)
    pub fn block(self) -> (usize, usize) {
        match self {
            GgmlType::F32 => (1, 4),
            GgmlType::F16 | GgmlType::BF16 => (1, 2),
            GgmlType::Q4_0 => (32, 18),
            GgmlType::Q4_1 => (32, 20),
            GgmlType::Q8_0 => (32, 34),
        }
    }
}

#[derive(Debug, Clone)]
pub struct GgufTensor {
    pub name: String,
    /// ggml order: `dims[0]` varies fastest. The row-major (PyTorch) shape is the reverse.
    pub dims: Vec<usize>,
    pub ty: GgmlType,
    /// Absolute offset of the data in the file.
    pub offset: usize,
    pub nbytes: usize,
}

impl GgufTensor {
    pub fn numel(&self) -> usize {
        self.dims.iter().product()
    }
    /// Row-major shape (outermost first), as safetensors stores it.
    pub fn shape(&self) -> Vec<usize> {
        self.dims.iter().rev().copied().collect()
    }
}

pub struct GgufFile {
    pub path: PathBuf,
    pub version: u32,
    pub metadata: BTreeMap<String, Value>,
    pub tensors: Vec<GgufTensor>,
    data: Vec<u8>,
}

struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], String> {
        let end = self
            .pos
            .checked_add(n)
            .filter(|&e| e <= self.buf.len())
            .ok_or_else(|| {
                format!(
                    "truncated GGUF: needs {n} bytes at offset {} but the file has {}",
                    self.pos,
                    self.buf.len()
                )
            })?;
        let s = &self.buf[self.pos..end];
        self.pos = end;
        Ok(s)
    }
    fn u8(&mut self) -> Result<u8, String> {
        Ok(self.take(1)?[0])
    }
    fn u16(&mut self) -> Result<u16, String> {
        Ok(u16::from_le_bytes(self.take(2)?.try_into().unwrap()))
    }
    fn u32(&mut self) -> Result<u32, String> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().unwrap()))
    }
    fn u64(&mut self) -> Result<u64, String> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().unwrap()))
    }
    fn len(&mut self, what: &str) -> Result<usize, String> {
        let n = self.u64()?;
        // Any count larger than the bytes left is corrupt; checking here keeps allocations sane.
        if n > (self.buf.len() - self.pos) as u64 {
            return Err(format!(
                "corrupt GGUF: {what} count {n} exceeds the file size"
            ));
        }
        Ok(n as usize)
    }
    fn string(&mut self) -> Result<String, String> {
        let n = self.len("string length")?;
        let b = self.take(n)?;
        String::from_utf8(b.to_vec()).map_err(|_| {
            format!(
                "corrupt GGUF: string at offset {} is not UTF-8",
                self.pos - n
            )
        })
    }
    fn value(&mut self, ty: u32, depth: u32) -> Result<Value, String> {
        Ok(match ty {
            0 => Value::U8(self.u8()?),
            1 => Value::I8(self.u8()? as i8),
            2 => Value::U16(self.u16()?),
            3 => Value::I16(self.u16()? as i16),
            4 => Value::U32(self.u32()?),
            5 => Value::I32(self.u32()? as i32),
            6 => Value::F32(f32::from_bits(self.u32()?)),
            7 => Value::Bool(self.u8()? != 0),
            8 => Value::String(self.string()?),
            9 => {
                if depth > 4 {
                    return Err("corrupt GGUF: arrays nested too deeply".into());
                }
                let item_ty = self.u32()?;
                let n = self.len("array")?;
                let mut v = Vec::with_capacity(n.min(1 << 20));
                for _ in 0..n {
                    v.push(self.value(item_ty, depth + 1)?);
                }
                Value::Array(v)
            }
            10 => Value::U64(self.u64()?),
            11 => Value::I64(self.u64()? as i64),
            12 => Value::F64(f64::from_bits(self.u64()?)),
            t => return Err(format!("corrupt GGUF: unknown metadata value type {t}")),
        })
    }
}

impl GgufFile {
    pub fn open(path: &Path) -> Result<GgufFile, LoadError> {
        let data = std::fs::read(path).map_err(|e| LoadError::io(path, e))?;
        Self::parse(path, data)
    }

    pub fn parse(path: &Path, data: Vec<u8>) -> Result<GgufFile, LoadError> {
        let (version, metadata, tensors) =
            Self::parse_inner(&data).map_err(|m| LoadError::invalid(path, m))?;
        Ok(GgufFile {
            path: path.to_path_buf(),
            version,
            metadata,
            tensors,
            data,
        })
    }

    #[allow(clippy::type_complexity)]
    fn parse_inner(data: &[u8]) -> Result<(u32, BTreeMap<String, Value>, Vec<GgufTensor>), String> {
        let mut c = Cursor { buf: data, pos: 0 };
        let magic = c
            .take(4)
            .map_err(|_| "not a GGUF file: shorter than its magic".to_string())?;
        if magic != b"GGUF" {
            return Err(format!(
                "not a GGUF file: bad magic {:?}",
                String::from_utf8_lossy(magic)
            ));
        }
        let version = c.u32()?;
        if !(2..=3).contains(&version) {
            return Err(format!(
                "unsupported GGUF version {version} (2 and 3 are supported)"
            ));
        }
        let n_tensors = c.len("tensor")?;
        let n_kv = c.len("metadata")?;
        let mut metadata = BTreeMap::new();
        for _ in 0..n_kv {
            let key = c.string()?;
            let ty = c.u32()?;
            let v = c.value(ty, 0)?;
            metadata.insert(key, v);
        }
        let alignment = metadata
            .get("general.alignment")
            .and_then(Value::as_u64)
            .unwrap_or(32) as usize;
        if alignment == 0 || !alignment.is_power_of_two() {
            return Err(format!(
                "corrupt GGUF: general.alignment {alignment} is not a power of two"
            ));
        }
        let mut infos = Vec::with_capacity(n_tensors);
        for _ in 0..n_tensors {
            let name = c.string()?;
            let n_dims = c.u32()? as usize;
            if n_dims > 4 {
                return Err(format!(
                    "corrupt GGUF: tensor '{name}' has {n_dims} dimensions"
                ));
            }
            let dims = (0..n_dims)
                .map(|_| c.u64().map(|d| d as usize))
                .collect::<Result<Vec<_>, _>>()?;
            let ty_id = c.u32()?;
            let ty = GgmlType::from_id(ty_id)
                .ok_or_else(|| format!("tensor '{name}': unsupported ggml type {ty_id}"))?;
            let offset = c.u64()? as usize;
            infos.push((name, dims, ty, offset));
        }
        let data_start = c.pos.div_ceil(alignment) * alignment;
        let mut tensors = Vec::with_capacity(n_tensors);
        for (name, dims, ty, offset) in infos {
            let numel = dims
                .iter()
                .try_fold(1usize, |a, &d| a.checked_mul(d))
                .ok_or_else(|| format!("tensor '{name}': dims {dims:?} overflow"))?;
            let (blk, bsize) = ty.block();
            if numel % blk != 0 {
                return Err(format!("tensor '{name}': {numel} elements is not a multiple of the {ty:?} block of {blk}"));
            }
            let nbytes = numel / blk * bsize;
            let start = data_start.checked_add(offset).ok_or("offset overflow")?;
            if start.checked_add(nbytes).is_none_or(|e| e > data.len()) {
                return Err(format!(
                    "truncated GGUF: tensor '{name}' needs bytes {start}..{} but the file has {}",
                    start + nbytes,
                    data.len()
                ));
            }
            tensors.push(GgufTensor {
                name,
                dims,
                ty,
                offset: start,
                nbytes,
            });
        }
        Ok((version, metadata, tensors))
    }

    pub fn get(&self, key: &str) -> Option<&Value> {
        self.metadata.get(key)
    }

    pub fn tensor(&self, name: &str) -> Option<&GgufTensor> {
        self.tensors.iter().find(|t| t.name == name)
    }

    pub fn raw(&self, t: &GgufTensor) -> &[u8] {
        &self.data[t.offset..t.offset + t.nbytes]
    }

    /// The tensor's values as f32, in ggml order (`dims[0]` fastest).
    pub fn dequantize(&self, t: &GgufTensor) -> Vec<f32> {
        dequantize(t.ty, self.raw(t), t.numel())
    }
}

fn f16_at(b: &[u8]) -> f32 {
    f16::from_le_bytes([b[0], b[1]]).to_f32()
}

/// Expands `numel` values of type `ty` from `raw` exactly as ggml defines each format.
/// `raw` must hold exactly the bytes for `numel` values (the reader guarantees it).
pub fn dequantize(ty: GgmlType, raw: &[u8], numel: usize) -> Vec<f32> {
    let mut out = Vec::with_capacity(numel);
    match ty {
        GgmlType::F32 => out.extend(
            raw.chunks_exact(4)
                .map(|b| f32::from_le_bytes(b.try_into().unwrap())),
        ),
        GgmlType::F16 => out.extend(raw.chunks_exact(2).map(f16_at)),
        GgmlType::BF16 => out.extend(
            raw.chunks_exact(2)
                .map(|b| bf16::from_le_bytes([b[0], b[1]]).to_f32()),
        ),
        GgmlType::Q8_0 => {
            for b in raw.chunks_exact(34) {
                let d = f16_at(&b[0..2]);
                out.extend(b[2..].iter().map(|&q| (q as i8) as f32 * d));
            }
        }
        GgmlType::Q4_0 => {
            for b in raw.chunks_exact(18) {
                let d = f16_at(&b[0..2]);
                let qs = &b[2..18];
                out.extend(qs.iter().map(|&q| ((q & 0x0f) as i32 - 8) as f32 * d));
                out.extend(qs.iter().map(|&q| ((q >> 4) as i32 - 8) as f32 * d));
            }
        }
        GgmlType::Q4_1 => {
            for b in raw.chunks_exact(20) {
                let d = f16_at(&b[0..2]);
                let m = f16_at(&b[2..4]);
                let qs = &b[4..20];
                out.extend(qs.iter().map(|&q| (q & 0x0f) as f32 * d + m));
                out.extend(qs.iter().map(|&q| (q >> 4) as f32 * d + m));
            }
        }
    }
    debug_assert_eq!(out.len(), numel);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dequantizes_blocks() {
        // Q4_1 block: d = 0.5, m = -1, nibbles 0..15 low, 15..0 high.
        let mut b = Vec::new();
        b.extend(f16::from_f32(0.5).to_le_bytes());
        b.extend(f16::from_f32(-1.0).to_le_bytes());
        for j in 0..16u8 {
            b.push(j | ((15 - j) << 4));
        }
        let v = dequantize(GgmlType::Q4_1, &b, 32);
        assert_eq!(v[0], -1.0);
        assert_eq!(v[15], 6.5);
        assert_eq!(v[16], 6.5);
        // Q8_0: d = 2, values -3 and 5.
        let mut b = Vec::new();
        b.extend(f16::from_f32(2.0).to_le_bytes());
        b.extend((0..32).map(|i| if i % 2 == 0 { (-3i8) as u8 } else { 5 }));
        let v = dequantize(GgmlType::Q8_0, &b, 32);
        assert_eq!(&v[..2], &[-6.0, 10.0]);
        // Q4_0: d = 1, nibble 0 -> -8.
        let mut b = Vec::new();
        b.extend(f16::from_f32(1.0).to_le_bytes());
        b.extend([0x80u8; 16]);
        let v = dequantize(GgmlType::Q4_0, &b, 32);
        assert_eq!((v[0], v[16]), (-8.0, 0.0));
    }

    #[test]
    fn rejects_bad_files() {
        let p = Path::new("m.gguf");
        let e = GgufFile::parse(p, b"GGML\x03\0\0\0".to_vec())
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("bad magic"), "{e}");
        let e = GgufFile::parse(p, b"GG".to_vec())
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("not a GGUF"), "{e}");
        let mut d = b"GGUF".to_vec();
        d.extend(3u32.to_le_bytes());
        d.extend(1u64.to_le_bytes());
        d.extend(u64::MAX.to_le_bytes());
        let e = GgufFile::parse(p, d).err().unwrap().to_string();
        assert!(e.contains("exceeds the file size"), "{e}");
    }
}
