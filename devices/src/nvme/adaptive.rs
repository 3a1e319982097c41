//! The adaptive pollers' threads (`adaptive`, `bar-adaptive`, `auto`):
//! poll while work comes, and after an idle interval ask to be woken and
//! sleep. What to do next is decided by a pure state machine
//! (`poller/`, [`Poller`]); a thread here only carries its actions out
//! (a [`Carrier`]) and reports what it saw, and holds the mechanisms:
//! arming and disarming the wake-up, trapping the doorbell page.
//!
//! How the next submission wakes a sleeping poller depends on where the
//! doorbells are:
//! - shadow doorbells (`adaptive`): every I/O SQ's EventIdx is set to the
//!   tail served, so the driver's next submission also writes the doorbell
//!   register, a KVM ioeventfd (out of process, the one the server
//!   announced; over mpqemu and ioregionfd a message, which wakes the poller
//!   through the same eventfd).
//! - BAR0's doorbell page (`bar-adaptive`, `auto`): the poller first sleeps
//!   in timed steps and looks at the page between them (stores that come
//!   as messages wake it at once); idle long, it has the host trap the page
//!   (`IoEvents::trap_area`; the VMM takes its memslot out), so the next
//!   doorbell store exits to `bar_write`, which stores the value in the
//!   page and wakes the poller (`poller/asleep.rs`). A host that cannot
//!   trap (a device process, whose client mapped the page) keeps the steps.
//!
//! Either way the poller arms first, then looks at the doorbells once more
//! under the core lock, so a submission that raced with the arming is
//! served rather than slept on; one that comes after it finds the poller
//! marked asleep and wakes it.

use super::controller::Core;
use super::doorbells::{kick_fd, read_eventfd, wait_either, Threads};
use super::poller::{Action, Config as PollerConfig, Observation, Poller, Trap};
use super::{queue, Nvme, DOORBELLS};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use vmm_sys_util::eventfd::EventFd;

impl Nvme {
    /// A poller per queue group, each sleeping on an eventfd of its own when
    /// idle (see `spawn_adaptive`).
    pub(super) fn start_adaptive(&self, t: &mut Threads) {
        let (shards, statics) = {
            let c = crate::lock(&self.core);
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
        crate::lock(&self.core).raised.set_wake(Some(kick.clone()));
        let done = crate::lock(&self.core).io_completion_fd();
        let forecast = self.cfg.forecast;
        match spawn_adaptive(self.core.clone(), kick, done, forecast, stop.clone()) {
            Ok(h) => t.worker = Some((stop.clone(), h.into())),
            Err(e) => return t.error = Some(format!("nvme: cannot start the adaptive poller: {e}")),
        }
        for s in shards {
            let Some(kick) = kick_fd(&s, t) else {
                // No eventfd to sleep on: this group polls without sleeping.
                match super::doorbells::spawn_poller(s, stop.clone()) {
                    Ok(h) => t.pollers.push(h.into()),
                    Err(e) => t.error = Some(format!("nvme: cannot start a poller: {e}")),
                }
                continue;
            };
            match spawn_adaptive(s, kick, None, forecast, stop.clone()) {
                Ok(h) => t.pollers.push(h.into()),
                Err(e) => t.error = Some(format!("nvme: cannot start an adaptive poller: {e}")),
            }
        }
    }
}

/// One queue group's adaptive poller: a thread that carries out what its
/// [`Poller`] decides (see `poller/mod.rs`). It polls the doorbells (shadow,
/// or the BAR page) while work comes; idle, it arms its wake-up and sleeps
/// on its doorbells' eventfd (and the file backend's completion eventfd).
fn spawn_adaptive(
    core: Arc<std::sync::Mutex<Core>>,
    kick: Arc<EventFd>,
    done: Option<Arc<EventFd>>,
    forecast: bool,
    stop: Arc<AtomicBool>,
) -> std::io::Result<std::thread::JoinHandle<()>> {
    std::thread::Builder::new().name("nvme-adaptive".into()).spawn(move || {
        // Timed wake-ups (a forecast, bar-adaptive's steps) come when set,
        // not up to the default 50 us later.
        // SAFETY: prctl on this thread, no pointer passed.
        unsafe { libc::prctl(libc::PR_SET_TIMERSLACK, 1000u64) };
        crate::sandbox::enter(crate::sandbox::Role::Device);
        // The page is the doorbells' for the controller's life (a device
        // process's next client gets a new one with no thread running).
        let page = crate::lock(&core).db.bar_page.is_some();
        Carrier { core: &core, kick: &kick, done: done.as_deref(), stop: &stop, epoch: Instant::now() }
            .run(Poller::new(PollerConfig { page, forecast }));
    })
}

/// What an adaptive poller's thread holds while it carries out its
/// poller's actions.
struct Carrier<'a> {
    core: &'a std::sync::Mutex<Core>,
    kick: &'a EventFd,
    done: Option<&'a EventFd>,
    stop: &'a AtomicBool,
    /// The poller's times are durations since this.
    epoch: Instant,
}

