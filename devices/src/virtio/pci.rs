//! virtio-blk as a virtio 1.x modern PCI function (virtio 1.2, 4.1):
//! vendor 0x1af4, device 0x1042; one 64-bit memory BAR holds the common
//! configuration, ISR, device configuration and notify areas (each named by
//! a vendor capability) and the MSI-X table and PBA (config vector + one
//! per queue). One request queue.
//!
//! Notifications arrive as `notify` says: `exit` (a write to the notify
//! area exits, and the queue is served on the vCPU thread in
//! [`bar_write`](DeviceModel::bar_write)) or `ioeventfd` (the notify
//! address is a KVM ioeventfd; the `virtio-blk` thread wakes and serves the
//! queue) or `poll` (that thread polls the ring, see [`worker`](super::worker)). A driver that breaks the ring puts the device in
//! DEVICE_NEEDS_RESET until it resets it.
//!
//! A `file:PATH` disk is read and written synchronously (pread, pwrite,
//! fdatasync) on the thread that serves the queue. Not yet: io_uring with
//! O_DIRECT and several requests in flight (NVMe's `FileBackend` slots), more queues.

use super::blk::{self, Blk};
use super::queue::{Queue, MAX_QUEUE_SIZE};
use crate::nvme::backend::{Backend, BackendKind};
use crate::pci::{Capability, MsixTable};
use crate::{
    le_value, read_regs, BarKind, BarSpec, Counter, DeviceContext, DeviceModel, Error, IoEventSpec, PciIds, Result,
};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
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
pub const F_EVENT_IDX: u64 = 1 << 29;
pub const F_VERSION_1: u64 = 1 << 32;
/// What the device offers.
pub const FEATURES: u64 =
    F_SEG_MAX | F_BLK_SIZE | F_FLUSH | F_DISCARD | F_WRITE_ZEROES | F_INDIRECT_DESC | F_EVENT_IDX | F_VERSION_1;
/// Device status bits (2.1).
pub const S_ACKNOWLEDGE: u8 = 1;
pub const S_DRIVER: u8 = 2;
pub const S_DRIVER_OK: u8 = 4;
pub const S_FEATURES_OK: u8 = 8;
pub const S_NEEDS_RESET: u8 = 64;
pub const S_FAILED: u8 = 128;
pub const NO_VECTOR: u16 = 0xffff;

/// BAR 0 layout.
pub const BAR_SIZE: u64 = 0x8000;
pub const COMMON: u64 = 0x0000;
pub const COMMON_LEN: u64 = 0x38;
pub const ISR: u64 = 0x1000;
pub const DEVCFG: u64 = 0x2000;
pub const DEVCFG_LEN: u64 = 0x40;
pub const NOTIFY: u64 = 0x3000;
/// notify_off_multiplier: queue q notifies at NOTIFY + 4 * q.
pub const NOTIFY_MULT: u32 = 4;
pub const MSIX_TABLE: u64 = 0x4000;
pub const MSIX_PBA: u64 = 0x5000;
/// Vector 0 for configuration changes, 1 for the queue (by convention; the driver picks).
pub const MSIX_VECTORS: u16 = 2;
const MSIX_CAP: usize = 0x40;
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

#[derive(Default)]
pub(super) struct Stats {
    pub(super) notifies: u64,
    pub(super) kicks: u64,
    /// Times the poller went to sleep on the ioeventfd.
    pub(super) sleeps: u64,
    requests: u64,
    errors: u64,
    interrupts: u64,
    ring_errors: u64,
    resets: u64,
}

/// Register and queue state, behind the device's one lock.
pub(super) struct State {
    ctx: Option<DeviceContext>,
    blk: Blk,
    msix: MsixTable,
    dfsel: u32,
    gfsel: u32,
    driver_features: u64,
    status: u8,
    generation: u8,
    config_vector: u16,
    queue_sel: u16,
    queue: Queue,
    queue_vector: u16,
    isr: u8,
    pub(super) st: Stats,
    /// A poller serves the queue: serve() leaves notifications suppressed.
    pub(super) polling: bool,
}

