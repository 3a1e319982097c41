//! The guard on `bench nvme`'s figures (`crate::guard`): a run whose IOPS
//! are above its round's ring floor at the job's queue depth (more than
//! 1/`min_floor_ratio` of it), or whose p50 at QD1 is under
//! `min_floor_ratio` of the floor's QD1 p50, cannot be true; a target whose
//! rounds' IOPS spread more than `max_spread` cannot be trusted. Either
//! marks the target, which then runs its rounds again, each after a fresh
//! floor, up to `reruns` times, before the mark stays.

use super::run::{Ctx, Target};
use super::{floor_qd, Job, NvmeRun};
use crate::floor::FloorRun;
use crate::guard::{GuardConfig, Mark};
use crate::stats::summarize;
use anyhow::Context;
use indicatif::ProgressBar;

/// A run's own marks against the floors it was measured with. A
/// controller with several pollers serves several rings at once: one ring's
/// ops/s is no floor for it, and it gets no IOPS mark.
pub fn run_marks(g: &GuardConfig, r: &NvmeRun, j: &Job) -> Vec<Mark> {
    let qd = floor_qd(j);
    let mut m = Vec::new();
    if let (Some(f), 1) = (r.floor_ops_s, r.pollers) {
        m.extend(g.above_floor_rate(r.io.iops, f, &format!("ring floor qd{qd} ops/s")));
    }
    if let (Some(p), 1) = (r.floor_p50_ns, qd) {
        m.extend(g.below_floor(r.io.p50_ns, p, "ring floor qd1 p50"));
    }
    m
}

/// The spread mark of a target's rounds (IOPS max/min), if any.
fn spread(g: &GuardConfig, runs: &[NvmeRun]) -> Option<Mark> {
    summarize(&runs.iter().map(|r| r.io.iops).collect::<Vec<_>>()).and_then(|s| g.spread(&s))
}

/// A target's marks: the worst of its runs' for each floor, and its spread.
pub fn group_marks(g: &GuardConfig, runs: &[NvmeRun], j: &Job) -> Vec<Mark> {
    let mut m: Vec<Mark> = Vec::new();
    // fio is the file's own floor, not judged (nor re-run) by the guard.
    if runs.iter().any(|r| super::is_fio_target(&r.target)) {
        return m;
    }
    for mk in runs.iter().flat_map(|r| run_marks(g, r, j)) {
        let Mark::BelowFloor { ratio, floor } = &mk else {
            m.push(mk);
            continue;
        };
        match m.iter_mut().find(|x| matches!(x, Mark::BelowFloor { floor: f, .. } if f == floor)) {
            Some(Mark::BelowFloor { ratio: worst, .. }) => *worst = worst.min(*ratio),
            _ => m.push(mk.clone()),
        }
    }
    m.extend(spread(g, runs));
    m
}

/// The runs that stand after the guard, and what it did.
#[derive(Default)]
pub struct Guarded {
    pub runs: Vec<NvmeRun>,
    pub superseded: Vec<NvmeRun>,
    pub floor: Vec<FloorRun>,
    pub errors: Vec<String>,
    pub reruns: Vec<(usize, String, u32, Vec<Mark>)>,
}

/// Each member's marks over its own runs, concatenated: what marks the group.
fn twins_marks(g: &GuardConfig, twins: &[Target], runs: &[NvmeRun], j: &Job) -> Vec<Mark> {
    twins.iter().flat_map(|t| group_marks(g, &of(runs, t), j)).collect()
}

/// The runs of target `t` among `runs`.
fn of(runs: &[NvmeRun], t: &Target) -> Vec<NvmeRun> {
    runs.iter().filter(|r| r.target == t.name).cloned().collect()
}