impl Carrier<'_> {
    fn now(&self) -> Duration {
        self.epoch.elapsed()
    }

    /// Carries out `m`'s actions until stopped (or an error stops it).
    fn run(&self, mut m: Poller) {
        // The crate's tests (the queue oracle's among them) check every
        // decision of every adaptive poller against the machine's invariants.
        #[cfg(test)]
        let mut check = super::poller::check::Checker::new(m.config());
        // The doorbell words, looked at without the lock between passes.
        let mut watch: Option<crate::mem::Watch> = None;
        // Asleep, the core lock is held from the end of a sleep through what
        // follows it (a look at the page, a trap, the wake-up).
        let mut held: Option<std::sync::MutexGuard<'_, Core>> = None;
        let mut seen = Observation::Done;
        loop {
            let act = m.step(seen);
            #[cfg(test)]
            if let Err(e) = check.check(seen, act) {
                // With the core lock held: poisoned, it fails the test at its next access.
                let _c = self.lock(&mut held);
                panic!("nvme: the adaptive poller broke an invariant: {e}");
            }
            seen = match act {
                Action::Look | Action::Pass { .. } if self.stop.load(Ordering::Relaxed) => return,
                Action::Look => Observation::Looked { changed: watch.as_ref().is_none_or(|w| w.changed()) },
                Action::Pass { hit } => {
                    let mut c = self.lock(&mut held);
                    c.st.polls += 1;
                    let (done, in_flight) = c.io_step();
                    // Timed completions held make no work until due: the machine
                    // sleeps until just before (PassedTimed); one late is work now.
                    let timed = c.timed_wait();
                    let late = timed.is_some_and(|w| w.is_zero());
                    let busy = c.poll_doorbells() | done | c.held_for_room() | late;
                    c.flush_coalesced();
                    c.take_raised();
                    if busy && hit {
                        c.st.forecast_hits += 1;
                    }
                    // Built once an idle begins; a word it expects wrongly (a
                    // queue created since, a value taken another way) costs a
                    // locked pass, never a missed command.
                    if !busy && !in_flight {
                        watch = Some(c.rewatch(watch.take()));
                    }
                    match timed {
                        Some(due_in) if !busy => Observation::PassedTimed { in_flight, due_in },
                        _ => Observation::Passed { busy, in_flight },
                    }
                }
                Action::Spin => {
                    std::hint::spin_loop();
                    Observation::Done
                }
                Action::Yield => yield_core(self.epoch),
                Action::Clock => Observation::Now(self.now()),
                Action::CountForecast => {
                    self.lock(&mut held).st.forecasts += 1;
                    Observation::Done
                }
                Action::Arm => {
                    let mut c = self.lock(&mut held);
                    // A ring for a command this thread found polling (a driver
                    // that read EventIdx just before a forecast's timer took it
                    // back) would end the coming sleep at once, taken for a gap.
                    c.drain_kicks();
                    let plan = m.planned_due().map(|d| d.saturating_sub(self.now()));
                    if !c.arm_wakeup(plan) {
                        Observation::Armed(None)
                    } else {
                        c.st.sleeps += 1;
                        // A sleep can be long: a memory a client unmaps meanwhile
                        // does not stay mapped under the watch.
                        watch = None;
                        c.flush_coalesced_untimed();
                        Observation::Armed(Some(self.now()))
                    }
                }
                Action::Sleep { timeout } => {
                    drop(held.take());
                    let r = wait_either(self.kick, self.done, timeout);
                    let mut c = crate::lock(self.core);
                    let (kicked, completed) = match r {
                        Ok(r) => r,
                        Err(e) => {
                            c.db.sleeping = false;
                            c.untrap_bar();
                            return c.thread_failed("adaptive", &e);
                        }
                    };
                    if self.stop.load(Ordering::Relaxed) {
                        // Woken to stop (that write is not a doorbell); the page goes back to the guest.
                        c.db.sleeping = false;
                        c.untrap_bar();
                        return;
                    }
                    held = Some(c);
                    Observation::Woke { kicked, completed, now: self.now() }
                }
                Action::LookAsleep => {
                    let c = held.get_or_insert_with(|| crate::lock(self.core));
                    c.st.polls += 1;
                    // A held timed completion wakes it by the sleep's timeout.
                    let found = c.poll_doorbells() || c.held_for_room() || c.timed_due_now();
                    Observation::LookedAsleep { found, now: self.now() }
                }
                Action::Trap => {
                    let c = held.get_or_insert_with(|| crate::lock(self.core));
                    Observation::Trapped(match c.trap_bar() {
                        Some(true) => Trap::Set,
                        Some(false) => Trap::Cannot,
                        None => Trap::Raced,
                    })
                }
                Action::Wake { kicked, completed, forecast } => {
                    let mut c = self.lock(&mut held);
                    c.db.sleeping = false;
                    if kicked {
                        c.drain_kicks();
                        c.st.wakeups += 1;
                    }
                    if let (true, Some(done)) = (completed, self.done) {
                        let _ = read_eventfd(done);
                    }
                    if forecast {
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
                    let stalled = c.io_stalled();
                    Observation::Awake { stalled, now: self.now() }
                }
            };
        }
    }

    /// The core lock: the one held since a sleep ended, or taken now.
    fn lock<'g>(&'g self, held: &mut Option<std::sync::MutexGuard<'g, Core>>) -> std::sync::MutexGuard<'g, Core> {
        held.take().unwrap_or_else(|| crate::lock(self.core))
    }
}

