//! A device's interrupts in the VMM: INTx as a KVM irqfd with resample
//! (transport::irq::IrqLines), and MSI-X vectors as KVM irqfds on GSIs whose
//! MSI routes follow the device's MSI-X table. The device writes an eventfd;
//! KVM injects; the VMM's threads are not involved.
//!
//! Masking happens here, as in QEMU and kernel VFIO: a vector whose route is
//! taken away (masked, function masked, MSI-X off) has its irqfd taken out
//! of KVM, so what the device signals meanwhile stays in the eventfd's
//! counter (a PBA read can look there); routed again, the vector goes back
//! into KVM and a signal that waited is delivered once.

use iopath_devices::irq::IrqLines;
use iopath_devices::lock;
use iopath_devices::Interrupts;
use kvm_bindings::{
    kvm_irq_routing_entry, KvmIrqRouting, KVM_IRQCHIP_IOAPIC, KVM_IRQCHIP_PIC_MASTER, KVM_IRQCHIP_PIC_SLAVE,
    KVM_IRQ_ROUTING_IRQCHIP, KVM_IRQ_ROUTING_MSI,
};
use kvm_ioctls::VmFd;
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

/// The VM's GSI routing table: KVM's default irqchip routes plus the MSI
/// routes devices ask for. KVM_SET_GSI_ROUTING replaces the whole table.
pub struct GsiRouter {
    vm: Arc<VmFd>,
    msi: Mutex<BTreeMap<u32, (u64, u32)>>,
}

impl GsiRouter {
    pub fn new(vm: Arc<VmFd>) -> Arc<Self> {
        Arc::new(GsiRouter { vm, msi: Mutex::new(BTreeMap::new()) })
    }

    /// Sets (Some) or removes (None) the MSI route of `gsi`.
    pub fn set(&self, gsi: u32, msg: Option<(u64, u32)>) -> Result<(), crate::VmmError> {
        let mut msi = lock(&self.msi);
        match msg {
            Some(m) => msi.insert(gsi, m),
            None => msi.remove(&gsi),
        };
        let mut entries = Vec::new();
        for pin in 0..24u32 {
            entries.push(irqchip(pin, KVM_IRQCHIP_IOAPIC, pin));
            if pin < 16 {
                let chip = if pin < 8 { KVM_IRQCHIP_PIC_MASTER } else { KVM_IRQCHIP_PIC_SLAVE };
                entries.push(irqchip(pin, chip, pin % 8));
            }
        }
        for (&gsi, &(addr, data)) in msi.iter() {
            let mut e = kvm_irq_routing_entry { gsi, type_: KVM_IRQ_ROUTING_MSI, ..Default::default() };
            e.u.msi.address_lo = addr as u32;
            e.u.msi.address_hi = (addr >> 32) as u32;
            e.u.msi.data = data;
            entries.push(e);
        }
        let mut table = KvmIrqRouting::new(entries.len())
            .map_err(|e| crate::VmmError::Memory(format!("a routing table of {} entries: {e:?}", entries.len())))?;
        table.as_mut_slice().copy_from_slice(&entries);
        self.vm.set_gsi_routing(&table).map_err(|source| crate::VmmError::Kvm { what: "KVM_SET_GSI_ROUTING", source })
    }
}

fn irqchip(gsi: u32, chip: u32, pin: u32) -> kvm_irq_routing_entry {
    let mut e = kvm_irq_routing_entry { gsi, type_: KVM_IRQ_ROUTING_IRQCHIP, ..Default::default() };
    e.u.irqchip.irqchip = chip;
    e.u.irqchip.pin = pin;
    e
}

/// One MSI-X vector: its eventfd, and whether it is routed (its irqfd is
/// in KVM and its GSI has the vector's message).
struct Vector {
    fd: EventFd,
    routed: bool,
}

/// One device's interrupts: INTx lines plus MSI-X vectors on GSIs
/// `base_gsi + vector`.
pub struct VmIrq {
    pub intx: Arc<IrqLines>,
    router: Arc<GsiRouter>,
    vm: Arc<VmFd>,
    base_gsi: u32,
    vectors: Mutex<Vec<Option<Vector>>>,
}

