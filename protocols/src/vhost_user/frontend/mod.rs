//! The VMM side of a vhost-user-blk device: iopath's modern virtio PCI
//! transport (`iopath_devices::virtio::transport`) whose queues a vhost-user
//! backend serves (iopath's `iopath serve virtio-blk --transport vhost-user`,
//! qemu-storage-daemon's vhost-user-blk export, any other), driven through
//! the rust-vmm `vhost` crate's [`Frontend`].
//!
//! - **Connect** ([`connect`]): SET_OWNER, GET_FEATURES, GET/SET_PROTOCOL_FEATURES
//!   (CONFIG, REPLY_ACK, MQ and INFLIGHT_SHMFD, those offered), GET_QUEUE_NUM when more
//!   than one queue is asked for, and GET_CONFIG, because the driver reads
//!   the device features and the capacity before DRIVER_OK. No ring,
//!   memory or fd is sent yet.
//! - **Queues**: the function has the `queues=N` the VMM asked for (1 by
//!   default; `virtio-blk,queues=N@vhost-user[:PATH]`). N > 1 needs a
//!   backend that offers VIRTIO_BLK_F_MQ, the MQ protocol feature and at
//!   least N queues (GET_QUEUE_NUM), or the connect fails and says which.
//!   MQ is passed to the driver whenever the backend offers it, with
//!   num_queues = N in the configuration (the backend's own count is its
//!   bound, not what this function has).
//! - **DRIVER_OK** (`ring.rs`): SET_FEATURES
//!   (the driver's choice), SET_MEM_TABLE (the VMM's RAM memfd),
//!   GET_INFLIGHT_FD (once, kept until reset) and SET_INFLIGHT_FD, then for
//!   each queue the driver enabled: SET_VRING_NUM/ADDR/BASE,
//!   SET_VRING_CALL (its MSI-X vector's irqfd, or an eventfd the VMM
//!   relays), SET_VRING_KICK (the eventfd that is the KVM ioeventfd on its
//!   notify address, registered at attach: one per queue, since each of
//!   the backend's rings waits on its own) and SET_VRING_ENABLE. A guest
//!   that never writes DRIVER_OK gets nothing sent; queues it leaves
//!   disabled are never started.
//! - **Interrupt changes** after DRIVER_OK (a queue's vector, MSI-X
//!   enable, a vector routed): a new SET_VRING_CALL for each queue whose
//!   calls must go elsewhere ([`QueueEngine::interrupt_changed`]).
//! - **Reset**: SET_VRING_ENABLE(0), then GET_VRING_BASE stops each
//!   started ring; the fds of the session are dropped.
//!
//! REPLY_ACK is negotiated where the backend offers it, so every request
//! is answered. Each sequence of requests (connect, DRIVER_OK, reset, a
//! call fd change) is bounded as a whole by [`BACKEND_TIMEOUT`] (a
//! watchdog shuts the socket down: `deadline.rs`). A backend that
//! does not answer or answers nonsense puts the device in
//! DEVICE_NEEDS_RESET with a log line and stops the run (the context's
//! fail hook). One that hangs up (dies) is replaced and its session
//! replayed, with the in-flight region kept (INFLIGHT_SHMFD), if the
//! frontend was made with a way back ([`connect_again`]: `reconnect.rs`);
//! else it stops the run too.

mod deadline;
mod reconnect;
mod ring;

use crate::peer::Peer;
use crate::process::DeviceProcess;
use crate::respawn::{Budget, Reconnect};
use crate::{Error, Result};
use deadline::Deadline;
use iopath_devices::virtio::blk::NUM_QUEUES_AT;
use iopath_devices::virtio::pci::F_MQ;
use iopath_devices::virtio::transport::{
    notify_offset, DeviceConfigBytes, QueueEngine, Shared, State, Transport, VirtioPci, DEVCFG_LEN, F_EVENT_IDX,
    F_VERSION_1, MAX_QUEUES,
};
use iopath_devices::{Counter, DeviceContext, FailFn, IoEventSpec, SharedDevice};
use reconnect::Inflight;
use ring::Session;
use std::os::unix::net::UnixStream;
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};
use vhost::vhost_user::message::{
    VhostUserConfigFlags, VhostUserHeaderFlag, VhostUserProtocolFeatures, VhostUserVirtioFeatures,
};
use vhost::vhost_user::{Frontend, VhostUserFrontend};
use vhost::VhostBackend;
use vmm_sys_util::eventfd::EventFd;

