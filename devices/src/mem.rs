//! Guest memory as a device model reaches it: [`GuestMem`].
//!
//! Most of the time guest RAM is mapped into this process (the VMM's own
//! memfd, or the fds a vfio-user or mpqemu client passed): a
//! [`GuestMemoryMmap`], accessed in place, with atomics where the device
//! needs ordering. A vfio-user client may also offer RAM without an fd (QEMU
//! with guest RAM that is not `share=on`); the device then reaches those
//! ranges through a [`DmaPort`] its host provides (vfio-user DMA_READ and
//! DMA_WRITE messages to the client). One memory may mix both: every access
//! is routed per address range, and an access that spans a mapped region and
//! a remote range is split between them.
//!
//! Cost: with no remote range (every host but a vfio-user server given RAM
//! without an fd) an access is one `match` in front of the `vm_memory` call
//! it was before; nothing is allocated and nothing is dispatched
//! dynamically.
//!
//! Ordering and atomicity: mapped memory is accessed as `vm_memory` does,
//! with `load_u32`/`store_u32` atomic and ordered as asked. Remote memory is
//! a message per access: a 4-byte load or store is one DMA_READ or
//! DMA_WRITE, atomic only as far as the client applies one message at once
//! (QEMU copies the 4 bytes with the big lock held), and ordered by message
//! order (a client serves them one after another). `Ordering` has no other
//! meaning there.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use vm_memory::{
    ByteValued, Bytes, GuestAddress, GuestMemoryBackend, GuestMemoryMmap, GuestMemoryRegion, GuestRegionMmap,
    MemoryRegionAddress,
};

/// Why a guest memory access failed.
#[derive(Debug, thiserror::Error)]
pub enum MemError {
    /// Some of the range is not guest memory (or wraps the address space).
    #[error("{len} bytes at {gpa:#x}: not guest memory")]
    Unmapped { gpa: u64, len: usize },
    /// An atomic access that is not naturally aligned.
    #[error("{len}-byte access at {gpa:#x}: not aligned")]
    Misaligned { gpa: u64, len: usize },
    /// The host could not reach remote memory (the client refused, did not
    /// answer in time, or went away).
    #[error("{len} bytes at {gpa:#x}: {reason}")]
    Remote { gpa: u64, len: usize, reason: String },
}

pub type Result<T, E = MemError> = std::result::Result<T, E>;

/// Guest memory the host reaches on the device's behalf: a read or write
/// of `len` bytes at `gpa` wholly inside one of the ranges the host gave
/// with the port (the caller splits accesses at range ends). Called from any
/// device thread, with device locks held; it may block (a message and its
/// reply), and must give up in bounded time.
pub trait DmaPort: Send + Sync {
    fn read(&self, gpa: u64, buf: &mut [u8]) -> Result<()>;
    fn write(&self, gpa: u64, data: &[u8]) -> Result<()>;
}

/// Ranges of guest memory reached through a [`DmaPort`].
struct Remote {
    /// Sorted, disjoint `[start, end)` ranges.
    ranges: Vec<(u64, u64)>,
    port: Arc<dyn DmaPort>,
}

impl Remote {
    /// The range holding `gpa`: its end.
    fn end_of(&self, gpa: u64) -> Option<u64> {
        let i = self.ranges.partition_point(|&(s, _)| s <= gpa);
        let (_, e) = *self.ranges.get(i.checked_sub(1)?)?;
        (gpa < e).then_some(e)
    }
}

