//! `iopath bench blk` end to end on the real /dev/kvm: the in-VMM virtio-blk
//! targets, the VMM's vhost-user frontend, QEMU's virtio-blk-pci and
//! vhost-user-blk-pci (on iopath's backend) and NVMe with BAR doorbells,
//! every job, every routing check held. Needs /dev/kvm and qemu-system-x86_64.

mod common;
use common::{kvm, programs};

use std::process::Command;

const TARGETS: [&str; 7] = [
    "virtio-exit",
    "virtio-ioeventfd",
    "virtio-poll",
    "vhost-user",
    "qemu-virtio-blk-pci",
    "qemu-vhost-user-blk-pci",
    "nvme-bar",
];

#[test]
fn bench_blk_quick_gives_a_checked_record_per_target_and_job() {
    kvm();
    assert!(programs().qemu.is_some(), "qemu-system-x86_64 is needed (apt-get install -y qemu-system-x86)");
    let out = Command::new(env!("CARGO_BIN_EXE_iopath"))
        .args(["bench", "blk", "--quick", "--quiet", "--json", "-", "--targets", &TARGETS.join(",")])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON on stdout");
    assert_eq!(v["benchmark"], "blk");
    assert_eq!(v["schema_version"], iopath_bench::guard::JSON_SCHEMA_VERSION);
    let jobs: Vec<String> =
        v["jobs"].as_array().unwrap().iter().map(|j| j["name"].as_str().unwrap().to_string()).collect();
    // Seq and rand, read and write, for throughput (128 KiB) and latency (4 KiB QD1).
    assert_eq!(jobs.len(), 8, "{jobs:?}");
    for rw in ["seq read", "seq write", "rand read", "rand write"] {
        assert!(jobs.iter().any(|j| j == &format!("{rw} 128k qd16")), "{jobs:?}");
        assert!(jobs.iter().any(|j| j == &format!("{rw} 4k qd1")), "{jobs:?}");
    }
    let recs = v["records"].as_array().unwrap();
    assert_eq!(recs.len(), TARGETS.len() * jobs.len());
    for t in TARGETS {
        for j in &jobs {
            let r = recs
                .iter()
                .find(|r| r["target"] == t && r["job"] == j.as_str())
                .unwrap_or_else(|| panic!("no record for {t} {j}"));
            assert_eq!(r["routing_ok"], true, "{t} {j}: {r}\n{stderr}");
            assert!(r["iops"].as_f64().unwrap() > 0.0, "{t} {j}: {r}");
            assert!(r["mb_s"].as_f64().unwrap() > 0.0 && r["p99_ns"].as_f64().unwrap() > 0.0, "{t} {j}: {r}");
            assert_eq!(r["rounds"].as_array().unwrap().len(), 1, "--quick is one round: {r}");
            assert_eq!(r["schema_version"], iopath_bench::guard::JSON_SCHEMA_VERSION);
            // iopath's VMM counts exits in the window; QEMU's are not ours to count.
            assert_eq!(r["exits_per_io"].is_null(), t.starts_with("qemu"), "{t} {j}: {r}");
        }
    }
    // Exits per I/O say the path: at QD1 every virtio-exit notify exits, ioeventfd's never do.
    let epi = |t: &str, j: &str| {
        recs.iter().find(|r| r["target"] == t && r["job"] == j).unwrap()["exits_per_io"].as_f64().unwrap()
    };
    assert!(epi("virtio-exit", "rand read 4k qd1") >= 1.0);
    assert_eq!(epi("virtio-ioeventfd", "rand read 4k qd1"), 0.0);
    // QEMU's rows are checked by a device count too: its block layer's
    // operations (QMP), iopath's backend's requests; so is the VMM's vhost-user.
    let runs = v["runs"].as_array().unwrap();
    for (t, what) in [
        ("qemu-virtio-blk-pci", "QEMU blockstats rd_operations="),
        ("qemu-vhost-user-blk-pci", "backend requests="),
        ("vhost-user", "backend requests="),
    ] {
        let rs: Vec<&serde_json::Value> = runs.iter().filter(|r| r["target"] == t).collect();
        assert_eq!(rs.len(), jobs.len(), "{t}");
        for r in rs {
            let ios = r["ios"].as_u64().unwrap();
            let routing = r["routing"].as_str().unwrap();
            assert!(routing.contains(what), "{t}: {routing}");
            assert!(routing.contains(&format!("for {ios} guest I/Os")), "{t}: {routing}");
        }
    }
    // The device-assignment line is there, without figures.
    let nr = v["not_run"].as_array().unwrap();
    assert!(nr.iter().any(|n| n["target"] == "vfio (device assignment)"), "{nr:?}");
    assert!(!recs.iter().any(|r| r["target"].as_str().unwrap().starts_with("vfio")));
}

