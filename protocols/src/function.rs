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
//! A client's memory is mapped whatever its fd: memfds (sealed or not),
//! hugetlbfs files (memfds or not), tmpfs and regular files, as the
//! vfio-user spec expects of a map given with an fd (SPDK's client, with
//! DPDK's hugetlbfs files, reads its socket only for its own replies and
//! never serves DMA_READ/DMA_WRITE). vfio-user's DMA messages serve only
//! maps without an fd. vfio-user DMA_MAP, mpqemu SYNC_SYSMEM and vhost-user
//! SET_MEM_TABLE share this one policy ([`map_region`]).
//!
//! A file can shrink under its mapping (a truncation, a hole punched in a
//! hugetlbfs file whose pool is then drained) and the next access faults
//! with SIGBUS. Each mapping is registered with the process's SIGBUS
//! handler ([`crate::sigbus`]), which replaces a faulting client mapping
//! with zero pages, so the access completes, and marks its session: the
//! session ends with an error naming the client and the region, the device
//! is reset as for any client that leaves, and the process serves the next
//! client. A fault outside every client mapping still kills the process.
//! Kernel accesses to a truncated page (io_uring, pread/pwrite) fail with
//! EFAULT, an NVMe error status.
//!
//! A hugetlbfs fd is still mapped with a reservation ([`map_region`]): a
//! pool that cannot back it refuses the map rather than fault later.
//! iopath's own memfds (guest RAM in `vmm/src/memory.rs`, NVMe's BAR0 in
//! `devices/src/nvme/doorbells.rs`) are sealed against shrinking, so a
//! peer cannot shrink what it is given.

use crate::sigbus::{Guarded, Owner};
use crate::{Error, Result};
use iopath_devices::pci::ConfigSpace;
use iopath_devices::{
    BarKind, BarSpec, Counter, DeviceContext, GuestMem, GuestMemoryMmap, Keeper, PciIds, SharedDevice,
};
use std::fs::File;
use std::sync::Arc;
use vm_memory::{FileOffset, GuestAddress, GuestMemoryRegion, GuestRegionMmap};

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

/// Maps the regions a client passed as one guest memory, in any order
/// (clients map guest RAM in whatever order their memory listener sees
/// it), each registered for `owner` ([`map_region`]). Each fd must be at
/// least `offset + size` long (a shorter file would fault on access), and
/// regions may not overlap. No region at all is the empty memory.
pub fn map_guest_memory(regions: Vec<SharedRegion>, owner: &Arc<Owner>) -> Result<(GuestMem, Vec<MappedRegion>)> {
    let mapped = regions.into_iter().map(|r| map_region(r, owner)).collect::<Result<Vec<_>>>()?;
    let (mem, keep) = guest_memory(mapped.clone())?;
    Ok((GuestMem::from(mem).keeping(keep), mapped))
}

/// A region a client shares, as mapped here.
#[derive(Clone)]
pub struct MappedRegion {
    /// The client's range: a window into `guard`'s mapping (see [`map_region`]).
    pub region: Arc<GuestRegionMmap>,
    /// The mapping, registered with the SIGBUS handler; the device's memory
    /// keeps it as long as it or a clone lives.
    pub guard: Arc<Guarded>,
}

impl MappedRegion {
    /// The region's guest physical range, for log lines: `[start, end)`.
    pub fn range(&self) -> (u64, u64) {
        let start = self.region.start_addr().0;
        (start, start + self.region.len())
    }

    /// True once the client shrank the region's file under it (an access
    /// faulted and the mapping was replaced by zero pages).
    pub fn poisoned(&self) -> bool {
        self.guard.poisoned()
    }
}

/// What a session says when its client shrank memory it shared, naming the
/// regions that faulted; None if none did.
pub fn shrunk(regions: &[&MappedRegion]) -> Option<Error> {
    let bad: Vec<String> = regions
        .iter()
        .filter(|r| r.poisoned())
        .map(|r| {
            let (s, e) = r.range();
            format!("{s:#x}..{e:#x}")
        })
        .collect();
    (!bad.is_empty()).then(|| {
        Error::protocol(format!(
            "the client shrank the file of its guest RAM at {} under the device (SIGBUS): those pages now \
             read as zeros here; session ended",
            bad.join(", ")
        ))
    })
}

