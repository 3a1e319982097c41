//! The vhost-user ring session of [`VhostUserBlk`]: each enabled queue's
//! ring set up at DRIVER_OK and stopped at reset, and the relay of backend
//! calls that have no irqfd.

use super::VhostUserBlk;
use crate::{Error, Result};
use iopath_devices::virtio::transport::{State, Transport, NO_VECTOR};
use iopath_devices::DeviceContext;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};
use vhost::vhost_user::message::VhostUserVirtioFeatures;
use vhost::vhost_user::VhostUserFrontend;
use vhost::{VhostBackend, VhostUserMemoryRegionInfo, VringConfigData};
use vm_memory::{GuestAddress, GuestMemoryBackend};
use vmm_sys_util::eventfd::EventFd;

/// What a DRIVER_OK set up in the backend, until the next reset: the
/// queues it started (those the driver enabled), each with its call.
pub struct Session {
    rings: Vec<(u16, Call)>,
}

impl Session {
    /// Queue `q`'s ring runs in the backend.
    pub(super) fn started(&self, q: u16) -> bool {
        self.rings.iter().any(|(i, _)| *i == q)
    }

    /// The queues whose rings run.
    pub(super) fn queues(&self) -> Vec<u16> {
        self.rings.iter().map(|(i, _)| *i).collect()
    }
}

/// Where one ring's calls go.
pub struct Call {
    /// Where the backend's calls go now.
    to: CallTo,
    /// The call eventfd given to the backend (the irqfd, or the relay's).
    _call: EventFd,
    /// The thread that turns the backend's calls into interrupts, if the
    /// call fd is not an irqfd.
    _relay: Option<Relay>,
}

/// Where the backend's calls go.
#[derive(Clone, Copy, Debug, PartialEq)]
enum CallTo {
    /// The MSI-X vector's irqfd: KVM injects, no VMM thread. A vector the
    /// driver masks keeps its irqfd: the eventfd holds the call until the
    /// vector is routed again (`Interrupts::msix_route`).
    Irqfd(u16),
    /// An eventfd a relay thread turns into INTx or the queue's vector.
    Relay,
}

/// A thread that waits on a call eventfd and raises its queue's interrupt.
/// Dropped (often under the device lock, which the thread takes), it is
/// told to stop and woken, not joined: it ends within one poll.
pub struct Relay {
    stop: Arc<AtomicBool>,
    wake: Arc<EventFd>,
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        let _ = self.wake.write(1);
    }
}

