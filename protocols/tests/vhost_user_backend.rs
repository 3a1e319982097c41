//! iopath's vhost-user-blk backend driven by the `vhost` crate's frontend
//! (an independent implementation of the protocol's other side): memory
//! from a sealed memfd, one ring, a write and a read with their data
//! checked; an unsealed memfd, mapped, that the frontend truncates; and
//! hostile frontends: a ring outside the
//! memory, too many regions, a bad queue index, a frontend that leaves in
//! the middle of I/O. After every session the process holds no more fds
//! and no more mappings of the frontend's memory than before it. In-flight
//! tracking: a region left as a killed backend leaves it is resubmitted in
//! counter order, each chain once; numbers past the device are refused.

use iopath_devices::block::StorageKind;
use iopath_devices::virtio::pci::{NotifyMode, VirtioBlkConfig, F_VERSION_1};
use iopath_protocols::vhost_user::backend::{VhostUserBackend, F_PROTOCOL_FEATURES, MAX_REGIONS, NUM_QUEUES};
use std::fs::File;
use std::os::fd::{AsRawFd, FromRawFd};
use std::os::unix::net::UnixStream;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};
use vhost::vhost_user::message::{VhostUserHeaderFlag, VhostUserProtocolFeatures};
use vhost::vhost_user::{Frontend, VhostUserFrontend};
use vhost::{VhostBackend, VhostUserMemoryRegionInfo, VringConfigData};
use vmm_sys_util::eventfd::EventFd;

/// The tests count this process's fds and mappings: one at a time.
static SERIAL: Mutex<()> = Mutex::new(());

const MEM: usize = 1 << 20;
const QSIZE: u16 = 64;
const DESC: u64 = 0;
const AVAIL: u64 = 0x1000;
const USED: u64 = 0x2000;
const NAME: &str = "iopath-vu-test";

/// Guest RAM as the frontend holds it: a memfd mapped here.
struct Guest {
    file: File,
    ptr: *mut u8,
}

impl Guest {
    fn new(sealed: bool) -> Guest {
        let file = memfd(MEM, sealed);
        // SAFETY: a fresh shared mapping of a file of MEM bytes.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                MEM,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            )
        };
        assert_ne!(p, libc::MAP_FAILED);
        Guest { file, ptr: p.cast() }
    }

    fn write(&self, gpa: u64, data: &[u8]) {
        assert!(gpa as usize + data.len() <= MEM);
        // SAFETY: inside the mapping (checked above).
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), self.ptr.add(gpa as usize), data.len()) }
    }

    fn read(&self, gpa: u64, out: &mut [u8]) {
        assert!(gpa as usize + out.len() <= MEM);
        // SAFETY: inside the mapping (checked above).
        unsafe { std::ptr::copy_nonoverlapping(self.ptr.add(gpa as usize), out.as_mut_ptr(), out.len()) }
    }

    fn u16_at(&self, gpa: u64) -> u16 {
        let mut b = [0u8; 2];
        self.read(gpa, &mut b);
        u16::from_le_bytes(b)
    }

    /// The frontend's address of guest address `gpa`.
    fn uva(&self, gpa: u64) -> u64 {
        self.ptr as u64 + gpa
    }

    fn region(&self) -> VhostUserMemoryRegionInfo {
        VhostUserMemoryRegionInfo {
            guest_phys_addr: 0,
            memory_size: MEM as u64,
            userspace_addr: self.ptr as u64,
            mmap_offset: 0,
            mmap_handle: self.file.as_raw_fd(),
        }
    }
}

impl Drop for Guest {
    fn drop(&mut self) {
        // SAFETY: the mapping made in new.
        unsafe { libc::munmap(self.ptr.cast(), MEM) };
    }
}

/// A memfd of `size` bytes, sealed against shrinking and growing if `sealed`.
fn memfd(size: usize, sealed: bool) -> File {
    let name = std::ffi::CString::new(NAME).unwrap();
    // SAFETY: a valid C string; the fd is owned by the File.
    let f = unsafe {
        let fd = libc::memfd_create(name.as_ptr(), libc::MFD_ALLOW_SEALING | libc::MFD_CLOEXEC);
        assert!(fd >= 0);
        File::from_raw_fd(fd)
    };
    f.set_len(size as u64).unwrap();
    if sealed {
        // SAFETY: fcntl on an fd we own.
        let r = unsafe { libc::fcntl(f.as_raw_fd(), libc::F_ADD_SEALS, libc::F_SEAL_SHRINK | libc::F_SEAL_GROW) };
        assert_eq!(r, 0);
    }
    f
}

fn fds() -> usize {
    std::fs::read_dir("/proc/self/fd").unwrap().count()
}

/// Mappings of the test's memfds in this process.
fn mappings() -> usize {
    std::fs::read_to_string("/proc/self/maps").unwrap().lines().filter(|l| l.contains(NAME)).count()
}

/// A backend serving one frontend session on a socket pair, in a thread.
struct Rig {
    fe: Frontend,
    be: Arc<VhostUserBackend>,
    session: JoinHandle<iopath_protocols::Result<()>>,
    guard: Guard,
}

/// How long a test's frontend may live: the `vhost` crate retries a read
/// that times out for ever, so a socket timeout cannot fail a request the
/// backend never answers; the guard shuts the socket down instead, and the
/// request fails (the test with it) rather than hanging.
const TEST_BOUND: Duration = Duration::from_secs(30);

/// Shuts a frontend's socket down after [`TEST_BOUND`] unless dropped first
/// (joined: its copy of the socket is gone when the drop returns).
struct Guard {
    tx: Option<std::sync::mpsc::Sender<()>>,
    t: Option<JoinHandle<()>>,
}

impl Guard {
    fn new(sock: &UnixStream) -> Guard {
        let s = sock.try_clone().unwrap();
        let (tx, rx) = std::sync::mpsc::channel::<()>();
        let t = std::thread::spawn(move || {
            if rx.recv_timeout(TEST_BOUND) == Err(std::sync::mpsc::RecvTimeoutError::Timeout) {
                eprintln!("the test's frontend outlived {TEST_BOUND:?}: its socket shut down");
                let _ = s.shutdown(std::net::Shutdown::Both);
            }
        });
        Guard { tx: Some(tx), t: Some(t) }
    }
}

