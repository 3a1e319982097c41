//! A client that shrinks memory it shared must not kill the device process
//! with SIGBUS (the policy is in `function`'s module doc). The servers run
//! in this test process: a SIGBUS would kill the test binary.
//! - vfio-user: a DMA_MAP whose memfd is not sealed against shrinking is not
//!   mmapped; the client truncates it and an NVMe Identify writes there: the
//!   access goes through DMA_WRITE (which this client never answers) and the
//!   command completes with an error. A sealed memfd is mapped as before,
//!   and cannot be shrunk.
//! - mpqemu: SYNC_SYSMEM with an unsealed fd closes the channel; a sealed
//!   one is taken.

mod common;
use common::{connect, memfd, nvme_enable, nvme_identify, serve, within};
use iopath_devices::irq::IrqLines;
use iopath_devices::testdev::PciTestDev;
use iopath_protocols::function::{cannot_shrink, PciFunction};
use iopath_protocols::mpqemu::wire::{recv, send, Msg, SysmemRegion};
use iopath_protocols::mpqemu::MpqemuServer;
use iopath_protocols::Server;
use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Queues in a sealed memfd at `QGPA`; Identify's data buffer in `data` at `DGPA`.
const QGPA: u64 = 0x10_0000;
const DGPA: u64 = 0x40_0000;
const ACQ: u64 = 0x1000;

/// Maps `data` (sealed or not), shrinks it if it can, then runs Identify
/// into it with the doorbell page shared (the device's poller does the DMA).
/// Returns the completion status and whether the shrink worked.
fn identify_into(data_sealed: bool, name: &'static str) -> (u16, bool, File) {
    let (path, _server) = serve("nvme,doorbell=bar,size_mb=1", name);
    within(name, move || {
        let mut c = connect(&path);
        let ram = memfd(1 << 16, true);
        let data = memfd(0x1000, data_sealed);
        c.dma_map(0, QGPA, 1 << 16, ram.as_raw_fd()).unwrap();
        c.dma_map(0, DGPA, 0x1000, data.as_raw_fd()).unwrap();
        let shrunk = match data.set_len(0) {
            Ok(()) => true,
            Err(e) => {
                assert_eq!(e.raw_os_error(), Some(libc::EPERM));
                false
            }
        };
        assert_eq!(cannot_shrink(&data), data_sealed);
        nvme_enable(&mut c, QGPA, QGPA + ACQ);
        let cqe = nvme_identify(&mut c, &ram, 0, ACQ, DGPA, Duration::from_secs(30));
        // The client may now have an unanswered DMA request in its socket:
        // it leaves without another call.
        (u16::from_le_bytes([cqe[14], cqe[15]]) >> 1, shrunk, data)
    })
}

#[test]
fn vfio_user_an_unsealed_dma_map_truncated_by_the_client_gives_an_nvme_error_not_sigbus() {
    let (status, shrunk, _) = identify_into(false, "unsealed");
    assert!(shrunk, "an unsealed memfd can shrink");
    assert_ne!(status, 0, "Identify into memory the device could not reach fails");
}

#[test]
fn vfio_user_a_sealed_dma_map_is_mapped_and_cannot_shrink() {
    let (status, shrunk, data) = identify_into(true, "sealed");
    assert!(!shrunk, "ftruncate of a sealed memfd fails with EPERM");
    assert_eq!(status, 0);
    let mut vid = [0u8; 2];
    data.read_exact_at(&mut vid, 0).unwrap();
    assert_eq!(u16::from_le_bytes(vid), 0x1234, "Identify data written through the mapping");
}

#[test]
fn mpqemu_sync_sysmem_with_an_unsealed_fd_closes_the_channel_and_a_sealed_one_is_taken() {
    let session = |sealed: bool| {
        let (a, b) = std::os::unix::net::UnixStream::pair().unwrap();
        let f = Arc::new(Mutex::new(PciFunction::new(Arc::new(Mutex::new(PciTestDev::new()))).unwrap()));
        let h = std::thread::spawn(move || MpqemuServer::new(f, IrqLines::new()).session(&b, "hostile"));
        let ram = memfd(1 << 20, sealed);
        let regions = vec![SysmemRegion { gpa: 0, size: 1 << 20, offset: 0 }];
        send(&a, &Msg::SyncSysmem(regions), &[ram.as_raw_fd()], "SYNC_SYSMEM").unwrap();
        if !sealed {
            ram.set_len(0).unwrap();
        }
        let _ = send(&a, &Msg::CfgRead { addr: 0, len: 4 }, &[], "CFGREAD");
        let reply = recv(&a).ok().flatten().map(|(m, _)| m);
        drop(a);
        (reply, h.join().unwrap())
    };
    let (reply, r) = session(false);
    assert!(reply.is_none(), "no reply after an unsealed SYNC_SYSMEM: {reply:?}");
    let e = r.unwrap_err().to_string();
    assert!(e.contains("not sealed"), "{e}");
    let (reply, r) = session(true);
    assert!(matches!(reply, Some(Msg::Ret(0x0005_1b36))), "{reply:?}");
    r.unwrap();
}
