//! The adaptive poller's machine without threads or clocks: each
//! transition on a sequence written out, then long random sequences
//! against the simulated world (`sim.rs`).

use super::super::{ADAPTIVE_IDLE, ADAPTIVE_IDLE_IO, ADAPTIVE_IDLE_MIN, BAR_IDLE_MAX, BAR_IDLE_STEP, BAR_TRAP_AFTER};
use super::check::Checker;
use super::sim::{run, Doorbells, Setup, Stats};
use super::*;
use Action as A;
use Observation as O;

const US: Duration = Duration::from_micros(1);
const MS: Duration = Duration::from_millis(1);

const SHADOW: Config = Config { page: false, forecast: false };
const FORECAST: Config = Config { page: false, forecast: true };
const PAGE: Config = Config { page: true, forecast: true };

/// A poller and the checker watching it.
struct Probe {
    m: Poller,
    check: Checker,
}

impl Probe {
    fn new(cfg: Config) -> Probe {
        let m = Poller::new(cfg);
        let check = Checker::new(m.config());
        Probe { m, check }
    }

    fn step(&mut self, seen: Observation) -> Action {
        let act = self.m.step(seen);
        if let Err(e) = self.check.check(seen, act) {
            panic!("{e}");
        }
        act
    }

    /// Each observation must get its action.
    fn expect(&mut self, seq: &[(Observation, Action)]) {
        for (i, &(seen, want)) in seq.iter().enumerate() {
            assert_eq!(self.step(seen), want, "step {i}: after {seen:?}");
        }
    }

    /// Idle locked passes (no looks: the thread has no watch) until the
    /// poller asks for the clock; the spins before it.
    fn idle_until_clock(&mut self, in_flight: bool) -> u32 {
        let mut spins = 0;
        let mut act = self.step(O::Passed { busy: false, in_flight });
        loop {
            act = match act {
                A::Clock => return spins,
                A::Spin => {
                    spins += 1;
                    self.step(O::Done)
                }
                A::Look => self.step(O::Looked { changed: true }),
                A::Pass { .. } => self.step(O::Passed { busy: false, in_flight }),
                a => panic!("idle: {a:?}"),
            };
        }
    }

    /// From awake and busy, idle until it arms at `t0 + window` (the clock
    /// read then); returns the spins before the first clock reading.
    fn idle_to_arm(&mut self, t0: Duration, window: Duration) {
        assert_eq!(self.step(O::Passed { busy: true, in_flight: false }), A::Pass { hit: false });
        assert_eq!(self.idle_until_clock(false), IDLE_CLOCK_PASSES - 1);
        assert_eq!(self.step(O::Now(t0)), A::Spin, "the window starts at the first clock reading");
        assert_eq!(self.idle_until_clock(false), IDLE_CLOCK_PASSES - 1);
        assert_eq!(self.step(O::Now(t0 + window - US)), A::Spin);
        self.idle_until_clock(false);
        assert_eq!(self.step(O::Now(t0 + window)), A::Arm);
    }

    /// A sleep that a kick ends `gap` after the idle began at `t0`.
    fn kicked_sleep(&mut self, t0: Duration, gap: Duration) {
        let w = self.m.window.get();
        self.idle_to_arm(t0, w);
        assert_eq!(self.step(O::Armed(Some(t0 + w))), A::Sleep { timeout: None });
        let now = t0 + gap;
        self.expect(&[
            (
                O::Woke { kicked: true, completed: false, now },
                A::Wake { kicked: true, completed: false, forecast: false },
            ),
            (O::Awake { stalled: false, now }, A::Pass { hit: false }),
        ]);
    }

    /// From a fresh poller, the gaps that train a forecast: 8 of `gap`, one
    /// every `every` from 1 ms, each a sleep that a kick ends; returns when
    /// the next gap begins.
    fn steady_gaps(&mut self, gap: Duration, every: Duration) -> Duration {
        self.step(O::Done);
        let mut t = MS;
        for _ in 0..8 {
            self.kicked_sleep(t, gap);
            t += every;
        }
        t
    }

    /// 8 kicked 1 ms gaps 2 ms apart, then idle to arm in the next gap:
    /// returns when that gap began and when the poller armed.
    fn trained_then_armed(&mut self) -> (Duration, Duration) {
        let t = self.steady_gaps(MS, 2 * MS);
        let w = self.m.window.get();
        self.idle_to_arm(t, w);
        (t, t + w)
    }
}

