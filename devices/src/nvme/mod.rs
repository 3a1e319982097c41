//! An NVMe controller (NVMe 1.4 subset) with one namespace.
//!
//! BAR0 (64-bit memory, 16 KiB) holds the controller registers (CAP, VS,
//! INTMS/INTMC, CC, CSTS, AQA, ASQ, ACQ) and, from 0x1000, the doorbells
//! (stride 4: SQ y tail at 0x1000 + 8y, CQ y head at 0x1000 + 8y + 4).
//! Admin: Identify (controller, namespace, active namespace list),
//! Create/Delete I/O SQ and CQ, Get/Set Features (number of queues,
//! interrupt coalescing, arbitration...), Get Log Page (error, SMART,
//! firmware), Abort, Asynchronous Event Request, Doorbell Buffer Config.
//! I/O: Read, Write, Flush, Write Zeroes, Dataset Management, with PRP1/PRP2
//! and PRP lists. Completions carry phase tags for polling drivers; a CQ
//! created with IEN=1 signals its MSI-X vector (65 vectors, table at BAR0
//! 0x2000, PBA at 0x3000): the host turns each vector into a KVM irqfd on
//! the MSI route the guest programmed. A vector that is masked (or MSI-X
//! off) keeps its pending bit and fires when unmasked.
//!
//! Doorbell modes (how I/O queue doorbells reach the controller):
//! - `mmio`: every doorbell write exits to the VMM, and the vCPU thread
//!   processes the queue at once. Doorbell Buffer Config is not offered.
//! - `shm`: Doorbell Buffer Config is offered; a device thread polls the
//!   shadow doorbells in guest RAM and keeps each EventIdx behind the tail,
//!   so a driver that follows the EventIdx rule never writes the MMIO
//!   doorbell: no exit per I/O.
//! - `bar`: the doorbell page of BAR0 is memory the controller shares (a
//!   memfd): the host maps it into the guest at BAR0+0x1000, so a driver's
//!   plain MMIO doorbell stores land in it without an exit, and the polling
//!   thread reads them there, admin queue included. No Doorbell Buffer
//!   Config is needed (SPDK's mappable BAR0, vfio-user sparse mmap).
//! - `ioeventfd`: Doorbell Buffer Config is offered and every I/O doorbell
//!   is a KVM ioeventfd (one eventfd for all of them). An ioeventfd loses
//!   the written value, so the device thread, woken by it, takes the tails
//!   from the shadow doorbells; it keeps EventIdx at the tail it served so
//!   the driver rings on its next submission, and re-reads the shadow after
//!   publishing EventIdx so a submission that raced with it is not missed.
//!   Until the driver configures the buffer, doorbell writes exit as in
//!   `mmio` (their value is needed).
//!
//! Every value from the guest is checked: queue ids and sizes, doorbell
//! values (an invalid one raises an asynchronous event), PRPs (must lie in
//! guest RAM), LBA ranges, opcodes. The controller answers with the NVMe
//! status the spec defines and goes on serving the other queues.

pub mod backend;
pub mod queue;

use crate::{le_fill, le_value, BarKind, BarSpec, Counter, DeviceContext, DeviceModelMut, GuestMemoryMmap, PciIds};
use backend::{Backend, BackendKind};
use queue::{post_cqe, prp_segments, queue_in_ram, read_sqe, status, Cq, Sq, Sqe, CQE_SIZE, PAGE, SQE_SIZE};
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use vm_memory::{Bytes, GuestAddress};
use vmm_sys_util::eventfd::EventFd;

pub const VENDOR: u16 = 0x1234;
pub const DEVICE: u16 = 0x10ed;
pub const CLASS: u32 = 0x010802;
pub const BAR0_SIZE: u64 = 16 << 10;
/// Queue pairs the controller offers (I/O), besides the admin pair.
pub const MAX_IO_QUEUES: u16 = 64;
/// Largest queue (entries).
pub const MQES: u16 = 4096;
/// Maximum data transfer: 2^MDTS pages = 128 KiB.
pub const MDTS: u8 = 5;
const AERL: usize = 4;
/// MSI-X vectors: one per queue pair, admin included.
pub const MSIX_VECTORS: usize = MAX_IO_QUEUES as usize + 1;
const MSIX_TABLE: u64 = 0x2000;
const MSIX_PBA: u64 = 0x3000;
/// Where the host lays out the MSI-X capability (the first and only one).
const MSIX_CAP: usize = 0x40;

const REG_INTMS: u64 = 0x0c;
const REG_INTMC: u64 = 0x10;
const REG_CC: u64 = 0x14;

const REG_AQA: u64 = 0x24;
const REG_ASQ: u64 = 0x28;
const REG_ACQ: u64 = 0x30;
const DOORBELLS: u64 = 0x1000;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DoorbellMode {
    Mmio,
    Ioeventfd,
    Shm,
    Bar,
}

impl std::str::FromStr for DoorbellMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "mmio" => Ok(DoorbellMode::Mmio),
            "ioeventfd" => Ok(DoorbellMode::Ioeventfd),
            "shm" => Ok(DoorbellMode::Shm),
            "bar" => Ok(DoorbellMode::Bar),
            _ => Err(format!("unknown doorbell mode {s:?} (mmio, ioeventfd, shm, bar)")),
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NvmeConfig {
    pub backend: BackendKind,
    /// Namespace size in bytes.
    pub size: u64,
    /// 512 or 4096.
    pub lba_size: u32,
    pub doorbell: DoorbellMode,
}

impl Default for NvmeConfig {
    fn default() -> Self {
        NvmeConfig { backend: BackendKind::Ram, size: 64 << 20, lba_size: 512, doorbell: DoorbellMode::Shm }
    }
}

#[derive(Default)]
struct Stats {
    admin: u64,
    io: u64,
    reads: u64,
    writes: u64,
    errors: u64,
    doorbell_writes: u64,
    bad_doorbells: u64,
    cq_full_waits: u64,
    polls: u64,
    kicks: u64,
    interrupts: u64,
}

