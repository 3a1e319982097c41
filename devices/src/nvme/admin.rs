//! Admin commands: queue creation and deletion, Identify, Get/Set Features,
//! Get Log Page, Abort, Asynchronous Event Request, Doorbell Buffer Config.
//! Identify's namespace structures and Format NVM: `ns_admin.rs`.

use super::controller::Core;
use super::queue::{self, prp_segments, queue_in_ram, status, Cq, Sq, Sqe, CQE_SIZE, PAGE, SQE_SIZE};
use super::{MAX_IO_QUEUES, MDTS, MQES, MSIX_VECTORS, VENDOR};
use std::sync::atomic::Ordering;

/// Asynchronous Event Requests outstanding at most.
const AERL: usize = 4;
/// Firmware revision (Identify Controller FR, firmware slot 1).
const FIRMWARE: &[u8; 8] = b"1.0     ";
/// Admin opcodes implemented (Doorbell Buffer Config, 0x7c, only where shadow
/// doorbells are served): what `admin` dispatches and the effects log lists.
const ADMIN_OPCODES: [u8; 11] = [0x00, 0x01, 0x02, 0x04, 0x05, 0x06, 0x08, 0x09, 0x0a, 0x0c, 0x80];
/// I/O opcodes implemented (`io`), and those that change LBA contents.
const IO_OPCODES: [u8; 5] = [0x00, 0x01, 0x02, 0x08, 0x09];
pub(super) const IO_LBA_CHANGING: [u8; 3] = [0x01, 0x08, 0x09];
/// Warning and critical composite temperature thresholds (Kelvin); the
/// SMART log reports 313 K.
const WCTEMP: u16 = 343;
const CCTEMP: u16 = 373;
const TEMPERATURE: u16 = 313;

/// The features Set Features keeps (Number of Queues and Interrupt
/// Coalescing live with the queues and the interrupts). Back to these
/// defaults on a controller reset.
#[derive(Clone)]
pub(super) struct Features {
    /// Arbitration (FID 01h) as set.
    pub arbitration: u32,
    /// Power Management (02h): workload hint; the one power state is 0.
    pub power: u32,
    /// Temperature Threshold (04h): composite sensor, over and under.
    pub temp_over: u16,
    pub temp_under: u16,
    /// Error Recovery (05h): TLER.
    pub error_recovery: u32,
    /// Volatile Write Cache (06h): enabled; off, every LBA-changing command
    /// is flushed before it completes.
    pub write_cache: bool,
    /// Interrupt Vector Configuration (09h): Coalescing Disable per vector.
    pub coalescing_off: Vec<bool>,
    /// Write Atomicity Normal (0Ah).
    pub write_atomicity: u32,
    /// Asynchronous Event Configuration (0Bh): SMART warnings to report.
    pub async_events: u32,
}

