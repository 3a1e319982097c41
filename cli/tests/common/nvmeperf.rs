//! nvmeperf (the guest's NVMe load generator) against a device spec: its
//! record and the controller's counters.

use super::programs;
use iopath_protocols::attach::{instantiate, DeviceSpec};
use iopath_vmm::{run, RamKind, VmConfig};
use std::collections::BTreeMap;
use std::time::Duration;

pub fn nvme_record(lines: &[String]) -> BTreeMap<String, String> {
    iopath_bench::record::find_record(lines, "nvme")
        .unwrap_or_else(|| panic!("no @nvme record in {:?}", lines.iter().rev().take(8).collect::<Vec<_>>()))
}

pub fn num(r: &BTreeMap<String, String>, k: &str) -> u64 {
    r.get(k).and_then(|v| v.parse().ok()).unwrap_or_else(|| panic!("{k} missing in {r:?}"))
}

/// The record, the controller's counters and the run's report.
pub type NvmeperfRun = (BTreeMap<String, String>, BTreeMap<String, u64>, iopath_vmm::vm::RunReport);

/// Runs nvmeperf against `spec`; returns the record and the controller's counters.
pub fn nvmeperf(spec: &str, args: &str) -> NvmeperfRun {
    nvmeperf_in(spec, args, 128, RamKind::Auto)
}

/// One nvmeperf run against `spec`, whatever its outcome.
pub fn nvmeperf_run(spec: &str, args: &str, mem_mb: u64, ram: RamKind) -> iopath_vmm::vm::RunReport {
    let spec: DeviceSpec = spec.parse().unwrap();
    let mut cfg = VmConfig::new(iopath_guest::IMAGE, &format!("workload=nvme {args}"));
    cfg.devices = vec![instantiate(&spec, &programs()).unwrap()];
    cfg.mem_size = mem_mb << 20;
    cfg.ram = ram;
    cfg.timeout = Duration::from_secs(120);
    run(cfg).unwrap()
}

/// The same in `mem_mb` of guest RAM backed as `ram` says.
pub fn nvmeperf_in(spec: &str, args: &str, mem_mb: u64, ram: RamKind) -> NvmeperfRun {
    let r = nvmeperf_run(spec, args, mem_mb, ram);
    assert_eq!(r.status, 1, "{spec:?} {args}: {:?}", r.lines.iter().rev().take(6).collect::<Vec<_>>());
    let rec = nvme_record(&r.lines);
    let c = r.devices[0].counters.iter().map(|c| (c.name.clone(), c.value)).collect();
    (rec, c, r)
}
