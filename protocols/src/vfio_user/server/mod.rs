//! The device side of vfio-user: the session loop and one handler per
//! command, grouped by concern (`dma.rs`, `region.rs`, `irq.rs`; version,
//! device info and reset here). `link.rs` is the socket as the session
//! shares it: a reader thread, replies to the server's own DMA requests
//! routed to their waiters, commands to the handler here, in order.
//!
//! Input is hostile. A request this side cannot serve gets an error reply
//! (EINVAL unless a handler says which errno) and the session goes on; only
//! a broken stream (a message that cannot be read or skipped, a reply where a
//! command belongs, a failed send) ends the session with an error.
//!
//! Deployed clients are served as they are: a request may be longer than
//! its fixed part (`argsz` is the reply buffer), a reply never exceeds the
//! request's `argsz` (it is cut, with `argsz` the size needed), VERSION is
//! answered with a subset of the proposal, and the server takes more fds
//! per message than it advertised (rust-vmm's client ignores the limit).

mod dma;
mod irq;
mod link;
mod region;

pub use link::{DmaStats, DMA_TIMEOUT};

use super::wire::{self, error_reply, fixed_part, Capabilities, Command, DeviceInfo, Version};
use super::wire::{DEFAULT_MAX_DATA_XFER_SIZE, INFO16_SIZE, VERSION_MAJOR, VERSION_MINOR};
use super::wire::{DEVICE_FLAGS_PCI, DEVICE_FLAGS_RESET, PCI_NUM_IRQS, PCI_NUM_REGIONS};
use super::{Received, MAX_FDS};
use crate::function::{no_memory, PciFunction};
use crate::transport::Server;
use crate::{Error, Result};
use iopath_devices::irq::IrqLines;
use iopath_devices::{DeviceContext, GuestMem, IoEventSpec, IoEvents, NoIoEvents};
use link::Link;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::sync::mpsc::{channel, Receiver};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;
use vmm_sys_util::eventfd::EventFd;

/// What GET_REGION_IO_FDS offers for a BAR.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IoFds {
    /// The ioeventfds the device registers (type IOEVENTFD): the client
    /// installs them as KVM ioeventfds.
    IoEventFds,
    /// One ioregionfd region per BAR (type IOREGIONFD, the [`ioregionfd`]
    /// extension); with `posted`, writes get no reply.
    ///
    /// [`ioregionfd`]: crate::vfio_user::ioregionfd
    IoRegionFds { posted: bool },
}

/// What this server can do, the most a VERSION answer offers: fds and
/// data per message, DMA maps, any page size from 4 KiB up (a map is any
/// page-aligned range of an fd), REGION_WRITE_MULTI. No twin socket: the
/// server's DMA_READ/DMA_WRITE (maps without an fd) go on the one socket,
/// which every client that has the fallback serves (QEMU's does).
const SERVER_CAPS: Capabilities = Capabilities {
    max_msg_fds: MAX_FDS,
    max_data_xfer_size: DEFAULT_MAX_DATA_XFER_SIZE,
    max_dma_maps: 65535,
    pgsizes: !0xfff,
    write_multiple: true,
};

/// Ioeventfds the device asked for, kept to announce with GET_REGION_IO_FDS.
#[derive(Default)]
struct Announced(Mutex<Vec<(IoEventSpec, EventFd)>>);

impl IoEvents for Announced {
    fn register(&self, spec: IoEventSpec, fd: &EventFd) -> iopath_devices::Result<()> {
        let fd = fd.try_clone().map_err(|e| iopath_devices::Error::io("dup of an ioeventfd", e))?;
        iopath_devices::lock(&self.0).push((spec, fd));
        Ok(())
    }
    fn unregister(&self, spec: IoEventSpec, _: &EventFd) -> iopath_devices::Result<()> {
        iopath_devices::lock(&self.0).retain(|(s, _)| *s != spec);
        Ok(())
    }
    fn static_only(&self) -> bool {
        true
    }
}

/// Serves one function to one vfio-user client at a time; what it keeps
/// across clients is the function and the ioeventfds its device announced.
pub struct VfioUserServer {
    f: Arc<Mutex<PciFunction>>,
    irq: Arc<IrqLines>,
    io_fds: IoFds,
    announced: Arc<Announced>,
    ioevents: Arc<dyn IoEvents>,
    /// How long a DMA_READ/DMA_WRITE waits for the client.
    dma_timeout: Duration,
    dma_stats: Arc<DmaStats>,
}

