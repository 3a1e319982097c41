//! NVMe submission and completion queues in guest memory, and PRP walking.
//!
//! Entries live in guest RAM at the queue's base address; the controller
//! keeps head/tail/phase. Every guest address is checked against guest RAM
//! before use: a bad one becomes an NVMe status, never an access outside RAM.

use crate::mem::Resolved;
use crate::GuestMem;

pub const SQE_SIZE: u64 = 64;
pub const CQE_SIZE: u64 = 16;
pub const PAGE: u64 = 4096;

/// Status codes (type in bits 10:8, code in 7:0), as the CQE carries them >> 1.
pub mod status {
    pub const SUCCESS: u16 = 0x000;
    pub const INVALID_OPCODE: u16 = 0x001;
    pub const INVALID_FIELD: u16 = 0x002;
    pub const DATA_TRANSFER_ERROR: u16 = 0x004;
    pub const INTERNAL: u16 = 0x006;
    pub const INVALID_NAMESPACE: u16 = 0x00b;
    pub const COMMAND_SEQUENCE_ERROR: u16 = 0x00c;
    pub const INVALID_PRP_OFFSET: u16 = 0x013;
    pub const LBA_OUT_OF_RANGE: u16 = 0x080;
    // Command specific (SCT 1).
    pub const CQ_INVALID: u16 = 0x100;
    pub const INVALID_QID: u16 = 0x101;
    pub const MAX_QSIZE_EXCEEDED: u16 = 0x102;
    pub const AER_LIMIT_EXCEEDED: u16 = 0x105;
    pub const INVALID_INTERRUPT_VECTOR: u16 = 0x108;
    pub const INVALID_LOG_PAGE: u16 = 0x109;
    pub const INVALID_FORMAT: u16 = 0x10a;
    pub const INVALID_QUEUE_DELETION: u16 = 0x10c;
    pub const FEATURE_NOT_SAVEABLE: u16 = 0x10d;
}

#[derive(Clone, Copy, Debug, Default)]
pub struct Sq {
    pub gpa: u64,
    /// Entries (1-based).
    pub size: u16,
    pub head: u16,
    pub tail: u16,
    pub cqid: u16,
    /// The ring's host address, resolved when the queue or the memory came.
    pub ring: Resolved,
}

#[derive(Clone, Copy, Debug, Default)]
pub struct Cq {
    pub gpa: u64,
    pub size: u16,
    pub head: u16,
    pub tail: u16,
    pub phase: bool,
    pub ien: bool,
    pub iv: u16,
    /// The ring's host address, resolved when the queue or the memory came.
    pub ring: Resolved,
}

impl Cq {
    pub fn full(&self) -> bool {
        next(self.tail, self.size) == self.head
    }

    /// Resolves the ring in `mem` (none if it is not wholly mapped: every
    /// access then takes the general path).
    pub fn resolve(&mut self, mem: &GuestMem) {
        self.ring = mem.resolve(self.gpa, self.size as usize * CQE_SIZE as usize, 16).unwrap_or_default();
    }
}

impl Sq {
    /// As [`Cq::resolve`].
    pub fn resolve(&mut self, mem: &GuestMem) {
        self.ring = mem.resolve(self.gpa, self.size as usize * SQE_SIZE as usize, 64).unwrap_or_default();
    }
}

/// The index after `i` in a queue of `size` entries (no division: this is per I/O).
#[inline]
pub fn next(i: u16, size: u16) -> u16 {
    if i + 1 >= size {
        0
    } else {
        i + 1
    }
}

/// A CQ's (tail, phase) after one more entry at `tail`: the phase flips
/// where the tail wraps (the posting side's and the read-back's step).
#[inline]
pub fn cq_after(tail: u16, phase: bool, size: u16) -> (u16, bool) {
    if tail + 1 >= size {
        (0, !phase)
    } else {
        (tail + 1, phase)
    }
}

/// The index before `i` in a queue of `size` entries.
#[inline]
pub fn prev(i: u32, size: u32) -> u32 {
    if i == 0 {
        size - 1
    } else {
        i - 1
    }
}

