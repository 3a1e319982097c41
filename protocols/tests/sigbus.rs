//! A device process maps the memory a client shares whatever its fd, and a
//! client that shrinks that memory afterwards loses only its own session
//! (`function`'s SIGBUS policy, `sigbus.rs`). The servers run in this test
//! process: a SIGBUS the handler did not take would kill the test binary.
//!
//! - vfio-user: DMA_MAP of an unsealed memfd, of a hugetlbfs file that is
//!   not a memfd (on a hugetlbfs mounted in a mount namespace of the test's
//!   own) and of a regular file are mapped: Identify and I/O complete with
//!   the right data and the server sends no DMA_READ/DMA_WRITE (counted).
//!   Then, in every doorbell mode, the client truncates its memory under
//!   running queues and rings a doorbell: its session ends with an error
//!   naming the region, the device is reset as after any client, and the
//!   next client is served (Identify and I/O, data checked).
//! - mpqemu: SYNC_SYSMEM with an unsealed memfd is taken; a truncation ends
//!   that session only.

mod common;
use common::within;
use iopath_devices::irq::IrqLines;
use iopath_devices::DeviceConfig;
use iopath_protocols::function::PciFunction;
use iopath_protocols::mpqemu::wire::{recv, send, Msg, SysmemRegion};
use iopath_protocols::mpqemu::MpqemuServer;
use iopath_protocols::serve::power_on;
use iopath_protocols::socket;
use iopath_protocols::vfio_user::wire::*;
use iopath_protocols::vfio_user::{IoFds, VfioUserServer};
use iopath_protocols::Server;
use std::fs::File;
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::fs::FileExt;
use std::os::unix::net::UnixStream;
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Guest RAM: `RAM` bytes at `BASE`, laid out as offsets into it.
const BASE: u64 = 0x10_0000;
const RAM: usize = 2 << 20;
const ASQ: u64 = 0;
const ACQ: u64 = 0x1000;
const IOSQ: u64 = 0x2000;
const IOCQ: u64 = 0x3000;
const SHADOW: u64 = 0x4000;
const EVENTIDX: u64 = 0x5000;
const IDC: u64 = 0x6000;
const IDN: u64 = 0x7000;
const WBUF: u64 = 0x8000;
const RBUF: u64 = 0x9000;
/// The region as the session's error names it.
const REGION: &str = "0x100000..0x300000";
const BOUND: Duration = Duration::from_secs(20);
const MODES: [&str; 7] = ["auto", "mmio", "ioeventfd", "shm", "bar", "adaptive", "bar-adaptive"];

#[derive(Clone, Copy, Debug)]
enum Kind {
    Memfd,
    Hugetlbfs,
    Regular,
}

/// A client's guest RAM: a file of some kind and the client's own mapping of it.
struct Ram {
    file: File,
    ptr: *mut u8,
}

// SAFETY: the mapping is the Ram's own; one thread uses it at a time.
unsafe impl Send for Ram {}

