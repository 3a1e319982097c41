//! Error injection in the controller: what `serve_sq` asks of the rules
//! (`block::inject`) for each command it fetched, and how each action is
//! carried out. Off (no rule held) it costs one relaxed load per command.
//!
//! - status: the command is not executed; it completes at once with the
//!   rule's status, and an Error Information log entry (log page 01h) is
//!   filled: a ring of [`ERROR_LOG_ENTRIES`] (Identify Controller's ELPE
//!   says so), newest first, each with the lifetime error count;
//! - delay: executed, its completion posted `ns` later by the queue
//!   group's timer wheel (`timing.rs`);
//! - drop and fatal: not executed, never completed. The command is kept
//!   ([`Dropped`]) and its CQ room counted as owed until an Abort names it
//!   (then it completes with Command Abort Requested), its SQ is deleted or
//!   the controller is reset or disabled. Fatal also sets CSTS.CFS;
//! - corrupt: a read, executed; once its data reached guest memory (the
//!   synchronous path, or a file operation reaped) the bytes
//!   [`Corrupt::flips`] names are XORed there, before its completion;
//! - event: executed, and an asynchronous event queued (delivered to an
//!   outstanding AER, or when one comes): SMART / Health critical warning
//!   (type 1, the warning bits also show in the SMART log's byte 0 until a
//!   reset) or Namespace Attribute Changed (type 2, info 0, log page 04h
//!   listing the namespace).
//!
//! State every queue group shares is one [`Shared`] (the rules, the error
//! log, the changed namespace list, the warning bits, CFS raised by a group
//! other than 0, the controller's clock); each group's own (its dropped
//! commands, its timer wheel) is its core's [`Ext`].

use super::controller::Core;
use super::queue::{prp_segments, status, Sqe};
use crate::block::inject::{Action, CommandView, Corrupt, Event, Injector, Kind, Lbas};
use crate::block::timing::{DeviceHist, TimerWheel, TimingModel};
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// Error Information log entries kept (ELPE + 1).
pub(super) const ERROR_LOG_ENTRIES: usize = 16;
/// Namespaces the Changed Namespace List holds before it says "more".
const CHANGED_NS_MAX: usize = 1024;
/// Status: Command Abort Requested (generic, 07h).
const ABORT_REQUESTED: u16 = 0x007;

/// The Error Information log: the newest entries, and how many errors there
/// were (each entry's Error Count; never 0 for a valid entry).
#[derive(Default)]
pub(super) struct ErrorLog {
    pub count: u64,
    pub entries: VecDeque<[u8; 64]>,
}

/// What every queue group of a controller shares.
pub(super) struct Shared {
    pub injector: Arc<Injector>,
    pub errors: Mutex<ErrorLog>,
    /// Namespaces changed since the log page 04h was last read.
    pub changed_ns: Mutex<Vec<u32>>,
    /// SMART critical warning bits an injected event set.
    pub smart_warning: AtomicU8,
    /// A group other than 0 injected a fatal status: group 0 sets CSTS.CFS.
    pub fatal: AtomicBool,
    /// The controller's clock: ns since this.
    pub epoch: Instant,
    /// Each namespace's timing model (index = NSID - 1; None: off), shared
    /// by the groups: its own `timing=`, else the controller's, one model
    /// for all the namespaces that take it (their ceilings are one device's).
    pub timing: Vec<Option<Arc<Mutex<TimingModel>>>>,
    /// What the device saw of the models' due times (counters `timing.*`);
    /// made with the first model.
    pub hist: Option<DeviceHist>,
}

/// A command fetched whose completion injection withheld (drop, fatal).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Dropped {
    pub sqid: u16,
    pub cid: u16,
    pub cqid: u16,
}

/// What a command carries besides its execution: when its completion is
/// due (0: at once) and a corruption of its read data.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct Extra {
    /// The controller's clock when it was fetched (timing on), ns.
    pub arrival: u64,
    /// Its NSID (timing on): which namespace's model times it.
    pub nsid: u32,
    pub delay: u64,
    pub corrupt: Option<Corrupt>,
}

