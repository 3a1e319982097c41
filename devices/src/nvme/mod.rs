//! An NVMe controller (NVMe 1.4 subset) with up to 32 namespaces
//! (`namespaces.rs` their options, `ns_admin.rs` their admin commands).
//!
//! BAR0 (64-bit memory, 16 KiB) holds the controller registers (CAP, VS,
//! INTMS/INTMC, CC, CSTS, AQA, ASQ, ACQ) and, from 0x1000, the doorbells
//! (stride 4: SQ y tail at 0x1000 + 8y, CQ y head at 0x1000 + 8y + 4).
//! Admin: Identify (controller, namespace, active and allocated namespace
//! lists, namespace identification descriptors), Format NVM, Create/Delete I/O SQ and CQ, Get/Set
//! Features (number of queues, interrupt coalescing, volatile write cache,
//! arbitration...), Get Log Page (error information, SMART, firmware,
//! changed namespace list, commands supported and effects; with offsets), Abort, Asynchronous Event Request, Doorbell
//! Buffer Config. Identify advertises only what is implemented.
//! I/O: Read, Write, Flush, Write Zeroes, Dataset Management, with PRP1/PRP2
//! and PRP lists. Completions carry phase tags for polling drivers; a CQ
//! created with IEN=1, and the admin CQ always (vector 0), signals its MSI-X
//! vector (65 vectors, table at BAR0 0x2000, PBA at 0x3000): the host turns
//! each vector into a KVM irqfd on the MSI route the guest programmed. A
//! vector that is masked (or MSI-X off) keeps its pending bit and fires when
//! unmasked. A host that keeps the MSI-X table itself (QEMU's vfio-user-pci)
//! gets every raised vector on its eventfd instead (`interrupts.rs`).
//!
//! Doorbell modes (how I/O queue doorbells reach the controller):
//! - `mmio`: every doorbell write exits to the VMM, and the vCPU thread
//!   processes the queue at once. Doorbell Buffer Config is not offered.
//! - `shm`: Doorbell Buffer Config is offered; a device thread polls the
//!   shadow doorbells in guest RAM and keeps each EventIdx behind the tail,
//!   so a driver that follows the EventIdx rule never writes the MMIO
//!   doorbell: no exit per I/O. A register write that does come only makes
//!   the controller look at the shadow (its value may be stale: a posted
//!   vfio-user write can arrive after newer shadow values were served).
//!   The shadow pages must be mapped memory: where the host reaches guest
//!   RAM by message (a vfio-user client's RAM without an fd, `crate::mem`),
//!   polling them would be a message per look, so Doorbell Buffer Config
//!   fails with Invalid Field there and doorbells are served as in `mmio`.
//! - `bar`: the doorbell page of BAR0 is memory the controller shares (a
//!   memfd): the host maps it into the guest at BAR0+0x1000, so a driver's
//!   plain MMIO doorbell stores land in it without an exit, and the polling
//!   thread reads them there, admin queue included. No Doorbell Buffer
//!   Config is needed (SPDK's mappable BAR0, vfio-user sparse mmap).
//! - `ioeventfd`: Doorbell Buffer Config is offered and every I/O doorbell
//!   is a KVM ioeventfd (one eventfd for all of them). An ioeventfd loses
//!   the written value, so the device thread, woken by it, takes the tails
//!   from the shadow doorbells; it keeps EventIdx at the tail it served so
//!   the driver rings on its next submission, and re-reads the shadow after
//!   publishing EventIdx so a submission that raced with it is not missed.
//!   Until the driver configures the buffer, doorbell writes exit as in
//!   `mmio` (their value is needed). In a device process, whose host
//!   announces ioeventfds once when its client attaches, every I/O doorbell
//!   is an ioeventfd from attach on (see `doorbells.rs`): there a driver
//!   must configure the buffer before it creates I/O queues.
//! - `adaptive`: `shm` while work comes; after [`ADAPTIVE_IDLE`] without
//!   any (less, down to [`ADAPTIVE_IDLE_MIN`], while its sleeps are longer
//!   than that: `poller/idle.rs`, `IdleWindow`; [`ADAPTIVE_IDLE_IO`], yielding the core between looks, when only file
//!   operations are in flight: their completion eventfd wakes it too), the poller sets every I/O
//!   SQ's EventIdx to the tail it served (the driver's next submission
//!   also writes the doorbell register, an
//!   ioeventfd as in `ioeventfd` mode), re-reads the shadow tails (a
//!   submission that raced with EventIdx is served, not slept on) and sleeps
//!   on the eventfd; a kick puts it back to polling, which moves EventIdx
//!   behind again. Where the doorbell is no ioeventfd (mpqemu, ioregionfd:
//!   the write comes as a message), the write is served where it arrives
//!   and wakes the poller through the same eventfd, so the submissions after
//!   it are polled again rather than each exiting. With steady gaps between
//!   submissions the poller sets a timer for just before the next is due and
//!   polls for it instead of waiting for its doorbell (`poller/forecast.rs`;
//!   `forecast=off` turns it off): a polled driver gets `shm`'s latency,
//!   an idle controller costs no core. In a device process it serves only
//!   drivers that configure shadow doorbells (Create I/O SQ is refused
//!   before Doorbell Buffer Config: a doorbell there is a kick without its
//!   value); in the VMM, a driver without them gets `mmio`.
//! - `bar-adaptive`: `bar` while work comes; after [`ADAPTIVE_IDLE`]
//!   without any (or less, as `adaptive`), the poller sleeps in timed steps ([`BAR_IDLE_STEP`]
//!   doubling up to [`BAR_IDLE_MAX`]) and looks at the page between them;
//!   doorbells that arrive as exits or messages wake it at once. Idle for
//!   [`BAR_TRAP_AFTER`], it asks its host to trap the page
//!   (`IoEvents::trap_area`: the VMM takes the page's memslot out, so the
//!   driver's next doorbell store exits to `bar_write`, which stores the
//!   value in the page and wakes the poller), re-reads the page (a store
//!   that landed before the trap is served, not slept on) and sleeps until
//!   woken; awake, it maps the page back and polls. A host that cannot trap
//!   the page (a device process: its client mapped the vfio-user sparse
//!   area) keeps the steps. See `poller/asleep.rs`.
//! - `auto` (the default): every driver's mode. BAR0's doorbell page is
//!   shared memory as in `bar` (SPDK's stores, and any driver's before it
//!   configures shadow doorbells, land there), and Doorbell Buffer Config
//!   is offered: once a driver configures it (Linux), its I/O queues'
//!   tails and heads are taken from the shadow doorbells as in `shm`, the
//!   admin queue's still from the page. One poller watches both and sleeps
//!   as `bar-adaptive` does (timed steps, then the page trapped where the
//!   host can); asleep, it also sets every shadowed SQ's EventIdx to the
//!   tail served, so a shadow driver's next submission stores to the
//!   register too, which lands in the page (or exits, trapped) and is seen
//!   at the next step (or at once). One poller (`pollers=1`).
//!
//! Guest memory is a [`GuestMem`](crate::GuestMem): queues, PRP lists and
//! data may also lie in memory the host reaches by message (vfio-user
//! DMA_READ/DMA_WRITE); the device thread then waits for those messages
//! with the core lock held, as it would for a page fault.
//!
//! A `file:PATH` namespace keeps the guest's queue depth: Read, Write and
//! Flush go to an io_uring on an O_DIRECT fd (up to 256 in flight, on the
//! guest's pages in place or each in a bounce buffer of its own as
//! `in_place=` says, one submit per queue pass) and complete when
//! the device thread reaps them: each poller pass (`shm`, `bar`), or when
//! the ring's eventfd wakes the `ioeventfd` thread or, in `mmio` mode, the
//! `nvme-uring` thread. A Flush waits for the operations before it
//! (IOSQE_IO_DRAIN); Delete I/O SQ waits for its queue's commands; a reset
//! aborts them and waits until none is in flight before CSTS.RDY reads 0
//! (an aborted read cannot land in guest memory later, nor an aborted
//! write in the file); attaching another memory waits for the operations on
//! the old one's pages; Write Zeroes and deallocate wait for them too (they write through
//! the buffered fd). While the controller has no memory (a client left),
//! completions wait in the ring for the next one. Ordering, bounds and
//! buffers: `io.rs`.
//!
//! Every value from the guest is checked: queue ids and sizes, doorbell
//! values (an invalid one raises an asynchronous event), PRPs (must lie in
//! guest RAM), LBA ranges, opcodes. The controller answers with the NVMe
//! status the spec defines and goes on serving the other queues.
//!
//! Locking: [`Nvme`] implements [`DeviceModel`] itself. All controller state
//! is one `Core` behind one mutex, which the vCPU thread (register and
//! doorbell accesses) and the device thread share, so a BAR access takes
//! exactly that lock. With `pollers=N` (N > 1; `shm`, `bar`, `adaptive`),
//! the I/O queues are spread over N queue groups by CQ id, each a `Core`
//! behind its own mutex served by its own poller; that core is group 0's,
//! and the admin path takes another group's lock only after it
//! (`shards.rs`). Starting and stopping the device threads (CC.EN, reset,
//! quiesce) is serialised by a second lock that no BAR access other than a
//! CC write takes; no core lock is held while a thread is joined.
//!
//! Files: `regs.rs` controller registers, enable, disable, shutdown;
//! `controller.rs` the `Core` and its state by concern, queue processing,
//! asynchronous events, counters; `admin.rs` admin commands; `io.rs` I/O
//! commands and PRP data movement; `doorbells.rs` the four doorbell modes
//! and the device thread; `adaptive.rs` the adaptive pollers' threads and
//! `poller/` their decisions, a pure state machine (and the forecast of
//! steady gaps); `interrupts.rs` MSI-X (the shared
//! [`MsixTable`](crate::pci::MsixTable)) and interrupt coalescing;
//! `queue.rs` queue entries and PRPs in guest memory; `shards.rs` queue
//! groups for several pollers; `inject.rs` error injection (`inject=`,
//! [`Nvme::injector`]) and the Error Information log; `timing.rs`
//! completions posted at their due time (`timing=`, injected delays). The namespace's storage is the block layer's
//! ([`crate::block`]), which virtio-blk shares.

