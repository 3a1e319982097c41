//! `bench blk`'s records (one per target and job, over rounds), its tables
//! and its JSON.

use super::{BlkResult, BlkRun, Measure, VFIO_TARGET};
use crate::nvme::LatHist;
use crate::stats::{summarize, Summary};
use serde::Serialize;
use serde_json::{json, Value};
use std::fmt::Write as _;

/// One round's figures of a record.
#[derive(Clone, Debug, Serialize)]
pub struct RoundFigures {
    pub round: u32,
    pub ios: u64,
    pub iops: f64,
    pub mb_s: f64,
    pub p50_ns: f64,
    pub p99_ns: f64,
    pub exits_per_io: Option<f64>,
    pub routing_ok: bool,
}

/// A target's figures for one job over its rounds: medians (IOPS, MB/s,
/// exits per I/O), percentiles of the merged histogram, every round's own.
#[derive(Clone, Debug, Serialize)]
pub struct Record {
    pub schema_version: u32,
    pub target: String,
    pub job: String,
    pub job_index: usize,
    pub measure: Measure,
    pub rw: String,
    pub bs: u64,
    pub iodepth: u32,
    /// None where no round ran (see `error`).
    pub iops: Option<f64>,
    pub mb_s: Option<f64>,
    pub p50_ns: Option<f64>,
    pub p99_ns: Option<f64>,
    pub exits_per_io: Option<f64>,
    pub iops_range: Option<(f64, f64)>,
    pub mb_s_range: Option<(f64, f64)>,
    /// Every round ran and every run's routing check held.
    pub routing_ok: bool,
    /// Against the reference target, same job: MB/s over its MB/s
    /// (throughput), p50 over its p50 (latency).
    pub ratio: Option<f64>,
    pub rounds: Vec<RoundFigures>,
    /// The first failure of a round that did not run, if any.
    pub error: Option<String>,
}

/// The figure a record is compared by: MB/s (throughput) or p50 (latency).
fn key(r: &Record) -> Option<f64> {
    match r.measure {
        Measure::Throughput => r.mb_s,
        Measure::Latency => r.p50_ns,
    }
}

fn median(v: impl Iterator<Item = f64>) -> Option<Summary> {
    summarize(&v.collect::<Vec<_>>())
}

impl BlkResult {
    /// One record per target and job, in the run's order (targets within jobs).
    pub fn records(&self) -> Vec<Record> {
        let o = &self.options;
        let mut out = Vec::new();
        // Runs and failures carry their target's name.
        let names: Vec<String> = o.targets.iter().map(|t| t.to_string()).collect();
        for (ji, j) in self.jobs.iter().enumerate() {
            for t in &names {
                let rs: Vec<&BlkRun> = self.runs.iter().filter(|r| r.job_index == ji && &r.target == t).collect();
                let fails: Vec<_> = self.failures.iter().filter(|f| f.job_index == ji && &f.target == t).collect();
                let iops = median(rs.iter().map(|r| r.iops));
                let mb_s = median(rs.iter().map(|r| r.mb_s));
                let merged = LatHist::merged(rs.iter().filter_map(|r| r.lat.as_ref()));
                let pct = |q| Some(merged.quantile_ns(q, self.tsc_khz)).filter(|v| v.is_finite());
                out.push(Record {
                    schema_version: crate::guard::JSON_SCHEMA_VERSION,
                    target: t.clone(),
                    job: j.name.clone(),
                    job_index: ji,
                    measure: j.measure,
                    rw: j.job.rw.clone(),
                    bs: j.job.bs,
                    iodepth: j.job.iodepth,
                    iops: iops.map(|s| s.median),
                    mb_s: mb_s.map(|s| s.median),
                    p50_ns: pct(0.5),
                    p99_ns: pct(0.99),
                    exits_per_io: median(rs.iter().filter_map(|r| r.exits_per_io)).map(|s| s.median),
                    iops_range: iops.map(|s| (s.min, s.max)),
                    mb_s_range: mb_s.map(|s| (s.min, s.max)),
                    routing_ok: !rs.is_empty() && fails.is_empty() && rs.iter().all(|r| r.routing_ok),
                    ratio: None,
                    rounds: rs
                        .iter()
                        .map(|r| RoundFigures {
                            round: r.round,
                            ios: r.ios,
                            iops: r.iops,
                            mb_s: r.mb_s,
                            p50_ns: r.p50_ns,
                            p99_ns: r.p99_ns,
                            exits_per_io: r.exits_per_io,
                            routing_ok: r.routing_ok,
                        })
                        .collect(),
                    error: fails.first().map(|f| f.error.clone()),
                });
            }
        }
        // Each against the reference's record of its job; only records
        // whose every run held its routing check are divided or divide.
        let reference = o.reference.to_string();
        let refs: Vec<(usize, Option<f64>)> =
            out.iter().filter(|r| r.target == reference && r.routing_ok).map(|r| (r.job_index, key(r))).collect();
        for r in out.iter_mut().filter(|r| r.routing_ok) {
            let base = refs.iter().find(|x| x.0 == r.job_index).and_then(|x| x.1).filter(|&b| b > 0.0);
            r.ratio = key(r).zip(base).map(|(v, b)| v / b);
        }
        out
    }