#[test]
fn busy_passes_poll_on_and_an_idle_one_turns_to_looks_between_locked_passes() {
    let mut p = Probe::new(SHADOW);
    p.expect(&[
        (O::Done, A::Pass { hit: false }),
        (O::Passed { busy: true, in_flight: false }, A::Pass { hit: false }),
        (O::Passed { busy: false, in_flight: false }, A::Spin),
    ]);
    // Up to LOOKS_PER_PASS looks, then a locked pass.
    for _ in 0..LOOKS_PER_PASS {
        p.expect(&[(O::Done, A::Look), (O::Looked { changed: false }, A::Spin)]);
    }
    p.expect(&[(O::Done, A::Pass { hit: false }), (O::Passed { busy: false, in_flight: false }, A::Spin)]);
    // A word that changed: a locked pass at once.
    p.expect(&[
        (O::Done, A::Look),
        (O::Looked { changed: true }, A::Pass { hit: false }),
        (O::Passed { busy: true, in_flight: false }, A::Pass { hit: false }),
    ]);
    // With file operations in flight: no looks, the clock every pass, a yield.
    p.expect(&[
        (O::Passed { busy: false, in_flight: true }, A::Clock),
        (O::Now(MS), A::Yield),
        (O::Yielded { took: US, now: MS + US }, A::Pass { hit: false }),
    ]);
}

#[test]
fn idle_for_the_window_by_the_clock_read_every_64th_pass_it_arms_and_sleeps() {
    let mut p = Probe::new(SHADOW);
    p.step(O::Done);
    p.idle_to_arm(MS, ADAPTIVE_IDLE);
    p.expect(&[
        (O::Armed(Some(MS + ADAPTIVE_IDLE)), A::Sleep { timeout: None }),
        (
            O::Woke { kicked: true, completed: false, now: 2 * MS },
            A::Wake { kicked: true, completed: false, forecast: false },
        ),
        (O::Awake { stalled: false, now: 2 * MS }, A::Pass { hit: false }),
    ]);
    // That sleep was long (800 us): the window halves.
    p.idle_to_arm(3 * MS, ADAPTIVE_IDLE / 2);
    // A submission raced with the arming: polled (a look first, the last pass
    // was idle), and the next idle starts afresh.
    p.expect(&[(O::Armed(None), A::Look), (O::Looked { changed: true }, A::Pass { hit: false })]);
    p.idle_to_arm(4 * MS, ADAPTIVE_IDLE / 2);
}

#[test]
fn the_window_shrinks_over_long_sleeps_and_a_burst_puts_it_back() {
    let mut p = Probe::new(SHADOW);
    p.step(O::Done);
    let mut t = MS;
    for _ in 0..10 {
        p.kicked_sleep(t, MS);
        t += 2 * MS;
    }
    assert_eq!(p.m.window.get(), ADAPTIVE_IDLE_MIN);
    for _ in 0..idle::BURST_PASSES {
        assert_eq!(p.step(O::Passed { busy: true, in_flight: false }), A::Pass { hit: false });
    }
    assert_eq!(p.m.window.get(), ADAPTIVE_IDLE);
}

#[test]
fn waiting_only_for_file_operations_it_yields_and_sleeps_soon_or_at_once_beside_a_busy_thread() {
    let mut p = Probe::new(FORECAST);
    p.expect(&[
        (O::Done, A::Pass { hit: false }),
        (O::Passed { busy: false, in_flight: true }, A::Clock),
        (O::Now(MS), A::Yield),
        (O::Yielded { took: US, now: MS + US }, A::Pass { hit: false }),
        (O::Passed { busy: false, in_flight: true }, A::Clock),
        (O::Now(MS + ADAPTIVE_IDLE_IO - US), A::Yield),
        (O::Yielded { took: US, now: MS + ADAPTIVE_IDLE_IO }, A::Pass { hit: false }),
        (O::Passed { busy: false, in_flight: true }, A::Clock),
        // No forecast timer while operations are in flight: their eventfd wakes it.
        (O::Now(MS + ADAPTIVE_IDLE_IO), A::Arm),
        (O::Armed(Some(MS + ADAPTIVE_IDLE_IO)), A::Sleep { timeout: None }),
        (
            O::Woke { kicked: false, completed: true, now: 2 * MS },
            A::Wake { kicked: false, completed: true, forecast: false },
        ),
        (O::Awake { stalled: false, now: 2 * MS }, A::Pass { hit: false }),
        (O::Passed { busy: true, in_flight: true }, A::Pass { hit: false }),
        (O::Passed { busy: false, in_flight: true }, A::Clock),
        (O::Now(3 * MS), A::Yield),
        // A yield that met a busy thread: the next idle pass sleeps at once.
        (O::Yielded { took: idle::LONG_YIELD + US, now: 4 * MS }, A::Pass { hit: false }),
        (O::Passed { busy: false, in_flight: true }, A::Clock),
        (O::Now(4 * MS), A::Arm),
    ]);
}

