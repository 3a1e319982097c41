//! I/O commands on namespace 1 (Flush, Read, Write, Write Zeroes, Dataset
//! Management) and the data movement between guest pages (PRPs) and the
//! storage ([`crate::block`]). The opcodes are listed once, for the effects
//! log, in `admin.rs`. Write Zeroes (DEAC: deallocate) and Dataset
//! Management's deallocate (AD) are the storage's write zeroes and discard
//! (a file namespace punches holes; deallocated blocks read as zeros, as
//! Identify Namespace's DLFEAT says), done after the file operations in
//! flight completed.
//!
//! On a file namespace with io_uring, Read, Write and Flush are
//! asynchronous: fetching one pushes its operation (a queue pass pushes
//! many, then submits once), on the guest's pages in place where they are
//! mapped and aligned for O_DIRECT (`block/guest.rs`), otherwise on a
//! slot's bounce buffer (a write's data gathered into it first, a read's
//! scattered from it when reaped); its completion is posted when the device
//! thread reaps it (`reap_io`). Before the controller gives a memory up, it
//! waits for the operations on its pages (`settle_guest_io`). Ordering:
//! NVMe leaves outstanding commands unordered, so a read of blocks a write
//! in flight covers may see either data (the host's concern). A Flush is
//! an fdatasync with IOSQE_IO_DRAIN: it starts only once every operation
//! submitted before it completed, and its completion is reaped after
//! theirs, so it completes after the writes fetched before it.
//! Bounds: at most [`FILE_SLOTS`](crate::block::FILE_SLOTS) commands are
//! out (the queues stop being fetched until one completes), and an SQ is
//! fetched only while its CQ has room for every completion already owed to
//! it, so a completion never waits for room (unless the host moves its CQ
//! head back; it is then held until there is room, or dropped by a reset).

use super::admin::IO_LBA_CHANGING;
use super::controller::Core;
use super::queue::{prp_segments, status, Sqe, PAGE};
use super::regs::cap;
use super::{MAX_IO_QUEUES, MDTS};
use crate::block::{FileOp, Placed, Storage, FILE_SLOTS};
use std::collections::VecDeque;
use std::time::{Duration, Instant};

/// Force Unit Access, in CDW12 of a Read, Write or Write Zeroes.
const FUA: u32 = 1 << 30;
/// Deallocate, in CDW12 of a Write Zeroes.
const DEAC: u32 = 1 << 25;
/// Attribute - Deallocate, in CDW11 of a Dataset Management.
const AD: u32 = 1 << 2;

/// The namespace: its storage and geometry.
pub(super) struct Namespace {
    pub storage: Storage,
    /// log2 of the LBA size.
    pub lba_shift: u32,
    /// Size in LBAs.
    pub nlbas: u64,
    /// Commands out on the file namespace's io_uring.
    pub pending: Pending,
}

/// The command a file namespace slot serves (index = slot).
#[derive(Default)]
struct Op {
    /// Its completion is owed to the host (false: free, or aborted by a reset).
    live: bool,
    sqid: u16,
    cid: u16,
    cqid: u16,
    opcode: u8,
    bytes: u64,
    /// Guest pages of a read, written when it completes.
    segs: Vec<(u64, u64)>,
    /// Set when reaped: the status its completion carries.
    status: Option<u16>,
    /// Injection and timing (`inject.rs`): its corruption, due time.
    extra: super::inject::Extra,
}

/// Commands out on the file namespace, and the completions owed to each CQ.
pub(super) struct Pending {
    ops: Vec<Op>,
    /// Reaped, waiting for room in their CQ (in reap order).
    held: VecDeque<u16>,
    /// Per CQ: completions owed (commands fetched and not yet posted).
    pub owed: Vec<u16>,
    /// Times fetching stopped because every slot was taken.
    pub slot_waits: u64,
    /// An I/O SQ stopped for want of a slot and was not served since.
    pub slot_wait: bool,
}

