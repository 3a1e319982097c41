//! The vhost-user ring session of [`VhostUserBlk`]: set up at DRIVER_OK,
//! stopped at reset, and the relay of backend calls that have no irqfd.

use super::frontend::VhostUserBlk;
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

/// What a DRIVER_OK set up in the backend, until the next reset.
pub struct Session {
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

/// A thread that waits on the call eventfd and raises the queue's interrupt.
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
    /// DRIVER_OK: the driver's features, guest RAM, the ring, kick and call.
    pub(super) fn start(&mut self, t: &mut Transport) -> Result<()> {
        let ctx = t.ctx.clone().ok_or_else(|| Error::protocol("DRIVER_OK before the device was attached"))?;
        let kick = self.kick.clone().ok_or_else(|| Error::protocol("no kick eventfd"))?;
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

        // The ring, in this process's addresses (the backend maps them through the table).
        let q = &t.queue;
        let hva = |gpa: u64, what: &str| {
            mem.mapped()
                .get_host_address(GuestAddress(gpa))
                .map(|p| p as u64)
                .map_err(|e| Error::protocol(format!("queue 0 {what} {gpa:#x}: {e}")))
        };
        let ring = VringConfigData {
            queue_max_size: q.num,
            queue_size: q.num,
            flags: 0,
            desc_table_addr: hva(q.desc, "descriptor table")?,
            used_ring_addr: hva(q.used, "used ring")?,
            avail_ring_addr: hva(q.avail, "available ring")?,
            log_addr: None,
        };
        let num = q.num;
        self.msg("SET_VRING_NUM", |fe| fe.set_vring_num(0, num))?;
        self.msg("SET_VRING_ADDR", |fe| fe.set_vring_addr(0, &ring))?;
        self.msg("SET_VRING_BASE", |fe| fe.set_vring_base(0, 0))?;
        // The call fd before the kick: a backend never runs the ring without one.
        let session = self.call(t, &ctx)?;
        self.msg("SET_VRING_KICK", |fe| fe.set_vring_kick(0, &kick))?;
        self.msg("SET_VRING_ENABLE", |fe| fe.set_vring_enable(0, true))?;
        self.session = Some(session);
        self.st.activations += 1;
        // Anything the driver made available before DRIVER_OK is looked at now.
        let _ = kick.write(1);
        Ok(())
    }

    /// Reset: SET_VRING_ENABLE(0), then GET_VRING_BASE stops the ring (and
    /// is the one request whose reply shows the backend took all before
    /// it), as QEMU's vhost_dev_stop does; the session's fds go.
    pub(super) fn stop(&mut self) -> Result<()> {
        let Some(session) = self.session.take() else { return Ok(()) };
        let r = self
            .msg("SET_VRING_ENABLE", |fe| fe.set_vring_enable(0, false))
            .and_then(|()| self.msg("GET_VRING_BASE", |fe| fe.get_vring_base(0)).map(drop));
        drop(session);
        r
    }

    /// Gives the backend a call fd (SET_VRING_CALL): the queue vector's
    /// irqfd if MSI-X is on and routes one, else an eventfd the VMM relays.
    fn call(&mut self, t: &Transport, ctx: &DeviceContext) -> Result<Session> {
        let irqfd =
            (t.msix_enabled() && t.queue_vector != NO_VECTOR).then(|| ctx.irq.msix_eventfd(t.queue_vector)).flatten();
        let (to, call, relay) = match irqfd {
            Some(fd) => (CallTo::Irqfd(t.queue_vector), fd, None),
            None => {
                let fd = EventFd::new(libc::EFD_NONBLOCK).map_err(|e| Error::io("call eventfd", e))?;
                let relay = spawn_relay(&fd, self.me.clone(), self.relays.clone())?;
                (CallTo::Relay, fd, Some(relay))
            }
        };
        self.msg("SET_VRING_CALL", |fe| fe.set_vring_call(0, &call))?;
        if to != CallTo::Relay {
            self.st.call_irqfd += 1;
        }
        Ok(Session { to, _call: call, _relay: relay })
    }

    /// After DRIVER_OK the driver changed the queue's vector or MSI-X (or
    /// routed a vector): if the calls should now go elsewhere, a new
    /// SET_VRING_CALL. The backend kept the old fd until then, so one
    /// interrupt is raised (spurious at worst) for a call it made there.
    pub(super) fn interrupt_changed(&mut self, t: &mut Transport) -> Result<()> {
        let (Some(was), Some(ctx)) = (self.session.as_ref().map(|s| s.to), t.ctx.clone()) else { return Ok(()) };
        let routed = t.msix_enabled() && t.queue_vector != NO_VECTOR;
        let same = match was {
            CallTo::Irqfd(v) => routed && v == t.queue_vector,
            CallTo::Relay => !routed || ctx.irq.msix_eventfd(t.queue_vector).is_none(),
        };
        if same {
            return Ok(());
        }
        // The old session goes either way: replaced, or the backend failed
        // (and a reset then sends nothing to it).
        self.session = None;
        let session = self.call(t, &ctx)?;
        log::debug!("{}: call fd {was:?} -> {:?}", self.name, session.to);
        self.session = Some(session);
        self.st.call_changes += 1;
        let v = t.queue_vector;
        t.interrupt(v, 1);
        Ok(())
    }
}

/// Starts the relay thread for `call`.
fn spawn_relay(call: &EventFd, dev: Weak<Mutex<State<VhostUserBlk>>>, live: Arc<AtomicUsize>) -> Result<Relay> {
    let fd = call.try_clone().map_err(|e| Error::io("call eventfd", e))?;
    let wake = Arc::new(EventFd::new(libc::EFD_NONBLOCK).map_err(|e| Error::io("eventfd", e))?);
    let stop = Arc::new(AtomicBool::new(false));
    let (w, s) = (wake.clone(), stop.clone());
    live.fetch_add(1, Ordering::AcqRel);
    let l = live.clone();
    let spawned = std::thread::Builder::new().name("vhost-user-call".into()).spawn(move || {
        relay_loop(&fd, &w, &s, &dev);
        l.fetch_sub(1, Ordering::AcqRel);
    });
    if let Err(e) = spawned {
        live.fetch_sub(1, Ordering::AcqRel);
        return Err(Error::io("vhost-user call thread", e));
    }
    Ok(Relay { stop, wake })
}

fn relay_loop(call: &EventFd, wake: &EventFd, stop: &AtomicBool, dev: &Weak<Mutex<State<VhostUserBlk>>>) {
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
            let v = s.t.queue_vector;
            s.t.interrupt(v, 1);
        }
    }
}