#[test]
fn refused_file_operations_bound_the_next_sleeps_and_a_retry_wakes_fully() {
    let mut p = Probe::new(PAGE);
    p.step(O::Done);
    p.idle_to_arm(MS, ADAPTIVE_IDLE);
    let t = MS + ADAPTIVE_IDLE;
    p.expect(&[
        (O::Armed(Some(t)), A::Sleep { timeout: Some(BAR_IDLE_STEP) }),
        (
            O::Woke { kicked: false, completed: true, now: t + US },
            A::Wake { kicked: false, completed: true, forecast: false },
        ),
        (O::Awake { stalled: true, now: t + US }, A::Pass { hit: false }),
    ]);
    // (That sleep was short: the window stays whole.)
    p.idle_to_arm(2 * MS, ADAPTIVE_IDLE);
    let t = 2 * MS + ADAPTIVE_IDLE;
    // The retry (1 ms) is later than the first step; the step's end looks at the page.
    p.expect(&[
        (O::Armed(Some(t)), A::Sleep { timeout: Some(BAR_IDLE_STEP) }),
        // With a retry due, a timeout is a full wake-up (a pass retries them), not a look.
        (
            O::Woke { kicked: false, completed: false, now: t + BAR_IDLE_STEP },
            A::Wake { kicked: false, completed: false, forecast: false },
        ),
        (O::Awake { stalled: true, now: t + BAR_IDLE_STEP }, A::Pass { hit: false }),
    ]);
    // Still refused: the retry doubles (2 ms), the steps stay shorter.
    p.idle_to_arm(3 * MS, ADAPTIVE_IDLE);
    let t = 3 * MS + ADAPTIVE_IDLE;
    p.expect(&[(O::Armed(Some(t)), A::Sleep { timeout: Some(BAR_IDLE_STEP) })]);
    let mut p = Probe::new(SHADOW);
    p.step(O::Done);
    p.idle_to_arm(MS, ADAPTIVE_IDLE);
    p.expect(&[
        (O::Armed(Some(MS)), A::Sleep { timeout: None }),
        (
            O::Woke { kicked: true, completed: false, now: 2 * MS },
            A::Wake { kicked: true, completed: false, forecast: false },
        ),
        (O::Awake { stalled: true, now: 2 * MS }, A::Pass { hit: false }),
    ]);
    p.idle_to_arm(3 * MS, ADAPTIVE_IDLE / 2);
    p.expect(&[(O::Armed(Some(4 * MS)), A::Sleep { timeout: Some(MS) })]);
}

#[test]
fn asleep_on_the_page_it_looks_in_doubling_steps_then_has_it_trapped() {
    let mut p = Probe::new(PAGE);
    p.step(O::Done);
    p.idle_to_arm(MS, ADAPTIVE_IDLE);
    let t0 = MS + ADAPTIVE_IDLE;
    assert_eq!(p.step(O::Armed(Some(t0))), A::Sleep { timeout: Some(BAR_IDLE_STEP) });
    let (mut now, mut step) = (t0, BAR_IDLE_STEP);
    loop {
        now += step;
        assert_eq!(p.step(O::Woke { kicked: false, completed: false, now }), A::LookAsleep);
        let next = (step * 2).min(BAR_IDLE_MAX);
        match p.step(O::LookedAsleep { found: false, now }) {
            A::Sleep { timeout } => assert_eq!(timeout, Some(next), "at {now:?}"),
            A::Trap => break,
            a => panic!("{a:?}"),
        }
        step = next;
    }
    assert!(now - t0 >= BAR_TRAP_AFTER && now - t0 < BAR_TRAP_AFTER + BAR_IDLE_MAX, "{:?}", now - t0);
    // Trapped: no more steps, a store wakes it (and the page goes back as it wakes).
    p.expect(&[
        (O::Trapped(Trap::Set), A::Sleep { timeout: None }),
        (
            O::Woke { kicked: true, completed: false, now: now + MS },
            A::Wake { kicked: true, completed: false, forecast: false },
        ),
        (O::Awake { stalled: false, now: now + MS }, A::Pass { hit: false }),
    ]);
}

