//! The device process: `iopath serve DEVICE --transport T (--socket PATH | --fd N)`.
//!
//! One device model, one client at a time, whatever the transport: the
//! transport's [`Server`](crate::Server) serves each client. After each
//! client leaves, the process prints the device's counters as one JSON line
//! on stdout, then resets the function (`power_on`): the next client finds
//! a device as after a power-on, not the queues, shadow doorbells and DMA
//! targets the last one left. With `keep_state` (`--keep-state`) the state
//! is kept instead, for a client that reconnects to go on where it was (the
//! vfio-user spec's live reconnect). A protocol error closes that client's
//! channel with a log line naming the client and the message; the process
//! goes on.
//!
//! That is the loop of a function transport. A queue transport
//! (vhost-user), which serves a device's queues rather than a PCI function,
//! has its own loop body ([`QueueTransport::serve`](crate::QueueTransport::serve))
//! on the same `clients` loop, `handshake` and stall bounds; [`run`] finds
//! which from the transport.
//!
//! # Stalled clients
//! A client may be idle between messages for as long as it likes (a VMM
//! whose guest leaves the device alone); what is bounded is a stall inside
//! the protocol ([`Timeouts`]):
//! - a new client's first message must begin within `handshake`, or the
//!   connection is dropped with a log line (it does not count as a client);
//! - once a message has begun, the rest must come within `message` (the
//!   session socket's SO_RCVTIMEO; see [`socket`](crate::socket) for how the
//!   wait between messages escapes it at no cost per message);
//! - the client must take what is sent to it within `send` (SO_SNDTIMEO):
//!   a client that never reads its replies cannot block the process.
//!
//! The last two end the session with [`Error::Timeout`]. On a listening
//! socket the thread `serve-acceptor` takes every connection and holds the
//! ones that wait, each against its own deadlines, all at once
//! (`acceptor.rs`): the first bound above, and the refusal of a
//! client that comes while another is served ([`FunctionTransport::refuse`]:
//! vfio-user answers its first message with EBUSY). It hands the serving
//! thread only a connection that has spoken. Neither a dropped nor a
//! refused connection prints a counters line.
//!
//! The socket file: what may be at PATH before (nothing, or a stale
//! socket; never a regular file, which is refused), and its removal however
//! the process ends: `listen.rs` and `janitor.rs`.

mod acceptor;
pub mod control;
mod janitor;
mod listen;
mod many;

pub use acceptor::MAX_PENDING;

use crate::function::PciFunction;
use crate::process::disconnect_report;
use crate::transport::{FunctionTransport, Server, Transport};
use crate::{Error, Result};
use iopath_devices::irq::IrqLines;
use iopath_devices::pci::{ConfigSpace, CONFIG_SIZE, PCI_COMMAND};
use iopath_devices::virtio::transport::MAX_QUEUES;
use std::io::Write;
use std::os::fd::{AsRawFd, FromRawFd};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::sync_channel;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

pub enum Listen {
    /// An inherited, connected socket: serve it, then exit.
    Fd(i32),
    /// Listen on this path: nothing there, or a stale socket (replaced);
    /// anything else is refused. Removed when the process ends.
    Socket(PathBuf),
}

/// How long a new client may take to send its first message.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// How long the rest of a message may take once it has begun.
pub const MESSAGE_TIMEOUT: Duration = Duration::from_secs(5);
/// How long a client may leave a reply (any send) untaken.
pub const SEND_TIMEOUT: Duration = Duration::from_secs(5);
/// How long a refused client's first message (and the refusal) may take.
pub const REFUSAL_TIMEOUT: Duration = Duration::from_secs(1);

/// Bounds on a client's stalls (see the module doc); none on its idle time.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Timeouts {
    pub handshake: Duration,
    pub message: Duration,
    pub send: Duration,
    pub refusal: Duration,
}

impl Default for Timeouts {
    fn default() -> Self {
        Timeouts {
            handshake: HANDSHAKE_TIMEOUT,
            message: MESSAGE_TIMEOUT,
            send: SEND_TIMEOUT,
            refusal: REFUSAL_TIMEOUT,
        }
    }
}

