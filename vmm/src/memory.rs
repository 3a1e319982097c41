//! Guest RAM: one region at guest physical address 0.
//!
//! Shared (a device of the VM hands guest RAM to another process): memfd
//! backed. The region keeps its memfd (`GuestRegionMmap::file_offset`),
//! which the proxies hand to a device process (mpqemu SYNC_SYSMEM,
//! vfio-user DMA_MAP, vhost-user SET_MEM_TABLE). It is sealed against
//! shrinking and growing: nobody it is handed can truncate it under the VM
//! (a truncated mapping faults with SIGBUS). A memfd gets transparent
//! huge pages only where the host's `shmem_enabled` allows; `hugetlb`
//! RAM is a memfd in hugetlbfs pages, shareable and huge everywhere, taken
//! from the host's pool when the VM starts.
//!
//! Not shared: anonymous private memory advised for transparent huge pages
//! (as QEMU's default RAM is). Fewer TLB misses for the guest, and a
//! device's O_DIRECT transfer on the guest's pages in place reaches a disk
//! as one segment per huge page rather than one per 4 KiB page (64 KiB
//! random writes on this project's virtual disk, in place: 20.9 k IOPS from
//! huge pages against 9.5 k from the memfd's 4 KiB ones).

use std::ffi::CString;
use std::fs::File;
use std::os::unix::io::{AsRawFd, FromRawFd};
use vm_memory::{FileOffset, GuestAddress, GuestMemoryBackend, GuestMemoryMmap, GuestRegionMmap, MmapRegion};

pub struct GuestRam {
    pub mem: GuestMemoryMmap,
    /// In huge pages, as far as the kernel grants them: hugetlbfs, or
    /// advised for transparent ones where the THP settings allow them.
    pub huge: bool,
}

/// How guest RAM is backed (`iopath run --ram`, `bench nvme --ram`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum RamKind {
    /// Anonymous memory advised for transparent huge pages, unless a
    /// device shares guest RAM: then [`Memfd`](Self::Memfd).
    #[default]
    Auto,
    /// A sealed memfd on tmpfs (transparent huge pages only where the
    /// host's `shmem_enabled` grants them), as QEMU's `memory-backend-memfd`.
    Memfd,
    /// A sealed memfd in 2 MiB hugetlbfs pages taken from the host's pool
    /// (`vm.nr_hugepages`) when the VM starts, as QEMU's
    /// `memory-backend-memfd,hugetlb=on`. Shareable with a device process.
    Hugetlb,
}

/// A guest RAM kind that is none of [`RamKind`]'s.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
#[error("guest RAM {0:?}: auto, memfd or hugetlb")]
pub struct UnknownRamKind(pub String);

impl std::str::FromStr for RamKind {
    type Err = UnknownRamKind;
    fn from_str(s: &str) -> Result<Self, UnknownRamKind> {
        match s {
            "auto" => Ok(RamKind::Auto),
            "memfd" => Ok(RamKind::Memfd),
            "hugetlb" => Ok(RamKind::Hugetlb),
            _ => Err(UnknownRamKind(s.to_string())),
        }
    }
}

impl std::fmt::Display for RamKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            RamKind::Auto => "auto",
            RamKind::Memfd => "memfd",
            RamKind::Hugetlb => "hugetlb",
        })
    }
}

/// The hugetlbfs page size `RamKind::Hugetlb` asks for.
const HUGETLB_PAGE: u64 = 2 << 20;

