//! A process-wide pool of poller threads (`iopath serve --pollers M`): M
//! threads serve the queue groups of every `shm` and `bar` controller the
//! process holds, however many controllers there are.
//!
//! Without a pool (the default) each queue group has a poller thread of its
//! own (`doorbells.rs`, [`spawn_poller`](super::doorbells::spawn_poller)).
//! With one, [`install`]ed once before any controller starts its threads,
//! a group that starts polling is given to the pool thread serving the
//! fewest groups, which then makes the same pass over it as a thread of its
//! own would ([`poll_pass`]), round-robin with its other groups. The
//! adaptive modes keep threads of their own (they sleep on an eventfd when
//! idle), unless they fall back to plain polling.
//!
//! Idle costs: a pool thread whose groups all found nothing for
//! [`IDLE_PASSES`] rounds yields its CPU after each round; after
//! [`SLEEP_AFTER`] of that it sleeps [`IDLE_SLEEP`] between rounds (less if
//! a group holds a timed completion due sooner), so controllers nobody uses
//! cost next to no CPU, and the first doorbell after such an idle waits up
//! to [`IDLE_SLEEP`]. A thread with no group at all sleeps until one comes.
//!
//! A pool thread that panics ends its groups' [`Ticket`]s with an error
//! (and takes no group any more) instead of leaving their controllers
//! waiting for ever.
//!
//! Stopping: a group's `stop` flag (the controller's, as for its own
//! thread); the pool thread drops the group at its next round and marks its
//! [`Ticket`] done, which the controller waits for (after that no pool
//! thread touches the core). The pool's threads live as long as the process.

use super::controller::Core;
use super::doorbells::Pass;
use super::doorbells::{poll_pass, PassState, IDLE_PASSES};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, Once, OnceLock};
use std::time::{Duration, Instant};

/// Pool threads a process may have.
pub const MAX_THREADS: usize = 64;
/// Idle (yielding) this long, a pool thread sleeps between rounds.
pub const SLEEP_AFTER: Duration = Duration::from_millis(20);
/// How long it then sleeps between rounds.
pub const IDLE_SLEEP: Duration = Duration::from_millis(1);

static POOL: OnceLock<Pool> = OnceLock::new();

/// The pool's threads.
pub struct Pool {
    threads: Threads<Arc<Mutex<Core>>>,
}

/// A pool of threads serving groups of type `G` (a core; a stand-in in
/// the tests) with a pass function.
struct Threads<G> {
    slots: Vec<Arc<Slot<G>>>,
    /// Its threads are started (at the first [`Pool::add`]).
    started: Once,
}

/// One pool thread's inbox.
struct Slot<G> {
    /// Groups given to it, not yet taken into its round.
    incoming: Mutex<Vec<Entry<G>>>,
    /// Set with `incoming` not empty (read without the lock every round).
    pending: AtomicBool,
    /// Signalled when a group is added (the thread may wait with none).
    added: Condvar,
    /// Groups it serves or is given (the least loaded takes the next);
    /// [`DEAD`] once its thread could not start or has ended.
    load: AtomicUsize,
    index: usize,
}

/// A queue group a pool thread serves.
struct Entry<G> {
    group: G,
    stop: Arc<AtomicBool>,
    done: Arc<Done>,
    state: PassState,
}

impl<G> Drop for Entry<G> {
    /// A group dropped without [`Done::finish`] (its thread panicked, or
    /// ended): its ticket says so rather than waiting for ever.
    fn drop(&mut self) {
        self.done.finish(Err("the pool thread serving it ended (a panic)".into()));
    }
}

#[derive(Default)]
struct Done {
    /// Set once: Ok when dropped at its `stop`, Err if its thread ended.
    done: Mutex<Option<Result<(), String>>>,
    cv: Condvar,
}

impl Done {
    fn finish(&self, r: Result<(), String>) {
        let mut d = self.done.lock().unwrap_or_else(|p| p.into_inner());
        if d.is_none() {
            *d = Some(r);
            self.cv.notify_all();
        }
    }
}

/// A group's place on a pool thread; [`Ticket::join`] waits until the pool
/// has dropped it (its `stop` set), or its thread has ended.
pub struct Ticket(Arc<Done>);

impl Ticket {
    /// Ok once the pool dropped the group at its `stop`; Err (why) if the
    /// thread serving it ended first (a panic): no pool thread touches the
    /// core after either.
    pub fn join(self) -> Result<(), String> {
        let mut d = self.0.done.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            if let Some(r) = d.as_ref() {
                return r.clone();
            }
            d = self.0.cv.wait(d).unwrap_or_else(|p| p.into_inner());
        }
    }
}