mod adaptive;
mod admin;
mod controller;
mod doorbells;
pub mod identity;
mod inject;
mod interrupts;
mod io;
mod meta;
pub mod namespaces;
mod ns_admin;
pub mod options;
#[cfg(any(test, feature = "oracle"))]
pub mod oracle;
mod poller;
pub mod pool;
pub mod queue;
mod regs;
mod shards;
mod state;
mod timing;

pub use crate::block::InPlace;
use crate::block::{Storage, StorageKind};
use crate::{le_fill, le_value, BarKind, BarSpec, Counter, DeviceContext, DeviceModel, Error, PciIds, Result};
use controller::Core;
use doorbells::Threads;
pub use inject::TimedRecord;
use regs::REG_CC;
use std::sync::{Arc, Mutex};

pub const VENDOR: u16 = 0x1234;
pub const DEVICE: u16 = 0x10ed;
pub const CLASS: u32 = 0x010802;
pub const BAR0_SIZE: u64 = 16 << 10;
/// Queue pairs the controller offers (I/O), besides the admin pair.
pub const MAX_IO_QUEUES: u16 = 64;
/// Largest queue (entries).
pub const MQES: u16 = 4096;
/// Maximum data transfer: 2^MDTS pages = 128 KiB.
pub const MDTS: u8 = 5;
const _: () = assert!((queue::PAGE as usize) << MDTS == crate::block::MAX_IO, "a command fits a storage slot");
/// MSI-X vectors: one per queue pair, admin included.
pub const MSIX_VECTORS: usize = MAX_IO_QUEUES as usize + 1;
/// MSI-X table and PBA offsets in BAR0.
const MSIX_TABLE: u64 = 0x2000;
const MSIX_PBA: u64 = 0x3000;
/// Where the controller asks the host to put its MSI-X capability, then
/// Power Management and PCI Express (an Endpoint, as NVMe over PCIe wants).
const MSIX_CAP: usize = 0x40;
const PM_CAP: usize = 0x50;
const EXP_CAP: usize = 0x60;
/// The doorbell registers (and, in `bar` mode, the shared page) in BAR0.
const DOORBELLS: u64 = 0x1000;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DoorbellMode {
    Mmio,
    Ioeventfd,
    Shm,
    Bar,
    /// shm's poller while work comes; idle for [`ADAPTIVE_IDLE`], it arms
    /// EventIdx and sleeps on the doorbells' ioeventfd.
    Adaptive,
    /// bar's poller while work comes; idle for [`ADAPTIVE_IDLE`], it sleeps
    /// in timed steps, and idle for [`BAR_TRAP_AFTER`] with the doorbell
    /// page trapped until a doorbell store exits.
    BarAdaptive,
    /// The default: BAR0's doorbell page shared and shadow doorbells
    /// offered, one poller that sleeps as bar-adaptive's does: serves
    /// drivers with and without shadow doorbells alike.
    Auto,
}