/// Guest RAM of `size` bytes backed as `kind` says (`Auto`: anonymous).
pub fn create(size: u64, kind: RamKind) -> std::io::Result<GuestRam> {
    if kind == RamKind::Auto {
        let region =
            MmapRegion::new(size as usize).map_err(|e| std::io::Error::other(format!("mmap guest RAM: {e}")))?;
        // SAFETY: advice on the mapping just made, which `region` owns.
        // Without it (no THP here) guest RAM is in 4 KiB pages.
        let advised = unsafe { libc::madvise(region.as_ptr().cast(), size as usize, libc::MADV_HUGEPAGE) } == 0;
        let mem = from_region(region)?;
        return Ok(GuestRam { huge: advised && iopath_devices::hugepages::anonymous_grants_advised(), ..mem });
    }
    let hugetlb = kind == RamKind::Hugetlb;
    if hugetlb && !size.is_multiple_of(HUGETLB_PAGE) {
        return Err(std::io::Error::other(format!(
            "guest RAM in hugetlb pages: {size} bytes is not a multiple of 2 MiB"
        )));
    }
    let name = CString::new("iopath-guest-ram").unwrap();
    let mut flags = libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING;
    if hugetlb {
        flags |= libc::MFD_HUGETLB | libc::MFD_HUGE_2MB;
    }
    // SAFETY: memfd_create with a valid C string; the fd is owned by the File below.
    let fd = unsafe { libc::memfd_create(name.as_ptr(), flags) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: fd is a fresh, owned descriptor.
    let memfd = unsafe { File::from_raw_fd(fd) };
    memfd.set_len(size)?;
    if hugetlb {
        // What the pool has before this takes any (a failed fallocate keeps
        // the pages it got until the memfd closes).
        let pool = hugetlb_pool();
        // The pages are taken now, or the VM does not start: mapped
        // without a reservation (vm-memory maps MAP_NORESERVE), a page the
        // pool lacks would be a SIGBUS at the guest's first touch.
        // SAFETY: fallocate on an fd we own; no memory is passed.
        if unsafe { libc::fallocate(fd, 0, 0, size as libc::off_t) } != 0 {
            let e = std::io::Error::last_os_error();
            return Err(std::io::Error::other(format!(
                "guest RAM in hugetlb pages: {} MiB needs {} free 2 MiB pages ({e}); {}",
                size >> 20,
                size / HUGETLB_PAGE,
                pool
            )));
        }
    }
    // Its size is final: no process it is handed to can shrink it under
    // the VM or a device (SIGBUS).
    // F_SEAL_SEAL: and no process it is handed to can seal it further (a
    // device process's F_SEAL_FUTURE_WRITE would refuse the others' mappings).
    let seals = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;
    // SAFETY: F_ADD_SEALS on the memfd `memfd` owns (made with MFD_ALLOW_SEALING);
    // the argument is an integer, no memory is passed.
    if unsafe { libc::fcntl(memfd.as_raw_fd(), libc::F_ADD_SEALS, seals) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    let region = MmapRegion::from_file(FileOffset::new(memfd, 0), size as usize)
        .map_err(|e| std::io::Error::other(format!("mmap guest RAM: {e}")))?;
    let ram = from_region(region)?;
    // A tmpfs memfd is advised here (for `shmem_enabled=advise`).
    let huge = ram.mem.iter().all(iopath_devices::hugepages::region_in_huge_pages);
    Ok(GuestRam { huge, ..ram })
}

/// The host's pool of 2 MiB pages, as /proc/meminfo tells it.
fn hugetlb_pool() -> String {
    let m = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let field = |k: &str| m.lines().find(|l| l.starts_with(k)).map(|l| l[k.len()..].trim().to_string());
    match (field("HugePages_Total:"), field("HugePages_Free:"), field("Hugepagesize:")) {
        (Some(t), Some(f), Some(sz)) => {
            format!("the pool has {f} free of {t} (of {sz}; vm.nr_hugepages sets the default size's)")
        }
        _ => "this kernel shows no hugetlb pool".into(),
    }
}

fn from_region(region: MmapRegion) -> std::io::Result<GuestRam> {
    let region = GuestRegionMmap::new(region, GuestAddress(0))
        .ok_or_else(|| std::io::Error::other("guest RAM region overflows"))?;
    let mem = GuestMemoryMmap::from_regions(vec![region]).map_err(|e| std::io::Error::other(e.to_string()))?;
    Ok(GuestRam { mem, huge: false })
}

#[cfg(test)]
mod tests {
    use super::RamKind;

    #[test]
    fn guest_ram_refuses_to_shrink_or_grow() {
        let ram = super::create(1 << 20, RamKind::Memfd).unwrap();
        use vm_memory::{GuestMemoryBackend, GuestMemoryRegion};
        let region = ram.mem.iter().next().unwrap();
        let f = region.file_offset().unwrap().file();
        let e = f.set_len(4096).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::EPERM), "shrink");
        assert_eq!(f.set_len(2 << 20).unwrap_err().raw_os_error(), Some(libc::EPERM), "grow");
        assert_eq!(f.metadata().unwrap().len(), 1 << 20);
    }

    #[test]
    fn unshared_guest_ram_is_anonymous() {
        let ram = super::create(4 << 20, RamKind::Auto).unwrap();
        use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend, GuestMemoryRegion};
        assert!(ram.mem.iter().next().unwrap().file_offset().is_none());
        ram.mem.write_obj(0x5au8, GuestAddress((4 << 20) - 1)).unwrap();
        assert_eq!(ram.mem.read_obj::<u8>(GuestAddress((4 << 20) - 1)).unwrap(), 0x5a);
    }

    #[test]
    fn hugetlb_guest_ram_takes_its_pages_from_the_pool_at_once_or_fails_with_the_pool() {
        // This machine keeps a pool of 2 MiB pages (HugePages_Free in /proc/meminfo): one is enough.
        let ram = super::create(2 << 20, RamKind::Hugetlb)
            .unwrap_or_else(|e| panic!("hugetlb guest RAM (needs one free 2 MiB page, vm.nr_hugepages): {e}"));
        assert!(ram.huge);
        use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend, GuestMemoryRegion};
        let f = ram.mem.iter().next().unwrap().file_offset().unwrap().file();
        assert_eq!(iopath_devices::hugepages::backing(f), iopath_devices::hugepages::Backing::Hugetlb);
        assert_eq!(f.set_len(4 << 20).unwrap_err().raw_os_error(), Some(libc::EPERM), "sealed");
        ram.mem.write_obj(0xa5u8, GuestAddress((2 << 20) - 1)).unwrap();
        assert_eq!(ram.mem.read_obj::<u8>(GuestAddress((2 << 20) - 1)).unwrap(), 0xa5);
        // More than any pool here: refused up front, naming the pool.
        let e = super::create(1 << 40, RamKind::Hugetlb).err().expect("a 1 TiB hugetlb RAM");
        assert!(e.to_string().contains("free 2 MiB pages") && e.to_string().contains("pool"), "{e}");
        let e = super::create(3 << 20, RamKind::Hugetlb).err().expect("3 MiB is not whole pages");
        assert!(e.to_string().contains("multiple of 2 MiB"), "{e}");
        // The plain memfd: huge exactly as the host's shmem settings grant an advised mapping.
        let m = super::create(2 << 20, RamKind::Memfd).unwrap();
        let f = m.mem.iter().next().unwrap().file_offset().unwrap().file();
        assert_eq!(m.huge, iopath_devices::hugepages::file_in_huge_pages(f, true));
    }
}
