//! The report from synthetic documents: no KVM.

use super::*;

fn ns(m: f64) -> Value {
    json!({"median": m, "min": m * 0.9, "max": m * 1.2, "n": 5})
}

fn exits_doc() -> Value {
    let row = |name: &str, targets: &[(&str, f64)]| {
        let t: serde_json::Map<String, Value> =
            targets.iter().map(|(k, v)| (k.to_string(), json!({"ns": ns(*v), "cycles": ns(*v * 2.6)}))).collect();
        json!({"name": name, "group": "g", "targets": t})
    };
    json!({
        "benchmark": "exits", "schema_version": 1,
        "host": {"cpu": "Test CPU 9000", "cpus": 2, "kernel": "6.1.0-test", "kvm_module": "kvm_pvm", "nested": true, "tsc_khz": 2_600_000},
        "options": {"transports": ["mpqemu", "vfio-user", "ioregionfd"]},
        "rows": [
            row("mmio-no-eventfd:pci-mem", &[("iopath", 30_000.0), ("qemu", 35_000.0), ("mpqemu", 60_000.0), ("vfio-user", 55_000.0), ("ioregionfd", 50_000.0)]),
            row("mmio-wildcard-eventfd:pci-mem", &[("iopath", 3_000.0)]),
            row("outl_to_kernel", &[("iopath", 4_000.0)]),
            row("doorbell-rtt:shm", &[("iopath", 110.0)]),
        ],
        "out_of_process": {"socket_round_trip": {"vfio-user": {"ns": ns(13_500.0), "batches": 5}}},
        "errors": [],
    })
}

fn nvme_doc() -> Value {
    let jobs: Vec<Value> = [1, 4, 16]
        .iter()
        .map(|qd| json!({"rw": "randread", "bs": 512, "iodepth": qd, "queues": 1, "verify": false, "thinktime_us": 0}))
        .collect();
    let mut runs = Vec::new();
    for (ji, qd) in [1.0, 4.0, 16.0].iter().enumerate() {
        for (t, k) in [("iopath-shm", 1.0), ("iopath-ioeventfd", 0.5), ("iopath-shm@vfio-user", 0.8), ("qemu", 0.3)] {
            for round in 0..2 {
                runs.push(json!({
                    "target": t, "job": ji, "round": round, "iops": 100_000.0 * qd * k + round as f64,
                    "p50_ns": 2000.0 * qd / k, "p99_ns": 5000.0 * qd / k, "exits_per_io": 0.0,
                    "hist": [[1000, 10], [2000, 50], [4000, 30], [8000, 10]],
                }));
            }
        }
    }
    json!({"benchmark": "nvme", "schema_version": 1, "options": {"jobs": jobs}, "runs": runs, "errors": ["one bad run"]})
}

fn floor_doc() -> Value {
    json!({"benchmark": "floor", "schema_version": 1, "summary": [
        {"qd": 1, "ops_s": ns(5e6), "p50_ns": ns(180.0)},
        {"qd": 16, "ops_s": ns(2e7), "p50_ns": ns(700.0)},
    ], "errors": []})
}

fn input() -> Input {
    Input {
        meta: Meta { version: "0.1.0 (abc1234)".into(), qemu: "QEMU emulator version 7.2.0".into(), ..Meta::default() },
        docs: vec![exits_doc(), nvme_doc(), floor_doc()],
        tables: vec![("floor".into(), "qd ops/s\n1 5.0M\n".into())],
    }
}

/// The SVG parses as XML and its text elements hold every name given.
fn svg_holds(svg: &str, names: &[&str]) {
    let doc = roxmltree::Document::parse(svg).unwrap_or_else(|e| panic!("not XML: {e}\n{svg}"));
    assert_eq!(doc.root_element().tag_name().name(), "svg");
    let texts: Vec<&str> = doc.descendants().filter(|n| n.has_tag_name("text")).filter_map(|n| n.text()).collect();
    for n in names {
        assert!(texts.iter().any(|t| t.contains(n)), "{n:?} not among the SVG's texts {texts:?}");
    }
}

