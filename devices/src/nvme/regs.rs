//! The controller registers (CAP, VS, INTMS/INTMC, CC, CSTS, AQA, ASQ,
//! ACQ) and what CC does: enable (admin queues from AQA/ASQ/ACQ), disable
//! (every queue dropped) and shutdown (CSTS.SHST reports it complete).

use super::controller::Core;
use super::queue::{queue_in_ram, Cq, Sq, CQE_SIZE, SQE_SIZE};
use super::{Nvme, DOORBELLS, MAX_IO_QUEUES, MQES};
use vm_memory::{Bytes, GuestAddress};

pub(super) const REG_INTMS: u64 = 0x0c;
pub(super) const REG_INTMC: u64 = 0x10;
pub(super) const REG_CC: u64 = 0x14;
pub(super) const REG_AQA: u64 = 0x24;
pub(super) const REG_ASQ: u64 = 0x28;
pub(super) const REG_ACQ: u64 = 0x30;
/// NVMe 1.4.
const VS: u32 = 0x0001_0400;

/// The registers the guest programs and the controller reports.
#[derive(Default)]
pub(super) struct Regs {
    pub cc: u32,
    pub csts: u32,
    pub aqa: u32,
    pub asq: u64,
    pub acq: u64,
    pub intms: u32,
}

/// Controller Capabilities.
pub(super) fn cap() -> u64 {
    let mqes = (MQES - 1) as u64;
    let cqr = 1u64 << 16;
    let to = 20u64 << 24; // 10 s
    let css_nvm = 1u64 << 37;
    mqes | cqr | to | css_nvm // DSTRD 0, MPSMIN = MPSMAX = 0 (4 KiB)
}

impl Regs {
    /// The register file 0..0x38 as a driver reads it.
    pub fn image(&self) -> [u8; 0x38] {
        let mut r = [0u8; 0x38];
        r[0..8].copy_from_slice(&cap().to_le_bytes());
        r[8..12].copy_from_slice(&VS.to_le_bytes());
        r[0x0c..0x10].copy_from_slice(&self.intms.to_le_bytes());
        r[0x10..0x14].copy_from_slice(&self.intms.to_le_bytes());
        r[0x14..0x18].copy_from_slice(&self.cc.to_le_bytes());
        r[0x1c..0x20].copy_from_slice(&self.csts.to_le_bytes());
        r[0x24..0x28].copy_from_slice(&self.aqa.to_le_bytes());
        r[0x28..0x30].copy_from_slice(&self.asq.to_le_bytes());
        r[0x30..0x38].copy_from_slice(&self.acq.to_le_bytes());
        r
    }

    /// A write of `len` bytes of value `v` to any register but CC (which
    /// [`Nvme::write_cc`] takes); read-only and reserved ones ignore it.
    pub fn write(&mut self, offset: u64, len: usize, v: u64) {
        match (offset, len) {
            (REG_INTMS, 4) => self.intms |= v as u32,
            (REG_INTMC, 4) => self.intms &= !(v as u32),
            (REG_AQA, 4) => self.aqa = v as u32 & 0x0fff_0fff,
            (REG_ASQ, 8) => self.asq = v & !0xfff,
            (REG_ACQ, 8) => self.acq = v & !0xfff,
            (REG_ASQ, 4) | (REG_ACQ, 4) => {
                let r = if offset == REG_ASQ { &mut self.asq } else { &mut self.acq };
                *r = (*r & !0xffff_ffff) | (v & 0xffff_f000);
            }
            (o, 4) if o == REG_ASQ + 4 || o == REG_ACQ + 4 => {
                let r = if o == REG_ASQ + 4 { &mut self.asq } else { &mut self.acq };
                *r = (*r & 0xffff_ffff) | v << 32;
            }
            _ => {} // read-only (CAP, VS, CSTS) or reserved
        }
    }
}

