//! State memory: a shared mapping a device keeps what it must not lose in,
//! so that the next process of the same device resumes where a killed one
//! stopped (the client holds the memfd and hands it to the next process).
//!
//! Its layout belongs to the device that adopts it
//! ([`DeviceModel::adopt_state`](crate::DeviceModel::adopt_state)). The
//! memory comes from a client: everything read from it is validated as guest
//! input is. It is reached as 64-bit atomic words, the unit a writer that may
//! be killed between any two stores can publish.
//!
//! A device's ram storage (a ram namespace, a ram disk) keeps its data here
//! too, after the device's own words ([`place_ram`]: each at a multiple of
//! [`RAM_ALIGN`], its map of written pages after it), so that the data
//! outlives the process: a memfd is sparse, and only the pages written
//! take memory (`block/ram.rs` reads a page never written as zeros
//! without touching it: a read fault on a memfd's hole would allocate it).

use crate::{Error, Result};
use std::fs::File;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use vm_memory::{FileOffset, MmapRegion};

/// Largest state memory a device may ask for or a client may hand over:
/// 1 TiB, a device's own words (a few MiB) and the data of its ram storage.
/// Only what is written takes memory; the rest is address space.
pub const MAX_STATE_LEN: usize = 1 << 40;

/// The counter of the bytes of state memory a device keeps its state in
/// (its size: address space; a memfd takes memory only where written).
pub const MEMORY_BYTES: &str = "state.memory-bytes";
/// The counter of the bytes of ram data the state memory holds room for
/// (within [`MEMORY_BYTES`]; absent: no ram storage keeps its data there).
pub const RAM_BYTES: &str = "state.ram-bytes";
/// The counter of the bytes of that data written (and not deallocated
/// since): the memory it takes.
pub const RAM_WRITTEN_BYTES: &str = "state.ram-written-bytes";

/// Where ram data starts in a state memory: a multiple of 2 MiB (a huge
/// page's size, should the host back the memfd with huge pages).
pub const RAM_ALIGN: usize = 2 << 20;
/// The unit of the map of written pages: a bit per 4 KiB.
pub const RAM_PAGE: usize = 4096;

/// Where one ram storage lies in a state memory: `len` bytes of data at
/// byte `at`, then its map of written pages (a bit per [`RAM_PAGE`], set
/// before the page is first written: `block/ram.rs`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RamPlace {
    pub at: usize,
    pub len: usize,
}

impl RamPlace {
    /// Byte offset of its map of written pages (page aligned).
    pub fn map_at(&self) -> usize {
        (self.at + self.len).next_multiple_of(RAM_PAGE)
    }

    /// The map's bytes: a bit per page, in whole 64-bit words.
    pub fn map_len(&self) -> usize {
        self.len.div_ceil(RAM_PAGE).div_ceil(64) * 8
    }

    /// Where its map ends.
    pub fn end(&self) -> usize {
        self.map_at() + self.map_len()
    }

    /// The two words a device records it as (`at`, `len`; none: zeros), to
    /// check at resume that the memory was laid out as it lays it out.
    pub fn words(p: Option<RamPlace>) -> [u64; 2] {
        p.map_or([0, 0], |p| [p.at as u64, p.len as u64])
    }
}

/// CLOCK_MONOTONIC now, in ns: the host's clock, which `bench reconnect`
/// reads too, so that it matches a kill to the first completion after it
/// (the line a resumed device logs once, `RESUMED_FIRST_COMPLETION`; the
/// bench parses it).
pub fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime writes the timespec it is given, nothing else.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// What a resumed device logs when it posts its first completion, before
/// the CLOCK_MONOTONIC time in ns (then " ns").
pub const RESUMED_FIRST_COMPLETION: &str = "resumed: first completion posted at CLOCK_MONOTONIC ";

