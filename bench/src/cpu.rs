//! CPU time of named threads (a device's poller, ioeventfd and io_uring
//! threads), in this process or in its children (a device process), read
//! from `/proc/PID/task/TID/schedstat`: its first field is the time the
//! thread ran, in ns, and it is readable for other processes' threads too.
//! Where schedstat is missing, `stat`'s utime+stime (clock ticks) stand in.
//! Its second field is the time the thread waited on a run queue, runnable
//! but not running: what other threads took from a polling one.

use iopath_devices::lock;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The NVMe controller's device threads (devices/src/nvme/doorbells.rs).
pub const NVME_DEVICE_THREADS: &[&str] = &["nvme-poller", "nvme-adaptive", "nvme-ioeventfd", "nvme-uring"];

/// One thread's CPU time at a snapshot.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ThreadCpu {
    pub pid: u32,
    pub tid: u32,
    pub name: String,
    pub cpu_ns: u64,
    /// Time spent runnable on a run queue, not running (schedstat; 0 without it).
    pub wait_ns: u64,
}

/// The CPU times of the matching threads at one instant.
#[derive(Clone, Debug)]
pub struct Snapshot {
    pub at: Instant,
    pub threads: Vec<ThreadCpu>,
}

impl Snapshot {
    /// Threads of `pids` whose name (comm) is one of `names`.
    pub fn take(pids: &[u32], names: &[&str]) -> Snapshot {
        let at = Instant::now();
        let mut threads = Vec::new();
        for &pid in pids {
            let Ok(dir) = std::fs::read_dir(format!("/proc/{pid}/task")) else { continue };
            for e in dir.flatten() {
                let Some(tid) = e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else { continue };
                let Ok(comm) = std::fs::read_to_string(format!("/proc/{pid}/task/{tid}/comm")) else { continue };
                let name = comm.trim_end_matches('\n');
                if !names.contains(&name) {
                    continue;
                }
                let (cpu_ns, wait_ns) = match schedstat(pid, tid) {
                    Some(s) => s,
                    None => match stat_cpu_ns(
                        &std::fs::read_to_string(format!("/proc/{pid}/task/{tid}/stat")).unwrap_or_default(),
                    ) {
                        Some(ns) => (ns, 0),
                        None => continue,
                    },
                };
                threads.push(ThreadCpu { pid, tid, name: name.to_string(), cpu_ns, wait_ns });
            }
        }
        Snapshot { at, threads }
    }

    /// CPU time the threads ran between `earlier` and this snapshot. A
    /// thread new since `earlier` counts from zero; one gone since is lost.
    pub fn cpu_ns_since(&self, earlier: &Snapshot) -> u64 {
        self.since(earlier, |t| t.cpu_ns)
    }

    /// Run-queue wait of the threads between `earlier` and this snapshot,
    /// counted as [`cpu_ns_since`](Self::cpu_ns_since) counts CPU time.
    pub fn wait_ns_since(&self, earlier: &Snapshot) -> u64 {
        self.since(earlier, |t| t.wait_ns)
    }

    fn since(&self, earlier: &Snapshot, f: fn(&ThreadCpu) -> u64) -> u64 {
        self.threads
            .iter()
            .map(|t| {
                let before = earlier.threads.iter().find(|b| b.pid == t.pid && b.tid == t.tid).map_or(0, f);
                f(t).saturating_sub(before)
            })
            .sum()
    }
}

/// A thread's (CPU time, run-queue wait) in ns from its schedstat.
fn schedstat(pid: u32, tid: u32) -> Option<(u64, u64)> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/task/{tid}/schedstat")).ok()?;
    let mut f = s.split_whitespace().map(|v| v.parse::<u64>().ok());
    Some((f.next()??, f.next()??))
}

/// A thread's CPU time in ns: schedstat, else stat's utime+stime.
pub fn thread_cpu_ns(pid: u32, tid: u32) -> Option<u64> {
    if let Some((ns, _)) = schedstat(pid, tid) {
        return Some(ns);
    }
    stat_cpu_ns(&std::fs::read_to_string(format!("/proc/{pid}/task/{tid}/stat")).ok()?)
}

/// utime+stime of a `stat` file's text, in ns.
fn stat_cpu_ns(s: &str) -> Option<u64> {
    // Fields after the comm's closing parenthesis: state is field 3, utime 14, stime 15.
    let f: Vec<&str> = s.get(s.rfind(')')? + 1..)?.split_whitespace().collect();
    let ticks = f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?;
    // SAFETY: sysconf has no memory effects.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as u64;
    Some(ticks * (1_000_000_000 / hz))
}

