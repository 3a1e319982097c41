//! I/O commands (Flush, Read, Write, Write Zeroes, Dataset Management),
//! routed by NSID to the controller's namespaces (an NSID that names none:
//! Invalid Namespace or Format, nothing touched; a Flush to FFFFFFFFh
//! flushes every namespace), and the data movement between guest pages (PRPs) and the
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
//! out per file namespace (the queues stop being fetched until each file
//! namespace has a free slot: a command's NSID is known only once it is
//! fetched), and an SQ is fetched only while its CQ has room for every
//! completion already owed to it, whatever namespace owes it ([`InFlight`]
//! is the controller's, a namespace's [`Pending`] its own slots), so a
//! completion never waits for room (unless the host moves its CQ head back;
//! it is then held until there is room, or dropped by a reset). Several
//! file namespaces' rings signal one eventfd: a wake-up reaps them all.

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

/// A namespace: its storage and geometry.
pub(super) struct Namespace {
    pub storage: Storage,
    /// log2 of the LBA size.
    pub lba_shift: u32,
    /// Size in LBAs.
    pub nlbas: u64,
    /// Commands out on the file namespace's io_uring.
    pub pending: Pending,
    /// Attached to the controller (active); detached, it is allocated only:
    /// I/O to it gets Invalid Namespace or Format (`ns_admin.rs`).
    pub attached: bool,
    /// Its metadata format (`ms` 0: none, the fast path) (`meta.rs`).
    pub meta: super::meta::MetaFmt,
    /// Protection information tuples checked, and the checks that failed.
    pub pi_checks: u64,
    pub pi_errors: u64,
}

impl Namespace {
    pub fn new(storage: Storage, cfg: &super::namespaces::NsConfig) -> Namespace {
        let (nlbas, lba_size) = (cfg.size / cfg.lba_size as u64, cfg.lba_size);
        let m = &cfg.meta;
        let meta = super::meta::MetaFmt {
            ms: m.ms,
            ext: m.ext,
            pi: m.pi,
            pi_first: m.pi_first,
            base: cfg.size,
            area: m.area(&cfg.backend, cfg.size),
        };
        Namespace {
            storage,
            lba_shift: lba_size.trailing_zeros(),
            nlbas,
            pending: Pending::new(),
            attached: true,
            meta,
            pi_checks: 0,
            pi_errors: 0,
        }
    }

    /// True if `n` LBAs from `slba` lie outside the namespace.
    fn out_of_range(&self, slba: u64, n: u64) -> bool {
        slba.checked_add(n).is_none_or(|e| e > self.nlbas)
    }
}

/// What the controller owes across its namespaces.
pub(super) struct InFlight {
    /// Per CQ: completions owed (commands fetched and not yet posted), from
    /// every namespace: an SQ is fetched only while its CQ has room for them.
    pub owed: Vec<u16>,
    /// Times fetching stopped because a file namespace's slots were all taken.
    pub slot_waits: u64,
    /// An I/O SQ stopped for want of a slot and was not served since.
    pub slot_wait: bool,
}

impl InFlight {
    pub fn new() -> Self {
        InFlight { owed: vec![0; MAX_IO_QUEUES as usize + 1], slot_waits: 0, slot_wait: false }
    }
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

/// Commands out on a file namespace (index = its slot).
pub(super) struct Pending {
    ops: Vec<Op>,
    /// Reaped, waiting for room in their CQ (in reap order).
    held: VecDeque<u16>,
}

impl Pending {
    pub fn new() -> Self {
        Pending { ops: (0..FILE_SLOTS).map(|_| Op::default()).collect(), held: VecDeque::new() }
    }
}

impl Core {
    /// The index of active namespace `nsid` in `ns` (None: no such
    /// namespace, or detached).
    pub(super) fn ns_index(&self, nsid: u32) -> Option<usize> {
        self.ns_allocated(nsid).filter(|&i| self.ns[i].attached)
    }

    /// The index of namespace `nsid`, attached or not.
    pub(super) fn ns_allocated(&self, nsid: u32) -> Option<usize> {
        let i = (nsid as usize).checked_sub(1)?;
        (i < self.ns.len()).then_some(i)
    }

