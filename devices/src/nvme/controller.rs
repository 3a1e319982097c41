//! The controller's state (`Core`), grouped by concern, and what ties the
//! concerns together: serving a submission queue, posting completions,
//! asynchronous events, counters.
//!
//! `Core` is shared by the vCPU thread (register and doorbell accesses) and
//! the device thread (polling, ioeventfd) behind one mutex; its methods are
//! spread over the files of the concern they serve. With several pollers,
//! each queue group is a `Core` of its own (`shards.rs`).

use super::admin::Features;
use super::doorbells::Doorbells;
use super::inject::{Ext, Extra};
use super::interrupts::IrqState;
use super::io::{InFlight, Namespace};
use super::queue::{self, post_cqe, read_sqe, status, Cq, Sq};
use super::regs::Regs;
use super::{DoorbellMode, NvmeConfig, MAX_IO_QUEUES};
use crate::block::{Bounce, Storage};
use crate::{Counter, GuestMem, GuestMemoryMmap};
use std::collections::VecDeque;

pub(super) struct Core {
    /// Guest RAM as the host gave it (queues, PRPs, shadow doorbells):
    /// mapped, or partly reached by message (`crate::mem`).
    pub mem: GuestMem,
    pub regs: Regs,
    pub queues: Queues,
    pub events: Events,
    /// The namespaces (index = NSID - 1).
    pub ns: Vec<Namespace>,
    /// Completions owed per CQ across the namespaces, slot waits (`io.rs`).
    pub flight: InFlight,
    pub scratch: Scratch,
    pub db: Doorbells,
    pub intr: IrqState,
    pub st: Stats,
    pub smart: Smart,
    pub feat: Features,
    /// SN, SUBNQN, CNTLID, NGUID, UUID (`identity.rs`).
    pub ident: super::identity::Identity,
    /// Queue groups (`shards.rs`): this core's group and how many there are.
    pub group: usize,
    pub groups: usize,
    /// Group 0 only: the cores of groups 1..N (index k - 1).
    pub shards: Vec<std::sync::Arc<std::sync::Mutex<Core>>>,
    /// Shared by the groups: MSI-X vector states, events they raised.
    pub vectors: std::sync::Arc<super::shards::Vectors>,
    pub raised: std::sync::Arc<super::shards::Raised>,
    /// Error injection and timed completions (`inject.rs`, `timing.rs`).
    pub ext: Ext,
    /// The state memory's recorder, once `adopt_state` gave one (`state/`).
    pub rec: Option<Box<super::state::Recorder>>,
    /// Set by a resume (`state/resume.rs`); the first completion posted
    /// after it clears it and logs when it was posted (`bench reconnect`).
    pub first_since_resume: bool,
    /// The queue oracle's log of the I/O commands fetched (`oracle.rs`).
    #[cfg(any(test, feature = "oracle"))]
    pub oplog: Option<std::sync::Arc<std::sync::Mutex<Vec<super::oracle::OpRecord>>>>,
}

/// Queue ids, ascending, from a mask copied when the walk began (the
/// walker may create or delete queues meanwhile, and looks each one up).
pub(super) struct SqIds(u128);

impl Iterator for SqIds {
    type Item = usize;
    fn next(&mut self) -> Option<usize> {
        if self.0 == 0 {
            return None;
        }
        let q = self.0.trailing_zeros() as usize;
        self.0 &= self.0 - 1;
        Some(q)
    }
}

impl Queues {
    /// Puts (or removes, with None) SQ `qid`.
    pub fn set_sq(&mut self, qid: usize, sq: Option<Sq>) {
        let bit = 1u128 << qid;
        self.sq_mask = if sq.is_some() { self.sq_mask | bit } else { self.sq_mask & !bit };
        self.sqs[qid] = sq;
    }

    /// Removes every SQ.
    pub fn clear_sqs(&mut self) {
        self.sqs.iter_mut().for_each(|q| *q = None);
        self.sq_mask = 0;
    }