/// The virtio-blk PCI function.
pub struct VirtioBlk {
    cfg: VirtioBlkConfig,
    state: Arc<Mutex<State>>,
    thread: Mutex<Option<Worker>>,
    /// The notify eventfd, made and registered at the first attach and kept:
    /// a device process's host announces it once (GET_REGION_IO_FDS) and
    /// its next clients get that same fd, so a later session must be woken
    /// through it, not through a new one nobody writes.
    kick: Mutex<Option<Arc<EventFd>>>,
    /// The guest-writable bytes of the VIRTIO_PCI_CAP_PCI_CFG capability
    /// (bar, offset, length, data), as the guest wrote them.
    pci_cfg: Mutex<[u8; PCI_CFG_BODY]>,
}

/// Where the VIRTIO_PCI_CAP_PCI_CFG capability sits, and its body length
/// (cap_len, cfg_type, bar, id, padding, offset, length, pci_cfg_data).
const PCI_CFG_CAP: usize = 0x98;
const PCI_CFG_BODY: usize = 18;
/// Body offsets of its fields.
const PCI_CFG_BAR: usize = 2;
const PCI_CFG_DATA: usize = 14;

struct Worker {
    kick: Arc<EventFd>,
    stop: Arc<AtomicBool>,
    handle: std::thread::JoinHandle<()>,
}

impl VirtioBlk {
    pub fn new(cfg: VirtioBlkConfig) -> Result<Self> {
        if cfg.size == 0 || !cfg.size.is_multiple_of(blk::SECTOR) {
            return Err(Error::Option { device: "virtio-blk", option: "size_mb".into(), reason: "empty disk".into() });
        }
        let backend = Backend::open(&cfg.backend, cfg.size)?;
        let state = State {
            ctx: None,
            blk: Blk::new(backend, cfg.size, "iopath-virtio-blk"),
            msix: MsixTable::new(MSIX_VECTORS, 0, MSIX_TABLE, MSIX_PBA, MSIX_CAP),
            dfsel: 0,
            gfsel: 0,
            driver_features: 0,
            status: 0,
            generation: 0,
            config_vector: NO_VECTOR,
            queue_sel: 0,
            queue: Queue::new(MAX_QUEUE_SIZE),
            queue_vector: NO_VECTOR,
            isr: 0,
            st: Stats::default(),
            polling: false,
        };
        let pci_cfg = Mutex::new([0u8; PCI_CFG_BODY]);
        Ok(VirtioBlk {
            cfg,
            state: Arc::new(Mutex::new(state)),
            thread: Mutex::new(None),
            kick: Mutex::new(None),
            pci_cfg,
        })
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        crate::lock(&self.state)
    }

    fn stop_thread(&self) {
        if let Some(w) = crate::lock(&self.thread).take() {
            w.stop.store(true, Ordering::Release);
            let _ = w.kick.write(1);
            let _ = w.handle.join();
        }
    }

    /// Registers the notify ioeventfd and starts the thread that serves it.
    fn start_thread(&self, ctx: &DeviceContext) {
        let mut t = crate::lock(&self.thread);
        if t.is_some() {
            return;
        }
        let spec = IoEventSpec { bar: 0, offset: NOTIFY, len: 0, datamatch: None };
        let mut kept = crate::lock(&self.kick);
        let kick = match kept.clone() {
            Some(k) => k, // registered at an earlier attach: still the one the host knows
            None => {
                let kick = match EventFd::new(libc::EFD_NONBLOCK) {
                    Ok(e) => Arc::new(e),
                    Err(e) => return log::warn!("virtio-blk: eventfd: {e}; notifications will exit"),
                };
                if let Err(e) = ctx.ioevents.register(spec, &kick) {
                    return log::warn!("virtio-blk: no ioeventfd ({e}); notifications will exit");
                }
                *kept = Some(kick.clone());
                kick
            }
        };
        drop(kept);
        let stop = Arc::new(AtomicBool::new(false));
        let (k, s, state) = (kick.clone(), stop.clone(), self.state.clone());
        let poll = self.cfg.notify == NotifyMode::Poll;
        let handle = std::thread::Builder::new().name("virtio-blk".into()).spawn(move || {
            crate::sandbox::enter(crate::sandbox::Role::Device);
            if poll {
                super::worker::poll_loop(&state, &k, &s)
            } else {
                super::worker::kick_loop(&state, &k, &s)
            }
        });
        match handle {
            Ok(handle) => *t = Some(Worker { kick, stop, handle }),
            Err(e) => {
                let _ = ctx.ioevents.unregister(spec, &kick);
                *crate::lock(&self.kick) = None;
                log::warn!("virtio-blk: thread: {e}; notifications will exit");
            }
        }
    }
}

