//! A device model with its PCI configuration space, as a device process
//! hosts it: the server half of every out-of-process transport.
//!
//! The model is the same object the VMM hosts in process; here its header
//! lives next to it, BAR accesses arrive either as (BAR, offset) (vfio-user
//! regions, ioregionfd) or as absolute addresses decoded through the BARs the
//! client programmed (mpqemu), and guest memory is built from the fds the
//! client passes.
//!
//! # Shared memory that may shrink (SIGBUS policy)
//!
//! A mapping of a file that is truncated under it faults with SIGBUS on the
//! next access, which would kill the process. So:
//! - every memfd iopath creates is sealed against shrinking (F_SEAL_SHRINK,
//!   and F_SEAL_GROW where its size is final; created with
//!   MFD_ALLOW_SEALING): guest RAM (`vmm/src/memory.rs`) and NVMe's BAR0
//!   (`devices/src/nvme/doorbells.rs`), whose doorbell page clients map;
//! - a device process maps a client's fd only if it cannot shrink under us:
//!   its seals (F_GET_SEALS) include F_SEAL_SHRINK ([`cannot_shrink`]). No
//!   other kind of fd is trusted (a regular file or a memfd without the seal
//!   can be truncated by whoever else holds it). Otherwise vfio-user treats
//!   the map as one without an fd (reached with DMA_READ/DMA_WRITE through
//!   the session link), logging once per client why; mpqemu, which has no
//!   such fallback, refuses the SYNC_SYSMEM and closes the channel with a log
//!   line naming the client, as for any bad message.

use crate::{Error, Result};
use iopath_devices::pci::ConfigSpace;
use iopath_devices::{BarKind, Counter, DeviceContext, GuestMemoryMmap, SharedDevice};
use std::fs::File;
use std::sync::Arc;
use vm_memory::{FileOffset, GuestAddress, GuestMemoryRegion, GuestRegionMmap, MmapRegion};

pub struct PciFunction {
    pub config: ConfigSpace,
    pub device: SharedDevice,
    /// Accesses that hit no BAR or a bad size (logged, answered with all-ones).
    pub stray_accesses: u64,
    /// Counters of the server that hosts the function (vfio-user's DMA requests).
    host_counters: Vec<CounterFn>,
}

/// Counters a host adds to the function's report.
pub type CounterFn = Box<dyn Fn() -> Vec<Counter> + Send>;

impl PciFunction {
    pub fn new(device: SharedDevice) -> Result<Self> {
        let mut config = ConfigSpace::new(device.ids(), &device.bars())?;
        config.add_capabilities(&device.capabilities())?;
        Ok(PciFunction { config, device, stray_accesses: 0, host_counters: Vec::new() })
    }

    pub fn attach(&mut self, ctx: DeviceContext) {
        self.device.attach(ctx)
    }

    /// Reads configuration space; offsets past 4 KiB or sizes over 4 read as all-ones.
    pub fn config_read(&mut self, offset: usize, data: &mut [u8]) {
        if data.len() > 4 || offset.checked_add(data.len()).is_none_or(|e| e > 4096) {
            data.fill(0xff);
            return;
        }
        if !self.device.config_read(offset, data) {
            self.config.read(offset, data);
        }
    }

    pub fn config_write(&mut self, offset: usize, data: &[u8]) {
        if data.len() > 4 || offset.checked_add(data.len()).is_none_or(|e| e > 4096) {
            return;
        }
        if offset + data.len() <= iopath_devices::pci::CONFIG_SIZE {
            self.config.write(offset, data);
        }
        self.device.config_write(offset, data);
    }

    /// The BAR and offset that an absolute guest address (or I/O port, with
    /// `io`) of an access of `len` bytes decodes to, as programmed.
    pub fn decode(&self, addr: u64, len: usize, io: bool) -> Option<(u8, u64)> {
        self.config.bar_specs().find_map(|b| {
            let p = self.config.bar_placement(b.index)?;
            let is_io = b.kind == BarKind::Io;
            let end = addr.checked_add(len as u64)?;
            (is_io == io && addr >= p.addr && end <= p.addr + b.size).then(|| (b.index, addr - p.addr))
        })
    }

