//! `bench nvme --state-memory on,off`: what keeping the controller's state
//! costs, each target with state memory over its `-nostate` twin (the same
//! job, round and attempt), round by round, so that both sides of a ratio
//! ran seconds apart on the same host.

use super::{NvmeResult, NvmeRun, NOSTATE};
use crate::stats::{summarize, Summary};
use std::fmt::Write as _;

/// One row: a target with state, its twin without, and their rounds.
pub(super) struct Row {
    pub job: usize,
    pub target: String,
    /// Each side's IOPS and p50 (ns) over the rounds.
    pub iops: [Option<Summary>; 2],
    pub p50: [Option<Summary>; 2],
    /// Per round: on over off, IOPS and p50.
    pub iops_ratio: Option<Summary>,
    pub p50_ratio: Option<Summary>,
}

/// The rows of every target that has a `-nostate` twin, in table order.
pub(super) fn rows(res: &NvmeResult) -> Vec<Row> {
    let mut out = Vec::new();
    let mut seen = Vec::new();
    for off in res.runs.iter().filter(|r| r.target.contains(NOSTATE)) {
        let on_name = off.target.replacen(NOSTATE, "", 1);
        if seen.contains(&(off.job, on_name.clone())) {
            continue;
        }
        seen.push((off.job, on_name.clone()));
        let side = |name: &str| -> Vec<&NvmeRun> {
            res.runs.iter().filter(|r| r.job == off.job && r.target == name).collect()
        };
        let (ons, offs) = (side(&on_name), side(&off.target));
        let pairs: Vec<(&NvmeRun, &NvmeRun)> = ons
            .iter()
            .filter_map(|a| offs.iter().find(|b| (b.round, b.attempt) == (a.round, a.attempt)).map(|b| (*a, *b)))
            .collect();
        let ratio = |f: fn(&NvmeRun) -> f64| {
            let v: Vec<f64> = pairs.iter().filter(|(_, b)| f(b) > 0.0).map(|(a, b)| f(a) / f(b)).collect();
            summarize(&v)
        };
        let each = |rs: &[&NvmeRun], f: fn(&NvmeRun) -> f64| summarize(&rs.iter().map(|r| f(r)).collect::<Vec<_>>());
        out.push(Row {
            job: off.job,
            target: on_name,
            iops: [each(&ons, |r| r.io.iops), each(&offs, |r| r.io.iops)],
            p50: [each(&ons, |r| r.io.p50_ns), each(&offs, |r| r.io.p50_ns)],
            iops_ratio: ratio(|r| r.io.iops),
            p50_ratio: ratio(|r| r.io.p50_ns),
        });
    }
    out
}

fn range(x: &Option<Summary>, f: fn(f64) -> String) -> String {
    x.as_ref().map_or("-".into(), |x| format!("{} [{} .. {}]", f(x.median), f(x.min), f(x.max)))
}

fn ratio(x: &Option<Summary>) -> String {
    x.as_ref().map_or("-".into(), |x| format!("{:.3} [{:.3} .. {:.3}]", x.median, x.min, x.max))
}

/// The table, if any target has a `-nostate` twin.
pub(super) fn table(res: &NvmeResult, s: &mut String) {
    let rows = rows(res);
    if rows.is_empty() {
        return;
    }
    let _ = writeln!(
        s,
        "\nstate keeping (state memory on) over none (-nostate), same job, round and attempt: per-round ratios \
         on/off, median [min .. max]; each side's IOPS and p50 (that round's own) median [min .. max] over rounds \
         (a target the guard ran again has no twin of its attempt: --reruns 0 keeps every pair interleaved)"
    );
    let (k, us) = (|v: f64| format!("{:.1}k", v / 1e3), |v: f64| format!("{:.2}", v / 1e3));
    let _ = writeln!(
        s,
        "{:<24} {:<26} {:<27} {:<27} {:<24} {:<22} {:<22} p50 on/off",
        "job", "target", "IOPS on", "IOPS off", "IOPS on/off", "p50 on (us)", "p50 off (us)"
    );
    for r in rows {
        let _ = writeln!(
            s,
            "{:<24} {:<26} {:<27} {:<27} {:<24} {:<22} {:<22} {}",
            res.options.jobs[r.job].label(),
            r.target,
            range(&r.iops[0], k),
            range(&r.iops[1], k),
            ratio(&r.iops_ratio),
            range(&r.p50[0], us),
            range(&r.p50[1], us),
            ratio(&r.p50_ratio)
        );
    }
}

#[cfg(test)]
mod tests {
    use super::super::{Job, NvmeOptions};
    use super::*;

    fn run(target: &str, round: u32, attempt: u32, iops: f64, p50: f64) -> NvmeRun {
        let mut r = NvmeRun::new(target, "iopath null", 0, round, 1000, 1000);
        (r.io.iops, r.io.p50_ns, r.attempt) = (iops, p50, attempt);
        r
    }

    fn result(runs: Vec<NvmeRun>) -> NvmeResult {
        NvmeResult {
            partial: false,
            host: crate::host::host_info(1_000_000),
            options: NvmeOptions { jobs: vec![Job::randread(512, 16)], ..Default::default() },
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
        }
    }

    #[test]
    fn each_round_is_over_its_own_twin_and_a_rerun_pairs_with_nothing() {
        let (on, off) = ("iopath-shm@vfio-user", "iopath-shm-nostate@vfio-user");
        let runs = vec![
            run(on, 0, 0, 90.0, 1100.0),
            run(off, 0, 0, 100.0, 1000.0),
            // Round 1 is slow for both: the ratio holds.
            run(on, 1, 0, 45.0, 2200.0),
            run(off, 1, 0, 50.0, 2000.0),
            run(on, 2, 0, 99.0, 1000.0),
            run(off, 2, 0, 100.0, 1000.0),
            // A re-run of round 2's twin only: no partner of its attempt.
            run(off, 2, 3, 10.0, 9000.0),
        ];
        let rows = rows(&result(runs));
        assert_eq!(rows.len(), 1);
        let r = &rows[0];
        assert_eq!(r.target, on);
        let ratio = r.iops_ratio.as_ref().unwrap();
        assert_eq!((ratio.median, ratio.min, ratio.max, ratio.n), (0.9, 0.9, 0.99, 3));
        let p = r.p50_ratio.as_ref().unwrap();
        assert!((p.median - 1.1).abs() < 1e-9 && p.min == 1.0 && p.n == 3, "{:?}", (p.median, p.min, p.n));
        assert_eq!(r.iops[1].as_ref().unwrap().min, 10.0, "the side's own rounds keep the re-run");
        let mut s = String::new();
        table(&result(vec![run(on, 0, 0, 1.0, 1.0)]), &mut s);
        assert!(s.is_empty(), "no twin, no table: {s}");
    }
}