impl Extra {
    #[inline]
    pub fn any(&self) -> bool {
        self.delay != 0 || self.corrupt.is_some()
    }
}

/// A completion the wheel holds until it is due.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct Timed {
    pub due: u64,
    /// When it was fetched (0: not timed by a model, a delay only).
    pub arrival: u64,
    pub sqid: u16,
    pub cid: u16,
    pub cqid: u16,
    pub dw0: u32,
    pub st: u16,
}

/// One queue group's injection and timing state.
pub(super) struct Ext {
    pub shared: Arc<Shared>,
    /// A copy of `shared.injector`, one pointer from the core.
    pub injector: Arc<Injector>,
    /// `timing=` is set: every I/O command is admitted by the model.
    pub timing: bool,
    pub dropped: Vec<Dropped>,
    /// Timed completions (`timing.rs`); made at the first one.
    pub wheel: Option<TimerWheel<Timed>>,
    /// Expired, waiting for room in their CQ (the host moved its head back).
    pub late: VecDeque<Timed>,
    pub expired: Vec<Timed>,
    /// What `io_start` hands a file slot with the command.
    pub next: Extra,
    /// Tests: every timed completion as (sqid, cid, due, posted), on the
    /// controller's clock.
    #[cfg(any(test, feature = "oracle"))]
    pub timelog: Option<Arc<Mutex<Vec<TimedRecord>>>>,
}

/// A timed completion as posted (the oracle checks none came early).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TimedRecord {
    pub sqid: u16,
    pub cid: u16,
    /// When it was fetched (0: not timed by a model, a delay only).
    pub arrival_ns: u64,
    pub due_ns: u64,
    pub posted_ns: u64,
}

impl Shared {
    pub fn new(cfg: &super::NvmeConfig) -> Shared {
        let injector = Injector::with_rules(&cfg.inject).unwrap_or_else(|e| {
            // NvmeConfig::validate checked every rule.
            log::error!("nvme: inject=: {e}");
            Injector::new()
        });
        let model = |t: &crate::block::timing::TimingSpec| Arc::new(Mutex::new(TimingModel::new(t)));
        let default = cfg.timing.as_deref().map(model);
        let timing: Vec<_> =
            cfg.ns_list().iter().map(|n| n.timing.as_deref().map(model).or_else(|| default.clone())).collect();
        let hist = timing.iter().any(Option::is_some).then(DeviceHist::default);
        Shared {
            injector: Arc::new(injector),
            errors: Mutex::default(),
            changed_ns: Mutex::default(),
            smart_warning: AtomicU8::new(0),
            fatal: AtomicBool::new(false),
            epoch: Instant::now(),
            timing,
            hist,
        }
    }
}

impl Ext {
    pub fn new(shared: Arc<Shared>) -> Ext {
        Ext {
            injector: shared.injector.clone(),
            timing: shared.timing.iter().any(Option::is_some),
            shared,
            dropped: Vec::new(),
            wheel: None,
            late: VecDeque::new(),
            expired: Vec::new(),
            next: Extra::default(),
            #[cfg(any(test, feature = "oracle"))]
            timelog: None,
        }
    }

    /// The controller's clock, ns.
    #[inline]
    pub fn now(&self) -> u64 {
        self.shared.epoch.elapsed().as_nanos() as u64
    }
}

/// What `serve_sq` does with a command after the rules saw it.
enum Verdict {
    /// Execute it, with this extra.
    Go(Extra),
    /// Complete it now with this status, not executed.
    Fail(u16),
    /// Neither execute nor complete it.
    Withhold,
}

/// The LBA size (log2) and size in LBAs of namespace `nsid`, if it exists
/// (the one place injection looks a namespace up).
pub(super) fn namespace_lbas(c: &Core, nsid: u32) -> Option<(u32, u64)> {
    c.ns_index(nsid).map(|i| (c.ns[i].lba_shift, c.ns[i].nlbas))
}

