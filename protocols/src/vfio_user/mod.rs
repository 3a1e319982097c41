//! vfio-user (QEMU docs/interop/vfio-user.rst; libvfio-user): the device
//! side as [`serve`] and the VMM side as [`VfioUserProxy`].
//!
//! The server is a PCI device with 9 regions (BAR0..5, ROM, config, VGA)
//! and 5 IRQ indexes. Guest RAM comes as DMA_MAP with the memfd and is
//! mapped in the device process; without an fd, the client answers the
//! server's DMA_READ/DMA_WRITE from guest RAM. BAR accesses arrive as
//! REGION_READ/WRITE, as KVM ioeventfds the client installed from
//! GET_REGION_IO_FDS (type IOEVENTFD), or, with the ioregionfd transport, on
//! region fds the server announced (type IOREGIONFD). INTx and MSI-X
//! eventfds come with SET_IRQS; the client makes them KVM irqfds.
//! A client that disconnects leaves the device state in place: DMA maps,
//! IRQ fds and region fds are dropped, the device keeps its registers.

pub mod wire;

use crate::attach::Transport;
use crate::function::{map_guest_memory, no_memory, PciFunction, SharedRegion};
use crate::ioregionfd::{self, RegionClient};
use iopath_devices::irq::IrqLines;
use crate::peer::Peer;
use crate::process::DeviceProcess;
use crate::socket;
use iopath_devices::{
    le_fill, le_value, BarKind, BarSpec, Counter, DeviceContext, DeviceModelMut, IoEventSpec, IoEvents,
    NoIoEvents, PciIds,
};
use std::fs::File;
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::sync::{Arc, Mutex};
use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend, GuestMemoryRegion};
use vmm_sys_util::eventfd::EventFd;
use wire::*;

/// Config space as a vfio-user region (a conventional PCI header).
const CONFIG_REGION_SIZE: u64 = 256;
/// Most fds this side takes with one message.
const MAX_FDS: u32 = 16;

/// One message off the socket: header, payload and the fds that came with it.
struct Received {
    hdr: Header,
    payload: Vec<u8>,
    fds: Vec<File>,
}

/// Reads one whole message; `Ok(None)` is a clean end of stream.
fn recv(sock: &UnixStream) -> Result<Option<Received>, String> {
    let mut h = [0u8; HEADER_SIZE];
    let fds = match socket::recv_exact(sock, &mut h) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(format!("receiving a header: {e}")),
    };
    let hdr = Header::parse(&h);
    let len = hdr.payload_len().map_err(|e| format!("message {} (command {}): {e}", hdr.msg_id, hdr.cmd))?;
    let mut payload = vec![0u8; len];
    socket::recv_exact(sock, &mut payload)
        .map_err(|e| format!("message {} (command {}): payload of {len} bytes: {e}", hdr.msg_id, hdr.cmd))?;
    Ok(Some(Received { hdr, payload, fds }))
}

fn send(sock: &UnixStream, msg: &[u8], fds: &[RawFd]) -> Result<(), String> {
    socket::send(sock, &[msg], fds).map_err(|e| format!("sending: {e}"))
}


// ---------------------------------------------------------------- server --

/// Ioeventfds the device asked for, kept to announce with GET_REGION_IO_FDS.
#[derive(Default)]
struct Announced(Mutex<Vec<(IoEventSpec, EventFd)>>);

impl IoEvents for Announced {
    fn register(&self, spec: IoEventSpec, fd: &EventFd) -> iopath_devices::Result<()> {
        let fd = fd.try_clone().map_err(|e| iopath_devices::Error::io("dup of an ioeventfd", e))?;
        self.0.lock().unwrap().push((spec, fd));
        Ok(())
    }
    fn unregister(&self, spec: IoEventSpec, _: &EventFd) -> iopath_devices::Result<()> {
        self.0.lock().unwrap().retain(|(s, _)| *s != spec);
        Ok(())
    }
    fn static_only(&self) -> bool {
        true
    }
}

/// What the device process keeps across clients.
pub struct ServerState {
    transport: Transport,
    announced: Arc<Announced>,
    irq: Arc<IrqLines>,
    ioevents: Arc<dyn IoEvents>,
}

impl ServerState {
    /// Attaches the device (no memory yet) with the host services the
    /// transport offers: announced ioeventfds for vfio-user, none for
    /// ioregionfd (its regions carry every access).
    pub fn new(f: &Arc<Mutex<PciFunction>>, transport: Transport, irq: Arc<IrqLines>) -> Self {
        let announced = Arc::new(Announced::default());
        let ioevents: Arc<dyn IoEvents> =
            if transport == Transport::VfioUser { announced.clone() } else { Arc::new(NoIoEvents) };
        let s = ServerState { transport, announced, irq, ioevents };
        f.lock().unwrap().attach(s.context(no_memory()));
        s
    }

    fn context(&self, mem: iopath_devices::GuestMemoryMmap) -> DeviceContext {
        let mut c = DeviceContext::detached(mem);
        c.ioevents = self.ioevents.clone();
        c.irq = self.irq.clone();
        c
    }
}

struct DmaEntry {
    map: DmaMap,
    file: Option<File>,
}

/// Per-client state.
struct Session {
    versioned: bool,
    dma: Vec<DmaEntry>,
    intx: (Option<EventFd>, Option<EventFd>),
    regions: Vec<std::thread::JoinHandle<()>>,
}

enum Reply {
    Data(Vec<u8>, Vec<RawFd>),
    Error(i32),
}

fn ok(payload: Vec<u8>) -> Reply {
    Reply::Data(payload, Vec::new())
}