    /// The ids of the SQs that exist, admin queue included.
    pub fn sq_ids(&self) -> SqIds {
        debug_assert_eq!(
            self.sq_mask,
            self.sqs.iter().enumerate().filter(|(_, s)| s.is_some()).fold(0u128, |m, (q, _)| m | 1 << q),
            "an SQ was written without set_sq"
        );
        SqIds(self.sq_mask)
    }

    /// SQ `qid`'s head, tail, size and CQ id, read in place: a copy of the
    /// queue right after a narrow store to it (the head, each command)
    /// cannot be forwarded from the store buffer and stalls.
    pub fn sq_fields(&self, qid: usize) -> Option<(u16, u16, u16, usize)> {
        self.sqs[qid].as_ref().map(|s| (s.head, s.tail, s.size, s.cqid as usize))
    }

    /// The ids of the I/O SQs that exist.
    pub fn io_sq_ids(&self) -> SqIds {
        SqIds(self.sq_ids().0 & !1)
    }

    /// Resolves every queue's ring in `mem` (the memory came or changed).
    pub fn resolve(&mut self, mem: &GuestMem) {
        self.sqs.iter_mut().flatten().for_each(|q| q.resolve(mem));
        self.cqs.iter_mut().flatten().for_each(|q| q.resolve(mem));
    }
}

/// The submission and completion queues (index = queue id; 0 is admin).
pub(super) struct Queues {
    /// Written only through `set_sq` and `clear_sqs`, which keep `sq_mask`.
    pub sqs: Vec<Option<Sq>>,
    /// Bit q is set while `sqs[q]` holds a queue: the pollers walk the
    /// queues that exist, not all MAX_IO_QUEUES + 1 slots in every pass.
    sq_mask: u128,
    pub cqs: Vec<Option<Cq>>,
    /// I/O queues allocated by Set Features (Number of Queues).
    pub nsqa: u16,
    pub ncqa: u16,
    /// An I/O queue was created (Number of Queues may no longer change).
    pub created: bool,
}

/// Asynchronous events: outstanding AER command ids, events waiting for one,
/// and the event types reported and not yet cleared.
///
/// As the spec has it, an event type that is outstanding (reported, its log
/// page not yet read) is not reported again: its events wait, and reading
/// the log page (Get Log Page without RAE) clears the type and the events
/// waiting for that page (the page reported them). At most one event per
/// (type, info) waits; the rest are counted and dropped, so a guest that
/// repeats a bad doorbell write forever cannot grow the queue.
#[derive(Default)]
pub(super) struct Events {
    pub aers: Vec<u16>,
    /// Completion dword 0 of each waiting event: type, info, log page.
    pub queued: VecDeque<u32>,
    /// Per event type: the log page of its event reported and not yet cleared.
    pub outstanding: [Option<u8>; 8],
    /// Events dropped because one of the same type and info was waiting.
    pub dropped: u64,
}

/// Buffers reused across commands.
pub(super) struct Scratch {
    /// PRP segments (guest address, length) of the command at hand.
    pub segs: Vec<(u64, u64)>,
    /// Staging for RAM namespace transfers.
    pub buf: Vec<u8>,
    /// O_DIRECT-aligned staging for file namespace transfers.
    pub bounce: Bounce,
}

/// Counters (names in [`Core::counters`]).
#[derive(Clone, Default)]
pub(super) struct Stats {
    pub admin: u64,
    pub io: u64,
    pub reads: u64,
    pub writes: u64,
    pub errors: u64,
    pub doorbell_writes: u64,
    pub bad_doorbells: u64,
    pub cq_full_waits: u64,
    pub polls: u64,
    pub kicks: u64,
    pub interrupts: u64,
    /// Completions whose MSI-X message merged into their pass's one.
    pub merged_interrupts: u64,
    /// adaptive: times the poller went to sleep, and was woken by a kick.
    pub sleeps: u64,
    pub wakeups: u64,
    /// adaptive: timed wake-ups for a forecast command, and the forecast
    /// commands found by the polling after them (`poller/forecast.rs`).
    pub forecasts: u64,
    pub forecast_hits: u64,
    /// Doorbell Buffer Config commands that set up shadow doorbells.
    pub dbbuf_configs: u64,
}

