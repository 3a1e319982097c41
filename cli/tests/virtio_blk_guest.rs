//! The guest's virtio-blk driver (`workload=vblk`) against QEMU's own
//! virtio-blk-pci (modern only): an independent device, so the driver is
//! checked apart from iopath's model. Needs /dev/kvm and qemu-system-x86_64.

mod common;
#[path = "common/vblk.rs"]
mod vblk_record;
use common::{kvm, programs};
use vblk_record::num;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// A raw disk file removed when the test ends, pass or fail.
struct Disk(PathBuf);
impl Drop for Disk {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

fn disk(tag: &str) -> Disk {
    let p = std::env::temp_dir().join(format!("iopath-vblk-{tag}-{}.img", std::process::id()));
    std::fs::File::create(&p).unwrap().set_len(8 << 20).unwrap();
    Disk(p)
}

/// Boots the image under QEMU with `disk` as a modern virtio-blk-pci.
fn boot(qemu: &Path, disk: &Path, args: &str) -> iopath_bench::qemu::QemuRun {
    let image = iopath_guest::image_file().unwrap();
    let drive = format!("file={},format=raw,if=none,id=d0,cache=none,aio=native", disk.display());
    let extra = ["-drive".to_string(), drive];
    let a = iopath_bench::qemu::args_with(
        &image,
        &format!("workload=vblk {args}"),
        128,
        &extra,
        &["virtio-blk-pci,drive=d0,disable-legacy=on"],
    );
    iopath_bench::qemu::run_args(qemu, a, None, Duration::from_secs(120), |_| {}).unwrap()
}

/// [`boot`]; returns the `@vblk` record and all lines, after checking the run ended with rc=0.
fn vblk(qemu: &Path, disk: &Path, args: &str) -> (BTreeMap<String, String>, Vec<String>) {
    let q = boot(qemu, disk, args);
    (vblk_record::record(&q, args), q.lines)
}

fn qemu() -> PathBuf {
    kvm();
    programs().qemu.expect("qemu-system-x86_64 is needed (apt-get install -y qemu-system-x86)")
}

#[test]
fn vblk_writes_a_pattern_and_reads_it_back_from_qemus_virtio_blk() {
    let qemu = qemu();
    let d = disk("verify");
    let (rec, lines) = vblk(&qemu, &d.0, "verify=1 bs=4096 iodepth=8 size_mb=4");
    assert_eq!(rec["rw"], "verify");
    assert_eq!(num(&rec, "mismatches"), 0);
    // 4 MiB of 4 KiB blocks written, then read back.
    assert_eq!(num(&rec, "verified_blocks"), 1024);
    assert_eq!(num(&rec, "ios"), 2048);
    // The data really went to the file: block 5 carries its LBA-tagged pattern, not zeros.
    let data = std::fs::read(&d.0).unwrap();
    assert!(data[5 * 4096..6 * 4096].iter().any(|&b| b != 0), "the disk file was not written");
    let dev = lines.iter().find(|l| l.starts_with("@vblk-dev")).expect("@vblk-dev line");
    assert!(dev.contains("event_idx=1"), "QEMU offers EVENT_IDX: {dev}");
}

#[test]
fn vblk_randread_runs_and_event_idx_saves_notifies() {
    let qemu = qemu();
    let d = disk("randread");
    let (rec, lines) = vblk(&qemu, &d.0, "rw=randread bs=4096 iodepth=16 time_ms=300");
    let ios = num(&rec, "ios");
    assert!(ios > 0, "{rec:?}");
    assert_eq!(num(&rec, "event_idx"), 1);
    // One kick per reaping pass (many I/Os); a notify only where avail_event asks.
    let (kicks, notifies) = (num(&rec, "kicks"), num(&rec, "notifies"));
    assert!(notifies <= kicks && kicks > 0, "{rec:?}");
    assert!(notifies < ios, "EVENT_IDX at iodepth 16: {notifies} notifies for {ios} I/Os");
    // The histogram is dumped, and holds every I/O.
    let total: u64 = lines
        .iter()
        .filter_map(|l| l.strip_prefix("@vblk-hist "))
        .flat_map(|l| l.split_whitespace())
        .map(|p| p.split_once(':').unwrap().1.parse::<u64>().unwrap())
        .sum();
    assert_eq!(total, ios);
    assert!(lines.iter().any(|l| l == "@vblk-window start") && lines.iter().any(|l| l == "@vblk-window end"));
}

#[test]
fn vblk_without_event_idx_notifies_unless_the_device_says_no() {
    let qemu = qemu();
    let d = disk("noevidx");
    let (rec, _) = vblk(&qemu, &d.0, "rw=randwrite bs=4096 iodepth=4 time_ms=200 event_idx=0");
    assert_eq!(num(&rec, "event_idx"), 0);
    assert!(num(&rec, "ios") > 0 && num(&rec, "notifies") > 0, "{rec:?}");
}

#[test]
fn vblk_refuses_a_queue_size_that_is_no_power_of_two_with_one_error() {
    let qemu = qemu();
    let d = disk("qsize");
    let q = boot(&qemu, &d.0, "rw=randread qsize=12 time_ms=100");
    // isa-debug-exit: the guest's code 1 is QEMU's status 3.
    assert_eq!(q.status, Some(3), "{:?}", q.lines);
    let errors: Vec<_> = q.lines.iter().filter(|l| l.starts_with("@vblk-error")).collect();
    assert_eq!(errors.len(), 1, "{errors:?}");
    assert!(errors[0].contains("queue size is not a power of 2"), "{errors:?}");
    assert!(q.lines.iter().any(|l| l == "@done rc=1"));
    assert!(!q.lines.iter().any(|l| l.starts_with("@vblk ")), "no job runs");
}
