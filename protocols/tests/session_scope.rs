//! What a client makes the device process hold belongs to its session and is
//! bounded: ioregionfd region fds (and their threads) end with the session
//! that got them, and repeated requests for regions or INTx resample fds
//! start no thread each. The servers run in this process, on socketpairs,
//! so the tests count this process's threads (/proc/self/task).

use iopath_devices::irq::IrqLines;
use iopath_devices::{Counter, DeviceConfig, Interrupts};
use iopath_protocols::function::PciFunction;
use iopath_protocols::mpqemu::{self, MpqemuServer};
use iopath_protocols::socket;
use iopath_protocols::vfio_user::ioregionfd::RegionClient;
use iopath_protocols::vfio_user::wire::*;
use iopath_protocols::vfio_user::{IoFds, VfioUserServer};
use iopath_protocols::Server;
use std::fs::File;
use std::io::Read;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

/// The tests count threads: one at a time.
static THREADS: Mutex<()> = Mutex::new(());

fn serial() -> MutexGuard<'static, ()> {
    THREADS.lock().unwrap_or_else(|e| e.into_inner())
}

/// Threads of this process now.
fn threads() -> usize {
    std::fs::read_dir("/proc/self/task").unwrap().count()
}

/// Threads a test may see come and go besides the server's own (the test
/// harness, a session's reader thread, one region thread per BAR).
const SLACK: usize = 8;

fn function(device: &str) -> Arc<Mutex<PciFunction>> {
    let dev = device.parse::<DeviceConfig>().unwrap().build().unwrap();
    Arc::new(Mutex::new(PciFunction::new(dev).unwrap()))
}