/// A submission queue entry's fields the controller uses.
#[derive(Clone, Copy, Debug, Default)]
pub struct Sqe {
    pub opcode: u8,
    pub cid: u16,
    pub nsid: u32,
    /// Reserved in the commands this controller implements; the queue
    /// oracle tags its commands with it.
    pub cdw2: u32,
    pub prp1: u64,
    pub prp2: u64,
    pub cdw10: u32,
    pub cdw11: u32,
    pub cdw12: u32,
    pub cdw13: u32,
    /// MPTR: a Read's or Write's separate metadata buffer (`meta.rs`).
    pub mptr: u64,
    /// EILBRT, and ELBAT/ELBATM (protection information, `meta.rs`).
    pub cdw14: u32,
    pub cdw15: u32,
}

impl Sqe {
    pub fn parse(b: &[u8; 64]) -> Sqe {
        let mut w = [0u64; 8];
        for (w, c) in w.iter_mut().zip(b.chunks_exact(8)) {
            *w = u64::from_le_bytes(c.try_into().unwrap());
        }
        Sqe::from_words(&w)
    }

    /// From the entry's eight 8-byte words (little endian, as loaded): the
    /// fields are shifts of words already in registers, with no trip
    /// through a byte buffer (loads of a field across two stored words
    /// cannot be forwarded, and stall).
    #[inline]
    pub fn from_words(w: &[u64; 8]) -> Sqe {
        Sqe {
            opcode: w[0] as u8,
            cid: (w[0] >> 16) as u16,
            nsid: (w[0] >> 32) as u32,
            cdw2: w[1] as u32,
            prp1: w[3],
            prp2: w[4],
            cdw10: w[5] as u32,
            cdw11: (w[5] >> 32) as u32,
            cdw12: w[6] as u32,
            cdw13: (w[6] >> 32) as u32,
            mptr: w[2],
            cdw14: w[7] as u32,
            cdw15: (w[7] >> 32) as u32,
        }
    }
}

/// Queue memory must be page aligned and wholly in guest RAM.
pub fn queue_in_ram(mem: &GuestMem, gpa: u64, bytes: u64) -> bool {
    gpa.is_multiple_of(PAGE) && gpa != 0 && mem.range_ok(gpa, bytes)
}

/// Reads entry `idx` (a cache line: 64 bytes, aligned), from the resolved
/// ring where it has one.
pub fn read_sqe(mem: &GuestMem, sq: &Sq, idx: u16) -> Option<Sqe> {
    let mut w = [0u64; 8];
    if mem.read_resolved_64(&sq.ring, idx as usize * SQE_SIZE as usize, &mut w) {
        return Some(Sqe::from_words(&w));
    }
    let mut b = [0u8; 64];
    mem.read_slice(&mut b, sq.gpa + idx as u64 * SQE_SIZE).ok()?;
    Some(Sqe::parse(&b))
}

/// Posts a completion; the dword with the phase tag is stored last, with
/// release ordering, so a guest that sees the new phase sees the entry.
/// Returns the CQ's tail and phase after it (None: the CQ is not in guest
/// RAM, nothing posted), from copies taken before the stores: a caller
/// that loaded them back from `cq` right after these narrower stores could
/// not have them forwarded from the store buffer (a stall per completion).
pub fn post_cqe(mem: &GuestMem, cq: &mut Cq, dw0: u32, sqhd: u16, sqid: u16, cid: u16, st: u16) -> Option<(u16, bool)> {
    let (tail, lap, size) = (cq.tail, cq.phase, cq.size);
    // Phase is the value the entry must carry this lap: the inverse of what is there.
    let phase = !lap as u32;
    let dw3 = cid as u32 | phase << 16 | (st as u32) << 17;
    let words = [dw0, 0, sqhd as u32 | (sqid as u32) << 16];
    // The resolved ring, or one lookup for the entry; the phase dword goes
    // last, with release ordering.
    if !mem.write_resolved_then_release(&cq.ring, cq.tail as usize * CQE_SIZE as usize, words, dw3) {
        let mut b = [0u8; 12];
        for (d, w) in b.chunks_exact_mut(4).zip(words) {
            d.copy_from_slice(&w.to_le_bytes());
        }
        if mem.write_then_release_u32(&b, cq.gpa + cq.tail as u64 * CQE_SIZE, dw3).is_err() {
            return None;
        }
    }
    let after = cq_after(tail, lap, size);
    (cq.tail, cq.phase) = after;
    Some(after)
}

