//! A `ram` namespace: data in anonymous memory, reached with plain copies.
//! Several threads may share one (NVMe's queue groups): what concurrent
//! operations on the same bytes leave there is the host's concern (as with
//! any disk: two commands in flight on the same blocks leave them
//! unspecified), never memory outside the mapping.

/// A `ram` namespace: an anonymous private mapping (pages appear on first
/// touch), read and written with plain copies through `&self` (several
/// queue groups may share it), every range checked against its length.
pub struct Ram {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: a `Ram` owns its mapping outright (private, anonymous, tied to no
// thread): moving the value moves that ownership, and `Drop` unmaps it from
// whichever thread holds the value last.
unsafe impl Send for Ram {}
// SAFETY: through `&self` the mapping is only reached by `read`, `write`,
// `zero` and `deallocate`, which check every range against `len` first and
// copy through the raw pointer, never forming a Rust reference into the
// mapping; `ptr` and `len` never change after `new`. So shared use never
// touches memory outside the mapping. Two commands copying the same bytes at
// once (the host's concern, as on any disk) leave those bytes unspecified;
// nothing `Ram` relies on lives in the mapping.
unsafe impl Sync for Ram {}

impl Ram {
    /// `len` bytes of zeros (no memory is taken until written).
    pub fn new(len: u64) -> crate::Result<Ram> {
        let too_large =
            || crate::Error::Option { device: "nvme", option: "size_mb".into(), reason: "namespace too large".into() };
        let len = usize::try_from(len).map_err(|_| too_large())?;
        if len == 0 {
            return Ok(Ram { ptr: std::ptr::NonNull::dangling().as_ptr(), len });
        }
        let ptr = super::anon_map(len).map_err(|e| crate::Error::io("block: ram namespace memory", e))?;
        Ok(Ram { ptr: ptr.cast(), len })
    }

    /// The byte offset of `n` bytes at `off`, if they lie in the mapping.
    fn at(&self, off: u64, n: usize) -> Option<usize> {
        let off = usize::try_from(off).ok()?;
        (off.checked_add(n)? <= self.len).then_some(off)
    }

    pub fn read(&self, off: u64, buf: &mut [u8]) -> bool {
        let Some(o) = self.at(off, buf.len()) else { return false };
        // SAFETY: o..o+len lies in the mapping (checked); `buf` is ours.
        unsafe { std::ptr::copy_nonoverlapping(self.ptr.add(o), buf.as_mut_ptr(), buf.len()) };
        true
    }

    pub fn write(&self, off: u64, buf: &[u8]) -> bool {
        let Some(o) = self.at(off, buf.len()) else { return false };
        // SAFETY: as in `read`.
        unsafe { std::ptr::copy_nonoverlapping(buf.as_ptr(), self.ptr.add(o), buf.len()) };
        true
    }

    pub fn zero(&self, off: u64, len: u64) -> bool {
        let Ok(n) = usize::try_from(len) else { return false };
        let Some(o) = self.at(off, n) else { return false };
        // SAFETY: as in `read`.
        unsafe { std::ptr::write_bytes(self.ptr.add(o), 0, n) };
        true
    }

    /// Zeroes `len` bytes at `off` and gives the memory of the whole pages
    /// among them back (MADV_DONTNEED: they read as zeros and take no
    /// memory until written again), so that a discard of the whole disk
    /// (mkfs does one) frees it rather than filling it with zeros.
    pub fn deallocate(&self, off: u64, len: u64) -> bool {
        const PAGE: usize = 4096;
        let Ok(n) = usize::try_from(len) else { return false };
        let Some(o) = self.at(off, n) else { return false };
        // The whole pages inside [o, o + n); the mapping is page aligned.
        let (first, end) = (o.next_multiple_of(PAGE), (o + n) / PAGE * PAGE);
        if first >= end {
            return self.zero(off, len);
        }
        // SAFETY: first..end lies in the mapping (inside the checked range)
        // and is page aligned; a private anonymous page given back reads as
        // zeros at its next touch. No Rust reference into the mapping exists
        // (every access is a copy through the pointer).
        let r = unsafe { libc::madvise(self.ptr.add(first).cast(), end - first, libc::MADV_DONTNEED) };
        if r != 0 {
            return self.zero(off, len); // zeros all the same, without freeing
        }
        self.zero(off, (first - o) as u64) && self.zero(end as u64, (o + n - end) as u64)
    }

    /// Its size in bytes.
    pub fn len(&self) -> u64 {
        self.len as u64
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl Drop for Ram {
    fn drop(&mut self) {
        if self.len == 0 {
            return; // nothing was mapped
        }
        // SAFETY: the mapping made in `new`, no longer reachable.
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn copies_stay_inside_the_namespace() {
        let r = super::Ram::new(8192).unwrap();
        assert!(r.write(4096, &[7u8; 512]));
        let mut b = [0u8; 512];
        assert!(r.read(4096, &mut b) && b == [7u8; 512]);
        assert!(r.zero(4096, 256) && r.read(4096, &mut b) && b[..256] == [0u8; 256] && b[256..] == [7u8; 256]);
        assert!(!r.write(8192 - 511, &[1u8; 512]), "past the end");
        assert!(!r.read(u64::MAX, &mut b), "offset overflow");
        assert!(!r.zero(1, u64::MAX), "length overflow");
    }

    /// Pages of the mapping in memory, per mincore(2).
    fn resident(r: &super::Ram) -> Vec<bool> {
        let pages = r.len.div_ceil(4096);
        let mut v = vec![0u8; pages];
        // SAFETY: the mapping is ours, page aligned, `pages` pages long; `v` has a byte per page.
        assert_eq!(unsafe { libc::mincore(r.ptr.cast(), r.len, v.as_mut_ptr()) }, 0);
        v.iter().map(|&b| b & 1 == 1).collect()
    }

    /// A deallocated range reads as zeros and its whole pages leave memory;
    /// the pages it only partly covers keep their other bytes.
    #[test]
    fn deallocation_gives_whole_pages_back_and_zeroes_the_edges() {
        let r = super::Ram::new(16 * 4096).unwrap();
        assert!(r.write(0, &[9u8; 16 * 4096]));
        assert!(resident(&r).iter().all(|&p| p), "written: every page in memory");
        // From the middle of page 2 to the middle of page 9.
        let (off, len) = (2 * 4096 + 100, 7 * 4096);
        assert!(r.deallocate(off, len));
        let res = resident(&r);
        assert!(res[3..9].iter().all(|&p| !p), "whole pages given back: {res:?}");
        assert!(res[2] && res[9], "the edge pages stay: {res:?}");
        let mut all = vec![0xffu8; 16 * 4096];
        assert!(r.read(0, &mut all));
        let (a, b) = (off as usize, (off + len) as usize);
        assert!(all[..a].iter().all(|&x| x == 9) && all[b..].iter().all(|&x| x == 9), "outside kept");
        assert!(all[a..b].iter().all(|&x| x == 0), "inside reads as zeros");
        // Inside one page: zeroed only; bounds as for every operation.
        assert!(r.deallocate(4096 + 10, 20) && r.read(4096, &mut all[..64]) && all[10..30] == [0u8; 20]);
        assert!(!r.deallocate(16 * 4096 - 10, 11), "past the end");
        assert!(!r.deallocate(u64::MAX - 1, 4), "offset overflow");
        assert!(r.deallocate(16 * 4096, 0), "empty at the end");
        let empty = super::Ram::new(0).unwrap();
        assert!(empty.is_empty() && empty.deallocate(0, 0) && !empty.write(0, &[1]));
    }
}