impl Drop for Guard {
    fn drop(&mut self) {
        drop(self.tx.take());
        if let Some(t) = self.t.take() {
            let _ = t.join();
        }
    }
}

impl Rig {
    /// The frontend on `a` (believing in `queues` queues), the backend's session thread.
    fn new(
        a: UnixStream,
        queues: u64,
        be: Arc<VhostUserBackend>,
        session: JoinHandle<iopath_protocols::Result<()>>,
    ) -> Rig {
        let guard = Guard::new(&a);
        Rig { fe: Frontend::from_stream(a, queues), be, session, guard }
    }
}

fn rig(notify: NotifyMode) -> Rig {
    rig_on(StorageKind::Ram, notify)
}

/// A `null` disk of [`MEM`] bytes, one queue, kicks as ioeventfds.
fn null_config() -> VirtioBlkConfig {
    VirtioBlkConfig {
        backend: StorageKind::Null,
        size: MEM as u64,
        notify: NotifyMode::Ioeventfd,
        ..VirtioBlkConfig::default()
    }
}

fn rig_on(backend: StorageKind, notify: NotifyMode) -> Rig {
    rig_with_queues(backend, notify, 1)
}

/// A rig whose frontend believes in `queues` queues.
fn rig_with_queues(backend: StorageKind, notify: NotifyMode, queues: u64) -> Rig {
    // A file disk is made (create=on) by the first rig on it.
    let create = matches!(backend, StorageKind::File(_));
    let cfg = VirtioBlkConfig { backend, size: MEM as u64, notify, create, ..VirtioBlkConfig::default() };
    let be = Arc::new(VhostUserBackend::new(&cfg).unwrap());
    let (a, b) = UnixStream::pair().unwrap();
    b.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let be2 = be.clone();
    let session = std::thread::spawn(move || be2.session(&b));
    Rig::new(a, queues, be, session)
}

impl Rig {
    /// Features and protocol features as QEMU asks them; every request acked.
    fn negotiate(&mut self) {
        let fe = &mut self.fe;
        fe.set_owner().unwrap();
        let f = fe.get_features().unwrap();
        assert_ne!(f & F_PROTOCOL_FEATURES, 0);
        fe.set_features(F_VERSION_1 | F_PROTOCOL_FEATURES).unwrap();
        let pf = fe.get_protocol_features().unwrap();
        assert!(pf.contains(VhostUserProtocolFeatures::CONFIG | VhostUserProtocolFeatures::REPLY_ACK), "{pf:?}");
        fe.set_protocol_features(
            VhostUserProtocolFeatures::CONFIG | VhostUserProtocolFeatures::REPLY_ACK | VhostUserProtocolFeatures::MQ,
        )
        .unwrap();
        fe.set_hdr_flags(VhostUserHeaderFlag::NEED_REPLY);
    }

    fn ring_config(g: &Guest, desc: u64) -> VringConfigData {
        VringConfigData {
            queue_max_size: QSIZE,
            queue_size: QSIZE,
            flags: 0,
            desc_table_addr: desc,
            used_ring_addr: g.uva(USED),
            avail_ring_addr: g.uva(AVAIL),
            log_addr: None,
        }
    }

    /// Memory, ring 0 and its fds; the ring enabled.
    fn start(&mut self, g: &Guest, kick: &EventFd, call: &EventFd) {
        self.start_ring(g, kick, call, 0);
    }

    /// Memory, ring `q` and its fds; the ring enabled.
    fn start_ring(&mut self, g: &Guest, kick: &EventFd, call: &EventFd, q: usize) {
        let fe = &mut self.fe;
        fe.set_mem_table(&[g.region()]).unwrap();
        fe.set_vring_num(q, QSIZE).unwrap();
        fe.set_vring_addr(q, &Self::ring_config(g, g.uva(DESC))).unwrap();
        fe.set_vring_base(q, 0).unwrap();
        fe.set_vring_call(q, call).unwrap();
        fe.set_vring_kick(q, kick).unwrap();
        fe.set_vring_enable(q, true).unwrap();
    }

    /// The session's result once the frontend is gone (bounded wait).
    fn end(self) -> (Arc<VhostUserBackend>, iopath_protocols::Result<()>) {
        drop(self.guard); // its copy of the socket first: the backend must see the end
        drop(self.fe);
        let t0 = Instant::now();
        while !self.session.is_finished() {
            assert!(t0.elapsed() < Duration::from_secs(10), "the session did not end");
            std::thread::sleep(Duration::from_millis(5));
        }
        (self.be, self.session.join().unwrap())
    }
}

/// Request `k`: a chain of header, data (4 KiB at `data`) and status, made
/// available as the next entry of the ring.
fn submit(g: &Guest, k: u16, kind: u32, sector: u64, data: u64) {
    let (hdr, status) = (0x8000 + 16 * k as u64, 0x9000 + k as u64);
    let mut h = [0u8; 16];
    h[0..4].copy_from_slice(&kind.to_le_bytes());
    h[8..16].copy_from_slice(&sector.to_le_bytes());
    g.write(hdr, &h);
    g.write(status, &[0xff]);
    let data_flags = if kind == 0 { 2 } else { 0 }; // IN: device-writable
    let descs = [(hdr, 16u32, 1u16), (data, 4096, 1 | data_flags), (status, 1, 2)];
    let head = (3 * k) % QSIZE;
    for (j, (addr, len, flags)) in descs.iter().enumerate() {
        let i = head + j as u16;
        let mut d = [0u8; 16];
        d[0..8].copy_from_slice(&addr.to_le_bytes());
        d[8..12].copy_from_slice(&len.to_le_bytes());
        d[12..14].copy_from_slice(&flags.to_le_bytes());
        d[14..16].copy_from_slice(&(i + 1).to_le_bytes());
        g.write(DESC + 16 * i as u64, &d);
    }
    let idx = g.u16_at(AVAIL + 2);
    g.write(AVAIL + 4 + 2 * (idx % QSIZE) as u64, &head.to_le_bytes());
    std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
    g.write(AVAIL + 2, &idx.wrapping_add(1).to_le_bytes());
}