impl VirtioBlk {
    /// The PCI_CFG window the guest set: (bar, offset, length 1, 2 or 4,
    /// aligned), or None if it is not one the device serves.
    fn pci_cfg_window(&self) -> Option<(u8, u64, usize)> {
        let c = *crate::lock(&self.pci_cfg);
        let off = u32::from_le_bytes(c[6..10].try_into().unwrap()) as u64;
        let len = u32::from_le_bytes(c[10..14].try_into().unwrap()) as usize;
        let ok = c[PCI_CFG_BAR] == 0 && matches!(len, 1 | 2 | 4) && off.is_multiple_of(len as u64);
        ok.then_some((0, off, len))
    }

    /// Keeps the guest's writes to the PCI_CFG capability; a write of
    /// pci_cfg_data writes the BAR through the window.
    fn pci_cfg_write(&self, offset: usize, data: &[u8]) {
        let body = PCI_CFG_CAP + 2;
        {
            let mut c = crate::lock(&self.pci_cfg);
            for (i, &b) in data.iter().enumerate() {
                let Some(k) = (offset + i).checked_sub(body).filter(|&k| k < PCI_CFG_BODY) else { continue };
                if k == PCI_CFG_BAR || k >= 6 {
                    c[k] = b;
                }
            }
        }
        if offset == body + PCI_CFG_DATA && data.len() == 4 {
            if let Some((bar, off, len)) = self.pci_cfg_window() {
                self.bar_write(bar, off, &data[..len]);
            }
        }
    }
}

impl Drop for VirtioBlk {
    fn drop(&mut self) {
        self.stop_thread();
    }
}

impl State {
    fn features(&self) -> u64 {
        FEATURES
    }

    fn common_regs(&self) -> [u8; COMMON_LEN as usize] {
        let mut r = [0u8; COMMON_LEN as usize];
        let mut put = |o: usize, v: &[u8]| r[o..o + v.len()].copy_from_slice(v);
        let dfeat = match self.dfsel {
            0 => self.features() as u32,
            1 => (self.features() >> 32) as u32,
            _ => 0,
        };
        put(0x00, &self.dfsel.to_le_bytes());
        put(0x04, &dfeat.to_le_bytes());
        put(0x08, &self.gfsel.to_le_bytes());
        let gfeat = if self.gfsel < 2 { (self.driver_features >> (32 * self.gfsel)) as u32 } else { 0 };
        put(0x0c, &gfeat.to_le_bytes());
        put(0x10, &self.config_vector.to_le_bytes());
        put(0x12, &1u16.to_le_bytes());
        put(0x14, &[self.status, self.generation]);
        put(0x16, &self.queue_sel.to_le_bytes());
        if self.queue_sel == 0 {
            let q = &self.queue;
            put(0x18, &q.num.to_le_bytes());
            put(0x1a, &self.queue_vector.to_le_bytes());
            put(0x1c, &(q.ready as u16).to_le_bytes());
            put(0x1e, &0u16.to_le_bytes());
            put(0x20, &q.desc.to_le_bytes());
            put(0x28, &q.avail.to_le_bytes());
            put(0x30, &q.used.to_le_bytes());
        }
        r
    }

    fn device_regs(&self) -> [u8; DEVCFG_LEN as usize] {
        let mut r = [0u8; DEVCFG_LEN as usize];
        r[0..8].copy_from_slice(&(self.blk.size / blk::SECTOR).to_le_bytes());
        r[12..16].copy_from_slice(&SEG_MAX.to_le_bytes());
        r[20..24].copy_from_slice(&(blk::SECTOR as u32).to_le_bytes());
        // max_discard_sectors, max_discard_seg, discard_sector_alignment,
        // max_write_zeroes_sectors, max_write_zeroes_seg, write_zeroes_may_unmap.
        for (at, v) in [(36, blk::MAX_RANGE_SECTORS), (40, blk::MAX_RANGE_SEGS), (44, 1)]
            .into_iter()
            .chain([(48, blk::MAX_RANGE_SECTORS), (52, blk::MAX_RANGE_SEGS)])
        {
            r[at..at + 4].copy_from_slice(&v.to_le_bytes());
        }
        r[56] = 1;
        r
    }

    fn vector_ok(v: u16) -> u16 {
        if v < MSIX_VECTORS {
            v
        } else {
            NO_VECTOR
        }
    }

