//! The simple host strategy: every shard's data section read into one aligned arena with large
//! positioned reads, tensors handed out as views. (The streaming strategies of the loader issue
//! replace how the arenas are filled, not what callers see.)

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::time::{Duration, Instant};

use crate::{AlignedBuf, Checkpoint, Dtype, LoadError};

const READ_CHUNK: usize = 16 << 20;

pub struct HostWeights {
    pub checkpoint: Checkpoint,
    arenas: Vec<AlignedBuf>,
    pub bytes: u64,
    pub elapsed: Duration,
}

/// A tensor's bytes in host memory, with its dtype and shape.
#[derive(Clone, Copy)]
pub struct TensorView<'a> {
    pub dtype: Dtype,
    pub shape: &'a [usize],
    pub bytes: &'a [u8],
}

impl<'a> TensorView<'a> {
    /// The data as `u16` words (BF16/F16), or `None` for other dtypes.
    pub fn as_u16(&self) -> Option<&'a [u16]> {
        if !matches!(self.dtype, Dtype::BF16 | Dtype::F16) {
            return None;
        }
        // SAFETY: any bit pattern is a valid u16; align_to only yields the aligned middle.
        let (head, mid, tail) = unsafe { self.bytes.align_to::<u16>() };
        (head.is_empty() && tail.is_empty()).then_some(mid)
    }

    pub fn as_f32(&self) -> Option<&'a [f32]> {
        if self.dtype != Dtype::F32 {
            return None;
        }
        // SAFETY: any bit pattern is a valid f32; align_to only yields the aligned middle.
        let (head, mid, tail) = unsafe { self.bytes.align_to::<f32>() };
        (head.is_empty() && tail.is_empty()).then_some(mid)
    }
}

impl HostWeights {
    /// Reads every shard of `checkpoint` into memory.
    pub fn load(checkpoint: Checkpoint) -> Result<HostWeights, LoadError> {
        let t0 = Instant::now();
        let mut arenas = Vec::with_capacity(checkpoint.shards.len());
        let mut bytes = 0;
        for shard in &checkpoint.shards {
            let path = &shard.path;
            let f = File::open(path).map_err(|e| LoadError::io(path, e))?;
            let now_len = f.metadata().map_err(|e| LoadError::io(path, e))?.len();
            if now_len < shard.data_start + shard.data_len {
                return Err(LoadError::invalid(
                    path,
                    format!("file shrank to {now_len} bytes since its header was read (needs {})", shard.data_start + shard.data_len),
                ));
            }
            let mut arena = AlignedBuf::zeroed(shard.data_len as usize);
            let buf = arena.as_mut_slice();
            let mut done = 0usize;
            while done < buf.len() {
                let n = READ_CHUNK.min(buf.len() - done);
                f.read_exact_at(&mut buf[done..done + n], shard.data_start + done as u64)
                    .map_err(|e| {
                        let at = shard.data_start + done as u64;
                        if e.kind() == std::io::ErrorKind::UnexpectedEof {
                            LoadError::invalid(path, format!("file ended during the load, reading bytes {at}..{}", at + n as u64))
                        } else {
                            LoadError::io(path, e)
                        }
                    })?;
                done += n;
            }
            bytes += shard.data_len;
            arenas.push(arena);
        }
        Ok(HostWeights {
            checkpoint,
            arenas,
            bytes,
            elapsed: t0.elapsed(),
        })
    }

    /// The bytes of a tensor found earlier with [`Checkpoint::get`] / [`Checkpoint::expect`].
    pub fn view<'a>(&'a self, e: &'a crate::TensorEntry) -> TensorView<'a> {
        let arena = self.arenas[e.shard].as_slice();
        TensorView {
            dtype: e.info.dtype,
            shape: &e.info.shape,
            bytes: &arena[e.info.begin as usize..e.info.end as usize],
        }
    }

    pub fn tensor(&self, name: &str) -> Result<TensorView<'_>, LoadError> {
        let e = self
            .checkpoint
            .get(name)
            .ok_or_else(|| LoadError::tensor(&self.checkpoint.dir, format!("checkpoint is missing tensor '{name}'")))?;
        let arena = self.arenas[e.shard].as_slice();
        Ok(TensorView {
            dtype: e.info.dtype,
            shape: &e.info.shape,
            bytes: &arena[e.info.begin as usize..e.info.end as usize],
        })
    }
}
