//! The exit transport: a BAR access that left KVM (KVM_EXIT_MMIO or
//! KVM_EXIT_IO) is handed to the device model by the vCPU thread itself.

use iopath_devices::DeviceModel;
use std::sync::{Arc, Mutex};

/// A shared, lockable device model.
pub type SharedDevice = Arc<Mutex<Box<dyn DeviceModel>>>;

/// One BAR of one device, as the VMM's bus sees it.
pub struct BarPort {
    pub device: SharedDevice,
    pub bar: u8,
}

impl BarPort {
    pub fn read(&self, offset: u64, data: &mut [u8]) {
        match self.device.lock() {
            Ok(mut d) => d.bar_read(self.bar, offset, data),
            Err(_) => data.fill(0xff),
        }
    }

    pub fn write(&self, offset: u64, data: &[u8]) {
        if let Ok(mut d) = self.device.lock() {
            d.bar_write(self.bar, offset, data)
        }
    }
}
