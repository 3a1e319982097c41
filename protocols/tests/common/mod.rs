//! Helpers shared by the integration tests that drive iopath's servers as
//! independent or hostile peers would. Each test binary uses a part of it.
#![allow(dead_code)]

use iopath_protocols::serve::{run, Listen, ServeOptions};
use std::fs::File;
use std::os::fd::{AsRawFd, FromRawFd};
use std::os::unix::fs::FileExt;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::{mpsc, OnceLock};
use std::time::{Duration, Instant};
use vfio_user::Client;

/// A memfd of `len` bytes, sealed against shrinking if `sealed` (device
/// processes map either; a client that shrinks an unsealed one ends its session).
pub fn memfd(len: u64, sealed: bool) -> File {
    // SAFETY: memfd_create with a NUL-terminated name; the fd is checked, then owned by the File.
    let fd = unsafe { libc::memfd_create(c"iopath-test".as_ptr(), libc::MFD_ALLOW_SEALING) };
    assert!(fd >= 0);
    // SAFETY: a fresh fd nothing else owns.
    let f = unsafe { File::from_raw_fd(fd) };
    f.set_len(len).unwrap();
    if sealed {
        // SAFETY: F_ADD_SEALS on an fd we own.
        assert_eq!(unsafe { libc::fcntl(f.as_raw_fd(), libc::F_ADD_SEALS, libc::F_SEAL_SHRINK) }, 0);
    }
    f
}

/// Runs `f` on its own thread under a deadline: a client stuck on a reply
/// it misread fails the test instead of hanging it.
pub fn within<T: Send + 'static>(what: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    match rx.recv_timeout(Duration::from_secs(60)) {
        Ok(v) => v,
        Err(mpsc::RecvTimeoutError::Timeout) => panic!("{what}: the client hung (an error reply?)"),
        Err(mpsc::RecvTimeoutError::Disconnected) => panic!("{what}: the client thread panicked"),
    }
}

/// This test process's scratch root, `$TMPDIR/iopath-tests-PID`.
static SCRATCH: OnceLock<PathBuf> = OnceLock::new();

extern "C" fn remove_scratch() {
    if let Some(root) = SCRATCH.get() {
        let _ = std::fs::remove_dir_all(root);
    }
}

/// An empty directory `name` for a test's sockets and files, under a root
/// that is removed when the test process exits (libtest returns from main or
/// calls exit(3) either way, so the atexit hook runs on success and failure).
pub fn scratch(name: &str) -> PathBuf {
    let root = SCRATCH.get_or_init(|| {
        // SAFETY: registers a plain extern "C" fn with no captured state.
        assert_eq!(unsafe { libc::atexit(remove_scratch) }, 0);
        std::env::temp_dir().join(format!("iopath-tests-{}", std::process::id()))
    });
    let dir = root.join(name);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// `iopath serve DEVICE --transport vfio-user --socket PATH`, one client,
/// in a thread of this process.
pub fn serve(device: &str, name: &str) -> (PathBuf, std::thread::JoinHandle<()>) {
    let path = scratch(name).join("vfio-user.sock");
    let o = ServeOptions {
        device: device.parse().unwrap(),
        transport: iopath_protocols::transport("vfio-user").unwrap(),
        listen: Listen::Socket(path.clone()),
        once: true,
        keep_state: false,
        timeouts: Default::default(),
        seccomp: false, // in a thread of the test process
        control: None,
        controllers: 1,
        pollers: None,
    };
    (path, std::thread::spawn(move || run(&o).unwrap()))
}

/// Connects the rust-vmm client once the server listens (VERSION and every
/// region's info are part of `Client::new`).
pub fn connect(path: &Path) -> Client {
    let t0 = Instant::now();
    loop {
        if path.exists() {
            match Client::new(path) {
                Ok(c) => return c,
                Err(vfio_user::Error::Connect(_)) => {}
                Err(e) => panic!("connecting: {e}"),
            }
        }
        assert!(t0.elapsed() < Duration::from_secs(10), "the server never listened on {}", path.display());
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// A raw connection to the server on `path`, once it listens.
pub fn dial(path: &Path) -> UnixStream {
    let t0 = Instant::now();
    loop {
        match UnixStream::connect(path) {
            Ok(s) => return s,
            Err(e) => assert!(t0.elapsed() < Duration::from_secs(10), "{}: {e}", path.display()),
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Enables iopath's NVMe controller through `c` with 16-entry admin queues
/// at guest addresses `asq` and `acq` (IOSQES 6, IOCQES 4).
pub fn nvme_enable(c: &mut Client, asq: u64, acq: u64) {
    c.region_write(0, 0x24, &(15u32 << 16 | 15).to_le_bytes()).unwrap();
    c.region_write(0, 0x28, &asq.to_le_bytes()).unwrap();
    c.region_write(0, 0x30, &acq.to_le_bytes()).unwrap();
    c.region_write(0, 0x14, &0x0046_0001u32.to_le_bytes()).unwrap();
}

/// Identify Controller (command id 0x42) into guest address `data`: the SQE
/// at offset `sq` of `ram` (the admin SQ's first slot), SQ 0's doorbell
/// rung through `c`, then the CQE polled at offset `cq` of `ram` until its
/// phase tag is 1, for up to `bound`. Returns the CQE.
pub fn nvme_identify(c: &mut Client, ram: &File, sq: u64, cq: u64, data: u64, bound: Duration) -> [u8; 16] {
    let mut sqe = [0u8; 64];
    sqe[0] = 0x06;
    sqe[2..4].copy_from_slice(&0x42u16.to_le_bytes());
    sqe[24..32].copy_from_slice(&data.to_le_bytes());
    sqe[40] = 1; // CNS 1: controller
    ram.write_all_at(&sqe, sq).unwrap();
    c.region_write(0, 0x1000, &1u32.to_le_bytes()).unwrap();
    let mut cqe = [0u8; 16];
    let t0 = Instant::now();
    loop {
        ram.read_exact_at(&mut cqe, cq).unwrap();
        if cqe[14] & 1 == 1 {
            break; // phase tag 1: posted
        }
        assert!(t0.elapsed() < bound, "no completion in {bound:?}");
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(u16::from_le_bytes([cqe[12], cqe[13]]), 0x42, "command id");
    cqe
}
