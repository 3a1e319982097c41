//! Helpers shared by the end-to-end tests.
//! Each test binary uses a part of it.
#![allow(dead_code)]

pub mod kills;
pub mod nvmeperf;
mod tempdir;
#[allow(unused_imports)] // not every test binary makes one
pub use tempdir::TempDir;

use iopath_protocols::attach::Programs;
use std::path::PathBuf;

/// The checks `harness/linux/guest-vblk.sh` prints that every Linux
/// virtio-blk run must pass.
pub const LINUX_VBLK_CHECKS: &[&str] = &[
    "probe",
    "features",
    "capacity",
    "queues",
    "queue-limits",
    "irq-msix",
    "fio-randwrite",
    "fio-randread",
    "irq-count-rise",
    "ext4",
    "rebind",
    "io-after-rebind",
    "no-errors",
];

pub fn kvm() {
    assert!(std::path::Path::new("/dev/kvm").exists(), "/dev/kvm is missing: these tests need KVM");
}

/// The iopath binary under test (for `iopath serve`) and QEMU if installed.
pub fn programs() -> Programs {
    Programs {
        iopath: PathBuf::from(env!("CARGO_BIN_EXE_iopath")),
        qemu: iopath_bench::qemu::find().ok(),
        serve_args: Vec::new(),
    }
}

/// A process as /proc shows it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProcInfo {
    pub pid: u32,
    /// Its name (`comm`, at most 15 bytes).
    pub comm: String,
    /// Its arguments, joined by spaces.
    pub cmdline: String,
}

/// The processes whose parent is `pid` (zombies included: not yet reaped).
pub fn children(pid: u32) -> Vec<ProcInfo> {
    let mut v = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Some(p) = e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else { continue };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{p}/stat")) else { continue };
        // "PID (COMM) STATE PPID ...": COMM may hold spaces and parentheses, the last ')' ends it.
        let (Some(open), Some(close)) = (stat.find('('), stat.rfind(')')) else { continue };
        let ppid = stat[close + 1..].split_whitespace().nth(1).and_then(|x| x.parse::<u32>().ok());
        if ppid == Some(pid) {
            let cmdline = std::fs::read_to_string(format!("/proc/{p}/cmdline")).unwrap_or_default().replace('\0', " ");
            v.push(ProcInfo { pid: p, comm: stat[open + 1..close].to_string(), cmdline });
        }
    }
    v
}
