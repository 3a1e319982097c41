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
         on/off, median [min .. max]; each side's IOPS and p50 (that round's own) median [min .. max] over rounds"
    );
    let (k, us) = (|v: f64| format!("{:.1}k", v / 1e3), |v: f64| format!("{:.2}", v / 1e3));
    let _ = writeln!(
        s,
        "{:<24} {:<26} {:<27} {:<27} {:<24} {:<22} {:<22} {}",
        "job", "target", "IOPS on", "IOPS off", "IOPS on/off", "p50 on (us)", "p50 off (us)", "p50 on/off"
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