/// One piece of an access: mapped (the region and the offset in it) or remote.
enum Piece<'a> {
    Mapped(&'a GuestRegionMmap, MemoryRegionAddress),
    Remote(&'a dyn DmaPort),
}

/// Guest memory as a device sees it: mapped regions, and, when the host
/// has some, ranges it reaches through a [`DmaPort`]. Cheap to clone.
#[derive(Clone, Default)]
pub struct GuestMem {
    mapped: GuestMemoryMmap,
    remote: Option<Arc<Remote>>,
    /// Which memory this is: every construction gets its own (clones share
    /// it), so a [`Resolved`] range from another memory is never used here.
    id: u64,
    /// The largest mapped region, resolved once: the per-I/O checks (PRPs,
    /// shadow doorbells) that fall in it skip vm-memory's region lookup.
    main: Main,
    /// The mapped memory is in huge pages, as far as the kernel grants them
    /// ([`in_huge_pages`](Self::in_huge_pages)): known from the mapped fds,
    /// or said by the host of anonymous memory.
    huge: bool,
    /// Mappings that regions of `mapped` are windows into (see [`Keeper`]).
    _keep: Option<Arc<[Keeper]>>,
}

/// Keeps mapped what a region maps without owning it. A hugetlbfs fd can
/// only be mapped from an offset its huge pages align with; a client's
/// region that starts elsewhere (QEMU maps guest RAM above 1 MiB from
/// offset 0x100000 of its memfd) is then a window into a mapping of the
/// whole pages around it, which must live as long as the region is used:
/// every [`GuestMem`] clone holds it.
pub type Keeper = Arc<dyn std::any::Any + Send + Sync>;

/// A mapped region's `[start, end)` and host address (all 0: none).
#[derive(Clone, Copy, Default)]
struct Main {
    start: u64,
    end: u64,
    host: usize,
}

impl Main {
    fn of(mapped: &GuestMemoryMmap) -> Main {
        let Some(r) = mapped.iter().max_by_key(|r| r.len()) else { return Main::default() };
        match r.get_host_address(MemoryRegionAddress(0)) {
            Ok(h) => Main { start: r.start_addr().0, end: region_end(r), host: h as usize },
            Err(_) => Main::default(),
        }
    }

    /// The host address of `[gpa, gpa + len)` if it lies wholly in this region.
    #[inline]
    fn host(&self, gpa: u64, len: u64) -> Option<usize> {
        let end = gpa.checked_add(len)?;
        (gpa >= self.start && end <= self.end && self.host != 0).then(|| self.host + (gpa - self.start) as usize)
    }
}

/// The next [`GuestMem::id`] (0 is the empty default's).
fn next_id() -> u64 {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

impl From<GuestMemoryMmap> for GuestMem {
    fn from(mapped: GuestMemoryMmap) -> Self {
        let huge = mapped_in_huge_pages(&mapped);
        GuestMem { main: Main::of(&mapped), mapped, remote: None, id: next_id(), huge, _keep: None }
    }
}

/// True if every region of `mapped` (there is one at least) maps an fd
/// whose pages are huge ([`crate::hugepages`]). Anonymous memory says no:
/// its owner marks it ([`GuestMem::with_huge_pages`]).
fn mapped_in_huge_pages(mapped: &GuestMemoryMmap) -> bool {
    mapped.num_regions() > 0 && mapped.iter().all(crate::hugepages::region_in_huge_pages)
}

/// A range of mapped guest memory resolved once to its host address, for
/// what a device reads or writes on every I/O (a queue's ring): no region
/// lookup per access. Valid only with the [`GuestMem`] it was resolved from
/// (checked on each use: its mapping cannot change while one of its clones
/// lives, and any other memory has another id).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Resolved {
    host: usize,
    len: usize,
    mem: u64,
}

impl std::fmt::Debug for GuestMem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mapped: Vec<(u64, u64)> = self.mapped.iter().map(|r| (r.start_addr().0, r.len())).collect();
        let remote = self.remote.as_ref().map(|r| r.ranges.clone()).unwrap_or_default();
        f.debug_struct("GuestMem").field("mapped", &mapped).field("remote", &remote).finish()
    }
}

/// The end (exclusive) of a mapped region, saturated at the top of the address space.
fn region_end(r: &GuestRegionMmap) -> u64 {
    r.last_addr().0.saturating_add(1)
}

impl GuestMem {
    /// `mapped` plus the `(gpa, size)` ranges `port` reaches. The ranges may
    /// come in any order; they must not be empty, wrap, overlap each other
    /// or a mapped region. No range is the same as `mapped` alone.
    pub fn with_remote(mapped: GuestMemoryMmap, ranges: &[(u64, u64)], port: Arc<dyn DmaPort>) -> Result<Self> {
        let mut r: Vec<(u64, u64)> = Vec::with_capacity(ranges.len());
        for &(gpa, size) in ranges {
            let end = gpa.checked_add(size).filter(|_| size > 0);
            r.push((gpa, end.ok_or(MemError::Unmapped { gpa, len: size as usize })?));
        }
        r.sort_unstable();
        for (i, &(s, e)) in r.iter().enumerate() {
            let overlaps_next = r.get(i + 1).is_some_and(|&(n, _)| n < e);
            let overlaps_mapped = overlaps_mapped(&mapped, s, e);
            if overlaps_next || overlaps_mapped {
                return Err(MemError::Remote { gpa: s, len: (e - s) as usize, reason: "overlaps other memory".into() });
            }
        }
        let remote = (!r.is_empty()).then(|| Arc::new(Remote { ranges: r, port }));
        let huge = mapped_in_huge_pages(&mapped);
        Ok(GuestMem { main: Main::of(&mapped), mapped, remote, id: next_id(), huge, _keep: None })
    }

    /// The same memory, marked as advised for (transparent) huge pages by
    /// its host (for anonymous memory; a mapped fd's pages are known from
    /// the fd when the memory is made).
    pub fn with_huge_pages(self, huge: bool) -> Self {
        GuestMem { huge, ..self }
    }

