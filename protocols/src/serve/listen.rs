//! The socket file of `iopath serve --socket PATH`: what may stand at PATH
//! before the process binds it, and that it is gone once the process is.
//!
//! - Nothing at PATH: bound.
//! - Anything but a socket (a disk image named by a typo, a directory, a
//!   symbolic link, whatever it points to): refused with an error naming it;
//!   nothing is touched.
//! - A socket some process still has bound (another `iopath serve`, QEMU,
//!   SPDK, a libvfio-user server): refused.
//! - A socket no process has bound any more (a server that died without
//!   cleaning up): stale, replaced.
//!
//! Whether a socket is live is asked of the kernel, not of the socket: a
//! connect, even one closed before a byte is exchanged, is a client to a
//! live server (it accepts it, logs it, may count it as its one client).
//! [`bound_by_anyone`] dumps the host's AF_UNIX sockets with sock_diag
//! (NETLINK_SOCK_DIAG, UNIX_DIAG with the bound file's inode, what `ss -x`
//! reads) and looks for one bound to this file. Not a lock file beside the
//! socket: only servers that know of it take it, so a socket QEMU or SPDK
//! serves would look stale and be deleted, the very mistake this is about.
//! Not /proc/net/unix: it gives the path as it was bound (relative to that
//! server's directory, or through another mount), not the file. The limit:
//! sock_diag sees this network namespace only; a server in another one that
//! shares the file system is not seen, and its socket would be taken for
//! stale. If the kernel cannot be asked (no unix_diag), the socket is left
//! alone and the error says to remove it if it is stale.
//!
//! The socket file is removed when the process ends, however it ends: see
//! the janitor (`janitor.rs`), started as soon as the socket is bound.

use super::janitor::Janitor;
use crate::{Error, Result};
use std::fs::Metadata;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::os::unix::net::UnixListener;
use std::path::Path;

/// A listening socket at a path this process bound, removed when the
/// process ends (this dropped, or the process killed).
pub(crate) struct Bound {
    pub(crate) listener: UnixListener,
    /// Declared after the listener: the socket is closed before its file goes.
    _janitor: Janitor,
}

impl Bound {
    /// Binds `path` as the module doc says: refuses what is not a socket or
    /// a socket in use, replaces a stale one.
    pub(crate) fn new(path: &Path) -> Result<Bound> {
        let listener = bind(path)?;
        let m = std::fs::symlink_metadata(path).map_err(|e| Error::io(format!("{} once bound", path.display()), e))?;
        match Janitor::start(path, m.dev(), m.ino()) {
            Ok(j) => Ok(Bound { listener, _janitor: j }),
            Err(e) => {
                // Not confined yet: the file can still go from here.
                remove_if_same(path, &m);
                Err(Error::io(format!("the janitor that removes {} at exit", path.display()), e))
            }
        }
    }
}

fn bind(path: &Path) -> Result<UnixListener> {
    let cannot = |e| Error::io(format!("cannot listen on {}", path.display()), e);
    match UnixListener::bind(path) {
        Ok(l) => return Ok(l),
        Err(e) if e.kind() == io::ErrorKind::AddrInUse => {}
        Err(e) => return Err(cannot(e)),
    }
    let m = match std::fs::symlink_metadata(path) {
        Ok(m) => m,
        // Gone since: someone else's doing; one more try.
        Err(e) if e.kind() == io::ErrorKind::NotFound => return UnixListener::bind(path).map_err(cannot),
        Err(e) => return Err(Error::io(format!("{} exists but cannot be looked at", path.display()), e)),
    };
    if !m.file_type().is_socket() {
        return Err(Error::Config(format!(
            "{} exists and is {}, not a socket: iopath serve replaces only a stale socket, never anything else \
             (give a path that does not exist)",
            path.display(),
            kind(&m)
        )));
    }
    match bound_by_anyone(path, &m) {
        Ok(false) => {}
        Ok(true) => {
            return Err(Error::Config(format!(
                "{} is a socket another process listens on (another iopath serve?): not replacing it",
                path.display()
            )))
        }
        Err(e) => {
            return Err(Error::Config(format!(
                "{} is a socket, and whether a process listens on it cannot be asked of the kernel \
                 (sock_diag: {e}): remove it if it is stale",
                path.display()
            )))
        }
    }
    // Stale: replaced, if it is still the file looked at.
    let now = std::fs::symlink_metadata(path);
    if let Ok(n) = &now {
        if (n.dev(), n.ino()) != (m.dev(), m.ino()) {
            return Err(Error::Config(format!("{} changed while it was looked at: try again", path.display())));
        }
        std::fs::remove_file(path)
            .map_err(|e| Error::io(format!("cannot replace the stale socket {}", path.display()), e))?;
    }
    log::info!("{}: a stale socket (no process has it bound); replaced", path.display());
    UnixListener::bind(path).map_err(cannot)
}

