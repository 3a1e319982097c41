//! How doorbells reach the controller, in the four modes (see the module
//! documentation of `nvme`): MMIO doorbell writes (`mmio`, and the admin
//! queue and not-yet-shadowed queues of `shm` and `ioeventfd`), shadow
//! doorbells polled by a thread (`shm`), BAR0's doorbell page as shared
//! memory polled by a thread (`bar`), and ioeventfd kicks that wake a thread
//! which reads the shadow doorbells (`ioeventfd`). The threads are started
//! and stopped here; the adaptive pollers, which also sleep, are in
//! `adaptive.rs` (their threads) and `poller/` (their decisions).
//!
//! ioeventfd registration follows the host. A VMM installs them as the
//! queues come and go (`register_doorbells`). A device process's host
//! announces them once, when its client attaches (vfio-user's
//! GET_REGION_IO_FDS; `IoEvents::static_only`), before any queue exists: the
//! controller then registers at attach the doorbell of every I/O queue it
//! offers (SQ tail and CQ head of queues 1..=MAX_IO_QUEUES, on one eventfd)
//! and keeps them, and its eventfd, for its lifetime (`register_static`).
//! The admin doorbells stay registers: their values are needed. A kick
//! carries no value and no address, so a write to the doorbell of a queue
//! that does not exist is a kick that finds no work, as a write of a tail the
//! shadow does not show; and I/O doorbells the driver rings before Doorbell
//! Buffer Config are lost (logged): out of process, ioeventfd mode needs a
//! driver that configures the shadow doorbells before it creates I/O queues
//! (Linux, nvmeperf).

use super::controller::Core;
use super::queue;
use super::{DoorbellMode, Nvme, BAR0_SIZE, DOORBELLS, MAX_IO_QUEUES};
use crate::{Error, GuestMemoryMmap, Result};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use vm_memory::{Bytes, GuestAddress};
use vmm_sys_util::eventfd::EventFd;

/// Doorbell state of the controller.
pub(super) struct Doorbells {
    pub mode: DoorbellMode,
    /// Shadow doorbell and EventIdx buffers (Doorbell Buffer Config).
    pub shadow: Option<(u64, u64)>,
    /// ioeventfd mode: the eventfd on every I/O doorbell, and the host's registrar.
    pub kick: Option<Arc<EventFd>>,
    pub ioevents: Option<Arc<dyn crate::IoEvents>>,
    /// Doorbells registered as ioeventfds (offset in BAR0).
    pub registered: Vec<u64>,
    /// bar mode: BAR0 as shared memory (the doorbells at 0x1000).
    pub bar_page: Option<GuestMemoryMmap>,
    /// Its host address (0: none), resolved once: the poller loads the
    /// doorbell words in place, without vm-memory's lookup in every pass.
    bar_host: usize,
    /// The same page as a `GuestMem`, made once: what the poller's `watch` holds.
    pub(super) bar_mem: Option<crate::GuestMem>,
    /// Why a device thread stopped on its own (reported with the counters).
    pub failed: Option<String>,
    /// adaptive: the poller sleeps, EventIdx armed (bar-adaptive: the
    /// doorbell page trapped, or looked at in timed steps).
    pub sleeping: bool,
    /// bar-adaptive: the host took the doorbell page out of the guest, so
    /// its stores exit (`IoEvents::trap_area`).
    pub trapped: bool,
    /// adaptive: wake-ups this side wrote to `kick` for a doorbell that came
    /// as a message, not yet drained (they are no ioeventfd kicks).
    pub own_wakes: u64,
}

impl Doorbells {
    pub fn new(mode: DoorbellMode, bar_page: Option<GuestMemoryMmap>) -> Self {
        let mut d = Doorbells {
            bar_host: 0,
            bar_mem: None,
            mode,
            shadow: None,
            kick: None,
            ioevents: None,
            registered: Vec::new(),
            bar_page: None,
            failed: None,
            sleeping: false,
            trapped: false,
            own_wakes: 0,
        };
        d.set_bar_page(bar_page);
        d
    }

    /// The doorbell page and the addresses derived from it.
    fn set_bar_page(&mut self, bar_page: Option<GuestMemoryMmap>) {
        use vm_memory::{GuestMemoryBackend, GuestMemoryRegion, MemoryRegionAddress};
        // The region at 0 of BAR0_SIZE bytes or more (`bar_memory`), or none.
        self.bar_host = bar_page
            .as_ref()
            .and_then(|p| p.iter().find(|r| r.start_addr().0 == 0 && r.len() >= BAR0_SIZE))
            .and_then(|r| r.get_host_address(MemoryRegionAddress(0)).ok())
            .map_or(0, |a| a as usize);
        self.bar_mem = bar_page.clone().filter(|_| self.bar_host != 0).map(crate::GuestMem::from);
        self.bar_page = bar_page;
    }

    /// bar mode: the doorbell word at byte `off` of BAR0, loaded in place
    /// (None: no page, or `off` is not a word inside it).
    fn bar_load(&self, off: u64) -> Option<u32> {
        if self.bar_host == 0 || !off.is_multiple_of(4) || off + 4 > BAR0_SIZE {
            return None;
        }
        // SAFETY: bar_host maps BAR0_SIZE bytes for as long as bar_page,
        // which this struct owns and never replaces, lives; the word is
        // inside and 4-byte aligned (the mapping is page aligned). The
        // guest writes it concurrently, hence atomic.
        let w = unsafe { &*((self.bar_host + off as usize) as *const std::sync::atomic::AtomicU32) };
        Some(u32::from_le(w.load(Ordering::Acquire)))
    }
}

/// What serves a queue group: a thread of its own, or a place on a
/// process-wide pool thread (`pool.rs`).
pub(super) enum Worker {
    Thread(std::thread::JoinHandle<()>),
    Pooled(super::pool::Ticket),
}

impl Worker {
    /// Waits until it has stopped (its `stop` set) or its thread ended:
    /// after this no thread touches the core for it. Err: its thread ended
    /// early (a panic).
    pub(super) fn join(self) -> std::result::Result<(), String> {
        match self {
            Worker::Thread(h) => h.join().map_err(|_| "the poller thread panicked".into()),
            Worker::Pooled(t) => t.join(),
        }
    }
}

impl From<std::thread::JoinHandle<()>> for Worker {
    fn from(h: std::thread::JoinHandle<()>) -> Self {
        Worker::Thread(h)
    }
}

