//! A `file:PATH` namespace: a regular file or a block device, opened
//! buffered (synchronous pread/pwrite, fdatasync, fallocate) and, where the
//! file system and kernel allow, O_DIRECT through an io_uring
//! ([`uring`](super::uring)) with up to [`FILE_SLOTS`](super::FILE_SLOTS)
//! operations in flight (or, `direct=off`, the same io_uring on a second
//! buffered fd: through the page cache, no alignment asked of anything) (`reap.rs`: pushed by a front end, submitted in
//! batches, reaped from the ring's completions). Discard and write zeroes
//! with deallocation punch holes (a thin image stays thin); write zeroes
//! without it keeps the blocks allocated.

use super::guest::InPlace;
use super::uring::Uring;
use crate::Result;
use std::fs::File;
use std::os::unix::fs::FileExt;

/// A file namespace: a buffered fd always, and when the filesystem and
/// kernel allow, an O_DIRECT fd driven through io_uring with up to
/// [`FILE_SLOTS`](super::FILE_SLOTS) operations in flight.
pub struct FileStorage {
    /// For messages.
    path: String,
    pub(super) file: File,
    pub(super) uring: Option<Uring>,
    /// Operations that completed through io_uring (with O_DIRECT unless
    /// [`is_direct`](Self::is_direct) says not).
    pub direct_ops: u64,
    /// Of those, the ones on guest pages in place.
    pub in_place_ops: u64,
    /// Which reads and writes work on guest pages in place (`guest.rs`).
    pub in_place: InPlace,
    /// Pushed operations go to the kernel once this many wait in the ring
    /// (0: when the queue pass that pushed them ends, or a bounced write's
    /// copies reach `SUBMIT_BYTES`, 256 KiB). One at a time costs a system call
    /// per operation but hands a disk a steady stream instead of bursts: on
    /// this project's virtual disk, 4 KiB randread QD32 did 0.97-1.00x of
    /// fio with 1 and 0.82-0.89x with 0 (fio itself lost as much with
    /// iodepth_batch_submit=16); on a loop device over /dev/shm, where the
    /// CPUs are the limit, 1 did 0.63-0.65x and 0 did 0.93-1.00x.
    pub submit_batch: usize,
    /// The most operations that were in flight at once (after a submit).
    pub max_in_flight: u64,
    /// The last submit left operations in the ring (the kernel refused
    /// them for now: EAGAIN, ENOMEM): the device thread retries them.
    pub(super) stalled: bool,
    /// Bytes of the operations pushed since the last submit.
    pub(super) unsent_bytes: usize,
    /// The namespace's size: no operation reaches past it.
    bytes: u64,
    /// The ring's fd was asked for O_DIRECT (`direct=on`, the default).
    direct: bool,
    /// fallocate refused (EOPNOTSUPP) to punch holes here ...
    no_punch: bool,
    /// ... or to zero a range: the slower way is taken at once from then on.
    no_zero_range: bool,
    /// Tests: the next submits fail as if the kernel were short of memory.
    #[cfg(test)]
    pub fail_submits: u32,
}

vmm_sys_util::ioctl_ior_nr!(BLKGETSIZE64, 0x12, 114, u64);

/// The bytes `f` holds: a regular file's length, or a block device's size
/// (which its inode's length does not give).
pub fn backing_bytes(f: &File) -> std::io::Result<u64> {
    use std::os::unix::fs::FileTypeExt;
    let m = f.metadata()?;
    if !m.file_type().is_block_device() {
        return Ok(m.len());
    }
    let mut size = 0u64;
    // SAFETY: BLKGETSIZE64 writes one u64, into `size`, which outlives the call.
    let r = unsafe { vmm_sys_util::ioctl::ioctl_with_mut_ref(f, BLKGETSIZE64(), &mut size) };
    if r < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(size)
}

