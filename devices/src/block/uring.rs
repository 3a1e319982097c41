//! A file namespace's io_uring: the ring on its O_DIRECT fd, restricted
//! to this namespace's own operations (`restrictions`), the slots that
//! operations in flight take (each with a bounce buffer in one `Arena`)
//! and the wait for them all before the buffers go. [`FileStorage`]
//! (`reap.rs`) pushes, submits and reaps through it.
//!
//! [`FileStorage`]: super::FileStorage

use super::guest;
use std::fs::File;
use std::sync::Arc;
use vmm_sys_util::eventfd::EventFd;

/// Operations a file namespace keeps in flight at most: its io_uring's
/// size, and the slots (bounce buffers) commands take.
pub const FILE_SLOTS: usize = 256;

/// A slot's buffer: the largest transfer a command may ask for (MDTS).
pub(super) const SLOT_BYTES: usize = super::MAX_IO;

/// Pushed operations are submitted at the latest once the bounced writes
/// among them copied this much (see `pushed`).
pub(super) const SUBMIT_BYTES: usize = 256 << 10;

/// What an io_uring slot does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FileOp {
    Read,
    /// `dsync`: stable before it completes (the write cache is off).
    Write {
        dsync: bool,
    },
    /// fdatasync, started only when every operation submitted before it has
    /// completed (IOSQE_IO_DRAIN).
    Flush,
}

/// What one slot's operation does (its buffer is in the [`Arena`]).
#[derive(Clone, Copy)]
pub(super) struct Slot {
    pub(super) op: FileOp,
    pub(super) off: u64,
    pub(super) len: usize,
    /// Its buffer is registered as fixed buffer number `slot`.
    pub(super) registered: bool,
    /// Its operation works on guest pages in place, not on its buffer.
    pub(super) guest: bool,
}

/// The slots' buffers, [`SLOT_BYTES`] each, in one anonymous mapping that is
/// 2 MiB aligned and advised for transparent huge pages. A transfer inside
/// a huge page is physically contiguous, so the block layer sends it to the
/// disk as one segment, not one per 4 KiB page: a virtual disk that costs
/// per segment serves it faster (64 KiB random writes on this host's disk:
/// 21-24 k IOPS from huge pages against 9-11 k from 4 KiB ones, fio). Where
/// the kernel gives no huge page they are ordinary pages. Pages are backed
/// on first use, so an idle namespace costs address space only.
pub(super) struct Arena {
    map: *mut libc::c_void,
    map_len: usize,
    pub(super) base: *mut u8,
}

// SAFETY: the mapping is owned by the Arena alone; slices of it are handed
// out through `&mut self` only.
unsafe impl Send for Arena {}

impl Arena {
    pub(super) const HUGE: usize = 2 << 20;

    pub(super) fn new() -> std::io::Result<Arena> {
        let bytes = FILE_SLOTS * SLOT_BYTES;
        let map_len = bytes + Self::HUGE;
        let map = super::anon_map(map_len)?;
        let base = map.cast::<u8>().wrapping_add((Self::HUGE - map as usize % Self::HUGE) % Self::HUGE);
        // SAFETY: `bytes` from `base` lie inside the mapping. Advice only:
        // without it (no THP here) the buffers are ordinary pages.
        unsafe { libc::madvise(base.cast(), bytes, libc::MADV_HUGEPAGE) };
        Ok(Arena { map, map_len, base })
    }

    /// Slot `slot`'s whole buffer: start and length.
    pub(super) fn whole(&self, slot: u16) -> (*mut u8, usize) {
        assert!((slot as usize) < FILE_SLOTS);
        (self.base.wrapping_add(slot as usize * SLOT_BYTES), SLOT_BYTES)
    }

    /// Slot `slot`'s buffer, `len` bytes (at most [`SLOT_BYTES`]: commands
    /// were checked against MDTS).
    pub(super) fn get(&mut self, slot: u16, len: usize) -> &mut [u8] {
        assert!(len <= SLOT_BYTES, "a {len}-byte transfer is over MDTS");
        // SAFETY: inside the mapping (`whole` checks the slot), and borrowed
        // from `&mut self`, so no other slice of it is live.
        unsafe { std::slice::from_raw_parts_mut(self.whole(slot).0, len) }
    }