/// The device thread (poller or ioeventfd server), if one runs.
#[derive(Default)]
pub(super) struct Threads {
    pub(super) worker: Option<(Arc<AtomicBool>, Worker)>,
    /// Several pollers: those of queue groups 1..N (`shards.rs`).
    pub(super) pollers: Vec<Worker>,
    /// Why a thread could not be started (reported with the counters).
    pub error: Option<String>,
}

impl Threads {
    /// A device thread runs (and may be asleep on the doorbells' eventfd).
    pub(super) fn running(&self) -> bool {
        self.worker.is_some()
    }
}

impl Nvme {
    /// Starts the device thread the doorbell mode needs (none for mmio).
    pub(super) fn start_threads(&self, t: &mut Threads) {
        if t.worker.is_some() {
            return;
        }
        if self.cfg.doorbell == DoorbellMode::Ioeventfd {
            self.start_kicked(t);
            return;
        }
        if self.cfg.doorbell.adaptive() {
            self.start_adaptive(t);
            return;
        }
        if self.cfg.doorbell == DoorbellMode::Mmio {
            self.start_reaper(t);
            return;
        }
        if !matches!(self.cfg.doorbell, DoorbellMode::Shm | DoorbellMode::Bar) {
            return;
        }
        let shards = crate::lock(&self.core).shards.clone();
        self.start_polling(t, &shards);
    }

    /// shm, bar: one poller per queue group, group 0 (this core) first; or,
    /// with a process-wide pool (`pool.rs`), a place for each on its threads.
    pub(super) fn start_polling(&self, t: &mut Threads, shards: &[Arc<std::sync::Mutex<Core>>]) {
        let stop = Arc::new(AtomicBool::new(false));
        if let Some(pool) = super::pool::get() {
            if let Some(w) = pool.add(self.core.clone(), stop.clone()) {
                t.worker = Some((stop.clone(), Worker::Pooled(w)));
                for s in shards {
                    // The pool runs: a thread that took group 0 takes these.
                    match pool.add(s.clone(), stop.clone()) {
                        Some(w) => t.pollers.push(Worker::Pooled(w)),
                        None => t.error = Some("nvme: the poller pool took no queue group".into()),
                    }
                }
                return;
            }
        }
        let h = spawn_poller(self.core.clone(), stop.clone());
        match h {
            Ok(h) => t.worker = Some((stop.clone(), h.into())),
            // The other groups' pollers are stopped through this one's entry:
            // without it none starts (they could not be stopped).
            Err(e) => return t.error = Some(format!("nvme: cannot start the poller: {e}")),
        }
        for s in shards {
            match spawn_poller(s.clone(), stop.clone()) {
                Ok(h) => t.pollers.push(h.into()),
                Err(e) => t.error = Some(format!("nvme: cannot start a poller: {e}")),
            }
        }
    }

    /// mmio mode with a file backend on io_uring: doorbell writes start
    /// operations on the vCPU thread; this thread sleeps on the ring's
    /// completion eventfd and posts what completed.
    fn start_reaper(&self, t: &mut Threads) {
        let Some(done) = crate::lock(&self.core).io_completion_fd() else { return };
        let stop = Arc::new(AtomicBool::new(false));
        let (core, stop2) = (self.core.clone(), stop.clone());
        let mut retry = Retry::default();
        let h = std::thread::Builder::new().name("nvme-uring".into()).spawn(move || {
            crate::sandbox::enter(crate::sandbox::Role::Device);
            while !stop2.load(Ordering::Relaxed) {
                // poll, then read what it found: a signal (EINTR) is retried there.
                let (ready, _) = match wait_either(&done, None, retry.after()) {
                    Ok(r) => r,
                    Err(e) => return crate::lock(&core).thread_failed("io_uring", &e),
                };
                if stop2.load(Ordering::Relaxed) {
                    return;
                }
                if let Some(Err(e)) = ready.then(|| read_eventfd(&done)) {
                    return crate::lock(&core).thread_failed("io_uring", &e);
                }
                let mut c = crate::lock(&core);
                c.io_progress();
                c.flush_coalesced_untimed();
                retry.next(c.io_stalled());
            }
        });
        match h {
            Ok(h) => t.worker = Some((stop, h.into())),
            Err(e) => t.error = Some(format!("nvme: cannot start the io_uring thread: {e}")),
        }
    }

    /// ioeventfd mode: a thread that sleeps on the doorbells' eventfd (and
    /// on the file backend's completion eventfd).
    fn start_kicked(&self, t: &mut Threads) {
        let Some(kick) = kick_fd(&self.core, t) else { return };
        // Kicks drained when the last thread stopped: look at the shadow once.
        crate::lock(&self.core).serve_kicked();
        let stop = Arc::new(AtomicBool::new(false));
        let (core, stop2) = (self.core.clone(), stop.clone());
        let done = crate::lock(&self.core).io_completion_fd();
        let mut retry = Retry::default();
        // The next timed completion's wait (`timing.rs`), from the last pass.
        let mut timed: Option<std::time::Duration> = None;
        let h = std::thread::Builder::new().name("nvme-ioeventfd".into()).spawn(move || {
            // A timed completion's wake-up comes at its due time, not up to the default 50 us later.
            // SAFETY: prctl on this thread, no pointer passed.
            unsafe { libc::prctl(libc::PR_SET_TIMERSLACK, 1000u64) };
            crate::sandbox::enter(crate::sandbox::Role::Device);
            while !stop2.load(Ordering::Relaxed) {
                let after = match (retry.after(), timed) {
                    (Some(a), Some(b)) => Some(a.min(b)),
                    (a, b) => a.or(b),
                };
                let (kicked, completed) = match wait_either(&kick, done.as_deref(), after) {
                    Ok(r) => r,
                    Err(e) => return crate::lock(&core).thread_failed("ioeventfd", &e),
                };
                if stop2.load(Ordering::Relaxed) {
                    return; // woken to stop (that write is not a doorbell)
                }
                let n = if kicked { read_eventfd(&kick).unwrap_or(0) } else { 0 };
                if let (true, Some(done)) = (completed, done.as_deref()) {
                    let _ = read_eventfd(done);
                }
                let mut c = crate::lock(&core);
                // Less the wake-ups a timed completion wrote (`timing.rs`).
                c.st.kicks += n.saturating_sub(std::mem::take(&mut c.db.own_wakes));
                if kicked && c.db.shadow.is_none() {
                    // Only a static host's doorbells are ioeventfds this early.
                    c.lost_doorbells(n);
                } else if kicked {
                    c.serve_kicked();
                }
                c.io_progress();
                // No timer here: what the aggregation threshold holds goes out now.
                c.flush_coalesced_untimed();
                retry.next(c.io_stalled());
                timed = c.timed_wait();
            }
        });
        match h {
            Ok(h) => t.worker = Some((stop, h.into())),
            Err(e) => t.error = Some(format!("nvme: cannot start the ioeventfd thread: {e}")),
        }
    }
}