    /// True if the mapped memory is in huge pages (hugetlbfs, or advised for
    /// transparent ones where the kernel grants them): pages that follow each other in guest memory
    /// then mostly follow each other in host memory too, so a transfer over
    /// several reaches a disk as one segment.
    pub fn in_huge_pages(&self) -> bool {
        self.huge
    }

    /// The same memory, holding `keep` (the mappings its regions are
    /// windows into) as long as it or a clone of it lives.
    pub fn keeping(self, keep: Vec<Keeper>) -> Self {
        GuestMem { _keep: (!keep.is_empty()).then(|| keep.into()), ..self }
    }

    /// The mapped part (what a host can pass on as fds). Its regions may be
    /// windows into mappings this memory keeps ([`Keeper`]): a thread that
    /// uses it holds a clone of this `GuestMem`, not of the
    /// `GuestMemoryMmap` alone.
    pub fn mapped(&self) -> &GuestMemoryMmap {
        &self.mapped
    }

    /// The `[start, end)` ranges reached through the port (none: all mapped).
    pub fn remote_ranges(&self) -> &[(u64, u64)] {
        self.remote.as_ref().map_or(&[], |r| &r.ranges)
    }

    /// No memory at all (a host whose client left).
    pub fn is_empty(&self) -> bool {
        self.mapped.num_regions() == 0 && self.remote.is_none()
    }

    /// True if `gpa` is guest memory, mapped or remote.
    pub fn address_in_range(&self, gpa: u64) -> bool {
        self.mapped.address_in_range(GuestAddress(gpa)) || self.remote.as_ref().is_some_and(|r| r.end_of(gpa).is_some())
    }

    /// True if `[gpa, gpa + len)` is wholly guest memory (mapped, remote, or
    /// both); an empty range is, a wrapping one is not.
    pub fn range_ok(&self, gpa: u64, len: u64) -> bool {
        let Some(end) = gpa.checked_add(len) else { return false };
        if len == 0 || self.main.host(gpa, len).is_some() {
            return true;
        }
        if let Some(r) = self.mapped.find_region(GuestAddress(gpa)) {
            if end <= region_end(r) {
                return true; // the usual case: one mapped region
            }
        }
        self.walk(gpa, len as usize, |_, _, _, _| Ok(())).is_ok()
    }

    /// True if `[gpa, gpa + len)` is wholly mapped memory, which the device
    /// may poll without a message per look (shadow doorbells).
    pub fn range_mapped(&self, gpa: u64, len: u64) -> bool {
        let Some(end) = gpa.checked_add(len) else { return false };
        let mut a = gpa;
        while a < end {
            let Some(r) = self.mapped.find_region(GuestAddress(a)) else { return false };
            a = region_end(r).min(end);
        }
        true
    }

