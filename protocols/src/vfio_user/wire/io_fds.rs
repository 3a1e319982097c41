//! GET_REGION_IO_FDS: the ioeventfds (and ioregionfd regions) a server
//! offers for a region, each entry indexing an fd sent with the reply.
//!
//! Two entry layouts are deployed. The spec text gives 40 bytes, the last
//! field (ioeventfd `datamatch`, ioregionfd `user_data`) at 32. libvfio-user
//! (`include/vfio-user.h`, so SPDK's NVMe target and QEMU's
//! x-vfio-user-server) sends 48: a union of its ioeventfd entry, which has
//! `shadow_mem_fd_index` at 28, `shadow_offset` at 32 and `datamatch` at 40,
//! and the 40-byte ioregionfd entry; it also sends type 2, a shadow
//! ioeventfd, unasked. The reply's stride, `(argsz - 16) / count` (the spec
//! writes `argsz - 32`, which its own 16-byte head and every server
//! contradict), says which: under 48 the spec's, 48 and more libvfio-user's.
//! An entry of an unknown type, or with flags its type does not allow, is
//! kept as [`IoFdEntry::Other`] for the client to skip.

use super::*;

/// The spec's entry.
const IO_FD_ENTRY_SIZE: usize = 40;
/// libvfio-user's entry, with the shadow ioeventfd fields.
const IO_FD_ENTRY_SIZE_SHADOW: usize = 48;

pub const IO_FD_TYPE_IOEVENTFD: u32 = 0;
pub const IO_FD_TYPE_IOREGIONFD: u32 = 1;
/// libvfio-user's shadow ioeventfd (`VFIO_USER_IO_FD_TYPE_IOEVENTFD_SHADOW`).
pub const IO_FD_TYPE_IOEVENTFD_SHADOW: u32 = 2;
/// `KVM_IOEVENTFD_FLAG_*` as in `<linux/kvm.h>` (bit 2 is DEASSIGN, not sent).
pub const KVM_IOEVENTFD_FLAG_DATAMATCH: u32 = 1 << 0;
pub const KVM_IOEVENTFD_FLAG_PIO: u32 = 1 << 1;
pub const KVM_IOEVENTFD_FLAG_VIRTIO_CCW_NOTIFY: u32 = 1 << 3;
pub const KVM_IOREGION_PIO: u32 = 1 << 0;
pub const KVM_IOREGION_POSTED_WRITES: u32 = 1 << 1;

const IOEVENTFD_FLAGS: u32 =
    KVM_IOEVENTFD_FLAG_DATAMATCH | KVM_IOEVENTFD_FLAG_PIO | KVM_IOEVENTFD_FLAG_VIRTIO_CCW_NOTIFY;

/// GET_REGION_IO_FDS request (16 bytes; `flags` and `count` are 0).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IoFdsRequest {
    pub argsz: u32,
    pub index: u32,
}

impl IoFdsRequest {
    pub fn parse(b: &[u8]) -> Result<Self, WireError> {
        let mut r = Rd::new("region_io_fds request", b, INFO16_SIZE, true)?;
        let (argsz, flags, index, count) = (r.u32()?, r.u32()?, r.u32()?, r.u32()?);
        if flags != 0 || count != 0 {
            return Err(invalid(format!("region_io_fds request: flags {flags:#x} and count {count} must be 0")));
        }
        check_argsz(r.what, argsz, INFO16_SIZE).map(|_| IoFdsRequest { argsz, index })
    }

    pub fn to_bytes(&self) -> Vec<u8> {
        Wr::new(INFO16_SIZE).u32(self.argsz).u32(0).u32(self.index).u32(0).0
    }
}

