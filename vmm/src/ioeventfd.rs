//! KVM ioeventfd for device models hosted in the VMM.
//!
//! A device asks for an ioeventfd in BAR terms ([`IoEventSpec`]); this file
//! turns it into a `KVM_IOEVENTFD` at the BAR's current guest address and
//! moves it when the guest moves the BAR. The ioctl is issued directly (not
//! through `VmFd::register_ioevent`) because the field's tests need a
//! 1-byte wildcard ioeventfd, as QEMU's pci-testdev registers it; kvm-ioctls
//! can only express a wildcard as length 0 (any length), which KVM routes
//! through its faster FAST_MMIO bus and would not be the same measurement.

use crate::bar_area::BarAreas;
use iopath_devices::lock;
use iopath_devices::pci::BarPlacement;
use iopath_devices::{BarKind, Error as DevError, IoEventSpec, IoEvents};
use kvm_bindings::kvm_ioeventfd;
use kvm_ioctls::VmFd;
use std::os::unix::io::AsRawFd;
use std::sync::{Arc, Mutex, OnceLock};
use vmm_sys_util::eventfd::EventFd;
use vmm_sys_util::ioctl::ioctl_with_ref;
use vmm_sys_util::ioctl_iow_nr;

const KVMIO: u32 = 0xAE;
ioctl_iow_nr!(KVM_IOEVENTFD, KVMIO, 0x79, kvm_ioeventfd);

pub const KVM_IOEVENTFD_FLAG_DATAMATCH: u32 = 1 << 0;
pub const KVM_IOEVENTFD_FLAG_PIO: u32 = 1 << 1;
pub const KVM_IOEVENTFD_FLAG_DEASSIGN: u32 = 1 << 2;

/// Why an ioeventfd could not be (de)assigned.
#[derive(Debug, thiserror::Error)]
pub enum IoEventFdError {
    #[error("invalid ioeventfd length {0} (0, 1, 2, 4 or 8; 0 only without datamatch)")]
    Length(u32),
    #[error("ioeventfd at BAR{bar} offset {offset:#x} is outside the BAR")]
    OutsideBar { bar: u8, offset: u64 },
    #[error("KVM_IOEVENTFD {} {}{addr:#x} len {len}: {source}", if *.assign { "assign" } else { "deassign" }, if *.pio { "port " } else { "mmio " })]
    Ioctl {
        assign: bool,
        pio: bool,
        addr: u64,
        len: u32,
        #[source]
        source: std::io::Error,
    },
}

/// Assigns or deassigns one ioeventfd at an absolute address.
pub fn kvm_ioeventfd(
    vm: &VmFd,
    addr: u64,
    pio: bool,
    len: u32,
    datamatch: Option<u64>,
    fd: &EventFd,
    assign: bool,
) -> Result<(), IoEventFdError> {
    if ![0, 1, 2, 4, 8].contains(&len) || (len == 0 && datamatch.is_some()) {
        return Err(IoEventFdError::Length(len));
    }
    let mut flags = 0;
    if datamatch.is_some() {
        flags |= KVM_IOEVENTFD_FLAG_DATAMATCH;
    }
    if pio {
        flags |= KVM_IOEVENTFD_FLAG_PIO;
    }
    if !assign {
        flags |= KVM_IOEVENTFD_FLAG_DEASSIGN;
    }
    let arg =
        kvm_ioeventfd { datamatch: datamatch.unwrap_or(0), addr, len, fd: fd.as_raw_fd(), flags, ..Default::default() };
    // SAFETY: the ioctl reads a kvm_ioeventfd we own; the fd outlives the call.
    let ret = unsafe { ioctl_with_ref(vm, KVM_IOEVENTFD(), &arg) };
    if ret < 0 {
        return Err(IoEventFdError::Ioctl { assign, pio, addr, len, source: std::io::Error::last_os_error() });
    }
    Ok(())
}

struct Registration {
    spec: IoEventSpec,
    fd: EventFd,
    /// Where it is assigned in KVM now (None while the BAR does not decode).
    at: Option<(u64, bool)>,
}

/// The [`IoEvents`] of one PCI device hosted in the VMM: its ioeventfds,
/// and the traps on the BAR areas it shares as memory.
pub struct KvmIoEvents {
    vm: Arc<VmFd>,
    state: Mutex<State>,
    /// The device's shared BAR areas, once the PCI host has mapped them.
    areas: OnceLock<Arc<BarAreas>>,
}

struct State {
    bars: [Option<BarPlacement>; 6],
    regs: Vec<Registration>,
}

impl KvmIoEvents {
    pub fn new(vm: Arc<VmFd>) -> Self {
        KvmIoEvents { vm, state: Mutex::new(State { bars: [None; 6], regs: Vec::new() }), areas: OnceLock::new() }
    }

    /// The device's shared BAR areas (the PCI host gives them once).
    pub fn set_areas(&self, areas: Arc<BarAreas>) {
        if self.areas.set(areas).is_err() {
            log::warn!("a device's BAR areas were given twice; the first stay");
        }
    }

    fn target(bars: &[Option<BarPlacement>; 6], spec: &IoEventSpec) -> Result<Option<(u64, bool)>, IoEventFdError> {
        let Some(p) = bars.get(spec.bar as usize).copied().flatten() else { return Ok(None) };
        let end = spec.offset.checked_add(spec.len.max(1) as u64);
        if end.is_none_or(|e| e > p.spec.size) {
            return Err(IoEventFdError::OutsideBar { bar: spec.bar, offset: spec.offset });
        }
        Ok(Some((p.addr + spec.offset, p.spec.kind == BarKind::Io)))
    }

