//! The VMM side of vfio-user: a device in another process as a
//! [`DeviceModel`](iopath_devices::DeviceModel) the VMM hosts.
//!
//! `connect` negotiates the version and reads the device's identity,
//! regions, MSI-X table location and io fds. At attach the proxy maps guest
//! RAM into the device process (DMA_MAP with the memfd), installs the
//! ioeventfds the server announced, and hands over the INTx eventfds if the
//! device has INTx. BAR accesses go on a region fd if one covers them, else
//! as REGION_READ/WRITE.
//!
//! MSI-X is the VMM's, as in QEMU and kernel VFIO: the proxy keeps the
//! table and the PBA (a [`MsixTable`]) and answers every access to them; none
//! reaches the device process, whose own table, if it has one, stays masked.
//! Each vector the guest unmasks is routed in the VMM, and its eventfd is
//! handed to the device process (SET_IRQS) the first time. A masked vector
//! is taken out of KVM by the host, so what the device signals waits in the
//! eventfd: the PBA shows it, and unmasking delivers it once.
//!
//! Deployed servers differ from the spec and from each other; what the
//! proxy does about it: GET_REGION_IO_FDS only to servers at minor >= 1
//! (see `connect`), both io fd entry layouts (`wire::io_fds`), optional
//! steps of the attach whose error replies are logged, configuration writes
//! forwarded without the bytes of a capability's ID and next pointer
//! (libvfio-user refuses a write that touches them: MSI-X Enable goes as
//! Message Control alone, 16 bits at cap + 2).
//!
//! An error reply is the answer to one request (a BAR read gives all-ones,
//! a write is dropped; both are counted); any other error ends the peer
//! (the run stops, accesses read all-ones).

use super::ioregionfd::{RegionClient, COMMANDS};
use super::wire::*;
use super::{recv_reply, send, Received, CONFIG_REGION_SIZE, MAX_FDS};
use crate::peer::Peer;
use crate::process::DeviceProcess;
use crate::{Error, Result};
use iopath_devices::irq::wait_readable;
use iopath_devices::pci::MsixTable;
use iopath_devices::{
    le_fill, le_value, BarKind, BarSpec, Counter, DeviceContext, DeviceModelMut, Interrupts, IoEventSpec, MappedArea,
    PciIds, SharedDevice,
};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend, GuestMemoryRegion};
use vmm_sys_util::eventfd::EventFd;

/// The proxy counter of requests sent (one per access that crossed as a message).
pub const REQUESTS: &str = "vfio-user.requests";

/// A device in another process over vfio-user (or its ioregionfd extension).
pub struct VfioUserProxy {
    pub(super) peer: Peer,
    next_id: u16,
    ids: PciIds,
    bars: Vec<BarSpec>,
    /// Ioeventfds the server announced: installed as KVM ioeventfds at attach.
    pub(super) ioevents: Vec<(IoEventSpec, EventFd)>,
    /// ioregionfd regions the server announced, by BAR.
    pub(super) regions: Vec<(u8, RegionClient)>,
    /// Guest RAM for the server's DMA requests: the `GuestMem`, which keeps
    /// what its regions may be windows into, not its mapping alone.
    pub(super) mem: Option<iopath_devices::GuestMem>,
    pub(super) requests: u64,
    dma_requests: u64,
    /// ioregionfd commands of regions already closed.
    region_commands: u64,
    max_xfer: u32,
    /// The device's MSI-X table and PBA, kept here and never forwarded
    /// (see [`msix_sync`](Self::msix_sync)).
    pub(super) msix: Option<MsixTable>,
    /// The table as at reset.
    msix_reset: Option<MsixTable>,
    /// Per MSI-X vector: a copy of the eventfd handed to the device process.
    msix_fds: Vec<Option<EventFd>>,
    /// Per MSI-X vector: routed in the host (its irqfd in KVM).
    msix_routed: Vec<bool>,
    /// Error replies to BAR accesses (each read as all-ones, or a dropped write).
    error_replies: u64,
    /// BAR parts the server offered as memory (sparse mmap).
    areas: Vec<MappedArea>,
    /// The server may be asked GET_REGION_IO_FDS (see `connect`).
    ask_io_fds: bool,
    /// Where the server's capabilities start (each one's ID and next
    /// pointer): read-only, and a write that touches them is refused whole
    /// by libvfio-user (EPERM), so they are never forwarded.
    cap_headers: Vec<usize>,
    irq: Option<Arc<dyn Interrupts>>,
}

