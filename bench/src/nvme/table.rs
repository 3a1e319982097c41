//! `bench nvme`'s table and JSON.

use super::{is_fio_target, placement, LatHist, NvmeResult, NvmeRun, FIO_BUSY_TARGET, FIO_TARGET};
use crate::stats::summarize;
use serde_json::{json, Value};
use std::fmt::Write as _;

pub(super) fn fmt_rate(v: f64) -> String {
    if v >= 1e6 {
        format!("{:.2} M", v / 1e6)
    } else {
        format!("{:.1} k", v / 1e3)
    }
}

pub(super) fn fmt_ns(v: f64) -> String {
    if !v.is_finite() {
        "-".into()
    } else if v >= 1000.0 {
        format!("{:.2} us", v / 1000.0)
    } else {
        format!("{v:.0} ns")
    }
}

/// The share of a CPU (percent) the guest's vCPU thread got in a run's
/// timed window: its CPU time per I/O times the I/Os per second.
fn vcpu_pct(r: &NvmeRun) -> Option<f64> {
    r.vcpu_ns_per_io.filter(|_| r.io.iops.is_finite()).map(|ns| ns * r.io.iops / 1e7)
}

/// Contention levels as given: "0,2".
fn levels(l: &[u32]) -> String {
    l.iter().map(|n| n.to_string()).collect::<Vec<_>>().join(",")
}

/// A ratio's median over rounds with its range: "1.02x [0.85 .. 1.29]".
fn show_ratio(x: Option<crate::stats::Summary>) -> String {
    x.map_or("-".to_string(), |x| format!("{:.2}x [{:.2} .. {:.2}]", x.median, x.min, x.max))
}

/// Device threads' and vCPU's run-queue wait, % of the window: "1.2/0.4 %".
pub(crate) fn waited(dev: Option<f64>, vcpu: Option<f64>) -> String {
    let f = |x: Option<f64>| x.map_or("-".to_string(), |p| format!("{p:.1}"));
    format!("{}/{} %", f(dev), f(vcpu))
}

/// A target's latency over its rounds: p50, p99, p99.9 in ns.
///
/// From the rounds' merged histogram (every I/O of every round, each
/// percentile interpolated linearly within its bucket), not a median of
/// per-round percentiles. Rows without a histogram (a fio without json+
/// bins) take the median of their rounds' own percentiles.
pub fn percentiles(rs: &[&NvmeRun], tsc_khz: u64) -> [f64; 3] {
    let qs = [0.5, 0.99, 0.999];
    if rs.iter().all(|r| r.io.lat.is_some()) {
        let m = LatHist::merged(rs.iter().filter_map(|r| r.io.lat.as_ref()));
        return qs.map(|q| m.quantile_ns(q, tsc_khz));
    }
    let med = |f: fn(&NvmeRun) -> f64| NvmeResult::median(rs, f);
    [med(|r| r.io.p50_ns), med(|r| r.io.p99_ns), med(|r| r.io.p999_ns)]
}

/// The mean latency over all rounds' I/Os.
fn lat_avg(rs: &[&NvmeRun]) -> f64 {
    // Counts come from the guest: added without overflow.
    let ios = rs.iter().fold(0u64, |a, r| a.saturating_add(r.io.ios));
    rs.iter().map(|r| r.io.lat_avg_ns * r.io.ios as f64).sum::<f64>() / ios.max(1) as f64
}

impl NvmeResult {
    /// (job, target) -> runs, in first-seen order.
    fn groups(&self) -> Vec<((usize, String), Vec<&NvmeRun>)> {
        let mut g: Vec<((usize, String), Vec<&NvmeRun>)> = Vec::new();
        for r in &self.runs {
            let k = (r.job, r.target.clone());
            match g.iter_mut().find(|(x, _)| *x == k) {
                Some((_, v)) => v.push(r),
                None => g.push((k, vec![r])),
            }
        }
        g.sort_by_key(|a| a.0 .0);
        g
    }

