//! The virtio 1.x modern PCI transport (virtio 1.2, 4.1), apart from what
//! serves the queues: vendor 0x1af4, one 64-bit memory BAR holding the
//! common configuration, ISR, device configuration and notify areas (each
//! named by a vendor capability), the MSI-X table and PBA (config vector +
//! one per queue), and the VIRTIO_PCI_CAP_PCI_CFG window.
//!
//! N virtqueues (1 ..= [`MAX_QUEUES`], the engine's
//! [`num_queues`](QueueEngine::num_queues), fixed for the device's life).
//! `queue_select` takes any value; a queue at or past N reads `queue_size`
//! 0 (unavailable, 4.1.4.3), its other fields 0 (the vector NO_VECTOR), and
//! writes to it are dropped. Queue q notifies at `NOTIFY + 4 * q`
//! (`queue_notify_off` = q, [`NOTIFY_MULT`]); the device takes the queue
//! from the address, not from the value written, as an ioeventfd does. The
//! MSI-X table has N + 1 vectors, so a driver can give the configuration
//! and each queue a vector of its own (Linux does); any queue may take any
//! vector, or share one.
//!
//! The transport owns feature negotiation, device status, each queue's
//! registers (size a power of two up to [`MAX_QUEUE_SIZE`], rings checked
//! against guest memory when the driver enables the queue, nothing
//! writable once it is enabled or after DRIVER_OK), MSI-X, ISR and INTx.
//! A reset forgets every queue. A [`QueueEngine`] serves the queues:
//! iopath's own virtio-blk ([`pci`](super::pci), requests served in the
//! VMM) or a vhost-user backend (`iopath_protocols::vhost_user::frontend`);
//! another device type is one more engine (`cli/tests/recipe_virtio_rng.rs`).
//! The transport tells it about DRIVER_OK, notify writes that exit, and
//! reset, and asks it for the device's PCI ids and class, its features and
//! its device configuration.
//!
//! With state memory (`state.rs`; an engine that can resume says so,
//! [`QueueEngine::state_supported`]) the transport records its registers,
//! MSI-X and, for the engine, the chains in flight, so that a new process
//! of the device resumes it.

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
/// Most virtqueues a device has: its notify area (4 bytes each) and its
/// MSI-X table (N + 1 vectors) fit their pages many times over.
pub const MAX_QUEUES: u16 = 16;
pub(super) const MSIX_CAP: usize = 0x40;

/// The address queue `q`'s notifications go to (BAR 0 offset).
pub fn notify_offset(q: u16) -> u64 {
    NOTIFY + NOTIFY_MULT as u64 * q as u64
}

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
    /// The PCI class code (base, sub, prog-if in bits 23:0) the function
    /// shows: what a driver that matches by class, or a person reading
    /// lspci, takes it for (virtio-blk: 0x010000, mass storage; a device
    /// with no fitting class: 0xff0000).
    fn class(&self) -> u32;
    /// The PCI subsystem id (the subsystem vendor is 0x1af4): 0x40 or
    /// higher for a non-transitional device (4.1.2.1). By default 0x1100,
    /// the one QEMU's virtio devices show.
    fn subsystem(&self) -> u16 {
        0x1100
    }
    /// The feature bits the device offers the driver.
    fn features(&self) -> u64;
    /// The device configuration area (read by the driver at any time).
    fn device_config(&self) -> DeviceConfigBytes;
    /// How many virtqueues the device has (1 ..= [`MAX_QUEUES`]; asked
    /// once, when the transport is made).
    fn num_queues(&self) -> u16 {
        1
    }
    /// The host attached the device (its memory, ioeventfds, interrupts);
    /// `t.ctx` is not set yet.
    fn attach(_dev: &Shared<Self>, _ctx: &DeviceContext) {}
    /// The run is ending: stop the engine's threads (without the lock held).
    fn quiesce(_dev: &Shared<Self>) {}
    /// A device process's next client is about to be served: replace every
    /// eventfd the engine registered as an ioeventfd, so that the one a
    /// client that left kept wakes nobody (without the lock held).
    fn new_client(_dev: &Shared<Self>, _ctx: &DeviceContext) {}
    /// The driver wrote DRIVER_OK with FEATURES_OK set. An error puts the
    /// device in DEVICE_NEEDS_RESET.
    fn driver_ok(&mut self, _t: &mut Transport) -> Result<()> {
        Ok(())
    }
    /// A write to queue `queue`'s notify address reached the VMM (it was
    /// not an ioeventfd); `queue` < the device's queues.
    fn notify(&mut self, t: &mut Transport, queue: u16);
    /// The driver reset the device (status 0) or the host did: stop serving
    /// every queue. The transport then forgets their registers.
    fn reset(&mut self, _t: &mut Transport) {}
    /// How a queue's interrupt is delivered may have changed: the driver
    /// wrote a queue's MSI-X vector, MSI-X enable or function mask, or a
    /// table entry (a vector's route). `t` holds the new state. An engine
    /// that handed a vector's eventfd to someone else (vhost-user's call
    /// fd) hands over the right one again.
    fn interrupt_changed(&mut self, _t: &mut Transport) {}
    /// The engine's own counters (the transport adds notifies, interrupts,
    /// ring_errors and resets).
    fn counters(&self) -> Vec<Counter>;
    /// Its error injection rules, shared with a control socket (None: it
    /// takes none).
    fn injector(&self) -> Option<std::sync::Arc<crate::block::inject::Injector>> {
        None
    }
    /// The engine hands guest RAM to another process (a vhost-user backend).
    fn shares_guest_ram(&self) -> bool {
        false
    }
    /// Whether the engine can keep its state in state memory and resume
    /// from it (`state.rs`): Ok, or why not.
    fn state_supported(&self) -> Result<()> {
        Err(crate::Error::Host(format!("{} keeps no state memory", self.name())))
    }
    /// Its storage, if it is a ram disk: state memory then holds its data
    /// (`state.rs`), which outlives the process.
    fn state_ram(&mut self) -> Option<&mut crate::block::Storage> {
        None
    }
    /// Before a resume: waits for the file operations a dead process left
    /// running in the kernel (`Storage::after_predecessor`).
    fn after_predecessor(&self) -> Result<()> {
        Ok(())
    }
    /// The device resumed from state memory: `again[q]` holds the chains of
    /// queue q a dead process took and did not complete, oldest first, to
    /// run before any new one. The engine serves its queues now.
    fn resumed(&mut self, _t: &mut Transport, _again: Vec<Vec<u16>>) {}
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
    /// The device's queues (as many as the engine has, fixed): their
    /// registers, and their ring state for an engine that serves them here.
    pub queues: Vec<Vq>,
    isr: u8,
    /// The device features, taken from the engine when the transport is made.
    features: u64,
    name: String,
    pub notifies: u64,
    pub interrupts: u64,
    pub ring_errors: u64,
    pub resets: u64,
    /// The state memory's recorder, once the device adopted one (`state.rs`).
    pub(super) rec: Option<Box<state::Recorder>>,
}