/// Runs every marked target again (bounded by `GuardConfig::run`), then
/// gives each run that stands its marks. fio's rows are not judged: the
/// ring is no floor for the host's own I/O. A target's twins at the other
/// contention levels (`--contend 0,N`) run again with it, back to back, so
/// that a contended run keeps a quiet twin of its own attempt; on a file,
/// fio runs again beside them, so that it keeps its fio rows too. Every
/// re-run gets an attempt number of its own, whatever its target: runs pair
/// up only with what ran in the same attempt.
pub fn apply(ctx: &Ctx, targets: &[Target], runs: Vec<NvmeRun>, pb: &ProgressBar) -> Guarded {
    let (o, g) = (ctx.o, &ctx.o.guard);
    let mut out = Guarded::default();
    let mut runs = runs;
    // `targets` has each target's levels one after the other.
    let levels = o.contend.len().max(1);
    let mut next_attempt = 1;
    for (ji, j) in o.jobs.iter().enumerate() {
        let fio: Vec<Target> = targets.iter().filter(|t| t.is_fio() && ctx.runs_job(t, j)).cloned().collect();
        for twins in targets.chunks(levels).filter(|c| !c[0].is_fio()) {
            let (mine, rest): (Vec<NvmeRun>, Vec<NvmeRun>) =
                runs.into_iter().partition(|r| r.job == ji && twins.iter().any(|t| t.name == r.target));
            runs = rest;
            if mine.is_empty() {
                continue;
            }
            // After Ctrl-C nothing runs again: the runs that stand are what was measured.
            if crate::interrupt::interrupted() || twins_marks(g, twins, &mine, j).is_empty() {
                out.runs.extend(mine);
                continue;
            }
            let (mut tried, mut floors) = (Vec::<Vec<NvmeRun>>::new(), Vec::new());
            let guarded = g.run(
                |attempt| {
                    let v = if attempt == 0 {
                        mine.clone()
                    } else {
                        pb.inc_length(o.rounds as u64 * (twins.len() + fio.len()) as u64);
                        let id = next_attempt;
                        next_attempt += 1;
                        let (v, f) = rerun(ctx, twins, &fio, ji, id, pb)?;
                        floors.extend(f);
                        v
                    };
                    tried.push(v.clone());
                    Ok::<_, anyhow::Error>(v)
                },
                |v| twins_marks(g, twins, v, j),
            );
            out.floor.extend(floors);
            let attempts = match &guarded {
                Ok(x) => x.attempts,
                Err(_) if crate::interrupt::interrupted() => tried.len() as u32,
                Err(e) => {
                    let names: Vec<&str> = twins.iter().map(|t| t.name.as_str()).collect();
                    out.errors.push(format!("{} {}: re-run: {e:#}", names.join(", "), j.label()));
                    tried.len() as u32
                }
            };
            // The last attempt that ran stands; the earlier ones are kept apart.
            let stands = tried.pop().unwrap_or_default();
            out.superseded.extend(tried.into_iter().flatten());
            for t in twins {
                out.reruns.push((ji, t.name.clone(), attempts, group_marks(g, &of(&stands, t), j)));
            }
            out.runs.extend(stands);
        }
    }
    out.runs.extend(runs);
    // Each run's marks: its own, and its target's spread.
    let mut by_group: Vec<((usize, String), Option<Mark>)> = Vec::new();
    for r in &out.runs {
        let k = (r.job, r.target.clone());
        if !by_group.iter().any(|(x, _)| *x == k) {
            let mine: Vec<NvmeRun> = out.runs.iter().filter(|x| (x.job, &x.target) == (k.0, &k.1)).cloned().collect();
            let s = if super::is_fio_target(&r.target) { None } else { spread(g, &mine) };
            by_group.push((k, s));
        }
    }
    for r in out.runs.iter_mut().filter(|r| !super::is_fio_target(&r.target)) {
        let mut m = run_marks(g, r, &o.jobs[r.job]);
        m.extend(by_group.iter().find(|(k, _)| (k.0, &k.1) == (r.job, &r.target)).and_then(|x| x.1.clone()));
        r.marks = m;
    }
    // Back in the order the rounds ran them.
    let pos = |r: &NvmeRun| targets.iter().position(|t| t.name == r.target).unwrap_or(usize::MAX);
    out.runs.sort_by_key(|r| (r.round, r.job, pos(r)));
    out
}

