//! A simulated controller, guest and host for the adaptive poller's
//! machine: a [`World`] carries out its actions in simulated time, with
//! seeded random costs and races, and answers with what a thread would
//! see. It plays what matters to a poller's decisions: submissions that
//! land in memory silently, ring an ioeventfd (EventIdx armed), exit from a
//! trapped page, or come as messages; file operations that complete later
//! on their eventfd; a trap that takes effect while a store lands; yields
//! that meet a busy thread.
//!
//! What it checks, beside [`Checker`]'s invariants: no lost wake-up (the
//! poller never sleeps where the work already there, or the next store,
//! would not end the sleep), every submission served within a bound, and
//! an awake poller without work sleeps within its budget.

use super::super::oracle::Rng;
use super::super::BAR_IDLE_MAX;
use super::check::{Broken, Checker, BUDGET};
use super::{Action, Config, Observation, Poller, Trap};
use std::hash::{DefaultHasher, Hash, Hasher};
use std::time::Duration;

const NS: Duration = Duration::from_nanos(1);
const US: Duration = Duration::from_micros(1);

/// Where the doorbells are.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Doorbells {
    /// `adaptive`: shadow doorbells; armed, the next submission rings.
    Shadow,
    /// `bar-adaptive`: the page; a store lands silently unless trapped.
    Page,
    /// `auto` with shadow doorbells configured: armed, a ring is a store
    /// to the page (silent unless trapped).
    Auto,
}

/// A rule of the world the poller broke: a lost wake-up, a sleep nothing
/// can end, a submission served late, a poll where it must sleep.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Lost {
    #[error("polls asleep or with the page trapped")]
    PollsAsleep,
    #[error("awake with nothing to do for {0:?}")]
    AwakeIdle(Duration),
    #[error("sleeps without being armed")]
    SleepsUnarmed,
    #[error("a lost wake-up: sleeps until woken on {0} submissions")]
    SleepsOnWork(usize),
    #[error("sleeps until woken where the next store wakes nobody")]
    SleepsUnwakeable,
    #[error("a lost wake-up: asleep for 1 s with {0} submissions")]
    AsleepOnWork(usize),
    #[error("a submission waited {waited:?} (bound {bound:?})")]
    WaitedTooLong { waited: Duration, bound: Duration },
}

/// What broke first: a checker's invariant or the world's rule.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Cause {
    #[error(transparent)]
    Broken(#[from] Broken),
    #[error(transparent)]
    Lost(#[from] Lost),
}

/// A run that broke a rule: its setup and seed, the step (None: at the
/// end) and the steps before it.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{setup:?} seed {seed}{}: {cause}{}", at_step(.step), trail(.last))]
pub struct Failure {
    pub setup: Setup,
    pub seed: u64,
    pub step: Option<u64>,
    pub cause: Cause,
    /// The last (observation, action) pairs, one a line.
    pub last: Vec<String>,
}

fn at_step(step: &Option<u64>) -> String {
    step.map(|i| format!(", step {i}")).unwrap_or_default()
}

fn trail(last: &[String]) -> String {
    last.iter().map(|l| format!("\n  {l}")).collect()
}

/// One simulated setup.
#[derive(Clone, Copy, Debug)]
pub struct Setup {
    pub doorbells: Doorbells,
    /// `forecast=on`.
    pub forecast: bool,
    /// A file namespace: every command is an operation that completes later.
    pub file: bool,
    /// The host can trap the page (the VMM; not a device process).
    pub can_trap: bool,
    /// Some doorbells come as messages (mpqemu, ioregionfd; a client that
    /// did not map the page).
    pub messages: bool,
}

impl Setup {
    pub fn config(&self) -> Config {
        Config { page: self.doorbells != Doorbells::Shadow, forecast: self.forecast }
    }
}

/// Counts of what a run went through (the tests check every path was taken).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Stats {
    pub served: u64,
    pub max_wait: Duration,
    pub sleeps: u64,
    pub kicked: u64,
    pub completed: u64,
    pub timers: u64,
    pub hits: u64,
    pub raced_arms: u64,
    pub found_asleep: u64,
    pub traps: u64,
    pub raced_traps: u64,
    pub cannot_trap: u64,
    pub long_yields: u64,
    pub stalls: u64,
}

/// Longest single action (a long yield, a trap, a wake-up).
const MAX_COST: Duration = Duration::from_millis(2);