/// Waits (bounded) until the used index reaches `n`, on the call eventfd.
fn wait_used(g: &Guest, call: &EventFd, n: u16) {
    let t0 = Instant::now();
    while g.u16_at(USED + 2) != n {
        assert!(t0.elapsed() < Duration::from_secs(10), "used index {} != {n}", g.u16_at(USED + 2));
        let mut p = libc::pollfd { fd: call.as_raw_fd(), events: libc::POLLIN, revents: 0 };
        // SAFETY: one valid pollfd.
        if unsafe { libc::poll(&mut p, 1, 100) } > 0 {
            let _ = call.read();
        }
    }
}

fn counter(be: &VhostUserBackend, name: &str) -> u64 {
    be.counters().iter().find(|c| c.name == name).map(|c| c.value).unwrap()
}

fn write_then_read(notify: NotifyMode) {
    let _s = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let g = Guest::new(true);
    let (kick, call) = (EventFd::new(0).unwrap(), EventFd::new(0).unwrap());
    let (fds0, maps0) = (fds(), mappings());
    let mut r = rig(notify);
    r.negotiate();
    assert_eq!(r.fe.get_queue_num().unwrap(), NUM_QUEUES as u64);
    let cfg = r.fe.get_config(0, 60, vhost::vhost_user::message::VhostUserConfigFlags::WRITABLE, &[0u8; 60]).unwrap();
    assert_eq!(u64::from_le_bytes(cfg.1[0..8].try_into().unwrap()), MEM as u64 / 512, "capacity in sectors");
    r.start(&g, &kick, &call);
    assert_eq!(mappings(), maps0 + 1, "the backend mapped the memfd");
    let pattern: Vec<u8> = (0..4096u32).map(|i| (i * 7 + 3) as u8).collect();
    g.write(0x10000, &pattern);
    submit(&g, 0, 1, 8, 0x10000); // OUT at sector 8
    kick.write(1).unwrap();
    wait_used(&g, &call, 1);
    let mut st = [0u8; 1];
    g.read(0x9000, &mut st);
    assert_eq!(st[0], 0, "write status");
    submit(&g, 1, 0, 8, 0x20000); // IN at sector 8
    kick.write(1).unwrap();
    wait_used(&g, &call, 2);
    g.read(0x9001, &mut st);
    assert_eq!(st[0], 0, "read status");
    let mut back = vec![0u8; 4096];
    g.read(0x20000, &mut back);
    assert_eq!(back, pattern, "the data read back is the data written");
    // Used length of the read: 4096 bytes of data and the status byte.
    let mut e = [0u8; 8];
    g.read(USED + 4 + 8, &mut e);
    assert_eq!(u32::from_le_bytes(e[4..8].try_into().unwrap()), 4097);
    assert_eq!(r.fe.get_vring_base(0).unwrap(), 2, "the vring base is the next available index");
    let (be, res) = r.end();
    res.unwrap();
    assert_eq!(counter(&be, "requests"), 2);
    // Each completion was signalled (no EVENT_IDX, no NO_INTERRUPT); a
    // poller may have found both requests without reading a kick.
    assert_eq!(counter(&be, "interrupts"), 2);
    if notify == NotifyMode::Ioeventfd {
        assert!(counter(&be, "kicks") >= 1);
    }
    assert_eq!(counter(&be, "errors"), 0);
    assert_eq!((fds(), mappings()), (fds0, maps0), "everything the session was given is gone");
}

#[test]
fn a_write_then_a_read_through_the_backend_on_kicks() {
    write_then_read(NotifyMode::Ioeventfd);
}

#[test]
fn a_write_then_a_read_through_the_backend_polling() {
    write_then_read(NotifyMode::Poll);
}

/// The session's refusal of a request the frontend made: the frontend's
/// error (an error reply), then the session's own error, with `why` in it.
fn refused<T: std::fmt::Debug>(r: Rig, res: vhost::Result<T>, why: &str) {
    assert!(res.is_err(), "accepted: {res:?}");
    let (be, end) = r.end();
    let e = end.unwrap_err().to_string();
    assert!(e.contains(why), "{e}");
    assert!(counter(&be, "refused") >= 1);
}

/// An unsealed memfd is mapped and serves I/O; the frontend then truncates
/// it under the running ring and kicks: the ring thread's access faults,
/// the mapping is replaced by zero pages and the session ends with an
/// error naming the region, leaving nothing behind; the same backend then
/// serves the next frontend.
#[test]
fn an_unsealed_memfd_is_mapped_and_a_truncation_ends_that_session_only() {
    let _s = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let (fds0, maps0) = (fds(), mappings());
    let g = Guest::new(false);
    let (kick, call) = (EventFd::new(0).unwrap(), EventFd::new(0).unwrap());
    let mut r = rig(NotifyMode::Ioeventfd);
    r.negotiate();
    r.start(&g, &kick, &call);
    let pattern: Vec<u8> = (0..4096u32).map(|i| (i * 13 + 1) as u8).collect();
    g.write(0x10000, &pattern);
    submit(&g, 0, 1, 8, 0x10000);
    kick.write(1).unwrap();
    wait_used(&g, &call, 1);
    submit(&g, 1, 0, 8, 0x20000);
    kick.write(1).unwrap();
    wait_used(&g, &call, 2);
    let mut back = vec![0u8; 4096];
    g.read(0x20000, &mut back);
    assert_eq!(back, pattern, "I/O through the unsealed memfd");
    // Truncated (the test's own mapping gone first: it would fault here too).
    let file = g.file.try_clone().unwrap();
    drop(g);
    file.set_len(0).unwrap();
    kick.write(1).unwrap();
    let t0 = Instant::now();
    while !r.session.is_finished() {
        assert!(t0.elapsed() < Duration::from_secs(10), "the session of a frontend that shrank its memory goes on");
        std::thread::sleep(Duration::from_millis(1));
    }
    let (be, end) = r.end();
    let e = end.unwrap_err().to_string();
    assert!(e.contains("shrank") && e.contains("0x0..0x100000"), "{e}");
    drop((file, kick, call));
    assert_eq!((fds(), mappings()), (fds0, maps0), "everything the session was given is gone");
    // The next frontend, on the same backend.
    let g = Guest::new(true);
    let (kick, call) = (EventFd::new(0).unwrap(), EventFd::new(0).unwrap());
    let (a, b) = UnixStream::pair().unwrap();
    b.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let be2 = be.clone();
    let mut r = Rig::new(a, 1, be, std::thread::spawn(move || be2.session(&b)));
    r.negotiate();
    r.start(&g, &kick, &call);
    submit(&g, 0, 0, 8, 0x30000);
    kick.write(1).unwrap();
    wait_used(&g, &call, 1);
    let mut back = vec![0u8; 4096];
    g.read(0x30000, &mut back);
    assert_eq!(back, pattern, "the disk kept the first frontend's write");
    r.end().1.unwrap();
}

