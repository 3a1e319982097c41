//! virtio-blk served in the VMM, on the modern PCI transport
//! ([`transport`](super::transport)): vendor 0x1af4, device 0x1042, and
//! `queues=N` request queues (1 ..= 16; 1 unless asked). [`BlkEngine`] is
//! its queue engine.
//!
//! VIRTIO_BLK_F_MQ is always offered, with num_queues = N in the
//! configuration space (N = 1 included: Linux then sets up one queue, as
//! without MQ; it uses min(num_queues, its CPUs) queues). Each queue is a
//! ring of its own: its requests, used ring, EVENT_IDX thresholds and
//! interrupt vector are its own; a ring the driver breaks puts the device
//! in DEVICE_NEEDS_RESET (every queue stops) until it resets it, and a
//! reset stops and forgets every queue.
//!
//! Notifications arrive as `notify` says: `exit` (a write to a queue's
//! notify address exits, and that queue is served on the vCPU thread in
//! `bar_write`) or `ioeventfd` (every queue's notify address is a KVM
//! ioeventfd on one eventfd; the `virtio-blk` thread wakes and serves each
//! queue that has work) or `poll` (that thread polls every ring, see
//! [`worker`](super::worker)). One thread serves all the queues: the disk
//! is one, behind the device's one lock, so threads per queue would take
//! turns at that lock, not serve in parallel; a pass takes at most a
//! ring's worth from each queue in turn, so no queue waits behind another
//! one kept full. One eventfd for all: a vfio-user client takes the fds a
//! server announces once, and one fd per queue would cost an fd each.
//!
//! A `file:PATH` disk served by the `virtio-blk` thread (ioeventfd, poll)
//! goes through the block layer's io_uring, as NVMe's does: IN, OUT and
//! FLUSH requests of every queue are pushed in a pass, submitted once,
//! and completed as the thread reaps them (it also waits on the ring's
//! completion eventfd), many in flight ([`aio`]). DISCARD, WRITE_ZEROES
//! and GET_ID are served at once, synchronously. A reset, and the end of
//! a run or a client, cancels the requests in flight and waits for their
//! operations: no completion reaches the guest after it. notify=exit
//! serves a file disk synchronously (pread, pwrite, fdatasync) on the
//! vCPU thread, which has nothing to wait for completions on; so does a
//! file whose filesystem refuses O_DIRECT or io_uring.
//!
//! Error injection (`inject=`) and the timing model (`timing=`) sit
//! between the rings and the storage (`blk_emu.rs`): every chain taken is
//! shown to the rules first, and every completion may wait in the timer
//! wheel, which each pass of the device thread empties of what is due.
//!
//! State memory (`transport/state.rs`; a device process over vfio-user):
//! every chain taken is noted in flight and every completion published in
//! the order that module documents, so that a new process resumes the
//! device and runs again exactly the requests the dead one had not
//! completed ([`BlkEngine::resumed`]: they go first, before anything new).
//! Null, file and ram disks resume (a ram disk's data lives in the state
//! memory), with any `notify=`; refused (`state_len` None): `timing=` and
//! `inject=` (held completions and injected drops are not recorded).

use super::blk::{self, Blk, Done};
use super::blk_async as aio;
use super::blk_emu::{self, Decision, Emu};
use super::queue::{Queue, QueueError};
use super::transport::{DeviceConfigBytes, QueueEngine, Shared, State, Transport, VirtioPci};
use crate::block::{Storage, StorageKind};
use crate::{Counter, DeviceContext, Error, GuestMem, IoEventSpec, Result};
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use vmm_sys_util::eventfd::EventFd;

pub const VENDOR: u16 = 0x1af4;
pub const DEVICE: u16 = 0x1042;
/// PCI class: mass storage (0x01), SCSI (0x00), as QEMU's virtio-blk-pci shows.
pub const CLASS: u32 = 0x01_00_00;
/// Feature bits (6, 5.2.3).
pub const F_SEG_MAX: u64 = 1 << 2;
pub const F_BLK_SIZE: u64 = 1 << 6;
pub const F_FLUSH: u64 = 1 << 9;
pub const F_DISCARD: u64 = 1 << 13;
/// VIRTIO_BLK_F_MQ: num_queues in the configuration space says how many queues.
pub const F_MQ: u64 = 1 << 12;
pub const F_WRITE_ZEROES: u64 = 1 << 14;
pub const F_INDIRECT_DESC: u64 = 1 << 28;
pub use super::transport::{F_EVENT_IDX, F_VERSION_1};
/// What the device offers.
pub const FEATURES: u64 =
    F_SEG_MAX | F_BLK_SIZE | F_FLUSH | F_MQ | F_DISCARD | F_WRITE_ZEROES | F_INDIRECT_DESC | F_EVENT_IDX | F_VERSION_1;