/// One sub-region of a GET_REGION_IO_FDS reply. `fd_index` indexes the
/// file descriptors sent with the reply.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IoFdEntry {
    IoEventFd {
        offset: u64,
        size: u64,
        fd_index: u32,
        flags: u32,
        datamatch: u64,
    },
    IoRegionFd {
        offset: u64,
        size: u64,
        fd_index: u32,
        flags: u32,
        user_data: u64,
    },
    /// libvfio-user's shadow ioeventfd: an ioeventfd whose written value
    /// KVM (patched) stores at `shadow_offset` of the memory fd
    /// `shadow_fd_index`. Only in 48-byte entries.
    ShadowIoEventFd {
        offset: u64,
        size: u64,
        fd_index: u32,
        flags: u32,
        shadow_fd_index: u32,
        shadow_offset: u64,
        datamatch: u64,
    },
    /// A sub-region this codec cannot take: an unknown type, flags its type
    /// does not allow, or a shadow ioeventfd in a 40-byte entry. A client
    /// skips it (io fds are optional: the accesses then go as messages).
    Other {
        offset: u64,
        size: u64,
        fd_index: u32,
        ty: u32,
        flags: u32,
    },
}

impl IoFdEntry {
    pub fn fd_index(&self) -> u32 {
        match *self {
            IoFdEntry::IoEventFd { fd_index, .. }
            | IoFdEntry::IoRegionFd { fd_index, .. }
            | IoFdEntry::ShadowIoEventFd { fd_index, .. }
            | IoFdEntry::Other { fd_index, .. } => fd_index,
        }
    }

    /// Reads one entry laid out for `stride` (>= 40) bytes.
    fn read(r: &mut Rd, stride: usize) -> Result<Self, WireError> {
        let (offset, size, fd_index, ty, flags) = (r.u64()?, r.u64()?, r.u32()?, r.u32()?, r.u32()?);
        let (word28, at32) = (r.u32()?, r.u64()?);
        let at40 = if stride >= IO_FD_ENTRY_SIZE_SHADOW { Some(r.u64()?) } else { None };
        let other = IoFdEntry::Other { offset, size, fd_index, ty, flags };
        Ok(match ty {
            IO_FD_TYPE_IOEVENTFD if flags & !IOEVENTFD_FLAGS == 0 => {
                IoFdEntry::IoEventFd { offset, size, fd_index, flags, datamatch: at40.unwrap_or(at32) }
            }
            IO_FD_TYPE_IOREGIONFD
                if flags & !(KVM_IOREGION_PIO | KVM_IOREGION_POSTED_WRITES) == 0
                    && (size != 0 || flags & KVM_IOREGION_POSTED_WRITES != 0) =>
            {
                // Its 40-byte entry in either layout (libvfio-user's is a union member).
                IoFdEntry::IoRegionFd { offset, size, fd_index, flags, user_data: at32 }
            }
            IO_FD_TYPE_IOEVENTFD_SHADOW if flags & !IOEVENTFD_FLAGS == 0 => match at40 {
                Some(datamatch) => IoFdEntry::ShadowIoEventFd {
                    offset,
                    size,
                    fd_index,
                    flags,
                    shadow_fd_index: word28,
                    shadow_offset: at32,
                    datamatch,
                },
                None => other,
            },
            _ => other,
        })
    }

    /// Writes one entry in `stride` bytes (the spec's layout under 48,
    /// libvfio-user's from 48), zero-padded.
    fn write(&self, w: Wr, stride: usize) -> Wr {
        let wide = stride >= IO_FD_ENTRY_SIZE_SHADOW;
        let (offset, size, fd_index, ty, flags, word28, at32, at40) = match *self {
            IoFdEntry::IoEventFd { offset, size, fd_index, flags, datamatch: d } => {
                let (at32, at40) = if wide { (0, d) } else { (d, 0) };
                (offset, size, fd_index, IO_FD_TYPE_IOEVENTFD, flags, 0, at32, at40)
            }
            IoFdEntry::IoRegionFd { offset, size, fd_index, flags, user_data: u } => {
                (offset, size, fd_index, IO_FD_TYPE_IOREGIONFD, flags, 0, u, 0)
            }
            IoFdEntry::ShadowIoEventFd { offset, size, fd_index, flags, shadow_fd_index, shadow_offset, datamatch } => {
                let ty = IO_FD_TYPE_IOEVENTFD_SHADOW;
                (offset, size, fd_index, ty, flags, shadow_fd_index, shadow_offset, datamatch)
            }
            IoFdEntry::Other { offset, size, fd_index, ty, flags } => (offset, size, fd_index, ty, flags, 0, 0, 0),
        };
        let mut w = w.u64(offset).u64(size).u32(fd_index).u32(ty).u32(flags).u32(word28).u64(at32);
        if wide {
            w = w.u64(at40);
        }
        w.bytes(&vec![0; stride - if wide { IO_FD_ENTRY_SIZE_SHADOW } else { IO_FD_ENTRY_SIZE }])
    }
}

