//! Helpers shared by the protocols' tests: what the VMM gives a proxy.

use crate::function::{map_guest_memory, PciFunction, SharedRegion};
use iopath_devices::irq::IrqLines;
use iopath_devices::testdev::PciTestDev;
use iopath_devices::{DeviceContext, Interrupts};
use std::fs::File;
use std::os::fd::FromRawFd;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

/// pci-testdev with its header, as a device process hosts it.
pub fn testdev() -> Arc<Mutex<PciFunction>> {
    Arc::new(Mutex::new(PciFunction::new(Arc::new(Mutex::new(PciTestDev::new()))).unwrap()))
}

/// An empty memfd.
pub fn memfd(name: &str) -> File {
    let name = std::ffi::CString::new(name).unwrap();
    // SAFETY: memfd_create with a valid name; the fd is checked and then owned by the File.
    let fd = unsafe { libc::memfd_create(name.as_ptr(), 0) };
    assert!(fd >= 0);
    // SAFETY: a fresh fd nothing else owns.
    unsafe { File::from_raw_fd(fd) }
}

/// A memfd of `len` bytes sealed against shrinking, as iopath's guest RAM
/// is and as device processes require before they map a client's fd.
pub fn sealed_memfd(name: &str, len: u64) -> File {
    use std::os::fd::AsRawFd;
    let name = std::ffi::CString::new(name).unwrap();
    // SAFETY: memfd_create with a valid name; the fd is checked and then owned by the File.
    let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_ALLOW_SEALING) };
    assert!(fd >= 0);
    // SAFETY: a fresh fd nothing else owns.
    let f = unsafe { File::from_raw_fd(fd) };
    f.set_len(len).unwrap();
    // SAFETY: F_ADD_SEALS on an fd we own.
    assert!(unsafe { libc::fcntl(f.as_raw_fd(), libc::F_ADD_SEALS, libc::F_SEAL_SHRINK) } == 0);
    f
}

/// A memfd-backed guest memory and an INTx pair, as the VMM gives a proxy.
pub fn vmm_context() -> (DeviceContext, EventFd) {
    let memfd = sealed_memfd("ram", 1 << 20);
    let owner = crate::sigbus::Owner::new(None::<&File>).unwrap();
    let (mem, _) =
        map_guest_memory(vec![SharedRegion { gpa: 0, size: 1 << 20, offset: 0, file: memfd }], &owner).unwrap();
    let lines = IrqLines::new();
    let trigger = EventFd::new(EFD_NONBLOCK).unwrap();
    lines.connect_intx(trigger.try_clone().unwrap(), Some(EventFd::new(EFD_NONBLOCK).unwrap()));
    let mut ctx = DeviceContext::detached(mem);
    ctx.irq = lines;
    (ctx, trigger)
}

/// Asserts INTx from the device side and sees it on the VMM's trigger fd.
pub fn device_intx_reaches(device_side: &Arc<IrqLines>, trigger: &EventFd) {
    let t0 = std::time::Instant::now();
    while device_side.intx_eventfds().is_none() {
        assert!(t0.elapsed() < Duration::from_secs(2), "the device process never got the INTx fds");
        std::thread::sleep(Duration::from_millis(5));
    }
    device_side.set_intx(true);
    assert!(iopath_devices::irq::wait_readable(trigger, Duration::from_secs(2)));
    assert_eq!(trigger.read().unwrap(), 1);
}
