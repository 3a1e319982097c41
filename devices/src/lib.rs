//! Device models, written once.
//!
//! A device model sees its BARs as offsets, guest memory as a [`GuestMem`]
//! (mapped memory, and ranges its host reaches by message, [`mem`]), and
//! asks for KVM ioeventfds through the [`IoEvents`]
//! trait. It never learns which transport carries its accesses (a VMM exit,
//! an ioeventfd, or a message from another process): that is what makes
//! the transports comparable. This crate must not touch KVM or the VMM.

pub mod backing;
pub mod block;
pub mod doorbell;
pub mod error;
pub mod hugepages;
pub mod irq;
pub mod mem;
pub mod nvme;
pub mod options;
pub mod pci;
pub mod rng;
pub mod sandbox;
pub mod spec;
pub mod state;
pub mod testdev;
pub mod virtio;

pub use error::{Error, Result};
pub use mem::{DmaPort, GuestMem, Keeper};
pub use spec::{DeviceConfig, DEVICE_NAMES};
use std::fmt;
pub use vm_memory::GuestMemoryMmap;
use vmm_sys_util::eventfd::EventFd;

/// Kind of a Base Address Register.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BarKind {
    /// 32-bit memory BAR.
    Mem32,
    /// 64-bit memory BAR (takes two BAR slots).
    Mem64,
    /// I/O space BAR.
    Io,
}

/// One BAR a device implements: its slot, kind and size (a power of two).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BarSpec {
    pub index: u8,
    pub kind: BarKind,
    pub size: u64,
}

/// PCI identity of a device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PciIds {
    pub vendor: u16,
    pub device: u16,
    /// Class code (base, sub, prog-if) in bits 23:0.
    pub class: u32,
    pub revision: u8,
    pub subsystem_vendor: u16,
    pub subsystem: u16,
    /// Interrupt Pin (configuration offset 0x3d): 1 (INTA#) for a device
    /// that raises INTx, 0 for one that does not. A host may route the line
    /// of a device that has none (the VMM routes every slot's); a vfio-user
    /// server offers INTx (GET_IRQ_INFO) only where the pin is set.
    pub interrupt_pin: u8,
}

/// A KVM ioeventfd a device asks for, in BAR terms.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IoEventSpec {
    pub bar: u8,
    pub offset: u64,
    /// Access length that hits: 1, 2, 4, 8, or 0 for any length.
    pub len: u32,
    /// Only a write of this value hits (None: any value, a "wildcard").
    pub datamatch: Option<u64>,
}

/// Registers ioeventfds for a device; implemented by the transport that hosts it.
pub trait IoEvents: Send + Sync {
    fn register(&self, spec: IoEventSpec, fd: &EventFd) -> Result<()>;
    fn unregister(&self, spec: IoEventSpec, fd: &EventFd) -> Result<()>;
    /// True when registrations are announced once to another process (a
    /// vfio-user client reads them with GET_REGION_IO_FDS) and cannot follow
    /// the device afterwards: a device then registers every ioeventfd it may
    /// want in `attach` and keeps them.
    fn static_only(&self) -> bool {
        false
    }
    /// Takes the BAR area the device shares at (`bar`, `offset`)
    /// ([`DeviceModel::mapped_areas`]) out of the guest (`trap`), so that the
    /// guest's accesses to it exit to the model's `bar_read`/`bar_write`, or
    /// puts it back. A polling device asks for this before it sleeps: the next
    /// store wakes it. False if this host cannot: it maps no such area, or
    /// another process does (a vfio-user client mapped the sparse area).
    fn trap_area(&self, _bar: u8, _offset: u64, _trap: bool) -> bool {
        false
    }
    /// Puts `area`'s memory (its fd) where the area the device shared at
    /// (`area.bar`, `area.offset`), of the same size, is, in place of the
    /// memory it had: a device process started again shares a new page.
    /// The area's trap stays as it was. False if this host cannot (it maps
    /// no such area, or the new memory does not fit): the old memory stays.
    fn replace_area(&self, _area: MappedArea) -> bool {
        false
    }
}

