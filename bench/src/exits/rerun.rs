//! The guard on exit figures (`crate::guard`): a row whose cost is below
//! its floor, or whose rounds disagree, is marked; its rounds are run again
//! (a bounded number of times, `GuardConfig::run`) and the mark stays only
//! if the last attempt still earns it.

use super::{ExitsResult, RowStats, Target, TargetRun};
use crate::guard::Mark;
use crate::stats::summarize;
use std::cell::RefCell;

/// The marks of one target's figures for a row: rounds that disagree
/// (max/min of the per-round medians), iopath's exit below the bare
/// `KVM_RUN` floor of the same row and cpl, an out-of-process write below
/// the in-VMM exit plus the transport's socket round trip.
pub fn marks(r: &ExitsResult, row: &RowStats, t: Target) -> Vec<Mark> {
    let g = r.options.guard;
    let Some(st) = row.targets.get(&t) else { return Vec::new() };
    let mut m = Vec::new();
    if let Some(s) = summarize(&st.per_round_median) {
        m.extend(g.spread(&s));
    }
    if t == Target::Iopath {
        if let (Some(a), Some(f)) = (st.cycles, row.targets.get(&Target::Floor).and_then(|f| f.cycles)) {
            m.extend(g.below_floor(a.median, f.median, "KVM_RUN floor"));
        }
    }
    m.extend(crate::remote::floor_mark(r, row, t));
    m
}

/// The targets to run again for a marked one: a ratio to the floor is
/// measured anew on both sides.
fn rerun_targets(t: Target, marks: &[Mark]) -> Vec<Target> {
    if t == Target::Iopath && marks.iter().any(|m| matches!(m, Mark::BelowFloor { .. })) {
        vec![Target::Iopath, Target::Floor]
    } else {
        vec![t]
    }
}

/// Runs one target at a cpl with only the named row, for a round and attempt.
pub type RowRunner<'a> = dyn FnMut(Target, u8, &str, u32, u32) -> anyhow::Result<TargetRun> + 'a;