/// Serves one client until it disconnects. `Err` is a broken stream (the
/// channel is closed); bad requests get error replies and the session goes on.
pub fn serve(
    sock: &UnixStream,
    f: &Arc<Mutex<PciFunction>>,
    irq: &Arc<IrqLines>,
    state: &mut ServerState,
) -> Result<(), String> {
    let mut s = Session { versioned: false, dma: Vec::new(), intx: (None, None), regions: Vec::new() };
    let r = (|| loop {
        let Some(m) = recv(sock)? else { return Ok(()) };
        if m.hdr.is_reply() {
            return Err(format!("message {} is a reply; the client sends commands", m.hdr.msg_id));
        }
        // Files that a reply hands out must live until it is sent.
        let mut keep: Vec<File> = Vec::new();
        let reply = handle(&m, f, irq, state, &mut s, &mut keep).unwrap_or_else(|e| {
            log::warn!("vfio-user: command {} (message {}): {e}", m.hdr.cmd, m.hdr.msg_id);
            Reply::Error(libc::EINVAL)
        });
        if m.hdr.no_reply() {
            continue;
        }
        match reply {
            Reply::Data(p, fds) => send(sock, &wire::reply(&m.hdr, &p), &fds)?,
            Reply::Error(errno) => send(sock, &error_reply(&m.hdr, errno), &[])?,
        }
        drop(keep);
    })();
    // Disconnect: drop DMA and IRQ fds; the device keeps its state.
    f.lock().unwrap().attach(state.context(no_memory()));
    drop(s);
    r
}