impl Ram {
    /// RAM of `kind`; None (said loudly) if this host has no hugetlbfs to give.
    fn new(kind: Kind) -> Option<Ram> {
        let file = match kind {
            Kind::Memfd => common::memfd(RAM as u64, false),
            Kind::Regular => {
                let p = std::env::temp_dir().join(format!("iopath-sigbus-{}-{:?}", std::process::id(), Instant::now()));
                let f = std::fs::OpenOptions::new().read(true).write(true).create_new(true).open(&p).unwrap();
                std::fs::remove_file(&p).unwrap();
                f.set_len(RAM as u64).unwrap();
                f
            }
            Kind::Hugetlbfs => match hugetlbfs_file() {
                Ok(f) => f,
                Err(e) => {
                    eprintln!("\n*** SKIPPED: no hugetlbfs file can be had on this host: {e} ***\n");
                    return None;
                }
            },
        };
        // SAFETY: a fresh shared mapping of a file of RAM bytes.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                RAM,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            )
        };
        assert_ne!(p, libc::MAP_FAILED, "{kind:?}: {}", std::io::Error::last_os_error());
        Some(Ram { file, ptr: p.cast() })
    }

    fn write(&self, off: u64, data: &[u8]) {
        assert!(off as usize + data.len() <= RAM);
        // SAFETY: inside the mapping (checked above); the file is not truncated while the Ram lives.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), self.ptr.add(off as usize), data.len()) }
    }

    fn read(&self, off: u64, out: &mut [u8]) {
        assert!(off as usize + out.len() <= RAM);
        // Volatile: the device writes concurrently.
        for (i, b) in out.iter_mut().enumerate() {
            // SAFETY: inside the mapping (checked above), which lives as long as
            // the Ram; a byte read has no alignment to keep.
            *b = unsafe { std::ptr::read_volatile(self.ptr.add(off as usize + i)) };
        }
    }

    /// Shrinks the file to nothing under every mapping of it, this test's
    /// own unmapped first (its next access would fault in the test's code).
    fn truncate(self) {
        let file = self.file.try_clone().unwrap();
        drop(self);
        file.set_len(0).unwrap();
    }
}

impl Drop for Ram {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `new`.
        unsafe { libc::munmap(self.ptr.cast(), RAM) };
    }
}

