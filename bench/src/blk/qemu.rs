//! `bench blk`'s QEMU targets: QEMU 7.2's own virtio-blk-pci, and its
//! vhost-user-blk-pci on iopath's backend (`iopath serve virtio-blk,...
//! --transport vhost-user --socket PATH`), both with the guest image the
//! other targets run. QEMU's exits are not ours to count; each row is
//! checked by a device count (`check.rs`): QMP `query-blockstats` when the
//! guest's window ended, and the backend's counters line after QEMU left.

use super::check::{self, Guest};
use super::run::{guest_checks, to_run, Ctx, WINDOW_END};
use super::{BlkRun, LISTEN_WAIT};
use crate::qemu::QemuBacking;
use iopath_devices::virtio::pci::NotifyMode;
use iopath_devices::DeviceConfig;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Most bytes of the backend's log read for its counters line.
const MAX_LOG: u64 = 16 << 20;

/// How long QMP and the backend's counters line may take.
const PEER_WAIT: Duration = Duration::from_secs(5);

impl Ctx<'_> {
    fn qemu(&self) -> anyhow::Result<&(PathBuf, QemuBacking)> {
        self.qemu.as_ref().map_err(|e| anyhow::anyhow!("no QEMU: {e:#}"))
    }

    /// QEMU's own virtio-blk-pci (modern only) on the same backend kind.
    pub(super) fn qemu_virtio(&self, t: &str, ji: usize, round: u32) -> anyhow::Result<BlkRun> {
        let (q, backing) = self.qemu()?;
        let dir = TempDir::new()?;
        let qmp_path = dir.0.join("qmp.sock");
        let dev = "virtio-blk-pci,drive=nvm0,disable-legacy=on";
        let timeout = Duration::from_secs(self.o.timeout_s);
        let mut extra = crate::qemu::fast_firmware_args();
        extra.extend(["-qmp".into(), format!("unix:{},server=on,wait=off", escaped(&qmp_path))]);
        // QMP is reached at the guest's first line (before its window, so the
        // handshake does not load QEMU's main loop in it) and asked for the
        // drive's operations when the window ends: every I/O is complete
        // then, and the guest is still printing (isa-debug-exit ends QEMU
        // at once, -no-shutdown or not).
        let mut qmp: Option<anyhow::Result<crate::qmp::Qmp>> = None;
        let mut stats: Option<anyhow::Result<(u64, u64)>> = None;
        let mut on_line = |l: &str| {
            let qmp = qmp.get_or_insert_with(|| crate::qmp::Qmp::connect(&qmp_path, PEER_WAIT));
            if l == WINDOW_END && stats.is_none() {
                stats = Some(match qmp {
                    Ok(m) => m.blockstats("nvm0"),
                    Err(e) => Err(anyhow::anyhow!("{e:#}")),
                });
            }
        };
        let (qr, drive) = crate::qemu::run_drive(
            q,
            &self.image,
            &self.cmdline(ji),
            self.o.mem_mb,
            backing,
            &extra,
            dev,
            timeout,
            &mut on_line,
        )?;
        let mut r = to_run(t, &self.jobs[ji], ji, round, &qr.lines, self.tsc_khz)
            .map_err(|e| anyhow::anyhow!("{e}; stderr: {}", qr.stderr.trim()))?;
        let g = Guest { ios: r.ios, notifies: r.guest_notifies.unwrap_or(0) };
        let stats = stats.unwrap_or_else(|| Err(anyhow::anyhow!("the guest printed no {WINDOW_END:?}")));
        let why = stats.as_ref().err().map(|e| format!("{e:#}"));
        let v = check::qemu_virtio(stats.as_ref().map(|s| *s).map_err(|_| why.as_deref().unwrap_or_default()), g);
        r.routing = format!("QEMU virtio-blk-pci on {drive}; exit status {:?}; {}", qr.status, v.text);
        r.routing_ok = qr.status == Some(1) && v.ok;
        guest_checks(&mut r);
        Ok(r)
    }

    /// QEMU's vhost-user-blk-pci on iopath's backend (`iopath serve
    /// virtio-blk,... --transport vhost-user --socket PATH`).
    pub(super) fn qemu_vhost_user(&self, t: &str, ji: usize, round: u32) -> anyhow::Result<BlkRun> {
        let (q, _) = self.qemu()?;
        let dir = TempDir::new()?;
        let sock = dir.0.join("vhost-user.sock");
        let config = DeviceConfig::VirtioBlk(self.blk_config(NotifyMode::Ioeventfd)).to_string();
        let log = dir.0.join("serve.log");
        let out = std::fs::File::create(&log).map_err(|e| anyhow::anyhow!("cannot create {}: {e}", log.display()))?;
        let mut server = Server(
            Command::new(&self.progs.iopath)
                .args(["serve", &config, "--transport", "vhost-user", "--socket"])
                .arg(&sock)
                .stdin(Stdio::null())
                .stdout(out.try_clone()?)
                .stderr(out)
                .spawn()
                .map_err(|e| anyhow::anyhow!("cannot start {}: {e}", self.progs.iopath.display()))?,
        );
        // Listening, not only bound: a connect before listen() is refused.
        let t0 = Instant::now();
        while !listening(&sock) {
            if let Some(st) = server.0.try_wait()? {
                anyhow::bail!("iopath serve {config} --transport vhost-user exited ({st}): {}", tail(&log));
            }
            anyhow::ensure!(t0.elapsed() < LISTEN_WAIT, "iopath serve did not listen within {LISTEN_WAIT:?}");
            std::thread::sleep(Duration::from_millis(20));
        }
        let mem = self.o.mem_mb;
        let mut extra = crate::qemu::fast_firmware_args();
        extra.extend([
            "-object".to_string(),
            format!("memory-backend-memfd,id=mem,size={mem}M,share=on"),
            "-numa".into(),
            "node,memdev=mem".into(),
            "-chardev".into(),
            format!("socket,id=c0,path={}", escaped(&sock)),
        ]);
        let dev = "vhost-user-blk-pci,chardev=c0,disable-legacy=on";
        let args = crate::qemu::args_with(&self.image, &self.cmdline(ji), mem, &extra, &[dev]);
        let qr = crate::qemu::run_args(q, args, None, Duration::from_secs(self.o.timeout_s), |_| {})?;
        // The backend prints its counters once QEMU has left.
        let counters = wait_counters(&log, &mut server, PEER_WAIT);
        drop(server);
        let mut r = to_run(t, &self.jobs[ji], ji, round, &qr.lines, self.tsc_khz)
            .map_err(|e| anyhow::anyhow!("{e}; QEMU: {}; backend: {}", qr.stderr.trim(), tail(&log)))?;
        let g = Guest { ios: r.ios, notifies: r.guest_notifies.unwrap_or(0) };
        let c = counters.as_ref().map(|cs| move |n: &str| cs.iter().find(|c| c.name == n).map(|c| c.value));
        let v = check::qemu_vhost_user(c.as_ref().map(|f| f as check::Counters), g);
        r.routing =
            format!("QEMU vhost-user-blk-pci on iopath serve {config}; exit status {:?}; {}", qr.status, v.text);
        r.routing_ok = qr.status == Some(1) && v.ok;
        guest_checks(&mut r);
        Ok(r)
    }
}

