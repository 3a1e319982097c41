//! The server against what deployed clients send (QEMU's vfio-user-pci,
//! SPDK's NVMe driver, the rust-vmm `vfio_user` client): requests longer than
//! their fixed part, DMA_UNMAP with an fd, of the last map or of all of
//! them, maps in any order or without an fd, VERSION negotiation, INTx with
//! a trigger eventfd only, SET_IRQS by value, MSI-X eventfds.

use super::super::wire::*;
use super::super::{recv, send, IoFds, VfioUserServer};
use crate::function::PciFunction;
use crate::testing::sealed_memfd;
use crate::transport::Server;
use crate::Result;
use iopath_devices::irq::IrqLines;
use iopath_devices::{DeviceConfig, Interrupts};
use serde_json::{json, Value};
use std::fs::File;
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::fs::FileExt;
use std::os::unix::net::UnixStream;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

struct Reply {
    hdr: Header,
    payload: Vec<u8>,
    fds: Vec<File>,
}

/// A client that sends exactly the bytes a test gives it.
struct Client {
    sock: UnixStream,
    id: u16,
    /// Server requests (DMA_READ/DMA_WRITE) answered with an error.
    refused_dma: u32,
}

impl Client {
    /// Sends a request and waits for its reply. A DMA_READ or DMA_WRITE the
    /// server sends meanwhile is refused (EFAULT): this client offers no
    /// memory that way (`dma_fallback.rs` has one that does).
    fn call(&mut self, cmd: Command, payload: &[u8], fds: &[RawFd]) -> Reply {
        self.id = self.id.wrapping_add(1);
        send(&self.sock, &message(self.id, cmd, FLAGS_TYPE_COMMAND, payload), fds).unwrap();
        let r = loop {
            let r = recv(&self.sock).unwrap().expect("the server closed the channel");
            if r.hdr.is_reply() {
                break r;
            }
            self.refused_dma += 1;
            send(&self.sock, &error_reply(&r.hdr, libc::EFAULT), &[]).unwrap();
        };
        assert!(r.hdr.is_reply() && r.hdr.msg_id == self.id && r.hdr.cmd == cmd as u16, "{:?}", r.hdr);
        Reply { hdr: r.hdr, payload: r.payload, fds: r.fds }
    }

    /// A request that must succeed.
    fn ok(&mut self, cmd: Command, payload: &[u8], fds: &[RawFd]) -> Reply {
        let r = self.call(cmd, payload, fds);
        assert!(!r.hdr.is_error(), "{cmd:?} failed with errno {}", r.hdr.error_no);
        r
    }

    /// A request that must fail; its errno.
    fn err(&mut self, cmd: Command, payload: &[u8], fds: &[RawFd]) -> u32 {
        let r = self.call(cmd, payload, fds);
        assert!(r.hdr.is_error() && r.payload.is_empty(), "{cmd:?} succeeded");
        r.hdr.error_no
    }

    fn version(&mut self) {
        let caps = json!({"capabilities": {"max_msg_fds": 16}}).to_string();
        self.ok(Command::Version, &[&[0, 0, 2, 0][..], caps.as_bytes(), &[0]].concat(), &[]);
    }

    fn set_irqs(&mut self, flags: u32, index: u32, start: u32, count: u32, data: &[u8], fds: &[RawFd]) -> Reply {
        self.call(Command::DeviceSetIrqs, &IrqSet { flags, index, start, count, data: data.to_vec() }.to_bytes(), fds)
    }

    fn dma_map(&mut self, address: u64, size: u64, fd: Option<&File>) -> Reply {
        let map = DmaMap { flags: DMA_MAP_FLAG_READ | DMA_MAP_FLAG_WRITE, offset: 0, address, size };
        let fds: Vec<RawFd> = fd.iter().map(|f| f.as_raw_fd()).collect();
        self.call(Command::DmaMap, &map.to_bytes(), &fds)
    }
}

/// Serves `device` to one client on a socketpair; the device's interrupt
/// lines are returned to play the device's side.
fn serve(device: &str) -> (Client, Arc<IrqLines>, JoinHandle<Result<()>>) {
    let dev = device.parse::<DeviceConfig>().unwrap().build().unwrap();
    let f = Arc::new(Mutex::new(PciFunction::new(dev).unwrap()));
    let irq = IrqLines::new();
    let (a, b) = UnixStream::pair().unwrap();
    let lines = irq.clone();
    let h = std::thread::spawn(move || VfioUserServer::new(f, lines, IoFds::IoEventFds).session(&b, "test"));
    (Client { sock: a, id: 0, refused_dma: 0 }, irq, h)
}

fn ram(len: u64) -> File {
    sealed_memfd("ram", len)
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().unwrap())
}

fn signalled(fd: &EventFd) -> bool {
    fd.read().is_ok()
}

