//! The adaptive pollers' decisions (`adaptive`, `bar-adaptive`, `auto`) as
//! a state machine: [`Poller::step`] takes what the poller's thread saw
//! carrying out the last [`Action`] (an [`Observation`]) and returns the
//! next action. No clock, no lock, no thread here: times come in as
//! durations since the thread started. The thread (`adaptive.rs`) only
//! carries actions out; this machine and its tests are the poller's logic.
//!
//! States, and what moves the poller between them:
//!
//! - **Polling** (awake, this file). A pass over the doorbells either only
//!   looks at the doorbell words without the core lock ([`Action::Look`],
//!   up to 16 between locked passes once idle) or takes the lock and serves
//!   them ([`Action::Pass`]). A pass with work ends any idle (a gap that a
//!   poll ended is timed for the forecast: [`Action::Clock`]). Idle passes
//!   spin ([`Action::Spin`]); the clock is read every 64th idle pass (a
//!   clock read in every pass delays the next submission by its own length),
//!   or every pass while only file operations are in flight, and then each
//!   idle pass yields the core instead ([`Action::Yield`], `idle.rs`).
//!   Idle for the idle interval ([`IdleWindow`]: 10-200 us, or
//!   [`ADAPTIVE_IDLE_IO`], or at once beside a busy thread), or once a
//!   forecast's poll ran out (a miss), the poller prepares to sleep.
//! - **Preparing**: with a forecast of the next command due within
//!   [`MIN_SLEEP`], it polls on for it instead ([`Action::CountForecast`],
//!   then Polling with an [`Expect`]); otherwise it arms its wake-up
//!   ([`Action::Arm`]: EventIdx at the tail served, the poller marked
//!   asleep) and looks at the shadow doorbells once more. A submission that
//!   raced with the arming ([`Observation::Armed`]`(None)`) sends it back to
//!   Polling; armed, it sleeps.
//! - **Asleep** (`asleep.rs`): [`Action::Sleep`] on the doorbells' eventfd
//!   and the file's completion eventfd, with a timeout for the earliest of:
//!   a forecast's timer, a retry of refused file operations, the next timed
//!   look at a doorbell page in memory (bar-adaptive, auto: 100 us doubling
//!   to 6 ms, [`Action::LookAsleep`]). Idle 20 ms in such steps, it has the
//!   host trap the page ([`Action::Trap`]); trapped, a store exits and wakes
//!   it, so the steps end; a store that landed as the trap took effect is
//!   served ([`Trap::Raced`]) and wakes it.
//! - **Waking**: a kick, a completion, the forecast's timer, a retry, or
//!   work found by a timed look: [`Action::Wake`] (the poller marked awake,
//!   EventIdx back behind the tails, the page mapped back) and Polling
//!   again. The sleep's length adapts the idle interval; a kick's gap and a
//!   timer's lateness feed the forecast, and after a timer the poller
//!   polls for the forecast command.
//!
//! Timed completions (a timing model, an injected delay) held by the
//! pass are no work until due ([`Observation::PassedTimed`]): the poller
//! idles and sleeps as without them, its sleep ending [`TIMED_MARGIN`]
//! before the next is due, and polls for one due sooner than a sleep
//! could end; the idle such a completion ends teaches the forecast nothing.
//!
//! Stopping (CC.EN cleared, a reset, quiesce) is no observation: the
//! thread ends in whatever state, undoing an arming (the poller marked
//! awake, the page mapped back); the next thread starts a new machine.
//!
//! The invariants the machine keeps (checked over long random sequences
//! against a simulated controller and guest, `sim.rs`, and on every
//! adaptive thread of the crate's tests, `check.rs`): it sleeps only armed
//! and re-checked, and with a timeout where a store cannot wake it (an
//! untrapped page); it never polls while armed; idle beyond its budget it
//! sleeps; it reads the clock at least every 64 idle passes; and it is
//! deterministic.

mod asleep;
#[cfg(test)]
pub(super) mod check;
pub mod forecast;
pub(super) mod idle;
#[cfg(test)]
mod sim;
#[cfg(test)]
mod tests;