    fn common_write(&mut self, off: u64, data: &[u8]) {
        let v = le_value(data);
        let q_setup = self.queue_sel == 0 && !self.queue.ready && self.status & S_DRIVER_OK == 0;
        match (off, data.len()) {
            (0x00, 4) => self.dfsel = v as u32,
            (0x08, 4) => self.gfsel = v as u32,
            (0x0c, 4) if self.status & S_FEATURES_OK == 0 && self.gfsel < 2 => {
                let sh = 32 * self.gfsel;
                self.driver_features = (self.driver_features & !(0xffff_ffffu64 << sh)) | (v & 0xffff_ffff) << sh;
            }
            (0x10, 2) => self.config_vector = Self::vector_ok(v as u16),
            (0x14, 1) => self.status_write(v as u8),
            (0x16, 2) => self.queue_sel = v as u16,
            (0x18, 2) if q_setup => {
                let n = v as u16;
                if n != 0 && n <= MAX_QUEUE_SIZE && n.is_power_of_two() {
                    self.queue.num = n;
                }
            }
            (0x1a, 2) if self.queue_sel == 0 => self.queue_vector = Self::vector_ok(v as u16),
            (0x1c, 2) if q_setup && v == 1 => self.enable_queue(),
            (0x20..=0x37, 4 | 8) if q_setup && off.is_multiple_of(data.len() as u64) => {
                let field = match off & !7 {
                    0x20 => &mut self.queue.desc,
                    0x28 => &mut self.queue.avail,
                    _ => &mut self.queue.used,
                };
                let sh = 8 * (off & 7);
                let mask = if data.len() == 8 { u64::MAX } else { 0xffff_ffffu64 << sh };
                *field = (*field & !mask) | ((v << sh) & mask);
            }
            _ => log::debug!("virtio-blk: common config write {off:#x}/{} dropped", data.len()),
        }
    }

    fn enable_queue(&mut self) {
        let Some(ctx) = &self.ctx else { return };
        match self.queue.validate(&ctx.mem) {
            Ok(()) => {
                self.queue.event_idx = self.driver_features & F_EVENT_IDX != 0;
                self.queue.ready = true;
            }
            Err(e) => self.broken(&format!("queue 0 enable: {e}")),
        }
    }

    fn status_write(&mut self, s: u8) {
        if s == 0 {
            return self.reset();
        }
        let mut s = s | (self.status & !S_NEEDS_RESET); // bits are only set, never cleared
        if s & S_FEATURES_OK != 0 && self.status & S_FEATURES_OK == 0 {
            let ok = self.driver_features & !self.features() == 0 && self.driver_features & F_VERSION_1 != 0;
            if !ok {
                s &= !S_FEATURES_OK; // the driver reads it back and gives up
            }
        }
        self.status = s | (self.status & S_NEEDS_RESET);
    }

    fn reset(&mut self) {
        self.queue.reset();
        self.queue.num = MAX_QUEUE_SIZE;
        (self.dfsel, self.gfsel, self.driver_features, self.status) = (0, 0, 0, 0);
        (self.config_vector, self.queue_vector, self.queue_sel, self.isr) = (NO_VECTOR, NO_VECTOR, 0, 0);
        if let Some(c) = &self.ctx {
            c.irq.set_intx(false);
        }
        self.st.resets += 1;
    }

    /// The driver broke the protocol: DEVICE_NEEDS_RESET and a configuration interrupt.
    fn broken(&mut self, why: &str) {
        log::warn!("virtio-blk: {why}; device needs reset");
        self.st.ring_errors += 1;
        if self.status & S_NEEDS_RESET == 0 {
            self.status |= S_NEEDS_RESET;
            self.generation = self.generation.wrapping_add(1);
            self.interrupt(self.config_vector, 2);
        }
    }