#[test]
fn requests_longer_than_their_fixed_part_are_served_and_replies_fit_argsz() {
    let (mut c, _, h) = serve("nvme,doorbell=bar,backend=null");
    c.version();
    // SPDK's NVMe driver sends its whole 4064-byte buffer, argsz 4064.
    let mut q = RegionInfo::request(0, 4064).to_bytes();
    q.resize(4064, 0);
    let r = c.ok(Command::DeviceGetRegionInfo, &q, &[]);
    let info = RegionInfoReply::parse(&r.payload).unwrap();
    assert_eq!(info.info.argsz as usize, r.payload.len());
    assert_eq!(info.sparse_mmap, Some(vec![SparseMmapArea { offset: 0x1000, size: 0x1000 }]));
    assert_eq!(r.fds.len(), 1, "the doorbell page's fd");
    // argsz 32 with the same long request: the fixed part, argsz = what is needed.
    q[..4].copy_from_slice(&32u32.to_le_bytes());
    let r = c.ok(Command::DeviceGetRegionInfo, &q, &[]);
    assert_eq!((r.payload.len(), u32_at(&r.payload, 0)), (32, info.info.argsz));
    // argsz below the fixed reply: refused.
    q[..4].copy_from_slice(&16u32.to_le_bytes());
    assert_eq!(c.err(Command::DeviceGetRegionInfo, &q, &[]), libc::EINVAL as u32);
    // rust-vmm's DEVICE_GET_INFO counts its header in argsz (32); others pad the request.
    for (argsz, len) in [(32u32, 16usize), (4064, 4064)] {
        let mut q = DeviceInfo { argsz, ..DeviceInfo::request() }.to_bytes();
        q.resize(len, 0);
        let r = c.ok(Command::DeviceGetInfo, &q, &[]);
        let d = DeviceInfo::parse(&r.payload).unwrap();
        assert_eq!((d.argsz, d.num_regions, d.num_irqs), (16, 9, 5));
    }
    let mut q = IrqInfo { argsz: 4064, ..IrqInfo::request(PCI_MSIX_IRQ_INDEX) }.to_bytes();
    q.resize(4064, 0);
    let r = c.ok(Command::DeviceGetIrqInfo, &q, &[]);
    assert_eq!((r.payload.len(), IrqInfo::parse(&r.payload).unwrap().count), (16, 65));
    let mut q = IoFdsRequest { argsz: 4064, index: 0 }.to_bytes();
    q.resize(4064, 0);
    let r = c.ok(Command::DeviceGetRegionIoFds, &q, &[]);
    assert_eq!(IoFdsReply::parse(&r.payload).unwrap().argsz as usize, r.payload.len());
    // DMA_MAP and DMA_UNMAP with trailing bytes; the UNMAP reply is the
    // 24-byte entry, argsz the size it needs.
    let mem = ram(1 << 20);
    let mut map = DmaMap { flags: 3, offset: 0, address: 0, size: 1 << 20 }.to_bytes();
    map.resize(48, 0);
    c.ok(Command::DmaMap, &map, &[mem.as_raw_fd()]);
    let mut unmap = DmaUnmap { argsz: 4064, ..DmaUnmap::new(0, 0, 1 << 20) }.to_bytes();
    unmap.resize(4064, 0);
    let r = c.ok(Command::DmaUnmap, &unmap, &[]);
    assert_eq!(r.payload, DmaUnmap::new(0, 0, 1 << 20).to_bytes());
    // SET_IRQS: an eventfd request that also carries a kernel-style fd array,
    // and bools followed by padding.
    let e = EventFd::new(EFD_NONBLOCK).unwrap();
    let flags = IRQ_SET_DATA_EVENTFD | IRQ_SET_ACTION_TRIGGER;
    let mut q = IrqSet { flags, index: PCI_MSIX_IRQ_INDEX, start: 0, count: 1, data: vec![] }.to_bytes();
    q[..4].copy_from_slice(&24u32.to_le_bytes());
    q.extend_from_slice(&(e.as_raw_fd()).to_le_bytes());
    c.ok(Command::DeviceSetIrqs, &q, &[e.as_raw_fd()]);
    let flags = IRQ_SET_DATA_BOOL | IRQ_SET_ACTION_TRIGGER;
    let mut q = IrqSet { flags, index: PCI_MSIX_IRQ_INDEX, start: 0, count: 1, data: vec![1] }.to_bytes();
    q.extend_from_slice(&[0; 3]);
    c.ok(Command::DeviceSetIrqs, &q, &[]);
    assert!(signalled(&e), "the vector was triggered by value");
    // Too short is still refused.
    assert_eq!(c.err(Command::DeviceSetIrqs, &q[..20], &[]), libc::EINVAL as u32, "bools missing");
    assert_eq!(c.err(Command::DeviceGetIrqInfo, &[16, 0, 0, 0], &[]), libc::EINVAL as u32);
    drop(c);
    h.join().unwrap().unwrap();
}

#[test]
fn dma_unmap_with_an_fd_of_the_last_map_and_of_all_maps_succeeds() {
    let (mut c, _, h) = serve("pci-testdev");
    c.version();
    let (a, b) = (ram(0x10000), ram(0x10000));
    assert!(!c.dma_map(0, 0x10000, Some(&a)).hdr.is_error());
    assert!(!c.dma_map(0x10000, 0x10000, Some(&b)).hdr.is_error());
    // Some clients pass the region's fd again with DMA_UNMAP: ignored.
    c.ok(Command::DmaUnmap, &DmaUnmap::new(0, 0x10000, 0x10000).to_bytes(), &[b.as_raw_fd()]);
    // The last map.
    c.ok(Command::DmaUnmap, &DmaUnmap::new(0, 0, 0x10000).to_bytes(), &[]);
    assert_eq!(c.err(Command::DmaUnmap, &DmaUnmap::new(0, 0, 0x10000).to_bytes(), &[]), libc::ENOENT as u32);
    // DMA_UNMAP_FLAG_ALL (QEMU's unmap_all: address and size 0).
    assert!(!c.dma_map(0x10000, 0x10000, Some(&b)).hdr.is_error());
    assert!(!c.dma_map(0, 0x10000, None).hdr.is_error());
    let all = DmaUnmap::new(DMA_UNMAP_FLAG_ALL, 0, 0).to_bytes();
    assert_eq!(c.ok(Command::DmaUnmap, &all, &[]).payload, all);
    assert_eq!(c.err(Command::DmaUnmap, &DmaUnmap::new(0, 0x10000, 0x10000).to_bytes(), &[]), libc::ENOENT as u32);
    c.ok(Command::DmaUnmap, &all, &[]);
    drop(c);
    h.join().unwrap().unwrap();
}

