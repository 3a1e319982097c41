//! Regions: GET_REGION_INFO (with the sparse mmap capability) and
//! REGION_READ / REGION_WRITE / REGION_WRITE_MULTI.

use super::*;

/// The fixed `vfio_region_info`.
pub const REGION_INFO_SIZE: usize = 32;
const SPARSE_CAP_SIZE: usize = 16;
const SPARSE_AREA_SIZE: usize = 16;
const WRITE_ONE_SIZE: usize = 24;

pub const REGION_INFO_FLAG_READ: u32 = 1 << 0;
pub const REGION_INFO_FLAG_WRITE: u32 = 1 << 1;
pub const REGION_INFO_FLAG_MMAP: u32 = 1 << 2;
pub const REGION_INFO_FLAG_CAPS: u32 = 1 << 3;
pub const REGION_INFO_CAP_SPARSE_MMAP: u16 = 1;
pub const REGION_INFO_CAP_TYPE: u16 = 2;

/// PCI region indexes: BAR0..BAR5 are 0..5.
pub const PCI_ROM_REGION_INDEX: u32 = 6;
pub const PCI_CONFIG_REGION_INDEX: u32 = 7;
pub const PCI_VGA_REGION_INDEX: u32 = 8;
pub const PCI_NUM_REGIONS: u32 = 9;

/// Data bytes one REGION_WRITE_MULTI entry can carry.
pub const WRITE_MULTI_DATA: usize = 8;

/// The fixed 32-byte `vfio_region_info`: the GET_REGION_INFO request, and
/// the start of its reply.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RegionInfo {
    pub argsz: u32,
    pub flags: u32,
    pub index: u32,
    pub cap_offset: u32,
    pub size: u64,
    pub offset: u64,
}

impl RegionInfo {
    /// A request for region `index` accepting up to `argsz` bytes of reply.
    pub fn request(index: u32, argsz: u32) -> Self {
        RegionInfo { argsz, flags: 0, index, cap_offset: 0, size: 0, offset: 0 }
    }

    pub fn parse(b: &[u8]) -> Result<Self, WireError> {
        Self::read(&mut Rd::new("region_info", b, REGION_INFO_SIZE, true)?)
    }

    fn read(r: &mut Rd) -> Result<Self, WireError> {
        let (argsz, flags, index, cap_offset) = (r.u32()?, r.u32()?, r.u32()?, r.u32()?);
        let i = RegionInfo { argsz, flags, index, cap_offset, size: r.u64()?, offset: r.u64()? };
        check_argsz(r.what, i.argsz, REGION_INFO_SIZE).map(|_| i)
    }

    pub fn to_bytes(&self) -> Vec<u8> {
        let w = Wr::new(REGION_INFO_SIZE).u32(self.argsz).u32(self.flags).u32(self.index).u32(self.cap_offset);
        w.u64(self.size).u64(self.offset).0
    }
}

/// One mmap-able window of a region, relative to the region's `offset`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SparseMmapArea {
    pub offset: u64,
    pub size: u64,
}

/// GET_REGION_INFO reply: the fixed struct plus an optional sparse mmap
/// capability (the only one produced; other capabilities are skipped).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RegionInfoReply {
    pub info: RegionInfo,
    pub sparse_mmap: Option<Vec<SparseMmapArea>>,
}

impl RegionInfoReply {
    /// A full reply: `argsz` is the size needed; with `sparse_mmap` the CAPS
    /// flag is set and `cap_offset` is 32.
    pub fn new(index: u32, flags: u32, size: u64, offset: u64, sparse_mmap: Option<Vec<SparseMmapArea>>) -> Self {
        let caps_len = sparse_mmap.as_ref().map_or(0, |a| SPARSE_CAP_SIZE + a.len() * SPARSE_AREA_SIZE);
        let (flags, cap_offset) = match sparse_mmap {
            Some(_) => (flags | REGION_INFO_FLAG_CAPS, REGION_INFO_SIZE as u32),
            None => (flags & !REGION_INFO_FLAG_CAPS, 0),
        };
        let argsz = len_u32(REGION_INFO_SIZE + caps_len);
        RegionInfoReply { info: RegionInfo { argsz, flags, index, cap_offset, size, offset }, sparse_mmap }
    }