impl DoorbellMode {
    /// Modes whose I/O doorbell registers are KVM ioeventfds once the shadow
    /// doorbells are set: a kick (EventIdx asks for it) brings the work.
    pub fn kicked(self) -> bool {
        matches!(self, DoorbellMode::Ioeventfd | DoorbellMode::Adaptive)
    }

    /// Modes served by polling threads, one per queue group (`pollers=N`).
    pub fn polled(self) -> bool {
        !matches!(self, DoorbellMode::Mmio | DoorbellMode::Ioeventfd)
    }

    /// Modes whose doorbells are BAR0's page shared as memory.
    pub fn bar_page(self) -> bool {
        matches!(self, DoorbellMode::Bar | DoorbellMode::BarAdaptive | DoorbellMode::Auto)
    }

    /// Modes whose poller sleeps when idle.
    pub fn adaptive(self) -> bool {
        matches!(self, DoorbellMode::Adaptive | DoorbellMode::BarAdaptive | DoorbellMode::Auto)
    }

    /// Modes that offer Doorbell Buffer Config (shadow doorbells).
    pub fn shadowed(self) -> bool {
        matches!(self, DoorbellMode::Shm | DoorbellMode::Ioeventfd | DoorbellMode::Adaptive | DoorbellMode::Auto)
    }

