//! Runs the same guest image under QEMU (+KVM) with QEMU's own devices.

use std::io::{BufRead, BufReader};
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

/// The arguments that give QEMU's guest RAM as a shared memfd, which
/// `x-pci-proxy-dev` hands to the device process (SYNC_SYSMEM).
pub fn memfd_ram_args() -> Vec<String> {
    ["-object", "memory-backend-memfd,id=ram0,size=64M,share=on", "-machine", "pc,memory-backend=ram0"]
        .iter()
        .map(|s| s.to_string())
        .collect()
}

/// Runs QEMU with `args`; `fd3`, if given, becomes the child's fd 3.
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
    let reader = std::thread::spawn(move || {
        for l in BufReader::new(stdout).lines() {
            let Ok(l) = l else { break };
            if tx.send(l.trim_end_matches('\r').to_string()).is_err() {
                break;
            }
        }
    });
    let err_reader = std::thread::spawn(move || std::io::read_to_string(stderr).unwrap_or_default());
    let t0 = Instant::now();
    let mut lines = Vec::new();
    let status = loop {
        while let Ok(l) = rx.recv_timeout(Duration::from_millis(20)) {
            on_line(&l);
            lines.push(l);
        }
        if let Some(s) = child.try_wait()? {
            break s.code();
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