/// GSIs for MSI-X start above the IOAPIC's 24 pins; each device gets 128.
pub const MSI_GSI_BASE: u32 = 32;
pub const MSI_GSIS_PER_DEVICE: u32 = 128;

impl VmIrq {
    pub fn new(vm: Arc<VmFd>, router: Arc<GsiRouter>, intx: Arc<IrqLines>, device_index: u32) -> Self {
        VmIrq {
            intx,
            router,
            vm,
            base_gsi: MSI_GSI_BASE + device_index * MSI_GSIS_PER_DEVICE,
            vectors: Mutex::new(Vec::new()),
        }
    }
}

impl Interrupts for VmIrq {
    fn set_intx(&self, level: bool) {
        Interrupts::set_intx(&*self.intx, level)
    }

    fn signal_msix(&self, vector: u16) -> bool {
        match lock(&self.vectors).get(vector as usize) {
            Some(Some(Vector { fd, routed: true })) => fd.write(1).is_ok(),
            _ => false,
        }
    }

    fn intx_eventfds(&self) -> Option<(EventFd, EventFd)> {
        self.intx.intx_fds()
    }

    fn msix_eventfd(&self, vector: u16) -> Option<EventFd> {
        lock(&self.vectors).get(vector as usize)?.as_ref()?.fd.try_clone().ok()
    }

