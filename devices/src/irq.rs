//! Interrupt lines as eventfds, for KVM irqfd.
//!
//! INTx is a pair: `trigger`, which KVM turns into a level-triggered GSI
//! assertion (irqfd), and `resample`, which KVM signals when the guest's EOI
//! de-asserts the line; a device whose level is still high asserts again.
//! INTx is automasked, as kernel VFIO's: an assertion signals the trigger
//! and masks the line; it stays masked (further assertions wait, a device
//! reset included) until the host unmasks it, by the resample eventfd (the
//! guest's EOI) or by value (vfio-user SET_IRQS ACTION_UNMASK); unmasking a
//! line that is still high signals again and keeps it masked.
//! MSI-X is one eventfd per vector, each a KVM irqfd on its own MSI route.
//! The same [`IrqLines`] serves a device in the VMM (fds registered with KVM
//! right there) and in a device process (fds received over the socket): the
//! interrupt never passes through the VMM's userspace.
//!
//! A client that gives MSI-X eventfds (vfio-user SET_IRQS) keeps the MSI-X
//! table itself, as QEMU does: from then on the lines report the table as
//! the host's ([`Interrupts::msix_host_owned`]), and a vector raised before
//! its eventfd arrives is held here and signalled when it does.

use crate::Interrupts;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::thread::JoinHandle;
use std::time::Duration;
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

struct Intx {
    trigger: EventFd,
    /// None: the host has no resampling irqfd and unmasks by value (a
    /// vfio-user client that gave a trigger eventfd only).
    resample: Option<EventFd>,
}

/// The one thread that waits on the current resample eventfd. `wake` makes
/// it look again at what INTx is connected to; `stop` (then `wake`) ends it.
struct Resampler {
    wake: EventFd,
    stop: Arc<AtomicBool>,
    thread: JoinHandle<()>,
}

impl Resampler {
    /// Ends the thread and waits for it (unless this is that thread: the
    /// last reference to the lines may be dropped there).
    fn end(self) {
        self.stop.store(true, Ordering::Release);
        let _ = self.wake.write(1);
        if self.thread.thread().id() != std::thread::current().id() {
            let _ = self.thread.join();
        }
    }
}

/// INTx as connected, and the resample thread serving it.
#[derive(Default)]
struct IntxState {
    line: Option<Arc<Intx>>,
    resampler: Option<Resampler>,
    /// The device's level.
    level: bool,
    /// Masked: by the host (ACTION_MASK), or automasked by an assertion.
    masked: bool,
}

