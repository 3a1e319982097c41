//! CPU contention as a bench option (`--contend N`): N busy threads that run
//! while a target's run is measured, so that sharing cores with other work
//! is a measured condition rather than an accident of the host.
//!
//! Contenders are threads of the bench process, not child processes: they
//! cannot outlive it (a Ctrl-C or a crash takes them along), and [`Contention`]
//! stops and joins them when dropped, on error paths too. Each is bounded: it
//! spins on arithmetic over a 4 KiB buffer at normal priority, and stops on
//! its own after a time limit even if its `Contention` were leaked.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Most contenders one `Contention` starts.
pub const MAX_CONTENDERS: u32 = 64;

/// The contenders' thread name (comm).
pub const THREAD_NAME: &str = "iopath-contend";

/// Running contender threads; dropping it stops and joins them.
pub struct Contention {
    stop: Arc<AtomicBool>,
    threads: Vec<JoinHandle<()>>,
}

impl Contention {
    /// Starts `n` contenders (none for 0), each of which stops by itself
    /// after `limit`. More than [`MAX_CONTENDERS`] is an error.
    pub fn start(n: u32, limit: Duration) -> std::io::Result<Contention> {
        Contention::start_on(n, None, limit)
    }

    /// As [`start`](Self::start), each contender pinned to `cpu` when one is
    /// given (a CPU it cannot be pinned to leaves it where the scheduler puts it).
    pub fn start_on(n: u32, cpu: Option<usize>, limit: Duration) -> std::io::Result<Contention> {
        if n > MAX_CONTENDERS {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!("{n} contenders: at most {MAX_CONTENDERS}"),
            ));
        }
        let mut c = Contention { stop: Arc::new(AtomicBool::new(false)), threads: Vec::new() };
        // A limit past what an Instant can hold means none.
        let deadline = Instant::now().checked_add(limit);
        for i in 0..n {
            let stop = c.stop.clone();
            // On an error, `c` is dropped here and stops the ones already started.
            let h = std::thread::Builder::new().name(THREAD_NAME.into()).spawn(move || {
                if let Some(c) = cpu {
                    if let Err(e) = crate::pin::set_affinity(0, c) {
                        log::warn!("contender: cannot pin to CPU {c}: {e}");
                    }
                }
                spin(i, &stop, deadline)
            })?;
            c.threads.push(h);
        }
        Ok(c)
    }

    /// Contenders running.
    pub fn len(&self) -> usize {
        self.threads.len()
    }

    pub fn is_empty(&self) -> bool {
        self.threads.is_empty()
    }
}

impl Drop for Contention {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for h in self.threads.drain(..) {
            let _ = h.join();
        }
    }
}

/// A contender's body: xorshift over a 4 KiB buffer until told to stop.
fn spin(seed: u32, stop: &AtomicBool, deadline: Option<Instant>) {
    let mut buf = [0u64; 512];
    let mut x = 0x9e37_79b9_7f4a_7c15u64 ^ seed as u64;
    loop {
        for _ in 0..4096 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let i = (x as usize) % buf.len();
            buf[i] = buf[i].wrapping_add(x);
        }
        std::hint::black_box(&mut buf);
        if stop.load(Ordering::Relaxed) || deadline.is_some_and(|d| Instant::now() >= d) {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    /// Tests count this process's threads: one at a time.
    static LOCK: Mutex<()> = Mutex::new(());

    fn contenders() -> usize {
        crate::cpu::Snapshot::take(&[std::process::id()], &[THREAD_NAME]).threads.len()
    }

    /// The count once it settles at `n` (a joined thread may linger in /proc
    /// for a moment), or the last count after 5 s.
    fn contenders_settle(n: usize) -> usize {
        let t0 = std::time::Instant::now();
        loop {
            let c = contenders();
            if c == n || t0.elapsed() > Duration::from_secs(5) {
                return c;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    #[test]
    fn contenders_start_run_and_none_is_left_after_drop() {
        let _g = LOCK.lock().unwrap_or_else(|e| e.into_inner());
        assert_eq!(contenders_settle(0), 0);
        let c = Contention::start(3, Duration::from_secs(60)).unwrap();
        assert_eq!(c.len(), 3);
        assert_eq!(contenders_settle(3), 3, "a new thread names itself once it runs");
        let me = [std::process::id()];
        let a = crate::cpu::Snapshot::take(&me, &[THREAD_NAME]);
        std::thread::sleep(Duration::from_millis(300));
        let b = crate::cpu::Snapshot::take(&me, &[THREAD_NAME]);
        assert!(b.cpu_ns_since(&a) > 10_000_000, "contenders ran {} ns", b.cpu_ns_since(&a));
        drop(c);
        assert_eq!(contenders_settle(0), 0);
    }

    #[test]
    fn zero_starts_none_and_too_many_is_an_error() {
        let _g = LOCK.lock().unwrap_or_else(|e| e.into_inner());
        let c = Contention::start(0, Duration::from_secs(1)).unwrap();
        assert!(c.is_empty());
        assert_eq!(contenders(), 0);
        assert!(Contention::start(MAX_CONTENDERS + 1, Duration::from_secs(1)).is_err());
        assert_eq!(contenders_settle(0), 0);
        // A limit no Instant can hold is no limit, not a panic.
        drop(Contention::start(1, Duration::MAX).unwrap());
        assert_eq!(contenders_settle(0), 0);
    }

    #[test]
    fn a_pinned_contender_runs_on_its_cpu() {
        let _g = LOCK.lock().unwrap_or_else(|e| e.into_inner());
        let cpu = *crate::pin::allowed_cpus().last().expect("a CPU");
        let c = Contention::start_on(1, Some(cpu), Duration::from_secs(60)).unwrap();
        assert_eq!(contenders_settle(1), 1);
        let t0 = std::time::Instant::now();
        let on = loop {
            let s = crate::cpu::Snapshot::take(&[std::process::id()], &[THREAD_NAME]);
            let on = s.threads.first().map(|t| t.tid).and_then(last_cpu);
            if on == Some(cpu) || t0.elapsed() > Duration::from_secs(5) {
                break on;
            }
            std::thread::sleep(Duration::from_millis(10));
        };
        assert_eq!(on, Some(cpu), "the contender runs where it was pinned");
        drop(c);
        assert_eq!(contenders_settle(0), 0);
    }

    /// The CPU thread `tid` of this process last ran on (field 39 of its stat).
    fn last_cpu(tid: u32) -> Option<usize> {
        let s = std::fs::read_to_string(format!("/proc/self/task/{tid}/stat")).ok()?;
        s.rsplit_once(')')?.1.split_whitespace().nth(36)?.parse().ok()
    }

    #[test]
    fn a_leaked_contention_stops_at_its_limit() {
        let _g = LOCK.lock().unwrap_or_else(|e| e.into_inner());
        let c = Contention::start(2, Duration::from_millis(100)).unwrap();
        let hs: Vec<JoinHandle<()>> = {
            let mut c = std::mem::ManuallyDrop::new(c);
            c.threads.drain(..).collect()
        };
        // Never told to stop: they end at the limit. Joining proves it.
        for h in hs {
            h.join().unwrap();
        }
        assert_eq!(contenders_settle(0), 0);
    }
}
