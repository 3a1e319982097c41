//! Queue groups ("shards"): one controller served by several pollers
//! (`pollers=N`, `shm` and `bar` modes).
//!
//! Modes: `shm` and `bar` (a poller per group) and `adaptive` (each
//! group's poller arms its own queues' EventIdx and sleeps on an eventfd of
//! its own, on which its queues' doorbells are ioeventfds; in a device
//! process, whose host takes one eventfd for every doorbell at attach, the
//! groups poll without sleeping).
//!
//! Group k holds the I/O queues whose CQ id is k mod N (an SQ goes with its
//! CQ, so a CQ shared by several SQs stays in one group). Each group is a
//! [`Core`] behind its own mutex with the state its I/O path touches: its
//! SQs and CQs, scratch buffers, counters, interrupt aggregation. Group 0
//! is the controller's own core (registers, admin queue, features, MSI-X
//! table, events), so its poller also serves the admin queue in `bar`
//! mode; groups 1..N are `Core::shards` of group 0.
//!
//! What the groups share, without a lock a poller takes per I/O:
//! - guest memory: each core holds a clone of the handle (set at attach);
//! - the namespace: `null` has no data; `ram` is one anonymous mapping
//!   ([`Ram`](crate::block::Ram)), a handle in each core's
//!   [`Storage`](crate::block::Storage), reached with plain copies (the host orders
//!   accesses to the same blocks, as with any NVMe device: two commands in
//!   flight on the same blocks leave them unspecified, never out of bounds);
//! - MSI-X: group 0 keeps the table; each vector has an atomic state here
//!   ([`Vectors`]): "deliverable" (host's table, or unmasked in ours), which
//!   group 0 keeps up to date, and "pending", which a group sets when it
//!   cannot deliver and group 0 folds into the table's PBA;
//! - asynchronous events a group raises (a bad doorbell value): a small
//!   mutex ([`Raised`]) group 0 drains, a rare path.
//!
//! Lock order: group 0's core, then one other group's core, then `Raised`
//! (its event list, then its wake eventfd; each a leaf).
//! Never a group's core before group 0's, never two other groups at once.
//! The admin path (on group 0) takes the group it changes; a poller takes
//! only its own group.

use super::controller::{Core, Smart, Stats};
use super::MSIX_VECTORS;
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::Mutex;

/// Vector state bits.
const DELIVERABLE: u8 = 1;
const PENDING: u8 = 2;

/// Per MSI-X vector: whether a group may signal it directly, and whether a
/// group left it pending.
pub(super) struct Vectors(Vec<AtomicU8>);

impl Vectors {
    pub fn new() -> Self {
        Vectors((0..MSIX_VECTORS).map(|_| AtomicU8::new(0)).collect())
    }
}

/// Asynchronous events groups raised, waiting for group 0 (bounded: one
/// per (type, info), as group 0's own queue).
#[derive(Default)]
pub(super) struct Raised {
    any: AtomicBool,
    events: Mutex<Vec<(u32, u32, u32)>>,
    /// adaptive: group 0's doorbell eventfd, written to wake it for an event.
    wake: Mutex<Option<std::sync::Arc<vmm_sys_util::eventfd::EventFd>>>,
    /// Those writes, not yet drained by group 0 (they are no kicks).
    wakes: std::sync::atomic::AtomicU64,
}

impl Raised {
    /// The wake-ups written since the last call.
    pub fn take_wakes(&self) -> u64 {
        self.wakes.swap(0, Ordering::Relaxed)
    }

    /// Group 0's adaptive poller sleeps on `kick` (None: it stopped).
    pub fn set_wake(&self, kick: Option<std::sync::Arc<vmm_sys_util::eventfd::EventFd>>) {
        *crate::lock(&self.wake) = kick;
    }

    /// Drops what waits (a controller reset).
    pub fn take_all(&self) {
        crate::lock(&self.events).clear();
        self.any.store(false, Ordering::Release);
    }
}

impl Core {
    /// A core for queue group `group` (1..N) of controller core `c0`.
    pub fn new_shard(c0: &Core, cfg: &super::NvmeConfig, group: usize) -> Core {
        // Each namespace's data is one (`null` or `ram`: several pollers never serve a file).
        let storages = c0
            .ns
            .iter()
            .map(|ns| ns.storage.share().unwrap_or(crate::block::Storage::Null { bytes: ns.storage.bytes() }))
            .collect();
        let mut c = Core::new(cfg, storages, c0.db.bar_page.clone());
        c.group = group;
        c.groups = c0.groups;
        c.vectors = c0.vectors.clone();
        c.raised = c0.raised.clone();
        c.ext = super::inject::Ext::new(c0.ext.shared.clone());
        c
    }

    /// Runs `f` on the core of group `g` (this one for 0; group 0 only).
    pub fn with_group<R>(&mut self, g: usize, f: impl FnOnce(&mut Core) -> R) -> R {
        if g == 0 || self.shards.is_empty() {
            return f(self);
        }
        let s = self.shards[g - 1].clone();
        let mut s = crate::lock(&s);
        f(&mut s)
    }

