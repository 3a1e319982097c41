//! The `virtio-blk` device thread: served on ioeventfd kicks
//! (`notify=ioeventfd`), or polling the available ring with the driver's
//! notifications suppressed (`notify=poll`), so a driver that honours
//! EVENT_IDX (or NO_NOTIFY) makes no exit while requests keep coming.

use super::pci::BlkEngine;
use super::transport::State;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};
use vmm_sys_util::eventfd::EventFd;

/// How long the poller spins on an empty ring before it sleeps.
pub const POLL_IDLE: Duration = Duration::from_micros(200);

/// Waits up to 1 s for a kick; the number of kicks read (0: none, or a stop).
fn wait_kick(kick: &EventFd, stop: &AtomicBool) -> u64 {
    let mut fds = [libc::pollfd { fd: kick.as_raw_fd(), events: libc::POLLIN, revents: 0 }];
    // SAFETY: one valid pollfd; a bounded wait so a stop is seen.
    unsafe { libc::poll(fds.as_mut_ptr(), 1, 1000) };
    if stop.load(Ordering::Acquire) {
        return 0; // the stop's own kick is not the guest's
    }
    kick.read().unwrap_or(0)
}

/// `notify=ioeventfd`: serve the queue on each kick.
pub(super) fn kick_loop(state: &Mutex<State<BlkEngine>>, kick: &EventFd, stop: &AtomicBool) {
    while !stop.load(Ordering::Acquire) {
        let n = wait_kick(kick, stop);
        if n > 0 {
            {
                let mut st = crate::lock(state);
                st.e.st.kicks = st.e.st.kicks.saturating_add(n);
            }
            // A driver that keeps the queue full keeps this going: the
            // stop is looked at between passes, the lock let go of.
            while !stop.load(Ordering::Acquire) && crate::lock(state).serve() {}
        }
    }
}

/// `notify=poll`: poll with notifications off; after [`POLL_IDLE`] without
/// work, turn them on, look once more (a request that came in between is
/// served at once), and sleep on the ioeventfd.
pub(super) fn poll_loop(state: &Mutex<State<BlkEngine>>, kick: &EventFd, stop: &AtomicBool) {
    crate::lock(state).e.polling = false; // notifications on until the first kick
    let mut idle = Instant::now();
    let mut awake = false;
    while !stop.load(Ordering::Acquire) {
        if !awake {
            let n = wait_kick(kick, stop);
            if n == 0 {
                continue;
            }
            let mut st = crate::lock(state);
            st.e.st.kicks = st.e.st.kicks.saturating_add(n);
            st.set_polling(true);
            (awake, idle) = (true, Instant::now());
        }
        let worked = crate::lock(state).has_work();
        if worked {
            // One pass per lock hold: a full queue starves neither the
            // BAR accesses nor the stop.
            while !stop.load(Ordering::Acquire) && crate::lock(state).serve() {}
            idle = Instant::now();
        } else if idle.elapsed() >= POLL_IDLE {
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