    /// Every mode, as `doorbell=` names them.
    pub const ALL: [DoorbellMode; 7] = [
        DoorbellMode::Auto,
        DoorbellMode::Adaptive,
        DoorbellMode::BarAdaptive,
        DoorbellMode::Shm,
        DoorbellMode::Bar,
        DoorbellMode::Ioeventfd,
        DoorbellMode::Mmio,
    ];
}

/// `adaptive` mode: how long the poller finds no work before it sleeps, at
/// most; the poller shortens it down to [`ADAPTIVE_IDLE_MIN`] while its
/// sleeps are longer than this (see `poller/idle.rs`, `IdleWindow`).
pub const ADAPTIVE_IDLE: std::time::Duration = std::time::Duration::from_micros(200);

/// The shortest idle interval before an adaptive poller sleeps.
pub const ADAPTIVE_IDLE_MIN: std::time::Duration = std::time::Duration::from_micros(10);

/// `adaptive` mode with file operations in flight and no other work: how
/// long the poller looks (yielding its core between looks, `poller/idle.rs`,
/// `Yielder`) before it sleeps until a completion (the ring's eventfd) or a
/// doorbell wakes it. A disk's completion takes tens of microseconds or
/// more; spinning through it takes a core from the vCPU and the storage stack.
pub const ADAPTIVE_IDLE_IO: std::time::Duration = std::time::Duration::from_micros(20);

/// `bar-adaptive`, idle: the first timed sleep between two looks at the
/// doorbell page; each next one is twice as long.
pub const BAR_IDLE_STEP: std::time::Duration = std::time::Duration::from_micros(100);

/// `bar-adaptive`: idle this long in timed steps, the poller has the host
/// trap the doorbell page and sleeps until a store exits. Trapping and
/// mapping the page back (two KVM memslot changes) cost hundreds of
/// microseconds of the poller's and the guest's time on this project's
/// nested machines (a think-time job that trapped on every idle paid 366 us
/// of CPU per I/O and waited 243 us p50 for each): only a long idle pays it.
pub const BAR_TRAP_AFTER: std::time::Duration = std::time::Duration::from_millis(20);

/// ... up to this. A timed look costs 12-40 us of CPU on this project's
/// (nested) machines: with 2 ms an idle poller took 0.9-1.5% of a core in
/// `bench nvme`'s idle window, 4 ms took 0.7-1.0% (single rounds up to
/// 1.7% on a loaded host). It is the longest a first submission after a
/// long idle waits to be seen where the page cannot be trapped (a device
/// process); in the VMM the page is trapped after [`BAR_TRAP_AFTER`].
pub const BAR_IDLE_MAX: std::time::Duration = std::time::Duration::from_millis(6);

impl std::str::FromStr for DoorbellMode {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "mmio" => Ok(DoorbellMode::Mmio),
            "ioeventfd" => Ok(DoorbellMode::Ioeventfd),
            "shm" => Ok(DoorbellMode::Shm),
            "bar" => Ok(DoorbellMode::Bar),
            "adaptive" => Ok(DoorbellMode::Adaptive),
            "bar-adaptive" => Ok(DoorbellMode::BarAdaptive),
            "auto" => Ok(DoorbellMode::Auto),
            _ => Err(Error::Option {
                device: "nvme",
                option: "doorbell".into(),
                reason: format!(
                    "unknown doorbell mode {s:?} ({})",
                    DoorbellMode::ALL.map(|m| m.to_string()).join(", ")
                ),
            }),
        }
    }
}

