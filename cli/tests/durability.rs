//! The queue oracle's durability case: iopath's controller on a file
//! namespace in an `iopath serve` device process, reached through iopath's
//! vfio-user proxy, with up to 255 writes in flight; the device process is
//! killed with SIGKILL now and then and a new one started on the same file.
//! The oracle checks that no write whose completion was reaped is lost or
//! overwritten by an older command run again, that no command completes
//! twice, and everything else it checks on every schedule. Every doorbell
//! mode that serves a file namespace from a device process.

mod common;
use common::TempDir;

use iopath_devices::nvme::oracle::{Driver, LocalPort, OpRecord, Port, RestartError, Rng, Shape, RAM};
use iopath_devices::{Counter, SharedDevice};
use iopath_protocols::function::{map_guest_memory, SharedRegion};
use iopath_protocols::vfio_user::VfioUserProxy;
use std::fs::File;
use std::os::fd::{AsRawFd, FromRawFd};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use vm_memory::{FileOffset, GuestAddress, GuestMemoryMmap};

/// A device process on `image`, and the proxy of it hosted on the oracle's RAM.
struct Device {
    child: Child,
    port: LocalPort,
}

/// The port: the driver's RAM (a memfd every device process maps) and the
/// device process of the moment.
struct CrashPort {
    spec: String,
    dir: PathBuf,
    file: File,
    ram: GuestMemoryMmap,
    now: Mutex<Option<Device>>,
    starts: Mutex<u32>,
}

fn memfd(len: u64) -> File {
    // SAFETY: memfd_create with a NUL-terminated name; the fd is checked, then owned by the File.
    let fd = unsafe { libc::memfd_create(c"iopath-durability".as_ptr(), libc::MFD_ALLOW_SEALING) };
    assert!(fd >= 0);
    // SAFETY: a fresh fd nothing else owns.
    let f = unsafe { File::from_raw_fd(fd) };
    f.set_len(len).unwrap();
    // SAFETY: F_ADD_SEALS on an fd we own.
    assert_eq!(unsafe { libc::fcntl(f.as_raw_fd(), libc::F_ADD_SEALS, libc::F_SEAL_SHRINK) }, 0);
    f
}

impl CrashPort {
    fn new(spec: String, dir: PathBuf) -> CrashPort {
        let file = memfd(RAM);
        let ram = GuestMemoryMmap::from_ranges_with_files([(
            GuestAddress(0),
            RAM as usize,
            Some(FileOffset::new(file.try_clone().unwrap(), 0)),
        )])
        .unwrap();
        let p = CrashPort { spec, dir, file, ram, now: Mutex::new(None), starts: Mutex::new(0) };
        *p.now.lock().unwrap() = Some(p.start().unwrap());
        p
    }

    /// `iopath serve SPEC --transport vfio-user --socket DIR/N.sock`, connected.
    fn start(&self) -> Result<Device, String> {
        let n = {
            let mut s = self.starts.lock().unwrap();
            *s += 1;
            *s
        };
        let sock = self.dir.join(format!("{n}.sock"));
        let child = Command::new(env!("CARGO_BIN_EXE_iopath"))
            .args(["serve", &self.spec, "--transport", "vfio-user", "--socket"])
            .arg(&sock)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| format!("iopath serve: {e}"))?;
        let t0 = Instant::now();
        let stream = loop {
            match std::os::unix::net::UnixStream::connect(&sock) {
                Ok(s) => break s,
                Err(_) if t0.elapsed() < Duration::from_secs(10) => std::thread::sleep(Duration::from_millis(5)),
                Err(e) => return Err(format!("{}: {e}", sock.display())),
            }
        };
        let proxy = VfioUserProxy::connect(stream, None).map_err(|e| format!("the proxy: {e}"))?;
        let dev: SharedDevice = Arc::new(Mutex::new(proxy));
        let owner = iopath_protocols::sigbus::Owner::new(None::<&File>).unwrap();
        let region = SharedRegion { gpa: 0, size: RAM, offset: 0, file: self.file.try_clone().unwrap() };
        let (mem, _) = map_guest_memory(vec![region], &owner).map_err(|e| e.to_string())?;
        let port = LocalPort::hosting(dev, self.ram.clone(), mem, false).map_err(|e| e.to_string())?;
        Ok(Device { child, port })
    }

    fn with<T>(&self, f: impl FnOnce(&LocalPort) -> T) -> T {
        f(&self.now.lock().unwrap().as_ref().expect("a device").port)
    }
}

impl Drop for Device {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Port for CrashPort {
    fn read32(&self, off: u64) -> u32 {
        self.with(|p| p.read32(off))
    }
    fn write(&self, off: u64, data: &[u8]) {
        self.with(|p| p.write(off, data))
    }
    fn doorbell(&self, off: u64, value: u32) {
        self.with(|p| p.doorbell(off, value))
    }
    fn ram(&self) -> &GuestMemoryMmap {
        &self.ram
    }
    fn counters(&self) -> Vec<Counter> {
        Vec::new() // the device's are in another process
    }
    fn take_ops(&self) -> Option<Vec<OpRecord>> {
        None
    }
    fn restart(&self) -> Option<Result<(), RestartError>> {
        let mut now = self.now.lock().unwrap();
        if let Some(mut d) = now.take() {
            // SIGKILL, and reaped: the kernel ends its io_uring's operations before.
            let _ = d.child.kill();
            let _ = d.child.wait();
        }
        Some(self.start().map(|d| *now = Some(d)).map_err(RestartError::from))
    }
}

fn run(mode: &str, seed: u64, dir: &Path) {
    let image = dir.join(format!("ns-{mode}-{seed}.img"));
    std::fs::write(&image, vec![0u8; 2 << 20]).unwrap();
    let spec = format!("nvme,doorbell={mode},backend=file:{},size_mb=2", image.display());
    let port = CrashPort::new(spec.clone(), dir.to_path_buf());
    let mut rng = Rng::new(seed);
    let mut shape = Shape::durability(&mut rng, 500);
    // Out of process, ioeventfd and adaptive serve only drivers with shadow doorbells.
    shape.shadow |= matches!(mode, "ioeventfd" | "adaptive");
    match Driver::new(&port, rng, shape).run() {
        Ok(r) => {
            eprintln!(
                "doorbell={mode} seed {seed}: {} submitted, {} completed, {} dropped, {} kills",
                r.submitted, r.completed, r.dropped, r.crashes
            );
            assert!(r.crashes > 0, "{spec} seed {seed}: no kill in {r:?}");
        }
        Err(e) => panic!("{spec} seed {seed}: {e}"),
    }
}

#[test]
fn killed_device_processes_lose_no_acknowledged_write_and_run_no_command_twice() {
    let dir = TempDir::new("durability");
    for mode in ["auto", "bar", "shm", "adaptive", "ioeventfd", "mmio", "bar-adaptive"] {
        for seed in 0..2 {
            run(mode, 40 + seed, &dir.0);
        }
    }
}
