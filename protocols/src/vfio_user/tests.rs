//! The proxy and the server over socketpairs: both io fd offers, a client
//! after another, hostile requests, the DMA fallback, interrupts.

use super::wire::*;
use super::{recv, send, IoFds, Received, VfioUserProxy, VfioUserServer};
use crate::function::PciFunction;
use crate::testing::{device_intx_reaches, sealed_memfd, testdev, vmm_context};
use crate::transport::Server;
use crate::{Error, Result};
use iopath_devices::irq::IrqLines;
use iopath_devices::{BarKind, Counter, DeviceConfig, DeviceModelMut, Interrupts, IoEventSpec, IoEvents};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use vm_memory::{Bytes, GuestAddress};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

mod deployed_clients;
mod dma_fallback;
mod reconnect;

type ServerThread = JoinHandle<(Result<()>, Vec<Counter>)>;

/// Serves `clients` connections in turn, one function (state kept across them).
fn server(io_fds: IoFds, socks: Vec<UnixStream>) -> ServerThread {
    std::thread::spawn(move || {
        let f = testdev();
        let mut srv = VfioUserServer::new(f.clone(), IrqLines::new(), io_fds);
        let mut r = Ok(());
        for s in socks {
            r = r.and(srv.session(&s, "test"));
        }
        let c = f.lock().unwrap().counters();
        (r, c)
    })
}

fn counter(c: &[Counter], name: &str) -> Option<u64> {
    c.iter().find(|c| c.name == name).map(|c| c.value)
}

fn place(p: &mut VfioUserProxy) {
    p.config_write(0x10, &0xfe00_0000u32.to_le_bytes());
    p.config_write(0x14, &0xc000u32.to_le_bytes());
    p.config_write(0x04, &3u16.to_le_bytes());
}

#[test]
fn proxy_and_server_run_pci_testdev_and_announce_its_ioeventfds() {
    let (a, b) = UnixStream::pair().unwrap();
    let h = server(IoFds::IoEventFds, vec![b]);
    let mut p = VfioUserProxy::connect(a, None).unwrap();
    assert_eq!((p.ids().vendor, p.ids().device, p.ids().class), (0x1b36, 0x0005, 0xff0000));
    let bars = p.bars();
    assert_eq!(
        bars.iter().map(|b| (b.index, b.kind, b.size)).collect::<Vec<_>>(),
        [(0, BarKind::Mem32, 4096), (1, BarKind::Io, 256)]
    );
    // Both eventfd tests of each BAR are announced: wildcard and datamatch 0xfa.
    let specs: Vec<IoEventSpec> = p.ioevents.iter().map(|(s, _)| *s).collect();
    assert_eq!(specs.len(), 4, "{specs:?}");
    assert!(specs.contains(&IoEventSpec { bar: 0, offset: 2049, len: 1, datamatch: None }));
    assert!(specs.contains(&IoEventSpec { bar: 1, offset: 133, len: 1, datamatch: Some(0xfa) }));
    place(&mut p);
    p.bar_write(1, 0, &[0]);
    for _ in 0..7 {
        p.bar_write(1, 131, &[0xfa]);
    }
    let mut c = [0u8; 4];
    p.bar_read(1, 12, &mut c);
    assert_eq!(u32::from_le_bytes(c), 7);
    // An announced eventfd signalled (as KVM would) shows as kicks.
    p.bar_write(0, 0, &[1]);
    p.ioevents.iter().find(|(s, _)| s.offset == 2049).unwrap().1.write(3).unwrap();
    let mut cfg = [0u8; 4];
    assert!(p.config_read(0, &mut cfg));
    assert_eq!(u32::from_le_bytes(cfg), 0x0005_1b36);
    drop(p);
    let (r, c) = h.join().unwrap();
    r.unwrap();
    assert_eq!(counter(&c, "portio-no-eventfd.exits"), Some(7));
    assert_eq!(counter(&c, "mmio-wildcard-eventfd.kicks"), Some(3));
}

#[test]
fn ioregionfd_regions_carry_sync_and_posted_accesses() {
    for posted in [false, true] {
        let (a, b) = UnixStream::pair().unwrap();
        let h = server(IoFds::IoRegionFds { posted }, vec![b]);
        let mut p = VfioUserProxy::connect(a, None).unwrap();
        assert!(p.ioevents.is_empty());
        assert_eq!(p.regions.len(), 2);
        assert!(p.regions.iter().all(|(_, r)| r.posted_writes == posted));
        place(&mut p);
        let before = p.chan.requests;
        p.bar_write(0, 0, &[0]);
        for _ in 0..50 {
            p.bar_write(0, 2048, &[0xfa]);
        }
        let mut c = [0u8; 4];
        p.bar_read(0, 12, &mut c);
        assert_eq!(u32::from_le_bytes(c), 50);
        assert_eq!(p.chan.requests, before, "no REGION_READ/WRITE message: the region fds carried them");
        assert_eq!(counter(&p.counters(), "ioregionfd.commands"), Some(52));
        drop(p);
        let (r, c) = h.join().unwrap();
        r.unwrap();
        assert_eq!(counter(&c, "mmio-no-eventfd.exits"), Some(50));
    }
}

