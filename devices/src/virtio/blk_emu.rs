//! What happens to a virtio-blk request between the ring and the storage,
//! and between the storage and the used ring: error injection (`inject=`,
//! the block layer's [`Injector`], asked once per request before it runs)
//! and the timing model (`timing=`, [`TimingModel`]: the request runs on
//! the storage as before, and its completion waits in a [`TimerWheel`]
//! until its due time). Both are off unless asked; the engine (`pci.rs`)
//! calls [`Emu::decide`] per chain, [`Emu::hold`] per completion and
//! [`Emu::expire`] at the start of every pass.
//!
//! How a request looks to a rule ([`CommandView`]):
//! - `op`: IN is read (NVMe opcode 0x02), OUT write (0x01), FLUSH flush
//!   (0x00), DISCARD discard (Dataset Management, 0x09), WRITE_ZEROES
//!   write-zeroes (0x08); GET_ID and unknown types are "other" I/O with
//!   opcode 0xff (`op=io:0xff`); a chain whose header cannot be read is
//!   never shown to the rules (it fails as before);
//! - `nsid` is 1; `qid` is the virtqueue's index + 1 (NVMe's qid 0 is its
//!   admin queue, which virtio-blk has none of);
//! - `lba` counts 512-byte sectors (virtio-blk's unit, whatever the
//!   disk): an IN or OUT covers `sector ..= sector + len / 512 - 1`, a
//!   DISCARD or WRITE_ZEROES its (one) segment; none for FLUSH, GET_ID or
//!   no data.
//!
//! What an action does:
//! - `status`: not run; the status byte is VIRTIO_BLK_S_UNSUPP for NVMe's
//!   Invalid Command Opcode (SCT 0, SC 0x01), S_OK for Successful
//!   Completion (SCT 0, SC 0: the request is *not* run, a lost write or
//!   a read that returns nothing), S_IOERR for every other status; used
//!   length 1 (the status byte);
//! - `delay`: run, and its completion posted no earlier than `delay` after
//!   it was taken from the ring (and its timing model due time);
//! - `drop`: not run, never completed (the driver times out); a reset
//!   forgets it with the rest of the ring;
//! - `corrupt`: run; if it is an IN that succeeded, [`Corrupt::flips`] of
//!   its data length are XORed into the data in guest memory before the
//!   completion is posted;
//! - `fatal`: not run, not completed; the device sets DEVICE_NEEDS_RESET
//!   and raises its configuration interrupt (as a broken ring does), and
//!   serves nothing until the driver resets it;
//! - `event`: NVMe's asynchronous events have no virtio-blk counterpart:
//!   refused when the rule is given ([`check_rule`]).
//!
//! Completions held for their due time are bounded by the rings: a held
//! request's head is not yet in its used ring, so a queue holds at most
//! its size, and the wheel is made for [`MAX_QUEUE_SIZE`] per queue. The
//! device thread sleeps no longer than the earliest due time
//! ([`Emu::until_due`]). A reset (and the end of a run) forgets what is
//! held: nothing reaches a used ring after it.

use super::blk::{self, Done, Part, SECTOR, T_DISCARD, T_FLUSH, T_IN, T_OUT, T_WRITE_ZEROES};
use super::queue::{Desc, MAX_QUEUE_SIZE};
use crate::block::inject::{Action, CommandView, Corrupt, Injector, Kind, Lbas, Rule, RuleError};
use crate::block::timing::{OpKind, TimerWheel, TimingModel, TimingSpec};
use crate::GuestMem;
use std::sync::Arc;

/// The rules a device asks per request, shared with whoever adds, lists
/// and clears them at run time (a control socket). The injector refuses a
/// rule that fails [`check_rule`]. While it holds no rule, a request costs one relaxed
/// load ([`Injector::armed`]), no lock.
pub type Rules = Arc<Injector>;

