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
//! - a hugetlbfs fd is mapped with a reservation ([`map_region`]): a pool
//!   that cannot back it refuses the map rather than fault later. What
//!   remains: a client that punches holes in its sealed hugetlbfs file
//!   after the map and drains the pool can still make a later access fault.

use crate::{Error, Result};
use iopath_devices::pci::ConfigSpace;
use iopath_devices::{BarKind, Counter, DeviceContext, GuestMem, GuestMemoryMmap, Keeper, SharedDevice};
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
pub fn map_guest_memory(regions: Vec<SharedRegion>) -> Result<GuestMem> {
    let mapped = regions.into_iter().map(map_region).collect::<Result<Vec<_>>>()?;
    let (mem, keep) = guest_memory(mapped)?;
    Ok(GuestMem::from(mem).keeping(keep))
}

/// A region a client shares, as mapped here.
#[derive(Clone)]
pub struct MappedRegion {
    pub region: Arc<GuestRegionMmap>,
    /// The mapping `region` is a window into, where it does not own its
    /// memory (see [`map_region`]); the device's memory keeps it.
    pub keeper: Option<Keeper>,
}

/// Maps one region a client shares: `size` bytes of its fd from `offset`,
/// checked against the fd's length.
///
/// A hugetlbfs fd maps only from offsets its page size divides. Clients
/// share guest RAM in sections (QEMU: below 640 KiB from offset 0, above
/// 1 MiB from offset 0x100000 of the same memfd), so where a section starts
/// or ends inside a huge page, the whole pages around it are mapped and
/// the region is the section's window into them (as libvfio-user and
/// vhost-user backends map such fds). The region alone is what the device
/// reaches.
pub fn map_region(r: SharedRegion) -> Result<MappedRegion> {
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
    let mmap_err = |e: vm_memory::mmap::MmapRegionError| {
        Error::io(format!("mmap of guest memory at {at:#x}"), std::io::Error::other(e))
    };
    // Nonzero for a hugetlbfs fd; any other maps from any page-aligned offset (mapped as given).
    let huge = iopath_devices::hugepages::hugetlb_page_size(&r.file).unwrap_or(0);
    // A hugetlbfs page the file lacks comes from the host's pool when it is
    // touched, and an empty pool faults with SIGBUS: such a mapping is made
    // with a reservation (no MAP_NORESERVE), so a pool that cannot back the
    // range refuses the map now (a client that reserved its own mapping, as
    // QEMU does by default, already holds the pages).
    let map = |file: File, offset: u64, len: usize| {
        let flags = if huge > 0 { libc::MAP_SHARED } else { libc::MAP_SHARED | libc::MAP_NORESERVE };
        vm_memory::mmap::MmapRegionBuilder::<()>::new(len)
            .with_file_offset(FileOffset::new(file, offset))
            .with_mmap_prot(libc::PROT_READ | libc::PROT_WRITE)
            .with_mmap_flags(flags)
            .with_hugetlbfs(huge > 0)
            .build()
            .map_err(mmap_err)
    };
    let page = huge.max(1);
    let (first, last) = (r.offset / page * page, end.div_ceil(page) * page);
    if (first == r.offset && last == end) || last > len {
        // Aligned (or a file without huge pages): the region owns its mapping.
        let region = GuestRegionMmap::new(map(r.file, r.offset, size)?, GuestAddress(at))
            .ok_or_else(|| Error::protocol(format!("memory region at {at:#x}: overflows")))?;
        return Ok(MappedRegion { region: Arc::new(region), keeper: None });
    }
    let whole =
        usize::try_from(last - first).map_err(|_| Error::protocol(format!("memory region at {at:#x}: too large")))?;
    let dup = r.file.try_clone().map_err(|e| Error::io("dup of a memory fd", e))?;
    let outer = Arc::new(map(dup, first, whole)?);
    // SAFETY: `size` bytes from `r.offset - first` into `outer` lie inside
    // it (`first <= r.offset`, `end <= last`); the memory made of this
    // region keeps `outer` (the keeper) as long as it or a clone lives.
    let inner = unsafe {
        vm_memory::mmap::MmapRegionBuilder::new(size)
            .with_raw_mmap_pointer(outer.as_ptr().add((r.offset - first) as usize))
            .with_file_offset(FileOffset::new(r.file, r.offset))
            .with_mmap_prot(libc::PROT_READ | libc::PROT_WRITE)
            .with_mmap_flags(libc::MAP_SHARED)
            .with_hugetlbfs(true)
            .build()
    }
    .map_err(mmap_err)?;
    let region = GuestRegionMmap::new(inner, GuestAddress(at))
        .ok_or_else(|| Error::protocol(format!("memory region at {at:#x}: overflows")))?;
    Ok(MappedRegion { region: Arc::new(region), keeper: Some(outer) })
}

/// One guest memory of already mapped regions, sorted here by address, and
/// the mappings they are windows into; overlapping regions are refused,
/// and none at all is the empty memory.
pub fn guest_memory(mut regions: Vec<MappedRegion>) -> Result<(GuestMemoryMmap, Vec<Keeper>)> {
    if regions.is_empty() {
        return Ok((no_memory(), Vec::new()));
    }
    regions.sort_by_key(|r| r.region.start_addr());
    let keep = regions.iter().filter_map(|r| r.keeper.clone()).collect();
    let arcs = regions.into_iter().map(|r| r.region).collect();
    let mem = GuestMemoryMmap::from_arc_regions(arcs).map_err(|e| Error::protocol(format!("guest memory map: {e}")))?;
    Ok((mem, keep))
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
        mem.mapped().write_obj(0xabcdu16, GuestAddress(0x10010)).unwrap();
        assert!(!mem.mapped().address_in_range(GuestAddress(0x11000)));
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
        mem.mapped().write_obj(1u8, GuestAddress(0x10000)).unwrap();
        mem.mapped().write_obj(2u8, GuestAddress(0x20fff)).unwrap();
        assert!(map_guest_memory(vec![region(0x10000), region(0x10800)]).is_err(), "overlap");
        let empty = map_guest_memory(Vec::new()).unwrap();
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
        let mem = map_guest_memory(vec![high, low]).unwrap();
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
        // 1 GiB of pages nobody allocated or reserved, more than this machine's pool: the map is
        // refused now (no reservation to be had) rather than a SIGBUS at a later touch.
        f.set_len(1 << 30).unwrap();
        let big = SharedRegion { gpa: 0, size: 1 << 30, offset: 0, file: f.try_clone().unwrap() };
        let e = map_guest_memory(vec![big]).expect_err("1 GiB of hugetlb pages mapped without a pool to back it");
        assert!(e.to_string().contains("mmap of guest memory"), "{e}");
    }

    fn tempfile() -> File {
        crate::testing::memfd("iopath-test")
    }
}