/// The name [`FromStr`](std::str::FromStr) takes.
impl std::fmt::Display for DoorbellMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            DoorbellMode::Mmio => "mmio",
            DoorbellMode::Ioeventfd => "ioeventfd",
            DoorbellMode::Shm => "shm",
            DoorbellMode::Bar => "bar",
            DoorbellMode::Adaptive => "adaptive",
            DoorbellMode::BarAdaptive => "bar-adaptive",
            DoorbellMode::Auto => "auto",
        })
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NvmeConfig {
    pub backend: StorageKind,
    /// Namespace size in bytes.
    pub size: u64,
    /// 512 or 4096.
    pub lba_size: u32,
    pub doorbell: DoorbellMode,
    /// Poller threads ([`MAX_POLLERS`] at most); with more than one, the I/O
    /// queues are spread over them by CQ id (`shards.rs`).
    pub pollers: u8,
    /// adaptive: the poller forecasts steady gaps and polls for the command
    /// that ends one, instead of waiting for its doorbell (`poller/forecast.rs`;
    /// `forecast=off` to compare).
    pub forecast: bool,
    /// A file namespace: which reads and writes work on the guest's pages
    /// in place instead of through bounce buffers (`block/guest.rs`).
    pub in_place: InPlace,
    /// A file namespace: its operations go to the kernel every this many
    /// (`submit_batch=N`, fio's iodepth_batch_submit), or 0: all that a
    /// queue pass fetched at once (see `block::FileStorage::submit_batch`).
    pub submit_batch: u16,
    /// A file namespace: make a missing file, `size` bytes written through
    /// (`create=on`; otherwise a missing file is an error, `crate::backing`).
    pub create: bool,
    /// `serial=`, `nqn=`, `cntlid=`; what is unset is drawn per controller
    /// instance (`identity.rs`).
    pub id: identity::IdentityOptions,
    /// `namespaces=N`: namespaces 1..=N, each with the options above
    /// (its own data: a `null` or `ram` backend).
    pub namespaces: u32,
    /// `ns=SPEC`: namespaces after those, in order (`namespaces.rs`).
    pub ns: Vec<namespaces::NsConfig>,
    /// `ms=`, `ext=`, `pi=`: namespace 1's metadata format (`meta.rs`).
    pub meta: namespaces::NsMeta,
    /// `timing=`: the namespace's device timing model (None: off, the
    /// default; boxed: it is large and rarely set); `timing.rs`.
    pub timing: Option<Box<crate::block::timing::TimingSpec>>,
    /// `inject=`: error injection rules the controller starts with (more
    /// come and go at run time through [`Nvme::injector`]); `inject.rs`.
    pub inject: Vec<crate::block::inject::Rule>,
}

/// Most operations `submit_batch=` may gather: the io_uring's size.
pub const MAX_SUBMIT_BATCH: u16 = crate::block::FILE_SLOTS as u16;

/// Poller threads a controller may have (`pollers=`).
pub const MAX_POLLERS: u8 = 16;

impl Default for NvmeConfig {
    fn default() -> Self {
        NvmeConfig {
            backend: StorageKind::Ram,
            size: 64 << 20,
            lba_size: 512,
            doorbell: DoorbellMode::Auto,
            pollers: 1,
            forecast: true,
            in_place: InPlace::Auto,
            submit_batch: 0,
            create: false,
            id: identity::IdentityOptions::default(),
            namespaces: 1,
            ns: Vec::new(),
            meta: namespaces::NsMeta::default(),
            timing: None,
            inject: Vec::new(),
        }
    }
}

impl NvmeConfig {
    /// Every namespace's options, namespace 1 first (index = NSID - 1).
    pub fn ns_list(&self) -> Vec<namespaces::NsConfig> {
        let first = namespaces::NsConfig {
            backend: self.backend.clone(),
            size: self.size,
            lba_size: self.lba_size,
            create: self.create,
            meta: self.meta,
            timing: None,
        };
        let mut v = vec![first; self.namespaces.max(1) as usize];
        v.extend(self.ns.iter().cloned());
        v
    }

    /// A file namespace is among them.
    pub fn any_file(&self) -> bool {
        self.ns_list().iter().any(|n| matches!(n.backend, StorageKind::File(_)))
    }

