//! `iopath serve`'s seccomp filters: a child process (this binary run
//! again) installs them with the function serve uses (`seccomp::install`),
//! then makes one system call from a thread of some role. Forbidden calls must end the child with
//! SIGSYS and the handler's line on stderr; allowed ones must not.

use iopath_devices::sandbox::{enter, Role};
use iopath_protocols::function::{map_region, MappedRegion, SharedRegion};
use iopath_protocols::sigbus::Owner;
use std::fs::File;
use std::io::Read;
use std::os::fd::{AsRawFd, FromRawFd};
use std::os::unix::net::UnixStream;
use std::os::unix::process::ExitStatusExt;
use std::sync::{Arc, OnceLock};
use vmm_sys_util::eventfd::EventFd;

/// An eventfd the child makes as a session would, for its threads to use.
static EVENT: OnceLock<EventFd> = OnceLock::new();

/// Memory a client shrank, made before the filters as a session makes it
/// (memfd_create and ftruncate are the client's, not the session's): a
/// client mapping registered with the SIGBUS handler, its owner's session
/// socket, and a mapping nobody registered.
struct Shrunk {
    client: MappedRegion,
    owner: Arc<Owner>,
    session: UnixStream,
    _client_end: UnixStream,
    stray: *const u8,
}

// SAFETY: `stray` is a mapping that lives as long as the process; the rest is Send and Sync.
unsafe impl Send for Shrunk {}
// SAFETY: as above.
unsafe impl Sync for Shrunk {}

static SHRUNK: OnceLock<Shrunk> = OnceLock::new();

fn shrunk_memory() -> Shrunk {
    let memfd = || {
        // SAFETY: memfd_create with a C string; the fd is owned by the File.
        let f = unsafe { File::from_raw_fd(libc::memfd_create(c"iopath-seccomp-sigbus".as_ptr(), 0)) };
        f.set_len(0x2000).unwrap();
        f
    };
    let (session, client_end) = UnixStream::pair().unwrap();
    let owner = Owner::new(Some(&session)).unwrap();
    let client = map_region(SharedRegion { gpa: 0, size: 0x2000, offset: 0, file: memfd() }, &owner).unwrap();
    client.region.file_offset().unwrap().file().set_len(0).unwrap();
    let f = memfd();
    // SAFETY: a fresh shared mapping of our memfd, never unmapped.
    let stray =
        unsafe { libc::mmap(std::ptr::null_mut(), 0x2000, libc::PROT_READ, libc::MAP_SHARED, f.as_raw_fd(), 0) };
    f.set_len(0).unwrap();
    Shrunk { client, owner, session, _client_end: client_end, stray: stray as *const u8 }
}

/// A load from the client's truncated memory: the handler replaces the
/// mapping (zero pages) under the filter; 0 if it did, and woke the session.
fn touch_shrunk_client_memory() -> i32 {
    let s = SHRUNK.get().unwrap();
    // SAFETY: inside the mapping, which `s.client` keeps mapped.
    let v = unsafe { std::ptr::read_volatile(s.client.guard.as_ptr().add(0x1008)) };
    let mut b = [0u8; 1];
    let woke = (&s.session).read(&mut b).ok() == Some(0);
    (v != 0 || !s.client.poisoned() || !s.owner.poisoned() || !woke) as i32
}

/// A load from a truncated mapping no client gave: fatal, SIGBUS.
fn touch_stray_memory() -> i32 {
    // SAFETY: a mapping of the process's own; the load faults (the file is empty).
    unsafe { std::ptr::read_volatile(SHRUNK.get().unwrap().stray) as i32 }
}

/// How a child ended, and what it wrote on stderr.
#[derive(Debug)]
enum End {
    Exit(i32),
    Signal(i32),
}

/// Where the child finds its case: "ROLE:OFFSET", the role's index in
/// `Role::ALL` (or "-" for the main thread) and the case function's offset
/// from [`anchor`] in this same binary.
const CASE: &str = "IOPATH_SECCOMP_CASE";

/// A function whose address the case functions are found from.
fn anchor() -> i32 {
    0
}