/// What `iopath serve` was asked.
pub struct ServeOptions {
    /// The model (one the transport carries: [`Transport::carries`]).
    pub device: iopath_devices::DeviceConfig,
    pub transport: Transport,
    pub listen: Listen,
    /// Exit after the first client served (with a listening socket; a
    /// connection dropped at the handshake or refused does not count).
    pub once: bool,
    /// Keep the device state from one client to the next instead of
    /// resetting the function (a client that reconnects).
    pub keep_state: bool,
    /// Bounds on a client's stalls (`iopath serve` takes the defaults).
    pub timeouts: Timeouts,
    /// Confine the process with seccomp once it is set up ([`crate::seccomp`]).
    pub seccomp: bool,
    /// Serve the device's error injection rules on this socket path
    /// (`control.rs`) for as long as the process serves.
    pub control: Option<PathBuf>,
    /// Controllers served, each a device of its own on a socket of its own
    /// (1 ..= [`many::MAX_CONTROLLERS`]; more than one: `many.rs`).
    pub controllers: usize,
    /// nvme `shm`/`bar`: a pool of this many poller threads serves every
    /// controller's queue groups (`iopath_devices::nvme::pool`); None: each
    /// queue group has a poller thread of its own.
    pub pollers: Option<usize>,
}

/// Serves until the inherited socket closes, or forever on a listening
/// socket (until the first client with `once`): the function transport's
/// loop below, or the queue transport's own. A device the transport does
/// not carry is refused before anything is bound.
pub fn run(o: &ServeOptions) -> Result<()> {
    o.transport.carries(&o.device)?;
    if let Some(m) = o.pollers {
        many::pool(o, m)?;
    }
    if o.controllers != 1 {
        return many::run(o);
    }
    match o.transport {
        Transport::Function(t) => function(o, t),
        Transport::Queues(q) => q.serve(o),
    }
}

/// The loop of the function transport `transport`.
fn function(o: &ServeOptions, transport: &'static dyn FunctionTransport) -> Result<()> {
    check_timeouts(&o.timeouts)?;
    let bound = bind(&o.listen)?;
    // A device process does not know its client's vCPUs: without
    // `queues=N` virtio-blk offers them all, and the driver takes what it
    // uses (Linux's virtio_blk one per CPU, iopath's guest queue 0).
    let config = o.device.with_default_queues(MAX_QUEUES);
    let device = config.build()?;
    let _control = control(o, &device)?;
    let f = Arc::new(Mutex::new(PciFunction::new(device)?));
    let irq = IrqLines::new();
    let server = transport.server(f.clone(), irq.clone())?;
    let mut host = Host { o, transport, f, irq, server, index: None };
    let banner = format!("{config} over {}", transport.name());
    let refuse = Box::new(move |s: &UnixStream| transport.refuse(s));
    clients(&o.listen, bound, &banner, o.once, o.seccomp, &o.timeouts, refuse, |sock, peer, free| {
        host.client(sock, peer, free)
    })
}

/// The control socket of `o.control`, on `device`'s rules; served until
/// the value is dropped. A device that takes no rules is refused.
pub(crate) fn control(o: &ServeOptions, device: &iopath_devices::SharedDevice) -> Result<Option<control::Control>> {
    let Some(path) = &o.control else { return Ok(None) };
    let Some(rules) = device.injector() else {
        return Err(Error::Config(format!("--control: {} takes no error injection rules", o.device)));
    };
    control::Control::start(path, rules, Some(device.clone())).map(Some)
}

/// Every timeout must be more than 0.
pub(crate) fn check_timeouts(t: &Timeouts) -> Result<()> {
    if [t.handshake, t.message, t.send, t.refusal].iter().any(|d| d.is_zero()) {
        return Err(Error::Config(format!("every timeout must be more than 0: {t:?}")));
    }
    Ok(())
}

/// Binds the socket of `listen` (if it is one) and starts its janitor,
/// before the device is built: a path that is refused costs nothing, and the
/// janitor is forked from a process that has touched little memory yet (its
/// pages are shared copy-on-write with the janitor for as long as it lives).
pub(crate) fn bind(listen: &Listen) -> Result<Option<listen::Bound>> {
    match listen {
        Listen::Fd(_) => Ok(None),
        Listen::Socket(path) => listen::Bound::new(path).map(Some),
    }
}

