//! The proxy's reconnect: a device process that dies (or whose socket
//! closes or breaks) does not stop the run. The proxy gets a new one
//! ([`Source`]: it starts the iopath device process it spawned again, or
//! waits, bounded, for an external socket to listen again), replays its
//! session on it and hands the state memory over:
//!
//! 1. VERSION (with the state memory offer), DEVICE_GET_INFO, the
//!    configuration header, GET_IRQ_INFO, GET_REGION_INFO and
//!    GET_REGION_IO_FDS of each BAR: `discovery`, as at `connect`; the
//!    device must be the same (IDs, BARs), else the run stops;
//! 2. DMA_MAP of each region of guest RAM, with the same fds;
//! 3. SET_IRQS of INTx (the same trigger and resample eventfds), if the
//!    device has INTx;
//! 4. the configuration writes the guest made, in their order (each
//!    offset and width once, its last value; none since the last reset);
//! 5. SET_IRQS of each MSI-X vector handed over before, with the same
//!    eventfd (the same KVM irqfd);
//! 6. the BAR pages (sparse mmap areas), if the device maps any into the
//!    guest: what the old process's pages hold now is written into the new
//!    process's (see below);
//! 7. STATE_MEMORY with the same memfd and `resume`, if the session had
//!    state memory (the device then resumes from it);
//! 8. then, locally: the KVM ioeventfds move to the new process's
//!    eventfds (kicks left in an old one are written to its successor), the
//!    ioregionfd regions are replaced, and the new process's BAR pages are
//!    mapped into the guest in place of the old ones.
//!
//! The access that met the broken channel waits for all this and is sent
//! again once (a register write a dead process may or may not have taken
//! is repeated: for a stateless device harmless, and a device with state
//! memory resumes from what it recorded before it). Other accesses wait on
//! the proxy's lock meanwhile. A watcher thread reconnects at once when the
//! socket closes, so a guest that only rings ioeventfds is served too.
//!
//! Reconnects are bounded: at most [`MAX_BURST`] within [`BURST_WINDOW`]
//! (a device process that dies whenever it is used stops the run), each
//! within the source's window ([`RESPAWN_WINDOW`] and [`RESPAWN_ATTEMPTS`]
//! processes for one the VMM starts; `--reconnect-ms` for a socket).
//!
//! A device that maps BAR pages into the guest (sparse mmap areas, e.g.
//! NVMe's doorbell page in `bar`, `bar-adaptive` and `auto`) keeps every
//! store the guest makes to them across the death. The pages are memory
//! the dead process made (a memfd); the VMM's mapping, and the proxy's
//! copy of each fd, outlive it. So:
//! - on the death, first, the proxy has the VMM take each page out of the
//!   guest (`IoEvents::trap_area`, the memslot removed): the guest's next
//!   store to one exits to the MMIO bus and reaches the proxy's
//!   `bar_write`, which waits on the proxy's lock until the new process is
//!   up, and is then sent to it as a REGION_WRITE. A store made before the
//!   trap is in the old page. If the VMM cannot take a page out, the run
//!   stops (a store would land where nobody looks);
//! - after the dead process is reaped, and before the new device resumes
//!   (step 6, before 7: the device starts polling only when it resumes),
//!   each old page's bytes are written into the new process's page
//!   (`pwrite` to its fd). The new device thus starts from every store
//!   made until the trap, and sees the trapped ones, later, as register
//!   writes. What it takes from the page is the guest's, hence validated
//!   by the device as any guest store (NVMe checks each tail and head
//!   against its queue, and a resumed controller takes an SQ's tail to be
//!   the head its state memory recorded, so a tail it already fetched up
//!   to fetches nothing again: `devices/src/nvme/state/`);
//! - once the session is replayed, the VMM maps the new pages where the old
//!   ones were (`IoEvents::replace_area`, with the memslot out) and puts
//!   them back into the guest. If it cannot, a page stays out of the guest
//!   and its stores go on as REGION_WRITEs: slower, never lost.
//!
//! The alternative, the old page's fd handed to the new process (an
//! extension beside STATE_MEMORY), would save the copy and the memslot
//! change, but a page the dead process made would then be a device's
//! memory for ever, any client could hand a device any fd as its BAR, and
//! deployed servers would need the extension; the copy needs nothing of the
//! server but the sparse mmap it already offers. The pages must be the
//! same as the dead process's (BAR, offset, size), and a reconnect carries
//! at most [`MAX_CARRIED`] bytes of them.
//!
//! A device without state memory (pci-testdev; any peer that does not know
//! the extension) is reconnected as well, with a warning that its
//! registers and in-flight work are lost: for a stateless device that is
//! harmless. iopath's NVMe controller and virtio-blk keep state memory
//! (where their configuration allows: `DeviceModel::state_len`) and resume
//! silently. A session that had state memory and whose new process cannot
//! take it back ends (the run stops): a device that forgot its state
//! would complete or lose commands the guest cannot know of.