    /// Calls `f(piece, gpa, offset in the access, length)` for each piece of
    /// `[gpa, gpa + len)`, in address order; fails before the first call if
    /// any of it is not guest memory.
    fn walk(&self, gpa: u64, len: usize, mut f: impl FnMut(Piece<'_>, u64, usize, usize) -> Result<()>) -> Result<()> {
        let unmapped = || MemError::Unmapped { gpa, len };
        let end = gpa.checked_add(len as u64).ok_or_else(unmapped)?;
        let remote = self.remote.as_deref();
        let piece_at = |a: u64| -> Option<(Piece<'_>, u64)> {
            if let Some(r) = self.mapped.find_region(GuestAddress(a)) {
                let off = MemoryRegionAddress(a - r.start_addr().0);
                return Some((Piece::Mapped(r, off), region_end(r)));
            }
            let e = remote?.end_of(a)?;
            Some((Piece::Remote(&*remote?.port), e))
        };
        // Check the whole range first: a failed access does nothing.
        let mut a = gpa;
        while a < end {
            let (_, e) = piece_at(a).ok_or_else(unmapped)?;
            a = e.min(end);
        }
        let mut a = gpa;
        while a < end {
            let (p, e) = piece_at(a).ok_or_else(unmapped)?;
            let n = (e.min(end) - a) as usize;
            f(p, a, (a - gpa) as usize, n)?;
            a += n as u64;
        }
        Ok(())
    }

    /// `[gpa, gpa + len)` resolved to its host address if it lies wholly in
    /// one mapped region and starts aligned to `align` bytes (a power of two).
    pub fn resolve(&self, gpa: u64, len: usize, align: usize) -> Option<Resolved> {
        let end = gpa.checked_add(len as u64)?;
        let r = self.mapped.find_region(GuestAddress(gpa))?;
        if end > region_end(r) || len == 0 {
            return None;
        }
        let host = r.get_host_address(MemoryRegionAddress(gpa - r.start_addr().0)).ok()? as usize;
        host.is_multiple_of(align).then_some(Resolved { host, len, mem: self.id })
    }

    /// The host address of `[gpa, gpa + len)` if it lies wholly in one
    /// mapped region (len > 0): for the kernel to move data to or from in
    /// place. Valid while this memory or one of its clones lives.
    pub fn host_address(&self, gpa: u64, len: usize) -> Option<usize> {
        match self.main.host(gpa, len as u64) {
            Some(h) if len > 0 => Some(h),
            _ => self.resolve(gpa, len, 1).map(|r| r.host),
        }
    }

    /// True if `other` is this memory (a clone of it), not another one.
    pub fn same(&self, other: &GuestMem) -> bool {
        self.id == other.id
    }

    /// The host address of `[off, off + n)` of `r`, if `r` is this memory's
    /// and the piece lies in it.
    fn resolved_at(&self, r: &Resolved, off: usize, n: usize) -> Option<usize> {
        (r.mem == self.id && r.mem != 0 && off.checked_add(n)? <= r.len).then(|| r.host + off)
    }

    /// Reads the 64 bytes at `off` in `r` (a submission queue entry; `r` is
    /// 64-byte aligned) as eight little-endian 8-byte words, with eight
    /// 8-byte loads. False if `r` is not this memory's or `off` is outside
    /// it: the caller takes the general path.
    pub fn read_resolved_64(&self, r: &Resolved, off: usize, out: &mut [u64; 8]) -> bool {
        let Some(a) = self.resolved_at(r, off, 64).filter(|a| a.is_multiple_of(8)) else { return false };
        let p = a as *const u64;
        for (i, w) in out.iter_mut().enumerate() {
            // SAFETY: `a..a + 64` is inside a mapped region of this memory
            // (resolve and resolved_at checked it, and the mapping lives as
            // long as `self`), 8-byte aligned; the guest may write it at any
            // time, so each word is read once, volatile, as vm-memory does.
            *w = u64::from_le(unsafe { std::ptr::read_volatile(p.add(i)) });
        }
        true
    }

    /// Asks the CPU to start fetching the cache line at `off` in `r` (the
    /// next submission queue entries, read a moment later): the misses on
    /// lines the guest just wrote then overlap. Nothing if `r` is not this
    /// memory's or `off` is outside it; never faults (a prefetch is a hint).
    pub fn prefetch_resolved(&self, r: &Resolved, off: usize) {
        #[cfg(target_arch = "x86_64")]
        if let Some(a) = self.resolved_at(r, off, 1) {
            // SAFETY: a prefetch reads nothing architecturally and cannot
            // fault; the address is inside the mapped ring anyway.
            unsafe { std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(a as *const i8) };
        }
    }

    /// Writes the 12 bytes `head` at `off` in `r`, then stores `last` right
    /// after them with release ordering (a completion entry and its phase
    /// dword; `r` is 16-byte aligned). False as in [`read_resolved_64`](Self::read_resolved_64).
    pub fn write_resolved_then_release(&self, r: &Resolved, off: usize, head: [u32; 3], last: u32) -> bool {
        let Some(a) = self.resolved_at(r, off, 16).filter(|a| a.is_multiple_of(4)) else { return false };
        let p = a as *mut u32;
        // SAFETY: `a..a + 16` is inside a mapped region of this memory, 4-byte
        // aligned (as above); the last dword is stored through an atomic
        // after the others, so a guest that sees it sees them.
        unsafe {
            for (i, w) in head.iter().enumerate() {
                std::ptr::write_volatile(p.add(i), w.to_le());
            }
            (*(p.add(3) as *const std::sync::atomic::AtomicU32)).store(last.to_le(), Ordering::Release);
        }
        true
    }

    /// Reads `buf.len()` bytes at `gpa`.
    pub fn read_slice(&self, buf: &mut [u8], gpa: u64) -> Result<()> {
        match &self.remote {
            None => {
                self.mapped.read_slice(buf, GuestAddress(gpa)).map_err(|_| MemError::Unmapped { gpa, len: buf.len() })
            }
            Some(_) => {
                let len = buf.len();
                self.walk(gpa, len, |p, a, off, n| match p {
                    Piece::Mapped(r, ra) => {
                        r.read_slice(&mut buf[off..off + n], ra).map_err(|_| MemError::Unmapped { gpa: a, len: n })
                    }
                    Piece::Remote(port) => port.read(a, &mut buf[off..off + n]),
                })
            }
        }
    }

    /// Writes `data` at `gpa`.
    pub fn write_slice(&self, data: &[u8], gpa: u64) -> Result<()> {
        match &self.remote {
            None => self
                .mapped
                .write_slice(data, GuestAddress(gpa))
                .map_err(|_| MemError::Unmapped { gpa, len: data.len() }),
            Some(_) => self.walk(gpa, data.len(), |p, a, off, n| match p {
                Piece::Mapped(r, ra) => {
                    r.write_slice(&data[off..off + n], ra).map_err(|_| MemError::Unmapped { gpa: a, len: n })
                }
                Piece::Remote(port) => port.write(a, &data[off..off + n]),
            }),
        }
    }

    /// Reads a plain value (little endian on this host) at `gpa`.
    pub fn read_obj<T: ByteValued + Default>(&self, gpa: u64) -> Result<T> {
        let mut v = T::default();
        self.read_slice(v.as_mut_slice(), gpa)?;
        Ok(v)
    }

    /// An aligned 32-bit load with `order` (mapped), or a 4-byte DMA read.
    pub fn load_u32(&self, gpa: u64, order: Ordering) -> Result<u32> {
        if !gpa.is_multiple_of(4) {
            return Err(MemError::Misaligned { gpa, len: 4 });
        }
        if let Some(a) = self.main.host(gpa, 4).filter(|a| a.is_multiple_of(4)) {
            // SAFETY: 4 bytes inside the main mapped region (which lives as
            // long as `self`), 4-byte aligned; the guest writes it
            // concurrently, hence atomic.
            return Ok(u32::from_le(unsafe { (*(a as *const std::sync::atomic::AtomicU32)).load(order) }));
        }
        match self.mapped.load::<u32>(GuestAddress(gpa), order) {
            Ok(v) => Ok(v),
            Err(_) if self.remote.is_some() => self.read_obj::<u32>(gpa),
            Err(_) => Err(MemError::Unmapped { gpa, len: 4 }),
        }
    }

    /// An aligned 32-bit store with `order` (mapped), or a 4-byte DMA write.
    pub fn store_u32(&self, v: u32, gpa: u64, order: Ordering) -> Result<()> {
        if !gpa.is_multiple_of(4) {
            return Err(MemError::Misaligned { gpa, len: 4 });
        }
        if let Some(a) = self.main.host(gpa, 4).filter(|a| a.is_multiple_of(4)) {
            // SAFETY: as in `load_u32`.
            unsafe { (*(a as *const std::sync::atomic::AtomicU32)).store(v.to_le(), order) };
            return Ok(());
        }
        match self.mapped.store(v, GuestAddress(gpa), order) {
            Ok(()) => Ok(()),
            Err(_) if self.remote.is_some() => self.write_slice(&v.to_le_bytes(), gpa),
            Err(_) => Err(MemError::Unmapped { gpa, len: 4 }),
        }
    }

    /// Writes `head` at `gpa`, then stores `last` right after it with
    /// release ordering, so that whoever sees `last` sees `head` (a
    /// completion entry whose last dword carries the phase tag). Mapped:
    /// one region lookup. Remote: two DMA writes, in that order.
    pub fn write_then_release_u32(&self, head: &[u8], gpa: u64, last: u32) -> Result<()> {
        let len = head.len() + 4;
        let unmapped = || MemError::Unmapped { gpa, len };
        let tail = gpa.checked_add(head.len() as u64).ok_or_else(unmapped)?;
        if let Ok(e) = self.mapped.get_slice(GuestAddress(gpa), len) {
            if !tail.is_multiple_of(4) {
                return Err(MemError::Misaligned { gpa: tail, len: 4 });
            }
            e.write_slice(head, 0).map_err(|_| unmapped())?;
            return e.store(last, head.len(), Ordering::Release).map_err(|_| unmapped());
        }
        if !self.range_ok(gpa, len as u64) {
            return Err(unmapped());
        }
        self.write_slice(head, gpa)?;
        self.store_u32(last, tail, Ordering::Release)
    }
}

/// True if `[s, e)` overlaps a region of `m`.
fn overlaps_mapped(m: &GuestMemoryMmap, s: u64, e: u64) -> bool {
    m.iter().any(|r| r.start_addr().0 < e && s < region_end(r))
}

/// A [`DmaPort`] over a plain buffer at `base`, for tests: counts its calls,
/// and fails every access once `fail` is set.
#[doc(hidden)]
pub mod testing {
    use super::*;
    use std::sync::atomic::{AtomicBool, AtomicU64};
    use std::sync::Mutex;