/// What a file that is not a socket is, for the error.
fn kind(m: &Metadata) -> &'static str {
    let t = m.file_type();
    if t.is_file() {
        "a regular file"
    } else if t.is_dir() {
        "a directory"
    } else if t.is_symlink() {
        "a symbolic link"
    } else if t.is_fifo() {
        "a FIFO"
    } else if t.is_block_device() {
        "a block device"
    } else if t.is_char_device() {
        "a character device"
    } else {
        "not a regular file"
    }
}

/// Removes `path` if it is still the file `m` describes (an error path
/// before the janitor runs).
fn remove_if_same(path: &Path, m: &Metadata) {
    if let Ok(n) = std::fs::symlink_metadata(path) {
        if (n.dev(), n.ino()) == (m.dev(), m.ino()) {
            let _ = std::fs::remove_file(path);
        }
    }
}

// sock_diag for AF_UNIX (linux/sock_diag.h, linux/unix_diag.h).
const SOCK_DIAG_BY_FAMILY: u16 = 20;
const UDIAG_SHOW_NAME: u32 = 0x1;
const UDIAG_SHOW_VFS: u32 = 0x2;
const UNIX_DIAG_NAME: u16 = 0;
const UNIX_DIAG_VFS: u16 = 1;

/// struct unix_diag_req.
#[repr(C)]
struct UnixDiagReq {
    family: u8,
    protocol: u8,
    pad: u16,
    states: u32,
    ino: u32,
    show: u32,
    cookie: [u32; 2],
}

#[repr(C)]
struct Request {
    nlh: libc::nlmsghdr,
    req: UnixDiagReq,
}
const _: () = assert!(std::mem::size_of::<Request>() == 40);

/// struct unix_diag_msg: family, type, state, pad (u8 each), ino, cookie[2].
const DIAG_MSG: usize = 16;
const NLMSG_HDR: usize = std::mem::size_of::<libc::nlmsghdr>();

/// True if some AF_UNIX socket of this network namespace is bound to the
/// file `m` describes (at `path`), whatever its state (listening, or bound
/// and about to).
///
/// The kernel gives each socket's file as its inode (32 bits) and its
/// superblock's device, which is not always the device stat gives (btrfs
/// subvolumes differ): a socket with this inode number counts as bound
/// here if its device matches, or if the path it was bound with is the same
/// file, or cannot tell (relative). Erring that way only leaves a stale
/// socket for the user to remove.
pub(crate) fn bound_by_anyone(path: &Path, m: &Metadata) -> io::Result<bool> {
    // SAFETY: socket(2); the fd is owned at once.
    let fd = unsafe { libc::socket(libc::AF_NETLINK, libc::SOCK_RAW | libc::SOCK_CLOEXEC, libc::NETLINK_SOCK_DIAG) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a new fd nothing else owns.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    // The kernel answers at once; a bound on the wait all the same.
    let tv = libc::timeval { tv_sec: 2, tv_usec: 0 };
    // SAFETY: setsockopt with a timeval of its size.
    unsafe {
        libc::setsockopt(
            fd.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_RCVTIMEO,
            (&tv as *const libc::timeval).cast(),
            std::mem::size_of::<libc::timeval>() as u32,
        )
    };
    // SAFETY: all-zero is a valid nlmsghdr.
    let mut nlh: libc::nlmsghdr = unsafe { std::mem::zeroed() };
    nlh.nlmsg_len = std::mem::size_of::<Request>() as u32;
    nlh.nlmsg_type = SOCK_DIAG_BY_FAMILY;
    nlh.nlmsg_flags = (libc::NLM_F_REQUEST | libc::NLM_F_DUMP) as u16;
    nlh.nlmsg_seq = 1;
    let req = Request {
        nlh,
        req: UnixDiagReq {
            family: libc::AF_UNIX as u8,
            protocol: 0,
            pad: 0,
            states: !0,
            ino: 0,
            show: UDIAG_SHOW_VFS | UDIAG_SHOW_NAME,
            cookie: [0; 2],
        },
    };
    // SAFETY: all-zero is a valid sockaddr_nl (pid 0: the kernel).
    let mut kernel: libc::sockaddr_nl = unsafe { std::mem::zeroed() };
    kernel.nl_family = libc::AF_NETLINK as u16;
    // SAFETY: sendto of the request struct and the address, both of their sizes.
    let sent = unsafe {
        libc::sendto(
            fd.as_raw_fd(),
            (&req as *const Request).cast(),
            std::mem::size_of::<Request>(),
            0,
            (&kernel as *const libc::sockaddr_nl).cast(),
            std::mem::size_of::<libc::sockaddr_nl>() as u32,
        )
    };
    if sent < 0 {
        return Err(io::Error::last_os_error());
    }
    let want = Want { ino: m.ino() as u32, kdev: kernel_dev(m.dev()), dev_ino: (m.dev(), m.ino()), path };
    let mut buf = vec![0u8; 64 << 10];
    let mut found = false;
    loop {
        // SAFETY: recv into a buffer of its length.
        let n = unsafe { libc::recv(fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0) };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        if n == 0 {
            return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "the kernel's answer ended early"));
        }
        match parse(&buf[..n as usize], &want, &mut found)? {
            true => return Ok(found),
            false => continue,
        }
    }
}

