//! seccomp for `iopath serve`: once the device process is set up (device
//! built, backend file open, socket bound or inherited), [`install`] takes
//! file system access by path away ([`crate::landlock`]) and confines every
//! thread to the system calls of the [`Session`](Role::Session) role
//! (TSYNC), and each thread a device process starts narrows itself to its
//! own role when it calls [`sandbox::enter`](iopath_devices::sandbox::enter)
//! (filters stack; the strictest answer wins).
//!
//! The allow-lists come from what the code calls, checked with `strace -f`
//! on the test suites and the benchmark, with stderr a terminal and not:
//! Rust's runtime and glibc (memory, futexes, thread start and exit), the
//! session (messages with fds, DMA maps, eventfds, region socket pairs, the
//! fd count from a `/proc/self/fd` opened before, [`crate::nopath`]),
//! device threads (eventfds, epoll, a file namespace's io_uring, whose
//! ring was restricted to the namespace's own operations when it was made,
//! pread/pwrite, and fallocate for discard and write zeroes). Arguments are checked where that is cheap and means
//! something: no executable memory, `clone` only for threads (`clone3`
//! answers ENOSYS, so glibc falls back to `clone`), `socketpair` only
//! AF_UNIX, signals only to this process, no SIGSYS handler but ours,
//! SIGBUS's handler changed only to the default (the SIGBUS handler's miss,
//! `crate::sigbus`), `shutdown` outside session and region threads only
//! SHUT_RD (the SIGBUS handler's wake-up), `io_uring_register` only to
//! update a buffer. No `execve`, `socket`, `connect`, `ptrace`, `ioctl`,
//! `io_uring_setup`, and no system call that takes a path in any role:
//! no open, stat, statx, access, readlink, ... (an fd's `fstat` is the raw
//! system call: [`crate::nopath::fstat`]).
//!
//! What the runtime would otherwise do by path or on a terminal after
//! setup is done or decided before it: glibc's heap trimming and arena
//! limit (below), the host's shmem settings, the panic message (no
//! backtrace; a panic then ends the process with 101), and the logger's colours (decided once when it is made, in
//! the binary: no terminal check per line).
//!
//! A forbidden call raises SIGSYS: the handler writes one line
//! ("iopath serve: seccomp: forbidden syscall N in thread NAME (role R)")
//! to stderr and the process dies of SIGSYS (the handler resets itself on
//! entry and re-sends the signal to its thread; a second forbidden call in
//! the handler would be fatal the same way, as the kernel forces a blocked
//! SIGSYS). A call made while SIGSYS is blocked (glibc blocks every signal
//! around `clone`) dies of SIGSYS without the line. Threads started before
//! [`install`] keep the session's filter: their `enter` found no hook yet.
//! A panic prints its message without a backtrace (which would open files).

use crate::{Error, Result};
use iopath_devices::sandbox::{self, Role};
use seccompiler::{
    BpfProgram, SeccompAction, SeccompCmpArgLen as Len, SeccompCmpOp as Op, SeccompCondition as Cond, SeccompFilter,
    SeccompRule,
};
use std::cell::Cell;
use std::collections::BTreeMap;
use std::io::Write;
use std::sync::OnceLock;

type Rules = BTreeMap<i64, Vec<SeccompRule>>;

/// Each role's compiled filter, set once by [`install`].
static FILTERS: OnceLock<Vec<(Role, BpfProgram)>> = OnceLock::new();

thread_local! {
    /// The role this thread entered (1 + its index in `Role::ALL`; 0: none), for the SIGSYS line.
    static ROLE: Cell<u8> = const { Cell::new(0) };
}

/// `arg` (32 bits) compared with `v`.
fn cond(arg: u8, op: Op, v: u64) -> Cond {
    Cond::new(arg, Len::Dword, op, v).expect("argument index below 6")
}

fn rule(conds: Vec<Cond>) -> SeccompRule {
    SeccompRule::new(conds).expect("a rule with conditions")
}

