//! What the driver's commands carry and leave: each write's data and
//! metadata (its pattern, and on a namespace with protection information
//! the tuples it sends or the controller generates: `pi.rs`), what a
//! block holds after a command, and where a transfer's bytes lie in guest
//! memory.

use super::super::model::Content;
use super::super::pi::{self, Prinfo};
use super::super::Port;
use super::{Cmd, Driver, Op, PAGE};
use vm_memory::{Bytes, GuestAddress};

impl<P: Port + ?Sized> Driver<'_, P> {
    /// A write's data: each block what it sends ([`Self::sent`]), its
    /// metadata words (inline with extended LBAs, not stripped) inverted
    /// ([`Meta`]).
    pub(super) fn payload(&self, c: &Cmd) -> Vec<u8> {
        let (words, m) = (self.host_lba(c) / 8, self.meta[c.ns]);
        (0..c.nlb)
            .flat_map(|k| (0..words).map(move |w| (k, w)))
            .flat_map(|(k, w)| m.stored(w, self.sent(c, k).word(c.slba + k, w)).to_le_bytes())
            .collect()
    }

    /// A write's separate metadata (MPTR): each block's words past its data,
    /// inverted.
    pub(super) fn meta_payload(&self, c: &Cmd) -> Vec<u8> {
        let m = self.meta[c.ns];
        let (first, words) = (m.data / 8, m.ms / 8);
        (0..c.nlb)
            .flat_map(|k| (first..first + words).map(move |w| (k, w)))
            .flat_map(|(k, w)| (!self.sent(c, k).word(c.slba + k, w)).to_le_bytes())
            .collect()
    }

    /// What write `c` sends for its block `k`: its pattern, with the tuple
    /// it chose where it carries PI of its own.
    pub(super) fn sent(&self, c: &Cmd, k: u64) -> Content {
        match c.tuples.get(k as usize) {
            Some(&tuple) => {
                let m = self.meta[c.ns];
                Content::Tagged { seq: Some(c.seq), data: (m.data / 8) as u16, at: m.pi_word(), tuple }
            }
            None => Content::Data(c.seq),
        }
    }

    /// What block `k` of a write, write zeroes or deallocation `c` holds
    /// once done: what the write sent, with the tuple the controller
    /// generated under PRACT.
    pub(super) fn left(&self, c: &Cmd, k: u64) -> Content {
        let m = self.meta[c.ns];
        let seq = (c.op == Op::Write).then_some(c.seq);
        if !(m.pi && c.pract() && matches!(c.op, Op::Write | Op::Zeroes)) {
            return if c.op == Op::Write { self.sent(c, k) } else { Content::Zero };
        }
        let base = seq.map_or(Content::Zero, Content::Data);
        let tuple = c.prinfo.unwrap().generate(k, &data_bytes(base, c.slba + k, m.data));
        Content::Tagged { seq, data: (m.data / 8) as u16, at: m.pi_word(), tuple }
    }

    /// With PRACT on a namespace with 8 bytes of metadata (PI alone), a
    /// read or write moves no metadata at all.
    pub(super) fn stripped(&self, c: &Cmd) -> bool {
        let m = self.meta[c.ns];
        m.pi && m.ms == 8 && c.pract() && matches!(c.op, Op::Read | Op::Write)
    }

    /// Bytes per block on the host's side of `c`'s transfer.
    pub(super) fn host_lba(&self, c: &Cmd) -> u64 {
        if self.stripped(c) {
            self.meta[c.ns].data
        } else {
            self.lba[c.ns]
        }
    }

    /// On a namespace with PI, most reads, writes and write zeroes get a
    /// PRINFO (none where injection decides their fate). A read checks
    /// only blocks whose content the model knows for sure; the status it
    /// must get is the first failing check of its blocks in order.
    pub(super) fn draw_prinfo(&mut self, c: &mut Cmd) {
        let m = self.meta[c.ns];
        let fit = matches!(c.op, Op::Read | Op::Write | Op::Zeroes) && c.action.is_none();
        if !(m.pi && fit && self.shape.data && self.rng.chance(60)) {
            return;
        }
        let mut p = Prinfo::draw(&mut self.rng, c.slba);
        let lbas = &self.lbas[c.ns];
        if c.op == Op::Read {
            if (c.slba..c.slba + c.nlb).any(|l| lbas.can_be(l).len() != 1) {
                p.prchk = 0;
            }
            c.pi_status = (0..c.nlb)
                .map(|k| {
                    let (lba, held) = (c.slba + k, lbas.can_be(c.slba + k)[0]);
                    p.check(k, &data_bytes(held, lba, m.data), !held.word(lba, m.pi_word() as u64))
                })
                .find(|&st| st != 0)
                .unwrap_or(0);
        }
        c.prinfo = Some(p);
    }

    /// A write without PRACT on a namespace with PI carries a tuple per
    /// block: a good one (or the application tag FFFFh: unchecked), now
    /// and then one field of one block spoiled.
    pub(super) fn draw_tuples(&mut self, c: &mut Cmd) {
        let (m, Some(p)) = (self.meta[c.ns], c.prinfo) else { return };
        if p.pract {
            return;
        }
        c.tuples = (0..c.nlb)
            .map(|k| {
                let lba = c.slba + k;
                if self.rng.chance(10) {
                    pi::tuple(self.rng.below(1 << 16) as u16, 0xffff, self.rng.below(1 << 32) as u32)
                } else {
                    p.generate(k, &data_bytes(Content::Data(c.seq), lba, m.data))
                }
            })
            .collect();
        if self.rng.chance(30) {
            let k = self.rng.below(c.nlb) as usize;
            c.tuples[k] = pi::spoil(c.tuples[k], self.rng.below(3));
        }
        c.pi_status = (0..c.nlb)
            .map(|k| {
                let data = data_bytes(Content::Data(c.seq), c.slba + k, m.data);
                p.check(k, &data, c.tuples[k as usize])
            })
            .find(|&st| st != 0)
            .unwrap_or(0);
    }

    /// The separate metadata buffer of `c` as it is in guest memory (empty
    /// without one).
    pub(super) fn meta_of(&self, c: &Cmd) -> Vec<u8> {
        let Some(p) = c.meta else { return Vec::new() };
        let mut out = vec![0u8; (c.nlb * self.meta[c.ns].ms) as usize];
        self.ram().read_slice(&mut out, GuestAddress(p)).unwrap();
        out
    }

    pub(super) fn scatter(&mut self, c: &Cmd, data: &[u8]) {
        let mut at = 0usize;
        for (a, n) in segments(c, self.host_lba(c)) {
            self.put(a, &data[at..at + n as usize]);
            at += n as usize;
        }
    }

    pub(super) fn gather(&self, c: &Cmd) -> Vec<u8> {
        let mut out = vec![0u8; c.bytes(self.host_lba(c)) as usize];
        let mut at = 0usize;
        for (a, n) in segments(c, self.host_lba(c)) {
            self.ram().read_slice(&mut out[at..at + n as usize], GuestAddress(a)).unwrap();
            at += n as usize;
        }
        out
    }
}

/// The data bytes of a block of `lba` holding `c` (`len` bytes).
fn data_bytes(c: Content, lba: u64, len: u64) -> Vec<u8> {
    (0..len / 8).flat_map(|w| c.word(lba, w).to_le_bytes()).collect()
}

pub(super) fn segments(c: &Cmd, lba: u64) -> Vec<(u64, u64)> {
    let mut left = c.bytes(lba);
    let mut out = Vec::new();
    for (i, &p) in c.pages.iter().enumerate() {
        let start = if i == 0 { c.offset } else { 0 };
        let n = (PAGE - start).min(left);
        out.push((p + start, n));
        left -= n;
    }
    out
}