/// The device's clock, in ns from any fixed point (tests give a fake one).
pub type Clock = Arc<dyn Fn() -> u64 + Send + Sync>;

/// A monotonic clock: ns since its first use.
pub fn monotonic() -> Clock {
    static EPOCH: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();
    let epoch = *EPOCH.get_or_init(std::time::Instant::now);
    Arc::new(move || epoch.elapsed().as_nanos() as u64)
}

/// A rule virtio-blk cannot carry out.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum RuleRefused {
    #[error("rule {0}: event actions are NVMe asynchronous events, which virtio-blk has none of")]
    Event(String),
}

/// Ok if virtio-blk can carry out `rule` (every action but `event`).
pub fn check_rule(rule: &Rule) -> Result<(), RuleRefused> {
    match rule.action {
        Action::Event(_) => Err(RuleRefused::Event(rule.to_string())),
        _ => Ok(()),
    }
}

/// [`check_rule`] as the device's [`Injector`] asks it of every rule added
/// (a control socket's too).
fn injector_check(rule: &Rule) -> Result<(), RuleError> {
    check_rule(rule).map_err(|e| RuleError::Refused(e.to_string()))
}

/// What [`Emu::decide`] says to do with a chain.
pub(super) enum Decision {
    /// Run it; then its completion as the plan says.
    Run(Plan),
    /// Not run: completed with this (its status byte is written), not
    /// before `due`.
    Complete(Done, Option<u64>),
    /// Not run, never completed.
    Drop,
    /// Not run; the device needs a reset.
    Fatal,
}

/// What happens to a request that runs, once it has.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) struct Plan {
    /// Its completion is posted no earlier (ns of the device's clock).
    pub(super) due: Option<u64>,
    /// Its data is corrupted first (an IN that succeeded).
    pub(super) corrupt: Option<Corrupt>,
}

/// A completion waiting for its due time.
#[derive(Clone, Copy, Default)]
struct Held {
    queue: u16,
    head: u16,
    done: Option<Done>,
}

/// Error injection and the timing model of one device (see the module doc).
pub(super) struct Emu {
    pub(super) rules: Rules,
    model: Option<TimingModel>,
    /// Made at the first completion held; [`MAX_QUEUE_SIZE`] per queue.
    wheel: Option<TimerWheel<u32>>,
    capacity: usize,
    held: Vec<Held>,
    free: Vec<u32>,
    /// Per queue: the plan of a chain given back to its ring (no io_uring
    /// slots free), which the next chain taken from it (that one) keeps.
    parked: Vec<Option<Plan>>,
    pub(super) clock: Clock,
    /// Requests dropped by a rule, and completions held (so far, at most at once).
    pub(super) dropped: u64,
    pub(super) delayed: u64,
    pub(super) held_max: u64,
}

impl Emu {
    /// For a device of `queues` queues, with `timing` and the rules `rules`
    /// (each checked with [`check_rule`] by the options).
    pub(super) fn new(queues: u16, timing: Option<&TimingSpec>, rules: &[Rule]) -> Emu {
        let set = Injector::checked(injector_check);
        for r in rules {
            if let Err(e) = set.add(*r) {
                log::warn!("virtio-blk: inject rule {r}: {e}"); // validated when parsed: cannot be
            }
        }
        Emu {
            rules: Arc::new(set),
            model: timing.map(TimingModel::new),
            wheel: None,
            capacity: usize::from(queues) * usize::from(MAX_QUEUE_SIZE),
            held: Vec::new(),
            free: Vec::new(),
            parked: vec![None; usize::from(queues)],
            clock: monotonic(),
            dropped: 0,
            delayed: 0,
            held_max: 0,
        }
    }

    /// Completions held now.
    pub(super) fn held(&self) -> usize {
        self.wheel.as_ref().map_or(0, TimerWheel::len)
    }