/// Controller state shared by the vCPU thread (registers, doorbell writes)
/// and the polling thread (shm mode).
struct Core {
    mem: GuestMemoryMmap,
    cc: u32,
    csts: u32,
    aqa: u32,
    asq: u64,
    acq: u64,
    intms: u32,
    sqs: Vec<Option<Sq>>,
    cqs: Vec<Option<Cq>>,
    nsqa: u16,
    ncqa: u16,
    queues_created: bool,
    /// Shadow doorbell and EventIdx buffers (Doorbell Buffer Config).
    dbbuf: Option<(u64, u64)>,
    aer: Vec<u16>,
    events: VecDeque<u32>,
    backend: Backend,
    lba_shift: u32,
    nlbas: u64,
    /// Interrupt Coalescing (Set Features 0x08): THR in bits 7:0 (0-based
    /// completions), TIME in bits 15:8 (100 us units). Applied to I/O CQs
    /// where a device thread can keep time (shm, bar, ioeventfd).
    coalescing: u32,
    /// Per vector: completions not yet signalled, and since when.
    agg: Vec<(u32, Option<std::time::Instant>)>,
    mode: DoorbellMode,
    segs: Vec<(u64, u64)>,
    buf: Vec<u8>,
    bounce: backend::Bounce,
    st: Stats,
    /// ioeventfd mode: the eventfd on every I/O doorbell, and the host's registrar.
    kick: Option<Arc<EventFd>>,
    ioevents: Option<Arc<dyn crate::IoEvents>>,
    /// Doorbells registered as ioeventfds (offset in BAR0).
    registered: Vec<u64>,
    irq: Arc<dyn crate::Interrupts>,
    /// bar mode: BAR0 as shared memory (the doorbells at 0x1000) and its fd.
    bar_page: Option<(GuestMemoryMmap, std::fs::File)>,
    /// MSI-X table (address lo, hi, data, vector control per vector) and state.
    msix: Vec<u32>,
    msix_enabled: bool,
    msix_fmask: bool,
    pending: Vec<bool>,
    smart_read_units: u64,
    smart_write_units: u64,
}

pub struct Nvme {
    core: Arc<Mutex<Core>>,
    cfg: NvmeConfig,
    poller: Option<(Arc<AtomicBool>, std::thread::JoinHandle<()>)>,
    error: Option<String>,
}

impl Nvme {
    pub fn new(cfg: NvmeConfig) -> Result<Self, String> {
        if cfg.lba_size != 512 && cfg.lba_size != 4096 {
            return Err(format!("LBA size {} (512 or 4096)", cfg.lba_size));
        }
        if cfg.size < cfg.lba_size as u64 || cfg.size % cfg.lba_size as u64 != 0 {
            return Err(format!("namespace size {} is not a multiple of the LBA size", cfg.size));
        }
        let backend = Backend::open(&cfg.backend, cfg.size)?;
        let core = Core {
            mem: GuestMemoryMmap::default(),
            cc: 0,
            csts: 0,
            aqa: 0,
            asq: 0,
            acq: 0,
            intms: 0,
            sqs: vec![None; MAX_IO_QUEUES as usize + 1],
            cqs: vec![None; MAX_IO_QUEUES as usize + 1],
            nsqa: MAX_IO_QUEUES,
            ncqa: MAX_IO_QUEUES,
            queues_created: false,
            dbbuf: None,
            aer: Vec::new(),
            events: VecDeque::new(),
            backend,
            lba_shift: cfg.lba_size.trailing_zeros(),
            nlbas: cfg.size / cfg.lba_size as u64,
            coalescing: 0,
            agg: vec![(0, None); MSIX_VECTORS],
            mode: cfg.doorbell,
            segs: Vec::with_capacity(64),
            buf: Vec::new(),
            bounce: backend::Bounce::new(0),
            st: Stats::default(),
            kick: None,
            ioevents: None,
            registered: Vec::new(),
            irq: Arc::new(crate::NoInterrupts),
            bar_page: None,
            msix: (0..MSIX_VECTORS).flat_map(|_| [0, 0, 0, 1]).collect(),
            msix_enabled: false,
            msix_fmask: false,
            pending: vec![false; MSIX_VECTORS],
            smart_read_units: 0,
            smart_write_units: 0,
        };
        let mut core = core;
        if cfg.doorbell == DoorbellMode::Bar {
            core.bar_page = Some(bar_memory()?);
        }
        Ok(Nvme { core: Arc::new(Mutex::new(core)), cfg, poller: None, error: None })
    }

    fn cap() -> u64 {
        let mqes = (MQES - 1) as u64;
        let cqr = 1u64 << 16;
        let to = 20u64 << 24; // 10 s
        let css_nvm = 1u64 << 37;
        mqes | cqr | to | css_nvm // DSTRD 0, MPSMIN = MPSMAX = 0 (4 KiB)
    }

    fn start_poller(&mut self) {
        if self.poller.is_some() {
            return;
        }
        if self.cfg.doorbell == DoorbellMode::Ioeventfd {
            self.start_kicked();
            return;
        }
        if !matches!(self.cfg.doorbell, DoorbellMode::Shm | DoorbellMode::Bar) {
            return;
        }
        let stop = Arc::new(AtomicBool::new(false));
        let (core, stop2) = (self.core.clone(), stop.clone());
        let h = std::thread::Builder::new().name("nvme-poller".into()).spawn(move || {
            let mut idle = 0u32;
            while !stop2.load(Ordering::Relaxed) {
                let busy = {
                    let mut c = core.lock().unwrap();
                    c.st.polls += 1;
                    let busy = if c.bar_page.is_some() { c.poll_bar() } else { c.poll_shadow() };
                    c.flush_coalesced();
                    busy
                };
                if busy {
                    idle = 0;
                } else {
                    idle = idle.saturating_add(1);
                    if idle > 4096 {
                        // Nothing for a while: let the other threads run.
                        std::thread::yield_now();
                    } else {
                        std::hint::spin_loop();
                    }
                }
            }
        });
        match h {
            Ok(h) => self.poller = Some((stop, h)),
            Err(e) => self.error = Some(format!("nvme: cannot start the poller: {e}")),
        }
    }

    /// ioeventfd mode: a thread that sleeps on the doorbells' eventfd.
    fn start_kicked(&mut self) {
        let kick = match EventFd::new(0) {
            Ok(k) => Arc::new(k),
            Err(e) => {
                self.error = Some(format!("nvme: eventfd: {e}"));
                return;
            }
        };
        {
            let mut c = self.core.lock().unwrap();
            c.kick = Some(kick.clone());
            for qid in 1..c.sqs.len() {
                if c.sqs[qid].is_some() {
                    c.register_doorbells(qid);
                }
            }
        }
        let stop = Arc::new(AtomicBool::new(false));
        let (core, stop2) = (self.core.clone(), stop.clone());
        let h = std::thread::Builder::new().name("nvme-ioeventfd".into()).spawn(move || {
            while !stop2.load(Ordering::Relaxed) {
                let Ok(n) = kick.read() else { return };
                if stop2.load(Ordering::Relaxed) {
                    return; // woken to stop (that write is not a doorbell)
                }
                let mut c = core.lock().unwrap();
                c.st.kicks += n;
                c.serve_kicked();
                // No timer here: what the aggregation threshold holds goes out now.
                let time = c.coalescing & 0xff00;
                c.coalescing &= !0xff00;
                c.flush_coalesced();
                c.coalescing |= time;
            }
        });
        match h {
            Ok(h) => self.poller = Some((stop, h)),
            Err(e) => self.error = Some(format!("nvme: cannot start the ioeventfd thread: {e}")),
        }
    }