/// Runs `f` in a fresh process, this test binary run again for
/// [`seccomp_case`]: it installs the filters, runs `f` (on a thread that
/// entered `role`, or the main thread for `None`) and exits with its code.
/// Not a fork: a child forked from this multi-threaded process may inherit
/// a lock another test thread held (std's thread registry) and hang on its
/// first thread.
fn child(role: Option<Role>, f: fn() -> i32) -> (End, String) {
    let offset = (f as usize).wrapping_sub(anchor as fn() -> i32 as usize);
    let role = role.map_or("-".to_string(), |r| Role::ALL.iter().position(|&x| x == r).unwrap().to_string());
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "seccomp_case", "--nocapture", "--test-threads=1"])
        .env(CASE, format!("{role}:{offset}"))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr).to_string();
    let end = match (out.status.code(), out.status.signal()) {
        (Some(c), _) => End::Exit(c),
        (None, Some(s)) => End::Signal(s),
        (None, None) => unreachable!("a process ends with a code or a signal"),
    };
    (end, err)
}

/// The child's side of [`child`]; does nothing in a normal test run.
#[test]
fn seccomp_case() {
    let Ok(case) = std::env::var(CASE) else { return };
    let (role, offset) = case.split_once(':').unwrap();
    let role = role.parse::<usize>().ok().map(|i| Role::ALL[i]);
    // SAFETY: `offset` is a case function's distance from `anchor` in this
    // same binary, as the parent computed it: the address of that function.
    let f = unsafe {
        std::mem::transmute::<usize, fn() -> i32>(
            (anchor as fn() -> i32 as usize).wrapping_add(offset.parse().unwrap()),
        )
    };
    // SAFETY: no core file for the deaths meant here.
    unsafe { libc::setrlimit(libc::RLIMIT_CORE, &libc::rlimit { rlim_cur: 0, rlim_max: 0 }) };
    let _ = SHRUNK.set(shrunk_memory());
    if let Err(e) = iopath_protocols::seccomp::install() {
        eprintln!("install: {e}");
        // SAFETY: ends the child without the harness's report.
        unsafe { libc::_exit(100) };
    }
    let _ = EVENT.set(EventFd::new(0).unwrap());
    let code = match role {
        None => f(),
        Some(r) => std::thread::spawn(move || {
            enter(r);
            f()
        })
        .join()
        .unwrap_or(101),
    };
    // SAFETY: as above.
    unsafe { libc::_exit(code) };
}

/// The child died of SIGSYS; returns its stderr.
fn dies(role: Option<Role>, f: fn() -> i32) -> String {
    let (end, err) = child(role, f);
    assert!(matches!(end, End::Signal(libc::SIGSYS)), "{role:?}: {end:?}, stderr {err:?}");
    err
}

/// The child died of SIGSYS after the handler named the call and the role.
fn killed(role: Option<Role>, f: fn() -> i32, nr: i64) {
    let err = dies(role, f);
    let line = format!("iopath serve: seccomp: forbidden syscall {nr} in thread ");
    assert!(err.contains(&line), "{role:?}: stderr {err:?}");
    if let Some(r) = role {
        assert!(err.contains(&format!("(role {})", r.name())), "{role:?}: stderr {err:?}");
    }
}

/// The child exited 0; returns its stderr.
fn lives(role: Option<Role>, f: fn() -> i32) -> String {
    let (end, err) = child(role, f);
    assert!(matches!(end, End::Exit(0)), "{role:?}: {end:?}, stderr {err:?}");
    err
}

fn socketpair() -> i32 {
    let mut fds = [0i32; 2];
    // SAFETY: socketpair fills two fds.
    unsafe { libc::socketpair(libc::AF_UNIX, libc::SOCK_STREAM, 0, fds.as_mut_ptr()) }
}

fn eventfd_round_trip() -> i32 {
    let e = EVENT.get().unwrap();
    e.write(3).unwrap();
    (e.read().unwrap() != 3) as i32
}

