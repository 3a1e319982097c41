//! PIO and MMIO buses: a range map from guest address to device.
//!
//! A bus is read-locked on every access and write-locked only when the guest
//! moves a BAR. An entry is called with `&self`: a BAR entry goes straight to
//! the device model, which takes the one lock it needs; the VMM's own small
//! devices (serial, PCI host) are a [`BusDeviceMut`] in a `Mutex`. Accesses
//! nobody claims are counted by the caller (the vCPU loop).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, RwLock};

/// A device on a bus. `offset` is relative to the base it was inserted at.
pub trait BusDevice: Send + Sync {
    fn read(&self, offset: u64, data: &mut [u8]);
    fn write(&self, offset: u64, data: &[u8]);
}

/// A bus device whose state sits behind one lock: `Mutex<T>` is the [`BusDevice`].
pub trait BusDeviceMut: Send {
    fn read(&mut self, offset: u64, data: &mut [u8]);
    fn write(&mut self, offset: u64, data: &[u8]);
}

impl<T: BusDeviceMut> BusDevice for Mutex<T> {
    fn read(&self, offset: u64, data: &mut [u8]) {
        iopath_devices::lock(self).read(offset, data)
    }
    fn write(&self, offset: u64, data: &[u8]) {
        iopath_devices::lock(self).write(offset, data)
    }
}

pub type SharedBusDevice = Arc<dyn BusDevice>;

#[derive(Debug, PartialEq, Eq, thiserror::Error)]
#[error("range {base:#x}+{len:#x} overlaps a device already on the bus")]
pub struct Overlap {
    pub base: u64,
    pub len: u64,
}

#[derive(Default)]
pub struct Bus {
    map: RwLock<BTreeMap<u64, (u64, SharedBusDevice)>>,
}

impl Bus {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn insert(&self, base: u64, len: u64, dev: SharedBusDevice) -> Result<(), Overlap> {
        let err = Overlap { base, len };
        let end = base.checked_add(len).filter(|_| len > 0).ok_or(Overlap { base, len })?;
        let mut m = iopath_devices::write(&self.map);
        if let Some((b, (l, _))) = m.range(..end).next_back() {
            if b + l > base {
                return Err(err);
            }
        }
        m.insert(base, (len, dev));
        Ok(())
    }

    /// Removes every range: the bus lets go of its devices (and whatever
    /// they hold: the PCI host holds the buses, so this breaks that cycle).
    pub fn clear(&self) {
        let map = std::mem::take(&mut *iopath_devices::write(&self.map));
        drop(map); // outside the lock: a device's drop may look at the bus
    }

    pub fn remove(&self, base: u64) -> bool {
        iopath_devices::write(&self.map).remove(&base).is_some()
    }

    /// The device whose range holds all of `addr..addr+len`, with the offset.
    pub fn resolve(&self, addr: u64, len: usize) -> Option<(u64, SharedBusDevice)> {
        let m = iopath_devices::read(&self.map);
        let (base, (size, dev)) = m.range(..=addr).next_back()?;
        let off = addr - base;
        (off.checked_add(len as u64)? <= *size).then(|| (off, dev.clone()))
    }

    /// Returns false when no device claims the access (the caller counts it).
    pub fn read(&self, addr: u64, data: &mut [u8]) -> bool {
        match self.resolve(addr, data.len()) {
            Some((off, dev)) => {
                dev.read(off, data);
                true
            }
            None => false,
        }
    }

    pub fn write(&self, addr: u64, data: &[u8]) -> bool {
        match self.resolve(addr, data.len()) {
            Some((off, dev)) => {
                dev.write(off, data);
                true
            }
            None => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Default)]
    struct Reg {
        last: Option<(u64, Vec<u8>)>,
    }
    impl BusDeviceMut for Reg {
        fn read(&mut self, offset: u64, data: &mut [u8]) {
            data.fill(offset as u8);
        }
        fn write(&mut self, offset: u64, data: &[u8]) {
            self.last = Some((offset, data.to_vec()));
        }
    }

    #[test]
    fn dispatch_by_range_with_offsets() {
        let bus = Bus::new();
        let a = Arc::new(Mutex::new(Reg::default()));
        bus.insert(0x1000, 0x100, a.clone()).unwrap();
        bus.insert(0x1100, 0x10, Arc::new(Mutex::new(Reg::default()))).unwrap();
        let mut d = [0u8; 4];
        assert!(bus.read(0x1010, &mut d));
        assert_eq!(d, [0x10; 4]);
        assert!(bus.write(0x10fc, &[1, 2, 3, 4]));
        assert_eq!(a.lock().unwrap().last, Some((0xfc, vec![1, 2, 3, 4])));
        // Straddling the end of a range, or nothing there: not claimed.
        assert!(!bus.write(0x10fe, &[0; 4]));
        assert!(!bus.read(0xfff, &mut d));
        assert!(!bus.read(0x1110, &mut d));
        assert!(!bus.read(u64::MAX, &mut d));
    }

    #[test]
    fn overlaps_are_refused_and_removal_works() {
        let bus = Bus::new();
        let dev = || -> SharedBusDevice { Arc::new(Mutex::new(Reg::default())) };
        bus.insert(0x100, 0x100, dev()).unwrap();
        assert!(bus.insert(0x80, 0x81, dev()).is_err());
        assert!(bus.insert(0x1ff, 1, dev()).is_err());
        assert!(bus.insert(0x150, 0x10, dev()).is_err());
        assert!(bus.insert(0, 0, dev()).is_err(), "empty range");
        assert!(bus.insert(u64::MAX, 2, dev()).is_err(), "wrapping range");
        bus.insert(0x200, 0x10, dev()).unwrap();
        bus.insert(0x80, 0x80, dev()).unwrap();
        assert!(bus.remove(0x100));
        assert!(!bus.write(0x100, &[0]));
        bus.insert(0x100, 0x100, dev()).unwrap();
    }
}