    /// Starts I/O command `c` of SQ `qid`: on a file namespace's io_uring
    /// (Read, Write, Flush; None: its completion comes when it is reaped)
    /// or at once (Some(status)).
    pub(super) fn io_start(&mut self, qid: usize, c: &Sqe) -> Option<u16> {
        let Some(i) = self.ns_index(c.nsid) else { return Some(self.io(c)) };
        let sync = self.ns[i].meta.ms != 0; // metadata: the synchronous way (`meta.rs`)
        let Storage::File(f) = &mut self.ns[i].storage else { return Some(self.io(c)) };
        if !matches!(c.opcode, 0x00..=0x02) || !f.is_async() || sync {
            return Some(self.io(c));
        }
        let ns = &self.ns[i];
        let (op, off, bytes) = match c.opcode {
            0x00 => (FileOp::Flush, 0, 0),
            _ => {
                let slba = c.cdw10 as u64 | (c.cdw11 as u64) << 32;
                let n = (c.cdw12 & 0xffff) as u64 + 1;
                if ns.out_of_range(slba, n) {
                    return Some(status::LBA_OUT_OF_RANGE);
                }
                let bytes = n << ns.lba_shift;
                if bytes > PAGE << MDTS {
                    return Some(status::INVALID_FIELD);
                }
                // Force Unit Access (CDW12 bit 30), or no volatile write cache: stable before it completes.
                let dsync = !self.feat.write_cache || c.cdw12 & FUA != 0;
                let op = if c.opcode == 0x01 { FileOp::Write { dsync } } else { FileOp::Read };
                (op, slba << ns.lba_shift, bytes)
            }
        };
        let ns = &mut self.ns[i];
        let Storage::File(f) = &mut ns.storage else { unreachable!() };
        // The caller fetched this command because a slot was free.
        let Some(slot) = f.take_slot() else { return Some(status::INTERNAL) };
        let mut segs = std::mem::take(&mut ns.pending.ops[slot as usize].segs);
        let mut st = match prp_segments(&self.mem, c.prp1, c.prp2, bytes, &mut segs) {
            Err(st) => st,
            Ok(()) => status::SUCCESS,
        };
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
        let o = &mut ns.pending.ops[slot as usize];
        o.segs = segs;
        if st != status::SUCCESS {
            f.release(slot);
            return Some(st);
        }
        (o.live, o.sqid, o.cid, o.cqid, o.opcode, o.bytes, o.status) =
            (true, qid as u16, c.cid, cqid, c.opcode, bytes, None);
        o.extra = self.ext.next;
        self.flight.owed[cqid as usize] += 1;
        None
    }

    /// Sends the operations pushed by a queue pass.
    pub(super) fn io_submit(&mut self) {
        for ns in &mut self.ns {
            if let Storage::File(f) = &mut ns.storage {
                f.submit();
            }
        }
    }

    /// Reaps what the file namespaces completed, without waiting, and posts
    /// the completions (or holds them while their CQ is full). True if
    /// anything was reaped or posted. Nothing while the controller has no
    /// memory (a client left; the next may keep the state): the completions
    /// wait in the ring (its completion queue has room for twice the
    /// operations in flight) until memory is attached again.
    pub(super) fn reap_io(&mut self) -> bool {
        self.batched(|c| c.reap_pass())
    }

    fn reap_pass(&mut self) -> bool {
        if self.mem.is_empty() {
            return false;
        }
        let mut did = false;
        for i in 0..self.ns.len() {
            did |= self.reap_ns(i);
        }
        did | self.post_reaped()
    }

    fn reap_ns(&mut self, i: usize) -> bool {
        let ns = &mut self.ns[i];
        let Storage::File(f) = &mut ns.storage else { return false };
        if !f.is_async() {
            return false;
        }
        f.submit(); // what an earlier submit left in the ring
        let mut did = false;
        while let Some((slot, r)) = f.reap() {
            did = true;
            let o = &mut ns.pending.ops[slot as usize];
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
            ns.pending.held.push_back(slot);
        }
        did
    }