    fn stop_poller(&mut self) {
        if let Some((stop, h)) = self.poller.take() {
            stop.store(true, Ordering::Relaxed);
            let kick = {
                let mut c = self.core.lock().unwrap();
                c.unregister_all();
                c.kick.take()
            };
            if let Some(k) = kick {
                let _ = k.write(1); // wake the ioeventfd thread to see `stop`
            }
            let _ = h.join();
        }
    }

    fn write_cc(&mut self, v: u32) {
        let was = self.core.lock().unwrap().cc & 1;
        let en = v & 1;
        if was == 1 && en == 0 {
            self.stop_poller();
            self.core.lock().unwrap().reset_queues();
        }
        let started = {
            let mut c = self.core.lock().unwrap();
            c.cc = v;
            if v >> 14 & 3 != 0 {
                c.csts = (c.csts & !0xc) | 0x8; // shutdown complete
            }
            if was == 0 && en == 1 {
                c.enable()
            } else {
                if en == 0 {
                    c.csts &= !1;
                }
                false
            }
        };
        if started {
            self.start_poller();
        }
    }
}

impl Core {
    fn enable(&mut self) -> bool {
        let asqs = (self.aqa & 0xfff) + 1;
        let acqs = ((self.aqa >> 16) & 0xfff) + 1;
        let mps = self.cc >> 7 & 0xf;
        let iosqes = self.cc >> 16 & 0xf;
        let iocqes = self.cc >> 20 & 0xf;
        let css = self.cc >> 4 & 7;
        let ok = asqs >= 2
            && acqs >= 2
            && mps == 0
            && css == 0
            && (iosqes == 0 || iosqes == 6)
            && (iocqes == 0 || iocqes == 4)
            && queue_in_ram(&self.mem, self.asq, asqs as u64 * SQE_SIZE)
            && queue_in_ram(&self.mem, self.acq, acqs as u64 * CQE_SIZE);
        if !ok {
            self.csts |= 2; // controller fatal status
            log::warn!("nvme: enable refused: AQA {:#x} ASQ {:#x} ACQ {:#x} CC {:#x}", self.aqa, self.asq, self.acq, self.cc);
            return false;
        }
        self.sqs[0] = Some(Sq { gpa: self.asq, size: asqs as u16, head: 0, tail: 0, cqid: 0 });
        self.cqs[0] = Some(Cq { gpa: self.acq, size: acqs as u16, ..Default::default() });
        self.csts = 1;
        true
    }

    fn reset_queues(&mut self) {
        if let Some((page, _)) = &self.bar_page {
            let _ = page.write_slice(&[0u8; 4096], GuestAddress(DOORBELLS));
        }
        self.sqs.iter_mut().for_each(|q| *q = None);
        self.cqs.iter_mut().for_each(|q| *q = None);
        self.dbbuf = None;
        self.aer.clear();
        self.events.clear();
        self.queues_created = false;
        self.agg.iter_mut().for_each(|a| *a = (0, None));
        self.nsqa = MAX_IO_QUEUES;
        self.ncqa = MAX_IO_QUEUES;
        self.csts = 0;
    }

    fn event(&mut self, kind: u32, info: u32, log_page: u32) {
        self.events.push_back(kind | info << 8 | log_page << 16);
        self.deliver_events();
    }

    /// Completes outstanding AERs with queued events while the admin CQ has
    /// room (an event waits otherwise: it never overwrites an unreaped entry).
    fn deliver_events(&mut self) {
        while !self.events.is_empty() && !self.aer.is_empty() && self.cqs[0].is_some_and(|c| !c.full()) {
            let cid = self.aer.remove(0);
            let dw0 = self.events.pop_front().unwrap();
            self.complete(0, cid, dw0, status::SUCCESS);
        }
    }

    /// An MMIO doorbell write. `offset` is from the start of the doorbells.
    fn doorbell(&mut self, off: u64, value: u32) {
        self.st.doorbell_writes += 1;
        if let Some((page, _)) = &self.bar_page {
            // The page was not mapped into the guest (or this write came as a
            // message): put the value where the poller reads doorbells.
            let _ = page.store(value, GuestAddress(DOORBELLS + off), Ordering::Release);
            return;
        }
        if self.csts & 1 == 0 {
            return;
        }
        let qid = (off / 8) as usize;
        let is_cq = off % 8 == 4;
        let size = if is_cq { self.cqs.get(qid).copied().flatten().map(|q| q.size) } else { self.sqs.get(qid).copied().flatten().map(|q| q.size) };
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
        if is_cq {
            self.cqs[qid].as_mut().unwrap().head = value as u16;
            if qid == 0 {
                self.deliver_events();
            }
            // Completions may have been waiting for room.
            for sqid in 0..self.sqs.len() {
                if self.sqs[sqid].is_some_and(|s| s.cqid as usize == qid && s.head != s.tail) {
                    self.process_sq(sqid);
                }
            }
        } else if self.mode == DoorbellMode::Ioeventfd && qid > 0 && self.dbbuf.is_some() {
            // A doorbell that was to be an ioeventfd but exited (the host
            // could not install it): serve it the ioeventfd way, so that
            // EventIdx keeps asking for the next one.
            self.serve_kicked();
        } else {
            self.sqs[qid].as_mut().unwrap().tail = value as u16;
            self.process_sq(qid);
        }
    }

