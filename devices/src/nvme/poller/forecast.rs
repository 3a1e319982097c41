//! The adaptive pollers' forecast of the next submission after an idle gap.
//!
//! A guest that submits at a steady pace (fio's `thinktime` or `rate_iops`,
//! a timer-driven application, a synchronous writer with steady compute
//! between writes) leaves gaps of about the same length. Each one longer
//! than the idle interval puts the poller to sleep, and each next command
//! then waits for its doorbell to wake it (35-45 us on this project's
//! nested hosts). With a forecast the poller sets a timer for a little
//! before the next command is due, polls from then on, and finds it in
//! memory: the doorbell is not rung and nothing waits for a wake-up. This
//! is what Linux's hybrid block polling does for completions (sleep most
//! of the expected time, poll the rest), applied to submissions.
//!
//! The estimate is the median of the last [`GAPS`] gaps and their median
//! absolute deviation (the spread), in nanoseconds: a host that stops a
//! vCPU for a millisecond now and then makes a few gaps long, and a mean
//! would follow them (a smoothed mean and deviation, as TCP's round-trip
//! timer, kept the forecast off for a dozen gaps after each such stall on
//! this project's hosts). A gap is measured from when the poller went idle
//! to when it saw the command: polled, that is exact to a pass; woken by
//! the doorbell, it is late by a wake-up, so the lateness of the timer's
//! own wake-ups (the upper quartile of the last [`LATES`]) is taken off it.
//!
//! The timer is set for the second shortest of the gaps less the timer's
//! lateness; the poll after it lasts until the upper quartile plus two
//! spreads and a lateness. The forecast acts only where it is cheap and
//! likely right: the margin before the median gap is at most a quarter of
//! the gap and at most [`MAX_MARGIN`], the whole poll (if the command does
//! not come) at most twice that, and a forecast that polled for nothing is
//! not made again for 1, 2, 4 .. 64 gaps. Irregular gaps (quartiles too far
//! apart for those bounds) get no forecast: the poller sleeps until its
//! doorbell, as without one.
//!
//! After a timed wake-up the poller polls for the command until
//! [`Forecast::poll_until`] ([`Expect`]); it is a hit if a pass that found
//! nothing came before it (found at the first look, the command came
//! before the timer woke the poller). Everything here is arithmetic on
//! durations the poller measured: no clock is read here.

use std::time::Duration;

/// The longest a forecast polls before the median gap (and twice that in
/// all, if the command does not come): the adaptive pollers' longest idle
/// interval, so a forecast costs no more CPU per gap than a busy idle does.
pub const MAX_MARGIN: Duration = super::super::ADAPTIVE_IDLE;

/// How late a timed wake-up is taken to be before one was measured.
const LATE_INIT: Duration = Duration::from_micros(50);

/// The shortest sleep a forecast sets a timer for: shorter, the poller
/// does not sleep at all (its idle interval covers such gaps).
pub const MIN_SLEEP: Duration = Duration::from_micros(20);

/// Added to every margin: the clock reads around a gap are a few passes
/// apart.
const SLACK_NS: i64 = 5_000;

/// Gaps without a forecast after a miss, doubling from 1 up to this.
const MAX_BACKOFF: u32 = 64;

/// The gaps the estimate is taken over; no forecast before half of them.
const GAPS: usize = 16;

/// The timed wake-ups whose lateness is taken (a wake-up's lateness
/// varies: a quartile covers most, a mean covers half).
const LATES: usize = 8;

/// How the poller saw the command that ended a gap.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Seen {
    /// Polling: the gap is exact to a pass.
    Polled,
    /// Woken by its doorbell: the gap is late by a wake-up.
    Kicked,
}