fn pci_ids(cfg: &[u8]) -> PciIds {
    let u16_at = |o: usize| u16::from_le_bytes([cfg[o], cfg[o + 1]]);
    let class = u32::from_le_bytes([cfg[8], cfg[9], cfg[10], cfg[11]]);
    PciIds {
        vendor: u16_at(0),
        device: u16_at(2),
        class: class >> 8,
        revision: class as u8,
        subsystem_vendor: u16_at(0x2c),
        subsystem: u16_at(0x2e),
        interrupt_pin: cfg[0x3d],
    }
}

/// The offsets of the capabilities in a configuration header, walked from
/// the capability pointer (at most 48, each in 0x40..0x100; a loop ends it).
fn capability_offsets(cfg: &[u8]) -> Vec<usize> {
    let mut out = Vec::new();
    if cfg.get(0x06).is_none_or(|s| s & 0x10 == 0) {
        return out;
    }
    let mut p = cfg.get(0x34).map_or(0, |&b| (b & 0xfc) as usize);
    while p >= 0x40 && p + 1 < cfg.len() && out.len() < 48 && !out.contains(&p) {
        out.push(p);
        p = (cfg[p + 1] & 0xfc) as usize;
    }
    out
}

/// The runs of a configuration write at `offset` that touch no
/// capability's first two bytes: (offset, bytes) each. An aligned access
/// leaves one run at most (a capability starts a dword).
fn without_cap_headers<'a>(headers: &[usize], offset: usize, data: &'a [u8]) -> Vec<(usize, &'a [u8])> {
    let header = |i: &usize| headers.iter().any(|&h| (h..h + 2).contains(&(offset + i)));
    let mut runs = Vec::new();
    let mut i = 0;
    while i < data.len() {
        if header(&i) {
            i += 1;
            continue;
        }
        let end = (i..data.len()).find(header).unwrap_or(data.len());
        runs.push((offset + i, &data[i..end]));
        i = end;
    }
    runs
}

/// True if the eventfd held a signal, which is taken (its counter goes back
/// to 0). Never blocks, whatever the fd's flags.
fn take_signal(fd: &Option<EventFd>) -> bool {
    fd.as_ref().is_some_and(|fd| wait_readable(fd, Duration::ZERO) && fd.read().is_ok_and(|n| n > 0))
}

/// A GET_REGION_INFO reply whose `argsz` is smaller than the 32 bytes it
/// is, read as 32: the rust-vmm `vfio_user` Server (0.1.7) sends a region's
/// info as its backend filled it and sets `argsz` only when it adds
/// capabilities, so a backend that left it 0 sends 0 (the spec: the size of
/// the whole reply).
fn region_info_argsz(mut payload: Vec<u8>) -> Vec<u8> {
    if let Some(a) = payload.first_chunk_mut::<4>().filter(|a| u32::from_le_bytes(**a) < 32) {
        *a = 32u32.to_le_bytes();
    }
    payload
}

/// A reply payload that does not parse.
fn bad_reply(what: impl std::fmt::Display) -> impl FnOnce(WireError) -> Error {
    move |e| Error::protocol(format!("{what}: {e}"))
}

