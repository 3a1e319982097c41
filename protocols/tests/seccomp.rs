//! `iopath serve`'s sandbox: a child process (this binary run again) builds
//! an NVMe device on a file namespace (its io_uring made as serve makes
//! it), confines itself with the function serve uses (`seccomp::install`:
//! Landlock, then the seccomp filters), then makes one system call from a
//! thread of some role. Forbidden calls must end the child with SIGSYS and
//! the handler's line on stderr; allowed ones must not. Some children run
//! with a pseudo-terminal for stderr (util-linux `script`), where a
//! terminal-only path of the runtime would show.

use iopath_devices::sandbox::{enter, Role};
use iopath_protocols::function::{map_region, MappedRegion, SharedRegion};
use iopath_protocols::sigbus::Owner;
use std::fs::File;
use std::io::Read;
use std::os::fd::{AsRawFd, FromRawFd};
use std::os::unix::net::UnixStream;
use std::os::unix::process::ExitStatusExt;
use std::sync::{Arc, Mutex, OnceLock};
use vmm_sys_util::eventfd::EventFd;

/// An eventfd the child makes as a session would, for its threads to use.
static EVENT: OnceLock<EventFd> = OnceLock::new();

/// An NVMe controller on a file namespace, built before the filters as
/// `iopath serve` builds its device, and what a thread needs to reach the
/// namespace's io_uring from outside the backend: the ring's fd (found in
/// /proc/self/fd) and the parameters of a ring of its size (the mmap
/// offsets, the same for every ring of that size on this kernel).
struct FileNvme {
    _device: iopath_devices::SharedDevice,
    ring_fd: i32,
    params: io_uring::Parameters,
    /// A ring with no restrictions, made before the sandbox as no device
    /// makes one: what reaches Landlock past seccomp and the restrictions.
    plain: Mutex<io_uring::IoUring>,
}

static NVME: OnceLock<FileNvme> = OnceLock::new();

fn file_nvme() -> FileNvme {
    let img = std::env::temp_dir().join(format!("iopath-seccomp-nvme-{}.img", std::process::id()));
    let cfg: iopath_devices::DeviceConfig =
        format!("nvme,backend=file:{},create=on,size_mb=1", img.display()).parse().unwrap();
    let device = cfg.build().unwrap();
    let _ = std::fs::remove_file(&img);
    let ring_fd = std::fs::read_dir("/proc/self/fd")
        .unwrap()
        .filter_map(|e| {
            let e = e.ok()?;
            let to = std::fs::read_link(e.path()).ok()?;
            (to.to_str() == Some("anon_inode:[io_uring]")).then(|| e.file_name().to_str()?.parse::<i32>().ok())?
        })
        .max()
        .expect("the file namespace's io_uring");
    let slots = iopath_devices::block::FILE_SLOTS as u32;
    let params = io_uring::IoUring::new(slots).unwrap().params().clone();
    FileNvme { _device: device, ring_fd, params, plain: Mutex::new(io_uring::IoUring::new(8).unwrap()) }
}

/// A file namespace's storage, opened before the filters as `iopath serve`
/// opens its device's: 64 KiB written with 0xa5 at its start.
static STORAGE: OnceLock<Mutex<iopath_devices::block::Storage>> = OnceLock::new();

fn file_storage() -> Mutex<iopath_devices::block::Storage> {
    use iopath_devices::block::StorageKind;
    let img = std::env::temp_dir().join(format!("iopath-seccomp-storage-{}.img", std::process::id()));
    let mut s = iopath_devices::backing::open(&StorageKind::File(img.clone()), 1 << 20, true).unwrap();
    let _ = std::fs::remove_file(&img);
    s.write(0, &[0xa5; 65536]).unwrap();
    Mutex::new(s)
}

/// What a device thread does for a discard and for write zeroes with and
/// without deallocation (fallocate PUNCH_HOLE, ZERO_RANGE) under the
/// filter: 0 if each completed and its 16 KiB read as zeros after, the
/// rest still as written.
fn discard_and_write_zeroes() -> i32 {
    let mut s = STORAGE.get().unwrap().lock().unwrap();
    let done = [s.discard(0, 16384), s.write_zeroes(16384, 16384, true), s.write_zeroes(32768, 16384, false)];
    let mut b = vec![0xffu8; 65536];
    let read = s.read(0, &mut b);
    let zeros = b[..49152].iter().all(|&x| x == 0) && b[49152..].iter().all(|&x| x == 0xa5);
    eprintln!("discard, write zeroes: {done:?}, read back: {read:?}, zeros where zeroed: {zeros}");
    (!(done.iter().all(|r| r.is_ok()) && read.is_ok() && zeros)) as i32
}

