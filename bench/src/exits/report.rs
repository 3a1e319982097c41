//! Statistics per row, the table and the JSON document of `bench exits`.

use super::{marks, ExitsResult, Routing, Target, TargetRun};
use crate::guard::{marks_json, Mark, JSON_SCHEMA_VERSION};
use crate::record::{Batch, Row};
use crate::stats::{ns, summarize, Summary};
use serde::Serialize;
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::fmt::Write as _;

/// Per-row (name and cpl), per-target statistics over every batch of every
/// round of the target's latest attempt.
pub struct RowStats {
    pub name: String,
    pub group: String,
    pub cpl: u8,
    pub targets: BTreeMap<Target, TargetStats>,
}

pub struct TargetStats {
    pub cycles: Option<Summary>,
    pub per_round_median: Vec<f64>,
    pub status: Option<String>,
    pub routing: Vec<Routing>,
    /// Median over the batches of the accesses in one timed batch.
    pub accesses_per_batch: Option<f64>,
    /// Every timed batch, as the guest recorded it, with its round.
    pub batches: Vec<RoundBatch>,
    /// Per round: every access of the row, and those outside the timed batches.
    pub rounds: Vec<RoundCounts>,
    /// The attempt these figures come from (0: the bench's own rounds).
    pub attempt: u32,
}

#[derive(Clone, Copy, Debug, Serialize)]
pub struct RoundBatch {
    pub round: u32,
    pub attempt: u32,
    #[serde(flatten)]
    pub batch: Batch,
}

#[derive(Clone, Copy, Debug, Serialize)]
pub struct RoundCounts {
    pub round: u32,
    pub attempt: u32,
    pub accesses: u64,
    pub timed_accesses: u64,
    pub warm: Option<u64>,
}

fn target_stats(rows: &[(&TargetRun, &Row)]) -> TargetStats {
    let all: Vec<f64> = rows.iter().flat_map(|(_, r)| r.per_access()).collect();
    let per_round_median = rows.iter().filter_map(|(_, r)| summarize(&r.per_access()).map(|s| s.median)).collect();
    let status = rows.iter().find_map(|(_, r)| r.status().map(|s| s.to_string()));
    let routing = rows.iter().filter_map(|(run, r)| run.routing.get(&r.name).cloned()).collect();
    let batches: Vec<RoundBatch> = rows
        .iter()
        .flat_map(|(run, r)| {
            r.batches().into_iter().map(|batch| RoundBatch { round: run.round, attempt: run.attempt, batch })
        })
        .collect();
    let per_batch: Vec<f64> = batches.iter().map(|b| b.batch.accesses as f64).collect();
    let rounds = rows
        .iter()
        .map(|(run, r)| RoundCounts {
            round: run.round,
            attempt: run.attempt,
            accesses: r.accesses,
            timed_accesses: r.timed_accesses(),
            warm: r.get_u64("warm"),
        })
        .collect();
    TargetStats {
        cycles: summarize(&all),
        per_round_median,
        status,
        routing,
        accesses_per_batch: summarize(&per_batch).map(|s| s.median),
        batches,
        rounds,
        attempt: rows.first().map_or(0, |(run, _)| run.attempt),
    }
}

impl ExitsResult {
    /// One entry per (row, cpl), in the order the guest printed them.
    pub fn rows(&self) -> Vec<RowStats> {
        let mut order: Vec<(String, String, u8)> = Vec::new();
        for r in &self.runs {
            for row in &r.out.rows {
                if !order.iter().any(|(n, _, c)| *n == row.name && *c == r.cpl) {
                    order.push((row.name.clone(), row.group.clone(), r.cpl));
                }
            }
        }
        order
            .into_iter()
            .map(|(name, group, cpl)| {
                let mut targets = BTreeMap::new();
                for t in Target::all() {
                    let with_row = || {
                        self.runs
                            .iter()
                            .filter(move |r| r.target == t && r.cpl == cpl)
                            .filter_map(|r| r.out.row(&name).map(|x| (r, x)))
                    };
                    // A re-run replaces every round of the attempts before it.
                    let Some(latest) = with_row().map(|(r, _)| r.attempt).max() else { continue };
                    let rows: Vec<(&TargetRun, &Row)> = with_row().filter(|(r, _)| r.attempt == latest).collect();
                    targets.insert(t, target_stats(&rows));
                }
                RowStats { name, group, cpl, targets }
            })
            .collect()
    }

    pub fn ratio(&self, r: &RowStats, a: Target, b: Target) -> Option<f64> {
        let x = r.targets.get(&a)?.cycles?.median;
        let y = r.targets.get(&b)?.cycles?.median;
        (y > 0.0).then_some(x / y)
    }