pub use super::transport::{
    notify_offset, BAR_SIZE, COMMON, COMMON_LEN, DEVCFG, DEVCFG_LEN, ISR, MAX_QUEUES, MSIX_PBA, MSIX_TABLE, NOTIFY,
    NOTIFY_MULT, NO_VECTOR, S_ACKNOWLEDGE, S_DRIVER, S_DRIVER_OK, S_FAILED, S_FEATURES_OK, S_NEEDS_RESET,
};
/// Segments per request the device advertises (seg_max).
pub const SEG_MAX: u32 = 128;

/// How queue notifications reach the device.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum NotifyMode {
    /// The notify write exits to the VMM, which serves the queue on the vCPU thread.
    #[default]
    Exit,
    /// The notify address is a KVM ioeventfd; a device thread serves the queue.
    Ioeventfd,
    /// A device thread polls the available ring with notifications
    /// suppressed; idle for [`POLL_IDLE`](super::worker::POLL_IDLE), it
    /// re-enables them and sleeps on the ioeventfd.
    Poll,
}

impl std::str::FromStr for NotifyMode {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "exit" => Ok(NotifyMode::Exit),
            "ioeventfd" => Ok(NotifyMode::Ioeventfd),
            "poll" => Ok(NotifyMode::Poll),
            _ => Err(Error::Option {
                device: "virtio-blk",
                option: "notify".into(),
                reason: format!("{s:?} (exit, ioeventfd, poll)"),
            }),
        }
    }
}

impl std::fmt::Display for NotifyMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            NotifyMode::Exit => "exit",
            NotifyMode::Ioeventfd => "ioeventfd",
            NotifyMode::Poll => "poll",
        })
    }
}

/// Options of `--device virtio-blk[,OPTIONS]` (`options.rs` lists them).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VirtioBlkConfig {
    pub backend: StorageKind,
    /// Disk size in bytes.
    pub size: u64,
    pub notify: NotifyMode,
    /// Request queues (`queues=N`, 1 ..= [`MAX_QUEUES`]). None: the host's
    /// default, which it settles before building the device
    /// ([`DeviceConfig::with_default_queues`](crate::DeviceConfig::with_default_queues)):
    /// one per vCPU in iopath's VMM (and in a device process it starts),
    /// [`MAX_QUEUES`] in a device process started on its own, which does
    /// not know its client's vCPUs (Linux's virtio_blk takes one per CPU;
    /// QEMU's vhost-user-blk-pci asks one per vCPU).
    pub queues: Option<u16>,
    /// A file disk: make a missing file, `size` bytes written through
    /// (`create=on`; otherwise a missing file is an error, `crate::backing`).
    pub create: bool,
    /// A file disk: its io_uring works O_DIRECT (`direct=on`, the default)
    /// or through the page cache (`direct=off`).
    pub direct: bool,
    /// The timing model (`timing=`; `blk_emu.rs`): completions posted at
    /// their due time. None: as soon as done. (Boxed: a device config stays small.)
    pub timing: Option<Box<crate::block::timing::TimingSpec>>,
    /// Error injection's rules at start (`inject=`; `blk_emu.rs`); more
    /// can be added at run time (`DeviceModel::injector`, which refuses what [`blk_emu::check_rule`] does).
    pub inject: Vec<crate::block::inject::Rule>,
}

impl Default for VirtioBlkConfig {
    fn default() -> Self {
        VirtioBlkConfig {
            backend: StorageKind::Ram,
            size: 64 << 20,
            notify: NotifyMode::Exit,
            queues: None,
            create: false,
            direct: true,
            timing: None,
            inject: Vec::new(),
        }
    }
}

impl VirtioBlkConfig {
    /// The queues of the device on the PCI transport: `queues=N`, else 1
    /// (hosts settle None first: see `queues`).
    pub fn num_queues(&self) -> u16 {
        self.queues.unwrap_or(1)
    }
}

