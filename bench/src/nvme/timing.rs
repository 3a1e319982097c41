//! `bench nvme --timing SPEC`: how closely the controller's device timing
//! model (`timing=`, `iopath_devices::block::timing`) keeps the time it
//! was configured with. Each iopath target runs twice in every round, as
//! itself and with the model (`-timed`), one right after the other; the
//! device time the guest observed is the timed run's percentile less the
//! untimed twin's 1st percentile (the path's own cost without waiting
//! behind other commands, measured in the same rounds: its median at a
//! depth above 1 is mostly that wait, which a timed command, parallel in
//! the model, does not have), from the histograms of all rounds merged.
//!
//! The device's own view comes beside it: its `timing.*` counters
//! ([`DeviceTiming`]), each timed completion's device time (posted −
//! fetched) and lateness (posted − due) on the controller's clock, medians
//! over the rounds. Where the guest's figure is off and the device's is
//! not, the time was lost between the device and the guest's histogram
//! (the vCPU not running, the guest's own queueing), not in the model.
//!
//! A row is within bounds when the observed p50 and p99 are within 2 % or
//! 1 us of the configured ones (whichever is larger), and the IOPS and
//! bandwidth ceilings, where configured and reached, within 2 %. Where the
//! job keeps more commands in flight than the model has channels, commands
//! wait for a channel: the observed time then includes that queueing and
//! the row says `queued` instead of judging the latency; where the IOPS
//! ceiling is below what the latency allows at the job's depth, commands
//! wait for their slot (`paced`), and only the ceiling is judged.

use super::table::percentiles;
use super::{Job, NvmeResult, NvmeRun};
use iopath_devices::block::timing::{Latency, OpKind, TimingSpec};
use serde::Serialize;
use std::fmt::Write;

/// The suffix of a target run with the model.
pub const TIMED: &str = "-timed";
/// Relative bound on the latencies and ceilings.
pub const REL: f64 = 0.02;
/// Absolute bound on the latencies, ns.
pub const ABS_NS: f64 = 1000.0;

/// A timed run's device-side figures (ns), from its counters.
#[derive(Clone, Copy, Debug, Serialize, PartialEq)]
pub struct DeviceTiming {
    pub posted: u64,
    pub device_p50_ns: u64,
    pub device_p99_ns: u64,
    pub late_p50_ns: u64,
    pub late_p99_ns: u64,
    pub late_max_ns: u64,
}

impl DeviceTiming {
    /// From the device's counters (`c(name)`); None without them.
    pub fn from_counters(c: impl Fn(&str) -> Option<u64>) -> Option<DeviceTiming> {
        Some(DeviceTiming {
            posted: c("timing.posted")?,
            device_p50_ns: c("timing.device-p50-ns")?,
            device_p99_ns: c("timing.device-p99-ns")?,
            late_p50_ns: c("timing.late-p50-ns")?,
            late_p99_ns: c("timing.late-p99-ns")?,
            late_max_ns: c("timing.late-max-ns")?,
        })
    }
}

/// One job and target, configured against observed.
#[derive(Clone, Debug, Serialize)]
pub struct TimingRow {
    pub job: usize,
    /// The untimed target (its timed twin is `{target}-timed`).
    pub target: String,
    pub op: &'static str,
    pub configured_p50_ns: f64,
    pub configured_p99_ns: f64,
    /// The untimed twin's 1st percentile: the path's own cost.
    pub base_p1_ns: f64,
    pub timed_p50_ns: f64,
    pub timed_p99_ns: f64,
    pub observed_p50_ns: f64,
    pub observed_p99_ns: f64,
    /// The device's own p50 / p99 (posted − fetched) and lateness p99
    /// (posted − due), medians over the rounds (NaN: no counters).
    pub device_p50_ns: f64,
    pub device_p99_ns: f64,
    pub late_p99_ns: f64,
    pub late_max_ns: f64,
    /// More commands in flight than channels: latency not judged.
    pub queued: bool,
    /// The IOPS ceiling is below what the latency alone allows at this
    /// depth: commands wait for their slot, latency not judged.
    pub paced: bool,
    pub latency_ok: Option<bool>,
    /// The same judgement of the device's own figures.
    pub device_ok: Option<bool>,
    /// The timed run's median IOPS and MB/s over rounds.
    pub iops: f64,
    pub mb_s: f64,
    pub iops_ceiling: Option<f64>,
    pub mb_s_ceiling: Option<f64>,
    /// Whether the ceiling holds, where the job reached it (None: not configured or not reached).
    pub ceiling_ok: Option<bool>,
    /// The timed runs' device threads' and vCPU's run-queue wait, % of the
    /// window, medians (NaN: not measured): the time the host took from the
    /// two threads a completion's due time depends on. A completion due while
    /// its poller waits is posted late, one due while the vCPU waits is seen late.
    pub device_waited_pct: f64,
    pub vcpu_waited_pct: f64,
}

