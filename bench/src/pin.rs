//! Thread placement for a run: the guest's vCPU thread (iopath's `vcpu0`,
//! QEMU's `CPU 0/KVM`) on one CPU, the device threads (pollers, ioeventfd
//! and io_uring threads) on the others, and the floor's two threads placed
//! the same way. Unpinned, this host's scheduler may put the submitter and
//! the poller on one CPU for part of a run, and a polled figure then falls by
//! an order of magnitude for reasons that are not the path's.
//!
//! Threads are found by name in this process and its children (a device
//! process, QEMU) while the run goes, by a [`Pinner`] that looks every few
//! milliseconds, since they come and go with the guest's driver.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// Where a run's threads go.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub struct Placement {
    /// The guest vCPU thread (the floor's submitter).
    pub vcpu: usize,
    /// The first device thread (the floor's poller); further device threads
    /// take the other allowed CPUs in turn, this one again when none is left.
    pub device: usize,
}

impl Placement {
    /// The first two CPUs this process may run on; None with fewer.
    pub fn auto() -> Option<Placement> {
        let cpus = allowed_cpus();
        (cpus.len() >= 2).then(|| Placement { vcpu: cpus[0], device: cpus[1] })
    }

    /// (submitter, poller), as the floor takes it.
    pub fn pair(&self) -> (usize, usize) {
        (self.vcpu, self.device)
    }

    /// The CPU of the `i`th device thread: `device`, then the other allowed
    /// CPUs but the vCPU's, round robin.
    pub fn device_cpu(&self, i: usize, allowed: &[usize]) -> usize {
        let mut cpus = vec![self.device];
        cpus.extend(allowed.iter().copied().filter(|&c| c != self.vcpu && c != self.device));
        cpus[i % cpus.len()]
    }
}

impl std::fmt::Display for Placement {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "pinned: vCPU on CPU {}, device threads from CPU {}", self.vcpu, self.device)
    }
}

/// A `--pin` value that does not parse or cannot be had.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum BadPin {
    #[error("{0:?}: auto, off or VCPU,DEVICE")]
    Syntax(String),
    #[error("{0:?} is not a CPU number")]
    NotACpu(String),
    #[error("{0:?}: the vCPU and the device threads need two CPUs")]
    SameCpu(String),
    #[error("{0:?}: CPU beyond CPU_SETSIZE")]
    BeyondSetSize(String),
}

