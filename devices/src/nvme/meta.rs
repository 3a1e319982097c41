//! Metadata and end-to-end protection information (PI) of a namespace
//! formatted with metadata (NVM Command Set: LBA formats with MS 8, 16 or
//! 64; FLBAS bit 4; MC; DPC/DPS).
//!
//! Where it lives: after the namespace's data in the same storage
//! (`ram`: the same mapping, `null`: nowhere, `file:PATH`: the file holds
//! `size` data bytes, then the metadata area), block `l`'s metadata at
//! `size + l * ms`. The area is an eighth of the data size (64 bytes per
//! 512-byte block, the most any format takes), so Format NVM may switch
//! between every format. Metadata is stored inverted (each byte XOR FFh):
//! storage that was never written, was deallocated or erased (zeros)
//! reads as all-FFh metadata, i.e. PI with the application tag FFFFh,
//! whose checks are disabled (type 1's escape), as a deallocated block's
//! PI must be for a host that checks every read.
//!
//! How it moves: with extended LBAs (FLBAS bit 4) each block's metadata
//! follows its data in the transfer the PRPs describe ((LBA size + MS)
//! bytes per block); otherwise it is one contiguous buffer at MPTR
//! (PSDT 00b), MS bytes per block. Every address is checked against guest
//! memory (a bad one: Data Transfer Error, nothing written).
//!
//! PI type 1 (8 bytes, big endian: a CRC16 T10-DIF guard of the block's
//! data, a 16-bit application tag, a 32-bit reference tag = the LBA's low
//! 32 bits), per PRINFO in CDW12: PRACT (bit 29) on a write makes the
//! controller generate it (with MS 8 the host sends no metadata at all,
//! and on a read gets none: stripped), PRCHK (bits 28:26: guard, app tag,
//! ref tag) the checks, against CDW14 (EILBRT, + 1 per block) and CDW15
//! (ELBAT, ELBATM). A failed check fails the command with End-to-end
//! Guard (282h), Application Tag (283h) or Reference Tag (284h) Check
//! Error and, on a write, nothing is written; on a read, nothing reaches
//! the host. Write Zeroes with PRACT writes PI of the zeroed blocks; Write
//! Zeroes without it, Dataset Management's deallocate and Format NVM leave
//! the metadata as deallocated (all FFh).
//!
//! Reads and writes of a namespace with metadata go the synchronous way
//! (a file's too: no io_uring), through buffers of their own; a namespace
//! without metadata never comes here (one branch on `ms` in `io.rs`).

use super::controller::Core;
use super::queue::{prp_segments, status, Sqe, PAGE};
use super::MDTS;

/// End-to-end Guard, Application Tag and Reference Tag Check Errors (SCT 2).
pub(super) const GUARD_CHECK: u16 = 0x282;
pub(super) const APP_TAG_CHECK: u16 = 0x283;
pub(super) const REF_TAG_CHECK: u16 = 0x284;

/// PRACT: the controller generates (write) or strips (read, MS 8) the PI.
const PRACT: u32 = 1 << 29;

/// The CRC16 T10-DIF table (polynomial 8BB7h, not reflected, initial 0).
const CRC_TABLE: [u16; 256] = {
    let mut t = [0u16; 256];
    let mut i = 0;
    while i < 256 {
        let mut c = (i as u16) << 8;
        let mut k = 0;
        while k < 8 {
            c = if c & 0x8000 != 0 { c << 1 ^ 0x8bb7 } else { c << 1 };
            k += 1;
        }
        t[i] = c;
        i += 1;
    }
    t
};

/// The PI guard of `data`: CRC16 T10-DIF.
pub fn crc16_t10dif(data: &[u8]) -> u16 {
    data.iter().fold(0u16, |c, &b| c << 8 ^ CRC_TABLE[((c >> 8) as u8 ^ b) as usize])
}

