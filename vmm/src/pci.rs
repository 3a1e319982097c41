//! The PCI host: type-1 configuration access through 0xCF8 (address) and
//! 0xCFC..0xCFF (data), bus 0 only, a host bridge at 00:00.0 and one device
//! per slot after it. When a configuration write changes a BAR or the
//! command register's decode bits, the BAR is unmapped from / mapped onto the
//! PIO or MMIO bus and its KVM ioeventfds follow it.
//!
//! BAR placement: with `place_bars`, the VMM assigns addresses as firmware
//! would (32- and 64-bit memory BARs in [0xE000_0000, 0xFEC0_0000), I/O BARs
//! from 0xC000) and enables decoding; otherwise the guest assigns them.

use crate::bar::BarPort;
use crate::bar_area::{BarAreas, RamArea};
use crate::bus::{Bus, BusDeviceMut};
use crate::ioeventfd::KvmIoEvents;
use iopath_devices::pci::{BarPlacement, ConfigSpace, PCI_COMMAND_IO, PCI_COMMAND_MEMORY};
use iopath_devices::SharedDevice;
use iopath_devices::{BarKind, PciIds};
use std::sync::Arc;

pub const CONFIG_ADDRESS: u64 = 0xcf8;

#[derive(Debug, thiserror::Error)]
pub enum PciError {
    #[error("PCI bus 0 is full")]
    BusFull,
    #[error("no room for BAR{bar} ({size:#x} bytes) of device {dev}")]
    NoRoom { dev: usize, bar: u8, size: u64 },
    #[error("{0}")]
    Header(#[from] iopath_devices::Error),
}
pub const MMIO_WINDOW: (u64, u64) = (0xe000_0000, 0xfec0_0000);
pub const IO_WINDOW: (u64, u64) = (0xc000, 0x1_0000);

struct Slot {
    config: ConfigSpace,
    device: Option<SharedDevice>,
    ioevents: Option<Arc<KvmIoEvents>>,
    mapped: [Option<BarPlacement>; 6],
    /// Parts of BARs that are shared memory, mapped into the guest as KVM
    /// memslots (shared with the device's `KvmIoEvents`, which traps them).
    areas: Option<Arc<BarAreas>>,
}

pub struct PciHost {
    address: u32,
    slots: Vec<Slot>,
    pio: Arc<Bus>,
    mmio: Arc<Bus>,
    /// Where BAR memory areas become KVM memslots (slot 0 is guest RAM).
    vm: Option<Arc<kvm_ioctls::VmFd>>,
    next_kvm_slot: u32,
    /// Config accesses to absent devices (reads return all-ones).
    pub absent_accesses: u64,
}

fn host_bridge() -> ConfigSpace {
    let ids = PciIds {
        vendor: 0x1b36,
        device: 0x0008,
        class: 0x060000,
        revision: 0,
        subsystem_vendor: 0,
        subsystem: 0,
        interrupt_pin: 0,
    };
    ConfigSpace::new(ids, &[]).expect("host bridge has no BARs")
}

impl PciHost {
    pub fn new(pio: Arc<Bus>, mmio: Arc<Bus>) -> Self {
        let bridge = Slot { config: host_bridge(), device: None, ioevents: None, mapped: [None; 6], areas: None };
        PciHost { address: 0, slots: vec![bridge], pio, mmio, vm: None, next_kvm_slot: 1, absent_accesses: 0 }
    }

    /// Lets BAR memory areas be mapped into the guest (KVM memslots).
    pub fn set_vm(&mut self, vm: Arc<kvm_ioctls::VmFd>) {
        self.vm = Some(vm);
    }

    /// Adds a device at the next slot; returns its device number.
    pub fn add(&mut self, device: SharedDevice, ioevents: Option<Arc<KvmIoEvents>>) -> Result<u8, PciError> {
        if self.slots.len() >= 32 {
            return Err(PciError::BusFull);
        }
        let (ids, bars, caps, areas) = (device.ids(), device.bars(), device.capabilities(), device.mapped_areas());
        let mut config = ConfigSpace::new(ids, &bars)?;
        config.add_capabilities(&caps)?;
        let mut ram = Vec::new();
        for a in areas.into_iter().filter(|_| self.vm.is_some()) {
            let fits =
                bars.iter().any(|b| b.index == a.bar && a.offset.checked_add(a.size).is_some_and(|e| e <= b.size));
            let long_enough =
                a.fd.metadata().is_ok_and(|m| a.fd_offset.checked_add(a.size).is_some_and(|e| e <= m.len()));
            if !fits || !long_enough || a.offset % 4096 != 0 || a.size % 4096 != 0 || a.size == 0 {
                log::warn!(
                    "{}: BAR{} area at {:#x}+{:#x} cannot be mapped; its accesses exit",
                    ids.vendor,
                    a.bar,
                    a.offset,
                    a.size
                );
                continue;
            }
            let fo = vm_memory::FileOffset::new(a.fd, a.fd_offset);
            match vm_memory::MmapRegion::from_file(fo, a.size as usize) {
                Ok(map) => {
                    ram.push(RamArea::new(a.bar, a.offset, map, self.next_kvm_slot));
                    self.next_kvm_slot += 1;
                }
                Err(e) => log::warn!("BAR{} area: mmap: {e}; its accesses exit", a.bar),
            }
        }
        let areas = match (&self.vm, ram.is_empty()) {
            (Some(vm), false) => Some(Arc::new(BarAreas::new(vm.clone(), ram))),
            _ => None,
        };
        if let (Some(io), Some(a)) = (&ioevents, &areas) {
            io.set_areas(a.clone());
        }
        self.slots.push(Slot { config, device: Some(device), ioevents, mapped: [None; 6], areas });
        Ok((self.slots.len() - 1) as u8)
    }

