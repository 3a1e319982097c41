//! What the proxy learns of a device at `connect`, in the order it asks:
//! VERSION, DEVICE_GET_INFO, the configuration header (REGION_READ of the
//! config region), GET_IRQ_INFO of MSI-X, GET_REGION_INFO of each BAR, then
//! the io fds of each BAR (`io_fds`).
//!
//! It owns the device's description (IDs, BARs, the areas it offers as
//! memory, where its capabilities start) and how deployed servers depart
//! from the spec at this stage: GET_REGION_IO_FDS only to servers at minor
//! version >= 1 ([`negotiate`]), a region info's short `argsz`
//! ([`region_info_argsz`]). It touches no guest state.

use super::channel::{bad_reply, Channel};
use super::io_fds::IoFdOffers;
use crate::vfio_user::wire::*;
use crate::vfio_user::{CONFIG_REGION_SIZE, MAX_FDS};
use crate::{Error, Result};
use iopath_devices::pci::MsixTable;
use iopath_devices::{BarKind, BarSpec, MappedArea, PciIds};
use std::fs::File;

/// The device as the server describes it, fixed for the session.
pub(super) struct Device {
    pub(super) ids: PciIds,
    pub(super) bars: Vec<BarSpec>,
    /// BAR parts the server offered as memory (sparse mmap).
    pub(super) areas: Vec<MappedArea>,
    /// Where the server's capabilities start (each one's ID and next
    /// pointer): read-only, and a write that touches them is refused whole
    /// by libvfio-user (EPERM), so they are never forwarded.
    pub(super) cap_headers: Vec<usize>,
}

/// All that `connect` learns.
pub(super) struct Discovered {
    pub(super) device: Device,
    /// The MSI-X table the configuration header places, if any.
    pub(super) msix: Option<MsixTable>,
    /// The io fds the server offered for its BARs.
    pub(super) io: IoFdOffers,
    /// The bytes of state memory VERSION agreed on, if any (`wire::state`).
    pub(super) state_len: Option<u64>,
}

/// Asks the server, in order, all that `connect` learns, offering state
/// memory (a reconnect: only a session with state memory on reconnects).
pub(super) fn discover(chan: &mut Channel) -> Result<Discovered> {
    discover_offering(chan, true)
}

/// [`discover`], offering state memory in VERSION only if `state`.
pub(super) fn discover_offering(chan: &mut Channel, state: bool) -> Result<Discovered> {
    let (ask_io_fds, state_len) = negotiate(chan, state)?;
    check_pci(chan)?;
    let cfg = chan.region_read(PCI_CONFIG_REGION_INDEX, 0, CONFIG_REGION_SIZE as u32)?;
    let (ids, cap_headers) = (pci_ids(&cfg), capability_offsets(&cfg));
    let msix = MsixTable::find(&cfg, irq_count(chan, PCI_MSIX_IRQ_INDEX)?);
    let (bars, areas) = regions(chan, &cfg)?;
    let mut io = IoFdOffers::default();
    for b in bars.iter().filter(|_| ask_io_fds) {
        io.ask(chan, *b)?;
    }
    Ok(Discovered { device: Device { ids, bars, areas, cap_headers }, msix, io, state_len })
}

/// VERSION: agrees on the version and sets the channel's DMA transfer
/// limit; true if the server may be asked GET_REGION_IO_FDS, and the
/// state memory the server's device keeps, if any. Every proposal offers
/// to hold state memory unless `state` is false (`--state-memory off`): a
/// server that does not know the key ignores it; one that does names
/// none in its reply to a proposal without it.
fn negotiate(chan: &mut Channel, state: bool) -> Result<(bool, Option<u64>)> {
    let state_memory = state.then_some(MAX_STATE_MEMORY);
    let caps = Capabilities { max_msg_fds: MAX_FDS, state_memory, ..Capabilities::default() };
    let v = Version { major: VERSION_MAJOR, minor: VERSION_MINOR, capabilities: Some(caps) };
    let r = chan.request(Command::Version, &v.to_bytes(), &[])?;
    let theirs = Version::parse(&r.payload).map_err(bad_reply("VERSION reply"))?;
    if theirs.major != VERSION_MAJOR || theirs.minor > VERSION_MINOR {
        return Err(Error::protocol(format!("server speaks version {}.{}", theirs.major, theirs.minor)));
    }
    // The server's DMA_READ/DMA_WRITE are bounded by what this side
    // proposed, not by the peer's own (up to 4 GiB) advertisement.
    chan.dma.max_xfer = theirs.caps().max_data_xfer_size.min(caps.max_data_xfer_size);
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
    // A reply that names state memory to a proposal without it is not
    // taken up: nothing was offered.
    let state = theirs.caps().state_memory.filter(|_| state);
    if let Some(n) = state.filter(|n| n % 8 != 0) {
        log::warn!("{}: the server asks for {n} bytes of state memory, not a multiple of 8: none", chan.peer.name);
        return Ok((theirs.minor >= 1, None));
    }
    Ok((theirs.minor >= 1, state))
}

