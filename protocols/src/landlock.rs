//! Landlock for `iopath serve`: once the device process is set up (its
//! socket bound, its backend file open), [`deny_all`] takes every file
//! system access by path away from it: a ruleset that handles every access
//! right the kernel knows and grants none (no rules). An open, a directory
//! listing, a file created, removed or truncated by path, an exec: each is
//! refused with EACCES, whatever the path and whoever asks (a thread, or an
//! io_uring operation the process submits: both act with its credentials).
//! Where the kernel knows them it also takes TCP bind/connect (ABI 4) and
//! abstract UNIX sockets and signals outside the process's domain (ABI 6).
//!
//! Landlock restricts the calling thread and the threads it starts after,
//! so `crate::seccomp::install` calls it before any thread of the device
//! process is started; a thread that already runs is confined by seccomp
//! only (logged). Landlock does not cover `stat`, `access` or `readlink` of
//! a path: the seccomp filters allow none of them.
//!
//! Raw system calls through `libc`, not the `landlock` crate: the one
//! policy needed, deny everything, takes a ruleset attribute and two
//! calls, and the crate's value (rules per path, best-effort compatibility
//! across ABIs) would go unused.

use crate::{Error, Result};

/// The last access right of each ABI version: every right up to it.
const FS_ABI1: u64 = (1 << 13) - 1; // EXECUTE .. MAKE_SYM
const FS_REFER: u64 = 1 << 13; // ABI 2
const FS_TRUNCATE: u64 = 1 << 14; // ABI 3
const FS_IOCTL_DEV: u64 = 1 << 15; // ABI 5
const NET_BIND_CONNECT_TCP: u64 = 0b11; // ABI 4
const SCOPE_ABSTRACT_UNIX_SIGNAL: u64 = 0b11; // ABI 6
const CREATE_RULESET_VERSION: libc::c_ulong = 1;

/// `struct landlock_ruleset_attr` (ABI 6 layout; an older kernel takes the
/// larger struct as long as the fields it does not know are 0).
#[repr(C)]
#[derive(Debug, Default, PartialEq, Eq)]
struct RulesetAttr {
    handled_access_fs: u64,
    handled_access_net: u64,
    scoped: u64,
}

/// Everything ABI `abi` can refuse.
fn handled(abi: u32) -> RulesetAttr {
    let mut fs = FS_ABI1;
    for (v, right) in [(2, FS_REFER), (3, FS_TRUNCATE), (5, FS_IOCTL_DEV)] {
        if abi >= v {
            fs |= right;
        }
    }
    RulesetAttr {
        handled_access_fs: fs,
        handled_access_net: if abi >= 4 { NET_BIND_CONNECT_TCP } else { 0 },
        scoped: if abi >= 6 { SCOPE_ABSTRACT_UNIX_SIGNAL } else { 0 },
    }
}

/// Why the kernel offers no Landlock.
#[derive(Debug, thiserror::Error)]
pub enum NoLandlock {
    #[error("this kernel has no Landlock (Linux 5.13, CONFIG_SECURITY_LANDLOCK)")]
    NotBuilt,
    #[error("Landlock is off on this kernel (not in the lsm= boot parameter)")]
    Off,
    #[error("Landlock: {0}")]
    Refused(std::io::Error),
}

/// The kernel's Landlock ABI version, or why there is none.
pub fn abi() -> std::result::Result<u32, NoLandlock> {
    // SAFETY: with a null attribute and size 0 the call only returns the version.
    let v = unsafe {
        libc::syscall(libc::SYS_landlock_create_ruleset, std::ptr::null::<RulesetAttr>(), 0, CREATE_RULESET_VERSION)
    };
    if v >= 1 {
        return Ok(v as u32);
    }
    let e = std::io::Error::last_os_error();
    Err(match e.raw_os_error() {
        Some(libc::ENOSYS) => NoLandlock::NotBuilt,
        Some(libc::EOPNOTSUPP) => NoLandlock::Off,
        _ => NoLandlock::Refused(e),
    })
}