#[test]
fn plots_are_svg_with_their_series() {
    let r = render(&input());
    let names: Vec<&str> = r.svgs.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(
        names,
        [
            "cost-per-path.svg",
            "iops-vs-iodepth-vmm.svg",
            "iops-vs-iodepth-vfio-user.svg",
            "p99-vs-iodepth-vmm.svg",
            "p99-vs-iodepth-vfio-user.svg",
            "cdf-randread-512-qd1-x1-vmm.svg",
            "cdf-randread-512-qd1-x1-vfio-user.svg",
            "cdf-randread-512-qd4-x1-vmm.svg",
            "cdf-randread-512-qd4-x1-vfio-user.svg",
            "cdf-randread-512-qd16-x1-vmm.svg",
            "cdf-randread-512-qd16-x1-vfio-user.svg"
        ]
    );
    let svg = |n: &str| &r.svgs.iter().find(|(m, _)| m == n).unwrap().1;
    svg_holds(
        svg("cost-per-path.svg"),
        &[
            "exit (iopath VMM)",
            "exit (QEMU)",
            "ioeventfd",
            "in-kernel",
            "mpqemu (device process)",
            "vfio-user (device process)",
            "ioregionfd (device process)",
            "shm doorbell",
        ],
    );
    // In the VMM with QEMU, over vfio-user apart; the CDFs hold every target.
    for n in ["iops-vs-iodepth-vmm.svg", "p99-vs-iodepth-vmm.svg"] {
        svg_holds(svg(n), &["iopath-shm", "iopath-ioeventfd", "qemu", "in the VMM"]);
        assert!(!svg(n).contains("@vfio-user"), "{n}");
    }
    svg_holds(svg("iops-vs-iodepth-vfio-user.svg"), &["iopath-shm@vfio-user", "over vfio-user"]);
    svg_holds(svg("cdf-randread-512-qd16-x1-vmm.svg"), &["iopath-shm", "iopath-ioeventfd", "qemu", "in the VMM"]);
    svg_holds(svg("cdf-randread-512-qd16-x1-vfio-user.svg"), &["iopath-shm@vfio-user", "over vfio-user"]);
}

#[test]
fn csv_has_one_row_per_figure() {
    let r = render(&input());
    let lines: Vec<&str> = r.csv.lines().collect();
    assert_eq!(lines[0], "bench,row,metric,median,min,max,unit");
    assert!(lines.contains(&"exits,mmio-no-eventfd:pci-mem @ iopath,ns_per_access,30000,27000,36000,ns"), "{}", r.csv);
    assert!(lines.contains(&"exits,socket round trip vfio-user,round_trip,13500,12150,16200,ns"));
    assert!(lines.contains(&"floor,ring qd16,ops_s,20000000,18000000,24000000,ops/s"));
    // Two rounds of iopath-shm at qd 4: 400000 and 400001.
    assert!(lines.contains(&"nvme,iopath-shm randread 512 qd4 x1,iops,400000.5,400000,400001,IOPS"), "{}", r.csv);
    assert!(lines.iter().all(|l| l.split(',').count() == 7), "a field needs quoting:\n{}", r.csv);
    // 4 exits rows x targets x 2 metrics + 1 rtt, 12 nvme groups x 4 metrics present, 2 x 2 floor.
    assert_eq!(lines.len() - 1, 8 * 2 + 1 + 12 * 4 + 4);
}

