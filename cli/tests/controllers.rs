//! `iopath serve nvme --controllers 3 --pollers 1 --socket DIR/c{}.sock`:
//! three controllers in one process, each on its own socket with its own
//! client (a small NVMe driver over raw vfio-user messages), polled by one
//! pool thread.
//!
//! Oracles: each controller's data is its own (a block written on one reads
//! back as written there and as zeros on the others); in `bar` mode every
//! doorbell (admin ones too) is served only by a poller, so each client's
//! completions show a poller served its controller, and the process has one
//! poller thread (`nvme-pool-0`, no `nvme-poller`); each controller's
//! counters line (tagged with its index) counts its own polls and I/O.

mod common;
use common::TempDir;

use iopath_protocols::socket;
use iopath_protocols::vfio_user::wire::*;
use std::os::fd::{AsRawFd, FromRawFd};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::process::Child;
use std::time::{Duration, Instant};

const HUNG: Duration = Duration::from_secs(20);
/// Guest RAM: `RAM` bytes at `BASE`, laid out as offsets into it.
const BASE: u64 = 0x10_0000;
const RAM: usize = 1 << 20;
const ASQ: u64 = 0;
const ACQ: u64 = 0x1000;
const IOSQ: u64 = 0x2000;
const IOCQ: u64 = 0x3000;
const IDN: u64 = 0x4000;
const WBUF: u64 = 0x8000;
const RBUF: u64 = 0x9000;

struct Server(Child);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A memfd of RAM bytes and this test's mapping of it.
struct Ram {
    file: std::fs::File,
    ptr: *mut u8,
}

impl Ram {
    fn new() -> Ram {
        let name = std::ffi::CString::new("controllers-test").unwrap();
        // SAFETY: memfd_create with a valid name; the fd is owned by the File.
        let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
        assert!(fd >= 0, "memfd_create: {}", std::io::Error::last_os_error());
        // SAFETY: a fresh descriptor nobody else owns.
        let file = unsafe { std::fs::File::from_raw_fd(fd) };
        file.set_len(RAM as u64).unwrap();
        // SAFETY: a fresh shared mapping of a file of RAM bytes.
        let p = unsafe {
            libc::mmap(std::ptr::null_mut(), RAM, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED, fd, 0)
        };
        assert_ne!(p, libc::MAP_FAILED, "{}", std::io::Error::last_os_error());
        Ram { file, ptr: p.cast() }
    }

    fn write(&self, off: u64, data: &[u8]) {
        assert!(off as usize + data.len() <= RAM);
        // SAFETY: inside the mapping (checked above).
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), self.ptr.add(off as usize), data.len()) }
    }

    fn read(&self, off: u64, out: &mut [u8]) {
        assert!(off as usize + out.len() <= RAM);
        for (i, b) in out.iter_mut().enumerate() {
            // SAFETY: inside the mapping (checked above); volatile, the device writes concurrently.
            *b = unsafe { std::ptr::read_volatile(self.ptr.add(off as usize + i)) };
        }
    }
}

impl Drop for Ram {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `new`.
        unsafe { libc::munmap(self.ptr.cast(), RAM) };
    }
}

/// A raw vfio-user client with a small NVMe driver: admin and one I/O
/// queue pair of 16 entries in its RAM, register writes as messages.
struct Client<'a> {
    s: UnixStream,
    id: u16,
    ram: &'a Ram,
    tails: [u16; 2],
}

