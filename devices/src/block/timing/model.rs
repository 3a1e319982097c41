//! The timing model: [`TimingModel::admit`] turns a command's arrival into
//! its due time. Deterministic (a seeded `crate::rng::SplitMix64`, no clock,
//! no thread: time is an argument) so a run can be replayed exactly.
//!
//! A command arriving at `now`:
//! 1. draws its service time `s` from its operation's [`Latency`] (none
//!    configured: 0, and it skips the channels);
//! 2. starts when the earliest-free of the N channels is free (`start =
//!    max(now, free)`; commands take channels in arrival order), which is
//!    then busy until `start + s`; no `channels`: it starts at `now`;
//! 3. is due at the earliest `t >= start + s` such that the ceilings hold.
//!
//! The ceilings are reservation calendars in virtual time (picoseconds, so
//! 1/iops and bytes/bw lose nothing to rounding): each ceiling is a line
//! of busy intervals that never overlap; a command holds `1/iops` of the
//! IOPS line and `bytes/bw` of the bandwidth line (the controller's slot
//! and its data transfer), both ending at its due time `t` and starting
//! no earlier than the end of the last interval forgotten (an absolute
//! schedule: idle time before that is not banked, and a command that
//! arrives late still gets the slot right after the previous one, so
//! lateness does not accumulate). As intervals are disjoint, any K
//! consecutive completions span at least K-1 slots (rate <= iops·K/(K-1):
//! 0.1% over for K = 1000) and the bytes completing in a window exceed
//! `bw × window` by at most one command's transfer. Why not the usual
//! pacers: a token bucket's burst allowance lets a window of 1000 commands
//! exceed the rate by the burst, and a single virtual clock (GCRA) gives
//! slots in arrival order, so a fast command would wait for a slow one's
//! slot: the latency distribution would change far below the ceiling. The
//! calendar places each command at the first free slot at or after its
//! own completion, so below the ceiling a command is delayed only when a
//! neighbour's slot actually overlaps its own (at most a few slots).
//!
//! Arrivals must not go back in time; an earlier `now` (two threads'
//! clock reads racing for the model's lock) counts as the latest seen.

use super::spec::{Latency, OpKind, TimingSpec, DEFAULT_SEED, MAX_DURATION_NS};
use crate::rng::SplitMix64;
use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap};
use std::ops::Bound;

/// What [`TimingModel::admit_full`] decided for one command (ns).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Admission {
    /// The arrival as the model took it (never before an earlier one's).
    pub arrival_ns: u64,
    /// When a channel took it.
    pub start_ns: u64,
    /// Its drawn service time.
    pub service_ns: u64,
    /// When its completion is due: `>= start + service`.
    pub due_ns: u64,
}

/// A namespace's device time (see the module doc).
pub struct TimingModel {
    latency: [Option<Latency>; 4],
    /// Each channel's free time; None: unbounded parallelism.
    channels: Option<BinaryHeap<Reverse<u64>>>,
    /// The IOPS line and one command's slot (ps).
    iops: Option<(Line, u128)>,
    /// The bandwidth line and the ceiling (bytes per second).
    bw: Option<(Line, u128)>,
    rng: SplitMix64,
    spare_normal: Option<f64>,
    last_now: u64,
}

const PS_PER_S: u128 = 1_000_000_000_000;

impl TimingModel {
    pub fn new(spec: &TimingSpec) -> Self {
        TimingModel {
            latency: spec.latency,
            channels: spec.channels.map(|n| (0..n).map(|_| Reverse(0)).collect()),
            iops: spec.iops.map(|n| {
                let slot = (PS_PER_S / n as u128).max(1);
                (Line::new(slot), slot)
            }),
            bw: spec.bw.map(|b| (Line::new(u128::MAX), b as u128)),
            rng: SplitMix64(spec.seed.unwrap_or(DEFAULT_SEED)),
            spare_normal: None,
            last_now: 0,
        }
    }

    /// The due time (ns) of a command of kind `op` moving `bytes` of data
    /// (0 for a flush or a discard; at most the front end's largest
    /// transfer, as it holds the bandwidth line for bytes/bw) that arrives
    /// at `now_ns`.
    pub fn admit(&mut self, now_ns: u64, op: OpKind, bytes: u64) -> u64 {
        self.admit_full(now_ns, op, bytes).due_ns
    }

    /// [`admit`](Self::admit) with the steps it took.
    pub fn admit_full(&mut self, now_ns: u64, op: OpKind, bytes: u64) -> Admission {
        let now = now_ns.max(self.last_now);
        self.last_now = now;
        let service = match self.latency[op.index()] {
            Some(l) => self.sample(l),
            None => 0,
        };
        let start = match (&mut self.channels, service) {
            (Some(free), s) if s > 0 => {
                let mut earliest = free.peek_mut().expect("at least one channel");
                let start = now.max(earliest.0);
                earliest.0 = start.saturating_add(s);
                start
            }
            _ => now,
        };
        let ready = start.saturating_add(service);
        let due = self.pace(now, ready, bytes);
        Admission { arrival_ns: now, start_ns: start, service_ns: service, due_ns: due }
    }