#[test]
fn a_new_client_finds_the_device_state_kept() {
    let (a1, b1) = UnixStream::pair().unwrap();
    let (a2, b2) = UnixStream::pair().unwrap();
    let h = server(IoFds::IoEventFds, vec![b1, b2]);
    let mut p = VfioUserProxy::connect(a1, None).unwrap();
    place(&mut p);
    p.bar_write(0, 0, &[0]);
    p.bar_write(0, 2048, &[0xfa]);
    drop(p); // the VMM goes away
    let mut p = VfioUserProxy::connect(a2, None).unwrap();
    let mut c = [0u8; 4];
    p.bar_read(0, 12, &mut c);
    assert_eq!(u32::from_le_bytes(c), 1, "test selection and count survived the disconnect");
    drop(p);
    h.join().unwrap().0.unwrap();
}

/// A raw client for hostile requests.
struct Raw(UnixStream, u16);
impl Raw {
    fn call(&mut self, cmd: u16, payload: &[u8], fds: &[RawFd]) -> Header {
        self.1 += 1;
        let mut m = message(self.1, Command::Version, FLAGS_TYPE_COMMAND, payload);
        m[2..4].copy_from_slice(&cmd.to_le_bytes());
        send(&self.0, &m, fds).unwrap();
        let r = recv(&self.0).unwrap().unwrap();
        assert_eq!(r.hdr.msg_id, self.1);
        r.hdr
    }
    fn version(&mut self) {
        let v = Version { major: 0, minor: 2, capabilities: None };
        assert!(!self.call(Command::Version as u16, &v.to_bytes(), &[]).is_error());
    }
}

#[test]
fn hostile_requests_get_error_replies_and_the_session_goes_on() {
    let (a, b) = UnixStream::pair().unwrap();
    let h = server(IoFds::IoEventFds, vec![b]);
    let mut c = Raw(a, 0);
    let info = DeviceInfo::request().to_bytes();
    let e = c.call(Command::DeviceGetInfo as u16, &info, &[]);
    assert_eq!((e.is_error(), e.error_no), (true, libc::EINVAL as u32), "before VERSION");
    c.version();
    assert_eq!(c.call(99, &[], &[]).error_no, libc::ENOSYS as u32, "unknown command");
    let w = RegionAccess::to_bytes_with_data(4095, 0, &[1, 2]);
    assert!(c.call(Command::RegionWrite as u16, &w, &[]).is_error(), "past the BAR end");
    let w = RegionAccess::to_bytes_with_data(0, 0, &[1, 2, 3]);
    assert!(c.call(Command::RegionWrite as u16, &w, &[]).is_error(), "3-byte BAR access");
    let r = RegionAccess { offset: 0, region: 42, count: 4 }.to_bytes();
    assert!(c.call(Command::RegionRead as u16, &r, &[]).is_error(), "no such region");
    let mut short = RegionAccess::to_bytes_with_data(0, 0, &[1, 2, 3, 4]);
    short.truncate(18);
    assert!(c.call(Command::RegionWrite as u16, &short, &[]).is_error(), "data shorter than count");
    // A memfd shorter than the mapping it claims is refused, not mapped.
    let memfd = sealed_memfd("short", 4096);
    let map = DmaMap { flags: 3, offset: 0, address: 0, size: 1 << 20 };
    assert!(c.call(Command::DmaMap as u16, &map.to_bytes(), &[memfd.as_raw_fd()]).is_error());
    let ok_map = DmaMap { flags: 3, offset: 0, address: 0x10000, size: 4096 };
    assert!(!c.call(Command::DmaMap as u16, &ok_map.to_bytes(), &[memfd.as_raw_fd()]).is_error());
    let overlap = DmaMap { flags: 3, offset: 0, address: 0x10800, size: 4096 };
    assert_eq!(c.call(Command::DmaMap as u16, &overlap.to_bytes(), &[]).error_no, libc::EEXIST as u32);
    let unmap = DmaUnmap::new(0, 0x20000, 4096);
    assert_eq!(c.call(Command::DmaUnmap as u16, &unmap.to_bytes(), &[]).error_no, libc::ENOENT as u32);
    // SET_IRQS with more fds than vectors, and on an index with none.
    let q = IrqSet { flags: IRQ_SET_DATA_EVENTFD | IRQ_SET_ACTION_TRIGGER, index: 0, start: 0, count: 1, data: vec![] };
    let fd = EventFd::new(0).unwrap();
    assert!(c.call(Command::DeviceSetIrqs as u16, &q.to_bytes(), &[fd.as_raw_fd(), fd.as_raw_fd()]).is_error());
    let q = IrqSet { index: PCI_MSIX_IRQ_INDEX, ..q };
    assert!(c.call(Command::DeviceSetIrqs as u16, &q.to_bytes(), &[fd.as_raw_fd()]).is_error());
    // Still serving: a good request works.
    assert!(!c.call(Command::DeviceGetInfo as u16, &info, &[]).is_error());
    // An oversize header cannot be skipped: the channel is closed.
    let mut m = message(77, Command::RegionRead, FLAGS_TYPE_COMMAND, &[]);
    m[4..8].copy_from_slice(&(64u32 << 20).to_le_bytes());
    send(&c.0, &m, &[]).unwrap();
    let (r, _) = h.join().unwrap();
    let e = r.unwrap_err();
    assert!(matches!(e, Error::Protocol(_)) && e.to_string().contains("exceeds"), "{e}");
}

