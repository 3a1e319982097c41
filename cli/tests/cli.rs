//! The command line, end to end on the real /dev/kvm.

use std::process::Command;

fn iopath() -> Command {
    Command::new(env!("CARGO_BIN_EXE_iopath"))
}

#[test]
fn bench_exits_json_has_verified_rows_and_floor_ratios() {
    assert!(std::path::Path::new("/dev/kvm").exists(), "/dev/kvm is missing");
    let out = iopath()
        .args(["bench", "exits", "--rounds", "1", "--batches", "3", "--batch-us", "2000"])
        .args(["--only", "cpuid,outl_to_vmm,mmio-no,portio-wild,doorbell-rtt:shm", "--json", "-"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "iopath failed: {stderr}");
    assert!(stderr.contains("routing"), "the table goes to stderr with --json -: {stderr}");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON on stdout");
    assert!(v["errors"].as_array().unwrap().is_empty(), "{}", v["errors"]);
    assert!(v["host"]["kvm_module"].is_string());
    let rows = v["rows"].as_array().unwrap();
    let names: Vec<&str> = rows.iter().map(|r| r["name"].as_str().unwrap()).collect();
    for want in
        ["cpuid", "outl_to_vmm", "mmio-no-eventfd:pci-mem", "portio-wildcard-eventfd:pci-io", "doorbell-rtt:shm"]
    {
        assert!(names.contains(&want), "row {want} missing from {names:?}");
    }
    for r in rows {
        let io = &r["targets"]["iopath"];
        assert!(io["cycles"]["median"].as_f64().unwrap() > 0.0, "{r}");
        for v in io["routing"].as_array().unwrap() {
            assert_eq!(v["ok"], true, "{r}");
        }
    }
    let outl = rows.iter().find(|r| r["name"] == "outl_to_vmm").unwrap();
    assert!(outl["ratio_iopath_over_floor"].as_f64().unwrap() > 0.0);
    // The raw inputs: every figure can be recomputed from the batches.
    assert_eq!(v["schema_version"], iopath_bench::guard::JSON_SCHEMA_VERSION);
    for r in rows {
        assert_eq!(r["cpl"], 3, "{r}");
        assert!(r["marks"].is_array(), "{r}");
        assert!(r["accesses_per_batch"].as_f64().unwrap() >= 1.0, "{r}");
        let batches = r["targets"]["iopath"]["batches"].as_array().unwrap();
        assert_eq!(batches.len(), 3, "{r}");
        for b in batches {
            assert!(b["cycles"].as_u64().unwrap() > 0 && b["iters"].as_u64().unwrap() > 0, "{b}");
            assert_eq!(b["accesses"], b["iters"], "{b}");
        }
    }
}

#[test]
fn run_and_image_commands_work() {
    let out = iopath().args(["run", "--append", "batches=1 batch_us=200 only=cpuid"]).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("@row name=cpuid"), "{stdout}");
    assert!(stdout.contains("@done rc=0"));
    let path = std::env::temp_dir().join(format!("iopath-image-test-{}.elf", std::process::id()));
    assert!(iopath().args(["image", "--out"]).arg(&path).status().unwrap().success());
    assert_eq!(std::fs::read(&path).unwrap(), iopath_guest::IMAGE);
    let _ = std::fs::remove_file(path);
}

#[test]
fn missing_qemu_is_explained() {
    let out = iopath()
        .args(["bench", "--quick", "--vs", "qemu"])
        .env("PATH", "/nonexistent")
        .env_remove("IOPATH_QEMU")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("apt-get install -y qemu-system-x86"), "{stderr}");
}

/// Runs `iopath ARGS --json -` and returns its JSON, after checking it succeeded.
fn bench_json(args: &[&str]) -> serde_json::Value {
    let out = iopath().args(args).args(["--json", "-"]).output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "iopath {args:?} failed: {stderr}");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON on stdout");
    assert!(v["errors"].as_array().unwrap().is_empty(), "{}", v["errors"]);
    v
}

fn positive(v: &serde_json::Value) -> bool {
    v.as_f64().is_some_and(|x| x > 0.0)
}

