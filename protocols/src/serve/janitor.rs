//! Removing the socket file of `iopath serve --socket PATH` when the process
//! ends, however it ends.
//!
//! Once confined (`crate::seccomp`) the process may not remove a file, and
//! one killed by SIGKILL removes nothing. So as soon as the socket is bound,
//! before the confinement, [`Janitor::start`] forks a janitor: a small
//! process that keeps nothing of the server's (every fd closed but two
//! pipes), ignores the signals a terminal or a process group sends (SIGINT,
//! SIGTERM, SIGHUP, ...), sits in a session of its own, and waits for the
//! end of a pipe only the server holds. When the server ends (returns,
//! fails, panics, is killed by any signal) the pipe reads end of stream; the
//! janitor removes the path if it is still the socket the server bound (the
//! same device and inode: never a file put there since), closes its pipe
//! back and exits. It is forked twice, so it is nobody's child to wait for.
//!
//! So that the file is gone by the time the process is: [`Janitor`]'s drop
//! (the server's normal end and its error paths) and a handler for SIGINT,
//! SIGTERM and SIGHUP (installed only where they had their default action)
//! close the pipe and wait for the janitor's pipe back, at most
//! [`REMOVAL_WAIT`]; then the handler lets the signal end the process as it
//! would have. The handler makes only system calls every seccomp role
//! allows (close, poll, getpid, gettid, tgkill).
//!
//! The fork, in a process that may have threads: the two children make only
//! async-signal-safe calls (fork, setsid, signal, prctl, close_range or
//! close, read, lstat, unlink, _exit) on what the parent prepared before
//! (the path as a C string, the fds, the fd limit); the second fork is made
//! by a child that is alone. What it costs: the janitor shares the server's
//! pages as they were at the fork, copy-on-write, for as long as it lives,
//! so it is forked before the device is built (`serve::bind`), from a small
//! process. Being nobody's child, it is reaped by init (or the nearest
//! subreaper) when it exits. Its limits: a janitor killed itself (SIGKILL
//! to it, or to its cgroup with the server's) removes nothing, and the next
//! `iopath serve` on PATH replaces the stale socket left; and a server
//! killed with SIGKILL is gone before its file is (the janitor removes it
//! right after).

use std::ffi::CString;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, IntoRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};
use std::sync::Once;
use std::time::{Duration, Instant};

/// How long the server waits for its janitor to have removed the file.
pub(crate) const REMOVAL_WAIT: Duration = Duration::from_secs(2);

/// Janitors the signal handler reaches (one per listening socket of the
/// process; a janitor beyond them still removes its file, after the end).
const SLOTS: usize = 64;

struct Slot {
    used: AtomicBool,
    /// The write end of the janitor's wake-up pipe (-1: closed).
    wake: AtomicI32,
    /// The read end of its pipe back (-1: none).
    done: AtomicI32,
}

#[allow(clippy::declare_interior_mutable_const)]
const FREE: Slot = Slot { used: AtomicBool::new(false), wake: AtomicI32::new(-1), done: AtomicI32::new(-1) };
static TABLE: [Slot; SLOTS] = [FREE; SLOTS];

/// The server's side of one janitor: dropped, the janitor removes the file.
pub(crate) struct Janitor {
    /// Its slot in TABLE, which holds the wake-up pipe's write end.
    slot: Option<usize>,
    /// The write end, when the table was full.
    wake: Option<OwnedFd>,
    done: OwnedFd,
}