/// How long the frontend waits for the backend to answer all requests of
/// one sequence: the connect handshake, a DRIVER_OK, a reset, a new call fd.
pub const BACKEND_TIMEOUT: Duration = Duration::from_secs(5);
/// The virtio-blk PCI device id (0x1040 + type 2).
const DEVICE_ID: u16 = 0x1042;
/// The bytes of virtio_blk_config asked for with GET_CONFIG: up to
/// write_zeroes_may_unmap and its padding (the part our device
/// configuration area shows; any backend's config is at least this long).
pub const CONFIG_LEN: u32 = 60;

/// Feature bits the transport passes from the backend to the driver: the
/// block device's own (SIZE_MAX, SEG_MAX, GEOMETRY, RO, BLK_SIZE, FLUSH,
/// TOPOLOGY, DISCARD, WRITE_ZEROES, MQ with num_queues set to the
/// function's queues) and the ring's that the backend's queue implements
/// (INDIRECT_DESC, EVENT_IDX), plus VERSION_1, which the transport
/// requires. Not passed: CONFIG_WCE (the driver would write `writeback`,
/// and configuration writes are not forwarded as SET_CONFIG), PACKED,
/// ACCESS_PLATFORM, NOTIFICATION_DATA, RING_RESET (the transport has none
/// of these) and PROTOCOL_FEATURES (vhost-user's own, bit 30).
pub const PASSED_FEATURES: u64 = (1 << 1)
    | (1 << 2)
    | (1 << 4)
    | (1 << 5)
    | (1 << 6)
    | (1 << 9)
    | (1 << 10)
    | F_MQ
    | (1 << 13)
    | (1 << 14)
    | (1 << 28)
    | F_EVENT_IDX
    | F_VERSION_1;

/// The frontend's counters (see [`QueueEngine::counters`]).
#[derive(Default)]
pub(super) struct Stats {
    /// Messages sent to the backend.
    pub(super) backend_msgs: u64,
    /// DRIVER_OKs that set the ring up in the backend.
    pub(super) activations: u64,
    /// Notify writes that exited and that the VMM passed to the kick eventfd.
    pub(super) kicks_forwarded: u64,
    /// Call fds given that were the MSI-X vector's irqfd (KVM injects).
    pub(super) call_irqfd: u64,
    /// Backend calls the VMM relayed (INTx, or a vector without an irqfd).
    pub(super) calls_relayed: u64,
    /// Call fds replaced after DRIVER_OK (the driver changed the queue's vector or MSI-X).
    pub(super) call_changes: u64,
    /// Requests the backend failed or did not answer.
    pub(super) backend_errors: u64,
    /// Sessions started again after the backend died (`reconnect.rs`).
    pub(super) reconnects: u64,
    /// Reconnects after which a completion was seen, and the pauses (from
    /// the death seen to that completion) added up and the longest, in µs.
    pub(super) pauses: u64,
    pub(super) pause_sum_us: u64,
    pub(super) pause_max_us: u64,
}

/// A virtio-blk queue served by a vhost-user backend.
pub struct VhostUserBlk {
    pub(super) fe: Frontend,
    deadline: Deadline,
    pub(super) peer: Peer,
    /// What the backend offered (GET_FEATURES).
    pub(super) backend_features: u64,
    /// The protocol features acked (SET_PROTOCOL_FEATURES was sent).
    pub(super) protocol: bool,
    config: DeviceConfigBytes,
    /// The function's queues (1 ..= MAX_QUEUES).
    queues: u16,
    /// Each queue's notify eventfd (made at the first attach), KVM's
    /// ioeventfd on its notify address when `kick_registered`.
    pub(super) kicks: Vec<Arc<EventFd>>,
    /// Every queue's notify address is a KVM ioeventfd.
    pub(super) kick_registered: bool,
    /// The rings as set up at DRIVER_OK, until reset.
    pub(super) session: Option<Session>,
    pub(super) me: Weak<Mutex<State<VhostUserBlk>>>,
    pub(super) st: Stats,
    pub(super) name: String,
    /// The session with the backend was ended (quiesce).
    ended: bool,
    /// When the sequence of requests under way must be done.
    until: Option<Instant>,
    /// Relay threads running (they end within one poll of their session's end).
    pub(super) relays: Arc<std::sync::atomic::AtomicUsize>,
    /// How the backend comes back when it dies (None: its death stops the run).
    pub(super) again: Option<Reconnect>,
    /// The backend offered INFLIGHT_SHMFD and it was acked.
    pub(super) inflight_acked: bool,
    /// The in-flight region of the rings started at DRIVER_OK (kept across
    /// backends until reset).
    pub(super) inflight: Option<Inflight>,
    /// The run's fail hook (from attach).
    pub(super) fail: Option<FailFn>,
    /// How often the backend may die before it is given up on.
    pub(super) budget: Budget,
    /// Which socket the session is on (one more at each new one).
    pub(super) generation: u64,
    /// The socket (generation) a death watcher was started for.
    pub(super) watched: Option<u64>,
}

