//! DMA_MAP, DMA_UNMAP, and the DMA_READ/DMA_WRITE access of the fallback
//! without a memory fd.

use super::*;

pub const DMA_MAP_SIZE: usize = 32;
pub const DMA_UNMAP_SIZE: usize = 24;

pub const DMA_MAP_FLAG_READ: u32 = 1 << 0;
pub const DMA_MAP_FLAG_WRITE: u32 = 1 << 1;
pub const DMA_UNMAP_FLAG_GET_DIRTY_BITMAP: u32 = 1 << 0;
pub const DMA_UNMAP_FLAG_ALL: u32 = 1 << 1;

/// DMA_MAP request (32 bytes; no reply payload). `argsz` is written as 32.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DmaMap {
    pub flags: u32,
    /// Offset into the file descriptor sent with the message (0 if none).
    pub offset: u64,
    pub address: u64,
    pub size: u64,
}

impl DmaMap {
    pub fn parse(b: &[u8]) -> Result<Self, WireError> {
        let mut r = Rd::new("dma_map", b, DMA_MAP_SIZE, true)?;
        check_argsz("dma_map", r.u32()?, DMA_MAP_SIZE)?;
        let m = DmaMap { flags: r.u32()?, offset: r.u64()?, address: r.u64()?, size: r.u64()? };
        if m.flags & !(DMA_MAP_FLAG_READ | DMA_MAP_FLAG_WRITE) != 0 {
            return Err(invalid(format!("dma_map: unknown flags {:#x}", m.flags)));
        }
        Ok(m)
    }

    pub fn to_bytes(&self) -> Vec<u8> {
        let w = Wr::new(DMA_MAP_SIZE).u32(DMA_MAP_SIZE as u32).u32(self.flags);
        w.u64(self.offset).u64(self.address).u64(self.size).0
    }
}

/// DMA_UNMAP request and reply (the server echoes the entry, `argsz` the
/// 24 bytes it needs). Flags 0 and `DMA_UNMAP_FLAG_ALL` (libvfio-user's and
/// QEMU's, with address and size 0) only: dirty bitmaps are not supported.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DmaUnmap {
    pub argsz: u32,
    pub flags: u32,
    pub address: u64,
    pub size: u64,
}

impl DmaUnmap {
    pub fn new(flags: u32, address: u64, size: u64) -> Self {
        DmaUnmap { argsz: DMA_UNMAP_SIZE as u32, flags, address, size }
    }

    pub fn parse(b: &[u8]) -> Result<Self, WireError> {
        let mut r = Rd::new("dma_unmap", b, DMA_UNMAP_SIZE, true)?;
        let u = DmaUnmap { argsz: r.u32()?, flags: r.u32()?, address: r.u64()?, size: r.u64()? };
        check_argsz("dma_unmap", u.argsz, DMA_UNMAP_SIZE)?;
        match u.flags {
            0 => Ok(u),
            DMA_UNMAP_FLAG_ALL if u.address == 0 && u.size == 0 => Ok(u),
            f => Err(invalid(format!("dma_unmap: unsupported flags {f:#x} (or ALL with a range)"))),
        }
    }

    pub fn to_bytes(&self) -> Vec<u8> {
        Wr::new(DMA_UNMAP_SIZE).u32(self.argsz).u32(self.flags).u64(self.address).u64(self.size).0
    }
}

/// `{address u64, count u64}`: alone for the DMA_READ request and DMA_WRITE
/// reply; followed by exactly `count` data bytes for the DMA_READ reply and
/// DMA_WRITE request. (The DMA_WRITE reply is this 16-byte form, as
/// libvfio-user sends and checks it; the spec's table gives count 4 bytes.)
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DmaAccess {
    pub address: u64,
    pub count: u64,
}

impl DmaAccess {
    pub fn parse(b: &[u8]) -> Result<Self, WireError> {
        let mut r = Rd::new("dma access", b, ACCESS_SIZE, true)?;
        Ok(DmaAccess { address: r.u64()?, count: r.u64()? })
    }

    pub fn parse_with_data(b: &[u8]) -> Result<(Self, &[u8]), WireError> {
        let mut r = Rd::new("dma access", b, ACCESS_SIZE, false)?;
        let a = DmaAccess { address: r.u64()?, count: r.u64()? };
        Ok((a, access_data("dma access data", &mut r, a.count)?))
    }

    pub fn to_bytes(&self) -> Vec<u8> {
        Wr::new(ACCESS_SIZE).u64(self.address).u64(self.count).0
    }

    pub fn to_bytes_with_data(address: u64, data: &[u8]) -> Vec<u8> {
        Wr::new(ACCESS_SIZE + data.len()).u64(address).u64(data.len() as u64).bytes(data).0
    }
}
#[cfg(test)]
mod tests {
    use super::*;
    use crate::vfio_user::wire::testutil::*;

    #[test]
    fn dma_map_and_unmap() {
        let m =
            DmaMap { flags: DMA_MAP_FLAG_READ | DMA_MAP_FLAG_WRITE, offset: 0x1000, address: 1 << 31, size: 1 << 30 };
        let enc = m.to_bytes();
        assert_eq!(enc, le(&[(32, 4), (3, 4), (0x1000, 8), (1 << 31, 8), (1 << 30, 8)]));
        check(&m, &enc, DmaMap::parse);
        assert!(DmaMap::parse(&set32(&enc, 4, 4)).is_err());
        assert!(DmaMap::parse(&set32(&enc, 0, 31)).is_err());
        let u = DmaUnmap::new(0, 1 << 31, 1 << 30);
        assert_eq!(u.to_bytes(), le(&[(24, 4), (0, 4), (1 << 31, 8), (1 << 30, 8)]));
        check(&u, &u.to_bytes(), DmaUnmap::parse);
        let all = DmaUnmap::new(DMA_UNMAP_FLAG_ALL, 0, 0);
        check(&all, &all.to_bytes(), DmaUnmap::parse);
        assert!(DmaUnmap::parse(&DmaUnmap::new(DMA_UNMAP_FLAG_ALL, 1, 0).to_bytes()).is_err());
        assert!(DmaUnmap::parse(&DmaUnmap::new(DMA_UNMAP_FLAG_GET_DIRTY_BITMAP, 0, 4096).to_bytes()).is_err());
    }
}
