//! The device side of vfio-user: the session loop and one handler per
//! command, grouped by concern (`dma.rs`, `region.rs`, `irq.rs`; version,
//! device info and reset here). `link.rs` is the socket as the session
//! shares it once the client has mapped memory without an fd: a reader
//! thread, replies to the server's own DMA requests routed to their
//! waiters, commands to the handler here, in order.
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
mod state;

pub use link::{DmaStats, DMA_TIMEOUT};

use super::ioregionfd::Region;
use super::wire::{self, error_reply, fixed_part, Capabilities, Command, DeviceInfo, Version};
use super::wire::{DEFAULT_MAX_DATA_XFER_SIZE, INFO16_SIZE, VERSION_MAJOR, VERSION_MINOR};
use super::wire::{DEVICE_FLAGS_PCI, DEVICE_FLAGS_RESET, PCI_NUM_IRQS, PCI_NUM_REGIONS};
use super::{recv, Received, MAX_FDS};
use crate::function::{no_memory, PciFunction};
use crate::sigbus::Owner;
use crate::transport::Server;
use crate::{Error, Result};
use iopath_devices::irq::IrqLines;
use iopath_devices::{DeviceContext, GuestMem, IoEventSpec, IoEvents, NoIoEvents};
use link::Link;
use std::collections::BTreeMap;
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
    state_memory: None,
};

/// Fds kept free for everything but DMA maps (sockets, eventfds, the
/// device's own files, logs).
const FD_RESERVE: u64 = 128;

/// How many DMA maps this process can hold, one fd each: the soft
/// RLIMIT_NOFILE less [`FD_RESERVE`] and the fds open now, at most
/// SERVER_CAPS' count and at least 1. Advertised in VERSION and enforced
/// (ENOSPC), so a client meets a refusal before EMFILE.
fn dma_map_budget() -> u32 {
    let mut lim = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit fills the struct it is given.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } != 0 {
        return SERVER_CAPS.max_dma_maps;
    }
    let open = crate::nopath::open_fds().unwrap_or(0);
    let free = lim.rlim_cur.saturating_sub(open).saturating_sub(FD_RESERVE);
    free.clamp(1, SERVER_CAPS.max_dma_maps as u64) as u32
}

/// Ioeventfds the device asked for, kept to announce with GET_REGION_IO_FDS:
/// each with the device's fd number it came as and our copy. Registrations
/// of one eventfd (the same fd number while registered: a device unregisters
/// before it closes an fd) share one copy, which GET_REGION_IO_FDS sends
/// once for all their entries: a device may ring many doorbells on one
/// eventfd (NVMe registers 128) and a client takes few fds per message.
#[derive(Default)]
struct Announced(Mutex<Vec<(IoEventSpec, RawFd, Arc<EventFd>)>>);

impl IoEvents for Announced {
    fn register(&self, spec: IoEventSpec, fd: &EventFd) -> iopath_devices::Result<()> {
        let mut a = iopath_devices::lock(&self.0);
        let key = fd.as_raw_fd();
        let copy = match a.iter().find(|(_, k, _)| *k == key) {
            Some((_, _, copy)) => copy.clone(),
            None => Arc::new(fd.try_clone().map_err(|e| iopath_devices::Error::io("dup of an ioeventfd", e))?),
        };
        a.push((spec, key, copy));
        Ok(())
    }
    fn unregister(&self, spec: IoEventSpec, _: &EventFd) -> iopath_devices::Result<()> {
        iopath_devices::lock(&self.0).retain(|(s, _, _)| *s != spec);
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
    /// Serves one client. This thread reads the socket and handles each
    /// command, until the client maps memory without an fd: from then on a
    /// reader thread takes every message off the socket (see `link.rs`) and
    /// this thread handles the commands it passes on, in order, so that the
    /// replies to the server's DMA requests are read whoever waits for them.
    /// A session whose memory all came with fds keeps the one thread and
    /// its latency.
    fn session(&mut self, sock: &UnixStream, peer: &str) -> Result<()> {
        // Nothing the last client was handed (a doorbell page it mapped, the
        // ioeventfds it installed) reaches the device this one is served.
        self.function().device.new_client();
        let wsock = sock.try_clone().map_err(|e| Error::io("dup of the session socket", e))?;
        let link = Arc::new(Link::new(wsock, peer, self.dma_timeout, self.dma_stats.clone()));
        // The SIGBUS handler shuts this socket down for reading if the
        // client shrinks memory it mapped (`crate::sigbus`).
        let owner = Owner::new(Some(sock))?;
        let mut s = Session {
            owner,
            srv: self,
            peer,
            sock,
            link: link.clone(),
            reader: None,
            versioned: false,
            client: Capabilities::default(),
            caps: Capabilities::default(),
            dma: Vec::new(),
            remote_logged: false,
            intx: (None, None),
            regions: BTreeMap::new(),
        };
        let r = s.run();
        // Over (the client left, or the channel is closed on an error):
        // waiting DMA fails now, and the reader stops.
        link.close();
        if let Some((_, reader)) = s.reader.take() {
            let _ = sock.shutdown(std::net::Shutdown::Both);
            let _ = reader.join();
        }
        // The session's ioregionfd regions are shut down and their threads
        // joined: a client's old region fd no longer reaches the device.
        drop(s);
        // Disconnect: drop DMA and IRQ fds; the device keeps its state.
        self.function().attach(self.context(no_memory().into()));
        r
    }
}

/// A DMA_MAP the client made, mapped here if it came with an fd.
struct DmaEntry {
    map: wire::DmaMap,
    region: Option<crate::function::MappedRegion>,
}

/// Per-client state.
struct Session<'a> {
    srv: &'a VfioUserServer,
    peer: &'a str,
    sock: &'a UnixStream,
    /// The socket's write side and the server's DMA requests.
    link: Arc<Link>,
    /// The reader thread and the commands it passes on, once the client has
    /// mapped memory without an fd.
    reader: Option<(Receiver<Result<Received>>, std::thread::JoinHandle<()>)>,
    versioned: bool,
    /// What the client proposed in VERSION: the most it takes from the
    /// server (fds per message).
    client: Capabilities,
    /// What the server answered: the session's limits (DMA maps).
    caps: Capabilities,
    dma: Vec<DmaEntry>,
    /// What the client's mapped memory is registered under with the SIGBUS
    /// handler: poisoned once the client shrank some of it.
    owner: Arc<Owner>,
    /// A DMA_MAP without an fd was logged (once per client).
    remote_logged: bool,
    /// INTx trigger and unmask (resample) eventfds, as SET_IRQS gave them.
    intx: (Option<EventFd>, Option<EventFd>),
    /// The ioregionfd region of each BAR the client asked for (one thread
    /// each); dropped, they are shut down and their threads joined.
    regions: BTreeMap<u8, Region>,
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
    /// Handles the client's commands in order until it leaves, the stream
    /// breaks, or the client shrinks memory it mapped (the SIGBUS handler
    /// then also ends the wait for its next message: see `crate::sigbus`).
    fn run(&mut self) -> Result<()> {
        let r = self.serve();
        match self.shrunk() {
            Some(e) => Err(e),
            None => r,
        }
    }

