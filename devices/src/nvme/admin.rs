//! Admin commands: queue creation and deletion, Identify, Get/Set Features,
//! Get Log Page, Abort, Asynchronous Event Request, Doorbell Buffer Config.

use super::controller::Core;
use super::queue::{prp_segments, queue_in_ram, status, Cq, Sq, Sqe, CQE_SIZE, PAGE, SQE_SIZE};
use super::{DoorbellMode, MAX_IO_QUEUES, MDTS, MQES, MSIX_VECTORS, VENDOR};
use std::sync::atomic::Ordering;
use vm_memory::{Bytes, GuestAddress};

/// Asynchronous Event Requests outstanding at most.
const AERL: usize = 4;

impl Core {
    /// Executes an admin command: Some((dw0, status)) to complete now, None
    /// for an AER (completed when an event comes).
    pub(super) fn admin(&mut self, c: &Sqe) -> Option<(u32, u16)> {
        let r = |st| Some((0, st));
        match c.opcode {
            0x00 => r(self.delete_sq(c.cdw10 as u16)),
            0x01 => r(self.create_sq(c)),
            0x02 => r(self.get_log_page(c)),
            0x04 => r(self.delete_cq(c.cdw10 as u16)),
            0x05 => r(self.create_cq(c)),
            0x06 => r(self.identify(c)),
            0x08 => Some((1, status::SUCCESS)), // Abort: the command was not aborted
            0x09 => self.set_features(c),
            0x0a => self.get_features(c),
            0x0c => {
                if self.events.aers.len() >= AERL {
                    return r(status::AER_LIMIT_EXCEEDED);
                }
                self.events.aers.push(c.cid);
                self.deliver_events();
                None
            }
            0x7c => r(self.dbbuf_config(c)),
            _ => r(status::INVALID_OPCODE),
        }
    }

    fn create_cq(&mut self, c: &Sqe) -> u16 {
        let qid = c.cdw10 as u16 as usize;
        let size = (c.cdw10 >> 16) + 1;
        if qid == 0 || qid > self.queues.ncqa as usize || self.queues.cqs[qid].is_some() {
            return status::INVALID_QID;
        }
        if size < 2 || size > MQES as u32 {
            return status::MAX_QSIZE_EXCEEDED;
        }
        if c.cdw11 & 1 == 0 {
            return status::INVALID_FIELD; // only physically contiguous queues
        }
        let (ien, iv) = (c.cdw11 & 2 != 0, (c.cdw11 >> 16) as u16);
        if ien && iv as usize >= MSIX_VECTORS {
            return status::INVALID_INTERRUPT_VECTOR;
        }
        if !queue_in_ram(&self.mem, c.prp1, size as u64 * CQE_SIZE) {
            return status::INVALID_FIELD;
        }
        self.queues.cqs[qid] = Some(Cq { gpa: c.prp1, size: size as u16, ien, iv, ..Default::default() });
        self.queues.created = true;
        self.zero_bar_doorbell(qid, true);
        self.sync_shadow(qid, true);
        status::SUCCESS
    }

    fn create_sq(&mut self, c: &Sqe) -> u16 {
        let qid = c.cdw10 as u16 as usize;
        let size = (c.cdw10 >> 16) + 1;
        let cqid = (c.cdw11 >> 16) as usize;
        if qid == 0 || qid > self.queues.nsqa as usize || self.queues.sqs[qid].is_some() {
            return status::INVALID_QID;
        }
        if size < 2 || size > MQES as u32 {
            return status::MAX_QSIZE_EXCEEDED;
        }
        if cqid == 0 || cqid >= self.queues.cqs.len() || self.queues.cqs[cqid].is_none() {
            return status::CQ_INVALID;
        }
        if c.cdw11 & 1 == 0 {
            return status::INVALID_FIELD;
        }
        if !queue_in_ram(&self.mem, c.prp1, size as u64 * SQE_SIZE) {
            return status::INVALID_FIELD;
        }
        self.queues.sqs[qid] = Some(Sq { gpa: c.prp1, size: size as u16, head: 0, tail: 0, cqid: cqid as u16 });
        self.queues.created = true;
        self.zero_bar_doorbell(qid, false);
        self.sync_shadow(qid, false);
        self.register_doorbells(qid);
        status::SUCCESS
    }

    /// Starts a new queue's shadow doorbell at 0 and its EventIdx where the
    /// mode wants the driver's first doorbell write: nowhere (shm) or on the
    /// first submission (ioeventfd).
    fn sync_shadow(&mut self, qid: usize, cq: bool) {
        if let Some((db, ei)) = self.db.shadow {
            let off = qid as u64 * 8 + if cq { 4 } else { 0 };
            let size = if cq { self.queues.cqs[qid].map(|q| q.size) } else { self.queues.sqs[qid].map(|q| q.size) };
            // shm: behind (never ring); ioeventfd SQ: 0 (ring on the first submission).
            let ev = if self.mode() == DoorbellMode::Ioeventfd && !cq { 0 } else { size.unwrap_or(1) as u32 - 1 };
            let _ = self.mem.store(0u32, GuestAddress(db + off), Ordering::Release);
            let _ = self.mem.store(ev, GuestAddress(ei + off), Ordering::Release);
        }
    }