#[test]
fn a_host_that_cannot_trap_keeps_the_steps_and_a_store_found_or_raced_wakes_it() {
    let mut p = Probe::new(PAGE);
    p.step(O::Done);
    p.idle_to_arm(MS, ADAPTIVE_IDLE);
    let t0 = MS + ADAPTIVE_IDLE;
    p.step(O::Armed(Some(t0)));
    let late = t0 + BAR_TRAP_AFTER;
    p.expect(&[
        (O::Woke { kicked: false, completed: false, now: late }, A::LookAsleep),
        (O::LookedAsleep { found: false, now: late }, A::Trap),
        (O::Trapped(Trap::Cannot), A::Sleep { timeout: Some(2 * BAR_IDLE_STEP) }),
        // Each next empty look asks again.
        (O::Woke { kicked: false, completed: false, now: late + MS }, A::LookAsleep),
        (O::LookedAsleep { found: false, now: late + MS }, A::Trap),
        (O::Trapped(Trap::Cannot), A::Sleep { timeout: Some(4 * BAR_IDLE_STEP) }),
        // A store found by a look wakes it.
        (O::Woke { kicked: false, completed: false, now: late + 2 * MS }, A::LookAsleep),
        (
            O::LookedAsleep { found: true, now: late + 2 * MS },
            A::Wake { kicked: false, completed: false, forecast: false },
        ),
        (O::Awake { stalled: false, now: late + 2 * MS }, A::Pass { hit: false }),
    ]);
    // A store that landed while the trap took effect: served there, awake.
    p.idle_to_arm(100 * MS, ADAPTIVE_IDLE / 2);
    let t0 = 100 * MS + ADAPTIVE_IDLE / 2;
    p.step(O::Armed(Some(t0)));
    let late = t0 + BAR_TRAP_AFTER + MS;
    p.expect(&[
        (O::Woke { kicked: false, completed: false, now: late }, A::LookAsleep),
        (O::LookedAsleep { found: false, now: late }, A::Trap),
        (O::Trapped(Trap::Raced), A::Wake { kicked: false, completed: false, forecast: false }),
        (O::Awake { stalled: false, now: late }, A::Pass { hit: false }),
    ]);
}

#[test]
fn steady_gaps_get_a_timer_and_the_command_polled_for_is_a_hit() {
    let mut p = Probe::new(FORECAST);
    // Gaps of 1 ms, each ended by a kick: after 8, a forecast.
    let (t, armed) = p.trained_then_armed();
    let Action::Sleep { timeout: Some(timer) } = p.step(O::Armed(Some(armed))) else { panic!("no timer") };
    let wake_at = armed + timer;
    assert!(wake_at > t + MS / 2 && wake_at < t + MS, "the timer {:?} after the gap began", wake_at - t);
    // The timer fires 10 us late: polling for the command from then on.
    let now = wake_at + 10 * US;
    p.expect(&[
        (O::Woke { kicked: false, completed: false, now }, A::Wake { kicked: false, completed: false, forecast: true }),
        (O::Awake { stalled: false, now }, A::Pass { hit: false }),
        (O::Passed { busy: false, in_flight: false }, A::Spin),
        // A pass found nothing since: the command found next was polled for.
        (O::Done, A::Look),
        (O::Looked { changed: true }, A::Pass { hit: true }),
        (O::Passed { busy: true, in_flight: false }, A::Clock),
        (O::Now(t + MS), A::Pass { hit: false }),
    ]);
    assert_eq!(p.m.expect, None);
}

