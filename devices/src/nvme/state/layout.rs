//! Where NVMe's state lies in the state memory (64-bit words), and the
//! controller configuration an admin command or a register write commits
//! (`Config`, two copies and a selector: the copy not selected is written
//! whole, then the selector flips in one store).
//!
//! Words: a header (magic, shape, selector), the MSI-X table as the guest
//! programmed it, the queues' moving indices (SQ head and tail, CQ tail
//! and phase, CQ head: one word each), the two configuration copies, then
//! the command slots (`SLOT_WORDS` each: state, the CQE to post, the
//! sequence number, the SQE), then the ram table: per namespace,
//! where its data lies in the state memory if it is a ram namespace
//! (`RamPlace::words`; zeros otherwise). The ram data follows the words
//! (`crate::state::place_ram`).

use super::super::namespaces::MAX_NAMESPACES;
use super::super::{MAX_IO_QUEUES, MSIX_VECTORS};

/// "iopNVMe1", little endian.
pub const MAGIC: u64 = u64::from_le_bytes(*b"iopNVMe1");
/// Queues, admin included.
pub const NQ: usize = MAX_IO_QUEUES as usize + 1;
pub const NNS: usize = MAX_NAMESPACES as usize;
/// Command slots: every command that can be in flight at once (a file
/// namespace holds 256, a RAM or null one completes in its pass, AERs wait).
pub const SLOTS: usize = 256 * NNS + 64;
pub const SLOT_WORDS: usize = 16;

pub const W_MAGIC: usize = 0;
pub const W_SHAPE: usize = 1;
pub const W_SELECT: usize = 2;
/// MSI-X: Message Control's high byte (bit 8: valid), then two words a vector.
pub const MSIX_CTL: usize = 8;
pub const MSIX: usize = MSIX_CTL + 1;
pub const SQ_HEAD: usize = MSIX + 2 * MSIX_VECTORS;
pub const SQ_TAIL: usize = SQ_HEAD + NQ;
/// Tail in bits 15:0, the phase the next entry carries the inverse of in bit 16.
pub const CQ_TAIL: usize = SQ_TAIL + NQ;
pub const CQ_HEAD: usize = CQ_TAIL + NQ;
pub const CFG: usize = (CQ_HEAD + NQ).next_multiple_of(8);
pub const CFG_NS: usize = 16;
pub const CFG_SQ: usize = CFG_NS + 2 * NNS;
pub const CFG_CQ: usize = CFG_SQ + 2 * NQ;
pub const CFG_WORDS: usize = CFG_CQ + 2 * NQ;
pub const SLOT0: usize = (CFG + 2 * CFG_WORDS).next_multiple_of(SLOT_WORDS);
/// Two words a namespace: its ram data's byte offset and length.
pub const RAM_TABLE: usize = SLOT0 + SLOTS * SLOT_WORDS;
pub const WORDS: usize = RAM_TABLE + 2 * NNS;
/// The bytes of NVMe's words (its ram namespaces' data after them).
pub const LEN: usize = WORDS * 8;
/// The shape word: what a layout of another build would differ in.
pub const SHAPE: u64 = 5 | (SLOTS as u64) << 8 | (NQ as u64) << 32 | (NNS as u64) << 48;

/// Slot words: state, CQE, sequence number, the SQE (8); a completion's
/// stores (state and CQE) in the slot's first cache line.
pub const S_META: usize = 0;
/// A POSTING slot's CQE: dw0 in bits 31:0, dw3's phase and status (its
/// bits 31:16) in bits 47:32, the SQ head it reports in bits 63:48.
pub const S_CQE: usize = 1;
pub const S_SEQ: usize = 2;
pub const S_SQE: usize = 3;
/// Slot states (meta bits 1:0); sqid in bits 15:8, the SQ index the
/// command was fetched at in bits 31:16 (`AT`). FETCHED: bit 2, the SQE
/// could not be read; bits 63:32 zero. POSTING: the cid in bits 47:32, the
/// CQ position in bits 63:48.
pub const FREE: u64 = 0;
pub const FETCHED: u64 = 1;
pub const POSTING: u64 = 2;
pub const BAD_SQE: u64 = 4;
/// The sqid and SQ index bits of a slot's state word.
pub const AT: u64 = 0xffff_ff00;

