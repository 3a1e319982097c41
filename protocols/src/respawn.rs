//! Getting a device process back after it died, for a VMM-side proxy or
//! frontend that survives it ([`Reconnect`]): the VMM starts the same
//! `iopath serve` again on a new socket pair if it started the first, or
//! waits, bounded, for an external server's socket to accept again. Also
//! what a death is logged with ([`death_cause`]) and the bound on how
//! often a device may die before the VMM gives up on it ([`Budget`]).
//! Generic: nothing here speaks a protocol.

use crate::attach::Programs;
use crate::process::{DeviceProcess, CHILD_SOCKET_FD};
use crate::{Error, Result};
use iopath_devices::DeviceConfig;
use std::collections::VecDeque;
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// How long a client of an external server (vfio-user or vhost-user)
/// waits for its socket to come back, in ms; 0 (the default) is no
/// reconnect: the server's death stops the run (`iopath run --reconnect-ms`).
static SOCKET_WAIT_MS: AtomicU64 = AtomicU64::new(0);

/// Sets how long clients of external sockets made from now on wait for
/// their socket to come back (zero: they do not reconnect).
pub fn set_socket_wait(d: Duration) {
    SOCKET_WAIT_MS.store(d.as_millis().min(u64::MAX as u128) as u64, Ordering::Relaxed);
}

/// The wait [`set_socket_wait`] set (zero: none).
pub fn socket_wait() -> Duration {
    Duration::from_millis(SOCKET_WAIT_MS.load(Ordering::Relaxed))
}
/// How often an external server's socket is tried while waiting.
const RETRY_EVERY: Duration = Duration::from_millis(10);

/// How the device process comes back.
#[derive(Clone, Debug)]
pub enum Reconnect {
    /// The VMM started it: `exe serve ARGS` again, on a new socket pair.
    Respawn { exe: PathBuf, args: Vec<String> },
    /// An external server: connect to `path` again, trying for up to `wait`.
    Socket { path: PathBuf, wait: Duration },
}

/// The arguments of `iopath serve` for `model` over `transport` on fd 3
/// (with the programs' own serve arguments): the first process's and each
/// respawned one's.
pub fn serve_args(progs: &Programs, model: &DeviceConfig, transport: &str) -> Vec<String> {
    [model.to_string(), "--transport".into(), transport.into(), "--fd".into(), CHILD_SOCKET_FD.to_string()]
        .into_iter()
        .chain(progs.serve_args.iter().cloned())
        .collect()
}

impl Reconnect {
    /// Reconnecting to the external server at `path`, bounded by
    /// [`socket_wait`] (None if it is 0: no reconnect).
    pub fn socket(path: impl Into<PathBuf>) -> Option<Self> {
        let wait = socket_wait();
        (!wait.is_zero()).then(|| Reconnect::Socket { path: path.into(), wait })
    }

    /// A new session's socket and, if the VMM starts it, its process.
    pub fn again(&self) -> Result<(UnixStream, Option<DeviceProcess>)> {
        match self {
            Reconnect::Respawn { exe, args } => {
                let (mine, theirs) = UnixStream::pair().map_err(|e| Error::io("socketpair", e))?;
                let child = DeviceProcess::spawn(exe, args, theirs.into())?;
                Ok((mine, Some(child)))
            }
            Reconnect::Socket { path, wait } => {
                let end = Instant::now() + *wait;
                loop {
                    match crate::attach::connect(path) {
                        Ok(s) => return Ok((s, None)),
                        Err(e) if Instant::now() >= end => {
                            return Err(Error::io(
                                format!("{} did not accept again within {wait:?}", path.display()),
                                e,
                            ))
                        }
                        Err(_) => std::thread::sleep(RETRY_EVERY),
                    }
                }
            }
        }
    }
}

/// Why the device process went away, for the log: its exit status or
/// signal (waited for up to 1 s; one still running after its socket closed
/// is killed), or "an external server" when the VMM did not start it.
pub fn death_cause(child: Option<DeviceProcess>) -> String {
    let Some(mut c) = child else { return "an external server closed its socket".into() };
    let pid = c.id();
    match c.exit_status(Duration::from_secs(1)) {
        Some(s) => format!("device process {pid} ended: {s}"),
        None => format!("device process {pid} closed its socket and still ran (killed)"),
    }
    // Dropped: killed if it still runs, and reaped.
}

/// [`death_cause`] on a thread of its own, so that the new process starts
/// while the dead one is still being reaped: a killed process becomes a
/// zombie only once all its threads (io_uring's workers among them) have
/// ended, which on a loaded host took up to 40 ms after its socket closed,
/// and nothing of the new session waits for it (the file fence,
/// `iopath_devices::block::fence`, waits for the dead process's file
/// operations itself). A process that closed its socket and still runs is
/// killed there after 1 s, as before: a new one waiting at the fence for it
/// is then let through.
pub struct Reaping {
    began: Instant,
    thread: std::result::Result<std::thread::JoinHandle<(String, Duration)>, String>,
}