    pub fn table(&self) -> String {
        let o = &self.options;
        let recs = self.records();
        let mut s = String::new();
        if self.partial {
            let _ = writeln!(s, "{}", crate::interrupt::partial_line(self.runs.len()));
        }
        let _ = writeln!(s, "{}", self.host);
        let _ = writeln!(
            s,
            "blk: backend {} ({} MiB), {} s per run, {} round(s), 1 guest vCPU, {}; throughput {} B at QD{}, \
             latency {} B at QD1; medians over rounds [min..max], percentiles over all rounds' I/Os; \
             ratio = target / {} (MB/s; latency: p50), only between records whose checks held",
            o.backend,
            self.disk_bytes >> 20,
            o.time_ms as f64 / 1000.0,
            o.rounds,
            o.pin.map_or_else(|| crate::floor::UNPINNED.to_string(), |p| p.to_string()),
            o.tput_bs,
            o.tput_qd,
            o.lat_bs,
            if o.targets.contains(&o.reference) {
                o.reference.to_string()
            } else {
                format!("{} (not run: no ratios)", o.reference)
            }
        );
        let cell = |m: Measure, r: &Record| -> String {
            let ratio = r.ratio.map_or(String::new(), |x| format!(" {x:.2}x"));
            match (m, r.mb_s_range, r.p50_ns, r.p99_ns) {
                _ if r.rounds.is_empty() => "failed".into(),
                (Measure::Throughput, Some((lo, hi)), ..) => {
                    format!("{:.0} [{lo:.0}..{hi:.0}]{ratio}", r.mb_s.unwrap_or(f64::NAN))
                }
                (Measure::Latency, _, Some(p50), Some(p99)) => format!("{}/{}{ratio}", us(p50), us(p99)),
                _ => "-".into(),
            }
        };
        for (m, title) in [
            (Measure::Throughput, format!("Throughput, MB/s at {} KiB QD{}", o.tput_bs / 1024, o.tput_qd)),
            (Measure::Latency, format!("Latency, p50/p99 us at {} KiB QD1", o.lat_bs / 1024)),
        ] {
            let jobs: Vec<usize> = (0..self.jobs.len()).filter(|&j| self.jobs[j].measure == m).collect();
            let _ = writeln!(s, "\n{title}");
            let mut hdr = format!("{:<25}", "target");
            for &j in &jobs {
                let _ = write!(hdr, " {:>26}", self.jobs[j].name);
            }
            let _ = writeln!(s, "{hdr}  check\n{}", "-".repeat(hdr.len() + 7));
            for t in &o.targets {
                let mut line = format!("{t:<25}");
                let mut ok = true;
                for &j in &jobs {
                    let r = recs.iter().find(|r| r.job_index == j && r.target == t.to_string());
                    ok &= r.is_some_and(|r| r.routing_ok);
                    let _ = write!(line, " {:>26}", r.map_or("-".into(), |r| cell(m, r)));
                }
                let _ = writeln!(s, "{line}  {}", if ok { "ok" } else { "WRONG/failed" });
            }
            for (t, why) in &self.not_run {
                let _ = writeln!(s, "{t:<25} {why}");
            }
            let _ = writeln!(s, "how far apart (max/min over targets that ran and held their checks):");
            for &j in &jobs {
                let _ = writeln!(s, "  {:<20} {}", self.jobs[j].name, spread(&recs, j, m));
            }
        }
        let _ = writeln!(s, "\nExits per I/O in the timed window (iopath's VMM; - where the VMM is QEMU)");
        let mut hdr = format!("{:<25}", "target");
        for j in &self.jobs {
            let _ = write!(hdr, " {:>8}", short(&j.name));
        }
        let _ = writeln!(s, "{hdr}\n{}", "-".repeat(hdr.len()));
        for t in &o.targets {
            let mut line = format!("{t:<25}");
            for ji in 0..self.jobs.len() {
                let r = recs.iter().find(|r| r.job_index == ji && r.target == t.to_string());
                let _ =
                    write!(line, " {:>8}", r.and_then(|r| r.exits_per_io).map_or("-".into(), |x| format!("{x:.3}")));
            }
            let _ = writeln!(s, "{line}");
        }
        // Each failing target once per distinct error.
        let mut seen: Vec<(String, String)> = Vec::new();
        for f in &self.failures {
            let k = (f.target.clone(), f.error.clone());
            if !seen.contains(&k) {
                let _ = writeln!(s, "failed: {} ({} round {}): {}", f.target, f.job, f.round, f.error);
                seen.push(k);
            }
        }
        for r in self.runs.iter().filter(|r| !r.routing_ok) {
            let _ = writeln!(s, "WRONG: {} {} round {}: {}", r.target, r.job, r.round, r.routing);
        }
        s
    }