#[test]
fn bench_floor_json_has_every_depth_in_every_round() {
    let v = bench_json(&["bench", "floor", "--rounds", "2", "--time-ms", "50"]);
    assert_eq!(v["benchmark"], "floor");
    // Pinned by default where there are two CPUs (`--pin auto`): submitter and poller apart.
    let pinned = std::thread::available_parallelism().map_or(1, |n| n.get()) >= 2;
    let want = if pinned { "pinned: submitter on CPU" } else { "unpinned" };
    assert!(v["placement"].as_str().unwrap().starts_with(want), "{}", v["placement"]);
    let cpus: Vec<&serde_json::Value> = v["runs"].as_array().unwrap().iter().map(|r| &r["cpus"]).collect();
    if pinned {
        assert!(cpus.iter().all(|c| c[0] != c[1]), "pinned apart: {cpus:?}");
    }
    // The wake-up floor of each round: a sleeping thread woken through an eventfd.
    let wake = v["wake"].as_array().unwrap();
    assert_eq!(wake.len(), 2, "{wake:?}");
    assert!(wake.iter().all(|w| positive(&w["p50_ns"]) && w["p50_ns"].as_f64() <= w["p99_ns"].as_f64()), "{wake:?}");
    let off = bench_json(&["bench", "floor", "--rounds", "1", "--time-ms", "20", "--pin", "off"]);
    assert!(off["placement"].as_str().unwrap().starts_with("unpinned"), "{}", off["placement"]);
    let runs = v["runs"].as_array().unwrap();
    let mut seen: Vec<(u64, u64)> =
        runs.iter().map(|r| (r["round"].as_u64().unwrap(), r["qd"].as_u64().unwrap())).collect();
    seen.sort_unstable();
    assert_eq!(seen, [(0, 1), (0, 16), (0, 64), (1, 1), (1, 16), (1, 64)]);
    for r in runs {
        assert!(positive(&r["ops_s"]) && positive(&r["p50_ns"]) && r["ops"].as_u64().unwrap() > 0, "{r}");
        assert_eq!(r["errors"], 0, "{r}");
        assert!(r["max_outstanding"].as_u64().unwrap() <= r["qd"].as_u64().unwrap(), "{r}");
    }
    let summary = v["summary"].as_array().unwrap();
    assert_eq!(summary.len(), 3);
    for s in summary {
        assert!(positive(&s["ops_s"]["median"]) && positive(&s["p50_ns"]["median"]), "{s}");
        assert_eq!(s["ops_s"]["n"], 2, "{s}");
    }
}

#[test]
fn bench_nvme_runs_carry_their_rounds_floor_ratio() {
    assert!(std::path::Path::new("/dev/kvm").exists(), "/dev/kvm is missing");
    let v = bench_json(&["bench", "nvme", "--quick"]);
    let floor = v["floor"]["runs"].as_array().unwrap();
    // The reference jobs' depths, 1 and 16, measured in the (one) round.
    let mut depths: Vec<u64> = floor.iter().map(|r| r["qd"].as_u64().unwrap()).collect();
    depths.sort_unstable();
    assert_eq!(depths, [1, 16], "{}", v["floor"]);
    for f in floor {
        assert!(positive(&f["ops_s"]) && f["round"] == 0, "{f}");
    }
    let runs = v["runs"].as_array().unwrap();
    assert_eq!(runs.len(), 14, "2 jobs x 7 doorbell modes");
    for r in runs {
        assert!(positive(&r["iops"]), "{r}");
        assert!(positive(&r["floor_ratio"]), "every run has IOPS / the floor's ops/s: {r}");
    }
}

#[test]
fn each_bench_subcommand_lists_only_its_own_options() {
    let help = |b: &str| {
        let out = iopath().args(["bench", b, "--help"]).output().unwrap();
        assert!(out.status.success(), "bench {b} --help: {}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8(out.stdout).unwrap()
    };
    let nvme = help("nvme");
    for absent in ["--transports", "--batches", "--only", "--batch-us", "--no-floor"] {
        assert!(!nvme.contains(absent), "bench nvme --help lists {absent}:\n{nvme}");
    }
    for present in ["--bs", "--iodepth", "--numjobs", "--runtime", "--thinktime", "--quiet"] {
        assert!(nvme.contains(present), "bench nvme --help lacks {present}:\n{nvme}");
    }
    let floor = help("floor");
    for absent in ["--vs", "--doorbell", "--transports", "--bs"] {
        assert!(!floor.contains(absent), "bench floor --help lists {absent}:\n{floor}");
    }
    let exits = help("exits");
    for absent in ["--bs", "--doorbell", "--time-ms", "--pollers"] {
        assert!(!exits.contains(absent), "bench exits --help lists {absent}:\n{exits}");
    }
}

#[test]
fn quick_with_an_explicit_runtime_is_refused_not_overridden() {
    // Before: --quick silently replaced --time 3 by 0.5 s.
    for args in [
        &["nvme", "--quick", "--time", "3"][..],
        &["nvme", "--quick", "--rounds", "2"],
        &["exits", "--quick", "--rounds", "2"],
    ] {
        let out = iopath().arg("bench").args(args).output().unwrap();
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains("cannot be used with"), "{args:?}: {stderr}");
    }
}