/// A namespace's metadata format as the I/O path uses it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) struct MetaFmt {
    /// Metadata bytes per block (0: none; nothing else applies).
    pub ms: u16,
    /// Extended LBAs: inline after each block's data.
    pub ext: bool,
    /// Protection information type (0 or 1).
    pub pi: u8,
    /// PI in the metadata's first 8 bytes (else its last 8).
    pub pi_first: bool,
    /// Byte offset of the metadata area in the storage (its size: `area`).
    pub base: u64,
    pub area: u64,
}

impl MetaFmt {
    fn pi_off(&self) -> usize {
        if self.pi_first {
            0
        } else {
            self.ms as usize - 8
        }
    }
}

/// What PRINFO and CDW14/15 ask of a command's PI.
#[derive(Clone, Copy, Debug)]
pub(super) struct PiCheck {
    /// PRCHK bits: 4 guard, 2 app tag, 1 ref tag.
    pub prchk: u32,
    /// EILBRT: the first block's expected reference tag.
    pub ref_tag: u32,
    pub app_tag: u16,
    pub app_mask: u16,
}

impl PiCheck {
    pub fn of(c: &Sqe) -> PiCheck {
        PiCheck {
            prchk: c.cdw12 >> 26 & 7,
            ref_tag: c.cdw14,
            app_tag: c.cdw15 as u16,
            app_mask: (c.cdw15 >> 16) as u16,
        }
    }

    /// Checks the 8-byte tuple `pi` of block `k` (0-based in the command)
    /// whose data is `data`: Ok, or the check that failed.
    pub fn check(&self, k: u64, data: &[u8], pi: &[u8]) -> Result<(), u16> {
        let app = u16::from_be_bytes([pi[2], pi[3]]);
        if app == 0xffff {
            return Ok(()); // type 1: checks disabled for this block
        }
        if self.prchk & 4 != 0 && u16::from_be_bytes([pi[0], pi[1]]) != crc16_t10dif(data) {
            return Err(GUARD_CHECK);
        }
        if self.prchk & 2 != 0 && app & self.app_mask != self.app_tag & self.app_mask {
            return Err(APP_TAG_CHECK);
        }
        let want = self.ref_tag.wrapping_add(k as u32);
        if self.prchk & 1 != 0 && u32::from_be_bytes([pi[4], pi[5], pi[6], pi[7]]) != want {
            return Err(REF_TAG_CHECK);
        }
        Ok(())
    }

    /// The tuple the controller generates for block `k` with `data`.
    pub fn generate(&self, k: u64, data: &[u8], pi: &mut [u8]) {
        pi[0..2].copy_from_slice(&crc16_t10dif(data).to_be_bytes());
        pi[2..4].copy_from_slice(&self.app_tag.to_be_bytes());
        pi[4..8].copy_from_slice(&self.ref_tag.wrapping_add(k as u32).to_be_bytes());
    }
}

/// Inverts stored metadata to what the host sees and back (see the module doc).
fn flip(b: &mut [u8]) {
    b.iter_mut().for_each(|x| *x = !*x);
}

impl Core {
    /// `pi.checks` and `pi.errors` (tuples checked, and found wrong) over
    /// every queue group, where a namespace has protection information.
    pub(super) fn pi_counters(&mut self) -> Vec<crate::Counter> {
        if !self.ns.iter().any(|ns| ns.meta.pi != 0 || ns.pi_checks != 0) {
            return Vec::new();
        }
        let (mut checks, mut errors) = (0, 0);
        for g in 0..self.groups.max(1) {
            let (c, e) =
                self.with_group(g, |k| k.ns.iter().fold((0, 0), |a, ns| (a.0 + ns.pi_checks, a.1 + ns.pi_errors)));
            (checks, errors) = (checks + c, errors + e);
        }
        [("pi.checks", checks), ("pi.errors", errors)]
            .into_iter()
            .map(|(n, value)| crate::Counter { name: n.into(), value })
            .collect()
    }