use super::channel::Channel;
use super::{discovery, dma, VfioUserProxy};
use crate::peer::Peer;
use crate::process::DeviceProcess;
use crate::respawn::{Budget, Reaping, Reconnect};
use crate::vfio_user::wire::*;
use crate::{Error, Result};
use iopath_devices::state::StateMemory;
use iopath_devices::{DeviceContext, MappedArea};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

/// The proxy counter of reconnects.
pub const RECONNECTS: &str = "vfio-user.reconnects";
/// The proxy counter of the time reconnects took, in µs (each from the
/// death noticed to the session replayed).
pub const RECONNECT_US: &str = "vfio-user.reconnect-us";

/// How long a reconnect to a device process the VMM starts may take.
pub const RESPAWN_WINDOW: Duration = Duration::from_secs(10);
/// Most device processes started for one reconnect.
const RESPAWN_ATTEMPTS: u32 = 3;
/// Most reconnects within [`BURST_WINDOW`]: a device process that dies
/// as soon as it is used (a crash the guest triggers every time) stops the
/// run instead of being started forever.
pub const MAX_BURST: usize = 8;
pub const BURST_WINDOW: Duration = Duration::from_secs(10);
/// How often a socket that is not back yet is tried again.
const RETRY_EVERY: Duration = Duration::from_millis(20);
/// Most bytes of BAR pages a reconnect copies from the dead process's pages
/// to the new one's (NVMe's doorbell page is 4 KiB): a server cannot make
/// the VMM copy gigabytes.
pub const MAX_CARRIED: u64 = 1 << 20;

/// Where a new process of the device comes from.
pub(in crate::vfio_user) enum Source {
    /// No reconnect: a broken channel ends the peer (the run stops).
    None,
    /// The VMM's own `iopath serve` (the same binary and arguments).
    Spawn { exe: PathBuf, args: Vec<String> },
    /// An external server listening on `path`, waited for up to `window`.
    Socket { path: PathBuf, window: Duration },
}

impl Source {
    /// Reconnect for an iopath device process the VMM started, or for a
    /// socket the server listens on if a window is set.
    pub(super) fn of(sock: &UnixStream, child: Option<&DeviceProcess>) -> Source {
        if let Some(c) = child {
            return match c.command() {
                Some((exe, args)) => Source::Spawn { exe: exe.into(), args: args.to_vec() },
                None => Source::None,
            };
        }
        let window = crate::respawn::socket_wait();
        let path = sock.peer_addr().ok().and_then(|a| a.as_pathname().map(PathBuf::from));
        match path {
            Some(path) if !window.is_zero() => Source::Socket { path, window },
            _ => Source::None,
        }
    }

    pub(super) fn enabled(&self) -> bool {
        !matches!(self, Source::None)
    }

    fn window(&self) -> Duration {
        match self {
            Source::Socket { window, .. } => *window,
            _ => RESPAWN_WINDOW,
        }
    }

    /// A new connection to the device: a started process, or the socket.
    fn open(&self, deadline: Instant) -> Result<(UnixStream, Option<DeviceProcess>)> {
        match self {
            Source::None => Err(Error::PeerGone("no reconnect".into())),
            Source::Spawn { exe, args } => Reconnect::Respawn { exe: exe.clone(), args: args.clone() }.again(),
            Source::Socket { path, .. } => {
                let wait = deadline.saturating_duration_since(Instant::now());
                Reconnect::Socket { path: path.clone(), wait }.again()
            }
        }
    }
}

