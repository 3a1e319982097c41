//! The `virtio-blk` device thread: served on ioeventfd kicks
//! (`notify=ioeventfd`), or polling the available ring with the driver's
//! notifications suppressed (`notify=poll`), so a driver that honours
//! EVENT_IDX (or NO_NOTIFY) makes no exit while requests keep coming.
//! On a file disk with io_uring it also wakes on the ring's completion
//! eventfd and reaps (`pci.rs`: each pass reaps before it serves). With
//! completions held for their due time (`blk_emu.rs`) it sleeps no longer
//! than until the first is due; each pass posts those due first.

use super::pci::BlkEngine;
use super::transport::State;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};
use vmm_sys_util::eventfd::EventFd;

/// How long the poller spins on an empty ring before it sleeps.
pub const POLL_IDLE: Duration = Duration::from_micros(200);

/// What wakes the thread: the queues' ioeventfd, the file's io_uring
/// completions (a file disk with io_uring), and the stop flag.
pub(super) struct Wake<'a> {
    pub(super) kick: &'a EventFd,
    pub(super) done: Option<&'a EventFd>,
    pub(super) stop: &'a AtomicBool,
}

/// The longest a wait lasts: a stop is seen within it.
const MAX_WAIT: Duration = Duration::from_secs(1);

/// Waits for a kick or a completion, at most [`MAX_WAIT`] and no longer
/// than until the first held completion is due: the number of kicks read
/// (0: none, or a stop) and whether completions were signalled.
fn wait_kick(state: &Mutex<State<BlkEngine>>, w: &Wake) -> (u64, bool) {
    let wait = crate::lock(state).until_due().map_or(MAX_WAIT, |ns| Duration::from_nanos(ns).min(MAX_WAIT));
    let ts = libc::timespec { tv_sec: wait.as_secs() as libc::time_t, tv_nsec: wait.subsec_nanos() as libc::c_long };
    let mut fds = [libc::pollfd { fd: w.kick.as_raw_fd(), events: libc::POLLIN, revents: 0 }; 2];
    let n = match w.done {
        Some(d) => {
            fds[1].fd = d.as_raw_fd();
            2
        }
        None => 1,
    };
    // SAFETY: `n` valid pollfds and a timespec that outlive the call; a
    // bounded wait so a stop is seen.
    unsafe { libc::ppoll(fds.as_mut_ptr(), n as libc::nfds_t, &ts, std::ptr::null()) };
    if w.stop.load(Ordering::Acquire) {
        return (0, false); // the stop's own kick is not the guest's
    }
    // The completion eventfd blocks on read: read only when it is readable.
    let done = n == 2 && fds[1].revents & libc::POLLIN != 0 && w.done.is_some_and(|d| d.read().is_ok());
    (w.kick.read().unwrap_or(0), done)
}

/// `notify=ioeventfd`: serve the queues on each kick, and reap on each completion.
pub(super) fn kick_loop(state: &Mutex<State<BlkEngine>>, w: &Wake) {
    while !w.stop.load(Ordering::Acquire) {
        let (n, done) = wait_kick(state, w);
        // With requests in flight, a quiet second also makes a pass: it
        // retries what a refused submit left in the ring (and a held
        // completion's due time is such an end of the wait).
        if n > 0 || done || crate::lock(state).in_flight() > 0 {
            {
                let mut st = crate::lock(state);
                st.e.st.kicks = st.e.st.kicks.saturating_add(n);
            }
            // A driver that keeps the queue full keeps this going: the
            // stop is looked at between passes, the lock let go of.
            while !w.stop.load(Ordering::Acquire) && crate::lock(state).serve() {}
        }
    }
}

/// `notify=poll`: poll with notifications off; after [`POLL_IDLE`] without
/// work, turn them on, look once more (a request that came in between is
/// served at once), and sleep on the ioeventfd (and the completions).
pub(super) fn poll_loop(state: &Mutex<State<BlkEngine>>, w: &Wake) {
    crate::lock(state).e.polling = false; // notifications on until the first kick
    let mut idle = Instant::now();
    let mut awake = false;
    while !w.stop.load(Ordering::Acquire) {
        if !awake {
            let (n, done) = wait_kick(state, w);
            if n == 0 {
                if done || crate::lock(state).in_flight() > 0 {
                    // Completions only (or a quiet second with requests in flight):
                    // reaped, and what they freed room for served.
                    while !w.stop.load(Ordering::Acquire) && crate::lock(state).serve() {}
                }
                continue;
            }
            let mut st = crate::lock(state);
            st.e.st.kicks = st.e.st.kicks.saturating_add(n);
            st.set_polling(true);
            (awake, idle) = (true, Instant::now());
        }
        let (worked, in_flight) = {
            let st = crate::lock(state);
            (st.has_work(), st.in_flight() > 0)
        };
        if worked || in_flight {
            // One pass per lock hold: a full queue starves neither the
            // BAR accesses nor the stop. A pass reaps first.
            while !w.stop.load(Ordering::Acquire) && crate::lock(state).serve() {}
            if worked {
                idle = Instant::now();
            }
        }
        if worked {
            continue;
        }
        if idle.elapsed() >= POLL_IDLE {
            let mut st = crate::lock(state);
            if !st.set_polling(false) {
                st.e.st.sleeps += 1;
                awake = false;
            } else {
                st.set_polling(true);
                idle = Instant::now();
            }
        } else {
            std::hint::spin_loop();
        }
    }
}