/// What a client is refused with when another one is served ([`FunctionTransport::refuse`]).
pub(crate) type Refuse = Box<dyn Fn(&UnixStream) -> Result<()> + Send>;

/// Serves the clients of `listen` one at a time with `client(sock, peer,
/// free)`, which serves one, calls `free` as soon as its session is over,
/// and returns false if it was dropped before its first message: the
/// inherited socket, then returns; or each connection on the listening
/// socket that has spoken (the acceptor drops the silent ones after
/// `timeouts.handshake` and refuses the ones that come while another is
/// served with `refuse`), until the first client with `once`. `banner`
/// names what is served on stderr. `bound`: the socket of `listen` as
/// [`bind`] bound it (bound here if `None`). Confines the process with
/// seccomp once set up.
#[allow(clippy::too_many_arguments)]
pub(crate) fn clients(
    listen: &Listen,
    bound: Option<listen::Bound>,
    banner: &str,
    once: bool,
    seccomp: bool,
    timeouts: &Timeouts,
    refuse: Refuse,
    client: impl FnMut(UnixStream, &str, &dyn Fn()) -> bool,
) -> Result<()> {
    let confine = || if seccomp { crate::seccomp::install() } else { Ok(()) };
    clients_confined(listen, bound, banner, once, &confine, timeouts, refuse, client)
}

/// [`clients`], confined by `confine` once set up (several controllers'
/// loops confine the process once, together: `many.rs`).
#[allow(clippy::too_many_arguments)]
pub(crate) fn clients_confined(
    listen: &Listen,
    bound: Option<listen::Bound>,
    banner: &str,
    once: bool,
    confine: &dyn Fn() -> Result<()>,
    timeouts: &Timeouts,
    refuse: Refuse,
    mut client: impl FnMut(UnixStream, &str, &dyn Fn()) -> bool,
) -> Result<()> {
    // Before any client memory is mapped: a client that shrinks it ends its
    // own session, not the process (`crate::sigbus`).
    crate::sigbus::install()?;
    match listen {
        Listen::Fd(fd) => {
            if *fd < 0 {
                return Err(Error::Config(format!("bad fd {fd}")));
            }
            // SAFETY: the fd was handed to this process to own (see DeviceProcess::spawn).
            let sock = unsafe { UnixStream::from_raw_fd(*fd) };
            confine()?;
            client(sock, &format!("fd {fd}"), &|| {});
            Ok(())
        }
        Listen::Socket(path) => {
            let bound = match bound {
                Some(b) => b,
                None => listen::Bound::new(path)?,
            };
            let l = &bound.listener;
            l.set_nonblocking(true).map_err(|e| Error::io(format!("the listening socket {}", path.display()), e))?;
            let wake = EventFd::new(EFD_NONBLOCK).map_err(|e| Error::io("the acceptor's eventfd", e))?;
            eprintln!("iopath serve: {banner} on {}", path.display());
            confine()?;
            let (tx, rx) = sync_channel(1);
            let (busy, stop) = (AtomicBool::new(false), AtomicBool::new(false));
            let where_ = path.display().to_string();
            std::thread::scope(|scope| {
                let a = acceptor::Acceptor {
                    l,
                    wake: &wake,
                    tx,
                    busy: &busy,
                    stop: &stop,
                    refuse,
                    handshake: timeouts.handshake,
                    refusal: timeouts.refusal,
                    banner,
                    where_: &where_,
                };
                std::thread::Builder::new()
                    .name("serve-acceptor".into())
                    .spawn_scoped(scope, move || a.run())
                    .map_err(|e| Error::io("the acceptor thread", e))?;
                let free = || {
                    busy.store(false, Ordering::Release);
                    let _ = wake.write(1);
                };
                let r = loop {
                    let Ok((sock, n)) = rx.recv() else {
                        break Err(Error::PeerGone(format!("the acceptor on {where_} stopped")));
                    };
                    let peer = format!("client {n} on {where_}");
                    if client(sock, &peer, &free) && once {
                        break Ok(());
                    }
                };
                stop.store(true, Ordering::Release);
                let _ = wake.write(1);
                r
            })
            // `bound` dropped here: the socket closed, its file removed.
        }
    }
}

