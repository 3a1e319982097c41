//! Clients that stall `iopath serve` (issue 10, D7) or leave the device set
//! up for the next client (D11), against `serve::run` in a thread of this
//! process with short bounds. Every wait here is a generous liveness bound:
//! a server that hangs fails the test, none measures how fast it is.
//!
//! D7: a client that sends nothing is dropped after the handshake bound, one
//! that stops inside a header after the message bound, one that never reads
//! its replies after the send bound; a client that comes while another is
//! served is told at once (vfio-user: EBUSY; mpqemu: a close) and is served
//! once the first leaves. D11: a client that leaves an NVMe controller
//! enabled with queues and shadow doorbells finds nothing of it when it (or
//! the next client) comes back, unless `keep_state`.

mod common;
use common::memfd;
use iopath_protocols::serve::{run, Listen, ServeOptions, Timeouts};
use iopath_protocols::socket;
use iopath_protocols::vfio_user::wire::*;
use std::io::{ErrorKind, Read};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::fs::FileExt;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// The bounds of these servers: short, so that the tests are quick.
const T: Timeouts = Timeouts {
    handshake: Duration::from_millis(500),
    message: Duration::from_millis(500),
    send: Duration::from_millis(500),
    refusal: Duration::from_secs(2),
};
/// How long a client waits for anything before it calls the server hung.
const HUNG: Duration = Duration::from_secs(20);

/// `iopath serve DEVICE --transport TRANSPORT --socket PATH` with the short
/// bounds, in a thread. Without `once` the thread outlives the test (it
/// waits for a next client that never comes).
fn serve(device: &str, transport: &str, name: &str, once: bool, keep_state: bool) -> (PathBuf, JoinHandle<()>) {
    let path = common::scratch(name).join("dev.sock");
    let o = ServeOptions {
        device: device.parse().unwrap(),
        transport: iopath_protocols::transport(transport).unwrap(),
        listen: Listen::Socket(path.clone()),
        once,
        keep_state,
        timeouts: T,
        seccomp: false, // in a thread of the test process
        control: None,
        controllers: 1,
        pollers: None,
    };
    (path, std::thread::spawn(move || run(&o).unwrap()))
}

/// A connection to the server once it listens, with reads and writes that
/// give up after [`HUNG`].
fn dial(path: &Path) -> UnixStream {
    let t0 = Instant::now();
    loop {
        if let Ok(s) = UnixStream::connect(path) {
            s.set_read_timeout(Some(HUNG)).unwrap();
            s.set_write_timeout(Some(HUNG)).unwrap();
            return s;
        }
        assert!(t0.elapsed() < HUNG, "the server never listened on {}", path.display());
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Waits for `h` (a server with `once`) to return.
fn joined(h: JoinHandle<()>, what: &str) {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(h.join().is_ok());
    });
    match rx.recv_timeout(HUNG) {
        Ok(ok) => assert!(ok, "{what}: the server panicked"),
        Err(_) => panic!("{what}: the server still runs after {HUNG:?}"),
    }
}

/// True once the server has closed `s` (end of stream or reset), false if
/// it is still open after [`HUNG`]; data the server sent first is skipped.
fn closed_by_server(s: &mut UnixStream) -> bool {
    let mut b = [0u8; 4096];
    loop {
        match s.read(&mut b) {
            Ok(0) => return true,
            Ok(_) => continue,
            Err(e) if e.kind() == ErrorKind::ConnectionReset => return true,
            Err(e) if e.kind() == ErrorKind::WouldBlock || e.kind() == ErrorKind::TimedOut => return false,
            Err(e) => panic!("reading: {e}"),
        }
    }
}

/// One request/reply on a raw vfio-user socket: (header, payload).
fn request(s: &UnixStream, id: u16, cmd: Command, payload: &[u8], fds: &[RawFd]) -> (Header, Vec<u8>) {
    socket::send(s, &[&message(id, cmd, FLAGS_TYPE_COMMAND, payload)], fds).unwrap();
    let mut h = [0u8; HEADER_SIZE];
    socket::recv_exact(s, &mut h).unwrap_or_else(|e| panic!("no reply to {cmd:?} {id}: {e}"));
    let r = Header::parse(&h);
    let mut p = vec![0u8; r.payload_len().unwrap()];
    socket::recv_exact(s, &mut p).unwrap();
    assert_eq!((r.msg_id, r.cmd), (id, cmd as u16), "the reply to {cmd:?} {id}");
    (r, p)
}

fn version_bytes() -> Vec<u8> {
    Version { major: VERSION_MAJOR, minor: VERSION_MINOR, capabilities: None }.to_bytes()
}