/// The doorbells' eventfd of a queue group's core (non-blocking: `counters`
/// may take its count first), registered for the queues it holds. A static
/// host's was made and announced at attach: it stays.
pub(super) fn kick_fd(core: &std::sync::Mutex<Core>, t: &mut Threads) -> Option<Arc<EventFd>> {
    let mut c = crate::lock(core);
    let kick = match c.db.kick.clone().map_or_else(|| EventFd::new(libc::EFD_NONBLOCK).map(Arc::new), Ok) {
        Ok(k) => k,
        Err(e) => {
            t.error = Some(format!("nvme: eventfd: {e}"));
            return None;
        }
    };
    c.db.kick = Some(kick.clone());
    for qid in 1..c.queues.sqs.len() {
        if c.queues.sqs[qid].is_some() {
            c.register_doorbells(qid);
        }
    }
    Some(kick)
}

impl Nvme {
    /// Stops the device thread: unregisters the ioeventfds (a static host's
    /// stay, with their eventfd), wakes the thread and joins it without
    /// holding the core lock.
    pub(super) fn stop_threads(&self, t: &mut Threads) {
        if let Some((stop, h)) = t.worker.take() {
            stop.store(true, Ordering::Relaxed);
            // Every queue group's eventfds (the other groups' pollers share
            // the flag); no core lock is held while a thread is joined.
            let shards = crate::lock(&self.core).shards.clone();
            let mut wake = Vec::new();
            let mut kicks = Vec::new();
            for (g, core) in std::iter::once(&self.core).chain(shards.iter()).enumerate() {
                let mut c = crate::lock(core);
                let kept = c.static_ioevents();
                if !kept {
                    c.unregister_all();
                }
                let kick = if kept { c.db.kick.clone() } else { c.db.kick.take() };
                if g == 0 {
                    c.raised.set_wake(None);
                }
                kicks.extend(kick.iter().map(|k| (g, k.clone())));
                wake.extend(kick.into_iter().chain(c.io_completion_fd()));
            }
            // Wake the threads that sleep on either to see `stop`.
            for fd in &wake {
                let _ = fd.write(1);
            }
            let ended: Vec<String> =
                t.pollers.drain(..).chain(std::iter::once(h)).filter_map(|w| w.join().err()).collect();
            // What the stopped pollers left in their doorbell eventfds: the
            // stop's own write, wake-ups this side wrote, and kicks of the
            // guest not drained yet (one rung while its poller, awake, was
            // already serving that submission). Those kicks are counted; the
            // rest is not a doorbell. A kept eventfd is then empty for the
            // next thread, which looks at the shadow when it starts.
            let mut c = crate::lock(&self.core);
            if let Some(e) = ended.first() {
                let m = format!("nvme: a queue group's poller stopped early: {e}");
                log::error!("{m}");
                c.db.failed = Some(m);
            }
            let other_wakes = c.raised.take_wakes();
            for (g, k) in kicks {
                let n = match wait_either(&k, None, Some(std::time::Duration::ZERO)) {
                    Ok((true, _)) => read_eventfd(&k).unwrap_or(0),
                    _ => 0,
                };
                c.with_group(g, |c| {
                    let own = 1 + c.db.own_wakes + if g == 0 { other_wakes } else { 0 };
                    c.st.kicks += n.saturating_sub(own);
                    c.db.own_wakes = 0;
                });
            }
        }
    }
}

impl Core {
    /// A device thread stops on an error it cannot go on after: logged, and
    /// kept to be reported with the counters.
    pub(super) fn thread_failed(&mut self, thread: &str, e: &std::io::Error) {
        let m = format!("nvme: the {thread} thread stopped: {e}");
        log::error!("{m}");
        self.db.failed = Some(m);
    }

    /// An MMIO doorbell write. `offset` is from the start of the doorbells.
    pub(super) fn doorbell(&mut self, off: u64, value: u32) {
        let qid = (off / 8) as usize;
        let is_cq = off % 8 == 4;
        if qid > 0 && qid <= MAX_IO_QUEUES as usize && !self.shards.is_empty() {
            // Another queue group's queue: its core counts and serves the
            // write (a queue that exists nowhere is refused here, below).
            let g = if is_cq { Some(self.cq_group(qid)) } else { self.sq_group(qid) };
            if let Some(g @ 1..) = g {
                self.with_group(g, |c| c.doorbell(off, value));
                self.take_raised();
                return;
            }
        }
        self.st.doorbell_writes += 1;
        if let Some(page) = &self.db.bar_page {
            // The page was not mapped into the guest, or is trapped
            // (bar-adaptive), or this write came as a message: put the value
            // where the poller reads doorbells, and wake it if it sleeps.
            let _ = page.store(value, GuestAddress(DOORBELLS + off), Ordering::Release);
            if self.db.sleeping {
                self.wake_poller();
            }
            return;
        }
        if self.regs.csts & 1 == 0 {
            return;
        }
        let q = &self.queues;
        let size = if is_cq {
            q.cqs.get(qid).copied().flatten().map(|q| q.size)
        } else {
            q.sqs.get(qid).copied().flatten().map(|q| q.size)
        };
        let Some(size) = size else {
            self.st.bad_doorbells += 1;
            self.event(0, 0, 1); // error: write to an invalid doorbell register
            return;
        };
        if value >= size as u32 {
            self.st.bad_doorbells += 1;
            self.event(0, 1, 1); // error: invalid doorbell write value
            return;
        }
        if qid > 0 && self.db.shadow.is_some() {
            // Shadow doorbells (shm, ioeventfd): the shadow holds the newest
            // value, and a register write only asks the controller to look
            // (the EventIdx rule). Its value may be older than tails already
            // served from the shadow: over vfio-user the write is a posted
            // message and can arrive late. Taken as the tail, it would make
            // the controller serve the whole ring again. (ioeventfd: a
            // doorbell that was to be an ioeventfd but exited, the host could
            // not install it, is served the ioeventfd way, so that EventIdx
            // keeps asking for the next one.)
            if self.mode() == DoorbellMode::Ioeventfd {
                self.serve_kicked();
            } else {
                self.poll_shadow();
                if self.db.sleeping {
                    // adaptive, and this doorbell was no ioeventfd (mpqemu,
                    // ioregionfd, or one the host could not install): wake
                    // the poller through its eventfd. poll_shadow just put
                    // EventIdx behind the tail, so the next submissions are
                    // polled again instead of each exiting.
                    self.wake_poller();
                }
            }
            return;
        }
        if let Some(r) = self.rec.as_deref_mut() {
            r.doorbell(qid, is_cq, value); // `state/`: before it is served
        }
        if is_cq {
            self.queues.cqs[qid].as_mut().unwrap().head = value as u16;
            if qid == 0 {
                self.deliver_events();
            }
            // Completions may have been waiting for room (file backend ones too).
            self.reap_io();
            for sqid in 0..self.queues.sqs.len() {
                if self.queues.sqs[sqid].is_some_and(|s| s.cqid as usize == qid && s.head != s.tail) {
                    self.process_sq(sqid);
                }
            }
            // The reap freed slots an SQ on another CQ may be waiting for.
            self.serve_slot_waiters();
        } else {
            self.queues.sqs[qid].as_mut().unwrap().tail = value as u16;
            self.process_sq(qid);
        }
    }

