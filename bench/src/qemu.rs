//! Runs the same guest image under QEMU (+KVM) with QEMU's own devices.

use iopath_devices::block::StorageKind;
use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

pub const BINARY: &str = "qemu-system-x86_64";

/// Finds qemu-system-x86_64 on PATH (or $IOPATH_QEMU), or explains how to get it.
pub fn find() -> anyhow::Result<PathBuf> {
    if let Ok(p) = std::env::var("IOPATH_QEMU") {
        return Ok(PathBuf::from(p));
    }
    for dir in std::env::var("PATH").unwrap_or_default().split(':') {
        let p = Path::new(dir).join(BINARY);
        if p.is_file() {
            return Ok(p);
        }
    }
    anyhow::bail!(
        "{BINARY} not found: install QEMU (Debian/Ubuntu: `apt-get install -y qemu-system-x86`, \
         Fedora: `dnf install qemu-system-x86`) or set IOPATH_QEMU to its path"
    )
}

pub struct QemuRun {
    pub status: Option<i32>,
    pub lines: Vec<String>,
    pub stderr: String,
}

/// The command line: the one the project documents, plus `-append`.
pub fn args(image: &Path, cmdline: &str, devices: &[&str]) -> Vec<String> {
    args_with(image, cmdline, 64, &[], devices)
}

/// The documented command line with `mem_mb` of RAM, `extra` arguments
/// (e.g. a `-drive`) and `devices`.
pub fn args_with(image: &Path, cmdline: &str, mem_mb: u64, extra: &[String], devices: &[&str]) -> Vec<String> {
    let mut a: Vec<String> = [
        "-accel",
        "kvm",
        "-cpu",
        "host,-arch-capabilities",
        "-display",
        "none",
        "-serial",
        "stdio",
        "-monitor",
        "none",
        "-no-reboot",
        "-device",
        "isa-debug-exit,iobase=0xf4,iosize=1",
        // Threads named by role (`CPU 0/KVM`, `worker`, `call_rcu`); without
        // it every thread has the main loop's name (see pin::QEMU_DEVICE_THREADS).
        "-name",
        "iopath,debug-threads=on",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    a.extend(["-m".into(), format!("{mem_mb}M")]);
    a.extend(extra.iter().cloned());
    for d in devices {
        a.push("-device".into());
        a.push(d.to_string());
    }
    a.extend(["-kernel".into(), image.display().to_string(), "-append".into(), cmdline.to_string()]);
    a
}

pub fn run(
    qemu: &Path,
    image: &Path,
    cmdline: &str,
    devices: &[&str],
    timeout: Duration,
    on_line: impl FnMut(&str),
) -> anyhow::Result<QemuRun> {
    run_args(qemu, args(image, cmdline, devices), None, timeout, on_line)
}

/// QEMU's `-device nvme` on the block device `drive` (a `-drive` value
/// with `id=nvm0`), for nvmeperf.
pub fn nvme_args(image: &Path, cmdline: &str, mem_mb: u64, drive: &str, lba: u32) -> Vec<String> {
    let dev = format!("nvme,drive=nvm0,serial=iopath0,logical_block_size={lba}");
    args_with(image, cmdline, mem_mb, &["-drive".into(), drive.to_string()], &[&dev])
}

/// What QEMU's nvme stands on: the same kind of backend iopath's
/// controller runs on, so that the two are compared on equal terms.
#[derive(Debug)]
pub enum QemuBacking {
    /// `null-co` of the namespace's size: no data moved, as iopath's null.
    Null { size: u64 },
    /// A file in /dev/shm of the namespace's size (tmpfs: its pages are
    /// RAM), as iopath's ram; made for the bench, removed after it.
    Ram(RamImage),
    /// iopath's own file, opened as iopath opens it: raw, O_DIRECT.
    File(PathBuf),
}

/// A sparse file in a tmpfs, removed when dropped. Reads of a hole are
/// zeros without a page behind them, as reads of iopath's untouched ram
/// namespace are.
#[derive(Debug)]
pub struct RamImage {
    pub path: PathBuf,
    pub size: u64,
}

/// Where RAM images go.
pub const SHM_DIR: &str = "/dev/shm";

impl RamImage {
    /// A new file of `size` bytes in `dir`, named after this process.
    pub fn create(dir: &Path, size: u64) -> anyhow::Result<RamImage> {
        static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let path = dir.join(format!("iopath-qemu-nvme-{}-{n}.img", std::process::id()));
        let f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&path)
            .map_err(|e| anyhow::anyhow!("cannot create QEMU's RAM image {}: {e}", path.display()))?;
        let img = RamImage { path, size };
        f.set_len(size).map_err(|e| anyhow::anyhow!("cannot size {} to {size} bytes: {e}", img.path.display()))?;
        Ok(img)
    }
}

