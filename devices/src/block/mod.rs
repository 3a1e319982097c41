//! Storage of the block devices: the data behind NVMe's namespace and
//! virtio-blk's disk (both front ends over this one layer), chosen by
//! `backend=null|ram|file:PATH` ([`StorageKind`]):
//! - `null`: no data, dispatch cost only;
//! - `ram` ([`ram`]): data in an anonymous mapping;
//! - `file:PATH` ([`file`](mod@file)): a regular file or a block device; reads,
//!   writes and flushes go O_DIRECT (virtio-blk's `direct=off`: buffered,
//!   through the page cache) through io_uring, many in flight
//!   ([`uring`]: the ring and its bounce buffers; `reap.rs`: operations
//!   pushed, submitted and their completions reaped), on the guest's pages
//!   in place where O_DIRECT's alignment allows ([`guest`]), otherwise one
//!   whole transfer per operation in a bounce buffer of its own; where
//!   O_DIRECT or io_uring is refused, synchronous pread/pwrite. The file
//!   is used as it is, never made or resized here ([`crate::backing`]
//!   checks it, and lays out a missing one with `create=on`).
//!
//! Operations ([`Storage`]): read, write, flush, discard and write zeroes
//! (with or without deallocation). Discarded and deallocated ranges read
//! as zeros: a file gets holes (fallocate PUNCH_HOLE), a ram namespace
//! gives the pages back. Every range is checked against the size (an
//! error, never an access outside); front ends check theirs first and
//! answer in their own terms (NVMe's LBA Out of Range, virtio's IOERR).
//! NVMe (`nvme/io.rs`) and virtio-blk (`virtio/blk.rs`; its io_uring side
//! `virtio/blk_async.rs`) are the two front ends. [`inject`] holds error
//! injection's rules (pure code: which commands, what happens to them,
//! when), which front ends ask per command, and [`timing`] the device
//! timing model (due times, the timer wheel); virtio-blk asks both
//! (`virtio/blk_emu.rs`), NVMe not yet.

pub(crate) mod fence;
pub mod file;
pub mod guest;
pub mod inject;
pub mod ram;
mod reap;
pub mod timing;
pub mod uring;

pub use file::{backing_bytes, path_bytes, FileStorage};
pub use guest::{BadInPlace, InPlace, Placed};
pub use ram::Ram;
pub use uring::{FileOp, FILE_SLOTS, IORING_REGISTER_BUFFERS_UPDATE};

use crate::{Error, Result};

/// The largest transfer one operation may ask for (an NVMe command's MDTS,
/// a bounce buffer slot): 128 KiB.
pub const MAX_IO: usize = 128 << 10;

/// What `backend=` names: where a block device keeps its data.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StorageKind {
    Null,
    Ram,
    File(std::path::PathBuf),
}

impl std::str::FromStr for StorageKind {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "null" => Ok(StorageKind::Null),
            "ram" => Ok(StorageKind::Ram),
            f if f.starts_with("file:") && f.len() > 5 => Ok(StorageKind::File(f[5..].into())),
            _ => Err(Error::Option {
                device: "nvme",
                option: "backend".into(),
                reason: format!("unknown backend {s:?} (null, ram, file:PATH)"),
            }),
        }
    }
}

/// `null`, `ram` or `file:PATH`, as [`FromStr`](std::str::FromStr) takes
/// them (a path that is not UTF-8 is written lossily).
impl std::fmt::Display for StorageKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            StorageKind::Null => f.write_str("null"),
            StorageKind::Ram => f.write_str("ram"),
            StorageKind::File(p) => write!(f, "file:{}", p.display()),
        }
    }
}

/// A device's storage, opened from a [`StorageKind`]: the operations
/// every block front end needs (read, write, flush, discard, write
/// zeroes), each checked against its size. A file's io_uring side (many
/// operations in flight) is [`FileStorage`]'s own API (`reap.rs`).
pub enum Storage {
    /// No data: reads leave the buffer as it is (a null device transfers
    /// nothing), writes and zeroing go nowhere.
    Null {
        bytes: u64,
    },
    /// Shared by the threads that serve one device (NVMe's queue groups).
    Ram(std::sync::Arc<Ram>),
    File(Box<FileStorage>),
}

/// An operation the storage did not carry out.
#[derive(Debug, thiserror::Error)]
pub enum StorageError {
    /// A range that does not lie inside the storage (the front end checks
    /// ranges first; this is the layer's own guard, nothing is touched).
    #[error("{len} bytes at byte {off} are outside the {size}-byte storage")]
    OutOfRange { off: u64, len: u64, size: u64 },
    /// The file or device failed it.
    #[error("storage I/O: {0}")]
    Io(#[from] std::io::Error),
}

type OpResult = std::result::Result<(), StorageError>;

/// A buffer aligned for O_DIRECT (4 KiB), for whole transfers.
pub struct Bounce(Vec<u8>, usize);

impl Bounce {
    pub fn new(len: usize) -> Self {
        let v = vec![0u8; len + 4096];
        let start = v.as_ptr().align_offset(4096);
        Bounce(v, start)
    }
    pub fn get(&mut self, len: usize) -> &mut [u8] {
        if self.0.len() < self.1 + len {
            *self = Bounce::new(len);
        }
        &mut self.0[self.1..self.1 + len]
    }
}

impl Storage {
    pub fn open(kind: &StorageKind, bytes: u64) -> Result<Self> {
        Self::open_with(kind, bytes, true)
    }

