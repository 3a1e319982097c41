//! SPDK's stock `spdk_nvme_perf`: its command line for one job and what it
//! prints (the `Total` line and, with `-L`, the latency percentiles).

use serde::Serialize;

/// Hugepage memory perf reserves at start (`-s`, MiB); it grows on demand.
pub const PERF_MEM_MB: u32 = 16;

/// One perf job: pattern, block size and queue depth on one qpair.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct PerfJob {
    pub rw: String,
    pub bs: u64,
    pub iodepth: u32,
}

impl PerfJob {
    pub fn label(&self) -> String {
        let bs = if self.bs.is_multiple_of(1024) { format!("{}k", self.bs / 1024) } else { self.bs.to_string() };
        format!("{} {bs} qd{}", self.rw, self.iodepth)
    }
}

/// perf's arguments: a `-r` for each of `trids`, the job for `secs` seconds on
/// one qpair per controller's namespace (each at the job's queue depth), on
/// core `core` (`-c`), with `-g` (one hugetlbfs file per memory segment list,
/// which SPDK's vfio-user client needs) and `-L` (latency percentiles).
pub fn args(trids: &[String], j: &PerfJob, secs: u64, core: usize) -> Vec<String> {
    let mut a = Vec::new();
    for t in trids {
        a.push("-r".to_string());
        a.push(t.clone());
    }
    for (k, v) in [
        ("-q", j.iodepth.to_string()),
        ("-o", j.bs.to_string()),
        ("-w", j.rw.clone()),
        ("-t", secs.to_string()),
        ("-P", "1".into()),
        ("-c", format!("{:#x}", 1u64 << core)),
        ("-s", PERF_MEM_MB.to_string()),
    ] {
        a.push(k.into());
        a.push(v);
    }
    a.extend(["-g".into(), "-L".into()]);
    a
}

/// What one perf run printed: its `Total` line (IOPS, MiB/s, latency
/// average, min and max in us) and its percentiles (us).
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct PerfOut {
    pub iops: f64,
    pub mib_s: f64,
    pub avg_us: f64,
    pub min_us: f64,
    pub max_us: f64,
    pub p50_us: f64,
    pub p99_us: f64,
    pub p999_us: f64,
}

/// The first line of perf's output that reports a failed I/O or an SPDK
/// error (`*ERROR*`), if any.
pub fn error_line(out: &str) -> Option<&str> {
    out.lines().find(|l| l.contains("completed with error") || l.contains("*ERROR*")).map(str::trim)
}