/// The guest pages of a transfer of `len` bytes described by PRP1/PRP2,
/// as (guest address, length) segments; PRP lists are followed and every
/// list entry is checked. Errors are NVMe status codes.
pub fn prp_segments(mem: &GuestMem, prp1: u64, prp2: u64, len: u64, out: &mut Vec<(u64, u64)>) -> Result<(), u16> {
    out.clear();
    if len == 0 {
        return Ok(());
    }
    if prp1 & 3 != 0 {
        return Err(status::INVALID_PRP_OFFSET);
    }
    let first = (PAGE - (prp1 & (PAGE - 1))).min(len);
    out.push((prp1, first));
    let left = len - first;
    if left == 0 {
        return check(mem, out);
    }
    if left <= PAGE {
        if prp2 & (PAGE - 1) != 0 {
            return Err(status::INVALID_PRP_OFFSET);
        }
        out.push((prp2, left));
        return check(mem, out);
    }
    prp_list(mem, prp2, left, out)?;
    check(mem, out)
}

/// The PRP list at `list` for the `left` bytes after PRP1's page, appended
/// to `out`. Apart from [`prp_segments`] so that its page-sized entry buffer
/// is on the stack only for transfers of more than two pages, not on the
/// path every 512 B or 4 KiB command takes.
#[inline(never)]
fn prp_list(mem: &GuestMem, mut list: u64, mut left: u64, out: &mut Vec<(u64, u64)>) -> Result<(), u16> {
    // PRP2 points to a list; the last entry of a full list page chains on.
    if list & 7 != 0 {
        return Err(status::INVALID_PRP_OFFSET);
    }
    let mut guard = 0;
    let mut entries = [0u64; (PAGE / 8) as usize];
    while left > 0 {
        let entries_here = (PAGE - (list & (PAGE - 1))) / 8;
        // The entries this list page holds for the transfer, in one read (one
        // message where the list is in memory reached by message).
        let wanted = entries_here.min(left.div_ceil(PAGE)) as usize;
        read_entries(mem, list, &mut entries[..wanted])?;
        for i in 0..wanted as u64 {
            let e = entries[i as usize];
            if i == entries_here - 1 && left > PAGE {
                if e & 7 != 0 {
                    return Err(status::INVALID_PRP_OFFSET);
                }
                list = e;
                break;
            }
            if e & (PAGE - 1) != 0 {
                return Err(status::INVALID_PRP_OFFSET);
            }
            let n = left.min(PAGE);
            out.push((e, n));
            left -= n;
            if left == 0 {
                break;
            }
        }
        guard += 1;
        if guard > 64 {
            return Err(status::INVALID_FIELD); // a list longer than any transfer this controller allows
        }
    }
    Ok(())
}

/// Reads PRP list entries at `at` (little endian in guest memory).
fn read_entries(mem: &GuestMem, at: u64, out: &mut [u64]) -> Result<(), u16> {
    let mut raw = [0u8; PAGE as usize];
    let raw = &mut raw[..out.len() * 8];
    mem.read_slice(raw, at).map_err(|_| status::DATA_TRANSFER_ERROR)?;
    for (e, b) in out.iter_mut().zip(raw.chunks_exact(8)) {
        *e = u64::from_le_bytes(b.try_into().unwrap());
    }
    Ok(())
}