/// VERSION on `s`: Ok, or the errno of its error reply.
fn version(s: &UnixStream, id: u16) -> Result<(), u32> {
    let (h, _) = request(s, id, Command::Version, &version_bytes(), &[]);
    if h.is_error() {
        Err(h.error_no)
    } else {
        Ok(())
    }
}

/// A 4-byte read of configuration space (the vendor and device ids at 0).
fn config_read(s: &UnixStream, id: u16) -> u32 {
    let q = RegionAccess { offset: 0, region: PCI_CONFIG_REGION_INDEX, count: 4 }.to_bytes();
    let (h, p) = request(s, id, Command::RegionRead, &q, &[]);
    assert!(!h.is_error(), "REGION_READ refused: errno {}", h.error_no);
    let (_, data) = RegionAccess::parse_with_data(&p).unwrap();
    u32::from_le_bytes(data.try_into().unwrap())
}

/// D7.1: a client that connects and sends nothing is dropped after the
/// handshake bound and does not count as the client of `--once`; the next
/// one is served.
#[test]
fn a_client_that_sends_nothing_is_dropped_and_the_next_is_served() {
    let (path, h) = serve("pci-testdev", "vfio-user", "silent", true, false);
    let mut a = dial(&path);
    assert!(closed_by_server(&mut a), "a silent client was not dropped in {HUNG:?}");
    let b = dial(&path);
    assert_eq!(version(&b, 1), Ok(()));
    assert_eq!(config_read(&b, 2) & 0xffff, 0x1b36, "pci-testdev's vendor id");
    drop(b);
    joined(h, "after the first client served");
}

/// D7.2: a client that sends half a header, then nothing, is dropped after
/// the message bound.
#[test]
fn a_client_that_stops_inside_a_header_is_dropped() {
    for transport in ["vfio-user", "mpqemu"] {
        let (path, h) = serve("pci-testdev", transport, &format!("half-{transport}"), true, false);
        let mut a = dial(&path);
        let m = message(1, Command::Version, FLAGS_TYPE_COMMAND, &version_bytes());
        socket::send(&a, &[&m[..HEADER_SIZE / 2]], &[]).unwrap();
        assert!(closed_by_server(&mut a), "{transport}: a client stuck inside a header was not dropped in {HUNG:?}");
        joined(h, transport);
    }
}

/// D7.2: the same inside a payload, the header whole.
#[test]
fn a_client_that_stops_inside_a_payload_is_dropped() {
    let (path, h) = serve("pci-testdev", "vfio-user", "half-payload", true, false);
    let mut a = dial(&path);
    assert_eq!(version(&a, 1), Ok(()));
    let m = message(2, Command::RegionRead, FLAGS_TYPE_COMMAND, &[0u8; 16]);
    socket::send(&a, &[&m[..HEADER_SIZE + 3]], &[]).unwrap();
    assert!(closed_by_server(&mut a), "a client stuck inside a payload was not dropped in {HUNG:?}");
    joined(h, "half a payload");
}

/// D7.3: a client that floods requests and never reads a reply cannot hold
/// the server: its session ends after the send bound.
#[test]
fn a_client_that_never_reads_its_replies_is_dropped() {
    let (path, h) = serve("pci-testdev", "vfio-user", "deaf", true, false);
    let a = dial(&path);
    assert_eq!(version(&a, 1), Ok(()));
    a.set_write_timeout(Some(Duration::from_secs(2))).unwrap();
    let q = RegionAccess { offset: 0, region: PCI_CONFIG_REGION_INDEX, count: 4 }.to_bytes();
    let mut sent = 0u32;
    let t0 = Instant::now();
    // Requests until the socket takes no more: the server, blocked on
    // replies nobody reads, stopped reading them (or it closed the channel).
    let e = loop {
        let m = message(sent as u16, Command::RegionRead, FLAGS_TYPE_COMMAND, &q);
        if let Err(e) = socket::send(&a, &[&m], &[]) {
            break e;
        }
        sent += 1;
        assert!(t0.elapsed() < HUNG, "{sent} requests taken in {HUNG:?}: nothing blocks?");
    };
    eprintln!("{sent} requests sent, then: {e}");
    joined(h, "a client that reads no reply");
}

/// D7.4: while a client holds an idle session, a second one is told at once
/// (EBUSY to its VERSION, then the close) and the first is not disturbed;
/// once the first leaves, the next client is served.
#[test]
fn a_second_vfio_user_client_gets_ebusy_then_is_served_after_the_first() {
    // ioregionfd's control channel is a vfio-user session: refused the same way.
    for transport in ["vfio-user", "ioregionfd"] {
        second_client_gets_ebusy(transport);
    }
}