#[test]
fn the_client_answers_dma_fallback_requests_within_guest_ram_only() {
    let (a, b) = UnixStream::pair().unwrap();
    let h = server(IoFds::IoEventFds, vec![b]);
    let mut p = VfioUserProxy::connect(a, None).unwrap();
    let mem = iopath_devices::GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x10000)]).unwrap();
    p.chan.dma.mem = Some(mem.clone().into());
    let hdr = |cmd: Command| Header { msg_id: 9, cmd: cmd as u16, msg_size: 0, flags: 0, error_no: 0 };
    let w =
        Received { hdr: hdr(Command::DmaWrite), payload: DmaAccess::to_bytes_with_data(0x100, b"hello"), fds: vec![] };
    let (rh, _) = parse_message(&p.chan.dma.serve(&w)).map(|(h, p)| (h, p.to_vec())).unwrap();
    assert!(!rh.is_error());
    let mut got = [0u8; 5];
    mem.read_slice(&mut got, GuestAddress(0x100)).unwrap();
    assert_eq!(&got, b"hello");
    let r = Received {
        hdr: hdr(Command::DmaRead),
        payload: DmaAccess { address: 0x100, count: 5 }.to_bytes(),
        fds: vec![],
    };
    let reply = p.chan.dma.serve(&r);
    let (_, payload) = parse_message(&reply).unwrap();
    assert_eq!(DmaAccess::parse_with_data(payload).unwrap().1, b"hello");
    let out = Received {
        hdr: hdr(Command::DmaRead),
        payload: DmaAccess { address: 0xfffe, count: 4 }.to_bytes(),
        fds: vec![],
    };
    let (eh, _) = parse_message(&p.chan.dma.serve(&out)).unwrap();
    assert_eq!((eh.is_error(), eh.error_no), (true, libc::EFAULT as u32), "straddles the end of guest RAM");
    drop(p);
    h.join().unwrap().0.unwrap();
}

#[test]
fn set_irqs_hands_intx_to_the_device_process_and_dma_map_its_ram() {
    let (a, b) = UnixStream::pair().unwrap();
    let irq = IrqLines::new();
    let irq2 = irq.clone();
    let h = std::thread::spawn(move || VfioUserServer::new(testdev(), irq2, IoFds::IoEventFds).session(&b, "test"));
    let mut p = VfioUserProxy::connect(a, None).unwrap();
    let (ctx, _) = vmm_context();
    let recorder = Arc::new(Recorder::default());
    let mut ctx = ctx;
    ctx.ioevents = recorder.clone();
    p.attach(ctx);
    assert!(p.chan.peer.dead.is_none(), "{:?}", p.chan.peer.dead);
    assert_eq!(recorder.0.lock().unwrap().len(), 4, "the announced ioeventfds went to KVM's registrar");
    // pci-testdev has no Interrupt Pin: the server offers no INTx, the proxy hands none over.
    assert!(irq.intx_eventfds().is_none(), "INTx fds for a device without INTx");
    drop(p);
    h.join().unwrap().unwrap();
    // virtio-blk has INTA#: its INTx eventfds reach the device process.
    let (a, b) = UnixStream::pair().unwrap();
    let irq = IrqLines::new();
    let irq2 = irq.clone();
    let dev = "virtio-blk,backend=null".parse::<DeviceConfig>().unwrap().build().unwrap();
    let f = Arc::new(Mutex::new(PciFunction::new(dev).unwrap()));
    let h = std::thread::spawn(move || VfioUserServer::new(f, irq2, IoFds::IoEventFds).session(&b, "test"));
    let mut p = VfioUserProxy::connect(a, None).unwrap();
    let (ctx, trigger) = vmm_context();
    p.attach(ctx);
    assert!(p.chan.peer.dead.is_none(), "{:?}", p.chan.peer.dead);
    device_intx_reaches(&irq, &trigger);
    drop(p);
    h.join().unwrap().unwrap();
}

