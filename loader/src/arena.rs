//! A zeroed heap buffer aligned to 2 MiB and backed by transparent huge pages where allowed.
//!
//! Why not `Vec<u8>`: (1) direct I/O needs block-aligned buffers, and kernels read weights as
//! `&[f32]`/`&[u16]`; (2) on this class of machine a fresh 4 KiB page faults in at only ~2 GB/s,
//! slower than the disk, and decode over 4 KiB pages pays a TLB miss every few cache lines. An
//! anonymous mapping advised `MADV_HUGEPAGE` faults 2 MiB at a time and keeps the weights in few
//! TLB entries. The mapping is untouched until first written, so allocation itself is free.

use std::ptr::NonNull;

pub const ALIGN: usize = 4096;
const HUGE: usize = 2 << 20;

pub struct AlignedBuf {
    /// Start of the usable region (2 MiB aligned).
    ptr: NonNull<u8>,
    len: usize,
    /// The whole mapping, for munmap.
    map: *mut libc::c_void,
    map_len: usize,
}

// SAFETY: AlignedBuf owns its mapping exclusively, like a Vec<u8>.
unsafe impl Send for AlignedBuf {}
// SAFETY: shared references only give out `&[u8]`, like a Vec<u8>.
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    /// A zeroed buffer of `len` bytes. Panics only if the system is out of address space.
    pub fn zeroed(len: usize) -> AlignedBuf {
        Self::map(len, true)
    }

    /// The same without the huge-page advice: for memory written a little at a time over a
    /// long life (the KV store), where 2 MiB faults measured no faster than 4 KiB ones.
    pub fn zeroed_small_pages(len: usize) -> AlignedBuf {
        Self::map(len, false)
    }

    fn map(len: usize, huge: bool) -> AlignedBuf {
        if len == 0 {
            return AlignedBuf {
                ptr: NonNull::dangling(),
                len: 0,
                map: std::ptr::null_mut(),
                map_len: 0,
            };
        }
        let map_len = len + HUGE;
        // SAFETY: an anonymous private mapping with no address hint has no preconditions.
        let map = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                map_len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if map == libc::MAP_FAILED {
            panic!(
                "mmap of {map_len} bytes failed: {}",
                std::io::Error::last_os_error()
            );
        }
        let start = (map as usize).div_ceil(HUGE) * HUGE;
        if huge {
            // SAFETY: [start, start + len) lies inside the mapping (we over-allocated by HUGE);
            // madvise is only advice and failure is harmless (THP disabled), so its result is
            // ignored.
            unsafe {
                libc::madvise(
                    start as *mut libc::c_void,
                    len.div_ceil(HUGE) * HUGE,
                    libc::MADV_HUGEPAGE,
                )
            };
        }
        AlignedBuf {
            ptr: NonNull::new(start as *mut u8).expect("mmap returned null"),
            len,
            map,
            map_len,
        }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Start of the region (for code that hands out disjoint parts to different threads).
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: ptr is valid for len bytes of (zero-initialized) mapping, or dangling with len 0.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as above, and &mut self guarantees exclusive access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        if !self.map.is_null() {
            // SAFETY: unmaps exactly the mapping created in `zeroed`; no references outlive self.
            unsafe { libc::munmap(self.map, self.map_len) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aligned_and_zeroed() {
        let mut b = AlignedBuf::zeroed(10_000);
        assert_eq!(b.as_slice().as_ptr() as usize % ALIGN, 0);
        assert!(b.as_slice().iter().all(|&x| x == 0));
        b.as_mut_slice()[9_999] = 7;
        assert_eq!(b.as_slice()[9_999], 7);
        assert!(AlignedBuf::zeroed(0).is_empty());
    }
}
