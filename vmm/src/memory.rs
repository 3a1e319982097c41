//! Guest RAM: one memfd-backed region at guest physical address 0.
//!
//! The region keeps its memfd (`GuestRegionMmap::file_offset`), which the
//! proxies hand to a device process (mpqemu SYNC_SYSMEM, vfio-user DMA_MAP).

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
    let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: fd is a fresh, owned descriptor.
    let memfd = unsafe { File::from_raw_fd(fd) };
    memfd.set_len(size)?;
    let region = MmapRegion::from_file(FileOffset::new(memfd, 0), size as usize)
        .map_err(|e| std::io::Error::other(format!("mmap guest RAM: {e}")))?;
    let region = GuestRegionMmap::new(region, GuestAddress(0))
        .ok_or_else(|| std::io::Error::other("guest RAM region overflows"))?;
    let mem = GuestMemoryMmap::from_regions(vec![region]).map_err(|e| std::io::Error::other(e.to_string()))?;
    Ok(GuestRam { mem })
}
