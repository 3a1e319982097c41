//! The virtio 1.x modern PCI transport (virtio 1.2, 4.1), apart from what
//! serves the queues: vendor 0x1af4, one 64-bit memory BAR holding the
//! common configuration, ISR, device configuration and notify areas (each
//! named by a vendor capability), the MSI-X table and PBA (config vector +
//! one per queue), and the VIRTIO_PCI_CAP_PCI_CFG window. One queue.
//!
//! The transport owns feature negotiation, device status, the queue's
//! registers (checked against guest memory when the driver enables it),
//! MSI-X, ISR and INTx. A [`QueueEngine`] serves the queue: iopath's own
//! virtio-blk ([`pci`](super::pci), requests served in the VMM) or a
//! vhost-user backend (`iopath_protocols::vhost_user::frontend`). The
//! transport tells it about DRIVER_OK, notify writes that exit, and reset,
//! and asks it for the device features and device configuration.

use super::queue::{Queue, MAX_QUEUE_SIZE};
use crate::pci::{Capability, MsixTable};
use crate::{le_value, Counter, DeviceContext, DeviceModel, Result};
use std::sync::{Arc, Mutex};

/// Feature bits the transport itself needs (6): VERSION_1 is required.
pub const F_VERSION_1: u64 = 1 << 32;
/// The queue's EVENT_IDX (the transport tells the queue whether it was negotiated).
pub const F_EVENT_IDX: u64 = 1 << 29;
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
pub(super) const MSIX_CAP: usize = 0x40;

/// Where the VIRTIO_PCI_CAP_PCI_CFG capability sits, and its body length
/// (cap_len, cfg_type, bar, id, padding, offset, length, pci_cfg_data).
const PCI_CFG_CAP: usize = 0x98;
const PCI_CFG_BODY: usize = 18;
/// Body offsets of its fields.
const PCI_CFG_BAR: usize = 2;
const PCI_CFG_DATA: usize = 14;

/// The device configuration area's bytes.
pub type DeviceConfigBytes = [u8; DEVCFG_LEN as usize];

/// What serves a virtio PCI function's queue. Its methods run under the
/// device's one lock, with the transport beside it (`t`), so an engine can
/// raise interrupts ([`Transport::interrupt`]) or give up on the ring
/// ([`Transport::broken`]).
pub trait QueueEngine: Send + Sized + 'static {
    /// The device's name (log lines, `DeviceModel::name`).
    fn name(&self) -> String;
    /// The PCI device id: 0x1040 + the virtio device type (4.1.2.1).
    fn device_id(&self) -> u16;
    /// The feature bits the device offers the driver.
    fn features(&self) -> u64;
    /// The device configuration area (read by the driver at any time).
    fn device_config(&self) -> DeviceConfigBytes;
    /// The host attached the device (its memory, ioeventfds, interrupts);
    /// `t.ctx` is not set yet.
    fn attach(_dev: &Shared<Self>, _ctx: &DeviceContext) {}
    /// The run is ending: stop the engine's threads (without the lock held).
    fn quiesce(_dev: &Shared<Self>) {}
    /// The driver wrote DRIVER_OK with FEATURES_OK set. An error puts the
    /// device in DEVICE_NEEDS_RESET.
    fn driver_ok(&mut self, _t: &mut Transport) -> Result<()> {
        Ok(())
    }
    /// A write to the queue's notify address reached the VMM (it was not
    /// an ioeventfd). `value` is what the driver wrote (the queue index).
    fn notify(&mut self, t: &mut Transport, value: u64);
    /// The driver reset the device (status 0) or the host did: stop serving
    /// the queue. The transport then forgets its registers.
    fn reset(&mut self, _t: &mut Transport) {}
    /// How the queue's interrupt is delivered may have changed: the driver
    /// wrote the queue's MSI-X vector, MSI-X enable or function mask, or a
    /// table entry (a vector's route). `t` holds the new state. An engine
    /// that handed a vector's eventfd to someone else (vhost-user's call
    /// fd) hands over the right one again.
    fn interrupt_changed(&mut self, _t: &mut Transport) {}
    /// The engine's own counters (the transport adds notifies, interrupts,
    /// ring_errors and resets).
    fn counters(&self) -> Vec<Counter>;
    /// The engine hands guest RAM to another process (a vhost-user backend).
    fn shares_guest_ram(&self) -> bool {
        false
    }
}