impl Janitor {
    /// Forks the janitor of the socket file at `path` (device `dev`, inode `ino`).
    pub(crate) fn start(path: &Path, dev: u64, ino: u64) -> io::Result<Janitor> {
        let c = CString::new(path.as_os_str().as_bytes())
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "a NUL byte in the path"))?;
        let (wake_r, wake_w) = pipe()?;
        let (done_r, done_w) = pipe()?;
        let max_fd = open_max();
        // SAFETY: fork(2). The child runs `janitor`, which makes only
        // async-signal-safe calls (this process may have other threads) on
        // what was prepared above, and never returns.
        let pid = unsafe { libc::fork() };
        if pid < 0 {
            return Err(io::Error::last_os_error());
        }
        if pid == 0 {
            // SAFETY: in the child of the fork, as said above.
            unsafe { janitor(&c, dev, ino, wake_r.as_raw_fd(), done_w.as_raw_fd(), max_fd) }
        }
        drop((wake_r, done_w));
        // The first child forks the janitor and exits at once.
        let mut status = 0;
        loop {
            // SAFETY: waitpid on our own child.
            let r = unsafe { libc::waitpid(pid, &mut status, 0) };
            if r == pid {
                if !libc::WIFEXITED(status) || libc::WEXITSTATUS(status) != 0 {
                    return Err(io::Error::other("its fork failed"));
                }
                break;
            }
            let e = io::Error::last_os_error();
            match e.raw_os_error() {
                Some(libc::EINTR) => {}
                Some(libc::ECHILD) => break, // SIGCHLD ignored: reaped already
                _ => return Err(e),
            }
        }
        install_handler();
        let w = wake_w.into_raw_fd();
        for (i, s) in TABLE.iter().enumerate() {
            if s.used.compare_exchange(false, true, Ordering::AcqRel, Ordering::Acquire).is_ok() {
                s.done.store(done_r.as_raw_fd(), Ordering::Release);
                s.wake.store(w, Ordering::Release);
                return Ok(Janitor { slot: Some(i), wake: None, done: done_r });
            }
        }
        // SAFETY: `w` came from into_raw_fd above and nothing else owns it.
        let wake = Some(unsafe { OwnedFd::from_raw_fd(w) });
        Ok(Janitor { slot: None, wake, done: done_r })
    }
}

impl Drop for Janitor {
    /// Wakes the janitor and waits (bounded) until it has removed the file.
    fn drop(&mut self) {
        let mut p = [libc::pollfd { fd: self.done.as_raw_fd(), events: libc::POLLIN, revents: 0 }];
        match self.slot {
            Some(i) => {
                let s = &TABLE[i];
                let w = s.wake.swap(-1, Ordering::AcqRel);
                if w >= 0 {
                    // SAFETY: the slot owned `w`; the swap made it ours alone.
                    unsafe { libc::close(w) };
                }
                wait_closed(&mut p);
                s.done.store(-1, Ordering::Release);
                s.used.store(false, Ordering::Release);
            }
            None => {
                drop(self.wake.take());
                wait_closed(&mut p);
            }
        }
    }
}

fn pipe() -> io::Result<(OwnedFd, OwnedFd)> {
    let mut fds = [0; 2];
    // SAFETY: pipe2 into an array of two.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: two new fds nothing else owns.
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}

/// One past the highest fd this process may have (for closing them all
/// where close_range(2) is missing).
fn open_max() -> u32 {
    let mut l = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit into a local.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut l) } != 0 {
        return 1 << 16;
    }
    l.rlim_cur.min(1 << 20) as u32
}

/// Polls `fds` until each has hung up (or errs), for at most
/// [`REMOVAL_WAIT`]. Async-signal-safe: no allocation, poll and the clock.
fn wait_closed(fds: &mut [libc::pollfd]) {
    let end = Instant::now() + REMOVAL_WAIT;
    loop {
        let left = end.saturating_duration_since(Instant::now());
        if fds.iter().all(|p| p.fd < 0) || left.is_zero() {
            return;
        }
        // SAFETY: poll on a caller's array of its length.
        let r = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, left.as_millis() as i32 + 1) };
        if r > 0 {
            for p in fds.iter_mut() {
                // The janitor never writes: any event is its end.
                if p.revents != 0 {
                    p.fd = -1;
                    p.revents = 0;
                }
            }
        }
    }
}

const SIGNALS: [libc::c_int; 3] = [libc::SIGINT, libc::SIGTERM, libc::SIGHUP];

/// The handler of [`SIGNALS`], where they had their default action.
fn install_handler() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        for sig in SIGNALS {
            // SAFETY: sigaction with zeroed structs (valid), reading the
            // current action first; the handler is async-signal-safe.
            unsafe {
                let mut old: libc::sigaction = std::mem::zeroed();
                if libc::sigaction(sig, std::ptr::null(), &mut old) != 0 || old.sa_sigaction != libc::SIG_DFL {
                    continue; // the program handles or ignores it: its choice
                }
                let mut sa: libc::sigaction = std::mem::zeroed();
                sa.sa_sigaction = on_signal as *const () as usize;
                sa.sa_flags = libc::SA_RESETHAND;
                libc::sigemptyset(&mut sa.sa_mask);
                for s in SIGNALS {
                    libc::sigaddset(&mut sa.sa_mask, s);
                }
                libc::sigaction(sig, &sa, std::ptr::null_mut());
            }
        }
    });
}