fn handle(
    m: &Received,
    f: &Arc<Mutex<PciFunction>>,
    irq: &Arc<IrqLines>,
    state: &mut ServerState,
    s: &mut Session,
    keep: &mut Vec<File>,
) -> Result<Reply, String> {
    let cmd = m.hdr.command();
    let p = &m.payload[..];
    let no_fds = || if m.fds.is_empty() { Ok(()) } else { Err(format!("{} unexpected fds", m.fds.len())) };
    if cmd != Some(Command::Version) && !s.versioned {
        return Err("VERSION must come first".into());
    }
    Ok(match cmd {
        Some(Command::Version) => {
            no_fds()?;
            let v = Version::parse(p).map_err(|e| e.to_string())?;
            if v.major != VERSION_MAJOR {
                return Err(format!("client speaks major version {}", v.major));
            }
            s.versioned = true;
            let caps = Capabilities { max_msg_fds: MAX_FDS, ..Capabilities::default() };
            let mine = Version { major: VERSION_MAJOR, minor: v.minor.min(VERSION_MINOR), capabilities: Some(caps) };
            ok(mine.to_bytes())
        }
        Some(Command::DmaMap) => {
            let map = DmaMap::parse(p).map_err(|e| e.to_string())?;
            if m.fds.len() > 1 {
                return Err(format!("DMA_MAP with {} fds", m.fds.len()));
            }
            let end = map.address.checked_add(map.size).filter(|_| map.size > 0).ok_or("empty or wrapping range")?;
            if s.dma.iter().any(|d| map.address < d.map.address + d.map.size && d.map.address < end) {
                return Ok(Reply::Error(libc::EEXIST));
            }
            s.dma.push(DmaEntry { map, file: m.fds.first().map(|f| f.try_clone()).transpose().map_err(|e| e.to_string())? });
            if let Err(e) = remap(f, state, s) {
                s.dma.pop();
                return Err(e);
            }
            ok(Vec::new())
        }
        Some(Command::DmaUnmap) => {
            no_fds()?;
            let u = DmaUnmap::parse(p).map_err(|e| e.to_string())?;
            if u.flags & DMA_UNMAP_FLAG_ALL != 0 {
                s.dma.clear();
            } else {
                let before = s.dma.len();
                s.dma.retain(|d| !(d.map.address == u.address && d.map.size == u.size));
                if s.dma.len() == before {
                    return Ok(Reply::Error(libc::ENOENT));
                }
            }
            remap(f, state, s)?;
            ok(u.to_bytes())
        }
        Some(Command::DeviceGetInfo) => {
            no_fds()?;
            DeviceInfo::parse(p).map_err(|e| e.to_string())?;
            let i = DeviceInfo {
                argsz: 16,
                flags: DEVICE_FLAGS_RESET | DEVICE_FLAGS_PCI,
                num_regions: PCI_NUM_REGIONS,
                num_irqs: PCI_NUM_IRQS,
            };
            ok(i.to_bytes())
        }
        Some(Command::DeviceGetRegionInfo) => {
            no_fds()?;
            let q = RegionInfo::parse(p).map_err(|e| e.to_string())?;
            let g = f.lock().unwrap();
            let size = region_size(&g, q.index).ok_or(format!("no region {}", q.index))?;
            let mut flags = if size > 0 { REGION_INFO_FLAG_READ | REGION_INFO_FLAG_WRITE } else { 0 };
            // Parts of this BAR the device shares as memory: a sparse mmap of one fd.
            let areas: Vec<_> = g.device.mapped_areas().into_iter().filter(|a| a.bar as u32 == q.index).collect();
            drop(g);
            let base = areas.first().map(|a| a.fd_offset.wrapping_sub(a.offset)).unwrap_or(0);
            let sparse: Vec<SparseMmapArea> = areas
                .iter()
                .filter(|a| a.fd_offset.wrapping_sub(a.offset) == base)
                .map(|a| SparseMmapArea { offset: a.offset, size: a.size })
                .collect();
            if sparse.is_empty() {
                return Ok(ok(RegionInfoReply::new(q.index, flags, size, 0, None).fit(q.argsz).to_bytes()));
            }
            flags |= REGION_INFO_FLAG_MMAP;
            let reply = RegionInfoReply::new(q.index, flags, size, base, Some(sparse)).fit(q.argsz);
            let fd = areas.into_iter().next().map(|a| a.fd).unwrap();
            let raw = fd.as_raw_fd();
            keep.push(fd);
            Reply::Data(reply.to_bytes(), vec![raw])
        }
        Some(Command::DeviceGetRegionIoFds) => {
            no_fds()?;
            let q = IoFdsRequest::parse(p).map_err(|e| e.to_string())?;
            let g = f.lock().unwrap();
            let spec = g.config.bar_specs().find(|b| b.index as u32 == q.index).ok_or(format!("no BAR {}", q.index))?;
            drop(g);
            let pio = if spec.kind == BarKind::Io { KVM_IOEVENTFD_FLAG_PIO } else { 0 };
            let (mut entries, mut fds) = (Vec::new(), Vec::new());
            match state.transport {
                Transport::VfioUser => {
                    for (e, fd) in state.announced.0.lock().unwrap().iter().filter(|(e, _)| e.bar == spec.index) {
                        let dm = if e.datamatch.is_some() { KVM_IOEVENTFD_FLAG_DATAMATCH } else { 0 };
                        entries.push(IoFdEntry::IoEventFd {
                            offset: e.offset,
                            size: e.len as u64,
                            fd_index: fds.len() as u32,
                            flags: dm | pio,
                            datamatch: e.datamatch.unwrap_or(0),
                        });
                        fds.push(fd.as_raw_fd());
                    }
                }
                Transport::IoRegionFd { posted } => {
                    let (mine, theirs) = UnixStream::pair().map_err(|e| format!("socketpair: {e}"))?;
                    let h = ioregionfd::spawn_server(mine, f.clone(), spec.index, 0, spec.size)
                        .map_err(|e| format!("ioregionfd thread: {e}"))?;
                    s.regions.push(h);
                    let flags = (if pio != 0 { KVM_IOREGION_PIO } else { 0 })
                        | (if posted { KVM_IOREGION_POSTED_WRITES } else { 0 });
                    entries.push(IoFdEntry::IoRegionFd {
                        offset: 0,
                        size: spec.size,
                        fd_index: 0,
                        flags,
                        user_data: spec.index as u64,
                    });
                    fds.push(theirs.as_raw_fd());
                    keep.push(File::from(std::os::fd::OwnedFd::from(theirs)));
                }
                Transport::Mpqemu => {}
            }
            let r = IoFdsReply::new(q.index, entries).fit(q.argsz);
            if r.is_truncated() {
                fds.clear();
            }
            Reply::Data(r.to_bytes(), fds)
        }
        Some(Command::DeviceGetIrqInfo) => {
            no_fds()?;
            let q = IrqInfo::parse(p).map_err(|e| e.to_string())?;
            let (flags, count) = match q.index {
                PCI_INTX_IRQ_INDEX => (IRQ_INFO_EVENTFD | IRQ_INFO_MASKABLE | IRQ_INFO_AUTOMASKED, 1),
                PCI_MSIX_IRQ_INDEX => (IRQ_INFO_EVENTFD | IRQ_INFO_NORESIZE, msix_vectors(&f.lock().unwrap())),
                PCI_MSI_IRQ_INDEX | PCI_ERR_IRQ_INDEX | PCI_REQ_IRQ_INDEX => {
                    (IRQ_INFO_EVENTFD | IRQ_INFO_NORESIZE, 0)
                }
                i => return Err(format!("no IRQ index {i}")),
            };
            ok(IrqInfo { argsz: 16, flags, index: q.index, count }.to_bytes())
        }
        Some(Command::DeviceSetIrqs) => {
            let q = IrqSet::parse(p).map_err(|e| e.to_string())?;
            let vectors = msix_vectors(&f.lock().unwrap());
            set_irqs(&q, m, irq, s, vectors)?;
            ok(Vec::new())
        }
        Some(Command::RegionRead) => {
            no_fds()?;
            let a = RegionAccess::parse(p).map_err(|e| e.to_string())?;
            let size = region_size(&f.lock().unwrap(), a.region).ok_or(format!("no region {}", a.region))?;
            if a.count as u64 > size {
                return Err(format!("REGION_READ of {} bytes from a region of {size}", a.count));
            }
            let mut data = vec![0u8; a.count as usize];
            region_access(&mut f.lock().unwrap(), a.region, a.offset, Access::Read(&mut data))?;
            ok(RegionAccess::to_bytes_with_data(a.offset, a.region, &data))
        }
        Some(Command::RegionWrite) => {
            no_fds()?;
            let (a, data) = RegionAccess::parse_with_data(p).map_err(|e| e.to_string())?;
            region_access(&mut f.lock().unwrap(), a.region, a.offset, Access::Write(data))?;
            ok(a.to_bytes())
        }
        Some(Command::RegionWriteMulti) => {
            no_fds()?;
            let w = RegionWriteMulti::parse(p).map_err(|e| e.to_string())?;
            let mut g = f.lock().unwrap();
            for x in &w.writes {
                region_access(&mut g, x.region, x.offset, Access::Write(x.bytes()))?;
            }
            ok(RegionWriteMultiReply { wr_cnt: w.writes.len() as u64 }.to_bytes())
        }
        Some(Command::DeviceReset) => {
            no_fds()?;
            expect_empty("device reset", p).map_err(|e| e.to_string())?;
            f.lock().unwrap().device.reset();
            ok(Vec::new())
        }
        Some(c) => {
            log::warn!("vfio-user: command {c:?} is not served here");
            Reply::Error(libc::ENOTSUP)
        }
        None => {
            log::warn!("vfio-user: unknown command {}", m.hdr.cmd);
            Reply::Error(libc::ENOSYS)
        }
    })
}