/// The places of a device's ram storages of `sizes` bytes (None: a storage
/// that is not ram) after `words` bytes of its own state, each at a
/// multiple of [`RAM_ALIGN`], and the state memory's length (`words` if
/// there is no ram). An error if that passes [`MAX_STATE_LEN`].
pub fn place_ram(words: usize, sizes: &[Option<u64>]) -> Result<(Vec<Option<RamPlace>>, usize)> {
    let too_large = || {
        let total: u64 = sizes.iter().flatten().sum();
        Error::Host(format!(
            "no state memory: {total} bytes of ram data do not fit in a state memory of {MAX_STATE_LEN} bytes"
        ))
    };
    let mut end = words;
    let mut places = Vec::with_capacity(sizes.len());
    for s in sizes {
        let Some(len) = *s else {
            places.push(None);
            continue;
        };
        let len = usize::try_from(len).map_err(|_| too_large())?;
        let at = end.checked_next_multiple_of(RAM_ALIGN).ok_or_else(too_large)?;
        let p = RamPlace { at, len };
        // (`end()` rounds `at + len` up to a page and adds the map: no overflow past this.)
        at.checked_add(len).and_then(|e| e.checked_add(RAM_PAGE + p.map_len())).ok_or_else(too_large)?;
        end = p.end();
        places.push(Some(p));
    }
    if end > MAX_STATE_LEN {
        return Err(too_large());
    }
    Ok((places, end.next_multiple_of(8)))
}

/// A shared, page-aligned mapping of a memfd, sealed against shrinking.
/// (The mapping holds the file; shared access is through atomics only.)
pub struct StateMemory {
    file: Arc<File>,
    /// Shared with the ram storages placed in it, which keep it mapped.
    map: Arc<MmapRegion<()>>,
}

impl StateMemory {
    /// A new zeroed state memory of `len` bytes (rounded up to 8).
    pub fn create(len: usize) -> Result<Self> {
        if len == 0 || len > MAX_STATE_LEN {
            return Err(Error::Host(format!("state memory of {len} bytes (1..={MAX_STATE_LEN})")));
        }
        let len = len.next_multiple_of(8);
        let name = c"iopath-state";
        // SAFETY: memfd_create with a NUL-terminated name; the fd is checked, then owned by the File.
        let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) };
        if fd < 0 {
            return Err(Error::io("state memory: memfd_create", std::io::Error::last_os_error()));
        }
        // SAFETY: a fresh descriptor nobody else owns.
        let file = unsafe { File::from_raw_fd(fd) };
        file.set_len(len as u64).map_err(|e| Error::io("state memory: size", e))?;
        // SAFETY: F_ADD_SEALS on an fd this function owns; integer argument.
        if unsafe { libc::fcntl(fd, libc::F_ADD_SEALS, libc::F_SEAL_SHRINK) } < 0 {
            return Err(Error::io("state memory: seal", std::io::Error::last_os_error()));
        }
        Self::map(file, len)
    }

    /// Maps a state memory a client handed over. It must be a memfd sealed
    /// against shrinking (so no peer can make a later access fault), of at
    /// least `min_len` bytes and at most [`MAX_STATE_LEN`].
    pub fn from_fd(fd: OwnedFd, min_len: usize) -> Result<Self> {
        let file = File::from(fd);
        // SAFETY: F_GET_SEALS on an fd we own; integer result.
        let seals = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_GET_SEALS) };
        if seals < 0 || seals & libc::F_SEAL_SHRINK == 0 {
            return Err(Error::Host("state memory: not a memfd sealed against shrinking".into()));
        }
        // The raw fstat system call: a device process's seccomp filter allows
        // it, and neither statx nor the newfstatat glibc's fstat makes.
        // SAFETY: a zeroed stat the call fills.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: SYS_fstat with our fd and a pointer to a live stat.
        if unsafe { libc::syscall(libc::SYS_fstat, file.as_raw_fd(), &mut st as *mut libc::stat) } < 0 {
            return Err(Error::io("state memory: fstat", std::io::Error::last_os_error()));
        }
        let size = st.st_size as u64;
        if size < min_len as u64 || size > MAX_STATE_LEN as u64 || !size.is_multiple_of(8) {
            return Err(Error::Host(format!(
                "state memory: {size} bytes; this device needs {min_len}..={MAX_STATE_LEN}, a multiple of 8"
            )));
        }
        Self::map(file, size as usize)
    }

    fn map(file: File, len: usize) -> Result<Self> {
        // A shared mapping of `len` bytes of a file at least that long that
        // cannot shrink (sealed).
        let file = Arc::new(file);
        let map = MmapRegion::from_file(FileOffset::from_arc(file.clone(), 0), len)
            .map_err(|e| Error::io("state memory: mmap", std::io::Error::other(e)))?;
        Ok(StateMemory { file, map: Arc::new(map) })
    }

    /// Its size in bytes (a multiple of 8).
    pub fn len(&self) -> usize {
        self.map.size()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The memfd, to hand to a peer.
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.file.as_fd()
    }

    /// A duplicate of the memfd (for a client that keeps one and sends one).
    pub fn try_clone_fd(&self) -> Result<OwnedFd> {
        self.file.as_fd().try_clone_to_owned().map_err(|e| Error::io("state memory: dup", e))
    }

    /// The mapping, for a ram storage placed in it (`Ram::in_state`),
    /// which keeps it mapped as long as it lives.
    pub(crate) fn mapping(&self) -> Arc<MmapRegion<()>> {
        self.map.clone()
    }

    /// Gives `len` bytes at `at` back (MADV_REMOVE: the memfd's pages there
    /// are freed and read as zeros), page aligned; an error outside it.
    pub fn punch(&self, at: usize, len: usize) -> Result<()> {
        let end = at.checked_add(len).filter(|&e| e <= self.len());
        if end.is_none() || !at.is_multiple_of(RAM_PAGE) {
            return Err(Error::Host(format!("state memory: cannot free {len} bytes at {at} of {}", self.len())));
        }
        // Whole pages: the last one may pass `len()` (the memfd's size is
        // a multiple of 8, its last page mapped whole).
        let len = len.next_multiple_of(RAM_PAGE);
        if len == 0 {
            return Ok(());
        }
        // SAFETY: a page-aligned range of our shared mapping (checked
        // above; the mapping covers its last page whole); its pages read
        // as zeros afterwards, which every user of the memory allows.
        let r = unsafe { libc::madvise(self.map.as_ptr().add(at).cast(), len, libc::MADV_REMOVE) };
        if r != 0 {
            return Err(Error::io("state memory: MADV_REMOVE", std::io::Error::last_os_error()));
        }
        Ok(())
    }

    /// The bytes of memory it takes now (the memfd's allocated pages, by
    /// fstat: not for a device thread, whose seccomp role has no fstat).
    pub fn allocated(&self) -> Result<u64> {
        // SAFETY: a zeroed stat the call fills.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: SYS_fstat with our fd and a pointer to a live stat.
        if unsafe { libc::syscall(libc::SYS_fstat, self.file.as_raw_fd(), &mut st as *mut libc::stat) } < 0 {
            return Err(Error::io("state memory: fstat", std::io::Error::last_os_error()));
        }
        Ok(st.st_blocks as u64 * 512)
    }

    /// The whole memory as 64-bit words.
    pub fn words(&self) -> &[AtomicU64] {
        // SAFETY: `map` is a page-aligned mapping of `len()` bytes (a
        // multiple of 8) that lives as long as `self`; AtomicU64 has the
        // size and alignment of u64 and every bit pattern is valid.
        unsafe { std::slice::from_raw_parts(self.map.as_ptr().cast::<AtomicU64>(), self.len() / 8) }
    }
}