#[test]
fn a_missing_target_is_reported_failed_not_faked() {
    kvm();
    // QEMU's vhost-user-blk-pci with a QEMU that is not there: the run goes
    // on, the target is reported failed with its error and no figures in
    // each of its 8 records, and the bench's exit status says so.
    let out = Command::new(env!("CARGO_BIN_EXE_iopath"))
        .args([
            "bench",
            "blk",
            "--quick",
            "--quiet",
            "--json",
            "-",
            "--targets",
            "virtio-ioeventfd,qemu-vhost-user-blk-pci",
        ])
        .env("IOPATH_QEMU", "/nonexistent/qemu-system-x86_64")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1), "a failed target makes the bench fail");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON on stdout");
    let recs = v["records"].as_array().unwrap();
    let failed: Vec<&serde_json::Value> = recs.iter().filter(|r| r["target"] == "qemu-vhost-user-blk-pci").collect();
    assert_eq!(failed.len(), 8, "a record per job: {recs:?}");
    for r in failed {
        assert_eq!(r["routing_ok"], false, "{r}");
        assert!(r["iops"].is_null() && r["rounds"].as_array().unwrap().is_empty(), "{r}");
        assert!(r["error"].as_str().is_some_and(|e| !e.is_empty()), "{r}");
    }
    assert!(recs.iter().filter(|r| r["target"] == "virtio-ioeventfd").all(|r| r["routing_ok"] == true));
}

/// The threads of `pid`: (tid, comm, Cpus_allowed_list).
fn threads(pid: u32) -> Vec<(u32, String, String)> {
    let Ok(dir) = std::fs::read_dir(format!("/proc/{pid}/task")) else { return Vec::new() };
    dir.flatten()
        .filter_map(|e| {
            let tid: u32 = e.file_name().to_str()?.parse().ok()?;
            let comm = std::fs::read_to_string(e.path().join("comm")).ok()?.trim_end().to_string();
            let status = std::fs::read_to_string(e.path().join("status")).ok()?;
            let cpus = status.lines().find_map(|l| l.strip_prefix("Cpus_allowed_list:"))?.trim().to_string();
            Some((tid, comm, cpus))
        })
        .collect()
}

/// The children of `parent` whose name is `comm`.
fn children(parent: u32, comm: &str) -> Vec<u32> {
    let Ok(dir) = std::fs::read_dir("/proc") else { return Vec::new() };
    dir.flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            let Ok(s) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else { return false };
            let (Some(a), Some(b)) = (s.find('('), s.rfind(')')) else { return false };
            let ppid = s[b + 1..].split_whitespace().nth(1).and_then(|p| p.parse::<u32>().ok());
            ppid == Some(parent) && &s[a + 1..b] == comm
        })
        .collect()
}

#[test]
fn pinned_qemu_runs_its_vcpu_on_the_vcpu_cpu_and_its_main_loop_on_the_device_cpu() {
    kvm();
    assert!(programs().qemu.is_some(), "qemu-system-x86_64 is needed");
    let cpus = iopath_bench::pin::allowed_cpus();
    assert!(cpus.len() >= 2, "this test needs two CPUs: {cpus:?}");
    let (vcpu, dev) = (cpus[0], cpus[1]);
    let mut bench = Command::new(env!("CARGO_BIN_EXE_iopath"))
        .args(["bench", "blk", "--quiet", "--rounds", "1", "--runtime", "1", "--json", "/dev/null"])
        .args(["--targets", "qemu-virtio-blk-pci", "--pin", &format!("{vcpu},{dev}")])
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    // Watch QEMU's threads while the bench runs: its vCPU thread must be
    // named (`-name ...,debug-threads=on`) and placed on the vCPU's CPU, its
    // main loop (the thread whose tid is the pid) on the device CPU.
    let (vc, dc) = (vcpu.to_string(), dev.to_string());
    let placed = |q: u32, ts: &[(u32, String, String)]| {
        ts.iter().any(|(_, n, c)| n == "CPU 0/KVM" && *c == vc)
            && ts.iter().any(|(t, n, c)| *t == q && n == "qemu-system-x86" && *c == dc)
    };
    let t0 = std::time::Instant::now();
    let mut last = Vec::new();
    let mut seen = None;
    while seen.is_none() && bench.try_wait().unwrap().is_none() && t0.elapsed() < std::time::Duration::from_secs(300) {
        for q in children(bench.id(), "qemu-system-x86") {
            let ts = threads(q);
            if placed(q, &ts) {
                seen = Some(ts);
            } else if !ts.is_empty() {
                last = ts;
            }
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    // The bench ends by itself (its QEMU runs with it), bounded by its --timeout.
    let st = bench.wait().unwrap();
    let ts = seen.unwrap_or_else(|| panic!("QEMU's threads never placed (bench: {st}); last seen: {last:?}"));
    // No other QEMU thread was put on the vCPU's CPU as a device thread.
    assert!(ts.iter().filter(|(_, _, c)| *c == vc).all(|(_, n, _)| n == "CPU 0/KVM"), "{ts:?}");
    assert!(st.success(), "bench blk on qemu-virtio-blk-pci: {st}");
}