/// Rebuilds the device's memory from the fd-backed DMA maps.
fn remap(f: &Arc<Mutex<PciFunction>>, state: &ServerState, s: &Session) -> Result<(), String> {
    let mut regions = Vec::new();
    for d in &s.dma {
        if let Some(file) = &d.file {
            let file = file.try_clone().map_err(|e| e.to_string())?;
            regions.push(SharedRegion { gpa: d.map.address, size: d.map.size, offset: d.map.offset, file });
        }
    }
    let mem = map_guest_memory(regions)?;
    f.lock().unwrap().attach(state.context(mem));
    Ok(())
}

/// MSI-X vectors the device's capability declares (0 without one).
fn msix_vectors(f: &PciFunction) -> u32 {
    f.device
        .capabilities()
        .iter()
        .find(|c| c.id == iopath_devices::pci::PCI_CAP_ID_MSIX && c.body.len() >= 2)
        .map_or(0, |c| (u16::from_le_bytes([c.body[0], c.body[1]]) & 0x7ff) as u32 + 1)
}

fn set_irqs(q: &IrqSet, m: &Received, irq: &Arc<IrqLines>, s: &mut Session, msix: u32) -> Result<(), String> {
    let data_eventfd = q.flags & IRQ_SET_DATA_EVENTFD != 0;
    let nfds = m.fds.len();
    if (!data_eventfd && nfds > 0) || (data_eventfd && nfds != 0 && nfds != q.count as usize) {
        return Err(format!("SET_IRQS count {} with {nfds} fds", q.count));
    }
    let fds = || m.fds.iter().map(|f| f.try_clone().map(iopath_devices::irq::eventfd_from)).collect::<Result<Vec<_>, _>>();
    match q.index {
        PCI_INTX_IRQ_INDEX => {
            if q.start + q.count > 1 {
                return Err(format!("INTx has 1 vector, not {}..{}", q.start, q.start + q.count));
            }
            if q.flags & IRQ_SET_DATA_NONE != 0 && q.count == 0 {
                s.intx = (None, None);
                irq.clear_intx();
                return Ok(());
            }
            if !data_eventfd {
                // Mask, unmask (re-asserts a line still high) or trigger, by value.
                if q.flags & IRQ_SET_ACTION_MASK != 0 {
                    irq.mask_intx(true);
                } else if q.flags & IRQ_SET_ACTION_UNMASK != 0 {
                    irq.mask_intx(false);
                }
                return Ok(());
            }
            let fd = fds().map_err(|e| e.to_string())?.pop();
            if q.flags & IRQ_SET_ACTION_TRIGGER != 0 {
                s.intx.0 = fd;
            } else if q.flags & IRQ_SET_ACTION_UNMASK != 0 {
                s.intx.1 = fd;
            }
            match (&s.intx.0, &s.intx.1) {
                (Some(t), Some(u)) => irq.connect_intx(
                    t.try_clone().map_err(|e| e.to_string())?,
                    u.try_clone().map_err(|e| e.to_string())?,
                ),
                _ => irq.clear_intx(),
            }
            Ok(())
        }
        PCI_MSIX_IRQ_INDEX if q.count > 0 && data_eventfd && q.flags & IRQ_SET_ACTION_TRIGGER != 0 => {
            if q.start + q.count > msix {
                return Err(format!("MSI-X vectors {}..{} of {msix}", q.start, q.start + q.count));
            }
            // No fds de-assigns the range.
            let fds: Vec<Option<EventFd>> = if nfds == 0 {
                (0..q.count).map(|_| None).collect()
            } else {
                fds().map_err(|e| e.to_string())?.into_iter().map(Some).collect()
            };
            irq.set_msix(q.start as usize, fds);
            Ok(())
        }
        PCI_MSIX_IRQ_INDEX | PCI_MSI_IRQ_INDEX | PCI_ERR_IRQ_INDEX | PCI_REQ_IRQ_INDEX => {
            if q.count == 0 && q.flags & IRQ_SET_DATA_NONE != 0 {
                if q.index == PCI_MSIX_IRQ_INDEX {
                    irq.clear_msix();
                }
                return Ok(());
            }
            // This device offers no vectors on these indexes (GET_IRQ_INFO count 0).
            Err(format!("IRQ index {} has no vectors {}..{}", q.index, q.start, q.start + q.count))
        }
        i => Err(format!("no IRQ index {i}")),
    }
}