/// The bytes at `p` (see [`backing_bytes`]); 0 where there is nothing to open.
pub fn path_bytes(p: &std::path::Path) -> u64 {
    File::open(p).and_then(|f| backing_bytes(&f)).unwrap_or(0)
}

/// The buffered fd of a `file:PATH` namespace of `bytes`: `p` opened to
/// read and write, a regular file or block device that is there and holds
/// them ([`crate::backing`]; never made, extended or truncated here).
fn open_backing(p: &std::path::Path, bytes: u64) -> Result<File> {
    Ok(crate::backing::open_rw(p, bytes)?)
}

impl FileStorage {
    /// Opens `p` for a namespace of `bytes` ([`open_backing`]), and its
    /// io_uring where the file system and kernel allow: on an O_DIRECT fd
    /// if `direct`, else on a buffered one (the page cache; O_DIRECT's
    /// alignment is then asked of no address, offset or length).
    pub(super) fn open(p: &std::path::Path, bytes: u64, direct: bool) -> Result<Self> {
        Self::open_signalling(p, bytes, direct, None)
    }

    /// As [`open`](Self::open), its io_uring signalling `done` (None: an
    /// eventfd of its own) on each completion.
    pub(super) fn open_signalling(
        p: &std::path::Path,
        bytes: u64,
        direct: bool,
        done: Option<std::sync::Arc<vmm_sys_util::eventfd::EventFd>>,
    ) -> Result<Self> {
        let f = open_backing(p, bytes)?;
        use std::os::unix::fs::OpenOptionsExt;
        // O_NOATIME: every read of a block device (or of a file mounted
        // relatime) otherwise goes through the kernel's atime check, about
        // 5 % of the device thread's CPU per 4 KiB read on a loop device.
        // Only the file's owner (or CAP_FOWNER) may ask for it.
        let open_direct = |flags| std::fs::OpenOptions::new().read(true).write(true).custom_flags(flags).open(p);
        let o_direct = if direct { libc::O_DIRECT } else { 0 };
        let ring_fd = match open_direct(o_direct | libc::O_NOATIME) {
            Err(e) if e.raw_os_error() == Some(libc::EPERM) => open_direct(o_direct),
            r => r,
        };
        let uring = match ring_fd {
            Err(e) => {
                log::info!("{}: no O_DIRECT here ({e}); using pread/pwrite", p.display());
                None
            }
            Ok(d) => match Uring::new(d, direct, done) {
                Ok(u) => Some(u),
                Err(e) => {
                    log::info!("io_uring unavailable ({e}); using pread/pwrite");
                    None
                }
            },
        };
        // The fence a resumed device waits at (`fence.rs`): on the description
        // the ring's operations hold.
        if let Some(u) = &uring {
            super::fence::hold(&u._direct, &p.display().to_string());
        }
        Ok(FileStorage {
            path: p.display().to_string(),
            file: f,
            uring,
            direct_ops: 0,
            in_place_ops: 0,
            in_place: InPlace::Auto,
            submit_batch: 0,
            max_in_flight: 0,
            stalled: false,
            unsent_bytes: 0,
            bytes,
            direct,
            no_punch: false,
            no_zero_range: false,
            #[cfg(test)]
            fail_submits: 0,
        })
    }

    /// The namespace's size in bytes.
    /// See [`Storage::after_predecessor`](super::Storage::after_predecessor):
    /// only the ring's operations outlive a process (its synchronous ones
    /// end with its threads).
    pub(super) fn after_predecessor(&self) -> Result<()> {
        match &self.uring {
            Some(u) => super::fence::after_predecessor(&u._direct, &self.path, super::fence::FENCE_WAIT),
            None => Ok(()),
        }
    }

    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// False for `direct=off`: the ring's operations go through the page cache.
    pub fn is_direct(&self) -> bool {
        self.direct
    }