impl std::fmt::Debug for StateMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "StateMemory({} bytes, fd {})", self.len(), self.file.as_raw_fd())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::Ordering;

    #[test]
    fn a_second_mapping_of_the_fd_sees_the_first_ones_words() {
        let a = StateMemory::create(20).unwrap();
        assert_eq!(a.len(), 24);
        a.words()[2].store(0xfeed, Ordering::Release);
        let b = StateMemory::from_fd(a.try_clone_fd().unwrap(), 24).unwrap();
        assert_eq!(b.words()[2].load(Ordering::Acquire), 0xfeed);
    }

    #[test]
    fn too_small_unsealed_or_oversized_memory_is_refused() {
        let a = StateMemory::create(16).unwrap();
        let e = StateMemory::from_fd(a.try_clone_fd().unwrap(), 64).unwrap_err().to_string();
        assert!(e.contains("16 bytes; this device needs 64"), "{e}");
        let plain = tempfile_fd();
        let e = StateMemory::from_fd(plain, 8).unwrap_err().to_string();
        assert!(e.contains("not a memfd sealed"), "{e}");
        assert!(StateMemory::create(MAX_STATE_LEN + 1).is_err());
        assert!(StateMemory::create(0).is_err());
    }

    fn tempfile_fd() -> OwnedFd {
        // SAFETY: memfd_create without sealing allowed; checked, then owned.
        let fd = unsafe { libc::memfd_create(c"plain".as_ptr(), libc::MFD_CLOEXEC) };
        assert!(fd >= 0);
        // SAFETY: a fresh fd nobody else owns.
        let f = unsafe { File::from_raw_fd(fd) };
        f.set_len(64).unwrap();
        f.into()
    }
}