/// An [`IoEvents`] for hosts without ioeventfd: every request fails, so the
/// device falls back to serving the access where it arrives.
pub struct NoIoEvents;
impl IoEvents for NoIoEvents {
    fn register(&self, _: IoEventSpec, _: &EventFd) -> Result<()> {
        Err(Error::Host("this transport has no ioeventfd".into()))
    }
    fn unregister(&self, _: IoEventSpec, _: &EventFd) -> Result<()> {
        Ok(())
    }
}

/// Interrupts a device raises. The host wires them to KVM irqfds (directly in
/// the VMM; through eventfds handed over a socket for a device process), so
/// an interrupt never passes through the VMM's userspace.
pub trait Interrupts: Send + Sync {
    /// Sets the level of INTx (pin A).
    fn set_intx(&self, level: bool);
    /// Signals MSI-X vector `vector`; false if the vector has no route.
    fn signal_msix(&self, vector: u16) -> bool;
    /// Copies of the INTx (trigger, resample) eventfds, for a transport that
    /// hands them to a device process (mpqemu SET_IRQFD, vfio-user SET_IRQS).
    fn intx_eventfds(&self) -> Option<(EventFd, EventFd)> {
        None
    }
    /// Points MSI-X vector `vector` at the message (address, data) the guest
    /// programmed, or takes its route away (None: masked or disabled).
    fn msix_route(&self, _vector: u16, _msg: Option<(u64, u32)>) {}
    /// A copy of the eventfd behind a routed MSI-X vector, for a transport
    /// that hands it to a device process (vfio-user SET_IRQS).
    fn msix_eventfd(&self, _vector: u16) -> Option<EventFd> {
        None
    }
    /// True when the host keeps the MSI-X table and PBA itself, as QEMU and
    /// kernel VFIO do: it gave the device an eventfd per vector (vfio-user
    /// SET_IRQS) and masks, holds and re-sends messages on its side. A table
    /// write may then never reach the device, whose own table stays masked:
    /// the device signals a vector whenever it raises it, whatever its table
    /// says. The host holds a vector raised before it has an eventfd and
    /// signals it when one arrives ([`signal_msix`](Self::signal_msix)
    /// returns false then). False (the default): the device's table rules,
    /// and the host only routes what [`msix_route`](Self::msix_route) gives.
    fn msix_host_owned(&self) -> bool {
        false
    }
}

/// An [`Interrupts`] with nothing connected.
pub struct NoInterrupts;
impl Interrupts for NoInterrupts {
    fn set_intx(&self, _: bool) {}
    fn signal_msix(&self, _: u16) -> bool {
        false
    }
}

/// A page-aligned part of a BAR backed by `size` bytes of `fd` from `fd_offset`.
#[derive(Debug)]
pub struct MappedArea {
    pub bar: u8,
    pub offset: u64,
    pub size: u64,
    pub fd: std::fs::File,
    pub fd_offset: u64,
}

/// Stops the run with a message (a device whose peer process died, say).
pub type FailFn = std::sync::Arc<dyn Fn(String) + Send + Sync>;

/// What a device gets from whoever hosts it.
#[derive(Clone)]
pub struct DeviceContext {
    /// Guest memory: mapped, or (a vfio-user client's RAM without an fd)
    /// partly reached through the host's [`DmaPort`].
    pub mem: GuestMem,
    pub ioevents: std::sync::Arc<dyn IoEvents>,
    pub irq: std::sync::Arc<dyn Interrupts>,
    pub fail: FailFn,
}

impl DeviceContext {
    /// A context with the given memory and nothing else connected.
    pub fn detached(mem: impl Into<GuestMem>) -> Self {
        DeviceContext {
            mem: mem.into(),
            ioevents: std::sync::Arc::new(NoIoEvents),
            irq: std::sync::Arc::new(NoInterrupts),
            fail: std::sync::Arc::new(|m| log::error!("{m}")),
        }
    }
}

/// A named device counter (routing checks read these).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Counter {
    pub name: String,
    pub value: u64,
}

impl fmt::Display for Counter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}={}", self.name, self.value)
    }
}