/// Why perf's output is no number.
#[derive(Debug, thiserror::Error)]
pub enum PerfError {
    #[error("perf reported an error: {0}")]
    Reported(String),
    #[error("perf printed no Total line (it attached no controller?)")]
    NoTotal,
    #[error("Total line {line:?}: {word:?} is no number")]
    NotANumber { line: String, word: String },
    #[error("Total line {0:?}: want IOPS MiB/s Average min max")]
    ShortTotal(String),
    #[error("no {0}% percentile (perf runs with -L)")]
    NoPercentile(&'static str),
    #[error("{pct}%: {value:?} is no latency")]
    NotALatency { pct: &'static str, value: String },
    #[error("perf's figures do not hold together: {0:?}")]
    Inconsistent(Box<PerfOut>),
}

/// Reads perf's stdout. An output without the figures, or with a
/// completion error, is an error: such a run is no number.
pub fn parse(out: &str) -> Result<PerfOut, PerfError> {
    if let Some(l) = error_line(out) {
        return Err(PerfError::Reported(l.to_string()));
    }
    let total = out.lines().find_map(|l| l.strip_prefix("Total")).ok_or(PerfError::NoTotal)?;
    let nums: Vec<f64> = total
        .trim_start()
        .trim_start_matches(':')
        .split_whitespace()
        .map(|w| w.parse::<f64>().map_err(|_| PerfError::NotANumber { line: total.to_string(), word: w.to_string() }))
        .collect::<Result<_, _>>()?;
    let [iops, mib_s, avg_us, min_us, max_us] = nums[..] else {
        return Err(PerfError::ShortTotal(total.to_string()));
    };
    let pct = |p: &'static str| -> Result<f64, PerfError> {
        let key = format!("{p}% :");
        let v =
            out.lines().find_map(|l| l.trim_start().strip_prefix(key.as_str())).ok_or(PerfError::NoPercentile(p))?;
        v.trim()
            .trim_end_matches("us")
            .trim()
            .parse::<f64>()
            .map_err(|_| PerfError::NotALatency { pct: p, value: v.to_string() })
    };
    let r = PerfOut {
        iops,
        mib_s,
        avg_us,
        min_us,
        max_us,
        p50_us: pct("50.00000")?,
        p99_us: pct("99.00000")?,
        p999_us: pct("99.90000")?,
    };
    let finite = [r.iops, r.avg_us, r.p50_us, r.p99_us].iter().all(|v| v.is_finite() && *v > 0.0);
    if !finite || r.p50_us > r.p99_us || r.p99_us > r.p999_us {
        return Err(PerfError::Inconsistent(Box::new(r)));
    }
    Ok(r)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// spdk_nvme_perf v25.09's output, 4 KiB randread QD16 against nvmf_tgt here.
    const OUT: &str = "Initializing NVMe Controllers
Attached to NVMeoF Controller at VFIOUSER (/tmp/spdkprobe/ctrl)
Associating VFIOUSER (/tmp/spdkprobe/ctrl) NSID 1 with lcore 0
Initialization complete. Launching workers.
========================================================
                                                                                      Latency(us)
Device Information                                :       IOPS      MiB/s    Average        min        max
VFIOUSER (/tmp/spdkprobe/ctrl) NSID 1 from core  0:   57293.06     223.80     283.46       2.85   80020.19
========================================================
Total                                             :   57293.06     223.80     283.46       2.85   80020.19

Summary latency data for VFIOUSER (/tmp/spdkprobe/ctrl) NSID 1       from core 0:
=================================================================================
  1.00000% :     3.605us
 10.00000% :     4.153us
 50.00000% :     4.885us
 99.00000% :    73.143us
 99.50000% : 24074.449us
 99.90000% : 44082.991us
 99.99000% : 80034.168us
";

    #[test]
    fn perf_output_gives_the_total_and_percentiles() {
        let p = parse(OUT).unwrap();
        assert_eq!((p.iops, p.mib_s, p.avg_us, p.min_us, p.max_us), (57293.06, 223.80, 283.46, 2.85, 80020.19));
        assert_eq!((p.p50_us, p.p99_us, p.p999_us), (4.885, 73.143, 44082.991));
    }

    #[test]
    fn an_output_without_figures_or_with_errors_is_no_number() {
        assert!(parse("Initializing NVMe Controllers\n").unwrap_err().to_string().contains("no Total"));
        let no_pct: String = OUT.lines().filter(|l| !l.contains('%')).map(|l| format!("{l}\n")).collect();
        assert!(parse(&no_pct).unwrap_err().to_string().contains("-L"));
        let err = format!("{OUT}starting I/O failed\nread completed with error (sct=0, sc=2)\n");
        assert!(parse(&err).unwrap_err().to_string().contains("completed with error"));
        let short = OUT.replace("283.46       2.85   80020.19\n\nSummary", "283.46\n\nSummary");
        assert!(parse(&short).unwrap_err().to_string().contains("want IOPS"));
        let zero = OUT.replace("Total                                             :   57293.06", "Total : 0.00");
        assert!(parse(&zero).is_err());
    }

    #[test]
    fn the_command_line_names_one_qpair_its_core_and_latency_tracking() {
        let j = PerfJob { rw: "randread".into(), bs: 512, iodepth: 64 };
        let a = args(&["trtype:VFIOUSER traddr:/x".into()], &j, 2, 1).join(" ");
        assert_eq!(a, "-r trtype:VFIOUSER traddr:/x -q 64 -o 512 -w randread -t 2 -P 1 -c 0x2 -s 16 -g -L");
        let two = args(&["trtype:VFIOUSER traddr:/x/0".into(), "trtype:VFIOUSER traddr:/x/1".into()], &j, 2, 1);
        assert!(two.join(" ").starts_with("-r trtype:VFIOUSER traddr:/x/0 -r trtype:VFIOUSER traddr:/x/1 -q 64"));
        assert_eq!(j.label(), "randread 512 qd64");
        assert_eq!(PerfJob { bs: 4096, ..j }.label(), "randread 4k qd64");
    }
}
