//! Interrupt lines as eventfds, for KVM irqfd.
//!
//! INTx is a pair: `trigger`, which KVM turns into a level-triggered GSI
//! assertion (irqfd), and `resample`, which KVM signals when the guest's EOI
//! de-asserts the line; a device whose level is still high asserts again.
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
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use vmm_sys_util::eventfd::EventFd;

struct Intx {
    trigger: EventFd,
    /// None: the host has no resampling irqfd and unmasks by value (a
    /// vfio-user client that gave a trigger eventfd only).
    resample: Option<EventFd>,
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
    intx: Mutex<Option<Arc<Intx>>>,
    level: AtomicBool,
    /// INTx masked by the client (vfio-user SET_IRQS ACTION_MASK).
    masked: AtomicBool,
    msix: Mutex<Msix>,
    /// Interrupts signalled (INTx assertions and MSI-X messages).
    pub signalled: AtomicU64,
    generation: AtomicU64,
}

impl IrqLines {
    pub fn new() -> Arc<Self> {
        Arc::new(IrqLines::default())
    }

    /// Connects INTx. With a `resample` eventfd a thread waits on it and
    /// re-asserts while the device's level stays high; it ends when INTx is
    /// replaced or dropped. Without one there is no thread: the host unmasks
    /// by value ([`mask_intx`](Self::mask_intx)), which re-asserts.
    pub fn connect_intx(self: &Arc<Self>, trigger: EventFd, resample: Option<EventFd>) {
        let gen = self.generation.fetch_add(1, Ordering::AcqRel) + 1;
        let has_resample = resample.is_some();
        let intx = Arc::new(Intx { trigger, resample });
        *self.intx.lock().unwrap() = Some(intx.clone());
        if !has_resample {
            return;
        }
        let weak = Arc::downgrade(self);
        let spawned = std::thread::Builder::new().name("intx-resample".into()).spawn(move || {
            crate::sandbox::enter(crate::sandbox::Role::Irq);
            loop {
                let Some(resample) = intx.resample.as_ref() else { return };
                let ready = poll_in(resample, 200);
                let Some(lines) = weak.upgrade() else { return };
                if lines.generation.load(Ordering::Acquire) != gen {
                    return;
                }
                let high = lines.level.load(Ordering::Acquire) && !lines.masked.load(Ordering::Acquire);
                if ready && resample.read().is_ok() && high {
                    let _ = intx.trigger.write(1);
                    lines.signalled.fetch_add(1, Ordering::Relaxed);
                }
            }
        });
        if let Err(e) = spawned {
            log::error!("cannot start the INTx resample thread: {e}");
        }
    }

    /// Masks or unmasks INTx; unmasking re-asserts a line that is still high.
    pub fn mask_intx(&self, mask: bool) {
        let was = self.masked.swap(mask, Ordering::AcqRel);
        if was && !mask && self.level.load(Ordering::Acquire) {
            if let Some(i) = self.intx.lock().unwrap().as_ref() {
                let _ = i.trigger.write(1);
                self.signalled.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    /// Disconnects INTx (its resample thread ends).
    pub fn clear_intx(&self) {
        self.generation.fetch_add(1, Ordering::AcqRel);
        self.masked.store(false, Ordering::Release);
        *self.intx.lock().unwrap() = None;
    }

    /// Copies of the INTx (trigger, resample) fds, to hand to another process.
    pub fn intx_fds(&self) -> Option<(EventFd, EventFd)> {
        let g = self.intx.lock().unwrap();
        let i = g.as_ref()?;
        Some((i.trigger.try_clone().ok()?, i.resample.as_ref()?.try_clone().ok()?))
    }

    /// Sets (Some) or clears (None) the eventfds of vectors `start..`. The
    /// first eventfd makes the table the client's; a vector held while it
    /// had none is signalled now.
    pub fn set_msix(&self, start: usize, fds: Vec<Option<EventFd>>) {
        let mut m = self.msix.lock().unwrap();
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
        *self.msix.lock().unwrap() = Msix::default();
    }
}

fn poll_in(fd: &EventFd, timeout_ms: i32) -> bool {
    use std::os::fd::AsRawFd;
    let mut p = libc::pollfd { fd: fd.as_raw_fd(), events: libc::POLLIN, revents: 0 };
    // SAFETY: one valid pollfd on the stack.
    unsafe { libc::poll(&mut p, 1, timeout_ms) > 0 }
}

impl Interrupts for IrqLines {
    fn set_intx(&self, level: bool) {
        let was = self.level.swap(level, Ordering::AcqRel);
        if level && !was && !self.masked.load(Ordering::Acquire) {
            if let Some(i) = self.intx.lock().unwrap().as_ref() {
                let _ = i.trigger.write(1);
                self.signalled.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    fn signal_msix(&self, vector: u16) -> bool {
        let mut m = self.msix.lock().unwrap();
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
        self.msix.lock().unwrap().host_owned
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
    use std::os::fd::AsRawFd;
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
    use vmm_sys_util::eventfd::EFD_NONBLOCK;

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
    fn a_masked_intx_asserts_when_unmasked_if_still_high() {
        let lines = IrqLines::new();
        let trig = EventFd::new(EFD_NONBLOCK).unwrap();
        lines.connect_intx(trig.try_clone().unwrap(), None);
        lines.mask_intx(true);
        Interrupts::set_intx(&*lines, true);
        assert!(trig.read().is_err(), "masked: nothing asserted");
        lines.mask_intx(false);
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
