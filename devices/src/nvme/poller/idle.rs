//! How long an awake adaptive poller goes on polling without work: its
//! idle interval ([`IdleWindow`]), and whether its core is shared with a
//! busy thread while it waits for file operations ([`Yielder`]). Pure
//! state: the poller's thread measures the times and passes them in.

use super::super::{ADAPTIVE_IDLE, ADAPTIVE_IDLE_MIN};
use std::time::Duration;

/// A yield that took longer than this met a thread that wants the core
/// for a whole time slice (see [`Yielder`]).
pub const LONG_YIELD: Duration = Duration::from_micros(50);

/// After a long yield: how long the poller sleeps at once rather than
/// yield while it waits for file operations.
pub const BESIDE_BUSY: Duration = Duration::from_millis(10);

/// While only file operations are in flight, an idle pass yields the core
/// rather than spin: the storage stack's own work (a loop or dm worker,
/// the block layer's completions) may be waiting for that core, and alone
/// on it a yield returns at once, so the poller still sees a completion
/// within a pass. A yield that lasted over [`LONG_YIELD`] handed the core
/// to a busy thread for its slice: for [`BESIDE_BUSY`] the poller then
/// sleeps at once instead (the completion eventfd wakes it, and a woken
/// thread is scheduled ahead of one that spins).
/// On a loop device over /dev/shm, 4 KiB randread QD32: 129-137 k IOPS
/// spinning, 165-176 k yielding (fio on the host: 177-205 k).
#[derive(Clone, Copy, Debug, Default)]
pub struct Yielder {
    busy_until: Option<Duration>,
}

impl Yielder {
    /// True while, at `now`, a recent yield found the core shared with a
    /// busy thread.
    pub fn beside_busy(&self, now: Duration) -> bool {
        self.busy_until.is_some_and(|t| now < t)
    }

    /// A yield took `took` and ended at `now`.
    pub fn yielded(&mut self, took: Duration, now: Duration) {
        if took > LONG_YIELD {
            self.busy_until = Some(now + BESIDE_BUSY);
        }
    }
}

/// How long an idle poller polls before it sleeps, adapted as KVM adapts
/// its halt polling. A sleep that ended within [`ADAPTIVE_IDLE`] (the next
/// submission came soon: polling a while longer would have caught it
/// without a wake-up) doubles the interval, up to [`ADAPTIVE_IDLE`]; a
/// longer sleep (the gaps are long: the polling before it bought nothing)
/// halves it, down to [`ADAPTIVE_IDLE_MIN`]. With a command every
/// millisecond the poller then spins 10 us before each sleep, not 200.
/// A burst ([`BURST_PASSES`] passes with work since the poller woke) puts
/// the full interval back: on shared cores the vCPU's long preemptions
/// make long sleeps too, and a short interval would then put the poller to
/// sleep in every short gap of the burst that follows (each wake-up waits
/// for the contended CPU: 1.5-2.1 ms p99.9 against 0.07-1.1 ms with the
/// fixed interval, `--contend 2`, 512 B QD16).
#[derive(Clone, Copy, Debug)]
pub struct IdleWindow {
    now: Duration,
    busy: u32,
}

/// Passes with work after a wake-up that make a burst (see [`IdleWindow`]).
pub const BURST_PASSES: u32 = 64;

impl IdleWindow {
    pub fn new() -> Self {
        IdleWindow { now: ADAPTIVE_IDLE, busy: 0 }
    }
    pub fn get(&self) -> Duration {
        self.now
    }
    /// A sleep of `slept` (from arming to waking) ended.
    pub fn slept(&mut self, slept: Duration) {
        self.busy = 0;
        self.now = if slept < ADAPTIVE_IDLE {
            (self.now * 2).min(ADAPTIVE_IDLE)
        } else {
            (self.now / 2).max(ADAPTIVE_IDLE_MIN)
        };
    }
    /// A pass found work.
    #[inline]
    pub fn busy(&mut self) {
        if self.busy < BURST_PASSES {
            self.busy += 1;
            if self.busy == BURST_PASSES {
                self.now = ADAPTIVE_IDLE;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_idle_window_halves_after_long_sleeps_and_doubles_back_after_short_ones() {
        let mut w = IdleWindow::new();
        assert_eq!(w.get(), ADAPTIVE_IDLE);
        // A command every millisecond: each sleep is long, the window shrinks to its floor.
        let mut seen = vec![w.get()];
        for _ in 0..10 {
            w.slept(Duration::from_millis(1));
            seen.push(w.get());
        }
        assert!(seen.windows(2).all(|p| p[1] <= p[0]), "{seen:?}");
        assert_eq!(w.get(), ADAPTIVE_IDLE_MIN);
        // Commands a few tens of microseconds apart: the sleeps are short, it grows back.
        for _ in 0..10 {
            w.slept(Duration::from_micros(30));
        }
        assert_eq!(w.get(), ADAPTIVE_IDLE);
        // A sleep of exactly the maximum counts as long.
        w.slept(ADAPTIVE_IDLE);
        assert_eq!(w.get(), ADAPTIVE_IDLE / 2);
        // A few commands after a wake-up keep the short interval; a burst restores the full one.
        for _ in 0..5 {
            w.slept(Duration::from_millis(1));
        }
        assert_eq!(w.get(), ADAPTIVE_IDLE_MIN);
        for _ in 0..BURST_PASSES - 1 {
            w.busy();
        }
        assert_eq!(w.get(), ADAPTIVE_IDLE_MIN);
        w.busy();
        assert_eq!(w.get(), ADAPTIVE_IDLE);
        w.slept(Duration::from_millis(1));
        assert_eq!(w.get(), ADAPTIVE_IDLE / 2, "the count starts again at each wake-up");
    }

    #[test]
    fn a_long_yield_means_a_busy_neighbour_for_a_while_and_a_short_one_changes_nothing() {
        let us = Duration::from_micros(1);
        let mut y = Yielder::default();
        assert!(!y.beside_busy(Duration::ZERO));
        y.yielded(LONG_YIELD, 100 * us);
        assert!(!y.beside_busy(100 * us), "exactly LONG_YIELD is not long");
        y.yielded(LONG_YIELD + us, 200 * us);
        assert!(y.beside_busy(200 * us));
        assert!(y.beside_busy(200 * us + BESIDE_BUSY - us));
        assert!(!y.beside_busy(200 * us + BESIDE_BUSY), "for BESIDE_BUSY, then spinning again");
        // A short yield later does not end the busy period early.
        y.yielded(us, 300 * us);
        assert!(y.beside_busy(300 * us));
    }
}