use super::doorbells::{Retry, LOOKS_PER_PASS};
use super::ADAPTIVE_IDLE_IO;
use asleep::Nap;
pub use forecast::MIN_SLEEP;
use forecast::{Expect, Forecast, Seen};
use idle::{IdleWindow, Yielder};
use std::time::Duration;

/// How long before a timed completion's due time a sleeping poller wakes
/// (then polls for it): more than a timed wake-up's lateness on a loaded
/// nested host (tens of microseconds), less than a forecast's margin.
pub const TIMED_MARGIN: Duration = Duration::from_micros(50);

/// Idle passes of an adaptive poller between two looks at the clock.
pub const IDLE_CLOCK_PASSES: u32 = 64;

/// What a poller is, fixed for its thread's life.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Config {
    /// The doorbell page is memory the guest stores to (bar-adaptive,
    /// auto): asleep, the poller looks at it in timed steps, then has it
    /// trapped.
    pub page: bool,
    /// Forecast steady gaps (`forecast=on`). Never with the page: its timed
    /// looks find a command up to a step late, too coarse to time gaps by.
    pub forecast: bool,
}

/// What the thread saw carrying out the last action.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Observation {
    /// The action (a spin, a count) is done; also the first observation.
    Done,
    /// [`Action::Look`]: a doorbell word differs from what the last locked
    /// pass left (or nothing is watched).
    Looked { changed: bool },
    /// [`Action::Pass`]: it found work (doorbells, completions, held
    /// commands); file operations are in flight.
    Passed { busy: bool, in_flight: bool },
    /// [`Action::Pass`]: no work, but timed completions are held (a timing
    /// model, an injected delay: `timing.rs`), the next due in `due_in`.
    PassedTimed { in_flight: bool, due_in: Duration },
    /// [`Action::Clock`]: the clock.
    Now(Duration),
    /// [`Action::Yield`]: how long the yield took, and the clock after it.
    Yielded { took: Duration, now: Duration },
    /// [`Action::Arm`]: armed and looked again, at this time; None: a
    /// submission raced with the arming (the poller must serve it).
    Armed(Option<Duration>),
    /// [`Action::Sleep`] ended: by a kick, a completion, or the timeout (neither).
    Woke { kicked: bool, completed: bool, now: Duration },
    /// [`Action::LookAsleep`]: the page showed work (served) or commands
    /// are held; the clock after it.
    LookedAsleep { found: bool, now: Duration },
    /// [`Action::Trap`]: how the trap went.
    Trapped(Trap),
    /// [`Action::Wake`]: file operations wait for a retry (the kernel
    /// refused them); the clock after it.
    Awake { stalled: bool, now: Duration },
}

/// How a request to trap the doorbell page went (`Core::trap_bar`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Trap {
    /// Trapped: the next store exits and wakes the poller.
    Set,
    /// The host cannot trap it (a device process): the steps go on.
    Cannot,
    /// A store landed as the trap took effect: served, the page is back,
    /// the poller awake.
    Raced,
}

/// What the thread does next.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Action {
    /// Look at the doorbell words without the core lock.
    Look,
    /// A locked pass: serve doorbells and completions; if it finds work and
    /// `hit`, count a forecast hit (the command came while polled for).
    Pass { hit: bool },
    /// One spin-loop hint.
    Spin,
    /// Yield the core, and time the yield.
    Yield,
    /// Read the clock.
    Clock,
    /// Count a forecast whose command is due already (polled for, no sleep).
    CountForecast,
    /// Drain the kicks, arm the wake-up and look at the doorbells again.
    Arm,
    /// Sleep on the eventfds until woken, or at most `timeout`.
    Sleep { timeout: Option<Duration> },
    /// Asleep: look at the doorbell page (serving what it shows).
    LookAsleep,
    /// Asleep: have the host trap the doorbell page.
    Trap,
    /// Wake up: drain the kick (`kicked`) or the completion eventfd
    /// (`completed`), count a forecast's timed wake-up (`forecast`), serve
    /// what a trapped store brought, then disarm.
    Wake { kicked: bool, completed: bool, forecast: bool },
}