/// QEMU's option syntax: a comma inside a value is written twice.
fn escaped(p: &Path) -> String {
    p.display().to_string().replace(',', ",,")
}

/// Whether a UNIX socket is listening on `path` (/proc/net/unix: its
/// __SO_ACCEPTCON flag is set by listen(), after bind() made the file).
fn listening(path: &Path) -> bool {
    const SO_ACCEPTCON: u32 = 0x10000;
    let Ok(f) = std::fs::File::open("/proc/net/unix") else { return false };
    let want = path.as_os_str().as_encoded_bytes();
    // Bounded: a host with very many sockets is read in part only.
    std::io::BufRead::split(std::io::BufReader::new(std::io::Read::take(f, 64 << 20)), b'\n').skip(1).any(|l| {
        let Ok(l) = l else { return false };
        let mut w = l.split(|&c| c == b' ').filter(|w| !w.is_empty());
        let flags = w.nth(3).and_then(|f| std::str::from_utf8(f).ok()).and_then(|f| u32::from_str_radix(f, 16).ok());
        flags.is_some_and(|f| f & SO_ACCEPTCON != 0) && w.nth(3) == Some(want)
    })
}

/// The backend's counters line in its log (`iopath serve` prints one per
/// frontend that left), waited for up to `wait`; None if none came.
fn wait_counters(log: &Path, server: &mut Server, wait: Duration) -> Option<Vec<iopath_devices::Counter>> {
    let t0 = Instant::now();
    loop {
        // Looked at before the log is read: a line printed before it exited is still found.
        let exited = server.0.try_wait().ok().flatten().is_some();
        let mut text = Vec::new();
        if let Ok(f) = std::fs::File::open(log) {
            let _ = std::io::Read::read_to_end(&mut std::io::Read::take(f, MAX_LOG), &mut text);
        }
        let found = String::from_utf8_lossy(&text).lines().rev().find_map(iopath_protocols::process::parse_report);
        if found.is_some() || exited || t0.elapsed() >= wait {
            return found;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A device process killed and reaped when dropped (this one only, by its pid).
struct Server(std::process::Child);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A directory of this run's (socket, log), removed when dropped.
struct TempDir(PathBuf);

impl TempDir {
    fn new() -> anyhow::Result<TempDir> {
        static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let p = std::env::temp_dir().join(format!("iopath-blk-{}-{n}", std::process::id()));
        std::fs::create_dir_all(&p).map_err(|e| anyhow::anyhow!("cannot create {}: {e}", p.display()))?;
        Ok(TempDir(p))
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The last lines of a log (bounded), for an error message.
fn tail(p: &Path) -> String {
    let s = std::fs::read(p).unwrap_or_default();
    let s = String::from_utf8_lossy(&s[s.len().saturating_sub(2000)..]).into_owned();
    s.trim().replace('\n', " | ")
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

    #[test]
    fn a_socket_bound_but_not_listening_is_not_listening() {
        let dir = TempDir::new().unwrap();
        let p = dir.0.join("s.sock");
        assert!(!listening(&p), "no socket yet");
        // SAFETY: a new socket, owned by `fd` from here on.
        let fd = unsafe { OwnedFd::from_raw_fd(libc::socket(libc::AF_UNIX, libc::SOCK_STREAM, 0)) };
        // SAFETY: sockaddr_un is plain data; all zeros is a valid value.
        let mut sa: libc::sockaddr_un = unsafe { std::mem::zeroed() };
        sa.sun_family = libc::AF_UNIX as libc::sa_family_t;
        for (d, s) in sa.sun_path.iter_mut().zip(p.as_os_str().as_encoded_bytes()) {
            *d = *s as libc::c_char;
        }
        let len = std::mem::size_of::<libc::sockaddr_un>() as libc::socklen_t;
        // SAFETY: bind reads `len` bytes of `sa`, a whole sockaddr_un.
        assert_eq!(unsafe { libc::bind(fd.as_raw_fd(), &sa as *const _ as *const libc::sockaddr, len) }, 0);
        // The file is there (what the bench waited for before), the listen not yet.
        assert!(p.exists());
        assert!(!listening(&p), "bound, not listening: a connect now is refused");
        // SAFETY: listen on a socket this test owns.
        assert_eq!(unsafe { libc::listen(fd.as_raw_fd(), 1) }, 0);
        assert!(listening(&p));
        assert!(!listening(&dir.0.join("s.sock2")), "another path");
    }
}