    /// Assigns every BAR as firmware would and enables decoding.
    pub fn place_bars(&mut self) -> Result<(), PciError> {
        let (mut mem, mut io) = (MMIO_WINDOW.0, IO_WINDOW.0);
        for dev in 0..self.slots.len() {
            let specs: Vec<_> = self.slots[dev].config.bar_specs().collect();
            let mut enable = 0;
            for b in specs {
                let (next, window, bit) = match b.kind {
                    BarKind::Io => (&mut io, IO_WINDOW, PCI_COMMAND_IO),
                    _ => (&mut mem, MMIO_WINDOW, PCI_COMMAND_MEMORY),
                };
                // BAR sizes come from devices, some in other processes: no overflow.
                let end = next.div_ceil(b.size).checked_mul(b.size).and_then(|a| a.checked_add(b.size));
                let Some(addr) = end.filter(|&e| e <= window.1).map(|e| e - b.size) else {
                    return Err(PciError::NoRoom { dev, bar: b.index, size: b.size });
                };
                *next = addr + b.size;
                self.slots[dev].config.set_bar_addr(b.index, addr);
                enable |= bit;
            }
            self.slots[dev].config.enable(enable);
            self.forward_header(dev);
            self.remap(dev);
        }
        Ok(())
    }

    /// Routes the device's INTx to `gsi` in its header.
    pub fn set_intx_line(&mut self, dev: usize, gsi: u8) {
        if let Some(s) = self.slots.get_mut(dev) {
            s.config.set_intx_line(gsi);
            self.forward_header(dev);
        }
    }

    /// Tells a model that keeps its own header (a device in another process)
    /// what the VMM programmed: BARs, interrupt line, then the command register.
    fn forward_header(&mut self, dev: usize) {
        let slot = &self.slots[dev];
        let Some(d) = &slot.device else { return };
        let bars = (0x10..0x28).step_by(4).map(|o| (o, 4));
        for (off, len) in bars.chain([(0x3c, 1), (0x04, 2)]) {
            let mut b = [0u8; 4];
            slot.config.read(off, &mut b[..len]);
            d.config_write(off, &b[..len]);
        }
    }

    /// Current BAR placements of device `dev` (for reports).
    pub fn placements(&self, dev: usize) -> Vec<BarPlacement> {
        self.slots.get(dev).map(|s| s.mapped.iter().flatten().copied().collect()).unwrap_or_default()
    }

    fn remap(&mut self, dev: usize) {
        let slot = &mut self.slots[dev];
        let Some(device) = slot.device.clone() else {
            return;
        };
        for b in slot.config.bar_specs().collect::<Vec<_>>() {
            let i = b.index as usize;
            let new = slot.config.bar_placement(b.index);
            if new == slot.mapped[i] {
                continue;
            }
            if let Some(old) = slot.mapped[i].take() {
                let bus = if old.spec.kind == BarKind::Io { &self.pio } else { &self.mmio };
                bus.remove(old.addr);
            }
            let mut placed = None;
            if let Some(p) = new {
                let bus = if p.spec.kind == BarKind::Io { &self.pio } else { &self.mmio };
                let port = BarPort { device: device.clone(), bar: b.index };
                match bus.insert(p.addr, p.spec.size, Arc::new(port)) {
                    Ok(()) => placed = Some(p),
                    Err(e) => log::warn!("00:{dev:02x}.0 BAR{}: {e}; left unmapped", b.index),
                }
            }
            slot.mapped[i] = placed;
            if let Some(io) = &slot.ioevents {
                io.bar_moved(b.index, placed);
            }
            if let Some(a) = &slot.areas {
                a.bar_moved(b.index, placed);
            }
        }
    }