/// A whole process's CPU time in ns: `stat`'s utime+stime, which also hold
/// its threads that ended (clock ticks: 10 ms steps where HZ is 100).
pub fn process_cpu_ns(pid: u32) -> Option<u64> {
    stat_cpu_ns(&std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?)
}

/// This process and its children (a device process it spawned).
pub fn self_and_children() -> Vec<u32> {
    let me = std::process::id();
    let mut pids = vec![me];
    match children_of(me) {
        Some(c) => pids.extend(c),
        None => pids.extend(children_by_scan(me)),
    }
    pids
}

/// `pid`'s children from each of its threads' `children` file (a few reads;
/// the pinner looks every 100-500 ms while a run goes, and a walk of every
/// process's `stat` took over a millisecond on a CPU the run polls on).
/// None where the kernel has no such file (CONFIG_PROC_CHILDREN unset).
fn children_of(pid: u32) -> Option<Vec<u32>> {
    // The main thread's file is there while the process is, where the kernel has them.
    if !std::path::Path::new(&format!("/proc/{pid}/task/{pid}/children")).exists() {
        return None;
    }
    let mut out = Vec::new();
    for e in std::fs::read_dir(format!("/proc/{pid}/task")).ok()?.flatten() {
        // A thread that ended meanwhile has no file left, and no children.
        if let Ok(s) = std::fs::read_to_string(e.path().join("children")) {
            out.extend(s.split_whitespace().filter_map(|v| v.parse::<u32>().ok()));
        }
    }
    out.sort_unstable();
    out.dedup();
    Some(out)
}

/// `pid`'s children, by each process's parent in `/proc/*/stat`.
fn children_by_scan(pid: u32) -> Vec<u32> {
    let mut out = Vec::new();
    let Ok(dir) = std::fs::read_dir("/proc") else { return out };
    for e in dir.flatten() {
        let Some(child) = e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else { continue };
        let Ok(s) = std::fs::read_to_string(format!("/proc/{child}/stat")) else { continue };
        let ppid = s.rfind(')').and_then(|i| s[i + 1..].split_whitespace().nth(1)?.parse::<u32>().ok());
        if ppid == Some(pid) {
            out.push(child);
        }
    }
    out
}

/// What a [`Window`] measured.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct WindowCpu {
    /// Matching threads seen at the window's end.
    pub threads: usize,
    /// Their CPU time during the window, in ns.
    pub busy_ns: u64,
    /// Their CPU time during the idle pause, as a percentage of its length
    /// (one fully busy thread is 100).
    pub idle_pct: f64,
    /// Their run-queue wait during the window (runnable, another thread on
    /// their CPU), as a percentage of the window (one thread waiting the
    /// whole window is 100): time the host took from them.
    pub waited_pct: f64,
}

#[derive(Default)]
struct WindowState {
    start: Option<Snapshot>,
    end: Option<Snapshot>,
    idle_end: Option<Snapshot>,
}

/// A measured window marked by two guest output lines: it opens at a line
/// starting with `open` and closes at one starting with `close`. At the
/// close, the line callback (on the vCPU thread, which is then held in its
/// exit) sleeps `idle`: the guest can issue no I/O, so what the device
/// threads spend then is their idle cost.
#[derive(Clone)]
pub struct Window {
    names: &'static [&'static str],
    open: &'static str,
    close: &'static str,
    idle: Duration,
    state: Arc<Mutex<WindowState>>,
}

