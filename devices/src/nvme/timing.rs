//! Completions posted at their due time: the namespace's timing model
//! (`timing=`, `block::timing`) and injected delays. A command is carried
//! out as without them; then, if its completion is due later than now, it
//! goes into its queue group's [`TimerWheel`](crate::block::timing::TimerWheel)
//! instead of its CQ, and counts as owed CQ room (as a file operation in
//! flight does), so the SQ stops being fetched before the CQ could
//! overflow. The group's device thread expires the wheel at every turn
//! (`io_pass`) and never sleeps past a due time: the ioeventfd thread
//! sleeps until it, an adaptive poller until [`TIMED_MARGIN`] before it
//! and then polls for it (`poller/`), the pollers of `shm`/`bar` never
//! sleep, and a pool thread sleeps no longer than it.
//!
//! [`TIMED_MARGIN`]: super::poller::TIMED_MARGIN Capacity: the entries of the group's
//! CQs (owed room bounds what one CQ can have held), grown when a queue is
//! created. Deleting an SQ, a reset or a disable forgets what the wheel
//! holds for those queues. Off (no `timing=`, no delay rule fired) the
//! path costs a branch per command.

use super::controller::Core;
use super::inject::{Extra, Timed};
use crate::block::timing::{OpKind, TimerWheel};

/// The timing model's operation for I/O opcode `opcode`.
fn op_kind(opcode: u8) -> Option<OpKind> {
    match opcode {
        0x00 => Some(OpKind::Flush),
        0x01 => Some(OpKind::Write),
        0x02 => Some(OpKind::Read),
        0x08 | 0x09 => Some(OpKind::Discard),
        _ => None,
    }
}

impl Core {
    /// The data bytes of I/O command `c` as the timing model counts them
    /// (a Read's or a Write's; 0 for the others).
    pub(super) fn io_bytes(&self, c: &super::queue::Sqe) -> u64 {
        match c.opcode {
            // A command naming no namespace fails at once; 512-byte blocks then.
            0x01 | 0x02 => {
                let shift = super::inject::namespace_lbas(self, c.nsid).map_or(9, |(s, _)| s);
                ((c.cdw12 & 0xffff) as u64 + 1) << shift
            }
            _ => 0,
        }
    }

    /// The clock value a command fetched now carries (timing on), else 0.
    #[inline]
    pub(super) fn arrival(&self, qid: usize) -> u64 {
        if self.ext.timing && qid > 0 {
            self.ext.now()
        } else {
            0
        }
    }