    /// Checks the namespace geometry (LBA size 512 or 4096, size a non-zero
    /// multiple of it) and the pollers (1 ..= [`MAX_POLLERS`]; more than one
    /// only in `shm`, `bar` and `adaptive` mode, on a `null` or `ram` namespace).
    pub fn validate(&self) -> Result<()> {
        let bad = |option: &str, reason: String| Err(Error::Option { device: "nvme", option: option.into(), reason });
        if self.lba_size != 512 && self.lba_size != 4096 {
            return bad("lba", format!("LBA size {} (512 or 4096)", self.lba_size));
        }
        if self.size < self.lba_size as u64 || !self.size.is_multiple_of(self.lba_size as u64) {
            return bad("size_mb", format!("namespace size {} is not a multiple of the LBA size", self.size));
        }
        if self.pollers == 0 || self.pollers > MAX_POLLERS {
            return bad("pollers", format!("{} pollers (1 ..= {MAX_POLLERS})", self.pollers));
        }
        if self.pollers > 1 && !self.doorbell.polled() {
            return bad(
                "pollers",
                format!("several pollers need doorbell=shm, bar or adaptive, not {}", self.doorbell),
            );
        }
        if !self.forecast && self.doorbell != DoorbellMode::Adaptive {
            return bad("forecast", format!("only doorbell=adaptive forecasts, not {}", self.doorbell));
        }
        if self.pollers > 1 && matches!(self.doorbell, DoorbellMode::BarAdaptive | DoorbellMode::Auto) {
            // One page holds every queue's doorbells: one group's trap would
            // make the others' stores exit while they are busy.
            return bad("pollers", format!("doorbell={} takes one poller (the doorbell page is one)", self.doorbell));
        }
        if self.in_place != InPlace::Auto && !self.any_file() {
            return bad("in_place", format!("in_place={} needs backend=file:PATH", self.in_place));
        }
        if self.submit_batch != 0 && !self.any_file() {
            return bad("submit_batch", format!("submit_batch={} needs backend=file:PATH", self.submit_batch));
        }
        if self.submit_batch > MAX_SUBMIT_BATCH {
            return bad("submit_batch", format!("{} (0 ..= {MAX_SUBMIT_BATCH})", self.submit_batch));
        }
        if self.create && !matches!(self.backend, StorageKind::File(_)) {
            return bad("create", "create=on needs backend=file:PATH".into());
        }
        let n = self.namespaces as u64 + self.ns.len() as u64;
        if self.namespaces == 0 || n > namespaces::MAX_NAMESPACES as u64 {
            return bad(
                "namespaces",
                format!(
                    "{n} namespaces (namespaces={} and {} ns=; 1 ..= {})",
                    self.namespaces,
                    self.ns.len(),
                    namespaces::MAX_NAMESPACES
                ),
            );
        }
        if self.namespaces > 1 && matches!(self.backend, StorageKind::File(_)) {
            return bad(
                "namespaces",
                "namespaces=N clones namespace 1: a file would be one disk N times; give each file namespace with ns="
                    .into(),
            );
        }
        self.meta.validate("namespace 1")?;
        for (i, ns) in self.ns.iter().enumerate() {
            ns.validate(&format!("namespace {}", self.namespaces as usize + 1 + i))?;
        }
        let mut files: Vec<_> = self
            .ns_list()
            .into_iter()
            .filter_map(|n| if let StorageKind::File(p) = n.backend { Some(p) } else { None })
            .collect();
        files.sort();
        if let Some(w) = files.windows(2).find(|w| w[0] == w[1]) {
            return bad("ns", format!("file:{} backs two namespaces", w[0].display()));
        }
        if self.pollers > 1 && self.any_file() {
            return bad(
                "pollers",
                "several pollers need backend=null or ram (a file namespace has one io_uring)".into(),
            );
        }
        if self.inject.len() > crate::block::inject::MAX_RULES {
            return bad("inject", format!("{} rules (at most {})", self.inject.len(), crate::block::inject::MAX_RULES));
        }
        if let Some(e) = self.inject.iter().find_map(|r| r.validate().err()) {
            return bad("inject", e.to_string());
        }
        if (self.timing.is_some() || self.ns.iter().any(|n| n.timing.is_some())) && self.doorbell == DoorbellMode::Mmio
        {
            return bad(
                "timing",
                "timing= needs a device thread to post completions at their due time (not doorbell=mmio)".into(),
            );
        }
        self.id.validate()
    }
}

/// The controller, as its host shares it (`Arc<Nvme>` is a
/// [`SharedDevice`](crate::SharedDevice); no outer lock).
pub struct Nvme {
    cfg: NvmeConfig,
    /// Everything a BAR access or the device thread touches: the one lock.
    core: Arc<Mutex<Core>>,
    /// The device thread: taken on CC writes, attach, reset, quiesce, drop.
    threads: Mutex<Threads>,
    /// `bar` mode: the memfd behind BAR0, whose doorbell page the host maps
    /// (a new one for each client of a device process: `new_client`).
    bar_fd: Mutex<Option<std::fs::File>>,
}

impl Nvme {
    pub fn new(mut cfg: NvmeConfig) -> Result<Self> {
        cfg.validate()?;
        // One identity for the controller's life, its queue groups included.
        cfg.id = cfg.id.resolved();
        // The file namespaces' rings signal one eventfd: the device thread sleeps on it.
        let done = match cfg.any_file() {
            true => Some(Arc::new(
                vmm_sys_util::eventfd::EventFd::new(libc::EFD_CLOEXEC)
                    .map_err(|e| Error::io("nvme: completion eventfd", e))?,
            )),
            false => None,
        };
        let mut storages = Vec::new();
        for n in cfg.ns_list() {
            // The data, then the metadata area, if any (`meta.rs`).
            let bytes = n.size + n.meta.area(&n.backend, n.size);
            crate::backing::prepare(&n.backend, bytes, n.create)?;
            let mut storage = match &done {
                Some(d) => Storage::open_signalling(&n.backend, bytes, d)?,
                None => Storage::open(&n.backend, bytes)?,
            };
            if let Storage::File(f) = &mut storage {
                f.in_place = cfg.in_place;
                f.submit_batch = cfg.submit_batch as usize;
            }
            storages.push(storage);
        }
        let (bar_page, bar_fd) = match cfg.doorbell.bar_page() {
            true => {
                let (page, fd) = doorbells::bar_memory()?;
                (Some(page), Some(fd))
            }
            false => (None, None),
        };
        let core = if cfg.pollers > 1 {
            // Queue groups (`shards.rs`), each with a handle on the one namespace.
            let mut c0 = Core::new(&cfg, storages, bar_page);
            c0.groups = cfg.pollers as usize;
            c0.shards = (1..c0.groups).map(|g| Arc::new(Mutex::new(Core::new_shard(&c0, &cfg, g)))).collect();
            c0
        } else {
            Core::new(&cfg, storages, bar_page)
        };
        let bar_fd = Mutex::new(bar_fd);
        Ok(Nvme { cfg, core: Arc::new(Mutex::new(core)), threads: Mutex::new(Threads::default()), bar_fd })
    }
}