impl VfioUserProxy {
    /// Negotiates the version, reads the device's regions, identity and
    /// announced io fds.
    pub fn connect(sock: UnixStream, child: Option<DeviceProcess>) -> Result<Self> {
        let mut p = VfioUserProxy {
            peer: Peer::new(sock, "vfio-user", child),
            next_id: 0,
            ids: pci_ids(&[0; 64]),
            bars: Vec::new(),
            ioevents: Vec::new(),
            regions: Vec::new(),
            mem: None,
            requests: 0,
            dma_requests: 0,
            region_commands: 0,
            max_xfer: DEFAULT_MAX_DATA_XFER_SIZE,
            msix: None,
            msix_reset: None,
            msix_fds: Vec::new(),
            msix_routed: Vec::new(),
            error_replies: 0,
            areas: Vec::new(),
            ask_io_fds: false,
            cap_headers: Vec::new(),
            irq: None,
        };
        let caps = Capabilities { max_msg_fds: MAX_FDS, ..Capabilities::default() };
        let v = Version { major: VERSION_MAJOR, minor: VERSION_MINOR, capabilities: Some(caps) };
        let r = p.request(Command::Version, &v.to_bytes(), &[])?;
        let theirs = Version::parse(&r.payload).map_err(bad_reply("VERSION reply"))?;
        if theirs.major != VERSION_MAJOR || theirs.minor > VERSION_MINOR {
            return Err(Error::protocol(format!("server speaks version {}.{}", theirs.major, theirs.minor)));
        }
        // The server's DMA_READ/DMA_WRITE are bounded by what this side
        // proposed, not by the peer's own (up to 4 GiB) advertisement.
        p.max_xfer = theirs.caps().max_data_xfer_size.min(caps.max_data_xfer_size);
        // GET_REGION_IO_FDS is optional, and asking a server that does not
        // know it can cost the session: the rust-vmm `vfio_user` crate's
        // Server (0.1.7) answers an unknown or unsupported command (6, 14,
        // 15, 16...) with an error before it reads the payload, then reads
        // that payload as the next header and answers it too (a reply to
        // "command 0"), so every later reply is out of step. That server
        // answers VERSION with 0.0 whatever it is offered; libvfio-user
        // (SPDK, QEMU's x-vfio-user-server) answers min(offered, 2) and
        // iopath's own server likewise. So only a server that agreed to a
        // minor version >= 1 is asked for io fds.
        p.ask_io_fds = theirs.minor >= 1;
        let r = p.request(Command::DeviceGetInfo, &DeviceInfo::request().to_bytes(), &[])?;
        let info = DeviceInfo::parse(&r.payload).map_err(bad_reply("DEVICE_GET_INFO reply"))?;
        if info.flags & DEVICE_FLAGS_PCI == 0 || info.num_regions <= PCI_CONFIG_REGION_INDEX {
            let (flags, n) = (info.flags, info.num_regions);
            return Err(Error::protocol(format!("not a PCI device (flags {flags:#x}, {n} regions)")));
        }
        let cfg = p.region_read(PCI_CONFIG_REGION_INDEX, 0, CONFIG_REGION_SIZE as u32)?;
        p.ids = pci_ids(&cfg);
        p.cap_headers = capability_offsets(&cfg);
        let msix_count = p.irq_count(PCI_MSIX_IRQ_INDEX)?;
        p.msix = MsixTable::find(&cfg, msix_count);
        p.msix_reset = p.msix.clone();
        let n = p.msix.as_ref().map_or(0, |m| m.vectors());
        (p.msix_fds, p.msix_routed) = ((0..n).map(|_| None).collect(), vec![false; n]);
        let mut i = 0u32;
        while i < 6 {
            let q = RegionInfo::request(i, 32 + 16 + 16 * 16);
            let r = p.request(Command::DeviceGetRegionInfo, &q.to_bytes(), &[])?;
            let reply = RegionInfoReply::parse(&region_info_argsz(r.payload.clone()))
                .map_err(bad_reply(format!("REGION_INFO {i}")))?;
            let ri = reply.info;
            // A sparse mmap: parts of the BAR that are memory of the device process.
            if let (Some(areas), Some(fd)) = (&reply.sparse_mmap, r.fds.first()) {
                if ri.flags & REGION_INFO_FLAG_MMAP != 0 {
                    for a in areas {
                        let Some(fd_offset) = ri.offset.checked_add(a.offset) else { continue };
                        if a.offset.checked_add(a.size).is_some_and(|e| e <= ri.size) {
                            let fd = fd.try_clone().map_err(|e| Error::io("dup of a region fd", e))?;
                            p.areas.push(MappedArea { bar: i as u8, offset: a.offset, size: a.size, fd, fd_offset });
                        }
                    }
                }
            }
            let at = 0x10 + 4 * i as usize;
            let bar = u32::from_le_bytes([cfg[at], cfg[at + 1], cfg[at + 2], cfg[at + 3]]);
            let kind = if bar & 1 == 1 {
                BarKind::Io
            } else if (bar >> 1) & 3 == 2 {
                BarKind::Mem64
            } else {
                BarKind::Mem32
            };
            if ri.size > 0 {
                p.bars.push(BarSpec { index: i as u8, kind, size: ri.size });
            }
            i += if kind == BarKind::Mem64 && ri.size > 0 { 2 } else { 1 };
        }
        let ask = p.ask_io_fds;
        for b in p.bars.clone().into_iter().filter(|_| ask) {
            p.io_fds(b)?;
        }
        Ok(p)
    }

