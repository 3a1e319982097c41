//! Hostile peers: what a malicious or broken client/server may send must be
//! refused without leaking resources or crashing the other side.

mod common;

use iopath_protocols::socket::{self, MAX_FDS};
use std::fs::File;
use std::io::ErrorKind;
use std::os::fd::{AsRawFd, FromRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::sync::Mutex;

/// Tests in this file run one at a time: one counts the process's fds, and
/// the others open and close fds (sockets, memfds, a child's pipes) meanwhile.
static FD_COUNTING: Mutex<()> = Mutex::new(());

fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").unwrap().count()
}

fn memfd() -> File {
    // SAFETY: a NUL-terminated name; the new fd is owned at once.
    let fd = unsafe { libc::memfd_create(c"hostile".as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) };
    assert!(fd >= 0, "memfd_create: {}", std::io::Error::last_os_error());
    // SAFETY: a fresh fd nothing else owns.
    unsafe { File::from_raw_fd(fd) }
}

/// D4: a message with n fds is received; more than MAX_FDS is an error, and
/// in every case no fd stays open once the received `File`s are dropped.
#[test]
fn scm_rights_over_the_limit_is_refused_and_leaks_no_fd() {
    let _g = FD_COUNTING.lock().unwrap_or_else(|e| e.into_inner());
    let f = memfd();
    for n in [1usize, 16, 17, 18, 30] {
        let (a, b) = UnixStream::pair().unwrap();
        let before = open_fds();
        let fds: Vec<RawFd> = vec![f.as_raw_fd(); n];
        socket::send(&a, &[b"hdr!", b"body"], &fds).unwrap();
        let mut h = [0u8; 4];
        let r = socket::recv_exact(&b, &mut h);
        if n <= MAX_FDS {
            let files = r.unwrap_or_else(|e| panic!("{n} fds: {e}"));
            assert_eq!(files.len(), n);
            assert_eq!(&h, b"hdr!");
        } else {
            let e = r.expect_err(&format!("{n} fds must be refused"));
            assert_eq!(e.kind(), ErrorKind::InvalidData, "{n} fds: {e}");
        }
        // Everything received is dropped by now (Ok's files, or the error).
        let after = open_fds();
        assert_eq!(after, before, "{n} fds: {} fd(s) leaked", after as isize - before as isize);
    }
}

mod hostile_server {
    use iopath_protocols::socket;
    use iopath_protocols::vfio_user::wire::*;
    use std::os::unix::net::UnixStream;

