//! virtio-blk served in the VMM, on the modern PCI transport
//! ([`transport`](super::transport)): vendor 0x1af4, device 0x1042, one
//! request queue. [`BlkEngine`] is its queue engine.
//!
//! Notifications arrive as `notify` says: `exit` (a write to the notify
//! area exits, and the queue is served on the vCPU thread in
//! `bar_write`) or `ioeventfd` (the notify
//! address is a KVM ioeventfd; the `virtio-blk` thread wakes and serves the
//! queue) or `poll` (that thread polls the ring, see
//! [`worker`](super::worker)). A driver that breaks the ring puts the
//! device in DEVICE_NEEDS_RESET until it resets it.
//!
//! A `file:PATH` disk is read and written synchronously (pread, pwrite,
//! fdatasync) on the thread that serves the queue. Not yet: io_uring with
//! O_DIRECT and several requests in flight (NVMe's `FileBackend` slots), more queues.

use super::blk::{self, Blk};
use super::transport::{DeviceConfigBytes, QueueEngine, Shared, State, Transport, VirtioPci};
use crate::nvme::backend::{Backend, BackendKind};
use crate::{Counter, DeviceContext, Error, IoEventSpec, Result};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use vmm_sys_util::eventfd::EventFd;

pub const VENDOR: u16 = 0x1af4;
pub const DEVICE: u16 = 0x1042;
/// Feature bits (6, 5.2.3).
pub const F_SEG_MAX: u64 = 1 << 2;
pub const F_BLK_SIZE: u64 = 1 << 6;
pub const F_FLUSH: u64 = 1 << 9;
pub const F_DISCARD: u64 = 1 << 13;
pub const F_WRITE_ZEROES: u64 = 1 << 14;
pub const F_INDIRECT_DESC: u64 = 1 << 28;
pub use super::transport::{F_EVENT_IDX, F_VERSION_1};
/// What the device offers.
pub const FEATURES: u64 =
    F_SEG_MAX | F_BLK_SIZE | F_FLUSH | F_DISCARD | F_WRITE_ZEROES | F_INDIRECT_DESC | F_EVENT_IDX | F_VERSION_1;
pub use super::transport::{
    BAR_SIZE, COMMON, COMMON_LEN, DEVCFG, DEVCFG_LEN, ISR, MSIX_PBA, MSIX_TABLE, MSIX_VECTORS, NOTIFY, NOTIFY_MULT,
    NO_VECTOR, S_ACKNOWLEDGE, S_DRIVER, S_DRIVER_OK, S_FAILED, S_FEATURES_OK, S_NEEDS_RESET,
};
/// Segments per request the device advertises (seg_max).
pub const SEG_MAX: u32 = 128;

/// How queue notifications reach the device.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum NotifyMode {
    /// The notify write exits to the VMM, which serves the queue on the vCPU thread.
    #[default]
    Exit,
    /// The notify address is a KVM ioeventfd; a device thread serves the queue.
    Ioeventfd,
    /// A device thread polls the available ring with notifications
    /// suppressed; idle for [`POLL_IDLE`](super::worker::POLL_IDLE), it
    /// re-enables them and sleeps on the ioeventfd.
    Poll,
}

impl std::str::FromStr for NotifyMode {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "exit" => Ok(NotifyMode::Exit),
            "ioeventfd" => Ok(NotifyMode::Ioeventfd),
            "poll" => Ok(NotifyMode::Poll),
            _ => Err(Error::Option {
                device: "virtio-blk",
                option: "notify".into(),
                reason: format!("{s:?} (exit, ioeventfd, poll)"),
            }),
        }
    }
}

impl std::fmt::Display for NotifyMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            NotifyMode::Exit => "exit",
            NotifyMode::Ioeventfd => "ioeventfd",
            NotifyMode::Poll => "poll",
        })
    }
}

/// Options of `--device virtio-blk[,backend=null|ram|file:PATH][,size_mb=N][,notify=exit|ioeventfd|poll]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VirtioBlkConfig {
    pub backend: BackendKind,
    /// Disk size in bytes.
    pub size: u64,
    pub notify: NotifyMode,
}