    /// [`connect`](Self::connect), named `name` in reports, as the VMM hosts it.
    pub fn shared(sock: UnixStream, child: Option<DeviceProcess>, name: &str) -> Result<SharedDevice> {
        let mut p = Self::connect(sock, child)?;
        p.set_name(name);
        Ok(Arc::new(Mutex::new(p)))
    }

    pub fn set_name(&mut self, name: &str) {
        self.peer.name = name.to_string();
    }

    /// Reads the io fds the server offers for BAR `b`.
    fn io_fds(&mut self, b: BarSpec) -> Result<()> {
        let mut argsz = 16 + 40 * 8;
        let (reply, fds) = loop {
            let q = IoFdsRequest { argsz, index: b.index as u32 };
            let r = match self.request(Command::DeviceGetRegionIoFds, &q.to_bytes(), &[]) {
                Ok(r) => r,
                Err(e @ Error::Remote { .. }) => {
                    log::info!("{}: no io fds for BAR{}: {e}", self.peer.name, b.index);
                    return Ok(());
                }
                Err(e) => return Err(e),
            };
            let reply = IoFdsReply::parse(&r.payload).map_err(bad_reply(format!("REGION_IO_FDS {}", b.index)))?;
            if reply.is_truncated() && reply.argsz > argsz && reply.argsz < 1 << 20 {
                argsz = reply.argsz;
                continue;
            }
            break (reply, r.fds);
        };
        // io fds are optional: a sub-region this client cannot take is
        // skipped with a log line, and its accesses go as messages.
        let (io, name) = (b.kind == BarKind::Io, self.peer.name.clone());
        let skip =
            |e: &IoFdEntry, why: &str| log::info!("{name}: BAR{}: skipping io fd sub-region {e:?}: {why}", b.index);
        for e in reply.entries {
            let fd = match fds.get(e.fd_index() as usize).map(|f| f.try_clone()) {
                Some(Ok(fd)) => fd,
                Some(Err(err)) => return Err(Error::io("dup of an io fd", err)),
                None => {
                    skip(&e, &format!("no fd {} among the {} sent", e.fd_index(), fds.len()));
                    continue;
                }
            };
            match e {
                IoFdEntry::IoEventFd { offset, size, flags, datamatch, .. } => {
                    if offset.checked_add(size.max(1)).is_none_or(|x| x > b.size)
                        || (flags & KVM_IOEVENTFD_FLAG_PIO != 0) != io
                        || !matches!(size, 0 | 1 | 2 | 4 | 8)
                    {
                        skip(&e, "outside the BAR, the wrong space or an access size KVM does not match");
                        continue;
                    }
                    let dm = (flags & KVM_IOEVENTFD_FLAG_DATAMATCH != 0).then_some(datamatch);
                    let spec = IoEventSpec { bar: b.index, offset, len: size as u32, datamatch: dm };
                    self.ioevents.push((spec, iopath_devices::irq::eventfd_from(fd)));
                }
                IoFdEntry::IoRegionFd { offset, size, flags, user_data, .. } => {
                    if offset.checked_add(size).is_none_or(|x| x > b.size) || (flags & KVM_IOREGION_PIO != 0) != io {
                        skip(&e, "outside the BAR or the wrong space");
                        continue;
                    }
                    let posted = flags & KVM_IOREGION_POSTED_WRITES != 0;
                    let s = UnixStream::from(std::os::fd::OwnedFd::from(fd));
                    self.regions.push((b.index, RegionClient::new(s, offset, size, user_data, posted)));
                }
                IoFdEntry::ShadowIoEventFd { .. } => {
                    skip(&e, "a shadow ioeventfd (libvfio-user's; it needs a patched KVM, which this one is not)")
                }
                IoFdEntry::Other { ty, flags, .. } => skip(&e, &format!("type {ty} with flags {flags:#x} is unknown")),
            }
        }
        Ok(())
    }