    /// What to do with the chain `descs` of queue `queue`, taken from the
    /// ring now: asks the rules (if any), and the timing model for its due time.
    pub(super) fn decide(&mut self, mem: &GuestMem, descs: &[Desc], queue: u16) -> Decision {
        if let Some(plan) = self.parked.get_mut(usize::from(queue)).and_then(Option::take) {
            return Decision::Run(plan);
        }
        // Neither asked for (the usual case): the chain is not even looked at.
        if self.model.is_none() && !self.rules.armed() {
            return Decision::Run(Plan::default());
        }
        let Some((view, kind, bytes)) = view(mem, descs, queue) else { return Decision::Run(Plan::default()) };
        let action = self.rules.decide(&view);
        let now = (self.clock)();
        let op = match kind {
            T_IN => Some(OpKind::Read),
            T_OUT => Some(OpKind::Write),
            T_FLUSH => Some(OpKind::Flush),
            T_DISCARD | T_WRITE_ZEROES => Some(OpKind::Discard),
            _ => None,
        };
        let due = match (&mut self.model, op) {
            (Some(m), Some(op)) => Some(m.admit(now, op, bytes)),
            _ => None,
        };
        match action {
            None | Some(Action::Event(_)) => Decision::Run(Plan { due, corrupt: None }),
            Some(Action::Delay { ns }) => {
                Decision::Run(Plan { due: Some(due.unwrap_or(now).max(now.saturating_add(ns))), corrupt: None })
            }
            Some(Action::Corrupt(c)) => Decision::Run(Plan { due, corrupt: (kind == T_IN).then_some(c) }),
            Some(Action::Status(s)) => {
                let status = match (s.sct, s.sc) {
                    (0, 0) => blk::S_OK,
                    (0, 1) => blk::S_UNSUPP,
                    _ => blk::S_IOERR,
                };
                Decision::Complete(blk::status_only(mem, descs, kind, status), due)
            }
            Some(Action::Drop) => {
                self.dropped += 1;
                Decision::Drop
            }
            Some(Action::Fatal) => Decision::Fatal,
        }
    }

    /// Keeps `plan` for queue `queue`'s chain that goes back to its ring:
    /// decided once, it is not asked of the rules and the model again.
    pub(super) fn park(&mut self, queue: u16, plan: Plan) {
        if let Some(p) = self.parked.get_mut(usize::from(queue)) {
            *p = Some(plan);
        }
    }

    /// Holds the completion of chain `head` of `queue` until `due` if that
    /// is still to come; false if it is to be posted now.
    pub(super) fn hold(&mut self, queue: u16, head: u16, done: Done, due: Option<u64>) -> bool {
        let Some(due) = due.filter(|&d| d > (self.clock)()) else { return false };
        let cap = self.capacity;
        let wheel = self.wheel.get_or_insert_with(|| TimerWheel::new(cap));
        let id = match self.free.pop() {
            Some(id) => id,
            None => {
                self.held.push(Held::default());
                (self.held.len() - 1) as u32
            }
        };
        if wheel.insert(due, id).is_err() {
            // Only a driver that makes a head available again before it was
            // used gets here: posted now rather than held without bound.
            log::debug!("virtio-blk: more completions held than the rings hold; posted now");
            self.free.push(id);
            return false;
        }
        self.held[id as usize] = Held { queue, head, done: Some(done) };
        self.delayed += 1;
        self.held_max = self.held_max.max(wheel.len() as u64);
        true
    }

    /// The completions due by now, in due order: (queue, head, done).
    pub(super) fn expire(&mut self) -> Vec<(u16, u16, Done)> {
        let Some(wheel) = self.wheel.as_mut().filter(|w| !w.is_empty()) else { return Vec::new() };
        let mut ids = Vec::new();
        wheel.expire((self.clock)(), &mut ids);
        let mut out = Vec::with_capacity(ids.len());
        for id in ids {
            let h = std::mem::take(&mut self.held[id as usize]);
            self.free.push(id);
            if let Some(d) = h.done {
                out.push((h.queue, h.head, d));
            }
        }
        out
    }