/// A server thread that serves one client after another, as `iopath serve`
/// on a listening socket does, and says when each session is over.
struct Served {
    clients: Option<Sender<UnixStream>>,
    ended: Receiver<()>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Served {
    fn start(mut server: Box<dyn Server>) -> Served {
        let (clients, next) = channel::<UnixStream>();
        let (done, ended) = channel();
        let thread = std::thread::spawn(move || {
            for (n, sock) in next.into_iter().enumerate() {
                if let Err(e) = server.session(&sock, &format!("client {n}")) {
                    eprintln!("session {n}: {e}");
                }
                done.send(()).unwrap();
            }
        });
        Served { clients: Some(clients), ended, thread: Some(thread) }
    }

    /// A new client's end of its socket.
    fn connect(&self) -> UnixStream {
        let (mine, theirs) = UnixStream::pair().unwrap();
        self.clients.as_ref().unwrap().send(theirs).unwrap();
        mine.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        mine
    }

    /// Waits until the server is done with the client that left.
    fn session_ended(&self) {
        self.ended.recv_timeout(Duration::from_secs(30)).expect("the session never ended");
    }
}

impl Drop for Served {
    fn drop(&mut self) {
        self.clients.take();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// One vfio-user request and its reply: (error flag, errno, payload, fds).
fn request(sock: &UnixStream, id: u16, cmd: Command, payload: &[u8], fds: &[RawFd]) -> (bool, u32, Vec<u8>, Vec<File>) {
    socket::send(sock, &[&message(id, cmd, FLAGS_TYPE_COMMAND, payload)], fds).unwrap();
    let mut h = [0u8; HEADER_SIZE];
    let mut files = socket::recv_exact(sock, &mut h).unwrap();
    let r = Header::parse(&h);
    let mut p = vec![0u8; r.payload_len().unwrap()];
    files.extend(socket::recv_exact(sock, &mut p).unwrap());
    assert_eq!((r.msg_id, r.cmd), (id, cmd as u16), "a reply to another request");
    (r.is_error(), r.error_no, p, files)
}

fn version(sock: &UnixStream) {
    let caps = Capabilities { max_msg_fds: 16, ..Default::default() };
    let v = Version { major: VERSION_MAJOR, minor: VERSION_MINOR, capabilities: Some(caps) };
    let (err, errno, _, _) = request(sock, 1, Command::Version, &v.to_bytes(), &[]);
    assert!(!err, "VERSION refused: errno {errno}");
}

/// GET_REGION_IO_FDS for BAR `bar`: the one ioregionfd region's fd.
fn region_fd(sock: &UnixStream, id: u16, bar: u32) -> File {
    let q = IoFdsRequest { argsz: 4096, index: bar };
    let (err, errno, p, mut fds) = request(sock, id, Command::DeviceGetRegionIoFds, &q.to_bytes(), &[]);
    assert!(!err, "GET_REGION_IO_FDS refused: errno {errno}");
    let r = IoFdsReply::parse(&p).unwrap();
    assert!(matches!(r.entries[..], [IoFdEntry::IoRegionFd { .. }]), "{:?}", r.entries);
    assert_eq!(fds.len(), 1);
    fds.pop().unwrap()
}

fn region_client(fd: File) -> RegionClient {
    RegionClient::new(UnixStream::from(OwnedFd::from(fd)), 0, 4096, 0, false)
}

/// What pci-testdev shows: its counters and the header of BAR0's current
/// test (the `offset` field, which names the test; reading it counts nothing).
fn device_state(f: &Mutex<PciFunction>) -> (Vec<Counter>, u32) {
    let mut g = f.lock().unwrap();
    let mut b = [0u8; 4];
    g.bar_read(0, 4, &mut b);
    (g.counters(), u32::from_le_bytes(b))
}

/// Reads what is on `fd` within 5 s: Some(0) is EOF, None nothing came.
fn read_within(fd: &UnixStream) -> Option<usize> {
    fd.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut b = [0u8; 64];
    match (&*fd).read(&mut b) {
        Ok(n) => Some(n),
        Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => None,
        Err(e) => panic!("reading a region fd: {e}"),
    }
}

/// D6: client A gets BAR0's region fd and leaves without closing it; client
/// B connects and selects a test. Nothing A sends on its old fd reaches the
/// device (B's registers and the counters are unchanged), and the fd reads
/// EOF; B's own region works.
#[test]
fn a_region_fd_kept_by_a_client_that_left_no_longer_reaches_the_device() {
    let _g = serial();
    let f = function("pci-testdev");
    let served =
        Served::start(Box::new(VfioUserServer::new(f.clone(), IrqLines::new(), IoFds::IoRegionFds { posted: false })));
    let a = served.connect();
    version(&a);
    let fd = region_fd(&a, 2, 0);
    let raw = UnixStream::from(OwnedFd::from(fd.try_clone().unwrap()));
    let mut old = region_client(fd);
    old.write(0, 1, 0).unwrap(); // A selects test 0: the region works in its session
    drop(a);
    served.session_ended();

    let b = served.connect();
    version(&b);
    // B selects test 2 through REGION_WRITE.
    let w = RegionAccess::to_bytes_with_data(0, 0, &[2]);
    let (err, errno, _, _) = request(&b, 3, Command::RegionWrite, &w, &[]);
    assert!(!err, "REGION_WRITE refused: errno {errno}");
    let before = device_state(&f);

    // A, on its old fd: selects test 1 (as a CC=0 would disable), reads data.
    let wrote = old.write(0, 1, 1);
    let read = old.read(8, 4);
    assert_eq!(device_state(&f), before, "a write or read on A's old region fd reached the device");
    assert!(wrote.is_err() && read.is_err(), "A's old region fd is served: write {wrote:?}, read {read:?}");
    assert_eq!(read_within(&raw), Some(0), "A's old region fd must read EOF");

    // B's own region is served.
    let mut mine = region_client(region_fd(&b, 4, 0));
    assert_eq!(mine.read(4, 4).unwrap() as u32, before.1, "B's region reads B's test");
    drop(mine);
    drop(b);
    served.session_ended();
}

/// D6: 300 GET_REGION_IO_FDS for the BARs in one session, every fd kept,
/// start no thread each; when the client leaves (still holding them), the
/// region threads are gone and every fd it kept reads EOF.
#[test]
fn repeated_region_requests_keep_one_thread_per_bar_for_the_session_only() {
    let _g = serial();
    let f = function("pci-testdev");
    let served = Served::start(Box::new(VfioUserServer::new(f, IrqLines::new(), IoFds::IoRegionFds { posted: true })));
    let c = served.connect();
    version(&c);
    let start = threads();
    let mut kept = Vec::new();
    for i in 0..300u16 {
        kept.push(region_fd(&c, 2 + i, (i % 2) as u32));
        let n = threads();
        assert!(n <= start + SLACK, "after {} requests: {n} threads, {start} at the start", i + 1);
    }
    // The fds kept are all served (the same two regions).
    let mut last = region_client(kept.pop().unwrap().try_clone().unwrap());
    assert_eq!(last.read(0, 1).unwrap(), 0);
    drop(c);
    served.session_ended();
    let n = threads();
    assert!(n <= start, "the session is over: {n} threads, {start} while it ran");
    for fd in kept {
        let s = UnixStream::from(OwnedFd::from(fd));
        assert_eq!(read_within(&s), Some(0), "a region fd of an ended session must read EOF");
    }
}

/// An INTx trigger and the resample fd the client gives last; the device
/// raises INTx, and a resample while the level is high asserts again.
fn intx_still_works(irq: &IrqLines, trigger: &EventFd, resample: &EventFd) {
    irq.set_intx(true);
    assert!(iopath_devices::irq::wait_readable(trigger, Duration::from_secs(5)), "INTx not asserted");
    assert_eq!(trigger.read().unwrap(), 1);
    resample.write(1).unwrap(); // the guest's EOI while the level is high
    assert!(iopath_devices::irq::wait_readable(trigger, Duration::from_secs(5)), "no re-assert on resample");
    assert_eq!(trigger.read().unwrap(), 1);
    irq.set_intx(false);
}

fn set_irqs(sock: &UnixStream, id: u16, action: u32, fd: RawFd) {
    let q =
        IrqSet { flags: IRQ_SET_DATA_EVENTFD | action, index: PCI_INTX_IRQ_INDEX, start: 0, count: 1, data: vec![] };
    let (err, errno, _, _) = request(sock, id, Command::DeviceSetIrqs, &q.to_bytes(), &[fd]);
    assert!(!err, "SET_IRQS refused: errno {errno}");
}

/// D8, vfio-user: 2,000 SET_IRQS giving INTx an unmask (resample) eventfd
/// start no thread each; INTx still works with the last one.
#[test]
fn repeated_intx_unmask_eventfds_start_no_thread_each() {
    let _g = serial();
    let irq = IrqLines::new();
    // virtio-blk: INTA# (pci-testdev has no INTx).
    let srv = VfioUserServer::new(function("virtio-blk,backend=null"), irq.clone(), IoFds::IoEventFds);
    let served = Served::start(Box::new(srv));
    let c = served.connect();
    version(&c);
    let trigger = EventFd::new(EFD_NONBLOCK).unwrap();
    set_irqs(&c, 2, IRQ_SET_ACTION_TRIGGER, trigger.as_raw_fd());
    let start = threads();
    let mut resample = EventFd::new(EFD_NONBLOCK).unwrap();
    for i in 0..2000u16 {
        resample = EventFd::new(EFD_NONBLOCK).unwrap();
        set_irqs(&c, 3 + i, IRQ_SET_ACTION_UNMASK, resample.as_raw_fd());
        if i % 50 == 0 {
            let n = threads();
            assert!(n <= start + SLACK, "after {} SET_IRQS: {n} threads, {start} at the start", i + 1);
        }
    }
    let n = threads();
    assert!(n <= start + SLACK, "after 2000 SET_IRQS: {n} threads, {start} at the start");
    intx_still_works(&irq, &trigger, &resample);
    drop(c);
    served.session_ended();
}

/// D8, mpqemu: 2,000 SET_IRQFD start no thread each; INTx still works with
/// the last pair.
#[test]
fn repeated_mpqemu_set_irqfd_starts_no_thread_each() {
    let _g = serial();
    let irq = IrqLines::new();
    let served = Served::start(Box::new(MpqemuServer::new(function("pci-testdev"), irq.clone())));
    let c = served.connect();
    let sync = |c: &UnixStream| {
        mpqemu::wire::send(c, &mpqemu::wire::Msg::CfgRead { addr: 0, len: 4 }, &[], "PCI_CFGREAD").unwrap();
        let (m, _) = mpqemu::wire::recv(c).unwrap().expect("the server closed the channel");
        assert!(matches!(m, mpqemu::wire::Msg::Ret(_)), "{m:?}");
    };
    sync(&c);
    let start = threads();
    let trigger = EventFd::new(EFD_NONBLOCK).unwrap();
    let mut resample = EventFd::new(EFD_NONBLOCK).unwrap();
    for i in 0..2000 {
        resample = EventFd::new(EFD_NONBLOCK).unwrap();
        let fds = [trigger.as_raw_fd(), resample.as_raw_fd()];
        mpqemu::wire::send(&c, &mpqemu::wire::Msg::SetIrqfd, &fds, "SET_IRQFD").unwrap();
        if i % 50 == 49 {
            sync(&c); // every SET_IRQFD before it is handled
            let n = threads();
            assert!(n <= start + SLACK, "after {} SET_IRQFD: {n} threads, {start} at the start", i + 1);
        }
    }
    sync(&c);
    intx_still_works(&irq, &trigger, &resample);
    drop(c);
    served.session_ended();
}

// ---------------------------------------------------------------------------------------------
// Per-client doorbell pages and ioeventfds (NVMe in a device process).

/// Guest memory of a client: a memfd at `GPA`, with the admin queues, an I/O queue pair, the
/// shadow doorbells and a data page.
const GPA: u64 = 0x10_0000;
const ASQ: u64 = 0x0;
const ACQ: u64 = 0x1000;
const IOSQ: u64 = 0x2000;
const IOCQ: u64 = 0x3000;
const DBBUF: u64 = 0x4000;
const EVIDX: u64 = 0x5000;
const DATA: u64 = 0x6000;

fn region_write(sock: &UnixStream, id: u16, offset: u64, data: &[u8]) {
    let q = RegionAccess::to_bytes_with_data(offset, 0, data);
    let (err, errno, _, _) = request(sock, id, Command::RegionWrite, &q, &[]);
    assert!(!err, "REGION_WRITE at {offset:#x} refused: errno {errno}");
}

fn region_read32(sock: &UnixStream, id: u16, offset: u64) -> u32 {
    let q = RegionAccess { offset, region: 0, count: 4 };
    let (err, errno, p, _) = request(sock, id, Command::RegionRead, &q.to_bytes(), &[]);
    assert!(!err, "REGION_READ at {offset:#x} refused: errno {errno}");
    u32::from_le_bytes(p[p.len() - 4..].try_into().unwrap())
}

/// A client of iopath's NVMe controller speaking raw vfio-user: its socket, its memory, its
/// message ids, and the admin queue's position.
struct Nvme {
    sock: UnixStream,
    ram: File,
    id: u16,
    atail: u16,
}

impl Nvme {
    fn connect(served: &Served) -> Nvme {
        let sock = served.connect();
        version(&sock);
        let ram = {
            // SAFETY: memfd_create with a NUL-terminated name; the fd is owned by the File.
            let fd = unsafe { libc::memfd_create(c"iopath-client".as_ptr(), 0) };
            assert!(fd >= 0);
            // SAFETY: a fresh fd nothing else owns.
            let f = unsafe { <File as std::os::fd::FromRawFd>::from_raw_fd(fd) };
            f.set_len(0x10000).unwrap();
            f
        };
        Nvme { sock, ram, id: 10, atail: 0 }
    }
    fn next(&mut self) -> u16 {
        self.id += 1;
        self.id
    }
    fn write32(&mut self, offset: u64, v: u32) {
        let id = self.next();
        region_write(&self.sock, id, offset, &v.to_le_bytes());
    }
    fn write64(&mut self, offset: u64, v: u64) {
        let id = self.next();
        region_write(&self.sock, id, offset, &v.to_le_bytes());
    }
    fn read32(&mut self, offset: u64) -> u32 {
        let id = self.next();
        region_read32(&self.sock, id, offset)
    }
    /// Maps the memory, enables the controller, configures shadow doorbells if asked, and
    /// creates I/O queue pair 1 (8 entries).
    fn bring_up(&mut self, shadow: bool) {
        let id = self.next();
        let map = DmaMap { flags: DMA_MAP_FLAG_READ | DMA_MAP_FLAG_WRITE, offset: 0, address: GPA, size: 0x10000 };
        let (err, errno, _, _) = request(&self.sock, id, Command::DmaMap, &map.to_bytes(), &[self.ram.as_raw_fd()]);
        assert!(!err, "DMA_MAP refused: errno {errno}");
        self.write32(0x24, 15 << 16 | 15);
        self.write64(0x28, GPA + ASQ);
        self.write64(0x30, GPA + ACQ);
        self.write32(0x14, 0x0046_0001);
        assert_eq!(self.read32(0x1c) & 3, 1, "CSTS.RDY");
        if shadow {
            assert_eq!(self.admin(0x7c, GPA + DBBUF, GPA + EVIDX, [0, 0]), 0, "Doorbell Buffer Config");
        }
        assert_eq!(self.admin(0x05, GPA + IOCQ, 0, [1 | 7 << 16, 1]), 0, "Create I/O CQ");
        assert_eq!(self.admin(0x01, GPA + IOSQ, 0, [1 | 7 << 16, 1 | 1 << 16]), 0, "Create I/O SQ");
    }
    /// An admin command through the admin queue's doorbell register; its status.
    fn admin(&mut self, op: u8, prp1: u64, prp2: u64, cdw: [u32; 2]) -> u16 {
        let slot = self.atail as u64;
        self.ram.write_all_at(&sqe(op, 0x100 + self.atail, 0, prp1, prp2, cdw), ASQ + slot * 64).unwrap();
        self.atail += 1;
        self.write32(0x1000, self.atail as u32);
        let cqe = self.wait_cqe(ACQ + slot * 16, Duration::from_secs(10)).expect("an admin completion");
        self.write32(0x1004, self.atail as u32);
        u16::from_le_bytes([cqe[14], cqe[15]]) >> 1
    }
    /// The CQE at `at` once its phase tag is 1, within `d`.
    fn wait_cqe(&self, at: u64, d: Duration) -> Option<[u8; 16]> {
        let t0 = std::time::Instant::now();
        let mut cqe = [0u8; 16];
        loop {
            self.ram.read_exact_at(&mut cqe, at).unwrap();
            if cqe[14] & 1 == 1 {
                return Some(cqe);
            }
            if t0.elapsed() > d {
                return None;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }
    /// A Write of LBA 0 in I/O SQ 1's slot 0, published in the shadow tail if `shadow`, no doorbell.
    fn stage_write(&mut self, shadow: bool) {
        self.ram.write_all_at(&sqe(0x01, 7, 1, GPA + DATA, 0, [0, 0]), IOSQ).unwrap();
        if shadow {
            self.ram.write_all_at(&1u32.to_le_bytes(), DBBUF + 8).unwrap();
        }
    }
    fn write_completed(&self, d: Duration) -> bool {
        self.wait_cqe(IOCQ, d).is_some()
    }
}

use std::os::unix::fs::FileExt;

fn sqe(op: u8, cid: u16, nsid: u32, prp1: u64, prp2: u64, cdw: [u32; 2]) -> [u8; 64] {
    let mut e = [0u8; 64];
    e[0] = op;
    e[2..4].copy_from_slice(&cid.to_le_bytes());
    e[4..8].copy_from_slice(&nsid.to_le_bytes());
    e[24..32].copy_from_slice(&prp1.to_le_bytes());
    e[32..40].copy_from_slice(&prp2.to_le_bytes());
    e[40..44].copy_from_slice(&cdw[0].to_le_bytes());
    e[44..48].copy_from_slice(&cdw[1].to_le_bytes());
    e
}

/// BAR0's region info with its fd: the doorbell page's memfd and the page's offset in it.
fn doorbell_page(sock: &UnixStream, id: u16) -> (File, u64) {
    let (err, errno, p, mut fds) =
        request(sock, id, Command::DeviceGetRegionInfo, &RegionInfo::request(0, 4096).to_bytes(), &[]);
    assert!(!err, "GET_REGION_INFO refused: errno {errno}");
    let r = RegionInfoReply::parse(&p).unwrap();
    let area = r.sparse_mmap.as_ref().and_then(|a| a.first().cloned()).expect("a sparse mmap area");
    assert_eq!((area.offset, area.size), (0x1000, 0x1000));
    assert_eq!(fds.len(), 1, "BAR0's fd");
    (fds.pop().unwrap(), r.info.offset + area.offset)
}

/// A client that left keeps its mapping of the doorbell page it was given: its stores reach a
/// page nobody polls. The next client's staged (unrung) write does not run until that client
/// rings its own doorbell, and its page is another memfd, sealed so that no client can seal it
/// further (F_SEAL_FUTURE_WRITE would refuse the next client's mapping).
#[test]
fn a_departed_clients_mapping_of_the_doorbell_page_reaches_nobody() {
    let _g = serial();
    let f = function("nvme,doorbell=bar,backend=ram,size_mb=1");
    let served = Served::start(Box::new(VfioUserServer::new(f.clone(), IrqLines::new(), IoFds::IoEventFds)));
    let a = served.connect();
    version(&a);
    let (fd_a, off_a) = doorbell_page(&a, 2);
    // SAFETY: F_ADD_SEALS on a copy of the device's memfd: refused (F_SEAL_SEAL).
    let sealed = unsafe { libc::fcntl(fd_a.as_raw_fd(), libc::F_ADD_SEALS, libc::F_SEAL_FUTURE_WRITE) };
    assert_eq!(sealed, -1, "a client added a seal to the doorbell page's memfd");
    let old = vm_memory::mmap::MmapRegion::<()>::from_file(vm_memory::FileOffset::new(fd_a, off_a), 0x1000).unwrap();
    drop(a);
    served.session_ended();
    let mut b = Nvme::connect(&served);
    let (_fd_b, _) = doorbell_page(&b.sock, 3);
    b.bring_up(false);
    b.stage_write(false);
    // The old client stores SQ 1's tail (1) into its mapping of the old page.
    // SAFETY: inside the 4 KiB mapping, 4-byte aligned.
    unsafe { std::ptr::write_volatile(old.as_ptr().add(8).cast::<u32>(), 1) };
    assert!(!b.write_completed(Duration::from_millis(500)), "the departed client's store ran the next client's write");
    assert_eq!(counter(&f, "io.writes"), 0);
    b.write32(0x1008, 1);
    assert!(b.write_completed(Duration::from_secs(10)), "the client's own doorbell");
    assert_eq!(counter(&f, "io.writes"), 1);
}

/// A client that left keeps the ioeventfds it was announced: a write to one wakes nobody. The
/// next client's write, published in its shadow doorbell but not rung, runs only when that
/// client rings its own (new) ioeventfd.
#[test]
fn a_departed_clients_ioeventfds_wake_nobody() {
    let _g = serial();
    let f = function("nvme,doorbell=ioeventfd,backend=ram,size_mb=1");
    let served = Served::start(Box::new(VfioUserServer::new(f.clone(), IrqLines::new(), IoFds::IoEventFds)));
    let io_fds = |sock: &UnixStream, id: u16| -> (Vec<IoFdEntry>, Vec<File>) {
        let q = IoFdsRequest { argsz: 65536, index: 0 };
        let (err, errno, p, fds) = request(sock, id, Command::DeviceGetRegionIoFds, &q.to_bytes(), &[]);
        assert!(!err, "GET_REGION_IO_FDS refused: errno {errno}");
        (IoFdsReply::parse(&p).unwrap().entries, fds)
    };
    // SQ 1's tail doorbell's eventfd.
    let sq1 = |(entries, fds): (Vec<IoFdEntry>, Vec<File>)| -> EventFd {
        let i = entries
            .iter()
            .find_map(|e| match e {
                IoFdEntry::IoEventFd { offset: 0x1008, fd_index, .. } => Some(*fd_index as usize),
                _ => None,
            })
            .expect("SQ 1's tail doorbell announced");
        // SAFETY: a dup of an eventfd the server sent; owned by the EventFd.
        unsafe { <EventFd as std::os::fd::FromRawFd>::from_raw_fd(libc::dup(fds[i].as_raw_fd())) }
    };
    let a = served.connect();
    version(&a);
    let old = sq1(io_fds(&a, 2));
    drop(a);
    served.session_ended();
    let mut b = Nvme::connect(&served);
    let new = sq1(io_fds(&b.sock, 3));
    b.bring_up(true);
    b.stage_write(true);
    // (EventIdx asks for a ring: the device thread sleeps until its ioeventfd fires.)
    old.write(1).unwrap();
    assert!(!b.write_completed(Duration::from_millis(500)), "the departed client's ioeventfd woke the device");
    assert_eq!(counter(&f, "io.writes"), 0);
    new.write(1).unwrap();
    assert!(b.write_completed(Duration::from_secs(10)), "the client's own ioeventfd");
    assert_eq!(counter(&f, "io.writes"), 1);
}

fn counter(f: &Mutex<PciFunction>, name: &str) -> u64 {
    let c = f.lock().unwrap().device.counters();
    c.iter().find(|c| c.name == name).map_or(0, |c| c.value)
}

/// virtio-blk's notify ioeventfd, as NVMe's: the one a client that left
/// kept is not the device's any more. Written, it stays unread (nobody
/// polls it) and no kick is counted; the next client's own one is read.
#[test]
fn a_departed_clients_virtio_notify_eventfd_wakes_nobody() {
    let _g = serial();
    let f = function("virtio-blk,backend=null,notify=ioeventfd");
    let served = Served::start(Box::new(VfioUserServer::new(f.clone(), IrqLines::new(), IoFds::IoEventFds)));
    let notify_fd = |sock: &UnixStream, id: u16| -> EventFd {
        let q = IoFdsRequest { argsz: 65536, index: 0 };
        let (err, errno, p, fds) = request(sock, id, Command::DeviceGetRegionIoFds, &q.to_bytes(), &[]);
        assert!(!err, "GET_REGION_IO_FDS refused: errno {errno}");
        let i = IoFdsReply::parse(&p)
            .unwrap()
            .entries
            .iter()
            .find_map(|e| match e {
                IoFdEntry::IoEventFd { fd_index, .. } => Some(*fd_index as usize),
                _ => None,
            })
            .expect("queue 0's notify address announced");
        // SAFETY: a dup of an eventfd the server sent; owned by the EventFd.
        unsafe { <EventFd as std::os::fd::FromRawFd>::from_raw_fd(libc::dup(fds[i].as_raw_fd())) }
    };
    let a = served.connect();
    version(&a);
    let old = notify_fd(&a, 2);
    drop(a);
    served.session_ended();
    let b = served.connect();
    version(&b);
    let new = notify_fd(&b, 3);
    let kicks = counter(&f, "kicks");
    // Non-blocking; emptied of the wake-up its device thread got when it stopped.
    set_nonblocking(&old).unwrap();
    let _ = old.read();
    old.write(1).unwrap();
    std::thread::sleep(Duration::from_millis(300));
    // A value still there was read by nobody.
    assert_eq!(old.read().ok(), Some(1), "the departed client's notify eventfd was read by the device");
    assert_eq!(counter(&f, "kicks"), kicks, "a kick counted from the departed client's eventfd");
    new.write(1).unwrap();
    let end = std::time::Instant::now() + Duration::from_secs(10);
    while counter(&f, "kicks") == kicks && std::time::Instant::now() < end {
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(counter(&f, "kicks"), kicks + 1, "the client's own notify eventfd");
    drop(b);
}

fn set_nonblocking(e: &EventFd) -> std::io::Result<()> {
    // SAFETY: fcntl on an fd the EventFd owns.
    let fl = unsafe { libc::fcntl(e.as_raw_fd(), libc::F_GETFL) };
    // SAFETY: F_SETFL with integer flags on the fd the EventFd owns.
    if unsafe { libc::fcntl(e.as_raw_fd(), libc::F_SETFL, fl | libc::O_NONBLOCK) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}
