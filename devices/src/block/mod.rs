//! Storage of the block devices: the data behind NVMe's namespace and
//! virtio-blk's disk (both front ends over this one layer), chosen by
//! `backend=null|ram|file:PATH` ([`StorageKind`]):
//! - `null`: no data, dispatch cost only;
//! - `ram` ([`ram`]): data in an anonymous mapping;
//! - `file:PATH` ([`file`]): a regular file or a block device; reads,
//!   writes and flushes go O_DIRECT through io_uring, many in flight
//!   ([`uring`]: the ring, its bounce buffers and completion reaping), on
//!   the guest's pages in place where O_DIRECT's alignment allows
//!   ([`guest`]), otherwise one whole transfer per operation in a bounce
//!   buffer of its own; where O_DIRECT or io_uring is refused, synchronous
//!   pread/pwrite.
//!
//! Callers pass byte ranges already checked against the storage's size.

pub mod file;
pub mod guest;
pub mod ram;
pub mod uring;

pub use file::{backing_bytes, path_bytes, FileStorage};
pub use guest::{InPlace, Placed};
pub use ram::Ram;
pub use uring::{FileOp, FILE_SLOTS, IORING_REGISTER_BUFFERS_UPDATE};

use crate::{Error, Result};
use std::os::unix::fs::FileExt;

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

/// A device's storage, opened from a [`StorageKind`].
pub enum Storage {
    Null,
    /// Shared by the threads that serve one device (NVMe's queue groups).
    Ram(std::sync::Arc<Ram>),
    File(Box<FileStorage>),
}

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
        Ok(match kind {
            StorageKind::Null => Storage::Null,
            StorageKind::Ram => Storage::Ram(std::sync::Arc::new(Ram::new(bytes)?)),
            StorageKind::File(p) => Storage::File(Box::new(FileStorage::open(p, bytes)?)),
        })
    }

    /// Another handle on the same data, for another thread of the same
    /// device: `null` and `ram` (None for a file, whose io_uring is one
    /// thread's).
    pub fn share(&self) -> Option<Storage> {
        match self {
            Storage::Null => Some(Storage::Null),
            Storage::Ram(r) => Some(Storage::Ram(r.clone())),
            Storage::File(_) => None,
        }
    }

    pub fn name(&self) -> &'static str {
        match self {
            Storage::Null => "null",
            Storage::Ram(_) => "ram",
            Storage::File(_) => "file",
        }
    }

    /// Reads `buf.len()` bytes at byte offset `off` (null: zeros are not
    /// even written, as a null device transfers no data).
    pub fn read(&mut self, off: u64, buf: &mut [u8]) -> std::io::Result<()> {
        match self {
            Storage::Null => Ok(()),
            Storage::Ram(r) => r.read(off, buf).then_some(()).ok_or_else(outside),
            Storage::File(f) => f.file.read_exact_at(buf, off),
        }
    }

    pub fn write(&mut self, off: u64, buf: &[u8]) -> std::io::Result<()> {
        match self {
            Storage::Null => Ok(()),
            Storage::Ram(r) => r.write(off, buf).then_some(()).ok_or_else(outside),
            Storage::File(f) => f.file.write_all_at(buf, off),
        }
    }

    pub fn zero(&mut self, off: u64, len: u64) -> std::io::Result<()> {
        match self {
            Storage::Null => Ok(()),
            Storage::Ram(r) => r.zero(off, len).then_some(()).ok_or_else(outside),
            Storage::File(f) => {
                let z = vec![0u8; 64 << 10];
                let mut done = 0;
                while done < len {
                    let n = (len - done).min(z.len() as u64) as usize;
                    f.file.write_all_at(&z[..n], off + done)?;
                    done += n as u64;
                }
                Ok(())
            }
        }
    }

    pub fn flush(&mut self) -> std::io::Result<()> {
        match self {
            Storage::File(f) => f.file.sync_data(),
            _ => Ok(()),
        }
    }
}

fn outside() -> std::io::Error {
    std::io::Error::other("outside the namespace")
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
mod tests;