    /// The groups with at least one run for which `f` holds (a section's rows).
    fn groups_where(&self, f: impl Fn(&NvmeRun) -> bool) -> Vec<((usize, String), Vec<&NvmeRun>)> {
        self.groups().into_iter().filter(|(_, rs)| rs.iter().any(|r| f(r))).collect()
    }

    fn median(rs: &[&NvmeRun], f: impl Fn(&NvmeRun) -> f64) -> f64 {
        summarize(&rs.iter().map(|r| f(r)).collect::<Vec<_>>()).map(|s| s.median).unwrap_or(f64::NAN)
    }

    /// The marks of a target's rows: the worst per floor, and the spread.
    fn marks_of(&self, ji: usize, target: &str, rs: &[&NvmeRun]) -> String {
        if let Some((_, _, n, m)) = self.reruns.iter().find(|x| x.0 == ji && x.1 == target) {
            let label = crate::guard::marks_label(m);
            return if m.is_empty() { format!("clean after {n} runs") } else { format!("{label}, after {n} runs") };
        }
        let runs: Vec<NvmeRun> = rs.iter().map(|r| (*r).clone()).collect();
        crate::guard::marks_label(&super::guard::group_marks(&self.options.guard, &runs, &self.options.jobs[ji]))
    }

    pub fn table(&self) -> String {
        let mut s = String::new();
        if self.partial {
            let _ = writeln!(s, "{}", crate::interrupt::partial_line(self.runs.len()));
        }
        let _ = writeln!(s, "{}", self.host);
        let o = &self.options;
        let _ = writeln!(
            s,
            "nvme: backend {}, LBA {} B, {} s per run, {} round(s); IOPS median over rounds; 1 guest vCPU; controller pollers {:?}; contend: {}; {}",
            o.backend,
            o.lba,
            o.time_ms as f64 / 1000.0,
            o.rounds,
            o.pollers,
            levels(&o.contend),
            placement(o)
        );
        let _ = writeln!(
            s,
            "ring floor, measured first in each round ({}; each run's /floor is against one more at its depth, run just before it):",
            crate::floor::placement(self.options.pin.map(|p| p.pair()))
        );
        s.push_str(&crate::floor::floor_rows(&self.floor));
        s.push_str(&crate::wake::rows(&self.wake));
        s.push_str(&crate::guestline::rows(&self.guest_line));
        let _ = writeln!(s);
        let hdr = format!(
            "{:<24} {:<22} {:>7} {:>9} {:>11} {:>17} {:>9} {:>9} {:>9} {:>9} {:>9} {:>11}  {}",
            "job",
            "target",
            "pollers",
            "IOPS",
            "/floor",
            "/fio [min..max]",
            "MB/s",
            "lat avg",
            "p50",
            "p99",
            "p99.9",
            "exits/IO",
            "check [marks]"
        );
        let _ = writeln!(s, "{hdr}");
        let _ = writeln!(s, "{}", "-".repeat(hdr.len() + 30));
        for ((ji, target), rs) in self.groups() {
            let j = &o.jobs[ji];
            let epi = rs.iter().filter_map(|r| r.exits_per_io).collect::<Vec<_>>();
            let epi = summarize(&epi).map(|x| format!("{:.6}", x.median)).unwrap_or_else(|| "-".into());
            let ok = if rs.iter().all(|r| r.routing_ok) { "ok" } else { "WRONG" };
            // The median over rounds of each round's IOPS / that round's floor.
            let fr = rs.iter().filter_map(|r| r.floor_ratio).collect::<Vec<_>>();
            let fr = summarize(&fr).map(|x| format!("{:.2}x floor", x.median)).unwrap_or_else(|| "-".into());
            // With a think time the I/Os meet an idle controller: their p50 over the wake-up floor's.
            let wr = summarize(&rs.iter().filter_map(|r| r.wake_ratio).collect::<Vec<_>>());
            let fr = if j.thinktime_us > 0 { wr.map_or("-".into(), |x| format!("{:.2}x wake", x.median)) } else { fr };
            // The same over the host's fio on the same file (file backend).
            let ff = rs.iter().filter_map(|r| r.fio_ratio).collect::<Vec<_>>();
            let ff = summarize(&ff)
                .map(|x| format!("{:.2} [{:.2}..{:.2}]", x.median, x.min, x.max))
                .unwrap_or_else(|| "-".into());
            let [p50, p99, p999] = percentiles(&rs, self.tsc_khz);
            let marks = self.marks_of(ji, &target, &rs);
            let marks = if marks.is_empty() { String::new() } else { format!(" [{marks}]") };
            let _ = writeln!(
                s,
                "{:<24} {:<22} {:>7} {:>9} {:>11} {:>17} {:>9.0} {:>9} {:>9} {:>9} {:>9} {:>11}  {ok}{marks} {}",
                j.label(),
                target,
                rs[0].pollers,
                fmt_rate(Self::median(&rs, |r| r.io.iops)),
                fr,
                ff,
                Self::median(&rs, |r| r.io.mb_s),
                fmt_ns(lat_avg(&rs)),
                fmt_ns(p50),
                fmt_ns(p99),
                fmt_ns(p999),
                epi,
                rs[0].routing
            );
            s.push_str(&super::split::rows(&rs, &target, self.tsc_khz));
        }
        let setup = summarize(&self.runs.iter().filter_map(|r| r.setup_exits.map(|x| x as f64)).collect::<Vec<_>>());
        let _ = writeln!(
            s,
            "lat avg over every I/O of every round; p50/p99/p99.9 from the rounds' merged latency histogram \
             (nvmeperf's buckets, 1/64 of a power of two), interpolated linearly within the bucket{}",
            if self.runs.iter().any(|r| is_fio_target(&r.target)) {
                "; fio's from its json+ bins put in the same buckets (or, without them, its own, median over rounds)"
            } else {
                ""
            }
        );
        let _ = writeln!(
            s,
            "exits/IO: VMM exits in the guest's timed window per I/O (setup and output apart: median {} exits a run)",
            setup.map_or("-".into(), |x| format!("{:.0}", x.median))
        );
        let _ = writeln!(
            s,
            "marks: IOPS above the round's ring floor (cost < {:.2}x of it), QD1 p50 under {:.2}x the floor's, \
             or rounds' IOPS max/min > {:.1}: the target runs again (up to {} times) before a mark stays",
            o.guard.min_floor_ratio, o.guard.min_floor_ratio, o.guard.max_spread, o.guard.reruns
        );
        self.vmm_table(&mut s);
        self.guest_line_table(&mut s);
        self.quiet_table(&mut s);
        self.fio_table(&mut s);
        self.cpu_table(&mut s);
        self.think_table(&mut s);
        self.ratio_lines(&mut s);
        super::state::table(self, &mut s);
        s.push_str(&super::timing::table(self, &super::timing::rows(self)));
        if !self.skipped.is_empty() {
            let _ = writeln!(s, "\nskipped:");
            for e in &self.skipped {
                let _ = writeln!(s, "  {e}");
            }
        }
        if !self.errors.is_empty() {
            let _ = writeln!(s, "\nerrors:");
            for e in &self.errors {
                let _ = writeln!(s, "  {e}");
            }
        }
        s
    }