    /// As [`open`](Self::open); a file's io_uring works O_DIRECT if
    /// `direct` (`direct=on`, the default), else through the page cache.
    pub fn open_with(kind: &StorageKind, bytes: u64, direct: bool) -> Result<Self> {
        Ok(match kind {
            StorageKind::Null => Storage::Null { bytes },
            StorageKind::Ram => Storage::Ram(std::sync::Arc::new(Ram::new(bytes)?)),
            StorageKind::File(p) => Storage::File(Box::new(FileStorage::open(p, bytes, direct)?)),
        })
    }

    /// As [`open`](Self::open); a file's io_uring signals `done` on each
    /// completion (one eventfd for several namespaces of a controller).
    pub fn open_signalling(
        kind: &StorageKind,
        bytes: u64,
        done: &std::sync::Arc<vmm_sys_util::eventfd::EventFd>,
    ) -> Result<Self> {
        Ok(match kind {
            StorageKind::File(p) => {
                Storage::File(Box::new(FileStorage::open_signalling(p, bytes, true, Some(done.clone()))?))
            }
            k => Storage::open(k, bytes)?,
        })
    }

    /// Another handle on the same data, for another thread of the same
    /// device: `null` and `ram` (None for a file, whose io_uring is one
    /// thread's).
    pub fn share(&self) -> Option<Storage> {
        match self {
            Storage::Null { bytes } => Some(Storage::Null { bytes: *bytes }),
            Storage::Ram(r) => Some(Storage::Ram(r.clone())),
            Storage::File(_) => None,
        }
    }

    /// Resuming in a new device process after one was killed: waits (at
    /// most [`fence::FENCE_WAIT`]) until the file operations the dead
    /// process left running in the kernel have ended (`fence.rs`), so that
    /// none lands after what the resumed device writes.
    pub fn after_predecessor(&self) -> Result<()> {
        match self {
            Storage::File(f) => f.after_predecessor(),
            _ => Ok(()),
        }
    }

    pub fn name(&self) -> &'static str {
        match self {
            Storage::Null { .. } => "null",
            Storage::Ram(_) => "ram",
            Storage::File(_) => "file",
        }
    }

    /// The size in bytes.
    pub fn bytes(&self) -> u64 {
        match self {
            Storage::Null { bytes } => *bytes,
            Storage::Ram(r) => r.len(),
            Storage::File(f) => f.bytes(),
        }
    }

    /// Ok if `len` bytes at `off` lie inside the storage.
    fn check(&self, off: u64, len: u64) -> OpResult {
        let size = self.bytes();
        match off.checked_add(len) {
            Some(end) if end <= size => Ok(()),
            _ => Err(StorageError::OutOfRange { off, len, size }),
        }
    }

    /// Reads `buf.len()` bytes at byte offset `off` (null: zeros are not
    /// even written, as a null device transfers no data).
    pub fn read(&mut self, off: u64, buf: &mut [u8]) -> OpResult {
        self.check(off, buf.len() as u64)?;
        match self {
            Storage::Null { .. } => {}
            Storage::Ram(r) => ram_did(r.read(off, buf), off, buf.len(), r)?,
            Storage::File(f) => f.read_at(off, buf)?,
        }
        Ok(())
    }

    pub fn write(&mut self, off: u64, buf: &[u8]) -> OpResult {
        self.check(off, buf.len() as u64)?;
        match self {
            Storage::Null { .. } => {}
            Storage::Ram(r) => ram_did(r.write(off, buf), off, buf.len(), r)?,
            Storage::File(f) => f.write_at(off, buf)?,
        }
        Ok(())
    }

    /// What was written is stable (a file: fdatasync).
    pub fn flush(&mut self) -> OpResult {
        if let Storage::File(f) = self {
            f.sync()?;
        }
        Ok(())
    }

    /// Discards `len` bytes at `off` (NVMe Dataset Management with
    /// Deallocate, virtio-blk DISCARD): their storage is given back (a
    /// file's blocks become a hole, a ram namespace's pages are freed) and
    /// they read as zeros afterwards, as NVMe's DLFEAT says (virtio leaves
    /// a discarded range's contents open; zeros are one answer).
    pub fn discard(&mut self, off: u64, len: u64) -> OpResult {
        self.write_zeroes(off, len, true)
    }

    /// Makes `len` bytes at `off` read as zeros (NVMe Write Zeroes, virtio-blk
    /// WRITE_ZEROES). With `deallocate` (NVMe's DEAC, virtio's UNMAP flag)
    /// as [`discard`](Self::discard); without, the storage stays allocated
    /// (a file: FALLOC_FL_ZERO_RANGE, or zeros written).
    pub fn write_zeroes(&mut self, off: u64, len: u64, deallocate: bool) -> OpResult {
        self.check(off, len)?;
        match self {
            Storage::Null { .. } => {}
            Storage::Ram(r) => {
                let ok = if deallocate { r.deallocate(off, len) } else { r.zero(off, len) };
                ram_did(ok, off, len as usize, r)?;
            }
            Storage::File(f) => f.zeroes(off, len, deallocate)?,
        }
        Ok(())
    }
}

/// A ram copy's result (`ok`: it lay inside, which `check` made sure of).
fn ram_did(ok: bool, off: u64, len: usize, r: &Ram) -> OpResult {
    if ok {
        Ok(())
    } else {
        Err(StorageError::OutOfRange { off, len: len as u64, size: r.len() })
    }
}

/// A fresh private anonymous mapping of `len` bytes, read-write, backed on
/// first use (MAP_NORESERVE); the caller unmaps it.
pub(crate) fn anon_map(len: usize) -> std::io::Result<*mut libc::c_void> {
    // SAFETY: a new mapping, no address asked for and no memory of ours passed.
    let map = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
            -1,
            0,
        )
    };
    if map == libc::MAP_FAILED {
        return Err(std::io::Error::last_os_error());
    }
    Ok(map)
}

#[cfg(test)]
mod model_tests;
#[cfg(test)]
mod tests;