/// A file of RAM bytes on a hugetlbfs (not a memfd): mounted, in a thread
/// of its own, in a private mount namespace of that thread, then the mount
/// detached; the open file keeps its filesystem. Its pages come from the
/// host's pool (2 MiB pages).
fn hugetlbfs_file() -> Result<File, String> {
    std::thread::spawn(|| -> Result<File, String> {
        let err = |what: &str| format!("{what}: {}", std::io::Error::last_os_error());
        let free: u64 = std::fs::read_to_string("/sys/kernel/mm/hugepages/hugepages-2048kB/free_hugepages")
            .map_err(|e| format!("the 2 MiB hugetlb pool: {e}"))?
            .trim()
            .parse()
            .unwrap_or(0);
        if free < (RAM >> 21) as u64 {
            return Err(format!("{free} free 2 MiB pages (vm.nr_hugepages)"));
        }
        let dir = std::env::temp_dir().join(format!("iopath-hugetlbfs-{}-{:?}", std::process::id(), Instant::now()));
        std::fs::create_dir(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        let c = |s: &str| std::ffi::CString::new(s).unwrap();
        let cdir = c(dir.to_str().unwrap());
        // SAFETY: unshare and mount with valid C strings; they affect this thread only.
        let r = unsafe {
            if libc::unshare(libc::CLONE_NEWNS) != 0 {
                Err(err("unshare(CLONE_NEWNS)"))
            } else if libc::mount(
                std::ptr::null(),
                c("/").as_ptr(),
                std::ptr::null(),
                libc::MS_REC | libc::MS_PRIVATE,
                std::ptr::null(),
            ) != 0
            {
                Err(err("making / private"))
            } else if libc::mount(
                c("none").as_ptr(),
                cdir.as_ptr(),
                c("hugetlbfs").as_ptr(),
                0,
                c("pagesize=2M").as_ptr().cast(),
            ) != 0
            {
                Err(err("mount -t hugetlbfs"))
            } else {
                Ok(())
            }
        };
        let file = r.and_then(|()| {
            let p = dir.join("ram");
            let f = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .create_new(true)
                .open(&p)
                .map_err(|e| e.to_string())?;
            std::fs::remove_file(&p).map_err(|e| e.to_string())?;
            f.set_len(RAM as u64).map_err(|e| e.to_string())?;
            Ok(f)
        });
        // SAFETY: a lazy unmount of our mount point.
        unsafe { libc::umount2(cdir.as_ptr(), libc::MNT_DETACH) };
        let _ = std::fs::remove_dir(&dir);
        file
    })
    .join()
    .unwrap()
}

/// A raw vfio-user client.
struct Client {
    s: UnixStream,
    id: u16,
}

impl Client {
    fn new(s: UnixStream) -> Client {
        s.set_read_timeout(Some(BOUND)).unwrap();
        let mut c = Client { s, id: 0 };
        let caps = Capabilities { max_msg_fds: 16, ..Default::default() };
        let v = Version { major: VERSION_MAJOR, minor: VERSION_MINOR, capabilities: Some(caps) };
        c.call(Command::Version, &v.to_bytes(), &[]).unwrap();
        c
    }

    /// One request and its reply: the payload, or why there is none. A
    /// message from the server that is not this reply (a DMA_READ or
    /// DMA_WRITE) fails the test.
    fn call(&mut self, cmd: Command, payload: &[u8], fds: &[RawFd]) -> Result<Vec<u8>, String> {
        self.id = self.id.wrapping_add(1);
        socket::send(&self.s, &[&message(self.id, cmd, FLAGS_TYPE_COMMAND, payload)], fds)
            .map_err(|e| e.to_string())?;
        let mut h = [0u8; HEADER_SIZE];
        socket::recv_exact(&self.s, &mut h).map_err(|e| e.to_string())?;
        let r = Header::parse(&h);
        let mut p = vec![0u8; r.payload_len().unwrap()];
        socket::recv_exact(&self.s, &mut p).map_err(|e| e.to_string())?;
        assert_eq!((r.msg_id, r.cmd), (self.id, cmd as u16), "the server sent something else than the reply");
        if r.is_error() {
            return Err(format!("{cmd:?}: errno {}", r.error_no));
        }
        Ok(p)
    }

    fn map(&mut self, ram: &Ram) {
        let m = DmaMap { flags: DMA_MAP_FLAG_READ | DMA_MAP_FLAG_WRITE, offset: 0, address: BASE, size: RAM as u64 };
        self.call(Command::DmaMap, &m.to_bytes(), &[ram.file.as_raw_fd()]).unwrap();
    }

    fn write(&mut self, offset: u64, v: &[u8]) -> Result<(), String> {
        self.call(Command::RegionWrite, &RegionAccess::to_bytes_with_data(offset, 0, v), &[]).map(drop)
    }
}

/// What an NVMe driver needs of a transport: register writes.
trait Regs {
    fn reg_write(&mut self, offset: u64, v: &[u8]) -> Result<(), String>;
}

impl Regs for Client {
    fn reg_write(&mut self, offset: u64, v: &[u8]) -> Result<(), String> {
        self.write(offset, v)
    }
}

/// A small NVMe driver: admin and one I/O queue pair of 16 entries in `ram`.
struct Nvme<'a, R: Regs> {
    regs: &'a mut R,
    ram: &'a Ram,
    tails: [u16; 2],
}

impl<'a, R: Regs> Nvme<'a, R> {
    fn enable(regs: &'a mut R, ram: &'a Ram) -> Self {
        regs.reg_write(0x24, &(15u32 << 16 | 15).to_le_bytes()).unwrap();
        regs.reg_write(0x28, &(BASE + ASQ).to_le_bytes()).unwrap();
        regs.reg_write(0x30, &(BASE + ACQ).to_le_bytes()).unwrap();
        regs.reg_write(0x14, &0x0046_0001u32.to_le_bytes()).unwrap();
        Nvme { regs, ram, tails: [0, 0] }
    }

