//! Block backends of the NVMe namespace: `null` (no data: dispatch cost
//! only), `ram` (keeps data in an anonymous mapping), `file:PATH` (O_DIRECT
//! reads, writes and flushes through io_uring, many in flight, on the
//! guest's pages in place where O_DIRECT's alignment allows (`guest.rs`),
//! otherwise one whole transfer per command in a bounce buffer of its own;
//! where O_DIRECT or io_uring is refused, synchronous pread/pwrite).
//! Callers pass LBA ranges already checked against the namespace.

mod guest;
pub use guest::{InPlace, Placed};

use crate::{Error, Result};
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::sync::Arc;
use vmm_sys_util::eventfd::EventFd;

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum BackendKind {
    Null,
    Ram,
    File(std::path::PathBuf),
}

impl std::str::FromStr for BackendKind {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "null" => Ok(BackendKind::Null),
            "ram" => Ok(BackendKind::Ram),
            f if f.starts_with("file:") && f.len() > 5 => Ok(BackendKind::File(f[5..].into())),
            _ => Err(Error::Option {
                device: "nvme",
                option: "backend".into(),
                reason: format!("unknown backend {s:?} (null, ram, file:PATH)"),
            }),
        }
    }
}

/// `null`, `ram` or `file:PATH`, as [`FromStr`](std::str::FromStr) takes
/// them (a path that is not UTF-8 is written lossily).
impl std::fmt::Display for BackendKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            BackendKind::Null => f.write_str("null"),
            BackendKind::Ram => f.write_str("ram"),
            BackendKind::File(p) => write!(f, "file:{}", p.display()),
        }
    }
}

pub enum Backend {
    Null,
    Ram(Vec<u8>),
    File(Box<FileBackend>),
}

/// Operations a file namespace keeps in flight at most: its io_uring's
/// size, and the slots (bounce buffers) commands take.
pub const FILE_SLOTS: usize = 256;

/// A slot's buffer: the largest transfer a command may ask for (MDTS).
const SLOT_BYTES: usize = (super::queue::PAGE as usize) << super::MDTS;

/// Pushed operations are submitted at the latest once the bounced writes
/// among them copied this much (see `pushed`).
const SUBMIT_BYTES: usize = 256 << 10;

/// What an io_uring slot does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FileOp {
    Read,
    /// `dsync`: stable before it completes (the write cache is off).
    Write {
        dsync: bool,
    },
    /// fdatasync, started only when every operation submitted before it has
    /// completed (IOSQE_IO_DRAIN).
    Flush,
}

/// What one slot's operation does (its buffer is in the [`Arena`]).
#[derive(Clone, Copy)]
struct Slot {
    op: FileOp,
    off: u64,
    len: usize,
    /// Its buffer is registered as fixed buffer number `slot`.
    registered: bool,
    /// Its operation works on guest pages in place, not on its buffer.
    guest: bool,
}

/// The slots' buffers, [`SLOT_BYTES`] each, in one anonymous mapping that is
/// 2 MiB aligned and advised for transparent huge pages. A transfer inside
/// a huge page is physically contiguous, so the block layer sends it to the
/// disk as one segment, not one per 4 KiB page: a virtual disk that costs
/// per segment serves it faster (64 KiB random writes on this host's disk:
/// 21-24 k IOPS from huge pages against 9-11 k from 4 KiB ones, fio). Where
/// the kernel gives no huge page they are ordinary pages. Pages are backed
/// on first use, so an idle namespace costs address space only.
struct Arena {
    map: *mut libc::c_void,
    map_len: usize,
    base: *mut u8,
}

// SAFETY: the mapping is owned by the Arena alone; slices of it are handed
// out through `&mut self` only.
unsafe impl Send for Arena {}

impl Arena {
    const HUGE: usize = 2 << 20;

    fn new() -> std::io::Result<Arena> {
        let bytes = FILE_SLOTS * SLOT_BYTES;
        let map_len = bytes + Self::HUGE;
        let map = anon_map(map_len)?;
        let base = map.cast::<u8>().wrapping_add((Self::HUGE - map as usize % Self::HUGE) % Self::HUGE);
        // SAFETY: `bytes` from `base` lie inside the mapping. Advice only:
        // without it (no THP here) the buffers are ordinary pages.
        unsafe { libc::madvise(base.cast(), bytes, libc::MADV_HUGEPAGE) };
        Ok(Arena { map, map_len, base })
    }

    /// Slot `slot`'s whole buffer: start and length.
    fn whole(&self, slot: u16) -> (*mut u8, usize) {
        assert!((slot as usize) < FILE_SLOTS);
        (self.base.wrapping_add(slot as usize * SLOT_BYTES), SLOT_BYTES)
    }

    /// Slot `slot`'s buffer, `len` bytes (at most [`SLOT_BYTES`]: commands
    /// were checked against MDTS).
    fn get(&mut self, slot: u16, len: usize) -> &mut [u8] {
        assert!(len <= SLOT_BYTES, "a {len}-byte transfer is over MDTS");
        // SAFETY: inside the mapping (`whole` checks the slot), and borrowed
        // from `&mut self`, so no other slice of it is live.
        unsafe { std::slice::from_raw_parts_mut(self.whole(slot).0, len) }
    }