/// An IORING_OP_OPENAT of /etc/hostname on `ring`: 0 if it was refused
/// (the refusal on stderr, after `what`), 1 if it opened the file.
fn ring_openat(ring: &mut io_uring::IoUring, what: &str) -> i32 {
    use io_uring::{opcode, types};
    let e = opcode::OpenAt::new(types::Fd(libc::AT_FDCWD), c"/etc/hostname".as_ptr()).build().user_data(u64::MAX);
    // SAFETY: the path is a static C string.
    unsafe { ring.submission().push(&e).unwrap() };
    if let Err(e) = ring.submit_and_wait(1) {
        eprintln!("{what}: submit: {e}");
        return 0;
    }
    // A backend's own completions (none: it is idle) would not carry this tag.
    let c = ring.completion().find(|c| c.user_data() == u64::MAX).expect("the openat's completion");
    let r = c.result();
    if r >= 0 {
        eprintln!("{what}: fd {r}: NOT REFUSED");
        return 1;
    }
    eprintln!("{what}: refused: {}", std::io::Error::from_raw_os_error(-r));
    0
}

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
// SAFETY: `stray` is only read through (by any thread), never freed or
// written through; the other fields are Sync.
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
    run_child(role, f, false)
}

/// As [`child`], with a pseudo-terminal for the child's stdin, stdout and
/// stderr (`script`; its output is the child's, both streams); the child
/// checks that stderr is a terminal before it confines itself.
fn child_at_a_terminal(role: Option<Role>, f: fn() -> i32) -> (End, String) {
    let (end, out) = run_child(role, f, true);
    assert!(out.contains("stderr is a terminal"), "{role:?}: the child's stderr was no terminal: {out:?}");
    (end, out)
}