/// The in-VMM engine's counters (the transport keeps notifies, interrupts,
/// ring_errors and resets).
#[derive(Default)]
pub(super) struct Stats {
    pub(super) kicks: u64,
    /// Times the poller went to sleep on the ioeventfd.
    pub(super) sleeps: u64,
    requests: u64,
    errors: u64,
    /// Requests served on each queue.
    queue_requests: Vec<u64>,
    /// Requests a dead device process had taken and not completed, run
    /// again after a resume from state memory.
    resubmitted: u64,
}

/// The queue engine of iopath's own virtio-blk: requests served in the
/// VMM on the vCPU thread (notify=exit) or the `virtio-blk` thread.
pub struct BlkEngine {
    cfg: VirtioBlkConfig,
    blk: Blk,
    pub(super) st: Stats,
    /// A poller serves the queue: serve() leaves notifications suppressed.
    pub(super) polling: bool,
    thread: Option<Worker>,
    /// The notify eventfd, made and registered at the first attach and kept:
    /// a device process's host announces it once (GET_REGION_IO_FDS) and
    /// its next clients get that same fd, so a later session must be woken
    /// through it, not through a new one nobody writes.
    kick: Option<Arc<EventFd>>,
    /// A file disk's requests go through its io_uring (the device thread
    /// serves the queues and reaps): set while that thread runs.
    pub(super) aio: bool,
    flight: aio::Flight,
    /// Error injection and the timing model (`blk_emu.rs`).
    pub(super) emu: Emu,
    /// The queue a pass starts at (turns, so that none waits for slots
    /// behind another one kept full).
    first: usize,
    /// Per queue: chains a dead device process took and did not complete
    /// (state memory), oldest first, served before the available ring's.
    resubmit: Vec<VecDeque<u16>>,
}

/// The virtio-blk PCI function served in the VMM.
pub type VirtioBlk = VirtioPci<BlkEngine>;

struct Worker {
    kick: Arc<EventFd>,
    stop: Arc<AtomicBool>,
    handle: std::thread::JoinHandle<()>,
}

impl VirtioPci<BlkEngine> {
    pub fn new(cfg: VirtioBlkConfig) -> Result<Self> {
        if cfg.size == 0 || !cfg.size.is_multiple_of(blk::SECTOR) {
            return Err(Error::Option { device: "virtio-blk", option: "size_mb".into(), reason: "empty disk".into() });
        }
        let n = cfg.num_queues();
        if !(1..=MAX_QUEUES).contains(&n) {
            let reason = format!("{n} (1 ..= {MAX_QUEUES})");
            return Err(Error::Option { device: "virtio-blk", option: "queues".into(), reason });
        }
        let storage = crate::backing::open_with(&cfg.backend, cfg.size, cfg.create, cfg.direct)?;
        let blk = Blk::new(storage, cfg.size, "iopath-virtio-blk");
        let st = Stats { queue_requests: vec![0; n as usize], ..Stats::default() };
        let emu = Emu::new(n, cfg.timing.as_deref(), &cfg.inject);
        let e = BlkEngine {
            emu,
            cfg,
            blk,
            st,
            polling: false,
            thread: None,
            kick: None,
            aio: false,
            flight: aio::Flight::default(),
            first: 0,
            resubmit: vec![VecDeque::new(); n as usize],
        };
        Ok(VirtioPci::with_engine(e))
    }
}

/// The ioeventfd of queue `q`'s notify address (any length, any value).
fn notify_spec(q: u16) -> IoEventSpec {
    IoEventSpec { bar: 0, offset: notify_offset(q), len: 0, datamatch: None }
}