/// What the guest does next: bursts, steady gaps (for the forecast),
/// gaps around the idle interval, and long idles (for the trap).
enum Pattern {
    Burst,
    Steady(Duration),
    Paced,
    Idle,
}

/// The simulated guest and host around one poller.
pub struct World {
    s: Setup,
    rng: Rng,
    pub now: Duration,
    /// The next submission: when, and whether its doorbell is a message.
    next: (Duration, bool),
    pattern: Pattern,
    left: u32,
    /// Submissions in memory not served yet (when each came).
    pending: Vec<Duration>,
    /// A doorbell word changed since the last locked pass.
    dirty: bool,
    /// File operations in flight: when each completes.
    ops: Vec<Duration>,
    done_fd: bool,
    kick: bool,
    /// EventIdx armed (shadow doorbells).
    evidx: bool,
    sleeping: bool,
    trapped: bool,
    /// When the poller last had work (or woke).
    last_work: Duration,
    pub stats: Stats,
}

impl World {
    pub fn new(s: Setup, seed: u64) -> World {
        let mut w = World {
            s,
            rng: Rng::new(seed),
            now: Duration::ZERO,
            next: (Duration::ZERO, false),
            pattern: Pattern::Burst,
            left: 0,
            pending: Vec::new(),
            dirty: false,
            ops: Vec::new(),
            done_fd: false,
            kick: false,
            evidx: false,
            sleeping: false,
            trapped: false,
            last_work: Duration::ZERO,
            stats: Stats::default(),
        };
        w.next = w.arrival(Duration::ZERO);
        w
    }

    /// The longest a submission may wait: an action's cost, and a step of
    /// timed looks where the page is in memory.
    fn wait_bound(&self) -> Duration {
        let page = if self.s.doorbells == Doorbells::Shadow { Duration::ZERO } else { BAR_IDLE_MAX + MAX_COST };
        MAX_COST + page + 100 * US
    }

    fn cost(&mut self, lo: Duration, hi: Duration) -> Duration {
        lo + NS * self.rng.below((hi - lo).as_nanos() as u64 + 1) as u32
    }

    /// The submission after one at `t`.
    fn arrival(&mut self, t: Duration) -> (Duration, bool) {
        if self.left == 0 {
            let r = &mut self.rng;
            (self.pattern, self.left) = match r.below(4) {
                0 => (Pattern::Burst, r.range(5, 200) as u32),
                1 => (Pattern::Steady(US * r.range(300, 3000) as u32), r.range(20, 80) as u32),
                2 => (Pattern::Paced, r.range(5, 50) as u32),
                _ => (Pattern::Idle, r.range(1, 3) as u32),
            };
        }
        self.left -= 1;
        let gap = match self.pattern {
            Pattern::Burst => self.cost(Duration::ZERO, 2 * US),
            Pattern::Steady(g) => g + self.cost(Duration::ZERO, 3 * US),
            Pattern::Paced => self.cost(5 * US, 400 * US),
            Pattern::Idle => self.cost(Duration::from_millis(1), Duration::from_millis(60)),
        };
        (t + gap, self.s.messages && self.rng.chance(10))
    }

    /// Time passes to `to`: submissions come, file operations complete.
    fn advance_to(&mut self, to: Duration) {
        let before = self.now;
        while self.next.0 <= to {
            let (at, message) = self.next;
            self.now = self.now.max(at);
            self.arrive(at, message);
            self.next = self.arrival(at);
        }
        if self.ops.iter().any(|&t| t > before && t <= to) {
            self.done_fd = true;
        }
        self.now = self.now.max(to);
    }

    fn advance(&mut self, lo: Duration, hi: Duration) {
        let d = self.cost(lo, hi);
        self.advance_to(self.now + d);
    }

    /// A submission at `at`: into memory, and whatever its doorbell does.
    fn arrive(&mut self, at: Duration, message: bool) {
        self.pending.push(at);
        self.dirty = true;
        let wakes = match (self.s.doorbells, message) {
            // The message is served where it arrives (the shadow looked at), and wakes a sleeper.
            (Doorbells::Shadow | Doorbells::Auto, true) => {
                self.serve();
                self.sleeping
            }
            // Stored in the page where it arrives, and wakes a sleeper.
            (Doorbells::Page, true) => self.sleeping,
            // The EventIdx rule rings the ioeventfd.
            (Doorbells::Shadow, false) => self.evidx,
            // A store to a trapped page exits: stored, and wakes a sleeper.
            (Doorbells::Page, false) => self.trapped && self.sleeping,
            (Doorbells::Auto, false) => self.evidx && self.trapped && self.sleeping,
        };
        self.kick |= wakes;
    }