    /// One of several queue groups with nothing to poll: no I/O SQ (nor,
    /// group 0 in `bar` mode, the admin queue, which its poller serves).
    pub fn group_unused(&self) -> bool {
        self.groups > 1
            && (self.group > 0 || self.db.bar_page.is_none())
            && self.queues.sqs.iter().skip(1).all(|s| s.is_none())
    }

    /// The group an I/O CQ belongs to.
    pub fn cq_group(&self, cqid: usize) -> usize {
        cqid % self.groups.max(1)
    }

    /// The group whose core holds I/O SQ `qid`, if it exists.
    pub fn sq_group(&mut self, qid: usize) -> Option<usize> {
        (0..self.groups.max(1)).find(|&g| self.with_group(g, |c| c.queues.sqs.get(qid).is_some_and(|s| s.is_some())))
    }

    /// Group 0, after anything that changes what the groups copy (attach,
    /// an admin command, enable, reset): guest memory, CSTS, the shadow
    /// doorbells, interrupt lines, coalescing and features.
    pub fn sync_shards(&mut self) {
        for s in self.shards.clone() {
            let mut s = crate::lock(&s);
            s.mem = self.mem.clone();
            let s = &mut *s;
            s.queues.resolve(&s.mem);
            s.regs.csts = self.regs.csts;
            s.db.shadow = self.db.shadow;
            s.db.ioevents = self.db.ioevents.clone();
            s.intr.irq = self.intr.irq.clone();
            if s.intr.coalescing != self.intr.coalescing {
                s.intr.coalescing = self.intr.coalescing;
                s.flush_coalesced_now();
            }
            s.feat = self.feat.clone();
        }
        self.sync_vectors();
    }

    /// Group 0: publishes whether each vector may be signalled directly,
    /// then takes the groups' pending signals into the table (signalled now
    /// if deliverable, else kept in the PBA). Set first, taken second: a
    /// group sets pending first and reads deliverable second, so one of the
    /// two sees the other and no signal is lost.
    pub fn sync_vectors(&mut self) {
        if self.shards.is_empty() {
            return;
        }
        let host = self.host_owns_table();
        for v in 0..MSIX_VECTORS {
            let s = &self.vectors.0[v];
            if host || !self.intr.msix.masked(v) {
                s.fetch_or(DELIVERABLE, Ordering::SeqCst);
            } else {
                s.fetch_and(!DELIVERABLE, Ordering::SeqCst);
            }
            if s.fetch_and(!PENDING, Ordering::SeqCst) & PENDING != 0 {
                self.interrupt(v as u16);
            }
        }
    }

    /// A group other than 0 signals vector `v`: directly if deliverable,
    /// else left pending for group 0. A mask that races with this may let
    /// one signal through just after it, as a message already sent would.
    pub fn shard_interrupt(&mut self, v: usize) {
        let s = &self.vectors.0[v];
        if s.load(Ordering::SeqCst) & DELIVERABLE != 0 && self.intr.irq.signal_msix(v as u16) {
            self.st.interrupts += 1;
            return;
        }
        s.fetch_or(PENDING, Ordering::SeqCst);
        if s.load(Ordering::SeqCst) & DELIVERABLE != 0 && s.fetch_and(!PENDING, Ordering::SeqCst) & PENDING != 0 {
            if self.intr.irq.signal_msix(v as u16) {
                self.st.interrupts += 1;
            } else {
                s.fetch_or(PENDING, Ordering::SeqCst);
            }
        }
    }

    /// A group other than 0 raises an asynchronous event: kept for group 0.
    pub fn shard_event(&mut self, kind: u32, info: u32, log_page: u32) {
        let mut q = crate::lock(&self.raised.events);
        if q.iter().any(|&(k, i, _)| (k, i) == (kind, info)) {
            self.events.dropped += 1;
            return;
        }
        q.push((kind, info, log_page));
        self.raised.any.store(true, Ordering::Release);
        drop(q);
        if let Some(k) = &*crate::lock(&self.raised.wake) {
            // Group 0 may sleep (adaptive); this write is no doorbell kick.
            if k.write(1).is_ok() {
                self.raised.wakes.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    /// Group 0: delivers the events the groups raised (a flag read when none).
    pub fn take_raised(&mut self) {
        if self.group != 0 || !self.raised.any.load(Ordering::Acquire) {
            return;
        }
        let q = {
            let mut q = crate::lock(&self.raised.events);
            self.raised.any.store(false, Ordering::Release);
            std::mem::take(&mut *q)
        };
        for (k, i, l) in q {
            self.event(k, i, l);
        }
    }

    /// Group 0: counters and SMART data of every group, summed; and each
    /// group's I/O commands (the per-poller counters).
    pub fn totals(&mut self) -> (Stats, Smart, u64, Vec<u64>) {
        let (mut st, mut smart, mut dropped) = (self.st.clone(), self.smart.clone(), self.events.dropped);
        let mut per = vec![self.st.io];
        for s in self.shards.clone() {
            let s = crate::lock(&s);
            st.add(&s.st);
            smart.read_units += s.smart.read_units;
            smart.write_units += s.smart.write_units;
            dropped += s.events.dropped;
            per.push(s.st.io);
        }
        (st, smart, dropped, per)
    }
}
