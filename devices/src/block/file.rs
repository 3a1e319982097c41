//! A `file:PATH` namespace: a regular file or a block device, opened
//! buffered (synchronous pread/pwrite, fdatasync) and, where the file
//! system and kernel allow, O_DIRECT through an io_uring ([`uring`]) with
//! up to [`FILE_SLOTS`](super::FILE_SLOTS) operations in flight: pushed by a front end,
//! submitted in batches, reaped from the ring's completions.
//!
//! [`uring`]: super::uring

use super::guest::InPlace;
use super::uring::{FileOp, Uring, SUBMIT_BYTES};
use crate::{Error, Result};
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::sync::Arc;
use vmm_sys_util::eventfd::EventFd;

/// A file namespace: a buffered fd always, and when the filesystem and
/// kernel allow, an O_DIRECT fd driven through io_uring with up to
/// [`FILE_SLOTS`](super::FILE_SLOTS) operations in flight.
pub struct FileStorage {
    pub(super) file: File,
    pub(super) uring: Option<Uring>,
    /// Operations that completed through io_uring with O_DIRECT.
    pub direct_ops: u64,
    /// Of those, the ones on guest pages in place.
    pub in_place_ops: u64,
    /// Which reads and writes work on guest pages in place (`guest.rs`).
    pub in_place: InPlace,
    /// Pushed operations go to the kernel once this many wait in the ring
    /// (0: when the queue pass that pushed them ends, or a bounced write's
    /// copies reach [`SUBMIT_BYTES`]). One at a time costs a system call
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
    stalled: bool,
    /// Bytes of the operations pushed since the last submit.
    unsent_bytes: usize,
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

/// The buffered fd of a `file:PATH` namespace of `bytes`: `p` opened (or
/// created); a regular file shorter than that is extended, a block device
/// must hold it already.
fn open_backing(p: &std::path::Path, bytes: u64) -> Result<File> {
    use std::os::unix::fs::FileTypeExt;
    let io_err = |e| Error::io(p.display().to_string(), e);
    let f = std::fs::OpenOptions::new().read(true).write(true).create(true).truncate(false).open(p).map_err(io_err)?;
    let have = backing_bytes(&f).map_err(io_err)?;
    if have < bytes {
        if f.metadata().map_err(io_err)?.file_type().is_block_device() {
            return Err(Error::Option {
                device: "nvme",
                option: "backend".into(),
                reason: format!("{}: the block device holds {have} bytes, the namespace needs {bytes}", p.display()),
            });
        }
        f.set_len(bytes).map_err(io_err)?;
    }
    Ok(f)
}

impl FileStorage {
    /// Opens `p` for a namespace of `bytes` ([`open_backing`]), and its
    /// O_DIRECT io_uring where the file system and kernel allow.
    pub(super) fn open(p: &std::path::Path, bytes: u64) -> Result<Self> {
        let f = open_backing(p, bytes)?;
        use std::os::unix::fs::OpenOptionsExt;
        // O_NOATIME: every read of a block device (or of a file mounted
        // relatime) otherwise goes through the kernel's atime check, about
        // 5 % of the device thread's CPU per 4 KiB read on a loop device.
        // Only the file's owner (or CAP_FOWNER) may ask for it.
        let open_direct = |flags| std::fs::OpenOptions::new().read(true).write(true).custom_flags(flags).open(p);
        let direct = match open_direct(libc::O_DIRECT | libc::O_NOATIME) {
            Err(e) if e.raw_os_error() == Some(libc::EPERM) => open_direct(libc::O_DIRECT),
            r => r,
        };
        let uring = match direct {
            Err(e) => {
                log::info!("{}: no O_DIRECT here ({e}); using pread/pwrite", p.display());
                None
            }
            Ok(d) => match Uring::new(d) {
                Ok(u) => Some(u),
                Err(e) => {
                    log::info!("io_uring unavailable ({e}); using pread/pwrite");
                    None
                }
            },
        };
        Ok(FileStorage {
            file: f,
            uring,
            direct_ops: 0,
            in_place_ops: 0,
            in_place: InPlace::Auto,
            submit_batch: 0,
            max_in_flight: 0,
            stalled: false,
            unsent_bytes: 0,
            #[cfg(test)]
            fail_submits: 0,
        })
    }

    /// True when commands go through io_uring (asynchronously).
    pub fn is_async(&self) -> bool {
        self.uring.is_some()
    }

    /// The eventfd io_uring signals on each completion.
    pub fn completion_fd(&self) -> Option<Arc<EventFd>> {
        self.uring.as_ref().map(|u| u.done.clone())
    }