/// What the clock [`Action::Clock`] asked for is for.
#[derive(Clone, Copy, Debug)]
enum ClockFor {
    /// A pass found the command that ended a gap begun at `start` (`hit`:
    /// one a forecast polled for).
    Gap { start: Duration, hit: bool },
    /// An idle pass: is it time to sleep?
    Idle,
}

/// One adaptive poller's state (see the module documentation).
#[derive(Debug)]
pub struct Poller {
    cfg: Config,
    clock: ClockFor,
    /// Since when the passes found no work (None: the last one found some,
    /// or the clock has not been read in this idle yet).
    idle_since: Option<Duration>,
    idle_passes: u32,
    /// The last pass saw file operations in flight.
    in_flight: bool,
    /// The last locked pass found nothing (looks may follow), and the looks since.
    watching: bool,
    looks: u32,
    /// Polling for a forecast command.
    expect: Option<Expect>,
    window: IdleWindow,
    yielder: Yielder,
    retry: Retry,
    forecast: Forecast,
    /// From preparing to sleep to awake again.
    nap: Option<Nap>,
    /// The last locked pass's wait for the next timed completion, and
    /// whether this idle held one (its end is then no submission gap: the
    /// forecast is not told of it).
    timed: Option<Duration>,
    timed_idle: bool,
}

impl Poller {
    pub fn new(cfg: Config) -> Poller {
        Poller {
            cfg: Config { forecast: cfg.forecast && !cfg.page, ..cfg },
            clock: ClockFor::Idle,
            idle_since: None,
            idle_passes: 0,
            in_flight: false,
            watching: false,
            looks: 0,
            expect: None,
            window: IdleWindow::new(),
            yielder: Yielder::default(),
            retry: Retry::default(),
            forecast: Forecast::default(),
            nap: None,
            timed: None,
            timed_idle: false,
        }
    }

    /// Preparing to sleep: when the sleep ends for the held timed
    /// completion the last pass saw (its due time less [`TIMED_MARGIN`]);
    /// None: no timed completion was planned for. The thread refuses to
    /// arm if one is held that this plan would sleep past (it came since,
    /// from another thread: a doorbell that exited).
    pub fn planned_due(&self) -> Option<Duration> {
        self.nap.as_ref().and_then(|n| n.due())
    }

    /// What this poller is (forecast off with the page).
    #[cfg(test)]
    pub fn config(&self) -> Config {
        self.cfg
    }

    /// The next action, given what the last one found.
    #[inline]
    pub fn step(&mut self, seen: Observation) -> Action {
        match seen {
            Observation::Done => self.next_pass(),
            Observation::Looked { changed: false } => {
                self.looks += 1;
                self.in_flight = false;
                self.idle()
            }
            Observation::Looked { changed: true } => {
                self.looks = 0;
                self.pass()
            }
            Observation::Passed { busy, in_flight } => {
                self.timed = None;
                self.passed(busy, in_flight)
            }
            Observation::PassedTimed { in_flight, due_in } => {
                (self.timed, self.timed_idle) = (Some(due_in), true);
                self.passed(false, in_flight)
            }
            Observation::Now(t) => match std::mem::replace(&mut self.clock, ClockFor::Idle) {
                ClockFor::Gap { start, hit } => {
                    self.forecast.seen(t.saturating_sub(start), Seen::Polled);
                    if hit {
                        self.forecast.hit();
                    }
                    self.next_pass()
                }
                ClockFor::Idle => self.idle_at(t),
            },
            Observation::Yielded { took, now } => {
                self.yielder.yielded(took, now);
                self.next_pass()
            }
            Observation::Armed(at) => self.armed(at),
            Observation::Woke { kicked, completed, now } => self.woke(kicked, completed, now),
            Observation::LookedAsleep { found, now } => self.looked_asleep(found, now),
            Observation::Trapped(t) => self.trapped(t),
            Observation::Awake { stalled, now } => self.awake(stalled, now),
        }
    }

    /// The next pass: a look while idle and no locked pass is due, else a locked one.
    #[inline]
    fn next_pass(&mut self) -> Action {
        if self.watching && self.looks < LOOKS_PER_PASS {
            return Action::Look;
        }
        self.looks = 0;
        self.pass()
    }