/// Sets up the process's pool of `threads` poller threads (1 ..=
/// [`MAX_THREADS`]); once per process, before any controller polls. The
/// threads start with the first group given to the pool (in a confined
/// process, after the confinement: each takes the device role's).
pub fn install(threads: usize) -> Result<(), String> {
    if threads == 0 || threads > MAX_THREADS {
        return Err(format!("{threads} poller threads (1 ..= {MAX_THREADS})"));
    }
    let mut made = false;
    POOL.get_or_init(|| {
        made = true;
        Pool { threads: Threads::new(threads) }
    });
    if made {
        Ok(())
    } else {
        Err("the poller pool is set up already".into())
    }
}

/// The process's pool, if [`install`]ed.
pub(super) fn get() -> Option<&'static Pool> {
    POOL.get()
}

/// The pool's size (0: none).
pub fn threads() -> usize {
    get().map_or(0, |p| p.threads.slots.len())
}

/// A slot whose thread could not start, or ended: never chosen.
const DEAD: usize = usize::MAX;

impl Pool {
    /// Gives `core` to the least loaded thread, served until `stop`; None
    /// if no pool thread runs (the caller starts its own).
    pub(super) fn add(&self, core: Arc<Mutex<Core>>, stop: Arc<AtomicBool>) -> Option<Ticket> {
        self.threads.add(core, stop, |c, s| poll_pass(c, s))
    }
}

impl<G: Send + 'static> Threads<G> {
    fn new(threads: usize) -> Self {
        let slots = (0..threads)
            .map(|index| {
                Arc::new(Slot {
                    incoming: Mutex::new(Vec::new()),
                    pending: AtomicBool::new(false),
                    added: Condvar::new(),
                    load: AtomicUsize::new(0),
                    index,
                })
            })
            .collect();
        Threads { slots, started: Once::new() }
    }

    /// Gives `group` to the least loaded live thread (starting them all at
    /// the first call, each running `pass`); None if none runs.
    fn add<P>(&self, group: G, stop: Arc<AtomicBool>, pass: P) -> Option<Ticket>
    where
        P: Fn(&G, &mut PassState) -> Pass + Clone + Send + 'static,
    {
        self.started.call_once(|| {
            for (i, s) in self.slots.iter().enumerate() {
                let (s2, pass) = (s.clone(), pass.clone());
                let b = std::thread::Builder::new().name(format!("nvme-pool-{i}"));
                if let Err(e) = b.spawn(move || run(&s2, pass)) {
                    log::error!("nvme: cannot start poller thread {i} of the pool: {e}");
                    s.load.store(DEAD, Ordering::Relaxed);
                }
            }
        });
        let done = Arc::new(Done::default());
        let mut entry = Some(Entry { group, stop, done: done.clone(), state: PassState::default() });
        // A thread found dead under its lock (it ended since it was chosen): the next.
        for _ in 0..self.slots.len() {
            let s = self.slots.iter().min_by_key(|s| s.load.load(Ordering::Relaxed))?;
            let mut inc = lock_any(&s.incoming);
            if s.load.load(Ordering::Relaxed) == DEAD {
                continue;
            }
            s.load.fetch_add(1, Ordering::Relaxed);
            inc.push(entry.take()?);
            s.pending.store(true, Ordering::Release);
            s.added.notify_one();
            return Some(Ticket(done));
        }
        // Not given: the entry's drop must not report an ended thread.
        if let Some(e) = entry {
            e.done.finish(Ok(()));
        }
        None
    }
}

/// A lock whose poisoning (a panicked pool thread) is not fatal here: the
/// inbox and tickets stay consistent under any panic.
fn lock_any<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Marks its slot dead as its thread ends (a panic): no group is given to
/// it any more, and those given but not taken end their tickets (the ones
/// it served end theirs as its round's vector drops).
struct Ending<'a, G>(&'a Slot<G>);

impl<G> Drop for Ending<'_, G> {
    fn drop(&mut self) {
        let left: Vec<Entry<G>> = {
            let mut inc = lock_any(&self.0.incoming);
            self.0.load.store(DEAD, Ordering::Relaxed);
            std::mem::take(&mut *inc)
        };
        log::error!("nvme: poller thread {} of the pool ended; its queue groups are no longer polled", self.0.index);
        drop(left);
    }
}