impl RamImage {
    /// Drops every page the last run wrote (the file is a hole again), so
    /// that each run reads untouched memory, as a fresh ram namespace of
    /// iopath's does, not the pages an earlier write job left in tmpfs.
    pub fn clear(&self) -> anyhow::Result<()> {
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(&self.path)
            .map_err(|e| anyhow::anyhow!("cannot open QEMU's RAM image {}: {e}", self.path.display()))?;
        f.set_len(0)
            .and_then(|_| f.set_len(self.size))
            .map_err(|e| anyhow::anyhow!("cannot clear {}: {e}", self.path.display()))
    }
}

impl Drop for RamImage {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// QEMU's option syntax: a comma inside a value is written twice.
fn escaped(p: &Path) -> String {
    p.display().to_string().replace(',', ",,")
}

impl QemuBacking {
    /// The backing for iopath's `backend` with a namespace of `size` bytes
    /// (a ram one makes its file in `shm_dir`).
    pub fn for_backend(backend: &StorageKind, size: u64, shm_dir: &Path) -> anyhow::Result<QemuBacking> {
        Ok(match backend {
            StorageKind::Null => QemuBacking::Null { size },
            StorageKind::Ram => QemuBacking::Ram(RamImage::create(shm_dir, size)?),
            StorageKind::File(p) => QemuBacking::File(p.clone()),
        })
    }

    /// The `-drive` value (id `nvm0`) with `aio` (unused for null-co). A
    /// file is raw with O_DIRECT (`cache=none`); a tmpfs file goes through
    /// the page cache, which is its memory (`cache=writeback`).
    pub fn drive(&self, aio: &str) -> String {
        match self {
            QemuBacking::Null { size } => format!("driver=null-co,size={size},if=none,id=nvm0"),
            QemuBacking::Ram(img) => {
                format!("file={},format=raw,if=none,id=nvm0,aio={aio},cache=writeback", escaped(&img.path))
            }
            QemuBacking::File(p) => format!("file={},format=raw,if=none,id=nvm0,aio={aio},cache=none", escaped(p)),
        }
    }

    /// The `aio` to try first, and the one for a QEMU without io_uring.
    fn aio(&self) -> Option<(&'static str, &'static str)> {
        match self {
            QemuBacking::Null { .. } => None,
            QemuBacking::Ram(_) => Some(("io_uring", "threads")),
            QemuBacking::File(_) => Some(("io_uring", "native")),
        }
    }

    /// The kind, short, for ratio lines: "null-co", "ram(/dev/shm)", "file".
    pub fn short(&self) -> String {
        match self {
            QemuBacking::Null { .. } => "null-co".into(),
            QemuBacking::Ram(_) => format!("ram({SHM_DIR})"),
            QemuBacking::File(_) => "file".into(),
        }
    }

