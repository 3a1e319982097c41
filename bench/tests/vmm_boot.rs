//! End-to-end: the real guest image in iopath's VMM on the real /dev/kvm. These tests fail
//! (they do not skip) when /dev/kvm is missing, so CI cannot pass without KVM.

use iopath_bench::record::{fields, GuestOutput};
use iopath_devices::doorbell::Doorbell;
use iopath_devices::testdev::PciTestDev;
use iopath_vmm::{run, VmConfig};
use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;

fn require_kvm() {
    assert!(
        std::path::Path::new("/dev/kvm").exists(),
        "/dev/kvm is missing: these end-to-end tests need KVM and must not be skipped"
    );
}

fn rows(lines: &[String]) -> HashMap<String, BTreeMap<String, String>> {
    lines
        .iter()
        .filter(|l| l.starts_with("@row "))
        .map(|l| {
            let m = fields(l);
            (m["name"].clone(), m)
        })
        .collect()
}

fn counter(r: &iopath_vmm::vm::DeviceReport, name: &str) -> u64 {
    r.counters.iter().find(|c| c.name == name).map(|c| c.value).unwrap_or_else(|| panic!("no counter {name}"))
}

fn config(cmdline: &str, place_bars: bool) -> VmConfig {
    let mut cfg = VmConfig::new(iopath_guest::IMAGE, cmdline);
    cfg.devices = vec![Arc::new(Mutex::new(PciTestDev::new())), Arc::new(Mutex::new(Doorbell::new()))];
    cfg.place_bars = place_bars;
    cfg.timeout = Duration::from_secs(120);
    cfg
}

#[test]
fn exits_workload_routes_every_row_as_labelled() {
    require_kvm();
    let r = run(config("workload=exits batches=3 batch_us=2000", true)).expect("guest run");
    assert_eq!(r.status, 1, "guest exit status; output:\n{}", r.lines.join("\n"));
    let rows = rows(&r.lines);
    let td = r.devices.iter().find(|d| d.name == "pci-testdev").unwrap();
    for name in ["mmio", "portio"] {
        for test in ["no-eventfd", "wildcard-eventfd", "datamatch-eventfd"] {
            let bar = if name == "mmio" { "pci-mem" } else { "pci-io" };
            let row = &rows[&format!("{name}-{test}:{bar}")];
            let accesses: u64 = row["accesses"].parse().unwrap();
            let count: u64 = row["count"].parse().unwrap();
            let exits = counter(td, &format!("{name}-{test}.exits"));
            let kicks = counter(td, &format!("{name}-{test}.kicks"));
            assert!(accesses > 0);
            if test == "no-eventfd" {
                assert_eq!((count, exits, kicks), (accesses, accesses, 0), "{name}-{test}");
            } else {
                assert_eq!((count, exits, kicks), (0, 0, accesses), "{name}-{test}");
            }
        }
    }
    for want in ["empty-loop", "cpuid", "outl_to_vmm", "inl_from_vmm", "mmio_to_vmm", "outl_to_kernel"] {
        assert!(rows.contains_key(want), "row {want} missing");
    }
    // The unclaimed port and MMIO rows were counted as unclaimed by the VMM.
    let n = |k: &str| rows[k]["accesses"].parse::<u64>().unwrap();
    assert!(r.exits.unclaimed_pio_write >= n("outl_to_vmm"));
    assert!(r.exits.unclaimed_pio_read >= n("inl_from_vmm"));
    assert!(r.exits.unclaimed_mmio_write >= n("mmio_to_vmm"));
    // Doorbell rows: each completion came by the path its name says.
    for (row, exits, kicks, polls) in [
        ("doorbell-rtt:exit-mmio", true, false, false),
        ("doorbell-rtt:exit-pio", true, false, false),
        ("doorbell-rtt:ioeventfd-mmio", false, true, false),
        ("doorbell-rtt:ioeventfd-pio", false, true, false),
        ("doorbell-rtt:shm", false, false, true),
    ] {
        let m = &rows[row];
        assert!(m.get("status").is_none(), "{row}: {m:?}");
        let a: u64 = m["accesses"].parse().unwrap();
        let get = |k: &str| m[k].parse::<u64>().unwrap();
        assert_eq!(get("exits"), if exits { a } else { 0 }, "{row} exits");
        assert_eq!(get("kicks"), if kicks { a } else { 0 }, "{row} kicks");
        assert_eq!(get("polls"), if polls { a } else { 0 }, "{row} polls");
    }
}