/// Guest-physical layout of the NVMe tests: admin queues, I/O queues, an
/// Identify buffer and a data page in a map at `BASE` (the controller
/// takes no queue at address 0).
const BASE: u64 = 0x10000;
const ASQ: u64 = BASE;
const ACQ: u64 = BASE + 0x1000;
const IOSQ: u64 = BASE + 0x2000;
const IOCQ: u64 = BASE + 0x3000;
const IDENT: u64 = BASE + 0x4000;
const DATA: u64 = BASE + 0x5000;
const QSIZE: u64 = 16;

/// An NVMe driver over raw vfio-user messages: registers and doorbells as
/// REGION_WRITEs (doorbell=mmio serves a queue before the write's reply),
/// queues in the memfds the test maps.
struct NvmeDriver {
    c: Client,
    /// (gpa, memfd) of every map with an fd, to read and write guest RAM.
    ram: Vec<(u64, File)>,
    tails: [u64; 2],
    heads: [u64; 2],
    phase: [bool; 2],
    cid: u16,
}

impl NvmeDriver {
    fn new(c: Client) -> Self {
        NvmeDriver { c, ram: Vec::new(), tails: [0; 2], heads: [0; 2], phase: [true; 2], cid: 0 }
    }

    fn map(&mut self, gpa: u64, f: File) {
        let size = f.metadata().unwrap().len();
        let r = self.c.dma_map(gpa, size, Some(&f));
        assert!(!r.hdr.is_error(), "DMA_MAP at {gpa:#x}: errno {}", r.hdr.error_no);
        self.ram.push((gpa, f));
    }

    fn mem(&self, gpa: u64) -> (&File, u64) {
        let (base, f) = self.ram.iter().find(|(b, f)| (*b..*b + f.metadata().unwrap().len()).contains(&gpa)).unwrap();
        (f, gpa - base)
    }

    fn write_mem(&self, gpa: u64, data: &[u8]) {
        let (f, off) = self.mem(gpa);
        f.write_all_at(data, off).unwrap();
    }

    fn read_mem(&self, gpa: u64, len: usize) -> Vec<u8> {
        let (f, off) = self.mem(gpa);
        let mut b = vec![0u8; len];
        f.read_exact_at(&mut b, off).unwrap();
        b
    }

    fn reg_write(&mut self, offset: u64, data: &[u8]) {
        self.c.ok(Command::RegionWrite, &RegionAccess::to_bytes_with_data(offset, 0, data), &[]);
    }

    fn reg_read32(&mut self, offset: u64) -> u32 {
        let r = self.c.ok(Command::RegionRead, &RegionAccess { offset, region: 0, count: 4 }.to_bytes(), &[]);
        u32_at(&r.payload, 16)
    }

    fn enable(&mut self) {
        self.reg_write(0x24, &(((QSIZE - 1) << 16 | (QSIZE - 1)) as u32).to_le_bytes());
        self.reg_write(0x28, &ASQ.to_le_bytes());
        self.reg_write(0x30, &ACQ.to_le_bytes());
        self.reg_write(0x14, &0x0046_0001u32.to_le_bytes());
        assert_eq!(self.reg_read32(0x1c) & 3, 1, "CSTS.RDY, no CFS");
    }

    /// Submits a command on queue `q` (0 admin, 1 I/O) and returns its status
    /// (the CQE's status field without the phase tag).
    fn submit(&mut self, q: usize, opcode: u8, nsid: u32, prp1: u64, cdw: [u32; 3]) -> u16 {
        self.cid += 1;
        let mut sqe = [0u8; 64];
        sqe[0] = opcode;
        sqe[2..4].copy_from_slice(&self.cid.to_le_bytes());
        sqe[4..8].copy_from_slice(&nsid.to_le_bytes());
        sqe[24..32].copy_from_slice(&prp1.to_le_bytes());
        for (i, d) in cdw.iter().enumerate() {
            sqe[40 + 4 * i..44 + 4 * i].copy_from_slice(&d.to_le_bytes());
        }
        let (sq, cq) = if q == 0 { (ASQ, ACQ) } else { (IOSQ, IOCQ) };
        self.write_mem(sq + self.tails[q] * 64, &sqe);
        self.tails[q] = (self.tails[q] + 1) % QSIZE;
        self.reg_write(0x1000 + 8 * q as u64, &(self.tails[q] as u32).to_le_bytes());
        let cqe = self.read_mem(cq + self.heads[q] * 16, 16);
        let st = u16::from_le_bytes([cqe[14], cqe[15]]);
        assert_eq!(st & 1 == 1, self.phase[q], "a completion was posted");
        assert_eq!(u16::from_le_bytes([cqe[12], cqe[13]]), self.cid);
        self.heads[q] = (self.heads[q] + 1) % QSIZE;
        if self.heads[q] == 0 {
            self.phase[q] = !self.phase[q];
        }
        self.reg_write(0x1004 + 8 * q as u64, &(self.heads[q] as u32).to_le_bytes());
        st >> 1
    }