    /// Serves available requests, at most a ring's worth, then re-arms
    /// notifications. True if it stopped with more to do: the device thread
    /// then lets go of the lock before the next pass, so a driver that keeps
    /// the queue full cannot hold register accesses off.
    pub(super) fn serve(&mut self) -> bool {
        if !self.live() {
            return false;
        }
        let Some(mem) = self.ctx.as_ref().map(|c| c.mem.clone()) else { return false };
        let mut irq = false;
        let mut more = false;
        for _ in 0..=self.queue.num {
            more = true;
            match self.queue.pop(&mem) {
                Ok(Some(c)) => {
                    let done = self.blk.handle(&mem, &c.descs);
                    self.st.requests += 1;
                    if done.status != Some(blk::S_OK) {
                        self.st.errors += 1;
                    }
                    match self.queue.push_used(&mem, c.head, done.written) {
                        Ok(i) => irq |= i,
                        Err(e) => {
                            self.broken(&format!("used ring: {e}"));
                            return false;
                        }
                    }
                }
                Ok(None) => match self.queue.set_notify(&mem, !self.polling) {
                    Ok(a) if a != self.queue.next_avail() => continue, // raced in
                    Ok(_) => {
                        more = false;
                        break;
                    }
                    Err(e) => {
                        self.broken(&format!("used ring: {e}"));
                        return false;
                    }
                },
                Err(e) => {
                    self.broken(&format!("queue 0: {e}"));
                    return false;
                }
            }
        }
        if irq {
            self.interrupt(self.queue_vector, 1);
        }
        more
    }

    /// The device serves its queue: features accepted, DRIVER_OK, the
    /// queue enabled, and no protocol error since the last reset.
    fn live(&self) -> bool {
        let ok = S_FEATURES_OK | S_DRIVER_OK;
        self.status & ok == ok && self.status & (S_NEEDS_RESET | S_FAILED) == 0 && self.queue.ready
    }

    /// True if the queue is live and the driver has made chains available
    /// the device has not taken.
    pub(super) fn has_work(&self) -> bool {
        self.live() && self.ctx.as_ref().is_some_and(|c| self.queue.has_work(&c.mem).unwrap_or(true))
    }

    /// Sets whether a poller serves the queue, and asks the driver for
    /// notifications accordingly. True if work is already waiting (a
    /// poller about to sleep then polls on).
    pub(super) fn set_polling(&mut self, on: bool) -> bool {
        self.polling = on;
        let live = self.live();
        match self.ctx.as_ref().map(|c| c.mem.clone()) {
            Some(mem) if live => match self.queue.set_notify(&mem, !on) {
                Ok(a) => a != self.queue.next_avail(),
                Err(e) => {
                    self.broken(&format!("used ring: {e}"));
                    false
                }
            },
            _ => false,
        }
    }

    /// Raises `vector` (MSI-X enabled) or INTx with ISR bit `isr_bit`.
    fn interrupt(&mut self, vector: u16, isr_bit: u8) {
        let Some(ctx) = &self.ctx else { return };
        if !self.msix.enabled() {
            self.isr |= isr_bit;
            ctx.irq.set_intx(true);
            self.st.interrupts += 1;
            return;
        }
        if vector == NO_VECTOR {
            return;
        }
        let v = vector as usize;
        if ctx.irq.msix_host_owned() {
            if ctx.irq.signal_msix(vector) {
                self.st.interrupts += 1;
            }
        } else if self.msix.masked(v) || !ctx.irq.signal_msix(vector) {
            self.msix.set_pending(v, true);
        } else {
            self.st.interrupts += 1;
        }
    }

    fn msix_update(&mut self, v: usize) {
        let Some(ctx) = &self.ctx else { return };
        let route = self.msix.route(v);
        ctx.irq.msix_route(v as u16, route);
        if route.is_some() && self.msix.pending(v) && ctx.irq.signal_msix(v as u16) {
            self.msix.set_pending(v, false);
            self.st.interrupts += 1;
        }
    }
}

impl DeviceModel for VirtioBlk {
    fn name(&self) -> String {
        "virtio-blk".into()
    }

    fn ids(&self) -> PciIds {
        PciIds {
            vendor: VENDOR,
            device: DEVICE,
            class: 0x01_00_00,
            revision: 1,
            subsystem_vendor: VENDOR,
            subsystem: 0x1100,
        }
    }

    fn bars(&self) -> Vec<BarSpec> {
        vec![BarSpec { index: 0, kind: BarKind::Mem64, size: BAR_SIZE }]
    }

    fn attach(&self, ctx: DeviceContext) {
        if self.cfg.notify != NotifyMode::Exit {
            self.start_thread(&ctx);
        }
        self.state().ctx = Some(ctx);
    }