/// DEVICE_GET_INFO: a PCI device, with a configuration region.
fn check_pci(chan: &mut Channel) -> Result<()> {
    let r = chan.request(Command::DeviceGetInfo, &DeviceInfo::request().to_bytes(), &[])?;
    let info = DeviceInfo::parse(&r.payload).map_err(bad_reply("DEVICE_GET_INFO reply"))?;
    if info.flags & DEVICE_FLAGS_PCI == 0 || info.num_regions <= PCI_CONFIG_REGION_INDEX {
        let (flags, n) = (info.flags, info.num_regions);
        return Err(Error::protocol(format!("not a PCI device (flags {flags:#x}, {n} regions)")));
    }
    Ok(())
}

/// The number of interrupts of IRQ index `index` (GET_IRQ_INFO); 0 if
/// the server refuses the question.
pub(super) fn irq_count(chan: &mut Channel, index: u32) -> Result<u32> {
    match chan.request(Command::DeviceGetIrqInfo, &IrqInfo::request(index).to_bytes(), &[]) {
        Ok(r) => Ok(IrqInfo::parse(&r.payload).map_err(bad_reply(format!("GET_IRQ_INFO {index}")))?.count),
        Err(e @ Error::Remote { .. }) => {
            log::info!("{}: no interrupts of index {index}: {e}", chan.peer.name);
            Ok(0)
        }
        Err(e) => Err(e),
    }
}

/// GET_REGION_INFO of BAR0..5: the BARs with a size (a 64-bit BAR takes
/// two slots, as the configuration header says) and the parts of each the
/// server offers as memory.
fn regions(chan: &mut Channel, cfg: &[u8]) -> Result<(Vec<BarSpec>, Vec<MappedArea>)> {
    let (mut bars, mut areas) = (Vec::new(), Vec::new());
    let mut i = 0u32;
    while i < 6 {
        let size = region_info(chan, i, &mut areas)?;
        let kind = bar_kind(cfg, i);
        if size > 0 {
            bars.push(BarSpec { index: i as u8, kind, size });
        }
        i += if kind == BarKind::Mem64 && size > 0 { 2 } else { 1 };
    }
    Ok((bars, areas))
}

/// GET_REGION_INFO of region `i`: its size; the areas of a sparse mmap,
/// within the region, go to `areas`.
fn region_info(chan: &mut Channel, i: u32, areas: &mut Vec<MappedArea>) -> Result<u64> {
    let q = RegionInfo::request(i, 32 + 16 + 16 * 16);
    let r = chan.request(Command::DeviceGetRegionInfo, &q.to_bytes(), &[])?;
    let reply =
        RegionInfoReply::parse(&region_info_argsz(r.payload.clone())).map_err(bad_reply(format!("REGION_INFO {i}")))?;
    let ri = reply.info;
    if let (Some(sparse), Some(fd)) = (&reply.sparse_mmap, r.fds.first()) {
        if ri.flags & REGION_INFO_FLAG_MMAP != 0 {
            mmap_areas(i as u8, &ri, sparse, fd, areas)?;
        }
    }
    Ok(ri.size)
}

