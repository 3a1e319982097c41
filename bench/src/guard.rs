//! The guard on figures: a cost below its physical floor, or rounds that
//! disagree too much, is marked, in the table and in the JSON, and the row
//! is run again (a bounded number of times) before the mark stays.
//!
//! A figure below its floor cannot be true: iopath's exit cheaper than a
//! bare `KVM_RUN` loop, an out-of-process write cheaper than the exit plus
//! the socket round trip it needs, NVMe IOPS above the same round's ring
//! floor. Such a figure comes from a broken measurement (a collapsed batch,
//! a host that changed state between the two runs), never from the path.

use crate::stats::Summary;
use serde_json::{json, Value};

/// Schema version of every `--json` document the benches write; bumped
/// when a field changes meaning or goes away (new fields do not bump it).
/// 3: `bench nvme`'s `options.contend` is a list of levels.
/// 4: `bench reconnect`'s `pause_ms` is each kill's pause to the device's
/// first completion after it (was the guest's longest gaps: `guest_gap_ms`).
pub const JSON_SCHEMA_VERSION: u32 = 4;

/// Thresholds and the re-run budget; `bench exits` and `bench nvme` take
/// `--reruns` and `--max-spread` (the field's doc is the option's help, its
/// default the one of [`GuardConfig::default`]).
#[derive(Clone, Copy, Debug, PartialEq, clap::Args)]
pub struct GuardConfig {
    /// A row marked by the guard (a figure below its floor, or rounds spread
    /// over --max-spread) is run again up to this many times before the mark stays.
    #[arg(long, default_value_t = GuardConfig::default().reruns, value_parser = clap::value_parser!(u32).range(0..=5))]
    pub reruns: u32,
    /// The guard marks rows whose rounds' max/min is above this.
    #[arg(long, default_value_t = GuardConfig::default().max_spread)]
    pub max_spread: f64,
    /// A cost under this fraction of its floor is marked.
    #[arg(skip = GuardConfig::default().min_floor_ratio)]
    pub min_floor_ratio: f64,
    /// A round this many times (or more) away from the median of its row's
    /// other rounds, either way, is marked as an outlier.
    #[arg(skip = GuardConfig::default().max_outlier)]
    pub max_outlier: f64,
}

impl Default for GuardConfig {
    fn default() -> Self {
        GuardConfig { min_floor_ratio: 0.95, max_spread: 2.0, reruns: 2, max_outlier: 100.0 }
    }
}

/// Why a figure is not to be taken at face value.
#[derive(Clone, Debug, PartialEq)]
pub enum Mark {
    /// The cost is `ratio` of the floor named `floor` (below `min_floor_ratio`).
    BelowFloor { ratio: f64, floor: String },
    /// The rounds' max is `max_over_min` times their min.
    Spread { max_over_min: f64 },
    /// Round `round` (0-based, in the order given) is `ratio` times the
    /// median of the other rounds (above 1: larger; below 1: smaller).
    Outlier { round: usize, ratio: f64 },
    /// One round only: no spread or outlier check was possible.
    Unguarded,
}

impl Mark {
    /// A short marker for a table cell.
    pub fn label(&self) -> String {
        match self {
            Mark::BelowFloor { ratio, floor } => format!("!{ratio:.2}x of {floor}"),
            Mark::Spread { max_over_min } => format!("!spread {max_over_min:.1}x"),
            Mark::Outlier { round, ratio } if *ratio >= 1.0 => {
                format!("!round {} {:.0}x the others", round + 1, ratio)
            }
            Mark::Outlier { round, ratio } => format!("!round {} 1/{:.0} of the others", round + 1, 1.0 / ratio),
            Mark::Unguarded => "!unguarded (1 round)".into(),
        }
    }

    pub fn json(&self) -> Value {
        match self {
            Mark::BelowFloor { ratio, floor } => json!({"kind": "below_floor", "ratio": ratio, "floor": floor}),
            Mark::Spread { max_over_min } => json!({"kind": "spread", "max_over_min": max_over_min}),
            Mark::Outlier { round, ratio } => json!({"kind": "outlier", "round": round, "ratio": ratio}),
            Mark::Unguarded => json!({"kind": "unguarded", "rounds": 1}),
        }
    }
}