    /// True if an access of `len` bytes at `offset` fits BAR `bar` and has a
    /// size a CPU can make; otherwise counts and logs it.
    fn checked(&mut self, what: &str, bar: u8, offset: u64, len: usize) -> bool {
        let size = self.config.bar_specs().find(|b| b.index == bar).map(|b| b.size);
        let fits = size.is_some_and(|s| offset.checked_add(len as u64).is_some_and(|e| e <= s));
        if fits && matches!(len, 1 | 2 | 4 | 8) {
            return true;
        }
        self.stray_accesses += 1;
        log::warn!("{}: {what} of {len} bytes at BAR{bar}+{offset:#x} refused", self.device.name());
        false
    }

    /// A read of BAR `bar` at `offset`; a bad one reads all-ones.
    pub fn bar_read(&mut self, bar: u8, offset: u64, data: &mut [u8]) {
        if self.checked("read", bar, offset, data.len()) {
            self.device.bar_read(bar, offset, data)
        } else {
            data.fill(0xff)
        }
    }

    /// A write of BAR `bar` at `offset`; a bad one is dropped.
    pub fn bar_write(&mut self, bar: u8, offset: u64, data: &[u8]) {
        if self.checked("write", bar, offset, data.len()) {
            self.device.bar_write(bar, offset, data)
        }
    }

    /// Adds the counters of whoever hosts the function to its report.
    pub fn add_counters(&mut self, f: CounterFn) {
        self.host_counters.push(f);
    }

    /// Quiesces the model and returns its counters, plus the host's own.
    pub fn counters(&mut self) -> Vec<Counter> {
        self.device.quiesce();
        let mut c = self.device.counters();
        c.push(Counter { name: "stray-accesses".into(), value: self.stray_accesses });
        c.extend(self.host_counters.iter().flat_map(|f| f()));
        c
    }
}

/// One piece of guest RAM a client shares: `size` bytes of `file` from
/// `offset`, at guest physical address `gpa`.
pub struct SharedRegion {
    pub gpa: u64,
    pub size: u64,
    pub offset: u64,
    pub file: File,
}

/// True if `file` cannot shrink under a mapping of it: its seals include
/// F_SEAL_SHRINK (a memfd sealed so). Files that cannot be sealed report no
/// seals, so this is false for them.
pub fn cannot_shrink(file: &File) -> bool {
    use std::os::fd::AsRawFd;
    // SAFETY: F_GET_SEALS on an fd we own; no memory is passed.
    let seals = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_GET_SEALS) };
    seals >= 0 && seals & libc::F_SEAL_SHRINK != 0
}

/// Maps the regions a client passed as one guest memory, in any order
/// (clients map guest RAM in whatever order their memory listener sees
/// it). Each fd must be at least `offset + size` long (a shorter file would
/// fault on access), and regions may not overlap. No region at all is the
/// empty memory.
pub fn map_guest_memory(regions: Vec<SharedRegion>) -> Result<GuestMemoryMmap> {
    let mapped = regions.into_iter().map(|r| map_region(r).map(Arc::new)).collect::<Result<Vec<_>>>()?;
    guest_memory(mapped)
}

/// Maps one region a client shares: `size` bytes of its fd from `offset`,
/// checked against the fd's length.
pub fn map_region(r: SharedRegion) -> Result<GuestRegionMmap> {
    let at = r.gpa;
    let end = r
        .offset
        .checked_add(r.size)
        .ok_or_else(|| Error::protocol(format!("memory region at {at:#x}: offset + size overflows")))?;
    let len = r.file.metadata().map_err(|e| Error::io("fstat of a memory fd", e))?.len();
    if r.size == 0 || end > len {
        return Err(Error::protocol(format!(
            "memory region at {at:#x}: {:#x} bytes from offset {:#x} but the fd holds {len:#x}",
            r.size, r.offset
        )));
    }
    let size = usize::try_from(r.size).map_err(|_| Error::protocol(format!("memory region at {at:#x}: too large")))?;
    let m = MmapRegion::from_file(FileOffset::new(r.file, r.offset), size)
        .map_err(|e| Error::io(format!("mmap of guest memory at {at:#x}"), std::io::Error::other(e)))?;
    GuestRegionMmap::new(m, GuestAddress(at))
        .ok_or_else(|| Error::protocol(format!("memory region at {at:#x}: overflows")))
}