/// What the proxy keeps to reconnect: where from, what to replay.
#[derive(Default)]
pub(super) struct Session {
    /// The VMM's services, from the attach on.
    pub(super) ctx: Option<DeviceContext>,
    /// The guest's configuration writes since the last reset: (offset,
    /// bytes), each offset and width once, in the order last written.
    pub(super) config: Vec<(usize, Vec<u8>)>,
    /// The client's copy of the state memory, if VERSION agreed on one.
    pub(super) state: Option<StateMemory>,
    pub(super) reconnects: u64,
    /// The time the reconnects took, from the death noticed to the replay done (µs).
    pub(super) reconnect_us: u64,
    /// The latest reconnects (at most [`MAX_BURST`] within [`BURST_WINDOW`]).
    budget: Option<Budget>,
    /// Set when the session ends: nothing reconnects after.
    pub(super) ending: Arc<AtomicBool>,
    /// Counts reconnects for the watcher (it reconnects once per break).
    pub(super) generation: u64,
    /// The proxy itself, for the watcher (set by `shared`).
    pub(super) me: Option<Weak<Mutex<VfioUserProxy>>>,
}

/// Most configuration writes kept (a header of 256 bytes, at most 3 widths).
const MAX_CONFIG_WRITES: usize = 768;

impl Session {
    /// Records a guest configuration write for the replay.
    pub(super) fn config_written(&mut self, offset: usize, data: &[u8]) {
        self.config.retain(|(o, d)| !(*o == offset && d.len() == data.len()));
        if self.config.len() < MAX_CONFIG_WRITES {
            self.config.push((offset, data.to_vec()));
        }
    }
}

impl VfioUserProxy {
    /// The state memory VERSION agreed on, created and handed over fresh
    /// (at connect). A refusal is logged: the device then runs without.
    pub(super) fn adopt_fresh_state(&mut self, len: Option<u64>) -> Result<()> {
        let Some(len) = len else { return Ok(()) };
        let mem = StateMemory::create(len as usize).map_err(Error::from)?;
        let name = self.chan.peer.name.clone();
        match send_state(&mut self.chan, &mem, false) {
            Ok(()) => {
                log::info!("{name}: the device keeps its state in {len} bytes of state memory");
                self.session.state = Some(mem);
                Ok(())
            }
            Err(e @ Error::Remote { .. }) => {
                log::warn!("{name}: the device refused state memory: {e}; it cannot resume after a restart");
                Ok(())
            }
            Err(e) => Err(e),
        }
    }

    /// Runs `op`; if the channel broke on it and reconnect is on, gets a
    /// new process of the device and runs `op` once more.
    pub(super) fn retried<T>(&mut self, mut op: impl FnMut(&mut Self) -> Result<T>) -> Result<T> {
        let r = op(self);
        let Err(e) = &r else { return r };
        if matches!(e, Error::Remote { .. }) || !self.source.enabled() {
            return r;
        }
        let cause = self.chan.broken.clone().unwrap_or_else(|| e.to_string());
        if self.recover(&cause) {
            op(self)
        } else {
            r
        }
    }