/// The rules' view of command `c` of SQ `qid`.
pub(super) fn command_view(qid: usize, c: &Sqe) -> CommandView {
    let slba = c.cdw10 as u64 | (c.cdw11 as u64) << 32;
    let nlb = c.cdw12 & 0xffff;
    let (kind, lba) = match (qid, c.opcode) {
        (0, _) => (Kind::Admin, None),
        (_, 0x00) => (Kind::Flush, None),
        (_, 0x01) => (Kind::Write, Some(Lbas { slba, nlb })),
        (_, 0x02) => (Kind::Read, Some(Lbas { slba, nlb })),
        (_, 0x08) => (Kind::WriteZeroes, Some(Lbas { slba, nlb })),
        (_, 0x09) => (Kind::Discard, None),
        _ => (Kind::Other, None),
    };
    CommandView { opcode: c.opcode, kind, nsid: c.nsid, lba, qid: qid as u16 }
}

impl Core {
    /// `serve_sq`, a command fetched while a rule or a timing model is
    /// set: its extra (arrival time, delay, corruption) to execute it
    /// with, or None if injection completed or withheld it.
    #[inline(never)]
    pub(super) fn fetched(&mut self, qid: usize, sqe: Option<&Sqe>) -> Option<Extra> {
        let mut x = Extra { arrival: self.arrival(qid), nsid: sqe.map_or(0, |c| c.nsid), ..Extra::default() };
        let Some(c) = sqe.filter(|_| self.ext.injector.armed()) else { return Some(x) };
        match self.inject(qid, c) {
            Verdict::Go(e) => (x.delay, x.corrupt) = (e.delay, e.corrupt),
            Verdict::Fail(st) => {
                self.complete(qid, c.cid, 0, st);
                return None;
            }
            Verdict::Withhold => return None,
        }
        Some(x)
    }

    /// `serve_sq`, the command carried out with (dw0, st): its read data
    /// corrupted if asked; true if its completion went into the wheel.
    #[inline(never)]
    pub(super) fn executed(&mut self, qid: usize, sqe: Option<&Sqe>, dw0: u32, st: u16, x: Extra) -> bool {
        let Some(c) = sqe else { return false };
        if let Some(k) = x.corrupt.filter(|_| st == status::SUCCESS) {
            self.corrupt_read(k, c.prp1, c.prp2, c.cdw12 & 0xffff, c.nsid);
        }
        let bytes = self.io_bytes(c);
        self.finish(qid, c.cid, c.opcode, bytes, dw0, st, x)
    }

    /// Asks the rules about command `c` of SQ `qid` (only while they hold
    /// one) and carries out what does not wait for its execution.
    fn inject(&mut self, qid: usize, c: &Sqe) -> Verdict {
        let view = command_view(qid, c);
        let Some(action) = self.ext.injector.decide(&view) else { return Verdict::Go(Extra::default()) };
        if qid > 0 && matches!(action, Action::Status(_) | Action::Drop | Action::Fatal) {
            self.st.io += 1; // fetched, not executed
        }
        match action {
            Action::Status(s) => {
                self.log_error(qid as u16, c, &view, s.field());
                Verdict::Fail(s.field())
            }
            Action::Delay { ns } => Verdict::Go(Extra { delay: ns.max(1), ..Extra::default() }),
            Action::Corrupt(k) => {
                Verdict::Go(Extra { corrupt: (qid > 0 && c.opcode == 0x02).then_some(k), ..Extra::default() })
            }
            Action::Drop | Action::Fatal => {
                if action == Action::Fatal {
                    self.raise_fatal();
                }
                let cqid = self.queues.sqs[qid].as_ref().map_or(0, |s| s.cqid);
                self.flight.owed[cqid as usize] += 1;
                self.ext.dropped.push(Dropped { sqid: qid as u16, cid: c.cid, cqid });
                Verdict::Withhold
            }
            Action::Event(e) => {
                self.inject_event(e, c.nsid);
                Verdict::Go(Extra::default())
            }
        }
    }

    /// CSTS.CFS: group 0's own register; another group's flag, which group
    /// 0 folds in when the host reads the registers.
    fn raise_fatal(&mut self) {
        if self.group == 0 {
            self.regs.csts |= 2;
        } else {
            self.ext.shared.fatal.store(true, Ordering::Release);
        }
        log::warn!("nvme: injected controller fatal status (CSTS.CFS)");
    }

