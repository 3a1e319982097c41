//! A ring's thread (`vhost-blk-q{N}`): served on each kick the frontend's
//! kick fd carries (`notify=ioeventfd`, or `exit`, which means the same
//! here: the guest's notification reaches this process as a kick), or
//! polling the available ring with the driver's notifications suppressed
//! (`notify=poll`: idle for [`POLL_IDLE`], notifications go back on, one
//! more look, and the thread sleeps on the kick fd). The same rules as the
//! in-VMM device's thread (`devices/src/virtio/worker.rs`), on [`Dev`].
//!
//! The thread also sleeps on a wake eventfd of its own: the session thread
//! writes it to stop the thread (joined before the kick fd is dropped) and
//! to have it look at the ring again when the ring was enabled.

use super::dev::{signal, Dev};
use std::fs::File;
use std::io::Read;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};
use vmm_sys_util::eventfd::EventFd;

/// How long the poller spins on an empty ring before it sleeps.
pub const POLL_IDLE: Duration = Duration::from_micros(200);

/// A running ring thread.
pub(super) struct Worker {
    wake: Arc<EventFd>,
    stop: Arc<AtomicBool>,
    handle: JoinHandle<()>,
}

/// What woke the thread.
enum Woke {
    /// The frontend kicked (once or more).
    Kick,
    /// The session thread asked for a look at the ring.
    Look,
    /// Stop, or the kick fd is gone.
    Stop,
}

struct Fds {
    kick: File,
    wake: Arc<EventFd>,
    stop: Arc<AtomicBool>,
    ring: usize,
}

impl Fds {
    /// Sleeps until a kick, a wake or a stop.
    fn wait(&mut self) -> Woke {
        let mut fds = [
            libc::pollfd { fd: self.kick.as_raw_fd(), events: libc::POLLIN, revents: 0 },
            libc::pollfd { fd: self.wake.as_raw_fd(), events: libc::POLLIN, revents: 0 },
        ];
        loop {
            // Before each sleep: a stop whose wake a look consumed (a look
            // read the eventfd after the stop wrote it) is seen here.
            if self.stop.load(Ordering::Acquire) {
                return Woke::Stop;
            }
            // SAFETY: two valid pollfds on the stack.
            let n = unsafe { libc::poll(fds.as_mut_ptr(), 2, -1) };
            if n < 0 && std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            if self.stop.load(Ordering::Acquire) {
                return Woke::Stop;
            }
            if fds[1].revents & libc::POLLIN != 0 {
                let _ = self.wake.read();
                return Woke::Look;
            }
            let k = fds[0].revents;
            if k & (libc::POLLERR | libc::POLLHUP | libc::POLLNVAL) != 0 || n < 0 {
                log::warn!("vhost-user-blk: queue {}: the kick fd failed; its thread stops", self.ring);
                return Woke::Stop;
            }
            if k & libc::POLLIN != 0 {
                let mut b = [0u8; 8];
                return match self.kick.read(&mut b) {
                    Ok(8) => Woke::Kick,
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
                    // Not an eventfd (EOF, a short read): a kick fd that would spin us.
                    r => {
                        log::warn!("vhost-user-blk: queue {}: read of the kick fd: {r:?}; its thread stops", self.ring);
                        Woke::Stop
                    }
                };
            }
        }
    }
}

impl Worker {
    /// Starts ring `ring`'s thread on `kick` (an eventfd made non-blocking:
    /// [`eventfd`](super::dev::eventfd)).
    pub(super) fn start(dev: Arc<Mutex<Dev>>, ring: usize, kick: File, poll: bool) -> std::io::Result<Worker> {
        let wake = Arc::new(EventFd::new(libc::EFD_NONBLOCK)?);
        let stop = Arc::new(AtomicBool::new(false));
        let mut fds = Fds { kick, wake: wake.clone(), stop: stop.clone(), ring };
        let handle = std::thread::Builder::new().name(format!("vhost-blk-q{ring}")).spawn(move || {
            iopath_devices::sandbox::enter(iopath_devices::sandbox::Role::Device);
            if poll {
                poll_loop(&dev, &mut fds)
            } else {
                kick_loop(&dev, &mut fds)
            }
        })?;
        Ok(Worker { wake, stop, handle })
    }

