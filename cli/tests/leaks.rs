//! Nothing a guest run was given outlives it: after `run` returns, its VM,
//! its device threads, its device process and their fds are gone.

mod common;
use common::{kvm, programs};

use iopath_protocols::attach::{instantiate, DeviceSpec};
use iopath_vmm::{run, VmConfig};
use std::time::Duration;

fn fds() -> usize {
    std::fs::read_dir("/proc/self/fd").unwrap().count()
}

fn threads() -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir("/proc/self/task")
        .unwrap()
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
        .map(|s| s.trim().to_string())
        .collect();
    v.sort();
    v
}

/// This process's children that have ended but were not waited for.
fn zombies() -> usize {
    let me = std::process::id().to_string();
    std::fs::read_dir("/proc")
        .unwrap()
        .filter_map(|e| std::fs::read_to_string(e.ok()?.path().join("stat")).ok())
        .filter(|s| {
            let f: Vec<&str> = s.rsplit_once(") ").map(|x| x.1).unwrap_or("").split(' ').collect();
            f.first() == Some(&"Z") && f.get(1) == Some(&me.as_str())
        })
        .count()
}

fn guest_run(spec: &str, workload: &str) {
    let spec: DeviceSpec = spec.parse().unwrap();
    let mut cfg = VmConfig::new(iopath_guest::IMAGE, workload);
    cfg.devices = vec![instantiate(&spec, &programs()).unwrap()];
    cfg.mem_size = 128 << 20;
    cfg.timeout = Duration::from_secs(120);
    let r = run(cfg).unwrap();
    assert_eq!(r.status, 1, "{:?}", r.lines.iter().rev().take(6).collect::<Vec<_>>());
}

#[test]
fn guest_runs_leave_no_vm_thread_fd_or_device_process_behind() {
    kvm();
    for (spec, workload) in [
        ("nvme,doorbell=shm,backend=null", "workload=nvme rw=randread bs=512 iodepth=4 time_ms=50"),
        ("nvme,doorbell=adaptive,backend=ram@vfio-user", "workload=nvme rw=randread bs=512 iodepth=4 time_ms=50"),
        ("pci-testdev@mpqemu", "workload=exits batches=1 batch_us=1000 only=outl_to_vmm"),
    ] {
        // The first run may start process-wide things (a logger, seccomp filters): not counted.
        guest_run(spec, workload);
        std::thread::sleep(Duration::from_millis(200));
        let (f0, t0) = (fds(), threads());
        for _ in 0..3 {
            guest_run(spec, workload);
        }
        std::thread::sleep(Duration::from_millis(500));
        assert_eq!(threads(), t0, "{spec}: threads left behind");
        assert!(fds() <= f0, "{spec}: {} fds before, {} after 3 runs", f0, fds());
        assert_eq!(zombies(), 0, "{spec}: device processes not waited for");
    }
}