impl Features {
    pub fn new() -> Self {
        Features {
            arbitration: 0,
            power: 0,
            temp_over: WCTEMP,
            temp_under: 0,
            error_recovery: 0,
            write_cache: true,
            coalescing_off: vec![false; MSIX_VECTORS],
            write_atomicity: 0,
            async_events: 0,
        }
    }
}

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
            // Abort: a command injection withheld is aborted; any other was not.
            0x08 => self.abort_withheld(c).or(Some((1, status::SUCCESS))),
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
            0x80 => r(self.format_nvm(c)),
            // Anything else is not implemented: not in ADMIN_OPCODES (the effects log).
            _ => r(status::INVALID_OPCODE),
        }
    }

    fn create_cq(&mut self, c: &Sqe) -> u16 {
        let qid = c.cdw10 as u16 as usize;
        let size = (c.cdw10 >> 16) + 1;
        // The queue's group (`shards.rs`; the only one with one poller) holds it.
        let g = self.cq_group(qid);
        if qid == 0 || qid > self.queues.ncqa as usize || self.with_group(g, |c| c.queues.cqs[qid].is_some()) {
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
        let prp1 = c.prp1;
        self.queues.created = true;
        self.with_group(g, |c| {
            let mut cq = Cq { gpa: prp1, size: size as u16, ien, iv, ..Default::default() };
            cq.resolve(&c.mem);
            c.queues.cqs[qid] = Some(cq);
            c.zero_bar_doorbell(qid, true);
            c.sync_shadow(qid, true);
        });
        status::SUCCESS
    }

    fn create_sq(&mut self, c: &Sqe) -> u16 {
        let qid = c.cdw10 as u16 as usize;
        let size = (c.cdw10 >> 16) + 1;
        let cqid = (c.cdw11 >> 16) as usize;
        if qid == 0 || qid > self.queues.nsqa as usize || self.sq_group(qid).is_some() {
            return status::INVALID_QID;
        }
        if size < 2 || size > MQES as u32 {
            return status::MAX_QSIZE_EXCEEDED;
        }
        // The SQ goes to its CQ's group (`shards.rs`).
        let g = self.cq_group(cqid);
        if cqid == 0 || cqid >= self.queues.cqs.len() || self.with_group(g, |c| c.queues.cqs[cqid].is_none()) {
            return status::CQ_INVALID;
        }
        if c.cdw11 & 1 == 0 {
            return status::INVALID_FIELD;
        }
        if !queue_in_ram(&self.mem, c.prp1, size as u64 * SQE_SIZE) {
            return status::INVALID_FIELD;
        }
        let mut sq = Sq { gpa: c.prp1, size: size as u16, cqid: cqid as u16, ..Default::default() };
        sq.resolve(&self.mem);
        self.queues.created = true;
        self.with_group(g, |c| {
            c.queues.set_sq(qid, Some(sq));
            c.zero_bar_doorbell(qid, false);
            c.sync_shadow(qid, false);
            // On that group's eventfd (adaptive: it wakes that group's poller).
            c.register_doorbells(qid);
        });
        status::SUCCESS
    }

    /// Starts a new queue's shadow doorbell at 0 and its EventIdx where the
    /// mode wants the driver's first doorbell write: nowhere (shm) or on the
    /// first submission (ioeventfd).
    pub(super) fn sync_shadow(&mut self, qid: usize, cq: bool) {
        if let Some((db, ei)) = self.db.shadow {
            let off = qid as u64 * 8 + if cq { 4 } else { 0 };
            let size = if cq { self.queues.cqs[qid].map(|q| q.size) } else { self.queues.sqs[qid].map(|q| q.size) };
            // shm: behind (never ring); ioeventfd SQ: 0 (ring on the first submission).
            let ev = if self.mode().kicked() && !cq { 0 } else { size.unwrap_or(1) as u32 - 1 };
            let _ = self.mem.store_u32(0, db + off, Ordering::Release);
            let _ = self.mem.store_u32(ev, ei + off, Ordering::Release);
        }
    }

    fn delete_sq(&mut self, qid: u16) -> u16 {
        let q = qid as usize;
        if q == 0 || q >= self.queues.sqs.len() {
            return status::INVALID_QID;
        }
        let Some(g) = self.sq_group(q) else { return status::INVALID_QID };
        self.with_group(g, |c| {
            c.forget_queue(Some(qid)); // injected drops, timed completions
            c.queues.set_sq(q, None);
            c.zero_bar_doorbell(q, false);
            c.unregister_doorbell(q, false);
        });
        status::SUCCESS
    }

    fn delete_cq(&mut self, qid: u16) -> u16 {
        let q = qid as usize;
        if q == 0 || q >= self.queues.cqs.len() {
            return status::INVALID_QID;
        }
        // Its SQs are in its group, as it is.
        let g = self.cq_group(q);
        self.with_group(g, |c| {
            if c.queues.cqs[q].is_none() {
                return status::INVALID_QID;
            }
            if c.queues.sqs.iter().flatten().any(|s| s.cqid == qid) {
                return status::INVALID_QUEUE_DELETION;
            }
            c.queues.cqs[q] = None;
            c.zero_bar_doorbell(q, true);
            c.unregister_doorbell(q, true);
            status::SUCCESS
        })
    }

    /// Copies `data` to the command's PRPs.
    pub(super) fn copy_to_guest(&mut self, c: &Sqe, data: &[u8]) -> u16 {
        let mut segs = std::mem::take(&mut self.scratch.segs);
        let r = match prp_segments(&self.mem, c.prp1, c.prp2, data.len() as u64, &mut segs) {
            Ok(()) => {
                let mut done = 0usize;
                let mut st = status::SUCCESS;
                for &(a, n) in &segs {
                    if self.mem.write_slice(&data[done..done + n as usize], a).is_err() {
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
            0x01 => {
                d[0..2].copy_from_slice(&VENDOR.to_le_bytes());
                d[2..4].copy_from_slice(&VENDOR.to_le_bytes());
                d[4..24].copy_from_slice(&self.ident.serial);
                d[24..64].copy_from_slice(format!("{:<40}", "iopath NVMe controller").as_bytes());
                d[64..72].copy_from_slice(FIRMWARE);
                d[77] = MDTS;
                d[78..80].copy_from_slice(&self.ident.cntlid.to_le_bytes()); // CNTLID
                d[80..84].copy_from_slice(&0x0001_0400u32.to_le_bytes()); // VER 1.4
                d[111] = 1; // CNTRLTYPE: I/O controller
                d[256..258].copy_from_slice(&self.oacs().to_le_bytes());
                d[258] = 3; // ACL (0-based)
                d[259] = (AERL - 1) as u8; // AERL (0-based)
                d[260] = 0b11; // FRMW: one slot, read-only (no Firmware Download or Commit)
                d[261] = 0b110; // LPA: Commands Supported and Effects log, extended data (NUMDU, LPOL/LPOU)
                d[262] = super::inject::ERROR_LOG_ENTRIES as u8 - 1; // ELPE (0's based)
                d[266..268].copy_from_slice(&WCTEMP.to_le_bytes());
                d[268..270].copy_from_slice(&CCTEMP.to_le_bytes());
                d[512] = 0x66; // SQES: 64 bytes
                d[513] = 0x44; // CQES: 16 bytes
                d[516..520].copy_from_slice(&(self.ns.len() as u32).to_le_bytes()); // NN
                d[524] = 0; // FNA: Format NVM per namespace, no cryptographic erase
                d[92..96].copy_from_slice(&(1u32 << 8).to_le_bytes()); // OAES: Namespace Attribute Notices
                let oncs: u16 = (1 << 2) | (1 << 3); // DSM, Write Zeroes
                d[520..522].copy_from_slice(&oncs.to_le_bytes());
                d[525] = 1; // VWC present (Set Features 06h turns it off)
                let nqn = self.ident.nqn.as_bytes();
                let n = nqn.len().min(super::identity::NQN_MAX); // validated: never cut
                d[768..768 + n].copy_from_slice(&nqn[..n]); // SUBNQN, NUL-terminated
            }
            // Namespace structures: Identify Namespace (00h, and 11h for an
            // allocated NSID), the active and allocated lists (02h, 10h), the
            // descriptors (03h).
            0x00 | 0x02 | 0x03 | 0x10 | 0x11 => {
                if let Err(st) = self.identify_ns(c, cns, &mut d) {
                    return st;
                }
            }
            _ => return status::INVALID_FIELD,
        }
        self.copy_to_guest(c, &d)
    }

    /// Optional Admin Command Support: Format NVM; Doorbell Buffer Config
    /// only where shadow doorbells are served.
    fn oacs(&self) -> u16 {
        let format = 1 << 1;
        if self.shadow_mode() {
            format | 1 << 8
        } else {
            format
        }
    }

    fn shadow_mode(&self) -> bool {
        self.mode().shadowed()
    }

    fn set_features(&mut self, c: &Sqe) -> Option<(u32, u16)> {
        let fid = c.cdw10 & 0xff;
        if c.cdw10 & 1 << 31 != 0 {
            return Some((0, status::FEATURE_NOT_SAVEABLE)); // no Save (ONCS bit 4)
        }
        let v = c.cdw11;
        let f = &mut self.feat;
        let ok = (0, status::SUCCESS);
        let invalid = Some((0, status::INVALID_FIELD));
        Some(match fid {
            0x01 => {
                f.arbitration = v & 0xffff_ff07;
                ok
            }
            0x02 => {
                if v & 0x1f != 0 {
                    return invalid; // power state 0 is the only one (NPSS 0)
                }
                f.power = v & 0xe0;
                ok
            }
            0x04 => {
                let (tmpth, tmpsel, thsel) = (v as u16, v >> 16 & 0xf, v >> 20 & 3);
                if !matches!(tmpsel, 0 | 0xf) || thsel > 1 {
                    return invalid; // the composite temperature is the only sensor
                }
                *if thsel == 0 { &mut f.temp_over } else { &mut f.temp_under } = tmpth;
                ok
            }
            0x05 => {
                if v & 1 << 16 != 0 {
                    return invalid; // no DULBE (NSFEAT bit 2)
                }
                f.error_recovery = v & 0xffff;
                ok
            }
            0x06 => {
                f.write_cache = v & 1 != 0;
                ok
            }
            0x07 => {
                if self.queues.created {
                    return Some((0, status::COMMAND_SEQUENCE_ERROR));
                }
                let nsqr = (c.cdw11 & 0xffff) as u16;
                let ncqr = (c.cdw11 >> 16) as u16;
                if nsqr == 0xffff || ncqr == 0xffff {
                    return invalid;
                }
                let q = &mut self.queues;
                q.nsqa = (nsqr + 1).min(MAX_IO_QUEUES);
                q.ncqa = (ncqr + 1).min(MAX_IO_QUEUES);
                (((q.ncqa - 1) as u32) << 16 | (q.nsqa - 1) as u32, status::SUCCESS)
            }
            0x08 => {
                self.intr.coalescing = c.cdw11 & 0xffff;
                self.flush_coalesced_now();
                ok
            }
            0x09 => {
                let Some(cd) = f.coalescing_off.get_mut((v & 0xffff) as usize) else { return invalid };
                *cd = v & 1 << 16 != 0;
                ok
            }
            0x0a => {
                f.write_atomicity = v & 1;
                ok
            }
            0x0b => {
                // SMART warnings (7:0), Namespace Attribute Notices (8).
                f.async_events = v & 0x1ff;
                ok
            }
            _ => return invalid,
        })
    }

    fn get_features(&mut self, c: &Sqe) -> Option<(u32, u16)> {
        let fid = c.cdw10 & 0xff;
        let (q, f) = (&self.queues, &self.feat);
        let v = match fid {
            0x01 => f.arbitration,
            0x02 => f.power,
            0x04 => {
                let (tmpsel, thsel) = (c.cdw11 >> 16 & 0xf, c.cdw11 >> 20 & 3);
                match (tmpsel, thsel) {
                    (0, 0) => f.temp_over as u32,
                    (0, 1) => f.temp_under as u32,
                    _ => return Some((0, status::INVALID_FIELD)),
                }
            }
            0x05 => f.error_recovery,
            0x06 => f.write_cache as u32,
            0x07 => ((q.ncqa - 1) as u32) << 16 | (q.nsqa - 1) as u32,
            0x08 => self.intr.coalescing,
            0x09 => {
                let iv = c.cdw11 & 0xffff;
                let Some(&cd) = f.coalescing_off.get(iv as usize) else { return Some((0, status::INVALID_FIELD)) };
                iv | (cd as u32) << 16
            }
            0x0a => f.write_atomicity,
            0x0b => f.async_events,
            _ => return Some((0, status::INVALID_FIELD)),
        };
        Some((v, status::SUCCESS))
    }

    /// Get Log Page: NUMD dwords (NUMDL, NUMDU) from byte offset LPOL/LPOU,
    /// which must be dword aligned and inside the page; bytes past the end
    /// of the page read as zeros. Without RAE, reading a page clears the
    /// asynchronous events it reports.
    fn get_log_page(&mut self, c: &Sqe) -> u16 {
        let lid = c.cdw10 & 0xff;
        let numd = ((c.cdw10 >> 16) | (c.cdw11 & 0xffff) << 16) as u64 + 1;
        let len = (numd * 4) as usize;
        if len > (PAGE << MDTS) as usize {
            return status::INVALID_FIELD;
        }
        let page = match lid {
            0x01 => self.error_log_page(), // the injected errors (`inject.rs`)
            0x02 => {
                // Controller-wide only (LPA bit 0 clear): NSID 0h or FFFFFFFFh.
                if !matches!(c.nsid, 0 | 0xffff_ffff) {
                    return status::INVALID_FIELD;
                }
                let mut s = vec![0u8; 512];
                let f = &self.feat;
                if TEMPERATURE > f.temp_over || TEMPERATURE < f.temp_under {
                    s[0] |= 1 << 1; // critical warning: temperature
                }
                s[0] |= self.injected_warning();
                s[1..3].copy_from_slice(&TEMPERATURE.to_le_bytes()); // composite temperature, K
                s[3] = 100; // available spare
                s[4] = 10; // threshold

                // Every queue group's (one with a single poller).
                let (st, smart, _, _) = self.totals();
                s[32..40].copy_from_slice(&smart.read_units.div_ceil(1000).to_le_bytes());
                s[48..56].copy_from_slice(&smart.write_units.div_ceil(1000).to_le_bytes());
                s[64..72].copy_from_slice(&st.reads.to_le_bytes());
                s[80..88].copy_from_slice(&st.writes.to_le_bytes());
                s[176..184].copy_from_slice(&self.error_count().to_le_bytes()); // error log entries, lifetime
                s
            }
            0x03 => {
                let mut f = vec![0u8; 512];
                f[0] = 1; // AFI: slot 1 active
                f[8..16].copy_from_slice(FIRMWARE);
                f
            }
            0x04 => self.changed_ns_page(c.cdw10 & 1 << 15 == 0),
            0x05 => self.effects_log(),
            _ => return status::INVALID_LOG_PAGE,
        };
        let off = c.cdw12 as u64 | (c.cdw13 as u64) << 32;
        if !off.is_multiple_of(4) || off > page.len() as u64 {
            return status::INVALID_FIELD;
        }
        let mut data = page[off as usize..].to_vec();
        data.resize(len, 0);
        let st = self.copy_to_guest(c, &data);
        if st == status::SUCCESS && c.cdw10 & 1 << 15 == 0 {
            self.log_page_read(lid as u8);
        }
        st
    }

    /// Commands Supported and Effects (log page 05h): a dword per admin
    /// opcode, then per I/O opcode; CSUPP for each one implemented, LBCC for
    /// those that change LBA contents.
    fn effects_log(&self) -> Vec<u8> {
        let mut log = vec![0u8; 4096];
        let mut set = |i: usize, v: u32| log[4 * i..4 * i + 4].copy_from_slice(&v.to_le_bytes());
        for op in ADMIN_OPCODES {
            set(op as usize, 1);
        }
        // Format NVM: changes LBA contents and the namespace's capability (its
        // LBA size); no other command to the namespace while it runs (CSE 001b).
        set(0x80, 0b111 | 1 << 16);
        if self.shadow_mode() {
            set(0x7c, 1);
        }
        for op in IO_OPCODES {
            set(256 + op as usize, if IO_LBA_CHANGING.contains(&op) { 0b11 } else { 1 });
        }
        log
    }

    /// Doorbell Buffer Config (shm, ioeventfd): the shadow doorbell and
    /// EventIdx pages; existing queues' values are copied into them.
    ///
    /// Both pages must be mapped memory: the device polls the shadow
    /// doorbells, which in memory reached by message (a vfio-user client's
    /// RAM without an fd) would be a DMA_READ per look, forever. There the
    /// command fails with Invalid Field, and a driver goes on with MMIO
    /// doorbells (Linux logs "unable to set dbbuf"): the controller then
    /// serves doorbell writes as in `mmio`.
    fn dbbuf_config(&mut self, c: &Sqe) -> u16 {
        if !self.shadow_mode() {
            return status::INVALID_OPCODE;
        }
        if !queue_in_ram(&self.mem, c.prp1, PAGE) || !queue_in_ram(&self.mem, c.prp2, PAGE) {
            return status::INVALID_FIELD;
        }
        if !self.mem.range_mapped(c.prp1, PAGE) || !self.mem.range_mapped(c.prp2, PAGE) {
            log::warn!("nvme: Doorbell Buffer Config refused: the shadow doorbells are not in mapped guest memory");
            return status::INVALID_FIELD;
        }
        self.db.shadow = Some((c.prp1, c.prp2));
        self.st.dbbuf_configs += 1;
        // Every queue group's queues (`sync_shards` gives the groups the buffer).
        for g in 0..self.groups.max(1) {
            self.with_group(g, |k| {
                k.db.shadow = Some((c.prp1, c.prp2));
                for qid in 1..k.queues.sqs.len() {
                    if k.queues.sqs[qid].is_some() || k.queues.cqs[qid].is_some() {
                        k.register_doorbells(qid);
                    }
                }
                // Queues that exist already: the shadow starts at their tail and
                // head, and EventIdx is set as for a new queue, from there (the
                // page holds whatever the driver left): behind, or, where a
                // doorbell kick is how work arrives, at the tail, so that the next
                // submission rings and wakes a poller asleep since before.
                let kicked = k.mode().kicked();
                for qid in 1..k.queues.sqs.len() {
                    let at = |off: u64| qid as u64 * 8 + off;
                    if let Some(sq) = k.queues.sqs[qid] {
                        let ev = if kicked { sq.tail as u32 } else { queue::prev(sq.tail as u32, sq.size as u32) };
                        let _ = k.mem.store_u32(sq.tail as u32, c.prp1 + at(0), Ordering::Release);
                        let _ = k.mem.store_u32(ev, c.prp2 + at(0), Ordering::Release);
                    }
                    if let Some(cq) = k.queues.cqs[qid] {
                        let ev = queue::prev(cq.head as u32, cq.size as u32);
                        let _ = k.mem.store_u32(cq.head as u32, c.prp1 + at(4), Ordering::Release);
                        let _ = k.mem.store_u32(ev, c.prp2 + at(4), Ordering::Release);
                    }
                }
            });
        }
        status::SUCCESS
    }
}
