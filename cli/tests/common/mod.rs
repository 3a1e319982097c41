//! Helpers shared by the end-to-end tests.
//! Each test binary uses a part of it.
#![allow(dead_code)]

pub mod nvmeperf;

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