    /// Tests: the open flags (F_GETFL) of the fd the io_uring works on.
    #[cfg(test)]
    pub fn ring_fd_flags(&self) -> Option<i32> {
        use std::os::fd::AsRawFd;
        // SAFETY: F_GETFL on our own open fd; no memory is passed.
        self.uring.as_ref().map(|u| unsafe { libc::fcntl(u._direct.as_raw_fd(), libc::F_GETFL) })
    }

    /// Reads `buf.len()` bytes at `off` with the buffered fd (the caller
    /// checked the range).
    pub(super) fn read_at(&self, off: u64, buf: &mut [u8]) -> std::io::Result<()> {
        self.file.read_exact_at(buf, off)
    }

    /// Writes `buf` at `off` with the buffered fd (the caller checked the range).
    pub(super) fn write_at(&self, off: u64, buf: &[u8]) -> std::io::Result<()> {
        self.file.write_all_at(buf, off)
    }

    /// fdatasync: what was written is stable.
    pub(super) fn sync(&self) -> std::io::Result<()> {
        self.file.sync_data()
    }

    /// Makes `len` bytes at `off` read as zeros (the caller checked the
    /// range), with the buffered fd; operations in flight on the same
    /// blocks must have completed (the front end waits for them). With
    /// `deallocate`, the file's blocks there are given back (a hole:
    /// fallocate PUNCH_HOLE, which on a block device zeroes them and may
    /// unmap them); otherwise they stay allocated (ZERO_RANGE: unwritten
    /// extents). Where the file system or device does neither, zeros are
    /// written.
    pub(super) fn zeroes(&mut self, off: u64, len: u64, deallocate: bool) -> std::io::Result<()> {
        if len == 0 {
            return Ok(());
        }
        if deallocate && !self.no_punch {
            match self.fallocate(libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE, off, len) {
                Ok(()) => return Ok(()),
                Err(Fallback::Unsupported) => self.no_punch = true,
                Err(Fallback::NotHere) => {}
                Err(Fallback::Failed(e)) => return Err(e),
            }
        }
        if !self.no_zero_range {
            match self.fallocate(libc::FALLOC_FL_ZERO_RANGE | libc::FALLOC_FL_KEEP_SIZE, off, len) {
                Ok(()) => return Ok(()),
                Err(Fallback::Unsupported) => self.no_zero_range = true,
                Err(Fallback::NotHere) => {}
                Err(Fallback::Failed(e)) => return Err(e),
            }
        }
        let z = vec![0u8; 64 << 10];
        let mut done = 0;
        while done < len {
            let n = (len - done).min(z.len() as u64) as usize;
            self.file.write_all_at(&z[..n], off + done)?;
            done += n as u64;
        }
        Ok(())
    }

    /// fallocate(2) of `len` bytes at `off` in `mode` on the buffered fd.
    fn fallocate(&self, mode: i32, off: u64, len: u64) -> std::result::Result<(), Fallback> {
        use std::os::fd::AsRawFd;
        let (Ok(o), Ok(n)) = (i64::try_from(off), i64::try_from(len)) else { return Err(Fallback::NotHere) };
        loop {
            // SAFETY: plain values on our own fd; no memory is passed.
            if unsafe { libc::fallocate(self.file.as_raw_fd(), mode, o, n) } == 0 {
                return Ok(());
            }
            let e = std::io::Error::last_os_error();
            return Err(match e.raw_os_error() {
                Some(libc::EINTR) => continue,
                // Not this file system, or not this kind of file.
                Some(libc::EOPNOTSUPP | libc::ENOSYS | libc::ENODEV) => Fallback::Unsupported,
                // Not this range (a block device's alignment): the next way may take it.
                Some(libc::EINVAL) => Fallback::NotHere,
                _ => Fallback::Failed(e),
            });
        }
    }
}

/// Why fallocate did not do it.
enum Fallback {
    /// Never here: the next way from now on.
    Unsupported,
    /// Not this time: the next way for this range.
    NotHere,
    /// A real error (EIO, ENOSPC): the operation fails.
    Failed(std::io::Error),
}