/// Registers every queue's notify address as an ioeventfd on one eventfd
/// and starts the thread that serves it.
fn start_thread(dev: &Shared<BlkEngine>, ctx: &DeviceContext) {
    let mut s = crate::lock(dev);
    if s.e.thread.is_some() {
        return;
    }
    let queues = s.t.num_queues();
    let kick = match s.e.kick.clone() {
        Some(k) => k, // registered at an earlier attach: still the one the host knows
        None => {
            let kick = match EventFd::new(libc::EFD_NONBLOCK) {
                Ok(e) => Arc::new(e),
                Err(e) => return log::warn!("virtio-blk: eventfd: {e}; notifications will exit"),
            };
            for q in 0..queues {
                if let Err(e) = ctx.ioevents.register(notify_spec(q), &kick) {
                    for done in 0..q {
                        let _ = ctx.ioevents.unregister(notify_spec(done), &kick);
                    }
                    return log::warn!("virtio-blk: no ioeventfd for queue {q} ({e}); notifications will exit");
                }
            }
            s.e.kick = Some(kick.clone());
            kick
        }
    };
    let stop = Arc::new(AtomicBool::new(false));
    let (k, st, state) = (kick.clone(), stop.clone(), dev.clone());
    let poll = s.e.cfg.notify == NotifyMode::Poll;
    let done = match &s.e.blk.storage {
        Storage::File(f) if f.is_async() => f.completion_fd(),
        _ => None,
    };
    let d = done.clone();
    let handle = std::thread::Builder::new().name("virtio-blk".into()).spawn(move || {
        crate::sandbox::enter(crate::sandbox::Role::Device);
        let w = super::worker::Wake { kick: &k, done: d.as_deref(), stop: &st };
        if poll {
            super::worker::poll_loop(&state, &w)
        } else {
            super::worker::kick_loop(&state, &w)
        }
    });
    match handle {
        Ok(handle) => {
            s.e.thread = Some(Worker { kick, stop, handle });
            s.e.aio = done.is_some();
        }
        Err(e) => {
            for q in 0..queues {
                let _ = ctx.ioevents.unregister(notify_spec(q), &kick);
            }
            s.e.kick = None;
            log::warn!("virtio-blk: thread: {e}; notifications will exit");
        }
    }
}

impl QueueEngine for BlkEngine {
    fn name(&self) -> String {
        "virtio-blk".into()
    }

    fn device_id(&self) -> u16 {
        DEVICE
    }

    fn class(&self) -> u32 {
        CLASS
    }

    fn features(&self) -> u64 {
        FEATURES
    }

    fn device_config(&self) -> DeviceConfigBytes {
        blk::config_space(self.blk.size, self.cfg.num_queues())
    }

    fn num_queues(&self) -> u16 {
        self.cfg.num_queues()
    }

    fn attach(dev: &Shared<Self>, ctx: &DeviceContext) {
        if crate::lock(dev).e.cfg.notify != NotifyMode::Exit {
            start_thread(dev, ctx);
        }
    }

    fn quiesce(dev: &Shared<Self>) {
        let w = crate::lock(dev).e.thread.take();
        if let Some(w) = w {
            w.stop.store(true, Ordering::Release);
            let _ = w.kick.write(1);
            let _ = w.handle.join();
        }
        // No completion after the run (or the client) ended.
        let mut s = crate::lock(dev);
        let e = &mut s.e;
        e.flight.cancel(&mut e.blk);
        e.emu.reset();
        e.aio = false;
    }

    fn new_client(dev: &Shared<Self>, ctx: &DeviceContext) {
        Self::quiesce(dev);
        let (old, queues, notify) = {
            let mut s = crate::lock(dev);
            (s.e.kick.take(), s.t.num_queues(), s.e.cfg.notify)
        };
        if let Some(old) = old {
            for q in 0..queues {
                let _ = ctx.ioevents.unregister(notify_spec(q), &old);
            }
        }
        if notify != NotifyMode::Exit {
            start_thread(dev, ctx);
        }
    }

    fn notify(&mut self, t: &mut Transport, queue: u16) {
        // The vCPU that wrote is waiting here: nothing else adds to the ring.
        // Held completions due by now go first (notify=exit has no thread
        // to post them: a delay rule added at run time waits for a notify).
        post_due(t, self);
        while serve_queue(t, self, queue as usize) {}
        if self.aio {
            submit(self); // the device thread reaps
        }
    }

    fn reset(&mut self, _t: &mut Transport) {
        // Before the transport forgets the queues: nothing completes after this.
        self.flight.cancel(&mut self.blk);
        self.emu.reset();
        self.resubmit.iter_mut().for_each(VecDeque::clear);
    }

    fn state_supported(&self) -> Result<()> {
        let no = |why: &str| Err(Error::Host(format!("virtio-blk: no state memory: {why}")));
        if self.cfg.timing.is_some() || !self.cfg.inject.is_empty() {
            return no("timing= and inject= are not recorded (held completions, dropped requests)");
        }
        Ok(())
    }