pub fn config_at(select: u64) -> usize {
    CFG + (select & 1) as usize * CFG_WORDS
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NsFmt {
    pub attached: bool,
    pub lba_shift: u32,
    pub nlbas: u64,
    pub ms: u16,
    pub ext: bool,
    pub pi: u8,
    pub pi_first: bool,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SqDef {
    pub gpa: u64,
    pub size: u16,
    pub cqid: u16,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CqDef {
    pub gpa: u64,
    pub size: u16,
    pub iv: u16,
    pub ien: bool,
}

/// An admin command whose effect this configuration holds, and its
/// completion (slot, sequence number, dw0, status): on resume it is
/// completed, not run again.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Done {
    pub slot: u16,
    pub seq: u64,
    pub dw0: u32,
    pub st: u16,
}

/// What the controller's registers, admin commands and control socket set.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Config {
    pub cc: u32,
    pub csts: u32,
    pub aqa: u32,
    pub intms: u32,
    pub asq: u64,
    pub acq: u64,
    pub nsqa: u16,
    pub ncqa: u16,
    pub created: bool,
    pub shadow: Option<(u64, u64)>,
    pub arbitration: u32,
    pub power: u32,
    pub temp_over: u16,
    pub temp_under: u16,
    pub write_cache: bool,
    pub error_recovery: u32,
    pub write_atomicity: u32,
    pub async_events: u32,
    pub coalescing: u32,
    /// Interrupt Vector Configuration's Coalescing Disable, bit = vector.
    pub coalescing_off: u128,
    pub done: Option<Done>,
    pub ns: Vec<NsFmt>,
    pub sqs: Vec<Option<SqDef>>,
    pub cqs: Vec<Option<CqDef>>,
}

const EXISTS: u64 = 1 << 40;

impl Config {
    pub fn encode(&self, w: &mut [u64; CFG_WORDS]) {
        w.fill(0);
        w[0] = self.cc as u64 | (self.csts as u64) << 32;
        w[1] = self.aqa as u64 | (self.intms as u64) << 32;
        w[2] = self.asq;
        w[3] = self.acq;
        w[4] = self.nsqa as u64 | (self.ncqa as u64) << 16 | (self.created as u64) << 32;
        if let Some((db, ei)) = self.shadow {
            w[4] |= EXISTS;
            (w[5], w[6]) = (db, ei);
        }
        w[7] = self.arbitration as u64 | (self.power as u64) << 32;
        w[8] = self.temp_over as u64 | (self.temp_under as u64) << 16 | (self.write_cache as u64) << 32;
        w[9] = self.error_recovery as u64 | (self.write_atomicity as u64) << 32;
        w[10] = self.async_events as u64 | (self.coalescing as u64) << 32;
        (w[11], w[12]) = (self.coalescing_off as u64, (self.coalescing_off >> 64) as u64);
        if let Some(d) = self.done {
            w[13] = d.slot as u64 | EXISTS;
            w[14] = d.dw0 as u64 | (d.st as u64) << 32;
            w[15] = d.seq;
        }
        for (i, n) in self.ns.iter().enumerate().take(NNS) {
            w[CFG_NS + 2 * i] = n.nlbas;
            w[CFG_NS + 2 * i + 1] = n.lba_shift as u64
                | (n.ms as u64) << 8
                | (n.ext as u64) << 24
                | (n.pi as u64) << 25
                | (n.pi_first as u64) << 28
                | (n.attached as u64) << 32
                | EXISTS;
        }
        for (q, s) in self.sqs.iter().enumerate().take(NQ) {
            if let Some(s) = s {
                w[CFG_SQ + 2 * q] = s.gpa;
                w[CFG_SQ + 2 * q + 1] = s.size as u64 | (s.cqid as u64) << 16 | EXISTS;
            }
        }
        for (q, c) in self.cqs.iter().enumerate().take(NQ) {
            if let Some(c) = c {
                w[CFG_CQ + 2 * q] = c.gpa;
                w[CFG_CQ + 2 * q + 1] = c.size as u64 | (c.iv as u64) << 16 | (c.ien as u64) << 32 | EXISTS;
            }
        }
    }

    /// The configuration the words hold, as they are (the caller validates).
    pub fn decode(w: &[u64]) -> Config {
        let has = |v: u64| v & EXISTS != 0;
        let ns = (0..NNS)
            .map(|i| (w[CFG_NS + 2 * i], w[CFG_NS + 2 * i + 1]))
            .filter(|&(_, b)| has(b))
            .map(|(a, b)| NsFmt {
                nlbas: a,
                lba_shift: (b & 0xff) as u32,
                ms: (b >> 8) as u16,
                ext: b >> 24 & 1 != 0,
                pi: (b >> 25 & 7) as u8,
                pi_first: b >> 28 & 1 != 0,
                attached: b >> 32 & 1 != 0,
            })
            .collect();
        let sqs = (0..NQ)
            .map(|q| (w[CFG_SQ + 2 * q], w[CFG_SQ + 2 * q + 1]))
            .map(|(a, b)| has(b).then_some(SqDef { gpa: a, size: b as u16, cqid: (b >> 16) as u16 }))
            .collect();
        let cqs = (0..NQ)
            .map(|q| (w[CFG_CQ + 2 * q], w[CFG_CQ + 2 * q + 1]))
            .map(|(a, b)| {
                has(b).then_some(CqDef { gpa: a, size: b as u16, iv: (b >> 16) as u16, ien: b >> 32 & 1 != 0 })
            })
            .collect();
        Config {
            cc: w[0] as u32,
            csts: (w[0] >> 32) as u32,
            aqa: w[1] as u32,
            intms: (w[1] >> 32) as u32,
            asq: w[2],
            acq: w[3],
            nsqa: w[4] as u16,
            ncqa: (w[4] >> 16) as u16,
            created: w[4] >> 32 & 1 != 0,
            shadow: has(w[4]).then_some((w[5], w[6])),
            arbitration: w[7] as u32,
            power: (w[7] >> 32) as u32,
            temp_over: w[8] as u16,
            temp_under: (w[8] >> 16) as u16,
            write_cache: w[8] >> 32 & 1 != 0,
            error_recovery: w[9] as u32,
            write_atomicity: (w[9] >> 32) as u32,
            async_events: w[10] as u32,
            coalescing: (w[10] >> 32) as u32,
            coalescing_off: w[11] as u128 | (w[12] as u128) << 64,
            done: has(w[13]).then_some(Done {
                slot: w[13] as u16,
                dw0: w[14] as u32,
                st: (w[14] >> 32) as u16,
                seq: w[15],
            }),
            ns,
            sqs,
            cqs,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_config_reads_back_as_written_and_the_layout_fits() {
        const { assert!(LEN <= crate::state::MAX_STATE_LEN) };
        let mut c = Config {
            cc: 0x460001,
            csts: 1,
            aqa: 0x1f001f,
            asq: 0x10000,
            acq: 0x20000,
            nsqa: 3,
            ncqa: 4,
            created: true,
            shadow: Some((0x3000, 0x4000)),
            write_cache: true,
            coalescing: 0x0a05,
            coalescing_off: 1 << 64 | 5,
            done: Some(Done { slot: 7, seq: 1 << 40, dw0: 0x30003, st: 0x101 }),
            ns: vec![NsFmt { attached: true, lba_shift: 12, nlbas: 256, ms: 8, ext: false, pi: 1, pi_first: true }],
            sqs: vec![None; NQ],
            cqs: vec![None; NQ],
            ..Default::default()
        };
        c.sqs[0] = Some(SqDef { gpa: 0x10000, size: 32, cqid: 0 });
        c.sqs[64] = Some(SqDef { gpa: 0x50000, size: 4096, cqid: 3 });
        c.cqs[3] = Some(CqDef { gpa: 0x60000, size: 2, iv: 64, ien: true });
        let mut w = [0u64; CFG_WORDS];
        c.encode(&mut w);
        assert_eq!(Config::decode(&w), c);
    }
}