    /// Leaves the mapping to the kernel that may still write to it.
    fn leak(&mut self) {
        self.map_len = 0;
    }
}

impl Drop for Arena {
    fn drop(&mut self) {
        if self.map_len > 0 {
            // SAFETY: the mapping made in `new`, no longer used.
            unsafe { libc::munmap(self.map, self.map_len) };
        }
    }
}

/// The asynchronous side of a file namespace: an io_uring on the O_DIRECT
/// fd (registered as fixed file 0), whose completions signal `done`, and
/// which can do nothing but this namespace's I/O ([`restrictions`]).
/// Operations work on the guest's pages in place (`guest.rs`: their memory
/// is kept mapped until they are reaped) or read into or write from bounce
/// buffers of their own (the slots), which live as long as the ring.
/// Each slot's buffer is registered as fixed buffer number `slot` at its
/// first use (the kernel then pins it once, not on every operation); where
/// registering is refused (RLIMIT_MEMLOCK), operations use plain buffers.
pub(super) struct Uring {
    /// Kept open for the ring, which knows it as fixed file 0.
    pub(super) _direct: File,
    pub(super) ring: io_uring::IoUring,
    pub(super) done: Arc<EventFd>,
    pub(super) slots: Vec<Slot>,
    pub(super) arena: Arena,
    pub(super) free: Vec<u16>,
    /// Pushed (submitted or not) and not yet reaped.
    pub(super) in_flight: usize,
    /// The fixed buffer table exists and registering has not been refused.
    pub(super) fixed_bufs: bool,
    /// Operations on guest pages in place: their pieces, per slot.
    pub(super) iovs: Vec<guest::Iovecs>,
    /// Of `in_flight`, those on guest pages in place.
    pub(super) guest_ops: usize,
    /// The memories those pages belong to, kept mapped until none is in
    /// flight (one, unless the controller gave a memory up while its
    /// operations were still out).
    pub(super) keep: Vec<crate::GuestMem>,
    /// O_DIRECT's alignment of memory addresses and of each piece's length
    /// ((1, 1) on a buffered fd, `direct=off`).
    pub(super) dio_align: (usize, usize),
}

/// io_uring_register(2)'s opcode for updating registered buffers in place:
/// the one registration a ring allows once it is enabled (`Uring::register`).
pub const IORING_REGISTER_BUFFERS_UPDATE: u8 = 16;

/// What a file namespace's ring may do once enabled, registered with
/// IORING_REGISTER_RESTRICTIONS: the operations `push` and `push_guest`
/// submit, each on fixed file 0 (IOSQE_FIXED_FILE required, IOSQE_IO_DRAIN
/// allowed: a flush), and buffer updates. Anything else (an open, a socket
/// operation, a plain fd) completes with EACCES: the ring cannot reach
/// what the process's sandbox refuses its system calls.
fn restrictions() -> Vec<io_uring::register::Restriction> {
    use io_uring::{opcode, register::Restriction, squeue::Flags};
    let ops = [
        opcode::Read::CODE,
        opcode::Readv::CODE,
        opcode::ReadFixed::CODE,
        opcode::Write::CODE,
        opcode::Writev::CODE,
        opcode::WriteFixed::CODE,
        opcode::Fsync::CODE,
    ];
    let mut r: Vec<_> = ops.into_iter().map(Restriction::sqe_op).collect();
    r.push(Restriction::sqe_flags_allowed((Flags::FIXED_FILE | Flags::IO_DRAIN).bits()));
    r.push(Restriction::sqe_flags_required(Flags::FIXED_FILE.bits()));
    r.push(Restriction::register_op(IORING_REGISTER_BUFFERS_UPDATE));
    r
}