impl Reaping {
    /// Starts reaping `child` (None: an external server, nothing to reap).
    /// If no thread can be started, the child is dropped at once (killed
    /// and reaped) and its cause is not told.
    pub fn start(child: Option<DeviceProcess>) -> Reaping {
        let began = Instant::now();
        let thread = std::thread::Builder::new()
            .name("device-reaper".into())
            .spawn(move || (death_cause(child), began.elapsed()))
            .map_err(|e| e.to_string());
        Reaping { began, thread }
    }

    /// The death's cause for the log, and how long after [`Self::start`] it
    /// was known (waits for the reaping thread: at most about 1 s).
    pub fn cause(self) -> (String, Duration) {
        match self.thread {
            Ok(h) => h
                .join()
                .unwrap_or_else(|_| ("the device process died (its reaper panicked)".into(), self.began.elapsed())),
            Err(e) => (format!("the device process died (no thread to reap it: {e})"), self.began.elapsed()),
        }
    }
}

/// At most `max` deaths within any `window`: a device process that dies
/// over and over (e.g. on a request it is given again each time) is given
/// up on, not restarted for ever.
pub struct Budget {
    max: usize,
    window: Duration,
    deaths: VecDeque<Instant>,
}

impl Budget {
    pub fn new(max: usize, window: Duration) -> Self {
        Budget { max, window, deaths: VecDeque::new() }
    }

    /// Counts a death at `now`; false if it is one more than the budget allows.
    pub fn spend(&mut self, now: Instant) -> bool {
        while self.deaths.front().is_some_and(|&t| now.saturating_duration_since(t) >= self.window) {
            self.deaths.pop_front();
        }
        if self.deaths.len() >= self.max {
            return false;
        }
        self.deaths.push_back(now);
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_budget_allows_max_deaths_per_window() {
        let mut b = Budget::new(3, Duration::from_secs(10));
        let t = Instant::now();
        assert!(b.spend(t) && b.spend(t + Duration::from_secs(1)) && b.spend(t + Duration::from_secs(2)));
        assert!(!b.spend(t + Duration::from_secs(3)), "a fourth within 10 s");
        // The first death left the window: room for one more.
        assert!(b.spend(t + Duration::from_secs(10)));
        assert!(!b.spend(t + Duration::from_secs(10)));
    }

    #[test]
    fn an_external_socket_that_never_comes_back_is_waited_for_a_bounded_time() {
        let dir = std::env::temp_dir().join(format!("iopath-respawn-{}", std::process::id()));
        let r = Reconnect::Socket { path: dir.join("none.sock"), wait: Duration::from_millis(50) };
        let e = r.again().err().expect("nobody listens").to_string();
        assert!(e.contains("did not accept again within 50ms"), "{e}");
    }

    #[test]
    fn an_external_socket_that_comes_back_is_connected_to() {
        let dir = std::env::temp_dir().join(format!("iopath-respawn-back-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("s.sock");
        let p = path.clone();
        let t = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(100));
            let l = std::os::unix::net::UnixListener::bind(&p).unwrap();
            l.accept().unwrap()
        });
        let r = Reconnect::Socket { path: path.clone(), wait: Duration::from_secs(10) };
        let (s, child) = r.again().expect("the listener came back");
        assert!(child.is_none());
        drop((s, t.join().unwrap()));
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_death_is_reaped_beside_the_caller_and_told_by_its_signal() {
        let (_mine, theirs) = UnixStream::pair().unwrap();
        let mut cmd = std::process::Command::new("/bin/sh");
        cmd.args(["-c", "kill -9 $$"]);
        let p = DeviceProcess::spawn_command(cmd, theirs.into()).unwrap();
        let (why, _) = Reaping::start(Some(p)).cause();
        assert!(why.contains("signal: 9"), "{why}");
        assert_eq!(Reaping::start(None).cause().0, "an external server closed its socket");
        // One that closed its socket and runs on is killed by the reaper (after 1 s).
        let (_mine, theirs) = UnixStream::pair().unwrap();
        let mut cmd = std::process::Command::new("/bin/sh");
        cmd.args(["-c", "exec 3>&-; exec sleep 30"]);
        let p = DeviceProcess::spawn_command(cmd, theirs.into()).unwrap();
        let pid = p.id();
        let (why, _) = Reaping::start(Some(p)).cause();
        assert!(why.contains(&format!("device process {pid} closed its socket and still ran (killed)")), "{why}");
    }

    #[test]
    fn a_death_is_told_by_its_signal() {
        let (_mine, theirs) = UnixStream::pair().unwrap();
        let mut cmd = std::process::Command::new("/bin/sh");
        cmd.args(["-c", "kill -9 $$"]);
        let p = DeviceProcess::spawn_command(cmd, theirs.into()).unwrap();
        let why = death_cause(Some(p));
        assert!(why.contains("signal: 9"), "{why}");
        assert_eq!(death_cause(None), "an external server closed its socket");
    }
}
