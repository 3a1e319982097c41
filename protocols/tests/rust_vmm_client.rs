//! An independent vfio-user client against iopath's server: the rust-vmm
//! `vfio_user` crate's `Client` (Cloud Hypervisor's) connects to
//! `iopath serve DEVICE --transport vfio-user --socket PATH`, run here as
//! the same `serve::run` in a thread, and drives pci-testdev and the NVMe
//! controller through its public API only.
//!
//! Where that client departs from the spec the server accepts it:
//! - VERSION: it proposes minor 1 and `{"max_msg_fds": 1, "max_data_xfer_size":
//!   1048576, "migration": {"pgsize": 4096}}`, then sends SET_IRQS with
//!   more fds than the one it allowed (the server takes up to 16 whatever
//!   it advertised). It cannot parse a reply without JSON.
//! - DEVICE_GET_INFO: argsz 32, its 16-byte header counted.
//! - It reads fixed-size replies without looking at the error flag:
//!   DMA_UNMAP (40 bytes), REGION_READ, GET_IRQ_INFO hang on an error reply,
//!   and DMA_MAP, SET_IRQS and DEVICE_RESET report success whatever the
//!   server said. The checks here therefore look at the device's effects,
//!   and every scenario runs under a deadline.
//! - `resettable()` is the inverse of DEVICE_FLAGS_RESET.

mod common;
use common::{connect, memfd, nvme_enable, nvme_identify, serve, within};
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::time::Duration;
use vfio_user::Client;
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

const CONFIG: u32 = 7;
const REGION_READ: u32 = 1;
const REGION_WRITE: u32 = 2;
const REGION_MMAP: u32 = 4;
const IRQ_EVENTFD: u32 = 1;
const SET_DATA_EVENTFD: u32 = 1 << 2;
const SET_ACTION_TRIGGER: u32 = 1 << 5;

fn read32(c: &mut Client, region: u32, offset: u64) -> u32 {
    let mut b = [0u8; 4];
    c.region_read(region, offset, &mut b).unwrap();
    u32::from_le_bytes(b)
}

#[test]
fn rust_vmm_client_drives_pci_testdev() {
    let (path, server) = serve("pci-testdev", "testdev");
    within("pci-testdev", move || {
        let mut c = connect(&path);
        // Device and region info came with the connection.
        for i in 0..9 {
            let r = c.region(i).unwrap_or_else(|| panic!("region {i}"));
            let size = match i {
                0 => 4096,
                1 | CONFIG => 256,
                _ => 0,
            };
            assert_eq!((r.index, r.size), (i, size), "region {i}");
            let rw = if size > 0 { REGION_READ | REGION_WRITE } else { 0 };
            assert_eq!(r.flags, rw, "region {i}");
            assert!(r.file_offset.is_none() && r.sparse_areas.is_empty());
        }
        assert_eq!(read32(&mut c, CONFIG, 0), 0x0005_1b36, "vendor and device ids");
        assert_eq!(read32(&mut c, CONFIG, 8) >> 8, 0xff0000, "class");
        // BAR0's header: select test 0 (mmio-no-eventfd) and hit it twice.
        c.region_write(0, 0, &[0]).unwrap();
        assert_eq!(read32(&mut c, 0, 0) >> 8 & 0xff, 1, "width");
        assert_eq!(read32(&mut c, 0, 4), 2048, "offset");
        assert_eq!(read32(&mut c, 0, 8), 0xfa, "data");
        let mut name = Vec::new();
        for off in (16..36).step_by(4) {
            name.extend_from_slice(&read32(&mut c, 0, off).to_le_bytes());
        }
        assert!(name.starts_with(b"mmio-no-eventfd\0"), "{:?}", String::from_utf8_lossy(&name));
        c.region_write(0, 2048, &[0xfa]).unwrap();
        c.region_write(0, 2048, &[0xfa]).unwrap();
        assert_eq!(read32(&mut c, 0, 12), 2, "count");
        // The I/O BAR too (1-byte accesses).
        c.region_write(1, 0, &[0]).unwrap();
        let mut b = [0u8; 1];
        c.region_read(1, 1, &mut b).unwrap();
        assert_eq!(b, [1], "width");
        // Guest RAM: map a memfd and take it back (the only map, then two).
        let ram = memfd(2 << 20, true);
        c.dma_map(0, 0x10_0000, 1 << 20, ram.as_raw_fd()).unwrap();
        c.dma_unmap(0x10_0000, 1 << 20).unwrap();
        c.dma_map(1 << 20, 0x20_0000, 1 << 20, ram.as_raw_fd()).unwrap();
        c.dma_map(0, 0x10_0000, 1 << 20, ram.as_raw_fd()).unwrap();
        c.dma_unmap(0x20_0000, 1 << 20).unwrap();
        c.dma_unmap(0x10_0000, 1 << 20).unwrap();
        // Interrupts: INTx (none: pci-testdev's Interrupt Pin is 0, as QEMU's), MSI (none),
        // MSI-X (none), ERR, REQ.
        for (index, count) in [(0, 0), (1, 0), (2, 0), (3, 0), (4, 0)] {
            let i = c.get_irq_info(index).unwrap();
            assert_eq!((i.index, i.count, i.flags & IRQ_EVENTFD), (index, count, IRQ_EVENTFD), "IRQ index {index}");
        }
        let trigger = EventFd::new(EFD_NONBLOCK).unwrap();
        // Refused with an error reply (no INTx vector), which this client does not surface;
        // the session goes on.
        c.set_irqs(0, SET_DATA_EVENTFD | SET_ACTION_TRIGGER, 0, 1, &[trigger.as_raw_fd()]).unwrap();
        // Reset: the test selection goes.
        c.reset().unwrap();
        assert_eq!(read32(&mut c, 0, 12), 0, "no test selected after reset");
        assert_eq!(read32(&mut c, CONFIG, 0), 0x0005_1b36);
        c.shutdown().unwrap();
    });
    server.join().unwrap();
}