/// The operation a job's commands are (a randrw job: its reads).
fn op_of(j: &Job) -> OpKind {
    match j.rw.as_str() {
        "write" | "randwrite" => OpKind::Write,
        _ => OpKind::Read,
    }
}

/// A latency's p50 and p99, ns.
pub fn quantiles(l: Latency) -> (f64, f64) {
    match l {
        Latency::Constant(v) => (v as f64, v as f64),
        Latency::Uniform { lo, hi } => {
            let (lo, hi) = (lo as f64, hi as f64);
            (lo + 0.5 * (hi - lo), lo + 0.99 * (hi - lo))
        }
        // Exactly the two given (the model draws exp(mu + sigma z)).
        Latency::LogNormal { p50, p99 } => (p50 as f64, p99 as f64),
    }
}

/// Within `REL` or `ABS_NS` of `want`.
pub fn close(got: f64, want: f64) -> bool {
    (got - want).abs() <= (want * REL).max(ABS_NS)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.retain(|x| x.is_finite());
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// The rows of `res` (none without `--timing`).
pub fn rows(res: &NvmeResult) -> Vec<TimingRow> {
    let Some(spec) = &res.options.timing else { return Vec::new() };
    let mut out = Vec::new();
    for (ji, j) in res.options.jobs.iter().enumerate() {
        let of =
            |name: &str| -> Vec<&NvmeRun> { res.runs.iter().filter(|r| r.job == ji && r.target == name).collect() };
        let mut timed: Vec<&str> = res.runs.iter().filter(|r| r.job == ji).map(|r| r.target.as_str()).collect();
        timed.retain(|t| t.contains(TIMED));
        timed.sort_unstable();
        timed.dedup();
        for t in timed {
            let base = t.replacen(TIMED, "", 1);
            let (tr, br) = (of(t), of(&base));
            if tr.is_empty() || br.is_empty() {
                continue;
            }
            out.push(row(spec, j, ji, &base, &tr, &br, res.tsc_khz));
        }
    }
    out
}

fn row(spec: &TimingSpec, j: &Job, ji: usize, base: &str, tr: &[&NvmeRun], br: &[&NvmeRun], tsc: u64) -> TimingRow {
    let op = op_of(j);
    let (c50, c99) = spec.latency(op).map_or((0.0, 0.0), quantiles);
    let [t50, t99, _] = percentiles(tr, tsc);
    let b1 = if br.iter().all(|r| r.io.lat.is_some()) {
        super::LatHist::merged(br.iter().filter_map(|r| r.io.lat.as_ref())).quantile_ns(0.01, tsc)
    } else {
        median(br.iter().filter_map(|r| r.io.lat_min_ns).collect())
    };
    let (o50, o99) = (t50 - b1, t99 - b1);
    let in_flight = j.iodepth as u64 * j.queues as u64;
    let queued = spec.channels.is_some_and(|c| in_flight > c as u64);
    let dev = |f: fn(&DeviceTiming) -> u64| {
        median(tr.iter().filter_map(|r| r.device_timing.as_ref()).map(|d| f(d) as f64).collect())
    };
    let (d50, d99) = (dev(|d| d.device_p50_ns), dev(|d| d.device_p99_ns));
    let iops = median(tr.iter().map(|r| r.io.iops).collect());
    let mb_s = median(tr.iter().map(|r| r.io.mb_s).collect());
    let iops_ceiling = spec.iops.map(|v| v as f64);
    let mb_s_ceiling = spec.bw.map(|v| v as f64 / 1e6);
    // A ceiling is judged where the job pressed against it: the untimed
    // path is faster than it, and the model's latency alone would allow more.
    let base_iops = median(br.iter().map(|r| r.io.iops).collect());
    let latency_bound = if c50 > 0.0 { in_flight as f64 / (c50 / 1e9) } else { f64::INFINITY };
    let paced = iops_ceiling.is_some_and(|c| latency_bound < f64::INFINITY && latency_bound > c);
    let judged = !queued && !paced && spec.latency(op).is_some();
    let ceiling = |cap: Option<f64>, got: f64, per_io: f64| {
        cap.filter(|&c| base_iops * per_io > c && latency_bound * per_io > c).map(|c| (got - c).abs() <= c * REL)
    };
    let ceiling_ok = match (ceiling(iops_ceiling, iops, 1.0), ceiling(mb_s_ceiling, mb_s, j.bs as f64 / 1e6)) {
        (None, None) => None,
        (a, b) => Some(a.unwrap_or(true) && b.unwrap_or(true)),
    };
    TimingRow {
        job: ji,
        target: base.to_string(),
        op: op.name(),
        configured_p50_ns: c50,
        configured_p99_ns: c99,
        base_p1_ns: b1,
        timed_p50_ns: t50,
        timed_p99_ns: t99,
        observed_p50_ns: o50,
        observed_p99_ns: o99,
        device_p50_ns: d50,
        device_p99_ns: d99,
        late_p99_ns: dev(|d| d.late_p99_ns),
        late_max_ns: dev(|d| d.late_max_ns),
        queued,
        paced,
        latency_ok: judged.then(|| close(o50, c50) && close(o99, c99)),
        device_ok: (judged && d50.is_finite()).then(|| close(d50, c50) && close(d99, c99)),
        iops,
        mb_s,
        iops_ceiling,
        mb_s_ceiling,
        ceiling_ok,
        device_waited_pct: median(tr.iter().filter_map(|r| r.device_waited_pct).collect()),
        vcpu_waited_pct: median(tr.iter().filter_map(|r| r.vcpu_waited_pct).collect()),
    }
}

/// The rows as a table, after the main one.
pub fn table(res: &NvmeResult, rows: &[TimingRow]) -> String {
    let mut s = String::new();
    let Some(spec) = &res.options.timing else { return s };
    let _ = writeln!(
        s,
        "\ndevice timing model: timing={spec}; guest = the -timed run's percentile less its untimed twin's p1, all rounds' I/Os; \
         dev = the device's own (posted - fetched; late = posted - due), median of rounds; within {:.0} % or {:.0} us; \
         waited: the timed runs' device threads' and vCPU's run-queue wait as a share of the window (a completion due \
         while its poller waits is posted late; one posted while the vCPU waits is seen late)",
        REL * 100.0,
        ABS_NS / 1000.0
    );
    let _ = writeln!(
        s,
        "{:<24} {:<20} {:>5} {:>26} {:>26} {:>9} {:>17} {:>11} {:>9} {:>8} {:>15}",
        "job",
        "target",
        "op",
        "p50 conf/guest/dev us",
        "p99 conf/guest/dev us",
        "twin p1",
        "late p99/max us",
        "guest/dev",
        "IOPS",
        "ceiling",
        "waited dev/vCPU"
    );
    let us = |ns: f64| ns / 1000.0;
    for r in rows {
        let j = &res.options.jobs[r.job];
        let verdict = |v: Option<bool>, none: &str| match v {
            Some(true) => "ok".to_string(),
            Some(false) => "OFF".to_string(),
            None => none.to_string(),
        };
        let lat = if r.queued {
            "queued".to_string()
        } else if r.paced {
            "paced".to_string()
        } else {
            format!("{}/{}", verdict(r.latency_ok, "-"), verdict(r.device_ok, "-"))
        };
        let _ = writeln!(
            s,
            "{:<24} {:<20} {:>5} {:>8.2}/{:>8.2}/{:>8.2} {:>8.2}/{:>8.2}/{:>8.2} {:>9.2} {:>8.2}/{:>8.2} {:>11} {:>9.0} {:>8} {:>15}",
            j.label(),
            r.target,
            r.op,
            us(r.configured_p50_ns),
            us(r.observed_p50_ns),
            us(r.device_p50_ns),
            us(r.configured_p99_ns),
            us(r.observed_p99_ns),
            us(r.device_p99_ns),
            us(r.base_p1_ns),
            us(r.late_p99_ns),
            us(r.late_max_ns),
            lat,
            r.iops,
            verdict(r.ceiling_ok, "-"),
            super::table::waited(
                Some(r.device_waited_pct).filter(|p| p.is_finite()),
                Some(r.vcpu_waited_pct).filter(|p| p.is_finite())
            ),
        );
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_distribution_gives_its_configured_quantiles() {
        assert_eq!(quantiles(Latency::Constant(10_000)), (10_000.0, 10_000.0));
        assert_eq!(quantiles(Latency::Uniform { lo: 0, hi: 100_000 }), (50_000.0, 99_000.0));
        assert_eq!(quantiles(Latency::LogNormal { p50: 80_000, p99: 300_000 }), (80_000.0, 300_000.0));
    }

    #[test]
    fn the_bound_is_two_percent_or_one_microsecond() {
        assert!(close(10_900.0, 10_000.0), "0.9 us off 10 us: within 1 us");
        assert!(!close(11_100.0, 10_000.0));
        assert!(close(101_900.0, 100_000.0), "1.9 % of 100 us");
        assert!(!close(102_100.0, 100_000.0));
    }
}