    /// Gets a new process of the device and replays the session on it,
    /// retried until the source's window ends; false (and the run stops)
    /// if it could not. `cause`: the error that broke the channel.
    pub(super) fn recover(&mut self, cause: &str) -> bool {
        if self.chan.peer.dead.is_some() {
            return false;
        }
        if self.session.ending.load(Ordering::Acquire) || !self.source.enabled() {
            self.chan.peer.die(&Error::PeerGone(cause.to_string()));
            return false;
        }
        let name = self.chan.peer.name.clone();
        let began = Instant::now();
        let budget = self.session.budget.get_or_insert_with(|| Budget::new(MAX_BURST, BURST_WINDOW));
        if !budget.spend(began) {
            let e = format!("{cause}; {MAX_BURST} reconnects within {BURST_WINDOW:?} already: no more");
            self.chan.reconnects = false;
            self.chan.peer.die(&Error::PeerGone(e));
            return false;
        }
        // The guest's stores to the BAR pages exit from here on (the module's doc).
        let trapped = self.trap_areas();
        // The new process starts while the dead one is reaped (`Reaping`),
        // unless the device maps BAR pages: those are carried over once the
        // dead process can no longer store to them, so it is reaped first.
        let reaping = Reaping::start(self.chan.peer.hang_up());
        let (reaping, reaped_first) =
            if self.dev.areas.is_empty() { (Some(reaping), None) } else { (None, Some(reaping.cause())) };
        if let Err(e) = trapped {
            let death = reaped_first.map(|c| c.0).or_else(|| reaping.map(|r| r.cause().0)).unwrap_or_default();
            let e = format!("{death}: {cause}; {e}");
            self.chan.reconnects = false;
            self.chan.peer.die(&Error::PeerGone(e));
            return false;
        }
        let deadline = began + self.source.window();
        let mut attempts = 0;
        let last = loop {
            attempts += 1;
            match self.reconnect_once(deadline) {
                Ok(()) => break None,
                Err(e) => {
                    log::warn!("{name}: reconnect attempt {attempts} ({cause}): {e}");
                    let spawned = matches!(self.source, Source::Spawn { .. });
                    if Instant::now() >= deadline || (spawned && attempts >= RESPAWN_ATTEMPTS) {
                        break Some(e);
                    }
                    std::thread::sleep(RETRY_EVERY);
                }
            }
        };
        let (death, reaped) = match reaping {
            Some(r) => r.cause(),
            None => reaped_first.unwrap_or_default(),
        };
        let why = format!("{death}: {cause}");
        if let Some(e) = last {
            let e = Error::PeerGone(format!("{why}; no reconnect after {attempts} attempts: {e}"));
            self.chan.broken = None;
            self.chan.reconnects = false;
            self.chan.peer.die(&e);
            return false;
        }
        self.session.reconnects += 1;
        self.session.generation += 1;
        let n = self.session.reconnects;
        let took = began.elapsed();
        self.session.reconnect_us += took.as_micros() as u64;
        log::warn!(
            "{name}: reconnected in {took:?} (the death's cause known after {reaped:?}; {n} so far) after {why}"
        );
        if std::env::var_os("IOPATH_DEBUG_RECONNECT").is_some() {
            eprintln!("{name}: reconnected in {took:?} (cause known after {reaped:?}) after {why}");
        }
        if self.session.state.is_none() {
            log::warn!(
                "{name}: the device keeps no state memory: its registers and any work in flight at the death are \
                 lost (harmless for a stateless device such as pci-testdev)"
            );
        }
        true
    }

    /// One reconnect: a new connection, the device found again and the
    /// session replayed on it (see the module's order).
    fn reconnect_once(&mut self, deadline: Instant) -> Result<()> {
        let (sock, child) = self.source.open(deadline)?;
        let mut chan = Channel::new(Peer::new(sock, &self.chan.peer.name, child));
        chan.peer.fail = self.chan.peer.fail.clone();
        chan.requests = self.chan.requests;
        chan.reconnects = true;
        chan.dma = std::mem::take(&mut self.chan.dma);
        let found = discovery::discover(&mut chan);
        // From here on the new channel is the proxy's, whatever happens.
        let old = std::mem::replace(&mut self.chan, chan);
        drop(old);
        let mut found = found?;
        if found.device.ids != self.dev.ids || found.device.bars != self.dev.bars {
            return Err(Error::protocol("another device came back (its IDs or BARs differ)"));
        }
        let areas = std::mem::take(&mut found.device.areas);
        if !same_pages(&areas, &self.dev.areas) {
            return Err(Error::protocol("another device came back (the BAR pages it maps differ)"));
        }
        let ctx = self.session.ctx.clone();
        if let Some(ctx) = &ctx {
            dma::map_guest_ram(&mut self.chan, &ctx.mem)?;
            self.hand_over_intx(ctx)?;
        }
        self.replay_config()?;
        if let Some(m) = &mut self.msix {
            m.replay(&mut self.chan)?;
        }
        carry_pages(&self.dev.areas, &areas)?;
        if let Some(mem) = &self.session.state {
            if found.state_len != Some(mem.len() as u64) {
                let (had, now) = (mem.len(), found.state_len);
                return Err(Error::protocol(format!("the device had {had} bytes of state memory; now {now:?}")));
            }
            send_state(&mut self.chan, mem, true)?;
        }
        self.move_ioevents(ctx.as_ref(), found.io.ioevents)?;
        self.region_commands += self.regions.iter().map(|(_, r)| r.commands).sum::<u64>();
        self.regions = found.io.regions;
        if self.chan.broken.is_some() {
            return Err(Error::PeerGone(self.chan.broken.clone().unwrap_or_default()));
        }
        self.map_new_pages(ctx.as_ref(), areas);
        Ok(())
    }