/// Allows each of `nrs` whatever its arguments.
fn any(r: &mut Rules, nrs: &[i64]) {
    for &n in nrs {
        r.insert(n, Vec::new());
    }
}

/// Allows `nr` when one of `rules` holds (unless it is already allowed outright).
fn when(r: &mut Rules, nr: i64, rules: Vec<SeccompRule>) {
    let e = r.entry(nr).or_insert_with(|| rules.clone());
    if !e.is_empty() && *e != rules {
        e.extend(rules);
    }
}

/// `arg` takes one of `values`.
fn one_of(arg: u8, values: &[u64]) -> Vec<SeccompRule> {
    values.iter().map(|&v| rule(vec![cond(arg, Op::Eq, v)])).collect()
}

/// What every thread needs: memory, futexes, time, its own exit, eventfd
/// and socket reads and writes it was handed, logging, the SIGSYS handler.
fn base(r: &mut Rules, pid: u32) {
    use libc::*;
    any(
        r,
        &[
            SYS_read,
            SYS_write,
            SYS_readv,
            SYS_writev,
            SYS_recvfrom,
            SYS_sendto,
            SYS_close,
            SYS_poll,
            SYS_ppoll,
            SYS_futex,
            SYS_sched_yield,
            SYS_nanosleep,
            SYS_clock_nanosleep,
            SYS_clock_gettime,
            SYS_gettimeofday,
            SYS_getrandom,
            SYS_brk,
            SYS_munmap,
            SYS_mremap,
            SYS_madvise,
            SYS_rt_sigreturn,
            SYS_rt_sigprocmask,
            SYS_sigaltstack,
            SYS_restart_syscall,
            SYS_exit,
            SYS_exit_group,
            SYS_getpid,
            SYS_gettid,
        ],
    );
    let no_exec = || vec![rule(vec![cond(2, Op::MaskedEq(PROT_EXEC as u64), 0)])];
    // A thread that reads a message the peer sends in pieces waits for the rest
    // as long as the socket's read timeout says (socket::recv_rest asks for it).
    when(r, SYS_getsockopt, vec![rule(vec![cond(1, Op::Eq, SOL_SOCKET as u64), cond(2, Op::Eq, SO_RCVTIMEO as u64)])]);
    when(r, SYS_mmap, no_exec());
    when(r, SYS_mprotect, no_exec());
    // PR_SET_TIMERSLACK: the NVMe adaptive poller's timed wake-ups (its own thread's slack).
    when(r, SYS_prctl, one_of(0, &[PR_GET_NAME as u64, PR_SET_NAME as u64, PR_SET_TIMERSLACK as u64]));
    // abort() and the SIGSYS handler signal their own thread; nobody else.
    when(r, SYS_tgkill, vec![rule(vec![cond(0, Op::Eq, pid as u64)])]);
    // F_GETFD/F_GETFL (std checks an fd it is handed), F_DUPFD_CLOEXEC (try_clone),
    // F_OFD_SETLK (a file storage's lock, which a resumed device waits at:
    // devices/src/block/fence.rs).
    when(r, SYS_fcntl, one_of(1, &[F_GETFD as u64, F_GETFL as u64, F_DUPFD_CLOEXEC as u64, F_OFD_SETLK as u64]));
    // The SIGBUS handler (`crate::sigbus`), in whatever thread faults on client
    // memory its client shrank: mmap of zero pages (no PROT_EXEC, above),
    // shutdown of the session socket for reading, write, rt_sigreturn; on a
    // fault outside client memory, the default action back (SIGBUS only) and
    // tgkill to itself.
    when(r, SYS_shutdown, one_of(1, &[SHUT_RD as u64]));
    when(r, SYS_rt_sigaction, one_of(0, &[SIGBUS as u64]));
}