    /// Leaves the mapping to the kernel that may still write to it.
    fn leak(&mut self) {
        self.map_len = 0;
    }
}

impl Drop for Arena {
    fn drop(&mut self) {
        if self.map_len > 0 {
            // SAFETY: the mapping made in `new`, no longer used.
            unsafe { libc::munmap(self.map, self.map_len) };
        }
    }
}

/// A fresh private anonymous mapping of `len` bytes, read-write, backed on
/// first use (MAP_NORESERVE); the caller unmaps it.
pub(super) fn anon_map(len: usize) -> std::io::Result<*mut libc::c_void> {
    // SAFETY: a new mapping, no address asked for and no memory of ours passed.
    let map = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
            -1,
            0,
        )
    };
    if map == libc::MAP_FAILED {
        return Err(std::io::Error::last_os_error());
    }
    Ok(map)
}

/// The asynchronous side of a file namespace: an io_uring on the O_DIRECT
/// fd (registered as fixed file 0), whose completions signal `done`, and
/// which can do nothing but this namespace's I/O ([`restrictions`]).
/// Operations work on the guest's pages in place (`guest.rs`: their memory
/// is kept mapped until they are reaped) or read into or write from bounce
/// buffers of their own (the slots), which live as long as the ring.
/// Each slot's buffer is registered as fixed buffer number `slot` at its
/// first use (the kernel then pins it once, not on every operation); where
/// registering is refused (RLIMIT_MEMLOCK), operations use plain buffers.
struct Uring {
    /// Kept open for the ring, which knows it as fixed file 0.
    _direct: File,
    ring: io_uring::IoUring,
    done: Arc<EventFd>,
    slots: Vec<Slot>,
    arena: Arena,
    free: Vec<u16>,
    /// Pushed (submitted or not) and not yet reaped.
    in_flight: usize,
    /// The fixed buffer table exists and registering has not been refused.
    fixed_bufs: bool,
    /// Operations on guest pages in place: their pieces, per slot.
    iovs: Vec<guest::Iovecs>,
    /// Of `in_flight`, those on guest pages in place.
    guest_ops: usize,
    /// The memories those pages belong to, kept mapped until none is in
    /// flight (one, unless the controller gave a memory up while its
    /// operations were still out).
    keep: Vec<crate::GuestMem>,
    /// O_DIRECT's alignment of memory addresses and of each piece's length.
    dio_align: (usize, usize),
}

/// io_uring_register(2)'s opcode for updating registered buffers in place:
/// the one registration a ring allows once it is enabled ([`Uring::register`]).
pub const IORING_REGISTER_BUFFERS_UPDATE: u8 = 16;

/// What a file namespace's ring may do once enabled, registered with
/// IORING_REGISTER_RESTRICTIONS: the operations `push` and `push_guest`
/// submit, each on fixed file 0 (IOSQE_FIXED_FILE required, IOSQE_IO_DRAIN
/// allowed: a flush), and buffer updates. Anything else (an open, a socket
/// operation, a plain fd) completes with EACCES: the ring cannot reach
/// what the process's sandbox refuses its system calls.
fn restrictions() -> Vec<io_uring::register::Restriction> {
    use io_uring::{opcode, register::Restriction, squeue::Flags};
    let ops = [
        opcode::Read::CODE,
        opcode::Readv::CODE,
        opcode::ReadFixed::CODE,
        opcode::Write::CODE,
        opcode::Writev::CODE,
        opcode::WriteFixed::CODE,
        opcode::Fsync::CODE,
    ];
    let mut r: Vec<_> = ops.into_iter().map(Restriction::sqe_op).collect();
    r.push(Restriction::sqe_flags_allowed((Flags::FIXED_FILE | Flags::IO_DRAIN).bits()));
    r.push(Restriction::sqe_flags_required(Flags::FIXED_FILE.bits()));
    r.push(Restriction::register_op(IORING_REGISTER_BUFFERS_UPDATE));
    r
}

/// A ring of `entries` created disabled (IORING_SETUP_R_DISABLED, Linux
/// 5.10), so that its restrictions can be registered before it runs; false
/// with a plain ring where the kernel has no such flag.
fn disabled_ring(entries: u32) -> std::io::Result<(io_uring::IoUring, bool)> {
    match io_uring::IoUring::builder().setup_r_disabled().build(entries) {
        Ok(r) => Ok((r, true)),
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
            log::warn!(
                "nvme: this kernel's io_uring has no restrictions (IORING_SETUP_R_DISABLED: Linux 5.10); \
                 the file backend's ring may make any io_uring operation"
            );
            Ok((io_uring::IoUring::new(entries)?, false))
        }
        Err(e) => Err(e),
    }
}