    /// iopath-adaptive (the default mode) and iopath-shm over QEMU and over
    /// fio at each contention level, naming what each side stood on.
    fn ratio_lines(&self, s: &mut String) {
        for (ji, j) in self.options.jobs.iter().enumerate() {
            for &n in &self.options.contend {
                let sfx = super::contend_suffix(&self.options, n);
                let side = |t: &str| {
                    let t = format!("{t}{sfx}");
                    let rs: Vec<&NvmeRun> = self.runs.iter().filter(|r| r.job == ji && r.target == t).collect();
                    (!rs.is_empty()).then(|| (Self::median(&rs, |r| r.io.iops), rs[0].setup.clone()))
                };
                for ours in ["iopath-adaptive", "iopath-shm"] {
                    let Some((a, sa)) = side(ours) else { continue };
                    for peer in ["qemu", FIO_TARGET, FIO_BUSY_TARGET] {
                        if let Some((q, sq)) = side(peer) {
                            let _ = writeln!(
                                s,
                                "{}: {ours}{sfx} / {peer}{sfx} IOPS = {:.2}x ({sa} / {sq})",
                                j.label(),
                                a / q
                            );
                        }
                    }
                }
            }
        }
    }

    /// Rows beside busy threads over their quiet twins, round by round,
    /// with the share of a CPU the guest's vCPU thread got in each: a guest
    /// that does a fixed amount of work per I/O cannot go faster than its
    /// vCPU runs, so with a polling guest (always runnable) IOPS over quiet
    /// is bounded by about the ratio of the two shares.
    fn quiet_table(&self, s: &mut String) {
        let groups = self.groups_where(|r| r.quiet_ratio.is_some() || r.quiet_floor_ratio.is_some());
        if groups.is_empty() {
            return;
        }
        let _ = writeln!(
            s,
            "\nbeside busy threads over quiet (the same target without them, same job and round, run just before): median [min .. max] of IOPS (same attempt), and of /floor (each run over the floor run just before it, which runs quiet); vCPU: the share of a CPU the guest's vCPU thread got in the timed window, median over rounds, beside busy threads / quiet"
        );
        let pct = |rs: &[&NvmeRun]| summarize(&rs.iter().filter_map(|r| vcpu_pct(r)).collect::<Vec<_>>());
        for ((ji, target), rs) in groups {
            let v = summarize(&rs.iter().filter_map(|r| r.quiet_ratio).collect::<Vec<_>>());
            let f = summarize(&rs.iter().filter_map(|r| r.quiet_floor_ratio).collect::<Vec<_>>());
            let base = super::base_target(rs[0]);
            let quiet: Vec<&NvmeRun> = self.runs.iter().filter(|r| r.job == ji && r.target == base).collect();
            let cpu = match (pct(&rs), pct(&quiet)) {
                (Some(b), Some(q)) => format!("{:.0} % / {:.0} %", b.median, q.median),
                _ => "-".into(),
            };
            let label = self.options.jobs[ji].label();
            let _ = writeln!(
                s,
                "{label:<24} {target:<26} IOPS {:<22} /floor {:<22} vCPU {cpu}",
                show_ratio(v),
                show_ratio(f)
            );
        }
    }