/// Re-runs every marked (row, cpl, target) until its marks go or the
/// budget (`options.guard.reruns`) is spent; each attempt runs all
/// `options.rounds` rounds of the row. QEMU's own runs are not re-run (their
/// marks stay as measured). Attempts are recorded in `r.attempts`, failures
/// in `r.errors`.
pub fn guard_rows(r: &mut ExitsResult, run: &mut RowRunner<'_>) {
    let g = r.options.guard;
    let rounds = r.options.rounds;
    let marked: Vec<(String, u8, Target)> =
        r.rows().iter().flat_map(|row| row.targets.keys().map(move |t| (row.name.clone(), row.cpl, *t))).collect();
    for (name, cpl, t) in marked {
        let current = |r: &ExitsResult| -> Vec<Mark> {
            r.rows()
                .into_iter()
                .find(|x| x.name == name && x.cpl == cpl)
                .map(|row| marks(r, &row, t))
                .unwrap_or_default()
        };
        // A re-run for an earlier target may have cleared this one already.
        if current(r).is_empty() {
            continue;
        }
        let key = (name.clone(), cpl, t);
        if t == Target::Qemu {
            r.attempts.insert(key, 1);
            continue;
        }
        let cell = RefCell::new(&mut *r);
        let outcome = g.run(
            |attempt| -> anyhow::Result<()> {
                if attempt == 0 {
                    return Ok(()); // the bench's own rounds
                }
                let targets = rerun_targets(t, &current(&cell.borrow()));
                // Attempt ids grow over the whole result, so the figures of a
                // row are always its newest attempt's, even when another
                // target's re-runs (the floor's, say) ran attempts before.
                let id = 1 + cell.borrow().runs.iter().map(|r| r.attempt).max().unwrap_or(0);
                // An attempt counts whole or not at all: a failed round leaves
                // the previous attempt's figures.
                let mut new = Vec::new();
                for round in 0..rounds {
                    for &x in &targets {
                        new.push(run(x, cpl, &name, round, id)?);
                    }
                }
                cell.borrow_mut().runs.extend(new);
                Ok(())
            },
            |_| current(&cell.borrow()),
        );
        match outcome {
            Ok(done) => {
                r.attempts.insert(key, done.attempts);
            }
            Err(e) => r.errors.push(format!("{} {name} cpl{cpl}: re-run: {e}", t.name())),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::exits::ExitsOptions;
    use crate::guard::GuardConfig;
    use crate::host::HostInfo;
    use crate::record::GuestOutput;
    use std::collections::BTreeMap;

    const ROW: &str = "outl_to_vmm";

    /// A run of `t` whose row costs `per_access` cycles in each of 3 batches.
    fn run_of(t: Target, round: u32, attempt: u32, per_access: u64) -> TargetRun {
        named_run(ROW, t, round, attempt, per_access)
    }

    fn named_run(name: &str, t: Target, round: u32, attempt: u32, per_access: u64) -> TargetRun {
        let c = per_access * 100;
        let line = format!("@row name={name} group=g cpl=3 iters=100 accesses=400 warm=100 cycles={c},{c},{c}");
        TargetRun {
            target: t,
            round,
            cpl: 3,
            attempt,
            out: GuestOutput::parse(&[line]),
            routing: BTreeMap::new(),
            exits: None,
            wall_s: 0.0,
        }
    }

    fn result(runs: Vec<TargetRun>) -> ExitsResult {
        let host = HostInfo {
            cpu: "test".into(),
            cpus: 2,
            kernel: "test".into(),
            kvm_module: "test".into(),
            nested: false,
            tsc_khz: 2_000_000,
        };
        let options = ExitsOptions {
            rounds: 2,
            guard: GuardConfig { reruns: 2, ..GuardConfig::default() },
            ..Default::default()
        };
        ExitsResult {
            partial: false,
            host,
            options,
            tsc_khz: 2_000_000,
            runs,
            errors: Vec::new(),
            rtt_ns: BTreeMap::new(),
            attempts: BTreeMap::new(),
        }
    }

    /// Two rounds of iopath at `io` cycles and of the floor at `floor`.
    fn rounds(io: [u64; 2], floor: [u64; 2]) -> Vec<TargetRun> {
        (0..2)
            .flat_map(|k| {
                [run_of(Target::Iopath, k, 0, io[k as usize]), run_of(Target::Floor, k, 0, floor[k as usize])]
            })
            .collect()
    }

    fn marks_of(r: &ExitsResult, t: Target) -> Vec<Mark> {
        let rows = r.rows();
        marks(r, &rows[0], t)
    }

    #[test]
    fn an_exit_below_its_floor_is_marked_in_table_and_json() {
        let r = result(rounds([500, 500], [1000, 1000]));
        assert_eq!(marks_of(&r, Target::Iopath), vec![Mark::BelowFloor { ratio: 0.5, floor: "KVM_RUN floor".into() }]);
        assert!(r.table().contains("!0.50x of KVM_RUN floor"), "{}", r.table());
        let j = r.json();
        assert_eq!(j["schema_version"], crate::guard::JSON_SCHEMA_VERSION);
        let row = &j["rows"][0];
        assert_eq!(row["marks"][0]["kind"], "below_floor");
        assert_eq!(row["marks"][0]["target"], "iopath");
        assert_eq!(row["cpl"], 3);
        assert_eq!(row["accesses_per_batch"], 100.0);
        let b = &row["targets"]["iopath"]["batches"];
        assert_eq!(b.as_array().unwrap().len(), 6, "3 batches x 2 rounds: {b}");
        assert_eq!(b[0], serde_json::json!({"round": 0, "attempt": 0, "cycles": 50000, "iters": 100, "accesses": 100}));
        // Above the floor: no mark.
        let r = result(rounds([1000, 1000], [900, 900]));
        assert!(marks_of(&r, Target::Iopath).is_empty());
        assert_eq!(r.json()["rows"][0]["marks"], serde_json::json!([]));
    }

    #[test]
    fn rounds_that_disagree_are_marked() {
        let r = result(rounds([1000, 3000], [900, 900]));
        assert_eq!(marks_of(&r, Target::Iopath), vec![Mark::Spread { max_over_min: 3.0 }]);
        assert!(r.table().contains("!spread 3.0x"));
    }

    #[test]
    fn a_marked_row_is_run_again_and_its_mark_goes_if_the_rerun_is_clean() {
        let mut r = result(rounds([500, 500], [1000, 1000]));
        let mut calls = Vec::new();
        guard_rows(&mut r, &mut |t, cpl, row, round, attempt| {
            calls.push((t, cpl, row.to_string(), round, attempt));
            Ok(run_of(t, round, attempt, if t == Target::Iopath { 1100 } else { 1000 }))
        });
        // One re-run (both sides of the ratio, every round) made it clean.
        assert_eq!(calls.len(), 4, "{calls:?}");
        assert!(calls.iter().all(|(_, cpl, row, _, attempt)| *cpl == 3 && row == ROW && *attempt == 1));
        assert_eq!(r.attempts[&(ROW.to_string(), 3, Target::Iopath)], 2);
        assert!(marks_of(&r, Target::Iopath).is_empty());
        // The figures are the re-run's.
        assert_eq!(r.rows()[0].targets[&Target::Iopath].cycles.unwrap().median, 1100.0);
        assert!(r.table().contains("2 attempts"));
    }

    #[test]
    fn a_mark_that_persists_stays_after_the_budget() {
        let mut r = result(rounds([500, 500], [1000, 1000]));
        let mut n = 0;
        guard_rows(&mut r, &mut |t, _, _, round, attempt| {
            n += 1;
            Ok(run_of(t, round, attempt, if t == Target::Iopath { 500 } else { 1000 }))
        });
        assert_eq!(n, 2 * 2 * 2, "2 re-runs x 2 rounds x 2 targets");
        assert_eq!(r.attempts[&(ROW.to_string(), 3, Target::Iopath)], 3);
        assert_eq!(marks_of(&r, Target::Iopath).len(), 1);
        assert!(r.errors.is_empty());
        // A runner that fails ends the re-runs with an error, not a panic.
        let mut r = result(rounds([500, 500], [1000, 1000]));
        guard_rows(&mut r, &mut |_, _, _, _, _| anyhow::bail!("no KVM"));
        assert!(r.errors.iter().any(|e| e.contains("re-run: no KVM")), "{:?}", r.errors);
        assert_eq!(marks_of(&r, Target::Iopath).len(), 1);
    }

    #[test]
    fn a_rerun_that_fails_midway_leaves_the_last_whole_attempt() {
        let mut r = result(rounds([500, 500], [1000, 1000]));
        // Round 0 of the re-run succeeds (at 2000 cycles), round 1 fails.
        guard_rows(&mut r, &mut |t, _, _, round, attempt| {
            if round == 1 {
                anyhow::bail!("guest stopped");
            }
            Ok(run_of(t, round, attempt, 2000))
        });
        assert!(r.errors.iter().any(|e| e.contains("guest stopped")), "{:?}", r.errors);
        // The figures stay the bench's own rounds', not half an attempt's.
        assert_eq!(r.rows()[0].targets[&Target::Iopath].cycles.unwrap().median, 500.0);
        assert!(r.runs.iter().all(|x| x.attempt == 0));
    }

    #[test]
    fn attempt_ids_grow_over_the_result_so_the_newest_attempt_is_the_one_shown() {
        // The floor was re-run before (attempts 1 and 2 of an earlier target);
        // iopath's re-run must not reuse id 1 and be hidden behind them.
        let mut runs = rounds([500, 500], [1000, 1000]);
        for a in 1..=2 {
            runs.extend((0..2).map(|k| run_of(Target::Floor, k, a, 1000)));
        }
        let mut r = result(runs);
        let mut ids = Vec::new();
        guard_rows(&mut r, &mut |t, _, _, round, attempt| {
            ids.push(attempt);
            Ok(run_of(t, round, attempt, if t == Target::Iopath { 1100 } else { 1000 }))
        });
        assert!(ids.iter().all(|&a| a == 3), "{ids:?}");
        assert_eq!(r.rows()[0].targets[&Target::Iopath].cycles.unwrap().median, 1100.0);
        assert_eq!(
            r.rows()[0].targets[&Target::Floor].per_round_median.len(),
            2,
            "one attempt's rounds, not two pooled"
        );
    }

    #[test]
    fn an_out_of_process_write_below_exit_plus_round_trip_is_marked() {
        const W: &str = "mmio-no-eventfd:pci-mem";
        let vfio = Target::Remote("vfio-user");
        let posted = Target::Remote("ioregionfd-posted");
        // At 2 GHz: exit 500 ns, the write over vfio-user 600 ns, its round trip 400 ns.
        let mut r = result(vec![
            named_run(W, Target::Iopath, 0, 0, 1000),
            named_run(W, vfio, 0, 0, 1200),
            named_run(W, posted, 0, 0, 1200),
        ]);
        r.rtt_ns.insert("vfio-user".into(), vec![400.0]);
        r.rtt_ns.insert("ioregionfd-posted".into(), vec![400.0]);
        let m = marks_of(&r, vfio);
        assert!(
            matches!(&m[..], [Mark::BelowFloor { ratio, floor }] if (ratio - 600.0 / 900.0).abs() < 1e-9 && floor == "exit + socket round trip"),
            "{m:?}"
        );
        assert!(marks_of(&r, posted).is_empty(), "a posted write need not wait");
        assert!(r.table().contains("marked: vfio-user mmio-no-eventfd:pci-mem: !0.67x of exit + socket round trip"));
        assert!(r.table().contains("(marked: below its floor)"));
        // With a 200 ns round trip the write is above its floor.
        r.rtt_ns.insert("vfio-user".into(), vec![100.0]);
        assert!(marks_of(&r, vfio).is_empty());
    }

    #[test]
    fn a_clean_row_is_not_run_again() {
        let mut r = result(rounds([1000, 1000], [900, 900]));
        guard_rows(&mut r, &mut |_, _, _, _, _| panic!("must not run"));
        assert!(r.attempts.is_empty());
    }
}