fn run_child(role: Option<Role>, f: fn() -> i32, tty: bool) -> (End, String) {
    let offset = (f as usize).wrapping_sub(anchor as fn() -> i32 as usize);
    let role = role.map_or("-".to_string(), |r| Role::ALL.iter().position(|&x| x == r).unwrap().to_string());
    let exe = std::env::current_exe().unwrap();
    let args = ["--exact", "seccomp_case", "--nocapture", "--test-threads=1"];
    let mut cmd = if tty {
        let line = format!("'{}' {}", exe.display(), args.join(" "));
        assert!(!exe.to_string_lossy().contains('\''), "a test binary path with a quote: {exe:?}");
        let mut c = std::process::Command::new("script");
        c.args(["-qec", &line, "/dev/null"]);
        c
    } else {
        let mut c = std::process::Command::new(exe);
        c.args(args);
        c
    };
    let out = cmd
        .env(CASE, format!("{role}:{offset}"))
        .env("RUST_BACKTRACE", "1")
        .stdin(std::process::Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("running the child (tty: {tty}; util-linux script for a terminal): {e}"));
    let err = if tty { &out.stdout } else { &out.stderr };
    let err = String::from_utf8_lossy(err).to_string();
    let end = match (out.status.code(), out.status.signal()) {
        // script -e: a child killed by signal N exits 128 + N.
        (Some(c), _) if tty && c > 128 => End::Signal(c - 128),
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
    // SAFETY: isatty on fd 2 (an ioctl the filters refuse, so asked before them).
    if unsafe { libc::isatty(2) } == 1 {
        eprintln!("stderr is a terminal");
    }
    let _ = SHRUNK.set(shrunk_memory());
    let _ = NVME.set(file_nvme());
    let _ = STORAGE.set(file_storage());
    if let Err(e) = iopath_protocols::seccomp::install() {
        eprintln!("install: {e}");
        // SAFETY: ends the child without the harness's report.
        unsafe { libc::_exit(100) };
    }
    let _ = EVENT.set(EventFd::new(0).unwrap());
    let code = match role {
        None => std::panic::catch_unwind(f).unwrap_or(101),
        Some(r) => std::thread::spawn(move || {
            enter(r);
            f()
        })
        .join()
        .unwrap_or(101),
    };
    // SAFETY: _exit(2) ends the child with the case's code, skipping the
    // harness's report; it touches no memory of ours.
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
    // Each call below is meant to be refused (the child dies of SIGSYS).
    // SAFETY: socket(2) takes integers only.
    killed(None, || unsafe { libc::socket(libc::AF_INET, libc::SOCK_STREAM, 0) }, libc::SYS_socket);
    // SAFETY: a NUL-terminated path and a NULL-terminated argv, both live for the call.
    killed(None, || unsafe { libc::execv(c"/bin/true".as_ptr(), [std::ptr::null()].as_ptr()) }, libc::SYS_execve);
    killed(
        None,
        // SAFETY: an anonymous private mapping at an address the kernel picks
        // (no existing memory replaced); it is never touched.
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
        // SAFETY: socketpair writes two ints into a live array of two.
        || unsafe { libc::socketpair(libc::AF_INET, libc::SOCK_STREAM, 0, [0; 2].as_mut_ptr()) },
        libc::SYS_socketpair,
    );
    // SAFETY: a NUL-terminated path; an fd it made would leak in a child that exits.
    killed(None, || unsafe { libc::open(c"/etc/hostname".as_ptr(), libc::O_RDONLY) }, libc::SYS_openat);
    // A new process (clone without CLONE_THREAD): fork is clone(SIGCHLD).
    // SAFETY: clone(SIGCHLD) without a stack is a fork; it is refused before it runs
    // (were it not, the child would return into this closure and exit too).
    killed(None, || unsafe { libc::syscall(libc::SYS_clone, libc::SIGCHLD, 0, 0, 0, 0) as i32 }, libc::SYS_clone);
}

#[test]
fn the_session_serves_with_the_filter_on() {
    lives(None, || {
        // What a session does: socket pairs, eventfds, a thread, its fd count, anonymous memory.
        let fds = socketpair();
        let n = iopath_protocols::nopath::open_fds().unwrap_or(0);
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
    // SAFETY: eventfd(2) takes integers only.
    killed(Some(Role::Device), || unsafe { libc::eventfd(0, 0) }, libc::SYS_eventfd2);
    killed(Some(Role::Device), socketpair, libc::SYS_socketpair);
    // clone3 comes first (only the roles that start threads get ENOSYS for it and
    // go on to clone); glibc makes it with every signal blocked, so the kernel
    // forces SIGSYS past the handler: the death is silent.
    dies(Some(Role::Device), || std::thread::spawn(|| 0).join().unwrap_or(1));
    // A reader receives; it does not map or start anything.
    // SAFETY: eventfd(2) takes integers only.
    killed(Some(Role::Reader), || unsafe { libc::eventfd(0, 0) }, libc::SYS_eventfd2);
    // SAFETY: pread of at most 1 byte into a live 1-byte buffer.
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
        // SAFETY: accept4 with no address buffer (both pointers null, as it allows).
        || unsafe { libc::accept4(0, std::ptr::null_mut(), std::ptr::null_mut(), 0) },
        libc::SYS_accept4,
    );
}

/// Discard and write zeroes on a file namespace (fallocate) work under the
/// filter of every role that serves storage; the roles that do not (a
/// reader, an interrupt thread) die of SIGSYS at the call.
#[test]
fn discard_and_write_zeroes_reach_the_file_under_the_storage_roles_filters() {
    for role in [None, Some(Role::Session), Some(Role::Region), Some(Role::Device)] {
        let err = lives(role, discard_and_write_zeroes);
        assert!(err.contains("zeros where zeroed: true"), "{role:?}: {err:?}");
    }
    for role in [Role::Reader, Role::Irq] {
        killed(Some(role), discard_and_write_zeroes, libc::SYS_fallocate);
    }
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

/// A device thread's panic (a bug; the device's state may be half
/// updated) ends the device process at once with 101 and a line that names
/// the thread and the panic: the main thread, which would go on serving,
/// never sees the thread end.
#[test]
fn a_panicking_device_thread_ends_the_process_with_its_message() {
    let (end, err) = child(None, || {
        // The default hook's backtrace (RUST_BACKTRACE=1) would call getcwd and open the binary: forbidden.
        std::env::set_var("RUST_BACKTRACE", "1");
        let t = std::thread::Builder::new().name("nvme-io0".into()).spawn(|| {
            enter(Role::Device);
            panic!("a device thread's bug");
        });
        let joined = t.unwrap().join();
        eprintln!("still serving after the device thread's panic (joined: {})", joined.is_ok());
        0
    });
    assert!(matches!(end, End::Exit(101)), "{end:?}, stderr {err:?}");
    assert!(err.contains("thread 'nvme-io0' panicked at"), "{err:?}");
    assert!(err.contains("a device thread's bug (no backtrace under seccomp)"), "{err:?}");
    assert!(!err.contains("still serving"), "{err:?}");
    assert!(!err.contains("forbidden syscall"), "{err:?}");
}

/// A panic in a thread of any role (the session's included), with stderr
/// a terminal or not and RUST_BACKTRACE=1, prints its message and ends the
/// process with 101: nothing on the panic path (the hook, its _exit) is a
/// call the filters refuse.
#[test]
fn a_panic_in_any_role_at_a_terminal_or_not_is_a_panic_not_a_sigsys() {
    let bug = || -> i32 { panic!("a bug under the filter") };
    for role in [None].into_iter().chain(Role::ALL.map(Some)) {
        for tty in [false, true] {
            let (end, out) = if tty { child_at_a_terminal(role, bug) } else { child(role, bug) };
            assert!(matches!(end, End::Exit(101)), "{role:?}, tty {tty}: {end:?}, output {out:?}");
            assert!(out.contains("a bug under the filter"), "{role:?}, tty {tty}: {out:?}");
            assert!(!out.contains("forbidden syscall"), "{role:?}, tty {tty}: {out:?}");
        }
    }
}

/// What a confined thread saw when it tried to reach a file by path: the
/// return value and errno, on stderr; 0 if it was refused, 1 if it got in.
fn refused(what: &str, r: i64) -> i32 {
    let e = std::io::Error::last_os_error();
    if r >= 0 {
        eprintln!("{what}: {r}: NOT REFUSED");
        return 1;
    }
    eprintln!("{what}: refused: {e}");
    0
}

fn open_etc_hostname() -> i32 {
    // SAFETY: open of a C string path; the fd (if any) is leaked in a child that exits.
    refused("openat /etc/hostname", unsafe { libc::open(c"/etc/hostname".as_ptr(), libc::O_RDONLY) } as i64)
}

fn open_root_directory() -> i32 {
    // SAFETY: open of a NUL-terminated path; the fd (if any) is leaked in a child that exits.
    let fd = unsafe { libc::open(c"/".as_ptr(), libc::O_RDONLY | libc::O_DIRECTORY) };
    refused("openat / (a directory, read-only)", fd as i64)
}

fn stat_etc_hostname() -> i32 {
    let mut st = std::mem::MaybeUninit::<libc::stat>::zeroed();
    // SAFETY: stat into a local buffer (glibc: newfstatat(AT_FDCWD, path)).
    refused("stat /etc/hostname", unsafe { libc::stat(c"/etc/hostname".as_ptr(), st.as_mut_ptr()) } as i64)
}

fn statx_etc_hostname() -> i32 {
    // SAFETY: statx into a local buffer.
    let r = unsafe {
        let mut stx: libc::statx = std::mem::zeroed();
        libc::statx(libc::AT_FDCWD, c"/etc/hostname".as_ptr(), 0, libc::STATX_BASIC_STATS, &mut stx)
    };
    refused("statx /etc/hostname", r as i64)
}

fn readlink_proc_self_exe() -> i32 {
    let mut b = [0u8; 256];
    // SAFETY: readlink into a local buffer of its size.
    let r = unsafe { libc::readlink(c"/proc/self/exe".as_ptr(), b.as_mut_ptr().cast(), b.len()) };
    refused("readlink /proc/self/exe", r as i64)
}

fn access_etc_hostname() -> i32 {
    // SAFETY: access of a C string path.
    refused("access /etc/hostname", unsafe { libc::access(c"/etc/hostname".as_ptr(), libc::R_OK) } as i64)
}

/// An IORING_OP_OPENAT of /etc/hostname on the NVMe file namespace's own
/// ring, which the thread reaches as an attacker with the process's memory
/// would (its fd, mapped again).
fn openat_through_the_backends_ring() -> i32 {
    let n = NVME.get().unwrap();
    // SAFETY: the fd is the backend's ring and the parameters a ring of its
    // size's; the handle is never dropped (the fd stays the backend's).
    let ring = unsafe { io_uring::IoUring::from_fd(n.ring_fd, n.params.clone()) }.unwrap();
    ring_openat(&mut std::mem::ManuallyDrop::new(ring), "io_uring openat /etc/hostname")
}

/// The same on a ring with no restrictions: Landlock's refusal.
fn openat_through_an_unrestricted_ring() -> i32 {
    let mut ring = NVME.get().unwrap().plain.lock().unwrap();
    ring_openat(&mut ring, "unrestricted io_uring openat /etc/hostname")
}

fn a_new_io_uring() -> i32 {
    let mut p = [0u8; 120]; // struct io_uring_params
                            // SAFETY: io_uring_setup with a zeroed params struct of its size.
    refused("io_uring_setup", unsafe { libc::syscall(libc::SYS_io_uring_setup, 8, p.as_mut_ptr()) })
}

/// After setup nothing is reached by path, in any role, at a terminal or
/// not: the system calls that take a path die of SIGSYS (no role's
/// allow-list has one, so the call never reaches the kernel, and the line
/// names it), and an open through the file namespace's io_uring, the one
/// way past the filters, completes with EACCES (the ring's restrictions;
/// Landlock would refuse it too). Every refusal is printed.
#[test]
fn nothing_is_reached_by_path_in_any_role_nor_through_the_io_uring() {
    let by_path: [(fn() -> i32, i64); 7] = [
        (open_etc_hostname, libc::SYS_openat),
        (open_root_directory, libc::SYS_openat),
        (stat_etc_hostname, libc::SYS_newfstatat),
        (statx_etc_hostname, libc::SYS_statx),
        (readlink_proc_self_exe, libc::SYS_readlink),
        (access_etc_hostname, libc::SYS_access),
        (a_new_io_uring, libc::SYS_io_uring_setup),
    ];
    for role in [None].into_iter().chain(Role::ALL.map(Some)) {
        for (i, &(f, nr)) in by_path.iter().enumerate() {
            // Each case once at a terminal, in turn.
            let (end, out) = if i % 2 == 1 { child_at_a_terminal(role, f) } else { child(role, f) };
            let line = format!("iopath serve: seccomp: forbidden syscall {nr} in thread ");
            assert!(matches!(end, End::Signal(libc::SIGSYS)) && out.contains(&line), "{role:?}: {end:?}, {out:?}");
            let said = out.lines().find(|l| l.contains(&line)).unwrap_or_default().trim_end();
            eprintln!("{role:?} case {i}: {end:?}: {said}");
        }
        // io_uring_enter is a device thread's (file I/O): the ring refuses the open itself.
        let (end, out) = child(role, openat_through_the_backends_ring);
        let said = out.lines().find(|l| l.contains("io_uring openat") || l.contains("seccomp")).unwrap_or_default();
        eprintln!("{role:?} io_uring openat: {end:?}: {said}");
        match role {
            Some(Role::Reader | Role::Irq) => {
                let line = format!("forbidden syscall {} in thread", libc::SYS_io_uring_enter);
                assert!(matches!(end, End::Signal(libc::SIGSYS)) && out.contains(&line), "{role:?}: {end:?}, {out:?}");
            }
            _ => {
                assert!(matches!(end, End::Exit(0)), "{role:?}: {end:?}, {out:?}");
                assert!(out.contains("io_uring openat /etc/hostname: refused: Permission denied"), "{role:?}: {out:?}");
            }
        }
    }
}

/// Landlock holds where seccomp and the ring's restrictions do not reach:
/// an open through a ring made before the sandbox without restrictions (no
/// device makes one) is refused too, EACCES, in every role that may enter
/// a ring at all.
#[test]
fn landlock_refuses_an_open_that_gets_past_the_filters() {
    let Ok(abi) = iopath_protocols::landlock::abi() else {
        panic!("this kernel has no Landlock: {:?}", iopath_protocols::landlock::abi());
    };
    for role in [None, Some(Role::Session), Some(Role::Region), Some(Role::Device)] {
        let (end, out) = child(role, openat_through_an_unrestricted_ring);
        let said = out.lines().find(|l| l.contains("io_uring openat")).unwrap_or_default();
        eprintln!("{role:?} (Landlock ABI {abi}): {end:?}: {said}");
        assert!(matches!(end, End::Exit(0)), "{role:?}: {end:?}, {out:?}");
        assert!(said.contains("refused: Permission denied"), "{role:?}: {out:?}");
    }
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