    fn identify(&mut self, buf: u64) -> u16 {
        self.submit(0, 0x06, 0, buf, [1, 0, 0])
    }

    fn create_io_queues(&mut self) {
        let size = ((QSIZE - 1) as u32) << 16;
        assert_eq!(self.submit(0, 0x05, 0, IOCQ, [size | 1, 1, 0]), 0, "Create I/O CQ 1");
        assert_eq!(self.submit(0, 0x01, 0, IOSQ, [size | 1, 1 << 16 | 1, 0]), 0, "Create I/O SQ 1");
    }

    /// Reads (or writes) LBA 0 to (or from) `buf`; 512 bytes.
    fn rw(&mut self, write: bool, buf: u64) -> u16 {
        self.submit(1, if write { 0x01 } else { 0x02 }, 1, buf, [0, 0, 0])
    }
}

const DATA_TRANSFER_ERROR: u16 = 0x004;

#[test]
fn a_read_after_dma_unmap_fails_instead_of_writing_the_unmapped_memory() {
    let (c, _, h) = serve("nvme,doorbell=mmio,size_mb=1");
    let mut d = NvmeDriver::new(c);
    d.c.version();
    d.map(BASE, ram(0x10000));
    let b = ram(0x1000);
    let unmapped = b.try_clone().unwrap();
    d.map(0x10_0000, b);
    d.enable();
    d.create_io_queues();
    d.write_mem(DATA, &[0x5a; 512]);
    assert_eq!(d.rw(true, DATA), 0);
    assert_eq!(d.rw(false, 0x10_0000), 0);
    assert_eq!(d.read_mem(0x10_0000, 512), [0x5a; 512]);
    // The client takes the page back (passing its fd along, as some do).
    let unmap = DmaUnmap::new(0, 0x10_0000, 0x1000).to_bytes();
    d.c.ok(Command::DmaUnmap, &unmap, &[unmapped.as_raw_fd()]);
    unmapped.write_all_at(&[0xaa; 512], 0).unwrap();
    assert_eq!(d.rw(false, 0x10_0000), DATA_TRANSFER_ERROR, "the page is no longer guest memory");
    let mut after = [0u8; 512];
    unmapped.read_exact_at(&mut after, 0).unwrap();
    assert_eq!(after, [0xaa; 512], "the device wrote memory the client took back");
    assert_eq!(d.rw(false, DATA), 0, "the rest of guest memory still works");
    drop(d);
    h.join().unwrap().unwrap();
}

#[test]
fn dma_maps_come_in_any_order_and_overlaps_are_refused() {
    let (c, _, h) = serve("nvme,doorbell=mmio,backend=null");
    let mut d = NvmeDriver::new(c);
    d.c.version();
    // QEMU maps RAM in the order its memory listener sees it: high first here.
    d.map(0x10_0000, ram(0x1000));
    d.map(BASE, ram(0x10000));
    let e = d.c.dma_map(BASE + 0x8000, 0x10000, Some(&ram(0x10000)));
    assert_eq!((e.hdr.is_error(), e.hdr.error_no), (true, libc::EEXIST as u32));
    assert_eq!(d.c.dma_map(0x10_0800, 0x800, None).hdr.error_no, libc::EEXIST as u32, "without an fd too");
    d.enable();
    assert_eq!(d.identify(0x10_0000), 0, "the lower and the higher map both reach the device");
    assert_eq!(u16::from_le_bytes(d.read_mem(0x10_0000, 2).try_into().unwrap()), 0x1234);
    drop(d);
    h.join().unwrap().unwrap();
}

#[test]
fn dma_map_without_an_fd_is_accepted_and_a_client_that_refuses_dma_gets_transfer_errors() {
    let (c, _, h) = serve("nvme,doorbell=mmio,backend=null");
    let mut d = NvmeDriver::new(c);
    d.c.version();
    // QEMU without share=on memory: RAM comes without an fd, and first.
    let r = d.c.dma_map(0x20_0000, 0x10_0000, None);
    assert!(!r.hdr.is_error(), "DMA_MAP without an fd: errno {}", r.hdr.error_no);
    d.map(BASE, ram(0x10000));
    d.enable();
    // The server asks with DMA_WRITE; this client refuses.
    assert_eq!(d.identify(0x20_0000), DATA_TRANSFER_ERROR, "no access is faked");
    assert!(d.c.refused_dma > 0, "the server asked the client");
    assert_eq!(d.identify(IDENT), 0);
    d.c.ok(Command::DmaUnmap, &DmaUnmap::new(0, 0x20_0000, 0x10_0000).to_bytes(), &[]);
    drop(d);
    h.join().unwrap().unwrap();
}