#[test]
fn fio_sizes_and_names_reach_the_job() {
    // --bs 4k --numjobs 2 (fio's names and suffixes) run as bs=4096 queues=2.
    let v = bench_json(&[
        "bench",
        "nvme",
        "--quick",
        "--quiet",
        "--backend",
        "null",
        "--doorbell",
        "shm",
        "--rw",
        "randread",
        "--bs",
        "4k",
        "--iodepth",
        "2",
        "--numjobs",
        "2",
    ]);
    let job = &v["options"]["jobs"][0];
    assert_eq!(
        (job["bs"].as_u64(), job["queues"].as_u64(), job["iodepth"].as_u64()),
        (Some(4096), Some(2), Some(2)),
        "{job}"
    );
    assert!(positive(&v["runs"][0]["iops"]), "{}", v["runs"]);
}

/// Lines of `text` that contain `what`, and how often `what` occurs in all.
fn occurrences(text: &str, what: &str) -> (usize, usize) {
    (text.lines().filter(|l| l.contains(what)).count(), text.matches(what).count())
}

/// Each error is printed once: the error types put their source in their own text, which an
/// error chain printed cause by cause repeated ("... (os error 2): No such file or directory
/// (os error 2)"), and a device process that died was logged by the VMM, then printed again.
#[test]
fn an_error_is_printed_once() {
    let dir = std::env::temp_dir().join(format!("iopath-once-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let missing = dir.join("missing").join("x");
    let m = missing.to_str().unwrap();
    let cases: [(Vec<String>, &str); 5] = [
        (
            vec!["serve".into(), "nvme".into(), "--transport".into(), "vfio-user".into(), "--socket".into(), m.into()],
            "No such file",
        ),
        (
            vec![
                "serve".into(),
                format!("nvme,backend=file:{m}"),
                "--transport".into(),
                "vfio-user".into(),
                "--socket".into(),
                dir.join("s").to_str().unwrap().into(),
            ],
            "does not exist; add create=on",
        ),
        (vec!["run".into(), "--device".into(), format!("nvme,backend=file:{m}")], "does not exist; add create=on"),
        (
            vec!["run".into(), "--device".into(), format!("virtio-blk,backend=file:{m}@vfio-user")],
            "does not exist; add create=on",
        ),
        (vec!["run".into(), "--device".into(), format!("pci-testdev@vfio-user:{m}")], "No such file"),
    ];
    for (args, what) in cases {
        let out = iopath().args(&args).output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        assert_eq!(occurrences(&stderr, what), (1, 1), "{args:?} printed {what:?} more than once:\n{stderr}");
    }
    // A device process that dies during the run: the run stops with that error, printed once.
    assert!(std::path::Path::new("/dev/kvm").exists(), "/dev/kvm is missing");
    let sock = dir.join("td.sock");
    let mut serve =
        iopath().args(["serve", "pci-testdev", "--transport", "vfio-user", "--socket"]).arg(&sock).spawn().unwrap();
    let t0 = std::time::Instant::now();
    while !sock.exists() {
        assert!(t0.elapsed() < std::time::Duration::from_secs(10), "no socket");
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let run = iopath()
        .args(["run", "--device"])
        .arg(format!("pci-testdev@vfio-user:{}", sock.display()))
        .args(["--append", "batches=100000 batch_us=20000"])
        .stderr(std::process::Stdio::piped())
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    std::thread::sleep(std::time::Duration::from_millis(1500));
    serve.kill().unwrap();
    let _ = serve.wait();
    let out = run.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert_eq!(occurrences(&stderr, "closed its socket"), (1, 1), "the device process's end, once:\n{stderr}");
    let _ = std::fs::remove_dir_all(&dir);
}