    /// For a cpl 0 row, its iopath median over the same row's at cpl 3.
    fn cpl_ratio(&self, rows: &[RowStats], r: &RowStats) -> Option<f64> {
        if r.cpl != 0 {
            return None;
        }
        let r3 = rows.iter().find(|x| x.name == r.name && x.cpl == 3)?;
        let x = r.targets.get(&Target::Iopath)?.cycles?.median;
        let y = r3.targets.get(&Target::Iopath)?.cycles?.median;
        (y > 0.0).then_some(x / y)
    }

    /// Every mark of a row, each with the target it is about.
    fn row_marks(&self, r: &RowStats) -> Vec<(Target, Mark)> {
        r.targets.keys().flat_map(|t| marks(self, r, *t).into_iter().map(move |m| (*t, m))).collect()
    }

    pub fn table(&self) -> String {
        let mut s = String::new();
        if self.partial {
            let _ = writeln!(s, "{}", crate::interrupt::partial_line(self.runs.len()));
        }
        let _ = writeln!(s, "{}", self.host);
        let _ = writeln!(
            s,
            "exit-cost table: {} rounds x {} batches of ~{} us each (acc/batch: accesses per batch, median), median [min..max] cycles per access; ns at the TSC rate; contend: {}",
            self.options.rounds, self.options.batches, self.options.batch_us, self.options.contend
        );
        let rows = self.rows();
        let have_floor = self.runs.iter().any(|r| r.target == Target::Floor);
        let have_qemu = self.runs.iter().any(|r| r.target == Target::Qemu);
        let both_cpls = rows.iter().any(|r| r.cpl == 0) && rows.iter().any(|r| r.cpl == 3);
        let mut hdr =
            format!("{:<32} {:>3} {:>26} {:>10} {:>9}", "row", "cpl", "iopath cycles [min..max]", "ns", "acc/batch");
        if have_floor {
            let _ = write!(hdr, " {:>10} {:>8}", "floor ns", "/floor");
        }
        if have_qemu {
            let _ = write!(hdr, " {:>26} {:>10} {:>8}", "qemu cycles [min..max]", "qemu ns", "/qemu");
        }
        if both_cpls {
            let _ = write!(hdr, " {:>7}", "r0/r3");
        }
        let _ = write!(hdr, "  {:<26} routing", "marks");
        let _ = writeln!(s, "{hdr}");
        let _ = writeln!(s, "{}", "-".repeat(hdr.len() + 20));
        let cyc = |t: Option<&TargetStats>| match t {
            Some(TargetStats { cycles: Some(c), .. }) => format!("{:.0} [{:.0}..{:.0}]", c.median, c.min, c.max),
            Some(TargetStats { status: Some(st), .. }) => st.clone(),
            _ => "-".into(),
        };
        let nsf = |t: Option<&TargetStats>| match t {
            Some(TargetStats { cycles: Some(c), .. }) => fmt_ns(ns(c.median, self.tsc_khz)),
            _ => "-".into(),
        };
        let rat = |x: Option<f64>| x.map(|v| format!("{v:.2}x")).unwrap_or_else(|| "-".into());
        for r in &rows {
            let io = r.targets.get(&Target::Iopath);
            let apb = io.and_then(|t| t.accesses_per_batch).map_or("-".into(), |v| format!("{v:.0}"));
            let mut line = format!("{:<32} {:>3} {:>26} {:>10} {:>9}", r.name, r.cpl, cyc(io), nsf(io), apb);
            if have_floor {
                let fl = r.targets.get(&Target::Floor);
                let _ = write!(line, " {:>10} {:>8}", nsf(fl), rat(self.ratio(r, Target::Iopath, Target::Floor)));
            }
            if have_qemu {
                let q = r.targets.get(&Target::Qemu);
                let _ = write!(
                    line,
                    " {:>26} {:>10} {:>8}",
                    cyc(q),
                    nsf(q),
                    rat(self.ratio(r, Target::Iopath, Target::Qemu))
                );
            }
            if both_cpls {
                let _ = write!(line, " {:>7}", rat(self.cpl_ratio(&rows, r)));
            }
            // Out-of-process targets' marks are shown in their own table.
            let m: Vec<String> = self
                .row_marks(r)
                .iter()
                .filter(|(t, _)| matches!(t, Target::Iopath | Target::Floor | Target::Qemu))
                .map(|(t, m)| if *t == Target::Iopath { m.label() } else { format!("{}:{}", t.name(), m.label()) })
                .collect();
            let m = if m.is_empty() { "-".to_string() } else { m.join(" ") };
            let routing: Vec<&Routing> = r
                .targets
                .iter()
                .filter(|(t, _)| matches!(t, Target::Iopath | Target::Floor | Target::Qemu))
                .flat_map(|(_, t)| t.routing.iter())
                .collect();
            let verdict = if let Some(v) = routing.iter().find(|v| !v.ok) {
                format!("WRONG: {}", v.detail)
            } else {
                io.and_then(|t| t.routing.first()).map(|v| format!("ok {}", v.detail)).unwrap_or_else(|| "ok".into())
            };
            let _ = writeln!(s, "{line}  {m:<26} {verdict}");
        }
        let reruns: Vec<String> = self
            .attempts
            .iter()
            .filter(|(_, n)| **n > 1) // QEMU's marked rows are not run again
            .map(|((row, cpl, t), n)| format!("{} {row} cpl{cpl}: {n} attempts", t.name()))
            .collect();
        if !reruns.is_empty() {
            let _ = writeln!(s, "marked rows run again (the figures are the last attempt's): {}", reruns.join("; "));
        }
        s.push_str(&crate::remote::table(self));
        if !self.errors.is_empty() {
            let _ = writeln!(s, "\nerrors:");
            for e in &self.errors {
                let _ = writeln!(s, "  {e}");
            }
        }
        s
    }

