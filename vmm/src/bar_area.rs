//! BAR areas a device shares as memory (`DeviceModel::mapped_areas`), as KVM
//! memslots where their BAR sits, so that the guest's accesses to them land
//! in memory without an exit (NVMe's doorbell page in `bar` modes).
//!
//! A device may ask to trap an area for a while (`IoEvents::trap_area`): its
//! memslot is taken out, and the guest's next access exits and reaches the
//! model's `bar_read`/`bar_write` through the MMIO bus, which always holds
//! the whole BAR. That is how a polling device that goes to sleep is woken by
//! the next doorbell store. The PCI host moves the areas with their BAR; a
//! trapped area stays out wherever its BAR goes until the device lets it go.
//!
//! An area's memory can be replaced (`IoEvents::replace_area`): the
//! vfio-user proxy, whose device process died, traps the old process's
//! page, hands what it holds to the new process, and then maps the new
//! process's page in its place ([`BarAreas::replace`]; the memslot is out
//! while the mapping changes, so no guest store reaches a mapping that is
//! gone).

use iopath_devices::lock;
use iopath_devices::pci::BarPlacement;
use kvm_bindings::kvm_userspace_memory_region as Region;
use kvm_ioctls::VmFd;
use std::sync::{Arc, Mutex};

/// One area and its memslot.
pub struct RamArea {
    pub bar: u8,
    /// Offset of the area in its BAR.
    pub offset: u64,
    pub map: vm_memory::MmapRegion,
    pub kvm_slot: u32,
    /// Where the memslot is now (None: not in the guest).
    placed: Option<u64>,
    /// Where the BAR puts the area (None: the BAR does not decode).
    at: Option<u64>,
    /// The device asked for its accesses to exit.
    trapped: bool,
}

impl RamArea {
    pub fn new(bar: u8, offset: u64, map: vm_memory::MmapRegion, kvm_slot: u32) -> RamArea {
        RamArea { bar, offset, map, kvm_slot, placed: None, at: None, trapped: false }
    }
}

/// A device's shared BAR areas. The memslots go when this does.
pub struct BarAreas {
    vm: Arc<VmFd>,
    areas: Mutex<Vec<RamArea>>,
}

impl BarAreas {
    pub fn new(vm: Arc<VmFd>, areas: Vec<RamArea>) -> BarAreas {
        BarAreas { vm, areas: Mutex::new(areas) }
    }

    /// The PCI host calls this when BAR `bar` starts or stops decoding or moves.
    pub fn bar_moved(&self, bar: u8, placement: Option<BarPlacement>) {
        let mut areas = lock(&self.areas);
        for a in areas.iter_mut().filter(|a| a.bar == bar) {
            a.at = placement.map(|p| p.addr + a.offset);
            apply(&self.vm, a);
        }
    }

    /// Takes the area at (`bar`, `offset`) out of the guest (`trap`) or puts
    /// it back where its BAR is. False if there is no such area or KVM
    /// refused (the area then stays as it was).
    pub fn set_trap(&self, bar: u8, offset: u64, trap: bool) -> bool {
        let mut areas = lock(&self.areas);
        let Some(a) = areas.iter_mut().find(|a| a.bar == bar && a.offset == offset) else { return false };
        a.trapped = trap;
        apply(&self.vm, a) == a.wanted()
    }

    /// Puts `map` behind the area at (`bar`, `offset`), in place of its
    /// memory (of the same size): the memslot is taken out, the old mapping
    /// dropped, and the slot put back where it is wanted (not while
    /// trapped). False if there is no such area, `map` is of another size,
    /// or KVM refused (then the old memory stays if the slot could not be
    /// taken out, or the new memory stays out of the guest: its accesses
    /// exit).
    pub fn replace(&self, bar: u8, offset: u64, map: vm_memory::MmapRegion) -> bool {
        let mut areas = lock(&self.areas);
        let Some(a) = areas.iter_mut().find(|a| a.bar == bar && a.offset == offset) else { return false };
        if map.size() != a.map.size() {
            return false;
        }
        let trapped = std::mem::replace(&mut a.trapped, true);
        if apply(&self.vm, a).is_some() {
            a.trapped = trapped;
            return false;
        }
        // No memslot points at the old mapping any more: it may go.
        a.map = map;
        a.trapped = trapped;
        apply(&self.vm, a) == a.wanted()
    }

    /// Where the area at (`bar`, `offset`) is mapped in the guest now.
    pub fn placed(&self, bar: u8, offset: u64) -> Option<u64> {
        let areas = lock(&self.areas);
        areas.iter().find(|a| a.bar == bar && a.offset == offset).and_then(|a| a.placed)
    }
}