impl Uring {
    fn new(file: File) -> std::io::Result<Uring> {
        use std::os::fd::AsRawFd;
        let (ring, disabled) = disabled_ring(FILE_SLOTS as u32)?;
        ring.submitter().register_files(&[file.as_raw_fd()])?;
        let done = EventFd::new(libc::EFD_CLOEXEC)?;
        ring.submitter().register_eventfd(done.as_raw_fd())?;
        let fixed_bufs = ring.submitter().register_buffers_sparse(FILE_SLOTS as u32).is_ok();
        if disabled {
            ring.submitter().register_restrictions(&mut restrictions())?;
            ring.submitter().register_enable_rings()?;
        }
        let slots = vec![Slot { op: FileOp::Read, off: 0, len: 0, registered: false, guest: false }; FILE_SLOTS];
        let arena = Arena::new()?;
        let free = (0..FILE_SLOTS as u16).rev().collect();
        let dio_align = guest::dio_align(&file);
        Ok(Uring {
            _direct: file,
            ring,
            done: Arc::new(done),
            slots,
            arena,
            free,
            in_flight: 0,
            fixed_bufs,
            iovs: (0..FILE_SLOTS).map(|_| guest::Iovecs::default()).collect(),
            guest_ops: 0,
            keep: Vec::new(),
            dio_align,
        })
    }

    /// Makes slot `slot`'s buffer its fixed buffer if it is not yet. False
    /// if it cannot be.
    fn register(&mut self, slot: u16) -> bool {
        if self.slots[slot as usize].registered {
            return true;
        }
        if !self.fixed_bufs {
            return false;
        }
        let (start, cap) = self.arena.whole(slot);
        let iov = libc::iovec { iov_base: start.cast(), iov_len: cap };
        // SAFETY: the buffer is this slot's part of the arena, which lives as
        // long as the ring (Drop waits for the operations before either goes).
        match unsafe { self.ring.submitter().register_buffers_update(slot as u32, &[iov], None) } {
            Ok(()) => {
                self.slots[slot as usize].registered = true;
                true
            }
            Err(e) => {
                log::info!("nvme: no fixed io_uring buffers ({e}); using plain ones");
                self.fixed_bufs = false;
                false
            }
        }
    }
}

impl Drop for Uring {
    /// The kernel may still copy into a slot's buffer: wait for every
    /// operation before the buffers go (or leak them if waiting fails).
    fn drop(&mut self) {
        while self.in_flight > 0 {
            match self.ring.submit_and_wait(1) {
                Ok(_) => {}
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => {
                    log::warn!("nvme: io_uring wait at close: {e}; {} buffers leaked", self.in_flight);
                    self.arena.leak();
                    // Guest memory too: the kernel may still move data to or from it.
                    std::mem::forget(std::mem::take(&mut self.keep));
                    return;
                }
            }
            self.in_flight -= self.ring.completion().count().min(self.in_flight);
        }
    }
}

/// A file namespace: a buffered fd always, and when the filesystem and
/// kernel allow, an O_DIRECT fd driven through io_uring with up to
/// [`FILE_SLOTS`] operations in flight.
pub struct FileBackend {
    file: File,
    uring: Option<Uring>,
    /// Operations that completed through io_uring with O_DIRECT.
    pub direct_ops: u64,
    /// Of those, the ones on guest pages in place.
    pub in_place_ops: u64,
    /// Which reads and writes work on guest pages in place (`guest.rs`).
    pub in_place: InPlace,
    /// Pushed operations go to the kernel once this many wait in the ring
    /// (0: when the queue pass that pushed them ends, or a bounced write's
    /// copies reach [`SUBMIT_BYTES`]). One at a time costs a system call
    /// per operation but hands a disk a steady stream instead of bursts: on
    /// this project's virtual disk, 4 KiB randread QD32 did 0.97-1.00x of
    /// fio with 1 and 0.82-0.89x with 0 (fio itself lost as much with
    /// iodepth_batch_submit=16); on a loop device over /dev/shm, where the
    /// CPUs are the limit, 1 did 0.63-0.65x and 0 did 0.93-1.00x.
    pub submit_batch: usize,
    /// The most operations that were in flight at once (after a submit).
    pub max_in_flight: u64,
    /// The last submit left operations in the ring (the kernel refused
    /// them for now: EAGAIN, ENOMEM): the device thread retries them.
    stalled: bool,
    /// Bytes of the operations pushed since the last submit.
    unsent_bytes: usize,
    /// Tests: the next submits fail as if the kernel were short of memory.
    #[cfg(test)]
    pub fail_submits: u32,
}

vmm_sys_util::ioctl_ior_nr!(BLKGETSIZE64, 0x12, 114, u64);

/// The bytes `f` holds: a regular file's length, or a block device's size
/// (which its inode's length does not give).
pub fn backing_bytes(f: &File) -> std::io::Result<u64> {
    use std::os::unix::fs::FileTypeExt;
    let m = f.metadata()?;
    if !m.file_type().is_block_device() {
        return Ok(m.len());
    }
    let mut size = 0u64;
    // SAFETY: BLKGETSIZE64 writes one u64, into `size`, which outlives the call.
    let r = unsafe { vmm_sys_util::ioctl::ioctl_with_mut_ref(f, BLKGETSIZE64(), &mut size) };
    if r < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(size)
}

