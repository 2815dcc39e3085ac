//! Loaded weights in host memory: per shard either a huge-page arena the data was read into or a
//! mapping used in place, and typed views of each tensor with no further copy.

use crate::read::{self, Backing, LoadOptions, LoadStats, Progress};
use crate::{Checkpoint, Dtype, LoadError};

pub struct HostWeights {
    pub checkpoint: Checkpoint,
    backing: Vec<Backing>,
    data_offset: Vec<u64>,
    pub stats: LoadStats,
}

/// A tensor's bytes in host memory, with its dtype and shape.
#[derive(Clone, Copy)]
pub struct TensorView<'a> {
    pub dtype: Dtype,
    pub shape: &'a [usize],
    pub bytes: &'a [u8],
}

impl<'a> TensorView<'a> {
    /// The data as `i8` (I8 tensors: Q8_0 values), or `None` for other dtypes.
    pub fn as_i8(&self) -> Option<&'a [i8]> {
        if self.dtype != Dtype::I8 {
            return None;
        }
        // SAFETY: i8 and u8 have the same size and alignment, and every bit pattern is an i8.
        Some(unsafe { std::slice::from_raw_parts(self.bytes.as_ptr().cast(), self.bytes.len()) })
    }

    /// The data as `u16` words (BF16/F16), or `None` for other dtypes or a misaligned tensor.
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
    /// Loads every shard of `checkpoint` with the default options (strategy `auto`).
    pub fn load(checkpoint: Checkpoint) -> Result<HostWeights, LoadError> {
        Self::load_with(checkpoint, &LoadOptions::default(), &mut |_| {})
    }

    pub fn load_with(
        checkpoint: Checkpoint,
        opts: &LoadOptions,
        progress: &mut dyn FnMut(Progress),
    ) -> Result<HostWeights, LoadError> {
        let loaded = read::load(&checkpoint, opts, progress)?;
        Ok(HostWeights {
            checkpoint,
            backing: loaded.backing,
            data_offset: loaded.data_offset,
            stats: loaded.stats,
        })
    }

    /// Weights whose backing is being filled elsewhere (a streaming load).
    pub(crate) fn from_parts(
        checkpoint: Checkpoint,
        backing: Vec<Backing>,
        data_offset: Vec<u64>,
        stats: LoadStats,
    ) -> HostWeights {
        HostWeights {
            checkpoint,
            backing,
            data_offset,
            stats,
        }
    }

    /// Address of a tensor's first byte (no borrow of its bytes: for alignment checks while
    /// a streaming load may still be writing them).
    pub fn addr(&self, e: &crate::TensorEntry) -> usize {
        let base = self.data_offset[e.shard] as usize;
        self.backing[e.shard].range(0, 0).as_ptr() as usize + base + e.info.begin as usize
    }

    /// The bytes of a tensor found earlier with [`Checkpoint::get`] / [`Checkpoint::expect`].
    pub fn view<'a>(&'a self, e: &'a crate::TensorEntry) -> TensorView<'a> {
        let base = self.data_offset[e.shard] as usize;
        TensorView {
            dtype: e.info.dtype,
            shape: &e.info.shape,
            bytes: self.backing[e.shard]
                .range(base + e.info.begin as usize, base + e.info.end as usize),
        }
    }

    pub fn tensor(&self, name: &str) -> Result<TensorView<'_>, LoadError> {
        let e = self.checkpoint.get(name).ok_or_else(|| {
            LoadError::tensor(
                &self.checkpoint.dir,
                format!("checkpoint is missing tensor '{name}'"),
            )
        })?;
        Ok(self.view(e))
    }
}
