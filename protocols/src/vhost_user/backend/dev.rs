//! The device state the session thread and the queue threads share: the
//! disk ([`Blk`]), the guest memory of the current session, each ring
//! (a [`Queue`] over that memory and its call and error fds) and the
//! counters. One lock; a queue thread holds it for one pass (at most a
//! ring's worth of requests), as the in-VMM device's thread does.

use iopath_devices::virtio::blk::{self, Blk};
use iopath_devices::virtio::inflight::InflightRing;
use iopath_devices::virtio::queue::{Queue, MAX_QUEUE_SIZE};
use iopath_devices::{Counter, GuestMem};
use std::collections::VecDeque;
use std::fs::File;
use std::os::fd::AsRawFd;
use std::sync::Arc;

/// One virtqueue as the frontend set it up.
#[derive(Default)]
pub(super) struct Ring {
    pub(super) q: Queue,
    /// Signalled when used buffers need an interrupt (SET_VRING_CALL), by
    /// the ring's thread once it let go of the lock.
    pub(super) call: Option<Arc<File>>,
    /// Signalled when the driver broke the ring (SET_VRING_ERR).
    pub(super) err: Option<File>,
    /// SET_VRING_ENABLE (or on from the start without PROTOCOL_FEATURES).
    pub(super) enabled: bool,
    /// The driver broke the ring: nothing more is served until it restarts.
    pub(super) broken: bool,
    /// A poller serves the ring: notifications stay suppressed.
    pub(super) polling: bool,
    /// Its part of the in-flight region (SET_INFLIGHT_FD), if the frontend set one.
    pub(super) inflight: Option<InflightRing>,
    /// Heads an earlier device process took and did not complete, oldest
    /// first: served before any new chain (at most the queue size).
    pub(super) resubmit: VecDeque<u16>,
    /// Resumed from a region an earlier device process used: the driver is
    /// owed one signal on the call fd (that process may have died between
    /// publishing used entries and signalling them; a driver waiting on
    /// those would wait for ever). Paid once a call fd is there.
    pub(super) owe_call: bool,
}

impl Ring {
    pub(super) fn new() -> Self {
        Ring { q: Queue::new(MAX_QUEUE_SIZE), ..Default::default() }
    }
}

#[derive(Default)]
pub(super) struct Stats {
    pub(super) sessions: u64,
    pub(super) kicks: u64,
    pub(super) sleeps: u64,
    pub(super) requests: u64,
    pub(super) errors: u64,
    pub(super) interrupts: u64,
    pub(super) ring_errors: u64,
    /// Messages refused (an error reply, or the session closed).
    pub(super) refused: u64,
    /// Sessions ended by the channel: a broken message, a request late.
    pub(super) socket_errors: u64,
    pub(super) mem_tables: u64,
    /// Chains resubmitted from the in-flight region (taken by a device
    /// process that died before completing them).
    pub(super) resubmitted: u64,
    /// In-flight regions the frontend set (SET_INFLIGHT_FD accepted).
    pub(super) inflight_regions: u64,
    /// Requests served on each ring.
    pub(super) ring_requests: [u64; super::NUM_QUEUES],
}

/// What the session thread and the queue threads share.
pub(super) struct Dev {
    pub(super) blk: Blk,
    /// Guest RAM of the current session (SET_MEM_TABLE); None between sessions.
    pub(super) mem: Option<GuestMem>,
    pub(super) rings: Vec<Ring>,
    pub(super) st: Stats,
}

/// Why a kick, call or error fd the frontend gave is refused.
#[derive(Debug, thiserror::Error)]
pub(super) enum BadEventFd {
    #[error("fstat: {0}")]
    Fstat(std::io::Error),
    #[error("not an eventfd (file type {0:#o})")]
    NotAnEventFd(u32),
    #[error("O_NONBLOCK: {0}")]
    NonBlocking(std::io::Error),
}

/// Checks that `f`, a kick, call or error fd the frontend gave, is an
/// eventfd (an anonymous inode: no file type), and makes it non-blocking.
/// A pipe, a socket or a file would block the ring's thread once full, or
/// grow without bound; a signal that finds the eventfd full is dropped.
pub(super) fn eventfd(f: &File) -> Result<(), BadEventFd> {
    let fd = f.as_raw_fd();
    // The raw fstat: glibc's is newfstatat, which the sandbox refuses.
    let st = crate::nopath::fstat(f).map_err(BadEventFd::Fstat)?;
    let kind = st.st_mode & libc::S_IFMT;
    if kind != 0 {
        return Err(BadEventFd::NotAnEventFd(kind));
    }
    // SAFETY: fcntl on an fd we own.
    let ok = unsafe {
        let fl = libc::fcntl(fd, libc::F_GETFL);
        fl >= 0 && libc::fcntl(fd, libc::F_SETFL, fl | libc::O_NONBLOCK) == 0
    };
    if !ok {
        return Err(BadEventFd::NonBlocking(std::io::Error::last_os_error()));
    }
    Ok(())
}

/// Writes 1 to an eventfd the frontend gave (non-blocking, see
/// [`eventfd`]); false if that failed.
pub(super) fn signal(f: &File) -> bool {
    let one = 1u64.to_ne_bytes();
    // SAFETY: an 8-byte write from a local buffer to an fd we own.
    unsafe { libc::write(f.as_raw_fd(), one.as_ptr().cast(), 8) == 8 }
}