impl GuardConfig {
    /// Marks a cost (time per access, per I/O) that is below `min_floor_ratio`
    /// of `floor_cost`. Non-finite or non-positive inputs give no mark (no
    /// figure to judge); the caller reports those as missing, not as fine.
    pub fn below_floor(&self, cost: f64, floor_cost: f64, floor: &str) -> Option<Mark> {
        if !(cost.is_finite() && floor_cost.is_finite() && cost > 0.0 && floor_cost > 0.0) {
            return None;
        }
        let ratio = cost / floor_cost;
        (ratio < self.min_floor_ratio).then(|| Mark::BelowFloor { ratio, floor: floor.to_string() })
    }

    /// The same for a rate (IOPS, ops/s): a rate above the floor's rate by
    /// more than 1/`min_floor_ratio` is a cost below it.
    pub fn above_floor_rate(&self, rate: f64, floor_rate: f64, floor: &str) -> Option<Mark> {
        if !(rate.is_finite() && floor_rate.is_finite() && rate > 0.0 && floor_rate > 0.0) {
            return None;
        }
        self.below_floor(1.0 / rate, 1.0 / floor_rate, floor)
    }

    /// Marks a summary over rounds (or batches) whose max/min is above `max_spread`.
    pub fn spread(&self, s: &Summary) -> Option<Mark> {
        if s.n < 2 || !(s.min > 0.0 && s.max.is_finite()) {
            return None;
        }
        let r = s.max / s.min;
        (r > self.max_spread).then_some(Mark::Spread { max_over_min: r })
    }

    /// Marks the rounds of one figure (`rounds`, one value per round, in
    /// round order): each round `max_outlier` times (or more) above or below
    /// its row's other rounds (their median: with two rounds, the other one;
    /// with more, the median of all rounds, which one wild round cannot
    /// move), and a figure of one round as unguarded (no spread or outlier
    /// check can fire on it). No rounds: no mark (the caller reports a
    /// missing figure as missing).
    pub fn rounds(&self, rounds: &[f64]) -> Vec<Mark> {
        let v: Vec<f64> = rounds.iter().copied().filter(|x| x.is_finite()).collect();
        if v.len() == 1 {
            return vec![Mark::Unguarded];
        }
        let all = crate::stats::summarize(&v).map(|s| s.median);
        let mut out = Vec::new();
        for (i, x) in v.iter().enumerate() {
            let m = if v.len() == 2 { Some(v[1 - i]) } else { all };
            let Some(m) = m.filter(|m| *m > 0.0 && *x > 0.0) else { continue };
            let ratio = x / m;
            if ratio >= self.max_outlier || ratio <= 1.0 / self.max_outlier {
                out.push(Mark::Outlier { round: i, ratio });
            }
        }
        out
    }

    /// Runs `attempt` (given the attempt number, 0 first) until `marks` finds
    /// nothing or the re-run budget is spent. Returns the last result, its
    /// marks and how many attempts ran. An error from `attempt` ends it.
    pub fn run<T, E>(
        &self,
        mut attempt: impl FnMut(u32) -> Result<T, E>,
        marks: impl Fn(&T) -> Vec<Mark>,
    ) -> Result<Guarded<T>, E> {
        let mut n = 0;
        loop {
            let value = attempt(n)?;
            n += 1;
            let m = marks(&value);
            if m.is_empty() || n > self.reruns {
                return Ok(Guarded { value, marks: m, attempts: n });
            }
        }
    }
}

/// A result with the marks that stayed and the attempts it took.
#[derive(Clone, Debug)]
pub struct Guarded<T> {
    pub value: T,
    pub marks: Vec<Mark>,
    pub attempts: u32,
}

/// The marks of a row as JSON (an empty array when none).
pub fn marks_json(marks: &[Mark]) -> Value {
    Value::Array(marks.iter().map(Mark::json).collect())
}