    /// The reply for a request that allowed `req_argsz` bytes: all of it if it
    /// fits, else (as VFIO does) the fixed struct alone, CAPS cleared, and
    /// `argsz` still the size needed so the client can retry.
    pub fn fit(mut self, req_argsz: u32) -> Self {
        if req_argsz < self.info.argsz {
            self.info.flags &= !REGION_INFO_FLAG_CAPS;
            self.info.cap_offset = 0;
            self.sparse_mmap = None;
        }
        self
    }

    /// True if the server had more to say than the request's `argsz` allowed.
    pub fn is_truncated(&self) -> bool {
        self.info.flags & REGION_INFO_FLAG_CAPS == 0 && self.info.argsz as usize > REGION_INFO_SIZE
    }

    pub fn to_bytes(&self) -> Vec<u8> {
        let mut w = Wr(self.info.to_bytes());
        if let Some(areas) = &self.sparse_mmap {
            w = w.u16(REGION_INFO_CAP_SPARSE_MMAP).u16(1).u32(0).u32(len_u32(areas.len())).u32(0);
            for a in areas {
                w = w.u64(a.offset).u64(a.size);
            }
        }
        w.0
    }

    pub fn parse(b: &[u8]) -> Result<Self, WireError> {
        const WHAT: &str = "region_info reply";
        let mut r = Rd::new(WHAT, b, REGION_INFO_SIZE, false)?;
        let info = RegionInfo::read(&mut r)?;
        let argsz = info.argsz as usize;
        if info.flags & REGION_INFO_FLAG_CAPS == 0 {
            // Truncated replies are the fixed struct, which libvfio-user pads
            // with zeros up to the request's argsz (< this argsz).
            if b.len() > argsz.max(REGION_INFO_SIZE) {
                return Err(WireError::Trailing { what: WHAT, expected: argsz, got: b.len() });
            }
            return Ok(RegionInfoReply { info, sparse_mmap: None });
        }
        if b.len() != argsz {
            return Err(invalid(format!("{WHAT}: CAPS set but argsz {argsz} != payload size {}", b.len())));
        }
        let (mut sparse, mut off, mut min) = (None, info.cap_offset as usize, REGION_INFO_SIZE);
        loop {
            // Each capability must start after the previous one ends, so the
            // walk only moves forward and ends within the payload.
            if off < min {
                return Err(invalid(format!("{WHAT}: capability at {off} overlaps or points backwards")));
            }
            r.pos = off;
            let (id, version, next) = (r.u16()?, r.u16()?, r.u32()?);
            if id == REGION_INFO_CAP_SPARSE_MMAP {
                if sparse.is_some() || version != 1 {
                    return Err(invalid(format!("{WHAT}: duplicate sparse mmap cap or version {version}")));
                }
                let (nr, _reserved) = (r.u32()? as usize, r.u32()?);
                let len = nr.checked_mul(SPARSE_AREA_SIZE).ok_or_else(|| invalid("sparse mmap: too many areas"))?;
                let mut a = Rd::new(WHAT, r.take(len)?, len, true)?;
                let mut areas = Vec::with_capacity(nr);
                for _ in 0..nr {
                    let area = SparseMmapArea { offset: a.u64()?, size: a.u64()? };
                    if area.offset.checked_add(area.size).is_none_or(|end| end > info.size) {
                        return Err(invalid(format!("{WHAT}: sparse area {area:?} lies outside the region")));
                    }
                    areas.push(area);
                }
                sparse = Some(areas);
            }
            if next == 0 {
                return Ok(RegionInfoReply { info, sparse_mmap: sparse });
            }
            (min, off) = (r.pos, next as usize);
        }
    }
}

/// `{offset u64, region u32, count u32}`: alone for the REGION_READ request
/// and REGION_WRITE reply; followed by exactly `count` data bytes for the
/// REGION_READ reply and REGION_WRITE request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RegionAccess {
    pub offset: u64,
    pub region: u32,
    pub count: u32,
}

impl RegionAccess {
    pub fn parse(b: &[u8]) -> Result<Self, WireError> {
        let mut r = Rd::new("region access", b, ACCESS_SIZE, true)?;
        Ok(RegionAccess { offset: r.u64()?, region: r.u32()?, count: r.u32()? })
    }