impl Nvme {
    /// CC: EN 0 -> 1 enables (and starts the device thread), 1 -> 0 stops
    /// the thread and drops every queue; SHN reports shutdown complete.
    pub(super) fn write_cc(&self, v: u32) {
        let mut threads = crate::lock(&self.threads);
        let was = crate::lock(&self.core).regs.cc & 1;
        let en = v & 1;
        let disable = was == 1 && en == 0;
        if disable {
            self.stop_threads(&mut threads);
        }
        let started = {
            let mut c = crate::lock(&self.core);
            if disable {
                c.reset_queues();
            }
            c.regs.cc = v;
            if v >> 14 & 3 != 0 {
                c.regs.csts = (c.regs.csts & !0xc) | 0x8; // shutdown complete
            }
            let started = if was == 0 && en == 1 {
                c.enable()
            } else {
                if en == 0 {
                    c.regs.csts &= !1;
                }
                false
            };
            c.sync_shards();
            c.commit_state(None); // `state/`
            started
        };
        if started {
            self.start_threads(&mut threads);
        }
    }
}

impl Core {
    /// CC.EN 0 -> 1: checks CC and the admin queues, sets CSTS.RDY, or
    /// CSTS.CFS when they are unusable. True when enabled.
    pub(super) fn enable(&mut self) -> bool {
        let r = &self.regs;
        let asqs = (r.aqa & 0xfff) + 1;
        let acqs = ((r.aqa >> 16) & 0xfff) + 1;
        let mps = r.cc >> 7 & 0xf;
        let iosqes = r.cc >> 16 & 0xf;
        let iocqes = r.cc >> 20 & 0xf;
        let css = r.cc >> 4 & 7;
        let ok = asqs >= 2
            && acqs >= 2
            && mps == 0
            && css == 0
            && (iosqes == 0 || iosqes == 6)
            && (iocqes == 0 || iocqes == 4)
            && queue_in_ram(&self.mem, r.asq, asqs as u64 * SQE_SIZE)
            && queue_in_ram(&self.mem, r.acq, acqs as u64 * CQE_SIZE);
        if !ok {
            log::warn!("nvme: enable refused: AQA {:#x} ASQ {:#x} ACQ {:#x} CC {:#x}", r.aqa, r.asq, r.acq, r.cc);
            self.regs.csts |= 2; // controller fatal status
            return false;
        }
        self.queues.set_sq(0, Some(Sq { gpa: r.asq, size: asqs as u16, ..Default::default() }));
        // The admin CQ always interrupts, on vector 0.
        self.queues.cqs[0] = Some(Cq { gpa: r.acq, size: acqs as u16, ien: true, iv: 0, ..Default::default() });
        self.queues.resolve(&self.mem);
        self.regs.csts = 1;
        true
    }

    /// Controller disable (or reset): every queue, the commands out on the
    /// file namespace (aborted, and waited for), the shadow doorbells,
    /// outstanding AERs and events, held interrupts and CSTS go; the
    /// features Set Features keeps return to their defaults. Aborted file
    /// operations that would not finish leave CSTS.CFS set (the host resets
    /// again) rather than a controller that looks idle.
    pub(super) fn reset_queues(&mut self) {
        let idle = self.abort_io();
        self.forget_queue(None); // injected drops, timed completions
        if let Some(page) = &self.db.bar_page {
            let _ = page.write_slice(&[0u8; 4096], GuestAddress(DOORBELLS));
        }
        let q = &mut self.queues;
        q.clear_sqs();
        q.cqs.iter_mut().for_each(|q| *q = None);
        self.db.shadow = None;
        self.events.aers.clear();
        self.events.queued.clear();
        self.events.outstanding = [None; 8];
        self.feat = super::admin::Features::new();
        q.created = false;
        self.intr.clear_held();
        q.nsqa = MAX_IO_QUEUES;
        q.ncqa = MAX_IO_QUEUES;
        self.regs.csts = if idle { 0 } else { 2 };
        // The other queue groups' queues, aggregation and events (their pollers are stopped).
        for s in self.shards.clone() {
            let mut s = crate::lock(&s);
            s.queues.clear_sqs();
            s.queues.cqs.iter_mut().for_each(|q| *q = None);
            s.db.shadow = None;
            s.intr.clear_held();
            s.forget_queue(None);
            s.flight.owed.iter_mut().for_each(|o| *o = 0);
        }
        self.raised.take_all();
        self.sync_shards();
    }
}