    /// Posts the reaped completions whose CQ has room, in reap order (per
    /// namespace).
    fn post_reaped(&mut self) -> bool {
        let mut did = false;
        for n in 0..self.ns.len() {
            let mut i = 0;
            while i < self.ns[n].pending.held.len() {
                let slot = self.ns[n].pending.held[i];
                let o = &self.ns[n].pending.ops[slot as usize];
                let (sqid, cid, cqid, st) = (o.sqid as usize, o.cid, o.cqid as usize, o.status.unwrap_or(0));
                if self.queues.cqs[cqid].is_some_and(|q| q.full()) {
                    i += 1;
                    continue;
                }
                self.ns[n].pending.held.remove(i);
                let o = &self.ns[n].pending.ops[slot as usize];
                let (x, opcode, bytes) = (o.extra, o.opcode, o.bytes);
                if x.any() || self.ext.timing {
                    if let Some(k) = x.corrupt.filter(|_| st == status::SUCCESS) {
                        super::inject::corrupt_segments(&self.mem, &o.segs, k, bytes as usize);
                    }
                    self.retire(n, slot);
                    did = true;
                    if !self.finish(sqid, cid, opcode, bytes, 0, st, x) {
                        self.complete(sqid, cid, 0, st);
                    } // else posted by the wheel
                    continue;
                }
                self.retire(n, slot);
                self.complete(sqid, cid, 0, st);
                did = true;
            }
        }
        did
    }

    /// Frees a live slot of namespace index `n` whose completion is posted or dropped.
    fn retire(&mut self, n: usize, slot: u16) {
        let ns = &mut self.ns[n];
        let o = &mut ns.pending.ops[slot as usize];
        o.live = false;
        let owed = &mut self.flight.owed[o.cqid as usize];
        *owed = owed.saturating_sub(1);
        if let Storage::File(f) = &mut ns.storage {
            f.release(slot);
        }
    }

    /// Delete I/O SQ `sqid`: waits for its commands on the file namespaces and
    /// posts their completions, so none is left to a queue that is gone
    /// (one the CQ has no room for, or one the wait failed for, is dropped).
    pub(super) fn drain_sq(&mut self, sqid: u16) {
        let mine = |p: &Pending| p.ops.iter().any(|o| o.live && o.sqid == sqid && o.status.is_none());
        for n in 0..self.ns.len() {
            while mine(&self.ns[n].pending) && !self.mem.is_empty() {
                self.reap_io();
                let left = mine(&self.ns[n].pending);
                let Storage::File(f) = &mut self.ns[n].storage else { break };
                if left && !f.wait() {
                    break;
                }
            }
        }
        self.reap_io();
        for n in 0..self.ns.len() {
            for slot in 0..FILE_SLOTS as u16 {
                let o = &self.ns[n].pending.ops[slot as usize];
                if o.live && o.sqid == sqid {
                    self.ns[n].pending.held.retain(|&s| s != slot);
                    self.retire_dropped(n, slot);
                }
            }
        }
    }

    /// A live command whose completion will never be posted: reaped, its
    /// slot is free now; still in flight, it is freed when reaped.
    fn retire_dropped(&mut self, n: usize, slot: u16) {
        if self.ns[n].pending.ops[slot as usize].status.is_some() {
            self.retire(n, slot);
        } else {
            let o = &mut self.ns[n].pending.ops[slot as usize];
            o.live = false;
            let owed = &mut self.flight.owed[o.cqid as usize];
            *owed = owed.saturating_sub(1);
        }
    }

    /// Controller reset or disable (the device thread is stopped): every
    /// command out on a file namespace is aborted without a completion, and
    /// this waits until none is in flight, so an aborted read on guest
    /// pages in place cannot land after the host moved on (and reused
    /// them), nor an aborted write after the host wrote those blocks anew.
    /// The wait is bounded by half of CAP.TO, the time the host gives the
    /// controller (for all namespaces together); false if operations are
    /// still in flight then.
    pub(super) fn abort_io(&mut self) -> bool {
        for n in 0..self.ns.len() {
            for slot in 0..FILE_SLOTS as u16 {
                if self.ns[n].pending.ops[slot as usize].live {
                    self.retire_dropped(n, slot);
                }
            }
            self.ns[n].pending.held.clear();
        }
        self.flight.owed.iter_mut().for_each(|o| *o = 0);
        self.flight.slot_wait = false;
        let timeout = Duration::from_millis((cap() >> 24 & 0xff) * 500 / 2);
        let deadline = Instant::now() + timeout;
        let mut ok = true;
        for ns in &mut self.ns {
            let Storage::File(f) = &mut ns.storage else { continue };
            // Every operation in flight is an aborted one: freed as it is reaped.
            if !f.drain(deadline.saturating_duration_since(Instant::now())) {
                log::error!("nvme: {} file operations still in flight {timeout:?} after a reset", f.in_flight());
                ok = false;
            }
        }
        ok
    }

