//! Whether mapped guest memory lies in huge pages.
//!
//! It matters to a device that moves data on the guest's pages in place
//! (a file namespace's O_DIRECT transfers, `block/guest.rs`): in 4 KiB pages a transfer
//! over several guest pages reaches the disk as one segment per page, in
//! huge pages as one per huge page.
//!
//! Memory a client shares comes as an fd; its file system tells:
//! - hugetlbfs (a memfd made with `MFD_HUGETLB`, QEMU's
//!   `memory-backend-memfd,hugetlb=on` or `memory-backend-file` on a
//!   hugetlbfs mount): huge pages, always.
//! - tmpfs/shmem (a plain memfd, `memory-backend-memfd`): transparent huge
//!   pages only where the host's `shmem_enabled` (and its PMD size's own
//!   knob, where the kernel has one) grants them. Under `advise` the
//!   mapping must be advised, which [`region_in_huge_pages`] does.
//! - anything else: not known to be huge.
//!
//! Anonymous memory has no fd: its owner knows whether it advised it
//! ([`GuestMem::with_huge_pages`](crate::GuestMem::with_huge_pages)).

use std::fs::File;
use std::os::fd::AsRawFd;
use vm_memory::{GuestMemoryRegion, GuestRegionMmap, MemoryRegionAddress};

/// `statfs.f_type` of hugetlbfs (linux/magic.h).
const HUGETLBFS_MAGIC: i64 = 0x9584_58f6;
/// `statfs.f_type` of tmpfs, which memfds without `MFD_HUGETLB` live on.
const TMPFS_MAGIC: i64 = 0x0102_1994;

const THP: &str = "/sys/kernel/mm/transparent_hugepage";

/// Where `file`'s pages live, as far as huge pages go.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backing {
    Hugetlb,
    Shmem,
    Other,
}

/// `file`'s file system: its `statfs`, or None if the call fails.
fn statfs(file: &File) -> Option<libc::statfs> {
    // SAFETY: `libc::statfs` is a plain C struct of integers (and integer
    // arrays), for which all-zero bytes are a valid value.
    let mut s: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: the fd is open for as long as `file` is borrowed; `&mut s` is a
    // writable, properly sized and aligned `statfs` that the kernel fills and
    // keeps no pointer to after the call returns.
    (unsafe { libc::fstatfs(file.as_raw_fd(), &mut s) } == 0).then_some(s)
}

/// A `statfs`'s file system magic (`f_type`'s width differs between architectures).
#[allow(clippy::unnecessary_cast)]
fn magic(s: &libc::statfs) -> i64 {
    s.f_type as i64
}

/// The file system `file` is on, by its `statfs` magic.
pub fn backing(file: &File) -> Backing {
    match statfs(file).map(|s| magic(&s)) {
        Some(HUGETLBFS_MAGIC) => Backing::Hugetlb,
        Some(TMPFS_MAGIC) => Backing::Shmem,
        _ => Backing::Other,
    }
}

/// The page size of a hugetlbfs `file` (its `statfs` block size); None for
/// any other file.
pub fn hugetlb_page_size(file: &File) -> Option<u64> {
    statfs(file).filter(|s| magic(s) == HUGETLBFS_MAGIC).map(|s| s.f_bsize as u64)
}

/// True if a mapping of `file` (advised for huge pages if `advised`) is in
/// huge pages as far as the kernel grants them.
pub fn file_in_huge_pages(file: &File, advised: bool) -> bool {
    grants(backing(file), advised)
}

/// Whether pages of `backing` are huge, mapped advised or not.
fn grants(backing: Backing, advised: bool) -> bool {
    match backing {
        Backing::Hugetlb => true,
        Backing::Shmem => {
            let (top, pmd) = settings();
            shmem_grants(top, pmd.as_deref(), advised)
        }
        Backing::Other => false,
    }
}

/// True if the kernel gives anonymous memory advised with MADV_HUGEPAGE
/// transparent huge pages (`enabled` is `always` or `madvise`).
pub fn anonymous_grants_advised() -> bool {
    let s = std::fs::read_to_string(format!("{THP}/enabled")).unwrap_or_default();
    matches!(selected(&s), Some("always" | "madvise"))
}

/// The host's shmem THP settings (`shmem_enabled`, and the PMD size's own
/// where the kernel has one), read once: call it before a sandbox takes
/// file opens away (a device process's seccomp filter), and later calls
/// use what it read. Unreadable settings grant nothing.
pub fn settings() -> &'static (String, Option<String>) {
    static SETTINGS: std::sync::OnceLock<(String, Option<String>)> = std::sync::OnceLock::new();
    SETTINGS.get_or_init(|| {
        let top = std::fs::read_to_string(format!("{THP}/shmem_enabled")).unwrap_or_default();
        let pmd =
            pmd_size().and_then(|kb| std::fs::read_to_string(format!("{THP}/hugepages-{kb}kB/shmem_enabled")).ok());
        (top, pmd)
    })
}