/// The capabilities object of a VERSION reply.
fn version_reply(c: &mut Client, minor: u16, json: Option<Value>) -> (u16, serde_json::Map<String, Value>) {
    let mut p = [0u16.to_le_bytes(), minor.to_le_bytes()].concat();
    if let Some(j) = json {
        p.extend_from_slice(j.to_string().as_bytes());
        p.push(0);
    }
    let r = c.ok(Command::Version, &p, &[]);
    let v = Version::parse(&r.payload).unwrap();
    let (0, Some(0)) = (v.major, r.payload.last().copied()) else { panic!("major {} or no JSON", v.major) };
    let j: Value = serde_json::from_slice(&r.payload[4..r.payload.len() - 1]).unwrap();
    (v.minor, j["capabilities"].as_object().unwrap().clone())
}

fn num(caps: &serde_json::Map<String, Value>, key: &str) -> u64 {
    caps[key].as_u64().unwrap()
}

#[test]
fn the_version_reply_is_a_subset_of_what_the_client_proposed() {
    // rust-vmm's client: minor 1, max_msg_fds 1, migration.pgsize.
    let (mut c, _, h) = serve("pci-testdev");
    let rust_vmm = json!({"capabilities": {"max_msg_fds": 1, "max_data_xfer_size": 1048576,
        "migration": {"pgsize": 4096}}});
    let (minor, caps) = version_reply(&mut c, 1, Some(rust_vmm));
    assert_eq!(minor, 1);
    assert!(num(&caps, "max_msg_fds") <= 1 && num(&caps, "max_data_xfer_size") <= 1 << 20, "{caps:?}");
    assert_eq!(num(&caps, "pgsizes"), 4096);
    for key in ["twin_socket", "migration"] {
        assert!(!caps.contains_key(key), "{key} was not offered: {caps:?}");
    }
    assert!(caps.get("write_multiple").is_none_or(|v| v.as_bool() == Some(false)), "not proposed: {caps:?}");
    // The server then sends no more fds in one message than the client takes:
    // pci-testdev has two ioeventfds on BAR0.
    let r = c.ok(Command::DeviceGetRegionIoFds, &IoFdsRequest { argsz: 4096, index: 0 }.to_bytes(), &[]);
    let io = IoFdsReply::parse(&r.payload).unwrap();
    assert!(r.fds.len() <= 1 && io.entries.iter().all(|e| (e.fd_index() as usize) < r.fds.len()), "{io:?}");
    drop(c);
    h.join().unwrap().unwrap();

    // A client proposing small limits and several page sizes, twin sockets
    // and REGION_WRITE_MULTI.
    let (mut c, _, h) = serve("pci-testdev");
    let small = json!({"capabilities": {"max_msg_fds": 4, "max_data_xfer_size": 4096, "max_dma_maps": 10,
        "pgsizes": 0x20_1000u64 | 0x800, "twin_socket": {"supported": true}, "write_multiple": true}});
    let (minor, caps) = version_reply(&mut c, 9, Some(small));
    assert!(minor <= 2);
    assert!(num(&caps, "max_msg_fds") <= 4 && num(&caps, "max_data_xfer_size") <= 4096, "{caps:?}");
    assert!(num(&caps, "max_dma_maps") <= 10, "{caps:?}");
    let pg = num(&caps, "pgsizes");
    assert!(pg != 0 && pg & !0x20_1000 == 0, "a subset of the client's, none below 4 KiB (QEMU): {pg:#x}");
    assert_eq!(caps.get("write_multiple"), Some(&Value::Bool(true)), "proposed and implemented");
    assert!(!caps.contains_key("twin_socket"), "not implemented: {caps:?}");
    // max_dma_maps holds: the eleventh map is refused.
    for i in 0..10 {
        assert!(!c.dma_map(i << 12, 0x1000, None).hdr.is_error());
    }
    assert_eq!(c.dma_map(10 << 12, 0x1000, None).hdr.error_no, libc::ENOSPC as u32);
    drop(c);
    h.join().unwrap().unwrap();

    // No JSON at all (QEMU before capabilities; defaults apply): the reply
    // still carries JSON (rust-vmm's client requires it), within the defaults.
    let (mut c, _, h) = serve("pci-testdev");
    let (minor, caps) = version_reply(&mut c, 0, None);
    assert_eq!(minor, 0);
    assert!(num(&caps, "max_msg_fds") <= 1 && num(&caps, "max_data_xfer_size") <= 1 << 20, "{caps:?}");
    drop(c);
    h.join().unwrap().unwrap();
}

