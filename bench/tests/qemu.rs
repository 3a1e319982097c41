//! The same guest image under QEMU + KVM with QEMU's pci-testdev: boots, and
//! its routing (pci-testdev's count register) matches each row's label. Fails
//! loudly without KVM or QEMU: CI installs qemu-system-x86.

use iopath_bench::exits::verify_qemu;
use iopath_bench::record::GuestOutput;
use std::time::Duration;

#[test]
fn guest_runs_under_qemu_and_routes_as_labelled() {
    assert!(std::path::Path::new("/dev/kvm").exists(), "/dev/kvm is missing");
    let qemu = iopath_bench::qemu::find().expect("QEMU is required for this test");
    let image = iopath_guest::image_file().unwrap();
    let cmd = "workload=exits batches=2 batch_us=2000 tsc_khz=2000000";
    let r = iopath_bench::qemu::run(&qemu, &image, cmd, &["pci-testdev"], Duration::from_secs(120), |_| {}).unwrap();
    assert_eq!(r.status, Some(1), "QEMU exit status; stderr {}\n{}", r.stderr, r.lines.join("\n"));
    let out = GuestOutput::parse(&r.lines);
    assert_eq!(out.done_rc, Some(0));
    assert!(out.pci.iter().any(|p| p["id"] == "1b36:0005"), "pci-testdev enumerated");
    let v = verify_qemu(&out);
    let testdev_rows: Vec<_> = out.rows.iter().filter(|r| r.group == "pci-testdev").collect();
    assert_eq!(testdev_rows.len(), 8, "six pci-testdev tests and a read row per BAR");
    for r in testdev_rows {
        assert!(v[&r.name].ok, "{}: {}", r.name, v[&r.name].detail);
        assert!(r.accesses > 0);
    }
}