    /// shm mode: reads the shadow doorbells of the I/O queues and serves
    /// what they show. True if there was work.
    fn poll_shadow(&mut self) -> bool {
        let Some((db, ei)) = self.dbbuf else { return false };
        let mut busy = false;
        for qid in 1..self.sqs.len() {
            let Some(sq) = self.sqs[qid] else { continue };
            let Ok(tail) = self.mem.load::<u32>(GuestAddress(db + qid as u64 * 8), Ordering::Acquire) else { continue };
            let cqid = sq.cqid as usize;
            if let Ok(head) = self.mem.load::<u32>(GuestAddress(db + cqid as u64 * 8 + 4), Ordering::Acquire) {
                if let Some(cq) = self.cqs[cqid].as_mut() {
                    if head < cq.size as u32 && head != cq.head as u32 {
                        // EventIdx one behind the head seen before this one (see below).
                        let ev = queue::prev(cq.head as u32, cq.size as u32);
                        cq.head = head as u16;
                        let _ = self.mem.store(ev, GuestAddress(ei + cqid as u64 * 8 + 4), Ordering::Release);
                    }
                }
            }
            if tail == sq.tail as u32 && sq.head == sq.tail {
                continue;
            }
            if tail >= sq.size as u32 {
                self.refuse_tail(&self.mem.clone(), db + qid as u64 * 8, &sq);
                continue;
            }
            // EventIdx goes one behind the tail seen *before* this one. The
            // driver's last written value is never behind a tail the
            // controller has read, so EventIdx stays out of every range the
            // driver crosses (unless it runs a queue length ahead): a driver
            // that follows the rule never rings. Setting it behind the new
            // tail instead races: the driver may read it right after the
            // controller took its write, and ring for nothing.
            let ev = queue::prev(sq.tail as u32, sq.size as u32);
            let _ = self.mem.store(ev, GuestAddress(ei + qid as u64 * 8), Ordering::Release);
            self.sqs[qid].as_mut().unwrap().tail = tail as u16;
            busy |= self.process_sq(qid);
        }
        busy
    }

    fn msix_masked(&self, v: usize) -> bool {
        !self.msix_enabled || self.msix_fmask || self.msix[4 * v + 3] & 1 != 0
    }

    /// A completion on CQ `cqid` for vector `v`: signals at once, or counts
    /// it toward the aggregation threshold (I/O queues, modes with a device
    /// thread to keep the aggregation time).
    fn completion_interrupt(&mut self, cqid: usize, v: u16) {
        let thr = (self.coalescing & 0xff) + 1;
        if cqid == 0 || self.coalescing == 0 || self.mode == DoorbellMode::Mmio || v as usize >= MSIX_VECTORS {
            return self.interrupt(v);
        }
        let a = &mut self.agg[v as usize];
        a.0 += 1;
        a.1.get_or_insert_with(std::time::Instant::now);
        if a.0 >= thr {
            *a = (0, None);
            self.interrupt(v);
        }
    }

    /// Signals the vectors whose aggregation time has run out (device threads call this).
    fn flush_coalesced(&mut self) {
        // Decided from the counters: turning coalescing off releases what it held.
        let time = std::time::Duration::from_micros(100 * ((self.coalescing >> 8) & 0xff) as u64);
        for v in 0..MSIX_VECTORS {
            if self.agg[v].1.is_some_and(|t| t.elapsed() >= time) {
                self.agg[v] = (0, None);
                self.interrupt(v as u16);
            }
        }
    }

    /// Signals every vector that holds coalesced completions.
    fn flush_coalesced_now(&mut self) {
        for v in 0..MSIX_VECTORS {
            if self.agg[v].0 > 0 {
                self.agg[v] = (0, None);
                self.interrupt(v as u16);
            }
        }
    }

    /// Signals vector `v`, or leaves it pending while it is masked.
    fn interrupt(&mut self, v: u16) {
        let v = v as usize;
        if v >= MSIX_VECTORS {
            return;
        }
        if self.msix_masked(v) || !self.irq.signal_msix(v as u16) {
            self.pending[v] = true;
        } else {
            self.st.interrupts += 1;
        }
    }

    /// Tells the host where vector `v` goes now, and fires it if it was pending.
    fn msix_update(&mut self, v: usize) {
        let route = (!self.msix_masked(v)).then(|| {
            let e = &self.msix[4 * v..4 * v + 3];
            (e[0] as u64 | (e[1] as u64) << 32, e[2])
        });
        self.irq.msix_route(v as u16, route);
        if route.is_some() && self.pending[v] && self.irq.signal_msix(v as u16) {
            self.pending[v] = false;
            self.st.interrupts += 1;
        }
    }

    /// A tail beyond the queue read from a shared doorbell word (`addr` in
    /// `mem`): counted, raised as an Invalid Doorbell Write Value event, and
    /// the word put back to the last good tail so the event is raised once.
    fn refuse_tail(&mut self, mem: &GuestMemoryMmap, addr: u64, sq: &Sq) {
        self.st.bad_doorbells += 1;
        let _ = mem.store(sq.tail as u32, GuestAddress(addr), Ordering::Release);
        self.event(0, 1, 1);
    }

    /// bar mode: the doorbells are the words of the shared page; serve what
    /// they show, admin queue included.
    fn poll_bar(&mut self) -> bool {
        let Some(page) = self.bar_page.as_ref().map(|(p, _)| p.clone()) else { return false };
        let mut busy = false;
        for qid in 0..self.sqs.len() {
            let Some(sq) = self.sqs[qid] else { continue };
            let cqid = sq.cqid as usize;
            if let (Ok(head), Some(cq)) = (page.load::<u32>(GuestAddress(DOORBELLS + cqid as u64 * 8 + 4), Ordering::Acquire), self.cqs[cqid].as_mut()) {
                if head < cq.size as u32 && head != cq.head as u32 {
                    cq.head = head as u16;
                    if cqid == 0 {
                        self.deliver_events();
                    }
                }
            }
            let Ok(tail) = page.load::<u32>(GuestAddress(DOORBELLS + qid as u64 * 8), Ordering::Acquire) else { continue };
            if tail == sq.tail as u32 && sq.head == sq.tail {
                continue;
            }
            if tail >= sq.size as u32 {
                self.refuse_tail(&page, DOORBELLS + qid as u64 * 8, &sq);
                continue;
            }
            self.sqs[qid].as_mut().unwrap().tail = tail as u16;
            busy |= self.process_sq(qid);
        }
        busy
    }