/// The forecast of one poller (see the module's documentation).
#[derive(Debug)]
pub struct Forecast {
    /// The last gaps, ns (a ring: `next` is the oldest once `n` = GAPS).
    gaps: [i64; GAPS],
    n: usize,
    next: usize,
    /// Their median, median absolute deviation (the spread), second
    /// shortest (of [`GAPS`]) and upper quartile, ns.
    gap: i64,
    dev: i64,
    low: i64,
    high: i64,
    /// The last lateness of timed wake-ups (a ring as `gaps`), ns; and
    /// the lateness taken: their upper quartile.
    lates: [i64; LATES],
    nl: usize,
    late: i64,
    /// Gaps still to pass without a forecast, and the next such wait.
    skip: u32,
    backoff: u32,
}

impl Default for Forecast {
    fn default() -> Self {
        Forecast {
            gaps: [0; GAPS],
            n: 0,
            next: 0,
            gap: 0,
            dev: 0,
            low: 0,
            high: 0,
            lates: [0; LATES],
            nl: 0,
            late: ns(LATE_INIT),
            skip: 0,
            backoff: 1,
        }
    }
}

fn ns(d: Duration) -> i64 {
    d.as_nanos().min(i64::MAX as u128) as i64
}

fn dur(ns: i64) -> Duration {
    Duration::from_nanos(ns.max(0) as u64)
}

/// The median of `v` (sorted in place; the upper one of an even count).
fn median(v: &mut [i64]) -> i64 {
    v.sort_unstable();
    v[v.len() / 2]
}

impl Forecast {
    /// How long before the median gap the timer is set. The doorbell-woken
    /// gaps scatter by the wake-up's own spread (tens of microseconds here)
    /// around the true gap, and a guest's own pace varies by as much: so the
    /// second shortest gap (one short one is not trusted) less a lateness. A
    /// command that comes before the timer rings, as without a forecast; once
    /// forecasts hit, the polled gaps narrow the spread.
    fn margin(&self) -> i64 {
        self.gap - self.low + self.late + SLACK_NS
    }

    /// A command came `gap` after the poller went idle.
    pub fn seen(&mut self, gap: Duration, how: Seen) {
        let s = match how {
            Seen::Polled => ns(gap),
            Seen::Kicked => (ns(gap) - self.late).max(0),
        };
        self.gaps[self.next] = s;
        self.next = (self.next + 1) % GAPS;
        self.n = (self.n + 1).min(GAPS);
        let mut v = [0i64; GAPS];
        let v = &mut v[..self.n];
        v.copy_from_slice(&self.gaps[..self.n]);
        self.gap = median(v);
        (self.low, self.high) = (v[v.len() / 16], v[v.len() * 3 / 4]);
        v.iter_mut().for_each(|x| *x = (*x - self.gap).abs());
        self.dev = median(v);
        self.skip = self.skip.saturating_sub(1);
    }

    /// When, after the poller went idle, to wake and poll for the next
    /// command; None: no forecast (irregular or short gaps, after a miss).
    pub fn wake_at(&self) -> Option<Duration> {
        let (g, margin) = (self.gap, self.margin());
        // The poll if the command does not come: from the timer to its end.
        let poll = ns(self.poll_until()) - (g - margin);
        if self.n < GAPS / 2 || self.skip > 0 || 4 * margin > g || margin > ns(MAX_MARGIN) || poll > 2 * ns(MAX_MARGIN)
        {
            return None;
        }
        let at = dur(g - margin);
        (at >= MIN_SLEEP).then_some(at)
    }

    /// After a timed wake-up: until when, after the poller went idle, it
    /// polls for the forecast command: the upper quartile, two spreads and
    /// a lateness (gaps measured by a doorbell wake-up took one lateness
    /// off, and that wake-up may have come sooner than a timer's).
    pub fn poll_until(&self) -> Duration {
        dur(self.high + 2 * self.dev + self.late + SLACK_NS)
    }