    /// Group 0, before the registers are read: CFS another group raised.
    pub(super) fn fold_fatal(&mut self) {
        if self.ext.shared.fatal.load(Ordering::Acquire) {
            self.regs.csts |= 2;
        }
    }

    fn inject_event(&mut self, e: Event, nsid: u32) {
        match e {
            Event::SmartWarning(bits) => {
                self.ext.shared.smart_warning.fetch_or(bits, Ordering::Relaxed);
                // SMART / Health status; info: 0 reliability, 1 temperature, 2 spare.
                let info = if bits & 0x02 != 0 {
                    1
                } else if bits & 0x01 != 0 {
                    2
                } else {
                    0
                };
                self.event(1, info, 0x02);
            }
            Event::NsChanged => {
                self.note_ns_changed(nsid);
                self.event(2, 0, 0x04);
            }
        }
    }

    /// Namespace `nsid` changed: listed in log page 04h until it is read.
    pub(super) fn note_ns_changed(&mut self, nsid: u32) {
        let mut l = crate::lock(&self.ext.shared.changed_ns);
        if !l.contains(&nsid) && l.len() <= CHANGED_NS_MAX {
            l.push(nsid);
        }
    }

    /// Log page 04h, Changed Namespace List: the namespaces, ascending, or
    /// FFFFFFFFh first if more than 1024 changed; emptied when read
    /// without RAE (`clear`).
    pub(super) fn changed_ns_page(&mut self, clear: bool) -> Vec<u8> {
        let mut l = crate::lock(&self.ext.shared.changed_ns);
        let mut page = vec![0u8; 4096];
        if l.len() > CHANGED_NS_MAX {
            page[..4].copy_from_slice(&u32::MAX.to_le_bytes());
        } else {
            l.sort_unstable();
            for (i, n) in l.iter().enumerate() {
                page[4 * i..4 * i + 4].copy_from_slice(&n.to_le_bytes());
            }
        }
        if clear {
            l.clear();
        }
        page
    }

    /// The SMART critical warning bits injected events set.
    pub(super) fn injected_warning(&self) -> u8 {
        self.ext.shared.smart_warning.load(Ordering::Relaxed)
    }

    /// An Error Information log entry for command `c`, failed with `field`.
    fn log_error(&mut self, sqid: u16, c: &Sqe, view: &CommandView, field: u16) {
        let mut log = crate::lock(&self.ext.shared.errors);
        log.count += 1;
        let mut e = [0u8; 64];
        e[0..8].copy_from_slice(&log.count.to_le_bytes());
        e[8..10].copy_from_slice(&sqid.to_le_bytes());
        e[10..12].copy_from_slice(&c.cid.to_le_bytes());
        e[12..14].copy_from_slice(&(field << 1).to_le_bytes()); // bit 0: phase tag (not kept)
        e[14..16].copy_from_slice(&0xffffu16.to_le_bytes()); // parameter error location: none
        e[16..24].copy_from_slice(&view.lba.map_or(0, |l| l.slba).to_le_bytes());
        e[24..28].copy_from_slice(&c.nsid.to_le_bytes());
        if log.entries.len() == ERROR_LOG_ENTRIES {
            log.entries.pop_back();
        }
        log.entries.push_front(e);
    }

    /// Log page 01h: the entries, newest first, then zeros (invalid entries).
    pub(super) fn error_log_page(&self) -> Vec<u8> {
        let log = crate::lock(&self.ext.shared.errors);
        let mut page = vec![0u8; 64 * ERROR_LOG_ENTRIES];
        for (i, e) in log.entries.iter().enumerate() {
            page[64 * i..64 * i + 64].copy_from_slice(e);
        }
        page
    }

    /// The errors logged over the controller's life (SMART log).
    pub(super) fn error_count(&self) -> u64 {
        crate::lock(&self.ext.shared.errors).count
    }