    #[inline]
    fn pass(&self) -> Action {
        Action::Pass { hit: self.expect.is_some_and(|e| e.looked) }
    }

    #[inline]
    fn passed(&mut self, busy: bool, in_flight: bool) -> Action {
        self.in_flight = in_flight;
        // Built once an idle begins (the thread watches the words as this pass
        // left them); not while timed completions are held: a look posts none.
        self.watching = !busy && !in_flight && self.timed.is_none();
        if !busy {
            return self.idle();
        }
        // The end of a forecast gap, or of one the clock was read in: timed
        // with the next clock reading.
        let gap = match self.expect.take() {
            Some(e) => Some(ClockFor::Gap { start: e.start, hit: e.looked }),
            None => {
                let submission = !in_flight && !self.timed_idle;
                self.idle_since.filter(|_| submission).map(|start| ClockFor::Gap { start, hit: false })
            }
        };
        self.timed_idle = false;
        (self.idle_since, self.idle_passes) = (None, 0);
        self.window.busy();
        match gap {
            Some(g) => {
                self.clock = g;
                Action::Clock
            }
            None => self.next_pass(),
        }
    }

    /// A pass found nothing. With no file operation in flight the clock is
    /// first read at the 64th idle pass (a few us in), not at the first: at
    /// QD1 the next submission usually comes within a few passes. Waiting
    /// only for the file's operations, every idle pass reads it and yields.
    #[inline]
    fn idle(&mut self) -> Action {
        let every = if self.in_flight { 1 } else { IDLE_CLOCK_PASSES };
        self.idle_passes = self.idle_passes.wrapping_add(1);
        if let Some(e) = self.expect.as_mut() {
            e.looked = true;
        }
        if !self.idle_passes.is_multiple_of(every) {
            return Action::Spin;
        }
        self.clock = ClockFor::Idle;
        Action::Clock
    }

    /// An idle pass read the clock: `t`.
    fn idle_at(&mut self, t: Duration) -> Action {
        // Waiting only for file operations the interval is short: the
        // completion eventfd wakes the poller, so it leaves the core sooner
        // (at once beside a busy thread).
        let idle = match self.in_flight {
            true if self.yielder.beside_busy(t) => Duration::ZERO,
            true => ADAPTIVE_IDLE_IO,
            false => self.window.get(),
        };
        let since = *self.idle_since.get_or_insert(t);
        if let Some(e) = self.expect {
            // Polling for a forecast command: until its time is past.
            if t < e.until {
                return Action::Spin;
            }
            self.forecast.missed();
            self.expect = None;
            self.idle_since = Some(e.start);
        } else if t.saturating_sub(since) < idle {
            return if self.in_flight { Action::Yield } else { Action::Spin };
        }
        self.prepare(t)
    }

    /// Idle long enough at `t`: poll on for a forecast command due about
    /// now, or arm and sleep.
    fn prepare(&mut self, t: Duration) -> Action {
        // A timed completion is posted by a pass at its due time: the sleep
        // ends TIMED_MARGIN before it; one due sooner than that is polled for.
        let due = self.timed.map(|w| t + w.saturating_sub(TIMED_MARGIN));
        if due.is_some_and(|d| d <= t + MIN_SLEEP) {
            return Action::Spin;
        }
        let gap_start = *self.idle_since.get_or_insert(t);
        // A forecast wakes the poller before the next command is due.
        let forecasting = self.cfg.forecast && !self.in_flight;
        let wake_at = forecasting.then(|| self.forecast.wake_at()).flatten().map(|d| gap_start + d);
        if wake_at.is_some_and(|w| w <= t + MIN_SLEEP) {
            // Due already (the idle interval was longer): poll on for it.
            self.expect = Some(Expect::new(gap_start, &self.forecast));
            return Action::CountForecast;
        }
        self.nap = Some(Nap::new(gap_start, wake_at, due));
        Action::Arm
    }
}

/// The shorter of two optional timeouts.
fn sooner(a: Option<Duration>, b: Option<Duration>) -> Option<Duration> {
    match (a, b) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}