/// The transport's register state (the engine's is beside it in [`State`]).
pub struct Transport {
    pub ctx: Option<DeviceContext>,
    msix: MsixTable,
    dfsel: u32,
    gfsel: u32,
    /// What the driver accepted.
    pub driver_features: u64,
    pub status: u8,
    generation: u8,
    config_vector: u16,
    queue_sel: u16,
    /// Queue 0: its registers, and its ring state for an engine that serves it here.
    pub queue: Queue,
    /// The MSI-X vector the driver gave queue 0 ([`NO_VECTOR`]: none).
    pub queue_vector: u16,
    isr: u8,
    /// The device features, taken from the engine when the transport is made.
    features: u64,
    name: String,
    pub notifies: u64,
    pub interrupts: u64,
    pub ring_errors: u64,
    pub resets: u64,
}

/// A device's state behind its one lock: the transport and the engine.
pub struct State<E> {
    pub t: Transport,
    pub e: E,
}

/// How an engine's threads reach the device.
pub type Shared<E> = Arc<Mutex<State<E>>>;

/// A virtio PCI function whose queue `E` serves.
pub struct VirtioPci<E: QueueEngine> {
    state: Shared<E>,
    /// The guest-writable bytes of the VIRTIO_PCI_CAP_PCI_CFG capability
    /// (bar, offset, length, data), as the guest wrote them.
    pci_cfg: Mutex<[u8; PCI_CFG_BODY]>,
}

impl<E: QueueEngine> VirtioPci<E> {
    /// A function served by `engine`.
    pub fn with_engine(engine: E) -> Self {
        let t = Transport {
            ctx: None,
            msix: new_msix(),
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
            features: engine.features(),
            name: engine.name(),
            notifies: 0,
            interrupts: 0,
            ring_errors: 0,
            resets: 0,
        };
        VirtioPci { state: Arc::new(Mutex::new(State { t, e: engine })), pci_cfg: Mutex::new([0u8; PCI_CFG_BODY]) }
    }

