//! The admin commands about namespaces: Identify Namespace (CNS 00h, and
//! 11h for an allocated NSID), the active and allocated namespace ID lists
//! (02h, 10h: every namespace is allocated; attached ones are active), the Namespace
//! Identification Descriptor list (03h: each namespace's NGUID and UUID,
//! `identity.rs`), and Format NVM (80h), which switches a namespace
//! between the two LBA formats Identify Namespace lists (0: 512 bytes, 1:
//! 4096; no metadata, no protection information) and erases its data (it
//! reads as zeros after; Secure Erase Settings 000b and 001b, user data
//! erase, do the same; cryptographic erase is not offered: FNA bit 2).
//! An NSID that names no namespace gets Invalid Namespace or Format; a
//! detached (inactive) one gets zeros from Identify Namespace (00h).
//!
//! Attach and detach at run time ([`Nvme::set_attached`](super::Nvme::set_attached),
//! the API a control socket calls; no Namespace Attachment command, which
//! comes with Namespace Management): the namespace leaves (or joins) the
//! active list, I/O to it gets Invalid Namespace or Format, its NSID goes
//! to the Changed Namespace List log (04h) and, where Set Features 0Bh
//! enabled Namespace Attribute Notices (OAES bit 8), an asynchronous event
//! (notice, namespace attribute changed, log 04h) tells the host to rescan.

use super::controller::Core;
use super::queue::{status, Sqe};

/// The LBA formats Identify Namespace lists, by index: log2 of the data
/// size, metadata bytes.
pub(super) const LBA_FORMATS: [(u32, u16); 8] =
    [(9, 0), (12, 0), (9, 8), (9, 16), (9, 64), (12, 8), (12, 16), (12, 64)];

/// MC: metadata as part of an extended LBA (bit 0) or a separate buffer (bit 1).
const MC: u8 = 0b11;
/// DPC: protection information type 1 (bit 0), in the first (bit 3) or last (bit 4) 8 bytes.
const DPC: u8 = 1 | 1 << 3 | 1 << 4;

impl Core {
    /// Fills `d` with the namespace structure `cns` asks for (Err: the
    /// command's status).
    pub(super) fn identify_ns(&mut self, c: &Sqe, cns: u32, d: &mut [u8]) -> Result<(), u16> {
        match cns {
            0x00 | 0x11 => {
                let i = self.ns_allocated(c.nsid).ok_or(status::INVALID_NAMESPACE)?;
                let ns = &self.ns[i];
                if cns == 0x00 && !ns.attached {
                    return Ok(()); // inactive: zeros
                }
                let nlbas = ns.nlbas;
                d[0..8].copy_from_slice(&nlbas.to_le_bytes()); // NSZE
                d[8..16].copy_from_slice(&nlbas.to_le_bytes()); // NCAP
                d[16..24].copy_from_slice(&nlbas.to_le_bytes()); // NUSE
                d[25] = LBA_FORMATS.len() as u8 - 1; // NLBAF (0-based)
                let m = ns.meta;
                // FLBAS: the format in use, bit 4 extended LBAs.
                let f = LBA_FORMATS.iter().position(|&f| f == (ns.lba_shift, m.ms)).unwrap_or(0) as u8;
                d[26] = f | (m.ext as u8) << 4;
                d[27] = MC;
                d[28] = DPC;
                d[29] = m.pi | (m.pi_first as u8) << 3; // DPS
                                                        // DLFEAT: deallocated blocks read as zeros (001b); Write Zeroes may
                                                        // deallocate (bit 3, DEAC: Linux then sets it unless told not to unmap).
                d[33] = 0b1001;
                let (nguid, _) = self.ident.namespace_ids(c.nsid);
                d[104..120].copy_from_slice(&nguid); // NGUID; EUI64 (120..128) not reported
                for (k, &(shift, ms)) in LBA_FORMATS.iter().enumerate() {
                    // LBAFk: MS, LBADS, RP 0.
                    d[128 + 4 * k..128 + 4 * k + 2].copy_from_slice(&ms.to_le_bytes());
                    d[128 + 4 * k + 2] = shift as u8;
                }
            }
            0x02 | 0x10 => {
                // NSIDs above CDW1's, ascending, up to 1024 of them.
                if c.nsid >= 0xffff_fffe {
                    return Err(status::INVALID_NAMESPACE);
                }
                let ids = (c.nsid.saturating_add(1)..=self.ns.len() as u32)
                    .filter(|&n| cns == 0x10 || self.ns[n as usize - 1].attached)
                    .take(1024);
                for (k, id) in ids.enumerate() {
                    d[4 * k..4 * k + 4].copy_from_slice(&id.to_le_bytes());
                }
            }
            0x03 => {
                self.ns_allocated(c.nsid).ok_or(status::INVALID_NAMESPACE)?;
                // Namespace Identification Descriptors: NIDT, NIDL, 2 reserved, NID.
                let (nguid, uuid) = self.ident.namespace_ids(c.nsid);
                let mut p = 0;
                for (nidt, nid) in [(2u8, nguid), (3, uuid)] {
                    d[p] = nidt;
                    d[p + 1] = nid.len() as u8;
                    d[p + 4..p + 4 + nid.len()].copy_from_slice(&nid);
                    p += 4 + nid.len();
                }
            }
            _ => return Err(status::INVALID_FIELD),
        }
        Ok(())
    }