impl Nvme {
    /// Attaches (`true`) or detaches namespace `nsid` at run time, as a
    /// control socket asks (`ns_admin.rs`): the host is told with a
    /// Namespace Attribute Changed event where it enabled them. Ok(false):
    /// it was so already; an error: no such namespace.
    pub fn set_attached(&self, nsid: u32, attached: bool) -> Result<bool> {
        let mut c = crate::lock(&self.core);
        let changed = c.set_attached(nsid, attached)?;
        c.commit_state(None);
        Ok(changed)
    }
}

#[cfg(any(test, feature = "oracle"))]
impl Nvme {
    /// Starts the log of fetched I/O commands the queue oracle checks.
    pub fn oracle_log(&self) -> Arc<Mutex<Vec<oracle::OpRecord>>> {
        let log: Arc<Mutex<Vec<oracle::OpRecord>>> = Arc::default();
        let mut c = crate::lock(&self.core);
        c.oplog = Some(log.clone());
        for s in &c.shards {
            crate::lock(s).oplog = Some(log.clone());
        }
        log
    }
}

impl DeviceModel for Nvme {
    fn name(&self) -> String {
        "nvme".into()
    }

    fn ids(&self) -> PciIds {
        PciIds {
            vendor: VENDOR,
            device: DEVICE,
            class: CLASS,
            revision: 0,
            subsystem_vendor: VENDOR,
            subsystem: DEVICE,
            interrupt_pin: 0, // MSI-X only
        }
    }

    fn state_len(&self) -> Option<usize> {
        state::supported(&self.cfg).ok().and_then(|()| state::len(&crate::lock(&self.core)).ok())
    }

    fn adopt_state(&self, mem: crate::state::StateMemory, resume: bool) -> Result<()> {
        self.adopt(mem, resume)
    }

    fn bars(&self) -> Vec<BarSpec> {
        vec![BarSpec { index: 0, kind: BarKind::Mem64, size: BAR0_SIZE }]
    }

    fn attach(&self, ctx: DeviceContext) {
        let (ready, gone) = {
            let mut c = crate::lock(&self.core);
            let gone = ctx.mem.is_empty();
            // The file operations on the old memory's pages end first.
            c.settle_guest_io();
            c.mem = ctx.mem;
            let c = &mut *c;
            c.queues.resolve(&c.mem);
            c.db.ioevents = Some(ctx.ioevents);
            // A device process's host announces ioeventfds only now.
            c.register_static();
            c.intr.irq = ctx.irq;
            // A client left (a device process gives its device no memory
            // then): whether the next one keeps the MSI-X table shows in its
            // writes. A map or unmap by the same client keeps what it showed.
            if gone {
                c.intr.client_table = false;
            } else if let Some(done) = c.io_completion_fd() {
                // File completions that waited for memory: the device thread posts them.
                let _ = done.write(1);
            }
            c.sync_shards();
            (c.regs.csts & 1 == 1, gone)
        };
        // A device process's next client finds the controller as the last
        // one left it only with `iopath serve --keep-state` (otherwise the
        // device is reset between clients): enabled, its queues served again
        // once that client's memory comes (none between clients).
        if ready && !gone {
            self.start_threads(&mut crate::lock(&self.threads));
        }
    }

    fn mapped_areas(&self) -> Vec<crate::MappedArea> {
        let fd = crate::lock(&self.bar_fd);
        let Some(fd) = fd.as_ref() else { return Vec::new() };
        match fd.try_clone() {
            Ok(fd) => vec![crate::MappedArea { bar: 0, offset: DOORBELLS, size: 0x1000, fd, fd_offset: DOORBELLS }],
            Err(e) => {
                log::warn!("nvme: cannot share the doorbell page: {e}");
                Vec::new()
            }
        }
    }

    fn capabilities(&self) -> Vec<crate::pci::Capability> {
        let msix = crate::lock(&self.core).intr.msix.capability();
        vec![msix, crate::pci::caps::power_management(PM_CAP), crate::pci::caps::express_endpoint(EXP_CAP)]
    }

