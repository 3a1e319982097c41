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
