//! Client memory that shrinks under the device: a SIGBUS handler and the
//! registry of the mappings it may repair.
//!
//! A device process maps whatever fd a client shares guest RAM with
//! (memfds sealed or not, hugetlbfs and tmpfs files, regular files): a
//! client that truncates the file afterwards (or punches holes in a
//! hugetlbfs file and drains the pool) makes the next access to the
//! mapping fault with SIGBUS. Such a fault must end that client's session,
//! not the process. So:
//!
//! - every client mapping is a [`Guarded`]: registered here, in a
//!   fixed-size, lock-free table of `[start, start + len)` ranges, with the
//!   [`Owner`] (the session) it belongs to;
//! - a process-wide SIGBUS handler ([`install`], SA_SIGINFO, once, before
//!   any client memory is mapped and before seccomp is applied) looks the
//!   fault address up in the table. On a hit it replaces the whole
//!   registered range with anonymous zero pages (one `mmap` MAP_FIXED |
//!   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, PROT_READ | PROT_WRITE;
//!   the range is the mapping's, in whole pages of its page size, so a
//!   hugetlb mapping is replaced whole), marks the entry and its owner
//!   poisoned, shuts the owner's session socket down for reading (its
//!   wait for the next message ends at once) and returns: the faulting load
//!   or store retries on zero pages. No thread dies and nothing outside
//!   the client's own memory is touched. On a miss it restores the default
//!   action and returns (a fault faults again and kills the process with
//!   SIGBUS, as without the handler; a SIGBUS sent with kill is sent again);
//! - the session sees its owner poisoned (at its next message, or at once:
//!   its socket reads end of stream) and ends with an error naming the
//!   client and the region; the device is reset as for any client that
//!   leaves, and the next client is served.
//!
//! The handler makes only async-signal-safe system calls, each allowed in
//! every seccomp role (`seccomp.rs`): mmap without PROT_EXEC, shutdown
//! (SHUT_RD), write (its stderr line), rt_sigaction (SIGBUS only), getpid,
//! gettid, tgkill (to this process) and rt_sigreturn.
//!
//! Kernel accesses (io_uring, pread/pwrite into guest memory) to a
//! truncated page do not raise SIGBUS: they fail with EFAULT, which the
//! NVMe backends turn into an error status.

use crate::{Error, Result};
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::{fence, AtomicBool, AtomicI32, AtomicPtr, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use vm_memory::mmap::MmapRegion;

/// Client mappings the process can hold at once (every session's): a
/// vfio-user client is told no more DMA maps than this.
pub const CAPACITY: usize = 4096;

/// One registered mapping. A seqlock (`seq` odd while it changes) lets the
/// handler read a consistent entry without a lock; `used` claims the slot
/// among registering threads.
struct Slot {
    seq: AtomicU64,
    used: AtomicBool,
    start: AtomicUsize,
    /// 0: free.
    len: AtomicUsize,
    poisoned: AtomicBool,
    /// The owner's flag (see [`Owner`]); valid while the entry is live.
    owner: AtomicPtr<AtomicBool>,
    /// The owner's socket to shut down for reading, or -1.
    wake: AtomicI32,
}

#[allow(clippy::declare_interior_mutable_const)] // a template for the static array
const FREE: Slot = Slot {
    seq: AtomicU64::new(0),
    used: AtomicBool::new(false),
    start: AtomicUsize::new(0),
    len: AtomicUsize::new(0),
    poisoned: AtomicBool::new(false),
    owner: AtomicPtr::new(std::ptr::null_mut()),
    wake: AtomicI32::new(-1),
};

static SLOTS: [Slot; CAPACITY] = [FREE; CAPACITY];

/// Whose memory a mapping is: a session. Its flag says a mapping of it was
/// repaired; its socket (a copy of the session's) is shut down for reading
/// by the handler so that a session waiting for the client's next message
/// wakes at once.
pub struct Owner {
    poisoned: AtomicBool,
    wake: Option<OwnedFd>,
}

impl Owner {
    /// An owner whose session reads `sock` (none: only the flag).
    pub fn new(sock: Option<&impl AsRawFd>) -> Result<Arc<Owner>> {
        let wake = match sock {
            Some(s) => {
                // SAFETY: F_DUPFD_CLOEXEC of an fd the caller holds open; the new fd is owned below.
                let fd = unsafe { libc::fcntl(s.as_raw_fd(), libc::F_DUPFD_CLOEXEC, 0) };
                if fd < 0 {
                    return Err(Error::io("dup of the session socket", std::io::Error::last_os_error()));
                }
                // SAFETY: a fresh fd nothing else owns.
                Some(unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) })
            }
            None => None,
        };
        Ok(Arc::new(Owner { poisoned: AtomicBool::new(false), wake }))
    }

    /// True once a mapping of this owner faulted and was replaced.
    pub fn poisoned(&self) -> bool {
        self.poisoned.load(Ordering::Acquire)
    }
}