    fn bar_read(&self, bar: u8, offset: u64, data: &mut [u8]) {
        let mut s = self.state();
        if bar == 0 && s.msix.read(bar, offset, data) {
            return;
        }
        match (bar, offset) {
            (0, o) if o < COMMON_LEN => read_regs(&s.common_regs(), o, data),
            (0, ISR) => {
                // Reading the ISR clears it and deasserts INTx (4.1.4.5).
                let isr = std::mem::take(&mut s.isr);
                read_regs(&[isr], 0, data);
                if let Some(c) = &s.ctx {
                    c.irq.set_intx(false);
                }
            }
            (0, o) if (DEVCFG..DEVCFG + DEVCFG_LEN).contains(&o) => read_regs(&s.device_regs(), o - DEVCFG, data),
            _ => data.fill(0xff),
        }
    }

    fn bar_write(&self, bar: u8, offset: u64, data: &[u8]) {
        let mut s = self.state();
        if bar != 0 {
            return;
        }
        if s.msix.claims(bar, offset) {
            if let Some(v) = s.msix.write(bar, offset, data) {
                s.msix_update(v);
            }
            return;
        }
        match offset {
            o if o < COMMON_LEN => s.common_write(o, data),
            o if (NOTIFY..NOTIFY + NOTIFY_MULT as u64).contains(&o) => {
                s.st.notifies += 1;
                // The vCPU that wrote is waiting here: nothing else adds to the ring.
                if le_value(data) == 0 {
                    while s.serve() {}
                }
            }
            _ => {}
        }
    }

    fn reset(&self) {
        let mut s = self.state();
        s.reset();
        s.msix = MsixTable::new(MSIX_VECTORS, 0, MSIX_TABLE, MSIX_PBA, MSIX_CAP);
    }

    fn quiesce(&self) {
        self.stop_thread();
    }

    fn counters(&self) -> Vec<Counter> {
        let s = self.state();
        let st = &s.st;
        [
            ("notifies", st.notifies),
            ("kicks", st.kicks),
            ("sleeps", st.sleeps),
            ("requests", st.requests),
            ("errors", st.errors),
            ("interrupts", st.interrupts),
            ("ring_errors", st.ring_errors),
            ("resets", st.resets),
        ]
        .into_iter()
        .map(|(n, value)| Counter { name: n.into(), value })
        .collect()
    }

    fn config_read(&self, offset: usize, data: &mut [u8]) -> bool {
        // pci_cfg_data reads the BAR through the window (4.1.4.9).
        let at = PCI_CFG_CAP + 2 + PCI_CFG_DATA;
        if offset != at || data.len() != 4 {
            return false;
        }
        data.fill(0);
        if let Some((bar, off, len)) = self.pci_cfg_window() {
            self.bar_read(bar, off, &mut data[..len]);
        }
        true
    }

    fn config_write(&self, offset: usize, data: &[u8]) {
        self.pci_cfg_write(offset, data);
        let mut s = self.state();
        if s.msix.config_write(offset, data) {
            for v in 0..MSIX_VECTORS as usize {
                s.msix_update(v);
            }
        }
    }

    fn capabilities(&self) -> Vec<Capability> {
        // A virtio vendor capability (4.1.4): cap_len, cfg_type, bar, id, 2
        // bytes padding, offset, length[, notify_off_multiplier].
        let vcap = |at: usize, kind: u8, off: u64, len: u64, extra: Option<u32>| {
            let mut body = vec![if extra.is_some() { 20 } else { 16 }, kind, 0, 0, 0, 0];
            body.extend_from_slice(&(off as u32).to_le_bytes());
            body.extend_from_slice(&(len as u32).to_le_bytes());
            if let Some(m) = extra {
                body.extend_from_slice(&m.to_le_bytes());
            }
            Capability { offset: at, id: 0x09, body, wmask: Vec::new() }
        };
        vec![
            self.state().msix.capability(),
            vcap(0x50, 1, COMMON, COMMON_LEN, None),
            vcap(0x60, 2, NOTIFY, NOTIFY_MULT as u64, Some(NOTIFY_MULT)),
            vcap(0x78, 3, ISR, 1, None),
            vcap(0x88, 4, DEVCFG, DEVCFG_LEN, None),
            {
                // VIRTIO_PCI_CAP_PCI_CFG: bar, offset, length and data are the guest's.
                let mut c = vcap(PCI_CFG_CAP, 5, 0, 0, Some(0));
                c.body[0] = 20;
                let mut w = vec![0u8; PCI_CFG_BODY];
                w[PCI_CFG_BAR] = 0xff;
                w[6..].fill(0xff);
                c.wmask = w;
                c
            },
        ]
    }
}

#[cfg(test)]
#[path = "pci_tests.rs"]
mod tests;
