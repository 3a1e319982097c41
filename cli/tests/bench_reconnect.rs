//! `iopath bench reconnect` end to end on the real /dev/kvm: two kills of
//! NVMe's vfio-user device process (doorbell=shm), then of virtio-blk's,
//! under the guest's verify workload. Oracles: the VMM's reconnect counter equals the kills, the
//! guest's record (no error, no mismatch, every block verified, two gaps),
//! each kill matched to the device's first completion after it (a pause
//! above 0 and below the kill interval), the file read back (the bench's
//! check), and nothing left in the temp dir. The goal is printed, not
//! judged (the host is shared).

mod common;

use std::process::Command;

#[test]
fn bench_reconnect_with_two_kills_counts_a_reconnect_per_kill_and_no_guest_error() {
    const TARGETS: [&str; 2] = ["nvme-vfio-user-shm", "vblk-vfio-user"];
    common::kvm();
    let dir = common::TempDir::new("reconnect-json");
    let json = dir.join("r.json");
    let before = leftovers();
    let out = Command::new(env!("CARGO_BIN_EXE_iopath"))
        .args(["bench", "reconnect", "--kills", "2", "--every", "1.5s", "--target", &TARGETS.join(","), "--json"])
        .arg(&json)
        .output()
        .unwrap();
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    eprintln!("{stdout}");
    assert!(out.status.success(), "{stdout}\n{stderr}");
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    assert_eq!((v["benchmark"].as_str(), v["options"]["kills"].as_u64()), (Some("reconnect"), Some(2)));
    let rows = v["rows"].as_array().unwrap();
    assert_eq!(rows.len(), TARGETS.len(), "{v}");
    for (r, target) in rows.iter().zip(TARGETS) {
        assert_eq!(r["target"], target);
        check_row(r);
        assert!(stdout.contains(target), "{stdout}");
    }
    assert!(stdout.contains("p50 ms"), "{stdout}");
    assert_eq!(leftovers(), before, "the bench's temp dir is gone");
}

/// A row's oracles (see the module doc).
fn check_row(r: &serde_json::Value) {
    assert_eq!((r["kills"].as_u64(), r["reconnects"].as_u64()), (Some(2), Some(2)), "{r}");
    assert_eq!((r["errors"].as_u64(), r["mismatches"].as_u64()), (Some(0), Some(0)), "{r}");
    assert_eq!((r["file_ok"].as_bool(), r["failed"].as_bool()), (Some(true), Some(false)), "{r}");
    assert!(r["tsc_khz"].as_u64().unwrap() > 0, "{r}");
    // Each kill's own pause, to the device's first completion after it: positive, within the
    // kill interval (the next kill's, or the window's end); the guest's gaps as a second view;
    // the VMM's log timed each reconnect too.
    let per_kill = r["kill_pause_ms"].as_array().unwrap();
    assert_eq!((per_kill.len(), r["unmatched_kills"].as_u64()), (2, Some(0)), "{r}");
    assert!(per_kill.iter().all(|p| p.as_f64().is_some_and(|p| p > 0.0 && p < 1500.0)), "{r}");
    assert_eq!(r["pause_ms"]["samples"].as_array().unwrap().len(), 2, "{r}");
    assert!(r["goal_met"].is_boolean(), "{r}");
    let gaps = r["guest_gap_ms"]["samples"].as_array().unwrap();
    assert_eq!(gaps.len(), 2, "{r}");
    assert!(gaps.iter().all(|p| p.as_f64().unwrap() > 0.0), "{r}");
    assert_eq!(r["vmm_reconnect_ms"]["samples"].as_array().unwrap().len(), 2, "{r}");
}

/// The bench's temp dirs of this host (its name: iopath-bench-reconnect-PID-N).
fn leftovers() -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(std::env::temp_dir())
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().to_str().map(str::to_string))
        .filter(|n| n.starts_with("iopath-bench-reconnect-"))
        .collect();
    v.sort();
    v
}
