//! A `ram` namespace or disk: data in memory, reached with plain copies.
//! Several threads may share one (NVMe's queue groups): what concurrent
//! operations on the same bytes leave there is the host's concern (as with
//! any disk: two commands in flight on the same blocks leave them
//! unspecified), never memory outside the mapping.
//!
//! Its memory is either its own anonymous mapping ([`Ram::new`]: the data
//! dies with the process) or a range of a state memory ([`Ram::in_state`],
//! placed by [`crate::state::place_ram`]: a memfd the client holds and hands
//! to the next process of the device, which uses the data where it is, no
//! copy). Either way a map of written pages follows the data: a bit per
//! 4 KiB page, set before the page is first written and cleared after a
//! deallocation gave it back, so a page whose bit is clear holds zeros. In
//! a state memory the map outlives the process with the data, and a read
//! of a page never written fills zeros without touching it (a read fault on
//! a memfd's hole allocates a page, where an anonymous one maps the shared
//! zero page: a guest reading a whole disk would fill memory with zeros).
//! Moving into a fresh state memory copies the pages written, nothing else.
//!
//! A write's bytes are in the mapping's pages when `write` returns: a front
//! end that posts its completion after that (NVMe, virtio-blk) never
//! acknowledges data a kill of the process can lose, as stores the process
//! made stay in the memfd's pages (`nvme/state/mod.rs`, `virtio/state.rs`
//! give the order).

use crate::state::{RamPlace, StateMemory, RAM_PAGE as PAGE};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// A `ram` namespace: its data and its map of written pages, read and
/// written with plain copies through `&self` (several queue groups may
/// share it), every range checked against its length.
pub struct Ram {
    ptr: *mut u8,
    len: usize,
    /// The map of written pages: `len` pages' bits in whole words.
    bits: *const AtomicU64,
    /// Pages whose bit is set (kept here: the map is only read at resume).
    written: AtomicU64,
    home: Home,
}

enum Home {
    /// An anonymous private mapping of `len` bytes, the map after them
    /// (unmapped on drop).
    Anon { map_len: usize },
    /// A range of a state memory, whose mapping this keeps.
    State { _mapping: Arc<vm_memory::MmapRegion<()>> },
}

// SAFETY: a `Ram` owns its mapping outright (private, anonymous, tied to no
// thread) or holds a reference to the state memory's shared one: moving the
// value moves that ownership, and `Drop` unmaps its own from whichever
// thread holds the value last.
unsafe impl Send for Ram {}
// SAFETY: through `&self` the mapping is only reached by `read`, `write`,
// `zero` and `deallocate`, which check every range against `len` first and
// copy through the raw pointer, never forming a Rust reference into the
// data, and the map only as atomics, below its last word; `ptr`, `bits` and
// `len` never change after they are made. So shared use never touches
// memory outside the mapping. Two commands copying the same bytes at once
// (the host's concern, as on any disk) leave those bytes unspecified;
// nothing `Ram` relies on for its safety lives in the mapping.
unsafe impl Sync for Ram {}

impl Ram {
    /// `len` bytes of zeros in memory of its own (no memory is taken until written).
    pub fn new(len: u64) -> crate::Result<Ram> {
        let too_large =
            || crate::Error::Option { device: "nvme", option: "size_mb".into(), reason: "namespace too large".into() };
        let len = usize::try_from(len).map_err(|_| too_large())?;
        let home = RamPlace { at: 0, len };
        if len == 0 {
            let (ptr, bits) = (std::ptr::NonNull::dangling().as_ptr(), std::ptr::NonNull::dangling().as_ptr());
            return Ok(Ram { ptr, len, bits, written: 0.into(), home: Home::Anon { map_len: 0 } });
        }
        let map_len = home.end();
        let ptr = super::anon_map(map_len).map_err(|e| crate::Error::io("block: ram namespace memory", e))?;
        let ptr = ptr.cast::<u8>();
        // SAFETY: `map_at()` < `map_len`, inside the new mapping; page aligned.
        let bits = unsafe { ptr.add(home.map_at()) }.cast::<AtomicU64>();
        Ok(Ram { ptr, len, bits, written: 0.into(), home: Home::Anon { map_len } })
    }