impl VfioUserServer {
    /// Attaches the device (no memory yet) with the host services the
    /// server offers: announced ioeventfds with [`IoFds::IoEventFds`], none
    /// with ioregionfd (its regions carry every access).
    pub fn new(f: Arc<Mutex<PciFunction>>, irq: Arc<IrqLines>, io_fds: IoFds) -> Self {
        let announced = Arc::new(Announced::default());
        let ioevents: Arc<dyn IoEvents> =
            if io_fds == IoFds::IoEventFds { announced.clone() } else { Arc::new(NoIoEvents) };
        let dma_stats = Arc::new(DmaStats::default());
        let stats = dma_stats.clone();
        iopath_devices::lock(&f).add_counters(Box::new(move || stats.counters()));
        let s = VfioUserServer { f, irq, io_fds, announced, ioevents, dma_timeout: DMA_TIMEOUT, dma_stats };
        s.function().attach(s.context(no_memory().into()));
        s
    }

    /// How long a DMA_READ/DMA_WRITE to the client waits for its reply
    /// ([`DMA_TIMEOUT`] unless set).
    pub fn set_dma_timeout(&mut self, d: Duration) {
        self.dma_timeout = d;
    }

    fn function(&self) -> MutexGuard<'_, PciFunction> {
        iopath_devices::lock(&self.f)
    }

    fn context(&self, mem: GuestMem) -> DeviceContext {
        let mut c = DeviceContext::detached(mem);
        c.ioevents = self.ioevents.clone();
        c.irq = self.irq.clone();
        c
    }
}

impl Server for VfioUserServer {
    /// Serves one client: a reader thread takes every message off the
    /// socket (see `link.rs`), this thread handles the commands in order.
    fn session(&mut self, sock: &UnixStream, peer: &str) -> Result<()> {
        let wsock = sock.try_clone().map_err(|e| Error::io("dup of the session socket", e))?;
        let link = Arc::new(Link::new(wsock, peer, self.dma_timeout, self.dma_stats.clone()));
        let (tx, rx) = channel();
        let r = std::thread::scope(|scope| {
            let l = link.clone();
            let reader = std::thread::Builder::new()
                .name("vfio-user-rx".into())
                .spawn_scoped(scope, move || l.read_loop(sock, tx))
                .map_err(|e| Error::io("vfio-user reader thread", e))?;
            let mut s = Session {
                srv: self,
                peer,
                link: link.clone(),
                versioned: false,
                client: Capabilities::default(),
                caps: Capabilities::default(),
                dma: Vec::new(),
                remote_logged: false,
                intx: (None, None),
            };
            let r = s.run(&rx);
            // Over (the client left, or the channel is closed on an error):
            // waiting DMA fails now, and the reader stops.
            link.close();
            let _ = sock.shutdown(std::net::Shutdown::Both);
            let _ = reader.join();
            drop(s);
            r
        });
        // Disconnect: drop DMA and IRQ fds; the device keeps its state.
        self.function().attach(self.context(no_memory().into()));
        r
    }
}

/// A DMA_MAP the client made, mapped here if it came with an fd.
struct DmaEntry {
    map: wire::DmaMap,
    region: Option<Arc<vm_memory::GuestRegionMmap>>,
}

/// Per-client state.
struct Session<'a> {
    srv: &'a VfioUserServer,
    peer: &'a str,
    /// The socket's write side and the server's DMA requests.
    link: Arc<Link>,
    versioned: bool,
    /// What the client proposed in VERSION: the most it takes from the
    /// server (fds per message).
    client: Capabilities,
    /// What the server answered: the session's limits (DMA maps).
    caps: Capabilities,
    dma: Vec<DmaEntry>,
    /// A DMA_MAP without an fd was logged (once per client).
    remote_logged: bool,
    /// INTx trigger and unmask (resample) eventfds, as SET_IRQS gave them.
    intx: (Option<EventFd>, Option<EventFd>),
}

/// A handler's answer: a payload with the fds it hands out, or an errno.
enum Reply {
    Data(Vec<u8>, Vec<OwnedFd>),
    Error(i32),
}

fn ok(payload: Vec<u8>) -> Result<Reply> {
    Ok(Reply::Data(payload, Vec::new()))
}

