//! The guest's `@vblk` records (workload=vblk), shared by the tests that
//! run the guest's virtio-blk driver against a device (QEMU's own, iopath's
//! over vhost-user). Included with `#[path = "common/vblk.rs"] mod vblk;`.
#![allow(dead_code)]

use std::collections::BTreeMap;

/// Field `k` of a record, as a number (panics naming the record if missing).
pub fn num(r: &BTreeMap<String, String>, k: &str) -> u64 {
    r.get(k).and_then(|v| v.parse().ok()).unwrap_or_else(|| panic!("{k} missing in {r:?}"))
}

/// The `@vblk` record of a QEMU run, after checking the guest ended with rc=0
/// (isa-debug-exit turns the guest's code 0 into QEMU's status 1) and
/// counted no error.
pub fn record(q: &iopath_bench::qemu::QemuRun, what: &str) -> BTreeMap<String, String> {
    assert_eq!(q.status, Some(1), "{what}: {}\n{:?}", q.stderr, q.lines);
    let rec = iopath_bench::record::find_record(&q.lines, "vblk")
        .unwrap_or_else(|| panic!("{what}: no @vblk record in {:?}", q.lines));
    assert_eq!(num(&rec, "errors"), 0, "{what}: {rec:?}");
    rec
}
