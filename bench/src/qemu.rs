//! Runs the same guest image under QEMU (+KVM) with QEMU's own devices.

use iopath_devices::nvme::backend::BackendKind;
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

/// The `-drive` value (id `nvm0`) for QEMU's nvme on iopath's `backend`:
/// a file is opened as iopath's file backend opens it, raw with O_DIRECT
/// (`cache=none`) through `aio` (io_uring, or native where QEMU has no
/// io_uring); any other backend is `null-co` (no data, as `null`).
pub fn nvme_drive(backend: &BackendKind, aio: &str) -> String {
    match backend {
        // QEMU's option syntax: a comma inside a value is written twice.
        BackendKind::File(p) => {
            format!(
                "file={},format=raw,if=none,id=nvm0,aio={aio},cache=none",
                p.display().to_string().replace(',', ",,")
            )
        }
        _ => "driver=null-co,size=64M,if=none,id=nvm0".into(),
    }
}

/// QEMU refused `aio=io_uring` (built without it, or the kernel's refused).
fn lacks_io_uring(r: &QemuRun) -> bool {
    !r.lines.iter().any(|l| l.starts_with('@')) && r.stderr.contains("io_uring")
}

/// Runs nvmeperf (`cmdline`) on QEMU's nvme on `backend` (see
/// [`nvme_drive`]); a file through io_uring, or aio=native if this QEMU
/// cannot. Returns the run and what QEMU's drive was, for its row.
pub fn run_nvme(
    qemu: &Path,
    image: &Path,
    cmdline: &str,
    mem_mb: u64,
    backend: &BackendKind,
    lba: u32,
    timeout: Duration,
) -> anyhow::Result<(QemuRun, String)> {
    let attempt = |aio: &str| {
        let drive = nvme_drive(backend, aio);
        run_args(qemu, nvme_args(image, cmdline, mem_mb, &drive, lba), None, timeout, |_| {})
    };
    let BackendKind::File(p) = backend else { return Ok((attempt("")?, "null-co".into())) };
    let r = attempt("io_uring")?;
    if !lacks_io_uring(&r) {
        return Ok((r, format!("file:{} (raw, aio=io_uring, cache=none)", p.display())));
    }
    let why = r.stderr.lines().find(|l| l.contains("io_uring")).unwrap_or("").trim().to_string();
    let r = attempt("native")?;
    Ok((r, format!("file:{} (raw, aio=native, cache=none: no io_uring in this QEMU: {why})", p.display())))
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_file_backend_gives_qemu_the_same_file_raw_o_direct_through_io_uring() {
        let f = BackendKind::File("/var/tmp/a,b.img".into());
        assert_eq!(
            nvme_drive(&f, "io_uring"),
            "file=/var/tmp/a,,b.img,format=raw,if=none,id=nvm0,aio=io_uring,cache=none"
        );
        assert!(nvme_drive(&f, "native").contains(",aio=native,cache=none"));
        for b in [BackendKind::Null, BackendKind::Ram] {
            assert_eq!(nvme_drive(&b, "io_uring"), "driver=null-co,size=64M,if=none,id=nvm0");
        }
        let a = nvme_args(Path::new("/img"), "workload=nvme", 256, &nvme_drive(&f, "io_uring"), 512);
        let i = a.iter().position(|x| x == "-drive").expect("a -drive");
        assert!(a[i + 1].starts_with("file=/var/tmp/a,,b.img,format=raw"));
        assert!(a.iter().any(|x| x == "nvme,drive=nvm0,serial=iopath0,logical_block_size=512"));
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
