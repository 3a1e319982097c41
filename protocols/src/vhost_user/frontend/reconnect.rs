//! A backend that dies is replaced, and the guest does not notice.
//!
//! - **In-flight region**: where the backend offers INFLIGHT_SHMFD (iopath's
//!   does), the first DRIVER_OK asks for one (GET_INFLIGHT_FD, the queues
//!   of this function, each of the largest ring's size) and the frontend
//!   keeps its fd and a mapping of it until reset; every session, the
//!   first and each replayed one, gets it with SET_INFLIGHT_FD before any
//!   ring starts. The backend notes there each chain it took and has not
//!   completed.
//! - **Death**: a watcher thread per socket sees it close (the process
//!   died, or an external server went away). Under the device lock (the
//!   guest's register accesses wait; its kicks land in the ioeventfds,
//!   which keep them), the cause is logged (exit status or signal of a
//!   process the VMM started) and a new session is made as the
//!   [`Reconnect`] says: the same `iopath serve` on a new socket pair, or
//!   the external socket, waited for (bounded, `iopath run --reconnect-ms`).
//! - **Replay**: the connect handshake again (the backend must offer the
//!   same features; the configuration the driver read is kept), then, if
//!   the rings ran, what DRIVER_OK sent: SET_FEATURES (the driver's),
//!   SET_MEM_TABLE, SET_INFLIGHT_FD (the kept region), and for each ring
//!   NUM, ADDR, BASE (its used index as the guest sees it), CALL, KICK,
//!   ENABLE, then one kick each, since a kick the dead backend read, or
//!   one that came while none listened, must not be lost. The new backend
//!   resubmits what the region holds. Rings that ran without a region
//!   (the backend does not offer it) cannot be resumed safely: that death
//!   stops the run, as before.
//! - **Bounds**: [`ATTEMPTS`] tries per death (a wait for an external
//!   socket that ran out is not tried again: the device lock is held for
//!   at most that wait), at most [`MAX_DEATHS`] deaths in [`DEATH_WINDOW`];
//!   past them the device needs reset and the run stops with the last
//!   error.
//! - **Measure**: `reconnects` counts the sessions made again; after each,
//!   a thread watches the started rings' used indexes (bounded by
//!   [`PAUSE_WATCH`]) and logs and counts the pause, from the death seen to
//!   the first completion after it.

use super::{deadline::Deadline, ring, VhostUserBlk};
use crate::peer::Peer;
use crate::process::DeviceProcess;
use crate::respawn::{death_cause, Reconnect};
use crate::{Error, Result};
use iopath_devices::virtio::transport::{State, Transport};
use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};
use vhost::vhost_user::message::VhostUserInflight;
use vhost::vhost_user::{Frontend, VhostUserFrontend};
use vm_memory::{FileOffset, MmapRegion};

/// Tries to make a new session after one death.
pub const ATTEMPTS: usize = 3;
/// Deaths allowed within [`DEATH_WINDOW`] before the backend is given up on.
pub const MAX_DEATHS: usize = 32;
pub const DEATH_WINDOW: Duration = Duration::from_secs(60);
/// How long after a reconnect a first completion is waited for, to measure the pause.
pub const PAUSE_WATCH: Duration = Duration::from_secs(10);
/// The largest in-flight region accepted from a backend (16 queues of
/// 32768 descriptors take about 8.5 MiB).
const MAX_INFLIGHT: u64 = 64 << 20;

/// The in-flight region: its fd, what GET_INFLIGHT_FD said of it, and this
/// process's mapping of it (kept with the fd until reset).
pub struct Inflight {
    file: Arc<File>,
    msg: VhostUserInflight,
    _map: MmapRegion<()>,
}

impl Inflight {
    fn map(file: File, msg: VhostUserInflight) -> Result<Self> {
        if msg.mmap_size == 0 || msg.mmap_size > MAX_INFLIGHT || !msg.mmap_offset.is_multiple_of(4096) {
            return Err(Error::protocol(format!(
                "GET_INFLIGHT_FD: {:#x} bytes at {:#x} (at most {MAX_INFLIGHT:#x}, page aligned)",
                msg.mmap_size, msg.mmap_offset
            )));
        }
        let have = file.metadata().map_err(|e| Error::io("in-flight region", e))?.len();
        if msg.mmap_offset.checked_add(msg.mmap_size).is_none_or(|end| end > have) {
            return Err(Error::protocol(format!("GET_INFLIGHT_FD: a region past its fd's {have:#x} bytes")));
        }
        let file = Arc::new(file);
        let map = MmapRegion::from_file(FileOffset::from_arc(file.clone(), msg.mmap_offset), msg.mmap_size as usize)
            .map_err(|e| Error::io("in-flight region mmap", std::io::Error::other(e)))?;
        Ok(Inflight { file, msg, _map: map })
    }
}