/// A row whose first access takes a whole batch's time (a device thread
/// starting cold) must still get batches of the target length: the guest's
/// `calibration-cold-start` row spins 20 ms on its first access, then each
/// access is a RAM store (20 ms hold millions). Before the fix the batch
/// stayed at the 8 accesses of the first pass. Likewise a path that is
/// slow while the batch is sized and fast from the timed batches on (a
/// device thread that was descheduled, then runs): `calibration-slow-then-fast`.
#[test]
fn a_cold_row_still_gets_batches_of_the_target_length() {
    require_kvm();
    for test_row in ["calibration-cold-start", "calibration-slow-then-fast"] {
        let cmdline = format!("workload=exits batches=3 batch_us=20000 only={test_row},doorbell-rtt:shm,outl_to_vmm");
        let r = run(config(&cmdline, true)).expect("guest run");
        assert_eq!(r.status, 1, "output:\n{}", r.lines.join("\n"));
        let out = GuestOutput::parse(&r.lines);
        let cold = out.row(test_row).unwrap_or_else(|| panic!("row {test_row} missing"));
        assert!(cold.iters >= 10_000, "{} accesses per batch: {cold:?}", cold.iters);
        let target = 20_000 * r.tsc_khz as u64 / 1000;
        for name in [test_row, "doorbell-rtt:shm", "outl_to_vmm"] {
            let row = out.row(name).unwrap_or_else(|| panic!("row {name} missing"));
            assert!(row.status().is_none(), "{row:?}");
            assert_eq!(row.cycles.len(), 3);
            // Far above 8 accesses, or (a host so loaded that each round trip
            // waits for a time slice) batches that still last the target time.
            let mut c = row.cycles.clone();
            c.sort();
            assert!(row.iters >= 64 || c[1] >= target / 4, "{name}: {} accesses per batch: {row:?}", row.iters);
            // Every access counted: the untimed ones and the timed batches.
            assert_eq!(row.get_u64("warm").unwrap() + row.timed_accesses(), row.accesses, "{row:?}");
        }
    }
}

/// The same access loops run at CPL0 when the command line asks, and
/// their accesses still take the path the row names.
#[test]
fn exit_rows_run_at_cpl0_when_asked() {
    require_kvm();
    let r =
        run(config("workload=exits batches=2 batch_us=2000 cpl=0 only=outl_to_vmm,cpuid", true)).expect("guest run");
    assert_eq!(r.status, 1, "output:\n{}", r.lines.join("\n"));
    let out = GuestOutput::parse(&r.lines);
    for name in ["outl_to_vmm", "cpuid"] {
        let row = out.row(name).unwrap_or_else(|| panic!("row {name} missing"));
        assert_eq!(row.cpl(), Some(0), "{row:?}");
        assert!(row.status().is_none() && row.iters > 0, "{row:?}");
    }
    assert_eq!(r.exits.unclaimed_pio_write, out.row("outl_to_vmm").unwrap().accesses);
}

#[test]
fn guest_assigns_bars_when_the_vmm_does_not() {
    require_kvm();
    let r = run(config("workload=exits batches=1 batch_us=500 only=mmio-no,portio-no", false)).expect("guest run");
    assert_eq!(r.status, 1, "output:\n{}", r.lines.join("\n"));
    let td = r.devices.iter().find(|d| d.name == "pci-testdev").unwrap();
    assert_eq!(td.bars.len(), 2, "both BARs decode after the guest assigned them");
    assert!(td.bars.iter().any(|b| b.addr >= 0xe000_0000));
    let rows = rows(&r.lines);
    assert_eq!(rows["mmio-no-eventfd:pci-mem"]["count"], rows["mmio-no-eventfd:pci-mem"]["accesses"]);
}

#[test]
fn bare_loop_runs_the_floor_workload() {
    require_kvm();
    let r = iopath_vmm::bare::run_bare(
        iopath_guest::IMAGE,
        "workload=floor batches=2 batch_us=1000",
        64 << 20,
        Duration::from_secs(60),
    )
    .expect("bare run");
    assert_eq!(r.status, 1, "output:\n{}", r.lines.join("\n"));
    let rows = rows(&r.lines);
    assert!(rows.contains_key("outl_to_vmm") && rows.contains_key("mmio_to_vmm"));
}

#[test]
fn a_guest_that_never_exits_is_stopped_by_the_timeout() {
    require_kvm();
    // An empty loop of ~10^12 iterations cannot finish in one second.
    let mut cfg = config("workload=exits batches=64 batch_us=100000000 only=empty-loop", true);
    cfg.timeout = Duration::from_secs(1);
    let t0 = std::time::Instant::now();
    let e = run(cfg).err().expect("must time out");
    assert!(matches!(e, iopath_vmm::VmmError::Timeout { .. }), "{e}");
    assert!(t0.elapsed() < Duration::from_secs(10));
}