#[test]
fn a_forecast_whose_command_does_not_come_is_a_miss_and_the_next_gap_gets_none() {
    let mut p = Probe::new(FORECAST);
    let (t, armed) = p.trained_then_armed();
    let Action::Sleep { timeout: Some(timer) } = p.step(O::Armed(Some(armed))) else { panic!("no timer") };
    let now = armed + timer;
    p.expect(&[
        (O::Woke { kicked: false, completed: false, now }, A::Wake { kicked: false, completed: false, forecast: true }),
        (O::Awake { stalled: false, now }, A::Pass { hit: false }),
    ]);
    let until = p.m.expect.unwrap().until;
    // The gaps (1 ms, less a wake-up's assumed lateness), the timer's own lateness (none) and a slack.
    assert!(until > t + 900 * US && until < t + MS + 2 * forecast::MAX_MARGIN, "{:?}", until - t);
    p.idle_until_clock(false);
    assert_eq!(p.step(O::Now(until - US)), A::Spin, "polling for it until its time is past");
    p.idle_until_clock(false);
    // Past: a miss, and the sleep has no timer (backing off).
    p.expect(&[(O::Now(until), A::Arm), (O::Armed(Some(until)), A::Sleep { timeout: None })]);
}

#[test]
fn a_forecast_due_within_min_sleep_is_polled_for_without_a_sleep() {
    let mut p = Probe::new(FORECAST);
    // Gaps of 300 us, each ended by a kick 100 us into a sleep (taken as 250 us: a
    // wake-up's lateness off): the forecast's timer would be due 195 us into the gap.
    let t = p.steady_gaps(300 * US, MS);
    assert_eq!(p.m.window.get(), ADAPTIVE_IDLE, "short sleeps keep the window whole");
    assert_eq!(p.step(O::Passed { busy: true, in_flight: false }), A::Pass { hit: false });
    p.idle_until_clock(false);
    assert_eq!(p.step(O::Now(t)), A::Spin);
    p.idle_until_clock(false);
    // At the window's end the timer is due within MIN_SLEEP: no sleep, polling on for it.
    p.expect(&[
        (O::Now(t + ADAPTIVE_IDLE), A::CountForecast),
        (O::Done, A::Look),
        (O::Looked { changed: false }, A::Spin),
        (O::Done, A::Look),
        (O::Looked { changed: true }, A::Pass { hit: true }),
        (O::Passed { busy: true, in_flight: false }, A::Clock),
        (O::Now(t + 300 * US), A::Pass { hit: false }),
    ]);
    assert_eq!(p.m.expect, None);
}

#[test]
fn the_page_gets_no_forecast_and_never_sleeps_longer_than_a_step_untrapped() {
    let mut p = Probe::new(PAGE);
    assert!(!p.m.config().forecast);
    p.step(O::Done);
    let mut t = MS;
    for _ in 0..20 {
        let w = p.m.window.get();
        p.idle_to_arm(t, w);
        assert_eq!(p.step(O::Armed(Some(t + w))), A::Sleep { timeout: Some(BAR_IDLE_STEP) });
        p.expect(&[
            (
                O::Woke { kicked: true, completed: false, now: t + MS },
                A::Wake { kicked: true, completed: false, forecast: false },
            ),
            (O::Awake { stalled: false, now: t + MS }, A::Pass { hit: false }),
        ]);
        t += 2 * MS;
    }
}

#[test]
fn the_same_observations_give_the_same_actions() {
    for seed in 0..2 {
        let s = Setup { doorbells: Doorbells::Shadow, forecast: true, file: true, can_trap: true, messages: true };
        let a = run(s, seed, 20_000).unwrap();
        let b = run(s, seed, 20_000).unwrap();
        assert_eq!(a, b, "seed {seed}");
        assert_ne!(a.trace, run(s, seed + 100, 20_000).unwrap().trace);
    }
}

/// Seeds per setup: `IOPATH_POLLER_SEEDS` for a longer campaign.
fn seeds() -> u64 {
    std::env::var("IOPATH_POLLER_SEEDS").ok().and_then(|s| s.parse().ok()).unwrap_or(4)
}

const STEPS: u64 = 100_000;