/// A client mapping registered with the handler: owns the mapping (unmapped
/// when the last reference goes) and its entry (removed just before).
pub struct Guarded {
    map: MmapRegion<()>,
    slot: usize,
    len: usize,
    _owner: Arc<Owner>,
}

impl Guarded {
    /// Registers `map` (whose pages are `page` bytes: the range replaced on
    /// a fault is its length rounded up to them) for `owner`. Fails if the
    /// table is full.
    pub fn new(map: MmapRegion<()>, page: usize, owner: &Arc<Owner>) -> Result<Arc<Guarded>> {
        install()?;
        let start = map.as_ptr() as usize;
        let len = map.size().div_ceil(page.max(1)) * page.max(1);
        let slot = SLOTS
            .iter()
            .position(|s| s.used.compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed).is_ok())
            .ok_or_else(|| Error::protocol(format!("more than {CAPACITY} client memory mappings")))?;
        let s = &SLOTS[slot];
        let owner_flag = &owner.poisoned as *const AtomicBool as *mut AtomicBool;
        let wake = owner.wake.as_ref().map_or(-1, |f| f.as_raw_fd());
        write_slot(s, |s| {
            s.start.store(start, Ordering::Relaxed);
            s.len.store(len, Ordering::Relaxed);
            s.poisoned.store(false, Ordering::Relaxed);
            s.owner.store(owner_flag, Ordering::Relaxed);
            s.wake.store(wake, Ordering::Relaxed);
        });
        Ok(Arc::new(Guarded { map, slot, len, _owner: owner.clone() }))
    }

    /// The mapping's first byte.
    pub fn as_ptr(&self) -> *mut u8 {
        self.map.as_ptr()
    }

    /// The range the handler replaces on a fault: `(start, len)`.
    pub fn range(&self) -> (usize, usize) {
        (self.map.as_ptr() as usize, self.len)
    }

    /// True once an access to this mapping faulted and it was replaced by zero pages.
    pub fn poisoned(&self) -> bool {
        SLOTS[self.slot].poisoned.load(Ordering::Acquire)
    }
}

impl Drop for Guarded {
    /// The entry goes before the mapping (`map` is dropped, so unmapped,
    /// after this body): nobody uses the mapping any more (this was the last
    /// reference), and no later mapping at these addresses can be taken for it.
    fn drop(&mut self) {
        let s = &SLOTS[self.slot];
        write_slot(s, |s| {
            s.len.store(0, Ordering::Relaxed);
            s.start.store(0, Ordering::Relaxed);
            s.owner.store(std::ptr::null_mut(), Ordering::Relaxed);
            s.wake.store(-1, Ordering::Relaxed);
        });
        s.used.store(false, Ordering::Release);
    }
}

/// Changes a slot the caller has claimed, as a seqlock writer.
fn write_slot(s: &Slot, f: impl FnOnce(&Slot)) {
    let seq = s.seq.load(Ordering::Relaxed);
    s.seq.store(seq.wrapping_add(1), Ordering::Relaxed);
    fence(Ordering::Release);
    f(s);
    s.seq.store(seq.wrapping_add(2), Ordering::Release);
}