    /// shm mode: reads the shadow doorbells of the I/O queues and serves
    /// what they show. True if there was work.
    pub(super) fn poll_shadow(&mut self) -> bool {
        let Some((db, ei)) = self.db.shadow else { return false };
        let mut busy = false;
        for qid in self.queues.io_sq_ids() {
            let Some((sq_head, sq_tail, sq_size, cqid)) = self.queues.sq_fields(qid) else { continue };
            let Ok(tail) = self.mem.load_u32(db + qid as u64 * 8, Ordering::Acquire) else { continue };
            if let Ok(head) = self.mem.load_u32(db + cqid as u64 * 8 + 4, Ordering::Acquire) {
                if let Some(cq) = self.queues.cqs[cqid].as_mut() {
                    if head < cq.size as u32 && head != cq.head as u32 {
                        // EventIdx one behind the head seen before this one (see
                        // below), once the one there lags.
                        let at = ei + cqid as u64 * 8 + 4;
                        if event_idx_lags(self.mem.load_u32(at, Ordering::Relaxed).ok(), head, cq.size as u32) {
                            let ev = queue::prev(cq.head as u32, cq.size as u32);
                            let _ = self.mem.store_u32(ev, at, Ordering::Release);
                        }
                        cq.head = head as u16;
                    }
                }
            }
            if tail == sq_tail as u32 && sq_head == sq_tail {
                continue;
            }
            if tail >= sq_size as u32 {
                let _ = self.mem.store_u32(sq_tail as u32, db + qid as u64 * 8, Ordering::Release);
                self.refuse_tail();
                continue;
            }
            // EventIdx goes one behind the tail seen *before* this one. The
            // driver's last written value is never behind a tail the
            // controller has read, so EventIdx stays out of every range the
            // driver crosses (unless it runs a queue length ahead): a driver
            // that follows the rule never rings. Setting it behind the new
            // tail instead races: the driver may read it right after the
            // controller took its write, and ring for nothing.
            // It is moved only once it lags half a queue behind the tail
            // (`event_idx_lags`), not on each new tail: every store makes the
            // driver fetch that line again after its fence, on its hot path.
            let at = ei + qid as u64 * 8;
            if event_idx_lags(self.mem.load_u32(at, Ordering::Relaxed).ok(), tail, sq_size as u32) {
                let ev = queue::prev(sq_tail as u32, sq_size as u32);
                let _ = self.mem.store_u32(ev, at, Ordering::Release);
            }
            self.queues.sqs[qid].as_mut().unwrap().tail = tail as u16;
            busy |= self.process_sq(qid);
        }
        busy
    }

    /// The doorbell words a poller looks at between its passes, and the
    /// memory they are in: the shadow ones of the I/O queues (shm,
    /// adaptive), or every queue's in BAR0's shared page (bar,
    /// bar-adaptive). Each should still hold the SQ tail and CQ head this
    /// controller took last: a word written since, even while the watch is
    /// made, reads as changed. None before there are doorbells in memory.
    fn watch_words(&self) -> Option<(&crate::GuestMem, impl Iterator<Item = (u64, u64, u64)> + '_)> {
        let q = &self.queues;
        // auto with shadow doorbells: the I/O queues' are the shadow's (the
        // admin queue's, in the page, wait for the next locked pass).
        let (mem, base, sqs) = match (self.db.bar_page.is_some(), self.db.shadow) {
            (_, Some((db, _))) => (&self.mem, db, q.io_sq_ids()),
            (true, None) => (self.db.bar_mem.as_ref()?, DOORBELLS, q.sq_ids()),
            (false, None) => return None,
        };
        let word = move |id: usize| {
            let (mut mask, mut want) = (0u64, 0u64);
            if let Some(sq) = q.sqs.get(id).and_then(|s| s.as_ref()) {
                (mask, want) = (0xffff_ffff, sq.tail as u64);
            }
            if let Some(cq) = q.cqs.get(id).and_then(|c| c.as_ref()) {
                (mask, want) = (mask | 0xffff_ffff << 32, want | (cq.head as u64) << 32);
            }
            (base + id as u64 * 8, mask, want)
        };
        // Each SQ's word and its CQ's (the same one when the ids match).
        let ids = sqs.flat_map(move |id| [Some(id), q.sq_fields(id).map(|f| f.3).filter(|&c| c != id)]);
        Some((mem, ids.flatten().map(word)))
    }

    /// The watch of the doorbell words (`watch_words`) a poller should go on
    /// with: `w` set to the words as they should be now, while it watches
    /// this controller's memory; a new one otherwise (none yet, or the
    /// memory was replaced or a client unmapped it: the old one is not kept
    /// mapped).
    pub(super) fn rewatch(&self, w: Option<crate::mem::Watch>) -> crate::mem::Watch {
        let Some((mem, words)) = self.watch_words() else { return Default::default() };
        match w {
            Some(mut w) if w.of(mem) => {
                w.set(words);
                w
            }
            _ => mem.watch(words),
        }
    }

    /// A tail beyond the queue read from a shared doorbell word: counted and
    /// raised as an Invalid Doorbell Write Value event. The caller has put
    /// the word back to the last good tail, so the event is raised once.
    fn refuse_tail(&mut self) {
        self.st.bad_doorbells += 1;
        self.event(0, 1, 1);
    }