/// A PCI device model, as its host calls it.
///
/// Every method takes `&self`: a model keeps its own state behind the one
/// lock it needs, so an access takes at most one lock on the device (the
/// usual shape is a [`DeviceModelMut`] inside a `Mutex`, which implements
/// this trait). `bar_read`/`bar_write` receive an offset inside BAR `bar`;
/// `data.len()` is the access size. A model must accept any offset and size
/// without panicking: out-of-range reads return all-ones, writes are dropped.
pub trait DeviceModel: Send + Sync {
    /// Short name, e.g. "pci-testdev".
    fn name(&self) -> String;
    fn ids(&self) -> PciIds;
    fn bars(&self) -> Vec<BarSpec>;
    /// Called before the first access, and again when the host's view of
    /// guest memory changes (a device process given a new memory map); a
    /// model keeps what it set up the first time (eventfds, threads). Once
    /// `attach` returns, no thread of the model touches the previous memory:
    /// a client that unmapped it may reuse it.
    fn attach(&self, ctx: DeviceContext);
    fn bar_read(&self, bar: u8, offset: u64, data: &mut [u8]);
    fn bar_write(&self, bar: u8, offset: u64, data: &[u8]);
    /// Device reset (PCI function-level): back to the power-on register
    /// state. Counters are kept.
    fn reset(&self) {}
    /// Stops device threads and folds pending ioeventfd kicks into counters.
    fn quiesce(&self) {}
    /// A device process's next client is about to be served: whatever the
    /// model handed out before (the fds of its [`mapped_areas`](Self::mapped_areas),
    /// the eventfds it registered as ioeventfds with a host that announces
    /// them once) is replaced by new ones, so that what a client that left
    /// kept reaches a page and an eventfd nobody looks at. The device's state
    /// stays as it is (the host resets it separately, unless told to keep it).
    fn new_client(&self) {}
    fn counters(&self) -> Vec<Counter>;
    /// The device's error injection rules, shared (a control socket holds
    /// the same handle); None for a device without error injection.
    fn injector(&self) -> Option<std::sync::Arc<crate::block::inject::Injector>> {
        None
    }
    /// Attaches (`true`) or detaches namespace `nsid` at run time, as a
    /// control socket asks: Ok(true) if that changed it, Ok(false) if it was
    /// so already; an error for a device without namespaces or no such one.
    fn set_namespace_attached(&self, nsid: u32, _attached: bool) -> Result<bool> {
        let reason = format!("{} has no namespaces to attach or detach (asked for {nsid})", self.name());
        Err(Error::Option { device: "control", option: "nsid".into(), reason })
    }
    /// Bytes of state memory ([`state::StateMemory`]) this device keeps
    /// what it must not lose in, so that the next process of it resumes
    /// where a killed one stopped; None for a device that keeps none.
    fn state_len(&self) -> Option<usize> {
        None
    }
    /// Keeps the device's state in `mem` from now on: `resume` false zeroes
    /// it and starts recording (a fresh session, before the guest touches
    /// the device); true resumes from what an earlier process of the same
    /// device left in it (after the session's DMA maps, interrupts and
    /// configuration are in place again). `mem` comes from a client: what is
    /// read from it is validated. An error leaves the device as it was.
    fn adopt_state(&self, _mem: state::StateMemory, _resume: bool) -> Result<()> {
        Err(Error::Host(format!("{} keeps no state memory", self.name())))
    }
    /// Configuration-space read. A model that keeps its own configuration
    /// space (a proxy for a device in another process) answers and returns
    /// true; the default leaves it to the host's header built from
    /// [`ids`](Self::ids) and [`bars`](Self::bars).
    fn config_read(&self, _offset: usize, _data: &mut [u8]) -> bool {
        false
    }
    /// Configuration-space write, after the host's header has taken it.
    fn config_write(&self, _offset: usize, _data: &[u8]) {}
    /// PCI capabilities, each at the `Capability::offset` the device chose (MSI-X...).
    fn capabilities(&self) -> Vec<pci::Capability> {
        Vec::new()
    }
    /// Parts of BARs that are plain memory the device shares (a doorbell
    /// page it polls): the host maps them into the guest where the BAR
    /// sits, so guest stores there never exit (vfio-user sparse mmap).
    fn mapped_areas(&self) -> Vec<MappedArea> {
        Vec::new()
    }
    /// True if the model hands guest RAM to another process (a proxy for
    /// a device process): the host must then back guest RAM with an fd it
    /// can pass. Otherwise the host may use anonymous memory, in
    /// transparent huge pages.
    fn shares_guest_ram(&self) -> bool {
        false
    }
}

