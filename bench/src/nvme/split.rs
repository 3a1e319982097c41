//! A randrw run's reads and writes apart. The guest prints, after its run's
//! own record and histogram, an `@KIND-read` and an `@KIND-write` record
//! (I/Os, latency sum and extremes in cycles), each with its histogram
//! (`@KIND-read-hist` lines): they must divide the run's own I/Os and
//! latency sum between them. The host's fio gives its `read` and `write`.
//! Here too their rows in `bench nvme`'s table and JSON summary.

use super::table::{fmt_ns, fmt_rate};
use super::{LatHist, NvmeRun};
use crate::stats::summarize;
use serde::Serialize;
use serde_json::{json, Value};
use std::fmt::Write as _;

/// A run's figures: one direction's of a randrw run (`NvmeRun::read`,
/// `write`), a whole run's (`NvmeRun::io`, flattened into its JSON), fio's
/// (`crate::fio::FioResult`, `FioDir`: there `hist` is empty and `lat` None
/// until [`IoFigures::from_fio`] puts fio's bins in the guest's buckets).
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct IoFigures {
    /// I/Os completed in the timed window.
    pub ios: u64,
    pub iops: f64,
    /// Decimal MB/s.
    pub mb_s: f64,
    /// Total latency (submission to completion); NaN without I/O.
    pub lat_avg_ns: f64,
    /// The shortest and longest latency (the guest's `lat_min`, `lat_max`;
    /// fio's `lat_ns` min and max for fio), where known.
    pub lat_min_ns: Option<f64>,
    pub lat_max_ns: Option<f64>,
    /// From `lat` (interpolated within the bucket, `LatHist::quantile_ns`);
    /// fio's own for fio.
    pub p50_ns: f64,
    pub p90_ns: f64,
    pub p99_ns: f64,
    pub p999_ns: f64,
    /// The latency histogram: `[upper_edge_ns, count]` pairs, non-empty
    /// buckets only; for fio, its json+ bins in the same buckets (empty if
    /// fio gave none).
    pub hist: Vec<(f64, u64)>,
    #[serde(skip)]
    pub lat: Option<LatHist>,
}

impl IoFigures {
    /// `ios` of `bs` bytes in `secs`, their percentiles from `lat`.
    pub fn new(ios: u64, bs: u64, secs: f64, lat: Option<LatHist>, tsc_khz: u64) -> IoFigures {
        let per_s = |v: f64| if secs > 0.0 { v / secs } else { f64::NAN };
        let q = |x: f64| lat.as_ref().map_or(f64::NAN, |h| h.quantile_ns(x, tsc_khz));
        IoFigures {
            ios,
            iops: per_s(ios as f64),
            mb_s: per_s(ios as f64 * bs as f64) / 1e6,
            lat_avg_ns: f64::NAN,
            lat_min_ns: None,
            lat_max_ns: None,
            p50_ns: q(0.5),
            p90_ns: q(0.9),
            p99_ns: q(0.99),
            p999_ns: q(0.999),
            hist: lat.as_ref().map(|h| h.pairs_ns(tsc_khz)).unwrap_or_default(),
            lat,
        }
    }

    /// fio's figures (`fio`, its `hist` and `lat` unset) with its json+
    /// `bins` (ns, count) put in the guest's buckets.
    pub fn from_fio(fio: &IoFigures, bins: &[(u64, u64)], tsc_khz: u64) -> IoFigures {
        let lat = (!bins.is_empty()).then(|| LatHist::from_ns_points(bins, tsc_khz));
        IoFigures { hist: lat.as_ref().map(|h| h.pairs_ns(tsc_khz)).unwrap_or_default(), lat, ..fio.clone() }
    }
}

/// The reads and writes of a run whose `@{kind}` record says `ios` I/Os of
/// `lat_sum` cycles in all, `bs` bytes each, in `secs`: both records must be
/// there, each histogram hold its record's I/Os, and the two add up to the run.
pub fn from_guest<S: AsRef<str>>(
    lines: &[S],
    kind: &str,
    (ios, lat_sum): (u64, u64),
    bs: u64,
    secs: f64,
    tsc_khz: u64,
) -> anyhow::Result<[IoFigures; 2]> {
    let ns = |c: u64| crate::stats::ns(c as f64, tsc_khz);
    let (mut n, mut sum) = (0u64, 0u64);
    let mut dir = |d: &str| -> anyhow::Result<IoFigures> {
        let k = format!("{kind}-{d}");
        let f = crate::record::find_record(lines, &k)
            .ok_or_else(|| anyhow::anyhow!("a randrw run without its @{k} record"))?;
        let g = |key: &str| {
            f.get(key).and_then(|v| v.parse::<u64>().ok()).ok_or_else(|| anyhow::anyhow!("@{k} record without {key}"))
        };
        let (dios, dsum) = (g("ios")?, g("lat_sum")?);
        n = n.checked_add(dios).ok_or_else(|| anyhow::anyhow!("@{k}: ios={dios} overflows"))?;
        sum = sum.checked_add(dsum).ok_or_else(|| anyhow::anyhow!("@{k}: lat_sum={dsum} overflows"))?;
        let lat = LatHist::parse_kind(lines, &k, dios)?.ok_or_else(|| anyhow::anyhow!("no @{k}-hist lines"))?;
        let mut r = IoFigures::new(dios, bs, secs, Some(lat), tsc_khz);
        if dios > 0 {
            r.lat_avg_ns = ns(dsum) / dios as f64;
            (r.lat_min_ns, r.lat_max_ns) = (g("lat_min").ok().map(ns), g("lat_max").ok().map(ns));
        }
        Ok(r)
    };
    let (read, write) = (dir("read")?, dir("write")?);
    anyhow::ensure!(
        (n, sum) == (ios, lat_sum),
        "@{kind}-read and @{kind}-write hold {n} I/Os of {sum} cycles, the run {ios} of {lat_sum}"
    );
    Ok([read, write])
}