    /// bar mode: puts queue `qid`'s SQ tail (or CQ head) word of the shared
    /// page back to 0, on Create and Delete. A new queue's tail and head
    /// start at 0; the word the guest last wrote for a deleted queue of the
    /// same id would otherwise be taken for the new queue's tail (stale
    /// commands served) or head (entries taken as reaped). The shadow
    /// doorbells of shm and ioeventfd are zeroed on Create by `sync_shadow`.
    pub(super) fn zero_bar_doorbell(&mut self, qid: usize, cq: bool) {
        if let Some(page) = &self.db.bar_page {
            let off = DOORBELLS + qid as u64 * 8 + if cq { 4 } else { 0 };
            let _ = page.store(0u32, GuestAddress(off), Ordering::Release);
        }
    }

    /// Whether queue `qid`'s doorbells are BAR0's page: every queue's in
    /// bar and bar-adaptive; in auto the admin queue's, and the others'
    /// until the driver configures shadow doorbells.
    pub(super) fn page_doorbells(&self, qid: usize) -> bool {
        self.db.bar_page.is_some() && (qid == 0 || self.db.shadow.is_none())
    }

    /// Resuming (`state/resume.rs`): CQ `qid`'s head as the driver last
    /// wrote it where its doorbells are memory (BAR0's page, or the shadow
    /// doorbells of an I/O queue), if inside a queue of `size` entries.
    /// Recorded only with a configuration, the state memory's may be a lap
    /// old, and completions posted against it could overrun the driver.
    pub(super) fn memory_cq_head(&self, qid: usize, size: u16) -> Option<u16> {
        let off = qid as u64 * 8 + 4;
        let head = if self.page_doorbells(qid) {
            self.db.bar_load(DOORBELLS + off)
        } else {
            let (db, _) = self.db.shadow.filter(|_| qid > 0)?;
            self.mem.load_u32(db + off, Ordering::Acquire).ok()
        };
        head.filter(|&h| h < size as u32).map(|h| h as u16)
    }

    /// bar mode: the doorbells are the words of the shared page; serve what
    /// they show, admin queue included. (auto, once the driver configured
    /// shadow doorbells: the I/O queues are the shadow's, `poll_shadow`.)
    pub(super) fn poll_bar(&mut self) -> bool {
        if self.db.bar_page.is_none() {
            return false;
        }
        let mut busy = false;
        let shadowed = self.db.shadow.is_some();
        for qid in self.queues.sq_ids() {
            if shadowed && qid > 0 {
                break; // ascending: the rest are I/O queues
            }
            let Some((sq_head, sq_tail, sq_size, cqid)) = self.queues.sq_fields(qid) else { continue };
            let head = self.db.bar_load(DOORBELLS + cqid as u64 * 8 + 4);
            let tail = self.db.bar_load(DOORBELLS + qid as u64 * 8);
            if let (Some(head), Some(cq)) = (head, self.queues.cqs[cqid].as_mut()) {
                if head < cq.size as u32 && head != cq.head as u32 {
                    cq.head = head as u16;
                    if cqid == 0 {
                        self.deliver_events();
                    }
                }
            }
            let Some(tail) = tail else { continue };
            if tail == sq_tail as u32 && sq_head == sq_tail {
                continue;
            }
            if tail >= sq_size as u32 {
                let page = self.db.bar_page.as_ref().unwrap();
                let _ = page.store(sq_tail as u32, GuestAddress(DOORBELLS + qid as u64 * 8), Ordering::Release);
                self.refuse_tail();
                continue;
            }
            self.queues.sqs[qid].as_mut().unwrap().tail = tail as u16;
            busy |= self.process_sq(qid);
        }
        busy
    }

    /// ioeventfd mode: serves every I/O queue from its shadow tail and
    /// publishes EventIdx = the tail served (ring me next time); where a
    /// full CQ holds an SQ's commands back, that CQ's EventIdx asks for the
    /// next head (ring me when you free an entry); then looks again. The
    /// heads are taken and their EventIdx set per CQ, after every SQ was
    /// served: set per SQ, a later SQ with nothing held took back the
    /// request an earlier SQ on the same CQ made, and its commands waited
    /// for a doorbell that never came.
    pub(super) fn serve_kicked(&mut self) {
        let Some((db, ei)) = self.db.shadow else { return };
        let cq_ids =
            |c: &Core| -> Vec<usize> { (1..c.queues.cqs.len()).filter(|&q| c.queues.cqs[q].is_some()).collect() };
        loop {
            for cqid in cq_ids(self) {
                if let Ok(head) = self.mem.load_u32(db + cqid as u64 * 8 + 4, Ordering::Acquire) {
                    let cq = self.queues.cqs[cqid].as_mut().unwrap();
                    if head < cq.size as u32 {
                        cq.head = head as u16;
                    }
                }
            }
            let mut served = Vec::new();
            for qid in self.queues.io_sq_ids() {
                let Some(sq) = self.queues.sqs[qid] else { continue };
                let Ok(tail) = self.mem.load_u32(db + qid as u64 * 8, Ordering::Acquire) else { continue };
                if tail >= sq.size as u32 {
                    let _ = self.mem.store_u32(sq.tail as u32, db + qid as u64 * 8, Ordering::Release);
                    self.refuse_tail();
                    continue;
                }
                self.queues.sqs[qid].as_mut().unwrap().tail = tail as u16;
                self.process_sq(qid);
                let _ = self.mem.store_u32(tail, ei + qid as u64 * 8, Ordering::SeqCst);
                served.push((qid, tail));
            }
            // Each CQ's EventIdx: at the head where commands wait for room, behind it otherwise.
            let mut held_cqs = Vec::new();
            for cqid in cq_ids(self) {
                let cq = self.queues.cqs[cqid].unwrap();
                let held = self
                    .queues
                    .io_sq_ids()
                    .any(|q| self.queues.sqs[q].is_some_and(|s| s.cqid as usize == cqid && s.head != s.tail));
                let ev = if held { cq.head as u32 } else { queue::prev(cq.head as u32, cq.size as u32) };
                let _ = self.mem.store_u32(ev, ei + cqid as u64 * 8 + 4, Ordering::SeqCst);
                if held {
                    held_cqs.push((cqid, cq.head as u32));
                }
            }
            // The driver stores, fences, reads EventIdx; this side stores
            // EventIdx, fences, reads the shadow: one of the two sees the other.
            std::sync::atomic::fence(Ordering::SeqCst);
            let tail_moved = served
                .iter()
                .any(|&(q, t)| self.mem.load_u32(db + q as u64 * 8, Ordering::Acquire).is_ok_and(|x| x != t));
            let head_moved = held_cqs
                .iter()
                .any(|&(c, h)| self.mem.load_u32(db + c as u64 * 8 + 4, Ordering::Acquire).is_ok_and(|x| x != h));
            if !tail_moved && !head_moved {
                return;
            }
        }
    }