impl Stats {
    /// Adds another group's counters.
    pub fn add(&mut self, o: &Stats) {
        let pairs = [
            (&mut self.admin, o.admin),
            (&mut self.io, o.io),
            (&mut self.reads, o.reads),
            (&mut self.writes, o.writes),
            (&mut self.errors, o.errors),
            (&mut self.doorbell_writes, o.doorbell_writes),
            (&mut self.bad_doorbells, o.bad_doorbells),
            (&mut self.cq_full_waits, o.cq_full_waits),
            (&mut self.polls, o.polls),
            (&mut self.kicks, o.kicks),
            (&mut self.interrupts, o.interrupts),
            (&mut self.merged_interrupts, o.merged_interrupts),
            (&mut self.sleeps, o.sleeps),
            (&mut self.wakeups, o.wakeups),
            (&mut self.forecasts, o.forecasts),
            (&mut self.forecast_hits, o.forecast_hits),
            (&mut self.dbbuf_configs, o.dbbuf_configs),
        ];
        for (a, b) in pairs {
            *a += b;
        }
    }
}

/// SMART / Health log data: 512-byte units transferred.
#[derive(Clone, Default)]
pub(super) struct Smart {
    pub read_units: u64,
    pub write_units: u64,
}

impl Core {
    /// A core with namespaces on `storages` (one per `cfg.ns_list()` entry, in order).
    pub fn new(cfg: &NvmeConfig, storages: Vec<Storage>, bar_page: Option<GuestMemoryMmap>) -> Core {
        let n = MAX_IO_QUEUES as usize + 1;
        Core {
            mem: GuestMem::default(),
            regs: Regs::default(),
            queues: Queues {
                sqs: vec![None; n],
                sq_mask: 0,
                cqs: vec![None; n],
                nsqa: MAX_IO_QUEUES,
                ncqa: MAX_IO_QUEUES,
                created: false,
            },
            events: Events::default(),
            ns: storages.into_iter().zip(cfg.ns_list()).map(|(s, n)| Namespace::new(s, &n)).collect(),
            flight: InFlight::new(),
            scratch: Scratch { segs: Vec::with_capacity(64), buf: Vec::new(), bounce: Bounce::new(0) },
            db: Doorbells::new(cfg.doorbell, bar_page),
            intr: IrqState::new(),
            st: Stats::default(),
            smart: Smart::default(),
            feat: Features::new(),
            ident: super::identity::Identity::new(&cfg.id),
            group: 0,
            groups: 1,
            shards: Vec::new(),
            vectors: std::sync::Arc::new(super::shards::Vectors::new()),
            raised: std::sync::Arc::default(),
            ext: Ext::new(std::sync::Arc::new(super::inject::Shared::new(cfg))),
            rec: None,
            first_since_resume: false,
            #[cfg(any(test, feature = "oracle"))]
            oplog: None,
        }
    }

    pub fn mode(&self) -> DoorbellMode {
        self.db.mode
    }

    /// Queues an asynchronous event (type, info, log page) unless one of the
    /// same type and info waits already, and delivers it if it can.
    pub fn event(&mut self, kind: u32, info: u32, log_page: u32) {
        if self.group != 0 {
            return self.shard_event(kind, info, log_page); // group 0 delivers it
        }
        let dw0 = kind & 7 | (info & 0xff) << 8 | (log_page & 0xff) << 16;
        if self.events.queued.iter().any(|e| e & 0xff07 == dw0 & 0xff07) {
            self.events.dropped += 1;
            return;
        }
        self.events.queued.push_back(dw0);
        self.deliver_events();
    }

