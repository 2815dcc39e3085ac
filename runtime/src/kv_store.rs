//! The memory under the CPU backend's KV store: one buffer of keys or of values, f32 or bf16
//! elements, in a page-aligned anonymous mapping
//! ([`thaw_loader::arena::AlignedBuf::zeroed_small_pages`]).
//!
//! Why not `Vec`: decode attention reads one KV head's row of a position (64 bf16 = 128 bytes
//! for the default model) at a stride of the whole KV row, so every row it reads is a separate
//! pair of cache lines — if rows start on a 64-byte boundary. A large `Vec` is a glibc `mmap`
//! chunk whose data starts 16 bytes into its page, so each 128-byte row straddled three lines:
//! `bench-coldstart kernels --attention` spent 1.6–2× as long a step over a 1 GiB store
//! (docs/PERFORMANCE.md, "Alignment of weights and KV rows"). The mapping is untouched until
//! written, so a large KV budget still costs nothing at start. Not advised for huge pages: with
//! aligned rows, 2 MiB pages measured no faster in the attention benchmark and slightly slower
//! serving 1024-token prompts (as session 8 had found for unaligned ones).

use thaw_kernels::ops::KvData;
use thaw_loader::arena::AlignedBuf;

use crate::model::KvDtype;

/// `len` elements of `dtype`, zeroed, cache-line (indeed page) aligned; grows by reallocating
/// (capacity at least doubles, so a single sequence's cache growing a block at a time copies
/// each element O(1) times).
pub(crate) struct KvBuf {
    buf: AlignedBuf,
    dtype: KvDtype,
    len: usize,
}

impl KvBuf {
    /// `n` zeros.
    pub(crate) fn zeros(dtype: KvDtype, n: usize) -> KvBuf {
        KvBuf {
            buf: AlignedBuf::zeroed_small_pages(n * dtype.bytes()),
            dtype,
            len: n,
        }
    }

    pub(crate) fn dtype(&self) -> KvDtype {
        self.dtype
    }

    /// Makes the buffer `n` elements long (never shorter); new elements are zero.
    pub(crate) fn grow(&mut self, n: usize) {
        if n <= self.len {
            return;
        }
        let size = self.dtype.bytes();
        if n * size > self.buf.len() {
            let cap = n.max(2 * self.len);
            let mut bigger = AlignedBuf::zeroed_small_pages(cap * size);
            bigger.as_mut_slice()[..self.len * size]
                .copy_from_slice(&self.buf.as_slice()[..self.len * size]);
            self.buf = bigger;
        }
        self.len = n;
    }

    /// Stores `row` (f32, rounded to bf16 for a bf16 store) at element `at`.
    pub(crate) fn write(&mut self, at: usize, row: &[f32]) {
        match self.dtype {
            KvDtype::F32 => self.elems_mut::<f32>()[at..at + row.len()].copy_from_slice(row),
            KvDtype::Bf16 => self.elems_mut::<u16>()[at..at + row.len()]
                .iter_mut()
                .zip(row)
                .for_each(|(o, &x)| *o = half::bf16::from_f32(x).to_bits()),
        }
    }

    /// The elements, typed for the attention kernels.
    pub(crate) fn data(&self) -> KvData<'_> {
        match self.dtype {
            KvDtype::F32 => KvData::F32(self.elems()),
            KvDtype::Bf16 => KvData::Bf16(self.elems()),
        }
    }

    /// The buffer as its `len` elements; `T` is the dtype's element (f32, or u16 bf16 bits).
    fn elems<T: Copy>(&self) -> &[T] {
        debug_assert_eq!(std::mem::size_of::<T>(), self.dtype.bytes());
        // SAFETY: the mapping is page aligned (so aligned for f32 and u16), holds at least
        // len × size zero-initialized bytes and lives as long as &self; any bit pattern is a
        // valid f32/u16 (the only `T`s used).
        unsafe { std::slice::from_raw_parts(self.buf.as_slice().as_ptr().cast(), self.len) }
    }

    fn elems_mut<T: Copy>(&mut self) -> &mut [T] {
        debug_assert_eq!(std::mem::size_of::<T>(), self.dtype.bytes());
        let p = self.buf.as_mut_slice().as_mut_ptr();
        // SAFETY: as in `elems`, with &mut self for exclusive access.
        unsafe { std::slice::from_raw_parts_mut(p.cast(), self.len) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn f32s(b: &KvBuf) -> &[f32] {
        match b.data() {
            KvData::F32(x) => x,
            KvData::Bf16(_) => panic!("bf16"),
        }
    }

    #[test]
    fn rows_are_cache_line_aligned_and_survive_growth() {
        let mut b = KvBuf::zeros(KvDtype::F32, 100);
        assert_eq!(f32s(&b).as_ptr() as usize % 64, 0);
        b.write(96, &[1.0, 2.0, 3.0, 4.0]);
        // Many small steps (a cache growing a block at a time) and one big one.
        for n in (101..5000).step_by(37).chain([1 << 20]) {
            b.grow(n);
            let x = f32s(&b);
            assert_eq!(x.len(), n);
            assert_eq!(x.as_ptr() as usize % 64, 0);
            assert_eq!(&x[96..100], &[1.0, 2.0, 3.0, 4.0]);
            assert!(x[100..].iter().all(|&v| v == 0.0));
        }
        b.grow(10); // never shrinks
        assert_eq!(f32s(&b).len(), 1 << 20);
    }

    #[test]
    fn bf16_rows_round_to_nearest() {
        let mut b = KvBuf::zeros(KvDtype::Bf16, 8);
        b.write(2, &[1.0, -2.5, 1.0 + 1.0 / 512.0]);
        let KvData::Bf16(x) = b.data() else {
            panic!("f32")
        };
        assert_eq!(x.as_ptr() as usize % 64, 0);
        let back: Vec<f32> = x
            .iter()
            .map(|&u| half::bf16::from_bits(u).to_f32())
            .collect();
        assert_eq!(back, [0.0, 0.0, 1.0, -2.5, 1.0, 0.0, 0.0, 0.0]);
    }
}