    /// The earliest due time at or after `ready` that both ceilings allow,
    /// with its slots reserved.
    fn pace(&mut self, now: u64, ready: u64, bytes: u64) -> u64 {
        if self.iops.is_none() && self.bw.is_none() {
            return ready;
        }
        let now_ps = now as u128 * 1000;
        let slot_iops = self.iops.as_ref().map_or(0, |(_, d)| *d);
        let slot_bw = self.bw.as_ref().map_or(0, |(_, b)| (bytes as u128 * PS_PER_S).div_ceil(*b));
        for (line, _) in self.iops.iter_mut().chain(self.bw.iter_mut()) {
            line.forget_before(now_ps);
        }
        let mut t = ready as u128 * 1000;
        loop {
            let before = t;
            if let Some((line, _)) = &self.iops {
                t = line.fit(t, slot_iops, line.floor);
            }
            if let Some((line, _)) = &self.bw {
                t = line.fit(t, slot_bw, line.floor);
            }
            if t == before {
                break;
            }
        }
        if let Some((line, _)) = &mut self.iops {
            line.reserve(t - slot_iops, t);
        }
        if let Some((line, _)) = &mut self.bw {
            line.min_gap = line.min_gap.min(slot_bw.max(1));
            line.reserve(t - slot_bw, t);
        }
        u64::try_from(t.div_ceil(1000)).unwrap_or(u64::MAX)
    }

    /// One service time (ns) from `l`.
    fn sample(&mut self, l: Latency) -> u64 {
        match l {
            Latency::Constant(d) => d,
            Latency::Uniform { lo, hi } => {
                let span = (hi - lo) as u128 + 1;
                lo + ((self.rng.next_u64() as u128 * span) >> 64) as u64
            }
            Latency::LogNormal { .. } => {
                let (mu, sigma) = l.lognormal_params().expect("a log-normal");
                let z = self.normal();
                ((mu + sigma * z).exp().round() as u64).clamp(1, MAX_DURATION_NS)
            }
        }
    }

    /// A standard normal draw (Box-Muller, both of each pair used).
    fn normal(&mut self) -> f64 {
        if let Some(z) = self.spare_normal.take() {
            return z;
        }
        let (u1, u2) = (self.rng.unit(), self.rng.unit());
        let r = (-2.0 * u1.ln()).sqrt();
        let a = std::f64::consts::TAU * u2;
        self.spare_normal = Some(r * a.sin());
        r * a.cos()
    }
}

/// A ceiling's busy intervals (ps), start -> end, disjoint; those that
/// ended before the latest arrival are forgotten, so it holds at most one
/// interval per command in flight, and `floor` is the end of the last one
/// forgotten: a new interval starts there or later (so it overlaps none,
/// forgotten or not), possibly before its command's arrival. That is an
/// absolute schedule: a command arriving at most one slot after the
/// previous one's due time is due exactly one slot after it (at QD1 the
/// ceiling is reached, not 1 / (slot + the path's time)), while any K
/// consecutive completions still span K-1 slots. A gap narrower than `min_gap` (the
/// IOPS slot; the shortest transfer seen so far) could hold no slot, so
/// its neighbours merge over it: `fit` then skips a whole busy run in one
/// step instead of walking its fragments (for the IOPS line this loses
/// nothing; for bandwidth, only a later transfer shorter than any before
/// it could have used such a gap).
struct Line {
    busy: BTreeMap<u128, u128>,
    min_gap: u128,
    floor: u128,
}

impl Line {
    fn new(min_gap: u128) -> Self {
        Line { busy: BTreeMap::new(), min_gap, floor: 0 }
    }

    fn forget_before(&mut self, now: u128) {
        while let Some(e) = self.busy.first_entry() {
            if *e.get() > now {
                break;
            }
            self.floor = self.floor.max(e.remove());
        }
    }

    /// The earliest end `e >= t` of a free interval `[e - d, e)` that
    /// starts at or after `floor`.
    fn fit(&self, t: u128, d: u128, floor: u128) -> u128 {
        if d == 0 {
            return t;
        }
        let mut s = t.saturating_sub(d).max(floor);
        loop {
            if let Some((_, &end)) = self.busy.range(..=s).next_back() {
                if end > s {
                    s = end;
                    continue;
                }
            }
            match self.busy.range((Bound::Excluded(s), Bound::Unbounded)).next() {
                Some((&next, &end)) if next < s + d => s = end,
                _ => return s + d,
            }
        }
    }

    /// Marks `[s, e)` busy (free, as `fit` found it), merged with a
    /// neighbour less than `min_gap` away.
    fn reserve(&mut self, mut s: u128, mut e: u128) {
        if s == e {
            return;
        }
        if let Some((&ps, &pe)) = self.busy.range(..s).next_back() {
            if s - pe < self.min_gap {
                self.busy.remove(&ps);
                s = ps;
            }
        }
        if let Some((&ns, &ne)) = self.busy.range(e..).next() {
            if ns - e < self.min_gap {
                self.busy.remove(&ns);
                e = ne;
            }
        }
        self.busy.insert(s, e);
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.busy.len()
    }
}

#[cfg(test)]
mod tests;