/// GET_REGION_IO_FDS reply: 16-byte head then `count` entries. If the
/// request's `argsz` was too small the reply is the head alone, `count` and
/// `argsz` saying what is needed, and `entries` is empty.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IoFdsReply {
    pub argsz: u32,
    pub index: u32,
    pub count: u32,
    pub entries: Vec<IoFdEntry>,
}

impl IoFdsReply {
    /// A reply in the spec's 40-byte entries, or libvfio-user's 48 if a
    /// shadow ioeventfd needs them.
    pub fn new(index: u32, entries: Vec<IoFdEntry>) -> Self {
        let shadow = entries.iter().any(|e| matches!(e, IoFdEntry::ShadowIoEventFd { .. }));
        let stride = if shadow { IO_FD_ENTRY_SIZE_SHADOW } else { IO_FD_ENTRY_SIZE };
        let argsz = len_u32(INFO16_SIZE + entries.len() * stride);
        IoFdsReply { argsz, index, count: len_u32(entries.len()), entries }
    }

    /// The reply for a request that allowed `req_argsz` bytes.
    pub fn fit(mut self, req_argsz: u32) -> Self {
        if req_argsz < self.argsz {
            self.entries.clear();
        }
        self
    }

    /// True if the server has sub-regions that were not sent.
    pub fn is_truncated(&self) -> bool {
        self.entries.len() != self.count as usize
    }

    /// Bytes per entry: `(argsz - 16) / count`.
    fn stride(&self) -> usize {
        (self.argsz as usize).saturating_sub(INFO16_SIZE).checked_div(self.count as usize).unwrap_or(0)
    }

    pub fn to_bytes(&self) -> Vec<u8> {
        let stride = self.stride().max(IO_FD_ENTRY_SIZE);
        let mut w = Wr::new(INFO16_SIZE + self.entries.len() * stride);
        w = w.u32(self.argsz).u32(0).u32(self.index).u32(self.count);
        for e in &self.entries {
            w = e.write(w, stride);
        }
        w.0
    }

    pub fn parse(b: &[u8]) -> Result<Self, WireError> {
        const WHAT: &str = "region_io_fds reply";
        let mut r = Rd::new(WHAT, b, INFO16_SIZE, false)?;
        let (argsz, flags, index, count) = (r.u32()?, r.u32()?, r.u32()?, r.u32()?);
        let (argsz_n, count_n) = (argsz as usize, count as usize);
        let mut reply = IoFdsReply { argsz, index, count, entries: Vec::new() };
        let stride = reply.stride();
        let fits = match count_n {
            0 => argsz_n == INFO16_SIZE,
            _ => stride >= IO_FD_ENTRY_SIZE && INFO16_SIZE + stride * count_n == argsz_n,
        };
        if flags != 0 || !fits {
            return Err(invalid(format!("{WHAT}: flags {flags:#x}, argsz {argsz} and count {count} disagree")));
        }
        if b.len() != INFO16_SIZE {
            // More than the head: all entries must be there.
            if b.len() != argsz_n {
                return Err(invalid(format!("{WHAT}: payload size {} != argsz {argsz}", b.len())));
            }
            reply.entries.reserve(count_n);
            for i in 0..count_n {
                r.pos = INFO16_SIZE + i * stride;
                reply.entries.push(IoFdEntry::read(&mut r, stride)?);
            }
        }
        Ok(reply)
    }
}
#[cfg(test)]
mod tests {
    use super::*;
    use crate::vfio_user::wire::testutil::*;