#[test]
fn the_session_may_not_open_network_sockets_exec_or_map_executable_memory() {
    // SAFETY (each): a raw system call with plain values; it is meant to be refused.
    killed(None, || unsafe { libc::socket(libc::AF_INET, libc::SOCK_STREAM, 0) }, libc::SYS_socket);
    killed(None, || unsafe { libc::execv(c"/bin/true".as_ptr(), [std::ptr::null()].as_ptr()) }, libc::SYS_execve);
    killed(
        None,
        || unsafe {
            let p = libc::mmap(
                std::ptr::null_mut(),
                4096,
                libc::PROT_READ | libc::PROT_EXEC,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            );
            (p == libc::MAP_FAILED) as i32
        },
        libc::SYS_mmap,
    );
    killed(
        None,
        || unsafe { libc::socketpair(libc::AF_INET, libc::SOCK_STREAM, 0, [0; 2].as_mut_ptr()) },
        libc::SYS_socketpair,
    );
    killed(None, || unsafe { libc::open(c"/etc/hostname".as_ptr(), libc::O_RDONLY) }, libc::SYS_openat);
    // A new process (clone without CLONE_THREAD): fork is clone(SIGCHLD).
    killed(None, || unsafe { libc::syscall(libc::SYS_clone, libc::SIGCHLD, 0, 0, 0, 0) as i32 }, libc::SYS_clone);
}

#[test]
fn the_session_serves_with_the_filter_on() {
    lives(None, || {
        // What a session does: socket pairs, eventfds, a thread, directories read-only, anonymous memory.
        let fds = socketpair();
        let n = std::fs::read_dir("/proc/self/fd").map(|d| d.count()).unwrap_or(0);
        let t = std::thread::spawn(eventfd_round_trip).join().unwrap_or(1);
        let v = vec![1u8; 8 << 20];
        (fds != 0 || n == 0 || t != 0 || v[4095] != 1) as i32
    });
    // Each client's doorbell page: a sealable memfd, sized, sealed (what NVMe's new_client does).
    lives(None, || {
        // SAFETY: memfd_create with a valid name; ftruncate and fcntl on the fd it returned, then closed.
        unsafe {
            let fd = libc::memfd_create(c"db".as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING);
            let sized = libc::ftruncate(fd, 16384);
            let sealed =
                libc::fcntl(fd, libc::F_ADD_SEALS, libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL);
            libc::close(fd);
            (fd < 0 || sized != 0 || sealed != 0) as i32
        }
    });
    // Not huge pages, not executable memory: only the flags a doorbell page is made with.
    killed(
        None,
        // SAFETY: memfd_create with a valid name; refused before it runs.
        || unsafe { libc::memfd_create(c"x".as_ptr(), libc::MFD_CLOEXEC | libc::MFD_HUGETLB) },
        libc::SYS_memfd_create,
    );
    // clone3 answers ENOSYS (glibc then uses clone), it does not kill.
    lives(None, || {
        // SAFETY: clone3 with no arguments; refused before it reads them.
        let r = unsafe { libc::syscall(libc::SYS_clone3, 0, 0) };
        (r != -1 || std::io::Error::last_os_error().raw_os_error() != Some(libc::ENOSYS)) as i32
    });
}

#[test]
fn each_role_keeps_to_its_own_calls() {
    // A device thread: eventfds and memory, no sockets, no threads, no eventfds of its own making.
    lives(Some(Role::Device), eventfd_round_trip);
    lives(Some(Role::Device), || (vec![7u8; 8 << 20][12345] != 7) as i32);
    killed(Some(Role::Device), || unsafe { libc::eventfd(0, 0) }, libc::SYS_eventfd2);
    killed(Some(Role::Device), socketpair, libc::SYS_socketpair);
    // clone3 comes first (only the roles that start threads get ENOSYS for it and
    // go on to clone); glibc makes it with every signal blocked, so the kernel
    // forces SIGSYS past the handler: the death is silent.
    dies(Some(Role::Device), || std::thread::spawn(|| 0).join().unwrap_or(1));
    // A reader receives; it does not map or start anything.
    killed(Some(Role::Reader), || unsafe { libc::eventfd(0, 0) }, libc::SYS_eventfd2);
    killed(Some(Role::Irq), || unsafe { libc::pread(0, [0u8; 1].as_mut_ptr().cast(), 1, 0) as i32 }, libc::SYS_pread64);
    // A region thread may start a device thread (an NVMe enable), which narrows further.
    lives(Some(Role::Region), || {
        std::thread::spawn(|| {
            enter(Role::Device);
            eventfd_round_trip()
        })
        .join()
        .unwrap_or(1)
    });
    killed(
        Some(Role::Region),
        || unsafe { libc::accept4(0, std::ptr::null_mut(), std::ptr::null_mut(), 0) },
        libc::SYS_accept4,
    );
}