    fn delete_sq(&mut self, qid: u16) -> u16 {
        let q = qid as usize;
        if q == 0 || q >= self.queues.sqs.len() || self.queues.sqs[q].is_none() {
            return status::INVALID_QID;
        }
        self.queues.sqs[q] = None;
        self.zero_bar_doorbell(q, false);
        status::SUCCESS
    }

    fn delete_cq(&mut self, qid: u16) -> u16 {
        let q = qid as usize;
        if q == 0 || q >= self.queues.cqs.len() || self.queues.cqs[q].is_none() {
            return status::INVALID_QID;
        }
        if self.queues.sqs.iter().flatten().any(|s| s.cqid == qid) {
            return status::INVALID_QUEUE_DELETION;
        }
        self.queues.cqs[q] = None;
        self.zero_bar_doorbell(q, true);
        status::SUCCESS
    }

    /// Copies `data` to the command's PRPs.
    fn copy_to_guest(&mut self, c: &Sqe, data: &[u8]) -> u16 {
        let mut segs = std::mem::take(&mut self.scratch.segs);
        let r = match prp_segments(&self.mem, c.prp1, c.prp2, data.len() as u64, &mut segs) {
            Ok(()) => {
                let mut done = 0usize;
                let mut st = status::SUCCESS;
                for &(a, n) in &segs {
                    if self.mem.write_slice(&data[done..done + n as usize], GuestAddress(a)).is_err() {
                        st = status::DATA_TRANSFER_ERROR;
                        break;
                    }
                    done += n as usize;
                }
                st
            }
            Err(st) => st,
        };
        self.scratch.segs = segs;
        r
    }

    fn identify(&mut self, c: &Sqe) -> u16 {
        let cns = c.cdw10 & 0xff;
        let mut d = vec![0u8; 4096];
        match cns {
            0x00 => {
                if c.nsid != 1 {
                    return status::INVALID_NAMESPACE;
                }
                let nlbas = self.ns.nlbas;
                d[0..8].copy_from_slice(&nlbas.to_le_bytes()); // NSZE
                d[8..16].copy_from_slice(&nlbas.to_le_bytes()); // NCAP
                d[16..24].copy_from_slice(&nlbas.to_le_bytes()); // NUSE
                d[25] = 0; // NLBAF: one format
                d[26] = 0; // FLBAS: format 0
                d[33] = 1; // DLFEAT: deallocated blocks read as zeros
                           // LBAF0: MS 0, LBADS, RP 0
                d[128 + 2] = self.ns.lba_shift as u8;
            }
            0x01 => {
                d[0..2].copy_from_slice(&VENDOR.to_le_bytes());
                d[2..4].copy_from_slice(&VENDOR.to_le_bytes());
                d[4..24].copy_from_slice(b"IOPATH0000000000001 ");
                d[24..64].copy_from_slice(format!("{:<40}", "iopath NVMe controller").as_bytes());
                d[64..72].copy_from_slice(b"1.0     ");
                d[77] = MDTS;
                d[78..80].copy_from_slice(&1u16.to_le_bytes()); // CNTLID
                d[80..84].copy_from_slice(&0x0001_0400u32.to_le_bytes()); // VER 1.4
                d[111] = 1; // CNTRLTYPE: I/O controller
                            // OACS: Doorbell Buffer Config only where shadow doorbells are served.
                let shadow = matches!(self.mode(), DoorbellMode::Shm | DoorbellMode::Ioeventfd);
                let oacs: u16 = if shadow { 1 << 8 } else { 0 };
                d[256..258].copy_from_slice(&oacs.to_le_bytes());
                d[258] = 3; // ACL (0-based)
                d[259] = (AERL - 1) as u8; // AERL (0-based)
                d[260] = 0x02; // FRMW: slot 1 read-only
                d[261] = 0x02; // LPA: command effects... log page attributes
                d[262] = 0; // ELPE
                d[512] = 0x66; // SQES: 64 bytes
                d[513] = 0x44; // CQES: 16 bytes
                d[516..520].copy_from_slice(&1u32.to_le_bytes()); // NN
                let oncs: u16 = (1 << 2) | (1 << 3); // DSM, Write Zeroes
                d[520..522].copy_from_slice(&oncs.to_le_bytes());
                d[525] = 1; // VWC present
            }
            0x02 => {
                if c.nsid < 1 {
                    d[0..4].copy_from_slice(&1u32.to_le_bytes());
                }
            }
            _ => return status::INVALID_FIELD,
        }
        self.copy_to_guest(c, &d)
    }