    pub fn json(&self) -> Value {
        let all = self.rows();
        let rows: Vec<Value> = all
            .iter()
            .map(|r| {
                let mut t = serde_json::Map::new();
                for (target, st) in &r.targets {
                    let m = marks(self, r, *target);
                    t.insert(
                        target.name().into(),
                        json!({
                            "cycles": st.cycles,
                            "ns": st.cycles.map(|c| json!({"median": ns(c.median, self.tsc_khz), "min": ns(c.min, self.tsc_khz), "max": ns(c.max, self.tsc_khz)})),
                            "per_round_median_cycles": st.per_round_median,
                            "accesses_per_batch": st.accesses_per_batch,
                            "batches": st.batches,
                            "rounds": st.rounds,
                            "attempt": st.attempt,
                            "marks": marks_json(&m),
                            "status": st.status,
                            "routing": st.routing,
                        }),
                    );
                }
                let marks: Vec<Value> = self
                    .row_marks(r)
                    .iter()
                    .map(|(t, m)| {
                        let mut v = m.json();
                        v["target"] = json!(t.name());
                        v
                    })
                    .collect();
                json!({
                    "name": r.name,
                    "group": r.group,
                    "cpl": r.cpl,
                    "targets": t,
                    "accesses_per_batch": r.targets.get(&Target::Iopath).and_then(|t| t.accesses_per_batch),
                    "marks": marks,
                    "ratio_iopath_over_floor": self.ratio(r, Target::Iopath, Target::Floor),
                    "ratio_iopath_over_qemu": self.ratio(r, Target::Iopath, Target::Qemu),
                    "ratio_cpl0_over_cpl3": self.cpl_ratio(&all, r),
                })
            })
            .collect();
        let runs: Vec<Value> = self
            .runs
            .iter()
            .map(|r| {
                json!({
                    "target": r.target.name(), "round": r.round, "cpl": r.cpl, "attempt": r.attempt, "wall_s": r.wall_s,
                    "guest": r.out.guest, "pci": r.out.pci,
                    "vmm_exits": r.exits.map(|e| e.fields().iter().map(|(k, v)| (k.to_string(), json!(v))).collect::<serde_json::Map<_, _>>()),
                })
            })
            .collect();
        let g = self.options.guard;
        let attempts: Vec<Value> = self
            .attempts
            .iter()
            .map(|((row, cpl, t), n)| json!({"row": row, "cpl": cpl, "target": t.name(), "attempts": n}))
            .collect();
        json!({
            "schema_version": JSON_SCHEMA_VERSION,
            "benchmark": "exits",
            "partial": self.partial,
            "out_of_process": crate::remote::json(self),
            "host": self.host,
            "options": self.options,
            "guard": {"min_floor_ratio": g.min_floor_ratio, "max_spread": g.max_spread, "reruns": g.reruns, "attempts": attempts},
            "tsc_khz": self.tsc_khz,
            "rows": rows,
            "runs": runs,
            "errors": self.errors,
        })
    }
}

pub(crate) fn fmt_ns(v: f64) -> String {
    if !v.is_finite() {
        "-".into()
    } else if v >= 1000.0 {
        format!("{:.2} us", v / 1000.0)
    } else {
        format!("{v:.1} ns")
    }
}
