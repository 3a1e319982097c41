//! `--output-format json|json+` read by readers of fio's output that are
//! not iopath's: fio's own `fio_jsonplus_clat2csv` (Debian's fio package;
//! it turns json+ `bins` into CSV and `--validate` checks the CSV against
//! the JSON, every bin of every job and direction), and a Python script
//! that reads what fio users' scripts read (`jobs[].read.iops`,
//! `clat_ns.percentile["99.000000"]`, `lat_ns` min/max/mean/stddev) and
//! checks that the figures hold together. A wrong schema fails both.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

const READER: &str = r#"
import json, sys
d = json.load(open(sys.argv[1]))
assert "iopath version" in d and "fio version" not in d, "header"
n = 0
for j in d["jobs"]:
    o = j["job options"]
    bs = int(o["bs"][:-1]) * 1024 if o["bs"].endswith("k") else int(o["bs"])
    for ddir in ("read", "write", "mixed"):
        if ddir not in j:
            continue
        x = j[ddir]
        if x["total_ios"] == 0:
            assert x["iops"] == 0 and "percentile" not in x["clat_ns"], (j["jobname"], ddir)
            continue
        p = x["clat_ns"]["percentile"]
        lat = x["lat_ns"]
        p50, p99 = p["50.000000"], p["99.000000"]
        assert lat["min"] <= p50 <= p99 <= lat["max"], (j["jobname"], lat, p50, p99)
        assert lat["min"] <= lat["mean"] <= lat["max"] and lat["stddev"] >= 0, lat
        assert lat["N"] == x["total_ios"], lat
        assert x["io_bytes"] == x["total_ios"] * bs, (x["io_bytes"], bs)
        assert x["bw"] == x["bw_bytes"] // 1024, x
        # runtime is whole ms, as fio's: a short run's I/Os may differ by half a ms of them
        slack = 0.01 * x["total_ios"] + x["iops"] * 0.0005 + 1
        assert abs(x["iops"] * x["runtime"] / 1000 - x["total_ios"]) <= slack, x
        assert abs(x["bw_bytes"] - x["iops"] * bs) <= 0.01 * x["bw_bytes"] + 1, x
        print(j["jobname"], o["rw"], o["bs"], ddir, "ios=%d" % x["total_ios"], "iops=%.0f" % x["iops"], "p99=%d" % p99)
        n += 1
print("jobs read:", n)
"#;

fn tmp(name: &str) -> common::TempDir {
    common::TempDir::new(&format!("fio-output-{name}"))
}

/// Python reads `file` as fio users' scripts do; the jobs it read.
fn python_reads(file: &Path) -> String {
    let out = Command::new("python3").arg("-c").arg(READER).arg(file).output().expect("python3 is needed");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "the reader refused {}: {text}{}",
        file.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    text
}

/// fio's own json+ reader: CSV per job, then its validation of the CSV
/// against the JSON's bins. Returns the CSV files.
fn clat2csv_reads(file: &Path, dir: &Path, jobs: usize) -> Vec<PathBuf> {
    let tool = ["/usr/bin/fio_jsonplus_clat2csv", "/usr/local/bin/fio_jsonplus_clat2csv"]
        .into_iter()
        .map(PathBuf::from)
        .find(|p| p.is_file())
        .expect("fio_jsonplus_clat2csv (Debian's fio package: apt-get install -y fio) is needed");
    let stub = dir.join("lat.csv");
    for validate in [false, true] {
        let mut c = Command::new("python3");
        c.arg(&tool).arg(file).arg(&stub);
        if validate {
            c.arg("--validate");
        }
        let out = c.output().unwrap();
        let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        assert!(out.status.success(), "fio_jsonplus_clat2csv (validate {validate}): {text}");
        if validate {
            assert_eq!(text.matches("validated").count(), jobs, "{text}");
        }
    }
    (0..jobs).map(|i| dir.join(format!("lat_job{i}.csv"))).collect()
}

/// The last cumulative count of `column` (e.g. "read_clat_ns") in a CSV of clat2csv.
fn csv_total(csv: &Path, column: &str) -> u64 {
    let text = std::fs::read_to_string(csv).unwrap();
    let mut lines = text.lines();
    let head: Vec<&str> = lines.next().unwrap().split(',').map(str::trim).collect();
    let col = head.iter().position(|h| *h == format!("{column}_cumulative")).expect(column);
    lines.filter_map(|l| l.split(',').nth(col).and_then(|v| v.trim().parse::<u64>().ok())).max().unwrap_or(0)
}

fn synthetic(plus: bool) -> iopath_bench::fioout::Output {
    use iopath_bench::fioout::{job, lat_from_hist, Figures, Measured, Output};
    let h = iopath_bench::nvme::LatHist::from_ns_points(&[(800, 10), (1000, 900), (5000, 89), (90_000, 1)], 2_000_000);
    let m = Measured {
        ios: 1000,
        bytes: 1000 * 4096,
        secs: 0.25,
        lat: Some(lat_from_hist(&h, 2_000_000, 790.0, 90_400.0, 1_420.0)),
    };
    let o = [("name", "t"), ("rw", "randread"), ("bs", "4k"), ("iodepth", "1")]
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    Output::new(vec![job("iopath-shm", 0, o, Figures::Read(&m), 0, plus)], false)
}