/// The marks of a row for a table cell ("" when none).
pub fn marks_label(marks: &[Mark]) -> String {
    marks.iter().map(Mark::label).collect::<Vec<_>>().join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(min: f64, median: f64, max: f64, n: usize) -> Summary {
        Summary { median, min, max, n }
    }

    #[test]
    fn a_cost_under_its_floor_is_marked_and_one_above_is_not() {
        let g = GuardConfig::default();
        assert_eq!(
            g.below_floor(53.0, 100.0, "KVM_RUN"),
            Some(Mark::BelowFloor { ratio: 0.53, floor: "KVM_RUN".into() })
        );
        assert_eq!(g.below_floor(96.0, 100.0, "KVM_RUN"), None);
        assert_eq!(g.below_floor(f64::NAN, 100.0, "KVM_RUN"), None);
        assert_eq!(g.below_floor(10.0, 0.0, "KVM_RUN"), None);
        // 70 M IOPS against a 60 M floor is a cost of 0.86x the floor's.
        assert!(
            matches!(g.above_floor_rate(70e6, 60e6, "ring"), Some(Mark::BelowFloor { ratio, .. }) if (ratio - 60.0 / 70.0).abs() < 1e-9)
        );
        assert_eq!(g.above_floor_rate(20e6, 60e6, "ring"), None);
    }

    #[test]
    fn rounds_that_disagree_are_marked() {
        let g = GuardConfig::default();
        assert_eq!(g.spread(&s(1.0, 2.0, 2.5, 5)), Some(Mark::Spread { max_over_min: 2.5 }));
        assert_eq!(g.spread(&s(1.0, 1.5, 1.9, 5)), None);
        assert_eq!(g.spread(&s(1.0, 1.0, 9.0, 1)), None, "one round has no spread");
    }

    #[test]
    fn a_round_100x_from_the_others_is_an_outlier_and_one_round_is_unguarded() {
        let g = GuardConfig::default();
        // The case: 6.56 ms among rounds of ~107.5 ns.
        let m = g.rounds(&[107.5, 6.56e6, 109.8]);
        assert_eq!(m.len(), 1, "{m:?}");
        assert!(matches!(m[0], Mark::Outlier { round: 1, ratio } if (ratio - 6.56e6 / 109.8).abs() < 1.0));
        assert_eq!(m[0].label(), "!round 2 59745x the others");
        assert_eq!(m[0].json()["kind"], "outlier");
        // Below the others by 100x or more.
        assert!(matches!(g.rounds(&[1000.0, 1000.0, 10.0])[..], [Mark::Outlier { round: 2, ratio }] if ratio == 0.01));
        // 99x is not marked; nor are rounds that agree.
        assert_eq!(g.rounds(&[100.0, 9900.0, 100.0]), vec![]);
        assert_eq!(g.rounds(&[100.0, 10000.0, 100.0]).len(), 1);
        assert_eq!(g.rounds(&[100.0, 120.0]), vec![]);
        // Two rounds 100x apart: each is 100x the other.
        assert_eq!(g.rounds(&[1.0, 100.0]).len(), 2);
        assert_eq!(g.rounds(&[6.56e6]), vec![Mark::Unguarded]);
        assert_eq!(Mark::Unguarded.label(), "!unguarded (1 round)");
        assert_eq!(g.rounds(&[]), vec![]);
        assert_eq!(g.rounds(&[f64::NAN]), vec![]);
    }

    #[test]
    fn a_marked_row_runs_again_within_the_budget() {
        let g = GuardConfig { reruns: 2, ..GuardConfig::default() };
        // Always marked: 1 + 2 attempts, the mark stays.
        let r = g.run(Ok::<u32, ()>, |_| vec![Mark::Spread { max_over_min: 3.0 }]).unwrap();
        assert_eq!((r.value, r.attempts, r.marks.len()), (2, 3, 1));
        // Clean on the second attempt: it stops there, unmarked.
        let r =
            g.run(Ok::<u32, ()>, |v| if *v == 0 { vec![Mark::Spread { max_over_min: 3.0 }] } else { vec![] }).unwrap();
        assert_eq!((r.value, r.attempts, r.marks.len()), (1, 2, 0));
        // An error ends it.
        assert_eq!(g.run(|_| Err::<u32, _>("boom"), |_| vec![]).unwrap_err(), "boom");
        assert_eq!(marks_label(&[Mark::Spread { max_over_min: 3.0 }]), "!spread 3.0x");
        assert_eq!(marks_json(&[]), json!([]));
    }
}