/// GET_IRQ_INFO offers INTx only where the Interrupt Pin is set, as kernel
/// VFIO does: pci-testdev has none (as QEMU's), virtio-blk INTA#; a device
/// without one takes no INTx vector, but may have it disabled.
#[test]
fn intx_is_offered_where_the_interrupt_pin_is_set() {
    for (dev, pin) in [("pci-testdev", 0u8), ("nvme,doorbell=mmio,backend=null", 0), ("virtio-blk,backend=null", 1)] {
        let (mut c, _, h) = serve(dev);
        c.version();
        let q = RegionAccess { offset: 0x3c, region: PCI_CONFIG_REGION_INDEX, count: 4 };
        let r = c.ok(Command::RegionRead, &q.to_bytes(), &[]);
        let (_, cfg) = RegionAccess::parse_with_data(&r.payload).unwrap();
        assert_eq!(cfg[1], pin, "{dev}: Interrupt Pin");
        let r = c.ok(Command::DeviceGetIrqInfo, &IrqInfo::request(PCI_INTX_IRQ_INDEX).to_bytes(), &[]);
        let info = IrqInfo::parse(&r.payload).unwrap();
        assert_eq!(info.count, pin as u32, "{dev}: INTx vectors");
        assert_eq!(info.flags, IRQ_INFO_EVENTFD | IRQ_INFO_MASKABLE | IRQ_INFO_AUTOMASKED, "{dev}");
        let trig = EventFd::new(EFD_NONBLOCK).unwrap();
        let set = c.set_irqs(
            IRQ_SET_DATA_EVENTFD | IRQ_SET_ACTION_TRIGGER,
            PCI_INTX_IRQ_INDEX,
            0,
            1,
            &[],
            &[trig.as_raw_fd()],
        );
        assert_eq!(set.hdr.is_error(), pin == 0, "{dev}: a trigger eventfd for INTx");
        let off = c.set_irqs(IRQ_SET_DATA_NONE | IRQ_SET_ACTION_TRIGGER, PCI_INTX_IRQ_INDEX, 0, 0, &[], &[]);
        assert!(!off.hdr.is_error(), "{dev}: disabling INTx");
        drop(c);
        h.join().unwrap().unwrap();
    }
}

/// INTx is automasked (GET_IRQ_INFO says so): an assertion masks it until
/// the client unmasks, and a device reset does not unmask it, as kernel
/// VFIO keeps its mask across VFIO_DEVICE_RESET. Trigger, reset, trigger:
/// no second signal until UNMASK.
#[test]
fn intx_stays_masked_after_an_assertion_until_unmasked_across_a_device_reset() {
    let (mut c, irq, h) = serve("virtio-blk,backend=null");
    c.version();
    let trig = EventFd::new(EFD_NONBLOCK).unwrap();
    let (efd, none) = (IRQ_SET_DATA_EVENTFD, IRQ_SET_DATA_NONE);
    let (trigger, unmask) = (IRQ_SET_ACTION_TRIGGER, IRQ_SET_ACTION_UNMASK);
    assert!(!c.set_irqs(efd | trigger, PCI_INTX_IRQ_INDEX, 0, 1, &[], &[trig.as_raw_fd()]).hdr.is_error());
    Interrupts::set_intx(&*irq, true);
    assert!(signalled(&trig), "the first assertion");
    assert!(irq.intx_masked(), "automasked");
    c.ok(Command::DeviceReset, &[], &[]);
    Interrupts::set_intx(&*irq, false); // the reset lowered the line
    Interrupts::set_intx(&*irq, true); // and the device raises it again
    assert!(!signalled(&trig), "masked since the first assertion, reset or not: no signal before UNMASK");
    assert!(!c.set_irqs(none | unmask, PCI_INTX_IRQ_INDEX, 0, 1, &[], &[]).hdr.is_error());
    assert!(signalled(&trig), "unmasked while high: signalled, once");
    assert!(!signalled(&trig));
    Interrupts::set_intx(&*irq, false);
    Interrupts::set_intx(&*irq, true);
    assert!(!signalled(&trig), "masked again by the re-assertion on unmask");
    Interrupts::set_intx(&*irq, false);
    assert!(!c.set_irqs(none | unmask, PCI_INTX_IRQ_INDEX, 0, 1, &[], &[]).hdr.is_error());
    assert!(!signalled(&trig) && !irq.intx_masked(), "unmasked while low: nothing to signal");
    Interrupts::set_intx(&*irq, true);
    assert!(signalled(&trig), "unmasked: the next assertion signals");
    drop(c);
    h.join().unwrap().unwrap();
}

