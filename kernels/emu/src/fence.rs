//! Fenced host memory: the emulator's "device allocations", each placed so that its end meets
//! an inaccessible page (and a second one guards its start), as Electric Fence does.
//!
//! Why: on a GPU an out-of-bounds load either reads a neighbour's bytes silently or, past the
//! mapping, raises `CUDA_ERROR_ILLEGAL_ADDRESS` — a sticky error that poisons the context and
//! with it every later measurement of the process. Here such a load past an allocation's end
//! (by more than its rounding to 256 bytes, which `cuMemAlloc` also has) or well before its
//! start hits a guard page and the test process dies with SIGSEGV (emu.cpp names the kernel
//! that was running), so a kernel's tail handling is checked on the CPU, before a GPU sees it.

use std::ptr::NonNull;

/// Alignment of the data, as `cuMemAlloc`'s (at least 256 bytes).
pub const ALIGN: usize = 256;

fn page() -> usize {
    // SAFETY: sysconf has no preconditions.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if p > 0 {
        p as usize
    } else {
        4096
    }
}

/// `len` zeroed bytes, 256-byte aligned, whose 256-byte rounded end is the first byte of a
/// `PROT_NONE` page; another such page lies below the first data page.
pub struct Fenced {
    map: NonNull<u8>,
    map_len: usize,
    data: NonNull<u8>,
    len: usize,
}

// SAFETY: Fenced owns its mapping exclusively (like a Vec<u8>); moving it between threads
// moves that ownership.
unsafe impl Send for Fenced {}
// SAFETY: shared references only read (or hand out the address, as a device pointer is shared).
unsafe impl Sync for Fenced {}

impl Fenced {
    /// Panics if the mapping cannot be made (out of address space: a test machine problem).
    pub fn zeroed(len: usize) -> Fenced {
        let pg = page();
        let rounded = len.max(1).div_ceil(ALIGN) * ALIGN;
        let data_pages = rounded.div_ceil(pg);
        let map_len = (data_pages + 2) * pg;
        // SAFETY: an anonymous private mapping of fresh pages; no existing memory is touched.
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
        assert!(
            map != libc::MAP_FAILED,
            "emulator: mmap of {map_len} bytes failed"
        );
        let map = map as *mut u8;
        // SAFETY: both guard pages lie inside the mapping just made (first and last page).
        unsafe {
            let lo = libc::mprotect(map as *mut libc::c_void, pg, libc::PROT_NONE);
            let hi = libc::mprotect(
                map.add(map_len - pg) as *mut libc::c_void,
                pg,
                libc::PROT_NONE,
            );
            assert!(
                lo == 0 && hi == 0,
                "emulator: mprotect of a guard page failed"
            );
        }
        // SAFETY: map_len - pg - rounded ≥ pg (data_pages · pg ≥ rounded), so data starts after
        // the low guard page and its rounded end is the high guard page's first byte.
        let data = unsafe { map.add(map_len - pg - rounded) };
        Fenced {
            map: NonNull::new(map).expect("mmap returned null"),
            map_len,
            data: NonNull::new(data).expect("inside a mapping"),
            len,
        }
    }

    pub fn from_slice(bytes: &[u8]) -> Fenced {
        let mut f = Fenced::zeroed(bytes.len());
        f.as_mut_slice().copy_from_slice(bytes);
        f
    }

    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    pub fn as_ptr(&self) -> *const u8 {
        self.data.as_ptr()
    }
    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.data.as_ptr()
    }
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: len bytes from data lie inside the readable part of the mapping we own.
        unsafe { std::slice::from_raw_parts(self.data.as_ptr(), self.len) }
    }
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as above, and &mut self makes the access exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.data.as_ptr(), self.len) }
    }
}

impl Drop for Fenced {
    fn drop(&mut self) {
        // SAFETY: the mapping was made by `zeroed` with this length and is unmapped once.
        unsafe { libc::munmap(self.map.as_ptr() as *mut libc::c_void, self.map_len) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn data_is_aligned_zeroed_and_ends_at_the_guard() {
        for len in [0usize, 1, 255, 256, 257, 4096, 10_000] {
            let mut f = Fenced::zeroed(len);
            assert_eq!(f.as_ptr() as usize % ALIGN, 0);
            assert!(f.as_slice().iter().all(|&b| b == 0));
            f.as_mut_slice().fill(7);
            let end = f.as_ptr() as usize + len.max(1).div_ceil(ALIGN) * ALIGN;
            assert_eq!(
                end % page(),
                0,
                "len {len}: the rounded end is a page boundary"
            );
            assert_eq!(end, f.map.as_ptr() as usize + f.map_len - page());
        }
    }
}