#[test]
fn markdown_has_host_tables_plots_errors_and_labelled_seeds() {
    let r = render(&input());
    let m = &r.markdown;
    for want in [
        "| CPU | Test CPU 9000 (2 CPUs) |",
        "| KVM | kvm_pvm (nested: this host is itself a VM)",
        "| iopath | 0.1.0 (abc1234) |",
        "| QEMU | QEMU emulator version 7.2.0 |",
        "- nvme: one bad run",
        "![cost-per-path.svg](cost-per-path.svg)",
        "| exit (iopath VMM) | 30.00 us | 27.00 us | 36.00 us |",
        "**Other hardware",
        "https://safl.dk/notebook/exploration/vfio_user.html",
        "| iopath-shm randread 512 qd16 x1 | iops | 1.60 MIOPS |",
        "## Ring floor",
        "qd ops/s\n1 5.0M",
    ] {
        assert!(m.contains(want), "{want:?} missing from:\n{m}");
    }
    // Ours over the published 4.3 M: the best vfio-user median, 1280000.5 IOPS.
    assert!(m.contains("| 4.30 MIOPS | 1.28 MIOPS (iopath-shm@vfio-user randread 512 qd16 x1) | 0.30x |"), "{m}");
    // ioregionfd over mpqemu: 60 us / 50 us.
    assert!(m.contains("| 1.20x (mpqemu ns / ioregionfd ns per MMIO write) |"), "{m}");
    assert_eq!(r.json["schema_version"], crate::guard::JSON_SCHEMA_VERSION);
    assert_eq!(r.json["benchmarks"].as_array().unwrap().len(), 3);
}

#[test]
fn missing_pieces_give_a_smaller_report_not_a_panic() {
    // No documents at all; documents of the wrong shape; a hist of garbage.
    for docs in [
        vec![],
        vec![
            json!({"benchmark": "exits", "rows": 5}),
            json!({"benchmark": "nvme", "runs": [{"hist": [["x", -1], [1], null]}]}),
            json!(null),
        ],
    ] {
        let r = render(&Input { docs, ..Input::default() });
        assert!(r.svgs.is_empty());
        assert_eq!(r.csv.lines().count(), 1);
        assert!(r.markdown.contains("## Host"));
    }
}

#[test]
fn write_puts_every_file_in_the_directory() {
    let dir = std::env::temp_dir().join(format!("iopath-report-test-{}", std::process::id()));
    let files = write(&dir, &render(&input())).unwrap();
    for f in ["report.md", "results.json", "results.csv", "cost-per-path.svg"] {
        assert!(files.contains(&dir.join(f)), "{f}");
        assert!(std::fs::metadata(dir.join(f)).unwrap().len() > 0);
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn cpl_rows_are_told_apart_and_marks_are_listed() {
    let mut i = input();
    let rows = i.docs[0]["rows"].as_array_mut().unwrap();
    rows[0]["cpl"] = json!(3);
    let mut cpl0 = rows[0].clone();
    cpl0["cpl"] = json!(0);
    cpl0["targets"]["iopath"]["ns"] = ns(9_000.0);
    cpl0["marks"] = json!([{"kind": "below_floor", "ratio": 0.8, "floor": "floor"}]);
    rows.insert(0, cpl0);
    i.docs[1]["runs"][0]["marks"] = json!([{"kind": "spread", "max_over_min": 2.5}]);
    let r = render(&i);
    // The cost plot and table take the CPL3 row; the CSV has both.
    assert!(r.markdown.contains("| exit (iopath VMM) | 30.00 us |"), "{}", r.markdown);
    assert!(r.csv.contains("exits,mmio-no-eventfd:pci-mem cpl0 @ iopath,ns_per_access,9000,"), "{}", r.csv);
    assert!(r.csv.contains("exits,mmio-no-eventfd:pci-mem cpl3 @ iopath,ns_per_access,30000,"));
    for want in [
        "## Marked figures",
        "| exits | mmio-no-eventfd:pci-mem cpl0 | below_floor floor=floor ratio=0.80 |",
        "| nvme | iopath-shm randread 512 qd1 x1 round 0 | spread max_over_min=2.50 |",
    ] {
        assert!(r.markdown.contains(want), "{want:?} missing from:\n{}", r.markdown);
    }
}

#[test]
fn results_json_renders_the_same_report_again() {
    let first = render(&input());
    let again = render(&Input::from_results(&first.json));
    assert_eq!(again.markdown, first.markdown);
    assert_eq!(again.csv, first.csv);
    assert_eq!(again.svgs, first.svgs);
    // Not a results.json at all: an empty report, no panic.
    assert!(render(&Input::from_results(&json!([1, 2]))).svgs.is_empty());
}