    /// QD1 runs: p50 over the guest line floor measured just before each.
    fn guest_line_table(&self, s: &mut String) {
        let groups = self.groups_where(|r| r.guest_line_ratio.is_some());
        if groups.is_empty() {
            return;
        }
        let _ = writeln!(
            s,
            "\nQD1 p50 over the guest line floor measured just before the run (one line there and back between the guest and a host thread; a command moves at least three): median [min .. max]"
        );
        for ((ji, target), rs) in groups {
            let v = summarize(&rs.iter().filter_map(|r| r.guest_line_ratio).collect::<Vec<_>>());
            let label = self.options.jobs[ji].label();
            let _ = writeln!(s, "{label:<24} {target:<26} p50 {}", show_ratio(v));
        }
    }

    /// Out-of-process rows over their in-VMM twins, round by round.
    fn vmm_table(&self, s: &mut String) {
        let groups = self.groups_where(|r| r.vmm_ratio.is_some() || r.vmm_floor_ratio.is_some());
        if groups.is_empty() {
            return;
        }
        let _ = writeln!(
            s,
            "\nout of process over in the VMM (same mode, job and round): median [min .. max] of IOPS (same attempt), and of /floor (each run over the floor run just before it)"
        );
        for ((ji, target), rs) in groups {
            let v = summarize(&rs.iter().filter_map(|r| r.vmm_ratio).collect::<Vec<_>>());
            let f = summarize(&rs.iter().filter_map(|r| r.vmm_floor_ratio).collect::<Vec<_>>());
            let label = self.options.jobs[ji].label();
            let _ = writeln!(s, "{label:<24} {target:<26} IOPS {:<22} /floor {}", show_ratio(v), show_ratio(f));
        }
    }