    /// How long until the earliest held completion is due (zero: now);
    /// None if none is held.
    pub(super) fn until_due(&self) -> Option<u64> {
        let due = self.wheel.as_ref()?.next_due()?;
        Some(due.saturating_sub((self.clock)()))
    }

    /// Forgets every held completion (a reset, the end of a run).
    pub(super) fn reset(&mut self) {
        if self.held() > 0 {
            self.wheel = Some(TimerWheel::new(self.capacity));
        }
        self.held.clear();
        self.free.clear();
        self.parked.iter_mut().for_each(|p| *p = None);
    }
}

/// `done` after `plan`'s corruption, if any (an IN that succeeded); one
/// that guest memory refused becomes S_IOERR.
pub(super) fn corrupted(mem: &GuestMem, descs: &[Desc], done: Done, plan: &Plan) -> Done {
    match plan.corrupt {
        Some(c) if done.kind == T_IN && done.status == Some(blk::S_OK) => {
            if corrupt(mem, descs, &c) {
                done
            } else {
                blk::finish(mem, descs, done.kind, false)
            }
        }
        _ => done,
    }
}

/// Flips `c`'s bytes in an IN's data, in guest memory (the chain's
/// writable bytes before its status byte). False if guest memory refused.
pub(super) fn corrupt(mem: &GuestMem, descs: &[Desc], c: &Corrupt) -> bool {
    let w = Part::new(descs.iter().filter(|d| d.write));
    let len = w.len.saturating_sub(1) as usize;
    if len == 0 {
        return true;
    }
    let mut data = vec![0u8; len];
    if !w.read(mem, 0, &mut data) {
        return false;
    }
    c.apply(&mut data);
    w.write(mem, 0, &data)
}

/// The chain as the rules see it, with its type and data bytes; None if
/// its header cannot be read.
pub(super) fn view(mem: &GuestMem, descs: &[Desc], queue: u16) -> Option<(CommandView, u32, u64)> {
    let r = Part::new(descs.iter().filter(|d| !d.write));
    let w = Part::new(descs.iter().filter(|d| d.write));
    let mut hdr = [0u8; 16];
    if r.len < 16 || !r.read(mem, 0, &mut hdr) {
        return None;
    }
    let kind = u32::from_le_bytes(hdr[0..4].try_into().unwrap());
    let sector = u64::from_le_bytes(hdr[8..16].try_into().unwrap());
    let span = |first: u64, sectors: u64| {
        (sectors > 0).then(|| Lbas { slba: first, nlb: u32::try_from(sectors - 1).unwrap_or(u32::MAX) })
    };
    let (k, opcode, lba, bytes) = match kind {
        T_IN => {
            let len = w.len.saturating_sub(1);
            (Kind::Read, 0x02, span(sector, len / SECTOR), len)
        }
        T_OUT => {
            let len = r.len - 16;
            (Kind::Write, 0x01, span(sector, len / SECTOR), len)
        }
        T_FLUSH => (Kind::Flush, 0x00, None, 0),
        T_DISCARD | T_WRITE_ZEROES => {
            let mut seg = [0u8; 16];
            let lba = if r.len >= 32 && r.read(mem, 16, &mut seg) {
                let first = u64::from_le_bytes(seg[0..8].try_into().unwrap());
                span(first, u64::from(u32::from_le_bytes(seg[8..12].try_into().unwrap())))
            } else {
                None
            };
            let k = if kind == T_DISCARD { (Kind::Discard, 0x09) } else { (Kind::WriteZeroes, 0x08) };
            (k.0, k.1, lba, 0)
        }
        _ => (Kind::Other, 0xff, None, 0),
    };
    Some((CommandView { opcode, kind: k, nsid: 1, lba, qid: queue + 1 }, kind, bytes))
}