/// The same methods as [`DeviceModel`] with `&mut self`, for a model whose
/// whole state sits behind one lock: `Mutex<T>` is then the [`DeviceModel`].
pub trait DeviceModelMut: Send {
    fn name(&self) -> String;
    fn ids(&self) -> PciIds;
    fn bars(&self) -> Vec<BarSpec>;
    fn attach(&mut self, ctx: DeviceContext);
    fn bar_read(&mut self, bar: u8, offset: u64, data: &mut [u8]);
    fn bar_write(&mut self, bar: u8, offset: u64, data: &[u8]);
    fn reset(&mut self) {}
    fn quiesce(&mut self) {}
    fn new_client(&mut self) {}
    fn counters(&self) -> Vec<Counter>;
    fn config_read(&mut self, _offset: usize, _data: &mut [u8]) -> bool {
        false
    }
    fn config_write(&mut self, _offset: usize, _data: &[u8]) {}
    fn capabilities(&self) -> Vec<pci::Capability> {
        Vec::new()
    }
    fn mapped_areas(&self) -> Vec<MappedArea> {
        Vec::new()
    }
    fn shares_guest_ram(&self) -> bool {
        false
    }
}

impl<T: DeviceModelMut> DeviceModel for std::sync::Mutex<T> {
    fn name(&self) -> String {
        lock(self).name()
    }
    fn ids(&self) -> PciIds {
        lock(self).ids()
    }
    fn bars(&self) -> Vec<BarSpec> {
        lock(self).bars()
    }
    fn attach(&self, ctx: DeviceContext) {
        lock(self).attach(ctx)
    }
    fn bar_read(&self, bar: u8, offset: u64, data: &mut [u8]) {
        lock(self).bar_read(bar, offset, data)
    }
    fn bar_write(&self, bar: u8, offset: u64, data: &[u8]) {
        lock(self).bar_write(bar, offset, data)
    }
    fn reset(&self) {
        lock(self).reset()
    }
    fn quiesce(&self) {
        lock(self).quiesce()
    }
    fn new_client(&self) {
        lock(self).new_client()
    }
    fn counters(&self) -> Vec<Counter> {
        lock(self).counters()
    }
    fn config_read(&self, offset: usize, data: &mut [u8]) -> bool {
        lock(self).config_read(offset, data)
    }
    fn config_write(&self, offset: usize, data: &[u8]) {
        lock(self).config_write(offset, data)
    }
    fn capabilities(&self) -> Vec<pci::Capability> {
        lock(self).capabilities()
    }
    fn mapped_areas(&self) -> Vec<MappedArea> {
        lock(self).mapped_areas()
    }
    fn shares_guest_ram(&self) -> bool {
        lock(self).shares_guest_ram()
    }
}

/// Locks a `Mutex`: the one way non-test code of the workspace takes one.
///
/// The lock-poison policy: a panic is a bug that may leave the state behind
/// a lock half updated, so that state is never used again. In iopath's own
/// processes the panic hook (`cli`'s `end_on_panic`, docs/TRUST.md) ends the
/// process with status 101 on the panicking thread, before it unwinds and
/// poisons anything, so no live thread ever meets a poisoned lock there. In
/// a process without that hook (a library user's, a test), a thread that
/// finds the lock poisoned panics in turn rather than go on with the
/// half-updated state.
pub fn lock<T: ?Sized>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|_| poisoned("a Mutex"))
}

/// The poison policy's panic (see [`lock`]).
#[cold]
fn poisoned(what: &str) -> ! {
    panic!("{what} was poisoned by a panic on another thread")
}