    fn state_ram(&mut self) -> Option<&mut Storage> {
        matches!(self.blk.storage, Storage::Ram(_)).then_some(&mut self.blk.storage)
    }

    fn after_predecessor(&self) -> Result<()> {
        self.blk.storage.after_predecessor()
    }

    fn resumed(&mut self, t: &mut Transport, again: Vec<Vec<u16>>) {
        let n: usize = again.iter().map(Vec::len).sum();
        for (q, heads) in again.into_iter().enumerate().take(self.resubmit.len()) {
            self.resubmit[q] = heads.into();
        }
        if n > 0 {
            let per: Vec<String> = self.resubmit.iter().map(|r| r.len().to_string()).collect();
            log::warn!(
                "virtio-blk: resumed from state memory: re-executing {n} request(s) a previous device process left in flight (per queue: {})",
                per.join(",")
            );
        } else {
            log::info!("virtio-blk: resumed from state memory, no request in flight");
        }
        while serve(t, self) {}
        if let Some(w) = &self.thread {
            let _ = w.kick.write(1); // the device thread reaps what the pass started
        }
    }

    fn injector(&self) -> Option<std::sync::Arc<crate::block::inject::Injector>> {
        Some(self.emu.rules.clone())
    }

    fn counters(&self) -> Vec<Counter> {
        let st = &self.st;
        [("kicks", st.kicks), ("sleeps", st.sleeps), ("requests", st.requests), ("errors", st.errors)]
            .into_iter()
            .chain((st.resubmitted > 0).then_some(("resubmitted", st.resubmitted)))
            .map(|(n, value)| Counter { name: n.into(), value })
            .chain(
                st.queue_requests
                    .iter()
                    .enumerate()
                    .map(|(q, &value)| Counter { name: format!("q{q}.requests"), value }),
            )
            .chain(self.file_counters())
            .chain(self.emu_counters())
            .collect()
    }
}

impl BlkEngine {
    /// Error injection and timing, when either is set: requests a rule
    /// fired on, dropped, completions held for their due time, the most
    /// held at once.
    fn emu_counters(&self) -> Vec<Counter> {
        let injected = self.emu.rules.stats().injected;
        if injected == 0 && self.emu.delayed == 0 {
            return Vec::new();
        }
        let e = &self.emu;
        [("inject.fired", injected), ("inject.dropped", e.dropped), ("held", e.delayed), ("held-max", e.held_max)]
            .into_iter()
            .map(|(n, value)| Counter { name: n.into(), value })
            .collect()
    }

    /// A file disk on io_uring: transfers done through it (O_DIRECT), the
    /// most operations in flight at once, and times a chain waited for slots.
    fn file_counters(&self) -> Vec<Counter> {
        let Storage::File(f) = &self.blk.storage else { return Vec::new() };
        if !f.is_async() {
            return Vec::new();
        }
        [("backend.direct-ops", f.direct_ops), ("backend.inflight-max", f.max_in_flight)]
            .into_iter()
            .chain([("backend.slot-waits", self.flight.slot_waits)])
            .map(|(n, value)| Counter { name: n.into(), value })
            .collect()
    }
}

/// One pass over every queue: each served as [`serve_queue`] does, in
/// turn. True if one stopped with more to do.
/// With io_uring ([`BlkEngine::aio`]): reaps first (freeing slots), starts
/// at the next queue each pass, and submits what the pass pushed.
pub(super) fn serve(t: &mut Transport, e: &mut BlkEngine) -> bool {
    let mut more = false;
    let n = t.queues.len();
    post_due(t, e);
    if e.aio {
        reap(t, e);
    }
    let first = if e.aio { e.first % n.max(1) } else { 0 };
    for k in 0..n {
        more |= serve_queue(t, e, (first + k) % n);
    }
    if e.aio {
        e.first = first + 1;
        submit(e);
    }
    more
}

/// Sends what a pass pushed to the file's io_uring.
fn submit(e: &mut BlkEngine) {
    if let Storage::File(f) = &mut e.blk.storage {
        f.submit();
    }
}