    pub struct BufferPort {
        pub base: u64,
        pub bytes: Mutex<Vec<u8>>,
        pub reads: AtomicU64,
        pub writes: AtomicU64,
        pub fail: AtomicBool,
    }

    impl BufferPort {
        pub fn new(base: u64, len: usize) -> Arc<Self> {
            Arc::new(BufferPort {
                base,
                bytes: Mutex::new(vec![0; len]),
                reads: AtomicU64::new(0),
                writes: AtomicU64::new(0),
                fail: AtomicBool::new(false),
            })
        }

        fn at(&self, gpa: u64, len: usize) -> Result<std::ops::Range<usize>> {
            let bad = || MemError::Remote { gpa, len, reason: "outside the test buffer".into() };
            if self.fail.load(Ordering::Relaxed) {
                return Err(MemError::Remote { gpa, len, reason: "the port fails".into() });
            }
            let off = gpa.checked_sub(self.base).ok_or_else(bad)? as usize;
            let end = off.checked_add(len).filter(|&e| e <= crate::lock(&self.bytes).len()).ok_or_else(bad)?;
            Ok(off..end)
        }
    }

    impl DmaPort for BufferPort {
        fn read(&self, gpa: u64, buf: &mut [u8]) -> Result<()> {
            self.reads.fetch_add(1, Ordering::Relaxed);
            let r = self.at(gpa, buf.len())?;
            buf.copy_from_slice(&crate::lock(&self.bytes)[r]);
            Ok(())
        }
        fn write(&self, gpa: u64, data: &[u8]) -> Result<()> {
            self.writes.fetch_add(1, Ordering::Relaxed);
            let r = self.at(gpa, data.len())?;
            crate::lock(&self.bytes)[r].copy_from_slice(data);
            Ok(())
        }
    }
}

/// Quadwords of guest memory a poller looks at between its passes without
/// its device's lock: [`changed`](Self::changed) tells it to take the lock
/// and look properly. Holds a clone of the memory, so the words stay mapped.
#[derive(Default)]
pub struct Watch {
    mem: GuestMem,
    /// Host address of each word, the bits looked at and the value they should hold.
    words: Vec<(usize, u64, u64)>,
}

impl Watch {
    /// True if this watches words of `mem` (the same memory, not one that replaced it).
    pub fn of(&self, mem: &GuestMem) -> bool {
        self.mem.same(mem)
    }