/// Wakes every janitor, waits (bounded) until their files are removed,
/// then lets `sig` end the process: SA_RESETHAND gave it back its default
/// action on entry, and it is blocked until this returns.
extern "C" fn on_signal(sig: libc::c_int) {
    let mut p = [libc::pollfd { fd: -1, events: libc::POLLIN, revents: 0 }; SLOTS];
    for (s, q) in TABLE.iter().zip(p.iter_mut()) {
        let w = s.wake.swap(-1, Ordering::AcqRel);
        if w >= 0 {
            // SAFETY: the swap made `w` ours alone; close is async-signal-safe.
            unsafe { libc::close(w) };
            q.fd = s.done.load(Ordering::Acquire);
        }
    }
    wait_closed(&mut p);
    // SAFETY: a signal to this very thread; async-signal-safe calls.
    unsafe { libc::syscall(libc::SYS_tgkill, libc::getpid(), libc::gettid(), sig) };
}

/// The first child: forks the janitor and exits (so nobody waits for the
/// janitor, which init reaps). The janitor: see the module doc.
///
/// # Safety
/// Only in the child of a fork; makes only async-signal-safe calls on
/// what the parent prepared, and never returns.
unsafe fn janitor(path: &CString, dev: u64, ino: u64, wake: RawFd, done: RawFd, max_fd: u32) -> ! {
    // SAFETY: (the caller's contract) this is the child of a fork, alone in
    // its process: the calls below are async-signal-safe and act on what the
    // parent prepared: `path`, a NUL-terminated string the parent made
    // before the fork (this copy of its memory is ours), the fds `wake` and
    // `done`, which this process holds, and a zeroed `stat` on this stack
    // (plain data, every bit pattern valid) that lstat fills; errno's
    // address is this thread's, valid while it runs. `close_all_but`'s
    // contract holds: this is the janitor.
    unsafe {
        let pid = libc::fork();
        if pid != 0 {
            libc::_exit(if pid > 0 { 0 } else { 1 });
        }
        libc::setsid();
        for sig in [
            libc::SIGINT,
            libc::SIGTERM,
            libc::SIGHUP,
            libc::SIGQUIT,
            libc::SIGPIPE,
            libc::SIGTSTP,
            libc::SIGTTIN,
            libc::SIGTTOU,
            libc::SIGUSR1,
            libc::SIGUSR2,
        ] {
            libc::signal(sig, libc::SIG_IGN);
        }
        libc::prctl(libc::PR_SET_NAME, c"serve-janitor".as_ptr());
        close_all_but(wake, done, max_fd);
        let mut b = [0u8; 1];
        loop {
            let r = libc::read(wake, b.as_mut_ptr().cast(), 1);
            if r == 0 || (r < 0 && *libc::__errno_location() != libc::EINTR) {
                break;
            }
        }
        let mut st: libc::stat = std::mem::zeroed();
        if libc::lstat(path.as_ptr(), &mut st) == 0
            && st.st_mode & libc::S_IFMT == libc::S_IFSOCK
            && (st.st_dev, st.st_ino) == (dev, ino)
        {
            libc::unlink(path.as_ptr());
        }
        libc::_exit(0)
    }
}

/// Closes every fd but `a` and `b`.
///
/// # Safety
/// In the janitor only: other owners of these fds are in another process.
unsafe fn close_all_but(a: RawFd, b: RawFd, max_fd: u32) {
    let (lo, hi) = (a.min(b) as u32, a.max(b) as u32);
    let mut ranges = [(0, lo.wrapping_sub(1)), (lo + 1, hi.wrapping_sub(1)), (hi + 1, u32::MAX)];
    if lo == 0 {
        ranges[0] = (1, 0); // empty
    }
    for (first, last) in ranges {
        if first > last {
            continue;
        }
        // SAFETY: (the caller's contract) in the janitor, whose fds but `a`
        // and `b` no code of this process uses: closing them (or a number
        // that is no open fd, EBADF) frees no memory and breaks no owner.
        unsafe {
            if libc::syscall(libc::SYS_close_range, first, last, 0) != 0 {
                for fd in first..=last.min(max_fd) {
                    libc::close(fd as RawFd);
                }
            }
        }
    }
}