/// The file looked for.
struct Want<'a> {
    ino: u32,
    /// Its device as the kernel keeps it (MAJOR << 20 | MINOR).
    kdev: u32,
    dev_ino: (u64, u64),
    path: &'a Path,
}

/// A stat device number as the kernel's superblocks keep it.
fn kernel_dev(dev: u64) -> u32 {
    ((libc::major(dev) as u32) << 20) | (libc::minor(dev) & 0xf_ffff)
}

/// Parses one datagram of the dump; true once NLMSG_DONE came. Sets
/// `found` when a socket bound to the file is in it.
fn parse(mut b: &[u8], want: &Want, found: &mut bool) -> io::Result<bool> {
    let bad = |what: &str| io::Error::new(io::ErrorKind::InvalidData, format!("sock_diag: {what}"));
    while b.len() >= NLMSG_HDR {
        let len = u32::from_ne_bytes(b[0..4].try_into().unwrap()) as usize;
        let ty = u16::from_ne_bytes(b[4..6].try_into().unwrap());
        if len < NLMSG_HDR || len > b.len() {
            return Err(bad("a message longer than what came"));
        }
        let body = &b[NLMSG_HDR..len];
        match ty as i32 {
            libc::NLMSG_DONE => return Ok(true),
            libc::NLMSG_ERROR => {
                let errno = body.get(0..4).map_or(0, |e| i32::from_ne_bytes(e.try_into().unwrap()));
                return Err(if errno < 0 { io::Error::from_raw_os_error(-errno) } else { bad("an error message") });
            }
            _ if ty == SOCK_DIAG_BY_FAMILY && body.len() >= DIAG_MSG && bound_here(&body[DIAG_MSG..], want) => {
                *found = true;
            }
            _ => {}
        }
        let next = len.next_multiple_of(4).min(b.len());
        b = &b[next..];
    }
    Ok(false)
}