    /// Commands read from an SQ but not completed for want of CQ room (or
    /// for a timed completion's room owed): a poller keeps polling for them.
    /// (Completions the timer wheel holds are `timing.rs`'s: a poller does
    /// not sleep past their due time.)
    pub(super) fn held_for_room(&self) -> bool {
        self.queues.sq_ids().filter_map(|q| self.queues.sqs[q].as_ref()).any(|s| s.head != s.tail)
    }

    /// Adds what the doorbells' eventfd counted to the kicks, less the
    /// wake-ups this side wrote. Only from the thread that waits on that
    /// eventfd, or while no device thread runs: a read from anywhere else
    /// can take the wake-up a sleeping poller waits for.
    pub(super) fn drain_kicks(&mut self) {
        if let Some(k) = &self.db.kick {
            let n = k.read().unwrap_or(0);
            if self.group == 0 {
                self.db.own_wakes += self.raised.take_wakes(); // other groups' events
            }
            let own = n.min(self.db.own_wakes);
            self.db.own_wakes -= own;
            self.st.kicks += n - own;
            if self.db.shadow.is_none() {
                self.lost_doorbells(n - own);
            }
        }
    }

    /// `n` I/O doorbell kicks came while no shadow doorbells are set. On a
    /// static host (a device process, every I/O doorbell an ioeventfd the
    /// client installed at attach) each was a register write whose value
    /// the kick lost: a driver that does not configure Doorbell Buffer
    /// Config (SPDK) would wait for completions that never come. The
    /// controller reports Controller Fatal Status instead, with a log line
    /// naming the modes that serve such a driver, and the driver resets.
    pub(super) fn lost_doorbells(&mut self, n: u64) {
        if n == 0 || !self.static_ioevents() {
            return;
        }
        if self.regs.csts & 2 == 0 {
            log::error!(
                "nvme: an I/O doorbell rang before Doorbell Buffer Config and its value is lost: doorbell={} in a \
                 device process serves only drivers that configure shadow doorbells before I/O (Linux); others \
                 need the default mode (auto), bar or mmio. Controller Fatal Status set.",
                self.mode()
            );
        }
        self.regs.csts |= 2;
    }

    /// ioeventfd mode: the I/O queue doorbells of `qid` as ioeventfds (a
    /// static host's were all registered at attach): SQ `qid`'s tail and CQ
    /// `qid`'s head, each by the queue group that holds that queue, so that
    /// its kick wakes the poller that serves it.
    pub(super) fn register_doorbells(&mut self, qid: usize) {
        if !self.mode().kicked() || self.db.shadow.is_none() || qid == 0 || self.static_ioevents() {
            return;
        }
        let (sq, cq) = (
            self.queues.sqs.get(qid).is_some_and(|q| q.is_some()),
            self.queues.cqs.get(qid).is_some_and(|q| q.is_some()),
        );
        self.register_queue(qid, sq, cq);
    }

    /// A deleted queue's doorbell is no ioeventfd of this group any more: a
    /// queue of the same id created later may be in another group, whose
    /// registration the host would refuse while this one stands.
    pub(super) fn unregister_doorbell(&mut self, qid: usize, cq: bool) {
        if self.static_ioevents() {
            return; // a static host's stay for the controller's lifetime
        }
        let off = DOORBELLS + qid as u64 * 8 + if cq { 4 } else { 0 };
        let (Some(kick), Some(io)) = (self.db.kick.clone(), self.db.ioevents.clone()) else { return };
        if let Some(i) = self.db.registered.iter().position(|&o| o == off) {
            self.db.registered.swap_remove(i);
            let _ = io.unregister(crate::IoEventSpec { bar: 0, offset: off, len: 4, datamatch: None }, &kick);
        }
    }

    /// True if the host announces ioeventfds once (a device process):
    /// ioeventfd mode then registers every I/O doorbell at attach.
    pub(super) fn static_ioevents(&self) -> bool {
        self.mode().kicked() && self.db.ioevents.as_ref().is_some_and(|io| io.static_only())
    }

    /// At attach, on a static host in ioeventfd mode: the eventfd of the
    /// doorbells (made once, kept) and the SQ tail and CQ head doorbells of
    /// every I/O queue the controller offers, whether the queue exists or
    /// not: the host announces them only now. Registering again (the next
    /// attach) adds nothing.
    pub(super) fn register_static(&mut self) {
        if !self.static_ioevents() {
            return;
        }
        if self.db.kick.is_none() {
            match EventFd::new(libc::EFD_NONBLOCK) {
                Ok(k) => self.db.kick = Some(Arc::new(k)),
                Err(e) => return log::warn!("nvme: eventfd for the doorbells: {e}; they exit"),
            }
        }
        for qid in 1..=MAX_IO_QUEUES as usize {
            self.register_queue(qid, true, true);
        }
    }

    /// For a device process's next client (no device thread runs): the
    /// doorbells announced once, registered again on a new eventfd; the old
    /// one, which the last client may keep, is no longer read.
    pub(super) fn renew_ioevents(&mut self) {
        if !self.static_ioevents() {
            return;
        }
        self.unregister_all();
        self.db.kick = None;
        self.db.own_wakes = 0;
        self.register_static();
    }

    /// For a device process's next client (no device thread runs): `page`
    /// becomes the doorbell page, holding what the old one holds now; the
    /// last client's mapping of the old one reaches nothing any more.
    pub(super) fn replace_bar_page(&mut self, page: GuestMemoryMmap) {
        let mut words = [0u8; 0x1000];
        if let Some(old) = &self.db.bar_page {
            let _ = old.read_slice(&mut words, GuestAddress(DOORBELLS));
        }
        let _ = page.write_slice(&words, GuestAddress(DOORBELLS));
        self.db.set_bar_page(Some(page));
        for s in self.shards.clone() {
            // The other queue groups poll the same page (`shards.rs`).
            let mut s = crate::lock(&s);
            let p = self.db.bar_page.clone();
            s.db.set_bar_page(p);
        }
    }