impl VhostUserBlk {
    /// The in-flight region for the rings `t` starts: asked for at the
    /// first DRIVER_OK (GET_INFLIGHT_FD), then given to this backend.
    pub(super) fn set_inflight(&mut self, t: &Transport) -> Result<()> {
        if self.inflight.is_none() {
            let size = t.queues.iter().filter(|q| q.ring.ready).map(|q| q.ring.num).max().unwrap_or(1);
            let size = size.checked_next_power_of_two().unwrap_or(size);
            let ask = VhostUserInflight { mmap_size: 0, mmap_offset: 0, num_queues: self.queues, queue_size: size };
            let (msg, file) = self.msg("GET_INFLIGHT_FD", |fe| fe.get_inflight_fd(&ask))?;
            self.inflight = Some(Inflight::map(file, msg)?);
        }
        let (msg, fd) = match &self.inflight {
            Some(f) => (f.msg, f.file.as_raw_fd()),
            None => return Ok(()),
        };
        self.msg("SET_INFLIGHT_FD", |fe| fe.set_inflight_fd(&msg, fd))
    }

    /// Starts the thread that sees this socket close and starts the session
    /// again (one per socket: attached again, nothing more is started).
    pub(super) fn watch_death(&mut self) {
        if self.watched == Some(self.generation) {
            return;
        }
        self.watched = Some(self.generation);
        let Ok(sock) = self.peer.sock.try_clone() else {
            return log::error!("{}: cannot watch the backend's socket: its death will go unseen", self.name);
        };
        let on = self.peer.watching();
        on.store(true, Ordering::Release);
        let (me, generation) = (self.me.clone(), self.generation);
        let spawned = std::thread::Builder::new().name("vhost-user-watch".into()).spawn(move || {
            while on.load(Ordering::Acquire) {
                if crate::socket::peer_closed(&sock, 100) {
                    let seen = Instant::now();
                    if on.swap(false, Ordering::AcqRel) {
                        if let Some(dev) = me.upgrade() {
                            let mut g = iopath_devices::lock(&dev);
                            let State { t, e } = &mut *g;
                            // A request that failed on this socket may have revived it first.
                            if e.generation == generation {
                                let started = e.session.is_some();
                                e.revive(t, seen, started);
                            }
                        }
                    }
                    return;
                }
            }
        });
        if let Err(e) = spawned {
            log::error!("{}: cannot watch the backend's socket ({e}): its death will go unseen", self.name);
        }
    }

    /// A new socket (and process) for the session: a new peer, watchdog
    /// and `vhost` frontend; the old ones go.
    fn adopt(&mut self, sock: UnixStream, child: Option<DeviceProcess>) -> Result<()> {
        let ours = sock.try_clone().map_err(|e| Error::io("vhost-user socket", e))?;
        let watched = sock.try_clone().map_err(|e| Error::io("vhost-user socket", e))?;
        let mut peer = Peer::new(sock, &self.name, child);
        peer.fail = self.fail.clone();
        // The watchdog says nothing to the run until the session is back.
        self.deadline = Deadline::new(watched, &self.name, peer.watching())
            .map_err(|e| Error::io("vhost-user deadline thread", e))?;
        self.peer = peer;
        self.fe = Frontend::from_stream(ours, 1);
        self.generation += 1;
        Ok(())
    }

    /// One try at a new session: connect, handshake, and if the rings ran
    /// (`started`), what DRIVER_OK sent, with the kept in-flight region.
    /// An error says whether another try may help (not after a wait for an
    /// external socket that already took its whole bound).
    fn replay(
        &mut self,
        t: &mut Transport,
        again: &Reconnect,
        started: bool,
    ) -> std::result::Result<(), (bool, Error)> {
        let (sock, child) = again.again().map_err(|e| (matches!(again, Reconnect::Respawn { .. }), e))?;
        self.adopt(sock, child).map_err(|e| (true, e))?;
        self.resume(t, started).map_err(|e| (true, e))
    }

    /// The handshake and, if the rings ran, DRIVER_OK's requests again.
    fn resume(&mut self, t: &mut Transport, started: bool) -> Result<()> {
        let (features, config) = (self.backend_features, self.config);
        self.within(Self::greet)?;
        self.config = config; // what the driver read stays
        if self.backend_features != features {
            return Err(Error::protocol(format!(
                "the new backend offers features {:#x}, the one the driver knew {features:#x}",
                self.backend_features
            )));
        }
        if started {
            if !self.inflight_acked {
                return Err(Error::protocol(
                    "the new backend tracks no in-flight requests: its rings cannot be resumed",
                ));
            }
            self.within(|s| s.start(t, true))?;
        }
        Ok(())
    }
}