/// A ring of `entries` created disabled (IORING_SETUP_R_DISABLED, Linux
/// 5.10), so that its restrictions can be registered before it runs; false
/// with a plain ring where the kernel has no such flag.
fn disabled_ring(entries: u32) -> std::io::Result<(io_uring::IoUring, bool)> {
    match io_uring::IoUring::builder().setup_r_disabled().build(entries) {
        Ok(r) => Ok((r, true)),
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
            log::warn!(
                "nvme: this kernel's io_uring has no restrictions (IORING_SETUP_R_DISABLED: Linux 5.10); \
                 the file backend's ring may make any io_uring operation"
            );
            Ok((io_uring::IoUring::new(entries)?, false))
        }
        Err(e) => Err(e),
    }
}

impl Uring {
    /// A ring on `file`, opened with O_DIRECT if `direct` (whose
    /// alignment is then the file's, statx), else buffered (none asked);
    /// its completions signal `done`, or an eventfd of its own (several
    /// rings may signal one: a controller's file namespaces).
    pub(super) fn new(file: File, direct: bool, done: Option<Arc<EventFd>>) -> std::io::Result<Uring> {
        use std::os::fd::AsRawFd;
        let (ring, disabled) = disabled_ring(FILE_SLOTS as u32)?;
        ring.submitter().register_files(&[file.as_raw_fd()])?;
        let done = match done {
            Some(d) => d,
            None => Arc::new(EventFd::new(libc::EFD_CLOEXEC)?),
        };
        ring.submitter().register_eventfd(done.as_raw_fd())?;
        let fixed_bufs = ring.submitter().register_buffers_sparse(FILE_SLOTS as u32).is_ok();
        if disabled {
            ring.submitter().register_restrictions(&mut restrictions())?;
            ring.submitter().register_enable_rings()?;
        }
        let slots = vec![Slot { op: FileOp::Read, off: 0, len: 0, registered: false, guest: false }; FILE_SLOTS];
        let arena = Arena::new()?;
        let free = (0..FILE_SLOTS as u16).rev().collect();
        let dio_align = if direct { guest::dio_align(&file) } else { (1, 1) };
        Ok(Uring {
            _direct: file,
            ring,
            done,
            slots,
            arena,
            free,
            in_flight: 0,
            fixed_bufs,
            iovs: (0..FILE_SLOTS).map(|_| guest::Iovecs::default()).collect(),
            guest_ops: 0,
            keep: Vec::new(),
            dio_align,
        })
    }

    /// Makes slot `slot`'s buffer its fixed buffer if it is not yet. False
    /// if it cannot be.
    pub(super) fn register(&mut self, slot: u16) -> bool {
        if self.slots[slot as usize].registered {
            return true;
        }
        if !self.fixed_bufs {
            return false;
        }
        let (start, cap) = self.arena.whole(slot);
        let iov = libc::iovec { iov_base: start.cast(), iov_len: cap };
        // SAFETY: the buffer is this slot's part of the arena, which lives as
        // long as the ring (Drop waits for the operations before either goes).
        match unsafe { self.ring.submitter().register_buffers_update(slot as u32, &[iov], None) } {
            Ok(()) => {
                self.slots[slot as usize].registered = true;
                true
            }
            Err(e) => {
                log::info!("nvme: no fixed io_uring buffers ({e}); using plain ones");
                self.fixed_bufs = false;
                false
            }
        }
    }
}

impl Drop for Uring {
    /// The kernel may still copy into a slot's buffer: wait for every
    /// operation before the buffers go (or leak them if waiting fails).
    fn drop(&mut self) {
        while self.in_flight > 0 {
            match self.ring.submit_and_wait(1) {
                Ok(_) => {}
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => {
                    log::warn!("nvme: io_uring wait at close: {e}; {} buffers leaked", self.in_flight);
                    self.arena.leak();
                    // Guest memory too: the kernel may still move data to or from it.
                    std::mem::forget(std::mem::take(&mut self.keep));
                    return;
                }
            }
            self.in_flight -= self.ring.completion().count().min(self.in_flight);
        }
    }
}