impl Dev {
    pub(super) fn new(blk: Blk, queues: usize) -> Self {
        Dev { blk, mem: None, rings: (0..queues).map(|_| Ring::new()).collect(), st: Stats::default() }
    }

    /// Ring `i` is served: memory mapped, the ring started and enabled, and
    /// not broken since it started.
    pub(super) fn live(&self, i: usize) -> bool {
        let r = &self.rings[i];
        self.mem.is_some() && r.q.ready && r.enabled && !r.broken
    }

    /// The driver broke ring `i`: stop serving it and tell the frontend on
    /// its error fd, if it gave one.
    fn broken(&mut self, i: usize, why: &str) {
        log::warn!("vhost-user-blk: queue {i}: {why}; queue stopped");
        self.st.ring_errors += 1;
        let r = &mut self.rings[i];
        r.broken = true;
        if let Some(e) = &r.err {
            signal(e);
        }
    }

    /// Serves ring `i`'s available requests, at most a ring's worth, then
    /// re-arms notifications (unless polling) and signals the call fd if the
    /// driver asked (EVENT_IDX or NO_INTERRUPT, by [`Queue::push_used`]).
    /// True if it stopped with more to do: the caller lets go of the lock
    /// before the next pass, so the session thread is not held off; and the
    /// call fd to signal, which the caller does after letting go of it.
    pub(super) fn serve(&mut self, i: usize) -> (bool, Option<Arc<File>>) {
        if !self.live(i) {
            return (false, None);
        }
        let Some(mem) = self.mem.clone() else { return (false, None) };
        let Dev { blk, rings, st, .. } = self;
        let r = &mut rings[i];
        let (mut irq, mut more) = (false, false);
        let mut fault = None;
        for _ in 0..=r.q.num {
            more = true;
            // Chains a dead device process left in flight first (already
            // noted in the region), then the available ring's.
            let next = match r.resubmit.pop_front() {
                Some(head) => {
                    st.resubmitted += 1;
                    r.q.chain(&mem, head).map(Some)
                }
                None => r.q.pop(&mem).inspect(|c| {
                    if let (Some(c), Some(f)) = (c, &mut r.inflight) {
                        f.take(c.head);
                    }
                }),
            };
            match next {
                Ok(Some(c)) => {
                    let done = blk.handle(&mem, &c.descs);
                    st.requests += 1;
                    st.ring_requests[i] += 1;
                    if done.status != Some(blk::S_OK) {
                        st.errors += 1;
                    }
                    if let Some(f) = &r.inflight {
                        f.used_before(c.head);
                    }
                    match r.q.push_used(&mem, c.head, done.written) {
                        Ok(want) => irq |= want,
                        Err(e) => {
                            fault = Some(format!("used ring: {e}"));
                            break;
                        }
                    }
                    if let Some(f) = &r.inflight {
                        f.used_after(c.head, r.q.next_used);
                    }
                }
                Ok(None) => match r.q.set_notify(&mem, !r.polling) {
                    Ok(a) if a != r.q.next_avail() => continue, // raced in
                    Ok(_) => {
                        more = false;
                        break;
                    }
                    Err(e) => {
                        fault = Some(format!("used ring: {e}"));
                        break;
                    }
                },
                Err(e) => {
                    fault = Some(e.to_string());
                    break;
                }
            }
        }
        let call = if irq { r.call.clone() } else { None };
        if call.is_some() {
            st.interrupts += 1;
        }
        if let Some(why) = fault {
            self.broken(i, &why);
            return (false, call);
        }
        (more, call)
    }

    /// True if ring `i` is live and has chains the device has not taken.
    pub(super) fn has_work(&self, i: usize) -> bool {
        let r = &self.rings[i];
        self.live(i) && (!r.resubmit.is_empty() || self.mem.as_ref().is_some_and(|m| r.q.has_work(m).unwrap_or(true)))
    }

    /// Sets whether a poller serves ring `i` and asks the driver for
    /// notifications accordingly. True if work is already waiting.
    pub(super) fn set_polling(&mut self, i: usize, on: bool) -> bool {
        self.rings[i].polling = on;
        if !self.live(i) {
            return false;
        }
        let Some(mem) = self.mem.clone() else { return false };
        let r = &mut self.rings[i];
        match r.q.set_notify(&mem, !on) {
            Ok(a) => a != r.q.next_avail(),
            Err(e) => {
                self.broken(i, &format!("used ring: {e}"));
                false
            }
        }
    }

    /// Forgets everything a session set up: memory, rings and their fds.
    pub(super) fn clear(&mut self) {
        self.mem = None;
        for r in &mut self.rings {
            *r = Ring::new();
        }
    }

    pub(super) fn counters(&self) -> Vec<Counter> {
        let st = &self.st;
        [
            ("sessions", st.sessions),
            ("kicks", st.kicks),
            ("sleeps", st.sleeps),
            ("requests", st.requests),
            ("errors", st.errors),
            ("interrupts", st.interrupts),
            ("ring_errors", st.ring_errors),
            ("refused", st.refused),
            ("socket_errors", st.socket_errors),
            ("mem_tables", st.mem_tables),
            ("inflight_regions", st.inflight_regions),
            ("inflight_resubmits", st.resubmitted),
        ]
        .into_iter()
        .map(|(n, value)| Counter { name: n.into(), value })
        .chain(
            st.ring_requests[..self.rings.len()]
                .iter()
                .enumerate()
                .map(|(q, &value)| Counter { name: format!("q{q}.requests"), value }),
        )
        .collect()
    }
}
