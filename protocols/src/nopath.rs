//! What a confined device process does on fds instead of paths. Once
//! `iopath serve` is confined ([`crate::seccomp`]) no system call that
//! takes a path is allowed (open, stat, readlink, access, ...) and Landlock
//! refuses every file system access by path ([`crate::landlock`]), so:
//!
//! - [`fstat`] is the raw `fstat` system call: glibc's `fstat` is
//!   `newfstatat(fd, "", AT_EMPTY_PATH)` and std's `File::metadata` is
//!   `statx(fd, "", AT_EMPTY_PATH)`, calls that take a path and so could
//!   name any file: neither is allowed;
//! - [`open_fds`] counts the process's open fds (the vfio-user server's DMA
//!   map budget) from a `/proc/self/fd` directory opened once by
//!   [`prepare`], before the sandbox, and read again from its start each time.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::{Mutex, OnceLock};

/// `/proc/self/fd`, opened by [`prepare`]; the lock orders its readers (one offset).
static PROC_FD: OnceLock<Mutex<OwnedFd>> = OnceLock::new();

/// Opens what [`open_fds`] reads, while paths may still be opened. Once per
/// process (later calls keep the first); an error leaves `open_fds` to open
/// the directory itself, which works only unconfined.
pub fn prepare() -> std::io::Result<()> {
    if PROC_FD.get().is_some() {
        return Ok(());
    }
    // SAFETY: a C string path; the fd returned is owned below.
    let fd = unsafe { libc::open(c"/proc/self/fd".as_ptr(), libc::O_RDONLY | libc::O_DIRECTORY | libc::O_CLOEXEC) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: a fresh fd of ours.
    let _ = PROC_FD.set(Mutex::new(unsafe { OwnedFd::from_raw_fd(fd) }));
    Ok(())
}

/// The fds this process has open (the one [`prepare`] keeps included), or
/// None if they cannot be counted.
pub fn open_fds() -> Option<u64> {
    let Some(dir) = PROC_FD.get() else {
        return std::fs::read_dir("/proc/self/fd").ok().map(|d| d.count() as u64);
    };
    let dir = iopath_devices::lock(dir);
    let fd = dir.as_raw_fd();
    // SAFETY: lseek on an fd we own; procfs lists the fd table afresh from offset 0.
    if unsafe { libc::lseek(fd, 0, libc::SEEK_SET) } != 0 {
        return None;
    }
    let mut buf = [0u64; 512]; // 4 KiB, 8-byte aligned for the records' header
    let mut n = 0u64;
    loop {
        // SAFETY: getdents64 writes at most `size_of_val(&buf)` bytes into `buf`.
        let got = unsafe { libc::syscall(libc::SYS_getdents64, fd, buf.as_mut_ptr(), std::mem::size_of_val(&buf)) };
        if got < 0 {
            return None;
        }
        if got == 0 {
            return Some(n);
        }
        n += dirents(&bytes_of(&buf)[..got as usize])?;
    }
}

fn bytes_of(buf: &[u64; 512]) -> &[u8] {
    // SAFETY: the same memory viewed as bytes, every bit pattern valid.
    unsafe { std::slice::from_raw_parts(buf.as_ptr().cast::<u8>(), std::mem::size_of_val(buf)) }
}

/// The entries in `b`, linux_dirent64 records (d_ino u64, d_off i64,
/// d_reclen u16, d_type u8, then the NUL-terminated name), less `.` and
/// `..`; None if a record's length is malformed.
fn dirents(b: &[u8]) -> Option<u64> {
    let mut n = 0;
    let mut at = 0;
    while at < b.len() {
        let len = u16::from_ne_bytes(b.get(at + 16..at + 18)?.try_into().ok()?) as usize;
        let rec = b.get(at..at + len).filter(|_| len >= 20)?;
        let name = &rec[19..];
        let name = &name[..name.iter().position(|&c| c == 0).unwrap_or(name.len())];
        if name != b"." && name != b".." {
            n += 1;
        }
        at += len;
    }
    Some(n)
}

/// The `stat` of an open file, by the `fstat` system call itself (see the
/// module doc for why not glibc's or std's).
pub fn fstat(f: &impl AsRawFd) -> std::io::Result<libc::stat> {
    let mut st = std::mem::MaybeUninit::<libc::stat>::zeroed();
    // SAFETY: fstat writes one struct stat into `st`.
    if unsafe { libc::syscall(libc::SYS_fstat, f.as_raw_fd(), st.as_mut_ptr()) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: zero-initialised and filled by the kernel.
    Ok(unsafe { st.assume_init() })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_kept_directory_counts_fds_as_a_fresh_listing_does() {
        let fresh = || std::fs::read_dir("/proc/self/fd").unwrap().count() as u64;
        // Unprepared: a fresh listing (its own fd counted).
        let before = open_fds().unwrap();
        prepare().unwrap();
        // Other tests open and close fds meanwhile: compare around a change of our own.
        let files: Vec<_> = (0..200).map(|_| std::fs::File::open("/dev/null").unwrap()).collect();
        let with = open_fds().unwrap();
        drop(files);
        let without = open_fds().unwrap();
        assert!(with >= without + 150, "{with} with 200 more files, {without} without");
        assert!(before > 0 && fresh() > 0);
    }

    #[test]
    fn dirents_counts_records_and_refuses_malformed_lengths() {
        let rec = |name: &[u8]| {
            let len = (19 + name.len() + 1).div_ceil(8) * 8;
            let mut r = vec![0u8; len];
            r[16..18].copy_from_slice(&(len as u16).to_ne_bytes());
            r[19..19 + name.len()].copy_from_slice(name);
            r
        };
        let b = [rec(b"."), rec(b".."), rec(b"0"), rec(b"17"), rec(b"1023")].concat();
        assert_eq!(dirents(&b), Some(3));
        let mut bad = rec(b"3");
        bad[16..18].copy_from_slice(&4u16.to_ne_bytes());
        assert_eq!(dirents(&bad), None, "a record shorter than its header");
        let mut long = rec(b"3");
        long[16..18].copy_from_slice(&400u16.to_ne_bytes());
        assert_eq!(dirents(&long), None, "a record past the buffer");
    }

    #[test]
    fn fstat_of_a_file_is_its_length_and_type() {
        let f = std::fs::File::open("/proc/self/exe").unwrap();
        let st = fstat(&f).unwrap();
        assert_eq!(st.st_size as u64, f.metadata().unwrap().len());
        assert_eq!(st.st_mode & libc::S_IFMT, libc::S_IFREG);
        let e = fstat(&-1).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::EBADF));
    }
}