impl<'a> Client<'a> {
    fn connect(path: &Path, ram: &'a Ram) -> Client<'a> {
        let s = UnixStream::connect(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        s.set_read_timeout(Some(HUNG)).unwrap();
        let mut c = Client { s, id: 0, ram, tails: [0, 0] };
        let caps = Capabilities { max_msg_fds: 16, ..Default::default() };
        let v = Version { major: VERSION_MAJOR, minor: VERSION_MINOR, capabilities: Some(caps) };
        c.call(Command::Version, &v.to_bytes(), &[]);
        let m = DmaMap { flags: DMA_MAP_FLAG_READ | DMA_MAP_FLAG_WRITE, offset: 0, address: BASE, size: RAM as u64 };
        c.call(Command::DmaMap, &m.to_bytes(), &[ram.file.as_raw_fd()]);
        c.reg(0x24, 15u32 << 16 | 15);
        c.reg(0x28, (BASE + ASQ) as u32);
        c.reg(0x2c, 0);
        c.reg(0x30, (BASE + ACQ) as u32);
        c.reg(0x34, 0);
        c.reg(0x14, 0x0046_0001);
        c
    }

    fn call(&mut self, cmd: Command, payload: &[u8], fds: &[i32]) {
        self.id = self.id.wrapping_add(1);
        socket::send(&self.s, &[&message(self.id, cmd, FLAGS_TYPE_COMMAND, payload)], fds).unwrap();
        let mut h = [0u8; HEADER_SIZE];
        socket::recv_exact(&self.s, &mut h).unwrap();
        let r = Header::parse(&h);
        let mut p = vec![0u8; r.payload_len().unwrap()];
        socket::recv_exact(&self.s, &mut p).unwrap();
        assert_eq!((r.msg_id, r.cmd), (self.id, cmd as u16), "not the reply");
        assert!(!r.is_error(), "{cmd:?}: errno {}", r.error_no);
    }

    fn reg(&mut self, off: u64, v: u32) {
        self.call(Command::RegionWrite, &RegionAccess::to_bytes_with_data(off, 0, &v.to_le_bytes()), &[]);
    }

    /// Submits on queue `q` (0: admin, 1: I/O) and waits for its completion: its status.
    fn command(&mut self, q: usize, opcode: u8, nsid: u32, prp1: u64, cdw: [u32; 3]) -> u16 {
        let (sq, cq) = if q == 0 { (ASQ, ACQ) } else { (IOSQ, IOCQ) };
        let slot = self.tails[q] as u64;
        assert!(slot < 16, "the test's queues do not wrap");
        let mut sqe = [0u8; 64];
        sqe[0] = opcode;
        sqe[2..4].copy_from_slice(&(0x100 * q as u16 + slot as u16).to_le_bytes());
        sqe[4..8].copy_from_slice(&nsid.to_le_bytes());
        sqe[24..32].copy_from_slice(&prp1.to_le_bytes());
        for (i, d) in cdw.iter().enumerate() {
            sqe[40 + 4 * i..44 + 4 * i].copy_from_slice(&d.to_le_bytes());
        }
        self.ram.write(sq + 64 * slot, &sqe);
        self.tails[q] += 1;
        let tail = self.tails[q] as u32;
        self.reg(0x1000 + 8 * q as u64, tail);
        let t0 = Instant::now();
        let mut cqe = [0u8; 16];
        loop {
            self.ram.read(cq + 16 * slot, &mut cqe);
            if cqe[14] & 1 == 1 {
                assert_eq!(u16::from_le_bytes([cqe[12], cqe[13]]), 0x100 * q as u16 + slot as u16, "command id");
                // The CQ head, as a driver would.
                self.reg(0x1000 + 8 * q as u64 + 4, tail);
                return u16::from_le_bytes([cqe[14], cqe[15]]) >> 1;
            }
            assert!(t0.elapsed() < HUNG, "no completion of opcode {opcode:#x} on queue {q}");
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// Identify Namespace 1 (its LBA size) and an I/O queue pair.
    fn setup(&mut self) -> usize {
        assert_eq!(self.command(0, 0x06, 1, BASE + IDN, [0, 0, 0]), 0, "Identify Namespace");
        let mut ns = [0u8; 192];
        self.ram.read(IDN, &mut ns);
        let lba = 1usize << ns[128 + 4 * (ns[26] & 0xf) as usize + 2];
        assert!((512..=4096).contains(&lba), "LBA size {lba}");
        assert_eq!(self.command(0, 0x05, 0, BASE + IOCQ, [15 << 16 | 1, 1, 0]), 0, "Create I/O CQ");
        assert_eq!(self.command(0, 0x01, 0, BASE + IOSQ, [15 << 16 | 1, 1 << 16 | 1, 0]), 0, "Create I/O SQ");
        lba
    }

    /// LBA 3 of namespace 1.
    fn read_block(&mut self, lba: usize) -> Vec<u8> {
        self.ram.write(RBUF, &vec![0xeeu8; lba]);
        assert_eq!(self.command(1, 0x02, 1, BASE + RBUF, [3, 0, 0]), 0, "Read");
        let mut back = vec![0u8; lba];
        self.ram.read(RBUF, &mut back);
        back
    }

    fn write_block(&mut self, data: &[u8]) {
        self.ram.write(WBUF, data);
        assert_eq!(self.command(1, 0x01, 1, BASE + WBUF, [3, 0, 0]), 0, "Write");
    }
}

/// The threads of process `pid` by name.
fn thread_names(pid: u32) -> Vec<String> {
    let mut v = Vec::new();
    for t in std::fs::read_dir(format!("/proc/{pid}/task")).unwrap() {
        let comm = t.unwrap().path().join("comm");
        v.push(std::fs::read_to_string(comm).unwrap_or_default().trim().to_string());
    }
    v
}

#[test]
fn three_controllers_one_poller_each_its_own_data() {
    let d = TempDir::new("controllers");
    let pattern = d.path("c{}.sock");
    let out = d.path("serve.out");
    let err = d.path("serve.err");
    let child = std::process::Command::new(env!("CARGO_BIN_EXE_iopath"))
        .args(["serve", "nvme,doorbell=bar,backend=ram,size_mb=1", "--controllers", "3", "--pollers", "1", "--socket"])
        .arg(&pattern)
        .stdout(std::fs::File::create(&out).unwrap())
        .stderr(std::fs::File::create(&err).unwrap())
        .spawn()
        .unwrap();
    let mut server = Server(child);
    let pid = server.0.id();
    let socks: Vec<_> = (0..3).map(|i| d.path(&format!("c{i}.sock"))).collect();
    let t0 = Instant::now();
    while std::fs::read_to_string(&err).unwrap_or_default().matches("controller ").count() < 3 {
        if let Some(s) = server.0.try_wait().unwrap() {
            panic!("serve exited ({s}): {}", std::fs::read_to_string(&err).unwrap_or_default());
        }
        assert!(t0.elapsed() < HUNG, "serve never listened: {}", std::fs::read_to_string(&err).unwrap_or_default());
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(socks.iter().all(|s| s.exists()), "a socket per controller");

    // All three clients connected at once, each on its own controller.
    let rams: Vec<Ram> = (0..3).map(|_| Ram::new()).collect();
    let mut cs: Vec<Client> = socks.iter().zip(&rams).map(|(s, r)| Client::connect(s, r)).collect();
    let lba = cs.iter_mut().map(|c| c.setup()).collect::<Vec<_>>()[0];
    let data: Vec<Vec<u8>> = (0..3u8).map(|k| (0..lba).map(|i| (i * 31 + 7) as u8 ^ (k + 1)).collect()).collect();
    // Controller 0 writes; the others still read zeros.
    cs[0].write_block(&data[0]);
    assert_eq!(cs[0].read_block(lba), data[0], "controller 0 reads what it wrote");
    for c in &mut cs[1..] {
        assert!(c.read_block(lba).iter().all(|&b| b == 0), "another controller's block is not controller 0's");
    }
    // Each writes its own: each reads back its own.
    for (c, d) in cs.iter_mut().zip(&data) {
        c.write_block(d);
    }
    for (k, (c, d)) in cs.iter_mut().zip(&data).enumerate() {
        assert_eq!(&c.read_block(lba), d, "controller {k}");
    }
    // One poller thread in the process, the pool's.
    let names = thread_names(pid);
    assert_eq!(names.iter().filter(|n| n.starts_with("nvme-pool")).count(), 1, "{names:?}");
    assert!(!names.iter().any(|n| n == "nvme-poller"), "{names:?}");
    drop(cs);

    // Each controller's counters line: its index, its own I/O (1+1+1+1+1 reads and writes on 0, 1+1+1 on the others).
    let t0 = Instant::now();
    let lines = loop {
        let s = std::fs::read_to_string(&out).unwrap_or_default();
        let lines: Vec<serde_json::Value> =
            s.lines().filter(|l| l.contains("\"disconnected\"")).map(|l| serde_json::from_str(l).unwrap()).collect();
        if lines.len() == 3 {
            break lines;
        }
        assert!(t0.elapsed() < HUNG, "counters lines: {s}");
        std::thread::sleep(Duration::from_millis(10));
    };
    let mut seen = [false; 3];
    for l in &lines {
        let k = l["controller"].as_u64().unwrap() as usize;
        seen[k] = true;
        let c = &l["counters"];
        let io = c["io.reads"].as_u64().unwrap() + c["io.writes"].as_u64().unwrap();
        assert_eq!(io, if k == 0 { 4 } else { 3 }, "controller {k}: {c}");
        assert!(c["shadow.polls"].as_u64().unwrap() > 0, "controller {k}: {c}");
    }
    assert_eq!(seen, [true; 3]);
    let _ = server.0.kill();
    let _ = server.0.wait();
}

/// `iopath ctl PATH ARGS..`: its JSON answer.
fn ctl(path: &Path, args: &[&str]) -> serde_json::Value {
    let o = std::process::Command::new(env!("CARGO_BIN_EXE_iopath")).arg("ctl").arg(path).args(args).output().unwrap();
    assert!(o.status.success(), "ctl {args:?}: {}", String::from_utf8_lossy(&o.stderr));
    serde_json::from_slice(&o.stdout)
        .unwrap_or_else(|e| panic!("ctl {args:?}: {e}: {}", String::from_utf8_lossy(&o.stdout)))
}

#[test]
fn a_control_socket_per_controller_injects_on_its_controller_only() {
    let d = TempDir::new("controllers-control");
    let err = d.path("serve.err");
    let child = std::process::Command::new(env!("CARGO_BIN_EXE_iopath"))
        .args(["serve", "nvme,doorbell=bar,backend=ram,size_mb=1", "--controllers", "3", "--pollers", "1"])
        .arg("--socket")
        .arg(d.path("c{}.sock"))
        .arg("--control")
        .arg(d.path("ctl{}.sock"))
        .stdout(std::process::Stdio::null())
        .stderr(std::fs::File::create(&err).unwrap())
        .spawn()
        .unwrap();
    let mut server = Server(child);
    let t0 = Instant::now();
    while std::fs::read_to_string(&err).unwrap_or_default().matches("controller ").count() < 3 {
        if let Some(s) = server.0.try_wait().unwrap() {
            panic!("serve exited ({s}): {}", std::fs::read_to_string(&err).unwrap_or_default());
        }
        assert!(t0.elapsed() < HUNG, "serve never listened: {}", std::fs::read_to_string(&err).unwrap_or_default());
        std::thread::sleep(Duration::from_millis(10));
    }
    let ctls: Vec<_> = (0..3).map(|i| d.path(&format!("ctl{i}.sock"))).collect();
    assert!(ctls.iter().all(|c| c.exists()), "a control socket per controller");
    // Reads of LBA 3 fail with Unrecovered Read Error (SCT 2, SC 0x81), DNR, on controller 2 only.
    let r = ctl(&ctls[2], &["inject", "op=read/lba=3-3/status=2:0x81:dnr"]);
    assert_eq!(r["ok"], true, "{r}");
    for c in &ctls[..2] {
        assert_eq!(ctl(c, &["list"])["rules"].as_array().map(|r| r.len()), Some(0), "another controller's rules");
    }
    let rams: Vec<Ram> = (0..3).map(|_| Ram::new()).collect();
    let socks: Vec<_> = (0..3).map(|i| d.path(&format!("c{i}.sock"))).collect();
    let mut cs: Vec<Client> = socks.iter().zip(&rams).map(|(s, r)| Client::connect(s, r)).collect();
    for (k, c) in cs.iter_mut().enumerate() {
        c.setup();
        let status = c.command(1, 0x02, 1, BASE + RBUF, [3, 0, 0]);
        if k == 2 {
            assert_eq!(status & 0x7ff, 0x281, "controller 2: the injected status ({status:#x})");
            assert_ne!(status & 0x4000, 0, "DNR ({status:#x})");
        } else {
            assert_eq!(status, 0, "controller {k}: no rule of its own");
        }
    }
    // Each controller's own hit counters.
    for (k, c) in ctls.iter().enumerate() {
        let s = ctl(c, &["stats"]);
        let injected = s["stats"]["injected"].as_u64();
        assert_eq!(injected, Some(u64::from(k == 2)), "controller {k}: {s}");
        if k == 2 {
            assert_eq!(s["stats"]["rules"][0]["fired"], 1, "{s}");
        }
    }
    drop(cs);
    let _ = server.0.kill();
    let _ = server.0.wait();
}

#[test]
fn several_controllers_are_refused_without_a_placeholder() {
    let d = TempDir::new("controllers-refused");
    let run = |args: &[&str]| {
        let o = std::process::Command::new(env!("CARGO_BIN_EXE_iopath")).args(args).output().unwrap();
        (o.status.code(), String::from_utf8_lossy(&o.stderr).to_string())
    };
    let sock = d.path("plain.sock");
    let sock = sock.to_str().unwrap();
    let (code, e) = run(&["serve", "nvme", "--controllers", "2", "--socket", sock]);
    assert_eq!(code, Some(2), "{e}");
    assert!(e.contains("{}"), "{e}");
    let pat = d.path("c{}.sock");
    let pat = pat.to_str().unwrap();
    // A control socket per controller: --control needs its {} too.
    let ctl = d.path("ctl.sock");
    let (code, e) = run(&["serve", "nvme", "--controllers", "2", "--socket", pat, "--control", ctl.to_str().unwrap()]);
    assert_eq!(code, Some(2), "{e}");
    assert!(e.contains("--control") && e.contains("{}"), "{e}");
    let (code, e) = run(&["serve", "nvme", "--controllers", "65", "--socket", pat]);
    assert_eq!(code, Some(2), "{e}");
    let (code, e) = run(&["serve", "nvme,doorbell=mmio", "--pollers", "2", "--socket", pat]);
    assert_eq!(code, Some(2), "{e}");
    assert!(e.contains("doorbell=shm or bar"), "{e}");
    assert!(!d.path("c0.sock").exists() && !d.path("c1.sock").exists(), "nothing bound");
}

/// `bench nvme --controllers 1,2 --quick`: a row per N, the guests' I/Os all
/// counted by their own controllers (the routing check), IOPS and CPU per
/// I/O figures present (not judged: speed belongs to the bench).
#[test]
fn bench_nvme_controllers_rows_route_every_guest_to_its_controller() {
    common::kvm();
    let o = std::process::Command::new(env!("CARGO_BIN_EXE_iopath"))
        .args(["bench", "nvme", "--controllers", "1,2", "--quick", "--rw", "randread", "--bs", "4k"])
        .args(["--iodepth", "4", "--quiet", "--json", "-"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{}: {err}", o.status);
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap_or_else(|e| panic!("{e}: {err}"));
    let rows = v["rows"].as_array().unwrap();
    assert_eq!(rows.iter().map(|r| r["controllers"].as_u64().unwrap()).collect::<Vec<_>>(), [1, 2], "{v}");
    for r in rows {
        assert_eq!(r["routing_ok"], true, "{r}");
        assert_eq!(r["target"], "iopath", "{r}");
        assert!(r["ios"].as_u64().unwrap() > 0 && r["iops"].as_f64().unwrap() > 0.0, "{r}");
        assert!(r["total_us_per_io"].as_f64().unwrap() > 0.0, "{r}");
    }
    assert!(v["errors"].as_array().unwrap().is_empty(), "{v}");
}