/// Live entries now (for tests and reports).
pub fn live() -> usize {
    SLOTS.iter().filter(|s| s.used.load(Ordering::Acquire)).count()
}

/// What installing the handler gave: 0, or the errno of sigaction.
static INSTALLED: OnceLock<i32> = OnceLock::new();

/// Installs the SIGBUS handler, once per process (later calls return what
/// the first got). `iopath serve` calls it before seccomp; every
/// [`Guarded`] calls it before it registers.
pub fn install() -> Result<()> {
    let errno = *INSTALLED.get_or_init(|| {
        // SAFETY: an all-zero sigaction is valid; the handler is async-signal-safe.
        let r = unsafe {
            let mut sa: libc::sigaction = std::mem::zeroed();
            sa.sa_sigaction = on_sigbus as *const () as usize;
            sa.sa_flags = libc::SA_SIGINFO | libc::SA_ONSTACK;
            libc::sigemptyset(&mut sa.sa_mask);
            libc::sigaction(libc::SIGBUS, &sa, std::ptr::null_mut())
        };
        if r == 0 {
            0
        } else {
            std::io::Error::last_os_error().raw_os_error().unwrap_or(libc::EINVAL)
        }
    });
    match errno {
        0 => Ok(()),
        e => Err(Error::io("the SIGBUS handler", std::io::Error::from_raw_os_error(e))),
    }
}

/// The entry holding `addr`, read consistently: (slot, start, len).
fn lookup(addr: usize) -> Option<(&'static Slot, usize, usize)> {
    for s in SLOTS.iter() {
        let seq = s.seq.load(Ordering::Acquire);
        if seq & 1 == 1 {
            // Being registered or removed: its mapping is in no one's use.
            continue;
        }
        let (start, len) = (s.start.load(Ordering::Relaxed), s.len.load(Ordering::Relaxed));
        fence(Ordering::Acquire);
        if s.seq.load(Ordering::Relaxed) != seq || len == 0 {
            continue;
        }
        if addr >= start && addr - start < len {
            return Some((s, start, len));
        }
    }
    None
}

/// The handler (see the module doc).
///
/// SAFETY (why an entry found here is the faulting mapping's, and stays so):
/// a thread faults on an access through a pointer into a client mapping,
/// which it can only hold while it holds a reference to the mapping's
/// [`Guarded`] (a `GuestMem` clone keeps it, and with it the window regions
/// into it): the last reference cannot be dropped while this handler runs on
/// that thread, so the entry is not removed (its `Drop` removes it) and its
/// slot not reused for another mapping. Entries read while they change are
/// skipped (no mapping being registered or removed is in use). The owner's
/// flag and socket live as long as the entry does (the `Guarded` holds the
/// owner).
extern "C" fn on_sigbus(_sig: libc::c_int, info: *mut libc::siginfo_t, _ctx: *mut libc::c_void) {
    // SAFETY: the kernel passes a valid siginfo with SA_SIGINFO.
    let (addr, code) = unsafe { ((*info).si_addr() as usize, (*info).si_code) };
    // si_code > 0: raised by the kernel for a fault at si_addr.
    if code > 0 {
        if let Some((s, start, len)) = lookup(addr) {
            if s.poisoned.load(Ordering::Acquire) || replace(start, len) {
                s.poisoned.store(true, Ordering::Release);
                let owner = s.owner.load(Ordering::Relaxed);
                if !owner.is_null() {
                    // SAFETY: the owner outlives the entry (see above).
                    unsafe { (*owner).store(true, Ordering::Release) };
                }
                let wake = s.wake.load(Ordering::Relaxed);
                if wake >= 0 {
                    // SAFETY: shutdown of the owner's socket copy, open while the entry lives.
                    unsafe { libc::shutdown(wake, libc::SHUT_RD) };
                }
                say(addr, start, len);
                return;
            }
        }
    }
    // A miss (or a replacement that failed): the default action, at once.
    // SAFETY: async-signal-safe calls with valid arguments.
    unsafe {
        let mut sa: libc::sigaction = std::mem::zeroed();
        sa.sa_sigaction = libc::SIG_DFL;
        libc::sigemptyset(&mut sa.sa_mask);
        libc::sigaction(libc::SIGBUS, &sa, std::ptr::null_mut());
        if code <= 0 {
            // Sent, not a fault: returning would not fault again.
            libc::syscall(libc::SYS_tgkill, libc::getpid(), libc::gettid(), libc::SIGBUS);
        }
    }
}