impl Window {
    pub fn new(names: &'static [&'static str], open: &'static str, close: &'static str, idle: Duration) -> Self {
        Window { names, open, close, idle, state: Arc::default() }
    }

    /// Feed it every guest line (the VMM's `on_line`).
    pub fn on_line(&self, line: &str) {
        let snap = || Snapshot::take(&self_and_children(), self.names);
        if line.starts_with(self.open) {
            let mut st = lock(&self.state);
            if st.start.is_none() {
                st.start = Some(snap());
            }
        } else if line.starts_with(self.close) {
            if lock(&self.state).end.is_some() {
                return;
            }
            let end = snap();
            std::thread::sleep(self.idle);
            let idle_end = snap();
            let mut st = lock(&self.state);
            st.end = Some(end);
            st.idle_end = Some(idle_end);
        }
    }

    /// The window's figures; None unless both lines were seen.
    pub fn result(&self) -> Option<WindowCpu> {
        let st = lock(&self.state);
        let (start, end, idle_end) = (st.start.as_ref()?, st.end.as_ref()?, st.idle_end.as_ref()?);
        let idle_wall = idle_end.at.duration_since(end.at).as_nanos().max(1) as f64;
        let wall = end.at.duration_since(start.at).as_nanos().max(1) as f64;
        Some(WindowCpu {
            threads: end.threads.len(),
            busy_ns: end.cpu_ns_since(start),
            idle_pct: idle_end.cpu_ns_since(end) as f64 * 100.0 / idle_wall,
            waited_pct: end.wait_ns_since(start) as f64 * 100.0 / wall,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, Ordering};

    fn named(name: &str, spin: bool, stop: Arc<AtomicBool>) -> std::thread::JoinHandle<()> {
        std::thread::Builder::new()
            .name(name.into())
            .spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    if spin {
                        std::hint::spin_loop();
                    } else {
                        std::thread::sleep(Duration::from_millis(20));
                    }
                }
            })
            .unwrap()
    }

    #[test]
    fn a_spawned_child_is_found_by_the_children_files_and_by_the_scan_alike() {
        let mut child = std::process::Command::new("sleep").arg("30").spawn().unwrap();
        let me = std::process::id();
        let listed = children_of(me);
        let scanned = children_by_scan(me);
        let found = self_and_children();
        let _ = child.kill();
        let _ = child.wait();
        assert!(scanned.contains(&child.id()), "the scan misses child {}: {scanned:?}", child.id());
        if let Some(l) = listed {
            assert!(l.contains(&child.id()), "the children files miss child {}: {l:?}", child.id());
        }
        assert_eq!(found[0], me);
        assert!(found.contains(&child.id()), "{found:?}");
    }

    #[test]
    fn a_spinning_named_thread_accrues_cpu_and_a_sleeping_one_does_not() {
        let stop = Arc::new(AtomicBool::new(false));
        let hs = [named("cpu-test-spin", true, stop.clone()), named("cpu-test-sleep", false, stop.clone())];
        let me = [std::process::id()];
        std::thread::sleep(Duration::from_millis(50));
        let a = Snapshot::take(&me, &["cpu-test-spin"]);
        let s0 = Snapshot::take(&me, &["cpu-test-sleep"]);
        std::thread::sleep(Duration::from_millis(400));
        let b = Snapshot::take(&me, &["cpu-test-spin"]);
        let s1 = Snapshot::take(&me, &["cpu-test-sleep"]);
        stop.store(true, Ordering::Relaxed);
        for h in hs {
            h.join().unwrap();
        }
        assert_eq!((a.threads.len(), s0.threads.len()), (1, 1), "{a:?} {s0:?}");
        assert_eq!(a.threads[0].name, "cpu-test-spin");
        // Generous: the machine is shared, but a spinning thread gets some CPU in 400 ms.
        assert!(b.cpu_ns_since(&a) > 20_000_000, "spinner ran {} ns", b.cpu_ns_since(&a));
        assert!(s1.cpu_ns_since(&s0) < 20_000_000, "sleeper ran {} ns", s1.cpu_ns_since(&s0));
    }

    #[test]
    fn names_that_match_no_thread_give_an_empty_snapshot() {
        let s = Snapshot::take(&[std::process::id()], &["no-such-thread"]);
        assert!(s.threads.is_empty());
        assert_eq!(s.cpu_ns_since(&s), 0);
        assert!(Snapshot::take(&[u32::MAX], &["x"]).threads.is_empty());
    }

    #[test]
    fn a_window_measures_between_its_lines_and_idles_at_the_close() {
        let stop = Arc::new(AtomicBool::new(false));
        let h = named("cpu-test-win", true, stop.clone());
        let w = Window::new(&["cpu-test-win"], "@open", "@close ", Duration::from_millis(100));
        w.on_line("@close early");
        assert!(w.result().is_none(), "no open line yet");
        let w = Window::new(&["cpu-test-win"], "@open", "@close ", Duration::from_millis(100));
        w.on_line("@open");
        std::thread::sleep(Duration::from_millis(200));
        w.on_line("unrelated");
        w.on_line("@close x=1");
        stop.store(true, Ordering::Relaxed);
        h.join().unwrap();
        let r = w.result().unwrap();
        assert_eq!(r.threads, 1);
        assert!(r.busy_ns > 10_000_000, "{r:?}");
        assert!(r.idle_pct > 0.0 && r.idle_pct <= 110.0, "{r:?}");
    }

    #[test]
    fn this_process_is_among_its_pids() {
        assert_eq!(self_and_children()[0], std::process::id());
    }
}