/// The bytes at `p` (see [`backing_bytes`]); 0 where there is nothing to open.
pub fn path_bytes(p: &std::path::Path) -> u64 {
    File::open(p).and_then(|f| backing_bytes(&f)).unwrap_or(0)
}

impl FileBackend {
    /// Opens `p` for a namespace of `bytes`: a regular file or block device
    /// that is there and holds them (`crate::backing`; never made, extended
    /// or truncated here).
    fn open(p: &std::path::Path, bytes: u64) -> Result<Self> {
        let f = crate::backing::open_rw(p, bytes)?;
        use std::os::unix::fs::OpenOptionsExt;
        // O_NOATIME: every read of a block device (or of a file mounted
        // relatime) otherwise goes through the kernel's atime check, about
        // 5 % of the device thread's CPU per 4 KiB read on a loop device.
        // Only the file's owner (or CAP_FOWNER) may ask for it.
        let open_direct = |flags| std::fs::OpenOptions::new().read(true).write(true).custom_flags(flags).open(p);
        let direct = match open_direct(libc::O_DIRECT | libc::O_NOATIME) {
            Err(e) if e.raw_os_error() == Some(libc::EPERM) => open_direct(libc::O_DIRECT),
            r => r,
        };
        let uring = match direct {
            Err(e) => {
                log::info!("{}: no O_DIRECT here ({e}); using pread/pwrite", p.display());
                None
            }
            Ok(d) => match Uring::new(d) {
                Ok(u) => Some(u),
                Err(e) => {
                    log::info!("io_uring unavailable ({e}); using pread/pwrite");
                    None
                }
            },
        };
        Ok(FileBackend {
            file: f,
            uring,
            direct_ops: 0,
            in_place_ops: 0,
            in_place: InPlace::Auto,
            submit_batch: 0,
            max_in_flight: 0,
            stalled: false,
            unsent_bytes: 0,
            #[cfg(test)]
            fail_submits: 0,
        })
    }

    /// True when commands go through io_uring (asynchronously).
    pub fn is_async(&self) -> bool {
        self.uring.is_some()
    }

    /// The eventfd io_uring signals on each completion.
    pub fn completion_fd(&self) -> Option<Arc<EventFd>> {
        self.uring.as_ref().map(|u| u.done.clone())
    }

    /// Operations pushed and not yet reaped.
    pub fn in_flight(&self) -> usize {
        self.uring.as_ref().map_or(0, |u| u.in_flight)
    }

    /// Takes a free slot (None: all [`FILE_SLOTS`] are taken, or no io_uring).
    pub fn take_slot(&mut self) -> Option<u16> {
        self.uring.as_mut()?.free.pop()
    }

    /// True if a slot is free (or commands are served synchronously).
    pub fn has_room(&self) -> bool {
        self.uring.as_ref().is_none_or(|u| !u.free.is_empty())
    }

    /// Gives a slot back; its operation must have been reaped (or never pushed).
    pub fn release(&mut self, slot: u16) {
        if let Some(u) = self.uring.as_mut() {
            debug_assert!(!u.free.contains(&slot));
            u.free.push(slot);
        }
    }

    /// Slot `slot`'s buffer, `len` bytes, 4 KiB aligned (not while its
    /// operation is in flight).
    pub fn buffer(&mut self, slot: u16, len: usize) -> &mut [u8] {
        self.uring.as_mut().expect("a slot is taken from the io_uring").arena.get(slot, len)
    }

    /// Queues slot `slot`'s operation on the ring (sent at the next
    /// [`submit`](Self::submit)); `len` bytes of its buffer at byte `off`.
    /// False if the ring refused it (the slot is still the caller's).
    pub fn push(&mut self, slot: u16, op: FileOp, off: u64, len: usize) -> bool {
        use io_uring::{opcode, squeue::Flags, types};
        let Some(u) = self.uring.as_mut() else { return false };
        let ptr = u.arena.get(slot, len).as_mut_ptr();
        let fixed = op != FileOp::Flush && u.register(slot);
        let s = &mut u.slots[slot as usize];
        (s.op, s.off, s.len, s.guest) = (op, off, len, false);
        let fd = types::Fixed(0);
        let (n, flags) = (len as u32, if op == (FileOp::Write { dsync: true }) { libc::RWF_DSYNC } else { 0 });
        let e = match op {
            FileOp::Read if fixed => opcode::ReadFixed::new(fd, ptr, n, slot).offset(off).build(),
            FileOp::Read => opcode::Read::new(fd, ptr, n).offset(off).build(),
            FileOp::Write { .. } if fixed => {
                opcode::WriteFixed::new(fd, ptr, n, slot).offset(off).rw_flags(flags).build()
            }
            FileOp::Write { .. } => opcode::Write::new(fd, ptr, n).offset(off).rw_flags(flags).build(),
            FileOp::Flush => opcode::Fsync::new(fd).flags(types::FsyncFlags::DATASYNC).build().flags(Flags::IO_DRAIN),
        }
        .user_data(slot as u64);
        // SAFETY: the buffer is the slot's own and stays put (it is neither
        // resized nor freed) until this operation's completion is reaped:
        // the slot is not given back before that, and Drop waits for it.
        if unsafe { u.ring.submission().push(&e) }.is_err() {
            return false;
        }
        self.pushed(if matches!(op, FileOp::Write { .. }) { len } else { 0 });
        true
    }