/// Sets a new client's socket timeouts and waits for its first message
/// (within `t.handshake`); false (logged with `what`) if it is to be dropped.
pub(crate) fn handshake(sock: &UnixStream, t: &Timeouts, what: &str) -> bool {
    let ready = sock.set_read_timeout(Some(t.message)).and_then(|_| sock.set_write_timeout(Some(t.send)));
    if let Err(e) = ready {
        log::error!("{what}: setting its socket timeouts: {e}; dropped");
        return false;
    }
    if !readable_within(sock, t.handshake) {
        log::warn!("{what}: no message within {:?}; dropped", t.handshake);
        return false;
    }
    true
}

/// What serves one client after another.
struct Host<'a> {
    o: &'a ServeOptions,
    transport: &'static dyn FunctionTransport,
    f: Arc<Mutex<PciFunction>>,
    irq: Arc<IrqLines>,
    server: Box<dyn Server>,
    /// With several controllers: this one's index, in its counters line.
    index: Option<usize>,
}

impl Host<'_> {
    /// Serves one connection, then reports and (unless `keep_state`) resets
    /// the function; `free` runs as soon as the session is over, before that.
    /// False if the connection was dropped before its first message.
    fn client(&mut self, sock: UnixStream, peer: &str, free: &dyn Fn()) -> bool {
        let o = self.o;
        let what = format!("{} over {}: {peer}", o.device, self.transport.name());
        if !handshake(&sock, &o.timeouts, &what) {
            free();
            return false;
        }
        // The client's departure and its cause (a client that cannot
        // reconnect, QEMU's vfio-user-pci, leaves for good).
        match self.server.session(&sock, peer) {
            Ok(()) => log::info!("{what}: the client left (it closed its socket)"),
            Err(e) => log::error!("{what}: {e}; closing its channel"),
        }
        drop(sock);
        free();
        self.irq.clear_intx();
        self.irq.clear_msix();
        let mut f = iopath_devices::lock(&self.f);
        let mut line = disconnect_report(self.transport.name(), o.device.name(), &f.counters());
        if let Some(i) = self.index {
            line = many::with_index(&line, i);
        }
        let mut out = std::io::stdout().lock();
        let _ = writeln!(out, "{line}");
        let _ = out.flush();
        if !o.keep_state {
            if let Err(e) = power_on(&mut f) {
                log::error!("{what}: resetting the device after it: {e}");
            }
        }
        true
    }
}

/// The function as after a power-on, for the next client: the model reset
/// as DEVICE_RESET does (queues, shadow doorbells and device threads gone;
/// the counters stay, they are the process's), and a fresh PCI header: BARs
/// unassigned, command register 0 (no memory, I/O or bus master enable),
/// MSI-X off. The header is reset too because a client that does not
/// reprogram it (QEMU's vfio-user-pci does, iopath's proxies do) must not
/// reach the device through the last client's BAR addresses (mpqemu decodes
/// them) or find MSI-X enabled; the model is told of the fresh header as a
/// configuration write, so that its own copy (MSI-X Enable, Function Mask)
/// agrees.
pub fn power_on(f: &mut PciFunction) -> Result<()> {
    f.device.reset();
    let mut c = ConfigSpace::new(f.device.ids(), &f.device.bars())?;
    c.add_capabilities(&f.device.capabilities())?;
    for off in (PCI_COMMAND..CONFIG_SIZE).step_by(4) {
        let mut b = [0u8; 4];
        c.read(off, &mut b);
        f.device.config_write(off, &b);
    }
    f.config = c;
    Ok(())
}

/// True once `sock` has input (or its peer closed) within `d`.
fn readable_within(sock: &UnixStream, d: Duration) -> bool {
    let end = Instant::now() + d;
    loop {
        let left = end.saturating_duration_since(Instant::now());
        let ms = left.as_millis().min(i32::MAX as u128) as i32;
        let mut p = libc::pollfd { fd: sock.as_raw_fd(), events: libc::POLLIN, revents: 0 };
        // SAFETY: one valid pollfd on the stack.
        match unsafe { libc::poll(&mut p, 1, ms) } {
            0 => return false,
            r if r > 0 => return true,
            _ if std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted => {}
            _ => return false,
        }
    }
}