    /// Sends a command and waits for its reply, serving the server's
    /// DMA_READ/DMA_WRITE commands that arrive meanwhile. An error reply is
    /// [`Error::Remote`] and leaves the peer up; any other error ends it.
    fn request(&mut self, cmd: Command, payload: &[u8], fds: &[RawFd]) -> Result<Received> {
        self.peer.alive()?;
        self.requests += 1;
        self.next_id = self.next_id.wrapping_add(1);
        let id = self.next_id;
        let r = self.exchange(id, cmd, payload, fds);
        match &r {
            Ok(_) | Err(Error::Remote { .. }) => {}
            Err(e) => self.peer.die(e),
        }
        r
    }

    fn exchange(&mut self, id: u16, cmd: Command, payload: &[u8], fds: &[RawFd]) -> Result<Received> {
        send(&self.peer.sock, &message(id, cmd, FLAGS_TYPE_COMMAND, payload), fds)?;
        let mut served = 0;
        loop {
            let m = recv_reply(&self.peer.sock)?
                .ok_or_else(|| Error::PeerGone("the device process closed the vfio-user socket".into()))?;
            if !m.hdr.is_reply() {
                served += 1;
                if served > 4096 {
                    let e = format!("the server sent {served} commands while {cmd:?} waited for its reply");
                    return Err(Error::protocol(e));
                }
                let reply = self.serve_dma(&m);
                send(&self.peer.sock, &reply, &[])?;
                continue;
            }
            if m.hdr.msg_id != id || m.hdr.cmd != cmd as u16 {
                let (got, c) = (m.hdr.msg_id, m.hdr.cmd);
                return Err(Error::protocol(format!("reply {got} to command {c} while waiting for {id}")));
            }
            if m.hdr.is_error() {
                return Err(Error::Remote { command: format!("{cmd:?}"), errno: m.hdr.error_no });
            }
            return Ok(m);
        }
    }

    /// Answers a server's DMA_READ/DMA_WRITE from guest RAM, bounds-checked;
    /// more than the proxy's own transfer limit is E2BIG (no buffer made).
    pub(super) fn serve_dma(&mut self, m: &Received) -> Vec<u8> {
        self.dma_requests += 1;
        let Some(mem) = self.mem.as_ref().map(|m| m.mapped()) else { return error_reply(&m.hdr, libc::EFAULT) };
        let max = self.max_xfer as u64;
        match m.hdr.command() {
            Some(Command::DmaRead) => match DmaAccess::parse(&m.payload) {
                Ok(a) if a.count > max => error_reply(&m.hdr, libc::E2BIG),
                Ok(a) => {
                    let mut buf = vec![0u8; a.count as usize];
                    match mem.read_slice(&mut buf, GuestAddress(a.address)) {
                        Ok(()) => reply(&m.hdr, &DmaAccess::to_bytes_with_data(a.address, &buf)),
                        Err(_) => error_reply(&m.hdr, libc::EFAULT),
                    }
                }
                _ => error_reply(&m.hdr, libc::EINVAL),
            },
            Some(Command::DmaWrite) => match DmaAccess::parse_with_data(&m.payload) {
                Ok((a, _)) if a.count > max => error_reply(&m.hdr, libc::E2BIG),
                Ok((a, data)) => match mem.write_slice(data, GuestAddress(a.address)) {
                    Ok(()) => reply(&m.hdr, &DmaAccess { address: a.address, count: a.count }.to_bytes()),
                    Err(_) => error_reply(&m.hdr, libc::EFAULT),
                },
                _ => error_reply(&m.hdr, libc::EINVAL),
            },
            _ => error_reply(&m.hdr, libc::ENOTSUP),
        }
    }

    fn region_read(&mut self, region: u32, offset: u64, count: u32) -> Result<Vec<u8>> {
        let q = RegionAccess { offset, region, count };
        let r = self.request(Command::RegionRead, &q.to_bytes(), &[])?;
        let (a, data) = RegionAccess::parse_with_data(&r.payload).map_err(bad_reply("REGION_READ reply"))?;
        if a.count != count || data.len() != count as usize {
            return Err(Error::protocol(format!("REGION_READ of {count} bytes answered with {}", data.len())));
        }
        Ok(data.to_vec())
    }

    fn region_write(&mut self, region: u32, offset: u64, data: &[u8]) -> Result<()> {
        let q = RegionAccess::to_bytes_with_data(offset, region, data);
        self.request(Command::RegionWrite, &q, &[]).map(|_| ())
    }