    pub fn json(&self) -> Value {
        json!({
            "benchmark": "blk",
            "partial": self.partial,
            "schema_version": crate::guard::JSON_SCHEMA_VERSION,
            "host": self.host,
            "options": self.options,
            "disk_mb": self.disk_bytes >> 20,
            "tsc_khz": self.tsc_khz,
            "jobs": self.jobs,
            "records": self.records(),
            "runs": self.runs,
            "failures": self.failures,
            "not_run": self.not_run.iter().map(|(t, why)| json!({"target": t, "reason": why})).collect::<Vec<_>>(),
            "vfio_target": VFIO_TARGET,
            "errors": self.errors,
        })
    }
}

fn us(ns: f64) -> String {
    format!("{:.1}", ns / 1000.0)
}

/// "seq read 128k qd16" as "sr128k".
fn short(name: &str) -> String {
    let w: Vec<&str> = name.split_whitespace().collect();
    match w.as_slice() {
        [a, b, bs, ..] => format!("{}{}{bs}", &a[..1], &b[..1]),
        _ => name.chars().take(8).collect(),
    }
}

/// The spread of job `j` over the targets that ran it: max/min of MB/s
/// (throughput) or of p50 (latency), naming both ends.
fn spread(recs: &[crate::blk::Record], j: usize, m: Measure) -> String {
    let v: Vec<(f64, &str)> = recs
        .iter()
        .filter(|r| r.job_index == j && r.routing_ok)
        .filter_map(|r| Some((if m == Measure::Throughput { r.mb_s? } else { r.p50_ns? }, r.target.as_str())))
        .filter(|x| x.0 > 0.0)
        .collect();
    let lo = v.iter().min_by(|a, b| a.0.total_cmp(&b.0));
    let hi = v.iter().max_by(|a, b| a.0.total_cmp(&b.0));
    match (lo, hi) {
        (Some(lo), Some(hi)) if v.len() > 1 => {
            let f = |x: f64| if m == Measure::Throughput { format!("{x:.0} MB/s") } else { format!("{} us", us(x)) };
            format!("{:.2}x: {} ({}) .. {} ({})", hi.0 / lo.0, f(lo.0), lo.1, f(hi.0), hi.1)
        }
        _ => "-".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::blk::{BlkOptions, BlkRun};
    use crate::host::HostInfo;

    fn run(target: &str, job_index: usize, mb_s: f64, ok: bool) -> BlkRun {
        BlkRun {
            target: target.into(),
            job_index,
            job: String::new(),
            round: 0,
            ios: 100,
            cycles: 1,
            iops: mb_s,
            mb_s,
            lat_avg_ns: None,
            lat_min_ns: None,
            lat_max_ns: None,
            p50_ns: 1000.0,
            p99_ns: 2000.0,
            hist: Vec::new(),
            lat: None,
            window_exits: Some(0),
            exits_per_io: Some(job_index as f64),
            guest_notifies: Some(1),
            errors: 0,
            routing: if ok { "fine".into() } else { "wrong counters".into() },
            routing_ok: ok,
        }
    }

    /// One throughput job on three targets, the reference's routing as `ref_ok`.
    fn result(ref_ok: bool) -> BlkResult {
        let targets = ["virtio-ioeventfd", "virtio-exit", "virtio-poll"];
        let options = BlkOptions {
            targets: targets.iter().map(|t| t.parse().unwrap()).collect(),
            size_mb: 64,
            pin: None,
            ..Default::default()
        };
        let jobs = options.jobs();
        BlkResult {
            partial: false,
            host: HostInfo {
                cpu: "test".into(),
                cpus: 2,
                kernel: "k".into(),
                kvm_module: "kvm".into(),
                nested: false,
                tsc_khz: 1_000_000,
            },
            disk_bytes: 5 << 20,
            options,
            jobs,
            tsc_khz: 1_000_000,
            runs: vec![
                run("virtio-ioeventfd", 0, 1000.0, ref_ok),
                run("virtio-exit", 0, 100.0, true),
                run("virtio-poll", 0, 400.0, !ref_ok),
            ],
            failures: Vec::new(),
            not_run: Vec::new(),
            errors: Vec::new(),
        }
    }

    /// report.md from this one blk document.
    fn blk_markdown(doc: &Value) -> String {
        let input = crate::report::Input { docs: vec![doc.clone()], ..Default::default() };
        crate::report::render(&input).markdown
    }

    fn ratio(recs: &[Record], t: &str) -> Option<f64> {
        recs.iter().find(|r| r.job_index == 0 && r.target == t).unwrap().ratio
    }

    #[test]
    fn ratios_and_spread_leave_out_records_whose_checks_failed() {
        // The reference failed its check: nothing is divided by its figure.
        let r = result(false);
        let recs = r.records();
        assert_eq!((ratio(&recs, "virtio-exit"), ratio(&recs, "virtio-poll")), (None, None));
        assert_eq!(spread(&recs, 0, Measure::Throughput), "4.00x: 100 MB/s (virtio-exit) .. 400 MB/s (virtio-poll)");
        // The reference held, virtio-poll did not: it gets no ratio and is not in the spread.
        let r = result(true);
        let recs = r.records();
        assert_eq!((ratio(&recs, "virtio-exit"), ratio(&recs, "virtio-poll")), (Some(0.1), None));
        assert!(spread(&recs, 0, Measure::Throughput).starts_with("10.00x: 100 MB/s (virtio-exit) .. 1000 MB/s"));
        // The report's table says the same from the JSON document.
        let md = blk_markdown(&r.json());
        assert!(md.contains("| 10.00x (virtio-exit .. virtio-ioeventfd) |"), "{md}");
    }

    #[test]
    fn the_header_gives_the_disk_size_the_targets_ran_on() {
        let r = result(true);
        assert!(r.table().contains("backend null (5 MiB)"), "{}", r.table());
        assert_eq!(r.json()["disk_mb"], 5);
        let md = blk_markdown(&r.json());
        assert!(md.contains("backend `null` (5 MiB)"), "{md}");
        // Exits per I/O for each job, in the columns' order (only job 0 ran).
        assert!(md.contains("| 0.000 / - / - / - |"), "{md}");
    }
}