    /// What the drive was, for the run's row.
    fn describe(&self, aio: &str) -> String {
        match self {
            QemuBacking::Null { size } => format!("null-co ({} MiB)", size >> 20),
            QemuBacking::Ram(img) => {
                format!("ram: {} ({} MiB, tmpfs, raw, aio={aio}, cache=writeback)", img.path.display(), img.size >> 20)
            }
            QemuBacking::File(p) => format!("file:{} (raw, aio={aio}, cache=none)", p.display()),
        }
    }
}

/// QEMU refused `aio=io_uring` (built without it, or the kernel's refused).
fn lacks_io_uring(r: &QemuRun) -> bool {
    !r.lines.iter().any(|l| l.starts_with('@')) && r.stderr.contains("io_uring")
}

/// Runs nvmeperf (`cmdline`) on QEMU's nvme on `backing`; through io_uring,
/// or the fallback `aio` if this QEMU cannot; each guest line goes to
/// `on_line` as it comes. Returns the run and what QEMU's drive was, for
/// its row.
#[allow(clippy::too_many_arguments)]
pub fn run_nvme(
    qemu: &Path,
    image: &Path,
    cmdline: &str,
    mem_mb: u64,
    backing: &QemuBacking,
    lba: u32,
    timeout: Duration,
    on_line: &mut dyn FnMut(&str),
) -> anyhow::Result<(QemuRun, String)> {
    let dev = format!("nvme,drive=nvm0,serial=iopath0,logical_block_size={lba}");
    run_drive(qemu, image, cmdline, mem_mb, backing, &[], &dev, timeout, on_line)
}

/// Runs the guest (`cmdline`) with QEMU's `device` (which names `drive=nvm0`)
/// on `backing`, with `extra` arguments: through io_uring, or the fallback
/// `aio` if this QEMU cannot. A RAM image is cleared before each run. Each
/// line of the guest's goes to `on_line` as it comes. Returns the run and
/// what QEMU's drive was, for its row.
#[allow(clippy::too_many_arguments)]
pub fn run_drive(
    qemu: &Path,
    image: &Path,
    cmdline: &str,
    mem_mb: u64,
    backing: &QemuBacking,
    extra: &[String],
    device: &str,
    timeout: Duration,
    on_line: &mut dyn FnMut(&str),
) -> anyhow::Result<(QemuRun, String)> {
    let mut attempt = |aio: &str| {
        if let QemuBacking::Ram(img) = backing {
            img.clear()?;
        }
        let mut x = extra.to_vec();
        x.extend(["-drive".into(), backing.drive(aio)]);
        let a = args_with(image, cmdline, mem_mb, &x, &[device]);
        run_args(qemu, a, None, timeout, &mut *on_line)
    };
    let Some((first, fallback)) = backing.aio() else { return Ok((attempt("")?, backing.describe(""))) };
    let r = attempt(first)?;
    if !lacks_io_uring(&r) {
        return Ok((r, backing.describe(first)));
    }
    let why = r.stderr.lines().find(|l| l.contains("io_uring")).unwrap_or("").trim().to_string();
    let r = attempt(fallback)?;
    Ok((r, format!("{} (no io_uring in this QEMU: {why})", backing.describe(fallback))))
}

/// qboot, QEMU's minimal firmware: a `-kernel` guest boots in about 0.3 s
/// instead of SeaBIOS's 5 s on this host (the firmware runs before the
/// guest's timed window, so figures do not change; runs get shorter).
pub const QBOOT: &str = "/usr/share/qemu/qboot.rom";

/// `-bios` qboot where this QEMU has it installed, else nothing (SeaBIOS).
pub fn fast_firmware_args() -> Vec<String> {
    if Path::new(QBOOT).is_file() {
        vec!["-bios".into(), QBOOT.into()]
    } else {
        Vec::new()
    }
}

/// The arguments that give QEMU's guest RAM as a shared memfd, which
/// `x-pci-proxy-dev` hands to the device process (SYNC_SYSMEM).
pub fn memfd_ram_args() -> Vec<String> {
    ["-object", "memory-backend-memfd,id=ram0,size=64M,share=on", "-machine", "pc,memory-backend=ram0"]
        .iter()
        .map(|s| s.to_string())
        .collect()
}

/// Most bytes of QEMU's console (the guest's output) kept; the rest is read
/// and dropped, so that a guest that floods it cannot exhaust host memory.
pub const MAX_OUTPUT: u64 = 64 << 20;
/// Longest line kept whole; a longer one is cut into lines this long.
pub const MAX_LINE: u64 = 64 << 10;
/// What a kept line costs beyond its bytes, counted against `MAX_OUTPUT`.
const LINE_OVERHEAD: u64 = 64;
/// Most bytes of QEMU's stderr kept.
pub const MAX_STDERR: u64 = 1 << 20;

/// Sends `r`'s lines (without "\n" or "\r\n") to `tx`, within `MAX_LINE`
/// and `MAX_OUTPUT`, reading to the end.
fn read_lines(r: impl Read, tx: std::sync::mpsc::Sender<String>) {
    let mut r = BufReader::new(r);
    let (mut kept, mut buf) = (0u64, Vec::new());
    loop {
        buf.clear();
        match (&mut r).take(MAX_LINE).read_until(b'\n', &mut buf) {
            Ok(0) | Err(_) => return,
            // Each kept line also costs a String and a channel node: charge
            // it, so a flood of empty lines stays within the bound too.
            Ok(n) => kept = kept.saturating_add(n as u64 + LINE_OVERHEAD),
        }
        if kept > MAX_OUTPUT {
            continue;
        }
        let l = String::from_utf8_lossy(&buf);
        if tx.send(l.trim_end_matches('\n').trim_end_matches('\r').to_string()).is_err() {
            return;
        }
    }
}

/// `r` to its end, keeping the first `max` bytes.
fn read_bounded(mut r: impl Read, max: u64) -> String {
    let mut kept = Vec::new();
    let _ = (&mut r).take(max).read_to_end(&mut kept);
    let _ = std::io::copy(&mut r, &mut std::io::sink());
    String::from_utf8_lossy(&kept).into_owned()
}

/// Runs QEMU with `args`; `fd3`, if given, becomes the child's fd 3.
/// Killed and reaped at once on Ctrl-C (`crate::interrupt`), which is then the error.
pub fn run_args(
    qemu: &Path,
    args: Vec<String>,
    fd3: Option<std::os::fd::OwnedFd>,
    timeout: Duration,
    mut on_line: impl FnMut(&str),
) -> anyhow::Result<QemuRun> {
    let mut cmd = Command::new(qemu);
    if let Some(fd) = &fd3 {
        iopath_protocols::process::inherit_as_fd3(&mut cmd, fd);
    }
    // QEMU dies with this thread, which waits for it below: a bench that
    // ends at once (a panic's `_exit`, SIGKILL) leaves no QEMU running.
    // SAFETY: between fork and exec only async-signal-safe calls (prctl, getppid).
    unsafe {
        use std::os::unix::process::CommandExt;
        let parent = libc::getpid();
        cmd.pre_exec(move || {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 || libc::getppid() != parent {
                return Err(std::io::Error::other("the bench is gone"));
            }
            Ok(())
        });
    }
    let mut child = cmd
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| anyhow::anyhow!("cannot start {}: {e}", qemu.display()))?;
    drop(fd3);
    let stdout = child.stdout.take().unwrap();
    let stderr = child.stderr.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel::<String>();
    let reader = std::thread::spawn(move || read_lines(stdout, tx));
    let err_reader = std::thread::spawn(move || read_bounded(stderr, MAX_STDERR));
    let t0 = Instant::now();
    let mut lines = Vec::new();
    let status = loop {
        // A guest that keeps printing must not keep the deadline from being looked at.
        while let Ok(l) = rx.recv_timeout(Duration::from_millis(20)) {
            on_line(&l);
            lines.push(l);
            if t0.elapsed() > timeout {
                break;
            }
        }
        if let Some(s) = child.try_wait()? {
            break s.code();
        }
        if crate::interrupt::interrupted() {
            let _ = child.kill();
            let _ = child.wait();
            let _ = reader.join();
            let _ = err_reader.join();
            return Err(crate::interrupt::Interrupted.into());
        }
        if t0.elapsed() > timeout {
            let _ = child.kill();
            let _ = child.wait();
            anyhow::bail!(
                "QEMU did not finish within {timeout:?}; last output: {:?}",
                lines.iter().rev().take(3).collect::<Vec<_>>()
            );
        }
    };
    let _ = reader.join();
    for l in rx.try_iter() {
        on_line(&l);
        lines.push(l);
    }
    let stderr = err_reader.join().unwrap_or_default();
    Ok(QemuRun { status, lines, stderr })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn qemu_stands_on_the_backend_kind_iopath_runs_on() {
        let f =
            QemuBacking::for_backend(&StorageKind::File("/var/tmp/a,b.img".into()), 1 << 20, Path::new("/x")).unwrap();
        assert_eq!(f.drive("io_uring"), "file=/var/tmp/a,,b.img,format=raw,if=none,id=nvm0,aio=io_uring,cache=none");
        assert!(f.drive("native").contains(",aio=native,cache=none"));
        let n = QemuBacking::for_backend(&StorageKind::Null, 64 << 20, Path::new("/x")).unwrap();
        assert_eq!(n.drive(""), "driver=null-co,size=67108864,if=none,id=nvm0");
        assert_eq!((n.short(), f.short()), ("null-co".to_string(), "file".to_string()));
        // ram: a sparse file of the namespace's size, gone with the backing.
        let dir = std::env::temp_dir();
        let r = QemuBacking::for_backend(&StorageKind::Ram, 8 << 20, &dir).unwrap();
        let QemuBacking::Ram(img) = &r else { panic!("{r:?}") };
        let path = img.path.clone();
        assert_eq!(std::fs::metadata(&path).unwrap().len(), 8 << 20);
        assert!(r.drive("io_uring").starts_with(&format!("file={},format=raw,", path.display())), "{}", r.drive("x"));
        assert!(r.drive("io_uring").ends_with(",aio=io_uring,cache=writeback"));
        assert_eq!(r.short(), "ram(/dev/shm)");
        drop(r);
        assert!(!path.exists(), "the RAM image outlived the bench");
        assert!(RamImage::create(Path::new("/nonexistent/dir"), 1).is_err());
        let a = nvme_args(Path::new("/img"), "workload=nvme", 256, &f.drive("io_uring"), 512);
        let i = a.iter().position(|x| x == "-drive").expect("a -drive");
        assert!(a[i + 1].starts_with("file=/var/tmp/a,,b.img,format=raw"));
        assert!(a.iter().any(|x| x == "nvme,drive=nvm0,serial=iopath0,logical_block_size=512"));
        // Threads named by role, so that --pin tells QEMU's vCPU from its main loop.
        let i = a.iter().position(|x| x == "-name").expect("a -name");
        assert_eq!(a[i + 1], "iopath,debug-threads=on");
    }