impl Pending {
    pub fn new() -> Self {
        Pending {
            ops: (0..FILE_SLOTS).map(|_| Op::default()).collect(),
            held: VecDeque::new(),
            owed: vec![0; MAX_IO_QUEUES as usize + 1],
            slot_waits: 0,
            slot_wait: false,
        }
    }
}

impl Core {
    /// Starts I/O command `c` of SQ `qid`: on the file namespace's io_uring
    /// (Read, Write, Flush; None: its completion comes when it is reaped)
    /// or at once (Some(status)).
    pub(super) fn io_start(&mut self, qid: usize, c: &Sqe) -> Option<u16> {
        let Storage::File(f) = &mut self.ns.storage else { return Some(self.io(c)) };
        if c.nsid != 1 || !matches!(c.opcode, 0x00..=0x02) || !f.is_async() {
            return Some(self.io(c));
        }
        let (op, off, bytes) = match c.opcode {
            0x00 => (FileOp::Flush, 0, 0),
            _ => {
                let slba = c.cdw10 as u64 | (c.cdw11 as u64) << 32;
                let n = (c.cdw12 & 0xffff) as u64 + 1;
                if slba.checked_add(n).is_none_or(|e| e > self.ns.nlbas) {
                    return Some(status::LBA_OUT_OF_RANGE);
                }
                let bytes = n << self.ns.lba_shift;
                if bytes > PAGE << MDTS {
                    return Some(status::INVALID_FIELD);
                }
                // Force Unit Access (CDW12 bit 30), or no volatile write cache: stable before it completes.
                let dsync = !self.feat.write_cache || c.cdw12 & FUA != 0;
                let op = if c.opcode == 0x01 { FileOp::Write { dsync } } else { FileOp::Read };
                (op, slba << self.ns.lba_shift, bytes)
            }
        };
        // The caller fetched this command because a slot was free.
        let Some(slot) = f.take_slot() else { return Some(status::INTERNAL) };
        let mut segs = std::mem::take(&mut self.ns.pending.ops[slot as usize].segs);
        let mut st = match prp_segments(&self.mem, c.prp1, c.prp2, bytes, &mut segs) {
            Err(st) => st,
            Ok(()) => status::SUCCESS,
        };
        let Storage::File(f) = &mut self.ns.storage else { unreachable!() };
        let mut placed = Placed::Bounce;
        if st == status::SUCCESS && op != FileOp::Flush {
            placed = f.push_guest(slot, op, off, runs(&segs), &self.mem);
            if placed == Placed::Refused {
                st = status::INTERNAL;
            }
        }
        let bounce = st == status::SUCCESS && placed == Placed::Bounce;
        if bounce && op != FileOp::Read {
            let buf = f.buffer(slot, bytes as usize);
            let mut pos = 0;
            for (a, n) in runs(&segs) {
                if self.mem.read_slice(&mut buf[pos..pos + n as usize], a).is_err() {
                    st = status::DATA_TRANSFER_ERROR;
                    break;
                }
                pos += n as usize;
            }
        }
        if bounce && !f.push(slot, op, off, bytes as usize) {
            st = status::INTERNAL;
        }
        let cqid = self.queues.sqs[qid].as_ref().map_or(0, |s| s.cqid);
        let o = &mut self.ns.pending.ops[slot as usize];
        o.segs = segs;
        if st != status::SUCCESS {
            f.release(slot);
            return Some(st);
        }
        (o.live, o.sqid, o.cid, o.cqid, o.opcode, o.bytes, o.status) =
            (true, qid as u16, c.cid, cqid, c.opcode, bytes, None);
        o.extra = self.ext.next;
        self.ns.pending.owed[cqid as usize] += 1;
        None
    }

    /// Sends the operations pushed by a queue pass.
    pub(super) fn io_submit(&mut self) {
        if let Storage::File(f) = &mut self.ns.storage {
            f.submit();
        }
    }

    /// Reaps what the file namespace completed, without waiting, and posts
    /// the completions (or holds them while their CQ is full). True if
    /// anything was reaped or posted. Nothing while the controller has no
    /// memory (a client left; the next may keep the state): the completions
    /// wait in the ring (its completion queue has room for twice the
    /// operations in flight) until memory is attached again.
    pub(super) fn reap_io(&mut self) -> bool {
        self.batched(|c| c.reap_pass())
    }