/// Runs `setup` over the seeds; the counts summed.
fn campaign(setup: Setup, base: u64) -> Stats {
    let mut sum = Stats::default();
    for seed in base..base + seeds() {
        let r = run(setup, seed, STEPS).unwrap_or_else(|e| panic!("{e}"));
        let s = r.stats;
        sum.served += s.served;
        sum.max_wait = sum.max_wait.max(s.max_wait);
        sum.sleeps += s.sleeps;
        sum.kicked += s.kicked;
        sum.completed += s.completed;
        sum.timers += s.timers;
        sum.hits += s.hits;
        sum.raced_arms += s.raced_arms;
        sum.found_asleep += s.found_asleep;
        sum.traps += s.traps;
        sum.raced_traps += s.raced_traps;
        sum.cannot_trap += s.cannot_trap;
        sum.long_yields += s.long_yields;
        sum.stalls += s.stalls;
    }
    eprintln!("{setup:?}: {sum:?}");
    assert!(sum.served > 0 && sum.sleeps > 0, "{sum:?}");
    sum
}

#[test]
fn random_sequences_on_shadow_doorbells_lose_no_wake_up_and_forecast_steady_gaps() {
    let s = campaign(
        Setup { doorbells: Doorbells::Shadow, forecast: true, file: false, can_trap: true, messages: false },
        1,
    );
    assert!(s.kicked > 0 && s.raced_arms > 0 && s.timers > 0 && s.hits > 0, "{s:?}");
    let s = campaign(
        Setup { doorbells: Doorbells::Shadow, forecast: false, file: false, can_trap: true, messages: true },
        100,
    );
    assert!(s.kicked > 0 && s.raced_arms > 0 && s.timers == 0 && s.hits == 0, "{s:?}");
}

#[test]
fn random_sequences_with_file_operations_in_flight() {
    let s = campaign(
        Setup { doorbells: Doorbells::Shadow, forecast: true, file: true, can_trap: true, messages: true },
        200,
    );
    assert!(s.completed > 0 && s.long_yields > 0 && s.stalls > 0, "{s:?}");
    let s = campaign(
        Setup { doorbells: Doorbells::Page, forecast: true, file: true, can_trap: false, messages: false },
        300,
    );
    assert!(s.completed > 0 && s.cannot_trap > 0 && s.timers == 0, "{s:?}");
}

#[test]
fn random_sequences_on_the_page_look_in_steps_and_trap_without_losing_a_store() {
    let s = campaign(
        Setup { doorbells: Doorbells::Page, forecast: true, file: false, can_trap: true, messages: true },
        400,
    );
    assert!(s.found_asleep > 0 && s.traps > 0 && s.raced_traps > 0 && s.timers == 0, "{s:?}");
    let s = campaign(
        Setup { doorbells: Doorbells::Auto, forecast: false, file: false, can_trap: true, messages: true },
        500,
    );
    assert!(s.found_asleep > 0 && s.traps > 0 && s.raced_traps > 0 && s.raced_arms > 0, "{s:?}");
}

/// Idle passes that hold a timed completion due `due_in` after each pass,
/// until the poller asks for the clock (it never looks without the lock: a
/// look posts nothing).
fn timed_idle_until_clock(p: &mut Probe, due_in: Duration) {
    let mut act = p.step(O::PassedTimed { in_flight: false, due_in });
    loop {
        act = match act {
            A::Clock => return,
            A::Spin => p.step(O::Done),
            A::Pass { .. } => p.step(O::PassedTimed { in_flight: false, due_in }),
            a => panic!("idle with a timed completion held: {a:?}"),
        };
    }
}