enum Access<'a> {
    Read(&'a mut [u8]),
    Write(&'a [u8]),
}

fn region_size(f: &PciFunction, index: u32) -> Option<u64> {
    match index {
        0..=5 => Some(f.config.bar_specs().find(|b| b.index as u32 == index).map_or(0, |b| b.size)),
        PCI_CONFIG_REGION_INDEX => Some(CONFIG_REGION_SIZE),
        PCI_ROM_REGION_INDEX | PCI_VGA_REGION_INDEX => Some(0),
        _ => None,
    }
}

/// A region access, checked against the region: BARs take 1/2/4/8-byte
/// accesses; config space any length, split into naturally aligned pieces.
fn region_access(f: &mut PciFunction, region: u32, offset: u64, a: Access) -> Result<(), String> {
    let size = region_size(f, region).ok_or(format!("no region {region}"))?;
    let len = match &a {
        Access::Read(d) => d.len(),
        Access::Write(d) => d.len(),
    };
    if offset.checked_add(len as u64).is_none_or(|e| e > size) || len == 0 {
        return Err(format!("{len} bytes at {offset:#x} outside region {region} ({size:#x} bytes)"));
    }
    if region == PCI_CONFIG_REGION_INDEX {
        let mut a = a;
        let mut pos = 0usize;
        while pos < len {
            let off = offset as usize + pos;
            let n = [4usize, 2, 1].into_iter().find(|n| off % n == 0 && pos + n <= len).unwrap_or(1);
            match &mut a {
                Access::Read(d) => f.config_read(off, &mut d[pos..pos + n]),
                Access::Write(d) => f.config_write(off, &d[pos..pos + n]),
            }
            pos += n;
        }
        return Ok(());
    }
    if !matches!(len, 1 | 2 | 4 | 8) {
        return Err(format!("BAR access of {len} bytes (1, 2, 4 or 8)"));
    }
    match a {
        Access::Read(d) => f.bar_read(region as u8, offset, d),
        Access::Write(d) => f.bar_write(region as u8, offset, d),
    }
    Ok(())
}

// ---------------------------------------------------------------- client --

/// The VMM side: a device in another process over vfio-user, hosted by the
/// VMM as a [`DeviceModel`].
pub struct VfioUserProxy {
    peer: Peer,
    next_id: u16,
    ids: PciIds,
    bars: Vec<BarSpec>,
    /// Ioeventfds the server announced: installed as KVM ioeventfds at attach.
    ioevents: Vec<(IoEventSpec, EventFd)>,
    /// ioregionfd regions the server announced, by BAR.
    regions: Vec<(u8, RegionClient)>,
    mem: Option<iopath_devices::GuestMemoryMmap>,
    requests: u64,
    dma_requests: u64,
    /// ioregionfd commands of regions already closed.
    region_commands: u64,
    max_xfer: u32,
    /// The device's MSI-X table as the guest programs it (the proxy turns it into routes).
    msix: Option<MsixShadow>,
    /// BAR parts the server offered as memory (sparse mmap).
    areas: Vec<iopath_devices::MappedArea>,
    irq: Option<Arc<dyn iopath_devices::Interrupts>>,
}

/// The client's copy of the device's MSI-X state: every write to the table
/// and to Message Control goes to the device too, but the routes (KVM irqfd
/// on an MSI route, whose eventfd is handed over with SET_IRQS) are made here.
struct MsixShadow {
    cap: usize,
    bar: u8,
    table: u64,
    entries: Vec<[u32; 4]>,
    enabled: bool,
    fmask: bool,
    given: Vec<bool>,
}

impl MsixShadow {
    /// Finds MSI-X in a configuration header; `max` bounds the vectors.
    fn find(cfg: &[u8], max: u32) -> Option<MsixShadow> {
        if cfg.len() < 256 || cfg[6] & 0x10 == 0 {
            return None;
        }
        let mut p = cfg[0x34] as usize & 0xfc;
        for _ in 0..48 {
            if p < 0x40 || p + 12 > cfg.len() {
                return None;
            }
            if cfg[p] == iopath_devices::pci::PCI_CAP_ID_MSIX {
                let n = ((u16::from_le_bytes([cfg[p + 2], cfg[p + 3]]) & 0x7ff) as u32 + 1).min(max) as usize;
                let t = u32::from_le_bytes(cfg[p + 4..p + 8].try_into().unwrap());
                return (n > 0 && (t & 7) < 6).then(|| MsixShadow {
                    cap: p,
                    bar: (t & 7) as u8,
                    table: (t & !7) as u64,
                    entries: vec![[0, 0, 0, 1]; n],
                    enabled: false,
                    fmask: false,
                    given: vec![false; n],
                });
            }
            p = cfg[p + 1] as usize & 0xfc;
        }
        None
    }

    fn route(&self, v: usize) -> Option<(u64, u32)> {
        let e = self.entries[v];
        (self.enabled && !self.fmask && e[3] & 1 == 0).then(|| (e[0] as u64 | (e[1] as u64) << 32, e[2]))
    }
}

fn pci_ids(cfg: &[u8]) -> PciIds {
    let u16_at = |o: usize| u16::from_le_bytes([cfg[o], cfg[o + 1]]);
    let class = u32::from_le_bytes(cfg[8..12].try_into().unwrap());
    PciIds {
        vendor: u16_at(0),
        device: u16_at(2),
        class: class >> 8,
        revision: class as u8,
        subsystem_vendor: u16_at(0x2c),
        subsystem: u16_at(0x2e),
    }
}

impl VfioUserProxy {
    /// Negotiates the version, reads the device's regions, identity and
    /// announced io fds.
    pub fn connect(sock: UnixStream, child: Option<DeviceProcess>) -> Result<Self, String> {
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
            areas: Vec::new(),
            irq: None,
        };
        let caps = Capabilities { max_msg_fds: MAX_FDS, ..Capabilities::default() };
        let v = Version { major: VERSION_MAJOR, minor: VERSION_MINOR, capabilities: Some(caps) };
        let r = p.request(Command::Version, &v.to_bytes(), &[])?;
        let theirs = Version::parse(&r.payload).map_err(|e| format!("VERSION reply: {e}"))?;
        if theirs.major != VERSION_MAJOR || theirs.minor > VERSION_MINOR {
            return Err(format!("server speaks version {}.{}", theirs.major, theirs.minor));
        }
        p.max_xfer = theirs.caps().max_data_xfer_size;
        let r = p.request(Command::DeviceGetInfo, &DeviceInfo::request().to_bytes(), &[])?;
        let info = DeviceInfo::parse(&r.payload).map_err(|e| format!("DEVICE_GET_INFO reply: {e}"))?;
        if info.flags & DEVICE_FLAGS_PCI == 0 || info.num_regions <= PCI_CONFIG_REGION_INDEX {
            return Err(format!("not a PCI device (flags {:#x}, {} regions)", info.flags, info.num_regions));
        }
        let cfg = p.region_read(PCI_CONFIG_REGION_INDEX, 0, CONFIG_REGION_SIZE as u32)?;
        p.ids = pci_ids(&cfg);
        let r = p.request(Command::DeviceGetIrqInfo, &IrqInfo::request(PCI_MSIX_IRQ_INDEX).to_bytes(), &[]);
        let msix_count = r.ok().and_then(|r| IrqInfo::parse(&r.payload).ok()).map_or(0, |i| i.count);
        p.msix = MsixShadow::find(&cfg, msix_count);
        let mut i = 0u32;
        while i < 6 {
            let q = RegionInfo::request(i, 32 + 16 + 16 * 16);
            let r = p.request(Command::DeviceGetRegionInfo, &q.to_bytes(), &[])?;
            let reply = RegionInfoReply::parse(&r.payload).map_err(|e| format!("REGION_INFO {i}: {e}"))?;
            let ri = reply.info;
            // A sparse mmap: parts of the BAR that are memory of the device process.
            if let (Some(areas), Some(fd)) = (&reply.sparse_mmap, r.fds.first()) {
                if ri.flags & REGION_INFO_FLAG_MMAP != 0 {
                    for a in areas {
                        let Some(fd_offset) = ri.offset.checked_add(a.offset) else { continue };
                        if a.offset.checked_add(a.size).is_some_and(|e| e <= ri.size) {
                            let fd = fd.try_clone().map_err(|e| e.to_string())?;
                            p.areas.push(iopath_devices::MappedArea { bar: i as u8, offset: a.offset, size: a.size, fd, fd_offset });
                        }
                    }
                }
            }
            let bar = u32::from_le_bytes(cfg[0x10 + 4 * i as usize..0x14 + 4 * i as usize].try_into().unwrap());
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
        for b in p.bars.clone() {
            p.io_fds(b)?;
        }
        Ok(p)
    }

    pub fn set_name(&mut self, name: &str) {
        self.peer.name = name.to_string();
    }

    /// Reads the io fds the server offers for BAR `b`.
    fn io_fds(&mut self, b: BarSpec) -> Result<(), String> {
        let mut argsz = 16 + 40 * 8;
        let (reply, fds) = loop {
            let q = IoFdsRequest { argsz, index: b.index as u32 };
            let r = match self.request(Command::DeviceGetRegionIoFds, &q.to_bytes(), &[]) {
                Ok(r) => r,
                Err(e) if self.peer.dead.is_none() => {
                    log::info!("{}: no io fds for BAR{}: {e}", self.peer.name, b.index);
                    return Ok(());
                }
                Err(e) => return Err(e),
            };
            let reply = IoFdsReply::parse(&r.payload).map_err(|e| format!("REGION_IO_FDS {}: {e}", b.index))?;
            if reply.is_truncated() && reply.argsz > argsz && reply.argsz < 1 << 20 {
                argsz = reply.argsz;
                continue;
            }
            break (reply, r.fds);
        };
        let io = b.kind == BarKind::Io;
        for e in reply.entries {
            let fd = fds.get(e.fd_index() as usize).ok_or(format!("BAR{}: fd index {} of {}", b.index, e.fd_index(), fds.len()))?;
            let fd = fd.try_clone().map_err(|e| e.to_string())?;
            match e {
                IoFdEntry::IoEventFd { offset, size, flags, datamatch, .. } => {
                    if offset.checked_add(size.max(1)).is_none_or(|x| x > b.size)
                        || (flags & KVM_IOEVENTFD_FLAG_PIO != 0) != io
                        || !matches!(size, 0 | 1 | 2 | 4 | 8)
                    {
                        return Err(format!("BAR{}: bad ioeventfd sub-region {e:?}", b.index));
                    }
                    let dm = (flags & KVM_IOEVENTFD_FLAG_DATAMATCH != 0).then_some(datamatch);
                    self.ioevents.push((IoEventSpec { bar: b.index, offset, len: size as u32, datamatch: dm }, iopath_devices::irq::eventfd_from(fd)));
                }
                IoFdEntry::IoRegionFd { offset, size, flags, user_data, .. } => {
                    if offset.checked_add(size).is_none_or(|x| x > b.size) || (flags & KVM_IOREGION_PIO != 0) != io {
                        return Err(format!("BAR{}: bad ioregionfd sub-region {e:?}", b.index));
                    }
                    let posted = flags & KVM_IOREGION_POSTED_WRITES != 0;
                    let s = UnixStream::from(std::os::fd::OwnedFd::from(fd));
                    self.regions.push((b.index, RegionClient::new(s, offset, size, user_data, posted)));
                }
            }
        }
        Ok(())
    }

    /// Sends a command and waits for its reply, serving the server's
    /// DMA_READ/DMA_WRITE commands that arrive meanwhile.
    fn request(&mut self, cmd: Command, payload: &[u8], fds: &[RawFd]) -> Result<Received, String> {
        if let Some(e) = &self.peer.dead {
            return Err(e.clone());
        }
        self.requests += 1;
        self.next_id = self.next_id.wrapping_add(1);
        let id = self.next_id;
        let r = self.exchange(id, cmd, payload, fds);
        if let Err(e) = &r {
            if !e.starts_with("error reply") {
                self.peer.die(e.clone());
            }
        }
        r
    }

    fn exchange(&mut self, id: u16, cmd: Command, payload: &[u8], fds: &[RawFd]) -> Result<Received, String> {
        send(&self.peer.sock, &message(id, cmd, FLAGS_TYPE_COMMAND, payload), fds)?;
        let mut served = 0;
        loop {
            let m = recv(&self.peer.sock)?.ok_or("the device process closed the vfio-user socket")?;
            if !m.hdr.is_reply() {
                served += 1;
                if served > 4096 {
                    return Err(format!("the server sent {served} commands while {cmd:?} waited for its reply"));
                }
                let reply = self.serve_dma(&m);
                send(&self.peer.sock, &reply, &[])?;
                continue;
            }
            if m.hdr.msg_id != id || m.hdr.cmd != cmd as u16 {
                return Err(format!("reply {} to command {} while waiting for {id}", m.hdr.msg_id, m.hdr.cmd));
            }
            if m.hdr.is_error() {
                return Err(format!("error reply to {cmd:?}: errno {}", m.hdr.error_no));
            }
            return Ok(m);
        }
    }

    /// Answers a server's DMA_READ/DMA_WRITE from guest RAM, bounds-checked.
    fn serve_dma(&mut self, m: &Received) -> Vec<u8> {
        self.dma_requests += 1;
        let Some(mem) = &self.mem else { return error_reply(&m.hdr, libc::EFAULT) };
        let max = self.max_xfer as u64;
        match m.hdr.command() {
            Some(Command::DmaRead) => match DmaAccess::parse(&m.payload) {
                Ok(a) if a.count <= max => {
                    let mut buf = vec![0u8; a.count as usize];
                    match mem.read_slice(&mut buf, GuestAddress(a.address)) {
                        Ok(()) => wire::reply(&m.hdr, &DmaAccess::to_bytes_with_data(a.address, &buf)),
                        Err(_) => error_reply(&m.hdr, libc::EFAULT),
                    }
                }
                _ => error_reply(&m.hdr, libc::EINVAL),
            },
            Some(Command::DmaWrite) => match DmaAccess::parse_with_data(&m.payload) {
                Ok((a, data)) if a.count <= max => match mem.write_slice(data, GuestAddress(a.address)) {
                    Ok(()) => wire::reply(&m.hdr, &DmaAccess { address: a.address, count: a.count }.to_bytes()),
                    Err(_) => error_reply(&m.hdr, libc::EFAULT),
                },
                _ => error_reply(&m.hdr, libc::EINVAL),
            },
            _ => error_reply(&m.hdr, libc::ENOTSUP),
        }
    }

    fn region_read(&mut self, region: u32, offset: u64, count: u32) -> Result<Vec<u8>, String> {
        let q = RegionAccess { offset, region, count };
        let r = self.request(Command::RegionRead, &q.to_bytes(), &[])?;
        let (a, data) = RegionAccess::parse_with_data(&r.payload).map_err(|e| format!("REGION_READ reply: {e}"))?;
        if a.count != count || data.len() != count as usize {
            return Err(format!("REGION_READ of {count} bytes answered with {}", data.len()));
        }
        Ok(data.to_vec())
    }

    fn region_write(&mut self, region: u32, offset: u64, data: &[u8]) -> Result<(), String> {
        let q = RegionAccess::to_bytes_with_data(offset, region, data);
        self.request(Command::RegionWrite, &q, &[]).map(|_| ())
    }

    /// Brings vector `v`'s route up to date and, the first time it is
    /// routed, hands its eventfd to the device process.
    fn msix_sync(&mut self, v: usize) {
        let (Some(m), Some(irq)) = (&self.msix, self.irq.clone()) else { return };
        let route = m.route(v);
        // Masking is the device's to enforce (it sees the same write and holds
        // the vector pending). Taking the route away here could drop a
        // message the device sent just before it saw the mask.
        if route.is_none() {
            return;
        }
        irq.msix_route(v as u16, route);
        if m.given[v] {
            return;
        }
        let Some(fd) = irq.msix_eventfd(v as u16) else { return };
        let q = IrqSet { flags: IRQ_SET_DATA_EVENTFD | IRQ_SET_ACTION_TRIGGER, index: PCI_MSIX_IRQ_INDEX, start: v as u32, count: 1, data: vec![] };
        match self.request(Command::DeviceSetIrqs, &q.to_bytes(), &[fd.as_raw_fd()]) {
            Ok(_) => self.msix.as_mut().unwrap().given[v] = true,
            Err(e) => log::warn!("{}: MSI-X vector {v}: {e}", self.peer.name),
        }
    }

    /// Observes a BAR write that lands in the MSI-X table (before it is forwarded).
    fn msix_table_write(&mut self, bar: u8, offset: u64, data: &[u8]) {
        let Some(m) = &mut self.msix else { return };
        let end = m.table + 16 * m.entries.len() as u64;
        if bar != m.bar || offset < m.table || offset >= end || !matches!(data.len(), 4 | 8) || offset % 4 != 0 {
            return;
        }
        let v = le_value(data);
        let first = ((offset - m.table) / 4) as usize;
        for k in 0..data.len() / 4 {
            let i = first + k;
            if i / 4 < m.entries.len() {
                m.entries[i / 4][i % 4] = (v >> (32 * k)) as u32;
            }
        }
        self.msix_sync(first / 4);
    }

    /// Observes a configuration write to MSI-X Message Control.
    fn msix_control_write(&mut self, offset: usize, data: &[u8]) {
        let Some(m) = &mut self.msix else { return };
        let hi = m.cap + 3;
        if offset > hi || hi >= offset + data.len() {
            return;
        }
        m.enabled = data[hi - offset] & 0x80 != 0;
        m.fmask = data[hi - offset] & 0x40 != 0;
        for v in 0..m.entries.len() {
            self.msix_sync(v);
        }
    }

    fn region_of(&mut self, bar: u8, offset: u64, len: usize) -> Option<&mut RegionClient> {
        self.regions.iter_mut().find(|(b, r)| *b == bar && r.covers(offset, len)).map(|(_, r)| r)
    }

    fn setup(&mut self, ctx: &DeviceContext) -> Result<(), String> {
        for r in ctx.mem.iter() {
            let fo = r.file_offset().ok_or("guest RAM is not fd-backed")?;
            let map = DmaMap {
                flags: DMA_MAP_FLAG_READ | DMA_MAP_FLAG_WRITE,
                offset: fo.start(),
                address: r.start_addr().0,
                size: r.len(),
            };
            self.request(Command::DmaMap, &map.to_bytes(), &[fo.file().as_raw_fd()])?;
        }
        for (spec, fd) in &self.ioevents {
            ctx.ioevents.register(*spec, fd).map_err(|e| format!("installing {spec:?}: {e}"))?;
        }
        if let Some((t, r)) = ctx.irq.intx_eventfds() {
            for (action, fd) in [(IRQ_SET_ACTION_TRIGGER, &t), (IRQ_SET_ACTION_UNMASK, &r)] {
                let q = IrqSet { flags: IRQ_SET_DATA_EVENTFD | action, index: PCI_INTX_IRQ_INDEX, start: 0, count: 1, data: vec![] };
                self.request(Command::DeviceSetIrqs, &q.to_bytes(), &[fd.as_raw_fd()])?;
            }
        }
        Ok(())
    }
}

impl DeviceModelMut for VfioUserProxy {
    fn name(&self) -> String {
        self.peer.name.clone()
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
            Err(e) => self.peer.die(e),
        }
    }

    fn bar_read(&mut self, bar: u8, offset: u64, data: &mut [u8]) {
        let n = data.len();
        let v = match self.region_of(bar, offset, n) {
            Some(r) => r.read(offset, n),
            None => self.region_read(bar as u32, offset, n as u32).map(|d| le_value(&d)),
        };
        match v {
            Ok(v) => le_fill(data, v),
            Err(e) => {
                self.peer.die(e);
                data.fill(0xff);
            }
        }
    }

    fn bar_write(&mut self, bar: u8, offset: u64, data: &[u8]) {
        // Routes first: the device may fire a vector as soon as it sees it unmasked.
        self.msix_table_write(bar, offset, data);
        let r = match self.region_of(bar, offset, data.len()) {
            Some(r) => r.write(offset, data.len(), le_value(data)),
            None => self.region_write(bar as u32, offset, data),
        };
        if let Err(e) = r {
            self.peer.die(e);
        }
    }

    fn mapped_areas(&self) -> Vec<iopath_devices::MappedArea> {
        self.areas
            .iter()
            .filter_map(|a| {
                let fd = a.fd.try_clone().ok()?;
                Some(iopath_devices::MappedArea { bar: a.bar, offset: a.offset, size: a.size, fd, fd_offset: a.fd_offset })
            })
            .collect()
    }

    fn config_read(&mut self, offset: usize, data: &mut [u8]) -> bool {
        match self.region_read(PCI_CONFIG_REGION_INDEX, offset as u64, data.len() as u32) {
            Ok(d) => data.copy_from_slice(&d),
            Err(_) => data.fill(0xff),
        }
        true
    }

    fn config_write(&mut self, offset: usize, data: &[u8]) {
        self.msix_control_write(offset, data);
        let _ = self.region_write(PCI_CONFIG_REGION_INDEX, offset as u64, data);
    }

    fn reset(&mut self) {
        let _ = self.request(Command::DeviceReset, &[], &[]);
    }

    fn quiesce(&mut self) {
        self.region_commands += self.regions.iter().map(|(_, r)| r.commands).sum::<u64>();
        self.regions.clear();
        self.peer.end();
    }

    fn counters(&self) -> Vec<Counter> {
        let mut c = self.peer.remote.clone();
        c.push(Counter { name: "vfio-user.requests".into(), value: self.requests });
        c.push(Counter { name: "vfio-user.dma-requests".into(), value: self.dma_requests });
        let cmds: u64 = self.regions.iter().map(|(_, r)| r.commands).sum();
        c.push(Counter { name: "ioregionfd.commands".into(), value: self.region_commands + cmds });
        c
    }
}