/// Maps one region a client shares, whatever its fd: `size` bytes of it from
/// `offset`, checked against the fd's length, registered for `owner` with the
/// SIGBUS handler ([`crate::sigbus`]; see the module doc).
///
/// A hugetlbfs fd maps only from offsets its page size divides. Clients
/// share guest RAM in sections (QEMU: below 640 KiB from offset 0, above
/// 1 MiB from offset 0x100000 of the same memfd), so where a section starts
/// or ends inside a huge page, the whole pages around it are mapped and
/// the region is the section's window into them (as libvfio-user and
/// vhost-user backends map such fds). The region alone is what the device
/// reaches. Every region is such a window, into a mapping of its own.
pub fn map_region(r: SharedRegion, owner: &Arc<Owner>) -> Result<MappedRegion> {
    let at = r.gpa;
    let end = r
        .offset
        .checked_add(r.size)
        .ok_or_else(|| Error::protocol(format!("memory region at {at:#x}: offset + size overflows")))?;
    let len = crate::nopath::fstat(&r.file).map_err(|e| Error::io("fstat of a memory fd", e))?.st_size as u64;
    if r.size == 0 || end > len {
        return Err(Error::protocol(format!(
            "memory region at {at:#x}: {:#x} bytes from offset {:#x} but the fd holds {len:#x}",
            r.size, r.offset
        )));
    }
    let too_large = || Error::protocol(format!("memory region at {at:#x}: too large"));
    let size = usize::try_from(r.size).map_err(|_| too_large())?;
    let mmap_err = |e: vm_memory::mmap::MmapRegionError| {
        Error::io(format!("mmap of guest memory at {at:#x}"), std::io::Error::other(e))
    };
    // Nonzero for a hugetlbfs fd; any other maps from any page-aligned offset (mapped as given).
    let huge = iopath_devices::hugepages::hugetlb_page_size(&r.file).unwrap_or(0);
    let page = huge.max(1);
    let (first, last) = (r.offset / page * page, end.div_ceil(page) * page);
    // Aligned, a file without huge pages, or pages past the file's end: mapped as given.
    let (moff, mlen) =
        if last > len { (r.offset, size) } else { (first, usize::try_from(last - first).map_err(|_| too_large())?) };
    // A hugetlbfs page the file lacks comes from the host's pool when it is
    // touched, and an empty pool faults with SIGBUS: such a mapping is made
    // with a reservation (no MAP_NORESERVE), so a pool that cannot back the
    // range refuses the map now (a client that reserved its own mapping, as
    // QEMU does by default, already holds the pages).
    let flags = if huge > 0 { libc::MAP_SHARED } else { libc::MAP_SHARED | libc::MAP_NORESERVE };
    let dup = r.file.try_clone().map_err(|e| Error::io("dup of a memory fd", e))?;
    let outer = vm_memory::mmap::MmapRegionBuilder::<()>::new(mlen)
        .with_file_offset(FileOffset::new(dup, moff))
        .with_mmap_prot(libc::PROT_READ | libc::PROT_WRITE)
        .with_mmap_flags(flags)
        .with_hugetlbfs(huge > 0)
        .build()
        .map_err(mmap_err)?;
    let guard = Guarded::new(outer, if huge > 0 { huge as usize } else { 4096 }, owner)?;
    // SAFETY: `size` bytes from `r.offset - moff` into the guarded mapping
    // lie inside it (`moff <= r.offset`, `end <= moff + mlen`); the memory
    // made of this region keeps `guard` (its keeper) as long as it or a
    // clone lives.
    let inner = unsafe {
        vm_memory::mmap::MmapRegionBuilder::new(size)
            .with_raw_mmap_pointer(guard.as_ptr().add((r.offset - moff) as usize))
            .with_file_offset(FileOffset::new(r.file, r.offset))
            .with_mmap_prot(libc::PROT_READ | libc::PROT_WRITE)
            .with_mmap_flags(libc::MAP_SHARED)
            .with_hugetlbfs(huge > 0)
            .build()
    }
    .map_err(mmap_err)?;
    let region = GuestRegionMmap::new(inner, GuestAddress(at))
        .ok_or_else(|| Error::protocol(format!("memory region at {at:#x}: overflows")))?;
    Ok(MappedRegion { region: Arc::new(region), guard })
}