    /// Registers queue `qid`'s SQ tail and CQ head doorbells, as asked
    /// (those not registered yet).
    fn register_queue(&mut self, qid: usize, sq: bool, cq: bool) {
        let (Some(kick), Some(io)) = (self.db.kick.clone(), self.db.ioevents.clone()) else { return };
        let offs = [(sq, DOORBELLS + qid as u64 * 8), (cq, DOORBELLS + qid as u64 * 8 + 4)];
        for off in offs.into_iter().filter(|o| o.0).map(|o| o.1) {
            if self.db.registered.contains(&off) {
                continue;
            }
            let spec = crate::IoEventSpec { bar: 0, offset: off, len: 4, datamatch: None };
            match io.register(spec, &kick) {
                Ok(()) => self.db.registered.push(off),
                Err(e) => log::warn!("nvme: no ioeventfd for the doorbell at {off:#x}: {e}; it exits"),
            }
        }
    }

    fn unregister_all(&mut self) {
        let (Some(kick), Some(io)) = (self.db.kick.clone(), self.db.ioevents.clone()) else { return };
        for off in self.db.registered.drain(..) {
            let _ = io.unregister(crate::IoEventSpec { bar: 0, offset: off, len: 4, datamatch: None }, &kick);
        }
    }
}

/// shm, adaptive awake: whether the EventIdx word `ev` (as read) is to be
/// moved up behind `now`, the tail (or head) just read from the shadow.
/// Left where it is, a driver crosses it only when one doorbell write
/// moves its value over what is left of the queue past the lag, which a
/// driver with fewer than half a queue outstanding never does; a crossing
/// costs one doorbell register write, which is served as any. A word at
/// `now` (the next submission would cross it) or outside the queue (the
/// driver wrote it) is moved too.
fn event_idx_lags(ev: Option<u32>, now: u32, size: u32) -> bool {
    match ev {
        Some(ev) if ev < size => {
            let lag = (now + size - ev) % size;
            lag == 0 || lag >= size / 2
        }
        _ => true,
    }
}

/// Idle passes that only look at the doorbell words ([`Core::rewatch`],
/// without the core lock) between two locked ones. A locked pass (the
/// lock taken and given back, the file backend, coalesced interrupts,
/// events) takes several times as long as a look, and a submission that
/// lands during one waits for its end: at 4 KiB QD1 on the null backend
/// this took the p50 from 555-556 ns to 540-547 ns (bar mode in the same
/// runs, unchanged: 531-537 ns).
pub(super) const LOOKS_PER_PASS: u32 = 16;

/// A poller's looks at the doorbell words between its locked passes.
#[derive(Default)]
pub(super) struct Looks {
    /// Kept, not made anew, while work comes: set again when an idle begins.
    watch: Option<crate::mem::Watch>,
    /// The last locked pass found nothing and set `watch`.
    watching: bool,
    /// Looks since that pass.
    looks: u32,
}

impl Looks {
    /// True if this pass need only look: idle, no word changed, and no
    /// locked pass due.
    #[inline]
    pub(super) fn only_look(&mut self) -> bool {
        let only = self.watching && self.looks < LOOKS_PER_PASS && self.watch.as_ref().is_some_and(|w| !w.changed());
        self.looks = if only { self.looks + 1 } else { 0 };
        only
    }

    /// After a locked pass: `idle` if it found nothing (the looks begin,
    /// the words as `c` took them), otherwise no looks until the next idle.
    pub(super) fn passed(&mut self, c: &Core, idle: bool) {
        self.watching = idle;
        if idle {
            self.watch = Some(c.rewatch(self.watch.take()));
        }
    }
}

/// What one poller pass over a queue group's core found ([`poll_pass`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) struct Pass {
    /// Work was done (or file operations are in flight): no idling.
    pub busy: bool,
    /// A queue group with no queue to poll, idle for a while (`shards.rs`).
    pub unused: bool,
    /// From a locked pass: when the next timed completion is due, as a
    /// wait from now (`timing.rs`); None on a look-only pass or with none held.
    pub timed: Option<std::time::Duration>,
}

/// A poller's state for one queue group's core, kept between its passes.
#[derive(Default)]
pub(super) struct PassState {
    /// Passes in a row that found nothing.
    pub idle: u32,
    looks: Looks,
}

/// Idle passes after which a poller stops spinning and gives up its CPU.
pub(super) const IDLE_PASSES: u32 = 4096;

/// One pass of a poller (`shm`, `bar`) over a queue group's core: a look at
/// the doorbell words, or a locked pass (doorbells, file backend
/// completions, coalesced interrupts, group 0's raised events). The same
/// for a poller thread of its own ([`spawn_poller`]) and a pool thread
/// (`pool.rs`) that serves several cores.
pub(super) fn poll_pass(core: &std::sync::Mutex<Core>, s: &mut PassState) -> Pass {
    let pass = if s.looks.only_look() {
        Pass::default()
    } else {
        let mut c = crate::lock(core);
        c.st.polls += 1;
        let busy = if c.db.bar_page.is_some() { c.poll_bar() } else { c.poll_shadow() };
        // File backend completions; busy (no idling) while operations are in flight.
        let busy = c.io_progress() | busy;
        c.flush_coalesced();
        c.take_raised();
        s.looks.passed(&c, !busy);
        // Looked at only once idle (it walks the group's queues).
        let unused = !busy && s.idle >= IDLE_PASSES && c.group_unused();
        Pass { busy, unused, timed: c.timed_wait() }
    };
    s.idle = if pass.busy { 0 } else { s.idle.saturating_add(1) };
    pass
}

/// A poller (`shm`, `bar`) of one queue group's core, until `stop`. Group 0's
/// also delivers the asynchronous events the other groups raised.
pub(super) fn spawn_poller(
    core: Arc<std::sync::Mutex<Core>>,
    stop: Arc<AtomicBool>,
) -> std::io::Result<std::thread::JoinHandle<()>> {
    std::thread::Builder::new().name("nvme-poller".into()).spawn(move || {
        crate::sandbox::enter(crate::sandbox::Role::Device);
        let mut s = PassState::default();
        while !stop.load(Ordering::Relaxed) {
            let p = poll_pass(&core, &mut s);
            if p.busy {
            } else if s.idle <= IDLE_PASSES {
                std::hint::spin_loop();
            } else if p.unused {
                // A queue group with no queue to poll: leave the core to the others;
                // a queue created meanwhile waits at most this long.
                std::thread::sleep(std::time::Duration::from_millis(1));
            } else {
                // Nothing for a while: let the other threads run.
                std::thread::yield_now();
            }
        }
    })
}

/// Reads an eventfd's count (blocks while it is 0), retrying when a signal
/// interrupts it.
pub(super) fn read_eventfd(fd: &EventFd) -> std::io::Result<u64> {
    loop {
        match fd.read() {
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            r => return r,
        }
    }
}