impl VhostUserBlk {
    /// DRIVER_OK: the driver's features, guest RAM, the in-flight region
    /// (if negotiated), then each enabled queue's ring, kick and call.
    /// `replay`: the same for a backend that replaces a dead one
    /// (`reconnect.rs`): the region kept, each ring's base its used index
    /// as the guest sees it.
    pub(super) fn start(&mut self, t: &mut Transport, replay: bool) -> Result<()> {
        let ctx = t.ctx.clone().ok_or_else(|| Error::protocol("DRIVER_OK before the device was attached"))?;
        if self.kicks.len() != t.queues.len() {
            return Err(Error::protocol("no kick eventfds"));
        }
        let mut features = t.driver_features;
        if self.protocol {
            features |= VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits();
        }
        self.msg("SET_FEATURES", |fe| fe.set_features(features))?;

        // Guest RAM: each mapped region's memfd. RAM reached only by
        // messages (a device process's client without fds) cannot be shared.
        let mem = ctx.mem.clone();
        if !mem.remote_ranges().is_empty() {
            return Err(Error::protocol("guest RAM without an fd cannot be shared with a vhost-user backend"));
        }
        let regions = mem
            .mapped()
            .iter()
            .map(VhostUserMemoryRegionInfo::from_guest_region)
            .collect::<std::result::Result<Vec<_>, _>>()
            .map_err(|e| Error::protocol(format!("guest RAM region without an fd: {e}")))?;
        self.msg("SET_MEM_TABLE", |fe| fe.set_mem_table(&regions))?;
        if self.inflight_acked {
            self.set_inflight(t)?;
        }

        // Each enabled queue's ring, in this process's addresses (the
        // backend maps them through the table); the others are not started.
        let hva = |q: usize, gpa: u64, what: &str| {
            mem.mapped()
                .get_host_address(GuestAddress(gpa))
                .map(|p| p as u64)
                .map_err(|e| Error::protocol(format!("queue {q} {what} {gpa:#x}: {e}")))
        };
        let mut rings = Vec::new();
        for (i, vq) in t.queues.iter().enumerate().filter(|(_, vq)| vq.ring.ready) {
            let q = &vq.ring;
            let ring = VringConfigData {
                queue_max_size: q.num,
                queue_size: q.num,
                flags: 0,
                desc_table_addr: hva(i, q.desc, "descriptor table")?,
                used_ring_addr: hva(i, q.used, "used ring")?,
                avail_ring_addr: hva(i, q.avail, "available ring")?,
                log_addr: None,
            };
            // A replayed ring goes on from the used index the guest sees:
            // what the dead backend took and did not complete is in the
            // in-flight region, which the new one resubmits.
            let base = if replay {
                used_idx(&mem, q.used).map_err(|e| Error::protocol(format!("queue {i}: {e}")))?
            } else {
                0
            };
            rings.push((i, q.num, ring, base));
        }
        let mut started = Vec::new();
        for (i, num, ring, base) in rings {
            self.msg("SET_VRING_NUM", |fe| fe.set_vring_num(i, num))?;
            self.msg("SET_VRING_ADDR", |fe| fe.set_vring_addr(i, &ring))?;
            self.msg("SET_VRING_BASE", |fe| fe.set_vring_base(i, base))?;
            // The call fd before the kick: a backend never runs the ring without one.
            let call = self.call(t, &ctx, i as u16)?;
            let kick = self.kicks[i].clone();
            self.msg("SET_VRING_KICK", |fe| fe.set_vring_kick(i, &kick))?;
            self.msg("SET_VRING_ENABLE", |fe| fe.set_vring_enable(i, true))?;
            started.push((i as u16, call));
        }
        // Anything the driver made available before DRIVER_OK (or, replayed,
        // while no backend listened: its kick may have been read by the
        // dead one) is looked at now.
        for (q, _) in &started {
            let _ = self.kicks[*q as usize].write(1);
        }
        self.session = Some(Session { rings: started });
        if !replay {
            self.st.activations += 1;
        }
        Ok(())
    }

    /// Reset: for each started ring SET_VRING_ENABLE(0), then
    /// GET_VRING_BASE stops it (and is the one request whose reply shows
    /// the backend took all before it), as QEMU's vhost_dev_stop does; the
    /// session's fds go. The first failure ends it.
    pub(super) fn stop(&mut self) -> Result<()> {
        // The in-flight region ends with the rings: the next DRIVER_OK gets a new one.
        self.inflight = None;
        let Some(session) = self.session.take() else { return Ok(()) };
        let mut r = Ok(());
        for (q, _) in &session.rings {
            let i = *q as usize;
            r = self
                .msg("SET_VRING_ENABLE", |fe| fe.set_vring_enable(i, false))
                .and_then(|()| self.msg("GET_VRING_BASE", |fe| fe.get_vring_base(i)).map(drop));
            if r.is_err() {
                break;
            }
        }
        drop(session);
        r
    }

    /// Gives the backend queue `q`'s call fd (SET_VRING_CALL): its
    /// vector's irqfd if MSI-X is on and routes one, else an eventfd the
    /// VMM relays.
    fn call(&mut self, t: &Transport, ctx: &DeviceContext, q: u16) -> Result<Call> {
        let vector = t.queues[q as usize].vector;
        let irqfd = (t.msix_enabled() && vector != NO_VECTOR).then(|| ctx.irq.msix_eventfd(vector)).flatten();
        let (to, call, relay) = match irqfd {
            Some(fd) => (CallTo::Irqfd(vector), fd, None),
            None => {
                let fd = EventFd::new(libc::EFD_NONBLOCK).map_err(|e| Error::io("call eventfd", e))?;
                let relay = spawn_relay(&fd, q, self.me.clone(), self.relays.clone())?;
                (CallTo::Relay, fd, Some(relay))
            }
        };
        self.msg("SET_VRING_CALL", |fe| fe.set_vring_call(q as usize, &call))?;
        if to != CallTo::Relay {
            self.st.call_irqfd += 1;
        }
        Ok(Call { to, _call: call, _relay: relay })
    }