    /// A vfio-user server that advertises a 4 GiB max_data_xfer_size and,
    /// on every REGION_READ, first asks the client to DMA_READ `dma_count`
    /// bytes. Returns the replies' (error flag, errno, payload length).
    pub fn serve(sock: UnixStream, dma_count: u64) -> Vec<(bool, u32, usize)> {
        let mut seen = Vec::new();
        let mut next_id = 0x4000u16;
        loop {
            let mut h = [0u8; HEADER_SIZE];
            if socket::recv_exact(&sock, &mut h).is_err() {
                return seen;
            }
            let hdr = Header::parse(&h);
            let mut payload = vec![0u8; hdr.payload_len().unwrap()];
            socket::recv_exact(&sock, &mut payload).unwrap();
            let body = match hdr.command().unwrap() {
                Command::Version => {
                    let caps = Capabilities { max_data_xfer_size: u32::MAX, max_msg_fds: 16, ..Default::default() };
                    Version { major: 0, minor: 2, capabilities: Some(caps) }.to_bytes()
                }
                Command::DeviceGetInfo => {
                    DeviceInfo { argsz: 16, flags: DEVICE_FLAGS_PCI, num_regions: 9, num_irqs: 5 }.to_bytes()
                }
                Command::DeviceGetIrqInfo => {
                    let q = IrqInfo::parse(&payload).unwrap();
                    IrqInfo { argsz: 16, flags: IRQ_INFO_EVENTFD, index: q.index, count: 0 }.to_bytes()
                }
                Command::DeviceGetRegionInfo => {
                    let q = RegionInfo::parse(&payload).unwrap();
                    let size = if q.index == 0 { 0x1000 } else { 0 };
                    let flags = REGION_INFO_FLAG_READ | REGION_INFO_FLAG_WRITE;
                    RegionInfoReply::new(q.index, flags, size, 0, None).to_bytes()
                }
                Command::RegionRead => {
                    let q = RegionAccess::parse(&payload).unwrap();
                    if q.region == 0 {
                        next_id = next_id.wrapping_add(1);
                        let a = DmaAccess { address: 0, count: dma_count }.to_bytes();
                        socket::send(&sock, &[&message(next_id, Command::DmaRead, FLAGS_TYPE_COMMAND, &a)], &[])
                            .unwrap();
                        let mut rh = [0u8; HEADER_SIZE];
                        socket::recv_exact(&sock, &mut rh).unwrap();
                        let r = Header::parse(&rh);
                        let mut rp = vec![0u8; r.payload_len().unwrap()];
                        socket::recv_exact(&sock, &mut rp).unwrap();
                        assert_eq!(r.msg_id, next_id);
                        seen.push((r.is_error(), r.error_no, rp.len()));
                    }
                    RegionAccess::to_bytes_with_data(q.offset, q.region, &vec![0u8; q.count as usize])
                }
                Command::RegionWrite => RegionAccess::parse_with_data(&payload).unwrap().0.to_bytes(),
                Command::DmaMap | Command::DeviceSetIrqs | Command::DeviceReset => vec![],
                _ => {
                    socket::send(&sock, &[&error_reply(&hdr, libc::ENOSYS)], &[]).unwrap();
                    continue;
                }
            };
            socket::send(&sock, &[&reply(&hdr, &body)], &[]).unwrap();
        }
    }
}

/// Peak resident set of this process, in KiB.
fn vm_hwm_kib() -> u64 {
    let s = std::fs::read_to_string("/proc/self/status").unwrap();
    let l = s.lines().find(|l| l.starts_with("VmHWM:")).unwrap();
    l.split_whitespace().nth(1).unwrap().parse().unwrap()
}

/// Proxy DMA bound: a server that advertises 4 GiB transfers and asks the
/// VMM for a 1 GiB DMA_READ gets an error reply (the proxy's own 1 MiB
/// limit), not a 1 GiB buffer; a read within the limit is still answered.
#[test]
fn proxy_refuses_a_dma_read_beyond_its_own_transfer_limit() {
    let _g = FD_COUNTING.lock().unwrap_or_else(|e| e.into_inner());
    use iopath_devices::{DeviceContext, DeviceModelMut, FailFn};
    use iopath_protocols::function::{map_guest_memory, SharedRegion};
    use iopath_protocols::vfio_user::VfioUserProxy;
    use std::sync::Arc;

    for (count, want_error) in [(1u64 << 30, true), (4096, false)] {
        let (a, b) = UnixStream::pair().unwrap();
        let h = std::thread::spawn(move || hostile_server::serve(b, count));
        let mut p = VfioUserProxy::connect(a, None).unwrap();
        let ram = memfd();
        ram.set_len(1 << 20).unwrap();
        let owner = iopath_protocols::sigbus::Owner::new(None::<&File>).unwrap();
        let (mem, _) =
            map_guest_memory(vec![SharedRegion { gpa: 0, size: 1 << 20, offset: 0, file: ram }], &owner).unwrap();
        let fail: FailFn = Arc::new(|m: String| panic!("the proxy failed: {m}"));
        let irq = Arc::new(iopath_devices::NoInterrupts);
        p.attach(DeviceContext { mem, ioevents: Arc::new(iopath_devices::NoIoEvents), irq, fail });
        let hwm = vm_hwm_kib();
        let mut d = [0u8; 4];
        p.bar_read(0, 0, &mut d);
        let grew = vm_hwm_kib().saturating_sub(hwm);
        drop(p);
        let seen = h.join().unwrap();
        assert_eq!(seen.len(), 1, "one DMA_READ asked");
        let (err, errno, len) = seen[0];
        if want_error {
            assert!(err, "a {count}-byte DMA_READ was answered with {len} bytes");
            assert!(
                errno == libc::E2BIG as u32 || errno == libc::EINVAL as u32,
                "errno {errno}: expected E2BIG/EINVAL (a bound check, not a failed read of a huge buffer)"
            );
        } else {
            assert!(!err, "a {count}-byte DMA_READ within the limit was refused (errno {errno})");
            assert_eq!(len, 16 + count as usize);
        }
        assert!(grew < 64 << 10, "peak RSS grew by {grew} KiB");
    }
}