fn check(mem: &GuestMem, segs: &[(u64, u64)]) -> Result<(), u16> {
    for &(a, n) in segs {
        if a == 0 || !mem.range_ok(a, n) {
            return Err(status::DATA_TRANSFER_ERROR);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

    fn mem() -> GuestMem {
        GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 1 << 20)]).unwrap().into()
    }

    #[test]
    fn an_sqe_reads_the_same_from_the_resolved_ring_and_the_general_path() {
        let m = mem();
        let mut sq = Sq { gpa: 0x1000, size: 4, ..Default::default() };
        let mut e = [0u8; 64];
        e[0] = 0x02; // opcode
        e[2..4].copy_from_slice(&0xbeefu16.to_le_bytes());
        e[4..8].copy_from_slice(&0x0102_0304u32.to_le_bytes());
        e[24..32].copy_from_slice(&0x1122_3344_5566_7788u64.to_le_bytes());
        e[32..40].copy_from_slice(&0x99aa_bbcc_ddee_ff00u64.to_le_bytes());
        for (i, v) in [0xa0a0_a0a0u32, 0xb1b1_b1b1, 0xc2c2_c2c2, 0xd3d3_d3d3].iter().enumerate() {
            e[40 + 4 * i..44 + 4 * i].copy_from_slice(&v.to_le_bytes());
        }
        m.write_slice(&e, 0x1000 + 2 * 64).unwrap();
        let slow = read_sqe(&m, &sq, 2).unwrap();
        sq.resolve(&m);
        assert_ne!(sq.ring, Default::default(), "the ring resolved");
        let fast = read_sqe(&m, &sq, 2).unwrap();
        for c in [slow, fast] {
            assert_eq!((c.opcode, c.cid, c.nsid), (0x02, 0xbeef, 0x0102_0304));
            assert_eq!((c.prp1, c.prp2), (0x1122_3344_5566_7788, 0x99aa_bbcc_ddee_ff00));
            assert_eq!((c.cdw10, c.cdw11, c.cdw12, c.cdw13), (0xa0a0_a0a0, 0xb1b1_b1b1, 0xc2c2_c2c2, 0xd3d3_d3d3));
        }
    }

    #[test]
    fn prps_one_two_and_lists() {
        let m = mem();
        let mut v = Vec::new();
        prp_segments(&m, 0x1200, 0, 512, &mut v).unwrap();
        assert_eq!(v, [(0x1200, 512)]);
        prp_segments(&m, 0x1800, 0x5000, 4096, &mut v).unwrap();
        assert_eq!(v, [(0x1800, 2048), (0x5000, 2048)]);
        // 16 KiB from a page-aligned PRP1: PRP2 is a list of 3 pages.
        for (i, p) in [0x7000u64, 0x9000, 0xb000].iter().enumerate() {
            m.mapped().write_obj(*p, GuestAddress(0x20000 + 8 * i as u64)).unwrap();
        }
        prp_segments(&m, 0x3000, 0x20000, 16384, &mut v).unwrap();
        assert_eq!(v, [(0x3000, 4096), (0x7000, 4096), (0x9000, 4096), (0xb000, 4096)]);
    }

    #[test]
    fn hostile_prps_get_a_status() {
        let m = mem();
        let mut v = Vec::new();
        assert_eq!(prp_segments(&m, 0x1201, 0, 512, &mut v), Err(status::INVALID_PRP_OFFSET));
        assert_eq!(prp_segments(&m, 0x1800, 0x5004, 4096, &mut v), Err(status::INVALID_PRP_OFFSET));
        assert_eq!(prp_segments(&m, 1 << 30, 0, 512, &mut v), Err(status::DATA_TRANSFER_ERROR), "outside RAM");
        assert_eq!(prp_segments(&m, 0xff000, 0x100000, 8192, &mut v), Err(status::DATA_TRANSFER_ERROR));
        assert_eq!(prp_segments(&m, 0x3000, u64::MAX - 7, 16384, &mut v), Err(status::DATA_TRANSFER_ERROR));
        // A list entry with an offset.
        m.mapped().write_obj(0x7001u64, GuestAddress(0x20000)).unwrap();
        assert_eq!(prp_segments(&m, 0x3000, 0x20000, 12288, &mut v), Err(status::INVALID_PRP_OFFSET));
        // A list that points at itself forever ends with a status.
        for i in 0..512u64 {
            m.mapped().write_obj(0x20000u64, GuestAddress(0x20000 + 8 * i)).unwrap();
        }
        assert!(prp_segments(&m, 0x3000, 0x20000, 1 << 30, &mut v).is_err());
    }

    #[test]
    fn completions_flip_phase_each_lap() {
        let m = mem();
        let mut cq = Cq { gpa: 0x8000, size: 2, ..Default::default() };
        assert_eq!(post_cqe(&m, &mut cq, 7, 1, 1, 0x42, 0), Some((1, false)));
        let dw3: u32 = m.mapped().read_obj(GuestAddress(0x8000 + 12)).unwrap();
        assert_eq!(dw3, 0x42 | 1 << 16);
        assert_eq!(post_cqe(&m, &mut cq, 0, 2, 1, 0x43, status::LBA_OUT_OF_RANGE), Some((0, true)));
        assert_eq!((cq.tail, cq.phase), (0, true));
        assert!(post_cqe(&m, &mut cq, 0, 3, 1, 0x44, 0).is_some());
        let dw3: u32 = m.mapped().read_obj(GuestAddress(0x8000 + 12)).unwrap();
        assert_eq!(dw3 >> 16 & 1, 0, "second lap carries phase 0");
        let dw3b: u32 = m.mapped().read_obj(GuestAddress(0x8000 + 16 + 12)).unwrap();
        assert_eq!(dw3b >> 17, status::LBA_OUT_OF_RANGE as u32);
    }
}
