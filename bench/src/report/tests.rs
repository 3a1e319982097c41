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
            "latency-vs-iodepth-vmm.svg",
            "latency-vs-iodepth-vfio-user.svg",
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
    for n in ["iops-vs-iodepth-vmm.svg", "latency-vs-iodepth-vmm.svg"] {
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
    assert_eq!(lines[0], "bench,row,metric,median,min,max,unit,mark");
    assert!(lines.contains(&"exits,mmio-no-eventfd:pci-mem @ iopath,ns_per_access,30000,27000,36000,ns,"), "{}", r.csv);
    assert!(lines.contains(&"exits,socket round trip vfio-user,round_trip,13500,12150,16200,ns,"));
    assert!(lines.contains(&"floor,ring qd16,ops_s,20000000,18000000,24000000,ops/s,"));
    // Two rounds of iopath-shm at qd 4: 400000 and 400001.
    assert!(lines.contains(&"nvme,iopath-shm randread 512 qd4 x1,iops,400000.5,400000,400001,IOPS,"), "{}", r.csv);
    assert!(lines.iter().all(|l| l.split(',').count() == 8), "a field needs quoting:\n{}", r.csv);
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
        "| exit (iopath VMM) | 30.00 us | 27.00 us | 36.00 us |  |",
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
        "| exits | mmio-no-eventfd:pci-mem cpl0 | bench: below_floor floor=floor ratio=0.80 |",
        "| nvme | iopath-shm randread 512 qd1 x1 round 0 | bench: spread max_over_min=2.50 |",
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

fn blk_doc() -> Value {
    let rec = |t: &str, ji: usize, job: &str, mb: f64, p50: f64| {
        let round =
            |k: f64| json!({"mb_s": mb * k, "iops": mb * k * 256.0, "p50_ns": p50 * k, "p99_ns": p50 * k * 3.0});
        json!({"target": t, "job": job, "job_index": ji, "mb_s": mb, "iops": mb * 256.0, "p50_ns": p50,
               "p99_ns": p50 * 3.0, "exits_per_io": 0.0, "ratio": 1.0, "routing_ok": true,
               "rounds": [round(0.95), round(1.05)]})
    };
    json!({
        "benchmark": "blk", "schema_version": 3,
        "options": {"backend": "null", "targets": ["virtio-blk", "nvme-shm", "vhost-user-blk"], "reference": "virtio-blk",
                    "tput_bs": 131072, "tput_qd": 16, "lat_bs": 4096, "time_ms": 1000, "rounds": 2, "size_mb": 64},
        "jobs": [{"name": "seqread", "measure": "throughput"}, {"name": "randread", "measure": "latency"}],
        "records": [
            rec("virtio-blk", 0, "seqread", 26_000.0, 0.0), rec("nvme-shm", 0, "seqread", 384_309.0, 0.0),
            rec("virtio-blk", 1, "randread", 0.0, 30_000.0), rec("nvme-shm", 1, "randread", 0.0, 4_000.0),
        ],
        "failures": [{"target": "vhost-user-blk", "job": "seqread", "round": 0, "error": "socket closed"}],
        "not_run": [],
        "errors": [],
    })
}

/// The fixture with every bench, a KVM_RUN floor, a failed NVMe target and a null-backend blk run.
fn full_input() -> Input {
    let mut i = input();
    i.docs[0]["rows"][0]["targets"]["floor"] = json!({"ns": ns(2_850.0)});
    i.docs[1]["errors"] = json!(["iopath-mmio randread 512 qd1 x1 round 0: guest exit status 3 (no device)"]);
    i.docs.push(blk_doc());
    i
}

/// The texts of an SVG with their extent: every one inside the picture,
/// by a generous width estimate (plot::text_width), rotated ones too.
fn texts_inside(name: &str, svg: &str) -> Vec<String> {
    let doc = roxmltree::Document::parse(svg).unwrap_or_else(|e| panic!("{name}: not XML: {e}"));
    let root = doc.root_element();
    let (w, h): (f64, f64) =
        (root.attribute("width").unwrap().parse().unwrap(), root.attribute("height").unwrap().parse().unwrap());
    let mut out = Vec::new();
    for t in doc.descendants().filter(|n| n.has_tag_name("text")) {
        let text = t.text().unwrap_or("").trim().to_string();
        let num = |k: &str| t.attribute(k).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
        let (x, y, size) = (num("x"), num("y"), num("font-size"));
        let len = plot::text_width(text.chars().count(), size);
        let (a, b) = match t.attribute("text-anchor") {
            Some("middle") => (-len / 2.0, len / 2.0),
            Some("end") => (-len, 0.0),
            _ => (0.0, len),
        };
        if t.attribute("transform").is_some_and(|r| r.starts_with("rotate(270")) {
            // Rotated a quarter turn: the text runs upwards from y.
            assert!(y - b >= 0.0 && y - a <= h && x >= 0.0, "{name}: {text:?} at y {y} leaves the {h} px height");
        } else {
            assert!(x + a >= 0.0 && x + b <= w, "{name}: {text:?} spans {:.0}..{:.0}, outside 0..{w}", x + a, x + b);
            assert!(y >= 0.0 && y <= h, "{name}: {text:?} at y {y}, outside 0..{h}");
        }
        out.push(text);
    }
    out
}

#[test]
fn every_plot_says_its_units_floors_failures_and_keeps_its_labels_inside() {
    let r = render(&full_input());
    let svg = |n: &str| &r.svgs.iter().find(|(m, _)| m == n).unwrap_or_else(|| panic!("{n} not drawn")).1;
    for (n, s) in &r.svgs {
        texts_inside(n, s);
    }
    let has = |n: &str, want: &[&str]| {
        let t = texts_inside(n, svg(n));
        for w in want {
            assert!(t.iter().any(|x| x.contains(w)), "{n}: {w:?} not among {t:?}");
        }
    };
    // 99 ns .. 72 µs spans decades: a log axis of dots, in µs, with the KVM_RUN floor drawn.
    has(
        "cost-per-path.svg",
        &[
            "time per access, µs (log scale)",
            "dot: median",
            "KVM_RUN floor (same run): 2.85 µs",
            "30.00 µs",
            "one round trip",
        ],
    );
    assert!(!svg("cost-per-path.svg").contains("<rect x=\"2"), "no bars on a log axis");
    // IOPS from 30 k to 1.6 M: log y; the failed target listed; the ring floor drawn.
    has(
        "iops-vs-iodepth-vmm.svg",
        &[
            "IOPS (log scale)",
            "iodepth, I/Os in flight (log scale)",
            "iopath-mmio: failed (no figures)",
            "ring floor (same run)",
            "qemu",
        ],
    );
    // Latency: p50 with p99 whiskers, in µs.
    has(
        "latency-vs-iodepth-vmm.svg",
        &[
            "I/O latency, submission to completion, µs (log scale)",
            "dot: p50, whisker: up to p99",
            "ring floor (same run)",
        ],
    );
    has("cdf-randread-512-qd1-x1-vmm.svg", &["I/O latency, µs (log scale)", "share of I/Os done within it, fraction"]);
    // blk: a null backend moved no data; a failed target says so; latency p50..p99 over the shm floor.
    has(
        "blk-throughput-seqread.svg",
        &["no data moved", "throughput the guest saw, MB/s (log scale)", "vhost-user-blk", "failed", "384309 MB/s"],
    );
    has("blk-latency-randread.svg", &["I/O latency, µs (log scale)", "p50..p99", "shm round trip floor (same run)"]);
    // Only a run's own failure names a failed series: not the wake or guest line floors, nor fio's rows.
    let mut i = full_input();
    i.docs[1]["errors"] = json!([
        "iopath-mmio randread 512 qd1 x1 round 0: guest exit status 3 (no device)",
        "wake round 0: timed out",
        "guest line floor before iopath-ioeventfd round 1: guest exit status 3",
        "fio-libaio randread 512 qd1 x1 round 0: fio missing",
    ]);
    let figs = figures(&i);
    let vmm = by_iodepth(&i, &figs, "iops", None).into_iter().find(|p| p.0 == "vmm").unwrap().2;
    let failed: Vec<&str> = vmm.iter().filter(|s| s.failed).map(|s| s.name.as_str()).collect();
    assert_eq!(failed, ["iopath-mmio"]);
    // The nvme transports' plots, the blk ones, the CDFs: each drawn once.
    assert_eq!(r.svgs.len(), 13, "{:?}", r.svgs.iter().map(|x| &x.0).collect::<Vec<_>>());
}

#[test]
fn the_issues_one_round_6_56_ms_round_trip_is_marked_everywhere() {
    let mut i = full_input();
    // One round of the shm round trip at 6.56 ms: no spread check can fire.
    i.docs[0]["rows"][3]["targets"]["iopath"] = json!({"ns": {"median": 6.56e6, "min": 6.56e6, "max": 6.56e6}, "rounds": 1, "per_round_median_cycles": [17.0e6]});
    let r = render(&i);
    let mark = "!unguarded (1 round)";
    assert!(
        r.csv.contains(&format!("exits,doorbell-rtt:shm @ iopath,ns_per_access,6560000,6560000,6560000,ns,{mark}")),
        "{}",
        r.csv
    );
    for want in [
        format!("| shm doorbell round trip | 6.56 ms | 6.56 ms | 6.56 ms | {mark} |"),
        format!("| exits | doorbell-rtt:shm @ iopath ns_per_access | {mark} |"),
        format!("| doorbell-rtt:shm @ iopath | ns_per_access | 6.56 ms | 6.56 ms | 6.56 ms | {mark} |"),
    ] {
        assert!(r.markdown.contains(&want), "{want:?} missing from:\n{}", r.markdown);
    }
    // The earlier measurement's row compares a marked figure with its mark.
    assert!(
        r.markdown.contains(&format!("| 6.56 ms (doorbell-rtt:shm @ iopath; {mark}) | 61023.26x |")),
        "{}",
        r.markdown
    );
    let cost = &r.svgs.iter().find(|(n, _)| n == "cost-per-path.svg").unwrap().1;
    assert!(texts_inside("cost-per-path.svg", cost).iter().any(|t| t == &format!("6.56 ms {mark}")));

    // Three rounds, one of them 6.56 ms among ~107 ns: that round is marked.
    i.docs[0]["rows"][3]["targets"]["iopath"] = json!({"ns": {"median": 109.8, "min": 107.5, "max": 6.56e6},
        "rounds": 3, "per_round_median_cycles": [279.5, 17.06e6, 285.5]});
    let r = render(&i);
    assert!(
        r.csv.contains(
            "exits,doorbell-rtt:shm @ iopath,ns_per_access,109.8,107.5,6560000,ns,!round 2 59755x the others"
        ),
        "{}",
        r.csv
    );
    assert!(r
        .markdown
        .contains("| shm doorbell round trip | 109.8 ns | 107.5 ns | 6.56 ms | !round 2 59755x the others |"));
}

#[test]
fn figures_below_a_same_run_floor_are_marked_in_csv_report_and_plots() {
    let mut i = full_input();
    // qemu's p50 at qd1 (both rounds) under the 110 ns shm round trip; the ring floor at qd1 slower than nvme.
    for r in i.docs[1]["runs"].as_array_mut().unwrap() {
        if r["target"] == "qemu" && r["job"] == 0 {
            r["p50_ns"] = json!(50.0);
        }
    }
    i.docs[2]["summary"][0]["ops_s"] = ns(50_000.0);
    let r = render(&i);
    let line = |row: &str, metric: &str| {
        r.csv
            .lines()
            .find(|l| l.starts_with(&format!("nvme,{row},{metric},")))
            .unwrap_or_else(|| panic!("{row} {metric}"))
            .to_string()
    };
    // 50 ns: under the shm round trip (110 ns) and the ring floor's p50 (180 ns) both.
    assert!(
        line("qemu randread 512 qd1 x1", "p50_latency")
            .ends_with(",ns,!0.45x of shm round trip floor; !0.28x of ring floor qd1"),
        "{}",
        r.csv
    );
    // 100 k IOPS against a ring floor of 50 k ops/s: a cost of 0.5x the floor's.
    assert!(line("iopath-shm randread 512 qd1 x1", "iops").ends_with(",IOPS,!0.50x of ring floor qd1"), "{}", r.csv);
    assert!(line("iopath-shm randread 512 qd4 x1", "iops").ends_with(",IOPS,"), "no floor at qd4");
    assert!(
        r.markdown.contains("| nvme | qemu randread 512 qd1 x1 p50_latency | !0.45x of shm round trip floor; "),
        "{}",
        r.markdown
    );
    for n in ["latency-vs-iodepth-vmm.svg", "iops-vs-iodepth-vmm.svg"] {
        let svg = &r.svgs.iter().find(|(m, _)| m == n).unwrap().1;
        assert!(texts_inside(n, svg).iter().any(|t| t == "ringed: marked, see report.md"), "{n}");
    }
    // One round of a blk record is unguarded; the CSV says so.
    let mut i = full_input();
    i.docs[3]["records"][0]["rounds"] = json!([{"mb_s": 26_000.0}]);
    let r = render(&i);
    assert!(r.csv.contains("blk,virtio-blk seqread,mb_s,26000,26000,26000,MB/s,!unguarded (1 round)"), "{}", r.csv);
}

/// Writes the fixture's report to $IOPATH_REPORT_DUMP (to look at the plots); nothing without it.
#[test]
fn dump_the_fixtures_report_when_asked() {
    if let Some(dir) = std::env::var_os("IOPATH_REPORT_DUMP") {
        write(std::path::Path::new(&dir), &render(&full_input())).unwrap();
    }
}