/// Device threads: epoll waits, and the block storage's I/O (NVMe's
/// queues, virtio-blk's requests): io_uring, pread/pwrite, fdatasync, and
/// fallocate (discard and write zeroes punch holes or zero ranges).
fn device(r: &mut Rules, pid: u32) {
    use libc::*;
    base(r, pid);
    any(
        r,
        &[
            SYS_epoll_wait,
            SYS_epoll_pwait,
            SYS_io_uring_enter,
            SYS_pread64,
            SYS_pwrite64,
            SYS_preadv,
            SYS_pwritev,
            SYS_fdatasync,
            SYS_fsync,
            SYS_fallocate,
        ],
    );
    // A file namespace registers a slot's bounce buffer at its first use
    // (the one registration its ring's restrictions allow).
    let update = iopath_devices::block::IORING_REGISTER_BUFFERS_UPDATE as u64;
    when(r, SYS_io_uring_register, one_of(1, &[update]));
}

/// Starting threads (a BAR access may start device threads): the clone
/// itself, what glibc and std do in the new thread before it narrows, and
/// the narrowing.
fn spawn(r: &mut Rules) {
    use libc::*;
    when(r, SYS_clone, vec![rule(vec![cond(0, Op::MaskedEq(CLONE_THREAD as u64), CLONE_THREAD as u64)])]);
    any(r, &[SYS_clone3, SYS_set_robust_list, SYS_rseq, SYS_sched_getaffinity]);
    when(r, SYS_prctl, one_of(0, &[PR_SET_NO_NEW_PRIVS as u64]));
    when(r, SYS_seccomp, one_of(0, &[SECCOMP_SET_MODE_FILTER as u64]));
    // glibc installs its cancellation handler at the first thread start; SIGSYS stays ours.
    when(r, SYS_rt_sigaction, vec![rule(vec![cond(0, Op::Ne, SIGSYS as u64)])]);
}

/// A region thread: a device thread that may also start threads and make
/// eventfds and epolls (what a BAR write does: NVMe enable, doorbell modes).
fn region(r: &mut Rules, pid: u32) {
    use libc::*;
    device(r, pid);
    spawn(r);
    // shutdown: a region thread ends its channel both ways when it stops,
    // so that a client holding a copy of the fd reads EOF.
    any(r, &[SYS_eventfd2, SYS_epoll_create1, SYS_epoll_ctl, SYS_shutdown]);
    when(r, SYS_fcntl, one_of(1, &[F_SETFL as u64, F_SETFD as u64]));
}

/// The session: the union of all roles, and the client's socket with fds,
/// DMA maps (mmap of the fds it sends, fstat and fstatfs of them: length,
/// huge pages or not), region socket pairs, the acceptor's socket options,
/// and the fd budget's listing of the `/proc/self/fd` opened before
/// (lseek, getdents64: [`crate::nopath::open_fds`]).
fn session(r: &mut Rules, pid: u32) {
    use libc::*;
    region(r, pid);
    any(
        r,
        &[
            SYS_accept,
            SYS_accept4,
            SYS_recvmsg,
            SYS_sendmsg,
            SYS_shutdown,
            SYS_getsockopt,
            SYS_setsockopt,
            SYS_getsockname,
            SYS_getpeername,
            SYS_fstat,
            SYS_fstatfs,
            SYS_lseek,
            SYS_getdents64,
            SYS_dup,
            SYS_dup3,
        ],
    );
    when(r, SYS_socketpair, one_of(0, &[AF_UNIX as u64]));
    when(r, SYS_fcntl, one_of(1, &[F_GET_SEALS as u64, F_ADD_SEALS as u64]));
    // Each client's own doorbell page (NVMe's BAR0 memfd, made at session
    // start so that nothing an earlier client mapped is shared): a sealable
    // memfd, no huge pages, its size set once, then sealed.
    when(r, SYS_memfd_create, one_of(1, &[(MFD_CLOEXEC | MFD_ALLOW_SEALING) as u64]));
    any(r, &[SYS_ftruncate]);
    // getrlimit: prlimit64(0, resource, NULL, old).
    when(r, SYS_prlimit64, vec![rule(vec![cond(0, Op::Eq, 0), Cond::new(2, Len::Qword, Op::Eq, 0).unwrap()])]);
}