    pub fn parse_with_data(b: &[u8]) -> Result<(Self, &[u8]), WireError> {
        let mut r = Rd::new("region access", b, ACCESS_SIZE, false)?;
        let a = RegionAccess { offset: r.u64()?, region: r.u32()?, count: r.u32()? };
        Ok((a, access_data("region access data", &mut r, a.count.into())?))
    }

    pub fn to_bytes(&self) -> Vec<u8> {
        Wr::new(ACCESS_SIZE).u64(self.offset).u32(self.region).u32(self.count).0
    }

    /// Header and data; `count` is `data.len()`.
    pub fn to_bytes_with_data(offset: u64, region: u32, data: &[u8]) -> Vec<u8> {
        Wr::new(ACCESS_SIZE + data.len()).u64(offset).u32(region).u32(len_u32(data.len())).bytes(data).0
    }
}

/// One coalesced write of REGION_WRITE_MULTI (24 bytes, up to 8 data bytes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WriteOne {
    pub offset: u64,
    pub region: u32,
    pub count: u32,
    pub data: [u8; WRITE_MULTI_DATA],
}

impl WriteOne {
    /// `None` if `data` is longer than 8 bytes.
    pub fn new(offset: u64, region: u32, data: &[u8]) -> Option<Self> {
        let mut d = [0u8; WRITE_MULTI_DATA];
        d.get_mut(..data.len())?.copy_from_slice(data);
        Some(WriteOne { offset, region, count: data.len() as u32, data: d })
    }

    /// The `count` bytes to write.
    pub fn bytes(&self) -> &[u8] {
        &self.data[..(self.count as usize).min(WRITE_MULTI_DATA)]
    }
}

/// REGION_WRITE_MULTI request: `wr_cnt u64` then `wr_cnt` [`WriteOne`]s.
/// The reply is [`RegionWriteMultiReply`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RegionWriteMulti {
    pub writes: Vec<WriteOne>,
}

impl RegionWriteMulti {
    pub fn parse(b: &[u8]) -> Result<Self, WireError> {
        const WHAT: &str = "region_write_multi";
        let mut r = Rd::new(WHAT, b, 8, false)?;
        let n = r.u64()?;
        let size = n.checked_mul(WRITE_ONE_SIZE as u64).and_then(|x| x.checked_add(8));
        let size = size.filter(|s| *s <= MAX_MSG_SIZE as u64).ok_or_else(|| invalid(format!("{WHAT}: wr_cnt {n}")))?;
        Rd::new(WHAT, b, size as usize, true)?;
        let mut writes = Vec::with_capacity(n as usize);
        for _ in 0..n {
            let w = WriteOne { offset: r.u64()?, region: r.u32()?, count: r.u32()?, data: r.arr()? };
            if w.count as usize > WRITE_MULTI_DATA {
                return Err(invalid(format!("{WHAT}: count {} > {WRITE_MULTI_DATA}", w.count)));
            }
            writes.push(w);
        }
        Ok(RegionWriteMulti { writes })
    }

    pub fn to_bytes(&self) -> Vec<u8> {
        let mut w = Wr::new(8 + self.writes.len() * WRITE_ONE_SIZE).u64(self.writes.len() as u64);
        for one in &self.writes {
            w = w.u64(one.offset).u32(one.region).u32(one.count).bytes(&one.data);
        }
        w.0
    }
}

/// REGION_WRITE_MULTI reply: the number of writes completed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RegionWriteMultiReply {
    pub wr_cnt: u64,
}

impl RegionWriteMultiReply {
    pub fn parse(b: &[u8]) -> Result<Self, WireError> {
        Ok(RegionWriteMultiReply { wr_cnt: Rd::new("region_write_multi reply", b, 8, true)?.u64()? })
    }

    pub fn to_bytes(&self) -> Vec<u8> {
        self.wr_cnt.to_le_bytes().to_vec()
    }
}
#[cfg(test)]
mod tests {
    use super::*;
    use crate::vfio_user::wire::testutil::*;

