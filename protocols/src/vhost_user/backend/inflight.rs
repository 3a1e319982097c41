//! GET_INFLIGHT_FD and SET_INFLIGHT_FD (protocol feature INFLIGHT_SHMFD):
//! the region in which the rings note the chains in flight
//! ([`iopath_devices::virtio::inflight`]), which the frontend keeps across
//! the death of a device process and hands to the next one.
//!
//! GET_INFLIGHT_FD makes a zeroed memfd of the size the frontend's queue
//! count and size need, both bounded by what the device serves (at most
//! its queues, each at most [`MAX_QUEUE_SIZE`]), sealed against shrinking
//! and growing. SET_INFLIGHT_FD maps the `region_size` bytes those numbers
//! need from the fd the frontend sends (whatever it is, as guest RAM:
//! registered with the SIGBUS handler, its length checked; `mmap_size` at
//! least what is needed). A refusal is an error reply where the frontend
//! asked for one (SET) or the end of the session (GET: the `vhost` crate
//! has no error reply for it), never a panic.

use crate::function::{map_region, shrunk, MappedRegion, SharedRegion};
use crate::sigbus::Owner;
use iopath_devices::virtio::inflight::{queue_region_size, region_size, InflightRing};
use iopath_devices::virtio::queue::MAX_QUEUE_SIZE;
use std::fs::File;
use std::os::fd::{AsRawFd, FromRawFd};
use std::ptr::NonNull;
use std::sync::Arc;
use vhost::vhost_user::message::VhostUserInflight;

/// Why an in-flight request is refused.
#[derive(Debug, thiserror::Error)]
pub(super) enum BadInflight {
    #[error("{0} queues (1 ..= {1}, the device's)")]
    Queues(u16, usize),
    #[error("queue size {0} (a power of 2, 1 ..= {MAX_QUEUE_SIZE})")]
    QueueSize(u16),
    #[error("{size:#x} bytes for {queues} queues of {queue_size}, which take {need:#x}")]
    Size { size: u64, queues: u16, queue_size: u16, need: u64 },
    #[error("its memfd: {0}")]
    Memfd(std::io::Error),
    #[error("{0}")]
    Map(#[from] crate::Error),
}

/// The bytes `m`'s queues need, if the device serves that many of that size.
fn need(m: &VhostUserInflight, queues: usize) -> Result<u64, BadInflight> {
    if m.num_queues == 0 || m.num_queues as usize > queues {
        return Err(BadInflight::Queues(m.num_queues, queues));
    }
    if m.queue_size == 0 || m.queue_size > MAX_QUEUE_SIZE || !m.queue_size.is_power_of_two() {
        return Err(BadInflight::QueueSize(m.queue_size));
    }
    Ok(region_size(m.num_queues, m.queue_size))
}

/// GET_INFLIGHT_FD: a new zeroed region for `m`'s queues (the device has
/// `queues`), and what the reply says of it.
pub(super) fn create(m: &VhostUserInflight, queues: usize) -> Result<(VhostUserInflight, File), BadInflight> {
    let size = need(m, queues)?.div_ceil(4096) * 4096;
    // SAFETY: memfd_create with a NUL-terminated name; the fd is checked, then owned by the File.
    let fd =
        unsafe { libc::memfd_create(c"iopath-vhost-inflight".as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) };
    if fd < 0 {
        return Err(BadInflight::Memfd(std::io::Error::last_os_error()));
    }
    // SAFETY: a new fd, owned from here on.
    let f = unsafe { File::from_raw_fd(fd) };
    f.set_len(size).map_err(BadInflight::Memfd)?;
    let seals = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;
    // SAFETY: F_ADD_SEALS on an fd we own.
    if unsafe { libc::fcntl(f.as_raw_fd(), libc::F_ADD_SEALS, seals) } != 0 {
        return Err(BadInflight::Memfd(std::io::Error::last_os_error()));
    }
    Ok((VhostUserInflight::new(size, 0, m.num_queues, m.queue_size), f))
}

/// A region the frontend set (SET_INFLIGHT_FD), mapped.
pub(super) struct Region {
    mapped: MappedRegion,
    num_queues: u16,
    queue_size: u16,
}

impl Region {
    /// Maps the region `m` describes from `file`, for a device of `queues`
    /// queues, registered for `owner` with the SIGBUS handler.
    pub(super) fn map(
        m: &VhostUserInflight,
        file: File,
        queues: usize,
        owner: &Arc<Owner>,
    ) -> Result<Region, BadInflight> {
        let need = need(m, queues)?;
        if m.mmap_size < need {
            return Err(BadInflight::Size { size: m.mmap_size, queues: m.num_queues, queue_size: m.queue_size, need });
        }
        let mapped = map_region(SharedRegion { gpa: 0, size: need, offset: m.mmap_offset, file }, owner)?;
        Ok(Region { mapped, num_queues: m.num_queues, queue_size: m.queue_size })
    }

    /// Queue `i`'s part, if the region has one.
    pub(super) fn ring(&self, i: usize) -> Option<InflightRing> {
        if i >= self.num_queues as usize {
            return None;
        }
        let at = i * queue_region_size(self.queue_size) as usize;
        // SAFETY: `at` plus a queue's region lies inside the mapping
        // (region_size bytes of it, checked when mapped).
        let p = unsafe { self.mapped.region.as_ptr().add(at) };
        let p = NonNull::new(p)?;
        // SAFETY: page-aligned mapping plus a multiple of 64; the view keeps
        // a clone of the mapping (its guard) alive.
        Some(unsafe { InflightRing::new(p, self.queue_size, Arc::new(self.mapped.clone())) })
    }

    /// Why the session ends if the frontend shrank the region's file.
    pub(super) fn shrunk(&self) -> Option<crate::Error> {
        shrunk(&[&self.mapped])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn msg(size: u64, queues: u16, qs: u16) -> VhostUserInflight {
        VhostUserInflight::new(size, 0, queues, qs)
    }

    /// GET's memfd fits what SET needs, is sealed against shrinking, and a
    /// SET of it maps; numbers past the device's, or a size too small, are
    /// refused with a reason.
    #[test]
    fn get_makes_what_set_maps_and_bad_numbers_are_refused() {
        let owner = Owner::new(None::<&File>).unwrap();
        let (reply, f) = create(&msg(0, 2, 128), 4).unwrap();
        assert!(reply.mmap_size >= region_size(2, 128) && reply.mmap_size.is_multiple_of(4096));
        assert_eq!((reply.num_queues, reply.queue_size), (2, 128));
        assert!(f.set_len(16).is_err(), "the region can shrink");
        let r = Region::map(&reply, f.try_clone().unwrap(), 4, &owner).unwrap();
        assert!(r.ring(1).is_some() && r.ring(2).is_none());
        let mut q = r.ring(1).unwrap();
        assert_eq!(q.start(128, 0).unwrap().resubmit, Vec::<u16>::new());
        for (m, what) in [
            (msg(0, 0, 128), "0 queues"),
            (msg(0, 5, 128), "5 queues"),
            (msg(0, 1, 512), "queue size 512"),
            (msg(0, 1, 100), "queue size 100"),
        ] {
            let e = create(&m, 4).err().unwrap().to_string();
            assert!(e.contains(what), "{e}");
        }
        let e = Region::map(&msg(64, 2, 128), f.try_clone().unwrap(), 4, &owner).err().unwrap().to_string();
        assert!(e.contains("which take"), "{e}");
        // An offset past the fd's end: refused by the mapping's length check.
        let mut past = reply;
        past.mmap_offset = 1 << 20;
        assert!(Region::map(&past, f, 4, &owner).is_err());
    }
}