    /// Submits on queue `q` (0: admin, 1: I/O) and waits for its completion: its status.
    fn command(&mut self, q: usize, opcode: u8, nsid: u32, (prp1, prp2): (u64, u64), cdw: [u32; 3]) -> u16 {
        let (sq, cq) = if q == 0 { (ASQ, ACQ) } else { (IOSQ, IOCQ) };
        let slot = self.tails[q] as u64;
        let mut sqe = [0u8; 64];
        sqe[0] = opcode;
        sqe[2..4].copy_from_slice(&(0x100 * q as u16 + slot as u16).to_le_bytes());
        sqe[4..8].copy_from_slice(&nsid.to_le_bytes());
        sqe[24..32].copy_from_slice(&prp1.to_le_bytes());
        sqe[32..40].copy_from_slice(&prp2.to_le_bytes());
        for (i, d) in cdw.iter().enumerate() {
            sqe[40 + 4 * i..44 + 4 * i].copy_from_slice(&d.to_le_bytes());
        }
        self.ram.write(sq + 64 * slot, &sqe);
        self.tails[q] += 1;
        self.regs.reg_write(0x1000 + 8 * q as u64, &(self.tails[q] as u32).to_le_bytes()).unwrap();
        let t0 = Instant::now();
        let mut cqe = [0u8; 16];
        loop {
            self.ram.read(cq + 16 * slot, &mut cqe);
            if cqe[14] & 1 == 1 {
                assert_eq!(u16::from_le_bytes([cqe[12], cqe[13]]), 0x100 * q as u16 + slot as u16, "command id");
                return u16::from_le_bytes([cqe[14], cqe[15]]) >> 1;
            }
            assert!(t0.elapsed() < BOUND, "no completion of opcode {opcode:#x} on queue {q}");
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// Identify (controller and namespace 1), an I/O queue pair, a write
    /// and a read of one block: the data read back is the data written.
    fn identify_and_io(&mut self) {
        assert_eq!(self.command(0, 0x06, 0, (BASE + IDC, 0), [1, 0, 0]), 0, "Identify Controller");
        let mut vid = [0u8; 2];
        self.ram.read(IDC, &mut vid);
        assert_eq!(u16::from_le_bytes(vid), 0x1234, "Identify data written through the mapping");
        assert_eq!(self.command(0, 0x06, 1, (BASE + IDN, 0), [0, 0, 0]), 0, "Identify Namespace");
        // Up to the LBA format FLBAS picks (the controller lists eight: LBAF 0 and 1 are 512 and 4096 without metadata).
        let mut ns = [0u8; 192];
        self.ram.read(IDN, &mut ns);
        let lba = 1usize << ns[128 + 4 * (ns[26] & 0xf) as usize + 2];
        assert!((512..=4096).contains(&lba), "LBA size {lba}");
        assert_eq!(self.command(0, 0x05, 0, (BASE + IOCQ, 0), [15 << 16 | 1, 1, 0]), 0, "Create I/O CQ");
        assert_eq!(self.command(0, 0x01, 0, (BASE + IOSQ, 0), [15 << 16 | 1, 1 << 16 | 1, 0]), 0, "Create I/O SQ");
        let pattern: Vec<u8> = (0..lba).map(|i| (i * 31 + 7) as u8 ^ self.tails[0] as u8).collect();
        self.ram.write(WBUF, &pattern);
        self.ram.write(RBUF, &vec![0u8; lba]);
        assert_eq!(self.command(1, 0x01, 1, (BASE + WBUF, 0), [3, 0, 0]), 0, "Write");
        assert_eq!(self.command(1, 0x02, 1, (BASE + RBUF, 0), [3, 0, 0]), 0, "Read");
        let mut back = vec![0u8; lba];
        self.ram.read(RBUF, &mut back);
        assert_eq!(back, pattern, "the data read back is the data written");
    }
}

/// A vfio-user server serving one client after another, as `iopath serve`
/// does (the device reset after each), and each session's end: its result
/// and the DMA_READ/DMA_WRITE messages sent so far.
struct Host {
    clients: Sender<UnixStream>,
    ended: Receiver<(Result<(), String>, u64)>,
}

impl Host {
    fn start(device: &str) -> Host {
        let dev = device.parse::<DeviceConfig>().unwrap().build().unwrap();
        let f = Arc::new(Mutex::new(PciFunction::new(dev).unwrap()));
        let (clients, next) = channel::<UnixStream>();
        let (done, ended) = channel();
        std::thread::spawn(move || {
            let irq = IrqLines::new();
            let mut server = VfioUserServer::new(f.clone(), irq.clone(), IoFds::IoEventFds);
            for (n, sock) in next.into_iter().enumerate() {
                sock.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
                sock.set_write_timeout(Some(Duration::from_secs(5))).unwrap();
                let r = server.session(&sock, &format!("client {n}")).map_err(|e| e.to_string());
                drop(sock);
                irq.clear_intx();
                irq.clear_msix();
                let mut f = f.lock().unwrap();
                let dma: u64 = f
                    .counters()
                    .iter()
                    .filter(|c| c.name == "dma.reads" || c.name == "dma.writes")
                    .map(|c| c.value)
                    .sum();
                power_on(&mut f).unwrap();
                if done.send((r, dma)).is_err() {
                    return;
                }
            }
        });
        Host { clients, ended }
    }

    fn connect(&self) -> Client {
        let (mine, theirs) = UnixStream::pair().unwrap();
        self.clients.send(theirs).unwrap();
        Client::new(mine)
    }

    fn session_end(&self) -> (Result<(), String>, u64) {
        self.ended.recv_timeout(BOUND).expect("the session never ended")
    }
}

/// A client with RAM of `kind`: mapped, Identify and I/O checked; it leaves.
fn served(host: &Host, kind: Kind) -> Option<()> {
    let ram = Ram::new(kind)?;
    let mut c = host.connect();
    c.map(&ram);
    Nvme::enable(&mut c, &ram).identify_and_io();
    drop(c);
    let (r, dma) = host.session_end();
    r.unwrap();
    assert_eq!(dma, 0, "{kind:?}: the server sent DMA_READ/DMA_WRITE for memory it was given with an fd");
    Some(())
}

#[test]
fn vfio_user_maps_an_unsealed_memfd_a_hugetlbfs_file_and_a_regular_file_and_sends_no_dma_message() {
    within("mapped", || {
        let host = Host::start("nvme,doorbell=mmio,size_mb=1");
        for kind in [Kind::Memfd, Kind::Regular, Kind::Hugetlbfs] {
            served(&host, kind);
        }
    });
}

/// In doorbell mode `mode`: client A's RAM of `kind` serves I/O, then A
/// truncates it under its running queues and rings the I/O queue's doorbell
/// (in `shm` mode the poller reads shadow doorbells in that RAM by itself).
/// A's session ends with an error naming the region; client B is served.
/// Returns how long A's session took to end after the truncation.
fn truncated_under_running_queues(mode: &str, kind: Kind) -> Option<Duration> {
    let host = Host::start(&format!("nvme,doorbell={mode},size_mb=1"));
    let ram = Ram::new(kind)?;
    let mut a = host.connect();
    a.map(&ram);
    let mut nvme = Nvme::enable(&mut a, &ram);
    nvme.identify_and_io();
    if mode == "shm" {
        let st = nvme.command(0, 0x7c, 0, (BASE + SHADOW, BASE + EVENTIDX), [0, 0, 0]);
        assert_eq!(st, 0, "Doorbell Buffer Config");
        ram.write(EVENTIDX, &[0; 8]);
    }
    let tail = nvme.tails[1];
    let t0 = Instant::now();
    ram.truncate();
    // The device reads the next entry from the truncated queue: SIGBUS in
    // whichever thread serves it (this request's in `mmio` mode). The
    // session may be over before the reply.
    let _ = a.write(0x1008, &(tail as u32 + 1).to_le_bytes());
    let (r, dma) = host.session_end();
    let took = t0.elapsed();
    let e = r.expect_err("the session of a client that shrank its memory ends with an error");
    assert!(e.contains("shrank") && e.contains(REGION), "{mode}, {kind:?}: {e}");
    assert_eq!(dma, 0);
    drop(a);
    // The process goes on: the next client finds a reset device and is served.
    served(&host, kind).expect("the second client's RAM");
    Some(took)
}

fn every_mode(kind: Kind) {
    for mode in MODES {
        let name = format!("{mode}, {kind:?}");
        match within(&name.clone(), move || truncated_under_running_queues(mode, kind)) {
            Some(t) => eprintln!("{name}: the truncated session ended {t:?} after the truncation"),
            None => return, // said loudly
        }
    }
}

#[test]
fn vfio_user_a_memfd_truncated_under_running_queues_ends_that_session_only_in_every_doorbell_mode() {
    every_mode(Kind::Memfd);
}

#[test]
fn vfio_user_a_hugetlbfs_file_truncated_under_running_queues_ends_that_session_only_in_every_doorbell_mode() {
    every_mode(Kind::Hugetlbfs);
}

#[test]
fn vfio_user_a_regular_file_truncated_under_running_queues_ends_that_session_only() {
    let t = within("regular", || truncated_under_running_queues("bar", Kind::Regular)).unwrap();
    eprintln!("bar, Regular: the truncated session ended {t:?} after the truncation");
}

/// An mpqemu client: BAR0 placed at `BAR`, memory and bus mastering on.
struct Mpqemu(UnixStream);

const BAR: u64 = 0xfe00_0000;

impl Mpqemu {
    fn call(&self, m: Msg, fds: &[RawFd]) -> Result<u64, String> {
        send(&self.0, &m, fds, "request").map_err(|e| e.to_string())?;
        match recv(&self.0).map_err(|e| e.to_string())? {
            Some((Msg::Ret(v), _)) => Ok(v),
            other => Err(format!("{:?}", other.map(|(m, _)| m))),
        }
    }

    fn start(s: UnixStream, ram: &Ram) -> Mpqemu {
        s.set_read_timeout(Some(BOUND)).unwrap();
        let c = Mpqemu(s);
        let regions = vec![SysmemRegion { gpa: BASE, size: RAM as u64, offset: 0 }];
        send(&c.0, &Msg::SyncSysmem(regions), &[ram.file.as_raw_fd()], "SYNC_SYSMEM").unwrap();
        c.call(Msg::CfgWrite { addr: 0x10, val: BAR as u32, len: 4 }, &[]).unwrap();
        c.call(Msg::CfgWrite { addr: 0x14, val: 0, len: 4 }, &[]).unwrap();
        c.call(Msg::CfgWrite { addr: 0x04, val: 0x6, len: 2 }, &[]).unwrap();
        c
    }
}

impl Regs for Mpqemu {
    fn reg_write(&mut self, offset: u64, v: &[u8]) -> Result<(), String> {
        let mut b = [0u8; 8];
        b[..v.len()].copy_from_slice(v);
        let m = Msg::BarWrite { addr: BAR + offset, val: u64::from_le_bytes(b), size: v.len() as u32, memory: true };
        self.call(m, &[]).map(drop)
    }
}

#[test]
fn mpqemu_an_unsealed_memfd_is_mapped_and_a_truncation_ends_that_session_only() {
    within("mpqemu", || {
        let dev = "nvme,doorbell=mmio,size_mb=1".parse::<DeviceConfig>().unwrap().build().unwrap();
        let f = Arc::new(Mutex::new(PciFunction::new(dev).unwrap()));
        let mut server = MpqemuServer::new(f.clone(), IrqLines::new());
        let f1 = f.clone();
        let session = move |server: &mut MpqemuServer, s: UnixStream| {
            let r = server.session(&s, "mpqemu client");
            power_on(&mut f1.lock().unwrap()).unwrap();
            r
        };
        // A: an unsealed memfd, mapped (Identify and I/O through it), then truncated.
        let ram = Ram::new(Kind::Memfd).unwrap();
        let (a, theirs) = UnixStream::pair().unwrap();
        let h = std::thread::spawn(move || (session(&mut server, theirs), server));
        let mut a = Mpqemu::start(a, &ram);
        let mut nvme = Nvme::enable(&mut a, &ram);
        nvme.identify_and_io();
        let tail = nvme.tails[1];
        ram.truncate();
        let _ = a.reg_write(0x1008, &(tail as u32 + 1).to_le_bytes());
        let (r, mut server) = h.join().unwrap();
        let e = r.expect_err("the session of a client that shrank its memory ends with an error").to_string();
        assert!(e.contains("shrank") && e.contains(REGION), "{e}");
        drop(a);
        // B: served by the same server, on a device reset after A.
        let ram = Ram::new(Kind::Memfd).unwrap();
        let (b, theirs) = UnixStream::pair().unwrap();
        let f2 = f.clone();
        let h = std::thread::spawn(move || {
            let r = server.session(&theirs, "mpqemu client b");
            power_on(&mut f2.lock().unwrap()).unwrap();
            r
        });
        let mut b = Mpqemu::start(b, &ram);
        Nvme::enable(&mut b, &ram).identify_and_io();
        drop(b);
        h.join().unwrap().unwrap();
        // The data of B's write reached the memfd through the server's mapping.
        let mut vid = [0u8; 2];
        ram.file.read_exact_at(&mut vid, IDC).unwrap();
        assert_eq!(u16::from_le_bytes(vid), 0x1234);
    });
}

/// The kernel, not the device's code, reaches a truncated page when a
/// file namespace reads into guest memory in place (io_uring, O_DIRECT):
/// no SIGBUS, the operation fails in its completion (EFAULT), and that
/// must become an NVMe error status, not a hang. The queues stay in a
/// second map the client keeps; the session goes on.
#[test]
fn an_in_place_read_into_truncated_memory_completes_with_an_nvme_error() {
    within("in place", || {
        let disk = std::env::temp_dir().join(format!("iopath-sigbus-disk-{}", std::process::id()));
        std::fs::write(&disk, vec![0x5au8; 1 << 20]).unwrap();
        let host =
            Host::start(&format!("nvme,doorbell=mmio,backend=file:{},size_mb=1,lba=4096,in_place=on", disk.display()));
        let (ram, data) = (Ram::new(Kind::Memfd).unwrap(), Ram::new(Kind::Memfd).unwrap());
        let mut c = host.connect();
        c.map(&ram);
        let dgpa = 0x40_0000;
        let m = DmaMap { flags: DMA_MAP_FLAG_READ | DMA_MAP_FLAG_WRITE, offset: 0, address: dgpa, size: RAM as u64 };
        c.call(Command::DmaMap, &m.to_bytes(), &[data.file.as_raw_fd()]).unwrap();
        let mut nvme = Nvme::enable(&mut c, &ram);
        nvme.identify_and_io();
        assert_eq!(nvme.command(1, 0x02, 1, (dgpa + 0x1000, 0), [5, 0, 0]), 0, "before the truncation");
        data.truncate();
        let st = nvme.command(1, 0x02, 1, (dgpa + 0x1000, 0), [5, 0, 0]);
        assert_ne!(st, 0, "a read into truncated memory completes with an error status");
        // The session goes on: a read into memory the client kept.
        assert_eq!(nvme.command(1, 0x02, 1, (BASE + RBUF, 0), [5, 0, 0]), 0);
        let mut back = vec![0u8; 4096];
        ram.read(RBUF, &mut back);
        assert!(back.iter().all(|&b| b == 0x5a), "the disk's data");
        drop(c);
        let (r, _) = host.session_end();
        let _ = std::fs::remove_file(&disk);
        // Either nothing faulted in the device's code (the kernel's EFAULT), or the session says so.
        if let Err(e) = r {
            assert!(e.contains("shrank"), "{e}");
        }
    });
}