/// NVMe queue layout inside the memfd, which sits at `GPA`.
const GPA: u64 = 0x10_0000;
const ASQ: u64 = 0;
const ACQ: u64 = 0x1000;
const IDENT: u64 = 0x2000;

fn nvme(doorbell: &'static str) {
    let (path, server) = serve(&format!("nvme,doorbell={doorbell},size_mb=1"), doorbell);
    within(doorbell, move || {
        let mut c = connect(&path);
        let bar0 = c.region(0).unwrap();
        assert_eq!((bar0.size, bar0.flags & (REGION_READ | REGION_WRITE)), (16 << 10, REGION_READ | REGION_WRITE));
        if doorbell == "bar" {
            // The doorbell page is shared memory: a sparse mmap of BAR0.
            assert_eq!(bar0.flags & REGION_MMAP, REGION_MMAP);
            let areas: Vec<(u64, u64)> = bar0.sparse_areas.iter().map(|a| (a.offset, a.size)).collect();
            assert_eq!(areas, [(0x1000, 0x1000)]);
            assert!(bar0.file_offset.is_some());
        }
        assert_eq!(read32(&mut c, CONFIG, 0), 0x10ed_1234, "vendor and device ids");
        let msix = c.get_irq_info(2).unwrap();
        assert_eq!(msix.count, 65);
        for index in [0, 1, 3, 4] {
            assert_eq!(c.get_irq_info(index).unwrap().index, index);
        }
        // Guest RAM, and MSI-X vectors 0 and 1 as eventfds (QEMU-style: the
        // client keeps the table and never writes the controller's).
        let ram = memfd(1 << 20, true);
        c.dma_map(0, GPA, 1 << 20, ram.as_raw_fd()).unwrap();
        let vectors: Vec<EventFd> = (0..2).map(|_| EventFd::new(EFD_NONBLOCK).unwrap()).collect();
        let raw: Vec<i32> = vectors.iter().map(|v| v.as_raw_fd()).collect();
        c.set_irqs(2, SET_DATA_EVENTFD | SET_ACTION_TRIGGER, 0, 2, &raw).unwrap();
        // Admin queues of 16 entries, then CC.EN (IOSQES 6, IOCQES 4).
        nvme_enable(&mut c, GPA + ASQ, GPA + ACQ);
        assert_eq!(read32(&mut c, 0, 0x1c) & 3, 1, "CSTS.RDY");
        // Identify controller: the SQE in guest RAM, then SQ 0's doorbell.
        let cqe = nvme_identify(&mut c, &ram, ASQ, ACQ, GPA + IDENT, Duration::from_secs(10));
        assert_eq!(u16::from_le_bytes([cqe[14], cqe[15]]) >> 1, 0, "status");
        assert_eq!(u16::from_le_bytes([cqe[8], cqe[9]]), 1, "SQ head");
        let mut id = [0u8; 64];
        ram.read_exact_at(&mut id, IDENT).unwrap();
        assert_eq!(u16::from_le_bytes([id[0], id[1]]), 0x1234, "VID");
        assert!(id[24..].starts_with(b"iopath NVMe controller"), "{:?}", String::from_utf8_lossy(&id[24..64]));
        assert!(
            iopath_devices::irq::wait_readable(&vectors[0], Duration::from_secs(5)),
            "the admin completion signalled vector 0's eventfd"
        );
        c.region_write(0, 0x1004, &1u32.to_le_bytes()).unwrap();
        // Take guest RAM back (the only map), reset, and leave.
        c.dma_unmap(GPA, 1 << 20).unwrap();
        c.reset().unwrap();
        assert_eq!(read32(&mut c, 0, 0x1c) & 1, 0, "not ready after reset");
        c.shutdown().unwrap();
    });
    server.join().unwrap();
}

#[test]
fn rust_vmm_client_drives_nvme_with_mmio_doorbells() {
    nvme("mmio");
}

#[test]
fn rust_vmm_client_drives_nvme_with_a_shared_doorbell_page() {
    nvme("bar");
}