    /// On a death: each BAR page the device maps into the guest taken out
    /// of it (its stores exit to `bar_write` from now on). Err if one could
    /// not be: the run must stop, a store would be lost.
    fn trap_areas(&self) -> std::result::Result<(), String> {
        if self.dev.areas.is_empty() {
            return Ok(());
        }
        let Some(ctx) = &self.session.ctx else {
            return Err("the device maps BAR pages into the guest and was never attached".into());
        };
        for a in &self.dev.areas {
            if !ctx.ioevents.trap_area(a.bar, a.offset, true) {
                return Err(format!(
                    "the VMM could not take the BAR{} page at {:#x} out of the guest: its stores would be lost, \
                     so the device is not reconnected",
                    a.bar, a.offset
                ));
            }
        }
        Ok(())
    }

    /// The new process's BAR pages into the guest in place of the old ones
    /// (trapped since the death), and kept as the device's. One the VMM
    /// cannot map stays out: its stores go on as REGION_WRITEs.
    fn map_new_pages(&mut self, ctx: Option<&DeviceContext>, new: Vec<MappedArea>) {
        let name = &self.chan.peer.name;
        if let Some(ctx) = ctx {
            for a in &new {
                let Ok(fd) = a.fd.try_clone() else { continue };
                let page = MappedArea { bar: a.bar, offset: a.offset, size: a.size, fd, fd_offset: a.fd_offset };
                if !ctx.ioevents.replace_area(page) {
                    log::warn!(
                        "{name}: the new BAR{} page at {:#x} could not be mapped; its stores exit",
                        a.bar,
                        a.offset
                    );
                } else if !ctx.ioevents.trap_area(a.bar, a.offset, false) {
                    log::warn!(
                        "{name}: the BAR{} page at {:#x} did not go back into the guest; its stores exit",
                        a.bar,
                        a.offset
                    );
                }
            }
        }
        self.dev.areas = new;
    }

    /// The guest's configuration writes, in order, as `config_write` sends them.
    fn replay_config(&mut self) -> Result<()> {
        for (offset, data) in &self.session.config {
            for (at, bytes) in super::without_cap_headers(&self.dev.cap_headers, *offset, data) {
                match self.chan.region_write(PCI_CONFIG_REGION_INDEX, at as u64, bytes) {
                    Ok(()) | Err(Error::Remote { .. }) => {}
                    Err(e) => return Err(e),
                }
            }
        }
        Ok(())
    }

    /// The KVM ioeventfds from the old process's eventfds to the new one's
    /// (kicks left in an old one are written to the new one of its spec).
    fn move_ioevents(
        &mut self,
        ctx: Option<&DeviceContext>,
        new: Vec<(iopath_devices::IoEventSpec, vmm_sys_util::eventfd::EventFd)>,
    ) -> Result<()> {
        let old = std::mem::replace(&mut self.ioevents, new);
        let Some(ctx) = ctx else { return Ok(()) };
        for (spec, fd) in &old {
            if let Err(e) = ctx.ioevents.unregister(*spec, fd) {
                log::warn!("{}: removing {spec:?}: {e}", self.chan.peer.name);
            }
        }
        for (spec, fd) in &self.ioevents {
            ctx.ioevents.register(*spec, fd).map_err(|e| Error::from(e).context(format!("installing {spec:?}")))?;
            let kicks = old.iter().find(|(s, _)| s == spec).map_or(0, |(_, o)| pending(o));
            if kicks > 0 {
                let _ = fd.write(kicks);
            }
        }
        Ok(())
    }