/// Reaps the file's completions and puts each request completed in its
/// queue's used ring, then raises the interrupts the driver asked for.
/// True if anything completed.
pub(super) fn reap(t: &mut Transport, e: &mut BlkEngine) -> bool {
    let Some(mem) = t.ctx.as_ref().map(|c| c.mem.clone()) else { return false };
    let done = e.flight.reap(&mut e.blk, &mem, |q| t.queue_live(q as usize));
    let mut irq = vec![false; t.queues.len()];
    for &(q, head, d, due) in &done {
        let i = q as usize;
        if !t.queue_live(i) {
            continue; // broken by an earlier one in this batch
        }
        count(e, i, &d);
        if e.emu.hold(q, head, d, due) {
            continue;
        }
        push_used(t, &mem, i, head, d.written, &mut irq);
    }
    raise(t, &irq);
    !done.is_empty()
}

/// Posts the held completions that are due (`blk_emu.rs`), each to its
/// queue's used ring while that queue is live, and raises the interrupts.
fn post_due(t: &mut Transport, e: &mut BlkEngine) {
    let due = e.emu.expire();
    if due.is_empty() {
        return;
    }
    let Some(mem) = t.ctx.as_ref().map(|c| c.mem.clone()) else { return };
    let mut irq = vec![false; t.queues.len()];
    for (q, head, d) in due {
        let i = q as usize;
        if !t.queue_live(i) {
            continue;
        }
        push_used(t, &mem, i, head, d.written, &mut irq);
    }
    raise(t, &irq);
}

/// Puts chain `head` of queue `i` in its used ring (`written` bytes),
/// noting in `irq` whether the driver asked for an interrupt; a used ring
/// that cannot be written breaks the device.
fn push_used(t: &mut Transport, mem: &GuestMem, i: usize, head: u16, written: u32, irq: &mut [bool]) {
    match complete(&mut t.queues[i].ring, t.rec.as_deref(), i, mem, head, written) {
        Ok(x) => irq[i] |= x,
        Err(err) => t.broken(&format!("used ring: {err}")),
    }
}

/// Puts chain `head` of queue `i` in the used ring as [`Queue::push_used`]
/// does, with the state memory's records around it (step 3 of
/// `transport/state.rs`): the head noted as the last batch before, its
/// entry cleared after the used index is published.
fn complete(
    q: &mut Queue,
    rec: Option<&super::transport::state::Recorder>,
    i: usize,
    mem: &GuestMem,
    head: u16,
    written: u32,
) -> std::result::Result<bool, QueueError> {
    if let Some(r) = rec {
        r.used_before(i, head);
    }
    let want = q.push_used(mem, head, written)?;
    if let Some(r) = rec {
        r.used_after(i, head, q.next_used);
    }
    Ok(want)
}

/// Raises the interrupt of each queue `irq` marks.
fn raise(t: &mut Transport, irq: &[bool]) {
    for (i, _) in irq.iter().enumerate().filter(|(_, &x)| x) {
        t.queue_interrupt(i);
    }
}

fn count(e: &mut BlkEngine, i: usize, done: &Done) {
    e.st.requests += 1;
    e.st.queue_requests[i] += 1;
    if done.status != Some(blk::S_OK) {
        e.st.errors += 1;
    }
}

