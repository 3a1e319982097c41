//! `bench blk`'s QEMU targets: QEMU 7.2's own virtio-blk-pci, and its
//! vhost-user-blk-pci on iopath's backend (`iopath serve virtio-blk,...
//! --transport vhost-user --socket PATH`), both with the guest image the
//! other targets run. Their routing is the guest's own count (I/O done,
//! 0 errors) and QEMU's exit status: QEMU's exits are not ours to count.

use super::run::{guest_checks, to_run, Ctx};
use super::{BlkRun, LISTEN_WAIT};
use crate::qemu::QemuBacking;
use iopath_devices::virtio::pci::NotifyMode;
use iopath_devices::DeviceConfig;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

impl Ctx<'_> {
    fn qemu(&self) -> anyhow::Result<&(PathBuf, QemuBacking)> {
        self.qemu.as_ref().map_err(|e| anyhow::anyhow!("no QEMU: {e}"))
    }

    /// QEMU's own virtio-blk-pci (modern only) on the same backend kind.
    pub(super) fn qemu_virtio(&self, t: &str, ji: usize, round: u32) -> anyhow::Result<BlkRun> {
        let (q, backing) = self.qemu()?;
        let dev = "virtio-blk-pci,drive=nvm0,disable-legacy=on";
        let timeout = Duration::from_secs(self.o.timeout_s);
        let fw = crate::qemu::fast_firmware_args();
        let (qr, drive) = crate::qemu::run_drive(
            q,
            &self.image,
            &self.cmdline(ji),
            self.o.mem_mb,
            backing,
            &fw,
            dev,
            timeout,
            &mut |_| {},
        )?;
        let mut r = to_run(t, &self.jobs[ji], ji, round, &qr.lines, self.tsc_khz)
            .map_err(|e| anyhow::anyhow!("{e}; stderr: {}", qr.stderr.trim()))?;
        r.routing = format!("QEMU virtio-blk-pci on {drive}; exit status {:?}", qr.status);
        r.routing_ok = qr.status == Some(1);
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
        let mut server = Server(
            Command::new(&self.progs.iopath)
                .args(["serve", &config, "--transport", "vhost-user", "--socket"])
                .arg(&sock)
                .stdin(Stdio::null())
                .stdout(std::fs::File::create(&log)?)
                .stderr(std::fs::File::create(&log)?)
                .spawn()
                .map_err(|e| anyhow::anyhow!("cannot start {}: {e}", self.progs.iopath.display()))?,
        );
        let t0 = Instant::now();
        while !sock.exists() {
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
            format!("socket,id=c0,path={}", sock.display().to_string().replace(',', ",,")),
        ]);
        let dev = "vhost-user-blk-pci,chardev=c0,disable-legacy=on";
        let args = crate::qemu::args_with(&self.image, &self.cmdline(ji), mem, &extra, &[dev]);
        let qr = crate::qemu::run_args(q, args, None, Duration::from_secs(self.o.timeout_s), |_| {})?;
        drop(server);
        let mut r = to_run(t, &self.jobs[ji], ji, round, &qr.lines, self.tsc_khz)
            .map_err(|e| anyhow::anyhow!("{e}; QEMU: {}; backend: {}", qr.stderr.trim(), tail(&log)))?;
        r.routing = format!("QEMU vhost-user-blk-pci on iopath serve {config}; exit status {:?}", qr.status);
        r.routing_ok = qr.status == Some(1);
        guest_checks(&mut r);
        Ok(r)
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