    /// Brings vector `v` up to date in the host, as QEMU and kernel VFIO
    /// do with the table they emulate: unmasked (MSI-X on, function and
    /// vector unmasked), it is routed to its message and, the first time,
    /// its eventfd goes to the device process (SET_IRQS, MSI-X index,
    /// TRIGGER | DATA_EVENTFD); masked, the host takes it out of KVM, so
    /// what the device signals waits in the eventfd (the PBA shows it), and
    /// unmasking delivers a vector that waited, once.
    fn msix_sync(&mut self, v: usize) {
        let (Some(m), Some(irq)) = (&mut self.msix, self.irq.clone()) else { return };
        let routed = self.msix_routed.get(v).copied().unwrap_or(false);
        let Some(route) = m.route(v) else {
            if routed {
                irq.msix_route(v as u16, None);
                self.msix_routed[v] = false;
            }
            return;
        };
        // What the device signalled while the vector was out of KVM: in its
        // eventfd, or taken from there into the PBA by a read.
        let waited = !routed && (m.pending(v) || self.msix_fds.get(v).is_some_and(take_signal));
        irq.msix_route(v as u16, Some(route));
        self.msix_routed[v] = true;
        if self.msix_fds[v].is_none() {
            self.msix_give(&*irq, v);
        }
        let m = self.msix.as_mut().unwrap();
        if waited && !irq.signal_msix(v as u16) {
            m.set_pending(v, true);
        } else {
            m.set_pending(v, false);
        }
    }

    /// Hands vector `v`'s eventfd to the device process.
    fn msix_give(&mut self, irq: &dyn Interrupts, v: usize) {
        let Some(fd) = irq.msix_eventfd(v as u16) else { return };
        let flags = IRQ_SET_DATA_EVENTFD | IRQ_SET_ACTION_TRIGGER;
        let q = IrqSet { flags, index: PCI_MSIX_IRQ_INDEX, start: v as u32, count: 1, data: vec![] };
        match self.request(Command::DeviceSetIrqs, &q.to_bytes(), &[fd.as_raw_fd()]) {
            Ok(_) => self.msix_fds[v] = Some(fd),
            Err(e) => log::warn!("{}: MSI-X vector {v}: {e}", self.peer.name),
        }
    }

    /// Moves the signals of vectors that are out of KVM into the PBA.
    fn msix_collect_pending(&mut self) {
        let Some(m) = &mut self.msix else { return };
        for (v, fd) in self.msix_fds.iter().enumerate() {
            if !self.msix_routed[v] && take_signal(fd) {
                m.set_pending(v, true);
            }
        }
    }

    /// A BAR read of the MSI-X table or PBA, answered here; false if neither claims it.
    fn msix_read(&mut self, bar: u8, offset: u64, data: &mut [u8]) -> bool {
        if !self.msix.as_ref().is_some_and(|m| m.claims(bar, offset)) {
            return false;
        }
        self.msix_collect_pending();
        self.msix.as_ref().is_some_and(|m| m.read(bar, offset, data))
    }

    /// A BAR write of the MSI-X table (or PBA, read-only), taken here; false
    /// if neither claims it.
    fn msix_write(&mut self, bar: u8, offset: u64, data: &[u8]) -> bool {
        let Some(m) = &mut self.msix else { return false };
        if !m.claims(bar, offset) {
            return false;
        }
        if let Some(v) = m.write(bar, offset, data) {
            self.msix_sync(v);
        }
        true
    }

    /// Observes a configuration write to MSI-X Message Control.
    fn msix_control_write(&mut self, offset: usize, data: &[u8]) {
        let Some(m) = &mut self.msix else { return };
        if !m.config_write(offset, data) {
            return;
        }
        for v in 0..m.vectors() {
            self.msix_sync(v);
        }
    }

    /// Message Control's Enable and Function Mask as the VMM keeps them,
    /// over what the device process answered for a configuration read.
    fn msix_control_read(&self, offset: usize, data: &mut [u8]) {
        let Some(m) = &self.msix else { return };
        let Some(b) = (m.cap_offset() + 3).checked_sub(offset).and_then(|i| data.get_mut(i)) else { return };
        *b = (*b & 0x3f) | (m.enabled() as u8) << 7 | (m.function_masked() as u8) << 6;
    }