/// The PMD huge page size in KiB (`hpage_pmd_size`), if the kernel says.
fn pmd_size() -> Option<u64> {
    let b: u64 = std::fs::read_to_string(format!("{THP}/hpage_pmd_size")).ok()?.trim().parse().ok()?;
    Some(b >> 10)
}

/// The selected word of a sysfs setting: `always [advise] never` gives `advise`.
fn selected(setting: &str) -> Option<&str> {
    let s = setting.split('[').nth(1)?;
    s.split(']').next()
}

/// Whether shmem gets PMD-sized transparent huge pages: `top` is
/// `shmem_enabled`, `pmd` the PMD size's own `shmem_enabled` (kernels with
/// per-size huge pages; `inherit` defers to `top`). `within_size` grants
/// pages inside the file's size, which a mapping of guest RAM is.
fn shmem_grants(top: &str, pmd: Option<&str>, advised: bool) -> bool {
    let grants = |w: &str| match w {
        "always" | "within_size" | "force" => true,
        "advise" => advised,
        _ => false,
    };
    match pmd.and_then(selected) {
        Some("inherit") | None => selected(top).is_some_and(grants),
        Some(w) => grants(w),
    }
}

/// True if `r` is a mapping of an fd whose pages are huge (see the
/// module's doc). A shmem mapping is advised for huge pages first (cheap,
/// and the same advice again changes nothing).
pub fn region_in_huge_pages(r: &GuestRegionMmap) -> bool {
    let Some(fo) = r.file_offset() else { return false };
    let b = backing(fo.file());
    let advised = b == Backing::Shmem
        && match r.get_host_address(MemoryRegionAddress(0)) {
            // SAFETY: advice on the region's own mapping, `len` bytes from its start.
            Ok(h) => unsafe { libc::madvise(h.cast(), r.len() as usize, libc::MADV_HUGEPAGE) == 0 },
            Err(_) => false,
        };
    grants(b, advised)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shmem_settings_grant_huge_pages_as_the_kernel_reads_them() {
        let never = "always within_size advise [never] deny force";
        let advise = "always within_size [advise] never deny force";
        assert!(!shmem_grants(never, None, true));
        assert!(shmem_grants(advise, None, true));
        assert!(!shmem_grants(advise, None, false));
        assert!(shmem_grants("[always] within_size advise never deny force", None, false));
        assert!(shmem_grants("always [within_size] advise never deny force", None, false));
        assert!(!shmem_grants("always within_size advise never [deny] force", None, true));
        // The PMD size's own knob, where it is not `inherit`, decides.
        assert!(shmem_grants(never, Some("[always] inherit within_size advise never"), false));
        assert!(!shmem_grants(advise, Some("always inherit within_size advise [never]"), true));
        assert!(shmem_grants(advise, Some("always [inherit] within_size advise never"), true));
        assert!(!shmem_grants("", None, true), "no THP at all");
    }

    #[test]
    fn a_hugetlb_memfd_is_huge_an_ordinary_file_is_not() {
        let name = c"iopath-hugepages-test";
        // SAFETY: memfd_create with a valid C string; the fd is owned by the File below.
        let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_HUGETLB) };
        assert!(fd >= 0, "memfd_create(MFD_HUGETLB): {}", std::io::Error::last_os_error());
        // SAFETY: a fresh, open fd (checked above) that nothing else owns.
        let f = unsafe { <File as std::os::fd::FromRawFd>::from_raw_fd(fd) };
        assert_eq!(backing(&f), Backing::Hugetlb);
        assert!(file_in_huge_pages(&f, false));
        // The crate's own directory is on a disk's file system, not tmpfs.
        let plain = tempfile_in(std::path::Path::new(env!("CARGO_MANIFEST_DIR")));
        assert_eq!(backing(&plain), Backing::Other);
        assert!(!file_in_huge_pages(&plain, true));
        // SAFETY: memfd_create with a valid C string; the fd is owned by the File below.
        let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
        assert!(fd >= 0, "memfd_create: {}", std::io::Error::last_os_error());
        // SAFETY: a fresh, open fd (checked above) that nothing else owns.
        let m = unsafe { <File as std::os::fd::FromRawFd>::from_raw_fd(fd) };
        assert_eq!(backing(&m), Backing::Shmem);
    }

    fn tempfile_in(dir: &std::path::Path) -> File {
        let p = dir.join(format!("iopath-hugepages-{}", std::process::id()));
        let f = File::options().create(true).truncate(true).read(true).write(true).open(&p).unwrap();
        let _ = std::fs::remove_file(p);
        f
    }
}