    /// The storage at `place` in state memory `mem`: resumed (`from` None:
    /// the data and map as a dead process of the device left them, used in
    /// place; any bytes are valid data), or fresh (`from`: the range is
    /// freed, then the pages `from` wrote are copied in, the move into state
    /// memory of a storage that was elsewhere). An error if `place` does not
    /// lie in `mem` or `from` is of another size.
    pub fn in_state(mem: &StateMemory, place: RamPlace, from: Option<&Ram>) -> crate::Result<Ram> {
        if place.end() > mem.len() || !place.at.is_multiple_of(PAGE) {
            return Err(crate::Error::Host(format!(
                "state memory of {} bytes: no ram data of {} bytes at {}",
                mem.len(),
                place.len,
                place.at
            )));
        }
        let map = mem.mapping();
        let base = map.as_ptr();
        // SAFETY: both offsets lie inside the mapping (`end()` checked above),
        // page aligned; `map` keeps it mapped as long as the `Ram` lives.
        let (ptr, bits) = unsafe { (base.add(place.at), base.add(place.map_at()).cast::<AtomicU64>()) };
        let ram = Ram { ptr, len: place.len, bits, written: 0.into(), home: Home::State { _mapping: map } };
        match from {
            Some(old) => {
                if old.len != ram.len {
                    let (a, b) = (old.len, ram.len);
                    return Err(crate::Error::Host(format!("state memory: ram data of {a} bytes moved into {b}")));
                }
                mem.punch(place.at, place.end() - place.at)?;
                old.copy_written_into(&ram);
            }
            None => {
                let n: u64 = (0..ram.words())
                    .map(|w| (ram.word(w).load(Ordering::Acquire) & ram.mask(w)).count_ones() as u64)
                    .sum();
                ram.written.store(n, Ordering::Relaxed);
            }
        }
        Ok(ram)
    }

    /// The pages this one wrote, copied into `to` (empty, of its size).
    fn copy_written_into(&self, to: &Ram) {
        for w in 0..self.words() {
            let mut v = self.word(w).load(Ordering::Acquire) & self.mask(w);
            while v != 0 {
                let page = w * 64 + v.trailing_zeros() as usize;
                v &= v - 1;
                let (o, n) = (page * PAGE, PAGE.min(self.len - page * PAGE));
                to.mark(page, page + 1);
                // SAFETY: page < pages, so o..o+n lies in both mappings (same length).
                unsafe { std::ptr::copy_nonoverlapping(self.ptr.add(o), to.ptr.add(o), n) };
            }
        }
    }

    /// Words in the map.
    fn words(&self) -> usize {
        self.len.div_ceil(PAGE).div_ceil(64)
    }

    /// Word `w` of the map (`w` < `words()`).
    fn word(&self, w: usize) -> &AtomicU64 {
        debug_assert!(w < self.words());
        // SAFETY: the map holds `words()` words, 8-aligned (page aligned), in
        // the mapping, reached only as atomics.
        unsafe { &*self.bits.add(w) }
    }

    /// The bits of word `w` that stand for pages of the data.
    fn mask(&self, w: usize) -> u64 {
        let pages = self.len.div_ceil(PAGE);
        match pages - w * 64 {
            n if n >= 64 => u64::MAX,
            n => (1 << n) - 1,
        }
    }

    /// `f(word, mask)` for the words holding the bits of pages [first, end).
    fn each_word(&self, first: usize, end: usize, mut f: impl FnMut(&AtomicU64, u64)) {
        let mut p = first;
        while p < end {
            let (w, lo) = (p / 64, p % 64);
            let hi = (end - w * 64).min(64);
            let mask = if hi - lo == 64 { u64::MAX } else { ((1u64 << (hi - lo)) - 1) << lo };
            f(self.word(w), mask);
            p = w * 64 + hi;
        }
    }

    /// Pages [first, end) are about to be written: their bits set first (a
    /// process killed in between leaves a set bit over zeros, harmless).
    fn mark(&self, first: usize, end: usize) {
        self.each_word(first, end, |word, mask| {
            if word.load(Ordering::Relaxed) & mask != mask {
                // AcqRel: the data stores after stay after (on x86 a locked
                // instruction, a full barrier).
                let old = word.fetch_or(mask, Ordering::AcqRel);
                self.written.fetch_add((mask & !old).count_ones() as u64, Ordering::Relaxed);
            }
        });
    }

    /// Pages [first, end) were given back: their bits cleared.
    fn unmark(&self, first: usize, end: usize) {
        self.each_word(first, end, |word, mask| {
            if word.load(Ordering::Relaxed) & mask != 0 {
                let old = word.fetch_and(!mask, Ordering::AcqRel);
                self.written.fetch_sub((mask & old).count_ones() as u64, Ordering::Relaxed);
            }
        });
    }

    fn is_written(&self, page: usize) -> bool {
        self.word(page / 64).load(Ordering::Acquire) >> (page % 64) & 1 == 1
    }

    /// The pages of `n` > 0 bytes at `o`.
    fn pages(o: usize, n: usize) -> (usize, usize) {
        (o / PAGE, (o + n - 1) / PAGE + 1)
    }