    /// Watches these words of the same memory instead (as [`GuestMem::watch`]),
    /// in the storage it has: no allocation once it held as many.
    pub fn set(&mut self, words: impl IntoIterator<Item = (u64, u64, u64)>) {
        self.words.clear();
        for (gpa, mask, want) in words {
            if let Some(a) = self.mem.main.host(gpa, 8).filter(|a| a.is_multiple_of(8)) {
                self.words.push((a, mask, want & mask));
            }
        }
    }

    /// True if a watched word no longer holds its expected value (or nothing is watched).
    #[inline]
    pub fn changed(&self) -> bool {
        self.words.is_empty()
            || self.words.iter().any(|&(a, mask, want)| {
                // SAFETY: `a` is 8-byte aligned inside the main mapped region
                // of `mem`, which this struct keeps mapped (see `GuestMem::watch`).
                let v = unsafe { (*(a as *const std::sync::atomic::AtomicU64)).load(Ordering::Acquire) };
                u64::from_le(v) & mask != want
            })
    }
}

impl GuestMem {
    /// Watches `(gpa, mask, want)`: the bits `mask` of the little-endian
    /// quadword at `gpa` should read `want`. A word not 8-byte aligned in
    /// the main mapped region is left out (the caller's locked passes see it).
    pub fn watch(&self, words: impl IntoIterator<Item = (u64, u64, u64)>) -> Watch {
        let mut w = Watch { mem: self.clone(), words: Vec::new() };
        w.set(words);
        w
    }
}

#[cfg(test)]
mod tests {
    use super::testing::BufferPort;
    use super::*;

    #[test]
    fn a_resolved_range_serves_only_its_memory_and_only_inside_it() {
        let (g, _) = mixed();
        assert_eq!(g.resolve(0x3000, 0x2000, 64), None, "crosses into remote memory");
        assert_eq!(g.resolve(0x4000, 0x100, 64), None, "remote");
        assert_eq!(g.resolve(0x3fc0, 0, 64), None, "empty");
        assert_eq!(g.resolve(u64::MAX - 8, 64, 1), None, "wraps");
        let r = g.resolve(0x1000, 0x400, 64).unwrap();
        // Written through the resolved ring, read back by the general path, and the other way.
        assert!(g.write_resolved_then_release(&r, 0x10, [1, 2, 3], 0x8001_0042));
        let back: [u32; 4] = g.read_obj(0x1010).unwrap();
        assert_eq!(back, [1, 2, 3, 0x8001_0042]);
        let cmd: Vec<u8> = (0..64).collect();
        g.write_slice(&cmd, 0x1040).unwrap();
        let words: Vec<u64> = cmd.chunks_exact(8).map(|c| u64::from_le_bytes(c.try_into().unwrap())).collect();
        let mut out = [0u64; 8];
        assert!(g.read_resolved_64(&r, 0x40, &mut out));
        assert_eq!(&out[..], &words[..]);
        // Outside the range, misaligned, or another memory (even over the same
        // mapping: a memory that replaced it): refused, the caller goes the long way.
        assert!(!g.read_resolved_64(&r, 0x3c8, &mut out), "past its end");
        assert!(!g.read_resolved_64(&r, 0x4, &mut out), "misaligned");
        assert!(!g.write_resolved_then_release(&r, 0x3f8, [0; 3], 0), "past its end");
        let other = GuestMem::from(g.mapped().clone());
        assert!(!other.read_resolved_64(&r, 0x40, &mut out));
        assert!(!other.write_resolved_then_release(&r, 0x10, [0; 3], 0));
        assert!(!GuestMem::default().read_resolved_64(&Resolved::default(), 0, &mut out));
        assert!(g.clone().read_resolved_64(&r, 0x40, &mut out), "a clone is the same memory");
        // A prefetch is a hint: in range, past the end, or of another memory, it changes nothing.
        for off in [0x40, 0x400, usize::MAX] {
            g.prefetch_resolved(&r, off);
            other.prefetch_resolved(&r, off);
        }
        assert!(g.read_resolved_64(&r, 0x40, &mut out) && out[..] == words[..]);
    }