/// Whether a socket's attributes (after its unix_diag_msg) say it is bound
/// to the file wanted (see [`bound_by_anyone`]).
fn bound_here(mut a: &[u8], want: &Want) -> bool {
    let (mut vfs, mut name) = (None, None);
    while a.len() >= 4 {
        let len = u16::from_ne_bytes([a[0], a[1]]) as usize;
        let ty = u16::from_ne_bytes([a[2], a[3]]);
        if len < 4 || len > a.len() {
            break;
        }
        let v = &a[4..len];
        match ty {
            UNIX_DIAG_VFS if v.len() >= 8 => {
                let ino = u32::from_ne_bytes(v[0..4].try_into().unwrap());
                let dev = u32::from_ne_bytes(v[4..8].try_into().unwrap());
                vfs = Some((ino, dev));
            }
            UNIX_DIAG_NAME => name = Some(v),
            _ => {}
        }
        a = &a[len.next_multiple_of(4).min(a.len())..];
    }
    let Some((ino, dev)) = vfs else { return false };
    if ino != want.ino {
        return false;
    }
    if dev == want.kdev {
        return true;
    }
    // Another device: the same file only if the path it was bound with is.
    let name = name.map(|n| {
        let end = n.iter().position(|&c| c == 0).unwrap_or(n.len());
        &n[..end]
    });
    match name {
        Some(n) if n.first() == Some(&b'/') => {
            let p = Path::new(std::ffi::OsStr::from_bytes(n));
            p == want.path || std::fs::symlink_metadata(p).is_ok_and(|m| (m.dev(), m.ino()) == want.dev_ino)
        }
        _ => true,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::net::UnixStream;

    /// Waits until no process has the socket at `p` bound: another test's
    /// fork (a janitor's) holds a copy of every fd of this process until its
    /// child closes them. A liveness bound, not a measure.
    fn unbound(p: &Path, m: &Metadata) {
        let t0 = std::time::Instant::now();
        while bound_by_anyone(p, m).unwrap() {
            assert!(t0.elapsed() < std::time::Duration::from_secs(10), "{} still bound", p.display());
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
    }

    /// A scratch directory removed when dropped, a failed assertion included.
    struct Dir(std::path::PathBuf);

    impl std::ops::Deref for Dir {
        type Target = Path;
        fn deref(&self) -> &Path {
            &self.0
        }
    }

    impl Drop for Dir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    fn dir(name: &str) -> Dir {
        let d = std::env::temp_dir().join(format!("iopath-listen-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        Dir(d)
    }

    #[test]
    fn the_kernel_tells_a_bound_socket_from_a_stale_one() {
        let d = dir("diag");
        let p = d.join("s.sock");
        let l = UnixListener::bind(&p).unwrap();
        let m = std::fs::symlink_metadata(&p).unwrap();
        assert!(bound_by_anyone(&p, &m).unwrap(), "a listening socket");
        // The same file through another spelling of its path.
        let other = d.join(".").join("s.sock");
        assert!(bound_by_anyone(&other, &std::fs::symlink_metadata(&other).unwrap()).unwrap());
        drop(l);
        unbound(&p, &m); // a socket nobody has bound any more
    }

    #[test]
    fn a_file_that_is_not_a_socket_is_refused_and_left_as_it_was() {
        let d = dir("file");
        let p = d.join("disk.img");
        std::fs::write(&p, b"a disk image").unwrap();
        let e = bind(&p).unwrap_err().to_string();
        assert!(e.contains("disk.img") && e.contains("a regular file"), "{e}");
        assert_eq!(std::fs::read(&p).unwrap(), b"a disk image");
        std::os::unix::fs::symlink(&p, d.join("link")).unwrap();
        let e = bind(&d.join("link")).unwrap_err().to_string();
        assert!(e.contains("a symbolic link"), "{e}");
        assert!(bind(&d).unwrap_err().to_string().contains("a directory"));
    }

    #[test]
    fn a_live_socket_is_refused_and_a_stale_one_replaced() {
        let d = dir("live");
        let p = d.join("s.sock");
        let live = UnixListener::bind(&p).unwrap();
        live.set_nonblocking(true).unwrap();
        let e = bind(&p).unwrap_err().to_string();
        assert!(e.contains("another process listens"), "{e}");
        // Nobody connected to find out.
        assert_eq!(live.accept().unwrap_err().kind(), io::ErrorKind::WouldBlock, "the check connected");
        drop(live);
        unbound(&p, &std::fs::symlink_metadata(&p).unwrap());
        assert!(UnixStream::connect(&p).is_err(), "a stale socket refuses connections");
        let l = bind(&p).unwrap();
        assert!(UnixStream::connect(&p).is_ok(), "the stale socket is replaced by a live one");
        drop(l);
    }

    #[test]
    fn the_socket_file_goes_with_its_server_but_never_a_file_put_there_since() {
        let d = dir("bound");
        let p = d.join("s.sock");
        let b = Bound::new(&p).unwrap();
        assert!(p.exists());
        drop(b);
        assert!(!p.exists(), "the socket file outlived its server");
        // Replaced behind the server's back: the new file is not its to remove.
        let b = Bound::new(&p).unwrap();
        std::fs::remove_file(&p).unwrap();
        std::fs::write(&p, b"not the server's").unwrap();
        drop(b);
        assert_eq!(std::fs::read(&p).unwrap(), b"not the server's");
    }
}