    /// The PCI host calls this when a BAR starts or stops decoding or moves.
    pub fn bar_moved(&self, bar: u8, placement: Option<BarPlacement>) {
        let mut st = lock(&self.state);
        if let Some(slot) = st.bars.get_mut(bar as usize) {
            *slot = placement;
        }
        let bars = st.bars;
        for r in st.regs.iter_mut().filter(|r| r.spec.bar == bar) {
            if let Some((addr, pio)) = r.at.take() {
                if let Err(e) = kvm_ioeventfd(&self.vm, addr, pio, r.spec.len, r.spec.datamatch, &r.fd, false) {
                    log::warn!("moving BAR{bar}: {e}");
                }
            }
            match Self::target(&bars, &r.spec) {
                Ok(Some((addr, pio))) => {
                    match kvm_ioeventfd(&self.vm, addr, pio, r.spec.len, r.spec.datamatch, &r.fd, true) {
                        Ok(()) => r.at = Some((addr, pio)),
                        Err(e) => log::warn!("moving BAR{bar}: {e}"),
                    }
                }
                Ok(None) => {}
                Err(e) => log::warn!("moving BAR{bar}: {e}"),
            }
        }
    }
}

impl IoEvents for KvmIoEvents {
    fn register(&self, spec: IoEventSpec, fd: &EventFd) -> iopath_devices::Result<()> {
        let mut st = lock(&self.state);
        let at = Self::target(&st.bars, &spec).map_err(|e| DevError::Host(e.to_string()))?;
        let at = match at {
            Some((addr, pio)) => {
                kvm_ioeventfd(&self.vm, addr, pio, spec.len, spec.datamatch, fd, true)
                    .map_err(|e| DevError::Host(e.to_string()))?;
                Some((addr, pio))
            }
            None => None,
        };
        let fd = fd.try_clone().map_err(|e| DevError::io("dup of an ioeventfd", e))?;
        st.regs.push(Registration { spec, fd, at });
        Ok(())
    }

    fn unregister(&self, spec: IoEventSpec, _fd: &EventFd) -> iopath_devices::Result<()> {
        let mut st = lock(&self.state);
        // KVM refuses two assignments of one spec, so the spec names the registration.
        let pos = st.regs.iter().position(|r| r.spec == spec).ok_or_else(|| {
            DevError::Host(format!("no ioeventfd registered at BAR{} offset {:#x}", spec.bar, spec.offset))
        })?;
        let r = st.regs.remove(pos);
        if let Some((addr, pio)) = r.at {
            kvm_ioeventfd(&self.vm, addr, pio, spec.len, spec.datamatch, &r.fd, false)
                .map_err(|e| DevError::Host(e.to_string()))?;
        }
        Ok(())
    }

    /// A shared BAR area taken out of the guest (its memslot removed, so its
    /// accesses exit to the device's `bar_write`) or put back.
    fn trap_area(&self, bar: u8, offset: u64, trap: bool) -> bool {
        self.areas.get().is_some_and(|a| a.set_trap(bar, offset, trap))
    }

    /// A shared BAR area's memory replaced by `area`'s fd (a new device
    /// process's page), mapped here first; its trap stays as it was.
    fn replace_area(&self, area: iopath_devices::MappedArea) -> bool {
        let Some(areas) = self.areas.get() else { return false };
        match crate::bar_area::map_area(area.fd, area.fd_offset, area.size) {
            Ok(map) => areas.replace(area.bar, area.offset, map),
            Err(e) => {
                log::warn!("BAR{} area at {:#x}: {e}", area.bar, area.offset);
                false
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use iopath_devices::BarSpec;
    use kvm_ioctls::Kvm;

    fn vm() -> Arc<VmFd> {
        assert!(std::path::Path::new("/dev/kvm").exists(), "/dev/kvm is missing");
        Arc::new(Kvm::new().unwrap().create_vm().unwrap())
    }

    fn io_bar(addr: u64) -> Option<BarPlacement> {
        Some(BarPlacement { spec: BarSpec { index: 1, kind: BarKind::Io, size: 0x100 }, addr })
    }

    #[test]
    fn registrations_follow_the_bar_and_stay_inside_it() {
        let io = KvmIoEvents::new(vm());
        let fd = EventFd::new(0).unwrap();
        let spec = IoEventSpec { bar: 1, offset: 0x83, len: 1, datamatch: Some(0xfa) };
        // Before the BAR decodes, the registration is remembered, not assigned.
        io.register(spec, &fd).unwrap();
        io.bar_moved(1, io_bar(0xc000));
        // KVM now holds it at 0xc083: the same assignment again collides.
        assert!(kvm_ioeventfd(&io.vm, 0xc083, true, 1, Some(0xfa), &fd, true).is_err());
        io.bar_moved(1, io_bar(0xd000));
        assert!(kvm_ioeventfd(&io.vm, 0xc083, true, 1, Some(0xfa), &fd, true).is_ok(), "old address released");
        kvm_ioeventfd(&io.vm, 0xc083, true, 1, Some(0xfa), &fd, false).unwrap();
        io.unregister(spec, &fd).unwrap();
        assert!(io.unregister(spec, &fd).is_err(), "already removed");
        let outside = IoEventSpec { bar: 1, offset: 0xff, len: 4, datamatch: None };
        assert!(io.register(outside, &fd).is_err());
        assert!(kvm_ioeventfd(&io.vm, 0xc000, true, 3, None, &fd, true).is_err(), "length 3");
        assert!(kvm_ioeventfd(&io.vm, 0xc000, true, 0, Some(1), &fd, true).is_err(), "len 0 with datamatch");
    }
}