/// A direction's runs of one target and job, over rounds.
fn of<'a>(rs: &[&'a NvmeRun], read: bool) -> Option<Vec<&'a IoFigures>> {
    rs.iter().map(|r| if read { r.read.as_ref() } else { r.write.as_ref() }).collect::<Option<Vec<_>>>()
}

/// The direction's p50, p99 and p99.9 (ns) over rounds: from the rounds'
/// merged histogram, or (fio without bins) the median of the rounds' own.
fn percentiles(ds: &[&IoFigures], tsc_khz: u64) -> [f64; 3] {
    let qs = [0.5, 0.99, 0.999];
    if ds.iter().all(|d| d.lat.is_some()) {
        let m = LatHist::merged(ds.iter().filter_map(|d| d.lat.as_ref()));
        return qs.map(|q| m.quantile_ns(q, tsc_khz));
    }
    let med = |f: fn(&IoFigures) -> f64| median(ds, f);
    [med(|d| d.p50_ns), med(|d| d.p99_ns), med(|d| d.p999_ns)]
}

fn median(ds: &[&IoFigures], f: impl Fn(&IoFigures) -> f64) -> f64 {
    summarize(&ds.iter().map(|d| f(d)).collect::<Vec<_>>()).map_or(f64::NAN, |s| s.median)
}

/// The I/Os of all rounds (saturating: the counts come from the guest) and
/// their mean latency.
fn ios_and_mean(ds: &[&IoFigures]) -> (u64, f64) {
    let ios = ds.iter().fold(0u64, |a, d| a.saturating_add(d.ios));
    let sum: f64 = ds.iter().filter(|d| d.ios > 0).map(|d| d.lat_avg_ns * d.ios as f64).sum();
    (ios, if ios > 0 { sum / ios as f64 } else { f64::NAN })
}

/// A randrw group's read and write rows under its own in the table: the
/// share of its I/Os, IOPS and MB/s (median over rounds), mean latency and
/// percentiles over every round's I/Os; nothing for other jobs.
pub fn rows(rs: &[&NvmeRun], target: &str, tsc_khz: u64) -> String {
    let mut s = String::new();
    let total = rs.iter().fold(0u64, |a, r| a.saturating_add(r.io.ios));
    for (read, name) in [(true, "read"), (false, "write")] {
        let Some(ds) = of(rs, read) else { return String::new() };
        let (ios, mean) = ios_and_mean(&ds);
        let [p50, p99, p999] = percentiles(&ds, tsc_khz);
        let share = format!("  {name} {:.1}%", 100.0 * ios as f64 / total.max(1) as f64);
        let _ = writeln!(
            s,
            "{share:<24} {target:<22} {:>7} {:>9} {:>11} {:>17} {:>9.0} {:>9} {:>9} {:>9} {:>9}",
            "",
            fmt_rate(median(&ds, |d| d.iops)),
            "",
            "",
            median(&ds, |d| d.mb_s),
            fmt_ns(mean),
            fmt_ns(p50),
            fmt_ns(p99),
            fmt_ns(p999),
        );
    }
    s
}