impl IntxState {
    /// Signals the trigger (if connected) and masks the line.
    fn assert(&mut self, signalled: &AtomicU64) {
        self.masked = true;
        if let Some(i) = &self.line {
            if i.trigger.write(1).is_ok() {
                signalled.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    /// The host's unmask: a line still high asserts again (and stays
    /// masked); a low one is unmasked.
    fn unmask(&mut self, signalled: &AtomicU64) {
        if self.level {
            self.assert(signalled);
        } else {
            self.masked = false;
        }
    }
}

/// MSI-X as a client set it up.
#[derive(Default)]
struct Msix {
    fds: Vec<Option<EventFd>>,
    /// Vectors raised while they had no eventfd (host-owned table only).
    pending: Vec<bool>,
    /// The client gave at least one eventfd since MSI-X was last cleared.
    host_owned: bool,
}

#[derive(Default)]
pub struct IrqLines {
    /// INTx: its fds, level and mask, under one lock (an unmask and an
    /// assertion that race see each other).
    intx: Mutex<IntxState>,
    msix: Mutex<Msix>,
    /// Interrupts signalled (INTx assertions and MSI-X messages).
    pub signalled: AtomicU64,
}

impl IrqLines {
    pub fn new() -> Arc<Self> {
        Arc::new(IrqLines::default())
    }

    /// Connects INTx. With a `resample` eventfd one thread per `IrqLines`
    /// waits on it and re-asserts while the device's level stays high:
    /// started on first need, switched to the new fd by later calls (a
    /// client repeating SET_IRQS or SET_IRQFD starts no thread), ended by
    /// [`clear_intx`](Self::clear_intx), a connection without resample, or
    /// the drop of the lines. Without one the host unmasks by value
    /// ([`mask_intx`](Self::mask_intx)), which re-asserts.
    pub fn connect_intx(self: &Arc<Self>, trigger: EventFd, resample: Option<EventFd>) {
        let has_resample = resample.is_some();
        let mut g = crate::lock(&self.intx);
        g.line = Some(Arc::new(Intx { trigger, resample }));
        if !has_resample {
            let r = g.resampler.take();
            drop(g);
            if let Some(r) = r {
                r.end();
            }
            return;
        }
        if let Some(r) = g.resampler.as_ref().filter(|r| !r.thread.is_finished()) {
            // The thread waits on the new fd from its next look.
            let _ = r.wake.write(1);
            return;
        }
        if let Some(dead) = g.resampler.take() {
            dead.end(); // over already (it panicked): joined at once
        }
        match self.start_resampler() {
            Ok(r) => g.resampler = Some(r),
            Err(e) => log::error!("cannot start the INTx resample thread: {e}"),
        }
    }

    fn start_resampler(self: &Arc<Self>) -> std::io::Result<Resampler> {
        let wake = EventFd::new(EFD_NONBLOCK)?;
        let stop = Arc::new(AtomicBool::new(false));
        let (w, s, lines) = (wake.try_clone()?, stop.clone(), Arc::downgrade(self));
        let thread =
            std::thread::Builder::new().name("intx-resample".into()).spawn(move || resample_loop(lines, w, s))?;
        Ok(Resampler { wake, stop, thread })
    }

    /// Masks INTx (the host's ACTION_MASK): assertions wait for the unmask.
    pub fn mask_intx(&self) {
        crate::lock(&self.intx).masked = true;
    }

    /// Unmasks INTx (the host's ACTION_UNMASK, or its resample eventfd): a
    /// line that is still high asserts again and stays masked.
    pub fn unmask_intx(&self) {
        crate::lock(&self.intx).unmask(&self.signalled);
    }

    /// True while INTx is masked (by the host, or automasked).
    pub fn intx_masked(&self) -> bool {
        crate::lock(&self.intx).masked
    }

    /// Disconnects INTx and unmasks it (the next connection starts
    /// unmasked, as kernel VFIO's INTx enable); its resample thread ends
    /// before this returns.
    pub fn clear_intx(&self) {
        let r = {
            let mut g = crate::lock(&self.intx);
            g.masked = false;
            g.line = None;
            g.resampler.take()
        };
        if let Some(r) = r {
            r.end();
        }
    }

    /// Copies of the INTx (trigger, resample) fds, to hand to another process.
    pub fn intx_fds(&self) -> Option<(EventFd, EventFd)> {
        let g = crate::lock(&self.intx);
        let i = g.line.as_ref()?;
        Some((i.trigger.try_clone().ok()?, i.resample.as_ref()?.try_clone().ok()?))
    }

    /// Sets (Some) or clears (None) the eventfds of vectors `start..`. The
    /// first eventfd makes the table the client's; a vector held while it
    /// had none is signalled now.
    pub fn set_msix(&self, start: usize, fds: Vec<Option<EventFd>>) {
        let mut m = crate::lock(&self.msix);
        let end = start + fds.len();
        if m.fds.len() < end {
            m.fds.resize_with(end, || None);
        }
        for (i, fd) in fds.into_iter().enumerate() {
            let v = start + i;
            m.host_owned |= fd.is_some();
            if let Some(fd) = &fd {
                if m.pending.get(v).copied().unwrap_or(false) {
                    m.pending[v] = false;
                    if fd.write(1).is_ok() {
                        self.signalled.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
            m.fds[v] = fd;
        }
    }

    /// Drops every MSI-X eventfd and held vector: the table is the device's again.
    pub fn clear_msix(&self) {
        *crate::lock(&self.msix) = Msix::default();
    }
}

impl Drop for IrqLines {
    fn drop(&mut self) {
        let r = self.intx.get_mut().unwrap_or_else(|e| e.into_inner()).resampler.take();
        if let Some(r) = r {
            r.end();
        }
    }
}

/// The resample thread: waits on `wake` and the current resample eventfd,
/// and unmasks INTx when the guest's EOI comes (a line still high asserts
/// again). A resample fd that hangs up or fails (not an eventfd:
/// a peer's pipe) is no longer waited on, with a log line, until INTx is
/// connected again.
fn resample_loop(lines: Weak<IrqLines>, wake: EventFd, stop: Arc<AtomicBool>) {
    crate::sandbox::enter(crate::sandbox::Role::Irq);
    let mut broken: Option<Arc<Intx>> = None;
    while !stop.load(Ordering::Acquire) {
        let Some(l) = lines.upgrade() else { return };
        let current = crate::lock(&l.intx).line.clone();
        drop(l);
        let Some(intx) = current else { return };
        if broken.as_ref().is_some_and(|b| !Arc::ptr_eq(b, &intx)) {
            broken = None; // connected again
        }
        let resample = intx.resample.as_ref().filter(|_| !broken.as_ref().is_some_and(|b| Arc::ptr_eq(b, &intx)));
        let mut p = [
            libc::pollfd { fd: wake.as_raw_fd(), events: libc::POLLIN, revents: 0 },
            libc::pollfd { fd: resample.map_or(-1, |r| r.as_raw_fd()), events: libc::POLLIN, revents: 0 },
        ];
        // SAFETY: two valid pollfds on the stack (a negative fd is skipped);
        // both fds stay open while `wake` and `intx` are held.
        if unsafe { libc::poll(p.as_mut_ptr(), 2, -1) } < 0 {
            continue; // EINTR
        }
        if p[0].revents != 0 {
            let _ = wake.read();
            continue; // look again at what INTx is connected to
        }
        let Some(resample) = resample.filter(|_| p[1].revents != 0) else { continue };
        let failed = match resample.read() {
            Err(e) => e.kind() != std::io::ErrorKind::WouldBlock,
            Ok(_) => false,
        };
        if failed || p[1].revents & (libc::POLLERR | libc::POLLHUP | libc::POLLNVAL) != 0 {
            log::warn!("the INTx resample fd hung up or is not an eventfd; no longer waited on");
            broken = Some(intx);
            continue;
        }
        let Some(lines) = lines.upgrade() else { return };
        let mut g = crate::lock(&lines.intx);
        // Only the resample fd of the line connected now unmasks it.
        if g.line.as_ref().is_some_and(|l| Arc::ptr_eq(l, &intx)) {
            g.unmask(&lines.signalled);
        }
    }
}

fn poll_in(fd: &EventFd, timeout_ms: i32) -> bool {
    let mut p = libc::pollfd { fd: fd.as_raw_fd(), events: libc::POLLIN, revents: 0 };
    // SAFETY: one valid pollfd on the stack.
    unsafe { libc::poll(&mut p, 1, timeout_ms) > 0 }
}

impl Interrupts for IrqLines {
    fn set_intx(&self, level: bool) {
        let mut g = crate::lock(&self.intx);
        let rising = level && !g.level;
        g.level = level;
        // Automasked: asserted, the line waits for the host's unmask.
        if rising && !g.masked && g.line.is_some() {
            g.assert(&self.signalled);
        }
    }

    fn signal_msix(&self, vector: u16) -> bool {
        let mut m = crate::lock(&self.msix);
        let v = vector as usize;
        if let Some(Some(fd)) = m.fds.get(v) {
            let ok = fd.write(1).is_ok();
            self.signalled.fetch_add(ok as u64, Ordering::Relaxed);
            return ok;
        }
        // Held for the client's table (bounded by the vectors a function can have).
        if m.host_owned && v < crate::pci::MSIX_MAX_VECTORS {
            if m.pending.len() <= v {
                m.pending.resize(v + 1, false);
            }
            m.pending[v] = true;
        }
        false
    }

    fn msix_host_owned(&self) -> bool {
        crate::lock(&self.msix).host_owned
    }

    fn intx_eventfds(&self) -> Option<(EventFd, EventFd)> {
        self.intx_fds()
    }
}

/// An eventfd received from a peer, made non-blocking. Something that is not
/// an eventfd fails on first use, which disables the line it was meant for.
pub fn eventfd_from(f: std::fs::File) -> EventFd {
    // Non-blocking: a peer that hands over something that is not an eventfd
    // (a full pipe) must not block the device thread that signals it.
    // SAFETY: fcntl on an fd we own.
    unsafe {
        let fl = libc::fcntl(f.as_raw_fd(), libc::F_GETFL);
        if fl >= 0 {
            libc::fcntl(f.as_raw_fd(), libc::F_SETFL, fl | libc::O_NONBLOCK);
        }
    }
    // SAFETY: the fd is owned by `f` and handed over; a non-eventfd fails
    // on first use, which disables the line it was meant for.
    unsafe { <EventFd as std::os::fd::FromRawFd>::from_raw_fd(std::os::fd::IntoRawFd::into_raw_fd(f)) }
}

/// Waits up to `timeout` for an eventfd to be readable (tests and tools).
pub fn wait_readable(fd: &EventFd, timeout: Duration) -> bool {
    poll_in(fd, timeout.as_millis().min(i32::MAX as u128) as i32)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::FromRawFd;

    #[test]
    fn intx_asserts_on_the_rising_edge_and_again_after_resample_while_high() {
        let lines = IrqLines::new();
        let trig = EventFd::new(EFD_NONBLOCK).unwrap();
        let res = EventFd::new(EFD_NONBLOCK).unwrap();
        lines.connect_intx(trig.try_clone().unwrap(), Some(res.try_clone().unwrap()));
        Interrupts::set_intx(&*lines, true);
        Interrupts::set_intx(&*lines, true); // still high: no second edge
        assert_eq!(trig.read().unwrap(), 1);
        res.write(1).unwrap(); // the guest EOI'd while the level is high
        assert!(wait_readable(&trig, Duration::from_secs(2)));
        assert_eq!(trig.read().unwrap(), 1);
        Interrupts::set_intx(&*lines, false);
        res.write(1).unwrap();
        assert!(!wait_readable(&trig, Duration::from_millis(300)), "low level: no re-assert");
        lines.clear_intx();
    }

    #[test]
    fn reconnecting_intx_moves_the_one_resample_thread_to_the_new_fds() {
        let lines = IrqLines::new();
        let trig = EventFd::new(EFD_NONBLOCK).unwrap();
        let old: Vec<EventFd> = (0..50).map(|_| EventFd::new(EFD_NONBLOCK).unwrap()).collect();
        for r in &old {
            lines.connect_intx(trig.try_clone().unwrap(), Some(r.try_clone().unwrap()));
        }
        let res = EventFd::new(EFD_NONBLOCK).unwrap();
        lines.connect_intx(trig.try_clone().unwrap(), Some(res.try_clone().unwrap()));
        Interrupts::set_intx(&*lines, true);
        assert_eq!(trig.read().unwrap(), 1);
        old[0].write(1).unwrap(); // a replaced resample fd does nothing
        assert!(!wait_readable(&trig, Duration::from_millis(300)));
        res.write(1).unwrap();
        assert!(wait_readable(&trig, Duration::from_secs(2)), "the current resample fd re-asserts");
        assert_eq!(trig.read().unwrap(), 1);
        // A pipe given as the resample fd that hangs up is dropped, not spun on.
        let mut p = [0i32; 2];
        // SAFETY: pipe2 fills two fds, owned just below.
        assert_eq!(unsafe { libc::pipe2(p.as_mut_ptr(), libc::O_NONBLOCK) }, 0);
        // SAFETY: fresh fds nothing else owns.
        let (r, w) = unsafe { (std::fs::File::from_raw_fd(p[0]), std::fs::File::from_raw_fd(p[1])) };
        lines.connect_intx(trig.try_clone().unwrap(), Some(eventfd_from(r)));
        drop(w);
        std::thread::sleep(Duration::from_millis(50)); // the thread sees the hang-up
        lines.connect_intx(trig.try_clone().unwrap(), Some(res.try_clone().unwrap()));
        res.write(1).unwrap();
        assert!(wait_readable(&trig, Duration::from_secs(2)), "a hung-up fd did not stop the thread");
        assert_eq!(trig.read().unwrap(), 1);
        lines.clear_intx();
        res.write(1).unwrap();
        assert!(!wait_readable(&trig, Duration::from_millis(300)), "cleared: no re-assert");
    }

    #[test]
    fn a_masked_intx_asserts_when_unmasked_if_still_high() {
        let lines = IrqLines::new();
        let trig = EventFd::new(EFD_NONBLOCK).unwrap();
        lines.connect_intx(trig.try_clone().unwrap(), None);
        lines.mask_intx();
        Interrupts::set_intx(&*lines, true);
        assert!(trig.read().is_err(), "masked: nothing asserted");
        lines.unmask_intx();
        assert_eq!(trig.read().unwrap(), 1, "unmasked while high: asserted");
        lines.clear_intx();
    }

    #[test]
    fn msix_vectors_signal_their_own_eventfd() {
        let lines = IrqLines::new();
        let a = EventFd::new(EFD_NONBLOCK).unwrap();
        lines.set_msix(2, vec![Some(a.try_clone().unwrap())]);
        assert!(!lines.signal_msix(0));
        assert!(!lines.signal_msix(9));
        assert!(lines.signal_msix(2));
        assert_eq!(a.read().unwrap(), 1);
    }

    #[test]
    fn the_table_is_the_clients_once_it_gives_eventfds_and_held_vectors_fire_when_theirs_arrives() {
        let lines = IrqLines::new();
        assert!(!lines.msix_host_owned(), "no eventfd: the device's table");
        assert!(!lines.signal_msix(3));
        lines.set_msix(0, vec![None, None]);
        assert!(!lines.msix_host_owned(), "de-assigning gives nothing");
        let a = EventFd::new(EFD_NONBLOCK).unwrap();
        lines.set_msix(1, vec![Some(a.try_clone().unwrap())]);
        assert!(lines.msix_host_owned());
        // Vector 3 raised twice with no eventfd: held once, fired when it gets one.
        assert!(!lines.signal_msix(3) && !lines.signal_msix(3));
        assert!(!lines.signal_msix(u16::MAX), "any vector number is safe");
        let b = EventFd::new(EFD_NONBLOCK).unwrap();
        lines.set_msix(3, vec![Some(b.try_clone().unwrap())]);
        assert_eq!(b.read().unwrap(), 1);
        lines.set_msix(3, vec![Some(b.try_clone().unwrap())]);
        assert!(b.read().is_err(), "fired once");
        assert_eq!(lines.signalled.load(Ordering::Relaxed), 1);
        // Vector 3 de-assigned, raised, then the client leaves: nothing is kept.
        lines.set_msix(3, vec![None]);
        assert!(!lines.signal_msix(3));
        lines.clear_msix();
        assert!(!lines.msix_host_owned(), "cleared: the device's table again");
        lines.set_msix(3, vec![Some(b.try_clone().unwrap())]);
        assert!(b.read().is_err(), "what was held went with the client");
        assert!(lines.signal_msix(3));
        assert_eq!(b.read().unwrap(), 1);
    }
}