    /// In `pct` percent of the calls, a submission comes now (at a moment that
    /// matters: while the poller arms, while a trap takes effect).
    fn race(&mut self, pct: u64) {
        if self.rng.chance(pct) {
            self.arrive(self.now, false);
        }
    }

    /// Serves what memory shows; true if there was any.
    fn serve(&mut self) -> bool {
        let n = self.pending.len();
        for i in 0..n {
            let wait = self.now - self.pending[i];
            self.stats.max_wait = self.stats.max_wait.max(wait);
            if self.s.file {
                let done = self.now + self.cost(5 * US, 300 * US);
                self.ops.push(done);
            }
        }
        self.pending.clear();
        self.stats.served += n as u64;
        if n > 0 {
            self.last_work = self.now;
        }
        n > 0
    }

    /// Carries out `act`: what the poller's thread would see.
    pub fn carry(&mut self, act: Action) -> Result<Observation, Lost> {
        let awake = !matches!(act, Action::Sleep { .. } | Action::LookAsleep | Action::Trap | Action::Wake { .. });
        if awake && (self.sleeping || self.trapped) {
            return Err(Lost::PollsAsleep);
        }
        if awake && self.pending.is_empty() && self.ops.is_empty() {
            let idle = self.now.saturating_sub(self.last_work);
            // Twice 64 passes between clock readings (the first, and the one past the budget).
            if idle > BUDGET + 400 * US {
                return Err(Lost::AwakeIdle(idle));
            }
        }
        Ok(match act {
            Action::Look => {
                self.advance(50 * NS, 500 * NS);
                Observation::Looked { changed: self.dirty }
            }
            Action::Pass { hit } => {
                self.advance(200 * NS, 2 * US);
                let now = self.now;
                let reaped = self.ops.len();
                self.ops.retain(|&t| t > now);
                let reaped = reaped > self.ops.len();
                if reaped {
                    self.last_work = now;
                }
                self.dirty = false;
                let busy = self.serve() | reaped;
                self.stats.hits += (busy && hit) as u64;
                Observation::Passed { busy, in_flight: !self.ops.is_empty() }
            }
            Action::Spin => {
                self.advance(20 * NS, 500 * NS);
                Observation::Done
            }
            Action::Clock => {
                self.advance(20 * NS, 100 * NS);
                Observation::Now(self.now)
            }
            Action::Yield => {
                let t = self.now;
                if self.rng.chance(10) {
                    self.stats.long_yields += 1;
                    self.advance(60 * US, MAX_COST);
                } else {
                    self.advance(100 * NS, 5 * US);
                }
                Observation::Yielded { took: self.now - t, now: self.now }
            }
            Action::CountForecast => {
                self.advance(100 * NS, 500 * NS);
                Observation::Done
            }
            Action::Arm => self.arm(),
            Action::Sleep { timeout } => self.sleep(timeout)?,
            Action::LookAsleep => {
                self.advance(US, 5 * US);
                let found = self.serve();
                self.stats.found_asleep += found as u64;
                Observation::LookedAsleep { found, now: self.now }
            }
            Action::Trap => self.trap(),
            Action::Wake { kicked, completed, forecast } => {
                self.sleeping = false;
                self.kick &= !kicked;
                self.done_fd &= !completed;
                self.stats.timers += forecast as u64;
                self.advance(US, 5 * US);
                if self.trapped {
                    self.serve();
                    // The page mapped back: stores during it exit, are stored and wake nobody.
                    self.advance(50 * US, 500 * US);
                    self.trapped = false;
                }
                self.evidx = false;
                self.last_work = self.now;
                let stalled = !self.ops.is_empty() && self.rng.chance(5);
                self.stats.stalls += stalled as u64;
                Observation::Awake { stalled, now: self.now }
            }
        })
    }

    fn arm(&mut self) -> Observation {
        // A submission in the first half lands before EventIdx is set (silent), one in
        // the second half after it (it rings); the look after arming sees either.
        self.kick = false;
        self.advance(250 * NS, 1500 * NS);
        self.race(10);
        self.evidx = self.s.doorbells != Doorbells::Page;
        self.advance(250 * NS, 1500 * NS);
        self.race(10);
        if self.evidx && !self.pending.is_empty() {
            self.stats.raced_arms += 1;
            self.last_work = self.now;
            return Observation::Armed(None);
        }
        // The page is not looked at here: its timed steps find what landed there.
        self.sleeping = true;
        self.stats.sleeps += 1;
        self.advance(100 * NS, US);
        Observation::Armed(Some(self.now))
    }

