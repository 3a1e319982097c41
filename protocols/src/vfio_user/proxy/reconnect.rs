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
//! 6. STATE_MEMORY with the same memfd and `resume`, if the session had
//!    state memory (the device then resumes from it);
//! 7. then, locally: the KVM ioeventfds move to the new process's
//!    eventfds (kicks left in an old one are written to its successor) and
//!    the ioregionfd regions are replaced.
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
//! NVMe's doorbell=bar page) is not reconnected: the VMM mapped the first
//! process's pages at attach and has no way to swap them, so the run stops
//! with that reason.
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
use iopath_devices::DeviceContext;
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
        // The new process starts while the dead one is reaped (`Reaping`).
        let reaping = Reaping::start(self.chan.peer.hang_up());
        if !self.dev.areas.is_empty() {
            let why = format!("{}: {cause}", reaping.cause().0);
            let e = format!("{why}; the device maps BAR pages into the guest, which a new process cannot replace");
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
        let (death, reaped) = reaping.cause();
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
        let found = found?;
        if found.device.ids != self.dev.ids || found.device.bars != self.dev.bars {
            return Err(Error::protocol("another device came back (its IDs or BARs differ)"));
        }
        if !found.device.areas.is_empty() || !self.dev.areas.is_empty() {
            // The VMM mapped the first process's BAR pages into the guest
            // at attach and cannot swap them: the guest's writes would go
            // to pages nobody reads. A clean stop, not a device that hangs.
            return Err(Error::protocol(
                "the device maps BAR pages into the guest (sparse mmap): a new process's pages cannot \
                 replace them, so it is not reconnected",
            ));
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
        Ok(())
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

/// STATE_MEMORY: `mem`'s fd to the server, fresh or to `resume` from.
fn send_state(chan: &mut Channel, mem: &StateMemory, resume: bool) -> Result<()> {
    let flags = if resume { STATE_MEMORY_RESUME } else { 0 };
    let q = StateMemoryMsg { flags, size: mem.len() as u64 };
    chan.request(Command::StateMemory, &q.to_bytes(), &[mem.fd().as_raw_fd()]).map(|_| ())
}
