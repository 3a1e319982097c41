//! File operations on the guest's pages in place. A Read or Write whose
//! pieces (its PRP runs) all lie in mapped guest memory, aligned as O_DIRECT
//! asks, goes to the kernel as one buffer or an iovec over those pages
//! instead of through its slot's bounce buffer. That saves a copy per
//! transfer (64 KiB, cold: 11-15 us of a core on this project's machines);
//! the kernel pins the guest's pages for each operation instead.
//!
//! The kernel moves data to or from those pages until the operation is
//! reaped, so:
//! - the memory they belong to is kept mapped (a clone of its
//!   [`GuestMem`]) while any such operation is in flight, whatever the
//!   controller does meanwhile: the kernel never writes to an address this
//!   process has unmapped, or mapped anew for something else;
//! - the controller waits for them before it gives a memory up (a vfio-user
//!   DMA_UNMAP, a client that leaves: `Core::settle_guest_io`), so a client
//!   that took its memory back sees no write after the reply; a reset waits
//!   for them as for every operation (`Core::abort_io`).
//!
//! Memory the device reaches by message (vfio-user maps without an fd) is
//! never worked on in place: it is not in this process.
//!
//! Which transfers go in place is the namespace's `in_place=` option
//! ([`InPlace`]). The bounce buffers are in huge pages where the kernel
//! grants them; guest RAM is too where [`GuestMem::in_huge_pages`] says so
//! (the VMM's own anonymous RAM, a hugetlbfs memfd), but a tmpfs memfd
//! shared with a device process is in 4 KiB pages unless the host's
//! `shmem_enabled` allows more. A transfer over several 4 KiB pages reaches
//! the disk as one segment per page, through a bounce buffer as one. On
//! this project's virtual disk, 64 KiB random writes in place did 9.5 k
//! IOPS from a memfd's 4 KiB pages and 20.9 k from huge pages, against
//! 15.6-18.3 k bounced; the device thread's CPU per write fell from 20-24 us
//! bounced to 9-13 us in place.

use super::{FileOp, FileStorage};
use crate::GuestMem;
use std::fs::File;

/// An operation's pieces of guest memory, as the kernel takes them.
#[derive(Default)]
pub(super) struct Iovecs(Vec<libc::iovec>);

// SAFETY: addresses handed to the kernel; this process reads or writes
// through them only in `buffered`, while their memory is kept.
unsafe impl Send for Iovecs {}

/// Which reads and writes of a file namespace work on the guest's pages in
/// place (`in_place=`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum InPlace {
    /// Those within one 4 KiB page, which reach the disk as one segment
    /// either way, and larger ones where guest memory is in huge pages;
    /// the others go through a bounce buffer. Buffered (`direct=off`):
    /// every one, as `On`.
    #[default]
    Auto,
    /// Every one O_DIRECT's alignment allows (for storage that does not
    /// cost per segment).
    On,
    /// None: every transfer goes through a bounce buffer.
    Off,
}

/// An `in_place=` value that is none of `auto`, `on` and `off`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0:?} (auto, on or off)")]
pub struct BadInPlace(pub String);

/// The option table's reason (`nvme/options.rs`: the table names device and key).
impl From<BadInPlace> for crate::options::Reason {
    fn from(e: BadInPlace) -> Self {
        crate::options::Reason(e.to_string())
    }
}

impl std::str::FromStr for InPlace {
    type Err = BadInPlace;
    fn from_str(s: &str) -> Result<Self, BadInPlace> {
        match s {
            "auto" => Ok(InPlace::Auto),
            "on" => Ok(InPlace::On),
            "off" => Ok(InPlace::Off),
            _ => Err(BadInPlace(s.to_string())),
        }
    }
}

impl std::fmt::Display for InPlace {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            InPlace::Auto => "auto",
            InPlace::On => "on",
            InPlace::Off => "off",
        })
    }
}

/// What [`FileStorage::push_guest`] did with an operation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Placed {
    /// Queued on the ring, on the guest's pages.
    InPlace,
    /// Not for in place (a piece is remote or not aligned for O_DIRECT, or
    /// in-place operations are off): the caller bounces it.
    Bounce,
    /// The ring refused it, or it does not lie inside the namespace; the
    /// slot is still the caller's.
    Refused,
}

