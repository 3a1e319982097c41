//! The sleeping adaptive poller: from arming to awake again (see the
//! states in `mod.rs`).
//!
//! Where the next submission wakes a sleeper, one sleep until woken does:
//! shadow doorbells (`adaptive`) have EventIdx armed, so the driver's next
//! submission rings an ioeventfd (or a message that wakes the poller). A
//! doorbell page in memory (`bar-adaptive`, `auto`) takes the guest's
//! stores silently, so the poller sleeps in timed steps ([`BAR_IDLE_STEP`]
//! doubling up to [`BAR_IDLE_MAX`]) and looks at the page between them;
//! asleep for [`BAR_TRAP_AFTER`] (by the clock: a loaded host wakes a
//! sleeper late), it has the host trap the page, and the steps end: a
//! store then exits and wakes it. Two memslot changes cost the guest and
//! the poller hundreds of microseconds on this project's nested machines:
//! paid only once an idle is long, they take the last timed wake-ups away.
//!
//! A wake-up tells the idle interval how long the sleep was (a forecast's
//! timer counts as a long one: taken as short, it grew the interval to the
//! whole gap, and the poller spun through gaps of 250 us), and the
//! forecast the gap a kick ended and how late its own timer fired.

use super::super::{ADAPTIVE_IDLE, BAR_IDLE_MAX, BAR_IDLE_STEP, BAR_TRAP_AFTER};
use super::forecast::{Expect, Seen};
use super::{sooner, Action, Poller, Trap};
use std::time::Duration;

/// One sleep, from preparing it to awake again.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct Nap {
    /// When the idle gap began, and when the forecast's timer is due.
    gap_start: Duration,
    wake_at: Option<Duration>,
    /// When the wait for a held timed completion ends (its due time less
    /// [`super::TIMED_MARGIN`]).
    due: Option<Duration>,
    /// When the poller armed (the sleep's length counts from there), and
    /// the last clock reading since.
    since: Duration,
    now: Duration,
    /// The next timed step (None: no steps; shadow doorbells, or trapped).
    step: Option<Duration>,
    /// Decided when waking, applied once awake: the gap a kick ended, the
    /// lateness of a forecast's timer, and whether the timer woke it.
    kicked_gap: Option<Duration>,
    late: Option<Duration>,
    timer: bool,
    /// The wait for a timed completion ended it (a planned wake-up, as a
    /// forecast's timer: no short sleep for the idle interval).
    due_woke: bool,
}

impl Nap {
    pub(super) fn new(gap_start: Duration, wake_at: Option<Duration>, due: Option<Duration>) -> Nap {
        Nap { gap_start, wake_at, due, ..Nap::default() }
    }

    pub(super) fn due(&self) -> Option<Duration> {
        self.due
    }

    /// The next timed step, twice the last, up to the cap.
    fn next_step(&mut self) {
        self.step = self.step.map(|d| (d * 2).min(BAR_IDLE_MAX));
    }
}

impl Poller {
    /// This sleep's state (made afresh if a wrong observation came: the
    /// poller then wakes, which undoes any arming).
    fn nap(&mut self) -> &mut Nap {
        debug_assert!(self.nap.is_some(), "an observation of a sleep the poller did not prepare");
        self.nap.get_or_insert_with(Nap::default)
    }

    /// The sleep until the earliest of: a retry, a timed step, the
    /// forecast's timer, a held timed completion's due time (less the margin).
    fn sleep(&mut self) -> Action {
        let retry = self.retry.after();
        let n = self.nap();
        let timer = n.wake_at.map(|w| w.saturating_sub(n.now));
        let due = n.due.map(|d| d.saturating_sub(n.now));
        Action::Sleep { timeout: sooner(sooner(retry, n.step), sooner(timer, due)) }
    }