    /// The state an engine's threads share.
    pub fn shared(&self) -> &Shared<E> {
        &self.state
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State<E>> {
        crate::lock(&self.state)
    }

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

impl<E: QueueEngine> Drop for VirtioPci<E> {
    fn drop(&mut self) {
        E::quiesce(&self.state);
    }
}

fn new_msix() -> MsixTable {
    MsixTable::new(MSIX_VECTORS, 0, MSIX_TABLE, MSIX_PBA, MSIX_CAP)
}

impl Transport {
    /// The feature bits offered.
    pub fn features(&self) -> u64 {
        self.features
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

    fn vector_ok(v: u16) -> u16 {
        if v < MSIX_VECTORS {
            v
        } else {
            NO_VECTOR
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

    fn forget(&mut self) {
        self.queue.reset();
        self.queue.num = MAX_QUEUE_SIZE;
        (self.dfsel, self.gfsel, self.driver_features, self.status) = (0, 0, 0, 0);
        (self.config_vector, self.queue_vector, self.queue_sel, self.isr) = (NO_VECTOR, NO_VECTOR, 0, 0);
        if let Some(c) = &self.ctx {
            c.irq.set_intx(false);
        }
        self.resets += 1;
    }

    /// The driver (or the engine's peer) broke the protocol:
    /// DEVICE_NEEDS_RESET and a configuration interrupt.
    pub fn broken(&mut self, why: &str) {
        log::warn!("{}: {why}; device needs reset", self.name);
        self.ring_errors += 1;
        if self.status & S_NEEDS_RESET == 0 {
            self.status |= S_NEEDS_RESET;
            self.generation = self.generation.wrapping_add(1);
            self.interrupt(self.config_vector, 2);
        }
    }

    /// The queue is served: features accepted, DRIVER_OK, the queue
    /// enabled, and no protocol error since the last reset.
    pub fn live(&self) -> bool {
        let ok = S_FEATURES_OK | S_DRIVER_OK;
        self.status & ok == ok && self.status & (S_NEEDS_RESET | S_FAILED) == 0 && self.queue.ready
    }

    /// True when MSI-X is enabled (else interrupts are INTx with the ISR).
    pub fn msix_enabled(&self) -> bool {
        self.msix.enabled()
    }

    /// Raises `vector` (MSI-X enabled) or INTx with ISR bit `isr_bit`.
    pub fn interrupt(&mut self, vector: u16, isr_bit: u8) {
        let Some(ctx) = &self.ctx else { return };
        if !self.msix.enabled() {
            self.isr |= isr_bit;
            ctx.irq.set_intx(true);
            self.interrupts += 1;
            return;
        }
        if vector == NO_VECTOR {
            return;
        }
        let v = vector as usize;
        if ctx.irq.msix_host_owned() {
            if ctx.irq.signal_msix(vector) {
                self.interrupts += 1;
            }
        } else if self.msix.masked(v) || !ctx.irq.signal_msix(vector) {
            self.msix.set_pending(v, true);
        } else {
            self.interrupts += 1;
        }
    }

    fn msix_update(&mut self, v: usize) {
        let Some(ctx) = &self.ctx else { return };
        let route = self.msix.route(v);
        ctx.irq.msix_route(v as u16, route);
        if route.is_some() && self.msix.pending(v) && ctx.irq.signal_msix(v as u16) {
            self.msix.set_pending(v, false);
            self.interrupts += 1;
        }
    }
}

impl<E: QueueEngine> State<E> {
    fn common_write(&mut self, off: u64, data: &[u8]) {
        let t = &mut self.t;
        let v = le_value(data);
        let q_setup = t.queue_sel == 0 && !t.queue.ready && t.status & S_DRIVER_OK == 0;
        match (off, data.len()) {
            (0x00, 4) => t.dfsel = v as u32,
            (0x08, 4) => t.gfsel = v as u32,
            (0x0c, 4) if t.status & S_FEATURES_OK == 0 && t.gfsel < 2 => {
                let sh = 32 * t.gfsel;
                t.driver_features = (t.driver_features & !(0xffff_ffffu64 << sh)) | (v & 0xffff_ffff) << sh;
            }
            (0x10, 2) => t.config_vector = Transport::vector_ok(v as u16),
            (0x14, 1) => self.status_write(v as u8),
            (0x16, 2) => t.queue_sel = v as u16,
            (0x18, 2) if q_setup => {
                let n = v as u16;
                if n != 0 && n <= MAX_QUEUE_SIZE && n.is_power_of_two() {
                    t.queue.num = n;
                }
            }
            (0x1a, 2) if t.queue_sel == 0 => {
                let v = Transport::vector_ok(v as u16);
                if v != t.queue_vector {
                    t.queue_vector = v;
                    self.e.interrupt_changed(&mut self.t);
                }
            }
            (0x1c, 2) if q_setup && v == 1 => t.enable_queue(),
            (0x20..=0x37, 4 | 8) if q_setup && off.is_multiple_of(data.len() as u64) => {
                let field = match off & !7 {
                    0x20 => &mut t.queue.desc,
                    0x28 => &mut t.queue.avail,
                    _ => &mut t.queue.used,
                };
                let sh = 8 * (off & 7);
                let mask = if data.len() == 8 { u64::MAX } else { 0xffff_ffffu64 << sh };
                *field = (*field & !mask) | ((v << sh) & mask);
            }
            _ => log::debug!("{}: common config write {off:#x}/{} dropped", t.name, data.len()),
        }
    }

    fn status_write(&mut self, s: u8) {
        if s == 0 {
            return self.reset();
        }
        let t = &mut self.t;
        let old = t.status;
        let mut s = s | (old & !S_NEEDS_RESET); // bits are only set, never cleared
        if s & S_FEATURES_OK != 0 && old & S_FEATURES_OK == 0 {
            let ok = t.driver_features & !t.features() == 0 && t.driver_features & F_VERSION_1 != 0;
            if !ok {
                s &= !S_FEATURES_OK; // the driver reads it back and gives up
            }
        }
        t.status = s | (old & S_NEEDS_RESET);
        let ok = S_FEATURES_OK | S_DRIVER_OK;
        if t.status & ok == ok && old & S_DRIVER_OK == 0 && t.status & S_NEEDS_RESET == 0 {
            if let Err(e) = self.e.driver_ok(&mut self.t) {
                self.t.broken(&format!("DRIVER_OK: {e}"));
            }
        }
    }

    fn reset(&mut self) {
        self.e.reset(&mut self.t);
        self.t.forget();
    }
}

#[path = "transport_model.rs"]
mod model;