/// One request/reply on a raw vfio-user socket: (error flag, errno, payload).
fn vfio_request(
    sock: &UnixStream,
    id: u16,
    cmd: iopath_protocols::vfio_user::wire::Command,
    payload: &[u8],
    fds: &[RawFd],
) -> (bool, u32, Vec<u8>) {
    use iopath_protocols::vfio_user::wire::*;
    socket::send(sock, &[&message(id, cmd, FLAGS_TYPE_COMMAND, payload)], fds).unwrap();
    let mut h = [0u8; HEADER_SIZE];
    socket::recv_exact(sock, &mut h).unwrap();
    let r = Header::parse(&h);
    let mut p = vec![0u8; r.payload_len().unwrap()];
    socket::recv_exact(sock, &mut p).unwrap();
    assert_eq!(r.msg_id, id);
    (r.is_error(), r.error_no, p)
}

const D10_CHILD: &str = "IOPATH_HOSTILE_DMA_MAPS_CHILD";

/// D10, run in a child process whose RLIMIT_NOFILE is 256: a client maps
/// sealed memfds until the server refuses; the refusal is ENOSPC at or
/// before the advertised max_dma_maps, never EMFILE or a dead session, and
/// every accepted map is still usable (the device sees the new memory).
#[test]
fn dma_maps_are_refused_with_enospc_within_the_advertised_count() {
    let _g = FD_COUNTING.lock().unwrap_or_else(|e| e.into_inner());
    if std::env::var_os(D10_CHILD).is_some() {
        return dma_maps_child();
    }
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "dma_maps_are_refused_with_enospc_within_the_advertised_count", "--nocapture"])
        .env(D10_CHILD, "1")
        .output()
        .unwrap();
    let log = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "child failed:\n{log}");
    assert!(log.contains("1 passed"), "{log}");
}

fn dma_maps_child() {
    use iopath_protocols::vfio_user::wire::*;

    let lim = libc::rlimit { rlim_cur: 256, rlim_max: 256 };
    // SAFETY: a valid rlimit; this child process is only this test.
    assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &lim) }, 0);
    let (path, server) = common::serve("pci-testdev", "hostile-d10");
    let sock = common::dial(&path);
    let caps = Capabilities { max_msg_fds: 16, max_dma_maps: 65535, ..Default::default() };
    let v = Version { major: VERSION_MAJOR, minor: VERSION_MINOR, capabilities: Some(caps) };
    let (err, _, p) = vfio_request(&sock, 1, Command::Version, &v.to_bytes(), &[]);
    assert!(!err);
    let advertised = Version::parse(&p).unwrap().caps().max_dma_maps as usize;
    let mut accepted = 0usize;
    let mut id = 1u16;
    loop {
        assert!(accepted <= advertised, "{accepted} maps accepted, more than the {advertised} advertised");
        let f = memfd();
        f.set_len(4096).unwrap();
        let seals = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW;
        // SAFETY: F_ADD_SEALS on the memfd `f` owns; the argument is an integer.
        assert_eq!(unsafe { libc::fcntl(f.as_raw_fd(), libc::F_ADD_SEALS, seals) }, 0);
        let flags = DMA_MAP_FLAG_READ | DMA_MAP_FLAG_WRITE;
        let m = DmaMap { flags, offset: 0, address: (accepted as u64) << 12, size: 4096 };
        id = id.wrapping_add(1);
        let (err, errno, _) = vfio_request(&sock, id, Command::DmaMap, &m.to_bytes(), &[f.as_raw_fd()]);
        drop(f); // the client keeps no fd: the server's budget is what counts
        if err {
            assert_eq!(errno, libc::ENOSPC as u32, "map {accepted} refused with errno {errno}, not ENOSPC");
            break;
        }
        accepted += 1;
        assert!(accepted < 100_000);
    }
    assert!(accepted > 0 && accepted <= advertised, "{accepted} accepted, {advertised} advertised");
    // The session is alive and the maps are there: unmapping each works.
    for i in 0..accepted {
        id = id.wrapping_add(1);
        let u = DmaUnmap::new(0, (i as u64) << 12, 4096);
        let (err, errno, _) = vfio_request(&sock, id, Command::DmaUnmap, &u.to_bytes(), &[]);
        assert!(!err, "unmap {i}: errno {errno}");
    }
    drop(sock);
    server.join().unwrap();
    eprintln!("{accepted} maps accepted of {advertised} advertised");
}