/// The server's side of the DMA fallback: reads guest memory through the
/// client when no fd was passed. Only valid while the client is waiting on
/// one of its own requests (or with nothing outstanding).
pub fn dma_read(sock: &UnixStream, msg_id: u16, address: u64, len: u64) -> Result<Vec<u8>, String> {
    let q = DmaAccess { address, count: len };
    send(sock, &message(msg_id, Command::DmaRead, FLAGS_TYPE_COMMAND, &q.to_bytes()), &[])?;
    let m = recv(sock)?.ok_or("client closed the socket")?;
    if m.hdr.is_error() {
        return Err(format!("DMA_READ of {len} bytes at {address:#x}: errno {}", m.hdr.error_no));
    }
    let (a, data) = DmaAccess::parse_with_data(&m.payload).map_err(|e| e.to_string())?;
    if a.count != len {
        return Err(format!("DMA_READ answered {} of {len} bytes", a.count));
    }
    Ok(data.to_vec())
}

/// Writes guest memory through the client (the DMA fallback).
pub fn dma_write(sock: &UnixStream, msg_id: u16, address: u64, data: &[u8]) -> Result<(), String> {
    let q = DmaAccess::to_bytes_with_data(address, data);
    send(sock, &message(msg_id, Command::DmaWrite, FLAGS_TYPE_COMMAND, &q), &[])?;
    let m = recv(sock)?.ok_or("client closed the socket")?;
    if m.hdr.is_error() {
        return Err(format!("DMA_WRITE of {} bytes at {address:#x}: errno {}", data.len(), m.hdr.error_no));
    }
    Ok(())
}

#[cfg(test)]
mod tests;
