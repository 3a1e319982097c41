//! GET_REGION_IO_FDS: the ioeventfds (and ioregionfd regions) a server
//! offers for a region, each entry indexing an fd sent with the reply.

use super::*;

const IO_FD_ENTRY_SIZE: usize = 40;

pub const IO_FD_TYPE_IOEVENTFD: u32 = 0;
pub const IO_FD_TYPE_IOREGIONFD: u32 = 1;
/// `KVM_IOEVENTFD_FLAG_*` as in `<linux/kvm.h>` (bit 2 is DEASSIGN, not sent).
pub const KVM_IOEVENTFD_FLAG_DATAMATCH: u32 = 1 << 0;
pub const KVM_IOEVENTFD_FLAG_PIO: u32 = 1 << 1;
pub const KVM_IOEVENTFD_FLAG_VIRTIO_CCW_NOTIFY: u32 = 1 << 3;
pub const KVM_IOREGION_PIO: u32 = 1 << 0;
pub const KVM_IOREGION_POSTED_WRITES: u32 = 1 << 1;

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

/// One sub-region of a GET_REGION_IO_FDS reply (40 bytes on the wire).
/// `fd_index` indexes the file descriptors sent with the reply.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IoFdEntry {
    IoEventFd { offset: u64, size: u64, fd_index: u32, flags: u32, datamatch: u64 },
    IoRegionFd { offset: u64, size: u64, fd_index: u32, flags: u32, user_data: u64 },
}

impl IoFdEntry {
    pub fn fd_index(&self) -> u32 {
        match *self {
            IoFdEntry::IoEventFd { fd_index, .. } | IoFdEntry::IoRegionFd { fd_index, .. } => fd_index,
        }
    }

    fn read(r: &mut Rd) -> Result<Self, WireError> {
        let (offset, size, fd_index, ty, flags) = (r.u64()?, r.u64()?, r.u32()?, r.u32()?, r.u32()?);
        let (_padding, last) = (r.u32()?, r.u64()?);
        let ioeventfd_flags =
            KVM_IOEVENTFD_FLAG_DATAMATCH | KVM_IOEVENTFD_FLAG_PIO | KVM_IOEVENTFD_FLAG_VIRTIO_CCW_NOTIFY;
        match ty {
            IO_FD_TYPE_IOEVENTFD if flags & !ioeventfd_flags == 0 => {
                Ok(IoFdEntry::IoEventFd { offset, size, fd_index, flags, datamatch: last })
            }
            IO_FD_TYPE_IOREGIONFD
                if flags & !(KVM_IOREGION_PIO | KVM_IOREGION_POSTED_WRITES) == 0
                    && (size != 0 || flags & KVM_IOREGION_POSTED_WRITES != 0) =>
            {
                Ok(IoFdEntry::IoRegionFd { offset, size, fd_index, flags, user_data: last })
            }
            IO_FD_TYPE_IOEVENTFD | IO_FD_TYPE_IOREGIONFD => {
                Err(invalid(format!("io fd sub-region type {ty}: bad flags {flags:#x} for size {size}")))
            }
            _ => Err(invalid(format!("io fd sub-region: unknown type {ty}"))),
        }
    }

    fn write(&self, w: Wr) -> Wr {
        let (offset, size, fd_index, ty, flags, last) = match *self {
            IoFdEntry::IoEventFd { offset, size, fd_index, flags, datamatch: d } => {
                (offset, size, fd_index, IO_FD_TYPE_IOEVENTFD, flags, d)
            }
            IoFdEntry::IoRegionFd { offset, size, fd_index, flags, user_data: u } => {
                (offset, size, fd_index, IO_FD_TYPE_IOREGIONFD, flags, u)
            }
        };
        w.u64(offset).u64(size).u32(fd_index).u32(ty).u32(flags).u32(0).u64(last)
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
    pub fn new(index: u32, entries: Vec<IoFdEntry>) -> Self {
        let argsz = len_u32(INFO16_SIZE + entries.len() * IO_FD_ENTRY_SIZE);
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

    pub fn to_bytes(&self) -> Vec<u8> {
        let mut w = Wr::new(INFO16_SIZE + self.entries.len() * IO_FD_ENTRY_SIZE);
        w = w.u32(self.argsz).u32(0).u32(self.index).u32(self.count);
        for e in &self.entries {
            w = e.write(w);
        }
        w.0
    }

    pub fn parse(b: &[u8]) -> Result<Self, WireError> {
        const WHAT: &str = "region_io_fds reply";
        let mut r = Rd::new(WHAT, b, INFO16_SIZE, false)?;
        let (argsz, flags, index, count) = (r.u32()?, r.u32()?, r.u32()?, r.u32()?);
        let (argsz_n, count_n) = (argsz as usize, count as usize);
        // Entry i is at 16 + i * (argsz - 16) / count: 40 today, not to be relied on.
        let stride = argsz_n.saturating_sub(INFO16_SIZE).checked_div(count_n).unwrap_or(0);
        let fits = match count_n {
            0 => argsz_n == INFO16_SIZE,
            _ => stride >= IO_FD_ENTRY_SIZE && INFO16_SIZE + stride * count_n == argsz_n,
        };
        if flags != 0 || !fits {
            return Err(invalid(format!("{WHAT}: flags {flags:#x}, argsz {argsz} and count {count} disagree")));
        }
        let mut entries = Vec::new();
        if b.len() != INFO16_SIZE {
            // More than the head: all entries must be there.
            if b.len() != argsz_n {
                return Err(invalid(format!("{WHAT}: payload size {} != argsz {argsz}", b.len())));
            }
            entries.reserve(count_n);
            for i in 0..count_n {
                r.pos = INFO16_SIZE + i * stride;
                entries.push(IoFdEntry::read(&mut r)?);
            }
        }
        Ok(IoFdsReply { argsz, index, count, entries })
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
        // count huge / not matching argsz, argsz too small / huge, flags, entry type 2 (libvfio-user's
        // shadow ioeventfd) and 7, unknown ioeventfd flag (4 is DEASSIGN).
        for (at, v) in [(12, u32::MAX), (12, 3), (0, 40), (0, u32::MAX), (4, 1), (36, 2), (36, 7), (40, 4)] {
            assert!(IoFdsReply::parse(&set32(&good, at, v)).is_err(), "field at {at} = {v}");
        }
        let bad = IoFdEntry::IoRegionFd { offset: 0, size: 0, fd_index: 0, flags: KVM_IOREGION_PIO, user_data: 0 };
        assert!(IoFdsReply::parse(&IoFdsReply::new(0, vec![bad]).to_bytes()).is_err());
        // A stride larger than 40 is honoured; the extra bytes are skipped.
        let wide: Vec<u8> = good[16..].chunks(40).flat_map(|c| [c, &[0xee; 8]].concat()).collect();
        let wide = [&set32(&good[..16], 0, 16 + 2 * 48), &wide[..]].concat();
        assert_eq!(IoFdsReply::parse(&wide).unwrap().entries, vec![e, e]);
    }
}