/// Takes every file system access by path away from this thread and the
/// threads it starts from now on. Some(ABI version) when it is enforced,
/// None (logged) where the kernel has no Landlock.
pub fn deny_all() -> Result<Option<u32>> {
    let abi = match abi() {
        Ok(v) => v,
        Err(why) => {
            log::warn!("iopath serve: {why}: files are refused by path by seccomp alone");
            return Ok(None);
        }
    };
    let threads = std::fs::read_dir("/proc/self/task").map(|d| d.count()).unwrap_or(1);
    if threads > 1 {
        log::warn!(
            "iopath serve: Landlock confines the threads started from now on; {} started before are \
             confined by seccomp alone",
            threads - 1
        );
    }
    let attr = handled(abi);
    let err = |what: &str| Error::io(format!("Landlock: {what}"), std::io::Error::last_os_error());
    // SAFETY: the attribute is a live struct of the size given.
    let fd = unsafe {
        libc::syscall(libc::SYS_landlock_create_ruleset, &attr as *const RulesetAttr, std::mem::size_of_val(&attr), 0)
    };
    if fd < 0 {
        return Err(err("creating the ruleset"));
    }
    // SAFETY: a fresh fd of ours, closed when this goes.
    let fd = unsafe { <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd as i32) };
    // Landlock needs no_new_privs (or CAP_SYS_ADMIN); seccomp needs it too.
    // SAFETY: prctl with plain values.
    if unsafe { libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) } != 0 {
        return Err(err("no_new_privs"));
    }
    // SAFETY: restrict_self with the ruleset's fd and no flags.
    let r = unsafe { libc::syscall(libc::SYS_landlock_restrict_self, std::os::fd::AsRawFd::as_raw_fd(&fd), 0) };
    if r != 0 {
        return Err(err("restricting the process"));
    }
    Ok(Some(abi))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_abi_handles_the_rights_it_knows() {
        assert_eq!(handled(1), RulesetAttr { handled_access_fs: 0x1fff, handled_access_net: 0, scoped: 0 });
        assert_eq!(handled(3).handled_access_fs, 0x7fff);
        assert_eq!(handled(4), RulesetAttr { handled_access_fs: 0x7fff, handled_access_net: 3, scoped: 0 });
        assert_eq!(handled(7), RulesetAttr { handled_access_fs: 0xffff, handled_access_net: 3, scoped: 3 });
    }

    /// In a thread of its own (Landlock confines the thread that asks and
    /// those it starts): opens and listings by path are refused, an fd
    /// opened before still reads. A stat is not Landlock's: seccomp's.
    #[test]
    fn a_confined_thread_opens_nothing_by_path() {
        let Ok(_) = abi() else {
            eprintln!("no Landlock here: nothing to check");
            return;
        };
        let before = std::fs::File::open("/proc/self/status").unwrap();
        let got = std::thread::spawn(move || {
            assert!(deny_all().unwrap().is_some());
            let code = |r: std::io::Result<()>| r.err().and_then(|e| e.raw_os_error());
            let read = std::io::Read::read(&mut &before, &mut [0u8; 16]).map(|_| ());
            let open = std::fs::File::open("/etc/hostname").map(|_| ());
            let list = std::fs::read_dir("/").map(|_| ());
            let child = std::thread::spawn(|| std::fs::File::open("/proc/self/status").map(|_| ())).join().unwrap();
            [code(read), code(open), code(list), code(child)]
        })
        .join()
        .unwrap();
        let eacces = Some(libc::EACCES);
        assert_eq!(got, [None, eacces, eacces, eacces], "read of an open fd, open, listing, open in a child thread");
        // This thread was not confined.
        assert!(std::fs::File::open("/etc/hostname").is_ok());
    }
}