/// Yields the core and times the yield (see `poller/idle.rs`, `Yielder`).
fn yield_core(epoch: Instant) -> Observation {
    let t = Instant::now();
    // SAFETY: sched_yield takes no arguments and cannot fail on Linux.
    unsafe { libc::sched_yield() };
    let now = Instant::now();
    Observation::Yielded { took: now - t, now: now - epoch }
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
    /// (`held_for_room`); so does a timed completion due before the sleep
    /// `plan` ends (from now) and half its margin (`poller::TIMED_MARGIN`).
    ///
    /// Shadow doorbells: every I/O SQ's EventIdx is set to the tail served,
    /// so that the driver's next submission writes the doorbell register.
    /// Without them (before Doorbell Buffer Config; always in bar-adaptive,
    /// which does not offer it) nothing is armed: a doorbell that exits or
    /// comes as a message wakes the poller, and bar-adaptive's timed looks
    /// see a store in the page.
    pub(super) fn arm_wakeup(&mut self, plan: Option<std::time::Duration>) -> bool {
        // A timed completion held that the sleep would end too late for (it
        // came since the last pass, or none was planned for): back to polling,
        // whose next pass plans for it.
        let margin = super::poller::TIMED_MARGIN / 2;
        if self.timed_wait().is_some_and(|w| plan.is_none_or(|p| w < p + margin)) {
            return false;
        }
        self.arm_shadow()
    }

    /// The arming itself: EventIdx at the tails served, then a look at the
    /// doorbells again (false: a submission came meanwhile).
    fn arm_shadow(&mut self) -> bool {
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
                self.arm_shadow();
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
        if self.poll_doorbells() || self.held_for_room() || self.timed_due_now() {
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
    use super::super::poller::idle::{Yielder, LONG_YIELD};
    use super::*;

    /// Pins the calling thread to `cpu`.
    fn pin(cpu: usize) {
        assert!(super::super::tests::pin_to(cpu), "pinning to CPU {cpu}");
    }

    #[test]
    fn a_yield_to_a_busy_thread_on_the_same_core_makes_the_poller_sleep_at_once() {
        let cpu = (0..libc::CPU_SETSIZE as usize)
            .find(|&c| {
                // SAFETY: a zeroed cpu_set_t is an empty set, filled with the calling thread's own mask.
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
            let (epoch, mut y) = (Instant::now(), Yielder::default());
            let mut now = Duration::ZERO;
            assert!(!y.beside_busy(now));
            // The spinner keeps the core for its slice (milliseconds) once a yield hands it over.
            let mut yields = 0;
            while !y.beside_busy(now) && yields < 1000 {
                let Observation::Yielded { took, now: t } = yield_core(epoch) else { unreachable!() };
                y.yielded(took, t);
                now = t;
                yields += 1;
            }
            y.beside_busy(now)
        });
        let beside = t.join().unwrap();
        stop.store(true, Ordering::Relaxed);
        spinner.join().unwrap();
        assert!(beside, "1000 yields to a thread spinning on the same CPU, none longer than {LONG_YIELD:?}");
    }
}