    /// A BAR access that failed: an error reply is the answer to that access
    /// (logged, counted; a read gives all-ones), anything else ends the peer.
    fn access_failed(&mut self, e: Error) {
        if !matches!(e, Error::Remote { .. }) {
            return self.peer.die(&e);
        }
        self.error_replies += 1;
        if self.error_replies.is_power_of_two() {
            log::warn!("{}: {e} ({} error replies to BAR accesses so far)", self.peer.name, self.error_replies);
        }
    }

    fn region_of(&mut self, bar: u8, offset: u64, len: usize) -> Option<&mut RegionClient> {
        self.regions.iter_mut().find(|(b, r)| *b == bar && r.covers(offset, len)).map(|(_, r)| r)
    }

    /// The number of interrupts of IRQ index `index` (GET_IRQ_INFO); 0 if
    /// the server refuses the question.
    fn irq_count(&mut self, index: u32) -> Result<u32> {
        match self.request(Command::DeviceGetIrqInfo, &IrqInfo::request(index).to_bytes(), &[]) {
            Ok(r) => Ok(IrqInfo::parse(&r.payload).map_err(bad_reply(format!("GET_IRQ_INFO {index}")))?.count),
            Err(e @ Error::Remote { .. }) => {
                log::info!("{}: no interrupts of index {index}: {e}", self.peer.name);
                Ok(0)
            }
            Err(e) => Err(e),
        }
    }

    /// A request whose error reply is logged, not fatal (an optional step
    /// of the attach); true if it succeeded.
    fn optional(&mut self, what: &str, cmd: Command, payload: &[u8], fds: &[RawFd]) -> Result<bool> {
        match self.request(cmd, payload, fds) {
            Ok(_) => Ok(true),
            Err(e @ Error::Remote { .. }) => {
                log::warn!("{}: {what}: {e}; going on without it", self.peer.name);
                Ok(false)
            }
            Err(e) => Err(e),
        }
    }

    /// What the attach does: guest RAM to the device process, the announced
    /// ioeventfds into KVM, the INTx eventfds to a device that has INTx. An
    /// error reply to any of these steps is logged and the attach goes on
    /// (a server may have no use for DMA, or take no resample fd); a broken
    /// channel ends it.
    fn setup(&mut self, ctx: &DeviceContext) -> Result<()> {
        for r in ctx.mem.mapped().iter() {
            let fo = r.file_offset().ok_or_else(|| Error::Config("guest RAM is not fd-backed".into()))?;
            let map = DmaMap {
                flags: DMA_MAP_FLAG_READ | DMA_MAP_FLAG_WRITE,
                offset: fo.start(),
                address: r.start_addr().0,
                size: r.len(),
            };
            let what = format!("DMA_MAP of guest RAM at {:#x}", map.address);
            self.optional(&what, Command::DmaMap, &map.to_bytes(), &[fo.file().as_raw_fd()])?;
        }
        for (spec, fd) in &self.ioevents {
            ctx.ioevents.register(*spec, fd).map_err(|e| Error::from(e).context(format!("installing {spec:?}")))?;
        }
        // INTx only if the device has it (GET_IRQ_INFO), as QEMU asks first.
        if let Some((t, r)) = ctx.irq.intx_eventfds() {
            if self.irq_count(PCI_INTX_IRQ_INDEX)? >= 1 {
                for (action, fd, what) in [
                    (IRQ_SET_ACTION_TRIGGER, &t, "SET_IRQS INTx trigger"),
                    (IRQ_SET_ACTION_UNMASK, &r, "SET_IRQS INTx resample (unmask)"),
                ] {
                    let flags = IRQ_SET_DATA_EVENTFD | action;
                    let q = IrqSet { flags, index: PCI_INTX_IRQ_INDEX, start: 0, count: 1, data: vec![] };
                    if !self.optional(what, Command::DeviceSetIrqs, &q.to_bytes(), &[fd.as_raw_fd()])? {
                        break;
                    }
                }
            }
        }
        Ok(())
    }
}

impl DeviceModelMut for VfioUserProxy {
    fn name(&self) -> String {
        self.peer.name.clone()
    }
    /// DMA_MAP passes guest RAM's fds.
    fn shares_guest_ram(&self) -> bool {
        true
    }
    fn ids(&self) -> PciIds {
        self.ids
    }
    fn bars(&self) -> Vec<BarSpec> {
        self.bars.clone()
    }

