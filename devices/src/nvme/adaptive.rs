//! The adaptive pollers (`adaptive`, `bar-adaptive`): poll while work
//! comes, and after an idle interval ask to be woken and sleep.
//!
//! How the next submission wakes a sleeping poller depends on where the
//! doorbells are:
//! - shadow doorbells (`adaptive`): every I/O SQ's EventIdx is set to the
//!   tail served, so the driver's next submission also writes the doorbell
//!   register, a KVM ioeventfd (out of process, the one the server
//!   announced; over mpqemu and ioregionfd a message, which wakes the poller
//!   through the same eventfd).
//! - BAR0's doorbell page (`bar-adaptive`): the poller first sleeps in
//!   timed steps and looks at the page between them (stores that come as
//!   messages wake it at once). Idle for [`BAR_TRAP_AFTER`] in those steps,
//!   it has the host trap the page (`IoEvents::trap_area`; the VMM takes
//!   its memslot out), so the next doorbell store exits to `bar_write`,
//!   which stores the value in the page and wakes the poller, and sleeps
//!   until then. Two memslot changes cost the guest and the poller hundreds
//!   of microseconds on this project's nested machines: paid only once an
//!   idle is long, they take the last timed wake-ups away. A host that
//!   cannot trap (a device process, whose client mapped the page) keeps the
//!   steps.
//!
//! Either way the poller arms first, then looks at the doorbells once more
//! under the core lock, so a submission that raced with the arming is
//! served rather than slept on; one that comes after it finds the poller
//! marked asleep and wakes it.

use super::controller::Core;
use super::doorbells::{kick_fd, read_eventfd, wait_either, Looks, Retry, Threads};
use super::forecast::{Forecast, Seen, MIN_SLEEP};
use super::{queue, Nvme, ADAPTIVE_IDLE, ADAPTIVE_IDLE_MIN, BAR_IDLE_MAX, BAR_IDLE_STEP, BAR_TRAP_AFTER, DOORBELLS};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use vmm_sys_util::eventfd::EventFd;

impl Nvme {
    /// A poller per queue group, each sleeping on an eventfd of its own when
    /// idle (see `spawn_adaptive`).
    pub(super) fn start_adaptive(&self, t: &mut Threads) {
        let (shards, statics) = {
            let c = self.core.lock().unwrap();
            (c.shards.clone(), c.static_ioevents())
        };
        if !shards.is_empty() && statics {
            // A device process's host took one eventfd for every doorbell at
            // attach: it cannot wake the group a doorbell belongs to.
            log::warn!("nvme: adaptive doorbells with several pollers in a device process: the pollers do not sleep");
            return self.start_polling(t, &shards);
        }
        let stop = Arc::new(AtomicBool::new(false));
        let Some(kick) = kick_fd(&self.core, t) else { return };
        // Another group's event wakes group 0 to deliver it.
        self.core.lock().unwrap().raised.set_wake(Some(kick.clone()));
        let done = self.core.lock().unwrap().io_completion_fd();
        let forecast = self.cfg.forecast;
        match spawn_adaptive(self.core.clone(), kick, done, forecast, stop.clone()) {
            Ok(h) => t.worker = Some((stop.clone(), h)),
            Err(e) => return t.error = Some(format!("nvme: cannot start the adaptive poller: {e}")),
        }
        for s in shards {
            let Some(kick) = kick_fd(&s, t) else {
                // No eventfd to sleep on: this group polls without sleeping.
                match super::doorbells::spawn_poller(s, stop.clone()) {
                    Ok(h) => t.pollers.push(h),
                    Err(e) => t.error = Some(format!("nvme: cannot start a poller: {e}")),
                }
                continue;
            };
            match spawn_adaptive(s, kick, None, forecast, stop.clone()) {
                Ok(h) => t.pollers.push(h),
                Err(e) => t.error = Some(format!("nvme: cannot start an adaptive poller: {e}")),
            }
        }
    }
}

/// Idle passes of an adaptive poller between two looks at the clock.
const IDLE_CLOCK_PASSES: u32 = 64;

/// A yield that took longer than this met a thread that wants the core
/// for a whole time slice (see [`Yielder`]).
const LONG_YIELD: Duration = Duration::from_micros(50);