    /// File rows over the host's two fio rows, round by round: alone, and
    /// beside a busy CPU where a polling guest's vCPU would be busy.
    fn fio_table(&self, s: &mut String) {
        let groups = self.groups_where(|r| r.fio_busy_ratio.is_some());
        if groups.is_empty() {
            return;
        }
        let busy = self.runs.iter().find(|r| r.target == FIO_BUSY_TARGET).map_or("", |r| r.routing.as_str());
        let _ = writeln!(
            s,
            "\nover the host's fio (same job and round): median [min .. max] of IOPS over {FIO_TARGET}, and over \
             {FIO_BUSY_TARGET}: {busy}"
        );
        for ((ji, target), rs) in groups {
            let f = summarize(&rs.iter().filter_map(|r| r.fio_ratio).collect::<Vec<_>>());
            let b = summarize(&rs.iter().filter_map(|r| r.fio_busy_ratio).collect::<Vec<_>>());
            let label = self.options.jobs[ji].label();
            let _ = writeln!(s, "{label:<24} {target:<26} /fio {:<22} /fio busy CPU {}", show_ratio(f), show_ratio(b));
        }
    }

    /// Device threads' CPU per group: per I/O in the window, idle, and waited.
    fn cpu_table(&self, s: &mut String) {
        let groups = self.groups_where(|r| r.device_threads > 0 || r.vcpu_ns_per_io.is_some());
        if groups.is_empty() {
            return;
        }
        let _ = writeln!(
            s,
            "\ndevice threads' CPU ({}; QEMU's {}; fio's own for the fio rows) and the vCPU thread's, per I/O in \
             the guest's timed window, median over rounds (a polling guest's vCPU spins: its figure is the window \
             over the I/Os); idle CPU: the device threads in a pause after it; waited: the device threads' and the \
             vCPU's run-queue wait in the window as a share of it (runnable, another thread on their CPU: time the \
             host took from them); contend: {}",
            crate::cpu::NVME_DEVICE_THREADS.join(", "),
            crate::pin::QEMU_DEVICE_THREADS.join(", "),
            levels(&self.options.contend)
        );
        let _ = writeln!(
            s,
            "{:<24} {:<22} {:>7} {:>11} {:>11} {:>9} {:>15}",
            "job", "target", "threads", "CPU/IO", "vCPU/IO", "idle CPU", "waited dev/vCPU"
        );
        for ((ji, target), rs) in groups {
            let med = |f: fn(&NvmeRun) -> Option<f64>| {
                summarize(&rs.iter().filter_map(|r| f(r)).collect::<Vec<_>>()).map(|x| x.median)
            };
            let _ = writeln!(
                s,
                "{:<24} {:<22} {:>7} {:>11} {:>11} {:>9} {:>15}",
                self.options.jobs[ji].label(),
                target,
                rs.iter().map(|r| r.device_threads).max().unwrap_or(0),
                med(|r| r.cpu_ns_per_io).map_or("-".into(), fmt_ns),
                med(|r| r.vcpu_ns_per_io).map_or("-".into(), fmt_ns),
                med(|r| r.idle_cpu_pct).map_or("-".into(), |p| format!("{p:.1} %")),
                waited(med(|r| r.device_waited_pct), med(|r| r.vcpu_waited_pct)),
            );
        }
    }