    fn attach(&mut self, ctx: DeviceContext) {
        self.peer.fail = Some(ctx.fail.clone());
        self.mem = Some(ctx.mem.clone());
        self.irq = Some(ctx.irq.clone());
        match self.setup(&ctx) {
            Ok(()) => self.peer.watch(),
            Err(e) => self.peer.die(&e),
        }
    }

    fn bar_read(&mut self, bar: u8, offset: u64, data: &mut [u8]) {
        if self.msix_read(bar, offset, data) {
            return;
        }
        let n = data.len();
        let v = match self.region_of(bar, offset, n) {
            Some(r) => r.read(offset, n),
            None => self.region_read(bar as u32, offset, n as u32).map(|d| le_value(&d)),
        };
        match v {
            Ok(v) => le_fill(data, v),
            Err(e) => {
                self.access_failed(e);
                data.fill(0xff);
            }
        }
    }

    fn bar_write(&mut self, bar: u8, offset: u64, data: &[u8]) {
        if self.msix_write(bar, offset, data) {
            return;
        }
        let r = match self.region_of(bar, offset, data.len()) {
            Some(r) => r.write(offset, data.len(), le_value(data)),
            None => self.region_write(bar as u32, offset, data),
        };
        if let Err(e) = r {
            self.access_failed(e);
        }
    }

    fn mapped_areas(&self) -> Vec<MappedArea> {
        self.areas
            .iter()
            .filter_map(|a| {
                let fd = a.fd.try_clone().ok()?;
                Some(MappedArea { bar: a.bar, offset: a.offset, size: a.size, fd, fd_offset: a.fd_offset })
            })
            .collect()
    }

    fn config_read(&mut self, offset: usize, data: &mut [u8]) -> bool {
        // The BARs and the expansion ROM BAR are the VMM's, as QEMU emulates
        // them: its header sizes and places them as it maps them, whatever
        // the server's configuration space does with a sizing write (writes
        // still go to the server). A configuration access stays within one
        // dword, so it is all BAR or none.
        if (0x10..0x28).contains(&offset) || (0x30..0x34).contains(&offset) {
            return false;
        }
        match self.region_read(PCI_CONFIG_REGION_INDEX, offset as u64, data.len() as u32) {
            Ok(d) => data.copy_from_slice(&d),
            Err(_) => data.fill(0xff),
        }
        self.msix_control_read(offset, data);
        true
    }

    fn config_write(&mut self, offset: usize, data: &[u8]) {
        self.msix_control_write(offset, data);
        // Without the bytes of a capability's ID and next pointer (a guest
        // that enables MSI-X with a dword write at the capability sends its
        // Message Control alone, 16 bits at cap + 2, as libvfio-user takes it).
        for (at, bytes) in without_cap_headers(&self.cap_headers.clone(), offset, data) {
            let _ = self.region_write(PCI_CONFIG_REGION_INDEX, at as u64, bytes);
        }
    }

    fn reset(&mut self) {
        let _ = self.request(Command::DeviceReset, &[], &[]);
        // MSI-X as at reset: every vector out of KVM, nothing pending, and
        // the eventfds handed over again when routed.
        if let Some(irq) = self.irq.clone() {
            for v in (0..self.msix_routed.len()).filter(|&v| self.msix_routed[v]) {
                irq.msix_route(v as u16, None);
            }
        }
        self.msix_fds.iter().for_each(|fd| _ = take_signal(fd));
        self.msix = self.msix_reset.clone();
        self.msix_fds.iter_mut().for_each(|fd| *fd = None);
        self.msix_routed.iter_mut().for_each(|r| *r = false);
    }

    fn quiesce(&mut self) {
        self.region_commands += self.regions.iter().map(|(_, r)| r.commands).sum::<u64>();
        self.regions.clear();
        self.peer.end();
    }

    fn counters(&self) -> Vec<Counter> {
        let mut c = self.peer.remote.clone();
        c.push(Counter { name: REQUESTS.into(), value: self.requests });
        c.push(Counter { name: "vfio-user.dma-requests".into(), value: self.dma_requests });
        c.push(Counter { name: "vfio-user.error-replies".into(), value: self.error_replies });
        let cmds: u64 = self.regions.iter().map(|(_, r)| r.commands).sum();
        c.push(Counter { name: COMMANDS.into(), value: self.region_commands + cmds });
        c
    }
}