    /// ioeventfd mode: serve every I/O queue from its shadow tail, publish
    /// EventIdx = the tail served (ring me next time), then look again.
    fn serve_kicked(&mut self) {
        let Some((db, ei)) = self.dbbuf else { return };
        for qid in 1..self.sqs.len() {
            loop {
                let Some(sq) = self.sqs[qid] else { break };
                let cqid = sq.cqid as usize;
                if let Ok(head) = self.mem.load::<u32>(GuestAddress(db + cqid as u64 * 8 + 4), Ordering::Acquire) {
                    if let Some(cq) = self.cqs[cqid].as_mut() {
                        if head < cq.size as u32 {
                            cq.head = head as u16;
                            let ev = queue::prev(head, cq.size as u32);
                            let _ = self.mem.store(ev, GuestAddress(ei + cqid as u64 * 8 + 4), Ordering::Release);
                        }
                    }
                }
                let Ok(tail) = self.mem.load::<u32>(GuestAddress(db + qid as u64 * 8), Ordering::Acquire) else { break };
                if tail >= sq.size as u32 {
                    self.refuse_tail(&self.mem.clone(), db + qid as u64 * 8, &sq);
                    break;
                }
                self.sqs[qid].as_mut().unwrap().tail = tail as u16;
                self.process_sq(qid);
                let _ = self.mem.store(tail, GuestAddress(ei + qid as u64 * 8), Ordering::SeqCst);
                // Commands held back by a full CQ: ask for the CQ head doorbell
                // (EventIdx = the head), then look at the head again.
                let held = self.sqs[qid].is_some_and(|s| s.head != s.tail);
                let cq_head = self.cqs[cqid].map(|c| c.head as u32);
                if let (true, Some(h)) = (held, cq_head) {
                    let _ = self.mem.store(h, GuestAddress(ei + cqid as u64 * 8 + 4), Ordering::SeqCst);
                }
                std::sync::atomic::fence(Ordering::SeqCst);
                let head_moved = held
                    && self.mem.load::<u32>(GuestAddress(db + cqid as u64 * 8 + 4), Ordering::Acquire).ok() != cq_head;
                match self.mem.load::<u32>(GuestAddress(db + qid as u64 * 8), Ordering::Acquire) {
                    Ok(t) if t != tail => continue, // a submission raced with EventIdx
                    _ if head_moved => continue,    // the host freed CQ entries meanwhile
                    _ => break,
                }
            }
        }
    }

    /// ioeventfd mode: the I/O queue doorbells of `qid` as ioeventfds.
    fn register_doorbells(&mut self, qid: usize) {
        let (Some(kick), Some(io)) = (self.kick.clone(), self.ioevents.clone()) else { return };
        if self.mode != DoorbellMode::Ioeventfd || self.dbbuf.is_none() || qid == 0 {
            return;
        }
        for off in [DOORBELLS + qid as u64 * 8, DOORBELLS + qid as u64 * 8 + 4] {
            if self.registered.contains(&off) {
                continue;
            }
            let spec = crate::IoEventSpec { bar: 0, offset: off, len: 4, datamatch: None };
            match io.register(spec, &kick) {
                Ok(()) => self.registered.push(off),
                Err(e) => log::warn!("nvme: no ioeventfd for the doorbell at {off:#x}: {e}; it exits"),
            }
        }
    }

    fn unregister_all(&mut self) {
        let (Some(kick), Some(io)) = (self.kick.clone(), self.ioevents.clone()) else { return };
        for off in self.registered.drain(..) {
            let _ = io.unregister(crate::IoEventSpec { bar: 0, offset: off, len: 4, datamatch: None }, &kick);
        }
    }