/// A randrw group's `read` and `write` in the JSON summary (None for other jobs).
pub fn summary(rs: &[&NvmeRun], tsc_khz: u64) -> Option<Value> {
    let dir = |read| -> Option<Value> {
        let ds = of(rs, read)?;
        let (ios, mean) = ios_and_mean(&ds);
        let [p50, p99, p999] = percentiles(&ds, tsc_khz);
        let merged = LatHist::merged(ds.iter().filter_map(|d| d.lat.as_ref()));
        Some(json!({
            "ios": ios,
            "iops": summarize(&ds.iter().map(|d| d.iops).collect::<Vec<_>>()),
            "mb_s": summarize(&ds.iter().map(|d| d.mb_s).collect::<Vec<_>>()),
            "lat_avg_ns": mean,
            "p50_ns": p50,
            "p99_ns": p99,
            "p999_ns": p999,
            "hist": merged.pairs_ns(tsc_khz),
        }))
    };
    Some(json!({"read": dir(true)?, "write": dir(false)?}))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lines(s: &[&str]) -> Vec<String> {
        s.iter().map(|l| l.to_string()).collect()
    }

    const RUN: [&str; 9] = [
        "@nvme rw=randrw ios=7 cycles=2000000 lat_sum=6040 lat_min=400 lat_max=1487 rwmixread=70",
        "@nvme-hist 548:4 668:3",
        "@nvme-hist-end buckets=2 lines=1",
        "@nvme-read ios=4 lat_sum=1606 lat_min=400 lat_max=403 p50=403",
        "@nvme-read-hist 548:4",
        "@nvme-read-hist-end buckets=1 lines=1",
        "@nvme-write ios=3 lat_sum=4434 lat_min=1472 lat_max=1487 p50=1487",
        "@nvme-write-hist 668:3",
        "@nvme-write-hist-end buckets=1 lines=1",
    ];

    #[test]
    fn reads_and_writes_divide_the_run() {
        // 1 GHz: 2 M cycles are 2 ms.
        let [r, w] = from_guest(&RUN, "nvme", (7, 6040), 4096, 0.002, 1_000_000).unwrap();
        assert_eq!((r.ios, r.iops, r.lat_avg_ns, r.lat_min_ns), (4, 2000.0, 401.5, Some(400.0)));
        assert_eq!((w.ios, w.iops, w.lat_max_ns, w.hist.len()), (3, 1500.0, Some(1487.0), 1));
        assert!((r.mb_s - 8.192).abs() < 1e-9, "{}", r.mb_s);
        assert_eq!(r.p50_ns, 401.5, "interpolated in bucket 548 (400..=403)");
        assert_eq!(w.p50_ns, 1479.5, "interpolated in bucket 668 (1472..=1487)");
        // A direction without I/O (rwmixread 100): an empty histogram, no latency figures.
        let none = lines(&[
            "@nvme-read ios=7 lat_sum=6040",
            "@nvme-read-hist 548:7",
            "@nvme-read-hist-end buckets=1 lines=1",
            "@nvme-write ios=0 lat_sum=0 lat_min=0 lat_max=0",
            "@nvme-write-hist-end buckets=0 lines=0",
        ]);
        let [_, w] = from_guest(&none, "nvme", (7, 6040), 4096, 0.002, 1_000_000).unwrap();
        assert_eq!((w.ios, w.lat_min_ns, w.hist.len()), (0, None, 0));
        assert!(w.lat_avg_ns.is_nan() && w.p50_ns.is_nan());
    }

    #[test]
    fn a_randrw_group_gets_a_read_and_a_write_row_and_summary() {
        let tsc = 1_000_000;
        let runs: Vec<NvmeRun> = (0..2)
            .map(|round| {
                let mut r = NvmeRun::new("iopath-shm", "", 0, round, 1000, 1_000_000);
                let d = |n, b| {
                    let mut d = IoFigures::new(n, 4096, 0.001, Some(LatHist { counts: [(b, n)].into() }), tsc);
                    d.lat_avg_ns = 1000.0;
                    d
                };
                (r.read, r.write) = (Some(d(700, 548)), Some(d(300, 848)));
                r
            })
            .collect();
        let rs: Vec<&NvmeRun> = runs.iter().collect();
        let text = rows(&rs, "iopath-shm", tsc);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 2, "{text}");
        assert!(lines[0].starts_with("  read 70.0%") && lines[0].contains("700.0 k"), "{text}");
        assert!(lines[1].starts_with("  write 30.0%") && lines[1].contains("10.3"), "p50 in bucket 848: {text}");
        let v = summary(&rs, tsc).unwrap();
        assert_eq!((v["read"]["ios"].as_u64(), v["write"]["ios"].as_u64()), (Some(1400), Some(600)));
        assert_eq!(v["read"]["p50_ns"].as_f64(), Some(401.5));
        // A run without its directions (any other job): no rows, no summary.
        let plain = NvmeRun::new("iopath-shm", "", 0, 0, 1000, 1);
        assert!(rows(&[&plain], "iopath-shm", tsc).is_empty() && summary(&[&plain], tsc).is_none());
    }

    #[test]
    fn records_that_do_not_add_up_are_errors() {
        let run = |l: &[String], ios, sum| from_guest(l, "nvme", (ios, sum), 4096, 0.002, 1_000_000);
        let good = lines(&RUN);
        assert!(run(&good, 8, 6040).is_err(), "more I/Os in the run than in its directions");
        assert!(run(&good, 7, 6041).is_err(), "latency sums apart");
        assert!(run(&good[..6], 7, 6040).is_err(), "no write record");
        let bad = |from: &str, to: &str| good.iter().map(|l| l.replacen(from, to, 1)).collect::<Vec<_>>();
        assert!(run(&bad("@nvme-read-hist 548:4", "@nvme-read-hist 548:5"), 7, 6040).is_err(), "histogram of 5");
        assert!(run(&bad("ios=3", "ios=x"), 7, 6040).is_err());
        let huge = bad("@nvme-write ios=3", &format!("@nvme-write ios={}", u64::MAX));
        assert!(run(&huge, 7, 6040).is_err(), "an overflow is an error, not a panic");
        // vblk's records are not nvme's.
        assert!(from_guest(&good, "vblk", (7, 6040), 4096, 0.002, 1_000_000).is_err());
    }
}
