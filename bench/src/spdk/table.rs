//! `bench spdk`'s tables (one per job and controller count: each target's
//! IOPS, average and p99 latency, CPU per I/O, median over rounds with min
//! and max, and iopath over nvmf_tgt; with several counts, one table of
//! them all) and its JSON.

use super::{Kind, SpdkResult, SpdkRun};
use crate::stats::{summarize, Summary};
use serde_json::{json, Value};
use std::fmt::Write as _;

/// The runs of job `ji` on `target` serving `n` controllers.
fn of(r: &SpdkResult, n: u32, ji: usize, target: Kind) -> Vec<&SpdkRun> {
    r.runs.iter().filter(|x| x.controllers == n && x.job == ji && x.target == target).collect()
}

fn sum(rs: &[&SpdkRun], f: fn(&SpdkRun) -> f64) -> Option<Summary> {
    summarize(&rs.iter().map(|r| f(r)).collect::<Vec<_>>())
}

const IOPS: fn(&SpdkRun) -> f64 = |r| r.perf.iops;
const AVG: fn(&SpdkRun) -> f64 = |r| r.perf.avg_us;
const P50: fn(&SpdkRun) -> f64 = |r| r.perf.p50_us;
const P99: fn(&SpdkRun) -> f64 = |r| r.perf.p99_us;
const SLEEPS: fn(&SpdkRun) -> f64 = |r| r.device.sleeps as f64;
/// The target process's CPU time per I/O it served, us.
const CPU_PER_IO: fn(&SpdkRun) -> f64 = |r| r.target_cpu_ns as f64 / 1e3 / r.device.commands.max(1) as f64;

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
        let _ = writeln!(
            s,
            "CPU/IO: the target process's CPU time during a run (perf's attach and exit included) over the I/Os \
             its devices served, us, median; nvmf_tgt's reactor polls its core whether or not there is I/O"
        );
        for (n, ji, j) in self.cells() {
            let _ = writeln!(s, "\n{}{}", j.label(), if n > 1 { format!(", {n} controllers") } else { String::new() });
            let hdr = format!(
                "{:<16} {:>6} {:>28} {:>26} {:>26} {:>28} {:>7} {:>8}",
                "target", "rounds", "IOPS", "avg us", "p50 us", "p99 us", "sleeps", "CPU/IO"
            );
            let _ = writeln!(s, "{hdr}");
            let _ = writeln!(s, "{}", "-".repeat(hdr.len()));
            let (a, b) = (of(self, n, ji, Kind::Iopath), of(self, n, ji, Kind::Nvmf));
            for (name, rs) in [("iopath", &a), ("nvmf_tgt", &b)] {
                let sleeps = if name == "iopath" {
                    sum(rs, SLEEPS).map_or("-".into(), |x| format!("{:.0}", x.median))
                } else {
                    "-".into()
                };
                let _ = writeln!(
                    s,
                    "{:<16} {:>6} {:>28} {:>26} {:>26} {:>28} {:>7} {:>8}",
                    name,
                    rs.len(),
                    show(sum(rs, IOPS), rate),
                    show(sum(rs, AVG), us),
                    show(sum(rs, P50), us),
                    show(sum(rs, P99), us),
                    sleeps,
                    sum(rs, CPU_PER_IO).map_or("-".into(), |x| format!("{:.3}", x.median))
                );
            }
            let x = |f| ratio(sum(&a, f), sum(&b, f)).map_or("-".into(), |r| format!("{r:.2}x"));
            let _ = writeln!(
                s,
                "{:<16} {:>6} {:>28} {:>26} {:>26} {:>28} {:>7} {:>8}",
                "iopath/nvmf_tgt",
                "",
                x(IOPS),
                x(AVG),
                x(P50),
                x(P99),
                "",
                x(CPU_PER_IO)
            );
            if let Some(r) = by_round(&a, &b).filter(|r| r.n > 1) {
                let _ = writeln!(
                    s,
                    "iopath/nvmf_tgt IOPS round by round (each round's pair ran back to back): {:.2}x [{:.2} .. {:.2}]",
                    r.median, r.min, r.max
                );
            }
        }
        if o.controllers.len() > 1 {
            s.push_str(&self.controllers_table());
        }
        if !self.errors.is_empty() {
            let _ = writeln!(s, "\nerrors (these runs are not in the figures):");
            for e in &self.errors {
                let _ = writeln!(s, "  {e}");
            }
        }
        s
    }

    /// (controllers, job index, job) of every table, counts first.
    fn cells(&self) -> Vec<(u32, usize, &super::perf::PerfJob)> {
        let o = &self.options;
        o.controllers.iter().flat_map(|&n| o.jobs.iter().enumerate().map(move |(ji, j)| (n, ji, j))).collect()
    }

    /// Total IOPS and CPU per I/O of both targets by controller count, a line per (job, N).
    fn controllers_table(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(
            s,
            "\ncontrollers: total IOPS over all N (perf's Total) and the target's CPU us per I/O, median [min .. max]"
        );
        let hdr = format!(
            "{:<22} {:>3} {:>28} {:>28} {:>24} {:>24}",
            "job", "N", "iopath IOPS", "nvmf_tgt IOPS", "iopath CPU/IO us", "nvmf_tgt CPU/IO us"
        );
        let _ = writeln!(s, "{hdr}");
        let _ = writeln!(s, "{}", "-".repeat(hdr.len()));
        let cpu = |v: f64| format!("{v:.3}");
        for (ji, j) in self.options.jobs.iter().enumerate() {
            for &n in &self.options.controllers {
                let (a, b) = (of(self, n, ji, Kind::Iopath), of(self, n, ji, Kind::Nvmf));
                let _ = writeln!(
                    s,
                    "{:<22} {:>3} {:>28} {:>28} {:>24} {:>24}",
                    j.label(),
                    n,
                    show(sum(&a, IOPS), rate),
                    show(sum(&b, IOPS), rate),
                    show(sum(&a, CPU_PER_IO), cpu),
                    show(sum(&b, CPU_PER_IO), cpu)
                );
            }
        }
        s
    }

    pub fn json(&self) -> Value {
        let summary: Vec<Value> = self
            .cells()
            .into_iter()
            .map(|(n, ji, j)| {
                let (a, b) = (of(self, n, ji, Kind::Iopath), of(self, n, ji, Kind::Nvmf));
                let side = |rs: &[&SpdkRun]| {
                    json!({"rounds": rs.len(), "iops": sum(rs, IOPS), "avg_us": sum(rs, AVG),
                           "p50_us": sum(rs, P50), "p99_us": sum(rs, P99), "cpu_us_per_io": sum(rs, CPU_PER_IO)})
                };
                json!({
                    "job": ji,
                    "controllers": n,
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
        let device = Io { commands: (iops * 2.0) as u64, ..Io::default() };
        SpdkRun {
            target,
            controllers: 1,
            job: 0,
            round,
            perf,
            device,
            target_cpu_ns: 2_000_000_000,
            check: String::new(),
            perf_pid: 1,
        }
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

    #[test]
    fn several_controller_counts_get_a_table_each_and_one_of_iops_and_cpu_per_io() {
        let o = SpdkOptions {
            jobs: vec![PerfJob { rw: "randread".into(), bs: 512, iodepth: 16 }],
            controllers: vec![1, 4],
            rounds: 1,
            ..Default::default()
        };
        let mut runs = vec![run(Kind::Iopath, 0, 100e3, 10.0), run(Kind::Nvmf, 0, 200e3, 5.0)];
        for (t, iops) in [(Kind::Iopath, 400e3), (Kind::Nvmf, 300e3)] {
            runs.push(SpdkRun { controllers: 4, ..run(t, 0, iops, 10.0) });
        }
        let r = SpdkResult {
            partial: false,
            host: crate::host::host_info(0),
            options: o,
            peers: "/p".into(),
            server_pids: vec![],
            runs,
            errors: vec![],
        };
        let t = r.table();
        assert!(t.contains("randread 512 qd16, 4 controllers"), "{t}");
        // 2 s of CPU over 2 s x IOPS commands: 10 us at 100 k IOPS, 2.5 at 400 k, 3.333 at 300 k.
        let line = t.lines().find(|l| l.starts_with("randread 512 qd16") && l.contains("   4 ")).unwrap();
        assert!(
            line.contains("400.0 k") && line.contains("300.0 k") && line.contains("2.500") && line.contains("3.333"),
            "{line}"
        );
        let v = r.json();
        assert_eq!(
            (v["summary"][1]["controllers"].as_u64(), v["summary"][1]["iopath"]["iops"]["median"].as_f64()),
            (Some(4), Some(400e3))
        );
        assert_eq!(v["summary"][0]["iopath"]["cpu_us_per_io"]["median"], 10.0);
    }
}