    fn reap_pass(&mut self) -> bool {
        let Storage::File(f) = &mut self.ns.storage else { return false };
        if !f.is_async() || self.mem.is_empty() {
            return false;
        }
        f.submit(); // what an earlier submit left in the ring
        let mut did = false;
        while let Some((slot, r)) = f.reap() {
            did = true;
            let o = &mut self.ns.pending.ops[slot as usize];
            if !o.live {
                f.release(slot); // aborted by a reset: nothing to deliver
                continue;
            }
            let mut st = match (r, o.opcode) {
                (Ok(()), _) => status::SUCCESS,
                (Err(e), 0x00) => {
                    log::warn!("nvme: flush: {e}");
                    status::INTERNAL
                }
                (Err(e), _) => {
                    log::debug!("nvme: file transfer: {e}");
                    status::DATA_TRANSFER_ERROR
                }
            };
            if st == status::SUCCESS && o.opcode == 0x02 && !f.in_guest(slot) {
                // Scatter the data read into the bounce buffer to the guest pages, now.
                let buf = f.buffer(slot, o.bytes as usize);
                let mut pos = 0;
                for (a, n) in runs(&o.segs) {
                    if self.mem.write_slice(&buf[pos..pos + n as usize], a).is_err() {
                        st = status::DATA_TRANSFER_ERROR;
                        break;
                    }
                    pos += n as usize;
                }
            }
            if st == status::SUCCESS && o.opcode != 0x00 {
                if o.opcode == 0x01 {
                    self.st.writes += 1;
                    self.smart.write_units += o.bytes / 512;
                } else {
                    self.st.reads += 1;
                    self.smart.read_units += o.bytes / 512;
                }
            }
            o.status = Some(st);
            self.ns.pending.held.push_back(slot);
        }
        did | self.post_reaped()
    }

    /// Posts the reaped completions whose CQ has room, in reap order.
    fn post_reaped(&mut self) -> bool {
        let mut did = false;
        let mut i = 0;
        while i < self.ns.pending.held.len() {
            let slot = self.ns.pending.held[i];
            let o = &self.ns.pending.ops[slot as usize];
            let (sqid, cid, cqid, st) = (o.sqid as usize, o.cid, o.cqid as usize, o.status.unwrap_or(0));
            if self.queues.cqs[cqid].is_some_and(|q| q.full()) {
                i += 1;
                continue;
            }
            self.ns.pending.held.remove(i);
            let o = &self.ns.pending.ops[slot as usize];
            let (x, opcode, bytes) = (o.extra, o.opcode, o.bytes);
            if x.any() || self.ext.timing {
                if let Some(k) = x.corrupt.filter(|_| st == status::SUCCESS) {
                    super::inject::corrupt_segments(&self.mem, &o.segs, k, bytes as usize);
                }
                self.retire(slot);
                did = true;
                if self.finish(sqid, cid, opcode, bytes, 0, st, x) {
                    continue; // posted by the wheel
                }
                self.complete(sqid, cid, 0, st);
                continue;
            }
            self.retire(slot);
            self.complete(sqid, cid, 0, st);
            did = true;
        }
        did
    }

    /// Frees a live slot whose completion is posted or dropped.
    fn retire(&mut self, slot: u16) {
        let o = &mut self.ns.pending.ops[slot as usize];
        o.live = false;
        let owed = &mut self.ns.pending.owed[o.cqid as usize];
        *owed = owed.saturating_sub(1);
        if let Storage::File(f) = &mut self.ns.storage {
            f.release(slot);
        }
    }