#[test]
fn a_ring_outside_the_memory_is_an_error_not_a_crash() {
    let _s = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let g = Guest::new(true);
    let (fds0, maps0) = (fds(), mappings());
    let mut r = rig(NotifyMode::Ioeventfd);
    r.negotiate();
    r.fe.set_mem_table(&[g.region()]).unwrap();
    r.fe.set_vring_num(0, QSIZE).unwrap();
    // The descriptor table straddles the end of the one region.
    let res = r.fe.set_vring_addr(0, &Rig::ring_config(&g, g.uva(MEM as u64 - 512)));
    refused(r, res, "not inside the memory table");
    assert_eq!((fds(), mappings()), (fds0, maps0));
}

#[test]
fn more_regions_than_the_bound_are_refused() {
    let _s = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let files: Vec<File> = (0..=MAX_REGIONS).map(|_| memfd(4096, true)).collect();
    let regions: Vec<VhostUserMemoryRegionInfo> = files
        .iter()
        .enumerate()
        .map(|(k, f)| VhostUserMemoryRegionInfo {
            guest_phys_addr: 0x10_0000 * k as u64,
            memory_size: 4096,
            userspace_addr: 0x7000_0000_0000 + 0x10_0000 * k as u64,
            mmap_offset: 0,
            mmap_handle: f.as_raw_fd(),
        })
        .collect();
    let (fds0, maps0) = (fds(), mappings());
    let mut r = rig(NotifyMode::Ioeventfd);
    r.negotiate();
    let res = r.fe.set_mem_table(&regions);
    refused(r, res, &format!("{} memory regions", MAX_REGIONS + 1));
    assert_eq!((fds(), mappings()), (fds0, maps0));
}

#[test]
fn a_queue_index_past_the_device_is_refused() {
    let _s = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let (a, b) = UnixStream::pair().unwrap();
    let cfg = null_config();
    let be = Arc::new(VhostUserBackend::new(&cfg).unwrap());
    let be2 = be.clone();
    let session = std::thread::spawn(move || be2.session(&b));
    // A frontend that believes in more queues than GET_QUEUE_NUM says.
    let mut r = Rig::new(a, 2 * NUM_QUEUES as u64, be, session);
    r.negotiate();
    let res = r.fe.set_vring_num(NUM_QUEUES, QSIZE);
    refused(r, res, &format!("queue index {NUM_QUEUES}"));
    // With queues=2 the device has 2: GET_QUEUE_NUM, num_queues and the bound say so.
    let (a, b) = UnixStream::pair().unwrap();
    let be = Arc::new(VhostUserBackend::new(&VirtioBlkConfig { queues: Some(2), ..cfg }).unwrap());
    let be2 = be.clone();
    let session = std::thread::spawn(move || be2.session(&b));
    let mut r = Rig::new(a, 2 * NUM_QUEUES as u64, be, session);
    r.negotiate();
    let flags = vhost::vhost_user::message::VhostUserConfigFlags::WRITABLE;
    let (_, cfg) = r.fe.get_config(34, 2, flags, &[0u8; 2]).unwrap();
    assert_eq!(u16::from_le_bytes([cfg[0], cfg[1]]), 2, "num_queues");
    r.fe.set_vring_num(1, QSIZE).unwrap();
    let res = r.fe.set_vring_num(2, QSIZE); // the crate's bound is ours here, not GET_QUEUE_NUM's
    let (be, end) = r.end();
    assert!(res.is_err() && end.unwrap_err().to_string().contains("queue index 2 (the device has 2)"));
    // The next frontend asks.
    let (a, b) = UnixStream::pair().unwrap();
    let be2 = be.clone();
    let session = std::thread::spawn(move || be2.session(&b));
    let mut r = Rig::new(a, 1, be, session);
    r.negotiate();
    assert_eq!(r.fe.get_queue_num().unwrap(), 2);
    r.end().1.unwrap();
}

#[test]
fn a_frontend_that_leaves_in_the_middle_of_io_leaves_nothing_behind() {
    let _s = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    for notify in [NotifyMode::Ioeventfd, NotifyMode::Poll] {
        let g = Guest::new(true);
        let (kick, call) = (EventFd::new(0).unwrap(), EventFd::new(0).unwrap());
        let (fds0, maps0) = (fds(), mappings());
        let mut r = rig(notify);
        r.negotiate();
        r.start(&g, &kick, &call);
        // A batch served, then another made available and kicked on the
        // disabled ring: the device holds them when the frontend goes
        // without a word.
        let n = QSIZE / 3;
        for k in 0..n {
            submit(&g, k, 1, k as u64 * 8, 0x10000 + 4096 * k as u64);
        }
        kick.write(1).unwrap();
        wait_used(&g, &call, n);
        // Disabled (acked: no pass of the ring's thread takes another), so
        // that the second batch stays available, untaken, whatever the timing.
        r.fe.set_vring_enable(0, false).unwrap();
        for k in 0..n {
            submit(&g, k, 1, k as u64 * 8, 0x10000 + 4096 * k as u64);
        }
        kick.write(1).unwrap();
        let (be, res) = r.end();
        res.unwrap();
        assert_eq!(g.u16_at(AVAIL + 2), 2 * n);
        assert_eq!(g.u16_at(USED + 2), n, "{notify}: no request was in flight at the disconnect");
        assert_eq!(counter(&be, "requests"), n as u64);
        assert_eq!(counter(&be, "ring_errors"), 0);
        assert_eq!((fds(), mappings()), (fds0, maps0), "{notify}: fds or mappings left after the session");
    }
}