    /// The error that ends a session whose client shrank mapped memory.
    fn shrunk(&self) -> Option<Error> {
        if !self.owner.poisoned() {
            return None;
        }
        let mapped: Vec<&crate::function::MappedRegion> = self.dma.iter().filter_map(|d| d.region.as_ref()).collect();
        Some(crate::function::shrunk(&mapped).unwrap_or_else(|| {
            Error::protocol("the client shrank memory it had mapped (since unmapped) under the device; session ended")
        }))
    }

    fn serve(&mut self) -> Result<()> {
        while let Some(m) = self.next()? {
            if self.owner.poisoned() {
                return Ok(()); // `run` says why
            }
            let reply = self.handle(&m).unwrap_or_else(|e| {
                log::warn!("vfio-user {}: command {} (message {}): {e}", self.peer, m.hdr.cmd, m.hdr.msg_id);
                Reply::Error(libc::EINVAL)
            });
            if m.hdr.no_reply() {
                continue;
            }
            let sent = match reply {
                Reply::Data(p, fds) => {
                    let raw: Vec<RawFd> = fds.iter().map(|f| f.as_raw_fd()).collect();
                    self.link.send(&wire::reply(&m.hdr, &p), &raw)
                }
                Reply::Error(errno) => self.link.send(&error_reply(&m.hdr, errno), &[]),
            };
            sent.map_err(|e| self.or_dead(e))?;
        }
        Ok(())
    }

    /// The reason the session ends: the link's, if a DMA request went
    /// unanswered (it shut the socket down), else `e`.
    fn or_dead(&self, e: Error) -> Error {
        self.link.dead().map_or(e, Error::protocol)
    }

    /// The next command: off the socket, or from the reader thread once one
    /// runs. None: the client left.
    fn next(&mut self) -> Result<Option<Received>> {
        if let Some((commands, _)) = &self.reader {
            return match commands.recv() {
                Ok(m) => m.map(Some).map_err(|e| self.or_dead(e)),
                Err(_) => self.link.dead().map_or(Ok(None), |why| Err(Error::protocol(why))),
            };
        }
        let Some(m) = recv(self.sock)? else { return Ok(None) };
        if m.hdr.is_reply() {
            // No DMA request was sent: no reader thread runs yet.
            return Err(Error::protocol(format!("message {} is a reply; the client sends commands", m.hdr.msg_id)));
        }
        Ok(Some(m))
    }

    /// Starts the reader thread (once), before the device may send a DMA
    /// request. This thread is between two messages: the reader takes the
    /// next one.
    fn start_reader(&mut self) -> Result<()> {
        if self.reader.is_some() {
            return Ok(());
        }
        let sock = self.sock.try_clone().map_err(|e| Error::io("dup of the session socket", e))?;
        let (tx, rx) = channel();
        let link = self.link.clone();
        let h = std::thread::Builder::new()
            .name("vfio-user-rx".into())
            .spawn(move || {
                iopath_devices::sandbox::enter(iopath_devices::sandbox::Role::Reader);
                link.read_loop(&sock, tx)
            })
            .map_err(|e| Error::io("vfio-user reader thread", e))?;
        self.reader = Some((rx, h));
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
            Some(Command::StateMemory) => self.state_memory(m),
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
        let mut caps = SERVER_CAPS.answer(&proposed).ok_or_else(|| {
            Error::protocol(format!("client page sizes {:#x}: none of 4 KiB or more", proposed.pgsizes))
        })?;
        // Each map with an fd holds that fd and a mapping: promise only what fits.
        caps.max_dma_maps = caps.max_dma_maps.min(dma_map_budget()).min(crate::sigbus::CAPACITY as u32);
        // State memory only to a client that proposed it (`state.rs`).
        caps.state_memory = self.state_answer(proposed.state_memory);
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
