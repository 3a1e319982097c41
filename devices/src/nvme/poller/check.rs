//! The invariants of an adaptive poller's decisions that the sequence of
//! (observation, action) pairs shows by itself. Checked on the random
//! sequences of `sim.rs` and, in this crate's tests, on every adaptive
//! poller thread (`adaptive.rs`), which the controller's tests and the
//! queue oracle drive.

use super::super::{ADAPTIVE_IDLE, BAR_IDLE_MAX, BAR_TRAP_AFTER};
use super::forecast::MAX_MARGIN;
use super::{Action, Config, Observation, Trap, IDLE_CLOCK_PASSES, MIN_SLEEP, TIMED_MARGIN};
use std::time::Duration;

/// The longest an awake poller goes on polling without work, from the
/// first clock reading of an idle: its longest idle interval, then a
/// forecast due within [`MIN_SLEEP`] and polled for up to twice
/// [`MAX_MARGIN`] past its time, or a timer's poll (up to three times
/// [`MAX_MARGIN`] past the timer, a late one's lateness added).
pub const BUDGET: Duration = ADAPTIVE_IDLE.saturating_add(MIN_SLEEP).saturating_add(MAX_MARGIN.saturating_mul(3));

/// An invariant a poller broke.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Broken {
    /// Awake past its idle budget without arming.
    #[error("idle {0:?} (over {BUDGET:?}) and still polling")]
    PollsPastBudget(Duration),
    /// More spins between clock readings than an idle allows.
    #[error("{0} spins without a look at the clock")]
    SpinsWithoutClock(u32),
    /// An action its state or the observation does not allow.
    #[error("{why}: {seen:?} -> {act:?}")]
    Transition { why: &'static str, seen: Observation, act: Action },
}

/// What the checker knows of the poller (see the module documentation).
pub struct Checker {
    cfg: Config,
    /// Armed, not awake again; when it armed; the page trapped.
    asleep: bool,
    armed_at: Duration,
    trapped: bool,
    /// Spins since the clock was last read.
    spins: u32,
    /// The first clock reading of this idle.
    stretch: Option<Duration>,
    /// The clock was asked for after a pass with work (a gap's end, not an idle).
    gap_clock: bool,
    /// The last pass held a timed completion due sooner than a sleep could
    /// end: the poller polls for it, however long the idle has been (a
    /// thread descheduled past the due time finds it overdue: the next
    /// pass posts it).
    timed_soon: bool,
}

impl Checker {
    pub fn new(cfg: Config) -> Checker {
        Checker {
            cfg,
            asleep: false,
            armed_at: Duration::ZERO,
            trapped: false,
            spins: 0,
            stretch: None,
            gap_clock: false,
            timed_soon: false,
        }
    }

    /// The poller answered `seen` with `act`: an error names the invariant it broke.
    pub fn check(&mut self, seen: Observation, act: Action) -> Result<(), Broken> {
        self.saw(seen);
        self.may(seen, act)?;
        // Idle beyond the budget, an awake poller arms (a polling thread must earn its core).
        if let (Observation::Now(t), Some(s), false, false) = (seen, self.stretch, self.gap_clock, self.timed_soon) {
            if t.saturating_sub(s) > BUDGET && act != Action::Arm {
                return Err(Broken::PollsPastBudget(t - s));
            }
        }
        match act {
            Action::Spin => {
                self.spins += 1;
                if self.spins > IDLE_CLOCK_PASSES {
                    return Err(Broken::SpinsWithoutClock(self.spins));
                }
            }
            Action::Clock => {
                self.spins = 0;
                self.gap_clock = matches!(seen, Observation::Passed { busy: true, .. });
            }
            _ => {}
        }
        Ok(())
    }

    /// What an observation tells of the poller's state.
    fn saw(&mut self, seen: Observation) {
        match seen {
            Observation::PassedTimed { due_in, .. } => self.timed_soon = due_in <= MIN_SLEEP + TIMED_MARGIN,
            Observation::Passed { .. } => self.timed_soon = false,
            _ => {}
        }
        match seen {
            Observation::Passed { busy: true, .. } | Observation::Armed(None) => (self.stretch, self.spins) = (None, 0),
            Observation::Armed(Some(t)) => (self.asleep, self.armed_at) = (true, t),
            Observation::Trapped(t) => self.trapped = t == Trap::Set,
            Observation::Awake { .. } => {
                (self.asleep, self.trapped) = (false, false);
                (self.stretch, self.spins) = (None, 0);
            }
            Observation::Now(t) if !self.gap_clock => {
                self.stretch.get_or_insert(t);
            }
            _ => {}
        }
    }

    /// Whether the poller may answer `seen` with `act`.
    fn may(&self, seen: Observation, act: Action) -> Result<(), Broken> {
        use Observation as O;
        let bad = |why: &'static str| Err(Broken::Transition { why, seen, act });
        if let O::Woke { .. } = seen {
            if !matches!(act, Action::LookAsleep | Action::Wake { .. }) {
                return bad("woken, it must look at the page or wake up (disarm) first");
            }
        }
        match act {
            Action::Look | Action::Pass { .. } | Action::Spin | Action::Yield | Action::Clock if self.asleep => {
                bad("polls with its wake-up armed")
            }
            Action::Arm | Action::CountForecast if self.asleep || !matches!(seen, O::Now(_)) => {
                bad("prepares a sleep other than after an idle pass's clock reading")
            }
            Action::Sleep { .. } if !self.asleep => bad("sleeps without its wake-up armed and looked at again"),
            Action::Sleep { .. }
                if !matches!(
                    seen,
                    O::Armed(Some(_)) | O::LookedAsleep { found: false, .. } | O::Trapped(Trap::Set | Trap::Cannot)
                ) =>
            {
                bad("sleeps other than after arming, an empty look or a trap")
            }
            Action::Sleep { timeout } if self.cfg.page && !self.trapped && timeout.is_none_or(|t| t > BAR_IDLE_MAX) => {
                bad("sleeps longer than a step with the page in memory (a store there wakes nobody)")
            }
            Action::LookAsleep
                if !self.asleep
                    || !self.cfg.page
                    || self.trapped
                    || !matches!(seen, O::Woke { kicked: false, completed: false, .. }) =>
            {
                bad("a timed look other than at a step's end")
            }
            Action::Trap => match seen {
                O::LookedAsleep { found: false, now }
                    if self.asleep && self.cfg.page && now.saturating_sub(self.armed_at) >= BAR_TRAP_AFTER =>
                {
                    Ok(())
                }
                _ => bad("traps the page other than after an empty look, asleep for BAR_TRAP_AFTER"),
            },
            Action::Wake { forecast: true, .. } if !self.cfg.forecast || self.cfg.page => {
                bad("a forecast's timer where there is no forecast")
            }
            Action::Wake { kicked, completed, .. } => match seen {
                O::Woke { kicked: k, completed: c, .. } if self.asleep && (k, c) == (kicked, completed) => Ok(()),
                O::LookedAsleep { found: true, .. } | O::Trapped(Trap::Raced)
                    if self.asleep && !kicked && !completed =>
                {
                    Ok(())
                }
                _ => bad("wakes other than from a sleep"),
            },
            _ => Ok(()),
        }
    }
}