/// A REGION_WRITE (and a REGION_READ) of 0 bytes at every offset of both of
/// pci-testdev's BARs and past their ends: each is refused with EINVAL
/// before it reaches the model, and the session goes on (the device counts
/// a real write afterwards). pci-testdev's own `bar_write` took the first
/// byte of any write and panicked on an empty one; no protocol lets a peer
/// send one (every server checks the size first), so that guard, for
/// in-process callers, is tested beside it in `devices/src/testdev.rs`.
#[test]
fn empty_region_accesses_are_refused_and_the_session_goes_on() {
    use iopath_protocols::vfio_user::wire::*;
    let _g = FD_COUNTING.lock().unwrap_or_else(|e| e.into_inner());
    let (path, server) = common::serve("pci-testdev", "hostile-empty");
    let sock = common::dial(&path);
    let v = Version { major: VERSION_MAJOR, minor: VERSION_MINOR, capabilities: None };
    assert!(!vfio_request(&sock, 1, Command::Version, &v.to_bytes(), &[]).0);
    let mut id = 1u16;
    for (bar, size) in [(0u32, 4096u64), (1, 256)] {
        for offset in (0..size + 16).step_by(3) {
            id = id.wrapping_add(1);
            let w = RegionAccess::to_bytes_with_data(offset, bar, &[]);
            let (err, errno, _) = vfio_request(&sock, id, Command::RegionWrite, &w, &[]);
            assert!(err && errno == libc::EINVAL as u32, "BAR{bar} empty write at {offset}: errno {errno}");
            id = id.wrapping_add(1);
            let r = RegionAccess { offset, region: bar, count: 0 }.to_bytes();
            let (err, errno, _) = vfio_request(&sock, id, Command::RegionRead, &r, &[]);
            assert!(err && errno == libc::EINVAL as u32, "BAR{bar} empty read at {offset}: errno {errno}");
        }
    }
    // Still served: select test 0 (the MMIO no-eventfd test), write its
    // address, read its count back.
    let write = |id: u16, offset: u64, data: &[u8]| {
        let w = RegionAccess::to_bytes_with_data(offset, 0, data);
        assert!(!vfio_request(&sock, id, Command::RegionWrite, &w, &[]).0);
    };
    write(9000, 0, &[0]);
    write(9001, 2048, &[0xfa]);
    let r = RegionAccess { offset: 12, region: 0, count: 4 }.to_bytes();
    let (err, _, p) = vfio_request(&sock, 9002, Command::RegionRead, &r, &[]);
    assert!(!err);
    let count = u32::from_le_bytes(p[p.len() - 4..].try_into().unwrap());
    assert_eq!(count, 1, "the write after the empty ones reached the device");
    drop(sock);
    server.join().unwrap();
}
