//! `bench spdk`'s tables (one per job: each target's IOPS, average and p99
//! latency, median over rounds with min and max, and iopath over nvmf_tgt)
//! and its JSON.

use super::{Kind, SpdkResult, SpdkRun};
use crate::stats::{summarize, Summary};
use serde_json::{json, Value};
use std::fmt::Write as _;

/// The runs of job `ji` on `target`.
fn of(r: &SpdkResult, ji: usize, target: Kind) -> Vec<&SpdkRun> {
    r.runs.iter().filter(|x| x.job == ji && x.target == target).collect()
}

fn sum(rs: &[&SpdkRun], f: fn(&SpdkRun) -> f64) -> Option<Summary> {
    summarize(&rs.iter().map(|r| f(r)).collect::<Vec<_>>())
}

const IOPS: fn(&SpdkRun) -> f64 = |r| r.perf.iops;
const AVG: fn(&SpdkRun) -> f64 = |r| r.perf.avg_us;
const P50: fn(&SpdkRun) -> f64 = |r| r.perf.p50_us;
const P99: fn(&SpdkRun) -> f64 = |r| r.perf.p99_us;
const SLEEPS: fn(&SpdkRun) -> f64 = |r| r.device.sleeps as f64;

fn rate(v: f64) -> String {
    if v >= 1e6 {
        format!("{:.2} M", v / 1e6)
    } else {
        format!("{:.1} k", v / 1e3)
    }
}

fn us(v: f64) -> String {
    if v >= 100.0 {
        format!("{v:.0}")
    } else {
        format!("{v:.2}")
    }
}

fn show(s: Option<Summary>, f: fn(f64) -> String) -> String {
    s.map_or("-".into(), |s| format!("{} [{} .. {}]", f(s.median), f(s.min), f(s.max)))
}

/// iopath's IOPS over nvmf_tgt's in each round (the two ran back to back).
fn by_round(a: &[&SpdkRun], b: &[&SpdkRun]) -> Option<Summary> {
    let v: Vec<f64> = a
        .iter()
        .filter_map(|x| b.iter().find(|y| y.round == x.round).map(|y| x.perf.iops / y.perf.iops))
        .filter(|r| r.is_finite())
        .collect();
    summarize(&v)
}

/// iopath's median over nvmf_tgt's.
fn ratio(a: Option<Summary>, b: Option<Summary>) -> Option<f64> {
    a.zip(b).filter(|(_, b)| b.median > 0.0).map(|(a, b)| a.median / b.median)
}

impl SpdkResult {
    /// The placement line: where perf and the targets ran.
    pub fn placement(&self) -> String {
        let p = self.options.pin;
        format!(
            "pinned: spdk_nvme_perf on CPU {} (-c {:#x}); each target on CPU {} (iopath serve: the whole process's \
             affinity; nvmf_tgt: -m {:#x})",
            p.vcpu,
            1u64 << p.vcpu,
            p.device,
            1u64 << p.device
        )
    }

    pub fn table(&self) -> String {
        let o = &self.options;
        let mut s = String::new();
        if self.partial {
            let _ = writeln!(s, "{}", crate::interrupt::partial_line(self.runs.len()));
        }
        let _ = writeln!(s, "{}", self.host);
        let _ = writeln!(
            s,
            "spdk: stock spdk_nvme_perf (SPDK v25.09, {}) against `iopath serve nvme,backend=null{}`{} over vfio-user \
             and nvmf_tgt (VFIOUSER, bdev_null); {} MiB namespace, {} B LBA; 1 qpair; {} s per run, a fresh perf \
             each; {} round(s), interleaved (even rounds iopath first, odd nvmf_tgt first); {}",
            self.peers.display(),
            o.doorbell.map_or(String::new(), |d| format!(",doorbell={d}")),
            if o.doorbell.is_none() { " (no doorbell option: auto)" } else { "" },
            o.size_mb,
            o.lba,
            o.runtime_s,
            o.rounds,
            self.placement()
        );
        let _ = writeln!(
            s,
            "perf's own figures (latency from -L), median over rounds [min .. max]; every run checked against the \
             device's counters (iopath's report, nvmf_tgt's bdev_get_iostat); sleeps: the times iopath's poller went \
             to sleep during a run (perf's attach and exit included), median"
        );
        for (ji, j) in o.jobs.iter().enumerate() {
            let _ = writeln!(s, "\n{}", j.label());
            let hdr = format!(
                "{:<16} {:>6} {:>28} {:>26} {:>26} {:>28} {:>7}",
                "target", "rounds", "IOPS", "avg us", "p50 us", "p99 us", "sleeps"
            );
            let _ = writeln!(s, "{hdr}");
            let _ = writeln!(s, "{}", "-".repeat(hdr.len()));
            let (a, b) = (of(self, ji, Kind::Iopath), of(self, ji, Kind::Nvmf));
            for (name, rs) in [("iopath", &a), ("nvmf_tgt", &b)] {
                let sleeps = if name == "iopath" {
                    sum(rs, SLEEPS).map_or("-".into(), |x| format!("{:.0}", x.median))
                } else {
                    "-".into()
                };
                let _ = writeln!(
                    s,
                    "{:<16} {:>6} {:>28} {:>26} {:>26} {:>28} {:>7}",
                    name,
                    rs.len(),
                    show(sum(rs, IOPS), rate),
                    show(sum(rs, AVG), us),
                    show(sum(rs, P50), us),
                    show(sum(rs, P99), us),
                    sleeps
                );
            }
            let x = |f| ratio(sum(&a, f), sum(&b, f)).map_or("-".into(), |r| format!("{r:.2}x"));
            let _ = writeln!(
                s,
                "{:<16} {:>6} {:>28} {:>26} {:>26} {:>28}",
                "iopath/nvmf_tgt",
                "",
                x(IOPS),
                x(AVG),
                x(P50),
                x(P99)
            );
            if let Some(r) = by_round(&a, &b).filter(|r| r.n > 1) {
                let _ = writeln!(
                    s,
                    "iopath/nvmf_tgt IOPS round by round (each round's pair ran back to back): {:.2}x [{:.2} .. {:.2}]",
                    r.median, r.min, r.max
                );
            }
        }
        if !self.errors.is_empty() {
            let _ = writeln!(s, "\nerrors (these runs are not in the figures):");
            for e in &self.errors {
                let _ = writeln!(s, "  {e}");
            }
        }
        s
    }