    /// A timed wake-up came `late` after the time it was set for (taken
    /// as at most [`MAX_MARGIN`]: one stalled wake-up does not turn the
    /// forecast off for long).
    pub fn woke(&mut self, late: Duration) {
        self.lates[self.nl % LATES] = ns(late).min(ns(MAX_MARGIN));
        self.nl += 1;
        let mut v = self.lates;
        let v = &mut v[..self.nl.min(LATES)];
        v.sort_unstable();
        self.late = v[v.len() * 3 / 4];
    }

    /// The forecast command came while the poller polled for it.
    pub fn hit(&mut self) {
        self.backoff = 1;
    }

    /// Nothing came by [`poll_until`](Self::poll_until): no forecast for
    /// the next 1, 2, 4 .. [`MAX_BACKOFF`] gaps.
    pub fn missed(&mut self) {
        self.skip = self.backoff;
        self.backoff = (self.backoff * 2).min(MAX_BACKOFF);
    }
}

/// A poller woken by a forecast's timer (or whose forecast was due
/// already), polling for the command. Times are the poller's clock
/// readings (durations since it started).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Expect {
    /// When the gap began, and until when to poll.
    pub start: Duration,
    pub until: Duration,
    /// A pass has found nothing since the wake-up: a command found now came
    /// while the poller polled for it (a hit).
    pub looked: bool,
}