/// The system calls `role` may make, with their argument rules.
fn rules(role: Role, pid: u32) -> Rules {
    let mut r = Rules::new();
    match role {
        Role::Session => session(&mut r, pid),
        Role::Region => region(&mut r, pid),
        Role::Reader => {
            base(&mut r, pid);
            any(&mut r, &[libc::SYS_recvmsg]);
        }
        Role::Device => device(&mut r, pid),
        Role::Irq => base(&mut r, pid),
    }
    r
}

fn arch() -> Result<seccompiler::TargetArch> {
    std::env::consts::ARCH.try_into().map_err(|e| Error::io("seccomp", std::io::Error::other(e)))
}

/// The filter of `role`: its allow-list, SIGSYS for anything else.
fn compile(role: Role, pid: u32) -> Result<BpfProgram> {
    let f = SeccompFilter::new(rules(role, pid), SeccompAction::Trap, SeccompAction::Allow, arch()?)
        .map_err(|e| Error::io(format!("seccomp filter of the {} role", role.name()), std::io::Error::other(e)))?;
    f.try_into().map_err(|e: seccompiler::BackendError| Error::io("seccomp filter", std::io::Error::other(e)))
}

/// `clone3` answers ENOSYS: its flags are out of a filter's reach, and
/// glibc then starts threads with `clone`, whose flags are checked.
fn clone3_enosys() -> Result<BpfProgram> {
    let r: Rules = [(libc::SYS_clone3, Vec::new())].into_iter().collect();
    let f = SeccompFilter::new(r, SeccompAction::Allow, SeccompAction::Errno(libc::ENOSYS as u32), arch()?)
        .map_err(|e| Error::io("seccomp filter for clone3", std::io::Error::other(e)))?;
    f.try_into().map_err(|e: seccompiler::BackendError| Error::io("seccomp filter", std::io::Error::other(e)))
}

/// Confines the process: the SIGSYS handler, the session filter on every
/// thread, and the hook that narrows each thread to its role. Once per
/// process; after it no thread can widen what it may do.
pub fn install() -> Result<()> {
    let pid = std::process::id();
    let filters = Role::ALL.iter().map(|&r| Ok((r, compile(r, pid)?))).collect::<Result<Vec<_>>>()?;
    let clone3 = clone3_enosys()?;
    if FILTERS.set(filters).is_err() {
        return Err(Error::Config("seccomp: the filters are installed already".into()));
    }
    on_sigsys()?;
    // Before any client memory is mapped and while sigaction is allowed in any thread.
    crate::sigbus::install()?;
    // Whether a DMA map's memfd is in huge pages depends on the host's
    // shmem settings, files no thread may open once confined.
    iopath_devices::hugepages::settings();
    // The fd budget's /proc/self/fd, opened while opening is allowed.
    crate::nopath::prepare().map_err(|e| Error::io("opening /proc/self/fd", e))?;
    // glibc reads /proc/sys/vm/overcommit_memory (an open by path) the first
    // time it shrinks a thread's heap, which may be in any thread after this.
    // A trim threshold above any heap's size (64 MiB) means no heap is ever
    // shrunk: a thread's freed memory stays with its arena for reuse, up to
    // the process's peak (whole heaps still go back to the system).
    // Likewise glibc works out its arena limit from the CPU count (reading
    // /sys) when it makes its ninth arena: set it now, to glibc's own
    // default (8 per CPU).
    let arenas = std::thread::available_parallelism().map_or(8, |n| n.get().saturating_mul(8)).min(1024) as i32;
    for (param, value, name) in
        [(libc::M_TRIM_THRESHOLD, i32::MAX, "M_TRIM_THRESHOLD"), (libc::M_ARENA_MAX, arenas, "M_ARENA_MAX")]
    {
        // SAFETY: mallopt only sets a malloc parameter.
        if unsafe { libc::mallopt(param, value) } != 1 {
            return Err(Error::Config(format!("seccomp: mallopt({name}) refused")));
        }
    }
    // The default panic hook's backtrace (RUST_BACKTRACE) opens files: a
    // thread that panics says why, without one. Then the process ends (101,
    // a panicking main's status; exit_group is in every role's list), as the
    // binary's own hook ends it unconfined: a panic is a bug, and the device
    // state it was changing may be half updated, so nothing serves on it
    // (nor unwinds through it: no lock is left poisoned for a live thread).
    std::panic::set_hook(Box::new(|info| {
        let t = std::thread::current();
        let name = t.name().unwrap_or("<unnamed>");
        let _ = writeln!(std::io::stderr(), "thread '{name}' {info} (no backtrace under seccomp)");
        // SAFETY: _exit(2) ends the process at once; it touches no memory of ours.
        unsafe { libc::_exit(101) };
    }));
    let apply = |bpf: &BpfProgram| {
        seccompiler::apply_filter_all_threads(bpf).map_err(|e| Error::io("seccomp", std::io::Error::other(e)))
    };
    // No file system access by path from here on (the filters below refuse
    // the calls too; Landlock also covers what they let through: an
    // io_uring operation, a thread started before them).
    crate::landlock::deny_all()?;
    apply(&FILTERS.get().expect("set above")[0].1)?;
    apply(&clone3)?;
    ROLE.with(|c| c.set(1));
    sandbox::set_hook(narrow);
    Ok(())
}