    /// Has the thread look at the ring (it was enabled).
    pub(super) fn nudge(&self) {
        let _ = self.wake.write(1);
    }

    /// Stops the thread and waits for it; its kick fd is closed with it.
    pub(super) fn stop(self) {
        self.stop.store(true, Ordering::Release);
        let _ = self.wake.write(1);
        let _ = self.handle.join();
    }
}

/// One pass over ring `i` ([`Dev::serve`]), the lock held for it only;
/// the call fd signalled after. True if the ring has more to do.
fn pass(dev: &Mutex<Dev>, i: usize) -> bool {
    let (more, call) = iopath_devices::lock(dev).serve(i);
    if let Some(c) = call {
        signal(&c);
    }
    more
}

/// Counts a wake by kicks as one kick (an eventfd's count is the
/// frontend's to choose: near `u64::MAX` it would overflow a sum).
fn kicked(dev: &Mutex<Dev>) {
    let st = &mut iopath_devices::lock(dev).st;
    st.kicks = st.kicks.saturating_add(1);
}

fn kick_loop(dev: &Mutex<Dev>, fds: &mut Fds) {
    let i = fds.ring;
    loop {
        match fds.wait() {
            Woke::Stop => return,
            Woke::Kick => kicked(dev),
            Woke::Look => {}
        }
        // A frontend that keeps the ring full keeps this going: the stop
        // (GET_VRING_BASE, the session's end) is looked at between passes.
        while !fds.stop.load(Ordering::Acquire) && pass(dev, i) {}
    }
}

fn poll_loop(dev: &Mutex<Dev>, fds: &mut Fds) {
    let i = fds.ring;
    iopath_devices::lock(dev).rings[i].polling = false; // notifications on until the first kick
    let (mut idle, mut awake) = (Instant::now(), false);
    loop {
        if fds.stop.load(Ordering::Acquire) {
            return;
        }
        if !awake {
            match fds.wait() {
                Woke::Stop => return,
                Woke::Kick => kicked(dev),
                Woke::Look => {}
            }
            iopath_devices::lock(dev).set_polling(i, true);
            (awake, idle) = (true, Instant::now());
        }
        let (live, worked) = {
            let d = iopath_devices::lock(dev);
            (d.live(i), d.has_work(i))
        };
        if !live {
            // Not served (disabled, stopped, broken): no spinning, sleep on kicks.
            iopath_devices::lock(dev).set_polling(i, false);
            awake = false;
            continue;
        }
        if worked {
            while !fds.stop.load(Ordering::Acquire) && pass(dev, i) {}
            idle = Instant::now();
        } else if idle.elapsed() >= POLL_IDLE {
            let mut d = iopath_devices::lock(dev);
            if !d.set_polling(i, false) {
                d.st.sleeps += 1;
                awake = false;
            } else {
                d.set_polling(i, true);
                idle = Instant::now();
            }
        } else {
            std::hint::spin_loop();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::FromRawFd;

    /// The state a look leaves when it read the wake a stop wrote (a look
    /// and a stop at once: SET_VRING_ENABLE 0 then GET_VRING_BASE, as QEMU
    /// stops a ring): stop set, wake empty, no kick. The thread must stop,
    /// not sleep; it slept for good before, and GET_VRING_BASE was never
    /// answered (QEMU hung at the guest's power-off).
    #[test]
    fn a_stop_whose_wake_a_look_consumed_is_still_seen() {
        // SAFETY: a new eventfd, owned by the File from here on.
        let kick = unsafe { File::from_raw_fd(libc::eventfd(0, libc::EFD_NONBLOCK)) };
        let wake = Arc::new(EventFd::new(libc::EFD_NONBLOCK).unwrap());
        let stop = Arc::new(AtomicBool::new(true));
        let mut fds = Fds { kick, wake, stop, ring: 0 };
        let (tx, rx) = std::sync::mpsc::channel();
        let t = std::thread::spawn(move || tx.send(matches!(fds.wait(), Woke::Stop)).unwrap());
        assert_eq!(rx.recv_timeout(Duration::from_secs(5)), Ok(true), "the thread slept through its stop");
        t.join().unwrap();
    }
}