    /// Format NVM: namespace NSID (FFFFFFFFh: every namespace) to LBA
    /// format CDW10 bits 3:0 (MSET bit 4, PI bits 7:5, PIL bit 8), its
    /// data and metadata erased. The commands in flight on
    /// the file namespaces complete first; every queue group takes the new
    /// geometry.
    pub(super) fn format_nvm(&mut self, c: &Sqe) -> u16 {
        let (lbaf, mset, pi, ses) = (c.cdw10 & 0xf, c.cdw10 >> 4 & 1, c.cdw10 >> 5 & 7, c.cdw10 >> 9 & 7);
        let pil = c.cdw10 >> 8 & 1 != 0;
        let targets: Vec<usize> = match c.nsid {
            0xffff_ffff => (0..self.ns.len()).collect(),
            n => match self.ns_index(n) {
                Some(i) => vec![i],
                None => return status::INVALID_NAMESPACE,
            },
        };
        let Some(&(shift, ms)) = LBA_FORMATS.get(lbaf as usize) else { return status::INVALID_FORMAT };
        // Protection information: type 1 only, in metadata that holds it.
        if pi > 1 || pi == 1 && ms < 8 {
            return status::INVALID_FORMAT;
        }
        // MSET (metadata as part of the LBA) means nothing without metadata.
        let ext = mset != 0 && ms != 0;
        if ses > 1 {
            return status::INVALID_FIELD;
        }
        self.settle_io();
        if self.io_in_flight() > 0 {
            log::warn!("nvme: format: file operations still in flight; refused");
            return status::INTERNAL;
        }
        for &i in &targets {
            let bytes = self.ns[i].nlbas << self.ns[i].lba_shift;
            if !bytes.is_multiple_of(1 << shift) {
                return status::INVALID_FORMAT;
            }
            // Metadata needs the area (`meta.rs`): its blocks' MS bytes each.
            if ms != 0 && (bytes >> shift) * ms as u64 > self.ns[i].meta.area {
                return status::INVALID_FORMAT;
            }
        }
        for i in targets {
            let ns = &mut self.ns[i];
            let bytes = ns.nlbas << ns.lba_shift;
            let all = bytes + ns.meta.area;
            if let Err(e) = ns.storage.write_zeroes(0, all, true).and_then(|()| ns.storage.flush()) {
                log::warn!("nvme: format: erasing namespace {}: {e}", i + 1);
                return status::INTERNAL;
            }
            for g in 0..self.groups.max(1) {
                self.with_group(g, |k| {
                    k.ns[i].lba_shift = shift;
                    k.ns[i].nlbas = bytes >> shift;
                    let m = &mut k.ns[i].meta;
                    (m.ms, m.ext, m.pi, m.pi_first) = (ms, ext, pi as u8, pil && pi != 0);
                });
            }
        }
        status::SUCCESS
    }
}

impl Core {
    /// Attaches (or detaches) namespace `nsid` in every queue group; if that
    /// changed it, logs it and raises the notice. Group 0 only.
    pub(super) fn set_attached(&mut self, nsid: u32, attached: bool) -> crate::Result<bool> {
        let Some(i) = self.ns_allocated(nsid) else {
            let reason = format!("no namespace {nsid} (1 ..= {})", self.ns.len());
            return Err(crate::Error::Option { device: "nvme", option: "nsid".into(), reason });
        };
        if self.ns[i].attached == attached {
            return Ok(false);
        }
        for g in 0..self.groups.max(1) {
            self.with_group(g, |k| k.ns[i].attached = attached);
        }
        self.note_ns_changed(nsid);
        if self.feat.async_events & 1 << 8 != 0 {
            self.event(2, 0, 0x04); // notice: namespace attribute changed
        }
        Ok(true)
    }
}