/// One guest memory of already mapped regions, sorted here by address, and
/// the mappings they are windows into; overlapping regions are refused,
/// and none at all is the empty memory.
pub fn guest_memory(mut regions: Vec<MappedRegion>) -> Result<(GuestMemoryMmap, Vec<Keeper>)> {
    if regions.is_empty() {
        return Ok((no_memory(), Vec::new()));
    }
    regions.sort_by_key(|r| r.region.start_addr());
    let keep = regions.iter().map(|r| r.guard.clone() as Keeper).collect();
    let arcs = regions.into_iter().map(|r| r.region).collect();
    let mem = GuestMemoryMmap::from_arc_regions(arcs).map_err(|e| Error::protocol(format!("guest memory map: {e}")))?;
    Ok((mem, keep))
}

/// What a proxy tells its VMM of a remote function, learnt with configuration accesses only,
/// as firmware does: the IDs of its header, and each BAR sized (all ones written, read back,
/// the original written back). `cfg(offset, None)` reads the 4 bytes at `offset`,
/// `cfg(offset, Some(v))` writes them. A vendor id of 0xffff is no device. The interrupt pin
/// is left 0: the VMM routes INTx of every slot (`vmm::pci`).
pub fn probe(mut cfg: impl FnMut(u32, Option<u32>) -> Result<u32>) -> Result<(PciIds, Vec<BarSpec>)> {
    let id = cfg(0, None)?;
    if id as u16 == 0xffff {
        return Err(Error::protocol(format!("the remote device answers vendor id {:#x}: no device", id as u16)));
    }
    let (class, sub) = (cfg(8, None)?, cfg(0x2c, None)?);
    let ids = PciIds {
        vendor: id as u16,
        device: (id >> 16) as u16,
        class: class >> 8,
        revision: class as u8,
        subsystem_vendor: sub as u16,
        subsystem: (sub >> 16) as u16,
        interrupt_pin: 0,
    };
    let mut size = |reg: u32| -> Result<u32> {
        let orig = cfg(reg, None)?;
        cfg(reg, Some(0xffff_ffff))?;
        let mask = cfg(reg, None)?;
        cfg(reg, Some(orig))?;
        Ok(mask)
    };
    let (mut bars, mut i) = (Vec::new(), 0u8);
    while i < 6 {
        let reg = 0x10 + 4 * u32::from(i);
        let mask = size(reg)?;
        let spec = if mask == 0 {
            None
        } else if mask & 1 == 1 {
            Some(BarSpec { index: i, kind: BarKind::Io, size: u64::from((!(mask & !3)).wrapping_add(1) & 0xffff) })
        } else if (mask >> 1) & 3 == 2 && i < 5 {
            let m = u64::from(size(reg + 4)?) << 32 | u64::from(mask & !0xf);
            Some(BarSpec { index: i, kind: BarKind::Mem64, size: (!m).wrapping_add(1) })
        } else {
            Some(BarSpec { index: i, kind: BarKind::Mem32, size: u64::from((!(mask & !0xf)).wrapping_add(1)) })
        };
        i += if spec.is_some_and(|b| b.kind == BarKind::Mem64) { 2 } else { 1 };
        bars.extend(spec);
    }
    Ok((ids, bars))
}