impl Session<'_> {
    /// Handles the commands the reader thread passes on, in order, until
    /// the client leaves or the stream breaks.
    fn run(&mut self, commands: &Receiver<Result<Received>>) -> Result<()> {
        while let Ok(m) = commands.recv() {
            let m = m?;
            let reply = self.handle(&m).unwrap_or_else(|e| {
                log::warn!("vfio-user {}: command {} (message {}): {e}", self.peer, m.hdr.cmd, m.hdr.msg_id);
                Reply::Error(libc::EINVAL)
            });
            if m.hdr.no_reply() {
                continue;
            }
            match reply {
                Reply::Data(p, fds) => {
                    let raw: Vec<RawFd> = fds.iter().map(|f| f.as_raw_fd()).collect();
                    self.link.send(&wire::reply(&m.hdr, &p), &raw)?
                }
                Reply::Error(errno) => self.link.send(&error_reply(&m.hdr, errno), &[])?,
            }
        }
        Ok(())
    }

    /// One command: its handler, after VERSION.
    fn handle(&mut self, m: &Received) -> Result<Reply> {
        let cmd = m.hdr.command();
        if cmd != Some(Command::Version) && !self.versioned {
            return Err(Error::protocol("VERSION must come first"));
        }
        match cmd {
            Some(Command::Version) => self.version(m),
            Some(Command::DmaMap) => self.dma_map(m),
            Some(Command::DmaUnmap) => self.dma_unmap(m),
            Some(Command::DeviceGetInfo) => self.device_info(m),
            Some(Command::DeviceGetRegionInfo) => self.region_info(m),
            Some(Command::DeviceGetRegionIoFds) => self.region_io_fds(m),
            Some(Command::DeviceGetIrqInfo) => self.irq_info(m),
            Some(Command::DeviceSetIrqs) => self.set_irqs(m),
            Some(Command::RegionRead) => self.region_read(m),
            Some(Command::RegionWrite) => self.region_write(m),
            Some(Command::RegionWriteMulti) => self.region_write_multi(m),
            Some(Command::DeviceReset) => self.reset(m),
            Some(c) => {
                log::warn!("vfio-user {}: command {c:?} is not served here", self.peer);
                Ok(Reply::Error(libc::ENOTSUP))
            }
            None => {
                log::warn!("vfio-user {}: unknown command {}", self.peer, m.hdr.cmd);
                Ok(Reply::Error(libc::ENOSYS))
            }
        }
    }

    fn version(&mut self, m: &Received) -> Result<Reply> {
        no_fds(m)?;
        let v = Version::parse(&m.payload)?;
        if v.major != VERSION_MAJOR {
            return Err(Error::protocol(format!("client speaks major version {}", v.major)));
        }
        // The answer is a subset of the proposal (absent keys: the spec's
        // defaults), and always carries JSON: rust-vmm's client needs it.
        let proposed = v.caps();
        let caps = SERVER_CAPS.answer(&proposed).ok_or_else(|| {
            Error::protocol(format!("client page sizes {:#x}: none of 4 KiB or more", proposed.pgsizes))
        })?;
        (self.versioned, self.client, self.caps) = (true, proposed, caps);
        self.link.set_max_xfer(caps.max_data_xfer_size);
        let mine = Version { major: VERSION_MAJOR, minor: v.minor.min(VERSION_MINOR), capabilities: Some(caps) };
        ok(mine.to_bytes())
    }

    fn device_info(&mut self, m: &Received) -> Result<Reply> {
        no_fds(m)?;
        // argsz is the client's reply buffer (rust-vmm's counts its header: 32).
        DeviceInfo::parse(fixed_part(&m.payload, INFO16_SIZE))?;
        let flags = DEVICE_FLAGS_RESET | DEVICE_FLAGS_PCI;
        ok(DeviceInfo { argsz: 16, flags, num_regions: PCI_NUM_REGIONS, num_irqs: PCI_NUM_IRQS }.to_bytes())
    }

    fn reset(&mut self, m: &Received) -> Result<Reply> {
        no_fds(m)?;
        wire::expect_empty("device reset", &m.payload)?;
        self.srv.function().device.reset();
        ok(Vec::new())
    }
}

/// Refuses a request that came with fds it does not take.
fn no_fds(m: &Received) -> Result<()> {
    match m.fds.len() {
        0 => Ok(()),
        n => Err(Error::protocol(format!("{n} unexpected fds"))),
    }
}