/// One guest memory of already mapped regions, sorted here by address;
/// overlapping regions are refused, and none at all is the empty memory.
pub fn guest_memory(mut regions: Vec<Arc<GuestRegionMmap>>) -> Result<GuestMemoryMmap> {
    if regions.is_empty() {
        return Ok(no_memory());
    }
    regions.sort_by_key(|r| r.start_addr());
    GuestMemoryMmap::from_arc_regions(regions).map_err(|e| Error::protocol(format!("guest memory map: {e}")))
}

/// An empty guest memory (before a client shared any).
pub fn no_memory() -> GuestMemoryMmap {
    GuestMemoryMmap::from_regions(Vec::new()).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;
    use iopath_devices::testdev::PciTestDev;
    use std::io::Write;
    use vm_memory::{Bytes, GuestMemoryBackend};

    #[test]
    fn absolute_addresses_decode_only_through_enabled_bars() {
        let mut f = PciFunction::new(std::sync::Arc::new(std::sync::Mutex::new(PciTestDev::new()))).unwrap();
        f.config_write(0x10, &0xfe00_0000u32.to_le_bytes());
        f.config_write(0x14, &0xc000u32.to_le_bytes());
        assert_eq!(f.decode(0xfe00_0800, 1, false), None, "decode off");
        f.config_write(0x04, &3u16.to_le_bytes());
        assert_eq!(f.decode(0xfe00_0800, 1, false), Some((0, 0x800)));
        assert_eq!(f.decode(0xc083, 1, true), Some((1, 0x83)));
        assert_eq!(f.decode(0xc083, 1, false), None, "I/O port is not memory");
        assert_eq!(f.decode(0xfe00_0fff, 2, false), None, "straddles the BAR end");
        assert_eq!(f.decode(u64::MAX, 8, false), None);
        let mut b = [0u8; 3];
        f.bar_read(0, 0, &mut b);
        assert_eq!(b, [0xff; 3], "odd size refused");
        let mut b = [0u8; 4];
        f.bar_read(0, 4094, &mut b);
        assert_eq!(b, [0xff; 4], "past the BAR");
        assert_eq!(f.stray_accesses, 2);
        let mut id = [0u8; 4];
        f.config_read(0, &mut id);
        assert_eq!(u32::from_le_bytes(id), 0x0005_1b36);
        f.config_read(usize::MAX - 1, &mut id);
        assert_eq!(id, [0xff; 4]);
    }

    #[test]
    fn shared_memory_is_checked_against_the_fd_length() {
        let mut file = tempfile();
        file.write_all(&[0u8; 8192]).unwrap();
        let short = SharedRegion { gpa: 0, size: 16384, offset: 0, file: file.try_clone().unwrap() };
        assert!(map_guest_memory(vec![short]).unwrap_err().to_string().contains("fd holds"));
        let ok = SharedRegion { gpa: 0x10000, size: 4096, offset: 4096, file: file.try_clone().unwrap() };
        let mem = map_guest_memory(vec![ok]).unwrap();
        mem.write_obj(0xabcdu16, GuestAddress(0x10010)).unwrap();
        assert!(!mem.address_in_range(GuestAddress(0x11000)));
        let overflow = SharedRegion { gpa: 0, size: u64::MAX, offset: 4096, file };
        assert!(map_guest_memory(vec![overflow]).is_err());
    }

    #[test]
    fn regions_map_in_any_order_and_none_is_the_empty_memory() {
        let region = |gpa: u64| {
            let f = tempfile();
            f.set_len(4096).unwrap();
            SharedRegion { gpa, size: 4096, offset: 0, file: f }
        };
        let mem = map_guest_memory(vec![region(0x20000), region(0x10000)]).unwrap();
        mem.write_obj(1u8, GuestAddress(0x10000)).unwrap();
        mem.write_obj(2u8, GuestAddress(0x20fff)).unwrap();
        assert!(map_guest_memory(vec![region(0x10000), region(0x10800)]).is_err(), "overlap");
        let empty = map_guest_memory(Vec::new()).unwrap();
        assert!(!empty.address_in_range(GuestAddress(0)));
    }

    fn tempfile() -> File {
        crate::testing::memfd("iopath-test")
    }
}