/// GET_CONFIG serves the bytes the PCI transport shows at its device
/// configuration: one virtio-blk, whoever hosts it.
#[test]
fn get_config_is_the_pci_devices_configuration_space() {
    use iopath_devices::virtio::pci::{VirtioBlk, DEVCFG, DEVCFG_LEN};
    use iopath_devices::DeviceModel;
    let _s = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    for queues in [Some(2), None] {
        let cfg = VirtioBlkConfig { size: 3 << 20, queues, ..null_config() };
        let pci = VirtioBlk::new(cfg.clone()).unwrap();
        let mut want = vec![0u8; DEVCFG_LEN as usize];
        for (k, b) in want.iter_mut().enumerate() {
            let mut x = [0u8; 1];
            pci.bar_read(0, DEVCFG + k as u64, &mut x);
            *b = x[0];
        }
        let (a, b) = UnixStream::pair().unwrap();
        let be = Arc::new(VhostUserBackend::new(&cfg).unwrap());
        let be2 = be.clone();
        let session = std::thread::spawn(move || be2.session(&b));
        let mut r = Rig::new(a, 1, be, session);
        r.negotiate();
        let flags = vhost::vhost_user::message::VhostUserConfigFlags::WRITABLE;
        let (_, got) = r.fe.get_config(0, DEVCFG_LEN as u32, flags, &want).unwrap();
        // num_queues (offset 34): queues=N on both hosts; without it, each
        // host's default (the PCI function 1, the backend NUM_QUEUES).
        let n = u16::from_le_bytes([got[34], got[35]]) as usize;
        let pci_n = u16::from_le_bytes([want[34], want[35]]) as usize;
        match queues {
            Some(q) => assert_eq!((n, pci_n), (q as usize, q as usize)),
            None => {
                assert_eq!((n, pci_n), (NUM_QUEUES, 1));
                want[34..36].copy_from_slice(&got[34..36]);
            }
        }
        assert_eq!(got, want, "{queues:?}");
        // A window past the fields reads as zeros.
        let (_, tail) = r.fe.get_config(0x100, 16, flags, &[0u8; 16]).unwrap();
        assert_eq!(tail, [0u8; 16]);
        r.end().1.unwrap();
    }
}

/// QEMU stops a ring with SET_VRING_ENABLE 0 (which has the ring's thread
/// look again) and GET_VRING_BASE at once (which stops the thread): the
/// stop must not be lost to the look, or the reply never comes and QEMU
/// hangs at shutdown. Many starts and stops, each answered in time.
#[test]
fn a_ring_stopped_right_after_it_was_disabled_answers() {
    let _s = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let g = Guest::new(true);
    let (kick, call) = (EventFd::new(0).unwrap(), EventFd::new(0).unwrap());
    let cfg = null_config();
    let be = Arc::new(VhostUserBackend::new(&cfg).unwrap());
    let (a, b) = UnixStream::pair().unwrap();
    // A reply that never comes: the rig's guard shuts the socket down
    // (the crate retries a timed-out read for ever: a socket timeout would not do).
    let be2 = be.clone();
    let session = std::thread::spawn(move || be2.session(&b));
    let mut r = Rig::new(a, 1, be, session);
    r.negotiate();
    r.start(&g, &kick, &call);
    // No ack awaited: GET_VRING_BASE follows SET_VRING_ENABLE as closely as the socket allows.
    r.fe.set_hdr_flags(VhostUserHeaderFlag::empty());
    for k in 0..3000 {
        r.fe.set_vring_enable(0, false).unwrap();
        assert_eq!(r.fe.get_vring_base(0).map_err(|e| format!("stop {k}: {e}")), Ok(0));
        r.fe.set_vring_base(0, 0).unwrap();
        r.fe.set_vring_kick(0, &kick).unwrap();
        r.fe.set_vring_enable(0, true).unwrap();
    }
    r.end().1.unwrap();
}

/// A pipe as a call, error or kick fd: once full (nobody reads it) a
/// write to it would block the ring's thread, with the device's lock held,
/// for good. Only eventfds are taken.
#[test]
fn a_pipe_as_a_call_error_or_kick_fd_is_refused() {
    let _s = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let g = Guest::new(true);
    for which in ["call", "error", "kick"] {
        let mut p = [0i32; 2];
        // SAFETY: a new pipe; each end owned below.
        assert_eq!(unsafe { libc::pipe2(p.as_mut_ptr(), libc::O_CLOEXEC) }, 0);
        // SAFETY: the read end is ours; the write end is owned by the EventFd.
        let (_read, pipe) = unsafe { (File::from_raw_fd(p[0]), EventFd::from_raw_fd(p[1])) };
        let mut r = rig(NotifyMode::Ioeventfd);
        r.negotiate();
        r.fe.set_mem_table(&[g.region()]).unwrap();
        r.fe.set_vring_num(0, QSIZE).unwrap();
        r.fe.set_vring_addr(0, &Rig::ring_config(&g, g.uva(DESC))).unwrap();
        let res = match which {
            "call" => r.fe.set_vring_call(0, &pipe),
            "error" => r.fe.set_vring_err(0, &pipe),
            _ => r.fe.set_vring_kick(0, &pipe),
        };
        refused(r, res, &format!("the {which} fd: not an eventfd"));
    }
}