fn second_client_gets_ebusy(transport: &str) {
    let (path, _server) = serve("pci-testdev", transport, &format!("busy-{transport}"), false, false);
    let a = dial(&path);
    assert_eq!(version(&a, 1), Ok(()));
    // A holds its session idle for longer than every bound.
    std::thread::sleep(T.handshake + T.message);
    let mut b = dial(&path);
    assert_eq!(version(&b, 7), Err(libc::EBUSY as u32), "the reply to a client that came second");
    assert!(closed_by_server(&mut b), "a refused client's channel stays open");
    assert_eq!(config_read(&a, 2) & 0xffff, 0x1b36, "the first client is still served");
    drop(a);
    // The server may not have seen A leave yet: EBUSY until it has.
    let t0 = Instant::now();
    loop {
        let c = dial(&path);
        match version(&c, 1) {
            Ok(()) => {
                assert_eq!(config_read(&c, 2) & 0xffff, 0x1b36);
                break;
            }
            Err(e) => assert_eq!(e, libc::EBUSY as u32),
        }
        assert!(t0.elapsed() < HUNG, "still busy {HUNG:?} after the first client left");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// D7.4 for mpqemu, which has no error reply: the second client's channel is
/// closed at once.
#[test]
fn a_second_mpqemu_client_is_closed_at_once() {
    use iopath_protocols::mpqemu::wire::{recv_reply, send, Msg};
    let (path, _server) = serve("pci-testdev", "mpqemu", "busy-mpqemu", false, false);
    let a = dial(&path);
    let vendor = |s: &UnixStream| {
        send(s, &Msg::CfgRead { addr: 0, len: 2 }, &[], "CFGREAD").unwrap();
        recv_reply(s).unwrap().map(|(m, _)| m)
    };
    assert_eq!(vendor(&a), Some(Msg::Ret(0x1b36)));
    let mut b = dial(&path);
    assert!(closed_by_server(&mut b), "a second mpqemu client was left hanging");
    assert_eq!(vendor(&a), Some(Msg::Ret(0x1b36)), "the first client is still served");
}

/// NVMe over vfio-user, as the raw client drives it.
struct Nvme {
    s: UnixStream,
    id: u16,
}

/// Guest RAM layout: offsets in one sealed memfd mapped at `BASE` (a queue
/// at GPA 0 is refused).
const BASE: u64 = 0x10_0000;
const ASQ: u64 = 0;
const ACQ: u64 = 0x1000;
const IOSQ: u64 = 0x2000;
const IOCQ: u64 = 0x3000;
const SHADOW: u64 = 0x4000;
const EVENTIDX: u64 = 0x5000;
const RAM: u64 = 1 << 20;
const CC: u64 = 0x14;
const CSTS: u64 = 0x1c;

impl Nvme {
    /// Connects (retrying while the server is busy with the last client).
    fn connect(path: &Path) -> Nvme {
        let t0 = Instant::now();
        loop {
            let s = dial(path);
            match version(&s, 1) {
                Ok(()) => return Nvme { s, id: 1 },
                Err(e) => assert_eq!(e, libc::EBUSY as u32),
            }
            assert!(t0.elapsed() < HUNG, "still busy after {HUNG:?}");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn call(&mut self, cmd: Command, payload: &[u8], fds: &[RawFd]) -> Vec<u8> {
        self.id = self.id.wrapping_add(1);
        let (h, p) = request(&self.s, self.id, cmd, payload, fds);
        assert!(!h.is_error(), "{cmd:?} refused: errno {}", h.error_no);
        p
    }

    fn map(&mut self, ram: &std::fs::File) {
        let m = DmaMap { flags: DMA_MAP_FLAG_READ | DMA_MAP_FLAG_WRITE, offset: 0, address: BASE, size: RAM };
        self.call(Command::DmaMap, &m.to_bytes(), &[ram.as_raw_fd()]);
    }

    fn write(&mut self, offset: u64, v: &[u8]) {
        self.call(Command::RegionWrite, &RegionAccess::to_bytes_with_data(offset, 0, v), &[]);
    }

    fn read32(&mut self, offset: u64) -> u32 {
        let p = self.call(Command::RegionRead, &RegionAccess { offset, region: 0, count: 4 }.to_bytes(), &[]);
        let (_, data) = RegionAccess::parse_with_data(&p).unwrap();
        u32::from_le_bytes(data.try_into().unwrap())
    }

    /// Admin command `n` (slot n of the admin queue), waited for; its status.
    fn admin(
        &mut self,
        ram: &std::fs::File,
        n: u64,
        opcode: u8,
        (prp1, prp2): (u64, u64),
        (cdw10, cdw11): (u32, u32),
    ) -> u16 {
        let mut sqe = [0u8; 64];
        sqe[0] = opcode;
        sqe[2..4].copy_from_slice(&(0x40 + n as u16).to_le_bytes());
        sqe[24..32].copy_from_slice(&prp1.to_le_bytes());
        sqe[32..40].copy_from_slice(&prp2.to_le_bytes());
        sqe[40..44].copy_from_slice(&cdw10.to_le_bytes());
        sqe[44..48].copy_from_slice(&cdw11.to_le_bytes());
        ram.write_all_at(&sqe, ASQ + 64 * n).unwrap();
        self.write(0x1000, &(n as u32 + 1).to_le_bytes());
        let mut cqe = [0u8; 16];
        let t0 = Instant::now();
        loop {
            ram.read_exact_at(&mut cqe, ACQ + 16 * n).unwrap();
            if cqe[14] & 1 == 1 {
                return u16::from_le_bytes([cqe[14], cqe[15]]) >> 1;
            }
            assert!(t0.elapsed() < HUNG, "no completion of admin opcode {opcode:#x}");
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}

/// Client A: maps RAM, enables the controller with an I/O queue pair whose
/// doorbells are shadowed in RAM (the poller reads them), and leaves without
/// a reset. Client B then maps its own RAM at the same address, with a
/// nonzero word everywhere (as any guest's RAM may have): returns what B
/// reads of CC and CSTS, and whether its RAM stayed as it was.
fn a_leaves_b_comes(name: &str, keep_state: bool) -> (u32, u32, bool) {
    let (path, _server) = serve("nvme,doorbell=shm,size_mb=1", "vfio-user", name, false, keep_state);
    let ram_a = memfd(RAM, true);
    let mut a = Nvme::connect(&path);
    a.map(&ram_a);
    a.write(0x24, &(15u32 << 16 | 15).to_le_bytes());
    a.write(0x28, &(BASE + ASQ).to_le_bytes());
    a.write(0x30, &(BASE + ACQ).to_le_bytes());
    a.write(CC, &0x0046_0001u32.to_le_bytes());
    assert_eq!(a.read32(CSTS) & 1, 1, "CSTS.RDY after enable");
    assert_eq!(a.admin(&ram_a, 0, 0x05, (BASE + IOCQ, 0), (15 << 16 | 1, 1)), 0, "Create I/O CQ 1");
    assert_eq!(a.admin(&ram_a, 1, 0x01, (BASE + IOSQ, 0), (15 << 16 | 1, 1 << 16 | 1)), 0, "Create I/O SQ 1");
    assert_eq!(a.admin(&ram_a, 2, 0x7c, (BASE + SHADOW, BASE + EVENTIDX), (0, 0)), 0, "Doorbell Buffer Config");
    drop(a);

    let ram_b = memfd(RAM, true);
    let pattern: Vec<u8> = (0..RAM / 4).flat_map(|_| 1u32.to_le_bytes()).collect();
    ram_b.write_all_at(&pattern, 0).unwrap();
    let mut b = Nvme::connect(&path);
    let (cc, csts) = (b.read32(CC), b.read32(CSTS));
    b.map(&ram_b);
    // A controller that kept A's queues reads B's words as doorbells and
    // writes back at once (its poller spins); a second is plenty to see it.
    std::thread::sleep(Duration::from_secs(1));
    let mut now = vec![0u8; RAM as usize];
    ram_b.read_exact_at(&mut now, 0).unwrap();
    let untouched = now == pattern;
    (cc, csts, untouched)
}

/// D11: the next client finds a reset controller (CC and CSTS 0), and no
/// queue of the last client's writes into the memory it maps.
#[test]
fn the_next_client_finds_a_reset_device_and_its_memory_untouched() {
    let (cc, csts, untouched) = a_leaves_b_comes("reset", false);
    assert!(
        (cc, csts, untouched) == (0, 0, true),
        "the next client reads CC {cc:#x} CSTS {csts:#x}; its memory untouched by the last client's queues: {untouched}"
    );
}

/// D11 with keep_state (`--keep-state`): the controller is as A left it.
#[test]
fn with_keep_state_the_next_client_finds_the_device_as_it_was() {
    let (cc, csts, _) = a_leaves_b_comes("kept", true);
    assert_eq!((cc, csts & 1), (0x0046_0001, 1), "CC and CSTS.RDY kept");
}