    #[test]
    fn each_run_on_a_ram_image_starts_from_untouched_memory() {
        let _one = crate::interrupt::TEST_LOCK.lock().unwrap_or_else(|p| p.into_inner());
        use std::io::Write;
        let dir = std::env::temp_dir();
        let r = QemuBacking::for_backend(&StorageKind::Ram, 1 << 20, &dir).unwrap();
        let QemuBacking::Ram(img) = &r else { panic!("{r:?}") };
        // What an earlier write job left: pages of data in the file.
        let mut f = std::fs::OpenOptions::new().write(true).open(&img.path).unwrap();
        f.write_all(&[0xa5; 65536]).unwrap();
        drop(f);
        let blocks = |p: &Path| std::os::unix::fs::MetadataExt::blocks(&std::fs::metadata(p).unwrap());
        assert!(blocks(&img.path) > 0);
        // A "QEMU" that does nothing: the run itself is not the point, the image before it is.
        let t = Duration::from_secs(10);
        run_drive(Path::new("/bin/true"), Path::new("/img"), "x", 64, &r, &[], "dev", t, &mut |_| {}).unwrap();
        assert_eq!(blocks(&img.path), 0, "the next run would read the last run's pages");
        assert_eq!(std::fs::metadata(&img.path).unwrap().len(), 1 << 20, "the image keeps its size");
    }