/// The hook: narrows the calling thread to `role`. A filter that cannot be
/// applied ends the process rather than leave the thread wider than meant.
fn narrow(role: Role) {
    let idx = Role::ALL.iter().position(|&r| r == role).unwrap_or(0);
    ROLE.with(|c| c.set(idx as u8 + 1));
    if role == Role::Session {
        return; // the process filter is the session's
    }
    let Some((_, bpf)) = FILTERS.get().and_then(|f| f.get(idx)) else { return };
    if let Err(e) = seccompiler::apply_filter(bpf) {
        eprintln!("iopath serve: seccomp: cannot narrow a thread to the {} role: {e}", role.name());
        std::process::abort();
    }
}

fn on_sigsys() -> Result<()> {
    // SAFETY: an all-zero sigaction is valid; the handler is async-signal-safe.
    unsafe {
        let mut sa: libc::sigaction = std::mem::zeroed();
        sa.sa_sigaction = sigsys as *const () as usize;
        sa.sa_flags = libc::SA_SIGINFO | libc::SA_RESETHAND;
        libc::sigemptyset(&mut sa.sa_mask);
        if libc::sigaction(libc::SIGSYS, &sa, std::ptr::null_mut()) != 0 {
            return Err(Error::io("seccomp: SIGSYS handler", std::io::Error::last_os_error()));
        }
    }
    Ok(())
}

/// A small line buffer for the handler (no allocation).
struct Line {
    buf: [u8; 160],
    len: usize,
}

impl Line {
    fn push(&mut self, s: &[u8]) {
        for &b in s {
            if b == 0 || self.len == self.buf.len() {
                return;
            }
            self.buf[self.len] = b;
            self.len += 1;
        }
    }
    fn num(&mut self, mut n: u32) {
        let mut d = [0u8; 10];
        let mut i = d.len();
        loop {
            i -= 1;
            d[i] = b'0' + (n % 10) as u8;
            n /= 10;
            if n == 0 {
                break;
            }
        }
        self.push(&d[i..]);
    }
}