    /// Operations pushed and not yet reaped.
    pub fn in_flight(&self) -> usize {
        self.uring.as_ref().map_or(0, |u| u.in_flight)
    }

    /// Takes a free slot (None: all [`FILE_SLOTS`](super::FILE_SLOTS) are taken, or no io_uring).
    pub fn take_slot(&mut self) -> Option<u16> {
        self.uring.as_mut()?.free.pop()
    }

    /// True if a slot is free (or commands are served synchronously).
    pub fn has_room(&self) -> bool {
        self.uring.as_ref().is_none_or(|u| !u.free.is_empty())
    }

    /// Gives a slot back; its operation must have been reaped (or never pushed).
    pub fn release(&mut self, slot: u16) {
        if let Some(u) = self.uring.as_mut() {
            debug_assert!(!u.free.contains(&slot));
            u.free.push(slot);
        }
    }

    /// Slot `slot`'s buffer, `len` bytes, 4 KiB aligned (not while its
    /// operation is in flight).
    pub fn buffer(&mut self, slot: u16, len: usize) -> &mut [u8] {
        self.uring.as_mut().expect("a slot is taken from the io_uring").arena.get(slot, len)
    }

    /// Queues slot `slot`'s operation on the ring (sent at the next
    /// [`submit`](Self::submit)); `len` bytes of its buffer at byte `off`.
    /// False if the ring refused it (the slot is still the caller's).
    pub fn push(&mut self, slot: u16, op: FileOp, off: u64, len: usize) -> bool {
        use io_uring::{opcode, squeue::Flags, types};
        let Some(u) = self.uring.as_mut() else { return false };
        let ptr = u.arena.get(slot, len).as_mut_ptr();
        let fixed = op != FileOp::Flush && u.register(slot);
        let s = &mut u.slots[slot as usize];
        (s.op, s.off, s.len, s.guest) = (op, off, len, false);
        let fd = types::Fixed(0);
        let (n, flags) = (len as u32, if op == (FileOp::Write { dsync: true }) { libc::RWF_DSYNC } else { 0 });
        let e = match op {
            FileOp::Read if fixed => opcode::ReadFixed::new(fd, ptr, n, slot).offset(off).build(),
            FileOp::Read => opcode::Read::new(fd, ptr, n).offset(off).build(),
            FileOp::Write { .. } if fixed => {
                opcode::WriteFixed::new(fd, ptr, n, slot).offset(off).rw_flags(flags).build()
            }
            FileOp::Write { .. } => opcode::Write::new(fd, ptr, n).offset(off).rw_flags(flags).build(),
            FileOp::Flush => opcode::Fsync::new(fd).flags(types::FsyncFlags::DATASYNC).build().flags(Flags::IO_DRAIN),
        }
        .user_data(slot as u64);
        // SAFETY: the buffer is the slot's own and stays put (it is neither
        // resized nor freed) until this operation's completion is reaped:
        // the slot is not given back before that, and Drop waits for it.
        if unsafe { u.ring.submission().push(&e) }.is_err() {
            return false;
        }
        self.pushed(if matches!(op, FileOp::Write { .. }) { len } else { 0 });
        true
    }

    /// Counts an operation just pushed, `copied` bytes gathered into its
    /// bounce buffer before; submits what was pushed once the copies add up
    /// to [`SUBMIT_BYTES`] or [`submit_batch`](Self::submit_batch) operations wait.
    pub(super) fn pushed(&mut self, copied: usize) {
        let batch_full = match self.uring.as_mut() {
            Some(u) => {
                u.in_flight += 1;
                self.submit_batch > 0 && u.ring.submission().len() >= self.submit_batch
            }
            None => false,
        };
        // A queue pass pushes many and submits once, but bounced writes are
        // copied into their slots as they are pushed (64 KiB: several us
        // each): the first would wait for every copy after it. Submitted
        // every SUBMIT_BYTES of copies instead, so the file sees them while
        // the rest copy. Reads and transfers in place copy nothing first.
        self.unsent_bytes += copied;
        if self.unsent_bytes >= SUBMIT_BYTES || batch_full {
            self.submit();
        }
    }

