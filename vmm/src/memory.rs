//! Guest RAM: one memfd-backed region at guest physical address 0.
//!
//! The region keeps its memfd (`GuestRegionMmap::file_offset`), which the
//! proxies hand to a device process (mpqemu SYNC_SYSMEM, vfio-user DMA_MAP).
//! It is sealed against shrinking and growing, which device processes
//! require before they map it (a truncated mapping faults with SIGBUS).

use std::ffi::CString;
use std::fs::File;
use std::os::unix::io::FromRawFd;
use vm_memory::{FileOffset, GuestAddress, GuestMemoryMmap, GuestRegionMmap, MmapRegion};

pub struct GuestRam {
    pub mem: GuestMemoryMmap,
}

pub fn create(size: u64) -> std::io::Result<GuestRam> {
    let name = CString::new("iopath-guest-ram").unwrap();
    // SAFETY: memfd_create with a valid C string; the fd is owned by the File below.
    let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: fd is a fresh, owned descriptor.
    let memfd = unsafe { File::from_raw_fd(fd) };
    memfd.set_len(size)?;
    // Its size is final: a device process that maps it must not see it
    // shrink (SIGBUS) and checks for this seal.
    // SAFETY: F_ADD_SEALS on an fd we own; no memory is passed.
    if unsafe { libc::fcntl(fd, libc::F_ADD_SEALS, libc::F_SEAL_SHRINK | libc::F_SEAL_GROW) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    let region = MmapRegion::from_file(FileOffset::new(memfd, 0), size as usize)
        .map_err(|e| std::io::Error::other(format!("mmap guest RAM: {e}")))?;
    let region = GuestRegionMmap::new(region, GuestAddress(0))
        .ok_or_else(|| std::io::Error::other("guest RAM region overflows"))?;
    let mem = GuestMemoryMmap::from_regions(vec![region]).map_err(|e| std::io::Error::other(e.to_string()))?;
    Ok(GuestRam { mem })
}

#[cfg(test)]
mod tests {
    #[test]
    fn guest_ram_refuses_to_shrink_or_grow() {
        let ram = super::create(1 << 20).unwrap();
        use vm_memory::{GuestMemoryBackend, GuestMemoryRegion};
        let region = ram.mem.iter().next().unwrap();
        let f = region.file_offset().unwrap().file();
        let e = f.set_len(4096).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::EPERM), "shrink");
        assert_eq!(f.set_len(2 << 20).unwrap_err().raw_os_error(), Some(libc::EPERM), "grow");
        assert_eq!(f.metadata().unwrap().len(), 1 << 20);
    }
}