#[test]
fn fio_readers_read_the_format_and_refuse_a_wrong_one() {
    use iopath_bench::fioout::to_text;
    let d = tmp("synthetic");
    let f = d.join("out.json");
    std::fs::write(&f, to_text(&synthetic(true))).unwrap();
    assert!(python_reads(&f).contains("iopath-shm randread 4k read ios=1000 iops=4000"));
    let csv = clat2csv_reads(&f, &d, 1);
    assert_eq!(csv_total(&csv[0], "read_clat_ns"), 1000);
    assert_eq!(csv_total(&csv[0], "read_lat_ns"), 1000);
    // Wrong schemas: each reader refuses them.
    let good = to_text(&synthetic(true));
    for (what, bad) in [
        ("percentile keys without fio's six decimals", good.replace("\"99.000000\"", "\"99\"")),
        ("lat_ns without N", good.replace("\"N\": 1000", "\"n\": 1000")),
    ] {
        std::fs::write(&f, bad).unwrap();
        let out = Command::new("python3").arg("-c").arg(READER).arg(&f).output().unwrap();
        assert!(!out.status.success(), "the reader took {what}");
    }
    let no_write: serde_json::Value = {
        let mut v: serde_json::Value = serde_json::from_str(&good).unwrap();
        v["jobs"][0].as_object_mut().unwrap().remove("write");
        v
    };
    std::fs::write(&f, no_write.to_string()).unwrap();
    let out =
        Command::new("python3").arg("/usr/bin/fio_jsonplus_clat2csv").arg(&f).arg(d.join("x.csv")).output().unwrap();
    assert!(!out.status.success(), "clat2csv took a job without its write object");
    let _ = std::fs::remove_dir_all(&d);
}

fn iopath(args: &[&str]) -> (String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_iopath")).args(args).output().unwrap();
    let (o, e) = (String::from_utf8_lossy(&out.stdout).into_owned(), String::from_utf8_lossy(&out.stderr).into_owned());
    assert!(out.status.success(), "iopath {args:?}: {}\n{e}", out.status);
    (o, e)
}

#[test]
fn bench_blk_json_plus_is_read_by_fios_tools() {
    common::kvm();
    let targets = ["virtio-exit", "nvme-shm"];
    let (out, _) =
        iopath(&["bench", "blk", "--quick", "--quiet", "--targets", &targets.join(","), "--output-format", "json+"]);
    let v: serde_json::Value = serde_json::from_str(&out).expect("fio's JSON alone on standard output");
    let jobs = v["jobs"].as_array().unwrap();
    assert_eq!(jobs.len(), 8 * targets.len(), "one job per target and job");
    for j in jobs {
        let rw = j["job options"]["rw"].as_str().unwrap();
        let (done, idle) = if rw.contains("read") { ("read", "write") } else { ("write", "read") };
        assert!(j[done]["total_ios"].as_u64().unwrap() > 0, "{j}");
        assert_eq!(j[idle]["total_ios"].as_u64(), Some(0), "{j}");
        assert!(targets.contains(&j["jobname"].as_str().unwrap()));
        assert_eq!(j["iopath rounds"].as_u64(), Some(1));
    }
    let d = tmp("blk");
    let f = d.join("out.json");
    std::fs::write(&f, &out).unwrap();
    println!("{}", python_reads(&f));
    let csv = clat2csv_reads(&f, &d, jobs.len());
    for (j, c) in jobs.iter().zip(&csv) {
        let dir = if j["read"]["total_ios"].as_u64() > Some(0) { "read" } else { "write" };
        assert_eq!(csv_total(c, &format!("{dir}_clat_ns")), j[dir]["total_ios"].as_u64().unwrap());
    }
    let _ = std::fs::remove_dir_all(&d);
}

/// fio's empty object of a direction a job did not run.
fn assert_empty(j: &serde_json::Value, dir: &str) {
    let x = &j[dir];
    assert_eq!(
        (x["total_ios"].as_u64(), x["iops"].as_f64(), x["runtime"].as_u64()),
        (Some(0), Some(0.0), Some(0)),
        "{j}"
    );
    assert!(x["clat_ns"].get("percentile").is_none() && x["clat_ns"].get("bins").is_none(), "{dir}: {j}");
}