    /// Sends every pushed operation to the kernel, without waiting. What
    /// the kernel does not take stays in the ring for the next submit; the
    /// first time, the completion eventfd is signalled so that the device
    /// thread wakes (no completion may come to wake it) and retries.
    pub fn submit(&mut self) {
        self.unsent_bytes = 0;
        let Some(u) = self.uring.as_mut() else { return };
        while !u.ring.submission().is_empty() {
            #[cfg(test)]
            if self.fail_submits > 0 {
                self.fail_submits -= 1;
                break;
            }
            match u.ring.submit() {
                Ok(0) => break, // nothing taken: try again next time rather than spin
                Ok(_) => {}
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                // Kept in the ring: the next submit (each pass, each reap) sends them.
                Err(e) => {
                    log::debug!("nvme: io_uring submit: {e}");
                    break;
                }
            }
        }
        let unsent = u.ring.submission().len();
        self.max_in_flight = self.max_in_flight.max((u.in_flight - unsent) as u64);
        if unsent > 0 && !self.stalled {
            let _ = u.done.write(1);
        }
        self.stalled = unsent > 0;
    }

    /// Tests: what the taken slots do.
    #[cfg(test)]
    pub fn taken_ops(&self) -> Vec<FileOp> {
        let Some(u) = &self.uring else { return Vec::new() };
        (0..super::FILE_SLOTS as u16).filter(|s| !u.free.contains(s)).map(|s| u.slots[s as usize].op).collect()
    }

    /// Operations wait in the ring for a submit the kernel refused.
    pub fn stalled(&self) -> bool {
        self.stalled
    }

    /// Blocks until an operation completes; false if none is in flight or
    /// waiting failed.
    pub fn wait(&mut self) -> bool {
        let Some(u) = self.uring.as_mut() else { return false };
        if u.in_flight == 0 {
            return false;
        }
        loop {
            match u.ring.submit_and_wait(1) {
                Ok(_) => return true,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => {
                    log::warn!("nvme: io_uring wait: {e}");
                    return false;
                }
            }
        }
    }

    /// Blocks until an operation completes or `timeout` passed (sends what
    /// an earlier submit left in the ring first); false if none is in
    /// flight, the time passed or waiting failed.
    pub fn wait_for(&mut self, timeout: std::time::Duration) -> bool {
        use std::os::fd::AsRawFd;
        self.submit();
        let Some(u) = self.uring.as_mut() else { return false };
        if u.in_flight == 0 {
            return false;
        }
        if !u.ring.completion().is_empty() {
            return true;
        }
        // The ring's fd is readable while its completion queue holds an entry.
        let mut p = libc::pollfd { fd: u.ring.as_raw_fd(), events: libc::POLLIN, revents: 0 };
        let ms = timeout.as_millis().clamp(1, i32::MAX as u128) as i32;
        // SAFETY: one valid pollfd.
        match unsafe { libc::poll(&mut p, 1, ms) } {
            n if n > 0 => true,
            0 => false,
            _ => {
                let e = std::io::Error::last_os_error();
                if e.kind() != std::io::ErrorKind::Interrupted {
                    log::warn!("nvme: io_uring wait: {e}");
                    return false;
                }
                true // the caller looks again (and checks its deadline)
            }
        }
    }

    /// The next completed operation, without waiting: its slot and result.
    /// The slot stays taken (its buffer holds the data read) until
    /// [`release`](Self::release). A read or write the filesystem refuses
    /// O_DIRECT for (EINVAL: its block size) is done here with the buffered fd.
    pub fn reap(&mut self) -> Option<(u16, std::io::Result<()>)> {
        let u = self.uring.as_mut()?;
        let c = u.ring.completion().next()?;
        u.in_flight -= 1;
        let slot = c.user_data() as u16;
        let Some(&s) = u.slots.get(slot as usize) else {
            return self.reap(); // not one of ours (cannot be: user_data is a slot)
        };
        let n = c.result();
        if s.guest {
            let r = self.reap_guest(slot, n);
            return Some((slot, r));
        }
        let r = match s.op {
            FileOp::Flush if n == 0 => Ok(()),
            FileOp::Read | FileOp::Write { .. } if n >= 0 && n as usize == s.len => {
                self.direct_ops += 1;
                Ok(())
            }
            FileOp::Read if n == -libc::EINVAL => self.file.read_exact_at(u.arena.get(slot, s.len), s.off),
            FileOp::Write { dsync } if n == -libc::EINVAL => {
                let r = self.file.write_all_at(u.arena.get(slot, s.len), s.off);
                if dsync {
                    r.and_then(|()| self.file.sync_data())
                } else {
                    r
                }
            }
            _ if n < 0 => Err(std::io::Error::from_raw_os_error(-n)),
            _ => Err(std::io::Error::new(std::io::ErrorKind::UnexpectedEof, "short O_DIRECT transfer")),
        };
        Some((slot, r))
    }
}