    /// A command of SQ `qid` was carried out with (dw0, st): true if its
    /// completion is held for later (the wheel took it), false to post it
    /// now. Applies a read's corruption first.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn finish(&mut self, qid: usize, cid: u16, opcode: u8, bytes: u64, dw0: u32, st: u16, x: Extra) -> bool {
        let mut due = 0;
        if self.ext.timing && qid > 0 {
            if let (Some(op), Some(m)) = (op_kind(opcode), self.model(x.nsid)) {
                due = crate::lock(m).admit(x.arrival, op, bytes);
            }
        }
        if x.delay != 0 {
            due = due.max(if x.arrival != 0 { x.arrival } else { self.ext.now() }).saturating_add(x.delay);
        }
        if due == 0 {
            return false;
        }
        let now = self.ext.now();
        if due <= now && x.delay == 0 {
            self.log_timed(qid as u16, cid, x.arrival, due, now);
            return false;
        }
        if self.mode() == super::DoorbellMode::Mmio {
            // No device thread to post it later (timing= is refused here; a delay is not kept).
            return false;
        }
        let Some(cqid) = self.queues.sqs[qid].as_ref().map(|s| s.cqid) else { return false };
        let t = Timed { due, arrival: x.arrival, sqid: qid as u16, cid, cqid, dw0, st };
        let first = self.ext.wheel.as_ref().and_then(|w| w.next_due()).is_none_or(|d| due < d);
        if !self.wheel_insert(t) {
            log::warn!("nvme: timer wheel full; the completion of cid {cid} on SQ {qid} is posted now");
            return false;
        }
        self.flight.owed[cqid as usize] += 1;
        if first {
            self.wake_for_timed();
        }
        true
    }

    /// The group's device thread may sleep past a completion just put in the
    /// wheel (served on another thread: a doorbell that exited): woken, it
    /// looks again and sleeps no longer than the wheel's next due time.
    fn wake_for_timed(&mut self) {
        match self.mode() {
            m if m.adaptive() && self.db.sleeping => self.wake_poller(),
            super::DoorbellMode::Ioeventfd => {
                if let Some(k) = &self.db.kick {
                    if k.write(1).is_ok() {
                        self.db.own_wakes += 1;
                    }
                }
            }
            _ => {} // shm, bar: the pollers never sleep
        }
    }

    /// Into the wheel, made or grown to the group's CQ entries if needed.
    fn wheel_insert(&mut self, t: Timed) -> bool {
        if let Some(w) = &mut self.ext.wheel {
            if w.insert(t.due, t).is_ok() {
                return true;
            }
        }
        let need: usize = self.queues.cqs.iter().flatten().map(|q| q.size as usize).sum::<usize>().max(64);
        let mut held = Vec::new();
        if let Some(mut w) = self.ext.wheel.take() {
            w.expire(u64::MAX, &mut held);
        }
        let mut w = TimerWheel::new(need.max(held.len() + 1));
        for h in held.into_iter().chain(std::iter::once(t)) {
            if w.insert(h.due, h).is_err() {
                return false;
            }
        }
        self.ext.wheel = Some(w);
        true
    }

    /// The group's turn: posts the timed completions that are due (in due
    /// order), and those that waited for CQ room. True if any was posted.
    pub(super) fn expire_timed(&mut self) -> bool {
        if self.ext.wheel.as_ref().is_none_or(|w| w.is_empty()) && self.ext.late.is_empty() {
            return false;
        }
        let now = self.ext.now();
        let mut out = std::mem::take(&mut self.ext.expired);
        if let Some(w) = &mut self.ext.wheel {
            w.expire(now, &mut out);
        }
        self.ext.late.extend(out.drain(..));
        self.ext.expired = out;
        let mut did = false;
        for _ in 0..self.ext.late.len() {
            let t = self.ext.late.pop_front().unwrap();
            if self.queues.cqs[t.cqid as usize].is_some_and(|q| q.full()) {
                self.ext.late.push_back(t);
                continue;
            }
            let owed = &mut self.flight.owed[t.cqid as usize];
            *owed = owed.saturating_sub(1);
            self.log_timed(t.sqid, t.cid, t.arrival, t.due, self.ext.now());
            self.complete(t.sqid as usize, t.cid, t.dw0, t.st);
            did = true;
        }
        did
    }

    /// Timed completions held (the device thread keeps polling for them).
    #[inline]
    pub(super) fn timed_held(&self) -> bool {
        self.ext.wheel.as_ref().is_some_and(|w| !w.is_empty()) || !self.ext.late.is_empty()
    }

    /// A timed completion is due now or past (posted by the next pass).
    pub(super) fn timed_due_now(&self) -> bool {
        self.timed_wait().is_some_and(|w| w.is_zero())
    }

    /// When the next timed completion is due, as a wait from now.
    pub(super) fn timed_wait(&self) -> Option<std::time::Duration> {
        if !self.ext.late.is_empty() {
            return Some(std::time::Duration::ZERO);
        }
        let due = self.ext.wheel.as_ref()?.next_due()?;
        Some(std::time::Duration::from_nanos(due.saturating_sub(self.ext.now())))
    }

    /// Forgets the timed completions of SQ `sqid` (None: all), their CQ
    /// room no longer owed.
    pub(super) fn forget_timed(&mut self, sqid: Option<u16>) {
        let mine = |s: u16| sqid.is_none_or(|q| q == s);
        let mut all: Vec<Timed> = self.ext.late.drain(..).collect();
        if let Some(mut w) = self.ext.wheel.take() {
            w.expire(u64::MAX, &mut all);
            // A fresh wheel (the old one's cursor is past every due time);
            // the same capacity holds what stays (late ones expire at once).
            let mut keep = TimerWheel::new(w.capacity());
            for t in all.iter().filter(|t| !mine(t.sqid)) {
                let _ = keep.insert(t.due, *t);
            }
            self.ext.wheel = Some(keep);
        }
        for t in all.iter().filter(|t| mine(t.sqid)) {
            let owed = &mut self.flight.owed[t.cqid as usize];
            *owed = owed.saturating_sub(1);
        }
    }

    /// Namespace `nsid`'s timing model, if it has one.
    fn model(&self, nsid: u32) -> Option<&std::sync::Mutex<crate::block::timing::TimingModel>> {
        self.ext.shared.timing.get(self.ns_index(nsid)?)?.as_deref()
    }

    /// A timed completion posted: into the device's histograms (a model's:
    /// `arrival` set) and the tests' log.
    #[cfg_attr(not(any(test, feature = "oracle")), allow(unused_variables))]
    fn log_timed(&self, sqid: u16, cid: u16, arrival: u64, due_ns: u64, posted_ns: u64) {
        if let (Some(h), true) = (&self.ext.shared.hist, arrival != 0) {
            h.record(arrival, due_ns, posted_ns);
        }
        #[cfg(any(test, feature = "oracle"))]
        if let Some(l) = &self.ext.timelog {
            crate::lock(l).push(super::inject::TimedRecord { sqid, cid, arrival_ns: arrival, due_ns, posted_ns });
        }
    }
}