impl Expect {
    /// Polling for the command of the gap that began at `start`.
    pub fn new(start: Duration, f: &Forecast) -> Self {
        Expect { start, until: start + f.poll_until(), looked: false }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const US: Duration = Duration::from_micros(1);

    #[test]
    fn steady_gaps_give_a_forecast_a_little_before_the_next_command() {
        let mut f = Forecast::default();
        assert_eq!(f.wake_at(), None, "nothing seen yet");
        for i in 0..40 {
            // 1 ms, +-2 us.
            f.seen(1000 * US + if i % 2 == 0 { 2 * US } else { Duration::ZERO }, Seen::Polled);
        }
        let at = f.wake_at().expect("steady gaps");
        // The margin: the initial lateness (50 us) plus a few deviations.
        assert!(at > 930 * US && at < 960 * US, "{at:?}");
        let until = f.poll_until();
        assert!(until > 1050 * US && until < 1070 * US, "{until:?}");
        // Timed wake-ups measured 10 us late: the margin shrinks.
        for _ in 0..40 {
            f.woke(10 * US);
        }
        let later = f.wake_at().unwrap();
        assert!(later > 970 * US && later < 995 * US, "{later:?}");
    }

    #[test]
    fn a_stall_now_and_then_does_not_turn_the_forecast_off() {
        // 1 ms gaps, every 10th 2.4 ms long (a vCPU stopped by its host for 1.4 ms).
        let mut f = Forecast::default();
        for i in 0..100u32 {
            f.seen(if i % 10 == 9 { 2400 * US } else { 1000 * US }, Seen::Polled);
            if i >= GAPS as u32 {
                let at = f.wake_at().unwrap_or_else(|| panic!("gap {i}: {f:?}"));
                assert!(at > 900 * US && at < 1000 * US, "gap {i}: {at:?}");
            }
        }
        // Until fewer than half of the gaps are regular.
        for i in 0..GAPS {
            f.seen(if i % 2 == 0 { 2400 * US } else { 1000 * US }, Seen::Polled);
        }
        assert_eq!(f.wake_at(), None, "{f:?}");
    }

    #[test]
    fn irregular_or_short_gaps_give_none() {
        // Gaps spread over 0.5 .. 1.5 ms.
        let mut f = Forecast::default();
        let mut x = 12345u32;
        for _ in 0..200 {
            x = x.wrapping_mul(1103515245).wrapping_add(12345);
            f.seen(500 * US + (x >> 16) % 1000 * US, Seen::Polled);
        }
        assert_eq!(f.wake_at(), None, "{f:?}");
        // Steady but short: the idle interval covers them.
        let mut f = Forecast::default();
        for _ in 0..40 {
            f.seen(30 * US, Seen::Polled);
        }
        assert_eq!(f.wake_at(), None, "{f:?}");
        // Steady and long, but the margin would exceed MAX_MARGIN: the timer is too late here.
        let mut f = Forecast::default();
        for _ in 0..40 {
            f.seen(100 * 1000 * US, Seen::Polled);
            f.woke(250 * US);
        }
        assert_eq!(f.wake_at(), None, "{f:?}");
    }

    #[test]
    fn a_doorbell_wakeup_counts_less_its_lateness_and_misses_back_off() {
        let mut f = Forecast::default();
        for _ in 0..40 {
            f.woke(30 * US);
        }
        // Woken by the doorbell 30 us after each command: the gap is taken as 1 ms, not 1.03.
        for _ in 0..40 {
            f.seen(1030 * US, Seen::Kicked);
        }
        let until = f.poll_until();
        assert!(until > 1030 * US && until < 1040 * US, "{until:?}");
        assert!(f.wake_at().is_some());
        // A miss: none for the next gap; two more misses: none for two, then four.
        f.missed();
        assert_eq!(f.wake_at(), None);
        f.seen(1000 * US, Seen::Polled);
        assert!(f.wake_at().is_some());
        f.missed();
        for _ in 0..2 {
            assert_eq!(f.wake_at(), None);
            f.seen(1000 * US, Seen::Polled);
        }
        assert!(f.wake_at().is_some());
        f.missed();
        for _ in 0..4 {
            assert_eq!(f.wake_at(), None);
            f.seen(1000 * US, Seen::Polled);
        }
        // A hit resets the back-off.
        f.hit();
        f.missed();
        assert_eq!(f.wake_at(), None);
        f.seen(1000 * US, Seen::Polled);
        assert!(f.wake_at().is_some());
    }

    #[test]
    fn over_random_gaps_lateness_hits_and_misses_a_forecast_stays_within_its_bounds() {
        use super::super::super::oracle::Rng;
        for seed in 0..4 {
            let mut r = Rng::new(seed);
            let mut f = Forecast::default();
            // The last GAPS gaps as measured (before a lateness is taken off), and
            // the misses since the last hit.
            let mut last = std::collections::VecDeque::new();
            let (mut seen, mut misses, mut skip, mut made) = (0u32, 0u32, 0u32, 0u32);
            let mut base = 1000 * US;
            for step in 0..100_000u32 {
                if r.chance(1) {
                    base = US * r.range(10, 20_000) as u32;
                }
                match r.below(100) {
                    0..=79 => {
                        let spread = US * r.pick(&[0u32, 2, 20, 300]);
                        let g = base + spread * r.below(2) as u32;
                        f.seen(g, if r.chance(70) { Seen::Polled } else { Seen::Kicked });
                        last.push_back(g);
                        if last.len() > GAPS {
                            last.pop_front();
                        }
                        seen += 1;
                        skip = skip.saturating_sub(1);
                    }
                    80..=87 => {
                        let most = if r.chance(90) { 60 } else { 2000 };
                        f.woke(US * r.range(0, most) as u32)
                    }
                    88..=94 => {
                        f.hit();
                        misses = 0;
                    }
                    _ => {
                        f.missed();
                        skip = 1 << misses.min(6);
                        misses += 1;
                    }
                }
                let Some(at) = f.wake_at() else { continue };
                made += 1;
                let ctx = format!("seed {seed} step {step}: {f:?}");
                assert!(seen as usize >= GAPS / 2 && skip == 0, "a forecast too early or while backing off: {ctx}");
                assert!(at >= MIN_SLEEP, "{at:?}: {ctx}");
                assert!(at <= *last.iter().max().unwrap(), "{at:?} after the longest gap: {ctx}");
                let until = f.poll_until();
                assert!(until >= at && until - at <= 2 * MAX_MARGIN, "poll {at:?}..{until:?}: {ctx}");
            }
            assert!(made > 1000, "seed {seed}: only {made} forecasts");
        }
    }
}
