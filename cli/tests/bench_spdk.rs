//! `iopath bench spdk` end to end: a short run of SPDK's stock spdk_nvme_perf against `iopath
//! serve nvme` and against SPDK's nvmf_tgt, whose JSON must show both targets ran, every run
//! checked by the device's counters; and a bench stopped by SIGINT in the middle of a perf run,
//! which must leave no process, hugepage file or socket behind.
//!
//! The bench builds the peers with harness/spdk/build.sh if they are missing (cached; these
//! tests fail loudly if it cannot) and makes hugepages available with harness/spdk/hugepages.sh.

mod common;
use common::children;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// One bench at a time: each SPDK process polls a core, and the host has two.
static ONE: Mutex<()> = Mutex::new(());

fn bench(args: &[&str]) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_iopath"));
    c.args(["bench", "spdk"]).args(args);
    c
}

/// What a process `pid` of the bench could leave: itself (still running as an SPDK or iopath
/// process), DPDK's hugepage files and runtime directory.
fn leftovers(pid: u32) -> Vec<String> {
    let mut v = Vec::new();
    if let Ok(cmd) = std::fs::read_to_string(format!("/proc/{pid}/cmdline")) {
        if ["spdk_nvme_perf", "nvmf_tgt", "serve", "rpc.py"].iter().any(|n| cmd.contains(n)) {
            v.push(format!("process {pid} still runs: {}", cmd.replace('\0', " ")));
        }
    }
    let prefix = format!("spdk_pid{pid}map_");
    if let Ok(rd) = std::fs::read_dir("/dev/hugepages") {
        for e in rd.flatten() {
            if e.file_name().to_string_lossy().starts_with(&prefix) {
                v.push(format!("hugepage file {}", e.path().display()));
            }
        }
    }
    let run = PathBuf::from(format!("/var/run/dpdk/spdk_pid{pid}"));
    if run.exists() {
        v.push(format!("DPDK runtime directory {}", run.display()));
    }
    v
}