    #[test]
    fn a_watch_sees_a_word_change_only_in_its_mask_and_leaves_out_what_it_cannot_load() {
        let (g, _) = mixed();
        g.write_slice(&0x0000_0007_0000_0003u64.to_le_bytes(), 0x100).unwrap();
        let w = g.watch([(0x100, u64::MAX, 0x0000_0007_0000_0003)]);
        assert!(!w.changed(), "as expected");
        g.store_u32(4, 0x100, Ordering::Release).unwrap();
        assert!(w.changed(), "the low word moved");
        // Only the masked bits count, and a want outside the mask is ignored.
        let w = g.watch([(0x100, 0xffff_ffff, 0xdead_0000_0000_0004)]);
        assert!(!w.changed());
        g.store_u32(9, 0x104, Ordering::Release).unwrap();
        assert!(!w.changed(), "a change outside the mask");
        g.store_u32(5, 0x100, Ordering::Release).unwrap();
        assert!(w.changed());
        // Expected a value the word does not hold: changed at once (the caller looks properly).
        assert!(g.watch([(0x100, u64::MAX, 0)]).changed());
        // Misaligned, in a mapped region other than the main one, remote, past the end:
        // left out; a watch of nothing reads as changed, so its poller never skips a look.
        for gpa in [0x104, 0x8000, 0x10000, 0x3ffc, u64::MAX - 7] {
            assert!(g.watch([(gpa, u64::MAX, 0)]).changed(), "{gpa:#x}");
        }
        let w = g.watch([(0x104, u64::MAX, 0), (0x100, 0xffff_ffff, 5)]);
        assert!(!w.changed(), "the loadable word alone is watched");
        // Set to other words of the same memory: only those count from then on.
        let mut w = w;
        w.set([(0x200, u64::MAX, 0), (0x8000, u64::MAX, 1)]);
        assert!(!w.changed(), "0x200 holds 0; 0x8000 is left out");
        g.store_u32(1, 0x204, Ordering::Release).unwrap();
        assert!(w.changed());
        assert!(Watch::default().changed());
    }

    #[test]
    fn the_main_region_fast_path_agrees_with_the_general_one_at_its_edges() {
        let (g, port) = mixed();
        // The main region is 0x0..0x4000: its last word, and the words of the other regions.
        for (gpa, v) in [(0x0, 1u32), (0x3ffc, 2), (0x8000, 3), (0x8ffc, 4), (0x10000, 5)] {
            g.store_u32(v, gpa, Ordering::Release).unwrap();
            assert_eq!(g.read_obj::<u32>(gpa).unwrap(), v, "{gpa:#x} stored");
            g.write_slice(&(v + 100).to_le_bytes(), gpa).unwrap();
            assert_eq!(g.load_u32(gpa, Ordering::Acquire).unwrap(), v + 100, "{gpa:#x} loaded");
        }
        assert_eq!(port.writes.load(Ordering::Relaxed), 2, "only 0x10000 went by message");
        assert!(matches!(g.load_u32(0x7ffc, Ordering::Acquire), Err(MemError::Unmapped { .. })), "a hole");
        assert!(matches!(g.store_u32(0, 0x3ffe, Ordering::Release), Err(MemError::Misaligned { .. })));
        // Ranges ending at the main region's end, past it into remote memory, past it into a hole.
        assert!(g.range_ok(0x3000, 0x1000) && g.range_ok(0x3000, 0x3000) && !g.range_ok(0x3000, 0x3001));
        assert!(!g.range_ok(u64::MAX - 3, 4) && g.range_ok(0x3ffc, 4) && g.range_ok(0x8ff0, 0x10));
        let none = GuestMem::default();
        assert!(none.load_u32(0, Ordering::Acquire).is_err() && !none.range_ok(0, 4));
    }