#[derive(Default)]
struct Recorder(Mutex<Vec<IoEventSpec>>);
impl IoEvents for Recorder {
    fn register(&self, s: IoEventSpec, _: &EventFd) -> iopath_devices::Result<()> {
        self.0.lock().unwrap().push(s);
        Ok(())
    }
    fn unregister(&self, _: IoEventSpec, _: &EventFd) -> iopath_devices::Result<()> {
        Ok(())
    }
}

/// What the VMM's interrupt host sees of a proxy's MSI-X: routes, and the
/// vector eventfds it handed out.
type Route = (u16, Option<(u64, u32)>);

#[derive(Default)]
struct MsixHost {
    routes: Mutex<Vec<Route>>,
    given: Mutex<Vec<(u16, EventFd)>>,
}
impl Interrupts for MsixHost {
    fn set_intx(&self, _: bool) {}
    fn signal_msix(&self, _: u16) -> bool {
        false
    }
    fn msix_route(&self, v: u16, msg: Option<(u64, u32)>) {
        self.routes.lock().unwrap().push((v, msg));
    }
    fn msix_eventfd(&self, v: u16) -> Option<EventFd> {
        let fd = EventFd::new(EFD_NONBLOCK).unwrap();
        let copy = fd.try_clone().unwrap();
        self.given.lock().unwrap().push((v, fd));
        Some(copy)
    }
}

#[test]
fn msix_vectors_are_routed_in_the_vmm_and_their_eventfds_handed_over_once() {
    let (a, b) = UnixStream::pair().unwrap();
    let dev = "nvme,doorbell=mmio,backend=null".parse::<DeviceConfig>().unwrap().build().unwrap();
    let irq = IrqLines::new();
    let device_side = irq.clone();
    let h = std::thread::spawn(move || {
        let f = Arc::new(Mutex::new(PciFunction::new(dev).unwrap()));
        VfioUserServer::new(f, irq, IoFds::IoEventFds).session(&b, "test")
    });
    let mut p = VfioUserProxy::connect(a, None).unwrap();
    let (mut ctx, _) = vmm_context();
    let host = Arc::new(MsixHost::default());
    ctx.irq = host.clone();
    p.attach(ctx);
    let (bar, cap) = p.msix.as_ref().map(|m| (m.table.bar(), m.table.cap_offset())).expect("the controller has MSI-X");
    let mut t = [0u8; 4];
    assert!(p.config_read(cap + 4, &mut t));
    let table = (u32::from_le_bytes(t) & !7) as u64;
    // Vector 1: message, then unmasked; MSI-X still off, so nothing is routed.
    p.bar_write(bar, table + 16, &0xfee0_0000u64.to_le_bytes());
    p.bar_write(bar, table + 24, &0x45u32.to_le_bytes());
    p.bar_write(bar, table + 28, &0u32.to_le_bytes());
    assert!(host.routes.lock().unwrap().is_empty());
    // MSI-X Enable: vector 1 is routed in the VMM and its eventfd handed over.
    p.config_write(cap + 3, &[0x80]);
    assert_eq!(*host.routes.lock().unwrap(), [(1, Some((0xfee0_0000, 0x45)))]);
    assert!(device_side.signal_msix(1), "the device process has vector 1's eventfd");
    let given: Vec<u16> = host.given.lock().unwrap().iter().map(|(v, _)| *v).collect();
    assert_eq!(given, [1]);
    assert_eq!(host.given.lock().unwrap()[0].1.read().unwrap(), 1);
    // Masking is the VMM's (the route goes away, signals wait in the
    // eventfd); a new message re-routes it on unmask, and the eventfd is
    // not handed over again.
    p.bar_write(bar, table + 28, &1u32.to_le_bytes());
    p.bar_write(bar, table + 24, &0x46u32.to_le_bytes());
    p.bar_write(bar, table + 28, &0u32.to_le_bytes());
    assert_eq!(host.routes.lock().unwrap().last(), Some(&(1, Some((0xfee0_0000, 0x46)))));
    assert_eq!(host.given.lock().unwrap().len(), 1);
    assert!(p.chan.peer.dead.is_none(), "{:?}", p.chan.peer.dead);
    drop(p);
    h.join().unwrap().unwrap();
}