/// Connects to the backend on `sock` (a device process the VMM started,
/// `child`, or one listening on a socket) and makes the PCI function, with
/// `queues` queues (1 ..= 16) the backend must serve.
pub fn connect(sock: UnixStream, child: Option<DeviceProcess>, name: &str, queues: u16) -> Result<SharedDevice> {
    connect_again(sock, child, name, queues, None)
}

/// [`connect`], and when the backend dies (its socket closes) the session
/// is started again as `again` says (`reconnect.rs`); None: its death
/// stops the run.
pub fn connect_again(
    sock: UnixStream,
    child: Option<DeviceProcess>,
    name: &str,
    queues: u16,
    again: Option<Reconnect>,
) -> Result<SharedDevice> {
    let mut engine = VhostUserBlk::handshake(sock, child, name, queues)?;
    engine.again = again;
    let dev = Arc::new(VirtioPci::with_engine(engine));
    iopath_devices::lock(dev.shared()).e.me = Arc::downgrade(dev.shared());
    Ok(dev)
}

/// A vhost crate error as ours (the socket timeout is a timeout).
pub(super) fn vhost_err(what: &str, e: vhost::Error) -> Error {
    use vhost::vhost_user::Error as U;
    match e {
        vhost::Error::VhostUserProtocol(U::SocketError(io) | U::SocketRetry(io) | U::SocketBroken(io)) => {
            Error::io(format!("vhost-user {what}"), io)
        }
        vhost::Error::VhostUserProtocol(U::Disconnected | U::PartialMessage) => {
            Error::PeerGone(format!("vhost-user {what}: the backend hung up"))
        }
        e => Error::protocol(format!("vhost-user {what}: {e}")),
    }
}

impl VhostUserBlk {
    fn handshake(sock: UnixStream, child: Option<DeviceProcess>, name: &str, queues: u16) -> Result<Self> {
        if !(1..=MAX_QUEUES).contains(&queues) {
            return Err(Error::Config(format!("{name}: {queues} queues (1 ..= {MAX_QUEUES})")));
        }
        let ours = sock.try_clone().map_err(|e| Error::io("vhost-user socket", e))?;
        let watched = sock.try_clone().map_err(|e| Error::io("vhost-user socket", e))?;
        let peer = Peer::new(sock, name, child);
        let deadline =
            Deadline::new(watched, name, peer.watching()).map_err(|e| Error::io("vhost-user deadline thread", e))?;
        let mut e = VhostUserBlk {
            fe: Frontend::from_stream(ours, 1),
            deadline,
            peer,
            backend_features: 0,
            protocol: false,
            config: [0; DEVCFG_LEN as usize],
            queues,
            kicks: Vec::new(),
            kick_registered: false,
            session: None,
            me: Weak::new(),
            st: Stats::default(),
            name: name.to_string(),
            ended: false,
            until: None,
            relays: Arc::default(),
            again: None,
            inflight_acked: false,
            inflight: None,
            fail: None,
            budget: Budget::new(reconnect::MAX_DEATHS, reconnect::DEATH_WINDOW),
            generation: 0,
            watched: None,
        };
        e.within(Self::greet)?;
        Ok(e)
    }