    /// Mapped 0x0..0x4000 and 0x8000..0x9000; remote 0x4000..0x6000 and 0x10000..0x11000.
    fn mixed() -> (GuestMem, Arc<BufferPort>) {
        let m = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x4000), (GuestAddress(0x8000), 0x1000)]).unwrap();
        let port = BufferPort::new(0x4000, 0xd000);
        let g = GuestMem::with_remote(m, &[(0x10000, 0x1000), (0x4000, 0x2000)], port.clone()).unwrap();
        (g, port)
    }

    #[test]
    fn accesses_are_routed_per_range_and_split_where_ranges_meet() {
        let (g, port) = mixed();
        assert!(g.address_in_range(0x3fff) && g.address_in_range(0x4000) && g.address_in_range(0x10fff));
        assert!(!g.address_in_range(0x6000) && !g.address_in_range(0x11000));
        // Mapped then remote, in one access.
        let data: Vec<u8> = (0..32u8).collect();
        g.write_slice(&data, 0x3ff0).unwrap();
        assert_eq!(port.writes.load(Ordering::Relaxed), 1, "only the remote half is a message");
        assert_eq!(&port.bytes.lock().unwrap()[..16], &data[16..]);
        let mut back = [0u8; 32];
        g.read_slice(&mut back, 0x3ff0).unwrap();
        assert_eq!(&back[..], &data[..]);
        assert_eq!(g.read_obj::<u64>(0x3ff8).unwrap(), u64::from_le_bytes(data[8..16].try_into().unwrap()));
        // Atomics: mapped in place, remote as 4-byte messages.
        g.store_u32(0xdead_beef, 0x10004, Ordering::Release).unwrap();
        assert_eq!(g.load_u32(0x10004, Ordering::Acquire).unwrap(), 0xdead_beef);
        g.store_u32(7, 0x8000, Ordering::Release).unwrap();
        assert_eq!(g.mapped().load::<u32>(GuestAddress(0x8000), Ordering::Acquire).unwrap(), 7);
        assert!(matches!(g.load_u32(0x10002, Ordering::Acquire), Err(MemError::Misaligned { .. })));
        // Ranges: wholly inside, across a hole, wrapping.
        assert!(g.range_ok(0x3000, 0x2000) && g.range_ok(0x10000, 0x1000) && g.range_ok(0x1000, 0));
        assert!(!g.range_ok(0x5000, 0x2000) && !g.range_ok(u64::MAX - 1, 4));
        assert!(g.range_mapped(0x8000, 0x1000) && !g.range_mapped(0x3000, 0x2000));
        assert_eq!(g.remote_ranges(), &[(0x4000, 0x6000), (0x10000, 0x11000)]);
    }

    #[test]
    fn a_failed_access_touches_nothing() {
        let (g, port) = mixed();
        let before = port.writes.load(Ordering::Relaxed);
        assert!(matches!(g.write_slice(&[1; 16], 0x5ff8), Err(MemError::Unmapped { gpa: 0x5ff8, len: 16 })));
        assert_eq!(port.writes.load(Ordering::Relaxed), before, "a range with a hole is refused before any message");
        port.fail.store(true, Ordering::Relaxed);
        assert!(matches!(g.read_obj::<u32>(0x4000), Err(MemError::Remote { .. })));
        assert!(g.read_obj::<u32>(0x100).is_ok(), "mapped memory does not need the port");
    }

    #[test]
    fn completions_store_the_last_dword_after_the_rest() {
        let (g, port) = mixed();
        g.write_then_release_u32(&[0xab; 12], 0x10010, 0x1234_5678).unwrap();
        assert_eq!(port.writes.load(Ordering::Relaxed), 2, "entry, then the phase dword");
        let mut e = [0u8; 16];
        g.read_slice(&mut e, 0x10010).unwrap();
        assert_eq!(&e[..12], &[0xab; 12]);
        assert_eq!(u32::from_le_bytes(e[12..].try_into().unwrap()), 0x1234_5678);
        g.write_then_release_u32(&[1; 12], 0x100, 9).unwrap();
        assert_eq!(g.mapped().read_obj::<u32>(GuestAddress(0x10c)).unwrap(), 9);
        assert!(g.write_then_release_u32(&[1; 12], 0x5ff8, 9).is_err());
    }

    #[test]
    fn overlapping_ranges_are_refused_and_none_is_all_mapped() {
        let m = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x4000)]).unwrap();
        let port = BufferPort::new(0, 0x10000);
        assert!(GuestMem::with_remote(m.clone(), &[(0x3000, 0x2000)], port.clone()).is_err(), "over mapped");
        assert!(GuestMem::with_remote(m.clone(), &[(0x5000, 0x2000), (0x6000, 0x1000)], port.clone()).is_err());
        assert!(GuestMem::with_remote(m.clone(), &[(0x5000, 0)], port.clone()).is_err(), "empty");
        let g = GuestMem::with_remote(m, &[], port).unwrap();
        assert!(g.remote_ranges().is_empty() && !g.is_empty());
        assert!(GuestMem::default().is_empty());
    }
}