    fn sleep(&mut self, timeout: Option<Duration>) -> Result<Observation, Lost> {
        if !self.sleeping {
            return Err(Lost::SleepsUnarmed);
        }
        let rings = match self.s.doorbells {
            Doorbells::Shadow => self.evidx,
            Doorbells::Page => self.trapped,
            Doorbells::Auto => self.evidx && self.trapped,
        };
        if timeout.is_none() && !self.kick && !self.done_fd {
            if !self.pending.is_empty() {
                return Err(Lost::SleepsOnWork(self.pending.len()));
            }
            if !rings {
                return Err(Lost::SleepsUnwakeable);
            }
        }
        let deadline = timeout.map(|t| self.now + t);
        let start = self.now;
        while !self.kick && !self.done_fd {
            let op = self.ops.iter().copied().filter(|&t| t > self.now).min();
            let mut to = self.next.0.min(op.unwrap_or(Duration::MAX));
            if let Some(d) = deadline {
                to = to.min(d);
            }
            self.advance_to(to);
            if deadline.is_some_and(|d| self.now >= d) {
                break;
            }
            if self.now - start > Duration::from_secs(1) && !self.pending.is_empty() {
                return Err(Lost::AsleepOnWork(self.pending.len()));
            }
        }
        let (kicked, completed) = (self.kick, self.done_fd);
        self.stats.kicked += kicked as u64;
        self.stats.completed += completed as u64;
        // A wake-up, or a timer, comes late.
        self.advance(2 * US, 60 * US);
        Ok(Observation::Woke { kicked, completed, now: self.now })
    }

    fn trap(&mut self) -> Observation {
        if !self.s.can_trap {
            self.stats.cannot_trap += 1;
            self.advance(200 * NS, US);
            return Observation::Trapped(Trap::Cannot);
        }
        // Stores land in the page until the trap takes effect; the look after it finds them.
        self.advance(50 * US, 500 * US);
        self.race(25);
        self.trapped = true;
        if self.serve() {
            self.stats.raced_traps += 1;
            self.advance(50 * US, 500 * US);
            (self.trapped, self.sleeping) = (false, false);
            return Observation::Trapped(Trap::Raced);
        }
        self.stats.traps += 1;
        Observation::Trapped(Trap::Set)
    }

    /// At the end: nothing waited longer than the bound.
    fn finish(&mut self) -> Result<(), Lost> {
        let bound = self.wait_bound();
        if let Some(&oldest) = self.pending.first() {
            self.stats.max_wait = self.stats.max_wait.max(self.now - oldest);
        }
        if self.stats.max_wait > bound {
            return Err(Lost::WaitedTooLong { waited: self.stats.max_wait, bound });
        }
        Ok(())
    }
}

/// What a run left: its trace's hash and its counts.
#[derive(Debug, PartialEq, Eq)]
pub struct Report {
    pub trace: u64,
    pub stats: Stats,
}

/// Runs a poller of `setup` for `steps` steps in a world of `seed`; the
/// first broken invariant, with the steps before it.
pub fn run(setup: Setup, seed: u64, steps: u64) -> Result<Report, Failure> {
    let mut w = World::new(setup, seed);
    let mut m = Poller::new(setup.config());
    let mut check = Checker::new(m.config());
    let mut seen = Observation::Done;
    let mut h = DefaultHasher::new();
    let mut last = std::collections::VecDeque::new();
    for i in 0..steps {
        let act = m.step(seen);
        last.push_back(format!("{:>12?} {seen:?} -> {act:?}", w.now));
        if last.len() > 24 {
            last.pop_front();
        }
        let at = |cause: Cause, last: &std::collections::VecDeque<String>| Failure {
            setup,
            seed,
            step: Some(i),
            cause,
            last: last.iter().cloned().collect(),
        };
        check.check(seen, act).map_err(|e| at(e.into(), &last))?;
        (seen, act).hash(&mut h);
        seen = w.carry(act).map_err(|e| at(e.into(), &last))?;
    }
    w.finish().map_err(|e| Failure { setup, seed, step: None, cause: e.into(), last: Vec::new() })?;
    Ok(Report { trace: h.finish(), stats: w.stats })
}