    pub(super) fn armed(&mut self, at: Option<Duration>) -> Action {
        let Some(t) = at else {
            // A submission raced with the arming: poll it.
            self.nap = None;
            (self.idle_since, self.idle_passes) = (None, 0);
            return self.next_pass();
        };
        // The thread dropped its watch of the words (a sleep can be long).
        (self.watching, self.looks) = (false, 0);
        let page = self.cfg.page;
        let n = self.nap();
        (n.since, n.now) = (t, t);
        n.step = page.then_some(BAR_IDLE_STEP);
        self.sleep()
    }

    pub(super) fn woke(&mut self, kicked: bool, completed: bool, now: Duration) -> Action {
        let retrying = self.retry.after().is_some();
        let n = self.nap();
        n.now = now;
        let timer = !kicked && !completed && n.wake_at.is_some_and(|w| now >= w);
        // A held timed completion is near: awake to post it (no forecast's timer).
        let due = n.due.is_some_and(|d| now >= d);
        n.due_woke = due;
        if !timer && !due && !kicked && !completed && !retrying && n.step.is_some() {
            // A timed step ended: a look at the page, still asleep.
            return Action::LookAsleep;
        }
        self.wake(kicked, completed, timer)
    }

    pub(super) fn looked_asleep(&mut self, found: bool, now: Duration) -> Action {
        let n = self.nap();
        n.now = now;
        if found {
            return self.wake(false, false, false);
        }
        // Nothing there: a longer sleep; idle long enough, the page trapped instead.
        n.next_step();
        if now.saturating_sub(n.since) < BAR_TRAP_AFTER {
            return self.sleep();
        }
        Action::Trap
    }

    pub(super) fn trapped(&mut self, t: Trap) -> Action {
        match t {
            Trap::Set => {
                self.nap().step = None;
                self.sleep()
            }
            // The steps go on (and the next one past BAR_TRAP_AFTER asks again).
            Trap::Cannot => self.sleep(),
            Trap::Raced => self.wake(false, false, false),
        }
    }

    /// Wakes up; what the wake-up tells the forecast is kept for `awake`.
    fn wake(&mut self, kicked: bool, completed: bool, timer: bool) -> Action {
        let in_flight = self.in_flight;
        let n = self.nap();
        n.kicked_gap = (kicked && !in_flight).then(|| n.now.saturating_sub(n.gap_start));
        n.late = n.wake_at.filter(|_| timer).map(|w| n.now.saturating_sub(w));
        n.timer = timer;
        Action::Wake { kicked, completed, forecast: timer }
    }

    pub(super) fn awake(&mut self, stalled: bool, now: Duration) -> Action {
        let n = self.nap.take().unwrap_or_default();
        self.retry.next(stalled);
        if !self.in_flight {
            self.window.slept(if n.timer || n.due_woke { ADAPTIVE_IDLE } else { now.saturating_sub(n.since) });
        }
        if let Some(gap) = n.kicked_gap {
            self.forecast.seen(gap, Seen::Kicked);
        }
        if let Some(late) = n.late {
            // Poll for the forecast command from here on.
            self.forecast.woke(late);
            self.expect = Some(Expect::new(n.gap_start, &self.forecast));
        }
        (self.idle_since, self.idle_passes) = (None, 0);
        self.next_pass()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timed_steps_double_up_to_the_cap() {
        let mut n = Nap { step: Some(BAR_IDLE_STEP), ..Nap::default() };
        let mut last = BAR_IDLE_STEP;
        for _ in 0..20 {
            n.next_step();
            let d = n.step.unwrap();
            assert!(d >= last && d <= BAR_IDLE_MAX, "{d:?} after {last:?}");
            last = d;
        }
        assert_eq!(last, BAR_IDLE_MAX);
        let mut n = Nap::default();
        n.next_step();
        assert_eq!(n.step, None, "no steps: none come");
        let ms = Duration::from_millis(1);
        assert_eq!(sooner(Some(ms), Some(ms / 200)), Some(ms / 200));
        assert_eq!(sooner(None, Some(ms)), Some(ms));
        assert_eq!(sooner(None, None), None);
    }
}