    /// `f(offset, bytes, written)` for each page's part of `n` bytes at `o`, in order.
    fn each_page(&self, o: usize, n: usize, mut f: impl FnMut(usize, usize, bool)) {
        let end = o + n;
        let mut at = o;
        while at < end {
            let k = (PAGE - at % PAGE).min(end - at);
            f(at, k, self.is_written(at / PAGE));
            at += k;
        }
    }

    /// The byte offset of `n` bytes at `off`, if they lie in the mapping.
    fn at(&self, off: u64, n: usize) -> Option<usize> {
        let off = usize::try_from(off).ok()?;
        (off.checked_add(n)? <= self.len).then_some(off)
    }

    pub fn read(&self, off: u64, buf: &mut [u8]) -> bool {
        let Some(o) = self.at(off, buf.len()) else { return false };
        if matches!(self.home, Home::Anon { .. }) {
            // SAFETY: o..o+len lies in the mapping (checked); `buf` is ours.
            unsafe { std::ptr::copy_nonoverlapping(self.ptr.add(o), buf.as_mut_ptr(), buf.len()) };
            return true;
        }
        // A memfd: pages never written are not touched (zeros).
        self.each_page(o, buf.len(), |at, k, written| {
            let to = &mut buf[at - o..at - o + k];
            if written {
                // SAFETY: at..at+k lies in the checked range; `to` is ours.
                unsafe { std::ptr::copy_nonoverlapping(self.ptr.add(at), to.as_mut_ptr(), k) };
            } else {
                to.fill(0);
            }
        });
        true
    }

    pub fn write(&self, off: u64, buf: &[u8]) -> bool {
        let Some(o) = self.at(off, buf.len()) else { return false };
        if buf.is_empty() {
            return true;
        }
        let (first, end) = Self::pages(o, buf.len());
        self.mark(first, end);
        // SAFETY: as in `read`.
        unsafe { std::ptr::copy_nonoverlapping(buf.as_ptr(), self.ptr.add(o), buf.len()) };
        true
    }

    /// Zeroes `len` bytes at `off`: the pages among them never written
    /// hold zeros already and are left untouched.
    pub fn zero(&self, off: u64, len: u64) -> bool {
        let Ok(n) = usize::try_from(len) else { return false };
        let Some(o) = self.at(off, n) else { return false };
        self.each_page(o, n, |at, k, written| {
            if written {
                // SAFETY: at..at+k lies in the checked range.
                unsafe { std::ptr::write_bytes(self.ptr.add(at), 0, k) };
            }
        });
        true
    }

    /// Zeroes `len` bytes at `off` and gives the memory of the whole pages
    /// among them back (anonymous: MADV_DONTNEED; in state memory:
    /// MADV_REMOVE, which frees the memfd's pages; either way they read as
    /// zeros and take no memory until written again), so that a discard of
    /// the whole disk (mkfs does one) frees it rather than filling it with
    /// zeros.
    pub fn deallocate(&self, off: u64, len: u64) -> bool {
        let Ok(n) = usize::try_from(len) else { return false };
        let Some(o) = self.at(off, n) else { return false };
        // The whole pages inside [o, o + n); the mapping is page aligned.
        let (first, end) = (o.next_multiple_of(PAGE), (o + n) / PAGE * PAGE);
        if first >= end {
            return self.zero(off, len);
        }
        let advice = match self.home {
            Home::Anon { .. } => libc::MADV_DONTNEED,
            Home::State { .. } => libc::MADV_REMOVE,
        };
        // SAFETY: first..end lies in the mapping (inside the checked range)
        // and is page aligned; a page given back reads as zeros at its next
        // touch. No Rust reference into the data exists (every access is a
        // copy through the pointer).
        let r = unsafe { libc::madvise(self.ptr.add(first).cast(), end - first, advice) };
        if r != 0 {
            return self.zero(off, len); // zeros all the same, without freeing
        }
        self.unmark(first / PAGE, end / PAGE);
        self.zero(off, (first - o) as u64) && self.zero(end as u64, (o + n - end) as u64)
    }

    /// Its size in bytes.
    pub fn len(&self) -> u64 {
        self.len as u64
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The bytes of its pages written (and not given back since): the
    /// memory its data takes.
    pub fn written_bytes(&self) -> u64 {
        self.written.load(Ordering::Relaxed) * PAGE as u64
    }

    /// Its data lies in a state memory (outlives the process).
    pub fn in_state_memory(&self) -> bool {
        matches!(self.home, Home::State { .. })
    }
}

impl Drop for Ram {
    fn drop(&mut self) {
        if let Home::Anon { map_len } = self.home {
            if map_len > 0 {
                // SAFETY: the mapping made in `new`, no longer reachable.
                unsafe { libc::munmap(self.ptr.cast(), map_len) };
            }
        }
    }
}

#[cfg(test)]
#[path = "ram_tests.rs"]
mod tests;