#[test]
fn intx_with_a_trigger_eventfd_only_and_by_value_actions() {
    let (mut c, irq, h) = serve("virtio-blk,backend=null");
    c.version();
    let trig = EventFd::new(EFD_NONBLOCK).unwrap();
    let t = [trig.as_raw_fd()];
    let (none, boolean, efd) = (IRQ_SET_DATA_NONE, IRQ_SET_DATA_BOOL, IRQ_SET_DATA_EVENTFD);
    let (mask, unmask, trigger) = (IRQ_SET_ACTION_MASK, IRQ_SET_ACTION_UNMASK, IRQ_SET_ACTION_TRIGGER);
    // QEMU without KVM's resampling irqfd: a trigger eventfd, no unmask one.
    assert!(!c.set_irqs(efd | trigger, PCI_INTX_IRQ_INDEX, 0, 1, &[], &t).hdr.is_error());
    Interrupts::set_intx(&*irq, true);
    assert!(signalled(&trig), "INTx asserted on the trigger eventfd");
    // Automasked: the client's unmask (after the guest's EOI) asserts again
    // while the line is still high.
    assert!(!c.set_irqs(none | unmask, PCI_INTX_IRQ_INDEX, 0, 1, &[], &[]).hdr.is_error());
    assert!(signalled(&trig), "still high: asserted again on unmask");
    assert!(!c.set_irqs(none | mask, PCI_INTX_IRQ_INDEX, 0, 1, &[], &[]).hdr.is_error());
    Interrupts::set_intx(&*irq, false);
    Interrupts::set_intx(&*irq, true);
    assert!(!signalled(&trig), "masked");
    assert!(!c.set_irqs(boolean | unmask, PCI_INTX_IRQ_INDEX, 0, 1, &[1], &[]).hdr.is_error());
    assert!(signalled(&trig), "unmasked while high");
    Interrupts::set_intx(&*irq, false);
    assert!(!c.set_irqs(none | unmask, PCI_INTX_IRQ_INDEX, 0, 1, &[], &[]).hdr.is_error());
    assert!(!signalled(&trig), "low: nothing to assert");
    // ACTION_TRIGGER by value signals the trigger eventfd (DATA_BOOL where true).
    assert!(!c.set_irqs(none | trigger, PCI_INTX_IRQ_INDEX, 0, 1, &[], &[]).hdr.is_error());
    assert!(signalled(&trig), "DATA_NONE trigger");
    assert!(!c.set_irqs(boolean | trigger, PCI_INTX_IRQ_INDEX, 0, 1, &[0], &[]).hdr.is_error());
    assert!(!signalled(&trig), "false: no trigger");
    assert!(!c.set_irqs(boolean | trigger, PCI_INTX_IRQ_INDEX, 0, 1, &[1], &[]).hdr.is_error());
    assert!(signalled(&trig), "true: trigger");
    // An eventfd for masking events is not offered; the trigger stays.
    assert!(c.set_irqs(efd | mask, PCI_INTX_IRQ_INDEX, 0, 1, &[], &t).hdr.is_error());
    Interrupts::set_intx(&*irq, true);
    assert!(signalled(&trig), "the trigger eventfd survived a refused request");
    Interrupts::set_intx(&*irq, false);
    // No fds de-assigns the trigger; count 0 with DATA_NONE disables INTx.
    assert!(!c.set_irqs(efd | trigger, PCI_INTX_IRQ_INDEX, 0, 1, &[], &[]).hdr.is_error());
    Interrupts::set_intx(&*irq, true);
    assert!(!signalled(&trig) && irq.intx_fds().is_none(), "de-assigned");
    Interrupts::set_intx(&*irq, false);
    assert!(!c.set_irqs(efd | trigger, PCI_INTX_IRQ_INDEX, 0, 1, &[], &t).hdr.is_error());
    assert!(!c.set_irqs(none | trigger, PCI_INTX_IRQ_INDEX, 0, 0, &[], &[]).hdr.is_error());
    assert!(irq.intx_fds().is_none(), "disabled");
    drop(c);
    h.join().unwrap().unwrap();
}

#[test]
fn msix_eventfds_from_set_irqs_carry_the_vectors_the_device_raises() {
    let (c, irq, h) = serve("nvme,doorbell=mmio,backend=null");
    let mut d = NvmeDriver::new(c);
    d.c.version();
    let (none, boolean, efd) = (IRQ_SET_DATA_NONE, IRQ_SET_DATA_BOOL, IRQ_SET_DATA_EVENTFD);
    let (mask, unmask, trigger) = (IRQ_SET_ACTION_MASK, IRQ_SET_ACTION_UNMASK, IRQ_SET_ACTION_TRIGGER);
    // QEMU keeps the table and masks vectors itself: MSI-X is not MASKABLE
    // here, nor NORESIZE (vectors are added one at a time, as QEMU does).
    let info = d.c.ok(Command::DeviceGetIrqInfo, &IrqInfo::request(PCI_MSIX_IRQ_INDEX).to_bytes(), &[]);
    let info = IrqInfo::parse(&info.payload).unwrap();
    assert_eq!((info.flags, info.count), (IRQ_INFO_EVENTFD, 65));
    for action in [mask, unmask] {
        assert!(d.c.set_irqs(none | action, PCI_MSIX_IRQ_INDEX, 0, 1, &[], &[]).hdr.is_error());
    }
    let fds: Vec<EventFd> = (0..2).map(|_| EventFd::new(EFD_NONBLOCK).unwrap()).collect();
    let raw: Vec<RawFd> = fds.iter().map(|f| f.as_raw_fd()).collect();
    assert!(!irq.msix_host_owned());
    assert!(!d.c.set_irqs(efd | trigger, PCI_MSIX_IRQ_INDEX, 0, 2, &[], &raw).hdr.is_error());
    assert!(irq.msix_host_owned(), "the client keeps the table");
    // ACTION_TRIGGER by value signals the vector's eventfd.
    assert!(!d.c.set_irqs(none | trigger, PCI_MSIX_IRQ_INDEX, 1, 1, &[], &[]).hdr.is_error());
    assert!(signalled(&fds[1]) && !signalled(&fds[0]));
    assert!(!d.c.set_irqs(boolean | trigger, PCI_MSIX_IRQ_INDEX, 0, 2, &[1, 0], &[]).hdr.is_error());
    assert!(signalled(&fds[0]) && !signalled(&fds[1]));
    assert!(d.c.set_irqs(none | trigger, PCI_MSIX_IRQ_INDEX, 64, 2, &[], &[]).hdr.is_error(), "past the vectors");
    // The controller raises vector 0 for the admin CQ; QEMU never forwards
    // table writes, so the controller's own table is still masked.
    d.map(BASE, ram(0x10000));
    d.enable();
    assert_eq!(d.identify(IDENT), 0);
    assert!(signalled(&fds[0]), "the admin completion reached vector 0's eventfd");
    // No fds de-assigns: a vector raised then is held and fires when the
    // client gives it an eventfd again.
    assert!(!d.c.set_irqs(efd | trigger, PCI_MSIX_IRQ_INDEX, 0, 1, &[], &[]).hdr.is_error());
    assert_eq!(d.identify(IDENT), 0);
    assert!(!signalled(&fds[0]));
    let again = EventFd::new(EFD_NONBLOCK).unwrap();
    assert!(!d.c.set_irqs(efd | trigger, PCI_MSIX_IRQ_INDEX, 0, 1, &[], &[again.as_raw_fd()]).hdr.is_error());
    assert!(signalled(&again), "the held vector fired");
    // count 0 with DATA_NONE disables the index: the table is the device's again.
    assert!(!d.c.set_irqs(none | trigger, PCI_MSIX_IRQ_INDEX, 0, 0, &[], &[]).hdr.is_error());
    assert!(!irq.msix_host_owned());
    drop(d);
    h.join().unwrap().unwrap();
}