    /// Think-time jobs: each command meets a controller idle for the think
    /// time, so its latency is the wake-up's; per target, the guest
    /// driver's kind, how many commands, their latency from the rounds'
    /// merged histogram, and what the device threads spent idle.
    fn think_table(&self, s: &mut String) {
        let groups: Vec<_> = self
            .groups()
            .into_iter()
            .filter(|((ji, t), _)| self.options.jobs[*ji].thinktime_us > 0 && !is_fio_target(t))
            .collect();
        if groups.is_empty() {
            return;
        }
        let _ = writeln!(
            s,
            "\nthe first command after an idle think time (its latency is the wake-up's): driver: shadow doorbells or \
             register stores (nvmeperf dbbuf=1/0, as the guest ran); cmds: commands over all rounds (the first of \
             each run follows setup, not an idle spell); p50/p99/max from the rounds' merged histogram; idle CPU: \
             the device threads in the {} ms pause after the window, median [min .. max] over rounds; window CPU: \
             their CPU over the timed window (think times and wake-ups) as a share of one core, median",
            super::IDLE_WINDOW.as_millis()
        );
        let hdr = format!(
            "{:<34} {:<30} {:<9} {:>5} {:>10} {:>10} {:>10} {:>22} {:>10}",
            "job", "target", "driver", "cmds", "p50", "p99", "max", "idle CPU", "window CPU"
        );
        let _ = writeln!(s, "{hdr}");
        for ((ji, target), rs) in groups {
            let driver = match rs[0].guest_dbbuf {
                Some(true) => "shadow",
                Some(false) => "registers",
                None => "-",
            };
            let merged = LatHist::merged(rs.iter().filter_map(|r| r.io.lat.as_ref()));
            let q = |x: f64| fmt_ns(merged.quantile_ns(x, self.tsc_khz));
            let idle = summarize(&rs.iter().filter_map(|r| r.idle_cpu_pct).collect::<Vec<_>>())
                .map_or("-".into(), |x| format!("{:.2} % [{:.2} .. {:.2}]", x.median, x.min, x.max));
            let window = summarize(
                &rs.iter().filter_map(|r| r.cpu_ns_per_io.map(|ns| ns * r.io.iops / 1e7)).collect::<Vec<_>>(),
            )
            .map_or("-".into(), |x| format!("{:.2} %", x.median));
            let _ = writeln!(
                s,
                "{:<34} {:<30} {:<9} {:>5} {:>10} {:>10} {:>10} {:>22} {:>10}",
                self.options.jobs[ji].label(),
                target,
                driver,
                rs.iter().fold(0u64, |a, r| a.saturating_add(r.io.ios)),
                q(0.5),
                q(0.99),
                q(1.0),
                idle,
                window
            );
        }
    }

    /// Per target: the merged-histogram percentiles the table shows, and the marks.
    fn summary_json(&self) -> Vec<Value> {
        self.groups()
            .into_iter()
            .map(|((ji, target), rs)| {
                let [p50, p99, p999] = percentiles(&rs, self.tsc_khz);
                let merged = LatHist::merged(rs.iter().filter_map(|r| r.io.lat.as_ref()));
                let runs: Vec<NvmeRun> = rs.iter().map(|r| (*r).clone()).collect();
                let marks = match self.reruns.iter().find(|x| x.0 == ji && x.1 == target) {
                    Some((_, _, _, m)) => m.clone(),
                    None => super::guard::group_marks(&self.options.guard, &runs, &self.options.jobs[ji]),
                };
                let mut v = json!({
                    "job": ji,
                    "target": target,
                    "setup": rs[0].setup,
                    "rounds": rs.len(),
                    "attempts": self.reruns.iter().find(|x| x.0 == ji && x.1 == target).map_or(1, |x| x.2),
                    "iops": summarize(&rs.iter().map(|r| r.io.iops).collect::<Vec<_>>()),
                    "ios": rs.iter().fold(0u64, |a, r| a.saturating_add(r.io.ios)),
                    "lat_avg_ns": lat_avg(&rs),
                    "p50_ns": p50,
                    "p99_ns": p99,
                    "p999_ns": p999,
                    "percentiles": if rs.iter().all(|r| r.io.lat.is_some()) { "merged histogram, interpolated" } else { "median of rounds" },
                    "hist": merged.pairs_ns(self.tsc_khz),
                    "marks": crate::guard::marks_json(&marks),
                });
                // randrw: its reads and writes apart, `read` and `write`.
                if let (Some(Value::Object(d)), Some(o)) = (super::split::summary(&rs, self.tsc_khz), v.as_object_mut()) {
                    o.extend(d);
                }
                v
            })
            .collect()
    }

