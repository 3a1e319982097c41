//! The wake-up floor: how long this host takes to run a thread that sleeps
//! on an eventfd, from the write that wakes it, when it has slept for a
//! while (its CPU idle). It bounds what any sleeping device thread can do
//! for the first I/O after an idle spell (`adaptive`, `ioeventfd`): on a
//! nested host an idle vCPU halts, and waking it goes through the outer
//! hypervisor.

use serde::Serialize;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use vmm_sys_util::eventfd::EventFd;

/// Wake-ups per round, and the idle spell before each.
pub const WAKES: usize = 200;
pub const IDLE: Duration = Duration::from_millis(1);

/// The table rows: p50 and p99, median [min .. max] over rounds.
pub fn rows(runs: &[WakeRun]) -> String {
    let (Some(p50), Some(p99)) = (
        crate::stats::summarize(&runs.iter().map(|r| r.p50_ns).collect::<Vec<_>>()),
        crate::stats::summarize(&runs.iter().map(|r| r.p99_ns).collect::<Vec<_>>()),
    ) else {
        return String::new();
    };
    let us = |v: f64| format!("{:.1} us", v / 1e3);
    format!(
        "wake-up floor (a thread asleep {} us in poll on an eventfd, woken from another CPU; {} per round): \
         p50 {} [{} .. {}], p99 {} [{} .. {}]\n",
        IDLE.as_micros(),
        WAKES,
        us(p50.median),
        us(p50.min),
        us(p50.max),
        us(p99.median),
        us(p99.min),
        us(p99.max)
    )
}

/// One wake-up floor measurement.
#[derive(Clone, Debug, Serialize)]
pub struct WakeRun {
    pub round: u32,
    /// Wake-ups measured.
    pub n: usize,
    /// How long the sleeper slept before each wake-up.
    pub idle_us: u64,
    pub p50_ns: f64,
    pub p99_ns: f64,
    pub min_ns: f64,
    /// (waker, sleeper) CPUs if pinned.
    pub cpus: Option<(usize, usize)>,
}

/// `n` wake-ups of a thread sleeping in poll(2) on an eventfd, each after
/// `idle` without one; the waker and the sleeper on `cpus` if given.
pub fn run_wake(n: usize, idle: Duration, cpus: Option<(usize, usize)>, round: u32) -> anyhow::Result<WakeRun> {
    anyhow::ensure!(n > 0 && n <= 100_000, "wake-ups: {n} (1..=100000)");
    let efd = Arc::new(EventFd::new(0)?);
    let t0 = Instant::now();
    // ns since t0 at which the sleeper ran; 0 while it has not.
    let woke = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let (e2, w2, s2) = (efd.clone(), woke.clone(), stop.clone());
    let sleeper = std::thread::Builder::new().name("wake-sleeper".into()).spawn(move || {
        if let Some((_, c)) = cpus {
            let _ = crate::pin::set_affinity(0, c);
        }
        while !s2.load(Ordering::Relaxed) {
            let mut p = libc::pollfd { fd: e2.as_raw_fd(), events: libc::POLLIN, revents: 0 };
            // SAFETY: one valid pollfd.
            let r = unsafe { libc::poll(&mut p, 1, 1000) };
            if r > 0 {
                let ran = t0.elapsed().as_nanos().max(1) as u64;
                // The count is taken before the wake-up is told: told first, a
                // sleeper preempted for longer than `idle` would then read the
                // next wake-up's write with this one's, and sleep through it.
                let _ = e2.read();
                w2.store(ran, Ordering::Release);
            }
        }
    })?;
    // The waker is a thread of its own too, so the caller's placement stays.
    let (e3, w3) = (efd.clone(), woke.clone());
    let waker = std::thread::Builder::new().name("wake-waker".into()).spawn(move || {
        if let Some((c, _)) = cpus {
            let _ = crate::pin::set_affinity(0, c);
        }
        let mut d = Vec::with_capacity(n);
        for _ in 0..n {
            std::thread::sleep(idle);
            w3.store(0, Ordering::Release);
            let sent = t0.elapsed().as_nanos() as u64;
            e3.write(1)?;
            let deadline = Instant::now() + Duration::from_secs(1);
            let mut at: u64 = 0;
            while at == 0 && Instant::now() < deadline {
                at = w3.load(Ordering::Acquire);
                std::hint::spin_loop();
            }
            if at == 0 {
                return Err(std::io::Error::other("the sleeper did not wake in 1 s"));
            }
            d.push(at.saturating_sub(sent) as f64);
        }
        Ok(d)
    });
    let d = match waker {
        Ok(h) => h.join().map_err(|_| anyhow::anyhow!("wake floor: the waker panicked")).and_then(|r| Ok(r?)),
        Err(e) => Err(e.into()),
    };
    stop.store(true, Ordering::Relaxed);
    let _ = efd.write(1);
    let _ = sleeper.join();
    let mut d = d.map_err(|e| anyhow::anyhow!("wake floor: {e}"))?;
    d.sort_by(f64::total_cmp);
    let q = |f: f64| d[((d.len() - 1) as f64 * f).round() as usize];
    Ok(WakeRun {
        round,
        n: d.len(),
        idle_us: idle.as_micros() as u64,
        p50_ns: q(0.5),
        p99_ns: q(0.99),
        min_ns: d[0],
        cpus,
    })
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_sleeper_is_woken_every_time_and_the_figures_are_ordered() {
        let r = super::run_wake(20, std::time::Duration::from_millis(1), None, 0).unwrap();
        assert_eq!(r.n, 20);
        assert!(r.min_ns > 0.0 && r.min_ns <= r.p50_ns && r.p50_ns <= r.p99_ns, "{r:?}");
        assert!(super::run_wake(0, std::time::Duration::ZERO, None, 0).is_err());
    }

    /// No idle at all: the next wake-up is written as soon as the last one
    /// is told, before a sleeper that told it first has read its count.
    #[test]
    fn back_to_back_wake_ups_are_each_seen() {
        let r = super::run_wake(2000, std::time::Duration::ZERO, None, 0).unwrap();
        assert_eq!(r.n, 2000);
    }
}