/// Attempt `attempt` of the twins (a target at each contention level) for
/// job `ji`: every round again, each run after the ring floor at the job's
/// depth (and the wake-up floor, with a think time), measured just before it,
/// and after the `fio` targets at its level (the file's own floor), which
/// join the attempt's runs.
fn rerun(
    ctx: &Ctx,
    twins: &[Target],
    fio: &[Target],
    ji: usize,
    attempt: u32,
    pb: &ProgressBar,
) -> anyhow::Result<(Vec<NvmeRun>, Vec<FloorRun>)> {
    let (o, j) = (ctx.o, &ctx.o.jobs[ji]);
    let pin = o.pin.map(|p| p.pair());
    let (mut runs, mut floors) = (Vec::new(), Vec::new());
    let say = |round: u32, t: &Target| {
        pb.set_message(format!("re-run {attempt} round {}/{} {} {}", round + 1, o.rounds, j.label(), t.name))
    };
    let run = |round: u32, t: &Target| -> anyhow::Result<NvmeRun> {
        let mut r = ctx.run_target(t, ji, round).with_context(|| format!("{} round {round}", t.name))?;
        r.attempt = attempt;
        Ok(r)
    };
    for round in 0..o.rounds {
        for t in twins {
            for f in fio.iter().filter(|f| f.contend == t.contend) {
                say(round, f);
                runs.push(run(round, f)?);
                pb.inc(1);
            }
            say(round, t);
            let (mut f, e) = crate::floor::measure_round(&[floor_qd(j)], round, o.floor_ms, pin);
            if !e.is_empty() {
                anyhow::bail!("{}", e.join("; "));
            }
            for x in f.iter_mut() {
                x.attempt = attempt;
            }
            let wake = if j.thinktime_us > 0 {
                let w = crate::wake::run_wake(crate::wake::WAKES, crate::wake::IDLE, pin, round);
                Some(w.context("wake")?.p50_ns)
            } else {
                None
            };
            let mut r = run(round, t)?;
            r.floor_ops_s = f.first().map(|f| f.ops_s);
            r.floor_p50_ns = f.first().map(|f| f.p50_ns);
            r.wake_p50_ns = wake;
            r.fill_floor_ratios(j);
            runs.push(r);
            floors.extend(f);
            pb.inc(1);
        }
    }
    Ok((runs, floors))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Marks with their ratios rounded to 1e-9, to compare exactly.
    fn r9(m: Vec<Mark>) -> Vec<Mark> {
        let r = |x: f64| (x * 1e9).round() / 1e9;
        m.into_iter()
            .map(|m| match m {
                Mark::BelowFloor { ratio, floor } => Mark::BelowFloor { ratio: r(ratio), floor },
                Mark::Spread { max_over_min } => Mark::Spread { max_over_min: r(max_over_min) },
                Mark::Outlier { round, ratio } => Mark::Outlier { round, ratio: r(ratio) },
                Mark::Unguarded => Mark::Unguarded,
            })
            .collect()
    }

    fn job(iodepth: u32) -> Job {
        Job::randread(4096, iodepth)
    }

    fn run(round: u32, iops: f64, p50_ns: f64, floor_ops_s: f64, floor_p50_ns: f64) -> NvmeRun {
        let mut r = NvmeRun::new("iopath-shm", "iopath ram", 0, round, 1000, 1000);
        (r.io.iops, r.io.p50_ns, r.floor_ops_s, r.floor_p50_ns) = (iops, p50_ns, Some(floor_ops_s), Some(floor_p50_ns));
        r
    }

    #[test]
    fn iops_above_the_rounds_floor_are_marked() {
        let g = GuardConfig::default();
        // 1.0 M IOPS against a 0.8 M floor: a cost of 0.8x the floor's.
        let m = r9(run_marks(&g, &run(0, 1.0e6, 5000.0, 0.8e6, 1000.0), &job(16)));
        assert_eq!(m, vec![Mark::BelowFloor { ratio: 0.8, floor: "ring floor qd16 ops/s".into() }]);
        // Up to 1/0.95 of the floor is noise, not a mark.
        assert!(run_marks(&g, &run(0, 1.05e6, 5000.0, 1.0e6, 1000.0), &job(16)).is_empty());
        // Several pollers serve several rings: one ring is no floor for them.
        let mut p2 = run(0, 1.0e6, 5000.0, 0.8e6, 1000.0);
        p2.pollers = 2;
        assert!(run_marks(&g, &p2, &job(16)).is_empty());
        // No floor measured: nothing to judge.
        let mut nf = run(0, 1.0e6, 5000.0, 0.8e6, 1000.0);
        nf.floor_ops_s = None;
        assert!(run_marks(&g, &nf, &job(16)).is_empty());
    }

    #[test]
    fn a_qd1_p50_under_the_floors_is_marked_at_qd1_only() {
        let g = GuardConfig::default();
        let m = r9(run_marks(&g, &run(0, 1.0e5, 500.0, 1.0e6, 1000.0), &job(1)));
        assert_eq!(m, vec![Mark::BelowFloor { ratio: 0.5, floor: "ring floor qd1 p50".into() }]);
        assert!(run_marks(&g, &run(0, 1.0e5, 960.0, 1.0e6, 1000.0), &job(1)).is_empty());
        // At QD16 the floor's p50 is not a bound on the run's.
        assert!(run_marks(&g, &run(0, 1.0e5, 500.0, 1.0e6, 1000.0), &job(16)).is_empty());
    }

    #[test]
    fn a_mark_on_either_twin_marks_both_levels() {
        use super::super::run::Kind;
        use iopath_devices::nvme::DoorbellMode;
        let g = GuardConfig::default();
        let kind = Kind::Iopath(None, super::super::run::Setup::plain(DoorbellMode::Shm));
        let twins = [
            Target { name: "iopath-shm".into(), kind, contend: 0 },
            Target { name: "iopath-shm+contend2".into(), kind, contend: 2 },
        ];
        let busy = |round: u32, iops: f64| {
            let mut r = run(round, iops, 5000.0, 2.0e6, 1.0);
            (r.target, r.contend) = ("iopath-shm+contend2".into(), 2);
            r
        };
        let calm = vec![run(0, 1.0e6, 5000.0, 2.0e6, 1.0), run(1, 1.1e6, 5000.0, 2.0e6, 1.0)];
        assert!(twins_marks(&g, &twins, &[calm.clone(), vec![busy(0, 0.4e6), busy(1, 0.5e6)]].concat(), &job(16))
            .is_empty());
        // The busy twin's rounds disagree: the group is marked, though the quiet twin is calm.
        let m = twins_marks(&g, &twins, &[calm, vec![busy(0, 0.1e6), busy(1, 0.5e6)]].concat(), &job(16));
        assert_eq!(r9(m), vec![Mark::Spread { max_over_min: 5.0 }]);
    }

    #[test]
    fn a_target_gets_its_worst_floor_mark_and_its_spread() {
        let g = GuardConfig::default();
        let runs =
            [run(0, 1.0e6, 5000.0, 0.9e6, 1.0), run(1, 2.5e6, 5000.0, 2.0e6, 1.0), run(2, 0.5e6, 5000.0, 1.0e6, 1.0)];
        let m = r9(group_marks(&g, &runs, &job(16)));
        assert_eq!(
            m,
            vec![
                Mark::BelowFloor { ratio: 0.8, floor: "ring floor qd16 ops/s".into() },
                Mark::Spread { max_over_min: 5.0 }
            ]
        );
        let calm = [run(0, 1.0e6, 1.0, 2.0e6, 1.0), run(1, 1.5e6, 1.0, 2.0e6, 1.0)];
        assert!(group_marks(&g, &calm, &job(16)).is_empty());
    }
}