    /// Completes outstanding AERs with the first queued events of types not
    /// outstanding, while the admin CQ has room (an event waits otherwise:
    /// it never overwrites an unreaped entry).
    pub fn deliver_events(&mut self) {
        while !self.events.aers.is_empty() && self.queues.cqs[0].is_some_and(|c| !c.full()) {
            let ev = &mut self.events;
            let Some(i) = ev.queued.iter().position(|&e| ev.outstanding[(e & 7) as usize].is_none()) else { return };
            let dw0 = ev.queued.remove(i).unwrap();
            ev.outstanding[(dw0 & 7) as usize] = Some((dw0 >> 16) as u8);
            let cid = ev.aers.remove(0);
            self.complete(0, cid, dw0, status::SUCCESS);
        }
    }

    /// The host read log page `lid` (without Retain Asynchronous Event): the
    /// event types it reported are no longer outstanding, and the events
    /// waiting for it are reported. The admin command completes first;
    /// `process_sq` delivers what may go now.
    pub fn log_page_read(&mut self, lid: u8) {
        for t in self.events.outstanding.iter_mut().filter(|t| **t == Some(lid)) {
            *t = None;
        }
        self.events.queued.retain(|&e| (e >> 16) as u8 != lid);
    }

    /// Serves SQ `qid` up to its tail; stops early if its CQ has no room
    /// for one more completion or (I/O queues) every file namespace slot is
    /// taken. Operations it started on the file namespace go out in one submit;
    /// the vectors its completions raise are signalled once, at its end.
    pub fn process_sq(&mut self, qid: usize) -> bool {
        self.batched(|c| c.serve_pass(qid))
    }

    fn serve_pass(&mut self, qid: usize) -> bool {
        if let Some(sq) = self.queues.sqs.get(qid).and_then(|s| s.as_ref()) {
            // The entries to serve, up to 8 lines ahead, fetched together.
            let (mut i, mut n) = (sq.head, 0);
            while i != sq.tail && n < 8 {
                self.mem.prefetch_resolved(&sq.ring, i as usize * queue::SQE_SIZE as usize);
                i = queue::next(i, sq.size);
                n += 1;
            }
        }
        let did = self.serve_sq(qid);
        self.io_submit();
        // A Delete I/O SQ (admin) or a Write Zeroes may have freed slots.
        self.serve_slot_waiters();
        did
    }

    /// Serves the I/O SQs that stopped for want of a file namespace slot, if
    /// slots are free again. Called wherever slots may have been freed (a
    /// reap, a queue drained): a waiting SQ may sit on any CQ, and no
    /// doorbell will come for it (its commands are already posted).
    pub fn serve_slot_waiters(&mut self) {
        // Each round fetches something or ends (the tails do not move here);
        // bounded all the same.
        for _ in 0..self.queues.sqs.len() {
            if !self.flight.slot_wait || !self.io_room() {
                return;
            }
            self.flight.slot_wait = false;
            for qid in self.queues.io_sq_ids() {
                if self.queues.sqs[qid].is_some_and(|s| s.head != s.tail) {
                    self.serve_sq(qid);
                }
            }
            self.io_submit();
        }
    }

    /// Serves SQ `qid` while it has commands and room; what the pass
    /// changed is recorded at its end (`state/`).
    fn serve_sq(&mut self, qid: usize) -> bool {
        let did = self.fetch_and_run(qid);
        if let Some(r) = self.rec.as_deref_mut() {
            r.record();
        }
        did
    }