#[test]
fn a_quick_run_measures_both_targets_and_checks_every_run() {
    let _one = ONE.lock().unwrap_or_else(|p| p.into_inner());
    let json = std::env::temp_dir().join(format!("iopath-bench-spdk-test-{}.json", std::process::id()));
    let t0 = Instant::now();
    let mut child = bench(&["--quick", "--iodepth", "16", "--bs", "4k", "--quiet", "--json"])
        .arg(&json)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Bounded: a cold build of the peers takes about 7 minutes here, the run itself under a minute.
    while child.try_wait().unwrap().is_none() {
        if t0.elapsed() > Duration::from_secs(900) {
            let _ = child.kill();
            let _ = child.wait();
            panic!("iopath bench spdk --quick did not finish within 15 minutes");
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    let out = child.wait_with_output().unwrap();
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "bench spdk failed ({}):\n{stdout}\n{stderr}", out.status);
    let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let _ = std::fs::remove_file(&json);
    assert_eq!(v["benchmark"], "spdk");
    assert!(v["host"]["kernel"].is_string() && v["placement"].as_str().is_some_and(|p| p.contains("pinned")));
    assert_eq!(v["errors"].as_array().map(Vec::len), Some(0), "{}", v["errors"]);
    assert_eq!(v["options"]["rounds"], 1);
    assert_eq!(v["options"]["jobs"][0], serde_json::json!({"rw": "randread", "bs": 4096, "iodepth": 16}));
    let runs = v["runs"].as_array().unwrap();
    let targets: Vec<&str> = runs.iter().filter_map(|r| r["target"].as_str()).collect();
    assert_eq!(targets, ["iopath", "nvmf_tgt"], "round 1 runs iopath first");
    for r in runs {
        let iops = r["perf"]["iops"].as_f64().unwrap();
        let (p50, p99) = (r["perf"]["p50_us"].as_f64().unwrap(), r["perf"]["p99_us"].as_f64().unwrap());
        let d = &r["device"];
        let cmds = d["commands"].as_u64().unwrap();
        assert!(iops > 0.0 && p50 > 0.0 && p50 <= p99, "{r}");
        // The device served at least every I/O perf counted in its 1 s, all reads, no error.
        assert!(cmds as f64 >= iops.floor() && d["reads"] == d["commands"], "{r}");
        assert_eq!((d["writes"].as_u64(), d["errors"].as_u64()), (Some(0), Some(0)), "{r}");
    }
    let s = &v["summary"][0];
    for t in ["iopath", "nvmf_tgt"] {
        assert_eq!(s[t]["rounds"], 1, "{s}");
        assert!(s[t]["iops"]["median"].as_f64().is_some_and(|x| x > 0.0), "{s}");
    }
    let ratio = s["iopath_over_nvmf_tgt"]["iops"].as_f64().unwrap();
    let want = s["iopath"]["iops"]["median"].as_f64().unwrap() / s["nvmf_tgt"]["iops"]["median"].as_f64().unwrap();
    assert!((ratio - want).abs() < 1e-9, "{s}");
    assert!(stdout.contains("iopath/nvmf_tgt") && stdout.contains("randread 4k qd16"), "{stdout}");
    // Nothing left: the servers stopped and every SPDK process's files removed.
    let pids = runs.iter().map(|r| &r["perf_pid"]).chain(v["servers"].as_array().unwrap().iter().map(|s| &s["pid"]));
    let left: Vec<String> = pids.filter_map(|p| p.as_u64()).flat_map(|p| leftovers(p as u32)).collect();
    assert!(left.is_empty(), "{left:?}");
}

#[test]
fn sigint_in_the_middle_of_a_perf_run_leaves_nothing_behind() {
    let _one = ONE.lock().unwrap_or_else(|p| p.into_inner());
    let mut child = bench(&["--rounds", "1", "--runtime", "30", "--iodepth", "16", "--bs", "4k", "--quiet"])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let pid = child.id();
    let t0 = Instant::now();
    // Until the first perf runs (the peers may need building: bounded as above).
    let kids = loop {
        let k = children(pid);
        if k.iter().any(|c| c.comm == "spdk_nvme_perf") {
            break k;
        }
        if let Some(st) = child.try_wait().unwrap() {
            let out = child.wait_with_output().unwrap();
            panic!("the bench ended ({st}) before any perf ran: {}", String::from_utf8_lossy(&out.stderr));
        }
        if t0.elapsed() > Duration::from_secs(900) {
            let _ = child.kill();
            let _ = child.wait();
            panic!("no spdk_nvme_perf under the bench within 15 minutes");
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let names: Vec<&str> = kids.iter().map(|c| c.comm.as_str()).collect();
    assert!(names.len() >= 3, "iopath serve, nvmf_tgt (its reactor) and perf under the bench: {kids:?}");
    // perf is doing I/O by now.
    std::thread::sleep(Duration::from_secs(2));
    // SAFETY: kill(2) on our own child, not yet reaped (its pid cannot name another process).
    unsafe { libc::kill(pid as libc::pid_t, libc::SIGINT) };
    let t1 = Instant::now();
    while child.try_wait().unwrap().is_none() {
        assert!(t1.elapsed() < Duration::from_secs(60), "the bench did not stop within 60 s of SIGINT");
        std::thread::sleep(Duration::from_millis(50));
    }
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(130), "{stderr}");
    assert!(stderr.contains("interrupted"), "{stderr}");
    let left: Vec<String> = kids.iter().flat_map(|c| leftovers(c.pid)).collect();
    assert!(left.is_empty(), "{left:?}");
    let dir = std::env::temp_dir().join(format!("iopath-bench-spdk-{pid}"));
    assert!(!Path::new(&dir).exists(), "{} (its sockets) is still there", dir.display());
}