    #[test]
    fn io_fds_request() {
        let q = IoFdsRequest { argsz: 1024, index: 1 };
        assert_eq!(q.to_bytes(), le(&[(1024, 4), (0, 4), (1, 4), (0, 4)]));
        check(&q, &q.to_bytes(), IoFdsRequest::parse);
        assert!(IoFdsRequest::parse(&set32(&q.to_bytes(), 12, 1)).is_err());
        assert!(IoFdsRequest::parse(&set32(&q.to_bytes(), 4, 1)).is_err());
        assert!(IoFdsRequest::parse(&set32(&q.to_bytes(), 0, 8)).is_err());
    }

    #[test]
    fn io_fds_reply_ioeventfd_bytes() {
        let flags = KVM_IOEVENTFD_FLAG_DATAMATCH;
        let r = IoFdsReply::new(
            0,
            vec![IoFdEntry::IoEventFd { offset: 0x1000, size: 4, fd_index: 0, flags, datamatch: 0x1234 }],
        );
        let want = le(&[
            (56, 4),     // argsz: 16 + 40
            (0, 4),      // flags
            (0, 4),      // index
            (1, 4),      // count
            (0x1000, 8), // offset
            (4, 8),      // size
            (0, 4),      // fd_index
            (0, 4),      // type: IOEVENTFD
            (1, 4),      // flags: DATAMATCH
            (0, 4),      // padding
            (0x1234, 8), // datamatch
        ]);
        assert_eq!(r.to_bytes(), want);
        assert_eq!(IoFdsReply::parse(&want).unwrap(), r);
        // The 16-byte head alone is the legitimate "argsz too small" reply.
        prefixes_fail(&want, |b| IoFdsReply::parse(b).is_ok(), &[16]);
        assert!(IoFdsReply::parse(&[&want[..], &[0]].concat()).is_err());
    }

    #[test]
    fn io_fds_reply_mixed_and_fit() {
        let posted = KVM_IOREGION_POSTED_WRITES;
        let r = IoFdsReply::new(
            4,
            vec![
                IoFdEntry::IoEventFd { offset: 0, size: 0, fd_index: 0, flags: 0, datamatch: 0 },
                IoFdEntry::IoRegionFd { offset: 0x100, size: 0, fd_index: 1, flags: posted, user_data: 9 },
                IoFdEntry::IoRegionFd { offset: 0x200, size: 8, fd_index: 1, flags: KVM_IOREGION_PIO, user_data: 10 },
            ],
        );
        assert_eq!((r.argsz, r.count, r.entries[1].fd_index()), (136, 3, 1));
        assert_eq!(r.to_bytes()[56..96], le(&[(0x100, 8), (0, 8), (1, 4), (1, 4), (2, 4), (0, 4), (9, 8)])[..]);
        assert_eq!(IoFdsReply::parse(&r.to_bytes()).unwrap(), r);
        assert_eq!(r.clone().fit(136), r);
        let short = r.fit(135);
        assert!(short.is_truncated());
        assert_eq!(short.to_bytes(), le(&[(136, 4), (0, 4), (4, 4), (3, 4)]));
        assert_eq!(IoFdsReply::parse(&short.to_bytes()).unwrap(), short);
        let empty = IoFdsReply::new(1, vec![]);
        check(&empty, &empty.to_bytes(), IoFdsReply::parse);
    }