/// Waits on `cv` with `g` (at most `timeout`, if given), with [`lock`]'s
/// poison policy for the lock it takes again.
pub fn wait<'a, T>(
    cv: &std::sync::Condvar,
    g: std::sync::MutexGuard<'a, T>,
    timeout: Option<std::time::Duration>,
) -> std::sync::MutexGuard<'a, T> {
    match timeout {
        None => cv.wait(g).unwrap_or_else(|_| poisoned("a Mutex")),
        Some(t) => cv.wait_timeout(g, t).unwrap_or_else(|_| poisoned("a Mutex")).0,
    }
}

/// Read-locks an `RwLock`, with [`lock`]'s poison policy.
pub fn read<T: ?Sized>(m: &std::sync::RwLock<T>) -> std::sync::RwLockReadGuard<'_, T> {
    m.read().unwrap_or_else(|_| poisoned("an RwLock"))
}

/// Write-locks an `RwLock`, with [`lock`]'s poison policy.
pub fn write<T: ?Sized>(m: &std::sync::RwLock<T>) -> std::sync::RwLockWriteGuard<'_, T> {
    m.write().unwrap_or_else(|_| poisoned("an RwLock"))
}

/// A device model shared by its host's bus entries and threads.
pub type SharedDevice = std::sync::Arc<dyn DeviceModel>;

/// Little-endian value of an access of 1..=8 bytes.
pub fn le_value(data: &[u8]) -> u64 {
    let mut b = [0u8; 8];
    let n = data.len().min(8);
    b[..n].copy_from_slice(&data[..n]);
    u64::from_le_bytes(b)
}

/// Fills an access of 1..=8 bytes with the low bytes of `v`.
pub fn le_fill(data: &mut [u8], v: u64) {
    let b = v.to_le_bytes();
    for (i, d) in data.iter_mut().enumerate() {
        *d = if i < 8 { b[i] } else { 0xff };
    }
}

/// Reads `data.len()` bytes at `offset` of a little-endian register file,
/// all-ones past its end.
pub fn read_regs(regs: &[u8], offset: u64, data: &mut [u8]) {
    for (i, d) in data.iter_mut().enumerate() {
        *d = offset
            .checked_add(i as u64)
            .and_then(|o| usize::try_from(o).ok())
            .and_then(|o| regs.get(o).copied())
            .unwrap_or(0xff);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn le_helpers() {
        assert_eq!(le_value(&[0x34, 0x12]), 0x1234);
        let mut d = [0u8; 4];
        le_fill(&mut d, 0xaabbccdd);
        assert_eq!(d, [0xdd, 0xcc, 0xbb, 0xaa]);
        let mut r = [0u8; 4];
        read_regs(&[1, 2, 3], 1, &mut r);
        assert_eq!(r, [2, 3, 0xff, 0xff]);
        read_regs(&[1, 2, 3], u64::MAX, &mut r);
        assert_eq!(r, [0xff; 4]);
    }

    /// The poison policy: a lock a panic left poisoned is never used again;
    /// `lock`, `read` and `write` panic where `std` would hand out the state.
    #[test]
    fn a_poisoned_lock_panics_rather_than_hand_out_its_state() {
        use std::panic::{catch_unwind, AssertUnwindSafe};
        use std::sync::{Mutex, RwLock};
        let (m, rw) = (Mutex::new(1), RwLock::new(1));
        assert_eq!(*lock(&m), 1);
        assert_eq!(*read(&rw), 1);
        assert_eq!(*write(&rw), 1);
        std::thread::scope(|s| {
            let _ = s
                .spawn(|| {
                    let (_g, _w) = (lock(&m), write(&rw));
                    panic!("a bug while holding both (this panic is the test's)");
                })
                .join();
        });
        assert!(m.is_poisoned() && rw.is_poisoned());
        assert!(catch_unwind(AssertUnwindSafe(|| drop(lock(&m)))).is_err(), "lock");
        assert!(catch_unwind(AssertUnwindSafe(|| drop(read(&rw)))).is_err(), "read");
        assert!(catch_unwind(AssertUnwindSafe(|| drop(write(&rw)))).is_err(), "write");
    }
}