    /// The connect handshake: owner, features, protocol features, configuration.
    fn greet(e: &mut Self) -> Result<()> {
        e.msg("SET_OWNER", |fe| fe.set_owner())?;
        e.backend_features = e.msg("GET_FEATURES", |fe| fe.get_features())?;
        if e.backend_features & F_VERSION_1 == 0 {
            return Err(Error::protocol("vhost-user backend does not offer VIRTIO_F_VERSION_1"));
        }
        if e.backend_features & VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits() == 0 {
            return Err(Error::protocol("vhost-user backend has no protocol features (GET_CONFIG needs them)"));
        }
        let offered = e.msg("GET_PROTOCOL_FEATURES", |fe| fe.get_protocol_features())?;
        if !offered.contains(VhostUserProtocolFeatures::CONFIG) {
            return Err(Error::protocol("vhost-user backend does not offer GET_CONFIG (protocol feature CONFIG)"));
        }
        // REPLY_ACK, where offered, makes every request answered, so a
        // backend that stops answering is seen at DRIVER_OK, not never.
        // MQ lets GET_QUEUE_NUM be asked.
        use VhostUserProtocolFeatures as P;
        // INFLIGHT_SHMFD lets a backend that replaces a dead one resubmit
        // what the dead one had taken (`reconnect.rs`).
        let acked = offered & (P::CONFIG | P::REPLY_ACK | P::MQ | P::INFLIGHT_SHMFD);
        e.msg("SET_PROTOCOL_FEATURES", |fe| fe.set_protocol_features(acked))?;
        e.inflight_acked = acked.contains(P::INFLIGHT_SHMFD);
        e.protocol = true;
        if acked.contains(P::REPLY_ACK) {
            e.fe.set_hdr_flags(VhostUserHeaderFlag::NEED_REPLY);
        }
        if e.queues > 1 {
            let n = e.queues;
            if e.backend_features & F_MQ == 0 {
                return Err(Error::Config(format!("{n} queues asked, and the backend does not offer VIRTIO_BLK_F_MQ")));
            }
            if !acked.contains(P::MQ) {
                return Err(Error::Config(format!("{n} queues asked, and the backend has no protocol feature MQ")));
            }
            // The crate bounds the answer and takes it as its queue limit.
            let has = e.msg("GET_QUEUE_NUM", |fe| fe.get_queue_num())?;
            if has < n as u64 {
                return Err(Error::Config(format!("{n} queues asked, and the backend has {has} (GET_QUEUE_NUM)")));
            }
        }
        let blank = [0u8; CONFIG_LEN as usize];
        let (_, cfg) = e.msg("GET_CONFIG", |fe| fe.get_config(0, CONFIG_LEN, VhostUserConfigFlags::empty(), &blank))?;
        // The crate checked the reply's size against the request's.
        let n = cfg.len().min(e.config.len());
        e.config[..n].copy_from_slice(&cfg[..n]);
        // The driver is offered this function's queues, not all the backend has.
        e.config[NUM_QUEUES_AT..NUM_QUEUES_AT + 2].copy_from_slice(&e.queues.to_le_bytes());
        Ok(())
    }

    /// Runs `f`, a sequence of requests, under one deadline (the outermost's).
    pub(super) fn within<T>(&mut self, f: impl FnOnce(&mut Self) -> Result<T>) -> Result<T> {
        let outer = self.until.is_none();
        if outer {
            self.until = Some(Instant::now() + BACKEND_TIMEOUT);
        }
        let r = f(self);
        if outer {
            self.until = None;
        }
        r
    }

    /// Sends one request (counted) and maps the crate's error to ours.
    pub(super) fn msg<T>(&mut self, what: &str, f: impl FnOnce(&mut Frontend) -> vhost::Result<T>) -> Result<T> {
        self.peer.alive()?;
        self.st.backend_msgs += 1;
        let fe = &mut self.fe;
        let at = self.until.unwrap_or_else(|| Instant::now() + BACKEND_TIMEOUT);
        let r = match self.deadline.run(what, at, || f(fe)) {
            (Ok(v), false) => return Ok(v),
            (_, true) => {
                Error::Timeout { what: format!("vhost-user {what} (in a sequence bounded by {BACKEND_TIMEOUT:?})") }
            }
            (Err(e), false) => vhost_err(what, e),
        };
        self.st.backend_errors += 1;
        Err(r)
    }

    /// The backend failed: the device needs a reset, and the run stops.
    pub(super) fn give_up(&mut self, t: &mut Transport, e: &Error) {
        t.broken(&format!("vhost-user backend: {e}"));
        self.peer.die(e);
    }
}

impl QueueEngine for VhostUserBlk {
    fn name(&self) -> String {
        self.name.clone()
    }

    /// SET_MEM_TABLE passes guest RAM's fds.
    fn shares_guest_ram(&self) -> bool {
        true
    }

    fn device_id(&self) -> u16 {
        DEVICE_ID
    }

    /// The same function as iopath's own virtio-blk shows.
    fn class(&self) -> u32 {
        iopath_devices::virtio::pci::CLASS
    }

    fn features(&self) -> u64 {
        self.backend_features & PASSED_FEATURES
    }

    fn device_config(&self) -> DeviceConfigBytes {
        self.config
    }

    fn num_queues(&self) -> u16 {
        self.queues
    }