/// `--pin`: `auto` (the first two allowed CPUs), `off`, or `VCPU,DEVICE`.
impl std::str::FromStr for PinChoice {
    type Err = BadPin;
    fn from_str(s: &str) -> Result<Self, BadPin> {
        match s {
            "auto" => Ok(PinChoice::Auto),
            "off" => Ok(PinChoice::Off),
            _ => {
                let (a, b) = s.split_once(',').ok_or_else(|| BadPin::Syntax(s.to_string()))?;
                let n = |v: &str| v.trim().parse::<usize>().map_err(|_| BadPin::NotACpu(v.to_string()));
                let (vcpu, device) = (n(a)?, n(b)?);
                if vcpu == device {
                    return Err(BadPin::SameCpu(s.to_string()));
                }
                if vcpu.max(device) >= libc::CPU_SETSIZE as usize {
                    return Err(BadPin::BeyondSetSize(s.to_string()));
                }
                Ok(PinChoice::Cpus(Placement { vcpu, device }))
            }
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PinChoice {
    Auto,
    Off,
    Cpus(Placement),
}

impl PinChoice {
    /// The placement to use: None when off, or auto on a single CPU.
    pub fn placement(self) -> Option<Placement> {
        match self {
            PinChoice::Auto => Placement::auto(),
            PinChoice::Off => None,
            PinChoice::Cpus(p) => Some(p),
        }
    }
}

/// The CPUs this process may run on.
pub fn allowed_cpus() -> Vec<usize> {
    // SAFETY: cpu_set_t is plain data filled by sched_getaffinity; CPU_ISSET
    // is given indexes below CPU_SETSIZE.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        if libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) != 0 {
            return Vec::new();
        }
        (0..libc::CPU_SETSIZE as usize).filter(|&c| libc::CPU_ISSET(c, &set)).collect()
    }
}

/// Pins thread `tid` (0: the calling thread) to `cpu`.
pub fn set_affinity(tid: u32, cpu: usize) -> std::io::Result<()> {
    if cpu >= libc::CPU_SETSIZE as usize {
        return Err(std::io::Error::other(format!("CPU {cpu} is beyond CPU_SETSIZE")));
    }
    // SAFETY: cpu_set_t is plain data; CPU_SET is given an index below
    // CPU_SETSIZE; sched_setaffinity reads the set.
    let rc = unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        libc::sched_setaffinity(tid as libc::pid_t, std::mem::size_of::<libc::cpu_set_t>(), &set)
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Thread names of the guest's vCPU: iopath's VMM and QEMU's.
pub const VCPU_THREADS: &[&str] = &["vcpu0", "CPU 0/KVM"];

/// QEMU's threads that serve its devices, by the names it gives them with
/// `-name ...,debug-threads=on` (which `qemu::args_with` passes): the main
/// loop (it keeps the process's name; without an iothread it serves the
/// devices' ioeventfds and io_uring completions) and the thread pool's
/// `worker`s (aio=threads). Without debug-threads every QEMU thread, the
/// vCPU's too, has the main loop's name.
pub const QEMU_DEVICE_THREADS: &[&str] = &["qemu-system-x86", "worker"];

/// Places a run's threads while it lasts (stops when dropped).
pub struct Pinner {
    stop: Arc<AtomicBool>,
    pinned: Arc<AtomicUsize>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Pinner {
    /// Looks for the vCPU thread and the threads named `device` in this
    /// process and its children, every 5 ms during the first half second,
    /// every 100 ms until 2 s, every 500 ms after, and pins each new one, and
    /// each one whose name changed: a thread the vCPU thread starts (a poller, at the
    /// controller's enable) runs under the vCPU's name, and on its CPU, until
    /// it names itself. A thread that cannot be pinned is skipped (counted no).
    pub fn start(p: Placement, device: &'static [&'static str]) -> Pinner {
        let (stop, pinned) = (Arc::new(AtomicBool::new(false)), Arc::new(AtomicUsize::new(0)));
        let (stop2, pinned2) = (stop.clone(), pinned.clone());
        let allowed = allowed_cpus();
        let thread = std::thread::Builder::new()
            .name("bench-pinner".into())
            .spawn(move || {
                let mut seen = BTreeMap::new();
                let mut n_device = 0;
                let t0 = std::time::Instant::now();
                while !stop2.load(Ordering::Relaxed) {
                    let found = crate::cpu::Snapshot::take(&crate::cpu::self_and_children(), &names(device));
                    let mut fresh: Vec<_> =
                        found.threads.iter().filter(|t| seen.get(&(t.pid, t.tid)) != Some(&t.name)).collect();
                    fresh.sort_by(|a, b| (&a.name, a.tid).cmp(&(&b.name, b.tid)));
                    for t in fresh {
                        seen.insert((t.pid, t.tid), t.name.clone());
                        let cpu = if VCPU_THREADS.contains(&t.name.as_str()) {
                            p.vcpu
                        } else {
                            n_device += 1;
                            p.device_cpu(n_device - 1, &allowed)
                        };
                        if set_affinity(t.tid, cpu).is_ok() {
                            pinned2.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                    // Each look reads every thread's name (some 0.2 ms, on a CPU the run
                    // polls on): often while the guest sets up, rarely once it runs.
                    let period = match t0.elapsed().as_millis() {
                        0..500 => 5,
                        500..2000 => 100,
                        _ => 500,
                    };
                    std::thread::sleep(Duration::from_millis(period));
                }
            })
            .ok();
        Pinner { stop, pinned, thread }
    }

    /// Threads pinned so far.
    pub fn pinned(&self) -> usize {
        self.pinned.load(Ordering::Relaxed)
    }
}

/// The vCPU names and `device`, as one list.
fn names(device: &'static [&'static str]) -> Vec<&'static str> {
    VCPU_THREADS.iter().chain(device.iter()).copied().collect()
}

impl Drop for Pinner {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(h) = self.thread.take() {
            let _ = h.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pin_choices_parse_and_bad_ones_say_why() {
        assert_eq!("off".parse::<PinChoice>(), Ok(PinChoice::Off));
        assert_eq!("auto".parse::<PinChoice>(), Ok(PinChoice::Auto));
        assert_eq!("0,1".parse::<PinChoice>(), Ok(PinChoice::Cpus(Placement { vcpu: 0, device: 1 })));
        assert!("1,1".parse::<PinChoice>().unwrap_err().to_string().contains("two CPUs"));
        assert!("x".parse::<PinChoice>().is_err());
        assert!("0,99999".parse::<PinChoice>().unwrap_err().to_string().contains("CPU_SETSIZE"));
    }

    #[test]
    fn device_threads_take_the_cpus_the_vcpu_does_not() {
        let p = Placement { vcpu: 0, device: 1 };
        let cpus: Vec<usize> = (0..4).map(|i| p.device_cpu(i, &[0, 1, 2, 3])).collect();
        assert_eq!(cpus, [1, 2, 3, 1]);
        assert_eq!(p.device_cpu(5, &[0, 1]), 1, "two CPUs: every device thread on the second");
    }

    #[test]
    fn a_thread_that_starts_under_the_vcpus_name_is_moved_when_it_names_itself() {
        let Some(p) = Placement::auto() else { return assert_eq!(allowed_cpus().len(), 1) };
        let pinner = Arc::new(Pinner::start(p, &["pin-test-late"]));
        let pn = pinner.clone();
        let wait_for = move |n: usize| {
            let t0 = std::time::Instant::now();
            while pn.pinned() < n && t0.elapsed() < Duration::from_secs(10) {
                std::thread::sleep(Duration::from_millis(2));
            }
            pn.pinned()
        };
        // As a poller the vCPU thread starts: named like it at first.
        let h = std::thread::Builder::new()
            .name("vcpu0".into())
            .spawn(move || {
                let first = wait_for(1);
                let name = std::ffi::CString::new("pin-test-late").unwrap();
                // SAFETY: PR_SET_NAME with a NUL-terminated name of 16 bytes or less.
                unsafe { libc::prctl(libc::PR_SET_NAME, name.as_ptr()) };
                let second = wait_for(2);
                std::thread::sleep(Duration::from_millis(5));
                // SAFETY: sched_getcpu has no arguments.
                (first, second, unsafe { libc::sched_getcpu() } as usize)
            })
            .unwrap();
        let (first, second, cpu) = h.join().unwrap();
        assert_eq!((first, second), (1, 2), "pinned as the vCPU, then again under its own name");
        assert_eq!(cpu, p.device, "it runs on the device CPU, not the vCPU's");
    }

    #[test]
    fn a_named_thread_of_this_process_is_pinned_while_the_pinner_runs() {
        let allowed = allowed_cpus();
        let Some(p) = Placement::auto() else {
            // One CPU: nothing to place (this machine has two; CI's too).
            assert_eq!(allowed.len(), 1);
            return;
        };
        let stop = Arc::new(AtomicBool::new(false));
        let s2 = stop.clone();
        let h = std::thread::Builder::new()
            .name("pin-test-device".into())
            .spawn(move || {
                while !s2.load(Ordering::Relaxed) {
                    std::thread::sleep(Duration::from_millis(1));
                }
                // SAFETY: sched_getcpu has no arguments.
                unsafe { libc::sched_getcpu() }
            })
            .unwrap();
        let pinner = Pinner::start(p, &["pin-test-device"]);
        let t0 = std::time::Instant::now();
        while pinner.pinned() == 0 && t0.elapsed() < Duration::from_secs(10) {
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(pinner.pinned(), 1, "the device thread was found and pinned");
        drop(pinner);
        stop.store(true, Ordering::Relaxed);
        assert_eq!(h.join().unwrap() as usize, p.device, "it runs where it was put");
    }
}