    /// Counts an operation just pushed, `copied` bytes gathered into its
    /// bounce buffer before; submits what was pushed once the copies add up
    /// to [`SUBMIT_BYTES`] or [`submit_batch`](Self::submit_batch) operations wait.
    fn pushed(&mut self, copied: usize) {
        let batch_full = match self.uring.as_mut() {
            Some(u) => {
                u.in_flight += 1;
                self.submit_batch > 0 && u.ring.submission().len() >= self.submit_batch
            }
            None => false,
        };
        // A queue pass pushes many and submits once, but bounced writes are
        // copied into their slots as they are pushed (64 KiB: several us
        // each): the first would wait for every copy after it. Submitted
        // every SUBMIT_BYTES of copies instead, so the file sees them while
        // the rest copy. Reads and transfers in place copy nothing first.
        self.unsent_bytes += copied;
        if self.unsent_bytes >= SUBMIT_BYTES || batch_full {
            self.submit();
        }
    }

    /// Sends every pushed operation to the kernel, without waiting. What
    /// the kernel does not take stays in the ring for the next submit; the
    /// first time, the completion eventfd is signalled so that the device
    /// thread wakes (no completion may come to wake it) and retries.
    pub fn submit(&mut self) {
        self.unsent_bytes = 0;
        let Some(u) = self.uring.as_mut() else { return };
        while !u.ring.submission().is_empty() {
            #[cfg(test)]
            if self.fail_submits > 0 {
                self.fail_submits -= 1;
                break;
            }
            match u.ring.submit() {
                Ok(0) => break, // nothing taken: try again next time rather than spin
                Ok(_) => {}
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                // Kept in the ring: the next submit (each pass, each reap) sends them.
                Err(e) => {
                    log::debug!("nvme: io_uring submit: {e}");
                    break;
                }
            }
        }
        let unsent = u.ring.submission().len();
        self.max_in_flight = self.max_in_flight.max((u.in_flight - unsent) as u64);
        if unsent > 0 && !self.stalled {
            let _ = u.done.write(1);
        }
        self.stalled = unsent > 0;
    }

    /// Tests: what the taken slots do.
    #[cfg(test)]
    pub fn taken_ops(&self) -> Vec<FileOp> {
        let Some(u) = &self.uring else { return Vec::new() };
        (0..FILE_SLOTS as u16).filter(|s| !u.free.contains(s)).map(|s| u.slots[s as usize].op).collect()
    }

    /// Operations wait in the ring for a submit the kernel refused.
    pub fn stalled(&self) -> bool {
        self.stalled
    }

    /// Blocks until an operation completes; false if none is in flight or
    /// waiting failed.
    pub fn wait(&mut self) -> bool {
        let Some(u) = self.uring.as_mut() else { return false };
        if u.in_flight == 0 {
            return false;
        }
        loop {
            match u.ring.submit_and_wait(1) {
                Ok(_) => return true,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => {
                    log::warn!("nvme: io_uring wait: {e}");
                    return false;
                }
            }
        }
    }

    /// Blocks until an operation completes or `timeout` passed (sends what
    /// an earlier submit left in the ring first); false if none is in
    /// flight, the time passed or waiting failed.
    pub fn wait_for(&mut self, timeout: std::time::Duration) -> bool {
        use std::os::fd::AsRawFd;
        self.submit();
        let Some(u) = self.uring.as_mut() else { return false };
        if u.in_flight == 0 {
            return false;
        }
        if !u.ring.completion().is_empty() {
            return true;
        }
        // The ring's fd is readable while its completion queue holds an entry.
        let mut p = libc::pollfd { fd: u.ring.as_raw_fd(), events: libc::POLLIN, revents: 0 };
        let ms = timeout.as_millis().clamp(1, i32::MAX as u128) as i32;
        // SAFETY: one valid pollfd.
        match unsafe { libc::poll(&mut p, 1, ms) } {
            n if n > 0 => true,
            0 => false,
            _ => {
                let e = std::io::Error::last_os_error();
                if e.kind() != std::io::ErrorKind::Interrupted {
                    log::warn!("nvme: io_uring wait: {e}");
                    return false;
                }
                true // the caller looks again (and checks its deadline)
            }
        }
    }