/// `size` bytes of `fd` from `fd_offset`, mapped shared, for an area: page
/// aligned, and within the file (a shorter file would be SIGBUS on access).
pub fn map_area(fd: std::fs::File, fd_offset: u64, size: u64) -> Result<vm_memory::MmapRegion, String> {
    let long_enough = fd.metadata().is_ok_and(|m| fd_offset.checked_add(size).is_some_and(|e| e <= m.len()));
    if !long_enough || !fd_offset.is_multiple_of(4096) || !size.is_multiple_of(4096) || size == 0 {
        return Err(format!("{size:#x} bytes at {fd_offset:#x} of its fd cannot be mapped"));
    }
    let fo = vm_memory::FileOffset::new(fd, fd_offset);
    vm_memory::MmapRegion::from_file(fo, size as usize).map_err(|e| format!("mmap: {e}"))
}

impl RamArea {
    fn wanted(&self) -> Option<u64> {
        self.at.filter(|_| !self.trapped)
    }
}

/// Puts `a`'s memslot where it is wanted (or nowhere); returns where it is.
fn apply(vm: &VmFd, a: &mut RamArea) -> Option<u64> {
    let want = a.wanted();
    if a.placed == want {
        return a.placed;
    }
    if a.placed.is_some() {
        let gone = Region { slot: a.kvm_slot, flags: 0, guest_phys_addr: 0, memory_size: 0, userspace_addr: 0 };
        // SAFETY: deleting a slot this host created.
        match unsafe { vm.set_user_memory_region(gone) } {
            Ok(()) => a.placed = None,
            Err(e) => {
                // The guest still sees the old mapping: keep it (and the slot) as they are.
                log::warn!("removing KVM memslot {}: {e}; the area stays where it was", a.kvm_slot);
                return a.placed;
            }
        }
    }
    if let Some(gpa) = want {
        let r = Region {
            slot: a.kvm_slot,
            flags: 0,
            guest_phys_addr: gpa,
            memory_size: a.map.size() as u64,
            userspace_addr: a.map.as_ptr() as u64,
        };
        // SAFETY: the mapping lives in the RamArea as long as the slot does:
        // a slot is removed before it moves, and Drop removes them all.
        match unsafe { vm.set_user_memory_region(r) } {
            Ok(()) => a.placed = Some(gpa),
            Err(e) => log::warn!("KVM memslot for a BAR area at {gpa:#x}: {e}; its accesses exit"),
        }
    }
    a.placed
}

