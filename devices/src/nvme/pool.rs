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
//! Stopping: a group's `stop` flag (the controller's, as for its own
//! thread); the pool thread drops the group at its next round and marks its
//! [`Ticket`] done, which the controller waits for (after that no pool
//! thread touches the core). The pool's threads live as long as the process.

use super::controller::Core;
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
    slots: Vec<Arc<Slot>>,
    /// Its threads are started (at the first [`Pool::add`]).
    started: Once,
}

/// One pool thread's inbox.
struct Slot {
    /// Groups given to it, not yet taken into its round.
    incoming: Mutex<Vec<Entry>>,
    /// Set with `incoming` not empty (read without the lock every round).
    pending: AtomicBool,
    /// Signalled when a group is added (the thread may wait with none).
    added: Condvar,
    /// Groups it serves or is given (the least loaded takes the next).
    load: AtomicUsize,
}

/// A queue group a pool thread serves.
struct Entry {
    core: Arc<Mutex<Core>>,
    stop: Arc<AtomicBool>,
    done: Arc<Done>,
    state: PassState,
}

#[derive(Default)]
struct Done {
    done: Mutex<bool>,
    cv: Condvar,
}

/// A group's place on a pool thread; [`Ticket::join`] waits until the pool
/// has dropped it (its `stop` set).
pub struct Ticket(Arc<Done>);

impl Ticket {
    pub fn join(self) {
        let mut d = crate::lock(&self.0.done);
        while !*d {
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
        let slots = (0..threads)
            .map(|_| {
                Arc::new(Slot {
                    incoming: Mutex::new(Vec::new()),
                    pending: AtomicBool::new(false),
                    added: Condvar::new(),
                    load: AtomicUsize::new(0),
                })
            })
            .collect();
        Pool { slots, started: Once::new() }
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
    get().map_or(0, |p| p.slots.len())
}

/// A slot whose thread could not start: never chosen.
const DEAD: usize = usize::MAX;

impl Pool {
    /// Gives `core` to the least loaded thread, served until `stop`; None
    /// if no pool thread could be started (the caller starts its own).
    pub(super) fn add(&self, core: Arc<Mutex<Core>>, stop: Arc<AtomicBool>) -> Option<Ticket> {
        self.started.call_once(|| {
            for (i, s) in self.slots.iter().enumerate() {
                let s2 = s.clone();
                if let Err(e) = std::thread::Builder::new().name(format!("nvme-pool-{i}")).spawn(move || run(&s2)) {
                    log::error!("nvme: cannot start poller thread {i} of the pool: {e}");
                    s.load.store(DEAD, Ordering::Relaxed);
                }
            }
        });
        let s = self.slots.iter().min_by_key(|s| s.load.load(Ordering::Relaxed))?;
        if s.load.load(Ordering::Relaxed) == DEAD {
            return None;
        }
        s.load.fetch_add(1, Ordering::Relaxed);
        let done = Arc::new(Done::default());
        let mut inc = crate::lock(&s.incoming);
        inc.push(Entry { core, stop, done: done.clone(), state: PassState::default() });
        s.pending.store(true, Ordering::Release);
        s.added.notify_one();
        Some(Ticket(done))
    }
}

/// A pool thread: rounds over its groups, forever.
fn run(slot: &Slot) {
    crate::sandbox::enter(crate::sandbox::Role::Device);
    let mut mine: Vec<Entry> = Vec::new();
    let mut idle = 0u32;
    let mut idle_since = Instant::now();
    loop {
        if mine.is_empty() || slot.pending.load(Ordering::Acquire) {
            let mut inc = crate::lock(&slot.incoming);
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
                *crate::lock(&e.done.done) = true;
                e.done.cv.notify_all();
                return false;
            }
            let p = poll_pass(&e.core, &mut e.state);
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
}