/// The areas of a sparse mmap that lie within their region, each with its own copy of the fd.
fn mmap_areas(bar: u8, ri: &RegionInfo, sparse: &[SparseMmapArea], fd: &File, out: &mut Vec<MappedArea>) -> Result<()> {
    for a in sparse {
        let Some(fd_offset) = ri.offset.checked_add(a.offset) else { continue };
        if a.offset.checked_add(a.size).is_some_and(|e| e <= ri.size) {
            let fd = fd.try_clone().map_err(|e| Error::io("dup of a region fd", e))?;
            out.push(MappedArea { bar, offset: a.offset, size: a.size, fd, fd_offset });
        }
    }
    Ok(())
}

/// BAR `i`'s kind, from its register in the configuration header.
fn bar_kind(cfg: &[u8], i: u32) -> BarKind {
    let at = 0x10 + 4 * i as usize;
    let bar = u32::from_le_bytes([cfg[at], cfg[at + 1], cfg[at + 2], cfg[at + 3]]);
    if bar & 1 == 1 {
        BarKind::Io
    } else if (bar >> 1) & 3 == 2 {
        BarKind::Mem64
    } else {
        BarKind::Mem32
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A header with status "capabilities" and a chain 0x40 -> 0x50 -> `last_next`.
    fn header(last_next: u8) -> Vec<u8> {
        let mut cfg = vec![0u8; CONFIG_REGION_SIZE as usize];
        cfg[0x06] = 0x10;
        cfg[0x34] = 0x40;
        cfg[0x41] = 0x50;
        cfg[0x51] = last_next;
        cfg
    }

    #[test]
    fn capabilities_are_walked_from_the_pointer_and_a_loop_or_a_bad_pointer_ends_the_walk() {
        assert_eq!(capability_offsets(&header(0)), [0x40, 0x50]);
        assert_eq!(capability_offsets(&header(0x40)), [0x40, 0x50], "a loop back to the first");
        assert_eq!(capability_offsets(&header(0x3c)), [0x40, 0x50], "a pointer into the header");
        let mut no_list = header(0);
        no_list[0x06] = 0;
        assert!(capability_offsets(&no_list).is_empty(), "status says no capability list");
        // The low two bits of a pointer are reserved: 0x43 is 0x40.
        let mut low_bits = header(0);
        low_bits[0x34] = 0x43;
        assert_eq!(capability_offsets(&low_bits), [0x40, 0x50]);
    }

    #[test]
    fn bar_kinds_and_ids_come_from_the_configuration_header() {
        let mut cfg = header(0);
        cfg[0x10..0x14].copy_from_slice(&0xfe00_0004u32.to_le_bytes()); // 64-bit memory
        cfg[0x18..0x1c].copy_from_slice(&0xc001u32.to_le_bytes()); // I/O
        cfg[0x1c..0x20].copy_from_slice(&0xfd00_0000u32.to_le_bytes()); // 32-bit memory
        let kinds: Vec<_> = [0, 2, 3].iter().map(|&i| bar_kind(&cfg, i)).collect();
        assert_eq!(kinds, [BarKind::Mem64, BarKind::Io, BarKind::Mem32]);
        cfg[..4].copy_from_slice(&[0x36, 0x1b, 0x10, 0x00]);
        cfg[8..12].copy_from_slice(&[0x02, 0x02, 0x08, 0x01]);
        cfg[0x2c..0x30].copy_from_slice(&[0xf4, 0x1a, 0x01, 0x11]);
        cfg[0x3d] = 1;
        let ids = pci_ids(&cfg);
        let got = (ids.vendor, ids.device, ids.class, ids.revision, ids.subsystem_vendor, ids.subsystem);
        assert_eq!(got, (0x1b36, 0x0010, 0x010802, 0x02, 0x1af4, 0x1101));
        assert_eq!(ids.interrupt_pin, 1);
    }

    #[test]
    fn a_short_region_info_argsz_is_read_as_the_32_bytes_the_info_is() {
        let with = |argsz: u32| [argsz.to_le_bytes().to_vec(), vec![7; 28]].concat();
        assert_eq!(region_info_argsz(with(0))[..4], 32u32.to_le_bytes());
        assert_eq!(region_info_argsz(with(31))[..4], 32u32.to_le_bytes());
        assert_eq!(region_info_argsz(with(80)), with(80), "a full argsz is left alone");
        assert_eq!(region_info_argsz(vec![1, 2]), [1, 2], "too short to carry one: left to the parser");
    }
}