    /// Before the controller lets its memory go (another is attached): waits
    /// until no file operation works on its pages in place, posting their
    /// completions there (or holding them for CQ room). Bounded like a
    /// reset's wait; past it, those operations keep the memory mapped until
    /// they end (`block/guest.rs`), and the client may see them land late.
    pub(super) fn settle_guest_io(&mut self) {
        let timeout = Duration::from_millis((cap() >> 24 & 0xff) * 500 / 2);
        let deadline = Instant::now() + timeout;
        for n in 0..self.ns.len() {
            loop {
                self.reap_io();
                let Storage::File(f) = &mut self.ns[n].storage else { break };
                let k = f.guest_in_flight();
                if k == 0 {
                    break;
                }
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() || !f.wait_for(left) {
                    log::error!(
                        "nvme: {k} file operations on guest pages still in flight {timeout:?} after the memory went"
                    );
                    return;
                }
            }
        }
    }

    /// Waits until no file namespace operation is in flight (their
    /// completions posted, or held for CQ room): before a write through the
    /// buffered fd (Write Zeroes, deallocate, Format NVM), which must not
    /// race O_DIRECT writes of the same blocks (the page cache they
    /// invalidate could be written back over them). Gives up if waiting fails.
    pub(super) fn settle_io(&mut self) {
        loop {
            self.reap_io();
            if self.io_in_flight() == 0 || self.mem.is_empty() {
                return;
            }
            // What the pass posted so far is not held while it waits.
            self.signal_due();
            let busy = self.ns.iter_mut().find_map(|ns| match &mut ns.storage {
                Storage::File(f) if f.in_flight() > 0 => Some(f),
                _ => None,
            });
            let Some(f) = busy else { return };
            if !f.wait() {
                return;
            }
        }
    }

    /// Executes an I/O command; returns its status.
    pub(super) fn io(&mut self, c: &Sqe) -> u16 {
        let Some(i) = self.ns_index(c.nsid) else {
            if c.nsid == 0xffff_ffff && c.opcode == 0x00 {
                return self.flush_all();
            }
            return status::INVALID_NAMESPACE;
        };
        let st = match c.opcode {
            0x00 => match self.ns[i].storage.flush() {
                Ok(()) => status::SUCCESS,
                Err(_) => status::INTERNAL,
            },
            0x01 | 0x02 => self.rw(i, c, c.opcode == 0x01),
            0x08 => {
                let (slba, n) = (c.cdw10 as u64 | (c.cdw11 as u64) << 32, (c.cdw12 & 0xffff) as u64 + 1);
                if self.ns[i].out_of_range(slba, n) {
                    return status::LBA_OUT_OF_RANGE;
                }
                self.settle_io();
                // DEAC: the blocks may be deallocated (DLFEAT bit 3 says so; a file gets a hole).
                let deac = c.cdw12 & DEAC != 0;
                let ns = &mut self.ns[i];
                match ns.storage.write_zeroes(slba << ns.lba_shift, n << ns.lba_shift, deac) {
                    Ok(()) => self.zero_meta(i, slba, n, Some(c)),
                    Err(e) => {
                        log::warn!("nvme: write zeroes: {e}");
                        status::INTERNAL
                    }
                }
            }
            0x09 => self.dsm(i, c),
            _ => status::INVALID_OPCODE,
        };
        // Volatile write cache off (Set Features 06h), or a Write or Write
        // Zeroes with Force Unit Access: what changed is stable before it completes.
        let fua = matches!(c.opcode, 0x01 | 0x08) && c.cdw12 & FUA != 0;
        if st == status::SUCCESS && (!self.feat.write_cache && IO_LBA_CHANGING.contains(&c.opcode) || fua) {
            if let Err(e) = self.ns[i].storage.flush() {
                log::warn!("nvme: flush with the write cache off: {e}");
                return status::INTERNAL;
            }
        }
        st
    }