    /// Serves SQ `qid` up to its tail; stops early if its CQ is full.
    fn process_sq(&mut self, qid: usize) -> bool {
        let mut did = false;
        loop {
            let Some(sq) = self.sqs[qid] else { return did };
            if sq.head == sq.tail {
                return did;
            }
            let Some(cq) = self.cqs[sq.cqid as usize] else { return did };
            if cq.full() {
                self.st.cq_full_waits += 1;
                return did;
            }
            let sqe = read_sqe(&self.mem, &sq, sq.head);
            self.sqs[qid].as_mut().unwrap().head = queue::next(sq.head, sq.size);
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

    fn complete(&mut self, sqid: usize, cid: u16, dw0: u32, st: u16) {
        if st != status::SUCCESS {
            self.st.errors += 1;
        }
        let Some(sq) = self.sqs[sqid] else { return };
        let cqid = sq.cqid as usize;
        if let Some(cq) = self.cqs[cqid].as_mut() {
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

    fn admin(&mut self, c: &Sqe) -> Option<(u32, u16)> {
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
                if self.aer.len() >= AERL {
                    return r(status::AER_LIMIT_EXCEEDED);
                }
                self.aer.push(c.cid);
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
        if qid == 0 || qid > self.ncqa as usize || self.cqs[qid].is_some() {
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
        self.cqs[qid] = Some(Cq { gpa: c.prp1, size: size as u16, ien, iv, ..Default::default() });
        self.queues_created = true;
        self.sync_shadow(qid, true);
        status::SUCCESS
    }

    fn create_sq(&mut self, c: &Sqe) -> u16 {
        let qid = c.cdw10 as u16 as usize;
        let size = (c.cdw10 >> 16) + 1;
        let cqid = (c.cdw11 >> 16) as usize;
        if qid == 0 || qid > self.nsqa as usize || self.sqs[qid].is_some() {
            return status::INVALID_QID;
        }
        if size < 2 || size > MQES as u32 {
            return status::MAX_QSIZE_EXCEEDED;
        }
        if cqid == 0 || cqid >= self.cqs.len() || self.cqs[cqid].is_none() {
            return status::CQ_INVALID;
        }
        if c.cdw11 & 1 == 0 {
            return status::INVALID_FIELD;
        }
        if !queue_in_ram(&self.mem, c.prp1, size as u64 * SQE_SIZE) {
            return status::INVALID_FIELD;
        }
        self.sqs[qid] = Some(Sq { gpa: c.prp1, size: size as u16, head: 0, tail: 0, cqid: cqid as u16 });
        self.queues_created = true;
        self.sync_shadow(qid, false);
        self.register_doorbells(qid);
        status::SUCCESS
    }

    /// Starts a new queue's shadow doorbell at 0 and its EventIdx where the
    /// mode wants the driver's first doorbell write: nowhere (shm) or on the
    /// first submission (ioeventfd).
    fn sync_shadow(&mut self, qid: usize, cq: bool) {
        if let Some((db, ei)) = self.dbbuf {
            let off = qid as u64 * 8 + if cq { 4 } else { 0 };
            let size = if cq { self.cqs[qid].map(|q| q.size) } else { self.sqs[qid].map(|q| q.size) };
            // shm: behind (never ring); ioeventfd SQ: 0 (ring on the first submission).
            let ev = if self.mode == DoorbellMode::Ioeventfd && !cq { 0 } else { size.unwrap_or(1) as u32 - 1 };
            let _ = self.mem.store(0u32, GuestAddress(db + off), Ordering::Release);
            let _ = self.mem.store(ev, GuestAddress(ei + off), Ordering::Release);
        }
    }

    fn delete_sq(&mut self, qid: u16) -> u16 {
        let q = qid as usize;
        if q == 0 || q >= self.sqs.len() || self.sqs[q].is_none() {
            return status::INVALID_QID;
        }
        self.sqs[q] = None;
        status::SUCCESS
    }

    fn delete_cq(&mut self, qid: u16) -> u16 {
        let q = qid as usize;
        if q == 0 || q >= self.cqs.len() || self.cqs[q].is_none() {
            return status::INVALID_QID;
        }
        if self.sqs.iter().flatten().any(|s| s.cqid == qid) {
            return status::INVALID_QUEUE_DELETION;
        }
        self.cqs[q] = None;
        status::SUCCESS
    }

    fn to_guest(&mut self, c: &Sqe, data: &[u8]) -> u16 {
        let mut segs = std::mem::take(&mut self.segs);
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
        self.segs = segs;
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
                d[0..8].copy_from_slice(&self.nlbas.to_le_bytes()); // NSZE
                d[8..16].copy_from_slice(&self.nlbas.to_le_bytes()); // NCAP
                d[16..24].copy_from_slice(&self.nlbas.to_le_bytes()); // NUSE
                d[25] = 0; // NLBAF: one format
                d[26] = 0; // FLBAS: format 0
                d[33] = 1; // DLFEAT: deallocated blocks read as zeros
                // LBAF0: MS 0, LBADS, RP 0
                d[128 + 2] = self.lba_shift as u8;
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
                let shadow = matches!(self.mode, DoorbellMode::Shm | DoorbellMode::Ioeventfd);
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
        self.to_guest(c, &d)
    }

    fn set_features(&mut self, c: &Sqe) -> Option<(u32, u16)> {
        let fid = c.cdw10 & 0xff;
        Some(match fid {
            0x07 => {
                if self.queues_created {
                    return Some((0, status::COMMAND_SEQUENCE_ERROR));
                }
                let nsqr = (c.cdw11 & 0xffff) as u16;
                let ncqr = (c.cdw11 >> 16) as u16;
                if nsqr == 0xffff || ncqr == 0xffff {
                    return Some((0, status::INVALID_FIELD));
                }
                self.nsqa = (nsqr + 1).min(MAX_IO_QUEUES);
                self.ncqa = (ncqr + 1).min(MAX_IO_QUEUES);
                (((self.ncqa - 1) as u32) << 16 | (self.nsqa - 1) as u32, status::SUCCESS)
            }
            0x08 => {
                self.coalescing = c.cdw11 & 0xffff;
                self.flush_coalesced_now();
                (0, status::SUCCESS)
            }
            0x01 | 0x02 | 0x04 | 0x05 | 0x06 | 0x09 | 0x0a | 0x0b => (0, status::SUCCESS),
            _ => (0, status::INVALID_FIELD),
        })
    }

    fn get_features(&mut self, c: &Sqe) -> Option<(u32, u16)> {
        let fid = c.cdw10 & 0xff;
        Some(match fid {
            0x07 => (((self.ncqa - 1) as u32) << 16 | (self.nsqa - 1) as u32, status::SUCCESS),
            0x08 => (self.coalescing, status::SUCCESS),
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
                s[32..40].copy_from_slice(&self.smart_read_units.div_ceil(1000).to_le_bytes());
                s[48..56].copy_from_slice(&self.smart_write_units.div_ceil(1000).to_le_bytes());
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
        self.to_guest(c, &page)
    }

    fn dbbuf_config(&mut self, c: &Sqe) -> u16 {
        if !matches!(self.mode, DoorbellMode::Shm | DoorbellMode::Ioeventfd) {
            return status::INVALID_OPCODE;
        }
        if !queue_in_ram(&self.mem, c.prp1, PAGE) || !queue_in_ram(&self.mem, c.prp2, PAGE) {
            return status::INVALID_FIELD;
        }
        self.dbbuf = Some((c.prp1, c.prp2));
        for qid in 1..self.sqs.len() {
            if self.sqs[qid].is_some() || self.cqs[qid].is_some() {
                self.register_doorbells(qid);
            }
            if let Some(sq) = self.sqs[qid] {
                let _ = self.mem.store(sq.tail as u32, GuestAddress(c.prp1 + qid as u64 * 8), Ordering::Release);
            }
            if let Some(cq) = self.cqs[qid] {
                let _ = self.mem.store(cq.head as u32, GuestAddress(c.prp1 + qid as u64 * 8 + 4), Ordering::Release);
            }
        }
        status::SUCCESS
    }

    fn io(&mut self, c: &Sqe) -> u16 {
        if c.nsid != 1 {
            return status::INVALID_NAMESPACE;
        }
        match c.opcode {
            0x00 => match self.backend.flush() {
                Ok(()) => status::SUCCESS,
                Err(_) => status::INTERNAL,
            },
            0x01 | 0x02 => self.rw(c, c.opcode == 0x01),
            0x08 => {
                let (slba, n) = (c.cdw10 as u64 | (c.cdw11 as u64) << 32, (c.cdw12 & 0xffff) as u64 + 1);
                if slba.checked_add(n).is_none_or(|e| e > self.nlbas) {
                    return status::LBA_OUT_OF_RANGE;
                }
                match self.backend.zero(slba << self.lba_shift, n << self.lba_shift) {
                    Ok(()) => status::SUCCESS,
                    Err(_) => status::INTERNAL,
                }
            }
            0x09 => self.dsm(c),
            _ => status::INVALID_OPCODE,
        }
    }

    fn rw(&mut self, c: &Sqe, write: bool) -> u16 {
        let slba = c.cdw10 as u64 | (c.cdw11 as u64) << 32;
        let n = (c.cdw12 & 0xffff) as u64 + 1;
        if slba.checked_add(n).is_none_or(|e| e > self.nlbas) {
            return status::LBA_OUT_OF_RANGE;
        }
        let bytes = n << self.lba_shift;
        if bytes > PAGE << MDTS {
            return status::INVALID_FIELD;
        }
        let mut segs = std::mem::take(&mut self.segs);
        let st = match prp_segments(&self.mem, c.prp1, c.prp2, bytes, &mut segs) {
            Err(st) => st,
            Ok(()) => self.transfer(&segs, slba << self.lba_shift, write),
        };
        self.segs = segs;
        if st == status::SUCCESS {
            if write {
                self.st.writes += 1;
                self.smart_write_units += bytes / 512;
            } else {
                self.st.reads += 1;
                self.smart_read_units += bytes / 512;
            }
        }
        st
    }

    /// Moves data between the backend and the guest pages.
    fn transfer(&mut self, segs: &[(u64, u64)], mut off: u64, write: bool) -> u16 {
        if matches!(self.backend, Backend::Null) {
            return status::SUCCESS;
        }
        if matches!(self.backend, Backend::File(_)) {
            return self.transfer_whole(segs, off, write);
        }
        for &(a, n) in segs {
            let n = n as usize;
            if self.buf.len() < n {
                self.buf.resize(n, 0);
            }
            let buf = &mut self.buf[..n];
            let r = if write {
                self.mem.read_slice(buf, GuestAddress(a)).map_err(|_| ()).and_then(|()| self.backend.write(off, buf).map_err(|_| ()))
            } else {
                self.backend.read(off, buf).map_err(|_| ()).and_then(|()| self.mem.write_slice(buf, GuestAddress(a)).map_err(|_| ()))
            };
            if r.is_err() {
                return status::DATA_TRANSFER_ERROR;
            }
            off += n as u64;
        }
        status::SUCCESS
    }

    /// A file transfer as one aligned backend operation (O_DIRECT-able),
    /// gathered from or scattered to the guest pages.
    fn transfer_whole(&mut self, segs: &[(u64, u64)], off: u64, write: bool) -> u16 {
        let len: u64 = segs.iter().map(|s| s.1).sum();
        let mut bounce = std::mem::replace(&mut self.bounce, backend::Bounce::new(0));
        let buf = bounce.get(len as usize);
        let mut pos = 0usize;
        let mut ok = true;
        if write {
            for &(a, n) in segs {
                ok &= self.mem.read_slice(&mut buf[pos..pos + n as usize], GuestAddress(a)).is_ok();
                pos += n as usize;
            }
            ok = ok && self.backend.write(off, buf).is_ok();
        } else {
            ok = self.backend.read(off, buf).is_ok();
            for &(a, n) in segs {
                if !ok {
                    break;
                }
                ok = self.mem.write_slice(&buf[pos..pos + n as usize], GuestAddress(a)).is_ok();
                pos += n as usize;
            }
        }
        self.bounce = bounce;
        if ok {
            status::SUCCESS
        } else {
            status::DATA_TRANSFER_ERROR
        }
    }

    fn dsm(&mut self, c: &Sqe) -> u16 {
        let nr = (c.cdw10 & 0xff) as usize + 1;
        let mut ranges = vec![0u8; nr * 16];
        let mut segs = std::mem::take(&mut self.segs);
        let r = prp_segments(&self.mem, c.prp1, c.prp2, ranges.len() as u64, &mut segs);
        let mut done = 0;
        let mut st = match r {
            Ok(()) => status::SUCCESS,
            Err(s) => s,
        };
        if st == status::SUCCESS {
            for &(a, n) in &segs {
                if self.mem.read_slice(&mut ranges[done..done + n as usize], GuestAddress(a)).is_err() {
                    st = status::DATA_TRANSFER_ERROR;
                }
                done += n as usize;
            }
        }
        self.segs = segs;
        if st != status::SUCCESS {
            return st;
        }
        let deallocate = c.cdw11 & 4 != 0;
        for r in ranges.chunks(16) {
            let n = u32::from_le_bytes(r[4..8].try_into().unwrap()) as u64;
            let slba = u64::from_le_bytes(r[8..16].try_into().unwrap());
            if slba.checked_add(n).is_none_or(|e| e > self.nlbas) {
                return status::LBA_OUT_OF_RANGE;
            }
            if deallocate && self.backend.zero(slba << self.lba_shift, n << self.lba_shift).is_err() {
                return status::INTERNAL;
            }
        }
        status::SUCCESS
    }

    fn regs(&self) -> [u8; 0x38] {
        let mut r = [0u8; 0x38];
        r[0..8].copy_from_slice(&Nvme::cap().to_le_bytes());
        r[8..12].copy_from_slice(&0x0001_0400u32.to_le_bytes());
        r[0x0c..0x10].copy_from_slice(&self.intms.to_le_bytes());
        r[0x10..0x14].copy_from_slice(&self.intms.to_le_bytes());
        r[0x14..0x18].copy_from_slice(&self.cc.to_le_bytes());
        r[0x1c..0x20].copy_from_slice(&self.csts.to_le_bytes());
        r[0x24..0x28].copy_from_slice(&self.aqa.to_le_bytes());
        r[0x28..0x30].copy_from_slice(&self.asq.to_le_bytes());
        r[0x30..0x38].copy_from_slice(&self.acq.to_le_bytes());
        r
    }
}

impl DeviceModelMut for Nvme {
    fn name(&self) -> String {
        "nvme".into()
    }

    fn ids(&self) -> PciIds {
        PciIds { vendor: VENDOR, device: DEVICE, class: CLASS, revision: 0, subsystem_vendor: VENDOR, subsystem: DEVICE }
    }

    fn bars(&self) -> Vec<BarSpec> {
        vec![BarSpec { index: 0, kind: BarKind::Mem64, size: BAR0_SIZE }]
    }

    fn attach(&mut self, ctx: DeviceContext) {
        let ready = {
            let mut c = self.core.lock().unwrap();
            c.mem = ctx.mem;
            c.ioevents = Some(ctx.ioevents);
            c.irq = ctx.irq;
            c.csts & 1 == 1
        };
        // A device process's next client finds the controller as the last
        // one left it: enabled, so its queues are served again.
        if ready {
            self.start_poller();
        }
    }

    fn mapped_areas(&self) -> Vec<crate::MappedArea> {
        let c = self.core.lock().unwrap();
        let Some((_, fd)) = &c.bar_page else { return Vec::new() };
        match fd.try_clone() {
            Ok(fd) => vec![crate::MappedArea { bar: 0, offset: DOORBELLS, size: 0x1000, fd, fd_offset: DOORBELLS }],
            Err(e) => {
                log::warn!("nvme: cannot share the doorbell page: {e}");
                Vec::new()
            }
        }
    }

    fn capabilities(&self) -> Vec<crate::pci::Capability> {
        let mut body = Vec::new();
        body.extend_from_slice(&(MSIX_VECTORS as u16 - 1).to_le_bytes()); // table size; enable/mask off
        body.extend_from_slice(&(MSIX_TABLE as u32).to_le_bytes()); // BIR 0
        body.extend_from_slice(&(MSIX_PBA as u32).to_le_bytes());
        vec![crate::pci::Capability { offset: MSIX_CAP, id: crate::pci::PCI_CAP_ID_MSIX, body, wmask: vec![0, 0xc0] }]
    }

    fn config_write(&mut self, offset: usize, data: &[u8]) {
        // Message Control's high byte holds MSI-X Enable (bit 15) and Function Mask (bit 14).
        let hi = MSIX_CAP + 3;
        if offset <= hi && hi < offset + data.len() {
            let b = data[hi - offset];
            let mut c = self.core.lock().unwrap();
            c.msix_enabled = b & 0x80 != 0;
            c.msix_fmask = b & 0x40 != 0;
            for v in 0..MSIX_VECTORS {
                c.msix_update(v);
            }
        }
    }

    fn bar_read(&mut self, bar: u8, offset: u64, data: &mut [u8]) {
        let table_end = MSIX_TABLE + 16 * MSIX_VECTORS as u64;
        if bar == 0 && (MSIX_TABLE..table_end).contains(&offset) {
            let c = self.core.lock().unwrap();
            let bytes: Vec<u8> = c.msix.iter().flat_map(|w| w.to_le_bytes()).collect();
            crate::read_regs(&bytes, offset - MSIX_TABLE, data);
            return;
        }
        if bar == 0 && (MSIX_PBA..MSIX_PBA + 16).contains(&offset) {
            let c = self.core.lock().unwrap();
            let mut bits = [0u8; 16];
            for (v, p) in c.pending.iter().enumerate() {
                bits[v / 8] |= (*p as u8) << (v % 8);
            }
            crate::read_regs(&bits, offset - MSIX_PBA, data);
            return;
        }
        if bar != 0 || offset >= DOORBELLS {
            le_fill(data, if bar != 0 { u64::MAX } else { 0 });
            return;
        }
        let regs = self.core.lock().unwrap().regs();
        crate::read_regs(&regs, offset, data);
    }

    fn bar_write(&mut self, bar: u8, offset: u64, data: &[u8]) {
        if bar != 0 {
            return;
        }
        let v = le_value(data);
        if (MSIX_TABLE..MSIX_TABLE + 16 * MSIX_VECTORS as u64).contains(&offset) {
            // DWORD or QWORD writes, naturally aligned (PCI spec).
            if !matches!(data.len(), 4 | 8) || offset % data.len() as u64 != 0 {
                return;
            }
            let mut c = self.core.lock().unwrap();
            let i = ((offset - MSIX_TABLE) / 4) as usize;
            for (k, w) in (0..data.len() / 4).map(|k| (k, (v >> (32 * k)) as u32)) {
                if let Some(slot) = c.msix.get_mut(i + k) {
                    *slot = if (i + k) % 4 == 3 { w & 1 } else { w };
                }
            }
            c.msix_update(i / 4);
            return;
        }
        if offset >= DOORBELLS && offset < MSIX_TABLE {
            if data.len() == 4 && offset % 4 == 0 {
                self.core.lock().unwrap().doorbell(offset - DOORBELLS, v as u32);
            }
            return;
        }
        match (offset, data.len()) {
            (REG_CC, 4) => self.write_cc(v as u32),
            (REG_INTMS, 4) => self.core.lock().unwrap().intms |= v as u32,
            (REG_INTMC, 4) => self.core.lock().unwrap().intms &= !(v as u32),
            (REG_AQA, 4) => self.core.lock().unwrap().aqa = v as u32 & 0x0fff_0fff,
            (REG_ASQ, 8) => self.core.lock().unwrap().asq = v & !0xfff,
            (REG_ACQ, 8) => self.core.lock().unwrap().acq = v & !0xfff,
            (REG_ASQ, 4) | (REG_ACQ, 4) => {
                let mut c = self.core.lock().unwrap();
                let r = if offset == REG_ASQ { &mut c.asq } else { &mut c.acq };
                *r = (*r & !0xffff_ffff) | (v & 0xffff_f000);
            }
            (o, 4) if o == REG_ASQ + 4 || o == REG_ACQ + 4 => {
                let mut c = self.core.lock().unwrap();
                let r = if o == REG_ASQ + 4 { &mut c.asq } else { &mut c.acq };
                *r = (*r & 0xffff_ffff) | v << 32;
            }
            _ => {} // read-only (CAP, VS, CSTS) or reserved
        }
    }

    fn reset(&mut self) {
        self.stop_poller();
        let mut c = self.core.lock().unwrap();
        c.reset_queues();
        c.cc = 0;
        c.aqa = 0;
        c.asq = 0;
        c.acq = 0;
    }

    fn quiesce(&mut self) {
        self.stop_poller();
    }

    fn counters(&self) -> Vec<Counter> {
        let c = self.core.lock().unwrap();
        let s = &c.st;
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
        v.push(Counter { name: format!("backend.{}", c.backend.name()), value: 1 });
        if let Backend::File(f) = &c.backend {
            v.push(Counter { name: "backend.direct-ops".into(), value: f.direct_ops });
        }
        if let Some(e) = &self.error {
            log::warn!("{e}");
        }
        v
    }
}

/// BAR0 as a memfd, mapped here at "address" 0, for the bar doorbell mode.
fn bar_memory() -> Result<(GuestMemoryMmap, std::fs::File), String> {
    use std::os::fd::FromRawFd;
    let name = std::ffi::CString::new("iopath-nvme-bar0").unwrap();
    // SAFETY: memfd_create with a valid name; the fd is owned by the File.
    let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
    if fd < 0 {
        return Err(format!("memfd_create: {}", std::io::Error::last_os_error()));
    }
    // SAFETY: a fresh descriptor nobody else owns.
    let f = unsafe { std::fs::File::from_raw_fd(fd) };
    f.set_len(BAR0_SIZE).map_err(|e| e.to_string())?;
    let region = vm_memory::MmapRegion::from_file(vm_memory::FileOffset::new(f.try_clone().map_err(|e| e.to_string())?, 0), BAR0_SIZE as usize)
        .map_err(|e| format!("mmap of the doorbell page: {e}"))?;
    let r = vm_memory::GuestRegionMmap::new(region, GuestAddress(0)).ok_or("doorbell page region")?;
    let m = GuestMemoryMmap::from_regions(vec![r]).map_err(|e| e.to_string())?;
    Ok((m, f))
}

impl Drop for Nvme {
    fn drop(&mut self) {
        self.stop_poller();
    }
}

#[cfg(test)]
mod tests;