/// When a device thread looks again at operations the kernel refused to
/// take (no completion will wake it for them): 1 ms after the first
/// refusal, doubling to 100 ms while they are refused.
#[derive(Debug, Default)]
pub(super) struct Retry(Option<std::time::Duration>);

impl Retry {
    /// How long the thread may sleep (None: until woken).
    pub(super) fn after(&self) -> Option<std::time::Duration> {
        self.0
    }
    /// After a pass: `stalled`, operations still wait in the ring.
    pub(super) fn next(&mut self, stalled: bool) {
        let max = std::time::Duration::from_millis(100);
        self.0 = stalled.then(|| self.0.map_or(std::time::Duration::from_millis(1), |d| (d * 2).min(max)));
    }
}

/// Sleeps until `a` or `b` is readable, or `timeout` passed; which ones are.
pub(super) fn wait_either(
    a: &EventFd,
    b: Option<&EventFd>,
    timeout: Option<std::time::Duration>,
) -> std::io::Result<(bool, bool)> {
    use std::os::fd::AsRawFd;
    let fd = |e: &EventFd| libc::pollfd { fd: e.as_raw_fd(), events: libc::POLLIN, revents: 0 };
    let mut fds = [fd(a), b.map_or(libc::pollfd { fd: -1, events: 0, revents: 0 }, fd)];
    // ppoll, not poll: a timeout in microseconds (poll's milliseconds
    // turned bar-adaptive's 100-800 us steps into no sleep at all).
    let end = timeout.map(|t| std::time::Instant::now() + t);
    loop {
        let left = end.map(|e| e.saturating_duration_since(std::time::Instant::now()));
        let ts = left.map(|t| libc::timespec {
            tv_sec: t.as_secs().min(i64::MAX as u64) as libc::time_t,
            tv_nsec: t.subsec_nanos() as libc::c_long,
        });
        let tsp = ts.as_ref().map_or(std::ptr::null(), |t| t as *const libc::timespec);
        // SAFETY: two valid pollfd entries (a negative fd is ignored), a
        // timespec that outlives the call or null, no signal mask.
        if unsafe { libc::ppoll(fds.as_mut_ptr(), 2, tsp, std::ptr::null()) } >= 0 {
            let ready = |p: &libc::pollfd| p.revents & (libc::POLLIN | libc::POLLERR | libc::POLLHUP) != 0;
            return Ok((ready(&fds[0]), ready(&fds[1])));
        }
        let e = std::io::Error::last_os_error();
        if e.kind() != std::io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

/// BAR0 as a memfd, mapped here at "address" 0, for the bar doorbell mode;
/// sealed against shrinking and growing.
pub(super) fn bar_memory() -> Result<(GuestMemoryMmap, std::fs::File)> {
    use std::os::fd::FromRawFd;
    let name = std::ffi::CString::new("iopath-nvme-bar0").unwrap();
    // SAFETY: memfd_create with a valid name; the fd is owned by the File.
    let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) };
    if fd < 0 {
        return Err(Error::io("nvme: memfd_create", std::io::Error::last_os_error()));
    }
    // SAFETY: a fresh descriptor nobody else owns.
    let f = unsafe { std::fs::File::from_raw_fd(fd) };
    f.set_len(BAR0_SIZE).map_err(|e| Error::io("nvme: doorbell page size", e))?;
    // Its size is final; a client that maps it must not see it shrink (a
    // truncated mapping is SIGBUS), and no client may add seals of its own
    // (F_SEAL_FUTURE_WRITE would refuse the next client's writable mapping).
    let seals = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;
    // SAFETY: `fd` stays open while `f` owns it (until this function returns
    // or hands `f` on); F_ADD_SEALS takes an integer argument, so no memory
    // is passed to the kernel.
    if unsafe { libc::fcntl(fd, libc::F_ADD_SEALS, seals) } < 0 {
        return Err(Error::io("nvme: sealing BAR0", std::io::Error::last_os_error()));
    }
    let fo = vm_memory::FileOffset::new(f.try_clone().map_err(|e| Error::io("nvme: doorbell page fd", e))?, 0);
    let region = vm_memory::MmapRegion::from_file(fo, BAR0_SIZE as usize)
        .map_err(|e| Error::Host(format!("nvme: mmap of the doorbell page: {e}")))?;
    let r = vm_memory::GuestRegionMmap::new(region, GuestAddress(0))
        .ok_or_else(|| Error::Host("nvme: doorbell page region".into()))?;
    let m = GuestMemoryMmap::from_regions(vec![r]).map_err(|e| Error::Host(format!("nvme: doorbell page: {e}")))?;
    Ok((m, f))
}

#[cfg(test)]
mod bar_memory_tests {
    #[test]
    fn bar0_memfd_refuses_to_shrink_grow_or_take_more_seals() {
        use std::os::fd::AsRawFd;
        let (_mem, f) = super::bar_memory().unwrap();
        assert_eq!(f.set_len(0).unwrap_err().raw_os_error(), Some(libc::EPERM), "shrink");
        assert_eq!(f.set_len(super::BAR0_SIZE * 2).unwrap_err().raw_os_error(), Some(libc::EPERM), "grow");
        assert_eq!(f.metadata().unwrap().len(), super::BAR0_SIZE);
        // A client's F_SEAL_FUTURE_WRITE would refuse every later client's writable mmap.
        // SAFETY: F_ADD_SEALS on an fd we own.
        let r = unsafe { libc::fcntl(f.as_raw_fd(), libc::F_ADD_SEALS, libc::F_SEAL_FUTURE_WRITE) };
        assert_eq!((r, std::io::Error::last_os_error().raw_os_error()), (-1, Some(libc::EPERM)), "F_SEAL_SEAL");
    }
}

#[cfg(test)]
mod event_idx_tests {
    use super::event_idx_lags;

    #[test]
    fn event_idx_moves_once_it_lags_half_a_queue_or_is_out_of_the_queue() {
        assert!(!event_idx_lags(Some(3), 4, 64), "one behind");
        assert!(!event_idx_lags(Some(3), 34, 64), "31 behind");
        assert!(event_idx_lags(Some(3), 35, 64), "32 behind");
        assert!(!event_idx_lags(Some(60), 10, 64), "14 behind, across the wrap");
        assert!(event_idx_lags(Some(40), 8, 64), "32 behind, across the wrap");
        assert!(event_idx_lags(Some(4), 4, 64), "at the tail: the next submission would cross it");
        assert!(event_idx_lags(Some(64), 4, 64), "outside the queue");
        assert!(event_idx_lags(None, 4, 64), "unreadable");
    }
}