    /// A Read or Write of `n` blocks at `slba` (in range) on namespace
    /// index `i`, which has metadata.
    pub(super) fn rw_meta(&mut self, i: usize, c: &Sqe, slba: u64, n: u64, write: bool) -> u16 {
        let (m, shift) = (self.ns[i].meta, self.ns[i].lba_shift);
        let (lbs, ms) = (1usize << shift, m.ms as usize);
        let pi = PiCheck::of(c);
        let pract = m.pi != 0 && c.cdw12 & PRACT != 0;
        // MS 8 and PRACT: the host's side of the transfer has no metadata.
        let host_ms = if pract && ms == 8 { 0 } else { ms };
        let blocks = n as usize;
        let xfer = if m.ext { blocks * (lbs + host_ms) } else { blocks * lbs } as u64;
        if xfer > PAGE << MDTS {
            return status::INVALID_FIELD;
        }
        let mut segs = std::mem::take(&mut self.scratch.segs);
        let st = match prp_segments(&self.mem, c.prp1, c.prp2, xfer, &mut segs) {
            Err(st) => st,
            Ok(()) => self.move_meta(i, c, &segs, slba, blocks, write, host_ms, pract, pi),
        };
        self.scratch.segs = segs;
        if st == status::SUCCESS {
            self.count_rw(write, (blocks * lbs) as u64);
        }
        st
    }

    #[allow(clippy::too_many_arguments)]
    fn move_meta(
        &mut self,
        i: usize,
        c: &Sqe,
        segs: &[(u64, u64)],
        slba: u64,
        blocks: usize,
        write: bool,
        host_ms: usize,
        pract: bool,
        pi: PiCheck,
    ) -> u16 {
        let (m, shift) = (self.ns[i].meta, self.ns[i].lba_shift);
        let (lbs, ms) = (1usize << shift, m.ms as usize);
        let xfer: usize = segs.iter().map(|s| s.1 as usize).sum();
        let mut host = vec![0u8; xfer];
        let mut data = vec![0u8; blocks * lbs];
        let mut meta = vec![0u8; blocks * ms];
        let (data_off, meta_off) = (slba << shift, m.base + slba * ms as u64);
        let po = m.pi_off();
        if write {
            let mut pos = 0;
            for (a, len) in super::io::runs(segs) {
                if self.mem.read_slice(&mut host[pos..pos + len as usize], a).is_err() {
                    return status::DATA_TRANSFER_ERROR;
                }
                pos += len as usize;
            }
            if m.ext {
                for k in 0..blocks {
                    let h = &host[k * (lbs + host_ms)..(k + 1) * (lbs + host_ms)];
                    data[k * lbs..(k + 1) * lbs].copy_from_slice(&h[..lbs]);
                    meta[k * ms..k * ms + host_ms].copy_from_slice(&h[lbs..]);
                }
            } else {
                data.copy_from_slice(&host);
                if host_ms > 0 && self.mem.read_slice(&mut meta, c.mptr).is_err() {
                    return status::DATA_TRANSFER_ERROR;
                }
            }
            if m.pi != 0 {
                for k in 0..blocks {
                    let (d, md) = (&data[k * lbs..(k + 1) * lbs], &mut meta[k * ms..(k + 1) * ms]);
                    if pract {
                        pi.generate(k as u64, d, &mut md[po..po + 8]);
                    } else {
                        self.ns[i].pi_checks += 1;
                        if let Err(st) = pi.check(k as u64, d, &md[po..po + 8]) {
                            self.ns[i].pi_errors += 1;
                            return st;
                        }
                    }
                }
            }
            flip(&mut meta);
            let s = &mut self.ns[i].storage;
            if s.write(data_off, &data).and_then(|()| s.write(meta_off, &meta)).is_err() {
                return status::DATA_TRANSFER_ERROR;
            }
        } else {
            let s = &mut self.ns[i].storage;
            if s.read(data_off, &mut data).and_then(|()| s.read(meta_off, &mut meta)).is_err() {
                return status::DATA_TRANSFER_ERROR;
            }
            flip(&mut meta);
            if m.pi != 0 {
                for k in 0..blocks {
                    let (d, md) = (&data[k * lbs..(k + 1) * lbs], &meta[k * ms..(k + 1) * ms]);
                    self.ns[i].pi_checks += 1;
                    if let Err(st) = pi.check(k as u64, d, &md[po..po + 8]) {
                        self.ns[i].pi_errors += 1;
                        return st;
                    }
                }
            }
            if m.ext {
                for k in 0..blocks {
                    let h = &mut host[k * (lbs + host_ms)..(k + 1) * (lbs + host_ms)];
                    h[..lbs].copy_from_slice(&data[k * lbs..(k + 1) * lbs]);
                    h[lbs..].copy_from_slice(&meta[k * ms..k * ms + host_ms]);
                }
            } else {
                host.copy_from_slice(&data);
                if host_ms > 0 && self.mem.write_slice(&meta, c.mptr).is_err() {
                    return status::DATA_TRANSFER_ERROR;
                }
            }
            let mut pos = 0;
            for (a, len) in super::io::runs(segs) {
                if self.mem.write_slice(&host[pos..pos + len as usize], a).is_err() {
                    return status::DATA_TRANSFER_ERROR;
                }
                pos += len as usize;
            }
        }
        status::SUCCESS
    }