impl Default for VirtioBlkConfig {
    fn default() -> Self {
        VirtioBlkConfig { backend: BackendKind::Ram, size: 64 << 20, notify: NotifyMode::Exit }
    }
}

/// The in-VMM engine's counters (the transport keeps notifies, interrupts,
/// ring_errors and resets).
#[derive(Default)]
pub(super) struct Stats {
    pub(super) kicks: u64,
    /// Times the poller went to sleep on the ioeventfd.
    pub(super) sleeps: u64,
    requests: u64,
    errors: u64,
}

/// The queue engine of iopath's own virtio-blk: requests served in the
/// VMM on the vCPU thread (notify=exit) or the `virtio-blk` thread.
pub struct BlkEngine {
    cfg: VirtioBlkConfig,
    blk: Blk,
    pub(super) st: Stats,
    /// A poller serves the queue: serve() leaves notifications suppressed.
    pub(super) polling: bool,
    thread: Option<Worker>,
    /// The notify eventfd, made and registered at the first attach and kept:
    /// a device process's host announces it once (GET_REGION_IO_FDS) and
    /// its next clients get that same fd, so a later session must be woken
    /// through it, not through a new one nobody writes.
    kick: Option<Arc<EventFd>>,
}

/// The virtio-blk PCI function served in the VMM.
pub type VirtioBlk = VirtioPci<BlkEngine>;

struct Worker {
    kick: Arc<EventFd>,
    stop: Arc<AtomicBool>,
    handle: std::thread::JoinHandle<()>,
}

impl VirtioPci<BlkEngine> {
    pub fn new(cfg: VirtioBlkConfig) -> Result<Self> {
        if cfg.size == 0 || !cfg.size.is_multiple_of(blk::SECTOR) {
            return Err(Error::Option { device: "virtio-blk", option: "size_mb".into(), reason: "empty disk".into() });
        }
        let backend = Backend::open(&cfg.backend, cfg.size)?;
        let blk = Blk::new(backend, cfg.size, "iopath-virtio-blk");
        let e = BlkEngine { cfg, blk, st: Stats::default(), polling: false, thread: None, kick: None };
        Ok(VirtioPci::with_engine(e))
    }
}

/// Registers the notify ioeventfd and starts the thread that serves it.
fn start_thread(dev: &Shared<BlkEngine>, ctx: &DeviceContext) {
    let mut s = crate::lock(dev);
    if s.e.thread.is_some() {
        return;
    }
    let spec = IoEventSpec { bar: 0, offset: NOTIFY, len: 0, datamatch: None };
    let kick = match s.e.kick.clone() {
        Some(k) => k, // registered at an earlier attach: still the one the host knows
        None => {
            let kick = match EventFd::new(libc::EFD_NONBLOCK) {
                Ok(e) => Arc::new(e),
                Err(e) => return log::warn!("virtio-blk: eventfd: {e}; notifications will exit"),
            };
            if let Err(e) = ctx.ioevents.register(spec, &kick) {
                return log::warn!("virtio-blk: no ioeventfd ({e}); notifications will exit");
            }
            s.e.kick = Some(kick.clone());
            kick
        }
    };
    let stop = Arc::new(AtomicBool::new(false));
    let (k, st, state) = (kick.clone(), stop.clone(), dev.clone());
    let poll = s.e.cfg.notify == NotifyMode::Poll;
    let handle = std::thread::Builder::new().name("virtio-blk".into()).spawn(move || {
        crate::sandbox::enter(crate::sandbox::Role::Device);
        if poll {
            super::worker::poll_loop(&state, &k, &st)
        } else {
            super::worker::kick_loop(&state, &k, &st)
        }
    });
    match handle {
        Ok(handle) => s.e.thread = Some(Worker { kick, stop, handle }),
        Err(e) => {
            let _ = ctx.ioevents.unregister(spec, &kick);
            s.e.kick = None;
            log::warn!("virtio-blk: thread: {e}; notifications will exit");
        }
    }
}