#[test]
fn a_held_timed_completion_due_later_is_slept_through_until_the_margin_before_it() {
    for cfg in [SHADOW, FORECAST, PAGE] {
        let mut p = Probe::new(cfg);
        let w = p.m.window.get();
        let t0 = MS;
        assert_eq!(p.step(O::Done), A::Pass { hit: false });
        assert_eq!(p.step(O::Passed { busy: true, in_flight: false }), A::Pass { hit: false });
        // A 1 ms device time held from t0: idle through the window, then a sleep ending
        // TIMED_MARGIN before it is due (or sooner: a page's first step).
        let due = t0 + MS;
        timed_idle_until_clock(&mut p, due - t0);
        assert_eq!(p.step(O::Now(t0)), A::Spin);
        timed_idle_until_clock(&mut p, due - (t0 + w));
        assert_eq!(p.step(O::Now(t0 + w)), A::Arm, "{cfg:?}");
        let timeout = match p.step(O::Armed(Some(t0 + w))) {
            A::Sleep { timeout } => timeout,
            a => panic!("{a:?}"),
        };
        let want = due - TIMED_MARGIN - (t0 + w);
        let want = if cfg.page { BAR_IDLE_STEP.min(want) } else { want };
        assert_eq!(timeout, Some(want), "{cfg:?}");
        if cfg.page {
            continue; // its steps are the page's; `woke` below is the shadow doorbells'
        }
        // The timeout ends the sleep: awake, no forecast's timer, and it polls for the completion.
        let now = due - TIMED_MARGIN;
        p.expect(&[
            (
                O::Woke { kicked: false, completed: false, now },
                A::Wake { kicked: false, completed: false, forecast: false },
            ),
            (O::Awake { stalled: false, now }, A::Pass { hit: false }),
        ]);
        // Within the margin: polled for, never a sleep, until the pass that posts it.
        timed_idle_until_clock(&mut p, TIMED_MARGIN);
        assert_eq!(p.step(O::Now(now)), A::Spin);
        for k in 1..=6u32 {
            timed_idle_until_clock(&mut p, TIMED_MARGIN.saturating_sub(k * 10 * US));
            assert_eq!(p.step(O::Now(now + w + k * 10 * US)), A::Spin, "{cfg:?} {k}");
        }
        // Posted: work, and the idle it ended is no submission gap for the forecast
        // (a gap is timed with a clock reading: A::Clock here).
        assert_eq!(p.step(O::Passed { busy: true, in_flight: false }), A::Pass { hit: false }, "{cfg:?}");
    }
}

#[test]
fn a_timed_completion_due_within_the_margin_keeps_the_poller_polling() {
    let mut p = Probe::new(SHADOW);
    let w = p.m.window.get();
    p.step(O::Done);
    assert_eq!(p.step(O::Passed { busy: true, in_flight: false }), A::Pass { hit: false });
    timed_idle_until_clock(&mut p, MIN_SLEEP + TIMED_MARGIN);
    assert_eq!(p.step(O::Now(MS)), A::Spin);
    timed_idle_until_clock(&mut p, MIN_SLEEP + TIMED_MARGIN);
    assert_eq!(p.step(O::Now(MS + w)), A::Spin, "a sleep could not end before it is due");
    // Due a little later: it sleeps.
    timed_idle_until_clock(&mut p, MIN_SLEEP + TIMED_MARGIN + US);
    assert_eq!(p.step(O::Now(MS + w + US)), A::Arm);
}

/// A thread descheduled for milliseconds between its last pass and its
/// clock reading (a loaded host) finds the completion its pass held overdue:
/// it polls on for the pass that posts it, which the checker allows however
/// long the idle has been; without a completion due, polling past the idle
/// budget is still a broken invariant.
#[test]
fn a_poller_descheduled_past_a_timed_completion_polls_for_it_and_the_checker_allows_it() {
    let mut p = Probe::new(SHADOW);
    p.step(O::Done);
    assert_eq!(p.step(O::Passed { busy: true, in_flight: false }), A::Pass { hit: false });
    timed_idle_until_clock(&mut p, 30 * US);
    assert_eq!(p.step(O::Now(MS)), A::Spin);
    timed_idle_until_clock(&mut p, 10 * US);
    assert_eq!(p.step(O::Now(MS + 3 * MS)), A::Spin, "overdue: the next pass posts it");
    assert_eq!(p.step(O::Passed { busy: true, in_flight: false }), A::Pass { hit: false });
    // The checker alone: the same idle without a timed completion breaks the budget.
    let mut c = Checker::new(SHADOW);
    c.check(O::Passed { busy: false, in_flight: false }, A::Clock).unwrap();
    c.check(O::Now(MS), A::Spin).unwrap();
    c.check(O::Passed { busy: false, in_flight: false }, A::Clock).unwrap();
    assert!(c.check(O::Now(MS + 3 * MS), A::Spin).is_err(), "polling past the idle budget");
    let mut c = Checker::new(SHADOW);
    c.check(O::PassedTimed { in_flight: false, due_in: 30 * US }, A::Clock).unwrap();
    c.check(O::Now(MS), A::Spin).unwrap();
    c.check(O::PassedTimed { in_flight: false, due_in: 30 * US }, A::Clock).unwrap();
    assert_eq!(c.check(O::Now(MS + 3 * MS), A::Spin), Ok(()));
}