    #[test]
    fn region_info_plain() {
        let q = RegionInfo::request(PCI_CONFIG_REGION_INDEX, 256);
        assert_eq!(q.to_bytes(), le(&[(256, 4), (0, 4), (7, 4), (0, 4), (0, 8), (0, 8)]));
        check(&q, &q.to_bytes(), RegionInfo::parse);
        let r = RegionInfoReply::new(7, REGION_INFO_FLAG_READ | REGION_INFO_FLAG_WRITE, 256, 0, None);
        assert!(r.info.argsz == 32 && !r.is_truncated());
        check(&r, &r.to_bytes(), RegionInfoReply::parse);
    }

    #[test]
    fn region_info_reply_sparse_bytes() {
        let areas = vec![SparseMmapArea { offset: 0x1000, size: 0x3000 }];
        let flags = REGION_INFO_FLAG_READ | REGION_INFO_FLAG_WRITE | REGION_INFO_FLAG_MMAP;
        let r = RegionInfoReply::new(0, flags, 0x4000, 0, Some(areas));
        let want = le(&[
            (64, 4),     // argsz: 32 + cap header 8 + nr_areas/reserved 8 + one area 16
            (0xf, 4),    // flags: READ | WRITE | MMAP | CAPS
            (0, 4),      // index
            (32, 4),     // cap_offset
            (0x4000, 8), // size
            (0, 8),      // offset
            (1, 2),      // cap id: SPARSE_MMAP
            (1, 2),      // cap version
            (0, 4),      // next
            (1, 4),      // nr_areas
            (0, 4),      // reserved
            (0x1000, 8), // area offset
            (0x3000, 8), // area size
        ]);
        assert_eq!(r.to_bytes(), want);
        check(&r, &want, RegionInfoReply::parse);
    }

    #[test]
    fn region_info_reply_fit() {
        let areas = vec![SparseMmapArea { offset: 0, size: 0x1000 }, SparseMmapArea { offset: 0x2000, size: 0x1000 }];
        let full = RegionInfoReply::new(2, REGION_INFO_FLAG_READ | REGION_INFO_FLAG_MMAP, 0x4000, 1 << 40, Some(areas));
        assert_eq!(full.info.argsz, 80);
        check(&full, &full.to_bytes(), RegionInfoReply::parse);
        assert_eq!(full.clone().fit(80), full);
        let short = full.fit(79);
        assert!(short.is_truncated() && short.sparse_mmap.is_none());
        assert_eq!((short.info.argsz, short.info.cap_offset, short.info.flags), (80, 0, REGION_INFO_FLAG_READ | 4));
        let enc = short.to_bytes();
        assert_eq!(enc.len(), 32);
        assert_eq!(RegionInfoReply::parse(&enc).unwrap(), short);
        // libvfio-user zero-pads a truncated reply up to the request's argsz.
        assert_eq!(RegionInfoReply::parse(&[&enc[..], &[0; 16]].concat()).unwrap(), short);
        assert!(RegionInfoReply::parse(&[&enc[..], &[0; 49]].concat()).is_err());
    }

    #[test]
    fn region_info_reply_hostile_chains() {
        let r = RegionInfoReply::new(0, 0, 0x4000, 0, Some(vec![SparseMmapArea { offset: 0, size: 0x1000 }]));
        let good = r.to_bytes();
        // cap_offset: 0 with CAPS set, backwards, running off the end.
        for v in [0, 16, 60, 64, u32::MAX] {
            assert!(RegionInfoReply::parse(&set32(&good, 12, v)).is_err(), "cap_offset {v}");
        }
        // next: itself (a loop), backwards, into the areas, past the end.
        for v in [32, 8, 40, 64, u32::MAX] {
            assert!(RegionInfoReply::parse(&set32(&good, 36, v)).is_err(), "next {v}");
        }
        for nr in [2, u32::MAX] {
            assert!(RegionInfoReply::parse(&set32(&good, 40, nr)).is_err(), "nr_areas {nr}");
        }
        assert!(RegionInfoReply::parse(&set32(&good, 0, 72)).is_err()); // argsz != size
        assert!(RegionInfoReply::parse(&set32(&good, 32, 0x0002_0001)).is_err()); // cap version 2
        let outside = RegionInfoReply::new(0, 0, 0x800, 0, Some(vec![SparseMmapArea { offset: 0, size: 0x1000 }]));
        assert!(RegionInfoReply::parse(&outside.to_bytes()).is_err());
        // An unknown capability (TYPE, 16 bytes) chained before the sparse one is skipped.
        let typed = [&set32(&good[..32], 0, 80), &le(&[(2, 2), (1, 2), (48, 4), (3, 4), (1, 4)])[..], &good[32..]];
        assert_eq!(RegionInfoReply::parse(&typed.concat()).unwrap().sparse_mmap, r.sparse_mmap);
    }

