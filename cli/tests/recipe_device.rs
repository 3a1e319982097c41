//! The "How to add a device" recipe (docs/ARCHITECTURE.md), checked: a PCI device that lives
//! in the tests only (`common/scratch.rs`), an implementation of `DeviceModelMut` and nothing
//! else, runs in iopath's VMM and is served over vfio-user from this process to the VMM's
//! proxy, with iopath's guest image making real accesses to its BAR (`workload=pci`, which
//! finds any function by its ids). No file of the library names it: if this test needs a
//! library edit to build or pass, the recipe is wrong. On the real /dev/kvm.

#[path = "common/scratch.rs"]
mod scratch;

use iopath_protocols::function::PciFunction;
use iopath_protocols::vfio_user::VfioUser;
use iopath_protocols::FunctionTransport;
use scratch::{check_device, counter, guest_accesses, Scratch};
use std::os::unix::net::UnixStream;
use std::sync::{Arc, Mutex};

#[test]
fn a_device_defined_in_a_test_runs_in_the_vmm_with_the_guest_image() {
    let dev = Arc::new(Mutex::new(Scratch::default()));
    let r = guest_accesses(dev.clone());
    check_device(&dev);
    // The VMM's report carries the device's counters and where it placed the BAR.
    assert_eq!(r.devices.len(), 1);
    assert_eq!(r.devices[0].name, "scratch");
    assert_eq!(counter(&r.devices[0].counters, "writes"), 2);
    assert_eq!(r.exits.unclaimed_mmio_write, 0);
    eprintln!("in the VMM: {:?}", r.devices[0].counters);
}

#[test]
fn a_device_defined_in_a_test_is_served_over_vfio_user_to_the_vmm() {
    let dev = Arc::new(Mutex::new(Scratch::default()));
    // The device side, in this process: the vfio-user server of the function, one session on a
    // socketpair. The VMM side: the vfio-user proxy on the other end.
    let f = Arc::new(Mutex::new(PciFunction::new(dev.clone()).unwrap()));
    let mut server = VfioUser.server(f, iopath_devices::irq::IrqLines::new()).unwrap();
    let (vmm_end, device_end) = UnixStream::pair().unwrap();
    let session = std::thread::spawn(move || server.session(&device_end, "the test's VMM").map_err(|e| e.to_string()));
    let proxy = VfioUser.connect(vmm_end, None, "scratch@vfio-user").unwrap();
    let r = guest_accesses(proxy);
    // The VM is gone, and with it the proxy's socket: the session ends cleanly.
    session.join().unwrap().unwrap();
    check_device(&dev);
    // Every access crossed the socket: at least one message each.
    let (crossings, _) = VfioUser.crossings();
    assert!(counter(&r.devices[0].counters, crossings) >= 8, "{:?}", r.devices[0].counters);
    eprintln!("over vfio-user: {:?}", r.devices[0].counters);
}