/// A direction's figures hold together: percentiles monotone in fio's
/// numeric order, and (json+) its bins hold its every I/O. Its I/Os.
fn assert_direction(j: &serde_json::Value, dir: &str, plus: bool) -> u64 {
    let x = &j[dir];
    let ios = x["total_ios"].as_u64().unwrap();
    assert!(ios > 0 && x["lat_ns"]["N"].as_u64() == Some(ios), "{dir}: {j}");
    let mut p: Vec<(f64, u64)> = x["clat_ns"]["percentile"]
        .as_object()
        .unwrap()
        .iter()
        .map(|(k, v)| (k.parse().unwrap(), v.as_u64().unwrap()))
        .collect();
    p.sort_by(|a, b| a.0.total_cmp(&b.0));
    assert_eq!(p.len(), iopath_bench::fioout::PERCENTILES.len());
    assert!(p.windows(2).all(|w| w[0].1 <= w[1].1), "{dir}: percentiles {p:?}");
    if plus {
        let bins = x["clat_ns"]["bins"].as_object().unwrap();
        assert_eq!(bins.values().map(|c| c.as_u64().unwrap()).sum::<u64>(), ios, "{dir}: bins");
    }
    ios
}

#[test]
fn bench_nvme_json_gives_reads_and_writes_apart_as_fio_does_and_verify_as_mixed() {
    common::kvm();
    let base = ["bench", "nvme", "--quick", "--doorbell", "shm", "--iodepth", "4"];
    let (out, _) = iopath(&[&base[..], &["--quiet", "--rw", "randread", "--output-format", "json+"]].concat());
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let j = &v["jobs"][0];
    assert_eq!((j["jobname"].as_str(), v["jobs"].as_array().unwrap().len()), (Some("iopath-shm"), 1));
    assert_eq!(j["job options"]["iodepth"].as_str(), Some("4"));
    assert_direction(j, "read", true);
    assert_empty(j, "write");
    let d = tmp("nvme");
    let f = d.join("out.json");
    std::fs::write(&f, &out).unwrap();
    assert!(python_reads(&f).contains("iopath-shm randread 4k read ios="));
    let csv = clat2csv_reads(&f, &d, 1);
    assert_eq!(csv_total(&csv[0], "read_lat_ns"), j["read"]["total_ios"].as_u64().unwrap());

    // randrw, 70 % reads: read and write apart, as fio's default reporting; the table (on
    // standard error without --quiet) shows them apart too.
    let (out, table) =
        iopath(&[&base[..], &["--rw", "randrw", "--rwmixread", "70", "--output-format", "json+"]].concat());
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let j = &v["jobs"][0];
    assert!(j.get("mixed").is_none() && j["job options"].get("unified_rw_reporting").is_none(), "{j}");
    assert_eq!(j["job options"]["rwmixread"].as_str(), Some("70"));
    let (reads, writes) = (assert_direction(j, "read", true), assert_direction(j, "write", true));
    // Each I/O a read with probability 0.7: the reads' count within 6 standard deviations.
    let n = (reads + writes) as f64;
    let sd = (n * 0.7 * 0.3).sqrt();
    assert!((reads as f64 - 0.7 * n).abs() <= 6.0 * sd + 1.0, "{reads} reads of {n} I/Os: {:.4}", reads as f64 / n);
    eprintln!("randrw 70: {reads} reads, {writes} writes ({:.4} reads)", reads as f64 / n);
    std::fs::write(&f, &out).unwrap();
    let read = python_reads(&f);
    assert!(
        read.contains("iopath-shm randrw 4k read ios=") && read.contains("iopath-shm randrw 4k write ios="),
        "{read}"
    );
    let csv = clat2csv_reads(&f, &d, 1);
    assert_eq!((csv_total(&csv[0], "read_clat_ns"), csv_total(&csv[0], "write_clat_ns")), (reads, writes));
    // The table's rows under the job's own: each direction's share of the I/Os the JSON counted.
    for (dir, ios) in [("read", reads), ("write", writes)] {
        let head = format!("  {dir} {:.1}%", 100.0 * ios as f64 / n);
        assert!(table.lines().any(|l| l.starts_with(&head) && l.contains("iopath-shm")), "no {head:?} row:\n{table}");
    }

    // randrw, no reads (fio's hyphenated spelling): the read object is fio's empty one.
    let (out, _) =
        iopath(&[&base[..], &["--quiet", "--rw", "randrw", "--rwmix-read", "0", "--output-format", "json"]].concat());
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let j = &v["jobs"][0];
    assert_direction(j, "write", false);
    assert_empty(j, "read");
    assert!(j["write"]["lat_ns"].get("bins").is_none(), "json, not json+");

    // verify: its writes and reads back are phases of one set: one mixed object.
    let (out, _) = iopath(&[&base[..], &["--quiet", "--verify", "--size", "8m", "--output-format", "json"]].concat());
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let j = &v["jobs"][0];
    assert!(j.get("read").is_none() && j["mixed"]["total_ios"].as_u64() > Some(0), "{j}");
    assert_eq!(j["job options"]["unified_rw_reporting"].as_str(), Some("mixed"));
    std::fs::write(&f, &out).unwrap();
    assert!(python_reads(&f).contains("iopath-shm verify 4k mixed ios="));
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn json_to_standard_output_twice_is_refused() {
    let out = Command::new(env!("CARGO_BIN_EXE_iopath"))
        .args(["bench", "blk", "--quick", "--json", "-", "--output-format", "json"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("both write to standard output"));
}