/// Replaces `[start, start + len)` with anonymous zero pages, in one call.
fn replace(start: usize, len: usize) -> bool {
    let flags = libc::MAP_FIXED | libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE;
    // SAFETY: the range is a registered client mapping, page-aligned and of
    // whole pages of its page size; MAP_FIXED replaces it atomically and
    // nothing but that mapping is there (see `on_sigbus`).
    let p = unsafe { libc::mmap(start as *mut libc::c_void, len, libc::PROT_READ | libc::PROT_WRITE, flags, -1, 0) };
    p as usize == start
}

/// One line on stderr, formatted without allocation.
fn say(addr: usize, start: usize, len: usize) {
    let mut b = [0u8; 160];
    let mut n = 0;
    let mut put = |s: &[u8]| {
        for &c in s {
            if n < b.len() {
                b[n] = c;
                n += 1;
            }
        }
    };
    let hex = |v: usize| {
        let mut d = [0u8; 18];
        d[0] = b'0';
        d[1] = b'x';
        for i in 0..16 {
            let nib = (v >> ((15 - i) * 4)) & 0xf;
            d[2 + i] = b"0123456789abcdef"[nib];
        }
        d
    };
    put(b"iopath: SIGBUS at ");
    put(&hex(addr));
    put(b" in client memory ");
    put(&hex(start));
    put(b"+");
    put(&hex(len));
    put(b" (its client shrank it): replaced by zero pages, the session ends\n");
    // SAFETY: write(2) of a stack buffer is async-signal-safe.
    unsafe { libc::write(2, b.as_ptr().cast(), n) };
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs::File;
    use std::io::Read;
    use std::os::unix::fs::FileExt;
    use std::os::unix::net::UnixStream;
    use vm_memory::FileOffset;

    /// A memfd of `len` bytes, not sealed: its holder can truncate it.
    fn memfd(len: u64) -> File {
        let f = crate::testing::memfd("iopath-sigbus-test");
        f.set_len(len).unwrap();
        f
    }

    fn map(f: &File, len: usize) -> MmapRegion<()> {
        vm_memory::mmap::MmapRegionBuilder::<()>::new(len)
            .with_file_offset(FileOffset::new(f.try_clone().unwrap(), 0))
            .with_mmap_prot(libc::PROT_READ | libc::PROT_WRITE)
            .with_mmap_flags(libc::MAP_SHARED)
            .build()
            .unwrap()
    }

    fn load(g: &Guarded, off: usize) -> u64 {
        // SAFETY: inside the guarded mapping, which `g` keeps mapped; 8-byte aligned.
        unsafe { std::ptr::read_volatile(g.as_ptr().add(off).cast::<u64>()) }
    }

    fn store(g: &Guarded, off: usize, v: u64) {
        // SAFETY: as in `load`.
        unsafe { std::ptr::write_volatile(g.as_ptr().add(off).cast::<u64>(), v) }
    }

    #[test]
    fn a_load_and_a_store_on_a_truncated_mapping_read_zeros_poison_it_and_touch_nothing_else() {
        let (mine, theirs) = UnixStream::pair().unwrap();
        let owner = Owner::new(Some(&theirs)).unwrap();
        let other_owner = Owner::new(None::<&File>).unwrap();
        let (a, b) = (memfd(0x4000), memfd(0x4000));
        let ga = Guarded::new(map(&a, 0x4000), 4096, &owner).unwrap();
        let gb = Guarded::new(map(&b, 0x4000), 4096, &other_owner).unwrap();
        store(&ga, 0x1000, 0x1111);
        store(&gb, 0x1000, 0x2222);
        assert_eq!(lookup(ga.as_ptr() as usize + 0x3fff).map(|(_, s, l)| (s, l)), Some(ga.range()));
        assert!(!ga.poisoned() && !owner.poisoned());
        a.set_len(0).unwrap();
        // Each access faults once, the handler replaces the mapping, the access retries.
        assert_eq!(load(&ga, 0x1000), 0, "zero pages after the truncation");
        store(&ga, 0x2000, 0x3333);
        assert_eq!(load(&ga, 0x2000), 0x3333, "the zero pages are private and writable");
        assert!(ga.poisoned() && owner.poisoned());
        // The owner's session socket was shut down for reading: its read ends at once.
        let mut buf = [0u8; 1];
        assert_eq!((&theirs).read(&mut buf).unwrap(), 0);
        drop(mine);
        // The other mapping, its owner and its file are as they were.
        assert!(!gb.poisoned() && !other_owner.poisoned());
        assert_eq!(load(&gb, 0x1000), 0x2222);
        let mut w = [0u8; 8];
        b.read_exact_at(&mut w, 0x1000).unwrap();
        assert_eq!(u64::from_le_bytes(w), 0x2222);
        // Nothing of the zero pages reaches the truncated file.
        assert_eq!(a.metadata().unwrap().len(), 0);
    }

    #[test]
    fn an_entry_lives_exactly_as_long_as_a_reference_to_its_mapping() {
        let owner = Owner::new(None::<&File>).unwrap();
        let f = memfd(0x2000);
        let g = Guarded::new(map(&f, 0x2000), 4096, &owner).unwrap();
        let (start, slot) = (g.as_ptr() as usize, g.slot);
        // The session lets go; a device thread still holds the mapping and
        // faults on it after the truncation: its entry is still there.
        let held = g.clone();
        drop(g);
        f.set_len(0).unwrap();
        let t = std::thread::spawn(move || {
            let v = load(&held, 8);
            assert!(lookup(held.as_ptr() as usize).is_some(), "the entry outlives the faulting access");
            (v, held.poisoned())
        });
        assert_eq!(t.join().unwrap(), (0, true));
        // The thread's reference was the last: the entry is gone and its slot free (or another's).
        let s = &SLOTS[slot];
        assert!(!s.used.load(Ordering::Acquire) || s.start.load(Ordering::Acquire) != start);
        assert!(lookup(start).is_none_or(|(s, _, _)| !std::ptr::eq(s, &SLOTS[slot])));
        assert!(owner.poisoned());
    }

    /// Child mode of the test below (the environment says so): a fault
    /// outside every entry, with entries registered.
    const CHILD: &str = "IOPATH_SIGBUS_TEST_CHILD";

    #[test]
    fn a_fault_outside_client_memory_still_kills_the_process_with_sigbus() {
        if std::env::var_os(CHILD).is_some() {
            let no_core = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
            // SAFETY: setrlimit reads the struct it is given (no core file of this expected death).
            unsafe { libc::setrlimit(libc::RLIMIT_CORE, &no_core) };
            let owner = Owner::new(None::<&File>).unwrap();
            let registered = memfd(0x1000);
            let _g = Guarded::new(map(&registered, 0x1000), 4096, &owner).unwrap();
            let f = memfd(0x1000);
            let m = map(&f, 0x1000);
            f.set_len(0).unwrap();
            // SAFETY: a read of our own mapping; it faults (the file is empty) and must kill us.
            let v = unsafe { std::ptr::read_volatile(m.as_ptr()) };
            eprintln!("the fault was swallowed: read {v}");
            std::process::exit(0);
        }
        use std::os::unix::process::ExitStatusExt;
        let name = "sigbus::tests::a_fault_outside_client_memory_still_kills_the_process_with_sigbus";
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args([name, "--exact", "--nocapture", "--test-threads=1"])
            .env(CHILD, "1")
            .output()
            .unwrap();
        assert_eq!(
            out.status.signal(),
            Some(libc::SIGBUS),
            "{:?}: {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }
}