/// A kick eventfd's count is the frontend's to choose: two kicks that
/// each carry nearly `u64::MAX` must not overflow the kicks counter (a
/// panic in debug, the ring's thread gone) and the ring is served on.
#[test]
fn kicks_near_the_eventfd_maximum_do_not_overflow() {
    let _s = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let g = Guest::new(true);
    let (kick, call) = (EventFd::new(0).unwrap(), EventFd::new(0).unwrap());
    let mut r = rig(NotifyMode::Ioeventfd);
    r.negotiate();
    r.start(&g, &kick, &call);
    for k in 0..3u16 {
        submit(&g, k, 1, 8, 0x10000);
        // The eventfd is full until the ring's thread reads the last kick.
        let t0 = Instant::now();
        while kick.write(u64::MAX - 1).is_err() {
            assert!(t0.elapsed() < Duration::from_secs(10), "kick {k}: the ring's thread reads no more kicks");
            std::thread::sleep(Duration::from_millis(5));
        }
        wait_used(&g, &call, k + 1);
    }
    let (be, res) = r.end();
    res.unwrap();
    assert_eq!(counter(&be, "requests"), 3);
}

/// A driver (a thread of the test) that keeps ring 0 (256 entries) full:
/// each entry the device uses is made available again at once (the same
/// 512 KiB write), so that a pass of the ring's thread finds work to its
/// end and the next one too. GET_VRING_BASE (which stops the thread) must
/// still be answered, on kicks and polling.
#[test]
fn a_ring_kept_full_still_stops_at_get_vring_base() {
    use std::sync::atomic::{AtomicBool, Ordering};
    const N: u16 = 256;
    let _s = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    for notify in [NotifyMode::Ioeventfd, NotifyMode::Poll] {
        let g = Guest::new(true);
        let (kick, call) = (EventFd::new(libc::EFD_NONBLOCK).unwrap(), EventFd::new(0).unwrap());
        // A file disk: each 512 KiB write a system call, a pass of the
        // ring's thread long enough for the driver to keep up through it.
        let disk = std::env::temp_dir().join(format!("iopath-vu-full-{}.img", std::process::id()));
        let mut r = rig_on(StorageKind::File(disk.clone()), notify);
        r.negotiate();
        r.fe.set_mem_table(&[g.region()]).unwrap();
        r.fe.set_vring_num(0, N).unwrap();
        let ring = VringConfigData { queue_max_size: N, queue_size: N, ..Rig::ring_config(&g, g.uva(DESC)) };
        r.fe.set_vring_addr(0, &ring).unwrap();
        r.fe.set_vring_base(0, 0).unwrap();
        r.fe.set_vring_call(0, &call).unwrap();
        r.fe.set_vring_kick(0, &kick).unwrap();
        r.fe.set_vring_enable(0, true).unwrap();
        // The one chain, at head 0: a write of 512 KiB at sector 0.
        let mut h = [0u8; 16];
        h[0..4].copy_from_slice(&1u32.to_le_bytes());
        g.write(0x8000, &h);
        for (j, (addr, len, flags)) in
            [(0x8000u64, 16u32, 1u16), (0x80000, 0x80000, 1), (0x9000, 1, 2)].iter().enumerate()
        {
            let mut d = [0u8; 16];
            d[0..8].copy_from_slice(&addr.to_le_bytes());
            d[8..12].copy_from_slice(&len.to_le_bytes());
            d[12..14].copy_from_slice(&flags.to_le_bytes());
            d[14..16].copy_from_slice(&(j as u16 + 1).to_le_bytes());
            g.write(DESC + 16 * j as u64, &d);
        }
        let done = Arc::new(AtomicBool::new(false));
        let (base, d2, k2) = (g.ptr as usize, done.clone(), kick.try_clone().unwrap());
        let feeder = std::thread::spawn(move || {
            let at = |gpa: u64| (base + gpa as usize) as *mut u16;
            let mut spins = 0u64;
            while !d2.load(Ordering::Relaxed) {
                // SAFETY: inside the guest's mapping, which outlives this thread (joined below).
                unsafe {
                    let used = std::ptr::read_volatile(at(USED + 2));
                    let mut avail = std::ptr::read_volatile(at(AVAIL + 2));
                    while avail != used.wrapping_add(N) {
                        std::ptr::write_volatile(at(AVAIL + 4 + 2 * (avail % N) as u64), 0);
                        avail = avail.wrapping_add(1);
                        std::sync::atomic::fence(Ordering::SeqCst);
                        std::ptr::write_volatile(at(AVAIL + 2), avail);
                    }
                }
                // Kicked only now and then: the refill is what keeps the ring full.
                spins += 1;
                if spins % 4096 == 1 {
                    let _ = k2.write(1);
                }
            }
        });
        // The device is busy: the used index moves.
        let t0 = Instant::now();
        while g.u16_at(USED + 2) < 1000 {
            assert!(t0.elapsed() < Duration::from_secs(10), "{notify}: the ring is not served");
            std::thread::sleep(Duration::from_millis(1));
        }
        let (tx, rx) = std::sync::mpsc::channel();
        let Rig { fe, be, session, guard } = r;
        let asker = std::thread::spawn(move || {
            let _ = tx.send(fe.get_vring_base(0).map_err(|e| e.to_string()));
            fe
        });
        let got = rx.recv_timeout(Duration::from_secs(10));
        done.store(true, Ordering::Relaxed);
        feeder.join().unwrap();
        assert!(matches!(got, Ok(Ok(_))), "{notify}: GET_VRING_BASE not answered: {got:?}");
        let fe = asker.join().unwrap();
        let (be, res) = Rig { fe, be, session, guard }.end();
        res.unwrap();
        let _ = std::fs::remove_file(&disk);
        assert!(counter(&be, "requests") >= 1000);
        assert_eq!(counter(&be, "ring_errors"), 0);
    }
}

/// QEMU's vhost-user-blk-pci asks for one queue per vCPU: with `-smp 16`
/// the sixteenth queue (index 15) is set up and serves requests.
#[test]
fn the_sixteenth_queue_serves_requests() {
    let _s = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let g = Guest::new(true);
    let (kick, call) = (EventFd::new(0).unwrap(), EventFd::new(0).unwrap());
    let mut r = rig_with_queues(StorageKind::Ram, NotifyMode::Ioeventfd, 16);
    r.negotiate();
    assert!(r.fe.get_queue_num().unwrap() >= 16);
    r.start_ring(&g, &kick, &call, 15);
    submit(&g, 0, 1, 8, 0x10000);
    kick.write(1).unwrap();
    wait_used(&g, &call, 1);
    let (be, res) = r.end();
    res.unwrap();
    assert_eq!(counter(&be, "q15.requests"), 1);
}