    #[test]
    fn region_write_one_byte_bytes() {
        let m = message(7, Command::RegionWrite, 0, &RegionAccess::to_bytes_with_data(0x10, 2, &[0xab]));
        let want = le(&[
            (7, 2),    // msg_id
            (10, 2),   // cmd: REGION_WRITE
            (33, 4),   // msg_size: 16 + 16 + 1
            (0, 4),    // flags: command
            (0, 4),    // error
            (0x10, 8), // offset
            (2, 4),    // region
            (1, 4),    // count
            (0xab, 1), // data
        ]);
        assert_eq!(m, want);
        let (h, p) = parse_message(&m).unwrap();
        assert_eq!(h.command(), Some(Command::RegionWrite));
        let (a, data) = RegionAccess::parse_with_data(p).unwrap();
        assert_eq!((a, data), (RegionAccess { offset: 0x10, region: 2, count: 1 }, &[0xab][..]));
        prefixes_fail(p, |b| RegionAccess::parse_with_data(b).is_ok(), &[]);
        assert!(RegionAccess::parse_with_data(&[p, &[0]].concat()).is_err());
        check(&a, &a.to_bytes(), RegionAccess::parse); // the reply
    }

    #[test]
    fn region_read_and_dma_access() {
        let req = RegionAccess { offset: 0x40, region: PCI_CONFIG_REGION_INDEX, count: 4 };
        check(&req, &req.to_bytes(), RegionAccess::parse);
        let rep = RegionAccess::to_bytes_with_data(0x40, 7, &[1, 2, 3, 4]);
        assert_eq!(RegionAccess::parse_with_data(&rep).unwrap(), (req, &[1u8, 2, 3, 4][..]));
        prefixes_fail(&rep, |b| RegionAccess::parse_with_data(b).is_ok(), &[]);
        let d = DmaAccess { address: 0x1000, count: 3 };
        assert_eq!(d.to_bytes(), le(&[(0x1000, 8), (3, 8)]));
        check(&d, &d.to_bytes(), DmaAccess::parse);
        let w = DmaAccess::to_bytes_with_data(0x1000, &[5, 6, 7]);
        assert_eq!(DmaAccess::parse_with_data(&w).unwrap(), (d, &[5u8, 6, 7][..]));
        prefixes_fail(&w, |b| DmaAccess::parse_with_data(b).is_ok(), &[]);
        assert!(DmaAccess::parse_with_data(&[&w[..], &[0]].concat()).is_err());
        let huge = DmaAccess { address: 0, count: u64::MAX }.to_bytes();
        assert!(matches!(DmaAccess::parse_with_data(&huge), Err(WireError::TooLarge { .. })));
    }

    #[test]
    fn write_multi() {
        let writes = vec![WriteOne::new(0x10, 0, &[1, 2, 3, 4]).unwrap(), WriteOne::new(0x18, 2, &[9; 8]).unwrap()];
        let m = RegionWriteMulti { writes };
        let enc = m.to_bytes();
        assert_eq!(enc[..32], le(&[(2, 8), (0x10, 8), (0, 4), (4, 4), (0x04030201, 8)])[..]);
        assert_eq!(enc.len(), 8 + 48);
        check(&m, &enc, RegionWriteMulti::parse);
        assert_eq!(m.writes[0].bytes(), &[1, 2, 3, 4]);
        assert!(WriteOne::new(0, 0, &[0; 9]).is_none());
        assert!(RegionWriteMulti::parse(&set32(&enc, 20, 9)).is_err()); // count 9
        assert!(RegionWriteMulti::parse(&[&u64::MAX.to_le_bytes()[..], &enc[8..]].concat()).is_err());
        let r = RegionWriteMultiReply { wr_cnt: 2 };
        check(&r, &r.to_bytes(), RegionWriteMultiReply::parse);
    }
}