impl Drop for BarAreas {
    /// Takes the areas out of the guest before their mappings go away.
    fn drop(&mut self) {
        let areas = self.areas.get_mut().unwrap_or_else(|e| e.into_inner());
        for a in areas.iter_mut() {
            a.at = None;
            apply(&self.vm, a);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use iopath_devices::{BarKind, BarSpec};

    fn vm() -> Arc<VmFd> {
        assert!(std::path::Path::new("/dev/kvm").exists(), "/dev/kvm is missing");
        Arc::new(kvm_ioctls::Kvm::new().unwrap().create_vm().unwrap())
    }

    fn bar0(addr: u64) -> Option<BarPlacement> {
        Some(BarPlacement { spec: BarSpec { index: 0, kind: BarKind::Mem64, size: 0x4000 }, addr })
    }

    /// Whether KVM holds a memslot over `gpa`: a second slot there is refused (EEXIST).
    fn occupied(vm: &VmFd, gpa: u64, page: &vm_memory::MmapRegion) -> bool {
        let r =
            Region { slot: 9, flags: 0, guest_phys_addr: gpa, memory_size: 4096, userspace_addr: page.as_ptr() as u64 };
        // SAFETY: a probe slot over a page this test owns, removed at once if it was made.
        match unsafe { vm.set_user_memory_region(r) } {
            Ok(()) => {
                let gone = Region { memory_size: 0, ..r };
                // SAFETY: a zero-sized region deletes the probe slot just made; KVM
                // keeps no pointer into `page` after it.
                unsafe { vm.set_user_memory_region(gone) }.unwrap();
                false
            }
            Err(_) => true,
        }
    }

    #[test]
    fn an_area_follows_its_bar_and_stays_out_while_trapped() {
        let vm = vm();
        let page = || vm_memory::MmapRegion::new(4096).unwrap();
        let probe = page();
        let a = BarAreas::new(vm.clone(), vec![RamArea::new(0, 0x1000, page(), 1)]);
        assert_eq!(a.placed(0, 0x1000), None, "nothing before the BAR decodes");
        a.bar_moved(0, bar0(0xe000_0000));
        assert_eq!(a.placed(0, 0x1000), Some(0xe000_1000));
        assert!(occupied(&vm, 0xe000_1000, &probe));
        // Trapped: out of the guest, and it stays out when the BAR moves.
        assert!(a.set_trap(0, 0x1000, true));
        assert_eq!(a.placed(0, 0x1000), None);
        assert!(!occupied(&vm, 0xe000_1000, &probe));
        a.bar_moved(0, bar0(0xe001_0000));
        assert_eq!(a.placed(0, 0x1000), None, "a trapped area stays out where its BAR goes");
        // Let go: back where the BAR is now.
        assert!(a.set_trap(0, 0x1000, false));
        assert_eq!(a.placed(0, 0x1000), Some(0xe001_1000));
        assert!(occupied(&vm, 0xe001_1000, &probe) && !occupied(&vm, 0xe000_1000, &probe));
        // No such area: refused, nothing changes.
        assert!(!a.set_trap(0, 0x2000, true) && !a.set_trap(1, 0x1000, true));
        assert_eq!(a.placed(0, 0x1000), Some(0xe001_1000));
        drop(a);
        assert!(!occupied(&vm, 0xe001_1000, &probe), "the memslot goes with the areas");
    }

    /// The host address behind the area at (`bar`, `offset`).
    fn host(a: &BarAreas, bar: u8, offset: u64) -> *const u8 {
        lock(&a.areas).iter().find(|x| x.bar == bar && x.offset == offset).unwrap().map.as_ptr() as *const u8
    }

    #[test]
    fn an_areas_memory_is_replaced_with_the_slot_out_and_its_trap_kept() {
        let vm = vm();
        let page = || vm_memory::MmapRegion::new(4096).unwrap();
        let probe = page();
        let a = BarAreas::new(vm.clone(), vec![RamArea::new(0, 0x1000, page(), 1)]);
        a.bar_moved(0, bar0(0xe000_0000));
        // Mapped: replaced, and back where its BAR is, on the new memory.
        let new = page();
        let at = new.as_ptr() as *const u8;
        assert!(a.replace(0, 0x1000, new));
        assert_eq!(host(&a, 0, 0x1000), at);
        assert_eq!(a.placed(0, 0x1000), Some(0xe000_1000));
        assert!(occupied(&vm, 0xe000_1000, &probe));
        // Trapped (as the vfio-user proxy has it while a device process is
        // replaced): replaced, and still out until let go.
        assert!(a.set_trap(0, 0x1000, true));
        let new = page();
        let at = new.as_ptr() as *const u8;
        assert!(a.replace(0, 0x1000, new));
        assert_eq!((host(&a, 0, 0x1000), a.placed(0, 0x1000)), (at, None));
        assert!(!occupied(&vm, 0xe000_1000, &probe));
        assert!(a.set_trap(0, 0x1000, false));
        assert_eq!(a.placed(0, 0x1000), Some(0xe000_1000));
        // Another size, or no such area: refused, nothing changes.
        assert!(!a.replace(0, 0x1000, vm_memory::MmapRegion::new(8192).unwrap()));
        assert!(!a.replace(0, 0x2000, page()));
        assert_eq!((host(&a, 0, 0x1000), a.placed(0, 0x1000)), (at, Some(0xe000_1000)));
    }

    #[test]
    fn an_area_is_mapped_only_page_aligned_and_within_its_file() {
        let file = tempfile_of(8192);
        let f = || file.try_clone().unwrap();
        assert!(map_area(f(), 4096, 4096).is_ok());
        assert!(map_area(f(), 4096, 8192).is_err(), "past the end of the file");
        assert!(map_area(f(), 100, 4096).is_err(), "unaligned offset");
        assert!(map_area(f(), 0, 100).is_err(), "unaligned size");
        assert!(map_area(f(), 0, 0).is_err(), "empty");
        assert!(map_area(f(), u64::MAX - 4095, 4096).is_err(), "overflow");
    }

    /// An anonymous file of `len` bytes.
    fn tempfile_of(len: u64) -> std::fs::File {
        use std::os::fd::FromRawFd;
        let name = std::ffi::CString::new("bar-area-test").unwrap();
        // SAFETY: memfd_create with a valid name; the fd is owned by the File.
        let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
        assert!(fd >= 0);
        // SAFETY: a fresh descriptor nobody else owns.
        let f = unsafe { std::fs::File::from_raw_fd(fd) };
        f.set_len(len).unwrap();
        f
    }
}