/// Serves queue `i`'s available requests, at most a ring's worth, then
/// re-arms its notifications and raises its interrupt if the driver wants
/// one. True if it stopped with more to do: the device thread then lets go
/// of the lock before the next pass, so a driver that keeps a queue full
/// can hold off neither register accesses nor the other queues.
pub(super) fn serve_queue(t: &mut Transport, e: &mut BlkEngine, i: usize) -> bool {
    if !t.queue_live(i) {
        return false;
    }
    let Some(mem) = t.ctx.as_ref().map(|c| c.mem.clone()) else { return false };
    let mut irq = false;
    let mut more = false;
    let q = &mut t.queues[i].ring;
    let mut rec = t.rec.as_deref_mut();
    for _ in 0..=q.num {
        more = true;
        // Chains a dead device process left in flight first (noted in
        // flight already), then the available ring's, each noted as taken.
        let again = e.resubmit.get_mut(i).and_then(VecDeque::pop_front);
        let next = match again {
            Some(head) => {
                e.st.resubmitted += 1;
                q.chain(&mem, head).map(Some)
            }
            None => q.pop(&mem).inspect(|c| {
                if let (Some(c), Some(r)) = (c, rec.as_deref_mut()) {
                    r.take(i, c.head, q.next_avail);
                }
            }),
        };
        match next {
            Ok(Some(c)) => {
                let (done, due) = match e.emu.decide(&mem, &c.descs, i as u16) {
                    Decision::Run(plan) => {
                        let done = if e.aio {
                            match e.flight.start(&mut e.blk, &mem, (i as u16, c.head), c.descs, plan) {
                                aio::Started::Done(d) => d,
                                aio::Started::InFlight => continue,
                                aio::Started::NoRoom => {
                                    // Left available until a reap frees slots (the thread
                                    // wakes on it); decided already, it keeps its plan.
                                    match again {
                                        Some(head) => e.resubmit[i].push_front(head),
                                        None => {
                                            if let Some(r) = rec.as_deref_mut() {
                                                r.untake(i, c.head, q.next_avail.wrapping_sub(1));
                                            }
                                            q.unpop();
                                        }
                                    }
                                    e.emu.park(i as u16, plan);
                                    more = false;
                                    break;
                                }
                            }
                        } else {
                            let d = e.blk.handle(&mem, &c.descs);
                            blk_emu::corrupted(&mem, &c.descs, d, &plan)
                        };
                        (done, plan.due)
                    }
                    Decision::Complete(done, due) => (done, due),
                    Decision::Drop => continue,
                    Decision::Fatal => {
                        t.broken("inject: fatal");
                        return false;
                    }
                };
                count(e, i, &done);
                if e.emu.hold(i as u16, c.head, done, due) {
                    continue;
                }
                match complete(q, rec.as_deref(), i, &mem, c.head, done.written) {
                    Ok(x) => irq |= x,
                    Err(err) => {
                        t.broken(&format!("used ring: {err}"));
                        return false;
                    }
                }
            }
            Ok(None) => match q.set_notify(&mem, !e.polling) {
                Ok(a) if a != q.next_avail() => continue, // raced in
                Ok(_) => {
                    more = false;
                    break;
                }
                Err(err) => {
                    t.broken(&format!("used ring: {err}"));
                    return false;
                }
            },
            Err(err) => {
                t.broken(&format!("queue {i}: {err}"));
                return false;
            }
        }
    }
    if irq {
        t.queue_interrupt(i);
    }
    more
}

impl State<BlkEngine> {
    /// How long the device thread may sleep before a held completion is
    /// due (None: none is held).
    pub(super) fn until_due(&self) -> Option<u64> {
        self.e.emu.until_due()
    }

    /// See [`serve`].
    pub(super) fn serve(&mut self) -> bool {
        serve(&mut self.t, &mut self.e)
    }

    /// Requests on the file's io_uring not yet completed, and completions
    /// held for their due time.
    pub(super) fn in_flight(&self) -> usize {
        self.e.flight.requests() + self.e.emu.held() + self.e.resubmit.iter().map(VecDeque::len).sum::<usize>()
    }

    /// True if a queue is live and the driver has made chains available
    /// on it the device has not taken.
    pub(super) fn has_work(&self) -> bool {
        let t = &self.t;
        let Some(c) = t.ctx.as_ref() else { return false };
        (0..t.queues.len()).any(|i| {
            t.queue_live(i) && (!self.e.resubmit[i].is_empty() || t.queues[i].ring.has_work(&c.mem).unwrap_or(true))
        })
    }

    /// Sets whether a poller serves the queues, and asks the driver for
    /// notifications on each live one accordingly. True if work is already
    /// waiting (a poller about to sleep then polls on).
    pub(super) fn set_polling(&mut self, on: bool) -> bool {
        self.e.polling = on;
        let Some(mem) = self.t.ctx.as_ref().map(|c| c.mem.clone()) else { return false };
        let mut waiting = false;
        for i in 0..self.t.queues.len() {
            if !self.t.queue_live(i) {
                continue;
            }
            let q = &mut self.t.queues[i].ring;
            match q.set_notify(&mem, !on) {
                Ok(a) => waiting |= a != q.next_avail(),
                Err(e) => {
                    self.t.broken(&format!("queue {i} used ring: {e}"));
                    return false;
                }
            }
        }
        waiting
    }
}
#[cfg(test)]
#[path = "pci_tests.rs"]
mod tests;
