//! Message I/O on an AF_UNIX stream socket with file descriptors passed as
//! SCM_RIGHTS, shared by every protocol, and the receive polling budget
//! (`--spin-us`). Plain `io::Result`: the protocols add what was being read.
//!
//! A message is read whole: the fixed-size header first (fds travel with its
//! first byte), then the body. Received fds are owned [`File`]s at once, so
//! an error path closes them.

use std::fs::File;
use std::io::{self, IoSlice, Read, Write};
use std::os::fd::{FromRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};
use vmm_sys_util::sock_ctrl_msg::ScmSocket;

/// Most fds accepted with one message; more is a protocol error.
pub const MAX_FDS: usize = 16;

/// How long a receiver polls its socket before it sleeps in the kernel
/// (0: it sleeps at once, as QEMU does). Polling keeps the thread on its
/// CPU, so a reply that comes within the budget costs no wake-up.
static SPIN_NS: AtomicU64 = AtomicU64::new(0);

/// Sets the polling budget of every receive in this process.
pub fn set_spin(d: Duration) {
    SPIN_NS.store(d.as_nanos().min(u64::MAX as u128) as u64, Ordering::Relaxed);
}

/// Polls `fd` for input for up to the spin budget; returns early when
/// input is there. The caller then does its (blocking) read.
pub fn spin_until_readable(fd: std::os::fd::RawFd) {
    let budget = SPIN_NS.load(Ordering::Relaxed);
    if budget == 0 {
        return;
    }
    let t0 = Instant::now();
    let mut p = libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
    loop {
        // SAFETY: one valid pollfd on the stack; timeout 0 never blocks.
        if unsafe { libc::poll(&mut p, 1, 0) } != 0 || t0.elapsed().as_nanos() as u64 >= budget {
            return;
        }
        std::hint::spin_loop();
    }
}

/// Sends `parts` as one message with `fds` attached to its first byte.
pub fn send(sock: &UnixStream, parts: &[&[u8]], fds: &[RawFd]) -> io::Result<()> {
    let total: usize = parts.iter().map(|p| p.len()).sum();
    let sent = if fds.is_empty() {
        let slices: Vec<IoSlice> = parts.iter().map(|p| IoSlice::new(p)).collect();
        (&*sock).write_vectored(&slices)?
    } else {
        sock.send_with_fds(parts, fds).map_err(|e| io::Error::from_raw_os_error(e.errno()))?
    };
    if sent < total {
        // A short stream write: the rest goes without fds.
        let mut rest = Vec::with_capacity(total - sent);
        parts.iter().for_each(|p| rest.extend_from_slice(p));
        (&*sock).write_all(&rest[sent..])?;
    }
    Ok(())
}

/// Reads exactly `buf.len()` bytes; fds that arrive with them are returned.
/// End of stream before the first byte is `UnexpectedEof` with no data read.
pub fn recv_exact(sock: &UnixStream, buf: &mut [u8]) -> io::Result<Vec<File>> {
    if buf.is_empty() {
        return Ok(Vec::new()); // a zero-length recvmsg would wait for data
    }
    spin_until_readable(std::os::fd::AsRawFd::as_raw_fd(sock));
    let mut fds = [-1 as RawFd; MAX_FDS + 1];
    let mut iov = [libc::iovec { iov_base: buf.as_mut_ptr().cast(), iov_len: buf.len() }];
    // SAFETY: the iovec points into `buf`, which is borrowed mutably for the call.
    let (n, nfds) = loop {
        match unsafe { sock.recv_with_fds(&mut iov, &mut fds) } {
            Ok(r) => break r,
            Err(e) if e.errno() == libc::EINTR => continue,
            Err(e) => return Err(io::Error::from_raw_os_error(e.errno())),
        }
    };
    // SAFETY: recvmsg gave us these `nfds` descriptors; nothing else owns them.
    let files: Vec<File> = fds[..nfds].iter().map(|&fd| unsafe { File::from_raw_fd(fd) }).collect();
    if n == 0 && !buf.is_empty() {
        return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "peer closed the socket"));
    }
    if nfds > MAX_FDS {
        return Err(io::Error::new(io::ErrorKind::InvalidData, format!("{nfds} fds with one message")));
    }
    (&*sock).read_exact(&mut buf[n..])?;
    Ok(files)
}

/// True once the peer has closed its end (POLLHUP/POLLRDHUP), without
/// consuming any data. `timeout_ms` as for poll(2).
pub fn peer_closed(sock: &UnixStream, timeout_ms: i32) -> bool {
    use std::os::fd::AsRawFd;
    let mut p = libc::pollfd { fd: sock.as_raw_fd(), events: libc::POLLRDHUP, revents: 0 };
    // SAFETY: one valid pollfd on the stack.
    let r = unsafe { libc::poll(&mut p, 1, timeout_ms) };
    r > 0 && p.revents & (libc::POLLHUP | libc::POLLRDHUP | libc::POLLERR | libc::POLLNVAL) != 0
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsRawFd;

    #[test]
    fn header_body_and_fds_arrive_together() {
        let (a, b) = UnixStream::pair().unwrap();
        let f = File::open("/dev/null").unwrap();
        send(&a, &[b"head", b"body!"], &[f.as_raw_fd(), f.as_raw_fd()]).unwrap();
        let mut h = [0u8; 4];
        let fds = recv_exact(&b, &mut h).unwrap();
        assert_eq!((&h, fds.len()), (b"head", 2));
        let mut body = [0u8; 5];
        assert!(recv_exact(&b, &mut body).unwrap().is_empty());
        assert_eq!(&body, b"body!");
        assert!(!peer_closed(&b, 0));
        drop(a);
        assert!(peer_closed(&b, 0));
        assert_eq!(recv_exact(&b, &mut h).unwrap_err().kind(), io::ErrorKind::UnexpectedEof);
    }

    #[test]
    fn too_many_fds_is_an_error_and_closes_them() {
        let (a, b) = UnixStream::pair().unwrap();
        let f = File::open("/dev/null").unwrap();
        let fds = vec![f.as_raw_fd(); MAX_FDS + 1];
        send(&a, &[b"x"], &fds).unwrap();
        let mut h = [0u8; 1];
        assert_eq!(recv_exact(&b, &mut h).unwrap_err().kind(), io::ErrorKind::InvalidData);
    }
}