/// The SIGSYS handler (SA_RESETHAND: SIGSYS is fatal again from here on).
/// Uses only system calls every role allows: prctl(PR_GET_NAME), write,
/// getpid, gettid, tgkill, rt_sigprocmask, exit_group.
extern "C" fn sigsys(_sig: libc::c_int, info: *mut libc::siginfo_t, _ctx: *mut libc::c_void) {
    let mut l = Line { buf: [0; 160], len: 0 };
    l.push(b"iopath serve: seccomp: forbidden syscall ");
    // SAFETY: for SIGSYS the kernel fills `_sigsys`: {void *call_addr; int syscall; unsigned arch},
    // the union starting 16 bytes in on 64-bit Linux, so `syscall` is at byte 24.
    let nr = unsafe { info.cast::<u8>().add(24).cast::<i32>().read_unaligned() };
    l.num(nr as u32);
    l.push(b" in thread ");
    let mut name = [0u8; 16];
    // SAFETY: PR_GET_NAME writes at most 16 bytes, NUL included, into `name`.
    unsafe { libc::prctl(libc::PR_GET_NAME, name.as_mut_ptr()) };
    l.push(&name);
    let role = ROLE.with(|c| c.get());
    if let Some(r) = role.checked_sub(1).and_then(|i| Role::ALL.get(i as usize)) {
        l.push(b" (role ");
        l.push(r.name().as_bytes());
        l.push(b")");
    }
    l.push(b"\n");
    // SAFETY: write, getpid, gettid, tgkill and sigprocmask are async-signal-safe; the buffer is ours.
    unsafe {
        libc::write(2, l.buf.as_ptr().cast(), l.len);
        // The handler was reset on entry: a SIGSYS now is fatal once it is unblocked.
        libc::syscall(libc::SYS_tgkill, libc::getpid(), libc::gettid(), libc::SIGSYS);
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGSYS);
        libc::pthread_sigmask(libc::SIG_UNBLOCK, &set, std::ptr::null_mut());
        libc::_exit(128 + libc::SIGSYS);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use libc::*;

    /// No role makes these: processes, network sockets, tracing, terminal
    /// and device ioctls, new io_urings, and every call that takes a path.
    const FORBIDDEN_EVERYWHERE: [i64; 48] = [
        SYS_execve,
        SYS_execveat,
        SYS_fork,
        SYS_vfork,
        SYS_socket,
        SYS_connect,
        SYS_bind,
        SYS_listen,
        SYS_ptrace,
        SYS_ioctl,
        SYS_io_uring_setup,
        SYS_open,
        SYS_openat,
        SYS_openat2,
        SYS_creat,
        SYS_open_by_handle_at,
        SYS_name_to_handle_at,
        SYS_stat,
        SYS_lstat,
        SYS_newfstatat,
        SYS_statx,
        SYS_statfs,
        SYS_access,
        SYS_faccessat,
        SYS_faccessat2,
        SYS_readlink,
        SYS_readlinkat,
        SYS_getcwd,
        SYS_chdir,
        SYS_chroot,
        SYS_mkdir,
        SYS_mkdirat,
        SYS_mknod,
        SYS_mknodat,
        SYS_unlink,
        SYS_unlinkat,
        SYS_rmdir,
        SYS_rename,
        SYS_renameat2,
        SYS_link,
        SYS_linkat,
        SYS_symlink,
        SYS_symlinkat,
        SYS_truncate,
        SYS_chmod,
        SYS_fchmodat,
        SYS_utimensat,
        SYS_mount,
    ];

    /// A thread starts under its parent's filters and narrows itself: every
    /// role a session or region thread may start must fit in the
    /// starter's filter, and the session's is the process's.
    #[test]
    fn each_role_fits_in_the_roles_that_start_it() {
        let fits = |inner: Role, outer: Role| {
            let (i, o) = (rules(inner, 1), rules(outer, 1));
            for (nr, ri) in &i {
                let ro = o.get(nr).unwrap_or_else(|| panic!("{inner:?}: syscall {nr} not in {outer:?}"));
                assert!(
                    ro.is_empty() || ri.iter().all(|r| ro.contains(r)),
                    "{inner:?}: syscall {nr} narrower in {outer:?}"
                );
            }
        };
        for r in Role::ALL {
            fits(r, Role::Session);
        }
        for r in [Role::Device, Role::Irq, Role::Region] {
            fits(r, Role::Region);
        }
        for r in Role::ALL {
            compile(r, 1).unwrap();
        }
        // Only the session's list need be checked: every role fits in it.
        let s = rules(Role::Session, 1);
        for nr in FORBIDDEN_EVERYWHERE {
            assert!(!s.contains_key(&nr), "syscall {nr} allowed");
        }
    }
}