    #[test]
    fn io_fds_reply_hostile() {
        let e = IoFdEntry::IoEventFd { offset: 0, size: 4, fd_index: 0, flags: 0, datamatch: 0 };
        let good = IoFdsReply::new(0, vec![e, e]).to_bytes();
        // count huge / not matching argsz, argsz too small / huge, flags.
        for (at, v) in [(12, u32::MAX), (12, 3), (0, 40), (0, u32::MAX), (4, 1)] {
            assert!(IoFdsReply::parse(&set32(&good, at, v)).is_err(), "field at {at} = {v}");
        }
        // An unknown type (7), an ioeventfd flag KVM does not take from a server (4 is
        // DEASSIGN), a shadow ioeventfd in a 40-byte entry (no room for its datamatch),
        // an ioregionfd of size 0 without posted writes: kept as Other, for the client to skip.
        for (at, v, ty, flags) in [(36, 7, 7, 0), (40, 4, 0, 4), (36, 2, 2, 0)] {
            let r = IoFdsReply::parse(&set32(&good, at, v)).unwrap();
            assert_eq!(r.entries[0], IoFdEntry::Other { offset: 0, size: 4, fd_index: 0, ty, flags }, "{at} = {v}");
            assert_eq!(r.entries[1], e);
        }
        let bad = IoFdEntry::IoRegionFd { offset: 0, size: 0, fd_index: 0, flags: KVM_IOREGION_PIO, user_data: 0 };
        let r = IoFdsReply::parse(&IoFdsReply::new(0, vec![bad]).to_bytes()).unwrap();
        assert_eq!(r.entries, [IoFdEntry::Other { offset: 0, size: 0, fd_index: 0, ty: 1, flags: KVM_IOREGION_PIO }]);
    }

    /// libvfio-user's entries (include/vfio-user.h): 48 bytes, shadow_mem_fd_index at 28,
    /// shadow_offset at 32, datamatch at 40; its ioregionfd entry keeps user_data at 32.
    #[test]
    fn io_fds_reply_libvfio_user_48_byte_entries() {
        let want = le(&[
            (16 + 3 * 48, 4), // argsz
            (0, 4),           // flags
            (0, 4),           // index
            (3, 4),           // count
            (0x1000, 8),      // [0] offset
            (4, 8),           //     size
            (0, 4),           //     fd_index
            (0, 4),           //     type: IOEVENTFD
            (1, 4),           //     flags: DATAMATCH
            (0, 4),           //     shadow_mem_fd_index
            (0, 8),           //     shadow_offset
            (0x1234, 8),      //     datamatch
            (0x2000, 8),      // [1] offset
            (4, 8),           //     size
            (1, 4),           //     fd_index
            (2, 4),           //     type: IOEVENTFD_SHADOW
            (0, 4),           //     flags
            (2, 4),           //     shadow_mem_fd_index
            (0x3000, 8),      //     shadow_offset
            (0, 8),           //     datamatch
            (0x100, 8),       // [2] offset
            (8, 8),           //     size
            (0, 4),           //     fd_index
            (1, 4),           //     type: IOREGIONFD
            (0, 4),           //     flags
            (0, 4),           //     padding
            (9, 8),           //     user_data
            (0, 8),           //     (union padding)
        ]);
        let r = IoFdsReply::parse(&want).unwrap();
        assert_eq!(
            r.entries,
            [
                IoFdEntry::IoEventFd { offset: 0x1000, size: 4, fd_index: 0, flags: 1, datamatch: 0x1234 },
                IoFdEntry::ShadowIoEventFd {
                    offset: 0x2000,
                    size: 4,
                    fd_index: 1,
                    flags: 0,
                    shadow_fd_index: 2,
                    shadow_offset: 0x3000,
                    datamatch: 0
                },
                IoFdEntry::IoRegionFd { offset: 0x100, size: 8, fd_index: 0, flags: 0, user_data: 9 },
            ]
        );
        assert_eq!(r.to_bytes(), want, "written back in the layout it came in");
        assert_eq!(IoFdsReply::new(0, r.entries.clone()), r, "a shadow entry needs the 48-byte layout");
        // The spec's 40-byte entry puts datamatch at 32.
        let spec = IoFdsReply::new(0, r.entries[..1].to_vec()).to_bytes();
        assert_eq!((spec.len(), &spec[48..56]), (56, &0x1234u64.to_le_bytes()[..]));
        // Wider than 48: libvfio-user's layout, the rest skipped.
        let wide: Vec<u8> = want[16..].chunks(48).flat_map(|c| [c, &[0xee; 8]].concat()).collect();
        let wide = [&set32(&want[..16], 0, 16 + 3 * 56), &wide[..]].concat();
        assert_eq!(IoFdsReply::parse(&wide).unwrap().entries, r.entries);
    }
}