    /// Delete I/O SQ `sqid`: waits for its commands on the file namespace and
    /// posts their completions, so none is left to a queue that is gone
    /// (one the CQ has no room for, or one the wait failed for, is dropped).
    pub(super) fn drain_sq(&mut self, sqid: u16) {
        let mine = |p: &Pending| p.ops.iter().any(|o| o.live && o.sqid == sqid && o.status.is_none());
        while mine(&self.ns.pending) && !self.mem.is_empty() {
            self.reap_io();
            let Storage::File(f) = &mut self.ns.storage else { break };
            if mine(&self.ns.pending) && !f.wait() {
                break;
            }
        }
        self.reap_io();
        for slot in 0..FILE_SLOTS as u16 {
            let o = &self.ns.pending.ops[slot as usize];
            if o.live && o.sqid == sqid {
                self.ns.pending.held.retain(|&s| s != slot);
                self.retire_dropped(slot);
            }
        }
    }

    /// A live command whose completion will never be posted: reaped, its
    /// slot is free now; still in flight, it is freed when reaped.
    fn retire_dropped(&mut self, slot: u16) {
        if self.ns.pending.ops[slot as usize].status.is_some() {
            self.retire(slot);
        } else {
            let o = &mut self.ns.pending.ops[slot as usize];
            o.live = false;
            let owed = &mut self.ns.pending.owed[o.cqid as usize];
            *owed = owed.saturating_sub(1);
        }
    }

    /// Controller reset or disable (the device thread is stopped): every
    /// command out on the file namespace is aborted without a completion, and
    /// this waits until none is in flight, so an aborted read on guest
    /// pages in place cannot land after the host moved on (and reused
    /// them), nor an aborted write after the host wrote those blocks anew.
    /// The wait is bounded by half of CAP.TO, the time the host gives the
    /// controller; false if operations are still in flight then.
    pub(super) fn abort_io(&mut self) -> bool {
        for slot in 0..FILE_SLOTS as u16 {
            if self.ns.pending.ops[slot as usize].live {
                self.retire_dropped(slot);
            }
        }
        self.ns.pending.held.clear();
        self.ns.pending.owed.iter_mut().for_each(|o| *o = 0);
        self.ns.pending.slot_wait = false;
        let Storage::File(f) = &mut self.ns.storage else { return true };
        let timeout = Duration::from_millis((cap() >> 24 & 0xff) * 500 / 2);
        // Every operation in flight is an aborted one: freed as it is reaped.
        if f.drain(timeout) {
            return true;
        }
        log::error!("nvme: {} file operations still in flight {timeout:?} after a reset", f.in_flight());
        false
    }