/// SET_VRING_ADDR before SET_VRING_NUM (the order is the frontend's): a
/// small ring near the end of the memory fits its own size, not the
/// device's largest; it is checked once its size is known.
#[test]
fn ring_addresses_before_the_ring_size_are_checked_at_that_size() {
    let _s = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let g = Guest::new(true);
    let (kick, call) = (EventFd::new(0).unwrap(), EventFd::new(0).unwrap());
    let mut r = rig(NotifyMode::Ioeventfd);
    r.negotiate();
    r.fe.set_mem_table(&[g.region()]).unwrap();
    // 8 descriptors (128 bytes) in the memory's last 512 bytes.
    let ring = VringConfigData { queue_size: 8, ..Rig::ring_config(&g, g.uva(MEM as u64 - 512)) };
    r.fe.set_vring_addr(0, &ring).unwrap();
    r.fe.set_vring_num(0, 8).unwrap();
    r.fe.set_vring_base(0, 0).unwrap();
    r.fe.set_vring_call(0, &call).unwrap();
    r.fe.set_vring_kick(0, &kick).unwrap();
    r.fe.set_vring_enable(0, true).unwrap();
    assert_eq!(r.fe.get_vring_base(0).unwrap(), 0);
    r.end().1.unwrap();
}

/// CHECK_DEVICE_STATE (not offered): the crate answers the refusal with an
/// error in its reply and would read on; the session ends all the same,
/// as at every refused request.
#[test]
fn a_refused_check_device_state_ends_the_session() {
    use std::io::{Read, Write};
    let _s = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let cfg = null_config();
    let be = Arc::new(VhostUserBackend::new(&cfg).unwrap());
    let (mut a, b) = UnixStream::pair().unwrap();
    b.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let be2 = be.clone();
    let session = std::thread::spawn(move || be2.session(&b));
    let mut hdr = [0u8; 12];
    hdr[0..4].copy_from_slice(&43u32.to_le_bytes()); // CHECK_DEVICE_STATE
    hdr[4..8].copy_from_slice(&1u32.to_le_bytes()); // version 1
    a.write_all(&hdr).unwrap();
    a.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut reply = [0u8; 20];
    a.read_exact(&mut reply).unwrap();
    assert_eq!(u64::from_le_bytes(reply[12..20].try_into().unwrap()), 1, "an error in the reply");
    let mut more = [0u8; 1];
    assert_eq!(a.read(&mut more).map_err(|e| e.kind()), Ok(0), "the session went on after a refusal");
    let e = session.join().unwrap().unwrap_err().to_string();
    assert!(e.contains("CHECK_DEVICE_STATE"), "{e}");
    assert_eq!(counter(&be, "refused"), 1);
}

/// Request `k`'s status byte (0: S_OK; 0xff: not written).
fn status(g: &Guest, k: u16) -> u8 {
    let mut st = [0u8; 1];
    g.read(0x9000 + k as u64, &mut st);
    st[0]
}

/// The in-flight region as the frontend holds it (its memfd, mapped here).
struct Inflight {
    p: *mut u8,
    len: usize,
}

impl Inflight {
    fn map(f: &File, len: usize) -> Inflight {
        // SAFETY: a fresh shared mapping of the region's memfd, as long as it.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                f.as_raw_fd(),
                0,
            )
        };
        assert_ne!(p, libc::MAP_FAILED);
        Inflight { p: p.cast(), len }
    }
    fn at<const N: usize>(&self, off: usize) -> [u8; N] {
        assert!(off + N <= self.len);
        // SAFETY: inside the mapping.
        unsafe { std::ptr::read_volatile(self.p.add(off).cast::<[u8; N]>()) }
    }
    fn put(&self, off: usize, b: &[u8]) {
        assert!(off + b.len() <= self.len);
        // SAFETY: inside the mapping.
        unsafe { std::ptr::copy_nonoverlapping(b.as_ptr(), self.p.add(off), b.len()) }
    }
    fn u16(&self, off: usize) -> u16 {
        u16::from_le_bytes(self.at(off))
    }
    /// Descriptor `i`'s entry: in flight or not, its counter.
    fn mark(&self, i: u16, inflight: bool, counter: u64) {
        let e = 16 + 16 * i as usize;
        self.put(e, &[inflight as u8]);
        self.put(e + 8, &counter.to_le_bytes());
    }
    fn inflight(&self, i: u16) -> bool {
        self.at::<1>(16 + 16 * i as usize)[0] == 1
    }
}

impl Drop for Inflight {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `map`.
        unsafe { libc::munmap(self.p.cast(), self.len) };
    }
}

/// A session on `be` (kept across sessions, as `iopath serve` keeps it), negotiated with
/// INFLIGHT_SHMFD as QEMU's vhost-user-blk does.
fn session_on(be: &Arc<VhostUserBackend>) -> Rig {
    let (a, b) = UnixStream::pair().unwrap();
    b.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let be2 = be.clone();
    let session = std::thread::spawn(move || be2.session(&b));
    let mut r = Rig::new(a, 1, be.clone(), session);
    let fe = &mut r.fe;
    fe.set_owner().unwrap();
    assert_ne!(fe.get_features().unwrap() & F_PROTOCOL_FEATURES, 0);
    fe.set_features(F_VERSION_1 | F_PROTOCOL_FEATURES).unwrap();
    let pf = fe.get_protocol_features().unwrap();
    assert!(pf.contains(VhostUserProtocolFeatures::INFLIGHT_SHMFD), "{pf:?}");
    fe.set_protocol_features(VhostUserProtocolFeatures::REPLY_ACK | VhostUserProtocolFeatures::INFLIGHT_SHMFD).unwrap();
    fe.set_hdr_flags(VhostUserHeaderFlag::NEED_REPLY);
    r
}

