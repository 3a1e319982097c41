//! The exit path's bus adapter: a BAR access that left KVM (KVM_EXIT_MMIO or
//! KVM_EXIT_IO) is handed to the device model by the vCPU thread itself. The
//! adapter holds no state and takes no lock; the model takes its own.

use crate::bus::BusDevice;
use iopath_devices::SharedDevice;

/// One BAR of one device, as the VMM's bus sees it.
pub struct BarPort {
    pub device: SharedDevice,
    pub bar: u8,
}

impl BusDevice for BarPort {
    fn read(&self, offset: u64, data: &mut [u8]) {
        self.device.bar_read(self.bar, offset, data)
    }

    fn write(&self, offset: u64, data: &[u8]) {
        self.device.bar_write(self.bar, offset, data)
    }
}