    fn attach(dev: &Shared<Self>, ctx: &DeviceContext) {
        let mut s = iopath_devices::lock(dev);
        s.e.peer.fail = Some(ctx.fail.clone());
        s.e.fail = Some(ctx.fail.clone());
        s.e.deadline.set_fail(ctx.fail.clone());
        if s.e.again.is_some() {
            // A backend that dies is started again (one watcher per socket).
            s.e.watch_death();
        } else {
            s.e.peer.watch(); // one watcher per peer: again, it only takes the new fail hook
        }
        if !s.e.kicks.is_empty() {
            return;
        }
        // Each queue's notify address becomes the KVM ioeventfd its ring
        // in the backend is kicked through; one that cannot be registered
        // exits, and `notify` passes it on.
        let mut registered = true;
        for q in 0..s.e.queues {
            let kick = match EventFd::new(libc::EFD_NONBLOCK) {
                Ok(k) => Arc::new(k),
                Err(e) => {
                    s.e.kicks.clear();
                    return log::error!("{}: eventfd: {e}", s.e.name);
                }
            };
            let spec = IoEventSpec { bar: 0, offset: notify_offset(q), len: 0, datamatch: None };
            if let Err(e) = ctx.ioevents.register(spec, &kick) {
                log::warn!("{}: queue {q}: no ioeventfd ({e}); the VMM passes notifications on", s.e.name);
                registered = false;
            }
            s.e.kicks.push(kick);
        }
        s.e.kick_registered = registered;
    }

    fn quiesce(dev: &Shared<Self>) {
        let child = {
            let mut s = iopath_devices::lock(dev);
            s.e.session = None;
            // Once: quiesce and then drop both come here, and a second end
            // would wait for counters the device process already gave.
            if std::mem::replace(&mut s.e.ended, true) {
                return;
            }
            s.e.peer.hang_up()
        };
        // The device process's counters are waited for (up to 5 s) without
        // the device lock, which a vCPU may want meanwhile.
        let Some(mut child) = child else { return };
        let name = iopath_devices::lock(dev).e.name.clone();
        let counters = Peer::counters_of(&mut child, &name);
        iopath_devices::lock(dev).e.peer.ended(child, counters);
    }

    fn driver_ok(&mut self, t: &mut Transport) -> iopath_devices::Result<()> {
        if !t.queues.iter().any(|q| q.ring.ready) {
            // The driver's mistake, not the backend's: NEEDS_RESET (the transport's), nothing sent.
            return Err(iopath_devices::Error::Host("DRIVER_OK with no queue enabled".into()));
        }
        if let Err(e) = self.recovering(t, |s, t| s.within(|s| s.start(t, false))) {
            // The backend failed: NEEDS_RESET, and the run stops.
            self.give_up(t, &e);
        }
        Ok(())
    }

    fn notify(&mut self, _t: &mut Transport, queue: u16) {
        // Without an ioeventfd the notify write lands here: pass it on to a started ring.
        let started = self.session.as_ref().is_some_and(|s| s.started(queue));
        if let (Some(k), true) = (self.kicks.get(queue as usize), started) {
            if k.write(1).is_ok() {
                self.st.kicks_forwarded += 1;
            }
        }
    }

    fn reset(&mut self, t: &mut Transport) {
        if let Err(e) = self.recovering(t, |s, _| s.within(|s| s.stop())) {
            self.give_up(t, &e);
        }
    }

    fn interrupt_changed(&mut self, t: &mut Transport) {
        if let Err(e) = self.recovering(t, |s, t| s.within(|s| s.interrupt_changed(t))) {
            self.give_up(t, &e);
        }
    }

    fn counters(&self) -> Vec<Counter> {
        let st = &self.st;
        let mut v: Vec<Counter> = [
            ("backend_msgs", st.backend_msgs),
            ("activations", st.activations),
            ("kick_ioeventfd", self.kick_registered as u64),
            ("kicks_forwarded", st.kicks_forwarded),
            ("call_irqfd", st.call_irqfd),
            ("calls_relayed", st.calls_relayed),
            ("call_changes", st.call_changes),
            ("backend_errors", st.backend_errors),
            ("inflight_shmfd", self.inflight_acked as u64),
            ("reconnects", st.reconnects),
            ("reconnect_pauses", st.pauses),
            ("reconnect_pause_sum_us", st.pause_sum_us),
            ("reconnect_pause_max_us", st.pause_max_us),
        ]
        .into_iter()
        .map(|(n, value)| Counter { name: n.into(), value })
        .collect();
        // A device process the VMM started reports its own counters at the end.
        v.extend(self.peer.remote.iter().map(|c| Counter { name: format!("backend.{}", c.name), value: c.value }));
        v
    }
}

#[cfg(test)]
mod tests;