    #[inline]
    fn fetch_and_run(&mut self, qid: usize) -> bool {
        // Between clients (a device process's left, its memory gone) the
        // doorbells it rang last are not served: no entry can be read, and
        // each would fail and count as an error of no client's.
        if self.mem.is_empty() {
            return false;
        }
        let mut did = false;
        loop {
            // Fields read in place, not the queues copied: a copy loads the
            // whole struct in wide loads right after the narrow store of the
            // head (or, in post_cqe, the CQ tail), which cannot be forwarded
            // from the store buffer and stalled every command.
            let Some(sq) = self.queues.sqs[qid].as_ref() else { return did };
            let (head, cqid) = (sq.head, sq.cqid as usize);
            if head == sq.tail {
                return did;
            }
            let Some(cq) = self.queues.cqs[cqid].as_ref() else { return did };
            // Room for this command's completion besides those owed already.
            // (No division: this is per command.)
            let used = if cq.tail >= cq.head { cq.tail - cq.head } else { cq.tail + cq.size - cq.head };
            if cq.size - 1 - used <= self.flight.owed[cqid] {
                self.st.cq_full_waits += 1;
                return did;
            }
            if qid > 0 && !self.io_room() {
                self.flight.slot_waits += 1;
                self.flight.slot_wait = true;
                return did;
            }
            let sq = self.queues.sqs[qid].as_mut().unwrap();
            let sqe = read_sqe(&self.mem, sq, head);
            sq.head = queue::next(head, sq.size);
            did = true;
            if let Some(r) = self.rec.as_deref_mut() {
                let gpa = sq.gpa + head as u64 * queue::SQE_SIZE;
                r.fetched(&self.mem, qid, head, gpa, sq.head, sqe.as_ref()); // `state/`: before it runs
            }
            self.run(qid, sqe);
        }
    }

    /// Runs a command fetched from SQ `qid` (None: its entry could not be
    /// read) and completes it, or leaves it in flight (file namespace, AER).
    /// A resumed controller runs the commands in flight again here (`state/`).
    #[inline]
    pub(super) fn run(&mut self, qid: usize, sqe: Option<queue::Sqe>) {
        #[cfg(any(test, feature = "oracle"))]
        if let (Some(log), Some(c), true) = (&self.oplog, &sqe, qid > 0) {
            let r = super::oracle::OpRecord { sqid: qid as u16, cid: c.cid, tag: c.cdw2, opcode: c.opcode };
            crate::lock(log).push(r);
        }
        // Error injection and completion timing (`inject.rs`, `timing.rs`):
        // off (no rule, no timing model), this branch is all they cost.
        let hooked = self.ext.timing || self.ext.injector.armed();
        let mut x = Extra::default();
        if hooked {
            match self.fetched(qid, sqe.as_ref()) {
                Some(e) => x = e,
                None => return, // completed with an injected status, or withheld
            }
        }
        let (dw0, st) = match sqe {
            None => (0, status::DATA_TRANSFER_ERROR),
            Some(c) if qid == 0 => {
                self.st.admin += 1;
                if c.opcode == 0x00 {
                    // Delete I/O SQ: its commands complete first.
                    self.drain_sq(c.cdw10 as u16);
                }
                match self.admin(&c) {
                    Some(r) => r,
                    None => return, // AER: completed later
                }
            }
            Some(c) => {
                self.st.io += 1;
                if hooked {
                    self.ext.next = x; // what a file slot carries
                }
                let r = self.io_start(qid, &c);
                if hooked {
                    self.ext.next = Extra::default();
                }
                match r {
                    Some(st) => (0, st),
                    None => return, // on the file namespace: completed when reaped
                }
            }
        };
        let cid = sqe.map(|c| c.cid).unwrap_or(0);
        if hooked && self.executed(qid, sqe.as_ref(), dw0, st, x) {
            return; // posted by the wheel
        }
        if qid == 0 {
            // Its effect committed with its completion (`state/`).
            self.commit_state(Some((dw0, st)));
        }
        self.complete(qid, cid, dw0, st);
        if qid == 0 {
            // An event a log page read let go.
            self.deliver_events();
            // What the command changed that the other queue groups copy.
            if !self.shards.is_empty() {
                self.sync_shards();
            }
        }
    }

    /// Every file namespace has a free slot (or completes at once): the
    /// next command's NSID is known only once it is fetched.
    fn io_room(&self) -> bool {
        self.ns.iter().all(|ns| match &ns.storage {
            Storage::File(f) => f.has_room(),
            _ => true,
        })
    }