    /// After DRIVER_OK the driver changed a queue's vector or MSI-X (or
    /// routed a vector): for each started ring whose calls should now go
    /// elsewhere, a new SET_VRING_CALL. The backend kept the old fd until
    /// then, so one interrupt is raised (spurious at worst) for a call it
    /// made there.
    pub(super) fn interrupt_changed(&mut self, t: &mut Transport) -> Result<()> {
        let Some(ctx) = t.ctx.clone() else { return Ok(()) };
        // The session is out while calls change: if the backend fails, it
        // stays out (and a reset then sends nothing to it).
        let Some(mut session) = self.session.take() else { return Ok(()) };
        for (q, call) in session.rings.iter_mut() {
            let vector = t.queues[*q as usize].vector;
            let routed = t.msix_enabled() && vector != NO_VECTOR;
            let same = match call.to {
                CallTo::Irqfd(v) => routed && v == vector,
                CallTo::Relay => !routed || ctx.irq.msix_eventfd(vector).is_none(),
            };
            if same {
                continue;
            }
            let new = self.call(t, &ctx, *q)?;
            log::debug!("{}: queue {q}: call fd {:?} -> {:?}", self.name, call.to, new.to);
            *call = new;
            self.st.call_changes += 1;
            t.queue_interrupt(*q as usize);
        }
        self.session = Some(session);
        Ok(())
    }
}

/// The used index of the ring whose used ring is at `used` (guest address).
pub(super) fn used_idx(mem: &iopath_devices::GuestMem, used: u64) -> std::result::Result<u16, String> {
    use vm_memory::Bytes;
    let at = used.checked_add(2).ok_or("used ring address overflows")?;
    mem.mapped().read_obj::<u16>(GuestAddress(at)).map(u16::from_le).map_err(|e| format!("used index at {at:#x}: {e}"))
}

/// Starts the relay thread for queue `q`'s `call`.
fn spawn_relay(call: &EventFd, q: u16, dev: Weak<Mutex<State<VhostUserBlk>>>, live: Arc<AtomicUsize>) -> Result<Relay> {
    let fd = call.try_clone().map_err(|e| Error::io("call eventfd", e))?;
    let wake = Arc::new(EventFd::new(libc::EFD_NONBLOCK).map_err(|e| Error::io("eventfd", e))?);
    let stop = Arc::new(AtomicBool::new(false));
    let (w, s) = (wake.clone(), stop.clone());
    live.fetch_add(1, Ordering::AcqRel);
    let l = live.clone();
    let spawned = std::thread::Builder::new().name("vhost-user-call".into()).spawn(move || {
        relay_loop(&fd, q, &w, &s, &dev);
        l.fetch_sub(1, Ordering::AcqRel);
    });
    if let Err(e) = spawned {
        live.fetch_sub(1, Ordering::AcqRel);
        return Err(Error::io("vhost-user call thread", e));
    }
    Ok(Relay { stop, wake })
}

fn relay_loop(call: &EventFd, q: u16, wake: &EventFd, stop: &AtomicBool, dev: &Weak<Mutex<State<VhostUserBlk>>>) {
    let mut fds = [
        libc::pollfd { fd: call.as_raw_fd(), events: libc::POLLIN, revents: 0 },
        libc::pollfd { fd: wake.as_raw_fd(), events: libc::POLLIN, revents: 0 },
    ];
    while !stop.load(Ordering::Acquire) {
        // SAFETY: two valid pollfds; bounded so a stop is seen.
        unsafe { libc::poll(fds.as_mut_ptr(), 2, 1000) };
        if stop.load(Ordering::Acquire) {
            return;
        }
        if call.read().is_ok() {
            let Some(dev) = dev.upgrade() else { return };
            let mut s = iopath_devices::lock(&dev);
            if stop.load(Ordering::Acquire) {
                return; // the session ended while this call waited for the lock
            }
            s.e.st.calls_relayed += 1;
            s.t.queue_interrupt(q as usize);
        }
    }
}
