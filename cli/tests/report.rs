//! `iopath bench all`: the whole pipeline on the real /dev/kvm, on the smoke
//! matrix (a few exit rows over one transport, two NVMe modes at two depths).

use std::process::Command;

#[test]
fn bench_all_writes_a_report_with_tables_csv_json_and_plots() {
    assert!(std::path::Path::new("/dev/kvm").exists(), "/dev/kvm is missing");
    let dir = std::env::temp_dir().join(format!("iopath-bench-all-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let out = Command::new(env!("CARGO_BIN_EXE_iopath"))
        .args(["bench", "all", "--quick", "--smoke", "--no-qemu", "--quiet", "--out"])
        .arg(&dir)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    let md = std::fs::read_to_string(dir.join("report.md")).unwrap_or_default();
    assert!(out.status.success(), "bench all failed: {stderr}\n{md}");
    assert!(out.stdout.is_empty(), "--quiet printed: {}", String::from_utf8_lossy(&out.stdout));

    let json: serde_json::Value = serde_json::from_slice(&std::fs::read(dir.join("results.json")).unwrap()).unwrap();
    assert!(json["schema_version"].is_u64());
    let benches: Vec<&str> =
        json["benchmarks"].as_array().unwrap().iter().map(|d| d["benchmark"].as_str().unwrap()).collect();
    assert_eq!(benches, ["exits", "floor", "nvme", "blk"]);

    let csv = std::fs::read_to_string(dir.join("results.csv")).unwrap();
    assert!(csv.starts_with("bench,row,metric,median,min,max,unit,mark\n"));
    for want in [
        // bench all runs the exit rows at ring 3 and ring 0 (the device processes at 3).
        "exits,mmio-no-eventfd:pci-mem cpl3 @ iopath,ns_per_access,",
        "exits,mmio-no-eventfd:pci-mem cpl0 @ iopath,ns_per_access,",
        "exits,mmio-no-eventfd:pci-mem cpl3 @ vfio-user,ns_per_access,",
        "floor,ring qd16,ops_s,",
        "nvme,iopath-shm@vfio-user randread 512 qd16 x1,iops,",
        "blk,virtio-ioeventfd seq read 128k qd16,mb_s,",
        "blk,virtio-exit rand write 4k qd1,p99_latency,",
    ] {
        assert!(csv.lines().any(|l| l.starts_with(want)), "{want} missing from:\n{csv}");
    }

    for want in [
        "## Host",
        "kvm_",
        "## Cost per path",
        "## Published figures beside ours",
        "**Other hardware",
        "## Exits",
        "## NVMe",
        "## Ring floor",
        "## Block paths",
        "vfio (device assignment)",
    ] {
        assert!(md.contains(want), "{want} missing from report.md:\n{md}");
    }
    for svg in [
        "cost-per-path.svg",
        "iops-vs-iodepth-vmm.svg",
        "latency-vs-iodepth-vmm.svg",
        "iops-vs-iodepth-vfio-user.svg",
        "blk-throughput-seq-read-128k-qd16.svg",
    ] {
        let text = std::fs::read_to_string(dir.join(svg)).unwrap_or_else(|e| panic!("{svg}: {e}"));
        roxmltree::Document::parse(&text).unwrap_or_else(|e| panic!("{svg} is not XML: {e}"));
        assert!(md.contains(&format!("]({svg})")), "report.md does not show {svg}");
    }
    // Every plot renders to PNG with an independent SVG renderer (librsvg), so an image a
    // viewer cannot draw fails here (to look at them, run `iopath bench all --quick --out DIR` and
    // `rsvg-convert` by hand: this directory goes at the end).
    let mut rendered = 0;
    for e in std::fs::read_dir(&dir).unwrap() {
        let svg = e.unwrap().path();
        if svg.extension().is_none_or(|x| x != "svg") {
            continue;
        }
        let png = svg.with_extension("png");
        let r = Command::new("rsvg-convert")
            .arg("-o")
            .arg(&png)
            .arg(&svg)
            .output()
            .unwrap_or_else(|e| panic!("rsvg-convert (librsvg2-bin; harness/test.sh installs it): {e}"));
        assert!(r.status.success(), "{}: {}", svg.display(), String::from_utf8_lossy(&r.stderr));
        let bytes = std::fs::read(&png).unwrap();
        assert!(bytes.starts_with(b"\x89PNG") && bytes.len() > 2000, "{}: no PNG drawn", png.display());
        rendered += 1;
    }
    assert!(rendered >= 5, "{rendered} plots rendered");
    // `iopath report` renders the same report again from results.json.
    let again = dir.join("again");
    let out = Command::new(env!("CARGO_BIN_EXE_iopath"))
        .args(["report", "--from"])
        .arg(dir.join("results.json"))
        .arg("--out")
        .arg(&again)
        .output()
        .unwrap();
    assert!(out.status.success(), "iopath report: {}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(std::fs::read_to_string(again.join("report.md")).unwrap(), md);
    assert_eq!(std::fs::read_to_string(again.join("results.csv")).unwrap(), csv);
    let _ = std::fs::remove_dir_all(&dir);
}