    /// The metadata of `n` blocks at `slba` after a Write Zeroes (`c`; with
    /// PRACT and PI: generated for the zeros) or a deallocation (`c` None:
    /// as deallocated, all FFh).
    pub(super) fn zero_meta(&mut self, i: usize, slba: u64, n: u64, c: Option<&Sqe>) -> u16 {
        let (m, shift) = (self.ns[i].meta, self.ns[i].lba_shift);
        if m.ms == 0 {
            return status::SUCCESS;
        }
        let ms = m.ms as usize;
        let off = m.base + slba * ms as u64;
        let len = n * ms as u64;
        let s = &mut self.ns[i].storage;
        let r = match c.filter(|c| m.pi != 0 && c.cdw12 & PRACT != 0) {
            None => s.write_zeroes(off, len, false),
            Some(c) => {
                let pi = PiCheck::of(c);
                let zeros = vec![0u8; 1 << shift];
                let mut meta = vec![0u8; len as usize];
                for (k, md) in meta.chunks_mut(ms).enumerate() {
                    pi.generate(k as u64, &zeros, &mut md[m.pi_off()..m.pi_off() + 8]);
                }
                flip(&mut meta);
                s.write(off, &meta)
            }
        };
        match r {
            Ok(()) => status::SUCCESS,
            Err(e) => {
                log::warn!("nvme: metadata of zeroed blocks: {e}");
                status::INTERNAL
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crc16_t10dif_matches_its_check_value() {
        // The catalogued check value of CRC-16/T10-DIF.
        assert_eq!(crc16_t10dif(b"123456789"), 0xd0db);
        assert_eq!(crc16_t10dif(&[0u8; 512]), 0);
    }

    #[test]
    fn checks_follow_prchk_and_the_escape() {
        let data = [0x5au8; 512];
        let g = PiCheck { prchk: 0, ref_tag: 100, app_tag: 0x1234, app_mask: 0 };
        let mut pi = [0u8; 8];
        g.generate(3, &data, &mut pi);
        assert_eq!(u32::from_be_bytes(pi[4..8].try_into().unwrap()), 103);
        let all = PiCheck { prchk: 7, ref_tag: 100, app_tag: 0x1234, app_mask: 0xffff };
        assert_eq!(all.check(3, &data, &pi), Ok(()));
        assert_eq!(all.check(4, &data, &pi), Err(REF_TAG_CHECK));
        let mut bad = pi;
        bad[0] ^= 1;
        assert_eq!(all.check(3, &data, &bad), Err(GUARD_CHECK));
        assert_eq!(PiCheck { prchk: 3, ..all }.check(3, &data, &bad), Ok(()), "guard not asked");
        assert_eq!(PiCheck { app_tag: 0x1235, ..all }.check(3, &data, &pi), Err(APP_TAG_CHECK));
        assert_eq!(PiCheck { app_tag: 0x1235, app_mask: 0xfff0, ..all }.check(3, &data, &pi), Ok(()));
        assert_eq!(all.check(9, &data, &[0xff; 8]), Ok(()), "app tag FFFFh: checks disabled");
    }
}