    /// The next completed operation, without waiting: its slot and result.
    /// The slot stays taken (its buffer holds the data read) until
    /// [`release`](Self::release). A read or write the filesystem refuses
    /// O_DIRECT for (EINVAL: its block size) is done here with the buffered fd.
    pub fn reap(&mut self) -> Option<(u16, std::io::Result<()>)> {
        let u = self.uring.as_mut()?;
        let c = u.ring.completion().next()?;
        u.in_flight -= 1;
        let slot = c.user_data() as u16;
        let Some(&s) = u.slots.get(slot as usize) else {
            return self.reap(); // not one of ours (cannot be: user_data is a slot)
        };
        let n = c.result();
        if s.guest {
            let r = self.reap_guest(slot, n);
            return Some((slot, r));
        }
        let r = match s.op {
            FileOp::Flush if n == 0 => Ok(()),
            FileOp::Read | FileOp::Write { .. } if n >= 0 && n as usize == s.len => {
                self.direct_ops += 1;
                Ok(())
            }
            FileOp::Read if n == -libc::EINVAL => self.file.read_exact_at(u.arena.get(slot, s.len), s.off),
            FileOp::Write { dsync } if n == -libc::EINVAL => {
                let r = self.file.write_all_at(u.arena.get(slot, s.len), s.off);
                if dsync {
                    r.and_then(|()| self.file.sync_data())
                } else {
                    r
                }
            }
            _ if n < 0 => Err(std::io::Error::from_raw_os_error(-n)),
            _ => Err(std::io::Error::new(std::io::ErrorKind::UnexpectedEof, "short O_DIRECT transfer")),
        };
        Some((slot, r))
    }
}

/// A buffer aligned for O_DIRECT (4 KiB), for whole transfers.
pub struct Bounce(Vec<u8>, usize);

impl Bounce {
    pub fn new(len: usize) -> Self {
        let v = vec![0u8; len + 4096];
        let start = v.as_ptr().align_offset(4096);
        Bounce(v, start)
    }
    pub fn get(&mut self, len: usize) -> &mut [u8] {
        if self.0.len() < self.1 + len {
            *self = Bounce::new(len);
        }
        &mut self.0[self.1..self.1 + len]
    }
}

impl Backend {
    pub fn open(kind: &BackendKind, bytes: u64) -> Result<Self> {
        Ok(match kind {
            BackendKind::Null => Backend::Null,
            BackendKind::Ram => {
                let n = usize::try_from(bytes).map_err(|_| Error::Option {
                    device: "nvme",
                    option: "size_mb".into(),
                    reason: "namespace too large".into(),
                })?;
                // vec! of zeros is calloc: pages are mapped on first touch.
                Backend::Ram(vec![0u8; n])
            }
            BackendKind::File(p) => Backend::File(Box::new(FileBackend::open(p, bytes)?)),
        })
    }

