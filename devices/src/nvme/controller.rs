//! The controller's state (`Core`), grouped by concern, and what ties the
//! concerns together: serving a submission queue, posting completions,
//! asynchronous events, counters.
//!
//! `Core` is shared by the vCPU thread (register and doorbell accesses) and
//! the device thread (polling, ioeventfd) behind one mutex; its methods are
//! spread over the files of the concern they serve.

use super::backend::{Backend, Bounce};
use super::doorbells::Doorbells;
use super::interrupts::IrqState;
use super::io::Namespace;
use super::queue::{self, post_cqe, read_sqe, status, Cq, Sq};
use super::regs::Regs;
use super::{DoorbellMode, NvmeConfig, MAX_IO_QUEUES};
use crate::{Counter, GuestMemoryMmap};
use std::collections::VecDeque;

pub(super) struct Core {
    /// Guest RAM as the host gave it (queues, PRPs, shadow doorbells).
    pub mem: GuestMemoryMmap,
    pub regs: Regs,
    pub queues: Queues,
    pub events: Events,
    pub ns: Namespace,
    pub scratch: Scratch,
    pub db: Doorbells,
    pub intr: IrqState,
    pub st: Stats,
    pub smart: Smart,
}

/// The submission and completion queues (index = queue id; 0 is admin).
pub(super) struct Queues {
    pub sqs: Vec<Option<Sq>>,
    pub cqs: Vec<Option<Cq>>,
    /// I/O queues allocated by Set Features (Number of Queues).
    pub nsqa: u16,
    pub ncqa: u16,
    /// An I/O queue was created (Number of Queues may no longer change).
    pub created: bool,
}

/// Asynchronous events: outstanding AER command ids and events waiting for one.
#[derive(Default)]
pub(super) struct Events {
    pub aers: Vec<u16>,
    pub queued: VecDeque<u32>,
}

/// Buffers reused across commands.
pub(super) struct Scratch {
    /// PRP segments (guest address, length) of the command at hand.
    pub segs: Vec<(u64, u64)>,
    /// Staging for RAM backend transfers.
    pub buf: Vec<u8>,
    /// O_DIRECT-aligned staging for file backend transfers.
    pub bounce: Bounce,
}

/// Counters (names in [`Core::counters`]).
#[derive(Default)]
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
}

/// SMART / Health log data: 512-byte units transferred.
#[derive(Default)]
pub(super) struct Smart {
    pub read_units: u64,
    pub write_units: u64,
}

impl Core {
    pub fn new(cfg: &NvmeConfig, backend: Backend, bar_page: Option<GuestMemoryMmap>) -> Core {
        let n = MAX_IO_QUEUES as usize + 1;
        Core {
            mem: GuestMemoryMmap::default(),
            regs: Regs::default(),
            queues: Queues {
                sqs: vec![None; n],
                cqs: vec![None; n],
                nsqa: MAX_IO_QUEUES,
                ncqa: MAX_IO_QUEUES,
                created: false,
            },
            events: Events::default(),
            ns: Namespace { backend, lba_shift: cfg.lba_size.trailing_zeros(), nlbas: cfg.size / cfg.lba_size as u64 },
            scratch: Scratch { segs: Vec::with_capacity(64), buf: Vec::new(), bounce: Bounce::new(0) },
            db: Doorbells::new(cfg.doorbell, bar_page),
            intr: IrqState::new(),
            st: Stats::default(),
            smart: Smart::default(),
        }
    }

    pub fn mode(&self) -> DoorbellMode {
        self.db.mode
    }

    /// Queues an asynchronous event (type, info, log page) and delivers it
    /// if an AER is outstanding.
    pub fn event(&mut self, kind: u32, info: u32, log_page: u32) {
        self.events.queued.push_back(kind | info << 8 | log_page << 16);
        self.deliver_events();
    }

    /// Completes outstanding AERs with queued events while the admin CQ has
    /// room (an event waits otherwise: it never overwrites an unreaped entry).
    pub fn deliver_events(&mut self) {
        while !self.events.queued.is_empty()
            && !self.events.aers.is_empty()
            && self.queues.cqs[0].is_some_and(|c| !c.full())
        {
            let cid = self.events.aers.remove(0);
            let dw0 = self.events.queued.pop_front().unwrap();
            self.complete(0, cid, dw0, status::SUCCESS);
        }
    }

    /// Serves SQ `qid` up to its tail; stops early if its CQ is full.
    pub fn process_sq(&mut self, qid: usize) -> bool {
        let mut did = false;
        loop {
            let Some(sq) = self.queues.sqs[qid] else { return did };
            if sq.head == sq.tail {
                return did;
            }
            let Some(cq) = self.queues.cqs[sq.cqid as usize] else { return did };
            if cq.full() {
                self.st.cq_full_waits += 1;
                return did;
            }
            let sqe = read_sqe(&self.mem, &sq, sq.head);
            self.queues.sqs[qid].as_mut().unwrap().head = queue::next(sq.head, sq.size);
            did = true;
            let (dw0, st) = match sqe {
                None => (0, status::DATA_TRANSFER_ERROR),
                Some(c) if qid == 0 => {
                    self.st.admin += 1;
                    match self.admin(&c) {
                        Some(r) => r,
                        None => continue, // AER: completed later
                    }
                }
                Some(c) => {
                    self.st.io += 1;
                    (0, self.io(&c))
                }
            };
            let cid = sqe.map(|c| c.cid).unwrap_or(0);
            self.complete(qid, cid, dw0, st);
        }
    }

    /// Posts a completion for a command of SQ `sqid` and signals its CQ's vector.
    pub fn complete(&mut self, sqid: usize, cid: u16, dw0: u32, st: u16) {
        if st != status::SUCCESS {
            self.st.errors += 1;
        }
        let Some(sq) = self.queues.sqs[sqid] else { return };
        let cqid = sq.cqid as usize;
        if let Some(cq) = self.queues.cqs[cqid].as_mut() {
            if !post_cqe(&self.mem, cq, dw0, sq.head, sqid as u16, cid, st) {
                log::warn!("nvme: CQ {cqid} is outside guest RAM; completion of cid {cid} dropped");
                return;
            }
            let (ien, iv) = (cq.ien, cq.iv);
            if ien {
                self.completion_interrupt(cqid, iv);
            }
        }
    }

    /// The device's counters, by the names routing checks and tests use.
    pub fn counters(&self) -> Vec<Counter> {
        let s = &self.st;
        let mut v: Vec<Counter> = [
            ("admin.commands", s.admin),
            ("io.commands", s.io),
            ("io.reads", s.reads),
            ("io.writes", s.writes),
            ("errors", s.errors),
            ("doorbell.writes", s.doorbell_writes),
            ("doorbell.invalid", s.bad_doorbells),
            ("cq.full-waits", s.cq_full_waits),
            ("shadow.polls", s.polls),
            ("ioeventfd.kicks", s.kicks),
            ("msix.interrupts", s.interrupts),
        ]
        .into_iter()
        .map(|(n, value)| Counter { name: n.into(), value })
        .collect();
        v.push(Counter { name: format!("backend.{}", self.ns.backend.name()), value: 1 });
        if let Backend::File(f) = &self.ns.backend {
            v.push(Counter { name: "backend.direct-ops".into(), value: f.direct_ops });
        }
        v
    }
}