    fn target(&self) -> Option<(usize, usize)> {
        let a = self.address;
        let (bus, dev, func, reg) = ((a >> 16) & 0xff, (a >> 11) & 0x1f, (a >> 8) & 0x7, (a & 0xfc) as usize);
        (a & 0x8000_0000 != 0 && bus == 0 && func == 0 && (dev as usize) < self.slots.len())
            .then_some((dev as usize, reg))
    }
}

impl BusDeviceMut for PciHost {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        match offset {
            0 if data.len() == 4 => data.copy_from_slice(&self.address.to_le_bytes()),
            4..=7 => match self.target() {
                Some((dev, reg)) => {
                    let off = reg + (offset as usize - 4);
                    let slot = &self.slots[dev];
                    let remote = slot.device.as_ref().is_some_and(|d| d.config_read(off, data));
                    if !remote {
                        slot.config.read(off, data)
                    }
                }
                None => {
                    self.absent_accesses += 1;
                    data.fill(0xff)
                }
            },
            _ => data.fill(0xff),
        }
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        match offset {
            0 if data.len() == 4 => self.address = u32::from_le_bytes(data.try_into().unwrap()),
            4..=7 => match self.target() {
                Some((dev, reg)) => {
                    let off = reg + (offset as usize - 4);
                    let change = self.slots[dev].config.write(off, data);
                    if let Some(d) = &self.slots[dev].device {
                        d.config_write(off, data);
                    }
                    if change.decode {
                        self.remap(dev);
                    }
                }
                None => self.absent_accesses += 1,
            },
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use iopath_devices::testdev::PciTestDev;
    use std::sync::Mutex;

    fn host() -> (PciHost, Arc<Bus>, Arc<Bus>) {
        let (pio, mmio) = (Arc::new(Bus::new()), Arc::new(Bus::new()));
        (PciHost::new(pio.clone(), mmio.clone()), pio, mmio)
    }

    fn cfg_read(h: &mut PciHost, dev: u32, reg: u32) -> u32 {
        h.write(0, &(0x8000_0000 | dev << 11 | reg).to_le_bytes());
        let mut b = [0u8; 4];
        h.read(4, &mut b);
        u32::from_le_bytes(b)
    }

    fn cfg_write(h: &mut PciHost, dev: u32, reg: u32, v: u32) {
        h.write(0, &(0x8000_0000 | dev << 11 | reg).to_le_bytes());
        h.write(4, &v.to_le_bytes());
    }

    fn testdev() -> SharedDevice {
        Arc::new(Mutex::new(PciTestDev::new()))
    }

    #[test]
    fn enumeration_sees_bridge_and_device_and_nothing_else() {
        let (mut h, _, _) = host();
        assert_eq!(h.add(testdev(), None).unwrap(), 1);
        assert_eq!(cfg_read(&mut h, 0, 0), 0x0008_1b36);
        assert_eq!(cfg_read(&mut h, 1, 0), 0x0005_1b36);
        assert_eq!(cfg_read(&mut h, 2, 0), 0xffff_ffff);
        assert_eq!(h.absent_accesses, 1);
        // Byte reads through 0xCFD..0xCFF pick the right lane.
        h.write(0, &(0x8000_0000u32 | 1 << 11).to_le_bytes());
        let mut b = [0u8; 1];
        h.read(6, &mut b);
        assert_eq!(b[0], 0x05);
        // Without the enable bit nothing is addressed.
        h.write(0, &(1u32 << 11).to_le_bytes());
        let mut w = [0u8; 4];
        h.read(4, &mut w);
        assert_eq!(w, [0xff; 4]);
    }

    #[test]
    fn guest_bar_programming_maps_and_unmaps_the_bus() {
        let (mut h, pio, mmio) = host();
        h.add(testdev(), None).unwrap();
        cfg_write(&mut h, 1, 0x10, 0xffff_ffff);
        assert_eq!(cfg_read(&mut h, 1, 0x10), 0xffff_f000, "BAR0 sizes as 4 KiB memory");
        cfg_write(&mut h, 1, 0x10, 0xe000_0000);
        cfg_write(&mut h, 1, 0x14, 0xc001);
        let mut b = [0u8; 1];
        assert!(!mmio.read(0xe000_0001, &mut b), "decode disabled");
        cfg_write(&mut h, 1, 0x04, 0x3);
        assert!(mmio.read(0xe000_0001, &mut b) && pio.read(0xc001, &mut b));
        // Move BAR0: the old range is gone, the new one answers.
        cfg_write(&mut h, 1, 0x10, 0xe010_0000);
        assert!(!mmio.read(0xe000_0001, &mut b));
        assert!(mmio.read(0xe010_0001, &mut b));
        cfg_write(&mut h, 1, 0x04, 0x0);
        assert!(!mmio.read(0xe010_0001, &mut b) && !pio.read(0xc001, &mut b));
    }

    #[test]
    fn firmware_placement_aligns_and_enables() {
        let (mut h, pio, mmio) = host();
        h.add(testdev(), None).unwrap();
        h.add(Arc::new(Mutex::new(iopath_devices::doorbell::Doorbell::new())), None).unwrap();
        h.place_bars().unwrap();
        let p1 = h.placements(1);
        let p2 = h.placements(2);
        assert_eq!(p1.len(), 2);
        assert_eq!(p2.len(), 2);
        for p in p1.iter().chain(&p2) {
            assert_eq!(p.addr % p.spec.size, 0);
        }
        assert_eq!(p2[0].spec.kind, BarKind::Mem64);
        let mut b = [0u8; 4];
        assert!(mmio.read(p2[0].addr, &mut b));
        assert_eq!(u32::from_le_bytes(b), iopath_devices::doorbell::MAGIC);
        assert!(pio.read(p1[1].addr + 1, &mut b[..1]));
        assert_eq!(cfg_read(&mut h, 2, 0x14), 0, "64-bit BAR high half below 4 GiB");
    }
}