    /// Watches the socket and reconnects as soon as it closes (a guest that
    /// only rings ioeventfds sends nothing the proxy would see fail).
    pub(super) fn watch(&self) {
        let Some(me) = self.session.me.clone() else { return };
        let Ok(mut sock) = self.chan.peer.sock.try_clone() else { return };
        let (ending, mut generation) = (self.session.ending.clone(), self.session.generation);
        let _ = std::thread::Builder::new().name("vfio-user-watch".into()).spawn(move || loop {
            if ending.load(Ordering::Acquire) {
                return;
            }
            if !crate::socket::peer_closed(&sock, 100) {
                continue;
            }
            let Some(p) = me.upgrade() else { return };
            let mut g = iopath_devices::lock(&p);
            if ending.load(Ordering::Acquire) || g.chan.peer.dead.is_some() {
                return;
            }
            if g.session.generation == generation && !g.recover("the device process closed its socket") {
                return;
            }
            generation = g.session.generation;
            match g.chan.peer.sock.try_clone() {
                Ok(s) => sock = s,
                Err(_) => return,
            }
        });
    }
}

/// The kicks an eventfd holds, taken (never blocks).
fn pending(fd: &vmm_sys_util::eventfd::EventFd) -> u64 {
    if iopath_devices::irq::wait_readable(fd, Duration::ZERO) {
        fd.read().unwrap_or(0)
    } else {
        0
    }
}

/// True if `new` are the BAR pages `old` were: the same BARs, offsets and sizes, in order.
fn same_pages(new: &[MappedArea], old: &[MappedArea]) -> bool {
    new.len() == old.len() && new.iter().zip(old).all(|(n, o)| (n.bar, n.offset, n.size) == (o.bar, o.offset, o.size))
}

/// What each of the dead process's BAR pages holds, written into the new
/// process's (`same_pages` checked). At most [`MAX_CARRIED`] bytes in all;
/// a new page past the end of its fd is refused (a write there would grow
/// the file, or fail on a sealed memfd).
pub(in crate::vfio_user) fn carry_pages(old: &[MappedArea], new: &[MappedArea]) -> Result<()> {
    use std::os::unix::fs::FileExt;
    let total = old.iter().fold(0u64, |t, a| t.saturating_add(a.size));
    if total > MAX_CARRIED {
        return Err(Error::protocol(format!(
            "the device maps {total} bytes of BAR pages; a reconnect carries {MAX_CARRIED}"
        )));
    }
    for (o, n) in old.iter().zip(new) {
        let len = n.fd.metadata().map_err(|e| Error::io("the new process's BAR page", e))?.len();
        if n.fd_offset.checked_add(n.size).is_none_or(|end| end > len) {
            let (at, size) = (n.fd_offset, n.size);
            return Err(Error::protocol(format!(
                "the new BAR page ({size} bytes at {at:#x}) is past its fd's {len} bytes"
            )));
        }
        let mut bytes = vec![0u8; o.size as usize];
        o.fd.read_exact_at(&mut bytes, o.fd_offset).map_err(|e| Error::io("reading the dead process's BAR page", e))?;
        n.fd.write_all_at(&bytes, n.fd_offset).map_err(|e| Error::io("writing the new process's BAR page", e))?;
    }
    Ok(())
}

/// STATE_MEMORY: `mem`'s fd to the server, fresh or to `resume` from.
fn send_state(chan: &mut Channel, mem: &StateMemory, resume: bool) -> Result<()> {
    let flags = if resume { STATE_MEMORY_RESUME } else { 0 };
    let q = StateMemoryMsg { flags, size: mem.len() as u64 };
    chan.request(Command::StateMemory, &q.to_bytes(), &[mem.fd().as_raw_fd()]).map(|_| ())
}