/// The SIGBUS handler does what it must under every role's filter: a
/// client that shrank its memory costs no thread (and no SIGSYS); a fault
/// outside client memory still kills the process with SIGBUS.
#[test]
fn the_sigbus_handler_works_under_every_roles_filter() {
    lives(None, touch_shrunk_client_memory);
    for role in Role::ALL {
        lives(Some(role), touch_shrunk_client_memory);
    }
    for role in [None, Some(Role::Device), Some(Role::Irq)] {
        let (end, err) = child(role, touch_stray_memory);
        assert!(matches!(end, End::Signal(libc::SIGBUS)), "{role:?}: {end:?}, stderr {err:?}");
    }
}

#[test]
fn a_panicking_device_thread_ends_alone_as_without_the_filter() {
    let err = lives(None, || {
        // The default hook's backtrace (RUST_BACKTRACE=1) would call getcwd and open the binary: forbidden.
        std::env::set_var("RUST_BACKTRACE", "1");
        let t = std::thread::spawn(|| {
            enter(Role::Device);
            panic!("a device thread's bug");
        });
        t.join().is_ok() as i32
    });
    assert!(err.contains("a device thread's bug"), "{err:?}");
}

const SHRINK_CHILD: &str = "IOPATH_SECCOMP_HEAP_SHRINK_CHILD";

/// Device threads that free much of what they allocated, and many that
/// allocate at once, live. glibc
/// shrinks a thread's heap then, and the first time it does it reads
/// /proc/sys/vm/overcommit_memory (an open by path, which no role may make):
/// `install` keeps glibc from trimming heaps, so that read never comes. Run
/// in a fresh process (re-executed): a forked child would inherit the value
/// if this process had read it already. Likewise the arena limit, which glibc
/// works out from the CPU count when it makes its ninth arena.
#[test]
fn a_device_thread_that_frees_much_of_its_heap_lives() {
    if std::env::var_os(SHRINK_CHILD).is_some() {
        iopath_protocols::seccomp::install().unwrap();
        let freed = std::thread::spawn(|| {
            enter(Role::Device);
            for _ in 0..4 {
                // Below the mmap threshold: these come from the thread's heap.
                let blocks: Vec<Vec<u8>> = (0..256).map(|i| vec![i as u8; 96 << 10]).collect();
                drop(blocks);
            }
            0
        })
        .join();
        assert_eq!(freed.ok(), Some(0));
        // Many device threads at once, each with its own arena: glibc asks
        // for the CPU count (sched_getaffinity) when its ninth arena is made,
        // in whichever thread that is.
        let barrier = std::sync::Arc::new(std::sync::Barrier::new(24));
        let threads: Vec<_> = (0..24)
            .map(|_| {
                let b = barrier.clone();
                std::thread::spawn(move || {
                    enter(Role::Device);
                    b.wait();
                    let v = vec![1u8; 4096];
                    b.wait();
                    v[100] as i32 - 1
                })
            })
            .collect();
        assert!(threads.into_iter().all(|t| t.join().ok() == Some(0)));
        return;
    }
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "a_device_thread_that_frees_much_of_its_heap_lives", "--nocapture", "--test-threads=1"])
        .env(SHRINK_CHILD, "1")
        .output()
        .unwrap();
    let log = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success() && log.contains("1 passed"), "{:?}:\n{log}", out.status);
}
