//! iopath's VMM survives its vfio-user device process being killed, on the
//! real /dev/kvm: pci-testdev in a device process the VMM started
//! (`--device pci-testdev@vfio-user`), SIGKILLed while the guest writes
//! to it. The proxy starts a new process and replays its session; the guest
//! finishes its rows. The oracle is the counters: one reconnect, and the
//! rows that ran after the kill (a message row and an ioeventfd row, whose
//! KVM ioeventfds moved to the new process's eventfds) counted exactly by
//! the new process (the message row's count as the guest read it from its
//! register too).

mod common;
use common::{children, kvm, programs};

use iopath_bench::record::GuestOutput;
use iopath_protocols::attach::{instantiate, DeviceSpec};
use iopath_vmm::{run, VmConfig};
use std::time::{Duration, Instant};

fn counter(r: &iopath_vmm::vm::RunReport, name: &str) -> Option<u64> {
    r.devices[0].counters.iter().find(|c| c.name == name).map(|c| c.value)
}

/// The pid of this process's `iopath serve pci-testdev ... --fd 3` child, waited for.
fn device_process() -> u32 {
    let t0 = Instant::now();
    loop {
        let found = children(std::process::id())
            .into_iter()
            .find(|p| p.cmdline.contains("serve pci-testdev") && p.cmdline.contains("--fd 3"));
        if let Some(p) = found {
            return p.pid;
        }
        assert!(t0.elapsed() < Duration::from_secs(20), "no device process was started");
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn a_device_process_killed_during_the_guest_workload_is_replaced_and_the_guest_goes_on() {
    kvm();
    let spec: DeviceSpec = "pci-testdev@vfio-user".parse().unwrap();
    // A long message row (on BAR0), then a message row and an ioeventfd
    // row on BAR1, which the guest runs after the BAR0 rows.
    let rows = "mmio-no-eventfd,portio-no-eventfd,portio-wildcard";
    let mut cfg = VmConfig::new(iopath_guest::IMAGE, &format!("workload=exits batches=40 batch_us=50000 only={rows}"));
    cfg.devices = vec![instantiate(&spec, &programs()).unwrap()];
    cfg.timeout = Duration::from_secs(120);
    let first = device_process();
    let h = std::thread::spawn(move || run(cfg));
    // Into the first row (its batches take 2 s at least).
    std::thread::sleep(Duration::from_millis(1000));
    // SAFETY: kill(2) of our own child, by its pid.
    assert_eq!(unsafe { libc::kill(first as i32, libc::SIGKILL) }, 0);
    let r = h.join().unwrap().unwrap();
    assert_eq!(r.status, 1, "{:?}", r.lines);
    let out = GuestOutput::parse(&r.lines);
    assert_eq!(out.rows.len(), 3, "{:?}", r.lines);
    assert_eq!(counter(&r, "vfio-user.reconnects"), Some(1));
    // The rows after the kill: the new process counted every access, and
    // the guest read that count from its register.
    for name in ["portio-no-eventfd", "portio-wildcard-eventfd"] {
        let row = out.row(&format!("{name}:pci-io")).unwrap();
        let exits = counter(&r, &format!("{name}.exits")).unwrap();
        let kicks = counter(&r, &format!("{name}.kicks")).unwrap();
        eprintln!(
            "{name}: guest accesses {}, count {:?}, new process exits {exits} kicks {kicks}",
            row.accesses,
            row.get_u64("count")
        );
        if name == "portio-no-eventfd" {
            // (An eventfd row's kicks are folded into the count when the device drains them, at the end.)
            assert_eq!(row.get_u64("count"), Some(row.accesses), "{name}");
        }
        assert_eq!(exits + kicks, row.accesses, "{name}: the new process counted them all");
    }
    // The row the kill interrupted: the new process, which lost the
    // selected test with the old one (pci-testdev keeps no state memory),
    // counted fewer than the guest made.
    let row = out.row("mmio-no-eventfd:pci-mem").unwrap();
    let exits = counter(&r, "mmio-no-eventfd.exits").unwrap();
    eprintln!(
        "mmio-no-eventfd: guest accesses {}, count {:?}, new process exits {exits}",
        row.accesses,
        row.get_u64("count")
    );
    assert!(exits < row.accesses, "the kill came during the first row: {exits} of {}", row.accesses);
    assert_ne!(device_process_gone(first), false, "the killed process was reaped");
}

/// True once `pid` is no child of ours any more (reaped).
fn device_process_gone(pid: u32) -> bool {
    !children(std::process::id()).iter().any(|p| p.pid == pid)
}