impl QueueEngine for BlkEngine {
    fn name(&self) -> String {
        "virtio-blk".into()
    }

    fn device_id(&self) -> u16 {
        DEVICE
    }

    fn features(&self) -> u64 {
        FEATURES
    }

    fn device_config(&self) -> DeviceConfigBytes {
        blk::config_space(self.blk.size)
    }

    fn attach(dev: &Shared<Self>, ctx: &DeviceContext) {
        if crate::lock(dev).e.cfg.notify != NotifyMode::Exit {
            start_thread(dev, ctx);
        }
    }

    fn quiesce(dev: &Shared<Self>) {
        let w = crate::lock(dev).e.thread.take();
        if let Some(w) = w {
            w.stop.store(true, Ordering::Release);
            let _ = w.kick.write(1);
            let _ = w.handle.join();
        }
    }

    fn notify(&mut self, t: &mut Transport, value: u64) {
        // The vCPU that wrote is waiting here: nothing else adds to the ring.
        if value == 0 {
            while serve(t, self) {}
        }
    }

    fn counters(&self) -> Vec<Counter> {
        let st = &self.st;
        [("kicks", st.kicks), ("sleeps", st.sleeps), ("requests", st.requests), ("errors", st.errors)]
            .into_iter()
            .map(|(n, value)| Counter { name: n.into(), value })
            .collect()
    }
}

/// Serves available requests, at most a ring's worth, then re-arms
/// notifications. True if it stopped with more to do: the device thread
/// then lets go of the lock before the next pass, so a driver that keeps
/// the queue full cannot hold register accesses off.
pub(super) fn serve(t: &mut Transport, e: &mut BlkEngine) -> bool {
    if !t.live() {
        return false;
    }
    let Some(mem) = t.ctx.as_ref().map(|c| c.mem.clone()) else { return false };
    let mut irq = false;
    let mut more = false;
    for _ in 0..=t.queue.num {
        more = true;
        match t.queue.pop(&mem) {
            Ok(Some(c)) => {
                let done = e.blk.handle(&mem, &c.descs);
                e.st.requests += 1;
                if done.status != Some(blk::S_OK) {
                    e.st.errors += 1;
                }
                match t.queue.push_used(&mem, c.head, done.written) {
                    Ok(i) => irq |= i,
                    Err(err) => {
                        t.broken(&format!("used ring: {err}"));
                        return false;
                    }
                }
            }
            Ok(None) => match t.queue.set_notify(&mem, !e.polling) {
                Ok(a) if a != t.queue.next_avail() => continue, // raced in
                Ok(_) => {
                    more = false;
                    break;
                }
                Err(err) => {
                    t.broken(&format!("used ring: {err}"));
                    return false;
                }
            },
            Err(err) => {
                t.broken(&format!("queue 0: {err}"));
                return false;
            }
        }
    }
    if irq {
        t.interrupt(t.queue_vector, 1);
    }
    more
}

impl State<BlkEngine> {
    /// See [`serve`].
    pub(super) fn serve(&mut self) -> bool {
        serve(&mut self.t, &mut self.e)
    }

    /// True if the queue is live and the driver has made chains available
    /// the device has not taken.
    pub(super) fn has_work(&self) -> bool {
        let t = &self.t;
        t.live() && t.ctx.as_ref().is_some_and(|c| t.queue.has_work(&c.mem).unwrap_or(true))
    }

    /// Sets whether a poller serves the queue, and asks the driver for
    /// notifications accordingly. True if work is already waiting (a
    /// poller about to sleep then polls on).
    pub(super) fn set_polling(&mut self, on: bool) -> bool {
        self.e.polling = on;
        let live = self.t.live();
        match self.t.ctx.as_ref().map(|c| c.mem.clone()) {
            Some(mem) if live => match self.t.queue.set_notify(&mem, !on) {
                Ok(a) => a != self.t.queue.next_avail(),
                Err(e) => {
                    self.t.broken(&format!("used ring: {e}"));
                    false
                }
            },
            _ => false,
        }
    }
}
#[cfg(test)]
#[path = "pci_tests.rs"]
mod tests;