/// O_DIRECT's alignment for `f`: of memory addresses, and of file offsets
/// and lengths (statx's STATX_DIOALIGN; 4096 for both where it tells none).
pub(super) fn dio_align(f: &File) -> (usize, usize) {
    use std::os::fd::AsRawFd;
    // SAFETY: statx is plain data; all zeros is a valid value.
    let mut stx: libc::statx = unsafe { std::mem::zeroed() };
    // SAFETY: an empty path with AT_EMPTY_PATH names the fd; `stx` outlives the call.
    let r = unsafe { libc::statx(f.as_raw_fd(), c"".as_ptr(), libc::AT_EMPTY_PATH, libc::STATX_DIOALIGN, &mut stx) };
    let (mem, off) = (stx.stx_dio_mem_align as usize, stx.stx_dio_offset_align as usize);
    let told = r == 0 && stx.stx_mask & libc::STATX_DIOALIGN != 0;
    if told && mem.is_power_of_two() && off.is_power_of_two() {
        (mem, off)
    } else {
        (4096, 4096)
    }
}

impl FileStorage {
    /// Queues slot `slot`'s Read or Write at byte `off` on the guest's
    /// pages themselves: `runs` are the transfer's `(gpa, length)` pieces,
    /// in order, in `mem`, which is kept mapped until the operation is
    /// reaped. [`Placed::Bounce`] (nothing queued) where they are not all
    /// mapped and aligned for O_DIRECT, or [`InPlace`] says no.
    pub fn push_guest(
        &mut self,
        slot: u16,
        op: FileOp,
        off: u64,
        runs: impl Iterator<Item = (u64, u64)>,
        mem: &GuestMem,
    ) -> Placed {
        use io_uring::{opcode, types};
        let (mode, size, direct) = (self.in_place, self.bytes(), self.is_direct());
        let Some(u) = self.uring.as_mut() else { return Placed::Bounce };
        let (ma, la) = u.dio_align;
        if mode == InPlace::Off || op == FileOp::Flush || !off.is_multiple_of(la as u64) {
            return Placed::Bounce;
        }
        let iov = &mut u.iovs[slot as usize].0;
        iov.clear();
        let mut len = 0usize;
        for (gpa, n) in runs {
            let n = n as usize;
            match mem.host_address(gpa, n) {
                Some(h) if h.is_multiple_of(ma) && n.is_multiple_of(la) => {
                    iov.push(libc::iovec { iov_base: h as *mut libc::c_void, iov_len: n })
                }
                _ => return Placed::Bounce,
            }
            len += n;
        }
        if off.checked_add(len as u64).is_none_or(|end| end > size) {
            return Placed::Refused; // past the namespace: never reaches the ring
        }
        let Some(first) = iov.first() else { return Placed::Bounce };
        let one_page = iov.len() == 1 && (first.iov_base as usize % 4096) + len <= 4096;
        // Buffered (direct=off), the kernel copies into its page cache
        // either way: in place saves the bounce copy whatever the pages.
        if mode == InPlace::Auto && direct && !one_page && !mem.in_huge_pages() {
            return Placed::Bounce;
        }
        let fd = types::Fixed(0);
        let flags = if op == (FileOp::Write { dsync: true }) { libc::RWF_DSYNC } else { 0 };
        let (one, k) = (first.iov_base.cast::<u8>(), iov.len() as u32);
        let e = match (op, k) {
            (FileOp::Read, 1) => opcode::Read::new(fd, one, len as u32).offset(off).build(),
            (FileOp::Read, _) => opcode::Readv::new(fd, iov.as_ptr(), k).offset(off).build(),
            (_, 1) => opcode::Write::new(fd, one, len as u32).offset(off).rw_flags(flags).build(),
            (_, _) => opcode::Writev::new(fd, iov.as_ptr(), k).offset(off).rw_flags(flags).build(),
        }
        .user_data(slot as u64);
        // SAFETY: the pages are mapped memory of `mem`, kept mapped (below)
        // until this operation is reaped; the iovec array is the slot's
        // own and is not touched again before then.
        if unsafe { u.ring.submission().push(&e) }.is_err() {
            return Placed::Refused;
        }
        let s = &mut u.slots[slot as usize];
        (s.op, s.off, s.len, s.guest) = (op, off, len, true);
        u.guest_ops += 1;
        if !u.keep.iter().any(|m| m.same(mem)) {
            u.keep.push(mem.clone());
        }
        self.pushed(0);
        Placed::InPlace
    }