    /// After a read reached guest memory: XORs the bytes `k` names in its
    /// data (PRPs of `c`, `bytes` long). Guest memory that cannot be
    /// reached is left (the read itself reported that).
    pub(super) fn corrupt_read(&mut self, k: Corrupt, prp1: u64, prp2: u64, nlb: u32, nsid: u32) {
        let Some((shift, _)) = namespace_lbas(self, nsid) else { return };
        let bytes = (u64::from(nlb) + 1) << shift;
        let mut segs = std::mem::take(&mut self.scratch.segs);
        if prp_segments(&self.mem, prp1, prp2, bytes, &mut segs).is_ok() {
            corrupt_segments(&self.mem, &segs, k, bytes as usize);
        }
        self.scratch.segs = segs;
    }

    /// Abort (admin 08h) of a command injection withheld: it completes now
    /// with Command Abort Requested, and the Abort's dword 0 bit 0 is 0
    /// (aborted). None if no group holds it.
    pub(super) fn abort_withheld(&mut self, c: &Sqe) -> Option<(u32, u16)> {
        let (sqid, cid) = (c.cdw10 as u16, (c.cdw10 >> 16) as u16);
        for g in 0..self.groups.max(1) {
            let found = self.with_group(g, |k| {
                let i = k.ext.dropped.iter().position(|d| (d.sqid, d.cid) == (sqid, cid))?;
                let d = k.ext.dropped.swap_remove(i);
                let owed = &mut k.flight.owed[d.cqid as usize];
                *owed = owed.saturating_sub(1);
                k.batched(|k| k.complete(sqid as usize, cid, 0, ABORT_REQUESTED));
                Some(())
            });
            if found.is_some() {
                return Some((0, status::SUCCESS));
            }
        }
        None
    }

    /// SQ `sqid` is deleted (None: every queue, a reset): the commands
    /// injection withheld and the timed completions of its commands are
    /// forgotten, their CQ room no longer owed.
    pub(super) fn forget_queue(&mut self, sqid: Option<u16>) {
        let mine = |s: u16| sqid.is_none_or(|q| q == s);
        let mut k = 0;
        while k < self.ext.dropped.len() {
            let d = self.ext.dropped[k];
            if mine(d.sqid) {
                let owed = &mut self.flight.owed[d.cqid as usize];
                *owed = owed.saturating_sub(1);
                self.ext.dropped.swap_remove(k);
            } else {
                k += 1;
            }
        }
        self.forget_timed(sqid);
        if sqid.is_none() {
            self.ext.shared.fatal.store(false, Ordering::Release);
            self.ext.shared.smart_warning.store(0, Ordering::Relaxed);
        }
    }
}

/// XORs the bytes `k` flips in `len` bytes of data laid over `segs`.
pub(super) fn corrupt_segments(mem: &crate::GuestMem, segs: &[(u64, u64)], k: Corrupt, len: usize) {
    let flips = k.flips(len);
    let (mut seg, mut base) = (0usize, 0usize);
    for (off, x) in flips {
        while seg < segs.len() && off >= base + segs[seg].1 as usize {
            base += segs[seg].1 as usize;
            seg += 1;
        }
        let Some(&(a, _)) = segs.get(seg) else { return };
        let at = a + (off - base) as u64;
        let mut b = [0u8; 1];
        if mem.read_slice(&mut b, at).is_ok() {
            b[0] ^= x;
            let _ = mem.write_slice(&b, at);
        }
    }
}

impl super::Nvme {
    /// The controller's error injection rules, as a control socket shares
    /// them: rules added or removed apply from the next command fetched.
    pub fn injector(&self) -> Arc<Injector> {
        crate::lock(&self.core).ext.injector.clone()
    }

    /// Tests: starts the log of timed completions (due and posted times).
    #[cfg(any(test, feature = "oracle"))]
    pub fn timed_log(&self) -> Arc<Mutex<Vec<TimedRecord>>> {
        let log: Arc<Mutex<Vec<TimedRecord>>> = Arc::default();
        let mut c = crate::lock(&self.core);
        c.ext.timelog = Some(log.clone());
        for s in &c.shards {
            crate::lock(s).ext.timelog = Some(log.clone());
        }
        log
    }
}