    pub fn json(&self) -> Value {
        let g = &self.options.guard;
        json!({
            "schema_version": crate::guard::JSON_SCHEMA_VERSION,
            "benchmark": "nvme",
            "partial": self.partial,
            "host": self.host,
            "options": self.options,
            "guard": {"min_floor_ratio": g.min_floor_ratio, "max_spread": g.max_spread, "reruns": g.reruns},
            "tsc_khz": self.tsc_khz,
            "runs": self.runs,
            "summary": self.summary_json(),
            "superseded_runs": self.superseded,
            "floor": {"placement": crate::floor::placement(self.options.pin.map(|p| p.pair())), "runs": self.floor, "wake": self.wake, "guest_line": self.guest_line, "reruns": self.refloor},
            "errors": self.errors,
            "skipped": self.skipped,
            "timing": super::timing::rows(self),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(round: u32, counts: &[(u32, u64)], p50_ns: f64) -> NvmeRun {
        let lat = LatHist { counts: counts.iter().copied().collect() };
        let mut r = NvmeRun::new("iopath-shm", "iopath ram", 0, round, lat.total(), 1);
        r.io.p50_ns = p50_ns;
        r.io.lat = Some(lat);
        r
    }

    #[test]
    fn the_tables_percentiles_come_from_the_merged_histogram() {
        // Round p50s 400, 400 and 10300 ns: their median would be 400. The
        // merged I/Os put p99 in the slow round's bucket (848: 10240..=10367)
        // and p50 in the fast one (548: 400..=403).
        let rs = [run(0, &[(548, 100)], 400.0), run(1, &[(548, 100)], 400.0), run(2, &[(848, 100)], 10300.0)];
        let refs: Vec<&NvmeRun> = rs.iter().collect();
        let [p50, p99, _] = percentiles(&refs, 1_000_000);
        assert_eq!(p50, 402.25);
        assert!(p99 > 10240.0 && p99 <= 10367.0, "{p99}");
        // Without histograms (fio's rows): the median of the rounds' own.
        let mut fio = rs.clone();
        for r in &mut fio {
            r.io.lat = None;
        }
        let refs: Vec<&NvmeRun> = fio.iter().collect();
        assert_eq!(percentiles(&refs, 1_000_000)[0], 400.0);
    }

    #[test]
    fn think_time_rows_show_the_driver_kind_the_commands_and_the_idle_cpu() {
        use super::super::{Job, NvmeOptions};
        let mut runs = Vec::new();
        for (target, dbbuf, ios, idle) in
            [("iopath-auto", true, 9, 0.1), ("iopath-auto-dbbuf0@vfio-user", false, 8, 1.2)]
        {
            for round in 0..2 {
                let mut r = run(round, &[(170, ios)], 1e6);
                r.target = target.into();
                (r.guest_dbbuf, r.idle_cpu_pct) = (Some(dbbuf), Some(idle + round as f64 / 10.0));
                (r.cpu_ns_per_io, r.io.iops) = (Some(5e6), 1.0);
                runs.push(r);
            }
        }
        let o =
            NvmeOptions { jobs: vec![Job { thinktime_us: 1_000_000, ..Job::randread(4096, 1) }], ..Default::default() };
        let r = NvmeResult {
            partial: false,
            host: crate::host::host_info(1_000_000),
            options: o,
            tsc_khz: 1_000_000,
            runs,
            superseded: vec![],
            floor: vec![],
            refloor: vec![],
            wake: vec![],
            guest_line: vec![],
            reruns: vec![],
            errors: vec![],
            skipped: vec![],
        };
        let mut s = String::new();
        r.think_table(&mut s);
        let row = |t: &str| s.lines().find(|l| l.contains(&format!(" {t} "))).unwrap_or_default().to_string();
        let (a, b) = (row("iopath-auto"), row("iopath-auto-dbbuf0@vfio-user"));
        assert!(a.contains("shadow") && a.contains(" 18 ") && a.contains("0.15 % [0.10 .. 0.20]"), "{s}");
        assert!(b.contains("registers") && b.contains(" 16 ") && b.contains("1.25 % [1.20 .. 1.30]"), "{s}");
        assert!(a.ends_with("0.50 %"), "5 ms of CPU a second: {a}");
        let mut none = String::new();
        NvmeResult { options: NvmeOptions::default(), ..r }.think_table(&mut none);
        assert!(none.is_empty(), "no think-time job, no section");
    }
}