    /// Routes vector `vector` to `msg`, or masks it (None): its irqfd leaves
    /// KVM and its eventfd keeps what the device signals until it is routed
    /// again, when a signal that waited is delivered once.
    fn msix_route(&self, vector: u16, msg: Option<(u64, u32)>) {
        if vector as u32 >= MSI_GSIS_PER_DEVICE {
            return;
        }
        let gsi = self.base_gsi + vector as u32;
        let mut v = lock(&self.vectors);
        if v.len() <= vector as usize {
            v.resize_with(vector as usize + 1, || None);
        }
        let slot = &mut v[vector as usize];
        let Some(msg) = msg else {
            // Masked: out of KVM first, so nothing the device signals from now on is consumed there.
            if let Some(x) = slot.as_mut().filter(|x| x.routed) {
                if let Err(e) = self.vm.unregister_irqfd(&x.fd, gsi) {
                    log::error!("MSI-X vector {vector}: KVM_IRQFD deassign on GSI {gsi}: {e}");
                }
                x.routed = false;
                if let Err(e) = self.router.set(gsi, None) {
                    log::error!("MSI-X vector {vector}: {e}");
                }
            }
            return;
        };
        if slot.is_none() {
            match EventFd::new(EFD_NONBLOCK) {
                Ok(fd) => *slot = Some(Vector { fd, routed: false }),
                Err(e) => return log::error!("MSI-X vector {vector}: eventfd: {e}"),
            }
        }
        let x = slot.as_mut().unwrap();
        if let Err(e) = self.router.set(gsi, Some(msg)) {
            return log::error!("MSI-X vector {vector}: {e}");
        }
        if x.routed {
            return;
        }
        // What the device signalled while the vector was masked (the fd is non-blocking).
        let waited = x.fd.read().is_ok_and(|n| n > 0);
        if let Err(e) = self.vm.register_irqfd(&x.fd, gsi) {
            return log::error!("MSI-X vector {vector}: KVM_IRQFD on GSI {gsi}: {e}");
        }
        x.routed = true;
        if waited {
            let _ = x.fd.write(1);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lapic_irr(vcpu: &kvm_ioctls::VcpuFd, vector: u8) -> bool {
        let l = vcpu.get_lapic().unwrap();
        let off = 0x200 + (vector as usize / 32) * 16;
        let w = u32::from_le_bytes([
            l.regs[off] as u8,
            l.regs[off + 1] as u8,
            l.regs[off + 2] as u8,
            l.regs[off + 3] as u8,
        ]);
        w & (1 << (vector % 32)) != 0
    }

    /// A VM with an in-kernel irqchip and vCPU 0 whose LAPIC accepts fixed interrupts.
    fn vm_with_lapic() -> (Arc<VmFd>, kvm_ioctls::VcpuFd) {
        assert!(std::path::Path::new("/dev/kvm").exists(), "/dev/kvm is missing");
        let kvm = kvm_ioctls::Kvm::new().unwrap();
        let vm = Arc::new(kvm.create_vm().unwrap());
        vm.create_irq_chip().unwrap();
        let vcpu = vm.create_vcpu(0).unwrap();
        // Software-enable the LAPIC (SVR bit 8).
        let mut l = vcpu.get_lapic().unwrap();
        l.regs[0xf0 + 1] |= 1;
        vcpu.set_lapic(&l).unwrap();
        (vm, vcpu)
    }

    #[test]
    fn an_msix_vector_reaches_the_lapic_through_an_irqfd_and_stops_when_unrouted() {
        let (vm, vcpu) = vm_with_lapic();
        let router = GsiRouter::new(vm.clone());
        let irq = VmIrq::new(vm.clone(), router.clone(), IrqLines::new(), 0);
        assert!(!irq.signal_msix(3), "an unrouted vector does not fire");
        // Destination APIC 0, fixed, vector 0x45.
        irq.msix_route(3, Some((0xfee0_0000, 0x45)));
        assert!(irq.signal_msix(3));
        std::thread::sleep(std::time::Duration::from_millis(20));
        assert!(lapic_irr(&vcpu, 0x45), "vector 0x45 not pending in the LAPIC");
        irq.msix_route(3, None);
        assert!(!irq.signal_msix(3), "masked: the device keeps it pending instead");
        // INTx routes survive a routing-table rewrite.
        let trigger = EventFd::new(EFD_NONBLOCK).unwrap();
        let resample = EventFd::new(EFD_NONBLOCK).unwrap();
        vm.register_irqfd_with_resample(&trigger, &resample, 17).unwrap();
        trigger.write(1).unwrap();
        std::thread::sleep(std::time::Duration::from_millis(20));
        let mut chip = kvm_bindings::kvm_irqchip { chip_id: KVM_IRQCHIP_IOAPIC, ..Default::default() };
        vm.get_irqchip(&mut chip).unwrap();
        // SAFETY: chip_id IOAPIC selects the ioapic member.
        assert_ne!(unsafe { chip.chip.ioapic.irr } & (1 << 17), 0);
    }

    #[test]
    fn a_masked_vector_is_held_in_its_eventfd_and_delivered_once_unmasked() {
        let (vm, vcpu) = vm_with_lapic();
        let irq = VmIrq::new(vm.clone(), GsiRouter::new(vm.clone()), IrqLines::new(), 1);
        let settle = || std::thread::sleep(std::time::Duration::from_millis(20));
        irq.msix_route(2, Some((0xfee0_0000, 0x51)));
        // What a device process holds (vfio-user SET_IRQS).
        let device = irq.msix_eventfd(2).unwrap();
        irq.msix_route(2, None);
        device.write(1).unwrap();
        settle();
        assert!(!lapic_irr(&vcpu, 0x51), "a masked vector reached the guest");
        // The signal waits in the eventfd, where a PBA read finds it (and puts it back).
        assert_eq!(device.read().ok(), Some(1), "the masked vector's signal was lost");
        device.write(1).unwrap();
        // Unmasked (with a new message): delivered once, to the new message.
        irq.msix_route(2, Some((0xfee0_0000, 0x52)));
        settle();
        assert!(lapic_irr(&vcpu, 0x52), "the pending vector was not delivered on unmask");
        assert!(!lapic_irr(&vcpu, 0x51));
        assert!(device.read().is_err(), "delivered, so nothing is left pending");
        // Unmasked again, the device's signals go straight into KVM.
        irq.msix_route(2, Some((0xfee0_0000, 0x53)));
        device.write(1).unwrap();
        settle();
        assert!(lapic_irr(&vcpu, 0x53));
        assert!(device.read().is_err(), "KVM's irqfd took the count");
        // A vector masked with nothing pending delivers nothing when unmasked.
        irq.msix_route(2, None);
        irq.msix_route(2, Some((0xfee0_0000, 0x54)));
        settle();
        assert!(!lapic_irr(&vcpu, 0x54));
    }
}