/// After a long yield: how long the poller sleeps at once rather than
/// yield while it waits for file operations.
const BESIDE_BUSY: Duration = Duration::from_millis(10);

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
#[derive(Default)]
struct Yielder {
    busy_until: Option<Instant>,
}

impl Yielder {
    /// True while a recent yield found the core shared with a busy thread.
    fn beside_busy(&self) -> bool {
        self.busy_until.is_some_and(|t| Instant::now() < t)
    }

    fn yield_core(&mut self) {
        let t = Instant::now();
        // SAFETY: sched_yield takes no arguments and cannot fail on Linux.
        unsafe { libc::sched_yield() };
        let now = Instant::now();
        if now - t > LONG_YIELD {
            self.busy_until = Some(now + BESIDE_BUSY);
        }
    }
}

/// The timed sleeps of a poller whose doorbell page is in memory:
/// [`BAR_IDLE_STEP`], doubling up to [`BAR_IDLE_MAX`]; and when the poller
/// went to sleep (the clock, not the sum of the steps: a loaded host wakes
/// a sleeper late, and the trap is due after an idle of so much time).
#[derive(Default)]
struct Steps {
    next: Option<Duration>,
    since: Option<std::time::Instant>,
}

impl Steps {
    fn start(&mut self, timed: bool) {
        *self = Steps { next: timed.then_some(BAR_IDLE_STEP), since: Some(std::time::Instant::now()) };
    }
    fn after(&self) -> Option<Duration> {
        self.next
    }
    /// A step passed with nothing to do.
    fn next(&mut self) {
        if let Some(d) = self.next {
            self.next = Some((d * 2).min(BAR_IDLE_MAX));
        }
    }
    /// How long the poller has been asleep.
    fn idle(&self) -> Duration {
        self.since.map_or(Duration::ZERO, |t| t.elapsed())
    }
    /// No more steps (the page is trapped: a store wakes the poller).
    fn stop(&mut self) {
        self.next = None;
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
struct IdleWindow {
    now: Duration,
    busy: u32,
}

/// Passes with work after a wake-up that make a burst (see [`IdleWindow`]).
const BURST_PASSES: u32 = 64;

impl IdleWindow {
    fn new() -> Self {
        IdleWindow { now: ADAPTIVE_IDLE, busy: 0 }
    }
    fn get(&self) -> Duration {
        self.now
    }
    /// A sleep of `slept` (from arming to waking) ended.
    fn slept(&mut self, slept: Duration) {
        self.busy = 0;
        self.now = if slept < ADAPTIVE_IDLE {
            (self.now * 2).min(ADAPTIVE_IDLE)
        } else {
            (self.now / 2).max(ADAPTIVE_IDLE_MIN)
        };
    }
    /// A pass found work.
    #[inline]
    fn busy(&mut self) {
        if self.busy < BURST_PASSES {
            self.busy += 1;
            if self.busy == BURST_PASSES {
                self.now = ADAPTIVE_IDLE;
            }
        }
    }
}

/// The shorter of two optional timeouts.
fn sooner(a: Option<Duration>, b: Option<Duration>) -> Option<Duration> {
    match (a, b) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

/// One queue group's adaptive poller. It polls the doorbells (shadow, or the
/// BAR page) while work comes; idle for its [`IdleWindow`], it arms its wake-up
/// and sleeps on its doorbells' eventfd (and the file backend's completion
/// eventfd).
fn spawn_adaptive(
    core: Arc<std::sync::Mutex<Core>>,
    kick: Arc<EventFd>,
    done: Option<Arc<EventFd>>,
    forecast_on: bool,
    stop2: Arc<AtomicBool>,
) -> std::io::Result<std::thread::JoinHandle<()>> {
    let mut retry = Retry::default();
    let mut steps = Steps::default();
    let mut window = IdleWindow::new();
    let mut forecast = Forecast::default();
    std::thread::Builder::new().name("nvme-adaptive".into()).spawn(move || {
        // Timed wake-ups (a forecast, bar-adaptive's steps) come when set,
        // not up to the default 50 us later.
        // SAFETY: prctl on this thread, no pointer passed.
        unsafe { libc::prctl(libc::PR_SET_TIMERSLACK, 1000u64) };
        crate::sandbox::enter(crate::sandbox::Role::Device);
        // Since when the passes found no work (None: the last one found some);
        // a busy pass reads no clock, and an idle one only every
        // IDLE_CLOCK_PASSES: a clock read (tens of ns) in every pass would
        // delay seeing the next submission by up to its own length.
        let mut idle_since: Option<Instant> = None;
        let mut idle_passes = 0u32;
        // Woken by a forecast's timer: polling for its command.
        let mut expect: Option<Expect> = None;
        let mut yielder = Yielder::default();
        // The doorbell words, looked at without the lock between passes.
        let mut looks = Looks::default();
        while !stop2.load(Ordering::Relaxed) {
            // An idle pass that only looks at the doorbell words (no lock),
            // unless one changed or a locked pass is due.
            let (busy, in_flight, gap) = if looks.only_look() {
                (false, false, None)
            } else {
                let mut c = core.lock().unwrap();
                c.st.polls += 1;
                let (done, in_flight) = c.io_step();
                let busy = c.poll_doorbells() | done | c.commands_held();
                c.flush_coalesced();
                c.take_raised();
                // The end of a forecast gap, or of one the clock was read in:
                // measured below, after the lock (a clock read and a sort).
                let mut gap = None;
                if busy {
                    if let Some(e) = expect.take() {
                        // Found at the first look, the command came before
                        // the timer woke this thread (and may have rung): no hit.
                        if e.looked {
                            c.st.forecast_hits += 1;
                        }
                        gap = Some((e.start, e.looked));
                    } else if let (Some(start), false) = (idle_since, in_flight) {
                        gap = Some((start, false));
                    }
                }
                // Built once an idle begins; a word it expects wrongly (a
                // queue created since, a value taken another way) costs a
                // locked pass, never a missed command.
                looks.passed(&c, !busy && !in_flight);
                (busy, in_flight, gap)
            };
            if let Some((start, hit)) = gap {
                forecast.seen(start.elapsed(), Seen::Polled);
                if hit {
                    forecast.hit();
                }
            }
            if busy {
                (idle_since, idle_passes) = (None, 0);
                window.busy();
                continue;
            }
            // With no file operation in flight the clock is first read at the
            // IDLE_CLOCK_PASSES-th idle pass (a few us in), not at the first:
            // at QD1 the next submission usually comes within a few passes.
            // Waiting only for the file's operations, every idle pass looks
            // and yields (`Yielder`), and the interval is short: the
            // completion eventfd wakes this thread, so it leaves the core
            // sooner (at once beside a busy thread).
            let (idle, every) = if in_flight {
                (if yielder.beside_busy() { Duration::ZERO } else { super::ADAPTIVE_IDLE_IO }, 1)
            } else {
                (window.get(), IDLE_CLOCK_PASSES)
            };
            idle_passes = idle_passes.wrapping_add(1);
            if let Some(e) = expect.as_mut() {
                e.looked = true;
            }
            if !idle_passes.is_multiple_of(every) {
                std::hint::spin_loop();
                continue;
            }
            let since = *idle_since.get_or_insert_with(Instant::now);
            if let Some(e) = expect {
                // Polling for a forecast command: until its time is past.
                if Instant::now() < e.until {
                    std::hint::spin_loop();
                    continue;
                }
                forecast.missed();
                expect = None;
                idle_since = Some(e.start);
            } else if since.elapsed() < idle {
                if in_flight {
                    yielder.yield_core();
                } else {
                    std::hint::spin_loop();
                }
                continue;
            }
            let gap_start = idle_since.unwrap_or(since);
            let wake_at = {
                let mut c = core.lock().unwrap();
                // A forecast wakes the poller before the next command is due.
                // Not in bar-adaptive: its timed looks at the page find a
                // command up to a step late, too coarse to time the gaps by.
                let forecasting = forecast_on && !in_flight && c.db.bar_page.is_none();
                let wake_at = forecasting.then(|| forecast.wake_at()).flatten().map(|d| gap_start + d);
                if wake_at.is_some_and(|t| t <= Instant::now() + MIN_SLEEP) {
                    // Due already (the idle interval was longer): poll on for it.
                    c.st.forecasts += 1;
                    expect = Some(Expect::new(gap_start, &forecast));
                    continue;
                }
                // A ring for a command this thread found polling (a driver
                // that read EventIdx just before a forecast's timer took it
                // back) would end the coming sleep at once, taken for a gap.
                c.drain_kicks();
                if !c.arm_wakeup() {
                    (idle_since, idle_passes) = (None, 0); // a submission raced: poll it
                    continue;
                }
                c.st.sleeps += 1;
                looks.stop();
                c.flush_coalesced_untimed();
                // The doorbell page is looked at in timed steps (until trapped).
                steps.start(c.db.bar_page.is_some());
                wake_at
            };
            // What the wake-up tells the forecast, told once the lock is released:
            // the gap a kick ended, and how late the forecast's timer fired.
            let (kicked_gap, late) = loop {
                let timer = wake_at.map(|t| t.saturating_duration_since(Instant::now()));
                let r = wait_either(&kick, done.as_deref(), sooner(sooner(retry.after(), steps.after()), timer));
                let mut c = core.lock().unwrap();
                let (kicked, completed) = match r {
                    Ok(r) => r,
                    Err(e) => {
                        c.db.sleeping = false;
                        c.untrap_bar();
                        return c.thread_failed("adaptive", &e);
                    }
                };
                if stop2.load(Ordering::Relaxed) {
                    // Woken to stop (that write is not a doorbell); the page goes back to the guest.
                    c.db.sleeping = false;
                    c.untrap_bar();
                    return;
                }
                let now = Instant::now();
                let forecast_due = !kicked && !completed && wake_at.is_some_and(|t| now >= t);
                if !forecast_due && !kicked && !completed && retry.after().is_none() && steps.after().is_some() {
                    // A timed look at the page, still asleep: nothing there, a
                    // longer sleep; idle long enough, the page trapped instead.
                    c.st.polls += 1;
                    if !c.poll_doorbells() && !c.commands_held() {
                        steps.next();
                        if steps.idle() < BAR_TRAP_AFTER {
                            continue;
                        }
                        // Some(false): the host cannot, the steps go on; None: a
                        // store came as the trap took effect, served: awake.
                        if c.trap_bar() == Some(true) {
                            steps.stop();
                        }
                        if c.db.sleeping {
                            continue;
                        }
                    }
                }
                c.db.sleeping = false;
                if kicked {
                    c.drain_kicks();
                    c.st.wakeups += 1;
                }
                if let (true, Some(done)) = (completed, done.as_deref()) {
                    let _ = read_eventfd(done);
                }
                if forecast_due {
                    c.st.forecasts += 1;
                }
                // What woke it is served first: the page back into the guest (a
                // memslot change) took 0.1-4.4 ms on this project's nested hosts,
                // and the command the trapped store brought would wait for it.
                if c.db.trapped {
                    c.poll_doorbells();
                }
                // Polling again: EventIdx goes back behind the tails (the page
                // back into the guest), or the next submission would ring.
                c.disarm_wakeup();
                retry.next(c.io_stalled());
                if !in_flight {
                    // A forecast's timer ended a sleep through most of a long
                    // gap: a long sleep for the idle interval, not a short one
                    // (taken as short, it grew the interval to the whole gap,
                    // and the poller spun through gaps of 250 us).
                    window.slept(if forecast_due { ADAPTIVE_IDLE } else { steps.idle() });
                }
                let kicked_gap = (kicked && !in_flight).then(|| now - gap_start);
                break (kicked_gap, wake_at.filter(|_| forecast_due).map(|t| now - t));
            };
            if let Some(gap) = kicked_gap {
                forecast.seen(gap, Seen::Kicked);
            }
            if let Some(late) = late {
                // Poll for the forecast command from here on.
                forecast.woke(late);
                expect = Some(Expect::new(gap_start, &forecast));
            }
            (idle_since, idle_passes) = (None, 0);
        }
    })
}

/// A poller woken by a forecast's timer, polling for the command.
#[derive(Clone, Copy)]
struct Expect {
    /// When the gap began, and until when to poll.
    start: Instant,
    until: Instant,
    /// A pass has found nothing since the wake-up: a command found now came
    /// while this thread polled for it.
    looked: bool,
}

impl Expect {
    fn new(start: Instant, f: &Forecast) -> Self {
        Expect { start, until: start + f.poll_until(), looked: false }
    }
}

impl Core {
    /// The doorbells the pollers read: BAR0's page, the shadow doorbells, or
    /// (auto) both: the page for the admin queue and for I/O queues until
    /// the driver configures shadow doorbells.
    pub(super) fn poll_doorbells(&mut self) -> bool {
        let page = self.poll_bar();
        self.poll_shadow() | page
    }

    /// Arms the wake-up and looks at the doorbells once more. False if a
    /// submission came meanwhile (the poller must serve it, not sleep); true
    /// if the poller may sleep. Commands held by a full CQ keep it polling
    /// (`commands_held`).
    ///
    /// Shadow doorbells: every I/O SQ's EventIdx is set to the tail served,
    /// so that the driver's next submission writes the doorbell register.
    /// Without them (before Doorbell Buffer Config; always in bar-adaptive,
    /// which does not offer it) nothing is armed: a doorbell that exits or
    /// comes as a message wakes the poller, and bar-adaptive's timed looks
    /// see a store in the page.
    pub(super) fn arm_wakeup(&mut self) -> bool {
        let Some((db, ei)) = self.db.shadow else {
            self.db.sleeping = true;
            return true;
        };
        let sqs: Vec<(usize, u16)> =
            self.queues.io_sq_ids().filter_map(|q| self.queues.sqs[q].map(|s| (q, s.tail))).collect();
        for &(qid, tail) in &sqs {
            let _ = self.mem.store_u32(tail as u32, ei + qid as u64 * 8, Ordering::SeqCst);
        }
        // The driver stores its tail, fences, reads EventIdx; this side stores
        // EventIdx, fences, reads the tail: one of the two sees the other.
        std::sync::atomic::fence(Ordering::SeqCst);
        for &(qid, tail) in &sqs {
            if self.mem.load_u32(db + qid as u64 * 8, Ordering::SeqCst).is_ok_and(|t| t != tail as u32) {
                return false;
            }
        }
        self.db.sleeping = true;
        true
    }

    /// Wakes the sleeping poller with a write to the doorbells' eventfd, as
    /// a KVM ioeventfd would (not counted as a kick: the doorbell write was
    /// counted as one). Without that eventfd (it could not be made) a
    /// shadow EventIdx stays armed and the next submission exits too.
    pub(super) fn wake_poller(&mut self) {
        match &self.db.kick {
            Some(k) if k.write(1).is_ok() => self.db.own_wakes += 1,
            _ if self.db.shadow.is_some() => {
                self.arm_wakeup();
            }
            _ => log::warn!("nvme: no eventfd to wake the poller with; it looks again at its next timed step"),
        }
    }

    /// Awake again: every I/O SQ's EventIdx one behind the tail served (as
    /// `poll_shadow` keeps it), so that the driver does not ring; or the
    /// doorbell page back in the guest.
    pub(super) fn disarm_wakeup(&mut self) {
        self.untrap_bar();
        let Some((_, ei)) = self.db.shadow else { return };
        for qid in self.queues.io_sq_ids() {
            if let Some(sq) = self.queues.sqs[qid] {
                let ev = queue::prev(sq.tail as u32, sq.size as u32);
                let _ = self.mem.store_u32(ev, ei + qid as u64 * 8, Ordering::Release);
            }
        }
    }

    /// bar-adaptive, asleep: has the host trap the doorbell page, then looks
    /// at the page once more. Some(true): trapped, the next store wakes the
    /// poller; Some(false): this host cannot trap it; None: a store landed
    /// as the trap took effect and was served (the page is back, the
    /// poller awake).
    pub(super) fn trap_bar(&mut self) -> Option<bool> {
        self.db.trapped = self.db.ioevents.as_ref().is_some_and(|io| io.trap_area(0, DOORBELLS, true));
        if !self.db.trapped {
            return Some(false);
        }
        // A store that exits from now on waits for this lock and then wakes
        // the poller; one that landed before the trap is in the page.
        if self.poll_doorbells() || self.commands_held() {
            self.db.sleeping = false;
            self.untrap_bar();
            return None;
        }
        Some(true)
    }

    /// The doorbell page back in the guest if it was trapped. Where the
    /// host cannot map it back, its stores go on exiting to `bar_write`,
    /// which serves them: slower, not wrong.
    pub(super) fn untrap_bar(&mut self) {
        if !std::mem::take(&mut self.db.trapped) {
            return;
        }
        if !self.db.ioevents.as_ref().is_some_and(|io| io.trap_area(0, DOORBELLS, false)) {
            log::warn!("nvme: the host did not map the doorbell page back; doorbell stores exit");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Pins the calling thread to `cpu`.
    fn pin(cpu: usize) {
        // SAFETY: a zeroed cpu_set_t is an empty set; CPU_SET writes inside it.
        unsafe {
            let mut set: libc::cpu_set_t = std::mem::zeroed();
            libc::CPU_SET(cpu, &mut set);
            assert_eq!(libc::sched_setaffinity(0, std::mem::size_of_val(&set), &set), 0);
        }
    }

    #[test]
    fn a_yield_to_a_busy_thread_on_the_same_core_makes_the_poller_sleep_at_once() {
        let cpu = (0..libc::CPU_SETSIZE as usize)
            .find(|&c| {
                // SAFETY: as in `pin`, reading the calling thread's own mask.
                unsafe {
                    let mut set: libc::cpu_set_t = std::mem::zeroed();
                    libc::sched_getaffinity(0, std::mem::size_of_val(&set), &mut set) == 0 && libc::CPU_ISSET(c, &set)
                }
            })
            .unwrap();
        let (stop, ready) = (Arc::new(AtomicBool::new(false)), Arc::new(AtomicBool::new(false)));
        let (s2, r2) = (stop.clone(), ready.clone());
        let spinner = std::thread::spawn(move || {
            pin(cpu);
            r2.store(true, Ordering::Release);
            while !s2.load(Ordering::Relaxed) {
                std::hint::spin_loop();
            }
        });
        let t = std::thread::spawn(move || {
            pin(cpu);
            // The spinner spins on that CPU from here on (this thread waits on it there).
            while !ready.load(Ordering::Acquire) {
                std::thread::yield_now();
            }
            let mut y = Yielder::default();
            assert!(!y.beside_busy());
            // The spinner keeps the core for its slice (milliseconds) once a yield hands it over.
            let mut yields = 0;
            while !y.beside_busy() && yields < 1000 {
                y.yield_core();
                yields += 1;
            }
            y.beside_busy()
        });
        let beside = t.join().unwrap();
        stop.store(true, Ordering::Relaxed);
        spinner.join().unwrap();
        assert!(beside, "1000 yields to a thread spinning on the same CPU, none longer than {LONG_YIELD:?}");
    }

    #[test]
    fn timed_steps_double_up_to_the_cap_and_only_when_asked_for() {
        let mut s = Steps::default();
        s.start(false);
        assert_eq!(s.after(), None, "shadow doorbells: no timed step");
        s.start(true);
        assert_eq!(s.after(), Some(BAR_IDLE_STEP));
        let mut last = BAR_IDLE_STEP;
        for _ in 0..20 {
            s.next();
            let d = s.after().unwrap();
            assert!(d >= last && d <= BAR_IDLE_MAX, "{d:?} after {last:?}");
            last = d;
        }
        assert_eq!(last, BAR_IDLE_MAX);
        std::thread::sleep(Duration::from_millis(1));
        assert!(s.idle() >= Duration::from_millis(1), "the idle time is the clock's, not the steps' sum");
        s.stop();
        assert_eq!(s.after(), None, "trapped: no more steps");
        assert_eq!(
            sooner(Some(Duration::from_millis(1)), Some(Duration::from_micros(5))),
            Some(Duration::from_micros(5))
        );
        assert_eq!(sooner(None, Some(Duration::from_micros(5))), Some(Duration::from_micros(5)));
        assert_eq!(sooner(None, None), None);
    }

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
}