    #[test]
    fn a_flooded_console_is_kept_within_its_bounds() {
        let _one = crate::interrupt::TEST_LOCK.lock().unwrap_or_else(|p| p.into_inner());
        // A "QEMU" (sh) that writes 100 MiB without a newline, then a line, and 2 MiB to stderr.
        let script = "head -c 104857600 /dev/zero | tr '\\0' x; echo; echo '@done rc=0'; head -c 2097152 /dev/zero >&2";
        let args = vec!["-c".to_string(), script.to_string()];
        let r = run_args(Path::new("/bin/sh"), args, None, Duration::from_secs(60), |_| {}).unwrap();
        let kept: u64 = r.lines.iter().map(|l| l.len() as u64 + 1).sum();
        assert!(kept <= MAX_OUTPUT + MAX_LINE, "{kept} bytes kept");
        assert!(r.lines.iter().all(|l| l.len() as u64 <= MAX_LINE));
        assert_eq!(r.stderr.len() as u64, MAX_STDERR);
        assert_eq!(r.status, Some(0));
        // Lines under the bounds come through whole.
        let args = vec!["-c".to_string(), "printf 'a\\r\\nb\\nc'".to_string()];
        let r = run_args(Path::new("/bin/sh"), args, None, Duration::from_secs(10), |_| {}).unwrap();
        assert_eq!(r.lines, ["a", "b", "c"]);
    }