/// A pool thread: rounds over its groups, forever.
fn run<G, P: Fn(&G, &mut PassState) -> Pass>(slot: &Slot<G>, pass: P) {
    crate::sandbox::enter(crate::sandbox::Role::Device);
    // Dropped after `_ending` (locals drop in reverse): the slot is dead
    // before any of its tickets ends.
    let mut mine: Vec<Entry<G>> = Vec::new();
    let _ending = Ending(slot);
    let mut idle = 0u32;
    let mut idle_since = Instant::now();
    loop {
        if mine.is_empty() || slot.pending.load(Ordering::Acquire) {
            let mut inc = lock_any(&slot.incoming);
            while mine.is_empty() && inc.is_empty() {
                inc = slot.added.wait(inc).unwrap_or_else(|p| p.into_inner());
            }
            mine.append(&mut inc);
            slot.pending.store(false, Ordering::Release);
        }
        let mut busy = false;
        let mut timed: Option<Duration> = None;
        mine.retain_mut(|e| {
            if e.stop.load(Ordering::Relaxed) {
                slot.load.fetch_sub(1, Ordering::Relaxed);
                e.done.finish(Ok(()));
                return false;
            }
            let p = pass(&e.group, &mut e.state);
            busy |= p.busy;
            timed = match (timed, p.timed) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, b) => a.or(b),
            };
            true
        });
        if busy {
            idle = 0;
            continue;
        }
        idle = idle.saturating_add(1);
        // Spinning instead of yielding was measured (issue 36): no better
        // beside N polling vCPUs (the pool waits to run 80-90% of the time
        // either way), and worse with one guest on a loaded host (the yield
        // is what gives its vCPU the core).
        if idle <= IDLE_PASSES {
            std::hint::spin_loop();
            idle_since = Instant::now();
        } else if idle_since.elapsed() < SLEEP_AFTER || timed.is_some_and(|t| t.is_zero()) {
            std::thread::yield_now();
        } else {
            std::thread::sleep(timed.map_or(IDLE_SLEEP, |t| t.min(IDLE_SLEEP)));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn install_bounds() {
        assert!(install(0).is_err());
        assert!(install(MAX_THREADS + 1).is_err());
        // The pool is process-wide: no install here (the other tests of this
        // binary would then poll through it).
    }

    /// A stand-in group: its pass panics when `boom` is set, counts passes.
    struct Fake {
        boom: AtomicBool,
        passes: AtomicUsize,
    }

    fn fake() -> Arc<Fake> {
        Arc::new(Fake { boom: AtomicBool::new(false), passes: AtomicUsize::new(0) })
    }

    fn pass(g: &Arc<Fake>, _: &mut PassState) -> Pass {
        g.passes.fetch_add(1, Ordering::Relaxed);
        assert!(!g.boom.load(Ordering::Relaxed), "a pass that panics (test)");
        Pass { busy: true, ..Pass::default() }
    }

    fn served(g: &Fake) {
        let n = g.passes.load(Ordering::Relaxed);
        while g.passes.load(Ordering::Relaxed) < n + 2 {
            std::thread::yield_now();
        }
    }

    #[test]
    fn a_stopped_group_joins_ok() {
        let t: Threads<Arc<Fake>> = Threads::new(2);
        let (a, b) = (fake(), fake());
        let (sa, sb) = (Arc::new(AtomicBool::new(false)), Arc::new(AtomicBool::new(false)));
        let ta = t.add(a.clone(), sa.clone(), pass).unwrap();
        let tb = t.add(b.clone(), sb.clone(), pass).unwrap();
        served(&a);
        served(&b);
        sa.store(true, Ordering::Relaxed);
        assert_eq!(ta.join(), Ok(()));
        // The other group is still served.
        served(&b);
        sb.store(true, Ordering::Relaxed);
        assert_eq!(tb.join(), Ok(()));
    }

    #[test]
    fn a_panicking_pool_thread_ends_its_tickets_with_an_error() {
        let t: Threads<Arc<Fake>> = Threads::new(1);
        let (a, b) = (fake(), fake());
        let stop = Arc::new(AtomicBool::new(false));
        let ta = t.add(a.clone(), stop.clone(), pass).unwrap();
        let tb = t.add(b.clone(), stop.clone(), pass).unwrap();
        served(&b);
        a.boom.store(true, Ordering::Relaxed);
        // Neither is stopped: without the fix both joins waited for ever.
        let ea = ta.join().unwrap_err();
        let eb = tb.join().unwrap_err();
        assert!(ea.contains("ended") && eb.contains("ended"), "{ea} / {eb}");
        // Its only thread is dead: no place for a new group (the caller starts its own).
        assert!(t.add(fake(), stop, pass).is_none());
    }
}