    pub fn name(&self) -> &'static str {
        match self {
            Backend::Null => "null",
            Backend::Ram(_) => "ram",
            Backend::File(_) => "file",
        }
    }

    /// Reads `buf.len()` bytes at byte offset `off` (null: zeros are not
    /// even written, as a null device transfers no data).
    pub fn read(&mut self, off: u64, buf: &mut [u8]) -> std::io::Result<()> {
        match self {
            Backend::Null => Ok(()),
            Backend::Ram(v) => {
                let o = off as usize;
                buf.copy_from_slice(&v[o..o + buf.len()]);
                Ok(())
            }
            Backend::File(f) => f.file.read_exact_at(buf, off),
        }
    }

    pub fn write(&mut self, off: u64, buf: &[u8]) -> std::io::Result<()> {
        match self {
            Backend::Null => Ok(()),
            Backend::Ram(v) => {
                let o = off as usize;
                v[o..o + buf.len()].copy_from_slice(buf);
                Ok(())
            }
            Backend::File(f) => f.file.write_all_at(buf, off),
        }
    }

    pub fn zero(&mut self, off: u64, len: u64) -> std::io::Result<()> {
        match self {
            Backend::Null => Ok(()),
            Backend::Ram(v) => {
                v[off as usize..(off + len) as usize].fill(0);
                Ok(())
            }
            Backend::File(f) => {
                let z = vec![0u8; 64 << 10];
                let mut done = 0;
                while done < len {
                    let n = (len - done).min(z.len() as u64) as usize;
                    f.file.write_all_at(&z[..n], off + done)?;
                    done += n as u64;
                }
                Ok(())
            }
        }
    }

    pub fn flush(&mut self) -> std::io::Result<()> {
        match self {
            Backend::File(f) => f.file.sync_data(),
            _ => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsRawFd;

    #[test]
    fn ram_and_file_keep_data_null_keeps_none() {
        let path = std::env::temp_dir().join(format!("iopath-nvme-{}.img", std::process::id()));
        for kind in [BackendKind::Ram, BackendKind::File(path.clone()), BackendKind::Null] {
            let mut b = crate::backing::open(&kind, 1 << 20, kind == BackendKind::File(path.clone())).unwrap();
            b.write(4096, b"abcd").unwrap();
            let mut r = [0u8; 4];
            b.read(4096, &mut r).unwrap();
            assert_eq!(&r, if kind == BackendKind::Null { b"\0\0\0\0" } else { b"abcd" }, "{kind:?}");
            // Whole aligned transfers go O_DIRECT through io_uring where the file system allows.
            let mut bounce = Bounce::new(8192);
            let buf = bounce.get(8192);
            buf.fill(0x5a);
            b.write(8192, buf).unwrap();
            buf.fill(0);
            b.read(8192, buf).unwrap();
            if kind != BackendKind::Null {
                assert!(buf.iter().all(|&x| x == 0x5a), "{kind:?}");
            }
            b.zero(4096, 4096).unwrap();
            b.read(4096, &mut r).unwrap();
            assert_eq!(r, [0; 4]);
        }
        let _ = std::fs::remove_file(path);
        assert!("floppy".parse::<BackendKind>().is_err());
        assert_eq!("file:/x".parse::<BackendKind>().unwrap(), BackendKind::File("/x".into()));
        for s in ["null", "ram", "file:/x/y z.img"] {
            assert_eq!(s.parse::<BackendKind>().unwrap().to_string(), s, "round trip");
        }
        let e = "file:".parse::<BackendKind>().unwrap_err();
        assert!(matches!(&e, Error::Option { option, .. } if option == "backend"), "{e}");
    }

    /// Reaps `n` operations, each successful, waiting for them.
    fn reap_all(f: &mut FileBackend, n: usize) {
        for _ in 0..n {
            loop {
                match f.reap() {
                    Some((s, r)) => {
                        r.unwrap();
                        f.release(s);
                        break;
                    }
                    None => assert!(f.wait()),
                }
            }
        }
    }

    #[test]
    fn pushed_operations_go_to_the_kernel_once_they_add_up_to_submit_bytes() {
        let path = std::env::temp_dir().join(format!("iopath-nvme-batch-{}.img", std::process::id()));
        crate::backing::prepare(&BackendKind::File(path.clone()), 1 << 20, true).unwrap();
        let mut f = FileBackend::open(&path, 1 << 20).unwrap();
        if !f.is_async() {
            eprintln!("no O_DIRECT io_uring here: nothing to check");
            let _ = std::fs::remove_file(&path);
            return;
        }
        let per = SUBMIT_BYTES / 4;
        let unsent = |f: &mut FileBackend| f.uring.as_mut().unwrap().ring.submission().len();
        let mut slots = Vec::new();
        for i in 0..5 {
            let s = f.take_slot().unwrap();
            f.buffer(s, per).fill(i as u8);
            assert!(f.push(s, FileOp::Write { dsync: false }, (i * per) as u64, per));
            slots.push(s);
            // The fourth push made SUBMIT_BYTES: those four went without a submit call.
            assert_eq!(unsent(&mut f), if i < 3 { i + 1 } else { i - 3 }, "after push {i}");
        }
        f.submit();
        assert_eq!(unsent(&mut f), 0);
        reap_all(&mut f, 5);
        let _ = std::fs::remove_file(&path);
    }

    #[test]
    fn with_a_submit_batch_pushed_reads_go_to_the_kernel_every_that_many() {
        let path = std::env::temp_dir().join(format!("iopath-nvme-sbatch-{}.img", std::process::id()));
        crate::backing::prepare(&BackendKind::File(path.clone()), 1 << 20, true).unwrap();
        let mut f = FileBackend::open(&path, 1 << 20).unwrap();
        if !f.is_async() {
            eprintln!("no O_DIRECT io_uring here: nothing to check");
            let _ = std::fs::remove_file(&path);
            return;
        }
        let unsent = |f: &mut FileBackend| f.uring.as_mut().unwrap().ring.submission().len();
        let read = |f: &mut FileBackend, i: u64| {
            let s = f.take_slot().unwrap();
            assert!(f.push(s, FileOp::Read, i * 4096, 4096));
        };
        // 0 (the default): reads wait for the pass's submit; they copy nothing first.
        for i in 0..3 {
            read(&mut f, i);
        }
        assert_eq!(unsent(&mut f), 3);
        f.submit();
        // 1: each goes at its push; 2: every second one.
        f.submit_batch = 1;
        read(&mut f, 3);
        assert_eq!(unsent(&mut f), 0);
        f.submit_batch = 2;
        read(&mut f, 4);
        assert_eq!(unsent(&mut f), 1);
        read(&mut f, 5);
        assert_eq!(unsent(&mut f), 0);
        reap_all(&mut f, 6);
        let _ = std::fs::remove_file(&path);
    }

    /// The ring does this namespace's operations and nothing else: an open,
    /// a no-op, a read of a plain fd and a registration other than a buffer
    /// update all get EACCES, while a read of fixed file 0 goes through.
    #[test]
    fn the_ring_refuses_every_operation_but_the_namespaces_own() {
        use io_uring::{opcode, types};
        let path = std::env::temp_dir().join(format!("iopath-nvme-restrict-{}.img", std::process::id()));
        crate::backing::prepare(&BackendKind::File(path.clone()), 1 << 20, true).unwrap();
        let mut f = FileBackend::open(&path, 1 << 20).unwrap();
        let _ = std::fs::remove_file(&path);
        if !f.is_async() {
            eprintln!("no O_DIRECT io_uring here: nothing to check");
            return;
        }
        let plain_fd = f.file.as_raw_fd();
        let u = f.uring.as_mut().unwrap();
        let buf = u.arena.get(0, 4096).as_mut_ptr();
        let probes = [
            ("openat", opcode::OpenAt::new(types::Fd(libc::AT_FDCWD), c"/etc/hostname".as_ptr()).build()),
            ("nop", opcode::Nop::new().build()),
            ("read of a plain fd", opcode::Read::new(types::Fd(plain_fd), buf, 4096).build()),
            ("read of fixed file 0", opcode::Read::new(types::Fixed(0), buf, 4096).build()),
        ];
        let mut got = Vec::new();
        for (what, e) in probes {
            // SAFETY: the path and the buffer outlive the operation, which is waited for here.
            unsafe { u.ring.submission().push(&e.user_data(0)).unwrap() };
            u.ring.submit_and_wait(1).unwrap();
            got.push((what, u.ring.completion().next().unwrap().result()));
        }
        let eacces = -libc::EACCES;
        assert_eq!(
            got,
            [("openat", eacces), ("nop", eacces), ("read of a plain fd", eacces), ("read of fixed file 0", 4096)]
        );
        let e = u.ring.submitter().register_files_update(0, &[plain_fd]).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::EACCES), "{e}");
    }

    #[test]
    fn operations_in_flight_on_a_file_complete_with_their_data_through_fixed_buffers() {
        let path = std::env::temp_dir().join(format!("iopath-nvme-uring-{}.img", std::process::id()));
        crate::backing::prepare(&BackendKind::File(path.clone()), 1 << 20, true).unwrap();
        let mut f = FileBackend::open(&path, 1 << 20).unwrap();
        if !f.is_async() {
            eprintln!("no O_DIRECT io_uring here: nothing to check");
            return;
        }
        // 16 writes of growing sizes in flight at once, then a flush after them, then reads.
        let sizes = |i: usize| 512 * (i + 1);
        let mut slots = Vec::new();
        for i in 0..16 {
            let s = f.take_slot().unwrap();
            f.buffer(s, sizes(i)).fill(i as u8 + 1);
            assert!(f.push(s, FileOp::Write { dsync: i == 3 }, (i as u64) << 16, sizes(i)));
            slots.push(s);
        }
        let flush = f.take_slot().unwrap();
        assert!(f.push(flush, FileOp::Flush, 0, 0));
        f.submit();
        assert_eq!(f.max_in_flight, 17);
        let mut done = Vec::new();
        while done.len() < 17 {
            match f.reap() {
                Some((s, r)) => {
                    r.unwrap();
                    done.push(s);
                }
                None => assert!(f.wait()),
            }
        }
        assert_eq!(done.last(), Some(&flush), "the flush drained the writes before it");
        for &s in &done {
            f.release(s);
        }
        for (i, &s) in slots.iter().enumerate() {
            f.buffer(s, sizes(i)).fill(0);
            assert!(f.push(s, FileOp::Read, (i as u64) << 16, sizes(i)));
        }
        f.submit();
        for _ in 0..16 {
            let (s, r) = loop {
                match f.reap() {
                    Some(x) => break x,
                    None => assert!(f.wait()),
                }
            };
            r.unwrap();
            let i = slots.iter().position(|&x| x == s).unwrap();
            assert!(f.buffer(s, sizes(i)).iter().all(|&b| b == i as u8 + 1), "read {i}");
        }
        // The largest transfer, MDTS, through two slots' buffers.
        let (w, r) = (slots[0], slots[1]);
        f.buffer(w, 128 << 10).fill(0x77);
        assert!(f.push(w, FileOp::Write { dsync: false }, 0x80000, 128 << 10));
        f.submit();
        let reap_one = |f: &mut FileBackend| loop {
            match f.reap() {
                Some(x) => break x,
                None => assert!(f.wait()),
            }
        };
        reap_one(&mut f).1.unwrap();
        f.buffer(r, 128 << 10).fill(0);
        assert!(f.push(r, FileOp::Read, 0x80000, 128 << 10));
        f.submit();
        reap_one(&mut f).1.unwrap();
        assert!(f.buffer(r, 128 << 10).iter().all(|&b| b == 0x77), "read of a whole slot");
        assert_eq!(f.direct_ops, 34);
        assert_eq!(f.in_flight(), 0);
        let u = f.uring.as_ref().unwrap();
        if u.fixed_bufs {
            assert!(slots.iter().all(|&s| u.slots[s as usize].registered), "fixed buffers");
        }
        // The slots' buffers: 2 MiB aligned (a whole slot never straddles a
        // huge page), advised for huge pages.
        assert_eq!(u.arena.base as usize % Arena::HUGE, 0);
        assert_eq!(Arena::HUGE % SLOT_BYTES, 0);
        let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
        let base = format!("{:x}-", u.arena.base as usize);
        let flags = smaps.split('\n').skip_while(|l| !l.starts_with(&base)).find(|l| l.starts_with("VmFlags:"));
        let thp = std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled").is_ok();
        assert!(!thp || flags.is_some_and(|f| f.contains(" hg")), "MADV_HUGEPAGE: {flags:?}");
        let _ = std::fs::remove_file(path);
    }
}