    /// The device thread's turn for the file namespace: reaps and posts what
    /// completed, then serves the I/O queues that stopped for want of a slot
    /// (whoever freed it) or of CQ room. True if anything was done or
    /// operations are in flight (a poller stays busy then).
    pub fn io_progress(&mut self) -> bool {
        let (done, in_flight) = self.io_step();
        done || in_flight
    }

    /// As [`io_progress`](Self::io_progress), apart: (anything completed,
    /// operations still in flight). The adaptive poller sleeps on the
    /// completion eventfd while only the latter holds.
    pub fn io_step(&mut self) -> (bool, bool) {
        self.batched(|c| c.io_pass())
    }

    fn io_pass(&mut self) -> (bool, bool) {
        if self.mem.is_empty() {
            return (false, false); // no client: its completions wait for its memory
        }
        let timed = self.expire_timed();
        if !self.reap_io() {
            self.serve_slot_waiters();
            if timed {
                // CQ room the wheel owed is free: SQs stopped for it go on.
                self.serve_io_sqs();
            }
            return (timed, self.io_in_flight() > 0 || self.timed_held());
        }
        self.serve_io_sqs();
        (true, self.io_in_flight() > 0 || self.timed_held())
    }

    /// Serves every I/O SQ with commands waiting (CQ room or slots were freed).
    fn serve_io_sqs(&mut self) {
        for qid in self.queues.io_sq_ids() {
            if self.queues.sqs[qid].is_some_and(|s| s.head != s.tail) {
                self.process_sq(qid);
            }
        }
    }

    /// The file namespaces' completion eventfd (every ring signals the one
    /// `Nvme::new` gave them).
    pub fn io_completion_fd(&self) -> Option<std::sync::Arc<vmm_sys_util::eventfd::EventFd>> {
        self.ns.iter().find_map(|ns| match &ns.storage {
            Storage::File(f) => f.completion_fd(),
            _ => None,
        })
    }

    /// File namespace operations wait in a ring for a submit the kernel
    /// refused: the device thread retries after a while.
    pub fn io_stalled(&self) -> bool {
        self.ns.iter().any(|ns| matches!(&ns.storage, Storage::File(f) if f.stalled()))
    }

    /// File namespace operations in flight, over the namespaces.
    pub fn io_in_flight(&self) -> usize {
        self.ns
            .iter()
            .map(|ns| match &ns.storage {
                Storage::File(f) => f.in_flight(),
                _ => 0,
            })
            .sum()
    }

    /// Posts a completion for a command of SQ `sqid` and signals its CQ's vector.
    pub fn complete(&mut self, sqid: usize, cid: u16, dw0: u32, st: u16) {
        if st != status::SUCCESS {
            self.st.errors += 1;
        }
        let Some((sqhd, cqid)) = self.queues.sqs[sqid].as_ref().map(|s| (s.head, s.cqid as usize)) else {
            if let Some(r) = self.rec.as_deref_mut() {
                r.forget(sqid, cid);
            }
            return;
        };
        if let Some(cq) = self.queues.cqs[cqid].as_mut() {
            // `state/`: the CQE and its place first, the tail after it.
            let slot = self.rec.as_deref_mut().and_then(|r| {
                let dw3 = cid as u32 | (!cq.phase as u32) << 16 | (st as u32) << 17;
                r.posting(&self.mem, sqid, cid, cq.tail, (dw0, sqhd as u32 | (sqid as u32) << 16, dw3))
            });
            if let Some(r) = self.rec.as_deref() {
                r.kill_point(); // tests: a death before the CQE is in guest RAM
            }
            let after = post_cqe(&self.mem, cq, dw0, sqhd, sqid as u16, cid, st);
            if let Some(r) = self.rec.as_deref_mut() {
                // (Not `unwrap_or`: its eager loads of the tail and phase
                // would wait on post_cqe's stores.)
                let (tail, phase) = match after {
                    Some(a) => a,
                    None => (cq.tail, cq.phase),
                };
                r.posted(slot, cqid, tail, phase);
            }
            if after.is_none() {
                log::warn!("nvme: CQ {cqid} is outside guest RAM; completion of cid {cid} dropped");
                return;
            }
            let posted_at = std::mem::take(&mut self.first_since_resume).then(crate::state::monotonic_ns);
            let (ien, iv) = (cq.ien, cq.iv);
            if ien {
                self.completion_interrupt(cqid, iv);
            }
            if let Some(ns) = posted_at {
                log::warn!("nvme: {}{ns} ns", crate::state::RESUMED_FIRST_COMPLETION);
            }
        }
    }