    /// The result of slot `slot`'s reaped operation on guest pages, `n`
    /// its io_uring result; lets their memory go once none is out. An
    /// operation the file refuses O_DIRECT for after all (EINVAL) is done
    /// with the buffered fd.
    pub(super) fn reap_guest(&mut self, slot: u16, n: i32) -> std::io::Result<()> {
        let FileStorage { uring, file, direct_ops, in_place_ops, .. } = self;
        let Some(u) = uring.as_mut() else { return Err(std::io::ErrorKind::NotConnected.into()) };
        let s = u.slots[slot as usize];
        let r = match n {
            n if n >= 0 && n as usize == s.len => {
                *direct_ops += 1;
                *in_place_ops += 1;
                Ok(())
            }
            n if n == -libc::EINVAL => buffered(file, s.op, &u.iovs[slot as usize].0, s.off),
            n if n < 0 => Err(std::io::Error::from_raw_os_error(-n)),
            _ => Err(std::io::Error::new(std::io::ErrorKind::UnexpectedEof, "short O_DIRECT transfer")),
        };
        u.guest_ops -= 1;
        if u.guest_ops == 0 {
            u.keep.clear();
        }
        r
    }

    /// True if slot `slot`'s last operation worked on guest pages in place
    /// (a read's data is there already).
    pub fn in_guest(&self, slot: u16) -> bool {
        self.uring.as_ref().is_some_and(|u| u.slots[slot as usize].guest)
    }

    /// Tests: O_DIRECT's alignment of addresses and lengths here.
    #[cfg(test)]
    pub fn dio_align(&self) -> Option<(usize, usize)> {
        self.uring.as_ref().map(|u| u.dio_align)
    }

    /// Operations in flight on guest pages in place.
    pub fn guest_in_flight(&self) -> usize {
        self.uring.as_ref().map_or(0, |u| u.guest_ops)
    }
}

/// pread or pwrite of the pieces `iov` at byte `off` with the buffered fd
/// (a stable write is synced after).
fn buffered(f: &File, op: FileOp, iov: &[libc::iovec], mut off: u64) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    for v in iov {
        let (mut p, mut left) = (v.iov_base as usize, v.iov_len);
        while left > 0 {
            // SAFETY: `p..p + left` is mapped guest memory, kept while the
            // operation is out (it is until reaped, which this is part of).
            let r = unsafe {
                match op {
                    FileOp::Read => libc::pread(f.as_raw_fd(), p as *mut libc::c_void, left, off as libc::off_t),
                    _ => libc::pwrite(f.as_raw_fd(), p as *const libc::c_void, left, off as libc::off_t),
                }
            };
            match r {
                r if r < 0 => {
                    let e = std::io::Error::last_os_error();
                    if e.kind() != std::io::ErrorKind::Interrupted {
                        return Err(e);
                    }
                }
                0 => return Err(std::io::ErrorKind::UnexpectedEof.into()),
                r => {
                    (p, left, off) = (p + r as usize, left - r as usize, off + r as u64);
                }
            }
        }
    }
    if op == (FileOp::Write { dsync: true }) {
        f.sync_data()?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::{BadInPlace, InPlace};

    #[test]
    fn in_place_takes_auto_on_off_and_names_a_bad_value() {
        for v in ["auto", "on", "off"] {
            assert_eq!(v.parse::<InPlace>().unwrap().to_string(), v);
        }
        assert_eq!("sometimes".parse::<InPlace>(), Err(BadInPlace("sometimes".into())));
        let e = "nvme,in_place=sometimes".parse::<crate::DeviceConfig>().unwrap_err().to_string();
        assert!(e.contains(r#"in_place: "sometimes" (auto, on or off)"#), "{e}");
    }
}