#[test]
fn nvme_ioeventfd_doorbells_are_announced_before_any_queue_on_one_fd() {
    // A client that takes one fd per message (rust-vmm's) still gets every I/O
    // doorbell: the controller rings all 128 on one eventfd, sent once.
    let (mut c, _, h) = serve("nvme,doorbell=ioeventfd,backend=null");
    let one = json!({"capabilities": {"max_msg_fds": 1}});
    let (_, caps) = version_reply(&mut c, 2, Some(one));
    assert!(num(&caps, "max_msg_fds") <= 1, "{caps:?}");
    let r = c.ok(Command::DeviceGetRegionIoFds, &IoFdsRequest { argsz: 1 << 16, index: 0 }.to_bytes(), &[]);
    let io = IoFdsReply::parse(&r.payload).unwrap();
    assert_eq!(r.fds.len(), 1, "{io:?}");
    let mut offsets = Vec::new();
    for e in &io.entries {
        match *e {
            IoFdEntry::IoEventFd { offset, size: 4, fd_index: 0, flags: 0, .. } => offsets.push(offset),
            _ => panic!("{e:?}"),
        }
    }
    offsets.sort();
    let want: Vec<u64> = (1..=64u64).flat_map(|q| [0x1000 + 8 * q, 0x1004 + 8 * q]).collect();
    assert_eq!(offsets, want, "SQ tail and CQ head of every I/O queue, no admin doorbell");
    drop(c);
    h.join().unwrap().unwrap();
}

/// libvfio-user's clients (its `client` sample; `tran_sock`) ask for a region's info with argsz
/// 32 and no room for ancillary data, then again with the argsz the reply asks for: the short
/// reply must carry no fd (one there truncates the message: MSG_CTRUNC, the client fails with
/// EFAULT), the full one the capability and its fd (QEMU and the rust-vmm client take that one).
#[test]
fn a_region_info_reply_too_short_for_its_capability_carries_no_fd() {
    let (mut c, _, h) = serve("nvme,backend=null");
    c.version();
    let r = c.ok(Command::DeviceGetRegionInfo, &RegionInfo::request(0, 32).to_bytes(), &[]);
    let short = RegionInfoReply::parse(&r.payload).unwrap();
    assert_eq!((r.payload.len(), r.fds.len()), (32, 0), "the fixed part alone, no fd");
    assert_eq!(short.info.flags & REGION_INFO_FLAG_CAPS, 0);
    assert!(short.info.argsz > 32, "argsz says what the capability needs: {:?}", short.info);
    let r = c.ok(Command::DeviceGetRegionInfo, &RegionInfo::request(0, short.info.argsz).to_bytes(), &[]);
    let full = RegionInfoReply::parse(&r.payload).unwrap();
    assert_eq!(full.sparse_mmap, Some(vec![SparseMmapArea { offset: 0x1000, size: 0x1000 }]));
    assert_eq!(r.fds.len(), 1, "the doorbell page's fd, with its capability");
    drop(c);
    h.join().unwrap().unwrap();
}

/// The NVMe function is PCI Express: a 4 KiB configuration region whose extended space reads 0
/// (a 0 header at 0x100: no extended capability), accesses past it refused; a conventional
/// function (pci-testdev) keeps 256 bytes.
#[test]
fn an_express_function_has_a_4k_configuration_region_reading_0_past_the_header() {
    for (dev, size) in [("nvme,doorbell=mmio,backend=null", 4096u64), ("pci-testdev", 256)] {
        let (mut c, _, h) = serve(dev);
        c.version();
        let q = RegionInfo::request(PCI_CONFIG_REGION_INDEX, 32);
        let r = c.ok(Command::DeviceGetRegionInfo, &q.to_bytes(), &[]);
        let info = RegionInfoReply::parse(&r.payload).unwrap().info;
        assert_eq!(info.size, size, "{dev}: configuration region size");
        let read = |c: &mut Client, offset: u64| {
            let q = RegionAccess { offset, region: PCI_CONFIG_REGION_INDEX, count: 4 };
            let r = c.call(Command::RegionRead, &q.to_bytes(), &[]);
            (!r.hdr.is_error()).then(|| u32_at(RegionAccess::parse_with_data(&r.payload).unwrap().1, 0))
        };
        if size == 4096 {
            assert_eq!(read(&mut c, 0x100), Some(0), "{dev}: no extended capability at 0x100");
            assert_eq!(read(&mut c, 0xffc), Some(0), "{dev}");
        }
        assert_eq!(read(&mut c, size), None, "{dev}: past the region");
        drop(c);
        h.join().unwrap().unwrap();
    }
}