    #[test]
    fn a_flood_of_empty_lines_is_bounded_by_count_too() {
        let _one = crate::interrupt::TEST_LOCK.lock().unwrap_or_else(|p| p.into_inner());
        // 8 M empty lines: 8 MiB of bytes, but each kept line costs its String.
        let args = vec!["-c".to_string(), "yes '' | head -n 8388608".to_string()];
        let r = run_args(Path::new("/bin/sh"), args, None, Duration::from_secs(120), |_| {}).unwrap();
        assert!(r.lines.len() as u64 <= MAX_OUTPUT / (LINE_OVERHEAD + 1) + 1, "{} lines kept", r.lines.len());
    }

    #[test]
    fn a_guest_that_keeps_printing_still_meets_the_deadline() {
        let _one = crate::interrupt::TEST_LOCK.lock().unwrap_or_else(|p| p.into_inner());
        // A line every 5 ms, forever: the 1 s deadline must end it (the bound here is liveness only).
        let args = vec!["-c".to_string(), "while :; do echo x; sleep 0.005; done".to_string()];
        let t0 = Instant::now();
        let r = run_args(Path::new("/bin/sh"), args, None, Duration::from_secs(1), |_| {});
        assert!(r.is_err(), "a run past its deadline is an error");
        assert!(t0.elapsed() < Duration::from_secs(60), "stopped after {:?}", t0.elapsed());
    }

    #[test]
    fn only_a_refused_io_uring_falls_back_to_native() {
        let run = |lines: &[&str], stderr: &str| QemuRun {
            status: Some(1),
            lines: lines.iter().map(|s| s.to_string()).collect(),
            stderr: stderr.into(),
        };
        assert!(lacks_io_uring(&run(
            &[],
            "qemu-system-x86_64: -drive ...: aio=io_uring was specified, but is not supported in this build."
        )));
        assert!(!lacks_io_uring(&run(&[], "qemu: could not open disk image: No such file")));
        assert!(!lacks_io_uring(&run(&["@nvme ios=1"], "warning: io_uring something")));
    }
}