/// One virtqueue's transport state.
#[derive(Clone, Debug)]
pub struct Vq {
    /// Its registers (size, enable, ring addresses) and ring state.
    pub ring: Queue,
    /// The MSI-X vector the driver gave it ([`NO_VECTOR`]: none).
    pub vector: u16,
}

impl Vq {
    fn new() -> Self {
        Vq { ring: Queue::new(MAX_QUEUE_SIZE), vector: NO_VECTOR }
    }
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
    /// A function served by `engine`, with its
    /// [`num_queues`](QueueEngine::num_queues) (bounded to 1 ..= [`MAX_QUEUES`]).
    pub fn with_engine(engine: E) -> Self {
        let n = engine.num_queues().clamp(1, MAX_QUEUES);
        let t = Transport {
            ctx: None,
            msix: new_msix(n),
            dfsel: 0,
            gfsel: 0,
            driver_features: 0,
            status: 0,
            generation: 0,
            config_vector: NO_VECTOR,
            queue_sel: 0,
            queues: vec![Vq::new(); n as usize],
            isr: 0,
            features: engine.features(),
            name: engine.name(),
            notifies: 0,
            interrupts: 0,
            ring_errors: 0,
            resets: 0,
            rec: None,
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

/// The MSI-X table of a device with `queues` queues: one vector for
/// configuration changes and one per queue (by convention; the driver picks).
fn new_msix(queues: u16) -> MsixTable {
    MsixTable::new(queues + 1, 0, MSIX_TABLE, MSIX_PBA, MSIX_CAP)
}

impl Transport {
    /// The feature bits offered.
    pub fn features(&self) -> u64 {
        self.features
    }

    /// How many queues the device has.
    pub fn num_queues(&self) -> u16 {
        self.queues.len() as u16
    }

    /// MSI-X vectors in the table: the configuration's and one per queue.
    pub fn msix_vectors(&self) -> u16 {
        self.num_queues() + 1
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
        put(0x12, &self.num_queues().to_le_bytes());
        put(0x14, &[self.status, self.generation]);
        put(0x16, &self.queue_sel.to_le_bytes());
        match self.queues.get(self.queue_sel as usize) {
            Some(vq) => {
                let q = &vq.ring;
                put(0x18, &q.num.to_le_bytes());
                put(0x1a, &vq.vector.to_le_bytes());
                put(0x1c, &(q.ready as u16).to_le_bytes());
                put(0x1e, &self.queue_sel.to_le_bytes()); // queue_notify_off
                put(0x20, &q.desc.to_le_bytes());
                put(0x28, &q.avail.to_le_bytes());
                put(0x30, &q.used.to_le_bytes());
            }
            // No such queue: size 0 (unavailable), no vector, the rest 0.
            None => put(0x1a, &NO_VECTOR.to_le_bytes()),
        }
        r
    }

    /// `v` if the table has that vector, else NO_VECTOR (the driver reads
    /// it back and knows it was refused).
    fn vector_ok(&self, v: u16) -> u16 {
        if v < self.msix_vectors() {
            v
        } else {
            NO_VECTOR
        }
    }

    fn enable_queue(&mut self, i: usize) {
        let Some(ctx) = &self.ctx else { return };
        let event_idx = self.driver_features & F_EVENT_IDX != 0;
        let q = &mut self.queues[i].ring;
        match q.validate(&ctx.mem) {
            Ok(()) => {
                q.event_idx = event_idx;
                q.ready = true;
            }
            Err(e) => self.broken(&format!("queue {i} enable: {e}")),
        }
    }

    fn forget(&mut self) {
        for vq in &mut self.queues {
            vq.ring.reset();
            vq.ring.num = MAX_QUEUE_SIZE;
            vq.vector = NO_VECTOR;
        }
        (self.dfsel, self.gfsel, self.driver_features, self.status) = (0, 0, 0, 0);
        (self.config_vector, self.queue_sel, self.isr) = (NO_VECTOR, 0, 0);
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
            self.record();
            self.interrupt(self.config_vector, 2);
        }
    }

    /// The device is served: features accepted, DRIVER_OK, and no
    /// protocol error since the last reset.
    pub fn live(&self) -> bool {
        let ok = S_FEATURES_OK | S_DRIVER_OK;
        self.status & ok == ok && self.status & (S_NEEDS_RESET | S_FAILED) == 0
    }

    /// Queue `i` is served: the device [`live`](Self::live) and the queue enabled.
    pub fn queue_live(&self, i: usize) -> bool {
        self.live() && self.queues.get(i).is_some_and(|q| q.ring.ready)
    }

    /// Raises queue `i`'s interrupt: its vector, or INTx with the ISR's queue bit.
    pub fn queue_interrupt(&mut self, i: usize) {
        if let Some(v) = self.queues.get(i).map(|q| q.vector) {
            self.interrupt(v, 1);
        }
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
        // The selected queue, if the device has it: its registers are
        // written only while it is disabled and before DRIVER_OK.
        let sel = Some(t.queue_sel as usize).filter(|&i| i < t.queues.len());
        let setup = sel.filter(|&i| !t.queues[i].ring.ready && t.status & S_DRIVER_OK == 0);
        match (off, data.len(), sel, setup) {
            (0x00, 4, ..) => t.dfsel = v as u32,
            (0x08, 4, ..) => t.gfsel = v as u32,
            (0x0c, 4, ..) if t.status & S_FEATURES_OK == 0 && t.gfsel < 2 => {
                let sh = 32 * t.gfsel;
                t.driver_features = (t.driver_features & !(0xffff_ffffu64 << sh)) | (v & 0xffff_ffff) << sh;
            }
            (0x10, 2, ..) => t.config_vector = t.vector_ok(v as u16),
            (0x14, 1, ..) => self.status_write(v as u8),
            (0x16, 2, ..) => t.queue_sel = v as u16,
            (0x18, 2, _, Some(i)) => {
                let n = v as u16;
                if n != 0 && n <= MAX_QUEUE_SIZE && n.is_power_of_two() {
                    t.queues[i].ring.num = n;
                }
            }
            (0x1a, 2, Some(i), _) => {
                let v = t.vector_ok(v as u16);
                if v != t.queues[i].vector {
                    t.queues[i].vector = v;
                    self.e.interrupt_changed(&mut self.t);
                }
            }
            (0x1c, 2, _, Some(i)) if v == 1 => t.enable_queue(i),
            (0x20..=0x37, 4 | 8, _, Some(i)) if off.is_multiple_of(data.len() as u64) => {
                let q = &mut t.queues[i].ring;
                let field = match off & !7 {
                    0x20 => &mut q.desc,
                    0x28 => &mut q.avail,
                    _ => &mut q.used,
                };
                let sh = 8 * (off & 7);
                let mask = if data.len() == 8 { u64::MAX } else { 0xffff_ffffu64 << sh };
                *field = (*field & !mask) | ((v << sh) & mask);
            }
            _ => log::debug!("{}: common config write {off:#x}/{} dropped", t.name, data.len()),
        }
        self.t.record();
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
        self.t.record();
    }
}

#[path = "transport_model.rs"]
mod model;
#[path = "state.rs"]
pub mod state;