    fn config_write(&self, offset: usize, data: &[u8]) {
        let mut c = crate::lock(&self.core);
        if c.intr.msix.config_write(offset, data) {
            for v in 0..MSIX_VECTORS {
                c.msix_update(v);
            }
            c.sync_vectors();
            c.record_msix_control();
        }
    }

    fn bar_read(&self, bar: u8, offset: u64, data: &mut [u8]) {
        if bar != 0 || (DOORBELLS..MSIX_TABLE).contains(&offset) {
            le_fill(data, if bar != 0 { u64::MAX } else { 0 });
            return;
        }
        let mut c = crate::lock(&self.core);
        c.fold_fatal(); // CSTS.CFS an injection set on another queue group
        if c.intr.msix.claims(bar, offset) {
            c.sync_vectors(); // the other queue groups' pending bits, for the PBA
        }
        if c.intr.msix.read(bar, offset, data) {
            return;
        }
        if offset >= DOORBELLS {
            le_fill(data, 0);
            return;
        }
        // Registers past ACQ (CMBLOC, CMBSZ, BPINFO, PMRCAP...) are not
        // implemented: they read as zero (all-ones would describe a CMB).
        let image = c.regs.image();
        for (i, d) in data.iter_mut().enumerate() {
            *d = image.get(offset as usize + i).copied().unwrap_or(0);
        }
    }

    fn bar_write(&self, bar: u8, offset: u64, data: &[u8]) {
        if bar != 0 {
            return;
        }
        let v = le_value(data);
        if (offset, data.len()) == (REG_CC, 4) {
            return self.write_cc(v as u32);
        }
        let mut c = crate::lock(&self.core);
        if c.intr.msix.claims(bar, offset) {
            if let Some(vector) = c.intr.msix.write(bar, offset, data) {
                c.intr.client_table = true;
                c.msix_update(vector);
                c.sync_vectors();
                c.record_msix(vector);
                c.record_msix_control();
            }
            return;
        }
        if (DOORBELLS..MSIX_TABLE).contains(&offset) {
            if data.len() == 4 && offset.is_multiple_of(4) {
                c.doorbell(offset - DOORBELLS, v as u32);
            }
            return;
        }
        c.regs.write(offset, data.len(), v);
        c.commit_state(None);
    }

    fn reset(&self) {
        let mut t = crate::lock(&self.threads);
        self.stop_threads(&mut t);
        let mut c = crate::lock(&self.core);
        c.reset_queues();
        c.intr.client_table = false;
        c.regs.cc = 0;
        c.regs.aqa = 0;
        c.regs.asq = 0;
        c.regs.acq = 0;
        c.sync_shards();
        c.commit_state(None);
        c.record_msix_control();
    }

    fn quiesce(&self) {
        self.stop_threads(&mut crate::lock(&self.threads));
    }

    /// A new doorbell page (its doorbells as the old one holds them) and,
    /// where the host announced the doorbells' ioeventfds once, a new
    /// eventfd announced for them: a client that left keeps a mapping of the
    /// old page and copies of the old eventfd, which nobody reads any more.
    fn new_client(&self) {
        let mut t = crate::lock(&self.threads);
        self.stop_threads(&mut t);
        let ready = {
            let mut c = crate::lock(&self.core);
            c.renew_ioevents();
            if self.cfg.doorbell.bar_page() {
                match doorbells::bar_memory() {
                    Ok((page, fd)) => {
                        c.replace_bar_page(page);
                        *crate::lock(&self.bar_fd) = Some(fd);
                    }
                    Err(e) => {
                        log::error!("nvme: a new doorbell page for the next client: {e}; it keeps the last one's")
                    }
                }
            }
            c.regs.csts & 1 == 1
        };
        // With `--keep-state` the controller is still enabled: served again.
        if ready {
            self.start_threads(&mut t);
        }
    }

    fn injector(&self) -> Option<Arc<crate::block::inject::Injector>> {
        Some(Nvme::injector(self))
    }

    fn set_namespace_attached(&self, nsid: u32, attached: bool) -> Result<bool> {
        self.set_attached(nsid, attached)
    }

    fn counters(&self) -> Vec<Counter> {
        // While a device thread runs, the kicks it has not drained yet are
        // not counted: reading its eventfd here could take its wake-up.
        let running = crate::lock(&self.threads).running();
        let (v, failed) = {
            let mut c = crate::lock(&self.core);
            if !running {
                c.drain_kicks();
            }
            (c.counters(), c.db.failed.clone())
        };
        if let Some(e) = failed {
            log::warn!("{e}");
        }
        if let Some(e) = &crate::lock(&self.threads).error {
            log::warn!("{e}");
        }
        v
    }
}

impl Drop for Nvme {
    fn drop(&mut self) {
        let t = self.threads.get_mut().unwrap_or_else(|p| p.into_inner());
        let mut t = std::mem::take(t);
        self.stop_threads(&mut t);
    }
}

#[cfg(test)]
mod tests;