    /// Flush to NSID FFFFFFFFh: every namespace's data stable (a file
    /// namespace's fdatasync, after the operations in flight completed).
    fn flush_all(&mut self) -> u16 {
        self.settle_io();
        for ns in &mut self.ns {
            if let Err(e) = ns.storage.flush() {
                log::warn!("nvme: flush: {e}");
                return status::INTERNAL;
            }
        }
        status::SUCCESS
    }

    /// Counts a Read or Write of `bytes` carried out (SMART's data units are 512 B here).
    pub(super) fn count_rw(&mut self, write: bool, bytes: u64) {
        if write {
            self.st.writes += 1;
            self.smart.write_units += bytes / 512;
        } else {
            self.st.reads += 1;
            self.smart.read_units += bytes / 512;
        }
    }

    fn rw(&mut self, i: usize, c: &Sqe, write: bool) -> u16 {
        let slba = c.cdw10 as u64 | (c.cdw11 as u64) << 32;
        let n = (c.cdw12 & 0xffff) as u64 + 1;
        if self.ns[i].out_of_range(slba, n) {
            return status::LBA_OUT_OF_RANGE;
        }
        if self.ns[i].meta.ms != 0 {
            return self.rw_meta(i, c, slba, n, write);
        }
        let shift = self.ns[i].lba_shift;
        let bytes = n << shift;
        if bytes > PAGE << MDTS {
            return status::INVALID_FIELD;
        }
        let mut segs = std::mem::take(&mut self.scratch.segs);
        let st = match prp_segments(&self.mem, c.prp1, c.prp2, bytes, &mut segs) {
            Err(st) => st,
            Ok(()) => self.transfer(i, &segs, slba << shift, write),
        };
        self.scratch.segs = segs;
        if st == status::SUCCESS {
            self.count_rw(write, bytes);
        }
        st
    }

    /// Moves data between namespace index `i`'s storage and the guest
    /// pages: a run of pages that follow each other in guest memory is one
    /// access (one message each way where the host reaches that memory by
    /// message).
    fn transfer(&mut self, i: usize, segs: &[(u64, u64)], mut off: u64, write: bool) -> u16 {
        if matches!(self.ns[i].storage, Storage::Null { .. }) {
            return status::SUCCESS;
        }
        if matches!(self.ns[i].storage, Storage::File(_)) {
            return self.transfer_whole(i, segs, off, write);
        }
        for (a, n) in runs(segs) {
            let n = n as usize;
            if self.scratch.buf.len() < n {
                self.scratch.buf.resize(n, 0);
            }
            let buf = &mut self.scratch.buf[..n];
            let (mem, storage) = (&self.mem, &mut self.ns[i].storage);
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
    fn transfer_whole(&mut self, i: usize, segs: &[(u64, u64)], off: u64, write: bool) -> u16 {
        let len: u64 = segs.iter().map(|s| s.1).sum();
        let (mem, storage) = (&self.mem, &mut self.ns[i].storage);
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
    fn dsm(&mut self, i: usize, c: &Sqe) -> u16 {
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
        if ranges.chunks(16).map(range).any(|(slba, n)| self.ns[i].out_of_range(slba, n)) {
            return status::LBA_OUT_OF_RANGE;
        }
        if c.cdw11 & AD == 0 {
            return status::SUCCESS; // attributes only: hints
        }
        self.settle_io();
        let ns = &mut self.ns[i];
        for (slba, n) in ranges.chunks(16).map(range) {
            if let Err(e) = ns.storage.discard(slba << ns.lba_shift, n << ns.lba_shift) {
                log::warn!("nvme: deallocate: {e}");
                return status::INTERNAL;
            }
        }
        if self.ns[i].meta.ms != 0 {
            for (slba, n) in ranges.chunks(16).map(range) {
                let st = self.zero_meta(i, slba, n, None);
                if st != status::SUCCESS {
                    return st;
                }
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