    fn set_features(&mut self, c: &Sqe) -> Option<(u32, u16)> {
        let fid = c.cdw10 & 0xff;
        Some(match fid {
            0x07 => {
                if self.queues.created {
                    return Some((0, status::COMMAND_SEQUENCE_ERROR));
                }
                let nsqr = (c.cdw11 & 0xffff) as u16;
                let ncqr = (c.cdw11 >> 16) as u16;
                if nsqr == 0xffff || ncqr == 0xffff {
                    return Some((0, status::INVALID_FIELD));
                }
                let q = &mut self.queues;
                q.nsqa = (nsqr + 1).min(MAX_IO_QUEUES);
                q.ncqa = (ncqr + 1).min(MAX_IO_QUEUES);
                (((q.ncqa - 1) as u32) << 16 | (q.nsqa - 1) as u32, status::SUCCESS)
            }
            0x08 => {
                self.intr.coalescing = c.cdw11 & 0xffff;
                self.flush_coalesced_now();
                (0, status::SUCCESS)
            }
            0x01 | 0x02 | 0x04 | 0x05 | 0x06 | 0x09 | 0x0a | 0x0b => (0, status::SUCCESS),
            _ => (0, status::INVALID_FIELD),
        })
    }

    fn get_features(&mut self, c: &Sqe) -> Option<(u32, u16)> {
        let fid = c.cdw10 & 0xff;
        let q = &self.queues;
        Some(match fid {
            0x07 => (((q.ncqa - 1) as u32) << 16 | (q.nsqa - 1) as u32, status::SUCCESS),
            0x08 => (self.intr.coalescing, status::SUCCESS),
            0x01 | 0x02 | 0x04 | 0x05 | 0x06 | 0x09 | 0x0a | 0x0b => (0, status::SUCCESS),
            _ => (0, status::INVALID_FIELD),
        })
    }

    fn get_log_page(&mut self, c: &Sqe) -> u16 {
        let lid = c.cdw10 & 0xff;
        let numd = ((c.cdw10 >> 16) | (c.cdw11 & 0xffff) << 16) as u64 + 1;
        let len = (numd * 4) as usize;
        if len > (PAGE << MDTS) as usize {
            return status::INVALID_FIELD;
        }
        let mut page = match lid {
            0x01 => vec![0u8; 64], // error information: no entries kept
            0x02 => {
                let mut s = vec![0u8; 512];
                s[1..3].copy_from_slice(&313u16.to_le_bytes()); // composite temperature, K
                s[3] = 100; // available spare
                s[4] = 10; // threshold
                s[32..40].copy_from_slice(&self.smart.read_units.div_ceil(1000).to_le_bytes());
                s[48..56].copy_from_slice(&self.smart.write_units.div_ceil(1000).to_le_bytes());
                s[64..72].copy_from_slice(&self.st.reads.to_le_bytes());
                s[80..88].copy_from_slice(&self.st.writes.to_le_bytes());
                s
            }
            0x03 => {
                let mut f = vec![0u8; 512];
                f[0] = 1;
                f[8..16].copy_from_slice(b"1.0     ");
                f
            }
            _ => return status::INVALID_LOG_PAGE,
        };
        page.resize(len, 0);
        let st = self.copy_to_guest(c, &page);
        if st == status::SUCCESS && c.cdw10 & 1 << 15 == 0 {
            self.log_page_read(lid as u8);
        }
        st
    }

    /// Doorbell Buffer Config (shm, ioeventfd): the shadow doorbell and
    /// EventIdx pages; existing queues' values are copied into them.
    fn dbbuf_config(&mut self, c: &Sqe) -> u16 {
        if !matches!(self.mode(), DoorbellMode::Shm | DoorbellMode::Ioeventfd) {
            return status::INVALID_OPCODE;
        }
        if !queue_in_ram(&self.mem, c.prp1, PAGE) || !queue_in_ram(&self.mem, c.prp2, PAGE) {
            return status::INVALID_FIELD;
        }
        self.db.shadow = Some((c.prp1, c.prp2));
        for qid in 1..self.queues.sqs.len() {
            if self.queues.sqs[qid].is_some() || self.queues.cqs[qid].is_some() {
                self.register_doorbells(qid);
            }
            if let Some(sq) = self.queues.sqs[qid] {
                let _ = self.mem.store(sq.tail as u32, GuestAddress(c.prp1 + qid as u64 * 8), Ordering::Release);
            }
            if let Some(cq) = self.queues.cqs[qid] {
                let _ = self.mem.store(cq.head as u32, GuestAddress(c.prp1 + qid as u64 * 8 + 4), Ordering::Release);
            }
        }
        status::SUCCESS
    }
}