/// In-flight tracking across a backend's death, driven by the `vhost` crate's frontend: a
/// first session writes through a region it got with GET_INFLIGHT_FD (the region then says
/// nothing is in flight, used_idx 2). The test then leaves the region as a backend killed at
/// two points would: chains of requests 3 and 2 (avail entries 2 and 3) taken, request 3
/// first by counter; and request 1's entry still set though its used index was published
/// (the region's used_idx lags: a death between the used index and the clear). A second
/// session with the same region (SET_INFLIGHT_FD) and QEMU's base after a lost backend (the
/// used index) must serve 3 then 2 (both write sector 16: 2's data must win), never request
/// 1 again, then take only the new request 4 (a read of sector 16) from the avail ring: used
/// index 5, not 7.
#[test]
fn chains_a_dead_backend_left_in_flight_are_resubmitted_in_counter_order_once() {
    let _s = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let g = Guest::new(true);
    let (kick, call) = (EventFd::new(0).unwrap(), EventFd::new(0).unwrap());
    let cfg = VirtioBlkConfig { backend: StorageKind::Ram, size: MEM as u64, ..null_config() };
    let be = Arc::new(VhostUserBackend::new(&cfg).unwrap());
    let mut r = session_on(&be);
    let (info, region) =
        r.fe.get_inflight_fd(&vhost::vhost_user::message::VhostUserInflight::new(0, 0, 1, QSIZE)).unwrap();
    assert!(info.mmap_size >= 16 + 16 * QSIZE as u64, "{}", info.mmap_size);
    r.fe.set_inflight_fd(&info, region.as_raw_fd()).unwrap();
    r.start(&g, &kick, &call);
    let (a, b, c): (Vec<u8>, Vec<u8>, Vec<u8>) =
        ((0..4096u32).map(|i| i as u8).collect(), vec![0xbb; 4096], vec![0xcc; 4096]);
    g.write(0x10000, &a);
    submit(&g, 0, 1, 8, 0x10000);
    submit(&g, 1, 1, 9, 0x10000);
    kick.write(1).unwrap();
    wait_used(&g, &call, 2);
    assert_eq!(r.fe.get_vring_base(0).unwrap(), 2);
    let inf = Inflight::map(&region, info.mmap_size as usize);
    assert_eq!((inf.u16(8), inf.u16(10), inf.u16(14)), (1, QSIZE, 2), "version, desc_num, used_idx");
    assert!((0..QSIZE).all(|i| !inf.inflight(i)), "nothing in flight after both completed");
    let (_, res) = r.end();
    res.unwrap();

    // What a backend killed in the middle leaves: requests 2 (head 6) and 3 (head 9) taken,
    // 3 first; request 1 (head 3) completed but its entry not cleared (region used_idx 1).
    g.write(0x11000, &b);
    g.write(0x12000, &c);
    submit(&g, 2, 1, 16, 0x11000);
    submit(&g, 3, 1, 16, 0x12000);
    inf.mark(9, true, 10);
    inf.mark(6, true, 11);
    inf.mark(3, true, 9);
    inf.put(12, &3u16.to_le_bytes()); // last_batch_head: request 1's head
    inf.put(14, &1u16.to_le_bytes()); // used_idx one behind the used ring's
    submit(&g, 4, 0, 16, 0x13000); // a new request: read sector 16

    let mut r = session_on(&be);
    r.fe.set_inflight_fd(&info, region.as_raw_fd()).unwrap();
    r.start(&g, &kick, &call); // base 0 as sent by start(): the region's count decides
    kick.write(1).unwrap();
    wait_used(&g, &call, 5);
    assert_eq!(r.fe.get_vring_base(0).unwrap(), 5, "the next available index after the one new chain");
    assert_eq!(g.u16_at(USED + 2), 5, "a chain completed twice");
    let used: Vec<u16> = (2..5).map(|k| g.u16_at(USED + 4 + 8 * k)).collect();
    assert_eq!(used, [9, 6, 12], "the resubmitted chains by counter, then the new one");
    assert_eq!((status(&g, 2), status(&g, 3), status(&g, 4)), (0, 0, 0));
    let mut back = vec![0u8; 4096];
    g.read(0x13000, &mut back);
    assert!(back == b, "request 2 (counter 11) wrote last: sector 16 holds its data");
    assert!((0..QSIZE).all(|i| !inf.inflight(i)) && inf.u16(14) == 5, "the region after");
    let (be, res) = r.end();
    res.unwrap();
    assert_eq!(counter(&be, "inflight_resubmits"), 2);
    assert_eq!(counter(&be, "requests"), 5);
}

/// GET_INFLIGHT_FD for more queues than the device has, or a size it does not serve, ends the
/// session (the crate has no error reply for it); SET_INFLIGHT_FD with an mmap_size too small
/// for its queues gets an error reply.
#[test]
fn inflight_numbers_past_the_device_are_refused() {
    let _s = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    use vhost::vhost_user::message::VhostUserInflight;
    let be = Arc::new(VhostUserBackend::new(&null_config()).unwrap());
    let mut r = session_on(&be);
    let (info, f) = r.fe.get_inflight_fd(&VhostUserInflight::new(0, 0, 1, QSIZE)).unwrap();
    let small = VhostUserInflight::new(64, 0, 1, QSIZE);
    assert!(r.fe.set_inflight_fd(&small, f.as_raw_fd()).is_err(), "a region too small for its queue");
    drop(r.end());
    let mut r = session_on(&be);
    let big = VhostUserInflight::new(0, 0, (NUM_QUEUES + 1) as u16, QSIZE);
    assert!(r.fe.get_inflight_fd(&big).is_err());
    let (_, res) = r.end();
    assert!(res.unwrap_err().to_string().contains("queues"));
    let mut r = session_on(&be);
    assert!(r.fe.get_inflight_fd(&VhostUserInflight::new(0, 0, 1, 1024)).is_err());
    drop(r.end());
    assert!(info.mmap_size > 0);
}