/// An empty guest memory (before a client shared any).
pub fn no_memory() -> GuestMemoryMmap {
    GuestMemoryMmap::from_regions(Vec::new()).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;
    use iopath_devices::testdev::PciTestDev;
    use iopath_devices::DeviceModelMut;
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

    /// BARs of every kind, with gaps: 64-bit at 0, I/O at 3, 32-bit at 4.
    struct Bars;

    impl DeviceModelMut for Bars {
        fn name(&self) -> String {
            "bars".into()
        }
        fn ids(&self) -> PciIds {
            PciIds {
                vendor: 0x1234,
                device: 0xbeef,
                class: 0x01_08_02,
                revision: 7,
                subsystem_vendor: 0x5678,
                subsystem: 0x9abc,
                interrupt_pin: 1,
            }
        }
        fn bars(&self) -> Vec<BarSpec> {
            vec![
                BarSpec { index: 0, kind: BarKind::Mem64, size: 1 << 33 },
                BarSpec { index: 3, kind: BarKind::Io, size: 0x40 },
                BarSpec { index: 4, kind: BarKind::Mem32, size: 0x2000 },
            ]
        }
        fn attach(&mut self, _: DeviceContext) {}
        fn bar_read(&mut self, _: u8, _: u64, data: &mut [u8]) {
            data.fill(0xff)
        }
        fn bar_write(&mut self, _: u8, _: u64, _: &[u8]) {}
        fn counters(&self) -> Vec<Counter> {
            Vec::new()
        }
    }

    #[test]
    fn probe_learns_the_ids_and_bars_of_a_function_and_leaves_its_bars_as_they_were() {
        let mut f = PciFunction::new(std::sync::Arc::new(std::sync::Mutex::new(Bars))).unwrap();
        f.config_write(0x10, &0xe000_000cu32.to_le_bytes());
        f.config_write(0x1c, &0xc001u32.to_le_bytes());
        let header = |f: &mut PciFunction| {
            let mut b = [0u8; 64];
            f.config_read(0, &mut b[..4]);
            (0x10..0x28).for_each(|o| f.config_read(o, &mut b[o..o + 1]));
            b
        };
        let before = header(&mut f);
        let mut accesses = 0;
        let (ids, bars) = probe(|off, w| {
            accesses += 1;
            let mut b = [0u8; 4];
            match w {
                Some(v) => f.config_write(off as usize, &v.to_le_bytes()),
                None => f.config_read(off as usize, &mut b),
            }
            Ok(u32::from_le_bytes(b))
        })
        .unwrap();
        assert_eq!(ids, PciIds { interrupt_pin: 0, ..Bars.ids() });
        assert_eq!(bars, Bars.bars());
        assert_eq!(header(&mut f), before, "a BAR was left sized");
        assert_eq!(accesses, 3 + 4 * 6, "ids, then 4 accesses per BAR register");
        let absent = probe(|_, _| Ok(u32::MAX)).unwrap_err();
        assert!(absent.to_string().contains("no device"), "{absent}");
        let broken = probe(|off, _| if off < 0x10 { Ok(0x1234) } else { Err(Error::protocol("gone")) });
        assert_eq!(broken.unwrap_err().to_string(), "gone");
    }

    #[test]
    fn shared_memory_is_checked_against_the_fd_length() {
        let mut file = tempfile();
        file.write_all(&[0u8; 8192]).unwrap();
        let short = SharedRegion { gpa: 0, size: 16384, offset: 0, file: file.try_clone().unwrap() };
        assert!(map_guest_memory(vec![short], &owner()).err().unwrap().to_string().contains("fd holds"));
        let ok = SharedRegion { gpa: 0x10000, size: 4096, offset: 4096, file: file.try_clone().unwrap() };
        let (mem, _) = map_guest_memory(vec![ok], &owner()).unwrap();
        mem.mapped().write_obj(0xabcdu16, GuestAddress(0x10010)).unwrap();
        assert!(!mem.mapped().address_in_range(GuestAddress(0x11000)));
        let overflow = SharedRegion { gpa: 0, size: u64::MAX, offset: 4096, file };
        assert!(map_guest_memory(vec![overflow], &owner()).is_err());
    }

    #[test]
    fn regions_map_in_any_order_and_none_is_the_empty_memory() {
        let region = |gpa: u64| {
            let f = tempfile();
            f.set_len(4096).unwrap();
            SharedRegion { gpa, size: 4096, offset: 0, file: f }
        };
        let (mem, _) = map_guest_memory(vec![region(0x20000), region(0x10000)], &owner()).unwrap();
        mem.mapped().write_obj(1u8, GuestAddress(0x10000)).unwrap();
        mem.mapped().write_obj(2u8, GuestAddress(0x20fff)).unwrap();
        assert!(map_guest_memory(vec![region(0x10000), region(0x10800)], &owner()).is_err(), "overlap");
        let (empty, _) = map_guest_memory(Vec::new(), &owner()).unwrap();
        assert!(!empty.mapped().address_in_range(GuestAddress(0)));
    }

    /// Mappings of files whose path names `name` in /proc/self/maps.
    fn maps_of(name: &str) -> usize {
        std::fs::read_to_string("/proc/self/maps").unwrap().lines().filter(|l| l.contains(name)).count()
    }

    #[test]
    fn hugetlb_regions_at_offsets_inside_a_huge_page_map_as_windows_kept_while_the_memory_lives() {
        // As QEMU shares 4 MiB of guest RAM from a hugetlb memfd: below 640 KiB from offset 0,
        // above 1 MiB from offset 0x100000. Two 2 MiB pages of this machine's pool (vm.nr_hugepages).
        let name = format!("iopath-hugetlb-window-{}", std::process::id());
        let c = std::ffi::CString::new(name.clone()).unwrap();
        // SAFETY: memfd_create with a valid C string; the fd is owned by the File below.
        let fd = unsafe { libc::memfd_create(c.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_HUGETLB) };
        assert!(fd >= 0, "memfd_create(MFD_HUGETLB): {}", std::io::Error::last_os_error());
        // SAFETY: a fresh fd we own.
        let f = unsafe { <File as std::os::fd::FromRawFd>::from_raw_fd(fd) };
        f.set_len(4 << 20).unwrap();
        // SAFETY: fallocate on our fd: the pages now, or a clear failure (not a SIGBUS later).
        let got = unsafe { libc::fallocate(fd, 0, 0, 4 << 20) };
        assert_eq!(got, 0, "two free 2 MiB pages (vm.nr_hugepages): {}", std::io::Error::last_os_error());
        let low = SharedRegion { gpa: 0, size: 0xa0000, offset: 0, file: f.try_clone().unwrap() };
        let high = SharedRegion { gpa: 0x100000, size: 0x300000, offset: 0x100000, file: f.try_clone().unwrap() };
        let before = maps_of(&name);
        let (mem, regions) = map_guest_memory(vec![high, low], &owner()).unwrap();
        drop(regions);
        assert!(mem.in_huge_pages());
        mem.mapped().write_obj(0x5a5a_1234u32, GuestAddress(0x100040)).unwrap();
        mem.mapped().write_obj(0x77u8, GuestAddress(0x9ffff)).unwrap();
        // The hole between the sections is not the device's, though its pages are mapped.
        assert!(!mem.mapped().address_in_range(GuestAddress(0xa0000)));
        assert!(!mem.mapped().address_in_range(GuestAddress(0xfffff)));
        assert!(!mem.mapped().address_in_range(GuestAddress(0x400000)));
        // The windows are at the right offsets of the fd: pread sees what the device wrote.
        use std::os::unix::fs::FileExt;
        let mut b = [0u8; 4];
        f.read_exact_at(&mut b, 0x100040).unwrap();
        assert_eq!(u32::from_le_bytes(b), 0x5a5a_1234);
        let mut one = [0u8; 1];
        f.read_exact_at(&mut one, 0x9ffff).unwrap();
        assert_eq!(one[0], 0x77);
        // A clone keeps the mappings; the last one gone, they are unmapped.
        let clone = mem.clone();
        drop(mem);
        assert!(maps_of(&name) > before);
        assert_eq!(clone.mapped().read_obj::<u32>(GuestAddress(0x100040)).unwrap(), 0x5a5a_1234);
        drop(clone);
        assert_eq!(maps_of(&name), before, "the whole-page mappings outlived the memory");
        // More pages than this machine's pool has or may grow to, nobody allocated or reserved:
        // the map is refused now (no reservation to be had) rather than a SIGBUS at a later touch.
        let pages = hugetlb_pool_pages() + 1;
        f.set_len(pages * (2 << 20)).unwrap();
        let big = SharedRegion { gpa: 0, size: pages * (2 << 20), offset: 0, file: f.try_clone().unwrap() };
        let e = map_guest_memory(vec![big], &owner()).err().expect("hugetlb pages mapped without a pool to back them");
        assert!(e.to_string().contains("mmap of guest memory"), "{e}");
    }

    /// The most 2 MiB pages the pool can hold: its size and what it may
    /// grow to on demand (vm.nr_overcommit_hugepages).
    fn hugetlb_pool_pages() -> u64 {
        let read = |p: &str| std::fs::read_to_string(p).unwrap().trim().parse::<u64>().unwrap();
        read("/sys/kernel/mm/hugepages/hugepages-2048kB/nr_hugepages")
            + read("/sys/kernel/mm/hugepages/hugepages-2048kB/nr_overcommit_hugepages")
    }

    fn owner() -> Arc<Owner> {
        Owner::new(None::<&File>).unwrap()
    }

    fn tempfile() -> File {
        crate::testing::memfd("iopath-test")
    }
}