impl VhostUserBlk {
    /// Runs `f` (requests of a vCPU: DRIVER_OK, reset, a call change); if
    /// it failed because the backend's socket closed (before its watcher
    /// acted), the session is made again first and `f` runs once more.
    pub(super) fn recovering(
        &mut self,
        t: &mut Transport,
        f: impl Fn(&mut Self, &mut Transport) -> Result<()>,
    ) -> Result<()> {
        let started = self.session.is_some();
        let Err(e) = f(self, t) else { return Ok(()) };
        if self.again.is_none() || self.ended || !crate::socket::peer_closed(&self.peer.sock, 0) {
            return Err(e);
        }
        // The watcher of this socket must not act on it again.
        if !self.peer.watching().swap(false, Ordering::AcqRel) {
            return Err(e);
        }
        log::warn!("{}: {e}: the backend is gone", self.name);
        self.revive(t, Instant::now(), started);
        self.peer.alive()?;
        f(self, t)
    }
}

/// See [`VhostUserBlk::revive`].
fn revive(t: &mut Transport, e: &mut VhostUserBlk, seen: Instant, started: bool) {
    if e.ended || e.peer.dead.is_some() {
        return;
    }
    let Some(again) = e.again.clone() else { return };
    let cause = death_cause(e.peer.hang_up());
    // The old rings' calls and relays go; a reset during this is not possible (the lock).
    e.session = None;
    if started && e.inflight.is_none() {
        // Without the region what the dead backend took is lost: not resumable.
        let why = format!("{cause}; the backend tracked no in-flight requests, so its rings cannot be resumed");
        return e.give_up(t, &Error::PeerGone(why));
    }
    if !e.budget.spend(seen) {
        let why = format!("{cause}; {} deaths within {DEATH_WINDOW:?}: given up", MAX_DEATHS + 1);
        return e.give_up(t, &Error::PeerGone(why));
    }
    let mut last = None;
    for attempt in 1..=ATTEMPTS {
        match e.replay(t, &again, started) {
            Ok(()) => {
                last = None;
                break;
            }
            Err((retry, err)) => {
                log::warn!("{}: reconnect try {attempt} of {ATTEMPTS} failed: {err}", e.name);
                e.session = None;
                last = Some(err);
                if !retry {
                    break;
                }
            }
        }
    }
    if let Some(err) = last {
        return e.give_up(t, &Error::PeerGone(format!("{cause}; no new session: {err}")));
    }
    if let Some(f) = e.fail.clone() {
        e.deadline.set_fail(f);
    }
    e.st.reconnects += 1;
    let n = e.st.reconnects;
    let took = seen.elapsed();
    let rings = e.session.as_ref().map(|s| s.queues()).unwrap_or_default();
    log::warn!(
        "{}: {cause}; reconnect {n}: session replayed in {:.1} ms ({} ring(s) resumed)",
        e.name,
        took.as_secs_f64() * 1e3,
        rings.len()
    );
    e.watch_death();
    // The pause: from the death seen to the first completion after it.
    let Some(mem) = t.ctx.as_ref().map(|c| c.mem.clone()) else { return };
    let used: Vec<(u64, u16)> = rings
        .iter()
        .filter_map(|&q| {
            let gpa = t.queues.get(q as usize)?.ring.used;
            Some((gpa, ring::used_idx(&mem, gpa).ok()?))
        })
        .collect();
    if used.is_empty() {
        return;
    }
    let (me, name) = (e.me.clone(), e.name.clone());
    let _ = std::thread::Builder::new()
        .name("vhost-user-pause".into())
        .spawn(move || watch_pause(&mem, &used, seen, n, &me, &name));
}

impl VhostUserBlk {
    /// The backend's socket closed at `seen`: a new session (with the
    /// rings replayed if they ran, `started`), or (out of tries, or of the
    /// death budget) the device needs reset and the run stops. Called
    /// under the device lock.
    pub(super) fn revive(&mut self, t: &mut Transport, seen: Instant, started: bool) {
        revive(t, self, seen, started)
    }
}

/// Waits (bounded) for any of the rings' used indexes to move from where
/// the replay found it; logs and counts the pause since `seen`.
fn watch_pause(
    mem: &iopath_devices::GuestMem,
    used: &[(u64, u16)],
    seen: Instant,
    n: u64,
    me: &Weak<Mutex<State<VhostUserBlk>>>,
    name: &str,
) {
    let end = Instant::now() + PAUSE_WATCH;
    while Instant::now() < end {
        if used.iter().any(|&(gpa, at)| ring::used_idx(mem, gpa).is_ok_and(|now| now != at)) {
            let pause = seen.elapsed();
            let us = pause.as_micros() as u64;
            log::warn!("{name}: reconnect {n}: first completion {:.1} ms after the death", us as f64 / 1e3);
            let Some(dev) = me.upgrade() else { return };
            let st = &mut iopath_devices::lock(&dev).e.st;
            st.pauses += 1;
            st.pause_sum_us += us;
            st.pause_max_us = st.pause_max_us.max(us);
            return;
        }
        std::thread::sleep(Duration::from_micros(200));
    }
    log::info!("{name}: reconnect {n}: no completion within {PAUSE_WATCH:?} (an idle guest?)");
}