    /// The device's counters, by the names routing checks and tests use.
    pub fn counters(&mut self) -> Vec<Counter> {
        self.take_raised();
        let (s, _, dropped, per) = self.totals();
        let s = &s;
        let mut v: Vec<Counter> = [
            ("admin.commands", s.admin),
            ("io.commands", s.io),
            ("io.reads", s.reads),
            ("io.writes", s.writes),
            ("errors", s.errors),
            ("doorbell.writes", s.doorbell_writes),
            ("doorbell.invalid", s.bad_doorbells),
            ("events.dropped", dropped),
            ("cq.full-waits", s.cq_full_waits),
            ("shadow.polls", s.polls),
            ("ioeventfd.kicks", s.kicks),
            ("msix.interrupts", s.interrupts),
            ("msix.merged", s.merged_interrupts),
            ("adaptive.sleeps", s.sleeps),
            ("adaptive.wakeups", s.wakeups),
            ("adaptive.forecasts", s.forecasts),
            ("adaptive.forecast-hits", s.forecast_hits),
            ("dbbuf.configs", s.dbbuf_configs),
        ]
        .into_iter()
        .map(|(n, value)| Counter { name: n.into(), value })
        .collect();
        if per.len() > 1 {
            // I/O commands each poller served (group k's poller: `poller{k}.ios`).
            v.extend(per.iter().enumerate().map(|(k, &n)| Counter { name: format!("poller{k}.ios"), value: n }));
        }
        // Each backend kind the namespaces use; the file counters summed over them.
        for kind in ["null", "ram", "file"] {
            if self.ns.iter().any(|ns| ns.storage.name() == kind) {
                v.push(Counter { name: format!("backend.{kind}"), value: 1 });
            }
        }
        if self.ns.len() > 1 {
            v.push(Counter { name: "namespaces".into(), value: self.ns.len() as u64 });
        }
        // The timing models' device time and lateness (`block::timing::hist`).
        if let Some(h) = &self.ext.shared.hist {
            v.extend(h.counters("timing").into_iter().map(|(name, value)| Counter { name, value }));
        }
        let files: Vec<_> =
            self.ns.iter().filter_map(|ns| if let Storage::File(f) = &ns.storage { Some(f) } else { None }).collect();
        if !files.is_empty() {
            let sum = |g: fn(&crate::block::FileStorage) -> u64| files.iter().map(|f| g(f)).sum::<u64>();
            v.push(Counter { name: "backend.direct-ops".into(), value: sum(|f| f.direct_ops) });
            // Of those, the ones that moved data to or from the guest's pages in place.
            v.push(Counter { name: "backend.in-place-ops".into(), value: sum(|f| f.in_place_ops) });
            // The queue depth that reached a file: the most operations in flight at once.
            let max = files.iter().map(|f| f.max_in_flight).max().unwrap_or(0);
            v.push(Counter { name: "backend.inflight-max".into(), value: max });
            v.push(Counter { name: "backend.slot-waits".into(), value: self.flight.slot_waits });
        }
        v.extend(self.pi_counters()); // `meta.rs`
        v.extend(self.state_counters()); // `state/`
        v
    }
}