    pub fn json(&self) -> Value {
        let summary: Vec<Value> = self
            .options
            .jobs
            .iter()
            .enumerate()
            .map(|(ji, j)| {
                let (a, b) = (of(self, ji, Kind::Iopath), of(self, ji, Kind::Nvmf));
                let side = |rs: &[&SpdkRun]| {
                    json!({"rounds": rs.len(), "iops": sum(rs, IOPS), "avg_us": sum(rs, AVG),
                           "p50_us": sum(rs, P50), "p99_us": sum(rs, P99)})
                };
                json!({
                    "job": ji,
                    "label": j.label(),
                    "iops_ratio_by_round": by_round(&a, &b),
                    "iopath": side(&a),
                    "nvmf_tgt": side(&b),
                    "iopath_over_nvmf_tgt": {
                        "iops": ratio(sum(&a, IOPS), sum(&b, IOPS)),
                        "avg_us": ratio(sum(&a, AVG), sum(&b, AVG)),
                        "p50_us": ratio(sum(&a, P50), sum(&b, P50)),
                        "p99_us": ratio(sum(&a, P99), sum(&b, P99)),
                    },
                })
            })
            .collect();
        json!({
            "schema_version": crate::guard::JSON_SCHEMA_VERSION,
            "benchmark": "spdk",
            "partial": self.partial,
            "host": self.host,
            "options": self.options,
            "placement": self.placement(),
            "peers": self.peers,
            "servers": self.server_pids.iter().map(|(k, p)| json!({"target": k, "pid": p})).collect::<Vec<_>>(),
            "runs": self.runs,
            "summary": summary,
            "errors": self.errors,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::super::perf::{PerfJob, PerfOut};
    use super::super::{Io, SpdkOptions};
    use super::*;

    fn run(target: Kind, round: u32, iops: f64, avg_us: f64) -> SpdkRun {
        let perf =
            PerfOut { iops, mib_s: 0.0, avg_us, min_us: 1.0, max_us: 9.0, p50_us: 1.0, p99_us: 2.0, p999_us: 3.0 };
        SpdkRun { target, job: 0, round, perf, device: Io::default(), check: String::new(), perf_pid: 1 }
    }

    #[test]
    fn each_job_gets_medians_over_rounds_and_iopath_over_nvmf_tgt() {
        let o =
            SpdkOptions { jobs: vec![PerfJob { rw: "randread".into(), bs: 4096, iodepth: 1 }], ..Default::default() };
        let r = SpdkResult {
            partial: false,
            host: crate::host::host_info(0),
            options: o,
            peers: "/p".into(),
            server_pids: vec![(Kind::Iopath, 10), (Kind::Nvmf, 11)],
            runs: vec![
                run(Kind::Iopath, 0, 100e3, 10.0),
                run(Kind::Nvmf, 0, 200e3, 5.0),
                run(Kind::Nvmf, 1, 180e3, 6.0),
                run(Kind::Iopath, 1, 120e3, 8.0),
                run(Kind::Iopath, 2, 90e3, 11.0),
                run(Kind::Nvmf, 2, 220e3, 4.0),
            ],
            errors: vec!["nvmf_tgt randread 4k qd1 round 3: boom".into()],
        };
        let v = r.json();
        let s = &v["summary"][0];
        assert_eq!(s["iopath"]["iops"]["median"], 100e3);
        assert_eq!(s["nvmf_tgt"]["iops"]["median"], 200e3);
        assert_eq!(s["iopath_over_nvmf_tgt"]["iops"], 0.5);
        assert_eq!(s["iopath_over_nvmf_tgt"]["avg_us"], 2.0);
        let by_round = &s["iops_ratio_by_round"];
        assert_eq!((by_round["median"].as_f64(), by_round["n"].as_u64()), (Some(0.5), Some(3)), "{by_round}");
        assert!((by_round["max"].as_f64().unwrap() - 120.0 / 180.0).abs() < 1e-9, "{by_round}");
        assert_eq!((v["benchmark"].as_str(), v["runs"].as_array().map(|a| a.len())), (Some("spdk"), Some(6)));
        assert_eq!(v["runs"][1]["target"], "nvmf_tgt");
        let t = r.table();
        assert!(t.contains("100.0 k [90.0 k .. 120.0 k]"), "{t}");
        assert!(t.contains("0.50x") && t.contains("2.00x") && t.contains("boom"), "{t}");
        assert!(t.contains("round by round (each round's pair ran back to back): 0.50x [0.41 .. 0.67]"), "{t}");
        assert!(t.contains("`iopath serve nvme,backend=null` (no doorbell option: auto)"), "{t}");
    }
}