    /// Before the controller lets its memory go (another is attached): waits
    /// until no file operation works on its pages in place, posting their
    /// completions there (or holding them for CQ room). Bounded like a
    /// reset's wait; past it, those operations keep the memory mapped until
    /// they end (`block/guest.rs`), and the client may see them land late.
    pub(super) fn settle_guest_io(&mut self) {
        let timeout = Duration::from_millis((cap() >> 24 & 0xff) * 500 / 2);
        let deadline = Instant::now() + timeout;
        loop {
            self.reap_io();
            let Storage::File(f) = &mut self.ns.storage else { return };
            let n = f.guest_in_flight();
            if n == 0 {
                return;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() || !f.wait_for(left) {
                log::error!(
                    "nvme: {n} file operations on guest pages still in flight {timeout:?} after the memory went"
                );
                return;
            }
        }
    }

    /// Waits until no file namespace operation is in flight (their
    /// completions posted, or held for CQ room): before a write through the
    /// buffered fd (Write Zeroes, deallocate), which must not race O_DIRECT
    /// writes of the same blocks (the page cache they invalidate could be
    /// written back over them). Gives up if waiting fails.
    fn settle_io(&mut self) {
        loop {
            self.reap_io();
            if self.io_in_flight() == 0 || self.mem.is_empty() {
                return;
            }
            // What the pass posted so far is not held while it waits.
            self.signal_due();
            let Storage::File(f) = &mut self.ns.storage else { return };
            if !f.wait() {
                return;
            }
        }
    }

    /// Executes an I/O command; returns its status.
    pub(super) fn io(&mut self, c: &Sqe) -> u16 {
        if c.nsid != 1 {
            return status::INVALID_NAMESPACE;
        }
        let st = match c.opcode {
            0x00 => match self.ns.storage.flush() {
                Ok(()) => status::SUCCESS,
                Err(_) => status::INTERNAL,
            },
            0x01 | 0x02 => self.rw(c, c.opcode == 0x01),
            0x08 => {
                let (slba, n) = (c.cdw10 as u64 | (c.cdw11 as u64) << 32, (c.cdw12 & 0xffff) as u64 + 1);
                if slba.checked_add(n).is_none_or(|e| e > self.ns.nlbas) {
                    return status::LBA_OUT_OF_RANGE;
                }
                self.settle_io();
                // DEAC: the blocks may be deallocated (DLFEAT bit 3 says so; a file gets a hole).
                let deac = c.cdw12 & DEAC != 0;
                match self.ns.storage.write_zeroes(slba << self.ns.lba_shift, n << self.ns.lba_shift, deac) {
                    Ok(()) => status::SUCCESS,
                    Err(e) => {
                        log::warn!("nvme: write zeroes: {e}");
                        status::INTERNAL
                    }
                }
            }
            0x09 => self.dsm(c),
            _ => status::INVALID_OPCODE,
        };
        // Volatile write cache off (Set Features 06h), or a Write or Write
        // Zeroes with Force Unit Access: what changed is stable before it completes.
        let fua = matches!(c.opcode, 0x01 | 0x08) && c.cdw12 & FUA != 0;
        if st == status::SUCCESS && (!self.feat.write_cache && IO_LBA_CHANGING.contains(&c.opcode) || fua) {
            if let Err(e) = self.ns.storage.flush() {
                log::warn!("nvme: flush with the write cache off: {e}");
                return status::INTERNAL;
            }
        }
        st
    }

    fn rw(&mut self, c: &Sqe, write: bool) -> u16 {
        let slba = c.cdw10 as u64 | (c.cdw11 as u64) << 32;
        let n = (c.cdw12 & 0xffff) as u64 + 1;
        if slba.checked_add(n).is_none_or(|e| e > self.ns.nlbas) {
            return status::LBA_OUT_OF_RANGE;
        }
        let bytes = n << self.ns.lba_shift;
        if bytes > PAGE << MDTS {
            return status::INVALID_FIELD;
        }
        let mut segs = std::mem::take(&mut self.scratch.segs);
        let st = match prp_segments(&self.mem, c.prp1, c.prp2, bytes, &mut segs) {
            Err(st) => st,
            Ok(()) => self.transfer(&segs, slba << self.ns.lba_shift, write),
        };
        self.scratch.segs = segs;
        if st == status::SUCCESS {
            if write {
                self.st.writes += 1;
                self.smart.write_units += bytes / 512;
            } else {
                self.st.reads += 1;
                self.smart.read_units += bytes / 512;
            }
        }
        st
    }

    /// Moves data between the storage and the guest pages: a run of pages
    /// that follow each other in guest memory is one access (one message
    /// each way where the host reaches that memory by message).
    fn transfer(&mut self, segs: &[(u64, u64)], mut off: u64, write: bool) -> u16 {
        if matches!(self.ns.storage, Storage::Null { .. }) {
            return status::SUCCESS;
        }
        if matches!(self.ns.storage, Storage::File(_)) {
            return self.transfer_whole(segs, off, write);
        }
        for (a, n) in runs(segs) {
            let n = n as usize;
            if self.scratch.buf.len() < n {
                self.scratch.buf.resize(n, 0);
            }
            let buf = &mut self.scratch.buf[..n];
            let (mem, storage) = (&self.mem, &mut self.ns.storage);
            let r = if write {
                mem.read_slice(buf, a).map_err(|_| ()).and_then(|()| storage.write(off, buf).map_err(|_| ()))
            } else {
                storage.read(off, buf).map_err(|_| ()).and_then(|()| mem.write_slice(buf, a).map_err(|_| ()))
            };
            if r.is_err() {
                return status::DATA_TRANSFER_ERROR;
            }
            off += n as u64;
        }
        status::SUCCESS
    }

    /// A file transfer as one aligned storage operation (O_DIRECT-able),
    /// gathered from or scattered to the guest pages.
    fn transfer_whole(&mut self, segs: &[(u64, u64)], off: u64, write: bool) -> u16 {
        let len: u64 = segs.iter().map(|s| s.1).sum();
        let (mem, storage) = (&self.mem, &mut self.ns.storage);
        let buf = self.scratch.bounce.get(len as usize);
        let mut pos = 0usize;
        let mut ok = true;
        if write {
            for (a, n) in runs(segs) {
                ok &= mem.read_slice(&mut buf[pos..pos + n as usize], a).is_ok();
                pos += n as usize;
            }
            ok = ok && storage.write(off, buf).is_ok();
        } else {
            ok = storage.read(off, buf).is_ok();
            for (a, n) in runs(segs) {
                if !ok {
                    break;
                }
                ok = mem.write_slice(&buf[pos..pos + n as usize], a).is_ok();
                pos += n as usize;
            }
        }
        if ok {
            status::SUCCESS
        } else {
            status::DATA_TRANSFER_ERROR
        }
    }

    /// Dataset Management: checks every range, then deallocates them when
    /// asked (AD): they read as zeros after (DLFEAT), a file's blocks
    /// become holes. A range outside the namespace fails the command
    /// before any is touched.
    fn dsm(&mut self, c: &Sqe) -> u16 {
        let nr = (c.cdw10 & 0xff) as usize + 1;
        let mut ranges = vec![0u8; nr * 16];
        let mut segs = std::mem::take(&mut self.scratch.segs);
        let r = prp_segments(&self.mem, c.prp1, c.prp2, ranges.len() as u64, &mut segs);
        let mut done = 0;
        let mut st = match r {
            Ok(()) => status::SUCCESS,
            Err(s) => s,
        };
        if st == status::SUCCESS {
            for &(a, n) in &segs {
                if self.mem.read_slice(&mut ranges[done..done + n as usize], a).is_err() {
                    st = status::DATA_TRANSFER_ERROR;
                }
                done += n as usize;
            }
        }
        self.scratch.segs = segs;
        if st != status::SUCCESS {
            return st;
        }
        // Context attributes (0..4), length in LBAs (4..8), starting LBA (8..16).
        let range = |r: &[u8]| {
            let n = u32::from_le_bytes(r[4..8].try_into().unwrap()) as u64;
            (u64::from_le_bytes(r[8..16].try_into().unwrap()), n)
        };
        if ranges.chunks(16).map(range).any(|(slba, n)| slba.checked_add(n).is_none_or(|e| e > self.ns.nlbas)) {
            return status::LBA_OUT_OF_RANGE;
        }
        if c.cdw11 & AD == 0 {
            return status::SUCCESS; // attributes only: hints
        }
        self.settle_io();
        for (slba, n) in ranges.chunks(16).map(range) {
            if let Err(e) = self.ns.storage.discard(slba << self.ns.lba_shift, n << self.ns.lba_shift) {
                log::warn!("nvme: deallocate: {e}");
                return status::INTERNAL;
            }
        }
        status::SUCCESS
    }
}

/// The segments with each run of adjacent ones (one ending where the next
/// begins) merged.
pub(super) fn runs(segs: &[(u64, u64)]) -> impl Iterator<Item = (u64, u64)> + '_ {
    let mut i = 0;
    std::iter::from_fn(move || {
        let &(a, mut n) = segs.get(i)?;
        i += 1;
        while let Some(&(b, m)) = segs.get(i) {
            if a.checked_add(n) != Some(b) {
                break;
            }
            n += m;
            i += 1;
        }
        Some((a, n))
    })
}

#[cfg(test)]
mod tests {
    #[test]
    fn adjacent_segments_merge_into_runs() {
        let segs = [(0x1800, 0x800), (0x2000, 0x1000), (0x5000, 0x1000), (0x6000, 0x200), (0x9000, 0x10)];
        let r: Vec<_> = super::runs(&segs).collect();
        assert_eq!(r, [(0x1800, 0x1800), (0x5000, 0x1200), (0x9000, 0x10)]);
        assert_eq!(super::runs(&[]).count(), 0);
    }
}
